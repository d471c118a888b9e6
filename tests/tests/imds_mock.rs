//! The IMDS source against AWS's own metadata mock (`amazon-ec2-metadata-mock`, built with
//! the box), next to the test kit's IMDS emulator: each scenario is played on both, and the
//! agent must come to the same drain on each, the one the notice asks for. Where the two
//! serve something different, the raw answers are compared too, so a difference shows up
//! here by name (see docs/testing.md, "The IMDS emulator against AWS's mock").

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use lastcall_testkit::agent::InProcessAgent;
use lastcall_testkit::eventually::{try_eventually, wait_for};
use lastcall_testkit::imds::ImdsEmulator;
use lastcall_testkit::kube_box;
use lastcall_testkit::world::{World, WorldSpec, cordoned, has_taint};
use serde_json::json;
use tokio::process::{Child, Command};

/// AWS's mock on a free port, killed when dropped.
struct Mock {
    child: Child,
    port: u16,
}

impl Mock {
    async fn start(args: &[&str]) -> Mock {
        let bin: PathBuf = kube_box::bin_dir()
            .expect("the box's binaries (hack/box/build.sh)")
            .join("ec2-metadata-mock");
        // Below the ephemeral range, as the box's own ports (a port from it can be taken by
        // an outgoing connection meanwhile).
        for _ in 0..20 {
            let port = 20_000 + (rand::random::<u16>() % 12_000);
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_err() {
                continue;
            }
            let mut cmd = Command::new(&bin);
            cmd.args(args)
                .args(["--hostname", "127.0.0.1", "--port", &port.to_string()])
                // Its config file and saved config go to a directory of the test's own.
                .env("HOME", std::env::temp_dir())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .kill_on_drop(true);
            let child = cmd.spawn().expect("starting ec2-metadata-mock");
            let mock = Mock { child, port };
            if mock.ready().await {
                return mock;
            }
        }
        panic!("ec2-metadata-mock did not start on any port tried");
    }

    async fn ready(&self) -> bool {
        try_eventually(
            "ec2-metadata-mock answers",
            Duration::from_secs(5),
            Duration::from_millis(50),
            || async {
                reqwest::get(format!("{}/latest/meta-data/instance-id", self.url()))
                    .await
                    .is_ok_and(|r| r.status().is_success())
                    .then_some(())
            },
        )
        .await
        .is_ok()
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for Mock {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

async fn agent_on(w: &World, endpoint: &str) -> InProcessAgent {
    let args: Vec<String> = [
        "--aws-imds",
        "--imds-endpoint",
        endpoint,
        "--aws-imds-interval",
        "200ms",
        "--resync-interval",
        "1s",
    ]
    .map(String::from)
    .to_vec();
    w.start_agent(&args).await
}

/// What the agent made of a notice: the match's announced deadline and reason, once the
/// node is fenced.
async fn drain_seen(w: &World) -> (Option<String>, String) {
    wait_for("the node fenced and the match told why", || async {
        let n = w.node().await;
        let gs = w.allocated();
        let reason = gs.annotations.get("lastcall.dev/drain-reason")?.clone();
        (cordoned(&n) && has_taint(&n, "lastcall.dev/draining")).then(|| {
            (
                gs.annotations.get("lastcall.dev/drain-deadline").cloned(),
                reason,
            )
        })
    })
    .await
}

/// One scenario on both backends: the agent's drain on the emulator (set up by `emulate`)
/// and on AWS's mock (started with `mock_args`).
async fn both(
    mock_args: &[&str],
    emulate: impl Fn(&ImdsEmulator),
) -> ((Option<String>, String), (Option<String>, String)) {
    let on_mock = {
        let w = World::start(WorldSpec::new(1, 1, 0)).await;
        let mock = Mock::start(mock_args).await;
        let agent = agent_on(&w, &mock.url()).await;
        w.claimed_all().await;
        let seen = drain_seen(&w).await;
        agent.stop().await.expect("clean stop");
        seen
    };
    let on_emulator = {
        let w = World::start(WorldSpec::new(1, 1, 0)).await;
        let imds = ImdsEmulator::start("i-1234567890abcdef0", "ip-10-0-0-1.ec2.internal")
            .await
            .expect("IMDS emulator");
        let agent = agent_on(&w, &imds.url()).await;
        w.claimed_all().await;
        emulate(&imds);
        let seen = drain_seen(&w).await;
        agent.stop().await.expect("clean stop");
        seen
    };
    (on_mock, on_emulator)
}

fn in_secs(secs: i64) -> jiff::Timestamp {
    jiff::Timestamp::now()
        .checked_add(jiff::SignedDuration::from_secs(secs))
        .expect("a time")
}

fn rfc3339(t: jiff::Timestamp) -> String {
    t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

fn rfc3339_in(secs: i64) -> String {
    rfc3339(in_secs(secs))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spot_interruption_is_the_same_drain_on_the_mock_and_the_emulator() {
    let time = rfc3339_in(600);
    let (mock, emu) = both(
        &["spot", "--action", "terminate", "--time", &time],
        |imds| {
            imds.set_spot_action(Some(json!({"action": "terminate", "time": time})));
        },
    )
    .await;
    assert_eq!(
        mock,
        (Some(time.clone()), "preemption".to_string()),
        "on the mock"
    );
    assert_eq!(emu, mock, "the emulator and the mock differ");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduled_stop_is_the_same_drain_on_the_mock_and_the_emulator() {
    let at = in_secs(1800);
    let not_before = rfc3339(at);
    // The emulator is given the date as AWS's mock writes it (day of month unpadded).
    let nb = at.strftime("%-d %b %Y %H:%M:%S GMT").to_string();
    let (mock, emu) = both(
        &[
            "events",
            "--code",
            "instance-stop",
            "--state",
            "active",
            "--not-before",
            &not_before,
        ],
        |imds| {
            imds.set_scheduled_events(json!([{
                "Code": "instance-stop",
                "Description": "The instance is scheduled for instance-stop",
                "EventId": "instance-event-1234567890abcdef0",
                "NotBefore": nb,
                "NotAfter": "12 Dec 2099 18:16:32 GMT",
                "State": "active",
            }]));
        },
    )
    .await;
    assert_eq!(
        mock.0.as_deref(),
        Some(not_before.as_str()),
        "on the mock: {mock:?}"
    );
    assert_eq!(emu, mock, "the emulator and the mock differ");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebalance_recommendation_is_the_same_drain_on_the_mock_and_the_emulator() {
    // The Spot notice an hour away (not yet served), the recommendation now.
    let (mock, emu) = both(
        &[
            "spot",
            "--mock-delay-sec",
            "3600",
            "--rebalance-delay-sec",
            "0",
        ],
        |imds| {
            imds.set_rebalance(Some(json!({"noticeTime": rfc3339_in(0)})));
        },
    )
    .await;
    // Its deadline (if any) is counted from when the agent saw it: each run its own.
    assert_eq!(mock.1, "rebalance", "on the mock: {mock:?}");
    assert_eq!(
        emu.1, mock.1,
        "the emulator and the mock differ: {emu:?} {mock:?}"
    );
    assert_eq!(emu.0.is_some(), mock.0.is_some(), "{emu:?} {mock:?}");
}

/// The raw answers, path by path, once each backend serves the same notices: status and the
/// body's meaning (JSON compared as values). The two differences found are pinned here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_emulator_answers_every_path_as_the_mock_does() {
    let time = rfc3339_in(600);
    let mock = Mock::start(&["spot", "--action", "terminate", "--time", &time]).await;
    let imds = ImdsEmulator::start("i-1234567890abcdef0", "ip-10-0-0-1.ec2.internal")
        .await
        .expect("IMDS emulator");
    imds.set_spot_action(Some(json!({"action": "terminate", "time": time})));
    // In its `spot` mode the mock serves a rebalance recommendation with the Spot notice
    // (from its start unless delayed), as EC2 may: the emulator is told the same.
    imds.set_rebalance(Some(json!({"noticeTime": rfc3339_in(0)})));
    let client = reqwest::Client::new();
    let get = |base: String, path: &'static str| {
        let client = client.clone();
        async move {
            let token = client
                .put(format!("{base}/latest/api/token"))
                .header("X-aws-ec2-metadata-token-ttl-seconds", "60")
                .send()
                .await
                .expect("token")
                .text()
                .await
                .expect("token body");
            let r = client
                .get(format!("{base}{path}"))
                .header("X-aws-ec2-metadata-token", token)
                .send()
                .await
                .expect("GET");
            (r.status().as_u16(), r.text().await.unwrap_or_default())
        }
    };
    for path in [
        "/latest/meta-data/instance-id",
        "/latest/meta-data/spot/instance-action",
        "/latest/meta-data/events/recommendations/rebalance",
    ] {
        let (ms, mb) = get(mock.url(), path).await;
        let (es, eb) = get(imds.url(), path).await;
        assert_eq!(es, ms, "{path}: status");
        if ms == 200 {
            match (
                serde_json::from_str::<serde_json::Value>(&mb),
                serde_json::from_str::<serde_json::Value>(&eb),
            ) {
                // A recommendation's time is each backend's own "now".
                (Ok(m), Ok(e)) if path.ends_with("/rebalance") => assert_eq!(
                    e.as_object().map(|o| o.keys().collect::<Vec<_>>()),
                    m.as_object().map(|o| o.keys().collect::<Vec<_>>()),
                    "{path}: fields"
                ),
                (Ok(m), Ok(e)) => assert_eq!(e, m, "{path}: body"),
                _ => assert_eq!(eb.trim(), mb.trim(), "{path}: body"),
            }
        }
    }
}

/// The scheduled-event document as the mock writes it, against the one the test kit writes
/// for the emulator (the timeline's `NotBefore`): EC2 writes the day of the month unpadded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scheduled_events_are_written_as_the_mock_writes_them() {
    // A single-digit day, whatever today is.
    let at = jiff::Timestamp::from_second(1_893_542_400).expect("2030-01-02T00:00:00Z");
    let mock = Mock::start(&[
        "events",
        "--code",
        "system-reboot",
        "--not-before",
        &rfc3339(at),
    ])
    .await;
    let body = reqwest::get(format!(
        "{}/latest/meta-data/events/maintenance/scheduled",
        mock.url()
    ))
    .await
    .expect("GET")
    .text()
    .await
    .expect("body");
    let events: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    let served = events[0]["NotBefore"].as_str().expect("NotBefore");
    assert_eq!(served, "2 Jan 2030 00:00:00 GMT", "the mock's NotBefore");
    assert_eq!(
        lastcall_testkit::timeline::runner::imds_time(at.into()),
        served,
        "the test kit writes NotBefore as EC2 does"
    );
    for key in [
        "Code",
        "Description",
        "EventId",
        "NotBefore",
        "NotAfter",
        "State",
    ] {
        assert!(events[0].get(key).is_some(), "{key} in {body}");
    }
}
