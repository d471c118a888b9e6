//! How long each Fleet's answers have been held, for `fleets_held` and
//! `fleet_held_seconds{namespace,fleet}` (and the alert on a Fleet held too long: while
//! held, a Fleet can grow but never shrink).
//!
//! The Fleet names come from reviews, so only Fleets that exist (the webhook's Fleet cache)
//! are tracked, and the tracker is bounded even so: at most [`MAX_TRACKED`] Fleets, each
//! forgotten (its series dropped) once it has not asked for [`FORGET_AFTER`],
//! so a deleted Fleet's last value does not stay behind and fire the alert forever.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::metrics::{FleetLabels, WebhookMetrics};

/// Most Fleets tracked at once; reviews of more Fleets are answered, not tracked.
pub const MAX_TRACKED: usize = 2_000;
/// A Fleet that has not asked for this long is forgotten (Agones asks every sync period).
pub const FORGET_AFTER: Duration = Duration::from_secs(600);

#[derive(Debug)]
struct Track {
    held_since: Option<Instant>,
    last_answer: Instant,
}

/// At most one warning about held answers that cannot be sized, per this period.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// Per-Fleet hold durations.
#[derive(Debug, Default)]
pub struct HeldFleets {
    fleets: Mutex<HashMap<(String, String), Track>>,
    last_warning: Mutex<Option<Instant>>,
}

impl HeldFleets {
    /// Whether a warning about held answers may be logged now (at most one a minute, so
    /// callers cannot flood the log); if so, marks now.
    pub fn due_warning(&self) -> bool {
        let mut last = self.last_warning.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        if last.is_some_and(|at| now.saturating_duration_since(at) < WARN_EVERY) {
            return false;
        }
        *last = Some(now);
        true
    }

    /// Records an answer for `namespace/name` and updates the metrics. Returns how long
    /// the Fleet has been held (zero when this answer is not held).
    pub fn answered(
        &self,
        metrics: &WebhookMetrics,
        namespace: &str,
        name: &str,
        held: bool,
    ) -> Duration {
        let now = Instant::now();
        let mut fleets = self.fleets.lock().unwrap_or_else(|p| p.into_inner());
        fleets.retain(|(ns, fleet), t| {
            let keep = now.saturating_duration_since(t.last_answer) < FORGET_AFTER;
            if !keep {
                metrics.fleet_held_seconds.remove(&FleetLabels {
                    fleet_namespace: ns.clone(),
                    fleet: fleet.clone(),
                });
            }
            keep
        });
        let key = (namespace.to_string(), name.to_string());
        if !fleets.contains_key(&key) && fleets.len() >= MAX_TRACKED {
            return Duration::ZERO;
        }
        let track = fleets.entry(key).or_insert(Track {
            held_since: None,
            last_answer: now,
        });
        track.last_answer = now;
        track.held_since = if held {
            Some(track.held_since.unwrap_or(now))
        } else {
            None
        };
        let held_for = track
            .held_since
            .map_or(Duration::ZERO, |since| now.saturating_duration_since(since));
        metrics
            .fleet_held_seconds
            .get_or_create(&FleetLabels {
                fleet_namespace: namespace.to_string(),
                fleet: name.to_string(),
            })
            .set(held_for.as_secs_f64());
        let count = fleets.values().filter(|t| t.held_since.is_some()).count();
        metrics
            .fleets_held
            .set(i64::try_from(count).unwrap_or(i64::MAX));
        held_for
    }
}
