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

/// One drain and its cancel, by the journal.
struct Cycle {
    /// The agent's requests (watches excluded), by kind.
    by_kind: BTreeMap<String, usize>,
    total: usize,
    /// PATCHes that put the ownership label on a server that landed on the node during
    /// the window (replacements coming back once the node is uncordoned).
    claims: usize,
    /// What a hand-written client would send for the same outcome (see [`bare_client`]).
    bare: usize,
}

/// The fewest requests for the outcome of a drain and its cancel, written by hand: one
/// guarded Node patch to fence (cordon, taint, record), one preconditioned DELETE per
/// Ready server, one merge patch per in-use server (label and both annotations at once);
/// then for the cancel one Node patch (uncordon, untaint, records removed) and one merge
/// patch per protected server. No Events, no reads, no claims: it is given the server
/// list and their states.
fn bare_client(ready: usize, in_use: usize) -> usize {
    1 + ready + in_use + 1 + in_use
}

/// Drains n1 (16 Ready, 4 Allocated) by FleetIQ `DRAINING`, waits until the Ready servers
/// are released and the matches protected, cancels with `ACTIVE`, waits until every mark
/// is gone (and, with no spare node, until the replacements that come back are claimed),
/// then lets resync passes run.
/// `by_field`: Agones 1.58 or later, whose GameServers the agent selects by
/// `status.nodeName` (it writes no claims); otherwise an older Agones and the label.
async fn drain_and_cancel(spare_node: bool, by_field: bool) -> Cycle {
    let extra: &[&str] = if spare_node { &["n2"] } else { &[] };
    let mut spec = WorldSpec::new(16, 4, 0).extra_nodes(extra);
    if by_field {
        spec = spec.selectable_fields();
    }
    let w = World::start(spec).await;
    let agent = w.agent(&[]).await;
    subscribed(&agent).await;
    agent
        .selects_gameservers_by(if by_field { "field" } else { "label" })
        .await;
    if !by_field {
        w.claimed_all().await;
    }
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let journal = w.cluster.emulator().journal();
    let start = journal.entries().last().map(|e| e.seq).unwrap_or(0);
    let here = w.on("n1");
    let ready = here.iter().filter(|g| g.state == Some(S::Ready)).count();
    let in_use = here.len() - ready;
    let before: std::collections::BTreeSet<String> = here.iter().map(|g| g.name.clone()).collect();

    w.status(Status::Draining).await;
    wait_for("Ready released, in-use servers protected", || async {
        let here = w.on("n1");
        let protected = here
            .iter()
            .filter(|g| g.annotations.contains_key("lastcall.dev/drain-deadline"))
            .count();
        (here.len() == in_use && protected == in_use).then_some(())
    })
    .await;
    w.status(Status::Active).await;
    wait_for("cancelled: uncordoned, untainted, unmarked", || async {
        let n = w.node().await;
        let unmarked = w.on("n1").iter().all(|g| {
            !g.annotations.contains_key("lastcall.dev/drain-deadline")
                && !g.labels.contains_key("lastcall.dev/node-draining")
        });
        (!lastcall_testkit::world::cordoned(&n)
            && !lastcall_testkit::world::has_taint(&n, "lastcall.dev/draining")
            && unmarked)
            .then_some(())
    })
    .await;
    if !spare_node {
        wait_for("the replacements back on n1", || async {
            (w.on("n1").len() == ready + in_use).then_some(())
        })
        .await;
        if !by_field {
            w.claimed_all().await;
        }
    }
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;

    let cycle: Vec<JournalEntry> = journal.filter(|e| {
        e.seq > start && e.identity.as_deref() == Some("agent-n1") && e.verb != Verb::Watch
    });
    let mut by_kind: BTreeMap<String, usize> = BTreeMap::new();
    for e in &cycle {
        *by_kind.entry(describe(e)).or_default() += 1;
    }
    let claims = cycle
        .iter()
        .filter(|e| {
            e.verb == Verb::Patch
                && e.resource.as_deref() == Some("gameservers")
                && e.name.as_ref().is_some_and(|n| !before.contains(n))
        })
        .count();
    drop(agent);
    Cycle {
        by_kind,
        total: cycle.len(),
        claims,
        bare: bare_client(ready, in_use),
    }
}

/// How much more than the hand-written client a drain and its cancel may cost.
const BOUND: f64 = 1.5;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_and_its_cancel_cost_at_most_1_5x_a_hand_written_client() {
    let c = drain_and_cancel(true, false).await;
    let ratio = c.total as f64 / c.bare as f64;
    eprintln!(
        "drain + cancel, 16 Ready + 4 Allocated, replacements elsewhere: {} requests, bare client {}, ratio {ratio:.2} {:#?}",
        c.total, c.bare, c.by_kind
    );
    assert_eq!(c.claims, 0, "nothing landed on n1: {:#?}", c.by_kind);
    assert!(
        ratio <= BOUND,
        "{} requests for a drain and its cancel, {ratio:.2}× the bare client's {} (bound {BOUND}×): {:#?}",
        c.total,
        c.bare,
        c.by_kind
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replacements_that_come_back_after_a_cancel_cost_one_claim_each() {
    let c = drain_and_cancel(false, false).await;
    let without_claims = c.total - c.claims;
    let ratio = without_claims as f64 / c.bare as f64;
    eprintln!(
        "drain + cancel, 16 Ready + 4 Allocated, replacements back on the node: {} requests ({} claims of servers that landed), bare client {}, ratio without the claims {ratio:.2} {:#?}",
        c.total, c.claims, c.bare, c.by_kind
    );
    // One ownership label per server that landed on the node, never more.
    assert_eq!(c.claims, 16, "{:#?}", c.by_kind);
    assert!(
        ratio <= BOUND,
        "{without_claims} requests besides the claims, {ratio:.2}× the bare client's {} (bound {BOUND}×): {:#?}",
        c.bare,
        c.by_kind
    );
}

/// Agones 1.58 or later: the agent selects its GameServers by `status.nodeName`, so the
/// replacements that come back after the cancel cost it nothing, and the whole cycle stays
/// within the bound with nothing left out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn selected_by_node_name_a_drain_and_cancel_with_replacements_back_is_within_1_5x() {
    let c = drain_and_cancel(false, true).await;
    let ratio = c.total as f64 / c.bare as f64;
    eprintln!(
        "drain + cancel by status.nodeName, 16 Ready + 4 Allocated, replacements back on the node: {} requests, bare client {}, ratio {ratio:.2} {:#?}",
        c.total, c.bare, c.by_kind
    );
    assert_eq!(c.claims, 0, "no claim writes: {:#?}", c.by_kind);
    let gs_patches: usize = c
        .by_kind
        .iter()
        .filter(|(k, _)| k.starts_with("patch gameservers"))
        .map(|(_, n)| n)
        .sum();
    assert_eq!(
        gs_patches, 8,
        "a protect and an unprotect per match: {:#?}",
        c.by_kind
    );
    assert!(
        ratio <= BOUND,
        "{} requests, {ratio:.2}× the bare client's {} (bound {BOUND}×): {:#?}",
        c.total,
        c.bare,
        c.by_kind
    );
}
