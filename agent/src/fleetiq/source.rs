//! The FleetIQ signal source: SUBSCRIBE to the instance channel, read pubsub's cached value on
//! every (re)subscribe, and fall back to asking GameLift when Redis goes quiet.
//!
//! A dropped connection keeps the last view (it never turns into "all clear"), is counted,
//! and is retried with jittered backoff. A bad message changes nothing: malformed, duplicate
//! keys (suspicious), another instance, or a status this version does not know (held, never
//! read as a cancel).
//!
//! Ordering: every status carries when it was polled, if known (pubsub keeps it beside the
//! cache key; the fallback uses the time it sent its own call). A status older than the one
//! held is ignored, so a cached or delayed Redis value never overrides what the fallback
//! learned later, and a slow fallback never overrides a newer Redis value.
//!
//! Quiet is not dead: with `--publish-unchanged=false` pubsub publishes nothing while nothing
//! changes. When a keep-alive period passes without a message, the source reads the
//! polled-at key; if pubsub has polled this instance since, the status is confirmed and the
//! GameLift fallback stays idle.

use std::time::Duration;

use tokio::time::Instant;

use futures::StreamExt;
use lastcall_common::backoff::Backoff;
use lastcall_common::fleetiq::{ParseError, StatusMessage, trim_for_log};
use lastcall_common::redis_conn::{self, CaFile, ErrorClass};
use lastcall_common::redis_url::RedisTarget;
use redis::AsyncCommands;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::gamelift::GameLift;
use super::view::{FleetIqView, Via};
use crate::metrics::{Metrics, ResultLabel, SourceLabel, SourceReason, SourceStatus};
#[cfg(test)]
use lastcall_common::fleetiq::InstanceStatus;

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
    /// CA bundle for `rediss://` (`--redis-ca-file`).
    pub ca_file: Option<CaFile>,
}

/// Which node the subscription goes through, kept across sessions: the next session
/// starts from the node that last worked, or from the one after it when it was that
/// node's connection that failed. The first starts from [`first_subscription_node`].
#[derive(Default)]
struct Subscription {
    /// Index into the session's node list.
    next: usize,
    /// The node last subscribed through (its URL), to log a move.
    node: Option<String>,
    /// `next` was chosen once by [`first_subscription_node`].
    spread: bool,
}

/// Where the first subscription of `channel` starts among the `nodes` known (the URL's, then
/// those learned from the slot map): a stable hash of the channel, so a Redis Cluster's
/// subscribers (one channel per instance) spread evenly over its nodes instead of all
/// landing on the first one the URL names. Every node hears every classic PUBLISH, so any
/// of them serves.
pub fn first_subscription_node(channel: &str, nodes: usize) -> usize {
    use std::hash::{Hash, Hasher};
    if nodes <= 1 {
        return 0;
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    channel.hash(&mut h);
    (h.finish() % nodes as u64) as usize
}

enum End {
    Shutdown,
    Failed { class: ErrorClass, error: String },
}

fn failed(class: ErrorClass, error: impl Into<String>) -> End {
    End::Failed {
        class,
        error: error.into(),
    }
}

fn redis_failed(context: &str, e: &redis::RedisError) -> End {
    failed(redis_conn::classify(e), format!("{context}: {e}"))
}

/// The ordering rule shared by Redis and the fallback: may a status polled at `candidate`
/// replace the one held, polled at `held`? Unknown times are trusted only where they
/// cannot undo a timed one: a cached value without a time never overrides a status the
/// fallback timed; a live message without one (an older publisher) still applies, as it
/// always did.
pub fn may_replace(
    held: Option<i64>,
    held_via: Option<Via>,
    candidate: Option<i64>,
    via: Via,
) -> bool {
    match (held, candidate) {
        (Some(h), Some(c)) => c >= h,
        (Some(_), None) => !(via == Via::Cache && held_via == Some(Via::Fallback)),
        (None, _) => true,
    }
}

/// The ACL forbids reading pubsub's keys: live messages still work, so this is no reason
/// to drop the subscription.
fn denied(e: &redis::RedisError) -> bool {
    redis_conn::classify(e) == ErrorClass::NoPermission
}

/// Unix milliseconds now.
fn unix_ms() -> i64 {
    jiff::Timestamp::now().as_millisecond()
}

/// When a status was first seen: when it was polled, if known (pubsub polls a whole period
/// before an agent may hear of it, and a Spot deadline counts from the poll), never later
/// than `now` (a clock ahead of ours is clamped).
pub fn first_sight(polled_at_ms: Option<i64>, now: jiff::Timestamp) -> jiff::Timestamp {
    polled_at_ms
        .and_then(|ms| jiff::Timestamp::from_millisecond(ms).ok())
        .map_or(now, |polled| polled.min(now))
}

impl RedisSource {
    /// Applies one message body. Returns whether it changed the view.
    pub fn handle(&self, body: &[u8], via: Via) -> bool {
        self.handle_at(body, via, None)
    }

    /// Applies one message body polled at `polled_at_ms` (if known), newer-only.
    pub fn handle_at(&self, body: &[u8], via: Via, polled_at_ms: Option<i64>) -> bool {
        let m = &self.metrics;
        match StatusMessage::parse(body) {
            Err(e) => {
                m.signals_rejected
                    .get_or_create(&SourceReason {
                        source: SOURCE,
                        reason: e.metric_label(),
                    })
                    .inc();
                let payload = trim_for_log(&String::from_utf8_lossy(body), 256);
                match e {
                    ParseError::UnknownStatus(_) => warn!(
                        message = "FleetIQ status this version does not know; holding the current status",
                        error = %e,
                        %payload,
                    ),
                    ParseError::DuplicateKey(_) => warn!(
                        message = "suspicious FleetIQ status message with a duplicate key; ignored",
                        error = %e,
                        %payload,
                    ),
                    _ => warn!(
                        message = "rejected FleetIQ status message",
                        error = %e,
                        %payload,
                    ),
                }
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
                let mut older = false;
                self.view.send_modify(|v| {
                    if !may_replace(v.polled_at_ms, v.via, polled_at_ms, via) {
                        older = true;
                        return;
                    }
                    changed = v.status != Some(msg.status);
                    let seen = first_sight(polled_at_ms, jiff::Timestamp::now());
                    v.observe(msg.status, via, seen, Instant::now());
                    v.polled_at_ms = polled_at_ms;
                });
                if older {
                    m.signals_rejected
                        .get_or_create(&SourceReason {
                            source: SOURCE,
                            reason: "older_than_held",
                        })
                        .inc();
                    info!(
                        message = "ignored a FleetIQ status older than the one held",
                        status = %msg.status,
                        via = ?via,
                        polled_at_ms = ?polled_at_ms,
                    );
                    return false;
                }
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

    /// Runs until `shutdown`; never returns early on Redis errors. A wrong password, an
    /// untrusted certificate or a TLS mismatch is logged once as one line naming the cause
    /// (repeats of the same cause are debug), counted, and retried with backoff: the last
    /// status is kept, so a Redis problem never drains or un-drains the node.
    pub async fn run(self, shutdown: CancellationToken) {
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
        let mut last_class: Option<ErrorClass> = None;
        let mut polled_seen: Option<i64> = None;
        // One client for the whole run: on a Redis Cluster it remembers the nodes learned
        // from the slot map, so losing the URL's node loses nothing.
        let keys_client = match redis_conn::any_client(&self.target, self.ca_file.as_ref()) {
            Ok(c) => c,
            Err(e) => {
                // The URL and CA were checked at start; nothing a retry could change.
                self.count_error(redis_conn::classify(&e));
                warn!(message = "FleetIQ over Redis disabled: the Redis client cannot be built", error = %e, redis = %self.target);
                shutdown.cancelled().await;
                return;
            }
        };
        let mut at = Subscription::default();
        loop {
            let began = Instant::now();
            let end = self
                .session(
                    &shutdown,
                    &keys_client,
                    &mut at,
                    &mut polled_seen,
                    &mut last_class,
                )
                .await;
            self.set_up(false);
            match end {
                End::Shutdown => return,
                End::Failed { class, error } => {
                    if began.elapsed() > HEALTHY_SESSION {
                        backoff.reset();
                    }
                    let delay = backoff.next_delay();
                    self.metrics.redis_reconnects.inc();
                    self.count_error(class);
                    let retry_in_ms = delay.as_millis() as u64;
                    let hint = class.hint(self.target.is_tls());
                    if last_class != Some(class) {
                        warn!(
                            message = "Redis unavailable; keeping the last FleetIQ status and retrying",
                            reason = class.label(),
                            hint,
                            error = %trim_for_log(&error, 300),
                            retry_in_ms,
                            redis = %self.target,
                        );
                    } else {
                        debug!(
                            message = "Redis still unavailable",
                            reason = class.label(),
                            error = %trim_for_log(&error, 300),
                            retry_in_ms,
                        );
                    }
                    last_class = Some(class);
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
    }

    fn count_error(&self, class: ErrorClass) {
        self.metrics
            .redis_errors
            .get_or_create(&SourceReason {
                source: SOURCE,
                reason: class.label(),
            })
            .inc();
    }

    /// The nodes a SUBSCRIBE may go through: the target itself, or on a Redis Cluster
    /// every node known (the URL's, then those learned from the slot map). A cluster
    /// broadcasts every PUBLISH to all its nodes, so any of them hears the channel.
    fn subscribe_nodes(&self, keys_client: &redis_conn::AnyClient) -> Vec<RedisTarget> {
        match keys_client {
            redis_conn::AnyClient::Cluster(seeds) => seeds.nodes(),
            redis_conn::AnyClient::Single(_) => vec![self.target.clone()],
        }
    }

    /// SUBSCRIBEs through the first node, from `at` on, that accepts. Each node that fails
    /// is counted in `redis_errors`; subscribing past failed nodes is one warning naming
    /// them. Only when every node failed does the session fail (and back off).
    async fn subscribe(
        &self,
        nodes: &[RedisTarget],
        at: &mut Subscription,
    ) -> Result<(redis::aio::PubSubSink, redis::aio::PubSubStream), End> {
        let mut last = failed(ErrorClass::Connection, "no Redis node to subscribe through");
        let mut skipped: Vec<String> = Vec::new();
        for step in 0..nodes.len() {
            let i = (at.next + step) % nodes.len();
            let node = &nodes[i];
            match self.subscribe_through(node).await {
                Ok(pair) => {
                    at.next = i;
                    if !skipped.is_empty() {
                        warn!(
                            message = "Redis Cluster nodes refused the FleetIQ subscription; subscribed through another",
                            node = %node,
                            failed = %trim_for_log(&skipped.join("; "), 600),
                        );
                    }
                    if at.node.as_ref().is_some_and(|n| n != node.url()) {
                        info!(message = "FleetIQ subscription moved to another Redis node", node = %node);
                    }
                    at.node = Some(node.url().to_string());
                    return Ok(pair);
                }
                Err(end) => {
                    if let End::Failed { class, error } = &end
                        && nodes.len() > 1
                    {
                        self.count_error(*class);
                        debug!(message = "cannot subscribe through this Redis node", node = %node, reason = class.label(), error = %trim_for_log(error, 300));
                        skipped.push(format!("{node}: {}", class.label()));
                    }
                    last = end;
                }
            }
        }
        at.next = (at.next + 1) % nodes.len().max(1);
        Err(last)
    }

    async fn subscribe_through(
        &self,
        node: &RedisTarget,
    ) -> Result<(redis::aio::PubSubSink, redis::aio::PubSubStream), End> {
        let client = match redis_conn::client(node, self.ca_file.as_ref()) {
            Ok(c) => c,
            Err(e) => return Err(redis_failed("Redis client", &e)),
        };
        let pubsub = match tokio::time::timeout(IO_TIMEOUT, client.get_async_pubsub()).await {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => return Err(redis_failed("connect", &e)),
            Err(_) => return Err(failed(ErrorClass::Timeout, "connect timed out")),
        };
        let (mut sink, stream) = pubsub.split();
        match tokio::time::timeout(IO_TIMEOUT, sink.subscribe(&self.channel)).await {
            Ok(Ok(())) => Ok((sink, stream)),
            Ok(Err(e)) => Err(redis_failed("SUBSCRIBE", &e)),
            Err(_) => Err(failed(ErrorClass::Timeout, "SUBSCRIBE timed out")),
        }
    }

    async fn session(
        &self,
        shutdown: &CancellationToken,
        keys_client: &redis_conn::AnyClient,
        at: &mut Subscription,
        polled_seen: &mut Option<i64>,
        last_class: &mut Option<ErrorClass>,
    ) -> End {
        // The keys: on a Redis Cluster they live on their slot's primary, so they are read
        // through a cluster connection that follows MOVED/ASK; connecting also refreshes the
        // nodes known.
        let mut conn = match redis_conn::connect_any(keys_client, IO_TIMEOUT).await {
            Ok(conn) => conn,
            Err(e) => return redis_failed("connect for the cached status", &e),
        };
        let nodes = self.subscribe_nodes(keys_client);
        if !at.spread {
            at.spread = true;
            at.next = first_subscription_node(&self.channel, nodes.len());
        }
        let (mut sink, mut stream) = match self.subscribe(&nodes, at).await {
            Ok(pair) => pair,
            Err(end) => return end,
        };
        // Subscribed first, then read the cache: nothing published in between is missed.
        match self.read_cache(&mut conn).await {
            Ok(Some((body, polled_at))) => {
                *polled_seen = polled_at.or(*polled_seen);
                self.handle_at(&body, Via::Cache, polled_at);
            }
            Ok(None) => debug!(message = "no cached FleetIQ status yet"),
            // An ACL user allowed only to subscribe still gets live messages.
            Err(e) if denied(&e) => {
                warn!(message = "not allowed to read the cached status; live messages only", error = %e)
            }
            Err(e) => return redis_failed("reading the cached status", &e),
        }
        self.set_up(true);
        if last_class.take().is_some() {
            info!(message = "Redis reachable again", channel = %self.channel, redis = %self.target);
        }
        let node = &nodes[at.next % nodes.len()];
        info!(message = "subscribed to FleetIQ status", channel = %self.channel, redis = %self.target, node = %node);
        let mut ping = tokio::time::interval(self.ping_every);
        ping.tick().await;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return End::Shutdown,
                msg = stream.next() => match msg {
                    None => {
                        // The node went away: the next session starts from the next node.
                        at.next = (at.next + 1) % nodes.len();
                        return failed(ErrorClass::Connection, format!("the subscription's connection to {node} closed"));
                    }
                    Some(m) => {
                        // The message's bytes are the original's; its polled-at time is
                        // beside the cache key (written before the PUBLISH).
                        let polled_at = match tokio::time::timeout(
                            IO_TIMEOUT,
                            conn.get::<_, Option<i64>>(self.target.keys().polled_at(&self.instance_id)),
                        )
                        .await
                        {
                            Ok(Ok(at)) => at,
                            Ok(Err(e)) if denied(&e) => None,
                            Ok(Err(e)) => return redis_failed("reading the polled-at time", &e),
                            Err(_) => return failed(ErrorClass::Timeout, "reading the polled-at time timed out"),
                        };
                        *polled_seen = polled_at.or(*polled_seen);
                        self.handle_at(m.get_payload_bytes(), Via::Message, polled_at);
                    }
                },
                _ = ping.tick() => {
                    let pinged = match tokio::time::timeout(IO_TIMEOUT, sink.ping::<redis::Value>()).await {
                        Ok(Ok(_)) => None,
                        Ok(Err(e)) => Some(redis_failed("PING", &e)),
                        Err(_) => Some(failed(ErrorClass::Timeout, "PING timed out")),
                    };
                    if let Some(end) = pinged {
                        at.next = (at.next + 1) % nodes.len();
                        return end;
                    }
                    let quiet = self
                        .view
                        .borrow()
                        .last_seen
                        .is_none_or(|t| t.elapsed() >= self.ping_every);
                    if quiet
                        && let Err(e) = self.confirm_quiet(&mut conn, polled_seen).await
                        && !denied(&e)
                    {
                        return redis_failed("checking the polled-at time", &e);
                    }
                }
            }
        }
    }

    /// The cached status and its polled-at time, in one round trip.
    async fn read_cache(
        &self,
        conn: &mut redis_conn::AnyConn,
    ) -> redis::RedisResult<Option<(Vec<u8>, Option<i64>)>> {
        let keys = self.target.keys();
        let (body, at): (Option<Vec<u8>>, Option<i64>) = redis::cmd("MGET")
            .arg(keys.status(&self.instance_id))
            .arg(keys.polled_at(&self.instance_id))
            .query_async(conn)
            .await?;
        Ok(body.map(|b| (b, at)))
    }

    /// No message for a keep-alive period: if pubsub polled this instance since we last
    /// looked, it is alive and merely quiet (`--publish-unchanged=false`), so the cached
    /// status is applied (newer-only) and the view counts as fresh.
    async fn confirm_quiet(
        &self,
        conn: &mut redis_conn::AnyConn,
        polled_seen: &mut Option<i64>,
    ) -> redis::RedisResult<()> {
        let Some((body, Some(at))) = self.read_cache(conn).await? else {
            return Ok(());
        };
        if polled_seen.is_some_and(|seen| at <= seen) {
            return Ok(());
        }
        *polled_seen = Some(at);
        debug!(
            message = "pubsub is quiet but alive: polled-at moved",
            polled_at_ms = at
        );
        self.metrics
            .signals
            .get_or_create(&SourceStatus {
                source: SOURCE,
                status: "confirmed",
            })
            .inc();
        if !self.handle_at(&body, Via::Cache, Some(at)) {
            // Older than what the fallback learned, or unchanged: either way pubsub is alive.
            self.view.send_modify(|v| {
                if v.status.is_some() {
                    v.last_seen = Some(Instant::now());
                }
            });
        }
        Ok(())
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
        let sent_at_ms = unix_ms();
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
                let mut applied = false;
                view.send_modify(|v| {
                    if may_replace(v.polled_at_ms, v.via, Some(sent_at_ms), Via::Fallback) {
                        applied = true;
                        v.observe(
                            status,
                            Via::Fallback,
                            first_sight(Some(sent_at_ms), jiff::Timestamp::now()),
                            Instant::now(),
                        );
                        v.polled_at_ms = Some(sent_at_ms);
                    }
                });
                if applied {
                    info!(message = "Redis is quiet; status read from GameLift", status = %status);
                } else {
                    info!(message = "GameLift answer older than the status held; ignored", status = %status);
                }
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

#[cfg(test)]
mod tests {
    #[test]
    fn first_subscriptions_spread_over_the_nodes() {
        assert_eq!(super::first_subscription_node("i-0", 0), 0);
        assert_eq!(super::first_subscription_node("i-0", 1), 0);
        let mut per_node = [0usize; 6];
        for i in 0..6000 {
            let ch = format!("i-{i:017x}");
            let n = super::first_subscription_node(&ch, 6);
            assert_eq!(
                n,
                super::first_subscription_node(&ch, 6),
                "stable for a channel"
            );
            per_node[n] += 1;
        }
        // Even within 10% of the 1,000 each would get.
        assert!(
            per_node.iter().all(|&n| (900..=1100).contains(&n)),
            "{per_node:?}"
        );
    }

    use super::*;

    fn source() -> (RedisSource, watch::Receiver<FleetIqView>, Metrics) {
        let (metrics, _registry) = Metrics::new();
        let (tx, rx) = watch::channel(FleetIqView::default());
        let src = RedisSource {
            target: RedisTarget::parse("127.0.0.1:1").unwrap(),
            channel: "i-1".into(),
            instance_id: "i-1".into(),
            metrics: metrics.clone(),
            view: tx,
            ping_every: PING_EVERY,
            ca_file: None,
        };
        (src, rx, metrics)
    }

    fn rejected(m: &Metrics, reason: &'static str) -> u64 {
        m.signals_rejected
            .get_or_create(&SourceReason {
                source: SOURCE,
                reason,
            })
            .get()
    }

    #[test]
    fn duplicate_keys_are_suspicious_and_never_drain() {
        let (src, rx, m) = source();
        let body = br#"{"InstanceId":"i-1","InstanceStatus":"ACTIVE","InstanceStatus":"DRAINING"}"#;
        assert!(!src.handle(body, Via::Message));
        assert_eq!(rx.borrow().status, None);
        assert_eq!(rejected(&m, "duplicate_key"), 1);
    }

    #[test]
    fn unknown_statuses_hold_a_drain() {
        let (src, rx, m) = source();
        assert!(src.handle(
            br#"{"InstanceId":"i-1","InstanceStatus":"DRAINING"}"#,
            Via::Message
        ));
        assert!(!src.handle(
            br#"{"InstanceId":"i-1","InstanceStatus":"HIBERNATING"}"#,
            Via::Message
        ));
        assert_eq!(
            rx.borrow().status,
            Some(InstanceStatus::Draining),
            "held, not cancelled"
        );
        assert_eq!(rejected(&m, "unknown_status"), 1);
    }

    #[test]
    fn an_older_cache_never_overrides_the_fallback() {
        let (src, rx, m) = source();
        src.view.send_modify(|v| {
            v.observe(
                InstanceStatus::Draining,
                Via::Fallback,
                jiff::Timestamp::now(),
                Instant::now(),
            );
            v.polled_at_ms = Some(2_000);
        });
        let active = br#"{"InstanceId":"i-1","InstanceStatus":"ACTIVE"}"#;
        assert!(!src.handle_at(active, Via::Cache, Some(1_000)));
        assert!(
            !src.handle_at(active, Via::Cache, None),
            "an untimed cache cannot undo a timed fallback"
        );
        assert_eq!(rx.borrow().status, Some(InstanceStatus::Draining));
        assert_eq!(rejected(&m, "older_than_held"), 2);
        assert!(
            src.handle_at(active, Via::Cache, Some(3_000)),
            "a newer poll applies"
        );
        assert_eq!(rx.borrow().status, Some(InstanceStatus::Active));
    }

    #[test]
    fn a_spot_deadline_counts_from_when_pubsub_polled_it() {
        let spot = br#"{"InstanceId":"i-1","InstanceStatus":"SPOT_TERMINATING"}"#;
        let deadline = |polled_at_ms: Option<i64>| {
            let (src, rx, _) = source();
            let before = jiff::Timestamp::now();
            assert!(src.handle_at(spot, Via::Message, polled_at_ms));
            let after = jiff::Timestamp::now();
            let n = rx.borrow().notice("i-1").expect("a Spot notice");
            (before, n.deadline.expect("a deadline"), after)
        };
        let two_min = jiff::SignedDuration::from_secs(120);
        // Polled 50 s before it reached us (a 60 s publish period): 70 s left, not 120.
        let polled =
            jiff::Timestamp::from_millisecond(jiff::Timestamp::now().as_millisecond() - 50_000)
                .unwrap();
        let (_, d, _) = deadline(Some(polled.as_millisecond()));
        assert_eq!(d, polled.checked_add(two_min).unwrap());
        // A polled-at time ahead of our clock is clamped: never later than receipt + 2 min.
        let ahead = jiff::Timestamp::now()
            .checked_add(jiff::SignedDuration::from_secs(600))
            .unwrap();
        let (before, d, after) = deadline(Some(ahead.as_millisecond()));
        assert!(
            before.checked_add(two_min).unwrap() <= d && d <= after.checked_add(two_min).unwrap(),
            "{d}"
        );
        // Unknown (an older pubsub): when it arrived.
        let (before, d, after) = deadline(None);
        assert!(
            before.checked_add(two_min).unwrap() <= d && d <= after.checked_add(two_min).unwrap()
        );
    }

    #[test]
    fn ordering_rule() {
        assert!(may_replace(None, None, None, Via::Cache));
        assert!(may_replace(
            Some(5),
            Some(Via::Message),
            Some(5),
            Via::Fallback
        ));
        assert!(!may_replace(
            Some(5),
            Some(Via::Message),
            Some(4),
            Via::Fallback
        ));
        assert!(may_replace(
            Some(5),
            Some(Via::Fallback),
            None,
            Via::Message
        ));
        assert!(!may_replace(Some(5), Some(Via::Fallback), None, Via::Cache));
    }
}
