//! Honouring the API server's 429s, as a layer of the client's service stack.
//!
//! When kube-apiserver's API Priority and Fairness (or max-in-flight) refuses a request it
//! answers `429` with `Retry-After: <seconds>` and a plain-text body, not a `Status`, so
//! kube-rs's error carries no retry hint: only the response headers do, and only a layer
//! sees them. kube's own retry is off (see `kube_client`), so this layer makes the
//! whole client wait: after a refusal, no request of this agent leaves before
//! `Retry-After` plus a jitter (`lastcall_common::backoff::after_retry_after`), drawn per
//! process, so thousands of agents refused at the same moment do not come back together.
//! The wait is in `poll_ready`, so requests queue in the client without a request deadline
//! running; the reconciler also sleeps it out ([`Throttle::remaining`]) instead of planning
//! into a closed gate.
//!
//! Every 429 is throttling: the agent sends no request whose own handler answers 429 (it
//! ends matches with a pod DELETE, not the Eviction API, whose disruption budgets do). A
//! 429 without `Retry-After` is counted and left to the caller's own backoff.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::http::{Request, Response, StatusCode, header};
use lastcall_common::backoff::RetryAfter;
use tokio::time::{Instant, Sleep};
use tower::{Layer, Service};
use tracing::warn;

use crate::metrics::{Metrics, VerbLabel};
use crate::request_deadline::verb;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, Default)]
struct Gate {
    /// No request leaves before this.
    not_before: Option<Instant>,
    jitter: RetryAfter,
}

/// The agent's shared throttle state: one per agent, for every client it builds.
#[derive(Clone)]
pub struct Throttle {
    gate: Arc<Mutex<Gate>>,
    metrics: Metrics,
}

impl Throttle {
    pub fn new(metrics: Metrics) -> Self {
        Self::with_jitter(metrics, RetryAfter::new())
    }

    /// With a given random source (tests).
    pub fn with_jitter(metrics: Metrics, jitter: RetryAfter) -> Self {
        Self {
            gate: Arc::new(Mutex::new(Gate {
                not_before: None,
                jitter,
            })),
            metrics,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Gate> {
        self.gate.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How long the server asked this agent to stay quiet from now.
    pub fn remaining(&self) -> Duration {
        self.not_before()
            .map(|t| t.saturating_duration_since(Instant::now()))
            .unwrap_or(Duration::ZERO)
    }

    fn not_before(&self) -> Option<Instant> {
        self.lock().not_before.filter(|t| *t > Instant::now())
    }

    /// A 429 came back for a request of `verb`, with `retry_after` if the server sent one.
    pub fn refused(&self, verb: &'static str, retry_after: Option<Duration>) {
        self.metrics
            .throttled
            .get_or_create(&VerbLabel { verb })
            .inc();
        let Some(asked) = retry_after else {
            warn!(
                message = "the API server refused a request (429) without Retry-After; retrying with backoff",
                verb
            );
            return;
        };
        let now = Instant::now();
        let mut g = self.lock();
        let open = g.not_before.is_none_or(|t| t <= now);
        // A refusal while the gate is closed answers a request sent before the first one
        // came back: the same burst, not one more refusal in a row.
        let wait = if open {
            g.jitter.refused(asked)
        } else {
            g.jitter.refused_again(asked)
        };
        let until = now + wait;
        g.not_before = Some(g.not_before.map_or(until, |t| t.max(until)));
        if open {
            warn!(
                message = "the API server asked to slow down (429); holding every request",
                verb,
                retry_after_s = asked.as_secs(),
                wait_ms = wait.as_millis() as u64,
                refusals_in_a_row = g.jitter.refusals()
            );
        }
    }

    /// A request was answered with anything but 429.
    pub fn served(&self) {
        self.lock().jitter.served();
    }
}

/// `Retry-After` in seconds (kube-apiserver never sends the HTTP-date form).
pub fn retry_after<B>(res: &Response<B>) -> Option<Duration> {
    let v = res.headers().get(header::RETRY_AFTER)?.to_str().ok()?;
    v.trim().parse::<u64>().ok().map(Duration::from_secs)
}

impl<S> Layer<S> for Throttle {
    type Service = Throttled<S>;

    fn layer(&self, inner: S) -> Throttled<S> {
        Throttled {
            inner,
            throttle: self.clone(),
            sleep: None,
        }
    }
}

pub struct Throttled<S> {
    inner: S,
    throttle: Throttle,
    sleep: Option<Pin<Box<Sleep>>>,
}

impl<S, B, RB> Service<Request<B>> for Throttled<S>
where
    S: Service<Request<B>, Response = Response<RB>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    type Response = Response<RB>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<RB>, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // The gate may move later while we wait (another refusal): look again after each wake.
        while let Some(until) = self.throttle.not_before() {
            match &mut self.sleep {
                Some(s) if s.deadline() == until => {}
                Some(s) => s.as_mut().reset(until),
                None => self.sleep = Some(Box::pin(tokio::time::sleep_until(until))),
            }
            if let Some(s) = &mut self.sleep {
                std::task::ready!(s.as_mut().poll(cx));
            }
        }
        self.sleep = None;
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let verb = verb(req.method());
        let throttle = self.throttle.clone();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let res = fut.await.map_err(Into::into)?;
            if res.status() == StatusCode::TOO_MANY_REQUESTS {
                throttle.refused(verb, retry_after(&res));
            } else {
                throttle.served();
            }
            Ok(res)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Answers 429 with `Retry-After: 1` to the first `refuse` requests, then 200.
    #[derive(Clone)]
    struct Server {
        refuse: usize,
        seen: Arc<AtomicUsize>,
        retry_after: Option<&'static str>,
        /// Refuse with a JSON `Status`, as a handler does (else APF's plain text).
        json: bool,
    }

    impl Service<Request<()>> for Server {
        type Response = Response<()>;
        type Error = BoxError;
        type Future = Pin<Box<dyn Future<Output = Result<Response<()>, BoxError>> + Send>>;
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
            Poll::Ready(Ok(()))
        }
        fn call(&mut self, _: Request<()>) -> Self::Future {
            let n = self.seen.fetch_add(1, Ordering::SeqCst);
            let refuse = n < self.refuse;
            let ra = self.retry_after;
            let json = self.json;
            Box::pin(async move {
                let mut r = Response::new(());
                if refuse {
                    *r.status_mut() = StatusCode::TOO_MANY_REQUESTS;
                    let t = if json {
                        "application/json"
                    } else {
                        "text/plain; charset=utf-8"
                    };
                    r.headers_mut()
                        .insert(header::CONTENT_TYPE, t.parse().expect("header"));
                    if let Some(v) = ra {
                        r.headers_mut()
                            .insert(header::RETRY_AFTER, v.parse().expect("header"));
                    }
                }
                Ok(r)
            })
        }
    }

    fn request(path: &str) -> Request<()> {
        let mut r = Request::new(());
        *r.method_mut() = axum::http::Method::PATCH;
        *r.uri_mut() = path.parse().expect("uri");
        r
    }

    async fn send(svc: &mut Throttled<Server>, path: &str) -> StatusCode {
        std::future::poll_fn(|cx| svc.poll_ready(cx))
            .await
            .expect("ready");
        svc.call(request(path)).await.expect("answer").status()
    }

    fn throttled(metrics: &Metrics) -> u64 {
        metrics
            .throttled
            .get_or_create(&VerbLabel { verb: "patch" })
            .get()
    }

    #[tokio::test]
    async fn after_a_429_no_request_leaves_before_retry_after() {
        let (metrics, _r) = Metrics::new();
        let throttle = Throttle::with_jitter(metrics.clone(), RetryAfter::seeded(3));
        let seen = Arc::new(AtomicUsize::new(0));
        let mut svc = throttle.layer(Server {
            refuse: 1,
            seen: seen.clone(),
            retry_after: Some("1"),
            json: false,
        });
        let start = Instant::now();
        assert_eq!(send(&mut svc, "/api/v1/nodes/n1").await, 429);
        let wait = throttle.remaining();
        assert!(
            wait >= Duration::from_secs(1) && wait < Duration::from_secs(2),
            "{wait:?}"
        );
        assert_eq!(send(&mut svc, "/api/v1/nodes/n1").await, 200);
        assert!(start.elapsed() >= wait, "{:?} < {wait:?}", start.elapsed());
        assert_eq!(seen.load(Ordering::SeqCst), 2);
        assert_eq!(throttled(&metrics), 1);
        assert_eq!(throttle.remaining(), Duration::ZERO);
    }

    /// A 429 is throttling whatever its body: APF's plain text, or a JSON `Status` (a
    /// server, a proxy or a webhook in front of it that answers in JSON). A pod DELETE, how
    /// lastcall ends a match, refused so is held like any other request.
    #[tokio::test]
    async fn every_429_with_retry_after_closes_the_gate_whatever_its_body() {
        let (metrics, _r) = Metrics::new();
        let throttle = Throttle::with_jitter(metrics.clone(), RetryAfter::seeded(3));
        let mut svc = throttle.layer(Server {
            refuse: 1,
            seen: Arc::new(AtomicUsize::new(0)),
            retry_after: Some("1"),
            json: true,
        });
        assert_eq!(
            send(&mut svc, "/api/v1/namespaces/default/pods/p").await,
            429
        );
        assert_eq!(throttled(&metrics), 1);
        assert!(throttle.remaining() >= Duration::from_secs(1));
    }

    #[tokio::test]
    async fn a_429_without_retry_after_is_counted_and_does_not_close_the_gate() {
        let (metrics, _r) = Metrics::new();
        let throttle = Throttle::new(metrics.clone());
        let mut svc = throttle.layer(Server {
            refuse: 1,
            seen: Arc::new(AtomicUsize::new(0)),
            retry_after: None,
            json: false,
        });
        // No Retry-After: counted, the caller's backoff decides.
        assert_eq!(send(&mut svc, "/api/v1/nodes/n1").await, 429);
        assert_eq!(throttled(&metrics), 1);
        assert_eq!(throttle.remaining(), Duration::ZERO);
    }

    #[test]
    fn retry_after_is_read_in_seconds() {
        let with = |v: &str| {
            let mut r = Response::new(());
            r.headers_mut()
                .insert(header::RETRY_AFTER, v.parse().expect("header"));
            retry_after(&r)
        };
        assert_eq!(with("1"), Some(Duration::from_secs(1)));
        assert_eq!(with(" 32 "), Some(Duration::from_secs(32)));
        assert_eq!(with("Wed, 21 Oct 2015 07:28:00 GMT"), None);
        assert_eq!(with("-1"), None);
        assert_eq!(retry_after(&Response::new(())), None);
    }
}
