//! Agones on an API server with no Agones: the CRD, the chart's PDB, and the one Agones
//! model of the test kit (`lastcall_emulators::cluster::agones`: its GameServer controller,
//! its SDK rules, its allocator) driven over HTTP. On the box the controller runs here
//! ([`Agones::on_box`], [`Agones::new`]), as its own user; on the emulator the cluster model
//! runs the same controller on its store, and [`Agones::without_controller`] only plays the
//! game and the allocator there.
//!
//! Ours, not Agones': the `gameservers.agones.dev` CRD (a structural schema that keeps
//! unknown fields, no status subresource as in Agones, with or without the
//! `selectableFields` `.status.state` and `.status.nodeName` as Agones 1.58 and later
//! declare them). The Agones module cannot be fetched here (the Go module proxy refuses it),
//! so no Agones binary runs anywhere in the tests.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use crate::cluster::agones::over_http::Controller;
use crate::cluster::agones::sdk::{self, Call, Outcome};
use crate::cluster::allocator::{self, AllocationRequest};
use crate::cluster::{EvictionSafe, GameServerSpec};
use crate::eventually::try_eventually;

pub use crate::cluster::allocator::Allocation;

pub const CRD_NAME: &str = "gameservers.agones.dev";
/// The label lastcall puts on servers of a draining node; an allocator excludes it.
pub const DRAINING_LABEL: &str = "lastcall.dev/node-draining";
/// The grace period of the servers' pods ([`Agones::ready_server`]): a match ends within it.
pub const GRACE_SECONDS: i64 = 1;

/// Which Agones the CRD plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Crd {
    /// Agones 1.58 or later: `status.nodeName` is a selectable field.
    SelectableNodeName,
    /// An older Agones: labels only.
    LabelsOnly,
}

pub fn gameservers_resource() -> ApiResource {
    allocator::gameserver_resource()
}

fn crds_resource() -> ApiResource {
    ApiResource {
        group: "apiextensions.k8s.io".into(),
        version: "v1".into(),
        api_version: "apiextensions.k8s.io/v1".into(),
        kind: "CustomResourceDefinition".into(),
        plural: "customresourcedefinitions".into(),
    }
}

fn crd(variant: Crd) -> Value {
    let mut version = json!({
        "name": "v1",
        "served": true,
        "storage": true,
        "schema": {"openAPIV3Schema": {
            "type": "object",
            "properties": {
                "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
                "status": {
                    "type": "object",
                    "x-kubernetes-preserve-unknown-fields": true,
                    "properties": {
                        "state": {"type": "string"},
                        "nodeName": {"type": "string"},
                    },
                },
            },
        }},
    });
    if variant == Crd::SelectableNodeName {
        version["selectableFields"] =
            json!([{"jsonPath": ".status.state"}, {"jsonPath": ".status.nodeName"}]);
    }
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": "agones.dev",
            "scope": "Namespaced",
            "names": {"kind": "GameServer", "listKind": "GameServerList", "plural": "gameservers",
                      "singular": "gameserver", "shortNames": ["gs"]},
            "versions": [version],
        },
    })
}

/// Installs the GameServer CRD as `variant` (replacing the other one) and waits until the
/// API server answers a `status.nodeName` field selector accordingly, as the agent's probe
/// will ask it.
pub async fn install_crd(client: &kube::Client, variant: Crd) -> anyhow::Result<()> {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &crds_resource());
    let mut want: DynamicObject = serde_json::from_value(crd(variant))?;
    match api.get_opt(CRD_NAME).await? {
        None => {
            api.create(&PostParams::default(), &want).await?;
        }
        Some(have) => {
            want.metadata.resource_version = have.metadata.resource_version;
            api.replace(CRD_NAME, &PostParams::default(), &want).await?;
        }
    }
    let gs: Api<DynamicObject> = Api::all_with(client.clone(), &gameservers_resource());
    let probe = ListParams::default()
        .fields("status.nodeName=probe")
        .limit(1);
    try_eventually(
        "the GameServer CRD served as asked",
        Duration::from_secs(30),
        Duration::from_millis(100),
        || async {
            match (variant, gs.list_metadata(&probe).await) {
                (Crd::SelectableNodeName, Ok(_)) => Some(()),
                (Crd::LabelsOnly, Err(kube::Error::Api(s))) if s.code == 400 => Some(()),
                _ => None,
            }
        },
    )
    .await?;
    Ok(())
}

/// The Agones chart's PDB for `agones.dev/safe-to-evict=false` pods, in `ns` (the model's,
/// `lastcall_emulators::cluster::agones::agones_pdb`).
pub async fn ensure_pdb(client: &kube::Client, ns: &str) -> anyhow::Result<()> {
    let api: Api<k8s_openapi::api::policy::v1::PodDisruptionBudget> =
        Api::namespaced(client.clone(), ns);
    let pdb = serde_json::from_value(crate::cluster::agones::agones_pdb(ns))?;
    match api.create(&PostParams::default(), &pdb).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// A GameServer as the test knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Server {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// Who plays which part of Agones on the API server: the game's SDK (and the test's own
/// reads and writes), the allocator, and the controller (`None`: another one runs, the
/// emulator's cluster model).
#[derive(Clone)]
pub struct Users {
    pub sdk: kube::Client,
    pub allocator: kube::Client,
    pub controller: Option<kube::Client>,
}

/// Agones' part for one namespace.
#[derive(Clone)]
pub struct Agones {
    pub ns: String,
    gs: Api<DynamicObject>,
    pods: Api<Pod>,
    allocator: Api<DynamicObject>,
    controller: Option<Arc<Controller>>,
}

impl Agones {
    /// Every part played by `client`, the controller running in `ns` while a clone lives.
    pub fn new(client: &kube::Client, ns: &str) -> Agones {
        Agones::with(
            Users {
                sdk: client.clone(),
                allocator: client.clone(),
                controller: Some(client.clone()),
            },
            ns,
        )
    }

    /// On the box: each part as its own user ([`super::SDK_USER`], [`super::ALLOCATOR_USER`],
    /// [`super::AGONES_USER`]), so the audit log tells them apart.
    pub async fn on_box(kbox: &super::KubeBox, ns: &str) -> anyhow::Result<Agones> {
        Ok(Agones::with(
            Users {
                sdk: kbox.client_as(super::SDK_USER).await?,
                allocator: kbox.client_as(super::ALLOCATOR_USER).await?,
                controller: Some(kbox.client_as(super::AGONES_USER).await?),
            },
            ns,
        ))
    }

    /// The game and the allocator only: the controller is someone else's (the emulator's
    /// cluster model runs the same one on its store).
    pub fn without_controller(sdk: &kube::Client, allocator: &kube::Client, ns: &str) -> Agones {
        Agones::with(
            Users {
                sdk: sdk.clone(),
                allocator: allocator.clone(),
                controller: None,
            },
            ns,
        )
    }

    pub fn with(users: Users, ns: &str) -> Agones {
        Agones {
            ns: ns.to_string(),
            gs: Api::namespaced_with(users.sdk.clone(), ns, &gameservers_resource()),
            pods: Api::namespaced(users.sdk.clone(), ns),
            allocator: Api::namespaced_with(users.allocator, ns, &gameservers_resource()),
            controller: users
                .controller
                .map(|c| Arc::new(Controller::spawn(&c, ns))),
        }
    }

    pub fn api(&self) -> &Api<DynamicObject> {
        &self.gs
    }

    /// Creates the GameServer `spec` describes (in this namespace) and waits until the
    /// controller made it Ready.
    pub async fn ready(&self, spec: GameServerSpec) -> anyhow::Result<Server> {
        let s = self.create(spec).await?;
        self.wait_state(&s, "Ready").await?;
        Ok(s)
    }

    /// Creates the GameServer `spec` describes, in this namespace.
    pub async fn create(&self, spec: GameServerSpec) -> anyhow::Result<Server> {
        let obj: DynamicObject =
            serde_json::from_value(spec.namespace(self.ns.as_str()).to_object())?;
        let made = self.gs.create(&PostParams::default(), &obj).await?;
        Ok(Server {
            namespace: self.ns.clone(),
            name: made
                .metadata
                .name
                .clone()
                .context("a GameServer without a name")?,
            uid: made
                .metadata
                .uid
                .clone()
                .context("a GameServer without a uid")?,
        })
    }

    /// Waits until `s` (this uid) is in `state`.
    pub async fn wait_state(&self, s: &Server, state: &str) -> anyhow::Result<()> {
        try_eventually(
            &format!("GameServer {} {state}", s.name),
            Duration::from_secs(60),
            Duration::from_millis(50),
            || async {
                let gs = self.gs.get_opt(&s.name).await.ok()??;
                (gs.metadata.uid.as_deref() == Some(s.uid.as_str())
                    && gs.data.pointer("/status/state").and_then(Value::as_str) == Some(state))
                .then_some(())
            },
        )
        .await?;
        Ok(())
    }

    /// A Ready server on `node` whose pod has [`GRACE_SECONDS`] of grace, `eviction.safe:
    /// Never` (Agones' default).
    pub async fn ready_server(&self, name: &str, node: &str) -> anyhow::Result<Server> {
        self.ready_server_evictable(name, node, "Never").await
    }

    /// [`Self::ready_server`] with `spec.eviction.safe` = `safe` (`Never`, `OnUpgrade`,
    /// `Always`); the pod's eviction label and annotation are the model's.
    pub async fn ready_server_evictable(
        &self,
        name: &str,
        node: &str,
        safe: &str,
    ) -> anyhow::Result<Server> {
        let safe: EvictionSafe = safe.parse()?;
        self.ready(on_node(GameServerSpec::new(name), node).eviction_safe(safe))
            .await
    }

    /// The allocator's step for one server: read it and write it Allocated from that read.
    pub async fn allocate(&self, name: &str) -> anyhow::Result<Allocation> {
        match self.allocator.get_opt(name).await? {
            None => Ok(Allocation::Gone),
            Some(gs) => self.allocate_read(gs).await,
        }
    }

    /// The allocator's write for a server it read earlier (from its cache): Allocated, with
    /// the resourceVersion it read, so any write since makes it fail.
    pub async fn allocate_read(&self, gs: DynamicObject) -> anyhow::Result<Allocation> {
        let req = AllocationRequest::new(self.ns.as_str());
        Ok(allocator::attempt(&self.allocator, gs, &req).await?)
    }

    /// Servers an allocator with lastcall's exclusion selector may pick: its read by the
    /// selector `lastcall.dev/node-draining!=true`, Ready and not being deleted.
    pub async fn candidates(&self) -> anyhow::Result<Vec<DynamicObject>> {
        let req =
            AllocationRequest::new(self.ns.as_str()).selector(format!("{DRAINING_LABEL}!=true"));
        Ok(allocator::read(&self.allocator, &req)
            .await?
            .into_iter()
            .filter(|g| {
                g.metadata.deletion_timestamp.is_none()
                    && g.data.pointer("/status/state").and_then(Value::as_str) == Some("Ready")
            })
            .collect())
    }

    /// The game's SDK `call` on server `name`, as the SDK server writes it (a read, then an
    /// update with the resourceVersion read, again on a conflict).
    pub async fn sdk(&self, name: &str, call: Call) -> anyhow::Result<Outcome> {
        for _ in 0..10 {
            let gs = self.gs.get(name).await?;
            let mut obj = serde_json::to_value(&gs)?;
            let outcome = sdk::apply(call, &mut obj)?;
            if outcome == Outcome::Skipped {
                return Ok(outcome);
            }
            let next: DynamicObject = serde_json::from_value(obj)?;
            match self.gs.replace(name, &PostParams::default(), &next).await {
                Ok(_) => return Ok(outcome),
                Err(kube::Error::Api(s)) if s.code == 409 => continue,
                Err(e) => return Err(e.into()),
            }
        }
        bail!("SDK {}() on {name}: conflicts on every try", call.name())
    }

    /// The match ends: the game calls SDK `Shutdown()` and exits (its pod's containers end,
    /// as the kubelet reports it); the controller then deletes the server and its pod.
    pub async fn shutdown(&self, s: &Server) -> anyhow::Result<()> {
        self.sdk(&s.name, Call::Shutdown).await?;
        self.game_exit(&s.name).await
    }

    /// SDK `Reserve(0)`: held until allocated or shut down.
    pub async fn reserve(&self, s: &Server) -> anyhow::Result<()> {
        self.sdk(&s.name, Call::Reserve { seconds: 0 }).await?;
        Ok(())
    }

    /// The game in pod `name` exits: every container terminated, the pod `Succeeded`, as a
    /// kubelet reports it (`lastcall_emulators::cluster::kubelet::mark_exited`). A pod
    /// already gone is left so.
    pub async fn game_exit(&self, name: &str) -> anyhow::Result<()> {
        for _ in 0..10 {
            let Some(pod) = self.pods.get_opt(name).await? else {
                return Ok(());
            };
            let mut obj = serde_json::to_value(&pod)?;
            crate::cluster::kubelet::mark_exited(&mut obj);
            let next: Pod = serde_json::from_value(obj)?;
            match self
                .pods
                .replace_status(name, &PostParams::default(), &next)
                .await
            {
                Ok(_) => return Ok(()),
                Err(kube::Error::Api(s)) if s.code == 409 => continue,
                Err(kube::Error::Api(s)) if s.code == 404 => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        }
        bail!("the exit of {name}: conflicts on every try")
    }

    /// The operator (or a Fleet scaling down) deletes the GameServer: the controller then
    /// deletes its pod, which ends within its grace period, and lets the server go.
    pub async fn delete(&self, name: &str) -> anyhow::Result<()> {
        self.gs
            .delete(name, &kube::api::DeleteParams::default())
            .await?;
        Ok(())
    }

    /// A merge patch of the GameServer `name` (someone else's labels or annotations).
    pub async fn patch(&self, name: &str, patch: Value) -> anyhow::Result<()> {
        self.gs
            .patch(name, &PatchParams::default(), &Patch::Merge(patch))
            .await?;
        Ok(())
    }

    pub async fn get(&self, name: &str) -> anyhow::Result<Option<DynamicObject>> {
        Ok(self.gs.get_opt(name).await?)
    }

    /// Whether the pod of `name` is gone.
    pub async fn pod_gone(&self, name: &str) -> anyhow::Result<bool> {
        Ok(self.pods.get_opt(name).await?.is_none())
    }

    /// Passes the controller this client runs has made (0 without one).
    pub fn controller_passes(&self) -> u64 {
        self.controller.as_ref().map_or(0, |c| c.passes())
    }
}

/// `spec` with its pod pinned to `node` by the node's hostname label (the test's isolation,
/// where Agones would leave placement to the scheduler) and [`GRACE_SECONDS`] of grace.
pub fn on_node(spec: GameServerSpec, node: &str) -> GameServerSpec {
    spec.node_selector("kubernetes.io/hostname", node)
        .grace_seconds(GRACE_SECONDS)
}

/// Fails unless `s` still exists with `state`.
pub async fn expect_state(a: &Agones, s: &Server, state: &str) -> anyhow::Result<()> {
    let Some(gs) = a.get(&s.name).await? else {
        bail!("{} is gone", s.name);
    };
    let have = gs.data.pointer("/status/state").and_then(Value::as_str);
    if have != Some(state) || gs.metadata.uid.as_deref() != Some(s.uid.as_str()) {
        bail!(
            "{} is {:?} (uid {:?}), expected {state}",
            s.name,
            have,
            gs.metadata.uid
        );
    }
    Ok(())
}

/// Fails unless `s` (this uid) still exists and nobody began deleting it: a match ended by
/// its pod's eviction leaves its server Unhealthy (Agones' answer to a pod gone under a
/// live server), never deleted.
pub async fn expect_kept(a: &Agones, s: &Server) -> anyhow::Result<()> {
    let Some(gs) = a.get(&s.name).await? else {
        bail!("{} is gone", s.name);
    };
    if gs.metadata.uid.as_deref() != Some(s.uid.as_str())
        || gs.metadata.deletion_timestamp.is_some()
    {
        bail!(
            "{} was replaced or is being deleted: uid {:?}, deletionTimestamp {:?}",
            s.name,
            gs.metadata.uid,
            gs.metadata.deletion_timestamp
        );
    }
    Ok(())
}

/// The resourceVersion of each GameServer deletion in a namespace, from a watch the test
/// runs: a DELETE that removes a server at once answers with a bare `Status`, so the audit
/// log cannot place it, but the watch's DELETED event carries the object at the deletion's
/// revision.
pub struct Deletions {
    seen: std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<String, u64>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Deletions {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Deletions {
    /// Starts watching `ns`'s GameServers; waits until the watch is open, so no deletion
    /// after this returns is missed.
    pub async fn watch(client: &kube::Client, ns: &str) -> anyhow::Result<Deletions> {
        use futures::StreamExt;
        use kube::runtime::watcher::{self, Event};
        let api: Api<DynamicObject> =
            Api::namespaced_with(client.clone(), ns, &gameservers_resource());
        let seen = std::sync::Arc::new(std::sync::Mutex::new(std::collections::BTreeMap::new()));
        let (tx, rx) = tokio::sync::oneshot::channel();
        let task = {
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut tx = Some(tx);
                let mut stream = watcher::watcher(api, watcher::Config::default()).boxed();
                while let Some(ev) = stream.next().await {
                    match ev {
                        Ok(Event::InitDone) => {
                            if let Some(tx) = tx.take() {
                                let _ = tx.send(());
                            }
                        }
                        Ok(Event::Delete(obj)) => {
                            if let (Some(name), Some(rv)) = (
                                obj.metadata.name,
                                obj.metadata
                                    .resource_version
                                    .and_then(|v| v.parse::<u64>().ok()),
                            ) {
                                seen.lock()
                                    .unwrap_or_else(|e| e.into_inner())
                                    .insert(name, rv);
                            }
                        }
                        _ => {}
                    }
                }
            })
        };
        tokio::time::timeout(Duration::from_secs(30), rx)
            .await
            .context("the GameServer watch did not open")??;
        Ok(Deletions { seen, task })
    }

    /// The deletion revision of `name`, if its DELETED event has arrived.
    pub fn of(&self, name: &str) -> Option<u64> {
        self.seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .copied()
    }
}
