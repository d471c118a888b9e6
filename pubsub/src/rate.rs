//! One token bucket for every GameLift call pubsub makes.
//!
//! Without it, calls burst at the start of each cycle and every page backs off on its own,
//! so a throttled account keeps being hit by the other groups. Here a throttled answer
//! halves the rate for every caller (at most once a second, so concurrent callers hit by the
//! same overload count once) and empties the bucket; each success wins a little of the rate
//! back. The throttled page itself also backs off before its retry. The decision is a pure
//! function of the state and the time, tested without a clock.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// Lowest fraction of the configured rate that throttling can push the bucket to.
const MIN_FACTOR: f64 = 0.1;
/// Fraction of the configured rate regained per successful call.
const RECOVERY_STEP: f64 = 0.02;
/// Throttles closer together than this are one signal: concurrent callers hit by the same
/// overload halve the rate once, not once each.
const DECREASE_SPACING: Duration = Duration::from_secs(1);

/// The bucket's state at one instant.
#[derive(Clone, Debug, PartialEq)]
pub struct Bucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    /// Fraction of `rate` currently allowed (1.0 until throttled).
    factor: f64,
    last: Instant,
    last_decrease: Option<Instant>,
}

impl Bucket {
    pub fn new(rate: f64, burst: u32, now: Instant) -> Self {
        let burst = f64::from(burst.max(1));
        Self {
            rate: rate.max(0.001),
            burst,
            tokens: burst,
            factor: 1.0,
            last: now,
            last_decrease: None,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate * self.factor).min(self.burst);
        self.last = now;
    }

    /// Takes a token now, or says how long to wait before asking again.
    pub fn try_take(&mut self, now: Instant) -> Result<(), Duration> {
        self.refill(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            return Ok(());
        }
        let missing = 1.0 - self.tokens;
        Err(Duration::from_secs_f64(missing / (self.rate * self.factor)))
    }

    /// A throttled answer: everyone continues at half the current rate, from an empty
    /// bucket.
    pub fn throttled(&mut self, now: Instant) {
        self.refill(now);
        if self
            .last_decrease
            .is_none_or(|at| now.saturating_duration_since(at) >= DECREASE_SPACING)
        {
            self.factor = (self.factor * 0.5).max(MIN_FACTOR);
            self.last_decrease = Some(now);
        }
        self.tokens = self.tokens.min(0.0);
    }

    /// A successful answer wins back a little of the rate.
    pub fn succeeded(&mut self, now: Instant) {
        self.refill(now);
        self.factor = (self.factor + RECOVERY_STEP).min(1.0);
    }

    /// Calls per second currently allowed.
    pub fn current_rate(&self) -> f64 {
        self.rate * self.factor
    }
}

/// The bucket shared by all groups' polls.
#[derive(Debug)]
pub struct RateLimiter(Mutex<Bucket>);

impl RateLimiter {
    pub fn new(rate: f64, burst: u32) -> Self {
        Self(Mutex::new(Bucket::new(rate, burst, Instant::now())))
    }

    fn bucket(&self) -> std::sync::MutexGuard<'_, Bucket> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for a token. `Err(waited)` if `deadline` would pass first: the caller gives up
    /// instead of calling late.
    pub async fn acquire(&self, deadline: Instant) -> Result<Duration, Duration> {
        let started = Instant::now();
        loop {
            let now = Instant::now();
            let wait = match self.bucket().try_take(now) {
                Ok(()) => return Ok(now - started),
                Err(wait) => wait,
            };
            if now + wait > deadline {
                return Err(now - started);
            }
            tokio::time::sleep(wait).await;
        }
    }

    pub fn throttled(&self) {
        self.bucket().throttled(Instant::now());
    }

    pub fn succeeded(&self) {
        self.bucket().succeeded(Instant::now());
    }

    pub fn current_rate(&self) -> f64 {
        self.bucket().current_rate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_then_the_rate() {
        let t0 = Instant::now();
        let mut b = Bucket::new(10.0, 2, t0);
        assert!(b.try_take(t0).is_ok());
        assert!(b.try_take(t0).is_ok());
        let wait = b.try_take(t0).unwrap_err();
        assert!((wait.as_secs_f64() - 0.1).abs() < 1e-6, "{wait:?}");
        assert!(b.try_take(t0 + Duration::from_millis(100)).is_ok());
        // Over ten seconds no more than burst + rate x time tokens are handed out.
        let mut taken = 0;
        for ms in (100..10_100).step_by(5) {
            if b.try_take(t0 + Duration::from_millis(ms)).is_ok() {
                taken += 1;
            }
        }
        assert!(taken <= 101, "{taken}");
    }

    #[test]
    fn throttling_halves_the_rate_for_everyone_then_recovers() {
        let t0 = Instant::now();
        let mut b = Bucket::new(10.0, 5, t0);
        b.throttled(t0);
        assert_eq!(b.current_rate(), 5.0);
        // The bucket was emptied: the next token comes at the halved rate.
        let wait = b.try_take(t0).unwrap_err();
        assert!((wait.as_secs_f64() - 0.2).abs() < 1e-6, "{wait:?}");
        b.throttled(t0);
        assert_eq!(b.current_rate(), 5.0, "one decrease per second");
        for s in 1..=10 {
            b.throttled(t0 + Duration::from_secs(s));
        }
        assert_eq!(b.current_rate(), 1.0, "floor at 10%");
        for _ in 0..100 {
            b.succeeded(t0);
        }
        assert_eq!(b.current_rate(), 10.0, "back to the configured rate");
    }
}
