//! A node with no drain: leftovers of an interrupted cancel, and compat mode's `active` taint.

use crate::keys;
use crate::progress::Progress;

use super::cancel::{cancel, unprotect_all};
use super::taints::{taint, tolerates};
use super::{Action, Inputs, NodePatch, Plan, Warning};

/// Not draining: clear leftovers of an interrupted cancel; in compat mode keep the original's
/// `active` taint on a registered node, but only where no running game would be evicted.
pub(super) fn idle(inp: &Inputs<'_>, progress: &Progress, out: &mut Plan) {
    unprotect_all(inp.observed, &mut out.actions);
    let node = &inp.observed.node;
    if node.has_taint(keys::TAINT_DRAINING) || progress.handed_back.is_some() {
        cancel(inp, progress, &mut out.actions);
        return;
    }
    if inp.config.compat_taints
        && progress.registered.is_some()
        && !node.has_taint(keys::COMPAT_TAINT_ACTIVE)
    {
        let active = taint(keys::COMPAT_TAINT_ACTIVE, "true", "NoExecute");
        let intolerant: Vec<String> = inp
            .observed
            .pods
            .iter()
            .filter(|p| {
                p.gameserver.is_some() && !p.deleting && !tolerates(&p.tolerations, &active)
            })
            .map(|p| format!("{}/{}", p.namespace, p.name))
            .collect();
        if let Some(first) = intolerant.first() {
            out.warnings.push(Warning {
                reason: "CompatTaintSkipped",
                note: format!(
                    "Not adding {}=true:NoExecute: {} running game-server pod(s) do not tolerate it and would be evicted (first: {first})",
                    keys::COMPAT_TAINT_ACTIVE,
                    intolerant.len()
                ),
            });
        } else {
            let mut taints = node.taints.clone();
            taints.push(active);
            out.actions.push(Action::PatchNode(NodePatch {
                resource_version: node.resource_version.clone(),
                taints: Some(taints),
                ..Default::default()
            }));
        }
    }
}
