//! Conformance of the Kubernetes API emulator: the real `kube::Client` over HTTP, with
//! assertions on status codes, `Status` bodies and stored state, for each semantic the
//! emulator claims (see docs/testing/kube-emulator.md).

use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, EvictParams, ListParams, Patch, PatchParams,
    PostParams, Preconditions, WatchEvent, WatchParams,
};
use kube::core::{GroupVersionKind, Status};
use kube::{Client, ResourceExt};
use lastcall_testkit::bins::workspace_binary;
use lastcall_testkit::eventually::wait_for;
use lastcall_testkit::kube::resources::{CONFIGMAPS, EVENTS_K8S, GAMESERVERS, NODES, PODS};
use lastcall_testkit::kube::{Emulator, FaultAction, FaultRule, Method, Options, Store, Verb};
use lastcall_testkit::process::signal;
use serde_json::{Value, json};

async fn setup() -> (Emulator, Client) {
    let emu = Emulator::start().await.unwrap();
    let client = emu.client().await.unwrap();
    (emu, client)
}

/// A client that shows 429/503 answers instead of retrying them (kube retries by default).
async fn setup_no_retry() -> (Emulator, Client) {
    let emu = Emulator::start().await.unwrap();
    let client = emu.client_no_retry("test").await.unwrap();
    (emu, client)
}

/// Creates `p`, then writes its status through `/status` as its kubelet would: a create
/// never keeps a pod's status.
async fn create_pod(pods: &Api<Pod>, p: &Pod) -> kube::Result<Pod> {
    let created = pods.create(&PostParams::default(), p).await?;
    match &p.status {
        Some(st) => {
            pods.patch_status(
                &created.name_any(),
                &PatchParams::default(),
                &Patch::Merge(json!({ "status": st })),
            )
            .await
        }
        None => Ok(created),
    }
}

/// A running, ready pod. A create drops the status: `create_pod` writes it through `/status`.
fn pod(name: &str, node: Option<&str>, labels: Value) -> Pod {
    let mut spec = json!({ "containers": [{ "name": "c", "image": "example" }] });
    if let Some(n) = node {
        spec["nodeName"] = json!(n);
    }
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": name, "labels": labels },
        "spec": spec,
        "status": { "phase": "Running", "conditions": [{ "type": "Ready", "status": "True" }] },
    }))
    .unwrap()
}

fn cm(name: &str) -> ConfigMap {
    serde_json::from_value(json!({ "metadata": { "name": name }, "data": { "k": "v" } })).unwrap()
}

fn api_err<T: std::fmt::Debug>(r: Result<T, kube::Error>) -> Status {
    match r {
        Err(kube::Error::Api(s)) => *s,
        other => panic!("expected an API error, got {other:?}"),
    }
}

fn rv_of<K: ResourceExt>(o: &K) -> u64 {
    o.resource_version().unwrap().parse().unwrap()
}

/// The next non-bookmark watch event, within 10 s.
async fn next_event<K, S>(s: &mut S) -> WatchEvent<K>
where
    S: Stream<Item = Result<WatchEvent<K>, kube::Error>> + Unpin,
{
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(10), s.next())
            .await
            .expect("a watch event within 10 s")
            .expect("the watch stream is open")
            .expect("a well-formed watch event");
        if !matches!(ev, WatchEvent::Bookmark(_)) {
            return ev;
        }
    }
}

fn describe<K: ResourceExt>(ev: &WatchEvent<K>) -> (String, String) {
    match ev {
        WatchEvent::Added(o) => ("ADDED".into(), o.name_any()),
        WatchEvent::Modified(o) => ("MODIFIED".into(), o.name_any()),
        WatchEvent::Deleted(o) => ("DELETED".into(), o.name_any()),
        WatchEvent::Bookmark(_) => ("BOOKMARK".into(), String::new()),
        WatchEvent::Error(s) => ("ERROR".into(), s.reason.clone()),
    }
}

fn ev(kind: &str, name: &str) -> (String, String) {
    (kind.to_string(), name.to_string())
}

// ---------------------------------------------------------------- resourceVersion, CRUD

#[tokio::test]
async fn resource_version_is_monotonic_across_resources() {
    let (emu, client) = setup().await;
    let nodes: Api<Node> = Api::all(client.clone());
    let pods: Api<Pod> = Api::default_namespaced(client.clone());
    let cms: Api<ConfigMap> = Api::default_namespaced(client.clone());
    let pp = PostParams::default();
    let n = nodes
        .create(
            &pp,
            &serde_json::from_value(json!({"metadata": {"name": "n1"}})).unwrap(),
        )
        .await
        .unwrap();
    let p = pods
        .create(&pp, &pod("p1", Some("n1"), json!({})))
        .await
        .unwrap();
    let c = cms.create(&pp, &cm("c1")).await.unwrap();
    let p2 = pods
        .patch(
            "p1",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"a": "b"}}})),
        )
        .await
        .unwrap();
    let rvs = [rv_of(&n), rv_of(&p), rv_of(&c), rv_of(&p2)];
    assert!(
        rvs.windows(2).all(|w| w[0] < w[1]),
        "not increasing: {rvs:?}"
    );
    let list = pods.list(&ListParams::default()).await.unwrap();
    let list_rv: u64 = list.metadata.resource_version.unwrap().parse().unwrap();
    assert_eq!(list_rv, rvs[3]);
    assert_eq!(emu.store().resource_version(), rvs[3]);
    // Server-set fields.
    assert!(p.uid().is_some());
    assert!(p.creation_timestamp().is_some());
    assert_eq!(p.metadata.namespace.as_deref(), Some("default"));
}

#[tokio::test]
async fn stale_replace_is_a_conflict() {
    let (_emu, client) = setup().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    let created = cms.create(&PostParams::default(), &cm("c1")).await.unwrap();
    let mut a = created.clone();
    a.data = Some([("k".to_string(), "a".to_string())].into());
    let after_a = cms.replace("c1", &PostParams::default(), &a).await.unwrap();
    assert!(rv_of(&after_a) > rv_of(&created));
    let mut b = created.clone();
    b.data = Some([("k".to_string(), "b".to_string())].into());
    let s = api_err(cms.replace("c1", &PostParams::default(), &b).await);
    assert_eq!((s.code, s.reason.as_str()), (409, "Conflict"));
    assert!(
        s.message.contains("the object has been modified"),
        "{}",
        s.message
    );
    assert_eq!(cms.get("c1").await.unwrap().data.unwrap()["k"], "a");
    // Without a resourceVersion the update is unconditional, as on a real server.
    b.metadata.resource_version = None;
    let after_b = cms.replace("c1", &PostParams::default(), &b).await.unwrap();
    assert_eq!(after_b.data.unwrap()["k"], "b");
}

#[tokio::test]
async fn create_get_errors_have_real_statuses() {
    let (_emu, client) = setup().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(client.clone());
    cms.create(&PostParams::default(), &cm("c1")).await.unwrap();
    let s = api_err(cms.create(&PostParams::default(), &cm("c1")).await);
    assert_eq!((s.code, s.reason.as_str()), (409, "AlreadyExists"));
    assert_eq!(s.message, "configmaps \"c1\" already exists");
    let s = api_err(cms.get("nope").await);
    assert_eq!((s.code, s.reason.as_str()), (404, "NotFound"));
    assert_eq!(s.message, "configmaps \"nope\" not found");
    assert_eq!(s.details.unwrap().kind, "configmaps");
    let s = api_err(cms.create(&PostParams::default(), &cm("Bad_Name")).await);
    assert_eq!((s.code, s.reason.as_str()), (422, "Invalid"));
    let s = api_err(
        cms.create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {}})).unwrap(),
        )
        .await,
    );
    assert_eq!((s.code, s.reason.as_str()), (422, "Invalid"));
    // The name in the body must match the URL.
    let s = api_err(
        cms.replace("other", &PostParams::default(), &cm("c1"))
            .await,
    );
    assert_eq!((s.code, s.reason.as_str()), (400, "BadRequest"));
    let s = api_err(
        cms.replace("missing", &PostParams::default(), &cm("missing"))
            .await,
    );
    assert_eq!(s.code, 404);
    // generateName.
    let g = cms
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"generateName": "gen-"}})).unwrap(),
        )
        .await
        .unwrap();
    assert!(
        g.name_any().starts_with("gen-") && g.name_any().len() == 9,
        "{}",
        g.name_any()
    );
}

#[tokio::test]
async fn unknown_paths_and_methods_answer_with_status() {
    let (emu, _client) = setup().await;
    let http = reqwest::Client::new();
    let r = http
        .get(format!("{}/apis/apps/v1/deployments", emu.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
    let body: Value = r.json().await.unwrap();
    assert_eq!(
        (body["kind"].as_str(), body["reason"].as_str()),
        (Some("Status"), Some("NotFound"))
    );
    let r = http
        .post(format!("{}/api/v1/pods", emu.url()))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 405);
    let r = http
        .post(format!(
            "{}/api/v1/namespaces/default/configmaps",
            emu.url()
        ))
        .body("not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["reason"], "BadRequest");
}

// ---------------------------------------------------------------- delete

#[tokio::test]
async fn delete_preconditions_conflict_and_keep_the_object() {
    let (_emu, client) = setup().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    let c = cms.create(&PostParams::default(), &cm("c1")).await.unwrap();
    let with = |uid: Option<String>, rv: Option<String>| DeleteParams {
        preconditions: Some(Preconditions {
            uid,
            resource_version: rv,
        }),
        ..Default::default()
    };
    let s = api_err(
        cms.delete("c1", &with(Some("wrong-uid".into()), None))
            .await,
    );
    assert_eq!((s.code, s.reason.as_str()), (409, "Conflict"));
    assert!(
        s.message
            .contains("Precondition failed: UID in precondition: wrong-uid"),
        "{}",
        s.message
    );
    let s = api_err(cms.delete("c1", &with(None, Some("1".into()))).await);
    assert_eq!((s.code, s.reason.as_str()), (409, "Conflict"));
    assert!(
        s.message.contains("ResourceVersion in precondition: 1"),
        "{}",
        s.message
    );
    assert_eq!(cms.get("c1").await.unwrap().uid(), c.uid());
    let out = cms
        .delete("c1", &with(c.uid(), c.resource_version()))
        .await
        .unwrap();
    // Config maps answer a completed delete with a Success Status.
    let status = out.right().expect("a Status for a deleted config map");
    assert!(status.is_success());
    assert_eq!(api_err(cms.get("c1").await).code, 404);
    assert_eq!(
        api_err(cms.delete("c1", &DeleteParams::default()).await).code,
        404
    );
}

#[tokio::test]
async fn finalizers_keep_a_deleted_object_until_removed() {
    let (emu, client) = setup().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    let mut c = cm("c1");
    c.metadata.finalizers = Some(vec!["example.com/hold".into()]);
    let created = cms.create(&PostParams::default(), &c).await.unwrap();
    let mut watch = cms
        .watch(&WatchParams::default(), &rv_of(&created).to_string())
        .await
        .unwrap()
        .boxed();
    let out = cms.delete("c1", &DeleteParams::default()).await.unwrap();
    let kept = out.left().expect("the object, still present");
    assert!(kept.metadata.deletion_timestamp.is_some());
    let got = cms.get("c1").await.unwrap();
    assert!(got.metadata.deletion_timestamp.is_some());
    assert_eq!(
        describe(&next_event(&mut watch).await),
        ev("MODIFIED", "c1")
    );
    // No new finalizers on an object being deleted.
    let s = api_err(
        cms.patch(
            "c1",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": ["example.com/hold", "x.io/more"]}})),
        )
        .await,
    );
    assert_eq!((s.code, s.reason.as_str()), (422, "Invalid"));
    // A patch cannot clear the deletionTimestamp.
    cms.patch(
        "c1",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"deletionTimestamp": null, "labels": {"a": "b"}}})),
    )
    .await
    .unwrap();
    assert!(
        cms.get("c1")
            .await
            .unwrap()
            .metadata
            .deletion_timestamp
            .is_some()
    );
    assert_eq!(
        describe(&next_event(&mut watch).await),
        ev("MODIFIED", "c1")
    );
    cms.patch(
        "c1",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    assert_eq!(api_err(cms.get("c1").await).code, 404);
    assert_eq!(describe(&next_event(&mut watch).await), ev("DELETED", "c1"));
    assert!(
        emu.store()
            .get(&CONFIGMAPS, Some("default"), "c1")
            .is_none()
    );
}

#[tokio::test]
async fn pod_grace_period_keeps_a_bound_pod_terminating() {
    let (emu, client) = setup().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    let mut p = pod("p1", Some("n1"), json!({}));
    p.spec.as_mut().unwrap().termination_grace_period_seconds = Some(45);
    pods.create(&PostParams::default(), &p).await.unwrap();
    let out = pods.delete("p1", &DeleteParams::default()).await.unwrap();
    let kept = out.left().expect("pods answer with the object");
    assert!(kept.metadata.deletion_timestamp.is_some());
    assert_eq!(kept.metadata.deletion_grace_period_seconds, Some(45));
    let got = pods.get("p1").await.unwrap();
    assert_eq!(got.metadata.deletion_grace_period_seconds, Some(45));
    // A second delete with a shorter grace period shortens it.
    pods.delete("p1", &DeleteParams::default().grace_period(5))
        .await
        .unwrap();
    assert_eq!(
        pods.get("p1")
            .await
            .unwrap()
            .metadata
            .deletion_grace_period_seconds,
        Some(5)
    );
    // Updates do not remove a pod in its grace period; the kubelet path does.
    pods.patch(
        "p1",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"x": "y"}}})),
    )
    .await
    .unwrap();
    assert!(pods.get("p1").await.is_ok());
    emu.store().remove(&PODS, Some("default"), "p1").unwrap();
    assert_eq!(api_err(pods.get("p1").await).code, 404);

    // Unbound pods and grace period 0 go at once.
    pods.create(&PostParams::default(), &pod("p2", None, json!({})))
        .await
        .unwrap();
    pods.delete("p2", &DeleteParams::default()).await.unwrap();
    assert_eq!(api_err(pods.get("p2").await).code, 404);
    pods.create(&PostParams::default(), &pod("p3", Some("n1"), json!({})))
        .await
        .unwrap();
    let out = pods
        .delete("p3", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    assert!(out.left().is_some());
    assert_eq!(api_err(pods.get("p3").await).code, 404);
    // gracePeriodSeconds as a query parameter works too.
    pods.create(&PostParams::default(), &pod("p4", Some("n1"), json!({})))
        .await
        .unwrap();
    let r = reqwest::Client::new()
        .delete(format!(
            "{}/api/v1/namespaces/default/pods/p4?gracePeriodSeconds=9",
            emu.url()
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(
        pods.get("p4")
            .await
            .unwrap()
            .metadata
            .deletion_grace_period_seconds,
        Some(9)
    );
}

#[tokio::test]
async fn delete_collection_by_label() {
    let (_emu, client) = setup().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    for (n, app) in [("a", "x"), ("b", "x"), ("c", "y")] {
        pods.create(&PostParams::default(), &pod(n, None, json!({ "app": app })))
            .await
            .unwrap();
    }
    let out = pods
        .delete_collection(
            &DeleteParams::default(),
            &ListParams::default().labels("app=x"),
        )
        .await
        .unwrap();
    assert_eq!(out.left().unwrap().items.len(), 2);
    let left: Vec<String> = pods
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|p| p.name_any())
        .collect();
    assert_eq!(left, vec!["c"]);
}

// ---------------------------------------------------------------- patch

#[tokio::test]
async fn merge_patch_and_its_resource_version_guard() {
    let (_emu, client) = setup().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    let created = pods
        .create(&PostParams::default(), &pod("p1", None, json!({"a": "1"})))
        .await
        .unwrap();
    let pp = PatchParams::default();
    let patched = pods
        .patch(
            "p1",
            &pp,
            &Patch::Merge(json!({"metadata": {"labels": {"b": "2", "a": null}}})),
        )
        .await
        .unwrap();
    assert_eq!(patched.labels().get("b").map(String::as_str), Some("2"));
    assert!(!patched.labels().contains_key("a"));
    assert!(rv_of(&patched) > rv_of(&created));
    // A resourceVersion in the body is a precondition.
    let s = api_err(
        pods.patch(
            "p1",
            &pp,
            &Patch::Merge(json!({"metadata": {"resourceVersion": created.resource_version(), "labels": {"c": "3"}}})),
        )
        .await,
    );
    assert_eq!((s.code, s.reason.as_str()), (409, "Conflict"));
    pods.patch(
        "p1",
        &pp,
        &Patch::Merge(json!({"metadata": {"resourceVersion": patched.resource_version(), "labels": {"c": "3"}}})),
    )
    .await
    .unwrap();
    // The uid is immutable.
    let s = api_err(
        pods.patch(
            "p1",
            &pp,
            &Patch::Merge(json!({"metadata": {"uid": "other"}})),
        )
        .await,
    );
    assert_eq!((s.code, s.reason.as_str()), (422, "Invalid"));
    // A patch that changes nothing does not bump the resourceVersion.
    let before = pods.get("p1").await.unwrap();
    let same = pods
        .patch(
            "p1",
            &pp,
            &Patch::Merge(json!({"metadata": {"labels": {"c": "3"}}})),
        )
        .await
        .unwrap();
    assert_eq!(same.resource_version(), before.resource_version());
    // Missing objects are 404.
    assert_eq!(
        api_err(pods.patch("nope", &pp, &Patch::Merge(json!({}))).await).code,
        404
    );
}

#[tokio::test]
async fn json_patch_and_failed_test_is_422() {
    let (_emu, client) = setup().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    let created = pods
        .create(&PostParams::default(), &pod("p1", None, json!({"a": "1"})))
        .await
        .unwrap();
    let pp = PatchParams::default();
    let jp = |v: Value| Patch::<()>::Json(serde_json::from_value::<json_patch::Patch>(v).unwrap());
    let ok = pods
        .patch(
            "p1",
            &pp,
            &jp(json!([
                {"op": "test", "path": "/metadata/resourceVersion", "value": created.resource_version()},
                {"op": "add", "path": "/metadata/labels/b", "value": "2"},
            ])),
        )
        .await
        .unwrap();
    assert_eq!(ok.labels().get("b").map(String::as_str), Some("2"));
    let s = api_err(
        pods.patch(
            "p1",
            &pp,
            &jp(json!([
                {"op": "test", "path": "/metadata/resourceVersion", "value": created.resource_version()},
                {"op": "add", "path": "/metadata/labels/c", "value": "3"},
            ])),
        )
        .await,
    );
    assert_eq!((s.code, s.reason.as_str()), (422, "Invalid"));
    assert!(!s.details.unwrap().causes.is_empty());
    let now = pods.get("p1").await.unwrap();
    assert_eq!(now.resource_version(), ok.resource_version());
    assert!(!now.labels().contains_key("c"));
    // Malformed JSON patch: 400.
    let r = reqwest::Client::new()
        .patch(format!("{}/api/v1/namespaces/default/pods/p1", _emu.url()))
        .header("content-type", "application/json-patch+json")
        .body(r#"{"op": "add"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
}

#[tokio::test]
async fn strategic_merge_subset_and_unsupported_patch_types() {
    let (_emu, client) = setup().await;
    let pods: Api<Pod> = Api::default_namespaced(client.clone());
    let mut p = pod("p1", None, json!({}));
    p.status
        .as_mut()
        .unwrap()
        .conditions
        .as_mut()
        .unwrap()
        .push(serde_json::from_value(json!({"type": "PodScheduled", "status": "True"})).unwrap());
    create_pod(&pods, &p).await.unwrap();
    let patched = pods
        .patch_status(
            "p1",
            &PatchParams::default(),
            &Patch::Strategic(
                json!({"status": {"conditions": [{"type": "Ready", "status": "False"}]}}),
            ),
        )
        .await
        .unwrap();
    let conds = patched.status.unwrap().conditions.unwrap();
    assert_eq!(conds.len(), 2, "merged by type, not replaced");
    assert_eq!(
        conds.iter().find(|c| c.type_ == "Ready").unwrap().status,
        "False"
    );
    let s = api_err(
        pods.patch(
            "p1",
            &PatchParams::apply("test"),
            &Patch::Apply(json!({"metadata": {"name": "p1"}})),
        )
        .await,
    );
    assert_eq!((s.code, s.reason.as_str()), (415, "UnsupportedMediaType"));
    let gs: Api<DynamicObject> = Api::default_namespaced_with(client, &gs_resource());
    gs.create(&PostParams::default(), &gameserver("gs1"))
        .await
        .unwrap();
    let s = api_err(
        gs.patch(
            "gs1",
            &PatchParams::default(),
            &Patch::Strategic(json!({"spec": {}})),
        )
        .await,
    );
    assert_eq!(s.code, 415);
}

// ---------------------------------------------------------------- watch

#[tokio::test]
async fn watch_reports_added_modified_deleted() {
    let (_emu, client) = setup().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    cms.create(&PostParams::default(), &cm("before"))
        .await
        .unwrap();
    let mut w = cms
        .watch(&WatchParams::default(), "0")
        .await
        .unwrap()
        .boxed();
    // Resource version 0: synthetic ADDED for what exists.
    assert_eq!(describe(&next_event(&mut w).await), ev("ADDED", "before"));
    cms.create(&PostParams::default(), &cm("c1")).await.unwrap();
    cms.patch(
        "c1",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"k": "2"}})),
    )
    .await
    .unwrap();
    cms.delete("c1", &DeleteParams::default()).await.unwrap();
    let got = [
        next_event(&mut w).await,
        next_event(&mut w).await,
        next_event(&mut w).await,
    ];
    assert_eq!(
        got.iter().map(describe).collect::<Vec<_>>(),
        vec![ev("ADDED", "c1"), ev("MODIFIED", "c1"), ev("DELETED", "c1")]
    );
    // The DELETED object carries the deletion's resourceVersion.
    let (WatchEvent::Modified(m), WatchEvent::Deleted(d)) = (&got[1], &got[2]) else {
        panic!("unexpected events");
    };
    assert!(rv_of(d) > rv_of(m));
}

#[tokio::test]
async fn watch_resumes_after_a_resource_version() {
    let (_emu, client) = setup().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    let a = cms.create(&PostParams::default(), &cm("a")).await.unwrap();
    cms.create(&PostParams::default(), &cm("b")).await.unwrap();
    cms.patch(
        "a",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"k": "2"}})),
    )
    .await
    .unwrap();
    let mut w = cms
        .watch(&WatchParams::default(), &rv_of(&a).to_string())
        .await
        .unwrap()
        .boxed();
    assert_eq!(describe(&next_event(&mut w).await), ev("ADDED", "b"));
    assert_eq!(describe(&next_event(&mut w).await), ev("MODIFIED", "a"));
    cms.create(&PostParams::default(), &cm("c")).await.unwrap();
    assert_eq!(describe(&next_event(&mut w).await), ev("ADDED", "c"));
}

#[tokio::test]
async fn watch_from_a_compacted_resource_version_is_410() {
    let emu = Emulator::start_with(Store::new(3), "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let client = emu.client().await.unwrap();
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    let first = cms.create(&PostParams::default(), &cm("c0")).await.unwrap();
    for i in 1..10 {
        cms.create(&PostParams::default(), &cm(&format!("c{i}")))
            .await
            .unwrap();
    }
    let mut w = cms
        .watch(&WatchParams::default(), &rv_of(&first).to_string())
        .await
        .unwrap()
        .boxed();
    match next_event(&mut w).await {
        WatchEvent::Error(s) => {
            assert_eq!((s.code, s.reason.as_str()), (410, "Expired"));
            assert!(
                s.message.contains("too old resource version"),
                "{}",
                s.message
            );
        }
        other => panic!("expected ERROR 410, got {:?}", describe(&other)),
    }
    assert!(w.next().await.is_none(), "the stream ends after the error");
    // Within the history, resumption works.
    let rv = emu.store().resource_version() - 2;
    let mut w = cms
        .watch(&WatchParams::default(), &rv.to_string())
        .await
        .unwrap()
        .boxed();
    assert_eq!(describe(&next_event(&mut w).await), ev("ADDED", "c8"));
    // A paged list whose continue token is older than the history is 410 too.
    let page = cms.list(&ListParams::default().limit(2)).await.unwrap();
    let token = page.metadata.continue_.clone().unwrap();
    for i in 10..15 {
        cms.create(&PostParams::default(), &cm(&format!("c{i}")))
            .await
            .unwrap();
    }
    let s = api_err(
        cms.list(&ListParams::default().limit(2).continue_token(&token))
            .await,
    );
    assert_eq!((s.code, s.reason.as_str()), (410, "Expired"));
}

/// A restart, as clients see it: open watches end, every request is answered 503 while the
/// server is down, then a watch resumed from before the restart is answered 410 (the new
/// watch cache starts empty), and a list followed by a watch from its resourceVersion works.
/// The objects survive (etcd keeps them).
#[tokio::test]
async fn a_restart_ends_watches_refuses_requests_then_answers_410_to_a_resumed_watch() {
    let (emu, _) = setup().await;
    let client = emu.client_no_retry("test").await.unwrap();
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    let a = cms.create(&PostParams::default(), &cm("a")).await.unwrap();
    let mut w = cms
        .watch(&WatchParams::default(), &rv_of(&a).to_string())
        .await
        .unwrap()
        .boxed();
    cms.create(&PostParams::default(), &cm("b")).await.unwrap();
    assert_eq!(describe(&next_event(&mut w).await), ev("ADDED", "b"));
    // What a client resumes from: older than the newest write when the server restarts.
    let before = rv_of(&a);
    emu.restart(Duration::from_secs(2));
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(e) = w.next().await {
            let e = e.expect("a well-formed watch event");
            assert!(
                matches!(e, WatchEvent::Bookmark(_)),
                "only bookmarks before the end"
            );
        }
    })
    .await;
    assert!(ended.is_ok(), "the open watch ended with the restart");
    // Down: reads, writes and watches are all answered 503.
    let s = api_err(cms.get("a").await);
    assert_eq!((s.code, s.reason.as_str()), (503, "ServiceUnavailable"));
    let s = api_err(cms.create(&PostParams::default(), &cm("c")).await);
    assert_eq!(s.code, 503);
    let s = api_err(
        cms.watch(&WatchParams::default(), &before.to_string())
            .await
            .map(|_| ()),
    );
    assert_eq!(s.code, 503);
    assert!(
        emu.journal().count(|e| e.status == 503) >= 3,
        "refusals are journaled"
    );
    // Up again: a watch resumed from before the restart is 410.
    let mut resumed = None;
    for _ in 0..100 {
        match cms
            .watch(&WatchParams::default(), &before.to_string())
            .await
        {
            Ok(w) => {
                resumed = Some(w.boxed());
                break;
            }
            Err(kube::Error::Api(s)) if s.code == 503 => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("unexpected {e}"),
        }
    }
    let mut resumed = resumed.expect("the server serves again after its down time");
    match next_event(&mut resumed).await {
        WatchEvent::Error(s) => assert_eq!((s.code, s.reason.as_str()), (410, "Expired")),
        other => panic!("expected ERROR 410, got {:?}", describe(&other)),
    }
    // Nothing was lost: a list sees both objects, and a watch from the list's
    // resourceVersion sees what comes next.
    let list = cms.list(&ListParams::default()).await.unwrap();
    let names: Vec<String> = list.items.iter().map(|c| c.name_any()).collect();
    assert_eq!(names, vec!["a", "b"]);
    let mut w = cms
        .watch(
            &WatchParams::default(),
            list.metadata.resource_version.as_deref().unwrap(),
        )
        .await
        .unwrap()
        .boxed();
    cms.create(&PostParams::default(), &cm("d")).await.unwrap();
    assert_eq!(describe(&next_event(&mut w).await), ev("ADDED", "d"));
}

/// The out-of-process emulator restarts through `POST /_emulator/restart`.
#[tokio::test]
async fn the_admin_restart_endpoint_restarts_the_server() {
    let emu = Emulator::start_with_options(
        Store::new(100),
        "127.0.0.1:0".parse().unwrap(),
        Options {
            admin: true,
            ..Options::default()
        },
    )
    .await
    .unwrap();
    let client = emu.client_no_retry("test").await.unwrap();
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    let a = cms.create(&PostParams::default(), &cm("a")).await.unwrap();
    cms.create(&PostParams::default(), &cm("b")).await.unwrap();
    let remote = lastcall_testkit::kube::admin::RemoteJournal::new(&emu.url());
    let floor = remote.restart(Duration::from_millis(300)).await.unwrap();
    assert_eq!(api_err(cms.get("a").await).code, 503);
    assert_eq!(floor, emu.store().resource_version(), "the newest write's");
    assert_eq!(emu.store().oldest_resumable(), floor);
    wait_for("the server serves again", || async {
        cms.get("a").await.ok().map(|_| ())
    })
    .await;
    let mut w = cms
        .watch(&WatchParams::default(), &rv_of(&a).to_string())
        .await
        .unwrap()
        .boxed();
    assert!(matches!(next_event(&mut w).await, WatchEvent::Error(s) if s.code == 410));
    // A watch from the resourceVersion the restart answered resumes without listing.
    let mut w = cms
        .watch(&WatchParams::default(), &floor.to_string())
        .await
        .unwrap()
        .boxed();
    cms.create(&PostParams::default(), &cm("c")).await.unwrap();
    assert_eq!(describe(&next_event(&mut w).await), ev("ADDED", "c"));
    // The remote journal carries each request's query: which resourceVersion it resumed.
    let watches: Vec<String> = remote
        .entries_since(0)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.verb == Verb::Watch && e.status == 200)
        .map(|e| e.query)
        .collect();
    assert!(
        watches
            .last()
            .is_some_and(|q| q.contains(&format!("resourceVersion={floor}"))),
        "{watches:?}"
    );
}

#[tokio::test]
async fn watch_with_node_field_selector_sees_only_that_node() {
    let (emu, client) = setup().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    let pp = PostParams::default();
    let mp = PatchParams::default();
    let now = DeleteParams::default().grace_period(0);
    let start = emu.store().resource_version();
    let mut w = pods
        .watch(
            &WatchParams::default().fields("spec.nodeName=n1"),
            &start.to_string(),
        )
        .await
        .unwrap()
        .boxed();
    // Traffic on another node: invisible.
    pods.create(&pp, &pod("other", Some("n2"), json!({})))
        .await
        .unwrap();
    pods.patch(
        "other",
        &mp,
        &Patch::Merge(json!({"metadata": {"labels": {"x": "1"}}})),
    )
    .await
    .unwrap();
    pods.delete("other", &now).await.unwrap();
    // n1's own pod.
    pods.create(&pp, &pod("p1", Some("n1"), json!({})))
        .await
        .unwrap();
    // A pod that gets bound to n1 (the binding subresource) appears as ADDED.
    pods.create(&pp, &pod("p2", None, json!({}))).await.unwrap();
    let binding = json!({"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "p2"}, "target": {"kind": "Node", "name": "n1"}});
    let _: Status = pods
        .create_subresource("binding", "p2", &pp, &binding)
        .await
        .unwrap();
    // A pod that leaves the selector (its label-free twin is deleted) disappears as DELETED.
    pods.delete("p1", &now).await.unwrap();
    pods.patch(
        "p2",
        &mp,
        &Patch::Merge(json!({"metadata": {"labels": {"y": "1"}}})),
    )
    .await
    .unwrap();
    pods.delete("p2", &now).await.unwrap();
    let mut got = Vec::new();
    for _ in 0..5 {
        got.push(describe(&next_event(&mut w).await));
    }
    assert_eq!(
        got,
        vec![
            ev("ADDED", "p1"),
            ev("ADDED", "p2"),
            ev("DELETED", "p1"),
            ev("MODIFIED", "p2"),
            ev("DELETED", "p2"),
        ]
    );
    // The same selector from "now" lists only n1's pods.
    pods.create(&pp, &pod("p3", Some("n1"), json!({})))
        .await
        .unwrap();
    pods.create(&pp, &pod("p4", Some("n2"), json!({})))
        .await
        .unwrap();
    let mut w = pods
        .watch(&WatchParams::default().fields("spec.nodeName=n1"), "0")
        .await
        .unwrap()
        .boxed();
    assert_eq!(describe(&next_event(&mut w).await), ev("ADDED", "p3"));
    pods.patch(
        "p4",
        &mp,
        &Patch::Merge(json!({"metadata": {"labels": {"z": "1"}}})),
    )
    .await
    .unwrap();
    pods.patch(
        "p3",
        &mp,
        &Patch::Merge(json!({"metadata": {"labels": {"z": "1"}}})),
    )
    .await
    .unwrap();
    assert_eq!(describe(&next_event(&mut w).await), ev("MODIFIED", "p3"));
}

#[tokio::test]
async fn watch_with_label_selector_transitions() {
    let (emu, client) = setup().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    let mp = PatchParams::default();
    pods.create(
        &PostParams::default(),
        &pod("p1", None, json!({"app": "x"})),
    )
    .await
    .unwrap();
    let start = emu.store().resource_version();
    let mut w = pods
        .watch(&WatchParams::default().labels("app=y"), &start.to_string())
        .await
        .unwrap()
        .boxed();
    pods.patch(
        "p1",
        &mp,
        &Patch::Merge(json!({"metadata": {"labels": {"app": "y"}}})),
    )
    .await
    .unwrap();
    pods.patch(
        "p1",
        &mp,
        &Patch::Merge(json!({"metadata": {"labels": {"app": "z"}}})),
    )
    .await
    .unwrap();
    assert_eq!(describe(&next_event(&mut w).await), ev("ADDED", "p1"));
    assert_eq!(describe(&next_event(&mut w).await), ev("DELETED", "p1"));
}

#[tokio::test]
async fn watch_bookmarks_timeout_and_initial_events() {
    let emu = Emulator::start_with_options(
        Store::new(100),
        "127.0.0.1:0".parse().unwrap(),
        Options {
            bookmark_interval: Duration::from_millis(50),
            ..Options::default()
        },
    )
    .await
    .unwrap();
    let client = emu.client().await.unwrap();
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    let c = cms.create(&PostParams::default(), &cm("c1")).await.unwrap();
    let mut w = cms
        .watch(&WatchParams::default().timeout(1), &rv_of(&c).to_string())
        .await
        .unwrap()
        .boxed();
    let mut bookmarks = Vec::new();
    // The stream ends by itself after timeoutSeconds.
    while let Some(ev) = tokio::time::timeout(Duration::from_secs(20), w.next())
        .await
        .unwrap()
    {
        if let WatchEvent::Bookmark(b) = ev.unwrap() {
            bookmarks.push(b.metadata.resource_version);
        }
    }
    assert!(!bookmarks.is_empty());
    assert!(bookmarks.iter().all(|rv| *rv == rv_of(&c).to_string()));
    // sendInitialEvents: ADDED for existing objects, then a bookmark marking the end.
    let mut w = cms
        .watch(&WatchParams::streaming_lists(), "")
        .await
        .unwrap()
        .boxed();
    let first = tokio::time::timeout(Duration::from_secs(10), w.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(describe(&first), ev("ADDED", "c1"));
    let second = tokio::time::timeout(Duration::from_secs(10), w.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let WatchEvent::Bookmark(b) = second else {
        panic!("expected the initial-events bookmark");
    };
    assert_eq!(
        b.metadata
            .annotations
            .get("k8s.io/initial-events-end")
            .map(String::as_str),
        Some("true")
    );
}

#[tokio::test]
async fn runtime_watcher_lists_watches_and_recovers_after_dropped_watches() {
    use kube::runtime::WatchStreamExt;
    use kube::runtime::watcher::{self, Event};
    let (emu, client) = setup().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    for n in ["a", "b", "c"] {
        cms.create(&PostParams::default(), &cm(n)).await.unwrap();
    }
    let mut w = watcher::watcher(cms.clone(), watcher::Config::default().page_size(2))
        .default_backoff()
        .boxed();
    let mut next = async || {
        tokio::time::timeout(Duration::from_secs(10), w.next())
            .await
            .expect("a watcher event within 10 s")
            .expect("the watcher runs")
            .expect("no watcher error")
    };
    assert!(matches!(next().await, Event::Init));
    let mut initial = Vec::new();
    loop {
        match next().await {
            Event::InitApply(o) => initial.push(o.name_any()),
            Event::InitDone => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(initial, vec!["a", "b", "c"]);
    cms.create(&PostParams::default(), &cm("d")).await.unwrap();
    assert!(matches!(next().await, Event::Apply(o) if o.name_any() == "d"));
    let lists = emu.journal().count(|e| e.verb == Verb::List);
    assert_eq!(lists, 2, "two pages");
    emu.drop_watches();
    cms.create(&PostParams::default(), &cm("e")).await.unwrap();
    assert!(matches!(next().await, Event::Apply(o) if o.name_any() == "e"));
    cms.delete("a", &DeleteParams::default()).await.unwrap();
    assert!(matches!(next().await, Event::Delete(o) if o.name_any() == "a"));
    // It re-watched from its resourceVersion instead of listing again.
    assert_eq!(emu.journal().count(|e| e.verb == Verb::List), 2);
    assert!(emu.journal().count(|e| e.verb == Verb::Watch) >= 2);
}

// ---------------------------------------------------------------- selectors

#[tokio::test]
async fn field_selectors_on_lists() {
    let (_emu, client) = setup().await;
    let pp = PostParams::default();
    let default: Api<Pod> = Api::namespaced(client.clone(), "default");
    let other: Api<Pod> = Api::namespaced(client.clone(), "other");
    let all: Api<Pod> = Api::all(client.clone());
    default
        .create(&pp, &pod("a", Some("n1"), json!({})))
        .await
        .unwrap();
    default
        .create(&pp, &pod("b", Some("n2"), json!({})))
        .await
        .unwrap();
    default
        .create(&pp, &pod("c", None, json!({})))
        .await
        .unwrap();
    other
        .create(&pp, &pod("a", Some("n1"), json!({})))
        .await
        .unwrap();
    let names = |l: kube::api::ObjectList<Pod>| {
        l.items
            .iter()
            .map(|p| format!("{}/{}", p.namespace().unwrap(), p.name_any()))
            .collect::<Vec<_>>()
    };
    let q = |s: &str| ListParams::default().fields(s);
    assert_eq!(
        names(all.list(&q("metadata.name=a")).await.unwrap()),
        vec!["default/a", "other/a"]
    );
    assert_eq!(
        names(all.list(&q("metadata.namespace==other")).await.unwrap()),
        vec!["other/a"]
    );
    assert_eq!(
        names(all.list(&q("spec.nodeName=n1")).await.unwrap()),
        vec!["default/a", "other/a"]
    );
    assert_eq!(
        names(default.list(&q("spec.nodeName=")).await.unwrap()),
        vec!["default/c"]
    );
    assert_eq!(
        names(
            default
                .list(&q("spec.nodeName!=n1,metadata.name!=c"))
                .await
                .unwrap()
        ),
        vec!["default/b"]
    );
    let s = api_err(default.list(&q("spec.image=x")).await);
    assert_eq!((s.code, s.reason.as_str()), (400, "BadRequest"));
    assert!(
        s.message.contains("field label not supported"),
        "{}",
        s.message
    );
    assert_eq!(api_err(default.list(&q("nonsense")).await).code, 400);
    // spec.nodeName is a pod field only.
    let nodes: Api<Node> = Api::all(client);
    assert_eq!(api_err(nodes.list(&q("spec.nodeName=n1")).await).code, 400);
}

#[tokio::test]
async fn label_selectors_with_every_operator() {
    let (_emu, client) = setup().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    for (n, labels) in [
        ("a", json!({"app": "x", "tier": "1"})),
        ("b", json!({"app": "y", "tier": "2"})),
        ("c", json!({"app": "z"})),
        ("d", json!({})),
    ] {
        pods.create(&PostParams::default(), &pod(n, None, labels))
            .await
            .unwrap();
    }
    let sel = async |s: &str| -> Vec<String> {
        pods.list(&ListParams::default().labels(s))
            .await
            .unwrap()
            .items
            .iter()
            .map(|p| p.name_any())
            .collect()
    };
    assert_eq!(sel("app=x").await, vec!["a"]);
    assert_eq!(sel("app==y").await, vec!["b"]);
    assert_eq!(sel("app!=x").await, vec!["b", "c", "d"]);
    assert_eq!(sel("app in (x, z)").await, vec!["a", "c"]);
    assert_eq!(sel("app notin (x,z)").await, vec!["b", "d"]);
    assert_eq!(sel("tier").await, vec!["a", "b"]);
    assert_eq!(sel("!tier").await, vec!["c", "d"]);
    assert_eq!(sel("app,!tier").await, vec!["c"]);
    assert_eq!(sel("tier>1").await, vec!["b"]);
    for bad in [
        "app in x",
        "app=(x)",
        "=x",
        "app in (x",
        "a b",
        "app,",
        "bad key=x",
    ] {
        let s = api_err(pods.list(&ListParams::default().labels(bad)).await);
        assert_eq!((s.code, s.reason.as_str()), (400, "BadRequest"), "{bad}");
    }
}

#[tokio::test]
async fn list_pages_with_continue_tokens() {
    let (_emu, client) = setup().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    for i in 0..5 {
        cms.create(&PostParams::default(), &cm(&format!("c{i}")))
            .await
            .unwrap();
    }
    let mut seen = Vec::new();
    let mut lp = ListParams::default().limit(2);
    let mut first_rv = None;
    loop {
        let page = cms.list(&lp).await.unwrap();
        assert!(page.items.len() <= 2);
        first_rv.get_or_insert(page.metadata.resource_version.clone());
        assert_eq!(Some(&page.metadata.resource_version), first_rv.as_ref());
        seen.extend(page.items.iter().map(|c| c.name_any()));
        match page.metadata.continue_ {
            Some(t) if !t.is_empty() => lp = lp.continue_token(&t),
            _ => break,
        }
    }
    assert_eq!(seen, vec!["c0", "c1", "c2", "c3", "c4"]);
}

// ---------------------------------------------------------------- eviction

fn pdb(name: &str, spec: Value) -> PodDisruptionBudget {
    serde_json::from_value(json!({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": { "name": name },
        "spec": spec,
    }))
    .unwrap()
}

async fn evict(pods: &Api<Pod>, name: &str) -> Result<Status, kube::Error> {
    pods.evict(name, &EvictParams::default()).await
}

#[tokio::test]
async fn eviction_blocked_by_the_agones_pdb() {
    let (_emu, client) = setup_no_retry().await;
    let pods: Api<Pod> = Api::default_namespaced(client.clone());
    let pdbs: Api<PodDisruptionBudget> = Api::default_namespaced(client);
    pdbs.create(
        &PostParams::default(),
        &pdb(
            "agones-gameserver-safe-to-evict-false",
            json!({"maxUnavailable": "0%", "selector": {"matchLabels": {"agones.dev/safe-to-evict": "false"}}}),
        ),
    )
    .await
    .unwrap();
    create_pod(
        &pods,
        &pod(
            "gs-1",
            Some("n1"),
            json!({"agones.dev/safe-to-evict": "false"}),
        ),
    )
    .await
    .unwrap();
    create_pod(
        &pods,
        &pod(
            "gs-2",
            Some("n1"),
            json!({"agones.dev/safe-to-evict": "true"}),
        ),
    )
    .await
    .unwrap();
    let s = api_err(evict(&pods, "gs-1").await);
    assert_eq!((s.code, s.reason.as_str()), (429, "TooManyRequests"));
    assert_eq!(
        s.message,
        "Cannot evict pod as it would violate the pod's disruption budget."
    );
    let causes = s.details.unwrap().causes;
    assert_eq!(causes.len(), 1);
    assert_eq!(causes[0].reason, "DisruptionBudget");
    assert_eq!(
        causes[0].message,
        "The disruption budget agones-gameserver-safe-to-evict-false needs 1 healthy pods and has 1 currently"
    );
    let still = pods.get("gs-1").await.unwrap();
    assert!(still.metadata.deletion_timestamp.is_none());
    // Not selected by the PDB: evicted.
    let ok = evict(&pods, "gs-2").await.unwrap();
    assert!(ok.is_success());
    assert!(
        pods.get("gs-2")
            .await
            .unwrap()
            .metadata
            .deletion_timestamp
            .is_some()
    );
}

#[tokio::test]
async fn eviction_without_pdb_deletes_with_the_requested_grace() {
    let (emu, client) = setup().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    pods.create(&PostParams::default(), &pod("p1", Some("n1"), json!({})))
        .await
        .unwrap();
    pods.create(&PostParams::default(), &pod("p2", None, json!({})))
        .await
        .unwrap();
    // kube's `evict` loses delete options (see toolchain.md); post a policy/v1 Eviction.
    let body = json!({
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": { "name": "p1", "namespace": "default" },
        "deleteOptions": { "gracePeriodSeconds": 7 },
    });
    let s: Status = pods
        .create_subresource("eviction", "p1", &PostParams::default(), &body)
        .await
        .unwrap();
    assert!(s.is_success());
    let p1 = pods.get("p1").await.unwrap();
    assert!(p1.metadata.deletion_timestamp.is_some());
    assert_eq!(p1.metadata.deletion_grace_period_seconds, Some(7));
    // The HTTP status is 201.
    let created = emu
        .journal()
        .filter(|e| e.subresource.as_deref() == Some("eviction"));
    assert_eq!(created.last().unwrap().status, 201);
    evict(&pods, "p2").await.unwrap();
    assert_eq!(api_err(pods.get("p2").await).code, 404);
    let s = api_err(evict(&pods, "missing").await);
    assert_eq!((s.code, s.reason.as_str()), (404, "NotFound"));
}

async fn budget_case(spec: Value, pods_n: usize) -> Vec<u16> {
    let (_emu, client) = setup_no_retry().await;
    let pods: Api<Pod> = Api::default_namespaced(client.clone());
    let pdbs: Api<PodDisruptionBudget> = Api::default_namespaced(client);
    let mut spec = spec;
    spec["selector"] = json!({"matchLabels": {"app": "x"}});
    pdbs.create(&PostParams::default(), &pdb("budget", spec))
        .await
        .unwrap();
    create_pod(&pods, &pod("unrelated", Some("n1"), json!({"app": "y"})))
        .await
        .unwrap();
    for i in 0..pods_n {
        create_pod(
            &pods,
            &pod(&format!("p{i}"), Some("n1"), json!({"app": "x"})),
        )
        .await
        .unwrap();
    }
    let mut codes = Vec::new();
    for i in 0..pods_n {
        codes.push(match evict(&pods, &format!("p{i}")).await {
            Ok(_) => 201,
            Err(kube::Error::Api(s)) => {
                assert_eq!(s.reason, "TooManyRequests");
                s.code
            }
            Err(e) => panic!("{e}"),
        });
    }
    codes
}

#[tokio::test]
async fn eviction_budgets_count_healthy_pods() {
    // maxUnavailable 1 of 3: one eviction, then blocked (the evicted pod is terminating).
    assert_eq!(
        budget_case(json!({"maxUnavailable": 1}), 3).await,
        vec![201, 429, 429]
    );
    // maxUnavailable 50% of 3 rounds up to 2.
    assert_eq!(
        budget_case(json!({"maxUnavailable": "50%"}), 3).await,
        vec![201, 201, 429]
    );
    // minAvailable 2 of 3.
    assert_eq!(
        budget_case(json!({"minAvailable": 2}), 3).await,
        vec![201, 429, 429]
    );
    // minAvailable 50% of 3 rounds up to 2.
    assert_eq!(
        budget_case(json!({"minAvailable": "50%"}), 3).await,
        vec![201, 429, 429]
    );
    // minAvailable 0 never blocks.
    assert_eq!(
        budget_case(json!({"minAvailable": 0}), 2).await,
        vec![201, 201]
    );
}

#[tokio::test]
async fn eviction_of_unready_pods_follows_the_unhealthy_pod_policy() {
    let (_emu, client) = setup_no_retry().await;
    let pods: Api<Pod> = Api::default_namespaced(client.clone());
    let pdbs: Api<PodDisruptionBudget> = Api::default_namespaced(client);
    pdbs.create(
        &PostParams::default(),
        &pdb(
            "one",
            json!({"minAvailable": 1, "selector": {"matchLabels": {"app": "x"}}}),
        ),
    )
    .await
    .unwrap();
    let mut unready = pod("unready", Some("n1"), json!({"app": "x"}));
    unready
        .status
        .as_mut()
        .unwrap()
        .conditions
        .as_mut()
        .unwrap()[0]
        .status = "False".into();
    create_pod(&pods, &unready).await.unwrap();
    create_pod(&pods, &pod("ready", Some("n1"), json!({"app": "x"})))
        .await
        .unwrap();
    // IfHealthyBudget: the budget is met (1 healthy of 1 needed), so the unready pod may go.
    evict(&pods, "unready").await.unwrap();
    // The last healthy pod may not.
    let s = api_err(evict(&pods, "ready").await);
    assert_eq!(s.code, 429);
    assert_eq!(
        s.details.unwrap().causes[0].message,
        "The disruption budget one needs 1 healthy pods and has 1 currently"
    );
}

// ---------------------------------------------------------------- discovery, journal, faults

#[tokio::test]
async fn discovery_finds_every_served_type() {
    let (_emu, client) = setup().await;
    let d = kube::discovery::Discovery::new(client.clone())
        .run()
        .await
        .unwrap();
    let (ar, caps) = d
        .resolve_gvk(&GroupVersionKind::gvk("agones.dev", "v1", "GameServer"))
        .expect("GameServer discovered");
    assert_eq!(ar.plural, "gameservers");
    assert!(caps.supports_operation(kube::discovery::verbs::WATCH));
    assert_eq!(caps.scope, kube::discovery::Scope::Namespaced);
    for (g, v, k) in [
        ("", "v1", "Pod"),
        ("", "v1", "Node"),
        ("policy", "v1", "PodDisruptionBudget"),
        ("events.k8s.io", "v1", "Event"),
        ("coordination.k8s.io", "v1", "Lease"),
        ("agones.dev", "v1", "Fleet"),
    ] {
        assert!(
            d.resolve_gvk(&GroupVersionKind::gvk(g, v, k)).is_some(),
            "{g}/{v} {k}"
        );
    }
    let info = client.apiserver_version().await.unwrap();
    assert_eq!(info.major, "1");
}

#[tokio::test]
async fn journal_records_requests_per_identity() {
    let (emu, _client) = setup().await;
    let agent = emu.client_as("agent-7").await.unwrap();
    let pods: Api<Pod> = Api::default_namespaced(agent.clone());
    let cms: Api<ConfigMap> = Api::default_namespaced(agent);
    emu.journal().clear();
    assert_eq!(api_err(pods.get("nope").await).code, 404);
    pods.list(&ListParams::default().labels("a=b"))
        .await
        .unwrap();
    cms.create(&PostParams::default(), &cm("c1")).await.unwrap();
    let e = emu.journal().entries();
    assert_eq!(e.len(), 3);
    assert_eq!(e[0].identity.as_deref(), Some("agent-7"));
    assert_eq!(
        (e[0].verb, e[0].method.as_str(), e[0].status),
        (Verb::Get, "GET", 404)
    );
    assert_eq!(e[0].path, "/api/v1/namespaces/default/pods/nope");
    assert_eq!(
        (
            e[0].resource.as_deref(),
            e[0].namespace.as_deref(),
            e[0].name.as_deref()
        ),
        (Some("pods"), Some("default"), Some("nope"))
    );
    assert_eq!((e[1].verb, e[1].status), (Verb::List, 200));
    assert!(e[1].query.contains("labelSelector=a%3Db"), "{}", e[1].query);
    assert_eq!((e[2].verb, e[2].status), (Verb::Create, 201));
    assert!(e[0].seq < e[1].seq && e[1].seq < e[2].seq);
    assert_eq!(emu.journal().mutating_count(), 1);
    assert_eq!(emu.journal().requests_for("agent-7"), 3);
    assert!(emu.journal().bytes_for("agent-7") > 0);
    assert_eq!(emu.journal().bytes_for("someone-else"), 0);
    // Watch events are counted per identity.
    let mut w = cms
        .watch(&WatchParams::default(), "0")
        .await
        .unwrap()
        .boxed();
    assert_eq!(describe(&next_event(&mut w).await), ev("ADDED", "c1"));
    assert!(emu.journal().watch_events_for("agent-7") >= 1);
    assert_eq!(emu.journal().count(|e| e.verb == Verb::Watch), 1);
}

#[tokio::test]
async fn injected_faults_fail_or_delay_the_next_matching_requests() {
    let (emu, client) = setup_no_retry().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    cms.create(&PostParams::default(), &cm("c1")).await.unwrap();
    emu.faults().inject(FaultRule::status(
        Some(Method::GET),
        "/configmaps/c1",
        2,
        500,
    ));
    for _ in 0..2 {
        let s = api_err(cms.get("c1").await);
        assert_eq!((s.code, s.reason.as_str()), (500, "InternalError"));
    }
    assert!(cms.get("c1").await.is_ok());
    // Method filter: a PATCH is not affected by a GET rule.
    emu.faults().inject(FaultRule {
        method: Some(Method::GET),
        path_contains: "/configmaps/c1".into(),
        times: 1,
        action: FaultAction::Status(429),
    });
    cms.patch(
        "c1",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"k": "2"}})),
    )
    .await
    .unwrap();
    let s = api_err(cms.get("c1").await);
    assert_eq!((s.code, s.reason.as_str()), (429, "TooManyRequests"));
    assert_eq!(emu.faults().pending(), 0);
    // Delays hold the request, then serve it.
    let delay = Duration::from_millis(300);
    emu.faults()
        .inject(FaultRule::delay(None, "/configmaps/c1", 1, delay));
    let t0 = std::time::Instant::now();
    assert_eq!(cms.get("c1").await.unwrap().data.unwrap()["k"], "2");
    assert!(t0.elapsed() >= delay);
    assert_eq!(emu.faults().pending(), 0);
    let failed = emu.journal().count(|e| e.status == 500);
    assert_eq!(failed, 2);
    // kube's default client retries a 503 by itself: two requests, one success.
    let retrying: Api<ConfigMap> =
        Api::default_namespaced(emu.client_as("retrying").await.unwrap());
    emu.faults()
        .inject(FaultRule::status(None, "/configmaps/c1", 1, 503));
    assert!(retrying.get("c1").await.is_ok());
    let statuses: Vec<u16> = emu
        .journal()
        .filter(|e| e.identity.as_deref() == Some("retrying"))
        .iter()
        .map(|e| e.status)
        .collect();
    assert_eq!(statuses, vec![503, 200]);
}

// ---------------------------------------------------------------- Agones, events, status

fn gs_resource() -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk("agones.dev", "v1", "GameServer"))
}

fn gameserver(name: &str) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "agones.dev/v1",
        "kind": "GameServer",
        "metadata": { "name": name },
        "spec": { "ports": [{ "name": "default", "containerPort": 7654 }], "eviction": { "safe": "OnUpgrade" } },
        "status": { "state": "Ready", "nodeName": "n1" },
    }))
    .unwrap()
}

#[tokio::test]
async fn gameserver_status_travels_with_the_object() {
    let (emu, client) = setup().await;
    let gs: Api<DynamicObject> = Api::default_namespaced_with(client, &gs_resource());
    let created = gs
        .create(&PostParams::default(), &gameserver("gs1"))
        .await
        .unwrap();
    assert_eq!(created.data["status"]["state"], "Ready");
    let mut allocated = gs.get("gs1").await.unwrap();
    allocated.data["status"]["state"] = json!("Allocated");
    let stored = gs
        .replace("gs1", &PostParams::default(), &allocated)
        .await
        .unwrap();
    assert_eq!(stored.data["status"]["state"], "Allocated");
    // A second allocator holding the old version loses.
    let mut late = created.clone();
    late.data["status"]["state"] = json!("Allocated");
    let s = api_err(gs.replace("gs1", &PostParams::default(), &late).await);
    assert_eq!((s.code, s.reason.as_str()), (409, "Conflict"));
    assert_eq!(s.details.unwrap().group, "agones.dev");
    assert!(
        s.message.contains("gameservers.agones.dev \"gs1\""),
        "{}",
        s.message
    );
    let in_store = emu
        .store()
        .get(&GAMESERVERS, Some("default"), "gs1")
        .unwrap();
    assert_eq!(in_store["status"]["state"], "Allocated");
    assert_eq!(in_store["metadata"]["generation"], 2);
    assert_eq!(
        gs.list(&ListParams::default()).await.unwrap().items.len(),
        1
    );
}

/// The GameServer CRD's selectable fields (Agones 1.58 and later): refused by an older CRD
/// with a real server's 400, served by a newer one on lists and watches, an absent field
/// reading as "" and a watch seeing a server arrive when Agones names its node.
#[tokio::test]
async fn gameserver_selectable_fields_follow_the_crd() {
    let (emu, client) = setup().await;
    let gs: Api<DynamicObject> = Api::default_namespaced_with(client.clone(), &gs_resource());
    let all: Api<DynamicObject> = Api::all_with(client, &gs_resource());
    let pp = PostParams::default();
    gs.create(&pp, &gameserver("on-n1")).await.unwrap();
    let mut starting = gameserver("starting");
    starting.data["status"] = json!({"state": "Starting"});
    gs.create(&pp, &starting).await.unwrap();
    let q = |s: &str| ListParams::default().fields(s);

    // An older Agones: only metadata fields, worded as for any custom resource.
    let s = api_err(all.list(&q("status.nodeName=n1")).await);
    assert_eq!((s.code, s.reason.as_str()), (400, "BadRequest"));
    assert!(
        s.message.contains("not a known field selector"),
        "{}",
        s.message
    );
    match all
        .watch(&WatchParams::default().fields("status.nodeName=n1"), "0")
        .await
    {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 400),
        Err(e) => panic!("not an API error: {e}"),
        Ok(_) => panic!("an older CRD's watch must be refused"),
    }

    emu.set_agones_selectable_fields(true);
    let names = |l: kube::api::ObjectList<DynamicObject>| {
        l.items.iter().map(|o| o.name_any()).collect::<Vec<_>>()
    };
    assert_eq!(
        names(all.list(&q("status.nodeName=n1")).await.unwrap()),
        vec!["on-n1"]
    );
    assert_eq!(
        names(all.list(&q("status.nodeName=")).await.unwrap()),
        vec!["starting"]
    );
    assert_eq!(
        names(all.list(&q("status.state=Starting")).await.unwrap()),
        vec!["starting"]
    );
    // Only the declared fields.
    let s = api_err(all.list(&q("spec.scheduling=Packed")).await);
    assert_eq!(s.code, 400);
    assert!(s.message.contains("\"status.nodeName\""), "{}", s.message);

    let start = emu.store().resource_version();
    let mut w = all
        .watch(
            &WatchParams::default().fields("status.nodeName=n1"),
            &start.to_string(),
        )
        .await
        .unwrap()
        .boxed();
    gs.patch(
        "starting",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"state": "Scheduled", "nodeName": "n1"}})),
    )
    .await
    .unwrap();
    gs.delete("on-n1", &DeleteParams::default()).await.unwrap();
    assert_eq!(describe(&next_event(&mut w).await), ev("ADDED", "starting"));
    assert_eq!(describe(&next_event(&mut w).await), ev("DELETED", "on-n1"));

    // Agones reinstalled without them: the next list is refused again.
    emu.set_agones_selectable_fields(false);
    assert_eq!(api_err(all.list(&q("status.nodeName=n1")).await).code, 400);
}

#[tokio::test]
async fn event_recorder_creates_then_patches_events() {
    use kube::runtime::events::{Event, EventType, Recorder, Reporter};
    let (emu, client) = setup().await;
    let pods: Api<Pod> = Api::default_namespaced(client.clone());
    let p = pods
        .create(&PostParams::default(), &pod("p1", None, json!({})))
        .await
        .unwrap();
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "lastcall".into(),
            instance: None,
        },
    );
    let reference = kube::Resource::object_ref(&p, &());
    let event = Event {
        type_: EventType::Normal,
        reason: "Draining".into(),
        note: Some("node is going away".into()),
        action: "Drain".into(),
        secondary: None,
    };
    recorder.publish(&event, &reference).await.unwrap();
    recorder.publish(&event, &reference).await.unwrap();
    let path = "/apis/events.k8s.io/v1/namespaces/default/events";
    assert_eq!(
        emu.journal()
            .count(|e| e.path == path && e.verb == Verb::Create && e.status == 201),
        1
    );
    assert_eq!(
        emu.journal()
            .count(|e| e.path.starts_with(path) && e.verb == Verb::Patch && e.status == 200),
        1
    );
    let (events, _) = emu.store().list(&EVENTS_K8S, Some("default"));
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["series"]["count"], 2);
    assert_eq!(events[0]["regarding"]["name"], "p1");
    // Core v1 events accept create and patch too.
    let core: Api<k8s_openapi::api::core::v1::Event> = Api::default_namespaced(client);
    let e: k8s_openapi::api::core::v1::Event = serde_json::from_value(json!({
        "metadata": { "name": "p1.1" },
        "involvedObject": { "kind": "Pod", "name": "p1", "namespace": "default" },
        "reason": "Draining",
        "count": 1,
    }))
    .unwrap();
    core.create(&PostParams::default(), &e).await.unwrap();
    let patched = core
        .patch(
            "p1.1",
            &PatchParams::default(),
            &Patch::Merge(json!({"count": 2})),
        )
        .await
        .unwrap();
    assert_eq!(patched.count, Some(2));
    let listed = core
        .list(&ListParams::default().fields("involvedObject.name=p1"))
        .await
        .unwrap();
    assert_eq!(listed.items.len(), 1);
}

#[tokio::test]
async fn status_subresource_and_nodes() {
    let (emu, client) = setup().await;
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "n1"}})).unwrap(),
        )
        .await
        .unwrap();
    nodes
        .patch(
            "n1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"unschedulable": true}})),
        )
        .await
        .unwrap();
    let cordoned = nodes
        .list(&ListParams::default().fields("spec.unschedulable=true"))
        .await
        .unwrap();
    assert_eq!(cordoned.items.len(), 1);
    let n = nodes
        .patch_status(
            "n1",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"conditions": [{"type": "Ready", "status": "True"}]}})),
        )
        .await
        .unwrap();
    assert_eq!(n.status.unwrap().conditions.unwrap()[0].type_, "Ready");
    let stored = emu.store().get(&NODES, None, "n1").unwrap();
    assert_eq!(stored["status"]["conditions"][0]["status"], "True");
    let e = emu
        .journal()
        .filter(|e| e.subresource.as_deref() == Some("status"));
    assert_eq!((e.len(), e[0].verb), (1, Verb::Patch));
    // Pods created without status start Pending, as on a real server.
    let pods: Api<Pod> = Api::default_namespaced(client);
    let mut bare = pod("bare", None, json!({}));
    bare.status = None;
    let created = pods.create(&PostParams::default(), &bare).await.unwrap();
    assert_eq!(created.status.unwrap().phase.as_deref(), Some("Pending"));
}

#[tokio::test]
async fn store_modify_is_atomic_and_skips_no_ops() {
    let store = Store::new(100);
    let created = store
        .create(
            &PODS,
            Some("default"),
            serde_json::to_value(pod("p1", Some("n1"), json!({}))).unwrap(),
        )
        .unwrap();
    let mut sub = store.subscribe();
    let rv = store.resource_version();
    let same = store
        .modify(&PODS, Some("default"), "p1", |_| Ok(()))
        .unwrap();
    assert_eq!(same, created);
    assert_eq!(store.resource_version(), rv);
    let changed = store
        .modify_status(&PODS, Some("default"), "p1", |o| {
            o["status"]["phase"] = json!("Succeeded");
            Ok(())
        })
        .unwrap();
    assert_eq!(changed["metadata"]["resourceVersion"], (rv + 1).to_string());
    let e = sub.recv().await.unwrap();
    assert_eq!((e.rv, e.name.as_str()), (rv + 1, "p1"));
    assert_eq!(e.old.as_ref().unwrap()["status"]["phase"], "Pending");
    // A closure error leaves the object alone.
    let err = store
        .modify(&PODS, Some("default"), "p1", |_| {
            Err(lastcall_testkit::kube::ApiError::bad_request("no"))
        })
        .unwrap_err();
    assert_eq!(err.code, 400);
    assert_eq!(store.resource_version(), rv + 1);
    assert_eq!(store.events_since(rv).unwrap().len(), 1);
}

// ---------------------------------------------------------------- the binary

#[tokio::test]
async fn binary_writes_a_kubeconfig_serves_and_exits_zero_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig.yaml");
    let bin = workspace_binary("lastcall-emulators", "lastcall-kube-emulator");
    let child = tokio::process::Command::new(bin)
        .args(["--listen", "127.0.0.1:0", "--kubeconfig-out"])
        .arg(&kubeconfig)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let path = kubeconfig.clone();
    wait_for("the emulator writes its kubeconfig", || {
        let path = path.clone();
        async move { path.exists().then_some(()) }
    })
    .await;
    let kc = kube::config::Kubeconfig::read_from(&kubeconfig).unwrap();
    let config =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .unwrap();
    let client = Client::try_from(config).unwrap();
    let nodes: Api<Node> = Api::all(client);
    assert!(
        nodes
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
    signal(child.id().unwrap(), "TERM").await.unwrap();
    let out = tokio::time::timeout(Duration::from_secs(20), child.wait_with_output())
        .await
        .expect("the emulator exits after SIGTERM")
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(stdout.starts_with("http://127.0.0.1:"), "{stdout}");
}

// ---------------------------------------------------------------- strictness: faults

#[tokio::test]
async fn watch_delivery_delay_holds_only_the_matching_watch() {
    use lastcall_testkit::kube::WatchDelay;
    let (emu, client) = setup().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    let start = emu.store().resource_version().to_string();
    let mut prompt = pods
        .watch(&WatchParams::default().fields("spec.nodeName=n2"), &start)
        .await
        .unwrap()
        .boxed();
    let mut late = pods
        .watch(&WatchParams::default().fields("spec.nodeName=n1"), &start)
        .await
        .unwrap()
        .boxed();
    // Open watches are affected too: the rule is looked up for every line.
    emu.faults().delay_watches(
        WatchDelay::resource("pods", Duration::from_secs(3)).selector("spec.nodeName=n1"),
    );
    pods.create(&PostParams::default(), &pod("p1", Some("n1"), json!({})))
        .await
        .unwrap();
    pods.create(&PostParams::default(), &pod("p2", Some("n2"), json!({})))
        .await
        .unwrap();
    // The undelayed watch sees its pod, which was created after p1...
    assert_eq!(describe(&next_event(&mut prompt).await), ev("ADDED", "p2"));
    // ...while the delayed one still has nothing: its cache is stale.
    let early = tokio::time::timeout(Duration::from_millis(300), late.next()).await;
    assert!(early.is_err(), "the delayed watch got {early:?} early");
    assert!(emu.store().get(&PODS, Some("default"), "p1").is_some());
    // It arrives later, intact and in order.
    assert_eq!(describe(&next_event(&mut late).await), ev("ADDED", "p1"));
    // Without the rule, delivery is prompt again.
    emu.faults().clear_watch_delays();
    pods.delete("p1", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    let deleted = tokio::time::timeout(Duration::from_secs(2), next_event(&mut late)).await;
    assert_eq!(describe(&deleted.unwrap()), ev("DELETED", "p1"));
}

#[tokio::test]
async fn watch_delay_matches_identity_and_resource() {
    use lastcall_testkit::kube::{WatchDelay, WatchKey};
    let faults = lastcall_testkit::kube::Faults::default();
    faults.delay_watches(
        WatchDelay::resource("gameservers", Duration::from_secs(1)).identity("agent-n1"),
    );
    let key = |resource: &str, identity: &str| WatchKey {
        resource: resource.into(),
        identity: Some(identity.into()),
        ..Default::default()
    };
    assert_eq!(
        faults.watch_delay(&key("gameservers", "agent-n1")),
        Duration::from_secs(1)
    );
    assert_eq!(
        faults.watch_delay(&key("gameservers", "other")),
        Duration::ZERO
    );
    assert_eq!(faults.watch_delay(&key("pods", "agent-n1")), Duration::ZERO);
    faults.clear();
    assert_eq!(
        faults.watch_delay(&key("gameservers", "agent-n1")),
        Duration::ZERO
    );
}

#[tokio::test]
async fn hang_fault_holds_a_request_until_released_or_abandoned() {
    let (emu, client) = setup_no_retry().await;
    // A client that gives up after 300 ms never gets an answer, and nothing is served.
    emu.faults()
        .inject(FaultRule::hang(Some(Method::POST), "/configmaps", 1));
    let http = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let err = http
        .post(format!(
            "{}/api/v1/namespaces/default/configmaps",
            emu.url()
        ))
        .header("content-type", "application/json")
        .body(json!({"metadata": {"name": "c1"}}).to_string())
        .send()
        .await
        .unwrap_err();
    assert!(err.is_timeout(), "{err:?}");
    wait_for("the abandoned request to be let go", || async {
        (emu.faults().hung_now() == 0).then_some(())
    })
    .await;
    assert!(
        emu.store()
            .get(&CONFIGMAPS, Some("default"), "c1")
            .is_none()
    );
    assert_eq!(emu.journal().count(|e| e.verb == Verb::Create), 0);

    // A patient client is held until the fault is released, then served.
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    emu.faults()
        .inject(FaultRule::hang(Some(Method::POST), "/configmaps", 1));
    let call = tokio::spawn(async move { cms.create(&PostParams::default(), &cm("c2")).await });
    wait_for("the request to be held", || async {
        (emu.faults().hung_now() == 1).then_some(())
    })
    .await;
    assert!(
        emu.store()
            .get(&CONFIGMAPS, Some("default"), "c2")
            .is_none()
    );
    emu.faults().release_hangs();
    call.await.unwrap().unwrap();
    assert!(
        emu.store()
            .get(&CONFIGMAPS, Some("default"), "c2")
            .is_some()
    );
    assert_eq!(emu.faults().hung_now(), 0);
    assert_eq!(emu.faults().pending(), 0);
}

// ---------------------------------------------------------------- strictness: /status

#[tokio::test]
async fn pod_status_is_written_only_through_status() {
    let (emu, client) = setup().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    // A create never keeps a pod's status.
    let created = pods
        .create(&PostParams::default(), &pod("p1", Some("n1"), json!({})))
        .await
        .unwrap();
    let status = created.status.clone().unwrap();
    assert_eq!(status.phase.as_deref(), Some("Pending"));
    assert!(status.conditions.is_none());
    // The main resource ignores status, but applies the rest of the patch.
    let patched = pods
        .patch(
            "p1",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"metadata": {"labels": {"a": "1"}}, "status": {"phase": "Running"}}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(patched.labels().get("a").map(String::as_str), Some("1"));
    assert_eq!(patched.status.unwrap().phase.as_deref(), Some("Pending"));
    // /status changes the status and ignores spec changes.
    let patched = pods
        .patch_status(
            "p1",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"activeDeadlineSeconds": 5}, "status": {"phase": "Running"}}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(patched.status.unwrap().phase.as_deref(), Some("Running"));
    assert_eq!(patched.spec.unwrap().active_deadline_seconds, None);
    // A PUT of the main resource with another status keeps the stored one.
    let mut p = pods.get("p1").await.unwrap();
    p.status.as_mut().unwrap().phase = Some("Failed".into());
    let replaced = pods
        .replace("p1", &PostParams::default(), &p)
        .await
        .unwrap();
    assert_eq!(
        replaced.status.as_ref().unwrap().phase.as_deref(),
        Some("Running")
    );
    // A main write that only touched status changed nothing: no new resourceVersion.
    assert_eq!(rv_of(&replaced), rv_of(&p));
    let stored = emu.store().get(&PODS, Some("default"), "p1").unwrap();
    assert_eq!(stored["status"]["phase"], "Running");
}

#[tokio::test]
async fn node_status_is_written_only_through_status() {
    let (_emu, client) = setup().await;
    let nodes: Api<Node> = Api::all(client);
    // A node registers with its status (the kubelet's create keeps it).
    let n: Node = serde_json::from_value(json!({
        "metadata": {"name": "n1"},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    }))
    .unwrap();
    let created = nodes.create(&PostParams::default(), &n).await.unwrap();
    assert_eq!(created.status.unwrap().conditions.unwrap().len(), 1);
    let patched = nodes
        .patch(
            "n1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"unschedulable": true}, "status": {"conditions": []}})),
        )
        .await
        .unwrap();
    assert_eq!(patched.spec.unwrap().unschedulable, Some(true));
    assert_eq!(patched.status.unwrap().conditions.unwrap().len(), 1);
    let patched = nodes
        .patch_status(
            "n1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"unschedulable": false}, "status": {"conditions": [{"type": "Ready", "status": "False"}]}})),
        )
        .await
        .unwrap();
    assert_eq!(patched.spec.unwrap().unschedulable, Some(true));
    assert_eq!(
        patched.status.unwrap().conditions.unwrap()[0].status,
        "False"
    );
}

fn fleet_resource() -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk("agones.dev", "v1", "Fleet"))
}

#[tokio::test]
async fn custom_resource_status_subresource_only_for_fleets() {
    let (_emu, client) = setup().await;
    let fleets: Api<DynamicObject> =
        Api::default_namespaced_with(client.clone(), &fleet_resource());
    let f: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "agones.dev/v1", "kind": "Fleet",
        "metadata": {"name": "f1"},
        "spec": {"replicas": 2},
        "status": {"replicas": 9},
    }))
    .unwrap();
    let created = fleets.create(&PostParams::default(), &f).await.unwrap();
    assert!(
        created.data.get("status").is_none(),
        "a CR create drops status"
    );
    let patched = fleets
        .patch(
            "f1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 3}, "status": {"replicas": 9}})),
        )
        .await
        .unwrap();
    assert_eq!(patched.data["spec"]["replicas"], 3);
    assert!(patched.data.get("status").is_none());
    // /status on a CR changes the status only: spec and metadata changes are dropped.
    let patched = fleets
        .patch_status(
            "f1",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"x": "1"}}, "spec": {"replicas": 1}, "status": {"replicas": 3}})),
        )
        .await
        .unwrap();
    assert_eq!(patched.data["status"]["replicas"], 3);
    assert_eq!(patched.data["spec"]["replicas"], 3);
    assert!(patched.labels().is_empty());
    // GameServers have no status subresource (their CRD declares none).
    let gs: Api<DynamicObject> = Api::default_namespaced_with(client, &gs_resource());
    gs.create(&PostParams::default(), &gameserver("gs1"))
        .await
        .unwrap();
    let s = api_err(
        gs.patch_status(
            "gs1",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"state": "Allocated"}})),
        )
        .await,
    );
    assert_eq!(s.code, 404);
}

#[tokio::test]
async fn custom_resource_put_needs_a_resource_version() {
    let (emu, client) = setup().await;
    let gs: Api<DynamicObject> = Api::default_namespaced_with(client.clone(), &gs_resource());
    gs.create(&PostParams::default(), &gameserver("gs1"))
        .await
        .unwrap();
    let mut unconditional = gs.get("gs1").await.unwrap();
    unconditional.metadata.resource_version = None;
    unconditional.data["status"]["state"] = json!("Allocated");
    let s = api_err(
        gs.replace("gs1", &PostParams::default(), &unconditional)
            .await,
    );
    assert_eq!((s.code, s.reason.as_str()), (422, "Invalid"));
    assert_eq!(
        s.message,
        "GameServer.agones.dev \"gs1\" is invalid: metadata.resourceVersion: Invalid value: 0x0: must be specified for an update"
    );
    let stored = emu
        .store()
        .get(&GAMESERVERS, Some("default"), "gs1")
        .unwrap();
    assert_eq!(stored["status"]["state"], "Ready");
    // With the resourceVersion it goes through; core types still allow unconditional PUTs.
    let current = gs.get("gs1").await.unwrap();
    unconditional.metadata.resource_version = current.metadata.resource_version;
    gs.replace("gs1", &PostParams::default(), &unconditional)
        .await
        .unwrap();
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    cms.create(&PostParams::default(), &cm("c1")).await.unwrap();
    let mut c = cm("c1");
    c.data = Some([("k".to_string(), "w".to_string())].into());
    let replaced = cms.replace("c1", &PostParams::default(), &c).await.unwrap();
    assert_eq!(replaced.data.unwrap()["k"], "w");
}

// ---------------------------------------------------------------- strictness: validation

#[tokio::test]
async fn labels_and_annotation_keys_are_validated() {
    let (emu, client) = setup().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(client.clone());
    let long = "n".repeat(64);
    let mut bad = cm("c1");
    bad.metadata.labels = Some([("node".to_string(), long.clone())].into());
    let s = api_err(cms.create(&PostParams::default(), &bad).await);
    assert_eq!((s.code, s.reason.as_str()), (422, "Invalid"));
    assert_eq!(
        s.message,
        format!(
            "ConfigMap \"c1\" is invalid: metadata.labels: Invalid value: \"{long}\": must be no more than 63 characters"
        )
    );
    let cause = &s.details.unwrap().causes[0];
    assert_eq!(cause.field, "metadata.labels");
    assert_eq!(cause.reason, "FieldValueInvalid");
    assert!(
        emu.store()
            .get(&CONFIGMAPS, Some("default"), "c1")
            .is_none()
    );
    // 63 characters is fine.
    let mut ok = cm("c1");
    ok.metadata.labels = Some([("node".to_string(), "n".repeat(63))].into());
    cms.create(&PostParams::default(), &ok).await.unwrap();
    // A patch that would store a bad label or key is refused and changes nothing.
    for labels in [
        json!({"x": "-starts-with-a-dash"}),
        json!({"Bad_Prefix/x": "1"}),
        json!({"a/b/c": "1"}),
    ] {
        let s = api_err(
            cms.patch(
                "c1",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": labels}})),
            )
            .await,
        );
        assert_eq!(s.code, 422, "{labels}");
    }
    let s = api_err(
        cms.patch(
            "c1",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {"no spaces": "x"}}})),
        )
        .await,
    );
    assert_eq!(s.code, 422);
    let stored = cms.get("c1").await.unwrap();
    assert_eq!(stored.labels().len(), 1);
    // The same rules hold for custom resources (and the GameServer label selectors the
    // agent builds from node names).
    let gs: Api<DynamicObject> = Api::default_namespaced_with(client, &gs_resource());
    let mut g = gameserver("gs1");
    g.metadata.labels = Some([("lastcall.dev/node".to_string(), long)].into());
    let s = api_err(gs.create(&PostParams::default(), &g).await);
    assert_eq!(s.code, 422);
    assert!(
        s.message
            .starts_with("GameServer.agones.dev \"gs1\" is invalid"),
        "{}",
        s.message
    );
}

#[tokio::test]
async fn duplicate_taints_are_invalid() {
    let (_emu, client) = setup().await;
    let nodes: Api<Node> = Api::all(client);
    let with_taints = |taints: Value| -> Node {
        serde_json::from_value(json!({"metadata": {"name": "n1"}, "spec": {"taints": taints}}))
            .unwrap()
    };
    let s = api_err(
        nodes
            .create(
                &PostParams::default(),
                &with_taints(json!([
                    {"key": "k", "value": "a", "effect": "NoSchedule"},
                    {"key": "k", "value": "b", "effect": "NoSchedule"},
                ])),
            )
            .await,
    );
    assert_eq!((s.code, s.reason.as_str()), (422, "Invalid"));
    assert_eq!(
        s.message,
        "Node \"n1\" is invalid: spec.taints[1]: Duplicate value: core.Taint{Key:\"k\", Value:\"b\", Effect:\"NoSchedule\", TimeAdded:<nil>}: taints must be unique by key and effect pair"
    );
    assert_eq!(s.details.unwrap().causes[0].reason, "FieldValueDuplicate");
    // Same key, other effect: fine.
    nodes
        .create(
            &PostParams::default(),
            &with_taints(json!([
                {"key": "k", "effect": "NoSchedule"},
                {"key": "k", "effect": "NoExecute"},
            ])),
        )
        .await
        .unwrap();
    // A JSON patch appending a duplicate is refused; the node keeps two taints.
    let s = api_err(
        nodes
            .patch(
                "n1",
                &PatchParams::default(),
                &Patch::Json::<()>(
                    serde_json::from_value(json!([
                        {"op": "add", "path": "/spec/taints/-", "value": {"key": "k", "value": "x", "effect": "NoExecute"}}
                    ]))
                    .unwrap(),
                ),
            )
            .await,
    );
    assert_eq!(s.code, 422);
    let s = api_err(
        nodes
            .patch(
                "n1",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"taints": [{"key": "k", "effect": "Sometimes"}]}})),
            )
            .await,
    );
    assert_eq!(s.code, 422);
    assert!(
        s.message.contains("Unsupported value: \"Sometimes\""),
        "{}",
        s.message
    );
    let n = nodes.get("n1").await.unwrap();
    assert_eq!(n.spec.unwrap().taints.unwrap().len(), 2);
}

#[tokio::test]
async fn pod_spec_is_immutable_but_for_what_the_server_allows() {
    let (_emu, client) = setup().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    let mut p = pod("p1", Some("n1"), json!({}));
    p.spec.as_mut().unwrap().tolerations = Some(vec![
        serde_json::from_value(json!({"key": "k", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30})).unwrap(),
    ]);
    pods.create(&PostParams::default(), &p).await.unwrap();
    let patch = |v: Value| {
        let pods = pods.clone();
        async move {
            pods.patch("p1", &PatchParams::default(), &Patch::Merge(v))
                .await
        }
    };
    let current_tolerations = || {
        let pods = pods.clone();
        async move {
            pods.get("p1")
                .await
                .unwrap()
                .spec
                .unwrap()
                .tolerations
                .unwrap()
        }
    };
    // Allowed: an image, labels, activeDeadlineSeconds set then lowered, a toleration
    // added, and the tolerationSeconds of an existing one.
    patch(json!({"spec": {"containers": [{"name": "c", "image": "example:2"}]}}))
        .await
        .unwrap();
    patch(json!({"metadata": {"labels": {"x": "1"}}}))
        .await
        .unwrap();
    patch(json!({"spec": {"activeDeadlineSeconds": 60}}))
        .await
        .unwrap();
    patch(json!({"spec": {"activeDeadlineSeconds": 30}}))
        .await
        .unwrap();
    let mut tols: Vec<Value> = current_tolerations()
        .await
        .into_iter()
        .map(|t| serde_json::to_value(t).unwrap())
        .collect();
    tols[0]["tolerationSeconds"] = json!(5);
    tols.push(
        json!({"key": "lastcall.dev/draining", "operator": "Exists", "effect": "NoSchedule"}),
    );
    patch(json!({"spec": {"tolerations": tols}})).await.unwrap();
    assert_eq!(current_tolerations().await.len(), 4);

    // Refused with 422: removing a toleration, moving the pod, raising or unsetting the
    // deadline, changing anything else in the spec.
    let forbidden = [
        (
            json!({"spec": {"tolerations": []}}),
            "spec.tolerations: Forbidden: existing toleration can not be modified except its tolerationSeconds",
        ),
        (
            json!({"spec": {"nodeName": "n2"}}),
            "spec: Forbidden: pod updates may not change fields other than",
        ),
        (
            json!({"spec": {"activeDeadlineSeconds": 90}}),
            "spec.activeDeadlineSeconds: Invalid value: 90: must be less than or equal to previous value",
        ),
        (
            json!({"spec": {"activeDeadlineSeconds": null}}),
            "must not update from a positive integer to nil value",
        ),
        (
            json!({"spec": {"terminationGracePeriodSeconds": 5}}),
            "spec: Forbidden",
        ),
        (
            json!({"spec": {"containers": [{"name": "c2", "image": "example:2"}]}}),
            "spec: Forbidden",
        ),
    ];
    for (body, expected) in forbidden {
        let s = api_err(patch(body.clone()).await);
        assert_eq!((s.code, s.reason.as_str()), (422, "Invalid"), "{body}");
        assert!(s.message.contains(expected), "{body}: {}", s.message);
    }
    let stored = pods.get("p1").await.unwrap().spec.unwrap();
    assert_eq!(stored.node_name.as_deref(), Some("n1"));
    assert_eq!(stored.active_deadline_seconds, Some(30));
    assert_eq!(stored.tolerations.unwrap().len(), 4);
}

#[tokio::test]
async fn malformed_tolerations_are_invalid() {
    let (_emu, client) = setup().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    for (tol, expected) in [
        (
            json!({"key": "k", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 5}),
            "effect must be 'NoExecute' when `tolerationSeconds` is set",
        ),
        (
            json!({"operator": "Equal", "value": "x"}),
            "operator must be Exists when `key` is empty",
        ),
        (
            json!({"key": "k", "operator": "Exists", "value": "x"}),
            "value must be empty when `operator` is 'Exists'",
        ),
    ] {
        let mut p = pod("p1", None, json!({}));
        p.spec.as_mut().unwrap().tolerations =
            Some(vec![serde_json::from_value(tol.clone()).unwrap()]);
        let s = api_err(pods.create(&PostParams::default(), &p).await);
        assert_eq!(s.code, 422, "{tol}");
        assert!(s.message.contains(expected), "{tol}: {}", s.message);
    }
}

#[tokio::test]
async fn new_pods_get_default_toleration_seconds() {
    let (emu, client) = setup().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    let created = pods
        .create(&PostParams::default(), &pod("plain", None, json!({})))
        .await
        .unwrap();
    let tols: Vec<Value> = created
        .spec
        .unwrap()
        .tolerations
        .unwrap()
        .into_iter()
        .map(|t| serde_json::to_value(t).unwrap())
        .collect();
    assert_eq!(
        tols,
        vec![
            json!({"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}),
            json!({"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}),
        ]
    );
    // A pod that already tolerates not-ready keeps its own and gets only unreachable.
    let mut own = pod("own", None, json!({}));
    own.spec.as_mut().unwrap().tolerations = Some(vec![serde_json::from_value(
        json!({"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 5}),
    )
    .unwrap()]);
    let created = pods.create(&PostParams::default(), &own).await.unwrap();
    let tols = created.spec.unwrap().tolerations.unwrap();
    assert_eq!(tols.len(), 2);
    assert_eq!(tols[0].toleration_seconds, Some(5));
    assert_eq!(
        tols[1].key.as_deref(),
        Some("node.kubernetes.io/unreachable")
    );
    // A blanket toleration tolerates both: nothing is added.
    let mut blanket = pod("blanket", None, json!({}));
    blanket.spec.as_mut().unwrap().tolerations = Some(vec![
        serde_json::from_value(json!({"operator": "Exists"})).unwrap(),
    ]);
    let created = pods.create(&PostParams::default(), &blanket).await.unwrap();
    assert_eq!(created.spec.unwrap().tolerations.unwrap().len(), 1);
    // The control plane's own creates (the store) go through the same admission.
    let direct = emu
        .store()
        .create(
            &PODS,
            Some("default"),
            json!({"metadata": {"name": "direct"}, "spec": {"containers": [{"name": "c"}]}}),
        )
        .unwrap();
    assert_eq!(direct["spec"]["tolerations"].as_array().unwrap().len(), 2);
    // Only creation: other kinds are untouched.
    assert!(
        emu.store()
            .get(&CONFIGMAPS, Some("default"), "plain")
            .is_none()
    );
}

#[tokio::test]
async fn binding_assigns_a_node_once() {
    let (_emu, client) = setup().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    pods.create(&PostParams::default(), &pod("p1", None, json!({})))
        .await
        .unwrap();
    let binding = |node: &str| json!({"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "p1"}, "target": {"kind": "Node", "name": node}});
    let s: Status = pods
        .create_subresource("binding", "p1", &PostParams::default(), &binding("n1"))
        .await
        .unwrap();
    assert_eq!(s.code, 201);
    let p = pods.get("p1").await.unwrap();
    assert_eq!(p.spec.unwrap().node_name.as_deref(), Some("n1"));
    let conds = p.status.unwrap().conditions.unwrap();
    assert!(
        conds
            .iter()
            .any(|c| c.type_ == "PodScheduled" && c.status == "True")
    );
    let s = api_err(
        pods.create_subresource::<_, Status>(
            "binding",
            "p1",
            &PostParams::default(),
            &binding("n2"),
        )
        .await,
    );
    assert_eq!((s.code, s.reason.as_str()), (409, "Conflict"));
    assert!(
        s.message.contains("is already assigned to node \"n1\""),
        "{}",
        s.message
    );
    let s = api_err(
        pods.create_subresource::<_, Status>(
            "binding",
            "nope",
            &PostParams::default(),
            &binding("n2"),
        )
        .await,
    );
    assert_eq!(s.code, 404);
}

/// The journal is the order writes were applied in, and a write anyone has seen in the
/// store is already journaled: the tests order what happened by it. (A write was once
/// journaled after its response was built, so a test that saw it in the store could count
/// the journal without it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_seen_in_the_store_is_already_journaled() {
    let (emu, client) = setup().await;
    let cms: Api<ConfigMap> = Api::namespaced(client, "default");
    cms.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": "c"}, "data": {"n": "0"}})).unwrap(),
    )
    .await
    .unwrap();
    const WRITES: usize = 300;
    let writer = tokio::spawn(async move {
        for i in 1..=WRITES {
            cms.patch(
                "c",
                &PatchParams::default(),
                &Patch::Merge(json!({"data": {"n": i.to_string()}})),
            )
            .await
            .unwrap();
        }
    });
    let journal = emu.journal();
    let patched = || {
        journal
            .count(|e| e.method == "PATCH" && e.status < 300 && e.path.ends_with("/configmaps/c"))
    };
    let (mut checks, mut seen) = (0, 0);
    while seen < WRITES {
        // Read the store directly (as a test does), then the journal.
        seen = emu
            .store()
            .get(&CONFIGMAPS, Some("default"), "c")
            .and_then(|v| v["data"]["n"].as_str()?.parse().ok())
            .unwrap_or(0);
        let seen_at = std::time::SystemTime::now();
        let journaled = journal
            .filter(|e| e.method == "PATCH" && e.status < 300 && e.path.ends_with("/configmaps/c"));
        assert!(
            journaled.len() >= seen,
            "the store shows write {seen}, the journal holds {}",
            journaled.len()
        );
        // And its time is no later than the moment it was seen.
        if let Some(e) = seen.checked_sub(1).and_then(|i| journaled.get(i)) {
            assert!(
                e.at <= seen_at,
                "write {seen} journaled as after it was seen"
            );
        }
        checks += 1;
        tokio::task::yield_now().await;
    }
    writer.await.unwrap();
    assert_eq!(patched(), WRITES);
    assert!(checks > WRITES / 10, "the reader kept up: {checks} checks");
}

/// Each write's body is journaled as sent (a DELETE's options, a patch), also when an
/// injected fault answers instead; reads carry none; the remote journal serves them on
/// request. Tests check what a client asked for by it (a graceful eviction's preconditions
/// and grace period).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_bodies_are_journaled_as_sent() {
    let emu = Emulator::start_with_options(
        Store::new(100),
        "127.0.0.1:0".parse().unwrap(),
        Options {
            admin: true,
            ..Options::default()
        },
    )
    .await
    .unwrap();
    let client = emu.client_no_retry("test").await.unwrap();
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    let a = cms.create(&PostParams::default(), &cm("a")).await.unwrap();
    cms.patch(
        "a",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"k": "w"}})),
    )
    .await
    .unwrap();
    emu.faults().inject(FaultRule::status(
        Some(Method::DELETE),
        "/configmaps/a",
        1,
        503,
    ));
    let dp = DeleteParams {
        grace_period_seconds: Some(7),
        preconditions: Some(Preconditions {
            uid: a.metadata.uid.clone(),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    assert_eq!(api_err(cms.delete("a", &dp).await).code, 503);
    cms.delete("a", &dp).await.unwrap();
    cms.get_opt("a").await.unwrap();

    let j = emu.journal().entries();
    let by = |verb: Verb| j.iter().filter(move |e| e.verb == verb).collect::<Vec<_>>();
    let created = by(Verb::Create);
    assert_eq!(
        created[0]
            .request
            .as_deref()
            .map(|v| &v["metadata"]["name"]),
        Some(&json!("a"))
    );
    assert_eq!(
        by(Verb::Patch)[0].request.as_deref(),
        Some(&json!({"data": {"k": "w"}}))
    );
    let deletes = by(Verb::Delete);
    assert_eq!(
        deletes.iter().map(|e| e.status).collect::<Vec<_>>(),
        [503, 200]
    );
    for d in &deletes {
        let body = d.request.as_deref().expect("a DELETE's options");
        assert_eq!(body["gracePeriodSeconds"], json!(7), "{body}");
        assert_eq!(
            body["preconditions"]["uid"].as_str(),
            a.metadata.uid.as_deref(),
            "{body}"
        );
    }
    assert!(by(Verb::Get).iter().all(|e| e.request.is_none()));
    // The remote journal: without bodies unless asked.
    let remote = lastcall_testkit::kube::admin::RemoteJournal::new(&emu.url());
    let plain = remote.entries_since(0).await.unwrap();
    assert!(plain.iter().all(|e| e.request.is_none()));
    let full = remote.entries_with_bodies_since(0).await.unwrap();
    let remote_deletes: Vec<_> = full.iter().filter(|e| e.verb == Verb::Delete).collect();
    assert_eq!(remote_deletes.len(), 2);
    for (r, l) in remote_deletes.iter().zip(&deletes) {
        assert_eq!(r.request, l.request);
    }
}
