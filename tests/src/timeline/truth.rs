//! What the script says is true at each moment: which signals are live and their hard
//! deadlines, rebuilt from the steps as they were really applied (their wall-clock times).

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use super::script::{Action, Safe, Timeline};

/// One signal of one source; a source holds at most one at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SignalId {
    ImdsScheduled,
    ImdsSpot,
    GceMaintenance,
    GcePreempted,
    FleetIq,
    Manual,
    Karpenter,
}

/// A live signal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Signal {
    /// When the machine goes whatever anyone does (stop, reboot, preemption).
    pub hard: Option<SystemTime>,
    /// Whether the hard deadline's cause is upgrade-like (maintenance, preemption), which
    /// `OnUpgrade` lets lastcall end matches for.
    pub upgrade_like: bool,
    /// Whether lastcall fences the node for it (not for an autoscaler's own taint).
    pub fences: bool,
    /// The deadline is counted from when the agent first sees the signal (GCE), so the
    /// agent's value may be later than the script's by its reaction time.
    pub relative: bool,
}

/// A step as it was applied.
#[derive(Clone, Debug)]
pub struct Applied {
    pub at: SystemTime,
    pub action: Action,
    /// What it changed in the script's truth (`None`: the signal is gone).
    pub effect: Option<(SignalId, Option<Signal>)>,
    /// Free text: the server a match ended on, an agent's fate.
    pub note: String,
}

/// Whole seconds at or after `t` (IMDS times have second precision).
pub fn ceil_secs(t: SystemTime) -> SystemTime {
    let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let s = if d.subsec_nanos() == 0 {
        d.as_secs()
    } else {
        d.as_secs() + 1
    };
    SystemTime::UNIX_EPOCH + Duration::from_secs(s)
}

/// What a step does to the truth, given when it was applied.
pub fn effect_of(
    tl: &Timeline,
    t0: SystemTime,
    at: SystemTime,
    a: &Action,
) -> Option<(SignalId, Option<Signal>)> {
    let ms = |m: u64| ceil_secs(t0 + Duration::from_millis(m));
    let hard = |t| Signal {
        hard: Some(t),
        upgrade_like: true,
        fences: true,
        relative: false,
    };
    let drain = Signal {
        hard: None,
        upgrade_like: false,
        fences: true,
        relative: false,
    };
    Some(match a {
        Action::ImdsScheduled {
            code,
            not_before_ms,
        } => (
            SignalId::ImdsScheduled,
            Some(if code.ends_the_vm() {
                hard(ms(*not_before_ms))
            } else {
                drain
            }),
        ),
        Action::ImdsScheduledCancel => (SignalId::ImdsScheduled, None),
        Action::ImdsSpot { at_ms } => (SignalId::ImdsSpot, Some(hard(ms(*at_ms)))),
        Action::GceTerminate => (
            SignalId::GceMaintenance,
            Some(Signal {
                relative: true,
                ..hard(at + Duration::from_secs(tl.gce_terminate_notice_s))
            }),
        ),
        Action::GceNone => (SignalId::GceMaintenance, None),
        Action::GcePreempted => (
            SignalId::GcePreempted,
            Some(Signal {
                relative: true,
                ..hard(at + Duration::from_secs(tl.gce_preemption_notice_s))
            }),
        ),
        Action::FleetIq { draining } => (SignalId::FleetIq, draining.then_some(drain)),
        Action::Manual(on) => (SignalId::Manual, on.then_some(drain)),
        Action::Karpenter(on) => (
            SignalId::Karpenter,
            on.then_some(Signal {
                fences: false,
                ..drain
            }),
        ),
        _ => return None,
    })
}

pub type Live = BTreeMap<SignalId, Signal>;

/// The live signals over time: piecewise constant, changing at applied steps.
pub struct Truth {
    /// `(from, live)`, in time order; before the first entry nothing is live.
    segments: Vec<(SystemTime, Live)>,
}

impl Truth {
    pub fn build(applied: &[Applied]) -> Truth {
        let mut live = Live::new();
        let mut segments = vec![(SystemTime::UNIX_EPOCH, live.clone())];
        for a in applied {
            let Some((id, s)) = a.effect else { continue };
            // Spot and preemption are never withdrawn; a repeat keeps the first deadline.
            if matches!(id, SignalId::ImdsSpot | SignalId::GcePreempted) && live.contains_key(&id) {
                continue;
            }
            // A repeated GCE TERMINATE is the same event: its deadline stays anchored.
            if id == SignalId::GceMaintenance && s.is_some() && live.contains_key(&id) {
                continue;
            }
            match s {
                Some(s) => live.insert(id, s),
                None => live.remove(&id),
            };
            segments.push((a.at, live.clone()));
        }
        Truth { segments }
    }

    /// The live signals at `t`.
    pub fn at(&self, t: SystemTime) -> &Live {
        let i = self.segments.partition_point(|(from, _)| *from <= t);
        &self.segments[i.saturating_sub(1)].1
    }

    /// Every state holding at some moment of `[from, to]`.
    pub fn during(&self, from: SystemTime, to: SystemTime) -> Vec<&Live> {
        let mut out = vec![self.at(from)];
        out.extend(
            self.segments
                .iter()
                .filter(|(t, _)| *t > from && *t <= to)
                .map(|(_, l)| l),
        );
        out
    }

    /// Times at which the truth changed.
    pub fn changes(&self) -> impl Iterator<Item = SystemTime> + '_ {
        self.segments.iter().skip(1).map(|(t, _)| *t)
    }

    pub fn last(&self) -> &Live {
        &self.segments[self.segments.len() - 1].1
    }
}

/// The earliest hard deadline among `live`, with `slack` added to relative ones.
pub fn earliest(live: &Live, slack: Duration) -> Option<SystemTime> {
    live.values()
        .filter_map(|s| s.hard.map(|h| if s.relative { h + slack } else { h }))
        .min()
}

/// Whether `eviction.safe` (and `--graceful-termination`) let lastcall end a match for `s`.
pub fn permits(safe: Safe, s: &Signal, graceful: bool) -> bool {
    graceful
        || match safe {
            Safe::Always => true,
            Safe::OnUpgrade => s.upgrade_like,
            Safe::Never => false,
        }
}
