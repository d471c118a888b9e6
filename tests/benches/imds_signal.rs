//! AWS Spot interruption notice (IMDS `spot/instance-action`) → every Ready server on the
//! node released (deleting), with the agent's default 1 s IMDS poll, as in production.
//!
//! Each round: a node with 8 Ready servers and one Allocated, a real in-process agent polling
//! the IMDS emulator over real HTTP (IMDSv2 tokens through aws-config's client), the notice
//! set at a random phase of the poll. The clock stops when every Ready server on the node
//! carries a deletionTimestamp in the store. The same-run baseline is the poll itself: the
//! moment a plain IMDSv2 client polling every 1 s (from a random phase) first reads the
//! notice, before doing any work.
//!
//! `cargo bench -p lastcall-testkit --bench imds_signal`

use std::time::{Duration, Instant};

use lastcall_testkit::agent::{InProcessAgent, config};
use lastcall_testkit::bench::{ms, percentile};
use lastcall_testkit::cluster::{
    AllocationRequest, Cluster, ClusterConfig, FleetSpec, GameServerState as S, NodeSpec,
};
use lastcall_testkit::eventually::eventually;
use lastcall_testkit::imds::ImdsEmulator;

const ROUNDS: usize = 20;
const READY: usize = 8;
const POLL: Duration = Duration::from_secs(1);

async fn poll_once(http: &reqwest::Client, url: &str) -> Option<bool> {
    let token = http
        .put(format!("{url}/latest/api/token"))
        .header("X-aws-ec2-metadata-token-ttl-seconds", "21600")
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    let r = http
        .get(format!("{url}/latest/meta-data/spot/instance-action"))
        .header("X-aws-ec2-metadata-token", token)
        .send()
        .await
        .ok()?;
    Some(r.status().is_success())
}

async fn round(i: usize) -> anyhow::Result<(Duration, Duration)> {
    let cluster = Cluster::start(ClusterConfig::default()).await?;
    cluster.add_node(NodeSpec::new("n1"))?;
    cluster.create_fleet(FleetSpec::new("fleet", (READY + 1) as i64).grace_seconds(0))?;
    cluster.wait_ready("default", "fleet", READY + 1).await?;
    cluster
        .allocate(&AllocationRequest::fleet("default", "fleet"))
        .await?;
    cluster.add_node(NodeSpec::new("n2"))?;
    let imds = ImdsEmulator::start("i-0123456789abcdef0", "ip-10-0-0-1.ec2.internal").await?;
    let url = imds.url();
    let cfg = cluster.emulator().config_for("agent-n1").await?;
    let agent = InProcessAgent::start(
        config("n1", &["--aws-imds", "--imds-endpoint", &url]),
        cfg,
        None,
    )
    .await?;
    // The agent has polled (and claimed its servers) before the notice.
    eventually(
        "claimed and polling",
        Duration::from_secs(20),
        Duration::from_millis(10),
        || async {
            let claimed = cluster
                .game_servers()
                .iter()
                .all(|g| g.labels.get("lastcall.dev/node").map(String::as_str) == Some("n1"));
            (claimed && imds.requests().len() >= 2).then_some(())
        },
    )
    .await;
    let http = reqwest::Client::new();
    let phase = Duration::from_millis(((i * 7919) % 1000) as u64);
    let poller = {
        let (http, url) = (http.clone(), url.clone());
        tokio::spawn(async move {
            tokio::time::sleep(phase).await;
            loop {
                if poll_once(&http, &url).await == Some(true) {
                    return Instant::now();
                }
                tokio::time::sleep(POLL).await;
            }
        })
    };
    // A random point in the agent's poll cycle, too.
    tokio::time::sleep(Duration::from_millis(((i * 3571) % 1000) as u64)).await;
    let notice = Instant::now();
    imds.set_spot_action(Some(serde_json::json!({
        "action": "terminate",
        "time": "2030-01-01T00:02:00Z"
    })));
    let released = eventually(
        "every Ready server released",
        Duration::from_secs(30),
        Duration::from_micros(500),
        || async {
            let ready_left = cluster
                .game_servers()
                .iter()
                .filter(|g| g.node.as_deref() == Some("n1"))
                .filter(|g| g.state == Some(S::Ready) && !g.deleting)
                .count();
            (ready_left == 0).then(Instant::now)
        },
    )
    .await;
    let polled = poller.await?;
    agent.stop().await?;
    cluster.shutdown().await;
    Ok((released - notice, polled.saturating_duration_since(notice)))
}

fn main() -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut released = vec![];
        let mut polled = vec![];
        for i in 0..ROUNDS {
            let (r, p) = round(i).await?;
            released.push(r);
            polled.push(p);
        }
        let (r50, r99) = (percentile(&mut released, 0.5), percentile(&mut released, 0.99));
        let (p50, p99) = (percentile(&mut polled, 0.5), percentile(&mut polled, 0.99));
        println!("IMDS Spot instance-action → every Ready server released, {ROUNDS} rounds, {READY} Ready + 1 Allocated");
        println!("| measure | p50 | p99 |");
        println!("|---|---|---|");
        println!(
            "| lastcall (1 s IMDS poll): notice → all {READY} Ready servers deleting | {} | {} |",
            ms(r50, 1),
            ms(r99, 1)
        );
        println!(
            "| baseline, a bare 1 s IMDSv2 poller: notice → notice read (before any work) | {} | {} |",
            ms(p50, 1),
            ms(p99, 1)
        );
        println!(
            "| lastcall's work after the read, p50 (difference) | {} | |",
            ms(r50.saturating_sub(p50), 1)
        );
        anyhow::Ok(())
    })
}
