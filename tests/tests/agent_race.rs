//! Allocation racing the drain: an allocator keeps allocating the node's Ready servers while
//! the agent fences and releases them, and the API fails some DELETEs with 429 or 503. Over
//! many randomized interleavings, ordered by the emulator's journal:
//!
//! - no server is deleted by the agent after it was allocated, and every server allocated
//!   after the fence is protected by the agent (the DELETE's preconditions alone save the
//!   match when the allocator ignores the drain);
//! - for an allocator that excludes `lastcall.dev/node-draining=true` (as the docs ask), no
//!   allocation succeeds on a server once the agent's first accepted write to it (its
//!   DELETE, or the label that follows a failed one) has landed, nor anywhere on the node
//!   once the agent's first round of releases past the fence is answered (but on a server
//!   whose DELETE failed, until its label lands).
//!
//! Half the interleavings use the selector, half do not. The run as a whole must contain the
//! race: allocations after the fence and releases that lost to an allocation (409).
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
use lastcall_testkit::kube::journal::{JournalEntry, Verb};
use lastcall_testkit::promises::allocation::{
    allocations, deleted_after_allocation, late_allocations,
};
use lastcall_testkit::promises::describe;
use lastcall_testkit::promises::fence::{assert_no_release_before_fence, first_fence};
use lastcall_testkit::world::{WindowRun, allocation_window, race_node};
use rand::{Rng, SeedableRng, rngs::StdRng};

const NS: &str = "default";
const INTERLEAVINGS: u64 = 500;
/// The selector the docs ask allocators to use.
const EXCLUDE_DRAINING: &str = "lastcall.dev/node-draining!=true";
const AT_ONCE: usize = 4;
const AGENT: &str = "agent-n1";
const ALLOCATOR: &str = "agones-allocator";

#[derive(Debug)]
struct Outcome {
    selector: bool,
    allocated_during_drain: usize,
    released: usize,
    conflicts: usize,
    /// Allocations that succeeded after the fence took effect.
    after_fence: usize,
    injected_delete_failures: usize,
}

/// Half the interleavings run the allocator with the exclusion selector, half without.
fn uses_selector(seed: u64) -> bool {
    seed.is_multiple_of(2)
}

async fn interleaving(seed: u64) -> Outcome {
    let selector = uses_selector(seed);
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
        let mut req = AllocationRequest::fleet(NS, "fleet")
            .on_node("n1")
            .max_tries(3);
        if selector {
            req = req.selector(EXCLUDE_DRAINING);
        }
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
    // By the journal (`lastcall_testkit::promises`): no release before the fence, no
    // server deleted after its allocation (only the DELETE's preconditions stand between
    // the two without the selector), every server allocated after the fence protected by
    // a write of the agent after its allocation, and with the selector no allocation that
    // came too late (per server, and per node once the first round of releases past the
    // fence was answered).
    let journal = cluster.emulator().journal();
    let entries = journal.entries();
    assert_no_release_before_fence(&entries, AGENT, "n1");
    let by_agent = |r: &JournalEntry| r.identity.as_deref() == Some(AGENT);
    let deleted: BTreeSet<String> = entries
        .iter()
        .filter(|r| {
            r.verb == Verb::Delete && r.resource.as_deref() == Some("gameservers") && r.status < 300
        })
        .filter_map(|r| r.name.clone())
        .collect();
    assert!(
        deleted.is_disjoint(&won),
        "seed {seed}: deleted {:?} allocated {won:?}",
        deleted
    );
    let killed = deleted_after_allocation(&entries, by_agent, ALLOCATOR);
    assert!(
        killed.is_empty(),
        "seed {seed} (selector {selector}): the agent deleted servers after their allocation (allocation, DELETE): {:?}",
        killed
            .iter()
            .map(|(a, d)| (a.name.clone(), a.seq, d.seq))
            .collect::<Vec<_>>()
    );
    let conflicts = journal.count(|r| {
        r.verb == Verb::Delete && r.resource.as_deref() == Some("gameservers") && r.status == 409
    });
    let fence = first_fence(&entries, AGENT, "n1")
        .unwrap_or_else(|| panic!("seed {seed}: no fence"))
        .seq;
    let after_fence_allocations: Vec<&JournalEntry> = allocations(&entries, ALLOCATOR)
        .into_iter()
        .filter(|a| a.seq > fence)
        .collect();
    for a in &after_fence_allocations {
        let protected_after = entries.iter().any(|r| {
            by_agent(r)
                && r.resource.as_deref() == Some("gameservers")
                && r.verb == Verb::Patch
                && r.status < 300
                && r.name == a.name
                && r.seq > a.seq
        });
        assert!(
            protected_after,
            "seed {seed} (selector {selector}): {:?} allocated during the drain (seq {}) was never written by the agent afterwards",
            a.name, a.seq
        );
    }
    if selector {
        let late = late_allocations(&entries, AGENT, ALLOCATOR, "n1", |_| true);
        assert!(
            late.is_empty(),
            "seed {seed}: allocations that came too late (fence #{fence}): {late:#?}\n{}",
            describe(
                &entries
                    .iter()
                    .filter(|r| r.seq >= fence && r.resource.as_deref() == Some("gameservers"))
                    .filter(|r| r.seq <= late.iter().map(|l| l.seq).max().unwrap_or(fence))
                    .collect::<Vec<_>>()
            )
        );
    }
    let injected = journal.count(|r| {
        r.verb == Verb::Delete
            && r.resource.as_deref() == Some("gameservers")
            && (r.status == 429 || r.status == 503)
    });
    agent.stop().await.unwrap();
    cluster.shutdown().await;
    Outcome {
        selector,
        allocated_during_drain: won.len(),
        released: deleted.len(),
        conflicts,
        after_fence: after_fence_allocations.len(),
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
    let after = |selector: bool| -> usize {
        outcomes
            .iter()
            .filter(|o| o.selector == selector)
            .map(|o| o.after_fence)
            .sum()
    };
    let faulted = outcomes
        .iter()
        .filter(|o| o.injected_delete_failures > 0)
        .count();
    eprintln!(
        "{INTERLEAVINGS} interleavings: {both} with both allocations and releases, {conflicts} release conflicts (allocation won), {faulted} with failing DELETEs; allocations after the fence: {} with the selector, {} without",
        after(true),
        after(false)
    );
    assert!(faulted > INTERLEAVINGS as usize / 4, "too few faulted runs");
    assert!(
        both > INTERLEAVINGS as usize / 10,
        "too few real races: {outcomes:?}"
    );
    // The race happened: releases lost to allocations, and allocations landed during the
    // drain, in both modes.
    assert!(conflicts > 0, "no release ever lost to an allocation");
    assert!(
        after(true) > 0 && after(false) > 0,
        "no allocation after the fence (with the selector: {}, without: {})",
        after(true),
        after(false)
    );
}

/// The allocation-window bench's claim that no match is lost, checked on a reduced set of
/// its interleavings in every mode (DELETEs succeeding or failing, with and without the
/// selector): no server deleted after its allocation, every one protected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_allocation_window_never_loses_a_match() {
    const RUNS_PER_MODE: u64 = 6;
    for (failing, selector) in [(false, false), (false, true), (true, false), (true, true)] {
        let runs: Vec<anyhow::Result<WindowRun>> = futures::stream::iter(0..RUNS_PER_MODE)
            .map(|seed| allocation_window(seed, 8, selector, failing))
            .buffer_unordered(AT_ONCE)
            .collect()
            .await;
        let mut won = 0;
        for r in runs {
            let r = r.unwrap_or_else(|e| {
                panic!("failing DELETEs {failing}, selector {selector}: {e:#}")
            });
            won += r.won.len();
        }
        assert!(
            won > 0,
            "failing DELETEs {failing}, selector {selector}: nothing was allocated"
        );
    }
}
