//! A fault in one dependency must not stop the agent or cause a drain: Redis dying mid-drain
//! (issue scenario 4), Redis going quiet, the instance id coming from (or missing from)
//! instance metadata, GameLift throttling everything, and Kubernetes API errors. The agent
//! runs in-process against the emulated cluster, the GameLift and IMDS emulators and a real
//! redis-server.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};
use lastcall_common::fleetiq::InstanceStatus as Status;
use lastcall_testkit::agent::{InProcessAgent, metric};
use lastcall_testkit::eventually::{eventually, try_eventually, wait_for};
use lastcall_testkit::gamelift::{Call, InstanceStatus};
use lastcall_testkit::imds::ImdsEmulator;
use lastcall_testkit::kube::{FaultRule, JournalEntry, Method, Verb};
use lastcall_testkit::promises::fence::assert_no_release_before_fence;
use lastcall_testkit::scale_restart::resource_version;
use lastcall_testkit::world::{
    GROUP, IID, NODE, NS, World, WorldSpec, cordoned, has_taint, subscribed,
};

/// The agent's identity in the journal.
const AGENT: &str = "agent-n1";

/// Redis stays down this long in the outage scenario (issue scenario 4).
const OUTAGE: Duration = Duration::from_secs(10);

/// n1 holds `ready` Ready and `allocated` Allocated servers; n2 joins afterwards.
async fn world(ready: usize, allocated: usize) -> World {
    World::start(WorldSpec::new(ready, allocated, 0)).await
}

fn taint_value(n: &Node, key: &str) -> Option<String> {
    n.spec
        .as_ref()?
        .taints
        .as_ref()?
        .iter()
        .find(|t| t.key == key)
        .map(|t| t.value.clone().unwrap_or_default())
}

fn fenced(n: &Node) -> bool {
    cordoned(n) && has_taint(n, "lastcall.dev/draining")
}

async fn gauge(agent: &InProcessAgent, name: &str, labels: &[(&str, &str)]) -> f64 {
    metric(&agent.metrics().await, name, labels).unwrap_or(0.0)
}

async fn wait_metric_at_least(agent: &InProcessAgent, name: &str, labels: &[(&str, &str)], v: f64) {
    wait_for(&format!("{name}{labels:?} >= {v}"), || async {
        (gauge(agent, name, labels).await >= v).then_some(())
    })
    .await;
}

/// How often each drain lifecycle Event (started, fenced, cancelled) was recorded on the
/// cluster, series counts included.
async fn drain_events(w: &World) -> BTreeMap<String, i32> {
    let events = Api::<k8s_openapi::api::events::v1::Event>::all(w.cluster.client());
    let mut out = BTreeMap::new();
    for e in events.list(&Default::default()).await.unwrap().items {
        let reason = e.reason.clone().unwrap_or_default();
        if ["DrainStarted", "NodeFenced", "DrainCancelled"].contains(&reason.as_str()) {
            *out.entry(reason).or_default() += e.series.map_or(1, |s| s.count);
        }
    }
    out
}

fn is_heartbeat(c: &Call) -> bool {
    c.op == "UpdateGameServer" && c.input["HealthCheck"] == "HEALTHY"
}

// ---------------------------------------------------------------------------------------
// Issue scenario 4: Redis killed for 10 s mid-drain
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_outage_mid_drain_keeps_heartbeats_and_the_drain_completes() {
    let mut w = world(1, 1).await;
    let keep = w.allocated();
    let agent = w.agent(&[]).await;
    subscribed(&agent).await;
    w.claimed_all().await;
    w.status(Status::Draining).await;
    w.fenced_and_released(&keep).await;
    let reconnects = gauge(&agent, "lastcall_redis_reconnects_total", &[]).await;
    let beats_ok = gauge(&agent, "lastcall_heartbeats_total", &[("result", "ok")]).await;

    let j = w.cluster.emulator().journal();
    let outage_start = j.entries().last().map_or(0, |e| e.seq);
    let drain_events_before = drain_events(&w).await;
    let down = SystemTime::now();
    w.redis.kill().await;
    wait_for("the agent notices Redis is gone", || async {
        (gauge(&agent, "lastcall_redis_connected", &[]).await == 0.0).then_some(())
    })
    .await;
    wait_metric_at_least(
        &agent,
        "lastcall_redis_reconnects_total",
        &[],
        reconnects + 1.0,
    )
    .await;
    // The outage itself: time has to pass here. Meanwhile the drain stands as it was: the
    // node fenced, the match protected, the phase still draining.
    let outage_end = tokio::time::Instant::now() + OUTAGE;
    let mut samples = 0;
    while tokio::time::Instant::now() < outage_end {
        let n = w.node().await;
        assert!(fenced(&n), "the fence came off during the Redis outage");
        let g = w.cluster.game_server(NS, &keep.name).unwrap();
        assert!(
            !g.deleting && g.annotations.contains_key("lastcall.dev/drain-deadline"),
            "the match lost its protection during the Redis outage"
        );
        assert_eq!(
            metric(
                &agent.metrics().await,
                "lastcall_drain_phase",
                &[("phase", "draining")]
            ),
            Some(1.0),
            "the drain phase changed during the Redis outage"
        );
        samples += 1;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(samples >= 5, "only {samples} samples during the outage");
    let outage_seq = j.entries().last().map_or(0, |e| e.seq);
    let up = SystemTime::now();
    w.redis.restart().await.unwrap();
    // By the journal: while Redis was down the agent changed nothing (no cancel, no uncordon,
    // no unprotect, no drain restarted) and recorded nothing new about the drain.
    let writes: Vec<_> = j
        .filter(|r| {
            r.seq > outage_start
                && r.seq <= outage_seq
                && r.identity.as_deref() == Some("agent-n1")
                && r.verb.is_mutating()
                && r.resource.as_deref() != Some("events")
        })
        .into_iter()
        .map(|r| (r.seq, r.verb.as_str(), r.resource, r.name, r.status))
        .collect();
    assert!(
        writes.is_empty(),
        "writes by the agent during the Redis outage: {writes:?}"
    );
    assert_eq!(
        drain_events(&w).await,
        drain_events_before,
        "a drain started, fenced or cancelled again during the Redis outage"
    );

    // Reconnect backoff is jittered and capped at 30 s; after 10 s down the pending delay
    // can be up to ~13 s (and, drawn unluckily, up to ~26 s).
    eventually(
        "the agent resubscribes",
        Duration::from_secs(40),
        Duration::from_millis(50),
        || async { (gauge(&agent, "lastcall_redis_connected", &[]).await == 1.0).then_some(()) },
    )
    .await;

    // Heartbeats, per the emulator's record: the 1 s period held through the outage.
    wait_for("a heartbeat after Redis came back", || async {
        w.gl.calls()
            .iter()
            .any(|c| is_heartbeat(c) && c.outcome == "ok" && c.at > up)
            .then_some(())
    })
    .await;
    let calls = w.gl.calls();
    let beats: Vec<SystemTime> = calls
        .iter()
        .filter(|c| is_heartbeat(c) && c.outcome == "ok")
        .map(|c| c.at)
        .collect();
    let during = beats.iter().filter(|t| **t >= down && **t <= up).count();
    assert!(
        during >= 7,
        "{during} heartbeats in a {OUTAGE:?} outage at a 1 s period"
    );
    // The chain from the last heartbeat before the outage to the first after it.
    let first = beats.iter().rposition(|t| *t < down).unwrap_or(0);
    let last = beats
        .iter()
        .position(|t| *t > up)
        .expect("a heartbeat after Redis came back");
    for pair in beats[first..=last].windows(2) {
        let gap = pair[1].duration_since(pair[0]).unwrap();
        assert!(
            gap < Duration::from_secs(3),
            "heartbeat gap of {gap:?} during the Redis outage"
        );
    }
    assert!(
        gauge(&agent, "lastcall_heartbeats_total", &[("result", "ok")]).await >= beats_ok + 7.0
    );

    // Still fenced, the match still protected, the last status kept through the outage.
    assert!(fenced(&w.node().await), "the outage did not undo the fence");
    let g = w.cluster.game_server(NS, &keep.name).unwrap();
    assert!(!g.deleting && g.annotations.contains_key("lastcall.dev/drain-deadline"));
    assert_eq!(
        metric(
            &agent.metrics().await,
            "lastcall_drain_phase",
            &[("phase", "draining")]
        ),
        Some(1.0)
    );

    // Resubscribed to the channel: a fresh message arrives.
    let labels = [("source", "fleetiq"), ("status", "DRAINING")];
    let seen = gauge(&agent, "lastcall_signals_total", &labels).await;
    w.status(Status::Draining).await;
    wait_metric_at_least(&agent, "lastcall_signals_total", &labels, seen + 1.0).await;

    w.finish_drain(&keep).await;
    agent.stop().await.unwrap();
    assert_no_release_before_fence(&j.entries(), AGENT, NODE);
}

// ---------------------------------------------------------------------------------------
// Redis up but quiet: ask GameLift directly
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quiet_redis_falls_back_to_gamelift_for_own_instance() {
    let w = world(1, 1).await;
    let keep = w.allocated();
    let agent = w
        .agent(&[
            "--publish-period",
            "1s",
            "--stale-periods",
            "2",
            "--healthcheck-interval",
            "5",
        ])
        .await;
    subscribed(&agent).await;
    w.claimed_all().await;
    // No message ever arrives on Redis; GameLift says DRAINING.
    w.gl.set_instance_status(IID, InstanceStatus::Draining);
    w.fenced_and_released(&keep).await;

    let describes: Vec<Call> =
        w.gl.calls()
            .into_iter()
            .filter(|c| c.op == "DescribeGameServerInstances")
            .collect();
    assert!(!describes.is_empty());
    for c in &describes {
        assert_eq!(c.input["InstanceIds"], serde_json::json!([IID]), "{c:?}");
        assert_eq!(c.input["GameServerGroupName"], GROUP, "{c:?}");
    }
    let m = agent.metrics().await;
    assert!(
        metric(
            &m,
            "lastcall_fleetiq_fallback_checks_total",
            &[("result", "ok")]
        ) >= Some(1.0)
    );
    assert!(
        metric(
            &m,
            "lastcall_signals_total",
            &[("source", "fleetiq"), ("status", "DRAINING")]
        ) >= Some(1.0)
    );
    assert_eq!(
        metric(&m, "lastcall_redis_connected", &[]),
        Some(1.0),
        "Redis was up, only quiet"
    );
    let ann = w.node().await.metadata.annotations.unwrap_or_default();
    assert_eq!(
        ann.get("lastcall.dev/drain-cause").map(String::as_str),
        Some("viability")
    );
    agent.stop().await.unwrap();
}

// ---------------------------------------------------------------------------------------
// Identity from instance metadata
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instance_id_from_imds_names_the_game_server_and_the_channel() {
    let w = world(1, 1).await;
    let keep = w.allocated();
    let imds = ImdsEmulator::start(IID, "ip-10-0-0-1.us-west-2.compute.internal")
        .await
        .unwrap();
    let mut args = w.fleetiq_args();
    args.extend(["--imds-endpoint".to_string(), imds.url()]);
    let agent = w.start_agent(&args).await;
    wait_for("registered and claimed", || async {
        (w.gl.count("ClaimGameServer") == 1).then_some(())
    })
    .await;
    let register =
        w.gl.calls()
            .into_iter()
            .find(|c| c.op == "RegisterGameServer")
            .unwrap();
    assert_eq!(register.input["GameServerId"], IID);
    assert_eq!(register.input["InstanceId"], IID);
    assert!(w.gl.game_server(GROUP, IID).unwrap().registered);
    let reqs = imds.requests();
    assert!(
        reqs.iter()
            .any(|(m, p, s)| m == "PUT" && p == "/latest/api/token" && *s == 200),
        "IMDSv2 token: {reqs:?}"
    );
    assert!(
        reqs.iter()
            .any(|(m, p, s)| m == "GET" && p == "/latest/meta-data/instance-id" && *s == 200),
        "{reqs:?}"
    );

    subscribed(&agent).await;
    w.claimed_all().await;
    w.status(Status::Draining).await; // published on channel i-n1
    w.fenced_and_released(&keep).await;
    assert_eq!(
        taint_value(&w.node().await, "lastcall.dev/draining").as_deref(),
        Some("fleetiq")
    );
    agent.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn imds_unreachable_leaves_fleetiq_waiting_and_manual_drain_working() {
    let w = world(1, 1).await;
    let keep = w.allocated();
    // A port nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut args = w.fleetiq_args();
    args.extend(["--imds-endpoint".to_string(), format!("http://{closed}")]);
    let agent = w.start_agent(&args).await;
    w.claimed_all().await;
    wait_metric_at_least(&agent, "lastcall_drain_phase", &[("phase", "idle")], 1.0).await;

    let patch = serde_json::json!({"metadata": {"labels": {"lastcall.dev/drain": "true"}}});
    Api::<Node>::all(w.cluster.client())
        .patch("n1", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    w.fenced_and_released(&keep).await;
    let n = w.node().await;
    assert_eq!(
        taint_value(&n, "lastcall.dev/draining").as_deref(),
        Some("manual")
    );
    let g = w.cluster.game_server(NS, &keep.name).unwrap();
    assert_eq!(
        g.annotations
            .get("lastcall.dev/drain-reason")
            .map(String::as_str),
        Some("manual")
    );
    assert!(w.gl.calls().is_empty(), "FleetIQ waits for an instance id");
    let m = agent.metrics().await;
    assert_eq!(metric(&m, "lastcall_redis_connected", &[]), Some(0.0));
    // Every task kept running: a supervised task that ended would make this an error.
    agent.stop().await.unwrap();
}

// ---------------------------------------------------------------------------------------
// GameLift and Kubernetes API faults
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gamelift_throttling_never_causes_a_drain() {
    let w = world(2, 1).await;
    let before: BTreeSet<String> = w.on(NODE).into_iter().map(|g| g.uid).collect();
    w.gl.set_throttle_ratio(1.0);
    let agent = w
        .agent(&[
            "--publish-period",
            "1s",
            "--stale-periods",
            "1",
            "--healthcheck-interval",
            "5",
        ])
        .await;
    subscribed(&agent).await;
    w.claimed_all().await;
    eventually(
        "throttled registrations and fallback checks are counted",
        Duration::from_secs(30),
        Duration::from_millis(100),
        || async {
            let m = agent.metrics().await;
            let beats = metric(
                &m,
                "lastcall_gamelift_calls_total",
                &[("operation", "RegisterGameServer"), ("result", "throttled")],
            );
            let checks = metric(
                &m,
                "lastcall_fleetiq_fallback_checks_total",
                &[("result", "throttled")],
            );
            (beats >= Some(3.0) && checks >= Some(1.0)).then_some(())
        },
    )
    .await;
    let calls = w.gl.calls();
    assert!(
        calls.iter().all(|c| c.outcome == "ThrottlingException"),
        "every call was throttled"
    );
    assert!(calls.iter().any(|c| c.op == "RegisterGameServer"));
    // No heartbeat before the server is registered.
    assert!(!calls.iter().any(is_heartbeat));
    let m = agent.metrics().await;
    assert_eq!(
        metric(&m, "lastcall_heartbeats_total", &[("result", "ok")]),
        None
    );
    assert_eq!(
        metric(&m, "lastcall_drain_phase", &[("phase", "idle")]),
        Some(1.0)
    );
    let n = w.node().await;
    assert!(
        n.spec.as_ref().and_then(|s| s.unschedulable) != Some(true),
        "not cordoned"
    );
    assert_eq!(taint_value(&n, "lastcall.dev/draining"), None);
    assert!(
        !n.metadata
            .annotations
            .unwrap_or_default()
            .contains_key("lastcall.dev/drain-started")
    );
    let after: BTreeSet<String> = w
        .on(NODE)
        .into_iter()
        .filter(|g| !g.deleting)
        .map(|g| g.uid)
        .collect();
    assert_eq!(after, before, "no game server released");
    // Readiness reports that FleetIQ start-up has not completed.
    let r = reqwest::get(format!("http://{}/readyz", agent.admin))
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    let report: serde_json::Value = r.json().await.unwrap();
    assert_eq!(report["fleetiq_registration"]["ok"], false, "{report}");
    agent.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_api_errors_are_retried_until_the_drain_completes() {
    let w = world(1, 1).await;
    let keep = w.allocated();
    let agent = w.agent(&[]).await;
    subscribed(&agent).await;
    w.claimed_all().await;
    // Start-up's own Node write (the registration mark) is done before faults go in.
    wait_for("registration recorded on the Node", || async {
        w.node()
            .await
            .metadata
            .annotations
            .unwrap_or_default()
            .contains_key("lastcall.dev/registered")
            .then_some(())
    })
    .await;
    let faults = w.cluster.emulator().faults();
    faults.inject(FaultRule::status(
        Some(Method::PATCH),
        "/api/v1/nodes/n1",
        2,
        500,
    ));
    w.status(Status::Draining).await;
    w.fenced_and_released(&keep).await;
    assert_eq!(faults.pending(), 0, "both injected failures were hit");
    let failed = w.cluster.emulator().journal().count(|e| {
        e.identity.as_deref() == Some("agent-n1")
            && e.method == "PATCH"
            && e.path == "/api/v1/nodes/n1"
            && e.status == 500
    });
    assert_eq!(failed, 2);
    let m = agent.metrics().await;
    assert!(metric(&m, "lastcall_reconciles_total", &[("result", "error")]) >= Some(1.0));
    w.finish_drain(&keep).await;
    agent.stop().await.unwrap();
    // The refused fences released nothing: the first release came after the accepted one.
    assert_no_release_before_fence(&w.cluster.emulator().journal().entries(), AGENT, NODE);
}

// ---------------------------------------------------------------------------------------
// The API server restarts mid-drain
// ---------------------------------------------------------------------------------------

/// How long the restarted API server answers 503.
const API_DOWN: Duration = Duration::from_secs(4);

/// The API server restarts while a drain waits on two matches (a control-plane upgrade
/// during a Spot wave): every watch ends, every request is answered 503 for 4 s, and the
/// watch history is gone, so each watch resumed from before is answered 410. One match
/// ends while the server is down: its DELETE reaches the agent through a re-list (or
/// through its resumed watch, if that watch held a resourceVersion the new server serves).
/// The agent keeps the fence and the other match's protection, sees the ended match gone,
/// deletes no allocated server, and deregisters exactly once when the second match ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_restart_mid_drain_is_recovered_by_listing_again() {
    use lastcall_testkit::agent::metric_sum;
    use lastcall_testkit::cluster::GameServerState;
    let w = world(1, 2).await;
    let matches: Vec<_> = w
        .on(NODE)
        .into_iter()
        .filter(|g| g.state == Some(GameServerState::Allocated))
        .collect();
    assert_eq!(matches.len(), 2);
    let agent = w.agent(&[]).await;
    subscribed(&agent).await;
    w.claimed_all().await;
    w.status(Status::Draining).await;
    wait_for(
        "fenced, the Ready server released, both matches protected",
        || async {
            let here = w.on(NODE);
            let n = w.node().await;
            (fenced(&n)
                && here.len() == 2
                && here
                    .iter()
                    .all(|g| g.annotations.contains_key("lastcall.dev/drain-deadline")))
            .then_some(())
        },
    )
    .await;
    let watch_errors = |m: &str| metric_sum(m, "lastcall_watch_errors_total", &[]);
    let errors_before = watch_errors(&agent.metrics().await);
    // A write elsewhere first: every watch of the agent is then behind the newest
    // resourceVersion, as on a busy cluster, so each one resumed is answered 410.
    let cm: k8s_openapi::api::core::v1::ConfigMap =
        serde_json::from_value(serde_json::json!({"metadata": {"name": "elsewhere"}})).unwrap();
    Api::namespaced(w.cluster.client(), NS)
        .create(&kube::api::PostParams::default(), &cm)
        .await
        .unwrap();
    let j = w.cluster.emulator().journal();
    let restart_seq = j.entries().last().map_or(0, |e| e.seq);
    let floor = w.cluster.emulator().restart(API_DOWN);
    // While it is down, the first match ends: the controller deletes its GameServer and
    // pod through etcd (the cluster model writes the store directly).
    let (ended, kept) = (&matches[0], &matches[1]);
    w.cluster
        .sdk_shutdown(NS, &ended.name)
        .expect("sdk shutdown");
    wait_for("the ended match's server and pod are gone", || async {
        (w.cluster.game_server(NS, &ended.name).is_none()
            && w.cluster.pod(NS, &ended.name).is_none())
        .then_some(())
    })
    .await;
    let gone_seq = j.entries().last().map_or(0, |e| e.seq);
    // The premise: the agent's watches could not have seen it; every request it made from
    // the restart until the match was gone was refused.
    let early: Vec<_> = j.filter(|e| {
        e.seq > restart_seq && e.seq <= gone_seq && e.identity.as_deref() == Some("agent-n1")
    });
    assert!(
        early.iter().all(|e| e.status == 503),
        "the agent was served while the server was down: {early:?}"
    );
    eventually(
        "the agent sees only the remaining match",
        Duration::from_secs(75),
        Duration::from_millis(50),
        || async {
            (metric_sum(&agent.metrics().await, "lastcall_game_servers", &[]) == 1.0).then_some(())
        },
    )
    .await;
    // Each kind comes back: a watch resumed from before the new watch cache's first
    // resourceVersion is answered 410 and its kind listed again; one that held a newer
    // resourceVersion (a write landed on this node as the server went down) is resumed, and
    // the DELETE reaches it through the watch. Each retries on its own jittered backoff, so
    // one kind may come back well after another: wait for each rather than assume they
    // return together. (The pods LIST before deregistering comes only once the second match
    // has ended, below.)
    let agent_asks = |e: &JournalEntry, kind: &str, verb: Verb| {
        e.identity.as_deref() == Some("agent-n1")
            && e.verb == verb
            && e.resource.as_deref() == Some(kind)
    };
    let mut relisted = 0;
    for kind in ["nodes", "pods", "gameservers"] {
        let from = wait_for("the agent's first watch after the restart", || async {
            j.filter(|e| e.seq > restart_seq && agent_asks(e, kind, Verb::Watch))
                .first()
                .map(|e| resource_version(&e.query))
        })
        .await;
        let behind = from.is_none_or(|rv| rv < floor);
        relisted += usize::from(behind);
        let back = try_eventually(
            &format!("{kind} back after the restart (listed again: {behind})"),
            Duration::from_secs(75),
            Duration::from_millis(50),
            || async {
                (j.count(|e| {
                    e.seq > gone_seq
                        && e.status == 200
                        && if behind {
                            agent_asks(e, kind, Verb::List)
                        } else {
                            agent_asks(e, kind, Verb::Watch)
                                && resource_version(&e.query).is_some_and(|rv| rv >= floor)
                        }
                }) >= 1)
                    .then_some(())
            },
        )
        .await;
        if let Err(e) = back {
            let seen: Vec<_> = j
                .filter(|e| e.seq > restart_seq && agent_asks(e, kind, e.verb))
                .iter()
                .map(|e| format!("#{} {} {} ?{}", e.seq, e.verb.as_str(), e.status, e.query))
                .collect();
            panic!(
                "{e}; watch cache from {floor}, gone at #{gone_seq}; the agent's requests: {seen:?}"
            );
        }
    }
    // A write elsewhere came last before the restart, so each watch is behind the new
    // cache unless a write on this node raced the restart (one kind in a dozen runs, measured
    // under load): the 410 path is taken in every run.
    assert!(
        relisted >= 1,
        "no kind was behind the restart: nothing was listed again"
    );
    let m = agent.metrics().await;
    assert!(
        watch_errors(&m) >= errors_before + 3.0,
        "each of the three watches failed and recovered: {} -> {}",
        errors_before,
        watch_errors(&m)
    );
    // The drain stands as it was.
    let n = w.node().await;
    assert!(fenced(&n), "the fence came off across the restart");
    let g = w
        .cluster
        .game_server(NS, &kept.name)
        .expect("the kept match");
    assert!(
        !g.deleting && g.annotations.contains_key("lastcall.dev/drain-deadline"),
        "the remaining match lost its protection across the restart"
    );
    assert_eq!(
        metric(&m, "lastcall_drain_phase", &[("phase", "draining")]),
        Some(1.0)
    );
    w.finish_drain(kept).await;
    // No allocated server was ever deleted by the agent.
    let killed: Vec<_> = j.filter(|e| {
        e.identity.as_deref() == Some("agent-n1")
            && e.verb == Verb::Delete
            && e.resource.as_deref() == Some("gameservers")
            && matches
                .iter()
                .any(|g| e.name.as_deref() == Some(g.name.as_str()))
    });
    assert!(killed.is_empty(), "allocated servers deleted: {killed:?}");
    agent.stop().await.unwrap();
    assert_no_release_before_fence(&j.entries(), AGENT, NODE);
}

/// The fence needs only the Node. Right after a start, while the API server refuses every
/// GameServer read (the selector probe and the GameServer watch cannot begin), a drain
/// signal still fences the node at once; the servers are released once they can be listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_fences_the_node_before_its_game_servers_can_be_listed() {
    let w = World::start(WorldSpec::new(2, 0, 0)).await;
    w.cluster.emulator().faults().inject(FaultRule::status(
        Some(Method::GET),
        "/apis/agones.dev/v1/",
        10_000,
        503,
    ));
    let agent = w.start_agent(&[]).await;
    Api::<Node>::all(w.cluster.client())
        .patch(
            "n1",
            &PatchParams::default(),
            &Patch::Merge(
                &serde_json::json!({"metadata": {"labels": {"lastcall.dev/drain": "true"}}}),
            ),
        )
        .await
        .expect("drain label");
    wait_for("fenced while GameServers cannot be read", || async {
        let n = w.node().await;
        (cordoned(&n) && has_taint(&n, "lastcall.dev/draining")).then_some(())
    })
    .await;
    let refused = w.cluster.emulator().journal().count(|r| {
        r.identity.as_deref() == Some("agent-n1")
            && r.path.contains("/apis/agones.dev/v1/")
            && r.status == 503
    });
    assert!(
        refused > 0,
        "the GameServer reads were refused: the fault was met"
    );
    assert_eq!(w.on("n1").len(), 2, "nothing released before they are seen");
    w.cluster.emulator().faults().clear();
    wait_for("both released once listed", || async {
        let released = w.cluster.emulator().journal().count(|r| {
            r.identity.as_deref() == Some("agent-n1")
                && r.resource.as_deref() == Some("gameservers")
                && r.verb == Verb::Delete
                && r.status < 300
        });
        (released == 2).then_some(())
    })
    .await;
    agent.stop().await.expect("clean stop");
}
