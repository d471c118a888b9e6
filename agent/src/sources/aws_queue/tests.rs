//! A relayed event must say what the same event read on the node says. The truths come from
//! AWS's documentation: a Spot warning comes two minutes before the interruption, except a
//! hibernation, which starts at once ("Spot Instance interruption notices"); the IMDS
//! `spot/instance-action` body names the interruption's own time; a Health scheduled
//! change's `startTime` is the window's start, the same time IMDS shows as `NotBefore`.

use super::*;
use crate::sources::aws_imds::{self, View};
use lastcall_common::aws_events::InstanceState;

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
