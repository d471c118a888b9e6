//! The Fleet controller (Agones' Fleet + GameServerSet controllers folded into one).
//!
//! A Fleet owns the GameServers it created (controller ownerRef, label
//! `agones.dev/fleet=<fleet>`). Each pass it:
//! - deletes its Unhealthy GameServers at once;
//! - counts the GameServers that are up (not being deleted, not Unhealthy/Shutdown/Error;
//!   Allocated and Reserved always count) and creates the missing ones from
//!   `spec.template`, or scales down surplus ones that are neither Allocated nor Reserved
//!   (not-yet-Ready first, then Ready ones on the emptiest nodes, as Packed does) by an
//!   update to `Shutdown` guarded by the resourceVersion it read, like the GameServerSet
//!   controller, so a server allocated meanwhile is kept;
//! - writes `status.{replicas,readyReplicas,reservedReplicas,allocatedReplicas}`.
//!
//! There is no GameServerSet object: GameServers carry the `agones.dev/gameserverset`
//! label of a set named after the Fleet, and their ownerRef points at the Fleet itself.
//! GameServers whose Fleet is gone are garbage-collected.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde_json::{Map, Value, json};

use crate::kube::resources::{FLEETS, GAMESERVERS};
use crate::kube::store::{DeleteOptions, Store};

use super::objects::{FleetView, GameServerState, GameServerView, keys};
use super::writes::{list_parsed, object_at, report};

/// At most this many GameServers are created per Fleet and pass (Agones' `maxCreations`
/// throttles the same way), so a huge scale-up still lets other work interleave.
const MAX_CREATIONS_PER_PASS: i64 = 64;

/// One pass over every Fleet.
pub(crate) fn run(store: &Store) {
    let fleets: Vec<FleetView> = list_parsed(store, &FLEETS, FleetView::parse)
        .into_iter()
        .map(|(f, _)| f)
        .collect();
    let gameservers = list_parsed(store, &GAMESERVERS, GameServerView::parse);
    let mut per_node: HashMap<String, usize> = HashMap::new();
    for (gs, _) in &gameservers {
        if let Some(node) = &gs.node
            && !gs.is_being_deleted()
        {
            *per_node.entry(node.clone()).or_default() += 1;
        }
    }
    let live: HashSet<&str> = fleets.iter().map(|f| f.uid.as_str()).collect();
    let mut owned: HashMap<&str, Vec<&(GameServerView, Value)>> = HashMap::new();
    for entry in &gameservers {
        let Some(owner) = entry.0.owner_fleet_uid.as_deref() else {
            continue;
        };
        if live.contains(owner) {
            owned.entry(owner).or_default().push(entry);
        } else if !entry.0.deleting {
            delete_gameserver(store, &entry.0, "delete gameserver of a deleted fleet");
        }
    }
    for fleet in &fleets {
        let members = owned.remove(fleet.uid.as_str()).unwrap_or_default();
        reconcile(store, fleet, &members, &per_node);
    }
}

fn reconcile(
    store: &Store,
    fleet: &FleetView,
    members: &[&(GameServerView, Value)],
    per_node: &HashMap<String, usize>,
) {
    if !fleet.deleting {
        for (gs, _) in members {
            if gs.state == Some(GameServerState::Unhealthy) && !gs.deleting {
                delete_gameserver(store, gs, "delete unhealthy gameserver");
            }
        }
        let up = members.iter().filter(|(gs, _)| gs.counts_as_up()).count();
        let up = i64::try_from(up).unwrap_or(i64::MAX);
        if up < fleet.replicas {
            for _ in 0..(fleet.replicas - up).min(MAX_CREATIONS_PER_PASS) {
                let res = store.create(
                    &GAMESERVERS,
                    Some(&fleet.namespace),
                    build_gameserver(fleet),
                );
                report(
                    "create fleet gameserver",
                    &fleet.namespace,
                    &fleet.name,
                    res,
                );
            }
        } else if up > fleet.replicas {
            let surplus = usize::try_from(up - fleet.replicas).unwrap_or(0);
            for (gs, raw) in scale_down_candidates(members, per_node)
                .into_iter()
                .take(surplus)
            {
                shut_down(store, gs, raw);
            }
        }
    }
    write_status(store, fleet, members);
}

/// GameServers a scale-down may remove, in the order it removes them: never Allocated or
/// Reserved; servers that are not Ready yet first, then Ready ones on the emptiest nodes.
fn scale_down_candidates<'a>(
    members: &[&'a (GameServerView, Value)],
    per_node: &HashMap<String, usize>,
) -> Vec<&'a (GameServerView, Value)> {
    let mut c: Vec<&(GameServerView, Value)> = members
        .iter()
        .copied()
        .filter(|(gs, _)| gs.counts_as_up())
        .filter(|(gs, _)| {
            !matches!(
                gs.state,
                Some(GameServerState::Allocated | GameServerState::Reserved)
            )
        })
        .collect();
    c.sort_by_key(|(gs, _)| {
        let ready = gs.state == Some(GameServerState::Ready);
        let load = gs
            .node
            .as_ref()
            .and_then(|n| per_node.get(n))
            .copied()
            .unwrap_or(0);
        (ready, load, gs.name.clone())
    });
    c
}

/// Sets state Shutdown with a full update carrying the resourceVersion that was read, as
/// the GameServerSet controller does; a 409 means the server changed (maybe allocated).
fn shut_down(store: &Store, gs: &GameServerView, raw: &Value) {
    let mut obj = raw.clone();
    object_at(&mut obj, &["status"])
        .insert("state".into(), json!(GameServerState::Shutdown.as_str()));
    report(
        "scale down gameserver",
        &gs.namespace,
        &gs.name,
        store.replace(&GAMESERVERS, Some(&gs.namespace), &gs.name, obj),
    );
}

fn delete_gameserver(store: &Store, gs: &GameServerView, action: &'static str) {
    let opts = DeleteOptions {
        precondition_uid: Some(gs.uid.clone()),
        ..Default::default()
    };
    report(
        action,
        &gs.namespace,
        &gs.name,
        store.delete(&GAMESERVERS, Some(&gs.namespace), &gs.name, &opts),
    );
}

/// Fleet status as the GameServerSet computes it: servers being deleted do not count.
fn write_status(store: &Store, fleet: &FleetView, members: &[&(GameServerView, Value)]) {
    let mut counts: BTreeMap<&str, i64> = BTreeMap::new();
    for (gs, _) in members.iter().filter(|(gs, _)| !gs.is_being_deleted()) {
        *counts.entry("replicas").or_default() += 1;
        let field = match gs.state {
            Some(GameServerState::Ready) => "readyReplicas",
            Some(GameServerState::Allocated) => "allocatedReplicas",
            Some(GameServerState::Reserved) => "reservedReplicas",
            _ => continue,
        };
        *counts.entry(field).or_default() += 1;
    }
    let uid = fleet.uid.clone();
    let res = store.modify_status(&FLEETS, Some(&fleet.namespace), &fleet.name, |obj| {
        if obj.pointer("/metadata/uid").and_then(Value::as_str) != Some(uid.as_str()) {
            return Ok(());
        }
        let status = object_at(obj, &["status"]);
        for field in [
            "replicas",
            "readyReplicas",
            "reservedReplicas",
            "allocatedReplicas",
        ] {
            status.insert(field.into(), json!(counts.get(field).copied().unwrap_or(0)));
        }
        Ok(())
    });
    report("fleet status", &fleet.namespace, &fleet.name, res);
}

/// Name of the (virtual) GameServerSet of a Fleet.
fn gameserverset_name(fleet: &FleetView) -> String {
    let suffix: String = fleet
        .uid
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .take(5)
        .collect();
    format!("{}-{}", fleet.name, suffix)
}

/// A new GameServer from the Fleet's template.
fn build_gameserver(fleet: &FleetView) -> Value {
    let gss = gameserverset_name(fleet);
    let template_meta: Map<String, Value> = fleet
        .template
        .get("metadata")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let mut labels: Map<String, Value> = template_meta
        .get("labels")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    labels.insert(keys::FLEET_LABEL.into(), json!(fleet.name));
    labels.insert(keys::GAMESERVERSET_LABEL.into(), json!(gss));
    let annotations = template_meta
        .get("annotations")
        .cloned()
        .unwrap_or_else(|| json!({}));
    let spec = fleet
        .template
        .get("spec")
        .cloned()
        .unwrap_or_else(|| json!({}));
    json!({
        "apiVersion": "agones.dev/v1",
        "kind": "GameServer",
        "metadata": {
            "generateName": format!("{gss}-"),
            "namespace": fleet.namespace,
            "labels": labels,
            "annotations": annotations,
            "finalizers": [keys::GAMESERVER_FINALIZER],
            "ownerReferences": [{
                "apiVersion": "agones.dev/v1",
                "kind": "Fleet",
                "name": fleet.name,
                "uid": fleet.uid,
                "controller": true,
                "blockOwnerDeletion": true,
            }],
        },
        "spec": spec,
    })
}
