//! One polling cycle, the loop that repeats it, and the process around them.
//!
//! A cycle re-reads the groups file, polls the groups with bounded concurrency and publishes
//! each page's statuses as soon as that page is read. Nothing in a cycle can end the
//! process: every failure is a value in the [`CycleReport`], a metric and a log line.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::get;
use futures::StreamExt;
use lastcall_common::admin::{self, Health};
use lastcall_common::backoff::jitter;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::groups::{GroupsFile, Reload};
use crate::liveness::Liveness;
use crate::metrics::UNKNOWN_STATUS;
use crate::metrics::WebhookMetrics;
use crate::metrics::{GroupLabels, GroupReasonLabels, GroupStatusLabels, Metrics};
use crate::poller::{Budget, PollErrorKind, Poller};
use crate::publisher::{Outgoing, PublishReport, Publisher, READY_REDIS};
use crate::rate::RateLimiter;
use crate::webhook::drain::DrainReader;
use crate::webhook::tls::ReloadingCert;
use crate::webhook::{READY_WEBHOOK, Webhook};
use lastcall_common::fleetiq::InstanceStatus;
use lastcall_common::redis_conn;

/// Name of the readiness check that some group was published recently.
pub const READY_PUBLISHING: &str = "publishing";

/// Shortest pause between the end of an overrunning cycle and the next one, so an overrun
/// never turns into back-to-back polling.
const MIN_GAP: Duration = Duration::from_secs(1);

/// Errors that stop the process at start.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid Redis client settings: {0}")]
    Redis(#[source] redis::RedisError),
    #[error("binding the admin listener on {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("installing signal handlers: {0}")]
    Signals(#[source] std::io::Error),
    #[error("admin HTTP server failed: {0}")]
    Admin(#[source] std::io::Error),
    #[error("{0}")]
    Config(#[source] crate::config::ConfigError),
    #[error("webhook TLS files: {0}")]
    WebhookTls(#[source] crate::webhook::tls::TlsError),
    #[error("{0}")]
    Webhook(#[source] crate::webhook::ServeError),
    #[error("{0}")]
    Queue(#[source] crate::queue::ServeError),
}

/// What one cycle did. Counts are for this cycle only.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CycleReport {
    /// Groups polled (0 when no valid groups file has been read yet).
    pub groups: usize,
    /// Groups that could not be polled.
    pub groups_failed: usize,
    /// GameLift calls, retries included.
    pub api_calls: u64,
    /// Pages received.
    pub pages: u64,
    /// GameLift calls that were retries.
    pub api_retries: u64,
    /// Valid instances received.
    pub instances: u64,
    /// Instance entries skipped as invalid.
    pub invalid_instances: u64,
    /// PUBLISH commands acknowledged.
    pub published: u64,
    /// Statuses not published because unchanged.
    pub unchanged: u64,
    /// Statuses dropped because Redis held one polled later (another replica).
    pub stale: u64,
    /// Of those, notices (not ACTIVE); each was also logged as a warning.
    pub notices_dropped: u64,
    /// Groups whose statuses were written this cycle.
    pub groups_published: usize,
    /// Cache keys written.
    pub cached: u64,
    /// Redis round trips attempted (pipelines and pings).
    pub redis_round_trips: u64,
    /// Publish batches that failed or were skipped.
    pub publish_errors: u64,
    /// The groups file could not be used this cycle (the last good list, if any, was).
    pub config_error: bool,
    /// groups_failed + publish_errors + config_error.
    pub errors: u64,
    pub duration: Duration,
}

/// What is remembered about one group between cycles.
#[derive(Clone, Copy, Debug, Default)]
struct GroupTrack {
    last_publish: Option<Instant>,
    failed_cycles: u32,
}

/// Cycle-to-cycle state, touched only by the cycle that holds the lock.
#[derive(Debug)]
struct CycleState {
    groups_file: GroupsFile,
    /// Groups that have per-group metric series, to drop them when a group is removed.
    metric_groups: Vec<String>,
    groups: HashMap<String, GroupTrack>,
    last_any_publish: Option<Instant>,
}

/// Puts groups that were not published last cycle first, keeping file order otherwise, so
/// a budget or deadline that runs out never starves the same groups every cycle.
pub fn failed_first(groups: &[String], failed_last: impl Fn(&str) -> bool) -> Vec<String> {
    let (mut first, rest): (Vec<String>, Vec<String>) =
        groups.iter().cloned().partition(|g| failed_last(g));
    first.extend(rest);
    first
}

/// The pubsub service: one GameLift poller, one Redis publisher, their metrics and health.
pub struct Pubsub {
    poller: Poller,
    publisher: Publisher,
    limiter: RateLimiter,
    started: Instant,
    cycle_deadline: Duration,
    /// How long after the cycle deadline publishing may go on (one Redis timeout).
    publish_grace: Duration,
    ready_within: Duration,
    liveness: Liveness,
    metrics: Metrics,
    registry: Arc<Registry>,
    health: Health,
    period: Duration,
    cycle_jitter: Duration,
    concurrency: usize,
    api_budget: u32,
    state: tokio::sync::Mutex<CycleState>,
    webhook: Option<Arc<Webhook>>,
    /// Queue mode's metrics, in this service's registry, when `--queue-url` is set.
    queue_metrics: Option<crate::queue::QueueMetrics>,
}

impl std::fmt::Debug for Pubsub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pubsub")
            .field("period", &self.period)
            .field("concurrency", &self.concurrency)
            .finish_non_exhaustive()
    }
}

impl Pubsub {
    /// Wires the service from its config and a GameLift client (see
    /// [`crate::poller::gamelift_client`]). No I/O happens here; must run inside Tokio.
    pub fn new(config: &Config, gamelift: aws_sdk_gamelift::Client) -> Result<Self, Error> {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        let settings = config.webhook_settings().map_err(Error::Config)?;
        let mut checks = vec![READY_REDIS, READY_PUBLISHING];
        if settings.is_some() {
            checks.push(READY_WEBHOOK);
        }
        let queue_metrics = config.queue.queue_url.as_ref().map(|_| {
            checks.push(crate::queue::READY_QUEUE);
            crate::queue::QueueMetrics::register(&mut registry)
        });
        let health = Health::new(&checks);
        let publisher =
            Publisher::new(config, metrics.clone(), health.clone()).map_err(Error::Redis)?;
        let webhook = match settings {
            None => None,
            Some(settings) => {
                let metrics = WebhookMetrics::register(&mut registry);
                // Its own connection: a slow publish batch never delays an answer.
                let target = config.redis_url.as_ref().ok_or_else(|| {
                    Error::Redis(redis::RedisError::from((
                        redis::ErrorKind::InvalidClientConfig,
                        "the webhook needs --redis-url",
                    )))
                })?;
                let client = redis_conn::any_client(target, config.redis_ca_file.as_ref())
                    .map_err(Error::Redis)?;
                let reader = DrainReader::new(
                    client,
                    target.is_tls(),
                    settings.redis_timeout,
                    settings.drain_state_max_age,
                    settings.drain_state_hold_limit,
                    settings.drain_state_key.clone(),
                    metrics.clone(),
                );
                Some(Arc::new(Webhook::new(
                    settings.policy,
                    reader,
                    settings.redis_timeout,
                    metrics,
                    health.clone(),
                )))
            }
        };
        Ok(Self {
            poller: Poller::new(gamelift, config, metrics.clone()),
            publisher,
            limiter: RateLimiter::new(config.api_rate, config.api_burst),
            started: Instant::now(),
            cycle_deadline: config.cycle_deadline(),
            publish_grace: config.redis_timeout,
            ready_within: config.period.saturating_mul(config.ready_periods),
            liveness: Liveness::new(config.liveness_timeout()),
            metrics,
            registry: Arc::new(registry),
            health,
            period: config.period,
            cycle_jitter: config.cycle_jitter,
            concurrency: usize::from(config.concurrency.max(1)),
            api_budget: config.api_budget,
            state: tokio::sync::Mutex::new(CycleState {
                groups_file: GroupsFile::new(&config.config_file),
                metric_groups: Vec::new(),
                groups: HashMap::new(),
                last_any_publish: None,
            }),
            webhook,
            queue_metrics,
        })
    }

    /// Queue mode's metrics, when `--queue-url` is set.
    pub fn queue_metrics(&self) -> Option<&crate::queue::QueueMetrics> {
        self.queue_metrics.as_ref()
    }

    /// The FleetAutoscaler webhook, when `--webhook-listen` is set; serve it with
    /// [`crate::webhook::serve`].
    pub fn webhook(&self) -> Option<&Arc<Webhook>> {
        self.webhook.as_ref()
    }

    /// `/metrics`, `/healthz` and `/readyz` for this service. `/healthz` is the polling
    /// loop's own (see [`crate::liveness`]): it fails only when the loop is stuck, never
    /// because Redis is down, so the webhook goes on answering (held) through an outage.
    pub fn admin_router(self: &Arc<Self>) -> Router {
        let me = self.clone();
        Router::new()
            .route(
                "/healthz",
                get(move || {
                    let me = me.clone();
                    async move {
                        match me.liveness.check() {
                            Ok(()) => (StatusCode::OK, "ok\n".to_string()),
                            Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
                        }
                    }
                }),
            )
            .fallback_service(admin::router(self.registry.clone(), self.health.clone()))
    }

    /// Whether the polling loop is alive: waiting for a cycle that is not overdue, or in a
    /// cycle younger than `--liveness-timeout`. Redis plays no part (see readiness).
    pub fn is_live(&self) -> bool {
        self.liveness.check().is_ok()
    }

    pub fn health(&self) -> &Health {
        &self.health
    }

    /// The metrics in Prometheus text form, as `/metrics` serves them.
    pub fn metrics_text(&self) -> String {
        let mut out = String::new();
        // Encoding into a String only fails if a metric's Display fails, which ours do not.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// Runs one cycle now: reload the groups, poll and publish every group.
    pub async fn run_cycle(&self) -> CycleReport {
        let started = Instant::now();
        let mut state = self.state.lock().await;
        self.liveness.cycling();
        let mut report = CycleReport::default();

        let Reload { groups, result } = state.groups_file.reload().await;
        match &result {
            Ok(changed) => {
                Metrics::result(&self.metrics.config_reloads, "ok");
                if *changed {
                    tracing::info!(message = "game server groups loaded", groups = ?groups.as_deref().unwrap_or_default());
                }
            }
            Err(e) => {
                report.config_error = true;
                Metrics::result(&self.metrics.config_reloads, "error");
                tracing::error!(
                    message = "cannot use the groups file, keeping the last good list",
                    path = %state.groups_file.path().display(),
                    reason = e.metric_label(),
                    error = %e,
                    kept = ?groups.as_deref()
                );
            }
        }
        let had_groups = groups.is_some();
        let groups = groups.unwrap_or_default();
        self.forget_removed_groups(&mut state, &groups);
        self.metrics.groups.set(groups.len() as i64);
        report.groups = groups.len();

        let budget = Budget::new(self.api_budget);
        let deadline = started + self.cycle_deadline;
        let order = failed_first(&groups, |g| {
            state.groups.get(g).is_some_and(|t| t.failed_cycles > 0)
        });
        let mut outcomes = futures::stream::iter(order.iter())
            .map(|group| self.poll_and_publish(group, &budget, deadline))
            .buffer_unordered(self.concurrency);
        let mut publish = PublishReport::default();
        let mut published_groups: HashSet<String> = HashSet::new();
        while let Some(outcome) = outcomes.next().await {
            if !outcome.failed && outcome.publish.errors == 0 {
                published_groups.insert(outcome.group.clone());
            }
            report.api_calls += outcome.stats.api_calls;
            report.pages += outcome.stats.pages;
            report.api_retries += outcome.stats.retries;
            report.invalid_instances += outcome.stats.invalid;
            report.instances += outcome.instance_ids.len() as u64;
            if outcome.failed {
                report.groups_failed += 1;
            }
            publish.add(&outcome.publish);
        }
        drop(outcomes);
        if publish.round_trips == 0 && publish.errors == 0 {
            // Nothing to publish: still find out whether Redis is there, for readiness.
            publish.add(&self.publisher.ping().await);
        }
        self.publisher.settle_readiness();
        report.published = publish.published;
        report.unchanged = publish.unchanged;
        report.stale = publish.stale;
        report.notices_dropped = publish.notices_dropped;
        report.groups_published = published_groups.len();
        report.cached = publish.cached;
        report.redis_round_trips = publish.round_trips;
        report.publish_errors = publish.errors;
        report.errors =
            report.groups_failed as u64 + report.publish_errors + u64::from(report.config_error);
        report.duration = started.elapsed();
        self.track_groups(&mut state, &groups, &published_groups);
        self.set_readiness(&state, had_groups, groups.len());
        self.finish_cycle(&report);
        // Not waiting for anything planned yet: `run` sets the next cycle's time.
        self.liveness.waiting_until(Instant::now());
        report
    }

    /// Per-group staleness and consecutive failures, for metrics and the next cycle's order.
    fn track_groups(&self, state: &mut CycleState, groups: &[String], published: &HashSet<String>) {
        let now = Instant::now();
        for g in groups {
            let track = state.groups.entry(g.clone()).or_default();
            if published.contains(g) {
                track.last_publish = Some(now);
                track.failed_cycles = 0;
                state.last_any_publish = Some(now);
            } else {
                track.failed_cycles = track.failed_cycles.saturating_add(1);
            }
            let since = track.last_publish.unwrap_or(self.started);
            let labels = GroupLabels { group: g.clone() };
            self.metrics
                .group_staleness
                .get_or_create(&labels)
                .set(now.saturating_duration_since(since).as_secs_f64());
            self.metrics
                .group_failed_cycles
                .get_or_create(&labels)
                .set(i64::from(track.failed_cycles));
        }
        state.groups.retain(|g, _| groups.contains(g));
        if !published.is_empty() {
            self.metrics.last_publish.set(unix_now());
        }
    }

    /// Ready means: a usable, non-empty groups file, and some group published within
    /// `--ready-periods` periods. A rollout with broken IAM (every group failing) is
    /// therefore not ready and does not replace a working pod. With the webhook on, a usable
    /// groups file that lists no groups means the webhook is the whole job: publishing has
    /// nothing to wait for (the `webhook` and `redis` checks still apply).
    fn set_readiness(&self, state: &CycleState, had_groups: bool, groups: usize) {
        let (ok, detail) = if !had_groups {
            (
                false,
                "no usable groups file yet (see config_reloads)".to_string(),
            )
        } else if groups == 0 && self.webhook.is_some() {
            (
                true,
                "no game server groups: pubsub serves the FleetAutoscaler webhook only".to_string(),
            )
        } else if groups == 0 {
            (
                false,
                "the groups file lists no game server groups".to_string(),
            )
        } else {
            match state.last_any_publish {
                Some(at) if at.elapsed() <= self.ready_within => {
                    (true, "a group was published recently".to_string())
                }
                _ => (
                    false,
                    format!(
                        "no group published in the last {}s: every group is failing (see group_errors)",
                        self.ready_within.as_secs()
                    ),
                ),
            }
        };
        self.health.set(READY_PUBLISHING, ok, detail);
    }

    /// Polls `group` and publishes each page as soon as it is read (see
    /// [`Poller::poll_group`]), in page order. Polling stops at the cycle deadline;
    /// publishing one Redis timeout later (what is left unwritten fails the group), so a
    /// cycle never outlives its deadline by more than that, whatever Redis does.
    async fn poll_and_publish(
        &self,
        group: &str,
        budget: &Budget,
        deadline: Instant,
    ) -> GroupOutcome {
        // A page read just before the deadline gets one Redis timeout to be written.
        let publish_by = deadline + self.publish_grace;
        let (pages, mut received) = tokio::sync::mpsc::unbounded_channel();
        let poll = async move {
            let poll = tokio::time::timeout_at(
                deadline,
                self.poller
                    .poll_group(group, budget, &self.limiter, deadline, &pages),
            )
            .await;
            // Ends the publishing loop below once what was read is published.
            drop(pages);
            match poll {
                Ok(poll) => poll,
                Err(_) => crate::poller::GroupPoll {
                    stats: crate::poller::PollStats::default(),
                    result: Err(crate::poller::PollError {
                        kind: crate::poller::PollErrorKind::Deadline,
                        attempts: 0,
                        message: "the cycle deadline (--cycle-deadline) passed during the poll"
                            .into(),
                    }),
                },
            }
        };
        let publish = async {
            let mut report = PublishReport::default();
            // Last status seen per instance, first-seen order kept (for counts and ids).
            let mut seen: Vec<(String, Option<InstanceStatus>)> = Vec::new();
            let mut index: HashMap<String, usize> = HashMap::new();
            while let Some(page) = received.recv().await {
                let unique = dedupe_keep_last(page);
                for m in &unique {
                    let id = &m.outgoing.instance_id;
                    match index.get(id) {
                        Some(&i) => seen[i].1 = m.status,
                        None => {
                            index.insert(id.clone(), seen.len());
                            seen.push((id.clone(), m.status));
                        }
                    }
                }
                let outgoing: Vec<Outgoing> = unique.into_iter().map(|p| p.outgoing).collect();
                report.add(&self.publisher.publish(&outgoing, publish_by).await);
            }
            (report, seen)
        };
        let (poll, (publish, seen)) = tokio::join!(poll, publish);
        let mut counts: HashMap<&'static str, i64> = HashMap::new();
        for (_, status) in &seen {
            let label = status.map_or(UNKNOWN_STATUS, |s| s.as_str());
            *counts.entry(label).or_default() += 1;
        }
        let unknown = counts.get(UNKNOWN_STATUS).copied().unwrap_or(0);
        if unknown > 0 {
            self.metrics.unknown_statuses.inc_by(unknown as u64);
            tracing::warn!(
                message = "published instance statuses this version does not know, as-is",
                group,
                instances = unknown
            );
        }
        let instance_ids = seen.into_iter().map(|(id, _)| id).collect();
        if let Err(e) = poll.result {
            self.metrics
                .group_errors
                .get_or_create(&GroupReasonLabels {
                    group: group.to_string(),
                    reason: e.kind.label(),
                })
                .inc();
            tracing::warn!(
                message = "cannot poll group this cycle",
                group,
                reason = e.kind.label(),
                attempts = e.attempts,
                pages_published = poll.stats.pages,
                error = %e.message
            );
            return GroupOutcome {
                group: group.to_string(),
                stats: poll.stats,
                failed: true,
                instance_ids,
                publish,
            };
        }
        // The per-status gauge describes whole groups only.
        let labels = InstanceStatus::ALL
            .iter()
            .map(|s| s.as_str())
            .chain([UNKNOWN_STATUS]);
        for status in labels {
            self.metrics
                .instances
                .get_or_create(&GroupStatusLabels {
                    group: group.to_string(),
                    status,
                })
                .set(counts.get(status).copied().unwrap_or(0));
        }
        GroupOutcome {
            group: group.to_string(),
            stats: poll.stats,
            failed: false,
            instance_ids,
            publish,
        }
    }

    fn forget_removed_groups(&self, state: &mut CycleState, groups: &[String]) {
        state.metric_groups.retain(|g| {
            let keep = groups.contains(g);
            if !keep {
                self.metrics
                    .forget_group(g, &PollErrorKind::ALL.map(PollErrorKind::label));
            }
            keep
        });
        for g in groups {
            if !state.metric_groups.contains(g) {
                state.metric_groups.push(g.clone());
            }
        }
    }

    fn finish_cycle(&self, report: &CycleReport) {
        self.metrics
            .cycle_duration
            .observe(report.duration.as_secs_f64());
        Metrics::result(
            &self.metrics.cycles,
            if report.errors == 0 { "ok" } else { "error" },
        );
        if report.errors == 0 {
            self.metrics.last_successful_cycle.set(unix_now());
        }
        tracing::info!(
            message = "cycle done",
            groups = report.groups,
            groups_failed = report.groups_failed,
            api_calls = report.api_calls,
            instances = report.instances,
            invalid_instances = report.invalid_instances,
            groups_published = report.groups_published,
            published = report.published,
            unchanged = report.unchanged,
            stale = report.stale,
            notices_dropped = report.notices_dropped,
            redis_round_trips = report.redis_round_trips,
            publish_errors = report.publish_errors,
            config_error = report.config_error,
            duration_ms = report.duration.as_millis() as u64
        );
    }

    /// Repeats cycles until `shutdown` is cancelled. Each cycle starts `period` plus a random
    /// `0..cycle_jitter` after the previous one started (so never sooner than `period`), and
    /// at least a second after the previous one ended, so an overrun never becomes
    /// back-to-back polling.
    pub async fn run(&self, shutdown: CancellationToken) {
        let mut next = Instant::now() + jitter(self.cycle_jitter);
        loop {
            self.liveness.waiting_until(next);
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep_until(next) => {}
            }
            let started = Instant::now();
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = self.run_cycle() => {}
            }
            next = next_start(started, Instant::now(), self.period) + jitter(self.cycle_jitter);
        }
    }
}

/// When the next cycle may start: a period after this one started, but never sooner than
/// [`MIN_GAP`] after it ended, so an overrunning cycle is not followed at once by the next.
pub fn next_start(started: Instant, ended: Instant, period: Duration) -> Instant {
    (started + period).max(ended + MIN_GAP)
}

/// One entry per instance of a page, even if it lists an instance twice: the later entry
/// wins. First-seen order is kept. (Across pages, each page is published in order, so a
/// later page's entry lands on top of an earlier one's.)
pub fn dedupe_keep_last(polled: Vec<crate::poller::Polled>) -> Vec<crate::poller::Polled> {
    let mut index: HashMap<String, usize> = HashMap::with_capacity(polled.len());
    let mut unique: Vec<crate::poller::Polled> = Vec::with_capacity(polled.len());
    for m in polled {
        match index.get(&m.outgoing.instance_id) {
            Some(&i) => unique[i] = m,
            None => {
                index.insert(m.outgoing.instance_id.clone(), unique.len());
                unique.push(m);
            }
        }
    }
    unique
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or_default()
}

/// One group's share of a cycle.
struct GroupOutcome {
    group: String,
    stats: crate::poller::PollStats,
    failed: bool,
    instance_ids: Vec<String>,
    publish: PublishReport,
}

/// Runs the whole process until SIGTERM/SIGINT: signals, admin server, cycles.
pub async fn serve(config: Config) -> Result<(), Error> {
    if config.redis_url.is_none() {
        // Only `--queue-url` can leave it unset (clap checks): the queue alone.
        return crate::queue::serve_alone(config)
            .await
            .map_err(Error::Queue);
    }
    let shutdown = CancellationToken::new();
    // First, so a signal during start-up is not lost.
    let signals = lastcall_common::shutdown::install(shutdown.clone()).map_err(Error::Signals)?;
    tracing::info!(
        message = "starting",
        version = env!("CARGO_PKG_VERSION"),
        config_file = %config.config_file.display(),
        period_s = config.period.as_secs_f64(),
        redis = ?config.redis_url.as_ref().map(ToString::to_string),
        region = ?config.aws_region,
        gamelift_endpoint = ?config.gamelift_endpoint,
        publish_unchanged = config.publish_unchanged,
        concurrency = config.concurrency
    );
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|source| Error::Bind {
            addr: config.listen,
            source,
        })?;
    let webhook_listener = match config.webhook.webhook_listen {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .map_err(|source| Error::Bind { addr, source })?,
        ),
        None => None,
    };
    let webhook_tls = match (
        &config.webhook.webhook_tls_cert,
        &config.webhook.webhook_tls_key,
    ) {
        (Some(cert), Some(key)) => Some(Arc::new(
            ReloadingCert::load(cert, key).map_err(Error::WebhookTls)?,
        )),
        _ => None,
    };
    let gamelift = crate::poller::gamelift_client(&config, None).await;
    let pubsub = Arc::new(Pubsub::new(&config, gamelift)?);
    if let Some(w) = pubsub.webhook() {
        // In-cluster credentials (the chart mounts a token with read access to Nodes and
        // Fleets) or a kubeconfig. Without either the webhook still answers: entries end
        // by age alone, and held answers keep status.replicas.
        match kube::Client::try_default().await {
            Ok(client) => w.attach_kube(client),
            Err(e) => tracing::warn!(
                message = "no Kubernetes API client: the webhook cannot see gone Nodes or a held Fleet's spec",
                error = %e,
                hint = "run in the cluster with the chart's RBAC, or set KUBECONFIG",
            ),
        }
    }
    let queue = match (pubsub.queue_metrics(), config.queue.queue_url.is_some()) {
        (Some(metrics), true) => {
            let kube = kube::Client::try_default()
                .await
                .map_err(|e| Error::Queue(crate::queue::ServeError::Kube(e)))?;
            let sqs = crate::queue::sqs_client(
                config.aws_region.as_deref(),
                config.queue.sqs_endpoint.as_deref(),
                config.queue.queue_wait,
                None,
            )
            .await;
            crate::queue::Queue::new(
                &config.queue,
                sqs,
                kube,
                metrics.clone(),
                pubsub.health().clone(),
            )
        }
        _ => None,
    };
    let mut admin = tokio::spawn(admin::serve(
        listener,
        pubsub.admin_router(),
        shutdown.clone(),
    ));
    let mut webhook = match (pubsub.webhook(), webhook_listener) {
        (Some(w), Some(listener)) => {
            tracing::info!(
                message = "FleetAutoscaler webhook listening",
                addr = %config.webhook.webhook_listen.map(|a| a.to_string()).unwrap_or_default(),
                tls = webhook_tls.is_some(),
                buffer = %w.policy().buffer(),
                min_replicas = w.policy().min(),
                max_replicas = w.policy().max(),
                drain_state_max_age_s = config.webhook.webhook_drain_state_max_age.as_secs(),
            );
            Some(tokio::spawn(crate::webhook::serve(
                listener,
                w.clone(),
                webhook_tls,
                shutdown.clone(),
            )))
        }
        _ => None,
    };
    let webhook_ended = async {
        match webhook.as_mut() {
            Some(task) => task.await,
            None => std::future::pending().await,
        }
    };

    let admin_result = tokio::select! {
        ((), ()) = async {
            let queue = async {
                if let Some(q) = &queue {
                    q.run(shutdown.clone()).await;
                }
            };
            tokio::join!(pubsub.run(shutdown.clone()), queue)
        } => None,
        r = &mut admin => Some(r),
        r = webhook_ended => {
            shutdown.cancel();
            let _ = signals.await;
            return match r {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(Error::Webhook(e)),
                Err(join) => Err(Error::Webhook(crate::webhook::ServeError::Io(std::io::Error::other(join.to_string())))),
            };
        }
    };
    shutdown.cancel();
    let admin_result = match admin_result {
        Some(r) => r,
        // Give in-flight scrapes a moment, but never hold up the exit.
        None => match tokio::time::timeout(Duration::from_secs(2), admin).await {
            Ok(r) => r,
            Err(_) => Ok(Ok(())),
        },
    };
    let _ = signals.await;
    tracing::info!(message = "stopped");
    match admin_result {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(Error::Admin(e)),
        Err(join) => Err(Error::Admin(std::io::Error::other(join.to_string()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::poller::Polled;
    use lastcall_common::fleetiq::InstanceStatus;

    /// One instant for every test poll, so polls are told apart by offsets from it.
    fn origin() -> tokio::time::Instant {
        static ORIGIN: std::sync::OnceLock<tokio::time::Instant> = std::sync::OnceLock::new();
        *ORIGIN.get_or_init(tokio::time::Instant::now)
    }

    fn polled(iid: &str, status: InstanceStatus, at: u64) -> Polled {
        Polled {
            outgoing: Outgoing {
                instance_id: iid.into(),
                body: status.as_str().into(),
                polled_at: origin() + Duration::from_millis(at),
            },
            status: Some(status),
        }
    }

    #[test]
    fn a_duplicate_across_pages_keeps_the_later_entry() {
        let out = dedupe_keep_last(vec![
            polled("i-1", InstanceStatus::Active, 1),
            polled("i-2", InstanceStatus::Active, 1),
            polled("i-1", InstanceStatus::Draining, 2),
        ]);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].status, Some(InstanceStatus::Draining));
        assert_eq!(
            out[0].outgoing.polled_at,
            origin() + Duration::from_millis(2)
        );
        assert_eq!(out[1].outgoing.instance_id, "i-2");
    }

    #[test]
    fn an_overrun_is_not_followed_at_once_by_the_next_cycle() {
        let t0 = Instant::now();
        let period = Duration::from_secs(60);
        assert_eq!(
            next_start(t0, t0 + Duration::from_secs(5), period),
            t0 + period
        );
        let overran = t0 + Duration::from_secs(75);
        assert_eq!(next_start(t0, overran, period), overran + MIN_GAP);
    }

    #[test]
    fn groups_that_missed_go_first_in_file_order() {
        let groups: Vec<String> = ["a", "b", "c", "d"].map(String::from).to_vec();
        let order = failed_first(&groups, |g| g == "c" || g == "d");
        assert_eq!(order, ["c", "d", "a", "b"]);
    }
}
