//! The one HTTP listener every lastcall process has: `/metrics`, `/healthz`, `/readyz`.
//!
//! Readiness is the AND of named checks (for example "redis" and "first_cycle"), each set by
//! the component that owns it, so `/readyz` can say which one is failing.
//!
//! Every HTTP listener of lastcall (this one, the webhook's, plain or TLS) is served by
//! [`serve_with`], with the same limits: a client that does not send a request's headers
//! within [`HEADER_TIMEOUT`] (a new connection, or an idle keep-alive one) is dropped, a
//! connection buffers at most [`MAX_READ_BUFFER`] of a request, and at most
//! [`MAX_CONNECTIONS`] connections are open at once (more wait in the kernel's accept
//! queue). So idle or slow clients cannot grow the process's memory.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// A client that has not sent a request's headers by then is dropped: on a new connection
/// and between requests of a kept-alive one alike.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections open at once per listener. Scrapes, probes and Agones' reviews need a few.
pub const MAX_CONNECTIONS: usize = 256;
/// Most bytes a connection buffers while reading a request (its headers must fit): with
/// [`MAX_CONNECTIONS`], what idle or slow clients can make a listener hold is bounded
/// (hyper's default is about 400 KiB a connection).
pub const MAX_READ_BUFFER: usize = 64 * 1024;
/// How long open requests may finish at shutdown.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// Shared readiness state. Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct Health {
    checks: Arc<Mutex<BTreeMap<&'static str, Check>>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Check {
    ok: bool,
    detail: String,
}

impl Health {
    /// Declares the checks that must pass before the process is ready; all start failing.
    pub fn new(required: &[&'static str]) -> Self {
        let health = Self::default();
        for name in required {
            health.set(name, false, "not yet checked");
        }
        health
    }

    pub fn set(&self, name: &'static str, ok: bool, detail: impl Into<String>) {
        if let Ok(mut checks) = self.checks.lock() {
            checks.insert(
                name,
                Check {
                    ok,
                    detail: detail.into(),
                },
            );
        }
    }

    pub fn is_ready(&self) -> bool {
        self.checks
            .lock()
            .map(|c| c.values().all(|c| c.ok))
            .unwrap_or(false)
    }

    fn report(&self) -> serde_json::Value {
        let checks = self.checks.lock().map(|c| c.clone()).unwrap_or_default();
        let map: serde_json::Map<_, _> = checks
            .iter()
            .map(|(k, v)| {
                (
                    k.to_string(),
                    serde_json::json!({"ok": v.ok, "detail": v.detail}),
                )
            })
            .collect();
        serde_json::Value::Object(map)
    }
}

/// The admin router, exposed separately so processes can add routes (the pubsub webhook):
/// [`probe_router`] and [`metrics_router`] together.
pub fn router(registry: Arc<Registry>, health: Health) -> Router {
    probe_router(health).merge(metrics_router(registry))
}

/// `/healthz` and `/readyz` alone: the kubelet's probes, for a listener of their own (the
/// agent on the host network serves them on the node's loopback only).
pub fn probe_router(health: Health) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(health)
}

/// `/metrics` alone, so a process can put it on its own listener or behind a layer
/// (`Router::route_layer`) that decides who may read it.
pub fn metrics_router(registry: Arc<Registry>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .with_state(registry)
}

/// Serves `router` over plain HTTP/1.1 on `listener` until `shutdown` is cancelled, with
/// the limits of [`serve_with`].
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    serve_with(
        listener,
        router,
        shutdown,
        |stream| async move { Some(stream) },
    )
    .await
}

/// Serves `router` on `listener` until `shutdown`, passing each accepted stream through
/// `handshake` first (TLS, or nothing); `None` ends that connection. At most
/// [`MAX_CONNECTIONS`] at once, each dropped when a request's headers take longer than
/// [`HEADER_TIMEOUT`]. A bad connection ends only itself; accept errors (out of file
/// descriptors) pause briefly and never end the server.
pub async fn serve_with<H, F, S>(
    listener: TcpListener,
    router: Router,
    shutdown: CancellationToken,
    handshake: H,
) -> std::io::Result<()>
where
    H: Fn(TcpStream) -> F + Clone + Send + 'static,
    F: Future<Output = Option<S>> + Send,
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let slot = tokio::select! {
            () = shutdown.cancelled() => break,
            s = slots.clone().acquire_owned() => s,
        };
        // The semaphore is never closed.
        let Ok(slot) = slot else { break };
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            a = listener.accept() => a,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(message = "HTTP accept failed", error = %e);
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let (handshake, router, shutdown) = (handshake.clone(), router.clone(), shutdown.clone());
        connections.spawn(async move {
            let _slot = slot;
            let Some(io) = handshake(stream).await else {
                return;
            };
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .max_buf_size(MAX_READ_BUFFER);
            let conn = builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(router));
            tokio::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(message = "HTTP connection ended with an error", %peer, error = %e);
                    }
                }
                () = shutdown.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(DRAIN_TIMEOUT, conn).await;
                }
            }
        });
        while connections.try_join_next().is_some() {}
    }
    // Let open requests finish, briefly; then drop what is left.
    let _ = tokio::time::timeout(DRAIN_TIMEOUT, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    connections.abort_all();
    Ok(())
}

async fn metrics(State(registry): State<Arc<Registry>>) -> Response {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &registry) {
        Ok(()) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        )
            .into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding metrics: {e}\n"),
        )
            .into_response(),
    }
}

async fn readyz(State(health): State<Health>) -> Response {
    let code = if health.is_ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, axum::Json(health.report())).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_when_every_check_passes() {
        let h = Health::new(&["redis", "first_cycle"]);
        assert!(!h.is_ready());
        h.set("redis", true, "connected");
        assert!(!h.is_ready());
        h.set("first_cycle", true, "done");
        assert!(h.is_ready());
        h.set("redis", false, "connection refused");
        assert!(!h.is_ready());
        assert_eq!(h.report()["redis"]["detail"], "connection refused");
    }
}
