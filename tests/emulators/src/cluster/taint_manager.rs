//! The NoExecute taint manager: removes running pods from nodes they may no longer run on.
//!
//! As in Kubernetes, a pod that does not tolerate a NoExecute taint on its node is deleted
//! at once (a normal graceful delete, so its termination grace period still applies); a
//! pod whose tolerations carry `tolerationSeconds` is deleted that long after it first
//! became subject to the taint (the shortest of its matching tolerations counts), and a
//! pod tolerating without `tolerationSeconds` stays. If the taints go away before the
//! deadline, the pending deletion is cancelled.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use serde_json::Value;
use tokio::time::Instant;

use crate::kube::resources::{NODES, PODS};
use crate::kube::store::{DeleteOptions, Store};

use super::objects::{NodeInfo, PodInfo, TaintEffect, tolerating};
use super::writes::{list_parsed, report, set_condition};

/// What the taint manager decides for one pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// No NoExecute taint applies, or every one is tolerated forever.
    Stay,
    /// Delete after this long (measured from when the pod became subject to the taints).
    DeleteAfter(Duration),
    /// An untolerated NoExecute taint: delete now.
    DeleteNow,
}

/// The decision for `pod` on `node` (Kubernetes' `getMinTolerationTime` rule).
pub fn verdict(node: &NodeInfo, pod: &PodInfo) -> Verdict {
    let mut min: Option<i64> = None;
    for (taint, effect) in &node.taints {
        if *effect != TaintEffect::NoExecute {
            continue;
        }
        match tolerating(&pod.tolerations, taint) {
            None => return Verdict::DeleteNow,
            Some(t) => {
                if let Some(secs) = t.toleration_seconds {
                    min = Some(min.map_or(secs, |m| m.min(secs)));
                }
            }
        }
    }
    match min {
        None => Verdict::Stay,
        Some(s) if s <= 0 => Verdict::DeleteNow,
        Some(s) => Verdict::DeleteAfter(Duration::from_secs(s.unsigned_abs())),
    }
}

/// The taint manager's memory: since when each pod has been subject to a timed toleration.
#[derive(Default)]
pub(crate) struct TaintManager {
    since: HashMap<String, Instant>,
}

impl TaintManager {
    /// One pass; returns whether a deletion is scheduled for later (a timer is pending).
    pub(crate) fn run(&mut self, store: &Store, now: Instant) -> bool {
        let nodes: BTreeMap<String, NodeInfo> = list_parsed(store, &NODES, NodeInfo::parse)
            .into_iter()
            .map(|(n, _)| (n.name.clone(), n))
            .collect();
        let pods = list_parsed(store, &PODS, PodInfo::parse);
        let mut pending = false;
        let mut seen: HashMap<String, Instant> = HashMap::new();
        for (pod, _) in &pods {
            if pod.deleting || pod.phase.is_finished() {
                continue;
            }
            let Some(node) = pod.node.as_ref().and_then(|n| nodes.get(n)) else {
                continue;
            };
            match verdict(node, pod) {
                Verdict::Stay => {}
                Verdict::DeleteNow => evict(store, pod),
                Verdict::DeleteAfter(after) => {
                    let since = self.since.get(&pod.uid).copied().unwrap_or(now);
                    if now >= since + after {
                        evict(store, pod);
                    } else {
                        seen.insert(pod.uid.clone(), since);
                        pending = true;
                    }
                }
            }
        }
        // Pods no longer subject to a timed toleration forget their start time.
        self.since = seen;
        pending
    }
}

/// Marks the pod as disrupted and deletes it gracefully, as the taint manager does.
fn evict(store: &Store, pod: &PodInfo) {
    let uid = pod.uid.clone();
    let marked = store.modify_status(&PODS, Some(&pod.namespace), &pod.name, |obj| {
        if obj.pointer("/metadata/uid").and_then(Value::as_str) == Some(uid.as_str()) {
            set_condition(
                obj,
                "DisruptionTarget",
                "True",
                "DeletionByTaintManager",
                "Taint manager: deleting due to NoExecute taint",
            );
        }
        Ok(())
    });
    if !report("mark pod disrupted", &pod.namespace, &pod.name, marked) {
        return;
    }
    let opts = DeleteOptions {
        precondition_uid: Some(pod.uid.clone()),
        ..Default::default()
    };
    report(
        "delete pod (NoExecute taint)",
        &pod.namespace,
        &pod.name,
        store.delete(&PODS, Some(&pod.namespace), &pod.name, &opts),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Taint, Toleration};

    fn node_with(effect: TaintEffect, effect_name: &str) -> NodeInfo {
        NodeInfo {
            name: "n".into(),
            labels: BTreeMap::new(),
            taints: vec![(
                Taint {
                    key: "drain".into(),
                    value: Some("true".into()),
                    effect: effect_name.into(),
                    time_added: None,
                },
                effect,
            )],
            unschedulable: false,
            ready: Some(true),
            internal_ip: None,
        }
    }

    fn pod_with(tolerations: Vec<Toleration>) -> PodInfo {
        PodInfo {
            namespace: "default".into(),
            name: "p".into(),
            uid: "u".into(),
            node: Some("n".into()),
            phase: super::super::objects::PodPhase::Running,
            deleting: false,
            grace_seconds: None,
            tolerations,
            node_selector: BTreeMap::new(),
            owner_gameserver_uid: None,
            containers_terminated: false,
        }
    }

    fn tol(seconds: Option<i64>) -> Toleration {
        Toleration {
            key: Some("drain".into()),
            operator: Some("Exists".into()),
            effect: Some("NoExecute".into()),
            toleration_seconds: seconds,
            ..Default::default()
        }
    }

    #[test]
    fn verdicts() {
        let hard = node_with(TaintEffect::NoExecute, "NoExecute");
        assert_eq!(verdict(&hard, &pod_with(vec![])), Verdict::DeleteNow);
        assert_eq!(verdict(&hard, &pod_with(vec![tol(None)])), Verdict::Stay);
        assert_eq!(
            verdict(&hard, &pod_with(vec![tol(Some(5))])),
            Verdict::DeleteAfter(Duration::from_secs(5))
        );
        assert_eq!(
            verdict(&hard, &pod_with(vec![tol(Some(0))])),
            Verdict::DeleteNow
        );
        let soft = node_with(TaintEffect::NoSchedule, "NoSchedule");
        assert_eq!(
            verdict(&soft, &pod_with(vec![])),
            Verdict::Stay,
            "NoSchedule never evicts"
        );
    }
}
