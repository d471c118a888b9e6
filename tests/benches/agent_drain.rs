//! Agent benchmarks: what a user feels when a node drains.
//!
//! Run: `cargo bench -p lastcall-testkit --bench agent_drain [-- fence deregister load memory]`
//! (no names = all four). `LASTCALL_BENCH_LOG=warn` (any tracing filter) prints the in-process
//! agents' logs to stderr.
//!
//! Everything runs against the in-process emulators (Kubernetes API + cluster model, GameLift)
//! and a private redis-server, all on 127.0.0.1, so the figures are lastcall's own reaction
//! time and traffic plus the emulators' work on the same two cores, never network latency.
//!
//! 1. **fence**: from the Redis PUBLISH of DRAINING until the `lastcall.dev/draining` taint is
//!    in the API store and every Ready server on the node is deleting or gone, over 100 drains
//!    (each cancelled with ACTIVE and refilled before the next). Baseline measured in the same
//!    run: a bare kube client making the minimum writes (one Node patch + one preconditioned
//!    DELETE per Ready server) on an identical node.
//! 2. **deregister**: from the last game's SDK `Shutdown()` until the GameLift emulator
//!    records `DeregisterGameServer`, one node (and agent) per sample.
//! 3. **load**: per-agent requests, watch events and response bytes from the emulator's
//!    journal, at 50 nodes × 20 game servers with 50 agents, in steady state, during one drain
//!    and while other nodes churn. Baselines measured in the same run: one cluster-wide
//!    GameServer LIST (what the original adapter does per check) and one unfiltered
//!    GameServer watch (what an agent without server-side filtering would receive).
//! 4. **memory**: peak RSS (`VmHWM`) of the real `lastcall-agent` binary through a full drain
//!    of a node with 40 game servers; baseline: the same binary idle, with no API server.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, anyhow, bail, ensure};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, Preconditions};
use kube::runtime::watcher;
use lastcall_agent::keys;
use lastcall_common::fleetiq::{InstanceStatus as Status, StatusMessage, cache_key};
use lastcall_testkit::agent::{InProcessAgent, config, metric, scrape};
use lastcall_testkit::bins::shipped_binary;
use lastcall_testkit::cluster::allocator::gameserver_resource;
use lastcall_testkit::cluster::{
    AllocationRequest, Cluster, ClusterConfig, FleetSpec, GameServerSpec, GameServerState as S,
    GameServerView, NodeSpec,
};
use lastcall_testkit::eventually::try_eventually;
use lastcall_testkit::gamelift::{GameLiftEmulator, InstanceStatus};
use lastcall_testkit::gce::GceMetadataEmulator;
use lastcall_testkit::imds::ImdsEmulator;
use lastcall_testkit::kube::resources::GAMESERVERS;
use lastcall_testkit::kube::{Store, Traffic, Verb};
use lastcall_testkit::net::free_port;
use lastcall_testkit::process::signal;
use lastcall_testkit::redis::RedisServer;
use redis::aio::MultiplexedConnection;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

const NS: &str = "default";
const GROUP: &str = "bench-group";
const HOSTNAME: &str = "kubernetes.io/hostname";

const FENCE_DRAINS: usize = 100;
const FENCE_READY: usize = 16;
const FENCE_ALLOCATED: usize = 4;
/// How often the fence poller re-reads the store.
const POLL: Duration = Duration::from_micros(500);
const FENCE_TARGET: Duration = Duration::from_millis(100);
/// The agent's default `--release-concurrency`; the baseline deletes with the same.
const RELEASE_CONCURRENCY: usize = 8;

const DEREG_NODES: usize = 24;
const DEREG_TARGET: Duration = Duration::from_secs(1);
/// The agent's default `--deregister-settle`, plus a margin.
const DEREG_SETTLE: Duration = Duration::from_millis(5500);

const LOAD_NODES: usize = 50;
const LOAD_PER_NODE: usize = 20;
const LOAD_ALLOCATED: usize = 5;
const WINDOW: Duration = Duration::from_secs(10);
/// Nodes whose game servers churn in the churn window.
const CHURN_NODES: std::ops::Range<usize> = 40..50;
/// Nodes untouched by the drain (its replacements land on the emptiest nodes, 01..15) and
/// by the churn.
const UNINVOLVED: std::ops::Range<usize> = 20..40;
const POOL_LABEL: &str = "bench.lastcall.dev/pool";

const MEM_READY: usize = 30;
const MEM_ALLOCATED: usize = 10;

/// The original adapter's `--healthcheck-interval` in its chart, and its drain re-check loop.
const ORIGINAL_INTERVAL: Duration = Duration::from_secs(60);
const ORIGINAL_RECHECK: Duration = Duration::from_secs(60);

fn main() -> anyhow::Result<()> {
    let wanted: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let run = |name: &str| wanted.is_empty() || wanted.iter().any(|w| name.contains(w.as_str()));
    if let Ok(filter) = std::env::var("LASTCALL_BENCH_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .init();
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    println!();
    println!(
        "lastcall-agent benchmarks; machine: {} ({} CPUs)",
        cpu_model(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    for (name, section) in [
        ("fence", Section::Fence),
        ("deregister", Section::Deregister),
        ("load", Section::Load),
        ("memory", Section::Memory),
    ] {
        if !run(name) {
            continue;
        }
        let started = Instant::now();
        runtime.block_on(async {
            match section {
                Section::Fence => bench_fence().await,
                Section::Deregister => bench_deregister().await,
                Section::Load => bench_load().await,
                Section::Memory => bench_memory().await,
            }
        })?;
        println!(
            "({name}: {:.1} s wall time)",
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

#[derive(Clone, Copy)]
enum Section {
    Fence,
    Deregister,
    Load,
    Memory,
}

// ---- shared helpers --------------------------------------------------------------------

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

/// Nearest-rank percentile of sorted samples.
fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 * p).ceil() as usize)
        .saturating_sub(1)
        .min(sorted.len().saturating_sub(1));
    sorted.get(i).copied().unwrap_or_default()
}

struct Stats {
    n: usize,
    min: Duration,
    p50: Duration,
    p99: Duration,
    max: Duration,
}

fn stats(mut v: Vec<Duration>) -> Stats {
    v.sort();
    Stats {
        n: v.len(),
        min: v.first().copied().unwrap_or_default(),
        p50: percentile(&v, 0.5),
        p99: percentile(&v, 0.99),
        max: v.last().copied().unwrap_or_default(),
    }
}

fn ratio(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64().max(1e-9)
}

/// [`try_eventually`] for a synchronous condition.
async fn until<T>(
    what: &str,
    within: Duration,
    every: Duration,
    mut cond: impl FnMut() -> Option<T>,
) -> anyhow::Result<T> {
    Ok(try_eventually(what, within, every, || std::future::ready(cond())).await?)
}

/// Waits until the store's resourceVersion has not moved for `quiet` (nobody is writing).
async fn quiet(store: &Store, quiet: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = store.resource_version();
    let mut since = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(5)).await;
        let rv = store.resource_version();
        if rv != last {
            last = rv;
            since = Instant::now();
        } else if since.elapsed() >= quiet {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("the store did not go quiet for {quiet:?} within 30 s");
        }
    }
}

fn has_taint(node: &Value, key: &str) -> bool {
    node.pointer("/spec/taints")
        .and_then(Value::as_array)
        .is_some_and(|ts| ts.iter().any(|t| t["key"] == key))
}

fn cordoned(node: &Value) -> bool {
    node.pointer("/spec/unschedulable")
        .and_then(Value::as_bool)
        .unwrap_or(false)
}

fn annotation<'a>(obj: &'a Value, key: &str) -> Option<&'a str> {
    obj.pointer("/metadata/annotations")
        .and_then(|a| a.get(key))
        .and_then(Value::as_str)
}

fn deleting(obj: &Value) -> bool {
    obj.pointer("/metadata/deletionTimestamp").is_some()
}

fn on_node(cluster: &Cluster, node: &str) -> Vec<GameServerView> {
    cluster
        .game_servers()
        .into_iter()
        .filter(|g| g.node.as_deref() == Some(node))
        .collect()
}

fn status_body(iid: &str, s: Status) -> String {
    StatusMessage {
        group_name: Some(GROUP.into()),
        group_arn: Some(GameLiftEmulator::group_arn(GROUP)),
        instance_id: iid.into(),
        status: s,
    }
    .to_python_json()
}

/// Publishes FleetIQ statuses the way pubsub does: SET the cache key, PUBLISH on the channel.
struct Publisher {
    conn: MultiplexedConnection,
}

impl Publisher {
    async fn new(redis: &RedisServer) -> anyhow::Result<Self> {
        Ok(Self {
            conn: redis.client().await?,
        })
    }

    async fn cache(&mut self, iid: &str, s: Status) -> anyhow::Result<()> {
        let _: () = redis::cmd("SET")
            .arg(cache_key(iid))
            .arg(status_body(iid, s))
            .query_async(&mut self.conn)
            .await?;
        Ok(())
    }

    /// Returns how many subscribers received the message.
    async fn publish(&mut self, iid: &str, s: Status) -> anyhow::Result<i64> {
        Ok(redis::cmd("PUBLISH")
            .arg(iid)
            .arg(status_body(iid, s))
            .query_async(&mut self.conn)
            .await?)
    }

    async fn status(&mut self, iid: &str, s: Status) -> anyhow::Result<i64> {
        self.cache(iid, s).await?;
        self.publish(iid, s).await
    }
}

fn iid_of(node: &str) -> String {
    lastcall_testkit::gamelift::instance_id(node)
}

async fn start_agent(
    cluster: &Cluster,
    gl: &GameLiftEmulator,
    redis: &RedisServer,
    node: &str,
) -> anyhow::Result<InProcessAgent> {
    let url = redis.url();
    let iid = iid_of(node);
    let args = [
        "--game-server-group",
        GROUP,
        "--instance-id",
        &iid,
        "--redis-url",
        &url,
    ];
    let kube = cluster
        .emulator()
        .config_for(&format!("agent-{node}"))
        .await?;
    InProcessAgent::start(config(node, &args), kube, Some(gl.sdk_client().await)).await
}

async fn wait_subscribed(agent: &InProcessAgent) -> anyhow::Result<()> {
    subscribed(agent.admin).await
}

/// Waits until the agent behind `admin` reports its Redis subscription.
async fn subscribed(admin: std::net::SocketAddr) -> anyhow::Result<()> {
    try_eventually(
        "the agent subscribes to Redis",
        Duration::from_secs(20),
        Duration::from_millis(20),
        || async {
            (metric(&scrape(admin).await, "lastcall_redis_connected", &[]) == Some(1.0))
                .then_some(())
        },
    )
    .await?;
    Ok(())
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
            })
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

/// CPU time (user + system) this process has used, from /proc/self/stat (100 Hz ticks).
fn process_cpu() -> Duration {
    let ticks = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            // Fields after the parenthesised command name; utime and stime are 14 and 15.
            let rest = s.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
        })
        .unwrap_or(0);
    Duration::from_millis(ticks * 10)
}

// ---- 1. signal → fence -----------------------------------------------------------------

/// When the fence became visible in the store.
struct Seen {
    taint: Instant,
    released: Instant,
}

/// Watches the store from a plain thread until `node` carries the draining taint and every
/// server in `ready` is deleting or gone.
fn spawn_fence_poller(
    store: Store,
    node: String,
    ready: Vec<String>,
    within: Duration,
) -> tokio::task::JoinHandle<anyhow::Result<Seen>> {
    tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + within;
        let mut taint = None;
        loop {
            let now = Instant::now();
            if taint.is_none()
                && store
                    .get(&lastcall_testkit::kube::resources::NODES, None, &node)
                    .is_some_and(|n| has_taint(&n, keys::TAINT_DRAINING))
            {
                taint = Some(now);
            }
            if let Some(t) = taint {
                let released = ready.iter().all(|name| {
                    store
                        .get(&GAMESERVERS, Some(NS), name)
                        .is_none_or(|o| deleting(&o))
                });
                if released {
                    return Ok(Seen {
                        taint: t,
                        released: now,
                    });
                }
            }
            if now >= deadline {
                bail!("node {node} not fenced within {within:?}");
            }
            std::thread::sleep(POLL);
        }
    })
}

/// The node is back to normal: schedulable, untainted, `FENCE_READY` Ready and
/// `FENCE_ALLOCATED` Allocated servers on it (claimed and unmarked when `agent`), no pod
/// terminating.
fn fence_settled(cluster: &Cluster, node: &str, agent: bool) -> Option<()> {
    let n = cluster.node(node)?;
    if cordoned(&n)
        || has_taint(&n, keys::TAINT_DRAINING)
        || annotation(&n, keys::ANN_STARTED).is_some()
    {
        return None;
    }
    let gss = on_node(cluster, node);
    let ready = gss.iter().filter(|g| g.state == Some(S::Ready)).count();
    let allocated = gss.iter().filter(|g| g.state == Some(S::Allocated)).count();
    if gss.iter().any(|g| g.deleting) || ready != FENCE_READY || allocated != FENCE_ALLOCATED {
        return None;
    }
    if agent
        && !gss.iter().all(|g| {
            g.labels.get(keys::LABEL_NODE).map(String::as_str) == Some(node)
                && !g.labels.contains_key(keys::LABEL_NODE_DRAINING)
                && !g.annotations.contains_key(keys::ANN_GS_DEADLINE)
        })
    {
        return None;
    }
    cluster
        .pods_on(node)
        .iter()
        .all(|p| !deleting(p))
        .then_some(())
}

async fn settle_fence_node(cluster: &Cluster, node: &str, agent: bool) -> anyhow::Result<()> {
    until(
        &format!("node {node} settled"),
        Duration::from_secs(20),
        Duration::from_millis(2),
        || fence_settled(cluster, node, agent),
    )
    .await?;
    quiet(cluster.store(), Duration::from_millis(30)).await
}

fn ready_names(cluster: &Cluster, node: &str) -> Vec<GameServerView> {
    on_node(cluster, node)
        .into_iter()
        .filter(|g| g.state == Some(S::Ready) && !g.deleting)
        .collect()
}

/// The minimum a fence needs, with a bare client: one guarded Node patch (cordon + taint),
/// then a preconditioned DELETE per Ready server, `RELEASE_CONCURRENCY` at a time.
async fn bare_fence(
    client: &kube::Client,
    node: &str,
    node_rv: &str,
    ready: &[GameServerView],
) -> anyhow::Result<()> {
    let ops = json!([
        {"op": "test", "path": "/metadata/resourceVersion", "value": node_rv},
        {"op": "add", "path": "/spec/unschedulable", "value": true},
        {"op": "add", "path": "/spec/taints", "value": [
            {"key": keys::TAINT_DRAINING, "value": "fleetiq", "effect": "NoSchedule"}
        ]},
    ]);
    let patch: json_patch::Patch = serde_json::from_value(ops)?;
    Api::<Node>::all(client.clone())
        .patch(node, &PatchParams::default(), &Patch::Json::<()>(patch))
        .await?;
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), NS, &gameserver_resource());
    let results: Vec<kube::Result<_>> = futures::stream::iter(ready)
        .map(|g| {
            let api = api.clone();
            let dp = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: Some(g.uid.clone()),
                    resource_version: Some(g.resource_version.clone()),
                }),
                ..DeleteParams::default()
            };
            async move { api.delete(&g.name, &dp).await }
        })
        .buffer_unordered(RELEASE_CONCURRENCY)
        .collect()
        .await;
    for r in results {
        r?;
    }
    Ok(())
}

async fn bare_unfence(client: &kube::Client, node: &str) -> anyhow::Result<()> {
    Api::<Node>::all(client.clone())
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"unschedulable": null, "taints": null}})),
        )
        .await?;
    Ok(())
}

fn histogram_sum_count(text: &str, name: &str) -> (f64, f64) {
    (
        metric(text, &format!("{name}_sum"), &[]).unwrap_or(0.0),
        metric(text, &format!("{name}_count"), &[]).unwrap_or(0.0),
    )
}

async fn bench_fence() -> anyhow::Result<()> {
    let cluster = Cluster::start(ClusterConfig::default()).await?;
    // n1 runs the agent; n2 is the bare-client baseline. Each Fleet is pinned to its node, so
    // the replacements of released servers wait (Pending) until the node is uncordoned and
    // then refill it for the next drain.
    for node in ["n1", "n2"] {
        cluster.add_node(NodeSpec::new(node))?;
        cluster.create_fleet(
            FleetSpec::new(format!("f-{node}"), (FENCE_READY + FENCE_ALLOCATED) as i64)
                .node_selector(HOSTNAME, node)
                .grace_seconds(0),
        )?;
    }
    for node in ["n1", "n2"] {
        let fleet = format!("f-{node}");
        cluster
            .wait_ready(NS, &fleet, FENCE_READY + FENCE_ALLOCATED)
            .await?;
        for _ in 0..FENCE_ALLOCATED {
            cluster
                .allocate(&AllocationRequest::fleet(NS, &fleet))
                .await?
                .context("allocation found no Ready server")?;
        }
    }
    let gl = GameLiftEmulator::start().await?;
    gl.add_instances(GROUP, &[iid_of("n1")], InstanceStatus::Active);
    let redis = RedisServer::start().await?;
    let mut publisher = Publisher::new(&redis).await?;
    let agent = start_agent(&cluster, &gl, &redis, "n1").await?;
    wait_subscribed(&agent).await?;
    let baseline = cluster.emulator().client_as("baseline-writer").await?;
    let iid = iid_of("n1");

    let mut agent_fence = Vec::new();
    let mut agent_taint = Vec::new();
    let mut bare_fence_t = Vec::new();
    let mut bare_taint = Vec::new();
    let mut histogram_before = (0.0, 0.0);
    let mut journal_from = 0;
    // Rounds whose DRAINING PUBLISH found no subscriber (the agent was resubscribing).
    let mut missed: Vec<usize> = Vec::new();
    // Round 0 warms up connections on both sides and is not counted.
    for round in 0..=FENCE_DRAINS {
        if round == 1 {
            histogram_before =
                histogram_sum_count(&agent.metrics().await, "lastcall_signal_to_fence_seconds");
            journal_from = cluster.emulator().journal().len() as u64;
        }
        // lastcall on n1.
        settle_fence_node(&cluster, "n1", true).await?;
        let ready: Vec<String> = ready_names(&cluster, "n1")
            .into_iter()
            .map(|g| g.name)
            .collect();
        ensure!(ready.len() == FENCE_READY);
        publisher.cache(&iid, Status::Draining).await?;
        let poll = spawn_fence_poller(
            cluster.store().clone(),
            "n1".into(),
            ready,
            Duration::from_secs(40),
        );
        let t0 = Instant::now();
        if publisher.publish(&iid, Status::Draining).await? == 0 {
            missed.push(round);
        }
        let seen = poll.await??;
        if round > 0 {
            agent_fence.push(seen.released - t0);
            agent_taint.push(seen.taint - t0);
        }
        publisher.status(&iid, Status::Active).await?;

        // The same writes from a bare client on n2.
        settle_fence_node(&cluster, "n2", false).await?;
        let ready = ready_names(&cluster, "n2");
        ensure!(ready.len() == FENCE_READY);
        let node_rv = cluster
            .node("n2")
            .and_then(|n| {
                n.pointer("/metadata/resourceVersion")
                    .and_then(Value::as_str)
                    .map(str::to_string)
            })
            .context("node n2 has no resourceVersion")?;
        let poll = spawn_fence_poller(
            cluster.store().clone(),
            "n2".into(),
            ready.iter().map(|g| g.name.clone()).collect(),
            Duration::from_secs(10),
        );
        let t0 = Instant::now();
        bare_fence(&baseline, "n2", &node_rv, &ready).await?;
        let seen = poll.await??;
        if round > 0 {
            bare_fence_t.push(seen.released - t0);
            bare_taint.push(seen.taint - t0);
        }
        bare_unfence(&baseline, "n2").await?;
    }
    settle_fence_node(&cluster, "n1", true).await?;
    let m = agent.metrics().await;
    let (sum, count) = histogram_sum_count(&m, "lastcall_signal_to_fence_seconds");
    let own_mean =
        Duration::from_secs_f64((sum - histogram_before.0) / (count - histogram_before.1).max(1.0));
    let releases_ok = metric(&m, "lastcall_releases_total", &[("result", "ok")]).unwrap_or(0.0);
    let releases_conflict =
        metric(&m, "lastcall_releases_total", &[("result", "conflict")]).unwrap_or(0.0);

    // What the agent sent per drain + cancel cycle, from the journal.
    let entries = cluster.emulator().journal().filter(|e| {
        e.seq >= journal_from && e.identity.as_deref() == Some("agent-n1") && e.verb != Verb::Watch
    });
    let mut by_kind: BTreeMap<String, u64> = BTreeMap::new();
    for e in &entries {
        let status = if e.status >= 300 {
            format!(" → {}", e.status)
        } else {
            String::new()
        };
        *by_kind
            .entry(format!(
                "{} {}{status}",
                e.verb.as_str(),
                e.resource.as_deref().unwrap_or("-")
            ))
            .or_default() += 1;
    }

    let a = stats(agent_fence);
    let at = stats(agent_taint);
    let b = stats(bare_fence_t);
    let bt = stats(bare_taint);
    println!();
    println!(
        "## 1. Signal → fence: {} drains of a node with {FENCE_READY} Ready + {FENCE_ALLOCATED} Allocated servers (store polled every {} µs)",
        a.n,
        POLL.as_micros()
    );
    println!();
    println!("| measure | p50 | p99 | min | max |");
    println!("|---|---|---|---|---|");
    let row = |name: &str, s: &Stats| {
        println!(
            "| {name} | {} | {} | {} | {} |",
            ms(s.p50),
            ms(s.p99),
            ms(s.min),
            ms(s.max)
        )
    };
    row("lastcall: PUBLISH → taint visible", &at);
    row(
        "lastcall: PUBLISH → taint + every Ready server released",
        &a,
    );
    row(
        "baseline (bare client, same writes): start → taint visible",
        &bt,
    );
    row(
        "baseline (bare client): start → taint + every Ready server released",
        &b,
    );
    println!();
    println!("| measure | value |");
    println!("|---|---|");
    println!(
        "| target | p99 < {} ({}) |",
        ms(FENCE_TARGET),
        if a.p99 < FENCE_TARGET {
            "met"
        } else {
            "MISSED"
        }
    );
    println!(
        "| lastcall / bare-client ratio, p50 | {:.1}x |",
        ratio(a.p50, b.p50)
    );
    println!(
        "| lastcall / bare-client ratio, p99 | {:.1}x |",
        ratio(a.p99, b.p99)
    );
    println!(
        "| lastcall overhead over the bare client, p50 | {} |",
        ms(a.p50.saturating_sub(b.p50))
    );
    println!(
        "| agent's own lastcall_signal_to_fence_seconds, mean | {} |",
        ms(own_mean)
    );
    println!(
        "| original adapter (computed): fence on the first message it reads | 0 to {} s after PUBLISH (it sleeps --healthcheck-interval after each message) |",
        ORIGINAL_INTERVAL.as_secs()
    );
    println!(
        "| releases by result over the run (ok / conflict) | {releases_ok} / {releases_conflict} |"
    );
    println!(
        "| DRAINING publishes that found no subscriber (agent resubscribing) | {} of {} {:?} |",
        missed.len(),
        FENCE_DRAINS + 1,
        missed
    );
    println!(
        "| agent Redis reconnects over the run | {} |",
        metric(&m, "lastcall_redis_reconnects_total", &[]).unwrap_or(0.0)
    );
    println!();
    println!(
        "Agent requests per drain + cancel cycle (watches excluded), over {FENCE_DRAINS} cycles:"
    );
    println!();
    println!("| request | per cycle |");
    println!("|---|---|");
    for (k, n) in &by_kind {
        println!("| {k} | {:.1} |", *n as f64 / FENCE_DRAINS as f64);
    }
    println!(
        "| total | {:.1} (bare client: {}) |",
        entries.len() as f64 / FENCE_DRAINS as f64,
        1 + FENCE_READY
    );
    agent.stop().await?;
    cluster.shutdown().await;
    Ok(())
}

// ---- 2. last game ends → DeregisterGameServer ------------------------------------------

async fn bench_deregister() -> anyhow::Result<()> {
    let cluster = Cluster::start(ClusterConfig::default()).await?;
    let nodes: Vec<String> = (0..DEREG_NODES).map(|i| format!("d{i:02}")).collect();
    for node in &nodes {
        cluster.add_node(NodeSpec::new(node.as_str()))?;
        for kind in ["game", "idle"] {
            cluster.create_game_server(
                GameServerSpec::new(format!("{kind}-{node}"))
                    .node_selector(HOSTNAME, node.as_str())
                    .grace_seconds(0),
            )?;
        }
    }
    until(
        "every game server Ready",
        Duration::from_secs(30),
        Duration::from_millis(20),
        || {
            (cluster
                .game_servers()
                .iter()
                .filter(|g| g.state == Some(S::Ready))
                .count()
                == 2 * DEREG_NODES)
                .then_some(())
        },
    )
    .await?;
    for node in &nodes {
        cluster.sdk_allocate(NS, &format!("game-{node}"))?;
    }
    let gl = GameLiftEmulator::start().await?;
    let iids: Vec<String> = nodes.iter().map(|n| iid_of(n)).collect();
    gl.add_instances(GROUP, &iids, InstanceStatus::Active);
    let redis = RedisServer::start().await?;
    let mut publisher = Publisher::new(&redis).await?;
    let mut agents = Vec::new();
    for node in &nodes {
        agents.push(start_agent(&cluster, &gl, &redis, node).await?);
    }
    for a in &agents {
        wait_subscribed(a).await?;
    }
    until(
        "every node registered and its servers claimed",
        Duration::from_secs(30),
        Duration::from_millis(20),
        || {
            let registered = nodes.iter().all(|n| {
                cluster
                    .node(n)
                    .is_some_and(|o| annotation(&o, keys::ANN_REGISTERED).is_some())
            });
            let claimed = cluster
                .game_servers()
                .iter()
                .all(|g| g.labels.get(keys::LABEL_NODE) == g.node.as_ref());
            (registered && claimed).then_some(())
        },
    )
    .await?;
    for iid in &iids {
        publisher.status(iid, Status::Draining).await?;
    }
    until(
        "every node draining with its game protected",
        Duration::from_secs(30),
        Duration::from_millis(20),
        || {
            nodes
                .iter()
                .all(|n| {
                    let idle_gone = cluster
                        .game_server(NS, &format!("idle-{n}"))
                        .is_none_or(|g| g.deleting);
                    let protected = cluster
                        .game_server(NS, &format!("game-{n}"))
                        .is_some_and(|g| g.annotations.contains_key(keys::ANN_GS_DEADLINE));
                    idle_gone && protected
                })
                .then_some(())
        },
    )
    .await?;
    quiet(cluster.store(), Duration::from_millis(200)).await?;
    ensure!(gl.count("DeregisterGameServer") == 0, "deregistered early");
    // Matches last minutes, not seconds: let the fence outlive the agent's default
    // --deregister-settle (5 s), so the figure is the reaction to the last game's end, not
    // the deliberate settle after a fence.
    tokio::time::sleep(DEREG_SETTLE).await;

    let mut latencies = Vec::new();
    for (node, iid) in nodes.iter().zip(&iids) {
        let t0 = SystemTime::now();
        cluster.sdk_shutdown(NS, &format!("game-{node}"))?;
        let call = until(
            &format!("DeregisterGameServer for {iid}"),
            Duration::from_secs(10),
            Duration::from_millis(1),
            || {
                gl.calls().into_iter().find(|c| {
                    c.op == "DeregisterGameServer"
                        && c.outcome == "ok"
                        && c.input.get("GameServerId").and_then(Value::as_str) == Some(iid)
                })
            },
        )
        .await?;
        latencies.push(call.at.duration_since(t0).unwrap_or_default());
        quiet(cluster.store(), Duration::from_millis(50)).await?;
    }
    let once = iids.iter().all(|iid| {
        gl.calls()
            .iter()
            .filter(|c| {
                c.op == "DeregisterGameServer"
                    && c.input.get("GameServerId").and_then(Value::as_str) == Some(iid)
            })
            .count()
            == 1
    });
    let s = stats(latencies);
    println!();
    println!(
        "## 2. Last game ends → DeregisterGameServer: {} nodes, one agent each, one Allocated server per node",
        s.n
    );
    println!();
    println!("| measure | value |");
    println!("|---|---|");
    println!("| p50 | {} |", ms(s.p50));
    println!("| p99 | {} |", ms(s.p99));
    println!("| min / max | {} / {} |", ms(s.min), ms(s.max));
    println!(
        "| target | < {} ({}) |",
        ms(DEREG_TARGET),
        if s.p99 < DEREG_TARGET {
            "met"
        } else {
            "MISSED"
        }
    );
    println!(
        "| original adapter (computed) | {} to {} s: its {} s re-check loop, then a {} s --healthcheck-interval sleep before the message that deregisters |",
        ORIGINAL_INTERVAL.as_secs(),
        (ORIGINAL_RECHECK + ORIGINAL_INTERVAL).as_secs(),
        ORIGINAL_RECHECK.as_secs(),
        ORIGINAL_INTERVAL.as_secs()
    );
    println!(
        "| ratio, original floor / lastcall p99 | {:.0}x |",
        ratio(ORIGINAL_INTERVAL, s.p99)
    );
    println!("| exactly one DeregisterGameServer per node | {once} |");
    for a in agents {
        a.stop().await?;
    }
    cluster.shutdown().await;
    Ok(())
}

// ---- 3. API load -----------------------------------------------------------------------

fn node_name(i: usize) -> String {
    format!("node{i:02}")
}

fn delta(
    after: &HashMap<Option<String>, Traffic>,
    before: &HashMap<Option<String>, Traffic>,
    identity: &str,
) -> Traffic {
    let key = Some(identity.to_string());
    let a = after.get(&key).copied().unwrap_or_default();
    let b = before.get(&key).copied().unwrap_or_default();
    Traffic {
        requests: a.requests - b.requests,
        watch_events: a.watch_events - b.watch_events,
        bytes: a.bytes - b.bytes,
    }
}

/// Mean and max of per-agent traffic over `nodes`.
struct Spread {
    mean: (f64, f64, f64),
    max: Traffic,
}

fn spread(
    after: &HashMap<Option<String>, Traffic>,
    before: &HashMap<Option<String>, Traffic>,
    nodes: impl Iterator<Item = usize>,
) -> Spread {
    let ts: Vec<Traffic> = nodes
        .map(|i| delta(after, before, &format!("agent-{}", node_name(i))))
        .collect();
    let n = ts.len().max(1) as f64;
    let sum = |f: fn(&Traffic) -> u64| ts.iter().map(f).sum::<u64>() as f64 / n;
    let max = |f: fn(&Traffic) -> u64| ts.iter().map(f).max().unwrap_or(0);
    Spread {
        mean: (
            sum(|t| t.requests),
            sum(|t| t.watch_events),
            sum(|t| t.bytes),
        ),
        max: Traffic {
            requests: max(|t| t.requests),
            watch_events: max(|t| t.watch_events),
            bytes: max(|t| t.bytes),
        },
    }
}

fn fmt_spread(s: &Spread) -> String {
    format!(
        "{:.1} / {} | {:.1} / {} | {:.0} / {}",
        s.mean.0, s.max.requests, s.mean.1, s.max.watch_events, s.mean.2, s.max.bytes
    )
}

fn fmt_traffic(t: &Traffic) -> String {
    format!("{} | {} | {}", t.requests, t.watch_events, t.bytes)
}

/// Every GameServer is Ready or Allocated, not deleting, on a node and labelled with it.
fn all_claimed(cluster: &Cluster, total: usize) -> Option<()> {
    let gss = cluster.game_servers();
    let live: Vec<&GameServerView> = gss.iter().filter(|g| !g.deleting).collect();
    (gss.len() == total
        && live.len() == total
        && live.iter().all(|g| {
            matches!(g.state, Some(S::Ready | S::Allocated))
                && g.node.is_some()
                && g.labels.get(keys::LABEL_NODE) == g.node.as_ref()
        }))
    .then_some(())
}

async fn bench_load() -> anyhow::Result<()> {
    let setup = Instant::now();
    let cluster = Cluster::start(ClusterConfig::default()).await?;
    for i in 0..LOAD_NODES {
        let mut spec = NodeSpec::new(node_name(i));
        if CHURN_NODES.contains(&i) {
            spec = spec.label(POOL_LABEL, "churn");
        }
        cluster.add_node(spec)?;
    }
    let total = LOAD_NODES * LOAD_PER_NODE;
    // The scheduler puts each pod on the node with the fewest pods: 20 per node.
    cluster.create_fleet(FleetSpec::new("main", total as i64).grace_seconds(1))?;
    cluster.create_fleet(
        FleetSpec::new("churn", 0)
            .node_selector(POOL_LABEL, "churn")
            .grace_seconds(1),
    )?;
    until(
        "1,000 Ready game servers",
        Duration::from_secs(180),
        Duration::from_millis(250),
        || {
            (cluster
                .game_servers()
                .iter()
                .filter(|g| g.state == Some(S::Ready))
                .count()
                == total)
                .then_some(())
        },
    )
    .await?;
    let ready_after = setup.elapsed();
    let mut per_node: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for g in cluster.game_servers() {
        per_node
            .entry(g.node.clone().unwrap_or_default())
            .or_default()
            .push(g.name);
    }
    ensure!(
        per_node.len() == LOAD_NODES && per_node.values().all(|v| v.len() == LOAD_PER_NODE),
        "game servers are not spread {LOAD_PER_NODE} per node"
    );
    for names in per_node.values() {
        for name in names.iter().take(LOAD_ALLOCATED) {
            cluster.sdk_allocate(NS, name)?;
        }
    }

    // The model alone (no agent yet), idle: its once-a-second resync passes.
    cluster.wait_stable(Duration::from_secs(60)).await?;
    let cpu0 = process_cpu();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let model_idle_cpu = process_cpu() - cpu0;

    let gl = GameLiftEmulator::start().await?;
    let iids: Vec<String> = (0..LOAD_NODES).map(|i| iid_of(&node_name(i))).collect();
    gl.add_instances(GROUP, &iids, InstanceStatus::Active);
    let redis = RedisServer::start().await?;
    let mut publisher = Publisher::new(&redis).await?;
    let mut agents = Vec::new();
    for i in 0..LOAD_NODES {
        agents.push(start_agent(&cluster, &gl, &redis, &node_name(i)).await?);
    }
    let agents_started = Instant::now();
    for a in &agents {
        wait_subscribed(a).await?;
    }
    until(
        "every node registered and every game server claimed",
        Duration::from_secs(180),
        Duration::from_millis(250),
        || {
            let registered = (0..LOAD_NODES).all(|i| {
                cluster
                    .node(&node_name(i))
                    .is_some_and(|o| annotation(&o, keys::ANN_REGISTERED).is_some())
            });
            (registered && all_claimed(&cluster, total).is_some()).then_some(())
        },
    )
    .await?;
    let claimed_after = setup.elapsed();

    // Baseline: what a watch without server-side filtering receives.
    let stop_unfiltered = CancellationToken::new();
    {
        let client = cluster.emulator().client_as("unfiltered-watch").await?;
        let api: Api<DynamicObject> = Api::all_with(client, &gameserver_resource());
        let stop = stop_unfiltered.clone();
        tokio::spawn(async move {
            let mut stream = std::pin::pin!(watcher(api, watcher::Config::default()));
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    next = stream.next() => if next.is_none() { return },
                }
            }
        });
    }
    cluster.wait_stable(Duration::from_secs(60)).await?;
    quiet(cluster.store(), Duration::from_millis(500)).await?;

    // Baseline: the original adapter's cluster-wide GameServer LIST, made once.
    let journal = cluster.emulator().journal();
    let lister = cluster.emulator().client_as("original-list").await?;
    let t = Instant::now();
    let listed = Api::<DynamicObject>::all_with(lister, &gameserver_resource())
        .list(&ListParams::default())
        .await?;
    let list_time = t.elapsed();
    let list = journal.traffic_for("original-list");

    // Steady state.
    let cpu0 = process_cpu();
    let s0 = journal.traffic();
    tokio::time::sleep(WINDOW).await;
    let s1 = journal.traffic();
    let steady_cpu = process_cpu() - cpu0;

    // One drain: node00.
    let drained = node_name(0);
    let cpu0 = process_cpu();
    let seq0 = journal.len() as u64;
    let d0 = journal.traffic();
    let drained_ready: Vec<String> = ready_names(&cluster, &drained)
        .into_iter()
        .map(|g| g.name)
        .collect();
    let poll = spawn_fence_poller(
        cluster.store().clone(),
        drained.clone(),
        drained_ready,
        Duration::from_secs(60),
    );
    let t = Instant::now();
    let drain_t0 = t;
    let receivers = publisher
        .status(&iid_of(&drained), Status::Draining)
        .await?;
    let fence_seen = poll.await??;
    until(
        "node00 drained and its Ready servers replaced elsewhere",
        Duration::from_secs(60),
        Duration::from_millis(100),
        || {
            let n = cluster.node(&drained)?;
            let here = on_node(&cluster, &drained);
            let protected = here.len() == LOAD_ALLOCATED
                && here.iter().all(|g| {
                    g.state == Some(S::Allocated)
                        && g.annotations.contains_key(keys::ANN_GS_DEADLINE)
                });
            (has_taint(&n, keys::TAINT_DRAINING)
                && protected
                && all_claimed(&cluster, total).is_some())
            .then_some(())
        },
    )
    .await?;
    let drain_done = t.elapsed();
    cluster.wait_stable(Duration::from_secs(60)).await?;
    quiet(cluster.store(), Duration::from_millis(500)).await?;
    let drain_window = t.elapsed();
    let d1 = journal.traffic();
    let drain_cpu = process_cpu() - cpu0;
    let mut drain_verbs: BTreeMap<String, u64> = BTreeMap::new();
    let drained_identity = format!("agent-{drained}");
    for e in journal.filter(|e| e.seq >= seq0 && e.identity.as_deref() == Some(&drained_identity)) {
        *drain_verbs
            .entry(format!(
                "{} {}",
                e.verb.as_str(),
                e.resource.as_deref().unwrap_or("-")
            ))
            .or_default() += 1;
    }
    let gained: Vec<usize> = (1..LOAD_NODES)
        .filter(|i| on_node(&cluster, &node_name(*i)).len() > LOAD_PER_NODE)
        .collect();
    ensure!(
        !gained
            .iter()
            .any(|i| UNINVOLVED.contains(i) || CHURN_NODES.contains(i)),
        "a replacement landed on an uninvolved or churn node: {gained:?}"
    );

    // Churn on nodes 40..49: create, allocate, shut down, scale away.
    let cpu0 = process_cpu();
    let c0 = journal.traffic();
    let t = Instant::now();
    let mut churn_ops = 0u64;
    let mut churn_refused = 0u64;
    let churn_nodes: Vec<String> = CHURN_NODES.map(node_name).collect();
    let churn_main: Vec<String> = cluster
        .fleet_game_servers(NS, "main")
        .into_iter()
        .filter(|g| {
            g.state == Some(S::Ready) && g.node.as_ref().is_some_and(|n| churn_nodes.contains(n))
        })
        .map(|g| g.name)
        .collect();
    let mut round = 0usize;
    while t.elapsed() + Duration::from_millis(1500) < WINDOW {
        cluster.scale_fleet(NS, "churn", 60)?;
        churn_ops += 1;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let fresh: Vec<String> = cluster
            .fleet_game_servers(NS, "churn")
            .into_iter()
            .filter(|g| g.state == Some(S::Ready) && !g.deleting)
            .take(10)
            .map(|g| g.name)
            .collect();
        for name in &fresh {
            churn_ops += 1;
            churn_refused += u64::from(cluster.sdk_allocate(NS, name).is_err());
        }
        let mains: Vec<&String> = churn_main
            .iter()
            .cycle()
            .skip(round * 10)
            .take(10)
            .collect();
        for name in &mains {
            churn_ops += 1;
            churn_refused += u64::from(cluster.sdk_allocate(NS, name).is_err());
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        for name in &fresh {
            churn_ops += 1;
            churn_refused += u64::from(cluster.sdk_shutdown(NS, name).is_err());
        }
        for name in &mains {
            churn_ops += 1;
            churn_refused += u64::from(cluster.sdk_ready(NS, name).is_err());
        }
        cluster.scale_fleet(NS, "churn", 0)?;
        churn_ops += 1;
        tokio::time::sleep(Duration::from_millis(300)).await;
        round += 1;
    }
    tokio::time::sleep(WINDOW.saturating_sub(t.elapsed())).await;
    let c1 = journal.traffic();
    let churn_cpu = process_cpu() - cpu0;
    stop_unfiltered.cancel();
    let mut redis_reconnects = 0.0;
    for a in &agents {
        redis_reconnects +=
            metric(&a.metrics().await, "lastcall_redis_reconnects_total", &[]).unwrap_or(0.0);
    }

    let steady_all = spread(&s1, &s0, 0..LOAD_NODES);
    let steady_u = spread(&s1, &s0, UNINVOLVED);
    let churn_u = spread(&c1, &c0, UNINVOLVED);
    let churn_c = spread(&c1, &c0, CHURN_NODES);
    let observed = format!("agent-{}", node_name(30));
    let drain_self = delta(&d1, &d0, &drained_identity);
    let drain_gained = spread(&d1, &d0, gained.iter().copied());
    let drain_others = spread(&d1, &d0, (1..LOAD_NODES).filter(|i| !gained.contains(i)));

    println!();
    println!(
        "## 3. API load: {LOAD_NODES} nodes × {LOAD_PER_NODE} game servers ({total}, {LOAD_ALLOCATED} Allocated per node), {LOAD_NODES} in-process agents"
    );
    println!();
    println!(
        "Setup: 1,000 Ready after {:.1} s, all claimed by their agents after {:.1} s.",
        ready_after.as_secs_f64(),
        claimed_after.as_secs_f64()
    );
    println!(
        "Drain of {drained}, {:.0} s after the agents started: the DRAINING PUBLISH reached {receivers} subscriber(s); taint visible after {}, every Ready server released after {}.",
        (drain_t0 - agents_started).as_secs_f64(),
        ms(fence_seen.taint - drain_t0),
        ms(fence_seen.released - drain_t0)
    );
    println!(
        "Redis reconnects, summed over the {LOAD_NODES} agents: {}.",
        redis_reconnects
    );
    println!(
        "Process CPU, cluster model alone and idle (before the agents start): {:.2} s per 5 s.",
        model_idle_cpu.as_secs_f64()
    );
    println!(
        "Process CPU (emulator + cluster model + {LOAD_NODES} agents + this bench): steady {:.2} s per {} s window, drain {:.2} s over {:.1} s, churn {:.2} s per {} s.",
        steady_cpu.as_secs_f64(),
        WINDOW.as_secs(),
        drain_cpu.as_secs_f64(),
        drain_window.as_secs_f64(),
        churn_cpu.as_secs_f64(),
        WINDOW.as_secs()
    );
    println!();
    println!(
        "| who, window | requests (mean / max) | watch events (mean / max) | bytes (mean / max) |"
    );
    println!("|---|---|---|---|");
    println!(
        "| all {LOAD_NODES} agents, steady {} s | {} |",
        WINDOW.as_secs(),
        fmt_spread(&steady_all)
    );
    println!(
        "| draining agent ({drained}), drain ({:.1} s to done, {:.1} s window) | {} |",
        drain_done.as_secs_f64(),
        drain_window.as_secs_f64(),
        fmt_traffic(&drain_self)
    );
    println!(
        "| {} agents that received a replacement, drain window | {} |",
        gained.len(),
        fmt_spread(&drain_gained)
    );
    println!(
        "| {} other agents, drain window | {} |",
        LOAD_NODES - 1 - gained.len(),
        fmt_spread(&drain_others)
    );
    println!(
        "| uninvolved agents (node{:02}–node{:02}), steady {} s | {} |",
        UNINVOLVED.start,
        UNINVOLVED.end - 1,
        WINDOW.as_secs(),
        fmt_spread(&steady_u)
    );
    println!(
        "| same uninvolved agents, churn {} s | {} |",
        WINDOW.as_secs(),
        fmt_spread(&churn_u)
    );
    println!(
        "| churning nodes' agents (node{:02}–node{:02}), churn {} s | {} |",
        CHURN_NODES.start,
        CHURN_NODES.end - 1,
        WINDOW.as_secs(),
        fmt_spread(&churn_c)
    );
    println!();
    println!("| one agent, node30 | requests | watch events | bytes |");
    println!("|---|---|---|---|");
    println!(
        "| steady {} s | {} |",
        WINDOW.as_secs(),
        fmt_traffic(&delta(&s1, &s0, &observed))
    );
    println!(
        "| churn elsewhere {} s ({churn_ops} churn writes, {churn_refused} refused) | {} |",
        WINDOW.as_secs(),
        fmt_traffic(&delta(&c1, &c0, &observed))
    );
    println!();
    println!("| baseline | requests | watch events | bytes |");
    println!("|---|---|---|---|");
    println!(
        "| unfiltered GameServer watch, steady {} s | {} |",
        WINDOW.as_secs(),
        fmt_traffic(&delta(&s1, &s0, "unfiltered-watch"))
    );
    println!(
        "| unfiltered GameServer watch, drain window | {} |",
        fmt_traffic(&delta(&d1, &d0, "unfiltered-watch"))
    );
    println!(
        "| unfiltered GameServer watch, churn {} s | {} |",
        WINDOW.as_secs(),
        fmt_traffic(&delta(&c1, &c0, "unfiltered-watch"))
    );
    println!(
        "| original: one cluster-wide GameServer LIST ({} items, {}) | {} | 0 | {} |",
        listed.items.len(),
        ms(list_time),
        list.requests,
        list.bytes
    );
    println!();
    println!("Draining agent's requests during the drain window, by verb:");
    println!();
    println!("| request | count |");
    println!("|---|---|");
    for (k, n) in &drain_verbs {
        println!("| {k} | {n} |");
    }
    for a in agents {
        a.stop().await?;
    }
    cluster.shutdown().await;
    Ok(())
}

// ---- 4. memory -------------------------------------------------------------------------

fn proc_kb(pid: u32, field: &str) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| {
            l.strip_prefix(field)?
                .strip_prefix(':')?
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse()
                .ok()
        })
        .with_context(|| format!("{field} missing from /proc/{pid}/status"))
}

fn mib(kb: u64) -> String {
    format!("{:.1} MiB", kb as f64 / 1024.0)
}

/// The agent binary with a clean environment: the given kubeconfig, static AWS credentials,
/// no instance metadata, no shared AWS config files.
fn agent_command(bin: &Path, kubeconfig: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(bin);
    cmd.env_clear()
        .env("KUBECONFIG", kubeconfig)
        .env("AWS_ACCESS_KEY_ID", "AKIDBENCH")
        .env("AWS_SECRET_ACCESS_KEY", "bench-secret")
        .env("AWS_REGION", "us-west-2")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env("AWS_CONFIG_FILE", "/nonexistent/lastcall-bench")
        .env("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/lastcall-bench")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    cmd
}

async fn wait_admin(port: u16, child: &mut Child) -> anyhow::Result<()> {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    try_eventually(
        "the lastcall-agent admin listener is up",
        Duration::from_secs(20),
        Duration::from_millis(10),
        || {
            let exited = child.try_wait();
            async move {
                match exited {
                    Ok(None) => (!scrape(addr).await.is_empty()).then_some(Ok(())),
                    Ok(Some(status)) => Some(Err(anyhow!("lastcall-agent exited early: {status}"))),
                    Err(e) => Some(Err(e.into())),
                }
            }
        },
    )
    .await?
}

/// SIGTERM, then wait (up to 10 s) for a clean exit.
async fn terminate(child: &mut Child) -> anyhow::Result<std::process::ExitStatus> {
    signal(child.id(), "TERM").await?;
    let exited = try_eventually(
        "lastcall-agent exits within 10 s of SIGTERM",
        Duration::from_secs(10),
        Duration::from_millis(20),
        || std::future::ready(child.try_wait().transpose()),
    )
    .await;
    match exited {
        Ok(status) => Ok(status?),
        Err(e) => {
            child.kill()?;
            Err(e.into())
        }
    }
}

async fn bench_memory() -> anyhow::Result<()> {
    let bin =
        tokio::task::spawn_blocking(|| shipped_binary("lastcall-agent", "lastcall-agent")).await?;
    let dir = tempfile::tempdir()?;

    // Baseline: idle, no API server (the kubeconfig points at a closed port), no FleetIQ.
    let dead = dir.path().join("dead.kubeconfig");
    std::fs::write(
        &dead,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: none\n  cluster:\n    server: \"http://127.0.0.1:{}\"\ncontexts:\n- name: none\n  context:\n    cluster: none\n    user: none\ncurrent-context: none\nusers:\n- name: none\n  user:\n    token: none\n",
            free_port()
        ),
    )?;
    let admin = free_port();
    let listen = format!("127.0.0.1:{admin}");
    let mut child = agent_command(
        &bin,
        &dead,
        &[
            "--node-name",
            "idle",
            "--listen",
            &listen,
            "--log-level",
            "warn",
        ],
    )
    .spawn()?;
    wait_admin(admin, &mut child).await?;
    let idle_start_rss = proc_kb(child.id(), "VmRSS")?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let idle_rss = proc_kb(child.id(), "VmRSS")?;
    let idle_hwm = proc_kb(child.id(), "VmHWM")?;
    let idle_anon = proc_kb(child.id(), "RssAnon")?;
    let idle_file = proc_kb(child.id(), "RssFile")?;
    terminate(&mut child).await?;

    // A full drain of a node with MEM_READY Ready + MEM_ALLOCATED Allocated servers.
    let cluster = Cluster::start(ClusterConfig::default()).await?;
    cluster.add_node(NodeSpec::new("m1"))?;
    let total = MEM_READY + MEM_ALLOCATED;
    cluster.create_fleet(FleetSpec::new("mem", total as i64).grace_seconds(1))?;
    cluster.wait_ready(NS, "mem", total).await?;
    let mut allocated = Vec::new();
    for _ in 0..MEM_ALLOCATED {
        let gs = cluster
            .allocate(&AllocationRequest::fleet(NS, "mem"))
            .await?
            .context("allocation found no Ready server")?;
        allocated.push(gs.name);
    }
    for n in ["m2", "m3"] {
        cluster.add_node(NodeSpec::new(n))?;
    }
    let gl = GameLiftEmulator::start().await?;
    gl.add_instances(GROUP, &[iid_of("m1")], InstanceStatus::Active);
    let redis = RedisServer::start().await?;
    let mut publisher = Publisher::new(&redis).await?;
    // Every source on: FleetIQ (Redis + GameLift), GCE metadata, AWS IMDS, the Node signals.
    let gce = GceMetadataEmulator::start().await?;
    let gce_url = gce.url();
    let imds = ImdsEmulator::start(&iid_of("m1"), "ip-10-0-0-1.ec2.internal").await?;
    let imds_url = imds.url();
    let kubeconfig = dir.path().join("agent.kubeconfig");
    cluster
        .emulator()
        .write_kubeconfig(&kubeconfig, "agent-m1")?;
    let admin = free_port();
    let listen = format!("127.0.0.1:{admin}");
    let iid = iid_of("m1");
    let url = redis.url();
    let gl_url = gl.url();
    let mut child = agent_command(
        &bin,
        &kubeconfig,
        &[
            "--node-name",
            "m1",
            "--listen",
            &listen,
            "--log-level",
            "warn",
            "--instance-id",
            &iid,
            "--game-server-group",
            GROUP,
            "--redis-url",
            &url,
            "--gamelift-endpoint",
            &gl_url,
            "--aws-region",
            "us-west-2",
            "--gce-metadata",
            "--gce-metadata-endpoint",
            &gce_url,
            "--aws-imds",
            "--imds-endpoint",
            &imds_url,
        ],
    )
    .spawn()?;
    let pid = child.id();
    let run = async {
        wait_admin(admin, &mut child).await?;
        subscribed(std::net::SocketAddr::from(([127, 0, 0, 1], admin))).await?;
        until(
            "registered and claimed",
            Duration::from_secs(20),
            Duration::from_millis(20),
            || {
                let registered = cluster
                    .node("m1")
                    .is_some_and(|n| annotation(&n, keys::ANN_REGISTERED).is_some());
                let claimed = on_node(&cluster, "m1")
                    .iter()
                    .all(|g| g.labels.get(keys::LABEL_NODE).map(String::as_str) == Some("m1"));
                (registered && claimed).then_some(())
            },
        )
        .await?;
        quiet(cluster.store(), Duration::from_millis(200)).await?;
        let before_drain = proc_kb(pid, "VmRSS")?;
        publisher.status(&iid, Status::Draining).await?;
        until(
            "Ready servers released and replaced",
            Duration::from_secs(30),
            Duration::from_millis(20),
            || {
                let here: Vec<GameServerView> = on_node(&cluster, "m1");
                let protected = here.len() == MEM_ALLOCATED
                    && here
                        .iter()
                        .all(|g| g.annotations.contains_key(keys::ANN_GS_DEADLINE));
                let elsewhere = cluster
                    .game_servers()
                    .iter()
                    .filter(|g| g.state == Some(S::Ready) && g.node.as_deref() != Some("m1"))
                    .count();
                (protected && elsewhere == MEM_READY).then_some(())
            },
        )
        .await?;
        for name in &allocated {
            cluster.sdk_shutdown(NS, name)?;
        }
        until(
            "deregistered",
            Duration::from_secs(30),
            Duration::from_millis(20),
            || {
                let node = cluster.node("m1")?;
                (gl.count("DeregisterGameServer") == 1
                    && annotation(&node, keys::ANN_DEREGISTERED).is_some())
                .then_some(())
            },
        )
        .await?;
        anyhow::Ok(before_drain)
    }
    .await;
    let hwm = proc_kb(pid, "VmHWM");
    let rss_end = proc_kb(pid, "VmRSS");
    let anon_end = proc_kb(pid, "RssAnon");
    let file_end = proc_kb(pid, "RssFile");
    let status = terminate(&mut child).await?;
    let before_drain = run?;
    let (hwm, rss_end, anon_end, file_end) = (hwm?, rss_end?, anon_end?, file_end?);
    ensure!(status.success(), "lastcall-agent exited with {status}");

    println!();
    println!(
        "## 4. Memory of the real lastcall-agent binary ({})",
        bin.display()
    );
    println!();
    println!("| measure | value |");
    println!("|---|---|");
    println!(
        "| idle, no API server: VmRSS when /metrics first answers | {} |",
        mib(idle_start_rss)
    );
    println!(
        "| idle, no API server: VmRSS / VmHWM 1 s later | {} / {} |",
        mib(idle_rss),
        mib(idle_hwm)
    );
    println!(
        "| drain of {total} game servers ({MEM_READY} Ready, {MEM_ALLOCATED} Allocated): VmRSS before the signal | {} |",
        mib(before_drain)
    );
    println!(
        "| same run: VmRSS after deregistration | {} |",
        mib(rss_end)
    );
    println!(
        "| of which anonymous (heap, stacks) / file-backed (the binary's pages) | {} / {} (idle: {} / {}) |",
        mib(anon_end),
        mib(file_end),
        mib(idle_anon),
        mib(idle_file)
    );
    println!(
        "| same run: peak RSS (VmHWM) through the whole drain | {} |",
        mib(hwm)
    );
    println!(
        "| peak / idle baseline (VmHWM) | {:.1}x |",
        hwm as f64 / idle_hwm.max(1) as f64
    );
    println!("| exit after SIGTERM | {status} |");
    cluster.shutdown().await;
    Ok(())
}
