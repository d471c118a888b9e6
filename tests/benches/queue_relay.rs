//! Queue mode, measured against a bare receive-and-delete loop on the same moto server in the
//! same run (moto's SQS and EventBridge are the slow part of this machine, not AWS's; the
//! ratio is the figure).
//!
//! 1. **Event put → node fenced**, p50/p99 over `ROUNDS` Spot warnings, each for its own
//!    node with its own in-process agent (built as the binary), pubsub's queue mode
//!    in-process. Baseline: the same warnings put through the same rule, read and deleted by
//!    a bare loop (one receiver, the same long poll).
//! 2. **A burst of Spot warnings** (`LASTCALL_QUEUE_BURST`, default 5,000: an Availability
//!    Zone reclaimed) for as many Nodes:
//!    put through EventBridge, then the real `lastcall-pubsub` binary (queue mode alone, no
//!    Redis) relays every one onto its Node; the clock stops when it has deleted the last
//!    message. 5,000 agents cannot run on this machine: what is measured is every event
//!    relayed (on its Node, where each agent reads it from its own watch), not every node
//!    fenced. pubsub's resident memory (`/proc/<pid>/status` `VmRSS`) is sampled every 50 ms
//!    through it. Baseline: the same burst read and deleted by a bare loop with the same
//!    number of receivers.
//!
//! `cargo bench -p lastcall-testkit --bench queue_relay` (add `--profile dev` to reuse a
//! debug build: the figures in docs/benchmarks.md say which).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lastcall_testkit::agent::{InProcessAgent, config, test_credentials};
use lastcall_testkit::bench::{ms, percentile};
use lastcall_testkit::bins::workspace_binary;
use lastcall_testkit::cluster::{Cluster, ClusterConfig, NodeSpec};
use lastcall_testkit::eventually::eventually;
use lastcall_testkit::queue::{
    PUBSUB, QueueRig, REGION, RunningRelay, relay_args, set_provider_id,
};
use serde_json::json;

const ROUNDS: usize = 10;
/// The burst's size: `LASTCALL_QUEUE_BURST` (default 5,000, an Availability Zone's worth).
fn burst_size() -> usize {
    std::env::var("LASTCALL_QUEUE_BURST")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5_000)
}
const RECEIVERS: usize = 4;

fn iid(i: usize) -> String {
    format!("i-{i:017x}")
}

/// Receives and deletes until `n` messages are gone; the instant each was deleted.
async fn bare_loop(sqs: aws_sdk_sqs::Client, url: String, n: u64, done: Arc<AtomicU64>) {
    while done.load(Ordering::SeqCst) < n {
        let Ok(out) = sqs
            .receive_message()
            .queue_url(&url)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .visibility_timeout(30)
            .send()
            .await
        else {
            continue;
        };
        for m in out.messages.unwrap_or_default() {
            if let Some(r) = m.receipt_handle()
                && sqs
                    .delete_message()
                    .queue_url(&url)
                    .receipt_handle(r)
                    .send()
                    .await
                    .is_ok()
            {
                done.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
}

async fn sqs(rig: &QueueRig) -> aws_sdk_sqs::Client {
    lastcall_pubsub::queue::sqs_client(
        Some(REGION),
        Some(&rig.moto.url()),
        Duration::from_secs(1),
        Some(test_credentials()),
    )
    .await
}

async fn put_burst(rig: &QueueRig, from: usize, n: usize) {
    let entries: Vec<serde_json::Value> = (from..from + n)
        .map(|i| {
            json!({
                "Source": "aws.ec2",
                "DetailType": "EC2 Spot Instance Interruption Warning",
                "Detail": json!({"instance-id": iid(i), "instance-action": "terminate"}).to_string(),
                "Resources": [format!("arn:aws:ec2:{REGION}:123456789012:instance/{}", iid(i))],
            })
        })
        .collect();
    let calls = entries
        .chunks(10)
        .map(|c| rig.moto.call("AWSEvents.PutEvents", json!({"Entries": c})));
    // One at a time: moto is one Python process, and slows as its queue fills.
    let results: Vec<anyhow::Result<serde_json::Value>> = futures::stream::iter(calls)
        .buffer_unordered(4)
        .collect()
        .await;
    for r in results {
        r.expect("PutEvents");
    }
}

async fn latency() -> anyhow::Result<()> {
    let cluster = Cluster::start(ClusterConfig::default()).await?;
    let admin = cluster.emulator().config_for("admin").await?;
    for i in 0..ROUNDS {
        cluster.add_node(NodeSpec::new(format!("n{i}")))?;
        set_provider_id(&admin, &format!("n{i}"), &iid(i)).await;
    }
    let rig = QueueRig::start().await?;

    // Baseline: put → received and deleted by a bare loop.
    let client = sqs(&rig).await;
    let mut base = vec![];
    for i in 0..ROUNDS {
        let done = Arc::new(AtomicU64::new(0));
        let t0 = Instant::now();
        rig.spot(&iid(1000 + i), "terminate").await;
        bare_loop(client.clone(), rig.queue_url.clone(), 1, done).await;
        base.push(t0.elapsed());
    }

    let relay = RunningRelay::start(
        &relay_args(&rig),
        cluster.emulator().config_for(PUBSUB).await?,
    )
    .await?;
    let mut agents = vec![];
    for i in 0..ROUNDS {
        let kube = cluster
            .emulator()
            .config_for(&format!("agent-n{i}"))
            .await?;
        agents.push(
            InProcessAgent::start(config(&format!("n{i}"), &["--aws-queue"]), kube, None).await?,
        );
    }
    // Every agent has its Node cached (its source reports).
    for a in &agents {
        eventually(
            "the agent's queue source is up",
            Duration::from_secs(30),
            Duration::from_millis(20),
            || async {
                a.metrics()
                    .await
                    .contains("lastcall_source_up{source=\"aws_queue\"} 1")
                    .then_some(())
            },
        )
        .await;
    }
    let mut fenced = vec![];
    for i in 0..ROUNDS {
        let node = format!("n{i}");
        let t0 = Instant::now();
        rig.spot(&iid(i), "terminate").await;
        eventually(
            "the node fenced",
            Duration::from_secs(30),
            Duration::from_millis(5),
            || async { (cluster.node(&node)?["spec"]["unschedulable"] == true).then_some(()) },
        )
        .await;
        fenced.push(t0.elapsed());
    }
    let (b50, b99) = (percentile(&mut base, 0.5), percentile(&mut base, 0.99));
    let (f50, f99) = (percentile(&mut fenced, 0.5), percentile(&mut fenced, 0.99));
    println!("event put → node fenced, {ROUNDS} Spot warnings, one node and agent each");
    println!(
        "  baseline (put → a bare loop received and deleted it): p50 {}, p99 {}",
        ms(b50, 0),
        ms(b99, 0)
    );
    println!(
        "  queue mode (put → relayed onto the Node → the agent fenced it): p50 {} ({:.2}×), p99 {} ({:.2}×)",
        ms(f50, 0),
        f50.as_secs_f64() / b50.as_secs_f64(),
        ms(f99, 0),
        f99.as_secs_f64() / b99.as_secs_f64()
    );
    for a in agents {
        a.stop().await?;
    }
    relay.stop().await;
    Ok(())
}

fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

async fn scrape(port: u16) -> String {
    match reqwest::get(format!("http://127.0.0.1:{port}/metrics")).await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

async fn burst() -> anyhow::Result<()> {
    let burst = burst_size();
    let cluster = Cluster::start(ClusterConfig::default()).await?;
    let admin = kube::Client::try_from(cluster.emulator().config_for("admin").await?)?;
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(admin);
    for i in 0..burst {
        cluster.add_node(NodeSpec::new(format!("z{i}")))?;
    }
    let sets = (0..burst).map(|i| {
        let nodes = nodes.clone();
        async move {
            nodes
                .patch(
                    &format!("z{i}"),
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(json!({"spec": {"providerID": lastcall_testkit::queue::provider_id(&iid(i))}})),
                )
                .await
                .expect("providerID");
        }
    });
    futures::stream::iter(sets)
        .buffer_unordered(16)
        .collect::<Vec<()>>()
        .await;
    let rig = QueueRig::start().await?;

    // Baseline: the burst read and deleted by RECEIVERS bare loops.
    let client = sqs(&rig).await;
    put_burst(&rig, 100_000, burst).await;
    let done = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    futures::future::join_all((0..RECEIVERS).map(|_| {
        bare_loop(
            client.clone(),
            rig.queue_url.clone(),
            burst as u64,
            done.clone(),
        )
    }))
    .await;
    let base = t0.elapsed();

    // The real binary, queue mode alone.
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    cluster.emulator().write_kubeconfig(&kubeconfig, PUBSUB)?;
    let port = lastcall_testkit::net::free_port();
    let bin =
        tokio::task::spawn_blocking(|| workspace_binary("lastcall-pubsub", "lastcall-pubsub"))
            .await?;
    let mut child = tokio::process::Command::new(bin)
        .env_clear()
        .env("HOME", dir.path())
        .env("AWS_ACCESS_KEY_ID", "AKIDBENCH")
        .env("AWS_SECRET_ACCESS_KEY", "bench-secret")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env("KUBECONFIG", &kubeconfig)
        .args([
            "--queue-url",
            &rig.queue_url,
            "--sqs-endpoint",
            &rig.moto.url(),
        ])
        .args(["--aws-region", REGION, "--queue-wait", "1s"])
        .args(["--queue-receivers", &RECEIVERS.to_string()])
        .args([
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--log-level",
            "warn",
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let pid = child.id().unwrap_or_default();
    eventually(
        "pubsub listed every Node",
        Duration::from_secs(120),
        Duration::from_millis(100),
        || async {
            (value(&scrape(port).await, "lastcall_pubsub_queue_nodes ") as usize == burst)
                .then_some(())
        },
    )
    .await;
    let idle = rss_kib(pid).unwrap_or_default();
    let peak = Arc::new(AtomicU64::new(idle));
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let (peak, sampling) = (peak.clone(), sampling.clone());
        tokio::spawn(async move {
            while sampling.load(Ordering::SeqCst) {
                if let Some(r) = rss_kib(pid) {
                    peak.fetch_max(r, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    put_burst(&rig, 0, burst).await;
    let t0 = Instant::now();
    eventually(
        "every event relayed and deleted",
        Duration::from_secs(900),
        Duration::from_millis(200),
        || async {
            let text = scrape(port).await;
            (value(
                &text,
                "lastcall_pubsub_queue_messages_deleted_total{reason=\"relayed\"} ",
            ) as usize
                >= burst)
                .then_some(())
        },
    )
    .await;
    let relayed = t0.elapsed();
    sampling.store(false, Ordering::SeqCst);
    let _ = sampler.await;
    let after = rss_kib(pid).unwrap_or_default();
    let _ = child.start_kill();
    // Every Node holds its own event.
    let missing = (0..burst)
        .filter(|i| {
            cluster.node(&format!("z{i}")).and_then(|n| {
                n["metadata"]["annotations"]["lastcall.dev/aws-events"]
                    .as_str()
                    .map(|s| s.contains(&iid(*i)))
            }) != Some(true)
        })
        .count();
    println!("a burst of {burst} Spot warnings for {burst} Nodes ({RECEIVERS} receivers)");
    println!(
        "  baseline (a bare loop receives and deletes them): {}",
        ms(base, 0)
    );
    println!(
        "  queue mode (the real lastcall-pubsub relays each onto its Node, then deletes it): {} ({:.2}×); Nodes without their event: {missing}",
        ms(relayed, 0),
        relayed.as_secs_f64() / base.as_secs_f64()
    );
    println!(
        "  pubsub RSS: {:.1} MiB with {burst} Nodes listed, peak {:.1} MiB through the burst ({:.2}×), {:.1} MiB after",
        idle as f64 / 1024.0,
        peak.load(Ordering::SeqCst) as f64 / 1024.0,
        peak.load(Ordering::SeqCst) as f64 / idle.max(1) as f64,
        after as f64 / 1024.0
    );
    Ok(())
}

use futures::StreamExt;

fn main() -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        // `LASTCALL_QUEUE_BENCH=burst` runs the burst alone.
        if std::env::var("LASTCALL_QUEUE_BENCH").as_deref() != Ok("burst") {
            latency().await?;
        }
        burst().await
    })
}
