//! The scheduler: binds pending pods to nodes that can take them.
//!
//! A node fits a pod when it is Ready, not cordoned (or the pod tolerates
//! `node.kubernetes.io/unschedulable:NoSchedule`, as kube-scheduler's NodeUnschedulable
//! plugin allows: a blanket `operator: Exists` toleration does), every NoSchedule/NoExecute
//! taint on it is tolerated, and its labels match the pod's nodeSelector. Among the fitting nodes
//! the one with the fewest pods wins, ties broken by name, so a scenario always lands the
//! same way. Binding also starts the pod (the kubelet start is instant in this model).
//! A pod that fits nowhere stays Pending with `PodScheduled=False`, like the real one.
//!
//! With a bind lag, a decision is bound that much later and not re-checked meanwhile, as
//! kube-scheduler's binding cycle runs after its scheduling cycle on the node it picked then:
//! a pod decided on before a cordon can still land after it.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Taint;
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::kube::resources::{NODES, PODS};
use crate::kube::store::{Part, Store, now_rfc3339};

use super::node_lifecycle::UNSCHEDULABLE_TAINT;
use super::objects::{NodeInfo, PodInfo, PodPhase, TaintEffect, tolerating};
use super::writes::{list_parsed, object_at, report, set_condition};

/// Why a node does not fit a pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Unfit {
    /// `spec.unschedulable` (cordoned).
    Cordoned,
    /// The node is not Ready.
    NotReady,
    /// A NoSchedule or NoExecute taint the pod does not tolerate.
    UntoleratedTaint,
    /// The node's labels do not match `spec.nodeSelector`.
    NodeSelector,
}

impl Unfit {
    /// The phrase kube-scheduler uses in its `FailedScheduling` message.
    fn phrase(self) -> &'static str {
        match self {
            Unfit::Cordoned => "node(s) were unschedulable",
            Unfit::NotReady => "node(s) were not ready",
            Unfit::UntoleratedTaint => "node(s) had untolerated taint(s)",
            Unfit::NodeSelector => "node(s) didn't match Pod's node affinity/selector",
        }
    }
}

/// Whether `node` can run `pod`; the first reason it cannot.
pub fn fits(node: &NodeInfo, pod: &PodInfo) -> Result<(), Unfit> {
    if node.unschedulable && tolerating(&pod.tolerations, &unschedulable_taint()).is_none() {
        return Err(Unfit::Cordoned);
    }
    if node.ready != Some(true) {
        return Err(Unfit::NotReady);
    }
    let blocking = node
        .taints
        .iter()
        .filter(|(_, e)| matches!(e, TaintEffect::NoSchedule | TaintEffect::NoExecute));
    for (taint, _) in blocking {
        if tolerating(&pod.tolerations, taint).is_none() {
            return Err(Unfit::UntoleratedTaint);
        }
    }
    if pod
        .node_selector
        .iter()
        .any(|(k, v)| node.labels.get(k) != Some(v))
    {
        return Err(Unfit::NodeSelector);
    }
    Ok(())
}

/// The taint the NodeUnschedulable plugin checks a cordoned node's pods against,
/// whether or not the node lifecycle controller has put it on the node yet.
fn unschedulable_taint() -> Taint {
    Taint {
        key: UNSCHEDULABLE_TAINT.to_string(),
        effect: "NoSchedule".to_string(),
        value: None,
        time_added: None,
    }
}

/// The node `pod` goes to: the fitting node with the fewest pods, ties by name; otherwise
/// the kube-scheduler style message saying why none fits.
pub fn pick<'a>(
    nodes: &'a [NodeInfo],
    load: &BTreeMap<String, usize>,
    pod: &PodInfo,
) -> Result<&'a NodeInfo, String> {
    let mut unfit: BTreeMap<Unfit, usize> = BTreeMap::new();
    let mut best: Option<(&NodeInfo, usize)> = None;
    for node in nodes {
        match fits(node, pod) {
            Ok(()) => {
                let n = load.get(&node.name).copied().unwrap_or(0);
                let better = match best {
                    None => true,
                    Some((b, bn)) => (n, &node.name) < (bn, &b.name),
                };
                if better {
                    best = Some((node, n));
                }
            }
            Err(why) => *unfit.entry(why).or_default() += 1,
        }
    }
    match best {
        Some((node, _)) => Ok(node),
        None => {
            let reasons: Vec<String> = unfit
                .iter()
                .map(|(why, n)| format!("{n} {}", why.phrase()))
                .collect();
            let mut msg = format!("0/{} nodes are available", nodes.len());
            if !reasons.is_empty() {
                msg.push_str(": ");
                msg.push_str(&reasons.join(", "));
            }
            msg.push('.');
            Err(msg)
        }
    }
}

/// The scheduler, and the decisions it has made but not bound yet.
#[derive(Default)]
pub(crate) struct Scheduler {
    /// How long after its decision a pod is bound (zero: in the same pass).
    bind_lag: Duration,
    /// Pods decided but not yet bound, by uid: the node picked and when the bind lands.
    assumed: BTreeMap<String, Assumed>,
}

struct Assumed {
    node: String,
    due: Instant,
}

impl Scheduler {
    pub(crate) fn new(bind_lag: Duration) -> Self {
        Scheduler {
            bind_lag,
            assumed: BTreeMap::new(),
        }
    }

    /// One scheduling pass over every pending pod; returns whether a bind is still due.
    pub(crate) fn run(&mut self, store: &Store, now: Instant) -> bool {
        let nodes: Vec<NodeInfo> = list_parsed(store, &NODES, NodeInfo::parse)
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        let pods: Vec<PodInfo> = list_parsed(store, &PODS, PodInfo::parse)
            .into_iter()
            .map(|(p, _)| p)
            .collect();
        let pending: Vec<&PodInfo> = pods
            .iter()
            .filter(|p| p.node.is_none() && !p.deleting && p.phase == PodPhase::Pending)
            .collect();
        // A decision about a pod that is gone, bound or deleting meanwhile is dropped.
        self.assumed
            .retain(|uid, _| pending.iter().any(|p| &p.uid == uid));
        let mut load: BTreeMap<String, usize> = BTreeMap::new();
        for pod in &pods {
            if let Some(node) = &pod.node
                && !pod.phase.is_finished()
            {
                *load.entry(node.clone()).or_default() += 1;
            }
        }
        // Decided pods count on their node, as kube-scheduler's assumed pods do.
        for a in self.assumed.values() {
            *load.entry(a.node.clone()).or_default() += 1;
        }
        for pod in pending {
            if let Some(a) = self.assumed.get(&pod.uid) {
                if now >= a.due {
                    // The node picked then, whatever it looks like now; a node that is gone
                    // sends the pod back to scheduling.
                    if let Some(node) = nodes.iter().find(|n| n.name == a.node) {
                        bind(store, pod, node);
                    }
                    self.assumed.remove(&pod.uid);
                }
                continue;
            }
            match pick(&nodes, &load, pod) {
                Ok(node) if self.bind_lag.is_zero() => {
                    if bind(store, pod, node) {
                        *load.entry(node.name.clone()).or_default() += 1;
                    }
                }
                Ok(node) => {
                    *load.entry(node.name.clone()).or_default() += 1;
                    let due = now + self.bind_lag;
                    let node = node.name.clone();
                    self.assumed.insert(pod.uid.clone(), Assumed { node, due });
                }
                Err(message) => mark_unschedulable(store, pod, &message),
            }
        }
        !self.assumed.is_empty()
    }
}

/// Binds the pod (the binding subresource) and starts it (its kubelet's status update,
/// through `/status`), unless it changed meanwhile (bound elsewhere, deleted, replaced).
fn bind(store: &Store, pod: &PodInfo, node: &NodeInfo) -> bool {
    let uid = pod.uid.clone();
    let res = store.transaction(|t| {
        t.bind(&pod.namespace, &pod.name, Some(&uid), &node.name)?;
        t.modify_part(
            &PODS,
            Some(&pod.namespace),
            &pod.name,
            |obj| {
                start_on(obj, node);
                Ok(())
            },
            Part::Status,
        )
    });
    report("bind pod", &pod.namespace, &pod.name, res)
}

/// Sets the status an instant container start leaves on a bound pod.
pub(crate) fn start_on(obj: &mut Value, node: &NodeInfo) {
    let now = now_rfc3339();
    let containers: Vec<String> = obj
        .pointer("/spec/containers")
        .and_then(Value::as_array)
        .map(|cs| {
            cs.iter()
                .filter_map(|c| c.get("name").and_then(Value::as_str).map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    {
        let status = object_at(obj, &["status"]);
        status.insert("phase".into(), json!("Running"));
        status.insert("startTime".into(), json!(now));
        if let Some(ip) = &node.internal_ip {
            status.insert("hostIP".into(), json!(ip));
            status.insert("hostIPs".into(), json!([{ "ip": ip }]));
        }
        let statuses: Vec<Value> = containers
            .iter()
            .map(|name| {
                json!({
                    "name": name,
                    "ready": true,
                    "started": true,
                    "restartCount": 0,
                    "image": "",
                    "imageID": "",
                    "state": { "running": { "startedAt": now } },
                })
            })
            .collect();
        status.insert("containerStatuses".into(), json!(statuses));
    }
    for type_ in ["PodScheduled", "Initialized", "ContainersReady", "Ready"] {
        set_condition(obj, type_, "True", "", "");
    }
}

fn mark_unschedulable(store: &Store, pod: &PodInfo, message: &str) {
    let uid = pod.uid.clone();
    let res = store.modify_status(&PODS, Some(&pod.namespace), &pod.name, |obj| {
        if obj.pointer("/metadata/uid").and_then(Value::as_str) != Some(uid.as_str())
            || obj
                .pointer("/spec/nodeName")
                .and_then(Value::as_str)
                .is_some_and(|n| !n.is_empty())
        {
            return Ok(());
        }
        set_condition(obj, "PodScheduled", "False", "Unschedulable", message);
        Ok(())
    });
    report("mark pod unschedulable", &pod.namespace, &pod.name, res);
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Taint, Toleration};

    fn node(name: &str) -> NodeInfo {
        NodeInfo {
            name: name.into(),
            labels: BTreeMap::new(),
            taints: Vec::new(),
            unschedulable: false,
            ready: Some(true),
            internal_ip: None,
        }
    }

    fn pod() -> PodInfo {
        PodInfo {
            namespace: "default".into(),
            name: "p".into(),
            uid: "u".into(),
            node: None,
            phase: PodPhase::Pending,
            deleting: false,
            grace_seconds: None,
            tolerations: Vec::new(),
            node_selector: BTreeMap::new(),
            owner_gameserver_uid: None,
            containers_terminated: false,
        }
    }

    fn taint(key: &str, effect: TaintEffect, name: &str) -> (Taint, TaintEffect) {
        (
            Taint {
                key: key.into(),
                value: Some("true".into()),
                effect: name.into(),
                time_added: None,
            },
            effect,
        )
    }

    #[test]
    fn picks_least_loaded_then_name() {
        let nodes = vec![node("b"), node("a"), node("c")];
        let mut load = BTreeMap::new();
        assert_eq!(
            pick(&nodes, &load, &pod()).map(|n| n.name.as_str()),
            Ok("a")
        );
        load.insert("a".to_string(), 2);
        load.insert("b".to_string(), 1);
        assert_eq!(
            pick(&nodes, &load, &pod()).map(|n| n.name.as_str()),
            Ok("c")
        );
    }

    #[test]
    fn filters_cordon_taints_selector_and_readiness() {
        let mut cordoned = node("a");
        cordoned.unschedulable = true;
        let mut tainted = node("b");
        tainted
            .taints
            .push(taint("k", TaintEffect::NoSchedule, "NoSchedule"));
        let mut soft = node("c");
        soft.taints.push(taint(
            "k",
            TaintEffect::PreferNoSchedule,
            "PreferNoSchedule",
        ));
        let mut not_ready = node("d");
        not_ready.ready = Some(false);
        assert_eq!(fits(&cordoned, &pod()), Err(Unfit::Cordoned));
        assert_eq!(fits(&tainted, &pod()), Err(Unfit::UntoleratedTaint));
        assert_eq!(fits(&soft, &pod()), Ok(()));
        assert_eq!(fits(&not_ready, &pod()), Err(Unfit::NotReady));

        let mut tolerant = pod();
        tolerant.tolerations.push(Toleration {
            key: Some("k".into()),
            operator: Some("Exists".into()),
            ..Default::default()
        });
        assert_eq!(fits(&tainted, &tolerant), Ok(()));

        let mut picky = pod();
        picky.node_selector.insert("pool".into(), "game".into());
        assert_eq!(fits(&node("e"), &picky), Err(Unfit::NodeSelector));
        let mut labelled = node("e");
        labelled.labels.insert("pool".into(), "game".into());
        assert_eq!(fits(&labelled, &picky), Ok(()));

        // A pod tolerating the unschedulable taint (or everything) may land on a cordoned node.
        let mut daemon = pod();
        daemon.tolerations.push(Toleration {
            key: Some(UNSCHEDULABLE_TAINT.into()),
            operator: Some("Exists".into()),
            effect: Some("NoSchedule".into()),
            ..Default::default()
        });
        assert_eq!(fits(&cordoned, &daemon), Ok(()));
        let mut blanket = pod();
        blanket.tolerations.push(Toleration {
            operator: Some("Exists".into()),
            ..Default::default()
        });
        assert_eq!(fits(&cordoned, &blanket), Ok(()));
        assert_eq!(fits(&tainted, &blanket), Ok(()));
        let mut other_effect = pod();
        other_effect.tolerations.push(Toleration {
            key: Some(UNSCHEDULABLE_TAINT.into()),
            operator: Some("Exists".into()),
            effect: Some("NoExecute".into()),
            ..Default::default()
        });
        assert_eq!(fits(&cordoned, &other_effect), Err(Unfit::Cordoned));

        let msg = pick(&[cordoned, tainted], &BTreeMap::new(), &pod()).err();
        assert_eq!(
            msg.as_deref(),
            Some(
                "0/2 nodes are available: 1 node(s) were unschedulable, 1 node(s) had untolerated taint(s)."
            )
        );
    }

    #[test]
    fn a_lagged_bind_lands_later_on_the_node_decided_even_if_cordoned_since() {
        use crate::cluster::fixtures::NodeSpec;
        let store = Store::new(100);
        store
            .create(&NODES, None, NodeSpec::new("n1").to_object())
            .unwrap();
        store
            .create(
                &PODS,
                Some("default"),
                json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c"}]}}),
            )
            .unwrap();
        let bound = || {
            store.get(&PODS, Some("default"), "p").and_then(|p| {
                p.pointer("/spec/nodeName")
                    .and_then(Value::as_str)
                    .map(str::to_string)
            })
        };
        let lag = Duration::from_millis(100);
        let mut s = Scheduler::new(lag);
        let t0 = Instant::now();
        assert!(s.run(&store, t0), "decided, the bind is due later");
        assert_eq!(bound(), None);
        // Cordoned after the decision: the binding cycle does not look again.
        let mut node = store.get(&NODES, None, "n1").unwrap();
        node["spec"]["unschedulable"] = json!(true);
        store.replace(&NODES, None, "n1", node).unwrap();
        assert!(s.run(&store, t0 + lag / 2));
        assert_eq!(bound(), None, "not before the lag");
        assert!(!s.run(&store, t0 + lag), "nothing left to bind");
        assert_eq!(bound().as_deref(), Some("n1"));

        // Without a lag, the same pass binds.
        let store = Store::new(100);
        store
            .create(&NODES, None, NodeSpec::new("n1").to_object())
            .unwrap();
        store
            .create(
                &PODS,
                Some("default"),
                json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c"}]}}),
            )
            .unwrap();
        assert!(!Scheduler::new(Duration::ZERO).run(&store, Instant::now()));
        assert!(
            store
                .get(&PODS, Some("default"), "p")
                .is_some_and(|p| p.pointer("/spec/nodeName").is_some())
        );
    }
}
