//! Webhook notifications end to end: the real agent (built as the binary builds it) posts to
//! a local receiver (`lastcall_testkit::webhook_receiver`) at a drain's moments, in order,
//! once each, also across a restart; a receiver that hangs, fails or is not there changes
//! nothing in the drain (the agent's writes, by the kube journal, are the baseline's), and
//! its failures are counted; the URL, a secret, never reaches a log; a bad template stops
//! start-up.

use std::io::Write as _;
use std::sync::{Arc, Mutex, Once, OnceLock};
use std::time::Duration;

use clap::Parser;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};
use lastcall_agent::config::Config;
use lastcall_common::fleetiq::InstanceStatus as Status;
use lastcall_testkit::agent::{InProcessAgent, config, metric, metric_sum};
use lastcall_testkit::eventually::{eventually, try_eventually, wait_for};
use lastcall_testkit::imds::ImdsEmulator;
use lastcall_testkit::kube::journal::Verb;
use lastcall_testkit::promises::fence::first_fence;
use lastcall_testkit::webhook_receiver::{Answer, Received, WebhookReceiver, refusing_url};
use lastcall_testkit::world::{
    GROUP, IID, NODE, NS, World, WorldSpec, annotation, cordoned, has_taint, subscribed,
};

const LONG: Duration = Duration::from_secs(90);
const EVERY: Duration = Duration::from_millis(50);
/// The full drain's game servers' termination grace period, in seconds.
const GRACE: i64 = 20;

/// Every log line of this test binary, at every level, from every crate.
fn logs() -> &'static Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    static INSTALL: Once = Once::new();
    let logs = LOGS.get_or_init(Default::default);
    INSTALL.call_once(|| {
        let sink = Capture(logs.clone());
        let _ = tracing::subscriber::set_global_default(
            tracing_subscriber::fmt()
                .with_writer(move || sink.clone())
                .with_ansi(false)
                .with_max_level(tracing::Level::DEBUG)
                .finish(),
        );
    });
    logs
}

#[derive(Clone)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn logged() -> String {
    String::from_utf8_lossy(&logs().lock().unwrap_or_else(|p| p.into_inner())).into_owned()
}

/// The URL's secret part is nowhere in the logs (the host and port may be).
fn assert_not_logged(token: &str) {
    let text = logged();
    assert!(
        !text.contains(token),
        "the webhook token appears in the logs: {}",
        text.lines().find(|l| l.contains(token)).unwrap_or_default()
    );
}

/// A file holding `url`, as a Secret's volume would.
fn url_file(url: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().expect("temp file");
    writeln!(f, "{url}").expect("write");
    f
}

fn events(got: &[Received]) -> Vec<String> {
    got.iter()
        .map(|r| {
            r.json
                .as_ref()
                .and_then(|j| j["event"].as_str())
                .unwrap_or("<not json>")
                .to_string()
        })
        .collect()
}

/// Every field in its own key, so each can be checked.
const FIELDS_TEMPLATE: &str = r#"{"event":"{event}","node":"{node}","cluster":"{cluster}","reason":"{reason}","source":"{source}","deadline":"{deadline}","text":"{message}"}"#;

fn notify_args(file: &tempfile::NamedTempFile, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "--notify-url-file",
        file.path().to_str().expect("utf-8 path"),
        "--notify-template",
        FIELDS_TEMPLATE,
        "--notify-cluster",
        "test-cluster",
    ]
    .map(String::from)
    .to_vec();
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// The Node Event reasons the agent wrote, in order.
fn node_events(w: &World) -> Vec<String> {
    w.cluster
        .store()
        .list(&lastcall_testkit::kube::resources::EVENTS_K8S, None)
        .0
        .iter()
        .filter(|e| e.pointer("/regarding/kind").and_then(|k| k.as_str()) == Some("Node"))
        .filter_map(|e| Some(e.get("reason")?.as_str()?.to_string()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_drain_notifies_start_hard_deadline_and_deregistration_in_order() {
    logs();
    let r = WebhookReceiver::start().await.expect("receiver");
    let file = url_file(&r.url());
    let w = World::start(WorldSpec::new(1, 1, 0).grace_seconds(GRACE)).await;
    let imds = ImdsEmulator::start(IID, "ip-10-0-0-1.ec2.internal")
        .await
        .expect("imds");
    let mut args = w.fleetiq_args();
    args.extend(notify_args(
        &file,
        // The Fleet's `eviction.safe` is Agones' default, Never: lastcall may end its match
        // at the deadline only with --graceful-termination.
        &[
            "--instance-id",
            IID,
            "--deregister-settle",
            "1s",
            "--graceful-termination",
            "--aws-imds",
            "--imds-endpoint",
            &imds.url(),
        ],
    ));
    let agent = w.start_agent(&args).await;
    wait_for("registered", || async {
        (w.gl.count("RegisterGameServer") == 1).then_some(())
    })
    .await;
    w.claimed_all().await;
    assert!(r.received().is_empty(), "nothing to tell before a drain");

    let keep = w.allocated();
    // A Spot interruption: the node dies in GRACE + 3 s (to the second, as IMDS says it).
    // lastcall ends the match at 3 s, the game shuts down at once, and the empty node is
    // deregistered well before the deadline.
    let deadline = (jiff::Timestamp::now() + jiff::SignedDuration::from_secs(GRACE + 3))
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string();
    imds.set_spot_action(Some(
        serde_json::json!({"action": "terminate", "time": deadline}),
    ));
    wait_for("hard_deadline told", || async {
        events(&r.received())
            .iter()
            .any(|e| e == "hard_deadline")
            .then_some(())
    })
    .await;
    // The game gets SIGTERM and, as games do, ends its match and shuts down.
    let _ = w.cluster.sdk_shutdown(NS, &keep.name);
    if let Err(e) = try_eventually("three notifications", LONG, EVERY, || async {
        (r.received().len() >= 3).then_some(())
    })
    .await
    {
        panic!(
            "{e}: got {:?}; servers on n1 {:?}; Node Events {:?}; the Node's annotations {:?}",
            events(&r.received()),
            w.on(NODE)
                .iter()
                .map(|g| (g.name.clone(), g.state, g.deleting))
                .collect::<Vec<_>>(),
            node_events(&w),
            w.node().await.metadata.annotations,
        );
    }
    wait_for("deregistration recorded", || async {
        annotation(&w.node().await, "lastcall.dev/deregistered").map(|_| ())
    })
    .await;
    // More passes run (resync 1 s): nothing is told twice.
    let passes = metric_sum(&agent.metrics().await, "lastcall_reconciles_total", &[]);
    wait_for("three more passes", || async {
        (metric_sum(&agent.metrics().await, "lastcall_reconciles_total", &[]) >= passes + 3.0)
            .then_some(())
    })
    .await;
    let m = agent.metrics().await;
    agent.stop().await.expect("clean stop");

    let got = r.received();
    assert_eq!(
        events(&got),
        ["drain_started", "hard_deadline", "deregistered"],
        "{got:#?}"
    );
    for g in &got {
        let j = g.json.as_ref().expect("JSON");
        assert_eq!(g.content_type.as_deref(), Some("application/json"));
        assert_eq!(j["node"], NODE);
        assert_eq!(j["cluster"], "test-cluster");
        assert_eq!(j["reason"], "preemption", "{j}");
        assert_eq!(j["source"], "aws_imds", "{j}");
        assert!(j["text"].as_str().is_some_and(|t| !t.is_empty()), "{j}");
    }
    let j = |i: usize| got[i].json.clone().unwrap_or_default();
    assert!(
        j(0)["text"]
            .as_str()
            .is_some_and(|t| t.starts_with("Drain started: preemption (aws_imds).")),
        "{}",
        j(0)
    );
    assert!(j(0)["deadline"].as_str().is_some_and(|d| !d.is_empty()));
    assert_eq!(j(1)["deadline"], deadline);
    assert!(
        j(1)["text"]
            .as_str()
            .is_some_and(|t| t.contains("1 match(es)")),
        "{}",
        j(1)
    );
    assert_eq!(j(2)["deadline"], "");
    // Each notification is the transition of a Node Event, in the same order.
    let reasons = node_events(&w);
    let pos = |r: &str| {
        reasons
            .iter()
            .position(|x| x == r)
            .unwrap_or_else(|| panic!("no {r} Event: {reasons:?}"))
    };
    assert!(pos("DrainStarted") < pos("MatchesEnded") && pos("MatchesEnded") < pos("Deregistered"));
    for (event, n) in [
        ("drain_started", 1.0),
        ("hard_deadline", 1.0),
        ("deregistered", 1.0),
    ] {
        assert_eq!(
            metric(
                &m,
                "lastcall_notifications_total",
                &[("event", event), ("outcome", "sent")]
            ),
            Some(n),
            "{event}"
        );
    }
    assert_not_logged(r.token());
    w.cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_notifies_start_then_cancel_once_also_across_a_restart() {
    logs();
    let r = WebhookReceiver::start().await.expect("receiver");
    let file = url_file(&r.url());
    let w = World::start(WorldSpec::new(1, 1, 0)).await;
    let extra = notify_args(&file, &[]);
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let agent = w.agent(&extra).await;
    subscribed(&agent).await;
    w.claimed_all().await;
    w.status(Status::Draining).await;
    wait_for("drain_started told", || async {
        (events(&r.received()) == ["drain_started"]).then_some(())
    })
    .await;

    // A restart finds the drain recorded on the Node: it tells nothing new.
    agent.stop().await.expect("clean stop");
    let agent = w.agent(&extra).await;
    subscribed(&agent).await;
    wait_for("the restarted agent planned a few passes", || async {
        (metric_sum(&agent.metrics().await, "lastcall_reconciles_total", &[]) >= 3.0).then_some(())
    })
    .await;
    let n = w.node().await;
    assert!(cordoned(&n) && has_taint(&n, "lastcall.dev/draining"));
    assert_eq!(events(&r.received()), ["drain_started"]);

    w.status(Status::Active).await;
    wait_for("cancelled: taint gone", || async {
        (!has_taint(&w.node().await, "lastcall.dev/draining")).then_some(())
    })
    .await;
    wait_for("drain_cancelled told", || async {
        (r.received().len() == 2).then_some(())
    })
    .await;
    let passes = metric_sum(&agent.metrics().await, "lastcall_reconciles_total", &[]);
    wait_for("three more passes", || async {
        (metric_sum(&agent.metrics().await, "lastcall_reconciles_total", &[]) >= passes + 3.0)
            .then_some(())
    })
    .await;
    agent.stop().await.expect("clean stop");
    let got = r.received();
    assert_eq!(
        events(&got),
        ["drain_started", "drain_cancelled"],
        "{got:#?}"
    );
    for g in &got {
        let j = g.json.as_ref().expect("JSON");
        assert_eq!(
            (j["reason"].as_str(), j["source"].as_str()),
            (Some("viability"), Some("fleetiq")),
            "{j}"
        );
        assert_eq!(j["node"], NODE);
    }
    let reasons = node_events(&w);
    assert_eq!(
        reasons.iter().filter(|r| *r == "DrainStarted").count(),
        1,
        "{reasons:?}"
    );
    assert!(reasons.iter().any(|r| r == "DrainCancelled"), "{reasons:?}");
    assert_not_logged(r.token());
    w.cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_fleetiq_the_drained_node_is_told_empty_once() {
    logs();
    let r = WebhookReceiver::start().await.expect("receiver");
    let file = url_file(&r.url());
    let w = World::start(WorldSpec::new(1, 1, 0)).await;
    let mut args: Vec<String> = ["--resync-interval", "1s"].map(String::from).to_vec();
    args.extend(notify_args(&file, &[]));
    let agent = w.start_agent(&args).await;
    w.claimed_all().await;
    let keep = w.allocated();
    // The operator's drain label: no FleetIQ, so nothing to deregister.
    Api::<Node>::all(w.cluster.client())
        .patch(
            NODE,
            &PatchParams::default(),
            &Patch::Merge(
                &serde_json::json!({"metadata": {"labels": {"lastcall.dev/drain": "true"}}}),
            ),
        )
        .await
        .expect("label");
    w.fenced_and_released(&keep).await;
    assert_eq!(events(&r.received()), ["drain_started"]);
    w.cluster
        .sdk_shutdown(NS, &keep.name)
        .expect("sdk shutdown");
    wait_for("empty told", || async {
        (r.received().len() == 2).then_some(())
    })
    .await;
    let passes = metric_sum(&agent.metrics().await, "lastcall_reconciles_total", &[]);
    wait_for("three more passes", || async {
        (metric_sum(&agent.metrics().await, "lastcall_reconciles_total", &[]) >= passes + 3.0)
            .then_some(())
    })
    .await;
    agent.stop().await.expect("clean stop");
    let got = r.received();
    assert_eq!(events(&got), ["drain_started", "empty"], "{got:#?}");
    let j = got[1].json.clone().unwrap_or_default();
    assert_eq!(
        (j["reason"].as_str(), j["source"].as_str()),
        (Some("manual"), Some("manual")),
        "{j}"
    );
    assert_not_logged(r.token());
    w.cluster.shutdown().await;
}

/// "Empty: the drained node may be taken" is a hand-off (an operator takes the node on it),
/// so it passes the gate's fresh read. Here the match ends while the agent's watches lag,
/// and a game server that tolerates everything binds to the node before the agent sees the
/// match go: its caches say empty, a fresh LIST says otherwise. Nothing is told while the
/// pod is on the node; once it is released, "empty" is told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_is_told_only_on_a_fresh_read() {
    use lastcall_testkit::cluster::GameServerSpec;
    use lastcall_testkit::kube::faults::WatchDelay;
    logs();
    let r = WebhookReceiver::start().await.expect("receiver");
    let file = url_file(&r.url());
    // No other node: nothing but a pod that tolerates the fence can land anywhere.
    let w = World::start(WorldSpec::new(0, 1, 0).extra_nodes(&[])).await;
    let mut args: Vec<String> = ["--resync-interval", "1s", "--deregister-settle", "0s"]
        .map(String::from)
        .to_vec();
    args.extend(notify_args(&file, &[]));
    let agent = w.start_agent(&args).await;
    w.claimed_all().await;
    let keep = w.allocated();
    Api::<Node>::all(w.cluster.client())
        .patch(
            NODE,
            &PatchParams::default(),
            &Patch::Merge(
                &serde_json::json!({"metadata": {"labels": {"lastcall.dev/drain": "true"}}}),
            ),
        )
        .await
        .expect("label");
    w.fenced_and_released(&keep).await;
    wait_for("drain_started told", || async {
        (events(&r.received()) == ["drain_started"]).then_some(())
    })
    .await;
    // The agent's pod and GameServer watches now lag 8 s behind the API server.
    let faults = w.cluster.emulator().faults();
    for resource in ["pods", "gameservers"] {
        faults.delay_watches(
            WatchDelay::resource(resource, Duration::from_secs(8)).identity("agent-n1"),
        );
    }
    let game_pods = || {
        w.cluster
            .pods_on(NODE)
            .into_iter()
            .filter(|p| p["metadata"]["labels"]["agones.dev/role"] == "gameserver")
            .map(|p| {
                p["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string()
            })
            .collect::<Vec<_>>()
    };
    let journal = w.cluster.emulator().journal();
    let ended = journal.entries().len();
    w.cluster
        .sdk_shutdown(NS, &keep.name)
        .expect("the match ends");
    wait_for("the match's pod gone", || async {
        game_pods().is_empty().then_some(())
    })
    .await;
    w.cluster
        .create_game_server(GameServerSpec::new("late").grace_seconds(1).toleration(
            k8s_openapi::api::core::v1::Toleration {
                operator: Some("Exists".into()),
                ..Default::default()
            },
        ))
        .expect("game server");
    wait_for("the late pod on the node", || async {
        (!game_pods().is_empty()).then_some(())
    })
    .await;
    // The agent sees the match go (8 s after it went): its caches are empty now, but the
    // late pod is on the node. A fresh read finds it: its server is released first, and
    // only then, with the node empty, is "empty" told.
    wait_for("empty told", || async {
        events(&r.received())
            .iter()
            .any(|e| e == "empty")
            .then_some(())
    })
    .await;
    let released = journal.entries().into_iter().skip(ended).any(|e| {
        e.identity.as_deref() == Some("agent-n1")
            && e.resource.as_deref() == Some("gameservers")
            && e.verb == Verb::Delete
            && e.name.as_deref() == Some("late")
            && e.status < 300
    });
    assert!(
        released,
        "told empty while the late game-server pod was on the node (the agent had not released it)"
    );
    assert!(game_pods().is_empty(), "{:?}", game_pods());
    assert_eq!(events(&r.received()), ["drain_started", "empty"]);
    faults.clear_watch_delays();
    agent.stop().await.expect("clean stop");
    w.cluster.shutdown().await;
}

/// What a drain did, as the kube journal shows the agent's accepted writes (Events left
/// out: they are queued and land whenever), each step once however often it was retried,
/// and FleetIQ's lifecycle calls (heartbeats left out).
#[derive(Debug, PartialEq, Eq)]
struct DrainShape {
    writes: Vec<(String, String, String)>,
    fleetiq: Vec<String>,
}

/// One FleetIQ drain with one match, ended by the game; `notify` flags added to the agent.
/// Returns its shape and the agent's metrics at the end.
async fn drain_with(notify: &[String]) -> (DrainShape, String) {
    let w = World::start(WorldSpec::new(2, 1, 0).grace_seconds(1)).await;
    let mut extra: Vec<&str> = vec!["--deregister-settle", "1s"];
    extra.extend(notify.iter().map(String::as_str));
    let agent = w.agent(&extra).await;
    subscribed(&agent).await;
    w.claimed_all().await;
    let keep = w.allocated();
    w.status(Status::Draining).await;
    w.fenced_and_released(&keep).await;
    w.cluster
        .sdk_shutdown(NS, &keep.name)
        .expect("sdk shutdown");
    eventually("deregistered and recorded", LONG, EVERY, || async {
        annotation(&w.node().await, "lastcall.dev/deregistered").map(|_| ())
    })
    .await;
    let m = agent.metrics().await;
    agent.stop().await.expect("clean stop");
    let mut writes: Vec<(String, String, String)> = vec![];
    // From the fence on: before it, the claims and the FleetIQ registration interleave as
    // their two tasks happen to run, and nothing is notified.
    let entries = w.cluster.emulator().journal().entries();
    let fence_seq = first_fence(&entries, "agent-n1", "n1")
        .expect("the fence in the journal")
        .seq;
    let fence = entries
        .iter()
        .position(|e| e.seq == fence_seq)
        .expect("the fence's place");
    for e in &entries[fence..] {
        if e.identity.as_deref() != Some("agent-n1")
            || !e.verb.is_mutating()
            || e.status >= 300
            || e.resource.as_deref() == Some("events")
        {
            continue;
        }
        let step = (
            format!("{:?}", e.verb),
            e.resource.clone().unwrap_or_default(),
            e.subresource.clone().unwrap_or_default(),
        );
        if writes.last() != Some(&step) {
            writes.push(step);
        }
    }
    assert!(
        writes
            .iter()
            .any(|(v, r, _)| v == &format!("{:?}", Verb::Delete) && r == "gameservers"),
        "{writes:?}"
    );
    let fleetiq =
        w.gl.calls()
            .iter()
            .map(|c| c.op.clone())
            .filter(|op| op != "UpdateGameServer" && op != "DescribeGameServerInstances")
            .collect();
    w.cluster.shutdown().await;
    (DrainShape { writes, fleetiq }, m)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_hangs_fails_or_is_absent_changes_nothing_in_the_drain() {
    logs();
    let ok = WebhookReceiver::start().await.expect("receiver");
    let ok_file = url_file(&ok.url());
    let (baseline, m) = drain_with(&notify_args(&ok_file, &[])).await;
    assert_eq!(
        events(&ok.received()),
        ["drain_started", "deregistered"],
        "{baseline:?}"
    );
    assert_eq!(
        metric_sum(&m, "lastcall_notifications_total", &[("outcome", "sent")]),
        2.0
    );
    assert_eq!(
        baseline
            .fleetiq
            .iter()
            .filter(|op| *op == "DeregisterGameServer")
            .count(),
        1,
        "{baseline:?}"
    );

    let hangs = WebhookReceiver::start().await.expect("receiver");
    hangs.answer(Answer::Hang);
    let fails = WebhookReceiver::start().await.expect("receiver");
    fails.answer(Answer::Status(500));
    let refused = refusing_url();
    for (what, url, token) in [
        ("hangs", hangs.url(), hangs.token().to_string()),
        ("500", fails.url(), fails.token().to_string()),
        (
            "refused",
            refused.clone(),
            refused
                .rsplit_once("/services/")
                .map(|(_, t)| t.to_string())
                .unwrap_or_default(),
        ),
    ] {
        let file = url_file(&url);
        let (shape, m) = drain_with(&notify_args(&file, &["--notify-timeout", "1s"])).await;
        assert_eq!(shape, baseline, "receiver {what}: the drain changed");
        let sent = metric_sum(&m, "lastcall_notifications_total", &[("outcome", "sent")]);
        assert_eq!(sent, 0.0, "receiver {what}");
        assert_not_logged(&token);
    }
    // Failures are counted and logged (without the URL): a fresh agent against the failing
    // receiver, kept running until it gives up.
    let file = url_file(&fails.url());
    let w = World::start(WorldSpec::new(0, 0, 0)).await;
    let extra = notify_args(&file, &["--notify-timeout", "1s"]);
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let agent = w.agent(&extra).await;
    subscribed(&agent).await;
    w.status(Status::Draining).await;
    eventually("the drain_started failure counted", LONG, EVERY, || async {
        (metric(
            &agent.metrics().await,
            "lastcall_notifications_total",
            &[("event", "drain_started"), ("outcome", "failed")],
        ) == Some(1.0))
        .then_some(())
    })
    .await;
    agent.stop().await.expect("clean stop");
    assert!(
        fails.received().len() >= 3,
        "retried: {:?}",
        fails.received().len()
    );
    let text = logged();
    assert!(
        text.lines().any(|l| l.contains("WARN")
            && l.contains("notification failed")
            && l.contains("drain_started")
            && l.contains("500")),
        "no warning for the failure"
    );
    assert_not_logged(fails.token());
    assert_not_logged(hangs.token());
    w.cluster.shutdown().await;
}

#[test]
fn a_bad_template_or_url_stops_start_up() {
    for (template, want) in [
        (
            r#"{"text":"{node} {nodename}"}"#,
            "unknown placeholder {nodename}",
        ),
        (r#"{"text": {node}}"#, "not JSON once filled in"),
        (r#"["{node}"]"#, "must be a JSON object"),
    ] {
        let err = Config::try_parse_from([
            "lastcall-agent",
            "--node-name",
            NODE,
            "--notify-template",
            template,
        ])
        .expect_err(template);
        assert_eq!(err.exit_code(), 2);
        let text = err.to_string();
        assert!(
            text.contains("--notify-template") && text.contains(want),
            "{text}"
        );
    }
    // A file that holds no URL: start-up fails naming the file, not its contents.
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let file = url_file("hooks.example.com/services/T0SECRET");
        let w = World::start(WorldSpec::new(0, 0, 0)).await;
        let kube = w
            .cluster
            .emulator()
            .config_for("agent-n1")
            .await
            .expect("client");
        let path = file.path().to_str().expect("utf-8").to_string();
        let cfg = config(
            NODE,
            &["--notify-url-file", &path, "--game-server-group", GROUP],
        );
        let err = match InProcessAgent::start(cfg, kube, None).await {
            Ok(a) => a.stop().await.expect_err("start-up must fail"),
            Err(e) => e,
        };
        let text = format!("{err:#}");
        assert!(text.contains("--notify-url-file"), "{text}");
        assert!(!text.contains("T0SECRET"), "{text}");
        w.cluster.shutdown().await;
    });
}
