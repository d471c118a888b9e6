//! Prometheus metrics. Every label comes from a small fixed set: never a node, event or
//! game-server name.

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceStatus {
    pub source: &'static str,
    pub status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceReason {
    pub source: &'static str,
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabel {
    pub phase: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    pub state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabel {
    pub action: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionResult {
    pub action: &'static str,
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationResult {
    pub operation: &'static str,
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct NoticeLabels {
    pub source: &'static str,
    pub cause: &'static str,
    pub severity: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabel {
    pub source: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventOutcome {
    pub event: &'static str,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerbLabel {
    pub verb: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ByLabel {
    pub by: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReviewReason {
    pub review: &'static str,
    pub reason: &'static str,
}

#[derive(Clone)]
pub struct Metrics {
    pub signals: Family<SourceStatus, Counter>,
    pub notices: Family<NoticeLabels, Gauge>,
    pub matches_at_risk: Gauge,
    pub deregistered_while_busy: Gauge,
    /// 1 while a machine that came back stays fenced, a while after it did, for a source
    /// that asked for its last drain and has not reported since.
    pub machine_returned_held: Gauge,
    pub cooperation_exposed: Gauge,
    pub writes_reverted: Family<ActionLabel, Counter>,
    pub drain_state: Family<ResultLabel, Counter>,
    pub signals_rejected: Family<SourceReason, Counter>,
    pub phase: Family<PhaseLabel, Gauge>,
    pub game_servers: Family<StateLabel, Gauge>,
    pub releases: Family<ResultLabel, Counter>,
    pub signal_to_fence: Histogram,
    pub drain_duration: Histogram,
    pub heartbeats: Family<ResultLabel, Counter>,
    pub deregistrations: Family<ResultLabel, Counter>,
    pub gamelift_calls: Family<OperationResult, Counter>,
    pub asg_calls: Family<OperationResult, Counter>,
    /// 1 while the Auto Scaling lifecycle wait this agent holds has its heartbeats refused
    /// (AccessDenied): the instance goes at the hook's heartbeat timeout.
    pub asg_heartbeat_denied: Gauge,
    pub asg_state_lag: Gauge,
    /// Reads of the node's own Karpenter NodeClaim, by result.
    pub nodeclaim_reads: Family<ResultLabel, Counter>,
    pub fallback_checks: Family<ResultLabel, Counter>,
    pub redis_connected: Gauge,
    pub redis_reconnects: Counter,
    pub redis_errors: Family<SourceReason, Counter>,
    pub last_message_age: Gauge<f64, AtomicU64>,
    pub source_up: Family<SourceLabel, Gauge>,
    pub source_errors: Family<SourceReason, Counter>,
    pub actions: Family<ActionResult, Counter>,
    pub reconciles: Family<ResultLabel, Counter>,
    pub watch_errors: Family<SourceLabel, Counter>,
    pub events: Family<ResultLabel, Counter>,
    /// Kubernetes API requests abandoned at `--request-timeout`, by HTTP verb.
    pub request_timeouts: Family<VerbLabel, Counter>,
    /// 429s from the API server (throttling, not a disruption budget), by HTTP verb.
    pub throttled: Family<VerbLabel, Counter>,
    /// 1 while this agent owns its node (see `owner`).
    pub node_owner: Gauge,
    /// 1 for how this agent selects its node's GameServers (`field` or `label`).
    pub gameserver_selection: Family<ByLabel, Gauge>,
    /// Webhook notifications, by drain event and outcome (see `notify`).
    pub notifications: Family<EventOutcome, Counter>,
    /// Requests to `/metrics` under `--metrics-auth=kubernetes`, by result.
    pub metrics_auth: Family<ResultLabel, Counter>,
    /// TokenReviews and SubjectAccessReviews without a decision, by review and reason.
    pub metrics_auth_review_failures: Family<ReviewReason, Counter>,
    /// 1 once start-up found the node restriction able to hold this agent (see
    /// `node_restriction`), 0 when it found a gap.
    pub node_restriction_enforceable: Gauge,
}

impl Metrics {
    /// Creates the metrics and registers them in a fresh registry.
    pub fn new() -> (Self, Arc<Registry>) {
        let latency = [
            0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
        ];
        let m = Self {
            signals: Family::default(),
            notices: Family::default(),
            matches_at_risk: Gauge::default(),
            deregistered_while_busy: Gauge::default(),
            machine_returned_held: Gauge::default(),
            cooperation_exposed: Gauge::default(),
            writes_reverted: Family::default(),
            drain_state: Family::default(),
            signals_rejected: Family::default(),
            phase: Family::default(),
            game_servers: Family::default(),
            releases: Family::default(),
            signal_to_fence: Histogram::new(latency),
            drain_duration: Histogram::new([
                1.0, 10.0, 30.0, 60.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0,
            ]),
            heartbeats: Family::default(),
            deregistrations: Family::default(),
            gamelift_calls: Family::default(),
            asg_calls: Family::default(),
            asg_heartbeat_denied: Gauge::default(),
            asg_state_lag: Gauge::default(),
            nodeclaim_reads: Family::default(),
            fallback_checks: Family::default(),
            redis_connected: Gauge::default(),
            redis_reconnects: Counter::default(),
            redis_errors: Family::default(),
            last_message_age: Gauge::default(),
            source_up: Family::default(),
            source_errors: Family::default(),
            actions: Family::default(),
            reconciles: Family::default(),
            watch_errors: Family::default(),
            events: Family::default(),
            request_timeouts: Family::default(),
            throttled: Family::default(),
            node_owner: Gauge::default(),
            gameserver_selection: Family::default(),
            notifications: Family::default(),
            metrics_auth: Family::default(),
            metrics_auth_review_failures: Family::default(),
            node_restriction_enforceable: Gauge::default(),
        };
        let mut r = Registry::with_prefix("lastcall");
        r.register(
            "signals",
            "Valid signals received, by source and status",
            m.signals.clone(),
        );
        r.register(
            "kube_request_timeouts",
            "Kubernetes API requests abandoned at --request-timeout, by verb",
            m.request_timeouts.clone(),
        );
        r.register(
            "kube_throttled",
            "Kubernetes API requests refused with 429 (API Priority and Fairness), by verb; the agent then waits Retry-After plus jitter",
            m.throttled.clone(),
        );
        r.register(
            "node_restriction_enforceable",
            "1 when the token carries this node and the API server serves ValidatingAdmissionPolicy v1, so the chart's node restriction holds this agent; 0 when not (checked once at start-up, in a pod)",
            m.node_restriction_enforceable.clone(),
        );
        r.register(
            "node_owner",
            "1 while this agent owns its node (one agent acts per node, also during a rollout)",
            m.node_owner.clone(),
        );
        r.register(
            "gameserver_selection",
            "1 for how the agent selects its node's GameServers: field (status.nodeName, no writes) or label (one claim write per server)",
            m.gameserver_selection.clone(),
        );
        r.register(
            "signals_rejected",
            "Signals rejected (malformed, unknown status, other instance), by source and reason",
            m.signals_rejected.clone(),
        );
        r.register(
            "drain_phase",
            "1 for the node's current drain phase",
            m.phase.clone(),
        );
        r.register(
            "game_servers",
            "Game servers on this node, by state",
            m.game_servers.clone(),
        );
        r.register(
            "releases",
            "Ready game servers released, by result",
            m.releases.clone(),
        );
        r.register(
            "signal_to_fence_seconds",
            "From receiving a drain signal to the node fenced and every Ready server released",
            m.signal_to_fence.clone(),
        );
        r.register(
            "drain_duration_seconds",
            "From drain start to the node being empty",
            m.drain_duration.clone(),
        );
        r.register(
            "heartbeats",
            "FleetIQ HEALTHY heartbeats, by result",
            m.heartbeats.clone(),
        );
        r.register(
            "deregistrations",
            "FleetIQ deregistrations, by result",
            m.deregistrations.clone(),
        );
        r.register(
            "gamelift_calls",
            "GameLift API calls, by operation and result",
            m.gamelift_calls.clone(),
        );
        r.register(
            "asg_lifecycle_calls",
            "EC2 Auto Scaling lifecycle-hook calls, by operation and result",
            m.asg_calls.clone(),
        );
        r.register(
            "asg_heartbeat_denied",
            "1 while the held Auto Scaling lifecycle wait's heartbeats are refused (AccessDenied): the instance goes at the hook's heartbeat timeout",
            m.asg_heartbeat_denied.clone(),
        );
        r.register(
            "asg_state_lag_seconds",
            "Seconds the Auto Scaling API has still reported this instance outside its termination wait although instance metadata says it is leaving (0 when not lagging)",
            m.asg_state_lag.clone(),
        );
        r.register(
            "karpenter_nodeclaim_reads",
            "Reads of the node's own Karpenter NodeClaim (its expiry), by result",
            m.nodeclaim_reads.clone(),
        );
        r.register(
            "fleetiq_fallback_checks",
            "Direct DescribeGameServerInstances checks made because Redis went quiet",
            m.fallback_checks.clone(),
        );
        r.register(
            "redis_connected",
            "1 while subscribed to Redis",
            m.redis_connected.clone(),
        );
        r.register(
            "redis_errors",
            "Redis failures by reason (timeout, connection, handshake, auth, tls, readonly, ...)",
            m.redis_errors.clone(),
        );
        r.register(
            "redis_reconnects",
            "Redis reconnect attempts",
            m.redis_reconnects.clone(),
        );
        r.register(
            "fleetiq_last_message_age_seconds",
            "Seconds since the last valid status message (any path)",
            m.last_message_age.clone(),
        );
        r.register(
            "source_notices",
            "Notices each source currently gives, by source, cause and severity (merged into one drain per node)",
            m.notices.clone(),
        );
        r.register(
            "matches_at_risk",
            "In-use game servers whose match may not end before the node's Terminate deadline and that lastcall may not end early (eviction.safe)",
            m.matches_at_risk.clone(),
        );
        r.register(
            "fleetiq_deregistered_while_busy",
            "1 while GameLift no longer lists this node's game server although matches still run on it: the node stays fenced and is handed over only once empty",
            m.deregistered_while_busy.clone(),
        );
        r.register(
            "machine_returned_held",
            "1 while a machine that came back stays fenced, a minute after it did, for a source that asked for its last drain and has not reported since",
            m.machine_returned_held.clone(),
        );
        r.register(
            "cooperation_exposed_matches",
            "In-use game servers on this node whose pod an autoscaler may take although autoscaler cooperation is on (safe-to-evict true or no do-not-disrupt)",
            m.cooperation_exposed.clone(),
        );
        r.register(
            "writes_reverted",
            "Writes that came back without what they wrote (an admission webhook reverted them), by action; each is retried with exponential backoff",
            m.writes_reverted.clone(),
        );
        r.register(
            "drain_state_writes",
            "Writes of this node's drain state to Redis for the FleetAutoscaler webhook, by result",
            m.drain_state.clone(),
        );
        r.register(
            "source_up",
            "1 while a signal source is connected",
            m.source_up.clone(),
        );
        r.register(
            "source_errors",
            "Failed reads of a signal source, by source and reason (each is retried; the last view is kept)",
            m.source_errors.clone(),
        );
        r.register(
            "actions",
            "Actions applied, by action and result",
            m.actions.clone(),
        );
        r.register(
            "reconciles",
            "Reconcile passes, by result",
            m.reconciles.clone(),
        );
        r.register(
            "watch_errors",
            "Kubernetes watch errors, by watched kind",
            m.watch_errors.clone(),
        );
        r.register(
            "notifications",
            "Webhook notifications of drain events (--notify-url-file), by event and outcome (sent, failed, dropped)",
            m.notifications.clone(),
        );
        r.register(
            "events",
            "Kubernetes Events published, by result",
            m.events.clone(),
        );
        r.register(
            "metrics_auth_requests",
            "Requests to /metrics under --metrics-auth=kubernetes, by result (allowed, unauthenticated, forbidden, unavailable, throttled)",
            m.metrics_auth.clone(),
        );
        r.register(
            "metrics_auth_review_failures",
            "TokenReviews (review=token) and SubjectAccessReviews (review=access) that gave no decision, by reason (timeout, refused, error, invalid); each request answered 503",
            m.metrics_auth_review_failures.clone(),
        );
        (m, Arc::new(r))
    }

    /// Records the GameServer selection (`field` or `label`), once decided.
    pub fn gameserver_selection(&self, by: &'static str) {
        self.gameserver_selection
            .get_or_create(&ByLabel { by })
            .set(1);
    }
}
