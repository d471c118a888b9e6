//! Every version of the scene's pods and GameServers, in the order the API server applied
//! them (its resourceVersions: one etcd on the box, one store on the emulator, each a single
//! counter across kinds), from watches of the scene's namespace opened at its start. Writes
//! the journals do not hold (the emulator's cluster model writes its store directly; kwok's
//! and the controllers' pod writes) are placed against the agent's by this.
//!
//! The watches read only the scene's namespace; a watch that ends is resumed from the last
//! version it delivered, and one the server cannot resume (410) breaks the history loudly
//! rather than leave a gap.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, WatchEvent, WatchParams};
use serde_json::Value;

use crate::kube_box::agones::gameservers_resource;

/// One version of an object.
#[derive(Clone, Debug)]
pub struct Version {
    /// `pods` or `gameservers`.
    pub resource: &'static str,
    /// `ADDED`, `MODIFIED` or `DELETED`.
    pub event: &'static str,
    pub name: String,
    pub uid: String,
    pub rv: u64,
    pub object: Value,
}

impl Version {
    /// `status.state` of a GameServer, `status.phase` of a pod.
    pub fn state(&self) -> Option<&str> {
        self.object
            .pointer("/status/state")
            .or_else(|| self.object.pointer("/status/phase"))
            .and_then(Value::as_str)
    }

    pub fn terminating(&self) -> bool {
        self.object.pointer("/metadata/deletionTimestamp").is_some()
    }

    pub fn describe(&self) -> String {
        format!(
            "rv {} {} {}/{} ({}){}",
            self.rv,
            self.event,
            self.resource,
            self.name,
            self.state().unwrap_or("-"),
            if self.terminating() {
                " terminating"
            } else {
                ""
            }
        )
    }
}

#[derive(Default)]
struct Shared {
    versions: Vec<Version>,
    broken: Option<String>,
}

/// The scene's watches and what they delivered.
pub struct History {
    shared: Arc<Mutex<Shared>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for History {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl History {
    /// Opens the watches of `ns`'s pods and GameServers, each from a LIST's resourceVersion
    /// (what exists then is recorded as ADDED at its own version).
    pub async fn start(client: &kube::Client, ns: &str) -> anyhow::Result<History> {
        let shared = Arc::new(Mutex::new(Shared::default()));
        let mut tasks = vec![];
        let kinds: [(&'static str, ApiResource); 2] = [
            ("pods", ApiResource::erase::<Pod>(&())),
            ("gameservers", gameservers_resource()),
        ];
        for (resource, ar) in kinds {
            let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &ar);
            let list = api.list(&ListParams::default()).await?;
            let from = list.metadata.resource_version.clone().unwrap_or_default();
            {
                let mut s = lock(&shared);
                for o in list.items {
                    if let Some(v) = version(resource, "ADDED", &o) {
                        s.versions.push(v);
                    }
                }
            }
            tasks.push(tokio::spawn(follow(api, resource, from, shared.clone())));
        }
        Ok(History { shared, tasks })
    }

    /// Every version so far, in resourceVersion order.
    ///
    /// # Panics
    /// When a watch could not resume (a gap in the history).
    pub fn versions(&self) -> Vec<Version> {
        let s = lock(&self.shared);
        if let Some(e) = &s.broken {
            panic!("the scene's history has a gap: {e}");
        }
        let mut v = s.versions.clone();
        v.sort_by_key(|v| v.rv);
        v
    }

    /// The versions of `resource` `name`, in order.
    pub fn of(&self, resource: &str, name: &str) -> Vec<Version> {
        self.versions()
            .into_iter()
            .filter(|v| v.resource == resource && v.name == name)
            .collect()
    }

    /// The resourceVersion of the DELETED event of `resource` `name` with `uid`, once seen.
    pub fn deleted(&self, resource: &str, name: &str, uid: &str) -> Option<u64> {
        self.of(resource, name)
            .into_iter()
            .find(|v| v.event == "DELETED" && v.uid == uid)
            .map(|v| v.rv)
    }

    /// Waits until the watch of `resource` has delivered a version of `name` at or after
    /// resourceVersion `rv` (0: any version): every version of it up to there is then in the
    /// history (one watch delivers its kind's events in order).
    pub async fn reached(&self, resource: &str, name: &str, rv: u64) {
        crate::eventually::wait_for(
            &format!("the scene's history of {resource}/{name} at rv {rv}"),
            || async {
                self.of(resource, name)
                    .iter()
                    .any(|v| v.rv >= rv)
                    .then_some(())
            },
        )
        .await;
    }

    /// The version of `resource` `name` (uid `uid`) current at resourceVersion `rv`: the
    /// last one at or before it.
    pub fn at(&self, resource: &str, name: &str, uid: &str, rv: u64) -> Option<Version> {
        self.of(resource, name)
            .into_iter()
            .rfind(|v| v.uid == uid && v.rv <= rv)
    }
}

fn lock(s: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

fn version(resource: &'static str, event: &'static str, o: &DynamicObject) -> Option<Version> {
    Some(Version {
        resource,
        event,
        name: o.metadata.name.clone()?,
        uid: o.metadata.uid.clone().unwrap_or_default(),
        rv: o.metadata.resource_version.as_deref()?.parse().ok()?,
        object: serde_json::to_value(o).ok()?,
    })
}

async fn follow(
    api: Api<DynamicObject>,
    resource: &'static str,
    mut from: String,
    shared: Arc<Mutex<Shared>>,
) {
    loop {
        let wp = WatchParams::default().timeout(240);
        let mut stream = match api.watch(&wp, &from).await {
            Ok(s) => s.boxed(),
            Err(e) => {
                // The API server restarting, say: try again from the same version.
                tracing::debug!(resource, error = %e, "scene history watch could not open");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        while let Some(ev) = stream.next().await {
            let (event, obj) = match ev {
                Ok(WatchEvent::Added(o)) => ("ADDED", o),
                Ok(WatchEvent::Modified(o)) => ("MODIFIED", o),
                Ok(WatchEvent::Deleted(o)) => ("DELETED", o),
                Ok(WatchEvent::Bookmark(b)) => {
                    from = b.metadata.resource_version;
                    continue;
                }
                Ok(WatchEvent::Error(e)) => {
                    lock(&shared).broken = Some(format!("{resource}: {} {}", e.code, e.message));
                    return;
                }
                Err(_) => break,
            };
            if let Some(v) = version(resource, event, &obj) {
                from = v.rv.to_string();
                lock(&shared).versions.push(v);
            }
        }
    }
}
