//! Autoscaler cooperation, raced (issue 9 §3): the modelled Cluster Autoscaler or Karpenter
//! tries to take a node holding only Ready game servers, while an allocator loop keeps
//! allocating that node's Ready servers and the agent runs with `--autoscaler-cooperation
//! in-use` (Agones' default `eviction.safe: Never`, with its 0% PDB).
//!
//! Karpenter runs as node expiry (`Method::Expiration`): under `Never`, Agones' 0% PDB
//! covers every game-server pod, so Karpenter's consolidation refuses any game-server node at
//! its pick (docs/autoscalers.md §3), idle or not; expiry takes the node whatever the PDB
//! says, and is where cooperation decides whether a match dies.
//!
//! Over 200 interleavings (100 per autoscaler), ordered by the emulator's journal:
//! - no pod of an Allocated server is ever evicted or deleted by the autoscaler (matches
//!   killed: 0);
//! - a node where no allocation won is taken (the autoscaler deletes it);
//! - a node where an allocation won stays, and its match is still running when the
//!   autoscaler has given up or is left waiting.

use std::collections::BTreeSet;
use std::time::Duration;

use futures::StreamExt;
use lastcall_testkit::cluster::autoscaler::cluster_autoscaler as ca;
use lastcall_testkit::cluster::autoscaler::karpenter::{self, Method};
use lastcall_testkit::cluster::autoscaler::{CLUSTER_AUTOSCALER_IDENTITY, KARPENTER_IDENTITY};
use lastcall_testkit::cluster::{ALLOCATOR_IDENTITY, AllocationRequest, GameServerState as S};
use lastcall_testkit::eventually::eventually;
use lastcall_testkit::kube::Verb;
use lastcall_testkit::world::race_node;
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
    allocated: usize,
    node_taken: bool,
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

async fn interleaving(who: Who, seed: u64) -> Outcome {
    let mut rng = StdRng::seed_from_u64(seed);
    let servers: usize = rng.random_range(2..=5);
    // Some runs have no allocator at all, so the node can be taken.
    let allocating = rng.random_bool(0.6);
    // Negative: the allocator starts first (an allocation that wins before the autoscaler
    // looks); positive: it starts after (racing the taint and the agent's releases).
    let start_ms: i64 = rng.random_range(-15..=25);
    let pace_ms: u64 = rng.random_range(1..=15);
    let (cluster, agent) = race_node(
        seed,
        servers,
        0,
        true,
        &[
            "--autoscaler-cooperation",
            "in-use",
            "--resync-interval",
            "1s",
        ],
    )
    .await;
    // The agent has offered every idle pod to autoscalers.
    eventually(
        &format!("seed {seed}: idle pods offered"),
        Duration::from_secs(20),
        Duration::from_millis(5),
        || async {
            let pods = cluster.pods_on("n1");
            (pods.len() == servers
                && pods.iter().all(|p| {
                    p.pointer(&format!("/metadata/annotations/{}", STE.replace('/', "~1")))
                        == Some(&serde_json::json!("true"))
                }))
            .then_some(())
        },
    )
    .await;

    let alloc_client = cluster
        .client_without_retry(ALLOCATOR_IDENTITY)
        .await
        .expect("allocator client");
    let allocator = async {
        let mut won = BTreeSet::new();
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
                let a = cluster.cluster_autoscaler(fast_ca()).await.expect("CA");
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
        assert!(
            !allocated_before,
            "{who:?} seed {seed}: the pod of allocated {pod} was evicted or deleted"
        );
    }
    if won.is_empty() {
        assert!(
            node_taken,
            "{who:?} seed {seed}: a node of idle servers was not taken"
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
    agent.stop().await.expect("clean stop");
    cluster.shutdown().await;
    Outcome {
        who,
        allocated: won.len(),
        node_taken,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn autoscalers_take_idle_nodes_and_never_a_match() {
    let runs = (0..PER_AUTOSCALER)
        .map(|s| (Who::ClusterAutoscaler, s))
        .chain((0..PER_AUTOSCALER).map(|s| (Who::Karpenter, 1000 + s)));
    let outcomes: Vec<Outcome> = futures::stream::iter(runs)
        .map(|(who, seed)| interleaving(who, seed))
        .buffer_unordered(AT_ONCE)
        .collect()
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
        // Both outcomes happened, or the race was not exercised.
        assert!(taken > 0 && kept > 0, "{who:?}: taken {taken}, kept {kept}");
    }
}
