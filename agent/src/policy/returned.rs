//! A machine that came back. Finality (a deregistration, a hand-back to GKE, a Spot notice
//! that cannot be withdrawn) assumes the VM never returns, but a stopped Spot or preemptible
//! VM is started again under the same Node, and reboots return. A new boot id says the life
//! the drain belonged to is over: with no signal live, everything lastcall placed is lifted
//! (the node takes game servers again); with one live, the fence stays and the drain goes
//! on in this life, its old final marks dropped. Either way an Event says why.

use crate::keys;
use crate::notice::Notice;
use crate::progress::{Progress, Recorded, format_precise};

use super::cancel::cancel;
use super::{Action, Inputs, NodeEvent, NodePatch, Phase, Plan, Warning};

/// The Warning Event (and `lastcall_machine_returned_held`) for a machine that came back
/// and stays fenced because a source that asked for its last drain has not reported since.
pub const MACHINE_RETURNED_HELD: &str = "MachineReturnedHeld";

/// How long a machine that came back stays fenced for unheard sources before the operator
/// is told: sources report within seconds of a start, so a hold longer than this is one that
/// may not end by itself (a source down, or gone from the configuration).
const HELD_WARN_AFTER: jiff::SignedDuration = jiff::SignedDuration::from_secs(60);

/// A machine that came back, held for sources that asked for its last drain and have not
/// reported in this life: once it has been back (Ready) a while, the operator is told which,
/// and the plan wakes for that moment before it.
pub(super) fn held(inp: &Inputs<'_>, progress: &Progress, out: &mut Plan) {
    let unknown = inp.unknown_sources;
    let mut waiting: Vec<&str> = match &progress.record {
        Recorded::Valid(r) => r
            .entries
            .iter()
            .filter(|e| unknown.contains(&e.source))
            .map(|e| e.source.as_str())
            .collect(),
        Recorded::Absent | Recorded::Garbled => unknown.iter().map(|s| s.as_str()).collect(),
    };
    waiting.sort_unstable();
    waiting.dedup();
    // Back since the kubelet reported Ready; unsaid, since now (told at once).
    let tell_at = inp
        .observed
        .node
        .ready_since
        .and_then(|t| t.checked_add(HELD_WARN_AFTER).ok())
        .unwrap_or(inp.now);
    if inp.now < tell_at {
        out.wake_at = Some(out.wake_at.map_or(tell_at, |w| w.min(tell_at)));
        return;
    }
    out.warnings.push(Warning {
        reason: MACHINE_RETURNED_HELD,
        note: format!(
            "The machine came back (a new boot id), but {} asked for the drain of its last life and has not reported since: the node stays fenced until it does. If that source is down, see its runbook; if it is gone for good, end the drain by hand (docs/operations.md, \"A machine came back\")",
            waiting.join(", ")
        ),
    });
}

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
