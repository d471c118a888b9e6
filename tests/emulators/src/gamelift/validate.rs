//! The service model's input constraints, checked before an operation runs.
//!
//! Taken from the GameLift model (`gamelift` 2015-10-01, as botocore and the Smithy model
//! ship it): required members, string lengths, patterns, list sizes, ranges and enums. A
//! violation is answered the way AWS answers a request that fails its model,
//! `ValidationException` (HTTP 400) with a message listing every violation; that error is
//! one of the errors common to all AWS APIs, so no GameLift operation models it and the
//! Rust SDK surfaces it as an unhandled error whose `code()` is `ValidationException`.
//! Business rules (an unknown group, a second registration) stay in `ops`.

use serde_json::Value as Json;

use super::ops::ApiError;

/// `GameServerInstanceId`: exactly 19 characters, `^i-[0-9a-zA-Z]{17}$`.
pub const INSTANCE_ID_PATTERN: &str = "^i-[0-9a-zA-Z]{17}$";
/// `GameServerId`: 3..=128 characters of `[a-zA-Z0-9-\.]+`.
pub const GAME_SERVER_ID_PATTERN: &str = "[a-zA-Z0-9-\\.]+";
/// `GameServerGroupNameOrArn`: 1..=256 characters.
pub const GROUP_PATTERN: &str = "[a-zA-Z0-9-\\.]+|^arn:.*:gameservergroup\\/[a-zA-Z0-9-\\.]+";
/// `GameServerConnectionInfo` (1..=512) and `GameServerData` (1..=1024).
pub const NON_BLANK_PATTERN: &str = ".*\\S.*";

fn id_chars(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.')
}

/// Whether `id` is an EC2 instance id the service accepts (`i-` and 17 alphanumerics).
pub fn instance_id_ok(id: &str) -> bool {
    id.len() == 19 && id.starts_with("i-") && id[2..].chars().all(|c| c.is_ascii_alphanumeric())
}

fn group_ok(s: &str) -> bool {
    if id_chars(s) {
        return true;
    }
    s.starts_with("arn:")
        && s.rfind(":gameservergroup/")
            .is_some_and(|i| id_chars(&s[i + ":gameservergroup/".len()..]))
}

/// Collects violations in the wording AWS uses
/// ("Value 'x' at 'instanceId' failed to satisfy constraint: ...").
#[derive(Default)]
struct Violations(Vec<String>);

impl Violations {
    fn add(&mut self, value: &Json, member: &str, constraint: &str) {
        let shown = match value {
            Json::Null => "null".to_string(),
            Json::String(s) => format!("'{s}'"),
            other => format!("'{other}'"),
        };
        self.0.push(format!(
            "Value {shown} at '{}' failed to satisfy constraint: {constraint}",
            lower_camel(member)
        ));
    }

    fn into_result(self) -> Result<(), ApiError> {
        if self.0.is_empty() {
            return Ok(());
        }
        let n = self.0.len();
        let noun = if n == 1 { "error" } else { "errors" };
        Err(ApiError::new(
            400,
            "ValidationException",
            format!("{n} validation {noun} detected: {}", self.0.join("; ")),
        ))
    }

    /// A string member: presence (if `required`), type, length and pattern.
    fn string(
        &mut self,
        input: &Json,
        member: &str,
        required: bool,
        len: (usize, usize),
        pattern: (&str, fn(&str) -> bool),
    ) {
        match input.get(member) {
            None | Some(Json::Null) => {
                if required {
                    self.add(&Json::Null, member, "Member must not be null");
                }
            }
            Some(v @ Json::String(s)) => self.text(v, s, member, len, pattern),
            // Wrong types are a decoding failure, reported by the operation itself.
            Some(_) => {}
        }
    }

    fn text(
        &mut self,
        v: &Json,
        s: &str,
        member: &str,
        (min, max): (usize, usize),
        (pattern, ok): (&str, fn(&str) -> bool),
    ) {
        let n = s.chars().count();
        if n < min {
            self.add(
                v,
                member,
                &format!("Member must have length greater than or equal to {min}"),
            );
        } else if n > max {
            self.add(
                v,
                member,
                &format!("Member must have length less than or equal to {max}"),
            );
        }
        if !ok(s) {
            self.add(
                v,
                member,
                &format!("Member must satisfy regular expression pattern: {pattern}"),
            );
        }
    }

    fn enumeration(&mut self, input: &Json, member: &str, allowed: &[&str]) {
        if let Some(v @ Json::String(s)) = input.get(member)
            && !allowed.contains(&s.as_str())
        {
            self.add(
                v,
                member,
                &format!(
                    "Member must satisfy enum value set: [{}]",
                    allowed.join(", ")
                ),
            );
        }
    }
}

/// `GameServerGroupName` → `gameServerGroupName`, as AWS names members in these messages.
fn lower_camel(member: &str) -> String {
    let mut c = member.chars();
    match c.next() {
        Some(f) => f.to_ascii_lowercase().to_string() + c.as_str(),
        None => String::new(),
    }
}

fn any_text(_: &str) -> bool {
    true
}

fn non_blank(s: &str) -> bool {
    s.chars().any(|c| !c.is_whitespace())
}

fn group(v: &mut Violations, input: &Json) {
    v.string(
        input,
        "GameServerGroupName",
        true,
        (1, 256),
        (GROUP_PATTERN, group_ok),
    );
}

fn game_server_id(v: &mut Violations, input: &Json, required: bool) {
    v.string(
        input,
        "GameServerId",
        required,
        (3, 128),
        (GAME_SERVER_ID_PATTERN, id_chars),
    );
}

fn game_server_data(v: &mut Violations, input: &Json) {
    v.string(
        input,
        "GameServerData",
        false,
        (1, 1024),
        (NON_BLANK_PATTERN, non_blank),
    );
}

/// Checks `input` against the model's constraints for `op`. Unknown operations pass
/// (the dispatcher refuses them).
pub(crate) fn input(op: &str, input: &Json) -> Result<(), ApiError> {
    let mut v = Violations::default();
    match op {
        "RegisterGameServer" => {
            group(&mut v, input);
            game_server_id(&mut v, input, true);
            v.string(
                input,
                "InstanceId",
                true,
                (19, 19),
                (INSTANCE_ID_PATTERN, instance_id_ok),
            );
            v.string(
                input,
                "ConnectionInfo",
                false,
                (1, 512),
                (NON_BLANK_PATTERN, non_blank),
            );
            game_server_data(&mut v, input);
        }
        "ClaimGameServer" => {
            group(&mut v, input);
            game_server_id(&mut v, input, false);
            game_server_data(&mut v, input);
            if let Some(Json::Array(items)) = input
                .get("FilterOption")
                .and_then(|f| f.get("InstanceStatuses"))
            {
                for item in items {
                    if let Json::String(s) = item
                        && s != "ACTIVE"
                        && s != "DRAINING"
                    {
                        v.add(
                            item,
                            "FilterOption.InstanceStatuses.member",
                            "Member must satisfy enum value set: [ACTIVE, DRAINING]",
                        );
                    }
                }
            }
        }
        "UpdateGameServer" => {
            group(&mut v, input);
            game_server_id(&mut v, input, true);
            game_server_data(&mut v, input);
            v.enumeration(input, "UtilizationStatus", &["AVAILABLE", "UTILIZED"]);
            v.enumeration(input, "HealthCheck", &["HEALTHY"]);
        }
        "DeregisterGameServer" | "DescribeGameServer" => {
            group(&mut v, input);
            game_server_id(&mut v, input, true);
        }
        "DescribeGameServerInstances" => {
            group(&mut v, input);
            if let Some(ids @ Json::Array(items)) = input.get("InstanceIds") {
                if items.is_empty() {
                    v.add(
                        ids,
                        "InstanceIds",
                        "Member must have length greater than or equal to 1",
                    );
                } else if items.len() > super::MAX_INSTANCE_IDS {
                    v.add(
                        ids,
                        "InstanceIds",
                        &format!(
                            "Member must have length less than or equal to {}",
                            super::MAX_INSTANCE_IDS
                        ),
                    );
                }
                for item in items {
                    if let Json::String(s) = item {
                        v.text(
                            item,
                            s,
                            "InstanceIds.member",
                            (19, 19),
                            (INSTANCE_ID_PATTERN, instance_id_ok),
                        );
                    }
                }
            }
            if let Some(limit) = input.get("Limit").filter(|l| !l.is_null())
                && limit.as_i64().is_none_or(|n| n < 1)
            {
                v.add(
                    limit,
                    "Limit",
                    "Member must have value greater than or equal to 1",
                );
            }
            v.string(input, "NextToken", false, (1, 1024), ("", any_text));
        }
        _ => {}
    }
    v.into_result()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn instance_ids() {
        assert!(instance_id_ok("i-0123456789abcdef0"));
        assert!(instance_id_ok("i-0ABCDEFabcdef0123"));
        assert!(!instance_id_ok("i-n1"));
        assert!(!instance_id_ok("i-0123456789abcdef"));
        assert!(!instance_id_ok("i-0123456789abcdef01"));
        assert!(!instance_id_ok("x-0123456789abcdef0"));
        assert!(!instance_id_ok("i-0123456789abcdef-"));
    }

    #[test]
    fn groups_take_names_and_arns() {
        assert!(group_ok("g1"));
        assert!(group_ok("my.group-1"));
        assert!(group_ok(
            "arn:aws:gamelift:us-west-2:123456789012:gameservergroup/g1"
        ));
        assert!(!group_ok("g 1"));
        assert!(!group_ok("arn:aws:gamelift:us-west-2:1:gameservergroup/"));
    }

    #[test]
    fn every_violation_is_listed() {
        let e = input(
            "RegisterGameServer",
            &json!({"GameServerGroupName": "g1", "GameServerId": "x", "InstanceId": "i-n1"}),
        )
        .unwrap_err();
        assert_eq!(e.code, "ValidationException");
        assert_eq!(e.status, 400);
        assert!(
            e.message.starts_with("3 validation errors detected: "),
            "{}",
            e.message
        );
        assert!(e.message.contains(
            "Value 'i-n1' at 'instanceId' failed to satisfy constraint: Member must satisfy regular expression pattern: ^i-[0-9a-zA-Z]{17}$"
        ));
        assert!(e.message.contains("Value 'x' at 'gameServerId' failed to satisfy constraint: Member must have length greater than or equal to 3"));
        let e = input("DescribeGameServer", &json!({"GameServerGroupName": "g1"})).unwrap_err();
        assert!(
            e.message.contains("Value null at 'gameServerId'"),
            "{}",
            e.message
        );
        assert!(input(
            "RegisterGameServer",
            &json!({"GameServerGroupName": "g1", "GameServerId": "gs-1", "InstanceId": "i-0123456789abcdef0"})
        )
        .is_ok());
    }
}
