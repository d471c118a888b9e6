//! The FleetAutoscaler webhook end to end: real HTTP(S) to the production server code,
//! drain state published with `lastcall_common::drain_state` into a real `redis-server`,
//! bodies in the shapes Agones sends. No assertion here is about time; the one client
//! timeout is Agones' own contract (it gives up after 15 s).

use std::time::{Duration, SystemTime};

use lastcall_common::drain_state::{self, FleetOnNode, NodeDrainState};
use lastcall_pubsub::webhook::review::parse_response;
use lastcall_testkit::agent::metric_sum;
use lastcall_testkit::eventually::wait_for;
use lastcall_testkit::redis::{RedisServer, TcpProxy, generate_tls};
use lastcall_testkit::webhook::{FleetStatus, WebhookServer, agones_review, typed_review};

/// Agones' webhook client timeout, less a margin: an answer later than this is no answer.
const AGONES_TIMEOUT: Duration = Duration::from_secs(14);

const NS: &str = "default";
const FLEET: &str = "simple-game";

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(AGONES_TIMEOUT)
        .build()
        .unwrap()
}

/// Posts `body` and returns the status and the body text.
async fn post(client: &reqwest::Client, url: &str, body: String) -> (u16, String) {
    let r = client
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("an answer within Agones' timeout");
    let status = r.status().as_u16();
    (status, r.text().await.unwrap())
}

/// Asks for `status` of Fleet `NS/FLEET` and returns `(scale, replicas)`, checking the
/// answer is a 200 echoing the uid.
async fn ask(client: &reqwest::Client, url: &str, status: FleetStatus) -> (bool, i64) {
    ask_fleet(client, url, NS, FLEET, status, &[]).await
}

async fn ask_fleet(
    client: &reqwest::Client,
    url: &str,
    namespace: &str,
    name: &str,
    status: FleetStatus,
    annotations: &[(&str, &str)],
) -> (bool, i64) {
    let uid = format!("uid-{}", rand::random::<u64>());
    let (code, body) = post(
        client,
        url,
        agones_review(&uid, namespace, name, status, annotations),
    )
    .await;
    assert_eq!(code, 200, "{body}");
    let (echoed, scale, replicas) = parse_response(body.as_bytes()).expect("a response");
    assert_eq!(echoed, uid, "the uid is echoed");
    (scale, replicas)
}

fn status(replicas: i64, allocated: i64) -> FleetStatus {
    FleetStatus {
        replicas,
        ready: replicas - allocated,
        reserved: 0,
        allocated,
    }
}

fn now_ms() -> i64 {
    drain_state::unix_ms(SystemTime::now())
}

fn draining(node: &str, at_ms: i64, fleets: &[(&str, &str, u32, u32)]) -> NodeDrainState {
    NodeDrainState {
        node: node.into(),
        updated_at_ms: at_ms,
        counted_at_ms: None,
        truncated: false,
        fleets: fleets
            .iter()
            .map(|&(namespace, name, ready, allocated)| FleetOnNode {
                namespace: namespace.into(),
                name: name.into(),
                ready,
                allocated,
                held: None,
                at_risk: None,
            })
            .collect(),
    }
}

async fn publish(redis: &RedisServer, state: &NodeDrainState) {
    let mut conn = redis.client().await.unwrap();
    drain_state::publish(&mut conn, state).await.unwrap();
}

/// Sets Fleet `NS/FLEET`'s `spec.replicas`, the floor of a held answer, and waits until the
/// webhook's Fleet cache has it.
async fn spec(hook: &WebhookServer, replicas: u32) {
    hook.set_fleet(NS, FLEET, replicas).await.unwrap();
}

fn m(server: &WebhookServer, name: &str, labels: &[(&str, &str)]) -> f64 {
    metric_sum(&server.metrics_text(), name, labels)
}

#[tokio::test]
async fn agones_shaped_reviews_get_the_buffer_with_the_uid_echoed() {
    let redis = RedisServer::start().await.unwrap();
    let hook = WebhookServer::start(&redis.host_port(), &["--webhook-max-replicas", "100"], None)
        .await
        .unwrap();
    let client = http();

    // Agones' wire form: 7 allocated + buffer 5 = 12.
    assert_eq!(ask(&client, &hook.url(), status(10, 7)).await, (true, 12));
    // Already there: no scaling.
    assert_eq!(ask(&client, &hook.url(), status(12, 7)).await, (false, 12));
    // Zero allocated: the buffer alone.
    assert_eq!(ask(&client, &hook.url(), status(0, 0)).await, (true, 5));

    // The documented typed form, on `/` (a `service:` webhook without a path).
    let root = hook.url().trim_end_matches("scale").to_string();
    let (code, body) = post(
        &client,
        &root,
        typed_review("u-typed", NS, FLEET, status(3, 1)),
    )
    .await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(
        parse_response(body.as_bytes()),
        Some(("u-typed".into(), true, 6))
    );
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["kind"], "FleetAutoscaleReview");
    assert_eq!(v["apiVersion"], "autoscaling.agones.dev/v1");

    let text = hook.metrics_text();
    assert_eq!(
        metric_sum(
            &text,
            "lastcall_pubsub_webhook_requests_total",
            &[("result", "scale_up")]
        ),
        3.0,
        "{text}"
    );
    assert_eq!(
        metric_sum(
            &text,
            "lastcall_pubsub_webhook_requests_total",
            &[("result", "unchanged")]
        ),
        1.0
    );
    assert_eq!(
        metric_sum(
            &text,
            "lastcall_pubsub_webhook_drain_state_reads_total",
            &[("result", "ok")]
        ),
        4.0
    );
    assert_eq!(
        metric_sum(
            &text,
            "lastcall_pubsub_webhook_request_duration_seconds_count",
            &[]
        ),
        4.0
    );
}

#[tokio::test]
async fn a_draining_node_adds_exactly_its_ready_servers_of_that_fleet() {
    let redis = RedisServer::start().await.unwrap();
    let hook = WebhookServer::start(&redis.host_port(), &["--webhook-max-replicas", "100"], None)
        .await
        .unwrap();
    let client = http();
    let fleet = status(20, 14);
    let (_, plain) = ask(&client, &hook.url(), fleet).await;
    assert_eq!(plain, 19, "14 allocated + 5");

    // node-a drains 6 Ready (and 2 Allocated) servers of this Fleet, and servers of other
    // Fleets, one with the same name in another namespace.
    publish(
        &redis,
        &draining(
            "node-a",
            now_ms(),
            &[
                (NS, FLEET, 6, 2),
                (NS, "other-game", 4, 0),
                ("staging", FLEET, 9, 0),
            ],
        ),
    )
    .await;
    assert_eq!(ask(&client, &hook.url(), fleet).await, (true, plain + 6));
    // The other Fleets get their own extra, and only theirs.
    assert_eq!(
        ask_fleet(&client, &hook.url(), "staging", FLEET, fleet, &[]).await,
        (true, plain + 9)
    );

    // A second draining node adds up; a republish replaces, never accumulates.
    publish(&redis, &draining("node-b", now_ms(), &[(NS, FLEET, 3, 0)])).await;
    publish(&redis, &draining("node-a", now_ms(), &[(NS, FLEET, 6, 1)])).await;
    assert_eq!(ask(&client, &hook.url(), fleet).await.1, plain + 9);

    // Drains end: the extra goes away.
    let mut conn = redis.client().await.unwrap();
    assert!(drain_state::clear(&mut conn, "node-a").await.unwrap());
    assert!(drain_state::clear(&mut conn, "node-b").await.unwrap());
    assert!(!drain_state::clear(&mut conn, "node-b").await.unwrap());
    assert_eq!(ask(&client, &hook.url(), fleet).await.1, plain);

    assert_eq!(
        m(&hook, "lastcall_pubsub_webhook_extra_replicas_total", &[]),
        6.0 + 9.0 + 9.0
    );
    assert_eq!(
        m(
            &hook,
            "lastcall_pubsub_webhook_drain_state_nodes",
            &[("state", "fresh")]
        ),
        0.0,
        "the gauge follows the last read"
    );
}

#[tokio::test]
async fn min_and_max_bound_the_answer_extra_included() {
    let redis = RedisServer::start().await.unwrap();
    let hook = WebhookServer::start(
        &redis.host_port(),
        &[
            "--webhook-min-replicas",
            "10",
            "--webhook-max-replicas",
            "30",
        ],
        None,
    )
    .await
    .unwrap();
    let client = http();
    // Zero allocated: min.
    assert_eq!(ask(&client, &hook.url(), status(4, 0)).await, (true, 10));
    publish(&redis, &draining("node-a", now_ms(), &[(NS, FLEET, 6, 0)])).await;
    // 0 + 5 + 6 = 11: above min, so all of it.
    assert_eq!(ask(&client, &hook.url(), status(10, 0)).await, (true, 11));
    // 22 + 5 + 6 = 33: capped at max.
    assert_eq!(ask(&client, &hook.url(), status(27, 22)).await, (true, 30));
    assert_eq!(
        m(
            &hook,
            "lastcall_pubsub_webhook_clamped_total",
            &[("bound", "min")]
        ),
        1.0
    );
    assert_eq!(
        m(
            &hook,
            "lastcall_pubsub_webhook_clamped_total",
            &[("bound", "max")]
        ),
        1.0
    );
}

#[tokio::test]
async fn stale_future_and_malformed_drain_state_counts_zero_and_dead_entries_are_pruned() {
    let redis = RedisServer::start().await.unwrap();
    let hook = WebhookServer::start(
        &redis.host_port(),
        &[
            "--webhook-max-replicas",
            "100",
            "--webhook-drain-state-max-age",
            "2m",
        ],
        None,
    )
    .await
    .unwrap()
    .with_fleets(&[(NS, FLEET, 10), (NS, "other-fleet", 20)])
    .await
    .unwrap();
    hook.add_nodes(&["late", "dead", "ahead", "fresh"])
        .await
        .unwrap();
    let client = http();
    let fleet = status(10, 10);
    let now = now_ms();
    // Late (3 min: stale, holding), long dead (1 h: past the 5 min hold limit, and over
    // 10 × 2 min: pruned), 10 min in the future (invalid), and garbage.
    publish(
        &redis,
        &draining("late", now - 3 * 60_000, &[(NS, FLEET, 6, 0)]),
    )
    .await;
    publish(
        &redis,
        &draining("dead", now - 3_600_000, &[(NS, FLEET, 6, 0)]),
    )
    .await;
    publish(
        &redis,
        &draining("ahead", now + 600_000, &[(NS, FLEET, 6, 0)]),
    )
    .await;
    let mut conn = redis.client().await.unwrap();
    let _: i64 = redis::cmd("HSET")
        .arg(drain_state::KEY)
        .arg("garbage")
        .arg("{\"node\":\"garbage\",\"fleets\":7}")
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: i64 = redis::cmd("HSET")
        .arg(drain_state::KEY)
        .arg(&b"\xff\xfe"[..])
        .arg("{}")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        ask(&client, &hook.url(), fleet).await,
        (true, 15),
        "zero extra"
    );
    // The stale entries name this Fleet: what those nodes hold now is unknown, so the
    // answer may not shrink it. Another Fleet, named by no stale entry, shrinks.
    spec(&hook, 20).await;
    assert_eq!(
        ask(&client, &hook.url(), status(20, 10)).await,
        (false, 20),
        "held while a stale entry names the Fleet"
    );
    assert_eq!(
        ask_fleet(&client, &hook.url(), NS, "other-fleet", status(20, 10), &[]).await,
        (true, 15)
    );
    assert_eq!(
        m(
            &hook,
            "lastcall_pubsub_webhook_held_total",
            &[("reason", "stale_entry")]
        ),
        1.0
    );

    // One fresh entry still counts beside them.
    spec(&hook, 10).await;
    publish(&redis, &draining("fresh", now_ms(), &[(NS, FLEET, 2, 0)])).await;
    assert_eq!(ask(&client, &hook.url(), fleet).await, (true, 17));

    for (reason, per_read) in [
        ("stale", 1.0),
        ("expired", 1.0),
        ("future", 1.0),
        ("invalid_json", 1.0),
        ("not_utf8", 1.0),
    ] {
        assert!(
            m(
                &hook,
                "lastcall_pubsub_webhook_drain_state_skipped_total",
                &[("reason", reason)]
            ) >= per_read,
            "{reason}: {}",
            hook.metrics_text()
        );
    }
    // The long-dead entry is deleted; the merely late and the malformed ones are kept.
    wait_for("the dead entry is pruned", || async {
        let mut conn = redis.client().await.ok()?;
        let exists: bool = redis::cmd("HEXISTS")
            .arg(drain_state::KEY)
            .arg("dead")
            .query_async(&mut conn)
            .await
            .ok()?;
        (!exists).then_some(())
    })
    .await;
    let fields: Vec<Vec<u8>> = redis::cmd("HKEYS")
        .arg(drain_state::KEY)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        fields.len(),
        7,
        "late, ahead, garbage, non-UTF-8, fresh, the epoch and its server run remain"
    );
    assert_eq!(
        m(
            &hook,
            "lastcall_pubsub_webhook_drain_state_pruned_total",
            &[]
        ),
        1.0
    );
    assert_eq!(ask(&client, &hook.url(), fleet).await.1, 17);
    assert_eq!(
        m(
            &hook,
            "lastcall_pubsub_webhook_drain_state_nodes",
            &[("state", "malformed")]
        ),
        2.0
    );
    assert_eq!(
        m(
            &hook,
            "lastcall_pubsub_webhook_drain_state_nodes",
            &[("state", "stale")]
        ),
        1.0,
        "late is stale; dead is past the hold limit (expired)"
    );
}

/// A drain-state entry has an end. An agent whose node dies (a Spot reclaim with players on
/// it) never clears its entry: while the entry is fresh the webhook would add its servers
/// although the GameServerSet already replaces them (created twice), then hold every Fleet
/// it names, unable to shrink, until the prune at 10 max ages. Now an entry whose Node is
/// gone counts for nothing and holds nothing, and so does one older than
/// `--webhook-drain-state-hold-limit` or dated in the future.
/// The Nodes are read from the kube emulator; the drain state from a real Redis.
#[tokio::test]
async fn a_gone_node_or_an_expired_entry_counts_for_nothing_and_holds_nothing() {
    use lastcall_testkit::cluster::{Cluster, ClusterConfig, NodeSpec};
    let redis = RedisServer::start().await.unwrap();
    let cluster = Cluster::start(ClusterConfig::default()).await.unwrap();
    for node in ["alive", "late-alive", "old-alive"] {
        cluster.add_node(NodeSpec::new(node)).unwrap();
    }
    let hook = WebhookServer::start(
        &redis.host_port(),
        &[
            "--webhook-max-replicas",
            "100",
            "--webhook-drain-state-max-age",
            "1m",
            "--webhook-drain-state-hold-limit",
            "3m",
        ],
        None,
    )
    .await
    .unwrap();
    cluster
        .create_fleet(lastcall_testkit::cluster::FleetSpec::new("held", 20))
        .unwrap();
    hook.attach_kube(cluster.client());
    hook.wait_fleet_listed(NS, "held").await;
    let client = http();
    let now = now_ms();
    // Fresh: 2 on a live node, 6 on a node that died (a Spot reclaim: its agent could
    // not clear the entry).
    cluster.add_node(NodeSpec::new("dead")).unwrap();
    publish(&redis, &draining("alive", now, &[(NS, FLEET, 2, 0)])).await;
    publish(&redis, &draining("dead", now, &[(NS, FLEET, 6, 0)])).await;
    cluster.remove_node("dead").unwrap();
    // 10 allocated + 5 + 2: the dead node's servers, which its GameServerSet replaces
    // already, are not asked for again.
    assert_eq!(ask(&client, &hook.url(), status(10, 10)).await, (true, 17));

    // Stale entries of other Fleets: a gone node's, one past the hold limit, one from the
    // future; none of them holds. A stale entry of a live node within the limit does.
    let late = now - 2 * 60_000;
    publish(&redis, &draining("dead-late", late, &[(NS, "gone", 3, 0)])).await;
    publish(
        &redis,
        &draining("old-alive", now - 4 * 60_000, &[(NS, "expired", 3, 0)]),
    )
    .await;
    publish(
        &redis,
        &draining("ahead", now + 5 * 60_000, &[(NS, "future", 3, 0)]),
    )
    .await;
    publish(&redis, &draining("late-alive", late, &[(NS, "held", 3, 0)])).await;
    for fleet in ["gone", "expired", "future"] {
        assert_eq!(
            ask_fleet(&client, &hook.url(), NS, fleet, status(20, 10), &[]).await,
            (true, 15),
            "{fleet}: scales down to the buffer"
        );
    }
    assert_eq!(
        ask_fleet(&client, &hook.url(), NS, "held", status(20, 10), &[]).await,
        (false, 20),
        "a live node's stale entry still holds"
    );
    let text = hook.metrics_text();
    assert_eq!(
        metric_sum(&text, "lastcall_pubsub_webhook_held_total", &[]),
        1.0,
        "{text}"
    );
    assert_eq!(
        metric_sum(
            &text,
            "lastcall_pubsub_webhook_drain_state_skipped_total",
            &[("reason", "node_gone")]
        ),
        2.0,
        "dead for this Fleet, dead-late for gone: {text}"
    );
    assert!(
        metric_sum(
            &text,
            "lastcall_pubsub_webhook_node_reads_total",
            &[("result", "absent")]
        ) >= 2.0,
        "{text}"
    );
    assert_eq!(
        metric_sum(&text, "lastcall_pubsub_webhook_fleets_held", &[]),
        1.0,
        "{text}"
    );
    assert!(
        text.contains(
            "lastcall_pubsub_webhook_fleet_held_seconds{fleet_namespace=\"default\",fleet=\"held\"}"
        ),
        "{text}"
    );
}

/// "Fresh" is about the counts, not only the publisher: an agent whose publisher keeps
/// refreshing its entry while its planner has stopped (counts computed three minutes ago,
/// over the two-minute max age) says nothing current about the node, so the Fleets it names
/// are held, not sized from old counts. Counts computed seconds ago count as before.
#[tokio::test]
async fn old_counts_from_a_live_publisher_hold_instead_of_counting() {
    let redis = RedisServer::start().await.unwrap();
    let hook = WebhookServer::start(&redis.host_port(), &["--webhook-max-replicas", "100"], None)
        .await
        .unwrap()
        .with_fleets(&[(NS, FLEET, 20), (NS, "current", 10)])
        .await
        .unwrap();
    hook.add_nodes(&["current", "repeated"]).await.unwrap();
    let client = http();
    let now = now_ms();
    let mut current = draining("current", now, &[(NS, "current", 3, 0)]);
    current.counted_at_ms = Some(now - 10_000);
    let mut repeated = draining("repeated", now, &[(NS, FLEET, 3, 0)]);
    repeated.counted_at_ms = Some(now - 3 * 60_000);
    publish(&redis, &current).await;
    publish(&redis, &repeated).await;
    assert_eq!(
        ask_fleet(&client, &hook.url(), NS, "current", status(10, 10), &[]).await,
        (true, 18),
        "10 allocated + 5 + the 3 of current counts"
    );
    assert_eq!(
        ask(&client, &hook.url(), status(20, 10)).await,
        (false, 20),
        "old counts hold the Fleet at its size: no scale-down to 10 + 5 (+ 3)"
    );
    assert_eq!(
        m(
            &hook,
            "lastcall_pubsub_webhook_held_total",
            &[("reason", "stale_counts")]
        ),
        1.0,
        "{}",
        hook.metrics_text()
    );
    assert!(
        m(
            &hook,
            "lastcall_pubsub_webhook_drain_state_skipped_total",
            &[("reason", "stale_counts")]
        ) >= 1.0
    );
}

/// Writers enforce the size readers enforce: an entry over 64 KiB is refused with an error
/// naming the limit and nothing is written (a reader would skip it, and the Fleets on that
/// node would silently count for nothing). Fitted, it keeps the Fleets with the most to
/// replace and is marked truncated: the Fleets it lists count, and every other Fleet is
/// held, since it may be among those left out.
#[tokio::test]
async fn an_oversize_entry_is_refused_by_the_writer_and_a_fitted_one_holds_every_fleet() {
    let redis = RedisServer::start().await.unwrap();
    let long = "f".repeat(200);
    let left = format!("{long}-399");
    let hook = WebhookServer::start(&redis.host_port(), &["--webhook-max-replicas", "100"], None)
        .await
        .unwrap()
        .with_fleets(&[(NS, FLEET, 10), (NS, &left, 20), (NS, "other", 20)])
        .await
        .unwrap();
    hook.add_nodes(&["big"]).await.unwrap();
    let client = http();
    let names: Vec<String> = (0..400).map(|i| format!("{long}-{i:03}")).collect();
    let mut fleets: Vec<(&str, &str, u32, u32)> =
        names.iter().map(|n| (NS, n.as_str(), 1, 0)).collect();
    fleets.push((NS, FLEET, 4, 0));
    let mut big = draining("big", now_ms(), &fleets);
    let mut conn = redis.client().await.unwrap();
    let err = drain_state::publish(&mut conn, &big)
        .await
        .expect_err("an entry over the limit is refused");
    let text = err.to_string();
    assert!(
        text.contains("over the 65536-byte limit"),
        "a clear error: {text}"
    );
    let written: Option<String> = redis::cmd("HGET")
        .arg(drain_state::KEY)
        .arg("big")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(written, None, "nothing written");

    let left_out = big.fit();
    assert!(left_out > 0 && big.truncated);
    assert!(big.to_json().len() <= drain_state::MAX_ENTRY_BYTES);
    assert_eq!(
        big.fleets[0].name, FLEET,
        "the Fleet with most to replace kept"
    );
    drain_state::publish(&mut conn, &big).await.unwrap();
    assert_eq!(
        ask(&client, &hook.url(), status(10, 10)).await,
        (true, 19),
        "10 + 5 + its 4: the Fleet it lists counts"
    );
    let left = names.last().unwrap();
    assert!(
        !big.fleets.iter().any(|f| &f.name == left),
        "{left} left out"
    );
    assert_eq!(
        ask_fleet(&client, &hook.url(), NS, left, status(20, 10), &[]).await,
        (false, 20),
        "a Fleet left out is held, not scaled down to 15"
    );
    assert_eq!(
        ask_fleet(&client, &hook.url(), NS, "other", status(20, 10), &[]).await,
        (false, 20),
        "any Fleet is"
    );
    assert!(
        m(
            &hook,
            "lastcall_pubsub_webhook_held_total",
            &[("reason", "truncated_entry")]
        ) >= 2.0
    );
}

/// Two clusters on one Redis, each with its `--cluster-name`, read only their own drains;
/// the default name keeps the key earlier releases used.
#[tokio::test]
async fn clusters_sharing_one_redis_do_not_see_each_others_drains() {
    let redis = RedisServer::start().await.unwrap();
    let start = |name: &'static str| {
        let url = redis.host_port();
        async move {
            WebhookServer::start(
                &url,
                &["--webhook-max-replicas", "100", "--cluster-name", name],
                None,
            )
            .await
            .unwrap()
        }
    };
    let (blue, green) = (start("blue").await, start("green").await);
    let legacy = WebhookServer::start(&redis.host_port(), &["--webhook-max-replicas", "100"], None)
        .await
        .unwrap();
    let mut conn = redis.client().await.unwrap();
    let state = draining("node-1", now_ms(), &[(NS, FLEET, 6, 0)]);
    drain_state::publish_to(&mut conn, &drain_state::key_for("blue"), &state)
        .await
        .unwrap();
    let mut old = draining("node-2", now_ms(), &[(NS, FLEET, 2, 0)]);
    old.fleets[0].ready = 2;
    drain_state::publish(&mut conn, &old).await.unwrap();
    let client = http();
    assert_eq!(ask(&client, &blue.url(), status(10, 10)).await, (true, 21));
    assert_eq!(
        ask(&client, &green.url(), status(10, 10)).await,
        (true, 15),
        "green does not see blue's drain"
    );
    assert_eq!(
        ask(&client, &legacy.url(), status(10, 10)).await,
        (true, 17),
        "no name: lastcall:drain-state, as before"
    );
    assert_eq!(drain_state::key_for(""), "lastcall:drain-state");
    assert_eq!(drain_state::key_for("blue"), "lastcall:drain-state:blue");
}

/// A held answer keeps the Fleet's own `spec.replicas`, watched on the API server. Agones
/// writes the answer into `spec.replicas` (and, when `scale` is false, its
/// `status.replicas`), so during a rolling update (status = spec + the surge) holding at
/// `status.replicas` ratcheted the Fleet up at every held sync: spec 10 became 13 here.
#[tokio::test]
async fn a_held_answer_keeps_the_fleets_spec_during_a_rolling_update() {
    use lastcall_testkit::cluster::{Cluster, ClusterConfig, FleetSpec, NodeSpec};
    let redis = RedisServer::start().await.unwrap();
    let cluster = Cluster::start(ClusterConfig::default()).await.unwrap();
    cluster.create_fleet(FleetSpec::new(FLEET, 10)).unwrap();
    cluster.add_node(NodeSpec::new("agent-down")).unwrap();
    let hook = WebhookServer::start(&redis.host_port(), &["--webhook-max-replicas", "100"], None)
        .await
        .unwrap();
    hook.attach_kube(cluster.emulator().client_as("pubsub").await.unwrap());
    hook.wait_fleet_listed(NS, FLEET).await;
    let client = http();
    // A stale entry names the Fleet: its agent stopped refreshing, its Node is still
    // there, so it holds.
    publish(
        &redis,
        &draining(
            "agent-down",
            now_ms() - 3 * 60_000,
            &[(NS, FLEET, 3, 0), (NS, "no-such", 1, 0)],
        ),
    )
    .await;
    // What Agones sends mid-rollout: spec 10, status 13 (3 surge servers), 2 allocated.
    let mid_rollout = status(13, 2);
    assert_eq!(
        ask(&client, &hook.url(), mid_rollout).await,
        (true, 10),
        "held at spec.replicas (scale: true, or Agones would apply status.replicas)"
    );
    assert_eq!(
        m(
            &hook,
            "lastcall_pubsub_webhook_fleet_sizes_total",
            &[("result", "known")]
        ),
        1.0
    );
    // A Fleet the API does not know: no size to hold at, so no guess either: an error,
    // and Agones leaves that Fleet as it is.
    let (code, body) = post(
        &client,
        &hook.url(),
        agones_review("u-1", NS, "no-such", status(13, 2), &[]),
    )
    .await;
    assert_eq!(code, 503, "{body}");
    assert!(
        body.contains("spec.replicas is not known (absent)"),
        "{body}"
    );
    // Every call is one the chart's ClusterRole for the webhook grants: get nodes, list
    // and watch fleets.agones.dev; nothing else.
    let calls: std::collections::BTreeSet<(String, String)> = cluster
        .emulator()
        .journal()
        .entries()
        .into_iter()
        .filter(|e| e.identity.as_deref() == Some("pubsub"))
        .map(|e| {
            (
                e.verb.as_str().to_string(),
                e.resource.clone().unwrap_or_default(),
            )
        })
        .collect();
    let granted: std::collections::BTreeSet<(String, String)> =
        [("list", "fleets"), ("watch", "fleets"), ("get", "nodes")]
            .iter()
            .map(|(v, r)| (v.to_string(), r.to_string()))
            .collect();
    assert_eq!(calls, granted);
    let chart = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../charts/lastcall/templates/pubsub.yaml"
    ))
    .unwrap();
    for rule in [
        "resources: [nodes]\n    verbs: [get]",
        "resources: [fleets]\n    verbs: [list, watch]",
    ] {
        assert!(chart.contains(rule), "the chart grants {rule:?}");
    }
}

/// A Redis restarted without persistence comes back with an empty drain-state hash, which
/// reads exactly like "no node drains": before, the next answer shrank a Fleet whose
/// draining node's servers were about to go. The hash carries an epoch field that only a
/// lost hash lacks: then every answer holds (grows, never shrinks) until every draining
/// agent has written again (`RESTART_SETTLE`, two refresh periods).
#[tokio::test]
async fn a_redis_restarted_empty_holds_until_the_agents_have_written_again() {
    let mut redis = RedisServer::start().await.unwrap();
    let hook = WebhookServer::start(&redis.host_port(), &["--webhook-max-replicas", "100"], None)
        .await
        .unwrap()
        .with_fleets(&[(NS, FLEET, 21)])
        .await
        .unwrap();
    hook.add_nodes(&["node-a"]).await.unwrap();
    let client = http();
    // Settled: nothing drains, the Fleet shrinks to the buffer.
    assert_eq!(ask(&client, &hook.url(), status(20, 10)).await, (true, 15));
    publish(&redis, &draining("node-a", now_ms(), &[(NS, FLEET, 6, 0)])).await;
    assert_eq!(ask(&client, &hook.url(), status(21, 10)).await, (false, 21));

    // Redis restarts empty: node-a's entry is gone, though node-a still drains.
    redis.restart().await.unwrap();
    // Until the webhook reads the new Redis (its connection died with the old one).
    let reads = || {
        metric_sum(
            &hook.metrics_text(),
            "lastcall_pubsub_webhook_drain_state_reads_total",
            &[("result", "ok")],
        )
    };
    let before = reads();
    wait_for("the webhook reads Redis again", || async {
        ask(&client, &hook.url(), status(10, 10)).await;
        (reads() > before).then_some(())
    })
    .await;
    assert_eq!(
        ask(&client, &hook.url(), status(21, 10)).await,
        (false, 21),
        "held: not shrunk to 15 on an empty read"
    );
    spec(&hook, 10).await;
    assert_eq!(
        ask(&client, &hook.url(), status(10, 10)).await,
        (true, 15),
        "growth is still allowed"
    );
    // The agent writes again; once the settle has passed (the epoch moved back here, as
    // time would move it), its entry counts as before.
    publish(&redis, &draining("node-a", now_ms(), &[(NS, FLEET, 6, 0)])).await;
    let mut conn = redis.client().await.unwrap();
    let epoch: i64 = redis::cmd("HGET")
        .arg(drain_state::KEY)
        .arg(drain_state::EPOCH_FIELD)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(
        (now_ms() - epoch).abs() < 30_000,
        "the webhook dated the hash"
    );
    let _: i64 = redis::cmd("HSET")
        .arg(drain_state::KEY)
        .arg(drain_state::EPOCH_FIELD)
        .arg(epoch - drain_state::RESTART_SETTLE.as_millis() as i64)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(ask(&client, &hook.url(), status(25, 10)).await, (true, 21));
}

/// With Redis down the drain state is unknown: answers are 200 and may grow the Fleet, but
/// never shrink it (a guessed zero extra would scale down just as a node's capacity
/// leaves). Before, a Fleet at 16 was answered 10.
#[tokio::test]
async fn redis_down_still_answers_200_and_holds_the_size() {
    let mut redis = RedisServer::start().await.unwrap();
    let hook = WebhookServer::start(
        &redis.host_port(),
        &[
            "--webhook-max-replicas",
            "100",
            "--webhook-redis-timeout",
            "200ms",
        ],
        None,
    )
    .await
    .unwrap()
    .with_fleets(&[(NS, FLEET, 16)])
    .await
    .unwrap();
    hook.add_nodes(&["node-a"]).await.unwrap();
    let client = http();
    publish(&redis, &draining("node-a", now_ms(), &[(NS, FLEET, 6, 0)])).await;
    assert_eq!(ask(&client, &hook.url(), status(10, 5)).await, (true, 16));

    redis.kill().await;
    for _ in 0..4 {
        assert_eq!(
            ask(&client, &hook.url(), status(16, 5)).await,
            (false, 16),
            "held: no scale-down on a guess"
        );
    }
    spec(&hook, 10).await;
    assert_eq!(
        ask(&client, &hook.url(), status(10, 8)).await,
        (true, 13),
        "growth is still allowed"
    );
    let text = hook.metrics_text();
    assert_eq!(
        metric_sum(&text, "lastcall_pubsub_webhook_held_total", &[]),
        4.0,
        "{text}"
    );
    let failed = metric_sum(
        &text,
        "lastcall_pubsub_webhook_drain_state_reads_total",
        &[],
    ) - metric_sum(
        &text,
        "lastcall_pubsub_webhook_drain_state_reads_total",
        &[("result", "ok")],
    );
    assert_eq!(failed, 5.0, "{text}");
    assert!(
        metric_sum(
            &text,
            "lastcall_pubsub_webhook_drain_state_reads_total",
            &[("result", "backoff")]
        ) >= 1.0,
        "later reads skip Redis while backing off: {text}"
    );

    // Redis back (empty, no persistence): the drain state is used again once republished.
    redis.restart().await.unwrap();
    publish(&redis, &draining("node-a", now_ms(), &[(NS, FLEET, 6, 0)])).await;
    wait_for("the webhook reads the drain state again", || async {
        (ask(&client, &hook.url(), status(10, 5)).await.1 == 16).then_some(())
    })
    .await;
}

#[tokio::test]
async fn blackholed_redis_is_bounded_by_the_timeout_and_answers_the_plain_buffer() {
    let redis = RedisServer::start().await.unwrap();
    let proxy = TcpProxy::start(redis.port()).await.unwrap();
    let hook = WebhookServer::start(
        &format!("127.0.0.1:{}", proxy.port()),
        &[
            "--webhook-max-replicas",
            "100",
            "--webhook-redis-timeout",
            "200ms",
        ],
        None,
    )
    .await
    .unwrap()
    .with_fleets(&[(NS, FLEET, 10)])
    .await
    .unwrap();
    hook.add_nodes(&["node-a"]).await.unwrap();
    let client = http();
    publish(&redis, &draining("node-a", now_ms(), &[(NS, FLEET, 6, 0)])).await;
    assert_eq!(ask(&client, &hook.url(), status(10, 5)).await.1, 16);

    // Bytes vanish, nothing is closed: only the webhook's own timeout can end the read.
    proxy.set_blackhole(true);
    assert_eq!(ask(&client, &hook.url(), status(10, 5)).await, (false, 10));
    assert_eq!(ask(&client, &hook.url(), status(10, 5)).await, (false, 10));
    let text = hook.metrics_text();
    let reads = |result| {
        metric_sum(
            &text,
            "lastcall_pubsub_webhook_drain_state_reads_total",
            &[("result", result)],
        )
    };
    assert!(reads("timeout") >= 1.0, "{text}");
    assert_eq!(
        reads("timeout") + reads("backoff"),
        2.0,
        "a timeout, then backoff: {text}"
    );

    proxy.set_blackhole(false);
    wait_for("a new connection reads the drain state", || async {
        (ask(&client, &hook.url(), status(10, 5)).await.1 == 16).then_some(())
    })
    .await;
}

#[tokio::test]
async fn bad_reviews_get_400_with_the_reason_and_never_stop_the_server() {
    let redis = RedisServer::start().await.unwrap();
    let hook = WebhookServer::start(&redis.host_port(), &["--webhook-max-replicas", "100"], None)
        .await
        .unwrap();
    let client = http();
    let ok = status(1, 0);
    let cases: Vec<(String, &str, &str)> = vec![
        (
            "{not json".into(),
            "not a FleetAutoscaleReview",
            "invalid_json",
        ),
        ("".into(), "not a FleetAutoscaleReview", "invalid_json"),
        ("{}".into(), "request is missing", "missing_field"),
        (
            typed_review("u", NS, FLEET, ok).replace("FleetAutoscaleReview", "AdmissionReview"),
            "kind is \"AdmissionReview\"",
            "wrong_kind",
        ),
        (
            agones_review("", NS, FLEET, ok, &[]),
            "request.uid is missing",
            "missing_field",
        ),
        (
            agones_review(
                "u",
                NS,
                FLEET,
                FleetStatus {
                    replicas: 3,
                    allocated: -2,
                    ..FleetStatus::default()
                },
                &[],
            ),
            "request.status.allocatedReplicas is -2",
            "bad_count",
        ),
    ];
    for (body, message, reason) in &cases {
        let (code, text) = post(&client, &hook.url(), body.clone()).await;
        assert_eq!(code, 400, "{body}: {text}");
        assert!(text.contains(message), "{body}: {text}");
        assert!(
            m(
                &hook,
                "lastcall_pubsub_webhook_rejected_total",
                &[("reason", reason)]
            ) >= 1.0,
            "{reason}"
        );
    }
    // A body that never arrives whole: 408 once BODY_TIMEOUT passes, not a connection
    // held for ever. Before, the server waited as long as the client did.
    let mut raw = tokio::net::TcpStream::connect(hook.addr()).await.unwrap();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    raw.write_all(
        b"POST /scale HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"request\"",
    )
    .await
    .unwrap();
    let mut head = [0u8; 12];
    // Agones' own limit on a webhook call, and a bound for the test.
    tokio::time::timeout(Duration::from_secs(15), raw.read_exact(&mut head))
        .await
        .expect("an answer once the body timeout passes")
        .unwrap();
    assert_eq!(&head, b"HTTP/1.1 408");

    // Wrong method, wrong path: refused by the router.
    assert_eq!(client.get(hook.url()).send().await.unwrap().status(), 405);
    assert_eq!(
        post(&client, &hook.url().replace("/scale", "/nope"), "{}".into())
            .await
            .0,
        404
    );

    // Still answering.
    assert_eq!(ask(&client, &hook.url(), status(1, 0)).await, (true, 5));
    assert_eq!(
        m(
            &hook,
            "lastcall_pubsub_webhook_requests_total",
            &[("result", "rejected")]
        ),
        (cases.len() + 1) as f64
    );
    assert_eq!(
        m(
            &hook,
            "lastcall_pubsub_webhook_rejected_total",
            &[("reason", "body_timeout")]
        ),
        1.0
    );
}

/// A typo in a Fleet's `lastcall.dev/autoscaler-*` annotation (or the URL's query) is
/// ignored with a warning and `bad_overrides_total{source}`: the answer is the plain
/// Buffer result of the flags. Before, it was a 400 on every sync, which Agones treats as
/// "leave the Fleet as it is": the Fleet could not even grow until someone fixed it.
#[tokio::test]
async fn a_bad_fleet_setting_answers_the_flags_buffer_and_is_counted() {
    let redis = RedisServer::start().await.unwrap();
    let hook = WebhookServer::start(&redis.host_port(), &["--webhook-max-replicas", "100"], None)
        .await
        .unwrap();
    let client = http();
    // 9 allocated + the flags' buffer of 5.
    let fleet = status(10, 9);
    let typo = [("lastcall.dev/autoscaler-buffer", "lots")];
    assert_eq!(
        ask_fleet(&client, &hook.url(), NS, FLEET, fleet, &typo).await,
        (true, 14)
    );
    let below = [("lastcall.dev/autoscaler-max-replicas", "2")];
    assert_eq!(
        ask_fleet(&client, &hook.url(), NS, FLEET, fleet, &below).await,
        (true, 14)
    );
    let url = format!("{}?min=-1", hook.url());
    assert_eq!(
        ask_fleet(&client, &url, NS, FLEET, fleet, &[]).await,
        (true, 14)
    );
    // A good query still applies beside a bad annotation: buffer 2.
    let url = format!("{}?buffer=2", hook.url());
    assert_eq!(
        ask_fleet(&client, &url, NS, FLEET, fleet, &typo).await,
        (true, 11)
    );
    for (source, n) in [("annotation", 2.0), ("combination", 1.0), ("query", 1.0)] {
        assert_eq!(
            m(
                &hook,
                "lastcall_pubsub_webhook_bad_overrides_total",
                &[("source", source)]
            ),
            n,
            "{source}"
        );
    }
    assert_eq!(m(&hook, "lastcall_pubsub_webhook_rejected_total", &[]), 0.0);
}

#[tokio::test]
async fn fleet_annotations_and_query_parameters_override_the_flags() {
    let redis = RedisServer::start().await.unwrap();
    let hook = WebhookServer::start(&redis.host_port(), &["--webhook-max-replicas", "100"], None)
        .await
        .unwrap();
    let client = http();
    let fleet = status(10, 9);
    // 30% of the Fleet Ready: ceil(9 × 100 / 70) = 13.
    let pct = [
        ("lastcall.dev/autoscaler-buffer", "30%"),
        ("lastcall.dev/autoscaler-min-replicas", "1"),
    ];
    assert_eq!(
        ask_fleet(&client, &hook.url(), NS, FLEET, fleet, &pct).await,
        (true, 13)
    );
    // The query wins over the annotations: buffer 2, min 0, max 10.
    let url = format!("{}?buffer=2&min=0&max=10", hook.url());
    assert_eq!(
        ask_fleet(&client, &url, NS, FLEET, fleet, &pct).await,
        (false, 10)
    );
    // An override never raises the flags' max: it is a hard cap. Before, 104.
    let raise = [("lastcall.dev/autoscaler-max-replicas", "500")];
    assert_eq!(
        ask_fleet(&client, &hook.url(), NS, FLEET, status(100, 99), &raise).await,
        (false, 100)
    );
    let url = format!("{}?max=1000", hook.url());
    assert_eq!(
        ask_fleet(&client, &url, NS, FLEET, status(100, 99), &[]).await,
        (false, 100)
    );
    // Drain extra comes on top of an overridden buffer too.
    publish(&redis, &draining("node-a", now_ms(), &[(NS, FLEET, 6, 0)])).await;
    let url = format!("{}?buffer=10%25&min=2&max=100", hook.url());
    // ceil(9 × 100 / 90) = 10, + 6.
    assert_eq!(
        ask_fleet(&client, &url, NS, FLEET, fleet, &[]).await,
        (true, 16)
    );
}

#[tokio::test]
async fn https_answers_with_a_certificate_the_caller_trusts() {
    let redis = RedisServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let tls = generate_tls(dir.path(), "webhook").await.unwrap();
    let hook = WebhookServer::start(
        &redis.host_port(),
        &["--webhook-max-replicas", "100"],
        Some(&tls),
    )
    .await
    .unwrap();
    assert!(hook.url().starts_with("https://"));
    // As Agones with `caBundle`: trust exactly that CA.
    let ca = reqwest::Certificate::from_pem(&std::fs::read(&tls.ca_pem).unwrap()).unwrap();
    let client = reqwest::Client::builder()
        .tls_certs_only([ca])
        .timeout(AGONES_TIMEOUT)
        .build()
        .unwrap();
    publish(&redis, &draining("node-a", now_ms(), &[(NS, FLEET, 6, 0)])).await;
    assert_eq!(ask(&client, &hook.url(), status(10, 5)).await, (true, 16));
    // Several requests on one kept-alive connection.
    assert_eq!(ask(&client, &hook.url(), status(16, 5)).await, (false, 16));

    // A client that does not trust the CA is refused in the handshake; plain HTTP on the
    // HTTPS port gets no answer; the server keeps serving.
    let untrusting = reqwest::Client::builder()
        .timeout(AGONES_TIMEOUT)
        .build()
        .unwrap();
    assert!(untrusting.post(hook.url()).body("{}").send().await.is_err());
    let plain = hook.url().replace("https://", "http://");
    assert!(http().post(plain).body("{}").send().await.is_err());
    assert_eq!(ask(&client, &hook.url(), status(16, 5)).await, (false, 16));
}

#[tokio::test]
async fn every_webhook_metric_is_documented() {
    let redis = RedisServer::start().await.unwrap();
    let hook = WebhookServer::start(&redis.host_port(), &["--webhook-max-replicas", "100"], None)
        .await
        .unwrap();
    let client = http();
    publish(&redis, &draining("node-a", now_ms(), &[(NS, FLEET, 6, 0)])).await;
    ask(&client, &hook.url(), status(1, 0)).await;
    post(&client, &hook.url(), "{".into()).await;
    let text = hook.metrics_text();
    let docs = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/metrics.md"))
        .unwrap();
    let mut seen = 0;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("# TYPE lastcall_pubsub_webhook_") else {
            continue;
        };
        let mut parts = rest.split_whitespace();
        let (Some(family), Some(kind)) = (parts.next(), parts.next()) else {
            continue;
        };
        let name = format!(
            "lastcall_pubsub_webhook_{family}{}",
            if kind == "counter" { "_total" } else { "" }
        );
        assert!(
            docs.contains(&format!("| `{name}` |")),
            "docs/metrics.md does not describe {name}"
        );
        seen += 1;
    }
    assert!(seen >= 8, "{text}");
}

/// The real binary with a clean environment.
fn pubsub_command(bin: &std::path::Path, home: &std::path::Path) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(bin);
    cmd.env_clear()
        .env("HOME", home)
        .env("AWS_ACCESS_KEY_ID", "AKIDWEBHOOKTEST")
        .env("AWS_SECRET_ACCESS_KEY", "webhook-test-secret")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env("AWS_REGION", "us-west-2")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    cmd
}

#[tokio::test]
async fn binary_serves_the_webhook_and_refuses_bad_webhook_flags_in_one_line() {
    let bin = tokio::task::spawn_blocking(|| {
        lastcall_testkit::bins::workspace_binary("lastcall-pubsub", "lastcall-pubsub")
    })
    .await
    .unwrap();
    let home = tempfile::tempdir().unwrap();
    let tls = generate_tls(home.path(), "bin").await.unwrap();
    let cert = tls.cert_pem.to_str().unwrap();
    let cases: &[(&[&str], &str)] = &[
        (
            &["--webhook-listen", "127.0.0.1:8000"],
            "--webhook-max-replicas",
        ),
        (
            &[
                "--webhook-listen",
                "127.0.0.1:8000",
                "--webhook-max-replicas",
                "3",
            ],
            "--webhook-max-replicas",
        ),
        (&["--webhook-buffer", "200%"], "--webhook-buffer"),
        (
            &["--webhook-drain-state-max-age", "5s"],
            "--webhook-drain-state-max-age",
        ),
        (
            &[
                "--webhook-listen",
                "127.0.0.1:8000",
                "--webhook-max-replicas",
                "9",
                "--webhook-tls-cert",
                cert,
            ],
            "--webhook-tls-key",
        ),
    ];
    for (args, flag) in cases {
        let out = pubsub_command(&bin, home.path())
            .args(["--redis-url", "cache:6379"])
            .args(*args)
            .output()
            .await
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<_> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{args:?}: {stderr:?}");
        assert!(
            lines[0].contains(flag),
            "{args:?}: {stderr:?} does not name {flag}"
        );
    }
    let help = pubsub_command(&bin, home.path())
        .arg("--help")
        .output()
        .await
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--webhook-listen",
        "--webhook-tls-cert",
        "--webhook-tls-key",
        "--webhook-buffer",
        "--webhook-min-replicas",
        "--webhook-max-replicas",
        "--webhook-drain-state-max-age",
        "--webhook-redis-timeout",
        "LASTCALL_PUBSUB_WEBHOOK_LISTEN",
    ] {
        assert!(help.contains(flag), "--help does not document {flag}");
    }

    // Served over HTTPS by the binary, next to an admin port whose /metrics shows it.
    let redis = RedisServer::start().await.unwrap();
    // A Redis dated an hour ago: answers do not hold for a restart that did not happen
    // (the binary has no Kubernetes client here, so a held answer would be refused).
    let mut c = redis.client().await.unwrap();
    drain_state::mark_epoch_in(&mut c, drain_state::KEY, now_ms() - 3_600_000)
        .await
        .unwrap();
    let (admin, port) = (
        lastcall_testkit::net::free_port(),
        lastcall_testkit::net::free_port(),
    );
    let mut child = pubsub_command(&bin, home.path())
        .args([
            "--config-file",
            "/nonexistent/fleetiq.conf",
            "--period",
            "10s",
        ])
        .args(["--listen", &format!("127.0.0.1:{admin}")])
        .args(["--webhook-listen", &format!("127.0.0.1:{port}")])
        .args([
            "--webhook-max-replicas",
            "50",
            "--webhook-buffer",
            "10%",
            "--webhook-min-replicas",
            "2",
        ])
        .args([
            "--webhook-tls-cert",
            cert,
            "--webhook-tls-key",
            tls.key_pem.to_str().unwrap(),
        ])
        .env("REDIS_URL", redis.host_port())
        .env("AWS_ENDPOINT_URL_GAMELIFT", "http://127.0.0.1:9")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    publish(&redis, &draining("node-a", now_ms(), &[(NS, FLEET, 6, 0)])).await;
    let ca = reqwest::Certificate::from_pem(&std::fs::read(&tls.ca_pem).unwrap()).unwrap();
    let client = reqwest::Client::builder()
        .tls_certs_only([ca])
        .timeout(AGONES_TIMEOUT)
        .build()
        .unwrap();
    let url = format!("https://127.0.0.1:{port}/scale");
    let body = wait_for("the binary's webhook answers", || async {
        let r = client
            .post(&url)
            .body(agones_review("bin-uid", NS, FLEET, status(20, 18), &[]))
            .send()
            .await
            .ok()?;
        (r.status() == 200).then_some(())?;
        r.text().await.ok()
    })
    .await;
    // ceil(18 × 100 / 90) = 20, + 6 Ready on the draining node.
    assert_eq!(
        parse_response(body.as_bytes()),
        Some(("bin-uid".into(), true, 26))
    );
    let metrics = reqwest::get(format!("http://127.0.0.1:{admin}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(
        metric_sum(
            &metrics,
            "lastcall_pubsub_webhook_requests_total",
            &[("result", "scale_up")]
        ),
        1.0,
        "{metrics}"
    );

    let pid = child.id().unwrap().to_string();
    let kill = tokio::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await
        .unwrap();
    assert!(kill.success());
    let status = lastcall_testkit::eventually::eventually(
        "exit after SIGTERM",
        Duration::from_secs(10),
        Duration::from_millis(20),
        || {
            let status = child.try_wait().unwrap();
            async move { status }
        },
    )
    .await;
    assert_eq!(status.code(), Some(0), "clean exit on SIGTERM");
}

// ---------------------------------------------------------------------------------------
// The full loop: GameServerSet replacement, a FleetAutoscaler on its sync period, a drain
// ---------------------------------------------------------------------------------------

mod full_loop {
    use super::*;
    use kube::api::{Api, DeleteParams, DynamicObject, Preconditions};
    use lastcall_testkit::cluster::allocator::gameserver_resource;
    use lastcall_testkit::cluster::fleet_autoscaler::FleetAutoscaler;
    use lastcall_testkit::cluster::{
        AllocationRequest, Cluster, ClusterConfig, FleetSpec, GameServerState, NodeSpec,
    };
    use lastcall_testkit::kube::resources::GAMESERVERS;
    use lastcall_testkit::kube::store::EventKind;
    use tokio_util::sync::CancellationToken;

    const LOOP_FLEET: &str = "arena";
    const READY: usize = 6;
    const ALLOCATED: usize = 2;
    const SYNC: Duration = Duration::from_millis(200);

    /// What the draining node's agent writes for the Fleet.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Contract {
        /// What agents publish today: Ready servers not being deleted, in-use servers.
        ReadyOnly,
        /// Also `held` (Ready servers kept, not released) and `at_risk` (in use, with a
        /// deadline): here the agent releases every Ready server at once and the drain
        /// has no deadline, so both are 0.
        HeldAndAtRisk,
    }

    fn state(contract: Contract, ready: u32) -> NodeDrainState {
        let (held, at_risk) = match contract {
            Contract::ReadyOnly => (None, None),
            Contract::HeldAndAtRisk => (Some(0), Some(0)),
        };
        NodeDrainState {
            node: "n1".into(),
            updated_at_ms: now_ms(),
            counted_at_ms: None,
            truncated: false,
            fleets: vec![FleetOnNode {
                namespace: NS.into(),
                name: LOOP_FLEET.into(),
                ready,
                allocated: ALLOCATED as u32,
                held,
                at_risk,
            }],
        }
    }

    /// Servers created beyond need when node n1, holding `READY` Ready and `ALLOCATED`
    /// Allocated servers of a Fleet sized by the webhook (buffer `READY`), drains while a
    /// FleetAutoscaler syncs every `SYNC`: the agent fences, publishes its drain state, an
    /// autoscaler sync lands, the agent releases the Ready servers (guarded deletes) and
    /// publishes again. The need is `READY` replacements.
    pub async fn overshoot(contract: Contract) -> usize {
        let redis = RedisServer::start().await.unwrap();
        let hook = WebhookServer::start(
            &redis.host_port(),
            &[
                "--webhook-buffer",
                &READY.to_string(),
                "--webhook-max-replicas",
                "100",
            ],
            None,
        )
        .await
        .unwrap();
        let cluster = Cluster::start(ClusterConfig::default()).await.unwrap();
        cluster.add_node(NodeSpec::new("n1")).unwrap();
        let size = READY + ALLOCATED;
        cluster
            .create_fleet(FleetSpec::new(LOOP_FLEET, size as i64).grace_seconds(0))
            .unwrap();
        cluster.wait_ready(NS, LOOP_FLEET, size).await.unwrap();
        for _ in 0..ALLOCATED {
            let got = cluster
                .allocate(&AllocationRequest::fleet(NS, LOOP_FLEET))
                .await
                .unwrap();
            assert!(got.is_some(), "allocated");
        }
        cluster.add_node(NodeSpec::new("n2")).unwrap();
        let fa = FleetAutoscaler::new(NS, LOOP_FLEET, &hook.url());
        let stop = CancellationToken::new();
        let mut redis_conn = redis.client().await.unwrap();

        let scenario = async {
            // Settled: the autoscaler answers the size the Fleet has.
            wait_for("a sync that leaves the Fleet as it is", || async {
                fa.journal()
                    .last()
                    .is_some_and(|s| {
                        matches!(
                            s,
                            lastcall_testkit::cluster::fleet_autoscaler::Sync::Unchanged { .. }
                        )
                    })
                    .then_some(())
            })
            .await;
            let rv0 = cluster.store().resource_version();

            // The agent fences and publishes; one autoscaler sync lands before it releases.
            cluster.set_unschedulable("n1", true).unwrap();
            drain_state::publish(&mut redis_conn, &state(contract, READY as u32))
                .await
                .unwrap();
            let syncs = fa.journal().len();
            wait_for("an autoscaler sync after the fence", || async {
                (fa.journal().len() > syncs).then_some(())
            })
            .await;

            // The agent releases every Ready server on n1, guarded as it does.
            let api: Api<DynamicObject> =
                Api::namespaced_with(cluster.client(), NS, &gameserver_resource());
            let ready_here: Vec<_> = cluster
                .fleet_game_servers(NS, LOOP_FLEET)
                .into_iter()
                .filter(|g| {
                    g.node.as_deref() == Some("n1") && g.state == Some(GameServerState::Ready)
                })
                .collect();
            assert_eq!(ready_here.len(), READY);
            for gs in &ready_here {
                let dp = DeleteParams {
                    preconditions: Some(Preconditions {
                        uid: Some(gs.uid.clone()),
                        resource_version: Some(gs.resource_version.clone()),
                    }),
                    ..Default::default()
                };
                api.delete(&gs.name, &dp).await.unwrap();
            }
            // It sees them leave and publishes again: nothing Ready is left on n1.
            cluster
                .wait_until(
                    "the released servers are gone",
                    Duration::from_secs(20),
                    |c| {
                        (!c.fleet_game_servers(NS, LOOP_FLEET)
                            .iter()
                            .any(|g| ready_here.iter().any(|r| r.name == g.name)))
                        .then_some(())
                    },
                )
                .await
                .unwrap();
            drain_state::publish(&mut redis_conn, &state(contract, 0))
                .await
                .unwrap();

            // Settled again: the Fleet is back at its size, READY of them Ready on n2.
            let syncs = fa.journal().len();
            cluster
                .wait_until("the Fleet settles", Duration::from_secs(30), |c| {
                    let status = c.fleet_status(NS, LOOP_FLEET)?;
                    let servers = c.fleet_game_servers(NS, LOOP_FLEET);
                    let on_n2 = servers
                        .iter()
                        .filter(|g| {
                            g.node.as_deref() == Some("n2")
                                && g.state == Some(GameServerState::Ready)
                        })
                        .count();
                    (fa.journal().len() > syncs + 1
                        && status.replicas == size as i64
                        && servers.len() == size
                        && on_n2 == READY)
                        .then_some(())
                })
                .await
                .unwrap();
            let created = cluster
                .store()
                .events_since(rv0)
                .unwrap()
                .iter()
                .filter(|e| e.rt == GAMESERVERS && e.kind == EventKind::Added)
                .count();
            stop.cancel();
            created
        };
        let ((), created) = tokio::join!(fa.clone().run(&cluster, SYNC, stop.clone()), scenario);
        created.saturating_sub(READY)
    }

    /// What one policy cost when a node died with matches on it.
    #[derive(Clone, Copy, Debug)]
    pub struct DeathCost {
        /// GameServers created from the Spot notice until the Fleet settled, less the
        /// `READY` the settled Fleet needs (every server of the dead node is gone).
        pub beyond_need: usize,
        /// From the node's death until `spec.replicas` reached the settled size.
        pub cannot_shrink: Duration,
    }

    fn spec_replicas(cluster: &Cluster) -> i64 {
        cluster
            .store()
            .get(
                &lastcall_testkit::kube::resources::FLEETS,
                Some(NS),
                LOOP_FLEET,
            )
            .and_then(|f| {
                f.pointer("/spec/replicas")
                    .and_then(serde_json::Value::as_i64)
            })
            .unwrap_or(-1)
    }

    /// A Spot notice on n1 (`READY` Ready, `ALLOCATED` Allocated, buffer `READY`): the
    /// agent fences and publishes (held 0, at_risk `ALLOCATED`: a Terminate deadline), one
    /// sync lands, it releases the Ready servers and publishes again, one sync lands, then
    /// the node dies with its matches (its servers end, the Node is deleted; no agent
    /// clears the entry). `webhook`: the FleetAutoscaler calls the webhook that reads this
    /// drain state; otherwise a webhook on an empty key, which answers Agones' Buffer
    /// formula, on the very same drain.
    pub async fn node_death(webhook: bool) -> DeathCost {
        let redis = RedisServer::start().await.unwrap();
        let name = if webhook { "" } else { "buffer-only" };
        let hook = WebhookServer::start(
            &redis.host_port(),
            &[
                "--webhook-buffer",
                &READY.to_string(),
                "--webhook-max-replicas",
                "100",
                "--cluster-name",
                name,
            ],
            None,
        )
        .await
        .unwrap();
        let cluster = Cluster::start(ClusterConfig::default()).await.unwrap();
        hook.attach_kube(cluster.client());
        cluster.add_node(NodeSpec::new("n1")).unwrap();
        let size = READY + ALLOCATED;
        cluster
            .create_fleet(FleetSpec::new(LOOP_FLEET, size as i64).grace_seconds(0))
            .unwrap();
        cluster.wait_ready(NS, LOOP_FLEET, size).await.unwrap();
        for _ in 0..ALLOCATED {
            let got = cluster
                .allocate(&AllocationRequest::fleet(NS, LOOP_FLEET))
                .await
                .unwrap();
            assert!(got.is_some(), "allocated");
        }
        cluster.add_node(NodeSpec::new("n2")).unwrap();
        let fa = FleetAutoscaler::new(NS, LOOP_FLEET, &hook.url());
        let stop = CancellationToken::new();
        let mut redis_conn = redis.client().await.unwrap();
        let entry = |ready: u32| NodeDrainState {
            fleets: vec![FleetOnNode {
                held: Some(0),
                at_risk: Some(ALLOCATED as u32),
                ..state(Contract::HeldAndAtRisk, ready).fleets[0].clone()
            }],
            ..state(Contract::HeldAndAtRisk, ready)
        };
        let one_sync = |fa: &FleetAutoscaler| {
            let n = fa.journal().len();
            let fa = fa.clone();
            async move {
                wait_for("an autoscaler sync", || async {
                    (fa.journal().len() > n).then_some(())
                })
                .await;
            }
        };

        let scenario = async {
            wait_for("a sync that leaves the Fleet as it is", || async {
                fa.journal()
                    .last()
                    .is_some_and(|s| {
                        matches!(
                            s,
                            lastcall_testkit::cluster::fleet_autoscaler::Sync::Unchanged { .. }
                        )
                    })
                    .then_some(())
            })
            .await;
            let rv0 = cluster.store().resource_version();
            cluster.set_unschedulable("n1", true).unwrap();
            drain_state::publish(&mut redis_conn, &entry(READY as u32))
                .await
                .unwrap();
            one_sync(&fa).await;
            let api: Api<DynamicObject> =
                Api::namespaced_with(cluster.client(), NS, &gameserver_resource());
            let on_n1 = |state: GameServerState| {
                cluster
                    .fleet_game_servers(NS, LOOP_FLEET)
                    .into_iter()
                    .filter(move |g| g.node.as_deref() == Some("n1") && g.state == Some(state))
                    .collect::<Vec<_>>()
            };
            let ready_here = on_n1(GameServerState::Ready);
            for gs in &ready_here {
                let dp = DeleteParams {
                    preconditions: Some(Preconditions {
                        uid: Some(gs.uid.clone()),
                        resource_version: Some(gs.resource_version.clone()),
                    }),
                    ..Default::default()
                };
                api.delete(&gs.name, &dp).await.unwrap();
            }
            drain_state::publish(&mut redis_conn, &entry(0))
                .await
                .unwrap();
            one_sync(&fa).await;

            // The VM goes with its matches: the servers end, the Node is deleted.
            for gs in on_n1(GameServerState::Allocated) {
                cluster.sdk_shutdown(NS, &gs.name).unwrap();
            }
            cluster.remove_node("n1").unwrap();
            let died = tokio::time::Instant::now();
            let settled = READY as i64;
            cluster
                .wait_until(
                    "the Fleet shrinks to its need",
                    Duration::from_secs(60),
                    |c| (spec_replicas(c) == settled).then_some(()),
                )
                .await
                .unwrap();
            let cannot_shrink = died.elapsed();
            cluster
                .wait_until("the Fleet settles", Duration::from_secs(30), |c| {
                    let servers = c.fleet_game_servers(NS, LOOP_FLEET);
                    (servers.len() == READY
                        && servers
                            .iter()
                            .all(|g| g.state == Some(GameServerState::Ready)))
                    .then_some(())
                })
                .await
                .unwrap();
            let created = cluster
                .store()
                .events_since(rv0)
                .unwrap()
                .iter()
                .filter(|e| e.rt == GAMESERVERS && e.kind == EventKind::Added)
                .count();
            stop.cancel();
            DeathCost {
                beyond_need: created.saturating_sub(READY),
                cannot_shrink,
            }
        };
        let ((), cost) = tokio::join!(fa.clone().run(&cluster, SYNC, stop.clone()), scenario);
        cost
    }
}

/// The full loop: a node drains while a FleetAutoscaler syncs against the webhook and the
/// Fleet's GameServerSet replaces what is deleted. The released Ready servers are replaced
/// by the set at once, so the webhook must not count them too: with `held`/`at_risk` in
/// the drain state, no server is created beyond need. Before (the webhook counted every
/// Ready server on the node), a sync between the fence and the release created the
/// released servers' replacements twice: 6 beyond need, scaled down at the next sync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_creates_only_the_replacements_it_needs() {
    let after = full_loop::overshoot(full_loop::Contract::HeldAndAtRisk).await;
    let before = full_loop::overshoot(full_loop::Contract::ReadyOnly).await;
    println!("servers created beyond need: ready-only contract {before}, held/at_risk {after}");
    assert_eq!(after, 0, "no server beyond the {} replacements", 6);
    assert_eq!(
        before, 6,
        "an older agent's entry still counts its Ready servers"
    );
}

/// A node dies with matches on it (a Spot reclaim after its notice), once with the webhook
/// and once with Agones' Buffer formula (the same webhook on an empty key), on the same
/// drain: servers created beyond need, and how long after the death the Fleet could not
/// shrink to its need. The webhook must not be worse than Buffer by more than the
/// replacements it deliberately asked for ahead of the deadline (`at_risk`), and the dead
/// Node's entry must stop counting once the API server has no such Node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_dying_with_matches_costs_no_more_than_buffer_beyond_its_early_replacements() {
    let hook = full_loop::node_death(true).await;
    let buffer = full_loop::node_death(false).await;
    let ratio = |a: f64, b: f64| if b == 0.0 { f64::NAN } else { a / b };
    println!(
        "node death with matches: servers beyond need webhook {} / Buffer {} (ratio {:.2}); cannot shrink for webhook {:.2} s / Buffer {:.2} s (ratio {:.2})",
        hook.beyond_need,
        buffer.beyond_need,
        ratio(hook.beyond_need as f64, buffer.beyond_need as f64),
        hook.cannot_shrink.as_secs_f64(),
        buffer.cannot_shrink.as_secs_f64(),
        ratio(
            hook.cannot_shrink.as_secs_f64(),
            buffer.cannot_shrink.as_secs_f64()
        ),
    );
    assert!(
        hook.beyond_need <= buffer.beyond_need + 2,
        "{hook:?} vs {buffer:?}"
    );
    // The Node read is cached 10 s; a dead Node's entry counts for nothing after that.
    assert!(
        hook.cannot_shrink < Duration::from_secs(15),
        "{hook:?} vs {buffer:?}"
    );
}

/// The webhook against a real Redis Cluster whose primary for the drain-state hash goes
/// silent (SIGSTOP: its address still accepts connections, nothing answers, as a VM that
/// froze or whose packets are blackholed) and is failed over to its replica. Connecting
/// through a silent node takes one to two timeouts (the slot map is asked of every known
/// node, each within the timeout); before, that connect ran inside each answer's own
/// timeout, was always cancelled, the node list was never refreshed, and every Fleet stayed
/// held until pubsub restarted. Now the connect runs in the background, within its own
/// bounds, and the answers read the drain state again once the replica is promoted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_webhook_reads_a_redis_cluster_again_after_its_primary_goes_silent_and_fails_over() {
    use lastcall_common::redis_conn;
    use lastcall_common::redis_url::RedisTarget;
    use lastcall_testkit::redis::RedisCluster;
    let cluster = RedisCluster::start(3, 1).await.unwrap();
    let ports = cluster.ports();
    let silent = cluster.primary_of(drain_state::KEY).await.unwrap();
    let url = cluster.url_through(&ports);
    let hook = WebhookServer::start(
        &url,
        &[
            "--webhook-max-replicas",
            "100",
            "--webhook-redis-timeout",
            "500ms",
        ],
        None,
    )
    .await
    .unwrap()
    .with_fleets(&[(NS, FLEET, 10)])
    .await
    .unwrap();
    hook.add_nodes(&["node-a"]).await.unwrap();
    let client = http();
    let target = RedisTarget::parse(&url).unwrap();
    let writer = redis_conn::any_client(&target, None).unwrap();
    let mut conn = redis_conn::connect_any(&writer, Duration::from_secs(5))
        .await
        .unwrap();
    drain_state::publish(
        &mut conn,
        &draining("node-a", now_ms(), &[(NS, FLEET, 6, 0)]),
    )
    .await
    .unwrap();
    wait_for("the webhook has connected to the cluster", || async {
        (ask(&client, &hook.url(), status(10, 5)).await == (true, 16)).then_some(())
    })
    .await;

    // The hash's primary freezes; its replica is elected after the node timeout (1 s).
    let mut node = cluster.node(silent).await.unwrap();
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut node)
        .await
        .unwrap();
    let pid = info
        .lines()
        .find_map(|l| l.strip_prefix("process_id:"))
        .unwrap()
        .trim()
        .to_string();
    let signal = |sig: &str| {
        let ok = std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig} {pid}");
    };
    signal("-STOP");
    // Held while the hash cannot be read (the Fleet's spec is 10: no scale-down, no guess).
    assert_eq!(ask(&client, &hook.url(), status(10, 5)).await, (false, 10));
    let others: Vec<u16> = ports.iter().copied().filter(|p| *p != silent).collect();
    let promoted = wait_for("another node is the hash's primary", || async {
        for port in &others {
            let Ok(mut c) = cluster.node(*port).await else {
                continue;
            };
            let slot: redis::RedisResult<u16> = redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(drain_state::KEY)
                .query_async(&mut c)
                .await;
            let Ok(slot) = slot else { continue };
            let Ok(nodes) = cluster.nodes_seen_by(*port).await else {
                continue;
            };
            let serving = nodes
                .iter()
                .find(|n| n.primary && n.slots.iter().any(|&(a, b)| a <= slot && slot <= b));
            if let Some(n) = serving.filter(|n| n.port != silent) {
                return Some(n.port);
            }
        }
        None
    })
    .await;
    // The webhook finds the new primary (the old one still silent): its read there dates
    // the hash on that server's run (a promoted replica may lack recent writes).
    let mut on_promoted = cluster.node(promoted).await.unwrap();
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut on_promoted)
        .await
        .unwrap();
    let run = info
        .lines()
        .find_map(|l| l.strip_prefix("run_id:"))
        .unwrap()
        .trim()
        .to_string();
    wait_for(
        "the webhook reads the hash on the promoted replica",
        || async {
            ask(&client, &hook.url(), status(10, 5)).await;
            let dated: Option<String> = redis::cmd("HGET")
                .arg(drain_state::KEY)
                .arg(drain_state::RUN_FIELD)
                .query_async(&mut cluster.node(promoted).await.ok()?)
                .await
                .ok()?;
            (dated.as_deref() == Some(run.as_str())).then_some(())
        },
    )
    .await;
    // The agent writes its entry again (every 30 s, on a new connection); once the settle
    // has passed (the epoch moved back here, as time would move it), it counts as before.
    let mut conn = redis_conn::connect_any(&writer, Duration::from_secs(5))
        .await
        .unwrap();
    drain_state::publish(
        &mut conn,
        &draining("node-a", now_ms(), &[(NS, FLEET, 6, 0)]),
    )
    .await
    .unwrap();
    let epoch: i64 = redis::cmd("HGET")
        .arg(drain_state::KEY)
        .arg(drain_state::EPOCH_FIELD)
        .query_async(&mut on_promoted)
        .await
        .unwrap();
    let _: i64 = redis::cmd("HSET")
        .arg(drain_state::KEY)
        .arg(drain_state::EPOCH_FIELD)
        .arg(epoch - drain_state::RESTART_SETTLE.as_millis() as i64)
        .query_async(&mut on_promoted)
        .await
        .unwrap();
    assert_eq!(ask(&client, &hook.url(), status(10, 5)).await, (true, 16));
    let text = hook.metrics_text();
    let connects = metric_sum(
        &text,
        "lastcall_pubsub_webhook_redis_connect_duration_seconds_count",
        &[],
    );
    assert!(
        metric_sum(
            &text,
            "lastcall_pubsub_webhook_redis_connects_total",
            &[("result", "ok")]
        ) >= 2.0,
        "a new connection after the failover: {text}"
    );
    // Each connect is bounded by its own timeouts: the slot map asked of every node at
    // once, then the connection (each at most two timeouts, 1 s here), whatever the
    // silent node does.
    assert_eq!(
        metric_sum(
            &text,
            "lastcall_pubsub_webhook_redis_connect_duration_seconds_bucket",
            &[("le", "2.048")]
        ),
        connects,
        "{text}"
    );
    signal("-CONT");
}

/// A Redis restored from an old snapshot (here: `SAVE`, then a drain starts, then the
/// server restarts and loads that snapshot) comes back with the drain-state hash *and its
/// epoch*: the drain that began after the snapshot is gone, and the hash reads like "that
/// node does not drain". Before, the next answer shrank the Fleet (21 to 15 here). The hash
/// also records the Redis server run that dated it: another run dates it again, and every
/// answer holds while the agents write again, as after a loss.
#[tokio::test]
async fn a_redis_restored_from_an_old_snapshot_holds_until_the_agents_have_written_again() {
    let mut redis = RedisServer::start().await.unwrap();
    let hook = WebhookServer::start(&redis.host_port(), &["--webhook-max-replicas", "100"], None)
        .await
        .unwrap()
        .with_fleets(&[(NS, FLEET, 21)])
        .await
        .unwrap();
    hook.add_nodes(&["node-a"]).await.unwrap();
    let client = http();
    // Settled: nothing drains, the Fleet shrinks to the buffer.
    assert_eq!(ask(&client, &hook.url(), status(20, 10)).await, (true, 15));
    let mut conn = redis.client().await.unwrap();
    let _: String = redis::cmd("SAVE").query_async(&mut conn).await.unwrap();
    publish(&redis, &draining("node-a", now_ms(), &[(NS, FLEET, 6, 0)])).await;
    assert_eq!(ask(&client, &hook.url(), status(21, 10)).await, (false, 21));

    // The server restarts from the snapshot: node-a's entry is gone, the epoch is not.
    redis.restart().await.unwrap();
    let mut conn = redis.client().await.unwrap();
    let restored: Vec<String> = redis::cmd("HKEYS")
        .arg(drain_state::KEY)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(
        restored.contains(&drain_state::EPOCH_FIELD.to_string())
            && !restored.contains(&"node-a".to_string()),
        "the snapshot has the epoch and not the drain: {restored:?}"
    );
    let reads = || {
        metric_sum(
            &hook.metrics_text(),
            "lastcall_pubsub_webhook_drain_state_reads_total",
            &[("result", "ok")],
        )
    };
    let before = reads();
    let last = wait_for("the webhook reads the restored Redis", || async {
        let answer = ask(&client, &hook.url(), status(21, 10)).await;
        (reads() > before).then_some(answer)
    })
    .await;
    assert_eq!(
        last,
        (false, 21),
        "held: not shrunk to 15 on the restored hash"
    );
    assert!(
        m(
            &hook,
            "lastcall_pubsub_webhook_held_total",
            &[("reason", "redis_restarted")]
        ) >= 1.0
    );
    assert_eq!(
        ask(&client, &hook.url(), status(10, 10)).await,
        (true, 21),
        "growth is still allowed (never below the Fleet's spec)"
    );
}

/// A held answer's floor is the Fleet's `spec.replicas`; when the webhook cannot know it
/// (here the API server restarts: its Fleet watch fails and must list again), it holds
/// rather than guesses: 503, and Agones keeps the Fleet exactly as it is. Before, a failed
/// Fleet read fell back to `status.replicas`: mid-rollout (spec 10, status 13 with the
/// surge) the answer was 13, which Agones writes into spec, and the ratchet returned.
#[tokio::test]
async fn a_held_answer_whose_fleet_size_is_unknown_is_refused_not_guessed() {
    let redis = RedisServer::start().await.unwrap();
    let hook = WebhookServer::start(&redis.host_port(), &["--webhook-max-replicas", "100"], None)
        .await
        .unwrap()
        .with_fleets(&[(NS, FLEET, 10)])
        .await
        .unwrap();
    hook.add_nodes(&["agent-down"]).await.unwrap();
    let client = http();
    // A stale entry names the Fleet: answers hold.
    publish(
        &redis,
        &draining("agent-down", now_ms() - 3 * 60_000, &[(NS, FLEET, 3, 0)]),
    )
    .await;
    let mid_rollout = status(13, 2);
    assert_eq!(ask(&client, &hook.url(), mid_rollout).await, (true, 10));

    // The API server restarts: the watch ends, requests get 503 for a while.
    let api = hook.kube().unwrap();
    api.restart(Duration::from_secs(3));
    let webhook = hook.pubsub.webhook().unwrap().clone();
    wait_for(
        "the webhook knows its Fleet cache is not current",
        || async {
            matches!(
                webhook.fleet_size(NS, FLEET),
                lastcall_pubsub::webhook::fleets::FleetSize::Unknown(_)
            )
            .then_some(())
        },
    )
    .await;
    let (code, body) = post(
        &client,
        &hook.url(),
        agones_review("u-unknown", NS, FLEET, mid_rollout, &[]),
    )
    .await;
    assert_eq!(code, 503, "held with no known floor is refused: {body}");
    assert!(body.contains("watch_failed"), "{body}");
    assert!(
        m(
            &hook,
            "lastcall_pubsub_webhook_requests_total",
            &[("result", "unavailable")]
        ) >= 1.0
    );
    // Listed again: held at the spec as before.
    hook.wait_fleet_listed(NS, FLEET).await;
    assert_eq!(ask(&client, &hook.url(), mid_rollout).await, (true, 10));
}
