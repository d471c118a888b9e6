use std::time::Duration;

use lastcall_emulators::autoscaling::{AutoScalingEmulator, Happening, Hook, LifecycleState};
use lastcall_emulators::eventually::wait_for;
use lastcall_emulators::imds::ImdsEmulator;

use super::*;
use crate::sources::test_support::start_source;

const I: &str = "i-0123456789abcdef0";
const GROUP: &str = "game-nodes";

fn hook(name: &str, transition: &str, hb: u64) -> HookInfo {
    HookInfo {
        name: name.into(),
        transition: transition.into(),
        heartbeat_timeout: Duration::from_secs(hb),
        global_timeout: None,
    }
}

#[test]
fn the_termination_hook_is_the_named_or_the_only_one() {
    let launch = hook("warm", "autoscaling:EC2_INSTANCE_LAUNCHING", 60);
    let a = hook("a", TERMINATING, 60);
    let b = hook("b", TERMINATING, 300);
    type Case<'a> = (Vec<HookInfo>, Option<&'a str>, Result<&'a str, PickError>);
    let cases: Vec<Case> = vec![
        (vec![launch.clone(), a.clone()], None, Ok("a")),
        (vec![a.clone(), b.clone()], Some("b"), Ok("b")),
        (
            vec![launch.clone()],
            None,
            Err(PickError::NoTerminationHook),
        ),
        (vec![], None, Err(PickError::NoTerminationHook)),
        (
            vec![a.clone(), b.clone()],
            None,
            Err(PickError::Ambiguous("a, b".into())),
        ),
        // A launch hook of that name is not a termination hook.
        (
            vec![launch.clone(), a.clone()],
            Some("warm"),
            Err(PickError::NotFound("warm".into())),
        ),
    ];
    for (hooks, wanted, want) in cases {
        let got = pick_hook(&hooks, wanted).map(|h| h.name);
        assert_eq!(got, want.map(str::to_string), "{hooks:?} {wanted:?}");
    }
}

/// Only the termination wait is held; a state before it means the API lags behind
/// instance metadata (read again), anything else means no wait is coming.
#[test]
fn lifecycle_states_are_before_the_wait_the_wait_or_past_it() {
    for s in [
        "InService",
        "Terminating",
        "Pending",
        "Pending:Wait",
        "Pending:Proceed",
    ] {
        assert_eq!(lifecycle(s), Lifecycle::Before, "{s}");
    }
    assert_eq!(lifecycle("Terminating:Wait"), Lifecycle::Waiting);
    for s in [
        "Terminating:Proceed",
        "Terminated",
        "Detaching",
        "Standby",
        "",
    ] {
        assert_eq!(lifecycle(s), Lifecycle::Past, "{s}");
    }
}

#[test]
fn the_wait_ends_at_the_cap_unless_heartbeats_are_refused() {
    let t0: Timestamp = "2026-12-01T10:00:00Z".parse().unwrap();
    let mut h = Hold::new(
        GROUP.into(),
        hook("h", TERMINATING, 300),
        t0,
        Duration::from_secs(5),
    );
    // 100 × 300 s, counted from the latest the wait can have begun.
    let began: Timestamp = "2026-12-01T09:59:55Z".parse().unwrap();
    assert_eq!(h.began, began);
    assert_eq!(h.cap, began + SignedDuration::from_secs(30_000));
    assert_eq!(h.expires, began + SignedDuration::from_secs(300));
    assert_eq!(h.deadline(), h.cap);
    assert_eq!(h.heartbeat_every(), Duration::from_secs(100));
    let n = h.notice();
    assert_eq!(
        (
            n.cause,
            n.severity,
            n.deadline,
            n.cancellable,
            n.can_start_early
        ),
        (
            Cause::ScaleDown,
            Severity::Terminate,
            Some(h.cap),
            false,
            false
        )
    );

    let t1 = t0 + SignedDuration::from_secs(200);
    h.heartbeat_accepted(t1);
    assert_eq!(h.expires, t1 + SignedDuration::from_secs(300));
    assert_eq!(
        h.deadline(),
        h.cap,
        "heartbeats do not move the announced end"
    );

    // Refused: the instance goes at the heartbeat timeout, and a later success does not
    // move that back.
    h.heartbeats_denied = true;
    let denied_end = h.expires;
    assert_eq!(h.deadline(), denied_end);
    h.heartbeat_accepted(t1 + SignedDuration::from_secs(100));
    assert_eq!(h.deadline(), denied_end);
    assert!(h.notice().detail.contains("AccessDenied"));
}

#[test]
fn the_global_timeout_is_capped_at_48_hours() {
    assert_eq!(
        hook("h", TERMINATING, 7_200).global_timeout(),
        Duration::from_secs(172_800)
    );
    let mut told = hook("h", TERMINATING, 30);
    told.global_timeout = Some(Duration::from_secs(1_000));
    assert_eq!(told.global_timeout(), Duration::from_secs(1_000));
    told.global_timeout = Some(Duration::from_secs(999_999));
    assert_eq!(told.global_timeout(), Duration::from_secs(172_800));
}

struct World {
    imds: ImdsEmulator,
    asg: AutoScalingEmulator,
}

async fn world(heartbeat_secs: u64) -> World {
    let imds = ImdsEmulator::start(I, "ip-10-0-0-1.ec2.internal")
        .await
        .unwrap();
    imds.set_target_lifecycle_state(Some("InService"));
    let asg = AutoScalingEmulator::start().await.unwrap();
    asg.add_group(GROUP, vec![Hook::terminating("lastcall", heartbeat_secs)]);
    asg.add_instance(GROUP, I);
    World { imds, asg }
}

fn start(w: &World) -> crate::sources::test_support::Started {
    start_source(
        SOURCE,
        super::start,
        &[
            "--asg-lifecycle",
            "--asg-interval",
            "100ms",
            "--imds-endpoint",
            &w.imds.url(),
            "--asg-endpoint",
            &w.asg.url(),
            "--aws-region",
            "us-west-2",
        ],
    )
}

#[tokio::test]
async fn in_service_is_known_and_costs_no_auto_scaling_call() {
    let w = world(60).await;
    let s = start(&w);
    s.wait_for_notices("in service", <[Notice]>::is_empty).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(s.current(), Report::Known(vec![]));
    assert!(w.asg.journal().is_empty(), "{:?}", w.asg.journal());
}

#[tokio::test]
async fn a_match_outliving_the_heartbeat_timeout_keeps_the_instance_until_the_node_is_empty() {
    let w = world(2).await;
    let s = start(&w);
    s.wait_for_notices("in service", <[Notice]>::is_empty).await;
    w.asg.begin_termination(I).unwrap();
    w.imds.set_target_lifecycle_state(Some("Terminated"));
    let n = s
        .wait_for_notices("the hold", |n| n.iter().any(|n| n.deadline.is_some()))
        .await;
    // The announced end is the cap: 100 × 2 s from (about) now.
    let deadline = n[0].deadline.unwrap();
    let cap = Timestamp::now() + SignedDuration::from_secs(200);
    assert!(
        deadline <= cap && deadline > cap - SignedDuration::from_secs(10),
        "{deadline} vs {cap}"
    );
    // Three heartbeat timeouts later the instance is still waiting, held by heartbeats.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(
        w.asg.lifecycle_state(I),
        Some(LifecycleState::TerminatingWait)
    );
    let beats = w
        .asg
        .journal()
        .iter()
        .filter(|e| e.happening == Happening::HeartbeatRecorded)
        .count();
    assert!(beats >= 4, "{beats} heartbeats in 6 s with a 2 s timeout");
    // The node empties: the action is completed, once.
    s.node_empty.send_replace(true);
    wait_for("completed", || async {
        (w.asg.lifecycle_state(I) == Some(LifecycleState::Terminated)).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let j = w.asg.journal();
    let completions: Vec<_> = j
        .iter()
        .filter(|e| matches!(e.happening, Happening::Completed { .. }))
        .collect();
    assert_eq!(completions.len(), 1, "{j:?}");
    assert!(
        !j.iter()
            .any(|e| matches!(e.happening, Happening::TimedOut { .. }))
    );
    assert_eq!(w.asg.calls("CompleteLifecycleAction"), 1);
    assert_eq!(s.asg_calls("CompleteLifecycleAction", "ok"), 1);
}

#[tokio::test]
async fn denied_heartbeats_announce_the_hook_timeout_and_never_crash() {
    let w = world(3).await;
    w.asg
        .fail("RecordLifecycleActionHeartbeat", "AccessDenied", 403, None);
    let s = start(&w);
    s.wait_for_notices("in service", <[Notice]>::is_empty).await;
    w.asg.begin_termination(I).unwrap();
    w.imds.set_target_lifecycle_state(Some("Terminated"));
    let n = s
        .wait_for_notices("the denied hold", |n| {
            n.iter().any(|n| n.detail.contains("AccessDenied"))
        })
        .await;
    // The instance goes at the heartbeat timeout, not the cap.
    let deadline = n[0].deadline.unwrap();
    assert!(
        deadline <= Timestamp::now() + SignedDuration::from_secs(3),
        "{deadline}"
    );
    assert!(s.errors("access_denied") >= 1);
    assert!(s.asg_calls("RecordLifecycleActionHeartbeat", "access_denied") >= 1);
    assert_eq!(s.metrics().asg_heartbeat_denied.get(), 1);
    // One Warning Event on the Node, naming the missing action and the consequence.
    let warned = s.warnings();
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert_eq!(warned[0].0, HEARTBEAT_DENIED);
    assert!(
        warned[0]
            .1
            .contains("autoscaling:RecordLifecycleActionHeartbeat")
            && warned[0].1.contains("heartbeat timeout"),
        "{}",
        warned[0].1
    );
    // The source is still running: once the node is empty it completes.
    w.asg.clear_faults();
    s.node_empty.send_replace(true);
    wait_for("completed after the denial", || async {
        (w.asg.calls("CompleteLifecycleAction") == 1).then_some(())
    })
    .await;
    wait_for("the denial gauge cleared", || async {
        (s.metrics().asg_heartbeat_denied.get() == 0).then_some(())
    })
    .await;
}

#[tokio::test]
async fn unreadable_metadata_is_unknown_never_in_service() {
    let w = world(60).await;
    w.imds.fail_next(1_000_000, 500);
    let s = start(&w);
    wait_for("IMDS errors counted", || async {
        (s.errors("imds") + s.errors("instance_id") >= 2).then_some(())
    })
    .await;
    assert!(
        s.reports().iter().all(|r| *r == Report::Unknown),
        "{:?}",
        s.reports()
    );
    assert_eq!(s.up(), 0);
}

/// A completion Auto Scaling applied but whose answer was lost: asked again, the group has
/// no action left (`No active Lifecycle Action`), which is taken as done, not retried.
#[tokio::test]
async fn a_completion_whose_answer_is_lost_is_done_once() {
    let w = world(60).await;
    w.asg.begin_termination(I).unwrap();
    w.imds.set_target_lifecycle_state(Some("Terminated"));
    w.asg.lose_next("CompleteLifecycleAction", 1);
    let s = start(&w);
    s.wait_for_notices("the hold", |n| n.iter().any(|n| n.deadline.is_some()))
        .await;
    s.node_empty.send_replace(true);
    wait_for("the lost answer and the answer to the retry", || async {
        (w.asg.answers_lost() == 1
            && s.asg_calls("CompleteLifecycleAction", "no_active_action") >= 1)
            .then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(w.asg.calls("CompleteLifecycleAction"), 1);
    assert_eq!(
        s.asg_calls("CompleteLifecycleAction", "no_active_action"),
        1
    );
}

#[tokio::test]
async fn an_action_completed_before_a_restart_is_not_completed_again() {
    let w = world(60).await;
    w.asg.begin_termination(I).unwrap();
    w.imds.set_target_lifecycle_state(Some("Terminated"));
    let first = start(&w);
    first
        .wait_for_notices("the hold", |n| n.iter().any(|n| n.deadline.is_some()))
        .await;
    first.node_empty.send_replace(true);
    wait_for("completed", || async {
        (w.asg.calls("CompleteLifecycleAction") == 1).then_some(())
    })
    .await;
    drop(first);
    // A restarted agent on the same (still running) instance: the group no longer lists it
    // as waiting, so there is nothing to heartbeat or complete.
    let second = start(&w);
    second.node_empty.send_replace(true);
    second.wait_for_notices("leaving", |n| !n.is_empty()).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(w.asg.calls("CompleteLifecycleAction"), 1);
    assert_eq!(second.asg_calls("RecordLifecycleActionHeartbeat", "ok"), 0);
}

/// A standby agent (a rollout runs two on the node) keeps the wait alive, so a hand-over
/// between owners never lets the hook time out under a match; it completes nothing, even on
/// an empty node: that is the owner's to do. Judged by the Auto Scaling journal's order, not
/// by a clock: Auto Scaling applies the hook's default result when no heartbeat comes within
/// the heartbeat timeout, so a wait that outlives three timeouts was held by heartbeats.
#[tokio::test]
async fn a_standby_agent_heartbeats_the_wait_and_completes_nothing() {
    const TIMEOUT: Duration = Duration::from_secs(2);
    let w = world(TIMEOUT.as_secs()).await;
    let s = start(&w);
    s.acting.store(false, std::sync::atomic::Ordering::SeqCst);
    s.wait_for_notices("in service", <[Notice]>::is_empty).await;
    w.asg.begin_termination(I).unwrap();
    w.imds.set_target_lifecycle_state(Some("Terminated"));
    s.wait_for_notices("the hold", |n| n.iter().any(|n| n.deadline.is_some()))
        .await;
    // Nobody acting: heartbeats until the wait has stood three heartbeat timeouts.
    let held_for = |j: &[lastcall_emulators::autoscaling::Entry]| {
        let started = j
            .iter()
            .find(|e| matches!(e.happening, Happening::WaitStarted { .. }))?
            .at;
        let last = j
            .iter()
            .rev()
            .find(|e| e.happening == Happening::HeartbeatRecorded)?
            .at;
        Some(last.duration_since(started))
    };
    let j = wait_for("the wait held past three heartbeat timeouts", || async {
        let j = w.asg.journal();
        (held_for(&j)? > 3 * TIMEOUT
            || j.iter()
                .any(|e| matches!(e.happening, Happening::TimedOut { .. })))
        .then_some(j)
    })
    .await;
    assert!(
        !j.iter()
            .any(|e| matches!(e.happening, Happening::TimedOut { .. })),
        "the wait timed out while the standby was to hold it: {j:?}"
    );
    assert_eq!(
        w.asg.lifecycle_state(I),
        Some(LifecycleState::TerminatingWait),
        "{j:?}"
    );
    // Empty, but standing by: it completes nothing. With no acting agent the wait ends the
    // way Auto Scaling ends an unattended one: at the heartbeat timeout, by its default
    // result.
    s.node_empty.send_replace(true);
    wait_for("the wait to end", || async {
        (w.asg.lifecycle_state(I) != Some(LifecycleState::TerminatingWait)).then_some(())
    })
    .await;
    let j = w.asg.journal();
    assert_eq!(w.asg.calls("CompleteLifecycleAction"), 0, "{j:?}");
    assert!(
        j.iter()
            .any(|e| matches!(e.happening, Happening::TimedOut { global: false, .. })),
        "{j:?}"
    );
}

/// A standby whose heartbeats are refused announces the earlier end but leaves the Warning
/// Event to the acting agent; once it acts, it tells it, once.
#[tokio::test]
async fn a_standby_tells_no_heartbeat_denial_until_it_acts() {
    let w = world(60).await;
    w.asg
        .fail("RecordLifecycleActionHeartbeat", "AccessDenied", 403, None);
    let s = start(&w);
    s.acting.store(false, std::sync::atomic::Ordering::SeqCst);
    s.wait_for_notices("in service", <[Notice]>::is_empty).await;
    w.asg.begin_termination(I).unwrap();
    w.imds.set_target_lifecycle_state(Some("Terminated"));
    s.wait_for_notices("the denied hold", |n| {
        n.iter().any(|n| n.detail.contains("AccessDenied"))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(s.warnings(), vec![]);
    s.acting.store(true, std::sync::atomic::Ordering::SeqCst);
    wait_for("the acting agent's Warning Event", || async {
        (!s.warnings().is_empty()).then_some(())
    })
    .await;
    // Told at once (heartbeats go every 20 s here), and only once.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let warned = s.warnings();
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert_eq!(warned[0].0, HEARTBEAT_DENIED);
}

/// The Auto Scaling API is eventually consistent: it may report the instance `InService`
/// for a while after instance metadata says `Terminated`, though the wait has begun. Here it
/// lags for 3 s (30 reads at 100 ms), longer than the hook's 2 s heartbeat timeout. The wait
/// is heartbeated through the lag (a heartbeat reaches the wait whatever the describe says),
/// so it never times out, and the end announced to games counts from when metadata first
/// said so, never later than the wait's real end (it began at the termination).
#[tokio::test]
async fn a_lagging_api_never_lets_the_wait_time_out_and_the_deadline_counts_from_metadata() {
    const LAGGED: usize = 30;
    let w = world(2).await;
    let s = start(&w);
    s.wait_for_notices("in service", <[Notice]>::is_empty).await;
    w.asg.lag_describes(LAGGED);
    w.asg.begin_termination(I).unwrap();
    // The wait's real end: the cap, 100 × 2 s, from the termination's start.
    let real_end = Timestamp::now() + SignedDuration::from_secs(200);
    w.imds.set_target_lifecycle_state(Some("Terminated"));
    wait_for("the lag read past (the API shows the wait), or the wait ended", || async {
        let j = w.asg.journal();
        let describes = j
            .iter()
            .filter(|e| matches!(&e.happening, Happening::Call { action, .. } if action == "DescribeAutoScalingInstances"))
            .count();
        let ended = j
            .iter()
            .any(|e| matches!(e.happening, Happening::TimedOut { .. }));
        (describes > LAGGED || ended).then_some(())
    })
    .await;
    let j = w.asg.journal();
    assert!(
        !j.iter()
            .any(|e| matches!(e.happening, Happening::TimedOut { .. })),
        "the wait timed out while the API lagged: {j:#?}"
    );
    assert_eq!(
        w.asg.lifecycle_state(I),
        Some(LifecycleState::TerminatingWait)
    );
    // A heartbeat reached the wait before the API first showed it.
    let mut describes = 0;
    let mut beat_in_lag = false;
    for e in &j {
        match &e.happening {
            Happening::Call { action, .. } if action == "DescribeAutoScalingInstances" => {
                describes += 1
            }
            Happening::HeartbeatRecorded if describes <= LAGGED => beat_in_lag = true,
            _ => {}
        }
    }
    assert!(beat_in_lag, "no heartbeat while the API lagged: {j:#?}");
    // Announced: never later than the real end (the agent saw the wait within a read of
    // its start; here the lag alone would make it 3 s late).
    let told: Vec<Timestamp> = s
        .reports()
        .iter()
        .filter_map(|r| match r {
            Report::Known(n) => n.iter().find_map(|n| n.deadline),
            Report::Unknown => None,
        })
        .collect();
    assert!(!told.is_empty());
    for d in told {
        assert!(
            d <= real_end + SignedDuration::from_millis(500),
            "announced {d}, the wait ends at {real_end}"
        );
    }
}
