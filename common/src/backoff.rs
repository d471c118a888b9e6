//! Jittered exponential backoff, shared by every retry loop.
//!
//! "Full jitter": each delay is drawn uniformly from `[base/2, cap]` where `cap` doubles per
//! attempt up to `max`, so thousands of agents that lose Redis at the same moment do not
//! reconnect in lockstep. Randomness is injected so the sequence is testable.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

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

/// The longest `Retry-After` honoured as sent; a longer one is cut to this, so a bad value
/// cannot silence a client for good (kube-apiserver's APF sends 1 to 32 seconds).
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

/// The widest window the wait after a refusal is spread over.
pub const MAX_RETRY_AFTER_SPREAD: Duration = Duration::from_secs(60);

/// How long to wait after a server refused a request with `Retry-After: retry_after`, for
/// the `refusals`-th refusal in a row (1 = the first): never less than asked, plus a jitter
/// drawn from `[0, window)` by `unit` (uniform in `[0, 1)`). The window is the wait asked
/// for (at least a second), doubling with each refusal in a row up to 8×, at most
/// [`MAX_RETRY_AFTER_SPREAD`]: clients refused at the same moment come back spread over
/// `[retry_after, 2 × retry_after)` the first time, and wider if they are refused again,
/// never in lock-step.
pub fn after_retry_after(retry_after: Duration, refusals: u32, unit: f64) -> Duration {
    let asked = retry_after.min(MAX_RETRY_AFTER);
    let doublings = refusals.saturating_sub(1).min(3);
    let window = asked
        .max(Duration::from_secs(1))
        .saturating_mul(1 << doublings)
        .min(MAX_RETRY_AFTER_SPREAD);
    let unit = if unit.is_finite() {
        unit.clamp(0.0, 1.0)
    } else {
        0.0
    };
    asked + window.mul_f64(unit)
}

/// [`after_retry_after`] with its own random source and the count of refusals in a row.
#[derive(Debug)]
pub struct RetryAfter {
    rng: StdRng,
    refusals: u32,
}

impl RetryAfter {
    /// Seeded from the OS, so every process draws differently.
    pub fn new() -> Self {
        Self::seeded(rand::rng().random())
    }

    /// A fixed sequence, for tests.
    pub fn seeded(seed: u64) -> Self {
        Self {
            rng: StdRng::seed_from_u64(seed),
            refusals: 0,
        }
    }

    /// A refusal asking for `retry_after`: the wait before the next request.
    pub fn refused(&mut self, retry_after: Duration) -> Duration {
        self.refusals = self.refusals.saturating_add(1);
        after_retry_after(retry_after, self.refusals, self.rng.random())
    }

    /// Another refusal of the same burst (requests sent before the first refusal came back):
    /// a fresh draw, without counting it as one more in a row.
    pub fn refused_again(&mut self, retry_after: Duration) -> Duration {
        after_retry_after(retry_after, self.refusals.max(1), self.rng.random())
    }

    /// A request was served: the next refusal is the first again.
    pub fn served(&mut self) {
        self.refusals = 0;
    }

    pub fn refusals(&self) -> u32 {
        self.refusals
    }
}

impl Default for RetryAfter {
    fn default() -> Self {
        Self::new()
    }
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

    #[test]
    fn the_wait_after_a_refusal_is_at_least_what_was_asked() {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        // (retry_after, refusals in a row, unit draw, wait)
        let table = [
            (s(1), 1, 0.0, s(1)),
            (s(1), 1, 0.5, ms(1500)),
            (s(1), 1, 0.999, ms(1999)),
            (s(1), 2, 0.5, s(2)),
            (s(1), 3, 0.5, s(3)),
            (s(1), 4, 0.5, s(5)),
            // The window stops doubling at 8×.
            (s(1), 9, 0.5, s(5)),
            (s(4), 1, 0.25, s(5)),
            // Retry-After: 0 still spreads the comeback over a second.
            (s(0), 1, 0.5, ms(500)),
            // A huge Retry-After is cut to the cap, and so is the window.
            (s(3600), 1, 0.0, s(60)),
            (s(3600), 4, 0.5, s(90)),
            (s(32), 4, 1.0, s(92)),
            // A bad draw adds nothing rather than anything unbounded.
            (s(1), 1, f64::NAN, s(1)),
            (s(1), 1, 7.0, s(2)),
            (s(1), 0, 0.5, ms(1500)),
        ];
        for (ra, n, u, want) in table {
            let got = after_retry_after(ra, n, u);
            let got_ms = got.as_millis();
            assert!(
                got_ms.abs_diff(want.as_millis()) <= 1,
                "after_retry_after({ra:?}, {n}, {u}) = {got:?}, want {want:?}"
            );
        }
    }

    #[test]
    fn agents_with_different_seeds_do_not_come_back_together() {
        let ra = Duration::from_secs(1);
        let a = RetryAfter::seeded(1).refused(ra);
        let b = RetryAfter::seeded(2).refused(ra);
        assert_ne!(a, b);
        for d in [a, b] {
            assert!(d >= ra && d < ra * 2, "{d:?}");
        }
        // Same seed, same draw: the spread comes from the seeds, not from chance.
        assert_eq!(RetryAfter::seeded(1).refused(ra), a);
    }

    #[test]
    fn a_thousand_agents_refused_at_once_spread_over_the_window() {
        let ra = Duration::from_secs(1);
        let waits: Vec<Duration> = (0..1000u64)
            .map(|seed| RetryAfter::seeded(seed).refused(ra))
            .collect();
        assert!(waits.iter().all(|w| *w >= ra && *w < ra * 2));
        // Ten 100 ms slots over [1 s, 2 s): each holds about a tenth, none a crowd.
        let mut slots = [0usize; 10];
        for w in &waits {
            slots[((w.as_millis() - 1000) / 100) as usize] += 1;
        }
        for (i, n) in slots.iter().enumerate() {
            assert!(
                (60..=140).contains(n),
                "slot {i} holds {n} of 1000: {slots:?}"
            );
        }
        let distinct: std::collections::HashSet<_> = waits.iter().collect();
        assert!(distinct.len() > 900, "{} distinct waits", distinct.len());
    }

    #[test]
    fn refusals_in_a_row_widen_the_window_and_a_success_resets_it() {
        let ra = Duration::from_secs(1);
        let mut r = RetryAfter::seeded(7);
        r.refused(ra);
        r.refused(ra);
        assert_eq!(r.refusals(), 2);
        // Refusals of the same burst do not count as more in a row.
        for _ in 0..10 {
            let d = r.refused_again(ra);
            assert!(d >= ra && d < ra * 3, "{d:?}");
        }
        assert_eq!(r.refusals(), 2);
        let widest = (0..200).map(|_| r.refused(ra)).max().unwrap();
        assert!(widest > ra * 5 && widest < ra * 9, "{widest:?}");
        r.served();
        assert_eq!(r.refusals(), 0);
        let d = r.refused(ra);
        assert!(d < ra * 2, "{d:?}");
    }
}
