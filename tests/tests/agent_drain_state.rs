//! The FleetAutoscaler webhook end to end with a real agent: a node draining with 6 Ready
//! servers of a Fleet held there (release pacing keeps them until replacements exist) makes
//! the webhook ask for exactly 6 more replicas than the plain buffer; when the drain is
//! cancelled the agent clears its drain state and the answer is the plain buffer again.

use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};
use lastcall_pubsub::webhook::review::parse_response;
use lastcall_testkit::agent::metric;
use lastcall_testkit::eventually::eventually;
use lastcall_testkit::webhook::{FleetStatus, WebhookServer, agones_review};
use lastcall_testkit::world::{NS, World, WorldSpec};

async fn ask(client: &reqwest::Client, url: &str) -> i64 {
    let body = agones_review(
        "uid-1",
        NS,
        "fleet",
        FleetStatus {
            replicas: 8,
            ready: 6,
            reserved: 0,
            allocated: 2,
        },
        &[],
    );
    let r = client
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("an answer");
    assert_eq!(r.status().as_u16(), 200);
    let text = r.text().await.expect("body");
    let (uid, _, replicas) = parse_response(text.as_bytes()).expect("a review response");
    assert_eq!(uid, "uid-1");
    replicas
}

async fn label(w: &World, value: Option<&str>) {
    Api::<Node>::all(w.cluster.client())
        .patch(
            "n1",
            &PatchParams::default(),
            &Patch::Merge(
                &serde_json::json!({"metadata": {"labels": {"lastcall.dev/drain": value}}}),
            ),
        )
        .await
        .expect("label");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_node_asks_the_webhook_for_its_ready_servers() {
    // 6 Ready and 2 Allocated servers of one Fleet, all on n1; no other node, so a floor of
    // 6 Ready holds every idle server on the draining node.
    let w = World::start(WorldSpec::new(6, 2, 0)).await;
    let hook = WebhookServer::start(
        &w.redis.host_port(),
        &["--webhook-max-replicas", "100"],
        None,
    )
    .await
    .expect("webhook");
    let url = w.redis.url();
    let agent = w
        .start_agent(&[
            "--redis-url".into(),
            url,
            "--publish-drain-state".into(),
            "--release-floor".into(),
            "6".into(),
        ])
        .await;
    w.claimed_all().await;
    let client = reqwest::Client::new();
    let plain = ask(&client, &hook.url()).await;
    assert_eq!(plain, 2 + 5, "allocated + the default buffer of 5");

    label(&w, Some("true")).await;
    let during = eventually(
        "the webhook counts the draining node's Ready servers",
        Duration::from_secs(10),
        Duration::from_millis(20),
        || async {
            let r = ask(&client, &hook.url()).await;
            (r != plain).then_some(r)
        },
    )
    .await;
    assert_eq!(during, plain + 6, "exactly the 6 Ready servers held on n1");

    label(&w, None).await;
    eventually(
        "the drain state is cleared when the drain is cancelled",
        Duration::from_secs(10),
        Duration::from_millis(20),
        || async { (ask(&client, &hook.url()).await == plain).then_some(()) },
    )
    .await;
    let m = agent.metrics().await;
    assert!(
        metric(&m, "lastcall_drain_state_writes_total", &[("result", "ok")]).unwrap_or(0.0) >= 2.0,
        "published, then cleared"
    );
    agent.stop().await.expect("clean stop");
}

/// Every change Redis makes to the drain-state hash, from its keyspace notifications: the
/// command names (`hset`, `hdel`, `del`…), in order. Nothing but `hdel`/`del`/an expiry can
/// make a field absent, so a log without them proves the entry never was.
struct HashChanges {
    seen: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl HashChanges {
    async fn watch(redis: &lastcall_testkit::redis::RedisServer, key: &str) -> Self {
        use futures::StreamExt;
        let mut conn = redis.client().await.expect("redis");
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("notify-keyspace-events")
            .arg("Kgh")
            .query_async::<()>(&mut conn)
            .await
            .expect("keyspace notifications on");
        let client = redis::Client::open(redis.url()).expect("client");
        let mut pubsub = client.get_async_pubsub().await.expect("pubsub");
        pubsub
            .subscribe(format!("__keyspace@0__:{key}"))
            .await
            .expect("subscribe");
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = seen.clone();
        let task = tokio::spawn(async move {
            let mut stream = pubsub.into_on_message();
            while let Some(m) = stream.next().await {
                let event: String = m.get_payload().unwrap_or_default();
                log.lock().unwrap().push(event);
            }
        });
        HashChanges { seen, task }
    }

    fn events(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }
}

async fn entry(redis: &lastcall_testkit::redis::RedisServer) -> Option<String> {
    let mut conn = redis.client().await.expect("redis");
    redis::cmd("HGET")
        .arg(lastcall_common::drain_state::KEY)
        .arg("n1")
        .query_async(&mut conn)
        .await
        .expect("HGET")
}

/// An agent restarted mid-drain (a rollout, an OOM kill) must not clear its node's entry
/// before its first plan: between that clear and the next write the webhook would see no
/// drain and let the Fleet shrink by the servers still held on the node. The keyspace
/// notifications prove no `HDEL` (or `DEL`) touched the hash from the old agent's stop
/// until the new one has written its entry, so the field was never absent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_mid_drain_never_removes_its_entry() {
    let w = World::start(WorldSpec::new(6, 2, 0)).await;
    let args = vec![
        "--redis-url".to_string(),
        w.redis.url(),
        "--publish-drain-state".into(),
        "--release-floor".into(),
        "6".into(),
    ];
    let first = w.start_agent(&args).await;
    w.claimed_all().await;
    label(&w, Some("true")).await;
    eventually(
        "the first agent publishes the drain",
        Duration::from_secs(10),
        Duration::from_millis(20),
        || async { entry(&w.redis).await },
    )
    .await;
    let changes = HashChanges::watch(&w.redis, lastcall_common::drain_state::KEY).await;
    first.stop().await.expect("clean stop");
    assert!(entry(&w.redis).await.is_some(), "stopping leaves the entry");

    let second = w.start_agent(&args).await;
    eventually(
        "the restarted agent writes its entry",
        Duration::from_secs(10),
        Duration::from_millis(20),
        || async {
            let m = second.metrics().await;
            let ok = metric(&m, "lastcall_drain_state_writes_total", &[("result", "ok")]);
            (ok.unwrap_or(0.0) >= 1.0).then_some(())
        },
    )
    .await;
    // The notification of that write, and of anything before it, has arrived.
    eventually(
        "the restarted agent's write is seen",
        Duration::from_secs(5),
        Duration::from_millis(20),
        || async { changes.events().iter().any(|e| e == "hset").then_some(()) },
    )
    .await;
    let events = changes.events();
    assert!(
        !events
            .iter()
            .any(|e| e == "hdel" || e == "del" || e == "expired"),
        "the entry was removed during the restart: {events:?}"
    );
    let state = lastcall_common::drain_state::NodeDrainState::parse(
        b"n1",
        entry(&w.redis).await.expect("the entry").as_bytes(),
    )
    .expect("a valid entry");
    assert_eq!(state.fleets.len(), 1);
    assert_eq!(state.fleets[0].held, Some(6), "still held on n1");
    let counted = state.counted_at_ms.expect("the counts are dated");
    assert!(
        counted <= state.updated_at_ms && state.updated_at_ms - counted < 10_000,
        "counted at {counted}, written at {}",
        state.updated_at_ms
    );
    changes.task.abort();
    second.stop().await.expect("clean stop");
}
