//! pubsub cycle at 10,000 instances across 50 groups, then at 50,000 instances across 250
//! groups with and without 30% of GameLift calls throttled.
//!
//! Run: `cargo bench -p lastcall-testkit --bench pubsub_cycle`
//!
//! The GameLift emulator runs in-process and answers instantly, so a cycle's wall time is
//! pubsub's own work (plus the emulator's request handling and redis-server, on the same
//! machine). Compared in the same run: a baseline publisher that does one PUBLISH round trip
//! per instance, as the original did, against pubsub's pipelined PUBLISH + SET batches.

use std::time::{Duration, Instant};

use clap::Parser;
use lastcall_common::admin::Health;
use lastcall_common::fleetiq::{InstanceStatus, StatusMessage};
use lastcall_pubsub::metrics::Metrics;
use lastcall_pubsub::publisher::{Outgoing, Publisher};
use lastcall_pubsub::{Config, Pubsub, gamelift_client};
use lastcall_testkit::gamelift::{self as emu, DEFAULT_PAGE_SIZE, GameLiftEmulator};
use lastcall_testkit::redis::RedisServer;

const GROUPS: usize = 50;
const PER_GROUP: usize = 200;
const CYCLES: usize = 15;
const BASELINE_RUNS: usize = 3;
const TARGET: Duration = Duration::from_millis(500);

fn main() -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(bench())
}

fn group_name(g: usize) -> String {
    format!("bench-group-{g:02}")
}

fn instance_ids(g: usize) -> Vec<String> {
    (0..PER_GROUP)
        .map(|i| format!("i-{g:02}{i:015x}"))
        .collect()
}

async fn bench() -> anyhow::Result<()> {
    let emulator = GameLiftEmulator::start().await?;
    let redis = RedisServer::start().await?;
    let dir = tempfile::tempdir()?;
    let groups_file = dir.path().join("fleetiq.conf");
    let names: Vec<String> = (0..GROUPS).map(group_name).collect();
    std::fs::write(
        &groups_file,
        serde_json::json!({ "GameServerGroups": names }).to_string(),
    )?;
    for g in 0..GROUPS {
        emulator.add_instances(
            &group_name(g),
            &instance_ids(g),
            emu::InstanceStatus::Active,
        );
    }
    let instances = GROUPS * PER_GROUP;
    let min_pages = GROUPS * PER_GROUP.div_ceil(DEFAULT_PAGE_SIZE);

    let config = Config::try_parse_from([
        "lastcall-pubsub",
        "--redis-url",
        &redis.host_port(),
        "--config-file",
        groups_file.to_str().unwrap_or_default(),
        "--aws-region",
        "us-west-2",
        "--gamelift-endpoint",
        &emulator.url(),
        "--cycle-jitter",
        "0s",
        // Above what the emulator can answer, so the figure is pubsub's own work; at the
        // default 20 calls/s these 100 pages take 5 s by design.
        "--api-rate",
        LARGE_RATE,
    ])?;
    let credentials = aws_sdk_gamelift::config::Credentials::new(
        "AKIDBENCH",
        "bench-secret",
        None,
        None,
        "bench",
    );
    let pubsub = Pubsub::new(&config, gamelift_client(&config, Some(credentials)).await)?;

    // Warm-up: connections, credentials, allocator.
    let warm = pubsub.run_cycle().await;
    anyhow::ensure!(
        warm.published as usize == instances,
        "warm-up published {}",
        warm.published
    );

    let mut durations = Vec::with_capacity(CYCLES);
    let mut round_trips = Vec::with_capacity(CYCLES);
    let mut api_calls = Vec::with_capacity(CYCLES);
    for _ in 0..CYCLES {
        emulator.clear_calls();
        let report = pubsub.run_cycle().await;
        anyhow::ensure!(report.errors == 0, "cycle had errors: {report:?}");
        anyhow::ensure!(report.published as usize == instances, "{report:?}");
        anyhow::ensure!(emulator.count("DescribeGameServerInstances") as u64 == report.api_calls);
        durations.push(report.duration);
        round_trips.push(report.redis_round_trips);
        api_calls.push(report.api_calls);
    }
    durations.sort();
    let median = durations[durations.len() / 2];
    // Nearest-rank p99: with 15 samples, the slowest cycle.
    let p99 = durations[((durations.len() as f64 * 0.99).ceil() as usize).saturating_sub(1)];

    // The same 10,000 messages, published two ways on the same Redis.
    let messages: Vec<Vec<Outgoing>> = (0..GROUPS)
        .map(|g| {
            let name = group_name(g);
            instance_ids(g)
                .into_iter()
                .map(|iid| {
                    let m = StatusMessage {
                        group_name: Some(name.clone()),
                        group_arn: Some(GameLiftEmulator::group_arn(&name)),
                        instance_id: iid,
                        status: InstanceStatus::Active,
                    };
                    Outgoing {
                        body: m.to_python_json(),
                        instance_id: m.instance_id,
                        polled_at: tokio::time::Instant::now(),
                    }
                })
                .collect()
        })
        .collect();
    let mut baseline_times = Vec::new();
    let mut conn = redis.client().await?;
    for _ in 0..BASELINE_RUNS {
        let started = Instant::now();
        for m in messages.iter().flatten() {
            let _: i64 = redis::cmd("PUBLISH")
                .arg(&m.instance_id)
                .arg(&m.body)
                .query_async(&mut conn)
                .await?;
        }
        baseline_times.push(started.elapsed());
    }
    baseline_times.sort();
    let baseline = baseline_times[baseline_times.len() / 2];

    let mut registry = prometheus_client::registry::Registry::default();
    let publisher = Publisher::new(&config, Metrics::register(&mut registry), Health::default())?;
    let mut pipelined_times = Vec::new();
    let mut pipelined_trips = 0;
    for _ in 0..BASELINE_RUNS {
        let started = Instant::now();
        pipelined_trips = 0;
        for group in &messages {
            let report = publisher
                .publish(
                    group,
                    tokio::time::Instant::now() + Duration::from_secs(600),
                )
                .await;
            anyhow::ensure!(report.errors == 0, "pipelined publish failed");
            pipelined_trips += report.round_trips;
        }
        pipelined_times.push(started.elapsed());
    }
    pipelined_times.sort();
    let pipelined = pipelined_times[pipelined_times.len() / 2];

    let trips = round_trips[round_trips.len() / 2];
    let calls = api_calls[api_calls.len() / 2];
    let ms = |d: Duration| format!("{:.1} ms", d.as_secs_f64() * 1000.0);
    println!();
    println!(
        "pubsub cycle: {instances} instances, {GROUPS} groups, page size {DEFAULT_PAGE_SIZE}, {CYCLES} cycles"
    );
    println!(
        "machine: {} ({} CPUs)",
        cpu_model(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!();
    println!("| measure | value |");
    println!("|---|---|");
    println!("| cycle time, median | {} |", ms(median));
    println!("| cycle time, p99 | {} |", ms(p99));
    println!(
        "| target | < {} ({}) |",
        ms(TARGET),
        if p99 < TARGET { "met" } else { "MISSED" }
    );
    println!("| Redis round trips per cycle | {trips} |");
    println!("| baseline round trips (1 PUBLISH per instance) | {instances} |");
    println!(
        "| round-trip ratio (baseline / pubsub) | {:.0}x |",
        instances as f64 / trips as f64
    );
    println!(
        "| publish time, pubsub newer-only script (SET, SET, PUBLISH per instance), {pipelined_trips} round trips | {} |",
        ms(pipelined)
    );
    println!(
        "| publish time, baseline PUBLISH only, {instances} round trips | {} |",
        ms(baseline)
    );
    println!(
        "| time ratio (baseline / pubsub publish) | {:.1}x |",
        baseline.as_secs_f64() / pipelined.as_secs_f64()
    );
    println!(
        "| time ratio (baseline / whole pubsub cycle) | {:.1}x |",
        baseline.as_secs_f64() / median.as_secs_f64()
    );
    println!("| API calls per cycle | {calls} |");
    println!("| minimum pages (sum of ceil(n / page size)) | {min_pages} |");
    println!();
    anyhow::ensure!(
        calls as usize == min_pages,
        "API calls {calls} != minimum pages {min_pages}"
    );
    large(&emulator, &redis).await?;
    Ok(())
}

const LARGE_GROUPS: usize = 250;
const LARGE_CYCLES: usize = 3;
/// High enough that the emulator, not the bucket, sets the pace: this measures pubsub's
/// own work. At the default `--api-rate 20` the same 500 pages take 25 s by design.
const LARGE_RATE: &str = "2000";

/// 250 groups x 200 instances, with and without 30% throttling.
async fn large(emulator: &GameLiftEmulator, redis: &RedisServer) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let groups_file = dir.path().join("fleetiq.conf");
    let names: Vec<String> = (0..LARGE_GROUPS).map(|g| format!("large-{g:03}")).collect();
    std::fs::write(
        &groups_file,
        serde_json::json!({ "GameServerGroups": names }).to_string(),
    )?;
    for (g, name) in names.iter().enumerate() {
        let ids: Vec<String> = (0..PER_GROUP)
            .map(|i| format!("i-l{g:03}{i:013x}"))
            .collect();
        emulator.add_instances(name, &ids, emu::InstanceStatus::Active);
    }
    let instances = LARGE_GROUPS * PER_GROUP;
    let min_pages = LARGE_GROUPS * PER_GROUP.div_ceil(DEFAULT_PAGE_SIZE);
    println!(
        "pubsub cycle: {instances} instances, {LARGE_GROUPS} groups, --api-rate {LARGE_RATE}, {LARGE_CYCLES} cycles each"
    );
    println!();
    println!(
        "| throttled | cycle time, median | cycle time, max | API calls / cycle (median) | minimum pages | throttled calls / cycle | groups failed / cycle (max) | effective call rate |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for ratio in [0.0, 0.3] {
        let config = Config::try_parse_from([
            "lastcall-pubsub",
            "--redis-url",
            &redis.host_port(),
            "--config-file",
            groups_file.to_str().unwrap_or_default(),
            "--aws-region",
            "us-west-2",
            "--gamelift-endpoint",
            &emulator.url(),
            "--cycle-jitter",
            "0s",
            "--api-rate",
            LARGE_RATE,
            "--api-budget",
            "100000",
            "--retry-base",
            "50ms",
            "--retry-max",
            "1s",
            "--api-max-attempts",
            "10",
        ])?;
        let credentials = aws_sdk_gamelift::config::Credentials::new(
            "AKIDBENCH",
            "bench-secret",
            None,
            None,
            "bench",
        );
        let pubsub = Pubsub::new(&config, gamelift_client(&config, Some(credentials)).await)?;
        emulator.set_seed(11);
        emulator.set_throttle_ratio(0.0);
        pubsub.run_cycle().await; // warm-up
        emulator.set_throttle_ratio(ratio);
        let mut durations = Vec::new();
        let mut calls = Vec::new();
        let mut throttled = Vec::new();
        let mut failed = 0;
        for _ in 0..LARGE_CYCLES {
            emulator.clear_calls();
            let report = pubsub.run_cycle().await;
            durations.push(report.duration);
            calls.push(report.api_calls);
            throttled.push(
                emulator
                    .calls()
                    .iter()
                    .filter(|c| c.outcome == "ThrottlingException")
                    .count(),
            );
            failed = failed.max(report.groups_failed);
        }
        durations.sort();
        calls.sort();
        throttled.sort();
        let median = durations[durations.len() / 2];
        let max = durations[durations.len() - 1];
        let c = calls[calls.len() / 2];
        println!(
            "| {:.0}% | {:.0} ms | {:.0} ms | {c} | {min_pages} | {} | {failed} | {:.0}/s |",
            ratio * 100.0,
            median.as_secs_f64() * 1000.0,
            max.as_secs_f64() * 1000.0,
            throttled[throttled.len() / 2],
            c as f64 / median.as_secs_f64(),
        );
    }
    emulator.set_throttle_ratio(0.0);
    println!();
    Ok(())
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
            })
        })
        .unwrap_or_else(|| "unknown CPU".into())
}
