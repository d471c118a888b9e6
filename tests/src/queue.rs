//! Queue mode under test: moto's real SQS and EventBridge, the EventBridge rules built from
//! the documented event patterns (`docs/queue.md`), and pubsub's queue consumer in-process
//! against the Kubernetes API emulator, wired as the binary wires it (same flags, same SQS
//! client builder, a kube client of identity `pubsub`).

use std::time::Duration;

use clap::Parser;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};
use lastcall_emulators::moto::Moto;
use lastcall_pubsub::queue::{self, NodeIndex, Queue, QueueMetrics};
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use lastcall_emulators::moto::{ACCOUNT, REGION};

/// The kube identity pubsub's requests carry in the emulator's journal.
pub const PUBSUB: &str = "pubsub";

/// The EventBridge rules `docs/queue.md` tells operators to create, one per event kind.
pub fn rules() -> Vec<(&'static str, Value)> {
    vec![
        (
            "lastcall-spot",
            json!({"source": ["aws.ec2"], "detail-type": ["EC2 Spot Instance Interruption Warning"]}),
        ),
        (
            "lastcall-rebalance",
            json!({"source": ["aws.ec2"], "detail-type": ["EC2 Instance Rebalance Recommendation"]}),
        ),
        (
            "lastcall-state-change",
            json!({"source": ["aws.ec2"], "detail-type": ["EC2 Instance State-change Notification"],
                   "detail": {"state": ["stopping", "stopped", "shutting-down", "terminated"]}}),
        ),
        (
            "lastcall-scheduled-change",
            json!({"source": ["aws.health"], "detail-type": ["AWS Health Event"],
                   "detail": {"service": ["EC2"], "eventTypeCategory": ["scheduledChange"]}}),
        ),
        (
            "lastcall-asg-terminate",
            json!({"source": ["aws.autoscaling"], "detail-type": ["EC2 Instance-terminate Lifecycle Action"]}),
        ),
        (
            "lastcall-capacity-reservation",
            json!({"source": ["aws.ec2"], "detail-type": ["EC2 Capacity Reservation Instance Interruption Warning"]}),
        ),
    ]
}

/// moto with a queue and the documented rules feeding it.
pub struct QueueRig {
    pub moto: Moto,
    pub queue_url: String,
}

impl QueueRig {
    pub async fn start() -> anyhow::Result<Self> {
        let moto = Moto::start().await?;
        let name = "lastcall-interruptions";
        let queue_url = moto.create_queue(name).await?;
        for (rule, pattern) in rules() {
            moto.rule_to_queue(rule, &pattern, name).await?;
        }
        Ok(Self { moto, queue_url })
    }

    /// An event in the documented shape, put through EventBridge as AWS would emit it.
    pub async fn put(&self, source: &str, detail_type: &str, detail: Value, instance: &str) {
        self.moto
            .put_event(source, detail_type, &detail, &[instance_arn(instance)])
            .await
            .expect("PutEvents");
    }

    /// Sends `envelopes` (see [`envelope`]) straight into the queue, 10 per
    /// `SendMessageBatch`, `parallel` calls at a time (see [`send_envelopes`]).
    pub async fn send_envelopes(&self, envelopes: &[Value], parallel: usize) -> anyhow::Result<()> {
        send_envelopes(envelopes, parallel, |bodies| async move {
            self.moto.send_batch(&self.queue_url, &bodies).await
        })
        .await
    }

    pub async fn spot(&self, instance: &str, action: &str) {
        self.put(
            "aws.ec2",
            "EC2 Spot Instance Interruption Warning",
            json!({"instance-id": instance, "instance-action": action}),
            instance,
        )
        .await;
    }

    /// Messages waiting plus in flight.
    pub async fn depth(&self) -> u64 {
        let (visible, hidden) = self.moto.depth(&self.queue_url).await.expect("depth");
        visible + hidden
    }
}

/// `arn:aws:ec2:<region>:<account>:instance/<id>`, an EC2 event's `resources` entry.
pub fn instance_arn(instance: &str) -> String {
    format!("arn:aws:ec2:{REGION}:{ACCOUNT}:instance/{instance}")
}

/// The message body an EventBridge rule with an SQS target delivers: the event itself, in
/// the envelope AWS documents (`version` "0", a fresh `id`, `detail-type`, `source`,
/// `account`, `time` to the second, `region`, `resources`, `detail` as an object).
/// `tests/tests/queue_relay.rs` checks it against what moto's EventBridge delivers for the
/// same event.
pub fn envelope(source: &str, detail_type: &str, detail: Value, instance: &str) -> Value {
    let id: u128 = rand::random();
    let id = format!("{id:032x}");
    json!({
        "version": "0",
        "id": format!("{}-{}-{}-{}-{}", &id[..8], &id[8..12], &id[12..16], &id[16..20], &id[20..]),
        "detail-type": detail_type,
        "source": source,
        "account": ACCOUNT,
        "time": jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string(),
        "region": REGION,
        "resources": [instance_arn(instance)],
        "detail": detail,
    })
}

/// A Spot warning's envelope (`instance-action` `terminate`), as [`QueueRig::spot`] puts it.
pub fn spot_envelope(instance: &str) -> Value {
    envelope(
        "aws.ec2",
        "EC2 Spot Instance Interruption Warning",
        json!({"instance-id": instance, "instance-action": "terminate"}),
        instance,
    )
}

/// Sends `envelopes` straight into a queue through `send` (one `SendMessageBatch` of up to
/// 10 bodies), `parallel` calls at a time: what an EventBridge rule's SQS target would
/// deliver, without an EventBridge (moto's `PutEvents` takes seconds a call once thousands
/// of events are queued; a burst measures lastcall, not moto's EventBridge).
pub async fn send_envelopes<F, Fut>(
    envelopes: &[Value],
    parallel: usize,
    send: F,
) -> anyhow::Result<()>
where
    F: Fn(Vec<String>) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    use futures::StreamExt as _;
    let bodies: Vec<String> = envelopes.iter().map(Value::to_string).collect();
    let calls = bodies.chunks(10).map(|c| send(c.to_vec()));
    let results: Vec<anyhow::Result<()>> = futures::stream::iter(calls)
        .buffer_unordered(parallel.max(1))
        .collect()
        .await;
    results.into_iter().collect()
}

/// pubsub's queue mode running in this process.
pub struct RunningRelay {
    pub metrics: QueueMetrics,
    pub index: NodeIndex,
    shutdown: CancellationToken,
    handle: JoinHandle<()>,
}

/// The flags a test relay runs with: short waits so redeliveries happen within a test.
pub fn relay_args(rig: &QueueRig) -> Vec<String> {
    [
        "lastcall-pubsub",
        "--queue-url",
        &rig.queue_url,
        "--sqs-endpoint",
        &rig.moto.url(),
        "--aws-region",
        REGION,
        "--queue-wait",
        "1s",
        "--queue-visibility",
        "4s",
        "--queue-node-wait",
        "3s",
    ]
    .map(String::from)
    .to_vec()
}

impl RunningRelay {
    /// Starts queue mode with `args` (see [`relay_args`]) and waits until it has listed the
    /// Nodes.
    pub async fn start(args: &[String], kube: kube::Config) -> anyhow::Result<Self> {
        let config = lastcall_pubsub::Config::try_parse_from(args)?;
        config.validate()?;
        let client = kube::Client::try_from(kube)?;
        let sqs = queue::sqs_client(
            config.aws_region.as_deref(),
            config.queue.sqs_endpoint.as_deref(),
            config.queue.queue_wait,
            Some(crate::agent::test_credentials()),
        )
        .await;
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = QueueMetrics::register(&mut registry);
        let health = lastcall_common::admin::Health::new(&[queue::READY_QUEUE]);
        let q = Queue::new(&config.queue, sqs, client, metrics.clone(), health)
            .ok_or_else(|| anyhow::anyhow!("no --queue-url"))?;
        let index = q.index().clone();
        let shutdown = CancellationToken::new();
        let stop = shutdown.clone();
        let handle = tokio::spawn(async move { q.run(stop).await });
        crate::eventually::wait_for("the relay listed the Nodes", || {
            let index = index.clone();
            async move { index.is_ready().then_some(()) }
        })
        .await;
        Ok(Self {
            metrics,
            index,
            shutdown,
            handle,
        })
    }

    /// Stops it as SIGTERM would: what is being handled finishes, nothing new is received.
    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(30), self.handle).await;
    }
}

/// `aws:///<zone>/<instance>`, as EKS and Karpenter set `spec.providerID`.
pub fn provider_id(instance: &str) -> String {
    format!("aws:///{REGION}a/{instance}")
}

/// Sets a Node's `spec.providerID`, as the kubelet's cloud provider does at registration.
pub async fn set_provider_id(admin: &kube::Config, node: &str, instance: &str) {
    let client = kube::Client::try_from(admin.clone()).expect("client");
    let api: Api<Node> = Api::all(client);
    api.patch(
        node,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"providerID": provider_id(instance)}})),
    )
    .await
    .expect("set providerID");
}

/// A counter's value in a family, 0 when the series does not exist yet.
pub fn count<L>(
    family: &prometheus_client::metrics::family::Family<
        L,
        prometheus_client::metrics::counter::Counter,
    >,
    labels: L,
) -> u64
where
    L: Clone + std::hash::Hash + Eq,
{
    family.get_or_create(&labels).get()
}
