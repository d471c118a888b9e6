//! The FleetIQ signal source: SUBSCRIBE to the instance channel, read pubsub's cached value on
//! every (re)subscribe, and fall back to asking GameLift when Redis goes quiet.
//!
//! A dropped connection keeps the last view (it never turns into "all clear"), is counted,
//! and is retried with jittered backoff. A bad message changes nothing.

use std::time::{Duration, Instant};

use futures::StreamExt;
use lastcall_common::backoff::Backoff;
use lastcall_common::fleetiq::{StatusMessage, cache_key, trim_for_log};
use lastcall_common::redis_url::RedisTarget;
use redis::AsyncCommands;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::gamelift::GameLift;
use super::view::{FleetIqView, Via};
use crate::metrics::{Metrics, ResultLabel, SourceLabel, SourceReason, SourceStatus};

const SOURCE: &str = "fleetiq";
const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// Default keep-alive period; a half-dead connection is noticed within about this long.
pub const PING_EVERY: Duration = Duration::from_secs(15);
/// A session that lived this long was healthy: the next failure starts backoff afresh.
const HEALTHY_SESSION: Duration = Duration::from_secs(30);

#[derive(Clone)]
pub struct RedisSource {
    pub target: RedisTarget,
    pub channel: String,
    pub instance_id: String,
    pub metrics: Metrics,
    pub view: watch::Sender<FleetIqView>,
    /// Keep-alive period. While subscribed, Redis answers PING with `["pong", ""]`, so any
    /// reply counts as alive.
    pub ping_every: Duration,
}

enum End {
    Shutdown,
    Disconnected(String),
}

impl RedisSource {
    /// Applies one message body. Returns whether it changed the view.
    pub fn handle(&self, body: &[u8], via: Via) -> bool {
        let m = &self.metrics;
        match StatusMessage::parse(body) {
            Err(e) => {
                m.signals_rejected
                    .get_or_create(&SourceReason {
                        source: SOURCE,
                        reason: e.metric_label(),
                    })
                    .inc();
                warn!(
                    message = "rejected FleetIQ status message",
                    error = %e,
                    payload = %trim_for_log(&String::from_utf8_lossy(body), 256),
                );
                false
            }
            Ok(msg) if msg.instance_id != self.instance_id => {
                m.signals_rejected
                    .get_or_create(&SourceReason {
                        source: SOURCE,
                        reason: "other_instance",
                    })
                    .inc();
                warn!(
                    message = "ignored status for another instance",
                    instance_id = %trim_for_log(&msg.instance_id, 64),
                    expected = %self.instance_id,
                );
                false
            }
            Ok(msg) => {
                m.signals
                    .get_or_create(&SourceStatus {
                        source: SOURCE,
                        status: msg.status.as_str(),
                    })
                    .inc();
                let mut changed = false;
                self.view.send_modify(|v| {
                    changed = v.status != Some(msg.status);
                    v.observe(msg.status, via, jiff::Timestamp::now(), Instant::now());
                });
                if changed {
                    info!(message = "FleetIQ status changed", status = %msg.status, via = ?via);
                } else {
                    debug!(message = "FleetIQ status", status = %msg.status, via = ?via);
                }
                changed
            }
        }
    }

    fn set_up(&self, up: bool) {
        self.metrics.redis_connected.set(i64::from(up));
        self.metrics
            .source_up
            .get_or_create(&SourceLabel { source: SOURCE })
            .set(i64::from(up));
    }

    /// Runs until `shutdown`; never returns early on Redis errors.
    pub async fn run(self, shutdown: CancellationToken) {
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
        loop {
            let began = Instant::now();
            let end = self.session(&shutdown).await;
            self.set_up(false);
            match end {
                End::Shutdown => return,
                End::Disconnected(why) => {
                    if began.elapsed() > HEALTHY_SESSION {
                        backoff.reset();
                    }
                    let delay = backoff.next_delay();
                    self.metrics.redis_reconnects.inc();
                    warn!(
                        message = "Redis subscription lost; keeping the last status and retrying",
                        error = %why,
                        retry_in_ms = delay.as_millis() as u64,
                        redis = %self.target,
                    );
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
    }

    async fn session(&self, shutdown: &CancellationToken) -> End {
        let client = match self.target.client() {
            Ok(c) => c,
            Err(e) => return End::Disconnected(e.to_string()),
        };
        let pubsub = match tokio::time::timeout(IO_TIMEOUT, client.get_async_pubsub()).await {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => return End::Disconnected(e.to_string()),
            Err(_) => return End::Disconnected("connect timed out".into()),
        };
        let (mut sink, mut stream) = pubsub.split();
        match tokio::time::timeout(IO_TIMEOUT, sink.subscribe(&self.channel)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return End::Disconnected(format!("SUBSCRIBE: {e}")),
            Err(_) => return End::Disconnected("SUBSCRIBE timed out".into()),
        }
        // Subscribed first, then read the cache: nothing published in between is missed.
        match tokio::time::timeout(IO_TIMEOUT, client.get_multiplexed_async_connection()).await {
            Ok(Ok(mut conn)) => match conn
                .get::<_, Option<Vec<u8>>>(cache_key(&self.instance_id))
                .await
            {
                Ok(Some(body)) => {
                    self.handle(&body, Via::Cache);
                }
                Ok(None) => debug!(message = "no cached FleetIQ status yet"),
                Err(e) => warn!(message = "reading the cached status failed", error = %e),
            },
            Ok(Err(e)) => warn!(message = "reading the cached status failed", error = %e),
            Err(_) => warn!(message = "reading the cached status timed out"),
        }
        self.set_up(true);
        info!(message = "subscribed to FleetIQ status", channel = %self.channel, redis = %self.target);
        let mut ping = tokio::time::interval(self.ping_every);
        ping.tick().await;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return End::Shutdown,
                msg = stream.next() => match msg {
                    None => return End::Disconnected("connection closed".into()),
                    Some(m) => { self.handle(m.get_payload_bytes(), Via::Message); }
                },
                _ = ping.tick() => {
                    match tokio::time::timeout(IO_TIMEOUT, sink.ping::<redis::Value>()).await {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => return End::Disconnected(format!("PING: {e}")),
                        Err(_) => return End::Disconnected("PING timed out".into()),
                    }
                }
            }
        }
    }
}

/// Asks GameLift directly while no status has arrived for `stale_after`.
pub async fn run_fallback(
    gamelift: GameLift,
    view: watch::Sender<FleetIqView>,
    stale_after: Duration,
    every: Duration,
    metrics: Metrics,
    shutdown: CancellationToken,
) {
    let started = Instant::now();
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
        let last = view.borrow().last_seen.unwrap_or(started);
        if last.elapsed() < stale_after {
            continue;
        }
        match gamelift.describe_own_status().await {
            Ok(Some(status)) => {
                metrics
                    .fallback_checks
                    .get_or_create(&ResultLabel { result: "ok" })
                    .inc();
                metrics
                    .signals
                    .get_or_create(&SourceStatus {
                        source: SOURCE,
                        status: status.as_str(),
                    })
                    .inc();
                info!(message = "Redis is quiet; status read from GameLift", status = %status);
                view.send_modify(|v| {
                    v.observe(
                        status,
                        Via::Fallback,
                        jiff::Timestamp::now(),
                        Instant::now(),
                    )
                });
            }
            Ok(None) => {
                metrics
                    .fallback_checks
                    .get_or_create(&ResultLabel { result: "unknown" })
                    .inc();
                warn!(message = "GameLift does not report a known status for this instance");
            }
            Err(e) => {
                metrics
                    .fallback_checks
                    .get_or_create(&ResultLabel {
                        result: e.metric_label(),
                    })
                    .inc();
                warn!(message = "GameLift fallback check failed", error = %e);
            }
        }
    }
}
