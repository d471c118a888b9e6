//! The game-server work on a fenced node: release what is not in use, protect what is,
//! end matches gracefully where a Terminate deadline and `eviction.safe` permit it.

use std::collections::BTreeMap;

use jiff::Timestamp;

use crate::deadline::Pressure;
use crate::eviction::{self, Subject, Verdict};
use crate::keys;
use crate::notice::Notice;
use crate::observed::{GsState, Observed};
use crate::progress::Progress;

use super::deadlines::{announced, pressure};
use super::pace::pace;
use super::taints::{taint, tolerates};
use super::{Action, GsRef, Inputs, Plan, Warning};

/// What the game-server work found.
pub(super) struct Work {
    /// Something on the node may still host or start a match.
    pub(super) busy: bool,
    /// Every in-use pod tolerates the compat draining taint.
    pub(super) all_in_use_tolerate: bool,
    /// The earliest graceful termination still to start.
    pub(super) wake_at: Option<Timestamp>,
}

/// The game-server work on a fenced node, for the notice driving it (or the recorded one),
/// folded into the plan: its actions, the at-risk gauge and warning, the wake-up.
pub(super) fn fenced_work(
    inp: &Inputs<'_>,
    progress: &Progress,
    driver: Option<&Notice>,
    unseen_servers: usize,
    out: &mut Plan,
) -> Work {
    let (deadline, reason) = announced(inp, progress, driver);
    let p = pressure(inp, progress);
    let work = game_server_work(
        inp,
        &deadline,
        &reason,
        p.as_ref(),
        unseen_servers,
        &mut out.actions,
    );
    let at_risk = eviction::matches_at_risk(
        &inp.observed.game_servers,
        &inp.observed.pods,
        p.as_ref(),
        &inp.config.eviction,
        inp.now,
    );
    note_work(&work, at_risk, &deadline, out);
    work
}

/// Folds a plan's game-server work into it: the gauge, the warning, the wake-up.
fn note_work(work: &Work, at_risk: usize, deadline: &str, out: &mut Plan) {
    out.at_risk = at_risk;
    if at_risk > 0 {
        out.warnings.push(Warning {
            reason: "MatchesAtRisk",
            note: format!(
                "{} match(es) in use may not end before the node goes at {deadline}; eviction.safe does not let lastcall end them early (see docs/eviction.md)",
                at_risk
            ),
        });
    }
    if let Some(at) = work.wake_at {
        out.wake_at = Some(out.wake_at.map_or(at, |w| w.min(at)));
    }
}

/// Releases idle and not-yet-ready servers, and labels and protects in-use ones.
/// Releases come first, in one concurrent batch, so the fence-to-released time stays at
/// about two round trips.
fn game_server_work(
    inp: &Inputs<'_>,
    deadline: &str,
    reason: &str,
    pressure: Option<&Pressure>,
    unseen_servers: usize,
    actions: &mut Vec<Action>,
) -> Work {
    let obs = inp.observed;
    // (A server not seen yet has a running pod: the pod check below counts it as busy.)
    let mut busy = false;
    let mut all_in_use_tolerate = unseen_servers == 0;
    let mut wake_at: Option<Timestamp> = None;
    let mut releases = vec![];
    let mut in_use = vec![];
    let mut endings = vec![];
    let pods: BTreeMap<(&str, &str), &crate::observed::PodView> = obs
        .pods
        .iter()
        .map(|p| ((p.namespace.as_str(), p.name.as_str()), p))
        .collect();
    let compat_draining = taint(keys::COMPAT_TAINT_DRAINING, "true", "NoExecute");
    for gs in &obs.game_servers {
        if gs.deleting
            || matches!(
                gs.state,
                GsState::Shutdown | GsState::Error | GsState::Unhealthy
            )
        {
            continue;
        }
        let r = GsRef::of(gs);
        if gs.state == GsState::Ready || gs.state.is_before_ready() {
            // Not in use, so deleting it (preconditioned on what we saw) ends no match. A
            // server that is not Ready yet cannot be allocated, and one stuck before Ready
            // would otherwise keep the node busy forever.
            busy = true;
            releases.push(Action::Release { gs: r });
        } else if gs.state.is_in_use() {
            busy = true;
            let labelled =
                gs.labels.get(keys::LABEL_NODE_DRAINING).map(String::as_str) == Some("true");
            if !labelled
                || gs
                    .annotations
                    .get(keys::ANN_GS_DEADLINE)
                    .map(String::as_str)
                    != Some(deadline)
                || gs.annotations.get(keys::ANN_GS_REASON).map(String::as_str) != Some(reason)
            {
                in_use.push(Action::Protect {
                    gs: r,
                    deadline: deadline.to_string(),
                    reason: reason.to_string(),
                });
            }
            let pod = obs.pod_of(gs);
            let v = eviction::verdict(
                &Subject::of(gs, pod),
                pressure,
                &inp.config.eviction,
                inp.now,
            );
            if let (Verdict::EndGracefully { at, .. }, Some(pod)) = (v, pod) {
                if at <= inp.now {
                    endings.push(Action::EndGracefully {
                        namespace: pod.namespace.clone(),
                        pod: pod.name.clone(),
                        uid: pod.uid.clone(),
                    });
                } else {
                    wake_at = Some(wake_at.map_or(at, |w| w.min(at)));
                }
            }
            if inp.config.compat_taints {
                match pods.get(&(gs.namespace.as_str(), gs.name.as_str())) {
                    Some(pod) if !tolerates(&pod.tolerations, &compat_draining) => {
                        all_in_use_tolerate = false;
                        in_use.push(Action::Tolerate {
                            namespace: pod.namespace.clone(),
                            pod: pod.name.clone(),
                            resource_version: pod.resource_version.clone(),
                        });
                    }
                    Some(_) => {}
                    // Pod not seen yet: do not taint until we can tolerate it.
                    None => all_in_use_tolerate = false,
                }
            }
        }
    }
    // A game-server pod that is still there, even one terminating, may be a game flushing
    // its results during its grace period: the instance must not be handed back under it.
    // A Failed or Succeeded pod runs nothing, and may never be deleted.
    if super::handoff::hosts_games(&obs.pods) {
        busy = true;
    }
    let (releases, held) = pace(inp, pressure, releases, &mut wake_at);
    actions.extend(releases);
    actions.extend(held);
    actions.extend(in_use);
    // After the protect writes, so the game has read its deadline when SIGTERM comes.
    actions.extend(endings);
    Work {
        busy,
        all_in_use_tolerate,
        wake_at,
    }
}

/// A Ready (or not yet Ready) GameServer whose pod is already terminating (SIGTERM'd while
/// starting, evicted, its node going) is deleted with its preconditions at once, in every
/// phase: Agones would still hand it to an allocator, and the match would start on a pod
/// that is dying.
pub(super) fn remove_terminating_from_allocation(inp: &Inputs<'_>, actions: &mut Vec<Action>) {
    let obs = inp.observed;
    for gs in &obs.game_servers {
        let v = eviction::verdict(
            &Subject::of(gs, obs.pod_of(gs)),
            None,
            &inp.config.eviction,
            inp.now,
        );
        let planned = actions
            .iter()
            .any(|a| matches!(a, Action::Release { gs: g } if g.uid == gs.uid));
        if v == Verdict::RemoveFromAllocation && !planned {
            actions.push(Action::Release { gs: GsRef::of(gs) });
        }
    }
}

/// An `eviction.safe` value this version does not know is treated as `Never` (the most
/// protective), and said once to the operator: never a guess that ends a match.
pub(super) fn warn_unknown_eviction_safe(obs: &Observed, warnings: &mut Vec<Warning>) {
    for gs in &obs.game_servers {
        if let eviction::EvictionSafe::Unknown(raw) = &gs.eviction_safe {
            warnings.push(Warning {
                reason: "EvictionSafeUnknown",
                note: format!(
                    "GameServer {}/{} has eviction.safe {raw:?}, which lastcall does not know; treated as Never (never ended early)",
                    gs.namespace, gs.name
                ),
            });
        }
    }
}
