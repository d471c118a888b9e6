//! Writes one event onto its Node: the annotation `lastcall.dev/aws-events`, one guarded
//! JSON patch (a `test` of the resourceVersion the record was read at, then the record), so
//! a concurrent writer is never overwritten and nothing but that annotation changes.
//!
//! Durable before the message is deleted: the patch's answer is the API server's own
//! (written to etcd). A redelivery or a replay finds the event there and writes nothing.

use jiff::Timestamp;
use json_patch::Patch as JsonPatch;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};
use lastcall_common::aws_events::{ANNOTATION, Record, Relayed};
use serde_json::{Value, json};

use super::nodes::NodeEntry;

/// Attempts of one write when the Node keeps changing under it.
const ATTEMPTS: usize = 5;

/// What one relay did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Written; the Node as the API server answered.
    Written(NodeEntry),
    /// Already on the Node: nothing written.
    Duplicate,
    /// The Node is gone (404), or runs another instance now.
    NodeGone,
}

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("writing the Node: {0}")]
    Kube(#[source] kube::Error),
    #[error("the Node kept changing; {ATTEMPTS} attempts")]
    Contended,
}

impl RelayError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Kube(kube::Error::Api(s)) if s.code == 403 => "forbidden",
            Self::Kube(kube::Error::Api(s)) if s.code == 429 => "throttled",
            Self::Kube(kube::Error::Api(_)) => "api_error",
            Self::Kube(_) => "unreachable",
            Self::Contended => "contended",
        }
    }
}

/// The patch that adds `event` to the Node's record, or `None` when it is already there.
/// An unreadable record (another version, or not ours) is replaced: pubsub owns the key.
pub fn plan(entry: &NodeEntry, event: &Relayed, now: Timestamp) -> Option<Value> {
    let current = match entry.record.as_deref().map(Record::parse) {
        None => Record::empty(),
        Some(Ok(r)) => r,
        Some(Err(e)) => {
            tracing::warn!(message = "the Node's relayed-events record cannot be read; replacing it", node = %entry.name, reason = e.metric_label(), error = %e);
            Record::empty()
        }
    };
    let next = current.with(event.clone(), now)?;
    let mut ops = vec![json!({
        "op": "test",
        "path": "/metadata/resourceVersion",
        "value": entry.resource_version,
    })];
    if !entry.has_annotations {
        ops.push(json!({"op": "add", "path": "/metadata/annotations", "value": {}}));
    }
    ops.push(json!({
        "op": "add",
        "path": format!("/metadata/annotations/{}", ANNOTATION.replace('~', "~0").replace('/', "~1")),
        "value": next.to_annotation(),
    }));
    Some(Value::Array(ops))
}

/// Writes `event` onto the Node `entry` names, reading the Node again after a conflict.
pub async fn relay(
    client: &kube::Client,
    instance: &str,
    mut entry: NodeEntry,
    event: &Relayed,
) -> Result<Outcome, RelayError> {
    let api: Api<Node> = Api::all(client.clone());
    for _ in 0..ATTEMPTS {
        let Some(ops) = plan(&entry, event, Timestamp::now()) else {
            return Ok(Outcome::Duplicate);
        };
        // The ops are built above from plain values: they always form a JSON patch.
        let patch: JsonPatch = serde_json::from_value(ops)
            .map_err(|e| RelayError::Kube(kube::Error::SerdeError(e)))?;
        match api
            .patch(
                &entry.name,
                &PatchParams::default(),
                &Patch::Json::<()>(patch),
            )
            .await
        {
            Ok(node) => {
                return Ok(match NodeEntry::of(&node) {
                    Some((i, e)) if i == instance => Outcome::Written(e),
                    _ => Outcome::NodeGone,
                });
            }
            // A failed `test` (422) or a conflict (409): the Node moved on. Read it again.
            Err(kube::Error::Api(s)) if s.code == 409 || s.code == 422 => {}
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok(Outcome::NodeGone),
            Err(e) => return Err(RelayError::Kube(e)),
        }
        match api.get(&entry.name).await {
            Ok(node) => match NodeEntry::of(&node) {
                Some((i, e)) if i == instance => entry = e,
                _ => return Ok(Outcome::NodeGone),
            },
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok(Outcome::NodeGone),
            Err(e) => return Err(RelayError::Kube(e)),
        }
    }
    Err(RelayError::Contended)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lastcall_common::aws_events::{Event, SpotAction};

    fn entry(record: Option<String>, has_annotations: bool) -> NodeEntry {
        NodeEntry {
            name: "n1".into(),
            resource_version: "42".into(),
            record,
            has_annotations,
        }
    }

    fn spot() -> Relayed {
        Relayed {
            instance: "i-0123456789abcdef0".into(),
            id: "e1".into(),
            time: "2026-12-01T10:00:00Z".parse().unwrap(),
            event: Event::SpotInterruption {
                action: SpotAction::Terminate,
            },
        }
    }

    #[test]
    fn the_patch_is_guarded_and_touches_only_the_annotation() {
        let now = "2026-12-01T10:00:01Z".parse().unwrap();
        let ops = plan(&entry(None, false), &spot(), now).unwrap();
        let ops = ops.as_array().unwrap();
        assert_eq!(
            ops[0],
            json!({"op": "test", "path": "/metadata/resourceVersion", "value": "42"})
        );
        assert_eq!(
            ops[1],
            json!({"op": "add", "path": "/metadata/annotations", "value": {}})
        );
        assert_eq!(
            ops[2]["path"],
            "/metadata/annotations/lastcall.dev~1aws-events"
        );
        let written = Record::parse(ops[2]["value"].as_str().unwrap()).unwrap();
        assert_eq!(written.events, vec![spot()]);
        assert_eq!(ops.len(), 3);

        let ops = plan(&entry(None, true), &spot(), now).unwrap();
        assert_eq!(
            ops.as_array().unwrap().len(),
            2,
            "the map exists: never replaced"
        );

        let there = Record::empty().with(spot(), now).unwrap().to_annotation();
        assert_eq!(
            plan(&entry(Some(there), true), &spot(), now),
            None,
            "a duplicate writes nothing"
        );

        let ops = plan(&entry(Some("garbage".into()), true), &spot(), now).unwrap();
        let written = Record::parse(ops[1]["value"].as_str().unwrap()).unwrap();
        assert_eq!(
            written.events,
            vec![spot()],
            "an unreadable record is replaced"
        );
    }
}
