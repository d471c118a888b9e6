//! A deadline on every Kubernetes API request, as a layer of the client's service stack.
//!
//! kube's client has no read timeout by default: one PATCH, DELETE or LIST on a connection
//! that stopped answering would block the single reconciler (and with it the fence after a
//! Spot notice) for good. Each request gets `--request-timeout` from sending to the
//! response's headers; a late one fails like any other request error, is counted by verb and
//! retried by its caller. Watches use a client without this layer (their long polls outlive
//! any request deadline) and a read timeout longer than their `timeoutSeconds`.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::http::{Method, Request};
use tower::{Layer, Service};

use crate::metrics::{Metrics, VerbLabel};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The error a request past its deadline ends with.
#[derive(Debug, thiserror::Error)]
#[error("no answer within the request timeout ({0:?})")]
pub struct RequestTimedOut(pub Duration);

/// Adds the deadline to a service.
#[derive(Clone)]
pub struct RequestDeadline {
    limit: Duration,
    metrics: Metrics,
}

impl RequestDeadline {
    pub fn new(limit: Duration, metrics: Metrics) -> Self {
        Self { limit, metrics }
    }
}

impl<S> Layer<S> for RequestDeadline {
    type Service = Deadlined<S>;

    fn layer(&self, inner: S) -> Deadlined<S> {
        Deadlined {
            inner,
            limit: self.limit,
            metrics: self.metrics.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Deadlined<S> {
    inner: S,
    limit: Duration,
    metrics: Metrics,
}

/// The metric label of a request's verb: a small fixed set.
pub fn verb(method: &Method) -> &'static str {
    match *method {
        Method::GET => "get",
        Method::POST => "post",
        Method::PUT => "put",
        Method::PATCH => "patch",
        Method::DELETE => "delete",
        _ => "other",
    }
}

impl<S, B> Service<Request<B>> for Deadlined<S>
where
    S: Service<Request<B>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let verb = verb(req.method());
        let limit = self.limit;
        let metrics = self.metrics.clone();
        let fut = self.inner.call(req);
        Box::pin(async move {
            match tokio::time::timeout(limit, fut).await {
                Ok(r) => r.map_err(Into::into),
                Err(_) => {
                    metrics
                        .request_timeouts
                        .get_or_create(&VerbLabel { verb })
                        .inc();
                    Err(Box::new(RequestTimedOut(limit)) as BoxError)
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A service that never answers (`true`) or answers at once.
    #[derive(Clone)]
    struct Server(bool);

    impl Service<Request<()>> for Server {
        type Response = ();
        type Error = BoxError;
        type Future = Pin<Box<dyn Future<Output = Result<(), BoxError>> + Send>>;
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
            Poll::Ready(Ok(()))
        }
        fn call(&mut self, _: Request<()>) -> Self::Future {
            let hang = self.0;
            Box::pin(async move {
                if hang {
                    std::future::pending::<()>().await;
                }
                Ok(())
            })
        }
    }

    fn request(method: Method) -> Request<()> {
        let mut r = Request::new(());
        *r.method_mut() = method;
        r
    }

    #[tokio::test]
    async fn a_late_answer_fails_and_is_counted_by_verb() {
        let (metrics, _registry) = Metrics::new();
        let layer = RequestDeadline::new(Duration::from_millis(20), metrics.clone());
        let mut hung = layer.layer(Server(true));
        let err = hung.call(request(Method::PATCH)).await.unwrap_err();
        assert!(err.is::<RequestTimedOut>(), "{err}");
        let mut quick = layer.layer(Server(false));
        assert!(quick.call(request(Method::DELETE)).await.is_ok());
        let count = |verb| {
            metrics
                .request_timeouts
                .get_or_create(&VerbLabel { verb })
                .get()
        };
        assert_eq!((count("patch"), count("delete")), (1, 0));
    }
}
