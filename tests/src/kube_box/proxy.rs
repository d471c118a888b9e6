//! A fault proxy in front of the box's API server: the agent's kubeconfig points here, and a
//! test arms faults on the requests it means ("the next PATCH of node X", "the first DELETE
//! of a GameServer", "the first POST to pods/eviction").
//!
//! The proxy terminates TLS with the box's own serving certificate (so the agent's CA is the
//! box's) and forwards every request as it came, bearer token and all, to the real
//! kube-apiserver over a TLS connection of its own; responses stream back, so watches work.
//! A request that matches an armed rule gets its fault instead:
//!
//! - [`Fault::Status`]: a 5xx `Status`, never forwarded;
//! - [`Fault::TooManyRequests`]: 429 with `Retry-After`, never forwarded (API priority and
//!   fairness answers so);
//! - [`Fault::Hang`]: never answered, never forwarded (the client's deadline must fire);
//! - [`Fault::ApplyThenDrop`] / [`Fault::ApplyThenStatus`]: forwarded and applied, the real
//!   answer read, held, then lost: the connection dropped, or a 5xx in its place.
//!
//! Each injection is recorded with what the server really answered (for a lost answer), so
//! a test proves the fault happened; the audit log shows what the server applied.
//!
//! Watches can be held ([`FaultProxy::hold_watches`]): the lines of a matching watch (open
//! ones too) are kept, in order, until the test releases them, and recorded, so a test shows
//! which events a client did not get while its watch lagged. The proxy also records, for
//! every request it forwards, which slow requests (hung, held) were still outstanding then
//! and which had ended ([`FaultProxy::forwarded_requests`]): an order of the client's
//! requests, not a time.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use axum::body::Body;
use axum::http::{HeaderValue, Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// The largest request body the proxy reads (Kubernetes writes are small).
const MAX_BODY: usize = 8 * 1024 * 1024;
/// How long a hung request is held before the proxy lets it go (a client gives up sooner).
const HANG_FOR: Duration = Duration::from_secs(300);

/// What a matching request gets instead of its answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// This status (a 5xx) with a `Status` body; the request is not forwarded.
    Status(u16),
    /// 429 with `Retry-After: <seconds>`; not forwarded.
    TooManyRequests { retry_after: u32 },
    /// No answer at all; not forwarded.
    Hang,
    /// Forwarded and applied; after `hold`, the connection is dropped without an answer.
    ApplyThenDrop { hold: Duration },
    /// Forwarded and applied; after `hold`, `status` (a 5xx) instead of the real answer.
    ApplyThenStatus { status: u16, hold: Duration },
    /// Held, not forwarded, until the test releases it ([`FaultProxy::release`]); then
    /// forwarded, and the client gets the real answer: a request that lost a race the test
    /// arranged.
    HoldUntilReleased,
}

impl Fault {
    /// Whether the request reaches the API server and its answer is lost.
    pub fn applies(&self) -> bool {
        matches!(
            self,
            Fault::ApplyThenDrop { .. } | Fault::ApplyThenStatus { .. }
        )
    }
}

type BodyPredicate = Arc<dyn Fn(&Value) -> bool + Send + Sync>;

/// Which requests a rule takes: a method, a path pattern (`*` stands for one segment; the
/// query is ignored) and, optionally, a predicate on the JSON body.
#[derive(Clone)]
pub struct Matcher {
    method: Method,
    path: String,
    body: Option<BodyPredicate>,
}

impl std::fmt::Debug for Matcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}{}",
            self.method,
            self.path,
            if self.body.is_some() { " (body)" } else { "" }
        )
    }
}

impl Matcher {
    pub fn new(method: Method, path: &str) -> Matcher {
        Matcher {
            method,
            path: path.to_string(),
            body: None,
        }
    }

    /// Only requests whose JSON body satisfies `f` (a body that is not JSON never does).
    pub fn body(mut self, f: impl Fn(&Value) -> bool + Send + Sync + 'static) -> Matcher {
        self.body = Some(Arc::new(f));
        self
    }

    fn matches(&self, method: &Method, path: &str, body: Option<&Value>) -> bool {
        if *method != self.method || !path_matches(&self.path, path) {
            return false;
        }
        match (&self.body, body) {
            (None, _) => true,
            (Some(f), Some(b)) => f(b),
            (Some(_), None) => false,
        }
    }
}

/// `pattern` against `path`, segment by segment; `*` matches any one segment.
fn path_matches(pattern: &str, path: &str) -> bool {
    let p: Vec<&str> = pattern.trim_matches('/').split('/').collect();
    let s: Vec<&str> = path.trim_matches('/').split('/').collect();
    p.len() == s.len() && p.iter().zip(&s).all(|(p, s)| *p == "*" || p == s)
}

/// One fault the proxy injected.
#[derive(Clone, Debug)]
pub struct Injection {
    /// The rule's name, as armed.
    pub rule: String,
    pub fault: Fault,
    pub method: String,
    /// Path and query.
    pub uri: String,
    /// The request body, if JSON.
    pub request: Value,
    /// For a lost answer: the status the API server really answered (the write's outcome).
    pub applied: Option<u16>,
    /// For a lost answer: the body it answered.
    pub answer: Value,
    pub at: jiff::Timestamp,
}

struct Rule {
    name: String,
    matcher: Matcher,
    fault: Fault,
    left: usize,
}

/// A request the proxy forwarded, and where the slow requests stood then: the rules whose
/// request was held unanswered (a hang, a held answer, a hold) and the ones whose held
/// request had already ended (answered, or given up by the client).
#[derive(Clone, Debug)]
pub struct Forwarded {
    pub method: String,
    /// Path and query.
    pub uri: String,
    pub while_outstanding: Vec<String>,
    pub after_ended: Vec<String>,
}

/// A watch line kept by a hold.
#[derive(Clone, Debug)]
pub struct HeldLine {
    /// The hold's name.
    pub hold: String,
    /// The watch's path and query.
    pub uri: String,
    /// The line (a watch event's JSON).
    pub line: String,
}

struct Hold {
    name: String,
    /// Watch paths it takes (`*` is one segment), GET with `watch=true`.
    paths: Vec<String>,
}

struct State {
    upstream: SocketAddr,
    connector: TlsConnector,
    rules: Mutex<Vec<Rule>>,
    injected: Mutex<Vec<Injection>>,
    changed: tokio::sync::Notify,
    forwarded: std::sync::atomic::AtomicUsize,
    log: Mutex<Vec<Forwarded>>,
    /// Slow requests outstanding, by rule name.
    outstanding: Mutex<Vec<String>>,
    /// Slow requests that have ended, by rule name.
    ended: Mutex<Vec<String>>,
    /// Rules whose held requests the test released.
    released: tokio::sync::watch::Sender<Vec<String>>,
    holds: Mutex<Vec<Hold>>,
    /// Bumped whenever holds change.
    holds_changed: tokio::sync::watch::Sender<u64>,
    held: Mutex<Vec<HeldLine>>,
}

impl State {
    /// The hold taking a watch of `path`, if any.
    fn hold_for(&self, path: &str) -> Option<String> {
        self.holds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|h| h.paths.iter().any(|p| path_matches(p, path)))
            .map(|h| h.name.clone())
    }
}

/// A slow request, outstanding while this lives, ended once dropped (however its hold ends:
/// answered, or the client gone).
struct Slow<'a> {
    state: &'a State,
    rule: String,
}

impl<'a> Slow<'a> {
    fn start(state: &'a State, rule: &str) -> Slow<'a> {
        state
            .outstanding
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(rule.to_string());
        Slow {
            state,
            rule: rule.to_string(),
        }
    }
}

impl Drop for Slow<'_> {
    fn drop(&mut self) {
        let mut o = self
            .state
            .outstanding
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(i) = o.iter().position(|r| *r == self.rule) {
            o.remove(i);
        }
        self.state
            .ended
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(self.rule.clone());
    }
}

impl State {
    /// The first armed rule `req` matches, used up by one.
    fn take(&self, method: &Method, path: &str, body: Option<&Value>) -> Option<(String, Fault)> {
        let mut rules = self.rules.lock().unwrap_or_else(|e| e.into_inner());
        let rule = rules
            .iter_mut()
            .find(|r| r.left > 0 && r.matcher.matches(method, path, body))?;
        rule.left -= 1;
        Some((rule.name.clone(), rule.fault.clone()))
    }

    fn record(&self, i: Injection) {
        self.injected
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(i);
        self.changed.notify_waiters();
    }
}

/// The proxy. Dropping it stops accepting; open connections end with their clients.
pub struct FaultProxy {
    addr: SocketAddr,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn certs(path: &Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let pem = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let certs: Vec<_> = CertificateDer::pem_slice_iter(&pem)
        .filter_map(Result::ok)
        .collect();
    anyhow::ensure!(!certs.is_empty(), "no certificate in {}", path.display());
    Ok(certs)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

impl FaultProxy {
    /// Listens on a free 127.0.0.1 port, serving `cert`/`key`, in front of the API server
    /// at `upstream` (whose certificate `ca` signed).
    pub async fn start(
        upstream: SocketAddr,
        ca: &Path,
        cert: &Path,
        key: &Path,
    ) -> anyhow::Result<FaultProxy> {
        let key_pem = std::fs::read(key).with_context(|| format!("reading {}", key.display()))?;
        let key = PrivateKeyDer::from_pem_slice(&key_pem)
            .map_err(|e| anyhow::anyhow!("no private key in {}: {e}", key.display()))?;
        let mut server = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(certs(cert)?, key)?;
        server.alpn_protocols = vec![b"http/1.1".to_vec()];
        let mut roots = rustls::RootCertStore::empty();
        for c in certs(ca)? {
            roots.add(c)?;
        }
        let mut client = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        client.alpn_protocols = vec![b"http/1.1".to_vec()];
        let state = Arc::new(State {
            upstream,
            connector: TlsConnector::from(Arc::new(client)),
            rules: Mutex::new(Vec::new()),
            injected: Mutex::new(Vec::new()),
            changed: tokio::sync::Notify::new(),
            forwarded: std::sync::atomic::AtomicUsize::new(0),
            log: Mutex::new(Vec::new()),
            outstanding: Mutex::new(Vec::new()),
            ended: Mutex::new(Vec::new()),
            released: tokio::sync::watch::channel(Vec::new()).0,
            holds: Mutex::new(Vec::new()),
            holds_changed: tokio::sync::watch::channel(0).0,
            held: Mutex::new(Vec::new()),
        });
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let acceptor = TlsAcceptor::from(Arc::new(server));
        let task = tokio::spawn(accept_loop(listener, acceptor, state.clone()));
        Ok(FaultProxy { addr, state, task })
    }

    /// `https://127.0.0.1:<port>`: the server a kubeconfig names.
    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// Arms `fault` for the next `times` requests `matcher` takes, under `name`.
    pub fn arm(&self, name: &str, matcher: Matcher, fault: Fault, times: usize) {
        self.state
            .rules
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Rule {
                name: name.to_string(),
                matcher,
                fault,
                left: times,
            });
    }

    /// Disarms rule `name`: the requests it would take from now on go through.
    pub fn disarm(&self, name: &str) {
        for r in self
            .state
            .rules
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter_mut()
            .filter(|r| r.name == name)
        {
            r.left = 0;
        }
    }

    /// Every injection so far, in order.
    pub fn injected(&self) -> Vec<Injection> {
        self.state
            .injected
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Rules armed and not (fully) used, by name.
    pub fn unused(&self) -> Vec<String> {
        self.state
            .rules
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|r| r.left > 0)
            .map(|r| r.name.clone())
            .collect()
    }

    /// Requests forwarded to the API server so far.
    pub fn forwarded(&self) -> usize {
        self.state
            .forwarded
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Lets the requests rule `name` holds ([`Fault::HoldUntilReleased`]) go on to the API
    /// server.
    pub fn release(&self, name: &str) {
        self.state
            .released
            .send_modify(|r| r.push(name.to_string()));
    }

    /// Every request forwarded so far, in order, with where the slow requests stood then.
    pub fn forwarded_requests(&self) -> Vec<Forwarded> {
        self.state
            .log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Holds every watch (`GET …?watch=true`) of one of `paths` (`*` is one segment), open
    /// or opened later: its lines are kept, in order, until [`FaultProxy::release_watches`].
    pub fn hold_watches(&self, name: &str, paths: &[&str]) {
        self.state
            .holds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Hold {
                name: name.to_string(),
                paths: paths.iter().map(|p| p.to_string()).collect(),
            });
        self.state.holds_changed.send_modify(|n| *n += 1);
    }

    /// Lets every held watch line go, in order; later lines are not held.
    pub fn release_watches(&self) {
        self.state
            .holds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        self.state.holds_changed.send_modify(|n| *n += 1);
    }

    /// Every watch line a hold kept so far.
    pub fn held_lines(&self) -> Vec<HeldLine> {
        self.state
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Waits until rule `name` has injected its fault (at most `within`).
    pub async fn wait_injected(&self, name: &str, within: Duration) -> anyhow::Result<Injection> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let changed = self.state.changed.notified();
            if let Some(i) = self.injected().into_iter().find(|i| i.rule == name) {
                return Ok(i);
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                anyhow::bail!(
                    "fault {name} never injected within {within:?}; injected: {:?}",
                    self.injected().iter().map(|i| &i.rule).collect::<Vec<_>>()
                );
            }
        }
    }
}

async fn accept_loop(listener: TcpListener, acceptor: TlsAcceptor, state: Arc<State>) {
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            // Out of descriptors, say: try again shortly rather than spin.
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let (acceptor, state) = (acceptor.clone(), state.clone());
        tokio::spawn(async move {
            let Ok(tls) = acceptor.accept(tcp).await else {
                return;
            };
            let service = hyper::service::service_fn(move |req| handle(state.clone(), req));
            // A service error (a lost answer) ends the connection without a response.
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(tls), service)
                .await;
        });
    }
}

/// The connection dropped in place of an answer.
#[derive(Debug, thiserror::Error)]
#[error("the answer was lost on purpose")]
struct Lost;

async fn handle(state: Arc<State>, req: Request<Incoming>) -> Result<Response<Body>, Lost> {
    let (parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(Body::new(body), MAX_BODY).await {
        Ok(b) => b,
        Err(e) => return Ok(status(502, &format!("reading the request: {e}"))),
    };
    let json: Option<Value> = serde_json::from_slice(&bytes).ok();
    let path = parts.uri.path().to_string();
    let uri = parts
        .uri
        .path_and_query()
        .map(|p| p.to_string())
        .unwrap_or_else(|| path.clone());
    let fault = state.take(&parts.method, &path, json.as_ref());
    let injection = |rule: String, fault: Fault, applied: Option<u16>, answer: Value| Injection {
        rule,
        fault,
        method: parts.method.to_string(),
        uri: uri.clone(),
        request: json.clone().unwrap_or(Value::Null),
        applied,
        answer,
        at: jiff::Timestamp::now(),
    };
    let Some((rule, fault)) = fault else {
        let is_watch = parts.method == Method::GET
            && url::form_urlencoded::parse(parts.uri.query().unwrap_or("").as_bytes())
                .any(|(k, v)| k == "watch" && (v == "true" || v == "1"));
        let up = Request::from_parts(parts.clone(), Body::from(bytes));
        return Ok(match forward(&state, up).await {
            Ok(r) if is_watch => held_watch(state.clone(), path.clone(), uri.clone(), r),
            Ok(r) => r.map(Body::new),
            Err(e) => status(502, &format!("{e:#}")),
        });
    };
    match fault.clone() {
        Fault::Status(code) => {
            state.record(injection(rule, fault, None, Value::Null));
            Ok(status(code, "injected by the fault proxy"))
        }
        Fault::TooManyRequests { retry_after } => {
            state.record(injection(rule, fault, None, Value::Null));
            let mut r = status(429, "injected by the fault proxy: too many requests");
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(retry_after));
            Ok(r)
        }
        Fault::Hang => {
            let _slow = Slow::start(&state, &rule);
            state.record(injection(rule, fault, None, Value::Null));
            tokio::time::sleep(HANG_FOR).await;
            Err(Lost)
        }
        Fault::HoldUntilReleased => {
            let _slow = Slow::start(&state, &rule);
            state.record(injection(rule.clone(), fault, None, Value::Null));
            let mut released = state.released.subscribe();
            // An error: the proxy is going away; forward what is left.
            let _ = released.wait_for(|r| r.contains(&rule)).await;
            let up = Request::from_parts(parts.clone(), Body::from(bytes));
            Ok(forward(&state, up)
                .await
                .map(|r| r.map(Body::new))
                .unwrap_or_else(|e| status(502, &format!("{e:#}"))))
        }
        Fault::ApplyThenDrop { hold } | Fault::ApplyThenStatus { hold, .. } => {
            let _slow = Slow::start(&state, &rule);
            let up = Request::from_parts(parts.clone(), Body::from(bytes));
            let (code, answer) = match forward(&state, up).await {
                Ok(r) => {
                    let code = r.status().as_u16();
                    let body = axum::body::to_bytes(Body::new(r.into_body()), MAX_BODY)
                        .await
                        .unwrap_or_default();
                    (
                        Some(code),
                        serde_json::from_slice(&body).unwrap_or(Value::Null),
                    )
                }
                Err(e) => (None, Value::String(format!("{e:#}"))),
            };
            state.record(injection(rule, fault.clone(), code, answer));
            tokio::time::sleep(hold).await;
            match fault {
                Fault::ApplyThenStatus { status: s, .. } => {
                    Ok(status(s, "injected by the fault proxy after applying"))
                }
                _ => Err(Lost),
            }
        }
    }
}

/// Sends `req` to the API server on a connection of its own.
async fn forward(state: &State, mut req: Request<Body>) -> anyhow::Result<Response<Incoming>> {
    let tcp = TcpStream::connect(state.upstream).await?;
    tcp.set_nodelay(true)?;
    let name = ServerName::IpAddress(state.upstream.ip().into());
    let tls = state.connector.connect(name, tcp).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
    // The connection lives as long as the response body streams (a watch).
    tokio::spawn(conn);
    req.headers_mut().insert(
        header::HOST,
        HeaderValue::from_str(&state.upstream.to_string())?,
    );
    state
        .forwarded
        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let while_outstanding = state
        .outstanding
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let after_ended = state
        .ended
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    state
        .log
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(Forwarded {
            method: req.method().to_string(),
            uri: req
                .uri()
                .path_and_query()
                .map(|p| p.to_string())
                .unwrap_or_default(),
            while_outstanding,
            after_ended,
        });
    Ok(sender.send_request(req).await?)
}

/// A watch's answer, streamed through: while a hold takes its path, its lines are kept (and
/// recorded), then sent in order once released.
fn held_watch(
    state: Arc<State>,
    path: String,
    uri: String,
    r: Response<Incoming>,
) -> Response<Body> {
    use futures::StreamExt;
    let (parts, body) = r.into_parts();
    let mut body = Body::new(body).into_data_stream();
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<axum::body::Bytes, axum::Error>>(64);
    tokio::spawn(async move {
        let mut changed = state.holds_changed.subscribe();
        let mut kept: Vec<axum::body::Bytes> = Vec::new();
        let mut partial = Vec::new();
        loop {
            tokio::select! {
                data = body.next() => {
                    let Some(Ok(data)) = data else { break };
                    match state.hold_for(&path) {
                        Some(hold) => {
                            partial.extend_from_slice(&data);
                            while let Some(i) = partial.iter().position(|b| *b == b'\n') {
                                let line: Vec<u8> = partial.drain(..=i).collect();
                                state.held.lock().unwrap_or_else(|e| e.into_inner()).push(HeldLine {
                                    hold: hold.clone(),
                                    uri: uri.clone(),
                                    line: String::from_utf8_lossy(&line).trim().to_string(),
                                });
                            }
                            kept.push(data);
                        }
                        None => {
                            partial.clear();
                            for k in kept.drain(..) {
                                if tx.send(Ok(k)).await.is_err() {
                                    return;
                                }
                            }
                            if tx.send(Ok(data)).await.is_err() {
                                return;
                            }
                        }
                    }
                }
                _ = changed.changed() => {
                    if state.hold_for(&path).is_none() {
                        partial.clear();
                        for k in kept.drain(..) {
                            if tx.send(Ok(k)).await.is_err() {
                                return;
                            }
                        }
                    }
                }
                _ = tx.closed() => return,
            }
        }
        for k in kept.drain(..) {
            if tx.send(Ok(k)).await.is_err() {
                return;
            }
        }
    });
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    Response::from_parts(parts, Body::from_stream(stream))
}

/// A Kubernetes `Status` answer.
fn status(code: u16, message: &str) -> Response<Body> {
    let code = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let reason = match code.as_u16() {
        429 => "TooManyRequests",
        503 => "ServiceUnavailable",
        504 => "Timeout",
        _ => "InternalError",
    };
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code.as_u16(),
    });
    let mut r = Response::new(Body::from(body.to_string()));
    *r.status_mut() = code;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pattern_matches_one_segment_per_star_and_ignores_nothing_else() {
        let p = "/apis/agones.dev/v1/namespaces/*/gameservers/*";
        assert!(path_matches(
            p,
            "/apis/agones.dev/v1/namespaces/a/gameservers/gs-0"
        ));
        assert!(!path_matches(
            p,
            "/apis/agones.dev/v1/namespaces/a/gameservers"
        ));
        assert!(!path_matches(
            p,
            "/apis/agones.dev/v1/namespaces/a/gameservers/gs-0/status"
        ));
        let m = Matcher::new(Method::PATCH, "/api/v1/nodes/n1")
            .body(|b| b.to_string().contains("unschedulable"));
        let fence = json!([{"op": "add", "path": "/spec/unschedulable", "value": true}]);
        assert!(m.matches(&Method::PATCH, "/api/v1/nodes/n1", Some(&fence)));
        assert!(!m.matches(&Method::PATCH, "/api/v1/nodes/n1", Some(&json!({}))));
        assert!(!m.matches(&Method::PATCH, "/api/v1/nodes/n1", None));
        assert!(!m.matches(&Method::PUT, "/api/v1/nodes/n1", Some(&fence)));
    }
}
