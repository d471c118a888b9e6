//! The chart's node restriction on a real API server: the chart is installed onto the box by
//! the real `helm` (its `auto` switch reads the API server's discovery), and the agent's
//! ServiceAccount, with a token bound to a pod on one node as the kubelet's projected token
//! is, makes every write of the policies' table (`charts/lastcall/agent-writes.yaml`) on that
//! node, while the same writes against another node's objects, and the writes just outside
//! the table on its own node (an image rewrite, a relabel, a system pod's delete, a
//! kubelet-only label, a GameServer's spec, Events about other objects), are refused by the
//! chart's ValidatingAdmissionPolicies (each named in its refusal) and change nothing. An
//! Eviction, on its own node or another, is refused by RBAC (the agent ends a match with a
//! preconditioned DELETE, never the Eviction API), and by the pod policy too where another
//! binding grants it. A token bound to no pod writes nothing. The real agent's drain still
//! completes under them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::authentication::v1::{SelfSubjectReview, TokenRequest};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ServiceAccount};
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, EvictParams, Patch, PatchParams, PostParams,
    Preconditions,
};
use lastcall_testkit::agent_writes::{Options, Table};
use lastcall_testkit::eventually::{try_eventually, wait_for};
use lastcall_testkit::kube_box::agent::{AgentProcess, Extra, NAMESPACE, SERVICE_ACCOUNT};
use lastcall_testkit::kube_box::agones::{self, Agones, Allocation, Crd, Server};
use lastcall_testkit::kube_box::{self, KubeBox, create_node};
use serde_json::{Value, json};

const NODE_POLICY: &str = "lastcall-agent-node-scope";
const POD_POLICY: &str = "lastcall-agent-pod-scope";
const GS_POLICY: &str = "lastcall-agent-gameserver-scope";
const EVENT_POLICY: &str = "lastcall-agent-event-scope";
const POLICIES: [&str; 4] = [NODE_POLICY, POD_POLICY, GS_POLICY, EVENT_POLICY];
/// The policy the chart no longer ships: an Eviction names only its pod, so it took every pod
/// of the namespace as its params (docs/scale.md).
const GONE_EVICTION_POLICY: &str = "lastcall-agent-eviction-scope";
const NODE_NAME_KEY: &str = "authentication.kubernetes.io/node-name";
const PROBE: &str = "example.com/probe";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The box's `helm` with `args`, a home of its own; its output, or an error with it.
fn helm(args: &[&str]) -> anyhow::Result<String> {
    let bin = kube_box::bin_dir()?.join("helm");
    let home = tempfile::tempdir()?;
    let out = std::process::Command::new(bin)
        .args(args)
        .env_clear()
        .env("HOME", home.path())
        .env("HELM_CACHE_HOME", home.path().join("cache"))
        .env("HELM_CONFIG_HOME", home.path().join("config"))
        .env("HELM_DATA_HOME", home.path().join("data"))
        .output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        anyhow::bail!("helm {} failed:\n{text}", args.join(" "));
    }
    Ok(text)
}

/// `helm upgrade --install` of the chart onto the box with default values (and a registry).
/// The release is named `box` with the chart's default object names (`fullnameOverride`), so
/// its DaemonSet (release label `box`) does not adopt the agent pod `kube_box::agent` creates
/// with the labels of `manifests/lastcall.yaml` (release `lastcall`) and delete it.
fn install_chart(kbox: &KubeBox) -> String {
    install_chart_with(kbox, &[])
}

/// [`install_chart`] with `sets` (`key=value`) on top of the default values.
fn install_chart_with(kbox: &KubeBox, sets: &[&str]) -> String {
    let chart = repo().join("charts/lastcall");
    let kubeconfig = kbox.dir().join("admin.kubeconfig");
    let (chart, kubeconfig) = (chart.to_string_lossy(), kubeconfig.to_string_lossy());
    let mut args = vec![
        "upgrade",
        "--install",
        "box",
        &chart,
        "-n",
        NAMESPACE,
        "--create-namespace",
        "--set",
        "image.registry=registry.invalid/lastcall",
        "--set",
        "fullnameOverride=lastcall",
        // The release adopts the RBAC objects other tests on this box made (helm 4 applies
        // on the server, where those writers own the fields).
        "--force-conflicts",
        "--kubeconfig",
        &kubeconfig,
    ];
    for s in sets {
        args.extend(["--set", s]);
    }
    helm(&args).expect("helm install onto the box")
}

fn vap_resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: "admissionregistration.k8s.io".into(),
        version: "v1".into(),
        api_version: "admissionregistration.k8s.io/v1".into(),
        kind: kind.into(),
        plural: plural.into(),
    }
}

fn events_resource() -> ApiResource {
    ApiResource {
        group: "events.k8s.io".into(),
        version: "v1".into(),
        api_version: "events.k8s.io/v1".into(),
        kind: "Event".into(),
        plural: "events".into(),
    }
}

/// Waits until the API server has type-checked every policy at its current generation, and
/// fails on any expression warning (a field the schema does not have, a type mismatch).
async fn policies_checked(admin: &kube::Client) {
    let policies: Api<DynamicObject> = Api::all_with(
        admin.clone(),
        &vap_resource("ValidatingAdmissionPolicy", "validatingadmissionpolicies"),
    );
    let bindings: Api<DynamicObject> = Api::all_with(
        admin.clone(),
        &vap_resource(
            "ValidatingAdmissionPolicyBinding",
            "validatingadmissionpolicybindings",
        ),
    );
    for name in POLICIES {
        policies
            .get(name)
            .await
            .unwrap_or_else(|e| panic!("helm install made no policy {name}: {e}"));
        let status = try_eventually(
            &format!("{name} type-checked"),
            Duration::from_secs(30),
            Duration::from_millis(200),
            || async {
                let p = policies.get(name).await.ok()?;
                let generation = p.metadata.generation?;
                let status = p.data.get("status")?.clone();
                (status["observedGeneration"] == json!(generation)).then_some(status)
            },
        )
        .await
        .expect("the policy's status");
        assert!(
            status
                .pointer("/typeChecking/expressionWarnings")
                .and_then(Value::as_array)
                .is_none_or(|w| w.is_empty()),
            "{name}: {status}"
        );
        bindings
            .get(name)
            .await
            .unwrap_or_else(|e| panic!("helm install made no binding {name}: {e}"));
    }
    // No eviction policy: nothing of the namespace's pods in a param cache.
    for (what, api) in [("policy", &policies), ("binding", &bindings)] {
        match api.get(GONE_EVICTION_POLICY).await {
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            other => panic!("helm install made a {what} {GONE_EVICTION_POLICY}: {other:?}"),
        }
    }
}

async fn namespace(client: &kube::Client, name: &str) {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
    match Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => panic!("namespace {name}: {e}"),
    }
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), name);
    wait_for("the namespace's default ServiceAccount", || async {
        sas.get_opt("default").await.ok().flatten().map(|_| ())
    })
    .await;
}

/// A pod of the agent's ServiceAccount on `node` (bound by name, as a DaemonSet's is).
async fn agent_pod(client: &kube::Client, name: &str, node: &str) -> Pod {
    pod_of(client, SERVICE_ACCOUNT, name, node).await
}

/// A pod of ServiceAccount `sa` on `node`.
async fn pod_of(client: &kube::Client, sa: &str, name: &str, node: &str) -> Pod {
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"nodeName": node, "serviceAccountName": sa,
                 "tolerations": [{"operator": "Exists"}],
                 "terminationGracePeriodSeconds": 1,
                 "containers": [{"name": "agent", "image": "lastcall-agent:0.1.0"}]},
    }))
    .unwrap();
    Api::<Pod>::namespaced(client.clone(), NAMESPACE)
        .create(&PostParams::default(), &pod)
        .await
        .expect("the probe pod")
}

/// A plain pod (no game server: a CNI or kube-proxy stand-in) in `ns` on `node`.
async fn system_pod(client: &kube::Client, ns: &str, name: &str, node: &str) -> Pod {
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": {"k8s-app": name}},
        "spec": {"nodeName": node, "tolerations": [{"operator": "Exists"}],
                 "terminationGracePeriodSeconds": 1,
                 "containers": [{"name": "cni", "image": "cni:1"}]},
    }))
    .unwrap();
    Api::<Pod>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &pod)
        .await
        .expect("the system pod")
}

/// A token of the agent's ServiceAccount from the TokenRequest API, bound to `pod` (as the
/// kubelet's projected token is) or to nothing.
async fn token(client: &kube::Client, pod: Option<&Pod>) -> String {
    token_of(client, SERVICE_ACCOUNT, pod).await
}

/// A token of ServiceAccount `sa`, bound to `pod` or to nothing.
async fn token_of(client: &kube::Client, sa: &str, pod: Option<&Pod>) -> String {
    let bound = pod.map(|p| {
        json!({"apiVersion": "v1", "kind": "Pod", "name": p.metadata.name, "uid": p.metadata.uid})
    });
    let mut spec = json!({"audiences": [], "expirationSeconds": 3600});
    if let Some(b) = bound {
        spec["boundObjectRef"] = b;
    }
    let req: TokenRequest = serde_json::from_value(
        json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}),
    )
    .unwrap();
    let got: TokenRequest = Api::<ServiceAccount>::namespaced(client.clone(), NAMESPACE)
        .create_subresource("token", sa, &PostParams::default(), &req)
        .await
        .expect("a token");
    got.status.expect("a token").token
}

async fn client_for(kbox: &KubeBox, token: &str) -> kube::Client {
    let cfg = kube_box::config_from(&kbox.kubeconfig(token, "probe"))
        .await
        .expect("a kubeconfig");
    kube::Client::try_from(cfg).expect("a client")
}

/// What the API server makes of a token's user: its name and extra.
async fn who(client: &kube::Client) -> Value {
    let review: SelfSubjectReview = serde_json::from_value(json!({
        "apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}))
    .unwrap();
    let got = Api::<SelfSubjectReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
        .expect("a SelfSubjectReview");
    serde_json::to_value(got.status.and_then(|s| s.user_info)).unwrap()
}

/// A write's outcome: Ok, or the API server's refusal (code, message).
type Outcome = Result<(), (u16, String)>;

fn outcome<T>(r: Result<T, kube::Error>) -> Outcome {
    match r {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) => Err((s.code, s.message)),
        Err(e) => Err((0, e.to_string())),
    }
}

/// The refusal came from `policy`, for the reason the chart gives, naming `node`.
fn assert_refused_by(what: &str, got: &Outcome, policy: &str, node: &str) {
    assert_refused_saying(what, got, policy, &format!("\"{node}\""));
}

/// The refusal came from `policy`, for the reason the chart gives, its message saying `says`.
fn assert_refused_saying(what: &str, got: &Outcome, policy: &str, says: &str) {
    let Err((code, message)) = got else {
        panic!("{what}: admitted, but the node restriction must refuse it");
    };
    assert_eq!(*code, 403, "{what}: {message}");
    assert!(
        message.contains(&format!("ValidatingAdmissionPolicy '{policy}'"))
            && message.contains("lastcall node restriction")
            && message.contains(says),
        "{what}: refused, but not by {policy} saying {says}: {message}"
    );
}

fn assert_admitted(what: &str, got: &Outcome) {
    if let Err((code, message)) = got {
        panic!("{what}: refused ({code}): {message}");
    }
}

fn merge_annotation() -> Patch<Value> {
    Patch::Merge(json!({"metadata": {"annotations": {PROBE: "x"}}}))
}

/// The APIs a token writes through, for the game servers' namespace `ns`.
struct Writes {
    nodes: Api<Node>,
    pods: Api<Pod>,
    gs: Api<DynamicObject>,
    events: kube::Client,
}

impl Writes {
    fn new(client: &kube::Client, ns: &str) -> Writes {
        Writes {
            nodes: Api::all(client.clone()),
            pods: Api::namespaced(client.clone(), ns),
            gs: Api::namespaced_with(client.clone(), ns, &agones::gameservers_resource()),
            events: client.clone(),
        }
    }

    fn events_in(&self, ns: &str) -> Api<DynamicObject> {
        Api::namespaced_with(self.events.clone(), ns, &events_resource())
    }
}

/// One kind of write of the table, as a request to send against one node's objects.
#[derive(Clone, Debug)]
enum Write {
    /// A merge patch of the Node, then its undo (both the agent's writes: a set and a
    /// removal, a cordon and an uncordon).
    Node(Value, Value),
    /// The taint appended to the Node's taints, then removed (guarded JSON patches).
    NodeTaint(Value),
    /// A merge patch of the node's resident game-server pod.
    Pod(Value),
    /// The toleration appended to the resident pod's tolerations.
    PodToleration(Value),
    /// A uid-preconditioned DELETE of a game-server pod of its own.
    PodDelete,
    /// A merge patch of the node's resident GameServer, then its undo.
    Gs(Value, Value),
    /// A uid- and resourceVersion-preconditioned DELETE of a GameServer in this state.
    GsDelete(String),
    /// An events.k8s.io Event about the Node, as the agent's recorder writes it; `patch`:
    /// then folded into a series.
    Event { patch: bool },
}

/// Every write the table lists for `options`: (its name, the policy that judges it, the write).
fn table_writes(t: &Table, options: Options) -> Vec<(String, &'static str, Write)> {
    let mut out = Vec::new();
    let meta = |what: &str, k: &str, v: Value| json!({"metadata": {what: {k: v}}});
    for f in &t.node_spec {
        assert_eq!(
            f, "unschedulable",
            "a new Node spec field in the table: write its probe"
        );
        out.push((
            format!("Node spec.{f}"),
            NODE_POLICY,
            Write::Node(json!({"spec": {f: true}}), json!({"spec": {f: null}})),
        ));
    }
    let on = |when: &Option<String>| match when.as_deref() {
        None => true,
        Some("compatTaints") => options.compat_taints,
        Some("gkeHandBack") => options.gke_hand_back,
        Some(other) => panic!("unknown option {other}"),
    };
    for tt in t.node_taints.iter().filter(|x| on(&x.when)) {
        out.push((
            format!("Node taint {}:{}", tt.key, tt.effect),
            NODE_POLICY,
            Write::NodeTaint(json!({"key": tt.key, "value": "probe", "effect": tt.effect})),
        ));
    }
    for k in t.node_labels.iter().filter(|x| on(&x.when)) {
        let v = k.value.clone().unwrap_or_else(|| "probe".into());
        out.push((
            format!("Node label {}", k.key),
            NODE_POLICY,
            Write::Node(
                meta("labels", &k.key, json!(v)),
                meta("labels", &k.key, Value::Null),
            ),
        ));
    }
    for k in t.node_annotations.iter().filter(|x| on(&x.when)) {
        out.push((
            format!("Node annotation {}", k.key),
            NODE_POLICY,
            Write::Node(
                meta("annotations", &k.key, json!("probe")),
                meta("annotations", &k.key, Value::Null),
            ),
        ));
    }
    for k in t.pod_annotations.iter().filter(|x| on(&x.when)) {
        out.push((
            format!("Pod annotation {}", k.key),
            POD_POLICY,
            Write::Pod(meta("annotations", &k.key, json!("true"))),
        ));
    }
    for tt in t.pod_tolerations.iter().filter(|x| on(&x.when)) {
        let mut tol = json!({"key": tt.key, "effect": tt.effect});
        if let Some(o) = &tt.operator {
            tol["operator"] = json!(o);
        }
        if let Some(v) = &tt.value {
            tol["value"] = json!(v);
        }
        out.push((
            format!("Pod toleration {}", tt.key),
            POD_POLICY,
            Write::PodToleration(tol),
        ));
    }
    if t.pod_delete {
        out.push(("Pod delete".into(), POD_POLICY, Write::PodDelete));
    }
    for k in t.gs_labels.iter().filter(|x| on(&x.when)) {
        // `nodeName`: the writer's node, filled in when sent.
        let v = k.value.clone().unwrap_or_else(|| "probe".into());
        out.push((
            format!("GameServer label {}", k.key),
            GS_POLICY,
            Write::Gs(
                meta("labels", &k.key, json!(v)),
                meta("labels", &k.key, Value::Null),
            ),
        ));
    }
    for k in t.gs_annotations.iter().filter(|x| on(&x.when)) {
        out.push((
            format!("GameServer annotation {}", k.key),
            GS_POLICY,
            Write::Gs(
                meta("annotations", &k.key, json!("probe")),
                meta("annotations", &k.key, Value::Null),
            ),
        ));
    }
    for s in &t.gs_delete_states {
        out.push((
            format!("GameServer delete in state {s:?}"),
            GS_POLICY,
            Write::GsDelete(s.clone()),
        ));
    }
    for v in &t.event_verbs {
        out.push((
            format!("Event {v}"),
            EVENT_POLICY,
            Write::Event {
                patch: v == "patch",
            },
        ));
    }
    out
}

/// One node's objects the writes go to, and how to make fresh ones.
struct Target<'a> {
    node: &'a str,
    /// The agent's own node (where an Event's reporter is).
    agent_node: &'a str,
    /// A Ready server with its pod that the patches go to.
    resident: &'a Server,
    agones: &'a Agones,
    admin: &'a kube::Client,
}

impl Target<'_> {
    /// A fresh game server on this node in `state` (`""`: no state yet), with its pod.
    async fn fresh(&self, name: &str, state: &str, safe: &str) -> Server {
        let s = self
            .agones
            .ready_server_evictable(name, self.node, safe)
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        if state != "Ready" {
            let st = if state.is_empty() {
                Value::Null
            } else {
                json!(state)
            };
            // The state as the controller or the SDK sidecar writes it.
            self.agones
                .patch(name, json!({"status": {"state": st}}))
                .await
                .unwrap();
        }
        s
    }

    fn fill(&self, v: &Value) -> Value {
        serde_json::from_str(
            &v.to_string()
                .replace("\"nodeName\"", &format!("\"{}\"", self.node)),
        )
        .unwrap()
    }

    /// Sends `w` through `to`; fresh objects are named after `tag`.
    async fn send(&self, to: &Writes, w: &Write, tag: &str) -> Outcome {
        let pp = PatchParams::default();
        match w {
            Write::Node(set, undo) => {
                outcome(to.nodes.patch(self.node, &pp, &Patch::Merge(set)).await)?;
                outcome(to.nodes.patch(self.node, &pp, &Patch::Merge(undo)).await)
            }
            Write::NodeTaint(taint) => {
                let nodes: Api<Node> = Api::all(self.admin.clone());
                // A NoExecute taint would have the taint manager evict the node's pods, the
                // resident ones too: a server-side dry run goes through admission alike.
                let pp = if taint["effect"] == "NoExecute" {
                    PatchParams::default().dry_run()
                } else {
                    PatchParams::default()
                };
                for add in [true, false] {
                    // As the agent's guarded patch: a write between the read and the patch
                    // (kwok's node status) fails the `test` op with 422 before admission;
                    // read again. Admission's refusal is a 403 and ends the write.
                    let mut tries = 0;
                    loop {
                        let n = serde_json::to_value(nodes.get(self.node).await.unwrap()).unwrap();
                        let mut taints =
                            n["spec"]["taints"].as_array().cloned().unwrap_or_default();
                        if add {
                            taints.push(taint.clone());
                        } else {
                            taints.retain(|t| t["key"] != taint["key"]);
                        }
                        let ops = json!([
                            {"op": "test", "path": "/metadata/resourceVersion", "value": n["metadata"]["resourceVersion"]},
                            {"op": "add", "path": "/spec/taints", "value": taints},
                        ]);
                        let patch: json_patch::Patch = serde_json::from_value(ops).unwrap();
                        tries += 1;
                        match outcome(
                            to.nodes
                                .patch(self.node, &pp, &Patch::Json::<()>(patch))
                                .await,
                        ) {
                            Err((422, _)) if tries < 5 => continue,
                            got => break got?,
                        }
                    }
                }
                Ok(())
            }
            Write::Pod(body) => outcome(
                to.pods
                    .patch(&self.resident.name, &pp, &Patch::Merge(body))
                    .await,
            ),
            Write::PodToleration(tol) => {
                let pods: Api<Pod> = Api::namespaced(self.admin.clone(), &self.agones.ns);
                let p = serde_json::to_value(pods.get(&self.resident.name).await.unwrap()).unwrap();
                let ops = json!([
                    {"op": "test", "path": "/metadata/resourceVersion", "value": p["metadata"]["resourceVersion"]},
                    {"op": "add", "path": "/spec/tolerations/-", "value": tol},
                ]);
                let patch: json_patch::Patch = serde_json::from_value(ops).unwrap();
                outcome(
                    to.pods
                        .patch(&self.resident.name, &pp, &Patch::Json::<()>(patch))
                        .await,
                )
            }
            Write::PodDelete => {
                let s = self
                    .fresh(&format!("{tag}-{}", self.node), "Ready", "Never")
                    .await;
                let dp = DeleteParams {
                    preconditions: Some(Preconditions {
                        uid: Some(pod_uid(self, &s.name).await),
                        resource_version: None,
                    }),
                    ..DeleteParams::default()
                };
                outcome(to.pods.delete(&s.name, &dp).await)
            }
            Write::Gs(set, undo) => {
                let (set, undo) = (self.fill(set), self.fill(undo));
                outcome(
                    to.gs
                        .patch(&self.resident.name, &pp, &Patch::Merge(&set))
                        .await,
                )?;
                outcome(
                    to.gs
                        .patch(&self.resident.name, &pp, &Patch::Merge(&undo))
                        .await,
                )
            }
            Write::GsDelete(state) => {
                let s = self
                    .fresh(&format!("{tag}-{}", self.node), state, "Never")
                    .await;
                let gs = self.agones.get(&s.name).await.unwrap().unwrap();
                let dp = DeleteParams {
                    preconditions: Some(Preconditions {
                        uid: Some(s.uid.clone()),
                        resource_version: gs.metadata.resource_version.clone(),
                    }),
                    ..DeleteParams::default()
                };
                outcome(to.gs.delete(&s.name, &dp).await)
            }
            Write::Event { patch } => {
                let name = format!("{}.{tag}", self.node);
                let ev = agent_event(&name, self.node, self.agent_node);
                let events = to.events_in("default");
                if *patch {
                    // The first occurrence, then the repeat as a series (kube's recorder).
                    Api::<DynamicObject>::namespaced_with(
                        self.admin.clone(),
                        "default",
                        &events_resource(),
                    )
                    .create(&PostParams::default(), &serde_json::from_value(ev).unwrap())
                    .await
                    .unwrap();
                    let series = json!({"series": {"count": 2, "lastObservedTime": now_micro()}});
                    outcome(events.patch(&name, &pp, &Patch::Merge(&series)).await)
                } else {
                    outcome(
                        events
                            .create(&PostParams::default(), &serde_json::from_value(ev).unwrap())
                            .await,
                    )
                }
            }
        }
    }
}

async fn pod_uid(t: &Target<'_>, name: &str) -> String {
    Api::<Pod>::namespaced(t.admin.clone(), &t.agones.ns)
        .get(name)
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap()
}

fn now_micro() -> String {
    jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%S.%6fZ")
        .to_string()
}

/// An Event as the agent of `reporter` writes one about Node `about` (kube-runtime's recorder).
fn agent_event(name: &str, about: &str, reporter: &str) -> Value {
    json!({
        "apiVersion": "events.k8s.io/v1", "kind": "Event",
        "metadata": {"name": name, "namespace": "default"},
        "eventTime": now_micro(),
        "action": "DrainStarted", "reason": "DrainStarted", "type": "Normal",
        "note": "probe",
        "regarding": {"apiVersion": "v1", "kind": "Node", "name": about},
        "reportingController": "lastcall-agent", "reportingInstance": reporter,
    })
}

/// The writes just outside the table, each on the agent's own node (or node B where so
/// named): (what, the policy that must refuse it, what its message says).
struct Hostile<'a> {
    agent: &'a Writes,
    admin: &'a kube::Client,
    a: &'a str,
    b: &'a str,
    ns: &'a str,
    game_a: &'a Server,
    game_b: &'a Server,
    allocated_a: &'a Server,
}

impl Hostile<'_> {
    async fn run(&self, options: Options) {
        let pp = &PatchParams::default();
        let (a, b) = (self.a, self.b);
        let w = self.agent;
        let image = |c: &str| json!({"spec": {"containers": [{"name": c, "image": "attacker.example/root:1"}]}});
        // The game pod's own container (the Agones model's template names it).
        let game_container = Api::<Pod>::namespaced(self.admin.clone(), self.ns)
            .get(&self.game_a.name)
            .await
            .expect("game pod on A")
            .spec
            .and_then(|s| s.containers.into_iter().next())
            .map(|c| c.name)
            .expect("a container");
        // An image rewrite is root on the node: a system pod's, and a game pod's.
        let sys = Api::<Pod>::namespaced(self.agent.events.clone(), "kube-system");
        assert_refused_by(
            "rewrite the image of a system pod on A",
            &outcome(
                sys.patch(&format!("cni-{a}"), pp, &Patch::Strategic(image("cni")))
                    .await,
            ),
            POD_POLICY,
            a,
        );
        assert_refused_by(
            "rewrite the image of a game pod on A",
            &outcome(
                w.pods
                    .patch(
                        &self.game_a.name,
                        pp,
                        &Patch::Strategic(image(&game_container)),
                    )
                    .await,
            ),
            POD_POLICY,
            a,
        );
        assert_refused_by(
            "relabel a game pod on A",
            &outcome(
                w.pods
                    .patch(
                        &self.game_a.name,
                        pp,
                        &Patch::Merge(
                            json!({"metadata": {"labels": {"agones.dev/safe-to-evict": "true"}}}),
                        ),
                    )
                    .await,
            ),
            POD_POLICY,
            a,
        );
        assert_refused_by(
            "annotate a game pod on A with a key lastcall never writes",
            &outcome(
                w.pods
                    .patch(&self.game_a.name, pp, &merge_annotation())
                    .await,
            ),
            POD_POLICY,
            a,
        );
        assert_refused_by(
            "delete a system pod on A",
            &outcome(
                sys.delete(&format!("cni-{a}"), &DeleteParams::default())
                    .await,
            ),
            POD_POLICY,
            a,
        );
        if !options.compat_taints {
            let tol = json!([{"op": "add", "path": "/spec/tolerations/-",
                "value": {"key": "gamelift.status/draining", "operator": "Equal", "value": "true", "effect": "NoExecute"}}]);
            let patch: json_patch::Patch = serde_json::from_value(tol).unwrap();
            assert_refused_by(
                "the compat toleration without compat mode",
                &outcome(
                    w.pods
                        .patch(&self.game_a.name, pp, &Patch::Json::<()>(patch))
                        .await,
                ),
                POD_POLICY,
                a,
            );
        }
        // The Node: a kubelet-only label, a key lastcall never writes, a finalizer, the
        // spec, another writer's taint, lastcall's taint with another effect; node B.
        let node =
            |body: Value| async move { outcome(w.nodes.patch(a, pp, &Patch::Merge(body)).await) };
        assert_refused_saying(
            "label A node-restriction.kubernetes.io/x",
            &node(json!({"metadata": {"labels": {"node-restriction.kubernetes.io/x": "y"}}})).await,
            NODE_POLICY,
            "node-restriction.kubernetes.io/x",
        );
        assert_refused_saying(
            "label A lastcall.dev/drain (the operator's label)",
            &node(json!({"metadata": {"labels": {"lastcall.dev/drain": "true"}}})).await,
            NODE_POLICY,
            "lastcall.dev/drain",
        );
        assert_refused_saying(
            "annotate A with a key lastcall never writes",
            &node(json!({"metadata": {"annotations": {PROBE: "x"}}})).await,
            NODE_POLICY,
            PROBE,
        );
        assert_refused_by(
            "add a finalizer to A",
            &node(json!({"metadata": {"finalizers": ["example.com/hold"]}})).await,
            NODE_POLICY,
            a,
        );
        assert_refused_by(
            "set A's providerID",
            &node(json!({"spec": {"providerID": "aws:///us-west-2a/i-0attacker"}})).await,
            NODE_POLICY,
            a,
        );
        if !options.gke_hand_back {
            assert_refused_saying(
                "GKE's hand-back label without agent.gkeHandBack",
                &node(json!({"metadata": {"labels": {"cloud.google.com/perform-maintenance": "true"}}})).await,
                NODE_POLICY,
                "cloud.google.com/perform-maintenance",
            );
        }
        let nodes_admin: Api<Node> = Api::all(self.admin.clone());
        let taints_with = |extra: Value, drop_foreign: bool| {
            let nodes_admin = nodes_admin.clone();
            async move {
                let n = serde_json::to_value(nodes_admin.get(a).await.unwrap()).unwrap();
                let mut t: Vec<Value> = n["spec"]["taints"].as_array().cloned().unwrap_or_default();
                if drop_foreign {
                    t.retain(|x| x["key"] != "example.com/foreign");
                }
                if !extra.is_null() {
                    t.push(extra);
                }
                let ops = json!([
                    {"op": "test", "path": "/metadata/resourceVersion", "value": n["metadata"]["resourceVersion"]},
                    {"op": "add", "path": "/spec/taints", "value": t}]);
                serde_json::from_value::<json_patch::Patch>(ops).unwrap()
            }
        };
        for (what, patch) in [
            (
                "add another writer's taint to A",
                taints_with(
                    json!({"key": "example.com/x", "effect": "NoSchedule"}),
                    false,
                )
                .await,
            ),
            (
                "remove another writer's taint from A",
                taints_with(Value::Null, true).await,
            ),
            (
                "lastcall's taint as NoExecute on A",
                taints_with(
                    json!({"key": "lastcall.dev/draining", "value": "x", "effect": "NoExecute"}),
                    false,
                )
                .await,
            ),
        ] {
            assert_refused_by(
                what,
                &outcome(w.nodes.patch(a, pp, &Patch::Json::<()>(patch)).await),
                NODE_POLICY,
                a,
            );
        }
        if !options.compat_taints {
            let patch = taints_with(
                json!({"key": "gamelift.status/draining", "value": "true", "effect": "NoExecute"}),
                false,
            )
            .await;
            assert_refused_by(
                "the compat taint without compat mode",
                &outcome(w.nodes.patch(a, pp, &Patch::Json::<()>(patch)).await),
                NODE_POLICY,
                a,
            );
        }
        assert_refused_by(
            "patch node B",
            &outcome(
                w.nodes
                    .patch(
                        b,
                        pp,
                        &Patch::Merge(json!({"spec": {"unschedulable": true}})),
                    )
                    .await,
            ),
            NODE_POLICY,
            b,
        );
        // GameServers: the spec (a pod template image), the state, a claim for another
        // node, a delete of a match, one on node B.
        let gs = |body: Value| async move {
            outcome(w.gs.patch(&self.game_a.name, pp, &Patch::Merge(body)).await)
        };
        assert_refused_by(
            "patch a GameServer's spec on A",
            &gs(json!({"spec": {"template": {"spec": {"containers": [{"name": "gameserver", "image": "attacker.example/root:1"}]}}}})).await,
            GS_POLICY,
            a,
        );
        assert_refused_by(
            "allocate a GameServer on A",
            &gs(json!({"status": {"state": "Allocated"}})).await,
            GS_POLICY,
            a,
        );
        assert_refused_by(
            "claim a GameServer on A for node B",
            &gs(json!({"metadata": {"labels": {"lastcall.dev/node": b}}})).await,
            GS_POLICY,
            a,
        );
        let alloc = self.allocated_a;
        let rv = Api::<DynamicObject>::namespaced_with(
            self.admin.clone(),
            self.ns,
            &agones::gameservers_resource(),
        )
        .get(&alloc.name)
        .await
        .unwrap()
        .metadata
        .resource_version;
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(alloc.uid.clone()),
                resource_version: rv,
            }),
            ..DeleteParams::default()
        };
        assert_refused_saying(
            "delete an Allocated GameServer on A",
            &outcome(w.gs.delete(&alloc.name, &dp).await),
            GS_POLICY,
            "in state Allocated",
        );
        assert_refused_by(
            "patch a GameServer on B",
            &outcome(
                w.gs.patch(
                    &self.game_b.name,
                    pp,
                    &Patch::Merge(
                        json!({"metadata": {"annotations": {"lastcall.dev/drain-reason": "x"}}}),
                    ),
                )
                .await,
            ),
            GS_POLICY,
            b,
        );
        // Events: about another node, about another object, in another namespace, with
        // another reporter, through the core API.
        let create = |ns: &str, ev: Value| {
            let api = w.events_in(ns);
            async move {
                outcome(
                    api.create(&PostParams::default(), &serde_json::from_value(ev).unwrap())
                        .await,
                )
            }
        };
        assert_refused_saying(
            "an Event about node B",
            &create("default", agent_event(&format!("{b}.hostile"), b, a)).await,
            EVENT_POLICY,
            &format!("about Node {b}"),
        );
        let mut about_pod = agent_event(&format!("{a}.hostile-pod"), a, a);
        about_pod["regarding"] =
            json!({"apiVersion": "v1", "kind": "Pod", "namespace": "default", "name": "victim"});
        assert_refused_saying(
            "an Event about a pod",
            &create("default", about_pod).await,
            EVENT_POLICY,
            "about Pod victim",
        );
        // A namespaced object's Event lives in its namespace: a GameServer's, on another node.
        let mut elsewhere = agent_event(&format!("{a}.hostile-ns"), a, a);
        elsewhere["metadata"]["namespace"] = json!(self.ns);
        elsewhere["regarding"] = json!({"apiVersion": "agones.dev/v1", "kind": "GameServer",
                                        "namespace": self.ns, "name": self.game_b.name});
        assert_refused_saying(
            "an Event in an unrelated namespace",
            &create(self.ns, elsewhere).await,
            EVENT_POLICY,
            &format!("in namespace \"{}\"", self.ns),
        );
        assert_refused_saying(
            "an Event about A reported as B's agent",
            &create("default", agent_event(&format!("{a}.hostile-rep"), a, b)).await,
            EVENT_POLICY,
            &format!("about Node {a}"),
        );
        // The chart grants no core Events; another binding that does is still held.
        grant(
            self.admin,
            "box-extra-core-events",
            json!({"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}),
        )
        .await;
        let core: Api<k8s_openapi::api::core::v1::Event> =
            Api::namespaced(w.events.clone(), "default");
        let core_ev: k8s_openapi::api::core::v1::Event = serde_json::from_value(json!({
            "metadata": {"name": format!("{a}.hostile-core"), "namespace": "default"},
            "involvedObject": {"kind": "Node", "name": a}, "reason": "DrainStarted", "message": "probe"}))
        .unwrap();
        // RBAC's cache takes the new binding in a moment: until then RBAC refuses first.
        let got = try_eventually(
            "the agent's core Event judged by the policy, not RBAC",
            Duration::from_secs(30),
            Duration::from_millis(200),
            || async {
                let got = outcome(core.create(&PostParams::default(), &core_ev).await);
                (!matches!(&got, Err((403, m)) if m.contains("cannot create resource")))
                    .then_some(got)
            },
        )
        .await
        .expect("the extra binding in effect");
        assert_refused_saying("a core Event about A", &got, EVENT_POLICY, "core Event");
    }

    /// Evictions by the agent's token, once (the extra binding stays): refused by RBAC on
    /// its own node and another, then, with another binding granting them, by the pod
    /// policy; no pod ends.
    async fn evictions(&self) {
        let a = self.a;
        let sys = Api::<Pod>::namespaced(self.agent.events.clone(), "kube-system");
        // Evictions: RBAC grants none, on the agent's own node or another.
        let game = Api::<Pod>::namespaced(self.agent.events.clone(), self.ns);
        for (what, pods, pod) in [
            ("evict a game pod on A", &game, self.game_a.name.clone()),
            ("evict a system pod on A", &sys, format!("cni-{a}")),
            ("evict a game pod on B", &game, self.game_b.name.clone()),
        ] {
            assert_refused_by_rbac(
                what,
                &outcome(pods.evict(&pod, &EvictParams::default()).await),
            );
        }
        // The chart grants no Eviction; another binding that does is still held, by the pod
        // policy, on the agent's own node too.
        grant(
            self.admin,
            "box-extra-evictions",
            json!({"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]}),
        )
        .await;
        let got = try_eventually(
            "the agent's Eviction judged by the policy, not RBAC",
            Duration::from_secs(30),
            Duration::from_millis(200),
            || async {
                let got = outcome(game.evict(&self.game_a.name, &EvictParams::default()).await);
                (!matches!(&got, Err((403, m)) if m.contains("cannot create resource")))
                    .then_some(got)
            },
        )
        .await
        .expect("the extra binding in effect");
        assert_refused_saying(
            "evict a game pod on A with an extra binding",
            &got,
            POD_POLICY,
            "CREATE pods/eviction",
        );
        for (ns, pod) in [
            (self.ns, &self.game_a.name),
            (self.ns, &self.game_b.name),
            ("kube-system", &format!("cni-{a}")),
        ] {
            let p = Api::<Pod>::namespaced(self.admin.clone(), ns)
                .get(pod)
                .await
                .unwrap_or_else(|e| panic!("{pod} is gone after refused evictions: {e}"));
            assert!(
                p.metadata.deletion_timestamp.is_none(),
                "{pod} is terminating after refused evictions"
            );
        }
    }
}

/// RBAC refused it: the agent's ClusterRole grants no such verb.
fn assert_refused_by_rbac(what: &str, got: &Outcome) {
    let Err((code, message)) = got else {
        panic!("{what}: admitted, but RBAC must refuse it");
    };
    assert_eq!(*code, 403, "{what}: {message}");
    assert!(
        message.contains("cannot create resource \"pods/eviction\"")
            && !message.contains("ValidatingAdmissionPolicy"),
        "{what}: refused, but not by RBAC: {message}"
    );
}

/// Another ClusterRole `name` bound to the agent's ServiceAccount that grants it `rule` (as a
/// cluster's own RBAC might: core Events, Evictions), so the policy, not RBAC, is what
/// refuses them.
async fn grant(admin: &kube::Client, name: &str, rule: Value) {
    let rbac = |kind: &str, plural: &str| ApiResource {
        group: "rbac.authorization.k8s.io".into(),
        version: "v1".into(),
        api_version: "rbac.authorization.k8s.io/v1".into(),
        kind: kind.into(),
        plural: plural.into(),
    };
    let role: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": [rule]}))
    .unwrap();
    let binding: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": NAMESPACE}]}))
    .unwrap();
    for (obj, ar) in [
        (role, rbac("ClusterRole", "clusterroles")),
        (binding, rbac("ClusterRoleBinding", "clusterrolebindings")),
    ] {
        match Api::<DynamicObject>::all_with(admin.clone(), &ar)
            .create(&PostParams::default(), &obj)
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => panic!("{name}: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_token_makes_only_the_tables_writes_on_its_own_node() {
    let kbox = kube_box::lease().await;
    eprintln!("box started in {:?}", kbox.started_in());
    let admin = kbox.client().await.expect("admin client");
    agones::install_crd(&admin, Crd::SelectableNodeName)
        .await
        .expect("GameServer CRD");
    let ns = "box-admission";
    namespace(&admin, ns).await;
    let (a, b) = ("adm-a", "adm-b");
    for n in [a, b] {
        create_node(&admin, n).await.expect("kwok node");
    }
    let notes = install_chart(&kbox);
    assert!(
        notes.contains("Each agent may make only lastcall's writes"),
        "the install's notes do not say the node restriction is on:\n{notes}"
    );
    // The `auto` switch found ValidatingAdmissionPolicy v1 in the API server's discovery, and
    // the API server type-checked every expression against the kinds it matches.
    policies_checked(&admin).await;

    // Resident servers on both nodes (none selected by a PDB, so only RBAC or a policy can
    // refuse an eviction), a match on A, and a system pod on each node.
    let agones = Agones::new(&admin, ns);
    let game_a = agones.ready_server("gs-a", a).await.expect("gs-a");
    let game_b = agones.ready_server("gs-b", b).await.expect("gs-b");
    let allocated_a = agones
        .ready_server("gs-a-match", a)
        .await
        .expect("gs-a-match");
    assert!(matches!(
        agones.allocate(&allocated_a.name).await.unwrap(),
        Allocation::Allocated(_)
    ));
    for n in [a, b] {
        system_pod(&admin, "kube-system", &format!("cni-{n}"), n).await;
    }

    let probe = agent_pod(&admin, "probe-adm-a", a).await;
    let agent = client_for(&kbox, &token(&admin, Some(&probe)).await).await;
    let user = who(&agent).await;
    assert_eq!(
        user["username"],
        format!("system:serviceaccount:{NAMESPACE}:{SERVICE_ACCOUNT}")
    );
    assert_eq!(
        user["extra"][NODE_NAME_KEY],
        json!([a]),
        "the pod-bound token carries its node: {user}"
    );
    let w = Writes::new(&agent, ns);

    // The policies take a moment to reach the admission plugin: probe with a dry run.
    let refused_dry = try_eventually(
        "the node restriction refuses a dry-run write to another node",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async {
            let r = w
                .nodes
                .patch(b, &PatchParams::default().dry_run(), &merge_annotation())
                .await;
            matches!(r, Err(kube::Error::Api(ref s)) if s.code == 403 && s.message.contains(NODE_POLICY))
                .then_some(())
        },
    )
    .await;
    if let Err(e) = refused_dry {
        panic!(
            "{e}: {:?}",
            outcome(
                w.nodes
                    .patch(b, &PatchParams::default().dry_run(), &merge_annotation())
                    .await
            )
        );
    }

    let table = Table::load(&repo()).expect("charts/lastcall/agent-writes.yaml");
    let at = |node: &'static str, resident| Target {
        node,
        agent_node: a,
        resident,
        agones: &agones,
        admin: &admin,
    };
    // Another writer's taint on A, which every write of the agent must keep.
    Api::<Node>::all(admin.clone())
        .patch(
            a,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"taints": [
                {"key": "example.com/foreign", "value": "x", "effect": "PreferNoSchedule"}]}})),
        )
        .await
        .expect("a foreign taint");
    let hostile = Hostile {
        agent: &w,
        admin: &admin,
        a,
        b,
        ns,
        game_a: &game_a,
        game_b: &game_b,
        allocated_a: &allocated_a,
    };
    for (round, options) in [Options::default(), Options::ALL].into_iter().enumerate() {
        if options != Options::default() {
            install_chart_with(
                &kbox,
                &["agent.compatTaints=true", "agent.gkeHandBack=true"],
            );
            policies_checked(&admin).await;
            // The widened policies reach the admission plugin: a compat taint's dry run.
            let nodes_admin: Api<Node> = Api::all(admin.clone());
            try_eventually(
                "the widened policies admit the compat taint",
                Duration::from_secs(30),
                Duration::from_millis(200),
                || async {
                    let n = serde_json::to_value(nodes_admin.get(a).await.ok()?).ok()?;
                    let mut t = n["spec"]["taints"].as_array().cloned().unwrap_or_default();
                    t.push(json!({"key": "gamelift.status/active", "value": "true", "effect": "NoExecute"}));
                    let ops = json!([{"op": "add", "path": "/spec/taints", "value": t}]);
                    let p: json_patch::Patch = serde_json::from_value(ops).ok()?;
                    w.nodes
                        .patch(a, &PatchParams::default().dry_run(), &Patch::Json::<()>(p))
                        .await
                        .ok()
                        .map(|_| ())
                },
            )
            .await
            .expect("the policies of agent.compatTaints");
            // Each policy reaches the admission plugin on its own: the pod policy's widening
            // too (a dry run of the compat toleration on the game pod of A).
            let pods_admin: Api<Pod> = Api::namespaced(admin.clone(), &agones.ns);
            try_eventually(
                "the widened pod policy admits the compat toleration",
                Duration::from_secs(30),
                Duration::from_millis(200),
                || async {
                    let p = serde_json::to_value(pods_admin.get(&game_a.name).await.ok()?).ok()?;
                    let ops = json!([
                        {"op": "test", "path": "/metadata/resourceVersion", "value": p["metadata"]["resourceVersion"]},
                        {"op": "add", "path": "/spec/tolerations/-", "value": {"key": "gamelift.status/draining", "operator": "Equal", "value": "true", "effect": "NoExecute"}},
                    ]);
                    let patch: json_patch::Patch = serde_json::from_value(ops).ok()?;
                    w.pods
                        .patch(&game_a.name, &PatchParams::default().dry_run(), &Patch::Json::<()>(patch))
                        .await
                        .ok()
                        .map(|_| ())
                },
            )
            .await
            .expect("the pod policy of agent.compatTaints");
        }
        let writes = table_writes(&table, options);
        // Every write of the table: admitted on the agent's own node, refused on B.
        for (i, (name, policy, write)) in writes.iter().enumerate() {
            let tag = format!("w{round}{i}");
            assert_admitted(
                &format!("{name} on A ({options:?})"),
                &at(a, &game_a).send(&w, write, &format!("{tag}a")).await,
            );
            let on_b = at(b, &game_b).send(&w, write, &format!("{tag}b")).await;
            match write {
                // An Event about node B is judged on what it is about.
                Write::Event { .. } => assert_refused_saying(
                    &format!("{name} about B"),
                    &on_b,
                    policy,
                    &format!("about Node {b}"),
                ),
                _ => assert_refused_by(&format!("{name} on B"), &on_b, policy, b),
            }
        }
        // The option-only writes of the table are refused without the option.
        if options == Options::default() {
            let all = table_writes(&table, Options::ALL);
            let plain: Vec<String> = writes.iter().map(|(n, _, _)| n.clone()).collect();
            let optional: Vec<_> = all.iter().filter(|(n, _, _)| !plain.contains(n)).collect();
            assert!(
                optional.len() >= 3,
                "compat taints and toleration, the hand-back label: {optional:?}"
            );
            for (i, (name, policy, write)) in optional.into_iter().enumerate() {
                let got = at(a, &game_a).send(&w, write, &format!("opt{i}")).await;
                let Err((403, m)) = &got else {
                    panic!("{name} on A without its option: {got:?}");
                };
                assert!(
                    m.contains(&format!("ValidatingAdmissionPolicy '{policy}'")),
                    "{name}: {m}"
                );
            }
        }
        hostile.run(options).await;
    }
    hostile.evictions().await;

    // Node B, its pod and its server were never written.
    let admin_w = Writes::new(&admin, ns);
    let node_b = serde_json::to_value(admin_w.nodes.get(b).await.unwrap()).unwrap();
    assert!(
        node_b.pointer("/spec/unschedulable").is_none()
            && node_b
                .pointer("/spec/taints")
                .is_none_or(|t| t.as_array().is_some_and(Vec::is_empty)),
        "Node B was written: {node_b}"
    );
    let pod_b = admin_w.pods.get("gs-b").await.expect("pod gs-b survives");
    assert!(
        pod_b.metadata.deletion_timestamp.is_none(),
        "pod gs-b was ended"
    );
    let gs_b = admin_w.gs.get("gs-b").await.expect("gs-b survives");
    assert_eq!(gs_b.metadata.uid.as_deref(), Some(game_b.uid.as_str()));
    assert!(
        !gs_b
            .metadata
            .annotations
            .unwrap_or_default()
            .contains_key("lastcall.dev/drain-reason"),
        "gs-b was written"
    );

    // A GameServer on node A cannot be moved to node B by the agent either.
    assert_refused_by(
        "move GameServer gs-a to node B",
        &outcome(
            w.gs.patch(
                &game_a.name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"nodeName": b}})),
            )
            .await,
        ),
        GS_POLICY,
        a,
    );

    // A token of the same ServiceAccount bound to no pod carries no node: it writes nothing,
    // not even node A's objects.
    let unbound = client_for(&kbox, &token(&admin, None).await).await;
    assert!(
        who(&unbound).await["extra"].get(NODE_NAME_KEY).is_none(),
        "an unbound token has no node"
    );
    let got = outcome(
        Api::<Node>::all(unbound)
            .patch(
                a,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"unschedulable": true}})),
            )
            .await,
    );
    match &got {
        Err((403, m)) if m.contains(NODE_POLICY) && m.contains(NODE_NAME_KEY) => {}
        other => panic!("a token without a node must be refused by {NODE_POLICY}: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_drain_completes_under_the_node_restriction() {
    let kbox = kube_box::lease().await;
    let admin = kbox.client().await.expect("admin client");
    agones::install_crd(&admin, Crd::SelectableNodeName)
        .await
        .expect("GameServer CRD");
    install_chart(&kbox);
    let ns = "box-admission-drain";
    namespace(&admin, ns).await;
    let node = "adm-drain";
    create_node(&admin, node).await.expect("kwok node");
    let agones = Agones::new(&admin, ns);
    let idle = vec![
        agones.ready_server("gs-0", node).await.unwrap(),
        agones.ready_server("gs-1", node).await.unwrap(),
    ];
    let busy = agones.ready_server("gs-2", node).await.unwrap();
    assert!(matches!(
        agones.allocate(&busy.name).await.unwrap(),
        Allocation::Allocated(_)
    ));
    // The real agent with a token bound to its pod on the node (kube_box::agent).
    let started = jiff::Timestamp::now();
    let agent = AgentProcess::start(&kbox, node, Extra::default())
        .await
        .expect("the agent");
    agent.ready().await.expect("agent ready");
    Api::<Node>::all(admin.clone())
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"lastcall.dev/drain": "true"}}})),
        )
        .await
        .unwrap();
    let done = try_eventually(
        "fenced, idle servers released, the match protected",
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async {
            let n =
                serde_json::to_value(Api::<Node>::all(admin.clone()).get(node).await.ok()?).ok()?;
            let fenced = n.pointer("/spec/unschedulable") == Some(&json!(true))
                && n.pointer("/spec/taints")?
                    .as_array()?
                    .iter()
                    .any(|t| t["key"] == "lastcall.dev/draining");
            for s in &idle {
                if agones.get(&s.name).await.ok()?.is_some() {
                    return None;
                }
            }
            let gs = agones.get(&busy.name).await.ok()??;
            let protected = gs
                .metadata
                .annotations?
                .contains_key("lastcall.dev/drain-deadline");
            (fenced && protected).then_some(())
        },
    )
    .await;
    let refused: Vec<String> = kbox
        .audit()
        .into_iter()
        .filter(|e| e.by_agent() && e.is_write() && e.received >= Some(started))
        .filter(|e| e.refused_by_policy())
        .map(|e| lastcall_testkit::kube_box::audit::describe(&e))
        .collect();
    if let Err(e) = done {
        panic!("{e}\nthe agent's refused writes:\n{}", refused.join("\n"));
    }
    assert!(
        refused.is_empty(),
        "the policy refused the agent's own drain:\n{}",
        refused.join("\n")
    );
    // The drain went through the policy: the agent's own writes, by its pod-bound token.
    let writes = kbox
        .audit()
        .into_iter()
        .filter(|e| e.by_agent() && e.is_write() && e.ok() && e.received >= Some(started))
        .filter(|e| e.resource == "nodes" || e.resource == "gameservers")
        .count();
    assert!(writes >= 3, "only {writes} accepted agent writes");
    agent.stop().await.expect("agent stops");
}

/// The agent's own metric `name`, once it has a value.
async fn gauge(agent: &AgentProcess, name: &str) -> f64 {
    try_eventually(
        &format!("the agent's {name}"),
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async { lastcall_testkit::agent::metric(&agent.metrics().await, name, &[]) },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.output()))
}

/// The events.k8s.io Events about Node `node` with `reason`.
async fn node_events(admin: &kube::Client, node: &str, reason: &str) -> Vec<DynamicObject> {
    Api::<DynamicObject>::namespaced_with(admin.clone(), "default", &events_resource())
        .list(&kube::api::ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.data["regarding"]["name"] == node && e.data["reason"] == reason)
        .collect()
}

/// Where the restriction cannot hold an agent, the agent says so at start-up instead of
/// running with every node's objects in reach: with the policies left out by the operator's
/// explicit `agent.nodeRestriction.enabled=false` (the install's notes warn) and a token bound
/// to no pod, the real agent logs why, sets `lastcall_node_restriction_enforceable` to 0 and
/// posts a `NodeRestrictionUnenforceable` Warning Event on its Node. The same agent with its
/// pod's own token under the chart's policies sets 1 and posts none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_the_restriction_cannot_hold_says_so() {
    let kbox = kube_box::lease().await;
    let admin = kbox.client().await.expect("admin client");
    agones::install_crd(&admin, Crd::SelectableNodeName)
        .await
        .expect("GameServer CRD");
    let notes = install_chart_with(&kbox, &["agent.nodeRestriction.enabled=false"]);
    assert!(
        notes.contains("WARNING: the node restriction is off"),
        "{notes}"
    );
    let policies: Api<DynamicObject> = Api::all_with(
        admin.clone(),
        &vap_resource("ValidatingAdmissionPolicy", "validatingadmissionpolicies"),
    );
    wait_for("the opted-out release's policies removed", || async {
        policies
            .get_opt(NODE_POLICY)
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;
    let (unheld, held) = ("adm-unheld", "adm-held");
    for n in [unheld, held] {
        create_node(&admin, n).await.expect("kwok node");
    }
    let agent = AgentProcess::start_unbound(&kbox, unheld, Extra::default())
        .await
        .expect("the agent");
    agent
        .ready()
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", agent.output()));
    assert_eq!(
        gauge(&agent, "lastcall_node_restriction_enforceable").await,
        0.0
    );
    let said = try_eventually(
        "the Warning Event on the agent's Node",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async {
            let evs = node_events(&admin, unheld, "NodeRestrictionUnenforceable").await;
            evs.into_iter().next()
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.output()));
    assert_eq!(said.data["type"], "Warning");
    let note = said.data["note"].as_str().unwrap_or_default();
    assert!(
        note.contains("may write every node's") && note.contains(NODE_NAME_KEY),
        "{note}"
    );
    let out = agent.output();
    assert!(
        out.contains("the node restriction cannot hold this agent") && out.contains(NODE_NAME_KEY),
        "no log line:\n{out}"
    );
    agent.stop().await.expect("agent stops");

    install_chart(&kbox);
    policies_checked(&admin).await;
    let agent = AgentProcess::start(&kbox, held, Extra::default())
        .await
        .expect("the agent");
    agent
        .ready()
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", agent.output()));
    // The gauge is set before the Event would be queued, in the same step.
    assert_eq!(
        gauge(&agent, "lastcall_node_restriction_enforceable").await,
        1.0
    );
    assert!(
        node_events(&admin, held, "NodeRestrictionUnenforceable")
            .await
            .is_empty(),
        "a held agent said it is not held"
    );
    agent.stop().await.expect("agent stops");
}

/// `auto` follows what helm knows of the API server: a live discovery with the kind, or
/// offline a target Kubernetes version of 1.30 or later, renders the policies; where the API
/// server cannot run them the chart refuses to install, naming the value that opts out, and
/// only that explicit `false` installs without them (its notes say what that leaves open).
#[test]
fn auto_renders_the_policies_only_where_the_api_server_serves_them() {
    let chart = repo().join("charts/lastcall");
    let chart = chart.to_string_lossy();
    let render = |extra: &[&str]| -> anyhow::Result<String> {
        let mut args = vec![
            "template",
            "lastcall",
            &chart,
            "--set",
            "image.registry=registry.invalid/lastcall",
        ];
        args.extend_from_slice(extra);
        helm(&args)
    };
    let has = |t: &str| t.contains("kind: ValidatingAdmissionPolicy\n");
    assert!(
        has(&render(&["--kube-version", "1.30.0"]).unwrap()),
        "offline 1.30"
    );
    // No policy API: refused, unless opted out.
    let refused = |got: anyhow::Result<String>, what: &str| {
        let err = got.expect_err(what).to_string();
        assert!(
            err.contains("does not serve ValidatingAdmissionPolicy v1")
                && err.contains("agent.nodeRestriction.enabled=false"),
            "{what}: {err}"
        );
    };
    refused(render(&["--kube-version", "1.29.9"]), "offline 1.29");
    // A live discovery lists kinds: without the policy kind (a 1.29 API server), none.
    refused(render(&["--api-versions", "v1/Pod"]), "live, no VAP");
    assert!(has(&render(&[
        "--kube-version",
        "1.29.9",
        "--api-versions",
        "v1/Pod",
        "--api-versions",
        "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy",
    ])
    .unwrap()));
    let off = render(&[
        "--kube-version",
        "1.29.9",
        "--set",
        "agent.nodeRestriction.enabled=false",
    ])
    .unwrap();
    assert!(!has(&off), "opted out");
    assert!(has(&render(&[
        "--kube-version",
        "1.29.9",
        "--set",
        "agent.nodeRestriction.enabled=true"
    ])
    .unwrap()));
    // Without the agents there is nothing to restrict: no refusal.
    assert!(!has(&render(&[
        "--kube-version",
        "1.29.9",
        "--set",
        "agent.enabled=false"
    ])
    .unwrap()));
    // The opted-out install's notes say what it leaves open.
    let out = helm(&[
        "install",
        "lastcall",
        &chart,
        "--dry-run=client",
        "--set",
        "image.registry=registry.invalid/lastcall",
        "--set",
        "agent.nodeRestriction.enabled=false",
    ])
    .unwrap();
    assert!(
        out.contains("WARNING: the node restriction is off") && out.contains("every agent may"),
        "{out}"
    );
    // Without a registry the chart refuses to render, naming the value and the docs.
    let err = helm(&["template", "lastcall", &chart]).expect_err("no registry");
    let err = err.to_string();
    assert!(
        err.contains("image.registry is required") && err.contains("docs/install.md"),
        "{err}"
    );
}

/// Label selection under the policy: a game-server pod is on the node but its GameServer
/// does not name the node yet (Agones has not marked it Scheduled), so the agent's claim is
/// refused; once the server names the node, the agent's next pass claims it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_waits_until_the_server_names_the_node() {
    let kbox = kube_box::lease().await;
    let admin = kbox.client().await.expect("admin client");
    agones::install_crd(&admin, Crd::LabelsOnly)
        .await
        .expect("GameServer CRD");
    install_chart(&kbox);
    let ns = "box-admission-claim";
    namespace(&admin, ns).await;
    let node = "adm-claim";
    create_node(&admin, node).await.expect("kwok node");
    let gs_api: Api<DynamicObject> =
        Api::namespaced_with(admin.clone(), ns, &agones::gameservers_resource());
    let gs: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "agones.dev/v1", "kind": "GameServer",
        "metadata": {"name": "gs-new", "namespace": ns},
        "spec": {"container": "gameserver",
                 "template": {"spec": {"containers": [{"name": "gameserver", "image": "gameserver"}]}}},
        "status": {"state": "Creating"},
    }))
    .unwrap();
    let gs = gs_api.create(&PostParams::default(), &gs).await.unwrap();
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "gs-new", "namespace": ns,
                     "labels": {"agones.dev/role": "gameserver", "agones.dev/gameserver": "gs-new"},
                     "ownerReferences": [{"apiVersion": "agones.dev/v1", "kind": "GameServer",
                                          "name": "gs-new", "uid": gs.metadata.uid, "controller": true}]},
        "spec": {"nodeName": node, "terminationGracePeriodSeconds": 1,
                 "containers": [{"name": "gameserver", "image": "gameserver"}]},
    }))
    .unwrap();
    Api::<Pod>::namespaced(admin.clone(), ns)
        .create(&PostParams::default(), &pod)
        .await
        .unwrap();
    let started = jiff::Timestamp::now();
    let agent = AgentProcess::start(&kbox, node, Extra::default())
        .await
        .expect("the agent");
    let refused_claim = || {
        kbox.audit().into_iter().any(|e| {
            e.by_agent()
                && e.resource == "gameservers"
                && e.name == "gs-new"
                && e.verb == "patch"
                && e.code == 403
                && e.received >= Some(started)
        })
    };
    let refused = try_eventually(
        "the agent's claim of a server that names no node is refused",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async { refused_claim().then_some(()) },
    )
    .await;
    if let Err(e) = refused {
        panic!("{e}\nagent output:\n{}", agent.output());
    }
    assert!(
        !gs_api
            .get("gs-new")
            .await
            .unwrap()
            .metadata
            .labels
            .unwrap_or_default()
            .contains_key("lastcall.dev/node"),
        "claimed before the server named the node"
    );
    // Agones marks it Scheduled on the node: the agent's next pass claims it.
    gs_api
        .patch(
            "gs-new",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"state": "Scheduled", "nodeName": node}})),
        )
        .await
        .unwrap();
    let claimed = try_eventually(
        "the agent claims the server once it names the node",
        Duration::from_secs(40),
        Duration::from_millis(200),
        || async {
            let labels = gs_api.get("gs-new").await.ok()?.metadata.labels?;
            (labels.get("lastcall.dev/node").map(String::as_str) == Some(node)).then_some(())
        },
    )
    .await;
    if let Err(e) = claimed {
        panic!("{e}\nagent output:\n{}", agent.output());
    }
    agent.stop().await.expect("agent stops");
}

/// The uninstall hook (`--cleanup-cooperation`) patches game-server pods on every node. The
/// agents' own ServiceAccount cannot under the node restriction (refused on the other node),
/// so the chart gives the hook a ServiceAccount of its own: with its objects as the chart
/// renders them, the real binary, run from a pod on one node, cleans both nodes' pods.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_uninstall_hook_cleans_every_node_under_the_restriction() {
    let kbox = kube_box::lease().await;
    let admin = kbox.client().await.expect("admin client");
    agones::install_crd(&admin, Crd::SelectableNodeName)
        .await
        .expect("GameServer CRD");
    install_chart(&kbox);
    let ns = "box-admission-cleanup";
    namespace(&admin, ns).await;
    let (c1, c2) = ("adm-c1", "adm-c2");
    let agones = Agones::new(&admin, ns);
    let pods: Api<Pod> = Api::namespaced(admin.clone(), ns);
    for (n, gs) in [(c1, "gs-c1"), (c2, "gs-c2")] {
        create_node(&admin, n).await.expect("kwok node");
        agones.ready_server(gs, n).await.expect("a server");
    }
    let mark = || async {
        for gs in ["gs-c1", "gs-c2"] {
            pods.patch(
                gs,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"annotations": {
                    "karpenter.sh/do-not-disrupt": "true",
                    "lastcall.dev/managed-annotations": "karpenter.sh/do-not-disrupt"}}})),
            )
            .await
            .expect("lastcall's cooperation keys");
        }
    };
    let marked = |gs: &'static str| {
        let pods = pods.clone();
        async move {
            pods.get(gs)
                .await
                .unwrap()
                .metadata
                .annotations
                .unwrap_or_default()
                .contains_key("lastcall.dev/managed-annotations")
        }
    };
    // The hook's objects as the chart renders them at uninstall.
    let chart = repo().join("charts/lastcall");
    let rendered = helm(&[
        "template",
        "box",
        &chart.to_string_lossy(),
        "-n",
        NAMESPACE,
        "--set",
        "fullnameOverride=lastcall",
        "--set",
        "image.registry=registry.invalid/lastcall",
        "--set",
        "agent.autoscalerCooperation=in-use",
        "--show-only",
        "templates/cooperation-cleanup.yaml",
    ])
    .expect("helm template");
    let docs: Vec<Value> = serde_saphyr::from_multiple(&rendered).expect("YAML");
    let mut hook_sa = String::new();
    let mut job_args: Vec<String> = Vec::new();
    for d in docs.iter().filter(|d| !d.is_null()) {
        let kind = d["kind"].as_str().unwrap();
        let (group, version, plural) = match kind {
            "ServiceAccount" => ("", "v1", "serviceaccounts"),
            "ClusterRole" => ("rbac.authorization.k8s.io", "v1", "clusterroles"),
            "ClusterRoleBinding" => ("rbac.authorization.k8s.io", "v1", "clusterrolebindings"),
            "Job" => {
                let c = &d["spec"]["template"]["spec"];
                hook_sa = c["serviceAccountName"].as_str().unwrap().to_string();
                job_args = c["containers"][0]["args"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|a| a.as_str().unwrap().to_string())
                    .collect();
                continue;
            }
            other => panic!("unexpected {other} in the hook"),
        };
        let ar = ApiResource {
            group: group.into(),
            version: version.into(),
            api_version: d["apiVersion"].as_str().unwrap().into(),
            kind: kind.into(),
            plural: plural.into(),
        };
        let obj: DynamicObject = serde_json::from_value(d.clone()).unwrap();
        let api: Api<DynamicObject> = match kind {
            "ServiceAccount" => Api::namespaced_with(admin.clone(), NAMESPACE, &ar),
            _ => Api::all_with(admin.clone(), &ar),
        };
        api.create(&PostParams::default(), &obj)
            .await
            .unwrap_or_else(|e| panic!("{kind}: {e}"));
    }
    assert!(
        job_args.iter().any(|a| a == "--cleanup-cooperation"),
        "{job_args:?}"
    );
    assert_ne!(hook_sa, SERVICE_ACCOUNT);

    let bin = tokio::task::spawn_blocking(|| {
        lastcall_testkit::bins::try_workspace_binary("lastcall-agent", "lastcall-agent")
    })
    .await
    .unwrap()
    .expect("lastcall-agent");
    let run = |token: String| {
        let bin = bin.clone();
        let args = job_args.clone();
        let kubeconfig = kbox.kubeconfig(&token, "hook");
        async move {
            let dir = tempfile::tempdir().unwrap();
            std::fs::write(dir.path().join("kubeconfig"), kubeconfig).unwrap();
            let out = tokio::process::Command::new(bin)
                .args(&args)
                .env_clear()
                .env("HOME", dir.path())
                .env("KUBECONFIG", dir.path().join("kubeconfig"))
                .env("NODE_NAME", c1)
                .output()
                .await
                .unwrap();
            (
                out.status.success(),
                format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ),
            )
        }
    };

    // The agents' ServiceAccount from a pod on c1: c2's pod is refused by the policy.
    mark().await;
    let as_agent = agent_pod(&admin, "cleanup-as-agent", c1).await;
    let (ok, out) = run(token(&admin, Some(&as_agent)).await).await;
    assert!(!ok, "the agents' ServiceAccount cleaned every node:\n{out}");
    assert!(
        marked("gs-c2").await,
        "c2's pod was cleaned by c1's agent:\n{out}"
    );
    assert!(
        out.contains("lastcall node restriction"),
        "refused for another reason:\n{out}"
    );

    // The hook's own ServiceAccount, from a pod on c1: both nodes cleaned.
    mark().await;
    let as_hook = pod_of(&admin, &hook_sa, "cleanup-as-hook", c1).await;
    let (ok, out) = run(token_of(&admin, &hook_sa, Some(&as_hook)).await).await;
    assert!(ok, "the uninstall hook failed:\n{out}");
    for gs in ["gs-c1", "gs-c2"] {
        assert!(
            !marked(gs).await,
            "{gs} still carries lastcall's keys:\n{out}"
        );
    }
}
