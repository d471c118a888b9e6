//! GCE maintenance signal → fence, with lastcall's hanging GET, next to a client that polls
//! the same key every 2 s (the AWS node-termination-handler's interval), in the same run.
//!
//! Each round: a node with Ready servers and a real agent watching the GCE metadata
//! emulator; the emulator's `maintenance-event` turns `TERMINATE_ON_HOST_MAINTENANCE`; the
//! clock stops when the `lastcall.dev/draining` taint is in the store. The baseline polls the
//! emulator every 2 s (from a random phase) and stops when it reads the new value: what a
//! poller would learn at best, before doing any work.
//!
//! `cargo bench -p lastcall-testkit --bench gce_signal`

use std::time::{Duration, Instant};

use lastcall_testkit::agent::{InProcessAgent, config};
use lastcall_testkit::bench::{ms, percentile};
use lastcall_testkit::cluster::{Cluster, ClusterConfig, FleetSpec, NodeSpec};
use lastcall_testkit::eventually::eventually;
use lastcall_testkit::gce::GceMetadataEmulator;

const ROUNDS: usize = 20;
const POLL: Duration = Duration::from_secs(2);

async fn round(i: usize) -> anyhow::Result<(Duration, Duration)> {
    let cluster = Cluster::start(ClusterConfig::default()).await?;
    cluster.add_node(NodeSpec::new("n1"))?;
    cluster.create_fleet(FleetSpec::new("fleet", 2).grace_seconds(0))?;
    cluster.wait_ready("default", "fleet", 2).await?;
    let gce = GceMetadataEmulator::start().await?;
    let url = gce.url();
    let cfg = cluster.emulator().config_for("agent-n1").await?;
    let agent = InProcessAgent::start(
        config(
            "n1",
            &[
                "--gce-metadata",
                "--gce-metadata-endpoint",
                &url,
                "--resync-interval",
                "1s",
            ],
        ),
        cfg,
        None,
    )
    .await?;
    // Let both hanging GETs be in place.
    eventually(
        "hanging GETs",
        Duration::from_secs(20),
        Duration::from_millis(5),
        || async { (gce.requests().iter().filter(|(_, _, w)| *w).count() >= 2).then_some(()) },
    )
    .await;
    // The baseline poller, started at a random phase of its period.
    let http = reqwest::Client::new();
    let key = format!("{url}/computeMetadata/v1/instance/maintenance-event");
    let phase = Duration::from_millis(((i * 7919) % 2000) as u64);
    let t0 = Instant::now() + Duration::from_millis(300);
    let poller = {
        let http = http.clone();
        let key = key.clone();
        tokio::spawn(async move {
            tokio::time::sleep(phase).await;
            loop {
                let body = http
                    .get(&key)
                    .header("Metadata-Flavor", "Google")
                    .send()
                    .await
                    .ok()?
                    .text()
                    .await
                    .ok()?;
                if body.starts_with("TERMINATE") {
                    return Some(Instant::now());
                }
                tokio::time::sleep(POLL).await;
            }
        })
    };
    tokio::time::sleep_until(t0.into()).await;
    let changed = Instant::now();
    gce.set("maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE");
    let fenced = eventually(
        "fenced",
        Duration::from_secs(20),
        Duration::from_micros(500),
        || async {
            cluster
                .node("n1")
                .and_then(|n| {
                    n.pointer("/spec/taints")?
                        .as_array()?
                        .iter()
                        .any(|t| t["key"] == "lastcall.dev/draining")
                        .then_some(())
                })
                .map(|()| Instant::now())
        },
    )
    .await;
    let polled = poller.await?.unwrap_or_else(Instant::now);
    agent.stop().await?;
    cluster.shutdown().await;
    Ok((fenced - changed, polled.saturating_duration_since(changed)))
}

fn main() -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut hanging = vec![];
        let mut polled = vec![];
        for i in 0..ROUNDS {
            let (h, p) = round(i).await?;
            hanging.push(h);
            polled.push(p);
        }
        let (h50, h99) = (
            percentile(&mut hanging, 0.5),
            percentile(&mut hanging, 0.99),
        );
        let (p50, p99) = (percentile(&mut polled, 0.5), percentile(&mut polled, 0.99));
        println!("GCE maintenance-event → fence, {ROUNDS} rounds");
        println!("| measure | p50 | p99 |");
        println!("|---|---|---|");
        println!(
            "| lastcall, hanging GET: change → taint in the store | {} | {} |",
            ms(h50, 1),
            ms(h99, 1)
        );
        println!(
            "| baseline, 2 s poll: change → value read (before any work) | {} | {} |",
            ms(p50, 1),
            ms(p99, 1)
        );
        println!(
            "| ratio poll / hanging GET | {:.0}x | {:.0}x |",
            p50.as_secs_f64() / h50.as_secs_f64().max(1e-6),
            p99.as_secs_f64() / h99.as_secs_f64().max(1e-6)
        );
        anyhow::Ok(())
    })
}
