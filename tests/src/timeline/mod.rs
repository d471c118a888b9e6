//! Randomized whole timelines for one node, checked against the emulators' journals.
//!
//! A seeded draw ([`script::Timeline::draw`]) gives signals from several sources appearing,
//! moving, cancelled and re-appearing (IMDS scheduled events and Spot, GCE maintenance and
//! preemption, FleetIQ over Redis, the manual label, Karpenter's taint), agent restarts,
//! kills and rollouts, API faults, allocations and match ends. [`runner::run`] plays it in
//! real time against a fresh world with the agent built exactly as the binary builds it;
//! [`check::check`] reads the kube journal (with each accepted write's resulting object)
//! and the GameLift calls and lists every invariant hit. Deadlines are a few seconds out,
//! so a timeline takes a few seconds; [`run_many`] runs several at once.

pub mod check;
pub mod runner;
pub mod script;
pub mod truth;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use futures::StreamExt;

use crate::redis::RedisServer;
use check::{Hit, Invariant};
use script::{Dimensions, Timeline};

/// The outcome of one timeline.
pub struct Outcome {
    pub seed: u64,
    pub hits: Vec<Hit>,
    /// The failure report (empty when there are no hits).
    pub report: String,
    pub wall: Duration,
    /// Of which building the world and starting the agent.
    pub setup: Duration,
    /// The run itself failed (world set-up); not an invariant hit.
    pub error: Option<String>,
}

/// Runs one timeline and checks it.
pub async fn run_one(seed: u64, dims: Dimensions, redis: &RedisServer) -> Outcome {
    let started = std::time::Instant::now();
    let tl = Timeline::draw(seed, dims);
    match runner::run(tl.clone(), redis).await {
        Ok(run) => {
            let hits = check::check(&run);
            let verbose = std::env::var_os("TIMELINE_VERBOSE").is_some();
            let report = if hits.is_empty() && !verbose {
                String::new()
            } else {
                check::report(&run, &hits)
            };
            Outcome {
                seed,
                hits,
                report,
                wall: started.elapsed(),
                setup: run.setup,
                error: None,
            }
        }
        Err(e) => Outcome {
            seed,
            hits: vec![],
            report: format!("{tl}run failed: {e:#}"),
            wall: started.elapsed(),
            setup: Duration::ZERO,
            error: Some(format!("{e:#}")),
        },
    }
}

/// Runs the timelines of `seeds`, `concurrency` at a time, sharing one Redis.
pub async fn run_many(seeds: Vec<u64>, dims: Dimensions, concurrency: usize) -> Vec<Outcome> {
    // A loaded machine can keep a fresh redis-server from answering its first PING in time
    // (it ended a long bench run between two chunks): try again before giving up.
    let mut started = RedisServer::start().await;
    for _ in 0..2 {
        if started.is_ok() {
            break;
        }
        started = RedisServer::start().await;
    }
    let redis = started.expect("redis-server");
    let redis = &redis;
    futures::stream::iter(seeds)
        .map(|seed| run_one(seed, dims, redis))
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await
}

/// Seeds and settings from the environment: `TIMELINE_SEED` (one seed, to replay),
/// `TIMELINE_SEEDS` (a comma-separated list), `TIMELINE_COUNT` (else `default_count`), `TIMELINE_FIRST` (first seed, default 1),
/// `TIMELINE_CONCURRENCY` (default 4), `TIMELINE_DISABLE` (dimension names to switch off).
/// `TIMELINE_VERBOSE` prints every timeline's report, hits or not.
pub fn from_env(default_count: u64) -> (Vec<u64>, Dimensions, usize) {
    let num = |k: &str| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    let listed: Vec<u64> = std::env::var("TIMELINE_SEEDS")
        .unwrap_or_default()
        .split(',')
        .filter_map(|v| v.trim().parse().ok())
        .collect();
    let seeds = match num("TIMELINE_SEED") {
        Some(s) => vec![s],
        None if !listed.is_empty() => listed,
        None => {
            let first = num("TIMELINE_FIRST").unwrap_or(1);
            (first..first + num("TIMELINE_COUNT").unwrap_or(default_count)).collect()
        }
    };
    let dims = Dimensions::without(&std::env::var("TIMELINE_DISABLE").unwrap_or_default())
        .unwrap_or_else(|e| panic!("TIMELINE_DISABLE: {e}"));
    let concurrency = num("TIMELINE_CONCURRENCY").unwrap_or(4) as usize;
    (seeds, dims, concurrency)
}

/// Hits per invariant, with the seeds that hit it.
pub fn summary(outcomes: &[Outcome]) -> BTreeMap<Invariant, Vec<u64>> {
    let mut by: BTreeMap<Invariant, Vec<u64>> = BTreeMap::new();
    for o in outcomes {
        let seen: BTreeSet<Invariant> = o.hits.iter().map(|h| h.invariant).collect();
        for i in seen {
            by.entry(i).or_default().push(o.seed);
        }
    }
    for v in by.values_mut() {
        v.sort_unstable();
    }
    by
}
