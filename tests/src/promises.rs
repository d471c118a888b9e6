//! The agent's promises (`docs/agent.md`, Guarantees), each checked once, on the kube
//! emulator's journal, for every test, bench and checker that holds the agent to it: what
//! counts as the fence, a release, a match killed, an allocation that came too late, and a
//! graceful ending. Each check returns what broke it (empty: kept), so a harness can count
//! and a test can panic with the requests that show it.

pub mod allocation;
pub mod body;
pub mod fence;
pub mod graceful;
pub mod retries;

use crate::kube::journal::JournalEntry;

/// An accepted (2xx) request.
pub fn accepted(e: &JournalEntry) -> bool {
    (200..300).contains(&e.status)
}

/// `e` was made by `identity`.
pub fn by(e: &JournalEntry, identity: &str) -> bool {
    e.identity.as_deref() == Some(identity)
}

/// One line per request, for failure messages: `#seq identity verb resource/name status`.
pub fn describe(entries: &[&JournalEntry]) -> String {
    entries
        .iter()
        .map(|e| {
            format!(
                "#{} {} {} {}{}/{} {}",
                e.seq,
                e.identity.as_deref().unwrap_or("-"),
                e.verb.as_str(),
                e.resource.as_deref().unwrap_or("-"),
                e.subresource
                    .as_deref()
                    .map(|s| format!("[{s}]"))
                    .unwrap_or_default(),
                e.name.as_deref().unwrap_or("-"),
                e.status
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}
