//! How the model's controllers read the store and report the outcome of their writes.
//!
//! The controllers act directly on the [`Store`] (they are the control plane), so a write
//! can only fail the ways a real controller's can: the object changed or vanished since it
//! was read (409, 404), or it already exists. Those are the normal churn of a level-triggered
//! loop and the next pass settles them; anything else is logged as a warning.

use serde_json::Value;

use crate::kube::resources::ResourceType;
use crate::kube::status::ApiError;
use crate::kube::store::Store;

use super::objects::ObjectError;

/// Every object of `rt` that parses with `parse`, paired with its raw JSON. Objects that do
/// not parse are skipped (and logged): the model never acts on what it cannot read.
pub(crate) fn list_parsed<T>(
    store: &Store,
    rt: &ResourceType,
    parse: impl Fn(&Value) -> Result<T, ObjectError>,
) -> Vec<(T, Value)> {
    let (items, _) = store.list(rt, None);
    items
        .into_iter()
        .filter_map(|raw| match parse(&raw) {
            Ok(v) => Some((v, raw)),
            Err(error) => {
                let object = raw
                    .pointer("/metadata/name")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                tracing::debug!(
                    kind = rt.kind,
                    object,
                    %error,
                    "cluster model skips an object it cannot read"
                );
                None
            }
        })
        .collect()
}

/// Logs the outcome of a model write; returns whether it succeeded.
pub(crate) fn report<T>(
    action: &'static str,
    ns: &str,
    name: &str,
    res: Result<T, ApiError>,
) -> bool {
    match res {
        Ok(_) => {
            tracing::trace!(action, ns, name, "cluster model wrote");
            true
        }
        Err(e) if matches!(e.code, 404 | 409) => {
            tracing::debug!(action, ns, name, error = %e, "cluster model write lost a race; next pass settles it");
            false
        }
        Err(e) => {
            tracing::warn!(action, ns, name, error = %e, "cluster model write failed");
            false
        }
    }
}

/// `obj[path...]` as a mutable object, creating (or replacing non-objects with) empty
/// objects on the way.
pub(crate) fn object_at<'a>(
    obj: &'a mut Value,
    path: &[&str],
) -> &'a mut serde_json::Map<String, Value> {
    let mut cur = obj;
    for key in path {
        if !cur.is_object() {
            *cur = Value::Object(Default::default());
        }
        let map = match cur {
            Value::Object(m) => m,
            _ => unreachable!("made an object above"),
        };
        cur = map
            .entry(key.to_string())
            .or_insert_with(|| Value::Object(Default::default()));
    }
    if !cur.is_object() {
        *cur = Value::Object(Default::default());
    }
    match cur {
        Value::Object(m) => m,
        _ => unreachable!("made an object above"),
    }
}

/// Sets or replaces the condition of `type_` in `status.conditions`, keeping
/// `lastTransitionTime` when the status does not change (as the real controllers do).
pub(crate) fn set_condition(
    obj: &mut Value,
    type_: &str,
    status: &str,
    reason: &str,
    message: &str,
) {
    let now = crate::kube::store::now_rfc3339();
    let st = object_at(obj, &["status"]);
    let conds = st
        .entry("conditions")
        .or_insert_with(|| Value::Array(Vec::new()));
    if !conds.is_array() {
        *conds = Value::Array(Vec::new());
    }
    let Value::Array(list) = conds else {
        return;
    };
    let existing = list
        .iter_mut()
        .find(|c| c.get("type").and_then(Value::as_str) == Some(type_));
    match existing {
        Some(c) => {
            let same_status = c.get("status").and_then(Value::as_str) == Some(status);
            let last = c.get("lastTransitionTime").cloned();
            *c = condition(type_, status, reason, message, &now);
            if same_status && let Some(last) = last {
                c["lastTransitionTime"] = last;
            }
        }
        None => list.push(condition(type_, status, reason, message, &now)),
    }
}

/// One condition; empty `reason` and `message` are left out, as for a plain `Ready=True`.
fn condition(type_: &str, status: &str, reason: &str, message: &str, now: &str) -> Value {
    let mut c = serde_json::json!({ "type": type_, "status": status, "lastTransitionTime": now });
    if !reason.is_empty() {
        c["reason"] = reason.into();
    }
    if !message.is_empty() {
        c["message"] = message.into();
    }
    c
}
