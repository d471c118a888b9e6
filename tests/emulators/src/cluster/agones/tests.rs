use std::collections::HashMap;

use serde_json::{Value, json};

use super::sdk::{self, Call, Outcome};
use super::*;

fn view(raw: &Value) -> GameServerView {
    GameServerView::parse(raw).unwrap()
}

fn server(state: &str, safe: &str) -> Value {
    json!({
        "metadata": {"name": "gs-1", "namespace": "ns", "uid": "u1", "resourceVersion": "7",
                     "finalizers": [keys::GAMESERVER_FINALIZER]},
        "spec": {"eviction": {"safe": safe},
                 "template": {"spec": {"containers": [{"name": "game", "image": "x"}]}}},
        "status": {"state": state, "eviction": {"safe": safe}},
    })
}

fn pod(phase: &str, deleting: bool) -> PodInfo {
    let mut p = json!({
        "metadata": {"name": "gs-1", "namespace": "ns", "uid": "p1",
                     "ownerReferences": [{"apiVersion": "agones.dev/v1", "kind": "GameServer",
                                          "name": "gs-1", "uid": "u1", "controller": true}]},
        "spec": {"nodeName": "n1", "containers": [{"name": "game", "image": "x"}]},
        "status": {"phase": phase},
    });
    if deleting {
        p["metadata"]["deletionTimestamp"] = json!("2030-01-01T00:00:00Z");
    }
    PodInfo::parse(&p).unwrap()
}

fn deleting(mut raw: Value) -> Value {
    raw["metadata"]["deletionTimestamp"] = json!("2030-01-01T00:00:00Z");
    raw
}

fn decide_on(raw: &Value, pod: Option<&PodInfo>) -> Option<Step> {
    decide(&view(raw), raw, pod, &HashMap::new())
}

#[test]
fn the_pod_carries_agones_labels_and_the_eviction_table() {
    // pkg/cloudproduct/eviction/eviction.go: (annotation, label) by eviction.safe.
    for (safe, ca, label) in [
        ("Never", "false", "false"),
        ("OnUpgrade", "false", "true"),
        ("Always", "true", "true"),
    ] {
        let raw = server("Creating", safe);
        let pod = build_pod(&view(&raw), &raw);
        assert_eq!(
            pod["metadata"]["labels"][keys::SAFE_TO_EVICT_LABEL],
            label,
            "{safe}"
        );
        assert_eq!(
            pod["metadata"]["annotations"][keys::CA_SAFE_TO_EVICT],
            ca,
            "{safe}"
        );
        assert_eq!(pod["metadata"]["name"], "gs-1");
        assert_eq!(pod["metadata"]["labels"][keys::ROLE_LABEL], "gameserver");
        assert_eq!(pod["metadata"]["labels"][keys::GAMESERVER_LABEL], "gs-1");
        assert_eq!(
            pod["metadata"]["annotations"][keys::CONTAINER_ANNOTATION],
            "game"
        );
        assert_eq!(pod["metadata"]["ownerReferences"][0]["uid"], "u1");
        assert_eq!(pod["metadata"]["ownerReferences"][0]["controller"], true);
        assert_eq!(pod["spec"]["restartPolicy"], "Never");
    }
}

#[test]
fn template_values_win_over_the_eviction_table() {
    let raw = json!({
        "metadata": {"name": "gs-1", "namespace": "ns", "uid": "u1"},
        "spec": {"template": {"metadata": {
            "labels": {keys::SAFE_TO_EVICT_LABEL: "true"},
            "annotations": {keys::CA_SAFE_TO_EVICT: "true"}
        }}}
    });
    assert_eq!(default_eviction(&raw), EvictionSafe::Always);
    let pod = build_pod(&view(&raw), &raw);
    assert_eq!(pod["metadata"]["labels"][keys::SAFE_TO_EVICT_LABEL], "true");
    assert_eq!(
        pod["metadata"]["annotations"][keys::CA_SAFE_TO_EVICT],
        "true"
    );
    assert_eq!(pod["spec"]["containers"][0]["name"], "gameserver");
}

#[test]
fn a_new_server_gets_the_finalizer_creating_and_never() {
    let raw = json!({"metadata": {"name": "gs-1", "namespace": "ns", "uid": "u1"}, "spec": {}});
    let Some(Step::Update { gs, .. }) = decide_on(&raw, None) else {
        panic!("defaults expected");
    };
    assert_eq!(
        gs["metadata"]["finalizers"],
        json!([keys::GAMESERVER_FINALIZER])
    );
    assert_eq!(gs["status"]["state"], "Creating");
    assert_eq!(gs["spec"]["eviction"]["safe"], "Never");
    assert_eq!(gs["status"]["eviction"]["safe"], "Never");
    assert_eq!(
        decide_on(&gs, None).map(|s| matches!(s, Step::CreatePod { .. })),
        Some(true)
    );
}

#[test]
fn the_finalizer_is_held_while_the_pod_exists() {
    let raw = deleting(server("Allocated", "Never"));
    assert_eq!(
        decide_on(&raw, Some(&pod("Running", false))),
        Some(Step::DeletePod)
    );
    assert_eq!(
        decide_on(&raw, Some(&pod("Running", true))),
        None,
        "terminating: wait"
    );
    let Some(Step::Update { gs, .. }) = decide_on(&raw, None) else {
        panic!("the finalizer let go once the pod is gone");
    };
    assert_eq!(gs["metadata"]["finalizers"], json!([]));
    assert_eq!(
        gs["status"]["state"], "Allocated",
        "the state is left as it was"
    );
    assert_eq!(
        gs["metadata"]["resourceVersion"], "7",
        "an update of what was read"
    );
}

#[test]
fn shutdown_deletes_and_a_lost_pod_makes_a_live_server_unhealthy() {
    assert_eq!(
        decide_on(&server("Shutdown", "Never"), Some(&pod("Running", false))),
        Some(Step::DeleteGameServer)
    );
    for state in ["Ready", "Reserved", "Allocated"] {
        let Some(Step::Update { gs, .. }) = decide_on(&server(state, "Never"), None) else {
            panic!("{state}: Unhealthy expected");
        };
        assert_eq!(gs["status"]["state"], "Unhealthy");
        let Some(Step::Update { gs, .. }) =
            decide_on(&server(state, "Never"), Some(&pod("Succeeded", false)))
        else {
            panic!("{state}: a finished pod is Unhealthy too");
        };
        assert_eq!(gs["status"]["state"], "Unhealthy");
        assert_eq!(
            decide_on(&server(state, "Never"), Some(&pod("Running", false))),
            None,
            "{state} is the SDK's or the allocator's, not the controller's"
        );
    }
}

#[test]
fn sdk_calls_leave_a_server_being_deleted_or_unhealthy_alone() {
    let mut ready = server("Ready", "Never");
    assert_eq!(
        sdk::apply(Call::Reserve { seconds: 0 }, &mut ready),
        Ok(Outcome::Written)
    );
    assert_eq!(ready["status"]["state"], "Reserved");
    assert_eq!(ready["status"]["reservedUntil"], Value::Null);
    let mut gone = deleting(server("Allocated", "Never"));
    assert_eq!(sdk::apply(Call::Shutdown, &mut gone), Ok(Outcome::Skipped));
    assert_eq!(gone["status"]["state"], "Allocated");
    let mut sick = server("Unhealthy", "Never");
    assert_eq!(sdk::apply(Call::Shutdown, &mut sick), Ok(Outcome::Skipped));
    let mut starting = server("Starting", "Never");
    assert!(sdk::apply(Call::Allocate, &mut starting).is_err());
}
