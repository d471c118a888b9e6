//! Who may read `/metrics` (`--metrics-auth`).
//!
//! On the host network the agent's listener is on the node's own address, which a cloud may
//! NAT to a public one. `/metrics` says which matches run on the node and when it drains,
//! so with `kubernetes` it answers only a caller whose bearer token the API server
//! authenticates (TokenReview) and who may `get` the non-resource URL `/metrics`
//! (SubjectAccessReview): the convention of Kubernetes' own components, so the ClusterRole
//! a Prometheus already has for them works here too.
//!
//! - No token, a malformed one, or one the API server rejects: 401, with
//!   `WWW-Authenticate: Bearer`. A valid token whose user may not: 403, naming the user.
//! - A review that fails (the API server unreachable, slow or refusing the agent) fails
//!   closed: 503, `lastcall_metrics_auth_review_failures_total{review,reason}` and a log
//!   line. The probes are on another listener, or another route, and never wait on it.
//! - Recent decisions are reused and new tokens are reviewed within a budget ([`gate`]), so
//!   a flood of random tokens grows no memory and costs the API server a few reviews a
//!   second; past the budget a new token gets 503 without a review.

mod bearer;
mod cache;
mod gate;
mod review;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::metrics::{Metrics, ResultLabel, ReviewReason};
use gate::{Gate, Lookup};
use review::Decision;

pub use bearer::MAX_TOKEN_BYTES;
pub use gate::{ALLOWED_TTL, REVIEW_BURST, REVIEW_EVERY};

/// The most one request waits for its reviews (a Prometheus scrape times out at 10 s).
pub const REVIEW_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the log says that new tokens were refused for want of budget.
const THROTTLE_LOG_EVERY: Duration = Duration::from_secs(30);

/// `--metrics-auth`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Anyone who reaches the listener reads /metrics.
    #[default]
    None,
    /// A bearer token the API server authenticates and authorizes for `get` on /metrics.
    Kubernetes,
}

/// What a request to a guarded route gets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Allowed,
    /// 401, and why.
    Unauthenticated(&'static str),
    /// 403: the user, who may not `get` `/metrics`.
    Forbidden(String),
    /// 503: a review failed.
    Unavailable,
    /// 503: a new token, and no review budget left.
    Throttled,
}

impl Verdict {
    fn label(&self) -> &'static str {
        match self {
            Verdict::Allowed => "allowed",
            Verdict::Unauthenticated(_) => "unauthenticated",
            Verdict::Forbidden(_) => "forbidden",
            Verdict::Unavailable => "unavailable",
            Verdict::Throttled => "throttled",
        }
    }

    fn from_decision(d: Decision) -> Verdict {
        match d {
            Decision::Allowed => Verdict::Allowed,
            Decision::Forbidden { user } => Verdict::Forbidden(user),
            Decision::Unauthenticated => {
                Verdict::Unauthenticated("the token is not valid (TokenReview)")
            }
        }
    }
}

impl IntoResponse for Verdict {
    fn into_response(self) -> Response {
        let (code, body) = match &self {
            Verdict::Allowed => (StatusCode::OK, String::new()),
            Verdict::Unauthenticated(why) => (StatusCode::UNAUTHORIZED, format!("Unauthorized: {why}\n")),
            Verdict::Forbidden(user) => (
                StatusCode::FORBIDDEN,
                format!(
                    "Forbidden: user {user:?} may not get /metrics (a ClusterRole with nonResourceURLs [\"/metrics\"] and verb get grants it)\n"
                ),
            ),
            Verdict::Unavailable => (
                StatusCode::SERVICE_UNAVAILABLE,
                "Service Unavailable: the token cannot be checked now (the API server did not answer the review)\n".into(),
            ),
            Verdict::Throttled => (
                StatusCode::SERVICE_UNAVAILABLE,
                "Service Unavailable: too many new tokens; try again\n".into(),
            ),
        };
        let mut r = (code, body).into_response();
        let h = r.headers_mut();
        match self {
            Verdict::Unauthenticated(_) => {
                h.insert(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer realm=\"lastcall-agent\""),
                );
            }
            Verdict::Unavailable | Verdict::Throttled => {
                h.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            Verdict::Allowed | Verdict::Forbidden(_) => {}
        }
        r
    }
}

/// Refusals for want of budget since the last log line about them.
#[derive(Debug, Default)]
struct Throttles {
    count: u64,
    logged: Option<Instant>,
}

struct Inner {
    client: kube::Client,
    metrics: Metrics,
    gate: Mutex<Gate>,
    throttles: Mutex<Throttles>,
}

/// The check in front of `/metrics` under `--metrics-auth=kubernetes`. Cheap to clone.
#[derive(Clone)]
pub struct Guard {
    inner: Arc<Inner>,
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Guard {
    /// Reviews go through `client`: the agent's own, with its deadline and its 429 pacing.
    pub fn new(client: kube::Client, metrics: Metrics) -> Self {
        Self {
            inner: Arc::new(Inner {
                client,
                metrics,
                gate: Mutex::new(Gate::new(Instant::now())),
                throttles: Mutex::new(Throttles::default()),
            }),
        }
    }

    /// `router` with each of its routes behind the guard (unknown paths stay 404s, never
    /// reviewed).
    pub fn protect(self, router: Router) -> Router {
        router.route_layer(middleware::from_fn_with_state(self, guard))
    }

    /// The verdict for a request with `headers`, counted by result.
    pub async fn verdict(&self, headers: &HeaderMap) -> Verdict {
        let v = self.decide(headers).await;
        self.inner
            .metrics
            .metrics_auth
            .get_or_create(&ResultLabel { result: v.label() })
            .inc();
        v
    }

    async fn decide(&self, headers: &HeaderMap) -> Verdict {
        let token = match bearer::token(headers) {
            Ok(t) => t,
            Err(missing) => return Verdict::Unauthenticated(missing.describe()),
        };
        let key: cache::Key = Sha256::digest(token.as_bytes()).into();
        let lookup = locked(&self.inner.gate).lookup(&key, Instant::now());
        match lookup {
            Lookup::Known(d) => return Verdict::from_decision(d),
            Lookup::Throttled => {
                self.throttled();
                return Verdict::Throttled;
            }
            Lookup::Review => {}
        }
        match review::decide(&self.inner.client, token, Instant::now() + REVIEW_TIMEOUT).await {
            Ok(d) => {
                match &d {
                    Decision::Allowed => debug!(message = "metrics auth: a scraper was allowed"),
                    Decision::Forbidden { user } => {
                        info!(message = "metrics auth: refused a user without get on /metrics (403)", user = %user)
                    }
                    Decision::Unauthenticated => {
                        debug!(message = "metrics auth: the API server rejected a token (401)")
                    }
                }
                locked(&self.inner.gate).record(key, &d, Instant::now());
                Verdict::from_decision(d)
            }
            Err(f) => {
                self.inner
                    .metrics
                    .metrics_auth_review_failures
                    .get_or_create(&ReviewReason {
                        review: f.review.label(),
                        reason: f.reason.label(),
                    })
                    .inc();
                warn!(
                    message = "metrics auth: a review failed; /metrics answers 503 until the API server decides",
                    review = f.review.label(),
                    reason = f.reason.label(),
                    hint = if f.reason == review::Reason::Refused {
                        "the agent's ServiceAccount needs create on tokenreviews and subjectaccessreviews"
                    } else {
                        ""
                    },
                    error = %f.detail,
                );
                Verdict::Unavailable
            }
        }
    }

    /// Counts a refusal for want of budget; logs them at most every [`THROTTLE_LOG_EVERY`].
    fn throttled(&self) {
        let now = Instant::now();
        let mut t = locked(&self.inner.throttles);
        t.count += 1;
        if t.logged
            .is_none_or(|at| now.duration_since(at) >= THROTTLE_LOG_EVERY)
        {
            warn!(
                message = "metrics auth: more new tokens than the review budget; refusing them (503) without review",
                refused = t.count,
                budget = format!(
                    "{REVIEW_BURST} at once, then one per {} ms",
                    REVIEW_EVERY.as_millis()
                ),
            );
            t.count = 0;
            t.logged = Some(now);
        }
    }
}

async fn guard(State(g): State<Guard>, req: Request, next: Next) -> Response {
    match g.verdict(req.headers()).await {
        Verdict::Allowed => next.run(req).await,
        refused => refused.into_response(),
    }
}

/// `/metrics` for a listener: behind the guard under `kubernetes`, as is under `none`.
pub fn metrics_routes(
    mode: Mode,
    router: Router,
    client: &kube::Client,
    metrics: &Metrics,
) -> Router {
    match mode {
        Mode::None => router,
        Mode::Kubernetes => Guard::new(client.clone(), metrics.clone()).protect(router),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_refusal_says_what_to_do_in_its_status_and_headers() {
        let r = Verdict::Unauthenticated("no bearer token").into_response();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(
            r.headers()[header::WWW_AUTHENTICATE],
            "Bearer realm=\"lastcall-agent\""
        );
        let r = Verdict::Forbidden("system:serviceaccount:x:y".into()).into_response();
        assert_eq!(r.status(), StatusCode::FORBIDDEN);
        assert!(r.headers().get(header::WWW_AUTHENTICATE).is_none());
        for v in [Verdict::Unavailable, Verdict::Throttled] {
            let r = v.into_response();
            assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        }
    }
}
