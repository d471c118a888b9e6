//! The chart's node restriction on a real API server: the chart is installed onto the box by
//! the real `helm` (its `auto` switch reads the API server's discovery), and the agent's
//! ServiceAccount, with a token bound to a pod on one node as the kubelet's projected token
//! is, writes that node's Node, Pods and GameServers and evicts its pods, while the same
//! writes against another node's objects are refused by the chart's ValidatingAdmissionPolicy
//! (named in the refusal) and change nothing. A token bound to no pod writes nothing. The
//! real agent's drain still completes under the policy.

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::authentication::v1::{SelfSubjectReview, TokenRequest};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ServiceAccount};
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, EvictParams, Patch, PatchParams, PostParams,
};
use lastcall_testkit::eventually::{try_eventually, wait_for};
use lastcall_testkit::kube_box::agent::{AgentProcess, Extra, NAMESPACE, SERVICE_ACCOUNT};
use lastcall_testkit::kube_box::agones::{self, Agones, Allocation, Crd};
use lastcall_testkit::kube_box::{self, KubeBox, create_node};
use serde_json::{Value, json};

const NODE_POLICY: &str = "lastcall-agent-node-scope";
const EVICTION_POLICY: &str = "lastcall-agent-eviction-scope";
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
    let chart = repo().join("charts/lastcall");
    let kubeconfig = kbox.dir().join("admin.kubeconfig");
    helm(&[
        "upgrade",
        "--install",
        "box",
        &chart.to_string_lossy(),
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
        &kubeconfig.to_string_lossy(),
    ])
    .expect("helm install onto the box")
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
    let Err((code, message)) = got else {
        panic!("{what}: admitted, but the node restriction must refuse it");
    };
    assert_eq!(*code, 403, "{what}: {message}");
    assert!(
        message.contains(&format!("ValidatingAdmissionPolicy '{policy}'"))
            && message.contains("lastcall node restriction")
            && message.contains(&format!("\"{node}\"")),
        "{what}: refused, but not by {policy} for node {node}: {message}"
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

fn has_probe(v: &Value) -> bool {
    v.pointer(&format!(
        "/metadata/annotations/{}",
        PROBE.replace('/', "~1")
    ))
    .is_some()
}

/// The writes the agent makes (its Node, a game-server pod and its GameServer, an
/// eviction), against one node's objects.
struct Writes {
    nodes: Api<Node>,
    pods: Api<Pod>,
    gs: Api<DynamicObject>,
}

impl Writes {
    fn new(client: &kube::Client, ns: &str) -> Writes {
        Writes {
            nodes: Api::all(client.clone()),
            pods: Api::namespaced(client.clone(), ns),
            gs: Api::namespaced_with(client.clone(), ns, &agones::gameservers_resource()),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_token_writes_only_its_own_nodes_objects() {
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
        notes.contains("Each agent may write only its own node's"),
        "the install's notes do not say the node restriction is on:\n{notes}"
    );
    // The `auto` switch found ValidatingAdmissionPolicy v1 in the API server's discovery.
    let policies: Api<DynamicObject> = Api::all_with(
        admin.clone(),
        &vap_resource("ValidatingAdmissionPolicy", "validatingadmissionpolicies"),
    );
    for name in [NODE_POLICY, EVICTION_POLICY] {
        policies
            .get(name)
            .await
            .unwrap_or_else(|e| panic!("helm install made no policy {name}: {e}"));
        // The API server type-checked every expression against the kinds it matches.
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
        Api::<DynamicObject>::all_with(
            admin.clone(),
            &vap_resource(
                "ValidatingAdmissionPolicyBinding",
                "validatingadmissionpolicybindings",
            ),
        )
        .get(name)
        .await
        .unwrap_or_else(|e| panic!("helm install made no binding {name}: {e}"));
    }

    // Game servers on both nodes; none selected by a PDB, so only the policy can refuse an
    // eviction.
    let agones = Agones::new(&admin, ns);
    let on_a = agones.ready_server("gs-a", a).await.expect("gs-a");
    let evictable_a = agones
        .ready_server_evictable("gs-a-evict", a, "Always")
        .await
        .expect("gs-a-evict");
    let deletable_a = agones.ready_server("gs-a-del", a).await.expect("gs-a-del");
    let on_b = agones.ready_server("gs-b", b).await.expect("gs-b");

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

    // Node B's objects: every write refused by the policy, naming node B.
    let pp = PatchParams::default();
    assert_refused_by(
        "patch Node B",
        &outcome(w.nodes.patch(b, &pp, &merge_annotation()).await),
        NODE_POLICY,
        b,
    );
    assert_refused_by(
        "patch pod gs-b",
        &outcome(w.pods.patch("gs-b", &pp, &merge_annotation()).await),
        NODE_POLICY,
        b,
    );
    assert_refused_by(
        "patch GameServer gs-b",
        &outcome(w.gs.patch("gs-b", &pp, &merge_annotation()).await),
        NODE_POLICY,
        b,
    );
    assert_refused_by(
        "evict pod gs-b",
        &outcome(w.pods.evict("gs-b", &EvictParams::default()).await),
        EVICTION_POLICY,
        b,
    );
    assert_refused_by(
        "delete pod gs-b",
        &outcome(w.pods.delete("gs-b", &DeleteParams::default()).await),
        NODE_POLICY,
        b,
    );
    assert_refused_by(
        "delete GameServer gs-b",
        &outcome(w.gs.delete("gs-b", &DeleteParams::default()).await),
        NODE_POLICY,
        b,
    );
    // ...and nothing of node B changed.
    let admin_w = Writes::new(&admin, ns);
    let node_b = serde_json::to_value(admin_w.nodes.get(b).await.unwrap()).unwrap();
    assert!(!has_probe(&node_b), "Node B was written");
    let pod_b = admin_w.pods.get("gs-b").await.expect("pod gs-b survives");
    assert!(
        pod_b.metadata.deletion_timestamp.is_none()
            && !has_probe(&serde_json::to_value(&pod_b).unwrap()),
        "pod gs-b was written: {:?}",
        pod_b.metadata
    );
    let gs_b = admin_w.gs.get("gs-b").await.expect("gs-b survives");
    assert_eq!(gs_b.metadata.uid.as_deref(), Some(on_b.uid.as_str()));
    assert!(
        !has_probe(&serde_json::to_value(&gs_b).unwrap()),
        "gs-b was written"
    );

    // Node A's objects: the same writes admitted.
    assert_admitted(
        "patch Node A",
        &outcome(w.nodes.patch(a, &pp, &merge_annotation()).await),
    );
    assert_admitted(
        "patch pod gs-a",
        &outcome(w.pods.patch(&on_a.name, &pp, &merge_annotation()).await),
    );
    assert_admitted(
        "patch GameServer gs-a",
        &outcome(w.gs.patch(&on_a.name, &pp, &merge_annotation()).await),
    );
    assert_admitted(
        "evict pod gs-a-evict",
        &outcome(
            w.pods
                .evict(&evictable_a.name, &EvictParams::default())
                .await,
        ),
    );
    assert_admitted(
        "delete pod gs-a",
        &outcome(w.pods.delete(&on_a.name, &DeleteParams::default()).await),
    );
    assert_admitted(
        "delete GameServer gs-a-del",
        &outcome(
            w.gs.delete(&deletable_a.name, &DeleteParams::default())
                .await,
        ),
    );
    let node_a = serde_json::to_value(admin_w.nodes.get(a).await.unwrap()).unwrap();
    assert!(has_probe(&node_a), "the write to Node A did not land");
    // Agones' finalizer holds a deleted server until its pod is gone: deleted means gone
    // or terminating.
    assert!(
        admin_w
            .gs
            .get_opt(&deletable_a.name)
            .await
            .unwrap()
            .is_none_or(|g| g.metadata.deletion_timestamp.is_some()),
        "gs-a-del not deleted"
    );

    // A GameServer on node A cannot be moved to node B by the agent either.
    assert_refused_by(
        "move GameServer gs-a to node B",
        &outcome(
            w.gs.patch(
                &on_a.name,
                &pp,
                &Patch::Merge(json!({"status": {"nodeName": b}})),
            )
            .await,
        ),
        NODE_POLICY,
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
            .patch(a, &pp, &merge_annotation())
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

/// `auto` follows what helm knows of the API server: a live discovery with the kind (or
/// without it), or offline the target Kubernetes version.
#[test]
fn auto_renders_the_policies_only_where_the_api_server_serves_them() {
    let chart = repo().join("charts/lastcall");
    let chart = chart.to_string_lossy();
    let render = |extra: &[&str]| -> String {
        let mut args = vec![
            "template",
            "lastcall",
            &chart,
            "--set",
            "image.registry=registry.invalid/lastcall",
        ];
        args.extend_from_slice(extra);
        helm(&args).expect("helm template")
    };
    let has = |t: &str| t.contains("kind: ValidatingAdmissionPolicy\n");
    assert!(has(&render(&["--kube-version", "1.30.0"])), "offline 1.30");
    assert!(!has(&render(&["--kube-version", "1.29.9"])), "offline 1.29");
    // A live discovery lists kinds: without the policy kind (a 1.29 API server), none.
    assert!(!has(&render(&["--api-versions", "v1/Pod"])), "live, no VAP");
    assert!(has(&render(&[
        "--kube-version",
        "1.29.9",
        "--api-versions",
        "v1/Pod",
        "--api-versions",
        "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy",
    ])));
    assert!(!has(&render(&[
        "--set",
        "agent.nodeRestriction.enabled=false"
    ])));
    assert!(has(&render(&[
        "--kube-version",
        "1.29.9",
        "--set",
        "agent.nodeRestriction.enabled=true"
    ])));
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
