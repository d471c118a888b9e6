//! The fence: the node-level write that keeps new matches off the node, and the claim on
//! game-server pods whose GameServer the label-filtered watch cannot see yet.

use std::collections::BTreeSet;

use crate::keys;
use crate::notice::Notice;
use crate::observed::Observed;
use crate::progress::{DrainRecord, Progress, Recorded, format_precise};

use super::deadlines::deadlines;
use super::taints::taint;
use super::{Action, Inputs, NodeEvent, NodePatch};

/// GameServer pods on this node whose GameServer the watch cannot see yet: not labelled yet
/// (selection by label), or not yet given `status.nodeName` by Agones (selection by field:
/// Creating or Starting, or Agones' controller is down). Claimed only where a label is what
/// makes them visible.
pub(super) fn unseen_servers(obs: &Observed) -> Vec<Action> {
    let seen: BTreeSet<(&str, &str)> = obs
        .game_servers
        .iter()
        .map(|g| (g.namespace.as_str(), g.name.as_str()))
        .collect();
    let mut out = vec![];
    for pod in &obs.pods {
        if let Some(gs) = &pod.gameserver
            && !pod.deleting
            && !pod.finished
            && !seen.contains(&(pod.namespace.as_str(), gs.as_str()))
        {
            out.push(Action::ClaimGameServer {
                namespace: pod.namespace.clone(),
                name: gs.clone(),
            });
        }
    }
    out
}

/// A held drain's fence, put back where another writer stripped it: our taint, and the
/// cordon if lastcall made it, with the moment it stands again (the settle counts from
/// it). The drain's record stays as it was while it is held. `None` when the fence stands.
pub(super) fn refence(inp: &Inputs<'_>, progress: &Progress) -> Option<NodePatch> {
    let node = &inp.observed.node;
    let mut patch = NodePatch {
        resource_version: node.resource_version.clone(),
        ..Default::default()
    };
    if !node.has_taint(keys::TAINT_DRAINING) {
        let mut taints = node.taints.clone();
        taints.push(taint(keys::TAINT_DRAINING, "lastcall", "NoSchedule"));
        patch.taints = Some(taints);
    }
    if progress.cordoned_by_us && !node.unschedulable {
        patch.unschedulable = Some(true);
    }
    if patch.taints.is_none() && patch.unschedulable.is_none() {
        return None;
    }
    restored(inp, &mut patch);
    Some(patch)
}

/// A fence put back after another writer stripped it: the settle before any hand-off
/// counts again from now (a scheduler may have chosen this node while the fence was gone,
/// and bind its pod after the next fresh read). Also written when the mark is unreadable.
fn restored(inp: &Inputs<'_>, patch: &mut NodePatch) {
    patch
        .set_annotations
        .insert(keys::ANN_FENCE_RESTORED.into(), format_precise(inp.now));
}

/// The node-level fence: cordon, our taint, progress annotations and the drain record.
/// `None` when already there.
pub(super) fn fence_patch(
    inp: &Inputs<'_>,
    progress: &Progress,
    driver: Option<&Notice>,
) -> Option<NodePatch> {
    let node = &inp.observed.node;
    let mut patch = NodePatch {
        resource_version: node.resource_version.clone(),
        ..Default::default()
    };
    // Karpenter, the cluster autoscaler or someone else may already keep new pods off the
    // node; then lastcall does only the game-server work and never cordons on top.
    if !node.unschedulable && driver.is_none_or(|d| d.cordon) {
        patch.unschedulable = Some(true);
        if !progress.cordoned_by_us {
            patch
                .set_annotations
                .insert(keys::ANN_CORDONED.into(), "true".into());
        }
    }
    if !node.has_taint(keys::TAINT_DRAINING) {
        let source = driver.map_or("lastcall", |d| d.source.as_str());
        let mut taints = node.taints.clone();
        taints.push(taint(keys::TAINT_DRAINING, source, "NoSchedule"));
        patch.taints = Some(taints);
    }
    // To the sub-second (the settle counts from it); a garbled start is written anew, so
    // the settle is never shortened by it. Also once deregistered: the hand-off that may
    // still wait (an Auto Scaling hook) counts its settle from it, and an unreadable start
    // would push it later on every pass, for ever.
    if progress.start().is_none() {
        patch
            .set_annotations
            .insert(keys::ANN_STARTED.into(), format_precise(inp.now));
    }
    // A drain already under way whose fence another writer stripped (or whose restoration
    // mark is unreadable): the fence stands again only from now.
    let putting_back = patch.unschedulable == Some(true) || patch.taints.is_some();
    let unreadable_mark = node
        .annotations
        .get(keys::ANN_FENCE_RESTORED)
        .is_some_and(|v| v.parse::<jiff::Timestamp>().is_err());
    if progress.started.is_some() && (putting_back || unreadable_mark) {
        restored(inp, &mut patch);
    }
    // The life this drain belongs to: a machine that comes back starts a new one.
    if let Some(boot) = &node.boot_id
        && progress.boot_id.is_none()
        && progress.deregistered.is_none()
    {
        patch
            .set_annotations
            .insert(keys::ANN_BOOT_ID.into(), boot.clone());
    }
    if let Some(d) = driver
        && progress.deregistered.is_none()
    {
        if progress.cause != Some(d.cause) {
            patch
                .set_annotations
                .insert(keys::ANN_CAUSE.into(), d.cause.as_str().into());
        }
        // Who asks now, as the deadline rule keeps it.
        let record = DrainRecord {
            entries: deadlines(inp, progress).record(),
        };
        if !record.entries.is_empty() && progress.record != Recorded::Valid(record.clone()) {
            patch
                .set_annotations
                .insert(keys::ANN_NOTICE.into(), record.to_annotation());
        }
    }
    if progress.started.is_none()
        && progress.deregistered.is_none()
        && patch.set_annotations.contains_key(keys::ANN_STARTED)
    {
        patch.events.push(NodeEvent::DrainStarted);
    }
    if patch.unschedulable == Some(true) || patch.taints.is_some() {
        patch.events.push(NodeEvent::NodeFenced);
    }
    (!patch.is_empty()).then_some(patch)
}
