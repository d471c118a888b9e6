//! The windows in which a doomed node could still take or lose a match, each closed and
//! checked against the emulators' journals: failed writes, restarts, stale caches, late
//! pods, compat taints, persistent rejections.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Toleration};
use kube::Api;
use kube::api::{Patch, PatchParams};
use lastcall_common::fleetiq::InstanceStatus as Status;
use lastcall_testkit::agent::{InProcessAgent, config, metric_sum};
use lastcall_testkit::cluster::{
    Cluster, ClusterConfig, FleetSpec, GameServerSpec, GameServerState as S, NodeSpec,
};
use lastcall_testkit::eventually::{eventually, wait_for};
use lastcall_testkit::gamelift::{GameLiftEmulator, InstanceStatus};
use lastcall_testkit::kube::faults::{FaultRule, Method};
use lastcall_testkit::kube::journal::Verb;
use lastcall_testkit::promises::fence::{assert_no_release_before_fence, first_fence};
use lastcall_testkit::promises::retries::{backoff_faults, times_by_name};
use lastcall_testkit::world::{
    GROUP, IID, LIFECYCLE, NODE, NS, World, WorldSpec, annotation, cordoned, has_taint, subscribed,
};

/// Records, by wall clock, the last moment a game-server pod was seen on `node`.
async fn watch_game_pods(
    cluster: &Cluster,
    node: &str,
    stop: Arc<AtomicBool>,
) -> Option<SystemTime> {
    {
        let mut last = None;
        while !stop.load(Ordering::SeqCst) {
            let here = cluster
                .pods_on(node)
                .iter()
                .any(|p| p["metadata"]["labels"]["agones.dev/role"] == "gameserver");
            if here {
                last = Some(SystemTime::now());
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        last
    }
}

fn deregister_times(gl: &GameLiftEmulator) -> Vec<SystemTime> {
    gl.calls()
        .into_iter()
        .filter(|c| c.op == "DeregisterGameServer")
        .map(|c| c.at)
        .collect()
}

/// How long failed DELETEs are watched for their backoff, the most attempts allowed in it
/// and the gap that shows the delay grew (see the test).
const RETRY_WINDOW: Duration = Duration::from_secs(6);
const RETRY_MAX: usize = 15;
const RETRY_GAP: Duration = Duration::from_millis(400);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_deletes_leave_ready_servers_labelled_and_are_retried_with_backoff() {
    let w = World::start(WorldSpec::new(3, 1, 0)).await;
    // A resync far beyond the test: only the retry backoff can make progress.
    let agent = w.agent_with_resync("300s", &[]).await;
    subscribed(&agent).await;
    w.claimed_all().await;
    let in_use = w.allocated().name;
    w.cluster.emulator().faults().inject(FaultRule::status(
        Some(Method::DELETE),
        "/gameservers/",
        100_000,
        503,
    ));
    // Only what follows the signal: start-up writes (claims, the registration record) race
    // each other and are not part of the drain.
    let signal = w
        .cluster
        .emulator()
        .journal()
        .entries()
        .last()
        .map_or(0, |e| e.seq);
    w.status(Status::Draining).await;
    // Every Ready server is excluded from allocation by label while its DELETEs fail...
    wait_for("Ready servers labelled while deletes fail", || async {
        let ready: Vec<_> = w
            .on(NODE)
            .into_iter()
            .filter(|g| g.state == Some(S::Ready) && !g.deleting)
            .collect();
        (ready.len() == 3
            && ready.iter().all(|g| {
                g.labels
                    .get("lastcall.dev/node-draining")
                    .map(String::as_str)
                    == Some("true")
            }))
        .then_some(())
    })
    .await;
    // Retried while they fail: a few rounds, so the watch echoes of the labels (which also
    // start a pass) are long past and only the retry backoff is left to try again...
    let j = w.cluster.emulator().journal();
    let failed_deletes = || {
        j.count(|r| {
            r.verb == Verb::Delete
                && r.resource.as_deref() == Some("gameservers")
                && r.status == 503
        })
    };
    wait_for("three rounds of failed DELETEs", || async {
        (failed_deletes() >= 9).then_some(())
    })
    .await;
    // ...backing off, by the journal's times: for each server, within RETRY_WINDOW of its
    // first failed DELETE, at most RETRY_MAX attempts, and a gap of RETRY_GAP among them
    // (full jitter from 100 ms doubling draws both but for many draws far below their
    // ceiling in a row; a retry at once, or at a fixed short delay, breaks both).
    let failed = || {
        times_by_name(&j.entries(), |r| {
            r.identity.as_deref() == Some("agent-n1")
                && r.verb == Verb::Delete
                && r.resource.as_deref() == Some("gameservers")
                && r.status == 503
        })
    };
    let first = failed()
        .values()
        .filter_map(|t| t.first().copied())
        .max()
        .expect("failed DELETEs");
    let wait = (first + RETRY_WINDOW)
        .duration_since(SystemTime::now())
        .unwrap_or_default();
    tokio::time::sleep(wait + Duration::from_millis(100)).await;
    let by_server = failed();
    assert_eq!(by_server.len(), 3, "{by_server:?}");
    for (name, times) in &by_server {
        let faults = backoff_faults(times, RETRY_WINDOW, RETRY_MAX, RETRY_GAP);
        assert!(faults.is_empty(), "{name}: {}", faults.join("; "));
    }
    // ...and released once the API recovers, at the next retry (the backoff's cap is 30 s),
    // without waiting for a resync.
    w.cluster.emulator().faults().clear();
    eventually(
        "released after the faults",
        Duration::from_secs(35),
        Duration::from_millis(20),
        || async {
            w.on(NODE)
                .iter()
                .all(|g| g.deleting || g.state == Some(S::Allocated))
                .then_some(())
        },
    )
    .await;

    // One write per server while the API is healthy: a label only follows a failed DELETE
    // of that same server, as the next write to it.
    let all = j.entries();
    assert_no_release_before_fence(&all, "agent-n1", NODE);
    let entries = j.filter(|r| r.identity.as_deref() == Some("agent-n1") && r.seq > signal);
    let fence_seq = first_fence(&all, "agent-n1", NODE).expect("fence").seq;
    let fence = entries
        .iter()
        .position(|r| r.seq == fence_seq)
        .expect("the fence follows the signal");
    let after = &entries[fence + 1..];
    let labels: Vec<usize> = after
        .iter()
        .enumerate()
        .filter(|(_, r)| {
            r.verb == Verb::Patch
                && r.resource.as_deref() == Some("gameservers")
                && r.name.as_deref() != Some(in_use.as_str())
        })
        .map(|(i, _)| i)
        .collect();
    assert!(!labels.is_empty(), "{entries:#?}");
    for i in labels {
        let name = &after[i].name;
        let previous = after[..i]
            .iter()
            .rev()
            .find(|r| r.resource.as_deref() == Some("gameservers") && &r.name == name)
            .unwrap_or_else(|| {
                panic!("a label of {name:?} with no DELETE before it: {entries:#?}")
            });
        assert_eq!(
            (previous.verb.as_str(), previous.status),
            ("delete", 503),
            "{name:?} was labelled without a failed DELETE before it"
        );
    }
    agent.stop().await.unwrap();
}

/// A DELETE refused with 429 is retried as it is, after its `Retry-After`: no label write in
/// between, which could not land before the retry (it waits out the same Retry-After) and
/// would be one more write for a server that asked for fewer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_delete_is_retried_after_retry_after_without_a_label() {
    let w = World::start(WorldSpec::new(3, 1, 0)).await;
    let agent = w.agent(&[]).await;
    subscribed(&agent).await;
    w.claimed_all().await;
    let in_use = w.allocated().name;
    // Every Ready server's first DELETE is refused.
    w.cluster.emulator().faults().inject(FaultRule::throttle(
        Some(Method::DELETE),
        "/gameservers/",
        3,
        Duration::from_secs(1),
    ));
    let j = w.cluster.emulator().journal();
    let signal = j.entries().last().map_or(0, |e| e.seq);
    w.status(Status::Draining).await;
    wait_for("every Ready server released", || async {
        w.on(NODE)
            .iter()
            .all(|g| g.deleting || g.state == Some(S::Allocated))
            .then_some(())
    })
    .await;
    let writes = j.filter(|r| {
        r.seq > signal
            && r.identity.as_deref() == Some("agent-n1")
            && r.resource.as_deref() == Some("gameservers")
            && r.name.as_deref() != Some(in_use.as_str())
            && r.verb.is_mutating()
    });
    let refused = writes.iter().filter(|r| r.status == 429).count();
    assert!(refused >= 1, "the fault refused a DELETE: {writes:#?}");
    assert!(
        writes.iter().all(|r| r.verb == Verb::Delete),
        "only DELETEs to the idle servers, no label after a 429: {writes:#?}"
    );
    // The first pass (fence, protect) failed part-way: its steps waited for the pass that
    // released the servers, and one Event tells them all (two without the wait).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let events: Vec<String> = j
        .filter(|r| {
            r.seq > signal
                && r.identity.as_deref() == Some("agent-n1")
                && r.resource.as_deref() == Some("events")
                && r.verb.is_mutating()
                && r.status < 300
        })
        .iter()
        .map(|r| {
            r.response
                .as_ref()
                .and_then(|v| v["note"].as_str().map(String::from))
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(
        events.len(),
        1,
        "one Event for the drain's steps: {events:#?}"
    );
    for step in ["Cordoned and tainted", "Released 3 idle", "Protecting 1"] {
        assert!(events[0].contains(step), "{step:?} missing: {events:#?}");
    }
    // Each retry came after the refusal's Retry-After.
    for (i, r) in writes.iter().enumerate().filter(|(_, r)| r.status == 429) {
        if let Some(next) = writes[i + 1..].iter().find(|n| n.name == r.name) {
            let waited = next.at.duration_since(r.at).unwrap_or_default();
            assert!(
                waited >= Duration::from_secs(1),
                "{:?} retried {waited:?} after its 429",
                r.name
            );
        }
    }
    agent.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_stuck_before_ready_is_deleted_and_the_node_deregistered() {
    let w = World::start(WorldSpec::new(0, 1, 0).extra_nodes(&[])).await;
    // A server whose game never calls Ready(): it sits in Scheduled on n1.
    w.cluster
        .create_fleet(FleetSpec::new("stuck", 1).grace_seconds(0).manual_ready())
        .unwrap();
    wait_for("stuck server on n1", || async {
        w.cluster
            .fleet_game_servers(NS, "stuck")
            .iter()
            .any(|g| g.node.as_deref() == Some(NODE) && g.state != Some(S::Ready))
            .then_some(())
    })
    .await;
    let agent = w.agent(&["--deregister-settle", "200ms"]).await;
    subscribed(&agent).await;
    w.claimed_all().await;
    w.status(Status::Draining).await;
    let keep = w.allocated();
    wait_for("the stuck server is released", || async {
        w.cluster
            .fleet_game_servers(NS, "stuck")
            .iter()
            .all(|g| g.node.as_deref() != Some(NODE) || g.deleting)
            .then_some(())
    })
    .await;
    w.finish_drain(&keep).await;
    agent.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spot_drain_stays_fenced_with_its_deadline_after_a_crash_and_a_late_active() {
    let w = World::start(WorldSpec::new(1, 1, 0)).await;
    let agent = w.agent(&[]).await;
    subscribed(&agent).await;
    w.claimed_all().await;
    w.status(Status::SpotTerminating).await;
    let keep = w.allocated();
    w.fenced_and_released(&keep).await;
    let deadline = w.allocated().annotations["lastcall.dev/drain-deadline"].clone();
    agent.abort();

    tokio::time::sleep(Duration::from_millis(1100)).await; // the deadline is second-precise
    let agent = w.agent(&[]).await;
    subscribed(&agent).await;
    // A lagging replica (or a failover) now says ACTIVE.
    w.status(Status::Active).await;
    let passes = |m: &str| metric_sum(m, "lastcall_reconciles_total", &[]);
    let start = passes(&agent.metrics().await);
    wait_for("several passes after ACTIVE", || async {
        (passes(&agent.metrics().await) >= start + 3.0).then_some(())
    })
    .await;
    let n = w.node().await;
    assert!(
        cordoned(&n) && has_taint(&n, "lastcall.dev/draining"),
        "still fenced"
    );
    assert_eq!(
        w.allocated().annotations["lastcall.dev/drain-deadline"],
        deadline,
        "the deadline did not move"
    );
    agent.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_with_redis_down_and_deletes_failing_resumes_releases_within_seconds() {
    let mut w = World::start(WorldSpec::new(3, 1, 0)).await;
    let in_use = w.allocated();
    let agent = w.agent(&[]).await;
    subscribed(&agent).await;
    w.claimed_all().await;
    w.cluster.emulator().faults().inject(FaultRule::status(
        Some(Method::DELETE),
        "/gameservers/",
        100_000,
        503,
    ));
    w.status(Status::Draining).await;
    wait_for("fenced", || async {
        has_taint(&w.node().await, "lastcall.dev/draining").then_some(())
    })
    .await;
    agent.abort();
    w.redis.kill().await;
    let j = w.cluster.emulator().journal();
    let restart = j.entries().last().map_or(0, |e| e.seq);
    // A resync far beyond the test: only the retry backoff can make progress.
    let agent = w.agent_with_resync("300s", &[]).await;
    let failed_after_restart = || {
        j.count(|r| {
            r.seq > restart
                && r.identity.as_deref() == Some("agent-n1")
                && r.verb == Verb::Delete
                && r.resource.as_deref() == Some("gameservers")
                && r.status == 503
        })
    };
    // FleetIQ is unknown (Redis down, fallback not due for minutes): the drain is held, and
    // the releases of the Ready servers on the fenced node are tried, and retried, anyway.
    wait_for(
        "releases retried after the restart while DELETEs fail",
        || async { (failed_after_restart() >= 6).then_some(()) },
    )
    .await;
    w.cluster.emulator().faults().clear();
    eventually(
        "released within seconds of the API's recovery",
        Duration::from_secs(8),
        Duration::from_millis(20),
        || async {
            w.on(NODE)
                .iter()
                .all(|g| g.deleting || g.state == Some(S::Allocated))
                .then_some(())
        },
    )
    .await;
    assert!(cordoned(&w.node().await));
    let released = j.filter(|r| {
        r.seq > restart
            && r.identity.as_deref() == Some("agent-n1")
            && r.verb == Verb::Delete
            && r.resource.as_deref() == Some("gameservers")
            && r.status < 300
    });
    let released: std::collections::BTreeSet<String> =
        released.into_iter().filter_map(|r| r.name).collect();
    assert!(
        !released.contains(&in_use.name),
        "the allocated server was deleted: {released:?}"
    );
    assert_eq!(
        released.len(),
        3,
        "every Ready server released: {released:?}"
    );
    let kept = w.allocated();
    assert_eq!((kept.uid, kept.deleting), (in_use.uid, false));
    agent.stop().await.unwrap();
    // The restarted agent released behind the fence its predecessor left standing.
    assert_no_release_before_fence(&j.entries(), "agent-n1", NODE);
}

/// How long the emulated scheduler takes to bind a pod it has decided on.
const BIND_LAG: Duration = Duration::from_millis(800);
/// The agent's `--deregister-settle`: longer than the bind lag.
const SETTLE: &str = "2s";

/// What the sampler saw, in its own order of observation.
#[derive(Default)]
struct Sightings {
    /// The last moment (wall clock) a game-server pod was seen on the node.
    last_pod: Option<SystemTime>,
    /// The first sample that found the node cordoned, and the first that found a game-server
    /// pod on it.
    first_cordoned: Option<u64>,
    first_pod: Option<u64>,
}

/// Samples `node` until `stop`: when it was cordoned and when game-server pods were on it.
async fn watch_node(cluster: &Cluster, node: &str, stop: Arc<AtomicBool>) -> Sightings {
    let mut seen = Sightings::default();
    let mut sample = 0u64;
    while !stop.load(Ordering::SeqCst) {
        sample += 1;
        let cordoned = cluster
            .node(node)
            .is_some_and(|n| n["spec"]["unschedulable"] == serde_json::json!(true));
        if cordoned && seen.first_cordoned.is_none() {
            seen.first_cordoned = Some(sample);
        }
        let here = cluster
            .pods_on(node)
            .iter()
            .any(|p| p["metadata"]["labels"]["agones.dev/role"] == "gameserver");
        if here {
            seen.last_pod = Some(SystemTime::now());
            seen.first_pod.get_or_insert(sample);
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    seen
}

/// One run: the scheduler decides on a game server's pod (one that tolerates everything, so
/// the cordon does not stop it) just before the manual drain label lands on an otherwise
/// empty node, and binds it `BIND_LAG` later: after the fence, within the settle period.
/// Returns whether the pod was seen to land after the cordon.
async fn late_pod_run(seed: u64) -> bool {
    let cluster = Cluster::start(ClusterConfig {
        tick: Duration::from_millis(5),
        bind_lag: BIND_LAG,
        ..ClusterConfig::default()
    })
    .await
    .unwrap();
    cluster.add_node(NodeSpec::new(NODE)).unwrap();
    let gl = GameLiftEmulator::start().await.unwrap();
    gl.add_instances(GROUP, &[IID.to_string()], InstanceStatus::Active);
    let cfg = cluster.emulator().config_for("agent-n1").await.unwrap();
    let agent = InProcessAgent::start(
        config(
            NODE,
            &[
                "--game-server-group",
                GROUP,
                "--instance-id",
                IID,
                "--resync-interval",
                "1s",
                "--deregister-settle",
                SETTLE,
            ],
        ),
        cfg,
        Some(gl.sdk_client().await),
    )
    .await
    .unwrap();
    eventually(
        "registered",
        Duration::from_secs(20),
        Duration::from_millis(10),
        || async { (gl.count("ClaimGameServer") >= 1).then_some(()) },
    )
    .await;
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = watch_node(&cluster, NODE, stop.clone());
    let scenario = async {
        // A GameServer of no Fleet: once released, nothing replaces it (a replacement that
        // tolerates everything would land on the node again, after any settle).
        // A second of grace keeps its pod on the node, terminating, long enough to be seen
        // even on a loaded machine.
        cluster
            .create_game_server(GameServerSpec::new("late").grace_seconds(1).toleration(
                Toleration {
                    operator: Some("Exists".into()),
                    ..Toleration::default()
                },
            ))
            .unwrap();
        // The pod exists (and is being decided on) before the drain signal.
        eventually(
            &format!("seed {seed}: the game server's pod is created"),
            Duration::from_secs(10),
            Duration::from_millis(1),
            || async {
                let pods = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(cluster.client(), NS)
                    .list(&Default::default())
                    .await
                    .ok()?;
                (!pods.items.is_empty()).then_some(())
            },
        )
        .await;
        Api::<Node>::all(cluster.client())
            .patch(
                NODE,
                &PatchParams::default(),
                &Patch::Merge(
                    &serde_json::json!({"metadata": {"labels": {"lastcall.dev/drain": "true"}}}),
                ),
            )
            .await
            .unwrap();
        eventually(
            &format!("seed {seed}: deregistered"),
            Duration::from_secs(30),
            Duration::from_millis(10),
            || async { (gl.count("DeregisterGameServer") >= 1).then_some(()) },
        )
        .await;
        // Long enough for a pod bound after a premature deregistration to be seen.
        tokio::time::sleep(BIND_LAG + Duration::from_millis(300)).await;
        stop.store(true, Ordering::SeqCst);
    };
    let (seen, ()) = tokio::join!(sampler, scenario);
    let deregs = deregister_times(&gl);
    assert_eq!(deregs.len(), 1, "seed {seed}: exactly one deregistration");
    let last = seen
        .last_pod
        .unwrap_or_else(|| panic!("seed {seed}: the game-server pod never reached the node"));
    assert!(
        deregs[0] > last,
        "seed {seed}: deregistered while a game-server pod was on the node (or before it landed)"
    );
    agent.stop().await.unwrap();
    cluster.shutdown().await;
    matches!((seen.first_cordoned, seen.first_pod), (Some(c), Some(p)) if p > c)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_bound_after_the_fence_within_the_settle_is_never_deregistered_under() {
    const RUNS: u64 = 12;
    let after: Vec<bool> = futures::stream::iter(0..RUNS)
        .map(late_pod_run)
        .buffer_unordered(4)
        .collect()
        .await;
    let n = after.iter().filter(|l| **l).count();
    eprintln!("{RUNS} runs: the game-server pod landed after the cordon in {n}");
    assert!(
        n > RUNS as usize / 2,
        "only {n} of {RUNS} runs bound the pod after the cordon: the settle was not exercised"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_starting_drained_with_a_failed_register_ends_deregistered_and_silent() {
    let w = World::start(WorldSpec::new(0, 0, 0)).await;
    w.gl.fail_next("RegisterGameServer", 1, 500);
    w.status(Status::Draining).await;
    let agent = w.agent(&["--deregister-settle", "0s"]).await;
    wait_for("deregistered", || async {
        annotation(&w.node().await, "lastcall.dev/deregistered").map(|_| ())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(2500)).await; // heartbeats are every 1 s
    let calls: Vec<String> =
        w.gl.calls()
            .into_iter()
            .map(|c| c.op)
            .filter(|op| LIFECYCLE.contains(&op.as_str()))
            .collect();
    let deregs: Vec<usize> = calls
        .iter()
        .enumerate()
        .filter(|(_, op)| *op == "DeregisterGameServer")
        .map(|(i, _)| i)
        .collect();
    assert_eq!(deregs.len(), 1, "exactly one deregistration: {calls:?}");
    assert!(
        calls[deregs[0] + 1..].is_empty(),
        "FleetIQ calls after the deregistration: {calls:?}"
    );
    assert!(
        w.gl.game_server(GROUP, IID).is_none_or(|g| !g.registered),
        "left registered: {calls:?}"
    );
    agent.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_deregistration_and_its_mark_never_deregisters_twice() {
    let w = World::start(WorldSpec::new(0, 0, 0)).await;
    let agent = w.agent(&["--deregister-settle", "0s"]).await;
    subscribed(&agent).await;
    wait_for("registered", || async {
        (w.gl.count("ClaimGameServer") >= 1).then_some(())
    })
    .await;
    // The deregistration is held unanswered until the fault below is in place: no timing.
    w.gl.hang_next("DeregisterGameServer", 1);
    w.status(Status::Draining).await;
    wait_for(
        "deregistration under way (GameLift asked first)",
        || async { (w.gl.count("DescribeGameServer") >= 1 && w.gl.hung_now() == 1).then_some(()) },
    )
    .await;
    // The mark that would follow the call never lands.
    w.cluster.emulator().faults().inject(FaultRule::status(
        Some(Method::PATCH),
        "/api/v1/nodes/n1",
        100_000,
        500,
    ));
    w.gl.release_hangs();
    wait_for("DeregisterGameServer answered", || async {
        (w.gl.count("DeregisterGameServer") == 1).then_some(())
    })
    .await;
    // Gone before the fault is lifted: an abort still running could land the mark after.
    agent.crash().await;
    w.cluster.emulator().faults().clear();
    assert!(annotation(&w.node().await, "lastcall.dev/deregistered").is_none());

    let agent = w.agent(&["--deregister-settle", "0s"]).await;
    wait_for("deregistration recorded after the restart", || async {
        annotation(&w.node().await, "lastcall.dev/deregistered").map(|_| ())
    })
    .await;
    assert_eq!(w.gl.count("DeregisterGameServer"), 1, "{:?}", w.gl.calls());
    assert!(
        w.gl.count("DescribeGameServer") >= 2,
        "checked before calling again: {:?}",
        w.gl.calls()
    );
    agent.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_game_in_its_termination_grace_period_keeps_the_node() {
    let w = World::start(WorldSpec::new(0, 1, 0).grace_seconds(2)).await;
    let agent = w.agent(&["--deregister-settle", "0s"]).await;
    subscribed(&agent).await;
    w.claimed_all().await;
    w.status(Status::Draining).await;
    let keep = w.allocated();
    wait_for("protected", || async {
        w.allocated()
            .annotations
            .contains_key("lastcall.dev/drain-deadline")
            .then_some(())
    })
    .await;
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = watch_game_pods(&w.cluster, NODE, stop.clone());
    let scenario = async {
        // The match is over and its GameServer deleted, but the game process is still
        // flushing results: its pod terminates for up to its grace period.
        let gs_api: Api<kube::api::DynamicObject> = Api::namespaced_with(
            w.cluster.client(),
            NS,
            &lastcall_testkit::cluster::allocator::gameserver_resource(),
        );
        gs_api
            .delete(&keep.name, &Default::default())
            .await
            .unwrap();
        wait_for("deregistered", || async {
            (w.gl.count("DeregisterGameServer") == 1).then_some(())
        })
        .await;
        stop.store(true, Ordering::SeqCst);
    };
    let (last, ()) = tokio::join!(sampler, scenario);
    let last = last.expect("the pod was seen");
    assert!(
        deregister_times(&w.gl)[0] > last,
        "deregistered while the game's pod was still terminating"
    );
    agent.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compat_mode_never_evicts_a_match_that_does_not_tolerate_the_active_taint() {
    let w = World::start(WorldSpec::new(0, 1, 0)).await;
    let keep = w.allocated();
    let agent = w.agent(&["--compat-taints"]).await;
    subscribed(&agent).await;
    let events = Api::<k8s_openapi::api::events::v1::Event>::all(w.cluster.client());
    wait_for("a Warning Event says why", || async {
        let list = events.list(&Default::default()).await.ok()?;
        list.items
            .iter()
            .any(|e| e.reason.as_deref() == Some("CompatTaintSkipped"))
            .then_some(())
    })
    .await;
    assert!(!has_taint(&w.node().await, "gamelift.status/active"));
    let now = w.allocated();
    assert_eq!(
        (now.uid, now.deleting),
        (keep.uid, false),
        "the match still runs"
    );
    agent.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_persistent_422_on_the_node_backs_off() {
    let w = World::start(WorldSpec::new(1, 0, 0)).await;
    let agent = w.agent(&[]).await;
    subscribed(&agent).await;
    w.claimed_all().await;
    w.cluster.emulator().faults().inject(FaultRule::status(
        Some(Method::PATCH),
        "/api/v1/nodes/n1",
        100_000,
        422,
    ));
    let j = w.cluster.emulator().journal();
    let node_requests = || {
        j.count(|r| {
            r.identity.as_deref() == Some("agent-n1")
                && r.resource.as_deref() == Some("nodes")
                && r.name.as_deref() == Some(NODE)
                && r.verb == Verb::Patch
        })
    };
    let before = node_requests();
    w.status(Status::Draining).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let sent = node_requests() - before;
    // Never fenced, so nothing released: the Ready server is neither deleted nor labelled.
    let entries = j.entries();
    assert!(first_fence(&entries, "agent-n1", NODE).is_none());
    assert_no_release_before_fence(&entries, "agent-n1", NODE);
    assert!(
        w.on(NODE).iter().all(|g| !g.deleting),
        "a server was released on a node that was never fenced"
    );
    // Backoff from 100 ms doubling: about 6 attempts in 4 s (each 422 is followed by one GET
    // that tells a stale resourceVersion from a refused write). Treated as a conflict, it was
    // about 10 PATCH+GET pairs a second.
    assert!((1..=10).contains(&sent), "{sent} node PATCHes in 4 s");
    let m = agent.metrics().await;
    assert!(metric_sum(&m, "lastcall_reconciles_total", &[("result", "error")]) >= 1.0);
    agent.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_name_longer_than_a_label_value_drains() {
    let long = format!("{}.compute.internal", "ip-10-0-0-1-game-pool-a".repeat(3));
    assert!(long.len() > 63);
    let cluster = Cluster::start(ClusterConfig::default()).await.unwrap();
    // The kubelet's hostname label must be a valid label value too.
    cluster
        .add_node(NodeSpec::new(long.as_str()).label("kubernetes.io/hostname", "ip-10-0-0-1"))
        .unwrap();
    cluster
        .create_fleet(FleetSpec::new("fleet", 2).grace_seconds(0))
        .unwrap();
    cluster.wait_ready(NS, "fleet", 2).await.unwrap();
    cluster.add_node(NodeSpec::new("n2")).unwrap();
    let cfg = cluster.emulator().config_for("agent-long").await.unwrap();
    let agent = InProcessAgent::start(config(&long, &["--resync-interval", "1s"]), cfg, None)
        .await
        .unwrap();
    Api::<Node>::all(cluster.client())
        .patch(
            &long,
            &PatchParams::default(),
            &Patch::Merge(
                &serde_json::json!({"metadata": {"labels": {"lastcall.dev/drain": "true"}}}),
            ),
        )
        .await
        .unwrap();
    wait_for("both servers released from the long-named node", || async {
        cluster
            .game_servers()
            .iter()
            .filter(|g| g.node.as_deref() == Some(long.as_str()))
            .all(|g| g.deleting)
            .then_some(())
    })
    .await;
    let j = cluster.emulator().journal();
    // The start-up probe of the GameServer field selector is refused by this (older)
    // Agones by design; nothing else may be.
    assert_eq!(
        j.count(|r| r.identity.as_deref() == Some("agent-long")
            && r.status == 400
            && !r.query.contains("status.nodeName")),
        0,
        "no request was rejected"
    );
    agent.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_409_without_a_change_behind_it_never_strands_an_idle_server() {
    let w = World::start(WorldSpec::new(2, 1, 0)).await;
    let agent = w.agent(&[]).await;
    subscribed(&agent).await;
    w.claimed_all().await;
    // A 409 that no change caused (an admission webhook, a proxy): the preconditions still
    // match, so the same delete must be tried again.
    w.cluster.emulator().faults().inject(FaultRule::status(
        Some(Method::DELETE),
        "/gameservers/",
        2,
        409,
    ));
    w.status(Status::Draining).await;
    eventually(
        "both idle servers released",
        Duration::from_secs(8),
        Duration::from_millis(20),
        || async {
            w.on(NODE)
                .iter()
                .all(|g| g.deleting || g.state == Some(S::Allocated))
                .then_some(())
        },
    )
    .await;
    let j = w.cluster.emulator().journal();
    assert_eq!(
        j.count(|r| r.verb == Verb::Delete && r.status == 409),
        2,
        "both injected conflicts were met"
    );
    agent.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn released_servers_are_not_written_again_after_a_cancel() {
    let w = World::start(WorldSpec::new(8, 1, 0).grace_seconds(0)).await;
    let agent = w.agent(&[]).await;
    subscribed(&agent).await;
    w.claimed_all().await;
    w.status(Status::Draining).await;
    // Cancel right as the releases land, while the deleted servers may still be in the
    // agent's cache: the drain-then-cancel cycle of a flapping signal.
    wait_for("released", || async {
        w.on(NODE)
            .iter()
            .all(|g| g.deleting || g.state == Some(S::Allocated))
            .then_some(())
    })
    .await;
    w.status(Status::Active).await;
    wait_for("cancelled", || async {
        let n = w.node().await;
        (!cordoned(&n) && !has_taint(&n, "lastcall.dev/draining")).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let j = w.cluster.emulator().journal();
    let ghosts = j.count(|r| {
        r.identity.as_deref() == Some("agent-n1")
            && r.resource.as_deref() == Some("gameservers")
            && r.status == 404
    });
    // Each ghost's whole history (who did what to it, when), so a failure explains itself.
    let names: Vec<String> = j
        .filter(|r| {
            r.identity.as_deref() == Some("agent-n1")
                && r.resource.as_deref() == Some("gameservers")
                && r.status == 404
        })
        .into_iter()
        .filter_map(|r| r.name)
        .collect();
    let history: Vec<_> = j
        .filter(|r| r.name.as_ref().is_some_and(|n| names.contains(n)))
        .iter()
        .map(|r| {
            (
                r.seq,
                r.identity.clone().unwrap_or_default(),
                r.verb.as_str(),
                r.resource.clone().unwrap_or_default(),
                r.subresource.clone().unwrap_or_default(),
                r.status,
            )
        })
        .collect();
    assert_eq!(
        ghosts, 0,
        "writes to servers the agent itself deleted; their history: {history:#?}"
    );
    agent.stop().await.unwrap();
}
