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

use crate::kube::Journal;
use crate::kube::journal::Verb;
use crate::kube::resources::{GAMESERVERS, NODES, PODS};
use crate::kube::status::ApiError;
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

/// Posts `boot_id` as the node's `status.nodeInfo.bootID`, as its kubelet reports it after
/// the machine (re)started.
pub(crate) fn post_boot_id(store: &Store, node: &str, boot_id: &str) -> Result<(), ApiError> {
    store
        .modify_status(&NODES, None, node, |obj| {
            let status = object_at(obj, &["status"]);
            let info = status.entry("nodeInfo").or_insert_with(|| json!({}));
            if let Some(info) = info.as_object_mut() {
                info.insert("bootID".into(), json!(boot_id));
            }
            Ok(())
        })
        .map(drop)
}

/// A new boot id the kubelet reports late ([`report_boot_after_reads`]).
pub struct LateBoot {
    pub node: String,
    pub boot_id: String,
    /// Only reads journaled after this entry count.
    pub after_seq: u64,
    /// How many reads of the Node come first.
    pub reads: usize,
    /// The longest it waits for them.
    pub within: Duration,
}

/// A machine that came back: its kubelet starts the containers again at once, but reports
/// the new boot id with its next node status, which goes out every
/// `nodeStatusUpdateFrequency` (10 s by default;
/// <https://kubernetes.io/docs/reference/config-api/kubelet-config.v1beta1/>), so a restarted
/// container can read the Node before it shows. Posts `late.boot_id` on `late.node` once the
/// journal shows `late.reads` reads of that Node (a GET, or a LIST or WATCH of nodes)
/// answered to identities `reader` accepts, later than journal entry `late.after_seq` (a
/// process starting reads its Node more than once: its first reads all see the old boot):
/// ordered by the journal, those readers saw the old boot. After `late.within` with fewer it
/// posts anyway. The task returns the last such read's `seq` (`None`: too few came, or the
/// post failed).
pub fn report_boot_after_reads(
    journal: Journal,
    store: Store,
    late: LateBoot,
    reader: impl Fn(&str) -> bool + Send + 'static,
) -> tokio::task::JoinHandle<Option<u64>> {
    let LateBoot {
        node,
        boot_id,
        after_seq,
        reads,
        within,
    } = late;
    tokio::spawn(async move {
        let give_up = Instant::now() + within;
        let read = loop {
            let seen = journal
                .filter(|e| {
                    e.seq > after_seq
                        && matches!(e.verb, Verb::Get | Verb::List | Verb::Watch)
                        && (200..300).contains(&e.status)
                        && e.resource.as_deref() == Some("nodes")
                        && e.name.as_deref().is_none_or(|n| n == node)
                        && e.identity.as_deref().is_some_and(&reader)
                })
                .get(reads.saturating_sub(1))
                .map(|e| e.seq);
            if seen.is_some() || Instant::now() >= give_up {
                break seen;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        post_boot_id(&store, &node, &boot_id).ok()?;
        read
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Node;

    fn boot_of(n: &Node) -> Option<String> {
        n.status
            .as_ref()
            .and_then(|s| s.node_info.as_ref())
            .map(|i| i.boot_id.clone())
    }

    /// The new boot id comes after the reader's reads of the Node, by the journal's order:
    /// the reader saw the old one; another identity's read does not count.
    #[tokio::test]
    async fn a_new_boot_id_is_posted_after_the_readers_reads() {
        let emu = crate::kube::Emulator::start().await.unwrap();
        emu.store()
            .create(
                &NODES,
                None,
                json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"},
                       "status": {"nodeInfo": {"bootID": "boot-0"}}}),
            )
            .unwrap();
        let after = emu.journal().entries().last().map_or(0, |e| e.seq);
        let posted = report_boot_after_reads(
            emu.journal().clone(),
            emu.store().clone(),
            LateBoot {
                node: "n1".into(),
                boot_id: "boot-1".into(),
                after_seq: after,
                reads: 2,
                within: Duration::from_secs(20),
            },
            |id| id == "agent",
        );
        let other = ::kube::Api::<Node>::all(emu.client_as("other").await.unwrap());
        let other = other.get("n1").await.unwrap();
        assert_eq!(boot_of(&other).as_deref(), Some("boot-0"));
        let agent = ::kube::Api::<Node>::all(emu.client_as("agent").await.unwrap());
        for _ in 0..2 {
            let n = agent.get("n1").await.unwrap();
            assert_eq!(boot_of(&n).as_deref(), Some("boot-0"));
        }
        let read = posted
            .await
            .unwrap()
            .expect("posted after the agent's reads");
        let entry = emu.journal().filter(|e| e.seq == read).remove(0);
        assert_eq!(entry.identity.as_deref(), Some("agent"));
        let now = emu.store().get(&NODES, None, "n1").unwrap();
        assert_eq!(now["status"]["nodeInfo"]["bootID"], "boot-1");
    }
}
