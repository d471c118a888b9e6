//! The HTTP front: routes real Kubernetes API paths to the store, journals every request,
//! applies injected faults, and renders every failure as a `metav1.Status`.
//!
//! One fallback handler parses paths itself rather than registering axum routes: the API's
//! path grammar is regular, and a single entry point makes journaling and fault
//! injection uniform.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::Response;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::apf::{self, Apf};
use super::discovery;
use super::eviction;
use super::faults::{FaultAction, Faults, WatchKey};
use super::journal::{Journal, JournalEntry, Verb, journaled_body};
use super::patch::{self, PatchKind};
use super::resources::{PODS, ResourceType};
use super::selectors::Selectors;
use super::status::{ApiError, success_status};
use super::store::{DeleteOptions, Part, Store, finalizers, meta_str};
use super::watch::{self, WatchContext, WatchRequest, WatchStart};

/// Largest request body accepted.
const MAX_BODY: usize = 16 * 1024 * 1024;

/// Everything the handler needs.
pub struct ServerState {
    pub store: Store,
    pub journal: Journal,
    pub faults: Faults,
    /// Cancelled (and replaced) to end every open watch.
    pub watches: Mutex<CancellationToken>,
    pub bookmark_interval: Duration,
    pub addr: SocketAddr,
    /// Store changes, handed to the watches that can want them.
    pub fanout: super::fanout::Fanout,
    /// API Priority and Fairness (off unless enabled).
    pub apf: Apf,
    /// The GameServer CRD declares Agones' selectable fields (Agones 1.58 and later).
    pub agones_selectable_fields: std::sync::atomic::AtomicBool,
    /// Until this moment every API request is answered 503, as while a restarted API
    /// server is not yet serving ([`ServerState::restart`]).
    pub down_until: Mutex<Option<std::time::Instant>>,
}

impl ServerState {
    /// Ends every open watch stream; later watches are unaffected.
    pub fn drop_watches(&self) {
        let mut g = self.watches.lock().unwrap_or_else(|p| p.into_inner());
        g.cancel();
        *g = CancellationToken::new();
    }

    /// What clients see when the API server restarts: every open watch ends, requests are
    /// answered 503 for `down`, and the watch history is gone (the new server's watch
    /// cache starts at the current resourceVersion), so every watch resumed from before
    /// is answered 410 and its client lists again. The store itself (etcd) keeps
    /// everything. Returns the resourceVersion the new watch cache starts at.
    pub fn restart(&self, down: Duration) -> u64 {
        *self.down_until.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(std::time::Instant::now() + down);
        let floor = self.store.compact();
        self.drop_watches();
        floor
    }

    /// Whether requests are refused now, because of [`ServerState::restart`].
    fn is_down(&self) -> bool {
        let mut g = self.down_until.lock().unwrap_or_else(|p| p.into_inner());
        match *g {
            Some(until) if std::time::Instant::now() < until => true,
            Some(_) => {
                *g = None;
                false
            }
            None => false,
        }
    }

    fn watch_token(&self) -> CancellationToken {
        self.watches
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// A parsed request path.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Route {
    Version,
    Health,
    CoreVersions,
    GroupList,
    Group(String),
    ResourceList(String, String),
    Resource {
        rt: ResourceType,
        namespace: Option<String>,
        name: Option<String>,
        subresource: Option<String>,
    },
}

fn not_found_path() -> ApiError {
    ApiError::new(404, "the server could not find the requested resource")
}

fn parse_route(path: &str) -> Result<Route, ApiError> {
    let segs: Vec<&str> = path
        .trim_matches('/')
        .split('/')
        .filter(|s| !s.is_empty())
        .collect();
    let (group, version, rest): (&str, &str, &[&str]) = match segs.as_slice() {
        ["version"] => return Ok(Route::Version),
        ["healthz" | "readyz" | "livez"] => return Ok(Route::Health),
        ["api"] => return Ok(Route::CoreVersions),
        ["apis"] => return Ok(Route::GroupList),
        ["apis", g] => return Ok(Route::Group((*g).to_string())),
        ["api", v] => return Ok(Route::ResourceList(String::new(), (*v).to_string())),
        ["apis", g, v] => return Ok(Route::ResourceList((*g).to_string(), (*v).to_string())),
        ["api", v, rest @ ..] => ("", *v, rest),
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => return Err(not_found_path()),
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some((*ns).to_string()), rest),
        _ => (None, rest),
    };
    let (plural, name, subresource) = match rest {
        [p] => (*p, None, None),
        [p, n] => (*p, Some((*n).to_string()), None),
        [p, n, s] => (*p, Some((*n).to_string()), Some((*s).to_string())),
        _ => return Err(not_found_path()),
    };
    let rt = ResourceType::find(group, version, plural).ok_or_else(not_found_path)?;
    if namespace.is_some() && !rt.namespaced {
        return Err(not_found_path());
    }
    if let Some(s) = &subresource {
        let ok = (s == "status" && rt.has_status_subresource())
            || ((s == "eviction" || s == "binding") && rt == PODS);
        if !ok {
            return Err(not_found_path());
        }
    }
    Ok(Route::Resource {
        rt,
        namespace,
        name,
        subresource,
    })
}

/// What a handler produces: a JSON document or a watch stream.
enum Reply {
    Json(StatusCode, Value),
    Text(StatusCode, &'static str),
    Stream(Body),
}

impl From<ApiError> for Reply {
    fn from(e: ApiError) -> Self {
        Reply::Json(
            StatusCode::from_u16(e.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            e.to_status(),
        )
    }
}

/// Parsed query string. A repeated key keeps its last value (clients do not repeat keys).
struct Query(HashMap<String, String>);

impl Query {
    fn parse(q: &str) -> Self {
        Query(
            url::form_urlencoded::parse(q.as_bytes())
                .into_owned()
                .collect(),
        )
    }
    fn get(&self, k: &str) -> Option<&str> {
        self.0.get(k).map(String::as_str)
    }
    fn flag(&self, k: &str) -> bool {
        matches!(self.get(k), Some("true" | "1"))
    }
}

fn bearer(headers: &HeaderMap) -> Option<String> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    v.strip_prefix("Bearer ").map(|t| t.trim().to_string())
}

fn verb_for(method: &Method, route: &Route, q: &Query) -> Verb {
    let collection = matches!(route, Route::Resource { name: None, .. });
    match *method {
        Method::GET if collection && q.flag("watch") => Verb::Watch,
        Method::GET if collection => Verb::List,
        Method::POST => Verb::Create,
        Method::PUT => Verb::Update,
        Method::PATCH => Verb::Patch,
        Method::DELETE if collection => Verb::DeleteCollection,
        Method::DELETE => Verb::Delete,
        _ => Verb::Get,
    }
}

/// The single entry point for every request.
pub async fn handle(State(s): State<Arc<ServerState>>, req: Request) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or_default().to_string();
    let identity = bearer(req.headers());
    let content_type = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let q = Query::parse(&query);
    let route = parse_route(&path);
    let verb = route
        .as_ref()
        .map(|r| verb_for(&method, r, &q))
        .unwrap_or(Verb::Get);
    let (resource, namespace, name, subresource) = match &route {
        Ok(Route::Resource {
            rt,
            namespace,
            name,
            subresource,
        }) => (
            Some(rt.plural.to_string()),
            namespace.clone(),
            name.clone(),
            subresource.clone(),
        ),
        _ => (None, None, None, None),
    };
    let path_and_query = if query.is_empty() {
        path.clone()
    } else {
        format!("{path}?{query}")
    };

    let entry = |status: StatusCode,
                 response: Option<Arc<Value>>,
                 request: Option<Arc<Value>>,
                 at| JournalEntry {
        seq: 0,
        identity: identity.clone(),
        verb,
        method: method.to_string(),
        path: path.clone(),
        query: query.clone(),
        status: status.as_u16(),
        resource: resource.clone(),
        namespace: namespace.clone(),
        name: name.clone(),
        subresource: subresource.clone(),
        at,
        response,
        request,
    };
    // A restarting server serves nothing, and admits nothing to its queues.
    if s.is_down() {
        let e = ApiError::new(
            503,
            "the API server is restarting: the server is currently unable to handle the request",
        );
        let bytes = serde_json::to_vec(&e.to_status()).unwrap_or_default();
        s.journal.add_traffic(&identity, bytes.len() as u64, 0);
        let status = StatusCode::SERVICE_UNAVAILABLE;
        s.journal
            .record(entry(status, None, None, std::time::SystemTime::now()));
        return json_response(status, Body::from(bytes));
    }
    // Admission comes first, as in the real filter chain: a request held by a fault holds
    // its seat, as a slow request would.
    let exempt = apf::exempt(verb == Verb::Watch, &path);
    let seat = match s.apf.admit(&identity, exempt).await {
        Ok(seat) => seat,
        Err(refused) => {
            let seq = s.journal.record(entry(
                StatusCode::TOO_MANY_REQUESTS,
                None,
                None,
                std::time::SystemTime::now(),
            ));
            s.journal
                .add_traffic(&identity, apf::TOO_MANY_REQUESTS.len() as u64, 0);
            s.apf.rejected(&identity, seq, &refused);
            return apf::too_many_requests(&refused);
        }
    };

    // Everything that waits comes first (faults, the body); then the write is applied and
    // journaled with nothing awaited in between.
    let fault = s.faults.take(&method, &path_and_query);
    if let Some(FaultAction::Throttle(retry_after)) = fault {
        s.journal.record(entry(
            StatusCode::TOO_MANY_REQUESTS,
            None,
            None,
            std::time::SystemTime::now(),
        ));
        s.journal
            .add_traffic(&identity, apf::TOO_MANY_REQUESTS.len() as u64, 0);
        return apf::too_many_requests(&apf::Refused { retry_after });
    }
    match fault {
        Some(FaultAction::Delay(d)) => tokio::time::sleep(d).await,
        Some(FaultAction::Hang) => s.faults.hang().await,
        _ => {}
    }
    // Read even when a fault answers instead, so the journal shows what was asked.
    let read = axum::body::to_bytes(req.into_body(), MAX_BODY).await;
    let request = match &read {
        Ok(b) if verb.is_mutating() => journaled_body(b),
        _ => None,
    };
    let body = match fault {
        Some(FaultAction::Status(code)) => Err(Reply::from(ApiError::new(
            code,
            format!("injected fault: status {code}"),
        ))),
        _ => read.map_err(|e| {
            Reply::from(ApiError::bad_request(&format!(
                "reading the request body: {e}"
            )))
        }),
    };
    let write = verb.is_mutating().then(|| s.journal.begin_write());
    // When it was applied: no one can have seen its effect before this moment.
    let applied_at = std::time::SystemTime::now();
    let reply = match body {
        Err(reply) => reply,
        Ok(body) => match route {
            Err(e) => e.into(),
            Ok(r) => dispatch(&s, r, &method, &q, &content_type, body, identity.clone())
                .unwrap_or_else(Reply::from),
        },
    };

    let mut written = None;
    let (status, response) = match reply {
        Reply::Json(status, v) => {
            let bytes = serde_json::to_vec(&v).unwrap_or_default();
            s.journal.add_traffic(&identity, bytes.len() as u64, 0);
            if verb.is_mutating() && status.is_success() {
                written = Some(Arc::new(v));
            }
            (status, json_response(status, Body::from(bytes)))
        }
        Reply::Text(status, t) => {
            s.journal.add_traffic(&identity, t.len() as u64, 0);
            let mut r = Response::new(Body::from(t));
            *r.status_mut() = status;
            (status, r)
        }
        // Stream bytes are counted as they are sent.
        Reply::Stream(body) => (StatusCode::OK, json_response(StatusCode::OK, body)),
    };
    let applied = verb.is_mutating() && status.is_success();
    let seq = s
        .journal
        .record(entry(status, written, request, applied_at));
    drop(write);
    drop(seat);
    if applied && fault == Some(FaultAction::LoseAnswer) {
        s.faults.answer_lost(seq);
        let e = ApiError::new(
            504,
            "Timeout: request did not complete within the allotted timeout (injected: the write was applied)",
        );
        let bytes = serde_json::to_vec(&e.to_status()).unwrap_or_default();
        return json_response(StatusCode::GATEWAY_TIMEOUT, Body::from(bytes));
    }
    response
}

fn json_response(status: StatusCode, body: Body) -> Response {
    let mut r = Response::new(body);
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

fn dispatch(
    s: &ServerState,
    route: Route,
    method: &Method,
    q: &Query,
    content_type: &str,
    body: Bytes,
    identity: Option<String>,
) -> Result<Reply, ApiError> {
    let get_only = |v: Value| -> Result<Reply, ApiError> {
        if *method == Method::GET {
            Ok(Reply::Json(StatusCode::OK, v))
        } else {
            Err(ApiError::method_not_allowed(
                "the server does not allow this method on the requested resource",
            ))
        }
    };
    match route {
        Route::Version => get_only(discovery::version()),
        Route::Health => Ok(Reply::Text(StatusCode::OK, "ok")),
        Route::CoreVersions => get_only(discovery::api_versions(&s.addr.to_string())),
        Route::GroupList => get_only(discovery::api_group_list()),
        Route::Group(g) => get_only(discovery::api_group(&g).ok_or_else(not_found_path)?),
        Route::ResourceList(g, v) => {
            get_only(discovery::api_resource_list(&g, &v).ok_or_else(not_found_path)?)
        }
        Route::Resource {
            rt,
            namespace,
            name,
            subresource,
        } => {
            if q.get("dryRun").is_some_and(|d| !d.is_empty()) {
                return Err(ApiError::bad_request(
                    "dryRun is not supported by the lastcall emulator",
                ));
            }
            let ns = namespace.as_deref();
            match (name, subresource.as_deref()) {
                (None, _) => match *method {
                    Method::GET if q.flag("watch") => start_watch(s, rt, namespace, q, identity),
                    Method::GET => list(s, &rt, ns, q),
                    Method::POST if ns.is_some() || !rt.namespaced => create(s, &rt, ns, &body),
                    Method::DELETE if ns.is_some() || !rt.namespaced => {
                        delete_collection(s, &rt, ns, q, &body)
                    }
                    _ => Err(ApiError::method_not_allowed(
                        "the server does not allow this method on the requested resource",
                    )),
                },
                (Some(name), Some("eviction")) => match *method {
                    Method::POST => evict(s, ns.unwrap_or_default(), &name, q, &body),
                    _ => Err(ApiError::method_not_allowed(
                        "the server does not allow this method on the requested resource",
                    )),
                },
                (Some(name), Some("binding")) => match *method {
                    Method::POST => bind(s, ns.unwrap_or_default(), &name, &body),
                    _ => Err(ApiError::method_not_allowed(
                        "the server does not allow this method on the requested resource",
                    )),
                },
                (Some(name), sub) => match *method {
                    Method::GET => s
                        .store
                        .get(&rt, ns, &name)
                        .map(|o| Reply::Json(StatusCode::OK, o))
                        .ok_or_else(|| ApiError::not_found(&rt.qualified_plural(), &name)),
                    Method::PUT => {
                        let obj = parse_body(&body)?;
                        Ok(Reply::Json(
                            StatusCode::OK,
                            s.store
                                .transaction(|t| t.replace_part(&rt, ns, &name, obj, part(sub)))?,
                        ))
                    }
                    Method::PATCH => {
                        patch_object(s, &rt, ns, &name, content_type, &body, part(sub))
                    }
                    Method::DELETE if sub.is_none() => delete(s, &rt, ns, &name, q, &body),
                    _ => Err(ApiError::method_not_allowed(
                        "the server does not allow this method on the requested resource",
                    )),
                },
            }
        }
    }
}

/// Which part of the object a write to this subresource addresses.
fn part(sub: Option<&str>) -> Part {
    if sub == Some("status") {
        Part::Status
    } else {
        Part::Main
    }
}

/// `POST .../pods/{name}/binding` with a `Binding` (`target.name` is the node).
fn bind(s: &ServerState, ns: &str, name: &str, body: &[u8]) -> Result<Reply, ApiError> {
    let v = parse_body(body)?;
    if let Some(kind) = v.get("kind").and_then(Value::as_str)
        && kind != "Binding"
    {
        return Err(ApiError::bad_request(&format!(
            "expected a Binding, got kind {kind:?}"
        )));
    }
    let node = v
        .pointer("/target/name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| ApiError::invalid("Binding", name, "target.name: Required value"))?;
    // As a real server, a body naming another pod is refused before the pod is looked up.
    if let Some(body_name) = v.pointer("/metadata/name").and_then(Value::as_str)
        && body_name != name
    {
        return Err(ApiError::bad_request(&format!(
            "the name of the object ({body_name}) does not match the name on the URL ({name})"
        )));
    }
    let uid = v.pointer("/metadata/uid").and_then(Value::as_str);
    s.store.bind(ns, name, uid, node)?;
    Ok(Reply::Json(
        StatusCode::CREATED,
        success_status(Some(201), None),
    ))
}

fn parse_body(body: &[u8]) -> Result<Value, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(&format!("the request body is not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    }
    Ok(v)
}

fn selectors(s: &ServerState, rt: &ResourceType, q: &Query) -> Result<Selectors, ApiError> {
    let crd_fields: &[&str] = if *rt == super::resources::GAMESERVERS
        && s.agones_selectable_fields
            .load(std::sync::atomic::Ordering::Relaxed)
    {
        super::selectors::AGONES_SELECTABLE_FIELDS
    } else {
        &[]
    };
    Selectors::parse_with(
        rt,
        q.get("labelSelector"),
        q.get("fieldSelector"),
        crd_fields,
    )
}

/// Continue tokens are `rv:namespace:name` (names cannot contain `:`).
fn parse_continue(token: &str) -> Result<(u64, String, String), ApiError> {
    let bad = || ApiError::bad_request(&format!("invalid continue token {token:?}"));
    let mut parts = token.splitn(3, ':');
    let rv = parts.next().and_then(|r| r.parse().ok()).ok_or_else(bad)?;
    let ns = parts.next().ok_or_else(bad)?.to_string();
    let name = parts.next().ok_or_else(bad)?.to_string();
    Ok((rv, ns, name))
}

fn list(
    s: &ServerState,
    rt: &ResourceType,
    ns: Option<&str>,
    q: &Query,
) -> Result<Reply, ApiError> {
    let sel = selectors(s, rt, q)?;
    let limit = match q.get("limit") {
        Some(l) => Some(
            l.parse::<usize>()
                .map_err(|_| ApiError::bad_request(&format!("invalid limit {l:?}")))?,
        ),
        None => None,
    };
    let cont = q
        .get("continue")
        .filter(|c| !c.is_empty())
        .map(parse_continue)
        .transpose()?;
    if let Some((rv, _, _)) = &cont
        && *rv < s.store.oldest_resumable()
    {
        return Err(ApiError::gone(
            "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.",
        ));
    }
    let after = cont.as_ref().map(|(_, n, m)| (n.as_str(), m.as_str()));
    let index = sel.index_key();
    let page = s
        .store
        .list_page(rt, ns, after, limit, index.as_ref(), |o| sel.matches(o));
    // Later pages report the first page's resourceVersion, so a watch started from it
    // replays whatever changed while the client paged.
    let rv = cont.map(|(rv, _, _)| rv).unwrap_or(page.rv);
    let mut meta = json!({ "resourceVersion": rv.to_string() });
    if let Some((n, m)) = page.next {
        meta["continue"] = json!(format!("{rv}:{n}:{m}"));
    }
    Ok(Reply::Json(
        StatusCode::OK,
        json!({
            "apiVersion": rt.api_version(),
            "kind": rt.list_kind(),
            "metadata": meta,
            "items": page.items,
        }),
    ))
}

fn start_watch(
    s: &ServerState,
    rt: ResourceType,
    namespace: Option<String>,
    q: &Query,
    identity: Option<String>,
) -> Result<Reply, ApiError> {
    let selectors = selectors(s, &rt, q)?;
    let start = match q.get("resourceVersion").filter(|r| !r.is_empty()) {
        None | Some("0") => WatchStart::Now,
        Some(r) => WatchStart::After(
            r.parse()
                .map_err(|_| ApiError::bad_request(&format!("invalid resource version: {r:?}")))?,
        ),
    };
    let timeout = match q.get("timeoutSeconds") {
        Some(t) => Some(Duration::from_secs(t.parse().map_err(|_| {
            ApiError::bad_request(&format!("invalid timeoutSeconds {t:?}"))
        })?)),
        None => None,
    };
    let send_initial_events = q.flag("sendInitialEvents");
    let bookmarks = q.flag("allowWatchBookmarks");
    if send_initial_events && !bookmarks {
        return Err(ApiError::invalid(
            "ListOptions.meta.k8s.io",
            "",
            "allowWatchBookmarks: Required value: allowWatchBookmarks must be set to true when sendInitialEvents is set",
        ));
    }
    let key = WatchKey {
        resource: rt.plural.to_string(),
        label_selector: q.get("labelSelector").unwrap_or_default().to_string(),
        field_selector: q.get("fieldSelector").unwrap_or_default().to_string(),
        identity: identity.clone(),
    };
    // A watch that passed the restart check before a restart but takes its token after
    // the restart ended the others would outlive it: check again once the token is held.
    let cancel = s.watch_token();
    if s.is_down() {
        return Err(ApiError::new(
            503,
            "the API server is restarting: the server is currently unable to handle the request",
        ));
    }
    let ctx = WatchContext {
        store: s.store.clone(),
        journal: s.journal.clone(),
        identity,
        cancel,
        bookmark_interval: s.bookmark_interval,
        faults: s.faults.clone(),
        key,
        fanout: s.fanout.clone(),
    };
    let req = WatchRequest {
        rt,
        namespace,
        selectors,
        start,
        timeout,
        bookmarks,
        send_initial_events,
    };
    Ok(Reply::Stream(watch::start(ctx, req)))
}

fn create(
    s: &ServerState,
    rt: &ResourceType,
    ns: Option<&str>,
    body: &[u8],
) -> Result<Reply, ApiError> {
    let obj = parse_body(body)?;
    let created = s.store.create(rt, ns, obj)?;
    Ok(Reply::Json(StatusCode::CREATED, created))
}

fn patch_object(
    s: &ServerState,
    rt: &ResourceType,
    ns: Option<&str>,
    name: &str,
    content_type: &str,
    body: &[u8],
    part: Part,
) -> Result<Reply, ApiError> {
    let kind = PatchKind::from_content_type(content_type)?;
    let out = s.store.transaction(|t| t.modify_part(rt, ns, name, |obj| {
        let before = obj.clone();
        patch::apply(kind, rt, obj, body)?;
        s.faults.apply_reverts(rt.plural, obj);
        if !obj.is_object() {
            return Err(ApiError::bad_request("the patched object is not a JSON object"));
        }
        // The deletion fields belong to the server; a patch cannot set or clear them.
        let meta = super::store::meta_mut(obj);
        for field in ["deletionTimestamp", "deletionGracePeriodSeconds"] {
            match before.pointer(&format!("/metadata/{field}")) {
                Some(v) => meta.insert(field.into(), v.clone()),
                None => meta.remove(field),
            };
        }
        if meta_str(&before, "deletionTimestamp").is_some() {
            let old = finalizers(&before);
            if finalizers(obj).iter().any(|f| !old.contains(f)) {
                return Err(ApiError::invalid(
                    &rt.qualified_kind(),
                    name,
                    "metadata.finalizers: Forbidden: no new finalizers can be added if the object is being deleted",
                ));
            }
        }
        Ok(())
    }, part))?;
    Ok(Reply::Json(StatusCode::OK, out))
}

/// `DeleteOptions` from the body (if any) and the `gracePeriodSeconds` query parameter.
fn delete_options(q: &Query, body: &[u8]) -> Result<DeleteOptions, ApiError> {
    let mut opts = DeleteOptions::default();
    if !body.iter().all(u8::is_ascii_whitespace) {
        let v = parse_body(body)?;
        if v.get("dryRun")
            .and_then(Value::as_array)
            .is_some_and(|a| !a.is_empty())
        {
            return Err(ApiError::bad_request(
                "dryRun is not supported by the lastcall emulator",
            ));
        }
        opts.grace_period_seconds = v.get("gracePeriodSeconds").and_then(Value::as_i64);
        opts.precondition_uid = v
            .pointer("/preconditions/uid")
            .and_then(Value::as_str)
            .map(str::to_string);
        opts.precondition_rv = v
            .pointer("/preconditions/resourceVersion")
            .and_then(Value::as_str)
            .map(str::to_string);
    }
    if let Some(g) = q.get("gracePeriodSeconds") {
        opts.grace_period_seconds =
            Some(g.parse().map_err(|_| {
                ApiError::bad_request(&format!("invalid gracePeriodSeconds {g:?}"))
            })?);
    }
    Ok(opts)
}

fn delete(
    s: &ServerState,
    rt: &ResourceType,
    ns: Option<&str>,
    name: &str,
    q: &Query,
    body: &[u8],
) -> Result<Reply, ApiError> {
    let opts = delete_options(q, body)?;
    let (obj, removed) = s.store.delete_ext(rt, ns, name, &opts)?;
    if removed && !rt.returns_deleted_object() {
        let mut details = json!({
            "name": name,
            "kind": rt.plural,
            "uid": meta_str(&obj, "uid").unwrap_or_default(),
        });
        if !rt.group.is_empty() {
            details["group"] = json!(rt.group);
        }
        return Ok(Reply::Json(
            StatusCode::OK,
            success_status(None, Some(details)),
        ));
    }
    Ok(Reply::Json(StatusCode::OK, obj))
}

fn delete_collection(
    s: &ServerState,
    rt: &ResourceType,
    ns: Option<&str>,
    q: &Query,
    body: &[u8],
) -> Result<Reply, ApiError> {
    let sel = selectors(s, rt, q)?;
    let opts = delete_options(q, body)?;
    let index = sel.index_key();
    let page = s
        .store
        .list_page(rt, ns, None, None, index.as_ref(), |o| sel.matches(o));
    let mut items = Vec::new();
    for o in page.items {
        let o_ns = meta_str(&o, "namespace").map(str::to_string);
        let o_name = meta_str(&o, "name").unwrap_or_default().to_string();
        match s.store.delete_ext(rt, o_ns.as_deref(), &o_name, &opts) {
            Ok((d, _)) => items.push(d),
            // Deleted meanwhile by someone else: not an error for a collection delete.
            Err(e) if e.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    Ok(Reply::Json(
        StatusCode::OK,
        json!({
            "apiVersion": rt.api_version(),
            "kind": rt.list_kind(),
            "metadata": { "resourceVersion": s.store.resource_version().to_string() },
            "items": items,
        }),
    ))
}

fn evict(s: &ServerState, ns: &str, name: &str, q: &Query, body: &[u8]) -> Result<Reply, ApiError> {
    let v = parse_body(body)?;
    if let Some(kind) = v.get("kind").and_then(Value::as_str)
        && kind != "Eviction"
    {
        return Err(ApiError::bad_request(&format!(
            "expected an Eviction, got kind {kind:?}"
        )));
    }
    if let Some(n) = meta_str(&v, "name").filter(|n| !n.is_empty())
        && n != name
    {
        return Err(ApiError::bad_request(
            "name in URL does not match name in Eviction object",
        ));
    }
    let opts = match v.get("deleteOptions").filter(|d| !d.is_null()) {
        Some(d) => delete_options(q, d.to_string().as_bytes())?,
        None => delete_options(q, b"")?,
    };
    eviction::evict(&s.store, ns, name, &opts)?;
    Ok(Reply::Json(
        StatusCode::CREATED,
        success_status(Some(201), None),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kube::resources::{GAMESERVERS, NODES};

    #[test]
    fn routes() {
        assert_eq!(
            parse_route("/api/v1/namespaces/ns/pods/p/eviction").unwrap(),
            Route::Resource {
                rt: PODS,
                namespace: Some("ns".into()),
                name: Some("p".into()),
                subresource: Some("eviction".into())
            }
        );
        assert_eq!(
            parse_route("/apis/agones.dev/v1/gameservers").unwrap(),
            Route::Resource {
                rt: GAMESERVERS,
                namespace: None,
                name: None,
                subresource: None
            }
        );
        assert_eq!(
            parse_route("/api/v1/nodes/n1").unwrap(),
            Route::Resource {
                rt: NODES,
                namespace: None,
                name: Some("n1".into()),
                subresource: None
            }
        );
        assert_eq!(
            parse_route("/api/v1/namespaces/x/nodes").unwrap_err().code,
            404
        );
        assert_eq!(
            parse_route("/api/v1/namespaces/x/pods/p/log")
                .unwrap_err()
                .code,
            404
        );
        assert_eq!(
            parse_route("/apis/apps/v1/deployments").unwrap_err().code,
            404
        );
    }
}
