//! Cluster state: JSON objects keyed by type, namespace and name, with one global,
//! monotonically increasing resourceVersion and a bounded history of changes.
//!
//! Objects stay as `serde_json::Value` so the store keeps every field a client sends
//! (Agones CRDs, fields newer than k8s-openapi) and the HTTP layer never re-encodes
//! through typed structs. Every change gets the next resourceVersion and one
//! [`StoreEvent`], published in resourceVersion order; watches replay the bounded history
//! to resume and answer 410 once it has been trimmed, as etcd compaction makes a real
//! server do.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::ops::Bound;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use serde_json::{Map, Value, json};
use tokio::sync::broadcast;

use super::resources::{NODES, PODS, ResourceType};
use super::selectors::IndexKey;
use super::status::ApiError;
use super::validation;

/// What happened to an object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    Added,
    Modified,
    Deleted,
}

impl EventKind {
    /// The watch event `type` string.
    pub fn as_str(&self) -> &'static str {
        match self {
            EventKind::Added => "ADDED",
            EventKind::Modified => "MODIFIED",
            EventKind::Deleted => "DELETED",
        }
    }
}

/// One change to the store. `object` is the object after the change (for `Deleted`, the
/// last state, carrying the deletion's resourceVersion); `old` is the state before.
#[derive(Debug)]
pub struct StoreEvent {
    pub rv: u64,
    pub rt: ResourceType,
    pub kind: EventKind,
    pub namespace: Option<String>,
    pub name: String,
    pub object: Value,
    pub old: Option<Value>,
    /// `object` serialised once, shared by every watch that sends it.
    encoded: OnceLock<Arc<str>>,
}

impl StoreEvent {
    /// `object` as JSON text, encoded at most once however many watches send it.
    pub fn object_json(&self) -> Arc<str> {
        self.encoded
            .get_or_init(|| Arc::from(self.object.to_string()))
            .clone()
    }
}

/// The part of an object a write addresses: the main resource or its `/status`.
///
/// On types with a status subresource ([`ResourceType::has_status_subresource`]) a main
/// write keeps the stored status, and a status write keeps the stored spec (core types)
/// or everything but the status (custom resources), as the real registries do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Main,
    Status,
}

/// Options of a delete, as in `metav1.DeleteOptions`.
#[derive(Debug, Clone, Default)]
pub struct DeleteOptions {
    pub grace_period_seconds: Option<i64>,
    pub precondition_uid: Option<String>,
    pub precondition_rv: Option<String>,
}

/// Default grace period of a pod without `spec.terminationGracePeriodSeconds`.
const DEFAULT_POD_GRACE_SECONDS: i64 = 30;

/// Capacity of the live event channel; a watch that falls further behind is ended and
/// resumes from history, like a real watch that the server drops.
const BROADCAST_CAPACITY: usize = 16_384;

type Key = (String, String);

/// One list index: the keys of the objects by the value of its attribute.
type ByValue = HashMap<String, BTreeSet<Key>>;

/// Live store events, in resourceVersion order.
pub type EventReceiver = broadcast::Receiver<Arc<StoreEvent>>;

/// The shared cluster state. Cheap to clone (an `Arc` inside).
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

struct Inner {
    state: Mutex<State>,
    tx: broadcast::Sender<Arc<StoreEvent>>,
}

struct State {
    rv: u64,
    objects: HashMap<ResourceType, BTreeMap<Key, Value>>,
    /// List indexes, as a real server's watch cache indexes pods by `spec.nodeName`: per
    /// type, per attribute (an [`IndexKey`] with an empty value: a field path or a label
    /// key), the keys of the objects by the attribute's value. Each is built by the first
    /// list that can use it and kept up to date by every write after, so a list filtered
    /// to one node's objects reads those, not the whole type under the store's lock.
    indexes: HashMap<ResourceType, Vec<(IndexKey, ByValue)>>,
    history: VecDeque<Arc<StoreEvent>>,
    history_limit: usize,
}

/// Exclusive access to the store for several operations that must see one state, e.g.
/// an eviction's PDB check and the delete, or an allocator's pick-and-update.
pub struct Txn<'a> {
    st: &'a mut State,
    tx: &'a broadcast::Sender<Arc<StoreEvent>>,
}

/// A page of a list: the objects, the list's resourceVersion and, when `limit` cut it
/// short, the key to continue after.
#[derive(Debug, Clone)]
pub struct ListPage {
    pub items: Vec<Value>,
    pub rv: u64,
    pub next: Option<(String, String)>,
}

impl Store {
    /// An empty store keeping the last `history_limit` events for watch resumption.
    pub fn new(history_limit: usize) -> Self {
        let (tx, _) = broadcast::channel(BROADCAST_CAPACITY);
        Store {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    rv: 1,
                    objects: HashMap::new(),
                    indexes: HashMap::new(),
                    history: VecDeque::new(),
                    history_limit,
                }),
                tx,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves consistent data (each operation commits
        // at its end), so a poisoned lock is still usable.
        self.inner
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Runs `f` with exclusive access; nothing else changes the store meanwhile.
    /// `f` must not block or await.
    pub fn transaction<R>(&self, f: impl FnOnce(&mut Txn<'_>) -> R) -> R {
        let mut guard = self.lock();
        let mut txn = Txn {
            st: &mut guard,
            tx: &self.inner.tx,
        };
        f(&mut txn)
    }

    /// The resourceVersion of the latest change.
    pub fn resource_version(&self) -> u64 {
        self.lock().rv
    }

    /// One object. For a namespaced type, `ns` must be given.
    pub fn get(&self, rt: &ResourceType, ns: Option<&str>, name: &str) -> Option<Value> {
        self.transaction(|t| t.get(rt, ns, name))
    }

    /// Every object of a type, in one namespace or (`None`) all, with the store's resourceVersion.
    pub fn list(&self, rt: &ResourceType, ns: Option<&str>) -> (Vec<Value>, u64) {
        self.transaction(|t| t.list(rt, ns))
    }

    /// A filtered, optionally paged list: objects after `after` (namespace, name) that
    /// satisfy `pred`, at most `limit` of them. With `index`, an equality every object
    /// satisfying `pred` meets, only the objects with that value are read.
    pub fn list_page(
        &self,
        rt: &ResourceType,
        ns: Option<&str>,
        after: Option<(&str, &str)>,
        limit: Option<usize>,
        index: Option<&IndexKey>,
        pred: impl Fn(&Value) -> bool,
    ) -> ListPage {
        self.transaction(|t| t.list_page(rt, ns, after, limit, index, pred))
    }

    /// Creates an object; sets uid, creationTimestamp, resourceVersion, generation, a
    /// name from `generateName`, and apiVersion/kind.
    pub fn create(
        &self,
        rt: &ResourceType,
        ns: Option<&str>,
        obj: Value,
    ) -> Result<Value, ApiError> {
        self.transaction(|t| t.create(rt, ns, obj))
    }

    /// Full update (PUT) of the main resource: 409 when `metadata.resourceVersion` is set
    /// and stale; 422 without one on a custom resource; the stored status is kept on types
    /// with a status subresource; 422 for what fails validation.
    pub fn replace(
        &self,
        rt: &ResourceType,
        ns: Option<&str>,
        name: &str,
        obj: Value,
    ) -> Result<Value, ApiError> {
        self.transaction(|t| t.replace(rt, ns, name, obj))
    }

    /// Full update of `/status` (PUT): only the status changes (for core types, everything
    /// but the spec); 409 when `metadata.resourceVersion` is set and stale.
    pub fn replace_status(
        &self,
        rt: &ResourceType,
        ns: Option<&str>,
        name: &str,
        obj: Value,
    ) -> Result<Value, ApiError> {
        self.transaction(|t| t.replace_part(rt, ns, name, obj, Part::Status))
    }

    /// [`Store::modify`] through `/status`: what `f` does outside the status is dropped
    /// (for core types, only spec changes are dropped), as a real `/status` write.
    pub fn modify_status<F>(
        &self,
        rt: &ResourceType,
        ns: Option<&str>,
        name: &str,
        f: F,
    ) -> Result<Value, ApiError>
    where
        F: FnOnce(&mut Value) -> Result<(), ApiError>,
    {
        self.transaction(|t| t.modify_part(rt, ns, name, f, Part::Status))
    }

    /// The pod binding subresource: sets `spec.nodeName` of a pod that has none (409 when
    /// it is already bound, 404 when it is gone or has another `uid`), and its
    /// `PodScheduled=True` condition.
    pub fn bind(
        &self,
        ns: &str,
        name: &str,
        uid: Option<&str>,
        node: &str,
    ) -> Result<Value, ApiError> {
        self.transaction(|t| t.bind(ns, name, uid, node))
    }

    /// Atomic read-modify-write of the main resource (a PATCH). If `f` sets
    /// `metadata.resourceVersion` to anything but the current one, 409. On types with a
    /// status subresource, status changes are dropped (use [`Store::modify_status`]). The
    /// result is validated (422) as any update. An unchanged object is not written (no new
    /// resourceVersion, no event). A result with deletionTimestamp and no finalizers is
    /// removed, unless it is a pod still in its grace period (the kubelet removes those).
    pub fn modify<F>(
        &self,
        rt: &ResourceType,
        ns: Option<&str>,
        name: &str,
        f: F,
    ) -> Result<Value, ApiError>
    where
        F: FnOnce(&mut Value) -> Result<(), ApiError>,
    {
        self.transaction(|t| t.modify(rt, ns, name, f))
    }

    /// Deletes as the API does: preconditions, finalizers and pod grace periods may keep
    /// the object (with deletionTimestamp); otherwise it is removed now.
    pub fn delete(
        &self,
        rt: &ResourceType,
        ns: Option<&str>,
        name: &str,
        opts: &DeleteOptions,
    ) -> Result<Value, ApiError> {
        self.transaction(|t| t.delete(rt, ns, name, opts))
            .map(|(v, _)| v)
    }

    /// Like [`Store::delete`], also telling whether the object is gone (true) or kept
    /// terminating (false).
    pub fn delete_ext(
        &self,
        rt: &ResourceType,
        ns: Option<&str>,
        name: &str,
        opts: &DeleteOptions,
    ) -> Result<(Value, bool), ApiError> {
        self.transaction(|t| t.delete(rt, ns, name, opts))
    }

    /// The kubelet / finalizer path: removes the object now if no finalizers remain,
    /// otherwise only makes sure it carries a deletionTimestamp.
    pub fn remove(
        &self,
        rt: &ResourceType,
        ns: Option<&str>,
        name: &str,
    ) -> Result<Value, ApiError> {
        self.transaction(|t| t.remove(rt, ns, name))
    }

    /// Forgets every kept event, as the watch cache of a restarted API server starts empty
    /// at the current resourceVersion: a watch resumed from any earlier one answers 410
    /// and its client lists again. Returns that resourceVersion, the oldest a watch can
    /// resume from.
    pub fn compact(&self) -> u64 {
        let mut st = self.lock();
        st.history.clear();
        st.rv
    }

    /// Every future change, in resourceVersion order.
    pub fn subscribe(&self) -> tokio::sync::broadcast::Receiver<std::sync::Arc<StoreEvent>> {
        self.inner.tx.subscribe()
    }

    /// Kept events with resourceVersion greater than `rv`; 410 Gone when events after
    /// `rv` have already been dropped from the history.
    pub fn events_since(&self, rv: u64) -> Result<Vec<Arc<StoreEvent>>, ApiError> {
        self.lock().events_since(rv)
    }

    /// [`Store::events_since`] and a subscription taken atomically: the receiver yields
    /// exactly the events after the returned ones, with no gap and no duplicate.
    pub fn subscribe_since(
        &self,
        rv: u64,
    ) -> Result<(Vec<Arc<StoreEvent>>, EventReceiver), ApiError> {
        let st = self.lock();
        let past = st.events_since(rv)?;
        Ok((past, self.inner.tx.subscribe()))
    }

    /// The current objects of a type that satisfy `pred` and a subscription taken at the
    /// same instant, with the resourceVersion of that instant.
    pub fn snapshot_and_subscribe(
        &self,
        rt: &ResourceType,
        ns: Option<&str>,
        pred: impl Fn(&Value) -> bool,
    ) -> (Vec<Value>, u64, EventReceiver) {
        let mut st = self.lock();
        let rx = self.inner.tx.subscribe();
        let mut txn = Txn {
            st: &mut st,
            tx: &self.inner.tx,
        };
        let page = txn.list_page(rt, ns, None, None, None, pred);
        (page.items, page.rv, rx)
    }

    /// The oldest resourceVersion a watch can still resume from.
    pub fn oldest_resumable(&self) -> u64 {
        self.lock().floor()
    }
}

impl State {
    fn floor(&self) -> u64 {
        match self.history.front() {
            Some(e) => e.rv - 1,
            None => self.rv,
        }
    }

    fn events_since(&self, rv: u64) -> Result<Vec<Arc<StoreEvent>>, ApiError> {
        let floor = self.floor();
        if rv < floor {
            return Err(ApiError::gone(&format!(
                "too old resource version: {rv} ({floor})"
            )));
        }
        // History is contiguous (one event per resourceVersion), so index arithmetic finds the start.
        let skip = usize::try_from(rv - floor).unwrap_or(usize::MAX);
        Ok(self.history.iter().skip(skip).cloned().collect())
    }
}

/// Namespace key for a type: `""` for cluster-scoped types.
fn ns_key(rt: &ResourceType, ns: Option<&str>) -> String {
    if rt.namespaced {
        ns.unwrap_or_default().to_string()
    } else {
        String::new()
    }
}

impl Txn<'_> {
    /// The current resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.st.rv
    }

    pub fn get(&self, rt: &ResourceType, ns: Option<&str>, name: &str) -> Option<Value> {
        self.get_ref(rt, ns, name).cloned()
    }

    fn get_ref(&self, rt: &ResourceType, ns: Option<&str>, name: &str) -> Option<&Value> {
        self.st
            .objects
            .get(rt)?
            .get(&(ns_key(rt, ns), name.to_string()))
    }

    pub fn list(&self, rt: &ResourceType, ns: Option<&str>) -> (Vec<Value>, u64) {
        let page = self.page(rt, ns, None, None, None, |_| true);
        (page.items, page.rv)
    }

    pub fn list_page(
        &mut self,
        rt: &ResourceType,
        ns: Option<&str>,
        after: Option<(&str, &str)>,
        limit: Option<usize>,
        index: Option<&IndexKey>,
        pred: impl Fn(&Value) -> bool,
    ) -> ListPage {
        let Some(key) = index else {
            return self.page(rt, ns, after, limit, None, pred);
        };
        self.ensure_index(rt, key);
        let empty = BTreeSet::new();
        let keys = self
            .st
            .indexes
            .get(rt)
            .and_then(|l| {
                l.iter()
                    .find(|(a, _)| a.same_attribute(key))
                    .and_then(|(_, m)| m.get(key.value()))
            })
            .unwrap_or(&empty);
        self.page(rt, ns, after, limit, Some(keys), pred)
    }

    /// A page of `rt` in key order, read from `keys` (an index's) or from every object.
    fn page(
        &self,
        rt: &ResourceType,
        ns: Option<&str>,
        after: Option<(&str, &str)>,
        limit: Option<usize>,
        keys: Option<&BTreeSet<Key>>,
        pred: impl Fn(&Value) -> bool,
    ) -> ListPage {
        let rv = self.st.rv;
        let Some(map) = self.st.objects.get(rt) else {
            return ListPage {
                items: Vec::new(),
                rv,
                next: None,
            };
        };
        let lower = match after {
            Some((a_ns, a_name)) => Bound::Excluded((a_ns.to_string(), a_name.to_string())),
            None => match ns {
                Some(n) if rt.namespaced => Bound::Included((n.to_string(), String::new())),
                _ => Bound::Unbounded,
            },
        };
        let ns_filter = if rt.namespaced { ns } else { None };
        let limit = limit.filter(|l| *l > 0).unwrap_or(usize::MAX);
        let candidates: Box<dyn Iterator<Item = (&Key, &Value)>> = match keys {
            Some(keys) => Box::new(
                keys.range((lower, Bound::Unbounded))
                    .filter_map(|k| map.get_key_value(k)),
            ),
            None => Box::new(map.range((lower, Bound::Unbounded))),
        };
        let mut items = Vec::new();
        let mut next = None;
        for ((k_ns, _), obj) in candidates {
            if let Some(n) = ns_filter
                && k_ns != n
            {
                break;
            }
            if !pred(obj) {
                continue;
            }
            if items.len() == limit {
                // There is at least one more match: the client continues after the last one sent.
                next = self.last_key(&items);
                break;
            }
            items.push(obj.clone());
        }
        ListPage { items, rv, next }
    }

    /// Builds the list index for `key`'s attribute on `rt` if there is none yet.
    fn ensure_index(&mut self, rt: &ResourceType, key: &IndexKey) {
        let st = &mut *self.st;
        let list = st.indexes.entry(*rt).or_default();
        if list.iter().any(|(a, _)| a.same_attribute(key)) {
            return;
        }
        let attr = key.with_value(String::new());
        let mut by_value = ByValue::new();
        for (k, obj) in st.objects.get(rt).into_iter().flatten() {
            if let Some(v) = attr.value_in(obj) {
                by_value.entry(v).or_default().insert(k.clone());
            }
        }
        list.push((attr, by_value));
    }

    /// Keeps `rt`'s list indexes up to date as the object at `key` goes from `old` to
    /// `new` (either absent).
    fn reindex(&mut self, rt: &ResourceType, key: &Key, old: Option<&Value>, new: Option<&Value>) {
        let Some(list) = self.st.indexes.get_mut(rt) else {
            return;
        };
        for (attr, by_value) in list.iter_mut() {
            let was = old.and_then(|o| attr.value_in(o));
            let is = new.and_then(|o| attr.value_in(o));
            if was == is {
                continue;
            }
            if let Some(v) = was
                && let Some(set) = by_value.get_mut(&v)
            {
                set.remove(key);
                if set.is_empty() {
                    by_value.remove(&v);
                }
            }
            if let Some(v) = is {
                by_value.entry(v).or_default().insert(key.clone());
            }
        }
    }

    fn last_key(&self, items: &[Value]) -> Option<(String, String)> {
        let last = items.last()?;
        Some((
            meta_str(last, "namespace").unwrap_or_default().to_string(),
            meta_str(last, "name").unwrap_or_default().to_string(),
        ))
    }

    pub fn create(
        &mut self,
        rt: &ResourceType,
        ns: Option<&str>,
        mut obj: Value,
    ) -> Result<Value, ApiError> {
        check_type(rt, &obj)?;
        let Some(map) = obj.as_object_mut() else {
            return Err(ApiError::bad_request(
                "the request body must be a JSON object",
            ));
        };
        map.insert("apiVersion".into(), json!(rt.api_version()));
        map.insert("kind".into(), json!(rt.kind));
        let meta = map.entry("metadata").or_insert_with(|| json!({}));
        if !meta.is_object() {
            *meta = json!({});
        }
        let ns = if rt.namespaced {
            let body_ns = meta_str(&obj, "namespace").filter(|s| !s.is_empty());
            match (ns, body_ns) {
                (Some(a), Some(b)) if a != b => {
                    return Err(ApiError::bad_request(
                        "the namespace of the provided object does not match the namespace sent on the request",
                    ));
                }
                (Some(a), _) => Some(a.to_string()),
                (None, Some(b)) => Some(b.to_string()),
                (None, None) => Some("default".to_string()),
            }
        } else {
            None
        };
        let name = match meta_str(&obj, "name").filter(|s| !s.is_empty()) {
            Some(n) => n.to_string(),
            None => match meta_str(&obj, "generateName").filter(|s| !s.is_empty()) {
                Some(prefix) => self.generate_name(rt, ns.as_deref(), prefix),
                None => {
                    return Err(ApiError::invalid(
                        &rt.qualified_kind(),
                        "",
                        "metadata.name: Required value: name or generateName is required",
                    ));
                }
            },
        };
        validate_name(rt, &name)?;
        if self.get_ref(rt, ns.as_deref(), &name).is_some() {
            return Err(ApiError::already_exists(&rt.qualified_plural(), &name));
        }
        let meta = meta_mut(&mut obj);
        meta.insert("name".into(), json!(name));
        match &ns {
            Some(n) => meta.insert("namespace".into(), json!(n)),
            None => meta.remove("namespace"),
        };
        meta.insert("uid".into(), json!(new_uid()));
        meta.insert("creationTimestamp".into(), json!(now_rfc3339()));
        meta.insert("generation".into(), json!(1));
        meta.remove("deletionTimestamp");
        meta.remove("deletionGracePeriodSeconds");
        meta.remove("resourceVersion");
        if *rt == PODS {
            // Admission, then the pod strategy: every pod starts Pending, whatever the body says.
            validation::default_toleration_seconds(&mut obj);
            obj["status"] = json!({ "phase": "Pending" });
        } else if rt.has_status_subresource() && *rt != NODES {
            // PDBs and custom resources with a status subresource start without status;
            // a Node keeps the status its kubelet registers it with.
            if let Some(map) = obj.as_object_mut() {
                map.remove("status");
            }
        }
        validation::check(rt, &name, validation::on_create(rt, &obj))?;
        Ok(self.put(rt, ns, name, obj, None))
    }

    fn generate_name(&self, rt: &ResourceType, ns: Option<&str>, prefix: &str) -> String {
        const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
        loop {
            let suffix: String = (0..5)
                .map(|_| ALPHABET[rand::random_range(0..ALPHABET.len())] as char)
                .collect();
            let name = format!("{prefix}{suffix}");
            if self.get_ref(rt, ns, &name).is_none() {
                return name;
            }
        }
    }

    pub fn replace(
        &mut self,
        rt: &ResourceType,
        ns: Option<&str>,
        name: &str,
        obj: Value,
    ) -> Result<Value, ApiError> {
        self.replace_part(rt, ns, name, obj, Part::Main)
    }

    /// A PUT on the main resource or on `/status`.
    pub fn replace_part(
        &mut self,
        rt: &ResourceType,
        ns: Option<&str>,
        name: &str,
        mut obj: Value,
        part: Part,
    ) -> Result<Value, ApiError> {
        check_type(rt, &obj)?;
        if !obj.is_object() {
            return Err(ApiError::bad_request(
                "the request body must be a JSON object",
            ));
        }
        let body_name = meta_str(&obj, "name").unwrap_or_default();
        if body_name != name {
            return Err(ApiError::bad_request(&format!(
                "the name of the object ({body_name}) does not match the name on the URL ({name})"
            )));
        }
        if rt.namespaced
            && let (Some(n), Some(b)) = (ns, meta_str(&obj, "namespace").filter(|s| !s.is_empty()))
            && n != b
        {
            return Err(ApiError::bad_request(
                "the namespace of the provided object does not match the namespace sent on the request",
            ));
        }
        let Some(old) = self.get(rt, ns, name) else {
            return Err(ApiError::not_found(&rt.qualified_plural(), name));
        };
        let current_rv = meta_str(&old, "resourceVersion")
            .unwrap_or_default()
            .to_string();
        let body_rv = meta_str(&obj, "resourceVersion").filter(|s| !s.is_empty());
        if body_rv.is_none() && rt.is_custom() {
            // Custom resources allow no unconditional update (AllowUnconditionalUpdate is
            // false in the CRD registry's strategy).
            return Err(ApiError::invalid_list(
                &rt.qualified_plural(),
                name,
                &[
                    "metadata.resourceVersion: Invalid value: 0: must be specified for an update"
                        .to_string(),
                ],
            ));
        }
        if let Some(body_rv) = body_rv
            && body_rv != current_rv
        {
            return Err(stale(rt, name));
        }
        let old_uid = meta_str(&old, "uid").unwrap_or_default().to_string();
        if let Some(body_uid) = meta_str(&obj, "uid").filter(|s| !s.is_empty())
            && body_uid != old_uid
        {
            return Err(ApiError::conflict(
                &rt.qualified_plural(),
                name,
                &format!(
                    "Precondition failed: UID in precondition: {body_uid}, UID in object meta: {old_uid}"
                ),
            ));
        }
        if meta_str(&old, "deletionTimestamp").is_some() {
            let old_f = finalizers(&old);
            if finalizers(&obj).iter().any(|f| !old_f.contains(f)) {
                return Err(ApiError::invalid(
                    &rt.qualified_kind(),
                    name,
                    "metadata.finalizers: Forbidden: no new finalizers can be added if the object is being deleted",
                ));
            }
        }
        // Fields the server owns keep their stored values, as on a real PUT.
        {
            let map = obj
                .as_object_mut()
                .ok_or_else(|| ApiError::internal("object"))?;
            map.insert("apiVersion".into(), json!(rt.api_version()));
            map.insert("kind".into(), json!(rt.kind));
        }
        keep_server_meta(
            &old,
            &mut obj,
            &[
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "generation",
                "namespace",
                "resourceVersion",
            ],
        );
        self.finish_update(rt, ns, name, old, obj, part)
    }

    pub fn modify<F>(
        &mut self,
        rt: &ResourceType,
        ns: Option<&str>,
        name: &str,
        f: F,
    ) -> Result<Value, ApiError>
    where
        F: FnOnce(&mut Value) -> Result<(), ApiError>,
    {
        self.modify_part(rt, ns, name, f, Part::Main)
    }

    /// A read-modify-write (PATCH) of the main resource or of `/status`.
    pub fn modify_part<F>(
        &mut self,
        rt: &ResourceType,
        ns: Option<&str>,
        name: &str,
        f: F,
        part: Part,
    ) -> Result<Value, ApiError>
    where
        F: FnOnce(&mut Value) -> Result<(), ApiError>,
    {
        let Some(old) = self.get(rt, ns, name) else {
            return Err(ApiError::not_found(&rt.qualified_plural(), name));
        };
        let mut obj = old.clone();
        f(&mut obj)?;
        if !obj.is_object() {
            return Err(ApiError::bad_request("the object must be a JSON object"));
        }
        let current_rv = meta_str(&old, "resourceVersion")
            .unwrap_or_default()
            .to_string();
        if let Some(new_rv) = meta_str(&obj, "resourceVersion").filter(|s| !s.is_empty())
            && new_rv != current_rv
        {
            return Err(stale(rt, name));
        }
        let old_uid = meta_str(&old, "uid").unwrap_or_default().to_string();
        let new_uid = meta_str(&obj, "uid").unwrap_or_default().to_string();
        if new_uid != old_uid {
            return Err(ApiError::invalid(
                &rt.qualified_kind(),
                name,
                &format!("metadata.uid: Invalid value: {new_uid:?}: field is immutable"),
            ));
        }
        if meta_str(&obj, "name") != Some(name) {
            return Err(ApiError::invalid(
                &rt.qualified_kind(),
                name,
                "metadata.name: Invalid value: field is immutable",
            ));
        }
        if let Some(map) = obj.as_object_mut() {
            map.insert("apiVersion".into(), json!(rt.api_version()));
            map.insert("kind".into(), json!(rt.kind));
        }
        keep_server_meta(
            &old,
            &mut obj,
            &[
                "creationTimestamp",
                "namespace",
                "resourceVersion",
                "generation",
            ],
        );
        self.finish_update(rt, ns, name, old, obj, part)
    }

    /// Binds a pending pod to `node` (the `pods/binding` subresource).
    pub fn bind(
        &mut self,
        ns: &str,
        name: &str,
        uid: Option<&str>,
        node: &str,
    ) -> Result<Value, ApiError> {
        let Some(old) = self.get(&PODS, Some(ns), name) else {
            return Err(ApiError::not_found("pods", name));
        };
        if let Some(uid) = uid
            && meta_str(&old, "uid") != Some(uid)
        {
            return Err(ApiError::not_found("pods", name));
        }
        if meta_str(&old, "deletionTimestamp").is_some() {
            return Err(ApiError::conflict(
                "pods",
                name,
                "pod is being deleted, cannot be assigned to a host",
            ));
        }
        if let Some(bound) = old
            .pointer("/spec/nodeName")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
        {
            return Err(ApiError::conflict(
                "pods",
                name,
                &format!("pod {name} is already assigned to node {bound:?}"),
            ));
        }
        let mut obj = old.clone();
        let Some(map) = obj.as_object_mut() else {
            return Err(ApiError::internal("stored pod is not an object"));
        };
        let spec = map.entry("spec").or_insert_with(|| json!({}));
        if let Some(spec) = spec.as_object_mut() {
            spec.insert("nodeName".into(), json!(node));
        }
        set_scheduled(&mut obj);
        Ok(self.put(
            &PODS,
            Some(ns.to_string()),
            name.to_string(),
            obj,
            Some(old),
        ))
    }

    /// Commits an update whose server-owned fields are already settled: applies the
    /// main/status split, validates, then stores (or removes a finished deletion).
    fn finish_update(
        &mut self,
        rt: &ResourceType,
        ns: Option<&str>,
        name: &str,
        old: Value,
        mut obj: Value,
        part: Part,
    ) -> Result<Value, ApiError> {
        split_status(rt, &old, &mut obj, part);
        validation::check(
            rt,
            name,
            validation::on_update(rt, &old, &obj, part == Part::Main),
        )?;
        if obj == old {
            return Ok(old);
        }
        if spec_changed(rt, &old, &obj) {
            let g = old
                .pointer("/metadata/generation")
                .and_then(Value::as_i64)
                .unwrap_or(0);
            meta_mut(&mut obj).insert("generation".into(), json!(g + 1));
        }
        let key_ns = if rt.namespaced {
            ns.map(str::to_string)
        } else {
            None
        };
        if meta_str(&obj, "deletionTimestamp").is_some()
            && finalizers(&obj).is_empty()
            && !awaiting_grace(rt, &obj)
        {
            return Ok(self.drop_obj(rt, key_ns, name.to_string(), obj, old));
        }
        Ok(self.put(rt, key_ns, name.to_string(), obj, Some(old)))
    }

    /// Returns the object and whether it was removed (true) or kept terminating (false).
    pub fn delete(
        &mut self,
        rt: &ResourceType,
        ns: Option<&str>,
        name: &str,
        opts: &DeleteOptions,
    ) -> Result<(Value, bool), ApiError> {
        let Some(old) = self.get(rt, ns, name) else {
            return Err(ApiError::not_found(&rt.qualified_plural(), name));
        };
        let uid = meta_str(&old, "uid").unwrap_or_default();
        if let Some(p) = &opts.precondition_uid
            && p != uid
        {
            return Err(ApiError::conflict(
                &rt.qualified_plural(),
                name,
                &format!(
                    "the UID in the precondition ({p}) does not match the UID in record ({uid}). The object might have been deleted and then recreated"
                ),
            ));
        }
        let rv = meta_str(&old, "resourceVersion").unwrap_or_default();
        if let Some(p) = &opts.precondition_rv
            && p != rv
        {
            return Err(ApiError::conflict(
                &rt.qualified_plural(),
                name,
                &format!(
                    "the ResourceVersion in the precondition ({p}) does not match the ResourceVersion in record ({rv}). The object might have been modified"
                ),
            ));
        }
        let grace = effective_grace(rt, &old, opts.grace_period_seconds);
        let has_finalizers = !finalizers(&old).is_empty();
        let key_ns = if rt.namespaced {
            ns.map(str::to_string)
        } else {
            None
        };
        let already = meta_str(&old, "deletionTimestamp").is_some();
        if already {
            let current_grace = old
                .pointer("/metadata/deletionGracePeriodSeconds")
                .and_then(Value::as_i64)
                .unwrap_or(0);
            if grace == 0 && !has_finalizers {
                return Ok((
                    self.drop_obj(rt, key_ns, name.to_string(), old.clone(), old),
                    true,
                ));
            }
            if grace < current_grace {
                // A shorter grace period on a second delete moves the deadline closer.
                let mut obj = old.clone();
                set_deletion(&mut obj, grace);
                return Ok((
                    self.put(rt, key_ns, name.to_string(), obj, Some(old)),
                    false,
                ));
            }
            return Ok((old, false));
        }
        if grace > 0 || has_finalizers {
            let mut obj = old.clone();
            set_deletion(&mut obj, grace);
            return Ok((
                self.put(rt, key_ns, name.to_string(), obj, Some(old)),
                false,
            ));
        }
        Ok((
            self.drop_obj(rt, key_ns, name.to_string(), old.clone(), old),
            true,
        ))
    }

    pub fn remove(
        &mut self,
        rt: &ResourceType,
        ns: Option<&str>,
        name: &str,
    ) -> Result<Value, ApiError> {
        let Some(old) = self.get(rt, ns, name) else {
            return Err(ApiError::not_found(&rt.qualified_plural(), name));
        };
        let key_ns = if rt.namespaced {
            ns.map(str::to_string)
        } else {
            None
        };
        if finalizers(&old).is_empty() {
            return Ok(self.drop_obj(rt, key_ns, name.to_string(), old.clone(), old));
        }
        let mut obj = old.clone();
        if meta_str(&obj, "deletionTimestamp").is_none() {
            meta_mut(&mut obj).insert("deletionTimestamp".into(), json!(now_rfc3339()));
        }
        // The grace period is over: once the finalizers go, the object goes.
        meta_mut(&mut obj).insert("deletionGracePeriodSeconds".into(), json!(0));
        if obj == old {
            return Ok(old);
        }
        Ok(self.put(rt, key_ns, name.to_string(), obj, Some(old)))
    }

    /// Stores `obj` under a new resourceVersion and publishes ADDED/MODIFIED.
    fn put(
        &mut self,
        rt: &ResourceType,
        ns: Option<String>,
        name: String,
        mut obj: Value,
        old: Option<Value>,
    ) -> Value {
        self.st.rv += 1;
        let rv = self.st.rv;
        meta_mut(&mut obj).insert("resourceVersion".into(), json!(rv.to_string()));
        let kind = if old.is_some() {
            EventKind::Modified
        } else {
            EventKind::Added
        };
        let key = (ns.clone().unwrap_or_default(), name.clone());
        let previous = self
            .st
            .objects
            .entry(*rt)
            .or_default()
            .insert(key.clone(), obj.clone());
        self.reindex(rt, &key, previous.as_ref(), Some(&obj));
        self.publish(rv, rt, kind, ns, name, obj.clone(), old);
        obj
    }

    /// Removes the object under a new resourceVersion and publishes DELETED.
    fn drop_obj(
        &mut self,
        rt: &ResourceType,
        ns: Option<String>,
        name: String,
        mut obj: Value,
        old: Value,
    ) -> Value {
        self.st.rv += 1;
        let rv = self.st.rv;
        meta_mut(&mut obj).insert("resourceVersion".into(), json!(rv.to_string()));
        let key = (ns.clone().unwrap_or_default(), name.clone());
        let previous = self.st.objects.get_mut(rt).and_then(|map| map.remove(&key));
        self.reindex(rt, &key, previous.as_ref(), None);
        self.publish(rv, rt, EventKind::Deleted, ns, name, obj.clone(), Some(old));
        obj
    }

    #[allow(clippy::too_many_arguments)]
    fn publish(
        &mut self,
        rv: u64,
        rt: &ResourceType,
        kind: EventKind,
        namespace: Option<String>,
        name: String,
        object: Value,
        old: Option<Value>,
    ) {
        let ev = Arc::new(StoreEvent {
            rv,
            rt: *rt,
            kind,
            namespace,
            name,
            object,
            old,
            encoded: OnceLock::new(),
        });
        self.st.history.push_back(ev.clone());
        while self.st.history.len() > self.st.history_limit {
            self.st.history.pop_front();
        }
        // No receivers is normal (nobody watching).
        let _ = self.tx.send(ev);
    }
}

/// Sets `PodScheduled=True` (what a binding records), replacing an earlier
/// `PodScheduled` condition such as the scheduler's `False`/`Unschedulable`.
fn set_scheduled(pod: &mut Value) {
    let cond =
        json!({ "type": "PodScheduled", "status": "True", "lastTransitionTime": now_rfc3339() });
    let Some(map) = pod.as_object_mut() else {
        return;
    };
    let status = map.entry("status").or_insert_with(|| json!({}));
    if !status.is_object() {
        *status = json!({});
    }
    let Some(status) = status.as_object_mut() else {
        return;
    };
    let conds = status
        .entry("conditions")
        .or_insert_with(|| Value::Array(Vec::new()));
    if !conds.is_array() {
        *conds = Value::Array(Vec::new());
    }
    if let Value::Array(list) = conds {
        list.retain(|c| c.get("type").and_then(Value::as_str) != Some("PodScheduled"));
        list.push(cond);
    }
}

/// Applies the main/status split of a type with a status subresource: a main write keeps
/// the stored status; a status write keeps the stored spec (and, for pods, the owner
/// references) or, for a custom resource, everything but the status.
fn split_status(rt: &ResourceType, old: &Value, obj: &mut Value, part: Part) {
    if !rt.has_status_subresource() {
        return;
    }
    let take = |from: &Value, to: &mut Value, key: &str| {
        if let Some(map) = to.as_object_mut() {
            match from.get(key) {
                Some(v) => map.insert(key.to_string(), v.clone()),
                None => map.remove(key),
            };
        }
    };
    match part {
        Part::Main => take(old, obj, "status"),
        Part::Status if rt.is_custom() => {
            let mut kept = old.clone();
            take(obj, &mut kept, "status");
            *obj = kept;
        }
        Part::Status => {
            take(old, obj, "spec");
            if *rt == PODS {
                let refs = old.pointer("/metadata/ownerReferences").cloned();
                let meta = meta_mut(obj);
                match refs {
                    Some(r) => meta.insert("ownerReferences".into(), r),
                    None => meta.remove("ownerReferences"),
                };
            }
        }
    }
}

/// 409 for a write based on an old resourceVersion, worded as the real server does.
fn stale(rt: &ResourceType, name: &str) -> ApiError {
    ApiError::conflict(
        &rt.qualified_plural(),
        name,
        "the object has been modified; please apply your changes to the latest version and try again",
    )
}

/// 400 when the body names another type, as the real decoder does.
fn check_type(rt: &ResourceType, obj: &Value) -> Result<(), ApiError> {
    if let Some(kind) = obj.get("kind").and_then(Value::as_str)
        && !kind.is_empty()
        && kind != rt.kind
    {
        return Err(ApiError::bad_request(&format!(
            "the kind in the body ({kind}) does not match the expected kind ({})",
            rt.kind
        )));
    }
    if let Some(av) = obj.get("apiVersion").and_then(Value::as_str)
        && !av.is_empty()
        && av != rt.api_version()
    {
        return Err(ApiError::bad_request(&format!(
            "the API version in the data ({av}) does not match the expected API version ({})",
            rt.api_version()
        )));
    }
    Ok(())
}

/// Names must be DNS subdomains (lower-case alphanumerics, `-` and `.`), at most 253 chars.
fn validate_name(rt: &ResourceType, name: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && name
            .as_bytes()
            .first()
            .is_some_and(u8::is_ascii_alphanumeric)
        && name
            .as_bytes()
            .last()
            .is_some_and(u8::is_ascii_alphanumeric);
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(
            &rt.qualified_kind(),
            name,
            &format!(
                "metadata.name: Invalid value: {name:?}: a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"
            ),
        ))
    }
}

/// The grace period a delete gets: only pods bound to a node and not finished get one.
fn effective_grace(rt: &ResourceType, obj: &Value, requested: Option<i64>) -> i64 {
    if *rt != PODS {
        return 0;
    }
    let bound = obj
        .pointer("/spec/nodeName")
        .and_then(Value::as_str)
        .is_some_and(|n| !n.is_empty());
    let phase = obj
        .pointer("/status/phase")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if !bound || phase == "Succeeded" || phase == "Failed" {
        return 0;
    }
    let g = requested
        .or_else(|| {
            obj.pointer("/spec/terminationGracePeriodSeconds")
                .and_then(Value::as_i64)
        })
        .unwrap_or(DEFAULT_POD_GRACE_SECONDS);
    // A negative request means "as soon as possible" (the real server turns it into 1).
    if g < 0 { 1 } else { g }
}

/// A pod whose grace period is still running is removed by the kubelet, not by an update.
fn awaiting_grace(rt: &ResourceType, obj: &Value) -> bool {
    *rt == PODS
        && obj
            .pointer("/metadata/deletionGracePeriodSeconds")
            .and_then(Value::as_i64)
            .is_some_and(|g| g > 0)
}

/// Marks an object terminating: deletionTimestamp is the deadline (now + grace).
fn set_deletion(obj: &mut Value, grace: i64) {
    let deadline = k8s_openapi::jiff::Timestamp::now()
        .checked_add(k8s_openapi::jiff::SignedDuration::from_secs(grace))
        .unwrap_or_else(|_| k8s_openapi::jiff::Timestamp::now());
    let meta = meta_mut(obj);
    meta.insert("deletionTimestamp".into(), json!(format_ts(deadline)));
    meta.insert("deletionGracePeriodSeconds".into(), json!(grace));
}

/// Whether anything outside metadata (and status, where status is a subresource) changed.
fn spec_changed(rt: &ResourceType, old: &Value, new: &Value) -> bool {
    let skip = |k: &str| k == "metadata" || (k == "status" && !rt.status_bumps_generation());
    let empty = Map::new();
    let o = old.as_object().unwrap_or(&empty);
    let n = new.as_object().unwrap_or(&empty);
    o.iter().any(|(k, v)| !skip(k) && n.get(k) != Some(v))
        || n.keys().any(|k| !skip(k) && !o.contains_key(k))
}

/// `metadata.<field>` as a string.
pub fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    obj.get("metadata")?.get(field)?.as_str()
}

/// Copies the server-owned metadata `fields` from the stored object onto a write, so a
/// client can neither set nor clear them (absent before means absent after).
fn keep_server_meta(old: &Value, obj: &mut Value, fields: &[&str]) {
    let old_meta = old.get("metadata").cloned().unwrap_or_else(|| json!({}));
    let meta = meta_mut(obj);
    for field in fields {
        match old_meta.get(*field) {
            Some(v) => meta.insert((*field).into(), v.clone()),
            None => meta.remove(*field),
        };
    }
}

/// `metadata` as a mutable map, created if missing.
pub fn meta_mut(obj: &mut Value) -> &mut Map<String, Value> {
    if !obj.is_object() {
        *obj = json!({});
    }
    let map = obj.as_object_mut().expect("just made an object");
    let meta = map.entry("metadata").or_insert_with(|| json!({}));
    if !meta.is_object() {
        *meta = json!({});
    }
    meta.as_object_mut().expect("just made an object")
}

/// `metadata.finalizers`.
pub fn finalizers(obj: &Value) -> Vec<String> {
    obj.pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// A random RFC 4122 version-4 UID.
fn new_uid() -> String {
    let mut b: [u8; 16] = rand::random();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// A Kubernetes `metav1.Time` string (RFC 3339, whole seconds, UTC).
pub fn format_ts(ts: k8s_openapi::jiff::Timestamp) -> String {
    ts.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// Now as a `metav1.Time` string.
pub fn now_rfc3339() -> String {
    format_ts(k8s_openapi::jiff::Timestamp::now())
}

#[cfg(test)]
mod list_index_tests {
    use serde_json::json;

    use super::super::selectors::Selectors;
    use super::*;

    /// Names an indexed list returns, checked against a scan of every object.
    fn names(
        store: &Store,
        rt: &ResourceType,
        labels: Option<&str>,
        fields: Option<&str>,
    ) -> Vec<String> {
        let sel = Selectors::parse(rt, labels, fields).expect("selector");
        let index = sel.index_key();
        assert!(index.is_some(), "the selector must be indexable");
        let indexed = store.list_page(rt, Some("default"), None, None, index.as_ref(), |o| {
            sel.matches(o)
        });
        let scanned = store.list_page(rt, Some("default"), None, None, None, |o| sel.matches(o));
        assert_eq!(
            indexed.items, scanned.items,
            "indexed and scanned lists differ"
        );
        indexed
            .items
            .iter()
            .filter_map(|o| meta_str(o, "name").map(str::to_string))
            .collect()
    }

    fn pod(name: &str, node: &str, label: &str) -> Value {
        json!({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": "default", "labels": {"x": label}},
               "spec": {"nodeName": node, "containers": [{"name": "c", "image": "i"}]}})
    }

    #[test]
    fn a_list_index_follows_every_write() {
        let store = Store::new(100);
        let ns = Some("default");
        for (name, node, label) in [("a", "n1", "1"), ("b", "n2", "1"), ("c", "n1", "2")] {
            store
                .create(&PODS, ns, pod(name, node, label))
                .expect("create");
        }
        // Built by the first list, on objects that were there before it.
        assert_eq!(
            names(&store, &PODS, None, Some("spec.nodeName=n1")),
            ["a", "c"]
        );
        assert_eq!(names(&store, &PODS, Some("x=1"), None), ["a", "b"]);
        // Kept up to date: a relabel, a new object, a deletion.
        let mut c = store.get(&PODS, ns, "c").expect("c");
        c["metadata"]["labels"]["x"] = json!("1");
        store.replace(&PODS, ns, "c", c).expect("replace");
        store
            .create(&PODS, ns, pod("d", "n1", "3"))
            .expect("create d");
        store
            .delete(
                &PODS,
                ns,
                "a",
                &DeleteOptions {
                    grace_period_seconds: Some(0),
                    ..Default::default()
                },
            )
            .expect("delete");
        assert_eq!(
            names(&store, &PODS, None, Some("spec.nodeName=n1")),
            ["c", "d"]
        );
        assert_eq!(names(&store, &PODS, Some("x=1"), None), ["b", "c"]);
        assert_eq!(
            names(&store, &PODS, Some("x=2"), None),
            Vec::<String>::new()
        );
        // Paged: the continue key is the last one sent.
        let sel = Selectors::parse(&PODS, Some("x=1"), None).expect("selector");
        let page = store.list_page(&PODS, ns, None, Some(1), sel.index_key().as_ref(), |o| {
            sel.matches(o)
        });
        assert_eq!(page.items.len(), 1);
        assert_eq!(page.next, Some(("default".to_string(), "b".to_string())));
    }
}
