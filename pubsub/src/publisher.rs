//! Publishes statuses to Redis with one atomic script per batch: for each instance,
//! `SET lastcall:status:<id> <json> EX <ttl>`, `SET lastcall:polled_at:<id> <ms> EX <ttl>`,
//! then `PUBLISH <id> <json>`, but only if the status was polled no earlier than the one
//! Redis holds. So two replicas (a rolling update, or `replicas: 2`) can never put an older
//! status on top of a newer one, in the cache or on the channel, and a subscriber that reads
//! the cache after subscribing never misses a newer value (SET comes before PUBLISH).
//!
//! The connection is ours, not a reconnecting manager's: any error that means "this
//! connection is no good" (timeout, READONLY after a failover, auth, TLS, a drop) throws it
//! away and the next batch opens a new one. Only a failure to *connect* backs off, and while
//! backing off batches are skipped and counted, so a dead Redis costs one connect attempt per
//! backoff step instead of a timeout per group. A server error on one batch (out of memory)
//! fails that batch only.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use lastcall_common::admin::Health;
use lastcall_common::backoff::Backoff;
use lastcall_common::fleetiq::{cache_key, polled_at_key, trim_for_log};
use lastcall_common::redis_conn::{self, ErrorClass};
use redis::aio::MultiplexedConnection;
use tokio::time::Instant;

use crate::config::Config;
use crate::metrics::Metrics;

/// Name of the readiness check this module owns.
pub const READY_REDIS: &str = "redis";

/// Applies a batch newer-only. KEYS: cache key and polled-at key per instance. ARGV[1]: TTL
/// in seconds; then per instance: channel, body, polled-at (ms), publish flag ("1"/"0").
/// Returns per instance 0 (older than what Redis holds: dropped), 1 (written and
/// published) or 2 (written, not published because unchanged).
const NEWER_ONLY: &str = r"
local ttl = ARGV[1]
local out = {}
for i = 1, #KEYS / 2 do
  local a = 2 + (i - 1) * 4
  local held = tonumber(redis.call('GET', KEYS[2 * i]))
  local at = tonumber(ARGV[a + 2])
  if held and at and held > at then
    out[i] = 0
  else
    redis.call('SET', KEYS[2 * i - 1], ARGV[a + 1], 'EX', ttl)
    redis.call('SET', KEYS[2 * i], ARGV[a + 2], 'EX', ttl)
    if ARGV[a + 3] == '1' then
      redis.call('PUBLISH', ARGV[a], ARGV[a + 1])
      out[i] = 1
    else
      out[i] = 2
    end
  end
end
return out
";

/// One instance's status, ready to publish.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outgoing {
    pub instance_id: String,
    /// The exact bytes published and cached (the original's JSON form).
    pub body: String,
    /// When the GameLift call that returned it was sent (Unix ms): the status is at least
    /// this fresh.
    pub polled_at_ms: i64,
}

/// What publishing one group's statuses did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PublishReport {
    /// PUBLISH commands sent.
    pub published: u64,
    /// Statuses not published because they had not changed (`--publish-unchanged=false`).
    pub unchanged: u64,
    /// Cache keys written.
    pub cached: u64,
    /// Statuses dropped because Redis already held one polled later (another replica).
    pub stale: u64,
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
        self.stale += other.stale;
        self.round_trips += other.round_trips;
        self.errors += other.errors;
    }
}

/// Pacing of connection attempts, shared by all concurrent publishes.
#[derive(Debug)]
struct Gate {
    backoff: Backoff,
    retry_at: Option<Instant>,
    /// The reason of the failure being logged, so a long outage logs one warning.
    failing: Option<ErrorClass>,
}

/// The live connection and a generation number, so a failure on an old connection does
/// not throw away the new one another group just opened.
type Slot = Option<(u64, MultiplexedConnection)>;

/// Why a batch got no connection.
enum NoConnection {
    BackingOff,
    Failed,
}

/// The Redis side of the service.
pub struct Publisher {
    client: redis::Client,
    tls: bool,
    timeout: Duration,
    ttl_secs: u64,
    batch: usize,
    publish_unchanged: bool,
    script: redis::Script,
    slot: tokio::sync::Mutex<Slot>,
    generation: AtomicU64,
    gate: Mutex<Gate>,
    /// Last body published per instance, for `--publish-unchanged=false`. An entry is
    /// removed when a write's outcome is unknown, so the next cycle publishes again.
    last: Mutex<HashMap<String, String>>,
    /// When a Redis round trip last succeeded (or when the publisher was created).
    last_ok: Mutex<Instant>,
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
    /// Creates the publisher without connecting (the first batch connects), so a Redis that
    /// is down at start delays nothing.
    pub fn new(config: &Config, metrics: Metrics, health: Health) -> redis::RedisResult<Self> {
        let client = redis_conn::client(&config.redis_url, config.redis_ca_file.as_ref())?;
        Ok(Self {
            client,
            tls: config.redis_url.is_tls(),
            timeout: config.redis_timeout,
            ttl_secs: config.cache_ttl().as_secs().max(1),
            batch: config.publish_batch.max(1) as usize,
            publish_unchanged: config.publish_unchanged,
            script: redis::Script::new(NEWER_ONLY),
            slot: tokio::sync::Mutex::new(None),
            generation: AtomicU64::new(0),
            gate: Mutex::new(Gate {
                // Capped below half a period, so publishing resumes within two periods of
                // Redis coming back.
                backoff: Backoff::new(
                    config.redis_retry_base,
                    config.redis_retry_max.min(config.period / 2),
                ),
                retry_at: None,
                failing: None,
            }),
            last: Mutex::new(HashMap::new()),
            last_ok: Mutex::new(Instant::now()),
            metrics,
            health,
        })
    }

    /// Time since a Redis round trip last succeeded (since creation if none has).
    pub fn since_last_success(&self) -> Duration {
        self.last_ok
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .elapsed()
    }

    /// Publishes and caches `messages`, `--publish-batch` instances per round trip.
    pub async fn publish(&self, messages: &[Outgoing]) -> PublishReport {
        let mut report = PublishReport::default();
        for chunk in messages.chunks(self.batch) {
            self.publish_chunk(chunk, &mut report).await;
        }
        report
    }

    async fn publish_chunk(&self, chunk: &[Outgoing], report: &mut PublishReport) {
        let (generation, mut conn) = match self.connection().await {
            Ok(c) => c,
            Err(NoConnection::BackingOff) => {
                report.errors += 1;
                Metrics::reason(&self.metrics.publish_errors, "backoff");
                return;
            }
            Err(NoConnection::Failed) => {
                report.round_trips += 1;
                report.errors += 1;
                return;
            }
        };
        let publish: Vec<bool> = if self.publish_unchanged {
            vec![true; chunk.len()]
        } else {
            let last = self.last.lock().unwrap_or_else(|p| p.into_inner());
            chunk
                .iter()
                .map(|m| last.get(&m.instance_id) != Some(&m.body))
                .collect()
        };
        let mut invocation = self.script.prepare_invoke();
        invocation.arg(self.ttl_secs);
        for (m, &publish) in chunk.iter().zip(&publish) {
            invocation
                .key(cache_key(&m.instance_id))
                .key(polled_at_key(&m.instance_id))
                .arg(&m.instance_id)
                .arg(&m.body)
                .arg(m.polled_at_ms)
                .arg(if publish { "1" } else { "0" });
        }

        report.round_trips += 1;
        let started = Instant::now();
        let sent: redis::RedisResult<Vec<i64>> = invocation.invoke_async(&mut conn).await;
        self.metrics
            .publish_duration
            .observe(started.elapsed().as_secs_f64());
        match sent {
            Ok(outcomes) if outcomes.len() == chunk.len() => {
                self.round_trip_ok();
                let mut last = (!self.publish_unchanged)
                    .then(|| self.last.lock().unwrap_or_else(|p| p.into_inner()));
                let (mut published, mut unchanged, mut stale) = (0u64, 0u64, 0u64);
                for (m, outcome) in chunk.iter().zip(&outcomes) {
                    match outcome {
                        0 => {
                            stale += 1;
                            // What Redis holds is not what we would have published: compare
                            // against it next time, never against our own older value.
                            if let Some(last) = last.as_mut() {
                                last.remove(&m.instance_id);
                            }
                        }
                        1 => {
                            published += 1;
                            if let Some(last) = last.as_mut() {
                                last.insert(m.instance_id.clone(), m.body.clone());
                            }
                        }
                        _ => unchanged += 1,
                    }
                }
                let cached = published + unchanged;
                report.published += published;
                report.unchanged += unchanged;
                report.cached += cached;
                report.stale += stale;
                self.metrics.messages_published.inc_by(published);
                self.metrics.messages_unchanged.inc_by(unchanged);
                self.metrics.messages_stale.inc_by(stale);
                self.metrics.cache_writes.inc_by(cached);
            }
            Ok(outcomes) => {
                report.errors += 1;
                self.forget_uncertain(chunk);
                let err = redis::RedisError::from((
                    redis::ErrorKind::UnexpectedReturnType,
                    "script answered the wrong number of outcomes",
                    format!("{} for {} instances", outcomes.len(), chunk.len()),
                ));
                self.command_failed(generation, &err, chunk.len()).await;
            }
            Err(e) => {
                report.errors += 1;
                // The script may have run even though the answer was lost (a timeout): what
                // Redis and the agents hold is unknown, so publish these again next time.
                self.forget_uncertain(chunk);
                self.command_failed(generation, &e, chunk.len()).await;
            }
        }
    }

    fn forget_uncertain(&self, chunk: &[Outgoing]) {
        if self.publish_unchanged {
            return;
        }
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        for m in chunk {
            last.remove(&m.instance_id);
        }
    }

    /// Checks Redis with a PING (used when a cycle had nothing to publish), through the same
    /// connection and gate as publishing, so readiness and liveness follow Redis even with
    /// no instances.
    pub async fn ping(&self) -> PublishReport {
        let mut report = PublishReport::default();
        let (generation, mut conn) = match self.connection().await {
            Ok(c) => c,
            Err(NoConnection::BackingOff) => {
                report.errors += 1;
                Metrics::reason(&self.metrics.publish_errors, "backoff");
                return report;
            }
            Err(NoConnection::Failed) => {
                report.round_trips += 1;
                report.errors += 1;
                return report;
            }
        };
        report.round_trips += 1;
        let started = Instant::now();
        let sent: redis::RedisResult<String> = redis::cmd("PING").query_async(&mut conn).await;
        self.metrics
            .publish_duration
            .observe(started.elapsed().as_secs_f64());
        match sent {
            Ok(_) => self.round_trip_ok(),
            Err(e) => {
                report.errors += 1;
                self.command_failed(generation, &e, 0).await;
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

    /// The live connection, or a new one. Connecting is serialised by the slot's lock, so
    /// concurrent groups wait for one attempt instead of each making their own.
    async fn connection(&self) -> Result<(u64, MultiplexedConnection), NoConnection> {
        let mut slot = self.slot.lock().await;
        if let Some((generation, conn)) = slot.as_ref() {
            return Ok((*generation, conn.clone()));
        }
        if self.backing_off() {
            return Err(NoConnection::BackingOff);
        }
        match redis_conn::connect(&self.client, self.timeout).await {
            Ok(conn) => {
                let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
                *slot = Some((generation, conn.clone()));
                self.metrics.redis_connects.inc();
                Ok((generation, conn))
            }
            Err(e) => {
                self.failed(&e, 0, true);
                Err(NoConnection::Failed)
            }
        }
    }

    /// A command failed on a connection: drop the connection if the error says it is no
    /// good, and count it. No backoff: the next batch tries a fresh connection at once.
    async fn command_failed(&self, generation: u64, err: &redis::RedisError, batch: usize) {
        if redis_conn::classify(err).needs_new_connection() {
            let mut slot = self.slot.lock().await;
            if slot.as_ref().is_some_and(|(g, _)| *g == generation) {
                *slot = None;
            }
        }
        self.failed(err, batch, false);
    }

    fn backing_off(&self) -> bool {
        let gate = self.gate.lock().unwrap_or_else(|p| p.into_inner());
        gate.retry_at.is_some_and(|at| Instant::now() < at)
    }

    fn round_trip_ok(&self) {
        Metrics::result(&self.metrics.redis_round_trips, "ok");
        self.metrics.redis_up.set(1);
        *self.last_ok.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        let recovered = {
            let mut gate = self.gate.lock().unwrap_or_else(|p| p.into_inner());
            gate.backoff.reset();
            gate.retry_at = None;
            gate.failing.take()
        };
        if let Some(reason) = recovered {
            tracing::info!(
                message = "Redis reachable again, publishing resumed",
                after = reason.label()
            );
        }
        self.health
            .set(READY_REDIS, true, "last round trip succeeded");
    }

    fn failed(&self, err: &redis::RedisError, batch: usize, connecting: bool) {
        let class = redis_conn::classify(err);
        let reason = class.label();
        Metrics::result(&self.metrics.redis_round_trips, "error");
        Metrics::reason(&self.metrics.publish_errors, reason);
        self.metrics.redis_up.set(0);
        let (first, delay) = {
            let mut gate = self.gate.lock().unwrap_or_else(|p| p.into_inner());
            let first = gate.failing != Some(class);
            gate.failing = Some(class);
            let delay = connecting.then(|| gate.backoff.next_delay());
            if let Some(delay) = delay {
                gate.retry_at = Some(Instant::now() + delay);
            }
            (first, delay)
        };
        let error = trim_for_log(&err.to_string(), 300);
        let hint = class.hint(self.tls);
        let retry_in_ms = delay.map_or(0, |d| d.as_millis() as u64);
        // One warning per outage and reason; the repeats are debug so a long outage does not
        // flood the log.
        if first {
            tracing::warn!(message = "Redis round trip failed", reason, hint, connecting, batch, retry_in_ms, error = %error);
        } else {
            tracing::debug!(message = "Redis still failing", reason, connecting, batch, retry_in_ms, error = %error);
        }
        self.health
            .set(READY_REDIS, false, format!("{reason}: {hint}: {error}"));
    }
}
