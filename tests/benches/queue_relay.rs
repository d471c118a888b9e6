//! Queue mode, measured against a bare receive-and-delete loop on the same moto server in the
//! same run (moto's SQS and EventBridge are the slow part of this machine, not AWS's; the
//! ratio is the figure).
//!
//! 1. **Event put → node fenced**, p50/p99 over `ROUNDS` Spot warnings, each for its own
//!    node with its own in-process agent (built as the binary), pubsub's queue mode
//!    in-process. Baseline: the same warnings put through the same rule, read and deleted by
//!    a bare loop (one receiver, the same long poll).
//! 2. **A burst of Spot warnings** (`LASTCALL_QUEUE_BURST`, default 5,000: an Availability
//!    Zone reclaimed) for as many Nodes, sent straight into the queue in the envelope an
//!    EventBridge rule delivers (`SendMessageBatch`, 10 a call: moto's `PutEvents` takes
//!    seconds a call once thousands are queued, and would measure moto). The real
//!    `lastcall-pubsub` binary (queue mode alone, no Redis) relays each onto its Node; real
//!    agents (`LASTCALL_QUEUE_BURST_AGENTS`, default 100, in this process) run on the first
//!    Nodes. From the first send, by the kube emulator's journal: when each Node carried
//!    its event (all of them), and when each Node with an agent was fenced by it. pubsub's
//!    resident memory (`/proc/<pid>/status` `VmRSS`) is sampled every 50 ms through it.
//!    The queue is ElasticMQ's (`LASTCALL_QUEUE_SERVER=moto` for moto's, whose receives take
//!    seconds once thousands of messages wait). Baseline, same run: as many warnings sent the same way, received and deleted by bare
//!    loops with the same number of receivers, each deletion timed from the first send.
//!
//! `cargo bench -p lastcall-testkit --bench queue_relay` (add `--profile dev` to reuse a
//! debug build: the figures in docs/benchmarks.md say which).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use lastcall_common::aws_events::ANNOTATION;
use lastcall_emulators::elasticmq::ElasticMq;
use lastcall_testkit::agent::{InProcessAgent, config, test_credentials};
use lastcall_testkit::bench::{ms, percentile};
use lastcall_testkit::bins::workspace_binary;
use lastcall_testkit::cluster::preload::node_name;
use lastcall_testkit::cluster::{Cluster, ClusterConfig, NodeSpec};
use lastcall_testkit::eventually::eventually;
use lastcall_testkit::queue::{
    PUBSUB, QueueRig, REGION, RunningRelay, provider_id, relay_args, send_envelopes,
    set_provider_id, spot_envelope,
};
use lastcall_testkit::scale_agents::{SHARD_AGENTS, Shard, ShardSpec, shard_ranges};
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
/// `SendMessageBatch` calls in flight at once while the burst is sent.
const PUTTERS: usize = 4;
/// Real agents in the burst (`LASTCALL_QUEUE_BURST_AGENTS`, default 100): on the first
/// Nodes, in this process, as many as the machine runs beside the rest.
fn burst_agents() -> usize {
    std::env::var("LASTCALL_QUEUE_BURST_AGENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100)
}

fn iid(i: usize) -> String {
    format!("i-{i:017x}")
}

/// Receives and deletes until `n` messages are gone; the instant each was deleted.
async fn bare_loop(
    sqs: aws_sdk_sqs::Client,
    url: String,
    n: u64,
    done: Arc<AtomicU64>,
    deleted: Arc<Mutex<Vec<Instant>>>,
) {
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
                if let Ok(mut d) = deleted.lock() {
                    d.push(Instant::now());
                }
            }
        }
    }
}

async fn sqs(endpoint: &str) -> aws_sdk_sqs::Client {
    lastcall_pubsub::queue::sqs_client(
        Some(REGION),
        Some(endpoint),
        Duration::from_secs(1),
        Some(test_credentials()),
    )
    .await
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
    let client = sqs(&rig.moto.url()).await;
    let mut base = vec![];
    for i in 0..ROUNDS {
        let done = Arc::new(AtomicU64::new(0));
        let t0 = Instant::now();
        rig.spot(&iid(1000 + i), "terminate").await;
        bare_loop(
            client.clone(),
            rig.queue_url.clone(),
            1,
            done,
            Arc::default(),
        )
        .await;
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

/// The SQS server of the burst: ElasticMQ (`LASTCALL_QUEUE_SERVER=elasticmq`, the default),
/// or moto's (`moto`, whose receives take seconds once thousands of messages wait).
enum BurstServer {
    ElasticMq(ElasticMq, String),
    Moto(QueueRig),
}

impl BurstServer {
    async fn start() -> anyhow::Result<Self> {
        Ok(
            if std::env::var("LASTCALL_QUEUE_SERVER").as_deref() == Ok("moto") {
                Self::Moto(QueueRig::start().await?)
            } else {
                let server = ElasticMq::start().await?;
                let url = server.create_queue("lastcall-interruptions").await?;
                Self::ElasticMq(server, url)
            },
        )
    }

    fn name(&self) -> &'static str {
        match self {
            Self::ElasticMq(..) => "ElasticMQ",
            Self::Moto(_) => "moto",
        }
    }

    fn endpoint(&self) -> String {
        match self {
            Self::ElasticMq(s, _) => s.url(),
            Self::Moto(rig) => rig.moto.url(),
        }
    }

    fn queue_url(&self) -> &str {
        match self {
            Self::ElasticMq(_, url) => url,
            Self::Moto(rig) => &rig.queue_url,
        }
    }

    async fn send(&self, envelopes: &[serde_json::Value]) -> anyhow::Result<()> {
        match self {
            Self::ElasticMq(s, url) => {
                send_envelopes(envelopes, PUTTERS, |bodies: Vec<String>| async move {
                    s.send_batch(url, &bodies).await
                })
                .await
            }
            Self::Moto(rig) => rig.send_envelopes(envelopes, PUTTERS).await,
        }
    }
}

/// The first write of `identity` to Node `node` the API server accepted whose answer
/// satisfies `done`: when it took effect, by the emulator's journal.
fn first_write(
    journal: &[lastcall_emulators::kube::journal::JournalEntry],
    identity: &str,
    node: &str,
    done: impl Fn(&serde_json::Value) -> bool,
) -> Option<SystemTime> {
    journal
        .iter()
        .filter(|r| {
            r.identity.as_deref() == Some(identity)
                && r.verb.is_mutating()
                && (200..300).contains(&r.status)
                && r.resource.as_deref() == Some("nodes")
                && r.name.as_deref() == Some(node)
        })
        .find(|r| r.response.as_deref().is_some_and(&done))
        .map(|r| r.at)
}

fn since(t0: SystemTime, at: SystemTime) -> Duration {
    at.duration_since(t0).unwrap_or_default()
}

fn carries(node: &serde_json::Value, instance: &str) -> bool {
    node["metadata"]["annotations"][ANNOTATION]
        .as_str()
        .is_some_and(|s| s.contains(instance))
}

/// p50, p99 and the last of `d`, in that order.
fn spread(d: &mut [Duration]) -> (Duration, Duration, Duration) {
    let last = d.iter().copied().max().unwrap_or_default();
    (percentile(d, 0.5), percentile(d, 0.99), last)
}

fn row(what: &str, d: (Duration, Duration, Duration), base: (Duration, Duration, Duration)) {
    let r = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64().max(1e-9);
    println!(
        "  {what}: p50 {} ({:.2}×), p99 {} ({:.2}×), last {} ({:.2}×)",
        ms(d.0, 0),
        r(d.0, base.0),
        ms(d.1, 0),
        r(d.1, base.1),
        ms(d.2, 0),
        r(d.2, base.2)
    );
}

async fn burst() -> anyhow::Result<()> {
    let burst = burst_size();
    let with_agents = burst_agents().min(burst);
    println!(
        "a burst of {burst} Spot warnings for {burst} Nodes ({RECEIVERS} receivers), {with_agents} of them (every {}th sent) with an agent; load {}",
        burst / with_agents.max(1),
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    let cluster = Cluster::start(ClusterConfig::default()).await?;
    let admin = kube::Client::try_from(cluster.emulator().config_for("admin").await?)?;
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(admin);
    for i in 0..burst {
        cluster.add_node(NodeSpec::new(node_name(i)))?;
    }
    let sets = (0..burst).map(|i| {
        let nodes = nodes.clone();
        async move {
            nodes
                .patch(
                    &node_name(i),
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(json!({"spec": {"providerID": provider_id(&iid(i))}})),
                )
                .await
                .map(|_| ())
        }
    });
    let set: Vec<Result<(), kube::Error>> = futures::stream::iter(sets)
        .buffer_unordered(16)
        .collect()
        .await;
    set.into_iter().collect::<Result<Vec<()>, _>>()?;
    let server = BurstServer::start().await?;

    // Real agents (built as the binary, in this process) on every `stride`-th Node, so their
    // warnings are spread through the burst, each with its Node cached before the clock
    // starts.
    // Real agents (built as the binary) on the first `with_agents` Nodes, each with its Node
    // cached before the clock starts: in `lastcall-scale-agents` shard processes of their
    // own (`LASTCALL_QUEUE_BURST_SHARDS`, the default), or in this process beside the
    // emulator (`LASTCALL_QUEUE_BURST_SHARDS=0`).
    let stride = burst / with_agents.max(1);
    let agent_nodes: Vec<usize> = (0..with_agents).collect();
    let sharded = std::env::var("LASTCALL_QUEUE_BURST_SHARDS").as_deref() != Ok("0");
    let started = Instant::now();
    let mut agents = Vec::new();
    let mut shards = Vec::new();
    let mut admins = Vec::new();
    if sharded {
        for (from, to) in shard_ranges(with_agents, SHARD_AGENTS) {
            let shard = Shard::spawn(&ShardSpec {
                kube_url: cluster.emulator().url(),
                gamelift_url: String::new(),
                redis_url: String::new(),
                from,
                to,
                aws_queue: true,
            })
            .await?;
            admins.extend(shard.admins.iter().map(|(_, a)| *a));
            shards.push(shard);
        }
    } else {
        for &i in &agent_nodes {
            let node = node_name(i);
            let kube = cluster
                .emulator()
                .config_for(&format!("agent-{node}"))
                .await?;
            let agent = InProcessAgent::start(config(&node, &["--aws-queue"]), kube, None).await?;
            admins.push(agent.admin);
            agents.push(agent);
        }
    }
    for a in &admins {
        eventually(
            "the agent's queue source is up",
            Duration::from_secs(300),
            Duration::from_millis(50),
            || async {
                lastcall_testkit::agent::scrape(*a)
                    .await
                    .contains("lastcall_source_up{source=\"aws_queue\"} 1")
                    .then_some(())
            },
        )
        .await;
    }
    println!(
        "  {with_agents} agents up in {} ({})",
        ms(started.elapsed(), 0),
        if sharded {
            format!("{} shard processes", shards.len())
        } else {
            "in this process".into()
        }
    );
    // The send order puts the Nodes with an agent every `stride`-th, spread through the
    // burst.
    let order: Vec<usize> = {
        let mut others = with_agents..burst;
        (0..burst)
            .filter_map(|p| {
                if p % stride.max(1) == 0 && p / stride.max(1) < with_agents {
                    Some(p / stride.max(1))
                } else {
                    others.next()
                }
            })
            .collect()
    };

    // Baseline: the same number of warnings (for instances no Node runs) sent the same way,
    // received and deleted by RECEIVERS bare loops.
    let client = sqs(&server.endpoint()).await;
    let envelopes: Vec<_> = (0..burst)
        .map(|i| spot_envelope(&iid(100_000 + i)))
        .collect();
    let done = Arc::new(AtomicU64::new(0));
    let deleted = Arc::new(Mutex::new(Vec::with_capacity(burst)));
    let loops = futures::future::join_all((0..RECEIVERS).map(|_| {
        bare_loop(
            client.clone(),
            server.queue_url().to_string(),
            burst as u64,
            done.clone(),
            deleted.clone(),
        )
    }));
    let t0 = Instant::now();
    let (sent, _) = tokio::join!(
        async {
            server.send(&envelopes).await?;
            anyhow::Ok(t0.elapsed())
        },
        loops
    );
    let base_sent = sent?;
    let mut base: Vec<Duration> = deleted
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .iter()
        .map(|at| at.duration_since(t0))
        .collect();
    let base = spread(&mut base);

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
            server.queue_url(),
            "--sqs-endpoint",
            &server.endpoint(),
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
    let envelopes: Vec<_> = order.iter().map(|&i| spot_envelope(&iid(i))).collect();
    let t0 = SystemTime::now();
    let started = Instant::now();
    server.send(&envelopes).await?;
    let relay_sent = started.elapsed();
    eventually(
        "every event relayed and deleted",
        Duration::from_secs(1800),
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
    sampling.store(false, Ordering::SeqCst);
    let _ = sampler.await;
    let after = rss_kib(pid).unwrap_or_default();
    let journal = cluster.emulator().journal();
    eventually(
        "every agent fenced its node",
        Duration::from_secs(600),
        Duration::from_millis(200),
        || async {
            let entries = journal.entries();
            agent_nodes
                .iter()
                .all(|i| {
                    let node = node_name(*i);
                    first_write(&entries, &format!("agent-{node}"), &node, |n| {
                        n["spec"]["unschedulable"] == true
                    })
                    .is_some()
                })
                .then_some(())
        },
    )
    .await;
    let _ = child.start_kill();
    let entries = journal.entries();
    let mut relayed = vec![];
    let mut missing = 0;
    for i in 0..burst {
        let node = node_name(i);
        match first_write(&entries, PUBSUB, &node, |n| carries(n, &iid(i))) {
            Some(at) => relayed.push(since(t0, at)),
            None => missing += 1,
        }
    }
    // Each agent's fence, from the first send and from its own Node's relay.
    let (mut fenced, mut after_relay): (Vec<Duration>, Vec<Duration>) = agent_nodes
        .iter()
        .filter_map(|&i| {
            let node = node_name(i);
            let fence = first_write(&entries, &format!("agent-{node}"), &node, |n| {
                n["spec"]["unschedulable"] == true
            })?;
            let relay = first_write(&entries, PUBSUB, &node, |n| carries(n, &iid(i)))?;
            Some((since(t0, fence), since(relay, fence)))
        })
        .unzip();
    println!(
        "  {}; clock from the first SendMessageBatch (10 per call, {PUTTERS} calls at a time); times per message / per Node",
        server.name()
    );
    println!(
        "  baseline, a bare loop receives and deletes each: p50 {}, p99 {}, last {} (all sent after {})",
        ms(base.0, 0),
        ms(base.1, 0),
        ms(base.2, 0),
        ms(base_sent, 0)
    );
    row(
        &format!(
            "the real lastcall-pubsub relayed each onto its Node ({} Nodes, all sent after {}; Nodes without their event: {missing})",
            relayed.len(),
            ms(relay_sent, 0)
        ),
        spread(&mut relayed),
        base,
    );
    row(
        &format!(
            "its agent fenced the Node ({} of the {with_agents} Nodes with an agent)",
            fenced.len()
        ),
        spread(&mut fenced),
        base,
    );
    let gap = spread(&mut after_relay);
    // The agents' own share: their signal → fence histogram.
    let (mut fence_sum, mut fence_count) = (0.0, 0.0);
    for a in &admins {
        let text = lastcall_testkit::agent::scrape(*a).await;
        fence_sum += value(&text, "lastcall_signal_to_fence_seconds_sum ");
        fence_count += value(&text, "lastcall_signal_to_fence_seconds_count ");
    }
    let agent_requests: Vec<_> = entries
        .iter()
        .filter(|r| {
            r.identity
                .as_deref()
                .is_some_and(|i| i.starts_with("agent-"))
                && r.at >= t0
        })
        .collect();
    let mut statuses: std::collections::BTreeMap<(String, u16), usize> = Default::default();
    for r in &agent_requests {
        *statuses
            .entry((
                format!(
                    "{} {}",
                    r.verb.as_str(),
                    r.resource.as_deref().unwrap_or("-")
                ),
                r.status,
            ))
            .or_default() += 1;
    }
    println!(
        "  the agents' requests from the first send (verb resource, status: count): {statuses:?}"
    );
    println!(
        "  its Node's relay → its agent's fence: p50 {}, p99 {}, longest {}; of which the agent's own signal → fence (its histogram): mean {:.1} ms over {fence_count} fences",
        ms(gap.0, 0),
        ms(gap.1, 0),
        ms(gap.2, 0),
        1000.0 * fence_sum / fence_count.max(1.0)
    );
    println!(
        "  pubsub RSS: {:.1} MiB with {burst} Nodes listed, peak {:.1} MiB through the burst ({:.2}×), {:.1} MiB after",
        idle as f64 / 1024.0,
        peak.load(Ordering::SeqCst) as f64 / 1024.0,
        peak.load(Ordering::SeqCst) as f64 / idle.max(1) as f64,
        after as f64 / 1024.0
    );
    for a in agents {
        a.stop().await?;
    }
    for shard in shards {
        shard.stop(Duration::from_secs(30)).await;
    }
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
