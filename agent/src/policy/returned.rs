//! A machine that came back. Finality (a deregistration, a hand-back to GKE, a Spot notice
//! that cannot be withdrawn) assumes the VM never returns, but a stopped Spot or preemptible
//! VM is started again under the same Node, and reboots return. A new boot id says the life
//! the drain belonged to is over: with no signal live, everything lastcall placed is lifted
//! (the node takes game servers again); with one live, the fence stays and the drain goes
//! on in this life, its old final marks dropped. Either way an Event says why.

use crate::keys;
use crate::notice::Notice;
use crate::progress::{Progress, format_precise};

use super::cancel::cancel;
use super::{Action, Inputs, NodeEvent, NodePatch, Phase};

/// The old life's marks that would keep the new one from ever being handed back or
/// cancelled.
const FINAL_MARKS: [&str; 3] = [
    keys::ANN_DEREGISTERED,
    keys::ANN_HANDED_BACK,
    keys::ANN_NOTICE,
];

/// The old life's marks to drop from the Node: the final ones, and a registration the old
/// life's deregistration ended (GameLift no longer has it: this life has registered
/// nothing, and a restarted agent must not take "GameLift does not have it" for a
/// deregistration of this life).
fn old_marks(inp: &Inputs<'_>) -> Vec<&'static str> {
    let ann = &inp.observed.node.annotations;
    let registration_ended = ann.contains_key(keys::ANN_DEREGISTERED);
    FINAL_MARKS
        .into_iter()
        .chain(registration_ended.then_some(keys::ANN_REGISTERED))
        .filter(|k| ann.contains_key(*k))
        .collect()
}

pub(super) fn returned(
    inp: &Inputs<'_>,
    progress: &Progress,
    driver: Option<&Notice>,
    actions: &mut Vec<Action>,
) -> Phase {
    let node = &inp.observed.node;
    if driver.is_none() {
        cancel(inp, progress, actions);
        let patch = match actions.iter_mut().find_map(|a| match a {
            Action::PatchNode(p) => Some(p),
            _ => None,
        }) {
            Some(p) => p,
            None => {
                actions.push(Action::PatchNode(NodePatch {
                    resource_version: node.resource_version.clone(),
                    ..Default::default()
                }));
                match actions.last_mut() {
                    Some(Action::PatchNode(p)) => p,
                    _ => return Phase::Cancelling,
                }
            }
        };
        for k in old_marks(inp) {
            patch.remove_annotations.insert(k.to_string());
        }
        if node.annotations.contains_key(keys::ANN_BOOT_ID) {
            patch
                .remove_annotations
                .insert(keys::ANN_BOOT_ID.to_string());
        }
        patch.events.retain(|e| *e != NodeEvent::DrainCancelled);
        patch.events.push(NodeEvent::MachineReturned);
        return Phase::Cancelling;
    }
    // A signal is live: the fence stays; the drain starts again in this life.
    let mut patch = NodePatch {
        resource_version: node.resource_version.clone(),
        ..Default::default()
    };
    for k in old_marks(inp) {
        patch.remove_annotations.insert(k.to_string());
    }
    if node.annotations.contains_key(keys::ANN_HANDED_BACK)
        && node
            .labels
            .contains_key(keys::LABEL_GKE_PERFORM_MAINTENANCE)
    {
        patch
            .remove_labels
            .insert(keys::LABEL_GKE_PERFORM_MAINTENANCE.to_string());
    }
    if let Some(boot) = &node.boot_id {
        patch
            .set_annotations
            .insert(keys::ANN_BOOT_ID.into(), boot.clone());
    }
    // The settle before any hand-off counts again from now.
    patch
        .set_annotations
        .insert(keys::ANN_STARTED.into(), format_precise(inp.now));
    patch.events.push(NodeEvent::MachineReturned);
    actions.push(Action::PatchNode(patch));
    Phase::Fencing
}
