//! What the node restriction's pod policy costs a match's end on the API server: the chart's
//! `-agent-pod-scope` policy judges the agent's pod DELETE (preconditioned on the pod's uid)
//! on the stored pod alone, with no params, so its cost should not grow with the pods of the
//! namespace. Its memory (resident set and Go heap in use) with many kwok pods, without the
//! policy and then with it, in one run on one box, and a DELETE's latency without and with it.
//! (lastcall used to end matches with Evictions, judged by an `-agent-eviction-scope` policy
//! that took every pod of the namespace as its params: `docs/scale.md` has what that cost.)
//!
//! Run: `cargo bench -p lastcall-testkit --bench box_policy_memory --profile dev`.
//! `LASTCALL_POLICY_BENCH_PODS` (default 60000) pods in one namespace, spread over
//! `LASTCALL_POLICY_BENCH_NODES` (default 100) kwok nodes that run them;
//! `LASTCALL_POLICY_BENCH_DELETES` (default 5) DELETEs timed each way.
//!
//! 1. The box (real kube-apiserver v1.35, etcd, controller-manager, scheduler, kwok), the
//!    chart's agent RBAC and nothing of its policies; the pods created with the shape of an
//!    Agones game-server pod (its labels and annotations, a controller reference, a game
//!    container and the SDK sidecar), bound to the kwok nodes, and run by kwok.
//! 2. Settled (every pod Running, then 30 s), the API server's resident set (`VmRSS` of its
//!    process) and Go heap in use (`go_memstats_heap_inuse_bytes` of its `/metrics`), five
//!    samples 5 s apart; then the same again after another 30 s, to show the drift without
//!    any change. Server-side dry-run DELETEs (uid-preconditioned, as the agent sends them) by
//!    the agent's pod-bound token of game-server pods on its node, timed.
//! 3. The chart's pod policy and binding as `manifests/lastcall.yaml` renders them; the
//!    policy is in force once a DELETE of a pod on another node is refused. Settled again,
//!    the same samples and DELETEs.
//!
//! The bench fails (non-zero exit) if the pods do not all run, the policy never refuses, or
//! a dry-run DELETE on the agent's own node fails without the policy; one that fails under
//! it is reported with its error.

#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use kube::Api;
use kube::api::{ApiResource, DeleteParams, DynamicObject, ListParams, PostParams, Preconditions};
use lastcall_testkit::eventually::try_eventually;
use lastcall_testkit::kube_box::agent::{self as box_agent};
use lastcall_testkit::kube_box::agones::{self, Agones, Crd};
use lastcall_testkit::kube_box::{KubeBox, create_node};
use serde_json::json;

const NS: &str = "games";
const PODS_ENV: &str = "LASTCALL_POLICY_BENCH_PODS";
const NODES_ENV: &str = "LASTCALL_POLICY_BENCH_NODES";
const POLICY: &str = "lastcall-agent-pod-scope";
const DELETES_ENV: &str = "LASTCALL_POLICY_BENCH_DELETES";
const SAMPLES: usize = 5;

fn env_count(name: &str, default: usize) -> anyhow::Result<usize> {
    match std::env::var(name) {
        Err(_) => Ok(default),
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => bail!("{name}={v:?}: want a whole number above 0"),
        },
    }
}

fn main() -> anyhow::Result<()> {
    let pods = env_count(PODS_ENV, 60_000)?;
    let nodes = env_count(NODES_ENV, 100)?;
    let deletes = env_count(DELETES_ENV, 5)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(bench(pods, nodes, deletes))
}

/// The pid of the box's kube-apiserver: the process whose command line names the box's own
/// certificate directory.
fn apiserver_pid(kbox: &KubeBox) -> anyhow::Result<u32> {
    let certs = format!(
        "--cert-dir={}",
        kbox.dir().join("apiserver-certs").display()
    );
    for entry in std::fs::read_dir("/proc")? {
        let entry = entry?;
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmd
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if args.first().is_some_and(|a| a.ends_with("kube-apiserver")) && args.contains(&certs) {
            return Ok(pid);
        }
    }
    bail!("no kube-apiserver with {certs}")
}

fn rss_bytes(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .context("no VmRSS")?;
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .context("VmRSS without a value")?
        .parse()?;
    Ok(kb * 1024)
}

async fn heap_inuse(client: &kube::Client) -> anyhow::Result<u64> {
    let req = hyper::Request::get("/metrics").body(Vec::new())?;
    let text = client
        .request_text(req)
        .await
        .context("the API server's /metrics")?;
    let line = text
        .lines()
        .find(|l| l.starts_with("go_memstats_heap_inuse_bytes "))
        .context("no go_memstats_heap_inuse_bytes")?;
    let v: f64 = line
        .split_whitespace()
        .nth(1)
        .context("no value")?
        .parse()?;
    Ok(v as u64)
}

/// Median resident set and heap in use over [`SAMPLES`] samples 5 s apart, after `settle`.
async fn memory(
    client: &kube::Client,
    pid: u32,
    settle: Duration,
) -> anyhow::Result<(u64, u64, u64, u64)> {
    tokio::time::sleep(settle).await;
    let (mut rss, mut heap) = (Vec::new(), Vec::new());
    for i in 0..SAMPLES {
        if i > 0 {
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
        rss.push(rss_bytes(pid)?);
        heap.push(heap_inuse(client).await?);
    }
    rss.sort_unstable();
    heap.sort_unstable();
    Ok((
        rss[SAMPLES / 2],
        rss[SAMPLES - 1] - rss[0],
        heap[SAMPLES / 2],
        heap[SAMPLES - 1] - heap[0],
    ))
}

/// A pod as Agones makes one for a GameServer (labels, annotations, a controller reference,
/// the game container and the SDK sidecar), bound to `node`. Every pod's controller is the one
/// GameServer `owner` (uid `uid`): one per pod would double the objects, and the garbage
/// collector deletes a pod whose owner does not exist.
fn game_pod(i: usize, node: &str, owner: &str, uid: &str) -> Pod {
    let name = format!("fleet-a-{i:06}");
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS,
            "labels": {"agones.dev/role": "gameserver", "agones.dev/gameserver": name,
                       "agones.dev/fleet": "fleet-a", "agones.dev/gameserverset": "fleet-a-x7k2p",
                       "agones.dev/safe-to-evict": "false"},
            "annotations": {"agones.dev/container": "gameserver", "agones.dev/sdk-version": "1.50.0",
                            "cluster-autoscaler.kubernetes.io/safe-to-evict": "false"},
            "ownerReferences": [{"apiVersion": "agones.dev/v1", "kind": "GameServer", "name": owner,
                                 "uid": uid, "controller": true, "blockOwnerDeletion": true}]},
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 30,
            "tolerations": [{"operator": "Exists"}],
            "containers": [
                {"name": "gameserver", "image": "registry.example.com/game:1.0.0",
                 "ports": [{"containerPort": 7654, "hostPort": 7000 + (i % 1000), "protocol": "UDP"}],
                 "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "1Gi"}},
                 "env": [{"name": "AGONES_SDK_GRPC_PORT", "value": "9357"},
                         {"name": "AGONES_SDK_HTTP_PORT", "value": "9358"}]},
                {"name": "agones-gameserver-sidecar", "image": "us-docker.pkg.dev/agones-images/release/agones-sdk:1.50.0",
                 "args": ["--grpc-port=9357", "--http-port=9358"],
                 "env": [{"name": "GAMESERVER_NAME", "value": name},
                         {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
                 "resources": {"requests": {"cpu": "30m"}}},
            ],
        },
    }))
    .expect("a pod")
}

/// Pods of `NS` not Running yet, by a paged list.
async fn not_running(pods: &Api<Pod>) -> anyhow::Result<usize> {
    let mut left = 0;
    let mut lp = ListParams::default()
        .fields("status.phase!=Running")
        .limit(5000);
    loop {
        let page = pods.list(&lp).await?;
        left += page.items.len();
        match page.metadata.continue_ {
            Some(c) if !c.is_empty() => lp = lp.continue_token(&c),
            _ => return Ok(left),
        }
    }
}

/// A server-side dry-run DELETE of pod `name` as the agent ends a match: preconditioned on
/// its uid, no grace override.
async fn dry_run_delete(agent: &Api<Pod>, name: &str) -> Result<(), kube::Error> {
    let uid = agent.get(name).await?.metadata.uid;
    let dp = DeleteParams {
        dry_run: true,
        preconditions: Some(Preconditions {
            uid,
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    agent.delete(name, &dp).await.map(|_| ())
}

/// `n` server-side dry-run DELETEs of pods on the agent's node, timed (the DELETE alone, not
/// the read of its uid): (p50, max, how many were refused or failed, the first failure).
async fn deletes(
    agent: &Api<Pod>,
    names: &[String],
    n: usize,
) -> (Duration, Duration, usize, Option<String>) {
    let mut took = Vec::new();
    let (mut failed, mut first) = (0, None);
    for name in names.iter().cycle().take(n) {
        let uid = match agent.get(name).await {
            Ok(p) => p.metadata.uid,
            Err(e) => {
                failed += 1;
                first.get_or_insert_with(|| format!("{name}: {e}"));
                continue;
            }
        };
        let dp = DeleteParams {
            dry_run: true,
            preconditions: Some(Preconditions {
                uid,
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        let t = Instant::now();
        let r = agent.delete(name, &dp).await;
        took.push(t.elapsed());
        if let Err(e) = r {
            failed += 1;
            first.get_or_insert_with(|| format!("{name}: {e}"));
        }
    }
    if took.is_empty() {
        return (Duration::ZERO, Duration::ZERO, failed, first);
    }
    took.sort_unstable();
    (took[took.len() / 2], took[took.len() - 1], failed, first)
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

async fn bench(pod_count: usize, node_count: usize, delete_count: usize) -> anyhow::Result<()> {
    let began = Instant::now();
    let kbox = KubeBox::start().await?;
    let client = kbox.client().await?;
    let pid = apiserver_pid(&kbox)?;
    println!(
        "\nbox_policy_memory: the box started in {:.1} s; kube-apiserver pid {pid}; {pod_count} pods on {node_count} kwok nodes",
        kbox.started_in().as_secs_f64()
    );
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NS}}))?;
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await?;
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), NS);
    try_eventually(
        "the namespace's default ServiceAccount",
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async { sas.get_opt("default").await.ok().flatten().map(|_| ()) },
    )
    .await?;
    let nodes: Vec<String> = (0..node_count)
        .map(|i| format!("bench-node-{i:03}"))
        .collect();
    futures::stream::iter(nodes.iter())
        .map(|n| create_node(&client, n))
        .buffer_unordered(8)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<anyhow::Result<Vec<()>>>()?;
    agones::install_crd(&client, Crd::SelectableNodeName).await?;
    let owner = Agones::new(&client, NS)
        .ready_server("fleet-owner", &nodes[0])
        .await?;
    let t = Instant::now();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let created = futures::stream::iter(0..pod_count)
        .map(|i| {
            let pods = pods.clone();
            let pod = game_pod(i, &nodes[i % node_count], &owner.name, &owner.uid);
            async move { pods.create(&PostParams::default(), &pod).await }
        })
        .buffer_unordered(32)
        .collect::<Vec<_>>()
        .await;
    if let Some(e) = created.into_iter().find_map(Result::err) {
        bail!("creating the pods: {e}");
    }
    println!(
        "  {pod_count} pods created in {:.0} s",
        t.elapsed().as_secs_f64()
    );
    try_eventually(
        "every pod Running",
        Duration::from_secs(1800),
        Duration::from_secs(5),
        || async { (not_running(&pods).await.ok()? == 0).then_some(()) },
    )
    .await?;
    println!("  all Running after {:.0} s", t.elapsed().as_secs_f64());

    // The agent's pod on the first node, its pod-bound token and the chart's RBAC.
    box_agent::install_rbac(&client)
        .await
        .context("the chart's agent RBAC")?;
    let agent_pod = box_agent::create_pod(&client, &nodes[0])
        .await
        .context("the agent's pod")?;
    let token = box_agent::token(&client, &agent_pod)
        .await
        .context("the agent's token")?;
    let agent_cfg =
        lastcall_testkit::kube_box::config_from(&kbox.kubeconfig(&token, "agent")).await?;
    let agent: Api<Pod> = Api::namespaced(kube::Client::try_from(agent_cfg)?, NS);
    let own: Vec<String> = (0..pod_count)
        .step_by(node_count)
        .take(delete_count)
        .map(|i| format!("fleet-a-{i:06}"))
        .collect();

    let settle = Duration::from_secs(30);
    let before = memory(&client, pid, settle).await?;
    let again = memory(&client, pid, settle).await?;
    let before_policy = deletes(&agent, &own, delete_count).await;
    if let Some(e) = &before_policy.3 {
        bail!("a dry-run DELETE on the agent's node without the policy failed: {e}");
    }

    // The chart's pod policy, as rendered.
    let docs = box_agent::manifest()?;
    for (kind, plural) in [
        ("ValidatingAdmissionPolicy", "validatingadmissionpolicies"),
        (
            "ValidatingAdmissionPolicyBinding",
            "validatingadmissionpolicybindings",
        ),
    ] {
        let doc = docs
            .iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == POLICY)
            .with_context(|| format!("{kind} {POLICY} not in manifests/lastcall.yaml"))?;
        let ar = ApiResource {
            group: "admissionregistration.k8s.io".into(),
            version: "v1".into(),
            api_version: "admissionregistration.k8s.io/v1".into(),
            kind: kind.into(),
            plural: plural.into(),
        };
        Api::<DynamicObject>::all_with(client.clone(), &ar)
            .create(
                &PostParams::default(),
                &serde_json::from_value(doc.clone())?,
            )
            .await?;
    }
    let t = Instant::now();
    let other = format!("fleet-a-{:06}", 1);
    try_eventually(
        "the policy refuses a DELETE on another node",
        Duration::from_secs(120),
        Duration::from_millis(500),
        || async {
            let r = dry_run_delete(&agent, &other).await;
            matches!(r, Err(kube::Error::Api(ref s)) if s.code == 403 && s.message.contains(POLICY))
                .then_some(())
        },
    )
    .await?;
    println!(
        "  the policy in force {:.1} s after it was created",
        t.elapsed().as_secs_f64()
    );
    let after = memory(&client, pid, settle).await?;
    let under_policy = deletes(&agent, &own, delete_count).await;

    println!(
        "\n| kube-apiserver, {pod_count} pods | without the policy | again, 30 s later | with the pod policy | with / without |"
    );
    println!("|---|---|---|---|---|");
    println!(
        "| resident set (median of {SAMPLES}; spread) | {:.0} MiB ({:.0}) | {:.0} MiB ({:.0}) | {:.0} MiB ({:.0}) | **{:.2}×** (+{:.0} MiB) |",
        mib(before.0),
        mib(before.1),
        mib(again.0),
        mib(again.1),
        mib(after.0),
        mib(after.1),
        after.0 as f64 / again.0 as f64,
        mib(after.0.saturating_sub(again.0))
    );
    println!(
        "| Go heap in use (median of {SAMPLES}; spread) | {:.0} MiB ({:.0}) | {:.0} MiB ({:.0}) | {:.0} MiB ({:.0}) | **{:.2}×** (+{:.0} MiB) |",
        mib(before.2),
        mib(before.3),
        mib(again.2),
        mib(again.3),
        mib(after.2),
        mib(after.3),
        after.2 as f64 / again.2 as f64,
        mib(after.2.saturating_sub(again.2))
    );
    println!(
        "| dry-run uid-preconditioned DELETE of a game-server pod on the agent's node, p50 / max of {delete_count} | {:.1} / {:.1} ms | – | {:.1} / {:.1} ms ({} of {delete_count} failed) | **{:.1}×** p50 |",
        before_policy.0.as_secs_f64() * 1e3,
        before_policy.1.as_secs_f64() * 1e3,
        under_policy.0.as_secs_f64() * 1e3,
        under_policy.1.as_secs_f64() * 1e3,
        under_policy.2,
        under_policy.0.as_secs_f64() / before_policy.0.as_secs_f64()
    );
    if let Some(e) = &under_policy.3 {
        println!("\nthe first DELETE under the policy that failed: {e}");
    }
    println!(
        "\n(box_policy_memory: {:.0} s wall time)",
        began.elapsed().as_secs_f64()
    );
    Ok(())
}
