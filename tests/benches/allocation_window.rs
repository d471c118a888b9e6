//! How long a draining node can still take a match, with and without the allocation
//! selector that excludes `lastcall.dev/node-draining=true`, measured in the same run.
//!
//! Each interleaving: a node with Ready servers of one Fleet, a real agent, an allocator
//! looping over that node's Ready servers (list, then update with the resourceVersion, as
//! Agones' allocator does), and the manual drain label. Allocations that succeed after the
//! fence took effect are found by the emulator's journal; their delay is measured from the
//! moment the drain signal was accepted. Every run also checks that no match is lost (no
//! allocated server deleted, each one protected once the drain settles) and fails the bench
//! otherwise; `tests/tests/agent_race.rs` runs a reduced set of the same interleavings.
//!
//! `cargo bench -p lastcall-testkit --bench allocation_window`

use std::time::Duration;

use futures::StreamExt;
use lastcall_testkit::world::{WindowRun, allocation_window};

const RUNS: u64 = 100;
const SERVERS: usize = 8;
const AT_ONCE: usize = 4;

async fn run(seed: u64, selector: bool, failing_deletes: bool) -> anyhow::Result<WindowRun> {
    allocation_window(seed, SERVERS, selector, failing_deletes).await
}

fn pct(v: &[Duration], p: f64) -> String {
    if v.is_empty() {
        return "–".into();
    }
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    format!("{:.1} ms", v[i].as_secs_f64() * 1e3)
}

fn main() -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        println!("allocation window: {RUNS} interleavings per mode, {SERVERS} Ready servers, allocator looping on the node");
        println!("| DELETEs | allocator | runs with an allocation after the fence | allocations after the fence | signal → such an allocation, p50 / p99 / max |");
        println!("|---|---|---|---|---|");
        for (failing, selector) in [(false, false), (false, true), (true, false), (true, true)] {
            let runs: Vec<anyhow::Result<WindowRun>> = futures::stream::iter(0..RUNS)
                .map(|s| run(s, selector, failing))
                .buffer_unordered(AT_ONCE)
                .collect()
                .await;
            let mut late = vec![];
            let mut runs_with = 0;
            for r in runs {
                let r = r?;
                runs_with += usize::from(!r.late.is_empty());
                late.extend(r.late);
            }
            late.sort();
            println!(
                "| {} | {} | {runs_with} / {RUNS} | {} | {} / {} / {} |",
                if failing { "first 16 fail (503)" } else { "succeed" },
                if selector {
                    "excludes `lastcall.dev/node-draining`"
                } else {
                    "no selector"
                },
                late.len(),
                pct(&late, 0.5),
                pct(&late, 0.99),
                pct(&late, 1.0),
            );
        }
        anyhow::Ok(())
    })
}
