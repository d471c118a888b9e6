//! The Fleets that exist and their `spec.replicas`, from one watch on `fleets.agones.dev`.
//!
//! Why a watch and not a read per answer: a held answer must never go below the Fleet's
//! own `spec.replicas` (Agones writes the answer there), and a read that fails must not
//! fall back to a guess (`status.replicas` is spec plus the surge during a rolling update,
//! and short of spec during a scale-up). The watch keeps every Fleet's spec at hand with
//! no request per review, whatever names callers send, and says which Fleets exist, so
//! only those are tracked in the held-Fleet metrics. When the cache cannot be trusted (no
//! client, not listed yet, the watch failed and is listing again), a held answer is
//! [`FleetSize::Unknown`] and the webhook answers an error: Agones then leaves the Fleet as
//! it is, the one hold that guesses nothing.
//!
//! Memory is one `(namespace, name, replicas)` per Fleet of the cluster: bounded by the
//! cluster, not by callers.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::StreamExt;
use kube::Api;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::watcher;
use lastcall_common::backoff::Backoff;
use tokio_util::sync::CancellationToken;

use crate::metrics::{Metrics, WebhookMetrics};

/// Backoff between two lists after the watch failed.
const RELIST_BASE: Duration = Duration::from_secs(1);
const RELIST_MAX: Duration = Duration::from_secs(30);

/// The Fleet resource, `agones.dev/v1`.
pub fn fleet_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("agones.dev", "v1", "Fleet"),
        "fleets",
    )
}

/// What the cache says of one Fleet's size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FleetSize {
    /// It exists with this `spec.replicas`.
    Known(u32),
    /// The cache is current and has no such Fleet.
    Absent,
    /// The cache cannot say; the label says why (`no_client`, `not_listed`,
    /// `watch_failed`).
    Unknown(&'static str),
}

impl FleetSize {
    /// A fixed metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Known(_) => "known",
            Self::Absent => "absent",
            Self::Unknown(why) => why,
        }
    }
}

#[derive(Debug)]
struct State {
    fleets: HashMap<(String, String), u32>,
    /// `None` while the cache is current (listed, and the watch has not failed since).
    unknown: Option<&'static str>,
}

/// The Fleet cache. Cheap to clone.
#[derive(Clone, Debug)]
pub struct FleetCache {
    state: Arc<RwLock<State>>,
}

impl Default for FleetCache {
    fn default() -> Self {
        Self {
            state: Arc::new(RwLock::new(State {
                fleets: HashMap::new(),
                unknown: Some("no_client"),
            })),
        }
    }
}

impl FleetCache {
    /// Fleet `namespace/name`'s size, as far as the cache can say.
    pub fn size(&self, namespace: &str, name: &str) -> FleetSize {
        let state = self.state.read().unwrap_or_else(|p| p.into_inner());
        if let Some(why) = state.unknown {
            return FleetSize::Unknown(why);
        }
        match state.fleets.get(&(namespace.to_string(), name.to_string())) {
            Some(n) => FleetSize::Known(*n),
            None => FleetSize::Absent,
        }
    }

    /// Whether Fleet `namespace/name` is known to exist (false while the cache cannot say).
    pub fn exists(&self, namespace: &str, name: &str) -> bool {
        matches!(self.size(namespace, name), FleetSize::Known(_))
    }

    /// Fleets in the cache.
    pub fn len(&self) -> usize {
        self.state
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .fleets
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn set_unknown(&self, why: &'static str) {
        self.state
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .unknown = Some(why);
    }

    /// Keeps the cache from `client` until `shutdown`: lists every Fleet, then follows the
    /// changes; after any error the cache is unknown until a new list completes.
    pub async fn run(
        self,
        client: kube::Client,
        metrics: WebhookMetrics,
        shutdown: CancellationToken,
    ) {
        let mut backoff = Backoff::new(RELIST_BASE, RELIST_MAX);
        self.set_unknown("not_listed");
        loop {
            let api: Api<DynamicObject> = Api::all_with(client.clone(), &fleet_resource());
            let mut events = watcher(api, watcher::Config::default()).boxed();
            let mut listing: HashMap<(String, String), u32> = HashMap::new();
            let failed = loop {
                let event = tokio::select! {
                    () = shutdown.cancelled() => return,
                    e = events.next() => e,
                };
                match event {
                    None => break "the watch ended".to_string(),
                    Some(Err(e)) => break e.to_string(),
                    Some(Ok(watcher::Event::Init)) => listing.clear(),
                    Some(Ok(watcher::Event::InitApply(f))) => {
                        if let Some((key, n)) = size_of(&f) {
                            listing.insert(key, n);
                        }
                    }
                    Some(Ok(watcher::Event::InitDone)) => {
                        let mut state = self.state.write().unwrap_or_else(|p| p.into_inner());
                        state.fleets = std::mem::take(&mut listing);
                        if let Some(was) = state.unknown.take() {
                            tracing::info!(
                                message =
                                    "Fleets listed: held answers keep each Fleet's spec.replicas",
                                fleets = state.fleets.len(),
                                was
                            );
                        }
                        metrics.fleets_known.set(state.fleets.len() as i64);
                        Metrics::result(&metrics.fleet_lists, "ok");
                        backoff.reset();
                    }
                    Some(Ok(watcher::Event::Apply(f))) => {
                        if let Some((key, n)) = size_of(&f) {
                            let mut state = self.state.write().unwrap_or_else(|p| p.into_inner());
                            state.fleets.insert(key, n);
                            metrics.fleets_known.set(state.fleets.len() as i64);
                        }
                    }
                    Some(Ok(watcher::Event::Delete(f))) => {
                        if let Some((key, _)) = size_of(&f) {
                            let mut state = self.state.write().unwrap_or_else(|p| p.into_inner());
                            state.fleets.remove(&key);
                            metrics.fleets_known.set(state.fleets.len() as i64);
                        }
                    }
                }
            };
            // A watch that failed may have missed changes: not trusted until listed again.
            self.set_unknown("watch_failed");
            Metrics::result(&metrics.fleet_lists, "error");
            let delay = backoff.next_delay();
            tracing::warn!(
                message = "the Fleet watch failed: held answers are refused (Agones keeps each Fleet as it is) until Fleets are listed again",
                error = %lastcall_common::fleetiq::trim_for_log(&failed, 300),
                retry_in_ms = delay.as_millis() as u64,
                hint = "the chart grants list and watch on fleets.agones.dev; check RBAC and the API server",
            );
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(delay) => {}
            }
        }
    }
}

/// A Fleet's key and `spec.replicas` (0 when absent, as Go's zero value).
fn size_of(fleet: &DynamicObject) -> Option<((String, String), u32)> {
    let name = fleet.metadata.name.clone()?;
    let namespace = fleet.metadata.namespace.clone()?;
    let replicas = fleet
        .data
        .pointer("/spec/replicas")
        .and_then(serde_json::Value::as_u64)
        .and_then(|n| u32::try_from(n).ok())
        .unwrap_or(0);
    Some(((namespace, name), replicas))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_client_every_size_is_unknown() {
        let cache = FleetCache::default();
        assert_eq!(cache.size("ns", "f"), FleetSize::Unknown("no_client"));
        assert!(!cache.exists("ns", "f"));
        {
            let mut s = cache.state.write().unwrap();
            s.unknown = None;
            s.fleets.insert(("ns".into(), "f".into()), 7);
        }
        assert_eq!(cache.size("ns", "f"), FleetSize::Known(7));
        assert_eq!(cache.size("ns", "g"), FleetSize::Absent);
        cache.set_unknown("watch_failed");
        assert_eq!(cache.size("ns", "f"), FleetSize::Unknown("watch_failed"));
    }
}
