//! Autoscaler cooperation: how fast the pod of a newly allocated game server carries
//! `karpenter.sh/do-not-disrupt: "true"` (allocation → annotation in the store), and how fast
//! it comes off when the game returns the server to Ready, with a real in-process agent
//! (`--autoscaler-cooperation in-use`) against the emulated cluster.
//!
//! Baseline, same run: a bare client's merge patch of one pod annotation, request → in the
//! store: the floor of any write an agent could make.
//!
//! `cargo bench -p lastcall-testkit --bench cooperation`

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{Patch, PatchParams};
use lastcall_testkit::agent::{InProcessAgent, config};
use lastcall_testkit::bench::{ms, percentile};
use lastcall_testkit::cluster::{AllocationRequest, Cluster, ClusterConfig, FleetSpec, NodeSpec};
use lastcall_testkit::eventually::eventually;

const SERVERS: usize = 10;
const ROUNDS: usize = 100;
const DND: &str = "karpenter.sh/do-not-disrupt";

fn dnd(cluster: &Cluster, name: &str) -> Option<bool> {
    let p = cluster.pod("default", name)?;
    Some(
        p.pointer(&format!("/metadata/annotations/{}", DND.replace('/', "~1")))
            == Some(&serde_json::json!("true")),
    )
}

async fn until(cluster: &Cluster, name: &str, want: bool) -> Instant {
    eventually(
        "annotation",
        Duration::from_secs(10),
        Duration::from_micros(200),
        || async { (dnd(cluster, name) == Some(want)).then(Instant::now) },
    )
    .await
}

fn main() -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let cluster = Cluster::start(ClusterConfig::default()).await?;
        cluster.add_node(NodeSpec::new("n1"))?;
        cluster.create_fleet(FleetSpec::new("fleet", SERVERS as i64).grace_seconds(0))?;
        cluster.wait_ready("default", "fleet", SERVERS).await?;
        let kube = cluster.emulator().config_for("agent-n1").await?;
        let agent = InProcessAgent::start(
            config("n1", &["--autoscaler-cooperation", "in-use"]),
            kube,
            None,
        )
        .await?;
        for g in cluster.game_servers() {
            until(&cluster, &g.name, false).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut on = vec![];
        let mut off = vec![];
        for _ in 0..ROUNDS {
            let t0 = Instant::now();
            let gs = cluster
                .allocate(&AllocationRequest::fleet("default", "fleet"))
                .await?
                .ok_or_else(|| anyhow::anyhow!("no Ready server"))?;
            on.push(until(&cluster, &gs.name, true).await - t0);
            let t1 = Instant::now();
            cluster.sdk_ready("default", &gs.name)?;
            off.push(until(&cluster, &gs.name, false).await - t1);
        }
        agent.stop().await?;

        // Baseline: one bare merge patch of a pod annotation, request → store.
        let client = cluster.emulator().client_as("bare").await?;
        let pods: Api<Pod> = Api::namespaced(client, "default");
        let name = cluster.game_servers()[0].name.clone();
        let mut bare = vec![];
        for i in 0..ROUNDS {
            let v = if i % 2 == 0 { "true" } else { "false" };
            let t0 = Instant::now();
            pods.patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(&serde_json::json!({"metadata": {"annotations": {DND: v}}})),
            )
            .await?;
            until(&cluster, &name, v == "true").await;
            bare.push(t0.elapsed());
        }
        let (on50, on99) = (percentile(&mut on, 0.5), percentile(&mut on, 0.99));
        let (off50, off99) = (percentile(&mut off, 0.5), percentile(&mut off, 0.99));
        let (b50, b99) = (percentile(&mut bare, 0.5), percentile(&mut bare, 0.99));
        println!("Autoscaler cooperation, {ROUNDS} allocations and returns on a node of {SERVERS} servers");
        println!("| measure | p50 | p99 |");
        println!("|---|---|---|");
        println!("| allocation answered → `do-not-disrupt: \"true\"` on its pod | {} | {} |", ms(on50, 2), ms(on99, 2));
        println!("| SDK `Ready()` (back to the pool) → `do-not-disrupt` removed | {} | {} |", ms(off50, 2), ms(off99, 2));
        println!("| baseline: a bare client's annotation patch, request → store | {} | {} |", ms(b50, 2), ms(b99, 2));
        println!(
            "| ratio allocation → annotation / bare patch | {:.1}x | {:.1}x |",
            on50.as_secs_f64() / b50.as_secs_f64().max(1e-9),
            on99.as_secs_f64() / b99.as_secs_f64().max(1e-9)
        );
        cluster.shutdown().await;
        anyhow::Ok(())
    })
}
