//! Agones' `FleetAutoscaleReview` (autoscaling.agones.dev/v1) on the wire, parsed once at
//! the edge.
//!
//! Agones marshals a Go struct with only `request` and `response` (`"response": null`), so
//! `apiVersion` and `kind` are optional here; when present they must name this contract.
//! Unknown fields (`players`, `counters`, `lists`, whatever comes next) are ignored. Counts
//! are Go int32s: a negative one, or one that does not fit, is rejected, never clamped.

use std::collections::HashMap;

use serde::Deserialize;
use serde_json::Value;

/// The API group and version of the contract.
pub const API_VERSION: &str = "autoscaling.agones.dev/v1";
/// The kind of the contract.
pub const KIND: &str = "FleetAutoscaleReview";

/// A review worth answering.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Review {
    pub uid: String,
    pub name: String,
    pub namespace: String,
    pub replicas: u32,
    pub ready_replicas: u32,
    pub reserved_replicas: u32,
    pub allocated_replicas: u32,
    /// The Fleet's annotations (Agones' `FleetAutoscaleRequestMetaData` feature).
    pub annotations: HashMap<String, String>,
    /// The `apiVersion` the caller sent, echoed back (Agones sends none).
    pub api_version: Option<String>,
}

/// Why a review was refused (HTTP 400). Each variant has a fixed metric label.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReviewError {
    #[error("body is not a FleetAutoscaleReview JSON object: {0}")]
    Json(String),
    #[error("kind is {0:?}, expected \"FleetAutoscaleReview\"")]
    WrongKind(String),
    #[error("apiVersion is {0:?}, expected \"autoscaling.agones.dev/v1\"")]
    WrongApiVersion(String),
    #[error("{0} is missing")]
    Missing(&'static str),
    #[error("{field} is {value}: a Fleet count is a whole number from 0 to 2147483647")]
    BadCount { field: &'static str, value: i64 },
    #[error("{field} {value:?} is not a Kubernetes {rule}")]
    InvalidName {
        field: &'static str,
        value: String,
        rule: &'static str,
    },
}

impl ReviewError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Json(_) => "invalid_json",
            Self::WrongKind(_) => "wrong_kind",
            Self::WrongApiVersion(_) => "wrong_api_version",
            Self::Missing(_) => "missing_field",
            Self::BadCount { .. } => "bad_count",
            Self::InvalidName { .. } => "invalid_name",
        }
    }
}

#[derive(Deserialize)]
struct Wire {
    #[serde(rename = "apiVersion")]
    api_version: Option<String>,
    kind: Option<String>,
    request: Option<WireRequest>,
}

#[derive(Deserialize)]
struct WireRequest {
    uid: Option<String>,
    name: Option<String>,
    namespace: Option<String>,
    status: Option<WireStatus>,
    annotations: Option<HashMap<String, String>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireStatus {
    replicas: Option<i64>,
    ready_replicas: Option<i64>,
    reserved_replicas: Option<i64>,
    allocated_replicas: Option<i64>,
}

fn count(field: &'static str, v: Option<i64>, required: bool) -> Result<u32, ReviewError> {
    match v {
        None if required => Err(ReviewError::Missing(field)),
        None => Ok(0),
        Some(n) => u32::try_from(n)
            .ok()
            .filter(|n| *n <= i32::MAX as u32)
            .ok_or(ReviewError::BadCount { field, value: n }),
    }
}

fn non_empty(field: &'static str, v: Option<String>) -> Result<String, ReviewError> {
    v.filter(|s| !s.is_empty())
        .ok_or(ReviewError::Missing(field))
}

impl Review {
    /// Parses a request body. `replicas` and `allocatedReplicas` are required (the answer
    /// depends on them); the other counts default to 0 as in Go, and are checked when sent.
    pub fn parse(body: &[u8]) -> Result<Review, ReviewError> {
        let wire: Wire = serde_json::from_slice(body).map_err(|e| {
            ReviewError::Json(lastcall_common::fleetiq::trim_for_log(&e.to_string(), 200))
        })?;
        if let Some(kind) = &wire.kind
            && kind != KIND
        {
            return Err(ReviewError::WrongKind(trim(kind)));
        }
        if let Some(v) = &wire.api_version
            && !v.starts_with("autoscaling.agones.dev/")
        {
            return Err(ReviewError::WrongApiVersion(trim(v)));
        }
        let req = wire.request.ok_or(ReviewError::Missing("request"))?;
        let uid = non_empty("request.uid", req.uid)?;
        let name = non_empty("request.name", req.name)?;
        let namespace = non_empty("request.namespace", req.namespace)?;
        // Kubernetes' own limits, so no name a Fleet cannot have is stored, logged at
        // length or echoed.
        check(
            "request.uid",
            &uid,
            is_uid,
            "UID (at most 128 printable ASCII characters)",
        )?;
        check(
            "request.namespace",
            &namespace,
            is_dns_label,
            "namespace (a DNS label: lowercase letters, digits and '-', at most 63)",
        )?;
        check(
            "request.name",
            &name,
            is_dns_subdomain,
            "object name (a DNS subdomain: lowercase letters, digits, '-' and '.', at most 253)",
        )?;
        let status = req.status.ok_or(ReviewError::Missing("request.status"))?;
        Ok(Review {
            uid,
            name,
            namespace,
            replicas: count("request.status.replicas", status.replicas, true)?,
            ready_replicas: count("request.status.readyReplicas", status.ready_replicas, false)?,
            reserved_replicas: count(
                "request.status.reservedReplicas",
                status.reserved_replicas,
                false,
            )?,
            allocated_replicas: count(
                "request.status.allocatedReplicas",
                status.allocated_replicas,
                true,
            )?,
            annotations: req.annotations.unwrap_or_default(),
            api_version: wire.api_version,
        })
    }
}

fn check(
    field: &'static str,
    value: &str,
    valid: fn(&str) -> bool,
    rule: &'static str,
) -> Result<(), ReviewError> {
    if valid(value) {
        return Ok(());
    }
    Err(ReviewError::InvalidName {
        field,
        value: trim(value),
        rule,
    })
}

/// A UID as the API server writes it (a UUID), with room to spare: printable ASCII.
fn is_uid(s: &str) -> bool {
    s.len() <= 128 && s.bytes().all(|b| b.is_ascii_graphic())
}

/// RFC 1123 label (Kubernetes' `IsDNS1123Label`): what a namespace name must be.
pub fn is_dns_label(s: &str) -> bool {
    s.len() <= 63 && is_label_chars(s)
}

/// RFC 1123 subdomain (Kubernetes' `IsDNS1123Subdomain`, whose parts have no length of
/// their own): what a Fleet name must be.
pub fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_label_chars)
}

/// Lowercase letters, digits and `-`, not empty, starting and ending with a letter or digit.
fn is_label_chars(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

fn trim(s: &str) -> String {
    lastcall_common::fleetiq::trim_for_log(s, 64)
}

/// The answer body: the review with `response` set (Agones reads only `response`).
pub fn response_body(api_version: Option<&str>, uid: &str, scale: bool, replicas: u32) -> Vec<u8> {
    let body = serde_json::json!({
        "apiVersion": api_version.unwrap_or(API_VERSION),
        "kind": KIND,
        "response": {"uid": uid, "scale": scale, "replicas": replicas},
    });
    // Serialising a Value of strings, bools and integers cannot fail.
    serde_json::to_vec(&body).unwrap_or_default()
}

/// Decodes an answer, for tests and benchmarks: `(uid, scale, replicas)`.
pub fn parse_response(body: &[u8]) -> Option<(String, bool, i64)> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let r = v.get("response")?;
    Some((
        r.get("uid")?.as_str()?.to_string(),
        r.get("scale")?.as_bool()?,
        r.get("replicas")?.as_i64()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What Agones' controller sends: no apiVersion/kind, `"response": null`, the full
    /// FleetStatus with counters and lists, labels and annotations.
    const AGONES: &str = r#"{
      "request": {
        "uid": "4b0b8a4e-7f3b-11ee-b962-0242ac120002",
        "name": "simple-game",
        "namespace": "default",
        "status": {
          "replicas": 10, "readyReplicas": 3, "reservedReplicas": 0, "allocatedReplicas": 7,
          "players": {"count": 12, "capacity": 100},
          "counters": {"rooms": {"allocatedCount": 4, "allocatedCapacity": 10, "count": 5, "capacity": 20}},
          "lists": {"players": {"allocatedCount": 1, "allocatedCapacity": 10, "count": 2, "capacity": 20}}
        },
        "labels": {"app": "simple-game"},
        "annotations": {"lastcall.dev/autoscaler-buffer": "10%"}
      },
      "response": null
    }"#;

    #[test]
    fn agones_wire_form_parses_with_unknown_fields() {
        let r = Review::parse(AGONES.as_bytes()).unwrap();
        assert_eq!(r.uid, "4b0b8a4e-7f3b-11ee-b962-0242ac120002");
        assert_eq!(
            (r.namespace.as_str(), r.name.as_str()),
            ("default", "simple-game")
        );
        assert_eq!(
            (
                r.replicas,
                r.ready_replicas,
                r.reserved_replicas,
                r.allocated_replicas
            ),
            (10, 3, 0, 7)
        );
        assert_eq!(r.annotations["lastcall.dev/autoscaler-buffer"], "10%");
        assert_eq!(r.api_version, None);
        let typed = r#"{"apiVersion":"autoscaling.agones.dev/v1","kind":"FleetAutoscaleReview","request":{"uid":"u","name":"f","namespace":"n","status":{"replicas":0,"allocatedReplicas":0},"annotations":null}}"#;
        assert!(Review::parse(typed.as_bytes()).is_ok());
    }

    #[test]
    fn bad_reviews_are_refused_with_a_label_and_a_message() {
        let status = r#""status":{"replicas":1,"allocatedReplicas":0}"#;
        let cases: Vec<(String, &str, &str)> = vec![
            ("{not json".into(), "invalid_json", "not a FleetAutoscaleReview"),
            ("[]".into(), "invalid_json", "not a FleetAutoscaleReview"),
            ("{}".into(), "missing_field", "request is missing"),
            (r#"{"request":null}"#.into(), "missing_field", "request is missing"),
            (format!(r#"{{"kind":"AdmissionReview","request":{{"uid":"u","name":"f","namespace":"n",{status}}}}}"#), "wrong_kind", "AdmissionReview"),
            (format!(r#"{{"apiVersion":"v1","request":{{"uid":"u","name":"f","namespace":"n",{status}}}}}"#), "wrong_api_version", "apiVersion"),
            (format!(r#"{{"request":{{"name":"f","namespace":"n",{status}}}}}"#), "missing_field", "request.uid"),
            (format!(r#"{{"request":{{"uid":"","name":"f","namespace":"n",{status}}}}}"#), "missing_field", "request.uid"),
            (format!(r#"{{"request":{{"uid":"u","namespace":"n",{status}}}}}"#), "missing_field", "request.name"),
            (format!(r#"{{"request":{{"uid":"u","name":"f",{status}}}}}"#), "missing_field", "request.namespace"),
            (r#"{"request":{"uid":"u","name":"f","namespace":"n"}}"#.into(), "missing_field", "request.status"),
            (r#"{"request":{"uid":"u","name":"f","namespace":"n","status":{"allocatedReplicas":1}}}"#.into(), "missing_field", "request.status.replicas"),
            (r#"{"request":{"uid":"u","name":"f","namespace":"n","status":{"replicas":1,"allocatedReplicas":-3}}}"#.into(), "bad_count", "allocatedReplicas is -3"),
            (r#"{"request":{"uid":"u","name":"f","namespace":"n","status":{"replicas":2147483648,"allocatedReplicas":0}}}"#.into(), "bad_count", "replicas is 2147483648"),
            (r#"{"request":{"uid":"u","name":"f","namespace":"n","status":{"replicas":1,"allocatedReplicas":0,"readyReplicas":-1}}}"#.into(), "bad_count", "readyReplicas"),
            (r#"{"request":{"uid":"u","name":"f","namespace":"n","status":{"replicas":1.5,"allocatedReplicas":0}}}"#.into(), "invalid_json", "not a FleetAutoscaleReview"),
            (r#"{"request":{"uid":7,"name":"f","namespace":"n","status":{"replicas":1,"allocatedReplicas":0}}}"#.into(), "invalid_json", "not a FleetAutoscaleReview"),
            (format!(r#"{{"request":{{"uid":"u","name":"{}","namespace":"n",{status}}}}}"#, "f".repeat(254)), "invalid_name", "request.name"),
            (format!(r#"{{"request":{{"uid":"u","name":"Simple_Game","namespace":"n",{status}}}}}"#), "invalid_name", "DNS subdomain"),
            (format!(r#"{{"request":{{"uid":"u","name":"a..b","namespace":"n",{status}}}}}"#), "invalid_name", "request.name"),
            (format!(r#"{{"request":{{"uid":"u","name":"f","namespace":"{}",{status}}}}}"#, "n".repeat(64)), "invalid_name", "request.namespace"),
            (format!(r#"{{"request":{{"uid":"u","name":"f","namespace":"a.b",{status}}}}}"#), "invalid_name", "DNS label"),
            (format!(r#"{{"request":{{"uid":"u","name":"f","namespace":"-n",{status}}}}}"#), "invalid_name", "request.namespace"),
            (format!(r#"{{"request":{{"uid":"{}","name":"f","namespace":"n",{status}}}}}"#, "u".repeat(129)), "invalid_name", "request.uid"),
            (format!(r#"{{"request":{{"uid":"a b","name":"f","namespace":"n",{status}}}}}"#), "invalid_name", "request.uid"),
        ];
        for (body, label, text) in cases {
            let err = Review::parse(body.as_bytes()).unwrap_err();
            assert_eq!(err.metric_label(), label, "{body}: {err}");
            assert!(err.to_string().contains(text), "{body}: {err}");
        }
    }

    #[test]
    fn names_follow_kubernetes_rules() {
        for ok in ["a", "simple-game", "a.b-c", &"x".repeat(253)] {
            assert!(is_dns_subdomain(ok), "{ok}");
        }
        for bad in ["", "A", "a_b", "-a", "a-", "a..b", ".a", &"x".repeat(254)] {
            assert!(!is_dns_subdomain(bad), "{bad}");
        }
        assert!(is_dns_label("default") && is_dns_label(&"x".repeat(63)));
        for bad in ["a.b", "", &"x".repeat(64)] {
            assert!(!is_dns_label(bad), "{bad}");
        }
    }

    #[test]
    fn the_response_echoes_the_uid_and_round_trips() {
        let body = response_body(None, "abc", true, 14);
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["kind"], KIND);
        assert_eq!(v["apiVersion"], API_VERSION);
        assert_eq!(v["response"]["replicas"], 14);
        assert_eq!(parse_response(&body), Some(("abc".into(), true, 14)));
    }
}
