//! Karpenter v1's disruption of one node, as `docs/autoscalers.md` §3 reads it from
//! Karpenter's sources (`pkg/controllers/disruption`, `pkg/controllers/node/termination`).
//!
//! [`Karpenter::disrupt`] runs the steps of §6 in the background:
//! 1. *pick* (graceful and eventual methods only): refuse when the node or an active pod
//!    says `karpenter.sh/do-not-disrupt: "true"`, or a PDB matching an evictable pod allows
//!    no disruption; emptiness also needs no running workload pod. Drift with a
//!    termination grace period (TGP) ignores the pod blockers;
//! 2. consolidation and emptiness wait `validation` and pick again; then the node gets
//!    `karpenter.sh/disrupted:NoSchedule` (and the exclude-from-load-balancers label), and
//!    `replacement_ready` passes while the replacement comes up (a failure removes the
//!    taint);
//! 3. *terminate* (every method; forceful ones start here): taint if missing, then every
//!    `drain_interval` re-list the node's pods and queue the evictable ones of the first
//!    tier that still has pods. The queue evicts by name and UID, retries with backoff,
//!    and never looks at the pod again; `do-not-disrupt` and terminating pods are not
//!    evicted but waited for;
//! 4. with a TGP, each pod still there at `deadline − its grace` is deleted with the time
//!    left as its grace (PDBs and `do-not-disrupt` notwithstanding), and the Node is deleted
//!    at the deadline. Without one Karpenter waits forever; the model stops after
//!    `give_up_after` and reports [`Outcome::Waiting`], leaving the node tainted.

use std::collections::HashSet;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Taint;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::super::objects::tolerates;
use super::keys::{EXCLUDE_FROM_LB_LABEL, KARPENTER_DISRUPTED_TAINT, KARPENTER_DO_NOT_DISRUPT};
use super::{
    Budget, Error, Kube, PodFacts, Run, api_err, has_taint, node_annotation, pause, status_code,
};

/// Priority classes Karpenter drains last (`terminator.go` groups).
const CRITICAL_PRIORITY_CLASSES: [&str; 2] = ["system-cluster-critical", "system-node-critical"];

/// How Karpenter came to disrupt the node; it decides which checks run
/// (`disruption/types.go` classes; KPA `concepts/disruption.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// Graceful: pick, validate after `validation`, taint, replace, terminate.
    Consolidation,
    /// Graceful, and the node must hold no running workload pod.
    Emptiness,
    /// Eventual: pick (pod blockers ignored with a TGP), taint, replace, terminate.
    Drift,
    /// Forceful (`expireAfter`): terminate at once, no check.
    Expiration,
    /// Forceful (Spot interruption, rebalance, health event): terminate at once.
    Interruption,
    /// Forceful (`kubectl delete node`): terminate at once.
    Manual,
}

impl Method {
    fn graceful(self) -> bool {
        matches!(self, Method::Consolidation | Method::Emptiness)
    }

    fn forceful(self) -> bool {
        matches!(
            self,
            Method::Expiration | Method::Interruption | Method::Manual
        )
    }
}

/// Karpenter's timings for one disruption; the defaults are Karpenter's
/// (`docs/autoscalers.md` §6) except `give_up_after`, which only the model has.
#[derive(Debug, Clone)]
pub struct Config {
    /// Consolidation's wait before re-validating its candidates (default 15 s).
    pub validation: Duration,
    /// From the taint to the replacement being ready (default 5 s).
    pub replacement_ready: Duration,
    /// The replacement fails to launch: the taint comes off and nothing else happens.
    pub fail_replacement: bool,
    /// The NodeClaim's `terminationGracePeriod` (default none).
    pub termination_grace_period: Option<Duration>,
    /// Time between drain passes (default 1 s).
    pub drain_interval: Duration,
    /// First retry delay of a refused eviction (default 100 ms); doubles up to the max.
    pub eviction_backoff_min: Duration,
    /// Longest retry delay of a refused eviction (default 10 s).
    pub eviction_backoff_max: Duration,
    /// A terminating pod stops being waited for this long after its deletionTimestamp
    /// (default 1 min).
    pub stuck_terminating_after: Duration,
    /// Model only: stop waiting for the drain after this long (default 60 s) and report
    /// [`Outcome::Waiting`] (Karpenter itself waits forever without a TGP).
    pub give_up_after: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            validation: Duration::from_secs(15),
            replacement_ready: Duration::from_secs(5),
            fail_replacement: false,
            termination_grace_period: None,
            drain_interval: Duration::from_secs(1),
            eviction_backoff_min: Duration::from_millis(100),
            eviction_backoff_max: Duration::from_secs(10),
            stuck_terminating_after: Duration::from_secs(60),
            give_up_after: Duration::from_secs(60),
        }
    }
}

/// What keeps a graceful method from picking the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Blocker {
    /// The node has `karpenter.sh/do-not-disrupt: "true"`.
    NodeDoNotDisrupt,
    /// An active pod has `karpenter.sh/do-not-disrupt: "true"`.
    PodDoNotDisrupt { pod: String },
    /// A PDB matching an evictable pod allows no disruption.
    PdbExhausted { pod: String, pdb: String },
    /// More than one PDB matches an evictable pod (the Eviction API would refuse it).
    MultiplePdbs { pod: String },
    /// Emptiness only: a workload pod still runs.
    NotEmpty { pod: String },
}

impl fmt::Display for Blocker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Blocker::NodeDoNotDisrupt => {
                write!(f, "node has {KARPENTER_DO_NOT_DISRUPT}=true")
            }
            Blocker::PodDoNotDisrupt { pod } => {
                write!(f, "pod {pod} has {KARPENTER_DO_NOT_DISRUPT}=true")
            }
            Blocker::PdbExhausted { pod, pdb } => {
                write!(f, "pdb {pdb} prevents pod evictions ({pod})")
            }
            Blocker::MultiplePdbs { pod } => write!(f, "pod {pod} has multiple PDBs"),
            Blocker::NotEmpty { pod } => write!(f, "node is not empty ({pod})"),
        }
    }
}

/// What a disruption did. Pod lists are `namespace/name`, sorted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The pick (or the validation after `validation`) found a blocker; nothing was written.
    Refused { why: Blocker },
    /// The replacement failed; the taint was removed.
    ReplacementFailed,
    /// The Node was deleted: drained (`at_deadline` false) or at the TGP deadline.
    /// `evicted` were evicted, `deleted` deleted at `deadline − grace`.
    NodeDeleted {
        evicted: Vec<String>,
        deleted: Vec<String>,
        at_deadline: bool,
    },
    /// `give_up_after` passed with `remaining` still on the node (no TGP, or a TGP longer
    /// than that); the node stays tainted, as Karpenter would keep draining it.
    Waiting {
        remaining: Vec<String>,
        evicted: Vec<String>,
    },
}

/// A modelled Karpenter; cheap to clone.
#[derive(Clone)]
pub struct Karpenter {
    kube: Kube,
    cfg: Arc<Config>,
}

impl Karpenter {
    /// A Karpenter acting with `client` (build it without kube's 429 retry, so the eviction
    /// backoff is Karpenter's; [`crate::cluster::Cluster::karpenter`] does).
    pub fn new(client: kube::Client, cfg: Config) -> Self {
        Karpenter {
            kube: Kube::new(client),
            cfg: Arc::new(cfg),
        }
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Registers `node` as one Karpenter launched: creates its NodeClaim (`<node>-claim`,
    /// with `spec` and the termination finalizer) and makes it the Node's owner, as
    /// registration does (`ownerReferences`, kind `NodeClaim`). Returns the NodeClaim.
    pub async fn launch(&self, node: &str, spec: &NodeClaimSpec) -> Result<Value, Error> {
        launch(&self.kube, node, spec).await
    }

    /// The expiration controller for `node`'s NodeClaim, in the background: at
    /// `creationTimestamp + spec.expireAfter` it deletes the NodeClaim, then the
    /// termination controller takes the node as for any forceful method, with the
    /// NodeClaim's `terminationGracePeriod` (taint, `nodeclaim-termination-timestamp` =
    /// deletion + grace, drain, pods deleted at `deadline − grace`, Node deleted). Once the
    /// Node is gone the finalizer comes off and the NodeClaim with it. `Ok(None)`:
    /// `expireAfter: Never`, nothing happens.
    pub fn expire(&self, node: &str) -> Run<Option<Outcome>> {
        let (kube, cfg, node) = (self.kube.clone(), self.cfg.clone(), node.to_string());
        Run::spawn(async move { expire(&kube, &cfg, &node).await })
    }

    /// Disrupts `node` by `method` in the background; await the handle for the [`Outcome`].
    pub fn disrupt(&self, node: &str, method: Method) -> Run<Outcome> {
        let (kube, cfg, node) = (self.kube.clone(), self.cfg.clone(), node.to_string());
        Run::spawn(async move { disrupt(&kube, &cfg, &node, method).await })
    }
}

async fn disrupt(kube: &Kube, cfg: &Config, node: &str, method: Method) -> Result<Outcome, Error> {
    if !method.forceful() {
        if let Some(why) = blocker(kube, cfg, node, method).await? {
            return Ok(Outcome::Refused { why });
        }
        if method.graceful() {
            pause(cfg.validation).await;
            if let Some(why) = blocker(kube, cfg, node, method).await? {
                return Ok(Outcome::Refused { why });
            }
        }
        set_taint(kube, node, true).await?;
        pause(cfg.replacement_ready).await;
        if cfg.fail_replacement {
            set_taint(kube, node, false).await?;
            return Ok(Outcome::ReplacementFailed);
        }
    }
    terminate(kube, cfg, node, cfg.termination_grace_period).await
}

/// What a NodeClaim's spec says about its end, as the NodePool copied it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeClaimSpec {
    /// `spec.expireAfter`: a Go duration (`720h`, `45s`) or `Never`.
    pub expire_after: String,
    /// `spec.terminationGracePeriod`, a Go duration.
    pub termination_grace_period: Option<String>,
}

/// Karpenter v1's NodeClaim type.
pub const NODECLAIM_API_VERSION: &str = "karpenter.sh/v1";
/// The finalizer Karpenter keeps on a NodeClaim until its node is gone.
pub const TERMINATION_FINALIZER: &str = "karpenter.sh/termination";

/// The name of `node`'s NodeClaim in the model.
pub fn nodeclaim_name(node: &str) -> String {
    format!("{node}-claim")
}

fn nodeclaims(kube: &Kube) -> Api<DynamicObject> {
    let ar = ApiResource {
        group: "karpenter.sh".into(),
        version: "v1".into(),
        api_version: NODECLAIM_API_VERSION.into(),
        kind: "NodeClaim".into(),
        plural: "nodeclaims".into(),
    };
    Api::all_with(kube.client.clone(), &ar)
}

/// The whole-second Go durations the model's NodeClaims use (`45s`, `1h30m`, `720h`).
pub fn go_duration(s: &str) -> Option<Duration> {
    let mut total = 0u64;
    let mut n = String::new();
    for c in s.chars() {
        if c.is_ascii_digit() {
            n.push(c);
            continue;
        }
        let unit = match c {
            'h' => 3600,
            'm' => 60,
            's' => 1,
            _ => return None,
        };
        total += n.parse::<u64>().ok()? * unit;
        n.clear();
    }
    (n.is_empty() && !s.is_empty()).then(|| Duration::from_secs(total))
}

async fn launch(kube: &Kube, node: &str, spec: &NodeClaimSpec) -> Result<Value, Error> {
    let name = nodeclaim_name(node);
    let mut body = json!({
        "apiVersion": NODECLAIM_API_VERSION,
        "kind": "NodeClaim",
        "metadata": {
            "name": name,
            "labels": { "karpenter.sh/nodepool": "default" },
            "finalizers": [TERMINATION_FINALIZER],
        },
        "spec": {
            "expireAfter": spec.expire_after,
            "nodeClassRef": { "group": "eks.amazonaws.com", "kind": "NodeClass", "name": "default" },
            "requirements": [],
        },
    });
    if let Some(g) = &spec.termination_grace_period {
        body["spec"]["terminationGracePeriod"] = json!(g);
    }
    let obj: DynamicObject = serde_json::from_value(body).map_err(|e| Error::Api {
        action: "build nodeclaim",
        name: name.clone(),
        source: Box::new(kube::Error::SerdeError(e)),
    })?;
    let api = nodeclaims(kube);
    let created = api
        .create(&PostParams::default(), &obj)
        .await
        .map_err(api_err("create nodeclaim", &name))?;
    api.patch_status(
        &name,
        &PatchParams::default(),
        &Patch::Merge(json!({ "status": { "nodeName": node } })),
    )
    .await
    .map_err(api_err("patch nodeclaim status", &name))?;
    let uid = created.metadata.uid.clone().unwrap_or_default();
    kube.patch_node(
        node,
        &Patch::Merge(json!({ "metadata": {
            "labels": { "karpenter.sh/nodepool": "default", "karpenter.sh/registered": "true" },
            "ownerReferences": [{
                "apiVersion": NODECLAIM_API_VERSION,
                "kind": "NodeClaim",
                "name": name,
                "uid": uid,
                "blockOwnerDeletion": true,
            }],
        } })),
    )
    .await?;
    serde_json::to_value(&created).map_err(|e| Error::Api {
        action: "read nodeclaim",
        name,
        source: Box::new(kube::Error::SerdeError(e)),
    })
}

async fn expire(kube: &Kube, cfg: &Config, node: &str) -> Result<Option<Outcome>, Error> {
    let name = nodeclaim_name(node);
    let api = nodeclaims(kube);
    let claim = api
        .get(&name)
        .await
        .map_err(api_err("get nodeclaim", &name))?;
    let spec = |k: &str| {
        claim
            .data
            .pointer(&format!("/spec/{k}"))
            .and_then(|v| v.as_str())
    };
    let expire_after = spec("expireAfter").unwrap_or("720h");
    if expire_after == "Never" {
        return Ok(None);
    }
    let bad = |what: &str| Error::Api {
        action: "read nodeclaim",
        name: name.clone(),
        source: Box::new(kube::Error::Service(what.to_string().into())),
    };
    let after = go_duration(expire_after).ok_or_else(|| bad("spec.expireAfter"))?;
    let tgp = match spec("terminationGracePeriod") {
        Some(g) => Some(go_duration(g).ok_or_else(|| bad("spec.terminationGracePeriod"))?),
        None => None,
    };
    let created = claim
        .metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0)
        .ok_or_else(|| bad("metadata.creationTimestamp"))?;
    let expiry = created
        .checked_add(k8s_openapi::jiff::SignedDuration::try_from(after).unwrap_or_default())
        .unwrap_or(created);
    let left = expiry.duration_since(k8s_openapi::jiff::Timestamp::now());
    if left.is_positive() {
        pause(Duration::try_from(left).unwrap_or_default()).await;
    }
    // Forceful: the NodeClaim is deleted (its finalizer holds it), and the node terminated.
    api.delete(&name, &DeleteParams::default())
        .await
        .map_err(api_err("delete nodeclaim", &name))?;
    let outcome = terminate(kube, cfg, node, tgp).await?;
    api.patch(
        &name,
        &PatchParams::default(),
        &Patch::Merge(json!({ "metadata": { "finalizers": null } })),
    )
    .await
    .map_err(api_err("remove nodeclaim finalizer", &name))?;
    Ok(Some(outcome))
}

/// The pick of a graceful or eventual method (`types.go` `NewCandidate`).
async fn blocker(
    kube: &Kube,
    cfg: &Config,
    node: &str,
    method: Method,
) -> Result<Option<Blocker>, Error> {
    let current = kube.node(node).await?;
    if node_annotation(&current, KARPENTER_DO_NOT_DISRUPT) == Some("true") {
        return Ok(Some(Blocker::NodeDoNotDisrupt));
    }
    let pdbs = kube.pdbs().await?;
    let pods = kube.all_pods().await?;
    let budgets = Budget::compute(&pdbs, &pods);
    let mut on_node: Vec<&PodFacts> = pods
        .iter()
        .filter(|p| p.node.as_deref() == Some(node))
        .collect();
    on_node.sort_by(|a, b| a.key.cmp(&b.key));
    let pod_blockers_apply = !(method == Method::Drift && cfg.termination_grace_period.is_some());
    if pod_blockers_apply {
        if let Some(p) = on_node.iter().find(|p| active(p) && do_not_disrupt(p)) {
            return Ok(Some(Blocker::PodDoNotDisrupt { pod: p.key.clone() }));
        }
        for p in on_node.iter().filter(|p| evictable(p)) {
            let matching = Budget::matching(&budgets, p);
            if matching.len() > 1 {
                return Ok(Some(Blocker::MultiplePdbs { pod: p.key.clone() }));
            }
            if let Some(b) = matching.into_iter().find(|b| b.allowed == 0) {
                return Ok(Some(Blocker::PdbExhausted {
                    pod: p.key.clone(),
                    pdb: format!("{}/{}", b.namespace, b.name),
                }));
            }
        }
    }
    if method == Method::Emptiness
        && let Some(p) = on_node
            .iter()
            .find(|p| active(p) && !p.daemon() && !p.mirror())
    {
        return Ok(Some(Blocker::NotEmpty { pod: p.key.clone() }));
    }
    Ok(None)
}

/// The termination controller's drain, then the Node delete (steps 3–4).
async fn terminate(
    kube: &Kube,
    cfg: &Config,
    node: &str,
    tgp: Option<Duration>,
) -> Result<Outcome, Error> {
    let start = Instant::now();
    let deadline = tgp.map(|tgp| start + tgp);
    if let Some(tgp) = tgp {
        // Karpenter writes the node's deadline where the node's agents can read it.
        let at = k8s_openapi::jiff::Timestamp::now()
            .checked_add(k8s_openapi::jiff::SignedDuration::try_from(tgp).unwrap_or_default())
            .unwrap_or_else(|_| k8s_openapi::jiff::Timestamp::now());
        let patch = json!({ "metadata": { "annotations": {
            TERMINATION_TIMESTAMP_ANNOTATION: at.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
        } } });
        kube.patch_node(node, &Patch::Merge(patch)).await?;
    }
    let give_up = start + cfg.give_up_after;
    let evicted: Arc<Mutex<Vec<String>>> = Arc::default();
    // Dropped on return, which stops whatever the queue is still retrying.
    let mut queue: JoinSet<()> = JoinSet::new();
    let mut queued: HashSet<String> = HashSet::new();
    let mut deleted: Vec<String> = Vec::new();
    let mut deleted_uids: HashSet<String> = HashSet::new();
    let done = |evicted: &Arc<Mutex<Vec<String>>>, deleted: &mut Vec<String>| {
        let mut e = evicted.lock().unwrap_or_else(|p| p.into_inner()).clone();
        e.sort();
        deleted.sort();
        (e, std::mem::take(deleted))
    };
    loop {
        set_taint(kube, node, true).await?;
        let now = Instant::now();
        if deadline.is_some_and(|d| now >= d) {
            kube.delete_node(node).await?;
            let (evicted, deleted) = done(&evicted, &mut deleted);
            return Ok(Outcome::NodeDeleted {
                evicted,
                deleted,
                at_deadline: true,
            });
        }
        let pods = kube.pods_on(node).await?;
        let waiting: Vec<&PodFacts> = pods.iter().filter(|p| waits_for(cfg, p)).collect();
        if let Some(d) = deadline {
            for p in &waiting {
                if deleted_uids.contains(&p.uid) || now + grace(p) < d {
                    continue;
                }
                let left = d.saturating_duration_since(now).as_secs();
                match kube
                    .delete_pod(p, i64::try_from(left).unwrap_or(i64::MAX))
                    .await
                {
                    Ok(()) => {
                        deleted_uids.insert(p.uid.clone());
                        deleted.push(p.key.clone());
                    }
                    Err(e) if matches!(status_code(&e), Some(404 | 409)) => {
                        deleted_uids.insert(p.uid.clone());
                    }
                    Err(error) => {
                        tracing::debug!(pod = %p.key, %error, "karpenter model: delete failed; next pass retries");
                    }
                }
            }
        }
        if waiting.is_empty() {
            kube.delete_node(node).await?;
            let (evicted, deleted) = done(&evicted, &mut deleted);
            return Ok(Outcome::NodeDeleted {
                evicted,
                deleted,
                at_deadline: false,
            });
        }
        if let Some(tier) = first_tier(&waiting) {
            for p in tier.into_iter().filter(|p| evictable(p)) {
                if queued.insert(p.uid.clone()) {
                    queue.spawn(evict(kube.clone(), cfg.clone(), p.clone(), evicted.clone()));
                }
            }
        }
        if now >= give_up {
            let mut remaining: Vec<String> = waiting.iter().map(|p| p.key.clone()).collect();
            remaining.sort();
            let (evicted, _) = done(&evicted, &mut deleted);
            return Ok(Outcome::Waiting { remaining, evicted });
        }
        let mut wake = (now + cfg.drain_interval).min(give_up);
        if let Some(d) = deadline {
            wake = wake.min(d);
            for p in &waiting {
                if let Some(at) = d.checked_sub(grace(p))
                    && at > now
                    && !deleted_uids.contains(&p.uid)
                {
                    wake = wake.min(at);
                }
            }
        }
        // Reap finished evictions so the set does not grow.
        while queue.try_join_next().is_some() {}
        tokio::time::sleep_until(wake).await;
    }
}

/// The eviction queue's work on one pod: by name and UID, without re-reading the pod;
/// 404 and 409 mean it is gone or replaced, anything else is retried with backoff.
async fn evict(kube: Kube, cfg: Config, pod: PodFacts, evicted: Arc<Mutex<Vec<String>>>) {
    let mut backoff = cfg.eviction_backoff_min;
    loop {
        match kube.evict(&pod, None, true).await {
            Ok(()) => {
                evicted
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(pod.key.clone());
                return;
            }
            Err(e) if matches!(status_code(&e), Some(404 | 409)) => return,
            Err(error) => {
                tracing::debug!(pod = %pod.key, %error, "karpenter model: eviction refused; backing off");
            }
        }
        pause(backoff).await;
        backoff = (backoff * 2).min(cfg.eviction_backoff_max);
    }
}

/// Adds (or removes) `karpenter.sh/disrupted:NoSchedule`, with the exclude-from-load-
/// balancers label when adding: a strategic merge patch carrying the whole taint list, only
/// when something changes (`terminator.go` `Taint`).
/// Karpenter's annotation on a node it terminates with a TGP: when the TGP runs out.
pub const TERMINATION_TIMESTAMP_ANNOTATION: &str = "karpenter.sh/nodeclaim-termination-timestamp";

async fn set_taint(kube: &Kube, node: &str, taint: bool) -> Result<(), Error> {
    let current = kube.node(node).await?;
    let has = has_taint(&current, KARPENTER_DISRUPTED_TAINT, "NoSchedule");
    let labelled = current
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(EXCLUDE_FROM_LB_LABEL))
        .is_some_and(|v| v == "karpenter");
    if taint == has && (!taint || labelled) {
        return Ok(());
    }
    // Same key with another effect is replaced, as Karpenter does.
    let mut taints: Vec<Taint> = current
        .spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default()
        .into_iter()
        .filter(|t| t.key != KARPENTER_DISRUPTED_TAINT)
        .collect();
    let mut patch = json!({});
    if taint {
        taints.push(Taint {
            key: KARPENTER_DISRUPTED_TAINT.to_string(),
            value: None,
            effect: "NoSchedule".to_string(),
            time_added: None,
        });
        patch["metadata"] = json!({ "labels": { EXCLUDE_FROM_LB_LABEL: "karpenter" } });
    }
    patch["spec"] = json!({ "taints": taints });
    kube.patch_node(node, &Patch::Strategic(patch)).await?;
    Ok(())
}

fn active(p: &PodFacts) -> bool {
    !p.terminal() && !p.terminating()
}

fn do_not_disrupt(p: &PodFacts) -> bool {
    p.annotation(KARPENTER_DO_NOT_DISRUPT) == Some("true")
}

fn tolerates_disrupted(p: &PodFacts) -> bool {
    let taint = Taint {
        key: KARPENTER_DISRUPTED_TAINT.to_string(),
        value: None,
        effect: "NoSchedule".to_string(),
        time_added: None,
    };
    p.tolerations.iter().any(|t| tolerates(t, &taint))
}

/// `IsEvictable`: active, not `do-not-disrupt`, would not come back (tolerates the taint),
/// not a static pod.
fn evictable(p: &PodFacts) -> bool {
    active(p) && !do_not_disrupt(p) && !tolerates_disrupted(p) && !p.mirror()
}

/// `IsWaitingEviction`: the drain is not done while such a pod is on the node.
fn waits_for(cfg: &Config, p: &PodFacts) -> bool {
    if p.terminal() || p.mirror() || tolerates_disrupted(p) {
        return false;
    }
    match p.deletion {
        None => true,
        Some(at) => {
            let stuck = k8s_openapi::jiff::SignedDuration::try_from(cfg.stuck_terminating_after)
                .ok()
                .and_then(|d| at.checked_add(d).ok());
            stuck.is_none_or(|s| k8s_openapi::jiff::Timestamp::now() < s)
        }
    }
}

fn grace(p: &PodFacts) -> Duration {
    Duration::from_secs(p.grace_seconds.max(0).unsigned_abs())
}

/// The first non-empty drain tier: non-critical workloads, non-critical daemons, critical
/// workloads, critical daemons. Later tiers wait until earlier ones are gone.
fn first_tier<'a>(waiting: &[&'a PodFacts]) -> Option<Vec<&'a PodFacts>> {
    let critical = |p: &PodFacts| {
        p.priority_class
            .as_deref()
            .is_some_and(|c| CRITICAL_PRIORITY_CLASSES.contains(&c))
    };
    [(false, false), (false, true), (true, false), (true, true)]
        .into_iter()
        .map(|(crit, daemon)| {
            waiting
                .iter()
                .copied()
                .filter(|p| critical(p) == crit && p.daemon() == daemon)
                .collect::<Vec<_>>()
        })
        .find(|tier| !tier.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(name: &str, extra: serde_json::Value) -> PodFacts {
        let mut raw = json!({
            "metadata": { "name": name, "namespace": "default", "uid": name },
            "spec": { "nodeName": "n1", "containers": [{"name": "c"}] },
            "status": { "phase": "Running" },
        });
        json_patch::merge(&mut raw, &extra);
        PodFacts::parse(raw).unwrap()
    }

    #[test]
    fn do_not_disrupt_and_terminating_pods_are_waited_for_not_evicted() {
        let cfg = Config::default();
        let dnd = pod(
            "a",
            json!({"metadata": {"annotations": {KARPENTER_DO_NOT_DISRUPT: "true"}}}),
        );
        assert!(!evictable(&dnd) && waits_for(&cfg, &dnd));
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let leaving = pod("b", json!({"metadata": {"deletionTimestamp": now}}));
        assert!(!evictable(&leaving) && waits_for(&cfg, &leaving));
        let done = pod("c", json!({"status": {"phase": "Succeeded"}}));
        assert!(!evictable(&done) && !waits_for(&cfg, &done));
        let plain = pod("d", json!({}));
        assert!(evictable(&plain) && waits_for(&cfg, &plain));
        let tolerant = pod(
            "e",
            json!({"spec": {"tolerations": [{"operator": "Exists"}]}}),
        );
        assert!(!evictable(&tolerant) && !waits_for(&cfg, &tolerant));
    }

    #[test]
    fn daemons_and_critical_pods_drain_last() {
        let daemon = pod(
            "d",
            json!({"metadata": {"ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "ds", "uid": "x", "controller": true}]}}),
        );
        let critical = pod(
            "c",
            json!({"spec": {"priorityClassName": "system-cluster-critical"}}),
        );
        let plain = pod("p", json!({}));
        let tier = first_tier(&[&daemon, &critical, &plain]).unwrap();
        assert_eq!(tier.len(), 1);
        assert_eq!(tier[0].name, "p");
        let tier = first_tier(&[&daemon, &critical]).unwrap();
        assert_eq!(tier[0].name, "d");
        assert!(first_tier(&[]).is_none());
    }
}
