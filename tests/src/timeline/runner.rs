//! The runner: builds one node's world, starts the agent as the binary does, plays the
//! drawn steps at their times, lets the signals settle, and hands back the journals.

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::PostParams;
use lastcall_common::fleetiq::{InstanceStatus as Status, StatusMessage, cache_key};
use rand::{Rng, SeedableRng, rngs::StdRng};
use serde_json::{Value, json};
use tokio::task::JoinHandle;

use super::script::{Action, AzureKind, KubeFault, NodeClaim, Safe, Timeline, Upcoming, Write};
use super::truth::{Applied, ceil_secs, effect_of, floor_secs};
use crate::agent::{InProcessAgent, config};
use crate::autoscaling::{AutoScalingEmulator, Happening, Hook};
use crate::cluster::autoscaler::karpenter::{self, NodeClaimSpec};
use crate::cluster::{
    AllocationRequest, Cluster, ClusterConfig, EvictionSafe, FleetSpec, GameServerSpec,
    GameServerState, NodeSpec, allocator, kubelet, toleration_equal,
};
use crate::eventually::try_eventually;
use crate::gamelift::{self, GameLiftEmulator, InstanceStatus};
use crate::gce::GceMetadataEmulator;
use crate::imds::ImdsEmulator;
use crate::kube::faults::{FaultRule, Method};
use crate::kube::journal::JournalEntry;
use crate::redis::RedisServer;
use lastcall_emulators::azure::{self, AzureMetadataEmulator};

/// Karpenter registers the node under a NodeClaim that expires in the run, before the
/// agent starts (as registration comes before the node runs pods): returns when it was
/// created (its own `creationTimestamp`) and when the Node named it as owner.
async fn launch_nodeclaim(
    cluster: &Cluster,
    claim: NodeClaim,
) -> anyhow::Result<(SystemTime, SystemTime)> {
    let k = cluster.karpenter(karpenter::Config::default()).await?;
    let obj = k
        .launch(
            NODE,
            &NodeClaimSpec {
                expire_after: format!("{}s", claim.expire_s),
                termination_grace_period: claim.grace_s.map(|g| format!("{g}s")),
            },
        )
        .await?;
    let launched = SystemTime::now();
    let created: jiff::Timestamp = obj["metadata"]["creationTimestamp"]
        .as_str()
        .context("the NodeClaim's creationTimestamp")?
        .parse()?;
    Ok((SystemTime::from(created), launched))
}

/// The truth's change a NodeClaim makes: when its expiry comes within `--maintenance-lead`
/// (at once for one that expires within the lead), with its expiry plus its grace period,
/// counted from its `creationTimestamp`, as the node's end.
fn nodeclaim_fence(
    tl: &Timeline,
    t0: SystemTime,
    claim: NodeClaim,
    (created, launched): (SystemTime, SystemTime),
) -> Applied {
    let at = (created + Duration::from_millis(claim.fence_after_ms())).max(launched);
    let end_ms = claim.end_after_ms().map(|e| {
        let end = created + Duration::from_millis(e);
        match end.duration_since(t0) {
            Ok(d) => d.as_millis() as i64,
            Err(before) => -(before.duration().as_millis() as i64),
        }
    });
    let action = Action::NodeClaimFence { end_ms };
    Applied {
        at,
        effect: effect_of(tl, t0, at, &action),
        action,
        note: String::new(),
    }
}

/// The agents' `--aws-imds-interval`.
pub const IMDS_POLL: Duration = Duration::from_millis(200);
/// The agents' `--azure-events-interval`.
pub const AZURE_POLL: Duration = Duration::from_millis(200);
/// IMDS' scheduled-events path.
pub const IMDS_SCHEDULED: &str = "/latest/meta-data/events/maintenance/scheduled";

/// The taint compat mode adds after claim (NoExecute).
pub const COMPAT_ACTIVE: &str = "gamelift.status/active";
/// The taint compat mode adds once every match tolerates it (NoExecute).
pub const COMPAT_DRAINING: &str = "gamelift.status/draining";

pub const NS: &str = "default";
pub const NODE: &str = "n1";
pub const GROUP: &str = "g1";
/// The prefix of the agents' identities in the kube journal: each agent pod writes as its
/// own user, `agent-n1/<pod>` ([`agent_identity`]), so the journal tells a standby agent's
/// writes from the owner's.
pub const AGENT: &str = "agent-n1";

/// The kube identity of the agent running in `pod`.
pub fn agent_identity(pod: &str) -> String {
    format!("{AGENT}/{pod}")
}

/// The agent pod whose identity `identity` is (`None`: not one of the node's agents).
pub fn agent_pod(identity: &str) -> Option<&str> {
    identity.strip_prefix(AGENT)?.strip_prefix('/')
}
/// The Auto Scaling group the instance is in (its termination hook is `h`).
pub const ASG: &str = "asg-n1";
/// The Azure VM's name.
pub const VM: &str = "vm-n1";
/// The allocator excludes these servers, as the docs ask.
pub const EXCLUSION: &str = "lastcall.dev/node-draining!=true";
/// How long a clean agent stop may take before the task is killed.
pub const STOP_WITHIN: Duration = Duration::from_secs(3);
/// How long after the last step a drain must have ended (deregistered, or cancelled).
pub const SETTLE: Duration = Duration::from_secs(10);

/// Everything a run leaves for the checker.
pub struct Run {
    pub timeline: Timeline,
    /// When IMDS answered a read of its scheduled events (any agent's): the moments an agent
    /// could have learned of an event's move or cancel.
    pub imds_scheduled_reads: Vec<SystemTime>,
    /// When Azure's metadata service answered a read of its scheduled events with the
    /// document (any agent's).
    pub azure_event_reads: Vec<SystemTime>,
    /// When GCE's metadata server answered a read of `maintenance-event` with a value (a
    /// hanging GET: at the change, for an agent waiting on it), and the agent pod that read it
    /// (each reads through its own path).
    pub gce_maintenance_reads: Vec<(SystemTime, String)>,
    pub t0: SystemTime,
    pub applied: Vec<Applied>,
    /// Servers allocated before the timeline started.
    pub allocated_at_start: BTreeSet<String>,
    /// The kube journal and GameLift calls of the whole run.
    pub journal: Vec<JournalEntry>,
    pub calls: Vec<gamelift::Call>,
    /// What happened to the instance in the Auto Scaling API (calls and its wait), when.
    pub asg: Vec<(SystemTime, Happening)>,
    /// Azure approvals (EventId, when).
    pub azure_approvals: Vec<(String, SystemTime)>,
    /// When the last step was applied, and whether (and when) the drain ended after it.
    pub settled_from: SystemTime,
    pub settled: Result<SystemTime, String>,
    /// Wall time of building the world and starting the agent.
    pub setup: Duration,
    /// Agents stopped in a rollout whose stop failed or never ended (each a hit,
    /// `agent-stop-failed`).
    pub agent_errors: Vec<String>,
    /// When the process could not run (see [`StallProbe`]): each stall's end and length.
    pub stalls: Vec<(SystemTime, Duration)>,
    /// Every game-server pod seen bound to the node, terminating ones included, with the
    /// first and last moment it was seen ([`PodSampler`]).
    pub pods: Vec<PodSeen>,
    /// The game server the scheduler placed on the node as the fence went up (its name,
    /// and when it was created: its pod lands `bind_lag_ms` later).
    pub late_servers: Vec<(String, SystemTime)>,
    /// The GameLift calls (journal `seq`) applied whose answer the emulator then lost.
    pub answers_lost: Vec<u64>,
    /// The kube writes (journal `seq`) applied whose answer the emulator then lost.
    pub kube_answers_lost: Vec<u64>,
    /// How many Auto Scaling calls were applied and their answers lost.
    pub asg_answers_lost: usize,
    /// When each agent instance started, and its pod's name (its identity).
    pub starts: Vec<(SystemTime, String)>,
    /// The journal `seq` of each agent read of the Node that a machine's new boot id was
    /// posted after (`Timeline::boot_id_lag`): the agent saw the old boot.
    pub boot_reads: Vec<u64>,
}

/// A game server a scheduler working from a cache of a moment ago places on the node as
/// lastcall's fence goes up: once armed, the first time the taint is seen, the server is
/// created at once, pinned to the node and tolerating everything (blanket tolerations);
/// the scheduler binds its pod `bind_lag_ms` later, within `--deregister-settle`.
struct LateServer {
    made: std::sync::Arc<std::sync::Mutex<Option<(String, SystemTime)>>>,
    task: JoinHandle<()>,
}

impl LateServer {
    const NAME: &str = "late-1";

    fn arm(store: crate::kube::store::Store) -> LateServer {
        let made = std::sync::Arc::new(std::sync::Mutex::new(None));
        let out = made.clone();
        let task = tokio::spawn(async move {
            loop {
                let fenced = store
                    .get(&crate::kube::resources::NODES, None, NODE)
                    .is_some_and(|n| has_own_taint(&n));
                if fenced {
                    let gs = GameServerSpec::new(Self::NAME)
                        .namespace(NS)
                        .node_selector("example.com/team", "blue")
                        .grace_seconds(1)
                        .toleration(k8s_openapi::api::core::v1::Toleration {
                            operator: Some("Exists".into()),
                            ..Default::default()
                        });
                    let at = SystemTime::now();
                    if store
                        .create(
                            &crate::kube::resources::GAMESERVERS,
                            Some(NS),
                            gs.to_object(),
                        )
                        .is_ok()
                        && let Ok(mut m) = out.lock()
                    {
                        *m = Some((Self::NAME.to_string(), at));
                    }
                    return;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        });
        LateServer { made, task }
    }

    fn stop(self) -> Option<(String, SystemTime)> {
        self.task.abort();
        self.made.lock().ok().and_then(|m| m.clone())
    }
}

/// GKE's answer to a hand-back (`cloud.google.com/perform-maintenance=true` on the Node,
/// written by the agent) on a VM that migrates live: the maintenance starts at once,
/// `maintenance-event` says `MIGRATE_ON_HOST_MAINTENANCE` while the VM moves, then `NONE`,
/// and the upcoming maintenance is gone (done). No new boot: the VM kept running.
/// (Compressed: GCE warns 60 s before a live migration.) Records each change as applied.
struct HandBack {
    applied: std::sync::Arc<std::sync::Mutex<Vec<Applied>>>,
    task: JoinHandle<()>,
}

impl HandBack {
    /// How long the migration takes here.
    const MIGRATION: Duration = Duration::from_millis(500);

    fn arm(
        tl: &Timeline,
        t0: SystemTime,
        store: crate::kube::store::Store,
        gce: std::sync::Arc<GceMetadataEmulator>,
    ) -> HandBack {
        let applied = std::sync::Arc::new(std::sync::Mutex::new(Vec::<Applied>::new()));
        let out = applied.clone();
        let tl = tl.clone();
        let record = move |action: Action| {
            let at = SystemTime::now();
            if let Ok(mut v) = out.lock() {
                v.push(Applied {
                    at,
                    effect: effect_of(&tl, t0, at, &action),
                    action,
                    note: String::new(),
                });
            }
        };
        let task = tokio::spawn(async move {
            loop {
                let asked = store
                    .get(&crate::kube::resources::NODES, None, NODE)
                    .is_some_and(|n| {
                        n["metadata"]["labels"][HAND_BACK_LABEL].as_str() == Some("true")
                    });
                if asked {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            gce.set("maintenance-event", "MIGRATE_ON_HOST_MAINTENANCE");
            record(Action::GceMigrating);
            tokio::time::sleep(Self::MIGRATION).await;
            gce.remove("upcoming-maintenance");
            gce.set("maintenance-event", "NONE");
            record(Action::GceNone);
            record(Action::GceUpcoming {
                status: Upcoming::Complete,
                window_ms: 0,
            });
        });
        HandBack { applied, task }
    }

    /// What GKE did so far.
    fn so_far(&self) -> Vec<Applied> {
        self.applied.lock().map(|v| v.clone()).unwrap_or_default()
    }

    fn stop(self) -> Vec<Applied> {
        self.task.abort();
        self.so_far()
    }
}

/// The label the agent's hand-back writes, which asks GKE to start the maintenance now.
const HAND_BACK_LABEL: &str = "cloud.google.com/perform-maintenance";

/// The game server that lands on an empty node ([`Action::StrayServer`]).
pub const STRAY: &str = "stray-1";

/// How late the pod watch delivers from the stray server's landing on.
const STRAY_POD_LAG: Duration = Duration::from_millis(400);

/// A game-server pod on the node, as sampled.
#[derive(Clone, Debug)]
pub struct PodSeen {
    pub name: String,
    pub first: SystemTime,
    pub last: SystemTime,
    /// When the pod was first seen marked for deletion by the taint manager (a NoExecute
    /// taint it does not tolerate): the world ending its match, not an agent's request.
    pub taint_deleted: Option<SystemTime>,
}

/// Whether the taint manager has marked `pod` for deletion.
fn taint_deleted(pod: &Value) -> bool {
    pod["status"]["conditions"].as_array().is_some_and(|cs| {
        cs.iter()
            .any(|c| c["type"] == "DisruptionTarget" && c["reason"] == "DeletionByTaintManager")
    })
}

/// How often the pod sampler looks at the node.
const SAMPLE_EVERY: Duration = Duration::from_millis(5);

/// Samples which game-server pods are bound to the node, straight from the emulator's
/// store: the checker's ground truth for "the node is empty" at a hand-off.
struct PodSampler {
    seen: std::sync::Arc<std::sync::Mutex<Vec<PodSeen>>>,
    task: JoinHandle<()>,
}

impl PodSampler {
    fn start(store: crate::kube::store::Store) -> PodSampler {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::<PodSeen>::new()));
        let out = seen.clone();
        let task = tokio::spawn(async move {
            loop {
                let (pods, _) = store.list(&crate::kube::resources::PODS, None);
                let now = SystemTime::now();
                if let Ok(mut v) = out.lock() {
                    for p in pods.iter().filter(|p| {
                        p.pointer("/spec/nodeName").and_then(Value::as_str) == Some(NODE)
                            && is_game_pod(p)
                    }) {
                        let name = p["metadata"]["name"].as_str().unwrap_or_default();
                        let tainted = taint_deleted(p).then_some(now);
                        match v.iter_mut().find(|s| s.name == name) {
                            Some(s) => {
                                s.last = now;
                                s.taint_deleted = s.taint_deleted.or(tainted);
                            }
                            None => v.push(PodSeen {
                                name: name.to_string(),
                                first: now,
                                last: now,
                                taint_deleted: tainted,
                            }),
                        }
                    }
                }
                tokio::time::sleep(SAMPLE_EVERY).await;
            }
        });
        PodSampler { seen, task }
    }

    fn stop(self) -> Vec<PodSeen> {
        self.task.abort();
        self.seen.lock().map(|v| v.clone()).unwrap_or_default()
    }
}

/// How often the stall probe wakes.
const PROBE_EVERY: Duration = Duration::from_millis(20);
/// Timer lateness below this is ordinary scheduling jitter, not a stall (a quiet machine's
/// timers fire within a millisecond or two; a starved one's are late by some milliseconds on
/// every tick, time the agents lose as well).
const PROBE_JITTER: Duration = Duration::from_millis(5);

/// Measures when this process could not run: a task on the agents' runtime that sleeps
/// `PROBE_EVERY` and records how late it woke. A shared machine can leave the whole process
/// (the in-process agents, the emulators and the runner alike) without a CPU for seconds;
/// the checker then allows the agent that much longer to react, as it could not have.
struct StallProbe {
    stalls: std::sync::Arc<std::sync::Mutex<Vec<(SystemTime, Duration)>>>,
    task: JoinHandle<()>,
}

impl StallProbe {
    fn start() -> StallProbe {
        let stalls = std::sync::Arc::new(std::sync::Mutex::new(vec![]));
        let out = stalls.clone();
        let task = tokio::spawn(async move {
            loop {
                let before = tokio::time::Instant::now();
                tokio::time::sleep(PROBE_EVERY).await;
                let late = before.elapsed().saturating_sub(PROBE_EVERY);
                if late > PROBE_JITTER
                    && let Ok(mut v) = out.lock()
                {
                    v.push((SystemTime::now(), late));
                }
            }
        });
        StallProbe { stalls, task }
    }

    fn stalls_now(&self) -> Vec<(SystemTime, Duration)> {
        self.stalls.lock().map(|v| v.clone()).unwrap_or_default()
    }

    fn stop(self) -> Vec<(SystemTime, Duration)> {
        self.task.abort();
        self.stalls.lock().map(|v| v.clone()).unwrap_or_default()
    }
}

/// A run that fails midway leaves no probe behind.
impl Drop for StallProbe {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn status(fleet_status: Status, iid: &str) -> String {
    StatusMessage {
        group_name: Some(GROUP.into()),
        group_arn: Some(GameLiftEmulator::group_arn(GROUP)),
        instance_id: iid.into(),
        status: fleet_status,
    }
    .to_python_json()
}

/// Caches and publishes `body` as pubsub does, retrying a connection that a loaded machine
/// let time out. Returns when the attempt that worked sent it: the moment the truth
/// changed, however long the connection took.
async fn publish(redis: &RedisServer, iid: &str, body: &str) -> anyhow::Result<SystemTime> {
    let mut last = None;
    for _ in 0..5 {
        match publish_once(redis, iid, body).await {
            Ok(at) => return Ok(at),
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("publish")))
}

async fn publish_once(redis: &RedisServer, iid: &str, body: &str) -> anyhow::Result<SystemTime> {
    let mut c = redis.client().await?;
    let at = SystemTime::now();
    let _: () = ::redis::cmd("SET")
        .arg(cache_key(iid))
        .arg(body)
        .query_async(&mut c)
        .await?;
    let _: i64 = ::redis::cmd("PUBLISH")
        .arg(iid)
        .arg(body)
        .query_async(&mut c)
        .await?;
    Ok(at)
}

/// Reads, edits and replaces the Node as `api`'s identity, retrying lost races (409).
/// Returns when the replace that was accepted was sent (the moment the truth changed).
async fn edit_node(api: &Api<Node>, f: impl Fn(&mut Node)) -> anyhow::Result<SystemTime> {
    for _ in 0..20 {
        let mut n = api.get(NODE).await?;
        f(&mut n);
        let at = SystemTime::now();
        match api.replace(NODE, &PostParams::default(), &n).await {
            Ok(_) => return Ok(at),
            Err(kube::Error::Api(e)) if e.code == 409 => continue,
            // An injected fault on Node writes hits the test's writers too: try again.
            Err(kube::Error::Api(e)) if e.code >= 500 => {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            Err(e) => return Err(e.into()),
        }
    }
    anyhow::bail!("editing the Node lost 20 races")
}

/// An IMDS scheduled-event time, as EC2 writes it (the day of the month unpadded).
pub fn imds_time(t: SystemTime) -> String {
    let ts = jiff::Timestamp::try_from(t).unwrap_or(jiff::Timestamp::UNIX_EPOCH);
    ts.strftime("%-d %b %Y %H:%M:%S GMT").to_string()
}

fn rfc1123(t: SystemTime) -> String {
    let ts = jiff::Timestamp::try_from(t).unwrap_or(jiff::Timestamp::UNIX_EPOCH);
    ts.strftime("%a, %d %b %Y %H:%M:%S GMT").to_string()
}

/// The EventId of Azure event `episode`.
pub fn azure_event_id(seed: u64, episode: u8) -> String {
    format!("tl{seed:x}-ev{episode}")
}

fn rfc3339(t: SystemTime) -> String {
    let ts = jiff::Timestamp::try_from(t).unwrap_or(jiff::Timestamp::UNIX_EPOCH);
    ts.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

struct Agents {
    /// The API server's URL: each agent's kube configuration is made for its own user.
    kube_url: String,
    /// The GCE metadata server's URL: each agent reads it through its own path
    /// ([`GceMetadataEmulator::url_for`]), so its reads are told apart.
    gce_url: String,
    /// Creates and deletes the agents' own Pod objects (their identities).
    pods: Api<k8s_openapi::api::core::v1::Pod>,
    gl: aws_sdk_gamelift::Client,
    flags: Vec<String>,
    /// The running agents, oldest first, each with its pod (name, uid).
    live: Vec<(InProcessAgent, (String, String))>,
    /// Older agents stopping after a rollout's overlap.
    stopping: Vec<Stopping>,
    next_pod: u32,
    /// When each agent instance started, and in which pod: the reaction time the checker
    /// allows a fresh instance is its own, not every agent's.
    starts: Vec<(SystemTime, String)>,
}

/// An older agent a rollout is stopping: the task that stops it after the overlap, the
/// agent itself (a machine going down takes it down at once), and its pod's name.
struct Stopping {
    task: JoinHandle<anyhow::Result<()>>,
    agent: tokio::task::AbortHandle,
    pod: String,
}

/// How long a dry run goes on after the last step: long enough for the drain it narrates to
/// reach its hand-off (the settle, the gate's fresh LIST), which it must not send.
const DRY_RUN_SETTLE: Duration = Duration::from_secs(2);

/// The `Retry-After` a throttled release is answered with (as API Priority and Fairness).
pub const RELEASE_RETRY_AFTER: Duration = Duration::from_secs(1);

/// How long a Spot eviction stays in the Azure document at least (three 200 ms reads).
const PREEMPT_LISTED_AT_LEAST: Duration = Duration::from_millis(600);

/// Every Kubernetes request's deadline in a timeline (`--request-timeout`): time runs about a
/// hundred times faster than in production (deadlines seconds away), so this is scaled too.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(1);

/// The namespace the agents' own pods live in, as the DaemonSet's would.
const AGENT_NAMESPACE: &str = "lastcall";

impl Agents {
    /// A new agent pod, as a DaemonSet rollout creates one: it never schedules here (its
    /// selector matches no node), it only has to exist for node ownership.
    async fn new_pod(&mut self) -> anyhow::Result<(String, String)> {
        self.next_pod += 1;
        let name = format!("lastcall-agent-{}", self.next_pod);
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": { "name": name, "namespace": AGENT_NAMESPACE },
            "spec": {
                "nodeSelector": { "example.com/agent-pod": "never-scheduled" },
                "containers": [{ "name": "agent", "image": "lastcall-agent" }]
            }
        }))?;
        let made = self.pods.create(&PostParams::default(), &pod).await?;
        let uid = made.metadata.uid.context("a created pod has a uid")?;
        Ok((name, uid))
    }

    /// Starts an agent in `pod` (a container restart keeps its pod), or in a new pod.
    async fn start(&mut self, pod: Option<(String, String)>) -> anyhow::Result<()> {
        let pod = match pod {
            Some(p) => p,
            None => self.new_pod().await?,
        };
        let gce = format!("{}/{}", self.gce_url, pod.0);
        let mut args: Vec<&str> = self.flags.iter().map(String::as_str).collect();
        args.extend([
            "--gce-metadata-endpoint",
            gce.as_str(),
            "--pod-name",
            pod.0.as_str(),
            "--pod-namespace",
            AGENT_NAMESPACE,
            "--pod-uid",
            pod.1.as_str(),
        ]);
        self.starts.push((SystemTime::now(), pod.0.clone()));
        let kube = crate::kube::config_for_url(&self.kube_url, &agent_identity(&pod.0)).await?;
        let a = InProcessAgent::start(config(NODE, &args), kube, Some(self.gl.clone())).await?;
        self.live.push((a, pod));
        Ok(())
    }
}

/// Runs `tl` against a fresh world. `redis` may be shared between concurrent runs (each
/// timeline has its own instance id, so its own channel).
pub async fn run(tl: Timeline, redis: &RedisServer) -> anyhow::Result<Run> {
    let setup_started = tokio::time::Instant::now();
    let iid = gamelift::instance_id(&format!("tl{}", tl.seed));
    let mut rng = StdRng::seed_from_u64(tl.seed ^ 0x7469_6d65_6c69_6e65);
    let cluster = Cluster::start(ClusterConfig {
        tick: Duration::from_millis(20),
        agones_selectable_fields: tl.agones_selectable_fields,
        bind_lag: Duration::from_millis(tl.bind_lag_ms),
        ..ClusterConfig::default()
    })
    .await
    .context("starting the cluster")?;
    cluster.add_node(NodeSpec::new(NODE).label("example.com/team", "blue").taint(
        "example.com/dedicated",
        "games",
        "PreferNoSchedule",
    ))?;
    cluster.set_boot_id(NODE, "boot-0")?;
    let mut allocated_at_start = BTreeSet::new();
    for safe in Safe::ALL {
        let i = safe as usize;
        let total = tl.ready[i] + tl.allocated[i];
        if total == 0 {
            continue;
        }
        let es = match safe {
            Safe::Never => EvictionSafe::Never,
            Safe::OnUpgrade => EvictionSafe::OnUpgrade,
            Safe::Always => EvictionSafe::Always,
        };
        let mut fleet = FleetSpec::new(safe.fleet(), total as i64)
            .eviction_safe(es)
            .grace_seconds(tl.grace_s[i]);
        if tl.mode.tolerate_active {
            fleet = fleet.toleration(toleration_equal(COMPAT_ACTIVE, "true", "NoExecute"));
        }
        cluster.create_fleet(fleet)?;
        cluster
            .wait_ready(NS, safe.fleet(), total)
            .await
            .context("waiting for the Fleets")?;
        for _ in 0..tl.allocated[i] {
            let gs = cluster
                .allocate(&AllocationRequest::fleet(NS, safe.fleet()))
                .await
                .context("initial allocation")?
                .ok_or_else(|| anyhow::anyhow!("initial allocation failed"))?;
            allocated_at_start.insert(gs.name);
        }
    }
    cluster.add_node(NodeSpec::new("n2"))?;
    let operator: Api<Node> = Api::all(cluster.emulator().client_as("operator").await?);
    let karpenter: Api<Node> = Api::all(cluster.emulator().client_as("karpenter").await?);
    let reverter: Api<Node> = Api::all(cluster.emulator().client_as("reverter").await?);
    let autoscaler: Api<Node> = Api::all(cluster.emulator().client_as("cluster-autoscaler").await?);
    let gke: Api<Node> = Api::all(cluster.emulator().client_as("gke").await?);
    if tl.foreign_cordon {
        edit_node(&operator, |n| {
            n.spec.get_or_insert_default().unschedulable = Some(true);
        })
        .await
        .context("the operator's cordon")?;
    }

    let gl = GameLiftEmulator::start()
        .await
        .context("GameLift emulator")?;
    gl.add_instances(GROUP, std::slice::from_ref(&iid), InstanceStatus::Active);
    let imds = ImdsEmulator::start(&iid, "ip-10-0-0-1.ec2.internal")
        .await
        .context("IMDS emulator")?;
    let gce = std::sync::Arc::new(GceMetadataEmulator::start().await.context("GCE emulator")?);
    gce.set(
        "scheduling/on-host-maintenance",
        tl.host_maintenance.as_str(),
    );
    // The policy's first reads failing: unread, it is neither MIGRATE nor TERMINATE.
    gce.fail_key_next("scheduling/on-host-maintenance", tl.policy_read_faults);
    let asg = AutoScalingEmulator::start()
        .await
        .context("Auto Scaling emulator")?;
    let asg_epoch = (tokio::time::Instant::now(), SystemTime::now());
    asg.add_group(ASG, vec![Hook::terminating("h", tl.asg_heartbeat_s)]);
    asg.add_instance(ASG, &iid);
    let az = AzureMetadataEmulator::start(VM)
        .await
        .context("Azure emulator")?;
    let mut flags: Vec<String> = if tl.fleetiq {
        ["--game-server-group", GROUP, "--redis-url", &redis.url()]
            .map(String::from)
            .to_vec()
    } else {
        vec![]
    };
    flags.extend(
        [
            "--instance-id",
            &iid,
            "--heartbeat-interval",
            "1s",
            "--resync-interval",
            "1s",
            "--request-timeout",
            "1s",
            "--deregister-settle",
            &format!("{}ms", tl.deregister_settle_ms()),
            "--aws-imds",
            "--imds-endpoint",
            &imds.url(),
            "--aws-imds-interval",
            &format!("{}ms", IMDS_POLL.as_millis()),
            "--gce-metadata",
            "--gce-wait-timeout",
            "5s",
            "--gce-preemption-notice",
            &format!("{}ms", tl.gce_preemption_notice().as_millis()),
            "--gce-terminate-notice",
            &format!("{}ms", tl.gce_terminate_notice().as_millis()),
            "--gce-upcoming-interval",
            "200ms",
        ]
        .map(String::from),
    );
    if tl.graceful_termination {
        flags.push("--graceful-termination".into());
    }
    if tl.rebalance_ttl_ms > 0 {
        flags.extend([
            "--rebalance-ttl".into(),
            format!("{}ms", tl.rebalance_ttl_ms),
        ]);
    }
    if tl.drain_on_foreign_cordon {
        flags.push("--drain-on-foreign-cordon".into());
    }
    if tl.gke_hand_back {
        flags.push("--gke-hand-back".into());
    }
    if tl.nodeclaim.is_some() {
        flags.extend([
            "--maintenance-lead".into(),
            format!("{}s", super::script::NODECLAIM_LEAD_S),
        ]);
    }
    let mode = tl.mode;
    if mode.dry_run {
        flags.push("--dry-run".into());
    }
    if mode.publish_drain_state {
        // Timelines share one Redis: each publishes under its own cluster name.
        flags.extend([
            "--publish-drain-state".into(),
            "--cluster-name".into(),
            format!("tl{}", tl.seed),
        ]);
    }
    if mode.pacing {
        flags.extend(
            [
                "--release-floor",
                "1",
                "--release-interval",
                "150ms",
                "--release-hold-max",
                "1s",
            ]
            .map(String::from),
        );
    }
    if let Some(c) = mode.cooperation {
        flags.extend(["--autoscaler-cooperation".into(), c.to_string()]);
    }
    if mode.compat_taints {
        flags.push("--compat-taints".into());
    }
    if tl.dims.asg_lifecycle {
        flags.extend(
            [
                "--asg-lifecycle",
                "--asg-interval",
                "200ms",
                "--asg-endpoint",
                &asg.url(),
                "--aws-region",
                "us-west-2",
            ]
            .map(String::from),
        );
    }
    if tl.dims.azure_events {
        flags.extend(
            [
                "--azure-events",
                "--azure-metadata-endpoint",
                &az.url(),
                "--azure-events-interval",
                &format!("{}ms", AZURE_POLL.as_millis()),
                "--azure-vm-name",
                VM,
            ]
            .map(String::from),
        );
        if tl.azure_approve {
            flags.push("--azure-approve-when-empty".into());
        }
    }
    if tl.fleetiq {
        publish(redis, &iid, &status(Status::Active, &iid))
            .await
            .context("publishing ACTIVE")?;
    }
    let mut agents = Agents {
        kube_url: cluster.emulator().url(),
        gce_url: gce.url(),
        pods: Api::namespaced(cluster.client(), AGENT_NAMESPACE),
        gl: gl.sdk_client().await,
        flags,
        live: vec![],
        stopping: vec![],
        next_pod: 0,
        starts: vec![],
    };
    // From before the first agent starts: a signal that came before it (a NodeClaim) is
    // judged from its start, stalls included.
    let probe = StallProbe::start();
    let nodeclaim_launched = match tl.nodeclaim {
        Some(claim) => Some(
            launch_nodeclaim(&cluster, claim)
                .await
                .context("launching the NodeClaim")?,
        ),
        None => None,
    };
    agents.start(None).await.context("starting the agent")?;
    try_eventually(
        "the agent sees its servers",
        Duration::from_secs(20),
        Duration::from_millis(10),
        || async {
            let here: Vec<_> = cluster
                .game_servers()
                .into_iter()
                .filter(|g| g.node.as_deref() == Some(NODE))
                .collect();
            if tl.agones_selectable_fields {
                // Nothing to claim: the agent's gauges count every server on the node. A dry
                // run already draining (a NodeClaim expiring within the lead) plans as if its
                // releases had landed: the servers it narrated released are not counted.
                let a = &agents.live.first()?.0;
                let m = a.metrics().await;
                let seen = crate::agent::metric_sum(&m, "lastcall_game_servers", &[]);
                let steps = a.narration.steps();
                let released = here
                    .iter()
                    .filter(|g| {
                        let named = format!("{NS}/{} ", g.name);
                        steps
                            .iter()
                            .any(|s| s.kind == "release" && s.text.contains(&named))
                    })
                    .count();
                (seen as usize + released == here.len()).then_some(())
            } else {
                here.iter()
                    .all(|g| g.labels.contains_key("lastcall.dev/node"))
                    .then_some(())
            }
        },
    )
    .await
    .map_err(|e| anyhow::anyhow!("{} within {:?}", e.what, e.within))?;

    let alloc_client = cluster.client_without_retry("agones-allocator").await?;
    let setup = setup_started.elapsed();
    let mut allocations: Vec<JoinHandle<()>> = vec![];
    let sampler = PodSampler::start(cluster.store().clone());
    let mut boots = 0u32;
    // The kubelet's late boot-id posts (`Timeline::boot_id_lag`), each answering the journal
    // `seq` of the agent's read that came first.
    let mut boot_reports: Vec<JoinHandle<Option<u64>>> = vec![];
    let mut late: Option<LateServer> = None;
    if tl.slow_starter {
        // Placed on the node before any signal; the game calls `Ready()` late.
        cluster.create_game_server(
            GameServerSpec::new(SLOW_STARTER)
                .namespace(NS)
                .node_selector("example.com/team", "blue")
                .grace_seconds(1)
                .manual_ready(),
        )?;
    }
    if tl.late_cancel {
        // On a whole second, so that IMDS' `NotBefore` (whole seconds) is the drawn one to
        // within 50 ms and the cancel falls where it was drawn, just before a match is due.
        let into = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .subsec_nanos();
        tokio::time::sleep(Duration::from_nanos(u64::from(1_000_000_000 - into))).await;
    }
    let start = tokio::time::Instant::now();
    let t0 = SystemTime::now();
    let hand_back = tl
        .gke_hand_back
        .then(|| HandBack::arm(&tl, t0, cluster.store().clone(), gce.clone()));
    let mut applied = vec![];
    // Truth changes no step makes: a rebalance recommendation's TTL running out, a
    // NodeClaim's expiry coming within the lead.
    let mut expiries: Vec<Applied> = vec![];
    if let (Some(claim), Some(launched)) = (tl.nodeclaim, nodeclaim_launched) {
        expiries.push(nodeclaim_fence(&tl, t0, claim, launched));
    }
    let mut scheduled_id = 0u32;
    // GCE's `maintenance-event` as last set to a real value, and whether an empty body
    // (a glitch) stands in for it now.
    let mut gce_event = "NONE";
    let mut gce_glitch = false;
    // When each Azure event was (last) put in the document, by episode.
    let mut azure_listed_at: std::collections::BTreeMap<u8, SystemTime> = Default::default();
    // The last step ends every match left, so a drain can finish.
    let steps: Vec<(u64, Action, bool)> = tl
        .steps
        .iter()
        .map(|s| (s.at_ms, s.action.clone(), false))
        .chain(std::iter::once((tl.end_all_at_ms, Action::EndMatch, true)))
        .collect();
    for (at_ms, action, all) in steps {
        let what = format!("step t+{at_ms} ms {action:?}");
        tokio::time::sleep_until(start + Duration::from_millis(at_ms)).await;
        let mut at = SystemTime::now();
        let mut note = String::new();
        match &action {
            Action::ImdsScheduled {
                code,
                not_before_ms,
            } => {
                let nb = ceil_secs(t0 + Duration::from_millis(*not_before_ms));
                if scheduled_id == 0 {
                    scheduled_id = rng.random_range(1..u32::MAX);
                }
                imds.set_scheduled_events(json!([{
                    "Code": code.as_str(),
                    "Description": "scheduled by the timeline",
                    "EventId": format!("instance-event-{scheduled_id:08x}"),
                    "NotBefore": imds_time(nb),
                    "NotAfter": imds_time(nb + Duration::from_secs(7200)),
                    "State": "active",
                }]));
                // Taken after the change: a read answered later saw it.
                at = SystemTime::now();
            }
            Action::ImdsScheduledCancel => {
                imds.set_scheduled_events(json!([]));
                at = SystemTime::now();
                scheduled_id = 0;
            }
            Action::ImdsSpot { at_ms } => {
                let t = ceil_secs(t0 + Duration::from_millis(*at_ms));
                imds.set_spot_action(Some(json!({"action": "terminate", "time": rfc3339(t)})));
            }
            Action::GceTerminate => {
                gce_event = "TERMINATE_ON_HOST_MAINTENANCE";
                gce_glitch = false;
                gce.set("maintenance-event", gce_event);
                // Taken after the change: a read answered later saw it.
                at = SystemTime::now();
            }
            Action::GceNone => {
                gce_event = "NONE";
                gce_glitch = false;
                gce.set("maintenance-event", gce_event);
                at = SystemTime::now();
            }
            Action::GceEmpty => {
                gce_glitch = true;
                gce.set("maintenance-event", "");
            }
            Action::GcePreempted => gce.set("preempted", "TRUE"),
            Action::AsgTerminate => {
                asg.lag_describes(tl.asg_lag);
                asg.begin_termination(&iid).context(what.clone())?;
                imds.set_target_lifecycle_state(Some("Terminated"));
            }
            Action::AzureEvent {
                episode,
                kind,
                not_before_ms,
            } => {
                azure_listed_at
                    .entry(*episode)
                    .or_insert_with(SystemTime::now);
                let id = azure_event_id(tl.seed, *episode);
                let nb = ceil_secs(t0 + Duration::from_millis(*not_before_ms));
                let mut ev = azure::event(&id, kind.event_type(), VM, &rfc1123(nb));
                if *kind == AzureKind::FreezeLong {
                    ev["DurationInSeconds"] = json!(120);
                }
                let mut events = az.events();
                match events.iter_mut().find(|e| e["EventId"] == id.as_str()) {
                    // Once started (approved) the platform no longer moves it.
                    Some(e) if e["EventStatus"] == "Started" => {}
                    Some(e) => *e = ev,
                    None => events.push(ev),
                }
                az.set_events(events);
                // Taken after the change: a read answered later saw it.
                at = SystemTime::now();
            }
            Action::AzureGone { episode } => {
                let id = azure_event_id(tl.seed, *episode);
                // A Spot eviction stays listed at least three of the agents' reads: one gone
                // at once (steps bunch up behind a slow one) could be read by an agent that
                // stops right then and missed by the next, which no checker can judge.
                let preempt = az
                    .events()
                    .iter()
                    .any(|e| e["EventId"] == id.as_str() && e["EventType"] == "Preempt");
                if let (true, Some(since)) = (preempt, azure_listed_at.get(episode)) {
                    let until = *since + PREEMPT_LISTED_AT_LEAST;
                    if let Ok(wait) = until.duration_since(SystemTime::now()) {
                        tokio::time::sleep(wait).await;
                    }
                }
                let mut events = az.events();
                // Whether any agent read the document while the event was in it: one gone
                // before that was never seen (the truth keeps only a Spot eviction seen).
                let listed = events.iter().any(|e| e["EventId"] == id.as_str());
                let since = azure_listed_at.remove(episode);
                let read = since.is_some_and(|since| {
                    az.requests().iter().any(|r| {
                        r.method == "GET"
                            && r.path == "/metadata/scheduledevents"
                            && r.status == 200
                            && r.at >= since
                    })
                });
                if listed && !read {
                    note = super::truth::UNREAD.to_string();
                }
                events.retain(|e| e["EventId"] != id.as_str());
                az.set_events(events);
                at = SystemTime::now();
            }
            Action::AzureApproved { .. } => {}
            Action::FleetIq { draining } => {
                let (s, gs) = if *draining {
                    (Status::Draining, InstanceStatus::Draining)
                } else {
                    (Status::Active, InstanceStatus::Active)
                };
                // A Spot notice that ACTIVE replaces before any agent recorded it (its drain
                // notice on the Node), where the agents that could have heard it were stopped
                // since, was read by no one who lived to act on it: the truth drops it (a
                // lagging replica's ACTIVE is all any later agent can learn). An agent that
                // heard it and lives keeps it (seed 4450).
                let spot_at = applied
                    .iter()
                    .rfind(|a: &&Applied| matches!(a.action, Action::FleetIqSpot))
                    .map(|a| a.at);
                if !*draining
                    && spot_at.is_some_and(|t| {
                        applied.iter().any(|a: &Applied| {
                            a.at >= t
                                && matches!(
                                    a.action,
                                    Action::RestartAgent
                                        | Action::AbortAgent { .. }
                                        | Action::Rollout { .. }
                                        | Action::MachineReturns
                                )
                        })
                    })
                    && !cluster
                        .node(NODE)
                        .is_some_and(|n| recorded_fleetiq_spot(&n))
                {
                    note = super::truth::UNREAD.to_string();
                }
                // GameLift says what Redis says: the agent may also ask GameLift.
                gl.set_instance_status(&iid, gs);
                at = publish(redis, &iid, &status(s, &iid)).await.context(what)?;
            }
            Action::FleetIqSpot => {
                gl.set_instance_status(&iid, InstanceStatus::SpotTerminating);
                at = publish(redis, &iid, &status(Status::SpotTerminating, &iid))
                    .await
                    .context(what)?;
            }
            Action::Manual(on) => {
                let on = *on;
                at = edit_node(&operator, |n| {
                    let labels = n.metadata.labels.get_or_insert_default();
                    if on {
                        labels.insert("lastcall.dev/drain".into(), "true".into());
                    } else {
                        labels.remove("lastcall.dev/drain");
                    }
                })
                .await
                .context(what)?;
            }
            Action::Karpenter(on) => {
                let on = *on;
                at = edit_node(&karpenter, |n| {
                    let taints = n
                        .spec
                        .get_or_insert_default()
                        .taints
                        .get_or_insert_default();
                    taints.retain(|t| t.key != "karpenter.sh/disrupted");
                    if on {
                        taints.push(crate::cluster::fixtures::taint(
                            "karpenter.sh/disrupted",
                            "",
                            "NoSchedule",
                        ));
                    } else if let Some(a) = n.metadata.annotations.as_mut() {
                        a.remove(KARPENTER_TERMINATION);
                    }
                })
                .await
                .context(what)?;
            }
            Action::KarpenterAt { at_ms } => {
                let when =
                    jiff::Timestamp::try_from(ceil_secs(t0 + Duration::from_millis(*at_ms)))?
                        .to_string();
                at = edit_node(&karpenter, |n| {
                    n.metadata
                        .annotations
                        .get_or_insert_default()
                        .insert(KARPENTER_TERMINATION.into(), when.clone());
                    set_taint(n, "karpenter.sh/disrupted", "", true);
                })
                .await
                .context(what)?;
            }
            Action::Autoscaler(on) => {
                let value = format!(
                    "{}",
                    ceil_secs(SystemTime::now())
                        .duration_since(SystemTime::UNIX_EPOCH)?
                        .as_secs()
                );
                at = edit_node(&autoscaler, |n| {
                    set_taint(n, "ToBeDeletedByClusterAutoscaler", &value, *on);
                })
                .await
                .context(what)?;
            }
            Action::GkeTaint(on) => {
                at = edit_node(&gke, |n| {
                    set_taint(n, "cloud.google.com/impending-node-termination", "", *on);
                })
                .await
                .context(what)?;
            }
            Action::GkeOngoing(on) => {
                at = edit_node(&gke, |n| {
                    set_label(
                        n,
                        "cloud.google.com/active-node-maintenance",
                        on.then_some("ONGOING"),
                    );
                })
                .await
                .context(what)?;
            }
            Action::GkeMaintenance { epoch_ms } => {
                let epoch = epoch_ms.map(|e| {
                    ceil_secs(t0 + Duration::from_millis(e))
                        .duration_since(SystemTime::UNIX_EPOCH)
                        .unwrap_or_default()
                        .as_secs()
                        .to_string()
                });
                at = edit_node(&gke, |n| {
                    set_label(
                        n,
                        "cloud.google.com/scheduled-maintenance-time",
                        epoch.as_deref(),
                    );
                })
                .await
                .context(what)?;
            }
            Action::RevertTaint => {
                at = edit_node(&reverter, |n| {
                    if let Some(t) = n.spec.as_mut().and_then(|s| s.taints.as_mut()) {
                        t.retain(|t| t.key != "lastcall.dev/draining");
                    }
                })
                .await
                .context(what)?;
            }
            Action::RestartAgent => {
                // The container restarts in its pod: the same identity.
                let mut pod = None;
                if !agents.live.is_empty() {
                    let (old, old_pod) = agents.live.remove(0);
                    note = match old.stop_within(STOP_WITHIN).await {
                        Ok(true) => String::new(),
                        Ok(false) => format!("the stop took over {STOP_WITHIN:?}: killed"),
                        Err(e) => format!("stop: {e}"),
                    };
                    pod = Some(old_pod);
                }
                agents.start(pod).await.context(what.clone())?;
            }
            Action::AbortAgent { gap_ms } => {
                // A crash: the kubelet restarts the container in the same pod.
                let mut pod = None;
                if let Some((a, old_pod)) = agents.live.pop() {
                    a.abort();
                    pod = Some(old_pod);
                }
                tokio::time::sleep(Duration::from_millis(*gap_ms)).await;
                agents.start(pod).await.context(what.clone())?;
            }
            Action::Rollout { overlap_ms } => {
                // maxSurge: a new pod next to the old one, which stops after the overlap
                // and whose pod object then goes.
                agents.start(None).await.context(what.clone())?;
                if agents.live.len() > 1 {
                    let (old, (old_name, _)) = agents.live.remove(0);
                    let (agent, pod) = (old.abort_handle(), old_name.clone());
                    let overlap = Duration::from_millis(*overlap_ms);
                    let pods = agents.pods.clone();
                    let stalls = probe.stalls.clone();
                    let task = tokio::spawn(async move {
                        tokio::time::sleep(overlap).await;
                        // STOP_WITHIN of time the process could run: a stall on a loaded
                        // machine holds the stop as much as anything else.
                        let from = SystemTime::now();
                        let stopped = old.stop_within(STOP_WITHIN * 4).await;
                        let took = from.elapsed().unwrap_or_default();
                        let stalled = stalls
                            .lock()
                            .map(|v| {
                                crate::timeline::check::stalled_within(&v, from, SystemTime::now())
                            })
                            .unwrap_or_default();
                        let _ = pods.delete(&old_name, &Default::default()).await;
                        match stopped {
                            Ok(false) => {
                                anyhow::bail!("the stop took over {:?}: killed", STOP_WITHIN * 4)
                            }
                            Ok(true) if took > STOP_WITHIN + stalled => anyhow::bail!(
                                "the stop took {took:?}, over {STOP_WITHIN:?} and the {stalled:?} the process stalled"
                            ),
                            other => other.map(|_| ()),
                        }
                    });
                    agents.stopping.push(Stopping { task, agent, pod });
                }
            }
            Action::Fault(f) => {
                let faults = cluster.emulator().faults();
                let node_path = format!("/api/v1/nodes/{NODE}");
                match *f {
                    KubeFault::FailNode { n, status } => faults.inject(FaultRule::status(
                        Some(Method::PATCH),
                        &node_path,
                        n,
                        status,
                    )),
                    KubeFault::FailGameServers { n, status } => faults.inject(FaultRule::status(
                        Some(Method::PATCH),
                        "/gameservers/",
                        n,
                        status,
                    )),
                    KubeFault::HangNode => {
                        faults.inject(FaultRule::hang(Some(Method::PATCH), &node_path, 1))
                    }
                    KubeFault::HangGameServers => {
                        faults.inject(FaultRule::hang(Some(Method::PATCH), "/gameservers/", 1))
                    }
                    KubeFault::FailEvictions { n } => {
                        faults.inject(FaultRule::status(Some(Method::POST), "/eviction", n, 503))
                    }
                    KubeFault::FailReleases { n, status: 429 } => {
                        faults.inject(FaultRule::throttle(
                            Some(Method::DELETE),
                            "/gameservers/",
                            n,
                            RELEASE_RETRY_AFTER,
                        ))
                    }
                    KubeFault::FailReleases { n, status } => faults.inject(FaultRule::status(
                        Some(Method::DELETE),
                        "/gameservers/",
                        n,
                        status,
                    )),
                    KubeFault::LoseAnswer(write) => {
                        let (method, path) = match write {
                            Write::Node => (Method::PATCH, node_path.as_str()),
                            Write::GameServer => (Method::PATCH, "/gameservers/"),
                            Write::Release => (Method::DELETE, "/gameservers/"),
                            Write::Eviction => (Method::POST, "/eviction"),
                        };
                        faults.inject(FaultRule::lose_answer(Some(method), path, 1))
                    }
                    KubeFault::LagWatches { ms } => {
                        for resource in ["pods", "gameservers"] {
                            faults.delay_watches(crate::kube::faults::WatchDelay::resource(
                                resource,
                                Duration::from_millis(ms),
                            ));
                        }
                    }
                }
            }
            Action::FailDeregister => gl.fail_next("DeregisterGameServer", 1, 500),
            Action::DeregisterAnswerLost => gl.lose_next("DeregisterGameServer", 1),
            Action::AsgCompleteAnswerLost => asg.lose_next("CompleteLifecycleAction", 1),
            Action::GameLiftForgets => {
                // What it forgets is a registration: on a loaded machine the agent may still
                // be registering (a draining node's agent registers nothing: then nothing).
                for _ in 0..40 {
                    if gl.game_server(GROUP, &iid).is_some_and(|g| g.registered) {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                at = SystemTime::now();
                note = gl.forget_game_server(GROUP, &iid).to_string();
            }
            Action::MachineReturns => {
                // Down: every agent on the node with it, one a rollout is stopping too
                // (its pod, being deleted, does not start again).
                let mut pods = vec![];
                for (a, pod) in agents.live.drain(..) {
                    a.abort();
                    pods.push(pod);
                }
                for old in agents.stopping.drain(..) {
                    old.agent.abort();
                    old.task.abort();
                    let _ = agents.pods.delete(&old.pod, &Default::default()).await;
                }
                // Up again: a new boot, the old boot's notices gone.
                imds.set_scheduled_events(json!([]));
                imds.set_spot_action(None);
                scheduled_id = 0;
                gce.set("maintenance-event", "NONE");
                gce.set("preempted", "FALSE");
                gce.remove("upcoming-maintenance");
                imds.set_rebalance(None);
                gce_event = "NONE";
                gce_glitch = false;
                az.set_events(vec![]);
                if tl.fleetiq {
                    gl.set_instance_status(&iid, InstanceStatus::Active);
                    publish(redis, &iid, &status(Status::Active, &iid))
                        .await
                        .context(what.clone())?;
                }
                boots += 1;
                let boot = format!("boot-{boots}");
                if tl.boot_id_lag {
                    // The kubelet posts the new boot id with its next node status, after the
                    // restarted agents' first reads of the Node (a start reads it twice: its
                    // watch's list and a look at the record).
                    let after = cluster
                        .emulator()
                        .journal()
                        .entries()
                        .last()
                        .map_or(0, |e| e.seq);
                    boot_reports.push(kubelet::report_boot_after_reads(
                        cluster.emulator().journal().clone(),
                        cluster.store().clone(),
                        kubelet::LateBoot {
                            node: NODE.to_string(),
                            boot_id: boot,
                            after_seq: after,
                            reads: 2,
                            within: Duration::from_secs(5),
                        },
                        |identity| agent_pod(identity).is_some(),
                    ));
                } else {
                    cluster.set_boot_id(NODE, &boot)?;
                }
                at = SystemTime::now();
                // The kubelet starts each agent container again in its pod.
                for pod in pods {
                    agents.start(Some(pod)).await.context(what.clone())?;
                }
            }
            Action::LateServer => {
                if late.is_none() {
                    late = Some(LateServer::arm(cluster.store().clone()));
                }
            }
            Action::Allocate(safe) => {
                let mut req = AllocationRequest::fleet(NS, safe.fleet()).on_node(NODE);
                if tl.exclusion_selector {
                    req = req.selector(EXCLUSION);
                }
                let c = alloc_client.clone();
                allocations.push(tokio::spawn(async move {
                    let _ = allocator::allocate(&c, &req).await;
                }));
            }
            Action::AllocateAtFence(safe) => {
                // The releases that follow the fence take a moment to answer, as on a busy
                // API server, so the allocator can get in between the fence and a release.
                cluster.emulator().faults().inject(FaultRule::delay(
                    Some(Method::DELETE),
                    "/gameservers/",
                    3,
                    Duration::from_millis(40),
                ));
                let (exclusion, safe) = (tl.exclusion_selector, *safe);
                let (c, store) = (alloc_client.clone(), cluster.store().clone());
                allocations.push(tokio::spawn(async move {
                    // Until the fence goes up (a timeline that never fences gives up).
                    let give_up = tokio::time::Instant::now() + Duration::from_secs(8);
                    while !store
                        .get(&crate::kube::resources::NODES, None, NODE)
                        .is_some_and(|n| has_own_taint(&n))
                    {
                        if tokio::time::Instant::now() > give_up {
                            return;
                        }
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                    // The drawn Fleet first, then the others: whichever still has a
                    // Ready server on the node.
                    let first = Safe::ALL.iter().position(|s| *s == safe).unwrap_or(0);
                    for pause in [0, 10, 30] {
                        tokio::time::sleep(Duration::from_millis(pause)).await;
                        for i in 0..Safe::ALL.len() {
                            let fleet = Safe::ALL[(first + i) % Safe::ALL.len()].fleet();
                            let mut req = AllocationRequest::fleet(NS, fleet).on_node(NODE);
                            if exclusion {
                                req = req.selector(EXCLUSION);
                            }
                            if let Ok(Some(_)) = allocator::allocate(&c, &req).await {
                                break;
                            }
                        }
                    }
                }));
            }
            Action::ImdsRebalance => {
                let notice = floor_secs(at);
                imds.set_rebalance(Some(json!({ "noticeTime": rfc3339(notice) })));
                // The operator's TTL counts from the notice: then it no longer holds the node.
                let ttl = Duration::from_millis(tl.rebalance_ttl_ms);
                expiries.push(Applied {
                    at: notice + ttl,
                    action: Action::RebalanceExpires,
                    effect: effect_of(&tl, t0, notice + ttl, &Action::RebalanceExpires),
                    note: String::new(),
                });
            }
            Action::RebalanceExpires | Action::NodeClaimFence { .. } | Action::GceMigrating => {}
            Action::StrayServer { refusals } => {
                // On the node the agent says is empty (its own phase gauge): ordered, not timed.
                let agent = agents.live.first().map(|(a, _)| a);
                let _ = try_eventually(
                    "the agent says the node is empty",
                    Duration::from_secs(5),
                    Duration::from_millis(10),
                    || async {
                        let m = agent?.metrics().await;
                        (crate::agent::metric(&m, "lastcall_drain_phase", &[("phase", "empty")])
                            == Some(1.0))
                        .then_some(())
                    },
                )
                .await;
                at = SystemTime::now();
                // Its pod seen late (a lagging pod watch): the first pass that knows of it
                // has its GameServer only, and releases it.
                cluster.emulator().faults().delay_watches(
                    crate::kube::faults::WatchDelay::resource("pods", STRAY_POD_LAG),
                );
                // Its releases refused (429, `Retry-After`) as long as drawn: the agent's
                // passes fail meanwhile.
                cluster.emulator().faults().inject(FaultRule::throttle(
                    Some(Method::DELETE),
                    "/gameservers/",
                    *refusals,
                    RELEASE_RETRY_AFTER,
                ));
                cluster.create_game_server(
                    GameServerSpec::new(STRAY)
                        .namespace(NS)
                        .node_selector("example.com/team", "blue")
                        .grace_seconds(1)
                        .toleration(k8s_openapi::api::core::v1::Toleration {
                            operator: Some("Exists".into()),
                            ..Default::default()
                        }),
                )?;
                // The next step (the hand-off's source) comes after its first refusal.
                let _ = try_eventually(
                    "the stray server's release refused",
                    Duration::from_secs(5),
                    Duration::from_millis(5),
                    || async {
                        (cluster.emulator().journal().count(|e| {
                            e.identity.as_deref().and_then(agent_pod).is_some()
                                && e.name.as_deref() == Some(STRAY)
                                && e.status == 429
                        }) > 0)
                            .then_some(())
                    },
                )
                .await;
                note = STRAY.to_string();
            }
            Action::GceUpcoming { status, window_ms } => {
                let start = ceil_secs(t0 + Duration::from_millis(*window_ms));
                let state = match status {
                    Upcoming::Pending => Some("PENDING"),
                    Upcoming::Ongoing => Some("ONGOING"),
                    Upcoming::Complete => None,
                };
                match state {
                    Some(state) => gce.set(
                        "upcoming-maintenance",
                        &json!({
                            "can_reschedule": if tl.gke_hand_back { "true" } else { "false" },
                            "latest_window_start_time": rfc3339(start),
                            "maintenance_status": state,
                            "type": "SCHEDULED",
                            "window_end_time": rfc3339(start + Duration::from_secs(3600)),
                            "window_start_time": rfc3339(start),
                        })
                        .to_string(),
                    ),
                    None => gce.remove("upcoming-maintenance"),
                }
            }
            Action::OperatorCordon(on) => {
                let changed = std::sync::atomic::AtomicBool::new(false);
                at = edit_node(&operator, |n| {
                    let spec = n.spec.get_or_insert_default();
                    changed.store(
                        spec.unschedulable.unwrap_or(false) != *on,
                        std::sync::atomic::Ordering::SeqCst,
                    );
                    spec.unschedulable = Some(*on);
                })
                .await
                .context(what)?;
                // `kubectl cordon` on a node cordoned already changes nothing: no signal.
                if changed.load(std::sync::atomic::Ordering::SeqCst) {
                    note = "changed".into();
                }
            }
            Action::ApiRestart { down_ms } => {
                cluster.emulator().restart(Duration::from_millis(*down_ms));
            }
            Action::Reserve => {
                let ready = servers_on_node(&cluster, GameServerState::Ready);
                if !ready.is_empty() {
                    let name = &ready[rng.random_range(0..ready.len())];
                    // Deleted meanwhile (a release): nothing reserved.
                    if cluster.reserve(NS, name).is_ok() {
                        note = name.clone();
                    }
                }
            }
            Action::Unreserve => {
                let reserved = servers_on_node(&cluster, GameServerState::Reserved);
                if !reserved.is_empty() {
                    let name = &reserved[rng.random_range(0..reserved.len())];
                    if cluster.sdk_ready(NS, name).is_ok() {
                        note = name.clone();
                    }
                }
            }
            Action::TurnsReady => {
                if cluster.sdk_ready(NS, SLOW_STARTER).is_ok() {
                    note = SLOW_STARTER.to_string();
                }
            }
            Action::EndMatch => {
                let busy = in_matches(&cluster);
                let chosen: Vec<String> = if all {
                    busy
                } else if busy.is_empty() {
                    vec![]
                } else {
                    vec![busy[rng.random_range(0..busy.len())].clone()]
                };
                for name in &chosen {
                    // A server deleted meanwhile has nothing left to end.
                    let _ = cluster.sdk_shutdown(NS, name);
                }
                note = chosen.join(",");
            }
        }
        let effect = match action {
            Action::OperatorCordon(true) if note.is_empty() => None,
            _ => effect_of(&tl, t0, at, &action),
        };
        applied.push(Applied {
            at,
            action,
            effect,
            note,
        });
    }
    for a in allocations {
        let _ = a.await;
    }
    // An allocator that raced a late fence may have allocated after every match ended:
    // those matches end too, so a drain can finish (the game ends them as any other).
    let late_matches = in_matches(&cluster);
    if !late_matches.is_empty() {
        for name in &late_matches {
            let _ = cluster.sdk_shutdown(NS, name);
        }
        applied.push(Applied {
            at: SystemTime::now(),
            action: Action::EndMatch,
            effect: None,
            note: late_matches.join(","),
        });
    }
    // An empty body is a glitch, and a glitch ends: the metadata server answers its real
    // value again before the settle. Left standing, an agent started during it has never
    // read the source, so it holds the drain GCE asked for (as it must: an unknown source
    // neither cancels nor finishes a drain), and the settle would time a broken metadata
    // server rather than the agent. The truth is unchanged: an empty body never changed it.
    if gce_glitch {
        gce.set("maintenance-event", gce_event);
    }

    // Settle: the drain ends, deregistered or cancelled.
    let settled_from = SystemTime::now();
    applied.append(&mut expiries);
    applied.sort_by_key(|a| a.at);
    // What is live now: the steps, and GKE's answers to a hand-back so far.
    let live_now = || {
        let mut all = applied.clone();
        all.extend(hand_back.iter().flat_map(HandBack::so_far));
        all.sort_by_key(|a| a.at);
        super::truth::Truth::build(&all).last().clone()
    };
    // Where the machine's last life began: a deregistration only ends this life's drain.
    let life_start = applied
        .iter()
        .filter(|a| matches!(a.action, Action::MachineReturns))
        .map(|a| a.at)
        .max()
        .unwrap_or(t0);
    // A FleetIQ machine that came back with nothing asking registers again (the checker's
    // `not-registered-again`): the settle waits for that too.
    let must_register = tl.fleetiq
        && life_start > t0
        && !super::truth::Truth::build(&applied)
            .during(life_start, life_start + Duration::from_secs(3))
            .into_iter()
            .any(super::truth::asks_drain);
    let asg_began = applied
        .iter()
        .any(|a| matches!(a.action, Action::AsgTerminate));
    // The bound is SETTLE of time the process could run: stalls within it extend it (up to
    // twice SETTLE more), as for the reaction time the checker allows.
    let settle_started = tokio::time::Instant::now();
    let settled = try_eventually(
        "the drain ends",
        SETTLE * 3,
        Duration::from_millis(50),
        || async {
            // A dry run changes nothing: there is no drain to end (the checker holds it to
            // having sent nothing). It goes on as if each step had landed: given the time a
            // drain takes to hand over once empty, it would have deregistered by now.
            if mode.dry_run {
                return (settle_started.elapsed() > DRY_RUN_SETTLE).then(|| Ok(SystemTime::now()));
            }
            let stalled = crate::timeline::check::stalled_within(
                &probe.stalls_now(),
                settled_from,
                SystemTime::now(),
            );
            if settle_started.elapsed() > SETTLE + stalled.min(SETTLE * 2) {
                return Some(Err(format!(
                    "the drain ends within {SETTLE:?} (and {} ms the process stalled)",
                    stalled.as_millis()
                )));
            }
            // The Auto Scaling wait ends with the drain: the agent lets the instance go. A
            // wait that timed out is over too (the checker judges the timeout itself).
            let asg_done = !asg_began
                || asg.journal().iter().any(|e| {
                    matches!(
                        e.happening,
                        Happening::Completed { .. } | Happening::TimedOut { .. }
                    )
                });
            // So does an Azure event that asked for the drain, with approvals on: the agent
            // approves it once the node is empty (the checker judges when).
            // Only an event still listed can be approved (a Spot eviction gone from the
            // document stays a signal, but there is nothing left to approve).
            let live_at_end = live_now();
            let approvals = az.approvals();
            let azure_done = !tl.azure_approve
                || live_at_end.iter().all(|(id, s)| match id {
                    // An event that asks for no drain is the agent's to approve or not.
                    super::truth::SignalId::Azure(_) if !s.asks() => true,
                    super::truth::SignalId::Azure(ep) => {
                        !super::truth::azure_listed(&applied, *ep, SystemTime::now())
                            || approvals.contains(&azure_event_id(tl.seed, *ep))
                    }
                    _ => true,
                });
            let completed = asg_done && azure_done;
            let node = cluster.node(NODE)?;
            // The agent has seen the machine's current boot: the Node's marks are this
            // life's, not the one before a return.
            let this_life = node["metadata"]["annotations"]["lastcall.dev/drain-boot-id"]
                .as_str()
                .is_none_or(|b| Some(b) == node["status"]["nodeInfo"]["bootID"].as_str());
            // Deregistered in this life (GameLift may have dropped the server on its own:
            // the agent then records it once the node is empty), by a drain asked for now
            // or a deregistration this life made: a record from an earlier life ends nothing.
            let handed_over_this_life = super::truth::asks_drain(&live_at_end)
                || gl
                    .calls()
                    .iter()
                    .any(|c| c.op == "DeregisterGameServer" && c.at >= life_start)
                || applied
                    .iter()
                    .any(|a| matches!(a.action, Action::GameLiftForgets) && a.at >= life_start);
            if completed
                && tl.fleetiq
                && this_life
                && handed_over_this_life
                && annotation_of(&node, "lastcall.dev/deregistered")
            {
                return Some(Ok(SystemTime::now()));
            }
            // A hand-back GKE is still answering (the VM migrating): not over yet.
            let handing_back = node["metadata"]["labels"][HAND_BACK_LABEL].as_str() == Some("true")
                && hand_back.as_ref().is_some_and(|h| {
                    !h.so_far().iter().any(|a| {
                        matches!(
                            a.action,
                            Action::GceUpcoming {
                                status: Upcoming::Complete,
                                ..
                            }
                        )
                    })
                });
            // Without FleetIQ a drain that stays asked for ends with the node empty.
            if completed
                && !tl.fleetiq
                && this_life
                && !handing_back
                && !live_at_end.is_empty()
                && annotation_of(&node, "lastcall.dev/drain-started")
                && !cluster.pods_on(NODE).iter().any(is_game_pod)
            {
                return Some(Ok(SystemTime::now()));
            }
            // Nothing asks for a drain (a signal the agent may take or leave may be live): back
            // to how lastcall found it, or never drained.
            // GameLift's own record: registered again, or never deregistered (a second
            // registration of a registered game server is refused as a conflict).
            let registered =
                !must_register || gl.game_server(GROUP, &iid).is_some_and(|g| g.registered);
            if !super::truth::asks_drain(&live_at_end) && registered {
                let ours = has_own_marks(&node)
                    || cluster.game_servers().iter().any(|g| {
                        g.labels.contains_key("lastcall.dev/node-draining")
                            || g.annotations.contains_key("lastcall.dev/drain-deadline")
                    });
                if !ours {
                    return Some(Ok(SystemTime::now()));
                }
            }
            None
        },
    )
    .await
    .map_err(|e| format!("{} within {:?}", e.what, e.within))
    .and_then(|r| r)
    .map_err(|e| {
        let node = cluster.node(NODE).unwrap_or(Value::Null);
        format!(
            "{e}; live signals {:?}; requests held by a hang fault: {}; Node {}",
            live_now().keys().collect::<Vec<_>>(),
            cluster.emulator().faults().hung_now(),
            node_summary(&node)
        )
    });
    // A little longer, so late mistakes land in the journal too.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let stalls = probe.stop();
    let pods = sampler.stop();
    let late_servers = late.map(LateServer::stop).into_iter().flatten().collect();
    // GKE's answers to a hand-back are part of the truth.
    applied.extend(hand_back.map(HandBack::stop).into_iter().flatten());
    let mut boot_reads = vec![];
    for r in boot_reports {
        if let Ok(Ok(Some(seq))) = tokio::time::timeout(Duration::from_secs(6), r).await {
            boot_reads.push(seq);
        }
    }
    let mut agent_errors = vec![];
    for (a, _) in agents.live.drain(..) {
        a.abort();
    }
    for old in agents.stopping.drain(..) {
        let Ok(joined) = tokio::time::timeout(STOP_WITHIN * 2, old.task).await else {
            agent_errors.push("an old agent's stop never ended".into());
            continue;
        };
        match joined {
            Ok(Err(e)) => agent_errors.push(e.to_string()),
            Err(e) => agent_errors.push(e.to_string()),
            Ok(Ok(())) => {}
        }
    }
    let agents_starts = std::mem::take(&mut agents.starts);
    let kube_answers_lost = cluster.emulator().faults().answers_lost();
    let journal = cluster.emulator().journal().entries();
    let calls = gl.calls();
    let asg_journal = asg
        .journal()
        .into_iter()
        .filter(|e| e.instance.as_deref() == Some(iid.as_str()))
        .map(|e| {
            (
                asg_epoch.1 + e.at.saturating_duration_since(asg_epoch.0),
                e.happening,
            )
        })
        .collect();
    let azure_approvals = az.approvals_at();
    // Approvals start the event at once: part of the truth from then on.
    for (id, at) in &azure_approvals {
        if let Some(episode) = (1..=u8::MAX).find(|e| azure_event_id(tl.seed, *e) == *id) {
            let action = Action::AzureApproved { episode };
            let effect = effect_of(&tl, t0, *at, &action);
            applied.push(Applied {
                at: *at,
                action,
                effect,
                note: String::new(),
            });
        }
    }
    applied.sort_by_key(|a| a.at);
    cluster.emulator().faults().clear();
    // A connection a killed agent left behind can hold a graceful shutdown; the cluster
    // stops anyway when dropped.
    // (Not the agent's error: a slow shutdown is only reported.)
    if tokio::time::timeout(Duration::from_secs(5), cluster.shutdown())
        .await
        .is_err()
    {
        eprintln!("timeline {}: the cluster's shutdown took over 5 s", tl.seed);
    }
    Ok(Run {
        imds_scheduled_reads: imds.reads(IMDS_SCHEDULED),
        azure_event_reads: az.event_reads(),
        gce_maintenance_reads: gce
            .reads_by("maintenance-event")
            .into_iter()
            .filter_map(|(at, pod)| Some((at, pod?)))
            .collect(),
        timeline: tl,
        t0,
        applied,
        allocated_at_start,
        journal,
        calls,
        asg: asg_journal,
        azure_approvals,
        settled_from,
        settled,
        setup,
        agent_errors,
        stalls,
        pods,
        late_servers,
        answers_lost: gl.answers_lost(),
        kube_answers_lost,
        asg_answers_lost: asg.answers_lost(),
        starts: agents_starts,
        boot_reads,
    })
}

fn annotation_of(node: &Value, key: &str) -> bool {
    node["metadata"]["annotations"][key].is_string()
}

/// A pod of an Agones GameServer.
pub fn is_game_pod(p: &Value) -> bool {
    p.pointer("/metadata/labels/agones.dev~1role")
        .and_then(Value::as_str)
        == Some("gameserver")
}

/// The node's servers in a match (Allocated or Reserved, not being deleted).
/// The name of the game server that starts slowly ([`Timeline::slow_starter`]).
pub const SLOW_STARTER: &str = "starting-1";

/// Karpenter's annotation: when it deletes every pod left on the node.
const KARPENTER_TERMINATION: &str = "karpenter.sh/nodeclaim-termination-timestamp";

/// Puts the `key:NoSchedule` taint on `n` (with `value`), or takes it off.
fn set_taint(n: &mut Node, key: &str, value: &str, on: bool) {
    let taints = n
        .spec
        .get_or_insert_default()
        .taints
        .get_or_insert_default();
    taints.retain(|t| t.key != key);
    if on {
        taints.push(crate::cluster::fixtures::taint(key, value, "NoSchedule"));
    }
}

/// Sets label `key` on `n` to `value`, or removes it.
fn set_label(n: &mut Node, key: &str, value: Option<&str>) {
    let labels = n.metadata.labels.get_or_insert_default();
    match value {
        Some(v) => labels.insert(key.into(), v.into()),
        None => labels.remove(key),
    };
}

/// Whether the Node's recorded drain notices hold FleetIQ's Spot notice.
fn recorded_fleetiq_spot(node: &Value) -> bool {
    node["metadata"]["annotations"]["lastcall.dev/drain-notice"]
        .as_str()
        .and_then(|s| serde_json::from_str::<Vec<Value>>(s).ok())
        .is_some_and(|notices| {
            notices
                .iter()
                .any(|n| n["source"] == "fleetiq" && n["cause"] == "preemption")
        })
}

/// The node's game servers in `state`, not being deleted.
fn servers_on_node(cluster: &Cluster, state: GameServerState) -> Vec<String> {
    cluster
        .game_servers()
        .into_iter()
        .filter(|g| g.node.as_deref() == Some(NODE) && !g.deleting && g.state == Some(state))
        .map(|g| g.name)
        .collect()
}

fn in_matches(cluster: &Cluster) -> Vec<String> {
    cluster
        .game_servers()
        .into_iter()
        .filter(|g| {
            g.node.as_deref() == Some(NODE)
                && !g.deleting
                && matches!(
                    g.state,
                    Some(GameServerState::Allocated | GameServerState::Reserved)
                )
        })
        .map(|g| g.name)
        .collect()
}

/// The Node carries lastcall's fence taint.
fn has_own_taint(node: &Value) -> bool {
    node["spec"]["taints"]
        .as_array()
        .is_some_and(|t| t.iter().any(|t| t["key"] == "lastcall.dev/draining"))
}

/// The Node still carries something of a drain's (taint or drain annotations).
pub fn has_own_marks(node: &Value) -> bool {
    let taint = has_own_taint(node);
    let ann = node["metadata"]["annotations"]
        .as_object()
        .is_some_and(|a| DRAIN_NODE_ANNOTATIONS.iter().any(|k| a.contains_key(*k)));
    taint || ann
}

/// Node annotations that exist only while a drain does.
pub const DRAIN_NODE_ANNOTATIONS: [&str; 4] = [
    "lastcall.dev/drain-started",
    "lastcall.dev/drain-cause",
    "lastcall.dev/cordoned-by-lastcall",
    "lastcall.dev/drain-notice",
];

/// Cordon, taint keys and lastcall annotations of a Node, for messages.
pub fn node_summary(node: &Value) -> String {
    let taints: Vec<&str> = node["spec"]["taints"]
        .as_array()
        .map(|t| t.iter().filter_map(|t| t["key"].as_str()).collect())
        .unwrap_or_default();
    let ann: Vec<String> = node["metadata"]["annotations"]
        .as_object()
        .map(|a| {
            a.iter()
                .filter(|(k, _)| k.starts_with("lastcall.dev/"))
                .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
                .collect()
        })
        .unwrap_or_default();
    format!(
        "unschedulable={} taints={taints:?} annotations={ann:?}",
        node["spec"]["unschedulable"].as_bool().unwrap_or(false)
    )
}
