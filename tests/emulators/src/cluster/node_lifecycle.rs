//! The node lifecycle controller's taint for cordoned nodes.
//!
//! With TaintNodesByCondition (always on since Kubernetes 1.17), the controller keeps a
//! `node.kubernetes.io/unschedulable:NoSchedule` taint on every node whose
//! `spec.unschedulable` is true, and removes it once the node is uncordoned. Each change
//! is a write to the Node, so it bumps the Node's resourceVersion: a client that cordons
//! and then writes the Node with the resourceVersion it got back from the cordon can
//! lose that race, as on a real cluster.

use k8s_openapi::api::core::v1::Taint;
use serde_json::{Value, json};

use crate::kube::resources::NODES;
use crate::kube::store::Store;

use super::writes::{object_at, report};

/// The taint key the controller manages for cordoned nodes.
pub const UNSCHEDULABLE_TAINT: &str = "node.kubernetes.io/unschedulable";

fn taints(obj: &Value) -> Vec<Value> {
    obj.pointer("/spec/taints")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

fn is_unschedulable_taint(t: &Value) -> bool {
    t.get("key").and_then(Value::as_str) == Some(UNSCHEDULABLE_TAINT)
        && t.get("effect").and_then(Value::as_str) == Some("NoSchedule")
}

/// What the taint list should be, if it needs to change.
fn desired(obj: &Value) -> Option<Vec<Value>> {
    let cordoned = obj
        .pointer("/spec/unschedulable")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let list = taints(obj);
    let has = list.iter().any(is_unschedulable_taint);
    match (cordoned, has) {
        (true, false) => {
            let mut list = list;
            let taint = Taint {
                key: UNSCHEDULABLE_TAINT.to_string(),
                effect: "NoSchedule".to_string(),
                value: None,
                time_added: None,
            };
            list.push(json!(taint));
            Some(list)
        }
        (false, true) => Some(
            list.into_iter()
                .filter(|t| !is_unschedulable_taint(t))
                .collect(),
        ),
        _ => None,
    }
}

/// One pass: adds or removes the taint where `spec.unschedulable` says so. Each write
/// re-checks the node as it is now, so a cordon flipped meanwhile is left to the next pass.
pub(crate) fn run(store: &Store) {
    let (nodes, _) = store.list(&NODES, None);
    for node in nodes {
        if desired(&node).is_none() {
            continue;
        }
        let Some(name) = node.pointer("/metadata/name").and_then(Value::as_str) else {
            continue;
        };
        let res = store.modify(&NODES, None, name, |obj| {
            if let Some(list) = desired(obj) {
                object_at(obj, &["spec"]).insert("taints".into(), Value::Array(list));
            }
            Ok(())
        });
        report("node lifecycle taint", "", name, res);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn follows_the_cordon() {
        let cordoned = json!({"spec": {"unschedulable": true, "taints": [{"key": "a", "effect": "NoExecute"}]}});
        let list = desired(&cordoned).unwrap();
        assert_eq!(list.len(), 2);
        assert!(is_unschedulable_taint(&list[1]));
        let done = json!({"spec": {"unschedulable": true, "taints": list}});
        assert!(desired(&done).is_none());
        let uncordoned = json!({"spec": {"taints": [{"key": UNSCHEDULABLE_TAINT, "effect": "NoSchedule"}, {"key": "a", "effect": "NoExecute"}]}});
        assert_eq!(desired(&uncordoned).unwrap().len(), 1);
        assert!(desired(&json!({"spec": {}})).is_none());
    }
}
