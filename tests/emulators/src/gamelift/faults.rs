//! Injected trouble: latency, throttling, failures and hangs, decided before an operation runs.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::ops::ApiError;

/// Seed used until a test picks one, so throttling by ratio repeats run to run.
pub(crate) const DEFAULT_SEED: u64 = 0x1a57_ca11;

/// Matches every operation in [`Faults::fail_next`].
pub(crate) const ANY_OP: &str = "*";

#[derive(Debug)]
struct FailRule {
    op: String,
    remaining: usize,
    error: ApiError,
}

/// Fails the `DescribeGameServerInstances` page of `group` that starts at instance `start`.
#[derive(Debug)]
struct PageRule {
    group: String,
    start: usize,
    remaining: usize,
    error: ApiError,
}

#[derive(Debug)]
pub(crate) struct Faults {
    pub(crate) latency: Duration,
    throttle_ratio: f64,
    throttle_next: usize,
    fail_rules: Vec<FailRule>,
    page_rules: Vec<PageRule>,
    /// (operation or `"*"`, calls left) held without an answer until released.
    hang_rules: Vec<(String, usize)>,
    /// (operation or `"*"`, calls left) applied, then answered as failed: the answer lost.
    lose_rules: Vec<(String, usize)>,
    rng: StdRng,
}

impl Default for Faults {
    fn default() -> Self {
        Faults {
            latency: Duration::ZERO,
            throttle_ratio: 0.0,
            throttle_next: 0,
            fail_rules: Vec::new(),
            page_rules: Vec::new(),
            hang_rules: Vec::new(),
            lose_rules: Vec::new(),
            rng: StdRng::seed_from_u64(DEFAULT_SEED),
        }
    }
}

impl Faults {
    pub(crate) fn set_seed(&mut self, seed: u64) {
        self.rng = StdRng::seed_from_u64(seed);
    }

    pub(crate) fn set_throttle_ratio(&mut self, ratio: f64) {
        self.throttle_ratio = if ratio.is_nan() {
            0.0
        } else {
            ratio.clamp(0.0, 1.0)
        };
    }

    pub(crate) fn throttle_next(&mut self, n: usize) {
        self.throttle_next = self.throttle_next.saturating_add(n);
    }

    pub(crate) fn fail_next(&mut self, op: &str, n: usize, error: ApiError) {
        if n > 0 {
            self.fail_rules.push(FailRule {
                op: op.to_string(),
                remaining: n,
                error,
            });
        }
    }

    pub(crate) fn fail_page(&mut self, group: &str, start: usize, n: usize, error: ApiError) {
        if n > 0 {
            self.page_rules.push(PageRule {
                group: group.to_string(),
                start,
                remaining: n,
                error,
            });
        }
    }

    /// The injected error for this `DescribeGameServerInstances` page, if a page rule
    /// names its group and the offset its `NextToken` carries (none: the first page).
    pub(crate) fn take_page(&mut self, op: &str, input: &serde_json::Value) -> Option<ApiError> {
        if op != "DescribeGameServerInstances" || self.page_rules.is_empty() {
            return None;
        }
        let group = input.get("GameServerGroupName")?.as_str()?;
        let start = match input.get("NextToken").and_then(serde_json::Value::as_str) {
            None => 0,
            Some(token) => token.strip_prefix(super::ops::TOKEN_PREFIX)?.parse().ok()?,
        };
        let rule = self
            .page_rules
            .iter_mut()
            .find(|r| r.remaining > 0 && r.group == group && r.start == start)?;
        rule.remaining -= 1;
        let error = rule.error.clone();
        self.page_rules.retain(|r| r.remaining > 0);
        Some(error)
    }

    pub(crate) fn hang_next(&mut self, op: &str, n: usize) {
        if n > 0 {
            self.hang_rules.push((op.to_string(), n));
        }
    }

    pub(crate) fn lose_next(&mut self, op: &str, n: usize) {
        if n > 0 {
            self.lose_rules.push((op.to_string(), n));
        }
    }

    /// Whether this applied call's answer is to be lost (consumes one use of the oldest
    /// matching rule).
    pub(crate) fn take_lose(&mut self, op: &str) -> bool {
        take_counted(&mut self.lose_rules, op)
    }

    pub(crate) fn clear_hang_rules(&mut self) {
        self.hang_rules.clear();
    }

    /// Whether this call is to be held (consumes one use of the oldest matching rule).
    pub(crate) fn take_hang(&mut self, op: &str) -> bool {
        take_counted(&mut self.hang_rules, op)
    }

    /// The injected error for this call, if any: explicit failures first (oldest rule
    /// first), then counted throttles, then the throttle ratio. The RNG is drawn only
    /// when a ratio is set, so other calls do not shift the sequence.
    pub(crate) fn take(&mut self, op: &str) -> Option<ApiError> {
        if let Some(rule) = self
            .fail_rules
            .iter_mut()
            .find(|r| r.remaining > 0 && (r.op == op || r.op == ANY_OP))
        {
            rule.remaining -= 1;
            let error = rule.error.clone();
            self.fail_rules.retain(|r| r.remaining > 0);
            return Some(error);
        }
        if self.throttle_next > 0 {
            self.throttle_next -= 1;
            return Some(ApiError::throttling());
        }
        if self.throttle_ratio > 0.0 && self.rng.random::<f64>() < self.throttle_ratio {
            return Some(ApiError::throttling());
        }
        None
    }
}

/// Consumes one use of the oldest rule naming `op` (or any operation); whether there was one.
fn take_counted(rules: &mut Vec<(String, usize)>, op: &str) -> bool {
    let Some(rule) = rules
        .iter_mut()
        .find(|(o, left)| *left > 0 && (o == op || o == ANY_OP))
    else {
        return false;
    };
    rule.1 -= 1;
    rules.retain(|(_, left)| *left > 0);
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explicit_failures_come_first_then_throttles() {
        let mut f = Faults::default();
        f.throttle_next(1);
        f.fail_next("A", 1, ApiError::injected(503));
        assert_eq!(
            f.take("B").map(|e| e.code),
            Some("ThrottlingException".into())
        );
        assert_eq!(f.take("A").map(|e| e.status), Some(503));
        assert_eq!(f.take("A"), None);
    }

    #[test]
    fn a_lose_rule_is_taken_once_per_call_of_its_operation() {
        let mut f = Faults::default();
        f.lose_next("DeregisterGameServer", 1);
        assert!(!f.take_lose("UpdateGameServer"));
        assert!(f.take_lose("DeregisterGameServer"));
        assert!(!f.take_lose("DeregisterGameServer"));
    }

    #[test]
    fn a_page_rule_fails_only_that_page_of_that_group() {
        let mut f = Faults::default();
        f.fail_page("g", 40, 2, ApiError::injected(503));
        let page = |group: &str, token: Option<&str>| {
            let mut input = serde_json::json!({ "GameServerGroupName": group });
            if let Some(t) = token {
                input["NextToken"] = t.into();
            }
            input
        };
        let op = "DescribeGameServerInstances";
        assert_eq!(f.take_page(op, &page("g", None)), None);
        assert_eq!(f.take_page(op, &page("g", Some("dgsi-20"))), None);
        assert_eq!(f.take_page(op, &page("h", Some("dgsi-40"))), None);
        assert_eq!(f.take_page("Other", &page("g", Some("dgsi-40"))), None);
        for _ in 0..2 {
            let e = f.take_page(op, &page("g", Some("dgsi-40")));
            assert_eq!(e.map(|e| e.status), Some(503));
        }
        assert_eq!(
            f.take_page(op, &page("g", Some("dgsi-40"))),
            None,
            "used up"
        );
    }

    #[test]
    fn ratio_is_repeatable_for_a_seed() {
        let run = || {
            let mut f = Faults::default();
            f.set_seed(7);
            f.set_throttle_ratio(0.5);
            (0..64).map(|_| f.take("X").is_some()).collect::<Vec<_>>()
        };
        let a = run();
        assert_eq!(a, run());
        assert!(a.iter().any(|t| *t) && a.iter().any(|t| !*t));
    }
}
