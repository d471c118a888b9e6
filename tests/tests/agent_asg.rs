//! EC2 Auto Scaling lifecycle hooks end to end: the real agent (in-process, built as the
//! binary builds it) against the Kubernetes, IMDS and Auto Scaling emulators over HTTP.
//!
//! The group parks the instance in `Terminating:Wait` with a 2 s heartbeat timeout while a
//! match runs on it. The promises, read from the Auto Scaling emulator's journal:
//! - a match that outlives the hook's timeout keeps the instance (heartbeats, no timeout);
//! - the action is completed once, within seconds of the node emptying;
//! - a crash between the last match's end and the completion still completes, once;
//! - a denied heartbeat is a Warning-level report and a counted error, never a crash.

use std::time::Duration;

use lastcall_testkit::agent::{InProcessAgent, config, metric};
use lastcall_testkit::autoscaling::{AutoScalingEmulator, Happening, Hook, LifecycleState};
use lastcall_testkit::cluster::{
    AllocationRequest, Cluster, ClusterConfig, FleetSpec, GameServerState, NodeSpec,
};
use lastcall_testkit::eventually::wait_for;
use lastcall_testkit::imds::ImdsEmulator;
use tokio::time::Instant;

const I: &str = "i-0a1b2c3d4e5f60718";
const GROUP: &str = "game-nodes";
const HEARTBEAT_TIMEOUT: u64 = 2;

struct World {
    cluster: Cluster,
    imds: ImdsEmulator,
    asg: AutoScalingEmulator,
    /// The allocated server (its match).
    playing: String,
}

async fn world() -> World {
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
        vec![Hook::terminating("lastcall", HEARTBEAT_TIMEOUT)],
    );
    asg.add_instance(GROUP, I);
    World {
        cluster,
        imds,
        asg,
        playing: playing.name,
    }
}

async fn agent(w: &World) -> InProcessAgent {
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

fn first(
    j: &[lastcall_testkit::autoscaling::Entry],
    want: impl Fn(&Happening) -> bool,
) -> Option<Instant> {
    j.iter().find(|e| want(&e.happening)).map(|e| e.at)
}

/// The group starts terminating the instance; returns when the agent has fenced the node.
async fn terminate(w: &World) {
    w.asg.begin_termination(I).expect("terminating");
    w.imds.set_target_lifecycle_state(Some("Terminated"));
    wait_for("the node fenced", || async {
        let node = w.cluster.node("n1")?;
        (node["spec"]["unschedulable"] == true).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_match_outliving_the_hook_timeout_keeps_the_instance_and_the_hook_completes_once_it_ends()
{
    let w = world().await;
    let agent = agent(&w).await;
    terminate(&w).await;
    // The match runs for more than two heartbeat timeouts.
    tokio::time::sleep(Duration::from_secs(3 * HEARTBEAT_TIMEOUT)).await;
    assert_eq!(
        w.asg.lifecycle_state(I),
        Some(LifecycleState::TerminatingWait),
        "the instance must wait while a match runs: {:#?}",
        w.asg.journal()
    );
    let playing_gs = w
        .cluster
        .game_server("default", &w.playing)
        .expect("the match's server");
    assert_eq!(
        playing_gs.state,
        Some(GameServerState::Allocated),
        "the match is untouched"
    );

    let match_end = Instant::now();
    w.cluster
        .sdk_shutdown("default", &w.playing)
        .expect("the match ends");
    wait_for("the hook completed", || async {
        (w.asg.lifecycle_state(I) == Some(LifecycleState::Terminated)).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let j = w.asg.journal();
    let waited = first(&j, |h| matches!(h, Happening::WaitStarted { .. })).expect("wait");
    let completed = first(
        &j,
        |h| matches!(h, Happening::Completed { result } if result == "CONTINUE"),
    )
    .expect("completed with CONTINUE");
    assert!(
        !j.iter()
            .any(|e| matches!(e.happening, Happening::TimedOut { .. })),
        "the hook timed out: {j:#?}"
    );
    assert_eq!(w.asg.calls("CompleteLifecycleAction"), 1, "{j:#?}");
    let beats = j
        .iter()
        .filter(|e| e.happening == Happening::HeartbeatRecorded && e.at < match_end)
        .count();
    assert!(beats >= 3, "{beats} heartbeats during a 6 s match: {j:#?}");
    // Completed after the match ended, within seconds (the node empties, the agent sees it).
    assert!(completed > match_end);
    let release = completed.duration_since(match_end);
    assert!(
        release < Duration::from_secs(15),
        "released {release:?} after the match ended"
    );
    println!(
        "held {:.1} s past a {HEARTBEAT_TIMEOUT} s heartbeat timeout; released {:.0} ms after the last match ended",
        completed.duration_since(waited).as_secs_f64(),
        release.as_secs_f64() * 1000.0
    );
    let m = agent.metrics().await;
    assert_eq!(
        metric(
            &m,
            "lastcall_asg_lifecycle_calls_total",
            &[("operation", "CompleteLifecycleAction"), ("result", "ok")]
        ),
        Some(1.0)
    );
    agent.stop().await.expect("clean stop");
    w.cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_the_last_match_and_the_completion_completes_once() {
    let w = world().await;
    let first_agent = agent(&w).await;
    terminate(&w).await;
    // Completion fails until the crash: the node empties, the agent cannot complete.
    w.asg
        .fail("CompleteLifecycleAction", "ServiceUnavailable", 503, None);
    w.cluster
        .sdk_shutdown("default", &w.playing)
        .expect("the match ends");
    wait_for("a completion attempt", || async {
        w.asg
            .journal()
            .iter()
            .any(|e| {
                matches!(&e.happening, Happening::Call { action, error: Some(_), .. } if action == "CompleteLifecycleAction")
            })
            .then_some(())
    })
    .await;
    first_agent.abort();
    w.asg.clear_faults();
    let second = agent(&w).await;
    wait_for("the hook completed after the restart", || async {
        (w.asg.lifecycle_state(I) == Some(LifecycleState::Terminated)).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    let j = w.asg.journal();
    assert_eq!(w.asg.calls("CompleteLifecycleAction"), 1, "{j:#?}");
    assert_eq!(
        j.iter()
            .filter(|e| matches!(e.happening, Happening::Completed { .. }))
            .count(),
        1
    );
    assert!(
        !j.iter()
            .any(|e| matches!(e.happening, Happening::TimedOut { .. }))
    );
    second.stop().await.expect("clean stop");
    w.cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_heartbeat_is_reported_and_the_agent_keeps_draining() {
    let w = world().await;
    w.asg
        .fail("RecordLifecycleActionHeartbeat", "AccessDenied", 403, None);
    let agent = agent(&w).await;
    terminate(&w).await;
    wait_for("the denial counted", || async {
        let m = agent.metrics().await;
        (metric(
            &m,
            "lastcall_asg_lifecycle_calls_total",
            &[
                ("operation", "RecordLifecycleActionHeartbeat"),
                ("result", "access_denied"),
            ],
        )? >= 1.0)
            .then_some(())
    })
    .await;
    // The announced deadline is now the hook's timeout (the instance goes then), on the
    // running match's GameServer.
    wait_for("the deadline announced", || async {
        let gs = w.cluster.game_server("default", &w.playing)?;
        let d: jiff::Timestamp = gs
            .annotations
            .get("lastcall.dev/drain-deadline")?
            .parse()
            .ok()?;
        (d <= jiff::Timestamp::now()
            + jiff::SignedDuration::from_secs(HEARTBEAT_TIMEOUT as i64 + 1))
        .then_some(())
    })
    .await;
    // Still alive, still serving.
    let m = agent.metrics().await;
    assert!(metric(&m, "lastcall_source_up", &[("source", "asg_lifecycle")]) == Some(1.0));
    agent.stop().await.expect("clean stop");
    w.cluster.shutdown().await;
}
