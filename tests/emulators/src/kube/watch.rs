//! Watch streams: newline-delimited `{"type": ..., "object": ...}` events, resumable from
//! a resourceVersion, with the selector transitions a real server makes (an object that
//! stops matching is DELETED for that watch, one that starts matching is ADDED).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::fanout::{Fanout, Subscription};
use super::faults::{Faults, WatchKey};
use super::journal::Journal;
use super::resources::ResourceType;
use super::selectors::Selectors;
use super::store::{EventKind, Store, StoreEvent};

/// Where a watch starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WatchStart {
    /// Synthetic ADDED events for every current object, then changes (no or `"0"` resourceVersion).
    Now,
    /// Changes after this resourceVersion, replayed from history, then live.
    After(u64),
}

/// A watch request, parsed from the query string.
#[derive(Clone, Debug)]
pub struct WatchRequest {
    pub rt: ResourceType,
    pub namespace: Option<String>,
    pub selectors: Selectors,
    pub start: WatchStart,
    pub timeout: Option<Duration>,
    pub bookmarks: bool,
    /// `sendInitialEvents=true`: synthetic ADDED events, then a BOOKMARK marking their end.
    pub send_initial_events: bool,
}

/// The event type one watch sends for a store event, if it sends it at all (the object
/// sent is always the event's object).
pub fn translate(req: &WatchRequest, ev: &StoreEvent) -> Option<&'static str> {
    if ev.rt != req.rt {
        return None;
    }
    if let Some(ns) = &req.namespace
        && ev.namespace.as_deref() != Some(ns.as_str())
    {
        return None;
    }
    if req.selectors.is_empty() {
        return Some(ev.kind.as_str());
    }
    let now = req.selectors.matches(&ev.object);
    match ev.kind {
        EventKind::Added => now.then_some("ADDED"),
        EventKind::Deleted => now.then_some("DELETED"),
        EventKind::Modified => {
            let before = ev.old.as_ref().is_some_and(|o| req.selectors.matches(o));
            match (before, now) {
                (true, true) => Some("MODIFIED"),
                (false, true) => Some("ADDED"),
                (true, false) => Some("DELETED"),
                (false, false) => None,
            }
        }
    }
}

fn line(kind: &str, object_json: &str) -> Bytes {
    Bytes::from(format!(
        "{{\"type\":\"{kind}\",\"object\":{object_json}}}\n"
    ))
}

fn bookmark(rt: &ResourceType, rv: u64, initial_end: bool) -> Bytes {
    let mut meta = json!({ "resourceVersion": rv.to_string() });
    if initial_end {
        meta["annotations"] = json!({ "k8s.io/initial-events-end": "true" });
    }
    let obj = json!({ "kind": rt.kind, "apiVersion": rt.api_version(), "metadata": meta });
    line("BOOKMARK", &obj.to_string())
}

/// Shared context of the watches one server runs.
#[derive(Clone)]
pub struct WatchContext {
    pub store: Store,
    pub journal: Journal,
    pub identity: Option<String>,
    /// Ends the stream (`Emulator::drop_watches`, shutdown).
    pub cancel: CancellationToken,
    pub bookmark_interval: Duration,
    /// Where [`super::faults::WatchDelay`] rules are looked up, for every line.
    pub faults: Faults,
    /// What this watch is, for matching those rules.
    pub key: WatchKey,
    /// Where the store's changes come from, already narrowed to what this watch can want.
    pub fanout: Fanout,
}

/// Lines on their way to the client, stamped with the moment the server produced them.
/// Bounded, so a client that does not read makes the watch fall behind the live feed
/// and be ended, as before; a delayed watch holds up to this many lines in flight.
type Outbox = mpsc::Sender<(Instant, Bytes)>;

/// Lines a watch may hold between the store and the client.
const OUTBOX_CAPACITY: usize = 4096;

/// What a watch has to send before live events.
enum Opening {
    /// Current objects as synthetic ADDED events, taken at this resourceVersion.
    Snapshot(Vec<Value>, u64),
    /// Past events to replay after the requested resourceVersion.
    Replay(Vec<Arc<StoreEvent>>, u64),
    /// The resourceVersion is too old: one ERROR event, then the end.
    Expired(Value),
}

/// Starts a watch and returns the response body. The starting point is fixed before
/// this returns, so changes made after the client has its response are never missed.
/// Too-old resourceVersions produce a stream with one ERROR event (410 Expired), as a
/// real server sends.
pub fn start(ctx: WatchContext, req: WatchRequest) -> Body {
    // Registered before the starting point is read: nothing after it can be missed, and
    // what came before it is skipped by resourceVersion.
    let sub = ctx.fanout.subscribe(&req.rt, &req.selectors);
    let (opening, rx) = if req.start == WatchStart::Now || req.send_initial_events {
        let sel = req.selectors.clone();
        let index = sel.index_key();
        let page = ctx.store.list_page(
            &req.rt,
            req.namespace.as_deref(),
            None,
            None,
            index.as_ref(),
            move |o| sel.matches(o),
        );
        (Opening::Snapshot(page.items, page.rv), Some(sub))
    } else {
        let from = match req.start {
            WatchStart::After(rv) => rv,
            WatchStart::Now => 0,
        };
        match ctx.store.events_since(from) {
            Ok(past) => (Opening::Replay(past, from), Some(sub)),
            Err(e) => (Opening::Expired(e.to_status()), None),
        }
    };
    let (tx, out) = mpsc::channel::<Bytes>(256);
    let (outbox, held) = mpsc::channel(OUTBOX_CAPACITY);
    tokio::spawn(forward(ctx.clone(), held, tx));
    tokio::spawn(run(ctx, req, opening, rx, outbox));
    let stream = futures::stream::unfold(out, |mut out| async move {
        out.recv().await.map(|b| (Ok::<Bytes, Infallible>(b), out))
    });
    Body::from_stream(stream)
}

/// Queues one line for the client (waiting while the queue is full); false when the
/// client has gone.
async fn send(tx: &Outbox, b: Bytes) -> bool {
    tx.send((Instant::now(), b)).await.is_ok()
}

/// Hands queued lines to the client in order, each no earlier than its production time
/// plus the watch's current delivery delay, and counts what it sends. Ends with the
/// producer (after draining), when the client goes, or at once when watches are dropped.
async fn forward(
    ctx: WatchContext,
    mut held: mpsc::Receiver<(Instant, Bytes)>,
    tx: mpsc::Sender<Bytes>,
) {
    loop {
        let next = tokio::select! {
            _ = ctx.cancel.cancelled() => return,
            _ = tx.closed() => return,
            next = held.recv() => next,
        };
        let Some((at, line)) = next else { return };
        tokio::select! {
            _ = ctx.cancel.cancelled() => return,
            _ = tx.closed() => return,
            _ = ctx.faults.wait_while_held(&ctx.key) => {}
        }
        let delay = ctx.faults.watch_delay(&ctx.key);
        if !delay.is_zero() {
            tokio::select! {
                _ = ctx.cancel.cancelled() => return,
                _ = tx.closed() => return,
                _ = tokio::time::sleep_until(at + delay) => {}
            }
        }
        let n = line.len() as u64;
        if tx.send(line).await.is_err() {
            return;
        }
        ctx.journal.add_traffic(&ctx.identity, n, 1);
    }
}

/// Sends the opening events; returns the last resourceVersion covered, or `None` when
/// the stream is over.
async fn send_opening(req: &WatchRequest, tx: &Outbox, opening: Opening) -> Option<u64> {
    match opening {
        Opening::Snapshot(objs, rv) => {
            for o in objs {
                if !send(tx, line("ADDED", &o.to_string())).await {
                    return None;
                }
            }
            if req.send_initial_events
                && req.bookmarks
                && !send(tx, bookmark(&req.rt, rv, true)).await
            {
                return None;
            }
            Some(rv)
        }
        Opening::Replay(past, from) => {
            let mut last = from;
            for ev in past {
                last = ev.rv;
                if let Some(kind) = translate(req, &ev)
                    && !send(tx, line(kind, &ev.object_json())).await
                {
                    return None;
                }
            }
            Some(last)
        }
        Opening::Expired(status) => {
            send(tx, line("ERROR", &status.to_string())).await;
            None
        }
    }
}

async fn run(
    ctx: WatchContext,
    req: WatchRequest,
    opening: Opening,
    rx: Option<Subscription>,
    tx: Outbox,
) {
    let deadline = req.timeout.map(|t| tokio::time::Instant::now() + t);
    let Some(mut last_rv) = send_opening(&req, &tx, opening).await else {
        return;
    };
    let Some(mut rx) = rx else {
        return;
    };
    let mut ticker = tokio::time::interval(ctx.bookmark_interval);
    ticker.tick().await;
    loop {
        let sleep_until = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = ctx.cancel.cancelled() => return,
            _ = tx.closed() => return,
            _ = sleep_until => {
                if req.bookmarks {
                    send(&tx, bookmark(&req.rt, last_rv, false)).await;
                }
                return;
            }
            _ = ticker.tick(), if req.bookmarks => {
                if !send(&tx, bookmark(&req.rt, last_rv, false)).await {
                    return;
                }
            }
            r = rx.rx.recv() => match r {
                Some(ev) => {
                    if ev.rv <= last_rv {
                        continue;
                    }
                    last_rv = ev.rv;
                    if let Some(kind) = translate(&req, &ev)
                        && !send(&tx, line(kind, &ev.object_json())).await
                    {
                        return;
                    }
                }
                // Fell behind the live feed (or the server is stopping): end the stream;
                // the client re-watches from the last resourceVersion it saw.
                None => return,
            }
        }
    }
}
