//! Allocation racing the drain: an allocator keeps allocating the node's Ready servers while
//! the agent fences and releases them. Over many randomized interleavings, no Allocated
//! server is ever deleted, and every server allocated during the fence ends up protected.
//!
//! Each interleaving is a fresh cluster, agent and allocator; a seeded RNG varies the number
//! of servers, the allocator's start offset relative to the drain signal, and its pacing.

use std::collections::BTreeSet;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};
use lastcall_testkit::agent::{InProcessAgent, config};
use lastcall_testkit::cluster::{
    AllocationRequest, Cluster, ClusterConfig, FleetSpec, GameServerState as S, NodeSpec,
};
use lastcall_testkit::eventually::eventually;
use lastcall_testkit::kube::journal::Verb;
use rand::{Rng, SeedableRng, rngs::StdRng};

const NS: &str = "default";
const INTERLEAVINGS: u64 = 200;
const AT_ONCE: usize = 4;

#[derive(Debug)]
struct Outcome {
    seed: u64,
    allocated_during_drain: usize,
    released: usize,
    conflicts: usize,
}

async fn interleaving(seed: u64) -> Outcome {
    let mut rng = StdRng::seed_from_u64(seed);
    let servers: usize = rng.random_range(3..=8);
    let start_offset_ms: i64 = rng.random_range(-5..=15);
    let pace_us: u64 = rng.random_range(0..=3000);

    let cluster = Cluster::start(ClusterConfig {
        tick: Duration::from_millis(20),
        ..ClusterConfig::default()
    })
    .await
    .unwrap();
    cluster.add_node(NodeSpec::new("n1")).unwrap();
    cluster
        .create_fleet(FleetSpec::new("fleet", servers as i64).grace_seconds(0))
        .unwrap();
    cluster.wait_ready(NS, "fleet", servers).await.unwrap();
    cluster.add_node(NodeSpec::new("n2")).unwrap();

    let kube = cluster.emulator().config_for("agent-n1").await.unwrap();
    let agent = InProcessAgent::start(config("n1", &["--resync-interval", "1s"]), kube, None)
        .await
        .unwrap();
    eventually(
        &format!("seed {seed}: agent claims its servers"),
        Duration::from_secs(20),
        Duration::from_millis(5),
        || async {
            let gs = cluster.game_servers();
            let on_n1: Vec<_> = gs
                .iter()
                .filter(|g| g.node.as_deref() == Some("n1"))
                .collect();
            (on_n1.len() == servers
                && on_n1
                    .iter()
                    .all(|g| g.labels.contains_key("lastcall.dev/node")))
            .then_some(())
        },
    )
    .await;

    // The allocator targets n1's Ready servers for the whole drain.
    let alloc_client = cluster
        .client_without_retry("agones-allocator")
        .await
        .unwrap();
    let allocator = async {
        if start_offset_ms > 0 {
            tokio::time::sleep(Duration::from_millis(start_offset_ms as u64)).await;
        }
        let mut won = BTreeSet::new();
        let req = AllocationRequest::fleet(NS, "fleet")
            .on_node("n1")
            .max_tries(3);
        for _ in 0..(servers * 3) {
            match lastcall_testkit::cluster::allocator::allocate(&alloc_client, &req).await {
                Ok(Some(gs)) => {
                    won.insert(gs.name);
                }
                Ok(None) => {}
                Err(e) => panic!("seed {seed}: allocator error {e}"),
            }
            if pace_us > 0 {
                tokio::time::sleep(Duration::from_micros(pace_us)).await;
            }
        }
        won
    };
    let drain = async {
        if start_offset_ms < 0 {
            tokio::time::sleep(Duration::from_millis((-start_offset_ms) as u64)).await;
        }
        let nodes: Api<Node> = Api::all(cluster.client());
        nodes
            .patch(
                "n1",
                &PatchParams::default(),
                &Patch::Merge(
                    &serde_json::json!({"metadata": {"labels": {"lastcall.dev/drain": "true"}}}),
                ),
            )
            .await
            .unwrap();
    };
    let (won, ()) = tokio::join!(allocator, drain);

    // Settle: every server on n1 is either released or an allocated, protected one.
    eventually(
        &format!("seed {seed}: drain settles"),
        Duration::from_secs(20),
        Duration::from_millis(10),
        || async {
            let settled = cluster
                .game_servers()
                .iter()
                .filter(|g| g.node.as_deref() == Some("n1"))
                .all(|g| {
                    g.deleting
                        || (g.state == Some(S::Allocated)
                            && g.annotations.contains_key("lastcall.dev/drain-deadline")
                            && g.labels
                                .get("lastcall.dev/node-draining")
                                .map(String::as_str)
                                == Some("true"))
                });
            settled.then_some(())
        },
    )
    .await;

    let after = cluster.game_servers();
    for name in &won {
        let gs = after
            .iter()
            .find(|g| &g.name == name)
            .unwrap_or_else(|| panic!("seed {seed}: allocated {name} was deleted"));
        assert!(
            !gs.deleting,
            "seed {seed}: allocated {name} is being deleted"
        );
        assert_eq!(gs.state, Some(S::Allocated), "seed {seed}: {name}");
        assert!(
            gs.annotations.contains_key("lastcall.dev/drain-deadline"),
            "seed {seed}: {name} not protected"
        );
    }
    // Every successful GameServer DELETE hit a server that was never allocated.
    let journal = cluster.emulator().journal();
    let deleted: BTreeSet<String> = journal
        .filter(|r| {
            r.verb == Verb::Delete && r.resource.as_deref() == Some("gameservers") && r.status < 300
        })
        .into_iter()
        .filter_map(|r| r.name)
        .collect();
    assert!(
        deleted.is_disjoint(&won),
        "seed {seed}: deleted {:?} allocated {won:?}",
        deleted
    );
    let conflicts = journal.count(|r| {
        r.verb == Verb::Delete && r.resource.as_deref() == Some("gameservers") && r.status == 409
    });
    agent.stop().await.unwrap();
    cluster.shutdown().await;
    Outcome {
        seed,
        allocated_during_drain: won.len(),
        released: deleted.len(),
        conflicts,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocation_racing_the_drain_never_loses_a_match() {
    let outcomes: Vec<Outcome> = futures::stream::iter(0..INTERLEAVINGS)
        .map(interleaving)
        .buffer_unordered(AT_ONCE)
        .collect()
        .await;
    assert_eq!(outcomes.len() as u64, INTERLEAVINGS);
    // The interleavings really interleave: both sides won sometimes, and some deletes lost
    // to an allocation (409) — otherwise this test would not be exercising the race.
    let both = outcomes
        .iter()
        .filter(|o| o.allocated_during_drain > 0 && o.released > 0)
        .count();
    let conflicts: usize = outcomes.iter().map(|o| o.conflicts).sum();
    eprintln!(
        "{INTERLEAVINGS} interleavings: {both} with both allocations and releases, {conflicts} release conflicts (allocation won)"
    );
    assert!(
        both > INTERLEAVINGS as usize / 10,
        "too few real races: {outcomes:?}"
    );
    let _ = outcomes.iter().map(|o| o.seed).max();
}
