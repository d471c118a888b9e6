//! Liveness of the polling loop: is the process still doing its work, whatever Redis does?
//!
//! `/healthz` must not follow Redis. A Redis that is down for everyone would restart pubsub
//! into CrashLoopBackOff, and the FleetAutoscaler webhook, built to answer "held" without
//! Redis, would then give Agones connection errors, so no Fleet could scale at all, not
//! even up. Readiness reports Redis; liveness reports only that the loop turns: it is
//! either waiting for a cycle that is due no later than planned, or inside a cycle that
//! started less than `--liveness-timeout` ago. A cycle is bounded (the poll by
//! `--cycle-deadline`, each Redis round trip by `--redis-timeout`), so a cycle older than
//! that is stuck, and a restart is the right remedy.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// Where the polling loop is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoopState {
    /// Sleeping until the next cycle, planned for `until`.
    Waiting { until: Instant },
    /// In a cycle that started at `since`.
    Cycling { since: Instant },
}

/// The verdict for `state` at `now`: `Ok`, or why the loop is not alive.
pub fn verdict(state: LoopState, now: Instant, timeout: Duration) -> Result<(), String> {
    match state {
        LoopState::Waiting { until } => {
            let late = now.saturating_duration_since(until);
            if late > timeout {
                return Err(format!(
                    "the polling loop missed its next cycle by {}s (liveness timeout {}s)",
                    late.as_secs(),
                    timeout.as_secs()
                ));
            }
            Ok(())
        }
        LoopState::Cycling { since } => {
            let running = now.saturating_duration_since(since);
            if running > timeout {
                return Err(format!(
                    "one cycle has run for {}s (liveness timeout {}s): the polling loop is stuck",
                    running.as_secs(),
                    timeout.as_secs()
                ));
            }
            Ok(())
        }
    }
}

/// The loop's state, shared between the loop and `/healthz`.
#[derive(Debug)]
pub struct Liveness {
    state: Mutex<LoopState>,
    timeout: Duration,
}

impl Liveness {
    pub fn new(timeout: Duration) -> Self {
        Self {
            state: Mutex::new(LoopState::Waiting {
                until: Instant::now(),
            }),
            timeout,
        }
    }

    pub fn waiting_until(&self, until: Instant) {
        self.set(LoopState::Waiting { until });
    }

    pub fn cycling(&self) {
        self.set(LoopState::Cycling {
            since: Instant::now(),
        });
    }

    /// Whether the loop is alive now, or why not.
    pub fn check(&self) -> Result<(), String> {
        let state = *self.state.lock().unwrap_or_else(|p| p.into_inner());
        verdict(state, Instant::now(), self.timeout)
    }

    fn set(&self, state: LoopState) {
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) = state;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(300);

    #[test]
    fn a_loop_that_waits_or_cycles_within_the_timeout_is_alive() {
        let t0 = Instant::now();
        let waiting = LoopState::Waiting {
            until: t0 + Duration::from_secs(60),
        };
        // Long before the planned cycle, and up to the timeout after it.
        assert!(verdict(waiting, t0, T).is_ok());
        assert!(verdict(waiting, t0 + Duration::from_secs(360), T).is_ok());
        let late = verdict(waiting, t0 + Duration::from_secs(361), T).unwrap_err();
        assert!(late.contains("missed its next cycle by 301s"), "{late}");

        let cycling = LoopState::Cycling { since: t0 };
        assert!(verdict(cycling, t0 + T, T).is_ok());
        let stuck = verdict(cycling, t0 + T + Duration::from_secs(1), T).unwrap_err();
        assert!(stuck.contains("stuck"), "{stuck}");
    }
}
