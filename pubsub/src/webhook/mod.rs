//! The disruption-aware FleetAutoscaler webhook.
//!
//! Agones' controller POSTs a `FleetAutoscaleReview` per Fleet every sync period and
//! scales the Fleet to the `replicas` of the answer. This answers with Agones' Buffer
//! policy ([`policy`]) plus the Fleet's Ready servers on draining nodes, read from the drain
//! state agents publish in Redis ([`drain`]), so replacements start before that capacity
//! is gone. Layers: [`settings`] (its flags), [`review`] (the wire contract), [`policy`]
//! (pure), [`drain`] (Redis, bounded), [`kube`] (Nodes and Fleets, bounded, optional),
//! [`held`] (how long each Fleet is held), [`tls`] (HTTPS), and the handler here. It
//! imports nothing of the poller or the publisher, only the metric definitions below all
//! of them.
//!
//! A review that can be answered always gets a 200, within a few bounded reads: where the
//! drain state is not fully known (Redis unreadable or lost, a stale entry of a live Node
//! naming the Fleet) the answer is *held*: the plain buffer plus what can be trusted, never
//! below the Fleet's own `spec.replicas`, so it never scales down on a guess and never
//! stops a Fleet from growing. A bad per-Fleet setting is ignored with a warning (the
//! flags answer). A review that cannot be answered (bad JSON, missing fields, negative
//! counts) gets a 400 with the reason, so the FleetAutoscaler reports an error instead of
//! scaling on guesses.

pub mod drain;
pub mod fleets;
pub mod held;
pub mod kube;
pub mod policy;
pub mod review;
pub mod settings;
pub mod tls;

pub use settings::Settings;

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use lastcall_common::admin::Health;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::metrics::{BoundLabels, Metrics, ReasonLabels, SourceLabels, WebhookMetrics};
use drain::{DrainReader, Lookup};
use fleets::{FleetCache, FleetSize};
use held::HeldFleets;
use kube::{KubeReads, NodeSeen};
use lastcall_common::drain_state::Snapshot;
use policy::{Buffer, FleetCounts, Overrides, Policy, PolicyError};
use review::{Review, ReviewError};

/// Largest review accepted. Agones sends the Fleet's labels and annotations, which may
/// carry a `kubectl` last-applied-configuration; Kubernetes caps an object's annotations at
/// 256 KiB together, so a real review is well under this.
pub const MAX_BODY_BYTES: usize = 512 * 1024;

/// Reviews read and answered at once; more wait (their bodies unread) for a turn. Bounds
/// the memory that bodies take, whatever callers send: an answer takes a millisecond or a
/// bounded Redis read, so Agones' reviews are not kept waiting long by this.
pub const MAX_IN_FLIGHT: usize = 32;

/// Every answer is sent within this of its request's arrival (body, Redis and Node reads
/// together): Agones gives up on a webhook after 15 s.
pub const ANSWER_WITHIN: Duration = Duration::from_secs(12);

/// Longest a client may take to send a review's body once its headers are in (the
/// headers have their own limit): a client that trickles a body is cut off (408) instead
/// of holding one of the listener's connections for ever.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// Fleet annotations that override the service-wide settings for that Fleet.
pub const ANNOTATION_BUFFER: &str = "lastcall.dev/autoscaler-buffer";
pub const ANNOTATION_MIN: &str = "lastcall.dev/autoscaler-min-replicas";
pub const ANNOTATION_MAX: &str = "lastcall.dev/autoscaler-max-replicas";

/// Query parameters of the webhook URL that override the settings (they win over
/// annotations).
pub const QUERY_BUFFER: &str = "buffer";
pub const QUERY_MIN: &str = "min";
pub const QUERY_MAX: &str = "max";

/// Name of pubsub's readiness check that the webhook is serving (present only when the
/// webhook is configured).
pub const READY_WEBHOOK: &str = "webhook";

/// The webhook: service-wide policy, drain state reader, metrics.
#[derive(Debug)]
pub struct Webhook {
    policy: Policy,
    reader: DrainReader,
    /// Bound of each Kubernetes read (the same as Redis').
    timeout: Duration,
    /// Set once a Kubernetes client is attached ([`Webhook::attach_kube`]).
    kube: OnceLock<KubeReads>,
    /// Every Fleet's `spec.replicas`, from a watch (once a client is attached).
    fleets: FleetCache,
    held: HeldFleets,
    /// Turns for reviews ([`MAX_IN_FLIGHT`]).
    turns: Arc<tokio::sync::Semaphore>,
    /// Stops the Fleet watch when the webhook is dropped.
    stop: CancellationToken,
    metrics: WebhookMetrics,
    /// pubsub's readiness: [`serve`] sets [`READY_WEBHOOK`] while it serves.
    health: Health,
}

impl Drop for Webhook {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// An answer: the status and body.
struct Answer {
    status: StatusCode,
    body: Vec<u8>,
}

impl Webhook {
    pub fn new(
        policy: Policy,
        reader: DrainReader,
        timeout: Duration,
        metrics: WebhookMetrics,
        health: Health,
    ) -> Self {
        Self {
            policy,
            reader,
            timeout,
            kube: OnceLock::new(),
            fleets: FleetCache::default(),
            held: HeldFleets::default(),
            turns: Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT)),
            stop: CancellationToken::new(),
            metrics,
            health,
        }
    }

    /// Lets the webhook read Nodes (an entry of a gone Node counts for nothing and holds
    /// nothing) and watch Fleets (a held answer keeps `spec.replicas`; only Fleets that
    /// exist are tracked). Only the first call counts. Must run inside Tokio.
    pub fn attach_kube(&self, client: ::kube::Client) {
        let reads = KubeReads::new(client.clone(), self.timeout, self.metrics.clone());
        if self.kube.set(reads).is_ok() {
            tokio::spawn(
                self.fleets
                    .clone()
                    .run(client, self.metrics.clone(), self.stop.clone()),
            );
        }
    }

    /// What the webhook's Fleet cache says of Fleet `namespace/name`.
    pub fn fleet_size(&self, namespace: &str, name: &str) -> FleetSize {
        self.fleets.size(namespace, name)
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// `POST /` and `POST /scale` answer reviews; `GET /healthz` says the listener is up.
    pub fn router(self: &Arc<Self>) -> Router {
        Router::new()
            .route("/", post(scale))
            .route("/scale", post(scale))
            .route("/healthz", get(|| async { "ok\n" }))
            .layer(DefaultBodyLimit::disable())
            .with_state(self.clone())
    }

    async fn answer(&self, query: Option<&str>, body: &[u8], deadline: Instant) -> Answer {
        let review = match Review::parse(body) {
            Ok(r) => r,
            Err(e) => return self.reject(&e, None),
        };
        let policy = self.policy_for(&review, query);
        let lookup = match self.reader.snapshot(deadline).await {
            Ok(snap) => {
                self.lookup(&snap, &review.namespace, &review.name, deadline)
                    .await
            }
            Err(reason) => Lookup::Unavailable(reason),
        };
        let fleet = FleetCounts {
            replicas: review.replicas,
            allocated: review.allocated_replicas,
        };
        let hold = lookup.hold();
        let hold_at = match hold {
            None => None,
            Some(reason) => {
                let size = self.fleets.size(&review.namespace, &review.name);
                Metrics::result(&self.metrics.fleet_sizes, size.label());
                match size {
                    FleetSize::Known(spec) => Some(spec),
                    other => return self.unknown_size(&review, reason, other),
                }
            }
        };
        let d = policy::decide(&policy, fleet, lookup.extra(), hold_at);
        // Only Fleets that exist are tracked: the names come from callers.
        let held_for = if self.fleets.exists(&review.namespace, &review.name) {
            self.held
                .answered(&self.metrics, &review.namespace, &review.name, d.held)
        } else {
            Duration::ZERO
        };
        if d.held {
            let reason = hold.unwrap_or("unknown");
            self.metrics
                .held
                .get_or_create(&ReasonLabels { reason })
                .inc();
            tracing::info!(
                message = "drain state not fully known: scale-down refused, size held",
                namespace = %review.namespace,
                fleet = %review.name,
                reason,
                current = review.replicas,
                held_at = d.replicas,
                buffer_target = d.buffer_target,
                held_for_s = held_for.as_secs(),
            );
        }
        let result = match d.replicas.cmp(&review.replicas) {
            std::cmp::Ordering::Greater => "scale_up",
            std::cmp::Ordering::Less => "scale_down",
            std::cmp::Ordering::Equal => "unchanged",
        };
        Metrics::result(&self.metrics.requests, result);
        self.metrics.extra_replicas.inc_by(d.extra);
        if let Some(bound) = d.clamped {
            self.metrics
                .clamped
                .get_or_create(&BoundLabels {
                    bound: bound.label(),
                })
                .inc();
        }
        let drain_state = match lookup {
            Lookup::Read { .. } => "read",
            Lookup::Unavailable(reason) => reason,
        };
        if d.extra > 0 {
            tracing::info!(
                message = "asking for replacements of Ready servers on draining nodes",
                namespace = %review.namespace,
                fleet = %review.name,
                uid = %review.uid,
                allocated = review.allocated_replicas,
                current = review.replicas,
                buffer_target = d.buffer_target,
                extra = d.extra,
                replicas = d.replicas,
                clamped = d.clamped.map(policy::Bound::label),
            );
        } else {
            tracing::debug!(
                message = "review answered",
                namespace = %review.namespace,
                fleet = %review.name,
                uid = %review.uid,
                allocated = review.allocated_replicas,
                current = review.replicas,
                buffer_target = d.buffer_target,
                replicas = d.replicas,
                clamped = d.clamped.map(policy::Bound::label),
                drain_state,
            );
        }
        Answer {
            status: StatusCode::OK,
            body: review::response_body(
                review.api_version.as_deref(),
                &review.uid,
                d.scale,
                d.replicas,
            ),
        }
    }

    /// The Fleet's drain state, with the entries of Nodes that are gone set aside: they
    /// count for nothing and hold nothing (the GameServerSet already replaces what was on
    /// them).
    async fn lookup(
        &self,
        snap: &Snapshot,
        namespace: &str,
        name: &str,
        deadline: Instant,
    ) -> Lookup {
        let naming: Vec<&str> = snap
            .nodes_naming(namespace, name)
            .map(|e| e.node.as_str())
            .collect();
        let seen: HashMap<String, NodeSeen> = match self.kube.get() {
            Some(k) if !naming.is_empty() => k.nodes(&naming, deadline).await,
            _ => HashMap::new(),
        };
        let f = snap.fleet(namespace, name, |e| {
            seen.get(&e.node).is_some_and(|s| kube::is_gone(*s, e))
        });
        if !f.gone.is_empty() {
            self.metrics
                .drain_state_skipped
                .get_or_create(&ReasonLabels {
                    reason: "node_gone",
                })
                .inc_by(f.gone.len() as u64);
            tracing::debug!(
                message = "drain state of Nodes that are gone counts for nothing",
                namespace,
                fleet = name,
                nodes = ?f.gone,
            );
        }
        let hold = if self.reader.settling(snap) {
            Some("redis_restarted")
        } else if !f.holding.is_empty() {
            f.hold_reason
        } else {
            None
        };
        Lookup::Read {
            extra: f.extra,
            hold,
        }
    }

    /// A held answer whose floor, the Fleet's `spec.replicas`, is not known (no client, the
    /// Fleets not listed yet or the watch failed, or no such Fleet): any number would be a
    /// guess (`status.replicas` ratchets a rolling update up and shrinks a scale-up in
    /// progress), so the answer is an error, and Agones keeps the Fleet as it is until a
    /// later sync. Counted; logged at most once a minute.
    fn unknown_size(&self, review: &Review, hold: &'static str, size: FleetSize) -> Answer {
        Metrics::result(&self.metrics.requests, "unavailable");
        self.metrics
            .held
            .get_or_create(&ReasonLabels { reason: hold })
            .inc();
        if self.held.due_warning() {
            tracing::warn!(
                message = "held answer refused: the Fleet's spec.replicas is not known, so Agones keeps the Fleet as it is",
                namespace = %review.namespace,
                fleet = %review.name,
                hold,
                fleet_size = size.label(),
                hint = "the webhook watches fleets.agones.dev (the chart grants list and watch); absent: no such Fleet",
            );
        }
        Answer {
            status: StatusCode::SERVICE_UNAVAILABLE,
            body: format!(
                "held ({hold}): the Fleet's spec.replicas is not known ({}); the Fleet is left as it is\n",
                size.label()
            )
            .into_bytes(),
        }
    }

    /// The service-wide policy with this Fleet's overrides: annotations, then the query.
    /// An override that is not valid (a typo in an annotation) is ignored with a warning
    /// and `bad_overrides_total{source}`, never a 400: Agones treats a 400 as "leave the
    /// Fleet as it is", so one typo would stop it growing for good.
    fn policy_for(&self, review: &Review, query: Option<&str>) -> Policy {
        let from_annotations = overrides(
            [ANNOTATION_BUFFER, ANNOTATION_MIN, ANNOTATION_MAX],
            review
                .annotations
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str())),
            "annotation",
        );
        let pairs: Vec<(String, String)> = query
            .map(|q| {
                url::form_urlencoded::parse(q.as_bytes())
                    .into_owned()
                    .collect()
            })
            .unwrap_or_default();
        let from_query = overrides(
            [QUERY_BUFFER, QUERY_MIN, QUERY_MAX],
            pairs.iter().map(|(k, v)| (k.as_str(), v.as_str())),
            "query parameter",
        );
        let usable = |o: Result<Overrides, String>, source: &'static str| match o {
            Ok(o) => o,
            Err(e) => {
                self.bad_override(review, source, &e);
                Overrides::default()
            }
        };
        let o = usable(from_annotations, "annotation").or(usable(from_query, "query"));
        match self.policy.with(&o) {
            Ok(p) => p,
            Err(e) => {
                self.bad_override(
                    review,
                    "combination",
                    &format!(
                        "the settings for this Fleet are invalid together (flags, {ANNOTATION_BUFFER}/-min-replicas/-max-replicas annotations, ?buffer=&min=&max=): {e}"
                    ),
                );
                self.policy
            }
        }
    }

    fn bad_override(&self, review: &Review, source: &'static str, error: &str) {
        self.metrics
            .bad_overrides
            .get_or_create(&SourceLabels { source })
            .inc();
        tracing::warn!(
            message = "ignoring invalid per-Fleet autoscaler settings: answering with the flags' settings",
            source,
            error,
            namespace = %review.namespace,
            fleet = %review.name,
            hint = "fix the lastcall.dev/autoscaler-* annotation or the webhook URL's query",
        );
    }

    fn reject(&self, e: &ReviewError, review: Option<&Review>) -> Answer {
        Metrics::result(&self.metrics.requests, "rejected");
        self.metrics
            .rejected
            .get_or_create(&ReasonLabels {
                reason: e.metric_label(),
            })
            .inc();
        tracing::warn!(
            message = "FleetAutoscaleReview refused",
            reason = e.metric_label(),
            error = %e,
            namespace = review.map(|r| r.namespace.as_str()),
            fleet = review.map(|r| r.name.as_str()),
            uid = review.map(|r| r.uid.as_str()),
        );
        Answer {
            status: StatusCode::BAD_REQUEST,
            body: format!("bad FleetAutoscaleReview: {e}\n").into_bytes(),
        }
    }
}

/// Reads the three settings from `pairs` whose keys are `keys` (buffer, min, max); other
/// keys are ignored. A bad value names where it came from.
fn overrides<'a>(
    keys: [&str; 3],
    pairs: impl Iterator<Item = (&'a str, &'a str)>,
    source: &str,
) -> Result<Overrides, String> {
    let mut o = Overrides::default();
    for (k, v) in pairs {
        let bad = |e: PolicyError| format!("{source} {k}={v:?}: {e}");
        if k == keys[0] {
            o.buffer = Some(v.parse::<Buffer>().map_err(bad)?);
        } else if k == keys[1] {
            o.min = Some(policy::parse_replicas(v).map_err(bad)?);
        } else if k == keys[2] {
            o.max = Some(policy::parse_replicas(v).map_err(bad)?);
        }
    }
    Ok(o)
}

async fn scale(State(webhook): State<Arc<Webhook>>, uri: Uri, body: Body) -> Response {
    let started = Instant::now();
    let deadline = started + ANSWER_WITHIN;
    // A turn first, the body after: bodies waiting for a turn are not read into memory.
    let turn = tokio::time::timeout_at(deadline, webhook.turns.clone().acquire_owned()).await;
    let answer = match turn {
        Ok(Ok(_turn)) => {
            webhook
                .read_and_answer(uri.query(), body, started, deadline)
                .await
        }
        _ => webhook.refuse_body(
            StatusCode::SERVICE_UNAVAILABLE,
            "busy",
            &format!(
                "no turn within {}s: {MAX_IN_FLIGHT} reviews are being answered",
                ANSWER_WITHIN.as_secs()
            ),
        ),
    };
    webhook
        .metrics
        .request_duration
        .observe(started.elapsed().as_secs_f64());
    let content_type = if answer.status == StatusCode::OK {
        "application/json"
    } else {
        "text/plain; charset=utf-8"
    };
    (
        answer.status,
        [(header::CONTENT_TYPE, content_type)],
        answer.body,
    )
        .into_response()
}

impl Webhook {
    /// Reads the body (bounded in size and time) and answers it.
    async fn read_and_answer(
        &self,
        query: Option<&str>,
        body: Body,
        started: Instant,
        deadline: Instant,
    ) -> Answer {
        let body_by = (started + BODY_TIMEOUT).min(deadline);
        match tokio::time::timeout_at(body_by, axum::body::to_bytes(body, MAX_BODY_BYTES)).await {
            Ok(Ok(body)) => self.answer(query, &body, deadline).await,
            Ok(Err(e)) => {
                self.refuse_body(StatusCode::PAYLOAD_TOO_LARGE, "too_large", &e.to_string())
            }
            Err(_) => self.refuse_body(
                StatusCode::REQUEST_TIMEOUT,
                "body_timeout",
                &format!("the body did not arrive within {}s", BODY_TIMEOUT.as_secs()),
            ),
        }
    }
}

impl Webhook {
    /// A body that could not be read whole: too large (413) or too slow (408).
    fn refuse_body(&self, status: StatusCode, reason: &'static str, error: &str) -> Answer {
        Metrics::result(&self.metrics.requests, "rejected");
        self.metrics
            .rejected
            .get_or_create(&ReasonLabels { reason })
            .inc();
        tracing::warn!(message = "FleetAutoscaleReview body refused", reason, error);
        Answer {
            status,
            body: format!("{error}\n").into_bytes(),
        }
    }
}

/// Serves the webhook on `listener` until `shutdown`: HTTPS when `tls` is given (its
/// certificate is re-read on rotation), plain HTTP otherwise.
pub async fn serve(
    listener: TcpListener,
    webhook: Arc<Webhook>,
    tls: Option<Arc<tls::ReloadingCert>>,
    shutdown: CancellationToken,
) -> Result<(), ServeError> {
    let router = webhook.router();
    // Every answer is either from the drain state or explicitly held (never a guessed
    // scale-down), so serving is all this check asks.
    let serving = || {
        webhook.health.set(
            READY_WEBHOOK,
            true,
            "serving reviews (held, no scale-down, while the drain state cannot be read)",
        );
    };
    let result = match tls {
        None => {
            serving();
            lastcall_common::admin::serve(listener, router, shutdown)
                .await
                .map_err(ServeError::Io)
        }
        Some(cert) => {
            let config = cert.server_config().map_err(ServeError::Tls)?;
            tokio::spawn(cert.watch(webhook.metrics.clone(), shutdown.clone()));
            serving();
            tls::serve(listener, router, config, shutdown)
                .await
                .map_err(ServeError::Io)
        }
    };
    webhook
        .health
        .set(READY_WEBHOOK, false, "the webhook listener stopped");
    result
}

/// Why the webhook server stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("webhook TLS: {0}")]
    Tls(#[source] tls::TlsError),
    #[error("webhook HTTP server failed: {0}")]
    Io(#[source] std::io::Error),
}
