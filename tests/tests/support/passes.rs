//! Absences asserted after the agent had its chance, not after a sleep: the agent's own pass
//! counter (`lastcall_reconciles_total`) moved on, so whatever it was going to do about what
//! it had seen, it has had those passes to do it in.

use std::time::Duration;

use lastcall_testkit::agent::{InProcessAgent, metric_sum};
use lastcall_testkit::eventually::eventually;

/// The reconcile passes `agent` has run so far.
pub async fn passes(agent: &InProcessAgent) -> f64 {
    metric_sum(&agent.metrics().await, "lastcall_reconciles_total", &[])
}

/// Waits until `agent` has run `n` more passes than when called. A pass already under way
/// may be the first of them, so `n` of 2 or more holds one that began afterwards. Bounded
/// generously: passes come at the agent's own pace, slower on a loaded machine.
pub async fn after_passes(agent: &InProcessAgent, n: u32) {
    let start = passes(agent).await;
    eventually(
        &format!("{n} more reconcile passes"),
        Duration::from_secs(60),
        Duration::from_millis(25),
        || async { (passes(agent).await >= start + f64::from(n)).then_some(()) },
    )
    .await;
}
