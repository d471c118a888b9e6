//! Every documented command, as written, by bash, onto the box: each shell block of the
//! install pages (`kube_box::install::PAGES`) runs through a real `bash` with the box's real
//! `helm` and `kubectl` (server-side validation, real RBAC, the CRDs the pages name: the
//! GameServer stand-in, Karpenter's NodePool and the Prometheus operator's monitors from
//! their own modules) and stand-ins only for `aws`, `eksctl`, `gcloud` and `az`. After each
//! install the workloads it created must be scheduled and ready on kwok's nodes (a
//! PodSecurity refusal leaves a DaemonSet unready). Then the agent is started from the
//! DaemonSet the install created (read back from the API server) and a drain completes
//! while the operations runbook is run against it.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use lastcall_testkit::agent::{metric, metric_sum};
use lastcall_testkit::eventually::try_eventually;
use lastcall_testkit::kube_box::agent::AgentProcess;
use lastcall_testkit::kube_box::agones::{self, Agones, Allocation, Crd, Deletions, Server};
use lastcall_testkit::kube_box::audit::describe;
use lastcall_testkit::kube_box::install::{self, Block, Mark, Shell};
use lastcall_testkit::kube_box::{self, EXEC_REDIS_PASSWORD, KubeBox, create_node};
use lastcall_testkit::redis::RedisServer;
use serde_json::{Value, json};

/// The node the pages name (`docs/operations.md` sets `NODE` to it): a game-server node.
const GAME_NODE: &str = "ip-10-0-1-23.us-west-2.compute.internal";
/// A node without the game-server label, for pubsub and Redis (kept off game-server nodes).
const SYSTEM_NODE: &str = "ip-10-0-2-45.us-west-2.compute.internal";
const NS: &str = "lastcall";

/// What the pages ask the reader to have set.
const VARS: &[(&str, &str)] = &[
    (
        "REGISTRY",
        "123456789012.dkr.ecr.us-west-2.amazonaws.com/lastcall",
    ),
    ("ACCOUNT", "123456789012"),
    ("CLUSTER", "games"),
    ("NODE", GAME_NODE),
    ("PASSWORD", "box-password"),
    ("AGENT_PASSWORD", "box-agent-password"),
    ("NODE_RESOURCE_GROUP", "MC_games_games_westeurope"),
    ("SCALE_SET", "aks-gameservers-12345678-vmss"),
    ("NODE_ROLE_ARN", "arn:aws:iam::123456789012:role/games-node"),
    ("GS_NAMESPACE", GAMES_NS),
    ("GS_NAME", MATCH),
];

/// The runbook's game servers: one match and one idle server on the game node.
const GAMES_NS: &str = "games";
const MATCH: &str = "match-0";
const IDLE: &str = "idle-0";
const OPERATIONS: &str = "docs/operations.md";
/// The bundled Redis's Service as the chart names it; on the box it is the test's Redis.
const REDIS_SERVICE: &str = "lastcall-redis.lastcall.svc:6379";

/// The cluster as a reader starts a path: no lastcall release, namespace or cluster-wide
/// object of an earlier path.
async fn reset(shell: &Shell) {
    shell
        .sh(&format!(
            "for r in $(helm -n {NS} list -aq); do helm -n {NS} uninstall \"$r\" --wait; done\n\
             kubectl delete namespace {NS} --ignore-not-found --wait=true --timeout=120s\n\
             kubectl delete clusterrole,clusterrolebinding,priorityclass,validatingadmissionpolicy,validatingadmissionpolicybinding -l app.kubernetes.io/part-of=lastcall --ignore-not-found\n"
        ))
        .await
        .unwrap_or_else(|e| panic!("removing the previous install: {e:#}"));
}

/// Every DaemonSet and Deployment in the namespace has all its pods scheduled and ready.
async fn workloads_ready(client: &kube::Client, after: &Block) {
    let ds: Api<DaemonSet> = Api::namespaced(client.clone(), NS);
    let deps: Api<Deployment> = Api::namespaced(client.clone(), NS);
    let got = try_eventually(
        "every DaemonSet and Deployment of the install ready",
        Duration::from_secs(90),
        Duration::from_millis(250),
        || async {
            let mut seen = BTreeMap::new();
            for d in ds.list(&ListParams::default()).await.ok()?.items {
                let st = d.status?;
                let ok = d.metadata.generation == st.observed_generation
                    && st.number_ready == st.desired_number_scheduled
                    && st.updated_number_scheduled.unwrap_or(0) == st.desired_number_scheduled;
                if !ok {
                    return None;
                }
                seen.insert(
                    format!("daemonset/{}", d.metadata.name?),
                    st.desired_number_scheduled,
                );
            }
            for d in deps.list(&ListParams::default()).await.ok()?.items {
                let want = d.spec?.replicas.unwrap_or(1);
                let st = d.status?;
                let ok = d.metadata.generation == st.observed_generation
                    && st.ready_replicas.unwrap_or(0) == want
                    && st.updated_replicas.unwrap_or(0) == want;
                if !ok {
                    return None;
                }
                seen.insert(format!("deployment/{}", d.metadata.name?), want);
            }
            Some(seen)
        },
    )
    .await;
    match got {
        Ok(seen) => eprintln!("  ready after {}: {seen:?}", after.place()),
        Err(e) => {
            let events = kube_box::install::events(client, NS).await;
            let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), NS);
            let pods: Vec<String> = pods
                .list(&ListParams::default())
                .await
                .map(|l| {
                    l.items
                        .into_iter()
                        .map(|p| {
                            format!(
                                "pod {:?} labels {:?} deleting {:?} phase {:?}",
                                p.metadata.name,
                                p.metadata.labels,
                                p.metadata.deletion_timestamp,
                                p.status.and_then(|s| s.phase)
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            eprintln!("{}", pods.join("\n"));
            let status: Vec<String> = ds
                .list(&ListParams::default())
                .await
                .map(|l| {
                    l.items
                        .into_iter()
                        .map(|d| format!("{:?}: {:?}", d.metadata.name, d.status))
                        .collect()
                })
                .unwrap_or_default();
            panic!(
                "{} installed workloads that never got ready: {e}\n{}\n{events}",
                after.place(),
                status.join("\n")
            )
        }
    }
}

fn installs(b: &Block) -> bool {
    b.body.lines().map(str::trim).any(|l| {
        l.starts_with("helm install")
            || l.starts_with("helm upgrade")
            || l.starts_with("helm rollback")
            || (l.starts_with("kubectl apply") && !l.contains("--dry-run"))
    })
}

/// The "original adapter" a migration starts from: its daemon's DaemonSet and pubsub's
/// Deployment (what `docs/migration.md` patches and scales), pods on no node.
async fn original_adapter(client: &kube::Client) {
    let ds: DaemonSet = serde_json::from_value(json!({
        "metadata": {"name": "gamelift-daemonset", "namespace": "kube-system"},
        "spec": {
            "selector": {"matchLabels": {"app": "gamelift-daemonset"}},
            "template": {
                "metadata": {"labels": {"app": "gamelift-daemonset"}},
                "spec": {"nodeSelector": {"role": "game-servers"},
                         "containers": [{"name": "daemon", "image": "gamelift-daemon:1"}]},
            },
        },
    }))
    .unwrap();
    Api::<DaemonSet>::namespaced(client.clone(), "kube-system")
        .create(&PostParams::default(), &ds)
        .await
        .expect("the original daemon's DaemonSet");
    let dep: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "pubsubv2", "namespace": "default"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "pubsubv2"}},
            "template": {
                "metadata": {"labels": {"app": "pubsubv2"}},
                "spec": {"containers": [{"name": "pubsub", "image": "pubsub:2"}]},
            },
        },
    }))
    .unwrap();
    Api::<Deployment>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &dep)
        .await
        .expect("the original pubsub's Deployment");
}

async fn nodes(client: &kube::Client) {
    create_node(client, GAME_NODE).await.expect("game node");
    create_node(client, SYSTEM_NODE).await.expect("system node");
    let api: Api<Node> = Api::all(client.clone());
    // GKE's node pool label (docs/install.md §4 selects it); the system node is no game node.
    api.patch(
        GAME_NODE,
        &PatchParams::default(),
        &Patch::Merge(
            json!({"metadata": {"labels": {"cloud.google.com/gke-nodepool": "game-servers"}}}),
        ),
    )
    .await
    .expect("label the game node");
    api.patch(
        SYSTEM_NODE,
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"role": null}}})),
    )
    .await
    .expect("unlabel the system node");
}

/// Runs `block` as its mark says; an error says where and why.
async fn run(shell: &Shell, client: &kube::Client, all: &[Block], b: &Block) {
    match &b.mark {
        Mark::Skip(why) => {
            eprintln!("skip {} ({why})", b.place());
            return;
        }
        Mark::ServerDryRun => {
            eprintln!("dry-run {}", b.place());
            let file = shell.work().join("block.yaml");
            std::fs::write(&file, &b.body).unwrap();
            shell
                .sh(&format!(
                    "kubectl apply --dry-run=server -f {}",
                    file.display()
                ))
                .await
                .unwrap_or_else(|e| {
                    panic!("{}: the API server refuses the example: {e:#}", b.place())
                });
            return;
        }
        Mark::After(n) => {
            reset(shell).await;
            let base: Vec<&Block> = all
                .iter()
                .filter(|x| x.page == b.page && x.section_number() == Some(n.as_str()))
                .filter(|x| x.mark == Mark::Run)
                .collect();
            assert!(!base.is_empty(), "{}: no section {n} to run on", b.place());
            // A section may show alternative installs (each a fresh install of its own): the
            // block runs on the first, with the steps that follow it up to the next.
            let first_alone = base
                .iter()
                .skip(1)
                .position(|x| x.fresh_install())
                .map_or(base.len(), |i| i + 1);
            for x in &base[..first_alone] {
                eprintln!("run {} (the install {} runs on)", x.place(), b.place());
                shell.run(x).await.unwrap_or_else(|e| panic!("{e:#}"));
            }
        }
        Mark::Run => {
            if b.fresh_install() {
                reset(shell).await;
            }
        }
    }
    eprintln!("run {}", b.place());
    let ran = shell.run(b).await.unwrap_or_else(|e| panic!("{e:#}"));
    let out: Vec<&str> = ran.stdout.lines().take(4).collect();
    if !out.is_empty() {
        eprintln!("  stdout: {}", out.join("\n          "));
    }
    if !ran.stderr.trim().is_empty() {
        eprintln!(
            "  stderr: {}",
            ran.stderr.trim().replace('\n', "\n          ")
        );
    }
    if installs(b) {
        workloads_ready(client, b).await;
    }
}

async fn prepare(kbox: &KubeBox) -> (kube::Client, Shell) {
    let client = kbox.client().await.expect("admin client");
    agones::install_crd(&client, Crd::SelectableNodeName)
        .await
        .expect("GameServer CRD");
    install::install_crds(kbox, &client)
        .await
        .expect("Karpenter's and the Prometheus operator's CRDs");
    nodes(&client).await;
    original_adapter(&client).await;
    let shell = Shell::new(kbox, VARS).expect("a shell");
    (client, shell)
}

/// After §5 (two pubsub replicas, the chart's one PodDisruptionBudget over them), a node
/// drain can evict a pubsub pod: the Eviction API admits it (two budgets over one pod answer
/// 500 and stall every drain of that node).
async fn pubsub_evicts(client: &kube::Client) {
    use k8s_openapi::api::core::v1::Pod;
    use k8s_openapi::api::policy::v1::PodDisruptionBudget;
    let budgets = Api::<PodDisruptionBudget>::namespaced(client.clone(), NS)
        .list(&ListParams::default())
        .await
        .expect("the namespace's PodDisruptionBudgets");
    assert_eq!(
        budgets.items.len(),
        1,
        "one PodDisruptionBudget over pubsub after §5: {:?}",
        budgets
            .items
            .iter()
            .map(|b| b.metadata.name.clone())
            .collect::<Vec<_>>()
    );
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let lp = ListParams::default().labels("app.kubernetes.io/component=pubsub");
    // The disruption controller counts both pods healthy first.
    try_eventually(
        "the PodDisruptionBudget allows one disruption",
        Duration::from_secs(60),
        Duration::from_millis(250),
        || async {
            let b = Api::<PodDisruptionBudget>::namespaced(client.clone(), NS)
                .list(&ListParams::default())
                .await
                .ok()?;
            (b.items.first()?.status.as_ref()?.disruptions_allowed >= 1).then_some(())
        },
    )
    .await
    .expect("a disruption allowed");
    let victim = pods.list(&lp).await.expect("pubsub pods").items[0]
        .metadata
        .name
        .clone()
        .expect("a name");
    pods.evict(&victim, &Default::default())
        .await
        .unwrap_or_else(|e| panic!("evicting pubsub pod {victim} after §5: {e}"));
    eprintln!("  evicted pubsub pod {victim} under the chart's PodDisruptionBudget");
}

/// What the runbook runs against: the agent started from the installed DaemonSet, the Redis
/// playing the bundled one, and Agones' part.
struct Runbook {
    /// Stopped once the drain is done: the runbook's last section starts from "lastcall
    /// removed while a node was draining", and the kubectl commands after the drain need no
    /// agent (its log stays served as it was).
    agent: Option<AgentProcess>,
    _redis: RedisServer,
    agones: Agones,
    idle: Server,
    matched: Server,
    deletions: Deletions,
}

/// The install the runbook needs (`docs/install.md` §5: agents, pubsub and the bundled
/// Redis), then a second revision (so `helm rollback` has one to go back to), then the agent
/// from the DaemonSet, and one match and one idle server on its node.
async fn runbook(kbox: &KubeBox, shell: &Shell, client: &kube::Client, all: &[Block]) -> Runbook {
    reset(shell).await;
    let base: Vec<&Block> = all
        .iter()
        .filter(|b| b.page == "docs/install.md" && b.section_number() == Some("5"))
        .filter(|b| b.mark == Mark::Run)
        .collect();
    assert!(
        !base.is_empty(),
        "docs/install.md has no §5 to run the runbook on"
    );
    for b in &base {
        eprintln!("run {} (the install the runbook runs on)", b.place());
        shell.run(b).await.unwrap_or_else(|e| panic!("{e:#}"));
        if installs(b) {
            workloads_ready(client, b).await;
        }
    }
    shell
        .sh(&format!("helm upgrade lastcall charts/lastcall -n {NS} --reuse-values --set pubsub.replicas=2 --set pubsub.cycleJitter=6s"))
        .await
        .expect("a second revision");
    workloads_ready(client, base[base.len() - 1]).await;
    pubsub_evicts(client).await;

    // The bundled Redis's backend: a real redis-server with the users the installed Redis
    // Deployment's command writes (read back from the API server), each with its password
    // from the Secret, and pubsub's also with the box's exec password (for `kubectl exec`
    // into the Redis pod, which runs `redis-cli --user lastcall-pubsub`).
    let secret: k8s_openapi::api::core::v1::Secret = Api::namespaced(client.clone(), NS)
        .get("lastcall-redis-auth")
        .await
        .expect("the Redis password Secret the page created");
    let data = secret.data.unwrap_or_default();
    let key = |k: &str| {
        String::from_utf8(
            data.get(k)
                .unwrap_or_else(|| panic!("the Secret has no {k}"))
                .0
                .clone(),
        )
        .unwrap()
    };
    let (password, agent_password) = (key("password"), key("agent-password"));
    let deployment: Deployment = Api::namespaced(client.clone(), NS)
        .get("lastcall-redis")
        .await
        .expect("the bundled Redis' Deployment");
    let script = deployment
        .spec
        .and_then(|s| s.template.spec)
        .map(|s| s.containers[0].args.clone().unwrap_or_default().join(" "))
        .unwrap_or_default();
    let format = script
        .split_once("printf '")
        .and_then(|(_, rest)| rest.split_once('\''))
        .map(|(f, _)| f.replace("%%", "\u{0}").replace("\\n", "\n"))
        .expect("the Redis command writes its users with printf");
    let redis = RedisServer::start().await.expect("redis-server");
    let mut conn = redis.client().await.expect("redis client");
    let mut secrets = vec![
        vec![password.clone(), EXEC_REDIS_PASSWORD.to_string()],
        vec![agent_password],
    ]
    .into_iter();
    // The default user's `off` last: this connection is the default user's.
    let mut lines: Vec<&str> = format.lines().filter(|l| l.starts_with("user ")).collect();
    lines.sort_by_key(|l| l.starts_with("user default "));
    for line in lines {
        let mut words = line.split_whitespace().skip(1);
        let user = words.next().unwrap().to_string();
        let mut setuser = redis::cmd("ACL");
        setuser.arg("SETUSER").arg(&user);
        for w in words {
            if w == ">%s" {
                for pw in secrets.next().expect("a password for each %s") {
                    setuser.arg(format!(">{pw}"));
                }
            } else {
                setuser.arg(w.replace('\u{0}', "%"));
            }
        }
        let _: () = setuser
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("the chart's Redis user {user}: {e}"));
    }
    assert_eq!(
        secrets.next(),
        None,
        "the chart's Redis command sets both passwords"
    );
    let cli = kbox.redis_exec_dir().join("bin/redis-cli");
    std::fs::write(
        &cli,
        format!(
            "#!/bin/sh\nexec /usr/bin/redis-cli -p {} \"$@\"\n",
            redis.port()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&cli, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();

    // The agent, as the DaemonSet the install created runs it.
    let mut got = install::installed_agent(client, NS, "lastcall-agent", "agent", GAME_NODE)
        .await
        .expect("the installed agent");
    eprintln!(
        "installed agent pod {:?}: args {:?}",
        got.pod.metadata.name, got.args
    );
    for a in &mut got.args {
        if a.starts_with("--listen=") {
            *a = "--listen=127.0.0.1:0".into();
        }
    }
    // On the host network the chart serves /metrics on a listener of its own, answered only
    // to a token the API server authorizes (proven by `box_metrics_auth.rs`); here the test
    // reads the drain's phase from /metrics beside the probes on loopback.
    got.args
        .retain(|a| !a.starts_with("--metrics-listen=") && !a.starts_with("--metrics-auth="));
    let mut rewired = false;
    for (k, v) in &mut got.env {
        if k == "REDIS_URL" && v.contains(REDIS_SERVICE) {
            *v = v.replace(REDIS_SERVICE, &format!("127.0.0.1:{}", redis.port()));
            rewired = true;
        }
    }
    assert!(
        rewired,
        "the installed agent does not name {REDIS_SERVICE}: {:?}",
        got.env
    );
    let agent = AgentProcess::spawn(kbox, &kbox.server(), got.pod, &got.token, got.args, got.env)
        .await
        .expect("the agent process");
    agent
        .ready()
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", agent.output()));

    let games: k8s_openapi::api::core::v1::Namespace =
        serde_json::from_value(json!({"metadata": {"name": GAMES_NS}})).unwrap();
    let _ = Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
        .create(&PostParams::default(), &games)
        .await;
    agones::ensure_pdb(client, GAMES_NS)
        .await
        .expect("Agones PDB");
    let agones = Agones::new(client, GAMES_NS);
    let deletions = Deletions::watch(client, GAMES_NS)
        .await
        .expect("a GameServer watch");
    let idle = agones
        .ready_server(IDLE, GAME_NODE)
        .await
        .expect("idle server");
    let matched = agones
        .ready_server(MATCH, GAME_NODE)
        .await
        .expect("match server");
    let a = agones.allocate(MATCH).await.expect("allocate");
    assert!(matches!(a, Allocation::Allocated(_)), "{a:?}");
    try_eventually(
        "the agent sees both servers",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async {
            let seen = metric_sum(&agent.metrics().await, "lastcall_game_servers", &[]);
            (seen as usize == 2).then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.output()));
    Runbook {
        agent: Some(agent),
        _redis: redis,
        agones,
        idle,
        matched,
        deletions,
    }
}

impl Runbook {
    fn output(&self) -> String {
        self.agent
            .as_ref()
            .map(AgentProcess::output)
            .unwrap_or_default()
    }

    /// What the agent printed so far, as its container's log (CRI format) for `kubectl logs`.
    fn publish_logs(&self, kbox: &KubeBox) {
        let Some(agent) = &self.agent else { return };
        let now = jiff::Timestamp::now();
        let text: String = agent
            .output()
            .lines()
            .map(|l| format!("{now} stdout F {l}\n"))
            .collect();
        std::fs::write(kbox.pod_log("agent"), text).expect("the agent's pod log");
    }

    /// After the drain label: the node fenced, the idle server released, the match protected;
    /// by the API server's order (resourceVersions), the agent's fence came before the idle
    /// server's deletion, and the agent deleted no match.
    async fn drain_started(&self, kbox: &KubeBox, client: &kube::Client) {
        let nodes: Api<Node> = Api::all(client.clone());
        let r = try_eventually(
            "fenced, idle released, match protected",
            Duration::from_secs(40),
            Duration::from_millis(200),
            || async {
                let n = serde_json::to_value(nodes.get(GAME_NODE).await.ok()?).ok()?;
                let cordoned = n.pointer("/spec/unschedulable") == Some(&Value::Bool(true));
                let tainted = n
                    .pointer("/spec/taints")?
                    .as_array()?
                    .iter()
                    .any(|t| t["key"] == "lastcall.dev/draining");
                let released = self.agones.get(&self.idle.name).await.ok()?.is_none();
                let m = self.agones.get(&self.matched.name).await.ok()??;
                let protected = m
                    .metadata
                    .annotations
                    .as_ref()?
                    .contains_key("lastcall.dev/drain-deadline");
                (cordoned && tainted && released && protected).then_some(())
            },
        )
        .await;
        if let Err(e) = r {
            panic!("{e}\n--- agent ---\n{}", self.output());
        }
        let fenced = |v: &Value| {
            v.pointer("/spec/unschedulable") == Some(&Value::Bool(true))
                && v.pointer("/spec/taints")
                    .and_then(Value::as_array)
                    .is_some_and(|t| t.iter().any(|t| t["key"] == "lastcall.dev/draining"))
        };
        let journal = kbox.audit();
        let fence = journal
            .iter()
            .filter(|e| e.by_agent() && e.ok() && e.resource == "nodes" && e.name == GAME_NODE)
            .find(|e| e.is_write() && fenced(&e.response))
            .unwrap_or_else(|| {
                panic!("no accepted fence of {GAME_NODE} by the agent in the audit log")
            });
        let fence_rv = fence
            .rv()
            .unwrap_or_else(|| panic!("no resourceVersion in {}", describe(fence)));
        let deleted = try_eventually(
            "the idle server's DELETED event",
            Duration::from_secs(10),
            Duration::from_millis(100),
            || async { self.deletions.of(&self.idle.name) },
        )
        .await
        .expect("the idle server's deletion, watched");
        assert!(
            fence_rv < deleted,
            "the idle server went (rv {deleted}) before the agent's fence (rv {fence_rv}): {}",
            describe(fence)
        );
        let killed: Vec<String> = journal
            .iter()
            .filter(|e| e.by_agent() && e.verb == "delete" && e.name == self.matched.name)
            .map(describe)
            .collect();
        assert!(killed.is_empty(), "the agent deleted the match: {killed:?}");
    }

    /// After the match is gone: the agent reports the node empty.
    async fn drain_done(&self) {
        let r = try_eventually(
            "the drain completes (phase empty)",
            Duration::from_secs(40),
            Duration::from_millis(200),
            || async {
                let text = self.agent.as_ref()?.metrics().await;
                (metric(&text, "lastcall_drain_phase", &[("phase", "empty")])? == 1.0).then_some(())
            },
        )
        .await;
        if let Err(e) = r {
            panic!("{e}\n--- agent ---\n{}", self.output());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_documented_command_runs_as_written_and_a_drain_completes() {
    let kbox = kube_box::lease().await;
    let (client, shell) = prepare(&kbox).await;
    let all = install::all_blocks().expect("the pages' blocks");
    let mut book: Option<Runbook> = None;
    let (mut started, mut done) = (false, false);
    for b in &all {
        if b.page == OPERATIONS && book.is_none() {
            book = Some(runbook(&kbox, &shell, &client, &all).await);
        }
        if let Some(r) = &book {
            r.publish_logs(&kbox);
        }
        run(&shell, &client, &all, b).await;
        if let Some(r) = &book {
            if b.body
                .contains("kubectl label node \"$NODE\" lastcall.dev/drain=true")
            {
                r.drain_started(&kbox, &client).await;
                started = true;
            }
            // The runbook's step that ends the match (a later page's deletion of an idle
            // server, to make room for an agent, ends no drain).
            if !done && b.body.contains("kubectl delete gameserver") {
                assert!(
                    started,
                    "{}: the match is deleted before any drain",
                    b.place()
                );
                r.drain_done().await;
                done = true;
            }
        }
        if done
            && let Some(r) = &mut book
            && r.agent.is_some()
        {
            r.publish_logs(&kbox);
            if let Some(agent) = r.agent.take() {
                let status = agent.stop().await.expect("the agent stops on SIGTERM");
                eprintln!("  the agent exited ({status}) after the drain");
            }
        }
    }
    assert!(
        started && done,
        "the runbook never drained the node (label) and ended its match"
    );
    let calls = shell.cli_calls();
    eprintln!("stand-in calls: {calls:?}");
    for cli in ["aws", "eksctl", "az"] {
        assert!(
            calls.iter().any(|c| c[0] == cli),
            "the pages call {cli}, the stand-in saw no call: {calls:?}"
        );
    }
}
