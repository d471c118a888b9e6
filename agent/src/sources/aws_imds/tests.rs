//! The parsers and the notice table, then the source itself against the IMDS emulator
//! (IMDSv2 only) over real HTTP: a Spot notice, an expired token, 5xx answers.

use lastcall_emulators::eventually::wait_for;
use lastcall_emulators::imds::ImdsEmulator;
use serde_json::json;

use super::*;
use crate::sources::test_support::{Started, start_source};

fn t(s: &str) -> Timestamp {
    s.parse().unwrap()
}

fn settings() -> Settings {
    Settings {
        rebalance_ttl: Duration::from_secs(1800),
        maintenance_lead: Duration::from_secs(3600),
    }
}

/// Every key read once with nothing pending.
fn empty_view(now: Timestamp) -> View {
    let mut v = View::default();
    for key in [SPOT, REBALANCE, SCHEDULED, LIFECYCLE] {
        assert_eq!(apply(&mut v, key, None, now), vec![]);
    }
    v
}

#[test]
fn a_spot_time_read_later_than_the_first_is_not_believed() {
    let now = t("2027-01-21T09:00:00Z");
    let mut v = empty_view(now);
    let spot = |time: &str| json!({ "action": "terminate", "time": time }).to_string();
    assert_eq!(
        apply(&mut v, SPOT, Some(&spot("2027-01-21T09:02:00Z")), now),
        vec![]
    );
    // Rewritten later: the instance still goes at the first time.
    assert_eq!(
        apply(&mut v, SPOT, Some(&spot("2027-01-21T09:02:01Z")), now),
        vec![]
    );
    assert_eq!(v.spot, Some(Some(t("2027-01-21T09:02:00Z"))));
    // Earlier: believed (the instance goes then).
    assert_eq!(
        apply(&mut v, SPOT, Some(&spot("2027-01-21T09:01:30Z")), now),
        vec![]
    );
    assert_eq!(v.spot, Some(Some(t("2027-01-21T09:01:30Z"))));
}

fn event(code: &str, state: &str, description: &str) -> serde_json::Value {
    json!({
        "Code": code,
        "Description": description,
        "EventId": format!("instance-event-{code}"),
        "NotBefore": "21 Jan 2027 09:00:43 GMT",
        "NotAfter": "21 Jan 2027 09:17:23 GMT",
        "State": state,
    })
}

#[test]
fn parses_every_notice_and_rejects_garbage() {
    assert_eq!(
        parse_spot(r#"{"action": "terminate", "time": "2026-12-01T08:22:00Z"}"#),
        Ok(t("2026-12-01T08:22:00Z"))
    );
    assert!(parse_spot(r#"{"action": "explode", "time": "2026-12-01T08:22:00Z"}"#).is_err());
    assert!(parse_spot("{}").is_err());
    assert_eq!(
        parse_rebalance(r#"{"noticeTime": "2026-12-01T08:00:00Z"}"#),
        Ok(t("2026-12-01T08:00:00Z"))
    );
    let s = parse_scheduled(
        &json!([
            event("system-reboot", "active", "scheduled reboot"),
            event("instance-stop", "canceled", "[Canceled] scheduled stop"),
        ])
        .to_string(),
    )
    .unwrap();
    assert_eq!(
        s,
        vec![
            Entry::Active(Scheduled {
                id: "instance-event-system-reboot".into(),
                code: Code::SystemReboot,
                not_before: t("2027-01-21T09:00:43Z")
            }),
            Entry::Finished {
                id: "instance-event-instance-stop".into()
            }
        ]
    );
    let Entry::Unknown { error, .. } =
        &parse_scheduled(r#"[{"NotBefore": "soon", "Code": "instance-stop", "State": "active"}]"#)
            .unwrap()[0]
    else {
        panic!("a bad NotBefore is not an event")
    };
    assert_eq!(error.reason, "invalid");
    assert!(parse_scheduled("{}").is_err());
}

/// What each documented code and state means for a running match, one row each.
#[test]
fn each_scheduled_code_is_classified_by_what_happens_to_a_running_process() {
    let now = t("2027-01-21T06:00:00Z"); // three hours before NotBefore
    let near = t("2027-01-21T08:30:00Z"); // inside the one-hour lead
    let nb = Some(t("2027-01-21T09:00:43Z"));
    use Severity::{Drain, Observe, Terminate};
    // code, state, description, severity now, severity inside the lead
    type Row<'a> = (&'a str, &'a str, &'a str, Option<(Severity, Severity)>);
    let rows: &[Row<'_>] = &[
        (
            "instance-stop",
            "active",
            "The instance is running on degraded hardware",
            Some((Terminate, Terminate)),
        ),
        (
            "instance-retirement",
            "active",
            "The instance is running on degraded hardware",
            Some((Terminate, Terminate)),
        ),
        (
            "instance-reboot",
            "active",
            "scheduled reboot",
            Some((Terminate, Terminate)),
        ),
        (
            "system-reboot",
            "active",
            "scheduled reboot",
            Some((Terminate, Terminate)),
        ),
        (
            "system-maintenance",
            "active",
            "scheduled network maintenance",
            Some((Observe, Drain)),
        ),
        (
            "instance-stop",
            "completed",
            "[Completed] The instance is running on degraded hardware",
            None,
        ),
        (
            "system-reboot",
            "canceled",
            "[Canceled] scheduled reboot",
            None,
        ),
        // Described after the fact, whatever State says.
        (
            "instance-reboot",
            "active",
            "[Completed] scheduled reboot",
            None,
        ),
        (
            "instance-retirement",
            "active",
            "[Canceled] retirement",
            None,
        ),
    ];
    for (code, state, description, want) in rows {
        let mut v = empty_view(now);
        let body = json!([event(code, state, description)]).to_string();
        assert_eq!(
            apply(&mut v, SCHEDULED, Some(&body), now),
            vec![],
            "{code} {state}"
        );
        let notices = |at| match report(&v, &settings(), at) {
            Report::Known(n) => n,
            Report::Unknown => panic!("{code}: unknown"),
        };
        let (now_n, near_n) = (notices(now), notices(near));
        match want {
            None => assert!(
                now_n.is_empty() && near_n.is_empty(),
                "{code} {state} {description}: {now_n:?}"
            ),
            Some((sev_now, sev_near)) => {
                assert_eq!(now_n.len(), 1, "{code}");
                let n = &now_n[0];
                assert_eq!(
                    (n.cause, n.severity, n.deadline, n.cancellable),
                    (Cause::Maintenance, *sev_now, nb, true),
                    "{code} {state}"
                );
                assert_eq!(near_n[0].severity, *sev_near, "{code} near the window");
                assert!(n.detail.contains(code), "{}", n.detail);
            }
        }
    }
}

#[test]
fn an_unknown_code_or_state_is_rejected_and_neither_drains_nor_clears() {
    let now = t("2027-01-21T06:00:00Z");
    let mut v = empty_view(now);
    for (code, state, reason) in [
        ("instance-explode", "active", "unknown_code"),
        ("instance-stop", "pending", "unknown_state"),
    ] {
        let body = json!([event(code, state, "x")]).to_string();
        let rejected = apply(&mut v, SCHEDULED, Some(&body), now);
        assert_eq!(rejected.len(), 1, "{code} {state}: counted");
        assert_eq!(rejected[0].reason, reason);
        assert_eq!(
            report(&v, &settings(), now),
            Report::Known(vec![]),
            "never a drain"
        );
    }
    // An event already read keeps its reading when its state turns into one this version
    // does not know: unknown is not "cleared".
    let stop = json!([event("instance-stop", "active", "x")]).to_string();
    assert_eq!(apply(&mut v, SCHEDULED, Some(&stop), now), vec![]);
    let before = report(&v, &settings(), now);
    let odd = json!([event("instance-stop", "in-progress", "x")]).to_string();
    assert_eq!(apply(&mut v, SCHEDULED, Some(&odd), now).len(), 1);
    assert_eq!(report(&v, &settings(), now), before);
    let Report::Known(n) = before else { panic!() };
    assert_eq!(n[0].severity, Severity::Terminate);
    // Completed: gone.
    let done = json!([event("instance-stop", "completed", "[Completed] x")]).to_string();
    assert_eq!(apply(&mut v, SCHEDULED, Some(&done), now), vec![]);
    assert_eq!(report(&v, &settings(), now), Report::Known(vec![]));
}

#[test]
fn notices_follow_the_table() {
    let now = t("2026-12-01T08:00:00Z");
    let s = settings();
    assert_eq!(report(&View::default(), &s, now), Report::Unknown);
    let mut v = empty_view(now);
    assert_eq!(report(&v, &s, now), Report::Known(vec![]));
    assert_eq!(
        apply(
            &mut v,
            REBALANCE,
            Some(r#"{"noticeTime": "2026-12-01T08:00:00Z"}"#),
            now,
        ),
        vec![]
    );
    let Report::Known(n) = report(&v, &s, now) else {
        panic!()
    };
    assert_eq!(
        (n[0].cause, n[0].severity, n[0].cancellable),
        (Cause::Rebalance, Severity::Drain, true)
    );
    assert_eq!(
        report(&v, &s, t("2026-12-01T08:30:00Z")),
        Report::Known(vec![]),
        "expires after its TTL"
    );
    apply(
        &mut v,
        SPOT,
        Some(r#"{"action": "terminate", "time": "2026-12-01T08:02:00Z"}"#),
        now,
    );
    let Report::Known(n) = report(&v, &s, now) else {
        panic!()
    };
    assert_eq!(
        (n[0].severity, n[0].cancellable, n[0].deadline),
        (Severity::Terminate, false, Some(t("2026-12-01T08:02:00Z")))
    );
    assert_eq!(apply(&mut v, SPOT, Some("garbage"), now).len(), 1);
    assert!(
        v.spot.is_some_and(|s| s.is_some()),
        "garbage changes nothing"
    );
    apply(&mut v, LIFECYCLE, Some("Terminated"), now);
    let Report::Known(n) = report(&v, &s, now) else {
        panic!()
    };
    assert!(
        n.iter()
            .any(|n| n.cause == Cause::ScaleDown && n.severity == Severity::Terminate)
    );
}

// ---- the source against the emulator ---------------------------------------------------

const SPOT_TIME: &str = "2026-12-01T08:22:00Z";

async fn imds() -> ImdsEmulator {
    ImdsEmulator::start("i-0123456789abcdef0", "ip-10-0-0-1.ec2.internal")
        .await
        .unwrap()
}

/// The source on `emu`, polling every 100 ms.
fn start_on(emu: &ImdsEmulator) -> Started {
    let url = emu.url();
    start_source(
        SOURCE,
        start,
        &[
            "--aws-imds",
            "--imds-endpoint",
            &url,
            "--aws-imds-interval",
            "100ms",
        ],
    )
}

fn spot_action() -> Option<serde_json::Value> {
    Some(json!({"action": "terminate", "time": SPOT_TIME}))
}

/// Waits until `n` more requests than `since` were made: with four keys a poll, `n >= 8`
/// means at least one whole poll ran after the one in flight.
async fn requests_past(emu: &ImdsEmulator, since: usize, n: usize) {
    wait_for(&format!("{n} more IMDS requests"), || async {
        (emu.requests().len() >= since + n).then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_spot_instance_action_is_a_final_terminate_notice_at_its_pinned_time() {
    let emu = imds().await;
    let src = start_on(&emu);
    src.wait_for_notices("every key read, nothing pending", |n| n.is_empty())
        .await;
    emu.set_spot_action(spot_action());
    let n = src
        .wait_for_notices("the Spot notice", |n| !n.is_empty())
        .await;
    assert_eq!(n.len(), 1, "{n:?}");
    assert_eq!(
        (n[0].source, n[0].cause, n[0].severity, n[0].cancellable),
        (SOURCE, Cause::Preemption, Severity::Terminate, false)
    );
    assert_eq!(n[0].deadline, Some(t(SPOT_TIME)), "the time IMDS gives");
    // Polled again and again, it is published and counted once.
    let published = src.reports().len();
    requests_past(&emu, emu.requests().len(), 8).await;
    assert_eq!(src.reports().len(), published);
    assert_eq!(src.signals("preemption"), 1);
    // 404 again: the notice is gone (a cancelled Spot request).
    emu.set_spot_action(None);
    src.wait_for_notices("no notice after a 404", |n| n.is_empty())
        .await;
}

#[tokio::test]
async fn an_expired_token_is_replaced_without_falling_back_to_imdsv1() {
    let emu = imds().await;
    let src = start_on(&emu);
    src.wait_for_notices("every key read, nothing pending", |n| n.is_empty())
        .await;
    let mark = emu.requests().len();
    emu.expire_tokens();
    emu.set_spot_action(spot_action());
    let n = src
        .wait_for_notices("the Spot notice", |n| !n.is_empty())
        .await;
    assert_eq!(n[0].deadline, Some(t(SPOT_TIME)));
    let later = emu.requests().split_off(mark);
    let fresh = later
        .iter()
        .position(|(m, p, s)| m == "PUT" && p == "/latest/api/token" && *s == 200)
        .expect("a new token was fetched");
    assert!(
        later[..fresh].iter().any(|(_, _, s)| *s == 401),
        "the expired token was never refused, so nothing was recovered: {later:?}"
    );
    // This IMDS refuses any GET without a token (HttpTokens: required), so an IMDSv1 read
    // would show up as a 401 after the new token.
    assert!(
        later[fresh..].iter().all(|(_, _, s)| *s != 401),
        "a request was refused after the new token: {later:?}"
    );
    for reason in ["token_rejected", "token", "server_error", "unreachable"] {
        assert_eq!(src.errors(reason), 0, "{reason}: the expiry cost a poll");
    }
    assert_eq!(src.up(), 1);
}

#[tokio::test]
async fn server_errors_never_clear_the_spot_notice() {
    let emu = imds().await;
    emu.set_spot_action(spot_action());
    let src = start_on(&emu);
    let seen = src
        .wait_for_notices("the Spot notice", |n| n.len() == 1)
        .await;
    let published = src.reports().len();
    let mark = emu.requests().len();
    emu.fail_next(6, 503);
    wait_for("a read failed", || async {
        (src.errors("server_error") >= 1).then_some(())
    })
    .await;
    // The six requests after the mark got the 503s; two more polls after them are clean.
    requests_past(&emu, mark + 6, 8).await;
    assert_eq!(src.up(), 1, "up again after a clean poll");
    assert_eq!(
        src.reports().len(),
        published,
        "a 503 published a report: {:?}",
        src.reports()
    );
    assert_eq!(src.current(), Report::Known(seen));
    emu.set_spot_action(None);
    src.wait_for_notices("no notice after a 404", |n| n.is_empty())
        .await;
}

/// `NotBefore` in IMDS's form, `secs` from now.
fn not_before_in(secs: i64) -> String {
    Timestamp::now()
        .checked_add(SignedDuration::from_secs(secs))
        .unwrap()
        .strftime("%d %b %Y %H:%M:%S GMT")
        .to_string()
}

#[tokio::test]
async fn scheduled_events_are_read_by_what_happens_to_a_running_process() {
    let emu = imds().await;
    let src = start_on(&emu);
    src.wait_for_notices("every key read, nothing pending", |n| n.is_empty())
        .await;
    let far = not_before_in(3 * 3600);
    let one = |code: &str, state: &str| {
        json!([{"Code": code, "Description": "scheduled", "EventId": "instance-event-1",
                "NotBefore": far, "NotAfter": far, "State": state}])
    };
    // A reboot ends every process on the node: a Terminate, so matches get their grace.
    for code in [
        "instance-reboot",
        "system-reboot",
        "instance-stop",
        "instance-retirement",
    ] {
        emu.set_scheduled_events(one(code, "active"));
        let n = src
            .wait_for_notices(code, |n| n.iter().any(|n| n.detail.contains(code)))
            .await;
        assert_eq!(n[0].severity, Severity::Terminate, "{code}");
    }
    // Network or power maintenance stops nothing: never a Terminate, and three hours out
    // (the lead is one hour) not even a drain.
    emu.set_scheduled_events(one("system-maintenance", "active"));
    let n = src
        .wait_for_notices("system-maintenance", |n| {
            n.iter().any(|n| n.detail.contains("system-maintenance"))
        })
        .await;
    assert_eq!(n[0].severity, Severity::Observe);
    // A code this version does not know: rejected and counted, never a drain.
    emu.set_scheduled_events(json!([]));
    src.wait_for_notices("cleared", |n| n.is_empty()).await;
    emu.set_scheduled_events(one("instance-explode", "active"));
    wait_for("the unknown code counted", || async {
        (src.rejected("unknown_code") >= 1).then_some(())
    })
    .await;
    requests_past(&emu, emu.requests().len(), 8).await;
    assert_eq!(src.current(), Report::Known(vec![]));
    assert_eq!(src.rejected("unknown_code"), 1, "once, not per poll");
}

#[test]
fn a_scheduled_time_is_read_with_or_without_a_leading_zero() {
    // EC2 writes the day of the month unpadded ("1 Jan 2021 02:00:00 GMT", as a real
    // instance answers and AWS's metadata mock writes it); a padded one is read alike.
    assert_eq!(
        parse_aws_time("1 Jan 2021 02:00:00 GMT").ok(),
        Some(t("2021-01-01T02:00:00Z"))
    );
    assert_eq!(
        parse_aws_time("01 Jan 2021 02:00:00 GMT").ok(),
        Some(t("2021-01-01T02:00:00Z"))
    );
    assert!(parse_aws_time("1 Jan 2021 02:00:00").is_err());
}
