//! A match ended by lastcall gets its pod's own graceful termination (`docs/eviction.md`):
//! a pod DELETE preconditioned on the uid of the pod it means, with no grace override, so the
//! game gets SIGTERM and its whole `terminationGracePeriodSeconds`, ending no earlier than the
//! deadline. Never an Eviction: at a hard deadline the machine goes whatever a disruption
//! budget says, and the Kubernetes docs' Eviction API is the voluntary-disruption path, one
//! that waits on budgets.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use serde_json::Value;

use super::body::{grace_period_override, uid_precondition};
use super::{accepted, by};
use crate::kube::journal::{JournalEntry, Verb};

/// What a game-server pod was before lastcall ended it.
#[derive(Clone, Debug)]
pub struct PodFacts {
    pub uid: String,
    /// Its `terminationGracePeriodSeconds` (30 when unset, as the API server defaults it).
    pub grace: i64,
}

impl PodFacts {
    /// From a stored pod (`None` without a uid).
    pub fn of(pod: &Value) -> Option<PodFacts> {
        Some(PodFacts {
            uid: pod["metadata"]["uid"].as_str()?.to_string(),
            grace: pod["spec"]["terminationGracePeriodSeconds"]
                .as_i64()
                .unwrap_or(30),
        })
    }
}

/// Whether `e` is a request that ends a pod's match: a pod DELETE, or an Eviction (which
/// lastcall must never send, but which would end the match all the same).
pub fn ends_a_match(e: &JournalEntry) -> bool {
    e.resource.as_deref() == Some("pods")
        && (is_eviction(e) || (e.verb == Verb::Delete && e.subresource.is_none()))
}

/// Whether `e` is a `policy/v1` Eviction (a POST to a pod's `eviction` subresource).
pub fn is_eviction(e: &JournalEntry) -> bool {
    e.resource.as_deref() == Some("pods")
        && e.verb == Verb::Create
        && e.subresource.as_deref() == Some("eviction")
}

/// Whether the API server refused `e` before reading its body (API Priority and Fairness'
/// 429, or a restarting server's 503): the journal keeps nothing of what it asked.
pub fn refused_unread(e: &JournalEntry) -> bool {
    e.request.is_none() && matches!(e.status, 429 | 503)
}

/// Every Eviction `agent` sent, answered or refused.
pub fn evictions<'a>(entries: &'a [JournalEntry], agent: &str) -> Vec<&'a JournalEntry> {
    entries
        .iter()
        .filter(|e| by(e, agent) && is_eviction(e))
        .collect()
}

/// What is wrong with one ending request by its body and query alone: an Eviction instead of
/// a pod DELETE; no uid precondition, or not `uid` when known; a grace period other than the
/// pod's own `grace`.
pub fn request_faults(e: &JournalEntry, uid: Option<&str>, grace: Option<i64>) -> Vec<String> {
    let body = e.request.as_deref();
    let mut out = vec![];
    if is_eviction(e) {
        out.push("an Eviction, not a pod DELETE".to_string());
    }
    match (uid_precondition(body), uid) {
        (None, _) => out.push("no uid precondition".to_string()),
        (Some(sent), Some(want)) if sent != want => {
            out.push(format!("uid precondition {sent}, the pod's uid is {want}"))
        }
        _ => {}
    }
    if let Some(g) = grace_period_override(body, &e.query)
        && grace != Some(g)
    {
        out.push(format!(
            "gracePeriodSeconds {g} overrides the pod's own {grace:?}"
        ));
    }
    out
}

/// Every fault of the ending requests `agent` made, one line each (empty: every match it
/// ended got its graceful termination):
///
/// - each request (accepted or refused) is a pod DELETE (no Eviction), names the pod's uid in
///   its preconditions and overrides no grace period (`before`: the pods as they were, by
///   name); one the API server turned away before reading its body (throttled or
///   restarting, [`refused_unread`]) is judged by its path alone, as nothing else of it is
///   known;
/// - each accepted one left the pod terminating with `deletionGracePeriodSeconds` equal to
///   its own grace (by a DELETE's answer, else the pod as stored afterwards, `after`; a pod
///   already gone was killed, not ended);
/// - and the pod's end (the request's time + that grace) is no earlier than `deadline −
///   slack`.
pub fn graceful_faults(
    entries: &[JournalEntry],
    agent: &str,
    before: &BTreeMap<String, PodFacts>,
    after: &BTreeMap<String, Value>,
    deadline: SystemTime,
    slack: Duration,
) -> Vec<String> {
    let mut out = vec![];
    for e in entries.iter().filter(|e| by(e, agent) && ends_a_match(e)) {
        let pod = e.name.clone().unwrap_or_default();
        let facts = before.get(&pod);
        let what = format!(
            "#{} {} of {pod}",
            e.seq,
            e.subresource.as_deref().unwrap_or("delete")
        );
        if facts.is_none() {
            out.push(format!("{what}: a pod the test did not know"));
        }
        if refused_unread(e) {
            if is_eviction(e) {
                out.push(format!("{what}: an Eviction, not a pod DELETE"));
            }
            continue;
        }
        for f in request_faults(e, facts.map(|f| f.uid.as_str()), facts.map(|f| f.grace)) {
            out.push(format!("{what}: {f}"));
        }
        if !accepted(e) {
            continue;
        }
        let answered = e
            .response
            .as_deref()
            .filter(|v| v["kind"] == "Pod")
            .or_else(|| after.get(&pod));
        let applied = answered.and_then(|v| v["metadata"]["deletionGracePeriodSeconds"].as_i64());
        match (applied, facts) {
            (None, _) => out.push(format!(
                "{what}: the pod is not terminating with a grace period (removed at once?)"
            )),
            (Some(g), Some(f)) if g != f.grace => out.push(format!(
                "{what}: terminating with {g}s, the pod's own grace is {}s",
                f.grace
            )),
            (Some(g), _) => {
                let end = e.at + Duration::from_secs(g.max(0) as u64);
                if end + slack < deadline {
                    out.push(format!(
                        "{what}: the pod ends {:?} before the deadline",
                        deadline.duration_since(end).unwrap_or_default()
                    ));
                }
            }
        }
    }
    out
}

/// Panics with every fault [`graceful_faults`] finds.
pub fn assert_graceful(
    entries: &[JournalEntry],
    agent: &str,
    before: &BTreeMap<String, PodFacts>,
    after: &BTreeMap<String, Value>,
    deadline: SystemTime,
    slack: Duration,
) {
    let faults = graceful_faults(entries, agent, before, after, deadline, slack);
    assert!(
        faults.is_empty(),
        "matches ended without their graceful termination:\n{}",
        faults.join("\n")
    );
}
