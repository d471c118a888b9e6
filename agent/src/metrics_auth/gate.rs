//! What a token gets before any review (a recent decision, a review, or a refusal when the
//! review budget is spent), and what a review's decision leaves behind. Pure: the clock is
//! an argument.
//!
//! Decisions are kept by the token's SHA-256 in two bounded caches: tokens the API server
//! accepted (allowed or forbidden), which only a valid credential can add, and tokens it
//! rejected, which anyone can. A flood of random tokens therefore fills only the second and
//! never pushes a scraper's decision out; and since each new token needs a review from the
//! budget, the flood costs the API server at most [`REVIEW_BURST`] reviews and then one per
//! [`REVIEW_EVERY`].

use std::time::Duration;

use tokio::time::Instant;

use super::cache::{Budget, Key, TtlCache};
use super::review::Decision;

/// How long an allowed token stays allowed without asking again: a revoked token or a
/// removed permission still reads `/metrics` for at most this long.
pub const ALLOWED_TTL: Duration = Duration::from_secs(60);
/// How long a refusal is kept: a permission just granted works after at most this long.
pub const FORBIDDEN_TTL: Duration = Duration::from_secs(10);
/// How long a token the API server rejected is refused without asking again.
pub const REJECTED_TTL: Duration = Duration::from_secs(10);
/// Tokens the API server accepted, kept at once (scrapers, a person with kubectl).
pub const KNOWN_CAPACITY: usize = 64;
/// Tokens it rejected, kept at once.
pub const REJECTED_CAPACITY: usize = 256;
/// Reviews the agent may start at once for tokens it has no decision for...
pub const REVIEW_BURST: u32 = 10;
/// ...and then one per this period.
pub const REVIEW_EVERY: Duration = Duration::from_millis(500);

/// What to do with a token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// A recent decision.
    Known(Decision),
    /// No decision: ask the API server (the budget is charged).
    Review,
    /// No decision and no budget left: refuse without asking.
    Throttled,
}

#[derive(Debug)]
pub struct Gate {
    known: TtlCache<Decision>,
    rejected: TtlCache<()>,
    budget: Budget,
}

impl Gate {
    pub fn new(now: Instant) -> Self {
        Self::with_budget(Budget::new(REVIEW_BURST, REVIEW_EVERY, now))
    }

    fn with_budget(budget: Budget) -> Self {
        Self {
            known: TtlCache::new(KNOWN_CAPACITY),
            rejected: TtlCache::new(REJECTED_CAPACITY),
            budget,
        }
    }

    pub fn lookup(&mut self, key: &Key, now: Instant) -> Lookup {
        if let Some(d) = self.known.get(key, now) {
            return Lookup::Known(d.clone());
        }
        if self.rejected.get(key, now).is_some() {
            return Lookup::Known(Decision::Unauthenticated);
        }
        if self.budget.try_spend(now) {
            Lookup::Review
        } else {
            Lookup::Throttled
        }
    }

    /// Keeps a review's decision for its TTL. A failed review leaves nothing: the next
    /// request asks again.
    pub fn record(&mut self, key: Key, decision: &Decision, now: Instant) {
        match decision {
            Decision::Allowed => {
                self.known.insert(key, decision.clone(), ALLOWED_TTL, now);
            }
            Decision::Forbidden { .. } => {
                self.known.insert(key, decision.clone(), FORBIDDEN_TTL, now);
            }
            Decision::Unauthenticated => {
                self.rejected.insert(key, (), REJECTED_TTL, now);
            }
        }
    }

    /// Entries held (known, rejected).
    #[cfg(test)]
    pub fn held(&self) -> (usize, usize) {
        (self.known.len(), self.rejected.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u32) -> Key {
        let mut k = [0u8; 32];
        k[28..].copy_from_slice(&i.to_be_bytes());
        k
    }

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_decision_is_reused_until_its_ttl_then_asked_again() {
        let t0 = Instant::now();
        let mut g = Gate::new(t0);
        let forbidden = Decision::Forbidden { user: "u".into() };
        for (k, d, ttl) in [
            (key(1), Decision::Allowed, ALLOWED_TTL),
            (key(2), forbidden.clone(), FORBIDDEN_TTL),
            (key(3), Decision::Unauthenticated, REJECTED_TTL),
        ] {
            assert_eq!(g.lookup(&k, t0), Lookup::Review);
            g.record(k, &d, t0);
            assert_eq!(g.lookup(&k, t0 + ttl - S), Lookup::Known(d.clone()));
            assert_eq!(
                g.lookup(&k, t0 + ttl),
                Lookup::Review,
                "{d:?} after its TTL"
            );
        }
        // Short TTLs for refusals, a longer one for a scraper.
        assert!(FORBIDDEN_TTL < ALLOWED_TTL && REJECTED_TTL < ALLOWED_TTL);
    }

    #[test]
    fn a_failed_review_leaves_nothing_behind() {
        let t0 = Instant::now();
        let mut g = Gate::new(t0);
        assert_eq!(g.lookup(&key(1), t0), Lookup::Review);
        // (the review failed: nothing recorded)
        assert_eq!(g.lookup(&key(1), t0), Lookup::Review);
        assert_eq!(g.held(), (0, 0));
    }

    #[test]
    fn a_flood_of_random_tokens_is_throttled_bounded_and_never_evicts_a_scraper() {
        let t0 = Instant::now();
        let mut g = Gate::new(t0);
        let scraper = key(u32::MAX);
        assert_eq!(g.lookup(&scraper, t0), Lookup::Review);
        g.record(scraper, &Decision::Allowed, t0);

        // 20,000 new tokens over 50 s, one every 2.5 ms: each gets a review only while the
        // budget lasts, and each reviewed one is rejected.
        let (mut reviews, mut throttled) = (0u32, 0u32);
        for i in 0..20_000u32 {
            let now = t0 + Duration::from_micros(2_500 * u64::from(i));
            match g.lookup(&key(i), now) {
                Lookup::Review => {
                    reviews += 1;
                    g.record(key(i), &Decision::Unauthenticated, now);
                }
                Lookup::Throttled => throttled += 1,
                Lookup::Known(d) => panic!("a new token had a decision: {d:?}"),
            }
            let (known, rejected) = g.held();
            assert!(known <= KNOWN_CAPACITY && rejected <= REJECTED_CAPACITY);
        }
        // The burst (less the scraper's own review), then one per period completed by the
        // last token (49.9975 s: 99 periods of 500 ms).
        let last = Duration::from_micros(2_500 * 19_999);
        let periods = last.as_micros() / REVIEW_EVERY.as_micros();
        assert_eq!(periods, 99);
        assert_eq!(u128::from(reviews), u128::from(REVIEW_BURST - 1) + periods);
        assert_eq!(reviews + throttled, 20_000);
        // The scraper's decision was made 50 s ago and is still there.
        assert_eq!(
            g.lookup(&scraper, t0 + 50 * S),
            Lookup::Known(Decision::Allowed)
        );
    }

    #[test]
    fn rejected_tokens_never_push_a_scraper_out_whatever_the_budget() {
        // A budget that lets every token through: the caches alone must hold.
        let t0 = Instant::now();
        let mut g = Gate::with_budget(Budget::new(u32::MAX, Duration::from_nanos(1), t0));
        let scraper = key(u32::MAX);
        assert_eq!(g.lookup(&scraper, t0), Lookup::Review);
        g.record(scraper, &Decision::Allowed, t0);
        // 100,000 rejected tokens late in the scraper's TTL, when its entry is the one
        // closest to expiry.
        let late = t0 + ALLOWED_TTL - S;
        for i in 0..100_000u32 {
            assert_eq!(g.lookup(&key(i), late), Lookup::Review);
            g.record(key(i), &Decision::Unauthenticated, late);
        }
        assert_eq!(g.held(), (1, REJECTED_CAPACITY));
        assert_eq!(g.lookup(&scraper, late), Lookup::Known(Decision::Allowed));
    }
}
