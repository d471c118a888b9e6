//! The Agones GameServer controller: GameServer ↔ pod, states, eviction.safe and the PDB.
//!
//! What it reproduces (gce-gke-agones.md §4):
//! - defaults (what Agones' mutating webhook does): finalizer `agones.dev/controller`,
//!   state `Creating`, `spec.eviction.safe` (Never, or Always when the pod template says
//!   `cluster-autoscaler.kubernetes.io/safe-to-evict: "true"`), copied to `status.eviction`;
//! - the pod: same name and namespace, labels `agones.dev/role=gameserver` and
//!   `agones.dev/gameserver=<name>` plus the template's, the eviction annotation and label
//!   (only where the template did not set them), a controller ownerRef to the GameServer;
//! - states: Creating → Starting (pod created) → Scheduled (pod bound, `status.nodeName`)
//!   → Ready (pod running; the game's SDK `Ready()` is instant unless the GameServer asks
//!   for a manual one) → Allocated/Reserved (allocator, SDK) → Shutdown (SDK) → deleted;
//! - a pod that is gone (or finished) while its GameServer is not being deleted makes the
//!   GameServer Unhealthy, even an Allocated one;
//! - a deleted GameServer: the pod gets a plain DELETE (its own grace period applies), the
//!   finalizer is removed once the pod is gone, and `status.state` is left as it was
//!   (agones#3159);
//! - pods whose GameServer no longer exists are garbage-collected.

use std::collections::{HashMap, HashSet};

use serde_json::{Map, Value, json};

use crate::kube::resources::{GAMESERVERS, NODES, PDBS, PODS};
use crate::kube::status::ApiError;
use crate::kube::store::{DeleteOptions, Store};

use super::objects::{
    EvictionSafe, GameServerState, GameServerView, NodeInfo, PodInfo, PodPhase, SDK_VERSION, keys,
};
use super::writes::{list_parsed, object_at, report};

/// Creates the Agones PDB in each namespace (the chart installs one per
/// `gameservers.namespaces` entry); an existing one is left alone.
pub(crate) fn ensure_pdbs(store: &Store, namespaces: &[String]) -> Result<(), ApiError> {
    for ns in namespaces {
        if store.get(&PDBS, Some(ns), keys::AGONES_PDB).is_some() {
            continue;
        }
        match store.create(&PDBS, Some(ns), agones_pdb(ns)) {
            Ok(_) => {}
            Err(e) if e.reason == "AlreadyExists" => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The `agones-gameserver-safe-to-evict-false` PDB of the Agones chart.
pub fn agones_pdb(ns: &str) -> Value {
    json!({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": keys::AGONES_PDB,
            "namespace": ns,
            "labels": { "app": "agones" },
        },
        "spec": {
            "maxUnavailable": "0%",
            "selector": { "matchLabels": { keys::SAFE_TO_EVICT_LABEL: "false" } },
        },
    })
}

/// One pass of the GameServer controller over every GameServer and GameServer pod.
pub(crate) fn run(store: &Store) {
    let pods: HashMap<(String, String), PodInfo> = list_parsed(store, &PODS, PodInfo::parse)
        .into_iter()
        .map(|(p, _)| ((p.namespace.clone(), p.name.clone()), p))
        .collect();
    let nodes: HashMap<String, NodeInfo> = list_parsed(store, &NODES, NodeInfo::parse)
        .into_iter()
        .map(|(n, _)| (n.name.clone(), n))
        .collect();
    let gameservers = list_parsed(store, &GAMESERVERS, GameServerView::parse);
    let live: HashSet<&str> = gameservers.iter().map(|(gs, _)| gs.uid.as_str()).collect();
    for (gs, raw) in &gameservers {
        let pod = pods
            .get(&(gs.namespace.clone(), gs.name.clone()))
            .filter(|p| p.owner_gameserver_uid.as_deref() == Some(gs.uid.as_str()));
        reconcile(store, gs, raw, pod, &nodes);
    }
    for pod in pods.values() {
        if let Some(owner) = &pod.owner_gameserver_uid
            && !live.contains(owner.as_str())
            && !pod.deleting
        {
            delete_pod(store, pod, "delete orphaned gameserver pod");
        }
    }
}

fn reconcile(
    store: &Store,
    gs: &GameServerView,
    raw: &Value,
    pod: Option<&PodInfo>,
    nodes: &HashMap<String, NodeInfo>,
) {
    if gs.deleting {
        return finalize(store, gs, pod);
    }
    if needs_defaults(gs) {
        return apply_defaults(store, gs);
    }
    let Some(state) = gs.state else { return };
    use GameServerState as S;
    match state {
        S::Shutdown => {
            // SDK Shutdown(): the controller deletes the GameServer (and so its pod).
            let opts = DeleteOptions {
                precondition_uid: Some(gs.uid.clone()),
                ..Default::default()
            };
            report(
                "delete shutdown gameserver",
                &gs.namespace,
                &gs.name,
                store.delete(&GAMESERVERS, Some(&gs.namespace), &gs.name, &opts),
            );
        }
        S::Unhealthy | S::Error => {}
        S::PortAllocation | S::Creating => match pod {
            Some(_) => transition(store, gs, state, S::Starting, |_| {}),
            None => {
                let res = store.create(&PODS, Some(&gs.namespace), build_pod(gs, raw));
                if report("create gameserver pod", &gs.namespace, &gs.name, res) {
                    transition(store, gs, state, S::Starting, |_| {});
                }
            }
        },
        _ => {
            let Some(pod) = pod.filter(|p| !p.phase.is_finished()) else {
                // The pod was deleted, evicted or its game ended: Agones' HealthController
                // (and MissingPodController) mark the GameServer Unhealthy.
                return transition(store, gs, state, S::Unhealthy, |_| {});
            };
            match state {
                S::Starting => {
                    if let Some(node) = &pod.node {
                        let address = nodes.get(node).and_then(|n| n.internal_ip.clone());
                        let node = node.clone();
                        transition(store, gs, state, S::Scheduled, move |obj| {
                            let status = object_at(obj, &["status"]);
                            status.insert("nodeName".into(), json!(node));
                            if let Some(ip) = address {
                                status.insert("address".into(), json!(ip));
                                status.insert(
                                    "addresses".into(),
                                    json!([{ "type": "InternalIP", "address": ip }]),
                                );
                            }
                        });
                    }
                }
                S::Scheduled if pod.phase == PodPhase::Running && !manual_ready(gs) => {
                    transition(store, gs, state, S::Ready, |_| {});
                }
                S::RequestReady if pod.phase == PodPhase::Running => {
                    transition(store, gs, state, S::Ready, |_| {});
                }
                _ => {}
            }
        }
    }
}

/// A GameServer being deleted: delete its pod, wait for it to go, then let go.
fn finalize(store: &Store, gs: &GameServerView, pod: Option<&PodInfo>) {
    if !gs
        .finalizers
        .iter()
        .any(|f| f == keys::GAMESERVER_FINALIZER)
    {
        return;
    }
    match pod {
        Some(p) if !p.deleting => delete_pod(store, p, "delete pod of deleted gameserver"),
        Some(_) => {}
        None => {
            let uid = gs.uid.clone();
            let res = store.modify(&GAMESERVERS, Some(&gs.namespace), &gs.name, |obj| {
                if obj.pointer("/metadata/uid").and_then(Value::as_str) != Some(uid.as_str()) {
                    return Ok(());
                }
                if let Some(Value::Array(fs)) = obj.pointer_mut("/metadata/finalizers") {
                    fs.retain(|f| f.as_str() != Some(keys::GAMESERVER_FINALIZER));
                }
                Ok(())
            });
            report("remove gameserver finalizer", &gs.namespace, &gs.name, res);
        }
    }
}

fn delete_pod(store: &Store, pod: &PodInfo, action: &'static str) {
    let opts = DeleteOptions {
        precondition_uid: Some(pod.uid.clone()),
        ..Default::default()
    };
    report(
        action,
        &pod.namespace,
        &pod.name,
        store.delete(&PODS, Some(&pod.namespace), &pod.name, &opts),
    );
}

fn needs_defaults(gs: &GameServerView) -> bool {
    gs.state.is_none()
        || !gs
            .finalizers
            .iter()
            .any(|f| f == keys::GAMESERVER_FINALIZER)
        || gs.eviction_spec.is_none()
        || gs.eviction_status != gs.eviction_spec
}

/// `eviction.safe` when the spec leaves it out: Always if the pod template already says
/// the cluster autoscaler may evict, otherwise Agones' default Never.
fn default_eviction(raw: &Value) -> EvictionSafe {
    let ca = raw
        .pointer("/spec/template/metadata/annotations")
        .and_then(|a| a.get(keys::CA_SAFE_TO_EVICT))
        .and_then(Value::as_str);
    if ca == Some("true") {
        EvictionSafe::Always
    } else {
        EvictionSafe::Never
    }
}

/// What Agones' mutating webhook and first sync fill in.
fn apply_defaults(store: &Store, gs: &GameServerView) {
    let uid = gs.uid.clone();
    let res = store.modify(&GAMESERVERS, Some(&gs.namespace), &gs.name, |obj| {
        if obj.pointer("/metadata/uid").and_then(Value::as_str) != Some(uid.as_str())
            || obj.pointer("/metadata/deletionTimestamp").is_some()
        {
            return Ok(());
        }
        let current = GameServerView::parse(obj)
            .map_err(|e| ApiError::invalid("GameServer.agones.dev", &uid, &e.to_string()))?;
        let safe = current
            .eviction_spec
            .unwrap_or_else(|| default_eviction(obj));
        let meta = object_at(obj, &["metadata"]);
        let finalizers = meta.entry("finalizers").or_insert_with(|| json!([]));
        if !finalizers.is_array() {
            *finalizers = json!([]);
        }
        if let Value::Array(fs) = finalizers
            && !fs
                .iter()
                .any(|f| f.as_str() == Some(keys::GAMESERVER_FINALIZER))
        {
            fs.push(json!(keys::GAMESERVER_FINALIZER));
        }
        object_at(obj, &["spec", "eviction"]).insert("safe".into(), json!(safe.as_str()));
        object_at(obj, &["status", "eviction"]).insert("safe".into(), json!(safe.as_str()));
        let status = object_at(obj, &["status"]);
        if current.state.is_none() {
            status.insert("state".into(), json!(GameServerState::Creating.as_str()));
        }
        Ok(())
    });
    report("default gameserver", &gs.namespace, &gs.name, res);
}

/// Moves `gs` from `from` to `to`, unless it changed meanwhile (another state, deleted,
/// recreated); `extra` sets further status fields in the same write.
pub(crate) fn transition(
    store: &Store,
    gs: &GameServerView,
    from: GameServerState,
    to: GameServerState,
    extra: impl FnOnce(&mut Value),
) {
    let uid = gs.uid.clone();
    let res = store.modify(&GAMESERVERS, Some(&gs.namespace), &gs.name, |obj| {
        let Ok(current) = GameServerView::parse(obj) else {
            return Ok(());
        };
        if current.uid != uid || current.deleting || current.state != Some(from) {
            return Ok(());
        }
        object_at(obj, &["status"]).insert("state".into(), json!(to.as_str()));
        extra(obj);
        Ok(())
    });
    report("gameserver state change", &gs.namespace, &gs.name, res);
}

fn manual_ready(gs: &GameServerView) -> bool {
    gs.annotations
        .get(keys::SDK_READY_ANNOTATION)
        .map(String::as_str)
        == Some(keys::SDK_READY_MANUAL)
}

/// The GameServer's pod, as Agones' `GameServer.Pod()` builds it from `spec.template`.
fn build_pod(gs: &GameServerView, raw: &Value) -> Value {
    let template = raw
        .pointer("/spec/template")
        .cloned()
        .unwrap_or_else(|| json!({}));
    let mut meta: Map<String, Value> = template
        .get("metadata")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let mut spec: Map<String, Value> = template
        .get("spec")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let has_containers = spec
        .get("containers")
        .and_then(Value::as_array)
        .is_some_and(|c| !c.is_empty());
    if !has_containers {
        spec.insert(
            "containers".into(),
            json!([{ "name": "gameserver", "image": "gameserver" }]),
        );
    }
    let container = raw
        .pointer("/spec/container")
        .and_then(Value::as_str)
        .map(str::to_string)
        .or_else(|| {
            spec.get("containers")
                .and_then(|c| c.get(0))
                .and_then(|c| c.get("name"))
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .unwrap_or_default();
    let safe = gs
        .eviction_status
        .or(gs.eviction_spec)
        .unwrap_or_else(|| default_eviction(raw));

    let labels = string_map(&mut meta, "labels");
    labels.insert(keys::ROLE_LABEL.into(), json!(keys::ROLE_GAMESERVER));
    labels.insert(keys::GAMESERVER_LABEL.into(), json!(gs.name));
    labels
        .entry(keys::SAFE_TO_EVICT_LABEL)
        .or_insert_with(|| json!(safe.safe_to_evict_label()));
    let annotations = string_map(&mut meta, "annotations");
    annotations.insert(keys::CONTAINER_ANNOTATION.into(), json!(container));
    annotations.insert(keys::SDK_VERSION_ANNOTATION.into(), json!(SDK_VERSION));
    annotations
        .entry(keys::CA_SAFE_TO_EVICT)
        .or_insert_with(|| json!(safe.ca_annotation()));
    meta.insert("name".into(), json!(gs.name));
    meta.insert("namespace".into(), json!(gs.namespace));
    meta.remove("generateName");
    meta.insert(
        "ownerReferences".into(),
        json!([{
            "apiVersion": "agones.dev/v1",
            "kind": "GameServer",
            "name": gs.name,
            "uid": gs.uid,
            "controller": true,
            "blockOwnerDeletion": true,
        }]),
    );
    json!({ "apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec })
}

/// `meta[key]` as a map, created when missing or not a map.
fn string_map<'a>(meta: &'a mut Map<String, Value>, key: &str) -> &'a mut Map<String, Value> {
    let v = meta.entry(key).or_insert_with(|| json!({}));
    if !v.is_object() {
        *v = json!({});
    }
    match v {
        Value::Object(m) => m,
        _ => unreachable!("made an object above"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(raw: &Value) -> GameServerView {
        GameServerView::parse(raw).unwrap()
    }

    #[test]
    fn pod_carries_agones_labels_and_eviction_mapping() {
        let raw = json!({
            "metadata": {"name": "gs-1", "namespace": "ns", "uid": "u1"},
            "spec": {
                "eviction": {"safe": "OnUpgrade"},
                "template": {
                    "metadata": {"labels": {"app": "game"}},
                    "spec": {"containers": [{"name": "game", "image": "x"}], "terminationGracePeriodSeconds": 5}
                }
            },
            "status": {"state": "Creating", "eviction": {"safe": "OnUpgrade"}}
        });
        let pod = build_pod(&view(&raw), &raw);
        assert_eq!(pod["metadata"]["name"], "gs-1");
        assert_eq!(pod["metadata"]["labels"]["app"], "game");
        assert_eq!(pod["metadata"]["labels"][keys::ROLE_LABEL], "gameserver");
        assert_eq!(pod["metadata"]["labels"][keys::GAMESERVER_LABEL], "gs-1");
        assert_eq!(pod["metadata"]["labels"][keys::SAFE_TO_EVICT_LABEL], "true");
        assert_eq!(
            pod["metadata"]["annotations"][keys::CA_SAFE_TO_EVICT],
            "false"
        );
        assert_eq!(
            pod["metadata"]["annotations"][keys::CONTAINER_ANNOTATION],
            "game"
        );
        assert_eq!(pod["metadata"]["ownerReferences"][0]["uid"], "u1");
        assert_eq!(pod["metadata"]["ownerReferences"][0]["controller"], true);
        assert_eq!(pod["spec"]["terminationGracePeriodSeconds"], 5);
    }

    #[test]
    fn template_values_win_over_eviction_mapping() {
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
}
