//! Azure instance metadata emulator: Scheduled Events and the VM's own name.
//!
//! - `GET /metadata/scheduledevents?api-version=…` answers the documented document
//!   `{"DocumentIncarnation": N, "Events": [{EventId, EventType, ResourceType, Resources,
//!   EventStatus, NotBefore, Description, EventSource, DurationInSeconds}]}`;
//!   `DocumentIncarnation` grows with every change of the list.
//! - `POST /metadata/scheduledevents?api-version=…` with `{"StartRequests": [{"EventId":
//!   …}]}` approves events: each is recorded, and (as the platform may) started at once:
//!   `EventStatus: Started`, `NotBefore: ""`. An id not in the list, or a body of another
//!   shape, answers 400 (this emulator's choice; the service's answer is not documented).
//! - `GET /metadata/instance/compute/name?api-version=…&format=text` answers the VM name.
//! - Every request needs the header `Metadata: true` and an `api-version`: without them
//!   the answer is 400 with a JSON error body, as the service does.
//!
//! Tests script the events, inject error statuses or a garbled body, and switch the
//! endpoint unreachable (connection refused). Every request is journaled.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// An event as the service lists it. `not_before` is RFC 1123
/// (`Mon, 19 Sep 2016 18:29:47 GMT`), empty once started.
pub fn event(id: &str, event_type: &str, vm: &str, not_before: &str) -> Value {
    json!({
        "EventId": id,
        "EventType": event_type,
        "ResourceType": "VirtualMachine",
        "Resources": [vm],
        "EventStatus": "Scheduled",
        "NotBefore": not_before,
        "Description": format!("{event_type} scheduled by the platform"),
        "EventSource": "Platform",
        "DurationInSeconds": if event_type == "Freeze" { 9 } else { -1 },
    })
}

/// One request: method, path, whether `Metadata: true` was sent, the status answered, and
/// when it was answered (so a test can tell whether a document was read while it held an
/// event).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub metadata_header: bool,
    pub status: u16,
    pub at: std::time::SystemTime,
    /// Answered with the garbled body instead of the document.
    pub garbled: bool,
}

#[derive(Default)]
struct Inner {
    vm_name: String,
    incarnation: u64,
    events: Vec<Value>,
    /// Answered instead of the document (status 200) while set.
    garbled: Option<String>,
    fail_next: usize,
    fail_status: u16,
    approvals: Vec<String>,
    /// Each approval with when it was received, in order.
    approvals_at: Vec<(String, std::time::SystemTime)>,
    journal: Vec<Request>,
}

type Shared = Arc<Mutex<Inner>>;

fn lock(s: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

/// A running emulator; starts with no events (`DocumentIncarnation` 1).
pub struct AzureMetadataEmulator {
    shared: Shared,
    addr: SocketAddr,
    serving: Mutex<Option<CancellationToken>>,
}

impl Drop for AzureMetadataEmulator {
    fn drop(&mut self) {
        if let Some(stop) = self
            .serving
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            stop.cancel();
        }
    }
}

impl AzureMetadataEmulator {
    /// Starts the emulator for the VM named `vm_name` on a free `127.0.0.1` port.
    pub async fn start(vm_name: &str) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared: Shared = Arc::new(Mutex::new(Inner {
            vm_name: vm_name.to_string(),
            incarnation: 1,
            fail_status: 500,
            ..Default::default()
        }));
        let emu = Self {
            shared,
            addr,
            serving: Mutex::new(None),
        };
        emu.serve(listener);
        Ok(emu)
    }

    fn serve(&self, listener: tokio::net::TcpListener) {
        let app = axum::Router::new()
            .fallback(handle)
            .with_state(self.shared.clone());
        let (stop, _) = crate::net::serve(listener, app, "the Azure metadata emulator");
        *self.serving.lock().unwrap_or_else(|e| e.into_inner()) = Some(stop);
    }

    /// `http://127.0.0.1:PORT`: the stand-in for `http://169.254.169.254`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Replaces the event list (a new `DocumentIncarnation`).
    pub fn set_events(&self, events: Vec<Value>) {
        let mut g = lock(&self.shared);
        g.events = events;
        g.incarnation += 1;
    }

    /// The current event list.
    pub fn events(&self) -> Vec<Value> {
        lock(&self.shared).events.clone()
    }

    /// The current `DocumentIncarnation`.
    pub fn incarnation(&self) -> u64 {
        lock(&self.shared).incarnation
    }

    /// Answers `body` (200) instead of the document while set.
    pub fn set_garbled(&self, body: Option<&str>) {
        lock(&self.shared).garbled = body.map(str::to_string);
    }

    /// The next `n` requests answer `status` with an empty body.
    pub fn fail_next(&self, n: usize, status: u16) {
        let mut g = lock(&self.shared);
        g.fail_next = n;
        g.fail_status = status;
    }

    /// Every EventId approved so far, in order.
    pub fn approvals(&self) -> Vec<String> {
        lock(&self.shared).approvals.clone()
    }

    /// Every EventId approved so far with when it was approved, in order (a test orders
    /// approvals against other journals).
    pub fn approvals_at(&self) -> Vec<(String, std::time::SystemTime)> {
        lock(&self.shared).approvals_at.clone()
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Request> {
        lock(&self.shared).journal.clone()
    }

    /// When each GET of the events document was answered with it (200, not garbled), taken
    /// under the lock a change takes too: a read answered after a change saw it.
    pub fn event_reads(&self) -> Vec<std::time::SystemTime> {
        lock(&self.shared)
            .journal
            .iter()
            .filter(|r| {
                r.method == "GET"
                    && r.path == "/metadata/scheduledevents"
                    && r.status == 200
                    && !r.garbled
            })
            .map(|r| r.at)
            .collect()
    }

    /// Refuses connections (`true`) or serves again on the same port (`false`).
    pub async fn set_unreachable(&self, unreachable: bool) -> anyhow::Result<()> {
        if unreachable {
            if let Some(stop) = self
                .serving
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
            {
                stop.cancel();
            }
            return Ok(());
        }
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.set_reuseaddr(true)?;
        socket.bind(self.addr)?;
        self.serve(socket.listen(128)?);
        Ok(())
    }
}

fn error(status: StatusCode, message: &str) -> (StatusCode, String) {
    (status, json!({ "error": message }).to_string())
}

async fn handle(
    State(shared): State<Shared>,
    method: Method,
    uri: Uri,
    Query(q): Query<BTreeMap<String, String>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let metadata_header = headers
        .get("metadata")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("true"));
    let mut g = lock(&shared);
    let (status, text) = answer(&mut g, &method, uri.path(), &q, metadata_header, &body);
    let garbled = g.garbled.as_ref() == Some(&text) && status == StatusCode::OK;
    g.journal.push(Request {
        method: method.to_string(),
        path: uri.path().to_string(),
        metadata_header,
        status: status.as_u16(),
        at: std::time::SystemTime::now(),
        garbled,
    });
    let content_type = if uri.path().ends_with("/name") && status == StatusCode::OK {
        "text/plain; charset=utf-8"
    } else {
        "application/json; charset=utf-8"
    };
    (status, [("content-type", content_type)], text).into_response()
}

fn answer(
    g: &mut Inner,
    method: &Method,
    path: &str,
    q: &BTreeMap<String, String>,
    metadata_header: bool,
    body: &[u8],
) -> (StatusCode, String) {
    if !metadata_header {
        return error(
            StatusCode::BAD_REQUEST,
            "Bad request. Required metadata header not specified",
        );
    }
    if q.get("api-version").is_none_or(|v| v.trim().is_empty()) {
        return error(
            StatusCode::BAD_REQUEST,
            "Bad request. api-version was not specified in the request",
        );
    }
    if g.fail_next > 0 {
        g.fail_next -= 1;
        let status =
            StatusCode::from_u16(g.fail_status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return (status, String::new());
    }
    match (method.as_str(), path) {
        ("GET", "/metadata/instance/compute/name") => (StatusCode::OK, g.vm_name.clone()),
        ("GET", "/metadata/scheduledevents") => match &g.garbled {
            Some(b) => (StatusCode::OK, b.clone()),
            None => (
                StatusCode::OK,
                json!({"DocumentIncarnation": g.incarnation, "Events": g.events}).to_string(),
            ),
        },
        ("POST", "/metadata/scheduledevents") => approve(g, body),
        _ => error(StatusCode::NOT_FOUND, "Not found"),
    }
}

fn approve(g: &mut Inner, body: &[u8]) -> (StatusCode, String) {
    let ids: Option<Vec<String>> = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v.get("StartRequests")?.as_array().cloned())
        .and_then(|reqs| {
            reqs.iter()
                .map(|r| r.get("EventId")?.as_str().map(str::to_string))
                .collect()
        });
    let Some(ids) = ids.filter(|ids| !ids.is_empty()) else {
        return error(
            StatusCode::BAD_REQUEST,
            "Bad request. Invalid StartRequests",
        );
    };
    let known = |id: &String| {
        g.events
            .iter()
            .any(|e| e.get("EventId").and_then(Value::as_str) == Some(id))
    };
    if !ids.iter().all(known) {
        return error(StatusCode::BAD_REQUEST, "Bad request. Unknown EventId");
    }
    for e in &mut g.events {
        if e.get("EventId")
            .and_then(Value::as_str)
            .is_some_and(|id| ids.iter().any(|a| a == id))
        {
            e["EventStatus"] = json!("Started");
            e["NotBefore"] = json!("");
        }
    }
    g.incarnation += 1;
    let now = std::time::SystemTime::now();
    g.approvals_at
        .extend(ids.iter().map(|id| (id.clone(), now)));
    g.approvals.extend(ids);
    (StatusCode::OK, String::new())
}
