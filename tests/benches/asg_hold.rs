//! An Auto Scaling termination hook held through a match that outlives it: how long the
//! instance was kept, and how soon after the last match ended it was let go.
//!
//! Each round: one node in a group whose termination hook has a 2 s heartbeat timeout, one
//! running match and one idle server, the real agent (in-process, built as the binary builds
//! it) against the Kubernetes, IMDS and Auto Scaling emulators over HTTP. The group starts
//! terminating the instance, the match runs for 6 s (three heartbeat timeouts), then ends.
//! Measured from the Auto Scaling emulator's journal: the wait (start → completion) and the
//! release latency (match end → `CompleteLifecycleAction`). The same-run baseline is the hook
//! on its own: without heartbeats the instance goes at the heartbeat timeout (the match dies),
//! and without a completion an emptied instance waits the rest of it.
//!
//! `cargo bench -p lastcall-testkit --bench asg_hold`

use std::time::Duration;

use lastcall_testkit::asg::{HEARTBEAT_TIMEOUT, I, agent, first, terminate, world};
use lastcall_testkit::autoscaling::{Happening, LifecycleState};
use lastcall_testkit::bench::{ms, percentile};
use lastcall_testkit::eventually::wait_for;
use tokio::time::Instant;

const ROUNDS: usize = 5;
const MATCH: Duration = Duration::from_secs(3 * HEARTBEAT_TIMEOUT);

/// (held, released after the match ended, timed out)
async fn round() -> anyhow::Result<(Duration, Duration, bool)> {
    let w = world().await;
    let a = agent(&w).await;
    terminate(&w).await;
    tokio::time::sleep(MATCH).await;
    let end = Instant::now();
    w.cluster.sdk_shutdown("default", &w.playing)?;
    wait_for("the instance gone", || async {
        (w.asg.lifecycle_state(I) == Some(LifecycleState::Terminated)).then_some(())
    })
    .await;
    let j = w.asg.journal();
    let began = first(&j, |h| matches!(h, Happening::WaitStarted { .. }))
        .ok_or_else(|| anyhow::anyhow!("no wait"))?;
    let gone =
        first(&j, |h| *h == Happening::Terminated).ok_or_else(|| anyhow::anyhow!("not gone"))?;
    let timed_out = j
        .iter()
        .any(|e| matches!(e.happening, Happening::TimedOut { .. }));
    a.stop().await?;
    w.cluster.shutdown().await;
    Ok((
        gone.duration_since(began),
        gone.saturating_duration_since(end),
        timed_out,
    ))
}

/// The baseline: the same hook with nobody heartbeating or completing it.
async fn baseline() -> anyhow::Result<Duration> {
    let w = world().await;
    w.asg.begin_termination(I)?;
    let start = Instant::now();
    wait_for("the hook timed out", || async {
        (w.asg.lifecycle_state(I) == Some(LifecycleState::Terminated)).then_some(())
    })
    .await;
    let gone = first(&w.asg.journal(), |h| *h == Happening::Terminated)
        .ok_or_else(|| anyhow::anyhow!("not gone"))?;
    w.cluster.shutdown().await;
    Ok(gone.saturating_duration_since(start))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let mut held = vec![];
    let mut released = vec![];
    let mut timeouts = 0;
    for _ in 0..ROUNDS {
        let (h, r, t) = round().await?;
        held.push(h);
        released.push(r);
        timeouts += usize::from(t);
    }
    let bare = baseline().await?;
    println!(
        "asg_hold: {ROUNDS} rounds, a {} s match on a hook with a {HEARTBEAT_TIMEOUT} s heartbeat timeout",
        MATCH.as_secs()
    );
    println!(
        "  instance held: p50 {} / max {}",
        ms(percentile(&mut held, 0.5), 0),
        ms(percentile(&mut held, 1.0), 0)
    );
    println!(
        "  released after the last match ended: p50 {} / max {}",
        ms(percentile(&mut released, 0.5), 0),
        ms(percentile(&mut released, 1.0), 0)
    );
    println!("  rounds where the hook timed out (the match would have died): {timeouts}");
    println!(
        "  baseline, the hook alone: the instance goes {} after the wait starts, match running or not",
        ms(bare, 0)
    );
    anyhow::ensure!(timeouts == 0, "a hook timed out with a match running");
    Ok(())
}
