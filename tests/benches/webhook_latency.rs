//! FleetAutoscaler webhook latency under load: 1,000 reviews per second for 10 s on
//! loopback, open loop, against the production server with drain state in a real
//! `redis-server` (one `HGETALL` per answer). Baseline in the same run: an axum handler
//! returning a constant body, under the same load from the same client.
//!
//! Run: `cargo bench -p lastcall-testkit --bench webhook_latency`
//! (`LASTCALL_BENCH_SECS` changes the 10 s.)
//!
//! Open loop: request i is sent at `start + i ms` whether or not earlier ones have been
//! answered (each on its own task), so a slow answer never delays the next request and a
//! stall shows up in the figures of every request it overlaps instead of silently lowering
//! the rate. Latency runs from the send to the last byte of the answer. The generator's own
//! lag (send − due; tokio's timer has a 1 ms grain) is reported apart, to show the schedule
//! was kept.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::routing::post;
use lastcall_common::drain_state::{self, FleetOnNode, NodeDrainState};
use lastcall_pubsub::webhook::review::parse_response;
use lastcall_testkit::redis::{RedisServer, generate_tls};
use lastcall_testkit::webhook::{FleetStatus, WebhookServer, agones_review};
use tokio::time::Instant;

const RATE: u64 = 1_000;
const TARGET_P99: Duration = Duration::from_millis(5);
/// Draining nodes in Redis, each with Ready servers of every Fleet.
const DRAINING_NODES: usize = 20;
const FLEETS: usize = 10;

fn main() -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(bench())
}

fn fleet(i: usize) -> String {
    format!("game-{i:02}")
}

/// Latencies of one run, sorted.
struct Run {
    name: &'static str,
    latencies: Vec<Duration>,
    /// Send − due, sorted.
    lags: Vec<Duration>,
    errors: usize,
    wall: Duration,
}

/// Nearest-rank percentile of sorted `v`.
fn pct(v: &[Duration], p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((v.len() as f64) * p / 100.0).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

impl Run {
    fn pct(&self, p: f64) -> Duration {
        pct(&self.latencies, p)
    }

    fn row(&self) -> String {
        let ms = |d: Duration| format!("{:.3}", d.as_secs_f64() * 1000.0);
        format!(
            "| {} | {} | {:.0} | {} | {} | {} | {} | {} | {} | {} / {} |",
            self.name,
            self.latencies.len(),
            self.latencies.len() as f64 / self.wall.as_secs_f64(),
            ms(self.pct(50.0)),
            ms(self.pct(90.0)),
            ms(self.pct(99.0)),
            ms(self.pct(99.9)),
            ms(self.latencies.last().copied().unwrap_or_default()),
            self.errors,
            ms(pct(&self.lags, 50.0)),
            ms(pct(&self.lags, 99.0)),
        )
    }
}

/// Sends `RATE` requests per second for `secs`, open loop; `check` validates each answer.
async fn load(
    name: &'static str,
    client: &reqwest::Client,
    url: &str,
    secs: u64,
    bodies: &[String],
    check: fn(u16, &[u8]) -> bool,
) -> Run {
    let n = (RATE * secs) as usize;
    let period = Duration::from_nanos(1_000_000_000 / RATE);
    let start = Instant::now() + Duration::from_millis(20);
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let due = start + period * i as u32;
        tokio::time::sleep_until(due).await;
        let (client, url, body) = (
            client.clone(),
            url.to_string(),
            bodies[i % bodies.len()].clone(),
        );
        tasks.push(tokio::spawn(async move {
            let sent = Instant::now();
            let ok = match client.post(&url).body(body).send().await {
                Ok(r) => {
                    let status = r.status().as_u16();
                    match r.bytes().await {
                        Ok(b) => check(status, &b),
                        Err(_) => false,
                    }
                }
                Err(_) => false,
            };
            (
                Instant::now().saturating_duration_since(sent),
                sent.saturating_duration_since(due),
                ok,
            )
        }));
    }
    let mut latencies = Vec::with_capacity(n);
    let mut lags = Vec::with_capacity(n);
    let mut errors = 0;
    for t in tasks {
        match t.await {
            Ok((d, lag, true)) => {
                latencies.push(d);
                lags.push(lag);
            }
            _ => errors += 1,
        }
    }
    let wall = Instant::now().saturating_duration_since(start);
    latencies.sort();
    lags.sort();
    Run {
        name,
        latencies,
        lags,
        errors,
        wall,
    }
}

fn webhook_ok(status: u16, body: &[u8]) -> bool {
    status == 200 && parse_response(body).is_some_and(|(_, _, replicas)| replicas > 0)
}

fn baseline_ok(status: u16, _body: &[u8]) -> bool {
    status == 200
}

async fn bench() -> anyhow::Result<()> {
    let secs: u64 = std::env::var("LASTCALL_BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let redis = RedisServer::start().await?;
    let mut conn = redis.client().await?;
    let now = drain_state::unix_ms(SystemTime::now());
    for node in 0..DRAINING_NODES {
        let state = NodeDrainState {
            node: format!("gke-pool-{node:03}"),
            // Fresh for the whole run (max age 2 min).
            updated_at_ms: now,
            counted_at_ms: None,
            truncated: false,
            fleets: (0..FLEETS)
                .map(|f| FleetOnNode {
                    namespace: "default".into(),
                    name: fleet(f),
                    ready: 1,
                    allocated: 2,
                    held: None,
                    at_risk: None,
                })
                .collect(),
        };
        drain_state::publish(&mut conn, &state).await?;
    }
    let hook = WebhookServer::start(
        &redis.host_port(),
        &["--webhook-max-replicas", "10000"],
        None,
    )
    .await?;
    let dir = tempfile::tempdir()?;
    let tls = generate_tls(dir.path(), "bench").await?;
    let hook_tls = WebhookServer::start(
        &redis.host_port(),
        &["--webhook-max-replicas", "10000"],
        Some(&tls),
    )
    .await?;

    // The baseline: the same router stack and listener, a constant answer.
    const CONSTANT: &str = r#"{"response":{"uid":"x","scale":false,"replicas":1}}"#;
    let baseline = Router::new().route("/scale", post(|| async { CONSTANT }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let baseline_url = format!("http://{}/scale", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, baseline).await });

    let bodies: Arc<Vec<String>> = Arc::new(
        (0..FLEETS * 10)
            .map(|i| {
                let status = FleetStatus {
                    replicas: 40,
                    ready: 10,
                    reserved: 0,
                    allocated: 30 + (i % 7) as i64,
                };
                agones_review(
                    &format!("bench-{i}"),
                    "default",
                    &fleet(i % FLEETS),
                    status,
                    &[],
                )
            })
            .collect(),
    );
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(15))
        .build()?;
    let ca = reqwest::Certificate::from_pem(&std::fs::read(&tls.ca_pem)?)?;
    let tls_client = reqwest::Client::builder()
        .tls_certs_only([ca])
        .timeout(Duration::from_secs(15))
        .build()?;

    // Sanity: every Fleet gets its 20 Ready on draining nodes on top of the buffer.
    let r = client
        .post(hook.url())
        .body(bodies[0].clone())
        .send()
        .await?;
    let (_, _, replicas) =
        parse_response(&r.bytes().await?).ok_or_else(|| anyhow::anyhow!("no response"))?;
    anyhow::ensure!(
        replicas == 30 + 5 + DRAINING_NODES as i64,
        "answer {replicas}"
    );

    // Warm-up: connections, TLS sessions, allocator.
    load("warm-up", &client, &baseline_url, 1, &bodies, baseline_ok).await;
    load("warm-up", &client, &hook.url(), 1, &bodies, webhook_ok).await;
    load(
        "warm-up",
        &tls_client,
        &hook_tls.url(),
        1,
        &bodies,
        webhook_ok,
    )
    .await;

    let base = load(
        "baseline: axum, constant body (HTTP)",
        &client,
        &baseline_url,
        secs,
        &bodies,
        baseline_ok,
    )
    .await;
    let plain = load(
        "webhook (HTTP)",
        &client,
        &hook.url(),
        secs,
        &bodies,
        webhook_ok,
    )
    .await;
    let https = load(
        "webhook (HTTPS)",
        &tls_client,
        &hook_tls.url(),
        secs,
        &bodies,
        webhook_ok,
    )
    .await;

    let server_count = lastcall_testkit::agent::metric_sum(
        &hook.metrics_text(),
        "lastcall_pubsub_webhook_drain_state_reads_total",
        &[("result", "ok")],
    );
    println!("webhook latency, {RATE} requests/s for {secs} s per run, open loop, loopback");
    println!(
        "{DRAINING_NODES} draining nodes × {FLEETS} Fleets in Redis; one HGETALL per answer ({server_count} reads on the HTTP webhook)"
    );
    println!();
    println!(
        "| run | answered | rate /s | p50 ms | p90 ms | p99 ms | p99.9 ms | max ms | errors | send lag p50 / p99 ms |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for r in [&base, &plain, &https] {
        println!("{}", r.row());
    }
    println!();
    for r in [&plain, &https] {
        println!(
            "{}: p50 {:.2}x, p99 {:.2}x the baseline; p99 target < {} ms: {}",
            r.name,
            r.pct(50.0).as_secs_f64() / base.pct(50.0).as_secs_f64(),
            r.pct(99.0).as_secs_f64() / base.pct(99.0).as_secs_f64(),
            TARGET_P99.as_millis(),
            if r.pct(99.0) < TARGET_P99 {
                "met"
            } else {
                "MISSED"
            }
        );
    }
    anyhow::ensure!(
        plain.errors == 0 && https.errors == 0 && base.errors == 0,
        "errors"
    );
    Ok(())
}
