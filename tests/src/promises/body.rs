//! What a journaled write asked for, read from its request body whatever its form: a JSON
//! patch (RFC 6902), a merge or strategic merge patch, or a whole object (create, PUT).

use serde_json::Value;

/// The value `body` writes at `path` (object keys from the root): `Some(Value::Null)` when
/// it removes it (or a parent of it), `None` when it does not touch it or only part of it
/// (a JSON patch op below `path`).
pub fn written(body: &Value, path: &[&str]) -> Option<Value> {
    match body {
        Value::Array(ops) => by_json_patch(ops, path),
        Value::Object(_) => {
            let mut v = body;
            for k in path {
                if v.is_null() {
                    return Some(Value::Null);
                }
                v = v.get(k)?;
            }
            Some(v.clone())
        }
        _ => None,
    }
}

/// The last JSON patch op's effect on `path`.
fn by_json_patch(ops: &[Value], path: &[&str]) -> Option<Value> {
    let mut out = None;
    for op in ops {
        let (Some(kind), Some(p)) = (op["op"].as_str(), op["path"].as_str()) else {
            continue;
        };
        let p = pointer(p);
        if p.len() > path.len() || p.iter().zip(path).any(|(a, b)| a != b) {
            continue;
        }
        let rest = &path[p.len()..];
        out = match kind {
            "remove" => Some(Value::Null),
            "add" | "replace" => {
                let mut v = &op["value"];
                for k in rest {
                    v = v.get(k).unwrap_or(&Value::Null);
                }
                Some(v.clone())
            }
            _ => out,
        };
    }
    out
}

/// A JSON pointer's keys, unescaped.
fn pointer(p: &str) -> Vec<String> {
    p.split('/')
        .skip(1)
        .map(|k| k.replace("~1", "/").replace("~0", "~"))
        .collect()
}

/// The `gracePeriodSeconds` a delete-like request asks for: in its `DeleteOptions` (the
/// body, or an Eviction's `deleteOptions`) or its query.
pub fn grace_period_override(body: Option<&Value>, query: &str) -> Option<i64> {
    let from_query = url::form_urlencoded::parse(query.as_bytes())
        .find(|(k, _)| k == "gracePeriodSeconds")
        .and_then(|(_, v)| v.parse().ok());
    from_query.or_else(|| {
        let b = body?;
        let opts = b.get("deleteOptions").unwrap_or(b);
        opts.get("gracePeriodSeconds")?.as_i64()
    })
}

/// The uid precondition of a delete-like request (`preconditions.uid` of its options).
pub fn uid_precondition(body: Option<&Value>) -> Option<&str> {
    let b = body?;
    let opts = b.get("deleteOptions").unwrap_or(b);
    opts.pointer("/preconditions/uid")?.as_str()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_a_value_from_every_form_of_write() {
        let merge = json!({"metadata": {"labels": {"a/b": "true", "c": null}}});
        assert_eq!(
            written(&merge, &["metadata", "labels", "a/b"]),
            Some(json!("true"))
        );
        assert_eq!(
            written(&merge, &["metadata", "labels", "c"]),
            Some(Value::Null)
        );
        assert_eq!(written(&merge, &["metadata", "annotations", "x"]), None);
        let cleared = json!({"metadata": {"labels": null}});
        assert_eq!(
            written(&cleared, &["metadata", "labels", "a/b"]),
            Some(Value::Null)
        );
        let ops = json!([
            {"op": "test", "path": "/metadata/resourceVersion", "value": "3"},
            {"op": "add", "path": "/spec/taints", "value": [{"key": "k"}]},
            {"op": "add", "path": "/metadata/labels/a~1b", "value": "true"},
            {"op": "remove", "path": "/metadata/labels/c"},
        ]);
        assert_eq!(
            written(&ops, &["spec", "taints"]),
            Some(json!([{"key": "k"}]))
        );
        assert_eq!(
            written(&ops, &["metadata", "labels", "a/b"]),
            Some(json!("true"))
        );
        assert_eq!(
            written(&ops, &["metadata", "labels", "c"]),
            Some(Value::Null)
        );
        assert_eq!(written(&ops, &["spec", "unschedulable"]), None);
        let whole = json!([{"op": "add", "path": "/metadata/labels", "value": {"x": "1"}}]);
        assert_eq!(
            written(&whole, &["metadata", "labels", "y"]),
            Some(Value::Null)
        );
        let below = json!([{"op": "add", "path": "/spec/taints/-", "value": {"key": "k"}}]);
        assert_eq!(written(&below, &["spec", "taints"]), None);
    }

    #[test]
    fn reads_delete_options_from_a_delete_and_an_eviction() {
        let delete = json!({"preconditions": {"uid": "u1"}, "gracePeriodSeconds": 0});
        assert_eq!(uid_precondition(Some(&delete)), Some("u1"));
        assert_eq!(grace_period_override(Some(&delete), ""), Some(0));
        let eviction =
            json!({"kind": "Eviction", "deleteOptions": {"preconditions": {"uid": "u2"}}});
        assert_eq!(uid_precondition(Some(&eviction)), Some("u2"));
        assert_eq!(grace_period_override(Some(&eviction), ""), None);
        assert_eq!(
            grace_period_override(Some(&eviction), "gracePeriodSeconds=5"),
            Some(5)
        );
        assert_eq!(uid_precondition(None), None);
    }
}
