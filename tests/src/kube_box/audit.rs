//! The API server's audit log: the box's journal of who wrote what, in what order.
//!
//! The policy logs every write to Nodes, Pods (evictions included) and GameServers with its
//! request and response bodies, and every other request of the agent's ServiceAccount with
//! its metadata (to count them). Writes are ordered by the `resourceVersion` of the object
//! each one produced: one etcd, so one revision counter across every kind.

use std::path::Path;

use serde_json::Value;

/// The agent's user, as the API server authenticates its ServiceAccount token.
pub const AGENT_USER: &str = "system:serviceaccount:lastcall:lastcall-agent";

/// `--audit-policy-file`.
pub const POLICY: &str = r#"apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: RequestResponse
    verbs: [create, update, patch, delete, deletecollection]
    resources:
      - group: ""
        resources: [nodes, pods, pods/eviction]
      - group: agones.dev
        resources: [gameservers]
  - level: Metadata
    users: ["system:serviceaccount:lastcall:lastcall-agent"]
  - level: None
"#;

/// One audit event (stage `ResponseComplete`, or `ResponseStarted` of a watch).
#[derive(Clone, Debug)]
pub struct Entry {
    pub audit_id: String,
    pub stage: String,
    pub verb: String,
    pub user: String,
    pub resource: String,
    pub subresource: String,
    pub namespace: String,
    pub name: String,
    pub code: u16,
    /// The response status's message (why a request failed).
    pub message: String,
    pub uri: String,
    pub request: Value,
    pub response: Value,
    /// When the API server received the request.
    pub received: Option<jiff::Timestamp>,
    /// When it answered (the event's stage time).
    pub completed: Option<jiff::Timestamp>,
}

impl Entry {
    fn parse(v: &Value) -> Option<Entry> {
        let s = |p: &str| {
            v.pointer(p)
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string()
        };
        Some(Entry {
            audit_id: v.get("auditID")?.as_str()?.to_string(),
            stage: s("/stage"),
            verb: s("/verb"),
            user: s("/user/username"),
            resource: s("/objectRef/resource"),
            subresource: s("/objectRef/subresource"),
            namespace: s("/objectRef/namespace"),
            name: s("/objectRef/name"),
            code: v
                .pointer("/responseStatus/code")
                .and_then(Value::as_u64)
                .and_then(|c| u16::try_from(c).ok())
                .unwrap_or(0),
            message: s("/responseStatus/message"),
            uri: s("/requestURI"),
            request: v.get("requestObject").cloned().unwrap_or(Value::Null),
            response: v.get("responseObject").cloned().unwrap_or(Value::Null),
            received: v
                .get("requestReceivedTimestamp")
                .and_then(Value::as_str)
                .and_then(|t| t.parse().ok()),
            completed: v
                .get("stageTimestamp")
                .and_then(Value::as_str)
                .and_then(|t| t.parse().ok()),
        })
    }

    pub fn ok(&self) -> bool {
        (200..300).contains(&self.code)
    }

    pub fn is_write(&self) -> bool {
        matches!(
            self.verb.as_str(),
            "create" | "update" | "patch" | "delete" | "deletecollection"
        )
    }

    /// Refused by authorization or by a ValidatingAdmissionPolicy (both answer 403; the
    /// policy's message names it). A 422 is the writer's own precondition, such as the
    /// JSON-patch `test` of the resourceVersion the agent read, which it retries.
    pub fn refused_by_policy(&self) -> bool {
        self.code == 403 || self.message.contains("ValidatingAdmissionPolicy")
    }

    pub fn by_agent(&self) -> bool {
        self.user == AGENT_USER
    }

    /// The resourceVersion of the object the write produced (its place in etcd's order).
    pub fn rv(&self) -> Option<u64> {
        self.response
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
            .and_then(|s| s.parse().ok())
    }

    /// The body the request sent (for a patch: the patch itself).
    pub fn sent(&self, pointer: &str) -> Option<&Value> {
        self.request.pointer(pointer)
    }
}

/// Every request in the log so far, once each, in the order the API server wrote them: its
/// `ResponseComplete` event, or a watch's `ResponseStarted` (a watch completes only when it
/// ends).
pub fn read(path: &Path) -> Vec<Entry> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Vec::new();
    };
    let mut seen = std::collections::HashSet::new();
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| Entry::parse(&v))
        .filter(|e| {
            e.stage == "ResponseComplete" || (e.stage == "ResponseStarted" && e.verb == "watch")
        })
        .filter(|e| seen.insert(e.audit_id.clone()))
        .collect()
}

/// The entries as the emulator's journal would hold them, so the promises written once on
/// that journal (`lastcall_testkit::promises`) judge the box too. They are put in the order
/// the promises read "before" and "after" in: a Node write at the moment the API server
/// answered it (a fence stands from then), every other request at the moment it was
/// received (a release is sent then); `seq` numbers them in that order, `identity` is the
/// audit user.
pub fn as_journal(entries: &[Entry]) -> Vec<crate::kube::journal::JournalEntry> {
    use crate::kube::journal::{JournalEntry, Verb};
    let mut keyed: Vec<(jiff::Timestamp, &Entry)> = entries
        .iter()
        .filter_map(|e| {
            let at = if e.resource == "nodes" && e.is_write() {
                e.completed.or(e.received)
            } else {
                e.received
            };
            Some((at?, e))
        })
        .collect();
    keyed.sort_by_key(|(at, _)| *at);
    keyed
        .into_iter()
        .enumerate()
        .filter_map(|(i, (at, e))| {
            let (path, query) = e.uri.split_once('?').unwrap_or((&e.uri, ""));
            let some = |s: &str| (!s.is_empty()).then(|| s.to_string());
            let body = |v: &Value| (!v.is_null()).then(|| std::sync::Arc::new(v.clone()));
            Some(JournalEntry {
                seq: i as u64,
                identity: Some(e.user.clone()),
                verb: Verb::parse(&e.verb)?,
                method: String::new(),
                path: path.to_string(),
                query: query.to_string(),
                status: e.code,
                resource: some(&e.resource),
                namespace: some(&e.namespace),
                name: some(&e.name),
                subresource: some(&e.subresource),
                at: std::time::SystemTime::from(at),
                response: if e.ok() { body(&e.response) } else { None },
                request: body(&e.request),
            })
        })
        .collect()
}

/// A one-line description of an entry, for failure messages.
pub fn describe(e: &Entry) -> String {
    format!(
        "{} {} {}/{}{} by {} -> {} rv={:?}{}",
        e.received.map(|t| t.to_string()).unwrap_or_default(),
        e.verb,
        e.resource,
        e.name,
        if e.subresource.is_empty() {
            String::new()
        } else {
            format!("/{}", e.subresource)
        },
        e.user,
        e.code,
        e.rv(),
        if e.message.is_empty() {
            String::new()
        } else {
            format!(" ({})", e.message)
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_read_once_each_with_what_the_tests_judge() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("audit.log");
        let lines = [
            // A write: both stages would be logged without omitStages; only ResponseComplete counts.
            r#"{"auditID":"a","stage":"ResponseComplete","verb":"patch","user":{"username":"system:serviceaccount:lastcall:lastcall-agent"},"objectRef":{"resource":"nodes","name":"n1"},"responseStatus":{"code":200},"requestObject":{"spec":{"unschedulable":true}},"responseObject":{"metadata":{"resourceVersion":"42"}},"requestReceivedTimestamp":"2026-12-05T14:47:10.702558Z"}"#,
            // A watch: counted from its start, once.
            r#"{"auditID":"w","stage":"ResponseStarted","verb":"watch","user":{"username":"system:serviceaccount:lastcall:lastcall-agent"},"objectRef":{"resource":"pods"},"responseStatus":{"code":200}}"#,
            r#"{"auditID":"w","stage":"ResponseComplete","verb":"watch","user":{"username":"system:serviceaccount:lastcall:lastcall-agent"},"objectRef":{"resource":"pods"},"responseStatus":{"code":200}}"#,
            // A DELETE answered with a bare Status: no resourceVersion.
            r#"{"auditID":"d","stage":"ResponseComplete","verb":"delete","user":{"username":"box-admin"},"objectRef":{"resource":"gameservers","namespace":"ns","name":"gs-0"},"responseStatus":{"code":409},"requestObject":{"preconditions":{"uid":"u"}},"responseObject":{"kind":"Status"}}"#,
            "not json: a line cut by a crash",
        ];
        std::fs::write(&log, lines.join("\n")).unwrap();
        let got = read(&log);
        assert_eq!(
            got.iter().map(|e| e.audit_id.as_str()).collect::<Vec<_>>(),
            ["a", "w", "d"]
        );
        let (patch, watch, delete) = (&got[0], &got[1], &got[2]);
        assert!(patch.by_agent() && patch.is_write() && patch.ok());
        assert_eq!(patch.rv(), Some(42));
        assert_eq!(patch.sent("/spec/unschedulable"), Some(&Value::Bool(true)));
        assert_eq!(
            patch.received.map(|t| t.to_string()).as_deref(),
            Some("2026-12-05T14:47:10.702558Z")
        );
        assert_eq!(watch.stage, "ResponseStarted");
        assert!(!watch.is_write());
        assert!(!delete.by_agent() && !delete.ok() && delete.is_write());
        assert_eq!((delete.code, delete.rv()), (409, None));
        assert_eq!(delete.sent("/preconditions/uid"), Some(&Value::from("u")));
        assert!(describe(delete).contains("delete gameservers/gs-0 by box-admin -> 409"));
        assert!(read(&dir.path().join("missing.log")).is_empty());
    }
}
