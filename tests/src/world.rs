//! The standard scenario world for agent tests: an emulated cluster whose node `n1` holds a
//! Fleet's game servers, a GameLift emulator with instance `i-000000000000000n1` in group `g1`, and a
//! private redis-server. Helpers publish FleetIQ statuses the way pubsub does and read back
//! what the agent did.

use k8s_openapi::api::core::v1::{Node, Toleration};
use kube::Api;
use lastcall_common::fleetiq::{InstanceStatus as Status, StatusMessage, cache_key};

use crate::agent::{InProcessAgent, config, metric};
use crate::cluster::{
    AllocationRequest, Cluster, ClusterConfig, EvictionSafe, FleetSpec, GameServerState,
    GameServerView, NodeSpec,
};
use crate::eventually::wait_for;
use crate::gamelift::{GameLiftEmulator, InstanceStatus};
use crate::redis::RedisServer;

pub const NS: &str = "default";
pub const GROUP: &str = "g1";
pub const IID: &str = "i-000000000000000n1";
pub const NODE: &str = "n1";
pub const FLEET: &str = "fleet";

/// How many game servers of each kind start on `n1`, and which nodes join afterwards so
/// that replacements of released servers have somewhere to go.
#[derive(Clone, Debug)]
pub struct WorldSpec {
    pub ready: usize,
    pub allocated: usize,
    pub reserved: usize,
    pub extra_nodes: Vec<String>,
    /// Tolerations in the Fleet's pod template.
    pub tolerations: Vec<Toleration>,
    /// The pods' `terminationGracePeriodSeconds`.
    pub grace_seconds: i64,
    /// The Fleet's `eviction.safe` (`None`: Agones' default, `Never`).
    pub eviction_safe: Option<EvictionSafe>,
    /// Agones 1.58 or later: GameServers selectable by `status.nodeName`.
    pub agones_selectable_fields: bool,
}

impl WorldSpec {
    pub fn new(ready: usize, allocated: usize, reserved: usize) -> Self {
        Self {
            ready,
            allocated,
            reserved,
            extra_nodes: vec!["n2".into()],
            tolerations: vec![],
            grace_seconds: 1,
            eviction_safe: None,
            agones_selectable_fields: false,
        }
    }

    /// Agones 1.58 or later: its CRD declares `status.nodeName` selectable.
    pub fn selectable_fields(mut self) -> Self {
        self.agones_selectable_fields = true;
        self
    }

    pub fn eviction_safe(mut self, safe: EvictionSafe) -> Self {
        self.eviction_safe = Some(safe);
        self
    }

    pub fn grace_seconds(mut self, s: i64) -> Self {
        self.grace_seconds = s;
        self
    }

    /// The Fleet's pods carry `t` (e.g. the original adapter's `gamelift.status/active`).
    pub fn tolerate(mut self, t: Toleration) -> Self {
        self.tolerations.push(t);
        self
    }

    pub fn extra_nodes(mut self, nodes: &[&str]) -> Self {
        self.extra_nodes = nodes.iter().map(|n| n.to_string()).collect();
        self
    }
}

pub struct World {
    pub cluster: Cluster,
    pub gl: GameLiftEmulator,
    pub redis: RedisServer,
}

impl World {
    pub async fn start(spec: WorldSpec) -> World {
        let cluster = Cluster::start(ClusterConfig {
            agones_selectable_fields: spec.agones_selectable_fields,
            ..ClusterConfig::default()
        })
        .await
        .expect("cluster");
        cluster.add_node(NodeSpec::new(NODE)).expect("node");
        let total = spec.ready + spec.allocated + spec.reserved;
        if total > 0 {
            let mut fleet = FleetSpec::new(FLEET, total as i64).grace_seconds(spec.grace_seconds);
            for t in &spec.tolerations {
                fleet = fleet.toleration(t.clone());
            }
            if let Some(safe) = spec.eviction_safe {
                fleet = fleet.eviction_safe(safe);
            }
            cluster.create_fleet(fleet).expect("fleet");
            cluster
                .wait_ready(NS, FLEET, total)
                .await
                .expect("fleet ready on n1");
        }
        for _ in 0..spec.allocated {
            let gs = cluster
                .allocate(&AllocationRequest::fleet(NS, FLEET))
                .await
                .expect("allocate");
            assert!(gs.is_some(), "allocation failed");
        }
        let ready: Vec<String> = cluster
            .game_servers()
            .into_iter()
            .filter(|g| g.state == Some(GameServerState::Ready))
            .map(|g| g.name)
            .collect();
        for name in ready.iter().take(spec.reserved) {
            cluster.reserve(NS, name).expect("reserve");
        }
        for n in &spec.extra_nodes {
            cluster
                .add_node(NodeSpec::new(n.as_str()))
                .expect("extra node");
        }
        let gl = GameLiftEmulator::start().await.expect("gamelift emulator");
        gl.add_instances(GROUP, &[IID.to_string()], InstanceStatus::Active);
        let redis = RedisServer::start().await.expect("redis-server");
        World { cluster, gl, redis }
    }

    /// FleetIQ flags for group g1 with fast heartbeats and resyncs, without an instance id.
    pub fn fleetiq_args(&self) -> Vec<String> {
        let url = self.redis.url();
        [
            "--game-server-group",
            GROUP,
            "--redis-url",
            &url,
            "--heartbeat-interval",
            "1s",
            "--resync-interval",
            "1s",
        ]
        .map(String::from)
        .to_vec()
    }

    /// An in-process agent for n1 with exactly `args`.
    pub async fn start_agent(&self, args: &[String]) -> InProcessAgent {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let kube = self
            .cluster
            .emulator()
            .config_for("agent-n1")
            .await
            .expect("client");
        InProcessAgent::start(config(NODE, &args), kube, Some(self.gl.sdk_client().await))
            .await
            .expect("agent")
    }

    /// An in-process FleetIQ agent for instance i-000000000000000n1, plus `extra` flags.
    pub async fn agent(&self, extra: &[&str]) -> InProcessAgent {
        let mut args = self.fleetiq_args();
        args.extend(["--instance-id", IID].map(String::from));
        args.extend(extra.iter().map(|s| s.to_string()));
        self.start_agent(&args).await
    }

    /// [`World::agent`] with a resync interval of `resync` instead of 1 s: with a long one
    /// (minutes), only the agent's own retries and watch events can make progress.
    pub async fn agent_with_resync(&self, resync: &str, extra: &[&str]) -> InProcessAgent {
        let mut args = self.fleetiq_args();
        if let Some(i) = args.iter().position(|a| a == "--resync-interval") {
            args[i + 1] = resync.to_string();
        }
        args.extend(["--instance-id", IID].map(String::from));
        args.extend(extra.iter().map(|s| s.to_string()));
        self.start_agent(&args).await
    }

    /// The body pubsub would publish for i-000000000000000n1.
    pub fn message(s: Status) -> String {
        StatusMessage {
            group_name: Some(GROUP.into()),
            group_arn: Some(GameLiftEmulator::group_arn(GROUP)),
            instance_id: IID.into(),
            status: s,
        }
        .to_python_json()
    }

    /// Sets the cached status and publishes it, as pubsub does.
    pub async fn status(&self, s: Status) {
        self.raw(&Self::message(s)).await;
    }

    /// Caches and publishes any body on i-000000000000000n1's channel.
    pub async fn raw(&self, body: &str) {
        let mut c = self.redis.client().await.expect("redis client");
        let _: () = redis::cmd("SET")
            .arg(cache_key(IID))
            .arg(body)
            .query_async(&mut c)
            .await
            .expect("SET");
        let _: i64 = redis::cmd("PUBLISH")
            .arg(IID)
            .arg(body)
            .query_async(&mut c)
            .await
            .expect("PUBLISH");
    }

    pub async fn node(&self) -> Node {
        Api::<Node>::all(self.cluster.client())
            .get(NODE)
            .await
            .expect("node n1")
    }

    /// Game servers whose pod runs on `node`.
    pub fn on(&self, node: &str) -> Vec<GameServerView> {
        self.cluster
            .game_servers()
            .into_iter()
            .filter(|g| g.node.as_deref() == Some(node))
            .collect()
    }

    /// The first Allocated server on n1.
    pub fn allocated(&self) -> GameServerView {
        self.on(NODE)
            .into_iter()
            .find(|g| g.state == Some(GameServerState::Allocated))
            .expect("an allocated server on n1")
    }

    /// Waits until `agent` sees every server of n1 (its `lastcall_game_servers` gauges add up
    /// to them), however it selects them: by `status.nodeName`, or once it has labelled them.
    pub async fn agent_sees_all(&self, agent: &InProcessAgent) {
        wait_for("the agent sees every server on n1", || async {
            let seen =
                crate::agent::metric_sum(&agent.metrics().await, "lastcall_game_servers", &[]);
            (seen as usize == self.on(NODE).len()).then_some(())
        })
        .await;
    }

    /// Waits until the agent has put its ownership label on every server of n1.
    pub async fn claimed_all(&self) {
        wait_for("agent labelled its game servers", || async {
            self.on(NODE)
                .iter()
                .all(|g| g.labels.get("lastcall.dev/node").map(String::as_str) == Some(NODE))
                .then_some(())
        })
        .await;
    }
}

impl World {
    /// Waits until n1 is cordoned and tainted, only `keep` is left on it and it is protected.
    pub async fn fenced_and_released(&self, keep: &GameServerView) {
        wait_for("fenced, Ready released, the match protected", || async {
            let here = self.on(NODE);
            let protected = here.len() == 1
                && here[0].uid == keep.uid
                && here[0]
                    .annotations
                    .contains_key("lastcall.dev/drain-deadline");
            let n = self.node().await;
            (cordoned(&n) && has_taint(&n, "lastcall.dev/draining") && protected).then_some(())
        })
        .await;
    }

    /// Ends the match and checks the drain finishes with exactly one deregistration, also
    /// after a few more resync passes.
    pub async fn finish_drain(&self, keep: &GameServerView) {
        assert_eq!(self.gl.count("DeregisterGameServer"), 0, "not while busy");
        self.cluster
            .sdk_shutdown(NS, &keep.name)
            .expect("sdk shutdown");
        wait_for("deregistered once the node is empty", || async {
            (self.gl.count("DeregisterGameServer") == 1).then_some(())
        })
        .await;
        wait_for("deregistration recorded on the Node", || async {
            self.node()
                .await
                .metadata
                .annotations
                .unwrap_or_default()
                .contains_key("lastcall.dev/deregistered")
                .then_some(())
        })
        .await;
        // Let a few resync passes (1 s) run: still exactly once.
        tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
        assert_eq!(self.gl.count("DeregisterGameServer"), 1);
    }
}

/// Waits until an in-process agent is subscribed to Redis.
pub async fn subscribed(agent: &InProcessAgent) {
    wait_for("agent subscribed to Redis", || async {
        (metric(&agent.metrics().await, "lastcall_redis_connected", &[]) == Some(1.0)).then_some(())
    })
    .await;
}

/// The FleetIQ lifecycle calls an agent makes for its game server.
pub const LIFECYCLE: [&str; 4] = [
    "RegisterGameServer",
    "ClaimGameServer",
    "UpdateGameServer",
    "DeregisterGameServer",
];

/// The Node's annotation `key`, if set.
pub fn annotation(n: &Node, key: &str) -> Option<String> {
    n.metadata.annotations.as_ref()?.get(key).cloned()
}

pub fn has_taint(n: &Node, key: &str) -> bool {
    n.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == key))
}

pub fn cordoned(n: &Node) -> bool {
    n.spec
        .as_ref()
        .and_then(|s| s.unschedulable)
        .unwrap_or(false)
}

/// A node `n1` for the race scenarios: `servers` Ready servers of Fleet `fleet` whose pods
/// have `grace_seconds` of grace, a 20 ms cluster tick, a spare node `n2` when `spare`, and
/// n1's agent with `flags`, started as the binary starts it. Returns once the agent has
/// claimed every server.
pub async fn race_node(
    seed: u64,
    servers: usize,
    grace_seconds: i64,
    spare: bool,
    flags: &[&str],
) -> (Cluster, InProcessAgent) {
    race_node_with(
        seed,
        servers,
        grace_seconds,
        spare,
        crate::cluster::EvictionSafe::Never,
        flags,
    )
    .await
}

/// [`race_node`] with the Fleet's `eviction.safe`.
pub async fn race_node_with(
    seed: u64,
    servers: usize,
    grace_seconds: i64,
    spare: bool,
    safe: crate::cluster::EvictionSafe,
    flags: &[&str],
) -> (Cluster, InProcessAgent) {
    let cluster = Cluster::start(ClusterConfig {
        tick: std::time::Duration::from_millis(20),
        ..ClusterConfig::default()
    })
    .await
    .expect("cluster");
    cluster.add_node(NodeSpec::new(NODE)).expect("n1");
    cluster
        .create_fleet(
            FleetSpec::new(FLEET, servers as i64)
                .grace_seconds(grace_seconds)
                .eviction_safe(safe),
        )
        .expect("fleet");
    cluster.wait_ready(NS, FLEET, servers).await.expect("ready");
    if spare {
        cluster.add_node(NodeSpec::new("n2")).expect("n2");
    }
    let kube = cluster
        .emulator()
        .config_for("agent-n1")
        .await
        .expect("client");
    let agent = InProcessAgent::start(config(NODE, flags), kube, None)
        .await
        .expect("agent");
    crate::eventually::eventually(
        &format!("seed {seed}: agent claims its servers"),
        std::time::Duration::from_secs(20),
        std::time::Duration::from_millis(5),
        || async {
            let gs = cluster.game_servers();
            let on_n1: Vec<_> = gs
                .iter()
                .filter(|g| g.node.as_deref() == Some(NODE))
                .collect();
            (on_n1.len() == servers
                && on_n1
                    .iter()
                    .all(|g| g.labels.contains_key("lastcall.dev/node")))
            .then_some(())
        },
    )
    .await;
    (cluster, agent)
}

/// What one allocation-window run saw.
#[derive(Debug, Default)]
pub struct WindowRun {
    /// Delays (drain signal accepted → allocation answered) of allocations after the fence.
    pub late: Vec<std::time::Duration>,
    /// Every server the allocator won, before or after the fence.
    pub won: Vec<String>,
}

/// One interleaving of the allocation-window measurement: a node with `servers` Ready
/// servers of one Fleet, a real agent, an allocator looping over that node's Ready servers
/// (list, then update with the resourceVersion, as Agones' allocator does; with the
/// `lastcall.dev/node-draining` exclusion selector when `selector`), and the manual drain
/// label; with `failing_deletes`, the API refuses the first `2 × servers` DELETEs (503).
///
/// Fails unless every match won survives the drain: by the emulator's journal the agent
/// never deleted a server after its allocation, and once the drain settles every won
/// server is Allocated, not being deleted, and protected by the agent.
pub async fn allocation_window(
    seed: u64,
    servers: usize,
    selector: bool,
    failing_deletes: bool,
) -> anyhow::Result<WindowRun> {
    use crate::kube::faults::{FaultRule, Method};
    use kube::api::{Patch, PatchParams};
    use std::time::{Duration, Instant};

    let cluster = Cluster::start(ClusterConfig {
        tick: Duration::from_millis(20),
        ..ClusterConfig::default()
    })
    .await?;
    cluster.add_node(NodeSpec::new(NODE))?;
    cluster.create_fleet(FleetSpec::new(FLEET, servers as i64).grace_seconds(0))?;
    cluster.wait_ready(NS, FLEET, servers).await?;
    cluster.add_node(NodeSpec::new("n2"))?;
    if failing_deletes {
        // The API server refuses the first DELETEs (429 or 503 under load).
        cluster.emulator().faults().inject(FaultRule::status(
            Some(Method::DELETE),
            "/gameservers/",
            servers * 2,
            503,
        ));
    }
    let cfg = cluster.emulator().config_for("agent-n1").await?;
    let agent =
        InProcessAgent::start(config(NODE, &["--resync-interval", "1s"]), cfg, None).await?;
    crate::eventually::eventually(
        "claimed",
        Duration::from_secs(20),
        Duration::from_millis(5),
        || async {
            cluster
                .game_servers()
                .iter()
                .filter(|g| g.node.as_deref() == Some(NODE))
                .all(|g| g.labels.contains_key("lastcall.dev/node"))
                .then_some(())
        },
    )
    .await;
    let client = cluster.client_without_retry("agones-allocator").await?;
    let mut req = AllocationRequest::fleet(NS, FLEET)
        .on_node(NODE)
        .max_tries(3);
    if selector {
        req = req.selector("lastcall.dev/node-draining!=true");
    }
    let offset = Duration::from_micros((seed * 7919) % 10_000);
    let signal = async {
        tokio::time::sleep(offset).await;
        Api::<Node>::all(cluster.client())
            .patch(
                NODE,
                &PatchParams::default(),
                &Patch::Merge(
                    &serde_json::json!({"metadata": {"labels": {"lastcall.dev/drain": "true"}}}),
                ),
            )
            .await?;
        anyhow::Ok(Instant::now())
    };
    let allocator = async {
        let mut won = vec![];
        for _ in 0..servers * 2 {
            if let Ok(Some(gs)) = crate::cluster::allocator::allocate(&client, &req).await {
                won.push((gs.name, Instant::now()));
            }
        }
        won
    };
    let (signalled, won) = tokio::join!(signal, allocator);
    let signalled = signalled?;

    // The drain settles: every server on the node released, or allocated and protected.
    let protected = |g: &GameServerView| {
        g.state == Some(GameServerState::Allocated)
            && !g.deleting
            && g.annotations.contains_key("lastcall.dev/drain-deadline")
    };
    crate::eventually::eventually(
        &format!("seed {seed}: the drain settles"),
        Duration::from_secs(20),
        Duration::from_millis(10),
        || async {
            cluster
                .game_servers()
                .iter()
                .filter(|g| g.node.as_deref() == Some(NODE))
                .all(|g| g.deleting || protected(g))
                .then_some(())
        },
    )
    .await;
    let journal = cluster.emulator().journal().entries();
    let killed = crate::promises::allocation::deleted_after_allocation(
        &journal,
        |r| r.identity.as_deref() == Some("agent-n1"),
        "agones-allocator",
    );
    if let Some((a, d)) = killed.first() {
        anyhow::bail!(
            "seed {seed}: the agent deleted {:?} (#{}) after it was allocated (#{})",
            d.name,
            d.seq,
            a.seq
        );
    }
    for (name, _) in &won {
        let now = cluster.game_server(NS, name);
        anyhow::ensure!(
            now.as_ref().is_some_and(protected),
            "seed {seed}: the match on {name} was lost or left unprotected: {now:?}"
        );
    }
    let fence = crate::promises::fence::first_fence(&journal, "agent-n1", NODE).map(|r| r.seq);
    let mut late = vec![];
    if let Some(fence) = fence {
        for (name, at) in &won {
            let after = crate::promises::allocation::allocations(&journal, "agones-allocator")
                .iter()
                .any(|r| r.seq > fence && r.name.as_deref() == Some(name.as_str()));
            if after {
                late.push(at.saturating_duration_since(signalled));
            }
        }
    }
    agent.stop().await?;
    cluster.shutdown().await;
    Ok(WindowRun {
        late,
        won: won.into_iter().map(|(n, _)| n).collect(),
    })
}
