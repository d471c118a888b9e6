//! The FleetIQ game-server lifecycle: register and claim at start, heartbeat forever.
//!
//! The heartbeat runs on its own task and shares nothing with the Redis source, so a quiet
//! or dead Redis never stops it (the original adapter's worst defect). A node that is
//! already draining, as recorded on the Node, is never registered or claimed again.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use lastcall_common::admin::Health;
use lastcall_common::backoff::Backoff;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::gamelift::GameLiftError;
use super::integration::FleetIq;
use crate::metrics::{Metrics, ResultLabel};
use crate::progress::Progress;

/// Readiness check name for the heartbeat.
pub const HEALTH_HEARTBEAT: &str = "fleetiq_heartbeat";
/// Readiness check name for start-up (instance id known, registered and claimed).
pub const HEALTH_REGISTRATION: &str = "fleetiq_registration";

/// Retries one start-up step. Gives up (`None`) on shutdown, and as soon as the server has
/// been deregistered meanwhile: start-up must never register or claim a node that the
/// reconciler has already handed back.
async fn retry<F, Fut>(
    what: &str,
    shutdown: &CancellationToken,
    fleetiq: &FleetIq,
    mut f: F,
) -> Option<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), GameLiftError>>,
{
    let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(60));
    loop {
        if fleetiq.is_deregistered() {
            info!(
                message = "deregistered meanwhile; start-up stops",
                step = what
            );
            return None;
        }
        match f().await {
            Ok(()) => return Some(()),
            Err(GameLiftError::Conflict(m)) => {
                info!(message = "already done", step = what, detail = %m);
                return Some(());
            }
            Err(GameLiftError::Deregistered) => {
                info!(
                    message = "deregistered meanwhile; start-up stops",
                    step = what
                );
                return None;
            }
            Err(GameLiftError::NotOwner) => {
                info!(
                    message = "another agent owns the node; start-up stops",
                    step = what
                );
                return None;
            }
            Err(e) => {
                let delay = backoff.next_delay();
                warn!(message = "FleetIQ call failed; retrying", step = what, error = %e, retry_in_ms = delay.as_millis() as u64);
                tokio::select! {
                    () = shutdown.cancelled() => return None,
                    () = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}

/// What start-up reads from the Node.
enum Read {
    Progress(Progress),
    /// The machine came back (a new boot id) and the Node still holds the last life's drain.
    Returned,
}

/// Reads the Node until it answers; `None` on shutdown.
async fn read_progress(
    nodes: &Api<Node>,
    name: &str,
    shutdown: &CancellationToken,
) -> Option<Read> {
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
    loop {
        match nodes.get(name).await {
            Ok(n) => {
                let progress = Progress::from_annotations(
                    n.metadata
                        .annotations
                        .as_ref()
                        .unwrap_or(&Default::default()),
                );
                // A machine that came back starts a new life: the last one's drain and
                // deregistration are not this one's, but whether this life drains too is
                // the reconciler's to settle (a drain signal may still be live).
                let returned = crate::observed::NodeView::from_node(&n)
                    .is_ok_and(|v| v.machine_returned(&progress));
                return Some(if returned {
                    Read::Returned
                } else {
                    Read::Progress(progress)
                });
            }
            Err(e) => {
                let delay = backoff.next_delay();
                warn!(message = "reading own Node failed", error = %e, retry_in_ms = delay.as_millis() as u64);
                tokio::select! {
                    () = shutdown.cancelled() => return None,
                    () = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}

/// How start-up ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StartUp {
    /// Registered and claimed now: the caller records it on the Node
    /// (`keys::ANN_REGISTERED`, through the actuator) and starts heartbeats.
    Claimed,
    /// Nothing new to record; whether heartbeats may run.
    Resumed { heartbeat: bool },
    /// The machine came back: nothing is sent until the reconciler has settled its new
    /// life on the Node (the old drain lifted, or started again), then start-up runs again.
    Returned,
}

impl StartUp {
    fn heartbeat(heartbeat: bool) -> Self {
        StartUp::Resumed { heartbeat }
    }
}

/// Register → HEALTHY → claim → UTILIZED, as the original did, unless the Node says a drain
/// is under way or the server was already deregistered. Heartbeats may run unless the server
/// is deregistered (or, on a draining node, was never registered at all).
///
/// Decided from one Node read, which may come before the kubelet has posted a new boot id:
/// the decision holds for this life only, and is taken again when the reconciler starts a
/// new one ([`FleetIq::new_life`]).
pub async fn start_up(
    fleetiq: &FleetIq,
    nodes: Api<Node>,
    node_name: &str,
    shutdown: &CancellationToken,
) -> StartUp {
    let progress = match read_progress(&nodes, node_name, shutdown).await {
        None => return StartUp::heartbeat(false),
        Some(Read::Returned) => {
            info!(
                message = "the machine came back (a new boot id): FleetIQ start-up waits until the drain of its last life is settled on the Node"
            );
            return StartUp::Returned;
        }
        Some(Read::Progress(p)) => p,
    };
    if progress.deregistered.is_some() {
        fleetiq.deregistered_earlier();
        info!(message = "game server was deregistered earlier; not registering or heartbeating");
        return StartUp::heartbeat(false);
    }
    if progress.is_draining() {
        // A crash may have cut between the drain's deregistration and its Node record: ask
        // GameLift before the first heartbeat, which must never follow a deregistration.
        let Some(registered) = ask_registered(fleetiq, shutdown).await else {
            return StartUp::heartbeat(false);
        };
        if registered {
            info!(message = "node is draining; not registering or claiming again");
            return StartUp::heartbeat(true);
        }
        if progress.registered.is_some() {
            fleetiq.deregistered_earlier();
            info!(
                message = "node is draining and GameLift no longer has its game server: it was deregistered; no heartbeats"
            );
        } else {
            info!(
                message =
                    "node is draining and its game server was never registered; no heartbeats"
            );
        }
        return StartUp::heartbeat(false);
    }
    loop {
        if retry("RegisterGameServer", shutdown, fleetiq, || {
            fleetiq.register()
        })
        .await
        .is_none()
        {
            return StartUp::heartbeat(!fleetiq.is_deregistered());
        }
        if retry("UpdateGameServer HEALTHY", shutdown, fleetiq, || {
            fleetiq.heartbeat()
        })
        .await
        .is_none()
        {
            return StartUp::heartbeat(!fleetiq.is_deregistered());
        }
        // Claim can say NotFound if registration was lost meanwhile: start over.
        let lost = AtomicBool::new(false);
        let claimed = retry("ClaimGameServer", shutdown, fleetiq, || {
            let f = fleetiq.claim();
            let lost = &lost;
            async move {
                match f.await {
                    Err(GameLiftError::NotFound(_)) => {
                        lost.store(true, Ordering::SeqCst);
                        Ok(())
                    }
                    other => other,
                }
            }
        })
        .await;
        let lost = lost.load(Ordering::SeqCst);
        if claimed.is_none() {
            return StartUp::heartbeat(!fleetiq.is_deregistered());
        }
        if !lost {
            break;
        }
        warn!(message = "game server not found while claiming; registering again");
    }
    if retry("UpdateGameServer UTILIZED", shutdown, fleetiq, || {
        fleetiq.utilized()
    })
    .await
    .is_none()
    {
        return StartUp::heartbeat(!fleetiq.is_deregistered());
    }
    StartUp::Claimed
}

/// Asks GameLift whether the server is registered, until it answers; `None` on shutdown or
/// when another agent owns the node.
async fn ask_registered(fleetiq: &FleetIq, shutdown: &CancellationToken) -> Option<bool> {
    let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(60));
    loop {
        match fleetiq.still_registered().await {
            Ok(r) => return Some(r),
            Err(GameLiftError::NotOwner) => return None,
            Err(e) => {
                let delay = backoff.next_delay();
                warn!(message = "asking GameLift whether the game server is registered failed; retrying", error = %e, retry_in_ms = delay.as_millis() as u64);
                tokio::select! {
                    () = shutdown.cancelled() => return None,
                    () = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}

/// HEALTHY every `interval` until shutdown, deregistration, or a new life of the machine
/// (start-up is decided again then).
pub async fn heartbeat_loop(
    fleetiq: FleetIq,
    interval: Duration,
    failure_threshold: u32,
    metrics: Metrics,
    health: Health,
    shutdown: CancellationToken,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failures = 0u32;
    let mut lives = fleetiq.lives();
    lives.mark_unchanged();
    health.set(HEALTH_HEARTBEAT, true, "starting");
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = lives.changed() => {
                info!(message = "a new life of the machine; heartbeats wait for start-up");
                return;
            }
            _ = tick.tick() => {}
        }
        if fleetiq.is_deregistered() {
            health.set(HEALTH_HEARTBEAT, true, "deregistered; heartbeats stopped");
            info!(message = "deregistered; heartbeats stop");
            return;
        }
        let result = fleetiq.heartbeat().await;
        if matches!(result, Err(GameLiftError::Deregistered)) {
            health.set(HEALTH_HEARTBEAT, true, "deregistered; heartbeats stopped");
            info!(message = "deregistered; heartbeats stop");
            return;
        }
        if matches!(result, Err(GameLiftError::NotOwner)) {
            health.set(HEALTH_HEARTBEAT, true, "another agent owns the node");
            info!(message = "another agent owns the node; heartbeats stop here");
            return;
        }
        let label = match &result {
            Ok(()) => "ok",
            Err(e) => e.metric_label(),
        };
        metrics
            .heartbeats
            .get_or_create(&ResultLabel { result: label })
            .inc();
        match result {
            Ok(()) => {
                failures = 0;
                health.set(HEALTH_HEARTBEAT, true, "ok");
            }
            Err(e) => {
                failures += 1;
                warn!(message = "heartbeat failed", error = %e, consecutive = failures);
                if failures >= failure_threshold {
                    health.set(
                        HEALTH_HEARTBEAT,
                        false,
                        format!("{failures} consecutive failures: {e}"),
                    );
                }
            }
        }
    }
}
