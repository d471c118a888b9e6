//! The Kubernetes API conformance cases, each written once and run on either backend: the
//! emulator (`tests/tests/kube_conformance.rs`) and the box's real API server
//! (`tests/tests/box_conformance.rs`). A case only speaks the API through a [`Backend`]: its
//! client, its namespace and its node names, so many cases share one box. What only the
//! emulator can show (its store, journal, faults, options) stays in `kube_conformance.rs`,
//! checked after the shared case; docs/testing.md lists where the two differ.

use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node, Pod, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::serde::de::DeserializeOwned;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, EvictParams, ListParams, Patch, PatchParams,
    PostParams, Preconditions, WatchEvent, WatchParams,
};
use kube::core::{GroupVersionKind, Status};
use kube::{Client, Resource, ResourceExt};
use serde_json::{Value, json};

use crate::eventually::wait_for;
use crate::kube::Emulator;
use crate::kube_box::agones::{self, Crd};

/// Where a case runs: a client, the case's own namespace and the prefix of its node names.
pub struct Backend {
    pub client: Client,
    pub ns: String,
    prefix: String,
    emu: Option<Emulator>,
}

impl Backend {
    /// A fresh emulator, namespace `default`, node names as written.
    pub async fn emulator() -> Backend {
        let emu = Emulator::start().await.expect("the emulator");
        let client = emu.client().await.expect("an emulator client");
        Backend::with_emulator(emu, client)
    }

    /// Like [`Backend::emulator`], with a client that shows 429/503 answers instead of
    /// retrying them (kube retries by default).
    pub async fn emulator_no_retry() -> Backend {
        let emu = Emulator::start().await.expect("the emulator");
        let client = emu
            .client_no_retry("test")
            .await
            .expect("an emulator client");
        Backend::with_emulator(emu, client)
    }

    fn with_emulator(emu: Emulator, client: Client) -> Backend {
        Backend {
            client,
            ns: "default".into(),
            prefix: String::new(),
            emu: Some(emu),
        }
    }

    /// A case's part of a shared API server (the box): namespace `ns`, created here, and
    /// node names prefixed `ns-`. `client` should not retry 429s (eviction cases read them).
    pub async fn on_server(client: Client, ns: &str) -> Backend {
        let b = Backend {
            client,
            ns: ns.to_string(),
            prefix: format!("{ns}-"),
            emu: None,
        };
        b.create_namespace(ns).await;
        agones::install_crd(&b.client, Crd::LabelsOnly)
            .await
            .expect("the GameServer CRD");
        b
    }

    /// The emulator behind this backend, for the checks only it can make.
    ///
    /// # Panics
    /// On a real API server.
    pub fn emu(&self) -> &Emulator {
        self.emu.as_ref().expect("an emulator backend")
    }

    /// The case's name for node `name`.
    pub fn node(&self, name: &str) -> String {
        self.unique(name)
    }

    /// `name`, unique to the case on a shared server (for cluster-wide queries).
    pub fn unique(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// The case's namespaced `K`s.
    pub fn api<K>(&self) -> Api<K>
    where
        K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>,
    {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// The case's GameServers.
    pub fn gameservers(&self) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), &self.ns, &gs_resource())
    }

    /// A second namespace for the case (`name` on the emulator, created on a server). Its
    /// name sorts after the case's own, as `default` before `other` on the emulator (a list
    /// across namespaces is ordered by namespace, then name).
    pub async fn namespace(&self, name: &str) -> String {
        if self.emu.is_some() {
            return name.to_string();
        }
        let ns = format!("{}{name}", self.ns);
        self.create_namespace(&ns).await;
        ns
    }

    async fn create_namespace(&self, ns: &str) {
        let obj: Namespace =
            serde_json::from_value(json!({"metadata": {"name": ns}})).expect("a namespace");
        Api::<Namespace>::all(self.client.clone())
            .create(&PostParams::default(), &obj)
            .await
            .expect("create the namespace");
        // Pods are refused until the namespace's default ServiceAccount exists.
        let sas: Api<ServiceAccount> = Api::namespaced(self.client.clone(), ns);
        wait_for("the namespace's default ServiceAccount", || async {
            sas.get_opt("default").await.ok().flatten().map(|_| ())
        })
        .await;
    }

    /// The GameServer CRD with (`true`) or without the selectable fields of Agones 1.58.
    pub async fn selectable_fields(&self, on: bool) {
        match &self.emu {
            Some(emu) => emu.set_agones_selectable_fields(on),
            None => {
                let variant = if on {
                    Crd::SelectableNodeName
                } else {
                    Crd::LabelsOnly
                };
                agones::install_crd(&self.client, variant)
                    .await
                    .expect("the GameServer CRD");
            }
        }
    }

    /// The API server's current resourceVersion, as a list of `api` reports it.
    pub async fn current_rv<K>(&self, api: &Api<K>) -> String
    where
        K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
    {
        api.list_metadata(&ListParams::default().limit(1))
            .await
            .expect("a list")
            .metadata
            .resource_version
            .expect("a list's resourceVersion")
    }

    /// Waits until the disruption controller has counted PDB `name`'s `expected` pods,
    /// `healthy` of them healthy. A real server refuses evictions (429) while a PDB's status
    /// is behind; the emulator computes the numbers at each eviction, so it never waits.
    pub async fn settle_pdb(&self, name: &str, expected: i32, healthy: i32) {
        settle_pdb_in(self, &self.ns, name, expected, healthy).await;
    }
}

/// [`Backend::settle_pdb`] in namespace `ns`.
async fn settle_pdb_in(b: &Backend, ns: &str, name: &str, expected: i32, healthy: i32) {
    if b.emu.is_some() {
        return;
    }
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(b.client.clone(), ns);
    wait_for(
        &format!("PDB {name}: {expected} pods counted, {healthy} healthy"),
        || async {
            let p = pdbs.get(name).await.ok()?;
            let st = p.status?;
            (st.observed_generation >= p.metadata.generation
                && st.expected_pods == expected
                && st.current_healthy == healthy)
                .then_some(())
        },
    )
    .await;
}

impl Backend {
    /// Deletes the case's nodes (cluster-scoped: they would show in other cases' lists).
    pub async fn delete_nodes(&self) {
        if self.prefix.is_empty() {
            return;
        }
        let nodes: Api<Node> = Api::all(self.client.clone());
        let Ok(list) = nodes.list_metadata(&ListParams::default()).await else {
            return;
        };
        for n in list.items {
            let name = n.name_any();
            if name.starts_with(&self.prefix) {
                let _ = nodes.delete(&name, &DeleteParams::default()).await;
            }
        }
    }
}

/// Leaves out the config map a real control plane publishes in every namespace (the
/// cluster's CA bundle), so a case sees only its own config maps.
pub const NOT_PUBLISHED: &str = "metadata.name!=kube-root-ca.crt";

/// Creates `p`, then writes its status through `/status` as its kubelet would: a create
/// never keeps a pod's status.
pub async fn create_pod(pods: &Api<Pod>, p: &Pod) -> kube::Result<Pod> {
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
pub fn pod(name: &str, node: Option<&str>, labels: Value) -> Pod {
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

pub fn cm(name: &str) -> ConfigMap {
    serde_json::from_value(json!({ "metadata": { "name": name }, "data": { "k": "v" } })).unwrap()
}

pub fn api_err<T: std::fmt::Debug>(r: Result<T, kube::Error>) -> Status {
    match r {
        Err(kube::Error::Api(s)) => *s,
        other => panic!("expected an API error, got {other:?}"),
    }
}

pub fn rv_of<K: ResourceExt>(o: &K) -> u64 {
    o.resource_version().unwrap().parse().unwrap()
}

/// The next non-bookmark watch event, within 10 s.
pub async fn next_event<K, S>(s: &mut S) -> WatchEvent<K>
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

/// The next watch event about one of `names` (the case's own objects), within 10 s: on a
/// real API server other writers share the namespace (the controller manager publishes
/// `kube-root-ca.crt` into every one), and a case reads only its own objects' events.
pub async fn next_event_of<K, S>(s: &mut S, names: &[&str]) -> WatchEvent<K>
where
    K: ResourceExt,
    S: Stream<Item = Result<WatchEvent<K>, kube::Error>> + Unpin,
{
    loop {
        let ev = next_event(s).await;
        let name = match &ev {
            WatchEvent::Added(o) | WatchEvent::Modified(o) | WatchEvent::Deleted(o) => o.name_any(),
            _ => return ev,
        };
        if names.contains(&name.as_str()) {
            return ev;
        }
    }
}

pub fn describe<K: ResourceExt>(ev: &WatchEvent<K>) -> (String, String) {
    match ev {
        WatchEvent::Added(o) => ("ADDED".into(), o.name_any()),
        WatchEvent::Modified(o) => ("MODIFIED".into(), o.name_any()),
        WatchEvent::Deleted(o) => ("DELETED".into(), o.name_any()),
        WatchEvent::Bookmark(_) => ("BOOKMARK".into(), String::new()),
        WatchEvent::Error(s) => ("ERROR".into(), s.reason.clone()),
    }
}

pub fn ev(kind: &str, name: &str) -> (String, String) {
    (kind.to_string(), name.to_string())
}

pub fn gs_resource() -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk("agones.dev", "v1", "GameServer"))
}

/// A Ready GameServer on `node`.
pub fn gameserver(name: &str, node: &str) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "agones.dev/v1",
        "kind": "GameServer",
        "metadata": { "name": name },
        "spec": { "ports": [{ "name": "default", "containerPort": 7654 }], "eviction": { "safe": "OnUpgrade" } },
        "status": { "state": "Ready", "nodeName": node },
    }))
    .unwrap()
}

pub fn pdb(name: &str, spec: Value) -> PodDisruptionBudget {
    serde_json::from_value(json!({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": { "name": name },
        "spec": spec,
    }))
    .unwrap()
}

pub async fn evict(pods: &Api<Pod>, name: &str) -> Result<Status, kube::Error> {
    pods.evict(name, &EvictParams::default()).await
}

// ---------------------------------------------------------------- resourceVersion, CRUD

pub async fn resource_version_is_monotonic_across_resources(b: &Backend) {
    let nodes: Api<Node> = Api::all(b.client.clone());
    let pods: Api<Pod> = b.api();
    let cms: Api<ConfigMap> = b.api();
    let pp = PostParams::default();
    let n1 = b.node("n1");
    let n = nodes
        .create(
            &pp,
            &serde_json::from_value(json!({"metadata": {"name": n1}})).unwrap(),
        )
        .await
        .unwrap();
    let p = pods
        .create(&pp, &pod("p1", Some(&n1), json!({})))
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
    // Server-set fields.
    assert!(p.uid().is_some());
    assert!(p.creation_timestamp().is_some());
    assert_eq!(p.metadata.namespace.as_deref(), Some(b.ns.as_str()));
}

pub async fn stale_replace_is_a_conflict(b: &Backend) {
    let cms: Api<ConfigMap> = b.api();
    let created = cms.create(&PostParams::default(), &cm("c1")).await.unwrap();
    let mut a = created.clone();
    a.data = Some([("k".to_string(), "a".to_string())].into());
    let after_a = cms.replace("c1", &PostParams::default(), &a).await.unwrap();
    assert!(rv_of(&after_a) > rv_of(&created));
    let mut bb = created.clone();
    bb.data = Some([("k".to_string(), "b".to_string())].into());
    let s = api_err(cms.replace("c1", &PostParams::default(), &bb).await);
    assert_eq!((s.code, s.reason.as_str()), (409, "Conflict"));
    assert!(
        s.message.contains("the object has been modified"),
        "{}",
        s.message
    );
    assert_eq!(cms.get("c1").await.unwrap().data.unwrap()["k"], "a");
    // Without a resourceVersion the update is unconditional, as on a real server.
    bb.metadata.resource_version = None;
    let after_b = cms
        .replace("c1", &PostParams::default(), &bb)
        .await
        .unwrap();
    assert_eq!(after_b.data.unwrap()["k"], "b");
}

// ---------------------------------------------------------------- errors, delete, patch

pub async fn create_get_errors_have_real_statuses(b: &Backend) {
    let cms: Api<ConfigMap> = b.api();
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

pub async fn delete_preconditions_conflict_and_keep_the_object(b: &Backend) {
    let cms: Api<ConfigMap> = b.api();
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
            .contains("the UID in the precondition (wrong-uid) does not match"),
        "{}",
        s.message
    );
    let s = api_err(cms.delete("c1", &with(None, Some("1".into()))).await);
    assert_eq!((s.code, s.reason.as_str()), (409, "Conflict"));
    assert!(
        s.message
            .contains("the ResourceVersion in the precondition (1) does not match"),
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

pub async fn finalizers_keep_a_deleted_object_until_removed(b: &Backend) {
    let cms: Api<ConfigMap> = b.api();
    let mut c = cm("c1");
    c.metadata.finalizers = Some(vec!["example.com/hold".into()]);
    let created = cms.create(&PostParams::default(), &c).await.unwrap();
    let mut watch = cms
        .watch(
            &WatchParams::default().fields("metadata.name=c1"),
            &rv_of(&created).to_string(),
        )
        .await
        .unwrap()
        .boxed();
    let out = cms.delete("c1", &DeleteParams::default()).await.unwrap();
    let kept = out.left().expect("the object, still present");
    assert!(kept.metadata.deletion_timestamp.is_some());
    let got = cms.get("c1").await.unwrap();
    assert!(got.metadata.deletion_timestamp.is_some());
    assert_eq!(
        describe(&next_event_of(&mut watch, &["c1"]).await),
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
        describe(&next_event_of(&mut watch, &["c1"]).await),
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
    assert_eq!(
        describe(&next_event_of(&mut watch, &["c1"]).await),
        ev("DELETED", "c1")
    );
}

pub async fn pod_grace_period_keeps_a_bound_pod_terminating(b: &Backend) {
    let pods: Api<Pod> = b.api();
    let n1 = b.node("n1");
    let mut p = pod("p1", Some(&n1), json!({}));
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
}

/// Unbound pods and grace period 0 go at once.
pub async fn unbound_pods_and_grace_zero_go_at_once(b: &Backend) {
    let pods: Api<Pod> = b.api();
    let n1 = b.node("n1");
    pods.create(&PostParams::default(), &pod("p2", None, json!({})))
        .await
        .unwrap();
    pods.delete("p2", &DeleteParams::default()).await.unwrap();
    assert_eq!(api_err(pods.get("p2").await).code, 404);
    pods.create(&PostParams::default(), &pod("p3", Some(&n1), json!({})))
        .await
        .unwrap();
    let out = pods
        .delete("p3", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    assert!(out.left().is_some());
    assert_eq!(api_err(pods.get("p3").await).code, 404);
}

pub async fn delete_collection_by_label(b: &Backend) {
    let pods: Api<Pod> = b.api();
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

pub async fn merge_patch_and_its_resource_version_guard(b: &Backend) {
    let pods: Api<Pod> = b.api();
    // Bound, so no scheduler writes to it between the case's reads and writes.
    let created = pods
        .create(
            &PostParams::default(),
            &pod("p1", Some(&b.node("n1")), json!({"a": "1"})),
        )
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

pub async fn json_patch_and_failed_test_is_422(b: &Backend) {
    let pods: Api<Pod> = b.api();
    // Bound, so no scheduler writes to it between the case's reads and writes.
    let created = pods
        .create(
            &PostParams::default(),
            &pod("p1", Some(&b.node("n1")), json!({"a": "1"})),
        )
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
    let now = pods.get("p1").await.unwrap();
    assert_eq!(now.resource_version(), ok.resource_version());
    assert!(!now.labels().contains_key("c"));
}

/// Strategic merge patches: pod conditions merge by type; custom resources refuse them (415).
pub async fn strategic_merge_of_conditions_not_of_custom_resources(b: &Backend) {
    let pods: Api<Pod> = b.api();
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
    let gs: Api<DynamicObject> = b.gameservers();
    gs.create(&PostParams::default(), &gameserver("gs1", &b.node("n1")))
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

pub async fn watch_reports_added_modified_deleted(b: &Backend) {
    const MINE: [&str; 2] = ["before", "c1"];
    let cms: Api<ConfigMap> = b.api();
    cms.create(&PostParams::default(), &cm("before"))
        .await
        .unwrap();
    let mut w = cms
        .watch(&WatchParams::default().fields(NOT_PUBLISHED), "0")
        .await
        .unwrap()
        .boxed();
    // Resource version 0: synthetic ADDED for what exists.
    assert_eq!(
        describe(&next_event_of(&mut w, &MINE).await),
        ev("ADDED", "before")
    );
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
        next_event_of(&mut w, &MINE).await,
        next_event_of(&mut w, &MINE).await,
        next_event_of(&mut w, &MINE).await,
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

pub async fn watch_resumes_after_a_resource_version(b: &Backend) {
    const MINE: [&str; 3] = ["a", "b", "c"];
    let cms: Api<ConfigMap> = b.api();
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
    assert_eq!(
        describe(&next_event_of(&mut w, &MINE).await),
        ev("ADDED", "b")
    );
    assert_eq!(
        describe(&next_event_of(&mut w, &MINE).await),
        ev("MODIFIED", "a")
    );
    cms.create(&PostParams::default(), &cm("c")).await.unwrap();
    assert_eq!(
        describe(&next_event_of(&mut w, &MINE).await),
        ev("ADDED", "c")
    );
}

pub async fn watch_with_node_field_selector_sees_only_that_node(b: &Backend) {
    let pods: Api<Pod> = b.api();
    let pp = PostParams::default();
    let mp = PatchParams::default();
    let now = DeleteParams::default().grace_period(0);
    let (n1, n2) = (b.node("n1"), b.node("n2"));
    let on_n1 = format!("spec.nodeName={n1}");
    let start = b.current_rv(&pods).await;
    let mut w = pods
        .watch(&WatchParams::default().fields(&on_n1), &start)
        .await
        .unwrap()
        .boxed();
    // Traffic on another node: invisible.
    pods.create(&pp, &pod("other", Some(&n2), json!({})))
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
    pods.create(&pp, &pod("p1", Some(&n1), json!({})))
        .await
        .unwrap();
    // A pod that gets bound to n1 (the binding subresource) appears as ADDED.
    pods.create(&pp, &pod("p2", None, json!({}))).await.unwrap();
    let binding = json!({"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "p2"}, "target": {"kind": "Node", "name": n1}});
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
    pods.create(&pp, &pod("p3", Some(&n1), json!({})))
        .await
        .unwrap();
    pods.create(&pp, &pod("p4", Some(&n2), json!({})))
        .await
        .unwrap();
    let mut w = pods
        .watch(&WatchParams::default().fields(&on_n1), "0")
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

pub async fn watch_with_label_selector_transitions(b: &Backend) {
    let pods: Api<Pod> = b.api();
    let mp = PatchParams::default();
    // Bound (to a node of the case's own, which needs not exist), so no scheduler writes it.
    pods.create(
        &PostParams::default(),
        &pod("p1", Some(&b.node("n1")), json!({"app": "x"})),
    )
    .await
    .unwrap();
    let start = b.current_rv(&pods).await;
    let mut w = pods
        .watch(&WatchParams::default().labels("app=y"), &start)
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

pub async fn field_selectors_on_lists(b: &Backend) {
    let pp = PostParams::default();
    let (ns, other_ns) = (b.ns.clone(), b.namespace("other").await);
    let (n1, n2) = (b.node("n1"), b.node("n2"));
    // Cluster-wide queries name what only this case creates.
    let a = b.unique("a");
    let default: Api<Pod> = b.api();
    let other: Api<Pod> = Api::namespaced(b.client.clone(), &other_ns);
    let all: Api<Pod> = Api::all(b.client.clone());
    default
        .create(&pp, &pod(&a, Some(&n1), json!({})))
        .await
        .unwrap();
    default
        .create(&pp, &pod("b", Some(&n2), json!({})))
        .await
        .unwrap();
    default
        .create(&pp, &pod("c", None, json!({})))
        .await
        .unwrap();
    other
        .create(&pp, &pod(&a, Some(&n1), json!({})))
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
        names(all.list(&q(&format!("metadata.name={a}"))).await.unwrap()),
        vec![format!("{ns}/{a}"), format!("{other_ns}/{a}")]
    );
    assert_eq!(
        names(
            all.list(&q(&format!("metadata.namespace=={other_ns}")))
                .await
                .unwrap()
        ),
        vec![format!("{other_ns}/{a}")]
    );
    assert_eq!(
        names(all.list(&q(&format!("spec.nodeName={n1}"))).await.unwrap()),
        vec![format!("{ns}/{a}"), format!("{other_ns}/{a}")]
    );
    assert_eq!(
        names(default.list(&q("spec.nodeName=")).await.unwrap()),
        vec![format!("{ns}/c")]
    );
    assert_eq!(
        names(
            default
                .list(&q(&format!("spec.nodeName!={n1},metadata.name!=c")))
                .await
                .unwrap()
        ),
        vec![format!("{ns}/b")]
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
    let nodes: Api<Node> = Api::all(b.client.clone());
    assert_eq!(
        api_err(nodes.list(&q(&format!("spec.nodeName={n1}"))).await).code,
        400
    );
}

pub async fn label_selectors_with_every_operator(b: &Backend) {
    let pods: Api<Pod> = b.api();
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

pub async fn list_pages_with_continue_tokens(b: &Backend) {
    let cms: Api<ConfigMap> = b.api();
    for i in 0..5 {
        cms.create(&PostParams::default(), &cm(&format!("c{i}")))
            .await
            .unwrap();
    }
    let mut seen = Vec::new();
    let mut lp = ListParams::default().fields(NOT_PUBLISHED).limit(2);
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

pub async fn eviction_blocked_by_the_agones_pdb(b: &Backend) {
    let n1 = b.node("n1");
    let pods: Api<Pod> = b.api();
    let pdbs: Api<PodDisruptionBudget> = b.api();
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
            Some(&n1),
            json!({"agones.dev/safe-to-evict": "false"}),
        ),
    )
    .await
    .unwrap();
    create_pod(
        &pods,
        &pod(
            "gs-2",
            Some(&n1),
            json!({"agones.dev/safe-to-evict": "true"}),
        ),
    )
    .await
    .unwrap();
    b.settle_pdb("agones-gameserver-safe-to-evict-false", 1, 1)
        .await;
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

/// (The emulator's run also checks the journal: the eviction's HTTP status is 201.)
pub async fn eviction_without_pdb_deletes_with_the_requested_grace(b: &Backend) {
    let pods: Api<Pod> = b.api();
    pods.create(
        &PostParams::default(),
        &pod("p1", Some(&b.node("n1")), json!({})),
    )
    .await
    .unwrap();
    pods.create(&PostParams::default(), &pod("p2", None, json!({})))
        .await
        .unwrap();
    // kube's `evict` loses delete options (see toolchain.md); post a policy/v1 Eviction.
    let body = json!({
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": { "name": "p1", "namespace": b.ns },
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
    evict(&pods, "p2").await.unwrap();
    assert_eq!(api_err(pods.get("p2").await).code, 404);
    let s = api_err(evict(&pods, "missing").await);
    assert_eq!((s.code, s.reason.as_str()), (404, "NotFound"));
}

/// Evicts `pods_n` healthy pods under a PDB of `spec`, in a namespace of their own (`name`
/// on a shared server), and answers each eviction's HTTP status.
async fn budget_case(b: &Backend, name: &str, spec: Value, pods_n: usize) -> Vec<u16> {
    let ns = b.namespace(name).await;
    let pods: Api<Pod> = Api::namespaced(b.client.clone(), &ns);
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(b.client.clone(), &ns);
    let n1 = b.node("n1");
    let mut spec = spec;
    spec["selector"] = json!({"matchLabels": {"app": "x"}});
    pdbs.create(&PostParams::default(), &pdb("budget", spec))
        .await
        .unwrap();
    create_pod(&pods, &pod("unrelated", Some(&n1), json!({"app": "y"})))
        .await
        .unwrap();
    for i in 0..pods_n {
        create_pod(
            &pods,
            &pod(&format!("p{i}"), Some(&n1), json!({"app": "x"})),
        )
        .await
        .unwrap();
    }
    let n = i32::try_from(pods_n).unwrap();
    settle_pdb_in(b, &ns, "budget", n, n).await;
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

/// minAvailable as a number of pods: what a real disruption controller can count for bare
/// pods (percentages and maxUnavailable need the pods' controllers and their scale).
pub async fn eviction_budgets_count_healthy_pods(b: &Backend) {
    // minAvailable 2 of 3.
    assert_eq!(
        budget_case(b, "b3", json!({"minAvailable": 2}), 3).await,
        vec![201, 429, 429]
    );
    // minAvailable 0 never blocks.
    assert_eq!(
        budget_case(b, "b5", json!({"minAvailable": 0}), 2).await,
        vec![201, 201]
    );
}

/// Budgets by share or by maxUnavailable, counted from the pods (the emulator only: a real
/// disruption controller needs the pods' controllers to count them, see docs/testing.md).
pub async fn eviction_budgets_by_share_count_healthy_pods(b: &Backend) {
    // maxUnavailable 1 of 3: one eviction, then blocked (the evicted pod is terminating).
    assert_eq!(
        budget_case(b, "b1", json!({"maxUnavailable": 1}), 3).await,
        vec![201, 429, 429]
    );
    // maxUnavailable 50% of 3 rounds up to 2.
    assert_eq!(
        budget_case(b, "b2", json!({"maxUnavailable": "50%"}), 3).await,
        vec![201, 201, 429]
    );
    // minAvailable 50% of 3 rounds up to 2.
    assert_eq!(
        budget_case(b, "b4", json!({"minAvailable": "50%"}), 3).await,
        vec![201, 429, 429]
    );
}

pub async fn eviction_of_unready_pods_follows_the_unhealthy_pod_policy(b: &Backend) {
    let pods: Api<Pod> = b.api();
    let pdbs: Api<PodDisruptionBudget> = b.api();
    pdbs.create(
        &PostParams::default(),
        &pdb(
            "one",
            json!({"minAvailable": 1, "selector": {"matchLabels": {"app": "x"}}}),
        ),
    )
    .await
    .unwrap();
    let n1 = b.node("n1");
    let mut unready = pod("unready", Some(&n1), json!({"app": "x"}));
    unready
        .status
        .as_mut()
        .unwrap()
        .conditions
        .as_mut()
        .unwrap()[0]
        .status = "False".into();
    create_pod(&pods, &unready).await.unwrap();
    create_pod(&pods, &pod("ready", Some(&n1), json!({"app": "x"})))
        .await
        .unwrap();
    b.settle_pdb("one", 2, 1).await;
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

pub async fn gameserver_status_travels_with_the_object(b: &Backend) {
    let gs: Api<DynamicObject> = b.gameservers();
    let created = gs
        .create(&PostParams::default(), &gameserver("gs1", &b.node("n1")))
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
    assert_eq!(
        gs.list(&ListParams::default()).await.unwrap().items.len(),
        1
    );
}

pub async fn gameserver_selectable_fields_follow_the_crd(b: &Backend) {
    let gs: Api<DynamicObject> = b.gameservers();
    let all: Api<DynamicObject> = Api::all_with(b.client.clone(), &gs_resource());
    let pp = PostParams::default();
    let n1 = b.node("n1");
    let on_n1 = format!("status.nodeName={n1}");
    b.selectable_fields(false).await;
    gs.create(&pp, &gameserver("on-n1", &n1)).await.unwrap();
    let mut starting = gameserver("starting", &n1);
    starting.data["status"] = json!({"state": "Starting"});
    gs.create(&pp, &starting).await.unwrap();
    let q = |s: &str| ListParams::default().fields(s);

    // An older Agones: only metadata fields.
    let s = api_err(all.list(&q(&on_n1)).await);
    assert_eq!((s.code, s.reason.as_str()), (400, "BadRequest"));
    assert!(
        s.message
            .contains("field label not supported: status.nodeName"),
        "{}",
        s.message
    );
    match all.watch(&WatchParams::default().fields(&on_n1), "0").await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 400),
        Err(e) => panic!("not an API error: {e}"),
        Ok(_) => panic!("an older CRD's watch must be refused"),
    }

    b.selectable_fields(true).await;
    let names = |l: kube::api::ObjectList<DynamicObject>| {
        l.items.iter().map(|o| o.name_any()).collect::<Vec<_>>()
    };
    assert_eq!(names(all.list(&q(&on_n1)).await.unwrap()), vec!["on-n1"]);
    assert_eq!(
        names(gs.list(&q("status.nodeName=")).await.unwrap()),
        vec!["starting"]
    );
    assert_eq!(
        names(gs.list(&q("status.state=Starting")).await.unwrap()),
        vec!["starting"]
    );
    // Only the declared fields.
    let s = api_err(all.list(&q("spec.scheduling=Packed")).await);
    assert_eq!(s.code, 400);
    assert!(
        s.message
            .contains("field label not supported: spec.scheduling"),
        "{}",
        s.message
    );

    let start = b.current_rv(&gs).await;
    let mut w = all
        .watch(&WatchParams::default().fields(&on_n1), &start)
        .await
        .unwrap()
        .boxed();
    gs.patch(
        "starting",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"state": "Scheduled", "nodeName": n1}})),
    )
    .await
    .unwrap();
    gs.delete("on-n1", &DeleteParams::default()).await.unwrap();
    assert_eq!(describe(&next_event(&mut w).await), ev("ADDED", "starting"));
    assert_eq!(describe(&next_event(&mut w).await), ev("DELETED", "on-n1"));

    // Agones reinstalled without them: the next list is refused again.
    b.selectable_fields(false).await;
    assert_eq!(api_err(all.list(&q(&on_n1)).await).code, 400);
}

pub async fn event_recorder_creates_then_patches_events(b: &Backend) {
    use kube::runtime::events::{Event, EventType, Recorder, Reporter};
    let pods: Api<Pod> = b.api();
    let p = pods
        .create(&PostParams::default(), &pod("p1", None, json!({})))
        .await
        .unwrap();
    let recorder = Recorder::new(
        b.client.clone(),
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
    // One event, its series counting both (the scheduler may write its own about p1).
    let events: Api<k8s_openapi::api::events::v1::Event> = b.api();
    let events: Vec<Value> = events
        .list(&ListParams::default().fields("reportingController=lastcall"))
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|e| serde_json::to_value(e).unwrap())
        .collect();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["series"]["count"], 2);
    assert_eq!(events[0]["regarding"]["name"], "p1");
    // Core v1 events accept create and patch too.
    let core: Api<k8s_openapi::api::core::v1::Event> = b.api();
    let e: k8s_openapi::api::core::v1::Event = serde_json::from_value(json!({
        "metadata": { "name": "p1.1" },
        "involvedObject": { "kind": "Pod", "name": "p1", "namespace": b.ns },
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
    // Only the core event: a real server also shows the events.k8s.io Event above here
    // (one store behind both APIs, its reportingController read as reportingComponent).
    let listed = core
        .list(
            &ListParams::default()
                .fields("involvedObject.name=p1,reason=Draining,reportingComponent="),
        )
        .await
        .unwrap();
    assert_eq!(listed.items.len(), 1);
}

pub async fn status_subresource_and_nodes(b: &Backend) {
    let nodes: Api<Node> = Api::all(b.client.clone());
    let n1 = b.node("n1");
    nodes
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": n1}})).unwrap(),
        )
        .await
        .unwrap();
    nodes
        .patch(
            &n1,
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
            &n1,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"conditions": [{"type": "Ready", "status": "True"}]}})),
        )
        .await
        .unwrap();
    assert_eq!(n.status.unwrap().conditions.unwrap()[0].type_, "Ready");
    // Pods created without status start Pending, as on a real server.
    let pods: Api<Pod> = b.api();
    let mut bare = pod("bare", None, json!({}));
    bare.status = None;
    let created = pods.create(&PostParams::default(), &bare).await.unwrap();
    assert_eq!(created.status.unwrap().phase.as_deref(), Some("Pending"));
}

pub async fn pod_status_is_written_only_through_status(b: &Backend) {
    let pods: Api<Pod> = b.api();
    // A create never keeps a pod's status.
    let created = pods
        .create(
            &PostParams::default(),
            &pod("p1", Some(&b.node("n1")), json!({})),
        )
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
}

pub async fn node_status_is_written_only_through_status(b: &Backend) {
    let n1 = b.node("n1");
    let nodes: Api<Node> = Api::all(b.client.clone());
    // A node registers with its status (the kubelet's create keeps it).
    let n: Node = serde_json::from_value(json!({
        "metadata": {"name": n1},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    }))
    .unwrap();
    let created = nodes.create(&PostParams::default(), &n).await.unwrap();
    assert_eq!(created.status.unwrap().conditions.unwrap().len(), 1);
    let patched = nodes
        .patch(
            &n1,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"unschedulable": true}, "status": {"conditions": []}})),
        )
        .await
        .unwrap();
    assert_eq!(patched.spec.unwrap().unschedulable, Some(true));
    assert_eq!(patched.status.unwrap().conditions.unwrap().len(), 1);
    let patched = nodes
        .patch_status(
            &n1,
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

pub async fn custom_resource_put_needs_a_resource_version(b: &Backend) {
    let gs: Api<DynamicObject> = b.gameservers();
    gs.create(&PostParams::default(), &gameserver("gs1", &b.node("n1")))
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
        "gameservers.agones.dev \"gs1\" is invalid: metadata.resourceVersion: Invalid value: 0: must be specified for an update"
    );
    assert_eq!(
        gs.get("gs1").await.unwrap().data["status"]["state"],
        "Ready"
    );
    // With the resourceVersion it goes through; core types still allow unconditional PUTs.
    let current = gs.get("gs1").await.unwrap();
    unconditional.metadata.resource_version = current.metadata.resource_version;
    gs.replace("gs1", &PostParams::default(), &unconditional)
        .await
        .unwrap();
    let cms: Api<ConfigMap> = b.api();
    cms.create(&PostParams::default(), &cm("c1")).await.unwrap();
    let mut c = cm("c1");
    c.data = Some([("k".to_string(), "w".to_string())].into());
    let replaced = cms.replace("c1", &PostParams::default(), &c).await.unwrap();
    assert_eq!(replaced.data.unwrap()["k"], "w");
}

pub async fn labels_and_annotation_keys_are_validated(b: &Backend) {
    let cms: Api<ConfigMap> = b.api();
    let long = "n".repeat(64);
    let mut bad = cm("c1");
    bad.metadata.labels = Some([("node".to_string(), long.clone())].into());
    let s = api_err(cms.create(&PostParams::default(), &bad).await);
    assert_eq!((s.code, s.reason.as_str()), (422, "Invalid"));
    assert_eq!(
        s.message,
        format!(
            "ConfigMap \"c1\" is invalid: metadata.labels: Invalid value: \"{long}\": must be no more than 63 bytes"
        )
    );
    let cause = &s.details.unwrap().causes[0];
    assert_eq!(cause.field, "metadata.labels");
    assert_eq!(cause.reason, "FieldValueInvalid");
    assert_eq!(api_err(cms.get("c1").await).code, 404);
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
    let gs: Api<DynamicObject> = b.gameservers();
    let mut g = gameserver("gs1", &b.node("n1"));
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

pub async fn duplicate_taints_are_invalid(b: &Backend) {
    let n1 = b.node("n1");
    let nodes: Api<Node> = Api::all(b.client.clone());
    let with_taints = |taints: Value| -> Node {
        serde_json::from_value(json!({"metadata": {"name": n1}, "spec": {"taints": taints}}))
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
        format!(
            "Node \"{n1}\" is invalid: metadata.taints[1]: Duplicate value: {{\"Key\":\"k\",\"Value\":\"b\",\"Effect\":\"NoSchedule\",\"TimeAdded\":null}}: taints must be unique by key and effect pair"
        )
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
                &n1,
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
                &n1,
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
    // The case's own taints (a real node controller may add its not-ready taint).
    let n = nodes.get(&n1).await.unwrap();
    let ours = n.spec.unwrap().taints.unwrap().into_iter();
    assert_eq!(ours.filter(|t| t.key == "k").count(), 2);
}

pub async fn pod_spec_is_immutable_but_for_what_the_server_allows(b: &Backend) {
    let n1 = b.node("n1");
    let pods: Api<Pod> = b.api();
    let mut p = pod("p1", Some(&n1), json!({}));
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
    // added, and the tolerationSeconds of an existing one. (The image by a JSON patch: a
    // merge patch replaces the whole container list, and on a real server that drops what
    // admission and defaulting added, the service account token's volume mount and the
    // image pull policy, which is a forbidden change.)
    pods.patch(
        "p1",
        &PatchParams::default(),
        &Patch::Json::<()>(
            serde_json::from_value(
                json!([{"op": "replace", "path": "/spec/containers/0/image", "value": "example:2"}]),
            )
            .unwrap(),
        ),
    )
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
            json!({"spec": {"nodeName": b.node("n2")}}),
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
    assert_eq!(stored.node_name.as_deref(), Some(n1.as_str()));
    assert_eq!(stored.active_deadline_seconds, Some(30));
    assert_eq!(stored.tolerations.unwrap().len(), 4);
}

pub async fn malformed_tolerations_are_invalid(b: &Backend) {
    let pods: Api<Pod> = b.api();
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

pub async fn new_pods_get_default_toleration_seconds(b: &Backend) {
    let pods: Api<Pod> = b.api();
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
}

pub async fn binding_assigns_a_node_once(b: &Backend) {
    let (n1, n2) = (b.node("n1"), b.node("n2"));
    let pods: Api<Pod> = b.api();
    // No scheduler serves this name, so a real one does not race the test's own binding
    // (its `PodScheduled=False` for an unschedulable pod could land after it).
    let mut p1 = pod("p1", None, json!({}));
    p1.spec.as_mut().unwrap().scheduler_name = Some("lastcall-test-binds-itself".into());
    pods.create(&PostParams::default(), &p1).await.unwrap();
    let binding = |node: &str| json!({"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "p1"}, "target": {"kind": "Node", "name": node}});
    let s: Status = pods
        .create_subresource("binding", "p1", &PostParams::default(), &binding(&n1))
        .await
        .unwrap();
    assert_eq!(s.code, 201);
    let p = pods.get("p1").await.unwrap();
    assert_eq!(p.spec.unwrap().node_name.as_deref(), Some(n1.as_str()));
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
            &binding(&n2),
        )
        .await,
    );
    assert_eq!((s.code, s.reason.as_str()), (409, "Conflict"));
    assert!(
        s.message
            .contains(&format!("is already assigned to node \"{n1}\"")),
        "{}",
        s.message
    );
    // A body naming another pod is refused before any pod is looked up.
    let s = api_err(
        pods.create_subresource::<_, Status>(
            "binding",
            "nope",
            &PostParams::default(),
            &binding(&n2),
        )
        .await,
    );
    assert_eq!((s.code, s.reason.as_str()), (400, "BadRequest"));
    let mut missing = binding(&n2);
    missing["metadata"]["name"] = json!("nope");
    let s = api_err(
        pods.create_subresource::<_, Status>("binding", "nope", &PostParams::default(), &missing)
            .await,
    );
    assert_eq!(s.code, 404);
}
