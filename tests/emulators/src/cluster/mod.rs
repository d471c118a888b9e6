//! The cluster model: what a real Kubernetes cluster with Agones does, on top of the
//! emulated API.
//!
//! [`Cluster`] starts an [`Emulator`] and a control-plane loop (see `model`) that watches
//! the store and acts on it the way the real components do: a scheduler that honours
//! cordon, taints and nodeSelector; the NoExecute taint manager; kubelets that end pods
//! after their grace period or when the game exits; the Agones GameServer and Fleet
//! controllers. The allocator goes over HTTP with a `kube::Client`, like the real one, so
//! tests can race allocations against lastcall. Two node autoscalers, Cluster Autoscaler
//! and Karpenter ([`autoscaler`]), are off unless a test creates one and asks it to take a
//! node; they too go over HTTP with their own identity. Tests drive the model through the methods
//! here (nodes, Fleets, SDK calls, game exits) and wait on its state with bounded waits.
//! `docs/testing/cluster-model.md` lists what is modelled and what is not.

pub mod agones;
pub mod allocator;
pub mod autoscaler;
pub mod fixtures;
pub mod fleet;
pub mod fleet_autoscaler;
pub mod kubelet;
mod model;
pub mod node_lifecycle;
pub mod objects;
pub mod preload;
pub mod scheduler;
pub mod taint_manager;
mod writes;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::Taint;
use serde_json::{Value, json};
use tokio::time::Instant;
use tokio_util::sync::DropGuard;

use crate::kube::resources::{FLEETS, GAMESERVERS, NODES, PODS};
use crate::kube::status::ApiError;
use crate::kube::store::Store;
use crate::kube::{DEFAULT_HISTORY, Emulator};

pub use allocator::AllocationRequest;
pub use fixtures::{
    FleetSpec, GameServerSpec, GameServerTemplate, NodeSpec, for_seconds, taint, toleration_equal,
    toleration_exists,
};
pub use objects::{EvictionSafe, GameServerState, GameServerView, keys};

use model::{ModelTask, Progress};
use writes::object_at;

/// Identity (bearer token) the allocator's requests carry in the emulator's journal.
pub const ALLOCATOR_IDENTITY: &str = "agones-allocator";

/// Default wait bound of the `wait_*` helpers.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(20);

/// How the cluster is set up.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// Game-server namespaces; each gets the Agones PDB (`gameservers.namespaces`).
    pub namespaces: Vec<String>,
    /// Watch events the API keeps for resumption.
    pub history_limit: usize,
    /// Timer resolution of the model (grace periods, `tolerationSeconds`).
    pub tick: Duration,
    /// Where the API listens.
    pub addr: SocketAddr,
    /// Run the node lifecycle controller's `node.kubernetes.io/unschedulable:NoSchedule`
    /// taint for cordoned nodes (on by default, as on every real cluster).
    pub node_lifecycle_taints: bool,
    /// How long the scheduler takes to bind a pod after deciding where it goes (zero by
    /// default: in the same pass). The bind does not re-check the node, so a pod decided on
    /// before a cordon lands after it, as with kube-scheduler's binding cycle.
    pub bind_lag: Duration,
    /// Agones 1.58 or later: the GameServer CRD selects by `status.nodeName` and
    /// `status.state` (off: an older Agones, labels only).
    pub agones_selectable_fields: bool,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            namespaces: vec!["default".to_string()],
            history_limit: DEFAULT_HISTORY,
            tick: Duration::from_millis(50),
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            node_lifecycle_taints: true,
            bind_lag: Duration::ZERO,
            agones_selectable_fields: false,
        }
    }
}

/// Why a cluster operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The API emulator did not start, or a client for it could not be built.
    #[error("starting the Kubernetes API emulator or a client for it")]
    Start(#[source] anyhow::Error),
    /// A write to the cluster state was refused.
    #[error("{action} {name:?}")]
    Api {
        action: &'static str,
        name: String,
        #[source]
        source: Box<ApiError>,
    },
    /// The allocator's HTTP calls failed (other than lost races).
    #[error("allocation request")]
    Allocate(#[source] kube::Error),
    /// An SDK call that Agones would not apply in the server's current state.
    #[error("SDK {call} on GameServer {name:?} in state {state:?}")]
    InvalidState {
        call: &'static str,
        name: String,
        state: Option<GameServerState>,
    },
    /// A bounded wait ended first.
    #[error("timed out after {within:?} waiting for {what}")]
    Timeout { what: String, within: Duration },
    /// A pass of the model panicked (a bug in the model).
    #[error("the cluster model panicked {0} time(s)")]
    ModelPanicked(u64),
}

/// Fleet `status` counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FleetStatus {
    pub replicas: i64,
    pub ready_replicas: i64,
    pub allocated_replicas: i64,
    pub reserved_replicas: i64,
}

/// A running emulated cluster. Stop it with [`Cluster::shutdown`]; dropping it stops the
/// model loop too.
pub struct Cluster {
    emulator: Emulator,
    client: kube::Client,
    allocator: kube::Client,
    cfg: ClusterConfig,
    model: ModelTask,
    /// Stops the model loop when the cluster is dropped without `shutdown`.
    _stop_model: DropGuard,
    next_ip: AtomicU32,
}

impl Cluster {
    /// Starts the API on `cfg.addr`, installs the Agones PDBs and starts the model.
    pub async fn start(cfg: ClusterConfig) -> Result<Cluster, ClusterError> {
        let store = Store::new(cfg.history_limit);
        agones::on_store::ensure_pdbs(&store, &cfg.namespaces).map_err(|source| {
            ClusterError::Api {
                action: "create PodDisruptionBudget",
                name: objects::keys::AGONES_PDB.to_string(),
                source: Box::new(source),
            }
        })?;
        let emulator = Emulator::start_with_options(
            store.clone(),
            cfg.addr,
            crate::kube::Options {
                agones_selectable_fields: cfg.agones_selectable_fields,
                ..Default::default()
            },
        )
        .await
        .map_err(ClusterError::Start)?;
        let client = emulator.client().await.map_err(ClusterError::Start)?;
        let allocator = client_without_retry(&emulator, ALLOCATOR_IDENTITY)
            .await
            .map_err(ClusterError::Start)?;
        let model = model::spawn(store, cfg.tick, cfg.node_lifecycle_taints, cfg.bind_lag);
        let _stop_model = model.cancel.clone().drop_guard();
        Ok(Cluster {
            emulator,
            client,
            allocator,
            cfg,
            model,
            _stop_model,
            next_ip: AtomicU32::new(1),
        })
    }

    pub fn emulator(&self) -> &Emulator {
        &self.emulator
    }

    pub fn store(&self) -> &Store {
        self.emulator.store()
    }

    pub fn config(&self) -> &ClusterConfig {
        &self.cfg
    }

    /// A client with the test identity (`"test"`); cheap to clone.
    pub fn client(&self) -> kube::Client {
        self.client.clone()
    }

    /// A client with `identity` that reports 429/503/504 at once instead of retrying.
    ///
    /// kube 5's default client retries those statuses up to 15 times with a backoff that
    /// grows towards 1000 s, so an eviction refused by a PDB (429) would hang a test for
    /// minutes; client-go, which Agones and kubectl use, does not do that.
    pub async fn client_without_retry(&self, identity: &str) -> Result<kube::Client, ClusterError> {
        client_without_retry(&self.emulator, identity)
            .await
            .map_err(ClusterError::Start)
    }

    /// A modelled Cluster Autoscaler acting as `cluster-autoscaler` (see
    /// [`autoscaler::cluster_autoscaler`]); it does nothing until asked to scale a node down.
    pub async fn cluster_autoscaler(
        &self,
        cfg: autoscaler::cluster_autoscaler::Config,
    ) -> Result<autoscaler::ClusterAutoscaler, ClusterError> {
        let client = self
            .client_without_retry(autoscaler::CLUSTER_AUTOSCALER_IDENTITY)
            .await?;
        Ok(autoscaler::ClusterAutoscaler::new(client, cfg))
    }

    /// A modelled Karpenter acting as `karpenter` (see [`autoscaler::karpenter`]); it does
    /// nothing until asked to disrupt a node.
    pub async fn karpenter(
        &self,
        cfg: autoscaler::karpenter::Config,
    ) -> Result<autoscaler::Karpenter, ClusterError> {
        let client = self
            .client_without_retry(autoscaler::KARPENTER_IDENTITY)
            .await?;
        Ok(autoscaler::Karpenter::new(client, cfg))
    }

    // ---- nodes -----------------------------------------------------------------------

    /// Registers a node (Ready unless the spec says otherwise). An InternalIP is assigned
    /// from 10.0.0.0/16 when the spec has none.
    pub fn add_node(&self, node: NodeSpec) -> Result<(), ClusterError> {
        let mut node = node;
        if node.internal_ip.is_none() {
            let n = self.next_ip.fetch_add(1, Ordering::Relaxed);
            node.internal_ip = Some(format!("10.0.{}.{}", (n >> 8) & 0xff, n & 0xff));
        }
        let name = node.name.clone();
        self.store()
            .create(&NODES, None, node.to_object())
            .map(drop)
            .map_err(api_err("create node", &name))
    }

    /// Removes a node at once (the VM is gone); the pod GC then deletes its pods.
    pub fn remove_node(&self, name: &str) -> Result<(), ClusterError> {
        self.store()
            .remove(&NODES, None, name)
            .map(drop)
            .map_err(api_err("remove node", name))
    }

    /// Sets `spec.unschedulable` (cordon / uncordon).
    pub fn set_unschedulable(&self, name: &str, unschedulable: bool) -> Result<(), ClusterError> {
        self.modify_node(name, "cordon node", |obj| {
            if unschedulable {
                object_at(obj, &["spec"]).insert("unschedulable".into(), json!(true));
            } else {
                object_at(obj, &["spec"]).remove("unschedulable");
            }
        })
    }

    /// Adds a taint (replacing one with the same key and effect).
    pub fn add_taint(&self, name: &str, taint: Taint) -> Result<(), ClusterError> {
        self.modify_node(name, "taint node", move |obj| {
            let mut taints = node_taints(obj);
            taints.retain(|t| !(t.key == taint.key && t.effect == taint.effect));
            taints.push(taint);
            object_at(obj, &["spec"]).insert("taints".into(), json!(taints));
        })
    }

    /// Removes taints with `key` (and `effect`, unless it is empty).
    pub fn remove_taint(&self, name: &str, key: &str, effect: &str) -> Result<(), ClusterError> {
        self.modify_node(name, "untaint node", |obj| {
            let mut taints = node_taints(obj);
            taints.retain(|t| !(t.key == key && (effect.is_empty() || t.effect == effect)));
            object_at(obj, &["spec"]).insert("taints".into(), json!(taints));
        })
    }

    /// Sets the node's `status.nodeInfo.bootID`, as its kubelet reports it after the machine
    /// (re)started: a new one is a machine that came back.
    pub fn set_boot_id(&self, name: &str, boot_id: &str) -> Result<(), ClusterError> {
        kubelet::post_boot_id(self.store(), name, boot_id)
            .map_err(api_err("set node boot id", name))
    }

    /// Sets the node's Ready condition.
    pub fn set_node_ready(&self, name: &str, ready: bool) -> Result<(), ClusterError> {
        self.store()
            .modify_status(&NODES, None, name, |obj| {
                kubelet::set_ready(obj, ready);
                Ok(())
            })
            .map(drop)
            .map_err(api_err("set node readiness", name))
    }

    fn modify_node(
        &self,
        name: &str,
        action: &'static str,
        f: impl FnOnce(&mut Value),
    ) -> Result<(), ClusterError> {
        self.store()
            .modify(&NODES, None, name, |obj| {
                f(obj);
                Ok(())
            })
            .map(drop)
            .map_err(api_err(action, name))
    }

    // ---- Agones objects --------------------------------------------------------------

    /// Creates a Fleet; its controller then creates the GameServers.
    pub fn create_fleet(&self, fleet: FleetSpec) -> Result<(), ClusterError> {
        self.store()
            .create(&FLEETS, Some(&fleet.namespace), fleet.to_object())
            .map(drop)
            .map_err(api_err("create fleet", &fleet.name))
    }

    /// Sets a Fleet's `spec.replicas`.
    pub fn scale_fleet(&self, ns: &str, name: &str, replicas: i64) -> Result<(), ClusterError> {
        self.store()
            .modify(&FLEETS, Some(ns), name, |obj| {
                object_at(obj, &["spec"]).insert("replicas".into(), json!(replicas));
                Ok(())
            })
            .map(drop)
            .map_err(api_err("scale fleet", name))
    }

    /// Creates a standalone GameServer (nothing replaces it when it goes).
    pub fn create_game_server(&self, gs: GameServerSpec) -> Result<(), ClusterError> {
        self.store()
            .create(&GAMESERVERS, Some(&gs.namespace), gs.to_object())
            .map(drop)
            .map_err(api_err("create gameserver", &gs.name))
    }

    /// Allocates a Ready GameServer over HTTP as the Agones allocator does (see
    /// [`allocator`]); `Ok(None)` is `UnAllocated`.
    pub async fn allocate(
        &self,
        req: &AllocationRequest,
    ) -> Result<Option<GameServerView>, ClusterError> {
        allocator::allocate(&self.allocator, req)
            .await
            .map_err(ClusterError::Allocate)
    }

    // ---- the game (SDK calls and process exit) ---------------------------------------

    /// SDK `Ready()`: RequestReady; the controller then moves it to Ready. Needed only for
    /// `manual_ready` servers. The rules of every SDK call are [`agones::sdk`]'s.
    pub fn sdk_ready(&self, ns: &str, name: &str) -> Result<(), ClusterError> {
        self.sdk_call(agones::sdk::Call::Ready, ns, name)
    }

    /// SDK `Allocate()`: the game marks itself Allocated.
    pub fn sdk_allocate(&self, ns: &str, name: &str) -> Result<(), ClusterError> {
        self.sdk_call(agones::sdk::Call::Allocate, ns, name)
    }

    /// SDK `Reserve(0)`: held (not allocatable, not scaled down) until allocated or shut down.
    pub fn reserve(&self, ns: &str, name: &str) -> Result<(), ClusterError> {
        self.sdk_call(agones::sdk::Call::Reserve { seconds: 0 }, ns, name)
    }

    /// SDK `Shutdown()`: state Shutdown; the controller deletes the GameServer and its pod
    /// (which ends at once: the game is exiting).
    pub fn sdk_shutdown(&self, ns: &str, name: &str) -> Result<(), ClusterError> {
        self.sdk_call(agones::sdk::Call::Shutdown, ns, name)
    }

    /// The game process in pod `ns/pod` exits: a terminating pod is removed at once; a
    /// running one ends (`Succeeded`) and its GameServer goes Unhealthy.
    pub fn game_exit(&self, ns: &str, pod: &str) -> Result<(), ClusterError> {
        self.store()
            .modify_status(&PODS, Some(ns), pod, |obj| {
                kubelet::mark_exited(obj);
                Ok(())
            })
            .map(drop)
            .map_err(api_err("game exit", pod))
    }

    fn sdk_call(&self, call: agones::sdk::Call, ns: &str, name: &str) -> Result<(), ClusterError> {
        let mut refused = None;
        let res = self.store().modify(&GAMESERVERS, Some(ns), name, |obj| {
            if let Err(e) = agones::sdk::apply(call, obj) {
                refused = Some(e);
            }
            Ok(())
        });
        res.map_err(api_err("SDK call", name))?;
        match refused {
            None => Ok(()),
            Some(e) => Err(ClusterError::InvalidState {
                call: e.call,
                name: name.to_string(),
                state: e.state,
            }),
        }
    }

    // ---- views -------------------------------------------------------------------------

    /// Every GameServer that parses, by namespace and name.
    pub fn game_servers(&self) -> Vec<GameServerView> {
        let (items, _) = self.store().list(&GAMESERVERS, None);
        items
            .iter()
            .filter_map(|o| GameServerView::parse(o).ok())
            .collect()
    }

    pub fn game_server(&self, ns: &str, name: &str) -> Option<GameServerView> {
        self.store()
            .get(&GAMESERVERS, Some(ns), name)
            .and_then(|o| GameServerView::parse(&o).ok())
    }

    /// The GameServers of a Fleet (by the `agones.dev/fleet` label).
    pub fn fleet_game_servers(&self, ns: &str, fleet: &str) -> Vec<GameServerView> {
        self.game_servers()
            .into_iter()
            .filter(|gs| gs.namespace == ns && gs.fleet() == Some(fleet))
            .collect()
    }

    /// A Fleet's `status` counters.
    pub fn fleet_status(&self, ns: &str, name: &str) -> Option<FleetStatus> {
        let fleet = self.store().get(&FLEETS, Some(ns), name)?;
        let n = |f: &str| {
            fleet
                .pointer(&format!("/status/{f}"))
                .and_then(Value::as_i64)
                .unwrap_or(0)
        };
        Some(FleetStatus {
            replicas: n("replicas"),
            ready_replicas: n("readyReplicas"),
            allocated_replicas: n("allocatedReplicas"),
            reserved_replicas: n("reservedReplicas"),
        })
    }

    pub fn pod(&self, ns: &str, name: &str) -> Option<Value> {
        self.store().get(&PODS, Some(ns), name)
    }

    /// Pods bound to `node` (terminating ones included).
    pub fn pods_on(&self, node: &str) -> Vec<Value> {
        let (pods, _) = self.store().list(&PODS, None);
        pods.into_iter()
            .filter(|p| p.pointer("/spec/nodeName").and_then(Value::as_str) == Some(node))
            .collect()
    }

    pub fn node(&self, name: &str) -> Option<Value> {
        self.store().get(&NODES, None, name)
    }

    // ---- waiting -----------------------------------------------------------------------

    /// Re-checks `cond` on every store change (and every tick) until it returns `Some`, or
    /// fails with [`ClusterError::Timeout`] after `within`.
    pub async fn wait_until<T>(
        &self,
        what: &str,
        within: Duration,
        mut cond: impl FnMut(&Cluster) -> Option<T>,
    ) -> Result<T, ClusterError> {
        self.wait_on(what, within, || {
            let r = cond(self);
            async move { r }
        })
        .await
    }

    async fn wait_on<T, Fut>(
        &self,
        what: &str,
        within: Duration,
        mut check: impl FnMut() -> Fut,
    ) -> Result<T, ClusterError>
    where
        Fut: Future<Output = Option<T>>,
    {
        let deadline = Instant::now() + within;
        let mut changes = self.store().subscribe();
        let mut progress = self.model.progress.clone();
        loop {
            let panics = progress.borrow().panics;
            if panics > 0 {
                return Err(ClusterError::ModelPanicked(panics));
            }
            if let Some(v) = check().await {
                return Ok(v);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(ClusterError::Timeout {
                    what: what.to_string(),
                    within,
                });
            }
            let wake = deadline.min(now + self.cfg.tick);
            tokio::select! {
                _ = changes.recv() => {}
                _ = progress.changed() => {}
                _ = tokio::time::sleep_until(wake) => {}
            }
        }
    }

    /// Waits until `fleet` has at least `n` Ready servers that are not being deleted;
    /// returns them by name.
    pub async fn wait_ready(
        &self,
        ns: &str,
        fleet: &str,
        n: usize,
    ) -> Result<Vec<GameServerView>, ClusterError> {
        self.wait_until(
            &format!("{n} Ready servers in fleet {ns}/{fleet}"),
            DEFAULT_WAIT,
            |c| {
                let mut ready: Vec<GameServerView> = c
                    .fleet_game_servers(ns, fleet)
                    .into_iter()
                    .filter(|gs| gs.state == Some(GameServerState::Ready) && !gs.deleting)
                    .collect();
                ready.sort_by(|a, b| a.name.cmp(&b.name));
                (ready.len() >= n).then_some(ready)
            },
        )
        .await
    }

    /// Waits until the model is quiet: its last pass changed nothing, nothing else changed
    /// since, and no timer (grace period, tolerationSeconds) is pending.
    pub async fn wait_stable(&self, within: Duration) -> Result<(), ClusterError> {
        let progress = self.model.progress.clone();
        let store = self.store().clone();
        self.wait_on("the cluster model to settle", within, || {
            let Progress { quiet_at, .. } = *progress.borrow();
            let quiet = quiet_at == Some(store.resource_version());
            async move { quiet.then_some(()) }
        })
        .await
    }

    /// Stops the model, then the API server.
    pub async fn shutdown(self) {
        let Cluster {
            emulator, model, ..
        } = self;
        model.cancel.cancel();
        if let Err(e) = model.task.await {
            tracing::error!(error = %e, "cluster model task failed");
        }
        emulator.shutdown().await;
    }
}

async fn client_without_retry(emulator: &Emulator, identity: &str) -> anyhow::Result<kube::Client> {
    let kubeconfig = kube::config::Kubeconfig::from_yaml(&emulator.kubeconfig_yaml(identity))?;
    let mut config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await?;
    config.default_retry = false;
    Ok(kube::Client::try_from(config)?)
}

/// The node's taints (empty when missing or malformed).
fn node_taints(obj: &Value) -> Vec<Taint> {
    obj.pointer("/spec/taints")
        .cloned()
        .and_then(|t| serde_json::from_value(t).ok())
        .unwrap_or_default()
}

fn api_err(action: &'static str, name: &str) -> impl FnOnce(ApiError) -> ClusterError {
    let name = name.to_string();
    move |source| ClusterError::Api {
        action,
        name,
        source: Box::new(source),
    }
}
