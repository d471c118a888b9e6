//! Store-only worlds for scale runs: Nodes, bound Running pods and GameServers written
//! straight into a [`Store`], with no scheduler, kubelet or Agones controller behind them.
//!
//! Thousands of nodes are cheap this way: nothing runs per object, so the emulator's CPU
//! goes to serving the API. What a controller would do (pods of deleted GameServers
//! removed, node status heartbeats, matches ending) is the scale harness's job, over HTTP.
//! GameServers carry no finalizer, so a DELETE removes one at once, as Agones' controller
//! would shortly after.

use serde_json::{Value, json};

use super::fixtures::NodeSpec;
use super::objects::keys;
use crate::kube::resources::{GAMESERVERS, NODES, PODS};
use crate::kube::{ApiError, Store};

/// Namespace of every preloaded pod and GameServer.
pub const NAMESPACE: &str = "default";
/// The Fleet label value of every preloaded GameServer.
pub const FLEET: &str = "main";
/// The agent's ownership label, set on preloaded servers as if their agent had claimed them.
pub const LABEL_NODE: &str = "lastcall.dev/node";

/// What to preload.
#[derive(Clone, Copy, Debug)]
pub struct Preload {
    pub nodes: usize,
    pub servers_per_node: usize,
    /// The first this many servers of each node are Allocated, the rest Ready.
    pub allocated_per_node: usize,
}

/// Name of node `i`.
pub fn node_name(i: usize) -> String {
    format!("node{i:05}")
}

/// Name of the `k`th GameServer (and its pod) on node `i`.
pub fn server_name(i: usize, k: usize) -> String {
    format!("gs-{}-{k:03}", node_name(i))
}

/// The node a preloaded server's name places it on.
pub fn node_of(server: &str) -> Option<&str> {
    let rest = server.strip_prefix("gs-")?;
    Some(&rest[..rest.rfind('-')?])
}

/// Writes the world into `store`. Returns the number of objects created.
pub fn preload(store: &Store, p: &Preload) -> Result<usize, ApiError> {
    let mut created = 0;
    for i in 0..p.nodes {
        let node = node_name(i);
        let mut spec = NodeSpec::new(&node);
        spec.internal_ip = Some(format!("10.{}.{}.{}", i >> 16, (i >> 8) & 0xff, i & 0xff));
        store.create(&NODES, None, spec.to_object())?;
        created += 1;
        for k in 0..p.servers_per_node {
            let name = server_name(i, k);
            let state = if k < p.allocated_per_node {
                "Allocated"
            } else {
                "Ready"
            };
            let gs = store.create(
                &GAMESERVERS,
                Some(NAMESPACE),
                game_server(&name, &node, state),
            )?;
            let uid = gs
                .pointer("/metadata/uid")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string();
            store.create(&PODS, Some(NAMESPACE), pod(&name, &uid, &node))?;
            created += 2;
        }
    }
    Ok(created)
}

/// A GameServer of Fleet [`FLEET`] in `state` on `node`, already claimed by its agent.
pub fn game_server(name: &str, node: &str, state: &str) -> Value {
    json!({
        "apiVersion": "agones.dev/v1",
        "kind": "GameServer",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": { keys::FLEET_LABEL: FLEET, LABEL_NODE: node },
            "annotations": {},
        },
        "spec": {
            "container": "gameserver",
            "ports": [{ "name": "default", "portPolicy": "Dynamic", "containerPort": 7654 }],
            "template": { "spec": { "containers": [{ "name": "gameserver", "image": "gameserver" }] } },
        },
        "status": {
            "state": state,
            "nodeName": node,
            "address": "10.0.0.1",
            "ports": [{ "name": "default", "port": 7000 }],
        },
    })
}

/// The Running pod of GameServer `name` (uid `uid`) on `node`.
pub fn pod(name: &str, uid: &str, node: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": {
                keys::ROLE_LABEL: keys::ROLE_GAMESERVER,
                keys::GAMESERVER_LABEL: name,
                keys::FLEET_LABEL: FLEET,
            },
            "ownerReferences": [{
                "apiVersion": "agones.dev/v1",
                "kind": "GameServer",
                "name": name,
                "uid": uid,
                "controller": true,
                "blockOwnerDeletion": true,
            }],
        },
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 0,
            "containers": [{ "name": "gameserver", "image": "gameserver" }],
        },
        "status": {
            "phase": "Running",
            "conditions": [{ "type": "Ready", "status": "True" }],
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        assert_eq!(node_of(&server_name(42, 7)), Some(node_name(42).as_str()));
        assert_eq!(node_of("other"), None);
    }

    #[test]
    fn preloads_bound_pods_and_claimed_servers() {
        let store = Store::new(100);
        let n = preload(
            &store,
            &Preload {
                nodes: 3,
                servers_per_node: 4,
                allocated_per_node: 1,
            },
        )
        .unwrap();
        assert_eq!(n, 3 + 3 * 4 * 2);
        let (pods, _) = store.list(&PODS, Some(NAMESPACE));
        assert!(pods.iter().all(|p| p["spec"]["nodeName"].is_string()));
        let (gss, _) = store.list(&GAMESERVERS, Some(NAMESPACE));
        let allocated = gss
            .iter()
            .filter(|g| g["status"]["state"] == "Allocated")
            .count();
        assert_eq!(allocated, 3);
    }
}
