//! Queue mode end to end, against a real SQS- and EventBridge-compatible server (moto): the
//! documented EventBridge rules feed a queue, events in the documented shapes are put
//! through them, pubsub's queue consumer relays each onto its Node, and a real agent
//! (in-process, built as the binary) drains. Every order is the kube emulator's journal.
//!
//! Truths from AWS's documentation: a Spot warning comes two minutes before the
//! interruption; a Health scheduled change's `startTime` is the start of its window.

use lastcall_common::aws_events::{ANNOTATION, Record};
use lastcall_emulators::kube::faults::FaultRule;
use lastcall_pubsub::queue::metrics::{KindLabels, OperationLabels, ReasonLabels};
use lastcall_testkit::eventually::wait_for;
use lastcall_testkit::kube::journal::JournalEntry;
use lastcall_testkit::queue::{
    PUBSUB, QueueRig, RunningRelay, count, relay_args, set_provider_id, spot_envelope,
};
use lastcall_testkit::world::{World, WorldSpec, annotation, cordoned, has_taint};
use serde_json::json;

const I1: &str = "i-0123456789abcdef0";
const I2: &str = "i-0aaaaaaaaaaaaaaa2";
const NOBODY: &str = "i-0eeeeeeeeeeeeeee0";

fn queue_agent_args() -> Vec<String> {
    ["--aws-queue", "--resync-interval", "1s"]
        .map(String::from)
        .to_vec()
}

fn is_pubsub_node_write(r: &JournalEntry, node: &str) -> bool {
    r.identity.as_deref() == Some(PUBSUB)
        && r.verb.is_mutating()
        && r.resource.as_deref() == Some("nodes")
        && r.name.as_deref() == Some(node)
}

fn accepted(r: &JournalEntry) -> bool {
    (200..300).contains(&r.status)
}

async fn relay_for(w: &World, rig: &QueueRig) -> RunningRelay {
    let kube = w
        .cluster
        .emulator()
        .config_for(PUBSUB)
        .await
        .expect("client");
    RunningRelay::start(&relay_args(rig), kube)
        .await
        .expect("relay")
}

async fn admin(w: &World) -> kube::Config {
    w.cluster
        .emulator()
        .config_for("admin")
        .await
        .expect("admin")
}

fn record_on(n: &k8s_openapi::api::core::v1::Node) -> Option<Record> {
    annotation(n, ANNOTATION).map(|raw| Record::parse(&raw).expect("a readable record"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spot_warning_through_eventbridge_fences_the_node_and_protects_its_match() {
    let w = World::start(WorldSpec::new(2, 1, 0)).await;
    set_provider_id(&admin(&w).await, "n1", I1).await;
    let rig = QueueRig::start().await.expect("moto");
    let relay = relay_for(&w, &rig).await;
    let agent = w.start_agent(&queue_agent_args()).await;
    w.agent_sees_all(&agent).await;
    let allocated = w.allocated();
    assert!(!cordoned(&w.node().await), "nothing said yet");

    rig.spot(I1, "terminate").await;
    w.fenced_and_released(&allocated).await;
    let n = w.node().await;
    let taint = n
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .and_then(|t| t.iter().find(|t| t.key == "lastcall.dev/draining"))
        .and_then(|t| t.value.clone());
    assert_eq!(taint.as_deref(), Some("aws_queue"));
    assert_eq!(
        annotation(&n, "lastcall.dev/drain-cause").as_deref(),
        Some("preemption")
    );

    // The deadline games are told is two minutes after the event.
    let record = record_on(&n).expect("the relayed record");
    assert_eq!(record.events.len(), 1);
    let event_time = record.events[0].time;
    let kept = w
        .on("n1")
        .into_iter()
        .find(|g| g.uid == allocated.uid)
        .expect("the match is still there");
    let deadline: jiff::Timestamp = kept.annotations["lastcall.dev/drain-deadline"]
        .parse()
        .expect("an RFC 3339 deadline");
    assert_eq!(deadline, event_time + jiff::SignedDuration::from_secs(120));

    // Ordered by the journal: pubsub's relay, then the agent's fence.
    let journal = w.cluster.emulator().journal().entries();
    let relayed = journal
        .iter()
        .find(|r| is_pubsub_node_write(r, "n1") && accepted(r))
        .expect("pubsub wrote the Node")
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
        .expect("the agent fenced")
        .seq;
    assert!(relayed < fenced, "relay {relayed} before fence {fenced}");
    // pubsub wrote one annotation and nothing else.
    let writes: Vec<&JournalEntry> = journal
        .iter()
        .filter(|r| r.identity.as_deref() == Some(PUBSUB) && r.verb.is_mutating())
        .collect();
    assert_eq!(writes.len(), 1, "{writes:?}");
    let ops = writes[0]
        .request
        .as_ref()
        .expect("the patch")
        .as_array()
        .expect("a JSON patch")
        .clone();
    assert_eq!(ops[0]["op"], "test", "guarded by the resourceVersion read");
    assert!(ops[1..].iter().all(|op| {
        op["path"]
            .as_str()
            .is_some_and(|p| p.starts_with("/metadata/annotations"))
    }));

    // Deleted once the relay was durable, and only once.
    wait_for("the message deleted", || async {
        (rig.depth().await == 0
            && count(&relay.metrics.deleted, ReasonLabels { reason: "relayed" }) == 1)
            .then_some(())
    })
    .await;
    assert_eq!(relay.metrics.received.get(), 1);
    assert_eq!(
        count(
            &relay.metrics.relayed,
            KindLabels {
                kind: "spot_interruption"
            }
        ),
        1
    );
    agent.stop().await.expect("clean stop");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmanaged_instance_is_deleted_once_and_a_launch_racing_its_event_is_relayed() {
    let w = World::start(WorldSpec::new(0, 0, 0)).await;
    set_provider_id(&admin(&w).await, "n1", I1).await;
    let rig = QueueRig::start().await.expect("moto");
    let relay = relay_for(&w, &rig).await;

    // An instance of another cluster (or none), and one whose Node is not there yet.
    rig.spot(NOBODY, "terminate").await;
    rig.spot(I2, "terminate").await;
    wait_for("both messages looked at and waiting", || async {
        (relay.metrics.received.get() >= 2).then_some(())
    })
    .await;
    assert_eq!(
        relay
            .metrics
            .deleted
            .get_or_create(&ReasonLabels {
                reason: "unmanaged"
            })
            .get(),
        0,
        "not before --queue-node-wait"
    );
    // The launch's Node registers after its event was received.
    w.cluster
        .add_node(lastcall_testkit::cluster::NodeSpec::new("n9"))
        .expect("node n9");
    set_provider_id(&admin(&w).await, "n9", I2).await;

    wait_for(
        "one relayed, one deleted as unmanaged, the queue empty",
        || async {
            (count(&relay.metrics.deleted, ReasonLabels { reason: "relayed" }) == 1
                && count(
                    &relay.metrics.deleted,
                    ReasonLabels {
                        reason: "unmanaged",
                    },
                ) == 1
                && rig.depth().await == 0)
                .then_some(())
        },
    )
    .await;
    assert_eq!(
        count(
            &relay.metrics.unmanaged,
            KindLabels {
                kind: "spot_interruption"
            }
        ),
        1,
        "counted once"
    );
    let n9 = kube::Api::<k8s_openapi::api::core::v1::Node>::all(w.cluster.client())
        .get("n9")
        .await
        .expect("n9");
    let record = record_on(&n9).expect("relayed onto n9");
    assert_eq!(record.events.len(), 1);
    assert_eq!(record.events[0].instance, I2);
    let journal = w.cluster.emulator().journal();
    assert_eq!(
        journal.count(|r| is_pubsub_node_write(r, "n1")),
        0,
        "n1 untouched"
    );
    assert_eq!(journal.count(|r| is_pubsub_node_write(r, "n9")), 1);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_mid_message_and_a_duplicate_delivery_change_nothing() {
    let w = World::start(WorldSpec::new(0, 0, 0)).await;
    set_provider_id(&admin(&w).await, "n1", I1).await;
    let rig = QueueRig::start().await.expect("moto");
    rig.spot(I1, "stop").await;
    // The body as delivered, read without taking it (visibility 0), for the replay below.
    let peek = rig
        .moto
        .call(
            "AmazonSQS.ReceiveMessage",
            json!({"QueueUrl": rig.queue_url, "VisibilityTimeout": 0}),
        )
        .await
        .expect("peek");
    let body = peek["Messages"][0]["Body"]
        .as_str()
        .expect("a message")
        .to_string();

    // The first pubsub cannot write the Node: the message must not be deleted.
    w.cluster.emulator().faults().inject(FaultRule::status(
        Some(lastcall_emulators::kube::faults::Method::PATCH),
        "/api/v1/nodes/n1",
        1000,
        500,
    ));
    let first = relay_for(&w, &rig).await;
    wait_for("the first relay's write refused", || async {
        (count(
            &first.metrics.errors,
            OperationLabels {
                operation: "PatchNode",
                reason: "api_error",
            },
        ) >= 1)
            .then_some(())
    })
    .await;
    first.stop().await;
    assert_eq!(rig.depth().await, 1, "a message whose relay failed is kept");
    let journal = w.cluster.emulator().journal();
    assert!(
        journal.count(|r| is_pubsub_node_write(r, "n1") && r.status == 500) >= 1,
        "the fault happened"
    );
    assert_eq!(
        journal.count(|r| is_pubsub_node_write(r, "n1") && accepted(r)),
        0
    );
    w.cluster.emulator().faults().clear();

    // A new pubsub gets it back after the visibility timeout and relays it.
    let second = relay_for(&w, &rig).await;
    wait_for("relayed by the restarted pubsub and deleted", || async {
        (count(&second.metrics.deleted, ReasonLabels { reason: "relayed" }) == 1
            && rig.depth().await == 0)
            .then_some(())
    })
    .await;
    // The same body again (SQS delivers at least once): nothing is written.
    rig.moto.send(&rig.queue_url, &body).await.expect("send");
    wait_for("the duplicate deleted", || async {
        (count(&second.metrics.deleted, ReasonLabels { reason: "relayed" }) == 2
            && rig.depth().await == 0)
            .then_some(())
    })
    .await;
    assert_eq!(
        count(
            &second.metrics.duplicates,
            KindLabels {
                kind: "spot_interruption"
            }
        ),
        1
    );
    assert_eq!(
        journal.count(|r| is_pubsub_node_write(r, "n1") && accepted(r)),
        1,
        "one write in all"
    );
    let record = record_on(
        &kube::Api::<k8s_openapi::api::core::v1::Node>::all(w.cluster.client())
            .get("n1")
            .await
            .expect("n1"),
    )
    .expect("the record");
    assert_eq!(record.events.len(), 1);
    second.stop().await;
}

/// Every event kind the queue carries drives a real agent: one node per kind, each with its
/// own instance and agent. The Health event's node holds a match, whose deadline is the
/// window's start, and it drains ahead of the window (now).
const HEALTH_ARN: &str = "arn:aws:health:us-east-1::event/EC2/AWS_EC2_INSTANCE_STOP_SCHEDULED/1";

/// Every event kind fences its node; then AWS Health closes its event (its `statusCode`
/// `closed`: the scheduled change is over or cancelled, AWS Health API's `EventStatusCode`),
/// and the node it fenced is released, after pubsub relayed the update (by the journal).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_kind_drives_a_real_agent() {
    let kinds: &[(&str, &str, &str)] = &[
        ("n1", "i-0000000000000a001", "maintenance"),
        ("n2", "i-0000000000000a002", "rebalance"),
        ("n3", "i-0000000000000a003", "preemption"),
        ("n4", "i-0000000000000a004", "scale_down"),
        ("n5", "i-0000000000000a005", "preemption"),
        ("n6", "i-0000000000000a006", "preemption"),
    ];
    let w =
        World::start(WorldSpec::new(0, 1, 0).extra_nodes(&["n2", "n3", "n4", "n5", "n6"])).await;
    let admin = admin(&w).await;
    for (node, iid, _) in kinds {
        set_provider_id(&admin, node, iid).await;
    }
    let rig = QueueRig::start().await.expect("moto");
    let relay = relay_for(&w, &rig).await;
    let mut agents = vec![];
    for (node, _, _) in kinds {
        let kube = w
            .cluster
            .emulator()
            .config_for(&format!("agent-{node}"))
            .await
            .expect("client");
        let args: Vec<&str> = ["--aws-queue", "--resync-interval", "1s"].to_vec();
        agents.push(
            lastcall_testkit::agent::InProcessAgent::start(
                lastcall_testkit::agent::config(node, &args),
                kube,
                None,
            )
            .await
            .expect("agent"),
        );
    }
    w.agent_sees_all(&agents[0]).await;
    let allocated = w.allocated();

    let start = jiff::Timestamp::now() + jiff::SignedDuration::from_hours(6);
    let health_start = jiff::fmt::rfc2822::to_string(&start.to_zoned(jiff::tz::TimeZone::UTC))
        .expect("rfc 2822")
        .replace("+0000", "GMT");
    rig.put(
        "aws.health",
        "AWS Health Event",
        json!({
            "eventArn": HEALTH_ARN,
            "statusCode": "upcoming",
            "service": "EC2",
            "eventTypeCode": "AWS_EC2_INSTANCE_STOP_SCHEDULED",
            "eventTypeCategory": "scheduledChange",
            "startTime": health_start,
            "eventDescription": [{"language": "en_US", "latestDescription": "stop"}],
            "affectedEntities": [{"entityValue": kinds[0].1}],
        }),
        kinds[0].1,
    )
    .await;
    rig.put(
        "aws.ec2",
        "EC2 Instance Rebalance Recommendation",
        json!({"instance-id": kinds[1].1}),
        kinds[1].1,
    )
    .await;
    rig.put(
        "aws.ec2",
        "EC2 Instance State-change Notification",
        json!({"instance-id": kinds[2].1, "state": "stopping"}),
        kinds[2].1,
    )
    .await;
    rig.put(
        "aws.autoscaling",
        "EC2 Instance-terminate Lifecycle Action",
        json!({
            "LifecycleActionToken": "87654321-4321-4321-4321-210987654321",
            "AutoScalingGroupName": "game-nodes",
            "LifecycleHookName": "lastcall-drain",
            "EC2InstanceId": kinds[3].1,
            "LifecycleTransition": "autoscaling:EC2_INSTANCE_TERMINATING",
        }),
        kinds[3].1,
    )
    .await;
    rig.put(
        "aws.ec2",
        "EC2 Capacity Reservation Instance Interruption Warning",
        json!({"instance-id": kinds[4].1, "instance-action": "terminate"}),
        kinds[4].1,
    )
    .await;
    rig.spot(kinds[5].1, "hibernate").await;

    let nodes = kube::Api::<k8s_openapi::api::core::v1::Node>::all(w.cluster.client());
    for (node, _, cause) in kinds {
        wait_for(&format!("{node} fenced for {cause}"), || async {
            let n = nodes.get(node).await.ok()?;
            (cordoned(&n)
                && has_taint(&n, "lastcall.dev/draining")
                && annotation(&n, "lastcall.dev/drain-cause").as_deref() == Some(cause))
            .then_some(())
        })
        .await;
    }
    // The Health event's window starts in six hours: the match on n1 is protected with that
    // deadline, and nothing ends it now.
    wait_for("the match told the window's start", || async {
        let g = w.on("n1").into_iter().find(|g| g.uid == allocated.uid)?;
        let d: jiff::Timestamp = g
            .annotations
            .get("lastcall.dev/drain-deadline")?
            .parse()
            .ok()?;
        (d.as_second() == start.as_second()).then_some(())
    })
    .await;
    wait_for("every message deleted", || async {
        (count(&relay.metrics.deleted, ReasonLabels { reason: "relayed" }) == 6
            && rig.depth().await == 0)
            .then_some(())
    })
    .await;

    // The Health event closes: the same eventArn, a new EventBridge id.
    rig.put(
        "aws.health",
        "AWS Health Event",
        json!({
            "eventArn": HEALTH_ARN,
            "statusCode": "closed",
            "service": "EC2",
            "eventTypeCode": "AWS_EC2_INSTANCE_STOP_SCHEDULED",
            "eventTypeCategory": "scheduledChange",
            "startTime": health_start,
            "eventDescription": [{"language": "en_US", "latestDescription": "cancelled"}],
            "affectedEntities": [{"entityValue": kinds[0].1}],
        }),
        kinds[0].1,
    )
    .await;
    wait_for("n1 released once its Health event closed", || async {
        let n = nodes.get("n1").await.ok()?;
        (!cordoned(&n) && !has_taint(&n, "lastcall.dev/draining")).then_some(())
    })
    .await;
    let journal = w.cluster.emulator().journal().entries();
    let closed_relayed = journal
        .iter()
        .find(|r| {
            is_pubsub_node_write(r, "n1")
                && accepted(r)
                && r.request
                    .as_ref()
                    .is_some_and(|b| b.to_string().contains(r#"\"status\":\"closed\""#))
        })
        .expect("pubsub relayed the closed update")
        .seq;
    let unfenced = journal
        .iter()
        .filter(|r| {
            r.identity.as_deref() == Some("agent-n1")
                && r.resource.as_deref() == Some("nodes")
                && accepted(r)
        })
        .rfind(|r| {
            r.response
                .as_ref()
                .is_some_and(|b| b.pointer("/spec/unschedulable") != Some(&json!(true)))
        })
        .expect("the agent released n1")
        .seq;
    assert!(
        closed_relayed < unfenced,
        "closed relayed {closed_relayed} before the release {unfenced}"
    );
    for (node, _, cause) in &kinds[1..] {
        let n = nodes.get(node).await.expect("node");
        assert!(
            cordoned(&n),
            "{node} still fenced for {cause}: a closed Health event touches no other"
        );
    }
    for a in agents {
        a.stop().await.expect("clean stop");
    }
    relay.stop().await;
}

/// What someone with `sqs:SendMessage` on the queue could send: each is counted and
/// deleted, nothing is written to any Node, and an event after them is still relayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_messages_are_deleted_and_never_reach_a_node() {
    let w = World::start(WorldSpec::new(0, 0, 0)).await;
    set_provider_id(&admin(&w).await, "n1", I1).await;
    let rig = QueueRig::start().await.expect("moto");
    let relay = relay_for(&w, &rig).await;
    let future = json!({
        "version": "0", "id": "f", "detail-type": "EC2 Spot Instance Interruption Warning",
        "source": "aws.ec2", "time": "2099-01-01T00:00:00Z",
        "detail": {"instance-id": I1, "instance-action": "terminate"}
    });
    let wrong_source = json!({
        "version": "0", "id": "w", "detail-type": "EC2 Spot Instance Interruption Warning",
        "source": "evil.corp", "time": "2026-12-01T00:00:00Z",
        "detail": {"instance-id": I1, "instance-action": "terminate"}
    });
    let hostile: Vec<String> =
        vec![
        "not json".into(),
        "x".repeat(200 * 1024),
        json!({"version": "0", "id": "u", "detail-type": "EC2 Fleet Error", "source": "aws.ec2",
               "time": "2026-12-01T00:00:00Z", "detail": {}}).to_string(),
        future.to_string(),
        wrong_source.to_string(),
        json!({"Service": "AWS Auto Scaling", "Event": "autoscaling:TEST_NOTIFICATION",
               "RequestId": "t", "Time": "2026-12-01T00:00:00Z"}).to_string(),
    ];
    for body in &hostile {
        rig.moto.send(&rig.queue_url, body).await.expect("send");
    }
    wait_for("every hostile message deleted", || async {
        let deleted = count(
            &relay.metrics.deleted,
            ReasonLabels {
                reason: "parse_error",
            },
        ) + count(&relay.metrics.deleted, ReasonLabels { reason: "ignored" });
        (deleted == hostile.len() as u64 && rig.depth().await == 0).then_some(())
    })
    .await;
    assert_eq!(
        count(
            &relay.metrics.parse_errors,
            ReasonLabels {
                reason: "future_time"
            }
        ),
        1
    );
    assert_eq!(
        count(
            &relay.metrics.parse_errors,
            ReasonLabels {
                reason: "unknown_detail_type"
            }
        ),
        1
    );
    assert_eq!(
        count(
            &relay.metrics.ignored,
            ReasonLabels {
                reason: "test_notification"
            }
        ),
        1
    );
    assert_eq!(
        w.cluster
            .emulator()
            .journal()
            .count(|r| r.identity.as_deref() == Some(PUBSUB) && r.verb.is_mutating()),
        0,
        "nothing written"
    );
    rig.spot(I1, "terminate").await;
    wait_for("a real event after them is relayed", || async {
        (count(&relay.metrics.deleted, ReasonLabels { reason: "relayed" }) == 1).then_some(())
    })
    .await;
    relay.stop().await;
}

/// The burst bench sends its Spot warnings straight into the queue (moto's `PutEvents` is too
/// slow for thousands): what it sends must be what an EventBridge rule delivers for the same
/// event, and a batch of them must be relayed, each onto its own Node, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envelopes_sent_straight_to_the_queue_are_eventbridges_and_each_is_relayed_once() {
    const BATCH: usize = 20;
    let rig = QueueRig::start().await.expect("moto");
    rig.spot(I1, "terminate").await;
    let got = rig
        .moto
        .call(
            "AmazonSQS.ReceiveMessage",
            json!({"QueueUrl": rig.queue_url, "MaxNumberOfMessages": 1, "WaitTimeSeconds": 5}),
        )
        .await
        .expect("ReceiveMessage");
    let message = &got["Messages"][0];
    let mut delivered: serde_json::Value = serde_json::from_str(
        message["Body"]
            .as_str()
            .expect("the rule delivered the event"),
    )
    .expect("a JSON body");
    let mut sent = spot_envelope(I1);
    for v in [&mut delivered, &mut sent] {
        let o = v.as_object_mut().expect("an object");
        // Each event's own: a UUID and a time to the second.
        let id = o.remove("id").expect("id");
        assert_eq!(id.as_str().map(str::len), Some(36), "{id}");
        let time = o.remove("time").expect("time");
        assert!(
            time.as_str()
                .is_some_and(|t| t.len() == 20 && t.parse::<jiff::Timestamp>().is_ok()),
            "{time}"
        );
    }
    // AWS's event structure reference (EventBridge User Guide, "Event structure reference")
    // lists `account` in every event delivered; moto's default target input leaves it out.
    assert_eq!(
        sent.as_object_mut().expect("an object").remove("account"),
        Some(json!(lastcall_testkit::queue::ACCOUNT)),
        "the envelope carries the account, as AWS's does"
    );
    assert_eq!(sent, delivered, "the envelope EventBridge delivers");
    rig.moto
        .call(
            "AmazonSQS.DeleteMessage",
            json!({"QueueUrl": rig.queue_url, "ReceiptHandle": message["ReceiptHandle"]}),
        )
        .await
        .expect("DeleteMessage");

    let w = World::start(WorldSpec::new(0, 0, 0)).await;
    let admin = admin(&w).await;
    let iid = |i: usize| format!("i-{:017x}", 0xb0 + i);
    for i in 0..BATCH {
        w.cluster
            .add_node(lastcall_testkit::cluster::NodeSpec::new(format!("b{i}")))
            .expect("node");
        set_provider_id(&admin, &format!("b{i}"), &iid(i)).await;
    }
    let relay = relay_for(&w, &rig).await;
    let envelopes: Vec<_> = (0..BATCH).map(|i| spot_envelope(&iid(i))).collect();
    rig.send_envelopes(&envelopes, 2)
        .await
        .expect("SendMessageBatch");
    // A redelivery (the machine loaded past the visibility timeout) may delete a message a
    // second time; what must hold is each Node written once, below.
    lastcall_testkit::eventually::eventually(
        "every message relayed and the queue empty",
        std::time::Duration::from_secs(90),
        std::time::Duration::from_millis(50),
        || async {
            (count(&relay.metrics.deleted, ReasonLabels { reason: "relayed" }) >= BATCH as u64
                && rig.depth().await == 0)
                .then_some(())
        },
    )
    .await;
    let nodes = kube::Api::<k8s_openapi::api::core::v1::Node>::all(w.cluster.client());
    let journal = w.cluster.emulator().journal();
    for i in 0..BATCH {
        let node = format!("b{i}");
        let record = record_on(&nodes.get(&node).await.expect("node")).expect("relayed");
        assert_eq!(record.events.len(), 1, "{node}");
        assert_eq!(record.events[0].instance, iid(i), "{node}");
        assert_eq!(
            journal.count(|r| is_pubsub_node_write(r, &node) && accepted(r)),
            1,
            "{node} written once"
        );
    }
    relay.stop().await;
}
