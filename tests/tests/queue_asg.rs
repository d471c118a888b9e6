//! An Auto Scaling termination that arrives through the queue is held exactly as the one read
//! through instance metadata: the hook is heartbeated while the match runs and completed
//! (`CONTINUE`) once, after the node is empty, through the same hand-off gate. The agent has
//! no instance metadata at all (its endpoint is a closed port): the termination comes from
//! the event relayed onto its Node, the instance id from the Node's `spec.providerID`.
//!
//! Truths from the Auto Scaling user guide: an instance waits in `Terminating:Wait` until
//! the hook is completed or its heartbeat timeout passes without a heartbeat. Ordered by the
//! Auto Scaling emulator's journal, never by a sleep.

use lastcall_emulators::autoscaling::{Happening, LifecycleState};
use lastcall_testkit::agent::{InProcessAgent, config, metric};
use lastcall_testkit::asg::{GROUP, I, world};
use lastcall_testkit::cluster::GameServerState;
use lastcall_testkit::eventually::wait_for;
use lastcall_testkit::queue::{PUBSUB, QueueRig, RunningRelay, relay_args, set_provider_id};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_termination_from_the_queue_is_held_with_heartbeats_and_completed_once_empty() {
    let w = world().await;
    let admin = w
        .cluster
        .emulator()
        .config_for("admin")
        .await
        .expect("admin");
    set_provider_id(&admin, "n1", I).await;
    let rig = QueueRig::start().await.expect("moto");
    let relay = RunningRelay::start(
        &relay_args(&rig),
        w.cluster
            .emulator()
            .config_for(PUBSUB)
            .await
            .expect("client"),
    )
    .await
    .expect("relay");
    let asg = w.asg.url();
    let closed = format!("http://127.0.0.1:{}", lastcall_testkit::net::free_port());
    let flags = [
        "--resync-interval",
        "1s",
        "--aws-queue",
        "--asg-lifecycle",
        "--asg-interval",
        "200ms",
        "--imds-endpoint",
        &closed,
        "--asg-endpoint",
        &asg,
        "--aws-region",
        "us-west-2",
    ];
    let kube = w
        .cluster
        .emulator()
        .config_for("agent-n1")
        .await
        .expect("client");
    let agent = InProcessAgent::start(config("n1", &flags), kube, None)
        .await
        .expect("agent");

    w.asg.begin_termination(I).expect("terminating");
    rig.put(
        "aws.autoscaling",
        "EC2 Instance-terminate Lifecycle Action",
        json!({
            "LifecycleActionToken": "87654321-4321-4321-4321-210987654321",
            "AutoScalingGroupName": GROUP,
            "LifecycleHookName": "lastcall",
            "EC2InstanceId": I,
            "LifecycleTransition": "autoscaling:EC2_INSTANCE_TERMINATING",
            "Origin": "AutoScalingGroup",
            "Destination": "EC2",
        }),
        I,
    )
    .await;
    wait_for("the node fenced", || async {
        let node = w.cluster.node("n1")?;
        (node["spec"]["unschedulable"] == true).then_some(())
    })
    .await;
    // Three heartbeats while the match runs: more than one heartbeat timeout has passed by
    // the third, so only the heartbeats kept the instance.
    wait_for("three heartbeats", || async {
        let beats = w
            .asg
            .journal()
            .iter()
            .filter(|e| e.happening == Happening::HeartbeatRecorded)
            .count();
        (beats >= 3).then_some(())
    })
    .await;
    assert_eq!(
        w.asg.lifecycle_state(I),
        Some(LifecycleState::TerminatingWait)
    );
    assert_eq!(
        w.asg.calls("CompleteLifecycleAction"),
        0,
        "not while the match runs"
    );
    assert_eq!(
        w.cluster
            .game_server("default", &w.playing)
            .expect("the match's server")
            .state,
        Some(GameServerState::Allocated),
        "the match is untouched"
    );

    w.cluster
        .sdk_shutdown("default", &w.playing)
        .expect("the match ends");
    wait_for("the hook completed", || async {
        (w.asg.lifecycle_state(I) == Some(LifecycleState::Terminated)).then_some(())
    })
    .await;
    let j = w.asg.journal();
    assert!(
        !j.iter()
            .any(|e| matches!(e.happening, Happening::TimedOut { .. })),
        "the hook timed out: {j:#?}"
    );
    let completions: Vec<_> = j
        .iter()
        .filter(|e| matches!(&e.happening, Happening::Completed { result } if result == "CONTINUE"))
        .collect();
    assert_eq!(completions.len(), 1, "{j:#?}");
    let m = agent.metrics().await;
    assert_eq!(
        metric(
            &m,
            "lastcall_asg_lifecycle_calls_total",
            &[("operation", "CompleteLifecycleAction"), ("result", "ok")]
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &m,
            "lastcall_source_errors_total",
            &[("source", "asg_lifecycle"), ("reason", "imds")]
        ),
        None,
        "instance metadata was never read"
    );
    agent.stop().await.expect("clean stop");
    relay.stop().await;
    w.cluster.shutdown().await;
}
