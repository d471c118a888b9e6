//! Discovery documents (`/api`, `/apis`, `/apis/{group}/{version}`, `/version`) built from
//! the resource table, so kube-rs `Discovery` and dynamic clients find every served type.

use serde_json::{Value, json};

use super::resources::{ALL, ResourceType};

const VERBS: &[&str] = &[
    "create",
    "delete",
    "deletecollection",
    "get",
    "list",
    "patch",
    "update",
    "watch",
];

/// Versions served under `/apis`, one per group, in table order.
fn groups() -> Vec<(&'static str, &'static str)> {
    let mut out: Vec<(&str, &str)> = Vec::new();
    for rt in ALL.iter().filter(|rt| !rt.group.is_empty()) {
        if !out.contains(&(rt.group, rt.version)) {
            out.push((rt.group, rt.version));
        }
    }
    out
}

fn group_doc(group: &str, version: &str) -> Value {
    let gv = json!({ "groupVersion": format!("{group}/{version}"), "version": version });
    json!({ "name": group, "versions": [gv.clone()], "preferredVersion": gv })
}

/// `GET /api`.
pub fn api_versions(server_address: &str) -> Value {
    json!({
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{ "clientCIDR": "0.0.0.0/0", "serverAddress": server_address }],
    })
}

/// `GET /apis`.
pub fn api_group_list() -> Value {
    let groups: Vec<Value> = groups().into_iter().map(|(g, v)| group_doc(g, v)).collect();
    json!({ "kind": "APIGroupList", "apiVersion": "v1", "groups": groups })
}

/// `GET /apis/{group}`, if served.
pub fn api_group(group: &str) -> Option<Value> {
    let (g, v) = groups().into_iter().find(|(g, _)| *g == group)?;
    let mut doc = group_doc(g, v);
    doc["kind"] = json!("APIGroup");
    doc["apiVersion"] = json!("v1");
    Some(doc)
}

fn resource_entry(rt: &ResourceType) -> Value {
    let mut e = json!({
        "name": rt.plural,
        "singularName": rt.singular(),
        "namespaced": rt.namespaced,
        "kind": rt.kind,
        "verbs": VERBS,
    });
    if !rt.short_names().is_empty() {
        e["shortNames"] = json!(rt.short_names());
    }
    if rt.group == "agones.dev" {
        e["categories"] = json!(["all"]);
    }
    e
}

/// `GET /api/v1` or `GET /apis/{group}/{version}`, if served.
pub fn api_resource_list(group: &str, version: &str) -> Option<Value> {
    let types: Vec<&ResourceType> = ALL
        .iter()
        .filter(|rt| rt.group == group && rt.version == version)
        .collect();
    if types.is_empty() {
        return None;
    }
    let mut resources = Vec::new();
    for rt in types {
        resources.push(resource_entry(rt));
        if rt.has_status_subresource() {
            resources.push(json!({
                "name": format!("{}/status", rt.plural),
                "singularName": "",
                "namespaced": rt.namespaced,
                "kind": rt.kind,
                "verbs": ["get", "patch", "update"],
            }));
        }
        if rt.plural == "pods" && rt.group.is_empty() {
            resources.push(json!({
                "name": "pods/binding",
                "singularName": "",
                "namespaced": true,
                "kind": "Binding",
                "verbs": ["create"],
            }));
            resources.push(json!({
                "name": "pods/eviction",
                "singularName": "",
                "namespaced": true,
                "group": "policy",
                "version": "v1",
                "kind": "Eviction",
                "verbs": ["create"],
            }));
        }
    }
    let gv = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    Some(
        json!({ "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources }),
    )
}

/// `GET /version`: the Kubernetes version the emulator models.
pub fn version() -> Value {
    json!({
        "major": "1",
        "minor": "33",
        "gitVersion": "v1.33.0-lastcall-emulator",
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2026-01-01T00:00:00Z",
        "goVersion": "n/a",
        "compiler": "rustc",
        "platform": "linux/amd64",
    })
}
