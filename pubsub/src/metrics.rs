//! Prometheus metrics of the pubsub service, all prefixed `lastcall_pubsub_`.
//!
//! Label values come from fixed sets (results, reasons, statuses) except `group`, whose
//! values are the operator's own game server group names from the config file: bounded by
//! that file, and the series of a group removed from it are dropped.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// The `status` label of an InstanceStatus this version does not know (published as-is).
pub const UNKNOWN_STATUS: &str = "UNKNOWN";

/// The only GameLift operation pubsub calls.
pub const OP_DESCRIBE_INSTANCES: &str = "DescribeGameServerInstances";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiCallLabels {
    pub operation: &'static str,
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GroupReasonLabels {
    pub group: String,
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GroupLabels {
    pub group: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabels {
    pub source: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabels {
    pub status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GroupStatusLabels {
    pub group: String,
    pub status: &'static str,
}

/// Every metric the service exports. Cheap to clone (each metric is an `Arc` inside).
#[derive(Clone, Debug)]
pub struct Metrics {
    pub api_calls: Family<ApiCallLabels, Counter>,
    pub api_retries: Family<ReasonLabels, Counter>,
    pub api_backoff_seconds: Family<ReasonLabels, Counter<f64, AtomicU64>>,
    pub api_call_duration: Histogram,
    pub group_errors: Family<GroupReasonLabels, Counter>,
    pub instances: Family<GroupStatusLabels, Gauge>,
    pub invalid_instances: Family<ReasonLabels, Counter>,
    pub messages_published: Counter,
    pub messages_unchanged: Counter,
    pub messages_stale: Counter,
    pub notices_dropped: Family<StatusLabels, Counter>,
    pub unknown_statuses: Counter,
    pub cache_writes: Counter,
    pub wrong_type_keys: Counter,
    pub redis_connects: Counter,
    pub api_rate_wait_seconds: Counter<f64, AtomicU64>,
    pub api_throttle_slowdowns: Counter,
    pub group_staleness: Family<GroupLabels, Gauge<f64, AtomicU64>>,
    pub group_failed_cycles: Family<GroupLabels, Gauge>,
    pub last_publish: Gauge<f64, AtomicU64>,
    pub publish_duration: Histogram,
    pub publish_errors: Family<ReasonLabels, Counter>,
    pub redis_round_trips: Family<ResultLabels, Counter>,
    pub redis_up: Gauge,
    pub config_reloads: Family<ResultLabels, Counter>,
    pub groups: Gauge,
    pub cycles: Family<ResultLabels, Counter>,
    pub cycle_duration: Histogram,
    pub last_successful_cycle: Gauge<f64, AtomicU64>,
}

impl Metrics {
    /// Creates the metrics and registers them under `lastcall_pubsub_` in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            api_calls: Family::default(),
            api_retries: Family::default(),
            api_backoff_seconds: Family::default(),
            api_call_duration: Histogram::new(exponential_buckets(0.005, 2.0, 13)),
            group_errors: Family::default(),
            instances: Family::default(),
            invalid_instances: Family::default(),
            messages_published: Counter::default(),
            messages_unchanged: Counter::default(),
            messages_stale: Counter::default(),
            notices_dropped: Family::default(),
            unknown_statuses: Counter::default(),
            cache_writes: Counter::default(),
            wrong_type_keys: Counter::default(),
            redis_connects: Counter::default(),
            api_rate_wait_seconds: Counter::default(),
            api_throttle_slowdowns: Counter::default(),
            group_staleness: Family::default(),
            group_failed_cycles: Family::default(),
            last_publish: Gauge::default(),
            publish_duration: Histogram::new(exponential_buckets(0.0005, 2.0, 14)),
            publish_errors: Family::default(),
            redis_round_trips: Family::default(),
            redis_up: Gauge::default(),
            config_reloads: Family::default(),
            groups: Gauge::default(),
            cycles: Family::default(),
            cycle_duration: Histogram::new(exponential_buckets(0.01, 2.0, 14)),
            last_successful_cycle: Gauge::default(),
        };
        // Every notice status has a series from the start, at 0, so an alert's increase()
        // sees the first drop.
        for status in lastcall_common::fleetiq::InstanceStatus::ALL
            .iter()
            .filter(|s| **s != lastcall_common::fleetiq::InstanceStatus::Active)
            .map(|s| s.as_str())
            .chain([UNKNOWN_STATUS])
        {
            let _ = m.notices_dropped.get_or_create(&StatusLabels { status });
        }
        let r = registry.sub_registry_with_prefix("lastcall_pubsub");
        r.register(
            "api_calls",
            "GameLift API calls by operation and result (ok, throttled, server_error, not_found, ...)",
            m.api_calls.clone(),
        );
        r.register(
            "api_retries",
            "GameLift calls retried after a backoff, by reason",
            m.api_retries.clone(),
        );
        r.register(
            "api_backoff_seconds",
            "Time spent backing off before GameLift retries, by reason",
            m.api_backoff_seconds.clone(),
        );
        r.register(
            "api_call_duration_seconds",
            "Duration of one GameLift attempt",
            m.api_call_duration.clone(),
        );
        r.register(
            "group_errors",
            "Groups that could not be polled in a cycle, by group and reason",
            m.group_errors.clone(),
        );
        r.register(
            "instances",
            "Instances seen in the last successful poll of each group, by status",
            m.instances.clone(),
        );
        r.register(
            "invalid_instances",
            "Instance entries skipped because GameLift's answer was unusable, by reason",
            m.invalid_instances.clone(),
        );
        r.register(
            "messages_published",
            "PUBLISH commands acknowledged by Redis",
            m.messages_published.clone(),
        );
        r.register(
            "messages_unchanged",
            "Statuses not published because they did not change (--publish-unchanged=false)",
            m.messages_unchanged.clone(),
        );
        r.register(
            "messages_stale",
            "Statuses not written because Redis held one polled later (another replica)",
            m.messages_stale.clone(),
        );
        r.register(
            "notices_dropped",
            "Notices (DRAINING, SPOT_TERMINATING, unknown) not written because Redis held a status another replica polled later, by status",
            m.notices_dropped.clone(),
        );
        r.register(
            "unknown_statuses",
            "Instances published with an InstanceStatus this version does not know (as the original did)",
            m.unknown_statuses.clone(),
        );
        r.register(
            "redis_connects",
            "Redis connections opened (the first, and each rebuild after a failure)",
            m.redis_connects.clone(),
        );
        r.register(
            "api_rate_wait_seconds",
            "Time GameLift calls waited for the shared rate limiter (--api-rate)",
            m.api_rate_wait_seconds.clone(),
        );
        r.register(
            "api_throttle_slowdowns",
            "Throttled GameLift answers, each of which slowed every caller (the rate halves at most once a second)",
            m.api_throttle_slowdowns.clone(),
        );
        r.register(
            "group_staleness_seconds",
            "Seconds since each group's statuses were last written to Redis (since start if never)",
            m.group_staleness.clone(),
        );
        r.register(
            "group_failed_cycles",
            "Consecutive cycles in which each group was not published",
            m.group_failed_cycles.clone(),
        );
        r.register(
            "last_publish_timestamp_seconds",
            "Unix time at which statuses of any group were last written to Redis",
            m.last_publish.clone(),
        );
        r.register(
            "cache_writes",
            "Last-value cache keys written (SET ... EX)",
            m.cache_writes.clone(),
        );
        r.register(
            "wrong_type_keys",
            "Instances with a key pubsub reads (polled-at, polled-by; the status with --publish-unchanged=false) holding another Redis type: read as absent and overwritten",
            m.wrong_type_keys.clone(),
        );
        r.register(
            "publish_duration_seconds",
            "Duration of one pipelined Redis round trip",
            m.publish_duration.clone(),
        );
        r.register(
            "publish_errors",
            "Publish batches that failed or were skipped, by reason",
            m.publish_errors.clone(),
        );
        r.register(
            "redis_round_trips",
            "Redis round trips by result",
            m.redis_round_trips.clone(),
        );
        r.register(
            "redis_up",
            "1 when the last Redis round trip succeeded",
            m.redis_up.clone(),
        );
        r.register(
            "config_reloads",
            "Reads of the game server groups file by result (ok, error)",
            m.config_reloads.clone(),
        );
        r.register(
            "groups",
            "Game server groups being polled",
            m.groups.clone(),
        );
        r.register(
            "cycles",
            "Polling cycles by result (ok, error)",
            m.cycles.clone(),
        );
        r.register(
            "cycle_duration_seconds",
            "Duration of one polling cycle",
            m.cycle_duration.clone(),
        );
        r.register(
            "last_successful_cycle_timestamp_seconds",
            "Unix time at which the last cycle without any error ended",
            m.last_successful_cycle.clone(),
        );
        m
    }

    pub fn api_call(&self, result: &'static str) {
        self.api_calls
            .get_or_create(&ApiCallLabels {
                operation: OP_DESCRIBE_INSTANCES,
                result,
            })
            .inc();
    }

    pub fn reason(family: &Family<ReasonLabels, Counter>, reason: &'static str) {
        family.get_or_create(&ReasonLabels { reason }).inc();
    }

    pub fn result(family: &Family<ResultLabels, Counter>, result: &'static str) {
        family.get_or_create(&ResultLabels { result }).inc();
    }

    /// Drops every per-group series of a group that left the config file; `error_reasons`
    /// are the `reason` labels its poll errors can have.
    pub fn forget_group(&self, group: &str, error_reasons: &[&'static str]) {
        let labels = GroupLabels {
            group: group.to_string(),
        };
        self.group_staleness.remove(&labels);
        self.group_failed_cycles.remove(&labels);
        self.instances.remove(&GroupStatusLabels {
            group: group.to_string(),
            status: UNKNOWN_STATUS,
        });
        for status in lastcall_common::fleetiq::InstanceStatus::ALL {
            self.instances.remove(&GroupStatusLabels {
                group: group.to_string(),
                status: status.as_str(),
            });
        }
        for &reason in error_reasons {
            self.group_errors.remove(&GroupReasonLabels {
                group: group.to_string(),
                reason,
            });
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BoundLabels {
    pub bound: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    pub state: &'static str,
}

/// A Fleet named in a review: only Fleets that exist are tracked (see
/// [`crate::webhook::fleets`]), at most [`crate::webhook::held::MAX_TRACKED`], each forgotten
/// when it stops asking.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FleetLabels {
    /// Not `namespace`: Prometheus gives that label the scraped pod's namespace.
    pub fleet_namespace: String,
    pub fleet: String,
}

/// Metrics of the FleetAutoscaler webhook, registered only when it is enabled. Names are
/// `lastcall_pubsub_webhook_*`; every label value comes from a fixed set, except the
/// Fleet of `fleet_held_seconds` (see [`FleetLabels`]).
#[derive(Clone, Debug)]
pub struct WebhookMetrics {
    pub requests: Family<ResultLabels, Counter>,
    pub rejected: Family<ReasonLabels, Counter>,
    pub request_duration: Histogram,
    pub extra_replicas: Counter,
    pub clamped: Family<BoundLabels, Counter>,
    pub held: Family<ReasonLabels, Counter>,
    pub drain_state_reads: Family<ResultLabels, Counter>,
    pub drain_state_read_duration: Histogram,
    pub redis_connects: Family<ResultLabels, Counter>,
    pub redis_connect_duration: Histogram,
    pub drain_state_nodes: Family<StateLabels, Gauge>,
    pub drain_state_skipped: Family<ReasonLabels, Counter>,
    pub drain_state_pruned: Counter,
    pub tls_reloads: Family<ResultLabels, Counter>,
    pub fleets_held: Gauge,
    pub fleet_held_seconds: Family<FleetLabels, Gauge<f64, AtomicU64>>,
    pub node_reads: Family<ResultLabels, Counter>,
    pub fleet_sizes: Family<ResultLabels, Counter>,
    pub fleets_known: Gauge,
    pub fleet_lists: Family<ResultLabels, Counter>,
    pub bad_overrides: Family<SourceLabels, Counter>,
}

impl WebhookMetrics {
    /// Creates the metrics and registers them under `lastcall_pubsub_webhook_` in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            requests: Family::default(),
            rejected: Family::default(),
            // 100 µs to about 3 s: a healthy answer is well under a millisecond.
            request_duration: Histogram::new(exponential_buckets(0.0001, 2.0, 16)),
            extra_replicas: Counter::default(),
            clamped: Family::default(),
            held: Family::default(),
            drain_state_reads: Family::default(),
            drain_state_read_duration: Histogram::new(exponential_buckets(0.0001, 2.0, 16)),
            redis_connects: Family::default(),
            // 1 ms to about 33 s: a cluster connect through a silent node takes two timeouts.
            redis_connect_duration: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            drain_state_nodes: Family::default(),
            drain_state_skipped: Family::default(),
            drain_state_pruned: Counter::default(),
            tls_reloads: Family::default(),
            fleets_held: Gauge::default(),
            fleet_held_seconds: Family::default(),
            node_reads: Family::default(),
            fleet_sizes: Family::default(),
            fleets_known: Gauge::default(),
            fleet_lists: Family::default(),
            bad_overrides: Family::default(),
        };
        let r = registry.sub_registry_with_prefix("lastcall_pubsub_webhook");
        r.register(
            "requests",
            "FleetAutoscaleReviews answered, by result (scale_up, scale_down, unchanged, rejected)",
            m.requests.clone(),
        );
        r.register(
            "rejected",
            "FleetAutoscaleReviews refused with 400, by reason",
            m.rejected.clone(),
        );
        r.register(
            "request_duration_seconds",
            "Time from a review's arrival to its answer",
            m.request_duration.clone(),
        );
        r.register(
            "extra_replicas",
            "Replicas added to answers for Ready servers on draining nodes",
            m.extra_replicas.clone(),
        );
        r.register(
            "clamped",
            "Answers changed by the min or max replicas bound",
            m.clamped.clone(),
        );
        r.register(
            "held",
            "Answers that refused a scale-down because the drain state was not fully known, by reason (stale_entry, redis_restarted, backoff, connecting, timeout, or an error class)",
            m.held.clone(),
        );
        r.register(
            "drain_state_reads",
            "Reads of the drain state from Redis, by result (ok, backoff, connecting, or an error class)",
            m.drain_state_reads.clone(),
        );
        r.register(
            "drain_state_read_duration_seconds",
            "Duration of one drain state read (waiting for the connection included)",
            m.drain_state_read_duration.clone(),
        );
        r.register(
            "redis_connects",
            "Connections to Redis the webhook opened (in the background, one at a time), by result (ok, error)",
            m.redis_connects.clone(),
        );
        r.register(
            "redis_connect_duration_seconds",
            "Duration of one connect to Redis by the webhook (for a cluster: asking every known node for the slot map, then connecting)",
            m.redis_connect_duration.clone(),
        );
        r.register(
            "drain_state_nodes",
            "Entries in the drain state at the last read, by state (fresh, stale, expired, future, malformed)",
            m.drain_state_nodes.clone(),
        );
        r.register(
            "drain_state_skipped",
            "Drain state entries that did not count, per read, by reason",
            m.drain_state_skipped.clone(),
        );
        r.register(
            "drain_state_pruned",
            "Long-dead drain state entries deleted",
            m.drain_state_pruned.clone(),
        );
        r.register(
            "tls_reloads",
            "Reloads of the webhook's TLS certificate and key after the files changed, by result",
            m.tls_reloads.clone(),
        );
        r.register(
            "fleets_held",
            "Fleets whose last answer was held (no scale-down: the drain state is not fully known)",
            m.fleets_held.clone(),
        );
        r.register(
            "fleet_held_seconds",
            "How long this Fleet's answers have been held without a break, as of its last answer (0 when not held)",
            m.fleet_held_seconds.clone(),
        );
        r.register(
            "node_reads",
            "Reads of the Nodes that drain state entries name, by result (present, absent, error)",
            m.node_reads.clone(),
        );
        r.register(
            "fleet_sizes",
            "Held answers by what the Fleet cache said of the Fleet's spec.replicas (known; absent, no_client, not_listed, watch_failed: answered with an error, so Agones keeps the Fleet as it is)",
            m.fleet_sizes.clone(),
        );
        r.register(
            "fleets_known",
            "Fleets in the webhook's Fleet cache (from its watch on fleets.agones.dev)",
            m.fleets_known.clone(),
        );
        r.register(
            "fleet_lists",
            "Lists of every Fleet by the webhook's watch (ok), and failures of the watch (error: the cache is unknown until the next list)",
            m.fleet_lists.clone(),
        );
        r.register(
            "bad_overrides",
            "Reviews whose lastcall.dev/autoscaler-* annotations or query parameters were invalid and ignored (the flags' settings answered), by source (annotation, query, combination)",
            m.bad_overrides.clone(),
        );
        m
    }
}
