//! The Cluster Autoscaler's scale-down of one node, as `docs/autoscalers.md` §2 reads it
//! from CA's sources (`simulator/drainability/rules`, `core/scaledown/actuation`).
//!
//! [`ClusterAutoscaler::scale_down`] runs the steps of §6 in the background:
//! 1. *pick*: refuse unless every pod passes the drainability rules, in CA's order;
//! 2. *mark*: one `PUT` of the Node adding `ToBeDeletedByClusterAutoscaler=<unix s>:NoSchedule`
//!    and `unschedulable: true`, retried on 409 for a while;
//! 3. *re-check* after `delete_delay_after_taint`: the same rules on a fresh pod list; a
//!    blocker now aborts (taint and cordon removed, Warning Event `ScaleDownFailed`);
//! 4. *evict* every pod of that list at once, through the Eviction API with the grace capped
//!    at `max_graceful_termination_secs`; failures are retried every `eviction_retry` until
//!    `max_pod_eviction_time`. Annotations are not read again: only the API's PDB check can
//!    stop an eviction now;
//! 5. *wait* for the evicted pods to leave, up to the longest grace plus a headroom;
//! 6. *delete* the Node, standing in for the instance.
//!
//! A failure in 4–5 is handled as in 3. The Node delete goes through the API; the model's
//! pod GC then removes whatever was left on it.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use k8s_openapi::api::core::v1::Taint;
use k8s_openapi::jiff::Timestamp;
use tokio::time::Instant;

use super::keys::{CA_SAFE_TO_EVICT, CA_SCALE_DOWN_DISABLED, CA_TO_BE_DELETED_TAINT};
use super::{
    Budget, Error, Kube, PodFacts, Run, api_err, has_taint, node_annotation, pause, status_code,
    without_taint,
};

/// Component name on the Events CA records.
const COMPONENT: &str = "cluster-autoscaler";

/// Reason of the Warning Event on a node whose scale-down failed or was aborted.
pub const SCALE_DOWN_FAILED: &str = "ScaleDownFailed";

/// Owner kinds CA counts as "replicated" (`rules/replicated/rule.go`).
const REPLICATED_KINDS: [&str; 4] = ["ReplicaSet", "ReplicationController", "Job", "StatefulSet"];

/// CA's flags that the scale-down of one node reads; the defaults are CA's
/// (`docs/autoscalers.md` §6).
#[derive(Debug, Clone)]
pub struct Config {
    /// `--node-delete-delay-after-taint` (default 5 s): from the taint to the re-check.
    pub delete_delay_after_taint: Duration,
    /// `--cordon-node-before-terminating` (default true): also set `spec.unschedulable` with the
    /// taint, and clear it when the taint comes off.
    pub cordon_node_before_terminating: bool,
    /// How long a taint (or untaint) `PUT` is retried on 409 (default 5 s, `utils/taints`).
    pub taint_conflict_deadline: Duration,
    /// Pause between those retries (default 750 ms).
    pub taint_conflict_retry: Duration,
    /// `--max-graceful-termination-sec` (default 600): cap on each eviction's grace period.
    pub max_graceful_termination_secs: i64,
    /// Pause between attempts at a refused eviction (default 10 s).
    pub eviction_retry: Duration,
    /// `--max-pod-eviction-time` (default 2 min): how long a refused eviction is retried.
    pub max_pod_eviction_time: Duration,
    /// How often the wait for evicted pods checks (default 5 s).
    pub pod_wait_poll: Duration,
    /// Added to the longest grace period for that wait (default 30 s).
    pub pod_eviction_headroom: Duration,
    /// `--skip-nodes-with-custom-controller-pods` (default true): a pod whose controller is not a
    /// ReplicaSet, ReplicationController, Job or StatefulSet blocks (Agones' GameServer).
    pub skip_nodes_with_custom_controller_pods: bool,
    /// `--skip-nodes-with-system-pods` (default true): non-DaemonSet `kube-system` pods block.
    pub skip_nodes_with_system_pods: bool,
    /// `--skip-nodes-with-local-storage` (default true): `emptyDir` and `hostPath` volumes block.
    pub skip_nodes_with_local_storage: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            delete_delay_after_taint: Duration::from_secs(5),
            cordon_node_before_terminating: true,
            taint_conflict_deadline: Duration::from_secs(5),
            taint_conflict_retry: Duration::from_millis(750),
            max_graceful_termination_secs: 600,
            eviction_retry: Duration::from_secs(10),
            max_pod_eviction_time: Duration::from_secs(120),
            pod_wait_poll: Duration::from_secs(5),
            pod_eviction_headroom: Duration::from_secs(30),
            skip_nodes_with_custom_controller_pods: true,
            skip_nodes_with_system_pods: true,
            skip_nodes_with_local_storage: true,
        }
    }
}

/// What keeps a node from being scaled down (the first blocking rule met).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Blocker {
    /// The node has `cluster-autoscaler.kubernetes.io/scale-down-disabled: "true"`.
    ScaleDownDisabled,
    /// The pod's controller is not RS/RC/Job/StatefulSet (or it has none).
    NotReplicated {
        pod: String,
        owner_kind: Option<String>,
    },
    /// A non-DaemonSet pod in `kube-system`.
    SystemPod { pod: String },
    /// The pod has `safe-to-evict: "false"`.
    NotSafeToEvict { pod: String },
    /// The pod has an `emptyDir` or `hostPath` volume.
    LocalStorage { pod: String },
    /// A PDB matching the pod allows no disruption.
    PdbExhausted { pod: String, pdb: String },
}

impl fmt::Display for Blocker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Blocker::ScaleDownDisabled => write!(f, "node has scale-down disabled"),
            Blocker::NotReplicated { pod, owner_kind } => match owner_kind {
                Some(kind) => write!(f, "pod {pod} is not replicated (controller {kind})"),
                None => write!(f, "pod {pod} is not replicated (no controller)"),
            },
            Blocker::SystemPod { pod } => write!(f, "non-daemonset kube-system pod {pod}"),
            Blocker::NotSafeToEvict { pod } => {
                write!(f, "pod {pod} is annotated {CA_SAFE_TO_EVICT}=false")
            }
            Blocker::LocalStorage { pod } => write!(f, "pod {pod} has local storage"),
            Blocker::PdbExhausted { pod, pdb } => {
                write!(f, "not enough pod disruption budget to move {pod} ({pdb})")
            }
        }
    }
}

/// Why a scale-down that had tainted the node failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The taint `PUT` kept conflicting until `taint_conflict_deadline` (nothing written).
    TaintConflict,
    /// These evictions were still failing at `max_pod_eviction_time` (with the last status,
    /// `None` for a transport error).
    EvictionsFailed { pods: Vec<(String, Option<u16>)> },
    /// These evicted pods were still on the node at the end of the wait.
    PodsRemained { pods: Vec<String> },
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::TaintConflict => write!(f, "could not taint the node (conflicts)"),
            Failure::EvictionsFailed { pods } => {
                let names: Vec<&str> = pods.iter().map(|(p, _)| p.as_str()).collect();
                write!(f, "failed to evict pods: {}", names.join(", "))
            }
            Failure::PodsRemained { pods } => {
                write!(f, "pods remaining after eviction: {}", pods.join(", "))
            }
        }
    }
}

/// What a scale-down did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The pick found a blocker; nothing was written.
    Refused { why: Blocker },
    /// The re-check after the taint found a blocker: no eviction was sent, the taint (and
    /// the cordon) were removed and `ScaleDownFailed` recorded.
    Aborted { why: Blocker },
    /// Eviction or the wait failed: pods already evicted stay evicted, the taint (and the
    /// cordon) were removed and `ScaleDownFailed` recorded.
    GaveUp { why: Failure },
    /// Every pod left and the Node was deleted; `evicted` lists the pods whose eviction
    /// the API accepted (`namespace/name`, sorted).
    NodeDeleted { evicted: Vec<String> },
}

/// A modelled Cluster Autoscaler; cheap to clone.
#[derive(Clone)]
pub struct ClusterAutoscaler {
    kube: Kube,
    cfg: Arc<Config>,
}

impl ClusterAutoscaler {
    /// A CA acting with `client` (build it without kube's 429 retry, so CA's own retry
    /// timing holds; [`crate::cluster::Cluster::cluster_autoscaler`] does).
    pub fn new(client: kube::Client, cfg: Config) -> Self {
        ClusterAutoscaler {
            kube: Kube::new(client),
            cfg: Arc::new(cfg),
        }
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Scales `node` down in the background, as if CA had found it unneeded; await the
    /// handle for the [`Outcome`].
    pub fn scale_down(&self, node: &str) -> Run<Outcome> {
        let (kube, cfg, node) = (self.kube.clone(), self.cfg.clone(), node.to_string());
        Run::spawn(async move { scale_down(&kube, &cfg, &node).await })
    }
}

async fn scale_down(kube: &Kube, cfg: &Config, node: &str) -> Result<Outcome, Error> {
    let current = kube.node(node).await?;
    if node_annotation(&current, CA_SCALE_DOWN_DISABLED) == Some("true") {
        return Ok(Outcome::Refused {
            why: Blocker::ScaleDownDisabled,
        });
    }
    if let Err(why) = pods_to_move(cfg, kube, node).await? {
        return Ok(Outcome::Refused { why });
    }
    if !set_mark(kube, cfg, node, true).await? {
        return Ok(Outcome::GaveUp {
            why: Failure::TaintConflict,
        });
    }
    let outcome = match drain(kube, cfg, node).await {
        Ok(o @ Outcome::NodeDeleted { .. }) => return Ok(o),
        Ok(o) => o,
        Err(e) => {
            // CA cleans up after any error once the node is tainted.
            if let Err(error) = set_mark(kube, cfg, node, false).await {
                tracing::warn!(%error, node, "cluster autoscaler model could not untaint");
            }
            return Err(e);
        }
    };
    if !set_mark(kube, cfg, node, false).await? {
        tracing::warn!(node, "cluster autoscaler model: untaint kept conflicting");
    }
    let message = match &outcome {
        Outcome::Aborted { why } => format!("scale-down aborted: {why}"),
        Outcome::GaveUp { why } => format!("scale-down failed: {why}"),
        _ => String::new(),
    };
    kube.warn_node(node, COMPONENT, SCALE_DOWN_FAILED, &message)
        .await;
    Ok(outcome)
}

/// Steps 3–6, once the node is tainted.
async fn drain(kube: &Kube, cfg: &Config, node: &str) -> Result<Outcome, Error> {
    pause(cfg.delete_delay_after_taint).await;
    let pods = match pods_to_move(cfg, kube, node).await? {
        Ok(pods) => pods,
        Err(why) => return Ok(Outcome::Aborted { why }),
    };

    let deadline = Instant::now() + cfg.max_pod_eviction_time;
    let results = join_all(pods.iter().map(|p| evict(kube, cfg, p, deadline))).await;
    let mut evicted = Vec::new();
    let mut failed = Vec::new();
    for (pod, res) in pods.iter().zip(results) {
        match res {
            Ok(true) => evicted.push(pod.key.clone()),
            Ok(false) => {}
            Err(status) => failed.push((pod.key.clone(), status)),
        }
    }
    if !failed.is_empty() {
        return Ok(Outcome::GaveUp {
            why: Failure::EvictionsFailed { pods: failed },
        });
    }

    let longest = pods
        .iter()
        .map(|p| grace(cfg, p))
        .max()
        .unwrap_or(0)
        .max(0)
        .unsigned_abs();
    let until = Instant::now() + Duration::from_secs(longest) + cfg.pod_eviction_headroom;
    loop {
        let on_node = kube.pods_on(node).await?;
        let remaining: Vec<String> = pods
            .iter()
            .filter(|p| on_node.iter().any(|q| q.key == p.key))
            .map(|p| p.key.clone())
            .collect();
        if remaining.is_empty() {
            break;
        }
        let now = Instant::now();
        if now >= until {
            return Ok(Outcome::GaveUp {
                why: Failure::PodsRemained { pods: remaining },
            });
        }
        pause(cfg.pod_wait_poll.min(until - now)).await;
    }

    kube.delete_node(node).await?;
    evicted.sort();
    Ok(Outcome::NodeDeleted { evicted })
}

/// The eviction grace CA sends: the pod's own, capped.
fn grace(cfg: &Config, pod: &PodFacts) -> i64 {
    pod.grace_seconds.min(cfg.max_graceful_termination_secs)
}

/// One pod's eviction, retried until `deadline`: `Ok(true)` accepted, `Ok(false)` the pod
/// was already gone (404), `Err(last status)` still refused at the deadline.
async fn evict(
    kube: &Kube,
    cfg: &Config,
    pod: &PodFacts,
    deadline: Instant,
) -> Result<bool, Option<u16>> {
    loop {
        let last = match kube.evict(pod, Some(grace(cfg, pod)), false).await {
            Ok(()) => return Ok(true),
            Err(e) if status_code(&e) == Some(404) => return Ok(false),
            Err(e) => {
                tracing::debug!(pod = %pod.key, error = %e, "cluster autoscaler model: eviction refused; retrying");
                status_code(&e)
            }
        };
        pause(cfg.eviction_retry).await;
        if Instant::now() >= deadline {
            return Err(last);
        }
    }
}

/// The pods CA would move off `node` (its drainability rules), or the first blocker.
async fn pods_to_move(
    cfg: &Config,
    kube: &Kube,
    node: &str,
) -> Result<Result<Vec<PodFacts>, Blocker>, Error> {
    let pdbs = kube.pdbs().await?;
    let pods = kube.all_pods().await?;
    let budgets = Budget::compute(&pdbs, &pods);
    let mut on_node: Vec<PodFacts> = pods
        .into_iter()
        .filter(|p| p.node.as_deref() == Some(node))
        .collect();
    on_node.sort_by(|a, b| a.key.cmp(&b.key));
    let mut to_move = Vec::new();
    for pod in on_node {
        match drainable(cfg, &pod, &budgets) {
            Drainable::Skip => {}
            Drainable::Move => to_move.push(pod),
            Drainable::Block(why) => return Ok(Err(why)),
        }
    }
    Ok(Ok(to_move))
}

enum Drainable {
    /// Not CA's to move (mirror and DaemonSet pods).
    Skip,
    Move,
    Block(Blocker),
}

/// CA's rules for one pod, first answer wins (`simulator/drainability/rules/rules.go`).
fn drainable(cfg: &Config, pod: &PodFacts, budgets: &[Budget]) -> Drainable {
    if pod.mirror() || pod.daemon() {
        return Drainable::Skip;
    }
    let safe_to_evict = pod.annotation(CA_SAFE_TO_EVICT);
    if safe_to_evict == Some("true") || pod.terminal() {
        return Drainable::Move;
    }
    let replicated = match &pod.owner_kind {
        Some(kind) => {
            !cfg.skip_nodes_with_custom_controller_pods || REPLICATED_KINDS.contains(&kind.as_str())
        }
        None => false,
    };
    if !replicated {
        return Drainable::Block(Blocker::NotReplicated {
            pod: pod.key.clone(),
            owner_kind: pod.owner_kind.clone(),
        });
    }
    if cfg.skip_nodes_with_system_pods && pod.namespace == "kube-system" {
        return Drainable::Block(Blocker::SystemPod {
            pod: pod.key.clone(),
        });
    }
    if safe_to_evict == Some("false") {
        return Drainable::Block(Blocker::NotSafeToEvict {
            pod: pod.key.clone(),
        });
    }
    if cfg.skip_nodes_with_local_storage && pod.local_storage {
        return Drainable::Block(Blocker::LocalStorage {
            pod: pod.key.clone(),
        });
    }
    if let Some(b) = Budget::matching(budgets, pod)
        .into_iter()
        .find(|b| b.allowed < 1)
    {
        return Drainable::Block(Blocker::PdbExhausted {
            pod: pod.key.clone(),
            pdb: format!("{}/{}", b.namespace, b.name),
        });
    }
    Drainable::Move
}

/// Adds (`mark`) or removes CA's taint, with the cordon when configured: a `PUT` of a fresh
/// copy of the Node, retried on 409 until `taint_conflict_deadline`. `Ok(false)` when the
/// conflicts outlasted it; a node that is gone has nothing to clean.
async fn set_mark(kube: &Kube, cfg: &Config, node: &str, mark: bool) -> Result<bool, Error> {
    let deadline = Instant::now() + cfg.taint_conflict_deadline;
    loop {
        let mut current = match kube.node(node).await {
            Ok(n) => n,
            Err(Error::NodeNotFound(_)) if !mark => return Ok(true),
            Err(e) => return Err(e),
        };
        let marked = has_taint(&current, CA_TO_BE_DELETED_TAINT, "NoSchedule");
        let cordoned = current.spec.as_ref().and_then(|s| s.unschedulable) == Some(true);
        let change_taint = marked != mark;
        let change_cordon = cfg.cordon_node_before_terminating && cordoned != mark;
        if !change_taint && !change_cordon {
            return Ok(true);
        }
        let mut taints = without_taint(&current, CA_TO_BE_DELETED_TAINT, "NoSchedule");
        if mark {
            taints.push(Taint {
                key: CA_TO_BE_DELETED_TAINT.to_string(),
                value: Some(Timestamp::now().as_second().to_string()),
                effect: "NoSchedule".to_string(),
                time_added: None,
            });
        }
        let spec = current.spec.get_or_insert_with(Default::default);
        if change_taint {
            spec.taints = Some(taints);
        }
        if change_cordon {
            spec.unschedulable = Some(mark);
        }
        match kube.replace_node(&current).await {
            Ok(_) => return Ok(true),
            Err(e) if status_code(&e) == Some(409) => {
                if Instant::now() >= deadline {
                    return Ok(false);
                }
                pause(cfg.taint_conflict_retry).await;
            }
            Err(e) if status_code(&e) == Some(404) && !mark => return Ok(true),
            Err(e) => return Err(api_err("update node", node)(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(
        annotations: serde_json::Value,
        owner: Option<&str>,
        labels: serde_json::Value,
    ) -> PodFacts {
        let mut raw = json!({
            "metadata": {
                "name": "p", "namespace": "default", "uid": "u",
                "annotations": annotations, "labels": labels,
            },
            "spec": { "nodeName": "n1", "containers": [{"name": "c"}] },
            "status": { "phase": "Running" },
        });
        if let Some(kind) = owner {
            raw["metadata"]["ownerReferences"] = json!([{
                "apiVersion": "x/v1", "kind": kind, "name": "o", "uid": "o1", "controller": true,
            }]);
        }
        PodFacts::parse(raw).unwrap()
    }

    fn blocked(d: Drainable) -> Option<Blocker> {
        match d {
            Drainable::Block(b) => Some(b),
            _ => None,
        }
    }

    #[test]
    fn rules_follow_cas_order() {
        let cfg = Config::default();
        let gs = |a| pod(a, Some("GameServer"), json!({}));
        assert!(matches!(
            drainable(&cfg, &gs(json!({CA_SAFE_TO_EVICT: "true"})), &[]),
            Drainable::Move
        ));
        // Not "true": the GameServer owner blocks before the annotation is looked at.
        assert!(matches!(
            blocked(drainable(
                &cfg,
                &gs(json!({CA_SAFE_TO_EVICT: "false"})),
                &[]
            )),
            Some(Blocker::NotReplicated { .. })
        ));
        assert!(matches!(
            blocked(drainable(&cfg, &gs(json!({})), &[])),
            Some(Blocker::NotReplicated { .. })
        ));
        let rs = |a| pod(a, Some("ReplicaSet"), json!({}));
        assert!(matches!(
            blocked(drainable(
                &cfg,
                &rs(json!({CA_SAFE_TO_EVICT: "false"})),
                &[]
            )),
            Some(Blocker::NotSafeToEvict { .. })
        ));
        assert!(matches!(
            drainable(&cfg, &rs(json!({})), &[]),
            Drainable::Move
        ));
        assert!(matches!(
            drainable(&cfg, &pod(json!({}), Some("DaemonSet"), json!({})), &[]),
            Drainable::Skip
        ));
        let lax = Config {
            skip_nodes_with_custom_controller_pods: false,
            ..Config::default()
        };
        assert!(matches!(
            drainable(&lax, &gs(json!({})), &[]),
            Drainable::Move
        ));
    }

    #[test]
    fn an_exhausted_budget_blocks_unless_the_pod_says_true() {
        let cfg = Config::default();
        let pdb: k8s_openapi::api::policy::v1::PodDisruptionBudget =
            serde_json::from_value(crate::cluster::agones::agones_pdb("default")).unwrap();
        let label = json!({"agones.dev/safe-to-evict": "false"});
        let plain = pod(json!({}), Some("ReplicaSet"), label.clone());
        let budgets = Budget::compute(&[pdb], std::slice::from_ref(&plain));
        assert_eq!(budgets[0].allowed, 0);
        assert!(matches!(
            blocked(drainable(&cfg, &plain, &budgets)),
            Some(Blocker::PdbExhausted { .. })
        ));
        let says_true = pod(json!({CA_SAFE_TO_EVICT: "true"}), Some("GameServer"), label);
        assert!(matches!(
            drainable(&cfg, &says_true, &budgets),
            Drainable::Move
        ));
    }
}
