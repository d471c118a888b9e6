//! The webhook's flags and the settings they make, checked together. The pubsub `Config`
//! flattens [`WebhookFlags`] in, so the command line is one, but the webhook's settings stay
//! inside the webhook's boundary: nothing here knows about polling or publishing.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use lastcall_common::drain_state;
use lastcall_common::duration::parse_duration;

use super::policy::{self, Buffer, Policy, PolicyError};
use super::tls;

/// The webhook's flags (all `--webhook-*`).
#[derive(Clone, Debug, clap::Args)]
pub struct WebhookFlags {
    /// Address of the FleetAutoscaler webhook (`POST /scale` or `POST /`), e.g.
    /// `0.0.0.0:8000` (the port Agones calls on a `service:` webhook by default). Unset: no
    /// webhook. Needs `--webhook-max-replicas`.
    #[arg(
        long,
        env = "LASTCALL_PUBSUB_WEBHOOK_LISTEN",
        requires = "webhook_max_replicas"
    )]
    pub webhook_listen: Option<SocketAddr>,

    /// PEM certificate (chain) the webhook serves HTTPS with; checked every 30s and
    /// reloaded when it changes (rotation). Unset: plain HTTP. Needs `--webhook-tls-key`.
    #[arg(long, env = "LASTCALL_PUBSUB_WEBHOOK_TLS_CERT",
          requires_all = ["webhook_tls_key", "webhook_listen"], value_parser = tls::parse_cert_file)]
    pub webhook_tls_cert: Option<PathBuf>,

    /// PEM private key of `--webhook-tls-cert` (PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "LASTCALL_PUBSUB_WEBHOOK_TLS_KEY", requires = "webhook_tls_cert",
          value_parser = tls::parse_key_file)]
    pub webhook_tls_key: Option<PathBuf>,

    /// Ready servers to keep, as Agones' Buffer `bufferSize`: a count (`5`) or a share of
    /// the Fleet (`10%`, 1–99%). Draining nodes' Ready servers come on top.
    #[arg(long, env = "LASTCALL_PUBSUB_WEBHOOK_BUFFER", default_value = "5",
          value_parser = parse_buffer)]
    pub webhook_buffer: Buffer,

    /// Smallest Fleet size the webhook asks for (0: none; at least 1 with a percentage
    /// buffer, and at least the buffer with a count, as Agones' Buffer policy requires).
    #[arg(long, env = "LASTCALL_PUBSUB_WEBHOOK_MIN_REPLICAS", default_value_t = 0,
          value_parser = parse_replicas)]
    pub webhook_min_replicas: u32,

    /// Largest Fleet size the webhook asks for, extra replacements included: a hard cap.
    /// Required with `--webhook-listen`.
    #[arg(long, env = "LASTCALL_PUBSUB_WEBHOOK_MAX_REPLICAS", value_parser = parse_replicas)]
    pub webhook_max_replicas: Option<u32>,

    /// A node's drain state older than this counts as zero extra (its agent stopped
    /// refreshing it), and the Fleets it names are held (no scale-down) until it is
    /// refreshed, cleared or pruned. At least 60s: agents refresh every 30s.
    #[arg(long, env = "LASTCALL_PUBSUB_WEBHOOK_DRAIN_STATE_MAX_AGE", default_value = "2m",
          value_parser = parse_max_age)]
    pub webhook_drain_state_max_age: Duration,

    /// A stale drain-state entry (older than the max age) holds the Fleets it names only
    /// until it is this old: then, like an entry whose Node is gone, it counts for nothing
    /// and holds nothing, so a dead agent's entry cannot keep a Fleet from shrinking. At
    /// least the max age.
    #[arg(long, env = "LASTCALL_PUBSUB_WEBHOOK_DRAIN_STATE_HOLD_LIMIT", default_value = "5m",
          value_parser = parse_max_age)]
    pub webhook_drain_state_hold_limit: Duration,

    /// Longest a webhook answer waits for Redis; after that it answers without the drain
    /// state: the plain buffer, never below the Fleet's current size (Agones gives up after
    /// 15s).
    #[arg(long, env = "LASTCALL_PUBSUB_WEBHOOK_REDIS_TIMEOUT", default_value = "500ms",
          value_parser = parse_webhook_timeout)]
    pub webhook_redis_timeout: Duration,

    /// This cluster's name, when clusters share one Redis: the webhook reads the drain
    /// state of `lastcall:drain-state:<name>`, which the agents started with the same
    /// `--cluster-name` write. Empty (the default): `lastcall:drain-state`, the key of
    /// earlier releases. A DNS label.
    #[arg(long, env = "LASTCALL_CLUSTER_NAME", default_value = "",
          value_parser = parse_cluster_name)]
    pub cluster_name: String,
}

/// Settings of the webhook, checked together.
#[derive(Clone, Debug)]
pub struct Settings {
    pub policy: Policy,
    pub redis_timeout: Duration,
    pub drain_state_max_age: Duration,
    pub drain_state_hold_limit: Duration,
    /// The drain-state hash of this cluster (`--cluster-name`).
    pub drain_state_key: String,
}

/// Settings that are valid one by one but not together. Each message names the flags.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("--webhook-buffer, --webhook-min-replicas, --webhook-max-replicas: {0}")]
    Policy(#[source] PolicyError),
    #[error("--webhook-listen needs --webhook-max-replicas")]
    MissingMaxReplicas,
    #[error("--webhook-listen {0} is also --listen: the webhook needs its own port")]
    SameListener(SocketAddr),
    #[error(
        "--webhook-drain-state-hold-limit ({hold}s) is below --webhook-drain-state-max-age ({max_age}s): a stale entry must be able to hold"
    )]
    HoldBelowMaxAge { hold: u64, max_age: u64 },
}

impl WebhookFlags {
    /// The settings (Agones' Buffer policy rules; a listener distinct from `admin`), or
    /// `None` when the webhook is off.
    pub fn settings(&self, admin: SocketAddr) -> Result<Option<Settings>, SettingsError> {
        let Some(addr) = self.webhook_listen else {
            return Ok(None);
        };
        if addr == admin && addr.port() != 0 {
            return Err(SettingsError::SameListener(addr));
        }
        let max = self
            .webhook_max_replicas
            .ok_or(SettingsError::MissingMaxReplicas)?;
        let policy = Policy::new(self.webhook_buffer, self.webhook_min_replicas, max)
            .map_err(SettingsError::Policy)?;
        if self.webhook_drain_state_hold_limit < self.webhook_drain_state_max_age {
            return Err(SettingsError::HoldBelowMaxAge {
                hold: self.webhook_drain_state_hold_limit.as_secs(),
                max_age: self.webhook_drain_state_max_age.as_secs(),
            });
        }
        Ok(Some(Settings {
            policy,
            redis_timeout: self.webhook_redis_timeout,
            drain_state_max_age: self.webhook_drain_state_max_age,
            drain_state_hold_limit: self.webhook_drain_state_hold_limit,
            drain_state_key: drain_state::key_for(&self.cluster_name),
        }))
    }
}

fn parse_buffer(raw: &str) -> Result<Buffer, String> {
    raw.parse::<Buffer>().map_err(|e| e.to_string())
}

fn parse_replicas(raw: &str) -> Result<u32, String> {
    policy::parse_replicas(raw).map_err(|e| e.to_string())
}

fn parse_max_age(raw: &str) -> Result<Duration, String> {
    let d = parse_duration(raw)?;
    let floor = drain_state::REFRESH_EVERY.saturating_mul(2);
    if d < floor {
        return Err(format!(
            "{raw} is below {}s, twice the agents' refresh period",
            floor.as_secs()
        ));
    }
    Ok(d)
}

fn parse_cluster_name(raw: &str) -> Result<String, String> {
    drain_state::check_cluster_name(raw).map(|()| raw.to_string())
}

fn parse_webhook_timeout(raw: &str) -> Result<Duration, String> {
    let d = parse_duration(raw)?;
    if d < Duration::from_millis(1) {
        return Err(format!("{raw} must be at least 1ms"));
    }
    if d > Duration::from_secs(10) {
        return Err(format!(
            "{raw} is over 10s: Agones gives up on a webhook after 15s"
        ));
    }
    Ok(d)
}
