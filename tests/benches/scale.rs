//! Scale: 2,000 agents on one control plane.
//!
//! Run: `nice cargo bench -p lastcall-testkit --bench scale` (`LASTCALL_SCALE_AGENTS`,
//! `LASTCALL_SCALE_SERVERS`, `LASTCALL_SCALE_ALLOCATED`, `LASTCALL_SCALE_UNFILTERED`,
//! `LASTCALL_SCALE_WINDOW` seconds change the world; `LASTCALL_SCALE_REDIS_CLUSTER=3x1` puts
//! the agents on a Redis Cluster (3 primaries, 1 replica each) instead of one redis-server;
//! `LASTCALL_SCALE_AGONES_FIELDS=0` an older Agones (GameServers selected by label);
//! `LASTCALL_SCALE_APF_RATE` sets the
//! rate API Priority and Fairness admits, 1,000/s by default, 0 for seats only, negative
//! for off; `LASTCALL_BENCH_LOG=warn` prints the agents' logs).
//!
//! The world is `lastcall_testkit::scale`: the Kubernetes API emulator in its own process
//! over a store-only world, the agents in shard processes of 500 (`LASTCALL_SCALE_SHARD`;
//! built as the binary builds them, each
//! with its own identity and filtered watches, FleetIQ mode), one GameLift emulator and the
//! background load on a side runtime, one private redis-server (or Redis Cluster).
//! Scenarios, in order:
//!
//! 1. steady state: requests/s and watch events/s at the API, per agent and in total, with
//!    one pubsub republish round; agent RSS per agent; emulator, agent, side and Redis CPU.
//!    Baselines: a sample of unfiltered watchers (every GameServer and pod, cached), scaled
//!    to the agent count, and one cluster-wide GameServer LIST (the original adapter's
//!    per-check read), scaled to a drain.
//! 2. 10% of the nodes doomed by FleetIQ DRAINING within one second, allocators racing.
//! 3. 50% of the (remaining) nodes, the same way.
//! 4. Redis: subscribers, CPU and memory across the run; PUBLISH → last fence from 2 and 3.
//! 6. the API server restarts (every watch ends, `LASTCALL_SCALE_DOWN` seconds of 503s, 5 by
//!    default, the watch history gone): the re-list storm, run before 2 and 3 so that the
//!    drains use the watches it re-made. Baseline: the unfiltered watchers' initial sync,
//!    which is what each of them would list again.

use std::time::Duration;

use lastcall_testkit::kube::Traffic;
use lastcall_testkit::scale::{
    DrainReport, ScaleSpec, ScaleWorld, UnfilteredReport, open_fds, status_kb,
};
use lastcall_testkit::scale_agents::run_on_two_workers;
use lastcall_testkit::scale_restart::RestartReport;

fn main() -> anyhow::Result<()> {
    // The harness's runtime (the agents run in shard processes).
    run_on_two_workers("harness", run())?
}

fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

fn pct(samples: &mut [Duration], p: f64) -> String {
    lastcall_testkit::bench::ms(lastcall_testkit::bench::percentile(samples, p), 0)
}

fn per_s(n: u64, window: Duration) -> f64 {
    n as f64 / window.as_secs_f64().max(1e-9)
}

fn mib(kb: u64) -> String {
    format!("{:.1} MiB", kb as f64 / 1024.0)
}

async fn run() -> anyhow::Result<()> {
    let spec = ScaleSpec::from_env(2000);
    let window = Duration::from_secs(
        std::env::var("LASTCALL_SCALE_WINDOW")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(30),
    );
    let n = spec.agents;
    println!(
        "# Scale: {n} agents, {} game servers per node ({} Allocated), kubelet status every {:?}, {:.0} pod churn/s, {:.0} GameServer writes/s",
        spec.servers_per_node,
        spec.allocated_per_node,
        spec.node_status_period,
        spec.pod_churn_per_sec,
        spec.gameserver_writes_per_sec
    );
    match &spec.apf {
        Some(a) => println!(
            "API Priority and Fairness: {} seats, {:.0} requests/s admitted, queues of {} per user, Retry-After {} s.",
            a.seats, a.rate, a.queue_per_flow, a.retry_after_secs
        ),
        None => println!("API Priority and Fairness: off."),
    }
    println!();
    let world = ScaleWorld::start(spec.clone()).await?;
    let epid = world.emulator_pid();
    for (phase, s) in &world.setup {
        println!("- setup: {phase} after {s:.1} s");
    }
    let agent_kb = world
        .rss_with_agents
        .saturating_sub(world.rss_before_agents);
    println!(
        "- agent processes ({} shards): RSS {} before the agents, {} with them: **{:.0} KiB per agent**; {} open fds ({:.1} per agent); emulator process RSS {}, {} open fds",
        world.shards.len(),
        mib(world.rss_before_agents),
        mib(world.rss_with_agents),
        agent_kb as f64 / n as f64,
        world.fds_with_agents,
        world.fds_with_agents as f64 / n as f64,
        mib(status_kb(&epid, "VmRSS")),
        open_fds(&epid),
    );
    println!();

    // 1. Steady state.
    let s = world.steady(window).await?;
    let w = s.window;
    println!("## 1. Steady state, {} s window", w.as_secs());
    println!();
    println!("| who | requests/s | watch events/s | bytes/s |");
    println!("|---|---|---|---|");
    let row = |who: &str, t: &Traffic, div: f64| {
        println!(
            "| {who} | {:.3} | {:.3} | {:.0} |",
            per_s(t.requests, w) / div,
            per_s(t.watch_events, w) / div,
            per_s(t.bytes, w) / div
        );
    };
    row(&format!("all {n} agents"), &s.agents, 1.0);
    row("per agent (mean)", &s.agents, n as f64);
    println!(
        "| busiest agent, requests in the window | {} | | |",
        s.max_agent_requests
    );
    println!(
        "| agents' requests in the window: watch renewals (server-ended watches resumed) / anything else | {} / {} | | |",
        s.agent_watch_renewals,
        s.agent_other_requests.values().sum::<u64>()
    );
    for (id, t) in &s.by_identity {
        row(id, t, 1.0);
    }
    row("everyone", &s.all, 1.0);
    println!();
    println!(
        "CPU over the window: emulator process {} , agents {} , side runtime (GameLift emulator + load generators) {} , redis-server {:.2} s. Pubsub round (SET + PUBLISH ACTIVE for {n} instances): {}.",
        secs(s.cpu.emulator),
        secs(s.cpu.agents()),
        secs(s.cpu.side),
        s.redis_cpu,
        secs(s.republish),
    );
    println!();

    // Baselines.
    let (items, list_bytes, list_time) = world.original_list().await?;
    let u = if spec.unfiltered_sample > 0 {
        Some(
            world
                .unfiltered(window.min(Duration::from_secs(20)))
                .await?,
        )
    } else {
        None
    };
    println!("### Baselines (same run)");
    println!();
    println!("| what | requests/s | watch events/s | bytes/s | memory |");
    println!("|---|---|---|---|---|");
    println!(
        "| lastcall, all {n} agents, steady | {:.3} | {:.1} | {:.0} | {} |",
        per_s(s.agents.requests, w),
        per_s(s.agents.watch_events, w),
        per_s(s.agents.bytes, w),
        mib(agent_kb)
    );
    if let Some(u) = &u {
        let uw = u.window;
        println!(
            "| unfiltered watches (every GameServer and pod), per watcher, measured on {} | {:.3} | {:.1} | {:.0} | {} |",
            u.sample,
            per_s(u.window_traffic.requests, uw),
            per_s(u.window_traffic.watch_events, uw),
            per_s(u.window_traffic.bytes, uw),
            mib(u.rss_kb_each)
        );
        println!(
            "| unfiltered × {n} (computed) | {:.1} | {:.0} | {:.0} | {} |",
            per_s(u.window_traffic.requests, uw) * n as f64,
            per_s(u.window_traffic.watch_events, uw) * n as f64,
            per_s(u.window_traffic.bytes, uw) * n as f64,
            mib(u.rss_kb_each * n as u64)
        );
        println!(
            "| unfiltered: each watcher's initial sync ({}) | {} | {} | {} | |",
            secs(u.sync_time),
            u.sync.requests,
            u.sync.watch_events,
            u.sync.bytes
        );
        println!(
            "| unfiltered initial syncs × {n} (a rollout, computed) | {} | {} | {} | |",
            u.sync.requests * n as u64,
            u.sync.watch_events * n as u64,
            u.sync.bytes * n as u64
        );
    }
    let draining = (n / 10).max(1) as f64;
    println!(
        "| original: one cluster-wide GameServer LIST ({items} items, {}) | | | {list_bytes} bytes | |",
        lastcall_testkit::bench::ms(list_time, 0)
    );
    println!(
        "| original during a 10% drain: {draining:.0} draining nodes × 1 LIST / 60 s (computed) | {:.2} | | {:.0} | |",
        draining / 60.0,
        draining / 60.0 * list_bytes as f64
    );
    println!();

    // 6. The API server restarts (before the drains, which then run on the re-made watches).
    let down = Duration::from_secs(
        std::env::var("LASTCALL_SCALE_DOWN")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(5),
    );
    let r = world.restart_api(down, Duration::from_secs(600)).await?;
    print_restart(n, &r, u.as_ref());

    // 2 and 3. Drains.
    let tenth: Vec<usize> = (0..n).filter(|i| i % 10 == 0).collect();
    let half: Vec<usize> = (0..n).filter(|i| (1..=5).contains(&(i % 10))).collect();
    let mut reports = vec![];
    for (name, doomed) in [("10%", tenth), ("50%", half)] {
        let r = world.drain(doomed, Duration::from_secs(1)).await?;
        print_drain(name, n, &mut r.fence.clone(), &r);
        // A figure that breaks a promise fails the run, after the table that shows it.
        let broken = r.broken_promises();
        if !broken.is_empty() {
            world.shutdown().await;
            anyhow::bail!(
                "{name} drain broke lastcall's promises: {}",
                broken.join("; ")
            );
        }
        reports.push((name, r));
    }

    // 4. Redis.
    let info = world.redis.info().await?;
    let g = |k: &str| info.sum(k);
    println!("## 4. Redis: {n} subscribers on {}", world.redis.describe());
    println!();
    println!("| measure | value (all nodes; the busiest node) |");
    println!("|---|---|");
    println!(
        "| connected clients | {:.0}; {:.0} |",
        g("connected_clients"),
        info.max("connected_clients")
    );
    println!(
        "| pubsub channels subscribed | {:.0}; {:.0} |",
        g("pubsub_channels"),
        info.max("pubsub_channels")
    );
    println!(
        "| used_memory | {}; {} |",
        mib(g("used_memory") as u64 / 1024),
        mib(info.max("used_memory") as u64 / 1024)
    );
    println!(
        "| used_memory_rss | {}; {} |",
        mib(g("used_memory_rss") as u64 / 1024),
        mib(info.max("used_memory_rss") as u64 / 1024)
    );
    println!(
        "| CPU, steady window incl. one republish round | {:.2} s; by node {:?} |",
        s.redis_cpu,
        s.redis_cpu_by_node
            .iter()
            .map(|(p, c)| format!("{p}: {c:.2}"))
            .collect::<Vec<_>>()
    );
    println!(
        "| republish round ({n} SET + PUBLISH) | {} |",
        secs(s.republish)
    );
    for (name, r) in &reports {
        println!(
            "| {name} drain: first PUBLISH → last fence ({} publishes over 1 s) | {} |",
            r.doomed,
            secs(r.last_fence)
        );
        println!("| {name} drain: CPU | {:.2} s |", r.redis_cpu);
    }
    println!("| total CPU so far (user + sys) | {:.2} s |", info.cpu());
    println!();
    let generated = &world.generated;
    println!("Background load generated over the run: {:?}", generated);
    world.shutdown().await;
    Ok(())
}

fn print_drain(name: &str, n: usize, fence: &mut [Duration], r: &DrainReport) {
    println!(
        "## {} {name} of the nodes doomed within one second ({} of {n}), allocators racing",
        if name == "10%" { "2." } else { "3." },
        r.doomed
    );
    println!();
    println!("| measure | value |");
    println!("|---|---|");
    println!(
        "| drains completed (deregistered) | {} of {} in {} |",
        r.doomed,
        r.doomed,
        secs(r.done_after)
    );
    println!(
        "| matches killed (allocated servers deleted) | **{}** |",
        r.killed.len()
    );
    println!(
        "| allocations too late (after their server was marked draining, or after the first round of releases past the fence) | **{}** |",
        r.late_allocations.len()
    );
    println!(
        "| allocations during the run / on doomed nodes after their fence (protected) | {} / {} |",
        r.allocations, r.allocations_after_fence
    );
    println!(
        "| signal → fence p50 / p99 / max | {} / {} / {} |",
        pct(fence, 0.5),
        pct(fence, 0.99),
        pct(fence, 1.0)
    );
    let mut acted = r.acted.clone();
    println!(
        "| signal → the agent's first request admitted p50 / p99 / max | {} / {} / {} |",
        pct(&mut acted, 0.5),
        pct(&mut acted, 0.99),
        pct(&mut acted, 1.0)
    );
    println!("| first signal → last fence | {} |", secs(r.last_fence));
    println!(
        "| requests at the API, whole drain (agents) | {} ({}) |",
        r.requests, r.agent_requests
    );
    println!(
        "| peak requests/s, everyone (agents) | {} ({}) |",
        r.peak_rps, r.peak_agent_rps
    );
    println!(
        "| agent requests per doomed node | {:.1} |",
        r.agent_requests as f64 / r.doomed.max(1) as f64
    );
    println!(
        "| Event writes (share of agent requests; of all) | {} ({:.1}%; {:.1}%) |",
        r.event_writes,
        100.0 * r.agent_event_writes as f64 / r.agent_requests.max(1) as f64,
        100.0 * r.event_writes as f64 / r.requests.max(1) as f64
    );
    println!(
        "| requests that waited in an APF queue / peak waiting at once | {} / {} |",
        r.apf_queued, r.apf_peak_queued
    );
    println!(
        "| 429s received, agents (everyone) | {} ({}) |",
        r.agent_429, r.status_429
    );
    println!("| 429s by user | {:?} |", r.refused_by);
    println!(
        "| 409s (allocation races lost, both sides) | {} |",
        r.conflicts_409
    );
    println!(
        "| CPU: emulator / agents / side | {} / {} / {} |",
        secs(r.cpu.emulator),
        secs(r.cpu.agents()),
        secs(r.cpu.side)
    );
    println!(
        "| agent processes' open fds, peak sampled | {} |",
        r.peak_fds
    );
    println!();
    println!("Agent requests by kind:");
    println!();
    println!("| request | count |");
    println!("|---|---|");
    for (k, v) in &r.agent_requests_by_kind {
        println!("| {k} | {v} |");
    }
    println!();
}

fn print_restart(n: usize, r: &RestartReport, u: Option<&UnfilteredReport>) {
    println!(
        "## 6. The API server restarts: every watch ends, {} of 503s, the watch history gone (run before 2 and 3)",
        secs(r.down)
    );
    println!();
    println!("| measure | value |");
    println!("|---|---|");
    let mut after = r.list_after_up.clone();
    println!(
        "| server up → each agent's re-list of each kind, p50 / p99 / max | {} / {} / {} |",
        pct(&mut after, 0.5),
        pct(&mut after, 0.99),
        pct(&mut after, 1.0)
    );
    println!(
        "| watches listed again (410); resumed without a list (held the newest resourceVersion) | {}; {} |",
        r.list_after_up.len(),
        r.resumed_without_list
    );
    println!(
        "| server up → the last watch resumed | {} |",
        secs(r.last_watch)
    );
    println!(
        "| agent requests until every watch was back: in all; per agent | {}; {:.1} |",
        r.agent_traffic.requests,
        r.agent_traffic.requests as f64 / n.max(1) as f64
    );
    println!(
        "| successful LISTs per agent, most | {} |",
        r.lists_per_agent_max
    );
    println!(
        "| agent writes (the promise: 0) | **{}** |",
        r.agent_writes.len()
    );
    println!(
        "| bytes to the agents (LIST responses, watch events): in all; per agent | {}; {:.0} |",
        r.agent_traffic.bytes,
        r.agent_traffic.bytes as f64 / n.max(1) as f64
    );
    println!(
        "| peak successful agent LISTs per second; peak agent requests per second | {}; {} |",
        r.peak_lists_per_s, r.peak_agent_rps
    );
    println!(
        "| 429s, agents (everyone) | {} ({}) |",
        r.agent_429, r.status_429
    );
    println!(
        "| requests that waited in an APF queue | {} |",
        r.apf_queued
    );
    println!(
        "| CPU: emulator / agents | {} / {} |",
        secs(r.cpu.emulator),
        secs(r.cpu.agents())
    );
    if let Some(u) = u {
        println!(
            "| baseline: unfiltered watchers listing again, × {n} (computed from one initial sync: {} requests, {} bytes) | {} requests, {} bytes ({:.0}×) |",
            u.sync.requests,
            u.sync.bytes,
            u.sync.requests * n as u64,
            u.sync.bytes * n as u64,
            (u.sync.bytes * n as u64) as f64 / r.agent_traffic.bytes.max(1) as f64
        );
    }
    println!();
    println!("Agent requests by kind and status:");
    println!();
    println!("| request | count |");
    println!("|---|---|");
    for (k, v) in &r.by_kind {
        println!("| {k} | {v} |");
    }
    println!();
}
