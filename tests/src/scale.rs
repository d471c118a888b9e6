//! Scale mode: thousands of in-process agents on one emulated control plane.
//!
//! The Kubernetes API emulator runs as its own process (`lastcall-kube-emulator --admin`)
//! over a store-only world (`cluster::preload`: Nodes, bound Running pods and claimed
//! GameServers, no scheduler, kubelet or Agones controllers), so its CPU, memory and file
//! descriptors are measured apart from the agents'. The agents run in shard processes
//! ([`crate::scale_agents`], 500 agents each by default, so their file descriptors fit the
//! per-process limit), one identity and one set of server-side filtered watches each,
//! built by [`crate::agent::InProcessAgent::start`] exactly as the binary builds them, in
//! FleetIQ mode against one GameLift emulator and one private `redis-server`.
//!
//! Around them, in the harness's process on a side runtime whose threads are named
//! [`SIDE_THREAD`] (its CPU is reported apart): the GameLift emulator, and the background
//! load a real
//! cluster makes: kubelet Node status updates (every node every `node_status_period`),
//! pod churn (short-lived non-game pods bound to random nodes), Agones GameServer writes
//! (SDK annotations on Allocated servers), the garbage collection of the pods of deleted
//! GameServers, allocators racing drains, and matches ending.
//!
//! Measurements come from the emulator's journal and APF counters (read over its admin
//! endpoints), GameLift's call log, `/proc` (the shard and emulator processes' CPU, RSS and
//! file descriptors, the side runtime's threads) and Redis `INFO`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context as _, anyhow, ensure};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use lastcall_common::fleetiq::{InstanceStatus as Status, StatusMessage};
use rand::Rng;
use serde_json::json;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::agent::{metric, scrape};
use crate::cluster::allocator::gameserver_resource;
use crate::cluster::preload::{LABEL_NODE, NAMESPACE, node_name, node_of, server_name};
use crate::eventually::try_eventually;
use crate::gamelift::{GameLiftEmulator, InstanceStatus};
use crate::kube::admin::RemoteJournal;
use crate::kube::{JournalEntry, Traffic, Verb, config_for_url};
use crate::promises::allocation::{allocations, deleted_after_allocation, late_allocations};
use crate::scale_agents::{SHARD_AGENTS, Shard, ShardSpec, shard_ranges};
use crate::scale_redis::{ScaleRedis, parse_cluster};

/// The game server group every scale agent belongs to.
pub const GROUP: &str = "scale-group";
/// Name prefix of the side runtime's threads (GameLift emulator, load generators).
pub const SIDE_THREAD: &str = "side";
const DRAINING_LABEL: &str = "lastcall.dev/node-draining";

/// API Priority and Fairness in the emulator (`lastcall-kube-emulator --apf-*`): the
/// limits one priority level gives every agent, each agent its own flow.
///
/// The emulator answers in well under a millisecond, so its seats alone would never run
/// out; the admission rate stands for the share of the API server's throughput the level
/// gets. Refusals are journaled (429) and counted by [`DrainReport::status_429`].
#[derive(Clone, Debug)]
pub struct ApfOptions {
    /// Requests served at once over all users (`--apf-concurrency`).
    pub seats: usize,
    /// Requests admitted per second over all users (`--apf-rate`; 0: no rate limit).
    pub rate: f64,
    /// Requests one user may have waiting (`--apf-queue-per-flow`).
    pub queue_per_flow: usize,
    /// The `Retry-After` of every refusal, in seconds.
    pub retry_after_secs: u64,
}

impl ApfOptions {
    /// kube-apiserver's defaults as seen by a ServiceAccount: 600 seats (400 read-only +
    /// 200 mutating) of which `workload-low` (100 of 245 nominal shares) gets 245; queues
    /// of 50.
    pub fn workload_low(rate: f64) -> Self {
        ApfOptions {
            seats: 245,
            rate,
            queue_per_flow: 50,
            retry_after_secs: 1,
        }
    }

    fn emulator_args(&self) -> Vec<String> {
        vec![
            "--apf-concurrency".into(),
            self.seats.to_string(),
            "--apf-rate".into(),
            self.rate.to_string(),
            "--apf-queue-per-flow".into(),
            self.queue_per_flow.to_string(),
            "--apf-retry-after-secs".into(),
            self.retry_after_secs.to_string(),
        ]
    }
}

/// The size and background load of a scale world.
#[derive(Clone, Debug)]
pub struct ScaleSpec {
    /// Nodes, one agent each.
    pub agents: usize,
    pub servers_per_node: usize,
    pub allocated_per_node: usize,
    /// Every node's status is written this often (the kubelet's `nodeStatusUpdateFrequency`).
    pub node_status_period: Duration,
    /// Short-lived non-game pods created (and deleted a few seconds later) per second.
    pub pod_churn_per_sec: f64,
    /// Agones GameServer writes (SDK annotations on Allocated servers) per second.
    pub gameserver_writes_per_sec: f64,
    /// Concurrent allocator loops during drains.
    pub allocators: usize,
    /// Unfiltered watchers started as a sample for the comparison.
    pub unfiltered_sample: usize,
    /// `None`: the emulator admits every request.
    pub apf: Option<ApfOptions>,
    /// Agones 1.58 or later: the agents select their GameServers by `status.nodeName`
    /// (`LASTCALL_SCALE_AGONES_FIELDS=0`: an older Agones, by label).
    pub agones_selectable_fields: bool,
    /// A Redis Cluster of (primaries, replicas each) instead of one redis-server
    /// (`LASTCALL_SCALE_REDIS_CLUSTER=3x1`).
    pub redis_cluster: Option<(usize, usize)>,
}

impl ScaleSpec {
    /// `agents` nodes of 20 servers (5 Allocated) under a 10 s kubelet cadence, with pod
    /// churn and GameServer writes that grow with the cluster.
    pub fn new(agents: usize) -> Self {
        ScaleSpec {
            agents,
            servers_per_node: 20,
            allocated_per_node: 5,
            node_status_period: Duration::from_secs(10),
            pod_churn_per_sec: (agents as f64 / 100.0).max(1.0),
            gameserver_writes_per_sec: (agents as f64 / 20.0).max(1.0),
            allocators: 8,
            unfiltered_sample: 5,
            apf: Some(ApfOptions::workload_low(1000.0)),
            agones_selectable_fields: true,
            redis_cluster: None,
        }
    }

    /// [`ScaleSpec::new`] with `LASTCALL_SCALE_AGENTS`, `LASTCALL_SCALE_SERVERS`,
    /// `LASTCALL_SCALE_ALLOCATED`, `LASTCALL_SCALE_UNFILTERED` and
    /// `LASTCALL_SCALE_AGONES_FIELDS` applied when set.
    pub fn from_env(default_agents: usize) -> Self {
        let var = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<usize>().ok());
        let mut s = ScaleSpec::new(var("LASTCALL_SCALE_AGENTS").unwrap_or(default_agents));
        if let Some(n) = var("LASTCALL_SCALE_SERVERS") {
            s.servers_per_node = n;
        }
        if let Some(n) = var("LASTCALL_SCALE_ALLOCATED") {
            s.allocated_per_node = n;
        }
        if let Some(n) = var("LASTCALL_SCALE_UNFILTERED") {
            s.unfiltered_sample = n;
        }
        if let Some(n) = var("LASTCALL_SCALE_AGONES_FIELDS") {
            s.agones_selectable_fields = n != 0;
        }
        if let Ok(c) = std::env::var("LASTCALL_SCALE_REDIS_CLUSTER") {
            s.redis_cluster = parse_cluster(&c);
        }
        if let Some(rate) = std::env::var("LASTCALL_SCALE_APF_RATE")
            .ok()
            .and_then(|v| v.parse::<f64>().ok())
        {
            // A negative rate turns APF off; 0 keeps the seats without a rate limit.
            s.apf = (rate >= 0.0).then(|| ApfOptions::workload_low(rate));
        }
        s
    }
}

/// CPU time (user + system) of the threads of this process, summed by name, from
/// `/proc/self/task/*/stat` (100 Hz ticks).
pub fn thread_cpu() -> HashMap<String, Duration> {
    let mut out: HashMap<String, Duration> = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for t in dir.flatten() {
        let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else {
            continue;
        };
        if let Some((name, cpu)) = parse_stat(&stat) {
            *out.entry(name).or_default() += cpu;
        }
    }
    out
}

/// (comm, utime + stime) of a `/proc/.../stat` line.
fn parse_stat(stat: &str) -> Option<(String, Duration)> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let name = stat.get(open + 1..close)?.to_string();
    let f: Vec<&str> = stat.get(close + 1..)?.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some((name, Duration::from_millis(ticks * 10)))
}

/// CPU time of process `pid` (`"self"` for this one).
pub fn process_cpu(pid: &str) -> Duration {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| parse_stat(&s))
        .map(|(_, d)| d)
        .unwrap_or_default()
}

/// A `/proc/<pid>/status` field in kB (`VmRSS`, `VmHWM`).
pub fn status_kb(pid: &str, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix(field)?
                    .trim_start_matches(':')
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse()
                    .ok()
            })
        })
        .unwrap_or(0)
}

/// Open file descriptors of process `pid`.
pub fn open_fds(pid: &str) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Sum of per-identity traffic whose identity starts with `prefix`, between two snapshots.
pub fn traffic_delta(
    after: &HashMap<Option<String>, Traffic>,
    before: &HashMap<Option<String>, Traffic>,
    pred: impl Fn(&str) -> bool,
) -> Traffic {
    let mut t = Traffic::default();
    for (id, a) in after {
        let Some(id) = id else { continue };
        if !pred(id) {
            continue;
        }
        let b = before.get(&Some(id.clone())).copied().unwrap_or_default();
        t.requests += a.requests - b.requests;
        t.watch_events += a.watch_events - b.watch_events;
        t.bytes += a.bytes - b.bytes;
    }
    t
}

/// The emulator's `Retry-After` ([`ApfOptions::retry_after_secs`] is 1), which the load
/// generators wait out after a 429.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// How long a load generator waits after `e`: a 429 asks for the emulator's `Retry-After`
/// (1 s), as client-go honours it; anything else for `otherwise`.
fn pause_after(e: &kube::Error, otherwise: Duration) -> Duration {
    match e {
        kube::Error::Api(s) if s.code == 429 => RETRY_AFTER,
        _ => otherwise,
    }
}

/// Deletes `name`, waiting out each 429 ([`RETRY_AFTER`]) and trying again, as a client-go
/// controller does. Returns how many times it was refused, and the outcome.
async fn delete_waiting_out_429<K>(
    api: &Api<K>,
    name: &str,
    params: &DeleteParams,
) -> (u64, kube::Result<()>)
where
    K: Clone + k8s_openapi::serde::de::DeserializeOwned + std::fmt::Debug,
{
    let mut refused = 0;
    loop {
        match api.delete(name, params).await {
            Err(kube::Error::Api(s)) if s.code == 429 => {
                refused += 1;
                tokio::time::sleep(RETRY_AFTER).await;
            }
            r => return (refused, r.map(|_| ())),
        }
    }
}

/// The Agones controller's workers ending matches (its Helm chart's
/// `agones.controller.numWorkers`, 100): the deletes of a drain's ended matches wait for
/// one, as a real controller's work queue holds them.
const MATCH_END_WORKERS: usize = 100;

/// Whether a journal identity is one of the scale agents.
pub fn is_agent(identity: &str) -> bool {
    identity.starts_with("agent-")
}

/// The emulator child process; killed on drop.
struct EmulatorProcess {
    child: Child,
    url: String,
}

impl Drop for EmulatorProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_emulator(spec: &ScaleSpec) -> anyhow::Result<EmulatorProcess> {
    use std::io::BufRead as _;
    let bin = crate::bins::try_workspace_binary("lastcall-emulators", "lastcall-kube-emulator")?;
    let mut cmd = Command::new(bin);
    cmd.args([
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "--history",
        "50000",
        "--bookmark-interval-secs",
        "60",
        "--preload-nodes",
        &spec.agents.to_string(),
        "--preload-servers-per-node",
        &spec.servers_per_node.to_string(),
        "--preload-allocated-per-node",
        &spec.allocated_per_node.to_string(),
    ]);
    if let Some(apf) = &spec.apf {
        cmd.args(apf.emulator_args());
    }
    if spec.agones_selectable_fields {
        cmd.arg("--agones-selectable-fields");
    }
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting lastcall-kube-emulator")?;
    let stdout = child.stdout.take().context("emulator stdout")?;
    let mut line = String::new();
    std::io::BufReader::new(stdout)
        .read_line(&mut line)
        .context("reading the emulator's URL")?;
    let url = line.trim().to_string();
    ensure!(url.starts_with("http://"), "emulator printed {url:?}");
    Ok(EmulatorProcess { child, url })
}

/// A progress line on stderr (a scale run takes minutes).
fn progress(what: &str) {
    eprintln!("[scale] {what}");
}

/// The running world.
pub struct ScaleWorld {
    pub spec: ScaleSpec,
    emulator: EmulatorProcess,
    pub journal: RemoteJournal,
    pub gl: GameLiftEmulator,
    pub redis: ScaleRedis,
    /// The agents' processes.
    pub shards: Vec<Shard>,
    /// Always `Some` until dropped: shut down in the background, since a world is dropped
    /// inside an async context.
    side: Option<tokio::runtime::Runtime>,
    stop: CancellationToken,
    /// Writes the background generators made, by kind.
    pub generated: Arc<Generated>,
    /// Servers won by allocators over the whole run, with when (their matches end when
    /// their node drains).
    pub won: Arc<std::sync::Mutex<Vec<(String, SystemTime)>>>,
    /// Setup phases (name, seconds).
    pub setup: Vec<(String, f64)>,
    /// The shard processes' RSS (kB, summed) before their agents started and once they had
    /// settled, and their open file descriptors then.
    pub rss_before_agents: u64,
    pub rss_with_agents: u64,
    pub fds_with_agents: usize,
}

/// Counters of the background generators.
#[derive(Default, Debug)]
pub struct Generated {
    pub node_status: AtomicU64,
    pub pods_created: AtomicU64,
    pub pods_deleted: AtomicU64,
    pub gameserver_writes: AtomicU64,
    pub gc_deletes: AtomicU64,
    /// Garbage-collector deletes refused with 429 (then retried).
    pub gc_throttled: AtomicU64,
    /// Times the garbage collector's GameServer watch listed again (after the first).
    pub gc_relists: AtomicU64,
    /// Pods of servers whose DELETE the watch never showed (found missing on a relist).
    pub gc_found_on_relist: AtomicU64,
    pub matches_ended: AtomicU64,
    pub errors: AtomicU64,
}

/// The GameLift instance id of node `i`.
pub fn iid(i: usize) -> String {
    crate::gamelift::instance_id(&node_name(i))
}

fn status_body(i: usize, s: Status) -> String {
    StatusMessage {
        group_name: Some(GROUP.into()),
        group_arn: Some(GameLiftEmulator::group_arn(GROUP)),
        instance_id: iid(i),
        status: s,
    }
    .to_python_json()
}

impl ScaleWorld {
    /// Starts the emulator process, GameLift, Redis, the background load and every agent,
    /// and returns once every agent is subscribed and has registered.
    pub async fn start(spec: ScaleSpec) -> anyhow::Result<ScaleWorld> {
        let mut setup = vec![];
        let t = Instant::now();
        let spec2 = spec.clone();
        let emulator = tokio::task::spawn_blocking(move || start_emulator(&spec2)).await??;
        setup.push((
            "emulator up, world preloaded".to_string(),
            t.elapsed().as_secs_f64(),
        ));
        progress(&format!("emulator up at {}", emulator.url));
        let journal = RemoteJournal::new(&emulator.url);
        let side = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name(SIDE_THREAD)
            .enable_all()
            .build()?;
        let gl = side.spawn(GameLiftEmulator::start()).await??;
        let side = Some(side);
        let ids: Vec<String> = (0..spec.agents).map(iid).collect();
        gl.add_instances(GROUP, &ids, InstanceStatus::Active);
        let redis = ScaleRedis::start(spec.redis_cluster).await?;
        let stop = CancellationToken::new();
        let generated = Arc::new(Generated::default());
        let mut world = ScaleWorld {
            spec,
            emulator,
            journal,
            gl,
            redis,
            shards: vec![],
            side,
            stop,
            generated,
            won: Arc::default(),
            setup,
            rss_before_agents: 0,
            rss_with_agents: 0,
            fds_with_agents: 0,
        };
        world.start_background().await?;
        // Pubsub's cache: every instance ACTIVE before its agent starts.
        let mut conn = world.redis.conn().await?;
        let keys = world.redis.keys();
        for i in 0..world.spec.agents {
            let _: () = redis::cmd("SET")
                .arg(keys.status(&iid(i)))
                .arg(status_body(i, Status::Active))
                .query_async(&mut conn)
                .await?;
        }
        let t = Instant::now();
        let per_shard = std::env::var("LASTCALL_SCALE_SHARD")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(SHARD_AGENTS);
        let gamelift_url = world.gl.url();
        let redis_url = world.redis.url();
        for (from, to) in shard_ranges(world.spec.agents, per_shard) {
            let shard = Shard::spawn(&ShardSpec {
                kube_url: world.emulator.url.clone(),
                gamelift_url: gamelift_url.clone(),
                redis_url: redis_url.clone(),
                from,
                to,
                aws_queue: false,
            })
            .await
            .with_context(|| format!("agents {from}..{to}"))?;
            world.shards.push(shard);
        }
        world.rss_before_agents = world.shards.iter().map(|s| s.rss_before_kb).sum();
        world
            .setup
            .push(("agents started".into(), t.elapsed().as_secs_f64()));
        progress(&format!(
            "agents started in {} processes",
            world.shards.len()
        ));
        for (_, admin) in world.shards.iter().flat_map(|s| &s.admins) {
            try_eventually(
                "an agent subscribes to Redis",
                Duration::from_secs(300),
                Duration::from_millis(100),
                || async {
                    (metric(&scrape(*admin).await, "lastcall_redis_connected", &[]) == Some(1.0))
                        .then_some(())
                },
            )
            .await?;
        }
        progress("agents subscribed to Redis");
        let n = world.spec.agents;
        let gl = &world.gl;
        try_eventually(
            "every agent registered with GameLift",
            Duration::from_secs(300),
            Duration::from_millis(250),
            || async {
                let registered: HashSet<String> = gl
                    .calls()
                    .into_iter()
                    .filter(|c| c.op == "RegisterGameServer" && c.outcome == "ok")
                    .filter_map(|c| c.input["InstanceId"].as_str().map(str::to_string))
                    .collect();
                (registered.len() >= n).then_some(())
            },
        )
        .await
        .map_err(|e| {
            // Say how far registration got, and how GameLift answered.
            let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
            let mut registered = HashSet::new();
            for c in gl.calls() {
                if c.op == "RegisterGameServer" && c.outcome == "ok" {
                    registered.insert(c.input["InstanceId"].as_str().map(str::to_string));
                }
                *outcomes
                    .entry(format!("{} {}", c.op, c.outcome))
                    .or_default() += 1;
            }
            anyhow::Error::from(e).context(format!(
                "{} of {n} agents registered; GameLift calls by outcome: {outcomes:?}",
                registered.len()
            ))
        })?;
        world.setup.push((
            "agents subscribed and registered".into(),
            t.elapsed().as_secs_f64(),
        ));
        progress("agents subscribed and registered");
        world
            .settle(Duration::from_secs(2), Duration::from_secs(120))
            .await?;
        world.rss_with_agents = world.agent_rss_kb();
        world.fds_with_agents = world.agent_fds();
        Ok(world)
    }

    pub fn url(&self) -> &str {
        &self.emulator.url
    }

    /// The shard processes' RSS, in kB, summed.
    pub fn agent_rss_kb(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| status_kb(&s.pid(), "VmRSS"))
            .sum()
    }

    /// The shard processes' open file descriptors, summed.
    pub fn agent_fds(&self) -> usize {
        self.shards.iter().map(|s| open_fds(&s.pid())).sum()
    }

    pub fn emulator_pid(&self) -> String {
        self.emulator.child.id().to_string()
    }

    /// Waits until the agents have made no request for `quiet`.
    pub async fn settle(&self, quiet: Duration, limit: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + limit;
        let agent_requests = |t: &HashMap<Option<String>, Traffic>| -> u64 {
            t.iter()
                .filter(|(id, _)| id.as_deref().is_some_and(is_agent))
                .map(|(_, t)| t.requests)
                .sum()
        };
        let mut last = agent_requests(&self.journal.traffic().await?);
        loop {
            tokio::time::sleep(quiet).await;
            let now = agent_requests(&self.journal.traffic().await?);
            if now == last {
                return Ok(());
            }
            ensure!(
                Instant::now() < deadline,
                "the agents did not settle within {limit:?}"
            );
            last = now;
        }
    }

    async fn client(&self, identity: &str) -> anyhow::Result<kube::Client> {
        Ok(kube::Client::try_from(
            config_for_url(&self.emulator.url, identity).await?,
        )?)
    }

    /// The background generators: kubelet Node status, pod churn, GameServer writes and the
    /// pod garbage collector, on the side runtime until [`ScaleWorld::shutdown`].
    async fn start_background(&self) -> anyhow::Result<()> {
        let n = self.spec.agents;
        let stop = self.stop.clone();
        let g = self.generated.clone();

        // kubelet: every node's status every period, spread evenly.
        let kubelet = self.client("kubelet").await?;
        let period = self.spec.node_status_period;
        let (stop1, g1) = (stop.clone(), g.clone());
        self.side().spawn(async move {
            let nodes: Api<Node> = Api::all(kubelet);
            let limit = Arc::new(Semaphore::new(32));
            let mut tick = tokio::time::interval(period / n.max(1) as u32);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut i = 0usize;
            loop {
                tokio::select! {
                    () = stop1.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let Ok(permit) = limit.clone().acquire_owned().await else {
                    return;
                };
                let (nodes, g) = (nodes.clone(), g1.clone());
                let name = node_name(i % n);
                i += 1;
                tokio::spawn(async move {
                    let now = crate::kube::store::now_rfc3339();
                    let patch = json!({"status": {"conditions": [{
                        "type": "Ready", "status": "True", "reason": "KubeletReady",
                        "message": "kubelet is posting ready status",
                        "lastHeartbeatTime": now,
                    }]}});
                    match nodes
                        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                    {
                        Ok(_) => g.node_status.fetch_add(1, Ordering::Relaxed),
                        Err(_) => g.errors.fetch_add(1, Ordering::Relaxed),
                    };
                    drop(permit);
                });
            }
        });

        // Pod churn: a short-lived non-game pod bound to a random node, deleted 5 s later.
        let churn = self.client("pod-churn").await?;
        let rate = self.spec.pod_churn_per_sec;
        let (stop2, g2) = (stop.clone(), g.clone());
        self.side().spawn(async move {
            let pods: Api<Pod> = Api::namespaced(churn, "batch");
            let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut k = 0u64;
            loop {
                tokio::select! {
                    () = stop2.cancelled() => return,
                    _ = tick.tick() => {}
                }
                k += 1;
                let node = node_name(rand::rng().random_range(0..n));
                let name = format!("job-{k}");
                let pod: Pod = match serde_json::from_value(json!({
                    "metadata": {"name": name, "namespace": "batch", "labels": {"app": "job"}},
                    "spec": {"nodeName": node, "restartPolicy": "Never",
                             "containers": [{"name": "job", "image": "job"}]},
                })) {
                    Ok(p) => p,
                    Err(_) => continue,
                };
                let (pods, g) = (pods.clone(), g2.clone());
                tokio::spawn(async move {
                    if pods.create(&PostParams::default(), &pod).await.is_err() {
                        g.errors.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                    g.pods_created.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    match pods
                        .delete(&name, &DeleteParams::default().grace_period(0))
                        .await
                    {
                        Ok(_) => g.pods_deleted.fetch_add(1, Ordering::Relaxed),
                        Err(_) => g.errors.fetch_add(1, Ordering::Relaxed),
                    };
                });
            }
        });

        // Agones: SDK annotations on Allocated servers (a status write per match event).
        let agones = self.client("agones-controller").await?;
        let rate = self.spec.gameserver_writes_per_sec;
        let allocated = self.spec.allocated_per_node.max(1);
        let (stop3, g3) = (stop.clone(), g.clone());
        let agones3 = agones.clone();
        self.side().spawn(async move {
            let gss: Api<DynamicObject> =
                Api::namespaced_with(agones3, NAMESPACE, &gameserver_resource());
            let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut round = 0u64;
            loop {
                tokio::select! {
                    () = stop3.cancelled() => return,
                    _ = tick.tick() => {}
                }
                round += 1;
                let (i, k) = {
                    let mut r = rand::rng();
                    (r.random_range(0..n), r.random_range(0..allocated))
                };
                let (gss, g) = (gss.clone(), g3.clone());
                tokio::spawn(async move {
                    let patch = json!({"metadata": {"annotations": {
                        "agones.dev/sdk-round": round.to_string()}}});
                    match gss
                        .patch(
                            &server_name(i, k),
                            &PatchParams::default(),
                            &Patch::Merge(&patch),
                        )
                        .await
                    {
                        Ok(_) => g.gameserver_writes.fetch_add(1, Ordering::Relaxed),
                        // A server whose match ended is gone: not an error of the load.
                        Err(kube::Error::Api(s)) if s.code == 404 => 0,
                        Err(_) => g.errors.fetch_add(1, Ordering::Relaxed),
                    };
                });
            }
        });

        // Garbage collection: the pod of a deleted GameServer goes with it, deleted by the
        // controller manager's own identity (its own APF flow) with its default 20 workers
        // (`--concurrent-gc-syncs`), each retrying a 429 after its Retry-After as client-go
        // does.
        let (stop4, g4) = (stop, g);
        let gc = self.client("kube-controller-manager").await?;
        let (queue, rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        let rx = Arc::new(tokio::sync::Mutex::new(rx));
        let pods: Api<Pod> = Api::namespaced(gc, NAMESPACE);
        for _ in 0..20 {
            let (rx, pods, g) = (rx.clone(), pods.clone(), g4.clone());
            self.side().spawn(async move {
                loop {
                    let Some(name) = rx.lock().await.recv().await else {
                        return;
                    };
                    let (refused, r) = delete_waiting_out_429(
                        &pods,
                        &name,
                        &DeleteParams::default().grace_period(0),
                    )
                    .await;
                    g.gc_throttled.fetch_add(refused, Ordering::Relaxed);
                    match r {
                        Ok(()) | Err(kube::Error::Api(_)) => {
                            g.gc_deletes.fetch_add(1, Ordering::Relaxed)
                        }
                        Err(_) => g.errors.fetch_add(1, Ordering::Relaxed),
                    };
                }
            });
        }
        // The servers that exist, as the controller's informer knows them: a watch that
        // falls behind the watch cache (410) lists again, and a server deleted meanwhile
        // shows no DELETE; it is the one missing from the new list, and its pod goes too.
        let g5 = self.generated.clone();
        self.side().spawn(async move {
            let gss: Api<DynamicObject> = Api::all_with(agones, &gameserver_resource());
            let mut stream = std::pin::pin!(watcher(gss, watcher::Config::default()));
            let mut lists = 0u64;
            let mut known: HashSet<String> = HashSet::new();
            let mut relisted: Option<HashSet<String>> = None;
            loop {
                let ev = tokio::select! {
                    () = stop4.cancelled() => return,
                    ev = stream.next() => ev,
                };
                let Some(ev) = ev else { return };
                let gone: Vec<String> = match ev {
                    Ok(watcher::Event::Init) => {
                        if lists > 0 {
                            g5.gc_relists.fetch_add(1, Ordering::Relaxed);
                        }
                        lists += 1;
                        relisted = Some(HashSet::new());
                        vec![]
                    }
                    Ok(watcher::Event::InitApply(o)) => {
                        if let (Some(r), Some(n)) = (relisted.as_mut(), o.metadata.name) {
                            r.insert(n);
                        }
                        vec![]
                    }
                    Ok(watcher::Event::InitDone) => {
                        let now = relisted.take().unwrap_or_default();
                        let gone: Vec<String> = known.difference(&now).cloned().collect();
                        g5.gc_found_on_relist
                            .fetch_add(gone.len() as u64, Ordering::Relaxed);
                        known = now;
                        gone
                    }
                    Ok(watcher::Event::Apply(o)) => {
                        known.extend(o.metadata.name);
                        vec![]
                    }
                    Ok(watcher::Event::Delete(o)) => {
                        let n = o.metadata.name.unwrap_or_default();
                        known.remove(&n);
                        vec![n]
                    }
                    Err(_) => vec![],
                };
                for name in gone {
                    if queue.send(name).is_err() {
                        return;
                    }
                }
            }
        });
        Ok(())
    }

    /// Publishes `status` for every instance in `nodes` as pubsub does (SET, then
    /// PUBLISH), spread evenly over `over`. Returns when each was published.
    pub async fn publish(
        &self,
        nodes: &[usize],
        status: Status,
        over: Duration,
    ) -> anyhow::Result<BTreeMap<usize, SystemTime>> {
        let mut conn = self.redis.conn().await?;
        let keys = self.redis.keys();
        let mut at = BTreeMap::new();
        let start = Instant::now();
        let step = over / nodes.len().max(1) as u32;
        for (k, &i) in nodes.iter().enumerate() {
            let due = start + step * k as u32;
            tokio::time::sleep_until(due.into()).await;
            let body = status_body(i, status);
            let _: () = redis::cmd("SET")
                .arg(keys.status(&iid(i)))
                .arg(&body)
                .query_async(&mut conn)
                .await?;
            at.insert(i, SystemTime::now());
            let _: i64 = redis::cmd("PUBLISH")
                .arg(iid(i))
                .arg(&body)
                .query_async(&mut conn)
                .await?;
        }
        Ok(at)
    }

    /// Starts the allocators: each loop picks a doomed node half the time (any node
    /// otherwise), reads one of its servers and, if it is Ready and not labelled
    /// `lastcall.dev/node-draining`, updates it to Allocated with its resourceVersion, as
    /// Agones' allocator does from its informer cache with the exclusion selector.
    pub async fn start_allocators(&self, doomed: Arc<Vec<usize>>) -> anyhow::Result<Allocators> {
        let stop = self.stop.child_token();
        let client = self.client(ALLOCATOR).await?;
        let n = self.spec.agents;
        let per = self.spec.servers_per_node;
        let mut tasks = vec![];
        for _ in 0..self.spec.allocators {
            let gss: Api<DynamicObject> =
                Api::namespaced_with(client.clone(), NAMESPACE, &gameserver_resource());
            let (stop, doomed, won) = (stop.clone(), doomed.clone(), self.won.clone());
            tasks.push(self.side().spawn(async move {
                while !stop.is_cancelled() {
                    let (i, k) = {
                        let mut r = rand::rng();
                        let i = if r.random_bool(0.5) && !doomed.is_empty() {
                            doomed[r.random_range(0..doomed.len())]
                        } else {
                            r.random_range(0..n)
                        };
                        (i, r.random_range(0..per))
                    };
                    let name = server_name(i, k);
                    let mut gs = match gss.get(&name).await {
                        Ok(gs) => gs,
                        Err(e) => {
                            tokio::time::sleep(pause_after(&e, Duration::from_millis(10))).await;
                            continue;
                        }
                    };
                    let ready = gs.data["status"]["state"] == "Ready";
                    let excluded =
                        gs.metadata.labels.as_ref().is_some_and(|l| {
                            l.get(DRAINING_LABEL).map(String::as_str) == Some("true")
                        });
                    if !ready || excluded || gs.metadata.deletion_timestamp.is_some() {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        continue;
                    }
                    gs.data["status"]["state"] = json!("Allocated");
                    let mut pause = Duration::from_millis(20);
                    match gss.replace(&name, &PostParams::default(), &gs).await {
                        Ok(_) => won
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push((name, SystemTime::now())),
                        Err(e) => pause = pause_after(&e, pause),
                    }
                    tokio::time::sleep(pause).await;
                }
            }));
        }
        Ok(Allocators { stop, tasks })
    }

    /// Ends every match on `nodes` (the preloaded Allocated servers and those allocators
    /// won there) after a random 1–6 s each, as players finish: the GameServer is deleted
    /// and the garbage collector removes its pod.
    ///
    /// `allocated` adds servers the journal shows allocated (a write the API applied after
    /// its client gave up is a match all the same). A 429 is retried after its
    /// Retry-After: a match that never ends would keep its node from emptying. The deletes
    /// go through [`MATCH_END_WORKERS`] workers, as the Agones controller's work queue
    /// sends them, not one request per match at once.
    pub async fn end_matches(&self, nodes: &[usize], allocated: &[String]) -> anyhow::Result<()> {
        let client = self.client("agones-controller").await?;
        let gss: Api<DynamicObject> =
            Api::namespaced_with(client, NAMESPACE, &gameserver_resource());
        let doomed: HashSet<String> = nodes.iter().map(|&i| node_name(i)).collect();
        let mut names: Vec<String> = nodes
            .iter()
            .flat_map(|&i| (0..self.spec.allocated_per_node).map(move |k| server_name(i, k)))
            .collect();
        names.extend(
            self.won
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .filter(|(s, _)| node_of(s).is_some_and(|n| doomed.contains(n)))
                .map(|(s, _)| s.clone()),
        );
        names.extend(
            allocated
                .iter()
                .filter(|s| node_of(s).is_some_and(|n| doomed.contains(n)))
                .cloned(),
        );
        names.sort();
        names.dedup();
        let g = self.generated.clone();
        let workers = Arc::new(Semaphore::new(MATCH_END_WORKERS));
        for name in names {
            let (gss, g, workers) = (gss.clone(), g.clone(), workers.clone());
            let delay = Duration::from_millis(rand::rng().random_range(1000..6000));
            self.side().spawn(async move {
                tokio::time::sleep(delay).await;
                let Ok(_worker) = workers.acquire_owned().await else {
                    return;
                };
                match delete_waiting_out_429(&gss, &name, &DeleteParams::default())
                    .await
                    .1
                {
                    Ok(()) | Err(kube::Error::Api(_)) => {
                        g.matches_ended.fetch_add(1, Ordering::Relaxed)
                    }
                    Err(_) => g.errors.fetch_add(1, Ordering::Relaxed),
                };
            });
        }
        Ok(())
    }

    /// Instances GameLift recorded a successful `DeregisterGameServer` for.
    pub fn deregistered(&self) -> HashSet<String> {
        self.gl
            .calls()
            .into_iter()
            .filter(|c| c.op == "DeregisterGameServer" && c.outcome == "ok")
            .filter_map(|c| c.input["GameServerId"].as_str().map(str::to_string))
            .collect()
    }

    /// Runs one drain of `doomed` (node indices), signalled by FleetIQ DRAINING within
    /// `over`, with the allocators racing it and matches ending; waits until every doomed
    /// node is deregistered, and reads what happened from the journals.
    pub async fn drain(&self, doomed: Vec<usize>, over: Duration) -> anyhow::Result<DrainReport> {
        let start_seq = self.next_seq().await?;
        let cpu0 = self.cpu();
        let r0 = self.redis.info().await?;
        let apf0 = self.journal.apf().await?;
        let doomed = Arc::new(doomed);
        let allocators = self.start_allocators(doomed.clone()).await?;
        // Let the allocators warm up so the race is on when the signal lands.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let t0 = SystemTime::now();
        let started = Instant::now();
        let published = self.publish(&doomed, Status::Draining, over).await?;
        let mut peak_fds = self.agent_fds();
        // Matches end once their nodes are fenced (players finish their round).
        let fenced_all = async {
            try_eventually(
                "every doomed node fenced",
                Duration::from_secs(600),
                Duration::from_millis(500),
                || async {
                    let e = self
                        .journal
                        .entries_with_bodies_since(start_seq)
                        .await
                        .ok()?;
                    let fenced: HashSet<&str> = e.iter().filter_map(fenced_node).collect();
                    doomed
                        .iter()
                        .all(|&i| fenced.contains(node_name(i).as_str()))
                        .then_some(())
                },
            )
            .await
        };
        fenced_all.await?;
        let fenced_after = started.elapsed();
        progress(&format!("{} nodes fenced", doomed.len()));
        // Give the allocators a moment past the fences, then stop them and end the matches.
        tokio::time::sleep(Duration::from_secs(2)).await;
        allocators.stop().await;
        peak_fds = peak_fds.max(self.agent_fds());
        let allocated: Vec<String> = self
            .journal
            .entries_since(start_seq)
            .await?
            .into_iter()
            .filter(|r| {
                r.identity.as_deref() == Some(ALLOCATOR) && r.verb == Verb::Update && r.status < 300
            })
            .filter_map(|r| r.name)
            .collect();
        self.end_matches(&doomed, &allocated).await?;
        let ids: HashSet<String> = doomed.iter().map(|&i| iid(i)).collect();
        let drained = try_eventually(
            "every doomed node deregistered",
            Duration::from_secs(900),
            Duration::from_millis(500),
            || async {
                let d = self.deregistered();
                ids.iter().all(|i| d.contains(i)).then_some(())
            },
        )
        .await
        .map_err(|e| {
            let d = self.deregistered();
            let stuck: Vec<String> = doomed
                .iter()
                .filter(|&&i| !d.contains(&iid(i)))
                .map(|&i| node_name(i))
                .collect();
            anyhow::Error::from(e).context(format!("{} not deregistered: {stuck:?}", stuck.len()))
        });
        if let Err(e) = drained {
            // What keeps the first few: their servers and pods, from the store.
            let mut why = vec![];
            let client = self.client("harness").await?;
            let gss: Api<DynamicObject> =
                Api::namespaced_with(client.clone(), NAMESPACE, &gameserver_resource());
            let pods: Api<Pod> = Api::namespaced(client, NAMESPACE);
            let d = self.deregistered();
            for &i in doomed.iter().filter(|&&i| !d.contains(&iid(i))).take(3) {
                let node = node_name(i);
                let servers = gss
                    .list(&ListParams::default().labels(&format!("{LABEL_NODE}={node}")))
                    .await
                    .map(|l| {
                        l.items
                            .iter()
                            .map(|g| {
                                format!(
                                    "{}:{}",
                                    g.metadata.name.as_deref().unwrap_or("?"),
                                    g.data["status"]["state"].as_str().unwrap_or("?")
                                )
                            })
                            .collect::<Vec<_>>()
                    });
                let left = pods
                    .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
                    .await
                    .map(|l| l.items.len());
                why.push(format!("{node}: servers {servers:?}, pods {left:?}"));
            }
            return Err(e.context(why.join("; ")));
        }
        let done_after = started.elapsed();
        progress(&format!("{} nodes deregistered", doomed.len()));
        peak_fds = peak_fds.max(self.agent_fds());
        let cpu1 = self.cpu();
        let r1 = self.redis.info().await?;
        let entries = self.journal.entries_with_bodies_since(start_seq).await?;
        let apf1 = self.journal.apf().await?;
        let won = self.won.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut report = DrainReport::build(
            self.spec.agents,
            self.spec.allocated_per_node,
            &doomed,
            &published,
            t0,
            &entries,
            &won,
            fenced_after,
            done_after,
            cpu1.since(&cpu0),
            r1.cpu() - r0.cpu(),
            peak_fds,
        );
        report.apf_queued = apf1.queued_total.saturating_sub(apf0.queued_total);
        report.apf_peak_queued = apf1.peak_queued;
        Ok(report)
    }

    /// The sequence number the next journal entry will get: every request is one entry,
    /// numbered from 0.
    pub async fn next_seq(&self) -> anyhow::Result<u64> {
        Ok(self
            .journal
            .traffic()
            .await?
            .values()
            .map(|t| t.requests)
            .sum())
    }

    /// CPU so far: the emulator process, the agents' processes, this process and its side threads.
    pub fn cpu(&self) -> CpuSample {
        let threads = thread_cpu();
        let side: Duration = threads
            .iter()
            .filter(|(k, _)| k.starts_with(SIDE_THREAD))
            .map(|(_, v)| *v)
            .sum();
        CpuSample {
            emulator: process_cpu(&self.emulator_pid()),
            process: process_cpu("self"),
            agents: self.shards.iter().map(|s| process_cpu(&s.pid())).sum(),
            side,
        }
    }

    /// Stops the agents, the background load and the emulator.
    pub async fn shutdown(mut self) {
        self.stop.cancel();
        futures::future::join_all(
            std::mem::take(&mut self.shards)
                .into_iter()
                .map(|s| s.stop(Duration::from_secs(30))),
        )
        .await;
    }

    /// The side runtime (GameLift emulator, background load).
    fn side(&self) -> &tokio::runtime::Runtime {
        self.side
            .as_ref()
            .expect("the side runtime lives as long as the world")
    }
}

/// The running allocator loops.
pub struct Allocators {
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Allocators {
    /// Stops them and waits for the allocations in flight, so every match won is known.
    pub async fn stop(self) {
        self.stop.cancel();
        futures::future::join_all(self.tasks).await;
    }
}

impl Drop for ScaleWorld {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(rt) = self.side.take() {
            rt.shutdown_background();
        }
    }
}

/// The allocators' identity in the journal.
const ALLOCATOR: &str = "agones-allocator";

/// The Node `r` leaves fenced, when it is an accepted write of that node's own agent after
/// which the Node stands fenced (`promises::fence`; the first one is the fence).
fn fenced_node(r: &JournalEntry) -> Option<&str> {
    let node = r.identity.as_deref()?.strip_prefix("agent-")?;
    (r.name.as_deref() == Some(node) && crate::promises::fence::leaves_fenced(r, node))
        .then_some(node)
}

/// Each doomed node's own Node and GameServer entries (the servers by their names'
/// node), so the per-node promises read a node's few entries instead of all of them.
fn per_node(
    entries: &[JournalEntry],
    doomed: &HashMap<String, usize>,
) -> HashMap<String, Vec<JournalEntry>> {
    let mut out: HashMap<String, Vec<JournalEntry>> = HashMap::new();
    for r in entries {
        let node = match r.resource.as_deref() {
            Some("nodes") => r.name.as_deref(),
            Some("gameservers") => r.name.as_deref().and_then(node_of),
            _ => None,
        };
        if let Some(n) = node.filter(|n| doomed.contains_key(*n)) {
            out.entry(n.to_string()).or_default().push(r.clone());
        }
    }
    out
}

/// CPU counters at one moment.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuSample {
    /// The emulator process (user + system).
    pub emulator: Duration,
    /// The harness's process (side runtime, harness).
    pub process: Duration,
    /// The agents' shard processes, summed.
    pub agents: Duration,
    /// This process's side runtime (GameLift emulator, load generators).
    pub side: Duration,
}

impl CpuSample {
    pub fn since(&self, before: &CpuSample) -> CpuSample {
        CpuSample {
            emulator: self.emulator.saturating_sub(before.emulator),
            process: self.process.saturating_sub(before.process),
            agents: self.agents.saturating_sub(before.agents),
            side: self.side.saturating_sub(before.side),
        }
    }

    /// The agents' processes.
    pub fn agents(&self) -> Duration {
        self.agents
    }
}

/// What one drain showed.
#[derive(Debug)]
pub struct DrainReport {
    pub doomed: usize,
    /// Signal (the node's PUBLISH) → its agent's fence, per node.
    pub fence: Vec<Duration>,
    /// Signal → the agent's first request after it admitted by the API (journaled), per node.
    pub acted: Vec<Duration>,
    /// First PUBLISH → the last fence.
    pub last_fence: Duration,
    /// Start → every node fenced / every node deregistered (polled).
    pub fenced_after: Duration,
    pub done_after: Duration,
    /// Agent DELETEs of a GameServer after its allocation, or of a preloaded Allocated one.
    pub killed: Vec<String>,
    /// Allocations that came too late (`promises::allocation::late_allocations`): on a
    /// server after its agent marked it draining, or on a doomed node after its agent's
    /// first round of releases past the fence was answered (servers whose own DELETE failed
    /// excepted).
    pub late_allocations: Vec<String>,
    /// Allocations on doomed nodes after their fence (then protected by the agent).
    pub allocations_after_fence: usize,
    pub allocations: usize,
    pub requests: u64,
    pub agent_requests: u64,
    pub peak_rps: u64,
    pub peak_agent_rps: u64,
    pub event_writes: u64,
    pub agent_event_writes: u64,
    /// 429s in the journal (every user), and those sent to agents.
    pub status_429: u64,
    pub agent_429: u64,
    /// 429s by identity (`-` for none).
    pub refused_by: BTreeMap<String, u64>,
    /// Requests that waited in an APF queue during the drain, and the most that ever
    /// waited at once (since the emulator started).
    pub apf_queued: u64,
    pub apf_peak_queued: usize,
    pub conflicts_409: u64,
    pub agent_requests_by_kind: BTreeMap<String, u64>,
    pub cpu: CpuSample,
    pub redis_cpu: f64,
    pub peak_fds: usize,
    pub window: Duration,
}

impl DrainReport {
    /// What this drain broke of the agent's promises, one line each (empty: none): a match
    /// killed (an allocated server deleted by an agent), or an allocation that came too
    /// late (after its server was marked draining, or after its node's first round of
    /// releases past the fence was answered). The CI test and the bench fail on it.
    pub fn broken_promises(&self) -> Vec<String> {
        let mut out = vec![];
        if !self.killed.is_empty() {
            out.push(format!(
                "{} matches killed: {:?}",
                self.killed.len(),
                self.killed
            ));
        }
        if !self.late_allocations.is_empty() {
            out.push(format!(
                "{} allocations after the fence shut them out: {:?}",
                self.late_allocations.len(),
                self.late_allocations
            ));
        }
        if self.fence.len() != self.doomed {
            out.push(format!(
                "{} of {} doomed nodes fenced",
                self.fence.len(),
                self.doomed
            ));
        }
        out
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        _agents: usize,
        allocated_per_node: usize,
        doomed: &[usize],
        published: &BTreeMap<usize, SystemTime>,
        t0: SystemTime,
        entries: &[JournalEntry],
        _won: &[(String, SystemTime)],
        fenced_after: Duration,
        done_after: Duration,
        cpu: CpuSample,
        redis_cpu: f64,
        peak_fds: usize,
    ) -> DrainReport {
        let doomed_names: HashMap<String, usize> =
            doomed.iter().map(|&i| (node_name(i), i)).collect();
        let mut fence_at: HashMap<String, (u64, SystemTime)> = HashMap::new();
        for r in entries {
            if let Some(n) = fenced_node(r)
                && doomed_names.contains_key(n)
            {
                fence_at.entry(n.to_string()).or_insert((r.seq, r.at));
            }
        }
        // Each doomed agent's first request after its signal (how long the agent took to
        // act, apart from how long the API took to admit its fence).
        let mut first_request: HashMap<&str, SystemTime> = HashMap::new();
        for r in entries {
            let Some(node) = r
                .identity
                .as_deref()
                .and_then(|id| id.strip_prefix("agent-"))
            else {
                continue;
            };
            if let (Some(i), None) = (doomed_names.get(node), first_request.get(node))
                && published.get(i).is_some_and(|p| r.at >= *p)
            {
                first_request.insert(node, r.at);
            }
        }
        let mut fence = vec![];
        let mut acted = vec![];
        let mut last = t0;
        for (n, i) in &doomed_names {
            if let (Some((_, at)), Some(p)) = (fence_at.get(n), published.get(i)) {
                fence.push(at.duration_since(*p).unwrap_or_default());
                last = last.max(*at);
            }
            if let (Some(at), Some(p)) = (first_request.get(n.as_str()), published.get(i)) {
                acted.push(at.duration_since(*p).unwrap_or_default());
            }
        }
        let first_publish = published.values().min().copied().unwrap_or(t0);
        let by_agent = |r: &JournalEntry| r.identity.as_deref().is_some_and(is_agent);
        let on_gs = |r: &JournalEntry| r.resource.as_deref() == Some("gameservers");
        let allocation_count = allocations(entries, ALLOCATOR).len();
        let preallocated: HashSet<String> = doomed
            .iter()
            .flat_map(|&i| (0..allocated_per_node).map(move |k| server_name(i, k)))
            .collect();
        // Killed: deleted by an agent after its allocation, or a preloaded Allocated one.
        let mut killed: Vec<String> = deleted_after_allocation(entries, by_agent, ALLOCATOR)
            .into_iter()
            .filter_map(|(_, d)| d.name.clone())
            .collect();
        let preallocated_deleted: Vec<String> = entries
            .iter()
            .filter(|r| by_agent(r) && on_gs(r) && r.verb == Verb::Delete && r.status < 300)
            .filter_map(|r| r.name.clone())
            .filter(|n| preallocated.contains(n) && !killed.contains(n))
            .collect();
        killed.extend(preallocated_deleted);
        // Late: the allocations each doomed node's agent let through too late.
        let mut late = vec![];
        let mut after_fence = 0;
        for (node, mine) in per_node(entries, &doomed_names) {
            let agent = format!("agent-{node}");
            let on_node = |name: &str| node_of(name) == Some(node.as_str());
            late.extend(
                late_allocations(&mine, &agent, ALLOCATOR, &node, on_node)
                    .into_iter()
                    .map(|l| l.name),
            );
            if let Some((fseq, _)) = fence_at.get(&node) {
                after_fence += allocations(&mine, ALLOCATOR)
                    .iter()
                    .filter(|a| a.seq > *fseq)
                    .count();
            }
        }
        let second = |r: &JournalEntry| {
            r.at.duration_since(SystemTime::UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs()
        };
        let mut per_sec: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
        let mut by_kind: BTreeMap<String, u64> = BTreeMap::new();
        for r in entries {
            let e = per_sec.entry(second(r)).or_default();
            e.0 += 1;
            if by_agent(r) {
                e.1 += 1;
                *by_kind
                    .entry(format!(
                        "{} {}{}",
                        r.verb.as_str(),
                        r.resource.as_deref().unwrap_or("-"),
                        r.subresource
                            .as_deref()
                            .map(|s| format!("/{s}"))
                            .unwrap_or_default()
                    ))
                    .or_default() += 1;
            }
        }
        let is_event_write =
            |r: &JournalEntry| r.resource.as_deref() == Some("events") && r.verb.is_mutating();
        DrainReport {
            doomed: doomed.len(),
            fence,
            acted,
            last_fence: last.duration_since(first_publish).unwrap_or_default(),
            fenced_after,
            done_after,
            killed,
            late_allocations: late,
            allocations_after_fence: after_fence,
            allocations: allocation_count,
            requests: entries.len() as u64,
            agent_requests: entries.iter().filter(|r| by_agent(r)).count() as u64,
            peak_rps: per_sec.values().map(|v| v.0).max().unwrap_or(0),
            peak_agent_rps: per_sec.values().map(|v| v.1).max().unwrap_or(0),
            event_writes: entries.iter().filter(|r| is_event_write(r)).count() as u64,
            agent_event_writes: entries
                .iter()
                .filter(|r| by_agent(r) && is_event_write(r))
                .count() as u64,
            status_429: entries.iter().filter(|r| r.status == 429).count() as u64,
            agent_429: entries
                .iter()
                .filter(|r| by_agent(r) && r.status == 429)
                .count() as u64,
            refused_by: entries.iter().filter(|r| r.status == 429).fold(
                BTreeMap::new(),
                |mut m, r| {
                    let id = r.identity.as_deref().unwrap_or("-");
                    let id = if is_agent(id) { "agent-*" } else { id };
                    *m.entry(id.to_string()).or_default() += 1;
                    m
                },
            ),
            apf_queued: 0,
            apf_peak_queued: 0,
            conflicts_409: entries.iter().filter(|r| r.status == 409).count() as u64,
            agent_requests_by_kind: by_kind,
            cpu,
            redis_cpu,
            peak_fds,
            window: done_after,
        }
    }
}

/// What the steady state showed over one window.
#[derive(Debug)]
pub struct SteadyReport {
    pub window: Duration,
    pub agents: Traffic,
    /// Of the agents' requests, the WATCHes that renew a watch the server ended (kube's
    /// watcher asks for a 290 s timeout, then resumes from its last resourceVersion).
    pub agent_watch_renewals: u64,
    /// The agents' other requests (the promise: 0), by `verb resource`.
    pub agent_other_requests: BTreeMap<String, u64>,
    pub max_agent_requests: u64,
    pub all: Traffic,
    pub by_identity: BTreeMap<String, Traffic>,
    pub cpu: CpuSample,
    pub redis_cpu: f64,
    /// Each node's share of `redis_cpu`, largest first.
    pub redis_cpu_by_node: Vec<(u16, f64)>,
    pub republish: Duration,
}

impl ScaleWorld {
    /// One steady-state window of `window`, with one pubsub round (ACTIVE republished for
    /// every instance, as pubsub does every period) at its start.
    pub async fn steady(&self, window: Duration) -> anyhow::Result<SteadyReport> {
        let r0 = self.redis.info().await?;
        let t0 = self.journal.traffic().await?;
        let seq0 = self.next_seq().await?;
        let cpu0 = self.cpu();
        let start = Instant::now();
        let all: Vec<usize> = (0..self.spec.agents).collect();
        self.publish(&all, Status::Active, Duration::ZERO).await?;
        let republish = start.elapsed();
        tokio::time::sleep(window.saturating_sub(start.elapsed())).await;
        let t1 = self.journal.traffic().await?;
        let cpu1 = self.cpu();
        let r1 = self.redis.info().await?;
        let seq1 = self.next_seq().await?;
        let mut agent_watch_renewals = 0;
        let mut agent_other_requests = BTreeMap::new();
        for r in self.journal.entries_since(seq0).await? {
            if r.seq >= seq1 || !r.identity.as_deref().is_some_and(is_agent) {
                continue;
            }
            if r.verb == Verb::Watch {
                agent_watch_renewals += 1;
            } else {
                *agent_other_requests
                    .entry(format!(
                        "{} {}",
                        r.verb.as_str(),
                        r.resource.as_deref().unwrap_or("-")
                    ))
                    .or_default() += 1;
            }
        }
        let mut by_identity = BTreeMap::new();
        for id in t1.keys().flatten() {
            if is_agent(id) {
                continue;
            }
            let d = traffic_delta(&t1, &t0, |x| x == id);
            if d != Traffic::default() {
                by_identity.insert(id.clone(), d);
            }
        }
        let max_agent_requests = t1
            .keys()
            .flatten()
            .filter(|id| is_agent(id))
            .map(|id| traffic_delta(&t1, &t0, |x| x == id).requests)
            .max()
            .unwrap_or(0);
        Ok(SteadyReport {
            window,
            agents: traffic_delta(&t1, &t0, is_agent),
            agent_watch_renewals,
            agent_other_requests,
            max_agent_requests,
            all: traffic_delta(&t1, &t0, |_| true),
            by_identity,
            cpu: cpu1.since(&cpu0),
            redis_cpu: r1.cpu() - r0.cpu(),
            redis_cpu_by_node: r1.cpu_by_node_since(&r0),
            republish,
        })
    }
}

/// What a sample of agents without server-side filtering would cost.
#[derive(Debug)]
pub struct UnfilteredReport {
    pub sample: usize,
    /// Initial LIST + watch traffic per watcher until synced.
    pub sync: Traffic,
    pub sync_time: Duration,
    /// Per watcher over the window.
    pub window_traffic: Traffic,
    pub window: Duration,
    /// RSS growth of this process per watcher (kB), its caches held.
    pub rss_kb_each: u64,
}

impl ScaleWorld {
    /// `sample` watchers that keep every GameServer and every pod of the cluster in a
    /// reflector cache (what an agent without server-side filtering needs to find its own),
    /// measured over `window` of the same background load.
    pub async fn unfiltered(&self, window: Duration) -> anyhow::Result<UnfilteredReport> {
        use kube::runtime::reflector;
        let k = self.spec.unfiltered_sample.max(1);
        let rss0 = status_kb("self", "VmRSS");
        let t0 = self.journal.traffic().await?;
        let start = Instant::now();
        let stop = self.stop.child_token();
        let mut readers = vec![];
        for j in 0..k {
            let client = self.client(&format!("unfiltered-{j}")).await?;
            let gs_writer = reflector::store::Writer::new(gameserver_resource());
            let gs_reader2 = gs_writer.as_reader();
            let gs_api: Api<DynamicObject> = Api::all_with(client.clone(), &gameserver_resource());
            let (pod_reader, pod_writer) = reflector::store::<Pod>();
            let pod_api: Api<Pod> = Api::all(client);
            let stop1 = stop.clone();
            tokio::spawn(async move {
                let s =
                    reflector::reflector(gs_writer, watcher(gs_api, watcher::Config::default()));
                let mut s = std::pin::pin!(s);
                loop {
                    tokio::select! {
                        () = stop1.cancelled() => return,
                        n = s.next() => if n.is_none() { return },
                    }
                }
            });
            let stop2 = stop.clone();
            tokio::spawn(async move {
                let s =
                    reflector::reflector(pod_writer, watcher(pod_api, watcher::Config::default()));
                let mut s = std::pin::pin!(s);
                loop {
                    tokio::select! {
                        () = stop2.cancelled() => return,
                        n = s.next() => if n.is_none() { return },
                    }
                }
            });
            readers.push((gs_reader2, pod_reader));
        }
        for (g, p) in &readers {
            g.wait_until_ready().await.map_err(|e| anyhow!("{e}"))?;
            p.wait_until_ready().await.map_err(|e| anyhow!("{e}"))?;
        }
        let sync_time = start.elapsed();
        let t1 = self.journal.traffic().await?;
        let rss1 = status_kb("self", "VmRSS");
        tokio::time::sleep(window).await;
        let t2 = self.journal.traffic().await?;
        stop.cancel();
        let per = |t: Traffic| Traffic {
            requests: t.requests / k as u64,
            watch_events: t.watch_events / k as u64,
            bytes: t.bytes / k as u64,
        };
        let unf = |id: &str| id.starts_with("unfiltered-");
        let report = UnfilteredReport {
            sample: k,
            sync: per(traffic_delta(&t1, &t0, unf)),
            sync_time,
            window_traffic: per(traffic_delta(&t2, &t1, unf)),
            window,
            rss_kb_each: rss1.saturating_sub(rss0) / k as u64,
        };
        drop(readers);
        Ok(report)
    }

    /// One cluster-wide GameServer LIST, as the original adapter makes per check: (items,
    /// response bytes, time).
    pub async fn original_list(&self) -> anyhow::Result<(usize, u64, Duration)> {
        let client = self.client("original-list").await?;
        let before = self.journal.traffic().await?;
        let t = Instant::now();
        let list = Api::<DynamicObject>::all_with(client, &gameserver_resource())
            .list(&ListParams::default())
            .await?;
        let took = t.elapsed();
        let after = self.journal.traffic().await?;
        let d = traffic_delta(&after, &before, |id| id == "original-list");
        Ok((list.items.len(), d.bytes, took))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_parsing_handles_spaces_in_names() {
        let line = "123 (side worker) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0";
        let (name, cpu) = parse_stat(line).unwrap();
        assert_eq!(name, "side worker");
        assert_eq!(cpu, Duration::from_millis(3000));
    }

    #[test]
    fn this_process_has_cpu_and_threads() {
        assert!(!thread_cpu().is_empty());
        assert!(status_kb("self", "VmRSS") > 0);
        assert!(open_fds("self") > 0);
    }
}
