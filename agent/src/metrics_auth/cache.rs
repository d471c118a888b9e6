//! Bounded memory for recent decisions, and the budget of reviews: a caller sending a new
//! random token on every request can neither grow the agent's memory nor make it flood the
//! API server.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

/// A token's SHA-256: the cache never holds a credential.
pub type Key = [u8; 32];

/// What [`TtlCache::insert`] did to make room.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Room {
    /// There was room (or the key was there already).
    Free,
    /// Expired entries were dropped.
    Expired,
    /// A live entry, the one closest to its expiry, was dropped.
    Evicted,
}

/// At most `capacity` entries, each until its own expiry.
#[derive(Debug)]
pub struct TtlCache<V> {
    entries: HashMap<Key, (V, Instant)>,
    capacity: usize,
}

impl<V> TtlCache<V> {
    pub fn new(capacity: usize) -> Self {
        Self {
            entries: HashMap::with_capacity(capacity.min(64)),
            capacity: capacity.max(1),
        }
    }

    /// The live value of `key`; an expired one is dropped.
    pub fn get(&mut self, key: &Key, now: Instant) -> Option<&V> {
        if self
            .entries
            .get(key)
            .is_some_and(|(_, until)| *until <= now)
        {
            self.entries.remove(key);
        }
        self.entries.get(key).map(|(v, _)| v)
    }

    /// Keeps `value` for `ttl`. When full, expired entries go first, else the live entry
    /// closest to its expiry (an O(capacity) scan: capacities are small).
    pub fn insert(&mut self, key: Key, value: V, ttl: Duration, now: Instant) -> Room {
        let mut room = Room::Free;
        if !self.entries.contains_key(&key) && self.entries.len() >= self.capacity {
            self.entries.retain(|_, (_, until)| *until > now);
            room = Room::Expired;
            if self.entries.len() >= self.capacity {
                let soonest = self
                    .entries
                    .iter()
                    .min_by_key(|(_, (_, until))| *until)
                    .map(|(k, _)| *k);
                if let Some(k) = soonest {
                    self.entries.remove(&k);
                }
                room = Room::Evicted;
            }
        }
        self.entries.insert(key, (value, now + ttl));
        room
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// A token bucket: at most `burst` reviews at once, then one per `every`.
#[derive(Debug)]
pub struct Budget {
    burst: u32,
    every: Duration,
    left: u32,
    /// When `left` was last topped up.
    since: Instant,
}

impl Budget {
    pub fn new(burst: u32, every: Duration, now: Instant) -> Self {
        Self {
            burst: burst.max(1),
            every: every.max(Duration::from_millis(1)),
            left: burst.max(1),
            since: now,
        }
    }

    /// Takes one review from the budget, if there is one left.
    pub fn try_spend(&mut self, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.since);
        let earned = elapsed.as_nanos() / self.every.as_nanos();
        if earned > 0 {
            let earned = u32::try_from(earned).unwrap_or(u32::MAX);
            self.left = self.left.saturating_add(earned).min(self.burst);
            // Whole periods only, so a steady caller is not robbed of a partial one.
            self.since += self.every * earned.min(self.burst);
            if self.left == self.burst {
                self.since = now;
            }
        }
        if self.left == 0 {
            return false;
        }
        self.left -= 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u32) -> Key {
        let mut k = [0u8; 32];
        k[..4].copy_from_slice(&i.to_be_bytes());
        k
    }

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn an_entry_lives_until_its_own_expiry() {
        let t0 = Instant::now();
        let mut c = TtlCache::new(4);
        c.insert(key(1), "allowed", 60 * S, t0);
        c.insert(key(2), "rejected", 10 * S, t0);
        assert_eq!(c.get(&key(1), t0 + 59 * S), Some(&"allowed"));
        assert_eq!(c.get(&key(2), t0 + 9 * S), Some(&"rejected"));
        assert_eq!(c.get(&key(2), t0 + 10 * S), None);
        assert_eq!(c.get(&key(1), t0 + 60 * S), None);
        assert!(c.is_empty(), "expired entries are dropped when read");
    }

    #[test]
    fn a_flood_of_new_keys_never_grows_past_the_capacity() {
        let t0 = Instant::now();
        let mut c = TtlCache::new(256);
        for i in 0..100_000u32 {
            // Far more keys than fit, all still live.
            c.insert(key(i), (), 10 * S, t0 + Duration::from_micros(u64::from(i)));
            assert!(c.len() <= 256);
        }
        assert_eq!(c.len(), 256);
        // The newest stay: the evicted ones were those closest to expiry.
        let now = t0 + Duration::from_micros(100_000);
        assert!(c.get(&key(99_999), now).is_some());
        assert!(c.get(&key(0), now).is_none());
    }

    #[test]
    fn room_is_made_from_expired_entries_first() {
        let t0 = Instant::now();
        let mut c = TtlCache::new(2);
        assert_eq!(c.insert(key(1), 1, 60 * S, t0), Room::Free);
        assert_eq!(c.insert(key(2), 2, 5 * S, t0), Room::Free);
        // Full; key 2 has expired by then: it goes, key 1 (live) stays.
        assert_eq!(c.insert(key(3), 3, 60 * S, t0 + 6 * S), Room::Expired);
        assert_eq!(c.get(&key(1), t0 + 6 * S), Some(&1));
        assert_eq!(c.get(&key(3), t0 + 6 * S), Some(&3));
        // Full of live entries: the one closest to its expiry goes.
        assert_eq!(c.insert(key(4), 4, 60 * S, t0 + 7 * S), Room::Evicted);
        assert_eq!(c.get(&key(1), t0 + 7 * S), None);
        assert_eq!(c.get(&key(3), t0 + 7 * S), Some(&3));
        // Replacing a key needs no room.
        assert_eq!(c.insert(key(3), 30, 60 * S, t0 + 8 * S), Room::Free);
        assert_eq!(c.get(&key(3), t0 + 8 * S), Some(&30));
    }

    #[test]
    fn the_budget_allows_a_burst_then_one_review_per_period() {
        let t0 = Instant::now();
        let every = Duration::from_millis(500);
        let mut b = Budget::new(3, every, t0);
        assert!((0..3).all(|_| b.try_spend(t0)));
        assert!(!b.try_spend(t0), "the burst is spent");
        assert!(!b.try_spend(t0 + Duration::from_millis(499)));
        assert!(b.try_spend(t0 + every), "one more after a period");
        assert!(!b.try_spend(t0 + every));
        // A long quiet time refills the burst, no more.
        let later = t0 + 3600 * S;
        assert!((0..3).all(|_| b.try_spend(later)));
        assert!(!b.try_spend(later));
        // Over ten seconds a steady flood gets exactly one review per period.
        let mut granted = 0;
        for ms in (1..=10_001).step_by(10) {
            if b.try_spend(later + Duration::from_millis(ms)) {
                granted += 1;
            }
        }
        assert_eq!(granted, 20);
    }
}
