//! The notifier against a real HTTP receiver (`lastcall_emulators::webhook_receiver`).

use std::time::Duration;

use lastcall_emulators::eventually::wait_for;
use lastcall_emulators::webhook_receiver::{Answer, WebhookReceiver, refusing_url};

use super::*;

fn note(event: Event, message: &str) -> Notification {
    Notification {
        event,
        reason: "viability".into(),
        source: "fleetiq".into(),
        deadline: String::new(),
        message: message.into(),
    }
}

fn settings(url: &str, timeout: Duration) -> Settings {
    Settings::new(
        url::Url::parse(url).expect("url"),
        Template::parse(template::DEFAULT).expect("template"),
        timeout,
        "n1".into(),
        "prod".into(),
    )
}

fn counted(m: &Metrics, event: Event, outcome: &'static str) -> u64 {
    m.notifications
        .get_or_create(&EventOutcome {
            event: event.as_str(),
            outcome,
        })
        .get()
}

/// Starts a poster for `url`; stops it when the returned token is cancelled.
fn run(url: &str, timeout: Duration) -> (Notifier, Metrics, CancellationToken) {
    let (metrics, _) = Metrics::new();
    let (notifier, poster) = start(settings(url, timeout), metrics.clone()).expect("start");
    let stop = CancellationToken::new();
    tokio::spawn(poster.run(stop.clone()));
    (notifier, metrics, stop)
}

#[tokio::test]
async fn notifications_arrive_in_order_as_json_text() {
    let r = WebhookReceiver::start().await.expect("receiver");
    let (n, m, stop) = run(&r.url(), Duration::from_secs(5));
    n.send(note(Event::DrainStarted, "first \"quoted\"\nline"));
    n.send(note(Event::Deregistered, "second"));
    wait_for("both received", || async {
        (r.received().len() == 2).then_some(())
    })
    .await;
    let got = r.received();
    assert_eq!(got[0].content_type.as_deref(), Some("application/json"));
    assert_eq!(
        got[0].json.as_ref().map(|j| j["text"].clone()),
        Some("lastcall drain_started on node n1: first \"quoted\"\nline".into())
    );
    assert_eq!(
        got[1].json.as_ref().map(|j| j["text"].clone()),
        Some("lastcall deregistered on node n1: second".into())
    );
    wait_for("counted", || async {
        (counted(&m, Event::Deregistered, "sent") == 1).then_some(())
    })
    .await;
    assert_eq!(counted(&m, Event::DrainStarted, "sent"), 1);
    stop.cancel();
}

#[tokio::test]
async fn server_errors_are_retried_a_bounded_number_of_times_then_counted() {
    let r = WebhookReceiver::start().await.expect("receiver");
    r.answer(Answer::Status(500));
    let (n, m, stop) = run(&r.url(), Duration::from_secs(5));
    n.send(note(Event::DrainStarted, "x"));
    wait_for("failed after its attempts", || async {
        (counted(&m, Event::DrainStarted, "failed") == 1).then_some(())
    })
    .await;
    assert_eq!(r.received().len(), ATTEMPTS as usize);
    // A client error is not retried.
    r.answer(Answer::Status(400));
    n.send(note(Event::DrainCancelled, "y"));
    wait_for("failed at once", || async {
        (counted(&m, Event::DrainCancelled, "failed") == 1).then_some(())
    })
    .await;
    assert_eq!(r.received().len(), ATTEMPTS as usize + 1);
    // 429 is retried, and the next attempt may succeed.
    r.answer(Answer::Status(429));
    n.send(note(Event::HardDeadline, "z"));
    wait_for("a retry", || async {
        (r.received().len() == ATTEMPTS as usize + 2).then_some(())
    })
    .await;
    r.answer(Answer::Ok);
    wait_for("sent on a retry", || async {
        (counted(&m, Event::HardDeadline, "sent") == 1).then_some(())
    })
    .await;
    stop.cancel();
}

#[tokio::test]
async fn a_hanging_or_absent_receiver_fails_within_bounds_and_the_queue_drops_the_rest() {
    let r = WebhookReceiver::start().await.expect("receiver");
    r.answer(Answer::Hang);
    let (n, m, stop) = run(&r.url(), Duration::from_millis(200));
    n.send(note(Event::DrainStarted, "hangs"));
    wait_for("timed out", || async {
        (counted(&m, Event::DrainStarted, "failed") == 1).then_some(())
    })
    .await;
    assert_eq!(
        r.received().len(),
        ATTEMPTS as usize,
        "timeouts are retried"
    );
    stop.cancel();

    let (n, m, stop) = run(&refusing_url(), Duration::from_millis(200));
    n.send(note(Event::Deregistered, "refused"));
    wait_for("refused", || async {
        (counted(&m, Event::Deregistered, "failed") == 1).then_some(())
    })
    .await;
    stop.cancel();

    // A poster that is not running: the queue fills and then drops, never blocks.
    let (metrics, _) = Metrics::new();
    let (n, _poster) =
        start(settings(&r.url(), Duration::from_secs(1)), metrics.clone()).expect("start");
    for _ in 0..QUEUE + 3 {
        n.send(note(Event::Empty, "queued"));
    }
    assert_eq!(counted(&metrics, Event::Empty, "dropped"), 3);
}

#[tokio::test]
async fn failures_never_carry_the_url() {
    let r = WebhookReceiver::start().await.expect("receiver");
    for (url, answer) in [
        (r.url(), Some(Answer::Status(503))),
        (refusing_url(), None),
        (r.url(), Some(Answer::Hang)),
    ] {
        if let Some(a) = answer {
            r.answer(a);
        }
        let (metrics, _) = Metrics::new();
        let (_n, poster) =
            start(settings(&url, Duration::from_millis(200)), metrics).expect("start");
        let failure = poster.attempt(r#"{"text":"x"}"#).await.expect_err("fails");
        let secret = url.rsplit_once("/services/").map(|(_, s)| s).unwrap_or("");
        assert!(!failure.what.contains(secret), "{}", failure.what);
        assert!(!failure.what.contains("/services/"), "{}", failure.what);
        assert!(failure.retry, "{}", failure.what);
    }
}

#[test]
fn the_url_comes_from_the_file_then_the_environment_and_errors_hide_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("url");
    std::fs::write(&file, "https://hooks.example.com/services/SECRET\n").expect("write");
    let u = Settings::url(Some(&file), Some("https://other.example.com/x".into()))
        .expect("ok")
        .expect("some");
    assert_eq!(u.path(), "/services/SECRET", "the file wins, trimmed");
    let e = Settings::url(None, Some("https://env.example.com/y".into()))
        .expect("ok")
        .expect("some");
    assert_eq!(e.host_str(), Some("env.example.com"));
    assert!(Settings::url(None, None).expect("ok").is_none());
    for bad in ["", "   \n", "ftp://h/SECRET", "not a url SECRET", "http://"] {
        std::fs::write(&file, bad).expect("write");
        let err = format!("{:#}", Settings::url(Some(&file), None).expect_err(bad));
        assert!(err.contains("--notify-url-file"), "{err}");
        assert!(!err.contains("SECRET"), "{err}");
    }
    let missing = dir.path().join("missing");
    let err = format!(
        "{:#}",
        Settings::url(Some(&missing), None).expect_err("missing")
    );
    assert!(err.contains("reading --notify-url-file"), "{err}");
}
