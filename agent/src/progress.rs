//! Drain progress, stored as annotations on the Node.
//!
//! Memory is lost when the agent restarts; the Node is not. Reading progress from the Node
//! is what lets a restarted agent resume a drain without re-registering, re-claiming or
//! deregistering twice.

use std::collections::BTreeMap;

use jiff::Timestamp;

use crate::keys;
use crate::notice::{Cause, Notice, Severity, Source};

/// The notice that drives a drain, persisted on the Node. Merging only ever makes it
/// stronger: severity rises, the deadline only tightens, and a drain that could not be
/// cancelled never becomes cancellable again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DrainRecord {
    pub source: Source,
    pub cause: Cause,
    pub severity: Severity,
    pub deadline: Option<Timestamp>,
    pub cancellable: bool,
    pub first_seen: Timestamp,
}

/// The record as read from the Node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Recorded {
    #[default]
    Absent,
    Valid(DrainRecord),
    /// Present but unreadable (edited by hand?): never read as "may be cancelled".
    Garbled,
}

impl DrainRecord {
    pub fn from_notice(n: &Notice, now: Timestamp) -> Self {
        Self {
            source: n.source,
            cause: n.cause,
            severity: n.severity,
            deadline: n.deadline,
            cancellable: n.cancellable,
            first_seen: now,
        }
    }

    /// This record after `n` has driven the drain too.
    pub fn merge(&self, n: &Notice) -> Self {
        let stronger = n.severity > self.severity
            || (n.severity == self.severity
                && matches!((n.deadline, self.deadline), (Some(a), Some(b)) if a < b));
        let deadline = match (self.deadline, n.deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        Self {
            source: if stronger { n.source } else { self.source },
            cause: if stronger { n.cause } else { self.cause },
            severity: self.severity.max(n.severity),
            deadline,
            cancellable: self.cancellable && n.cancellable,
            first_seen: self.first_seen,
        }
    }

    /// The recorded notice, as policy sees a live one.
    pub fn as_notice(&self) -> Notice {
        Notice {
            source: self.source,
            id: format!("recorded:{}", self.source.as_str()),
            cause: self.cause,
            severity: self.severity,
            deadline: self.deadline,
            cancellable: self.cancellable,
            cordon: true,
            can_start_early: false,
            detail: format!("recorded on the Node since {}", format_ts(self.first_seen)),
        }
    }

    pub fn to_annotation(&self) -> String {
        let mut v = serde_json::json!({
            "source": self.source.as_str(),
            "cause": self.cause.as_str(),
            "severity": self.severity.as_str(),
            "cancellable": self.cancellable,
            "firstSeen": format_ts(self.first_seen),
        });
        if let Some(d) = self.deadline {
            v["deadline"] = serde_json::Value::String(format_ts(d));
        }
        v.to_string()
    }

    pub fn parse(s: &str) -> Option<Self> {
        let v: serde_json::Value = serde_json::from_str(s).ok()?;
        let text = |k: &str| v.get(k).and_then(|x| x.as_str());
        let deadline = match v.get("deadline") {
            None | Some(serde_json::Value::Null) => None,
            Some(d) => Some(d.as_str()?.parse().ok()?),
        };
        Some(Self {
            source: crate::sources::by_name(text("source")?)?,
            cause: Cause::parse(text("cause")?)?,
            severity: Severity::parse(text("severity")?)?,
            deadline,
            cancellable: v.get("cancellable")?.as_bool()?,
            first_seen: text("firstSeen")?.parse().ok()?,
        })
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    pub started: Option<Timestamp>,
    pub cause: Option<Cause>,
    /// lastcall cordoned the node (it was schedulable before), so a cancel may uncordon it.
    pub cordoned_by_us: bool,
    pub deregistered: Option<Timestamp>,
    pub registered: Option<Timestamp>,
    pub record: Recorded,
    /// lastcall added the compat draining taint.
    pub compat_draining_ours: bool,
}

impl Progress {
    /// Reads progress; a garbled annotation reads as absent for timestamps, but the
    /// presence of the started key alone still means "a drain is in progress".
    pub fn from_annotations(ann: &BTreeMap<String, String>) -> Self {
        let ts = |k: &str| ann.get(k).and_then(|v| v.parse::<Timestamp>().ok());
        let started = ann
            .get(keys::ANN_STARTED)
            .map(|v| v.parse().unwrap_or(Timestamp::UNIX_EPOCH));
        Self {
            started,
            cause: ann.get(keys::ANN_CAUSE).and_then(|c| Cause::parse(c)),
            cordoned_by_us: ann.get(keys::ANN_CORDONED).map(String::as_str) == Some("true"),
            deregistered: ts(keys::ANN_DEREGISTERED).or_else(|| {
                ann.contains_key(keys::ANN_DEREGISTERED)
                    .then_some(Timestamp::UNIX_EPOCH)
            }),
            registered: ts(keys::ANN_REGISTERED),
            record: match ann.get(keys::ANN_NOTICE) {
                None => Recorded::Absent,
                Some(v) => DrainRecord::parse(v).map_or(Recorded::Garbled, Recorded::Valid),
            },
            compat_draining_ours: ann.get(keys::ANN_COMPAT_DRAINING).map(String::as_str)
                == Some("true"),
        }
    }

    pub fn is_draining(&self) -> bool {
        self.started.is_some() || self.deregistered.is_some()
    }
}

/// RFC 3339 with second precision, as Kubernetes writes times.
pub fn format_ts(t: Timestamp) -> String {
    t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_tolerates_garbage() {
        let t: Timestamp = "2026-11-30T05:00:00Z".parse().unwrap();
        let mut ann = BTreeMap::new();
        ann.insert(keys::ANN_STARTED.to_string(), format_ts(t));
        ann.insert(keys::ANN_CAUSE.to_string(), "viability".to_string());
        ann.insert(keys::ANN_CORDONED.to_string(), "true".to_string());
        let p = Progress::from_annotations(&ann);
        assert_eq!(p.started, Some(t));
        assert_eq!(p.cause, Some(Cause::Viability));
        assert!(p.cordoned_by_us && p.is_draining() && p.deregistered.is_none());

        ann.insert(keys::ANN_STARTED.to_string(), "yesterday-ish".to_string());
        ann.insert(keys::ANN_DEREGISTERED.to_string(), "???".to_string());
        let p = Progress::from_annotations(&ann);
        assert!(
            p.started.is_some(),
            "a garbled start time still means draining"
        );
        assert!(
            p.deregistered.is_some(),
            "a garbled deregistered mark must never allow a second call"
        );
        assert!(Progress::from_annotations(&BTreeMap::new()) == Progress::default());
    }

    fn notice(severity: Severity, deadline: Option<&str>, cancellable: bool) -> Notice {
        Notice {
            source: crate::sources::fleetiq::SOURCE,
            id: "x".into(),
            cause: if cancellable {
                Cause::Viability
            } else {
                Cause::Preemption
            },
            severity,
            deadline: deadline.map(|d| d.parse().unwrap()),
            cancellable,
            cordon: true,
            can_start_early: false,
            detail: String::new(),
        }
    }

    #[test]
    fn record_round_trips_and_only_ever_gets_stronger() {
        let t: Timestamp = "2026-11-30T05:00:00Z".parse().unwrap();
        let spot = notice(Severity::Terminate, Some("2026-11-30T05:02:00Z"), false);
        let r = DrainRecord::from_notice(&spot, t);
        assert_eq!(DrainRecord::parse(&r.to_annotation()), Some(r.clone()));
        // A later, re-anchored deadline or a cancellable Drain never loosens it.
        let later = notice(Severity::Terminate, Some("2026-11-30T05:09:00Z"), false);
        assert_eq!(r.merge(&later), r);
        let drain = notice(Severity::Drain, None, true);
        assert_eq!(r.merge(&drain), r);
        // A Drain record becomes final and gets a deadline when a Spot notice arrives.
        let d = DrainRecord::from_notice(&drain, t);
        let m = d.merge(&spot);
        assert_eq!(
            (m.severity, m.cancellable, m.deadline, m.cause, m.first_seen),
            (
                Severity::Terminate,
                false,
                spot.deadline,
                Cause::Preemption,
                t
            )
        );
        for bad in [
            "",
            "{}",
            "[1]",
            r#"{"source":"mars","cause":"viability","severity":"drain","cancellable":true,"firstSeen":"2026-11-30T05:00:00Z"}"#,
        ] {
            assert_eq!(DrainRecord::parse(bad), None, "{bad}");
        }
        let mut ann = BTreeMap::new();
        ann.insert(keys::ANN_NOTICE.to_string(), "{garbage".to_string());
        assert_eq!(Progress::from_annotations(&ann).record, Recorded::Garbled);
    }
}
