//! API Priority and Fairness, reduced to what a client can see: an opt-in limit on the
//! requests served at once and on the rate they are admitted, per-user flows that queue
//! fairly, and 429 answers shaped exactly as kube-apiserver's.
//!
//! Off by default, so every other test sees an unlimited server. When on:
//!
//! - a request needs a seat (at most `concurrency` served at once) and, with a rate, a
//!   token from a bucket refilled at `rate` per second up to `burst`;
//! - a request that cannot start waits in its flow's queue (the flow is the user: the
//!   bearer token the journal records as `identity`). A flow holds at most
//!   `queue_per_flow` waiting requests; seats go to the flows in turn (round robin), so a
//!   user that floods fills its own queue and is refused, while a light user's request
//!   waits behind at most one request of each other flow;
//! - a request refused (its flow's queue is full, or it waited `queue_wait`) gets what the
//!   real server's filter writes (`WithPriorityAndFairness` and `WithMaxInFlightLimit`
//!   share it): `429`, `Retry-After: <seconds>`, `Content-Type: text/plain; charset=utf-8`,
//!   `X-Content-Type-Options: nosniff` and the body `Too many requests, please try again
//!   later.` plus a newline. It is **not** a `Status`: client-go turns it into one
//!   (`reason: TooManyRequests`, `details.retryAfterSeconds` from the header) and kubectl
//!   prints "the server has received too many requests and has asked us to try again
//!   later"; kube-rs reports `Error::Api` with code 429 and the text as the message. APF
//!   also names the matched FlowSchema and priority level by UID in two headers; so does
//!   this.
//! - Long-running requests do not take seats: watches (the real APF charges a watch only
//!   while it initialises, which here is instantaneous) and the health endpoints (the
//!   real server's `probes` FlowSchema is exempt).
//!
//! What it does not model: priority levels and FlowSchemas (every request is in one level),
//! shuffle sharding (every user gets its own queue), work estimates (a LIST costs one seat
//! like a GET), the `system:masters` exemption, and APF's Retry-After that grows with the
//! drop rate (`retry_after_secs` is fixed).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use tokio::sync::oneshot;

/// The body kube-apiserver sends with an APF or max-in-flight 429 (`http.Error` adds the
/// newline).
pub const TOO_MANY_REQUESTS: &str = "Too many requests, please try again later.\n";

/// The response headers naming the matched FlowSchema and priority level (by UID).
pub const FLOW_SCHEMA_UID_HEADER: &str = "X-Kubernetes-PF-FlowSchema-UID";
pub const PRIORITY_LEVEL_UID_HEADER: &str = "X-Kubernetes-PF-PriorityLevel-UID";

/// The one FlowSchema and priority level every request is classified into.
const FLOW_SCHEMA_UID: &str = "7d1e0b6c-4f55-4c55-9a5e-6c7a1a3a0f01";
const PRIORITY_LEVEL_UID: &str = "7d1e0b6c-4f55-4c55-9a5e-6c7a1a3a0f02";

/// The limits. [`ApfConfig::default`] is generous; tests tighten what they need.
#[derive(Clone, Debug)]
pub struct ApfConfig {
    /// Requests served at once (seats), over all users.
    pub concurrency: usize,
    /// Requests admitted per second over all users; `None`: no rate limit.
    pub rate: Option<f64>,
    /// Tokens the rate bucket holds (requests admitted at once after a quiet spell).
    pub burst: usize,
    /// Requests one user may have waiting; one more is refused at once. 0: no queueing.
    pub queue_per_flow: usize,
    /// How long a queued request waits for a seat before it is refused.
    pub queue_wait: Duration,
    /// The `Retry-After` header of every refusal, in seconds (the real filters send 1 to 32).
    pub retry_after_secs: u64,
}

impl Default for ApfConfig {
    fn default() -> Self {
        ApfConfig {
            concurrency: 600,
            rate: None,
            burst: 1,
            queue_per_flow: 50,
            queue_wait: Duration::from_secs(15),
            retry_after_secs: 1,
        }
    }
}

/// A refusal, as [`Apf::rejections`] lists them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    /// The journal entry of the refused request.
    pub seq: u64,
    pub identity: Option<String>,
    pub at: SystemTime,
    pub retry_after: Duration,
}

/// What the limiter has done so far (since it was last enabled).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ApfStats {
    /// Requests holding a seat now.
    pub in_flight: usize,
    /// The most requests that ever held seats at once.
    pub peak_in_flight: usize,
    /// Requests waiting now.
    pub queued: usize,
    /// The most requests that ever waited at once.
    pub peak_queued: usize,
    /// Requests that had to wait (and were later served or refused).
    pub queued_total: u64,
    /// 429s sent, per user (`None`: requests without a bearer token).
    pub rejected: BTreeMap<Option<String>, u64>,
}

impl ApfStats {
    pub fn rejected_total(&self) -> u64 {
        self.rejected.values().sum()
    }

    pub fn rejected_for(&self, identity: &str) -> u64 {
        self.rejected
            .get(&Some(identity.to_string()))
            .copied()
            .unwrap_or(0)
    }
}

type Flow = Option<String>;

struct Waiter {
    id: u64,
    tx: oneshot::Sender<Seat>,
}

#[derive(Default)]
struct State {
    config: Option<ApfConfig>,
    /// Bumped on every enable/disable, so a seat of an earlier configuration frees nothing.
    epoch: u64,
    tokens: f64,
    refilled: Option<Instant>,
    queues: HashMap<Flow, VecDeque<Waiter>>,
    /// Flows with waiters, in the order they are served.
    turn: VecDeque<Flow>,
    next_id: u64,
    /// Whether the task handing out tokens to waiting requests runs (one per limiter:
    /// waiters never poll, so thousands queued cost nothing while they wait).
    ticking: bool,
    stats: ApfStats,
    rejections: Vec<Rejection>,
}

impl State {
    fn refill(&mut self, now: Instant) {
        let Some(cfg) = &self.config else { return };
        let Some(rate) = cfg.rate else { return };
        let burst = cfg.burst.max(1) as f64;
        if let Some(last) = self.refilled {
            let add = now.saturating_duration_since(last).as_secs_f64() * rate;
            self.tokens = (self.tokens + add).min(burst);
        }
        self.refilled = Some(now);
    }

    /// Whether one more request may start now (a seat, and a token when rate-limited).
    fn can_start(&self) -> bool {
        let Some(cfg) = &self.config else {
            return true;
        };
        self.stats.in_flight < cfg.concurrency.max(1) && (cfg.rate.is_none() || self.tokens >= 1.0)
    }

    fn start(&mut self) {
        if self.config.as_ref().is_some_and(|c| c.rate.is_some()) {
            self.tokens -= 1.0;
        }
        self.stats.in_flight += 1;
        self.stats.peak_in_flight = self.stats.peak_in_flight.max(self.stats.in_flight);
    }

    /// The time until the next token, when rate-limited.
    fn next_token_in(&self) -> Duration {
        match self.config.as_ref().and_then(|c| c.rate) {
            Some(rate) if rate > 0.0 => {
                let missing = (1.0 - self.tokens).max(0.0);
                Duration::from_secs_f64(missing / rate)
                    .clamp(Duration::from_millis(1), Duration::from_millis(50))
            }
            _ => Duration::from_millis(50),
        }
    }

    fn remove_waiter(&mut self, flow: &Flow, id: u64) -> bool {
        let Some(q) = self.queues.get_mut(flow) else {
            return false;
        };
        let Some(i) = q.iter().position(|w| w.id == id) else {
            return false;
        };
        q.remove(i);
        self.stats.queued -= 1;
        if q.is_empty() {
            self.queues.remove(flow);
            self.turn.retain(|f| f != flow);
        }
        true
    }
}

/// The limiter. Cheap to clone; off until [`Apf::enable`].
#[derive(Clone, Default)]
pub struct Apf {
    state: Arc<Mutex<State>>,
}

/// A request's seat: freed (and given to the next flow in turn) when dropped.
pub struct Seat {
    apf: Option<Apf>,
    epoch: u64,
}

impl Drop for Seat {
    fn drop(&mut self) {
        if let Some(apf) = self.apf.take() {
            let mut g = apf.lock();
            if g.epoch == self.epoch {
                g.stats.in_flight = g.stats.in_flight.saturating_sub(1);
            }
            apf.dispatch_locked(&mut g);
        }
    }
}

/// A request the limiter refused.
#[derive(Clone, Debug)]
pub struct Refused {
    pub retry_after: Duration,
}

/// Whether a request is long-running or exempt, so it takes no seat: watches and the
/// health endpoints.
pub fn exempt(is_watch: bool, path: &str) -> bool {
    is_watch
        || matches!(
            path.trim_end_matches('/'),
            "/healthz" | "/readyz" | "/livez"
        )
}

impl Apf {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Turns the limiter on (or changes its limits); counters start from zero.
    pub fn enable(&self, config: ApfConfig) {
        let mut g = self.lock();
        g.epoch += 1;
        g.tokens = config.burst.max(1) as f64;
        g.refilled = Some(Instant::now());
        g.config = Some(config);
        g.stats = ApfStats {
            queued: g.stats.queued,
            ..ApfStats::default()
        };
        g.rejections.clear();
    }

    /// Turns the limiter off: every waiting request is served at once.
    pub fn disable(&self) {
        let mut g = self.lock();
        g.config = None;
        g.epoch += 1;
        self.dispatch_locked(&mut g);
    }

    pub fn is_enabled(&self) -> bool {
        self.lock().config.is_some()
    }

    pub fn stats(&self) -> ApfStats {
        self.lock().stats.clone()
    }

    /// Every refusal since the limiter was enabled, in order.
    pub fn rejections(&self) -> Vec<Rejection> {
        self.lock().rejections.clone()
    }

    /// Seats go to waiting requests, one flow after the other, while any can start.
    fn dispatch_locked(&self, g: &mut State) {
        g.refill(Instant::now());
        while g.can_start() {
            let Some(flow) = g.turn.pop_front() else {
                return;
            };
            let Some(q) = g.queues.get_mut(&flow) else {
                continue;
            };
            let Some(w) = q.pop_front() else {
                g.queues.remove(&flow);
                continue;
            };
            if q.is_empty() {
                g.queues.remove(&flow);
            } else {
                g.turn.push_back(flow);
            }
            g.stats.queued -= 1;
            g.start();
            let seat = Seat {
                apf: Some(self.clone()),
                epoch: g.epoch,
            };
            if let Err(mut seat) = w.tx.send(seat) {
                // The request was abandoned while it waited: its seat is free again
                // (disarmed, as the lock is held here).
                seat.apf = None;
                g.stats.in_flight -= 1;
                if g.config.as_ref().is_some_and(|c| c.rate.is_some()) {
                    g.tokens += 1.0;
                }
            }
        }
    }

    /// Admits a request of `flow` (the caller's identity): a seat to hold while it is
    /// served, or a refusal to answer with [`too_many_requests`]. Exempt requests and a
    /// limiter that is off get a seat that counts nothing.
    pub async fn admit(&self, flow: &Flow, exempt: bool) -> Result<Seat, Refused> {
        let (id, mut rx, wait, retry_after) = {
            let mut g = self.lock();
            let Some(cfg) = g.config.clone().filter(|_| !exempt) else {
                return Ok(Seat {
                    apf: None,
                    epoch: 0,
                });
            };
            let retry_after = Duration::from_secs(cfg.retry_after_secs);
            self.dispatch_locked(&mut g);
            if g.turn.is_empty() && g.can_start() {
                g.start();
                return Ok(Seat {
                    apf: Some(self.clone()),
                    epoch: g.epoch,
                });
            }
            let waiting = g.queues.get(flow).map_or(0, VecDeque::len);
            if waiting >= cfg.queue_per_flow {
                return Err(Refused { retry_after });
            }
            let (tx, rx) = oneshot::channel();
            let id = g.next_id;
            g.next_id += 1;
            if waiting == 0 {
                g.turn.push_back(flow.clone());
            }
            g.queues
                .entry(flow.clone())
                .or_default()
                .push_back(Waiter { id, tx });
            g.stats.queued += 1;
            g.stats.queued_total += 1;
            g.stats.peak_queued = g.stats.peak_queued.max(g.stats.queued);
            // A freed seat dispatches by itself (`Seat::drop`); tokens come with time, so a
            // rate needs the ticker.
            if cfg.rate.is_some() && !g.ticking {
                g.ticking = true;
                self.spawn_ticker();
            }
            (id, rx, cfg.queue_wait, retry_after)
        };
        // Removes the entry if this future is dropped while it waits (the client left).
        let mut guard = QueuedGuard {
            apf: self,
            flow,
            id,
            armed: true,
        };
        tokio::select! {
            seat = &mut rx => {
                guard.armed = false;
                seat.map_err(|_| Refused { retry_after })
            }
            () = tokio::time::sleep(wait) => {
                if self.lock().remove_waiter(flow, id) {
                    guard.armed = false;
                    return Err(Refused { retry_after });
                }
                // Dispatched while the wait ended: the seat was sent under the lock.
                guard.armed = false;
                rx.await.map_err(|_| Refused { retry_after })
            }
        }
    }

    /// Hands out tokens to waiting requests as they come in, until no request waits.
    fn spawn_ticker(&self) {
        let apf = self.clone();
        tokio::spawn(async move {
            loop {
                let tick = apf.lock().next_token_in();
                tokio::time::sleep(tick).await;
                let mut g = apf.lock();
                apf.dispatch_locked(&mut g);
                if g.turn.is_empty() || g.config.is_none() {
                    g.ticking = false;
                    return;
                }
            }
        });
    }

    /// Records a refusal answered as journal entry `seq`.
    pub fn rejected(&self, identity: &Flow, seq: u64, refused: &Refused) {
        let mut g = self.lock();
        *g.stats.rejected.entry(identity.clone()).or_default() += 1;
        g.rejections.push(Rejection {
            seq,
            identity: identity.clone(),
            at: SystemTime::now(),
            retry_after: refused.retry_after,
        });
    }
}

struct QueuedGuard<'a> {
    apf: &'a Apf,
    flow: &'a Flow,
    id: u64,
    armed: bool,
}

impl Drop for QueuedGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            let mut g = self.apf.lock();
            g.remove_waiter(self.flow, self.id);
        }
    }
}

/// The 429 kube-apiserver answers when APF (or max-in-flight) refuses a request.
pub fn too_many_requests(refused: &Refused) -> Response {
    let mut r = Response::new(Body::from(TOO_MANY_REQUESTS));
    *r.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::RETRY_AFTER,
        HeaderValue::from(refused.retry_after.as_secs()),
    );
    h.insert(
        FLOW_SCHEMA_UID_HEADER,
        HeaderValue::from_static(FLOW_SCHEMA_UID),
    );
    h.insert(
        PRIORITY_LEVEL_UID_HEADER,
        HeaderValue::from_static(PRIORITY_LEVEL_UID),
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(u: &str) -> Flow {
        Some(u.to_string())
    }

    #[tokio::test]
    async fn off_admits_everything() {
        let apf = Apf::default();
        let seats: Vec<Seat> = futures_seats(&apf, &user("a"), 100).await;
        assert_eq!(seats.len(), 100);
        assert_eq!(apf.stats(), ApfStats::default());
    }

    async fn futures_seats(apf: &Apf, flow: &Flow, n: usize) -> Vec<Seat> {
        let mut out = vec![];
        for _ in 0..n {
            out.push(apf.admit(flow, false).await.expect("admitted"));
        }
        out
    }

    #[tokio::test]
    async fn a_full_flow_queue_is_refused_and_seats_go_round_robin() {
        let apf = Apf::default();
        apf.enable(ApfConfig {
            concurrency: 1,
            queue_per_flow: 2,
            queue_wait: Duration::from_secs(30),
            ..ApfConfig::default()
        });
        let held = apf.admit(&user("flood"), false).await.expect("first seat");
        let order = Arc::new(Mutex::new(Vec::new()));
        let wait = |who: &'static str, flow: &'static str| {
            let apf = apf.clone();
            let order = order.clone();
            tokio::spawn(async move {
                let seat = apf.admit(&user(flow), false).await.expect("served");
                order.lock().unwrap().push(who);
                drop(seat);
            })
        };
        // Two of the flooder's wait; the third is refused at once.
        let f1 = wait("flood-1", "flood");
        crate::eventually::wait_for("one queued", || async {
            (apf.stats().queued == 1).then_some(())
        })
        .await;
        let f2 = wait("flood-2", "flood");
        crate::eventually::wait_for("two queued", || async {
            (apf.stats().queued == 2).then_some(())
        })
        .await;
        assert!(apf.admit(&user("flood"), false).await.is_err());
        assert_eq!(apf.stats().rejected_total(), 0, "counted by the server");
        // A light user's request waits too, but is served right after the flooder's first.
        let light = wait("light", "light");
        crate::eventually::wait_for("three queued", || async {
            (apf.stats().queued == 3).then_some(())
        })
        .await;
        drop(held);
        for t in [f1, f2, light] {
            t.await.expect("task");
        }
        assert_eq!(*order.lock().unwrap(), ["flood-1", "light", "flood-2"]);
        let s = apf.stats();
        assert_eq!(s.peak_in_flight, 1);
        assert_eq!(s.peak_queued, 3);
        assert_eq!(s.queued_total, 3);
        assert_eq!(s.in_flight, 0);
    }

    #[tokio::test]
    async fn a_request_that_waits_too_long_is_refused() {
        let apf = Apf::default();
        apf.enable(ApfConfig {
            concurrency: 1,
            queue_per_flow: 1,
            queue_wait: Duration::from_millis(50),
            retry_after_secs: 3,
            ..ApfConfig::default()
        });
        let _held = apf.admit(&user("a"), false).await.expect("seat");
        let r = apf.admit(&user("b"), false).await.err().expect("refused");
        assert_eq!(r.retry_after, Duration::from_secs(3));
        assert_eq!(apf.stats().queued, 0);
        // Exempt requests never wait.
        assert!(apf.admit(&user("b"), true).await.is_ok());
    }

    #[tokio::test]
    async fn the_rate_limit_spaces_admissions() {
        let apf = Apf::default();
        apf.enable(ApfConfig {
            rate: Some(50.0),
            burst: 2,
            queue_per_flow: 10,
            queue_wait: Duration::from_secs(30),
            ..ApfConfig::default()
        });
        let start = Instant::now();
        for _ in 0..7 {
            drop(apf.admit(&user("a"), false).await.expect("admitted"));
        }
        // Two from the burst, five more at 50/s: at least 100 ms.
        assert!(
            start.elapsed() >= Duration::from_millis(95),
            "{:?}",
            start.elapsed()
        );
    }

    #[test]
    fn the_refusal_is_what_kube_apiserver_writes() {
        let r = too_many_requests(&Refused {
            retry_after: Duration::from_secs(1),
        });
        assert_eq!(r.status(), 429);
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        assert_eq!(
            r.headers()[header::CONTENT_TYPE],
            "text/plain; charset=utf-8"
        );
        assert_eq!(r.headers()[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
        assert!(r.headers().contains_key(FLOW_SCHEMA_UID_HEADER));
    }
}
