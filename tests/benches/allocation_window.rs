//! How long a draining node can still take a match, with and without the allocation
//! selector that excludes `lastcall.dev/node-draining=true`, measured in the same run.
//!
//! Each interleaving: a node with Ready servers of one Fleet, a real agent, an allocator
//! looping over that node's Ready servers (list, then update with the resourceVersion, as
//! Agones' allocator does), and the manual drain label. Allocations that succeed after the
//! fence took effect are found by the emulator's journal; their delay is measured from the
//! moment the drain signal was accepted.
//!
//! `cargo bench -p lastcall-testkit --bench allocation_window`

use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};
use lastcall_testkit::agent::{InProcessAgent, config};
use lastcall_testkit::cluster::allocator::allocate;
use lastcall_testkit::cluster::{AllocationRequest, Cluster, ClusterConfig, FleetSpec, NodeSpec};
use lastcall_testkit::eventually::eventually;
use lastcall_testkit::kube::faults::{FaultRule, Method};
use lastcall_testkit::kube::journal::Verb;

const NS: &str = "default";
const RUNS: u64 = 100;
const SERVERS: usize = 8;
const AT_ONCE: usize = 4;

struct Run {
    /// Delays (signal accepted → allocation answered) of allocations after the fence.
    late: Vec<Duration>,
}

async fn run(seed: u64, selector: bool, failing_deletes: bool) -> anyhow::Result<Run> {
    let cluster = Cluster::start(ClusterConfig {
        tick: Duration::from_millis(20),
        ..ClusterConfig::default()
    })
    .await?;
    cluster.add_node(NodeSpec::new("n1"))?;
    cluster.create_fleet(FleetSpec::new("fleet", SERVERS as i64).grace_seconds(0))?;
    cluster.wait_ready(NS, "fleet", SERVERS).await?;
    cluster.add_node(NodeSpec::new("n2"))?;
    if failing_deletes {
        // The API server refuses the first DELETEs (429 or 503 under load).
        cluster.emulator().faults().inject(FaultRule::status(
            Some(Method::DELETE),
            "/gameservers/",
            SERVERS * 2,
            503,
        ));
    }
    let cfg = cluster.emulator().config_for("agent-n1").await?;
    let agent =
        InProcessAgent::start(config("n1", &["--resync-interval", "1s"]), cfg, None).await?;
    eventually(
        "claimed",
        Duration::from_secs(20),
        Duration::from_millis(5),
        || async {
            cluster
                .game_servers()
                .iter()
                .filter(|g| g.node.as_deref() == Some("n1"))
                .all(|g| g.labels.contains_key("lastcall.dev/node"))
                .then_some(())
        },
    )
    .await;
    let client = cluster.client_without_retry("agones-allocator").await?;
    let mut req = AllocationRequest::fleet(NS, "fleet")
        .on_node("n1")
        .max_tries(3);
    if selector {
        req = req.selector("lastcall.dev/node-draining!=true");
    }
    let offset = Duration::from_micros((seed * 7919) % 10_000);
    let signal = async {
        tokio::time::sleep(offset).await;
        Api::<Node>::all(cluster.client())
            .patch(
                "n1",
                &PatchParams::default(),
                &Patch::Merge(
                    &serde_json::json!({"metadata": {"labels": {"lastcall.dev/drain": "true"}}}),
                ),
            )
            .await?;
        anyhow::Ok(Instant::now())
    };
    let allocator = async {
        let mut won = vec![];
        for _ in 0..SERVERS * 2 {
            if let Ok(Some(gs)) = allocate(&client, &req).await {
                won.push((gs.name, Instant::now()));
            }
        }
        won
    };
    let (signalled, won) = tokio::join!(signal, allocator);
    let signalled = signalled?;
    let journal = cluster.emulator().journal().entries();
    let fence = journal
        .iter()
        .find(|r| {
            r.identity.as_deref() == Some("agent-n1")
                && r.verb == Verb::Patch
                && r.resource.as_deref() == Some("nodes")
                && r.status < 300
        })
        .map(|r| r.seq);
    let mut late = vec![];
    if let Some(fence) = fence {
        for (name, at) in won {
            let after = journal.iter().any(|r| {
                r.seq > fence
                    && r.identity.as_deref() == Some("agones-allocator")
                    && r.verb == Verb::Update
                    && r.status < 300
                    && r.name.as_deref() == Some(name.as_str())
            });
            if after {
                late.push(at.saturating_duration_since(signalled));
            }
        }
    }
    agent.stop().await?;
    cluster.shutdown().await;
    Ok(Run { late })
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
            let runs: Vec<anyhow::Result<Run>> = futures::stream::iter(0..RUNS)
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
