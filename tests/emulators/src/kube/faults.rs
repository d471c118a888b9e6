//! Fault injection: fail, delay or hang the next N requests that match a rule, and deliver
//! the events of chosen watches late, to test how clients cope with API errors, slowness,
//! requests that never come back, and caches that lag behind the server.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

pub use axum::http::Method;
use tokio::sync::watch;

/// What a matching request gets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FaultAction {
    /// Answer with this HTTP status and a matching `Status` body, without serving it.
    Status(u16),
    /// Wait this long, then serve the request normally.
    Delay(Duration),
    /// Refuse it as API Priority and Fairness does: `429`, a plain-text body and this
    /// `Retry-After` (whole seconds), journaled as a 429.
    Throttle(Duration),
    /// Accept the request and answer nothing until [`Faults::release_hangs`] or
    /// [`Faults::clear`] (then it is served normally), or until the client gives up and
    /// closes the connection (then it is never served). A server that stops answering
    /// looks like this to a client: only its own timeout ends the call.
    Hang,
    /// Serve the request (it is applied and journaled as the server answered it), then
    /// answer `504 Timeout` instead, as an API server does when its storage write outlived
    /// the request's deadline yet went through: the write happened, the client cannot know.
    LoseAnswer,
}

/// Affects the next `times` requests whose method matches (any if `None`) and whose
/// path-and-query contains `path_contains`.
#[derive(Clone, Debug)]
pub struct FaultRule {
    pub method: Option<Method>,
    pub path_contains: String,
    pub times: usize,
    pub action: FaultAction,
}

impl FaultRule {
    /// A rule failing the next `times` requests matching `method`/`path_contains` with `status`.
    pub fn status(method: Option<Method>, path_contains: &str, times: usize, status: u16) -> Self {
        FaultRule {
            method,
            path_contains: path_contains.to_string(),
            times,
            action: FaultAction::Status(status),
        }
    }

    /// A rule delaying the next `times` matching requests by `delay`.
    pub fn delay(
        method: Option<Method>,
        path_contains: &str,
        times: usize,
        delay: Duration,
    ) -> Self {
        FaultRule {
            method,
            path_contains: path_contains.to_string(),
            times,
            action: FaultAction::Delay(delay),
        }
    }

    /// A rule hanging the next `times` matching requests (see [`FaultAction::Hang`]).
    /// A rule refusing the next `times` matching requests as APF does (see
    /// [`FaultAction::Throttle`]).
    pub fn throttle(
        method: Option<Method>,
        path_contains: &str,
        times: usize,
        retry_after: Duration,
    ) -> Self {
        FaultRule {
            method,
            path_contains: path_contains.to_string(),
            times,
            action: FaultAction::Throttle(retry_after),
        }
    }

    pub fn hang(method: Option<Method>, path_contains: &str, times: usize) -> Self {
        FaultRule {
            method,
            path_contains: path_contains.to_string(),
            times,
            action: FaultAction::Hang,
        }
    }

    /// A rule applying the next `times` matching requests and losing their answers (see
    /// [`FaultAction::LoseAnswer`]).
    pub fn lose_answer(method: Option<Method>, path_contains: &str, times: usize) -> Self {
        FaultRule {
            method,
            path_contains: path_contains.to_string(),
            times,
            action: FaultAction::LoseAnswer,
        }
    }
}

/// Late delivery for the watches it matches: every line such a watch sends (events,
/// bookmarks) reaches the client `delay` after the server produced it, in order. Matches
/// open watches as well as later ones, and stops delaying once removed.
///
/// Every given criterion must match; `None` matches anything.
#[derive(Clone, Debug)]
pub struct WatchDelay {
    /// Resource plural (`"pods"`, `"gameservers"`).
    pub resource: Option<String>,
    /// A substring of the watch's decoded `labelSelector` or `fieldSelector`
    /// (e.g. `"spec.nodeName=n1"`, `"agones.dev/role"`).
    pub selector_contains: Option<String>,
    /// The caller's identity (bearer token).
    pub identity: Option<String>,
    pub delay: Duration,
}

impl WatchDelay {
    /// Delays every watch of `resource` by `delay`.
    pub fn resource(resource: &str, delay: Duration) -> Self {
        WatchDelay {
            resource: Some(resource.to_string()),
            selector_contains: None,
            identity: None,
            delay,
        }
    }

    /// Only watches whose label or field selector contains `s`.
    pub fn selector(mut self, s: &str) -> Self {
        self.selector_contains = Some(s.to_string());
        self
    }

    /// Only watches made by `identity`.
    pub fn identity(mut self, identity: &str) -> Self {
        self.identity = Some(identity.to_string());
        self
    }
}

/// What a watch is, for matching [`WatchDelay`] rules.
#[derive(Clone, Debug, Default)]
pub struct WatchKey {
    pub resource: String,
    pub label_selector: String,
    pub field_selector: String,
    pub identity: Option<String>,
}

impl WatchDelay {
    fn matches(&self, w: &WatchKey) -> bool {
        self.resource.as_ref().is_none_or(|r| *r == w.resource)
            && self.selector_contains.as_ref().is_none_or(|s| {
                w.label_selector.contains(s.as_str()) || w.field_selector.contains(s.as_str())
            })
            && self
                .identity
                .as_ref()
                .is_none_or(|i| w.identity.as_deref() == Some(i.as_str()))
    }
}

/// A mutating admission webhook that reverts writes: every PATCH of a `resource` object
/// leaves it with the JSON pointer `pointer` set to `value` (`None` removes it), whatever
/// the patch said, and answers with that object. Stays until [`Faults::clear`].
#[derive(Clone, Debug)]
pub struct Revert {
    /// Resource plural (`"pods"`, `"nodes"`).
    pub resource: String,
    /// RFC 6901 pointer, e.g. `/metadata/annotations/a~1b`.
    pub pointer: String,
    pub value: Option<serde_json::Value>,
}

impl Revert {
    /// Sets `pointer` to `value` on every patched `resource` object.
    pub fn set(resource: &str, pointer: &str, value: serde_json::Value) -> Self {
        Revert {
            resource: resource.to_string(),
            pointer: pointer.to_string(),
            value: Some(value),
        }
    }

    /// Removes `pointer` from every patched `resource` object.
    pub fn remove(resource: &str, pointer: &str) -> Self {
        Revert {
            resource: resource.to_string(),
            pointer: pointer.to_string(),
            value: None,
        }
    }

    fn apply(&self, obj: &mut serde_json::Value) {
        let tokens: Vec<String> = self
            .pointer
            .split('/')
            .skip(1)
            .map(|t| t.replace("~1", "/").replace("~0", "~"))
            .collect();
        let Some((last, parents)) = tokens.split_last() else {
            return;
        };
        let mut at = obj;
        for t in parents {
            let Some(map) = at.as_object_mut() else {
                return;
            };
            at = map
                .entry(t.clone())
                .or_insert_with(|| serde_json::Value::Object(Default::default()));
        }
        if let Some(map) = at.as_object_mut() {
            match &self.value {
                Some(v) => map.insert(last.clone(), v.clone()),
                None => map.remove(last),
            };
        }
    }
}

#[derive(Default)]
struct Rules {
    requests: Vec<FaultRule>,
    watch_delays: Vec<WatchDelay>,
    /// Watches held until released (the rules' `delay` is not used).
    watch_holds: Vec<WatchDelay>,
    reverts: Vec<Revert>,
}

/// The active fault rules. Cheap to clone.
#[derive(Clone)]
pub struct Faults {
    rules: Arc<Mutex<Rules>>,
    /// Bumped to release every hung request.
    release: Arc<watch::Sender<u64>>,
    hung: Arc<AtomicUsize>,
    /// Number of watch delay rules, read without the lock on every watch line.
    watch_delays: Arc<AtomicUsize>,
    /// The journal `seq` of every write applied whose answer [`FaultAction::LoseAnswer`] lost.
    lost: Arc<Mutex<Vec<u64>>>,
    /// Bumped whenever watch holds change, to wake the lines waiting on one.
    holds_changed: Arc<watch::Sender<u64>>,
    /// Watch lines that have waited on a hold so far.
    held_lines: Arc<AtomicUsize>,
}

impl Default for Faults {
    fn default() -> Self {
        Faults {
            rules: Arc::default(),
            release: Arc::new(watch::channel(0).0),
            hung: Arc::default(),
            watch_delays: Arc::default(),
            lost: Arc::default(),
            holds_changed: Arc::new(watch::channel(0).0),
            held_lines: Arc::default(),
        }
    }
}

/// Counts a hung request while it is held, however the hold ends.
struct HungGuard(Arc<AtomicUsize>);

impl Drop for HungGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Faults {
    fn lock(&self) -> MutexGuard<'_, Rules> {
        self.rules.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a rule; rules are tried in the order added.
    pub fn inject(&self, rule: FaultRule) {
        if rule.times > 0 {
            self.lock().requests.push(rule);
        }
    }

    /// Adds a watch delivery delay (see [`WatchDelay`]); the first matching rule counts.
    pub fn delay_watches(&self, rule: WatchDelay) {
        let mut rules = self.lock();
        rules.watch_delays.push(rule);
        self.watch_delays
            .store(rules.watch_delays.len(), Ordering::SeqCst);
    }

    /// Removes every watch delivery delay; lines already held keep their delay.
    pub fn clear_watch_delays(&self) {
        self.lock().watch_delays.clear();
        self.watch_delays.store(0, Ordering::SeqCst);
    }

    /// Holds the watches `rule` matches (open ones too; its `delay` is not used): none of
    /// their lines reaches the client until [`Faults::release_watch_holds`], then all of
    /// them do, in order. A watch that lags for as long as a test says, not for a time.
    pub fn hold_watches(&self, rule: WatchDelay) {
        self.lock().watch_holds.push(rule);
        self.holds_changed.send_modify(|n| *n += 1);
    }

    /// Lets every held watch line go, in order; later lines are not held.
    pub fn release_watch_holds(&self) {
        self.lock().watch_holds.clear();
        self.holds_changed.send_modify(|n| *n += 1);
    }

    /// Watch lines that waited on a hold so far: a test's proof that a watch lagged.
    pub fn held_lines(&self) -> usize {
        self.held_lines.load(Ordering::SeqCst)
    }

    /// Waits while a hold matches the watch `w`; returns whether the line waited.
    pub async fn wait_while_held(&self, w: &WatchKey) -> bool {
        let mut changed = self.holds_changed.subscribe();
        let mut waited = false;
        loop {
            if !self.lock().watch_holds.iter().any(|r| r.matches(w)) {
                return waited;
            }
            if !waited {
                self.held_lines.fetch_add(1, Ordering::SeqCst);
                waited = true;
            }
            if changed.changed().await.is_err() {
                return waited;
            }
        }
    }

    /// Adds a reverting admission webhook (see [`Revert`]).
    pub fn revert(&self, rule: Revert) {
        self.lock().reverts.push(rule);
    }

    /// Applies the reverting webhooks for `resource` to a patched object.
    pub fn apply_reverts(&self, resource: &str, obj: &mut serde_json::Value) {
        for r in self
            .lock()
            .reverts
            .iter()
            .filter(|r| r.resource == resource)
        {
            r.apply(obj);
        }
    }

    /// Removes every rule, watch delay and reverting webhook, and releases hung requests.
    pub fn clear(&self) {
        {
            let mut rules = self.lock();
            rules.requests.clear();
            rules.reverts.clear();
            rules.watch_delays.clear();
            self.watch_delays.store(0, Ordering::SeqCst);
        }
        self.release_hangs();
    }

    /// Lets every request held by [`FaultAction::Hang`] go on to be served.
    pub fn release_hangs(&self) {
        self.release.send_modify(|g| *g += 1);
    }

    /// Requests held by [`FaultAction::Hang`] right now (released or abandoned ones
    /// no longer count).
    pub fn hung_now(&self) -> usize {
        self.hung.load(Ordering::SeqCst)
    }

    /// Request rules with uses left.
    pub fn pending(&self) -> usize {
        self.lock().requests.len()
    }

    /// Consumes one use of the first rule matching this request, if any.
    pub fn take(&self, method: &Method, path_and_query: &str) -> Option<FaultAction> {
        let mut rules = self.lock();
        let rules = &mut rules.requests;
        let i = rules.iter().position(|r| {
            r.method.as_ref().is_none_or(|m| m == method)
                && path_and_query.contains(&r.path_contains)
        })?;
        let action = rules[i].action.clone();
        rules[i].times -= 1;
        if rules[i].times == 0 {
            rules.remove(i);
        }
        Some(action)
    }

    /// Records that the write journaled as `seq` was applied and its answer lost.
    pub fn answer_lost(&self, seq: u64) {
        self.lost
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(seq);
    }

    /// The journal `seq` of every write applied whose answer was lost, in order: proof a
    /// [`FaultAction::LoseAnswer`] met a write, and which.
    pub fn answers_lost(&self) -> Vec<u64> {
        self.lost.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Holds the caller until [`Faults::release_hangs`]; dropping the future (the client
    /// went away) ends the hold too.
    pub async fn hang(&self) {
        let mut rx = self.release.subscribe();
        self.hung.fetch_add(1, Ordering::SeqCst);
        let _guard = HungGuard(self.hung.clone());
        // An error means the sender is gone, which cannot happen while `self` lives.
        let _ = rx.changed().await;
    }

    /// The delivery delay for a watch right now (zero when no rule matches).
    pub fn watch_delay(&self, w: &WatchKey) -> Duration {
        if self.watch_delays.load(Ordering::SeqCst) == 0 {
            return Duration::ZERO;
        }
        self.lock()
            .watch_delays
            .iter()
            .find(|r| r.matches(w))
            .map(|r| r.delay)
            .unwrap_or(Duration::ZERO)
    }
}
