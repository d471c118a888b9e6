//! What a signal source says about the node: its current view, as level not edge.
//!
//! Policy matches on `cause`, `severity` and `deadline`, never on which source spoke, so a
//! new source never touches policy.

use jiff::Timestamp;

/// Where a notice came from. Used for logs, metrics and the taint value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Source {
    FleetIq,
    Manual,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::FleetIq => "fleetiq",
            Self::Manual => "manual",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "fleetiq" => Some(Self::FleetIq),
            "manual" => Some(Self::Manual),
            _ => None,
        }
    }
}

/// What is happening to the node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Cause {
    /// FleetIQ judged the instance no longer viable (DRAINING).
    Viability,
    /// The instance is about to be reclaimed (Spot interruption).
    Preemption,
    /// An operator asked for the drain.
    Manual,
}

impl Cause {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Viability => "viability",
            Self::Preemption => "preemption",
            Self::Manual => "manual",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "viability" => Some(Self::Viability),
            "preemption" => Some(Self::Preemption),
            "manual" => Some(Self::Manual),
            _ => None,
        }
    }
}

/// How hard the notice pushes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Severity {
    /// Log and count only.
    Observe,
    /// Take the node out of service when convenient.
    Drain,
    /// The node will die at the deadline.
    Terminate,
}

impl Severity {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Observe => "observe",
            Self::Drain => "drain",
            Self::Terminate => "terminate",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "observe" => Some(Self::Observe),
            "drain" => Some(Self::Drain),
            "terminate" => Some(Self::Terminate),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notice {
    pub source: Source,
    /// Stable id of the underlying event, for logs and dedupe.
    pub id: String,
    pub cause: Cause,
    pub severity: Severity,
    pub deadline: Option<Timestamp>,
    /// Whether the source may later withdraw it (FleetIQ DRAINING → ACTIVE can; Spot cannot).
    pub cancellable: bool,
    pub detail: String,
}

impl Notice {
    /// The notice that should drive the drain: highest severity, then earliest deadline.
    pub fn strongest(notices: &[Notice]) -> Option<&Notice> {
        notices
            .iter()
            .filter(|n| n.severity >= Severity::Drain)
            .max_by(|a, b| {
                a.severity
                    .cmp(&b.severity)
                    .then_with(|| match (a.deadline, b.deadline) {
                        (Some(x), Some(y)) => y.cmp(&x),
                        (Some(_), None) => std::cmp::Ordering::Greater,
                        (None, Some(_)) => std::cmp::Ordering::Less,
                        (None, None) => b.source.cmp(&a.source),
                    })
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(source: Source, severity: Severity, deadline: Option<i64>) -> Notice {
        Notice {
            source,
            id: "x".into(),
            cause: Cause::Viability,
            severity,
            deadline: deadline.map(|s| Timestamp::from_second(s).unwrap()),
            cancellable: true,
            detail: String::new(),
        }
    }

    #[test]
    fn strongest_prefers_severity_then_earliest_deadline() {
        assert_eq!(
            Notice::strongest(&[n(Source::FleetIq, Severity::Observe, None)]),
            None
        );
        let list = [
            n(Source::FleetIq, Severity::Drain, None),
            n(Source::Manual, Severity::Terminate, Some(200)),
            n(Source::FleetIq, Severity::Terminate, Some(100)),
        ];
        let s = Notice::strongest(&list).unwrap();
        assert_eq!(
            (s.severity, s.deadline),
            (Severity::Terminate, list[2].deadline)
        );
    }
}
