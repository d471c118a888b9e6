//! Queue mode's metrics, all `lastcall_pubsub_queue_*`. Every label value comes from a fixed
//! set (an event kind, a reason, an operation): never an instance, a Node or a queue name.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationLabels {
    pub operation: &'static str,
    pub reason: &'static str,
}

#[derive(Clone, Debug)]
pub struct QueueMetrics {
    /// Messages received (redeliveries included).
    pub received: Counter,
    /// Events written onto their Node, by kind (a duplicate already there is not counted).
    pub relayed: Family<KindLabels, Counter>,
    /// Events already on their Node when delivered again (a redelivery or a replay).
    pub duplicates: Family<KindLabels, Counter>,
    /// Messages deleted, by why: `relayed`, `ignored`, `unmanaged`, `parse_error`.
    pub deleted: Family<ReasonLabels, Counter>,
    /// Events for an instance no Node of this cluster runs, past `--queue-node-wait`.
    pub unmanaged: Family<KindLabels, Counter>,
    /// Valid messages that ask nothing (test notifications, launches, other Health events).
    pub ignored: Family<ReasonLabels, Counter>,
    /// Messages that could not be read, by reason.
    pub parse_errors: Family<ReasonLabels, Counter>,
    /// Failed SQS and Kubernetes calls, by operation and reason.
    pub errors: Family<OperationLabels, Counter>,
    /// From the event's time to its Node written, in seconds.
    pub relay_latency: Histogram,
    /// How long the oldest message of the last receive had waited in the queue (SQS
    /// `SentTimestamp`), in seconds; 0 after an empty receive: the queue backing up.
    pub oldest_message_age: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// Nodes with an instance id the relay knows (from the Node watch).
    pub nodes: Gauge,
}

impl QueueMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            received: Counter::default(),
            relayed: Family::default(),
            duplicates: Family::default(),
            deleted: Family::default(),
            unmanaged: Family::default(),
            ignored: Family::default(),
            parse_errors: Family::default(),
            errors: Family::default(),
            relay_latency: Histogram::new(exponential_buckets(0.05, 2.0, 14)),
            oldest_message_age: Gauge::default(),
            nodes: Gauge::default(),
        };
        let r = registry.sub_registry_with_prefix("lastcall_pubsub_queue");
        r.register(
            "messages_received",
            "SQS messages received",
            m.received.clone(),
        );
        r.register(
            "events_relayed",
            "Events written onto their Node, by kind",
            m.relayed.clone(),
        );
        r.register(
            "events_duplicate",
            "Events already on their Node when delivered again, by kind",
            m.duplicates.clone(),
        );
        r.register(
            "messages_deleted",
            "SQS messages deleted, by reason",
            m.deleted.clone(),
        );
        r.register(
            "events_unmanaged",
            "Events for an instance no Node of this cluster runs, by kind",
            m.unmanaged.clone(),
        );
        r.register(
            "messages_ignored",
            "Valid messages that ask nothing of lastcall, by reason",
            m.ignored.clone(),
        );
        r.register(
            "parse_errors",
            "Messages that could not be read, by reason",
            m.parse_errors.clone(),
        );
        r.register(
            "errors",
            "Failed SQS and Kubernetes calls, by operation and reason",
            m.errors.clone(),
        );
        r.register(
            "relay_latency_seconds",
            "From an event's time to its Node written",
            m.relay_latency.clone(),
        );
        r.register(
            "oldest_message_age_seconds",
            "How long the oldest message of the last receive had waited in the queue (0: none waited)",
            m.oldest_message_age.clone(),
        );
        r.register(
            "nodes",
            "Nodes with an EC2 instance id in their providerID",
            m.nodes.clone(),
        );
        m
    }

    pub fn error(&self, operation: &'static str, reason: &'static str) {
        self.errors
            .get_or_create(&OperationLabels { operation, reason })
            .inc();
    }
}
