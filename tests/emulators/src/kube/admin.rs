//! Endpoints that expose the journal of an emulator running as its own process
//! (`lastcall-kube-emulator --admin`), so a scale harness can keep the emulator's CPU, memory
//! and file descriptors out of the process whose agents it measures, and one that acts on
//! it: `POST /_emulator/restart?down_ms=N` restarts the API server as its clients see it
//! ([`super::Emulator::restart`]).
//!
//! `GET /_emulator/traffic`: per-identity totals, `{"<identity>": [requests, watch events,
//! bytes]}` (`""` for requests without a token). `GET /_emulator/journal?since=SEQ`: the
//! entries from `SEQ` on, with their query strings (a watch's `resourceVersion`) but
//! without their response bodies or paths; `&bodies=1` adds each write's request body. `GET /_emulator/apf`: what API
//! Priority and Fairness has done (`{"enabled", "peak_in_flight", "peak_queued",
//! "queued_total", "rejected"}`), since a queued request is not journaled until it is
//! served. A real API server serves neither
//! path; no client of the API ever asks for them.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::extract::{Query, State};
use axum::response::Json;
use serde::Deserialize;
use serde_json::{Value, json};

use super::journal::{JournalEntry, Traffic, Verb};
use super::server::ServerState;

pub const TRAFFIC_PATH: &str = "/_emulator/traffic";
pub const JOURNAL_PATH: &str = "/_emulator/journal";
pub const APF_PATH: &str = "/_emulator/apf";
pub const RESTART_PATH: &str = "/_emulator/restart";

/// The admin routes over `state`.
pub(super) fn routes(router: axum::Router<Arc<ServerState>>) -> axum::Router<Arc<ServerState>> {
    router
        .route(TRAFFIC_PATH, axum::routing::get(traffic))
        .route(JOURNAL_PATH, axum::routing::get(journal))
        .route(APF_PATH, axum::routing::get(apf))
        .route(RESTART_PATH, axum::routing::post(restart))
}

#[derive(Deserialize)]
struct Down {
    #[serde(default)]
    down_ms: u64,
}

/// Restarts the API server (watches end, history gone, 503 for `down_ms`); answers the
/// resourceVersion the new watch cache starts at.
async fn restart(State(s): State<Arc<ServerState>>, Query(q): Query<Down>) -> Json<Value> {
    let floor = s.restart(Duration::from_millis(q.down_ms));
    Json(json!({ "resourceVersion": floor.to_string() }))
}

async fn apf(State(s): State<Arc<ServerState>>) -> Json<Value> {
    let st = s.apf.stats();
    Json(json!({
        "enabled": s.apf.is_enabled(),
        "peak_in_flight": st.peak_in_flight,
        "peak_queued": st.peak_queued,
        "queued_total": st.queued_total,
        "rejected": st.rejected_total(),
    }))
}

/// What API Priority and Fairness did, as `GET /_emulator/apf` reports it.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
pub struct RemoteApf {
    pub enabled: bool,
    pub peak_in_flight: usize,
    pub peak_queued: usize,
    /// Requests that waited for a seat or a token (then served or refused).
    pub queued_total: u64,
    /// 429s sent.
    pub rejected: u64,
}

async fn traffic(State(s): State<Arc<ServerState>>) -> Json<Value> {
    let map: serde_json::Map<String, Value> = s
        .journal
        .traffic()
        .into_iter()
        .map(|(id, t)| {
            (
                id.unwrap_or_default(),
                json!([t.requests, t.watch_events, t.bytes]),
            )
        })
        .collect();
    Json(Value::Object(map))
}

#[derive(Deserialize)]
struct Since {
    #[serde(default)]
    since: u64,
    /// `1` (or `true`): each row also carries its request body ([`JournalEntry::request`]).
    #[serde(default)]
    bodies: Option<String>,
}

async fn journal(State(s): State<Arc<ServerState>>, Query(q): Query<Since>) -> Json<Value> {
    let bodies = matches!(q.bodies.as_deref(), Some("1" | "true"));
    let entries: Vec<Value> = s
        .journal
        .filter(|e| e.seq >= q.since)
        .iter()
        .map(|e| {
            let mut row = json!([
                e.seq,
                e.identity,
                e.verb.as_str(),
                e.resource,
                e.namespace,
                e.name,
                e.subresource,
                e.status,
                e.at.duration_since(SystemTime::UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_micros() as u64,
                e.query,
            ]);
            if bodies && let Value::Array(r) = &mut row {
                r.push(e.request.as_deref().cloned().unwrap_or(Value::Null));
            }
            row
        })
        .collect();
    Json(Value::Array(entries))
}

/// Reads the admin endpoints of an emulator at `base` (`http://127.0.0.1:PORT`).
#[derive(Clone)]
pub struct RemoteJournal {
    base: String,
    http: reqwest::Client,
}

impl RemoteJournal {
    pub fn new(base: &str) -> Self {
        Self {
            base: base.trim_end_matches('/').to_string(),
            http: reqwest::Client::new(),
        }
    }

    /// Per-identity totals so far.
    pub async fn traffic(&self) -> anyhow::Result<HashMap<Option<String>, Traffic>> {
        let v: HashMap<String, [u64; 3]> = self
            .http
            .get(format!("{}{TRAFFIC_PATH}", self.base))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        Ok(v.into_iter()
            .map(|(id, [requests, watch_events, bytes])| {
                (
                    (!id.is_empty()).then_some(id),
                    Traffic {
                        requests,
                        watch_events,
                        bytes,
                    },
                )
            })
            .collect())
    }

    /// What API Priority and Fairness has done since it was enabled.
    pub async fn apf(&self) -> anyhow::Result<RemoteApf> {
        Ok(self
            .http
            .get(format!("{}{APF_PATH}", self.base))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?)
    }

    /// Restarts the API server as its clients see it, refusing requests for `down`
    /// (`POST /_emulator/restart`). Returns the resourceVersion the new watch cache starts
    /// at: a watch from it or later resumes without listing.
    pub async fn restart(&self, down: Duration) -> anyhow::Result<u64> {
        let body: Value = self
            .http
            .post(format!(
                "{}{RESTART_PATH}?down_ms={}",
                self.base,
                down.as_millis()
            ))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        body["resourceVersion"]
            .as_str()
            .and_then(|rv| rv.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("restart answered no resourceVersion: {body}"))
    }

    /// Entries from sequence number `since` on (paths, request and response bodies left
    /// out).
    pub async fn entries_since(&self, since: u64) -> anyhow::Result<Vec<JournalEntry>> {
        self.rows(since, false).await
    }

    /// As [`RemoteJournal::entries_since`], with each write's request body
    /// ([`JournalEntry::request`]): what a check of what the clients asked for needs.
    pub async fn entries_with_bodies_since(&self, since: u64) -> anyhow::Result<Vec<JournalEntry>> {
        self.rows(since, true).await
    }

    async fn rows(&self, since: u64, bodies: bool) -> anyhow::Result<Vec<JournalEntry>> {
        type Row = (
            u64,
            Option<String>,
            String,
            Option<String>,
            Option<String>,
            Option<String>,
            Option<String>,
            u16,
            u64,
            String,
            Option<Value>,
        );
        let flag = if bodies { "&bodies=1" } else { "" };
        let rows: Vec<Value> = self
            .http
            .get(format!("{}{JOURNAL_PATH}?since={since}{flag}", self.base))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        rows.into_iter()
            .map(|mut row| {
                // Rows without bodies have ten fields: the eleventh reads as none.
                if let Value::Array(r) = &mut row
                    && r.len() == 10
                {
                    r.push(Value::Null);
                }
                serde_json::from_value::<Row>(row).map_err(anyhow::Error::from)
            })
            .map(|row| {
                let (
                    seq,
                    identity,
                    verb,
                    resource,
                    namespace,
                    name,
                    subresource,
                    status,
                    at,
                    query,
                    request,
                ) = row?;
                {
                    Ok(JournalEntry {
                        seq,
                        identity,
                        verb: Verb::parse(&verb)
                            .ok_or_else(|| anyhow::anyhow!("unknown verb {verb:?}"))?,
                        method: String::new(),
                        path: String::new(),
                        query,
                        status,
                        resource,
                        namespace,
                        name,
                        subresource,
                        at: SystemTime::UNIX_EPOCH + Duration::from_micros(at),
                        response: None,
                        request: request.map(Arc::new),
                    })
                }
            })
            .collect()
    }
}
