//! Publishes statuses to Redis with one atomic script per batch: for each instance,
//! `SET lastcall:status:<id> <json> EX <ttl>`, `SET lastcall:polled_at:<id> <ms> EX <ttl>`,
//! `SET lastcall:polled_by:<id> <writer> EX <ttl>`, then `PUBLISH <id> <json>`, unless Redis
//! holds a status another writer polled later. So two replicas (a rolling update, or
//! `replicas: 2`) can never put an older status on top of a newer one, in the cache or on
//! the channel, and a subscriber that reads the cache after subscribing never misses a newer
//! value (SET comes before PUBLISH).
//!
//! No wall clock of a replica orders anything. Polls are dated on Redis' own clock, read on
//! the node that stores them (on a Redis Cluster, one reading per slot: the nodes' clocks
//! are never mixed): a reading is Redis' time `T` on that node, answered by the moment `r`
//! the reply is in, taken by one `TIME` when there is none (a new connection, a slot not
//! written lately) and renewed by every write, whose script returns the time it ran at; a
//! poll sent at `p` (monotonic) is dated `T + (p − r)`, which is never later than the
//! truth (the transit of `TIME` only makes it older), so a replica whose path to Redis is
//! slow looks older, never newer. A replica's clock step, forward or back, changes nothing. Between
//! two polls of one writer, its own monotonic order decides (a per-writer sequence stored
//! beside the time, `<writer> <sequence>`): a later poll always wins, and a delayed script
//! carrying an older poll never does, however it is dated. A held time ahead of Redis'
//! `TIME` (left by an older release) never blocks a write, and none is stored. A dropped notice (anything but ACTIVE) is a warning and
//! `notices_dropped_total{status}`, which has an alert.
//!
//! The connection is ours, not a reconnecting manager's: any error that means "this
//! connection is no good" (timeout, READONLY after a failover, auth, TLS, a drop) throws it
//! away and the next batch opens a new one. Only a failure to *connect* backs off, and while
//! backing off batches are skipped and counted, so a dead Redis costs one connect attempt per
//! backoff step instead of a timeout per group. A server error on one batch (out of memory)
//! fails that batch only.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::StreamExt;
use lastcall_common::admin::Health;
use lastcall_common::backoff::Backoff;
use lastcall_common::fleetiq::{InstanceStatus, StatusMessage, trim_for_log};
use lastcall_common::redis_conn::{self, AnyClient, AnyConn, ErrorClass};
use lastcall_common::redis_url::InstanceKeys;
use tokio::time::Instant;

use crate::config::Config;
use crate::metrics::{Metrics, StatusLabels};

/// Scripts in flight at once against a Redis Cluster, where each instance is its own
/// script call (its keys share a slot; different instances' keys do not).
const CLUSTER_IN_FLIGHT: usize = 64;

/// Redis key beside `lastcall:polled_at:<id>` naming the writer (one pubsub process) that
/// wrote it, so that writer's own later polls always win whatever its clock did. (On a
/// Redis Cluster the id is a hash tag: see `InstanceKeys`.)
pub fn polled_by_key(instance_id: &str) -> String {
    InstanceKeys::default().polled_by(instance_id)
}

/// A random id for this process as a writer: distinct across replicas and restarts.
fn new_writer_id() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// Name of the readiness check this module owns.
pub const READY_REDIS: &str = "redis";

/// Applies a batch newer-only. KEYS: cache, polled-at and polled-by key per instance.
/// ARGV[1]: TTL in seconds, ARGV[2]: this writer's id; then per instance: channel, body,
/// the poll's time (ms, Redis' clock: see the module doc), the poll's sequence in this
/// writer (its monotonic time, µs), publish mode ("1" always, "0" only if the cached body
/// differs). Polled-by holds `<writer> <sequence>` (an older
/// release's bare writer id reads as that writer with no sequence: superseded).
/// Returns Redis' time when the script ran (Unix ms: it renews the reading that dates this
/// node's polls), then per instance 0 (another writer polled later: dropped), 1 (written and
/// published) or 2 (written, not published because unchanged), plus [`REPLACED`] when one
/// of its keys held another Redis type: a read of such a key fails (WRONGTYPE), which
/// would fail the whole script, every batch of it and every cycle, so it is read as absent
/// and overwritten (the keys are pubsub's own).
const NEWER_ONLY: &str = r"
if redis.replicate_commands then pcall(redis.replicate_commands) end
local ttl = ARGV[1]
local writer = ARGV[2]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {now}
for i = 1, #KEYS / 3 do
  local a = 3 + (i - 1) * 5
  local replaced = 0
  local function get(key)
    local ok, v = pcall(redis.call, 'GET', key)
    if ok then return v end
    replaced = 4
    return false
  end
  local held = tonumber(get(KEYS[3 * i - 1]))
  local by = get(KEYS[3 * i]) or ''
  local by_writer, by_seq = string.match(by, '^(%S+) (%d+)$')
  if not by_writer then by_writer = by end
  local at = tonumber(ARGV[a + 2]) or 0
  if at > now then at = now end
  local seq = tonumber(ARGV[a + 3]) or 0
  local older
  if by_writer == writer then
    older = by_seq ~= nil and tonumber(by_seq) > seq
  else
    older = held ~= nil and held <= now and held > at
  end
  if older then
    out[i + 1] = 0
  else
    local body = ARGV[a + 1]
    local publish = ARGV[a + 4] == '1' or get(KEYS[3 * i - 2]) ~= body
    redis.call('SET', KEYS[3 * i - 2], body, 'EX', ttl)
    redis.call('SET', KEYS[3 * i - 1], at, 'EX', ttl)
    redis.call('SET', KEYS[3 * i], writer .. ' ' .. string.format('%d', seq), 'EX', ttl)
    if publish then
      redis.call('PUBLISH', ARGV[a], body)
      out[i + 1] = 1 + replaced
    else
      out[i + 1] = 2 + replaced
    end
  end
end
return out
";

/// Shortest time a reading of Redis' clock dates polls before it is read again; the
/// longest gap between two writes of a status by healthy cycles lengthens it (see
/// [`Publisher::new`]), since every write renews its slot's reading anyway. A step of
/// Redis' clock is followed by the next write after it.
const CLOCK_REFRESH: Duration = Duration::from_secs(30);

/// Where a reading of Redis' clock was taken: the single node, or one slot of a cluster
/// (a slot lives on one node at a time).
type ClockKey = Option<redis::cluster_routing::Slot>;

/// Redis' clock (Unix ms) on the node that holds `KEYS[1]`.
pub const TIME_MS: &str = r"
local t = redis.call('TIME')
return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
";

/// Added to an instance's outcome when one of its keys held another type and was replaced.
const REPLACED: i64 = 4;

/// One instance's status, ready to publish.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outgoing {
    pub instance_id: String,
    /// The exact bytes published and cached (the original's JSON form).
    pub body: String,
    /// When the GameLift call that returned it was sent (monotonic): the status is at
    /// least this fresh. Redis dates it from its age, so no wall clock is involved.
    pub polled_at: Instant,
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
    /// Of those, notices (not ACTIVE): each also a warning.
    pub notices_dropped: u64,
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
        self.notices_dropped += other.notices_dropped;
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
type Slot = Option<(u64, AnyConn)>;

/// Why a batch got no connection.
enum NoConnection {
    BackingOff,
    Failed,
}

/// The Redis side of the service.
pub struct Publisher {
    client: AnyClient,
    keys: InstanceKeys,
    cluster: bool,
    tls: bool,
    timeout: Duration,
    ttl_secs: u64,
    batch: usize,
    publish_unchanged: bool,
    script: redis::Script,
    /// Reads Redis' clock on the node of a batch's keys (see the module doc).
    clock: redis::Script,
    /// The last reading per node or slot: connection generation, when its answer was in,
    /// Redis' time then. At most one per slot (16,384).
    readings: Mutex<HashMap<ClockKey, (u64, Instant, i64)>>,
    /// How long a reading dates polls (see [`CLOCK_REFRESH`]).
    clock_refresh: Duration,
    /// This process's id as a writer (see [`polled_by_key`]).
    writer: String,
    /// The origin of this writer's sequence: a poll's sequence is its time since then.
    origin: Instant,
    slot: tokio::sync::Mutex<Slot>,
    generation: AtomicU64,
    /// The last connection generation on which a round trip succeeded: a connection thrown
    /// away before any did (a node that accepts and never answers) paces the next connect
    /// like a failed connect, so a silent Redis costs one timeout per backoff step.
    proven: AtomicU64,
    gate: Mutex<Gate>,
    /// Round trips that succeeded, and the last failure, since readiness was last settled.
    since_settled: Mutex<(u64, Option<String>)>,
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
        let target = config.redis_url.as_ref().ok_or_else(|| {
            redis::RedisError::from((redis::ErrorKind::InvalidClientConfig, "no --redis-url"))
        })?;
        let client = redis_conn::any_client(target, config.redis_ca_file.as_ref())?;
        Ok(Self {
            client,
            keys: target.keys(),
            cluster: target.is_cluster(),
            tls: target.is_tls(),
            timeout: config.redis_timeout,
            ttl_secs: config.cache_ttl().as_secs().max(1),
            batch: config.publish_batch.max(1) as usize,
            publish_unchanged: config.publish_unchanged,
            script: redis::Script::new(NEWER_ONLY),
            clock: redis::Script::new(TIME_MS),
            readings: Mutex::new(HashMap::new()),
            clock_refresh: CLOCK_REFRESH
                .max(config.period + config.cycle_jitter + config.cycle_deadline()),
            writer: new_writer_id(),
            // Early enough that every poll of this process comes after it.
            origin: Instant::now()
                .checked_sub(Duration::from_secs(3600))
                .unwrap_or_else(Instant::now),
            slot: tokio::sync::Mutex::new(None),
            generation: AtomicU64::new(0),
            proven: AtomicU64::new(0),
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
            since_settled: Mutex::new((0, None)),
            metrics,
            health,
        })
    }

    /// Sets the Redis readiness check from everything since the last call (one cycle):
    /// ready if any round trip succeeded. So one group whose batches keep failing (an ACL,
    /// an oversized batch) does not make readiness follow whichever batch finished last.
    pub fn settle_readiness(&self) {
        let (ok, error) =
            std::mem::take(&mut *self.since_settled.lock().unwrap_or_else(|p| p.into_inner()));
        match (ok, error) {
            (0, Some(error)) => self.health.set(READY_REDIS, false, error),
            (0, None) => {}
            (n, None) => self
                .health
                .set(READY_REDIS, true, format!("{n} round trips succeeded")),
            (n, Some(error)) => self.health.set(
                READY_REDIS,
                true,
                format!("{n} round trips succeeded; some failed: {error}"),
            ),
        }
    }

    /// Publishes and caches `messages`, `--publish-batch` instances per round trip, until
    /// `deadline`: what is not written by then fails this cycle (`reason="deadline"`, a
    /// warning with the count), so a slow or silent Redis never runs a cycle past it.
    /// On a Redis Cluster, one script per instance instead (an instance's keys share a
    /// slot, different instances' do not), many in flight at once: the cluster connection
    /// pipelines them per node and follows `MOVED`/`ASK` through a failover.
    pub async fn publish(&self, messages: &[Outgoing], deadline: Instant) -> PublishReport {
        let mut report = PublishReport::default();
        let mut done = 0usize;
        if self.cluster {
            let mut chunks = futures::stream::iter(messages.chunks(1))
                .map(|chunk| async move {
                    let mut r = PublishReport::default();
                    // One instance holds one of the slots in flight for at most one
                    // timeout, whatever the cluster client's own retries would take: a
                    // silent primary's instances must not keep the others waiting.
                    let sent =
                        tokio::time::timeout(self.timeout, self.publish_chunk(chunk, &mut r)).await;
                    if sent.is_err() {
                        r.round_trips += 1;
                        r.errors += 1;
                        Metrics::reason(&self.metrics.publish_errors, ErrorClass::Timeout.label());
                        Metrics::result(&self.metrics.redis_round_trips, "error");
                    }
                    r
                })
                .buffer_unordered(CLUSTER_IN_FLIGHT);
            let all = async {
                while let Some(r) = chunks.next().await {
                    report.add(&r);
                    done += 1;
                }
            };
            let _ = tokio::time::timeout_at(deadline, all).await;
        } else {
            for chunk in messages.chunks(self.batch) {
                let mut r = PublishReport::default();
                let sent =
                    tokio::time::timeout_at(deadline, self.publish_chunk(chunk, &mut r)).await;
                report.add(&r);
                if sent.is_err() {
                    break;
                }
                done += chunk.len();
            }
        }
        if done < messages.len() {
            self.cut(messages.len() - done, &mut report);
        }
        report
    }

    /// Statuses left unwritten at the deadline: one error, one warning.
    fn cut(&self, left: usize, report: &mut PublishReport) {
        report.errors += 1;
        Metrics::reason(&self.metrics.publish_errors, "deadline");
        tracing::warn!(
            message = "the cycle deadline passed before these statuses were written to Redis; their group goes first next cycle",
            instances = left,
            hint = "a slow or silent Redis (or a Redis Cluster node): see publish_errors_total{reason}",
        );
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
        // Unchanged is judged in the script against what Redis holds, not against what
        // this replica last sent, so another replica's write in between is seen.
        let mode = if self.publish_unchanged { "1" } else { "0" };
        let Some(first) = chunk.first() else { return };
        // On a cluster a chunk is one instance: its slot's reading, never another node's.
        let clock_key: ClockKey = self
            .cluster
            .then(|| redis::cluster_routing::Slot::for_key(self.keys.status(&first.instance_id)));
        let held = self
            .readings
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&clock_key)
            .copied();
        let (answered, redis_ms) = match held {
            Some((g, at, t)) if g == generation && at.elapsed() < self.clock_refresh => (at, t),
            _ => {
                // Counted with the batch it dates (round trips count batches).
                let read = self
                    .clock
                    .key(self.keys.status(&first.instance_id))
                    .invoke_async::<i64>(&mut conn)
                    .await;
                match read {
                    Ok(t) => {
                        let answered = Instant::now();
                        self.readings
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .insert(clock_key, (generation, answered, t));
                        (answered, t)
                    }
                    Err(e) => {
                        report.round_trips += 1;
                        report.errors += 1;
                        self.command_failed(generation, &e, chunk.len()).await;
                        return;
                    }
                }
            }
        };
        let mut invocation = self.script.prepare_invoke();
        invocation.arg(self.ttl_secs).arg(&self.writer);
        for m in chunk {
            let at_ms = if m.polled_at >= answered {
                redis_ms.saturating_add(m.polled_at.duration_since(answered).as_millis() as i64)
            } else {
                redis_ms.saturating_sub(answered.duration_since(m.polled_at).as_millis() as i64)
            };
            let seq_us = m
                .polled_at
                .saturating_duration_since(self.origin)
                .as_micros() as u64;
            invocation
                .key(self.keys.status(&m.instance_id))
                .key(self.keys.polled_at(&m.instance_id))
                .key(self.keys.polled_by(&m.instance_id))
                .arg(&m.instance_id)
                .arg(&m.body)
                .arg(at_ms)
                .arg(seq_us)
                .arg(mode);
        }

        report.round_trips += 1;
        let started = Instant::now();
        let sent: redis::RedisResult<Vec<i64>> = invocation.invoke_async(&mut conn).await;
        self.metrics
            .publish_duration
            .observe(started.elapsed().as_secs_f64());
        match sent {
            Ok(answer) if answer.len() == chunk.len() + 1 => {
                self.round_trip_ok(generation);
                // The script's own `TIME`, answered now: the freshest reading of this node.
                self.readings
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(clock_key, (generation, Instant::now(), answer[0]));
                let outcomes = &answer[1..];
                let (mut published, mut unchanged, mut stale) = (0u64, 0u64, 0u64);
                for (m, outcome) in chunk.iter().zip(outcomes) {
                    let outcome = if *outcome >= REPLACED {
                        self.wrong_type_replaced(m);
                        outcome - REPLACED
                    } else {
                        *outcome
                    };
                    match outcome {
                        0 => {
                            stale += 1;
                            if self.notice_dropped(m) {
                                report.notices_dropped += 1;
                            }
                        }
                        1 => published += 1,
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
                let err = redis::RedisError::from((
                    redis::ErrorKind::UnexpectedReturnType,
                    "script answered the wrong number of outcomes",
                    format!(
                        "{} for {} instances",
                        outcomes.len().saturating_sub(1),
                        chunk.len()
                    ),
                ));
                self.command_failed(generation, &err, chunk.len()).await;
            }
            Err(e) => {
                report.errors += 1;
                self.command_failed(generation, &e, chunk.len()).await;
            }
        }
    }

    /// One of `m`'s keys held another Redis type (someone else wrote it) and was replaced.
    fn wrong_type_replaced(&self, m: &Outgoing) {
        self.metrics.wrong_type_keys.inc();
        tracing::warn!(
            message = "replaced a key of the wrong type for this instance (not written by pubsub)",
            instance = %m.instance_id,
            hint = "something else writes lastcall:status:*, lastcall:polled_at:* or lastcall:polled_by:* keys",
        );
    }

    /// A status was dropped because another writer holds a later poll. That is routine for
    /// ACTIVE; for a notice it may mean clocks disagree and a drain is not heard, so it is
    /// a warning and an alertable counter. Returns whether `m` was a notice.
    fn notice_dropped(&self, m: &Outgoing) -> bool {
        let label = match StatusMessage::parse(m.body.as_bytes()).map(|msg| msg.status) {
            Ok(InstanceStatus::Active) => return false,
            Ok(s) => s.as_str(),
            Err(_) => crate::metrics::UNKNOWN_STATUS,
        };
        self.metrics
            .notices_dropped
            .get_or_create(&StatusLabels { status: label })
            .inc();
        tracing::warn!(
            message = "a notice was not written: Redis holds a status another pubsub replica polled later",
            instance = %m.instance_id,
            status = label,
            polled_ago_ms = m.polled_at.elapsed().as_millis() as u64,
            hint = "another replica polled it later (a rolling update, or replicas: 2); if this repeats with one replica, look at lastcall:polled_by of the instance",
        );
        true
    }

    /// Checks Redis with a PING (used when a cycle had nothing to publish), through the same
    /// connection and gate as publishing, so readiness follows Redis even with no instances.
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
            Ok(_) => self.round_trip_ok(generation),
            Err(e) => {
                report.errors += 1;
                self.command_failed(generation, &e, 0).await;
            }
        }
        report
    }

    /// The live connection, or a new one. Connecting is serialised by the slot's lock, so
    /// concurrent groups wait for one attempt instead of each making their own.
    async fn connection(&self) -> Result<(u64, AnyConn), NoConnection> {
        let mut slot = self.slot.lock().await;
        if let Some((generation, conn)) = slot.as_ref() {
            return Ok((*generation, conn.clone()));
        }
        if self.backing_off() {
            return Err(NoConnection::BackingOff);
        }
        match redis_conn::connect_any(&self.client, self.timeout).await {
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
    /// good, and count it. The next batch tries a fresh connection at once, unless the one
    /// dropped never completed a round trip (then the connect backs off, as a failed one
    /// does). On a Redis Cluster a timeout keeps the connection: it is one node's (the
    /// client keeps one per node and follows the slot map), so a silent primary fails only
    /// its own slots' instances instead of remaking every node's connection each time.
    async fn command_failed(&self, generation: u64, err: &redis::RedisError, batch: usize) {
        let class = redis_conn::classify(err);
        let drop = class.needs_new_connection() && !(self.cluster && class == ErrorClass::Timeout);
        if drop {
            let mut slot = self.slot.lock().await;
            if slot.as_ref().is_some_and(|(g, _)| *g == generation) {
                *slot = None;
                if self.proven.load(Ordering::Relaxed) != generation {
                    let mut gate = self.gate.lock().unwrap_or_else(|p| p.into_inner());
                    let delay = gate.backoff.next_delay();
                    gate.retry_at = Some(Instant::now() + delay);
                }
            }
        }
        self.failed(err, batch, false);
    }

    fn backing_off(&self) -> bool {
        let gate = self.gate.lock().unwrap_or_else(|p| p.into_inner());
        gate.retry_at.is_some_and(|at| Instant::now() < at)
    }

    fn round_trip_ok(&self, generation: u64) {
        self.proven.store(generation, Ordering::Relaxed);
        Metrics::result(&self.metrics.redis_round_trips, "ok");
        self.metrics.redis_up.set(1);
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
        self.since_settled
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .0 += 1;
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
        self.since_settled
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .1 = Some(format!("{reason}: {hint}: {error}"));
    }
}
