//! Allocation racing the drain: an allocator keeps allocating the node's Ready servers while
//! the agent fences and releases them, and the API fails some DELETEs with 429 or 503. Over
//! many randomized interleavings, no Allocated server is ever deleted, every server allocated
//! during the fence ends up protected, and, for an allocator that excludes
//! `lastcall.dev/node-draining=true` (as the docs ask), no allocation on a server succeeds
//! once the agent's first accepted write to it (its DELETE, or the label that follows a failed
//! DELETE) has landed: ordered by the emulator's journal.
//!
//! Each interleaving is a fresh cluster, agent and allocator; a seeded RNG varies the number
//! of servers, the allocator's start offset relative to the drain signal, its pacing and the
//! injected DELETE failures.

use std::collections::BTreeSet;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};
use lastcall_testkit::cluster::{AllocationRequest, GameServerState as S};
use lastcall_testkit::eventually::eventually;
use lastcall_testkit::kube::faults::{FaultRule, Method};
use lastcall_testkit::kube::journal::Verb;
use lastcall_testkit::world::race_node;
use rand::{Rng, SeedableRng, rngs::StdRng};

const NS: &str = "default";
const INTERLEAVINGS: u64 = 500;
/// The selector the docs ask allocators to use.
const EXCLUDE_DRAINING: &str = "lastcall.dev/node-draining!=true";
const AT_ONCE: usize = 4;

#[derive(Debug)]
struct Outcome {
    seed: u64,
    allocated_during_drain: usize,
    released: usize,
    conflicts: usize,
    /// Allocations that succeeded after the fence took effect.
    after_fence: usize,
    /// The most agent requests (Events aside) completed between the fence and one of those.
    max_agent_requests_before_allocation: usize,
    injected_delete_failures: usize,
}

async fn interleaving(seed: u64) -> Outcome {
    let mut rng = StdRng::seed_from_u64(seed);
    let servers: usize = rng.random_range(3..=8);
    let start_offset_ms: i64 = rng.random_range(-5..=15);
    let pace_us: u64 = rng.random_range(0..=3000);
    let delete_failures: usize = if rng.random_bool(0.5) {
        rng.random_range(1..=6)
    } else {
        0
    };
    let failure_status: u16 = if rng.random_bool(0.5) { 429 } else { 503 };

    let (cluster, agent) = race_node(seed, servers, 0, true, &["--resync-interval", "1s"]).await;
    if delete_failures > 0 {
        cluster.emulator().faults().inject(FaultRule::status(
            Some(Method::DELETE),
            "/gameservers/",
            delete_failures,
            failure_status,
        ));
    }

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
            .selector(EXCLUDE_DRAINING)
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
    // The promise itself, in journal order: once the fence took effect, an allocation can
    // only succeed on a server before the agent's first accepted write to it (a DELETE, which
    // allocators skip, or the label that follows a failed DELETE). A failed DELETE costs one
    // more round trip: the price of one write per released server instead of two.
    let entries = journal.entries();
    let by_agent = |r: &lastcall_testkit::kube::journal::JournalEntry| {
        r.identity.as_deref() == Some("agent-n1") && r.resource.as_deref() != Some("events")
    };
    let fence = entries
        .iter()
        .find(|r| {
            by_agent(r)
                && r.verb == Verb::Patch
                && r.resource.as_deref() == Some("nodes")
                && r.status < 300
        })
        .unwrap_or_else(|| panic!("seed {seed}: no fence"))
        .seq;
    let mut after_fence = 0;
    let mut max_before = 0;
    for a in entries.iter().filter(|r| {
        r.seq > fence
            && r.identity.as_deref() == Some("agones-allocator")
            && r.verb == Verb::Update
            && r.status < 300
    }) {
        after_fence += 1;
        let writes_to = |r: &&lastcall_testkit::kube::journal::JournalEntry| {
            by_agent(r)
                && r.name == a.name
                && matches!(r.verb, Verb::Patch | Verb::Delete)
                && r.status < 300
                && r.resource.as_deref() == Some("gameservers")
        };
        // A server that came up around the fence (a replacement scheduled just before the
        // cordon) is claimed after it: that ownership label is not a fencing write.
        let claimed_before = entries.iter().filter(writes_to).any(|r| r.seq < fence);
        let touched_first = entries
            .iter()
            .filter(writes_to)
            .filter(|r| r.seq > fence && r.seq < a.seq)
            .nth(usize::from(!claimed_before))
            .is_some();
        assert!(
            !touched_first,
            "seed {seed}: {:?} was still allocatable after the agent's first accepted write to it: {:#?}",
            a.name,
            entries
                .iter()
                .filter(|r| r.name == a.name && r.seq > fence)
                .map(|r| (r.seq, r.identity.clone(), r.verb.as_str(), r.status))
                .collect::<Vec<_>>()
        );
        let between = entries
            .iter()
            .filter(|r| by_agent(r) && r.seq > fence && r.seq < a.seq)
            .count();
        max_before = max_before.max(between);
    }
    let injected = journal.count(|r| {
        r.verb == Verb::Delete
            && r.resource.as_deref() == Some("gameservers")
            && (r.status == 429 || r.status == 503)
    });
    agent.stop().await.unwrap();
    cluster.shutdown().await;
    Outcome {
        seed,
        allocated_during_drain: won.len(),
        released: deleted.len(),
        conflicts,
        after_fence,
        max_agent_requests_before_allocation: max_before,
        injected_delete_failures: injected,
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
    let after: usize = outcomes.iter().map(|o| o.after_fence).sum();
    let max_before = outcomes
        .iter()
        .map(|o| o.max_agent_requests_before_allocation)
        .max()
        .unwrap_or(0);
    let faulted = outcomes
        .iter()
        .filter(|o| o.injected_delete_failures > 0)
        .count();
    eprintln!(
        "{INTERLEAVINGS} interleavings: {both} with both allocations and releases, {conflicts} release conflicts (allocation won), {faulted} with failing DELETEs; {after} allocations succeeded after the fence, with at most {max_before} agent requests completed between the fence and one of them"
    );
    assert!(faulted > INTERLEAVINGS as usize / 4, "too few faulted runs");
    assert!(
        both > INTERLEAVINGS as usize / 10,
        "too few real races: {outcomes:?}"
    );
    let _ = outcomes.iter().map(|o| o.seed).max();
}
