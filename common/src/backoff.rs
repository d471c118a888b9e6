//! Jittered exponential backoff, shared by every retry loop.
//!
//! "Full jitter": each delay is drawn uniformly from `[base/2, cap]` where `cap` doubles per
//! attempt up to `max`, so thousands of agents that lose Redis at the same moment do not
//! reconnect in lockstep. Randomness is injected so the sequence is testable.

use std::time::Duration;

use rand::Rng;

#[derive(Clone, Debug)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    attempt: u32,
}

impl Backoff {
    /// `base` is the first ceiling, `max` the largest delay ever returned.
    pub fn new(base: Duration, max: Duration) -> Self {
        let base = base.max(Duration::from_millis(1));
        Self {
            base,
            max: max.max(base),
            attempt: 0,
        }
    }

    /// The next delay, drawn with `rng`.
    pub fn next_with<R: Rng + ?Sized>(&mut self, rng: &mut R) -> Duration {
        let ceiling = self.ceiling();
        self.attempt = self.attempt.saturating_add(1);
        let floor = (self.base / 2).min(ceiling);
        let span = ceiling.saturating_sub(floor).as_millis() as u64;
        floor
            + Duration::from_millis(if span == 0 {
                0
            } else {
                rng.random_range(0..=span)
            })
    }

    /// The next delay, drawn from the thread RNG.
    pub fn next_delay(&mut self) -> Duration {
        self.next_with(&mut rand::rng())
    }

    /// The ceiling for the current attempt: `base * 2^attempt`, capped at `max`.
    pub fn ceiling(&self) -> Duration {
        let factor = 1u32.checked_shl(self.attempt.min(30)).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.max)
    }

    pub fn attempts(&self) -> u32 {
        self.attempt
    }

    /// Starts over after a success.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

/// A random delay in `[0, max]`, to spread periodic work of many processes.
pub fn jitter(max: Duration) -> Duration {
    let ms = max.as_millis() as u64;
    if ms == 0 {
        return Duration::ZERO;
    }
    Duration::from_millis(rand::rng().random_range(0..=ms))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{SeedableRng, rngs::StdRng};

    #[test]
    fn grows_to_the_cap_and_stays_within_bounds() {
        let mut rng = StdRng::seed_from_u64(7);
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let mut ceilings = vec![];
        for _ in 0..12 {
            let c = b.ceiling();
            let d = b.next_with(&mut rng);
            assert!(
                d >= Duration::from_millis(50) && d <= c,
                "{d:?} not in [50ms, {c:?}]"
            );
            ceilings.push(c);
        }
        assert_eq!(ceilings[0], Duration::from_millis(100));
        assert_eq!(ceilings[1], Duration::from_millis(200));
        assert_eq!(*ceilings.last().unwrap(), Duration::from_secs(5));
        b.reset();
        assert_eq!(b.ceiling(), Duration::from_millis(100));
        assert_eq!(b.attempts(), 0);
    }

    #[test]
    fn delays_are_spread() {
        let mut rng = StdRng::seed_from_u64(1);
        let draws: std::collections::HashSet<_> = (0..50)
            .map(|_| {
                Backoff::new(Duration::from_secs(1), Duration::from_secs(1)).next_with(&mut rng)
            })
            .collect();
        assert!(
            draws.len() > 10,
            "jitter should spread delays, got {draws:?}"
        );
    }

    #[test]
    fn huge_attempt_counts_do_not_overflow() {
        let mut b = Backoff::new(Duration::from_millis(10), Duration::from_secs(30));
        for _ in 0..100 {
            b.next_delay();
        }
        assert_eq!(b.ceiling(), Duration::from_secs(30));
    }
}
