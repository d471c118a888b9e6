//! The scale bench's promises on a reduced world (100 agents by default, which keeps the
//! test near a minute in CI; `LASTCALL_SCALE_AGENTS=200` or more to change): in-process agents built as the binary builds them,
//! each with its own identity and filtered watches, on a store-only emulator in its own
//! process, under kubelet, pod-churn and Agones background load.
//!
//! - steady state: no agent makes a Kubernetes request (other than resuming a watch the
//!   server ended after its timeout);
//! - 10% and then another 50% of the nodes doomed by FleetIQ within one second while
//!   allocators run with the exclusion selector: every drain completes (deregistered), no
//!   agent deletes an allocated server, and no allocation succeeds on a doomed node after
//!   its agent's first round of releases past the fence (by the emulator's journal);
//! - the API server restarts (watches end, 5 s of 503s, the watch history gone): every
//!   agent lists each kind it watches again and resumes its watch, and none writes
//!   anything; the drains above run after it, on the watches it re-made;
//! - all of it through a tight API Priority and Fairness level (150 requests/s, 4 waiting
//!   per user), so agents queue, are refused with 429 and `Retry-After`, and retry;
//! - on a Redis Cluster (60 agents), subscriptions spread over its nodes and a 10% drain
//!   published through the cluster completes.
//!
//! The figures at 2,000 agents are the bench's: `cargo bench -p lastcall-testkit --bench scale`.

use std::time::Duration;

use lastcall_testkit::scale::{ApfOptions, ScaleSpec, ScaleWorld};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scale_promises_hold() {
    let mut spec = ScaleSpec::from_env(100);
    spec.unfiltered_sample = 0;
    spec.apf = Some(ApfOptions {
        queue_per_flow: 4,
        ..ApfOptions::workload_low(150.0)
    });
    let n = spec.agents;
    let world = ScaleWorld::start(spec).await.expect("scale world");
    eprintln!("setup: {:?}", world.setup);

    let steady = world
        .steady(Duration::from_secs(12))
        .await
        .expect("steady window");
    eprintln!(
        "steady 12 s: agents {:?}, everyone {:?}, background {:?}",
        steady.agents, steady.all, steady.by_identity
    );
    // The only requests allowed: a watch the server ended (kube asks for 290 s) resumed.
    assert!(
        steady.agent_other_requests.is_empty(),
        "agents made Kubernetes requests in steady state: {:?}",
        steady.agent_other_requests
    );
    assert_eq!(steady.agents.requests, steady.agent_watch_renewals);
    assert!(
        steady
            .by_identity
            .get("kubelet")
            .is_some_and(|t| t.requests > 0),
        "the kubelet load ran"
    );

    // The API server restarts; the drains below run on the watches the agents re-made.
    let r = world
        .restart_api(Duration::from_secs(5), Duration::from_secs(300))
        .await
        .expect("every agent lists again and resumes its watches");
    eprintln!(
        "restart: {} re-lists, {} resumed without one, last re-list {:?} and watch {:?} after the server was up, max {} LISTs per agent, {:?} of agent traffic, peak {} LISTs/s, 429s {} (agents {}), by kind {:?}",
        r.list_after_up.len(),
        r.resumed_without_list,
        r.last_list,
        r.last_watch,
        r.lists_per_agent_max,
        r.agent_traffic,
        r.peak_lists_per_s,
        r.status_429,
        r.agent_429,
        r.by_kind
    );
    assert!(
        r.agent_writes.is_empty(),
        "agents wrote because the API server restarted: {:?}",
        r.agent_writes
    );
    assert_eq!(
        r.list_after_up.len() + r.resumed_without_list,
        3 * n,
        "every agent watch listed again, or resumed from a resourceVersion still served"
    );
    assert!(
        r.list_after_up.len() >= 3 * n * 9 / 10,
        "most watches were answered 410 and listed again (the premise): {} of {}",
        r.list_after_up.len(),
        3 * n
    );

    let tenth: Vec<usize> = (0..n).filter(|i| i % 10 == 0).collect();
    let half: Vec<usize> = (0..n).filter(|i| (1..=5).contains(&(i % 10))).collect();
    let mut refused = 0;
    for (name, doomed) in [("10%", tenth), ("50%", half)] {
        let r = world
            .drain(doomed.clone(), Duration::from_secs(1))
            .await
            .unwrap_or_else(|e| panic!("{name} drain: {e:#}"));
        eprintln!(
            "{name}: {} doomed, fenced after {:?}, done after {:?}, last fence {:?}, {} allocations ({} after a fence), {} requests (agents {}), peak {} req/s, events {}, 429s {} (agents {}), queued {}",
            r.doomed,
            r.fenced_after,
            r.done_after,
            r.last_fence,
            r.allocations,
            r.allocations_after_fence,
            r.requests,
            r.agent_requests,
            r.peak_rps,
            r.event_writes,
            r.status_429,
            r.agent_429,
            r.apf_queued
        );
        eprintln!(
            "{name}: agent requests by kind {:?}",
            r.agent_requests_by_kind
        );
        refused += r.agent_429;
        let broken = r.broken_promises();
        assert!(broken.is_empty(), "{name}: {}", broken.join("; "));
        assert!(r.allocations > 0, "{name}: the allocators ran");
    }
    // Every drain above completed although agents were refused on the way.
    assert!(
        refused > 0,
        "the priority level never refused an agent: the test did not exercise 429s"
    );
    world.shutdown().await;
}

/// The same promises with the agents on a Redis Cluster (three primaries, a replica each),
/// given every node in one URL as a chart user would: their subscriptions spread over the
/// nodes (no node carries more than twice its even share), and a 10% drain published
/// through the cluster completes with nothing killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_redis_cluster_subscriptions_spread_and_drains_complete() {
    let mut spec = ScaleSpec::from_env(60);
    spec.unfiltered_sample = 0;
    spec.redis_cluster = Some((3, 1));
    let n = spec.agents;
    let world = ScaleWorld::start(spec).await.expect("scale world");
    let info = world.redis.info().await.expect("INFO");
    let per_node: Vec<f64> = info
        .nodes
        .iter()
        .map(|(_, i)| i.get("pubsub_channels").copied().unwrap_or(0.0))
        .collect();
    eprintln!("subscriptions per node: {per_node:?}");
    assert_eq!(per_node.iter().sum::<f64>() as usize, n, "one per agent");
    let even = n as f64 / per_node.len() as f64;
    assert!(
        per_node.iter().all(|&c| c <= 2.0 * even),
        "subscriptions not spread over the cluster's nodes: {per_node:?}"
    );
    let tenth: Vec<usize> = (0..n).filter(|i| i % 10 == 0).collect();
    let r = world
        .drain(tenth.clone(), Duration::from_secs(1))
        .await
        .expect("10% drain");
    let broken = r.broken_promises();
    assert!(broken.is_empty(), "{}", broken.join("; "));
    world.shutdown().await;
}
