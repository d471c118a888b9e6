//! API errors as the real server reports them: a `metav1.Status` with `reason` and `code`.
//!
//! Clients branch on `reason` and `code` (kube-rs surfaces them as `ErrorResponse`), so
//! every failure the emulator produces goes through this type.

use serde_json::{Value, json};

/// A failed API call; [`ApiError::to_status`] renders the `Status` body the server sends.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{code} {reason}: {message}")]
pub struct ApiError {
    pub code: u16,
    pub reason: String,
    pub message: String,
    pub details: Option<Value>,
}

/// Splits a qualified resource (`gameservers.agones.dev`) into `details` `{kind, group}`.
fn resource_details(resource: &str, name: &str) -> Value {
    let (kind, group) = match resource.split_once('.') {
        Some((k, g)) => (k, g),
        None => (resource, ""),
    };
    let mut d = json!({ "name": name, "kind": kind });
    if !group.is_empty() {
        d["group"] = json!(group);
    }
    d
}

impl ApiError {
    /// A Status with an arbitrary code, the reason the real server pairs with it.
    pub fn new(code: u16, message: impl Into<String>) -> Self {
        let reason = match code {
            400 => "BadRequest",
            401 => "Unauthorized",
            403 => "Forbidden",
            404 => "NotFound",
            405 => "MethodNotAllowed",
            406 => "NotAcceptable",
            409 => "Conflict",
            410 => "Expired",
            415 => "UnsupportedMediaType",
            422 => "Invalid",
            429 => "TooManyRequests",
            503 => "ServiceUnavailable",
            504 => "Timeout",
            _ if code >= 500 => "InternalError",
            _ => "Unknown",
        };
        ApiError {
            code,
            reason: reason.to_string(),
            message: message.into(),
            details: None,
        }
    }

    /// 404 for a named object; `kind` is the qualified resource (`pods`, `gameservers.agones.dev`).
    pub fn not_found(kind: &str, name: &str) -> Self {
        ApiError {
            code: 404,
            reason: "NotFound".into(),
            message: format!("{kind} {name:?} not found"),
            details: Some(resource_details(kind, name)),
        }
    }

    /// 409 Conflict (stale resourceVersion, failed precondition).
    pub fn conflict(kind: &str, name: &str, msg: &str) -> Self {
        ApiError {
            code: 409,
            reason: "Conflict".into(),
            message: format!("Operation cannot be fulfilled on {kind} {name:?}: {msg}"),
            details: Some(resource_details(kind, name)),
        }
    }

    /// 409 AlreadyExists on a duplicate create.
    pub fn already_exists(kind: &str, name: &str) -> Self {
        ApiError {
            code: 409,
            reason: "AlreadyExists".into(),
            message: format!("{kind} {name:?} already exists"),
            details: Some(resource_details(kind, name)),
        }
    }

    /// 422 Invalid; `kind` is the object kind (`Pod`, `GameServer.agones.dev`).
    pub fn invalid(kind: &str, name: &str, msg: &str) -> Self {
        let mut details = resource_details(kind, name);
        details["causes"] = json!([{ "reason": "FieldValueInvalid", "message": msg }]);
        ApiError {
            code: 422,
            reason: "Invalid".into(),
            message: format!("{kind} {name:?} is invalid: {msg}"),
            details: Some(details),
        }
    }

    /// 422 Invalid listing several field errors (`field: message` each), worded as the
    /// server joins them: one error as is, more in brackets.
    pub fn invalid_list(kind: &str, name: &str, errs: &[String]) -> Self {
        let mut details = resource_details(kind, name);
        let causes: Vec<Value> = errs
            .iter()
            .map(|e| {
                let (field, msg) = e.split_once(": ").unwrap_or(("", e.as_str()));
                let reason = if msg.starts_with("Duplicate value") {
                    "FieldValueDuplicate"
                } else if msg.starts_with("Forbidden") {
                    "FieldValueForbidden"
                } else if msg.starts_with("Required value") {
                    "FieldValueRequired"
                } else if msg.starts_with("Unsupported value") {
                    "FieldValueNotSupported"
                } else {
                    "FieldValueInvalid"
                };
                json!({ "reason": reason, "message": msg, "field": field })
            })
            .collect();
        details["causes"] = Value::Array(causes);
        let joined = match errs {
            [one] => one.clone(),
            many => format!("[{}]", many.join(", ")),
        };
        ApiError {
            code: 422,
            reason: "Invalid".into(),
            message: format!("{kind} {name:?} is invalid: {joined}"),
            details: Some(details),
        }
    }

    pub fn bad_request(msg: &str) -> Self {
        ApiError::new(400, msg)
    }

    pub fn too_many_requests(msg: &str) -> Self {
        ApiError::new(429, msg)
    }

    /// 410 with reason `Expired`: a watch or continue token older than the kept history.
    pub fn gone(msg: &str) -> Self {
        ApiError::new(410, msg)
    }

    pub fn internal(msg: &str) -> Self {
        let mut e = ApiError::new(500, format!("Internal error occurred: {msg}"));
        e.details = Some(json!({ "causes": [{ "message": msg }] }));
        e
    }

    pub fn unsupported_media_type(content_type: &str) -> Self {
        ApiError::new(
            415,
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/strategic-merge-patch+json (got {content_type:?})"
            ),
        )
    }

    pub fn method_not_allowed(msg: &str) -> Self {
        ApiError::new(405, msg)
    }

    /// The `metav1.Status` body for this error.
    pub fn to_status(&self) -> Value {
        let mut s = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let Some(d) = &self.details {
            s["details"] = d.clone();
        }
        s
    }
}

/// A `Status` with `status: Success` (eviction and non-pod deletes answer with one).
pub fn success_status(code: Option<u16>, details: Option<Value>) -> Value {
    let mut s = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success",
    });
    if let Some(c) = code {
        s["code"] = json!(c);
    }
    if let Some(d) = details {
        s["details"] = d;
    }
    s
}
