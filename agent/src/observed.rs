//! Typed views of the Kubernetes objects the policy reads, parsed once at the edge.
//!
//! Nothing downstream compares raw strings such as `"Allocated"`; unknown values become
//! explicit `Unknown` variants that policy treats conservatively.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Node, Pod, Taint, Toleration};
use kube::api::DynamicObject;
use kube::discovery::ApiResource;

use crate::keys;

/// Agones' GameServer API, addressed dynamically so unknown fields never break parsing.
pub fn gameserver_resource() -> ApiResource {
    ApiResource {
        group: "agones.dev".into(),
        version: "v1".into(),
        api_version: "agones.dev/v1".into(),
        kind: "GameServer".into(),
        plural: "gameservers".into(),
    }
}

/// Agones Fleets: read (one GET per Fleet with servers here) only for release pacing.
pub fn fleet_resource() -> ApiResource {
    ApiResource {
        group: "agones.dev".into(),
        version: "v1".into(),
        api_version: "agones.dev/v1".into(),
        kind: "Fleet".into(),
        plural: "fleets".into(),
    }
}

/// Agones' `eviction.safe`: which voluntary disruptions the game accepts. An observed fact;
/// what it permits is the eviction rule's (`EvictionSafe::permits`, in `eviction`).
///
/// Parsed once at the edge ([`EvictionSafe::of_gameserver`]); nothing downstream compares
/// strings.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum EvictionSafe {
    /// The Agones default: run to completion, never disrupted voluntarily.
    Never,
    /// Blocks the autoscaler, accepts upgrades: the game handles SIGTERM within its grace.
    OnUpgrade,
    /// Accepts any voluntary disruption with SIGTERM and grace.
    Always,
    /// A value this version does not know. Treated as `Never`, the most protective; the
    /// integrator counts it (`is_unknown`) and logs the raw value.
    Unknown(String),
}

impl EvictionSafe {
    /// An absent or empty value is Agones' default, `Never`; anything unrecognised is
    /// `Unknown` (Agones' CRD values are case-sensitive, so no folding).
    pub fn parse(s: Option<&str>) -> Self {
        match s {
            None | Some("") | Some("Never") => Self::Never,
            Some("OnUpgrade") => Self::OnUpgrade,
            Some("Always") => Self::Always,
            Some(other) => Self::Unknown(other.to_string()),
        }
    }

    /// Reads a GameServer's raw object. `status.eviction.safe` comes first: it is the value
    /// Agones enforces (it copies spec, then forces `Always` when the pod template carries
    /// `cluster-autoscaler.kubernetes.io/safe-to-evict: "true"`). `spec.eviction.safe` is the
    /// fallback for a GameServer whose status is not written yet. A non-string value is
    /// `Unknown`, never a silent default.
    pub fn of_gameserver(data: &serde_json::Value) -> Self {
        let at = |root: &str| {
            data.get(root)
                .and_then(|r| r.get("eviction"))
                .and_then(|e| e.get("safe"))
                .filter(|v| !v.is_null() && v.as_str() != Some(""))
        };
        match at("status").or_else(|| at("spec")) {
            None => Self::Never,
            Some(serde_json::Value::String(s)) => Self::parse(Some(s)),
            Some(other) => Self::Unknown(other.to_string()),
        }
    }

    pub fn is_unknown(&self) -> bool {
        matches!(self, Self::Unknown(_))
    }

    /// Fixed label for metrics (an unknown raw value never becomes a label).
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Never => "never",
            Self::OnUpgrade => "on_upgrade",
            Self::Always => "always",
            Self::Unknown(_) => "unknown",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ObserveError {
    #[error("{kind} has no {field}")]
    Missing {
        kind: &'static str,
        field: &'static str,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct NodeView {
    pub name: String,
    pub resource_version: String,
    pub unschedulable: bool,
    pub taints: Vec<Taint>,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    /// `status.nodeInfo.bootID`, as the kubelet reports it (`None` before it has).
    pub boot_id: Option<String>,
    /// Since when the kubelet has reported the node Ready (the `Ready` condition's
    /// `lastTransitionTime` while it is `True`): after a reboot, about when the machine came
    /// back. `None` when not Ready or not said.
    pub ready_since: Option<jiff::Timestamp>,
}

impl NodeView {
    pub fn from_node(node: &Node) -> Result<Self, ObserveError> {
        let meta = &node.metadata;
        let spec = node.spec.as_ref();
        Ok(Self {
            name: meta.name.clone().ok_or(ObserveError::Missing {
                kind: "Node",
                field: "name",
            })?,
            resource_version: meta.resource_version.clone().ok_or(ObserveError::Missing {
                kind: "Node",
                field: "resourceVersion",
            })?,
            unschedulable: spec.and_then(|s| s.unschedulable).unwrap_or(false),
            // A null taint list is an empty one (the original adapter crashed here).
            taints: spec.and_then(|s| s.taints.clone()).unwrap_or_default(),
            labels: meta.labels.clone().unwrap_or_default(),
            annotations: meta.annotations.clone().unwrap_or_default(),
            boot_id: boot_id(node),
            ready_since: ready_since(node),
        })
    }

    /// The machine came back since the drain that `progress` describes started: its boot id
    /// is known now and differs from the one recorded then.
    pub fn machine_returned(&self, progress: &crate::progress::Progress) -> bool {
        progress.is_draining()
            && matches!(
                (progress.boot_id.as_deref(), self.boot_id.as_deref()),
                (Some(then), Some(now)) if then != now
            )
    }

    pub fn has_taint(&self, key: &str) -> bool {
        self.taints.iter().any(|t| t.key == key)
    }
}

/// When the Node's `Ready` condition last turned `True`, while it is.
fn ready_since(node: &Node) -> Option<jiff::Timestamp> {
    let ready = node
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready" && c.status == "True")?;
    let t = ready.last_transition_time.as_ref()?;
    Some(t.0)
}

/// The Node's boot id, when its kubelet has reported one.
pub fn boot_id(node: &Node) -> Option<String> {
    node.status
        .as_ref()?
        .node_info
        .as_ref()
        .map(|i| i.boot_id.clone())
        .filter(|b| !b.is_empty())
}

/// Agones GameServer states (`pkg/apis/agones/v1/gameserver.go`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum GsState {
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
    /// No state yet (just created).
    Empty,
    /// A state this version does not know; treated as possibly in use.
    Unknown(String),
}

impl GsState {
    pub fn parse(s: Option<&str>) -> Self {
        match s {
            None | Some("") => Self::Empty,
            Some("PortAllocation") => Self::PortAllocation,
            Some("Creating") => Self::Creating,
            Some("Starting") => Self::Starting,
            Some("Scheduled") => Self::Scheduled,
            Some("RequestReady") => Self::RequestReady,
            Some("Ready") => Self::Ready,
            Some("Reserved") => Self::Reserved,
            Some("Allocated") => Self::Allocated,
            Some("Shutdown") => Self::Shutdown,
            Some("Error") => Self::Error,
            Some("Unhealthy") => Self::Unhealthy,
            Some(other) => Self::Unknown(other.to_string()),
        }
    }

    /// Players may be on it: never remove voluntarily. Unknown states count, to be safe.
    pub fn is_in_use(&self) -> bool {
        matches!(self, Self::Allocated | Self::Reserved | Self::Unknown(_))
    }

    /// On its way to Ready; it will be released once it gets there.
    pub fn is_before_ready(&self) -> bool {
        matches!(
            self,
            Self::Empty
                | Self::PortAllocation
                | Self::Creating
                | Self::Starting
                | Self::Scheduled
                | Self::RequestReady
        )
    }

    /// Fixed label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Ready => "ready",
            Self::Allocated => "allocated",
            Self::Reserved => "reserved",
            Self::Shutdown | Self::Error | Self::Unhealthy => "terminal",
            Self::Unknown(_) => "unknown",
            _ => "starting",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct GameServerView {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub resource_version: String,
    pub state: GsState,
    pub deleting: bool,
    pub node_name: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    /// The `eviction.safe` Agones enforces (status, else spec; absent is `Never`).
    pub eviction_safe: EvictionSafe,
    /// Annotation keys the user set in the pod template (`spec.template.metadata`): values
    /// lastcall never touches on the pod.
    pub template_annotations: BTreeSet<String>,
}

impl GameServerView {
    pub fn from_dynamic(obj: &DynamicObject) -> Result<Self, ObserveError> {
        let meta = &obj.metadata;
        let missing = |field| ObserveError::Missing {
            kind: "GameServer",
            field,
        };
        let status = obj.data.get("status");
        let str_at = |key: &str| status.and_then(|s| s.get(key)).and_then(|v| v.as_str());
        Ok(Self {
            namespace: meta.namespace.clone().ok_or(missing("namespace"))?,
            name: meta.name.clone().ok_or(missing("name"))?,
            uid: meta.uid.clone().ok_or(missing("uid"))?,
            resource_version: meta
                .resource_version
                .clone()
                .ok_or(missing("resourceVersion"))?,
            state: GsState::parse(str_at("state")),
            deleting: meta.deletion_timestamp.is_some(),
            node_name: str_at("nodeName").map(str::to_string),
            labels: meta.labels.clone().unwrap_or_default(),
            annotations: meta.annotations.clone().unwrap_or_default(),
            eviction_safe: EvictionSafe::of_gameserver(&obj.data),
            template_annotations: obj
                .data
                .pointer("/spec/template/metadata/annotations")
                .and_then(|a| a.as_object())
                .map(|a| a.keys().cloned().collect())
                .unwrap_or_default(),
        })
    }

    pub fn key(&self) -> (String, String) {
        (self.namespace.clone(), self.name.clone())
    }

    pub fn fleet(&self) -> Option<&str> {
        self.labels.get(keys::AGONES_FLEET).map(String::as_str)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct PodView {
    pub namespace: String,
    pub name: String,
    /// Preconditions a graceful termination on exactly this pod.
    pub uid: String,
    pub resource_version: String,
    /// The GameServer this pod runs, when it is an Agones game-server pod.
    pub gameserver: Option<String>,
    pub annotations: BTreeMap<String, String>,
    pub tolerations: Vec<Toleration>,
    pub deleting: bool,
    /// When a terminating pod is killed: its `deletionTimestamp` (request + grace).
    pub deletion_timestamp: Option<Timestamp>,
    /// `spec.terminationGracePeriodSeconds`; Kubernetes' 30 s when absent or invalid.
    pub termination_grace: Duration,
    /// Phase `Failed` or `Succeeded`: its containers have stopped for good, so it hosts no
    /// match, whether or not anyone ever deletes it.
    pub finished: bool,
}

/// The grace period Kubernetes gives a pod that does not set one.
pub const DEFAULT_TERMINATION_GRACE: Duration = Duration::from_secs(30);

impl PodView {
    pub fn from_pod(pod: &Pod) -> Result<Self, ObserveError> {
        let meta = &pod.metadata;
        let missing = |field| ObserveError::Missing { kind: "Pod", field };
        let labels = meta.labels.as_ref();
        let is_gs = labels
            .and_then(|l| l.get(keys::AGONES_ROLE))
            .map(String::as_str)
            == Some("gameserver");
        Ok(Self {
            namespace: meta.namespace.clone().ok_or(missing("namespace"))?,
            name: meta.name.clone().ok_or(missing("name"))?,
            uid: meta.uid.clone().unwrap_or_default(),
            resource_version: meta
                .resource_version
                .clone()
                .ok_or(missing("resourceVersion"))?,
            gameserver: if is_gs {
                labels
                    .and_then(|l| l.get(keys::AGONES_GAMESERVER).cloned())
                    .or_else(|| meta.name.clone())
            } else {
                None
            },
            annotations: meta.annotations.clone().unwrap_or_default(),
            tolerations: pod
                .spec
                .as_ref()
                .and_then(|s| s.tolerations.clone())
                .unwrap_or_default(),
            deleting: meta.deletion_timestamp.is_some(),
            deletion_timestamp: meta.deletion_timestamp.as_ref().map(|t| t.0),
            termination_grace: pod
                .spec
                .as_ref()
                .and_then(|s| s.termination_grace_period_seconds)
                .and_then(|s| u64::try_from(s).ok())
                .map_or(DEFAULT_TERMINATION_GRACE, Duration::from_secs),
            finished: matches!(
                pod.status.as_ref().and_then(|s| s.phase.as_deref()),
                Some("Failed" | "Succeeded")
            ),
        })
    }
}

/// Everything policy sees of the cluster for one node.
#[derive(Clone, Debug, PartialEq)]
pub struct Observed {
    pub node: NodeView,
    pub game_servers: Vec<GameServerView>,
    pub pods: Vec<PodView>,
    /// What release pacing knows of each Fleet with servers here (empty when pacing is off).
    pub fleets: BTreeMap<(String, String), FleetFacts>,
}

impl Observed {
    /// The termination grace of pod `namespace/name`, or the Kubernetes default when the
    /// pod watch does not show it.
    pub fn termination_grace(&self, namespace: &str, name: &str) -> Duration {
        self.pods
            .iter()
            .find(|p| p.namespace == namespace && p.name == name)
            .map_or(DEFAULT_TERMINATION_GRACE, |p| p.termination_grace)
    }

    /// The pod running `gs` on this node, if the pod watch shows it.
    pub fn pod_of(&self, gs: &GameServerView) -> Option<&PodView> {
        self.pods.iter().find(|p| {
            p.namespace == gs.namespace && p.gameserver.as_deref() == Some(gs.name.as_str())
        })
    }

    /// This node's Ready servers of Fleet `namespace/fleet` that are not being deleted.
    pub fn ready_here(&self, namespace: &str, fleet: &str) -> i64 {
        self.game_servers
            .iter()
            .filter(|g| {
                !g.deleting
                    && g.state == GsState::Ready
                    && g.namespace == namespace
                    && g.fleet() == Some(fleet)
            })
            .count() as i64
    }
}

/// A Fleet, as release pacing sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FleetFacts {
    /// The Fleet's Ready servers on other nodes, at least: `status.readyReplicas` minus the
    /// most Ready servers this node held while that status may have been written (see the
    /// reconciler). `None` when the Fleet could not be read.
    pub ready_elsewhere: Option<i64>,
    /// When this agent last released one of the Fleet's Ready servers.
    pub last_release: Option<Timestamp>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_taints_and_tolerations_are_empty() {
        let node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "n1", "resourceVersion": "5"},
            "spec": {"taints": null}
        }))
        .unwrap();
        let v = NodeView::from_node(&node).unwrap();
        assert!(v.taints.is_empty() && !v.unschedulable);
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "gs-1", "namespace": "default", "resourceVersion": "7",
                         "labels": {"agones.dev/role": "gameserver", "agones.dev/gameserver": "gs-1"}},
            "spec": {"containers": [], "tolerations": null}
        }))
        .unwrap();
        let p = PodView::from_pod(&pod).unwrap();
        assert_eq!(p.gameserver.as_deref(), Some("gs-1"));
        assert!(p.tolerations.is_empty());
    }

    #[test]
    fn gameserver_parses_state_and_rejects_missing_identity() {
        let gs: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "agones.dev/v1", "kind": "GameServer",
            "metadata": {"name": "gs-1", "namespace": "default", "uid": "u1", "resourceVersion": "9"},
            "status": {"state": "Allocated", "nodeName": "n1"}
        }))
        .unwrap();
        let v = GameServerView::from_dynamic(&gs).unwrap();
        assert_eq!(v.state, GsState::Allocated);
        assert_eq!(v.node_name.as_deref(), Some("n1"));
        let mut broken = gs.clone();
        broken.metadata.uid = None;
        assert_eq!(
            GameServerView::from_dynamic(&broken),
            Err(ObserveError::Missing {
                kind: "GameServer",
                field: "uid"
            })
        );
        assert_eq!(
            GsState::parse(Some("Teleporting")),
            GsState::Unknown("Teleporting".into())
        );
        assert!(GsState::parse(Some("Teleporting")).is_in_use());
    }
}
