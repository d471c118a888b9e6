//! The Smithy RPC v2 CBOR codec, as far as the emulated operations need it.
//!
//! Requests are decoded into `serde_json::Value` so handlers and the call journal can
//! work with ordinary JSON; replies are built as `ciborium::Value` because they need
//! what JSON cannot express (tag 1 epoch-second timestamps).

use std::time::{SystemTime, UNIX_EPOCH};

use ciborium::Value;

/// Smithy namespace of the GameLift service; error `__type`s are shape ids in it.
pub(crate) const NAMESPACE: &str = "com.amazonaws.gamelift";

/// A request body that is not one CBOR map.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DecodeError {
    /// The bytes are not CBOR.
    #[error("body is not CBOR: {0}")]
    Cbor(String),
    /// The body decoded to something other than a map (every operation input is a structure).
    #[error("body is CBOR but not a map")]
    NotAMap,
    /// A map key is not a text string (Smithy structures only use text keys).
    #[error("map key is not a text string")]
    NonTextKey,
}

/// Decodes a request body. An empty body stands for an empty input structure.
pub(crate) fn decode_request(body: &[u8]) -> Result<serde_json::Value, DecodeError> {
    if body.is_empty() {
        return Ok(serde_json::Value::Object(serde_json::Map::new()));
    }
    let value: Value = ciborium::from_reader(body).map_err(|e| DecodeError::Cbor(e.to_string()))?;
    if !value.is_map() {
        return Err(DecodeError::NotAMap);
    }
    to_json(value)
}

/// CBOR → JSON. Tags are dropped (a tag 1 timestamp becomes its number), byte strings
/// become arrays of numbers: no emulated input carries either.
fn to_json(value: Value) -> Result<serde_json::Value, DecodeError> {
    Ok(match value {
        Value::Null => serde_json::Value::Null,
        Value::Bool(b) => serde_json::Value::Bool(b),
        Value::Integer(i) => {
            let i = i128::from(i);
            if let Ok(v) = i64::try_from(i) {
                serde_json::Value::from(v)
            } else if let Ok(v) = u64::try_from(i) {
                serde_json::Value::from(v)
            } else {
                serde_json::Value::from(i as f64)
            }
        }
        Value::Float(f) => serde_json::Value::from(f),
        Value::Text(s) => serde_json::Value::String(s),
        Value::Bytes(b) => serde_json::Value::from(b),
        Value::Array(items) => {
            serde_json::Value::Array(items.into_iter().map(to_json).collect::<Result<_, _>>()?)
        }
        Value::Map(entries) => {
            let mut map = serde_json::Map::new();
            for (k, v) in entries {
                let Value::Text(k) = k else {
                    return Err(DecodeError::NonTextKey);
                };
                map.insert(k, to_json(v)?);
            }
            serde_json::Value::Object(map)
        }
        Value::Tag(_, inner) => to_json(*inner)?,
        _ => serde_json::Value::Null,
    })
}

/// A reply as AWS JSON: timestamps (tag 1) become their epoch-seconds number, which is
/// how the JSON protocols carry them. Replies are built by the emulator with text keys
/// only, so nothing is lost.
pub(crate) fn reply_to_json(value: &Value) -> serde_json::Value {
    to_json(value.clone()).unwrap_or_else(|_| serde_json::json!({}))
}

/// Encodes a reply. Encoding an in-memory `Value` into a `Vec` cannot fail in practice;
/// should it, the reply is an empty map rather than a panic inside the server.
pub(crate) fn encode(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    if ciborium::into_writer(value, &mut out).is_err() {
        out = vec![0xa0];
    }
    out
}

/// A Smithy `timestamp`: tag 1 around epoch seconds (a float, so sub-second precision survives).
pub(crate) fn timestamp(t: SystemTime) -> Value {
    let secs = match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_secs_f64(),
        Err(e) => -e.duration().as_secs_f64(),
    };
    Value::Tag(1, Box::new(Value::Float(secs)))
}

/// A text value.
pub(crate) fn text(s: impl Into<String>) -> Value {
    Value::Text(s.into())
}

/// A structure from `(member, value)` pairs; members whose value is `None` are left out,
/// the way a real service omits unset optional members.
pub(crate) fn structure<'a>(members: impl IntoIterator<Item = (&'a str, Option<Value>)>) -> Value {
    Value::Map(
        members
            .into_iter()
            .filter_map(|(k, v)| v.map(|v| (text(k), v)))
            .collect(),
    )
}

/// An error body: `__type` as a full shape id plus `Message`. The SDK's rpcv2Cbor error
/// parser (`cbor_errors::parse_error_metadata`) strips everything up to `#`, so the
/// operation error enums match on the bare name.
pub(crate) fn error_body(code: &str, message: &str) -> Vec<u8> {
    encode(&structure([
        ("__type", Some(text(format!("{NAMESPACE}#{code}")))),
        ("Message", Some(text(message))),
    ]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indefinite_map_decodes() {
        // {_ "GameServerId": "gs-1", "Limit": 5 } with an indefinite-length map, as the SDK encodes it
        let mut body = vec![0xbf];
        body.extend([0x6c]);
        body.extend(b"GameServerId");
        body.extend([0x64]);
        body.extend(b"gs-1");
        body.extend([0x65]);
        body.extend(b"Limit");
        body.push(0x05);
        body.push(0xff);
        let json = decode_request(&body).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"GameServerId": "gs-1", "Limit": 5})
        );
    }

    #[test]
    fn non_map_is_rejected() {
        assert!(matches!(decode_request(&[0x01]), Err(DecodeError::NotAMap)));
        assert!(matches!(
            decode_request(&[0xff, 0xff]),
            Err(DecodeError::Cbor(_))
        ));
    }

    #[test]
    fn timestamp_is_tag_1() {
        let bytes = encode(&timestamp(
            UNIX_EPOCH + std::time::Duration::from_millis(1500),
        ));
        assert_eq!(bytes[0], 0xc1);
    }
}
