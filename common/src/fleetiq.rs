//! The FleetIQ instance-status message that pubsub publishes and the agent consumes.
//!
//! The channel is the bare EC2 instance id and the body is the JSON form of GameLift's
//! `GameServerInstance`, exactly as the original adapter wrote it. Publishing reproduces the
//! original Python publisher byte for byte; parsing accepts the Python and the Go forms (any key
//! order, `null` for absent, extra keys) and rejects everything else with a typed error.

use std::fmt;

use serde_json::Value;

/// Largest body the agent will even try to parse. Real messages are about 200 bytes.
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024;

/// Redis key under which pubsub caches an instance's last message, so an agent that
/// (re)subscribes learns the current status at once instead of waiting a whole period.
/// The channel itself stays the bare instance id, as in the original adapter.
pub fn cache_key(instance_id: &str) -> String {
    format!("lastcall:status:{instance_id}")
}

/// Redis key beside [`cache_key`] holding when pubsub polled the cached status (Unix
/// milliseconds, decimal). The message bytes stay exactly the original's, so ordering
/// lives here: pubsub writes a status only if it was polled no earlier than the one held,
/// and agents read it to tell a live-but-unchanged pubsub from a dead one, and to compare
/// the cache with what their own GameLift fallback learned.
pub fn polled_at_key(instance_id: &str) -> String {
    format!("lastcall:polled_at:{instance_id}")
}

/// FleetIQ's viability verdict for one instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum InstanceStatus {
    Active,
    Draining,
    SpotTerminating,
}

impl InstanceStatus {
    pub const ALL: [InstanceStatus; 3] = [Self::Active, Self::Draining, Self::SpotTerminating];

    /// The API's spelling, used on the wire and as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Active => "ACTIVE",
            Self::Draining => "DRAINING",
            Self::SpotTerminating => "SPOT_TERMINATING",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "ACTIVE" => Some(Self::Active),
            "DRAINING" => Some(Self::Draining),
            "SPOT_TERMINATING" => Some(Self::SpotTerminating),
            _ => None,
        }
    }
}

impl fmt::Display for InstanceStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One instance's status, as carried on its Redis channel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatusMessage {
    pub group_name: Option<String>,
    pub group_arn: Option<String>,
    pub instance_id: String,
    pub status: InstanceStatus,
}

/// Why a message was rejected. Each variant maps to a fixed metric label.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("message is {0} bytes, over the {MAX_MESSAGE_BYTES}-byte limit")]
    Oversize(usize),
    #[error("message is not valid JSON: {0}")]
    Json(String),
    #[error("message is not a JSON object")]
    NotObject,
    #[error("field {0} is missing or null")]
    MissingField(&'static str),
    #[error("field {0} is not a string")]
    WrongType(&'static str),
    #[error("unknown InstanceStatus {0:?}")]
    UnknownStatus(String),
    /// The same key twice (for example `InstanceStatus` ACTIVE then DRAINING). JSON parsers
    /// disagree on which one wins, so such a message is suspicious and never acted on.
    #[error("duplicate key {0:?}")]
    DuplicateKey(String),
}

impl ParseError {
    /// Bounded label for `reason` in rejection metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Oversize(_) => "oversize",
            Self::Json(_) => "invalid_json",
            Self::NotObject => "not_object",
            Self::MissingField(_) => "missing_field",
            Self::WrongType(_) => "wrong_type",
            Self::UnknownStatus(_) => "unknown_status",
            Self::DuplicateKey(_) => "duplicate_key",
        }
    }
}

const KEY_GROUP_NAME: &str = "GameServerGroupName";
const KEY_GROUP_ARN: &str = "GameServerGroupArn";
const KEY_INSTANCE_ID: &str = "InstanceId";
const KEY_STATUS: &str = "InstanceStatus";

impl StatusMessage {
    /// Parses a message body in either publisher's form.
    pub fn parse(body: &[u8]) -> Result<Self, ParseError> {
        if body.len() > MAX_MESSAGE_BYTES {
            return Err(ParseError::Oversize(body.len()));
        }
        let value: Value =
            serde_json::from_slice(body).map_err(|e| ParseError::Json(e.to_string()))?;
        let obj = value.as_object().ok_or(ParseError::NotObject)?;
        if let Some(key) = first_duplicate_key(body) {
            return Err(ParseError::DuplicateKey(trim_for_log(&key, 64)));
        }
        let opt_str = |key: &'static str| -> Result<Option<String>, ParseError> {
            match obj.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(_) => Err(ParseError::WrongType(key)),
            }
        };
        let instance_id = opt_str(KEY_INSTANCE_ID)?
            .filter(|s| !s.is_empty())
            .ok_or(ParseError::MissingField(KEY_INSTANCE_ID))?;
        let status_raw = opt_str(KEY_STATUS)?.ok_or(ParseError::MissingField(KEY_STATUS))?;
        let status = InstanceStatus::parse(&status_raw)
            .ok_or_else(|| ParseError::UnknownStatus(trim_for_log(&status_raw, 64)))?;
        Ok(Self {
            group_name: opt_str(KEY_GROUP_NAME)?,
            group_arn: opt_str(KEY_GROUP_ARN)?,
            instance_id,
            status,
        })
    }

    /// The original Python publisher's bytes: `json.dumps` of the botocore dict, i.e. model key
    /// order, `", "` and `": "` separators, absent fields omitted, non-ASCII escaped.
    pub fn to_python_json(&self) -> String {
        python_json(
            self.group_name.as_deref(),
            self.group_arn.as_deref(),
            &self.instance_id,
            self.status.as_str(),
        )
    }

    /// The Go port's form: compact, `null` for absent fields. Offered for consumers that
    /// were written against it.
    pub fn to_go_json(&self) -> String {
        serde_json::json!({
            KEY_GROUP_ARN: self.group_arn,
            KEY_GROUP_NAME: self.group_name,
            KEY_INSTANCE_ID: self.instance_id,
            KEY_STATUS: self.status.as_str(),
        })
        .to_string()
    }
}

/// The original Python publisher's bytes for any status string, including ones this
/// version does not know: the original published whatever GameLift returned.
pub fn python_json(
    group_name: Option<&str>,
    group_arn: Option<&str>,
    instance_id: &str,
    status: &str,
) -> String {
    let mut out = String::with_capacity(160);
    out.push('{');
    let mut first = true;
    let mut field = |key: &str, value: &str| {
        if !first {
            out.push_str(", ");
        }
        first = false;
        push_python_str(&mut out, key);
        out.push_str(": ");
        push_python_str(&mut out, value);
    };
    if let Some(v) = group_name {
        field(KEY_GROUP_NAME, v);
    }
    if let Some(v) = group_arn {
        field(KEY_GROUP_ARN, v);
    }
    field(KEY_INSTANCE_ID, instance_id);
    field(KEY_STATUS, status);
    out.push('}');
    out
}

/// The first key that appears twice in the top-level object of `body`, if any.
/// `serde_json::Value` silently keeps the last one, so this second pass looks for them.
fn first_duplicate_key(body: &[u8]) -> Option<String> {
    use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};

    struct Keys;
    impl<'de> Visitor<'de> for Keys {
        type Value = Option<String>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut seen: Vec<String> = Vec::new();
            let mut dup = None;
            while let Some(key) = map.next_key::<String>()? {
                map.next_value::<IgnoredAny>()?;
                if dup.is_none() && seen.contains(&key) {
                    dup = Some(key.clone());
                }
                seen.push(key);
            }
            Ok(dup)
        }
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    de.deserialize_map(Keys).ok().flatten()
}

/// Writes `s` as Python's `json.dumps` would (with its default `ensure_ascii=True`).
fn push_python_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Shortens untrusted text for a log line, on a char boundary.
pub fn trim_for_log(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…({} bytes)", &s[..end], s.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(status: InstanceStatus) -> StatusMessage {
        StatusMessage {
            group_name: Some("agones-game-server-group-01".into()),
            group_arn: Some(
                "arn:aws:gamelift:us-west-2:123456789012:gameservergroup/agones-game-server-group-01"
                    .into(),
            ),
            instance_id: "i-0123456789abcdef0".into(),
            status,
        }
    }

    #[test]
    fn python_form_is_byte_exact() {
        let expected = r#"{"GameServerGroupName": "agones-game-server-group-01", "GameServerGroupArn": "arn:aws:gamelift:us-west-2:123456789012:gameservergroup/agones-game-server-group-01", "InstanceId": "i-0123456789abcdef0", "InstanceStatus": "DRAINING"}"#;
        assert_eq!(msg(InstanceStatus::Draining).to_python_json(), expected);
    }

    #[test]
    fn python_form_omits_absent_fields_and_escapes_like_python() {
        let m = StatusMessage {
            group_name: Some("g\u{e9}\"\n\u{1F600}".into()),
            group_arn: None,
            instance_id: "i-1".into(),
            status: InstanceStatus::Active,
        };
        assert_eq!(
            m.to_python_json(),
            r#"{"GameServerGroupName": "g\u00e9\"\n\ud83d\ude00", "InstanceId": "i-1", "InstanceStatus": "ACTIVE"}"#
        );
    }

    #[test]
    fn parses_python_go_and_reordered_forms() {
        for status in InstanceStatus::ALL {
            let m = msg(status);
            assert_eq!(
                StatusMessage::parse(m.to_python_json().as_bytes()),
                Ok(m.clone())
            );
            assert_eq!(
                StatusMessage::parse(m.to_go_json().as_bytes()),
                Ok(m.clone())
            );
        }
        let go_nulls = br#"{"GameServerGroupArn":null,"GameServerGroupName":null,"InstanceId":"i-9","InstanceStatus":"SPOT_TERMINATING","Extra":{"x":1}}"#;
        let parsed = StatusMessage::parse(go_nulls).unwrap();
        assert_eq!(parsed.group_arn, None);
        assert_eq!(parsed.status, InstanceStatus::SpotTerminating);
    }

    #[test]
    fn rejects_bad_input_with_typed_errors() {
        let cases: &[(&[u8], &str)] = &[
            (b"not json", "invalid_json"),
            (b"[1,2]", "not_object"),
            (br#"{"InstanceStatus":"ACTIVE"}"#, "missing_field"),
            (br#"{"InstanceId":"i-1"}"#, "missing_field"),
            (
                br#"{"InstanceId":"","InstanceStatus":"ACTIVE"}"#,
                "missing_field",
            ),
            (
                br#"{"InstanceId":"i-1","InstanceStatus":null}"#,
                "missing_field",
            ),
            (
                br#"{"InstanceId":7,"InstanceStatus":"ACTIVE"}"#,
                "wrong_type",
            ),
            (
                br#"{"InstanceId":"i-1","InstanceStatus":["ACTIVE"]}"#,
                "wrong_type",
            ),
            (
                br#"{"InstanceId":"i-1","InstanceStatus":"active"}"#,
                "unknown_status",
            ),
            (
                br#"{"InstanceId":"i-1","InstanceStatus":"EXPLODING"}"#,
                "unknown_status",
            ),
            (
                br#"{"InstanceId":"i-1","InstanceStatus":"ACTIVE","GameServerGroupName":5}"#,
                "wrong_type",
            ),
        ];
        for (body, label) in cases {
            let err = StatusMessage::parse(body).unwrap_err();
            assert_eq!(
                err.metric_label(),
                *label,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        let big = vec![b' '; MAX_MESSAGE_BYTES + 1];
        assert_eq!(
            StatusMessage::parse(&big).unwrap_err().metric_label(),
            "oversize"
        );
    }

    #[test]
    fn duplicate_keys_are_rejected_whichever_comes_last() {
        for body in [
            br#"{"InstanceId":"i-1","InstanceStatus":"ACTIVE","InstanceStatus":"DRAINING"}"#
                .as_slice(),
            br#"{"InstanceId":"i-1","InstanceStatus":"DRAINING","InstanceStatus":"ACTIVE"}"#,
            br#"{"InstanceId":"i-1","InstanceId":"i-2","InstanceStatus":"ACTIVE"}"#,
        ] {
            let err = StatusMessage::parse(body).unwrap_err();
            assert_eq!(err.metric_label(), "duplicate_key", "{err}");
        }
        // Nested duplicates are not ours to judge; distinct keys pass.
        let ok = br#"{"InstanceId":"i-1","InstanceStatus":"ACTIVE","X":{"a":1,"a":2}}"#;
        assert!(StatusMessage::parse(ok).is_ok());
    }

    #[test]
    fn python_json_carries_unknown_statuses_as_is() {
        assert_eq!(
            python_json(Some("g"), None, "i-1", "HIBERNATING"),
            r#"{"GameServerGroupName": "g", "InstanceId": "i-1", "InstanceStatus": "HIBERNATING"}"#
        );
        assert_eq!(
            StatusMessage::parse(python_json(None, None, "i-1", "HIBERNATING").as_bytes())
                .unwrap_err()
                .metric_label(),
            "unknown_status"
        );
    }

    #[test]
    fn trim_keeps_char_boundaries() {
        assert_eq!(trim_for_log("abc", 10), "abc");
        let t = trim_for_log("ééééé", 3);
        assert!(t.starts_with('é') && t.ends_with("(10 bytes)"), "{t}");
    }
}
