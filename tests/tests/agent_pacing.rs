//! Release pacing end to end: a node with 10 Ready servers of one Fleet drains with a floor
//! of 4. Sampled throughout, the Fleet never has fewer than 4 Ready servers (Ready and not
//! being deleted, on any node), and every idle server on the node is still released in the
//! end, as replacements come up elsewhere. Held servers carry the exclusion label at once,
//! a hold that cannot end (no room for replacements) ends at `--release-hold-max`, and three
//! nodes draining one Fleet together do not count each other's servers as capacity.

use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};
use lastcall_testkit::agent::{InProcessAgent, config};
use lastcall_testkit::cluster::{
    Cluster, ClusterConfig, FleetSpec, GameServerState as S, NodeSpec,
};
use lastcall_testkit::eventually::eventually;
use lastcall_testkit::kube::journal::Verb;

#[path = "support/passes.rs"]
mod passes;
use passes::after_passes;

const FLOOR: usize = 4;

const DRAINING: &str = "lastcall.dev/node-draining";

async fn drain(cluster: &Cluster, node: &str) {
    Api::<Node>::all(cluster.client())
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(
                &serde_json::json!({"metadata": {"labels": {"lastcall.dev/drain": "true"}}}),
            ),
        )
        .await
        .expect("label");
}

async fn agent_on(cluster: &Cluster, node: &str, flags: &[&str]) -> InProcessAgent {
    let kube = cluster
        .emulator()
        .config_for(&format!("agent-{node}"))
        .await
        .expect("client");
    InProcessAgent::start(config(node, flags), kube, None)
        .await
        .expect("agent")
}

async fn claimed(cluster: &Cluster) {
    eventually(
        "claimed",
        Duration::from_secs(20),
        Duration::from_millis(10),
        || async {
            cluster
                .game_servers()
                .iter()
                .all(|g| g.labels.contains_key("lastcall.dev/node"))
                .then_some(())
        },
    )
    .await;
}

fn ready(cluster: &Cluster) -> usize {
    cluster
        .game_servers()
        .iter()
        .filter(|g| g.state == Some(S::Ready) && !g.deleting)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_keeps_its_floor_of_ready_servers_while_the_node_drains() {
    let cluster = Cluster::start(ClusterConfig::default())
        .await
        .expect("cluster");
    cluster.add_node(NodeSpec::new("n1")).expect("n1");
    cluster
        .create_fleet(FleetSpec::new("fleet", 10).grace_seconds(0))
        .expect("fleet");
    cluster
        .wait_ready("default", "fleet", 10)
        .await
        .expect("ready");
    cluster.add_node(NodeSpec::new("n2")).expect("n2");
    let kube = cluster
        .emulator()
        .config_for("agent-n1")
        .await
        .expect("client");
    let agent = InProcessAgent::start(
        config("n1", &["--release-floor", "4", "--resync-interval", "1s"]),
        kube,
        None,
    )
    .await
    .expect("agent");
    eventually(
        "claimed",
        Duration::from_secs(20),
        Duration::from_millis(10),
        || async {
            cluster
                .game_servers()
                .iter()
                .all(|g| g.labels.contains_key("lastcall.dev/node"))
                .then_some(())
        },
    )
    .await;
    Api::<Node>::all(cluster.client())
        .patch(
            "n1",
            &PatchParams::default(),
            &Patch::Merge(
                &serde_json::json!({"metadata": {"labels": {"lastcall.dev/drain": "true"}}}),
            ),
        )
        .await
        .expect("label");
    let samples = std::cell::Cell::new(0);
    let lowest = std::cell::Cell::new(usize::MAX);
    eventually(
        "every server on n1 released, the floor kept at every sample",
        Duration::from_secs(60),
        Duration::from_millis(2),
        || async {
            let r = ready(&cluster);
            lowest.set(lowest.get().min(r));
            samples.set(samples.get() + 1);
            assert!(
                r >= FLOOR,
                "the Fleet fell to {r} Ready servers (floor {FLOOR})"
            );
            (!cluster
                .game_servers()
                .iter()
                .any(|g| g.node.as_deref() == Some("n1") && !g.deleting))
            .then_some(())
        },
    )
    .await;
    let (samples, lowest) = (samples.get(), lowest.get());
    eprintln!("{samples} samples, lowest Ready count {lowest} (floor {FLOOR})");
    assert!(samples > 10, "the drain was sampled");
    agent.stop().await.expect("clean stop");
}

/// A Fleet of 6 on n1 alone, floor 4: two go, four are held. Nowhere else can replacements
/// run, so only the hold's bound ends it. The held servers carry the exclusion label (for
/// allocators that select it away) long before that, and no allocation with the selector
/// lands on them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_servers_are_excluded_at_once_and_the_hold_is_bounded() {
    let cluster = Cluster::start(ClusterConfig::default())
        .await
        .expect("cluster");
    cluster.add_node(NodeSpec::new("n1")).expect("n1");
    cluster
        .create_fleet(FleetSpec::new("fleet", 6).grace_seconds(0))
        .expect("fleet");
    cluster
        .wait_ready("default", "fleet", 6)
        .await
        .expect("ready");
    let agent = agent_on(
        &cluster,
        "n1",
        &[
            "--release-floor",
            "4",
            "--release-hold-max",
            "4s",
            "--resync-interval",
            "1s",
        ],
    )
    .await;
    claimed(&cluster).await;
    drain(&cluster, "n1").await;
    let held: Vec<String> = eventually(
        "two released, four held and labelled",
        Duration::from_secs(20),
        Duration::from_millis(10),
        || async {
            let live: Vec<_> = cluster
                .game_servers()
                .into_iter()
                .filter(|g| g.node.as_deref() == Some("n1") && !g.deleting)
                .collect();
            (live.len() == 4
                && live
                    .iter()
                    .all(|g| g.labels.get(DRAINING).map(String::as_str) == Some("true")))
            .then(|| live.into_iter().map(|g| g.name).collect())
        },
    )
    .await;
    // The hold ends: everything goes, although the floor was never reached.
    eventually(
        "held servers released at --release-hold-max",
        Duration::from_secs(20),
        Duration::from_millis(20),
        || async {
            held.iter()
                .all(|n| cluster.game_server("default", n).is_none_or(|g| g.deleting))
                .then_some(())
        },
    )
    .await;
    // Labelled before released: in the journal, each held server's label precedes its delete.
    let journal = cluster.emulator().journal().entries();
    for name in &held {
        let at = |verb: Verb| {
            journal
                .iter()
                .find(|e| {
                    e.identity.as_deref() == Some("agent-n1")
                        && e.verb == verb
                        && e.resource.as_deref() == Some("gameservers")
                        && e.name.as_deref() == Some(name.as_str())
                        && e.status < 300
                })
                .map(|e| e.seq)
        };
        let labelled = at(Verb::Patch).expect("labelled");
        let deleted = at(Verb::Delete).expect("deleted");
        assert!(
            labelled < deleted,
            "{name}: labelled at {labelled}, deleted at {deleted}"
        );
    }
    agent.stop().await.expect("clean stop");
}

/// Three nodes of 3 Ready servers each drain one Fleet together, floor 4, with no node left
/// for replacements. Each agent counts the servers on the other draining nodes as leaving,
/// not as capacity: none is released (the Fleet's 9 Ready servers stay allocatable to
/// allocators without the exclusion selector) until `--release-hold-max` ends the hold, and
/// then all are. Counting the others' held servers as Ready elsewhere, the first node to
/// decide would release all of its own at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_draining_together_do_not_count_each_other_as_capacity() {
    let cluster = Cluster::start(ClusterConfig::default())
        .await
        .expect("cluster");
    for n in ["n1", "n2", "n3"] {
        cluster.add_node(NodeSpec::new(n)).expect("node");
    }
    cluster
        .create_fleet(FleetSpec::new("fleet", 9).grace_seconds(0))
        .expect("fleet");
    cluster
        .wait_ready("default", "fleet", 9)
        .await
        .expect("ready");
    for n in ["n1", "n2", "n3"] {
        let here = cluster
            .game_servers()
            .iter()
            .filter(|g| g.node.as_deref() == Some(n))
            .count();
        assert_eq!(here, 3, "the scheduler spreads the Fleet: {n} has {here}");
    }
    let flags = [
        "--release-floor",
        "4",
        "--release-hold-max",
        "6s",
        "--resync-interval",
        "1s",
    ];
    let mut agents = vec![];
    for n in ["n1", "n2", "n3"] {
        agents.push(agent_on(&cluster, n, &flags).await);
    }
    claimed(&cluster).await;
    for n in ["n1", "n2", "n3"] {
        drain(&cluster, n).await;
    }
    let deletes = |cluster: &Cluster| {
        cluster.emulator().journal().count(|e| {
            e.identity
                .as_deref()
                .is_some_and(|i| i.starts_with("agent-"))
                && e.verb == Verb::Delete
                && e.resource.as_deref() == Some("gameservers")
        })
    };
    eventually(
        "all nine held and labelled",
        Duration::from_secs(20),
        Duration::from_millis(10),
        || async {
            let gs = cluster.game_servers();
            (gs.len() == 9
                && gs
                    .iter()
                    .all(|g| g.labels.get(DRAINING).map(String::as_str) == Some("true")))
            .then_some(())
        },
    )
    .await;
    eventually(
        "all released at --release-hold-max",
        Duration::from_secs(20),
        Duration::from_millis(20),
        || async {
            // Replacements wait unscheduled: every node is cordoned.
            (!cluster.game_servers().iter().any(|g| {
                !g.deleting && ["n1", "n2", "n3"].contains(&g.node.as_deref().unwrap_or(""))
            }))
            .then_some(())
        },
    )
    .await;
    // Released only once each node's hold ran out (from its recorded drain start), by the
    // journal: none counted another's held servers as capacity before.
    let hold = jiff::SignedDuration::from_secs(6);
    let journal = cluster.emulator().journal().entries();
    for n in ["n1", "n2", "n3"] {
        let started: jiff::Timestamp = cluster
            .node(n)
            .and_then(|v| {
                v["metadata"]["annotations"]["lastcall.dev/drain-started"]
                    .as_str()
                    .map(String::from)
            })
            .expect("the drain start recorded")
            .parse()
            .expect("a time");
        let held_until = std::time::SystemTime::from(started + hold);
        let early: Vec<_> = journal
            .iter()
            .filter(|e| {
                e.identity.as_deref() == Some(format!("agent-{n}").as_str())
                    && e.verb == Verb::Delete
                    && e.resource.as_deref() == Some("gameservers")
                    && e.at < held_until
            })
            .map(|e| e.name.clone())
            .collect();
        assert!(
            early.is_empty(),
            "{n} released {early:?} before its hold ended: it counted another's servers as capacity"
        );
    }
    assert!(
        deletes(&cluster) >= 9,
        "every server released once the holds ended"
    );
    for a in agents {
        a.stop().await.expect("clean stop");
    }
}

/// With pacing on, an idle node reads no Fleet: Fleets matter only to a drain pacing its
/// releases (at 2,000 idle nodes a GET and a LIST each per pass would be hundreds a
/// second). Once a drain starts, the Fleet is read and the floor holds as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_node_reads_no_fleet_and_a_draining_one_does() {
    let cluster = Cluster::start(ClusterConfig::default())
        .await
        .expect("cluster");
    cluster.add_node(NodeSpec::new("n1")).expect("n1");
    cluster
        .create_fleet(FleetSpec::new("fleet", 4).grace_seconds(0))
        .expect("fleet");
    cluster
        .wait_ready("default", "fleet", 4)
        .await
        .expect("ready");
    let agent = agent_on(
        &cluster,
        "n1",
        &["--release-floor", "2", "--resync-interval", "500ms"],
    )
    .await;
    claimed(&cluster).await;
    let fleet_reads = || {
        cluster.emulator().journal().count(|r| {
            r.identity.as_deref() == Some("agent-n1") && r.resource.as_deref() == Some("fleets")
        })
    };
    // Several passes on an idle node.
    after_passes(&agent, 4).await;
    assert_eq!(fleet_reads(), 0, "an idle node reads no Fleet");
    drain(&cluster, "n1").await;
    eventually(
        "the draining node reads its Fleet",
        Duration::from_secs(20),
        Duration::from_millis(50),
        || async { (fleet_reads() > 0).then_some(()) },
    )
    .await;
    agent.stop().await.expect("clean stop");
}
