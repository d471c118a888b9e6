//! Ending a drain: whether a restarted agent holds it, and undoing exactly what lastcall did.

use k8s_openapi::api::core::v1::Taint;

use crate::keys;
use crate::notice::{Cause, Source};
use crate::observed::Observed;
use crate::progress::{Progress, Recorded};

use super::{Action, GsRef, Inputs, NodeEvent, NodePatch};

/// A restarted agent holds a drain while any source that asked for it is unknown (one of
/// them may still want it). Other unknown sources do not hold it: they did not ask for it.
pub(super) fn held(progress: &Progress, unknown: &[Source]) -> bool {
    match &progress.record {
        Recorded::Valid(r) => r.entries.iter().any(|e| unknown.contains(&e.source)),
        // Written by an older agent, or unreadable: hold while any source is unknown,
        // except for a manual drain (its label is always known).
        Recorded::Absent | Recorded::Garbled => {
            progress.cause != Some(Cause::Manual) && !unknown.is_empty()
        }
    }
}

/// Undo exactly what lastcall did: our taints, our labels and annotations, and the cordon
/// only if we made it.
pub(super) fn cancel(inp: &Inputs<'_>, progress: &Progress, actions: &mut Vec<Action>) {
    unprotect_all(inp.observed, actions);
    let node = &inp.observed.node;
    let mut patch = NodePatch {
        resource_version: node.resource_version.clone(),
        ..Default::default()
    };
    let ours = |t: &Taint| {
        t.key == keys::TAINT_DRAINING
            || (t.key == keys::COMPAT_TAINT_DRAINING && progress.compat_draining_ours)
    };
    if node.taints.iter().any(ours) {
        patch.taints = Some(node.taints.iter().filter(|t| !ours(t)).cloned().collect());
    }
    if progress.cordoned_by_us && node.unschedulable {
        patch.unschedulable = Some(false);
    }
    for k in [
        keys::ANN_STARTED,
        keys::ANN_FENCE_RESTORED,
        keys::ANN_CAUSE,
        keys::ANN_CORDONED,
        keys::ANN_NOTICE,
        keys::ANN_COMPAT_DRAINING,
        keys::ANN_HANDED_BACK,
        keys::ANN_BOOT_ID,
    ] {
        if node.annotations.contains_key(k) {
            patch.remove_annotations.insert(k.to_string());
        }
    }
    // The hand-back label is ours only with our mark beside it (one write set both).
    if node.annotations.contains_key(keys::ANN_HANDED_BACK)
        && node
            .labels
            .contains_key(keys::LABEL_GKE_PERFORM_MAINTENANCE)
    {
        patch
            .remove_labels
            .insert(keys::LABEL_GKE_PERFORM_MAINTENANCE.to_string());
    }
    if patch.remove_annotations.contains(keys::ANN_STARTED) {
        patch.events.push(NodeEvent::DrainCancelled);
    }
    if !patch.is_empty() {
        actions.push(Action::PatchNode(patch));
    }
}

pub(super) fn unprotect_all(obs: &Observed, actions: &mut Vec<Action>) {
    for gs in &obs.game_servers {
        if gs.deleting {
            continue;
        }
        let marked = gs.labels.contains_key(keys::LABEL_NODE_DRAINING)
            || gs.annotations.contains_key(keys::ANN_GS_DEADLINE)
            || gs.annotations.contains_key(keys::ANN_GS_REASON);
        if marked {
            actions.push(Action::Unprotect { gs: GsRef::of(gs) });
        }
    }
}
