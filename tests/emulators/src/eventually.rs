//! Bounded polling for end-to-end tests.
//!
//! The only place tests may poll: a condition checked repeatedly until it holds or a
//! deadline passes. A missing behaviour fails loudly with the description instead of
//! hanging the suite.

use std::future::Future;
use std::time::Duration;

/// Checks `cond` every `every` until it returns `Some`, or fails after `within`.
pub async fn eventually<T, F, Fut>(what: &str, within: Duration, every: Duration, mut cond: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(v) = cond().await {
            return v;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("condition not met within {within:?}: {what}");
        }
        tokio::time::sleep(every).await;
    }
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
