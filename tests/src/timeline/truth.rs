//! What the script says is true at each moment: which signals are live and their hard
//! deadlines, rebuilt from the steps as they were really applied (their wall-clock times).
//! Every deadline and every game's consent is the providers' ([`super::providers`]), never
//! lastcall's rule.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use super::providers::{self, Consent, Decided};
use super::script::{Action, AzureKind, Safe, Timeline, Upcoming};

/// One signal of one source; a source holds at most one at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SignalId {
    ImdsScheduled,
    ImdsSpot,
    GceMaintenance,
    GcePreempted,
    FleetIq,
    /// FleetIQ `SPOT_TERMINATING`: never withdrawn.
    FleetIqSpot,
    Manual,
    Karpenter,
    /// The cluster autoscaler's taint.
    Autoscaler,
    /// GKE's impending-termination taint.
    GkeTaint,
    /// GKE's `active-node-maintenance=ONGOING` label.
    GkeOngoing,
    /// GKE's `scheduled-maintenance-time` label.
    GkeMaintenance,
    /// IMDS' rebalance recommendation, until `--rebalance-ttl` after its `noticeTime`.
    ImdsRebalance,
    /// GCE's `upcoming-maintenance`.
    GceUpcoming,
    /// The operator's cordon, with `--drain-on-foreign-cordon`.
    ForeignCordon,
    /// The Auto Scaling termination hook's wait.
    AsgLifecycle,
    /// One Azure scheduled event, by episode.
    Azure(u8),
    /// The Karpenter NodeClaim's expiry, from `--maintenance-lead` before it.
    NodeClaimExpiry,
}

impl SignalId {
    /// Written on the Node object, not by the machine: it outlives a reboot.
    pub fn on_the_node(self) -> bool {
        matches!(
            self,
            SignalId::Manual
                | SignalId::Karpenter
                | SignalId::Autoscaler
                | SignalId::GkeTaint
                | SignalId::GkeOngoing
                | SignalId::GkeMaintenance
                | SignalId::ForeignCordon
                | SignalId::NodeClaimExpiry
        )
    }
}

/// A live signal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Signal {
    /// When the machine goes whatever anyone does (stop, reboot, preemption).
    pub hard: Option<SystemTime>,
    /// Who decided the machine goes, which a game's `eviction.safe` consents to or not
    /// ([`providers::consent`]).
    pub decided: Decided,
    /// Whether lastcall fences the node for it (not for an autoscaler's own taint).
    pub fences: bool,
    /// The provider counts the deadline from a notice the agent only hears later (GCE's, a
    /// Spot notice through FleetIQ), so the agent's value may be later than the truth's by
    /// its reaction time.
    pub relative: bool,
    /// The provider leaves the drain to the agent: nothing ends (an Azure freeze, which every
    /// process survives), so keeping new matches off is a policy of the agent's. It asks for
    /// no drain and forbids none; only outcomes are judged (no match ended, no busy machine
    /// handed over).
    pub optional: bool,
}

impl Signal {
    /// Whether it asks for a drain (a signal the agent may take or leave does not).
    pub fn asks(&self) -> bool {
        !self.optional
    }
}

/// Whether some signal of `live` asks for a drain.
pub fn asks_drain(live: &Live) -> bool {
    live.values().any(Signal::asks)
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

/// Whole seconds at or before `t` (an agent may keep deadlines to the second).
pub fn floor_secs(t: SystemTime) -> SystemTime {
    let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    SystemTime::UNIX_EPOCH + Duration::from_secs(d.as_secs())
}

/// What a step does to the truth, given when it was applied. A deadline counted from the
/// agent's first sight of a signal is taken from the moment the step was applied, to the
/// second below: the agent cannot have seen it earlier.
pub fn effect_of(
    tl: &Timeline,
    t0: SystemTime,
    at: SystemTime,
    a: &Action,
) -> Option<(SignalId, Option<Signal>)> {
    let ms = |m: u64| ceil_secs(t0 + Duration::from_millis(m));
    let hard = |t| Signal {
        hard: Some(t),
        decided: Decided::Platform,
        fences: true,
        relative: false,
        optional: false,
    };
    let drain = Signal {
        hard: None,
        decided: Decided::Platform,
        fences: true,
        relative: false,
        optional: false,
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
        // GCE's notice for the VM's class, from the change of `maintenance-event`.
        Action::GceTerminate => (
            SignalId::GceMaintenance,
            Some(Signal {
                relative: true,
                ..hard(floor_secs(at + tl.gce_terminate_notice()))
            }),
        ),
        Action::GceNone => (SignalId::GceMaintenance, None),
        // A live migration: the VM survives, nothing ends; keeping matches off meanwhile is
        // the agent's choice.
        Action::GceMigrating => (
            SignalId::GceMaintenance,
            Some(Signal {
                fences: false,
                optional: true,
                ..drain
            }),
        ),
        // ACPI G2 with `preempted`, G3 the notice later.
        Action::GcePreempted => (
            SignalId::GcePreempted,
            Some(Signal {
                relative: true,
                ..hard(floor_secs(at + tl.gce_preemption_notice()))
            }),
        ),
        // The hook's global timeout from the wait's start, far beyond the run; a scale-in or
        // a replacement alike.
        Action::AsgTerminate => (
            SignalId::AsgLifecycle,
            Some(Signal {
                hard: Some(floor_secs(
                    at + providers::asg_global_timeout(Duration::from_secs(tl.asg_heartbeat_s)),
                )),
                decided: Decided::Either,
                relative: true,
                ..drain
            }),
        ),
        Action::AzureEvent {
            episode,
            kind,
            not_before_ms,
        } => (
            SignalId::Azure(*episode),
            match kind {
                // Every process survives a freeze, short or long: nothing to end, and
                // keeping new matches off for it is the agent's choice.
                AzureKind::FreezeShort | AzureKind::FreezeLong => Some(Signal {
                    fences: false,
                    optional: true,
                    ..drain
                }),
                // A scale set's scale-in or a user deleting the VM.
                AzureKind::Terminate => Some(Signal {
                    decided: Decided::Either,
                    ..hard(ms(*not_before_ms))
                }),
                _ => Some(hard(ms(*not_before_ms))),
            },
        ),
        Action::AzureGone { episode } => (SignalId::Azure(*episode), None),
        // Started by the platform once approved: the VM may go now (the agent counts it
        // from its next read).
        Action::AzureApproved { episode } => (
            SignalId::Azure(*episode),
            Some(Signal {
                relative: true,
                ..hard(at)
            }),
        ),
        Action::FleetIq { draining } => (SignalId::FleetIq, draining.then_some(drain)),
        // EC2's two minutes from its Spot notice, which FleetIQ's status reports (not
        // compressed: the agent takes no setting for it), far beyond the run.
        Action::FleetIqSpot => (
            SignalId::FleetIqSpot,
            Some(Signal {
                relative: true,
                ..hard(floor_secs(at + providers::EC2_SPOT_NOTICE))
            }),
        ),
        Action::Manual(on) => (SignalId::Manual, on.then_some(drain)),
        Action::Karpenter(on) => (
            SignalId::Karpenter,
            on.then_some(Signal {
                fences: false,
                ..drain
            }),
        ),
        // Karpenter deletes every pod left at its termination time (for a consolidation, a
        // drift or an expiry alike), and keeps new pods off itself.
        Action::KarpenterAt { at_ms } => (
            SignalId::Karpenter,
            Some(Signal {
                decided: Decided::Either,
                fences: false,
                ..hard(ms(*at_ms))
            }),
        ),
        Action::Autoscaler(on) => (
            SignalId::Autoscaler,
            on.then_some(Signal {
                fences: false,
                ..drain
            }),
        ),
        // GKE terminating the node says no time: the node goes, but nothing tells when.
        Action::GkeTaint(on) => (SignalId::GkeTaint, on.then_some(drain)),
        Action::GkeOngoing(on) => (SignalId::GkeOngoing, on.then_some(drain)),
        // When host maintenance starts, well within the lead time: a drain. Nothing says
        // the VM goes then (it may migrate live); if it does, GCE's metadata says so first.
        Action::GkeMaintenance { epoch_ms } => (SignalId::GkeMaintenance, epoch_ms.map(|_| drain)),
        Action::ImdsRebalance => (SignalId::ImdsRebalance, Some(drain)),
        // Karpenter's expiry replaces the node whatever the demand (a forceful disruption);
        // with a grace period every pod left is deleted at its end, without one nothing is
        // killed. The drain before it is the operator's `--maintenance-lead`.
        Action::NodeClaimFence { end_ms } => (
            SignalId::NodeClaimExpiry,
            Some(Signal {
                // Counted from the NodeClaim's creation, which may precede `t0`.
                hard: end_ms.map(|m| {
                    let d = Duration::from_millis(m.unsigned_abs());
                    ceil_secs(if m < 0 { t0 - d } else { t0 + d })
                }),
                ..drain
            }),
        ),
        Action::RebalanceExpires => (SignalId::ImdsRebalance, None),
        // Pending: a drain (the window is when maintenance starts, well within the lead).
        // Ongoing: on a VM that host maintenance stops (`TERMINATE`) the VM goes from the
        // window's start; one that migrates live keeps running.
        Action::GceUpcoming { status, window_ms } => (
            SignalId::GceUpcoming,
            match status {
                Upcoming::Pending => Some(drain),
                Upcoming::Ongoing if tl.host_maintenance.stops_the_vm() => {
                    Some(hard(ms(*window_ms)))
                }
                Upcoming::Ongoing => Some(drain),
                Upcoming::Complete => None,
            },
        ),
        // A cordon someone else made, when the agent is asked to take it as a drain (it
        // never cordons or fences for it: the node is cordoned already).
        Action::OperatorCordon(on) if tl.drain_on_foreign_cordon => (
            SignalId::ForeignCordon,
            on.then_some(Signal {
                fences: false,
                ..drain
            }),
        ),
        _ => return None,
    })
}

pub type Live = BTreeMap<SignalId, Signal>;

/// A change of the truth: when, and which signal changed (`None`: a machine's return).
pub type Change = (SystemTime, Option<SignalId>);

/// The note of an `AzureGone` step whose event no agent read while it was listed (no
/// successful read of the document between its listing and its removal).
pub const UNREAD: &str = "unread";

/// Whether the Azure event `id` was drawn as a Spot eviction (before `upto`, its vanishing)
/// and read while listed: a Spot eviction stays, but one gone before any agent read the
/// document was never seen, and the platform evicting at once is all that can be said of it.
fn preempt_seen(
    applied: &[Applied],
    upto: &Applied,
    id: SignalId,
    preempt: &dyn Fn(&Action) -> bool,
) -> bool {
    upto.note != UNREAD
        && applied
            .iter()
            .take_while(|a| !std::ptr::eq(*a, upto))
            .any(|a| a.effect.map(|(i, _)| i) == Some(id) && preempt(&a.action))
}

/// The live signals over time: piecewise constant, changing at applied steps.
pub struct Truth {
    /// `(from, live)`, in time order; before the first entry nothing is live.
    segments: Vec<(SystemTime, Live)>,
    /// The signal whose change began each segment (`None`: the start, a machine's return).
    causes: Vec<Option<SignalId>>,
}

impl Truth {
    pub fn build(applied: &[Applied]) -> Truth {
        let mut live = Live::new();
        let mut segments = vec![(SystemTime::UNIX_EPOCH, live.clone())];
        let mut causes = vec![None];
        for a in applied {
            // A machine that came back: the old boot's notices went with it (the operator's
            // label and Karpenter's taint are on the Node).
            if matches!(a.action, Action::MachineReturns) {
                live.retain(|id, _| id.on_the_node());
                segments.push((a.at, live.clone()));
                causes.push(None);
                continue;
            }
            // ACTIVE replacing a Spot notice no agent recorded: no one can know of it.
            if matches!(a.action, Action::FleetIq { draining: false }) && a.note == UNREAD {
                live.remove(&SignalId::FleetIqSpot);
            }
            let Some((id, s)) = a.effect else { continue };
            // Spot and preemption are never withdrawn, nor moved later: a repeat keeps the
            // first deadline unless it states an earlier one (the instance goes then).
            if matches!(
                id,
                SignalId::ImdsSpot | SignalId::GcePreempted | SignalId::FleetIqSpot
            ) && let Some(old) = live.get(&id)
            {
                let earlier = match (old.hard, s.and_then(|n| n.hard)) {
                    (Some(o), Some(n)) => n < o,
                    _ => false,
                };
                if !earlier {
                    continue;
                }
            }
            // A repeated GCE TERMINATE is the same event: its deadline stays anchored.
            if id == SignalId::GceMaintenance
                && s.is_some_and(|s| s.hard.is_some())
                && live.get(&id).is_some_and(|old| old.hard.is_some())
            {
                continue;
            }
            // The Auto Scaling wait ends only with the instance.
            if id == SignalId::AsgLifecycle && live.contains_key(&id) {
                continue;
            }
            let mut s = s;
            if let SignalId::Azure(_) = id {
                let azure = live.get(&id).copied();
                let preempt = |a: &Action| {
                    matches!(
                        a,
                        Action::AzureEvent {
                            kind: AzureKind::Preempt,
                            ..
                        }
                    )
                };
                match (azure, s) {
                    // Approved after the event went: nothing to start.
                    (None, _) if matches!(a.action, Action::AzureApproved { .. }) => continue,
                    // A freeze started early is still only a freeze.
                    (Some(old), _)
                        if old.hard.is_none()
                            && matches!(a.action, Action::AzureApproved { .. }) =>
                    {
                        continue;
                    }
                    // A Spot eviction is never withdrawn.
                    (Some(_), None) if preempt_seen(applied, a, id, &preempt) => continue,
                    // Started once approved: the VM may go from then on.
                    (Some(old), Some(new)) if matches!(a.action, Action::AzureApproved { .. }) => {
                        s = Some(Signal {
                            hard: old.hard.min(new.hard).or(new.hard),
                            relative: true,
                            ..old
                        });
                    }
                    // Moved: the platform's deadline is the new one, later or earlier; what
                    // any agent saw before does not keep the old one alive.
                    (Some(old), Some(new)) => {
                        s = Some(Signal {
                            relative: old.relative || new.relative,
                            ..new
                        });
                    }
                    _ => {}
                }
            }
            match s {
                Some(s) => live.insert(id, s),
                None => live.remove(&id),
            };
            segments.push((a.at, live.clone()));
            causes.push(Some(id));
        }
        Truth { segments, causes }
    }

    /// Every state holding at some moment of `[from, to]`, each with the change that ended
    /// it by `to` (when, and which signal changed), or `None` if it still held then.
    pub fn during_with_ends(
        &self,
        from: SystemTime,
        to: SystemTime,
    ) -> Vec<(&Live, Option<Change>)> {
        let first = self
            .segments
            .partition_point(|(t, _)| *t <= from)
            .saturating_sub(1);
        let mut out = vec![];
        for i in first..self.segments.len() {
            if i > first && self.segments[i].0 > to {
                break;
            }
            let end = self
                .segments
                .get(i + 1)
                .filter(|(t, _)| *t <= to)
                .map(|(t, _)| (*t, self.causes[i + 1]));
            out.push((&self.segments[i].1, end));
        }
        out
    }

    /// The live signals at `t`.
    pub fn at(&self, t: SystemTime) -> &Live {
        let i = self.segments.partition_point(|(from, _)| *from <= t);
        &self.segments[i.saturating_sub(1)].1
    }

    /// Every state holding at some moment of `[from, to]`.
    pub fn during(&self, from: SystemTime, to: SystemTime) -> Vec<&Live> {
        self.during_with_ends(from, to)
            .into_iter()
            .map(|(live, _)| live)
            .collect()
    }

    /// Times at which the truth changed.
    pub fn changes(&self) -> impl Iterator<Item = SystemTime> + '_ {
        self.segments.iter().skip(1).map(|(t, _)| *t)
    }

    pub fn last(&self) -> &Live {
        &self.segments[self.segments.len() - 1].1
    }
}

/// The earliest hard deadline among `live` still ahead of `now`, with `slack` added to
/// relative ones. A deadline already passed is left out: the machine would be gone, and
/// the test world running on past it says nothing about what to announce.
pub fn earliest(live: &Live, now: SystemTime, slack: Duration) -> Option<SystemTime> {
    live.iter()
        .filter_map(|(id, s)| {
            s.hard.map(|h| {
                if s.relative {
                    h + slack + extra_slack(*id)
                } else {
                    h
                }
            })
        })
        .filter(|h| *h > now)
        .min()
}

/// What a relative deadline may be later by beyond the reaction time, for the signals the
/// agent can only see late. The Auto Scaling wait is seen after IMDS' poll, up to three
/// `DescribeAutoScalingInstances` reads that still answer the old state, and an agent
/// start; its cap (from the agent's first sight) is counted to the second. The wait's real
/// start is not in any answer the agent gets, so its announcement is that much late: in
/// production against a cap of hours.
pub fn extra_slack(id: SignalId) -> Duration {
    match id {
        SignalId::AsgLifecycle => Duration::from_secs(4),
        _ => Duration::ZERO,
    }
}

/// Whether Azure event `episode` is listed in the document at `t` (listed, or listed again,
/// and not gone since): only a listed event can be approved.
pub fn azure_listed(applied: &[Applied], episode: u8, t: SystemTime) -> bool {
    applied
        .iter()
        .filter(|a| a.at <= t)
        .rev()
        .find_map(|a| match a.action {
            Action::AzureEvent { episode: e, .. } if e == episode => Some(true),
            Action::AzureGone { episode: e } if e == episode => Some(false),
            _ => None,
        })
        .unwrap_or(false)
}

/// Whether the game of a server with `safe` (and the operator's `--graceful-termination`)
/// lets its match end early for `s` ([`providers::consent`]).
pub fn consent(safe: Safe, s: &Signal, graceful: bool) -> Consent {
    providers::consent(safe, s.decided, graceful)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000) + Duration::from_millis(ms)
    }

    fn applied(ms: u64, id: SignalId, s: Option<Signal>) -> Applied {
        Applied {
            at: at(ms),
            action: Action::EndMatch,
            effect: Some((id, s)),
            note: String::new(),
        }
    }

    fn hard(ms: u64) -> Signal {
        Signal {
            hard: Some(at(ms)),
            decided: Decided::Platform,
            fences: true,
            relative: false,
            optional: false,
        }
    }

    #[test]
    fn the_truth_follows_moves_cancels_and_never_withdraws_spot() {
        let t = Truth::build(&[
            applied(100, SignalId::ImdsScheduled, Some(hard(3000))),
            applied(200, SignalId::ImdsSpot, Some(hard(5000))),
            applied(300, SignalId::ImdsScheduled, Some(hard(4000))),
            applied(400, SignalId::ImdsSpot, Some(hard(9000))),
            applied(500, SignalId::ImdsScheduled, None),
        ]);
        let e = |ms| earliest(t.at(at(ms)), at(ms), Duration::ZERO);
        assert_eq!(e(50), None);
        assert_eq!(e(150), Some(at(3000)));
        // Rescheduled later: the current deadline is the new one, not the minimum.
        assert_eq!(e(350), Some(at(4000)));
        // A second Spot notice does not move the first later.
        assert_eq!(e(450), Some(at(4000)));
        assert_eq!(e(600), Some(at(5000)));
        // One that states an earlier time does: the instance goes then.
        let spot = Truth::build(&[
            applied(200, SignalId::ImdsSpot, Some(hard(5000))),
            applied(400, SignalId::ImdsSpot, Some(hard(3000))),
        ]);
        let e2 = |ms| earliest(spot.at(at(ms)), at(ms), Duration::ZERO);
        assert_eq!(e2(300), Some(at(5000)));
        assert_eq!(e2(450), Some(at(3000)));
        // A deadline already passed no longer bounds what is announced.
        assert_eq!(e(5001), None);
        assert_eq!(t.during(at(250), at(450)).len(), 2);
        assert_eq!(t.changes().count(), 4);
    }

    fn azure(ms: u64, episode: u8, kind: AzureKind, nb: u64) -> Applied {
        Applied {
            action: Action::AzureEvent {
                episode,
                kind,
                not_before_ms: nb,
            },
            ..applied(ms, SignalId::Azure(episode), Some(hard(nb)))
        }
    }

    #[test]
    fn azure_deadlines_are_the_platforms_and_a_spot_eviction_stays() {
        let gone = |ms, episode| Applied {
            action: Action::AzureGone { episode },
            ..applied(ms, SignalId::Azure(episode), None)
        };
        let t = Truth::build(&[
            azure(100, 1, AzureKind::Reboot, 3000),
            azure(200, 1, AzureKind::Reboot, 5000),
            azure(300, 2, AzureKind::Preempt, 4000),
            gone(400, 1),
            gone(500, 2),
        ]);
        let e = |ms| earliest(t.at(at(ms)), at(ms), Duration::ZERO);
        // Moved later: the deadline is the new one, and only the new one.
        assert_eq!(e(250), Some(at(5000)));
        // The reboot vanished; the Spot eviction cannot be withdrawn.
        assert_eq!(e(450), Some(at(4000)));
        assert_eq!(e(600), Some(at(4000)));
        assert!(t.last().contains_key(&SignalId::Azure(2)));
        assert!(!t.last().contains_key(&SignalId::Azure(1)));
    }

    #[test]
    fn a_nodeclaim_s_end_counts_from_t0_either_side_and_is_the_platform_s() {
        let tl = Timeline::draw(1, super::super::script::Dimensions::ALL);
        let t0 = at(5000);
        let effect = |end_ms| {
            effect_of(&tl, t0, t0, &Action::NodeClaimFence { end_ms })
                .and_then(|(id, s)| (id == SignalId::NodeClaimExpiry).then_some(s?))
                .expect("a NodeClaim signal")
        };
        // Created before `t0`: its end may lie before it too (to the second above).
        assert_eq!(effect(Some(-1500)).hard, Some(at(4000)));
        assert_eq!(effect(Some(2000)).hard, Some(at(7000)));
        let no_grace = effect(None);
        assert_eq!(
            no_grace.hard, None,
            "without a grace period nothing is killed"
        );
        assert!(no_grace.fences && no_grace.decided == Decided::Platform && !no_grace.relative);
        assert!(SignalId::NodeClaimExpiry.on_the_node());
    }

    #[test]
    fn a_freeze_asks_nothing_and_a_scale_in_is_either() {
        let tl = Timeline::draw(1, super::super::script::Dimensions::ALL);
        let t0 = at(0);
        let azure = |kind| {
            let a = Action::AzureEvent {
                episode: 1,
                kind,
                not_before_ms: 4000,
            };
            effect_of(&tl, t0, t0, &a)
                .and_then(|(_, s)| s)
                .expect("a signal")
        };
        for freeze in [AzureKind::FreezeShort, AzureKind::FreezeLong] {
            let s = azure(freeze);
            assert!(!s.asks() && s.hard.is_none() && !s.fences, "{freeze:?}");
        }
        let scale_in = azure(AzureKind::Terminate);
        assert_eq!(scale_in.decided, Decided::Either);
        assert_eq!(consent(Safe::OnUpgrade, &scale_in, false), Consent::Either);
        assert_eq!(
            consent(Safe::OnUpgrade, &azure(AzureKind::Reboot), false),
            Consent::Yes
        );
        assert_eq!(consent(Safe::Never, &scale_in, true), Consent::Yes);
        assert!(asks_drain(&Live::from([(
            SignalId::Azure(1),
            azure(AzureKind::Reboot)
        )])));
        assert!(!asks_drain(&Live::from([(
            SignalId::Azure(1),
            azure(AzureKind::FreezeLong)
        )])));
        assert_eq!(ceil_secs(at(1)), floor_secs(at(1)) + Duration::from_secs(1));
        assert_eq!(ceil_secs(at(0)), at(0));
    }
}
