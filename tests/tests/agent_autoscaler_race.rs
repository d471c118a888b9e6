//! Autoscaler cooperation, raced: the modelled Cluster Autoscaler or Karpenter tries to take
//! a node holding Ready game servers, while an allocator loop keeps allocating that node's
//! Ready servers and the agent runs with `--autoscaler-cooperation in-use`.
//!
//! Under Agones' default `eviction.safe: Never` (with its 0% PDB), Karpenter runs as node
//! expiry (`Method::Expiration`): its consolidation refuses any game-server node at its pick
//! (docs/autoscalers.md §3), idle or not; expiry takes the node whatever the PDB says, and
//! is where cooperation decides whether a match dies. The Cluster Autoscaler never picks a
//! node holding a game server: lastcall never marks a pod evictable, and Agones' own value is
//! `"false"`.
//!
//! Under `OnUpgrade` (no PDB at all) and `Always` (Agones marks Ready pods evictable itself),
//! the Cluster Autoscaler races allocations with the agent running, and with the agent gone
//! (stopped after it settled, before the allocations): nothing lastcall wrote may leave an
//! allocated pod evictable.
//!
//! Ordered by the emulator's journal:
//! - no pod of an Allocated server is ever evicted or deleted by the autoscaler (matches
//!   killed: 0);
//! - a node where no allocation won is taken when the autoscaler may take it;
//! - a node where an allocation won stays, and its match is still running when the
//!   autoscaler has given up or is left waiting.

use std::collections::BTreeSet;
use std::time::Duration;

use futures::StreamExt;
use lastcall_testkit::cluster::EvictionSafe;
use lastcall_testkit::cluster::autoscaler::cluster_autoscaler as ca;
use lastcall_testkit::cluster::autoscaler::karpenter::{self, Method};
use lastcall_testkit::cluster::autoscaler::{CLUSTER_AUTOSCALER_IDENTITY, KARPENTER_IDENTITY};
use lastcall_testkit::cluster::{ALLOCATOR_IDENTITY, AllocationRequest, GameServerState as S};
use lastcall_testkit::eventually::eventually;
use lastcall_testkit::kube::Verb;
use lastcall_testkit::world::race_node_with;
use rand::{Rng, SeedableRng, rngs::StdRng};

const NS: &str = "default";
const PER_AUTOSCALER: u64 = 100;
const AT_ONCE: usize = 4;
const STE: &str = "cluster-autoscaler.kubernetes.io/safe-to-evict";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Who {
    ClusterAutoscaler,
    Karpenter,
}

#[derive(Debug)]
struct Outcome {
    who: Who,
    safe: EvictionSafe,
    allocated: usize,
    node_taken: bool,
}

/// One interleaving's setting.
#[derive(Clone, Copy, Debug)]
struct Setting {
    who: Who,
    safe: EvictionSafe,
    /// The agent stops (a crash, an outage) once it has settled, before any allocation.
    gone: bool,
}

fn fast_ca() -> ca::Config {
    ca::Config {
        delete_delay_after_taint: Duration::from_millis(150),
        taint_conflict_deadline: Duration::from_secs(2),
        taint_conflict_retry: Duration::from_millis(50),
        eviction_retry: Duration::from_millis(50),
        max_pod_eviction_time: Duration::from_millis(600),
        pod_wait_poll: Duration::from_millis(50),
        pod_eviction_headroom: Duration::from_secs(2),
        ..ca::Config::default()
    }
}

fn fast_karpenter() -> karpenter::Config {
    karpenter::Config {
        validation: Duration::from_millis(150),
        replacement_ready: Duration::from_millis(50),
        drain_interval: Duration::from_millis(50),
        eviction_backoff_min: Duration::from_millis(20),
        eviction_backoff_max: Duration::from_millis(200),
        give_up_after: Duration::from_millis(1500),
        ..karpenter::Config::default()
    }
}

async fn interleaving(setting: Setting, seed: u64) -> Outcome {
    let Setting { who, safe, gone } = setting;
    let mut rng = StdRng::seed_from_u64(seed);
    let servers: usize = rng.random_range(2..=5);
    // Some runs have no allocator at all, so the node can be taken.
    // With the agent gone, every run allocates, before the autoscaler looks.
    let allocating = gone || rng.random_bool(0.6);
    // Negative: the allocator starts first (an allocation that wins before the autoscaler
    // looks); positive: it starts after (racing the taint and the agent's releases).
    let start_ms: i64 = if gone {
        -40
    } else {
        rng.random_range(-15..=25)
    };
    let pace_ms: u64 = rng.random_range(1..=15);
    let (cluster, agent) = race_node_with(
        seed,
        servers,
        0,
        true,
        safe,
        &[
            "--autoscaler-cooperation",
            "in-use",
            "--resync-interval",
            "1s",
        ],
    )
    .await;
    eventually(
        &format!("seed {seed}: every pod is up"),
        Duration::from_secs(20),
        Duration::from_millis(5),
        || async {
            let pods = cluster.pods_on("n1");
            (pods.len() == servers
                && pods.iter().all(|p| {
                    p.pointer(&format!("/metadata/annotations/{}", STE.replace('/', "~1")))
                        .is_some()
                }))
            .then_some(())
        },
    )
    .await;
    let agent = if gone {
        // Whatever it would write for idle pods has been written by now.
        tokio::time::sleep(Duration::from_millis(300)).await;
        agent.stop().await.expect("stop");
        None
    } else {
        Some(agent)
    };

    let alloc_client = cluster
        .client_without_retry(ALLOCATOR_IDENTITY)
        .await
        .expect("allocator client");
    // With the agent gone, one allocation lands before the autoscaler looks: the case an
    // absent agent must not leave evictable.
    let mut first = BTreeSet::new();
    if gone {
        let req = AllocationRequest::fleet(NS, "fleet").on_node("n1");
        let gs = lastcall_testkit::cluster::allocator::allocate(&alloc_client, &req)
            .await
            .expect("allocate")
            .expect("a Ready server on n1");
        first.insert(gs.name);
    }
    let allocator = async {
        let mut won = first;
        if !allocating {
            return won;
        }
        tokio::time::sleep(Duration::from_millis(start_ms.max(0) as u64)).await;
        let req = AllocationRequest::fleet(NS, "fleet")
            .on_node("n1")
            .max_tries(2);
        for _ in 0..(servers * 2) {
            if let Ok(Some(gs)) =
                lastcall_testkit::cluster::allocator::allocate(&alloc_client, &req).await
            {
                won.insert(gs.name);
            }
            tokio::time::sleep(Duration::from_millis(pace_ms)).await;
        }
        won
    };
    let identity = match who {
        Who::ClusterAutoscaler => CLUSTER_AUTOSCALER_IDENTITY,
        Who::Karpenter => KARPENTER_IDENTITY,
    };
    let take = async {
        if start_ms < 0 {
            tokio::time::sleep(Duration::from_millis(start_ms.unsigned_abs())).await;
        }
        match who {
            Who::ClusterAutoscaler => {
                let mut cfg = fast_ca();
                if safe == EvictionSafe::Always {
                    // Agones marks Always pods evictable itself: CA picks the node, and only
                    // lastcall's "false" on an allocated pod, seen at the re-check after the
                    // taint, keeps the match. Real CA waits 5 s there; 2 s is still far
                    // beyond the agent's reaction, even on a loaded machine.
                    cfg.delete_delay_after_taint = Duration::from_secs(2);
                }
                let a = cluster.cluster_autoscaler(cfg).await.expect("CA");
                let outcome = a.scale_down("n1").await.expect("CA run");
                matches!(outcome, ca::Outcome::NodeDeleted { .. })
            }
            Who::Karpenter => {
                let k = cluster
                    .karpenter(fast_karpenter())
                    .await
                    .expect("Karpenter");
                let outcome = k
                    .disrupt("n1", Method::Expiration)
                    .await
                    .expect("Karpenter run");
                matches!(outcome, karpenter::Outcome::NodeDeleted { .. })
            }
        }
    };
    let (won, node_taken) = tokio::join!(allocator, take);

    // The promise, from the journal: no pod of a server allocated before it was evicted or
    // deleted by the autoscaler.
    let entries = cluster.emulator().journal().entries();
    for e in entries.iter().filter(|e| {
        e.identity.as_deref() == Some(identity)
            && e.resource.as_deref() == Some("pods")
            && (e.subresource.as_deref() == Some("eviction") || e.verb == Verb::Delete)
            && e.status < 300
    }) {
        let pod = e.name.clone().unwrap_or_default();
        let allocated_before = entries.iter().any(|a| {
            a.seq < e.seq
                && a.identity.as_deref() == Some(ALLOCATOR_IDENTITY)
                && a.verb == Verb::Update
                && a.status < 300
                && a.name.as_deref() == Some(pod.as_str())
        });
        if allocated_before {
            let story: Vec<String> = entries
                .iter()
                .filter(|a| {
                    a.name.as_deref() == Some(pod.as_str())
                        || (a.resource.as_deref() == Some("nodes") && a.verb != Verb::Get)
                })
                .filter(|a| a.verb != Verb::Watch && a.verb != Verb::List)
                .map(|a| {
                    format!(
                        "{} {:?} {:?} {:?}/{:?} {}",
                        a.seq, a.identity, a.verb, a.resource, a.subresource, a.status
                    )
                })
                .collect();
            panic!(
                "{who:?} {safe:?} seed {seed}: the pod of allocated {pod} was evicted or deleted:\n{}",
                story.join("\n")
            );
        }
    }
    // The Cluster Autoscaler may take a node of game servers only where Agones itself
    // marks them evictable (Always): lastcall never does.
    let may_take = who == Who::Karpenter || safe == EvictionSafe::Always;
    if won.is_empty() {
        assert_eq!(
            node_taken, may_take,
            "{who:?} {safe:?} seed {seed}: a node of idle servers taken: {node_taken}"
        );
    } else {
        assert!(
            !node_taken,
            "{who:?} seed {seed}: a node holding {won:?} was taken"
        );
        for name in &won {
            let g = cluster
                .game_servers()
                .into_iter()
                .find(|g| &g.name == name)
                .unwrap_or_else(|| panic!("{who:?} seed {seed}: {name} is gone"));
            assert_eq!(g.state, Some(S::Allocated), "{who:?} seed {seed}: {name}");
            assert!(!g.deleting, "{who:?} seed {seed}: {name} is being deleted");
            let pod = cluster.pod(NS, name).expect("its pod");
            assert!(
                pod.pointer("/metadata/deletionTimestamp").is_none(),
                "{who:?} seed {seed}: {name}'s pod is terminating"
            );
        }
    }
    if let Some(agent) = agent {
        agent.stop().await.expect("clean stop");
    }
    cluster.shutdown().await;
    Outcome {
        who,
        safe,
        allocated: won.len(),
        node_taken,
    }
}

async fn run_all(settings: &[(Setting, u64)]) -> Vec<Outcome> {
    let runs: Vec<(Setting, u64)> = settings
        .iter()
        .flat_map(|(s, n)| (0..*n).map(move |i| (*s, i)))
        .enumerate()
        .map(|(k, (s, _))| (s, k as u64))
        .collect();
    futures::stream::iter(runs)
        .map(|(s, seed)| interleaving(s, seed))
        .buffer_unordered(AT_ONCE)
        .collect()
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn autoscalers_take_idle_nodes_and_never_a_match() {
    let never = |who| Setting {
        who,
        safe: EvictionSafe::Never,
        gone: false,
    };
    let outcomes = run_all(&[
        (never(Who::ClusterAutoscaler), PER_AUTOSCALER),
        (never(Who::Karpenter), PER_AUTOSCALER),
    ])
    .await;
    assert_eq!(outcomes.len() as u64, 2 * PER_AUTOSCALER);
    for who in [Who::ClusterAutoscaler, Who::Karpenter] {
        let mine: Vec<&Outcome> = outcomes.iter().filter(|o| o.who == who).collect();
        let taken = mine.iter().filter(|o| o.node_taken).count();
        let kept = mine.iter().filter(|o| o.allocated > 0).count();
        eprintln!(
            "{who:?}: {} interleavings, {taken} idle nodes taken, {kept} nodes kept for a match that won the race, allocated servers killed: 0",
            mine.len()
        );
        // The race was exercised: some allocations won.
        assert!(kept > 0, "{who:?}: kept {kept}");
        if who == Who::Karpenter {
            assert!(taken > 0, "{who:?}: taken {taken}");
        }
    }
}

/// `OnUpgrade` (no PDB) and `Always` (evictable by Agones' own value) against the Cluster
/// Autoscaler, with the agent running and with the agent gone before the allocations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_autoscaler_never_takes_a_match_under_on_upgrade_or_always() {
    const RUNS: u64 = 20;
    let ca = |safe, gone| Setting {
        who: Who::ClusterAutoscaler,
        safe,
        gone,
    };
    let outcomes = run_all(&[
        (ca(EvictionSafe::OnUpgrade, false), RUNS),
        (ca(EvictionSafe::OnUpgrade, true), RUNS),
        (ca(EvictionSafe::Always, false), RUNS),
    ])
    .await;
    assert_eq!(outcomes.len() as u64, 3 * RUNS);
    for safe in [EvictionSafe::OnUpgrade, EvictionSafe::Always] {
        let mine: Vec<&Outcome> = outcomes.iter().filter(|o| o.safe == safe).collect();
        let taken = mine.iter().filter(|o| o.node_taken).count();
        let kept = mine.iter().filter(|o| o.allocated > 0).count();
        eprintln!(
            "ClusterAutoscaler {safe:?}: {} interleavings, {taken} idle nodes taken, {kept} nodes holding a match kept, allocated servers killed: 0",
            mine.len()
        );
        assert!(kept > 0, "{safe:?}: the race was exercised");
    }
}
