//! The AWS events pubsub relays to a node's agent in queue mode, as they sit on the Node.
//!
//! pubsub reads EventBridge events from an SQS queue, finds the Node whose `spec.providerID`
//! names the instance, and adds the event to the annotation [`ANNOTATION`] on that Node; the
//! node's agent reads it from the watch of its own Node it already keeps. The Node is the
//! channel because every agent already watches it, it needs no Redis, and it outlives a
//! pubsub restart (see `docs/architecture.md`).
//!
//! Each entry names the instance it was for: an event for an earlier instance that ran under
//! the same Node name never drains the new one. The record is bounded ([`MAX_EVENTS`] entries,
//! [`MAX_BYTES`] of JSON, each string [`MAX_FIELD`] bytes) and versioned ([`VERSION`]); a
//! record that is larger, of another version or malformed is rejected whole by the reader,
//! counted and logged, and never acted on.

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

/// The Node annotation holding the relayed events.
pub const ANNOTATION: &str = "lastcall.dev/aws-events";
/// The record's format version. A reader rejects any other.
pub const VERSION: u32 = 1;
/// Most events kept on one Node; the oldest go first.
pub const MAX_EVENTS: usize = 16;
/// Largest record, in bytes of JSON.
pub const MAX_BYTES: usize = 16 * 1024;
/// Longest string field (instance ids, event ids, group and hook names, tokens).
pub const MAX_FIELD: usize = 256;
/// How long pubsub keeps an event on the Node: the longest an Auto Scaling lifecycle wait can
/// last (48 hours). Older entries are dropped on the next write.
pub const KEEP_SECS: i64 = 48 * 3600;

/// Everything relayed to one Node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    pub version: u32,
    pub events: Vec<Relayed>,
}

/// One event, for one instance.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Relayed {
    /// The EC2 instance the event was for (`i-…`).
    pub instance: String,
    /// The event's id (EventBridge `id`, or an Auto Scaling notification's `RequestId`):
    /// a redelivery or a replay carries the same id and changes nothing.
    pub id: String,
    /// When the event happened (EventBridge `time`).
    pub time: Timestamp,
    pub event: Event,
}

/// What the event says, in the vocabulary the agent's rules use.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Event {
    /// EC2 Spot Instance Interruption Warning.
    SpotInterruption { action: SpotAction },
    /// EC2 Instance Rebalance Recommendation.
    RebalanceRecommendation,
    /// EC2 Instance State-change Notification, for the states that end the instance.
    StateChange { state: InstanceState },
    /// AWS Health Event, EC2 scheduled change: `code` in instance metadata's vocabulary
    /// (`instance-stop`, `instance-retirement`, `instance-reboot`, `system-reboot`,
    /// `system-maintenance`), `start` the window's start.
    ScheduledChange {
        code: String,
        start: Timestamp,
        /// The Health event's own `eventTypeCode`, for logs.
        aws_code: String,
        /// The Health event's `eventArn`: every update of one event (`upcoming`, `open`,
        /// `closed`) carries the same one, under a new EventBridge id. Empty in records
        /// written before it was kept.
        #[serde(default, skip_serializing_if = "String::is_empty")]
        arn: String,
        /// The Health event's `statusCode` when it was sent.
        #[serde(default)]
        status: HealthStatus,
    },
    /// EC2 Capacity Reservation Instance Interruption Warning.
    CapacityReservationInterruption {
        /// The event's `instance-termination-time`, when it states one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        terminates: Option<Timestamp>,
    },
    /// EC2 Instance-terminate Lifecycle Action: the instance waits on `hook` of `group`.
    TerminateLifecycleAction { group: String, hook: String },
}

/// An AWS Health event's `statusCode`. Its updates only move forward: `upcoming` (before the
/// window), `open` (in it), `closed` (over: done, or cancelled).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HealthStatus {
    Upcoming,
    /// Also what an event that states no status counts as: still to be acted on.
    #[default]
    Open,
    Closed,
}

impl HealthStatus {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "upcoming" => Some(Self::Upcoming),
            "open" => Some(Self::Open),
            "closed" => Some(Self::Closed),
            _ => None,
        }
    }
}

/// A Spot interruption's `instance-action`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SpotAction {
    Terminate,
    Stop,
    Hibernate,
}

impl SpotAction {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "terminate" => Some(Self::Terminate),
            "stop" => Some(Self::Stop),
            "hibernate" => Some(Self::Hibernate),
            _ => None,
        }
    }
}

/// The instance states that end it (the others, `pending` and `running`, are not relayed).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum InstanceState {
    Stopping,
    Stopped,
    ShuttingDown,
    Terminated,
}

impl InstanceState {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "stopping" => Some(Self::Stopping),
            "stopped" => Some(Self::Stopped),
            "shutting-down" => Some(Self::ShuttingDown),
            "terminated" => Some(Self::Terminated),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stopping => "stopping",
            Self::Stopped => "stopped",
            Self::ShuttingDown => "shutting-down",
            Self::Terminated => "terminated",
        }
    }
}

impl Event {
    /// A bounded name for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::SpotInterruption { .. } => "spot_interruption",
            Self::RebalanceRecommendation => "rebalance_recommendation",
            Self::StateChange { .. } => "state_change",
            Self::ScheduledChange { .. } => "scheduled_change",
            Self::CapacityReservationInterruption { .. } => "capacity_reservation_interruption",
            Self::TerminateLifecycleAction { .. } => "terminate_lifecycle_action",
        }
    }
}

/// Why a record was rejected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("the record is {0} bytes, more than {MAX_BYTES}")]
    TooLarge(usize),
    #[error("the record is not valid: {0}")]
    Invalid(String),
    #[error("the record is version {0}; this version reads {VERSION}")]
    Version(u32),
    #[error("the record holds {0} events, more than {MAX_EVENTS}")]
    TooMany(usize),
    #[error("a field is longer than {MAX_FIELD} bytes")]
    FieldTooLong,
}

impl RecordError {
    /// A bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::TooLarge(_) => "too_large",
            Self::Invalid(_) => "invalid",
            Self::Version(_) => "version",
            Self::TooMany(_) => "too_many",
            Self::FieldTooLong => "field_too_long",
        }
    }
}

impl Relayed {
    fn fields_fit(&self) -> bool {
        let mut fields = vec![self.instance.as_str(), self.id.as_str()];
        match &self.event {
            Event::ScheduledChange {
                code,
                aws_code,
                arn,
                ..
            } => {
                fields.extend([code.as_str(), aws_code.as_str(), arn.as_str()]);
            }
            Event::TerminateLifecycleAction { group, hook } => {
                fields.extend([group.as_str(), hook.as_str()]);
            }
            _ => {}
        }
        fields.iter().all(|f| f.len() <= MAX_FIELD)
    }

    /// The same event: a redelivery, a replay or another rule's copy of it.
    pub fn same_as(&self, other: &Relayed) -> bool {
        self.instance == other.instance && self.id == other.id && self.event == other.event
    }
}

impl Record {
    pub fn empty() -> Self {
        Self {
            version: VERSION,
            events: vec![],
        }
    }

    /// Reads a record as found on a Node: bounded, versioned, every field checked.
    pub fn parse(raw: &str) -> Result<Self, RecordError> {
        if raw.len() > MAX_BYTES {
            return Err(RecordError::TooLarge(raw.len()));
        }
        // The version first, so a newer writer's record says so instead of "invalid".
        let version: serde_json::Value =
            serde_json::from_str(raw).map_err(|e| RecordError::Invalid(e.to_string()))?;
        match version.get("version").and_then(serde_json::Value::as_u64) {
            Some(v) if v == u64::from(VERSION) => {}
            Some(v) => return Err(RecordError::Version(u32::try_from(v).unwrap_or(u32::MAX))),
            None => return Err(RecordError::Invalid("no version".into())),
        }
        let record: Record =
            serde_json::from_value(version).map_err(|e| RecordError::Invalid(e.to_string()))?;
        if record.events.len() > MAX_EVENTS {
            return Err(RecordError::TooMany(record.events.len()));
        }
        if !record.events.iter().all(Relayed::fields_fit) {
            return Err(RecordError::FieldTooLong);
        }
        Ok(record)
    }

    /// The record with `event` added, if it is not there yet: `None` when it already is (a
    /// duplicate delivery changes nothing, not even the Node's resourceVersion). Entries older
    /// than [`KEEP_SECS`] before `now` are dropped, then the oldest beyond [`MAX_EVENTS`] or
    /// [`MAX_BYTES`].
    pub fn with(&self, event: Relayed, now: Timestamp) -> Option<Self> {
        if self.events.iter().any(|e| e.same_as(&event)) {
            return None;
        }
        let keep_from = now
            .checked_sub(jiff::SignedDuration::from_secs(KEEP_SECS))
            .unwrap_or(Timestamp::MIN);
        let mut events: Vec<Relayed> = self
            .events
            .iter()
            .filter(|e| e.time >= keep_from)
            .cloned()
            .collect();
        events.push(event);
        events.sort_by_key(|e| e.time);
        while events.len() > MAX_EVENTS {
            events.remove(0);
        }
        let mut out = Self {
            version: VERSION,
            events,
        };
        while out.to_annotation().len() > MAX_BYTES && out.events.len() > 1 {
            out.events.remove(0);
        }
        Some(out)
    }

    /// The events for `instance`, the one this Node runs now.
    pub fn for_instance<'a>(&'a self, instance: &'a str) -> impl Iterator<Item = &'a Relayed> {
        self.events.iter().filter(move |e| e.instance == instance)
    }

    pub fn to_annotation(&self) -> String {
        // Serialising plain data with string keys cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// The EC2 instance id in a Node's `spec.providerID` (`aws:///<zone>/<instance-id>`).
/// Nothing else is accepted: not a DNS name, not another provider's id.
pub fn instance_of_provider_id(provider_id: &str) -> Option<&str> {
    let rest = provider_id.strip_prefix("aws:///")?;
    let (zone, id) = rest.split_once('/')?;
    (!zone.is_empty() && !zone.contains('/') && is_instance_id(id)).then_some(id)
}

/// `i-` and 8 or 17 lowercase hex digits, as EC2 instance ids are.
pub fn is_instance_id(s: &str) -> bool {
    s.strip_prefix("i-").is_some_and(|hex| {
        matches!(hex.len(), 8 | 17)
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn spot(instance: &str, id: &str, time: &str) -> Relayed {
        Relayed {
            instance: instance.into(),
            id: id.into(),
            time: t(time),
            event: Event::SpotInterruption {
                action: SpotAction::Terminate,
            },
        }
    }

    #[test]
    fn a_record_reads_back_what_it_writes() {
        let r = Record::empty()
            .with(
                spot("i-0123456789abcdef0", "e1", "2026-12-01T00:00:00Z"),
                t("2026-12-01T00:00:01Z"),
            )
            .unwrap();
        let raw = r.to_annotation();
        assert!(
            raw.contains(r#""kind":"spot-interruption","action":"terminate""#),
            "{raw}"
        );
        assert_eq!(Record::parse(&raw), Ok(r));
    }

    #[test]
    fn a_duplicate_changes_nothing() {
        let now = t("2026-12-01T00:00:01Z");
        let e = spot("i-0123456789abcdef0", "e1", "2026-12-01T00:00:00Z");
        let r = Record::empty().with(e.clone(), now).unwrap();
        assert_eq!(r.with(e, now), None);
    }

    #[test]
    fn old_and_surplus_events_are_dropped_oldest_first() {
        let now = t("2026-12-10T00:00:00Z");
        let mut r = Record::empty()
            .with(spot("i-00000001", "old", "2026-12-01T00:00:00Z"), now)
            .unwrap();
        r = r
            .with(spot("i-00000001", "new", "2026-12-09T23:00:00Z"), now)
            .unwrap();
        assert_eq!(r.events.len(), 1, "older than 48 h: dropped");
        for i in 0..40 {
            let time = format!("2026-12-09T23:{:02}:00Z", i + 1);
            r = r
                .with(spot("i-00000001", &format!("e{i}"), &time), now)
                .unwrap();
        }
        assert_eq!(r.events.len(), MAX_EVENTS);
        assert_eq!(r.events.last().unwrap().id, "e39");
        assert!(r.to_annotation().len() <= MAX_BYTES);
    }

    #[test]
    fn hostile_records_are_rejected_whole() {
        let ok = Record::empty()
            .with(
                spot("i-00000001", "e", "2026-12-01T00:00:00Z"),
                t("2026-12-01T00:00:00Z"),
            )
            .unwrap()
            .to_annotation();
        let cases: Vec<(String, &str)> = vec![
            ("x".repeat(MAX_BYTES + 1), "too_large"),
            ("not json".into(), "invalid"),
            (r#"{"events":[]}"#.into(), "invalid"),
            (ok.replace(r#""version":1"#, r#""version":2"#), "version"),
            (ok.replace(r#""version":1"#, r#""version":"1""#), "invalid"),
            (ok.replace("terminate", "explode"), "invalid"),
            (
                ok.replace(r#""id":"e""#, r#""id":"e","extra":1"#),
                "invalid",
            ),
            (ok.replace("2026-12-01T00:00:00Z", "yesterday"), "invalid"),
            (
                ok.replace(
                    r#""id":"e""#,
                    &format!(r#""id":"{}""#, "e".repeat(MAX_FIELD + 1)),
                ),
                "field_too_long",
            ),
        ];
        for (raw, label) in cases {
            let err = Record::parse(&raw).expect_err(&raw[..raw.len().min(80)]);
            assert_eq!(err.metric_label(), label, "{err}");
        }
        let many: Vec<Relayed> = (0..=MAX_EVENTS)
            .map(|i| spot("i-00000001", &format!("e{i}"), "2026-12-01T00:00:00Z"))
            .collect();
        let raw = serde_json::to_string(&Record {
            version: VERSION,
            events: many,
        })
        .unwrap();
        assert_eq!(Record::parse(&raw).unwrap_err().metric_label(), "too_many");
    }

    /// A record written before a Health event's ARN and status were kept, or without a
    /// capacity reservation's stated termination time, still reads: no ARN, status open.
    #[test]
    fn optional_fields_read_when_absent_and_are_written_when_present() {
        let raw = r#"{"version":1,"events":[{"instance":"i-00000001","id":"h","time":"2026-12-01T00:00:00Z","event":{"kind":"scheduled-change","code":"instance-stop","start":"2026-12-05T00:00:00Z","aws_code":"AWS_EC2_INSTANCE_STOP_SCHEDULED"}},{"instance":"i-00000001","id":"c","time":"2026-12-01T00:00:00Z","event":{"kind":"capacity-reservation-interruption"}}]}"#;
        let r = Record::parse(raw).expect("readable");
        assert_eq!(
            r.events[0].event,
            Event::ScheduledChange {
                code: "instance-stop".into(),
                start: t("2026-12-05T00:00:00Z"),
                aws_code: "AWS_EC2_INSTANCE_STOP_SCHEDULED".into(),
                arn: String::new(),
                status: HealthStatus::Open,
            }
        );
        assert_eq!(
            r.events[1].event,
            Event::CapacityReservationInterruption { terminates: None }
        );
        let written = r.to_annotation();
        assert!(
            !written.contains("arn") && !written.contains("terminates"),
            "absent fields are not written: {written}"
        );
        assert_eq!(Record::parse(&written), Ok(r));
        let closed = Event::ScheduledChange {
            code: "instance-stop".into(),
            start: t("2026-12-05T00:00:00Z"),
            aws_code: "AWS_EC2_INSTANCE_STOP_SCHEDULED".into(),
            arn: "arn:aws:health:us-east-1::event/EC2/AWS_EC2_INSTANCE_STOP_SCHEDULED/x".into(),
            status: HealthStatus::Closed,
        };
        let written = serde_json::to_string(&closed).unwrap();
        assert!(written.contains(r#""status":"closed""#), "{written}");
        assert_eq!(serde_json::from_str::<Event>(&written).unwrap(), closed);
        let long_arn = Record {
            version: VERSION,
            events: vec![Relayed {
                instance: "i-00000001".into(),
                id: "h".into(),
                time: t("2026-12-01T00:00:00Z"),
                event: Event::ScheduledChange {
                    code: "instance-stop".into(),
                    start: t("2026-12-05T00:00:00Z"),
                    aws_code: "x".into(),
                    arn: "a".repeat(MAX_FIELD + 1),
                    status: HealthStatus::Open,
                },
            }],
        };
        assert_eq!(
            Record::parse(&long_arn.to_annotation()).unwrap_err(),
            RecordError::FieldTooLong
        );
    }

    /// A Node name reused by a new instance keeps the old instance's entries until they age
    /// out: they are never the new instance's.
    #[test]
    fn an_earlier_instances_event_is_not_the_new_ones() {
        let now = t("2026-12-01T00:00:10Z");
        let r = Record::empty()
            .with(
                spot("i-0000000000000old0", "old", "2026-12-01T00:00:00Z"),
                now,
            )
            .unwrap()
            .with(
                spot("i-0000000000000new0", "new", "2026-12-01T00:00:05Z"),
                now,
            )
            .unwrap();
        let ids: Vec<&str> = r
            .for_instance("i-0000000000000new0")
            .map(|e| e.id.as_str())
            .collect();
        assert_eq!(ids, ["new"]);
        assert_eq!(r.for_instance("i-00000000").count(), 0);
    }

    #[test]
    fn only_an_aws_provider_id_names_an_instance() {
        assert_eq!(
            instance_of_provider_id("aws:///us-west-2a/i-0123456789abcdef0"),
            Some("i-0123456789abcdef0")
        );
        assert_eq!(
            instance_of_provider_id("aws:///us-west-2a/i-1234abcd"),
            Some("i-1234abcd")
        );
        for bad in [
            "",
            "aws:///i-0123456789abcdef0",
            "aws://us-west-2a/i-0123456789abcdef0",
            "gce://p/z/i-0123456789abcdef0",
            "aws:///us-west-2a/ip-10-0-0-1.ec2.internal",
            "aws:///us-west-2a/i-0123456789ABCDEF0",
            "aws:///us-west-2a/i-0123",
            "aws:///a/b/i-0123456789abcdef0",
            "aws:///us-west-2a/i-0123456789abcdef0/",
        ] {
            assert_eq!(instance_of_provider_id(bad), None, "{bad}");
        }
    }
}
