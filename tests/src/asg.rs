//! A node in an EC2 Auto Scaling group with a termination lifecycle hook, for the hook
//! scenarios and their benchmark: the cluster model, the IMDS and Auto Scaling emulators, and
//! the agent built as the binary builds it.

use crate::agent::{InProcessAgent, config};
use crate::autoscaling::{AutoScalingEmulator, Entry, Happening, Hook};
use crate::cluster::{AllocationRequest, Cluster, ClusterConfig, FleetSpec, NodeSpec};
use crate::eventually::wait_for;
use crate::imds::ImdsEmulator;
use tokio::time::Instant;

pub const I: &str = "i-0a1b2c3d4e5f60718";
pub const GROUP: &str = "game-nodes";
pub const HEARTBEAT_TIMEOUT: u64 = 2;

pub struct World {
    pub cluster: Cluster,
    pub imds: ImdsEmulator,
    pub asg: AutoScalingEmulator,
    /// The allocated server (its match).
    pub playing: String,
}

/// One node holding one match and one idle server, its instance in service.
pub async fn world() -> World {
    world_with(HEARTBEAT_TIMEOUT).await
}

/// As [`world`], with the hook's heartbeat timeout in seconds.
pub async fn world_with(heartbeat_timeout: u64) -> World {
    let cluster = Cluster::start(ClusterConfig::default())
        .await
        .expect("cluster");
    cluster.add_node(NodeSpec::new("n1")).expect("n1");
    cluster
        // A released idle server's pod ends within a second of its SIGTERM.
        .create_fleet(FleetSpec::new("arena", 2).grace_seconds(1))
        .expect("fleet");
    cluster
        .wait_ready("default", "arena", 2)
        .await
        .expect("ready");
    let playing = cluster
        .allocate(&AllocationRequest::fleet("default", "arena"))
        .await
        .expect("allocate")
        .expect("an allocated server");
    let imds = ImdsEmulator::start(I, "n1").await.expect("imds");
    imds.set_target_lifecycle_state(Some("InService"));
    let asg = AutoScalingEmulator::start().await.expect("asg");
    asg.add_group(
        GROUP,
        vec![Hook::terminating("lastcall", heartbeat_timeout)],
    );
    asg.add_instance(GROUP, I);
    World {
        cluster,
        imds,
        asg,
        playing: playing.name,
    }
}

/// The agent of `n1` with the lifecycle source on.
pub async fn agent(w: &World) -> InProcessAgent {
    let (imds, asg) = (w.imds.url(), w.asg.url());
    let flags = [
        "--resync-interval",
        "1s",
        "--asg-lifecycle",
        "--asg-interval",
        "200ms",
        "--imds-endpoint",
        &imds,
        "--asg-endpoint",
        &asg,
        "--aws-region",
        "us-west-2",
        "--instance-id",
        I,
    ];
    let kube = w
        .cluster
        .emulator()
        .config_for("agent-n1")
        .await
        .expect("client");
    InProcessAgent::start(config("n1", &flags), kube, None)
        .await
        .expect("agent")
}

/// When the first journal entry satisfying `want` happened.
pub fn first(j: &[Entry], want: impl Fn(&Happening) -> bool) -> Option<Instant> {
    j.iter().find(|e| want(&e.happening)).map(|e| e.at)
}

/// The group starts terminating the instance; returns when the agent has fenced the node.
pub async fn terminate(w: &World) {
    w.asg.begin_termination(I).expect("terminating");
    w.imds.set_target_lifecycle_state(Some("Terminated"));
    wait_for("the node fenced", || async {
        let node = w.cluster.node("n1")?;
        (node["spec"]["unschedulable"] == true).then_some(())
    })
    .await;
}
