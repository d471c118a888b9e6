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
