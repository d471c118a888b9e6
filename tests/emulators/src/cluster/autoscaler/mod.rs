//! Node autoscalers, modelled from their sources: Cluster Autoscaler and Karpenter.
//!
//! Both are off unless a test creates one ([`crate::cluster::Cluster::cluster_autoscaler`],
//! [`crate::cluster::Cluster::karpenter`]), and both are driven by a test call naming the
//! node (`scale_down`, `disrupt`) instead of by utilization. Everything they do goes over
//! HTTP with a `kube::Client` of their own identity, so the emulator's journal shows each
//! taint, eviction and delete they issue, and a test can race the allocator (or lastcall)
//! against them. Every wait is a configurable [`Duration`], so tests run them with
//! milliseconds where the real defaults are seconds or minutes.
//!
//! `docs/autoscalers.md` §2–§3 hold the findings from their sources and §6 the rules this
//! module follows; `docs/testing/cluster-model.md` lists what is modelled and what is not.

pub mod cluster_autoscaler;
pub mod karpenter;

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, Node, ObjectReference, Pod, Toleration};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, EvictParams, ListParams, PostParams, Preconditions};
use serde_json::Value;
use tokio::task::JoinHandle;

use crate::kube::eviction::{desired_healthy, is_healthy};
use crate::kube::selectors::LabelSelector;

use super::objects::PodPhase;

pub use cluster_autoscaler::ClusterAutoscaler;
pub use karpenter::Karpenter;

/// Identity (bearer token) of the Cluster Autoscaler's requests in the journal.
pub const CLUSTER_AUTOSCALER_IDENTITY: &str = "cluster-autoscaler";
/// Identity (bearer token) of Karpenter's requests in the journal.
pub const KARPENTER_IDENTITY: &str = "karpenter";

/// The keys both autoscalers read and write.
pub mod keys {
    /// Pod annotation CA reads: `"true"` makes any pod drainable, `"false"` blocks.
    pub use super::super::objects::keys::CA_SAFE_TO_EVICT;
    /// Node annotation: CA never scales the node down when it is `"true"`.
    pub const CA_SCALE_DOWN_DISABLED: &str = "cluster-autoscaler.kubernetes.io/scale-down-disabled";
    /// CA's hard taint (`<unix seconds>:NoSchedule`) on a node it is deleting.
    pub const CA_TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";
    /// Pod or node annotation: Karpenter's graceful methods never pick the node, its drain
    /// never evicts the pod.
    pub const KARPENTER_DO_NOT_DISRUPT: &str = "karpenter.sh/do-not-disrupt";
    /// Karpenter's taint (no value, `NoSchedule`) on a node it is terminating.
    pub const KARPENTER_DISRUPTED_TAINT: &str = "karpenter.sh/disrupted";
    /// Node label Karpenter sets with its taint, value `karpenter`.
    pub const EXCLUDE_FROM_LB_LABEL: &str =
        "node.kubernetes.io/exclude-from-external-load-balancers";
    /// Pod annotation of a mirror (static) pod; neither autoscaler evicts those.
    pub const MIRROR_POD_ANNOTATION: &str = "kubernetes.io/config.mirror";
}

/// Why an autoscaler run could not finish with an [`Outcome`](cluster_autoscaler::Outcome).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An API call failed in a way the modelled autoscaler does not retry.
    #[error("{action} {name:?}")]
    Api {
        action: &'static str,
        name: String,
        #[source]
        source: Box<kube::Error>,
    },
    /// The node named in the call does not exist (or vanished mid-run).
    #[error("node {0:?} not found")]
    NodeNotFound(String),
    /// The background task panicked (a bug in the model).
    #[error("the autoscaler task failed")]
    Task(#[source] tokio::task::JoinError),
}

fn api_err(action: &'static str, name: &str) -> impl FnOnce(kube::Error) -> Error {
    let name = name.to_string();
    move |source| Error::Api {
        action,
        name,
        source: Box::new(source),
    }
}

/// A run in the background; await it for its outcome.
///
/// Dropping the handle stops the run where it is (nothing is cleaned up), so a test that
/// ends early leaves no task writing to a stopped emulator.
#[must_use = "dropping the handle stops the run"]
pub struct Run<T> {
    task: JoinHandle<Result<T, Error>>,
}

impl<T: Send + 'static> Run<T> {
    fn spawn(fut: impl Future<Output = Result<T, Error>> + Send + 'static) -> Self {
        Run {
            task: tokio::spawn(fut),
        }
    }
}

impl<T> Run<T> {
    /// Whether the run has ended (awaiting it then returns at once).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

impl<T> Future for Run<T> {
    type Output = Result<T, Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.task)
            .poll(cx)
            .map(|joined| joined.map_err(Error::Task).and_then(|r| r))
    }
}

impl<T> Drop for Run<T> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What the autoscalers read from a pod, parsed once.
#[derive(Debug, Clone)]
pub(crate) struct PodFacts {
    /// `namespace/name`, as outcomes and blockers name pods.
    pub key: String,
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub node: Option<String>,
    pub phase: PodPhase,
    pub deletion: Option<Timestamp>,
    /// `spec.terminationGracePeriodSeconds` (Kubernetes' 30 when unset).
    pub grace_seconds: i64,
    pub annotations: BTreeMap<String, String>,
    /// Kind of the controller ownerReference.
    pub owner_kind: Option<String>,
    pub local_storage: bool,
    pub tolerations: Vec<Toleration>,
    pub priority_class: Option<String>,
    /// The pod as JSON, for label selectors and the PDB health rule.
    pub raw: Value,
}

impl PodFacts {
    /// Parses a pod; `None` (logged) when it does not parse: an autoscaler that cannot
    /// read a pod does not act on it.
    pub fn parse(raw: Value) -> Option<PodFacts> {
        let pod: Pod = match serde_json::from_value(raw.clone()) {
            Ok(p) => p,
            Err(error) => {
                tracing::debug!(%error, "autoscaler model skips a pod it cannot read");
                return None;
            }
        };
        let meta = pod.metadata;
        let spec = pod.spec.unwrap_or_default();
        let namespace = meta.namespace.unwrap_or_default();
        let name = meta.name.unwrap_or_default();
        let owner_kind = meta
            .owner_references
            .unwrap_or_default()
            .into_iter()
            .find(|o| o.controller == Some(true))
            .map(|o| o.kind);
        let local_storage = spec
            .volumes
            .as_deref()
            .unwrap_or_default()
            .iter()
            .any(|v| v.empty_dir.is_some() || v.host_path.is_some());
        Some(PodFacts {
            key: format!("{namespace}/{name}"),
            namespace,
            name,
            uid: meta.uid.unwrap_or_default(),
            node: spec.node_name.filter(|n| !n.is_empty()),
            phase: PodPhase::parse(pod.status.as_ref().and_then(|s| s.phase.as_deref())),
            deletion: meta.deletion_timestamp.map(|t| t.0),
            grace_seconds: spec.termination_grace_period_seconds.unwrap_or(30).max(0),
            annotations: meta.annotations.unwrap_or_default(),
            owner_kind,
            local_storage,
            tolerations: spec.tolerations.unwrap_or_default(),
            priority_class: spec.priority_class_name,
            raw,
        })
    }

    pub fn annotation(&self, key: &str) -> Option<&str> {
        self.annotations.get(key).map(String::as_str)
    }

    pub fn terminal(&self) -> bool {
        self.phase.is_finished()
    }

    pub fn terminating(&self) -> bool {
        self.deletion.is_some()
    }

    pub fn daemon(&self) -> bool {
        self.owner_kind.as_deref() == Some("DaemonSet")
    }

    /// A static pod's mirror (owned by the Node); no autoscaler evicts or waits for it.
    pub fn mirror(&self) -> bool {
        self.annotations.contains_key(keys::MIRROR_POD_ANNOTATION)
            || self.owner_kind.as_deref() == Some("Node")
    }
}

/// A PodDisruptionBudget with the disruptions it allows now.
#[derive(Debug, Clone)]
pub(crate) struct Budget {
    pub namespace: String,
    pub name: String,
    selector: LabelSelector,
    /// `status.disruptionsAllowed` as the disruption controller would compute it.
    pub allowed: i64,
}

impl Budget {
    /// Every PDB with its allowance, from the pods the caller listed (all namespaces).
    ///
    /// The emulator keeps no PDB status (no disruption controller), so the allowance is
    /// computed here with the same rule the eviction subresource applies.
    pub fn compute(pdbs: &[PodDisruptionBudget], pods: &[PodFacts]) -> Vec<Budget> {
        pdbs.iter()
            .filter_map(|pdb| {
                let raw = serde_json::to_value(pdb).ok()?;
                let namespace = pdb.metadata.namespace.clone().unwrap_or_default();
                let name = pdb.metadata.name.clone().unwrap_or_default();
                // A PDB without a selector selects nothing.
                let sel = raw.pointer("/spec/selector").filter(|s| !s.is_null())?;
                let selector = match LabelSelector::from_object(sel) {
                    Ok(s) => s,
                    Err(error) => {
                        tracing::debug!(%error, namespace, name, "autoscaler model skips a PDB it cannot read");
                        return None;
                    }
                };
                let selected: Vec<&PodFacts> = pods
                    .iter()
                    .filter(|p| p.namespace == namespace && selector.matches(&p.raw))
                    .collect();
                let expected = selected.len() as i64;
                let healthy = selected.iter().filter(|p| is_healthy(&p.raw)).count() as i64;
                let desired = desired_healthy(&raw, expected).ok()?;
                Some(Budget {
                    namespace,
                    name,
                    selector,
                    allowed: (healthy - desired).max(0),
                })
            })
            .collect()
    }

    pub fn matching<'a>(budgets: &'a [Budget], pod: &PodFacts) -> Vec<&'a Budget> {
        budgets
            .iter()
            .filter(|b| b.namespace == pod.namespace && b.selector.matches(&pod.raw))
            .collect()
    }
}

/// The API calls both autoscalers make, with their identity's client.
#[derive(Clone)]
pub(crate) struct Kube {
    client: kube::Client,
}

impl Kube {
    pub fn new(client: kube::Client) -> Self {
        Kube { client }
    }

    fn nodes(&self) -> Api<Node> {
        Api::all(self.client.clone())
    }

    /// The node, or [`Error::NodeNotFound`].
    pub async fn node(&self, name: &str) -> Result<Node, Error> {
        self.nodes()
            .get_opt(name)
            .await
            .map_err(api_err("get node", name))?
            .ok_or_else(|| Error::NodeNotFound(name.to_string()))
    }

    /// `PUT` of the node; the resourceVersion it carries makes a stale write a 409.
    pub async fn replace_node(&self, node: &Node) -> Result<Node, kube::Error> {
        let name = node.metadata.name.clone().unwrap_or_default();
        self.nodes()
            .replace(&name, &PostParams::default(), node)
            .await
    }

    pub async fn patch_node(
        &self,
        name: &str,
        patch: &kube::api::Patch<Value>,
    ) -> Result<Node, Error> {
        self.nodes()
            .patch(name, &kube::api::PatchParams::default(), patch)
            .await
            .map_err(api_err("patch node", name))
    }

    /// Deletes the node (it stands in for the instance); gone already counts as done.
    pub async fn delete_node(&self, name: &str) -> Result<(), Error> {
        match self.nodes().delete(name, &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(api_err("delete node", name)(e)),
        }
    }

    /// Every pod (both autoscalers watch all pods; PDB allowances need the whole namespace).
    pub async fn all_pods(&self) -> Result<Vec<PodFacts>, Error> {
        self.list_pods(&ListParams::default()).await
    }

    /// The pods bound to `node` (a `spec.nodeName` field selector).
    pub async fn pods_on(&self, node: &str) -> Result<Vec<PodFacts>, Error> {
        self.list_pods(&ListParams::default().fields(&format!("spec.nodeName={node}")))
            .await
    }

    async fn list_pods(&self, lp: &ListParams) -> Result<Vec<PodFacts>, Error> {
        let list = Api::<Pod>::all(self.client.clone())
            .list(lp)
            .await
            .map_err(api_err("list pods", ""))?;
        Ok(list
            .items
            .into_iter()
            .filter_map(|p| serde_json::to_value(p).ok())
            .filter_map(PodFacts::parse)
            .collect())
    }

    pub async fn pdbs(&self) -> Result<Vec<PodDisruptionBudget>, Error> {
        Ok(Api::<PodDisruptionBudget>::all(self.client.clone())
            .list(&ListParams::default())
            .await
            .map_err(api_err("list poddisruptionbudgets", ""))?
            .items)
    }

    /// One eviction (`POST pods/{name}/eviction`).
    pub async fn evict(
        &self,
        pod: &PodFacts,
        grace_seconds: Option<i64>,
        with_uid: bool,
    ) -> Result<(), kube::Error> {
        let params = EvictParams {
            delete_options: Some(DeleteParams {
                grace_period_seconds: grace_seconds.map(|g| g.clamp(0, i64::from(u32::MAX)) as u32),
                preconditions: with_uid.then(|| Preconditions {
                    uid: Some(pod.uid.clone()),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            }),
            post_options: PostParams::default(),
        };
        Api::<Pod>::namespaced(self.client.clone(), &pod.namespace)
            .evict(&pod.name, &params)
            .await
            .map(drop)
    }

    /// A pod `DELETE` with a grace period and a UID precondition (no PDB check).
    pub async fn delete_pod(&self, pod: &PodFacts, grace_seconds: i64) -> Result<(), kube::Error> {
        let params = DeleteParams {
            grace_period_seconds: Some(grace_seconds.clamp(0, i64::from(u32::MAX)) as u32),
            preconditions: Some(Preconditions {
                uid: Some(pod.uid.clone()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        Api::<Pod>::namespaced(self.client.clone(), &pod.namespace)
            .delete(&pod.name, &params)
            .await
            .map(drop)
    }

    /// A Warning Event on the node (namespace `default`, where events about
    /// cluster-scoped objects go). Failing to record one is logged, never fatal.
    pub async fn warn_node(&self, node: &str, component: &str, reason: &str, message: &str) {
        let now = Time(Timestamp::now());
        let event = Event {
            metadata: ObjectMeta {
                name: Some(format!("{node}.{:x}", Timestamp::now().as_nanosecond())),
                namespace: Some("default".into()),
                ..ObjectMeta::default()
            },
            involved_object: ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Node".into()),
                name: Some(node.to_string()),
                ..ObjectReference::default()
            },
            reason: Some(reason.to_string()),
            message: Some(message.to_string()),
            type_: Some("Warning".into()),
            source: Some(k8s_openapi::api::core::v1::EventSource {
                component: Some(component.to_string()),
                host: None,
            }),
            first_timestamp: Some(now.clone()),
            last_timestamp: Some(now),
            count: Some(1),
            ..Event::default()
        };
        let res = Api::<Event>::namespaced(self.client.clone(), "default")
            .create(&PostParams::default(), &event)
            .await;
        if let Err(error) = res {
            tracing::warn!(%error, node, reason, "autoscaler model could not record an Event");
        }
    }
}

/// The status code of an API answer (`None` for transport errors).
pub(crate) fn status_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    }
}

/// The node's taints, without the one of `key` and `effect`.
pub(crate) fn without_taint(
    node: &Node,
    key: &str,
    effect: &str,
) -> Vec<k8s_openapi::api::core::v1::Taint> {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default()
        .into_iter()
        .filter(|t| !(t.key == key && t.effect == effect))
        .collect()
}

pub(crate) fn has_taint(node: &Node, key: &str, effect: &str) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|ts| ts.iter().any(|t| t.key == key && t.effect == effect))
}

pub(crate) fn node_annotation<'a>(node: &'a Node, key: &str) -> Option<&'a str> {
    node.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
}

/// Sleeps `d`; a zero duration yields once, so loops stay cooperative.
pub(crate) async fn pause(d: Duration) {
    if d.is_zero() {
        tokio::task::yield_now().await;
    } else {
        tokio::time::sleep(d).await;
    }
}
