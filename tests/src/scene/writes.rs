//! The agent's accepted writes in the order the API server applied them, read from either
//! backend's journal (the emulator's, or the box's audit log) and placed by the
//! resourceVersion each write produced (one store, one etcd: one revision counter each).
//!
//! Only Nodes, Pods and GameServers: the kinds the box's audit policy records with bodies.

use serde_json::Value;

use crate::kube::journal::JournalEntry;

/// The kinds a [`Write`] is read for.
pub const KINDS: [&str; 3] = ["nodes", "pods", "gameservers"];

/// One accepted write of the agent.
#[derive(Clone, Debug)]
pub struct Write {
    /// Its place in the API server's order: the resourceVersion it produced.
    pub at: u64,
    /// Its arrival in the emulator's journal (`seq`; 0 on the box), for writes that changed
    /// nothing and so share a resourceVersion.
    pub seq: u64,
    /// When the API server took it, by its own clock.
    pub when: Option<jiff::Timestamp>,
    pub verb: String,
    pub resource: String,
    pub subresource: String,
    pub name: String,
    /// The body sent (a patch: the patch; a DELETE: its options).
    pub request: Value,
    /// The answer: the object after the write (a `Status` for some deletes).
    pub response: Value,
}

impl Write {
    /// One line for failure messages.
    pub fn describe(&self) -> String {
        format!(
            "#{} {} {}/{}{} sent {}",
            self.at,
            self.verb,
            self.resource,
            self.name,
            if self.subresource.is_empty() {
                String::new()
            } else {
                format!("/{}", self.subresource)
            },
            self.request
        )
    }

    pub fn is_delete(&self) -> bool {
        self.verb == "delete"
    }
}

/// The accepted writes of `identity` to node `node` and to pods and GameServers of `ns`,
/// from the emulator's journal, in its order.
pub fn from_emulator(entries: &[JournalEntry], identity: &str, node: &str, ns: &str) -> Vec<Write> {
    let mut out: Vec<Write> = entries
        .iter()
        .filter(|e| {
            e.identity.as_deref() == Some(identity)
                && e.verb.is_mutating()
                && (200..300).contains(&e.status)
        })
        .filter_map(|e| {
            let resource = e.resource.clone()?;
            let name = e.name.clone().unwrap_or_default();
            let mine = match resource.as_str() {
                "nodes" => name == node,
                "pods" | "gameservers" => e.namespace.as_deref() == Some(ns),
                _ => false,
            };
            mine.then(|| Write {
                at: e.seq,
                seq: e.seq,
                when: jiff::Timestamp::try_from(e.at).ok(),
                verb: e.verb.as_str().to_string(),
                resource,
                subresource: e.subresource.clone().unwrap_or_default(),
                name,
                request: e.request.as_deref().cloned().unwrap_or(Value::Null),
                response: e.response.as_deref().cloned().unwrap_or(Value::Null),
            })
        })
        .collect();
    out.sort_by_key(|w| w.at);
    out
}

/// The resourceVersion in a write's answer (an object; `None` for a `Status`).
pub fn rv_of(response: &Value) -> Option<u64> {
    response
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)?
        .parse()
        .ok()
}

/// The uid a DELETE's options name (`preconditions.uid`).
pub fn uid_sent(request: &Value) -> Option<String> {
    request
        .pointer("/preconditions/uid")
        .and_then(Value::as_str)
        .map(str::to_string)
}

/// Lists `writes` one per line.
pub fn dump(writes: &[&Write]) -> String {
    writes
        .iter()
        .map(|w| w.describe())
        .collect::<Vec<_>>()
        .join("\n")
}
