//! How the agent finds its node's GameServers (`--gameserver-selector`): by `status.nodeName`
//! where the GameServer CRD declares it selectable (Agones 1.58 and later), by its own label
//! elsewhere. The real agent against the emulated cluster, the GameLift emulator and a real
//! redis-server.

use std::collections::BTreeSet;
use std::time::Duration;

use lastcall_common::fleetiq::InstanceStatus as Status;
use lastcall_testkit::agent::{metric, metric_sum};
use lastcall_testkit::cluster::{GameServerState as S, NodeSpec};
use lastcall_testkit::eventually::wait_for;
use lastcall_testkit::kube::journal::Verb;
use lastcall_testkit::kube::{FaultRule, Method};
use lastcall_testkit::world::{FLEET, NODE, NS, World, WorldSpec, cordoned, subscribed};

const LABEL_NODE: &str = "lastcall.dev/node";

/// Every write the agent sent to a GameServer, as (verb, name).
fn gameserver_writes(w: &World) -> Vec<(Verb, String)> {
    w.cluster
        .emulator()
        .journal()
        .filter(|e| {
            e.identity.as_deref() == Some("agent-n1")
                && e.resource.as_deref() == Some("gameservers")
                && matches!(e.verb, Verb::Patch | Verb::Delete | Verb::Update)
        })
        .into_iter()
        .map(|e| (e.verb, e.name.unwrap_or_default()))
        .collect()
}

/// Agones 1.58 or later: with the default flags the agent selects by `status.nodeName`,
/// sees servers that land on its node without writing to them, and drains exactly as by
/// label: every Ready server released, the match kept until it ends, one deregistration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_node_name_nothing_is_claimed_and_the_drain_is_whole() {
    let w = World::start(WorldSpec::new(3, 1, 0).extra_nodes(&[]).selectable_fields()).await;
    let agent = w.agent(&[]).await;
    subscribed(&agent).await;
    agent.selects_gameservers_by("field").await;
    // Two more land on n1 while the agent runs (the only node).
    w.cluster.scale_fleet(NS, FLEET, 6).expect("scale");
    wait_for("6 servers on n1, all Ready or Allocated", || async {
        let here = w.on(NODE);
        (here.len() == 6
            && here
                .iter()
                .all(|g| matches!(g.state, Some(S::Ready | S::Allocated))))
        .then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(gameserver_writes(&w), vec![], "no claims while idle");

    let keep = w.allocated();
    let ready: BTreeSet<String> = w
        .on(NODE)
        .into_iter()
        .filter(|g| g.state == Some(S::Ready))
        .map(|g| g.name)
        .collect();
    assert_eq!(ready.len(), 5);
    w.cluster.add_node(NodeSpec::new("n2")).expect("n2");
    w.status(Status::Draining).await;
    w.fenced_and_released(&keep).await;
    // The two that landed after the agent started were seen and released like the rest.
    let writes = gameserver_writes(&w);
    let deleted: BTreeSet<String> = writes
        .iter()
        .filter(|(v, _)| *v == Verb::Delete)
        .map(|(_, n)| n.clone())
        .collect();
    assert_eq!(
        deleted, ready,
        "every Ready server released, nothing else deleted"
    );
    assert!(
        writes
            .iter()
            .all(|(v, n)| *v == Verb::Delete || *n == keep.name),
        "only the match is written to (its protection): {writes:?}"
    );
    assert!(
        w.cluster
            .game_servers()
            .iter()
            .all(|g| !g.labels.contains_key(LABEL_NODE)),
        "no server carries the claim label"
    );
    w.finish_drain(&keep).await;
    let m = agent.metrics().await;
    assert_eq!(
        metric_sum(
            &m,
            "lastcall_actions_total",
            &[("action", "claim_gameserver")]
        ),
        0.0
    );
    agent.stop().await.expect("clean stop");
}

/// An older Agones: the probe is refused, the agent labels each server it sees and watches
/// the label (one claim per server).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_agones_falls_back_to_the_label() {
    let w = World::start(WorldSpec::new(2, 1, 0)).await;
    let agent = w.agent(&[]).await;
    agent.selects_gameservers_by("label").await;
    w.claimed_all().await;
    let claims = gameserver_writes(&w);
    assert_eq!(claims.len(), 3, "one claim per server: {claims:?}");
    assert!(claims.iter().all(|(v, _)| *v == Verb::Patch));
    agent.stop().await.expect("clean stop");
}

/// `--gameserver-selector label` on a new Agones: no probe, the label, as asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn label_is_used_when_asked_even_where_the_field_is_served() {
    let w = World::start(WorldSpec::new(2, 0, 0).selectable_fields()).await;
    let agent = w.agent(&["--gameserver-selector", "label"]).await;
    agent.selects_gameservers_by("label").await;
    w.claimed_all().await;
    let probes = w.cluster.emulator().journal().filter(|e| {
        e.identity.as_deref() == Some("agent-n1")
            && e.resource.as_deref() == Some("gameservers")
            && e.query.contains("status.nodeName")
    });
    assert!(probes.is_empty(), "no probe: {probes:?}");
    agent.stop().await.expect("clean stop");
}

/// `--gameserver-selector field` where the CRD does not declare the field: the agent stops
/// with an error naming the flag, before it writes anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn field_demanded_of_an_older_agones_stops_the_agent_with_the_reason() {
    let w = World::start(WorldSpec::new(2, 1, 0)).await;
    let agent = w.agent(&["--gameserver-selector", "field"]).await;
    let ended = agent
        .ended_within(Duration::from_secs(20))
        .await
        .expect("the agent must stop by itself");
    let err = ended.expect_err("an error, not a clean stop").to_string();
    assert!(err.contains("--gameserver-selector field"), "{err}");
    assert_eq!(gameserver_writes(&w), vec![]);
    assert!(!cordoned(&w.node().await));
}

/// A probe that gets no answer (503s) is asked again, never taken for a refusal: the agent
/// selects by field once the API server answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unanswered_probe_is_retried_not_guessed() {
    let w = World::start(WorldSpec::new(2, 0, 0).selectable_fields()).await;
    w.cluster.emulator().faults().inject(FaultRule::status(
        Some(Method::GET),
        "status.nodeName",
        3,
        503,
    ));
    let agent = w.agent(&[]).await;
    agent.selects_gameservers_by("field").await;
    let m = agent.metrics().await;
    assert!(
        metric(
            &m,
            "lastcall_watch_errors_total",
            &[("source", "gameserver")]
        ) >= Some(3.0),
        "each failed probe counted"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(gameserver_writes(&w), vec![], "nothing claimed");
    agent.stop().await.expect("clean stop");
}

/// Agones reinstalled without the selectable field while the agent runs: its watch can
/// never list again, so the agent stops with the reason; restarted, it selects by label and
/// sees every server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_withdrawn_field_stops_the_agent_and_the_restart_uses_the_label() {
    let w = World::start(WorldSpec::new(2, 1, 0).selectable_fields()).await;
    let agent = w.agent(&[]).await;
    agent.selects_gameservers_by("field").await;
    w.cluster.emulator().set_agones_selectable_fields(false);
    w.cluster.emulator().drop_watches();
    let ended = agent
        .ended_within(Duration::from_secs(30))
        .await
        .expect("the agent must stop by itself");
    let err = ended.expect_err("an error, not a clean stop").to_string();
    assert!(err.contains("status.nodeName"), "{err}");

    let agent = w.agent(&[]).await;
    agent.selects_gameservers_by("label").await;
    w.claimed_all().await;
    agent.stop().await.expect("clean stop");
}
