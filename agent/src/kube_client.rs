//! The agent's two Kubernetes clients, built on a TCP connector with keepalive.
//!
//! kube's default client opens its connections without TCP keepalive: a connection whose
//! peer vanished without a FIN or RST (a load balancer or NAT that forgot it, a
//! control-plane node that lost power) looks open until a read or write timeout notices.
//! For a watch that is the full read timeout (longer than the watch's long poll), during
//! which the node's cache is frozen. With keepalive the kernel probes an idle connection
//! after [`KEEPALIVE_IDLE`] and fails it after [`KEEPALIVE_RETRIES`] unanswered probes
//! [`KEEPALIVE_INTERVAL`] apart, about a minute in all; the request or watch on it then
//! fails and is retried on a new connection.
//!
//! kube 5 builds its connector inside `ClientBuilder::try_from` with no hook for socket
//! options, so the stack is built here from kube's public parts (`ConfigExt`): the same
//! HTTPS connector, timeouts, base URI, authentication and extra headers, in kube's order.
//! What is left out: kube's tracing spans (lastcall logs and counts its own requests), the
//! client-certificate expiry of exec plugins, and proxies. A kubeconfig with `proxy-url`
//! (never the case in-cluster) gets kube's own client, without keepalive, and says so.

use std::time::Duration;

use anyhow::Context;
use hyper_timeout::TimeoutConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kube::client::{Body, ClientBuilder, ConfigExt};
use tower::layer::util::Identity;
use tower::util::Either;
use tower::{BoxError, ServiceBuilder};
use tracing::warn;

use crate::metrics::Metrics;
use crate::request_deadline::RequestDeadline;
use crate::throttle::Throttle;

/// How long a connection may be idle before the kernel sends the first keepalive probe.
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
/// The gap between unanswered keepalive probes.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// Unanswered probes after which the kernel declares the connection dead.
pub const KEEPALIVE_RETRIES: u32 = 3;

/// The watches' client reads for longer than the watches' long polls (`timeoutSeconds` 290).
const WATCH_READ_TIMEOUT: Duration = Duration::from_secs(330);

/// The agent's Kubernetes client for requests. kube retries 429/503/504 up to 15 times on
/// its own, for minutes; the reconciler has its own capped, jittered backoff and must stay
/// responsive to new signals, so that retry is off (this stack has none). Every request gets
/// `request_timeout` (see `request_deadline`), counted from when it leaves: a 429's
/// `Retry-After` holds every request of the agent first (see `throttle`). Tests build their
/// agents through this too.
pub fn for_requests(
    mut cfg: kube::Config,
    request_timeout: Duration,
    metrics: &Metrics,
    throttle: &Throttle,
) -> anyhow::Result<kube::Client> {
    cfg.default_retry = false;
    // The deadline layer ends a request without headers first (and counts it); these bound
    // the rest, e.g. a response body that stops arriving after its headers.
    let socket = request_timeout.saturating_mul(2);
    cfg.connect_timeout = Some(socket);
    cfg.write_timeout = Some(socket);
    cfg.read_timeout = Some(socket);
    cfg.reset_reader_on_write = true;
    let deadline = RequestDeadline::new(request_timeout, metrics.clone());
    build(cfg, Either::Left(deadline), throttle).context("building the Kubernetes client")
}

/// The client of the watches: no request deadline (a watch is a long poll), but a read
/// timeout longer than the poll, so a watch on a connection that died silently ends and is
/// re-established (keepalive usually ends it much sooner). Its lists and watches wait out a
/// 429's `Retry-After` too (`throttle`).
pub fn for_watches(mut cfg: kube::Config, throttle: &Throttle) -> anyhow::Result<kube::Client> {
    cfg.default_retry = false;
    cfg.read_timeout = Some(WATCH_READ_TIMEOUT);
    cfg.reset_reader_on_write = true;
    build(cfg, Either::Right(Identity::new()), throttle)
        .context("building the Kubernetes watch client")
}

/// The TCP connector: kube's (HTTPS through it, plain HTTP allowed), plus keepalive.
fn tcp_connector() -> HttpConnector {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_keepalive(Some(KEEPALIVE_IDLE));
    http.set_keepalive_interval(Some(KEEPALIVE_INTERVAL));
    http.set_keepalive_retries(Some(KEEPALIVE_RETRIES));
    http
}

/// The request deadline, or nothing.
type Outer = Either<RequestDeadline, Identity>;

/// kube's default stack without its retry, rebuilt on [`tcp_connector`], under `outer` and
/// the throttle.
fn build(cfg: kube::Config, outer: Outer, throttle: &Throttle) -> kube::Result<kube::Client> {
    if cfg.proxy_url.is_some() {
        warn!(
            message = "the kubeconfig sets proxy-url: the Kubernetes clients use kube's own connector, without TCP keepalive"
        );
        return Ok(ClientBuilder::try_from(cfg)?
            .with_layer(&outer)
            .with_layer(throttle)
            .build());
    }
    let https = cfg.rustls_https_connector_with_connector(tcp_connector())?;
    let mut connector = TimeoutConnector::new(https);
    connector.set_connect_timeout(cfg.connect_timeout);
    connector.set_read_timeout(cfg.read_timeout);
    connector.set_write_timeout(cfg.write_timeout);
    connector.set_reset_reader_on_write(cfg.reset_reader_on_write);
    let client: hyper_util::client::legacy::Client<_, Body> =
        hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build(connector);
    let service = ServiceBuilder::new()
        .layer(cfg.base_uri_layer())
        .option_layer(cfg.auth_layer()?)
        .layer(cfg.extra_headers_layer()?)
        .map_err(BoxError::from)
        .service(client);
    Ok(ClientBuilder::new(service, cfg.default_namespace)
        .with_layer(&outer)
        .with_layer(throttle)
        .build())
}

#[cfg(test)]
mod tests;
