//! The controller against an API server over HTTP, as Agones' controller runs: the box's
//! real kube-apiserver (or the emulator's, which serves the same API). [`Controller`] keeps
//! one namespace: it watches that namespace's GameServers and pods and runs a pass on every
//! change, and once a second regardless, each pass on a fresh LIST (level-triggered, as the
//! emulator's model loop).

use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use kube::runtime::watcher;
use serde_json::Value;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{AgonesApi, ApiFailure, Pass, Snapshot};
use crate::cluster::allocator::gameserver_resource;

/// How often a pass runs even when nothing changed (an informer's resync).
const RESYNC: Duration = Duration::from_secs(1);

/// [`AgonesApi`] over HTTP for one namespace.
#[derive(Clone)]
pub struct HttpApi {
    ns: String,
    game_servers: Api<DynamicObject>,
    pods: Api<Pod>,
    nodes: Api<Node>,
}

impl HttpApi {
    /// The controller's view of namespace `ns`, writing as `client`'s user.
    pub fn new(client: &kube::Client, ns: &str) -> HttpApi {
        HttpApi {
            ns: ns.to_string(),
            game_servers: Api::namespaced_with(client.clone(), ns, &gameserver_resource()),
            pods: Api::namespaced(client.clone(), ns),
            nodes: Api::all(client.clone()),
        }
    }
}

fn failure(e: kube::Error) -> ApiFailure {
    match e {
        kube::Error::Api(s) => ApiFailure {
            code: s.code,
            message: s.message.clone(),
        },
        other => ApiFailure {
            code: 0,
            message: other.to_string(),
        },
    }
}

fn to_value<T: serde::Serialize>(items: Vec<T>) -> Vec<Value> {
    items
        .into_iter()
        .filter_map(|o| serde_json::to_value(o).ok())
        .collect()
}

impl AgonesApi for HttpApi {
    async fn read(&self) -> Result<Snapshot, ApiFailure> {
        let lp = ListParams::default();
        // Agones' pod informer sees game-server pods only.
        let pods_lp = ListParams::default().labels("agones.dev/role=gameserver");
        let (gs, pods, nodes) = tokio::try_join!(
            self.game_servers.list(&lp),
            self.pods.list(&pods_lp),
            self.nodes.list(&lp),
        )
        .map_err(failure)?;
        Ok(Snapshot {
            game_servers: to_value(gs.items),
            pods: to_value(pods.items),
            nodes: to_value(nodes.items),
        })
    }

    async fn create_pod(&self, ns: &str, pod: Value) -> Result<(), ApiFailure> {
        debug_assert_eq!(ns, self.ns);
        let pod: Pod = serde_json::from_value(pod).map_err(|e| ApiFailure {
            code: 422,
            message: e.to_string(),
        })?;
        self.pods
            .create(&PostParams::default(), &pod)
            .await
            .map(drop)
            .map_err(failure)
    }

    async fn update_game_server(&self, gs: Value) -> Result<(), ApiFailure> {
        let obj: DynamicObject = serde_json::from_value(gs).map_err(|e| ApiFailure {
            code: 422,
            message: e.to_string(),
        })?;
        let name = obj.metadata.name.clone().unwrap_or_default();
        self.game_servers
            .replace(&name, &PostParams::default(), &obj)
            .await
            .map(drop)
            .map_err(failure)
    }

    async fn delete_game_server(&self, _ns: &str, name: &str) -> Result<(), ApiFailure> {
        self.game_servers
            .delete(name, &DeleteParams::background())
            .await
            .map(drop)
            .map_err(failure)
    }

    async fn delete_pod(&self, _ns: &str, name: &str) -> Result<(), ApiFailure> {
        self.pods
            .delete(name, &DeleteParams::default())
            .await
            .map(drop)
            .map_err(failure)
    }
}

/// The GameServer controller for one namespace, running until dropped.
pub struct Controller {
    cancel: CancellationToken,
    passes: watch::Receiver<u64>,
}

impl Drop for Controller {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

impl Controller {
    /// Starts the controller for namespace `ns`, writing as `client`'s user.
    pub fn spawn(client: &kube::Client, ns: &str) -> Controller {
        let cancel = CancellationToken::new();
        let (tx, passes) = watch::channel(0);
        let api = HttpApi::new(client, ns);
        tokio::spawn(run(api, tx, cancel.clone()));
        Controller { cancel, passes }
    }

    /// Passes completed so far.
    pub fn passes(&self) -> u64 {
        *self.passes.borrow()
    }
}

async fn run(api: HttpApi, passes: watch::Sender<u64>, cancel: CancellationToken) {
    let changes = futures::stream::select(
        watcher::watcher(api.game_servers.clone(), watcher::Config::default())
            .map(|_| ())
            .boxed(),
        watcher::watcher(
            api.pods.clone(),
            watcher::Config::default().labels("agones.dev/role=gameserver"),
        )
        .map(|_| ())
        .boxed(),
    );
    let mut changes = changes.boxed();
    let mut tick = tokio::time::interval(RESYNC);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        // Until a pass finds nothing to do: each write is the next pass's input.
        loop {
            let pass = tokio::select! {
                _ = cancel.cancelled() => return,
                p = super::sync(&api) => p,
            };
            passes.send_modify(|n| *n += 1);
            match pass {
                Ok(Pass { wrote: 0, .. }) => break,
                Ok(_) => continue,
                Err(e) => {
                    tracing::debug!(error = %e, "Agones controller could not read; trying again at the next change");
                    break;
                }
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = changes.next() => {}
            _ = tick.tick() => {}
        }
    }
}
