//! Dry-run mode: every outside write (Kubernetes or GameLift) is logged, counted and
//! recorded instead of sent, through the same code path up to the wire. The reconciler lays
//! what it did not send over what it observes ([`overlay`]), so each plan follows as if the
//! last step had landed, and tells the whole drain step by step ([`narration`]).

pub mod narration;
pub mod overlay;

use std::sync::{Arc, Mutex};

use tracing::info;

use crate::metrics::{ActionResult, Metrics};

/// Dry-run calls kept for inspection; beyond this they are still skipped, just not recorded.
const MAX_RECORDED: usize = 10_000;

/// Shared by every writer, so one switch and one record cover all of them.
#[derive(Clone)]
pub struct DryRun {
    enabled: bool,
    metrics: Metrics,
    recorded: Arc<Mutex<Vec<String>>>,
}

impl DryRun {
    pub fn new(enabled: bool, metrics: Metrics) -> Self {
        Self {
            enabled,
            metrics,
            recorded: Arc::default(),
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// In dry-run mode, records `what` and returns true: the caller must not send. A call
    /// already recorded is not logged or counted again (each pass re-plans the same calls,
    /// since nothing changes).
    pub fn skip(&self, kind: &'static str, what: String) -> bool {
        if !self.enabled {
            return false;
        }
        if let Ok(mut r) = self.recorded.lock()
            && r.len() < MAX_RECORDED
            && !r.contains(&what)
        {
            info!(message = "dry run: not sending", call = %what);
            self.metrics
                .actions
                .get_or_create(&ActionResult {
                    action: kind,
                    result: "dry_run",
                })
                .inc();
            r.push(what);
        }
        true
    }

    /// What dry-run mode would have sent, in order.
    pub fn recorded(&self) -> Vec<String> {
        self.recorded.lock().map(|r| r.clone()).unwrap_or_default()
    }
}
