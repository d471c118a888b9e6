//! The fence (cordon + lastcall's `NoSchedule` taint on the Node, one write) and the
//! promise that nothing is released before it: every release-like write the agent makes to
//! a GameServer (its DELETE, the `lastcall.dev/node-draining` label, the drain-deadline
//! annotation) lands while its Node stands fenced by an accepted write of the agent's.

use serde_json::Value;

use super::body::written;
use super::{accepted, by, describe};
use crate::kube::journal::{JournalEntry, Verb};

/// lastcall's fence taint.
pub const DRAINING_TAINT: &str = "lastcall.dev/draining";
/// The label allocators exclude (`lastcall.dev/node-draining!=true`).
pub const DRAINING_LABEL: &str = "lastcall.dev/node-draining";
/// The deadline announced on a protected GameServer.
pub const DEADLINE_ANNOTATION: &str = "lastcall.dev/drain-deadline";

/// An accepted write to the main resource of Node `node`.
fn node_write(e: &JournalEntry, node: &str) -> bool {
    e.resource.as_deref() == Some("nodes")
        && e.name.as_deref() == Some(node)
        && e.subresource.is_none()
        && matches!(e.verb, Verb::Patch | Verb::Update)
        && accepted(e)
}

fn has_draining_taint(taints: &Value) -> bool {
    taints
        .as_array()
        .is_some_and(|t| t.iter().any(|t| t["key"] == DRAINING_TAINT))
}

/// Whether an accepted Node write left the Node fenced (`Some(true)`), unfenced
/// (`Some(false)`), or did not say (`None`). By its answer when journaled (cordoned and
/// carrying lastcall's taint); otherwise (a remote journal keeps no answers) by its body:
/// a taint list written with lastcall's taint in it fences, one without it unfences.
fn fence_state_after(e: &JournalEntry) -> Option<bool> {
    if let Some(v) = e.response.as_deref().filter(|v| v["kind"] == "Node") {
        return Some(
            v["spec"]["unschedulable"].as_bool() == Some(true)
                && has_draining_taint(&v["spec"]["taints"]),
        );
    }
    let taints = written(e.request.as_deref()?, &["spec", "taints"])?;
    Some(has_draining_taint(&taints))
}

/// Whether `e` is an accepted write to Node `node` after which it stands fenced: the
/// fence itself, or a later write that keeps it. The first one by the agent is the fence.
pub fn leaves_fenced(e: &JournalEntry, node: &str) -> bool {
    node_write(e, node) && fence_state_after(e) == Some(true)
}

/// The agent's fence of `node`: its first accepted write that left the Node fenced.
pub fn first_fence<'a>(
    entries: &'a [JournalEntry],
    agent: &str,
    node: &str,
) -> Option<&'a JournalEntry> {
    entries
        .iter()
        .find(|e| by(e, agent) && leaves_fenced(e, node))
}

/// Whether `e` takes a GameServer out of allocation or announces its end: a DELETE, or a
/// write that sets the draining label or the drain-deadline annotation (taking them off,
/// as a cancel does, is not).
pub fn is_release_write(e: &JournalEntry) -> bool {
    if e.resource.as_deref() != Some("gameservers") || !e.verb.is_mutating() {
        return false;
    }
    if e.verb == Verb::Delete {
        return true;
    }
    let Some(body) = e.request.as_deref() else {
        return false;
    };
    let sets = |path: &[&str]| written(body, path).is_some_and(|v| !v.is_null());
    sets(&["metadata", "labels", DRAINING_LABEL])
        || sets(&["metadata", "annotations", DEADLINE_ANNOTATION])
}

/// The release writes `agent` sent (accepted or not: sending one is the act) while `node`
/// did not stand fenced by an accepted write of the agent's: none before its first fence,
/// none after a write of its took the fence off and before the next. Empty: the promise
/// held.
pub fn releases_before_fence<'a>(
    entries: &'a [JournalEntry],
    agent: &str,
    node: &str,
) -> Vec<&'a JournalEntry> {
    let mut fenced = false;
    let mut out = vec![];
    for e in entries.iter().filter(|e| by(e, agent)) {
        if node_write(e, node)
            && let Some(state) = fence_state_after(e)
        {
            fenced = state;
        } else if is_release_write(e) && !fenced {
            out.push(e);
        }
    }
    out
}

/// Panics, naming the requests, unless every release write of `agent` came while `node`
/// stood fenced by the agent's own accepted write.
pub fn assert_no_release_before_fence(entries: &[JournalEntry], agent: &str, node: &str) {
    let early = releases_before_fence(entries, agent, node);
    if early.is_empty() {
        return;
    }
    let fence = first_fence(entries, agent, node).map(|f| f.seq);
    let theirs: Vec<&JournalEntry> = entries
        .iter()
        .filter(|e| {
            by(e, agent)
                && e.verb.is_mutating()
                && matches!(e.resource.as_deref(), Some("nodes" | "gameservers"))
        })
        .collect();
    panic!(
        "{agent} released before its fence of {node} was accepted (first fence: {fence:?}):\n{}\nits Node and GameServer writes:\n{}",
        describe(&early),
        describe(&theirs)
    );
}
