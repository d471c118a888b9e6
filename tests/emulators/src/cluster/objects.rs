//! Typed views of the objects the model reads, parsed once at the boundary.
//!
//! The store keeps raw JSON (so no field a client sent is lost); every decision in the
//! model is taken on these views instead, so no controller compares strings deep inside
//! its logic. An object that does not parse (an unknown GameServer state, a wrongly typed
//! field) is skipped with a warning: bad input never triggers an action.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use k8s_openapi::api::core::v1::{Node, Pod, Taint, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;
use serde_json::Value;

/// Well-known label, annotation and finalizer keys (Agones and Kubernetes spellings).
pub mod keys {
    /// Pod label Agones uses to find GameServer pods.
    pub const ROLE_LABEL: &str = "agones.dev/role";
    /// Value of [`ROLE_LABEL`] on GameServer pods.
    pub const ROLE_GAMESERVER: &str = "gameserver";
    /// Pod label naming the pod's GameServer.
    pub const GAMESERVER_LABEL: &str = "agones.dev/gameserver";
    /// GameServer label naming its Fleet.
    pub const FLEET_LABEL: &str = "agones.dev/fleet";
    /// GameServer label naming its GameServerSet.
    pub const GAMESERVERSET_LABEL: &str = "agones.dev/gameserverset";
    /// Pod label the Agones PDB selects on.
    pub const SAFE_TO_EVICT_LABEL: &str = "agones.dev/safe-to-evict";
    /// Pod annotation the cluster autoscaler reads.
    pub const CA_SAFE_TO_EVICT: &str = "cluster-autoscaler.kubernetes.io/safe-to-evict";
    /// GameServer annotation rewritten on every allocation (RFC 3339).
    pub const LAST_ALLOCATED: &str = "agones.dev/last-allocated";
    /// Pod annotation naming the game container.
    pub const CONTAINER_ANNOTATION: &str = "agones.dev/container";
    /// Pod and GameServer annotation with the SDK version.
    pub const SDK_VERSION_ANNOTATION: &str = "agones.dev/sdk-version";
    /// Finalizer the Agones controller holds on every GameServer.
    pub const GAMESERVER_FINALIZER: &str = "agones.dev/controller";
    /// Name of the PDB the Agones chart installs per game-server namespace.
    pub const AGONES_PDB: &str = "agones-gameserver-safe-to-evict-false";
    /// GameServer annotation (test kit only): with value `manual`, the game does not call
    /// SDK `Ready()` by itself; the test calls [`crate::cluster::Cluster::sdk_ready`].
    pub const SDK_READY_ANNOTATION: &str = "testkit.lastcall.dev/sdk-ready";
    /// Value of [`SDK_READY_ANNOTATION`] that turns the automatic `Ready()` off.
    pub const SDK_READY_MANUAL: &str = "manual";
}

/// The SDK version the model claims to run (annotation only; nothing depends on it).
pub const SDK_VERSION: &str = "1.57.0";

/// A value outside a closed set (GameServer state, eviction setting, taint effect).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} {value:?}")]
pub struct UnknownValue {
    pub what: &'static str,
    pub value: String,
}

/// Why an object could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    /// A field has the wrong JSON type.
    #[error("malformed object: {0}")]
    Malformed(#[source] serde_json::Error),
    /// A closed-set field has a value the model does not know.
    #[error(transparent)]
    Unknown(#[from] UnknownValue),
}

/// Agones `status.state` (`pkg/apis/agones/v1/gameserver.go`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GameServerState {
    PortAllocation,
    Creating,
    Starting,
    Scheduled,
    RequestReady,
    Ready,
    Reserved,
    Allocated,
    Shutdown,
    Error,
    Unhealthy,
}

impl GameServerState {
    pub const ALL: [GameServerState; 11] = [
        GameServerState::PortAllocation,
        GameServerState::Creating,
        GameServerState::Starting,
        GameServerState::Scheduled,
        GameServerState::RequestReady,
        GameServerState::Ready,
        GameServerState::Reserved,
        GameServerState::Allocated,
        GameServerState::Shutdown,
        GameServerState::Error,
        GameServerState::Unhealthy,
    ];

    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            GameServerState::PortAllocation => "PortAllocation",
            GameServerState::Creating => "Creating",
            GameServerState::Starting => "Starting",
            GameServerState::Scheduled => "Scheduled",
            GameServerState::RequestReady => "RequestReady",
            GameServerState::Ready => "Ready",
            GameServerState::Reserved => "Reserved",
            GameServerState::Allocated => "Allocated",
            GameServerState::Shutdown => "Shutdown",
            GameServerState::Error => "Error",
            GameServerState::Unhealthy => "Unhealthy",
        }
    }

    /// Agones `IsBeforeReady`.
    pub fn is_before_ready(self) -> bool {
        matches!(
            self,
            GameServerState::PortAllocation
                | GameServerState::Creating
                | GameServerState::Starting
                | GameServerState::Scheduled
                | GameServerState::RequestReady
        )
    }

    /// Agones `IsActive`: Ready, Reserved or Allocated.
    pub fn is_active(self) -> bool {
        matches!(
            self,
            GameServerState::Ready | GameServerState::Reserved | GameServerState::Allocated
        )
    }

    /// Shutdown, Error or Unhealthy: the server will not serve again.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            GameServerState::Shutdown | GameServerState::Error | GameServerState::Unhealthy
        )
    }

    /// Whether a GameServer in this state has (or had) a pod: every state after Creating.
    pub fn has_pod(self) -> bool {
        !matches!(
            self,
            GameServerState::PortAllocation | GameServerState::Creating
        )
    }
}

impl fmt::Display for GameServerState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for GameServerState {
    type Err = UnknownValue;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        GameServerState::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| UnknownValue {
                what: "GameServer state",
                value: s.to_string(),
            })
    }
}

/// Agones `spec.eviction.safe`, and what Agones puts on a server's pod for it
/// (`pkg/cloudproduct/eviction/eviction.go`, `SetEviction`; docs
/// `Advanced/controlling-disruption`, "Implementation / Under the hood").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum EvictionSafe {
    Always,
    OnUpgrade,
    /// The Agones default.
    #[default]
    Never,
}

impl EvictionSafe {
    pub fn as_str(self) -> &'static str {
        match self {
            EvictionSafe::Always => "Always",
            EvictionSafe::OnUpgrade => "OnUpgrade",
            EvictionSafe::Never => "Never",
        }
    }

    /// Pod annotation `cluster-autoscaler.kubernetes.io/safe-to-evict`: `"true"` for Always
    /// only; OnUpgrade and Never block the cluster autoscaler.
    pub fn ca_annotation(self) -> &'static str {
        match self {
            EvictionSafe::Always => "true",
            EvictionSafe::OnUpgrade | EvictionSafe::Never => "false",
        }
    }

    /// Pod label `agones.dev/safe-to-evict`: `"false"` (what the Agones PDB selects) for Never
    /// only; OnUpgrade pods are labelled `"true"`, outside the PDB, so upgrades may evict them.
    pub fn safe_to_evict_label(self) -> &'static str {
        match self {
            EvictionSafe::Always | EvictionSafe::OnUpgrade => "true",
            EvictionSafe::Never => "false",
        }
    }
}

impl fmt::Display for EvictionSafe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for EvictionSafe {
    type Err = UnknownValue;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "Always" => Ok(EvictionSafe::Always),
            "OnUpgrade" => Ok(EvictionSafe::OnUpgrade),
            "Never" => Ok(EvictionSafe::Never),
            other => Err(UnknownValue {
                what: "eviction.safe",
                value: other.to_string(),
            }),
        }
    }
}

/// Taint effects; `PreferNoSchedule` is only a preference and never blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TaintEffect {
    NoSchedule,
    PreferNoSchedule,
    NoExecute,
}

impl FromStr for TaintEffect {
    type Err = UnknownValue;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "NoSchedule" => Ok(TaintEffect::NoSchedule),
            "PreferNoSchedule" => Ok(TaintEffect::PreferNoSchedule),
            "NoExecute" => Ok(TaintEffect::NoExecute),
            other => Err(UnknownValue {
                what: "taint effect",
                value: other.to_string(),
            }),
        }
    }
}

/// Whether `toleration` tolerates `taint`, with the rules of Kubernetes' `ToleratesTaint`:
/// an empty effect matches every effect, an empty key matches every key (validation only
/// allows it with `Exists`), `Exists` ignores the value, `Equal` (or no operator) compares it.
pub fn tolerates(toleration: &Toleration, taint: &Taint) -> bool {
    if let Some(effect) = toleration.effect.as_deref().filter(|e| !e.is_empty())
        && effect != taint.effect
    {
        return false;
    }
    if let Some(key) = toleration.key.as_deref().filter(|k| !k.is_empty())
        && key != taint.key
    {
        return false;
    }
    match toleration.operator.as_deref().unwrap_or("") {
        "Exists" => true,
        "" | "Equal" => {
            toleration.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or("")
        }
        _ => false,
    }
}

/// The first toleration that tolerates `taint`, if any.
pub fn tolerating<'a>(tolerations: &'a [Toleration], taint: &Taint) -> Option<&'a Toleration> {
    tolerations.iter().find(|t| tolerates(t, taint))
}

/// What the model needs to know about a Node.
#[derive(Debug, Clone)]
pub struct NodeInfo {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// Taints with a known effect (an unknown effect is ignored, as the scheduler would).
    pub taints: Vec<(Taint, TaintEffect)>,
    pub unschedulable: bool,
    /// The `Ready` condition; `None` when the node reports no such condition yet.
    pub ready: Option<bool>,
    pub internal_ip: Option<String>,
}

impl NodeInfo {
    pub fn parse(obj: &Value) -> Result<Self, ObjectError> {
        let node: Node = serde_json::from_value(obj.clone()).map_err(ObjectError::Malformed)?;
        let spec = node.spec.unwrap_or_default();
        let status = node.status.unwrap_or_default();
        let taints = spec
            .taints
            .unwrap_or_default()
            .into_iter()
            .filter_map(|t| t.effect.parse::<TaintEffect>().ok().map(|e| (t, e)))
            .collect();
        let ready = status
            .conditions
            .unwrap_or_default()
            .into_iter()
            .find(|c| c.type_ == "Ready")
            .map(|c| c.status == "True");
        let internal_ip = status
            .addresses
            .unwrap_or_default()
            .into_iter()
            .find(|a| a.type_ == "InternalIP")
            .map(|a| a.address);
        Ok(NodeInfo {
            name: node.metadata.name.unwrap_or_default(),
            labels: node.metadata.labels.unwrap_or_default(),
            taints,
            unschedulable: spec.unschedulable.unwrap_or(false),
            ready,
            internal_ip,
        })
    }

    /// Ready and not cordoned: the scheduler may bind pods here.
    pub fn schedulable(&self) -> bool {
        !self.unschedulable && self.ready == Some(true)
    }
}

/// Pod phases, as the kubelet reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodPhase {
    Pending,
    Running,
    Succeeded,
    Failed,
    Unknown,
}

impl PodPhase {
    pub(crate) fn parse(s: Option<&str>) -> PodPhase {
        match s {
            None | Some("Pending") => PodPhase::Pending,
            Some("Running") => PodPhase::Running,
            Some("Succeeded") => PodPhase::Succeeded,
            Some("Failed") => PodPhase::Failed,
            Some(_) => PodPhase::Unknown,
        }
    }

    /// The pod's containers have ended for good.
    pub fn is_finished(self) -> bool {
        matches!(self, PodPhase::Succeeded | PodPhase::Failed)
    }
}

/// What the model needs to know about a Pod.
#[derive(Debug, Clone)]
pub struct PodInfo {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub node: Option<String>,
    pub phase: PodPhase,
    pub deleting: bool,
    pub grace_seconds: Option<i64>,
    pub tolerations: Vec<Toleration>,
    pub node_selector: BTreeMap<String, String>,
    /// UID of the controller owner when it is an Agones GameServer.
    pub owner_gameserver_uid: Option<String>,
    /// Every container has a terminated state: the game exited.
    pub containers_terminated: bool,
}

impl PodInfo {
    pub fn parse(obj: &Value) -> Result<Self, ObjectError> {
        let pod: Pod = serde_json::from_value(obj.clone()).map_err(ObjectError::Malformed)?;
        let meta = pod.metadata;
        let spec = pod.spec.unwrap_or_default();
        let status = pod.status.unwrap_or_default();
        let statuses = status.container_statuses.unwrap_or_default();
        let containers_terminated = !statuses.is_empty()
            && statuses
                .iter()
                .all(|s| s.state.as_ref().is_some_and(|st| st.terminated.is_some()));
        Ok(PodInfo {
            namespace: meta.namespace.clone().unwrap_or_default(),
            name: meta.name.clone().unwrap_or_default(),
            uid: meta.uid.clone().unwrap_or_default(),
            node: spec.node_name.filter(|n| !n.is_empty()),
            phase: PodPhase::parse(status.phase.as_deref()),
            deleting: meta.deletion_timestamp.is_some(),
            grace_seconds: meta.deletion_grace_period_seconds,
            tolerations: spec.tolerations.unwrap_or_default(),
            node_selector: spec.node_selector.unwrap_or_default(),
            owner_gameserver_uid: controller_owner(&meta, "agones.dev/v1", "GameServer"),
            containers_terminated,
        })
    }
}

/// UID of the controller ownerReference of the given apiVersion and kind.
fn controller_owner(meta: &ObjectMeta, api_version: &str, kind: &str) -> Option<String> {
    meta.owner_references
        .as_deref()
        .unwrap_or_default()
        .iter()
        .find(|o| o.controller == Some(true) && o.api_version == api_version && o.kind == kind)
        .map(|o| o.uid.clone())
}

/// The parts of an Agones GameServer the model and the tests read.
#[derive(Debug, Clone, PartialEq)]
pub struct GameServerView {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub resource_version: String,
    /// `None` until the controller has applied its defaults.
    pub state: Option<GameServerState>,
    /// `status.nodeName`.
    pub node: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    /// `metadata.deletionTimestamp` is set.
    pub deleting: bool,
    pub finalizers: Vec<String>,
    /// `spec.eviction.safe` (`None` when unset).
    pub eviction_spec: Option<EvictionSafe>,
    /// `status.eviction.safe`.
    pub eviction_status: Option<EvictionSafe>,
    /// UID of the controlling Fleet, for servers a Fleet created.
    pub owner_fleet_uid: Option<String>,
}

/// Serde shape of the GameServer fields read here; everything else is ignored.
#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct RawGameServer {
    metadata: ObjectMeta,
    spec: RawGameServerSpec,
    status: RawGameServerStatus,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct RawGameServerSpec {
    eviction: Option<RawEviction>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct RawGameServerStatus {
    state: Option<String>,
    node_name: Option<String>,
    eviction: Option<RawEviction>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct RawEviction {
    safe: Option<String>,
}

fn parse_eviction(e: Option<RawEviction>) -> Result<Option<EvictionSafe>, UnknownValue> {
    e.and_then(|e| e.safe)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse())
        .transpose()
}

impl GameServerView {
    pub fn parse(obj: &Value) -> Result<Self, ObjectError> {
        let raw: RawGameServer =
            serde_json::from_value(obj.clone()).map_err(ObjectError::Malformed)?;
        let meta = raw.metadata;
        let state = raw
            .status
            .state
            .filter(|s| !s.is_empty())
            .map(|s| s.parse::<GameServerState>())
            .transpose()?;
        Ok(GameServerView {
            namespace: meta.namespace.clone().unwrap_or_default(),
            name: meta.name.clone().unwrap_or_default(),
            uid: meta.uid.clone().unwrap_or_default(),
            resource_version: meta.resource_version.clone().unwrap_or_default(),
            state,
            node: raw.status.node_name.filter(|n| !n.is_empty()),
            labels: meta.labels.clone().unwrap_or_default(),
            annotations: meta.annotations.clone().unwrap_or_default(),
            deleting: meta.deletion_timestamp.is_some(),
            finalizers: meta.finalizers.clone().unwrap_or_default(),
            eviction_spec: parse_eviction(raw.spec.eviction)?,
            eviction_status: parse_eviction(raw.status.eviction)?,
            owner_fleet_uid: controller_owner(&meta, "agones.dev/v1", "Fleet"),
        })
    }

    /// The Fleet named by the `agones.dev/fleet` label.
    pub fn fleet(&self) -> Option<&str> {
        self.labels.get(keys::FLEET_LABEL).map(String::as_str)
    }

    /// Agones `IsBeingDeleted`: a deletionTimestamp or state Shutdown.
    pub fn is_being_deleted(&self) -> bool {
        self.deleting || self.state == Some(GameServerState::Shutdown)
    }

    /// Counts towards a Fleet's replicas: not leaving and not failed.
    pub fn counts_as_up(&self) -> bool {
        !self.deleting && !self.state.is_some_and(GameServerState::is_terminal)
    }
}

/// The parts of an Agones Fleet the model reads.
#[derive(Debug, Clone)]
pub struct FleetView {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub replicas: i64,
    pub deleting: bool,
    /// `spec.template`, copied verbatim into every GameServer the Fleet creates.
    pub template: Value,
}

impl FleetView {
    pub fn parse(obj: &Value) -> Result<Self, ObjectError> {
        #[derive(Deserialize, Default)]
        #[serde(default, rename_all = "camelCase")]
        struct RawFleet {
            metadata: ObjectMeta,
            spec: RawFleetSpec,
        }
        #[derive(Deserialize, Default)]
        #[serde(default, rename_all = "camelCase")]
        struct RawFleetSpec {
            replicas: Option<i64>,
            template: Value,
        }
        let raw: RawFleet = serde_json::from_value(obj.clone()).map_err(ObjectError::Malformed)?;
        Ok(FleetView {
            namespace: raw.metadata.namespace.unwrap_or_default(),
            name: raw.metadata.name.unwrap_or_default(),
            uid: raw.metadata.uid.unwrap_or_default(),
            replicas: raw.spec.replicas.unwrap_or(0).max(0),
            deleting: raw.metadata.deletion_timestamp.is_some(),
            template: raw.spec.template,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn taint(key: &str, value: Option<&str>, effect: &str) -> Taint {
        Taint {
            key: key.into(),
            value: value.map(str::to_string),
            effect: effect.into(),
            time_added: None,
        }
    }

    fn tol(
        key: Option<&str>,
        op: Option<&str>,
        value: Option<&str>,
        effect: Option<&str>,
    ) -> Toleration {
        Toleration {
            key: key.map(str::to_string),
            operator: op.map(str::to_string),
            value: value.map(str::to_string),
            effect: effect.map(str::to_string),
            toleration_seconds: None,
        }
    }

    #[test]
    fn toleration_matching_follows_kubernetes() {
        let t = taint("k", Some("v"), "NoSchedule");
        assert!(tolerates(
            &tol(Some("k"), Some("Equal"), Some("v"), Some("NoSchedule")),
            &t
        ));
        assert!(
            tolerates(&tol(Some("k"), None, Some("v"), None), &t),
            "empty effect matches all"
        );
        assert!(
            !tolerates(&tol(Some("k"), Some("Equal"), Some("w"), None), &t),
            "value differs"
        );
        assert!(tolerates(&tol(Some("k"), Some("Exists"), None, None), &t));
        assert!(
            tolerates(&tol(None, Some("Exists"), None, None), &t),
            "empty key + Exists"
        );
        assert!(!tolerates(
            &tol(Some("other"), Some("Exists"), None, None),
            &t
        ));
        assert!(
            !tolerates(&tol(Some("k"), Some("Exists"), None, Some("NoExecute")), &t),
            "effect differs"
        );
        assert!(
            !tolerates(&tol(Some("k"), Some("Bogus"), Some("v"), None), &t),
            "unknown operator"
        );
        let no_value = taint("k", None, "NoExecute");
        assert!(tolerates(
            &tol(Some("k"), Some("Equal"), None, None),
            &no_value
        ));
    }

    #[test]
    fn gameserver_state_round_trips_and_rejects_unknown() {
        for s in GameServerState::ALL {
            assert_eq!(s.as_str().parse::<GameServerState>(), Ok(s));
        }
        assert!("ready".parse::<GameServerState>().is_err());
        let gs = json!({"metadata": {"name": "a"}, "status": {"state": "Bogus"}});
        assert!(matches!(
            GameServerView::parse(&gs),
            Err(ObjectError::Unknown(_))
        ));
    }

    #[test]
    fn eviction_mapping_matches_agones_table() {
        assert_eq!(
            (
                EvictionSafe::Never.ca_annotation(),
                EvictionSafe::Never.safe_to_evict_label()
            ),
            ("false", "false")
        );
        assert_eq!(
            (
                EvictionSafe::OnUpgrade.ca_annotation(),
                EvictionSafe::OnUpgrade.safe_to_evict_label()
            ),
            ("false", "true")
        );
        assert_eq!(
            (
                EvictionSafe::Always.ca_annotation(),
                EvictionSafe::Always.safe_to_evict_label()
            ),
            ("true", "true")
        );
        assert_eq!(EvictionSafe::default(), EvictionSafe::Never);
    }
}
