//! The agent's accepted writes in the order the API server applied them, read from either
//! backend's journal: the emulator's (its `seq`, the order it served them) or the box's
//! audit log (the resourceVersion each write produced: one etcd, one revision counter).
//!
//! Only Nodes, Pods and GameServers: the kinds the box's audit policy records with bodies.

use serde_json::Value;

use crate::kube::journal::JournalEntry;

/// The kinds a [`Write`] is read for.
pub const KINDS: [&str; 3] = ["nodes", "pods", "gameservers"];

/// One accepted write of the agent.
#[derive(Clone, Debug)]
pub struct Write {
    /// Its place in the backend's order (emulator: `seq`; box: resourceVersion).
    pub at: u64,
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

/// Lists `writes` one per line.
pub fn dump(writes: &[&Write]) -> String {
    writes
        .iter()
        .map(|w| w.describe())
        .collect::<Vec<_>>()
        .join("\n")
}
