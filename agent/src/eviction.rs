//! What a drain may do to one game server: hard deadlines by `spec.eviction.safe` and by
//! cause (issue 9 §1), and the rare cases that count as leaving (§4).
//!
//! Pure: no I/O, no clock (`now` is an input), no tokio. The planner asks [`verdict`] once
//! per game server and turns the answer into actions; [`matches_at_risk`] feeds the gauge.
//!
//! # The rule, in order
//!
//! | game server | verdict |
//! |---|---|
//! | `Shutdown`, `Error`, `Unhealthy`, or a `deletionTimestamp` | [`Verdict::Leaving`], whatever else is true |
//! | not in use (Ready or before Ready), its pod has a `deletionTimestamp` | [`Verdict::RemoveFromAllocation`], with or without a drain |
//! | not in use, the node drains (Drain or Terminate) | [`Verdict::Release`] |
//! | in use (Allocated, Reserved, unknown state), only a Drain | [`Verdict::Protect`], not at risk |
//! | in use, a Terminate notice without a deadline | `Protect`, at risk |
//! | in use, its pod unseen, or already terminating | `Protect`; at risk unless the pod is killed before the deadline anyway |
//! | in use, a Terminate deadline, ending permitted (below) | [`Verdict::EndGracefully`] at `deadline − grace` |
//! | in use, a Terminate deadline, ending not permitted | `Protect`, at risk |
//!
//! Ending is permitted when `eviction.safe` permits it for the cause
//! ([`EvictionSafe::permits`]), or when the operator turned on
//! [`EvictionConfig::graceful_termination`].

use std::collections::BTreeMap;
use std::time::Duration;

use jiff::Timestamp;

pub use crate::deadline::Pressure;
use crate::notice::{Cause, Severity};
pub use crate::observed::EvictionSafe;
use crate::observed::{GameServerView, GsState, PodView};

impl EvictionSafe {
    /// Whether the game accepts being ended gracefully for this cause.
    ///
    /// - `Never` and unknown values: for no cause.
    /// - `OnUpgrade`: for upgrade-like causes only ([`upgrade_like`]).
    /// - `Always`: for every cause.
    pub fn permits(&self, cause: Cause) -> bool {
        match self {
            Self::Never | Self::Unknown(_) => false,
            Self::OnUpgrade => upgrade_like(cause),
            Self::Always => true,
        }
    }
}

/// The causes `eviction.safe: OnUpgrade` accepts.
///
/// Agones' `eviction.safe` design (implemented in agones#2857) draws one line: `OnUpgrade`
/// "blocks Cluster Autoscaler based evictions, but allows eviction from upgrades", and "if
/// Autoscaler is not enabled, safe: Always is the same as safe: OnUpgrade". So the line is
/// *the node will go whatever anyone decides* (upgrade-like) against *someone chose to
/// move capacity, and could choose otherwise* (autoscaler-like).
///
/// | cause | upgrade-like | why |
/// |---|---|---|
/// | `Maintenance` | yes | the host is serviced or retired; the node goes regardless |
/// | `Upgrade` | yes | drift, expiry, node upgrade: the case the setting is named after |
/// | `Manual` | yes | an operator's drain, what `kubectl drain` does (PDB-respecting evictions, which `OnUpgrade` lets through) |
/// | `Preemption` | yes | the provider takes the VM back; nothing can keep it, so SIGTERM with grace beats a hard stop |
/// | `ScaleDown` | **no** | autoscaler scale-down or consolidation: exactly what `OnUpgrade` blocks |
/// | `Rebalance` | no | a capacity-rebalancing recommendation; the instance may live on, and acting on it is the autoscaler's choice |
/// | `Viability` | no | FleetIQ's balancing decision, withdrawable (DRAINING → ACTIVE): autoscaler-like |
pub fn upgrade_like(cause: Cause) -> bool {
    match cause {
        Cause::Maintenance | Cause::Upgrade | Cause::Manual | Cause::Preemption => true,
        Cause::ScaleDown | Cause::Rebalance | Cause::Viability => false,
    }
}

/// Operator knobs for hard deadlines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EvictionConfig {
    /// Also end gracefully the in-use servers whose `eviction.safe` does not permit it for
    /// the cause (`Never`, unknown values, `OnUpgrade` under an autoscaler), at
    /// `deadline − terminationGracePeriodSeconds`. The VM kills them at the deadline anyway;
    /// this hands the game SIGTERM and its whole grace period instead. Off by default:
    /// without it lastcall never ends such a match, it only warns.
    pub graceful_termination: bool,
}

/// What the verdict reads of a game-server pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PodFacts {
    /// `spec.terminationGracePeriodSeconds`: how long the game has between SIGTERM and SIGKILL.
    pub grace: Duration,
    /// The pod's `deletionTimestamp`, when it is terminating. The API server sets it to the
    /// deletion request plus the grace period, so it is when the kubelet kills the pod.
    pub deletion: Option<Timestamp>,
}

impl PodFacts {
    pub fn of(pod: &PodView) -> Self {
        Self {
            grace: pod.termination_grace,
            // Deleting with no readable time: assume the latest kill, the at-risk side.
            deletion: pod
                .deletion_timestamp
                .or_else(|| pod.deleting.then_some(Timestamp::MAX)),
        }
    }
}

/// One game server as the verdict reads it.
#[derive(Clone, Copy, Debug)]
pub struct Subject<'a> {
    pub state: &'a GsState,
    /// The GameServer has a `deletionTimestamp` (it may still say `Ready`, agones#3159).
    pub deleting: bool,
    pub safe: &'a EvictionSafe,
    /// `None` when its pod is not observed (yet): then its grace is unknown, and lastcall
    /// never ends it.
    pub pod: Option<PodFacts>,
}

impl<'a> Subject<'a> {
    pub fn of(gs: &'a GameServerView, pod: Option<&PodView>) -> Self {
        Self {
            state: &gs.state,
            deleting: gs.deleting,
            safe: &gs.eviction_safe,
            pod: pod.map(PodFacts::of),
        }
    }
}

/// What the drain should do with one game server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing presses on it: leave it alone.
    Keep,
    /// Already leaving (Shutdown, Error, Unhealthy, or being deleted): nothing to do, and
    /// it counts as gone whatever `status.state` says.
    Leaving,
    /// Not in use and its pod is terminating (SIGTERM'd while starting, so the game never
    /// saw it): delete the GameServer now, preconditioned on uid and resourceVersion,
    /// drain or no drain. Left alone it would turn or stay Ready, allocatable, on a pod
    /// that dies within its grace. Before Ready too: deleting it then closes the race
    /// between reaching Ready and being allocated.
    RemoveFromAllocation,
    /// Not in use and the node drains: delete with preconditions; its Fleet replaces it.
    Release,
    /// In use: label and annotate it, never end it. `at_risk`: a Terminate deadline will
    /// (or may) cut its match short; warn with an Event and count it.
    Protect { at_risk: bool },
    /// In use, a Terminate deadline, and ending it is permitted: protect it until `at`
    /// (`deadline − grace`), then start its pod's graceful termination. `at <= now` means
    /// now. `at_risk`: the full grace no longer fits before the deadline.
    EndGracefully { at: Timestamp, at_risk: bool },
}

impl Verdict {
    pub fn at_risk(&self) -> bool {
        match self {
            Self::Protect { at_risk } | Self::EndGracefully { at_risk, .. } => *at_risk,
            Self::Keep | Self::Leaving | Self::RemoveFromAllocation | Self::Release => false,
        }
    }
}

/// How a state bears on the drain. An exhaustive match, so a new state must be placed.
enum Class {
    /// Ready or before Ready: nobody plays on it.
    Idle,
    /// Allocated, Reserved, or a state this version does not know (maybe in use).
    InUse,
    /// Shutdown, Error, Unhealthy.
    Terminal,
}

fn class(state: &GsState) -> Class {
    match state {
        GsState::Ready
        | GsState::Empty
        | GsState::PortAllocation
        | GsState::Creating
        | GsState::Starting
        | GsState::Scheduled
        | GsState::RequestReady => Class::Idle,
        GsState::Allocated | GsState::Reserved | GsState::Unknown(_) => Class::InUse,
        GsState::Shutdown | GsState::Error | GsState::Unhealthy => Class::Terminal,
    }
}

/// The verdict for one game server (see the module table). Total: every input has one.
pub fn verdict(
    s: &Subject<'_>,
    pressure: Option<&Pressure>,
    cfg: &EvictionConfig,
    now: Timestamp,
) -> Verdict {
    let class = class(s.state);
    if s.deleting || matches!(class, Class::Terminal) {
        return Verdict::Leaving;
    }
    // Observe-only notices press on nothing.
    let pressure = pressure.filter(|p| p.severity >= Severity::Drain);
    let pod_terminating = s.pod.and_then(|p| p.deletion);
    if matches!(class, Class::Idle) {
        return match (pod_terminating, pressure) {
            (Some(_), _) => Verdict::RemoveFromAllocation,
            (None, Some(_)) => Verdict::Release,
            (None, None) => Verdict::Keep,
        };
    }
    let Some(p) = pressure else {
        return Verdict::Keep;
    };
    let deadline = match (p.severity, p.deadline) {
        (Severity::Terminate, Some(d)) => d,
        // The node dies at an unknown moment: no time to start from, and whoever stops it
        // sends SIGTERM itself.
        (Severity::Terminate, None) => return Verdict::Protect { at_risk: true },
        // A Drain, even with a deadline, never ends a match.
        _ => return Verdict::Protect { at_risk: false },
    };
    let Some(pod) = s.pod else {
        return Verdict::Protect { at_risk: true };
    };
    if let Some(kill_at) = pod_terminating {
        // Its graceful termination is already under way (lastcall's or anyone's): nothing
        // more to start. Safe if the kubelet's kill comes no later than the VM's death.
        return Verdict::Protect {
            at_risk: kill_at > deadline,
        };
    }
    if !(s.safe.permits(p.cause) || cfg.graceful_termination) {
        return Verdict::Protect { at_risk: true };
    }
    // The deadline rule says when: `deadline − grace`.
    let at = p.ends_at(pod.grace).unwrap_or(Timestamp::MIN);
    Verdict::EndGracefully {
        at,
        at_risk: at < now,
    }
}

/// How many of `servers` have a match at risk (the "matches at risk" gauge). Pods are
/// matched to their GameServer by namespace and the `agones.dev/gameserver` label.
pub fn matches_at_risk(
    servers: &[GameServerView],
    pods: &[PodView],
    pressure: Option<&Pressure>,
    cfg: &EvictionConfig,
    now: Timestamp,
) -> usize {
    let by_gs: BTreeMap<(&str, &str), &PodView> = pods
        .iter()
        .filter_map(|p| Some(((p.namespace.as_str(), p.gameserver.as_deref()?), p)))
        .collect();
    servers
        .iter()
        .filter(|gs| {
            let pod = by_gs
                .get(&(gs.namespace.as_str(), gs.name.as_str()))
                .copied();
            verdict(&Subject::of(gs, pod), pressure, cfg, now).at_risk()
        })
        .count()
}

#[cfg(test)]
mod tests;
