//! The AWS JSON 1.1 protocol, which the GameLift model still lists beside RPC v2 CBOR and
//! which boto3 and other JSON-speaking tools use:
//! - request: `POST /`, `X-Amz-Target: GameLift.<Operation>`,
//!   `Content-Type: application/x-amz-json-1.1`, body a JSON object (members by name);
//! - success: 200, the same content type, a JSON object; timestamps are epoch seconds
//!   as numbers; an operation without output answers `{}`;
//! - error: non-2xx, a JSON object `{"__type": "<ErrorName>", "message": "..."}`.
//!
//! The operations, faults, validation and journal are the ones the CBOR front uses.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::ops::{ApiError, Reply};
use super::{Shared, cbor};

/// The JSON 1.1 content type.
pub(crate) const CONTENT_TYPE: &str = "application/x-amz-json-1.1";
/// The target prefix of every GameLift operation (`GameLift.RegisterGameServer`).
pub(crate) const TARGET_PREFIX: &str = "GameLift.";

/// The operation named by `X-Amz-Target` and the decoded body.
fn decode(headers: &HeaderMap, body: &[u8]) -> (String, Result<Value, ApiError>) {
    let target = headers
        .get("x-amz-target")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let Some(op) = target.strip_prefix(TARGET_PREFIX).filter(|o| !o.is_empty()) else {
        return (
            "/".to_string(),
            Err(ApiError::new(
                400,
                "UnknownOperationException",
                format!("X-Amz-Target {target:?} does not name a GameLift operation"),
            )),
        );
    };
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let input = if content_type != CONTENT_TYPE {
        Err(ApiError::serialization(format!(
            "content-type must be {CONTENT_TYPE}, got {content_type:?}"
        )))
    } else if body.iter().all(u8::is_ascii_whitespace) {
        Ok(json!({}))
    } else {
        match serde_json::from_slice::<Value>(body) {
            Ok(v @ Value::Object(_)) => Ok(v),
            Ok(_) => Err(ApiError::serialization("body is JSON but not an object")),
            Err(e) => Err(ApiError::serialization(format!("body is not JSON: {e}"))),
        }
    };
    (op.to_string(), input)
}

/// `POST /` with `X-Amz-Target`.
pub(crate) async fn operation(
    State(shared): State<Shared>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (op, decoded) = decode(&headers, &body);
    let (seq, result) = if op == "/" {
        // Not an operation: journal it under the path, like the CBOR front's fallback.
        let result = decoded.map(|_| None);
        let now = std::time::SystemTime::now();
        let seq = super::record(&mut super::lock(&shared), now, op, Value::Null, &result);
        (seq, result)
    } else {
        super::run(&shared, op, decoded).await
    };
    reply(seq, result)
}

fn reply(seq: u64, result: Result<Reply, ApiError>) -> Response {
    let (status, body) = match result {
        Ok(Some(value)) => (StatusCode::OK, cbor::reply_to_json(&value)),
        Ok(None) => (StatusCode::OK, json!({})),
        Err(e) => (
            StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            json!({ "__type": e.code, "message": e.message }),
        ),
    };
    let mut response = (status, body.to_string()).into_response();
    let h = response.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE));
    if let Ok(id) = HeaderValue::from_str(&format!("lastcall-emulator-{seq}")) {
        h.insert("x-amzn-requestid", id);
    }
    response
}
