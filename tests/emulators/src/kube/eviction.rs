//! The `pods/eviction` subresource: a delete that PodDisruptionBudgets may refuse (429).
//!
//! The real server checks the PDB status the disruption controller maintains; the
//! emulator computes the same numbers from the pods at the moment of the request, under
//! the store lock, so concurrent evictions cannot both spend the last allowed disruption.

use serde_json::{Value, json};

use super::resources::{PDBS, PODS};
use super::selectors::LabelSelector;
use super::status::ApiError;
use super::store::{DeleteOptions, Store, Txn};

/// Evicts a pod: 404 if missing, 429 if a PDB forbids it, else deletes it as `DELETE` would.
pub fn evict(store: &Store, ns: &str, name: &str, opts: &DeleteOptions) -> Result<(), ApiError> {
    store.transaction(|t| evict_in(t, ns, name, opts))
}

fn evict_in(t: &mut Txn<'_>, ns: &str, name: &str, opts: &DeleteOptions) -> Result<(), ApiError> {
    let Some(pod) = t.get(&PODS, Some(ns), name) else {
        return Err(ApiError::not_found("pods", name));
    };
    if !can_ignore_pdb(&pod) {
        check_budgets(t, ns, &pod)?;
    }
    t.delete(&PODS, Some(ns), name, opts)?;
    Ok(())
}

/// Finished, pending and already-terminating pods are evicted without consulting PDBs.
fn can_ignore_pdb(pod: &Value) -> bool {
    let phase = pod
        .pointer("/status/phase")
        .and_then(Value::as_str)
        .unwrap_or_default();
    matches!(phase, "Succeeded" | "Failed" | "Pending")
        || pod.pointer("/metadata/deletionTimestamp").is_some()
}

/// Healthy = not terminating and Ready (the Ready condition; without one, phase Running).
pub fn is_healthy(pod: &Value) -> bool {
    if pod
        .pointer("/metadata/deletionTimestamp")
        .is_some_and(|d| !d.is_null())
    {
        return false;
    }
    let ready = pod
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .and_then(|cs| {
            cs.iter()
                .find(|c| c.get("type").and_then(Value::as_str) == Some("Ready"))
        });
    match ready {
        Some(c) => c.get("status").and_then(Value::as_str) == Some("True"),
        None => pod.pointer("/status/phase").and_then(Value::as_str) == Some("Running"),
    }
}

/// An IntOrString budget value: a count, or a percentage of `expected` rounded up.
fn scaled(v: &Value, expected: i64, pdb: &str) -> Result<i64, ApiError> {
    match v {
        Value::Number(n) => n.as_i64().ok_or_else(|| {
            ApiError::internal(&format!("PodDisruptionBudget {pdb}: invalid value {n}"))
        }),
        Value::String(s) => match s.strip_suffix('%') {
            Some(p) => {
                let pct: i64 = p.trim().parse().map_err(|_| {
                    ApiError::internal(&format!(
                        "PodDisruptionBudget {pdb}: invalid percentage {s:?}"
                    ))
                })?;
                Ok((pct * expected + 99) / 100)
            }
            None => s.parse().map_err(|_| {
                ApiError::internal(&format!("PodDisruptionBudget {pdb}: invalid value {s:?}"))
            }),
        },
        other => Err(ApiError::internal(&format!(
            "PodDisruptionBudget {pdb}: invalid value {other}"
        ))),
    }
}

/// The number of healthy pods the budget requires among `expected` matching pods.
pub fn desired_healthy(pdb: &Value, expected: i64) -> Result<i64, ApiError> {
    let name = pdb
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if let Some(max) = pdb.pointer("/spec/maxUnavailable").filter(|v| !v.is_null()) {
        return Ok((expected - scaled(max, expected, name)?).max(0));
    }
    if let Some(min) = pdb.pointer("/spec/minAvailable").filter(|v| !v.is_null()) {
        return scaled(min, expected, name);
    }
    Ok(0)
}

fn check_budgets(t: &Txn<'_>, ns: &str, pod: &Value) -> Result<(), ApiError> {
    let (pdbs, _) = t.list(&PDBS, Some(ns));
    let mut matching = Vec::new();
    for pdb in pdbs {
        // A missing selector selects nothing; `{}` selects every pod in the namespace.
        let Some(sel) = pdb.pointer("/spec/selector").filter(|s| !s.is_null()) else {
            continue;
        };
        let sel = LabelSelector::from_object(sel)?;
        if sel.matches(pod) {
            matching.push((pdb, sel));
        }
    }
    if matching.len() > 1 {
        return Err(ApiError::internal(
            "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support.",
        ));
    }
    let Some((pdb, sel)) = matching.pop() else {
        return Ok(());
    };
    let (pods, _) = t.list(&PODS, Some(ns));
    let selected: Vec<&Value> = pods.iter().filter(|p| sel.matches(p)).collect();
    let expected = selected.len() as i64;
    let healthy = selected.iter().filter(|p| is_healthy(p)).count() as i64;
    let desired = desired_healthy(&pdb, expected)?;
    if !is_healthy(pod) {
        // An unhealthy pod does not reduce availability; the policy decides.
        let policy = pdb
            .pointer("/spec/unhealthyPodEvictionPolicy")
            .and_then(Value::as_str)
            .unwrap_or("IfHealthyBudget");
        if policy == "AlwaysAllow" || (healthy >= desired && desired > 0) {
            return Ok(());
        }
    }
    if healthy - desired > 0 {
        return Ok(());
    }
    let pdb_name = pdb
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let mut err = ApiError::too_many_requests(
        "Cannot evict pod as it would violate the pod's disruption budget.",
    );
    err.details = Some(json!({
        "causes": [{
            "reason": "DisruptionBudget",
            "message": format!("The disruption budget {pdb_name} needs {desired} healthy pods and has {healthy} currently"),
        }]
    }));
    Err(err)
}
