//! GCE metadata server emulator: the `computeMetadata/v1/instance/*` keys lastcall reads,
//! with hanging GETs (`wait_for_change`, `last_etag`, `timeout_sec`), ETags, the
//! `Metadata-Flavor: Google` header rule (403 without it), 503 blips, 404 for keys that are
//! not defined, and a switch that makes it unreachable (connection refused), as behind GKE
//! Workload Identity without `hostNetwork` or on Autopilot.
//!
//! The same keys are served under `/<reader>/computeMetadata/…`
//! ([`GceMetadataEmulator::url_for`]), so that a test giving each client its own endpoint
//! can tell their reads apart.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// What a key answers.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Answer {
    Value(String),
    /// 404: the key is not defined.
    Missing,
}

#[derive(Default)]
struct Inner {
    keys: BTreeMap<String, (Answer, u64)>,
    next_etag: u64,
    /// Answer the next N requests with 503.
    fail_next: usize,
    /// Answer the next N requests for one key with 503 (the other keys answer).
    fail_key: BTreeMap<String, usize>,
    /// Every request: (key, had the header, wait_for_change).
    journal: Vec<(String, bool, bool)>,
    /// Every answer with a value: (key, when it was read under the lock a change takes too,
    /// whether the value was not empty, the reader its URL named).
    answered: Vec<(String, std::time::SystemTime, bool, Option<String>)>,
}

#[derive(Clone)]
struct Shared {
    inner: Arc<Mutex<Inner>>,
    changed: Arc<Notify>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A running emulator. Keys start as on a healthy VM: `maintenance-event=NONE`,
/// `preempted=FALSE`, `upcoming-maintenance` not defined, and
/// `scheduling/on-host-maintenance=TERMINATE` (as on GKE's Spot and preemptible nodes; a
/// standard VM's default, `MIGRATE`, is set by the tests that need it).
pub struct GceMetadataEmulator {
    shared: Shared,
    addr: SocketAddr,
    serving: Mutex<Option<CancellationToken>>,
}

impl GceMetadataEmulator {
    pub async fn start() -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Shared {
            inner: Arc::default(),
            changed: Arc::default(),
        };
        let emu = Self {
            shared,
            addr,
            serving: Mutex::new(None),
        };
        emu.set("maintenance-event", "NONE");
        emu.set("preempted", "FALSE");
        emu.set("scheduling/on-host-maintenance", "TERMINATE");
        emu.serve(listener);
        Ok(emu)
    }

    fn serve(&self, listener: tokio::net::TcpListener) {
        let app = axum::Router::new()
            .route(
                "/computeMetadata/v1/instance/{*key}",
                axum::routing::get(get),
            )
            .route(
                "/{reader}/computeMetadata/v1/instance/{*key}",
                axum::routing::get(get),
            )
            .with_state(self.shared.clone());
        let (stop, _) = crate::net::serve(listener, app, "the GCE metadata emulator");
        *self.serving.lock().unwrap_or_else(|e| e.into_inner()) = Some(stop);
    }

    /// `http://127.0.0.1:PORT`: what `--gce-metadata-endpoint` takes.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The same server for one named reader (`http://127.0.0.1:PORT/<reader>`): its reads are
    /// recorded under its name ([`GceMetadataEmulator::reads_by`]).
    pub fn url_for(&self, reader: &str) -> String {
        format!("http://{}/{reader}", self.addr)
    }

    /// Sets `instance/<key>` to `value` with a new ETag, waking hanging GETs on it.
    pub fn set(&self, key: &str, value: &str) {
        self.put(key, Answer::Value(value.to_string()));
    }

    /// Makes `instance/<key>` answer 404 (not defined).
    pub fn remove(&self, key: &str) {
        self.put(key, Answer::Missing);
    }

    fn put(&self, key: &str, answer: Answer) {
        let mut g = self.shared.lock();
        g.next_etag += 1;
        let etag = g.next_etag;
        g.keys.insert(key.to_string(), (answer, etag));
        drop(g);
        self.shared.changed.notify_waiters();
    }

    /// The next `n` requests get 503, as during the sub-second blips the docs warn about.
    pub fn fail_next(&self, n: usize) {
        self.shared.lock().fail_next = n;
    }

    /// The next `n` requests for `instance/<key>` alone get 503: one read failing while the
    /// others answer.
    pub fn fail_key_next(&self, key: &str, n: usize) {
        self.shared.lock().fail_key.insert(key.to_string(), n);
    }

    /// Requests so far: `(key, sent Metadata-Flavor, was a hanging GET)`.
    pub fn requests(&self) -> Vec<(String, bool, bool)> {
        self.shared.lock().journal.clone()
    }

    /// When each GET of `key` was answered with a value that is not empty (an empty body is
    /// a glitch, which tells nothing): the moments a reader could have learned what it said.
    /// A read answered after a change saw it.
    pub fn reads(&self, key: &str) -> Vec<std::time::SystemTime> {
        self.shared
            .lock()
            .answered
            .iter()
            .filter(|(k, _, told, _)| k == key && *told)
            .map(|(_, at, _, _)| *at)
            .collect()
    }

    /// As [`GceMetadataEmulator::reads`], each with the reader its URL named (`None`: the
    /// plain URL).
    pub fn reads_by(&self, key: &str) -> Vec<(std::time::SystemTime, Option<String>)> {
        self.shared
            .lock()
            .answered
            .iter()
            .filter(|(k, _, told, _)| k == key && *told)
            .map(|(_, at, _, reader)| (*at, reader.clone()))
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
            // Hanging GETs in flight end with the server.
            self.shared.changed.notify_waiters();
            return Ok(());
        }
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.set_reuseaddr(true)?;
        socket.bind(self.addr)?;
        self.serve(socket.listen(128)?);
        Ok(())
    }
}

/// ETags are opaque: 16 hex digits, as the real server sends.
fn etag_text(n: u64) -> String {
    format!("{n:016x}")
}

async fn get(
    State(shared): State<Shared>,
    Path(path): Path<BTreeMap<String, String>>,
    Query(q): Query<BTreeMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    let key = path.get("key").cloned().unwrap_or_default();
    // Named in the URL by a client given its own endpoint (`url_for`).
    let reader = path.get("reader").cloned();
    let flavor = headers.get("metadata-flavor").and_then(|v| v.to_str().ok()) == Some("Google");
    let wait = q.get("wait_for_change").map(String::as_str) == Some("true");
    {
        let mut g = shared.lock();
        g.journal.push((key.clone(), flavor, wait));
        if !flavor {
            return (
                StatusCode::FORBIDDEN,
                "Missing Metadata-Flavor:Google header.",
            )
                .into_response();
        }
        if g.fail_next > 0 {
            g.fail_next -= 1;
            return (StatusCode::SERVICE_UNAVAILABLE, "Service Unavailable").into_response();
        }
        if let Some(n) = g.fail_key.get_mut(&key).filter(|n| **n > 0) {
            *n -= 1;
            return (StatusCode::SERVICE_UNAVAILABLE, "Service Unavailable").into_response();
        }
    }
    let timeout = q
        .get("timeout_sec")
        .and_then(|t| t.parse::<u64>().ok())
        .unwrap_or(3600);
    let last = q.get("last_etag").cloned();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout);
    loop {
        let changed = shared.changed.notified();
        let answered = {
            let mut g = shared.lock();
            let current = g.keys.get(&key).cloned();
            let ready = !wait
                || match (&current, &last) {
                    (Some((_, etag)), Some(l)) => etag_text(*etag) != *l,
                    // Without last_etag, wait for the next change (as the real server does).
                    _ => false,
                };
            if ready || tokio::time::Instant::now() >= deadline {
                if let Some((Answer::Value(v), _)) = &current {
                    let told = !v.is_empty();
                    g.answered.push((
                        key.clone(),
                        std::time::SystemTime::now(),
                        told,
                        reader.clone(),
                    ));
                }
                Some(current)
            } else {
                None
            }
        };
        if let Some(current) = answered {
            return answer(current);
        }
        tokio::select! {
            () = changed => {}
            // Read again: past the deadline, answered whatever it holds.
            () = tokio::time::sleep_until(deadline) => {}
        }
    }
}

fn answer(current: Option<(Answer, u64)>) -> Response {
    match current {
        Some((Answer::Value(v), etag)) => {
            let mut r = (StatusCode::OK, v).into_response();
            let h = r.headers_mut();
            h.insert("metadata-flavor", HeaderValue::from_static("Google"));
            if let Ok(e) = HeaderValue::from_str(&etag_text(etag)) {
                h.insert("etag", e);
            }
            r
        }
        _ => (StatusCode::NOT_FOUND, "Not Found").into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reads that told a value: a hanging GET woken by a change counts from the
    /// change, a refused, failed or empty answer does not count.
    #[tokio::test]
    async fn reads_are_the_answers_that_told_a_value() {
        let emu = GceMetadataEmulator::start().await.unwrap();
        let c = reqwest::Client::new();
        let url = format!(
            "{}/computeMetadata/v1/instance/maintenance-event",
            emu.url()
        );
        let get = |u: String, flavor: bool| {
            let mut r = c.get(u);
            if flavor {
                r = r.header("Metadata-Flavor", "Google");
            }
            r.send()
        };
        let r = get(url.clone(), true).await.unwrap();
        let etag = r.headers()["etag"].to_str().unwrap().to_string();
        assert_eq!(get(url.clone(), false).await.unwrap().status(), 403);
        emu.fail_next(1);
        assert_eq!(get(url.clone(), true).await.unwrap().status(), 503);
        assert_eq!(emu.reads("maintenance-event").len(), 1);
        // One key failing: only its reads.
        emu.fail_key_next("preempted", 1);
        let preempted = url.replace("maintenance-event", "preempted");
        assert_eq!(get(url.clone(), true).await.unwrap().status(), 200);
        assert_eq!(get(preempted.clone(), true).await.unwrap().status(), 503);
        assert_eq!(get(preempted, true).await.unwrap().status(), 200);
        assert_eq!(emu.reads("maintenance-event").len(), 2);
        let waiting = get(
            format!("{url}?wait_for_change=true&last_etag={etag}&timeout_sec=30"),
            true,
        );
        let set = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let before = std::time::SystemTime::now();
            emu.set("maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE");
            before
        };
        let (r, before) = tokio::join!(waiting, set);
        assert_eq!(r.unwrap().status(), 200);
        let reads = emu.reads("maintenance-event");
        assert_eq!(reads.len(), 3);
        assert!(reads[2] >= before, "woken by the change, read after it");
        // An empty body (a glitch) tells nothing.
        emu.set("maintenance-event", "");
        assert_eq!(get(url.clone(), true).await.unwrap().status(), 200);
        assert_eq!(emu.reads("maintenance-event").len(), 3);
        assert_eq!(emu.reads("preempted").len(), 1);
    }

    /// A reader's own URL serves the same keys and names it in the reads.
    #[tokio::test]
    async fn readers_are_told_apart() {
        let emu = GceMetadataEmulator::start().await.unwrap();
        let c = reqwest::Client::new();
        let get = |base: String| {
            c.get(format!(
                "{base}/computeMetadata/v1/instance/maintenance-event"
            ))
            .header("Metadata-Flavor", "Google")
            .send()
        };
        let r = get(emu.url_for("agent-2")).await.unwrap();
        assert_eq!(r.text().await.unwrap(), "NONE");
        get(emu.url()).await.unwrap();
        let readers: Vec<Option<String>> = emu
            .reads_by("maintenance-event")
            .into_iter()
            .map(|(_, r)| r)
            .collect();
        assert_eq!(readers, vec![Some("agent-2".to_string()), None]);
    }

    #[tokio::test]
    async fn hanging_get_answers_on_change_or_timeout_with_the_same_etag() {
        let emu = GceMetadataEmulator::start().await.unwrap();
        let c = reqwest::Client::new();
        let url = format!(
            "{}/computeMetadata/v1/instance/maintenance-event",
            emu.url()
        );
        let r = c.get(&url).send().await.unwrap();
        assert_eq!(r.status(), 403, "the header is required");
        let r = c
            .get(&url)
            .header("Metadata-Flavor", "Google")
            .send()
            .await
            .unwrap();
        let etag = r.headers()["etag"].to_str().unwrap().to_string();
        assert_eq!(r.text().await.unwrap(), "NONE");
        // Timeout: the same value and ETag.
        let r = c
            .get(format!(
                "{url}?wait_for_change=true&last_etag={etag}&timeout_sec=1"
            ))
            .header("Metadata-Flavor", "Google")
            .send()
            .await
            .unwrap();
        assert_eq!(r.headers()["etag"].to_str().unwrap(), etag);
        // A change wakes the hanging GET.
        let waiting = c
            .get(format!(
                "{url}?wait_for_change=true&last_etag={etag}&timeout_sec=30"
            ))
            .header("Metadata-Flavor", "Google")
            .send();
        let set = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            emu.set("maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE");
        };
        let (r, ()) = tokio::join!(waiting, set);
        let r = r.unwrap();
        assert_ne!(r.headers()["etag"].to_str().unwrap(), etag);
        assert_eq!(r.text().await.unwrap(), "TERMINATE_ON_HOST_MAINTENANCE");
        emu.fail_next(1);
        let r = c
            .get(&url)
            .header("Metadata-Flavor", "Google")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 503);
        let r = c
            .get(format!(
                "{}/computeMetadata/v1/instance/upcoming-maintenance",
                emu.url()
            ))
            .header("Metadata-Flavor", "Google")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 404);
        emu.set_unreachable(true).await.unwrap();
        assert!(
            c.get(&url)
                .header("Metadata-Flavor", "Google")
                .send()
                .await
                .is_err()
        );
        emu.set_unreachable(false).await.unwrap();
        let r = c
            .get(&url)
            .header("Metadata-Flavor", "Google")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
}
