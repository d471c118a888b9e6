//! A private `redis-server` per test: its own port on 127.0.0.1, its own temp dir, no
//! persistence. It never touches a system Redis on 6379.
//!
//! The process can be killed and restarted on the same port, which is how tests take
//! Redis away from a subscriber and give it back.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::process::{Child, Command};

/// How long a fresh server gets to answer PING.
const READY_WITHIN: Duration = Duration::from_secs(10);
/// How long `restart` keeps retrying when the port is not yet free.
const REBIND_WITHIN: Duration = Duration::from_secs(10);
/// Pause between readiness probes and bind retries.
const PROBE_EVERY: Duration = Duration::from_millis(20);
/// Fresh ports `start` tries if the one it picked was taken meanwhile.
const START_ATTEMPTS: usize = 5;

/// Why the server could not come up on a port.
#[derive(Debug, thiserror::Error)]
enum LaunchError {
    /// The process exited before answering PING (most often: the port was taken).
    #[error("redis-server exited early ({status}); log tail:\n{log}")]
    Exited { status: String, log: String },
    /// Anything else (spawn failure, no PING in time).
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

/// A running (or killed) private Redis server. Dropping it kills the process.
pub struct RedisServer {
    port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.start_kill();
        }
    }
}

impl RedisServer {
    /// Starts `redis-server` on a free port and waits until it answers PING.
    pub async fn start() -> anyhow::Result<RedisServer> {
        which_redis_server()?;
        let dir = tempfile::Builder::new()
            .prefix("lastcall-redis-")
            .tempdir()
            .context("creating a temp dir for redis-server")?;
        let mut last = None;
        for _ in 0..START_ATTEMPTS {
            let port = free_port()?;
            match launch(port, &dir.path().to_path_buf()).await {
                Ok(child) => {
                    return Ok(RedisServer {
                        port,
                        dir,
                        child: Some(child),
                    });
                }
                // Someone took the port between our probe and redis' bind: pick another.
                Err(e @ LaunchError::Exited { .. }) => last = Some(e),
                Err(LaunchError::Other(e)) => return Err(e),
            }
        }
        match last {
            Some(e) => Err(anyhow::Error::new(e).context("redis-server did not start")),
            None => bail!("redis-server did not start"),
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:P`
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// `127.0.0.1:P`, the `REDIS_URL` form the original adapter expects.
    pub fn host_port(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Kills the server with SIGKILL and waits for it to exit. Idempotent.
    pub async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }

    /// Starts the server again on the same port (retrying while the port is still busy),
    /// and waits for PING. Kills the running one first, if any. The data is gone: the
    /// server runs without persistence.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.kill().await;
        let dir = self.dir.path().to_path_buf();
        let deadline = tokio::time::Instant::now() + REBIND_WITHIN;
        loop {
            match launch(self.port, &dir).await {
                Ok(child) => {
                    self.child = Some(child);
                    return Ok(());
                }
                Err(LaunchError::Exited { status, log })
                    if tokio::time::Instant::now() < deadline =>
                {
                    tracing::debug!(port = self.port, %status, %log, "redis-server rebind failed, retrying");
                    tokio::time::sleep(PROBE_EVERY).await;
                }
                Err(e) => {
                    return Err(anyhow::Error::new(e)
                        .context(format!("restarting redis-server on port {}", self.port)));
                }
            }
        }
    }

    /// A fresh multiplexed connection to this server.
    pub async fn client(&self) -> anyhow::Result<::redis::aio::MultiplexedConnection> {
        let client = ::redis::Client::open(self.url())?;
        Ok(client.get_multiplexed_async_connection().await?)
    }
}

fn which_redis_server() -> anyhow::Result<()> {
    let found = std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|p| p.join("redis-server").is_file()))
        .unwrap_or(false);
    if !found {
        bail!("redis-server is not on PATH; install it with `apt-get install -y redis-server`");
    }
    Ok(())
}

/// A port the kernel considers free right now.
fn free_port() -> anyhow::Result<u16> {
    let listener =
        std::net::TcpListener::bind(("127.0.0.1", 0)).context("probing for a free port")?;
    Ok(listener.local_addr()?.port())
}

fn log_path(dir: &std::path::Path, port: u16) -> PathBuf {
    dir.join(format!("redis-{port}.log"))
}

/// Spawns redis-server on `port` and waits for PING; an early exit is reported with the log.
async fn launch(port: u16, dir: &PathBuf) -> Result<Child, LaunchError> {
    let log = log_path(dir, port);
    // Each launch gets a fresh log, so an error shows this attempt's reason.
    let _ = std::fs::remove_file(&log);
    let mut child = Command::new("redis-server")
        .arg("--port")
        .arg(port.to_string())
        .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir)
        .arg("--logfile")
        .arg(&log)
        .args(["--daemonize", "no"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .context("spawning redis-server")?;
    let url = format!("redis://127.0.0.1:{port}");
    let deadline = tokio::time::Instant::now() + READY_WITHIN;
    loop {
        if let Some(status) = child.try_wait().context("polling redis-server")? {
            let log = std::fs::read_to_string(&log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(5).collect();
            return Err(LaunchError::Exited {
                status: status.to_string(),
                log: tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
            });
        }
        // Check the answer comes from our process: if our bind failed, another server may
        // hold the port and answer PING before our child's exit is noticed.
        if child.id().is_some() && serving_pid(&url).await == child.id() {
            return Ok(child);
        }
        if tokio::time::Instant::now() >= deadline {
            let _ = child.start_kill();
            let _ = child.wait().await;
            return Err(LaunchError::Other(anyhow::anyhow!(
                "redis-server on port {port} did not answer PING within {READY_WITHIN:?}"
            )));
        }
        tokio::time::sleep(PROBE_EVERY).await;
    }
}

/// The pid of the server answering on `url`, once it answers PING.
async fn serving_pid(url: &str) -> Option<u32> {
    let client = ::redis::Client::open(url).ok()?;
    let mut conn = client.get_multiplexed_async_connection().await.ok()?;
    let pong: String = ::redis::cmd("PING").query_async(&mut conn).await.ok()?;
    if pong != "PONG" {
        return None;
    }
    let info: String = ::redis::cmd("INFO")
        .arg("server")
        .query_async(&mut conn)
        .await
        .ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("process_id:"))
        .and_then(|pid| pid.trim().parse().ok())
}
