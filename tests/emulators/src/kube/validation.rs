//! The API server's validation and admission that lastcall's writes meet, answered with
//! 422 `Invalid` like the real server (`k8s.io/apimachinery` and `pkg/apis/core/validation`
//! rules; see `docs/testing/kube-emulator.md` for the sources):
//! - metadata: label keys and annotation keys are qualified names, label values are valid
//!   label values (at most 63 characters, `(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?`);
//! - Nodes: taints have valid keys, values and effects, unique by key and effect;
//! - Pods: tolerations are well formed; an update may change only container and init
//!   container images, `activeDeadlineSeconds` (set, or lowered), tolerations (additions,
//!   and `tolerationSeconds` of existing ones) and a negative
//!   `terminationGracePeriodSeconds` to 1;
//! - the DefaultTolerationSeconds admission plugin on pod creation.

use serde_json::{Map, Value, json};

use super::resources::{NODES, PODS, ResourceType};
use super::status::ApiError;

/// `tolerationSeconds` the DefaultTolerationSeconds plugin gives (its flag default).
pub const DEFAULT_TOLERATION_SECONDS: i64 = 300;
/// The taint keys that plugin adds tolerations for, in the order it adds them.
pub const NOT_READY: &str = "node.kubernetes.io/not-ready";
pub const UNREACHABLE: &str = "node.kubernetes.io/unreachable";

const NAME_PART_FMT: &str = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]";
const LABEL_VALUE_FMT: &str = "(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?";
const DNS1123_SUBDOMAIN_FMT: &str =
    "[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*";

/// `field: message` lines, as the server lists them.
pub type Errors = Vec<String>;

fn quoted(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

fn name_part_ok(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.first().is_some_and(u8::is_ascii_alphanumeric)
        && b.last().is_some_and(u8::is_ascii_alphanumeric)
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

fn dns1123_subdomain_ok(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            let b = label.as_bytes();
            !b.is_empty()
                && b.iter()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
                && b.first().is_some_and(u8::is_ascii_alphanumeric)
                && b.last().is_some_and(u8::is_ascii_alphanumeric)
        })
}

/// Problems with a qualified name (`prefix/name` or `name`), as `IsQualifiedName` words them.
pub fn qualified_name_errors(key: &str) -> Vec<String> {
    let mut errs = Vec::new();
    let (prefix, name) = match key.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if key.matches('/').count() > 1 {
        return vec![format!(
            "a qualified name must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is '{NAME_PART_FMT}') with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"
        )];
    }
    if let Some(p) = prefix {
        if p.is_empty() {
            errs.push("prefix part must be non-empty".to_string());
        } else if !dns1123_subdomain_ok(p) {
            errs.push(format!("prefix part a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '{DNS1123_SUBDOMAIN_FMT}')"));
        }
    }
    if name.is_empty() {
        errs.push("name part must be non-empty".to_string());
    } else {
        if name.len() > 63 {
            errs.push("name part must be no more than 63 characters".to_string());
        }
        if !name_part_ok(name) {
            errs.push(format!("name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is '{NAME_PART_FMT}')"));
        }
    }
    errs
}

/// Problems with a label value, as `IsValidLabelValue` words them.
pub fn label_value_errors(value: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if value.len() > 63 {
        errs.push("must be no more than 63 bytes".to_string());
    }
    if !value.is_empty() && !name_part_ok(value) {
        errs.push(format!("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for validation is '{LABEL_VALUE_FMT}')"));
    }
    errs
}

fn map_at<'a>(obj: &'a Value, path: &str) -> Option<&'a Map<String, Value>> {
    obj.pointer(path).and_then(Value::as_object)
}

/// Labels and annotation keys of any object.
fn metadata(obj: &Value, errs: &mut Errors) {
    if let Some(labels) = map_at(obj, "/metadata/labels") {
        for (k, v) in labels {
            for e in qualified_name_errors(k) {
                errs.push(format!(
                    "metadata.labels: Invalid value: {}: {e}",
                    quoted(k)
                ));
            }
            match v.as_str() {
                Some(s) => {
                    for e in label_value_errors(s) {
                        errs.push(format!(
                            "metadata.labels: Invalid value: {}: {e}",
                            quoted(s)
                        ));
                    }
                }
                None => errs.push(format!(
                    "metadata.labels: Invalid value: {v}: label values must be strings"
                )),
            }
        }
    }
    if let Some(annotations) = map_at(obj, "/metadata/annotations") {
        for k in annotations.keys() {
            for e in qualified_name_errors(k) {
                errs.push(format!(
                    "metadata.annotations: Invalid value: {}: {e}",
                    quoted(k)
                ));
            }
        }
    }
}

fn str_at<'a>(v: &'a Value, key: &str) -> &'a str {
    v.get(key).and_then(Value::as_str).unwrap_or_default()
}

/// `spec.taints`: keys, values, effects, and no two with the same key and effect.
fn node_taints(obj: &Value, errs: &mut Errors) {
    let Some(taints) = obj.pointer("/spec/taints").and_then(Value::as_array) else {
        return;
    };
    let mut seen: Vec<(&str, &str)> = Vec::new();
    for (i, t) in taints.iter().enumerate() {
        let (key, value, effect) = (str_at(t, "key"), str_at(t, "value"), str_at(t, "effect"));
        for e in qualified_name_errors(key) {
            errs.push(format!(
                "spec.taints[{i}].key: Invalid value: {}: {e}",
                quoted(key)
            ));
        }
        for e in label_value_errors(value) {
            errs.push(format!(
                "spec.taints[{i}].value: Invalid value: {}: {e}",
                quoted(value)
            ));
        }
        match effect {
            "NoSchedule" | "PreferNoSchedule" | "NoExecute" => {}
            "" => errs.push(format!("spec.taints[{i}].effect: Required value")),
            other => errs.push(format!(
                "spec.taints[{i}].effect: Unsupported value: {}: supported values: \"NoExecute\", \"NoSchedule\", \"PreferNoSchedule\"",
                quoted(other)
            )),
        }
        if seen.contains(&(key, effect)) {
            errs.push(format!(
                "metadata.taints[{i}]: Duplicate value: {{\"Key\":{},\"Value\":{},\"Effect\":{},\"TimeAdded\":null}}: taints must be unique by key and effect pair",
                quoted(key),
                quoted(value),
                quoted(effect)
            ));
            continue;
        }
        seen.push((key, effect));
    }
}

/// `spec.tolerations` of a pod (ValidateTolerations).
fn tolerations(spec: &Value, errs: &mut Errors) {
    let Some(list) = spec.get("tolerations").and_then(Value::as_array) else {
        return;
    };
    for (i, t) in list.iter().enumerate() {
        let path = format!("spec.tolerations[{i}]");
        let (key, op, value, effect) = (
            str_at(t, "key"),
            str_at(t, "operator"),
            str_at(t, "value"),
            str_at(t, "effect"),
        );
        if !key.is_empty() {
            for e in qualified_name_errors(key) {
                errs.push(format!("{path}.key: Invalid value: {}: {e}", quoted(key)));
            }
        }
        if key.is_empty() && op != "Exists" {
            errs.push(format!(
                "{path}.operator: Invalid value: {}: operator must be Exists when `key` is empty, which means \"match all values and all keys\"",
                quoted(op)
            ));
        }
        if t.get("tolerationSeconds").is_some_and(|s| !s.is_null()) && effect != "NoExecute" {
            errs.push(format!(
                "{path}.effect: Invalid value: {}: effect must be 'NoExecute' when `tolerationSeconds` is set",
                quoted(effect)
            ));
        }
        match op {
            "" | "Equal" => {
                for e in label_value_errors(value) {
                    errs.push(format!(
                        "{path}.operator: Invalid value: {}: {e}",
                        quoted(value)
                    ));
                }
            }
            "Exists" => {
                if !value.is_empty() {
                    errs.push(format!(
                        "{path}.operator: Invalid value: {}: value must be empty when `operator` is 'Exists'",
                        quoted(value)
                    ));
                }
            }
            other => errs.push(format!(
                "{path}.operator: Unsupported value: {}: supported values: \"Equal\", \"Exists\"",
                quoted(other)
            )),
        }
        match effect {
            "" | "NoSchedule" | "PreferNoSchedule" | "NoExecute" => {}
            other => errs.push(format!(
                "{path}.effect: Unsupported value: {}: supported values: \"NoExecute\", \"NoSchedule\", \"PreferNoSchedule\"",
                quoted(other)
            )),
        }
    }
}

/// Validation of a new object.
pub fn on_create(rt: &ResourceType, obj: &Value) -> Errors {
    let mut errs = Errors::new();
    metadata(obj, &mut errs);
    if *rt == NODES {
        node_taints(obj, &mut errs);
    }
    if *rt == PODS
        && let Some(spec) = obj.get("spec")
    {
        tolerations(spec, &mut errs);
    }
    errs
}

/// Validation of an update (`main` false for a `/status` write, which keeps the spec).
pub fn on_update(rt: &ResourceType, old: &Value, new: &Value, main: bool) -> Errors {
    let mut errs = Errors::new();
    metadata(new, &mut errs);
    if *rt == NODES {
        node_taints(new, &mut errs);
    }
    if *rt == PODS && main {
        let empty = json!({});
        let (o, n) = (
            old.get("spec").unwrap_or(&empty),
            new.get("spec").unwrap_or(&empty),
        );
        tolerations(n, &mut errs);
        pod_spec_update(o, n, &mut errs);
    }
    errs
}

fn toleration_without_seconds(t: &Value) -> Value {
    let mut t = t.clone();
    if let Some(m) = t.as_object_mut() {
        m.remove("tolerationSeconds");
    }
    t
}

/// ValidatePodUpdate: what an update may change in a pod's spec.
fn pod_spec_update(old: &Value, new: &Value, errs: &mut Errors) {
    let before = errs.len();
    // activeDeadlineSeconds: may be set, or lowered; never raised or unset.
    let (o_ads, n_ads) = (
        old.get("activeDeadlineSeconds").and_then(Value::as_i64),
        new.get("activeDeadlineSeconds").and_then(Value::as_i64),
    );
    match (o_ads, n_ads) {
        (_, Some(n)) if !(0..=i64::from(i32::MAX)).contains(&n) => errs.push(format!(
            "spec.activeDeadlineSeconds: Invalid value: {n}: must be between 0 and 2147483647, inclusive"
        )),
        (Some(o), Some(n)) if n > o => errs.push(format!(
            "spec.activeDeadlineSeconds: Invalid value: {n}: must be less than or equal to previous value"
        )),
        (Some(_), None) => errs.push(
            "spec.activeDeadlineSeconds: Invalid value: \"null\": must not update from a positive integer to nil value"
                .to_string(),
        ),
        _ => {}
    }
    // Tolerations: existing ones stay, only their tolerationSeconds may change.
    let list = |s: &Value| {
        s.get("tolerations")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let (o_tol, n_tol) = (list(old), list(new));
    let n_stripped: Vec<Value> = n_tol.iter().map(toleration_without_seconds).collect();
    if o_tol
        .iter()
        .any(|t| !n_stripped.contains(&toleration_without_seconds(t)))
    {
        errs.push(
            "spec.tolerations: Forbidden: existing toleration can not be modified except its tolerationSeconds"
                .to_string(),
        );
    }
    if errs.len() > before {
        return;
    }
    // Everything else must be unchanged (images and the fields above aside).
    let mut a = new.clone();
    let mut b = old.clone();
    for m in [&mut a, &mut b] {
        if let Some(map) = m.as_object_mut() {
            map.remove("activeDeadlineSeconds");
            map.remove("tolerations");
        }
    }
    for list in ["containers", "initContainers"] {
        let old_images: Vec<Value> = b
            .get(list)
            .and_then(Value::as_array)
            .map(|cs| {
                cs.iter()
                    .map(|c| c.get("image").cloned().unwrap_or(Value::Null))
                    .collect()
            })
            .unwrap_or_default();
        if let Some(cs) = a.get_mut(list).and_then(Value::as_array_mut)
            && cs.len() == old_images.len()
        {
            for (c, img) in cs.iter_mut().zip(old_images) {
                if let Some(m) = c.as_object_mut() {
                    match img {
                        Value::Null => m.remove("image"),
                        img => m.insert("image".into(), img),
                    };
                }
            }
        }
    }
    let o_grace = old
        .get("terminationGracePeriodSeconds")
        .and_then(Value::as_i64);
    let n_grace = new
        .get("terminationGracePeriodSeconds")
        .and_then(Value::as_i64);
    if o_grace.is_some_and(|g| g < 0)
        && n_grace == Some(1)
        && let (Some(am), Some(g)) = (a.as_object_mut(), old.get("terminationGracePeriodSeconds"))
    {
        am.insert("terminationGracePeriodSeconds".into(), g.clone());
    }
    if a != b {
        errs.push("spec: Forbidden: pod updates may not change fields other than `spec.containers[*].image`,`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)".to_string());
    }
}

/// The DefaultTolerationSeconds admission plugin: a new pod that does not already
/// tolerate `not-ready` / `unreachable` NoExecute taints (a toleration with that key or
/// no key, and effect NoExecute or none) gets `Exists` tolerations for them with
/// `tolerationSeconds: 300`.
pub fn default_toleration_seconds(pod: &mut Value) {
    let tolerates = |list: &[Value], key: &str| {
        list.iter().any(|t| {
            let (k, e) = (str_at(t, "key"), str_at(t, "effect"));
            (k == key || k.is_empty()) && (e == "NoExecute" || e.is_empty())
        })
    };
    let existing: Vec<Value> = pod
        .pointer("/spec/tolerations")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let mut added = Vec::new();
    for key in [NOT_READY, UNREACHABLE] {
        if !tolerates(&existing, key) {
            added.push(json!({
                "key": key,
                "operator": "Exists",
                "effect": "NoExecute",
                "tolerationSeconds": DEFAULT_TOLERATION_SECONDS,
            }));
        }
    }
    if added.is_empty() {
        return;
    }
    let Some(root) = pod.as_object_mut() else {
        return;
    };
    let spec = root.entry("spec").or_insert_with(|| json!({}));
    let Some(spec) = spec.as_object_mut() else {
        return;
    };
    let list = spec
        .entry("tolerations")
        .or_insert_with(|| Value::Array(Vec::new()));
    if !list.is_array() {
        *list = Value::Array(Vec::new());
    }
    if let Value::Array(l) = list {
        l.extend(added);
    }
}

/// The 422 for `errs` (none: `Ok`). One error is the message itself; several are listed
/// in brackets, as the server joins them.
pub fn check(rt: &ResourceType, name: &str, errs: Errors) -> Result<(), ApiError> {
    if errs.is_empty() {
        return Ok(());
    }
    Err(ApiError::invalid_list(&rt.qualified_kind(), name, &errs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_rules() {
        assert!(label_value_errors("").is_empty());
        assert!(label_value_errors("node-1.a_b").is_empty());
        assert_eq!(label_value_errors(&"a".repeat(63)).len(), 0);
        assert_eq!(label_value_errors(&"a".repeat(64)).len(), 1);
        assert_eq!(label_value_errors("-a").len(), 1);
        assert!(qualified_name_errors("lastcall.dev/node-draining").is_empty());
        assert!(qualified_name_errors("app").is_empty());
        assert_eq!(qualified_name_errors("Bad_Prefix/x").len(), 1);
        assert_eq!(qualified_name_errors("a/b/c").len(), 1);
        assert_eq!(qualified_name_errors(&"k".repeat(64)).len(), 1);
        assert_eq!(qualified_name_errors("/x").len(), 1);
    }

    #[test]
    fn default_tolerations_are_added_once() {
        let mut pod = json!({"spec": {"tolerations": [
            {"key": NOT_READY, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 5}
        ]}});
        default_toleration_seconds(&mut pod);
        let list = pod["spec"]["tolerations"].as_array().unwrap();
        assert_eq!(list.len(), 2);
        assert_eq!(list[1]["key"], UNREACHABLE);
        assert_eq!(list[1]["tolerationSeconds"], 300);
        let mut all = json!({"spec": {"tolerations": [{"operator": "Exists"}]}});
        default_toleration_seconds(&mut all);
        assert_eq!(all["spec"]["tolerations"].as_array().unwrap().len(), 1);
    }

    #[test]
    fn pod_updates() {
        let old = json!({"containers": [{"name": "c", "image": "a:1"}], "nodeName": "n1",
            "tolerations": [{"key": "k", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 10}]});
        let ok = |new: Value| {
            let mut e = Errors::new();
            pod_spec_update(&old, &new, &mut e);
            e
        };
        let mut image = old.clone();
        image["containers"][0]["image"] = json!("a:2");
        assert!(ok(image).is_empty());
        let mut secs = old.clone();
        secs["tolerations"][0]["tolerationSeconds"] = json!(1);
        secs["tolerations"]
            .as_array_mut()
            .unwrap()
            .push(json!({"key": "x", "operator": "Exists"}));
        assert!(ok(secs).is_empty());
        let mut removed = old.clone();
        removed["tolerations"] = json!([]);
        assert_eq!(ok(removed).len(), 1);
        let mut moved = old.clone();
        moved["nodeName"] = json!("n2");
        assert_eq!(ok(moved).len(), 1);
        let mut deadline = old.clone();
        deadline["activeDeadlineSeconds"] = json!(30);
        assert!(ok(deadline.clone()).is_empty());
        let mut raised = deadline.clone();
        raised["activeDeadlineSeconds"] = json!(60);
        let mut e = Errors::new();
        pod_spec_update(&deadline, &raised, &mut e);
        assert_eq!(e.len(), 1);
    }
}
