//! Scale agents in processes of their own: a shard of in-process agents per
//! `lastcall-scale-agents` process.
//!
//! Why shards: an agent holds about ten file descriptors (three watch connections, a pooled
//! request connection, its admin listener, two Redis connections, GameLift), plus up to
//! `--release-concurrency` request connections while it drains. 2,000 agents in one process
//! would pass this machine's hard limit of 20,000 descriptors per process before a drain
//! even starts; on a real cluster every agent is a process of its own. A shard of 500 stays
//! far below it through a whole-shard drain.
//!
//! Inside a shard every agent is built by [`InProcessAgent::start`], exactly as the binary
//! builds it, with its own identity and filtered watches; the shard's agents share one
//! GameLift SDK client (one connection pool) with a retry partition of the shard's own.
//!
//! Protocol on the shard's stdout: one `agent <index> <admin address>` line per agent, then
//! `started <RSS in kB before the first agent>`. The shard runs until its stdin closes, then
//! stops its agents (10 s each at most) and exits.

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, anyhow, ensure};
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, BufReader};
use tokio::process::{Child, ChildStdin, Command};

use crate::agent::{InProcessAgent, config};
use crate::cluster::preload::node_name;
use crate::kube::config_for_url;
use crate::scale::{GROUP, iid, status_kb};

/// Runs `fut` on a two-worker runtime whose threads are named `threads` (the machine's
/// cores), with logs to stderr filtered by `LASTCALL_BENCH_LOG` when it is set: how the
/// scale bench and each shard process run.
pub fn run_on_two_workers<F: std::future::Future>(
    threads: &str,
    fut: F,
) -> anyhow::Result<F::Output> {
    if let Ok(filter) = std::env::var("LASTCALL_BENCH_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .init();
    }
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(threads)
        .enable_all()
        .build()?
        .block_on(fut))
}

/// Agents per shard process by default.
pub const SHARD_AGENTS: usize = 500;

/// What one shard runs.
#[derive(Clone, Debug)]
pub struct ShardSpec {
    pub kube_url: String,
    pub gamelift_url: String,
    pub redis_url: String,
    /// Agent indexes `from..to` (node `node_name(i)`, instance `iid(i)`).
    pub from: usize,
    pub to: usize,
    /// Queue mode (`--aws-queue`): the agents read EC2 events relayed onto their Node and
    /// use neither GameLift nor Redis (`gamelift_url` and `redis_url` are not used).
    pub aws_queue: bool,
}

/// The shard process's body: starts the agents, reports them, runs until stdin closes.
pub async fn run(spec: ShardSpec) -> anyhow::Result<()> {
    let rss_before = status_kb("self", "VmRSS");
    let gamelift = (!spec.aws_queue).then(|| {
        aws_sdk_gamelift::Client::from_conf(
            crate::gamelift::sdk_config_for(
                &spec.gamelift_url,
                &format!("lastcall-scale-shard-{}", spec.from),
            )
            .build(),
        )
    });
    let mut agents = Vec::with_capacity(spec.to.saturating_sub(spec.from));
    for i in spec.from..spec.to {
        let node = node_name(i);
        let id = iid(i);
        let args: &[&str] = if spec.aws_queue {
            &["--aws-queue"]
        } else {
            &[
                "--game-server-group",
                GROUP,
                "--instance-id",
                &id,
                "--redis-url",
                &spec.redis_url,
            ]
        };
        let kube = config_for_url(&spec.kube_url, &format!("agent-{node}")).await?;
        let agent = InProcessAgent::start(config(&node, args), kube, gamelift.clone())
            .await
            .with_context(|| format!("agent {i}"))?;
        println!("agent {i} {}", agent.admin);
        agents.push(agent);
    }
    println!("started {rss_before}");
    // Until the parent closes stdin (or dies).
    let mut sink = Vec::new();
    let _ = tokio::io::stdin().read_to_end(&mut sink).await;
    futures::future::join_all(
        agents
            .into_iter()
            .map(|a| a.stop_within(Duration::from_secs(10))),
    )
    .await;
    Ok(())
}

/// A running shard, seen from the harness.
pub struct Shard {
    child: Child,
    stdin: Option<ChildStdin>,
    pub pid: u32,
    /// (agent index, admin address), in index order.
    pub admins: Vec<(usize, SocketAddr)>,
    /// The shard's RSS before its first agent started, in kB.
    pub rss_before_kb: u64,
}

impl Shard {
    /// Starts `lastcall-scale-agents` for `spec` and returns once every agent has started.
    pub async fn spawn(spec: &ShardSpec) -> anyhow::Result<Shard> {
        let bin = tokio::task::spawn_blocking(|| {
            crate::bins::try_workspace_binary("lastcall-testkit", "lastcall-scale-agents")
        })
        .await??;
        let mut child = Command::new(bin)
            .args([
                "--kube-url",
                &spec.kube_url,
                "--gamelift-url",
                &spec.gamelift_url,
                "--redis-url",
                &spec.redis_url,
                "--from",
                &spec.from.to_string(),
                "--to",
                &spec.to.to_string(),
            ])
            .args(spec.aws_queue.then_some("--aws-queue"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .context("starting lastcall-scale-agents")?;
        let pid = child.id().context("the shard exited at once")?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().context("shard stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let mut admins = vec![];
        let rss_before_kb = loop {
            let line = lines.next_line().await?.ok_or_else(|| {
                anyhow!(
                    "shard {}..{} exited after starting {} agents",
                    spec.from,
                    spec.to,
                    admins.len()
                )
            })?;
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                ["agent", i, addr] => admins.push((i.parse()?, addr.parse()?)),
                ["started", kb] => break kb.parse()?,
                _ => return Err(anyhow!("shard printed {line:?}")),
            }
        };
        ensure!(
            admins.len() == spec.to - spec.from,
            "shard {}..{} reported {} agents",
            spec.from,
            spec.to,
            admins.len()
        );
        Ok(Shard {
            child,
            stdin,
            pid,
            admins,
            rss_before_kb,
        })
    }

    pub fn pid(&self) -> String {
        self.pid.to_string()
    }

    /// Closes the shard's stdin and waits for it to stop its agents; kills it after
    /// `within`.
    pub async fn stop(mut self, within: Duration) {
        drop(self.stdin.take());
        if tokio::time::timeout(within, self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

/// Splits `0..agents` into shards of at most `per_shard`.
pub fn shard_ranges(agents: usize, per_shard: usize) -> Vec<(usize, usize)> {
    let per = per_shard.max(1);
    (0..agents)
        .step_by(per)
        .map(|from| (from, (from + per).min(agents)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_every_agent_once() {
        assert_eq!(shard_ranges(0, 500), vec![]);
        assert_eq!(shard_ranges(100, 500), vec![(0, 100)]);
        assert_eq!(
            shard_ranges(1200, 500),
            vec![(0, 500), (500, 1000), (1000, 1200)]
        );
        assert_eq!(shard_ranges(3, 0), vec![(0, 1), (1, 2), (2, 3)]);
    }
}
