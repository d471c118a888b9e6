//! Agents under API Priority and Fairness: four nodes drain at once against an API server
//! that admits 10 requests a second. The server refuses many of their requests (429 with
//! `Retry-After: 1`); every drain still ends, no allocated server is deleted, and no agent
//! sends a request again before the `Retry-After` it was given, by the journal.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};
use lastcall_testkit::agent::{InProcessAgent, config, metric, metric_sum};
use lastcall_testkit::cluster::{
    Cluster, ClusterConfig, GameServerSpec, GameServerState as S, NodeSpec,
};
use lastcall_testkit::eventually::eventually;
use lastcall_testkit::kube::{ApfConfig, Verb};

const NS: &str = "default";
const HOSTNAME: &str = "kubernetes.io/hostname";
const NODES: [&str; 4] = ["n1", "n2", "n3", "n4"];
const READY_PER_NODE: usize = 3;
const ALLOCATED_PER_NODE: usize = 2;

fn server(node: &str, i: usize) -> String {
    format!("gs-{node}-{i}")
}

async fn agent_on(cluster: &Cluster, node: &str) -> InProcessAgent {
    let kube = cluster
        .emulator()
        .config_for(&format!("agent-{node}"))
        .await
        .expect("client config");
    InProcessAgent::start(config(node, &["--resync-interval", "1s"]), kube, None)
        .await
        .expect("agent")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drains_end_under_throttling_and_agents_wait_out_retry_after() {
    let cluster = Cluster::start(ClusterConfig::default())
        .await
        .expect("cluster");
    let per_node = READY_PER_NODE + ALLOCATED_PER_NODE;
    for node in NODES {
        cluster.add_node(NodeSpec::new(node)).expect("node");
        for i in 0..per_node {
            cluster
                .create_game_server(
                    GameServerSpec::new(server(node, i))
                        .node_selector(HOSTNAME, node)
                        .grace_seconds(0),
                )
                .expect("game server");
        }
    }
    eventually(
        "every game server Ready",
        Duration::from_secs(30),
        Duration::from_millis(20),
        || async {
            (cluster
                .game_servers()
                .iter()
                .filter(|g| g.state == Some(S::Ready))
                .count()
                == NODES.len() * per_node)
                .then_some(())
        },
    )
    .await;
    let mut allocated = BTreeSet::new();
    for node in NODES {
        for i in 0..ALLOCATED_PER_NODE {
            cluster
                .sdk_allocate(NS, &server(node, i))
                .expect("allocate");
            allocated.insert(server(node, i));
        }
    }
    let mut agents = vec![];
    for node in NODES {
        agents.push(agent_on(&cluster, node).await);
    }
    eventually(
        "every server claimed",
        Duration::from_secs(30),
        Duration::from_millis(20),
        || async {
            cluster
                .game_servers()
                .iter()
                .all(|g| g.labels.contains_key("lastcall.dev/node"))
                .then_some(())
        },
    )
    .await;

    // A tiny control plane: 10 requests a second, 2 at once, no queueing.
    let emu = cluster.emulator();
    emu.apf().enable(ApfConfig {
        concurrency: 2,
        rate: Some(10.0),
        burst: 2,
        queue_per_flow: 0,
        queue_wait: Duration::from_secs(1),
        retry_after_secs: 1,
    });
    let drain_from = emu.journal().entries().last().map_or(0, |e| e.seq);
    // The operator's labels go through kube's own retry, which honours Retry-After too.
    let nodes: Api<Node> = Api::all(cluster.client());
    for node in NODES {
        nodes
            .patch(
                node,
                &PatchParams::default(),
                &Patch::Merge(
                    &serde_json::json!({"metadata": {"labels": {"lastcall.dev/drain": "true"}}}),
                ),
            )
            .await
            .expect("drain label");
    }

    eventually(
        "every node fenced, its Ready servers released and its matches protected",
        Duration::from_secs(90),
        Duration::from_millis(50),
        || async {
            let servers = cluster.game_servers();
            let done = NODES.iter().all(|node| {
                let here: Vec<_> = servers
                    .iter()
                    .filter(|g| g.node.as_deref() == Some(*node) && !g.deleting)
                    .collect();
                here.len() == ALLOCATED_PER_NODE
                    && here.iter().all(|g| {
                        g.state == Some(S::Allocated)
                            && g.annotations.contains_key("lastcall.dev/drain-deadline")
                    })
            });
            let fenced = NODES.iter().all(|n| {
                cluster.node(n).is_some_and(|o| {
                    o.pointer("/spec/unschedulable") == Some(&serde_json::json!(true))
                })
            });
            (done && fenced).then_some(())
        },
    )
    .await;
    for name in &allocated {
        cluster.sdk_shutdown(NS, name).expect("match ends");
    }
    eventually(
        "every drain ended: the node is empty",
        Duration::from_secs(90),
        Duration::from_millis(100),
        || async {
            for a in &agents {
                if metric(
                    &a.metrics().await,
                    "lastcall_drain_phase",
                    &[("phase", "empty")],
                ) != Some(1.0)
                {
                    return None;
                }
            }
            Some(())
        },
    )
    .await;

    let journal = emu.journal().entries();
    let stats = emu.apf().stats();
    let rejections = emu.apf().rejections();
    let agent_ids: BTreeSet<String> = NODES.iter().map(|n| format!("agent-{n}")).collect();
    let is_agent = |id: &Option<String>| id.as_ref().is_some_and(|i| agent_ids.contains(i));

    // No allocated server was deleted by an agent.
    let deleted_in_use: Vec<&str> = journal
        .iter()
        .filter(|e| {
            is_agent(&e.identity)
                && e.verb == Verb::Delete
                && e.resource.as_deref() == Some("gameservers")
                && e.status < 300
                && e.name.as_ref().is_some_and(|n| allocated.contains(n))
        })
        .filter_map(|e| e.name.as_deref())
        .collect();
    assert!(
        deleted_in_use.is_empty(),
        "allocated servers deleted: {deleted_in_use:?}"
    );

    // The race happened: the agents were refused, and more than once each.
    let refused: BTreeMap<String, u64> = agent_ids
        .iter()
        .map(|a| (a.clone(), stats.rejected_for(a)))
        .collect();
    assert!(
        refused.values().sum::<u64>() >= 4,
        "the agents were hardly throttled: {refused:?} ({stats:?})"
    );

    // After each refusal, the same request came back no earlier than Retry-After.
    let by_seq: BTreeMap<u64, usize> = journal
        .iter()
        .enumerate()
        .map(|(i, e)| (e.seq, i))
        .collect();
    let mut retried = 0;
    let mut shortest = Duration::MAX;
    for r in rejections.iter().filter(|r| is_agent(&r.identity)) {
        let Some(&i) = by_seq.get(&r.seq) else {
            panic!("rejection {} not in the journal", r.seq)
        };
        let refused = &journal[i];
        let again = journal[i + 1..].iter().find(|e| {
            e.identity == refused.identity
                && e.method == refused.method
                && e.path == refused.path
                && e.query == refused.query
        });
        if let Some(again) = again {
            let gap = again.at.duration_since(refused.at).unwrap_or_default();
            assert!(
                gap >= r.retry_after,
                "{:?} sent {} {} again {gap:?} after a 429 with Retry-After {:?}",
                refused.identity,
                refused.method,
                refused.path,
                r.retry_after
            );
            shortest = shortest.min(gap);
            retried += 1;
        }
    }
    assert!(retried > 0, "no refused request was retried");

    // The agents counted what they were refused.
    let mut counted = 0.0;
    for a in &agents {
        counted += metric_sum(&a.metrics().await, "lastcall_kube_throttled_total", &[]);
    }
    let agent_429s = rejections.iter().filter(|r| is_agent(&r.identity)).count();
    assert_eq!(
        counted as usize, agent_429s,
        "lastcall_kube_throttled_total"
    );
    // A refused pass costs no more than its retry: no label on an idle server whose DELETE
    // was refused (only DELETEs reach idle servers), and the Events of refused passes wait
    // for the pass that finishes (one per drain here, as unthrottled).
    let idle_writes: Vec<String> = journal
        .iter()
        .filter(|e| {
            e.seq > drain_from
                && is_agent(&e.identity)
                && e.resource.as_deref() == Some("gameservers")
                && e.verb.is_mutating()
                && e.name.as_ref().is_some_and(|n| !allocated.contains(n))
                && e.verb != Verb::Delete
        })
        .map(|e| format!("{} {} {:?}", e.method, e.status, e.name))
        .collect();
    assert!(
        idle_writes.is_empty(),
        "writes to idle servers besides DELETEs: {idle_writes:?}"
    );
    let events: BTreeMap<String, usize> = agent_ids
        .iter()
        .map(|a| {
            let n = journal
                .iter()
                .filter(|e| {
                    e.identity.as_deref() == Some(a.as_str())
                        && e.resource.as_deref() == Some("events")
                        && e.verb == Verb::Create
                        && e.status < 300
                })
                .count();
            (a.clone(), n)
        })
        .collect();
    eprintln!("Events written per agent: {events:?}");
    assert!(
        events.values().all(|n| *n <= 2),
        "Events per drain under throttling: {events:?}"
    );
    eprintln!(
        "429s per agent {refused:?}; {retried} refused requests retried, the soonest {shortest:?} later; peak in flight {}, requests by agents {}",
        stats.peak_in_flight,
        journal.iter().filter(|e| is_agent(&e.identity)).count()
    );
    for a in agents {
        a.stop().await.expect("agent stops cleanly");
    }
}
