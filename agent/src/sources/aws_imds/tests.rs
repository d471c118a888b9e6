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
        r#"[{"NotBefore": "21 Jan 2027 09:00:43 GMT", "Code": "system-reboot", "State": "active"},
                {"NotBefore": "22 Jan 2027 09:00:43 GMT", "Code": "instance-stop", "State": "canceled"}]"#,
    )
    .unwrap();
    assert_eq!(
        s,
        vec![Scheduled {
            code: "system-reboot".into(),
            not_before: t("2027-01-21T09:00:43Z")
        }]
    );
    assert!(parse_scheduled(r#"[{"NotBefore": "soon", "Code": "x"}]"#).is_err());
    assert!(parse_scheduled("{}").is_err());
}

#[test]
fn notices_follow_the_table() {
    let now = t("2026-12-01T08:00:00Z");
    let ttl = Duration::from_secs(1800);
    let mut v = View::default();
    assert_eq!(report(&v, ttl, now), Report::Unknown);
    for key in [SPOT, REBALANCE, SCHEDULED, LIFECYCLE] {
        apply(&mut v, key, None, now).unwrap();
    }
    assert_eq!(report(&v, ttl, now), Report::Known(vec![]));
    apply(
        &mut v,
        REBALANCE,
        Some(r#"{"noticeTime": "2026-12-01T08:00:00Z"}"#),
        now,
    )
    .unwrap();
    let Report::Known(n) = report(&v, ttl, now) else {
        panic!()
    };
    assert_eq!(
        (n[0].cause, n[0].severity, n[0].cancellable),
        (Cause::Rebalance, Severity::Drain, true)
    );
    assert_eq!(
        report(&v, ttl, t("2026-12-01T08:30:00Z")),
        Report::Known(vec![]),
        "expires after its TTL"
    );
    apply(
        &mut v,
        SPOT,
        Some(r#"{"action": "terminate", "time": "2026-12-01T08:02:00Z"}"#),
        now,
    )
    .unwrap();
    let Report::Known(n) = report(&v, ttl, now) else {
        panic!()
    };
    assert_eq!(
        (n[0].severity, n[0].cancellable, n[0].deadline),
        (Severity::Terminate, false, Some(t("2026-12-01T08:02:00Z")))
    );
    assert!(apply(&mut v, SPOT, Some("garbage"), now).is_err());
    assert!(
        v.spot.is_some_and(|s| s.is_some()),
        "garbage changes nothing"
    );
    apply(&mut v, LIFECYCLE, Some("Terminated"), now).unwrap();
    let Report::Known(n) = report(&v, ttl, now) else {
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
