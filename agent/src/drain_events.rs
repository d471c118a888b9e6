//! Kubernetes Events from the plan's steps: one Event per reconcile pass that changed
//! something, on the Node, telling every step of that pass. A pass that failed part-way (a
//! 429, a 5xx) hands its steps to the next pass's Event instead, for a few seconds at most,
//! so a throttled drain does not write one Event per refused pass.
//!
//! An Event per object per step would cost as many API writes as the drain itself (a node
//! with 7 game servers paid 10 Event writes for 16 real ones). Operators read a drain on
//! its Node (`kubectl describe node`), and each protected GameServer already carries its
//! deadline and reason as annotations, so one summary per pass loses nothing.

use crate::policy::NodeEvent;

/// Names listed in one note before "and N more": an Event note is at most 1 kB.
const MAX_NAMES: usize = 8;
/// The API server rejects longer notes.
const MAX_NOTE: usize = 1024;

/// What one pass did, collected as its steps succeed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PassLog {
    /// The Node write's meaning (decided by policy with the step), and whether it cordoned.
    pub node: Vec<NodeEvent>,
    pub cordoned: bool,
    /// `namespace/name` of servers deleted with their preconditions.
    pub released: Vec<String>,
    /// Servers that changed between the read and the delete (allocation won?).
    pub skipped: Vec<String>,
    /// Servers that got (or had moved) their deadline, with it and the reason.
    pub protected: Vec<String>,
    pub deadline: Option<(String, String)>,
    /// Game-server pods whose graceful termination lastcall started before a deadline.
    pub ended: Vec<String>,
    pub deregistered: bool,
}

/// Every Event reason the agent emits (documented in `docs/events.md`).
pub const REASONS: &[&str] = &[
    "DrainStarted",
    "NodeFenced",
    "DrainCancelled",
    "MachineReturned",
    "GameServersReleased",
    "GameServersProtected",
    "ReleaseSkipped",
    "MatchesEnded",
    "Deregistered",
    // Policy's warnings (`policy::Warning`), sent once per process.
    "CompatTaintSkipped",
    "MatchesAtRisk",
    "CooperationLabelInvalid",
    "EvictionSafeUnknown",
    crate::policy::DEREGISTERED_WHILE_BUSY,
    crate::policy::MACHINE_RETURNED_HELD,
    // Sources' warnings (`sources::NodeWarnings`).
    crate::sources::asg_lifecycle::HEARTBEAT_DENIED,
    // Start-up's check of the node restriction.
    crate::node_restriction::REASON,
];

fn names(list: &[String]) -> String {
    let mut s = list
        .iter()
        .take(MAX_NAMES)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if list.len() > MAX_NAMES {
        s.push_str(&format!(" and {} more", list.len() - MAX_NAMES));
    }
    s
}

impl PassLog {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// Adds a later pass's steps to this one's, each named once: the Event of a pass that
    /// failed part-way waits for the pass that finishes its work (see `Reconciler::tell`).
    pub fn merge(&mut self, later: PassLog) {
        fn add<T: PartialEq>(to: &mut Vec<T>, from: Vec<T>) {
            for x in from {
                if !to.contains(&x) {
                    to.push(x);
                }
            }
        }
        add(&mut self.node, later.node);
        self.cordoned |= later.cordoned;
        add(&mut self.released, later.released);
        add(&mut self.skipped, later.skipped);
        add(&mut self.protected, later.protected);
        if later.deadline.is_some() {
            self.deadline = later.deadline;
        }
        add(&mut self.ended, later.ended);
        self.deregistered |= later.deregistered;
    }

    /// The pass's one Event: the reason of its most significant step, and a note telling
    /// every step. `why` is the drain's cause and source. `None` when nothing happened.
    pub fn event(&self, why: &str) -> Option<(&'static str, String)> {
        let mut parts: Vec<String> = vec![];
        let mut reason = None;
        for e in &self.node {
            reason.get_or_insert(e.reason());
            parts.push(match e {
                NodeEvent::DrainStarted => format!("Drain started: {why}."),
                NodeEvent::NodeFenced if self.cordoned => {
                    "Cordoned and tainted; no new game servers land here.".into()
                }
                NodeEvent::NodeFenced => {
                    "Tainted (already kept from new pods); no new game servers land here.".into()
                }
                NodeEvent::DrainCancelled => {
                    "Signal cleared before the node was empty; undid lastcall's changes.".into()
                }
                NodeEvent::MachineReturned => {
                    "The machine came back (a new boot id): the last drain's hand-off belonged to a life that is over. With no signal live, lastcall lifted what it placed and the node takes game servers again; with one live, the fence stays and the drain starts again.".into()
                }
            });
        }
        if !self.released.is_empty() {
            reason.get_or_insert("GameServersReleased");
            parts.push(format!(
                "Released {} idle game server(s), deleted so their Fleets replace them elsewhere: {}.",
                self.released.len(),
                names(&self.released)
            ));
        }
        if !self.protected.is_empty() {
            reason.get_or_insert("GameServersProtected");
            let until = match &self.deadline {
                Some((deadline, cause)) => {
                    format!(" ({cause}); their matches may run until {deadline}")
                }
                None => String::new(),
            };
            parts.push(format!(
                "Protecting {} game server(s) in use{until}: {}.",
                self.protected.len(),
                names(&self.protected)
            ));
        }
        if !self.ended.is_empty() {
            reason.get_or_insert("MatchesEnded");
            parts.push(format!(
                "Started the graceful termination of {} match(es) so each gets its whole grace period before the node's deadline: {}.",
                self.ended.len(),
                names(&self.ended)
            ));
        }
        if !self.skipped.is_empty() {
            reason.get_or_insert("ReleaseSkipped");
            parts.push(format!(
                "{} changed while being released (allocation won?) and were re-checked: {}.",
                self.skipped.len(),
                names(&self.skipped)
            ));
        }
        if self.deregistered {
            reason.get_or_insert("Deregistered");
            parts.push("No game servers in use; deregistered from FleetIQ.".into());
        }
        let mut note = parts.join(" ");
        if note.len() > MAX_NOTE {
            let mut cut = MAX_NOTE - 3;
            while !note.is_char_boundary(cut) {
                cut -= 1;
            }
            note.truncate(cut);
            note.push_str("...");
        }
        reason.map(|r| (r, note))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(prefix: &str, n: usize) -> Vec<String> {
        (0..n).map(|i| format!("default/{prefix}{i}")).collect()
    }

    #[test]
    fn a_first_pass_tells_every_step_in_one_event_named_after_the_drain_start() {
        let log = PassLog {
            node: vec![NodeEvent::DrainStarted, NodeEvent::NodeFenced],
            cordoned: true,
            released: list("r", 4),
            protected: list("a", 3),
            deadline: Some(("2026-12-01T12:00:00Z".into(), "viability".into())),
            ..PassLog::default()
        };
        let (reason, note) = log.event("viability (fleetiq)").expect("an event");
        assert_eq!(reason, "DrainStarted");
        for want in [
            "Drain started: viability (fleetiq).",
            "Cordoned and tainted",
            "Released 4 idle game server(s)",
            "default/r3",
            "Protecting 3 game server(s) in use (viability); their matches may run until 2026-12-01T12:00:00Z",
            "default/a2",
        ] {
            assert!(note.contains(want), "{want:?} missing from {note:?}");
        }
    }

    #[test]
    fn merged_passes_tell_each_step_once_with_the_latest_deadline() {
        let mut first = PassLog {
            node: vec![NodeEvent::DrainStarted, NodeEvent::NodeFenced],
            cordoned: true,
            released: list("r", 2),
            protected: list("a", 1),
            deadline: Some(("2026-12-01T12:00:00Z".into(), "viability".into())),
            ..PassLog::default()
        };
        first.merge(PassLog {
            node: vec![NodeEvent::NodeFenced],
            released: list("r", 4),
            protected: list("a", 2),
            deadline: Some(("2026-12-01T11:00:00Z".into(), "preemption".into())),
            ..PassLog::default()
        });
        first.merge(PassLog::default());
        assert_eq!(
            first.node,
            vec![NodeEvent::DrainStarted, NodeEvent::NodeFenced]
        );
        assert!(first.cordoned);
        assert_eq!(first.released, list("r", 4));
        assert_eq!(first.protected, list("a", 2));
        let (reason, note) = first.event("x").expect("an event");
        assert_eq!(reason, "DrainStarted");
        assert!(note.contains("Released 4 idle"), "{note}");
        assert!(note.contains("until 2026-12-01T11:00:00Z"), "{note}");
        let mut empty = PassLog::default();
        empty.merge(PassLog {
            deregistered: true,
            ..PassLog::default()
        });
        assert_eq!(empty.event("x").map(|e| e.0), Some("Deregistered"));
    }

    #[test]
    fn later_passes_are_named_after_their_own_step() {
        let released = PassLog {
            released: list("r", 1),
            ..PassLog::default()
        };
        assert_eq!(
            released.event("x").map(|e| e.0),
            Some("GameServersReleased")
        );
        let skipped = PassLog {
            skipped: list("r", 1),
            ..PassLog::default()
        };
        assert_eq!(skipped.event("x").map(|e| e.0), Some("ReleaseSkipped"));
        let dereg = PassLog {
            deregistered: true,
            ..PassLog::default()
        };
        assert_eq!(dereg.event("x").map(|e| e.0), Some("Deregistered"));
        let tainted = PassLog {
            node: vec![NodeEvent::NodeFenced],
            ..PassLog::default()
        };
        let (r, note) = tainted.event("x").expect("event");
        assert_eq!(r, "NodeFenced");
        assert!(note.starts_with("Tainted (already kept from new pods)"));
        assert_eq!(PassLog::default().event("x"), None);
        assert!(PassLog::default().is_empty());
        for (r, _) in [released, skipped, dereg, tainted]
            .iter()
            .filter_map(|l| l.event("x"))
        {
            assert!(REASONS.contains(&r), "{r} not listed");
        }
    }

    #[test]
    fn long_lists_are_cut_to_a_valid_note() {
        let log = PassLog {
            released: (0..500)
                .map(|i| format!("a-very-long-namespace-name/gameserver-é-{i}"))
                .collect(),
            protected: list("p", 20),
            ..PassLog::default()
        };
        let (_, note) = log.event("x").expect("event");
        assert!(note.len() <= MAX_NOTE, "{}", note.len());
        assert!(note.contains("and 492 more"), "{note}");
        assert!(note.contains("and 12 more"), "{note}");
    }
}
