//! What a signal source says about the node: its current view, as level not edge.
//!
//! Policy matches on `cause`, `severity` and `deadline`, never on which source spoke, so a
//! new source never touches policy.

use std::collections::BTreeSet;
use std::sync::{Mutex, OnceLock};

use jiff::Timestamp;

/// Which source said it: the source's `NAME` from the registry (`sources::REGISTRY`). A
/// small fixed set, so it is also a bounded metric label and the taint value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Source(pub &'static str);

/// The name of every source this version can start, as drain records carry it. Here, with
/// the vocabulary, so that reading a record needs no registry (which needs the whole
/// configuration); `sources::REGISTRY` says how each runs, and a test keeps the two equal.
pub const BUILT_IN: &[Source] = &[
    Source("fleetiq"),
    Source("gce_metadata"),
    Source("aws_imds"),
    Source("aws_queue"),
    Source("azure_events"),
    Source("asg_lifecycle"),
    Source("karpenter_expiry"),
    Source("manual"),
    Source("karpenter"),
    Source("cluster_autoscaler"),
    Source("gke"),
    Source("cordon"),
];

impl Source {
    pub fn as_str(self) -> &'static str {
        self.0
    }

    /// The source named `name` (as read back from the Node), if this process knows it: a
    /// built-in one or one an embedder started in-process. An unknown name makes the record
    /// unreadable, never a claim.
    pub fn by_name(name: &str) -> Option<Source> {
        BUILT_IN
            .iter()
            .copied()
            .find(|s| s.as_str() == name)
            .or_else(|| {
                embedded()
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .iter()
                    .copied()
                    .find(|s| s.as_str() == name)
            })
    }

    /// Lets [`Source::by_name`] resolve sources started in-process beyond [`BUILT_IN`].
    /// Without them the drain record such a source asked for would read back as
    /// unreadable, and be written again on every pass.
    pub fn remember(sources: impl IntoIterator<Item = Source>) {
        let mut known = embedded().lock().unwrap_or_else(|e| e.into_inner());
        known.extend(sources.into_iter().filter(|s| !BUILT_IN.contains(s)));
    }
}

fn embedded() -> &'static Mutex<BTreeSet<Source>> {
    static EMBEDDED: OnceLock<Mutex<BTreeSet<Source>>> = OnceLock::new();
    EMBEDDED.get_or_init(Default::default)
}

/// What is happening to the node. Policy matches on this, never on the source.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Cause {
    /// FleetIQ judged the instance no longer viable (DRAINING).
    Viability,
    /// The instance is about to be reclaimed (Spot interruption, GCE preemption).
    Preemption,
    /// Host or scheduled maintenance (GCE, GKE, AWS scheduled events).
    Maintenance,
    /// A rebalance recommendation: the instance is at elevated risk of interruption.
    Rebalance,
    /// An autoscaler is removing the node (scale-down, consolidation, emptiness).
    ScaleDown,
    /// The node is being replaced (drift, expiry, upgrade, a cordon from elsewhere).
    Upgrade,
    /// An operator asked for the drain.
    Manual,
}

impl Cause {
    pub const ALL: [Cause; 7] = [
        Self::Viability,
        Self::Preemption,
        Self::Maintenance,
        Self::Rebalance,
        Self::ScaleDown,
        Self::Upgrade,
        Self::Manual,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Viability => "viability",
            Self::Preemption => "preemption",
            Self::Maintenance => "maintenance",
            Self::Rebalance => "rebalance",
            Self::ScaleDown => "scale_down",
            Self::Upgrade => "upgrade",
            Self::Manual => "manual",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.as_str() == s)
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
    /// Whether lastcall should cordon for it. Not when someone else already keeps new pods
    /// off the node (Karpenter's and the cluster autoscaler's own taints, a foreign cordon):
    /// then only the game-server work is done.
    pub cordon: bool,
    /// The maintenance behind it may be started early once the node is empty (GCE
    /// `can_reschedule`), which GKE does when asked with `cloud.google.com/perform-maintenance`.
    pub can_start_early: bool,
    /// The deadline is lastcall's estimate counted from when the notice was first seen (a
    /// Spot notice's two minutes, GCE's terminate notice), not a time the provider stated:
    /// a restart counts it again, later, so the recorded one stands (see `deadline`).
    pub estimated_deadline: bool,
    /// The provider restates this deadline while the notice stands and may postpone it,
    /// though it cannot withdraw the notice (an Azure `Preempt`): the time it states now is
    /// the deadline, later or earlier. A cancellable stated deadline moves anyway; an EC2
    /// Spot `instance-action` never moves later, so its source leaves this off.
    pub restated: bool,
    pub detail: String,
}

impl Notice {
    /// A notice as most sources say it: lastcall cordons, nothing starts early. The id is
    /// `<source>:<cause>`, one notice per cause and source.
    pub fn new(
        source: Source,
        cause: Cause,
        severity: Severity,
        deadline: Option<Timestamp>,
        cancellable: bool,
        detail: String,
    ) -> Self {
        Self {
            source,
            id: format!("{}:{}", source.as_str(), cause.as_str()),
            cause,
            severity,
            deadline,
            cancellable,
            cordon: true,
            can_start_early: false,
            estimated_deadline: false,
            restated: false,
            detail,
        }
    }

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
            cordon: true,
            can_start_early: false,
            estimated_deadline: false,
            restated: false,
            detail: String::new(),
        }
    }

    #[test]
    fn causes_and_severities_read_back_what_they_write() {
        for c in Cause::ALL {
            assert_eq!(Cause::parse(c.as_str()), Some(c));
        }
        for s in [Severity::Observe, Severity::Drain, Severity::Terminate] {
            assert_eq!(Severity::parse(s.as_str()), Some(s));
        }
        assert_eq!(Cause::parse("meteor"), None);
        assert_eq!(Severity::parse("Drain"), None, "case matters");
        assert_eq!(Source("fleetiq").as_str(), "fleetiq");
    }

    #[test]
    fn strongest_prefers_severity_then_earliest_deadline() {
        assert_eq!(
            Notice::strongest(&[n(Source("fleetiq"), Severity::Observe, None)]),
            None
        );
        let list = [
            n(Source("fleetiq"), Severity::Drain, None),
            n(Source("manual"), Severity::Terminate, Some(200)),
            n(Source("fleetiq"), Severity::Terminate, Some(100)),
        ];
        let s = Notice::strongest(&list).unwrap();
        assert_eq!(
            (s.severity, s.deadline),
            (Severity::Terminate, list[2].deadline)
        );
    }
}
