//! Publishes statuses to Redis: `PUBLISH <instance-id> <json>` plus
//! `SET lastcall:status:<instance-id> <json> EX <ttl>`, pipelined, one round trip per batch.
//!
//! Redis trouble never reaches the poller: a failed round trip is counted and logged, and
//! further batches are skipped (and counted) until a jittered backoff expires, so a dead
//! Redis costs one failed attempt per backoff step instead of a timeout per group. The
//! `ConnectionManager` reconnects underneath.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use lastcall_common::admin::Health;
use lastcall_common::backoff::Backoff;
use lastcall_common::fleetiq::{StatusMessage, cache_key, trim_for_log};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::time::Instant;

use crate::config::Config;
use crate::metrics::Metrics;

/// Name of the readiness check this module owns.
pub const READY_REDIS: &str = "redis";

/// What publishing one group's statuses did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PublishReport {
    /// PUBLISH commands acknowledged.
    pub published: u64,
    /// Statuses not published because they had not changed (`--publish-unchanged=false`).
    pub unchanged: u64,
    /// Cache keys written.
    pub cached: u64,
    /// Round trips attempted (successful or not).
    pub round_trips: u64,
    /// Batches that failed or were skipped while backing off.
    pub errors: u64,
}

impl PublishReport {
    pub fn add(&mut self, other: &PublishReport) {
        self.published += other.published;
        self.unchanged += other.unchanged;
        self.cached += other.cached;
        self.round_trips += other.round_trips;
        self.errors += other.errors;
    }
}

/// Reconnection pacing shared by all concurrent publishes.
#[derive(Debug)]
struct Gate {
    backoff: Backoff,
    retry_at: Option<Instant>,
}

/// The Redis side of the service.
pub struct Publisher {
    conn: ConnectionManager,
    ttl_secs: u64,
    batch: usize,
    publish_unchanged: bool,
    gate: Mutex<Gate>,
    /// Last body successfully published per instance, for `--publish-unchanged=false`.
    last: Mutex<HashMap<String, String>>,
    metrics: Metrics,
    health: Health,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("ttl_secs", &self.ttl_secs)
            .field("batch", &self.batch)
            .field("publish_unchanged", &self.publish_unchanged)
            .finish_non_exhaustive()
    }
}

impl Publisher {
    /// Creates the publisher without connecting (the first round trip connects), so a Redis
    /// that is down at start delays nothing. Must be called inside a Tokio runtime.
    pub fn new(config: &Config, metrics: Metrics, health: Health) -> redis::RedisResult<Self> {
        let client = config.redis_url.client()?;
        // One connection attempt per round trip: pacing is the gate's job, so a request never
        // sits in the manager's own retry loop while the cycle waits.
        let manager_config = ConnectionManagerConfig::new()
            .set_number_of_retries(0)
            .set_connection_timeout(Some(config.redis_timeout))
            .set_response_timeout(Some(config.redis_timeout));
        let conn = ConnectionManager::new_lazy_with_config(client, manager_config)?;
        Ok(Self {
            conn,
            ttl_secs: config.cache_ttl().as_secs().max(1),
            batch: config.publish_batch.max(1) as usize,
            publish_unchanged: config.publish_unchanged,
            gate: Mutex::new(Gate {
                backoff: Backoff::new(config.redis_retry_base, config.redis_retry_max),
                retry_at: None,
            }),
            last: Mutex::new(HashMap::new()),
            metrics,
            health,
        })
    }

    /// Publishes and caches `messages`, `--publish-batch` instances per round trip.
    pub async fn publish(&self, messages: &[StatusMessage]) -> PublishReport {
        let mut report = PublishReport::default();
        let bodies: Vec<(&str, String)> = messages
            .iter()
            .map(|m| (m.instance_id.as_str(), m.to_python_json()))
            .collect();
        for chunk in bodies.chunks(self.batch) {
            self.publish_chunk(chunk, &mut report).await;
        }
        report
    }

    async fn publish_chunk(&self, chunk: &[(&str, String)], report: &mut PublishReport) {
        if self.backing_off() {
            report.errors += 1;
            Metrics::reason(&self.metrics.publish_errors, "backoff");
            return;
        }
        let publish: Vec<bool> = if self.publish_unchanged {
            vec![true; chunk.len()]
        } else {
            let last = self.last.lock().unwrap_or_else(|p| p.into_inner());
            chunk
                .iter()
                .map(|(iid, body)| last.get(*iid) != Some(body))
                .collect()
        };
        let mut pipe = redis::pipe();
        for ((iid, body), &publish) in chunk.iter().zip(&publish) {
            if publish {
                pipe.cmd("PUBLISH").arg(*iid).arg(body.as_str()).ignore();
            }
            pipe.cmd("SET")
                .arg(cache_key(iid))
                .arg(body.as_str())
                .arg("EX")
                .arg(self.ttl_secs)
                .ignore();
        }
        let published = publish.iter().filter(|p| **p).count() as u64;
        let unchanged = chunk.len() as u64 - published;

        report.round_trips += 1;
        let started = Instant::now();
        let mut conn = self.conn.clone();
        let sent: redis::RedisResult<()> = pipe.query_async(&mut conn).await;
        self.metrics
            .publish_duration
            .observe(started.elapsed().as_secs_f64());
        match sent {
            Ok(()) => {
                self.round_trip_ok();
                report.published += published;
                report.unchanged += unchanged;
                report.cached += chunk.len() as u64;
                self.metrics.messages_published.inc_by(published);
                self.metrics.messages_unchanged.inc_by(unchanged);
                self.metrics.cache_writes.inc_by(chunk.len() as u64);
                if !self.publish_unchanged {
                    let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
                    for ((iid, body), &publish) in chunk.iter().zip(&publish) {
                        if publish {
                            last.insert((*iid).to_string(), body.clone());
                        }
                    }
                }
            }
            Err(e) => {
                report.errors += 1;
                self.round_trip_failed(&e, chunk.len());
            }
        }
    }

    /// Checks Redis with a PING (used when a cycle had nothing to publish), through the same
    /// gate as publishing, so readiness follows Redis even with no instances.
    pub async fn ping(&self) -> PublishReport {
        let mut report = PublishReport::default();
        if self.backing_off() {
            report.errors += 1;
            Metrics::reason(&self.metrics.publish_errors, "backoff");
            return report;
        }
        report.round_trips += 1;
        let started = Instant::now();
        let mut conn = self.conn.clone();
        let sent: redis::RedisResult<String> = redis::cmd("PING").query_async(&mut conn).await;
        self.metrics
            .publish_duration
            .observe(started.elapsed().as_secs_f64());
        match sent {
            Ok(_) => self.round_trip_ok(),
            Err(e) => {
                report.errors += 1;
                self.round_trip_failed(&e, 0);
            }
        }
        report
    }

    /// Forgets the last published body of instances that were not seen this cycle, so the
    /// change-detection map does not grow with every instance ever launched.
    pub fn retain_seen(&self, seen: &HashSet<String>) {
        if self.publish_unchanged {
            return;
        }
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        last.retain(|iid, _| seen.contains(iid));
    }

    fn backing_off(&self) -> bool {
        let gate = self.gate.lock().unwrap_or_else(|p| p.into_inner());
        gate.retry_at.is_some_and(|at| Instant::now() < at)
    }

    fn round_trip_ok(&self) {
        Metrics::result(&self.metrics.redis_round_trips, "ok");
        self.metrics.redis_up.set(1);
        let recovered = {
            let mut gate = self.gate.lock().unwrap_or_else(|p| p.into_inner());
            gate.backoff.reset();
            gate.retry_at.take().is_some()
        };
        if recovered {
            tracing::info!(message = "Redis reachable again, publishing resumed");
        }
        self.health
            .set(READY_REDIS, true, "last round trip succeeded");
    }

    fn round_trip_failed(&self, err: &redis::RedisError, batch: usize) {
        let reason = error_reason(err);
        Metrics::result(&self.metrics.redis_round_trips, "error");
        Metrics::reason(&self.metrics.publish_errors, reason);
        self.metrics.redis_up.set(0);
        let (first, delay) = {
            let mut gate = self.gate.lock().unwrap_or_else(|p| p.into_inner());
            let first = gate.retry_at.is_none();
            let delay = gate.backoff.next_delay();
            gate.retry_at = Some(Instant::now() + delay);
            (first, delay)
        };
        let error = trim_for_log(&err.to_string(), 300);
        // One warning per outage; the repeats are debug so a long outage does not flood logs.
        if first {
            tracing::warn!(message = "Redis round trip failed, backing off", reason, batch, retry_in_ms = delay.as_millis() as u64, error = %error);
        } else {
            tracing::debug!(message = "Redis still failing", reason, batch, retry_in_ms = delay.as_millis() as u64, error = %error);
        }
        self.health
            .set(READY_REDIS, false, format!("{reason}: {error}"));
    }
}

fn error_reason(err: &redis::RedisError) -> &'static str {
    if err.is_timeout() {
        "timeout"
    } else if err.is_io_error() || err.is_connection_dropped() || err.is_connection_refusal() {
        "connection"
    } else {
        "server"
    }
}
