//! The local demo (`lastcall-demo`): one FleetIQ drain, told step by step on stdout.
//!
//! Everything lastcall talks to runs here (the Kubernetes API emulator with its cluster
//! model, the GameLift emulator) or next to it (a private `redis-server`), while lastcall
//! itself runs as the real `lastcall-agent` and `lastcall-pubsub` processes, configured the
//! way a deployment configures them. So what the demo shows is what production code does,
//! not a re-enactment. Every wait is bounded: a step that does not happen fails the demo
//! with what was expected, and every process is stopped on the way out.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use futures::StreamExt;
use lastcall_agent::keys;
use lastcall_common::fleetiq::{InstanceStatus as Status, StatusMessage};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWriteExt, BufReader};
use tokio::process::Command;
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::agent::{metric, scrape};
use crate::bins::try_workspace_binary;
use crate::cluster::objects::NodeInfo;
use crate::cluster::{
    AllocationRequest, Cluster, ClusterConfig, ClusterError, FleetSpec, GameServerState as S,
    GameServerView, NodeSpec,
};
use crate::eventually::{TimedOut, try_eventually};
use crate::gamelift::{GameLiftEmulator, InstanceStatus};
use crate::net::try_free_port;
use crate::process;
use crate::redis::RedisServer;

/// The cluster's nodes; each gets one agent and one FleetIQ instance `i-<node>`.
pub const NODES: [&str; 3] = ["node-a", "node-b", "node-c"];
/// The node GameLift takes away.
pub const DOOMED: &str = "node-a";
/// The FleetIQ game server group of every instance.
pub const GROUP: &str = "demo-group";
const NS: &str = "default";
const FLEET: &str = "demo";
const REPLICAS: usize = 12;
/// Matches running before the drain, per node: node-a keeps two Ready servers to release
/// and one Allocated plus one Reserved server to protect.
const ALLOCATIONS: [(&str, usize); 3] = [("node-a", 1), ("node-b", 2), ("node-c", 1)];
/// pubsub's publish period: GameLift's advised minimum, so the demo is as quick as allowed.
const PUBSUB_PERIOD: Duration = Duration::from_secs(10);
const HEARTBEAT_INTERVAL: &str = "5s";
/// Pod grace period of the Fleet's servers: short, so released servers leave quickly.
const POD_GRACE_SECONDS: i64 = 2;
/// How long a process gets to exit after SIGTERM before it is killed.
const STOP_WITHIN: Duration = Duration::from_secs(10);
const POLL_EVERY: Duration = Duration::from_millis(50);

/// How the demo runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// Echo the processes' logs (prefixed with their name) as well as writing them to files.
    pub verbose: bool,
    /// After the story, keep everything up until Ctrl-C.
    pub keep_running: bool,
    /// Bound on each step's wait.
    pub timeout: Duration,
    /// Where logs, kubeconfigs and the groups file go; default: a new temp dir, kept.
    pub log_dir: Option<PathBuf>,
}

/// Why the demo did not complete.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error(
        "{0}. Install it (Debian/Ubuntu: `sudo apt-get install -y redis-server`; \
         macOS: `brew install redis`) and run the demo again"
    )]
    RedisMissing(String),
    #[error("{what}")]
    Setup {
        what: String,
        #[source]
        source: anyhow::Error,
    },
    #[error("expected {expected} within {}s; it did not happen", .within.as_secs())]
    Timeout { expected: String, within: Duration },
    #[error("expected {expected}, but {found}")]
    Unexpected { expected: String, found: String },
    #[error("{0}")]
    ProcessExited(String),
    #[error("a process did not stop cleanly: {0}")]
    Unclean(String),
    #[error("interrupted by {0}")]
    Interrupted(&'static str),
}

fn setup<E>(what: impl Into<String>) -> impl FnOnce(E) -> DemoError
where
    E: Into<anyhow::Error>,
{
    let what = what.into();
    move |e| DemoError::Setup {
        what,
        source: e.into(),
    }
}

/// Runs the demo to the end (or to the first failure), then stops everything.
pub async fn run(opts: Options) -> Result<(), DemoError> {
    let began = Instant::now();
    let dir = match prepare_dir(&opts) {
        Ok(d) => d,
        Err(e) => {
            println!("DEMO FAILED: {}", chain(&e));
            return Err(e);
        }
    };
    init_tracing(&dir);
    println!("lastcall demo");
    println!("  logs, kubeconfigs and the groups file: {}", dir.display());
    let (early_tx, early_rx) = watch::channel(None);
    let mut world = World {
        opts: opts.clone(),
        dir: dir.clone(),
        procs: Processes {
            list: Vec::new(),
            early: early_tx,
            verbose: opts.verbose,
        },
        env: None,
        agents: Vec::new(),
        pubsub_admin: None,
        deregistered: false,
    };
    let mut outcome = tokio::select! {
        r = world.story() => r,
        why = early_exit(early_rx.clone()) => Err(DemoError::ProcessExited(why)),
        sig = interrupted() => Err(DemoError::Interrupted(sig)),
    };
    if outcome.is_ok() && opts.keep_running {
        world.print_keep_running();
        outcome = tokio::select! {
            why = early_exit(early_rx.clone()) => Err(DemoError::ProcessExited(why)),
            sig = interrupted() => {
                println!("\n{sig} received: stopping");
                Ok(())
            }
        };
    }
    if let Err(e) = &outcome {
        println!();
        println!("DEMO FAILED: {}", chain(e));
        world.print_log_tails();
    }
    let story_ok = outcome.is_ok();
    let stopped = world.shut_down().await;
    if let (true, Err(e)) = (story_ok, &stopped) {
        println!();
        println!("DEMO FAILED: {}", chain(e));
    }
    let outcome = outcome.and(stopped);
    if outcome.is_ok() {
        println!();
        println!(
            "Demo complete: {DOOMED} was fenced, its idle game servers were released and replaced \
             elsewhere, its matches were protected until they ended, and it was deregistered from \
             FleetIQ exactly once."
        );
    }
    println!(
        "Took {:.1}s. Logs: {}",
        began.elapsed().as_secs_f64(),
        dir.display()
    );
    outcome
}

/// An error with its causes, `outer: inner: root`.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

fn prepare_dir(opts: &Options) -> Result<PathBuf, DemoError> {
    match &opts.log_dir {
        Some(d) => {
            std::fs::create_dir_all(d)
                .map_err(setup(format!("creating --log-dir {}", d.display())))?;
            Ok(d.clone())
        }
        None => tempfile::Builder::new()
            .prefix("lastcall-demo-")
            .tempdir()
            .map(tempfile::TempDir::keep)
            .map_err(setup("creating a temp dir for the demo's files")),
    }
}

/// The demo's own (in-process emulators') logs go to `demo.log`, never to stdout.
fn init_tracing(dir: &Path) {
    let Ok(file) = std::fs::File::create(dir.join("demo.log")) else {
        return;
    };
    let _ = tracing_subscriber::fmt()
        .with_writer(std::sync::Mutex::new(file))
        .with_ansi(false)
        .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
        .try_init();
}

// ---- the world ----------------------------------------------------------------------

/// What runs in this process.
struct Env {
    cluster: Cluster,
    gamelift: GameLiftEmulator,
    redis: RedisServer,
}

struct AgentInfo {
    node: &'static str,
    instance: String,
    admin: SocketAddr,
    kubeconfig: PathBuf,
    /// When its process was started.
    started: Instant,
}

struct World {
    opts: Options,
    dir: PathBuf,
    procs: Processes,
    env: Option<Env>,
    agents: Vec<AgentInfo>,
    pubsub_admin: Option<SocketAddr>,
    /// The story reached the deregistration (checked again after SIGTERM).
    deregistered: bool,
}

/// What the drain step leaves for the next one.
struct Drained {
    /// The Allocated and Reserved servers of the doomed node, with their state.
    protected: Vec<(String, S)>,
    released: usize,
}

fn not_started() -> DemoError {
    DemoError::Unexpected {
        expected: "the emulators to be running".into(),
        found: "they were not started".into(),
    }
}

fn instance_id(node: &str) -> String {
    crate::gamelift::instance_id(node)
}

fn heading(n: u32, title: &str) {
    println!();
    println!("[{n}/6] {title}");
}

fn since(t0: Instant, t: Instant) -> String {
    format!("+{:.2}s", t.saturating_duration_since(t0).as_secs_f64())
}

impl World {
    fn env(&self) -> Result<&Env, DemoError> {
        self.env.as_ref().ok_or_else(not_started)
    }

    async fn story(&mut self) -> Result<(), DemoError> {
        self.start_world().await?;
        self.start_lastcall().await?;
        self.wait_ready().await?;
        let drained = self.drain().await?;
        self.end_matches(&drained).await
    }

    // ---- 1 ----------------------------------------------------------------------------

    async fn start_world(&mut self) -> Result<(), DemoError> {
        heading(1, "Start the emulated world");
        if let Err(e) = crate::tools::ensure("redis-server", "redis-server") {
            return Err(DemoError::RedisMissing(format!("{e:#}")));
        }
        let within = self.opts.timeout;
        let cluster = Cluster::start(ClusterConfig::default())
            .await
            .map_err(setup("starting the Kubernetes API emulator"))?;
        println!(
            "  Kubernetes API emulator  {}  (cluster model: scheduler, kubelets, Agones controllers)",
            cluster.emulator().url()
        );
        for node in NODES {
            cluster
                .add_node(NodeSpec::new(node))
                .map_err(setup(format!("adding node {node}")))?;
        }
        println!("  nodes                    {}", NODES.join(", "));
        let started = Instant::now();
        cluster
            .create_fleet(FleetSpec::new(FLEET, REPLICAS as i64).grace_seconds(POD_GRACE_SECONDS))
            .map_err(setup("creating the Fleet"))?;
        until(
            &cluster,
            &format!("{REPLICAS} Ready game servers in Fleet {NS}/{FLEET}"),
            within,
            |c| (up(c).filter(|g| g.state == Some(S::Ready)).count() == REPLICAS).then_some(()),
        )
        .await?;
        println!(
            "  Fleet {NS}/{FLEET}       {REPLICAS} game servers, all Ready after {:.1}s",
            started.elapsed().as_secs_f64()
        );
        let mut allocated = Vec::new();
        for (node, n) in ALLOCATIONS {
            for _ in 0..n {
                let req = AllocationRequest::fleet(NS, FLEET).on_node(node);
                let gs = cluster
                    .allocate(&req)
                    .await
                    .map_err(setup(format!("allocating a game server on {node}")))?
                    .ok_or_else(|| DemoError::Unexpected {
                        expected: format!("a Ready game server to allocate on {node}"),
                        found: "the allocator answered UnAllocated".into(),
                    })?;
                allocated.push(format!("{} ({node})", gs.name));
            }
        }
        println!("  allocated (matches on)   {}", allocated.join(", "));
        let reserved = up(&cluster)
            .filter(|g| g.node.as_deref() == Some(DOOMED) && g.state == Some(S::Ready))
            .map(|g| g.name)
            .min()
            .ok_or_else(|| DemoError::Unexpected {
                expected: format!("a Ready game server on {DOOMED} to reserve"),
                found: "none is Ready".into(),
            })?;
        cluster
            .reserve(NS, &reserved)
            .map_err(setup(format!("reserving {reserved}")))?;
        println!("  reserved (SDK Reserve)   {reserved} ({DOOMED})");

        let gamelift = GameLiftEmulator::start()
            .await
            .map_err(setup("starting the GameLift emulator"))?;
        gamelift.add_group(GROUP);
        let ids: Vec<String> = NODES.iter().map(|n| instance_id(n)).collect();
        gamelift.add_instances(GROUP, &ids, InstanceStatus::Active);
        println!(
            "  GameLift emulator        {}  group {GROUP}: {} ACTIVE",
            gamelift.url(),
            ids.join(", ")
        );
        let redis = RedisServer::start()
            .await
            .map_err(setup("starting redis-server"))?;
        println!(
            "  redis-server             {}  (private, no persistence)",
            redis.url()
        );
        self.env = Some(Env {
            cluster,
            gamelift,
            redis,
        });
        Ok(())
    }

    // ---- 2 ----------------------------------------------------------------------------

    async fn start_lastcall(&mut self) -> Result<(), DemoError> {
        heading(
            2,
            "Start lastcall: one agent process per node, one pubsub process",
        );
        println!("  building lastcall-agent and lastcall-pubsub if needed (cargo build)");
        let agent_bin = build("lastcall-agent", "lastcall-agent").await?;
        let pubsub_bin = build("lastcall-pubsub", "lastcall-pubsub").await?;
        println!("  binaries                 {}", agent_bin.display());
        println!("                           {}", pubsub_bin.display());
        let env = self.env.as_ref().ok_or_else(not_started)?;
        let groups = self.dir.join("fleetiq.conf");
        // The original adapter's `fleetiq.conf` format, as the ConfigMap holds it.
        let groups_json = format!("{{\"GameServerGroups\": [\"{GROUP}\"]}}");
        std::fs::write(&groups, &groups_json)
            .map_err(setup(format!("writing {}", groups.display())))?;
        println!(
            "  groups file              {}  {groups_json}",
            groups.display()
        );
        let admin_kubeconfig = self.dir.join("kubeconfig");
        env.cluster
            .emulator()
            .write_kubeconfig(&admin_kubeconfig, "admin")
            .map_err(setup("writing the kubeconfig"))?;

        for node in NODES {
            let kubeconfig = self.dir.join(format!("kubeconfig-{node}"));
            env.cluster
                .emulator()
                .write_kubeconfig(&kubeconfig, node)
                .map_err(setup(format!("writing {}", kubeconfig.display())))?;
            let listen = SocketAddr::from(([127, 0, 0, 1], free_port()?));
            let instance = instance_id(node);
            let mut cmd = Command::new(&agent_bin);
            base_env(&mut cmd, &self.dir);
            cmd.env("KUBECONFIG", &kubeconfig).args([
                "--node-name",
                node,
                "--instance-id",
                &instance,
                "--game-server-group",
                GROUP,
                "--redis-url",
                &env.redis.url(),
                "--gamelift-endpoint",
                &env.gamelift.url(),
                "--listen",
                &listen.to_string(),
                "--heartbeat-interval",
                HEARTBEAT_INTERVAL,
                "--publish-period",
                &format!("{}s", PUBSUB_PERIOD.as_secs()),
            ]);
            let log = self.dir.join(format!("agent-{node}.log"));
            let started = Instant::now();
            let pid = self.procs.spawn(&format!("agent {node}"), cmd, &log)?;
            println!(
                "  lastcall-agent {node}    pid {pid:<7} {instance:<9} http://{listen}  log {}",
                log.display()
            );
            self.agents.push(AgentInfo {
                node,
                instance,
                admin: listen,
                kubeconfig,
                started,
            });
        }

        let listen = SocketAddr::from(([127, 0, 0, 1], free_port()?));
        let mut cmd = Command::new(&pubsub_bin);
        base_env(&mut cmd, &self.dir);
        cmd.args([
            "--config-file",
            &groups.to_string_lossy(),
            "--period",
            &format!("{}s", PUBSUB_PERIOD.as_secs()),
            "--cycle-jitter",
            "0s",
            "--redis-url",
            &env.redis.url(),
            "--gamelift-endpoint",
            &env.gamelift.url(),
            "--listen",
            &listen.to_string(),
        ]);
        let log = self.dir.join("pubsub.log");
        let pid = self.procs.spawn("pubsub", cmd, &log)?;
        println!(
            "  lastcall-pubsub          pid {pid:<7} period {}s  http://{listen}  log {}",
            PUBSUB_PERIOD.as_secs(),
            log.display()
        );
        self.pubsub_admin = Some(listen);
        Ok(())
    }

    // ---- 3 ----------------------------------------------------------------------------

    async fn wait_ready(&mut self) -> Result<(), DemoError> {
        heading(3, "Wait for lastcall to be ready");
        let env = self.env()?;
        let within = self.opts.timeout;
        let http = http_client()?;
        for a in &self.agents {
            poll(
                &format!("agent {} to answer /readyz with 200", a.node),
                within,
                || readyz(&http, a.admin),
            )
            .await?;
            poll(
                &format!(
                    "agent {} to register and claim {} in FleetIQ (UTILIZED)",
                    a.node, a.instance
                ),
                within,
                || async {
                    env.gamelift
                        .game_server(GROUP, &a.instance)
                        .filter(|r| r.registered && r.utilization == "UTILIZED")
                        .map(|_| ())
                },
            )
            .await?;
            let node = a.node;
            let owned = until(
                &env.cluster,
                &format!(
                    "agent {node} to record its registration and label its game servers {}={node}",
                    keys::LABEL_NODE
                ),
                within,
                |c| {
                    let registered = node_annotation(c, node, keys::ANN_REGISTERED).is_some();
                    let mine: Vec<GameServerView> =
                        up(c).filter(|g| g.node.as_deref() == Some(node)).collect();
                    let labelled = mine
                        .iter()
                        .all(|g| g.labels.get(keys::LABEL_NODE).map(String::as_str) == Some(node));
                    (registered && labelled).then_some(mine.len())
                },
            )
            .await?;
            println!(
                "  agent {node}: ready {:.1}s after its start, registered and claimed in FleetIQ as {} \
                 (UTILIZED, heartbeat every {HEARTBEAT_INTERVAL}), watching its {owned} game servers",
                a.started.elapsed().as_secs_f64(),
                a.instance
            );
        }
        if let Some(admin) = self.pubsub_admin {
            poll(
                "pubsub to answer /readyz with 200 (a first cycle published)",
                within,
                || readyz(&http, admin),
            )
            .await?;
            let published = metric(
                &scrape(admin).await,
                "lastcall_pubsub_messages_published_total",
                &[],
            )
            .unwrap_or(0.0);
            println!(
                "  pubsub: ready; its first cycle published {published} statuses (all ACTIVE) to Redis"
            );
        }
        println!();
        println!("  The cluster:");
        print_cluster(&env.cluster);
        Ok(())
    }

    // ---- 4 ----------------------------------------------------------------------------

    async fn drain(&mut self) -> Result<Drained, DemoError> {
        let iid = instance_id(DOOMED);
        heading(4, &format!("GameLift marks {iid} ({DOOMED}) DRAINING"));
        let env = self.env()?;
        let within = self.opts.timeout;
        let cluster = &env.cluster;
        let here: Vec<GameServerView> = up(cluster)
            .filter(|g| g.node.as_deref() == Some(DOOMED))
            .collect();
        let ready: BTreeSet<String> = here
            .iter()
            .filter(|g| g.state == Some(S::Ready))
            .map(|g| g.name.clone())
            .collect();
        let protected: Vec<(String, S)> = here
            .iter()
            .filter_map(|g| match g.state {
                Some(s @ (S::Allocated | S::Reserved)) => Some((g.name.clone(), s)),
                _ => None,
            })
            .collect();
        let names_before: BTreeSet<String> =
            cluster.game_servers().into_iter().map(|g| g.name).collect();
        let ready_total = up(cluster).filter(|g| g.state == Some(S::Ready)).count();

        let published = watch_channel(&env.redis.url(), &iid).await?;
        env.gamelift
            .set_instance_status(&iid, InstanceStatus::Draining);
        let t0 = Instant::now();
        println!(
            "  t=0     the GameLift emulator reports {iid} DRAINING (its Auto Scaling group is taking it away)"
        );
        println!(
            "          pubsub will publish within one period ({}s); {DOOMED}'s agent is subscribed to channel {iid}",
            PUBSUB_PERIOD.as_secs()
        );

        let (published_at, body) = tokio::time::timeout(within, published)
            .await
            .map_err(|_| DemoError::Timeout {
                expected: format!("pubsub to publish DRAINING on Redis channel {iid}"),
                within,
            })?
            .map_err(|_| DemoError::Unexpected {
                expected: format!("a DRAINING message on Redis channel {iid}"),
                found: "the Redis subscription ended".into(),
            })?;
        println!(
            "  {:<7} pubsub published on channel {iid}: {body}",
            since(t0, published_at)
        );

        let taint = until(
            cluster,
            &format!("{DOOMED} cordoned and tainted {}", keys::TAINT_DRAINING),
            within,
            |c| {
                let n = NodeInfo::parse(&c.node(DOOMED)?).ok()?;
                let t = n
                    .taints
                    .iter()
                    .find(|(t, _)| t.key == keys::TAINT_DRAINING)?;
                n.unschedulable.then(|| taint_text(&t.0))
            },
        )
        .await?;
        let fenced_at = Instant::now();
        println!(
            "  {:<7} {DOOMED} fenced: cordoned and tainted {taint} ({} ms after the publish)",
            since(t0, fenced_at),
            fenced_at
                .saturating_duration_since(published_at)
                .as_millis()
        );

        let mut left: BTreeSet<String> = ready.clone();
        while !left.is_empty() {
            let gone: Vec<String> = until(
                cluster,
                &format!(
                    "{DOOMED}'s Ready game servers released: {}",
                    left.iter().cloned().collect::<Vec<_>>().join(", ")
                ),
                within,
                |c| {
                    let gone: Vec<String> = left
                        .iter()
                        .filter(|n| c.game_server(NS, n).is_none_or(|g| g.deleting))
                        .cloned()
                        .collect();
                    (!gone.is_empty()).then_some(gone)
                },
            )
            .await?;
            for name in gone {
                println!(
                    "  {:<7} released {name}: it was Ready (idle), so lastcall deleted it (uid + resourceVersion preconditions)",
                    since(t0, Instant::now())
                );
                left.remove(&name);
            }
        }

        let annotated = until(
            cluster,
            &format!(
                "{DOOMED}'s Allocated and Reserved game servers annotated {}",
                keys::ANN_GS_DEADLINE
            ),
            within,
            |c| {
                protected
                    .iter()
                    .map(|(name, _)| {
                        let g = c.game_server(NS, name)?;
                        let deadline = g.annotations.get(keys::ANN_GS_DEADLINE)?.clone();
                        let reason = g.annotations.get(keys::ANN_GS_REASON).cloned();
                        Some((g, deadline, reason))
                    })
                    .collect::<Option<Vec<_>>>()
            },
        )
        .await?;
        let at = since(t0, Instant::now());
        for (g, deadline, reason) in annotated {
            if g.deleting {
                return Err(DemoError::Unexpected {
                    expected: format!("{} (in a match) to be kept", g.name),
                    found: "it is being deleted".into(),
                });
            }
            println!(
                "  {at:<7} protected {} ({}): kept running, {}={deadline}, {}={}, label {}={}",
                g.name,
                g.state.map(S::as_str).unwrap_or("?"),
                keys::ANN_GS_DEADLINE,
                keys::ANN_GS_REASON,
                reason.as_deref().unwrap_or("-"),
                keys::LABEL_NODE_DRAINING,
                g.labels
                    .get(keys::LABEL_NODE_DRAINING)
                    .map(String::as_str)
                    .unwrap_or("-"),
            );
        }

        let replacements = until(
            cluster,
            &format!("{ready_total} Ready game servers again, none on {DOOMED}"),
            within,
            |c| {
                let ready_elsewhere: Vec<GameServerView> = up(c)
                    .filter(|g| g.state == Some(S::Ready) && g.node.as_deref() != Some(DOOMED))
                    .collect();
                (ready_elsewhere.len() >= ready_total).then(|| {
                    ready_elsewhere
                        .into_iter()
                        .filter(|g| !names_before.contains(&g.name))
                        .collect::<Vec<_>>()
                })
            },
        )
        .await?;
        let at = since(t0, Instant::now());
        for g in &replacements {
            println!(
                "  {at:<7} replacement {} Ready on {} (the Fleet refilled; the taint keeps it off {DOOMED})",
                g.name,
                g.node.as_deref().unwrap_or("?")
            );
        }
        if let Some(g) = up(cluster)
            .find(|g| g.node.as_deref() == Some(DOOMED) && !names_before.contains(&g.name))
        {
            return Err(DemoError::Unexpected {
                expected: format!("no new game server on {DOOMED}"),
                found: format!("{} was scheduled there", g.name),
            });
        }
        let deregs = env.gamelift.count("DeregisterGameServer");
        if deregs != 0 {
            return Err(DemoError::Unexpected {
                expected: "no DeregisterGameServer while matches run".into(),
                found: format!("{deregs} call(s)"),
            });
        }
        println!(
            "          DeregisterGameServer calls so far: 0 ({} matches still running on {DOOMED})",
            protected.len()
        );
        println!();
        print_cluster(cluster);
        Ok(Drained {
            protected,
            released: ready.len(),
        })
    }

    // ---- 5 ----------------------------------------------------------------------------

    async fn end_matches(&mut self, drained: &Drained) -> Result<(), DemoError> {
        heading(5, &format!("The matches on {DOOMED} end"));
        let env = self.env.as_ref().ok_or_else(not_started)?;
        let within = self.opts.timeout;
        let iid = instance_id(DOOMED);
        let t0 = Instant::now();
        for (name, state) in &drained.protected {
            env.cluster
                .sdk_shutdown(NS, name)
                .map_err(setup(format!("SDK Shutdown of {name}")))?;
            println!("  t=0     {name} ({state}) calls SDK Shutdown(): its match is over");
        }
        poll(
            &format!("DeregisterGameServer for {iid} once {DOOMED} is empty"),
            within,
            || async { (env.gamelift.count("DeregisterGameServer") > 0).then_some(()) },
        )
        .await?;
        println!(
            "  {:<7} {DOOMED} is empty: lastcall called DeregisterGameServer({GROUP}, {iid}); {DOOMED} is deregistered",
            since(t0, Instant::now())
        );
        let at = until(
            &env.cluster,
            &format!("the deregistration recorded on Node {DOOMED}"),
            within,
            |c| node_annotation(c, DOOMED, keys::ANN_DEREGISTERED),
        )
        .await?;
        println!(
            "          Node annotation {}={at} (a restarted agent will not repeat it)",
            keys::ANN_DEREGISTERED
        );
        until(
            &env.cluster,
            &format!(
                "Fleet {NS}/{FLEET} back to {REPLICAS} running game servers, and none left on {DOOMED}"
            ),
            within,
            |c| {
                let all = c.fleet_game_servers(NS, FLEET);
                let settled = all.len() == REPLICAS
                    && all.iter().all(|g| {
                        g.node.as_deref() != Some(DOOMED)
                            && !g.deleting
                            && matches!(g.state, Some(S::Ready | S::Allocated | S::Reserved))
                    });
                settled.then_some(())
            },
        )
        .await?;
        check_one_deregistration(&env.gamelift)?;
        self.deregistered = true;

        println!();
        println!("Summary");
        print_cluster(&env.cluster);
        println!();
        println!("  FleetIQ calls (GameLift emulator journal), by operation:");
        let mut ops: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
        for c in env.gamelift.calls() {
            *ops.entry(c.op).or_default().entry(c.outcome).or_default() += 1;
        }
        for (op, outcomes) in &ops {
            let total: usize = outcomes.values().sum();
            let detail: Vec<String> = outcomes.iter().map(|(o, n)| format!("{o} {n}")).collect();
            println!("    {op:<30} {total:>4}  ({})", detail.join(", "));
        }
        if let Some(a) = self.agents.iter().find(|a| a.node == DOOMED) {
            let text = scrape(a.admin).await;
            let m =
                |name: &str, labels: &[(&str, &str)]| metric(&text, name, labels).unwrap_or(0.0);
            println!();
            println!("  agent {DOOMED} metrics (http://{}/metrics):", a.admin);
            let fences = m("lastcall_signal_to_fence_seconds_count", &[]);
            let fence_sum = m("lastcall_signal_to_fence_seconds_sum", &[]);
            println!(
                "    lastcall_signal_to_fence_seconds   {fences} drain(s), {:.1} ms from the Redis message to fenced and released",
                if fences > 0.0 {
                    fence_sum / fences * 1000.0
                } else {
                    0.0
                }
            );
            println!(
                "    lastcall_releases_total            ok {}, conflict {}, error {}",
                m("lastcall_releases_total", &[("result", "ok")]),
                m("lastcall_releases_total", &[("result", "conflict")]),
                m("lastcall_releases_total", &[("result", "error")]),
            );
            let drains = m("lastcall_drain_duration_seconds_count", &[]);
            let drain_sum = m("lastcall_drain_duration_seconds_sum", &[]);
            println!(
                "    lastcall_drain_duration_seconds    {drains} drain(s), {:.2} s from drain start to empty",
                if drains > 0.0 {
                    drain_sum / drains
                } else {
                    0.0
                }
            );
            println!(
                "    lastcall_deregistrations_total     ok {}",
                m("lastcall_deregistrations_total", &[("result", "ok")])
            );
            println!(
                "    lastcall_heartbeats_total          ok {}",
                m("lastcall_heartbeats_total", &[("result", "ok")])
            );
            println!(
                "    lastcall_drain_phase               {}",
                current_phase(&text).unwrap_or_else(|| "-".into())
            );
        }
        println!();
        println!(
            "  Story: {} Ready server(s) released and replaced elsewhere, {} match(es) protected until they ended, 1 deregistration.",
            drained.released,
            drained.protected.len()
        );
        Ok(())
    }

    // ---- keep running, failure, 6 ------------------------------------------------------

    fn print_keep_running(&self) {
        println!();
        println!("Everything keeps running; press Ctrl-C to stop.");
        println!(
            "  kubeconfig      {}  (export KUBECONFIG=...; the emulator speaks the Kubernetes API)",
            self.dir.join("kubeconfig").display()
        );
        for a in &self.agents {
            println!(
                "  agent {}    http://{}/metrics  /readyz  kubeconfig {}",
                a.node,
                a.admin,
                a.kubeconfig.display()
            );
        }
        if let Some(p) = self.pubsub_admin {
            println!("  pubsub          http://{p}/metrics  /readyz");
        }
        if let Some(env) = &self.env {
            println!("  GameLift        {}", env.gamelift.url());
            println!("  redis           {}", env.redis.url());
        }
    }

    fn print_log_tails(&self) {
        for p in &self.procs.list {
            let text = std::fs::read_to_string(&p.log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(3)..];
            println!("  last lines of {} ({}):", p.name, p.log.display());
            for l in tail {
                println!("    {l}");
            }
        }
    }

    async fn shut_down(mut self) -> Result<(), DemoError> {
        if self.procs.list.is_empty() && self.env.is_none() {
            return Ok(());
        }
        heading(6, "Stop everything (SIGTERM to each process)");
        let reports = futures::future::join_all(self.procs.list.iter().map(stop)).await;
        let mut unclean = Vec::new();
        for (p, r) in self.procs.list.iter().zip(reports) {
            println!("  {:<14} {r}", p.name);
            if !r.clean {
                unclean.push(format!("{}: {}", p.name, r));
            }
        }
        let mut result = Ok(());
        if let Some(mut env) = self.env.take() {
            if self.deregistered {
                println!(
                    "  DeregisterGameServer calls after SIGTERM: {} (SIGTERM does not deregister)",
                    env.gamelift.count("DeregisterGameServer")
                );
                result = check_one_deregistration(&env.gamelift);
            }
            env.redis.kill().await;
            env.cluster.shutdown().await;
            drop(env.gamelift);
            println!(
                "  redis-server, the Kubernetes API emulator and the GameLift emulator stopped"
            );
        }
        if !unclean.is_empty() {
            return Err(DemoError::Unclean(unclean.join("; ")));
        }
        result
    }
}

fn check_one_deregistration(gl: &GameLiftEmulator) -> Result<(), DemoError> {
    let n = gl.count("DeregisterGameServer");
    if n != 1 {
        return Err(DemoError::Unexpected {
            expected: "exactly one DeregisterGameServer call".into(),
            found: format!("{n} calls"),
        });
    }
    Ok(())
}

// ---- views ------------------------------------------------------------------------------

/// The Fleet's game servers that are up: not being deleted, not failed.
fn up(c: &Cluster) -> impl Iterator<Item = GameServerView> {
    c.fleet_game_servers(NS, FLEET)
        .into_iter()
        .filter(|g| g.counts_as_up())
}

fn node_annotation(c: &Cluster, node: &str, key: &str) -> Option<String> {
    c.node(node)?
        .pointer("/metadata/annotations")?
        .get(key)?
        .as_str()
        .map(str::to_string)
}

fn taint_text(t: &k8s_openapi::api::core::v1::Taint) -> String {
    match &t.value {
        Some(v) => format!("{}={v}:{}", t.key, t.effect),
        None => format!("{}:{}", t.key, t.effect),
    }
}

/// Nodes with cordon, taints and their game servers by state. "starting" counts servers
/// not Ready yet; "leaving" those being deleted, shut down or failed.
fn print_cluster(c: &Cluster) {
    println!(
        "    {:<8} {:<9} {:<42} {:>5} {:>9} {:>8} {:>8} {:>7}",
        "node", "cordoned", "taints", "Ready", "Allocated", "Reserved", "starting", "leaving"
    );
    let servers = c.fleet_game_servers(NS, FLEET);
    for node in NODES {
        let info = c.node(node).and_then(|n| NodeInfo::parse(&n).ok());
        let cordoned = if info.as_ref().is_some_and(|i| i.unschedulable) {
            "yes"
        } else {
            "no"
        };
        let taints: Vec<String> = info
            .map(|i| i.taints.iter().map(|(t, _)| taint_text(t)).collect())
            .unwrap_or_default();
        let taints = if taints.is_empty() {
            "-".to_string()
        } else {
            taints.join(",")
        };
        let mine: Vec<&GameServerView> = servers
            .iter()
            .filter(|g| g.node.as_deref() == Some(node))
            .collect();
        let count = |f: &dyn Fn(&GameServerView) -> bool| mine.iter().filter(|g| f(g)).count();
        let state = |s: S| move |g: &GameServerView| g.counts_as_up() && g.state == Some(s);
        let r = count(&state(S::Ready));
        let a = count(&state(S::Allocated));
        let v = count(&state(S::Reserved));
        let starting = count(&|g| g.counts_as_up() && g.state.is_none_or(S::is_before_ready));
        let leaving = count(&|g| !g.counts_as_up());
        println!(
            "    {node:<8} {cordoned:<9} {taints:<42} {r:>5} {a:>9} {v:>8} {starting:>8} {leaving:>7}"
        );
    }
}

/// The label of the `lastcall_drain_phase` sample whose value is 1.
fn current_phase(text: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix("lastcall_drain_phase{phase=\"")?;
        let (phase, value) = rest.split_once("\"}")?;
        (value.trim().parse::<f64>().ok()? == 1.0).then(|| phase.to_string())
    })
}

// ---- waiting ----------------------------------------------------------------------------

/// Waits on the cluster model's store (woken by every change).
async fn until<T>(
    cluster: &Cluster,
    expected: &str,
    within: Duration,
    cond: impl FnMut(&Cluster) -> Option<T>,
) -> Result<T, DemoError> {
    cluster
        .wait_until(expected, within, cond)
        .await
        .map_err(|e| match e {
            ClusterError::Timeout { what, within } => DemoError::Timeout {
                expected: what,
                within,
            },
            other => DemoError::Setup {
                what: format!("waiting for {expected}"),
                source: other.into(),
            },
        })
}

/// Checks `check` every [`POLL_EVERY`] until it answers, for things outside the store.
async fn poll<T, F, Fut>(expected: &str, within: Duration, check: F) -> Result<T, DemoError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    try_eventually(expected, within, POLL_EVERY, check)
        .await
        .map_err(|TimedOut { what, within }| DemoError::Timeout {
            expected: what,
            within,
        })
}

fn http_client() -> Result<reqwest::Client, DemoError> {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .map_err(setup("building an HTTP client"))
}

async fn readyz(http: &reqwest::Client, addr: SocketAddr) -> Option<()> {
    let r = http
        .get(format!("http://{addr}/readyz"))
        .send()
        .await
        .ok()?;
    (r.status() == reqwest::StatusCode::OK).then_some(())
}

/// Subscribes to `channel` now; the receiver gets the first DRAINING message and when it came.
async fn watch_channel(
    url: &str,
    channel: &str,
) -> Result<oneshot::Receiver<(Instant, String)>, DemoError> {
    let what = format!("subscribing to Redis channel {channel}");
    let client = ::redis::Client::open(url).map_err(setup(what.clone()))?;
    let mut pubsub = client
        .get_async_pubsub()
        .await
        .map_err(setup(what.clone()))?;
    pubsub.subscribe(channel).await.map_err(setup(what))?;
    let (tx, rx) = oneshot::channel();
    tokio::spawn(async move {
        let mut messages = pubsub.into_on_message();
        while let Some(msg) = messages.next().await {
            let body = msg.get_payload_bytes();
            if StatusMessage::parse(body).is_ok_and(|m| m.status == Status::Draining) {
                let _ = tx.send((Instant::now(), String::from_utf8_lossy(body).into_owned()));
                return;
            }
        }
    });
    Ok(rx)
}

// ---- processes --------------------------------------------------------------------------

fn free_port() -> Result<u16, DemoError> {
    try_free_port().map_err(setup("finding a free port on 127.0.0.1"))
}

async fn build(package: &'static str, bin: &'static str) -> Result<PathBuf, DemoError> {
    tokio::task::spawn_blocking(move || try_workspace_binary(package, bin))
        .await
        .map_err(setup(format!("building {bin}")))?
        .map_err(setup(format!("building {bin}")))
}

/// A clean environment: nothing from the caller's shell (REDIS_URL, AWS_*, proxies,
/// RUST_LOG) leaks into the processes; AWS credentials are dummies the emulator accepts.
fn base_env(cmd: &mut Command, dir: &Path) {
    cmd.env_clear()
        .env("HOME", dir)
        .env("AWS_ACCESS_KEY_ID", "AKIDLASTCALLDEMO")
        .env("AWS_SECRET_ACCESS_KEY", "lastcall-demo-secret")
        .env("AWS_REGION", "us-west-2")
        .env("AWS_EC2_METADATA_DISABLED", "true");
}

/// One child process, supervised by a task that owns it.
struct Process {
    name: String,
    pid: u32,
    log: PathBuf,
    /// Set before SIGTERM, so the exit is not reported as a crash.
    stopping: CancellationToken,
    exit: watch::Receiver<Option<Result<ExitStatus, String>>>,
}

struct Processes {
    list: Vec<Process>,
    /// Gets a description of the first process that exits on its own.
    early: watch::Sender<Option<String>>,
    verbose: bool,
}

impl Processes {
    fn spawn(&mut self, name: &str, mut cmd: Command, log: &Path) -> Result<u32, DemoError> {
        let what = format!("starting {name}");
        // Its own process group: a Ctrl-C in the terminal reaches only the demo, which
        // then stops the processes in order and reports how each one exited.
        cmd.stdin(Stdio::null()).kill_on_drop(true).process_group(0);
        if self.verbose {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        } else {
            let file = std::fs::File::create(log).map_err(setup(what.clone()))?;
            let err = file.try_clone().map_err(setup(what.clone()))?;
            cmd.stdout(file).stderr(err);
        }
        let mut child = cmd.spawn().map_err(setup(what.clone()))?;
        let pid = child
            .id()
            .ok_or_else(|| DemoError::ProcessExited(format!("{name} exited at once")))?;
        if self.verbose {
            let _ = std::fs::File::create(log);
            if let Some(out) = child.stdout.take() {
                tokio::spawn(echo(name.to_string(), out, log.to_path_buf()));
            }
            if let Some(err) = child.stderr.take() {
                tokio::spawn(echo(name.to_string(), err, log.to_path_buf()));
            }
        }
        let stopping = CancellationToken::new();
        let (exit_tx, exit) = watch::channel(None);
        let early = self.early.clone();
        let (stop, who) = (stopping.clone(), name.to_string());
        tokio::spawn(async move {
            let status = child.wait().await.map_err(|e| e.to_string());
            if !stop.is_cancelled() {
                let how = match &status {
                    Ok(s) => describe(s),
                    Err(e) => e.clone(),
                };
                early.send_if_modified(|v| {
                    let first = v.is_none();
                    if first {
                        *v = Some(format!("{who} exited on its own ({how}); see its log"));
                    }
                    first
                });
            }
            exit_tx.send_replace(Some(status));
        });
        self.list.push(Process {
            name: name.to_string(),
            pid,
            log: log.to_path_buf(),
            stopping,
            exit,
        });
        Ok(pid)
    }
}

/// Copies a child's output to its log file and, prefixed with its name, to stdout.
async fn echo(name: String, pipe: impl AsyncRead + Unpin, log: PathBuf) {
    let mut file = tokio::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(&log)
        .await
        .ok();
    let mut lines = BufReader::new(pipe).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        println!("  | {name:<12} {line}");
        if let Some(f) = file.as_mut() {
            let _ = f.write_all(format!("{line}\n").as_bytes()).await;
        }
    }
}

fn describe(s: &ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => s.to_string(),
    }
}

struct StopReport {
    text: String,
    clean: bool,
}

impl std::fmt::Display for StopReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

/// SIGTERM, then wait (bounded) for the exit; SIGKILL if it does not come.
async fn stop(p: &Process) -> StopReport {
    p.stopping.cancel();
    let mut exit = p.exit.clone();
    let already = exit.borrow().clone();
    if let Some(status) = already {
        let how = status.map(|s| describe(&s)).unwrap_or_else(|e| e);
        return StopReport {
            text: format!("had already exited ({how})"),
            clean: false,
        };
    }
    let started = Instant::now();
    if process::signal(p.pid, "TERM").await.is_err() {
        return StopReport {
            text: format!("could not send SIGTERM to pid {}", p.pid),
            clean: false,
        };
    }
    let waited = tokio::time::timeout(STOP_WITHIN, exit.wait_for(Option::is_some)).await;
    let took = started.elapsed().as_secs_f64();
    match waited {
        Ok(Ok(v)) => match v.clone() {
            Some(Ok(s)) => StopReport {
                text: format!("SIGTERM -> {} after {took:.2}s", describe(&s)),
                clean: s.success(),
            },
            Some(Err(e)) => StopReport {
                text: format!("SIGTERM -> waiting failed: {e}"),
                clean: false,
            },
            None => StopReport {
                text: "SIGTERM -> exit unknown".into(),
                clean: false,
            },
        },
        Ok(Err(_)) => StopReport {
            text: "SIGTERM -> its supervisor ended".into(),
            clean: false,
        },
        Err(_) => {
            let _ = process::signal(p.pid, "KILL").await;
            StopReport {
                text: format!(
                    "did not exit within {}s of SIGTERM; killed",
                    STOP_WITHIN.as_secs()
                ),
                clean: false,
            }
        }
    }
}

async fn early_exit(mut rx: watch::Receiver<Option<String>>) -> String {
    match rx.wait_for(Option::is_some).await {
        Ok(v) => v.clone().unwrap_or_default(),
        Err(_) => std::future::pending().await,
    }
}

/// Resolves on Ctrl-C (SIGINT) or SIGTERM.
async fn interrupted() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let term = async {
        match signal(SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    let int = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        () = term => "SIGTERM",
        () = int => "SIGINT",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drain_phase_is_the_sample_at_one() {
        let text = "lastcall_drain_phase{phase=\"idle\"} 0\nlastcall_drain_phase{phase=\"deregistered\"} 1\n";
        assert_eq!(current_phase(text).as_deref(), Some("deregistered"));
        assert_eq!(
            current_phase("lastcall_drain_phase{phase=\"idle\"} 0\n"),
            None
        );
    }
}
