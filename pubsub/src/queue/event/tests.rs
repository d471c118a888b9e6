//! The documented event shapes (EventBridge's and Auto Scaling's user guides), and what an
//! attacker who can send to the queue would send.

use super::*;
use lastcall_common::aws_events::InstanceState;
use serde_json::json;

const I: &str = "i-1234567890abcdef0";

fn eb(detail_type: &str, source: &str, detail: Value) -> String {
    json!({
        "version": "0",
        "id": "7bf73129-1428-4cd3-a780-95db273d1602",
        "detail-type": detail_type,
        "source": source,
        "account": "123456789012",
        "time": "2026-12-01T10:00:00Z",
        "region": "us-east-2",
        "resources": [format!("arn:aws:ec2:us-east-2:123456789012:instance/{I}")],
        "detail": detail,
    })
    .to_string()
}

fn relayed_one(body: &str) -> Relayed {
    match parse(body) {
        Ok(Parsed::Relay(mut v)) if v.len() == 1 => v.remove(0),
        other => panic!("expected one event, got {other:?}"),
    }
}

fn t(s: &str) -> Timestamp {
    s.parse().unwrap()
}

#[test]
fn a_spot_warning_each_action() {
    for (raw, action) in [
        ("terminate", SpotAction::Terminate),
        ("stop", SpotAction::Stop),
        ("hibernate", SpotAction::Hibernate),
    ] {
        let r = relayed_one(&eb(
            SPOT,
            "aws.ec2",
            json!({"instance-id": I, "instance-action": raw}),
        ));
        assert_eq!(r.instance, I);
        assert_eq!(r.id, "7bf73129-1428-4cd3-a780-95db273d1602");
        assert_eq!(r.time, t("2026-12-01T10:00:00Z"));
        assert_eq!(r.event, Event::SpotInterruption { action });
    }
}

#[test]
fn rebalance_and_capacity_reservation() {
    let r = relayed_one(&eb(REBALANCE, "aws.ec2", json!({"instance-id": I})));
    assert_eq!(r.event, Event::RebalanceRecommendation);
    let r = relayed_one(&eb(
        CAPACITY_RESERVATION,
        "aws.ec2",
        json!({"instance-id": I, "instance-action": "terminate"}),
    ));
    assert_eq!(
        r.event,
        Event::CapacityReservationInterruption { terminates: None }
    );
    // The documented shape states when the instance is terminated.
    let r = relayed_one(&eb(
        CAPACITY_RESERVATION,
        "aws.ec2",
        json!({"instance-id": I, "instance-action": "terminate",
               "instance-termination-time": "2026-12-01T10:02:00Z", "azId": "use2-az1"}),
    ));
    assert_eq!(
        r.event,
        Event::CapacityReservationInterruption {
            terminates: Some(t("2026-12-01T10:02:00Z"))
        }
    );
    let e = parse(&eb(
        CAPACITY_RESERVATION,
        "aws.ec2",
        json!({"instance-id": I, "instance-termination-time": "soon"}),
    ))
    .unwrap_err();
    assert_eq!(e.metric_label(), "invalid");
}

#[test]
fn state_changes_that_end_the_instance_and_those_that_do_not() {
    for (raw, state) in [
        ("stopping", InstanceState::Stopping),
        ("stopped", InstanceState::Stopped),
        ("shutting-down", InstanceState::ShuttingDown),
        ("terminated", InstanceState::Terminated),
    ] {
        let r = relayed_one(&eb(
            STATE_CHANGE,
            "aws.ec2",
            json!({"instance-id": I, "state": raw}),
        ));
        assert_eq!(r.event, Event::StateChange { state });
    }
    for raw in ["pending", "running"] {
        assert_eq!(
            parse(&eb(
                STATE_CHANGE,
                "aws.ec2",
                json!({"instance-id": I, "state": raw})
            )),
            Ok(Parsed::Ignored {
                why: Ignored::NotEnding
            })
        );
    }
    let e = parse(&eb(
        STATE_CHANGE,
        "aws.ec2",
        json!({"instance-id": I, "state": "exploding"}),
    ))
    .unwrap_err();
    assert_eq!(e.metric_label(), "invalid");
}

fn health(service: &str, category: &str, code: &str, entities: Value) -> String {
    eb(
        HEALTH,
        "aws.health",
        json!({
            "eventArn": "arn:aws:health:us-east-2::event/EC2/AWS_EC2_INSTANCE_STOP_SCHEDULED/x",
            "service": service,
            "eventTypeCode": code,
            "eventTypeCategory": category,
            "startTime": "Sat, 05 Dec 2026 15:10:09 GMT",
            "eventDescription": [{"language": "en_US", "latestDescription": "text"}],
            "affectedEntities": entities,
        }),
    )
}

#[test]
fn a_health_event_is_one_event_per_affected_instance() {
    let body = health(
        "EC2",
        "scheduledChange",
        "AWS_EC2_INSTANCE_STOP_SCHEDULED",
        json!([
            {"entityValue": "i-1234567890abcdef0", "tags": {"stage": "prod"}},
            {"entityValue": "i-0fedcba0987654321"},
            {"entityValue": "i-1234567890abcdef0"},
            {"entityValue": "vol-0123456789abcdef0"},
            {},
        ]),
    );
    let Ok(Parsed::Relay(events)) = parse(&body) else {
        panic!("{:?}", parse(&body))
    };
    let instances: Vec<&str> = events.iter().map(|e| e.instance.as_str()).collect();
    assert_eq!(
        instances,
        ["i-1234567890abcdef0", "i-0fedcba0987654321"],
        "each instance once; other entities skipped"
    );
    assert_eq!(
        events[0].event,
        Event::ScheduledChange {
            code: "instance-stop".into(),
            start: t("2026-12-05T15:10:09Z"),
            aws_code: "AWS_EC2_INSTANCE_STOP_SCHEDULED".into(),
            arn: "arn:aws:health:us-east-2::event/EC2/AWS_EC2_INSTANCE_STOP_SCHEDULED/x".into(),
            status: HealthStatus::Open,
        }
    );
}

/// The Health API's `EventStatusCode`: `upcoming`, `open`, `closed`. Each is relayed with
/// the event's ARN (a `closed` update withdraws the event on the node); anything else is
/// an error.
#[test]
fn a_health_events_status_and_arn_are_kept() {
    let with_status = |status: Value| {
        let mut v: Value = serde_json::from_str(&health(
            "EC2",
            "scheduledChange",
            "AWS_EC2_INSTANCE_RETIREMENT_SCHEDULED",
            json!([{"entityValue": I}]),
        ))
        .unwrap();
        v["detail"]["statusCode"] = status;
        v.to_string()
    };
    for (raw, status) in [
        ("upcoming", HealthStatus::Upcoming),
        ("open", HealthStatus::Open),
        ("closed", HealthStatus::Closed),
    ] {
        let r = relayed_one(&with_status(json!(raw)));
        assert!(
            matches!(&r.event, Event::ScheduledChange { status: s, arn, .. }
                if *s == status && arn.ends_with("AWS_EC2_INSTANCE_STOP_SCHEDULED/x")),
            "{raw}: {:?}",
            r.event
        );
    }
    for bad in [json!("resolved"), json!("CLOSED"), json!(1)] {
        assert_eq!(
            parse(&with_status(bad.clone())).unwrap_err().metric_label(),
            "invalid",
            "{bad}"
        );
    }
    let mut v: Value = serde_json::from_str(&with_status(json!("open"))).unwrap();
    // Longer than a relayed field (the Health API allows 1,600 bytes): relayed without it.
    v["detail"]["eventArn"] = json!("a".repeat(MAX_FIELD + 1));
    let r = relayed_one(&v.to_string());
    assert!(
        matches!(&r.event, Event::ScheduledChange { arn, .. } if arn.is_empty()),
        "{:?}",
        r.event
    );
}

#[test]
fn health_codes_are_classified_by_what_they_end() {
    for (aws, code) in [
        ("AWS_EC2_INSTANCE_STOP_SCHEDULED", "instance-stop"),
        (
            "AWS_EC2_INSTANCE_RETIREMENT_SCHEDULED",
            "instance-retirement",
        ),
        (
            "AWS_EC2_PERSISTENT_INSTANCE_RETIREMENT_SCHEDULED",
            "instance-retirement",
        ),
        (
            "AWS_EC2_INSTANCE_REBOOT_MAINTENANCE_SCHEDULED",
            "instance-reboot",
        ),
        (
            "AWS_EC2_SYSTEM_REBOOT_MAINTENANCE_SCHEDULED",
            "system-reboot",
        ),
        ("AWS_EC2_SYSTEM_MAINTENANCE_SCHEDULED", "system-maintenance"),
        (
            "AWS_EC2_DEDICATED_HOST_NETWORK_MAINTENANCE_SCHEDULED",
            "system-maintenance",
        ),
    ] {
        assert_eq!(scheduled_code(aws), Some(code), "{aws}");
    }
    for aws in [
        "AWS_EC2_OPERATIONAL_ISSUE",
        "AWS_EC2_SOMETHING_SCHEDULED",
        "AWS_RDS_MAINTENANCE_SCHEDULED",
        "",
    ] {
        assert_eq!(scheduled_code(aws), None, "{aws}");
    }
    let e = parse(&health(
        "EC2",
        "scheduledChange",
        "AWS_EC2_SOMETHING_SCHEDULED",
        json!([{"entityValue": I}]),
    ))
    .unwrap_err();
    assert_eq!(e.metric_label(), "unknown_code");
    assert_eq!(e.detail_type(), HEALTH);
}

#[test]
fn non_ec2_health_events_and_other_categories_are_ignored() {
    for (service, category) in [
        ("RDS", "scheduledChange"),
        ("EC2", "issue"),
        ("EC2", "accountNotification"),
    ] {
        assert_eq!(
            parse(&health(
                service,
                category,
                "AWS_EC2_INSTANCE_STOP_SCHEDULED",
                json!([{"entityValue": I}])
            )),
            Ok(Parsed::Ignored {
                why: Ignored::OtherHealth
            }),
            "{service} {category}"
        );
    }
}

#[test]
fn a_health_event_with_an_rfc3339_start_or_none() {
    let mut v: Value = serde_json::from_str(&health(
        "EC2",
        "scheduledChange",
        "AWS_EC2_SYSTEM_MAINTENANCE_SCHEDULED",
        json!([{"entityValue": I}]),
    ))
    .unwrap();
    v["detail"]["startTime"] = json!("2026-12-05T15:10:09Z");
    let r = relayed_one(&v.to_string());
    assert!(
        matches!(r.event, Event::ScheduledChange { start, .. } if start == t("2026-12-05T15:10:09Z"))
    );
    v["detail"].as_object_mut().unwrap().remove("startTime");
    assert_eq!(parse(&v.to_string()).unwrap_err().metric_label(), "invalid");
}

fn lifecycle_detail(transition: &str) -> Value {
    json!({
        "LifecycleActionToken": "87654321-4321-4321-4321-210987654321",
        "AutoScalingGroupName": "game-nodes",
        "LifecycleHookName": "lastcall-drain",
        "EC2InstanceId": I,
        "LifecycleTransition": transition,
        "Origin": "AutoScalingGroup",
        "Destination": "EC2",
    })
}

#[test]
fn a_terminate_lifecycle_action_and_a_launch() {
    let r = relayed_one(&eb(
        TERMINATE_ACTION,
        "aws.autoscaling",
        lifecycle_detail(TERMINATING),
    ));
    assert_eq!(
        r.event,
        Event::TerminateLifecycleAction {
            group: "game-nodes".into(),
            hook: "lastcall-drain".into()
        }
    );
    assert_eq!(
        parse(&eb(
            LAUNCH_ACTION,
            "aws.autoscaling",
            lifecycle_detail(LAUNCHING)
        )),
        Ok(Parsed::Ignored {
            why: Ignored::Launch
        })
    );
}

fn raw_notification() -> Value {
    json!({
        "Origin": "AutoScalingGroup",
        "Destination": "EC2",
        "Service": "AWS Auto Scaling",
        "Time": "2026-12-01T10:00:00.517Z",
        "AccountId": "123456789012",
        "LifecycleTransition": TERMINATING,
        "RequestId": "c613620e-07e2-4ed2-a9e2-ef8258911ade",
        "LifecycleActionToken": "bcd2f1b8-9a78-44d3-8a7a-4dd07d7cf635",
        "EC2InstanceId": I,
        "LifecycleHookName": "lastcall-drain",
        "AutoScalingGroupName": "game-nodes",
    })
}

#[test]
fn a_raw_and_an_sns_wrapped_auto_scaling_notification() {
    let raw = raw_notification();
    let r = relayed_one(&raw.to_string());
    assert_eq!(r.id, "c613620e-07e2-4ed2-a9e2-ef8258911ade");
    assert_eq!(r.time, t("2026-12-01T10:00:00.517Z"));
    assert!(matches!(r.event, Event::TerminateLifecycleAction { .. }));
    let sns = json!({
        "Type": "Notification",
        "MessageId": "b9a8b0b4-0b5e-5b4c-9c3a-0a1b2c3d4e5f",
        "TopicArn": "arn:aws:sns:us-east-2:123456789012:lifecycle",
        "Subject": "Auto Scaling:  Lifecycle action 'TERMINATING'",
        "Message": raw.to_string(),
        "Timestamp": "2026-12-01T10:00:00.600Z",
        "SignatureVersion": "1",
    });
    assert_eq!(relayed_one(&sns.to_string()), r, "the same event unwrapped");
}

#[test]
fn test_notifications_are_ignored_raw_wrapped_or_through_eventbridge() {
    let test = json!({
        "AccountId": "123456789012",
        "RequestId": "4e6156f4-a9e2-4bda-a7fd-33f2ae528958",
        "AutoScalingGroupARN": "arn:aws:autoscaling:us-east-2:123456789012:autoScalingGroup:x:autoScalingGroupName/game-nodes",
        "AutoScalingGroupName": "game-nodes",
        "Service": "AWS Auto Scaling",
        "Event": "autoscaling:TEST_NOTIFICATION",
        "Time": "2026-12-01T10:00:00.517Z",
    });
    let wrapped = json!({"Type": "Notification", "Message": test.to_string()});
    let mut bridged = lifecycle_detail(TERMINATING);
    bridged["Event"] = json!(TEST_NOTIFICATION);
    for body in [
        test.to_string(),
        wrapped.to_string(),
        eb(TERMINATE_ACTION, "aws.autoscaling", bridged),
    ] {
        assert_eq!(
            parse(&body),
            Ok(Parsed::Ignored {
                why: Ignored::TestNotification
            }),
            "{body}"
        );
    }
}

/// What someone who can send to the queue (or who misconfigured a rule) would send: each is
/// an error with a bounded label, never an event to relay.
#[test]
fn hostile_bodies_are_errors_never_events() {
    let spot = |detail: Value| eb(SPOT, "aws.ec2", detail);
    let mut wrong_version: Value = serde_json::from_str(&spot(
        json!({"instance-id": I, "instance-action": "terminate"}),
    ))
    .unwrap();
    wrong_version["version"] = json!("1");
    let mut numeric_version = wrong_version.clone();
    numeric_version["version"] = json!(0);
    let mut bad_time = wrong_version.clone();
    bad_time["version"] = json!("0");
    bad_time["time"] = json!("yesterday");
    let mut no_id = bad_time.clone();
    no_id["time"] = json!("2026-12-01T10:00:00Z");
    no_id["id"] = json!("");
    let mut huge_id = no_id.clone();
    huge_id["id"] = json!("x".repeat(MAX_FIELD + 1));
    let doubly_wrapped = json!({"Type": "Notification", "Message": json!({"Type": "Notification", "Message": raw_notification().to_string()}).to_string()});
    let mut raw_bad_instance = raw_notification();
    raw_bad_instance["EC2InstanceId"] = json!("ip-10-0-0-1.ec2.internal");
    let mut raw_no_hook = raw_notification();
    raw_no_hook
        .as_object_mut()
        .unwrap()
        .remove("LifecycleHookName");
    let many = json!(
        (0..=MAX_ENTITIES)
            .map(|_| json!({"entityValue": I}))
            .collect::<Vec<_>>()
    );
    let cases: Vec<(String, &str)> = vec![
        ("x".repeat(MAX_BODY + 1), "too_large"),
        (format!("{{\"detail-type\": \"{}\"}}", "a".repeat(MAX_BODY)), "too_large"),
        ("".into(), "not_json"),
        ("{".into(), "not_json"),
        ("[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[".into(), "not_json"),
        ("null".into(), "unknown_shape"),
        ("[]".into(), "unknown_shape"),
        ("\"EC2 Spot Instance Interruption Warning\"".into(), "unknown_shape"),
        ("{}".into(), "unknown_shape"),
        (json!({"hello": "world"}).to_string(), "unknown_shape"),
        (eb("EC2 Fleet Error", "aws.ec2", json!({})), "unknown_detail_type"),
        (eb("Scheduled Event", "aws.events", json!({})), "unknown_detail_type"),
        (eb(SPOT, "evil.corp", json!({"instance-id": I, "instance-action": "terminate"})), "invalid"),
        (eb(SPOT, "aws.health", json!({"instance-id": I, "instance-action": "terminate"})), "invalid"),
        (spot(json!({"instance-id": I})), "invalid"),
        (spot(json!({"instance-id": I, "instance-action": "explode"})), "invalid"),
        (spot(json!({"instance-id": 42, "instance-action": "terminate"})), "invalid"),
        (spot(json!({"instance-id": "i-../../etc", "instance-action": "terminate"})), "invalid"),
        (spot(json!({"instance-id": "ip-10-0-0-1.ec2.internal", "instance-action": "terminate"})), "invalid"),
        (spot(json!("not an object")), "invalid"),
        (spot(json!(null)), "invalid"),
        (wrong_version.to_string(), "version"),
        (numeric_version.to_string(), "invalid"),
        (bad_time.to_string(), "invalid"),
        (no_id.to_string(), "invalid"),
        (huge_id.to_string(), "invalid"),
        (json!({"detail-type": SPOT}).to_string(), "invalid"),
        (json!({"Type": "Notification"}).to_string(), "invalid"),
        (json!({"Type": "Notification", "Message": "not json"}).to_string(), "invalid"),
        (json!({"Type": "Notification", "Message": {"nested": "object"}}).to_string(), "invalid"),
        (doubly_wrapped.to_string(), "unknown_shape"),
        (raw_bad_instance.to_string(), "invalid"),
        (raw_no_hook.to_string(), "invalid"),
        (json!({"Service": "AWS Auto Scaling", "LifecycleTransition": "autoscaling:EC2_INSTANCE_EXPLODING"}).to_string(), "invalid"),
        (eb(TERMINATE_ACTION, "aws.autoscaling", lifecycle_detail("autoscaling:EC2_INSTANCE_EXPLODING")), "invalid"),
        (health("EC2", "scheduledChange", "AWS_EC2_INSTANCE_STOP_SCHEDULED", many), "invalid"),
        (health("EC2", "scheduledChange", "AWS_EC2_INSTANCE_STOP_SCHEDULED", json!("all")), "invalid"),
    ];
    for (body, label) in &cases {
        let shown = &body[..body.len().min(120)];
        match parse(body) {
            Err(e) => {
                assert_eq!(e.metric_label(), *label, "{shown}: {e}");
                assert!(e.to_string().len() < 600, "the error stays short: {e}");
                assert!(e.detail_type().len() <= 64);
            }
            Ok(p) => panic!("{shown}: accepted as {p:?}"),
        }
    }
}

#[test]
fn a_long_detail_type_is_told_cut() {
    let e = parse(&eb(&"Z".repeat(10_000), "aws.ec2", json!({}))).unwrap_err();
    assert_eq!(e.detail_type().len(), 64);
}
