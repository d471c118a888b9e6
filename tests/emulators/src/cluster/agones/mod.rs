//! Agones, written once for both test backends: the GameServer controller, the pods it
//! makes, the SDK's state changes and the shared PodDisruptionBudget (the allocator, over
//! HTTP like the real one, is [`super::allocator`]). Every decision reads and writes only
//! through [`AgonesApi`], which both backends serve: the emulator's cluster model runs the
//! controller on its store ([`on_store`]), the box against the real API server
//! ([`over_http`], which serves the emulator over HTTP as well). A belief about Agones
//! lives here once, with where Agones says so (agones-dev/agones, v1.60; the docs page
//! `Advanced/controlling-disruption`):
//!
//! - **defaults** (`pkg/apis/agones/v1/gameserver.go`, `ApplyDefaults`; Agones' mutating
//!   webhook applies them at creation, here the controller's first write does): the
//!   finalizer `agones.dev/controller` (`FinalizerName`), state `Creating`
//!   (`applyStatusDefaults`), `spec.eviction.safe` `Never` unless the pod template says
//!   `cluster-autoscaler.kubernetes.io/safe-to-evict: "true"`, which is taken for `Always`
//!   (`applyEvictionDefaults`; the docs' note on backward compatibility), copied to
//!   `status.eviction` (`applyEvictionStatus`). Agones passes Dynamic ports through
//!   `PortAllocation` first; no ports are allocated here, so that state is skipped;
//! - **Creating**: the pod is created ([`pod::build_pod`]) and the server moves to Starting
//!   (`pkg/gameservers/controller.go`, `syncGameServerCreatingState`); **Starting**: once
//!   the pod is bound, Scheduled with `status.nodeName` and the node's address
//!   (`syncGameServerStartingState`); **Scheduled → Ready** once the pod runs: the game's
//!   SDK `Ready()` (RequestReady, `pkg/sdkserver/sdkserver.go`) and the controller's Ready
//!   (`syncGameServerRequestReadyState`) in one write, unless the server asks for a manual
//!   `Ready()` ([`keys::SDK_READY_ANNOTATION`], the test kit's), when the test plays the SDK
//!   ([`sdk`]); RequestReady → Ready once the pod runs;
//! - **Shutdown**: the controller deletes the GameServer, propagation Background, no
//!   preconditions (`syncGameServerShutdownState`);
//! - **being deleted**: the pod gets a plain DELETE once (its own grace period applies) and
//!   the finalizer stays until the pod is gone, then an update lets it go
//!   (`syncGameServerDeletionTimestamp`); `status.state` is left as it was;
//! - **a pod gone or finished** under a GameServer that is not being deleted makes it
//!   Unhealthy, an Allocated one too (`pkg/gameservers/missing.go`, `health.go`);
//! - **Reserved and Allocated** are written by the SDK and the allocator, never by the
//!   controller ([`sdk`], [`super::allocator`]); the controller leaves them be.
//!
//! Not modelled: ports, health checks, the SDK sidecar, Fleets' and GameServerSets' own
//! controllers (the emulator has a Fleet controller of its own, [`super::fleet`]; the box has
//! no Fleet CRD), Agones' webhooks. Pods whose GameServer is gone are the garbage
//! collector's: the box has the real one, the emulator's model plays it ([`on_store`]).

pub mod on_store;
pub mod over_http;
pub mod pod;
pub mod sdk;

use std::collections::HashMap;
use std::future::Future;

use serde_json::{Value, json};

use super::objects::{
    EvictionSafe, GameServerState, GameServerView, NodeInfo, PodInfo, PodPhase, keys,
};
use super::writes::object_at;

pub use pod::{agones_pdb, build_pod};

/// What one pass of the controller reads: the GameServers and pods in its scope, and the
/// Nodes (for a server's address), as raw objects.
#[derive(Debug, Default, Clone)]
pub struct Snapshot {
    pub game_servers: Vec<Value>,
    pub pods: Vec<Value>,
    pub nodes: Vec<Value>,
}

/// A refused or failed request: its HTTP status (0: no answer) and message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ApiFailure {
    pub code: u16,
    pub message: String,
}

impl ApiFailure {
    /// The object changed or went since it was read (409, 404), or already exists: the
    /// churn of a level-triggered controller, which its next pass settles.
    pub fn is_race(&self) -> bool {
        matches!(self.code, 404 | 409)
    }
}

/// The API the controller reads and writes: what one pass reads, and the four writes
/// Agones' GameServer controller makes. Served by the emulator's store ([`on_store`]) and
/// by any API server over HTTP ([`over_http`]).
pub trait AgonesApi {
    /// The GameServers and pods in scope, and every Node.
    fn read(&self) -> impl Future<Output = Result<Snapshot, ApiFailure>> + Send;
    /// Creates a pod.
    fn create_pod(
        &self,
        ns: &str,
        pod: Value,
    ) -> impl Future<Output = Result<(), ApiFailure>> + Send;
    /// A full update (PUT) of a GameServer with the resourceVersion it carries (client-go's
    /// `Update`): 409 when it changed since it was read.
    fn update_game_server(&self, gs: Value) -> impl Future<Output = Result<(), ApiFailure>> + Send;
    /// DELETE of a GameServer, propagation Background, no preconditions.
    fn delete_game_server(
        &self,
        ns: &str,
        name: &str,
    ) -> impl Future<Output = Result<(), ApiFailure>> + Send;
    /// DELETE of a pod with default options: its own grace period applies.
    fn delete_pod(
        &self,
        ns: &str,
        name: &str,
    ) -> impl Future<Output = Result<(), ApiFailure>> + Send;
}

/// One write the controller decides on for one GameServer.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Update the GameServer to `gs` (defaults, a state change, the finalizer let go).
    Update { action: &'static str, gs: Value },
    /// Create the server's pod, then update the server to `starting`.
    CreatePod { pod: Value, starting: Value },
    /// Delete the GameServer (it reached Shutdown).
    DeleteGameServer,
    /// Delete the server's pod (the server is being deleted).
    DeletePod,
}

/// What the controller does about one GameServer now (`raw` as read, `pod` its own pod: the
/// pod of its name controlled by it), or nothing.
pub fn decide(
    gs: &GameServerView,
    raw: &Value,
    pod: Option<&PodInfo>,
    nodes: &HashMap<String, NodeInfo>,
) -> Option<Step> {
    use GameServerState as S;
    if gs.deleting {
        return finalize(gs, raw, pod);
    }
    if needs_defaults(gs) {
        return Some(Step::Update {
            action: "default gameserver",
            gs: with_defaults(raw),
        });
    }
    let state = gs.state?;
    let to = |state: S| with_state(raw, state);
    match state {
        S::Shutdown => Some(Step::DeleteGameServer),
        S::Unhealthy | S::Error => None,
        S::PortAllocation | S::Creating => match pod {
            Some(_) => Some(Step::Update {
                action: "gameserver starting",
                gs: to(S::Starting),
            }),
            None => Some(Step::CreatePod {
                pod: build_pod(gs, raw),
                starting: to(S::Starting),
            }),
        },
        // The allocator's and the SDK's states; the controller leaves them be while the pod
        // runs.
        _ => {
            let Some(pod) = pod.filter(|p| !p.phase.is_finished()) else {
                return Some(Step::Update {
                    action: "gameserver unhealthy: its pod is gone",
                    gs: to(S::Unhealthy),
                });
            };
            match state {
                S::Starting => {
                    let node = pod.node.as_ref()?;
                    let mut next = to(S::Scheduled);
                    let status = object_at(&mut next, &["status"]);
                    status.insert("nodeName".into(), json!(node));
                    if let Some(ip) = nodes.get(node).and_then(|n| n.internal_ip.clone()) {
                        status.insert("address".into(), json!(ip));
                        status.insert(
                            "addresses".into(),
                            json!([{ "type": "InternalIP", "address": ip }]),
                        );
                    }
                    Some(Step::Update {
                        action: "gameserver scheduled",
                        gs: next,
                    })
                }
                S::Scheduled if pod.phase == PodPhase::Running && !manual_ready(gs) => {
                    Some(Step::Update {
                        action: "gameserver ready",
                        gs: to(S::Ready),
                    })
                }
                S::RequestReady if pod.phase == PodPhase::Running => Some(Step::Update {
                    action: "gameserver ready",
                    gs: to(S::Ready),
                }),
                _ => None,
            }
        }
    }
}

/// A GameServer being deleted: its pod deleted once, the finalizer held until it is gone.
fn finalize(gs: &GameServerView, raw: &Value, pod: Option<&PodInfo>) -> Option<Step> {
    if !gs
        .finalizers
        .iter()
        .any(|f| f == keys::GAMESERVER_FINALIZER)
    {
        return None;
    }
    match pod {
        Some(p) if !p.deleting => Some(Step::DeletePod),
        Some(_) => None,
        None => {
            let mut next = raw.clone();
            if let Some(Value::Array(fs)) = next.pointer_mut("/metadata/finalizers") {
                // Agones also lets go of the older finalizer `agones.dev`.
                fs.retain(|f| {
                    f.as_str() != Some(keys::GAMESERVER_FINALIZER)
                        && f.as_str() != Some("agones.dev")
                });
            }
            Some(Step::Update {
                action: "remove gameserver finalizer",
                gs: next,
            })
        }
    }
}

fn needs_defaults(gs: &GameServerView) -> bool {
    gs.state.is_none()
        || !gs
            .finalizers
            .iter()
            .any(|f| f == keys::GAMESERVER_FINALIZER)
        || gs.eviction_spec.is_none()
        || gs.eviction_status != gs.eviction_spec
}

/// `eviction.safe` when the spec leaves it out: Always if the pod template already says
/// the cluster autoscaler may evict, otherwise Agones' default Never.
pub fn default_eviction(raw: &Value) -> EvictionSafe {
    let ca = raw
        .pointer("/spec/template/metadata/annotations")
        .and_then(|a| a.get(keys::CA_SAFE_TO_EVICT))
        .and_then(Value::as_str);
    if ca == Some("true") {
        EvictionSafe::Always
    } else {
        EvictionSafe::Never
    }
}

/// `raw` with Agones' defaults filled in (the finalizer, `eviction.safe` in spec and status,
/// the state `Creating`); an object that does not parse is returned as it is.
pub fn with_defaults(raw: &Value) -> Value {
    let mut obj = raw.clone();
    let Ok(current) = GameServerView::parse(raw) else {
        return obj;
    };
    let safe = current
        .eviction_spec
        .unwrap_or_else(|| default_eviction(raw));
    let meta = object_at(&mut obj, &["metadata"]);
    let finalizers = meta.entry("finalizers").or_insert_with(|| json!([]));
    if !finalizers.is_array() {
        *finalizers = json!([]);
    }
    if let Value::Array(fs) = finalizers
        && !fs
            .iter()
            .any(|f| f.as_str() == Some(keys::GAMESERVER_FINALIZER))
    {
        fs.push(json!(keys::GAMESERVER_FINALIZER));
    }
    object_at(&mut obj, &["spec", "eviction"]).insert("safe".into(), json!(safe.as_str()));
    object_at(&mut obj, &["status", "eviction"]).insert("safe".into(), json!(safe.as_str()));
    if current.state.is_none() {
        object_at(&mut obj, &["status"])
            .insert("state".into(), json!(GameServerState::Creating.as_str()));
    }
    obj
}

/// `raw` in `state`.
fn with_state(raw: &Value, state: GameServerState) -> Value {
    let mut next = raw.clone();
    object_at(&mut next, &["status"]).insert("state".into(), json!(state.as_str()));
    next
}

fn manual_ready(gs: &GameServerView) -> bool {
    gs.annotations
        .get(keys::SDK_READY_ANNOTATION)
        .map(String::as_str)
        == Some(keys::SDK_READY_MANUAL)
}

/// What a pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Pass {
    /// Writes that were accepted.
    pub wrote: usize,
    /// Writes that lost a race (404, 409): the next pass settles them.
    pub raced: usize,
}

/// One pass of the GameServer controller: every GameServer read, each one's step taken.
/// Objects that do not parse are skipped: the controller never acts on what it cannot read.
pub async fn sync<A: AgonesApi>(api: &A) -> Result<Pass, ApiFailure> {
    let snap = api.read().await?;
    let pods: HashMap<(String, String), PodInfo> = snap
        .pods
        .iter()
        .filter_map(|p| PodInfo::parse(p).ok())
        .map(|p| ((p.namespace.clone(), p.name.clone()), p))
        .collect();
    let nodes: HashMap<String, NodeInfo> = snap
        .nodes
        .iter()
        .filter_map(|n| NodeInfo::parse(n).ok())
        .map(|n| (n.name.clone(), n))
        .collect();
    let mut pass = Pass::default();
    for raw in &snap.game_servers {
        let Ok(gs) = GameServerView::parse(raw) else {
            continue;
        };
        let pod = pods
            .get(&(gs.namespace.clone(), gs.name.clone()))
            .filter(|p| p.owner_gameserver_uid.as_deref() == Some(gs.uid.as_str()));
        let Some(step) = decide(&gs, raw, pod, &nodes) else {
            continue;
        };
        let res = match step {
            Step::Update { gs: next, .. } => api.update_game_server(next).await,
            Step::CreatePod { pod, starting } => match api.create_pod(&gs.namespace, pod).await {
                Ok(()) => api.update_game_server(starting).await,
                Err(e) => Err(e),
            },
            Step::DeleteGameServer => api.delete_game_server(&gs.namespace, &gs.name).await,
            Step::DeletePod => api.delete_pod(&gs.namespace, &gs.name).await,
        };
        match res {
            Ok(()) => pass.wrote += 1,
            Err(e) if e.is_race() => {
                tracing::debug!(ns = gs.namespace, name = gs.name, error = %e, "Agones controller write lost a race; the next pass settles it");
                pass.raced += 1;
            }
            Err(e) => {
                tracing::warn!(ns = gs.namespace, name = gs.name, error = %e, "Agones controller write failed");
                pass.raced += 1;
            }
        }
    }
    Ok(pass)
}

#[cfg(test)]
mod tests;
