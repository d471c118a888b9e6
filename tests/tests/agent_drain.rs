//! End-to-end drain scenarios: the real agent (in-process and as a process) against the
//! emulated cluster, the GameLift emulator and a real redis-server.

use std::collections::BTreeSet;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use lastcall_common::fleetiq::{InstanceStatus as Status, StatusMessage};
use lastcall_testkit::agent::{metric, metric_sum};
use lastcall_testkit::cluster::fixtures::toleration_equal;
use lastcall_testkit::cluster::{GameServerState as S, GameServerView};
use lastcall_testkit::eventually::{eventually, wait_for};
use lastcall_testkit::world::{NS, World, WorldSpec, cordoned, has_taint, subscribed};

#[path = "support/passes.rs"]
mod passes;
use passes::after_passes;

async fn world(ready: usize, allocated: usize, reserved: usize, extra_nodes: &[&str]) -> World {
    World::start(WorldSpec::new(ready, allocated, reserved).extra_nodes(extra_nodes)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_fences_releases_protects_and_deregisters_once() {
    let w = world(3, 2, 1, &["n2", "n3"]).await;
    let before: Vec<GameServerView> = w.on("n1");
    let in_use: BTreeSet<(String, String)> = before
        .iter()
        .filter(|g| matches!(g.state, Some(S::Allocated | S::Reserved)))
        .map(|g| (g.name.clone(), g.uid.clone()))
        .collect();
    assert_eq!(in_use.len(), 3);
    let agent = w.agent(&[]).await;
    wait_for("registered and claimed", || async {
        (w.gl.count("RegisterGameServer") == 1 && w.gl.count("ClaimGameServer") == 1).then_some(())
    })
    .await;
    subscribed(&agent).await;
    w.claimed_all().await;

    w.status(Status::Draining).await;
    wait_for("node cordoned and tainted", || async {
        let n = w.node().await;
        (cordoned(&n) && has_taint(&n, "lastcall.dev/draining")).then_some(())
    })
    .await;
    wait_for("Ready servers released and replaced elsewhere", || async {
        let here: Vec<_> = w.on("n1").into_iter().filter(|g| !g.deleting).collect();
        let ready_elsewhere = w
            .cluster
            .game_servers()
            .iter()
            .filter(|g| g.state == Some(S::Ready) && !g.deleting && g.node.as_deref() != Some("n1"))
            .count();
        (here.len() == 3 && ready_elsewhere == 3).then_some(())
    })
    .await;
    wait_for("released servers gone", || async {
        (w.on("n1").len() == 3).then_some(())
    })
    .await;
    for g in w.on("n1") {
        assert!(
            in_use.contains(&(g.name.clone(), g.uid.clone())),
            "{} is not one of the in-use servers",
            g.name
        );
        assert!(!g.deleting, "{} must not be deleted", g.name);
        assert_eq!(
            g.annotations
                .get("lastcall.dev/drain-reason")
                .map(String::as_str),
            Some("viability")
        );
        assert!(g.annotations.contains_key("lastcall.dev/drain-deadline"));
        assert_eq!(
            g.labels
                .get("lastcall.dev/node-draining")
                .map(String::as_str),
            Some("true")
        );
    }
    let m = agent.metrics().await;
    assert_eq!(
        metric(&m, "lastcall_releases_total", &[("result", "ok")]),
        Some(3.0)
    );
    assert_eq!(
        metric(&m, "lastcall_signal_to_fence_seconds_count", &[]),
        Some(1.0)
    );
    assert_eq!(
        w.gl.count("DeregisterGameServer"),
        0,
        "not while matches run"
    );

    for (name, _) in &in_use {
        w.cluster.sdk_shutdown(NS, name).unwrap();
    }
    wait_for("deregistered", || async {
        (w.gl.count("DeregisterGameServer") == 1).then_some(())
    })
    .await;
    wait_for("deregistration recorded on the node", || async {
        let n = w.node().await;
        n.metadata
            .annotations
            .unwrap_or_default()
            .contains_key("lastcall.dev/deregistered")
            .then_some(())
    })
    .await;
    // The signal again, heard, and more passes after it: still exactly one.
    let draining = |m: &str| {
        metric_sum(
            m,
            "lastcall_signals_total",
            &[("source", "fleetiq"), ("status", "DRAINING")],
        )
    };
    let heard = draining(&agent.metrics().await);
    w.status(Status::Draining).await;
    wait_for("the signal heard again", || async {
        (draining(&agent.metrics().await) > heard).then_some(())
    })
    .await;
    after_passes(&agent, 2).await;
    assert_eq!(w.gl.count("DeregisterGameServer"), 1);
    let m = agent.metrics().await;
    assert_eq!(
        metric(&m, "lastcall_deregistrations_total", &[("result", "ok")]),
        Some(1.0)
    );
    assert_eq!(
        metric(&m, "lastcall_drain_phase", &[("phase", "deregistered")]),
        Some(1.0)
    );
    // Events were published on the Node: one per pass, each telling its steps.
    let events: Vec<(String, String)> = w
        .cluster
        .store()
        .list(&lastcall_testkit::kube::resources::EVENTS_K8S, None)
        .0
        .iter()
        .filter(|e| e.pointer("/regarding/kind").and_then(|k| k.as_str()) == Some("Node"))
        .filter_map(|e| {
            Some((
                e.get("reason")?.as_str()?.to_string(),
                e.get("note")?.as_str()?.to_string(),
            ))
        })
        .collect();
    let note_of = |reason: &str| {
        events
            .iter()
            .find(|(r, _)| r == reason)
            .map(|(_, n)| n.clone())
            .unwrap_or_else(|| panic!("missing Event {reason}: {events:?}"))
    };
    let started = note_of("DrainStarted");
    for want in [
        "viability (fleetiq)",
        "Cordoned and tainted",
        "Released 3 idle game server(s)",
        "Protecting 3 game server(s) in use (viability)",
    ] {
        assert!(started.contains(want), "{want:?} not in {started:?}");
    }
    for (name, _) in &in_use {
        assert!(
            started.contains(name.as_str()),
            "{name} not named in {started:?}"
        );
    }
    assert!(note_of("Deregistered").contains("deregistered from FleetIQ"));
    agent.stop().await.unwrap();
    assert_eq!(
        w.gl.count("DeregisterGameServer"),
        1,
        "SIGTERM does not deregister by default"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_undoes_only_lastcalls_changes() {
    let w = world(2, 1, 0, &["n2"]).await;
    let agent = w.agent(&[]).await;
    subscribed(&agent).await;
    w.claimed_all().await;

    w.status(Status::Draining).await;
    wait_for("fenced", || async {
        cordoned(&w.node().await).then_some(())
    })
    .await;
    // Someone else adds a taint mid-drain.
    let c = w.cluster.emulator().client().await.unwrap();
    let patch = serde_json::json!({"spec": {"taints": w.node().await.spec.unwrap().taints.unwrap().into_iter()
        .map(|t| serde_json::to_value(t).unwrap())
        .chain([serde_json::json!({"key": "example.com/foreign", "value": "x", "effect": "NoSchedule"})])
        .collect::<Vec<_>>()}});
    Api::<Node>::all(c.clone())
        .patch(
            "n1",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .unwrap();

    w.status(Status::Active).await;
    wait_for("uncordoned (we cordoned it)", || async {
        let n = w.node().await;
        (!cordoned(&n) && !has_taint(&n, "lastcall.dev/draining")).then_some(())
    })
    .await;
    let n = w.node().await;
    assert!(has_taint(&n, "example.com/foreign"), "foreign taint lost");
    assert!(
        !n.metadata
            .annotations
            .unwrap_or_default()
            .contains_key("lastcall.dev/drain-started")
    );
    wait_for("allocated server unmarked", || async {
        w.on("n1")
            .iter()
            .filter(|g| g.state == Some(S::Allocated))
            .all(|g| !g.labels.contains_key("lastcall.dev/node-draining"))
            .then_some(())
    })
    .await;

    // Cordoned by someone else, then DRAINING again, then ACTIVE: stays cordoned.
    Api::<Node>::all(c)
        .patch(
            "n1",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&serde_json::json!({"spec": {"unschedulable": true}})),
        )
        .await
        .unwrap();
    w.status(Status::Draining).await;
    wait_for("tainted again", || async {
        has_taint(&w.node().await, "lastcall.dev/draining").then_some(())
    })
    .await;
    w.status(Status::Active).await;
    wait_for("our taint removed", || async {
        (!has_taint(&w.node().await, "lastcall.dev/draining")).then_some(())
    })
    .await;
    let n = w.node().await;
    assert!(
        cordoned(&n),
        "a node cordoned by someone else must stay cordoned"
    );
    assert!(has_taint(&n, "example.com/foreign"));
    assert_eq!(w.gl.count("DeregisterGameServer"), 0);
    let m = agent.metrics().await;
    assert!(metric_sum(&m, "lastcall_signals_total", &[("status", "ACTIVE")]) >= 2.0);
    agent.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_causes_no_action_and_is_counted() {
    let w = world(2, 1, 0, &["n2"]).await;
    let agent = w.agent(&[]).await;
    subscribed(&agent).await;
    w.claimed_all().await;
    // Let start-up writes (claim labels, registration mark) settle, then watch the journal.
    eventually(
        "startup settles",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async {
            w.node()
                .await
                .metadata
                .annotations
                .unwrap_or_default()
                .contains_key("lastcall.dev/registered")
                .then_some(())
        },
    )
    .await;
    // Settled: a whole pass made no write.
    let mutating_before = wait_for("start-up writes settle", || async {
        let before = w.cluster.emulator().journal().mutating_count();
        after_passes(&agent, 2).await;
        (w.cluster.emulator().journal().mutating_count() == before).then_some(before)
    })
    .await;

    let big = format!(
        "{{\"InstanceId\":\"i-000000000000000n1\",\"InstanceStatus\":\"DRAINING\",\"pad\":\"{}\"}}",
        "x".repeat(1 << 20)
    );
    let mut bodies: Vec<String> = vec![big];
    for i in 0..50 {
        bodies.push(
            StatusMessage {
                group_name: None,
                group_arn: None,
                instance_id: format!("i-0000000000other{i:02}"),
                status: Status::Draining,
            }
            .to_python_json(),
        );
        bodies.push(format!("{{not json {i}"));
        bodies.push(format!(
            "{{\"InstanceId\":\"i-000000000000000n1\",\"InstanceStatus\":\"EXPLODING{i}\"}}"
        ));
        bodies.push(format!(
            "{{\"InstanceId\":{i},\"InstanceStatus\":\"DRAINING\"}}"
        ));
    }
    bodies.push("[\"DRAINING\"]".into());
    bodies.push("{\"InstanceStatus\":\"DRAINING\"}".into());
    let mut c = w.redis.client().await.unwrap();
    for b in &bodies {
        let _: i64 = redis::cmd("PUBLISH")
            .arg("i-000000000000000n1")
            .arg(b)
            .query_async(&mut c)
            .await
            .unwrap();
    }
    let sent = bodies.len() as f64;
    assert!(sent >= 200.0);
    wait_for("every bad message counted", || async {
        let m = agent.metrics().await;
        (metric_sum(
            &m,
            "lastcall_signals_rejected_total",
            &[("source", "fleetiq")],
        ) == sent)
            .then_some(())
    })
    .await;
    // Passes after every message was heard: none of them wrote.
    after_passes(&agent, 2).await;
    let m = agent.metrics().await;
    for reason in [
        "other_instance",
        "invalid_json",
        "unknown_status",
        "wrong_type",
        "oversize",
        "not_object",
        "missing_field",
    ] {
        assert!(
            metric(
                &m,
                "lastcall_signals_rejected_total",
                &[("source", "fleetiq"), ("reason", reason)]
            )
            .unwrap_or(0.0)
                >= 1.0,
            "{reason}"
        );
    }
    assert_eq!(
        w.cluster.emulator().journal().mutating_count(),
        mutating_before,
        "bad input must cause no write"
    );
    assert!(!cordoned(&w.node().await));
    assert_eq!(
        metric(&m, "lastcall_drain_phase", &[("phase", "idle")]),
        Some(1.0)
    );
    agent.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compat_mode_matches_the_original_on_the_wire() {
    // As with the original adapter, the Fleet's pods tolerate its `active` taint.
    let w = World::start(
        WorldSpec::new(1, 1, 0)
            .extra_nodes(&["n2"])
            .tolerate(toleration_equal(
                "gamelift.status/active",
                "true",
                "NoExecute",
            )),
    )
    .await;
    let agent = w.agent(&["--compat-taints"]).await;
    subscribed(&agent).await;
    w.claimed_all().await;
    wait_for("active taint after claim", || async {
        has_taint(&w.node().await, "gamelift.status/active").then_some(())
    })
    .await;
    let allocated = w
        .on("n1")
        .into_iter()
        .find(|g| g.state == Some(S::Allocated))
        .unwrap();
    w.status(Status::Draining).await;
    wait_for("draining taint", || async {
        has_taint(&w.node().await, "gamelift.status/draining").then_some(())
    })
    .await;
    let n = w.node().await;
    let taints: Vec<serde_json::Value> = n
        .spec
        .unwrap()
        .taints
        .unwrap()
        .into_iter()
        .map(|t| serde_json::to_value(t).unwrap())
        .collect();
    for key in ["gamelift.status/active", "gamelift.status/draining"] {
        let t = taints.iter().find(|t| t["key"] == key).unwrap();
        assert_eq!(
            t.to_string(),
            format!(r#"{{"effect":"NoExecute","key":"{key}","value":"true"}}"#)
        );
    }
    let c = w.cluster.emulator().client().await.unwrap();
    let pod = Api::<Pod>::namespaced(c, NS)
        .get(&allocated.name)
        .await
        .unwrap();
    let tols: Vec<String> = pod
        .spec
        .unwrap()
        .tolerations
        .unwrap_or_default()
        .iter()
        .map(|t| serde_json::to_string(t).unwrap())
        .collect();
    assert!(
        tols.contains(&r#"{"effect":"NoExecute","key":"gamelift.status/draining","operator":"Equal","value":"true"}"#.to_string()),
        "{tols:?}"
    );
    // The allocated server survived the NoExecute taint: the model's taint manager has had
    // its pass over the tainted node (the model went quiet) and left it.
    w.cluster
        .wait_stable(Duration::from_secs(10))
        .await
        .expect("the cluster model settles");
    assert!(
        w.on("n1")
            .iter()
            .any(|g| g.name == allocated.name && !g.deleting)
    );
    agent.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_sends_no_mutating_request() {
    let w = world(2, 1, 0, &["n2"]).await;
    let agent = w.agent(&["--dry-run"]).await;
    subscribed(&agent).await;
    w.status(Status::Draining).await;
    wait_for("dry-run actions recorded", || async {
        let m = agent.metrics().await;
        (metric(
            &m,
            "lastcall_actions_total",
            &[("action", "release"), ("result", "dry_run")],
        )
        .unwrap_or(0.0)
            >= 2.0)
            .then_some(())
    })
    .await;
    let j = w.cluster.emulator().journal();
    let agent_writes =
        j.count(|r| r.identity.as_deref() == Some("agent-n1") && r.verb.is_mutating());
    assert_eq!(agent_writes, 0, "dry run must not write");
    assert_eq!(
        w.gl.count("RegisterGameServer")
            + w.gl.count("ClaimGameServer")
            + w.gl.count("UpdateGameServer"),
        0
    );
    assert!(!cordoned(&w.node().await));
    agent.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscription_survives_keepalive_pings() {
    // While subscribed, Redis answers PING with ["pong", ""]; the keep-alive must accept it
    // instead of dropping the subscription at every ping.
    let w = world(1, 1, 0, &["n2"]).await;
    let agent = w.agent(&["--redis-ping-interval", "100ms"]).await;
    subscribed(&agent).await;
    // About a dozen pings answered (each counted by Redis as a command), not a sleep.
    let pings = |info: String| {
        info.lines()
            .find_map(|l| l.strip_prefix("cmdstat_ping:calls="))
            .and_then(|v| v.split(',').next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let stats = || async {
        let mut c = w.redis.client().await.unwrap();
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut c)
            .await
            .unwrap();
        pings(info)
    };
    let before = stats().await;
    wait_for("a dozen keep-alive pings", || async {
        (stats().await >= before + 12).then_some(())
    })
    .await;
    let m = agent.metrics().await;
    assert_eq!(
        metric(&m, "lastcall_redis_reconnects_total", &[]),
        Some(0.0),
        "the subscription dropped"
    );
    assert_eq!(metric(&m, "lastcall_redis_connected", &[]), Some(1.0));
    w.status(Status::Draining).await;
    wait_for("still receiving: fenced", || async {
        cordoned(&w.node().await).then_some(())
    })
    .await;
    assert_eq!(
        metric(
            &agent.metrics().await,
            "lastcall_redis_reconnects_total",
            &[]
        ),
        Some(0.0)
    );
    agent.stop().await.unwrap();
}
