//! Seed 003's rare case, raced against an allocator: a game-server pod is deleted (SIGTERM'd
//! while its GameServer is Ready) on a node that is not draining. Agones keeps such a
//! GameServer Ready, and allocatable, until the pod is gone; the agent deletes the GameServer
//! with its preconditions as soon as it sees the pod terminating.
//!
//! In every other interleaving one of the deleted pods belongs to a server already in a
//! match. Over many interleavings, ordered by the emulator's journal: every such GameServer
//! that was not allocated first is deleted by the agent; none is allocated after the agent's
//! delete; one allocated before its pod's deletion, or in the window before the agent saw the
//! pod (its preconditions fail), is never deleted by the agent. The window itself
//! (allocations between the pod's deletion and the agent's delete) is counted and reported.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::DeleteParams;
use lastcall_testkit::cluster::{AllocationRequest, GameServerState as S};
use lastcall_testkit::eventually::eventually;
use lastcall_testkit::kube::journal::Verb;
use lastcall_testkit::world::race_node;
use rand::{Rng, SeedableRng, rngs::StdRng};

const NS: &str = "default";
const INTERLEAVINGS: u64 = 40;
const AT_ONCE: usize = 4;

#[derive(Debug, Default)]
struct Outcome {
    deleted_pods: usize,
    removed_by_agent: usize,
    allocated_in_window: usize,
    /// Allocated before its pod was deleted: a running match, not this rare case.
    allocated_before: usize,
}

async fn interleaving(seed: u64) -> Outcome {
    let mut rng = StdRng::seed_from_u64(seed);
    let servers: usize = rng.random_range(4..=8);
    let pace_us: u64 = rng.random_range(0..=4000);
    // Long grace: the pod stays terminating (and its GameServer Ready) for the whole run.
    let (cluster, agent) = race_node(seed, servers, 60, false, &["--resync-interval", "1s"]).await;

    // In every other interleaving one server is already in a match when its pod is
    // deleted: the agent must leave it alone.
    let in_match: Option<String> = if seed % 2 == 1 {
        let gs = cluster
            .allocate(&AllocationRequest::fleet(NS, "fleet"))
            .await
            .expect("allocate")
            .expect("an allocated server");
        Some(gs.name)
    } else {
        None
    };
    let victims: Vec<String> = {
        let mut names: Vec<String> = cluster
            .game_servers()
            .into_iter()
            .filter(|g| g.state == Some(S::Ready))
            .map(|g| g.name)
            .collect();
        names.sort();
        let k = rng.random_range(1..=names.len().min(3));
        in_match
            .into_iter()
            .chain(names.into_iter().take(k))
            .collect()
    };
    let kubectl: Api<Pod> = Api::namespaced(
        cluster
            .emulator()
            .client_as("kubectl")
            .await
            .expect("kubectl"),
        NS,
    );
    let alloc_client = cluster
        .client_without_retry("agones-allocator")
        .await
        .expect("allocator client");
    let allocator = async {
        let req = AllocationRequest::fleet(NS, "fleet").max_tries(3);
        for _ in 0..servers {
            let _ = lastcall_testkit::cluster::allocator::allocate(&alloc_client, &req).await;
            tokio::time::sleep(Duration::from_micros(pace_us)).await;
        }
    };
    let deleter = async {
        tokio::time::sleep(Duration::from_micros(rng.random_range(0..=3000))).await;
        for v in &victims {
            kubectl
                .delete(v, &DeleteParams::default())
                .await
                .expect("delete pod");
        }
    };
    tokio::join!(allocator, deleter);
    // Let the agent see and act.
    eventually(
        &format!("seed {seed}: every victim allocated or being deleted"),
        Duration::from_secs(10),
        Duration::from_millis(10),
        || async {
            let gs: BTreeMap<String, _> = cluster
                .game_servers()
                .into_iter()
                .map(|g| (g.name.clone(), g))
                .collect();
            victims
                .iter()
                .all(|v| {
                    gs.get(v)
                        .is_none_or(|g| g.deleting || g.state != Some(S::Ready))
                })
                .then_some(())
        },
    )
    .await;
    agent.stop().await.expect("clean stop");

    let entries = cluster.emulator().journal().entries();
    let mut out = Outcome {
        deleted_pods: victims.len(),
        ..Outcome::default()
    };
    for v in &victims {
        let named = |e: &&lastcall_testkit::kube::journal::JournalEntry| {
            e.name.as_deref() == Some(v.as_str())
        };
        let pod_deleted = entries
            .iter()
            .filter(named)
            .find(|e| {
                e.identity.as_deref() == Some("kubectl") && e.verb == Verb::Delete && e.status < 300
            })
            .map(|e| e.seq)
            .expect("pod deleted");
        let agent_delete = entries
            .iter()
            .filter(named)
            .find(|e| {
                e.identity.as_deref() == Some("agent-n1")
                    && e.verb == Verb::Delete
                    && e.resource.as_deref() == Some("gameservers")
                    && e.status < 300
            })
            .map(|e| e.seq);
        let allocations: Vec<u64> = entries
            .iter()
            .filter(named)
            .filter(|e| {
                e.identity.as_deref() == Some("agones-allocator")
                    && e.verb == Verb::Update
                    && e.status < 300
            })
            .map(|e| e.seq)
            .collect();
        match agent_delete {
            Some(d) => {
                out.removed_by_agent += 1;
                assert!(
                    allocations.iter().all(|a| *a < d),
                    "seed {seed}: {v} allocated after the agent deleted it"
                );
                // Allocated first (before its pod's deletion or in the window after it): a
                // match, which the agent's delete must never end.
                assert!(
                    allocations.is_empty(),
                    "seed {seed}: the agent deleted {v} (seq {d}) after it was allocated (seq {allocations:?}; pod deleted at seq {pod_deleted})"
                );
            }
            None => assert!(
                !allocations.is_empty(),
                "seed {seed}: {v} was neither allocated nor removed from allocation"
            ),
        }
        if agent_delete.is_none() {
            if allocations.iter().any(|a| *a < pod_deleted) {
                out.allocated_before += 1;
            } else {
                out.allocated_in_window += 1;
            }
        }
    }
    cluster.shutdown().await;
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ready_server_whose_pod_is_deleted_is_removed_from_allocation() {
    let outcomes: Vec<Outcome> = futures::stream::iter(0..INTERLEAVINGS)
        .map(interleaving)
        .buffer_unordered(AT_ONCE)
        .collect()
        .await;
    let deleted: usize = outcomes.iter().map(|o| o.deleted_pods).sum();
    let removed: usize = outcomes.iter().map(|o| o.removed_by_agent).sum();
    let window: usize = outcomes.iter().map(|o| o.allocated_in_window).sum();
    let before: usize = outcomes.iter().map(|o| o.allocated_before).sum();
    eprintln!(
        "{INTERLEAVINGS} interleavings: {deleted} pods deleted ({before} of them already allocated), {removed} GameServers removed by the agent, {window} allocated in the window between the pod's deletion and the agent's delete"
    );
    assert!(
        removed > 0,
        "the agent removed none: the race was not exercised"
    );
    // Both sides of the race occurred: servers allocated before their pod was deleted (which
    // the agent must leave alone) and idle ones the agent removed.
    assert!(
        before > 0,
        "no victim was allocated before its pod's deletion: that case was not exercised"
    );
}

/// A release whose DELETE finds the server changed (a Starting server turned Ready, so
/// allocatable) labels it `lastcall.dev/node-draining` in the same pass: exclusion-selector
/// allocators skip it from then on, not a pass later. The real actuator against the
/// emulator, ordered by its journal: the 409 DELETE, then the label.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_that_finds_the_server_changed_labels_it_at_once() {
    use lastcall_agent::actuator::{Actuator, Release};
    use lastcall_agent::policy::GsRef;
    use lastcall_testkit::kube::resources::GAMESERVERS;
    use lastcall_testkit::world::{NS, World, WorldSpec};

    let w = World::start(WorldSpec::new(1, 0, 0)).await;
    let seen = w.on("n1").into_iter().next().expect("a server on n1");
    let old = GsRef {
        namespace: NS.into(),
        name: seen.name.clone(),
        uid: seen.uid.clone(),
        resource_version: seen.resource_version.clone(),
    };
    // Agones writes it (Starting -> Ready) after the agent saw it.
    w.cluster
        .store()
        .modify(&GAMESERVERS, Some(NS), &seen.name, |obj| {
            obj["status"]["state"] = serde_json::json!("Ready");
            obj["metadata"]["annotations"]["agones.dev/sdk-version"] = serde_json::json!("1.58.0");
            Ok(())
        })
        .expect("the server changes");
    let (metrics, _) = lastcall_agent::metrics::Metrics::new();
    let client = w
        .cluster
        .emulator()
        .config_for("agent-n1")
        .await
        .map(|c| kube::Client::try_from(c).expect("client"))
        .expect("config");
    let actuator = Actuator::new(client, "n1".into(), false, metrics);
    let outcome = actuator.release(&old).await;
    assert!(
        matches!(outcome.result, Ok(Release::Conflict)),
        "{:?}",
        outcome.result
    );
    let j = w.cluster.emulator().journal();
    let mine: Vec<_> = j
        .filter(|r| {
            r.identity.as_deref() == Some("agent-n1")
                && r.resource.as_deref() == Some("gameservers")
                && (r.verb == Verb::Delete || r.verb == Verb::Patch)
        })
        .into_iter()
        .map(|r| (r.verb, r.status))
        .collect();
    assert_eq!(
        mine,
        [(Verb::Delete, 409), (Verb::Patch, 200)],
        "the refused DELETE, then the label"
    );
    let now = w.on("n1").into_iter().next().expect("still there");
    assert_eq!(
        now.labels
            .get("lastcall.dev/node-draining")
            .map(String::as_str),
        Some("true")
    );
}
