//! A node with a notice: fence it, do the game-server work, then the last steps once it is
//! empty (the compat taint, the hand-back to GKE, FleetIQ deregistration).

use std::collections::BTreeMap;

use crate::keys;
use crate::notice::Notice;
use crate::observed::GsState;
use crate::progress::{Progress, format_precise};

use super::fence::fence_patch;
use super::game_servers::fenced_work;
use super::handoff;
use super::taints::taint;
use super::{Action, Inputs, NodePatch, Phase, Plan};

pub(super) fn drain(
    inp: &Inputs<'_>,
    progress: &Progress,
    driver: &Notice,
    unseen_servers: usize,
    out: &mut Plan,
) -> Phase {
    let obs = inp.observed;
    let fence = fence_patch(inp, progress, Some(driver));
    let fencing = fence.is_some();
    if let Some(p) = fence {
        out.actions.push(Action::PatchNode(p));
    }
    let work = fenced_work(inp, progress, Some(driver), unseen_servers, out);

    if inp.config.compat_taints
        && !fencing
        && work.all_in_use_tolerate
        && !obs
            .game_servers
            .iter()
            .any(|g| !g.deleting && (g.state == GsState::Ready || g.state.is_before_ready()))
        && !obs.node.has_taint(keys::COMPAT_TAINT_DRAINING)
    {
        // Last, as the original did: every in-use pod tolerates it and no Ready server is
        // left for the taint manager to kill outside the race-safe delete. Recorded, so a
        // cancel removes only a taint lastcall added.
        let mut taints = obs.node.taints.clone();
        taints.push(taint(keys::COMPAT_TAINT_DRAINING, "true", "NoExecute"));
        let mut set_annotations = BTreeMap::new();
        set_annotations.insert(keys::ANN_COMPAT_DRAINING.to_string(), "true".to_string());
        out.actions.push(Action::PatchNode(NodePatch {
            resource_version: obs.node.resource_version.clone(),
            taints: Some(taints),
            set_annotations,
            ..Default::default()
        }));
    }

    // Every hand-off below waits for the same gate: fenced, empty, settled.
    let gate = handoff::gate(inp, progress, !fencing, work.busy);
    if gate.is_open()
        && inp.config.hand_back
        && inp.notices.iter().any(|n| n.can_start_early)
        && !progress.handed_back_final()
    {
        // Empty, and the maintenance may start now: hand the node back early, once. The
        // annotation makes it once across restarts; the label is GKE's.
        let mut patch = NodePatch {
            resource_version: obs.node.resource_version.clone(),
            ..Default::default()
        };
        patch
            .set_labels
            .insert(keys::LABEL_GKE_PERFORM_MAINTENANCE.into(), "true".into());
        patch
            .set_annotations
            .insert(keys::ANN_HANDED_BACK.into(), format_precise(inp.now));
        out.actions.push(Action::PatchNode(patch));
    }

    if fencing {
        Phase::Fencing
    } else if work.busy {
        Phase::Draining
    } else {
        // The fence must have stood for a while: a scheduler deciding on a cache from before
        // the cordon may still be binding a pod here.
        handoff::wake(gate, &mut out.wake_at);
        if gate.is_open() {
            if inp.config.deregister {
                out.actions.push(Action::Deregister);
            } else {
                out.hand_off = true;
            }
        }
        Phase::Empty
    }
}
