//! Reads the drain state for the webhook, never slowly and never fatally.
//!
//! Each answer reads Redis once (`HGETALL`, O(draining nodes)), so it reflects the state at
//! the time of the question. The read is bounded by `--webhook-redis-timeout`; on any
//! failure the answer is held (see [`Lookup::hold`]), and reads back off for a while, so a dead or
//! blackholed Redis costs one timeout per backoff step, not one per request. The connection
//! is the webhook's own: a slow publish batch never delays an answer.

use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use lastcall_common::backoff::Backoff;
use lastcall_common::drain_state::{self, Skip, Snapshot};
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

/// The webhook's view of `lastcall:drain-state`.
pub struct DrainReader {
    client: AnyClient,
    tls: bool,
    timeout: Duration,
    max_age: Duration,
    hold_limit: Duration,
    /// The hash read (`--cluster-name`).
    key: String,
    slot: tokio::sync::Mutex<Option<AnyConn>>,
    gate: Mutex<Gate>,
    last_prune: Mutex<Option<Instant>>,
    last_warning: Mutex<Option<Instant>>,
    metrics: WebhookMetrics,
}

impl std::fmt::Debug for DrainReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DrainReader")
            .field("timeout", &self.timeout)
            .field("max_age", &self.max_age)
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
            client,
            tls,
            timeout,
            max_age,
            hold_limit,
            key,
            slot: tokio::sync::Mutex::new(None),
            gate: Mutex::new(Gate {
                backoff: Backoff::new(RETRY_BASE, RETRY_MAX),
                retry_at: None,
                failing: None,
            }),
            last_prune: Mutex::new(None),
            last_warning: Mutex::new(None),
            metrics,
        }
    }

    /// Whether answers must hold because the hash was lost recently (see
    /// [`Snapshot::settling`]).
    pub fn settling(&self, snap: &Snapshot) -> bool {
        snap.settling(drain_state::unix_ms(SystemTime::now()), self.max_age)
    }

    /// The drain state now, within the timeout, or why it cannot be read (`backoff`,
    /// `timeout`, an error class): then the answer is held.
    pub async fn snapshot(&self) -> Result<Snapshot, &'static str> {
        if self.backing_off() {
            Metrics::result(&self.metrics.drain_state_reads, "backoff");
            return Err("backoff");
        }
        let started = Instant::now();
        let read = tokio::time::timeout(self.timeout, self.read()).await;
        self.metrics
            .drain_state_read_duration
            .observe(started.elapsed().as_secs_f64());
        match read {
            Ok(Ok((snap, conn))) => {
                self.read_ok(&snap, conn);
                Ok(snap)
            }
            Ok(Err(e)) => {
                let class = redis_conn::classify(&e);
                if class.needs_new_connection() {
                    self.forget_connection();
                }
                self.read_failed(class.label(), class.hint(self.tls), &e.to_string());
                Err(class.label())
            }
            Err(_) => {
                // A connection that did not answer in time is not trusted again.
                self.forget_connection();
                let label = ErrorClass::Timeout.label();
                self.read_failed(
                    label,
                    ErrorClass::Timeout.hint(self.tls),
                    "no answer within --webhook-redis-timeout",
                );
                Err(label)
            }
        }
    }

    async fn read(&self) -> redis::RedisResult<(Snapshot, AnyConn)> {
        let mut conn = {
            let mut slot = self.slot.lock().await;
            match slot.as_ref() {
                Some(c) => c.clone(),
                None => {
                    let c = redis_conn::connect_any(&self.client, self.timeout).await?;
                    *slot = Some(c.clone());
                    c
                }
            }
        };
        let now_ms = drain_state::unix_ms(SystemTime::now());
        let mut snap =
            drain_state::read_all(&mut conn, &self.key, now_ms, self.max_age, self.hold_limit)
                .await?;
        if snap.epoch_ms.is_none() {
            let epoch = drain_state::mark_epoch_in(&mut conn, &self.key, now_ms).await?;
            if epoch == now_ms {
                tracing::warn!(
                    message = "the drain state had no epoch: Redis lost it (a restart without persistence, a flush) or no webhook has read it yet; holding every Fleet while the agents write again",
                    hold_s = drain_state::RESTART_SETTLE.as_secs(),
                );
            }
            snap.epoch_ms = Some(epoch);
        }
        Ok((snap, conn))
    }

    /// Drops the shared connection so the next read opens a new one. Never waits: if
    /// another request holds the slot it is connecting, and the slot is empty anyway.
    fn forget_connection(&self) {
        if let Ok(mut slot) = self.slot.try_lock() {
            *slot = None;
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

    fn read_failed(&self, reason: &'static str, hint: &'static str, error: &str) {
        Metrics::result(&self.metrics.drain_state_reads, reason);
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
