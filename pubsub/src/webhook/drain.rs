//! Reads the drain state for the webhook, never slowly and never fatally.
//!
//! Each answer reads Redis once (one script: the hash's date checked, then `HGETALL`,
//! O(draining nodes)), so it reflects the state at the time of the question. The read is
//! bounded by `--webhook-redis-timeout`; on any failure the answer is held (see
//! [`Lookup::hold`]), and reads back off for a while, so a dead or blackholed Redis costs one
//! timeout per backoff step, not one per request. The connection is the webhook's own (a
//! slow publish batch never delays an answer), made in the background (see [`Link`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use lastcall_common::backoff::Backoff;
use lastcall_common::drain_state::{self, Redated, Skip, Snapshot};
use lastcall_common::fleetiq::trim_for_log;
use lastcall_common::redis_conn::{self, AnyClient, AnyConn, ErrorClass};
use tokio::time::Instant;

use crate::metrics::{Metrics, ReasonLabels, StateLabels, WebhookMetrics};

/// Backoff after a failed read: short, so drain state is used again soon after Redis
/// returns (Agones asks every 30 s by default).
const RETRY_BASE: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(10);
/// At most one prune pass, and one warning about bad entries, per this period.
const HOUSEKEEPING_EVERY: Duration = Duration::from_secs(60);

/// Extra Ready servers for one Fleet, or why none could be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// Read; `hold` says why the count may be short: a stale entry (within the hold
    /// limit, of a Node that exists) names the Fleet (`stale_entry`), or the hash was lost
    /// and the agents are still writing it again (`redis_restarted`).
    Read {
        extra: u64,
        hold: Option<&'static str>,
    },
    /// Counted as zero; the label says why (`backoff`, `timeout`, an error class).
    Unavailable(&'static str),
}

impl Lookup {
    pub fn extra(self) -> u64 {
        match self {
            Self::Read { extra, .. } => extra,
            Self::Unavailable(_) => 0,
        }
    }

    /// Why the answer must not shrink the Fleet, if it must not: the drain state could not
    /// be read, or part of it is stale.
    pub fn hold(self) -> Option<&'static str> {
        match self {
            Self::Read { hold, .. } => hold,
            Self::Unavailable(reason) => Some(reason),
        }
    }
}

#[derive(Debug)]
struct Gate {
    backoff: Backoff,
    retry_at: Option<Instant>,
    failing: Option<&'static str>,
}

/// The webhook's connection to Redis, as answers see it. Connecting is one background task
/// at a time, never cancelled by an answer's timeout: a connection through a silent Redis
/// Cluster node takes about two timeouts (see `redis_conn::connect_any`), longer than one
/// answer may wait, and a connect cut short would never learn the cluster's new node list.
/// Answers wait for it only as long as their own timeout, and are held meanwhile.
#[derive(Clone)]
enum Link {
    /// No connection and none being made.
    Down,
    Connecting,
    /// A connection and its generation (so a failure on an old one never drops a new one).
    Up(u64, AnyConn),
    /// The last connect failed (the label of its error class); the next answer after the
    /// backoff connects again.
    Failed(&'static str),
}

/// The webhook's view of `lastcall:drain-state`.
pub struct DrainReader {
    inner: Arc<Inner>,
}

struct Inner {
    client: AnyClient,
    tls: bool,
    timeout: Duration,
    max_age: Duration,
    hold_limit: Duration,
    /// The hash read (`--cluster-name`).
    key: String,
    link: tokio::sync::watch::Sender<Link>,
    generation: AtomicU64,
    gate: Mutex<Gate>,
    last_prune: Mutex<Option<Instant>>,
    last_warning: Mutex<Option<Instant>>,
    metrics: WebhookMetrics,
}

impl std::fmt::Debug for DrainReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DrainReader")
            .field("timeout", &self.inner.timeout)
            .field("max_age", &self.inner.max_age)
            .finish_non_exhaustive()
    }
}

impl DrainReader {
    /// No I/O: the first question connects.
    pub fn new(
        client: AnyClient,
        tls: bool,
        timeout: Duration,
        max_age: Duration,
        hold_limit: Duration,
        key: String,
        metrics: WebhookMetrics,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                client,
                tls,
                timeout,
                max_age,
                hold_limit,
                key,
                link: tokio::sync::watch::Sender::new(Link::Down),
                generation: AtomicU64::new(0),
                gate: Mutex::new(Gate {
                    backoff: Backoff::new(RETRY_BASE, RETRY_MAX),
                    retry_at: None,
                    failing: None,
                }),
                last_prune: Mutex::new(None),
                last_warning: Mutex::new(None),
                metrics,
            }),
        }
    }

    /// Whether answers must hold because the hash was lost recently (see
    /// [`Snapshot::settling`]).
    pub fn settling(&self, snap: &Snapshot) -> bool {
        snap.settling(drain_state::unix_ms(SystemTime::now()), self.inner.max_age)
    }

    /// The drain state now, by `deadline` (at most the webhook's Redis timeout from now),
    /// or why it cannot be read (`backoff`, `connecting`, `timeout`, an error class): then
    /// the answer is held.
    pub async fn snapshot(&self, deadline: Instant) -> Result<Snapshot, &'static str> {
        let me = &self.inner;
        if me.backing_off() {
            Metrics::result(&me.metrics.drain_state_reads, "backoff");
            return Err("backoff");
        }
        let deadline = deadline.min(Instant::now() + me.timeout);
        let started = Instant::now();
        let conn = tokio::time::timeout_at(deadline, me.connection()).await;
        let (generation, mut conn) = match conn {
            Ok(Ok(c)) => c,
            Ok(Err(label)) => {
                // Counted and logged (with the backoff step) by the connect itself.
                Metrics::result(&me.metrics.drain_state_reads, label);
                return Err(label);
            }
            Err(_) => {
                // The connect goes on in the background; a later answer uses it.
                Metrics::result(&me.metrics.drain_state_reads, CONNECTING);
                return Err(CONNECTING);
            }
        };
        let now_ms = drain_state::unix_ms(SystemTime::now());
        let read = tokio::time::timeout_at(
            deadline,
            drain_state::read_dated(&mut conn, &me.key, now_ms, me.max_age, me.hold_limit),
        )
        .await;
        me.metrics
            .drain_state_read_duration
            .observe(started.elapsed().as_secs_f64());
        match read {
            Ok(Ok((snap, redated))) => {
                if redated != Redated::No {
                    tracing::warn!(
                        message = match redated {
                            Redated::Missing =>
                                "the drain state had no epoch: Redis lost it (a restart without persistence, a flush) or no webhook has read it yet; holding every Fleet while the agents write again",
                            _ =>
                                "the drain state was dated on another run of the Redis server: it restarted from a snapshot or failed over to a replica, and may have lost drains written since; holding every Fleet while the agents write again",
                        },
                        hold_s = drain_state::RESTART_SETTLE.as_secs(),
                    );
                }
                me.read_ok(&snap, conn);
                Ok(snap)
            }
            Ok(Err(e)) => {
                let class = redis_conn::classify(&e);
                if class.needs_new_connection() {
                    me.reconnect(generation);
                }
                Metrics::result(&me.metrics.drain_state_reads, class.label());
                me.failed(class.label(), class.hint(me.tls), &e.to_string());
                Err(class.label())
            }
            Err(_) => {
                // A connection that did not answer in time is not trusted again.
                me.reconnect(generation);
                let label = ErrorClass::Timeout.label();
                Metrics::result(&me.metrics.drain_state_reads, label);
                me.failed(
                    label,
                    ErrorClass::Timeout.hint(me.tls),
                    "no answer within --webhook-redis-timeout",
                );
                Err(label)
            }
        }
    }
}

/// Label of a read that found the connection still being made.
const CONNECTING: &str = "connecting";

impl Inner {
    /// The connection, once there is one: starts a connect when there is none (and none is
    /// under way) and waits for it, or for its failure.
    async fn connection(self: &Arc<Self>) -> Result<(u64, AnyConn), &'static str> {
        let mut rx = self.link.subscribe();
        let mut first = true;
        loop {
            let state = rx.borrow_and_update().clone();
            match state {
                Link::Up(generation, conn) => return Ok((generation, conn)),
                Link::Failed(label) if !first => return Err(label),
                Link::Connecting => {}
                Link::Down | Link::Failed(_) => self.start_connect(),
            }
            first = false;
            if rx.changed().await.is_err() {
                return Err(ErrorClass::Connection.label());
            }
        }
    }

    /// Starts the one background connect, unless one runs or a connection is up.
    fn start_connect(self: &Arc<Self>) {
        let claimed = self.link.send_if_modified(|l| {
            if matches!(l, Link::Down | Link::Failed(_)) {
                *l = Link::Connecting;
                true
            } else {
                false
            }
        });
        if !claimed {
            return;
        }
        let me = self.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            // Bounded inside: per node, and the cluster connection, each by the timeout.
            let result = redis_conn::connect_any(&me.client, me.timeout).await;
            me.metrics
                .redis_connect_duration
                .observe(started.elapsed().as_secs_f64());
            match result {
                Ok(conn) => {
                    Metrics::result(&me.metrics.redis_connects, "ok");
                    // A fresh connection is worth a read at once.
                    me.gate.lock().unwrap_or_else(|p| p.into_inner()).retry_at = None;
                    let generation = me.generation.fetch_add(1, Ordering::Relaxed) + 1;
                    me.link.send_replace(Link::Up(generation, conn));
                }
                Err(e) => {
                    let class = redis_conn::classify(&e);
                    Metrics::result(&me.metrics.redis_connects, "error");
                    me.failed(class.label(), class.hint(me.tls), &e.to_string());
                    me.link.send_replace(Link::Failed(class.label()));
                }
            }
        });
    }

    /// Drops connection `generation` (a newer one stays) and starts a new one at once, in
    /// the background: answers meanwhile back off (held) without waiting for it, and the
    /// first after the backoff uses it. So a failover is followed within about one connect
    /// (the new slot map), not one backoff step after another.
    fn reconnect(self: &Arc<Self>, generation: u64) {
        let dropped = self.link.send_if_modified(|l| {
            if matches!(l, Link::Up(g, _) if *g == generation) {
                *l = Link::Down;
                true
            } else {
                false
            }
        });
        if dropped {
            self.start_connect();
        }
    }

    fn backing_off(&self) -> bool {
        let gate = self.gate.lock().unwrap_or_else(|p| p.into_inner());
        gate.retry_at.is_some_and(|at| Instant::now() < at)
    }

    fn read_ok(&self, snap: &Snapshot, conn: AnyConn) {
        Metrics::result(&self.metrics.drain_state_reads, "ok");
        let recovered = {
            let mut gate = self.gate.lock().unwrap_or_else(|p| p.into_inner());
            gate.backoff.reset();
            gate.retry_at = None;
            gate.failing.take()
        };
        if let Some(after) = recovered {
            tracing::info!(message = "drain state readable again", after);
        }
        let (mut stale, mut malformed, mut expired, mut future) = (0i64, 0i64, 0i64, 0i64);
        for s in &snap.skipped {
            self.metrics
                .drain_state_skipped
                .get_or_create(&ReasonLabels {
                    reason: s.why.metric_label(),
                })
                .inc();
            match s.why {
                Skip::Malformed(_) => malformed += 1,
                Skip::Future { .. } => future += 1,
                Skip::Stale { .. } | Skip::StaleCounts { .. } => stale += 1,
                Skip::Expired { .. } => expired += 1,
            }
        }
        let nodes = &self.metrics.drain_state_nodes;
        nodes
            .get_or_create(&StateLabels { state: "fresh" })
            .set(snap.fresh_nodes as i64);
        nodes
            .get_or_create(&StateLabels { state: "stale" })
            .set(stale);
        nodes
            .get_or_create(&StateLabels { state: "malformed" })
            .set(malformed);
        nodes
            .get_or_create(&StateLabels { state: "expired" })
            .set(expired);
        nodes
            .get_or_create(&StateLabels { state: "future" })
            .set(future);
        if !snap.skipped.is_empty() && due(&self.last_warning) {
            let first: Vec<String> = snap
                .skipped
                .iter()
                .filter(|s| {
                    matches!(
                        s.why,
                        Skip::Malformed(_) | Skip::Future { .. } | Skip::Expired { .. }
                    )
                })
                .take(5)
                .map(|s| match &s.why {
                    Skip::Malformed(e) => format!("{}: {e}", trim_for_log(&s.node, 64)),
                    other => format!("{}: {}", trim_for_log(&s.node, 64), other.metric_label()),
                })
                .collect();
            if !first.is_empty() {
                tracing::warn!(
                    message = "drain state entries skipped (they count for nothing; only stale ones within the hold limit hold the Fleets they name)",
                    malformed,
                    stale,
                    expired,
                    future,
                    first = ?first
                );
            }
        }
        self.prune(snap, conn);
    }

    /// Deletes long-dead entries in the background, at most once per housekeeping period.
    fn prune(&self, snap: &Snapshot, mut conn: AnyConn) {
        let dead: Vec<(String, Vec<u8>, Vec<u8>)> = snap
            .prunable(self.max_age)
            .map(|s| (s.node.clone(), s.field.clone(), s.value.clone()))
            .collect();
        if dead.is_empty() || !due(&self.last_prune) {
            return;
        }
        let pruned = self.metrics.drain_state_pruned.clone();
        let timeout = self.timeout;
        let key = self.key.clone();
        tokio::spawn(async move {
            for (node, field, value) in dead {
                match tokio::time::timeout(
                    timeout,
                    drain_state::prune(&mut conn, &key, &field, &value),
                )
                .await
                {
                    Ok(Ok(true)) => {
                        pruned.inc();
                        tracing::info!(message = "pruned a long-dead drain state entry", node = %trim_for_log(&node, 64));
                    }
                    Ok(Ok(false)) => {}
                    Ok(Err(e)) => {
                        tracing::debug!(message = "pruning drain state failed", error = %e);
                        return;
                    }
                    Err(_) => return,
                }
            }
        });
    }

    /// One step of the backoff, and one warning per outage (repeats at debug).
    fn failed(&self, reason: &'static str, hint: &'static str, error: &str) {
        let (first, retry_in) = {
            let mut gate = self.gate.lock().unwrap_or_else(|p| p.into_inner());
            let first = gate.failing != Some(reason);
            gate.failing = Some(reason);
            let delay = gate.backoff.next_delay();
            gate.retry_at = Some(Instant::now() + delay);
            (first, delay)
        };
        let error = trim_for_log(error, 300);
        let retry_in_ms = retry_in.as_millis() as u64;
        if first {
            tracing::warn!(message = "cannot read the drain state; answers may grow Fleets but not shrink them", reason, hint, retry_in_ms, error = %error);
        } else {
            tracing::debug!(message = "drain state still unreadable", reason, retry_in_ms, error = %error);
        }
    }
}

/// Whether `every` has passed since `last`; if so, marks now.
fn due(last: &Mutex<Option<Instant>>) -> bool {
    let mut last = last.lock().unwrap_or_else(|p| p.into_inner());
    let now = Instant::now();
    if last.is_some_and(|at| now.duration_since(at) < HOUSEKEEPING_EVERY) {
        return false;
    }
    *last = Some(now);
    true
}
