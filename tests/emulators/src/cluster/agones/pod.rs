//! What Agones makes for a GameServer besides the GameServer: its pod, and (once per
//! namespace, from its Helm chart) the PodDisruptionBudget that keeps `Never` pods.

use serde_json::{Map, Value, json};

use super::default_eviction;
use crate::cluster::objects::{GameServerView, SDK_VERSION, keys};

/// The `agones-gameserver-safe-to-evict-false` PDB of the Agones chart
/// (`install/helm/agones/templates/pdb.yaml`, one per `gameservers.namespaces` entry):
/// `maxUnavailable: 0%` over pods labelled `agones.dev/safe-to-evict: "false"`, that is
/// `Never` pods only ([`crate::cluster::EvictionSafe::safe_to_evict_label`]).
pub fn agones_pdb(ns: &str) -> Value {
    json!({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": keys::AGONES_PDB,
            "namespace": ns,
            "labels": { "app": "agones" },
        },
        "spec": {
            "maxUnavailable": "0%",
            "selector": { "matchLabels": { keys::SAFE_TO_EVICT_LABEL: "false" } },
        },
    })
}

/// The GameServer's pod, as Agones' `GameServer.Pod()` builds it from `spec.template`
/// (`pkg/apis/agones/v1/gameserver.go`): the template's metadata and spec, named and placed
/// as the server (`podObjectMeta`), the labels `agones.dev/role=gameserver` and
/// `agones.dev/gameserver=<name>`, the annotations `agones.dev/container` and
/// `agones.dev/sdk-version`, a controller ownerReference to the server, `restartPolicy:
/// Never` unless the template says otherwise (the SidecarContainers feature gate, beta and
/// on by default: `pkg/util/runtime/features.go`), and the eviction label and annotation by `eviction.safe` where the template
/// did not set them (`pkg/cloudproduct/eviction/eviction.go`, `SetEviction`: the table is
/// [`crate::cluster::EvictionSafe`]'s).
pub fn build_pod(gs: &GameServerView, raw: &Value) -> Value {
    let template = raw
        .pointer("/spec/template")
        .cloned()
        .unwrap_or_else(|| json!({}));
    let mut meta: Map<String, Value> = template
        .get("metadata")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let mut spec: Map<String, Value> = template
        .get("spec")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let has_containers = spec
        .get("containers")
        .and_then(Value::as_array)
        .is_some_and(|c| !c.is_empty());
    if !has_containers {
        spec.insert(
            "containers".into(),
            json!([{ "name": "gameserver", "image": "gameserver" }]),
        );
    }
    spec.entry("restartPolicy")
        .or_insert_with(|| json!("Never"));
    let container = raw
        .pointer("/spec/container")
        .and_then(Value::as_str)
        .map(str::to_string)
        .or_else(|| {
            spec.get("containers")
                .and_then(|c| c.get(0))
                .and_then(|c| c.get("name"))
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .unwrap_or_default();
    let safe = gs
        .eviction_status
        .or(gs.eviction_spec)
        .unwrap_or_else(|| default_eviction(raw));

    let labels = string_map(&mut meta, "labels");
    labels.insert(keys::ROLE_LABEL.into(), json!(keys::ROLE_GAMESERVER));
    labels.insert(keys::GAMESERVER_LABEL.into(), json!(gs.name));
    labels
        .entry(keys::SAFE_TO_EVICT_LABEL)
        .or_insert_with(|| json!(safe.safe_to_evict_label()));
    let annotations = string_map(&mut meta, "annotations");
    annotations.insert(keys::CONTAINER_ANNOTATION.into(), json!(container));
    annotations.insert(keys::SDK_VERSION_ANNOTATION.into(), json!(SDK_VERSION));
    annotations
        .entry(keys::CA_SAFE_TO_EVICT)
        .or_insert_with(|| json!(safe.ca_annotation()));
    meta.insert("name".into(), json!(gs.name));
    meta.insert("namespace".into(), json!(gs.namespace));
    meta.remove("generateName");
    meta.remove("resourceVersion");
    meta.remove("uid");
    meta.insert(
        "ownerReferences".into(),
        json!([{
            "apiVersion": "agones.dev/v1",
            "kind": "GameServer",
            "name": gs.name,
            "uid": gs.uid,
            "controller": true,
            "blockOwnerDeletion": true,
        }]),
    );
    json!({ "apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec })
}

/// `meta[key]` as a map, created when missing or not a map.
fn string_map<'a>(meta: &'a mut Map<String, Value>, key: &str) -> &'a mut Map<String, Value> {
    let v = meta.entry(key).or_insert_with(|| json!({}));
    if !v.is_object() {
        *v = json!({});
    }
    match v {
        Value::Object(m) => m,
        _ => unreachable!("made an object above"),
    }
}
