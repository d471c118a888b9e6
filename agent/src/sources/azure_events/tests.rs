//! The document parser and the notice table, then the source itself against the Azure
//! metadata emulator over real HTTP: every event type, a vanished event, approval once the
//! node is empty, and an unreachable or garbled endpoint that never clears anything.

use lastcall_emulators::azure::{AzureMetadataEmulator, event};
use lastcall_emulators::eventually::wait_for;
use serde_json::json;

use super::*;
use crate::sources::test_support::{Started, start_source};

const VM: &str = "aks-games-12345678-vmss_3";
const NB: &str = "Mon, 19 Sep 2016 18:29:47 GMT";
/// A NotBefore far ahead, for the source tests.
const LATER: &str = "Fri, 01 Jan 2100 00:00:00 GMT";

fn t(s: &str) -> Timestamp {
    s.parse().unwrap()
}

fn doc(events: Vec<serde_json::Value>) -> String {
    json!({"DocumentIncarnation": 7, "Events": events}).to_string()
}

fn read(view: &mut View, events: Vec<serde_json::Value>, now: Timestamp) -> Vec<ParseError> {
    apply(view, parse_document(&doc(events)).unwrap(), VM, now)
}

fn notices(view: &View) -> Vec<Notice> {
    match report(view) {
        Report::Known(n) => n,
        Report::Unknown => panic!("unknown"),
    }
}

#[test]
fn not_before_is_rfc_1123_and_empty_once_started() {
    assert_eq!(parse_not_before(NB), Ok(Some(t("2016-09-19T18:29:47Z"))));
    assert_eq!(parse_not_before(""), Ok(None));
    assert!(parse_not_before("2016-09-19T18:29:47Z").is_err());
    assert!(parse_not_before("Mon, 19 Sep 2016").is_err());
}

#[test]
fn documents_parse_and_garbage_is_rejected() {
    let d = parse_document(&doc(vec![event("e1", "Reboot", VM, NB)])).unwrap();
    assert_eq!(d.incarnation, 7);
    assert_eq!(
        d.entries,
        vec![Entry::Event(Event {
            id: "e1".into(),
            kind: EventType::Reboot,
            status: EventStatus::Scheduled,
            not_before: Some(t("2016-09-19T18:29:47Z")),
            resources: vec![VM.into()],
            duration: None,
        })]
    );
    for (body, label) in [
        ("<html>", "invalid_json"),
        ("[]", "not_object"),
        (r#"{"Events": []}"#, "not_object"),
        (r#"{"DocumentIncarnation": 1}"#, "not_object"),
    ] {
        assert_eq!(
            parse_document(body).map_err(|e| e.metric_label()),
            Err(label),
            "{body}"
        );
    }
    let mut odd = event("e2", "Explode", VM, NB);
    let mut paused = event("e3", "Reboot", VM, NB);
    paused["EventStatus"] = json!("Paused");
    let mut undated = event("e4", "Reboot", VM, "");
    undated["EventStatus"] = json!("Scheduled");
    let d = parse_document(&doc(vec![odd.clone(), paused, undated])).unwrap();
    let labels: Vec<&str> = d
        .entries
        .iter()
        .map(|e| match e {
            Entry::Unknown { error, .. } => error.metric_label(),
            Entry::Event(_) => "event",
        })
        .collect();
    assert_eq!(labels, ["unknown_type", "unknown_status", "invalid"]);
    odd["EventId"] = json!(null);
    let d = parse_document(&doc(vec![odd])).unwrap();
    assert!(matches!(&d.entries[0], Entry::Unknown { .. }));
}

/// What each event type means for a running match, one row each.
#[test]
fn each_event_type_maps_to_what_happens_to_a_running_process() {
    let now = t("2016-09-19T18:00:00Z");
    let deadline = Some(t("2016-09-19T18:29:47Z"));
    use Severity::{Drain, Observe, Terminate};
    let rows: &[(&str, Option<i64>, Cause, Severity, bool)] = &[
        ("Freeze", Some(9), Cause::Maintenance, Observe, true),
        ("Freeze", None, Cause::Maintenance, Observe, true),
        ("Freeze", Some(300), Cause::Maintenance, Drain, true),
        ("Reboot", None, Cause::Maintenance, Terminate, true),
        ("Redeploy", None, Cause::Maintenance, Terminate, true),
        ("Preempt", None, Cause::Preemption, Terminate, false),
        ("Terminate", None, Cause::ScaleDown, Terminate, true),
    ];
    for (kind, duration, cause, severity, cancellable) in rows {
        let mut e = event("e1", kind, VM, NB);
        e["DurationInSeconds"] = json!(duration.unwrap_or(-1));
        let mut v = View::default();
        assert_eq!(read(&mut v, vec![e], now), vec![], "{kind}");
        let n = notices(&v);
        assert_eq!(n.len(), 1, "{kind}");
        assert_eq!(
            (
                n[0].source,
                n[0].cause,
                n[0].severity,
                n[0].deadline,
                n[0].cancellable
            ),
            (SOURCE, *cause, *severity, deadline, *cancellable),
            "{kind} {duration:?}"
        );
        assert!(n[0].detail.contains(kind), "{}", n[0].detail);
    }
}

#[test]
fn only_this_vms_events_count_and_a_started_event_is_due_now() {
    let now = t("2016-09-19T18:00:00Z");
    let mut v = View::default();
    assert_eq!(report(&v), Report::Unknown, "nothing read yet");
    read(
        &mut v,
        vec![event("other", "Reboot", "aks-games-12345678-vmss_4", NB)],
        now,
    );
    assert_eq!(report(&v), Report::Known(vec![]), "another VM's event");
    // Resources name VMs case-insensitively.
    read(
        &mut v,
        vec![event("e1", "Redeploy", &VM.to_uppercase(), NB)],
        now,
    );
    assert_eq!(notices(&v)[0].deadline, Some(t("2016-09-19T18:29:47Z")));
    // Started: NotBefore is empty; the deadline it had stands (never later).
    let mut started = event("e1", "Redeploy", VM, "");
    started["EventStatus"] = json!("Started");
    read(&mut v, vec![started.clone()], t("2016-09-19T18:35:00Z"));
    assert_eq!(notices(&v)[0].deadline, Some(t("2016-09-19T18:29:47Z")));
    assert!(notices(&v)[0].estimated_deadline, "counted by lastcall");
    // First seen Started: due now, and it stays at that moment.
    let mut fresh = View::default();
    read(&mut fresh, vec![started.clone()], now);
    read(&mut fresh, vec![started], t("2016-09-19T18:10:00Z"));
    assert_eq!(notices(&fresh)[0].deadline, Some(now));
}

/// A Reboot or a Spot eviction the platform postpones is later, as the platform says, not at
/// the first time: the deadline rule moves a stated deadline its provider restates.
#[test]
fn a_postponed_event_is_later_and_an_earlier_one_earlier() {
    for kind in ["Reboot", "Preempt"] {
        let now = t("2016-09-19T18:00:00Z");
        let mut v = View::default();
        read(&mut v, vec![event("e1", kind, VM, NB)], now);
        assert_eq!(notices(&v)[0].deadline, Some(t("2016-09-19T18:29:47Z")));
        assert!(!notices(&v)[0].estimated_deadline, "stated by the platform");
        assert!(
            notices(&v)[0].restated,
            "{kind}: the platform may postpone it"
        );
        read(
            &mut v,
            vec![event("e1", kind, VM, "Mon, 19 Sep 2016 19:29:47 GMT")],
            now,
        );
        assert_eq!(notices(&v)[0].deadline, Some(t("2016-09-19T19:29:47Z")));
        read(
            &mut v,
            vec![event("e1", kind, VM, "Mon, 19 Sep 2016 18:15:00 GMT")],
            now,
        );
        assert_eq!(notices(&v)[0].deadline, Some(t("2016-09-19T18:15:00Z")));
    }
}

#[test]
fn a_vanished_event_is_cancelled_but_a_spot_eviction_stands() {
    let now = t("2016-09-19T18:00:00Z");
    let mut v = View::default();
    read(
        &mut v,
        vec![event("r", "Reboot", VM, NB), event("p", "Preempt", VM, NB)],
        now,
    );
    assert_eq!(notices(&v).len(), 2);
    read(&mut v, vec![], now);
    let n = notices(&v);
    assert_eq!(n.len(), 1, "{n:?}");
    assert_eq!((n[0].cause, n[0].cancellable), (Cause::Preemption, false));
}

#[test]
fn an_unknown_entry_never_drains_and_never_clears() {
    let now = t("2016-09-19T18:00:00Z");
    let mut v = View::default();
    let rejected = read(&mut v, vec![event("x", "Hibernate", VM, NB)], now);
    assert_eq!(rejected.len(), 1);
    assert_eq!(report(&v), Report::Known(vec![]), "never a drain");
    read(&mut v, vec![event("r", "Reboot", VM, NB)], now);
    let before = notices(&v);
    let mut odd = event("r", "Reboot", VM, NB);
    odd["EventStatus"] = json!("Paused");
    assert_eq!(read(&mut v, vec![odd], now).len(), 1);
    assert_eq!(notices(&v), before, "its last reading stands");
}

#[test]
fn only_pending_events_that_ask_for_a_drain_are_approved_once() {
    let now = t("2016-09-19T18:00:00Z");
    let mut v = View::default();
    let mut started = event("s", "Reboot", VM, "");
    started["EventStatus"] = json!("Started");
    read(
        &mut v,
        vec![
            event("freeze", "Freeze", VM, NB),
            event("reboot", "Reboot", VM, NB),
            started,
        ],
        now,
    );
    let mut approved = BTreeSet::new();
    assert_eq!(to_approve(&v, &approved), ["reboot"]);
    approved.insert("reboot".to_string());
    assert!(to_approve(&v, &approved).is_empty());
}

// ---- the source against the emulator ---------------------------------------------------

async fn azure() -> AzureMetadataEmulator {
    AzureMetadataEmulator::start(VM).await.unwrap()
}

/// The source on `emu`, polling every 100 ms.
fn start_on(emu: &AzureMetadataEmulator, extra: &[&str]) -> Started {
    let url = emu.url();
    let mut args = vec![
        "--azure-events",
        "--azure-metadata-endpoint",
        &url,
        "--azure-events-interval",
        "100ms",
    ];
    args.extend_from_slice(extra);
    start_source(SOURCE, start, &args)
}

fn event_reads(emu: &AzureMetadataEmulator) -> usize {
    emu.requests()
        .iter()
        .filter(|r| r.method == "GET" && r.path == "/metadata/scheduledevents")
        .count()
}

async fn reads_past(emu: &AzureMetadataEmulator, since: usize, n: usize) {
    wait_for(&format!("{n} more Scheduled Events reads"), || async {
        (event_reads(emu) >= since + n).then_some(())
    })
    .await;
}

#[tokio::test]
async fn every_event_type_arrives_as_its_notice_and_a_vanished_one_clears() {
    let emu = azure().await;
    emu.set_events(vec![event(
        "other",
        "Reboot",
        "aks-games-12345678-vmss_9",
        LATER,
    )]);
    let src = start_on(&emu, &[]);
    src.wait_for_notices("read, nothing for this VM", |n| n.is_empty())
        .await;
    for (kind, severity) in [
        ("Freeze", Severity::Observe),
        ("Reboot", Severity::Terminate),
        ("Redeploy", Severity::Terminate),
        ("Terminate", Severity::Terminate),
        ("Preempt", Severity::Terminate),
    ] {
        let id = format!("ev-{kind}");
        emu.set_events(vec![event(&id, kind, VM, LATER)]);
        let n = src
            .wait_for_notices(kind, |n| n.iter().any(|n| n.id.ends_with(&id)))
            .await;
        let mine: Vec<&Notice> = n.iter().filter(|n| n.id.ends_with(&id)).collect();
        assert_eq!(mine[0].severity, severity, "{kind}");
        assert_eq!(mine[0].deadline, Some(t("2100-01-01T00:00:00Z")), "{kind}");
        if kind != "Preempt" {
            emu.set_events(vec![]);
            src.wait_for_notices(&format!("{kind} vanished"), |n| n.is_empty())
                .await;
        }
    }
    // The Spot eviction stays after it vanishes: it cannot be withdrawn.
    emu.set_events(vec![]);
    reads_past(&emu, event_reads(&emu), 3).await;
    let Report::Known(n) = src.current() else {
        panic!()
    };
    assert_eq!(n.len(), 1);
    assert_eq!((n[0].cause, n[0].cancellable), (Cause::Preemption, false));
    // The VM name came from compute/name; every request sent `Metadata: true`.
    let reqs = emu.requests();
    assert!(
        reqs.iter()
            .any(|r| r.path == "/metadata/instance/compute/name")
    );
    assert!(
        reqs.iter().all(|r| r.metadata_header && r.status == 200),
        "{reqs:?}"
    );
    assert_eq!(src.signals("preemption"), 1);
}

#[tokio::test]
async fn an_unreachable_or_garbled_endpoint_is_unknown_never_clear() {
    let emu = azure().await;
    emu.set_garbled(Some("<html>oops</html>"));
    let src = start_on(&emu, &["--azure-vm-name", VM]);
    reads_past(&emu, 0, 3).await;
    assert_eq!(
        src.reports(),
        vec![Report::Unknown],
        "garbage at start is not all clear"
    );
    assert_eq!(
        src.rejected("invalid_json"),
        1,
        "counted once, not per poll"
    );
    emu.set_garbled(None);
    emu.set_events(vec![event("r", "Reboot", VM, LATER)]);
    let seen = src.wait_for_notices("the reboot", |n| n.len() == 1).await;
    let published = src.reports().len();
    // Garbled, 5xx, unreachable: the reboot stands.
    emu.set_garbled(Some(r#"{"DocumentIncarnation": "x"}"#));
    reads_past(&emu, event_reads(&emu), 2).await;
    assert_eq!(src.rejected("not_object"), 1);
    emu.set_garbled(None);
    emu.fail_next(3, 503);
    reads_past(&emu, event_reads(&emu), 4).await;
    assert!(src.errors("server_error") >= 3);
    emu.set_unreachable(true).await.unwrap();
    wait_for("reads fail", || async {
        (src.errors("unreachable") >= 2).then_some(())
    })
    .await;
    assert_eq!(src.up(), 0);
    assert_eq!(src.current(), Report::Known(seen.clone()));
    emu.set_unreachable(false).await.unwrap();
    wait_for("up again", || async { (src.up() == 1).then_some(()) }).await;
    assert_eq!(src.reports().len(), published, "{:?}", src.reports());
    assert_eq!(src.current(), Report::Known(seen));
    assert!(
        emu.requests()
            .iter()
            .all(|r| r.path != "/metadata/instance/compute/name"),
        "--azure-vm-name given: no name lookup"
    );
}

#[tokio::test]
async fn pending_events_are_approved_once_the_node_is_empty_and_only_then() {
    let emu = azure().await;
    emu.set_events(vec![
        event("reboot", "Reboot", VM, LATER),
        event("freeze", "Freeze", VM, LATER),
        event("theirs", "Reboot", "aks-games-12345678-vmss_9", LATER),
    ]);
    let src = start_on(&emu, &["--azure-approve-when-empty"]);
    src.wait_for_notices("both events", |n| n.len() == 2).await;
    reads_past(&emu, event_reads(&emu), 3).await;
    assert!(emu.approvals().is_empty(), "a match may still be running");
    src.node_empty.send_replace(true);
    wait_for("the reboot approved", || async {
        (!emu.approvals().is_empty()).then_some(())
    })
    .await;
    // The platform starts it: NotBefore empties, and it is due now.
    let n = src
        .wait_for_notices("the reboot started", |n| {
            n.iter().any(|n| n.detail.contains("started"))
        })
        .await;
    let reboot = n.iter().find(|n| n.id.ends_with("reboot")).unwrap();
    assert!(
        reboot.deadline.is_some_and(|d| d <= Timestamp::now()),
        "{reboot:?}"
    );
    reads_past(&emu, event_reads(&emu), 3).await;
    assert_eq!(
        emu.approvals(),
        ["reboot"],
        "once, and only what asked for the drain"
    );
    let posts: Vec<_> = emu
        .requests()
        .into_iter()
        .filter(|r| r.method == "POST")
        .collect();
    assert_eq!(posts.len(), 1);
    assert!(posts[0].metadata_header && posts[0].status == 200);
    assert_eq!(
        src.metrics()
            .actions
            .get_or_create(&ActionResult {
                action: APPROVE_ACTION,
                result: "ok"
            })
            .get(),
        1
    );
}

#[tokio::test]
async fn a_dry_run_counts_the_approval_and_sends_nothing() {
    let emu = azure().await;
    emu.set_events(vec![event("reboot", "Reboot", VM, LATER)]);
    let src = start_on(&emu, &["--azure-approve-when-empty", "--dry-run"]);
    src.wait_for_notices("the reboot", |n| n.len() == 1).await;
    src.node_empty.send_replace(true);
    wait_for("counted as a dry run", || async {
        let c = src
            .metrics()
            .actions
            .get_or_create(&ActionResult {
                action: APPROVE_ACTION,
                result: "dry_run",
            })
            .get();
        (c == 1).then_some(())
    })
    .await;
    reads_past(&emu, event_reads(&emu), 3).await;
    assert!(emu.approvals().is_empty());
    assert!(emu.requests().iter().all(|r| r.method == "GET"));
}

/// A standby agent (a rollout runs two on the node) reports the event but approves
/// nothing, even on an empty node; once it acts, it approves, once.
#[tokio::test]
async fn a_standby_agent_approves_nothing_until_it_acts() {
    let emu = azure().await;
    emu.set_events(vec![event("reboot", "Reboot", VM, LATER)]);
    let src = start_on(&emu, &["--azure-approve-when-empty"]);
    src.acting.store(false, std::sync::atomic::Ordering::SeqCst);
    src.wait_for_notices("the reboot", |n| n.len() == 1).await;
    src.node_empty.send_replace(true);
    reads_past(&emu, event_reads(&emu), 3).await;
    assert!(emu.approvals().is_empty(), "{:?}", emu.requests());
    src.acting.store(true, std::sync::atomic::Ordering::SeqCst);
    wait_for("approved by the acting agent", || async {
        (!emu.approvals().is_empty()).then_some(())
    })
    .await;
    reads_past(&emu, event_reads(&emu), 3).await;
    assert_eq!(emu.approvals(), ["reboot"]);
}
