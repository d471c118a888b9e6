//! Bounded polling for end-to-end tests.
//!
//! The only place tests may poll: a condition checked repeatedly until it holds or a
//! deadline passes. A missing behaviour fails loudly with the description instead of
//! hanging the suite.

use std::future::Future;
use std::time::Duration;

/// A condition that did not hold in time.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("condition not met within {within:?}: {what}")]
pub struct TimedOut {
    pub what: String,
    pub within: Duration,
}

/// Checks `cond` every `every` until it returns `Some`, or reports [`TimedOut`] after
/// `within`. For harnesses that turn a timeout into their own error (the demo, benchmarks).
pub async fn try_eventually<T, F, Fut>(
    what: &str,
    within: Duration,
    every: Duration,
    mut cond: F,
) -> Result<T, TimedOut>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(v) = cond().await {
            return Ok(v);
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(TimedOut {
                what: what.to_string(),
                within,
            });
        }
        tokio::time::sleep(every).await;
    }
}

/// Checks `cond` every `every` until it returns `Some`, or fails after `within`.
pub async fn eventually<T, F, Fut>(what: &str, within: Duration, every: Duration, cond: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    try_eventually(what, within, every, cond)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// `eventually` with the defaults most scenarios want: 20 s, checked every 25 ms.
pub async fn wait_for<T, F, Fut>(what: &str, cond: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    eventually(
        what,
        Duration::from_secs(20),
        Duration::from_millis(25),
        cond,
    )
    .await
}
