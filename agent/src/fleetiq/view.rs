//! The FleetIQ source's current view of this instance, and its translation into a notice.

use tokio::time::Instant;

use jiff::Timestamp;
use lastcall_common::fleetiq::InstanceStatus;

use crate::notice::{Cause, Notice, Severity, Source};

/// The FleetIQ source's name (`sources::fleetiq` registers it): its notices carry it.
pub const SOURCE: Source = Source("fleetiq");

/// How the status reached us.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    /// Live PUBLISH on the instance channel.
    Message,
    /// The last value pubsub cached in Redis, read at (re)subscribe.
    Cache,
    /// Direct DescribeGameServerInstances because Redis went quiet.
    Fallback,
}

/// Level, not edge: the latest status and when it changed. Kept across disconnects.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FleetIqView {
    pub status: Option<InstanceStatus>,
    pub via: Option<Via>,
    /// When any valid status last arrived (drives staleness).
    pub last_seen: Option<Instant>,
    /// When the current status first arrived (wall clock, for deadlines; monotonic, for latency).
    pub since: Option<(Timestamp, Instant)>,
    /// When the current status was polled (Unix ms), if known: pubsub's polled-at time for
    /// Redis values, the call's send time for the fallback. Newer-only ordering uses it.
    pub polled_at_ms: Option<i64>,
    /// When SPOT_TERMINATING was first seen. A Spot interruption cannot be withdrawn, so the
    /// Terminate notice stays even if a later message says otherwise.
    pub spot_since: Option<Timestamp>,
}

/// AWS gives two minutes between a Spot interruption notice and reclaim.
pub const SPOT_NOTICE: jiff::SignedDuration = jiff::SignedDuration::from_secs(120);

impl FleetIqView {
    /// Records a status; `since` moves only when the status changes, so a status re-published
    /// every period does not keep pushing a deadline back.
    pub fn observe(&mut self, status: InstanceStatus, via: Via, now: Timestamp, mono: Instant) {
        if self.status != Some(status) {
            self.since = Some((now, mono));
        }
        if status == InstanceStatus::SpotTerminating && self.spot_since.is_none() {
            self.spot_since = Some(now);
        }
        self.status = Some(status);
        self.via = Some(via);
        self.last_seen = Some(mono);
    }

    pub fn notice(&self, instance_id: &str) -> Option<Notice> {
        let (since, _) = self.since?;
        let base = |cause, severity, deadline, cancellable, status: InstanceStatus| Notice {
            id: format!("{instance_id}:{status}"),
            ..Notice::new(
                SOURCE,
                cause,
                severity,
                deadline,
                cancellable,
                format!("FleetIQ InstanceStatus={status} via {:?}", self.via),
            )
        };
        if let Some(spot) = self.spot_since {
            let s = InstanceStatus::SpotTerminating;
            let deadline = spot.checked_add(SPOT_NOTICE).ok();
            // Counted from first sight, so a restart would count it again, later.
            return Some(Notice {
                estimated_deadline: true,
                ..base(Cause::Preemption, Severity::Terminate, deadline, false, s)
            });
        }
        match self.status? {
            InstanceStatus::Active => None,
            s @ InstanceStatus::Draining => {
                Some(base(Cause::Viability, Severity::Drain, None, true, s))
            }
            s @ InstanceStatus::SpotTerminating => Some(base(
                Cause::Preemption,
                Severity::Terminate,
                since.checked_add(SPOT_NOTICE).ok(),
                false,
                s,
            )),
        }
    }

    /// When the current drain-worthy status was first seen, for signal→fence latency.
    pub fn since_instant(&self) -> Option<Instant> {
        self.since.map(|(_, m)| m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadline_is_stable_across_republished_status() {
        let t0: Timestamp = "2026-11-30T05:00:00Z".parse().unwrap();
        let m = Instant::now();
        let mut v = FleetIqView::default();
        assert_eq!(v.notice("i-1"), None);
        v.observe(InstanceStatus::Active, Via::Cache, t0, m);
        assert_eq!(v.notice("i-1"), None);
        v.observe(InstanceStatus::SpotTerminating, Via::Message, t0, m);
        let later = t0.checked_add(jiff::SignedDuration::from_secs(60)).unwrap();
        v.observe(InstanceStatus::SpotTerminating, Via::Message, later, m);
        let n = v.notice("i-1").unwrap();
        assert_eq!(n.severity, Severity::Terminate);
        assert!(!n.cancellable);
        assert_eq!(n.deadline, Some("2026-11-30T05:02:00Z".parse().unwrap()));
        // A Spot interruption cannot be withdrawn: later statuses keep the Terminate notice.
        v.observe(InstanceStatus::Active, Via::Fallback, later, m);
        let n = v.notice("i-1").unwrap();
        assert_eq!(
            (n.cause, n.severity, n.cancellable),
            (Cause::Preemption, Severity::Terminate, false)
        );
        assert_eq!(n.deadline, Some("2026-11-30T05:02:00Z".parse().unwrap()));
        let mut d = FleetIqView::default();
        d.observe(InstanceStatus::Draining, Via::Message, t0, m);
        let n = d.notice("i-1").unwrap();
        assert_eq!(
            (n.cause, n.severity, n.cancellable),
            (Cause::Viability, Severity::Drain, true)
        );
        d.observe(InstanceStatus::Active, Via::Message, later, m);
        assert_eq!(d.notice("i-1"), None, "DRAINING is withdrawn by ACTIVE");
    }
}
