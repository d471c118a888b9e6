//! The parsers and the notice table, then the source itself against the GCE metadata
//! emulator over real HTTP: hanging GETs, 503 blips and an unreachable server.

use lastcall_emulators::eventually::wait_for;
use lastcall_emulators::gce::GceMetadataEmulator;

use super::*;
use crate::sources::test_support::{Started, start_source};

fn settings() -> Settings {
    Settings {
        endpoint: String::new(),
        wait_timeout: Duration::from_secs(60),
        preemption_notice: Duration::from_secs(30),
        terminate_notice: Duration::from_secs(3600),
        upcoming_interval: Duration::from_secs(60),
        maintenance_lead: Duration::from_secs(3600),
    }
}

fn t(s: &str) -> Timestamp {
    s.parse().unwrap()
}

#[test]
fn event_values_are_classified_and_unknown_ones_are_rejected() {
    assert_eq!(parse_event("NONE\n"), Ok(MaintenanceEvent::None));
    assert_eq!(
        parse_event("MIGRATE_ON_HOST_MAINTENANCE"),
        Ok(MaintenanceEvent::Migrate)
    );
    assert_eq!(
        parse_event(" TERMINATE_ON_HOST_MAINTENANCE\n"),
        Ok(MaintenanceEvent::Terminate)
    );
    for (body, label) in [
        ("", "empty"),
        ("  \n", "empty"),
        ("SHUTDOWN_ON_HOST_MAINTENANCE", "unknown_value"),
        ("<html>", "unknown_value"),
    ] {
        let e = parse_event(body).unwrap_err();
        assert_eq!(e.metric_label(), label, "{body:?}");
    }
    assert_eq!(parse_preempted("TRUE"), Ok(true));
    assert!(parse_preempted("maybe").is_err());
    assert_eq!(parse_preempted("").unwrap_err().metric_label(), "empty");
}

#[test]
fn upcoming_accepts_every_known_shape_and_rejects_garbage() {
    let notice = r#"{"can_reschedule":"true","latest_window_start_time":"2024-12-01T19:00:01Z","maintenance_reasons":["PLANNED_UPDATE"],"maintenance_status":"PENDING","type":"SCHEDULED","window_end_time":"2024-12-01T21:00:01Z","window_start_time":"2024-12-01T19:00:01Z"}"#;
    let u = parse_upcoming(200, notice).unwrap().unwrap();
    assert_eq!(
        (u.window_start, u.status, u.can_reschedule),
        (t("2024-12-01T19:00:01Z"), UpcomingStatus::Pending, true)
    );
    let wrapped = format!(r#"{{"Upcoming maintenance": {notice}}}"#);
    assert_eq!(parse_upcoming(200, &wrapped).unwrap(), Some(u));
    // Only 404 and COMPLETE say "nothing scheduled".
    assert_eq!(parse_upcoming(404, "Not Found"), Ok(None));
    assert_eq!(
        parse_upcoming(
            200,
            r#"{"maintenance_status":"COMPLETE","window_start_time":"2024-12-01T19:00:01Z"}"#
        ),
        Ok(None)
    );
    // Nothing definite: never read as "nothing scheduled".
    for unknown in [
        "",
        "NONE",
        "{ }",
        r#"{"Upcoming maintenance": {}}"#,
        r#"{"error": "no notifications have been received yet, try again later"}"#,
    ] {
        assert_eq!(
            parse_upcoming(200, unknown).map_err(|e| e.metric_label()),
            Err("upcoming_unknown"),
            "{unknown}"
        );
    }
    // Values this version does not know: rejected, never guessed.
    for odd in [
        r#"{"maintenance_status":"POSTPONED","window_start_time":"2024-12-01T19:00:01Z"}"#,
        r#"{"maintenance_status":"PENDING","type":"SURPRISE","window_start_time":"2024-12-01T19:00:01Z"}"#,
        r#"{"maintenance_status":"PENDING","can_reschedule":"maybe","window_start_time":"2024-12-01T19:00:01Z"}"#,
        r#"{"window_start_time":"2024-12-01T19:00:01Z"}"#,
    ] {
        assert_eq!(
            parse_upcoming(200, odd).map_err(|e| e.metric_label()),
            Err("unknown_value"),
            "{odd}"
        );
    }
    for bad in [
        "<html>",
        "[1]",
        r#"{"maintenance_status":"PENDING"}"#,
        r#"{"maintenance_status":"PENDING","window_start_time":"soon"}"#,
    ] {
        assert_eq!(
            parse_upcoming(200, bad).map_err(|e| e.metric_label()),
            Err("bad_upcoming"),
            "{bad}"
        );
    }
    let ongoing = parse_upcoming(
        200,
        r#"{"maintenance_status":"ONGOING","type":"UNSCHEDULED","can_reschedule":false,"window_start_time":"2024-12-01T19:00:01Z"}"#,
    )
    .unwrap()
    .unwrap();
    assert_eq!(ongoing.status, UpcomingStatus::Ongoing);
}

/// An ONGOING maintenance ends every process only on a VM that host maintenance stops: one
/// that live-migrates (`on-host-maintenance=MIGRATE`) loses nothing, so nothing may end a
/// match for it. Unread or unknown, the policy counts as stopping the VM.
#[test]
fn ongoing_maintenance_is_a_terminate_only_where_the_vm_is_stopped() {
    assert_eq!(
        parse_on_host_maintenance("MIGRATE\n"),
        Ok(OnHostMaintenance::Migrate)
    );
    assert_eq!(
        parse_on_host_maintenance("TERMINATE"),
        Ok(OnHostMaintenance::Terminate)
    );
    assert!(parse_on_host_maintenance("SHUTDOWN").is_err());
    let s = settings();
    let now = t("2026-12-01T00:00:00Z");
    let ongoing = |policy| View {
        event: Some((MaintenanceEvent::None, now)),
        preempted: Some((false, now)),
        upcoming: Some(Some(Upcoming {
            window_start: t("2026-12-01T00:30:00Z"),
            status: UpcomingStatus::Ongoing,
            can_reschedule: false,
        })),
        on_host_maintenance: policy,
    };
    for (policy, want) in [
        (Some(OnHostMaintenance::Migrate), Severity::Drain),
        (Some(OnHostMaintenance::Terminate), Severity::Terminate),
        // Unread: not guessed. It drains (no new match) and ends none.
        (None, Severity::Drain),
    ] {
        let Report::Known(n) = report(&ongoing(policy), &s, now) else {
            panic!("{policy:?}")
        };
        assert_eq!(n[0].severity, want, "{policy:?}");
    }
}

/// GKE's hand-back (`cloud.google.com/perform-maintenance`) starts the maintenance now, and
/// a node handed back stays fenced until the machine returns with a new boot id. A VM that
/// live-migrates never does (the migration keeps it running: same boot), so only a VM that
/// maintenance stops may be handed back early.
#[test]
fn only_a_vm_that_maintenance_stops_may_be_handed_back_early() {
    let s = settings();
    let now = t("2026-12-01T00:00:00Z");
    let pending = |policy| View {
        event: Some((MaintenanceEvent::None, now)),
        preempted: Some((false, now)),
        upcoming: Some(Some(Upcoming {
            window_start: t("2026-12-01T00:30:00Z"),
            status: UpcomingStatus::Pending,
            can_reschedule: true,
        })),
        on_host_maintenance: policy,
    };
    for (policy, early) in [
        (Some(OnHostMaintenance::Terminate), true),
        (Some(OnHostMaintenance::Migrate), false),
        (None, false),
    ] {
        let Report::Known(n) = report(&pending(policy), &s, now) else {
            panic!("{policy:?}")
        };
        assert_eq!(n[0].can_start_early, early, "{policy:?}");
        assert_eq!(n[0].severity, Severity::Drain, "within the lead");
    }
}

#[test]
fn notices_follow_the_table() {
    let s = settings();
    let now = t("2026-12-01T00:00:00Z");
    assert_eq!(report(&View::default(), &s, now), Report::Unknown);
    let mut v = View {
        event: Some((MaintenanceEvent::None, now)),
        preempted: Some((false, now)),
        upcoming: None,
        on_host_maintenance: None,
    };
    assert_eq!(
        report(&v, &s, now),
        Report::Unknown,
        "nothing definite from upcoming-maintenance yet, and nothing asks for a drain"
    );
    v.upcoming = Some(None);
    assert_eq!(report(&v, &s, now), Report::Known(vec![]));
    v.event = Some((MaintenanceEvent::Migrate, now));
    let Report::Known(n) = report(&v, &s, now) else {
        panic!()
    };
    assert_eq!(n[0].severity, Severity::Observe, "migration never drains");
    v.event = Some((MaintenanceEvent::Terminate, now));
    let Report::Known(n) = report(&v, &s, now) else {
        panic!()
    };
    assert_eq!(
        (n[0].severity, n[0].cancellable, n[0].deadline),
        (Severity::Terminate, true, Some(t("2026-12-01T01:00:00Z")))
    );
    v.event = Some((MaintenanceEvent::None, now));
    v.preempted = Some((true, now));
    let Report::Known(n) = report(&v, &s, now) else {
        panic!()
    };
    assert_eq!(
        (n[0].cause, n[0].cancellable, n[0].deadline),
        (Cause::Preemption, false, Some(t("2026-12-01T00:00:30Z")))
    );
    v.preempted = Some((false, now));
    v.upcoming = Some(Some(Upcoming {
        window_start: t("2026-12-01T05:00:00Z"),
        status: UpcomingStatus::Pending,
        can_reschedule: true,
    }));
    let Report::Known(n) = report(&v, &s, now) else {
        panic!()
    };
    assert_eq!(n[0].severity, Severity::Observe, "before the lead");
    let Report::Known(n) = report(&v, &s, t("2026-12-01T04:00:00Z")) else {
        panic!()
    };
    assert_eq!(
        (n[0].severity, n[0].deadline),
        (Severity::Drain, Some(t("2026-12-01T05:00:00Z")))
    );
}

// ---- the source against the emulator ---------------------------------------------------

const EVENT: &str = "maintenance-event";
const TERMINATE: &str = "TERMINATE_ON_HOST_MAINTENANCE";

/// The source on `emu`, with 2 s hanging GETs and a 200 ms upcoming-maintenance poll.
fn start_on(emu: &GceMetadataEmulator) -> Started {
    let url = emu.url();
    start_source(
        SOURCE,
        start,
        &[
            "--gce-metadata",
            "--gce-metadata-endpoint",
            &url,
            "--gce-wait-timeout",
            "2s",
            "--gce-upcoming-interval",
            "200ms",
        ],
    )
}

/// Requests for `key` so far that were (`true`) or were not hanging GETs.
fn reads(emu: &GceMetadataEmulator, key: &str, hanging: bool) -> usize {
    emu.requests()
        .iter()
        .filter(|(k, _, wait)| k == key && *wait == hanging)
        .count()
}

/// `at + d`, for deadline bounds.
fn after(at: Timestamp, d: SignedDuration) -> Timestamp {
    at.checked_add(d).unwrap()
}

/// Over HTTP: an ONGOING window on a VM that live-migrates is a drain, never a Terminate;
/// the same window on a VM that is stopped for it is a Terminate.
#[tokio::test]
async fn an_ongoing_window_follows_the_vms_own_host_maintenance_policy() {
    let emu = GceMetadataEmulator::start().await.unwrap();
    emu.set("scheduling/on-host-maintenance", "MIGRATE");
    emu.set(
        "upcoming-maintenance",
        r#"{"maintenance_status":"ONGOING","type":"SCHEDULED","can_reschedule":"false","window_start_time":"2100-01-01T00:00:00Z"}"#,
    );
    let src = start_on(&emu);
    let n = src
        .wait_for_notices("the ongoing window", |n| !n.is_empty())
        .await;
    assert_eq!(n[0].severity, Severity::Drain, "{n:?}");
    emu.set("scheduling/on-host-maintenance", "TERMINATE");
    src.wait_for_notices("stopped for it: a Terminate", |n| {
        n.iter().any(|n| n.severity == Severity::Terminate)
    })
    .await;
}

#[tokio::test]
async fn a_terminate_maintenance_event_arrives_on_the_hanging_get_as_a_terminate_notice() {
    let emu = GceMetadataEmulator::start().await.unwrap();
    let src = start_on(&emu);
    src.wait_for_notices("both keys read, nothing pending", |n| n.is_empty())
        .await;
    wait_for("a hanging GET on maintenance-event", || async {
        (reads(&emu, EVENT, true) > 0).then_some(())
    })
    .await;
    let before = Timestamp::now();
    emu.set(EVENT, TERMINATE);
    let n = src
        .wait_for_notices("the maintenance notice", |n| !n.is_empty())
        .await;
    let seen = Timestamp::now();
    assert_eq!(n.len(), 1, "{n:?}");
    assert_eq!(
        (n[0].source, n[0].cause, n[0].severity, n[0].cancellable),
        (SOURCE, Cause::Maintenance, Severity::Terminate, true)
    );
    assert_eq!(n[0].detail, format!("{EVENT}={TERMINATE}"));
    // The deadline is --gce-terminate-notice (1 h) from when the event was seen.
    let hour = SignedDuration::from_hours(1);
    let deadline = n[0].deadline.expect("a deadline");
    assert!(
        after(before, hour) <= deadline && deadline <= after(seen, hour),
        "{deadline} is not an hour after {before}..{seen}"
    );
    assert_eq!(
        reads(&emu, EVENT, false),
        1,
        "only the first read is plain: the change came on the hanging GET already open"
    );
    assert!(
        emu.requests().iter().all(|(_, flavor, _)| *flavor),
        "Metadata-Flavor: Google on every request"
    );
    assert_eq!(src.signals("terminate"), 1);
    emu.set(EVENT, "NONE");
    src.wait_for_notices("the event withdrawn by the server", |n| n.is_empty())
        .await;
}

#[tokio::test]
async fn preempted_is_a_final_terminate_notice_thirty_seconds_out() {
    let emu = GceMetadataEmulator::start().await.unwrap();
    let src = start_on(&emu);
    src.wait_for_notices("both keys read, nothing pending", |n| n.is_empty())
        .await;
    let before = Timestamp::now();
    emu.set("preempted", "TRUE");
    let n = src
        .wait_for_notices("the preemption notice", |n| !n.is_empty())
        .await;
    let seen = Timestamp::now();
    assert_eq!(n.len(), 1, "{n:?}");
    assert_eq!(
        (n[0].cause, n[0].severity, n[0].cancellable),
        (Cause::Preemption, Severity::Terminate, false)
    );
    let notice = SignedDuration::from_secs(30);
    let deadline = n[0].deadline.expect("a deadline");
    assert!(
        after(before, notice) <= deadline && deadline <= after(seen, notice),
        "{deadline} is not 30 s after {before}..{seen}"
    );
}

#[tokio::test]
async fn server_errors_never_clear_what_was_seen_and_only_the_server_clears_it() {
    let emu = GceMetadataEmulator::start().await.unwrap();
    emu.set(EVENT, TERMINATE);
    emu.set(
        "upcoming-maintenance",
        r#"{"maintenance_status":"PENDING","window_start_time":"2099-01-01T00:00:00Z","can_reschedule":"false"}"#,
    );
    let src = start_on(&emu);
    let seen = src
        .wait_for_notices("the event and the upcoming window", |n| n.len() == 2)
        .await;
    let published = src.reports().len();
    let mark = emu.requests().len();
    // 503s on both paths: the upcoming-maintenance poll, and the event's next read (a
    // write of the same value wakes its hanging GET, which answers before the blips).
    emu.fail_next(6);
    emu.set(EVENT, TERMINATE);
    wait_for("six 503s counted", || async {
        (src.errors("server_error") >= 6).then_some(())
    })
    .await;
    // The six requests after the mark got the 503s; once a later event read and two later
    // polls were made, every failure has been handled.
    wait_for("both paths past the blips", || async {
        let later = emu.requests().split_off(mark + 6);
        let polls = later.iter().filter(|(k, _, _)| k == "upcoming-maintenance");
        let events = later.iter().filter(|(k, _, _)| k == EVENT);
        (polls.count() >= 2 && events.count() >= 1).then_some(())
    })
    .await;
    assert_eq!(src.errors("server_error"), 6);
    assert_eq!(
        src.reports().len(),
        published,
        "a 503 published a report: {:?}",
        src.reports()
    );
    assert_eq!(src.current(), Report::Known(seen));
    assert_eq!(src.signals("none"), 0, "an error was read as NONE");
    // What the server says does clear them.
    emu.remove("upcoming-maintenance");
    let n = src
        .wait_for_notices("the window gone (404)", |n| n.len() == 1)
        .await;
    assert_eq!(n[0].severity, Severity::Terminate);
    emu.set(EVENT, "NONE");
    src.wait_for_notices("the event withdrawn", |n| n.is_empty())
        .await;
}

#[tokio::test]
async fn an_unreachable_server_is_reported_down_and_the_notice_stands() {
    let emu = GceMetadataEmulator::start().await.unwrap();
    emu.set(EVENT, TERMINATE);
    let src = start_on(&emu);
    let seen = src
        .wait_for_notices("the maintenance notice", |n| n.len() == 1)
        .await;
    assert_eq!(src.up(), 1);
    let published = src.reports().len();
    emu.set_unreachable(true).await.unwrap();
    wait_for("the server reported down", || async {
        (src.up() == 0).then_some(())
    })
    .await;
    assert!(src.errors("unreachable") >= 3);
    emu.set_unreachable(false).await.unwrap();
    wait_for("the server reported up again", || async {
        (src.up() == 1).then_some(())
    })
    .await;
    assert_eq!(src.reports().len(), published, "{:?}", src.reports());
    assert_eq!(src.current(), Report::Known(seen));
}

#[test]
fn a_drain_asked_by_another_key_stands_while_upcoming_is_unknown() {
    let s = settings();
    let now = t("2026-12-01T00:00:00Z");
    let v = View {
        event: Some((MaintenanceEvent::Terminate, now)),
        preempted: Some((false, now)),
        upcoming: None,
        on_host_maintenance: None,
    };
    let Report::Known(n) = report(&v, &s, now) else {
        panic!("a terminate event is a notice whatever upcoming-maintenance says")
    };
    assert_eq!(n[0].severity, Severity::Terminate);
}

const UPCOMING: &str = "upcoming-maintenance";
const PENDING: &str = r#"{"maintenance_status":"PENDING","type":"SCHEDULED","window_start_time":"2099-01-01T00:00:00Z","can_reschedule":"false"}"#;

/// Waits until `n` more upcoming-maintenance polls than `since` were answered.
async fn upcoming_polls_past(emu: &GceMetadataEmulator, since: usize, n: usize) {
    wait_for(&format!("{n} more upcoming-maintenance polls"), || async {
        let polls = emu
            .requests()
            .iter()
            .filter(|(k, _, _)| k == UPCOMING)
            .count();
        (polls >= since + n).then_some(())
    })
    .await;
}

fn upcoming_polls(emu: &GceMetadataEmulator) -> usize {
    emu.requests()
        .iter()
        .filter(|(k, _, _)| k == UPCOMING)
        .count()
}

#[tokio::test]
async fn an_unreadable_upcoming_answer_never_drops_a_pending_window() {
    let emu = GceMetadataEmulator::start().await.unwrap();
    emu.set(UPCOMING, PENDING);
    let src = start_on(&emu);
    let seen = src
        .wait_for_notices("the pending window", |n| n.len() == 1)
        .await;
    assert_eq!(seen[0].deadline, Some(t("2099-01-01T00:00:00Z")));
    let published = src.reports().len();
    for (i, unknown) in [
        "{ }",
        "NONE",
        "",
        r#"{"error": "no notifications have been received yet, try again later"}"#,
    ]
    .into_iter()
    .enumerate()
    {
        emu.set(UPCOMING, unknown);
        upcoming_polls_past(&emu, upcoming_polls(&emu), 2).await;
        assert_eq!(src.current(), Report::Known(seen.clone()), "{unknown:?}");
        assert_eq!(
            src.rejected("upcoming_unknown"),
            i as u64 + 1,
            "{unknown:?}"
        );
    }
    assert_eq!(src.reports().len(), published, "{:?}", src.reports());
    // A value this version does not know is rejected too, and the window stands.
    emu.set(UPCOMING, &PENDING.replace("PENDING", "POSTPONED"));
    upcoming_polls_past(&emu, upcoming_polls(&emu), 2).await;
    assert_eq!(src.rejected("unknown_value"), 1);
    assert_eq!(src.current(), Report::Known(seen));
    // COMPLETE clears it.
    emu.set(UPCOMING, &PENDING.replace("PENDING", "COMPLETE"));
    src.wait_for_notices("the window complete", |n| n.is_empty())
        .await;
}

#[tokio::test]
async fn an_unknown_answer_at_start_leaves_the_source_unknown_never_clear() {
    let emu = GceMetadataEmulator::start().await.unwrap();
    emu.set(UPCOMING, "{ }");
    emu.set(EVENT, "");
    let src = start_on(&emu);
    upcoming_polls_past(&emu, 0, 3).await;
    wait_for("the empty event body rejected", || async {
        (src.rejected("empty") >= 1).then_some(())
    })
    .await;
    assert_eq!(
        src.reports(),
        vec![Report::Unknown],
        "an empty maintenance-event is not TERMINATE, and `{{}}` is not all clear"
    );
    assert_eq!(src.signals("terminate"), 0);
    // A value this version does not know is not TERMINATE either.
    emu.set(EVENT, "SHUTDOWN_ON_HOST_MAINTENANCE");
    wait_for("the unknown value rejected", || async {
        (src.rejected("unknown_value") >= 1).then_some(())
    })
    .await;
    assert_eq!(src.current(), Report::Unknown);
    // Definite answers make it known.
    emu.set(EVENT, "NONE");
    emu.remove(UPCOMING);
    src.wait_for_notices("nothing pending, said positively", |n| n.is_empty())
        .await;
}

/// The source on `emu` with an upcoming-maintenance interval of an hour: whatever it learns
/// within a test, it learns from a retry, never from the next interval.
fn start_slow(emu: &GceMetadataEmulator) -> Started {
    let url = emu.url();
    start_source(
        SOURCE,
        start,
        &[
            "--gce-metadata",
            "--gce-metadata-endpoint",
            &url,
            "--gce-wait-timeout",
            "2s",
            "--gce-upcoming-interval",
            "1h",
        ],
    )
}

const POLICY: &str = "scheduling/on-host-maintenance";
const ONGOING: &str = r#"{"maintenance_status":"ONGOING","type":"SCHEDULED","can_reschedule":"false","window_start_time":"2026-01-01T00:00:00Z"}"#;

/// One failed read of the VM's host-maintenance policy with a window already ONGOING (its
/// start past): what the window does to the VM is not known, so no notice may end a match
/// (a Terminate whose deadline is past would end them all at once, on a VM that may well
/// live-migrate). The window drains, and the policy is read again at once, not an
/// interval (here an hour) later; read as `TERMINATE`, the window is a Terminate.
#[tokio::test]
async fn one_failed_read_of_the_policy_ends_no_match_and_is_read_again_at_once() {
    let emu = GceMetadataEmulator::start().await.unwrap();
    emu.set(UPCOMING, ONGOING);
    emu.set(POLICY, "TERMINATE");
    emu.fail_key_next(POLICY, 1);
    let src = start_slow(&emu);
    src.wait_for_notices("the policy read again: a Terminate", |n| {
        n.iter().any(|n| n.severity == Severity::Terminate)
    })
    .await;
    assert_eq!(src.errors("server_error"), 1, "the policy read failed once");
    // The window as first reported, with the policy unread: drained, ending no match.
    let reports = src.reports();
    let window = |r: &Report| match r {
        Report::Known(n) if !n.is_empty() => Some(n.clone()),
        _ => None,
    };
    let first = reports.iter().find_map(window).unwrap();
    assert_eq!(
        (first[0].severity, first[0].deadline),
        (Severity::Drain, Some(t("2026-01-01T00:00:00Z"))),
        "with the policy unread the ongoing window must end no match: {reports:?}"
    );
    let policy_reads = emu
        .requests()
        .iter()
        .filter(|(k, _, _)| k == POLICY)
        .count();
    assert_eq!(policy_reads, 2, "read again once, after the failure");
}

/// A machine that comes back while the metadata server is down: until it answers, the source
/// is unknown (a drain it asked for is held, the node stays fenced). Once it answers again,
/// every key is read within seconds, not an upcoming-maintenance interval (here an hour)
/// later.
#[tokio::test]
async fn a_server_that_answers_again_is_read_again_within_seconds() {
    let emu = GceMetadataEmulator::start().await.unwrap();
    emu.set_unreachable(true).await.unwrap();
    let src = start_slow(&emu);
    wait_for("every key tried and refused", || async {
        (src.errors("unreachable") >= 4).then_some(())
    })
    .await;
    assert_eq!(src.current(), Report::Unknown);
    emu.set_unreachable(false).await.unwrap();
    src.wait_for_notices("every key read: nothing scheduled", |n| n.is_empty())
        .await;
    assert!(
        emu.requests().iter().any(|(k, _, _)| k == UPCOMING),
        "upcoming-maintenance read again"
    );
}
