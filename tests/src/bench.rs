//! Small helpers the `harness = false` benchmarks share.

use std::time::Duration;

/// The `p` quantile (0..=1) of `samples`, nearest rank; sorts them in place.
pub fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    let last = samples.len().saturating_sub(1);
    samples
        .get(((last as f64) * p).round() as usize)
        .copied()
        .unwrap_or_default()
}

/// `d` in milliseconds with `decimals` places, for the reports' tables.
pub fn ms(d: Duration, decimals: usize) -> String {
    format!("{:.*} ms", decimals, d.as_secs_f64() * 1e3)
}
