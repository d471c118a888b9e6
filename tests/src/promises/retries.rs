//! Retries back off (`docs/agent.md`: failed writes are retried with backoff, never in a
//! tight loop), read from the journal's times: within a window from the first failure, a
//! bounded number of attempts, and the gaps between them grown past the first ones.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use crate::kube::journal::JournalEntry;

/// The times of the requests `pick` selects, per object name, in journal order.
pub fn times_by_name(
    entries: &[JournalEntry],
    pick: impl Fn(&JournalEntry) -> bool,
) -> BTreeMap<String, Vec<SystemTime>> {
    let mut out: BTreeMap<String, Vec<SystemTime>> = BTreeMap::new();
    for e in entries.iter().filter(|e| pick(e)) {
        out.entry(e.name.clone().unwrap_or_default())
            .or_default()
            .push(e.at);
    }
    out
}

/// The gaps between consecutive `times`.
pub fn gaps(times: &[SystemTime]) -> Vec<Duration> {
    times
        .windows(2)
        .map(|w| w[1].duration_since(w[0]).unwrap_or_default())
        .collect()
}

/// What is wrong with attempts at `times` for a backoff, within `window` from the first
/// (empty: nothing): more than `max` attempts in it (a tight loop), or no gap in it as long
/// as `longest` (the delay never grew). With jittered exponential backoff both bounds hold
/// but for draws far below their ceiling many times in a row.
pub fn backoff_faults(
    times: &[SystemTime],
    window: Duration,
    max: usize,
    longest: Duration,
) -> Vec<String> {
    let Some(first) = times.first().copied() else {
        return vec![];
    };
    let within: Vec<SystemTime> = times
        .iter()
        .copied()
        .filter(|t| *t <= first + window)
        .collect();
    let g = gaps(&within);
    let mut out = vec![];
    if within.len() > max {
        out.push(format!(
            "{} attempts within {window:?} of the first (at most {max})",
            within.len()
        ));
    }
    if g.iter().all(|d| *d < longest) {
        out.push(format!(
            "no gap of {longest:?} within {window:?}: the delay never grew"
        ));
    }
    if !out.is_empty() {
        out.push(format!(
            "gaps (ms): {:?}",
            g.iter().map(Duration::as_millis).collect::<Vec<_>>()
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: &[u64]) -> Vec<SystemTime> {
        ms.iter()
            .map(|m| SystemTime::UNIX_EPOCH + Duration::from_millis(*m))
            .collect()
    }

    #[test]
    fn a_growing_delay_passes_a_tight_or_flat_loop_does_not() {
        let (w, longest) = (Duration::from_secs(4), Duration::from_millis(400));
        // What the agent did: two echoes, then 85, 353, 566, 1533 ms.
        let backoff = at(&[0, 28, 32, 117, 470, 1036, 2569]);
        assert!(backoff_faults(&backoff, w, 15, longest).is_empty());
        let tight: Vec<u64> = (0..400).map(|i| i * 10).collect();
        assert_eq!(backoff_faults(&at(&tight), w, 15, longest).len(), 3);
        let flat: Vec<u64> = (0..14).map(|i| i * 300).collect();
        let faults = backoff_faults(&at(&flat), w, 15, longest);
        assert!(faults[0].starts_with("no gap"), "{faults:?}");
        assert!(backoff_faults(&[], w, 15, longest).is_empty());
    }
}
