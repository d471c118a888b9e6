//! One way to open Redis connections for both binaries: TLS with an optional CA file, TCP
//! keepalive and a user timeout, and one classification of Redis errors.
//!
//! Why keepalive and a user timeout: a half-open socket (node replaced, NAT state lost, no
//! RST) otherwise times out on every round trip until the kernel gives up, about 15
//! minutes later. Why one classification: each binary must decide the same way whether an
//! error means "rebuild the connection" (timeout, READONLY after a failover, auth) and must
//! log it as one clear line with a bounded metric label.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::io::tcp::{TcpSettings, socket2::TcpKeepalive};
use redis::{ErrorKind, IntoConnectionInfo, RedisError, ServerErrorKind};

use crate::redis_url::RedisTarget;

/// Idle time before the first keepalive probe, and the gap between probes.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(15);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
const KEEPALIVE_PROBES: u32 = 3;
/// Unacknowledged data older than this kills the socket (Linux `TCP_USER_TIMEOUT`).
const USER_TIMEOUT: Duration = Duration::from_secs(30);

/// Largest CA file accepted; a bundle of a few hundred certificates fits easily.
const MAX_CA_BYTES: u64 = 4 * 1024 * 1024;

/// A PEM CA bundle read and checked at start, so a wrong path fails the flag, not a
/// reconnect loop.
#[derive(Clone)]
pub struct CaFile {
    path: PathBuf,
    pem: Vec<u8>,
}

impl std::fmt::Debug for CaFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CaFile({})", self.path.display())
    }
}

impl CaFile {
    /// Reads `path`; for use as a clap value parser.
    pub fn parse(raw: &str) -> Result<Self, String> {
        let path = PathBuf::from(raw.trim());
        let meta = std::fs::metadata(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        if meta.len() > MAX_CA_BYTES {
            return Err(format!(
                "{}: {} bytes is over the {MAX_CA_BYTES}-byte limit",
                path.display(),
                meta.len()
            ));
        }
        let pem = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        if !pem
            .windows(b"-----BEGIN CERTIFICATE-----".len())
            .any(|w| w == b"-----BEGIN CERTIFICATE-----")
        {
            return Err(format!(
                "{}: no PEM certificate (-----BEGIN CERTIFICATE-----) in the file",
                path.display()
            ));
        }
        Ok(Self { path, pem })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Socket options every Redis connection gets.
pub fn tcp_settings() -> TcpSettings {
    TcpSettings::default()
        .set_nodelay(true)
        .set_keepalive(
            TcpKeepalive::new()
                .with_time(KEEPALIVE_IDLE)
                .with_interval(KEEPALIVE_INTERVAL)
                .with_retries(KEEPALIVE_PROBES),
        )
        .set_user_timeout(USER_TIMEOUT)
}

/// Builds the client for `target`: keepalive always, the CA file's roots for `rediss://`
/// when given (the system's web roots otherwise). No I/O.
pub fn client(target: &RedisTarget, ca: Option<&CaFile>) -> redis::RedisResult<redis::Client> {
    let info = target
        .url()
        .into_connection_info()?
        .set_tcp_settings(tcp_settings());
    match ca {
        Some(ca) if target.is_tls() => redis::Client::build_with_tls(
            info,
            redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(ca.pem.clone()),
            },
        ),
        _ => redis::Client::open(info),
    }
}

/// Opens a multiplexed connection with both timeouts set.
pub async fn connect(
    client: &redis::Client,
    timeout: Duration,
) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout));
    // The library's own timeout covers the TCP connect; the outer one also bounds a TLS or
    // AUTH handshake that a blackholed peer never answers.
    match tokio::time::timeout(
        timeout.saturating_mul(2),
        client.get_multiplexed_async_connection_with_config(&config),
    )
    .await
    {
        Ok(r) => r,
        Err(_) => Err(RedisError::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "connecting to Redis timed out",
        ))),
    }
}

/// A client for a single Redis or a Redis Cluster, as the target says.
#[derive(Clone)]
pub enum AnyClient {
    Single(redis::Client),
    Cluster(ClusterSeeds),
}

/// How to reach a Redis Cluster: the nodes the URL names, and every node learned from the
/// cluster's own slot map since (shared by clones). Each connection starts from all of
/// them, so a dead or replaced seed node costs nothing while any known node answers.
#[derive(Clone)]
pub struct ClusterSeeds {
    target: RedisTarget,
    ca: Option<CaFile>,
    learned: Arc<Mutex<Vec<NodeAddr>>>,
}

/// A cluster node as the slot map names it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeAddr {
    pub host: String,
    pub port: u16,
}

impl fmt::Display for NodeAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl ClusterSeeds {
    /// Every node known, as single-node targets: the URL's first, then the learned ones
    /// (primaries and replicas, in slot-map order) not named by the URL.
    pub fn nodes(&self) -> Vec<RedisTarget> {
        let mut out = self.target.seeds();
        let learned = self
            .learned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for n in learned {
            if let Ok(t) = self.target.node(&n.host, n.port)
                && !out.iter().any(|o| o.url() == t.url())
            {
                out.push(t);
            }
        }
        out
    }

    /// Replaces the learned nodes (an empty map changes nothing).
    pub fn learn(&self, nodes: Vec<NodeAddr>) {
        if !nodes.is_empty() {
            *self.learned.lock().unwrap_or_else(|p| p.into_inner()) = nodes;
        }
    }

    /// Asks every known node for the slot map at once, each bounded by `timeout` (connect
    /// and answer): the nodes that answered, in the order known, and the map learned from
    /// the first answer. A node that accepts and never answers costs one bound, in
    /// parallel with the others, and the node list is refreshed even when no cluster
    /// connection can be made.
    async fn probe(&self, timeout: Duration) -> Vec<RedisTarget> {
        let nodes = self.nodes();
        let asks = nodes.iter().map(|node| async move {
            let client = client(node, self.ca.as_ref()).ok()?;
            let ask = async {
                let mut conn = connect(&client, timeout).await?;
                let map: redis::Value = redis::cmd("CLUSTER")
                    .arg("SLOTS")
                    .query_async(&mut conn)
                    .await?;
                Ok::<_, RedisError>(parse_cluster_slots(&map))
            };
            match tokio::time::timeout(timeout.saturating_mul(2), ask).await {
                Ok(Ok(map)) => Some(map),
                Ok(Err(e)) => {
                    tracing::debug!(message = "a cluster node did not answer", node = %node, error = %e);
                    None
                }
                Err(_) => {
                    tracing::debug!(message = "a cluster node did not answer in time", node = %node);
                    None
                }
            }
        });
        let answers = futures::future::join_all(asks).await;
        if let Some(map) = answers.iter().flatten().find(|m| !m.is_empty()) {
            self.learn(map.clone());
        }
        let silent: Vec<String> = nodes
            .iter()
            .zip(&answers)
            .filter(|(_, a)| a.is_none())
            .map(|(n, _)| n.to_string())
            .collect();
        if !silent.is_empty() {
            tracing::warn!(
                message = "Redis Cluster nodes did not answer within the timeout; connecting through the others",
                silent = ?silent,
                answering = nodes.len() - silent.len(),
            );
        }
        nodes
            .into_iter()
            .zip(answers)
            .filter_map(|(node, a)| a.map(|_| node))
            .collect()
    }

    fn client(&self, nodes: Vec<RedisTarget>) -> redis::RedisResult<redis::cluster::ClusterClient> {
        let mut infos = Vec::new();
        for node in nodes {
            infos.push(
                node.url()
                    .into_connection_info()?
                    .set_tcp_settings(tcp_settings()),
            );
        }
        let mut builder = redis::cluster::ClusterClient::builder(infos)
            .tcp_settings(tcp_settings())
            // A failover moves slots for a few seconds: retry a redirected or refused
            // command a few times, then fail it to the caller, who counts and retries.
            .retries(4);
        if let Some(ca) = self.ca.as_ref().filter(|_| self.target.is_tls()) {
            builder = builder.certs(redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(ca.pem.clone()),
            });
        }
        builder.build()
    }
}

/// A connection to a single Redis or to a Redis Cluster. In a cluster each command goes to
/// the primary of its key's slot, over one multiplexed connection per node, following
/// `MOVED` (the slot map is refreshed) and `ASK`; commands without a key go to any node.
#[derive(Clone)]
pub enum AnyConn {
    Single(redis::aio::MultiplexedConnection),
    Cluster(redis::cluster_async::ClusterConnection),
}

impl AnyConn {
    pub fn is_cluster(&self) -> bool {
        matches!(self, Self::Cluster(_))
    }
}

impl redis::aio::ConnectionLike for AnyConn {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// Builds the client for `target`: for `redis+cluster://` and `rediss+cluster://` a cluster
/// client seeded with every node the URL names, and later with every node learned from
/// the slot map too; the same socket options and CA as [`client`]. No I/O.
pub fn any_client(target: &RedisTarget, ca: Option<&CaFile>) -> redis::RedisResult<AnyClient> {
    if !target.is_cluster() {
        return client(target, ca).map(AnyClient::Single);
    }
    let seeds = ClusterSeeds {
        target: target.clone(),
        ca: ca.cloned(),
        learned: Arc::default(),
    };
    // Checked now, so a bad URL fails at start.
    seeds.client(seeds.nodes())?;
    Ok(AnyClient::Cluster(seeds))
}

/// Opens a connection (for a cluster: from every known node, learns the slot map,
/// connects to its nodes and remembers them) with both timeouts set, bounded as
/// [`connect`] is.
pub async fn connect_any(client: &AnyClient, timeout: Duration) -> redis::RedisResult<AnyConn> {
    let seeds = match client {
        AnyClient::Single(c) => return connect(c, timeout).await.map(AnyConn::Single),
        AnyClient::Cluster(c) => c,
    };
    // Only nodes that answer seed the connection: a silent one would hold it to its bound.
    let answering = seeds.probe(timeout).await;
    if answering.is_empty() {
        return Err(RedisError::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "no Redis Cluster node answered",
        )));
    }
    let cluster = seeds.client(answering)?;
    let config = redis::cluster::ClusterConfig::new()
        .set_connection_timeout(timeout)
        .set_response_timeout(timeout);
    let mut conn = match tokio::time::timeout(
        timeout.saturating_mul(2),
        cluster.get_async_connection_with_config(config),
    )
    .await
    {
        Ok(r) => r?,
        Err(_) => {
            return Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "connecting to the Redis Cluster timed out",
            )));
        }
    };
    // Best effort: the connection works without it, and the last map learned stays.
    match tokio::time::timeout(timeout, cluster_nodes(&mut conn)).await {
        Ok(Ok(nodes)) => seeds.learn(nodes),
        Ok(Err(e)) => tracing::debug!(message = "reading the cluster's nodes failed", error = %e),
        Err(_) => tracing::debug!(message = "reading the cluster's nodes timed out"),
    }
    Ok(AnyConn::Cluster(conn))
}

/// Every node of the cluster, primaries and replicas, from `CLUSTER SLOTS`.
pub async fn cluster_nodes(
    conn: &mut redis::cluster_async::ClusterConnection,
) -> redis::RedisResult<Vec<NodeAddr>> {
    let map: redis::Value = redis::cmd("CLUSTER").arg("SLOTS").query_async(conn).await?;
    Ok(parse_cluster_slots(&map))
}

/// Parses a `CLUSTER SLOTS` answer: per range `[start, end, [host, port, id, …], replicas…]`.
/// A node whose host is unknown (`""` or `"?"`) is left out; each node is listed once.
pub fn parse_cluster_slots(map: &redis::Value) -> Vec<NodeAddr> {
    use redis::Value;
    let text = |v: &Value| match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    let mut out: Vec<NodeAddr> = Vec::new();
    let Value::Array(ranges) = map else {
        return out;
    };
    for range in ranges {
        let Value::Array(fields) = range else {
            continue;
        };
        for node in fields.iter().skip(2) {
            let Value::Array(parts) = node else { continue };
            let host = parts.first().and_then(text);
            let port = match parts.get(1) {
                Some(Value::Int(p)) => u16::try_from(*p).ok(),
                Some(v) => text(v).and_then(|p| p.parse().ok()),
                None => None,
            };
            if let (Some(host), Some(port)) = (host, port)
                && !host.is_empty()
                && host != "?"
                && port != 0
            {
                let n = NodeAddr { host, port };
                if !out.contains(&n) {
                    out.push(n);
                }
            }
        }
    }
    out
}

/// What kind of Redis failure happened. Labels are fixed, for metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    Timeout,
    Connection,
    /// The server closed the connection during the handshake: most often `redis://` against
    /// a TLS port.
    Handshake,
    Auth,
    Tls,
    /// Writing to a replica: the server we reach is no longer the primary.
    ReadOnly,
    OutOfMemory,
    NoPermission,
    Server,
}

impl ErrorClass {
    pub const ALL: [ErrorClass; 9] = [
        Self::Timeout,
        Self::Connection,
        Self::Handshake,
        Self::Auth,
        Self::Tls,
        Self::ReadOnly,
        Self::OutOfMemory,
        Self::NoPermission,
        Self::Server,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            Self::Connection => "connection",
            Self::Handshake => "handshake",
            Self::Auth => "auth",
            Self::Tls => "tls",
            Self::ReadOnly => "readonly",
            Self::OutOfMemory => "oom",
            Self::NoPermission => "no_permission",
            Self::Server => "server",
        }
    }

    /// Whether the connection must be thrown away and opened again. A timed-out or
    /// read-only connection would fail the same way forever.
    pub fn needs_new_connection(self) -> bool {
        matches!(
            self,
            Self::Timeout
                | Self::Connection
                | Self::Handshake
                | Self::Auth
                | Self::Tls
                | Self::ReadOnly
        )
    }

    /// A hint for the one log line, saying what the operator should check.
    pub fn hint(self, tls: bool) -> &'static str {
        match self {
            Self::Timeout => "no answer in time: network path, firewall or an overloaded server",
            Self::Connection => "cannot reach Redis: address, port or the server is down",
            Self::Handshake if tls => "the server closed the connection during the handshake",
            Self::Handshake => {
                "the server closed the connection during the handshake: if this port serves TLS, use rediss://"
            }
            Self::Auth => "wrong user name or password (check the credentials in REDIS_URL)",
            Self::Tls => {
                "TLS failed: the server certificate is not trusted (check the CA file) or the port does not speak TLS"
            }
            Self::ReadOnly => "the server is a read-only replica (failover?); reconnecting",
            Self::OutOfMemory => "Redis refused the write: maxmemory reached",
            Self::NoPermission => {
                "the ACL user lacks a permission (needs +eval/+get/+set/+publish/+subscribe on the keys)"
            }
            Self::Server => "Redis answered with an error",
        }
    }
}

/// Classifies `err` into a fixed [`ErrorClass`].
pub fn classify(err: &RedisError) -> ErrorClass {
    let text = format!("{err:?} {err}").to_ascii_lowercase();
    match err.kind() {
        ErrorKind::AuthenticationFailed => return ErrorClass::Auth,
        ErrorKind::Server(ServerErrorKind::ReadOnly) => return ErrorClass::ReadOnly,
        ErrorKind::Server(ServerErrorKind::NoPerm) => return ErrorClass::NoPermission,
        _ => {}
    }
    let code = err.code().unwrap_or_default();
    if code == "WRONGPASS" || code == "NOAUTH" || text.contains("wrongpass") {
        return ErrorClass::Auth;
    }
    if code == "OOM" {
        return ErrorClass::OutOfMemory;
    }
    if code == "READONLY" {
        return ErrorClass::ReadOnly;
    }
    if text.contains("certificate")
        || text.contains("invalidcertificate")
        || text.contains("unknownissuer")
        || text.contains("tls")
        || text.contains("invalidcontenttype")
        || text.contains("corrupt message")
    {
        return ErrorClass::Tls;
    }
    if err.is_timeout() || text.contains("timed out") {
        return ErrorClass::Timeout;
    }
    if err.is_connection_refusal() {
        return ErrorClass::Connection;
    }
    if err.is_connection_dropped()
        || text.contains("connection closed")
        || text.contains("unexpected end")
        || text.contains("eof")
    {
        return ErrorClass::Handshake;
    }
    if err.is_io_error() {
        return ErrorClass::Connection;
    }
    ErrorClass::Server
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_server_and_io_errors() {
        let io = |kind, msg: &str| RedisError::from(std::io::Error::new(kind, msg.to_string()));
        assert_eq!(
            classify(&io(std::io::ErrorKind::TimedOut, "timed out")),
            ErrorClass::Timeout
        );
        assert_eq!(
            classify(&io(std::io::ErrorKind::ConnectionRefused, "refused")),
            ErrorClass::Connection
        );
        assert_eq!(
            classify(&io(
                std::io::ErrorKind::InvalidData,
                "invalid peer certificate: UnknownIssuer"
            )),
            ErrorClass::Tls
        );
        let server = |code: &str| {
            redis::make_extension_error(code.to_string(), Some("injected".to_string()))
        };
        assert_eq!(classify(&server("WRONGPASS")), ErrorClass::Auth);
        assert_eq!(classify(&server("OOM")), ErrorClass::OutOfMemory);
        assert_eq!(classify(&server("SOMETHING")), ErrorClass::Server);
        assert!(ErrorClass::ReadOnly.needs_new_connection());
        assert!(!ErrorClass::OutOfMemory.needs_new_connection());
    }

    #[test]
    fn parses_the_cluster_slot_map() {
        use redis::Value;
        let node = |host: &str, port: i64| {
            Value::Array(vec![
                Value::BulkString(host.as_bytes().to_vec()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ])
        };
        let map = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                node("10.0.0.1", 7000),
                node("10.0.0.4", 7003),
            ]),
            Value::Array(vec![
                Value::Int(5461),
                Value::Int(10922),
                node("10.0.0.2", 7001),
                node("?", 7004),
                node("", 7005),
            ]),
            Value::Array(vec![
                Value::Int(10923),
                Value::Int(16383),
                node("10.0.0.1", 7000),
            ]),
            Value::Nil,
        ]);
        let got: Vec<String> = parse_cluster_slots(&map)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(got, ["10.0.0.1:7000", "10.0.0.4:7003", "10.0.0.2:7001"]);
        assert!(parse_cluster_slots(&Value::Nil).is_empty());
    }

    #[test]
    fn a_cluster_client_knows_the_url_nodes_then_the_learned_ones() {
        let target =
            RedisTarget::parse("redis+cluster://u:pw@10.0.0.1:7000,10.0.0.2:7001").unwrap();
        let AnyClient::Cluster(seeds) = any_client(&target, None).unwrap() else {
            panic!("a cluster client");
        };
        seeds.learn(vec![
            NodeAddr {
                host: "10.0.0.2".into(),
                port: 7001,
            },
            NodeAddr {
                host: "10.0.0.3".into(),
                port: 7002,
            },
        ]);
        seeds.learn(Vec::new());
        let urls: Vec<String> = seeds.nodes().iter().map(|n| n.url().to_string()).collect();
        assert_eq!(
            urls,
            [
                "redis://u:pw@10.0.0.1:7000",
                "redis://u:pw@10.0.0.2:7001",
                "redis://u:pw@10.0.0.3:7002"
            ]
        );
    }

    #[test]
    fn ca_file_must_hold_a_certificate() {
        let dir = tempfile_dir();
        let bad = dir.join("bad.pem");
        std::fs::write(&bad, "not a cert").unwrap();
        assert!(CaFile::parse(bad.to_str().unwrap()).is_err());
        assert!(CaFile::parse("/nonexistent/ca.pem").is_err());
        let good = dir.join("good.pem");
        std::fs::write(
            &good,
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        assert_eq!(CaFile::parse(good.to_str().unwrap()).unwrap().path(), good);
        let _ = std::fs::remove_dir_all(dir);
    }

    fn tempfile_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("lastcall-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
