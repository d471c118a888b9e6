//! PATCH bodies: JSON merge patch (RFC 7386), JSON patch (RFC 6902) and a subset of
//! strategic merge patch. Server-side apply is refused with 415.

use serde_json::{Map, Value};

use super::resources::ResourceType;
use super::status::ApiError;

/// The patch flavour, chosen by the request's `Content-Type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PatchKind {
    Merge,
    Json,
    Strategic,
    Apply,
}

impl PatchKind {
    /// Maps a `Content-Type` to a patch kind; anything else is 415.
    pub fn from_content_type(ct: &str) -> Result<Self, ApiError> {
        let base = ct.split(';').next().unwrap_or_default().trim();
        match base {
            "application/merge-patch+json" => Ok(PatchKind::Merge),
            "application/json-patch+json" => Ok(PatchKind::Json),
            "application/strategic-merge-patch+json" => Ok(PatchKind::Strategic),
            "application/apply-patch+yaml" | "application/apply-patch+cbor" => Ok(PatchKind::Apply),
            other => Err(ApiError::unsupported_media_type(other)),
        }
    }
}

/// Applies `body` to `target` in place. On error `target` may be partly patched; callers
/// patch a copy.
pub fn apply(
    kind: PatchKind,
    rt: &ResourceType,
    target: &mut Value,
    body: &[u8],
) -> Result<(), ApiError> {
    match kind {
        PatchKind::Apply => Err(ApiError::new(
            415,
            "server-side apply (application/apply-patch+yaml) is not supported by the lastcall emulator; use a merge or JSON patch",
        )),
        PatchKind::Merge => {
            let p = parse_object(body)?;
            json_patch::merge(target, &p);
            Ok(())
        }
        PatchKind::Strategic => {
            if rt.is_custom() {
                // The real server refuses strategic merge patches on custom resources.
                return Err(ApiError::new(
                    415,
                    format!(
                        "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml (strategic merge patch is not supported for {})",
                        rt.qualified_plural()
                    ),
                ));
            }
            let p = parse_object(body)?;
            strategic_merge(target, &p, "");
            Ok(())
        }
        PatchKind::Json => {
            let p: json_patch::Patch = serde_json::from_slice(body)
                .map_err(|e| ApiError::bad_request(&format!("invalid JSON patch: {e}")))?;
            // As a real server: no causes, and a message that does not say what failed.
            json_patch::patch(target, &p).map_err(|_| {
                let mut err = ApiError::new(
                    422,
                    "the server rejected our request due to an error in our request",
                );
                err.details = Some(serde_json::json!({}));
                err
            })
        }
    }
}

fn parse_object(body: &[u8]) -> Result<Value, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(&format!("invalid patch body: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::bad_request(
            "a merge patch body must be a JSON object",
        ));
    }
    Ok(v)
}

/// The merge key of a list field under strategic merge, for the fields lastcall's
/// callers touch. Lists not named here are replaced, as in a merge patch.
fn merge_key(path: &str, field: &str) -> Option<&'static str> {
    match field {
        "conditions" => Some("type"),
        "containers"
        | "initContainers"
        | "ephemeralContainers"
        | "volumes"
        | "env"
        | "volumeMounts" => {
            if path.ends_with("status") {
                None
            } else {
                Some("name")
            }
        }
        "ownerReferences" => Some("uid"),
        "addresses" if path.ends_with("status") => Some("type"),
        _ => None,
    }
}

/// Strategic merge: a merge patch, except that lists with a merge key merge element by
/// element (`$patch: delete` removes one), and `$`-directives are honoured or dropped.
fn strategic_merge(target: &mut Value, patch: &Value, path: &str) {
    let Some(pmap) = patch.as_object() else {
        *target = patch.clone();
        return;
    };
    if pmap.get("$patch").and_then(Value::as_str) == Some("replace") {
        let mut p = pmap.clone();
        p.remove("$patch");
        *target = Value::Object(p);
        return;
    }
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let Some(tmap) = target.as_object_mut() else {
        return;
    };
    for (k, v) in pmap {
        if k.starts_with('$') {
            continue;
        }
        let child_path = format!("{path}/{k}");
        match v {
            Value::Null => {
                tmap.remove(k);
            }
            Value::Array(items) => match merge_key(path, k) {
                Some(key) => {
                    let cur = tmap
                        .entry(k.clone())
                        .or_insert_with(|| Value::Array(vec![]));
                    merge_list(cur, items, key, &child_path);
                }
                None => {
                    tmap.insert(k.clone(), v.clone());
                }
            },
            Value::Object(_) => {
                let cur = tmap.entry(k.clone()).or_insert(Value::Null);
                strategic_merge(cur, v, &child_path);
            }
            _ => {
                tmap.insert(k.clone(), v.clone());
            }
        }
    }
}

fn merge_list(cur: &mut Value, items: &[Value], key: &str, path: &str) {
    if !cur.is_array() {
        *cur = Value::Array(vec![]);
    }
    let Some(list) = cur.as_array_mut() else {
        return;
    };
    for item in items {
        let Some(k) = item.get(key) else {
            list.push(item.clone());
            continue;
        };
        let pos = list.iter().position(|e| e.get(key) == Some(k));
        let delete = item.get("$patch").and_then(Value::as_str) == Some("delete");
        match (pos, delete) {
            (Some(i), true) => {
                list.remove(i);
            }
            (None, true) => {}
            (Some(i), false) => strategic_merge(&mut list[i], item, path),
            (None, false) => {
                let mut e = Value::Null;
                strategic_merge(&mut e, item, path);
                list.push(e);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kube::resources::PODS;
    use serde_json::json;

    #[test]
    fn strategic_merges_conditions_by_type() {
        let mut pod = json!({"status": {"conditions": [{"type": "Ready", "status": "False"}, {"type": "X", "status": "True"}]}});
        let body = json!({"status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "X", "$patch": "delete"}]}});
        apply(
            PatchKind::Strategic,
            &PODS,
            &mut pod,
            body.to_string().as_bytes(),
        )
        .unwrap();
        assert_eq!(
            pod,
            json!({"status": {"conditions": [{"type": "Ready", "status": "True"}]}})
        );
    }
}
