//! A private `redis-server` per test: its own port on 127.0.0.1, its own temp dir, no
//! persistence. It never touches a system Redis on 6379.
//!
//! The process can be killed and restarted on the same port, which is how tests take
//! Redis away from a subscriber and give it back. It can also serve TLS only, with a
//! certificate generated for the test by the `openssl` CLI, and an ACL user instead of the
//! passwordless default user ([`RedisServer::start_secure`]); be made a replica
//! ([`RedisServer::replica_of`]); and be reached through a [`TcpProxy`] that can delay,
//! blackhole or redirect traffic. [`RedisCluster`] starts a real Redis Cluster of such
//! servers (`cluster-enabled yes`, created with `redis-cli --cluster create`), with replicas,
//! fails a primary over to its replica (`CLUSTER FAILOVER`), or kills a node (SIGKILL) and
//! waits until its replica took over.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

use crate::net::try_free_port;

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

/// Connect and answer timeout of the tests' own Redis connections ([`RedisServer::client`]).
const HARNESS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// TLS files generated for one test: a CA, and a server certificate it signed for
/// `127.0.0.1`.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub ca_pem: PathBuf,
    pub cert_pem: PathBuf,
    pub key_pem: PathBuf,
}

/// The ACL user of a secure server.
pub const ACL_USER: &str = "lastcall";
/// Its password.
pub const ACL_PASSWORD: &str = "s3cret-pw";

/// How a server is launched.
#[derive(Clone, Debug, Default)]
struct Mode {
    /// Serve TLS only (no plain-text port) with these files.
    tls: Option<TlsFiles>,
    /// Disable the default user and require [`ACL_USER`] / [`ACL_PASSWORD`].
    acl: bool,
    /// `cluster-enabled yes` (its bus on port + 10000).
    cluster: bool,
}

/// A running (or killed) private Redis server. Dropping it kills the process.
pub struct RedisServer {
    port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
    mode: Mode,
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
        Self::start_mode(Mode::default()).await
    }

    /// Starts a server that speaks TLS only (certificate from a CA generated here) and
    /// accepts only the ACL user [`ACL_USER`] with [`ACL_PASSWORD`].
    pub async fn start_secure() -> anyhow::Result<RedisServer> {
        let dir = tempfile::Builder::new()
            .prefix("lastcall-tls-")
            .tempdir()
            .context("creating a temp dir for TLS files")?;
        let tls = generate_tls(dir.path(), "server").await?;
        // Keep the files with the server's own directory.
        let mut server = Self::start_mode(Mode {
            tls: Some(tls),
            acl: true,
            cluster: false,
        })
        .await?;
        let keep = std::mem::replace(&mut server.dir, dir);
        // The server's log dir is not needed after start; the TLS dir must outlive it.
        drop(keep);
        Ok(server)
    }

    async fn start_mode(mode: Mode) -> anyhow::Result<RedisServer> {
        which_redis_server()?;
        let dir = tempfile::Builder::new()
            .prefix("lastcall-redis-")
            .tempdir()
            .context("creating a temp dir for redis-server")?;
        let mut last = None;
        for _ in 0..START_ATTEMPTS {
            let port = if mode.cluster {
                free_cluster_port()?
            } else {
                try_free_port().context("probing for a free port")?
            };
            match launch(port, dir.path(), &mode).await {
                Ok(child) => {
                    return Ok(RedisServer {
                        port,
                        dir,
                        child: Some(child),
                        mode,
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

    /// Whether the process runs (it was not killed).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// `redis://127.0.0.1:P`, or for a secure server `rediss://user:password@127.0.0.1:P`.
    pub fn url(&self) -> String {
        server_url(self.port, &self.mode)
    }

    /// The TLS files of a secure server.
    pub fn tls(&self) -> Option<&TlsFiles> {
        self.mode.tls.as_ref()
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
            match launch(self.port, &dir, &self.mode).await {
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

    /// A fresh multiplexed connection to this server, for the tests' own writes. Its
    /// timeouts are generous: the client's defaults (1 s to connect, 500 ms per answer) fail
    /// a test's `SET` on a loaded shared machine while the server is fine. A dead server
    /// still fails at once (connection refused).
    pub async fn client(&self) -> anyhow::Result<::redis::aio::MultiplexedConnection> {
        let client = open_client(self.port, &self.mode)?;
        let config = ::redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(HARNESS_TIMEOUT))
            .set_response_timeout(Some(HARNESS_TIMEOUT));
        Ok(client
            .get_multiplexed_async_connection_with_config(&config)
            .await?)
    }

    /// `REPLICAOF 127.0.0.1 <primary>`: from now on writes answer `READONLY`, as after a
    /// managed-Redis failover. `None` makes it a primary again.
    pub async fn replica_of(&self, primary: Option<u16>) -> anyhow::Result<()> {
        let mut conn = self.client().await?;
        let mut cmd = ::redis::cmd("REPLICAOF");
        match primary {
            Some(port) => cmd.arg("127.0.0.1").arg(port),
            None => cmd.arg("NO").arg("ONE"),
        };
        let _: String = cmd.query_async(&mut conn).await?;
        Ok(())
    }
}

fn server_url(port: u16, mode: &Mode) -> String {
    match (&mode.tls, mode.acl) {
        (Some(_), true) => format!("rediss://{ACL_USER}:{ACL_PASSWORD}@127.0.0.1:{port}"),
        (Some(_), false) => format!("rediss://127.0.0.1:{port}"),
        (None, true) => format!("redis://{ACL_USER}:{ACL_PASSWORD}@127.0.0.1:{port}"),
        (None, false) => format!("redis://127.0.0.1:{port}"),
    }
}

fn open_client(port: u16, mode: &Mode) -> anyhow::Result<::redis::Client> {
    let url = server_url(port, mode);
    Ok(match &mode.tls {
        Some(tls) => ::redis::Client::build_with_tls(
            url.as_str(),
            ::redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(std::fs::read(&tls.ca_pem)?),
            },
        )?,
        None => ::redis::Client::open(url)?,
    })
}

/// Generates a CA and a server certificate for `127.0.0.1` signed by it, with the
/// `openssl` CLI, into `dir`. `name` keeps several sets apart in one directory.
pub async fn generate_tls(dir: &Path, name: &str) -> anyhow::Result<TlsFiles> {
    let p = |f: &str| dir.join(format!("{name}-{f}"));
    let ext = p("ext.cnf");
    std::fs::write(
        &ext,
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n",
    )?;
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let path = |f: &str| p(f).to_string_lossy().into_owned();
    let steps: Vec<Vec<String>> = vec![
        [
            &["req", "-x509"][..],
            &ec[..],
            &["-keyout", &path("ca.key"), "-out", &path("ca.pem")],
            &["-days", "2", "-subj", "/CN=lastcall test CA"],
        ]
        .concat()
        .iter()
        .map(|s| s.to_string())
        .collect(),
        [
            &["req"][..],
            &ec[..],
            &["-keyout", &path("server.key"), "-out", &path("server.csr")],
            &["-subj", "/CN=127.0.0.1"],
        ]
        .concat()
        .iter()
        .map(|s| s.to_string())
        .collect(),
        [
            "x509",
            "-req",
            "-in",
            &path("server.csr"),
            "-CA",
            &path("ca.pem"),
            "-CAkey",
            &path("ca.key"),
            "-CAcreateserial",
            "-out",
            &path("server.pem"),
            "-days",
            "2",
            "-extfile",
            &path("ext.cnf"),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
    ];
    for args in steps {
        let out = Command::new("openssl")
            .args(&args)
            .stdin(Stdio::null())
            .output()
            .await
            .context("running openssl (apt-get install -y openssl)")?;
        if !out.status.success() {
            bail!(
                "openssl {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    Ok(TlsFiles {
        ca_pem: p("ca.pem"),
        cert_pem: p("server.pem"),
        key_pem: p("server.key"),
    })
}

/// A TCP proxy on 127.0.0.1 in front of a Redis port. It can delay what the client sends
/// (a slow path between one publisher and Redis), blackhole everything (a half-open
/// connection: bytes vanish, nothing is closed, and connections that saw the blackhole never
/// carry data again, like a socket whose NAT state was lost), and switch its upstream (a
/// failover behind a stable DNS name: new connections reach the new server, old ones stay
/// where they were).
pub struct TcpProxy {
    port: u16,
    upstream: Arc<AtomicU16>,
    blackhole: Arc<AtomicBool>,
    drop_replies: Arc<AtomicBool>,
    delay_ms: Arc<AtomicU64>,
    stop: CancellationToken,
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl TcpProxy {
    pub async fn start(upstream: u16) -> anyhow::Result<TcpProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let proxy = TcpProxy {
            port,
            upstream: Arc::new(AtomicU16::new(upstream)),
            blackhole: Arc::new(AtomicBool::new(false)),
            drop_replies: Arc::new(AtomicBool::new(false)),
            delay_ms: Arc::new(AtomicU64::new(0)),
            stop: CancellationToken::new(),
        };
        let (up, hole, replies, delay, stop) = (
            proxy.upstream.clone(),
            proxy.blackhole.clone(),
            proxy.drop_replies.clone(),
            proxy.delay_ms.clone(),
            proxy.stop.clone(),
        );
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    () = stop.cancelled() => return,
                    a = listener.accept() => a,
                };
                let Ok((client, _)) = accepted else { continue };
                let links = Links {
                    upstream: up.clone(),
                    hole: hole.clone(),
                    drop_replies: replies.clone(),
                    delay_ms: delay.clone(),
                };
                let stop = stop.clone();
                tokio::spawn(async move {
                    tokio::select! {
                        () = stop.cancelled() => {}
                        () = serve_connection(client, links) => {}
                    }
                });
            }
        });
        Ok(proxy)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Where new connections go from now on.
    pub fn set_upstream(&self, port: u16) {
        self.upstream.store(port, Ordering::SeqCst);
    }

    /// Starts or ends the blackhole.
    pub fn set_blackhole(&self, on: bool) {
        self.blackhole.store(on, Ordering::SeqCst);
    }

    /// While on, requests still reach Redis but answers are lost, and connections that lost
    /// one never answer again: the "did my write happen?" case.
    pub fn set_drop_replies(&self, on: bool) {
        self.drop_replies.store(on, Ordering::SeqCst);
    }

    /// Delay added to every chunk the client sends, order kept.
    pub fn set_delay(&self, d: Duration) {
        self.delay_ms.store(d.as_millis() as u64, Ordering::SeqCst);
    }
}

/// The proxy's switches, as each connection sees them.
struct Links {
    upstream: Arc<AtomicU16>,
    hole: Arc<AtomicBool>,
    drop_replies: Arc<AtomicBool>,
    delay_ms: Arc<AtomicU64>,
}

async fn serve_connection(client: TcpStream, links: Links) {
    let Links {
        upstream,
        hole,
        drop_replies,
        delay_ms,
    } = links;
    let dead = Arc::new(AtomicBool::new(false));
    if hole.load(Ordering::SeqCst) {
        // Accepted by the kernel, never answered.
        swallow(client).await;
        return;
    }
    let Ok(server) = TcpStream::connect(("127.0.0.1", upstream.load(Ordering::SeqCst))).await
    else {
        return;
    };
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let up_dead = dead.clone();
    let up_hole = hole.clone();
    let reader = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match cr.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if up_hole.load(Ordering::SeqCst) {
                up_dead.store(true, Ordering::SeqCst);
            }
            if up_dead.load(Ordering::SeqCst) {
                continue;
            }
            let due = tokio::time::Instant::now()
                + Duration::from_millis(delay_ms.load(Ordering::SeqCst));
            if tx.send((due, buf[..n].to_vec())).is_err() {
                return;
            }
        }
    };
    let writer = async move {
        while let Some((due, bytes)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if sw.write_all(&bytes).await.is_err() {
                return;
            }
        }
        // The client closed: close towards the server too.
        let _ = sw.shutdown().await;
    };
    let down_dead = dead.clone();
    let back = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match sr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if hole.load(Ordering::SeqCst) || drop_replies.load(Ordering::SeqCst) {
                down_dead.store(true, Ordering::SeqCst);
            }
            if down_dead.load(Ordering::SeqCst) {
                continue;
            }
            if cw.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        // A dead connection stays open and silent, as a half-open socket does.
        if down_dead.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        let _ = cw.shutdown().await;
    };
    tokio::join!(
        async {
            tokio::join!(reader, writer);
        },
        back
    );
}

/// Reads and drops everything until the peer goes away.
async fn swallow(mut s: TcpStream) {
    let mut buf = vec![0u8; 4096];
    while let Ok(n) = s.read(&mut buf).await {
        if n == 0 {
            return;
        }
    }
}

fn which_redis_server() -> anyhow::Result<()> {
    if let Err(e) = crate::tools::ensure("redis-server", "redis-server") {
        bail!("{e:#}");
    }
    Ok(())
}

fn log_path(dir: &std::path::Path, port: u16) -> PathBuf {
    dir.join(format!("redis-{port}.log"))
}

/// Spawns redis-server on `port` and waits for PING; an early exit is reported with the log.
async fn launch(port: u16, dir: &Path, mode: &Mode) -> Result<Child, LaunchError> {
    let log = log_path(dir, port);
    // Each launch gets a fresh log, so an error shows this attempt's reason.
    let _ = std::fs::remove_file(&log);
    let mut command = Command::new("redis-server");
    match &mode.tls {
        Some(tls) => {
            command
                .args(["--port", "0", "--tls-port", &port.to_string()])
                .arg("--tls-cert-file")
                .arg(&tls.cert_pem)
                .arg("--tls-key-file")
                .arg(&tls.key_pem)
                .arg("--tls-ca-cert-file")
                .arg(&tls.ca_pem)
                .args(["--tls-auth-clients", "no"]);
        }
        None => {
            command.arg("--port").arg(port.to_string());
        }
    }
    if mode.cluster {
        command
            .args(["--cluster-enabled", "yes"])
            .args(["--cluster-config-file", &format!("nodes-{port}.conf")])
            .args(["--cluster-node-timeout", "1000"])
            // A replica whose master was idle (pinged every 10 s) may count its data as too
            // old for the 1 s node timeout (factor 10 → 20 s) and never stand for election;
            // the tests kill primaries to see the failover, not Redis's staleness rule.
            .args(["--cluster-replica-validity-factor", "0"]);
    }
    if mode.acl {
        command.args(["--user", "default", "off"]).args([
            "--user",
            ACL_USER,
            "on",
            &format!(">{ACL_PASSWORD}"),
            "~*",
            "&*",
            "+@all",
        ]);
    }
    let mut child = command
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
    let client = open_client(port, mode).map_err(LaunchError::Other)?;
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
        if child.id().is_some() && serving_pid(&client).await == child.id() {
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
async fn serving_pid(client: &::redis::Client) -> Option<u32> {
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

/// A free port whose cluster bus port (port + 10000) is free too.
fn free_cluster_port() -> anyhow::Result<u16> {
    for _ in 0..200 {
        let port = try_free_port().context("probing for a free port")?;
        if port > 55_000 {
            continue;
        }
        if std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return Ok(port);
        }
    }
    bail!("no free port with a free cluster bus port")
}

/// A node of a [`RedisCluster`] as `CLUSTER NODES` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterNode {
    pub id: String,
    pub port: u16,
    pub primary: bool,
    /// The primary's id, for a replica.
    pub replica_of: Option<String>,
    /// Slot ranges served, for a primary.
    pub slots: Vec<(u16, u16)>,
}

/// A real Redis Cluster on loopback: `primaries` primaries with `replicas` replicas each,
/// every node a private `redis-server` (see [`RedisServer`]). Dropping it kills them all.
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

/// How long the cluster gets to agree on its slots, or a failover to complete.
const CLUSTER_WITHIN: Duration = Duration::from_secs(30);

impl RedisCluster {
    /// Starts the servers, creates the cluster with `redis-cli --cluster create`, and waits
    /// until every node says `cluster_state:ok` and sees every replica attached.
    pub async fn start(primaries: usize, replicas: usize) -> anyhow::Result<RedisCluster> {
        // redis-cli creates the cluster.
        if let Err(e) = crate::tools::ensure("redis-cli", "redis-tools") {
            bail!("{e:#}");
        }
        let mode = Mode {
            cluster: true,
            ..Mode::default()
        };
        let mut nodes = Vec::new();
        for _ in 0..primaries * (1 + replicas) {
            nodes.push(RedisServer::start_mode(mode.clone()).await?);
        }
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(nodes.iter().map(RedisServer::host_port))
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .await
            .context("running redis-cli --cluster create")?;
        if !out.status.success() {
            bail!(
                "redis-cli --cluster create: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let cluster = RedisCluster { nodes };
        let want_replicas = primaries * replicas;
        cluster
            .wait("every node sees the whole cluster", |views| {
                views.iter().all(|(state_ok, nodes)| {
                    *state_ok
                        && nodes.iter().filter(|n| n.primary).count() == primaries
                        && nodes.iter().filter(|n| n.replica_of.is_some()).count() == want_replicas
                })
            })
            .await?;
        Ok(cluster)
    }

    /// `redis+cluster://127.0.0.1:P` with the first node as the seed.
    pub fn url(&self) -> String {
        format!("redis+cluster://127.0.0.1:{}", self.nodes[0].port())
    }

    /// `redis+cluster://127.0.0.1:P1,127.0.0.1:P2,…` naming `ports` in that order.
    pub fn url_through(&self, ports: &[u16]) -> String {
        let nodes: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        format!("redis+cluster://{}", nodes.join(","))
    }

    /// Every node's port, killed ones included.
    pub fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(RedisServer::port).collect()
    }

    /// The ports of the nodes still running.
    pub fn live_ports(&self) -> Vec<u16> {
        self.nodes
            .iter()
            .filter(|n| n.is_running())
            .map(RedisServer::port)
            .collect()
    }

    fn first_live(&self) -> anyhow::Result<u16> {
        self.live_ports()
            .first()
            .copied()
            .context("every node of the cluster was killed")
    }

    /// A plain connection to the node on `port`.
    pub async fn node(&self, port: u16) -> anyhow::Result<::redis::aio::MultiplexedConnection> {
        let client = ::redis::Client::open(format!("redis://127.0.0.1:{port}"))?;
        Ok(client.get_multiplexed_async_connection().await?)
    }

    /// The cluster as the node on `port` sees it.
    pub async fn nodes_seen_by(&self, port: u16) -> anyhow::Result<Vec<ClusterNode>> {
        let mut conn = self.node(port).await?;
        let text: String = ::redis::cmd("CLUSTER")
            .arg("NODES")
            .query_async(&mut conn)
            .await?;
        Ok(parse_cluster_nodes(&text))
    }

    /// The port of the primary serving `key`'s slot, as the first live node sees it.
    pub async fn primary_of(&self, key: &str) -> anyhow::Result<u16> {
        let seen_by = self.first_live()?;
        let mut conn = self.node(seen_by).await?;
        let slot: u16 = ::redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query_async(&mut conn)
            .await?;
        let nodes = self.nodes_seen_by(seen_by).await?;
        nodes
            .iter()
            .find(|n| n.primary && n.slots.iter().any(|&(a, b)| a <= slot && slot <= b))
            .map(|n| n.port)
            .with_context(|| format!("no primary serves slot {slot}"))
    }

    /// Subscribers of `channel` on the node on `port` (`PUBSUB NUMSUB` counts the node's
    /// own clients only), 0 for a killed node.
    pub async fn subscribers_on(&self, port: u16, channel: &str) -> u64 {
        let Ok(mut conn) = self.node(port).await else {
            return 0;
        };
        let counts: Vec<(String, u64)> = ::redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(channel)
            .query_async(&mut conn)
            .await
            .unwrap_or_default();
        counts.iter().map(|(_, n)| n).sum()
    }

    /// Kills the node on `port` with SIGKILL (no goodbye to the cluster), then waits until
    /// every live node says `cluster_state:ok` and none counts it as a primary: a replica
    /// of it, if it was a primary, was elected in its place (within the node timeout,
    /// 1 s here, plus the election).
    pub async fn kill(&mut self, port: u16) -> anyhow::Result<()> {
        let node = self
            .nodes
            .iter_mut()
            .find(|n| n.port() == port)
            .with_context(|| format!("no node on port {port}"))?;
        node.kill().await;
        self.wait("the killed node's replica took over", |views| {
            views
                .iter()
                .all(|(ok, nodes)| *ok && nodes.iter().all(|n| !(n.port == port && n.primary)))
        })
        .await
    }

    /// The replicas of the primary on `port`.
    pub async fn replicas_of(&self, port: u16) -> anyhow::Result<Vec<u16>> {
        let nodes = self.nodes_seen_by(port).await?;
        let id = nodes
            .iter()
            .find(|n| n.port == port)
            .map(|n| n.id.clone())
            .context("the node is not in its own view")?;
        Ok(nodes
            .iter()
            .filter(|n| n.replica_of.as_deref() == Some(id.as_str()))
            .map(|n| n.port)
            .collect())
    }

    /// `CLUSTER FAILOVER` on the replica on `replica`: it becomes the primary of its
    /// slots, and its old primary a replica. Waits until every node agrees.
    pub async fn failover(&self, replica: u16) -> anyhow::Result<()> {
        let mut conn = self.node(replica).await?;
        let _: String = ::redis::cmd("CLUSTER")
            .arg("FAILOVER")
            .query_async(&mut conn)
            .await?;
        self.wait("the failover is seen by every node", |views| {
            views
                .iter()
                .all(|(ok, nodes)| *ok && nodes.iter().any(|n| n.port == replica && n.primary))
        })
        .await
    }

    async fn wait(
        &self,
        what: &str,
        done: impl Fn(&[(bool, Vec<ClusterNode>)]) -> bool,
    ) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + CLUSTER_WITHIN;
        loop {
            let mut views = Vec::new();
            let live = self.live_ports();
            for port in live.iter().copied() {
                let Ok(mut conn) = self.node(port).await else {
                    continue;
                };
                let info: String = ::redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query_async(&mut conn)
                    .await
                    .unwrap_or_default();
                let nodes = self.nodes_seen_by(port).await.unwrap_or_default();
                views.push((info.contains("cluster_state:ok"), nodes));
            }
            if views.len() == live.len() && done(&views) {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                bail!("timed out after {CLUSTER_WITHIN:?} waiting until {what}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Parses `CLUSTER NODES`: `<id> <ip:port@bus> <flags> <primary|-> <ping> <pong> <epoch>
/// <link> <slot ranges…>`.
fn parse_cluster_nodes(text: &str) -> Vec<ClusterNode> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 8 {
                return None;
            }
            let port = f[1].split('@').next()?.rsplit(':').next()?.parse().ok()?;
            let flags: Vec<&str> = f[2].split(',').collect();
            let primary = flags.contains(&"master") && !flags.contains(&"fail");
            let replica_of = (f[3] != "-").then(|| f[3].to_string());
            let slots = f[8..]
                .iter()
                .filter(|s| !s.starts_with('['))
                .filter_map(|s| match s.split_once('-') {
                    Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                    None => s.parse().ok().map(|n| (n, n)),
                })
                .collect();
            Some(ClusterNode {
                id: f[0].to_string(),
                port,
                primary,
                replica_of,
                slots,
            })
        })
        .collect()
}
