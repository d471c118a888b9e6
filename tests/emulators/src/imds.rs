//! An emulated EC2 instance metadata service (IMDSv2 only, `HttpTokens: required`).
//!
//! Session flow: `PUT /latest/api/token` with `X-aws-ec2-metadata-token-ttl-seconds`
//! (1..=21600) returns a token; every GET must carry it in `X-aws-ec2-metadata-token`.
//! Token expiry uses tokio's clock, so tests under a paused clock can expire tokens by
//! advancing time. See `docs/testing/cloud.md` for what is and is not emulated.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Header carrying the requested TTL on `PUT /latest/api/token` (and the remaining TTL on answers).
pub const TTL_HEADER: &str = "x-aws-ec2-metadata-token-ttl-seconds";
/// Header carrying the session token on metadata requests.
pub const TOKEN_HEADER: &str = "x-aws-ec2-metadata-token";
/// Longest token TTL IMDS grants (6 hours).
pub const MAX_TTL_SECS: u64 = 21_600;

const REGION: &str = "us-west-2";
const AVAILABILITY_ZONE: &str = "us-west-2a";
const INSTANCE_TYPE: &str = "c5.xlarge";

struct ImdsState {
    instance_id: String,
    local_hostname: String,
    tokens: HashMap<String, Instant>,
    next_token: u64,
    spot_action: Option<serde_json::Value>,
    scheduled_events: serde_json::Value,
    rebalance: Option<serde_json::Value>,
    target_lifecycle_state: Option<String>,
    fail_next: usize,
    fail_status: u16,
    requests: Vec<(String, String, u16)>,
    /// When each of `requests` was answered (under the lock a change takes too, so a read
    /// answered after a change saw it).
    answered_at: Vec<std::time::SystemTime>,
}

type Shared = Arc<Mutex<ImdsState>>;

fn lock(shared: &Mutex<ImdsState>) -> MutexGuard<'_, ImdsState> {
    shared.lock().unwrap_or_else(|p| p.into_inner())
}

/// An IMDS endpoint on `127.0.0.1`, alive until dropped.
pub struct ImdsEmulator {
    addr: SocketAddr,
    shared: Shared,
    stop: CancellationToken,
}

impl Drop for ImdsEmulator {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl ImdsEmulator {
    /// Starts an IMDS for one instance on a free `127.0.0.1` port. Fails for an instance id
    /// EC2 never reports (anything but `^i-[0-9a-zA-Z]{17}$`).
    pub async fn start(instance_id: &str, local_hostname: &str) -> anyhow::Result<ImdsEmulator> {
        // EC2 only ever reports ids of this form; a test world with another is unrealistic.
        anyhow::ensure!(
            crate::gamelift::validate::instance_id_ok(instance_id),
            "{instance_id:?} is not an EC2 instance id ({}); use lastcall_emulators::gamelift::instance_id",
            crate::gamelift::validate::INSTANCE_ID_PATTERN
        );
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let shared: Shared = Arc::new(Mutex::new(ImdsState {
            instance_id: instance_id.to_string(),
            local_hostname: local_hostname.to_string(),
            tokens: HashMap::new(),
            next_token: 0,
            spot_action: None,
            scheduled_events: serde_json::Value::Array(Vec::new()),
            rebalance: None,
            target_lifecycle_state: None,
            fail_next: 0,
            fail_status: 500,
            requests: Vec::new(),
            answered_at: Vec::new(),
        }));
        let app = Router::new().fallback(handle).with_state(shared.clone());
        let (stop, _) = crate::net::serve(listener, app, "the IMDS emulator");
        Ok(ImdsEmulator { addr, shared, stop })
    }

    /// Base URL (`http://127.0.0.1:P`), the stand-in for `http://169.254.169.254`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn state(&self) -> MutexGuard<'_, ImdsState> {
        lock(&self.shared)
    }

    /// Every token issued so far stops working (401); new tokens can be requested.
    pub fn expire_tokens(&self) {
        self.state().tokens.clear();
    }

    /// Body of `spot/instance-action`; `None` answers 404 (no interruption).
    pub fn set_spot_action(&self, v: Option<serde_json::Value>) {
        self.state().spot_action = v;
    }

    /// Body of `events/maintenance/scheduled` (a JSON array; `[]` when none).
    pub fn set_scheduled_events(&self, v: serde_json::Value) {
        self.state().scheduled_events = v;
    }

    /// Body of `events/recommendations/rebalance`; `None` answers 404.
    pub fn set_rebalance(&self, v: Option<serde_json::Value>) {
        self.state().rebalance = v;
    }

    /// Plain-text `autoscaling/target-lifecycle-state` (e.g. `InService`, `Terminated`);
    /// `None` answers 404, as for an instance outside an Auto Scaling group.
    pub fn set_target_lifecycle_state(&self, v: Option<&str>) {
        self.state().target_lifecycle_state = v.map(str::to_string);
    }

    /// The next `n` requests (token or metadata) answer `status` with an empty body.
    pub fn fail_next(&self, n: usize, status: u16) {
        let mut s = self.state();
        s.fail_next = n;
        s.fail_status = status;
    }

    /// Every request so far: method, path, status answered.
    pub fn requests(&self) -> Vec<(String, String, u16)> {
        self.state().requests.clone()
    }

    /// When each GET of `path` was answered with its value (200) or its absence (404): the
    /// moments a reader could have learned what the path said.
    pub fn reads(&self, path: &str) -> Vec<std::time::SystemTime> {
        let s = self.state();
        s.requests
            .iter()
            .zip(&s.answered_at)
            .filter(|((m, p, st), _)| m == "GET" && p == path && matches!(st, 200 | 404))
            .map(|(_, t)| *t)
            .collect()
    }

    /// Number of tokens currently valid.
    pub fn live_tokens(&self) -> usize {
        let now = Instant::now();
        self.state()
            .tokens
            .values()
            .filter(|exp| **exp > now)
            .count()
    }
}

async fn handle(
    axum::extract::State(shared): axum::extract::State<Shared>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let mut state = lock(&shared);
    let path = uri.path().to_string();
    let (status, body, ttl) = answer(&mut state, &method, &path, &headers);
    state
        .requests
        .push((method.to_string(), path, status.as_u16()));
    state.answered_at.push(std::time::SystemTime::now());
    let mut response = (status, body).into_response();
    let h = response.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    if let Some(ttl) = ttl {
        h.insert(TTL_HEADER, HeaderValue::from(ttl));
    }
    response
}

/// Status, body and (for token-authenticated answers) the token's remaining TTL.
fn answer(
    state: &mut ImdsState,
    method: &Method,
    path: &str,
    headers: &HeaderMap,
) -> (StatusCode, String, Option<u64>) {
    if state.fail_next > 0 {
        state.fail_next -= 1;
        let status =
            StatusCode::from_u16(state.fail_status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return (status, String::new(), None);
    }
    let now = Instant::now();
    if path == "/latest/api/token" {
        if method != Method::PUT {
            return (StatusCode::METHOD_NOT_ALLOWED, String::new(), None);
        }
        // IMDS refuses token requests that went through a proxy.
        if headers.contains_key("x-forwarded-for") {
            return (StatusCode::FORBIDDEN, String::new(), None);
        }
        let ttl = headers
            .get(TTL_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .filter(|t| (1..=MAX_TTL_SECS).contains(t));
        let Some(ttl) = ttl else {
            return (StatusCode::BAD_REQUEST, String::new(), None);
        };
        state.next_token += 1;
        let token = format!(
            "lastcall-imds-{}-{:016x}",
            state.next_token,
            rand::random::<u64>()
        );
        state
            .tokens
            .insert(token.clone(), now + Duration::from_secs(ttl));
        return (StatusCode::OK, token, Some(ttl));
    }
    if method != Method::GET {
        return (StatusCode::METHOD_NOT_ALLOWED, String::new(), None);
    }
    let expiry = headers
        .get(TOKEN_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|t| state.tokens.get(t).copied())
        .filter(|exp| *exp > now);
    let Some(expiry) = expiry else {
        return (StatusCode::UNAUTHORIZED, String::new(), None);
    };
    let remaining = Some(expiry.saturating_duration_since(now).as_secs());
    let found = |body: String| (StatusCode::OK, body, remaining);
    let not_found = (StatusCode::NOT_FOUND, String::new(), remaining);
    match path {
        "/latest/meta-data/instance-id" => found(state.instance_id.clone()),
        "/latest/meta-data/local-hostname" => found(state.local_hostname.clone()),
        "/latest/meta-data/placement/region" => found(REGION.to_string()),
        "/latest/meta-data/placement/availability-zone" => found(AVAILABILITY_ZONE.to_string()),
        "/latest/meta-data/instance-type" => found(INSTANCE_TYPE.to_string()),
        "/latest/meta-data/spot/instance-action" => match &state.spot_action {
            Some(v) => found(v.to_string()),
            None => not_found,
        },
        "/latest/meta-data/events/maintenance/scheduled" => {
            found(state.scheduled_events.to_string())
        }
        "/latest/meta-data/events/recommendations/rebalance" => match &state.rebalance {
            Some(v) => found(v.to_string()),
            None => not_found,
        },
        "/latest/meta-data/autoscaling/target-lifecycle-state" => {
            match &state.target_lifecycle_state {
                Some(v) => found(v.clone()),
                None => not_found,
            }
        }
        _ => not_found,
    }
}
