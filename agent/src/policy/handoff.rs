//! The one gate every hand-off passes: FleetIQ deregistration, the hand-back to GKE, and
//! the `hand_off` a platform waits for (an Auto Scaling lifecycle CONTINUE, an Azure
//! event's approval). Handing a machine over cannot be taken back, so none of them may
//! rest on anything but the node itself: fenced, nothing on it that hosts or may start a
//! match, and the fence stood long enough that a scheduler deciding on a cache from before
//! the cordon has bound its pod already. What FleetIQ says is never part of it: a game
//! server GameLift forgot (heartbeats stopped while the agent was away, an old agent's
//! deregistration on exit) may still have players on it.
//!
//! The reconciler confirms an open gate on a fresh, consistent read of the node's pods
//! before it acts on it (the watch caches can lag behind a pod bound just before the fence).

use jiff::Timestamp;

use crate::observed::PodView;
use crate::progress::Progress;

use super::{Inputs, Warning};

/// Whether the node's pods may host a match: a game-server pod that has not finished, one
/// terminating included (the game may be flushing its results in its grace period). A
/// Failed or Succeeded pod runs nothing. Every match has a pod, so a fresh pod LIST decides
/// this alone; it is the whole gate where nothing else is read (`--deregister-on-exit`).
pub fn hosts_games(pods: &[PodView]) -> bool {
    pods.iter().any(|p| p.gameserver.is_some() && !p.finished)
}

/// The Warning Event (and `lastcall_fleetiq_deregistered_while_busy`) for a node GameLift
/// no longer lists while matches still run on it.
pub const DEREGISTERED_WHILE_BUSY: &str = "DeregisteredWhileBusy";

/// Whether the node may be handed over now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Gate {
    /// Not fenced, or something on the node may host a match: no hand-off, nothing to wait for.
    Closed,
    /// Empty and fenced, but the fence has not stood the settle yet: plan again then.
    SettlesAt(Timestamp),
    /// Empty, fenced, settled.
    Open,
}

impl Gate {
    pub(super) fn is_open(self) -> bool {
        self == Self::Open
    }
}

/// The gate for this node: `fenced` is lastcall's taint on the node, `busy` whether the
/// fenced work found anything that hosts or may start a match (a terminating game pod
/// included: the game may be flushing its results).
pub(super) fn gate(inp: &Inputs<'_>, progress: &Progress, fenced: bool, busy: bool) -> Gate {
    if !fenced || busy {
        return Gate::Closed;
    }
    // Counted from the latest moment the fence can have been made; an unreadable start is
    // written anew by the fence, so it counts from then.
    let settle = jiff::SignedDuration::try_from(inp.config.deregister_settle).unwrap_or_default();
    let Some(fenced_at) = progress.fenced_by else {
        return Gate::SettlesAt(inp.now.checked_add(settle).unwrap_or(Timestamp::MAX));
    };
    let settled_at = fenced_at.checked_add(settle).unwrap_or(Timestamp::MAX);
    if inp.now >= settled_at {
        Gate::Open
    } else {
        Gate::SettlesAt(settled_at)
    }
}

/// Folds a gate that is waiting for its settle into the plan's wake-up.
pub(super) fn wake(gate: Gate, wake_at: &mut Option<Timestamp>) {
    if let Gate::SettlesAt(at) = gate {
        *wake_at = Some(wake_at.map_or(at, |w| w.min(at)));
    }
}

/// The warning for a node whose game server GameLift no longer lists while it is busy.
pub(super) fn deregistered_while_busy() -> Warning {
    Warning {
        reason: DEREGISTERED_WHILE_BUSY,
        note: "GameLift no longer lists this node's game server, but matches still run here: \
               the node stays fenced and its matches protected, and it is handed over only once \
               it is empty"
            .to_string(),
    }
}
