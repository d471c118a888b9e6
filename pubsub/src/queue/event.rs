//! The events on the queue, parsed strictly: an SQS message body in, the events to relay (or
//! a reason not to) out. Pure: no I/O, no clock.
//!
//! Accepted, each by a versioned type (EventBridge `version` "0"; the Auto Scaling
//! notification's own fields):
//!
//! | source | detail-type | relayed as |
//! |---|---|---|
//! | `aws.ec2` | `EC2 Spot Instance Interruption Warning` | a Spot interruption (`instance-action`) |
//! | `aws.ec2` | `EC2 Instance Rebalance Recommendation` | a rebalance recommendation |
//! | `aws.ec2` | `EC2 Instance State-change Notification` | `stopping`, `stopped`, `shutting-down`, `terminated`; `pending` and `running` are ignored |
//! | `aws.health` | `AWS Health Event` | service `EC2`, category `scheduledChange`: one event per affected instance, with its `eventArn` and `statusCode` (a `closed` update is relayed too: it withdraws the event); other services and categories are ignored |
//! | `aws.autoscaling` | `EC2 Instance-terminate Lifecycle Action` | a termination lifecycle wait |
//! | `aws.autoscaling` | `EC2 Instance-launch Lifecycle Action` | ignored: a launch is not a disruption |
//! | `aws.ec2` | `EC2 Capacity Reservation Instance Interruption Warning` | a capacity reservation interruption |
//! | – | a raw Auto Scaling notification, or one wrapped by SNS (`Type: Notification`) | as the lifecycle actions above; `autoscaling:TEST_NOTIFICATION` is ignored |
//!
//! Anything else is an error with a bounded label. Bodies are bounded by [`MAX_BODY`]; a
//! Health event's affected entities by [`MAX_ENTITIES`].

use jiff::Timestamp;
use lastcall_common::aws_events::{
    Event, HealthStatus, InstanceState, MAX_FIELD, Relayed, SpotAction, is_instance_id,
};
use serde::Deserialize;
use serde_json::Value;

/// Largest body parsed: EventBridge's largest event (256 KiB). SQS may carry more; it is
/// rejected unread.
pub const MAX_BODY: usize = 256 * 1024;
/// Most affected entities read from one Health event.
pub const MAX_ENTITIES: usize = 1000;

pub const SPOT: &str = "EC2 Spot Instance Interruption Warning";
pub const REBALANCE: &str = "EC2 Instance Rebalance Recommendation";
pub const STATE_CHANGE: &str = "EC2 Instance State-change Notification";
pub const HEALTH: &str = "AWS Health Event";
pub const TERMINATE_ACTION: &str = "EC2 Instance-terminate Lifecycle Action";
pub const LAUNCH_ACTION: &str = "EC2 Instance-launch Lifecycle Action";
pub const CAPACITY_RESERVATION: &str = "EC2 Capacity Reservation Instance Interruption Warning";

const TERMINATING: &str = "autoscaling:EC2_INSTANCE_TERMINATING";
const LAUNCHING: &str = "autoscaling:EC2_INSTANCE_LAUNCHING";
const TEST_NOTIFICATION: &str = "autoscaling:TEST_NOTIFICATION";

/// What a message says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Parsed {
    /// Events to relay, each for one instance.
    Relay(Vec<Relayed>),
    /// A valid message that asks nothing of lastcall (deleted, counted by `why`).
    Ignored { why: Ignored },
}

/// Why a valid message is not relayed. Bounded: a metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ignored {
    /// `autoscaling:TEST_NOTIFICATION`.
    TestNotification,
    /// An instance-launch lifecycle action.
    Launch,
    /// A state change to `pending` or `running`.
    NotEnding,
    /// A Health event of another service or category, or without an EC2 instance.
    OtherHealth,
}

impl Ignored {
    pub fn metric_label(self) -> &'static str {
        match self {
            Self::TestNotification => "test_notification",
            Self::Launch => "launch",
            Self::NotEnding => "not_ending",
            Self::OtherHealth => "other_health",
        }
    }
}

/// Why a message could not be read. Its `detail_type` (bounded) is told in the log.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("the body is {0} bytes, more than {MAX_BODY}")]
    TooLarge(usize),
    #[error("the body is not JSON: {0}")]
    NotJson(String),
    #[error("neither an EventBridge event nor an Auto Scaling notification")]
    UnknownShape,
    #[error("detail-type {detail_type:?} from {source_name:?} is not one lastcall reads")]
    UnknownDetailType {
        detail_type: String,
        source_name: String,
    },
    #[error("EventBridge event version {0:?}; this version reads \"0\"")]
    Version(String),
    #[error("{detail_type}: {why}")]
    Invalid { detail_type: String, why: String },
    #[error("{detail_type}: Health event type {code:?} is not one this version knows")]
    UnknownCode { detail_type: String, code: String },
}

impl ParseError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::TooLarge(_) => "too_large",
            Self::NotJson(_) => "not_json",
            Self::UnknownShape => "unknown_shape",
            Self::UnknownDetailType { .. } => "unknown_detail_type",
            Self::Version(_) => "version",
            Self::Invalid { .. } => "invalid",
            Self::UnknownCode { .. } => "unknown_code",
        }
    }

    /// The detail-type the message claimed (bounded), for the once-per-type log.
    pub fn detail_type(&self) -> &str {
        match self {
            Self::UnknownDetailType { detail_type, .. }
            | Self::Invalid { detail_type, .. }
            | Self::UnknownCode { detail_type, .. } => detail_type,
            _ => "",
        }
    }
}

fn bounded(s: &str) -> String {
    let mut end = s.len().min(64);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

fn invalid(detail_type: &str, why: impl Into<String>) -> ParseError {
    ParseError::Invalid {
        detail_type: bounded(detail_type),
        why: why.into(),
    }
}

/// The EventBridge envelope. Fields beyond these (`account`, `region`, `resources`, a
/// test server's `ingestion-time`) are not read.
#[derive(Deserialize)]
struct Envelope {
    version: String,
    id: String,
    #[serde(rename = "detail-type")]
    detail_type: String,
    source: String,
    time: String,
    detail: Value,
}

#[derive(Deserialize)]
struct InstanceDetail {
    #[serde(rename = "instance-id")]
    instance_id: String,
}

#[derive(Deserialize)]
struct SpotDetail {
    #[serde(rename = "instance-id")]
    instance_id: String,
    #[serde(rename = "instance-action")]
    instance_action: String,
}

/// EC2 Capacity Reservation Instance Interruption Warning: AWS documents
/// `instance-termination-time` in it ("Monitor interruptible Capacity Reservations with
/// EventBridge and CloudTrail", Amazon EC2 User Guide); read when there.
#[derive(Deserialize)]
struct CapacityDetail {
    #[serde(rename = "instance-id")]
    instance_id: String,
    #[serde(default, rename = "instance-termination-time")]
    termination_time: Option<String>,
}

#[derive(Deserialize)]
struct StateDetail {
    #[serde(rename = "instance-id")]
    instance_id: String,
    state: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct HealthDetail {
    service: String,
    event_type_category: String,
    #[serde(default)]
    event_arn: Option<String>,
    /// `upcoming`, `open` or `closed` (the Health API's `EventStatusCode`).
    #[serde(default)]
    status_code: Option<String>,
    #[serde(default)]
    event_type_code: Option<String>,
    #[serde(default)]
    start_time: Option<String>,
    #[serde(default)]
    affected_entities: Vec<Entity>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Entity {
    #[serde(default)]
    entity_value: Option<String>,
}

/// The lifecycle fields, in an EventBridge `detail` or at the top of an Auto Scaling
/// notification.
#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Lifecycle {
    #[serde(default)]
    event: Option<String>,
    #[serde(default)]
    lifecycle_transition: Option<String>,
    #[serde(default)]
    auto_scaling_group_name: Option<String>,
    #[serde(default)]
    lifecycle_hook_name: Option<String>,
    #[serde(default, rename = "EC2InstanceId")]
    ec2_instance_id: Option<String>,
    #[serde(default)]
    request_id: Option<String>,
    #[serde(default)]
    time: Option<String>,
}

/// Reads one SQS message body.
pub fn parse(body: &str) -> Result<Parsed, ParseError> {
    if body.len() > MAX_BODY {
        return Err(ParseError::TooLarge(body.len()));
    }
    let v: Value = serde_json::from_str(body).map_err(|e| ParseError::NotJson(e.to_string()))?;
    parse_value(v, true)
}

fn parse_value(v: Value, may_unwrap: bool) -> Result<Parsed, ParseError> {
    let Some(obj) = v.as_object() else {
        return Err(ParseError::UnknownShape);
    };
    if obj.contains_key("detail-type") {
        let env: Envelope =
            serde_json::from_value(v).map_err(|e| invalid("EventBridge event", e.to_string()))?;
        return event_bridge(env);
    }
    // SNS: {"Type": "Notification", "Message": "<the notification as a JSON string>"}.
    if may_unwrap && obj.get("Type").and_then(Value::as_str) == Some("Notification") {
        let Some(inner) = obj.get("Message").and_then(Value::as_str) else {
            return Err(invalid("SNS notification", "no Message string"));
        };
        let inner: Value = serde_json::from_str(inner)
            .map_err(|e| invalid("SNS notification", format!("Message: {e}")))?;
        return parse_value(inner, false);
    }
    if obj.get("Service").and_then(Value::as_str) == Some("AWS Auto Scaling") {
        let l: Lifecycle = serde_json::from_value(v)
            .map_err(|e| invalid("Auto Scaling notification", e.to_string()))?;
        let id = l.request_id.clone().unwrap_or_default();
        let time = l.time.clone().unwrap_or_default();
        return lifecycle("Auto Scaling notification", l, &id, &time);
    }
    Err(ParseError::UnknownShape)
}

fn event_bridge(env: Envelope) -> Result<Parsed, ParseError> {
    if env.version != "0" {
        return Err(ParseError::Version(bounded(&env.version)));
    }
    let dt = env.detail_type.as_str();
    let expected_source = match dt {
        SPOT | REBALANCE | STATE_CHANGE | CAPACITY_RESERVATION => "aws.ec2",
        HEALTH => "aws.health",
        TERMINATE_ACTION | LAUNCH_ACTION => "aws.autoscaling",
        _ => {
            return Err(ParseError::UnknownDetailType {
                detail_type: bounded(dt),
                source_name: bounded(&env.source),
            });
        }
    };
    if env.source != expected_source {
        return Err(invalid(
            dt,
            format!("source {:?}, not {expected_source}", bounded(&env.source)),
        ));
    }
    let one = |instance: String, event: Event| -> Result<Parsed, ParseError> {
        Ok(Parsed::Relay(vec![relayed(
            dt, &instance, &env.id, &env.time, event,
        )?]))
    };
    match dt {
        SPOT => {
            let d: SpotDetail = from(dt, env.detail.clone())?;
            let action = SpotAction::parse(&d.instance_action).ok_or_else(|| {
                invalid(
                    dt,
                    format!("instance-action {:?}", bounded(&d.instance_action)),
                )
            })?;
            one(d.instance_id, Event::SpotInterruption { action })
        }
        REBALANCE => {
            let d: InstanceDetail = from(dt, env.detail.clone())?;
            one(d.instance_id, Event::RebalanceRecommendation)
        }
        CAPACITY_RESERVATION => {
            let d: CapacityDetail = from(dt, env.detail.clone())?;
            let terminates = d
                .termination_time
                .map(|raw| {
                    raw.parse::<Timestamp>().map_err(|e| {
                        invalid(
                            dt,
                            format!("instance-termination-time {:?}: {e}", bounded(&raw)),
                        )
                    })
                })
                .transpose()?;
            one(
                d.instance_id,
                Event::CapacityReservationInterruption { terminates },
            )
        }
        STATE_CHANGE => {
            let d: StateDetail = from(dt, env.detail.clone())?;
            match d.state.as_str() {
                "pending" | "running" => Ok(Parsed::Ignored {
                    why: Ignored::NotEnding,
                }),
                s => {
                    let state = InstanceState::parse(s)
                        .ok_or_else(|| invalid(dt, format!("state {:?}", bounded(s))))?;
                    one(d.instance_id, Event::StateChange { state })
                }
            }
        }
        HEALTH => health(&env),
        _ => {
            let l: Lifecycle = from(dt, env.detail.clone())?;
            lifecycle(dt, l, &env.id, &env.time)
        }
    }
}

fn from<T: for<'de> Deserialize<'de>>(dt: &str, v: Value) -> Result<T, ParseError> {
    serde_json::from_value(v).map_err(|e| invalid(dt, format!("detail: {e}")))
}

fn relayed(
    dt: &str,
    instance: &str,
    id: &str,
    time: &str,
    event: Event,
) -> Result<Relayed, ParseError> {
    if !is_instance_id(instance) {
        return Err(invalid(dt, format!("instance id {:?}", bounded(instance))));
    }
    if id.is_empty() || id.len() > MAX_FIELD {
        return Err(invalid(dt, "id missing or too long"));
    }
    let time: Timestamp = time
        .parse()
        .map_err(|e| invalid(dt, format!("time {:?}: {e}", bounded(time))))?;
    Ok(Relayed {
        instance: instance.to_string(),
        id: id.to_string(),
        time,
        event,
    })
}

fn health(env: &Envelope) -> Result<Parsed, ParseError> {
    let dt = HEALTH;
    let d: HealthDetail = from(dt, env.detail.clone())?;
    if d.service != "EC2" || d.event_type_category != "scheduledChange" {
        return Ok(Parsed::Ignored {
            why: Ignored::OtherHealth,
        });
    }
    if d.affected_entities.len() > MAX_ENTITIES {
        return Err(invalid(
            dt,
            format!(
                "{} affected entities, more than {MAX_ENTITIES}",
                d.affected_entities.len()
            ),
        ));
    }
    let aws_code = d
        .event_type_code
        .ok_or_else(|| invalid(dt, "no eventTypeCode"))?;
    let code = scheduled_code(&aws_code).ok_or_else(|| ParseError::UnknownCode {
        detail_type: dt.into(),
        code: bounded(&aws_code),
    })?;
    let status = match d.status_code.as_deref() {
        None => HealthStatus::default(),
        Some(raw) => HealthStatus::parse(raw)
            .ok_or_else(|| invalid(dt, format!("statusCode {:?}", bounded(raw))))?,
    };
    // The Health API allows an ARN of up to 1,600 bytes, more than a relayed field holds: such
    // an event is still relayed, without its ARN, so each of its updates stands alone (a
    // `closed` one then withdraws nothing: a drain too many, never a maintenance missed).
    let arn = d
        .event_arn
        .filter(|a| a.len() <= MAX_FIELD)
        .unwrap_or_default();
    let raw_start = d.start_time.ok_or_else(|| invalid(dt, "no startTime"))?;
    let start = health_time(&raw_start)
        .ok_or_else(|| invalid(dt, format!("startTime {:?}", bounded(&raw_start))))?;
    let mut out = vec![];
    for e in &d.affected_entities {
        // Health lists other entity kinds too (volumes, hosts): only instances are relayed.
        let Some(value) = e.entity_value.as_deref().filter(|v| is_instance_id(v)) else {
            continue;
        };
        let event = Event::ScheduledChange {
            code: code.into(),
            start,
            aws_code: bounded(&aws_code),
            arn: arn.clone(),
            status,
        };
        let r = relayed(dt, value, &env.id, &env.time, event)?;
        if !out.iter().any(|o: &Relayed| o.same_as(&r)) {
            out.push(r);
        }
    }
    if out.is_empty() {
        return Ok(Parsed::Ignored {
            why: Ignored::OtherHealth,
        });
    }
    Ok(Parsed::Relay(out))
}

/// A Health `eventTypeCode` of an EC2 scheduled change, in instance metadata's vocabulary
/// of scheduled events, by what it does to a running process (as the instance-metadata
/// source classifies them): a stop, a retirement or a reboot ends every process; network
/// and power maintenance ends none. `None`: not a code this version knows.
pub fn scheduled_code(aws: &str) -> Option<&'static str> {
    let rest = aws.strip_prefix("AWS_EC2_")?;
    if !rest.ends_with("_SCHEDULED") {
        return None;
    }
    Some(if rest.contains("RETIREMENT") {
        "instance-retirement"
    } else if rest.contains("INSTANCE_STOP") {
        "instance-stop"
    } else if rest.contains("SYSTEM_REBOOT") {
        "system-reboot"
    } else if rest.contains("REBOOT") {
        "instance-reboot"
    } else if rest.contains("MAINTENANCE") {
        "system-maintenance"
    } else {
        return None;
    })
}

/// Health writes times as RFC 2822 (`Sat, 05 Jun 2016 15:10:09 GMT`); RFC 3339 is read too.
fn health_time(s: &str) -> Option<Timestamp> {
    if let Ok(t) = s.parse::<Timestamp>() {
        return Some(t);
    }
    jiff::fmt::rfc2822::parse(s).ok().map(|z| z.timestamp())
}

fn lifecycle(dt: &str, l: Lifecycle, id: &str, time: &str) -> Result<Parsed, ParseError> {
    if l.event.as_deref() == Some(TEST_NOTIFICATION)
        || l.lifecycle_transition.as_deref() == Some(TEST_NOTIFICATION)
    {
        return Ok(Parsed::Ignored {
            why: Ignored::TestNotification,
        });
    }
    match l.lifecycle_transition.as_deref() {
        Some(TERMINATING) => {}
        Some(LAUNCHING) => {
            return Ok(Parsed::Ignored {
                why: Ignored::Launch,
            });
        }
        other => {
            return Err(invalid(
                dt,
                format!("LifecycleTransition {:?}", other.map(bounded)),
            ));
        }
    }
    let field = |v: Option<String>, name: &str| {
        v.filter(|s| !s.is_empty() && s.len() <= MAX_FIELD)
            .ok_or_else(|| invalid(dt, format!("{name} missing or too long")))
    };
    let group = field(l.auto_scaling_group_name, "AutoScalingGroupName")?;
    let hook = field(l.lifecycle_hook_name, "LifecycleHookName")?;
    let instance = field(l.ec2_instance_id, "EC2InstanceId")?;
    Ok(Parsed::Relay(vec![relayed(
        dt,
        &instance,
        id,
        time,
        Event::TerminateLifecycleAction { group, hook },
    )?]))
}

#[cfg(test)]
mod tests;
