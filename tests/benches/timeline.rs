//! Whole randomized timelines (`lastcall_testkit::timeline`) at volume: how many invariant
//! hits, of which kind and on which seeds, and the wall time per timeline.
//!
//! `cargo bench -p lastcall-testkit --bench timeline` (2,000 timelines; `TIMELINE_COUNT`,
//! `TIMELINE_FIRST`, `TIMELINE_CONCURRENCY`, `TIMELINE_DISABLE` as for the test). Prints a
//! summary and exits 0 whatever the hits: the test (`--test timeline`) is what asserts.

use std::time::{Duration, Instant};

use lastcall_testkit::bench::{ms, percentile};
use lastcall_testkit::timeline::{from_env, run_many, summary};

/// Timelines per progress line.
const CHUNK: usize = 100;

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (seeds, dims, concurrency) = from_env(2000);
    let n = seeds.len();
    let started = Instant::now();
    // In chunks, with a running total, so a long run shows where it stands.
    let mut outcomes = vec![];
    let verbose = std::env::var_os("TIMELINE_VERBOSE").is_some();
    for chunk in seeds.chunks(CHUNK) {
        let done = rt.block_on(run_many(chunk.to_vec(), dims, concurrency));
        if verbose {
            for o in done.iter().filter(|o| !o.report.is_empty()) {
                println!("{}", o.report);
            }
        }
        outcomes.extend(done);
        let hits: usize = outcomes.iter().map(|o| o.hits.len()).sum();
        println!(
            "… {} timelines, {:.0} s, {hits} hits: {:?}",
            outcomes.len(),
            started.elapsed().as_secs_f64(),
            summary(&outcomes)
                .iter()
                .map(|(i, s)| (i.as_str(), s.len(), s))
                .collect::<Vec<_>>()
        );
    }
    let wall = started.elapsed();
    let mut walls: Vec<Duration> = outcomes.iter().map(|o| o.wall).collect();
    let errors = outcomes.iter().filter(|o| o.error.is_some()).count();
    let with_hits = outcomes.iter().filter(|o| !o.hits.is_empty()).count();
    let hits: usize = outcomes.iter().map(|o| o.hits.len()).sum();
    println!("timelines: {n}, {concurrency} at a time, dimensions {dims:?}");
    println!(
        "wall: {:.1} s total; per timeline median {}, p95 {}, max {}",
        wall.as_secs_f64(),
        ms(percentile(&mut walls, 0.5), 0),
        ms(percentile(&mut walls, 0.95), 0),
        ms(percentile(&mut walls, 1.0), 0),
    );
    println!("runs that could not start: {errors}");
    println!("invariant hits: {hits} in {with_hits} timelines");
    for (inv, seeds) in summary(&outcomes) {
        let shown: Vec<String> = seeds.iter().take(12).map(u64::to_string).collect();
        println!(
            "  {:<28} {:>5} timelines; seeds {}{}",
            inv.as_str(),
            seeds.len(),
            shown.join(","),
            if seeds.len() > shown.len() {
                ",…"
            } else {
                ""
            }
        );
    }
    for o in outcomes.iter().filter(|o| o.error.is_some()).take(5) {
        println!(
            "run error, seed {}: {}",
            o.seed,
            o.error.as_deref().unwrap_or_default()
        );
    }
}
