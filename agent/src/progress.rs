//! Drain progress, stored as annotations on the Node.
//!
//! Memory is lost when the agent restarts; the Node is not. Reading progress from the Node
//! is what lets a restarted agent resume a drain without re-registering, re-claiming or
//! deregistering twice.

use std::collections::BTreeMap;

use jiff::Timestamp;

use crate::keys;
use crate::notice::Cause;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    pub started: Option<Timestamp>,
    pub cause: Option<Cause>,
    /// lastcall cordoned the node (it was schedulable before), so a cancel may uncordon it.
    pub cordoned_by_us: bool,
    pub deregistered: Option<Timestamp>,
    pub registered: Option<Timestamp>,
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
}
