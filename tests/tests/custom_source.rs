//! Scenario 11 of the signals issue: a source added in a test, as one file
//! (`support/doomsday.rs`) plus one registry line, drains a node end to end and cancels
//! when it clears. Nothing in the agent names it.

#[path = "support/doomsday.rs"]
mod doomsday;

use lastcall_agent::sources::{Kind, Registered};
use lastcall_testkit::agent::{InProcessAgent, config, metric};
use lastcall_testkit::cluster::GameServerState as S;
use lastcall_testkit::eventually::wait_for;
use lastcall_testkit::world::{World, WorldSpec, cordoned, has_taint};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_added_as_one_file_and_one_line_drains_and_cancels() {
    let w = World::start(WorldSpec::new(2, 1, 0).extra_nodes(&["n2"])).await;
    let kube = w
        .cluster
        .emulator()
        .config_for("agent-n1")
        .await
        .expect("client");
    // The registry line.
    let line = Registered {
        source: doomsday::SOURCE,
        kind: Kind::Task(doomsday::start),
    };
    let agent = InProcessAgent::start_with_sources(config("n1", &[]), kube, None, vec![line])
        .await
        .expect("agent");
    w.claimed_all().await;
    let allocated = w.allocated();
    assert!(!cordoned(&w.node().await), "nothing said yet");

    doomsday::say(Some("the test says so"));
    wait_for("fenced, Ready released, the match protected", || async {
        let n = w.node().await;
        let here = w.on("n1");
        let protected = here.len() == 1
            && here[0].uid == allocated.uid
            && here[0]
                .annotations
                .get("lastcall.dev/drain-reason")
                .map(String::as_str)
                == Some("maintenance");
        (cordoned(&n) && has_taint(&n, "lastcall.dev/draining") && protected).then_some(())
    })
    .await;
    let n = w.node().await;
    let taint_value = n
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .and_then(|t| t.iter().find(|t| t.key == "lastcall.dev/draining"))
        .and_then(|t| t.value.clone());
    assert_eq!(
        taint_value.as_deref(),
        Some("doomsday"),
        "the taint names the source"
    );
    let m = agent.metrics().await;
    assert_eq!(
        metric(
            &m,
            "lastcall_source_notices",
            &[
                ("source", "doomsday"),
                ("cause", "maintenance"),
                ("severity", "drain")
            ]
        ),
        Some(1.0),
        "the new source's signal is counted under its own name"
    );

    doomsday::say(None);
    wait_for("drain cancelled, node restored", || async {
        let n = w.node().await;
        let here = w.on("n1");
        let unprotected = here.iter().all(|g| {
            g.state != Some(S::Allocated)
                || !g.annotations.contains_key("lastcall.dev/drain-reason")
        });
        (!cordoned(&n) && !has_taint(&n, "lastcall.dev/draining") && unprotected).then_some(())
    })
    .await;
    assert_eq!(
        w.on("n1").iter().filter(|g| g.uid == allocated.uid).count(),
        1
    );
    // The fence and the cancel, each once. (The record of a source outside the built-in
    // registry once read back as unreadable, so every pass wrote the Node again.)
    let node_writes = w.cluster.emulator().journal().count(|r| {
        r.identity.as_deref() == Some("agent-n1")
            && r.verb.is_mutating()
            && r.resource.as_deref() == Some("nodes")
    });
    assert!((2..=4).contains(&node_writes), "{node_writes} Node writes");
    agent.stop().await.expect("clean stop");
}
