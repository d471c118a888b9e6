//! The one HTTP listener every lastcall process has: `/metrics`, `/healthz`, `/readyz`.
//!
//! Readiness is the AND of named checks (for example "redis" and "first_cycle"), each set by
//! the component that owns it, so `/readyz` can say which one is failing.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Shared readiness state. Cheap to clone.
#[derive(Clone, Default)]
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

#[derive(Clone)]
struct AdminState {
    registry: Arc<Registry>,
    health: Health,
}

/// The admin router, exposed separately so processes can add routes (the pubsub webhook).
pub fn router(registry: Arc<Registry>, health: Health) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(AdminState { registry, health })
}

/// Serves `router` on `listener` until `shutdown` is cancelled.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
}

async fn metrics(State(state): State<AdminState>) -> Response {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &state.registry) {
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

async fn readyz(State(state): State<AdminState>) -> Response {
    let code = if state.health.is_ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, axum::Json(state.health.report())).into_response()
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
