//! Writes that did not stick. A mutating admission webhook (a policy engine setting
//! `safe-to-evict`, one stripping a taint) can answer a successful write with an object that
//! lacks what was written. Planning again would send the same write at once, from every
//! node, for ever; so a write whose answer lacks what it wrote backs off exponentially per
//! object, as a failure does, and is told (a metric and a Warning Event).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::DynamicObject;
use tokio::time::Instant;

use crate::cooperation::Changes;
use crate::keys;

/// The first pause after a reverted write; it doubles with each revert in a row.
const FIRST: Duration = Duration::from_secs(1);
/// The longest pause.
const MAX: Duration = Duration::from_secs(300);

/// The object a write goes to.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Target {
    Node,
    Pod { namespace: String, name: String },
    GameServer { namespace: String, name: String },
}

impl Target {
    pub fn describe(&self) -> String {
        match self {
            Self::Node => "the Node".into(),
            Self::Pod { namespace, name } => format!("pod {namespace}/{name}"),
            Self::GameServer { namespace, name } => format!("GameServer {namespace}/{name}"),
        }
    }
}

/// What a write to the Node set (a fact about the write, whoever decided it).
#[derive(Clone, Copy, Debug)]
pub struct NodeWrite<'a> {
    pub unschedulable: Option<bool>,
    /// The complete new taint list, when the write replaced it.
    pub taints: Option<&'a [k8s_openapi::api::core::v1::Taint]>,
    pub set_annotations: &'a BTreeMap<String, String>,
    pub remove_annotations: &'a BTreeSet<String>,
    pub set_labels: &'a BTreeMap<String, String>,
}

/// What a write to a GameServer set.
#[derive(Clone, Copy, Debug)]
pub enum GameServerWrite<'a> {
    /// The `lastcall.dev/node-draining` label.
    Labelled,
    /// The label and the drain deadline and reason annotations.
    Protected { deadline: &'a str, reason: &'a str },
}

/// Whether the Node the API server answered carries what `patch` wrote.
pub fn node_kept(patch: NodeWrite<'_>, written: &Node) -> bool {
    let spec = written.spec.as_ref();
    let unschedulable = spec.and_then(|s| s.unschedulable).unwrap_or(false);
    let taint_set =
        |ts: &[k8s_openapi::api::core::v1::Taint]| -> BTreeSet<(String, String, String)> {
            ts.iter()
                .map(|t| {
                    (
                        t.key.clone(),
                        t.effect.clone(),
                        t.value.clone().unwrap_or_default(),
                    )
                })
                .collect()
        };
    let written_taints = spec.and_then(|s| s.taints.clone()).unwrap_or_default();
    let empty = BTreeMap::new();
    let annotations = written.metadata.annotations.as_ref().unwrap_or(&empty);
    let labels = written.metadata.labels.as_ref().unwrap_or(&empty);
    patch.unschedulable.is_none_or(|u| u == unschedulable)
        && patch
            .taints
            .is_none_or(|t| taint_set(t) == taint_set(&written_taints))
        && patch
            .set_annotations
            .iter()
            .all(|(k, v)| annotations.get(k) == Some(v))
        && patch
            .remove_annotations
            .iter()
            .all(|k| !annotations.contains_key(k))
        && patch
            .set_labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
}

/// Whether the pod the API server answered carries the annotation `changes`.
pub fn pod_kept(changes: &Changes, written: &Pod) -> bool {
    let empty = BTreeMap::new();
    let annotations = written.metadata.annotations.as_ref().unwrap_or(&empty);
    changes
        .iter()
        .all(|(k, v)| annotations.get(k) == v.as_ref())
}

/// Whether the GameServer the API server answered carries what `write` set.
pub fn gameserver_kept(write: GameServerWrite<'_>, written: &DynamicObject) -> bool {
    let empty = BTreeMap::new();
    let labels = written.metadata.labels.as_ref().unwrap_or(&empty);
    let annotations = written.metadata.annotations.as_ref().unwrap_or(&empty);
    let labelled = labels.get(keys::LABEL_NODE_DRAINING).map(String::as_str) == Some("true");
    match write {
        GameServerWrite::Labelled => labelled,
        GameServerWrite::Protected { deadline, reason } => {
            labelled
                && annotations.get(keys::ANN_GS_DEADLINE).map(String::as_str) == Some(deadline)
                && annotations.get(keys::ANN_GS_REASON).map(String::as_str) == Some(reason)
        }
    }
}

struct Entry {
    /// Reverts in a row.
    times: u32,
    /// No write to the object before this.
    until: Instant,
}

/// Per object: how many writes in a row came back reverted, and when to try again.
#[derive(Default)]
pub struct Reverted {
    entries: BTreeMap<Target, Entry>,
}

impl Reverted {
    /// A write to `t` came back without what it wrote: returns the pause before the next.
    pub fn reverted(&mut self, t: Target, now: Instant) -> Duration {
        let e = self.entries.entry(t).or_insert(Entry {
            times: 0,
            until: now,
        });
        e.times = e.times.saturating_add(1);
        let pause = FIRST.saturating_mul(1u32 << (e.times - 1).min(16)).min(MAX);
        e.until = now + pause;
        pause
    }

    /// A write to `t` stuck: no pause any more.
    pub fn kept(&mut self, t: &Target) {
        self.entries.remove(t);
    }

    /// Whether writes to `t` are paused now.
    pub fn paused(&self, t: &Target, now: Instant) -> bool {
        self.entries.get(t).is_some_and(|e| e.until > now)
    }

    /// When the earliest pause still running ends.
    pub fn next_retry(&self, now: Instant) -> Option<Instant> {
        self.entries
            .values()
            .map(|e| e.until)
            .filter(|u| *u > now)
            .min()
    }

    /// Forgets objects that are gone, so the map stays O(objects on this node).
    pub fn retain(&mut self, live: impl Fn(&Target) -> bool) {
        self.entries.retain(|t, _| live(t));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reverted_write_backs_off_exponentially_until_one_sticks() {
        let now = Instant::now();
        let mut r = Reverted::default();
        let pod = Target::Pod {
            namespace: "default".into(),
            name: "gs-1".into(),
        };
        let pauses: Vec<Duration> = (0..12).map(|_| r.reverted(pod.clone(), now)).collect();
        assert_eq!(pauses[0], FIRST);
        assert_eq!(pauses[1], 2 * FIRST);
        assert_eq!(pauses[4], 16 * FIRST);
        assert_eq!(pauses[11], MAX, "capped");
        assert!(r.paused(&pod, now));
        assert!(!r.paused(&Target::Node, now), "per object");
        assert_eq!(r.next_retry(now), Some(now + MAX));
        assert!(!r.paused(&pod, now + MAX));
        r.kept(&pod);
        assert!(!r.paused(&pod, now));
        assert_eq!(r.reverted(pod.clone(), now), FIRST, "a new run starts over");
        r.retain(|t| *t == Target::Node);
        assert_eq!(r.next_retry(now), None, "gone objects are forgotten");
    }

    #[test]
    fn an_answer_without_what_was_written_is_a_revert() {
        let changes: Changes = [(
            crate::cooperation::ANN_SAFE_TO_EVICT.to_string(),
            Some("false".to_string()),
        )]
        .into();
        let pod = |v: &str| -> Pod {
            serde_json::from_value(serde_json::json!({"metadata": {"name": "p",
                "annotations": {crate::cooperation::ANN_SAFE_TO_EVICT: v}}}))
            .expect("pod")
        };
        assert!(pod_kept(&changes, &pod("false")));
        assert!(!pod_kept(&changes, &pod("true")));

        let taints = [k8s_openapi::api::core::v1::Taint {
            key: keys::TAINT_DRAINING.into(),
            value: Some("manual".into()),
            effect: "NoSchedule".into(),
            time_added: None,
        }];
        let (set, remove) = (BTreeMap::new(), BTreeSet::new());
        let patch = NodeWrite {
            unschedulable: Some(true),
            taints: Some(&taints),
            set_annotations: &set,
            remove_annotations: &remove,
            set_labels: &set,
        };
        let node = |taints: serde_json::Value| -> Node {
            serde_json::from_value(serde_json::json!({"metadata": {"name": "n1"},
                "spec": {"unschedulable": true, "taints": taints}}))
            .expect("node")
        };
        assert!(node_kept(
            patch,
            &node(
                serde_json::json!([{"key": keys::TAINT_DRAINING, "value": "manual", "effect": "NoSchedule"}])
            )
        ));
        assert!(!node_kept(patch, &node(serde_json::json!(null))));
    }
}
