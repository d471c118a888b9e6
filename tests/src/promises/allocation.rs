//! Allocation against the drain: no match killed (a GameServer deleted by the agent after
//! its allocation), and, for allocators that exclude `lastcall.dev/node-draining=true`, no
//! allocation that came too late (`docs/agent.md`, Guarantees):
//!
//! - per server: none after the agent's last accepted write to it marked it draining (its
//!   DELETE, or the label that follows a failed one);
//! - per node: none once every DELETE of the agent's first round of releases past its
//!   fence has been answered, except on a server whose own DELETE failed (429/5xx) after
//!   the fence and whose label has not landed (the per-server rule covers that one).

use std::collections::BTreeMap;

use super::body::written;
use super::fence::{DRAINING_LABEL, first_fence};
use super::{accepted, by};
use crate::kube::journal::{JournalEntry, Verb};

/// The allocator's accepted allocations (an Update of a GameServer), in journal order.
pub fn allocations<'a>(entries: &'a [JournalEntry], allocator: &str) -> Vec<&'a JournalEntry> {
    entries
        .iter()
        .filter(|e| {
            by(e, allocator)
                && e.verb == Verb::Update
                && e.resource.as_deref() == Some("gameservers")
                && accepted(e)
        })
        .collect()
}

fn on_gameservers(e: &JournalEntry) -> bool {
    e.resource.as_deref() == Some("gameservers")
}

/// A match killed: an accepted DELETE of a GameServer by an agent (`is_agent`) after the
/// allocator allocated it. Pairs of (the allocation, the DELETE).
pub fn deleted_after_allocation<'a>(
    entries: &'a [JournalEntry],
    is_agent: impl Fn(&JournalEntry) -> bool,
    allocator: &str,
) -> Vec<(&'a JournalEntry, &'a JournalEntry)> {
    let mut first: BTreeMap<&str, &JournalEntry> = BTreeMap::new();
    let mut out = vec![];
    for e in entries {
        let Some(name) = e.name.as_deref() else {
            continue;
        };
        if by(e, allocator) && e.verb == Verb::Update && on_gameservers(e) && accepted(e) {
            first.entry(name).or_insert(e);
        } else if is_agent(e)
            && e.verb == Verb::Delete
            && on_gameservers(e)
            && accepted(e)
            && let Some(a) = first.get(name)
        {
            out.push((*a, e));
        }
    }
    out
}

/// An allocation that came too late, and the write (or the answered round) it came after.
#[derive(Clone, Debug)]
pub struct LateAllocation {
    pub name: String,
    pub seq: u64,
    /// The agent's marking write of this server, or the last answer of its first round.
    pub after: u64,
    pub why: &'static str,
}

/// Whether an accepted write of the agent to a GameServer marks it draining: its DELETE,
/// or a body that sets the draining label to `"true"`.
fn marks_draining(e: &JournalEntry) -> bool {
    e.verb == Verb::Delete
        || e.request.as_deref().is_some_and(|b| {
            written(b, &["metadata", "labels", DRAINING_LABEL]).is_some_and(|v| v == "true")
        })
}

/// Per server: allocations by `allocator` after the last accepted write of an agent
/// (`is_agent`: the node's agents, whose writes to a server count as one writer's) to that
/// server marked it draining.
pub fn allocated_after_marked(
    entries: &[JournalEntry],
    is_agent: impl Fn(&JournalEntry) -> bool,
    allocator: &str,
) -> Vec<LateAllocation> {
    let mut marked: BTreeMap<&str, Option<u64>> = BTreeMap::new();
    let mut out = vec![];
    for e in entries.iter().filter(|e| on_gameservers(e) && accepted(e)) {
        let Some(name) = e.name.as_deref() else {
            continue;
        };
        if is_agent(e) && e.verb.is_mutating() {
            marked.insert(name, marks_draining(e).then_some(e.seq));
        } else if by(e, allocator)
            && e.verb == Verb::Update
            && let Some(Some(w)) = marked.get(name)
        {
            out.push(LateAllocation {
                name: name.to_string(),
                seq: e.seq,
                after: *w,
                why: "after the agent marked the server draining",
            });
        }
    }
    out
}

/// Per node: allocations by `allocator` of servers on `node` (`on_node` by name) after the
/// agent's first round of releases past its fence was answered, but on a server whose own
/// DELETE failed after the fence and before the allocation.
pub fn allocated_after_first_round(
    entries: &[JournalEntry],
    agent: &str,
    allocator: &str,
    node: &str,
    on_node: impl Fn(&str) -> bool,
) -> Vec<LateAllocation> {
    let Some(fence) = first_fence(entries, agent, node).map(|f| f.seq) else {
        return vec![];
    };
    let on_node = &on_node;
    let deletes = || {
        entries.iter().filter(move |d| {
            by(d, agent)
                && on_gameservers(d)
                && d.verb == Verb::Delete
                && d.seq > fence
                && d.name.as_deref().is_some_and(on_node)
        })
    };
    let mut first_delete: BTreeMap<&str, u64> = BTreeMap::new();
    for d in deletes() {
        if let Some(n) = d.name.as_deref() {
            first_delete.entry(n).or_insert(d.seq);
        }
    }
    let Some(round) = first_delete.values().max().copied() else {
        return vec![];
    };
    let failed_before = |name: &str, before: u64| {
        deletes().any(|d| {
            d.name.as_deref() == Some(name)
                && (d.status == 429 || d.status >= 500)
                && d.seq < before
        })
    };
    allocations(entries, allocator)
        .into_iter()
        .filter_map(|a| {
            let name = a.name.as_deref()?;
            (a.seq > round && on_node(name) && !failed_before(name, a.seq)).then(|| {
                LateAllocation {
                    name: name.to_string(),
                    seq: a.seq,
                    after: round,
                    why: "after the agent's first round of releases was answered",
                }
            })
        })
        .collect()
}

/// Both rules for one node, each late allocation once.
pub fn late_allocations(
    entries: &[JournalEntry],
    agent: &str,
    allocator: &str,
    node: &str,
    on_node: impl Fn(&str) -> bool,
) -> Vec<LateAllocation> {
    let mut late: Vec<LateAllocation> =
        allocated_after_marked(entries, |e| by(e, agent), allocator)
            .into_iter()
            .filter(|l| on_node(&l.name))
            .collect();
    for l in allocated_after_first_round(entries, agent, allocator, node, &on_node) {
        if !late.iter().any(|k| k.seq == l.seq) {
            late.push(l);
        }
    }
    late.sort_by_key(|l| l.seq);
    late
}
