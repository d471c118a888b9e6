//! The Agones stand-in: the box has no Agones, so the tests play its part against the real
//! API server, and only the parts lastcall touches.
//!
//! Ours, not Agones': the `gameservers.agones.dev` CRD (a structural schema that keeps
//! unknown fields, no status subresource as in Agones, with or without the `selectableFields`
//! `.status.state` and `.status.nodeName` as Agones 1.58 and later declare them), the
//! `agones-gameserver-safe-to-evict-false` PDB of the Agones chart, a GameServer's pod (named
//! as the server, a controller ownerReference to it, Agones' labels), the state changes the
//! controller and SDK make (Scheduled with `status.nodeName`, Ready, Shutdown then a
//! uid-preconditioned DELETE), and the allocator's resourceVersion-preconditioned
//! Ready → Allocated update. Not modelled: Fleets, GameServerSets (no replacements), health
//! checks, ports, the `agones.dev/controller` finalizer (a deleted server goes at once and
//! the garbage collector deletes its pod), Reserved, and any Agones webhook.

use std::time::Duration;

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
    Preconditions,
};
use serde_json::{Value, json};

use crate::eventually::try_eventually;

pub const CRD_NAME: &str = "gameservers.agones.dev";
/// The label lastcall puts on servers of a draining node; an allocator excludes it.
pub const DRAINING_LABEL: &str = "lastcall.dev/node-draining";

/// Which Agones the CRD plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Crd {
    /// Agones 1.58 or later: `status.nodeName` is a selectable field.
    SelectableNodeName,
    /// An older Agones: labels only.
    LabelsOnly,
}

pub fn gameservers_resource() -> ApiResource {
    ApiResource {
        group: "agones.dev".into(),
        version: "v1".into(),
        api_version: "agones.dev/v1".into(),
        kind: "GameServer".into(),
        plural: "gameservers".into(),
    }
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

/// The Agones chart's PDB for `agones.dev/safe-to-evict=false` pods, in `ns`.
pub async fn ensure_pdb(client: &kube::Client, ns: &str) -> anyhow::Result<()> {
    let api: Api<k8s_openapi::api::policy::v1::PodDisruptionBudget> =
        Api::namespaced(client.clone(), ns);
    let pdb = serde_json::from_value(json!({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "agones-gameserver-safe-to-evict-false", "namespace": ns,
                     "labels": {"app": "agones"}},
        "spec": {"maxUnavailable": "0%",
                 "selector": {"matchLabels": {"agones.dev/safe-to-evict": "false"}}},
    }))?;
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

/// Agones' part for one namespace.
#[derive(Clone)]
pub struct Agones {
    pub ns: String,
    gs: Api<DynamicObject>,
    pods: Api<Pod>,
}

impl Agones {
    pub fn new(client: &kube::Client, ns: &str) -> Agones {
        Agones {
            ns: ns.to_string(),
            gs: Api::namespaced_with(client.clone(), ns, &gameservers_resource()),
            pods: Api::namespaced(client.clone(), ns),
        }
    }

    pub fn api(&self) -> &Api<DynamicObject> {
        &self.gs
    }

    /// Creates a GameServer and its pod (pinned to `node` by its hostname label: the test's
    /// isolation, where Agones would leave placement to the scheduler), waits until the real
    /// scheduler bound it and kwok runs it, and marks it Scheduled then Ready.
    pub async fn ready_server(&self, name: &str, node: &str) -> anyhow::Result<Server> {
        self.ready_server_evictable(name, node, "Never").await
    }

    /// [`Self::ready_server`] with `spec.eviction.safe` = `safe` (`Never`, `OnUpgrade`,
    /// `Always`): the pod's `agones.dev/safe-to-evict` label and autoscaler annotation say
    /// `"true"` only for `Always`, as Agones sets them, and the controller copies the value to
    /// `status.eviction.safe`.
    pub async fn ready_server_evictable(
        &self,
        name: &str,
        node: &str,
        safe: &str,
    ) -> anyhow::Result<Server> {
        let evictable = if safe == "Always" { "true" } else { "false" };
        let gs: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "agones.dev/v1",
            "kind": "GameServer",
            "metadata": {"name": name, "namespace": self.ns},
            "spec": {
                "container": "gameserver",
                "ports": [{"name": "default", "portPolicy": "Dynamic", "containerPort": 7654,
                           "protocol": "UDP"}],
                "eviction": {"safe": safe},
                "template": {"spec": {"containers": [{"name": "gameserver", "image": "gameserver"}]}},
            },
            "status": {"state": "Creating"},
        }))?;
        let gs = self.gs.create(&PostParams::default(), &gs).await?;
        let uid = gs
            .metadata
            .uid
            .clone()
            .context("created GameServer without a uid")?;
        let pod: Pod = serde_json::from_value(json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": self.ns,
                "labels": {"agones.dev/role": "gameserver", "agones.dev/gameserver": name,
                           "agones.dev/safe-to-evict": evictable},
                "annotations": {"agones.dev/container": "gameserver",
                                "cluster-autoscaler.kubernetes.io/safe-to-evict": evictable},
                "ownerReferences": [{"apiVersion": "agones.dev/v1", "kind": "GameServer",
                                     "name": name, "uid": uid, "controller": true,
                                     "blockOwnerDeletion": true}],
            },
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "terminationGracePeriodSeconds": 1,
                "containers": [{"name": "gameserver", "image": "gameserver"}],
            },
        }))?;
        self.pods.create(&PostParams::default(), &pod).await?;
        let pods = self.pods.clone();
        let ip = try_eventually(
            &format!("pod {name} scheduled onto {node} and running"),
            Duration::from_secs(60),
            Duration::from_millis(100),
            || async {
                let p = pods.get(name).await.ok()?;
                let bound = p.spec.as_ref()?.node_name.as_deref() == Some(node);
                let st = p.status?;
                (bound && st.phase.as_deref() == Some("Running")).then_some(st.pod_ip)?
            },
        )
        .await?;
        self.state(
            name,
            json!({"state": "Scheduled", "nodeName": node, "address": ip,
                   "eviction": {"safe": safe}}),
        )
        .await?;
        self.state(name, json!({"state": "Ready"})).await?;
        Ok(Server {
            namespace: self.ns.clone(),
            name: name.to_string(),
            uid,
        })
    }

    /// A merge patch of `status`, as the controller or the SDK sidecar writes it.
    pub async fn state(&self, name: &str, status: Value) -> anyhow::Result<()> {
        self.gs
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({ "status": status })),
            )
            .await?;
        Ok(())
    }

    /// The allocator's step for one server: read it and, if Ready and not being deleted,
    /// write Allocated with the resourceVersion it read (a changed server answers 409).
    pub async fn allocate(&self, name: &str) -> anyhow::Result<Allocation> {
        match self.gs.get_opt(name).await? {
            None => Ok(Allocation::Gone),
            Some(gs) => self.allocate_read(gs).await,
        }
    }

    /// The allocator's write for a server it read earlier (from its cache): Allocated, with
    /// the resourceVersion it read, so any write since makes it fail.
    pub async fn allocate_read(&self, mut gs: DynamicObject) -> anyhow::Result<Allocation> {
        let state = gs.data.pointer("/status/state").and_then(Value::as_str);
        if state != Some("Ready") || gs.metadata.deletion_timestamp.is_some() {
            return Ok(Allocation::NotReady);
        }
        let name = gs
            .metadata
            .name
            .clone()
            .context("a GameServer without a name")?;
        gs.data["status"]["state"] = json!("Allocated");
        match self.gs.replace(&name, &PostParams::default(), &gs).await {
            Ok(done) => Ok(Allocation::Allocated(
                done.metadata
                    .resource_version
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0),
            )),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(Allocation::Conflict),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(Allocation::Gone),
            Err(e) => Err(e.into()),
        }
    }

    /// Servers an allocator with lastcall's exclusion selector may pick: Ready, not being
    /// deleted, not labelled draining.
    pub async fn candidates(&self) -> anyhow::Result<Vec<DynamicObject>> {
        let lp = ListParams::default().labels(&format!("{DRAINING_LABEL}!=true"));
        Ok(self
            .gs
            .list(&lp)
            .await?
            .items
            .into_iter()
            .filter(|g| {
                g.metadata.deletion_timestamp.is_none()
                    && g.data.pointer("/status/state").and_then(Value::as_str) == Some("Ready")
            })
            .collect())
    }

    /// The match ends: the SDK's Shutdown, then the controller's uid-preconditioned DELETE.
    pub async fn shutdown(&self, s: &Server) -> anyhow::Result<()> {
        self.state(&s.name, json!({"state": "Shutdown"})).await?;
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(s.uid.clone()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        self.gs.delete(&s.name, &dp).await?;
        Ok(())
    }

    pub async fn get(&self, name: &str) -> anyhow::Result<Option<DynamicObject>> {
        Ok(self.gs.get_opt(name).await?)
    }

    /// Whether the pod of `name` is gone (deleted by the garbage collector, removed by kwok).
    pub async fn pod_gone(&self, name: &str) -> anyhow::Result<bool> {
        Ok(self.pods.get_opt(name).await?.is_none())
    }
}

/// What one allocation attempt got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Allocation {
    /// Written; the resourceVersion it produced.
    Allocated(u64),
    /// 409: the server changed since it was read.
    Conflict,
    /// Not Ready, or being deleted.
    NotReady,
    Gone,
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

/// The resourceVersion of each GameServer deletion in a namespace, from a watch the test
/// runs: a DELETE's answer is a bare `Status`, so the audit log cannot place it, but the
/// watch's DELETED event carries the object at the deletion's revision.
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
