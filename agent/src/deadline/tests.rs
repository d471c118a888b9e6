//! One table: live notices × record × unknown sources × now → the announced deadline, the
//! pressing deadline, whether a match may be ended now, and the record kept.

use super::*;
use crate::sources::{aws_imds, azure_events, fleetiq, gce_metadata, node};

const IMDS: Source = aws_imds::SOURCE;
const FLEETIQ: Source = fleetiq::SOURCE;
const GCE: Source = gce_metadata::SOURCE;
const GKE: Source = node::GKE;
const AZURE: Source = azure_events::SOURCE;

/// The game's grace period in every row.
const GRACE: Duration = Duration::from_secs(120);
/// `--drain-deadline` in every row.
const DEFAULT: Duration = Duration::from_secs(30 * 60);

/// Minutes after the drain's start.
fn t(min: i64) -> Timestamp {
    let t0: Timestamp = "2026-11-30T05:00:00Z".parse().unwrap();
    t0 + SignedDuration::from_mins(min)
}

fn live(source: Source, cause: Cause, severity: Severity, at: Option<i64>, cancel: bool) -> Notice {
    Notice::new(source, cause, severity, at.map(t), cancel, String::new())
}

/// A scheduled event: Terminate at `at`, cancellable, a time the provider stated.
fn event(at: i64) -> Notice {
    live(
        IMDS,
        Cause::Maintenance,
        Severity::Terminate,
        Some(at),
        true,
    )
}

/// A Spot notice: two minutes from first sight, final.
fn spot(at: i64) -> Notice {
    Notice {
        estimated_deadline: true,
        ..live(
            FLEETIQ,
            Cause::Preemption,
            Severity::Terminate,
            Some(at),
            false,
        )
    }
}

/// GCE `TERMINATE_ON_HOST_MAINTENANCE`: cancellable, counted from first sight.
fn gce_terminate(at: i64) -> Notice {
    Notice {
        estimated_deadline: true,
        ..live(GCE, Cause::Maintenance, Severity::Terminate, Some(at), true)
    }
}

/// An EC2 Spot `instance-action`: a time AWS stated, final, never moved.
fn ec2_spot(at: i64) -> Notice {
    live(
        IMDS,
        Cause::Preemption,
        Severity::Terminate,
        Some(at),
        false,
    )
}

/// An Azure `Preempt`: a time the platform stated, final, restated while it stands.
fn azure_preempt(at: i64) -> Notice {
    Notice {
        restated: true,
        ..live(
            AZURE,
            Cause::Preemption,
            Severity::Terminate,
            Some(at),
            false,
        )
    }
}

fn draining() -> Notice {
    live(FLEETIQ, Cause::Viability, Severity::Drain, None, true)
}

fn rec(n: &Notice, first_seen: i64) -> Entry {
    Entry {
        source: n.source,
        cause: n.cause,
        severity: n.severity,
        deadline: n.deadline,
        cancellable: n.cancellable,
        first_seen: t(first_seen),
        restated: n.restated,
    }
}

struct Row {
    name: &'static str,
    live: Vec<Notice>,
    record: Vec<Entry>,
    unknown: Vec<Source>,
    now: i64,
    /// (minutes, where from)
    announced: Option<(i64, Origin)>,
    /// The pressing deadline (current only), and its severity.
    pressure: Option<(Severity, Option<i64>)>,
    may_end: bool,
    /// The record kept: (source, deadline minutes, first seen minutes).
    kept: Vec<(Source, Option<i64>, i64)>,
}

#[test]
fn the_current_deadline() {
    use Origin::{Default as Def, Live, Record};
    let rows = vec![
        Row {
            name: "nothing asks",
            live: vec![],
            record: vec![],
            unknown: vec![],
            now: 0,
            announced: None,
            pressure: None,
            may_end: false,
            kept: vec![],
        },
        Row {
            name: "observe-only notices ask for nothing",
            live: vec![live(
                GKE,
                Cause::Maintenance,
                Severity::Observe,
                Some(60),
                true,
            )],
            record: vec![],
            unknown: vec![],
            now: 0,
            announced: None,
            pressure: None,
            may_end: false,
            kept: vec![],
        },
        Row {
            name: "a scheduled event, before deadline − grace",
            live: vec![event(60)],
            record: vec![],
            unknown: vec![],
            now: 57,
            announced: Some((60, Live(IMDS))),
            pressure: Some((Severity::Terminate, Some(60))),
            may_end: false,
            kept: vec![(IMDS, Some(60), 57)],
        },
        Row {
            name: "a scheduled event, at deadline − grace",
            live: vec![event(60)],
            record: vec![rec(&event(60), 0)],
            unknown: vec![],
            now: 58,
            announced: Some((60, Live(IMDS))),
            pressure: Some((Severity::Terminate, Some(60))),
            may_end: true,
            kept: vec![(IMDS, Some(60), 0)],
        },
        Row {
            name: "an event rescheduled later: the source moved it, the old date ends nothing",
            live: vec![event(600)],
            record: vec![rec(&event(60), 0)],
            unknown: vec![],
            now: 59,
            announced: Some((600, Live(IMDS))),
            pressure: Some((Severity::Terminate, Some(600))),
            may_end: false,
            kept: vec![(IMDS, Some(600), 0)],
        },
        Row {
            name: "an event moved earlier",
            live: vec![event(30)],
            record: vec![rec(&event(60), 0)],
            unknown: vec![],
            now: 29,
            announced: Some((30, Live(IMDS))),
            pressure: Some((Severity::Terminate, Some(30))),
            may_end: true,
            kept: vec![(IMDS, Some(30), 0)],
        },
        Row {
            name: "a deadline counted from first sight is not moved by a restart",
            live: vec![gce_terminate(130)],
            record: vec![rec(&gce_terminate(60), 0)],
            unknown: vec![],
            now: 59,
            announced: Some((60, Record(GCE))),
            pressure: Some((Severity::Terminate, Some(60))),
            may_end: true,
            kept: vec![(GCE, Some(60), 0)],
        },
        Row {
            name: "Spot re-anchored by a restart keeps its recorded deadline",
            live: vec![spot(7)],
            record: vec![rec(&spot(2), 0)],
            unknown: vec![],
            now: 0,
            announced: Some((2, Record(FLEETIQ))),
            pressure: Some((Severity::Terminate, Some(2))),
            may_end: true,
            kept: vec![(FLEETIQ, Some(2), 0)],
        },
        Row {
            name: "an EC2 Spot time read again later keeps the recorded one",
            live: vec![ec2_spot(7)],
            record: vec![rec(&ec2_spot(2), 0)],
            unknown: vec![],
            now: 0,
            announced: Some((2, Record(IMDS))),
            pressure: Some((Severity::Terminate, Some(2))),
            may_end: true,
            kept: vec![(IMDS, Some(2), 0)],
        },
        Row {
            name: "an Azure Preempt the platform postponed is later: no match ends at its old time",
            live: vec![azure_preempt(7)],
            record: vec![rec(&azure_preempt(2), 0)],
            unknown: vec![],
            now: 0,
            announced: Some((7, Live(AZURE))),
            pressure: Some((Severity::Terminate, Some(7))),
            may_end: false,
            kept: vec![(AZURE, Some(7), 0)],
        },
        Row {
            name: "an Azure Preempt moved earlier is earlier",
            live: vec![azure_preempt(1)],
            record: vec![rec(&azure_preempt(2), 0)],
            unknown: vec![],
            now: 0,
            announced: Some((1, Live(AZURE))),
            pressure: Some((Severity::Terminate, Some(1))),
            may_end: true,
            kept: vec![(AZURE, Some(1), 0)],
        },
        Row {
            name: "an Azure Preempt gone from the document stays (cannot be withdrawn)",
            live: vec![],
            record: vec![rec(&azure_preempt(2), 0)],
            unknown: vec![],
            now: 0,
            announced: Some((2, Record(AZURE))),
            pressure: Some((Severity::Terminate, Some(2))),
            may_end: true,
            kept: vec![(AZURE, Some(2), 0)],
        },
        Row {
            name: "an Azure Preempt recorded, Azure unheard since a restart: the platform may have postponed it meanwhile, so its old time ends no match until Azure answers",
            live: vec![],
            record: vec![rec(&azure_preempt(2), 0)],
            unknown: vec![AZURE],
            now: 0,
            announced: Some((2, Record(AZURE))),
            pressure: Some((Severity::Terminate, None)),
            may_end: false,
            kept: vec![(AZURE, Some(2), 0)],
        },
        Row {
            name: "an EC2 Spot time recorded, IMDS unheard since a restart: its time never moves, still binding",
            live: vec![],
            record: vec![rec(&ec2_spot(2), 0)],
            unknown: vec![IMDS],
            now: 0,
            announced: Some((2, Record(IMDS))),
            pressure: Some((Severity::Terminate, Some(2))),
            may_end: true,
            kept: vec![(IMDS, Some(2), 0)],
        },
        Row {
            name: "Spot, then a lagging replica says ACTIVE: still binding",
            live: vec![],
            record: vec![rec(&spot(2), 0)],
            unknown: vec![],
            now: 0,
            announced: Some((2, Record(FLEETIQ))),
            pressure: Some((Severity::Terminate, Some(2))),
            may_end: true,
            kept: vec![(FLEETIQ, Some(2), 0)],
        },
        Row {
            name: "Spot recorded, FleetIQ unknown after a restart: still binding",
            live: vec![],
            record: vec![rec(&spot(2), 0)],
            unknown: vec![FLEETIQ],
            now: -1,
            announced: Some((2, Record(FLEETIQ))),
            pressure: Some((Severity::Terminate, Some(2))),
            may_end: false,
            kept: vec![(FLEETIQ, Some(2), 0)],
        },
        Row {
            name: "a recorded event whose source is unknown: announced, never ends a match",
            live: vec![],
            record: vec![rec(&event(60), 0)],
            unknown: vec![IMDS],
            now: 59,
            announced: Some((60, Record(IMDS))),
            pressure: Some((Severity::Terminate, None)),
            may_end: false,
            kept: vec![(IMDS, Some(60), 0)],
        },
        Row {
            name: "a recorded event its source no longer reports: withdrawn",
            live: vec![],
            record: vec![rec(&event(60), 0)],
            unknown: vec![],
            now: 59,
            announced: None,
            pressure: None,
            may_end: false,
            kept: vec![],
        },
        Row {
            name: "a drain without a deadline, joined by a later event: announced stays",
            live: vec![draining(), event(120)],
            record: vec![rec(&draining(), 0)],
            unknown: vec![],
            now: 10,
            announced: Some((30, Def(FLEETIQ))),
            pressure: Some((Severity::Terminate, Some(120))),
            may_end: false,
            kept: vec![(IMDS, Some(120), 10), (FLEETIQ, None, 0)],
        },
        Row {
            name: "the drain without a deadline withdrawn: the event's own deadline",
            live: vec![event(120)],
            record: vec![rec(&draining(), 0), rec(&event(120), 10)],
            unknown: vec![],
            now: 20,
            announced: Some((120, Live(IMDS))),
            pressure: Some((Severity::Terminate, Some(120))),
            may_end: false,
            kept: vec![(IMDS, Some(120), 10)],
        },
        Row {
            name: "a live drain and an unconfirmed Terminate: announced early, protect only",
            live: vec![draining()],
            record: vec![rec(&draining(), 0), rec(&event(20), 0)],
            unknown: vec![IMDS],
            now: 19,
            announced: Some((20, Record(IMDS))),
            pressure: Some((Severity::Terminate, None)),
            may_end: false,
            kept: vec![(IMDS, Some(20), 0), (FLEETIQ, None, 0)],
        },
        Row {
            name: "a current Terminate beats an earlier unconfirmed one for ending",
            live: vec![live(
                GKE,
                Cause::Maintenance,
                Severity::Terminate,
                Some(60),
                true,
            )],
            record: vec![rec(&event(30), 0)],
            unknown: vec![IMDS],
            now: 58,
            announced: Some((30, Record(IMDS))),
            pressure: Some((Severity::Terminate, Some(60))),
            may_end: true,
            kept: vec![(IMDS, Some(30), 0), (GKE, Some(60), 58)],
        },
        Row {
            name: "a current Drain with a date and an unconfirmed Terminate: protect only",
            live: vec![live(
                GKE,
                Cause::Maintenance,
                Severity::Drain,
                Some(40),
                true,
            )],
            record: vec![rec(&event(60), 0)],
            unknown: vec![IMDS],
            now: 59,
            announced: Some((40, Live(GKE))),
            pressure: Some((Severity::Terminate, None)),
            may_end: false,
            kept: vec![(IMDS, Some(60), 0), (GKE, Some(40), 59)],
        },
        Row {
            name: "a Drain with a deadline (a reboot event) never ends a match",
            live: vec![live(
                IMDS,
                Cause::Maintenance,
                Severity::Drain,
                Some(60),
                true,
            )],
            record: vec![],
            unknown: vec![],
            now: 59,
            announced: Some((60, Live(IMDS))),
            pressure: Some((Severity::Drain, Some(60))),
            may_end: false,
            kept: vec![(IMDS, Some(60), 59)],
        },
        Row {
            name: "a reboot and a stop of one provider: two claims, a Drain's date ends nothing",
            live: vec![
                live(IMDS, Cause::Maintenance, Severity::Drain, Some(90), true),
                event(120),
            ],
            record: vec![],
            unknown: vec![],
            now: 100,
            announced: Some((90, Live(IMDS))),
            pressure: Some((Severity::Terminate, Some(120))),
            may_end: false,
            kept: vec![(IMDS, Some(90), 100), (IMDS, Some(120), 100)],
        },
        Row {
            name: "Terminate without a time: the default is announced, nothing ends",
            live: vec![live(
                IMDS,
                Cause::ScaleDown,
                Severity::Terminate,
                None,
                false,
            )],
            record: vec![],
            unknown: vec![],
            now: 5,
            announced: Some((35, Def(IMDS))),
            pressure: Some((Severity::Terminate, None)),
            may_end: false,
            kept: vec![(IMDS, None, 5)],
        },
        Row {
            name: "two causes of one source: the earliest Terminate presses",
            live: vec![spot(50), event(40)],
            record: vec![rec(&spot(50), 0)],
            unknown: vec![],
            now: 38,
            announced: Some((40, Live(IMDS))),
            pressure: Some((Severity::Terminate, Some(40))),
            may_end: true,
            kept: vec![(IMDS, Some(40), 38), (FLEETIQ, Some(50), 0)],
        },
    ];
    for r in rows {
        let d = current(&Inputs {
            live: &r.live,
            record: &r.record,
            unknown: &r.unknown,
            default_deadline: DEFAULT,
            now: t(r.now),
        });
        let announced = d.announced.map(|a| (a.at, a.origin));
        assert_eq!(
            announced,
            r.announced.map(|(m, o)| (t(m), o)),
            "{}: announced",
            r.name
        );
        assert_eq!(
            d.pressure.map(|p| (p.severity, p.deadline)),
            r.pressure.map(|(s, m)| (s, m.map(t))),
            "{}: pressure",
            r.name
        );
        assert_eq!(
            d.pressure.is_some_and(|p| p.may_end(GRACE, t(r.now))),
            r.may_end,
            "{}: may end",
            r.name
        );
        let kept: Vec<(Source, Option<Timestamp>, Timestamp)> = d
            .record()
            .iter()
            .map(|e| (e.source, e.deadline, e.first_seen))
            .collect();
        let want: Vec<(Source, Option<Timestamp>, Timestamp)> = r
            .kept
            .iter()
            .map(|(s, d, f)| (*s, d.map(t), t(*f)))
            .collect();
        assert_eq!(kept, want, "{}: record", r.name);
    }
}

#[test]
fn a_match_ends_at_deadline_minus_grace_and_only_on_a_dated_terminate() {
    let p = |severity, at: Option<i64>| Pressure {
        cause: Cause::Maintenance,
        severity,
        deadline: at.map(t),
    };
    let dated = p(Severity::Terminate, Some(60));
    assert_eq!(dated.ends_at(GRACE), Some(t(58)));
    assert!(!dated.may_end(GRACE, t(58) - SignedDuration::from_nanos(1)));
    assert!(dated.may_end(GRACE, t(58)));
    // A grace too long to represent: at once.
    assert_eq!(dated.ends_at(Duration::MAX), Some(Timestamp::MIN));
    assert!(dated.may_end(Duration::MAX, t(0)));
    for undated in [
        p(Severity::Terminate, None),
        p(Severity::Drain, Some(60)),
        p(Severity::Observe, Some(60)),
    ] {
        assert_eq!(undated.ends_at(GRACE), None, "{undated:?}");
        assert!(!undated.may_end(GRACE, t(600)), "{undated:?}");
    }
}

#[test]
fn a_recorded_claim_reads_back_as_the_notice_it_was() {
    let e = rec(&event(60), 0);
    let n = e.as_notice();
    assert_eq!(
        (
            n.source,
            n.cause,
            n.severity,
            n.deadline,
            n.cancellable,
            n.cordon
        ),
        (
            IMDS,
            Cause::Maintenance,
            Severity::Terminate,
            Some(t(60)),
            true,
            true
        )
    );
    assert_eq!(n.id, "recorded:aws_imds:maintenance");
    assert!(n.detail.contains("2026-11-30T05:00:00"), "{}", n.detail);
}

#[test]
fn one_source_and_cause_is_one_claim() {
    let claim = |live: &[Notice], record: &[Entry], unknown: &[Source]| {
        current(&Inputs {
            live,
            record,
            unknown,
            default_deadline: DEFAULT,
            now: t(1),
        })
    };
    let final_event = Notice {
        cancellable: false,
        ..event(120)
    };
    // Two notices of one source, cause and severity: one claim, the earliest deadline,
    // final if either is.
    let d = claim(&[event(90), final_event.clone()], &[], &[]);
    let e = &d.record()[..];
    assert_eq!(e.len(), 1, "{e:?}");
    assert_eq!(
        (
            e[0].severity,
            e[0].deadline,
            e[0].cancellable,
            e[0].first_seen
        ),
        (Severity::Terminate, Some(t(90)), false, t(1))
    );
    // Counted from first sight in one of them: the group may not move the record later.
    let estimated = Notice {
        estimated_deadline: true,
        ..event(130)
    };
    let d = claim(&[estimated, event(130)], &[rec(&event(60), 0)], &[]);
    assert_eq!(d.record()[0].deadline, Some(t(60)));
    // A final record stays final and keeps its deadline whatever the live notice says.
    let d = claim(&[event(200)], &[rec(&final_event, 0)], &[]);
    let e = &d.record()[..];
    assert_eq!(e.len(), 1, "{e:?}");
    assert_eq!(
        (e[0].severity, e[0].deadline, e[0].cancellable),
        (Severity::Terminate, Some(t(120)), false)
    );
    // A current Terminate without a time and an unconfirmed one: the current one presses
    // (its cause decides what eviction.safe permits).
    let asg = live(IMDS, Cause::ScaleDown, Severity::Terminate, None, false);
    let d = claim(&[asg], &[rec(&event(60), 0)], &[IMDS]);
    let p = d.pressure.expect("pressure");
    assert_eq!(
        (p.cause, p.severity, p.deadline),
        (Cause::ScaleDown, Severity::Terminate, None)
    );
}
