//! The disruption-aware FleetAutoscaler webhook.
//!
//! Agones' controller POSTs a `FleetAutoscaleReview` per Fleet every sync period and
//! scales the Fleet to the `replicas` of the answer. This answers with Agones' Buffer
//! policy ([`policy`]) plus the Fleet's Ready servers on draining nodes, read from the drain
//! state agents publish in Redis ([`drain`]), so replacements start before that capacity
//! is gone. Layers: [`settings`] (its flags), [`review`] (the wire contract), [`policy`]
//! (pure), [`drain`] (Redis, bounded), [`tls`] (HTTPS), and the handler here. It imports
//! nothing of the poller or the publisher, only the metric definitions below all of them.
//!
//! A review that can be answered always gets a 200, within `--webhook-redis-timeout` plus
//! microseconds: without drain state (or with a stale entry naming the Fleet) the answer is
//! the plain buffer but never below the Fleet's current size, so it never scales down on a
//! guess. A review that cannot
//! be answered (bad JSON, missing fields, negative counts, a bad per-Fleet setting) gets a
//! 400 with the reason, so the FleetAutoscaler reports an error instead of scaling on
//! guesses.

pub mod drain;
pub mod policy;
pub mod review;
pub mod settings;
pub mod tls;

pub use settings::Settings;

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use lastcall_common::admin::Health;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::metrics::{BoundLabels, Metrics, ReasonLabels, WebhookMetrics};
use drain::{DrainReader, Lookup};
use policy::{Buffer, FleetCounts, Overrides, Policy, PolicyError};
use review::{Review, ReviewError};

/// Largest review accepted. Agones sends the Fleet's labels and annotations, which may
/// carry a `kubectl` last-applied-configuration of several KiB.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;

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
    metrics: WebhookMetrics,
    /// pubsub's readiness: [`serve`] sets [`READY_WEBHOOK`] while it serves.
    health: Health,
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
        metrics: WebhookMetrics,
        health: Health,
    ) -> Self {
        Self {
            policy,
            reader,
            metrics,
            health,
        }
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
            .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
            .with_state(self.clone())
    }

    async fn answer(&self, query: Option<&str>, body: &[u8]) -> Answer {
        let review = match Review::parse(body) {
            Ok(r) => r,
            Err(e) => return self.reject(&e, None),
        };
        let policy = match self.policy_for(&review, query) {
            Ok(p) => p,
            Err(e) => return self.reject(&e, Some(&review)),
        };
        let lookup = self
            .reader
            .extra_ready(&review.namespace, &review.name)
            .await;
        let fleet = FleetCounts {
            replicas: review.replicas,
            allocated: review.allocated_replicas,
        };
        let hold = lookup.hold();
        let d = policy::decide(&policy, fleet, lookup.extra(), hold.is_some());
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
                buffer_target = d.buffer_target,
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

    /// The service-wide policy with this Fleet's overrides: annotations, then the query.
    fn policy_for(&self, review: &Review, query: Option<&str>) -> Result<Policy, ReviewError> {
        let from_annotations = overrides(
            [ANNOTATION_BUFFER, ANNOTATION_MIN, ANNOTATION_MAX],
            review
                .annotations
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str())),
            "annotation",
        )?;
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
        )?;
        let o = from_annotations.or(from_query);
        self.policy.with(&o).map_err(|e| {
            ReviewError::BadOverride(format!(
                "the settings for this Fleet are invalid (flags, {ANNOTATION_BUFFER}/-min-replicas/-max-replicas annotations, ?buffer=&min=&max=): {e}"
            ))
        })
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
) -> Result<Overrides, ReviewError> {
    let mut o = Overrides::default();
    for (k, v) in pairs {
        let bad = |e: PolicyError| ReviewError::BadOverride(format!("{source} {k}={v:?}: {e}"));
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

async fn scale(State(webhook): State<Arc<Webhook>>, uri: Uri, body: Bytes) -> Response {
    let started = Instant::now();
    let answer = webhook.answer(uri.query(), &body).await;
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
