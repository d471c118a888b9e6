//! Fault injection: fail or delay the next N requests that match a rule, to test how
//! clients cope with API errors and slowness.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

pub use axum::http::Method;

/// What a matching request gets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FaultAction {
    /// Answer with this HTTP status and a matching `Status` body, without serving it.
    Status(u16),
    /// Wait this long, then serve the request normally.
    Delay(Duration),
}

/// Affects the next `times` requests whose method matches (any if `None`) and whose
/// path-and-query contains `path_contains`.
#[derive(Clone, Debug)]
pub struct FaultRule {
    pub method: Option<Method>,
    pub path_contains: String,
    pub times: usize,
    pub action: FaultAction,
}

impl FaultRule {
    /// A rule failing the next `times` requests matching `method`/`path_contains` with `status`.
    pub fn status(method: Option<Method>, path_contains: &str, times: usize, status: u16) -> Self {
        FaultRule {
            method,
            path_contains: path_contains.to_string(),
            times,
            action: FaultAction::Status(status),
        }
    }

    /// A rule delaying the next `times` matching requests by `delay`.
    pub fn delay(
        method: Option<Method>,
        path_contains: &str,
        times: usize,
        delay: Duration,
    ) -> Self {
        FaultRule {
            method,
            path_contains: path_contains.to_string(),
            times,
            action: FaultAction::Delay(delay),
        }
    }
}

/// The active fault rules. Cheap to clone.
#[derive(Clone, Default)]
pub struct Faults {
    rules: Arc<Mutex<Vec<FaultRule>>>,
}

impl Faults {
    fn lock(&self) -> MutexGuard<'_, Vec<FaultRule>> {
        self.rules.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a rule; rules are tried in the order added.
    pub fn inject(&self, rule: FaultRule) {
        if rule.times > 0 {
            self.lock().push(rule);
        }
    }

    /// Removes every rule.
    pub fn clear(&self) {
        self.lock().clear();
    }

    /// Rules with uses left.
    pub fn pending(&self) -> usize {
        self.lock().len()
    }

    /// Consumes one use of the first rule matching this request, if any.
    pub fn take(&self, method: &Method, path_and_query: &str) -> Option<FaultAction> {
        let mut rules = self.lock();
        let i = rules.iter().position(|r| {
            r.method.as_ref().is_none_or(|m| m == method)
                && path_and_query.contains(&r.path_contains)
        })?;
        let action = rules[i].action.clone();
        rules[i].times -= 1;
        if rules[i].times == 0 {
            rules.remove(i);
        }
        Some(action)
    }
}
