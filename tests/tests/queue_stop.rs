//! A console stop through the queue ends nothing before it must, judged by the kube
//! emulator's journal: an `EC2 Instance State-change Notification` `stopping`, then
//! `stopped`, put through moto's EventBridge rules in AWS's documented shape, for the
//! instance under a node that holds two matches, one of a Fleet with `eviction.safe: Always`
//! and one with `Never`.
//!
//! Truths from AWS's documentation ("StopInstances", Amazon EC2 API Reference; "Stop and
//! start Amazon EC2 instances", Amazon EC2 User Guide): a stop is not announced ahead; EC2
//! shuts the instance down, by default with a graceful operating-system shutdown (which a
//! caller may skip, `skipOsShutdown`, or cut short by forcing the stop), so its processes
//! are ended from `stopping` on, and `stopped` follows once it is off. So the machine's end is the `stopping` event's time:
//! not later, not moved later by `stopped`, and nothing is owed a longer notice. What
//! lastcall may end gracefully at that moment it ends then (the `Always` match); what it may
//! not (`Never`) it leaves to the shutdown, told the stop's time.

#[path = "support/passes.rs"]
mod passes;
use passes::after_passes;

use k8s_openapi::api::core::v1::Node;
use lastcall_common::aws_events::{ANNOTATION, Event, InstanceState, Record};
use lastcall_pubsub::queue::metrics::ReasonLabels;
use lastcall_testkit::agent::{InProcessAgent, config};
use lastcall_testkit::cluster::{
    AllocationRequest, Cluster, ClusterConfig, EvictionSafe, FleetSpec, NodeSpec,
};
use lastcall_testkit::eventually::wait_for;
use lastcall_testkit::kube::journal::JournalEntry;
use lastcall_testkit::promises::graceful::ends_a_match;
use lastcall_testkit::queue::{PUBSUB, QueueRig, RunningRelay, count, relay_args, set_provider_id};
use serde_json::json;

const I: &str = "i-0123456789abcdef0";

fn accepted(r: &JournalEntry) -> bool {
    (200..300).contains(&r.status)
}

fn relayed_write(r: &JournalEntry, state: &str) -> bool {
    r.identity.as_deref() == Some(PUBSUB)
        && r.verb.is_mutating()
        && r.resource.as_deref() == Some("nodes")
        && accepted(r)
        && r.request
            .as_ref()
            .is_some_and(|b| b.to_string().contains(state))
}

/// The time of the relayed state change to `state` on the Node.
async fn relayed_time(nodes: &kube::Api<Node>, state: InstanceState) -> Option<jiff::Timestamp> {
    let n = nodes.get("n1").await.ok()?;
    let raw = n.metadata.annotations.as_ref()?.get(ANNOTATION)?;
    let r = Record::parse(raw).ok()?;
    r.events
        .iter()
        .find(|e| e.event == Event::StateChange { state })
        .map(|e| e.time)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_console_stop_ends_what_may_end_at_the_stop_and_nothing_before_it() {
    let cluster = Cluster::start(ClusterConfig::default())
        .await
        .expect("cluster");
    cluster.add_node(NodeSpec::new("n1")).expect("n1");
    for (name, safe) in [
        ("never", EvictionSafe::Never),
        ("always", EvictionSafe::Always),
    ] {
        cluster
            .create_fleet(FleetSpec::new(name, 1).eviction_safe(safe).grace_seconds(2))
            .expect("fleet");
        cluster.wait_ready("default", name, 1).await.expect("ready");
        cluster
            .allocate(&AllocationRequest::fleet("default", name))
            .await
            .expect("allocate")
            .expect("an allocated server");
    }
    let server_of = |fleet: &str| {
        cluster
            .game_servers()
            .into_iter()
            .find(|g| g.labels.get("agones.dev/fleet").map(String::as_str) == Some(fleet))
            .expect("a server")
            .name
    };
    let (never, always) = (server_of("never"), server_of("always"));
    let admin = cluster.emulator().config_for("admin").await.expect("admin");
    set_provider_id(&admin, "n1", I).await;

    let rig = QueueRig::start().await.expect("moto");
    let relay = RunningRelay::start(
        &relay_args(&rig),
        cluster.emulator().config_for(PUBSUB).await.expect("client"),
    )
    .await
    .expect("relay");
    let agent = InProcessAgent::start(
        config("n1", &["--aws-queue", "--resync-interval", "1s"]),
        cluster
            .emulator()
            .config_for("agent-n1")
            .await
            .expect("client"),
        None,
    )
    .await
    .expect("agent");
    wait_for("claimed", || async {
        cluster
            .game_servers()
            .iter()
            .all(|g| g.labels.get("lastcall.dev/node").map(String::as_str) == Some("n1"))
            .then_some(())
    })
    .await;
    let ended = |server: &str| {
        cluster.emulator().journal().count(|e| {
            e.identity.as_deref() == Some("agent-n1")
                && ends_a_match(e)
                && accepted(e)
                && e.name.as_deref() == Some(server)
        }) > 0
    };

    // The console stop: `stopping` now.
    let state = |s: &str| json!({"instance-id": I, "state": s});
    rig.put(
        "aws.ec2",
        "EC2 Instance State-change Notification",
        state("stopping"),
        I,
    )
    .await;
    wait_for("the Always match ended at the stop", || async {
        ended(&always).then_some(())
    })
    .await;
    let nodes: kube::Api<Node> = kube::Api::all(cluster.client());
    let stop = relayed_time(&nodes, InstanceState::Stopping)
        .await
        .expect("the stop relayed onto the Node");

    // Then `stopped`, once the instance is off: in a later second than `stopping` (the
    // envelope's time has whole seconds), so that a rule taking the later time would show.
    wait_for("a second past the stop", || async {
        (jiff::Timestamp::now().as_second() > stop.as_second()).then_some(())
    })
    .await;
    rig.put(
        "aws.ec2",
        "EC2 Instance State-change Notification",
        state("stopped"),
        I,
    )
    .await;
    wait_for("both relayed and deleted", || async {
        (count(&relay.metrics.deleted, ReasonLabels { reason: "relayed" }) == 2
            && relayed_time(&nodes, InstanceState::Stopped).await.is_some())
        .then_some(())
    })
    .await;
    let stopped = relayed_time(&nodes, InstanceState::Stopped)
        .await
        .expect("stopped relayed");
    assert!(stopped > stop, "stopped {stopped} after stopping {stop}");
    // The agent's chance to do anything more about it.
    after_passes(&agent, 2).await;

    let journal = cluster.emulator().journal().entries();
    let relayed = journal
        .iter()
        .find(|r| relayed_write(r, "stopping"))
        .expect("pubsub relayed the stop")
        .seq;
    let fenced = journal
        .iter()
        .find(|r| {
            r.identity.as_deref() == Some("agent-n1")
                && r.resource.as_deref() == Some("nodes")
                && accepted(r)
                && r.response
                    .as_ref()
                    .and_then(|b| b.pointer("/spec/unschedulable"))
                    == Some(&json!(true))
        })
        .expect("the agent fenced n1")
        .seq;
    let always_ended = journal
        .iter()
        .find(|e| {
            e.identity.as_deref() == Some("agent-n1")
                && ends_a_match(e)
                && accepted(e)
                && e.name.as_deref() == Some(always.as_str())
        })
        .expect("the Always match ended")
        .seq;
    assert!(
        relayed < fenced && fenced < always_ended,
        "relay {relayed}, fence {fenced}, the Always match's end {always_ended}"
    );
    // Nothing before the stop: no match was ended before pubsub relayed it.
    assert!(
        !journal.iter().any(|e| e.seq < relayed
            && e.identity.as_deref() == Some("agent-n1")
            && ends_a_match(e)),
        "a match ended before the stop was relayed"
    );
    // The `Never` match is left to the shutdown: never ended by lastcall, told the stop's
    // time, and `stopped` (later) did not move it.
    assert!(!ended(&never), "the Never match was ended by lastcall");
    let g = cluster
        .game_servers()
        .into_iter()
        .find(|g| g.name == never)
        .expect("the Never server");
    let told: jiff::Timestamp = g
        .annotations
        .get("lastcall.dev/drain-deadline")
        .expect("the Never match told its deadline")
        .parse()
        .expect("an RFC 3339 deadline");
    assert_eq!(told, stop, "the machine's end is the stop's time");
    assert!(!g.deleting, "the Never server deleted");

    agent.stop().await.expect("clean stop");
    relay.stop().await;
    cluster.shutdown().await;
}
