//! The control-plane loop: every controller, one level-triggered pass at a time.
//!
//! A pass runs the node lifecycle controller (when enabled), the kubelets, the taint
//! manager, the scheduler, the GameServer controller and the Fleet controller, each re-reading the store and acting on what it finds now
//! (never on what changed). Passes run after every burst of store changes (the model's
//! own writes included, until a pass finds nothing to do), on a short tick while a timer
//! is pending (grace periods, `tolerationSeconds`), and once a second regardless.
//! After each pass the loop publishes whether the cluster is quiet: the pass wrote nothing,
//! nobody else did meanwhile, and no timer is pending.

use std::panic::AssertUnwindSafe;
use std::time::Duration;

use tokio::sync::{broadcast, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use crate::kube::store::Store;

use super::kubelet::Kubelet;
use super::scheduler::Scheduler;
use super::taint_manager::TaintManager;
use super::{agones, fleet, node_lifecycle};

/// How often a pass runs even when nothing changed (a resync, as informers do).
const RESYNC: Duration = Duration::from_secs(1);

/// What the loop reports after each pass.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Progress {
    /// Passes completed.
    pub passes: u64,
    /// The store resourceVersion at which the last pass found nothing to do and no timer
    /// pending; `None` when it did something or waits for a timer.
    pub quiet_at: Option<u64>,
    /// Passes that panicked (a model bug); the loop logs and keeps going.
    pub panics: u64,
}

/// The controllers and their timers.
#[derive(Default)]
struct Controllers {
    node_lifecycle: bool,
    kubelet: Kubelet,
    taint_manager: TaintManager,
    scheduler: Scheduler,
}

impl Controllers {
    /// One pass; returns whether a timer is pending.
    fn pass(&mut self, store: &Store, now: Instant) -> bool {
        if self.node_lifecycle {
            node_lifecycle::run(store);
        }
        let terminating = self.kubelet.run(store, now);
        let tolerating = self.taint_manager.run(store, now);
        let binding = self.scheduler.run(store, now);
        agones::on_store::run(store);
        fleet::run(store);
        terminating || tolerating || binding
    }
}

/// The running loop.
pub(crate) struct ModelTask {
    pub cancel: CancellationToken,
    pub task: JoinHandle<()>,
    pub progress: watch::Receiver<Progress>,
}

/// Starts the loop; it runs until `cancel` fires.
pub(crate) fn spawn(
    store: Store,
    tick: Duration,
    node_lifecycle: bool,
    bind_lag: Duration,
) -> ModelTask {
    let cancel = CancellationToken::new();
    let (tx, progress) = watch::channel(Progress::default());
    // Subscribe before the first pass so no change between the two is missed.
    let rx = store.subscribe();
    let controllers = Controllers {
        node_lifecycle,
        scheduler: Scheduler::new(bind_lag),
        ..Controllers::default()
    };
    let task = tokio::spawn(run(store, tick, controllers, rx, tx, cancel.clone()));
    ModelTask {
        cancel,
        task,
        progress,
    }
}

async fn run(
    store: Store,
    tick: Duration,
    mut controllers: Controllers,
    mut rx: broadcast::Receiver<std::sync::Arc<crate::kube::store::StoreEvent>>,
    progress: watch::Sender<Progress>,
    cancel: CancellationToken,
) {
    let mut interval = tokio::time::interval(tick.max(Duration::from_millis(1)));
    interval.set_missed_tick_behavior(MissedTickBehavior::Skip);
    loop {
        let before = store.resource_version();
        let now = Instant::now();
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| controllers.pass(&store, now)));
        let after = store.resource_version();
        let last_pass = Instant::now();
        let pending = match outcome {
            Ok(pending) => pending,
            Err(_) => {
                tracing::error!("cluster model pass panicked; continuing with the next pass");
                progress.send_modify(|p| p.panics += 1);
                true
            }
        };
        progress.send_modify(|p| {
            p.passes += 1;
            p.quiet_at = (before == after && !pending).then_some(after);
        });
        // Wait for something worth another pass.
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                ev = rx.recv() => match ev {
                    Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {
                        // Coalesce the burst: one pass sees all of it.
                        while let Ok(_) | Err(broadcast::error::TryRecvError::Lagged(_)) = rx.try_recv() {}
                        break;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                _ = interval.tick() => {
                    if pending || last_pass.elapsed() >= RESYNC {
                        break;
                    }
                }
            }
        }
    }
}
