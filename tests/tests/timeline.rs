//! Randomized whole timelines for one node (`lastcall_testkit::timeline`): signals from
//! several sources appearing, moving, cancelled and re-appearing, agent restarts, kills and
//! rollouts, API faults, allocations and match ends, checked against the emulators'
//! journals. Zero invariant hits allowed.
//!
//! `TIMELINE_COUNT` sets how many (default 200: about 5 min at 1.5 s each on a quiet
//! machine, within the cold CI run's budget), `TIMELINE_SEED=<n>` replays one,
//! `TIMELINE_DISABLE=two_agents,hangs` switches generator dimensions off.

use lastcall_testkit::timeline::{Met, from_env, run_many, summary};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_timelines_keep_every_invariant() {
    // The agents' own logs with `RUST_LOG` set (e.g. `lastcall_agent=debug`), to replay one
    // seed: they are not told apart by timeline.
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
    }
    let (seeds, dims, concurrency) = from_env(200);
    let n = seeds.len();
    let started = std::time::Instant::now();
    let outcomes = run_many(seeds, dims, concurrency).await;
    let errors: Vec<String> = outcomes
        .iter()
        .filter_map(|o| o.error.as_ref().map(|e| format!("seed {}: {e}", o.seed)))
        .collect();
    for o in outcomes.iter().filter(|o| !o.report.is_empty()) {
        eprintln!("{}", o.report);
    }
    let by = summary(&outcomes);
    let hits: usize = outcomes.iter().map(|o| o.hits.len()).sum();
    let slowest = outcomes.iter().map(|o| o.wall).max().unwrap_or_default();
    for o in &outcomes {
        eprintln!(
            "seed {}: {:.1}s ({:.1}s set-up), {} hits",
            o.seed,
            o.wall.as_secs_f64(),
            o.setup.as_secs_f64(),
            o.hits.len()
        );
    }
    eprintln!(
        "{n} timelines in {:.1}s (slowest {:.1}s): {hits} invariant hits; by invariant (seeds): {:?}",
        started.elapsed().as_secs_f64(),
        slowest.as_secs_f64(),
        by.iter().map(|(i, s)| (i.as_str(), s)).collect::<Vec<_>>()
    );
    let met = Met::total(&outcomes);
    eprintln!("met: {met}");
    assert!(
        errors.is_empty(),
        "timelines that could not run: {errors:#?}"
    );
    assert_eq!(hits, 0, "invariant hits (reports above): {by:?}");
    // Every edge, fault and judged case is met at least a few times in the default 200.
    if n >= 200 {
        let short = met.below(5);
        assert!(
            short.is_empty(),
            "met fewer than 5 times: {short:?} ({met})"
        );
    }
}
