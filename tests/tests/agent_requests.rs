//! What one drain costs the API server: the agent's requests, by verb, from the emulator's
//! journal, on a node with 4 Ready, 2 Allocated and 1 Reserved game servers.
//!
//! The original adapter needs 9 requests there, but one of them LISTs every GameServer in
//! the cluster. lastcall's budget is 12, none of which grows with the cluster.

use std::collections::BTreeMap;

use lastcall_common::fleetiq::InstanceStatus as Status;
use lastcall_testkit::cluster::GameServerState as S;
use lastcall_testkit::eventually::wait_for;
use lastcall_testkit::kube::journal::{JournalEntry, Verb};
use lastcall_testkit::world::{NS, World, WorldSpec, subscribed};

/// The budget for this node: at most 12 requests per drain.
const BUDGET: usize = 12;

fn describe(e: &JournalEntry) -> String {
    format!(
        "{} {}{} -> {}",
        e.verb.as_str(),
        e.resource.as_deref().unwrap_or("?"),
        e.subresource
            .as_deref()
            .map(|s| format!("/{s}"))
            .unwrap_or_default(),
        e.status
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_of_4_ready_2_allocated_1_reserved_costs_at_most_12_requests() {
    let w = World::start(WorldSpec::new(4, 2, 1).extra_nodes(&["n2"])).await;
    let agent = w.agent(&[]).await;
    subscribed(&agent).await;
    w.claimed_all().await;
    // Let the claim writes settle so the window holds only the drain.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let journal = w.cluster.emulator().journal();
    let start = journal.entries().last().map(|e| e.seq).unwrap_or(0);
    let bytes_before = journal.traffic_for("agent-n1").bytes;

    w.status(Status::Draining).await;
    wait_for("Ready released, in-use servers protected", || async {
        let here = w.on("n1");
        let protected = here.iter().filter(|g| {
            matches!(g.state, Some(S::Allocated | S::Reserved))
                && g.annotations.contains_key("lastcall.dev/drain-deadline")
        });
        (here.len() == 3 && protected.count() == 3).then_some(())
    })
    .await;
    for g in w.on("n1") {
        w.cluster.sdk_shutdown(NS, &g.name).expect("end the match");
    }
    wait_for("deregistered and recorded", || async {
        let n = w.node().await;
        (w.gl.count("DeregisterGameServer") == 1
            && n.metadata
                .annotations
                .unwrap_or_default()
                .contains_key("lastcall.dev/deregistered"))
        .then_some(())
    })
    .await;
    // A few more resync passes: the drain is over, so they must cost nothing.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;

    let drain: Vec<JournalEntry> = journal.filter(|e| {
        e.seq > start && e.identity.as_deref() == Some("agent-n1") && e.verb != Verb::Watch
    });
    let mut by_kind: BTreeMap<String, usize> = BTreeMap::new();
    for e in &drain {
        *by_kind.entry(describe(e)).or_default() += 1;
    }
    let bytes = journal.traffic_for("agent-n1").bytes - bytes_before;
    eprintln!(
        "requests per drain: {}, response bytes {bytes} (watch events included) {by_kind:#?}",
        drain.len()
    );
    assert!(
        drain.len() <= BUDGET,
        "{} requests, budget {BUDGET}: {by_kind:#?}",
        drain.len()
    );
    assert!(
        !drain
            .iter()
            .any(|e| e.resource.as_deref() == Some("gameservers")
                && e.verb == Verb::List
                && !e.query.contains("labelSelector")),
        "no cluster-wide GameServer LIST"
    );
}
