//! A relayed event must say what the same event read on the node says. The truths come from
//! AWS's documentation: a Spot warning comes two minutes before the interruption, except a
//! hibernation, which starts at once ("Spot Instance interruption notices"); the IMDS
//! `spot/instance-action` body names the interruption's own time; a Health scheduled
//! change's `startTime` is the window's start, the same time IMDS shows as `NotBefore`.

use super::*;
use crate::sources::aws_imds::{self, View};
use lastcall_common::aws_events::{HealthStatus, InstanceState};

const ME: &str = "i-0123456789abcdef0";

fn t(s: &str) -> Timestamp {
    s.parse().unwrap()
}

fn ev(id: &str, time: &str, event: Event) -> Relayed {
    Relayed {
        instance: ME.into(),
        id: id.into(),
        time: t(time),
        event,
    }
}

fn settings() -> Settings {
    Settings {
        rebalance_ttl: Duration::from_secs(1800),
        maintenance_lead: Duration::from_secs(600),
        lifecycle_held_elsewhere: false,
    }
}

/// What `aws_imds` says for `view`, with the source and ids set aside.
fn imds(view: View, now: Timestamp) -> Vec<(Cause, Severity, Option<Timestamp>, bool)> {
    let s = aws_imds::Settings {
        rebalance_ttl: settings().rebalance_ttl,
        maintenance_lead: settings().maintenance_lead,
    };
    match aws_imds::report(&view, &s, now) {
        Report::Known(n) => n
            .into_iter()
            .map(|n| (n.cause, n.severity, n.deadline, n.cancellable))
            .collect(),
        Report::Unknown => panic!("unknown"),
    }
}

fn queue(events: &[Relayed], now: Timestamp) -> Vec<(Cause, Severity, Option<Timestamp>, bool)> {
    let refs: Vec<&Relayed> = events.iter().collect();
    notices(&refs, &settings(), now)
        .into_iter()
        .inspect(|n| assert_eq!(n.source, SOURCE))
        .map(|n| (n.cause, n.severity, n.deadline, n.cancellable))
        .collect()
}

fn quiet() -> View {
    View {
        spot: Some(None),
        rebalance: Some(None),
        scheduled: Some(vec![]),
        terminating: Some(false),
    }
}

#[test]
fn a_spot_warning_says_what_imds_says_two_minutes_later() {
    let now = t("2026-12-01T10:00:05Z");
    let relayed = [ev(
        "e1",
        "2026-12-01T10:00:00Z",
        Event::SpotInterruption {
            action: SpotAction::Terminate,
        },
    )];
    let on_node = View {
        spot: Some(Some(t("2026-12-01T10:02:00Z"))),
        ..quiet()
    };
    assert_eq!(queue(&relayed, now), imds(on_node, now));
}

#[test]
fn a_hibernation_starts_at_once() {
    let now = t("2026-12-01T10:00:05Z");
    let relayed = [ev(
        "e1",
        "2026-12-01T10:00:00Z",
        Event::SpotInterruption {
            action: SpotAction::Hibernate,
        },
    )];
    assert_eq!(
        queue(&relayed, now),
        [(
            Cause::Preemption,
            Severity::Terminate,
            Some(t("2026-12-01T10:00:00Z")),
            false
        )]
    );
}

#[test]
fn a_spot_time_never_moves_later() {
    let now = t("2026-12-01T10:00:40Z");
    let spot = |id, time| {
        ev(
            id,
            time,
            Event::SpotInterruption {
                action: SpotAction::Stop,
            },
        )
    };
    let events = [
        spot("late", "2026-12-01T10:00:30Z"),
        spot("first", "2026-12-01T10:00:00Z"),
    ];
    assert_eq!(
        queue(&events, now),
        [(
            Cause::Preemption,
            Severity::Terminate,
            Some(t("2026-12-01T10:02:00Z")),
            false
        )]
    );
}

#[test]
fn a_rebalance_is_a_cancellable_drain_that_lapses_as_on_the_node() {
    let relayed = [ev(
        "r",
        "2026-12-01T10:00:00Z",
        Event::RebalanceRecommendation,
    )];
    for now in [
        "2026-12-01T10:00:01Z",
        "2026-12-01T10:29:59Z",
        "2026-12-01T10:30:00Z",
    ] {
        let now = t(now);
        let on_node = View {
            rebalance: Some(Some(t("2026-12-01T10:00:00Z"))),
            ..quiet()
        };
        assert_eq!(queue(&relayed, now), imds(on_node, now), "{now}");
    }
    assert!(queue(&relayed, t("2026-12-01T10:30:00Z")).is_empty());
}

#[test]
fn a_health_event_is_the_same_scheduled_event_as_imds_shows() {
    for (code, aws_code) in [
        ("instance-stop", "AWS_EC2_INSTANCE_STOP_SCHEDULED"),
        ("system-maintenance", "AWS_EC2_SYSTEM_MAINTENANCE_SCHEDULED"),
        (
            "system-reboot",
            "AWS_EC2_SYSTEM_REBOOT_MAINTENANCE_SCHEDULED",
        ),
    ] {
        let start = t("2026-12-05T15:00:00Z");
        let relayed = [ev(
            "h",
            "2026-12-01T10:00:00Z",
            Event::ScheduledChange {
                code: code.into(),
                start,
                aws_code: aws_code.into(),
                arn: format!("arn:aws:health:us-east-1::event/EC2/{aws_code}/1"),
                status: HealthStatus::Upcoming,
            },
        )];
        for now in ["2026-12-01T10:00:01Z", "2026-12-05T14:55:00Z"] {
            let now = t(now);
            let on_node = View {
                scheduled: Some(vec![Scheduled {
                    id: "x".into(),
                    code: Code::parse(code).unwrap(),
                    not_before: start,
                }]),
                ..quiet()
            };
            let q = queue(&relayed, now);
            assert_eq!(q, imds(on_node, now), "{code} at {now}");
            assert_eq!(q[0].2, Some(start), "the window's start is the deadline");
        }
    }
}

#[test]
fn a_state_change_that_ends_the_instance_is_now() {
    for state in [
        InstanceState::Stopping,
        InstanceState::ShuttingDown,
        InstanceState::Stopped,
        InstanceState::Terminated,
    ] {
        let relayed = [ev(
            "s",
            "2026-12-01T10:00:00Z",
            Event::StateChange { state },
        )];
        assert_eq!(
            queue(&relayed, t("2026-12-01T10:00:01Z")),
            [(
                Cause::Preemption,
                Severity::Terminate,
                Some(t("2026-12-01T10:00:00Z")),
                false
            )]
        );
    }
}

#[test]
fn a_lifecycle_action_is_what_imds_says_for_terminated_unless_the_hold_has_it() {
    let now = t("2026-12-01T10:00:01Z");
    let relayed = [ev(
        "l",
        "2026-12-01T10:00:00Z",
        Event::TerminateLifecycleAction {
            group: "g".into(),
            hook: "h".into(),
        },
    )];
    let on_node = View {
        terminating: Some(true),
        ..quiet()
    };
    assert_eq!(queue(&relayed, now), imds(on_node, now));
    let refs: Vec<&Relayed> = relayed.iter().collect();
    let held = Settings {
        lifecycle_held_elsewhere: true,
        ..settings()
    };
    assert!(notices(&refs, &held, now).is_empty());
}

#[test]
fn an_old_event_stops_counting() {
    let relayed = [
        ev(
            "s",
            "2026-12-01T10:00:00Z",
            Event::SpotInterruption {
                action: SpotAction::Stop,
            },
        ),
        ev(
            "st",
            "2026-12-01T10:00:00Z",
            Event::StateChange {
                state: InstanceState::Stopping,
            },
        ),
    ];
    assert_eq!(queue(&relayed, t("2026-12-01T10:59:59Z")).len(), 2);
    assert!(
        queue(&relayed, t("2026-12-01T11:02:00Z")).is_empty(),
        "stopped and started again an hour later: the old events do not drain it"
    );
}

fn health(id: &str, time: &str, arn: &str, status: HealthStatus, start: &str) -> Relayed {
    ev(
        id,
        time,
        Event::ScheduledChange {
            code: "instance-retirement".into(),
            start: t(start),
            aws_code: "AWS_EC2_INSTANCE_RETIREMENT_SCHEDULED".into(),
            arn: arn.into(),
            status,
        },
    )
}

/// AWS Health's statuses (the Health API's `EventStatusCode`: `upcoming`, `open`, `closed`)
/// arrive as updates of one event, each under a new EventBridge id and the same `eventArn`.
/// `closed` means the change is over (done, or cancelled): instance metadata then lists the
/// scheduled event as completed or canceled, which is no signal (`aws_imds`), so the
/// relayed one clears too. A redelivered earlier update never brings it back.
#[test]
fn a_closed_health_event_withdraws_it_and_an_older_update_does_not_bring_it_back() {
    const A: &str = "arn:aws:health:us-east-1::event/EC2/AWS_EC2_INSTANCE_RETIREMENT_SCHEDULED/a";
    const B: &str = "arn:aws:health:us-east-1::event/EC2/AWS_EC2_INSTANCE_RETIREMENT_SCHEDULED/b";
    let now = t("2026-12-02T10:00:00Z");
    let start = "2026-12-05T15:00:00Z";
    let upcoming = health(
        "u",
        "2026-12-01T10:00:00Z",
        A,
        HealthStatus::Upcoming,
        start,
    );
    let open = health("o", "2026-12-02T09:00:00Z", A, HealthStatus::Open, start);
    let closed = health("c", "2026-12-02T09:30:00Z", A, HealthStatus::Closed, start);
    let other = health(
        "x",
        "2026-12-01T11:00:00Z",
        B,
        HealthStatus::Upcoming,
        start,
    );
    let told = |events: &[&Relayed]| {
        notices(events, &settings(), now)
            .into_iter()
            .map(|n| (n.id, n.deadline))
            .collect::<Vec<_>>()
    };
    let a = (format!("aws_queue:{A}"), Some(t(start)));
    let b = (format!("aws_queue:{B}"), Some(t(start)));
    assert_eq!(told(&[&upcoming]), std::slice::from_ref(&a));
    assert_eq!(
        told(&[&upcoming, &open]),
        [a],
        "two updates of one event are one notice"
    );
    assert!(told(&[&upcoming, &open, &closed]).is_empty());
    assert!(
        told(&[&closed, &upcoming]).is_empty(),
        "the earlier update redelivered after the closed one"
    );
    assert_eq!(
        told(&[&upcoming, &closed, &other]),
        [b],
        "another event stands"
    );
    // Records written before the ARN was kept: each entry is its own event.
    let legacy = |id: &str| health(id, "2026-12-01T10:00:00Z", "", HealthStatus::Open, start);
    let (l1, l2) = (legacy("l1"), legacy("l2"));
    assert_eq!(told(&[&l1, &l2]).len(), 2);
}

/// AWS's documented warning states `instance-termination-time`: an earlier time than two
/// minutes after the warning is the deadline; a later one never moves it past two minutes.
#[test]
fn a_capacity_reservation_warning_ends_at_its_stated_time_or_two_minutes() {
    let now = t("2026-12-01T10:00:05Z");
    for (stated, deadline) in [
        (None, "2026-12-01T10:02:00Z"),
        (Some("2026-12-01T10:01:30Z"), "2026-12-01T10:01:30Z"),
        (Some("2026-12-01T10:05:00Z"), "2026-12-01T10:02:00Z"),
    ] {
        let relayed = [ev(
            "c",
            "2026-12-01T10:00:00Z",
            Event::CapacityReservationInterruption {
                terminates: stated.map(t),
            },
        )];
        assert_eq!(
            queue(&relayed, now),
            [(
                Cause::Preemption,
                Severity::Terminate,
                Some(t(deadline)),
                false
            )],
            "{stated:?}"
        );
    }
}

/// The source looks again exactly when its notices change by the clock alone.
#[test]
fn the_next_change_is_the_next_lapse_or_lead() {
    let s = settings();
    let next = |events: &[&Relayed], now: &str| read(events, &s, t(now)).next_change;
    let rebalance = ev("r", "2026-12-01T10:00:00Z", Event::RebalanceRecommendation);
    assert_eq!(
        next(&[&rebalance], "2026-12-01T10:00:01Z"),
        Some(t("2026-12-01T10:30:00Z")),
        "--rebalance-ttl"
    );
    assert_eq!(next(&[&rebalance], "2026-12-01T10:30:00Z"), None, "lapsed");
    let maintenance = ev(
        "m",
        "2026-12-01T10:00:00Z",
        Event::ScheduledChange {
            code: "system-maintenance".into(),
            start: t("2026-12-05T15:00:00Z"),
            aws_code: "AWS_EC2_SYSTEM_MAINTENANCE_SCHEDULED".into(),
            arn: "arn".into(),
            status: HealthStatus::Upcoming,
        },
    );
    assert_eq!(
        next(&[&maintenance], "2026-12-01T10:00:01Z"),
        Some(t("2026-12-05T14:50:00Z")),
        "--maintenance-lead before the window: Observe becomes Drain"
    );
    assert_eq!(
        next(&[&maintenance], "2026-12-05T14:50:00Z"),
        Some(t("2026-12-05T16:00:00Z")),
        "then its lapse"
    );
    let spot = ev(
        "s",
        "2026-12-01T10:00:00Z",
        Event::SpotInterruption {
            action: SpotAction::Terminate,
        },
    );
    assert_eq!(
        next(&[&spot], "2026-12-01T10:00:01Z"),
        Some(t("2026-12-01T11:02:00Z"))
    );
    assert_eq!(next(&[], "2026-12-01T10:00:01Z"), None);
}

fn node(record: Option<&Record>) -> k8s_openapi::api::core::v1::Node {
    let mut n = k8s_openapi::api::core::v1::Node::default();
    n.metadata.name = Some("n1".into());
    n.spec = Some(k8s_openapi::api::core::v1::NodeSpec {
        provider_id: Some(format!("aws:///us-east-1a/{ME}")),
        ..Default::default()
    });
    if let Some(r) = record {
        n.metadata.annotations = Some([(ANNOTATION.to_string(), r.to_annotation())].into());
    }
    n
}

/// The source wakes on the Node watch, not on a timer: on a clock that moves only when every
/// task waits on a timer (tokio's paused clock), the relayed warning reaches the notice with
/// the clock where it was. A source that looked at its cached Node every so often would
/// need the clock to move first.
#[tokio::test(start_paused = true)]
async fn a_relayed_event_reaches_the_notice_on_the_node_watch_not_on_a_timer() {
    use kube::runtime::{reflector, watcher};
    let (cache, mut writer) = reflector::store();
    let (node_changed, node_changes) = tokio::sync::watch::channel(());
    let kube = super::super::KubeAccess {
        client: kube::Client::try_from(kube::Config::new(
            "http://127.0.0.1:9".parse().expect("a URL"),
        ))
        .expect("a client"),
        node: cache,
        node_changes,
    };
    let s = super::super::test_support::start_source_with(
        SOURCE,
        super::start,
        &["--aws-queue"],
        Some(kube),
    );
    let mut reports = s.updates.clone();
    let t0 = tokio::time::Instant::now();

    // The watch's first list: the Node, nothing relayed yet.
    for e in [
        watcher::Event::Init,
        watcher::Event::InitApply(node(None)),
        watcher::Event::InitDone,
    ] {
        writer.apply_watcher_event(&e);
    }
    node_changed.send_replace(());
    reports.changed().await.expect("a report");
    assert_eq!(*reports.borrow_and_update(), Report::Known(vec![]));

    // pubsub relays a Spot warning: the watch delivers the Node with it.
    let warning = Relayed {
        instance: ME.into(),
        id: "e1".into(),
        time: Timestamp::now(),
        event: Event::SpotInterruption {
            action: SpotAction::Terminate,
        },
    };
    let record = Record::empty()
        .with(warning.clone(), Timestamp::now())
        .expect("new");
    writer.apply_watcher_event(&watcher::Event::Apply(node(Some(&record))));
    node_changed.send_replace(());
    reports.changed().await.expect("a report");
    let notices = match &*reports.borrow_and_update() {
        Report::Known(n) => n.clone(),
        Report::Unknown => panic!("unknown"),
    };
    assert_eq!(notices.len(), 1, "{notices:?}");
    assert_eq!(notices[0].cause, Cause::Preemption);
    assert_eq!(notices[0].deadline, Some(warning.time + SPOT_NOTICE));
    assert_eq!(
        tokio::time::Instant::now() - t0,
        Duration::ZERO,
        "the notice came without the clock moving: no timer fired"
    );
}
