//! EC2 Auto Scaling lifecycle hooks end to end: the real agent (in-process, built as the
//! binary builds it) against the Kubernetes, IMDS and Auto Scaling emulators over HTTP.
//!
//! The group parks the instance in `Terminating:Wait` with a 2 s heartbeat timeout while a
//! match runs on it. The promises, read from the Auto Scaling emulator's journal:
//! - a match that outlives the hook's timeout keeps the instance (heartbeats, no timeout);
//! - the action is completed once, within seconds of the node emptying;
//! - a crash between the last match's end and the completion still completes, once;
//! - a denied heartbeat is a Warning Event on the Node, a metric and a counted error, never
//!   a crash: the agent still completes the hook once the node is empty.

use std::time::Duration;

use lastcall_testkit::agent::metric;
use lastcall_testkit::asg::{HEARTBEAT_TIMEOUT, I, agent, first, terminate, world, world_with};
use lastcall_testkit::autoscaling::{Happening, LifecycleState};
use lastcall_testkit::cluster::GameServerState;
use lastcall_testkit::eventually::wait_for;
use lastcall_testkit::kube::journal::Verb;
use tokio::time::Instant;

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
async fn a_denied_heartbeat_is_a_warning_event_and_the_agent_still_completes_the_hook() {
    // Long enough for the match to end inside the unheld wait.
    const TIMEOUT: u64 = 30;
    let w = world_with(TIMEOUT).await;
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
    // Its own Warning Event on the Node, naming the missing action and the consequence.
    let note = wait_for("the LifecycleHeartbeatDenied Event", || async {
        w.cluster
            .emulator()
            .journal()
            .filter(|r| {
                r.identity.as_deref() == Some("agent-n1")
                    && r.resource.as_deref() == Some("events")
                    && r.verb == Verb::Create
                    && r.status < 300
            })
            .into_iter()
            .find_map(|r| {
                let e = r.response?;
                (e["reason"] == "LifecycleHeartbeatDenied"
                    && e["type"] == "Warning"
                    && e["regarding"]["name"] == "n1")
                    .then(|| e["note"].as_str().unwrap_or_default().to_string())
            })
    })
    .await;
    assert!(
        note.contains("autoscaling:RecordLifecycleActionHeartbeat")
            && note.contains("heartbeat timeout"),
        "{note}"
    );
    // The announced deadline is now the hook's timeout (the instance goes then), on the
    // running match's GameServer.
    wait_for("the deadline announced", || async {
        let gs = w.cluster.game_server("default", &w.playing)?;
        let d: jiff::Timestamp = gs
            .annotations
            .get("lastcall.dev/drain-deadline")?
            .parse()
            .ok()?;
        (d <= jiff::Timestamp::now() + jiff::SignedDuration::from_secs(TIMEOUT as i64 + 1))
            .then_some(())
    })
    .await;
    let m = agent.metrics().await;
    assert_eq!(metric(&m, "lastcall_asg_heartbeat_denied", &[]), Some(1.0));
    assert_eq!(
        metric(&m, "lastcall_source_up", &[("source", "asg_lifecycle")]),
        Some(1.0),
        "still alive, still serving"
    );
    // The match ends inside the wait: the agent still completes the hook, once.
    w.cluster
        .sdk_shutdown("default", &w.playing)
        .expect("the match ends");
    wait_for("the hook completed", || async {
        (w.asg.lifecycle_state(I) == Some(LifecycleState::Terminated)).then_some(())
    })
    .await;
    let j = w.asg.journal();
    assert!(
        first(
            &j,
            |h| matches!(h, Happening::Completed { result } if result == "CONTINUE")
        )
        .is_some(),
        "completed with CONTINUE: {j:#?}"
    );
    assert!(
        !j.iter()
            .any(|e| matches!(e.happening, Happening::TimedOut { .. })),
        "the hook timed out: {j:#?}"
    );
    assert_eq!(w.asg.calls("CompleteLifecycleAction"), 1, "{j:#?}");
    let warned = w.cluster.emulator().journal().count(|r| {
        r.resource.as_deref() == Some("events")
            && r.verb == Verb::Create
            && r.response
                .as_ref()
                .is_some_and(|e| e["reason"] == "LifecycleHeartbeatDenied")
    });
    assert_eq!(warned, 1, "one Event, not one per refused heartbeat");
    agent.stop().await.expect("clean stop");
    w.cluster.shutdown().await;
}

/// The Auto Scaling API is eventually consistent: for a while after a termination begins it
/// may still say `InService` while instance metadata already says `Terminated`. The source
/// reads again until the wait shows, holds it, and completes it once the match ends: the
/// hook never times out under the match.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_auto_scaling_api_is_read_again_and_the_wait_is_held() {
    let w = world().await;
    // Four reads at the agent's 200 ms interval: the API lags for most of a second, well
    // inside the hook's 2 s heartbeat timeout (a lag as long as the timeout would end the
    // wait on AWS too).
    w.asg.lag_describes(4);
    let agent = agent(&w).await;
    terminate(&w).await;
    wait_for("the lag met and read past", || async {
        let m = agent.metrics().await;
        (metric(
            &m,
            "lastcall_source_errors_total",
            &[("source", "asg_lifecycle"), ("reason", "lagging")],
        )? >= 3.0
            && w.asg
                .journal()
                .iter()
                .any(|e| e.happening == Happening::HeartbeatRecorded))
        .then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2 * HEARTBEAT_TIMEOUT)).await;
    assert_eq!(
        w.asg.lifecycle_state(I),
        Some(LifecycleState::TerminatingWait),
        "the wait must be held while the match runs: {:#?}",
        w.asg.journal()
    );
    let m = agent.metrics().await;
    assert_eq!(metric(&m, "lastcall_asg_state_lag_seconds", &[]), Some(0.0));
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
    assert_eq!(w.asg.calls("CompleteLifecycleAction"), 1, "{j:#?}");
    agent.stop().await.expect("clean stop");
    w.cluster.shutdown().await;
}
