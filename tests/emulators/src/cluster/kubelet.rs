//! The kubelets (and the pod garbage collector): pod termination and node registration.
//!
//! A deleted pod that is bound to a node stays terminating (the store keeps it with its
//! deletionTimestamp) until its kubelet is done with it: when its grace period has passed,
//! or at once when its game has exited (every container terminated, see
//! [`crate::cluster::Cluster::game_exit`]) or its GameServer reached Shutdown (the game
//! called SDK `Shutdown()` and is on its way out). The kubelet then removes the pod.
//!
//! It also starts a pod created already bound to its node (the scheduler starts the pods it
//! binds in the same step), reports a Ready condition for a node that has none yet (node
//! registration), and, like the pod GC, force-deletes pods bound to a node that no longer
//! exists.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::time::Instant;

use crate::kube::resources::{GAMESERVERS, NODES, PODS};
use crate::kube::store::{DeleteOptions, Store, now_rfc3339};

use super::objects::{GameServerState, GameServerView, NodeInfo, PodInfo, PodPhase};
use super::writes::{list_parsed, object_at, report, set_condition};

/// The kubelets' memory: when each terminating pod was first seen terminating.
#[derive(Default)]
pub(crate) struct Kubelet {
    terminating_since: HashMap<String, Instant>,
}

impl Kubelet {
    /// One pass; returns whether a pod is waiting for its grace period (a timer is pending).
    pub(crate) fn run(&mut self, store: &Store, now: Instant) -> bool {
        register_nodes(store);
        let (node_objs, _) = store.list(&NODES, None);
        let nodes: BTreeSet<String> = node_objs
            .iter()
            .filter_map(|n| {
                n.pointer("/metadata/name")
                    .and_then(Value::as_str)
                    .map(str::to_string)
            })
            .collect();
        let shutdown_gs: HashSet<String> = list_parsed(store, &GAMESERVERS, GameServerView::parse)
            .into_iter()
            .filter(|(gs, _)| gs.state == Some(GameServerState::Shutdown))
            .map(|(gs, _)| gs.uid)
            .collect();
        let mut pending = false;
        let mut still: HashMap<String, Instant> = HashMap::new();
        for (pod, _) in list_parsed(store, &PODS, PodInfo::parse) {
            let Some(node) = &pod.node else { continue };
            if !nodes.contains(node) {
                force_delete(store, &pod);
                continue;
            }
            if !pod.deleting {
                if pod.phase == PodPhase::Pending {
                    start(store, &pod, node);
                }
                continue;
            }
            let since = self.terminating_since.get(&pod.uid).copied().unwrap_or(now);
            let grace = Duration::from_secs(pod.grace_seconds.unwrap_or(0).max(0).unsigned_abs());
            let game_gone = pod.containers_terminated
                || pod
                    .owner_gameserver_uid
                    .as_ref()
                    .is_some_and(|uid| shutdown_gs.contains(uid));
            if game_gone || now >= since + grace {
                finish(store, &pod);
            } else {
                still.insert(pod.uid.clone(), since);
                pending = true;
            }
        }
        self.terminating_since = still;
        pending
    }
}

/// Starts a pod that was created bound to this node (past the scheduler, which starts the
/// pods it binds itself): a kubelet runs every pod bound to its node.
fn start(store: &Store, pod: &PodInfo, node: &str) {
    let Some(info) = store
        .get(&NODES, None, node)
        .and_then(|n| NodeInfo::parse(&n).ok())
    else {
        return;
    };
    let uid = pod.uid.clone();
    let res = store.modify_status(&PODS, Some(&pod.namespace), &pod.name, |obj| {
        if obj.pointer("/metadata/uid").and_then(Value::as_str) == Some(uid.as_str()) {
            super::scheduler::start_on(obj, &info);
        }
        Ok(())
    });
    report("start bound pod", &pod.namespace, &pod.name, res);
}

/// Removes a terminating pod whose containers are done.
fn finish(store: &Store, pod: &PodInfo) {
    report(
        "remove terminated pod",
        &pod.namespace,
        &pod.name,
        store.remove(&PODS, Some(&pod.namespace), &pod.name),
    );
}

/// The pod GC: a pod bound to a node that no longer exists is deleted without grace.
fn force_delete(store: &Store, pod: &PodInfo) {
    let opts = DeleteOptions {
        grace_period_seconds: Some(0),
        precondition_uid: Some(pod.uid.clone()),
        ..Default::default()
    };
    report(
        "delete pod of a missing node",
        &pod.namespace,
        &pod.name,
        store.delete(&PODS, Some(&pod.namespace), &pod.name, &opts),
    );
}

/// A node with no Ready condition gets `Ready=True`, as a registering kubelet reports.
fn register_nodes(store: &Store) {
    let (nodes, _) = store.list(&NODES, None);
    for node in nodes {
        let has_ready = node
            .pointer("/status/conditions")
            .and_then(Value::as_array)
            .is_some_and(|cs| {
                cs.iter()
                    .any(|c| c.get("type").and_then(Value::as_str) == Some("Ready"))
            });
        if has_ready {
            continue;
        }
        let Some(name) = node.pointer("/metadata/name").and_then(Value::as_str) else {
            continue;
        };
        let res = store.modify_status(&NODES, None, name, |obj| {
            set_ready(obj, true);
            Ok(())
        });
        report("register node", "", name, res);
    }
}

/// Sets the node's Ready condition as its kubelet would.
pub(crate) fn set_ready(node: &mut Value, ready: bool) {
    let (status, reason, message) = if ready {
        ("True", "KubeletReady", "kubelet is posting ready status")
    } else {
        (
            "False",
            "KubeletNotReady",
            "kubelet stopped posting node status",
        )
    };
    set_condition(node, "Ready", status, reason, message);
}

/// Marks every container of a pod as exited (exit code 0) and the pod `Succeeded`, as a
/// kubelet reports a game that exited under `restartPolicy: Never` (Agones' pods), a
/// terminating pod too (the kubelet puts a pod in a terminal phase before it removes it);
/// a terminating one is then removed by its kubelet. The box's tests write the same.
pub fn mark_exited(pod: &mut Value) {
    let now = now_rfc3339();
    let names: Vec<String> = pod
        .pointer("/spec/containers")
        .and_then(Value::as_array)
        .map(|cs| {
            cs.iter()
                .filter_map(|c| c.get("name").and_then(Value::as_str).map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let names = if names.is_empty() {
        vec!["gameserver".to_string()]
    } else {
        names
    };
    let statuses: Vec<Value> = names
        .iter()
        .map(|name| {
            json!({
                "name": name,
                "ready": false,
                "started": false,
                "restartCount": 0,
                "image": "",
                "imageID": "",
                "state": { "terminated": { "exitCode": 0, "reason": "Completed", "finishedAt": now } },
            })
        })
        .collect();
    let status = object_at(pod, &["status"]);
    status.insert("containerStatuses".into(), json!(statuses));
    status.insert("phase".into(), json!("Succeeded"));
    set_condition(pod, "ContainersReady", "False", "PodCompleted", "");
    set_condition(pod, "Ready", "False", "PodCompleted", "");
}
