//! Agents on a real Redis Cluster (three primaries, a replica each; `cluster-enabled yes`,
//! a 1 s node timeout) with a drain in progress, while nodes die: the primary holding an
//! instance's slot, and the node an agent subscribed through, killed with SIGKILL (or, in
//! the cheaper variant, failed over with `CLUSTER FAILOVER`). Statuses are written by
//! pubsub's own publisher, seeded with a node that dies too. After the failover, a notice
//! published once must reach every agent and every drain must complete, and no allocated
//! server is ever deleted (by the kube journal).

use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use lastcall_common::fleetiq::{InstanceStatus as Status, StatusMessage};
use lastcall_common::redis_url::{InstanceKeys, RedisTarget};
use lastcall_testkit::agent::InProcessAgent;
use lastcall_testkit::cluster::GameServerView;
use lastcall_testkit::eventually::eventually;
use lastcall_testkit::gamelift::{GameLiftEmulator, InstanceStatus};
use lastcall_testkit::redis::RedisCluster;
use lastcall_testkit::world::{
    GROUP, World, WorldSpec, annotation, cordoned, has_taint, subscribed,
};

/// How long anything may take around a failover: the node timeout (1 s), the election,
/// and the agents' reconnect backoff, on a loaded machine.
const FAILOVER_WITHIN: Duration = Duration::from_secs(90);
const POLL: Duration = Duration::from_millis(100);

/// Nodes of the test cluster: three primaries and a replica each.
const CLUSTER_NODES: usize = 6;

/// Two instance ids whose agents' first subscription goes through the node their URL names
/// first (agents spread their subscriptions over the nodes they know by channel: see
/// `first_subscription_node`), so each scenario knows which node it kills.
fn instances_through_the_url_node() -> (String, String) {
    let mut ids = (0u64..).map(|k| format!("i-{k:017x}")).filter(|id| {
        lastcall_agent::fleetiq::source::first_subscription_node(id, CLUSTER_NODES) == 0
    });
    let a = ids.next().unwrap_or_default();
    let b = ids.next().unwrap_or_default();
    (a, b)
}

/// Logs to the test's output with `RUST_LOG` set (e.g. `lastcall_agent=debug`).
fn logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// pubsub's publisher, as the binary builds it, against `redis_url`.
fn publisher(redis_url: &str, dir: &Path) -> lastcall_pubsub::publisher::Publisher {
    let groups = dir.join("fleetiq.conf");
    std::fs::write(&groups, format!("{GROUP}\n")).unwrap();
    let config = <lastcall_pubsub::config::Config as clap::Parser>::try_parse_from([
        "lastcall-pubsub",
        "--redis-url",
        redis_url,
        "--config-file",
        groups.to_str().unwrap(),
        "--aws-region",
        "us-west-2",
        "--listen",
        "127.0.0.1:0",
    ])
    .unwrap();
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = lastcall_pubsub::metrics::Metrics::register(&mut registry);
    let health = lastcall_common::admin::Health::new(&[lastcall_pubsub::publisher::READY_REDIS]);
    lastcall_pubsub::publisher::Publisher::new(&config, metrics, health).unwrap()
}

/// What GameLift says, kept the same as what is published, so a fallback check agrees.
fn gamelift_says(w: &World, iid: &str, status: Status) {
    let s = match status {
        Status::Active => InstanceStatus::Active,
        Status::Draining => InstanceStatus::Draining,
        _ => InstanceStatus::SpotTerminating,
    };
    w.gl.set_instance_status(iid, s);
}

/// Publishes `status` for `iid` (of world `w`) through pubsub's script (cache keys, then PUBLISH), retrying
/// until Redis took it: once this returns, the notice is in the cluster.
async fn publish(p: &lastcall_pubsub::publisher::Publisher, w: &World, iid: &str, status: Status) {
    gamelift_says(w, iid, status);
    let body = StatusMessage {
        group_name: Some(GROUP.into()),
        group_arn: Some(GameLiftEmulator::group_arn(GROUP)),
        instance_id: iid.into(),
        status,
    }
    .to_python_json();
    eventually(
        "pubsub published the status",
        FAILOVER_WITHIN,
        POLL,
        || async {
            let r = p
                .publish(
                    &[lastcall_pubsub::publisher::Outgoing {
                        instance_id: iid.to_string(),
                        body: body.clone(),
                        polled_at: tokio::time::Instant::now(),
                    }],
                    tokio::time::Instant::now() + Duration::from_secs(60),
                )
                .await;
            (r.published == 1).then_some(())
        },
    )
    .await;
}

/// An agent for node n1 of `w`, for instance `iid`, on the cluster at `url`, built as the
/// binary builds it.
async fn agent(w: &World, iid: &str, url: &str) -> InProcessAgent {
    let args: Vec<String> = [
        "--game-server-group",
        GROUP,
        "--redis-url",
        url,
        "--instance-id",
        iid,
        "--heartbeat-interval",
        "1s",
        "--resync-interval",
        "1s",
        "--redis-ping-interval",
        "1s",
    ]
    .map(String::from)
    .to_vec();
    let agent = w.start_agent(&args).await;
    subscribed(&agent).await;
    w.claimed_all().await;
    agent
}

/// The agent is subscribed again and read the cache (`lastcall_redis_connected` 1).
async fn connected(agent: &InProcessAgent) {
    eventually("the agent is subscribed", FAILOVER_WITHIN, POLL, || async {
        (lastcall_testkit::agent::metric(&agent.metrics().await, "lastcall_redis_connected", &[])
            == Some(1.0))
        .then_some(())
    })
    .await;
}

/// The node of `channel`'s only subscriber, once there is exactly one.
async fn subscribed_through(cluster: &RedisCluster, channel: &str) -> u16 {
    eventually(
        "exactly one subscriber of the channel",
        FAILOVER_WITHIN,
        POLL,
        || async {
            let mut on = Vec::new();
            for port in cluster.live_ports() {
                for _ in 0..cluster.subscribers_on(port, channel).await {
                    on.push(port);
                }
            }
            (on.len() == 1).then(|| on[0])
        },
    )
    .await
}

/// The drain's notice on the Node names `cause`.
async fn notice_names(w: &World, cause: &str) {
    eventually(
        "the drain notice names the new cause",
        FAILOVER_WITHIN,
        POLL,
        || async {
            let n: Node = w.node().await;
            annotation(&n, "lastcall.dev/drain-notice")
                .is_some_and(|a| a.contains(&format!("\"{cause}\"")))
                .then_some(())
        },
    )
    .await;
}

/// The agent never deleted `keep` (the allocated server) nor any server while it was
/// allocated, and `keep` is still there, protected, until its match ends.
async fn never_deleted_by_the_agent(w: &World, keep: &GameServerView) {
    let deletes: Vec<String> = w
        .cluster
        .emulator()
        .journal()
        .entries()
        .into_iter()
        .filter(|e| {
            e.identity.as_deref() == Some("agent-n1")
                && e.method == "DELETE"
                && e.resource.as_deref() == Some("gameservers")
                && e.name.as_deref() == Some(keep.name.as_str())
        })
        .map(|e| format!("{} {} {}", e.seq, e.path, e.status))
        .collect();
    assert!(
        deletes.is_empty(),
        "the agent deleted the allocated server: {deletes:?}"
    );
    let g = w.cluster.game_server("default", &keep.name).unwrap();
    assert!(
        !g.deleting && g.annotations.contains_key("lastcall.dev/drain-deadline"),
        "the match lost its protection: {g:?}"
    );
    let n = w.node().await;
    assert!(cordoned(&n) && has_taint(&n, "lastcall.dev/draining"));
}

/// Two agents (two worlds, instances `iid` and `iid2`) drain while the cluster loses two
/// nodes to SIGKILL: the primary of `iid`'s slot, which agent A (and pubsub) subscribed and
/// connected through, so A's node and its keys' primary are the same; and a replica of
/// another shard, which agent B subscribed through, so B's node and its keys' primary differ.
/// After each replica took over, one SPOT_TERMINATING per instance, published once, reaches
/// both agents (each moved its subscription to a live node and read the cache), both drains
/// complete with one deregistration each, and neither allocated server was deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drains_survive_killing_the_slot_primary_and_the_subscribed_node() {
    logs();
    let mut cluster = RedisCluster::start(3, 1).await.unwrap();
    let (iid, iid2) = instances_through_the_url_node();
    let (iid, iid2) = (iid.as_str(), iid2.as_str());
    let keys = RedisTarget::parse(&cluster.url()).unwrap().keys();
    let p1 = cluster.primary_of(&keys.status(iid)).await.unwrap();
    let p2 = cluster.primary_of(&keys.status(iid2)).await.unwrap();
    // B goes through a replica outside p1's shard (outside p2's too when there is one):
    // killing it with p1 leaves every shard a node and a majority of primaries to elect
    // p1's replica.
    let mut candidates = Vec::new();
    for port in cluster.ports() {
        let nodes = cluster.nodes_seen_by(port).await.unwrap();
        let me = nodes.iter().find(|n| n.port == port).unwrap();
        if let Some(of) = &me.replica_of {
            let primary = nodes.iter().find(|n| &n.id == of).unwrap().port;
            if primary != p1 {
                candidates.push((primary == p2, port));
            }
        }
    }
    candidates.sort();
    let x = candidates.first().expect("a replica outside p1's shard").1;

    let w1 = World::start(WorldSpec::new(1, 1, 0)).await;
    let w2 = World::start(WorldSpec::new(1, 1, 0)).await;
    w1.gl
        .add_instances(GROUP, &[iid.to_string()], InstanceStatus::Active);
    w2.gl
        .add_instances(GROUP, &[iid2.to_string()], InstanceStatus::Active);
    let (keep1, keep2) = (w1.allocated(), w2.allocated());
    let dir = tempfile::tempdir().unwrap();
    // pubsub and agent A start from p1 only; B from x only. Each learns the rest.
    let pubsub = publisher(&cluster.url_through(&[p1]), dir.path());
    publish(&pubsub, &w1, iid, Status::Active).await;
    publish(&pubsub, &w2, iid2, Status::Active).await;
    let a = agent(&w1, iid, &cluster.url_through(&[p1])).await;
    let b = agent(&w2, iid2, &cluster.url_through(&[x])).await;
    assert_eq!(subscribed_through(&cluster, iid).await, p1);
    assert_eq!(subscribed_through(&cluster, iid2).await, x);

    // Both drains in progress: fenced, the idle server released, the match protected.
    publish(&pubsub, &w1, iid, Status::Draining).await;
    publish(&pubsub, &w2, iid2, Status::Draining).await;
    w1.fenced_and_released(&keep1).await;
    w2.fenced_and_released(&keep2).await;

    cluster.kill(p1).await.unwrap();
    cluster.kill(x).await.unwrap();
    assert_ne!(cluster.primary_of(&keys.status(iid)).await.unwrap(), p1);

    // The cluster is healthy again: each notice is published once, and must arrive.
    publish(&pubsub, &w2, iid2, Status::SpotTerminating).await;
    publish(&pubsub, &w1, iid, Status::SpotTerminating).await;
    notice_names(&w1, "preemption").await;
    notice_names(&w2, "preemption").await;
    let a_now = subscribed_through(&cluster, iid).await;
    let b_now = subscribed_through(&cluster, iid2).await;
    assert!(a_now != p1 && b_now != x, "{a_now} {b_now}");
    connected(&a).await;
    connected(&b).await;

    never_deleted_by_the_agent(&w1, &keep1).await;
    never_deleted_by_the_agent(&w2, &keep2).await;
    w1.finish_drain(&keep1).await;
    w2.finish_drain(&keep2).await;
    a.stop().await.unwrap();
    b.stop().await.unwrap();
}

/// The cheaper variant: `CLUSTER FAILOVER` of the primary of the instance's slot, which the
/// agent subscribed through, mid-drain. The agent's node is now a replica and still hears
/// every PUBLISH; a notice published after the failover arrives. Then that node (now
/// the subscribed-through replica, no longer the keys' primary) is killed: the agent moves
/// its subscription, a second notice arrives, and the drain completes without deleting the
/// allocated server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_survives_a_cluster_failover_then_its_node_killed() {
    logs();
    let mut cluster = RedisCluster::start(3, 1).await.unwrap();
    let (iid, _) = instances_through_the_url_node();
    let iid = iid.as_str();
    let keys: InstanceKeys = RedisTarget::parse(&cluster.url()).unwrap().keys();
    let p1 = cluster.primary_of(&keys.status(iid)).await.unwrap();
    let r1 = cluster.replicas_of(p1).await.unwrap()[0];
    let w = World::start(WorldSpec::new(1, 1, 0)).await;
    w.gl.add_instances(GROUP, &[iid.to_string()], InstanceStatus::Active);
    let keep = w.allocated();
    let dir = tempfile::tempdir().unwrap();
    let pubsub = publisher(&cluster.url(), dir.path());
    publish(&pubsub, &w, iid, Status::Active).await;
    let a = agent(&w, iid, &cluster.url_through(&[p1])).await;
    assert_eq!(subscribed_through(&cluster, iid).await, p1);
    publish(&pubsub, &w, iid, Status::Draining).await;
    w.fenced_and_released(&keep).await;

    cluster.failover(r1).await.unwrap();
    assert_eq!(cluster.primary_of(&keys.status(iid)).await.unwrap(), r1);
    publish(&pubsub, &w, iid, Status::SpotTerminating).await;
    notice_names(&w, "preemption").await;
    never_deleted_by_the_agent(&w, &keep).await;

    // p1 is a replica now: killing it elects nobody, and the agent must move.
    assert_eq!(subscribed_through(&cluster, iid).await, p1);
    cluster.kill(p1).await.unwrap();
    let signals = |text: &str| {
        lastcall_testkit::agent::metric(
            text,
            "lastcall_signals_total",
            &[("source", "fleetiq"), ("status", "SPOT_TERMINATING")],
        )
        .unwrap_or(0.0)
    };
    let moved = subscribed_through(&cluster, iid).await;
    assert_ne!(moved, p1);
    // Resubscribed and the cache read: what arrives next is the live message.
    connected(&a).await;
    let seen = signals(&a.metrics().await);
    publish(&pubsub, &w, iid, Status::SpotTerminating).await;
    eventually(
        "the notice after the kill arrives",
        FAILOVER_WITHIN,
        POLL,
        || async { (signals(&a.metrics().await) > seen).then_some(()) },
    )
    .await;
    never_deleted_by_the_agent(&w, &keep).await;
    w.finish_drain(&keep).await;
    a.stop().await.unwrap();
}

/// A listener that accepts connections and never answers: a node whose packets are
/// blackholed after the handshake (a dead VM behind a still-routing address).
async fn silent_node() -> (u16, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    (port, task)
}

/// A Redis Cluster URL that names a node which never answers, first: every connection
/// (the webhook's reads, the publisher's batches, the agents' drain-state writes) is still
/// made within the per-node bound from the nodes that do answer, and the node list is
/// learned from them. Before, the silent node held every connect to its whole timeout
/// bound and then failed it, so no connection was ever made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_cluster_node_does_not_stall_connecting() {
    use lastcall_common::redis_conn;
    let cluster = RedisCluster::start(3, 0).await.unwrap();
    let (silent, _task) = silent_node().await;
    let mut ports = vec![silent];
    ports.extend(cluster.ports());
    let target = RedisTarget::parse(&cluster.url_through(&ports)).unwrap();
    let client = redis_conn::any_client(&target, None).unwrap();
    let timeout = Duration::from_millis(500);
    for attempt in 0..3 {
        let started = tokio::time::Instant::now();
        let mut conn = redis_conn::connect_any(&client, timeout)
            .await
            .unwrap_or_else(|e| panic!("attempt {attempt}: no connection: {e}"));
        let took = started.elapsed();
        assert!(
            took < timeout * 2,
            "attempt {attempt}: connecting took {took:?}, over twice the per-node bound"
        );
        let pong: String = redis::cmd("PING").query_async(&mut conn).await.unwrap();
        assert_eq!(pong, "PONG");
        let _: () = redis::cmd("SET")
            .arg(format!("k{attempt}"))
            .arg(1)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
}

/// A replica in the slot map that accepts connections and then answers nothing (paused:
/// `CLIENT PAUSE … ALL`, as a node whose packets are blackholed after the handshake): a
/// connection is still made within the per-node bound, and commands to the primaries work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_replica_in_the_slot_map_does_not_stall_connecting() {
    use lastcall_common::redis_conn;
    let cluster = RedisCluster::start(3, 1).await.unwrap();
    let nodes = cluster.nodes_seen_by(cluster.ports()[0]).await.unwrap();
    let replica = nodes.iter().find(|n| !n.primary).expect("a replica").port;
    let primary = nodes.iter().find(|n| n.primary).expect("a primary").port;
    let mut pause = cluster.node(replica).await.unwrap();
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(30_000)
        .arg("ALL")
        .query_async(&mut pause)
        .await
        .unwrap();
    let target = RedisTarget::parse(&cluster.url_through(&[primary])).unwrap();
    let client = redis_conn::any_client(&target, None).unwrap();
    let timeout = Duration::from_millis(500);
    for attempt in 0..3 {
        let started = tokio::time::Instant::now();
        let mut conn = redis_conn::connect_any(&client, timeout)
            .await
            .unwrap_or_else(|e| panic!("attempt {attempt}: no connection: {e}"));
        let took = started.elapsed();
        assert!(
            took < timeout * 2,
            "attempt {attempt}: connecting took {took:?}, over twice the per-node bound"
        );
        for k in 0..6 {
            let _: () = redis::cmd("SET")
                .arg(format!("k{attempt}-{k}"))
                .arg(1)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
    }
}

/// A primary that accepts connections and answers nothing: connecting still succeeds
/// within the bound, keys on the other primaries are written at once, and only the keys
/// of the silent node's slots fail, each within the response timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_primary_stalls_only_its_own_slots() {
    use lastcall_common::redis_conn;
    let cluster = RedisCluster::start(3, 0).await.unwrap();
    let ports = cluster.ports();
    let silent = ports[2];
    let mut pause = cluster.node(silent).await.unwrap();
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(30_000)
        .arg("ALL")
        .query_async(&mut pause)
        .await
        .unwrap();
    let target = RedisTarget::parse(&cluster.url_through(&ports[..2])).unwrap();
    let client = redis_conn::any_client(&target, None).unwrap();
    let timeout = Duration::from_millis(500);
    for attempt in 0..3 {
        let started = tokio::time::Instant::now();
        let mut conn = redis_conn::connect_any(&client, timeout)
            .await
            .unwrap_or_else(|e| panic!("attempt {attempt}: no connection: {e}"));
        let took = started.elapsed();
        assert!(
            took < timeout * 3,
            "attempt {attempt}: connecting took {took:?}"
        );
        let (mut ok, mut failed) = (0, 0);
        for k in 0..12 {
            let started = tokio::time::Instant::now();
            let r: redis::RedisResult<()> = redis::cmd("SET")
                .arg(format!("k{attempt}-{k}"))
                .arg(1)
                .query_async(&mut conn)
                .await;
            let took = started.elapsed();
            match r {
                Ok(()) => ok += 1,
                Err(_) => failed += 1,
            }
            assert!(took < timeout * 12, "a command took {took:?}");
        }
        assert!(ok >= 4, "attempt {attempt}: {ok} written, {failed} failed");
    }
}
