//! A record of every request the emulator served, so tests can assert what a component
//! did and did not call, and benchmarks can count requests, watch events and bytes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

/// The Kubernetes verb of a request, as RBAC and audit logs name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verb {
    Get,
    List,
    Watch,
    Create,
    Update,
    Patch,
    Delete,
    DeleteCollection,
}

impl Verb {
    /// Whether the verb can change state.
    pub fn is_mutating(&self) -> bool {
        !matches!(self, Verb::Get | Verb::List | Verb::Watch)
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            Verb::Get => "get",
            Verb::List => "list",
            Verb::Watch => "watch",
            Verb::Create => "create",
            Verb::Update => "update",
            Verb::Patch => "patch",
            Verb::Delete => "delete",
            Verb::DeleteCollection => "deletecollection",
        }
    }

    /// The verb named `s` ([`Verb::as_str`] backwards).
    pub fn parse(s: &str) -> Option<Verb> {
        [
            Verb::Get,
            Verb::List,
            Verb::Watch,
            Verb::Create,
            Verb::Update,
            Verb::Patch,
            Verb::Delete,
            Verb::DeleteCollection,
        ]
        .into_iter()
        .find(|v| v.as_str() == s)
    }
}

/// One served request.
#[derive(Clone, Debug)]
pub struct JournalEntry {
    /// Order of arrival, from 0.
    pub seq: u64,
    /// The bearer token, which the emulator treats as the caller's identity.
    pub identity: Option<String>,
    pub verb: Verb,
    pub method: String,
    pub path: String,
    pub query: String,
    /// The status the response started with (a watch's later ERROR events are not reflected).
    pub status: u16,
    /// Resource plural (`pods`); `None` for discovery and other non-resource paths.
    pub resource: Option<String>,
    pub namespace: Option<String>,
    pub name: Option<String>,
    pub subresource: Option<String>,
    /// When the request took effect (a write: the moment before the store applied it, so no
    /// one can have seen its effect earlier): wall-clock time, so harnesses can set requests
    /// against deadlines and other emulators' journals.
    pub at: SystemTime,
    /// For an accepted (2xx) mutating request, the JSON the server answered with: the object
    /// as it stood after the write (a `Status` for evictions and some deletes). Lets a
    /// harness replay what each writer changed without reading the store.
    pub response: Option<Arc<serde_json::Value>>,
    /// For a mutating request the server read, the body it was sent: the JSON as parsed, or
    /// the text when it is not JSON; `None` for reads, empty bodies, bodies larger than
    /// [`JOURNALED_BODY_MAX`], and requests refused before the body was read (API Priority
    /// and Fairness, a `Throttle` fault, a restarting server). Lets a test check what a
    /// client asked for (a DELETE's preconditions, an eviction's grace period), not only
    /// what it got. Together with `query` (`gracePeriodSeconds` may travel there too).
    pub request: Option<Arc<serde_json::Value>>,
}

/// The largest request body the journal keeps (larger ones are journaled without it): the
/// writes tests check are a few hundred bytes, and the journal lives as long as the server.
pub const JOURNALED_BODY_MAX: usize = 64 * 1024;

/// `body` as the journal keeps it (see [`JournalEntry::request`]).
pub fn journaled_body(body: &[u8]) -> Option<Arc<serde_json::Value>> {
    if body.len() > JOURNALED_BODY_MAX || body.iter().all(u8::is_ascii_whitespace) {
        return None;
    }
    let v = serde_json::from_slice(body)
        .unwrap_or_else(|_| serde_json::Value::String(String::from_utf8_lossy(body).into_owned()));
    Some(Arc::new(v))
}

/// Per-identity traffic totals.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    pub requests: u64,
    /// Watch event lines sent (including BOOKMARK and ERROR events).
    pub watch_events: u64,
    /// Response body bytes, watch streams included.
    pub bytes: u64,
}

#[derive(Default)]
struct Inner {
    entries: Vec<JournalEntry>,
    next_seq: u64,
    traffic: HashMap<Option<String>, Traffic>,
}

/// The request journal. Cheap to clone.
#[derive(Clone, Default)]
pub struct Journal {
    inner: Arc<Mutex<Inner>>,
    /// Held by a write from just before the store applies it until it is journaled, and
    /// taken by every reader of entries: journal order is then the order writes were
    /// applied, and a write anyone has seen in the store is already in the journal.
    commit: Arc<Mutex<()>>,
}

/// A write in progress (see [`Journal::begin_write`]).
pub struct WriteInProgress<'a>(#[allow(dead_code)] MutexGuard<'a, ()>);

impl Journal {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The entries, once no write is between being applied and being journaled.
    fn settled(&self) -> MutexGuard<'_, Inner> {
        let _no_write_in_flight = self.commit.lock().unwrap_or_else(|p| p.into_inner());
        self.lock()
    }

    /// Call before applying a write to the store, and keep until it is [`record`]ed. Must
    /// not be held across an `.await`, nor while reading entries.
    ///
    /// [`record`]: Journal::record
    pub fn begin_write(&self) -> WriteInProgress<'_> {
        WriteInProgress(self.commit.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Appends an entry, assigning its `seq`, which it returns.
    pub fn record(&self, mut entry: JournalEntry) -> u64 {
        let mut g = self.lock();
        entry.seq = g.next_seq;
        let seq = entry.seq;
        g.next_seq += 1;
        g.traffic
            .entry(entry.identity.clone())
            .or_default()
            .requests += 1;
        g.entries.push(entry);
        seq
    }

    /// Adds response bytes (and watch events) to an identity's totals.
    pub fn add_traffic(&self, identity: &Option<String>, bytes: u64, watch_events: u64) {
        let mut g = self.lock();
        let t = g.traffic.entry(identity.clone()).or_default();
        t.bytes += bytes;
        t.watch_events += watch_events;
    }

    /// A copy of every entry so far.
    pub fn entries(&self) -> Vec<JournalEntry> {
        self.settled().entries.clone()
    }

    /// Forgets entries and traffic totals (sequence numbers keep increasing).
    pub fn clear(&self) {
        let mut g = self.lock();
        g.entries.clear();
        g.traffic.clear();
    }

    pub fn len(&self) -> usize {
        self.settled().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Entries satisfying `pred`.
    pub fn count(&self, pred: impl Fn(&JournalEntry) -> bool) -> usize {
        self.settled().entries.iter().filter(|e| pred(e)).count()
    }

    /// Entries satisfying `pred`, copied.
    pub fn filter(&self, pred: impl Fn(&JournalEntry) -> bool) -> Vec<JournalEntry> {
        self.settled()
            .entries
            .iter()
            .filter(|e| pred(e))
            .cloned()
            .collect()
    }

    /// Requests with a mutating verb.
    pub fn mutating_count(&self) -> usize {
        self.count(|e| e.verb.is_mutating())
    }

    /// Requests made by `identity`.
    pub fn requests_for(&self, identity: &str) -> u64 {
        self.traffic_for(identity).requests
    }

    /// Watch event lines sent to `identity`.
    pub fn watch_events_for(&self, identity: &str) -> u64 {
        self.traffic_for(identity).watch_events
    }

    /// Response bytes sent to `identity`.
    pub fn bytes_for(&self, identity: &str) -> u64 {
        self.traffic_for(identity).bytes
    }

    pub fn traffic_for(&self, identity: &str) -> Traffic {
        self.lock()
            .traffic
            .get(&Some(identity.to_string()))
            .copied()
            .unwrap_or_default()
    }

    /// Totals per identity (`None` = requests without a bearer token).
    pub fn traffic(&self) -> HashMap<Option<String>, Traffic> {
        self.lock().traffic.clone()
    }
}
