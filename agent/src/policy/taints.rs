//! Taints and tolerations: the ones lastcall writes, and whether a pod stays under one.

use k8s_openapi::api::core::v1::{Taint, Toleration};

use crate::keys;

/// The original adapter's toleration, added to in-use pods in compat mode.
pub fn compat_toleration() -> Toleration {
    Toleration {
        key: Some(keys::COMPAT_TAINT_DRAINING.to_string()),
        operator: Some("Equal".to_string()),
        value: Some("true".to_string()),
        effect: Some("NoExecute".to_string()),
        toleration_seconds: None,
    }
}

pub(super) fn taint(key: &str, value: &str, effect: &str) -> Taint {
    Taint {
        key: key.to_string(),
        value: Some(value.to_string()),
        effect: effect.to_string(),
        time_added: None,
    }
}

/// Whether `tolerations` let a pod stay on a node with `taint` for good (a NoExecute
/// toleration with `tolerationSeconds` only delays the eviction).
pub(super) fn tolerates(tolerations: &[Toleration], taint: &Taint) -> bool {
    tolerations.iter().any(|t| {
        let op = t.operator.as_deref().unwrap_or("Equal");
        let key_ok = match t.key.as_deref() {
            None | Some("") => op == "Exists",
            Some(k) => k == taint.key,
        };
        let value_ok = op == "Exists"
            || t.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or("");
        let effect_ok = t
            .effect
            .as_deref()
            .is_none_or(|e| e.is_empty() || e == taint.effect);
        let forever = taint.effect != "NoExecute" || t.toleration_seconds.is_none();
        key_ok && value_ok && effect_ok && forever
    })
}
