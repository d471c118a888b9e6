//! The Agones allocator, over HTTP like the real one, on either backend
//! (`pkg/gameserverallocations/allocator.go`).
//!
//! It lists the GameServers the request's selectors match, keeps the Ready ones without a
//! deletionTimestamp, picks one in Packed order, and writes it back with a full update
//! (PUT) that carries the resourceVersion it read (`applyAllocationToGameServer`): state
//! `Allocated`, annotation `agones.dev/last-allocated`, and the request's labels and
//! annotations. A 409 means someone else changed that server (an allocation, a delete, a
//! label) since the read: Agones drops it from its cache and tries again
//! (`allocationUpdateWorkers`, `Retry`), a bounded number of times, then reports the
//! allocation `UnAllocated` (`Ok(None)`). Like the real allocator it never looks at nodes:
//! taints, cordon and maintenance labels do not stop an allocation. [`attempt`] is one such
//! write from a read the caller made earlier (the allocator's cache, a moment behind).

use std::collections::{BTreeMap, HashMap};

use kube::api::{Api, DynamicObject, ListParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::{Value, json};

use crate::kube::store::now_rfc3339;

use super::objects::{GameServerState, GameServerView, keys};

/// Default number of attempts before an allocation gives up as `UnAllocated`.
pub const DEFAULT_MAX_TRIES: u32 = 10;

/// What to allocate (a small `GameServerAllocation`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocationRequest {
    pub namespace: String,
    /// Only servers of this Fleet (`agones.dev/fleet=<fleet>`).
    pub fleet: Option<String>,
    /// A label selector in Kubernetes syntax (`a=b,c!=d,e in (f)`), applied by the API server.
    pub selector: Option<String>,
    /// Only servers whose `status.nodeName` is this node.
    pub node: Option<String>,
    /// Labels set on the allocated server (the allocation's `metadata` patch).
    pub labels: BTreeMap<String, String>,
    /// Annotations set on the allocated server.
    pub annotations: BTreeMap<String, String>,
    /// Attempts before giving up (at least 1).
    pub max_tries: u32,
}

impl AllocationRequest {
    /// Any Ready server in `namespace`.
    pub fn new(namespace: impl Into<String>) -> Self {
        AllocationRequest {
            namespace: namespace.into(),
            fleet: None,
            selector: None,
            node: None,
            labels: BTreeMap::new(),
            annotations: BTreeMap::new(),
            max_tries: DEFAULT_MAX_TRIES,
        }
    }

    /// A Ready server of `fleet` in `namespace`.
    pub fn fleet(namespace: impl Into<String>, fleet: impl Into<String>) -> Self {
        AllocationRequest {
            fleet: Some(fleet.into()),
            ..AllocationRequest::new(namespace)
        }
    }

    pub fn selector(mut self, selector: impl Into<String>) -> Self {
        self.selector = Some(selector.into());
        self
    }

    pub fn on_node(mut self, node: impl Into<String>) -> Self {
        self.node = Some(node.into());
        self
    }

    pub fn label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    pub fn annotation(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.annotations.insert(key.into(), value.into());
        self
    }

    pub fn max_tries(mut self, tries: u32) -> Self {
        self.max_tries = tries;
        self
    }

    /// The label selector sent with the list.
    fn list_selector(&self) -> Option<String> {
        let parts: Vec<String> = self
            .fleet
            .iter()
            .map(|f| format!("{}={f}", keys::FLEET_LABEL))
            .chain(self.selector.iter().filter(|s| !s.is_empty()).cloned())
            .collect();
        (!parts.is_empty()).then(|| parts.join(","))
    }
}

/// The `ApiResource` of `agones.dev/v1` GameServers for dynamic clients.
pub fn gameserver_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("agones.dev", "v1", "GameServer"),
        "gameservers",
    )
}

/// Allocates one Ready GameServer; `Ok(None)` is `UnAllocated` (none left, or every attempt
/// lost its race). Errors are transport or server errors other than 409/404.
pub async fn allocate(
    client: &kube::Client,
    req: &AllocationRequest,
) -> Result<Option<GameServerView>, kube::Error> {
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &req.namespace, &gameserver_resource());
    for n in 1..=req.max_tries.max(1) {
        let Some(chosen) = choose(read(&api, req).await?, req.node.as_deref()) else {
            return Ok(None);
        };
        let name = chosen.metadata.name.clone().unwrap_or_default();
        match attempt(&api, chosen, req).await? {
            Allocation::Allocated(obj) => {
                let raw = serde_json::to_value(&*obj).map_err(kube::Error::SerdeError)?;
                return Ok(GameServerView::parse(&raw).ok());
            }
            lost => {
                tracing::debug!(name, attempt = n, ?lost, "allocation lost a race; retrying");
            }
        }
    }
    Ok(None)
}

/// What one allocation attempt got.
#[derive(Clone, Debug, PartialEq)]
pub enum Allocation {
    /// Written: the server as the update left it.
    Allocated(Box<DynamicObject>),
    /// 409: the server changed since it was read.
    Conflict,
    /// Not Ready, or being deleted, in the read: nothing sent.
    NotReady,
    /// 404: the server is gone.
    Gone,
}

impl Allocation {
    /// The resourceVersion an accepted allocation produced.
    pub fn resource_version(&self) -> Option<u64> {
        match self {
            Allocation::Allocated(obj) => obj.metadata.resource_version.as_deref()?.parse().ok(),
            _ => None,
        }
    }
}

/// One allocation write for `read`, a server the allocator read earlier (from its cache):
/// if it was Ready and not being deleted then, a PUT of it Allocated (with the request's
/// labels and annotations) carrying the resourceVersion read, so any write since makes it
/// fail with 409.
pub async fn attempt(
    api: &Api<DynamicObject>,
    mut read: DynamicObject,
    req: &AllocationRequest,
) -> Result<Allocation, kube::Error> {
    let state = read.data.pointer("/status/state").and_then(Value::as_str);
    if state != Some(GameServerState::Ready.as_str()) || read.metadata.deletion_timestamp.is_some()
    {
        return Ok(Allocation::NotReady);
    }
    let name = read.metadata.name.clone().unwrap_or_default();
    mark_allocated(&mut read, req);
    match api.replace(&name, &PostParams::default(), &read).await {
        Ok(obj) => Ok(Allocation::Allocated(Box::new(obj))),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(Allocation::Conflict),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(Allocation::Gone),
        Err(e) => Err(e),
    }
}

/// The allocator's read: the GameServers the request's selectors match (what its cache
/// holds, when a caller keeps it a while).
pub async fn read(
    api: &Api<DynamicObject>,
    req: &AllocationRequest,
) -> Result<Vec<DynamicObject>, kube::Error> {
    let mut lp = ListParams::default();
    if let Some(sel) = req.list_selector() {
        lp = lp.labels(&sel);
    }
    Ok(api.list(&lp).await?.items)
}

/// The server to allocate from a read: Ready, not being deleted, on the requested node; in
/// Packed order (nodes with the most Allocated first, then the most Ready, then by name).
pub fn choose(read: Vec<DynamicObject>, node: Option<&str>) -> Option<DynamicObject> {
    let candidates: Vec<(GameServerView, DynamicObject)> = read
        .into_iter()
        .filter_map(|obj| {
            let raw = serde_json::to_value(&obj).ok()?;
            GameServerView::parse(&raw).ok().map(|v| (v, obj))
        })
        .collect();
    pick(candidates, node)
}

fn pick(
    candidates: Vec<(GameServerView, DynamicObject)>,
    node: Option<&str>,
) -> Option<DynamicObject> {
    let mut allocated: HashMap<String, usize> = HashMap::new();
    let mut ready: HashMap<String, usize> = HashMap::new();
    for (gs, _) in &candidates {
        let Some(n) = &gs.node else { continue };
        match gs.state {
            Some(GameServerState::Allocated) => *allocated.entry(n.clone()).or_default() += 1,
            Some(GameServerState::Ready) => *ready.entry(n.clone()).or_default() += 1,
            _ => {}
        }
    }
    candidates
        .into_iter()
        .filter(|(gs, _)| gs.state == Some(GameServerState::Ready) && !gs.deleting)
        .filter(|(gs, _)| node.is_none_or(|n| gs.node.as_deref() == Some(n)))
        .min_by_key(|(gs, _)| {
            let n = gs.node.clone().unwrap_or_default();
            let a = allocated.get(&n).copied().unwrap_or(0);
            let r = ready.get(&n).copied().unwrap_or(0);
            (
                std::cmp::Reverse(a),
                std::cmp::Reverse(r),
                n,
                gs.name.clone(),
            )
        })
        .map(|(_, obj)| obj)
}

fn mark_allocated(obj: &mut DynamicObject, req: &AllocationRequest) {
    if !obj.data.is_object() {
        obj.data = json!({});
    }
    let status = obj
        .data
        .as_object_mut()
        .map(|d| d.entry("status").or_insert_with(|| json!({})));
    if let Some(status) = status {
        if !status.is_object() {
            *status = json!({});
        }
        status["state"] = Value::from(GameServerState::Allocated.as_str());
    }
    let annotations = obj
        .metadata
        .annotations
        .get_or_insert_with(Default::default);
    annotations.insert(keys::LAST_ALLOCATED.into(), now_rfc3339());
    annotations.extend(req.annotations.clone());
    if !req.labels.is_empty() {
        obj.metadata
            .labels
            .get_or_insert_with(Default::default)
            .extend(req.labels.clone());
    }
}
