//! The drain's latency metrics: signal → fenced (and every idle server released), and drain
//! start → empty. Each is observed once per drain; what the reconciler tells it is only the
//! plan it applied.

use tokio::time::Instant;
use tracing::info;

use crate::metrics::Metrics;
use crate::policy::{Phase, Plan};
use crate::progress::Progress;

#[derive(Default)]
pub struct DrainTiming {
    /// When the current drain signal arrived, until the node is fenced.
    fence_clock: Option<Instant>,
    fenced_recorded: bool,
    drain_recorded: bool,
    /// The last pass without a drain signal.
    last_quiet: Option<Instant>,
}

impl DrainTiming {
    /// Before the plan is applied. `last_change` is when a task source last changed its
    /// report: if that came after the last quiet pass, it is when the signal arrived; a Node
    /// signal arrives with the watch event that woke this pass.
    pub fn planned(&mut self, plan: &Plan, last_change: Option<Instant>, now: Instant) {
        if plan.driver.is_some() && self.fence_clock.is_none() && !self.fenced_recorded {
            let since = last_change.filter(|t| self.last_quiet.is_none_or(|q| *t > q));
            self.fence_clock = Some(since.unwrap_or(now));
        }
        if plan.driver.is_none() {
            self.last_quiet = Some(now);
        }
        if plan.driver.is_none() && matches!(plan.phase, Phase::Idle | Phase::Cancelling) {
            *self = Self {
                last_quiet: self.last_quiet,
                ..Self::default()
            };
        }
    }

    /// After the whole plan was applied. A pass that succeeded applied its whole plan, so
    /// once the plan is past fencing (or was the fencing pass itself), the node is fenced
    /// and every Ready server released.
    pub fn applied(&mut self, plan: &Plan, progress: &Progress, metrics: &Metrics, now: Instant) {
        let fenced = matches!(
            plan.phase,
            Phase::Fencing | Phase::Draining | Phase::Empty | Phase::Deregistered
        );
        if plan.driver.is_some() && fenced && !self.fenced_recorded {
            if let Some(t0) = self.fence_clock.take() {
                let secs = now.saturating_duration_since(t0).as_secs_f64();
                metrics.signal_to_fence.observe(secs);
                info!(
                    message = "node fenced and idle servers released",
                    seconds = secs
                );
            }
            self.fenced_recorded = true;
        }
        if matches!(plan.phase, Phase::Empty | Phase::Deregistered) && !self.drain_recorded {
            if let Some(start) = progress.start() {
                let secs = jiff::Timestamp::now()
                    .duration_since(start)
                    .as_secs_f64()
                    .max(0.0);
                metrics.drain_duration.observe(secs);
            }
            self.drain_recorded = true;
        }
    }
}
