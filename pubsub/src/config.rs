//! Every setting of the pubsub service: one `Config`, from flags and environment variables.
//!
//! All validation lives in clap value parsers, so a bad value is rejected at start with exit
//! code 2 and a message naming the flag, before any I/O. The original adapter's names
//! (`REDIS_URL`, `AWS_REGION`, the `/etc/fleetiq/fleetiq.conf` path) are kept.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::builder::BoolishValueParser;
use clap::{ArgAction, Parser};
use lastcall_common::duration::parse_duration;
use lastcall_common::redis_conn::CaFile;
use lastcall_common::redis_url::RedisTarget;

use crate::queue::QueueFlags;
use crate::webhook::settings::{Settings, SettingsError, WebhookFlags};

/// GameLift advises refreshing `DescribeGameServerInstances` no more than once every 10 s.
pub const MIN_PERIOD: Duration = Duration::from_secs(10);

/// Polls GameLift FleetIQ for the viability of every game-server instance and publishes each
/// status on Redis (channel = instance id), caching the last value under
/// `lastcall:status:<instance-id>`.
#[derive(Clone, Debug, Parser)]
#[command(name = "lastcall-pubsub", version)]
pub struct Config {
    /// Game server groups file (the `fleetiqconfig` ConfigMap format,
    /// `{"GameServerGroups": [...]}`). Re-read every cycle; an invalid edit keeps the last
    /// good list.
    #[arg(
        long,
        env = "FLEETIQ_CONFIG",
        default_value = "/etc/fleetiq/fleetiq.conf"
    )]
    pub config_file: PathBuf,

    /// Time between the starts of two polling cycles (e.g. 60s, 2m). At least 10s, GameLift's
    /// advised minimum.
    #[arg(long, env = "LASTCALL_PUBSUB_PERIOD", default_value = "60s", value_parser = parse_period)]
    pub period: Duration,

    /// Extra random delay (0..this) added before each cycle, so replicas and restarts do not
    /// poll in lockstep.
    #[arg(long, env = "LASTCALL_PUBSUB_CYCLE_JITTER", default_value = "5s", value_parser = parse_duration)]
    pub cycle_jitter: Duration,

    /// Redis to publish to: `host[:port][/db]` (the original form), `redis://[user:pass@]host[:port][/db]`
    /// or `rediss://…` for TLS; a Redis Cluster (cluster-mode ElastiCache, Memorystore Cluster)
    /// as `redis+cluster://[user:pass@]host[:port]` or `rediss+cluster://…`, naming the
    /// configuration endpoint or one or more nodes (comma-separated `host:port`). Required
    /// unless `--queue-url` is set (then, unset, pubsub reads only the queue).
    #[arg(long, env = "REDIS_URL", value_parser = parse_redis, required_unless_present = "queue_url")]
    pub redis_url: Option<RedisTarget>,

    /// PEM file with the CA certificate(s) that signed the Redis server's certificate, for
    /// `rediss://` URLs. Unset: the public web roots. Read at start; a missing or
    /// certificate-less file fails the flag.
    #[arg(long, env = "REDIS_CA_FILE", value_parser = CaFile::parse)]
    pub redis_ca_file: Option<CaFile>,

    /// AWS region of the game server groups. Unset: the SDK's default chain (profile, IMDS).
    #[arg(long, env = "AWS_REGION", value_parser = parse_region)]
    pub aws_region: Option<String>,

    /// GameLift endpoint override (`http://` or `https://`), e.g. a VPC endpoint or a test
    /// emulator.
    #[arg(long, env = "AWS_ENDPOINT_URL_GAMELIFT", value_parser = parse_endpoint)]
    pub gamelift_endpoint: Option<String>,

    /// Address of the admin HTTP server (`/metrics`, `/healthz`, `/readyz`).
    #[arg(long, env = "LASTCALL_PUBSUB_LISTEN", default_value = "0.0.0.0:9090")]
    pub listen: SocketAddr,

    /// Publish every instance every cycle, as the original did. `--publish-unchanged=false`
    /// publishes only statuses that changed since the last successful publish; the cache
    /// key is refreshed either way.
    #[arg(
        long,
        env = "LASTCALL_PUBSUB_PUBLISH_UNCHANGED",
        default_value_t = true,
        action = ArgAction::Set,
        num_args = 0..=1,
        default_missing_value = "true",
        value_parser = BoolishValueParser::new(),
    )]
    pub publish_unchanged: bool,

    /// TTL of the cached last value, in periods (TTL = this × --period).
    #[arg(long, env = "LASTCALL_PUBSUB_CACHE_TTL_PERIODS", default_value_t = 3,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub cache_ttl_periods: u32,

    /// Groups polled at the same time.
    #[arg(long, env = "LASTCALL_PUBSUB_CONCURRENCY", default_value_t = 4,
          value_parser = clap::value_parser!(u16).range(1..=64))]
    pub concurrency: u16,

    /// First backoff ceiling after a throttled, timed-out or 5xx GameLift call; doubles per
    /// retry (full jitter).
    #[arg(long, env = "LASTCALL_PUBSUB_RETRY_BASE", default_value = "1s", value_parser = parse_positive)]
    pub retry_base: Duration,

    /// Largest backoff between two GameLift attempts.
    #[arg(long, env = "LASTCALL_PUBSUB_RETRY_MAX", default_value = "20s", value_parser = parse_positive)]
    pub retry_max: Duration,

    /// Attempts per GameLift page before the group is given up for this cycle.
    #[arg(long, env = "LASTCALL_PUBSUB_API_MAX_ATTEMPTS", default_value_t = 5,
          value_parser = clap::value_parser!(u32).range(1..=20))]
    pub api_max_attempts: u32,

    /// Timeout of one GameLift attempt.
    #[arg(long, env = "LASTCALL_PUBSUB_API_TIMEOUT", default_value = "10s", value_parser = parse_positive)]
    pub api_timeout: Duration,

    /// Most GameLift calls per second, retries included, shared by every group (a token
    /// bucket). A throttled answer slows every caller, not only the one that saw it.
    #[arg(long, env = "LASTCALL_PUBSUB_API_RATE", default_value_t = 20.0, value_parser = parse_rate)]
    pub api_rate: f64,

    /// Calls that may go out back to back before the rate applies.
    #[arg(long, env = "LASTCALL_PUBSUB_API_BURST", default_value_t = 5,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub api_burst: u32,

    /// Time a cycle may spend polling; groups not done by then fail this cycle (reason
    /// `deadline`) and go first in the next one. Default: the period.
    #[arg(long, env = "LASTCALL_PUBSUB_CYCLE_DEADLINE", value_parser = parse_positive)]
    pub cycle_deadline: Option<Duration>,

    /// `/healthz` fails when one cycle has run this long, or the next cycle is this late:
    /// the polling loop is stuck. Redis being down never fails it (see `/readyz`). Default:
    /// 5 periods; at least twice the cycle deadline.
    #[arg(long, env = "LASTCALL_PUBSUB_LIVENESS_TIMEOUT", value_parser = parse_positive)]
    pub liveness_timeout: Option<Duration>,

    /// `/readyz` requires that at least one group was published in the last this many
    /// periods.
    #[arg(long, env = "LASTCALL_PUBSUB_READY_PERIODS", default_value_t = 3,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub ready_periods: u32,

    /// Most GameLift calls (retries included) in one cycle; groups left when it runs out
    /// fail for this cycle. Guards the account's API quota against a runaway loop.
    #[arg(long, env = "LASTCALL_PUBSUB_API_BUDGET", default_value_t = 2000,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub api_budget: u32,

    /// Instances per pipelined Redis round trip (each instance is a PUBLISH and a SET).
    #[arg(long, env = "LASTCALL_PUBSUB_PUBLISH_BATCH", default_value_t = 2000,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub publish_batch: u32,

    /// Connect and response timeout of one Redis round trip.
    #[arg(long, env = "LASTCALL_PUBSUB_REDIS_TIMEOUT", default_value = "5s", value_parser = parse_positive)]
    pub redis_timeout: Duration,

    /// First backoff after a failed Redis round trip; while backing off, publishing is
    /// skipped (and counted) instead of stalling the cycle.
    #[arg(long, env = "LASTCALL_PUBSUB_REDIS_RETRY_BASE", default_value = "1s", value_parser = parse_positive)]
    pub redis_retry_base: Duration,

    /// Largest backoff between two Redis reconnection attempts.
    #[arg(long, env = "LASTCALL_PUBSUB_REDIS_RETRY_MAX", default_value = "30s", value_parser = parse_positive)]
    pub redis_retry_max: Duration,

    /// Log filter (`info`, `debug`, `lastcall_pubsub=debug,info`); `RUST_LOG` overrides it.
    #[arg(long, env = "LASTCALL_PUBSUB_LOG_LEVEL", default_value = "info",
          value_parser = lastcall_common::telemetry::parse_level)]
    pub log_level: String,

    /// The webhook's flags (`--webhook-*`), owned by the webhook.
    #[command(flatten)]
    pub webhook: WebhookFlags,

    /// Queue mode's flags (`--queue-*`), owned by the queue consumer.
    #[command(flatten)]
    pub queue: QueueFlags,
}

impl Config {
    /// TTL of the cache key: a few periods, so a dead publisher's values expire.
    pub fn cache_ttl(&self) -> Duration {
        self.period.saturating_mul(self.cache_ttl_periods)
    }

    /// How long a cycle may poll.
    pub fn cycle_deadline(&self) -> Duration {
        self.cycle_deadline.unwrap_or(self.period)
    }

    /// How long a cycle may run (or the next one be late) before `/healthz` fails.
    pub fn liveness_timeout(&self) -> Duration {
        self.liveness_timeout
            .unwrap_or_else(|| self.period.saturating_mul(5))
    }

    /// The webhook's settings, checked together (Agones' Buffer policy rules, distinct
    /// listeners); `None` when the webhook is off.
    pub fn webhook_settings(&self) -> Result<Option<Settings>, ConfigError> {
        Ok(self.webhook.settings(self.listen)?)
    }

    /// Checks what clap cannot check flag by flag: flags that must agree with each other.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let deadline = self.cycle_deadline();
        let liveness = self.liveness_timeout();
        // A cycle polls until its deadline, then publishes what it read: a liveness
        // timeout shorter than twice that would restart a healthy process.
        if liveness < deadline.saturating_mul(2) {
            return Err(ConfigError::LivenessBelowCycle {
                liveness: secs(liveness),
                deadline: secs(deadline),
            });
        }
        // A status is written at most period + jitter + deadline after the one before it
        // (the next cycle starts up to period + jitter later and may poll that group last),
        // so a shorter TTL lets the cache key expire between two healthy cycles.
        let gap = self.period + self.cycle_jitter + deadline;
        if self.cache_ttl() < gap {
            return Err(ConfigError::CacheTtlBelowCycle {
                ttl: secs(self.cache_ttl()),
                gap: secs(gap),
            });
        }
        self.webhook_settings().map(|_| ())
    }
}

fn secs(d: Duration) -> String {
    format!("{}s", d.as_secs_f64())
}

/// Settings that are valid one by one but not together. Each message names the flags.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(
        "--liveness-timeout {liveness} is below twice the cycle deadline ({deadline}, --cycle-deadline or --period): /healthz would fail during a healthy cycle"
    )]
    LivenessBelowCycle { liveness: String, deadline: String },
    #[error(
        "--cache-ttl-periods × --period ({ttl}) is below --period + --cycle-jitter + the cycle deadline ({gap}): cached statuses would expire between two healthy cycles"
    )]
    CacheTtlBelowCycle { ttl: String, gap: String },
    #[error("{0}")]
    Webhook(#[from] SettingsError),
}

fn parse_period(raw: &str) -> Result<Duration, String> {
    let d = parse_duration(raw)?;
    if d < MIN_PERIOD {
        return Err(format!(
            "{raw} is below GameLift's advised minimum of {}s",
            MIN_PERIOD.as_secs()
        ));
    }
    Ok(d)
}

fn parse_positive(raw: &str) -> Result<Duration, String> {
    let d = parse_duration(raw)?;
    if d < Duration::from_millis(1) {
        return Err(format!("{raw} must be at least 1ms"));
    }
    Ok(d)
}

fn parse_rate(raw: &str) -> Result<f64, String> {
    let rate: f64 = raw
        .trim()
        .parse()
        .map_err(|_| format!("{raw:?} is not a number of calls per second"))?;
    if !(0.1..=10_000.0).contains(&rate) {
        return Err(format!(
            "{raw} must be between 0.1 and 10000 calls per second"
        ));
    }
    Ok(rate)
}

fn parse_redis(raw: &str) -> Result<RedisTarget, String> {
    RedisTarget::parse(raw).map_err(|e| e.to_string())
}

fn parse_region(raw: &str) -> Result<String, String> {
    let ok = !raw.is_empty()
        && raw.len() <= 64
        && raw
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if ok {
        Ok(raw.to_string())
    } else {
        Err(format!(
            "{raw:?} is not an AWS region name (e.g. us-west-2)"
        ))
    }
}

fn parse_endpoint(raw: &str) -> Result<String, String> {
    let url = url::Url::parse(raw).map_err(|e| format!("{raw:?} is not a URL: {e}"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!("{raw:?} must be an http:// or https:// URL"));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(format!("{raw:?} has no host"));
    }
    Ok(raw.trim_end_matches('/').to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::webhook::policy::{Buffer, Policy};
    use clap::error::ErrorKind;

    fn parse(args: &[&str]) -> Result<Config, clap::Error> {
        let mut argv = vec!["lastcall-pubsub"];
        if !args.contains(&"--redis-url") {
            argv.extend(["--redis-url", "cache:6379"]);
        }
        argv.extend_from_slice(args);
        Config::try_parse_from(argv)
    }

    #[test]
    fn defaults_match_the_original() {
        let c = parse(&[]).unwrap();
        assert_eq!(c.config_file, PathBuf::from("/etc/fleetiq/fleetiq.conf"));
        assert_eq!(c.period, Duration::from_secs(60));
        assert!(c.publish_unchanged);
        assert_eq!(c.cache_ttl(), Duration::from_secs(180));
        assert_eq!(c.concurrency, 4);
        assert_eq!(c.redis_url.unwrap().url(), "redis://cache:6379");
        assert_eq!(c.listen, "0.0.0.0:9090".parse().unwrap());
    }

    #[test]
    fn publish_unchanged_takes_an_optional_value() {
        assert!(
            !parse(&["--publish-unchanged=false"])
                .unwrap()
                .publish_unchanged
        );
        assert!(
            !parse(&["--publish-unchanged", "no"])
                .unwrap()
                .publish_unchanged
        );
        assert!(parse(&["--publish-unchanged"]).unwrap().publish_unchanged);
        assert!(
            parse(&["--publish-unchanged=true", "--period", "10s"])
                .unwrap()
                .publish_unchanged
        );
    }

    #[test]
    fn bad_values_name_their_flag_in_one_line() {
        let cases: &[(&[&str], &str)] = &[
            (&["--period", "5s"], "--period"),
            (&["--period", "soon"], "--period"),
            (&["--redis-url", "http://x"], "--redis-url"),
            (&["--cache-ttl-periods", "0"], "--cache-ttl-periods"),
            (&["--concurrency", "0"], "--concurrency"),
            (&["--aws-region", "US West"], "--aws-region"),
            (&["--gamelift-endpoint", "ftp://x"], "--gamelift-endpoint"),
            (&["--listen", "nowhere"], "--listen"),
            (&["--log-level", "lastcall=[[["], "--log-level"),
            (&["--retry-base", "0s"], "--retry-base"),
            (&["--publish-unchanged=maybe"], "--publish-unchanged"),
            (&["--api-rate", "0"], "--api-rate"),
            (&["--api-rate", "fast"], "--api-rate"),
            (&["--redis-ca-file", "/nonexistent.pem"], "--redis-ca-file"),
            (&["--cycle-deadline", "0s"], "--cycle-deadline"),
            (&["--webhook-buffer", "0"], "--webhook-buffer"),
            (&["--webhook-buffer", "100%"], "--webhook-buffer"),
            (&["--webhook-buffer", "five"], "--webhook-buffer"),
            (&["--webhook-min-replicas=-1"], "--webhook-min-replicas"),
            (
                &["--webhook-max-replicas", "2147483648"],
                "--webhook-max-replicas",
            ),
            (
                &["--webhook-drain-state-max-age", "10s"],
                "--webhook-drain-state-max-age",
            ),
            (
                &["--webhook-redis-timeout", "30s"],
                "--webhook-redis-timeout",
            ),
            (
                &["--webhook-tls-cert", "/nonexistent.pem"],
                "--webhook-tls-cert",
            ),
            (
                &["--webhook-tls-key", "/nonexistent.pem"],
                "--webhook-tls-key",
            ),
        ];
        for (args, flag) in cases {
            let err = parse(args).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::ValueValidation, "{args:?}: {err}");
            let line = lastcall_common::cli::one_line(&err.render().to_string());
            assert!(line.contains(flag), "{args:?}: {line}");
            assert!(!line.contains('\n'));
        }
    }

    #[test]
    fn flags_that_must_agree_are_checked_together() {
        assert!(parse(&[]).unwrap().validate().is_ok(), "the defaults agree");
        assert!(
            parse(&["--period", "10s", "--liveness-timeout", "20s"])
                .unwrap()
                .validate()
                .is_ok()
        );
        let cases: &[(&[&str], &str)] = &[
            (&["--liveness-timeout", "90s"], "--liveness-timeout"),
            (
                &["--period", "10s", "--liveness-timeout", "19s"],
                "--liveness-timeout",
            ),
            (
                &["--cycle-deadline", "5m", "--liveness-timeout", "9m"],
                "--cycle-deadline",
            ),
            (&["--cache-ttl-periods", "1"], "--cache-ttl-periods"),
            (&["--cache-ttl-periods", "2"], "--cache-ttl-periods"),
        ];
        for (args, flag) in cases {
            let err = parse(args).unwrap().validate().unwrap_err().to_string();
            assert!(err.contains(flag) && !err.contains('\n'), "{args:?}: {err}");
        }
    }

    #[test]
    fn missing_redis_url_is_one_line() {
        if std::env::var_os("REDIS_URL").is_some() {
            return; // the environment supplies it
        }
        let err = Config::try_parse_from(["lastcall-pubsub"]).unwrap_err();
        let line = lastcall_common::cli::one_line(&err.render().to_string());
        assert!(line.contains("--redis-url"), "{line}");
    }

    #[test]
    fn webhook_is_off_by_default_and_its_flags_are_checked_together() {
        assert!(parse(&[]).unwrap().webhook_settings().unwrap().is_none());
        let on = parse(&[
            "--webhook-listen",
            "127.0.0.1:8000",
            "--webhook-max-replicas",
            "50",
        ])
        .unwrap();
        let s = on.webhook_settings().unwrap().unwrap();
        assert_eq!(s.policy, Policy::new(Buffer::Absolute(5), 0, 50).unwrap());
        assert_eq!(s.drain_state_max_age, Duration::from_secs(120));
        assert_eq!(s.redis_timeout, Duration::from_millis(500));

        // Flags that need each other.
        for args in [
            &["--webhook-listen", "127.0.0.1:8000"][..],
            &[
                "--webhook-listen",
                "127.0.0.1:8000",
                "--webhook-max-replicas",
                "5",
                "--webhook-tls-cert",
                "Cargo.toml",
            ],
        ] {
            let err = parse(args).unwrap_err();
            let line = lastcall_common::cli::one_line(&err.render().to_string());
            assert!(line.contains("--webhook-"), "{args:?}: {line}");
        }
        // Valid one by one, not together: one line naming the flags.
        let cases: &[&[&str]] = &[
            &["--webhook-max-replicas", "3"],
            &[
                "--webhook-min-replicas",
                "20",
                "--webhook-max-replicas",
                "10",
            ],
            &[
                "--webhook-min-replicas",
                "2",
                "--webhook-max-replicas",
                "10",
            ],
            &["--webhook-buffer", "10%", "--webhook-max-replicas", "10"],
            &["--webhook-max-replicas", "10", "--listen", "127.0.0.1:8000"],
        ];
        for extra in cases {
            let mut args = vec!["--webhook-listen", "127.0.0.1:8000"];
            args.extend_from_slice(extra);
            let err = parse(&args).unwrap().validate().unwrap_err().to_string();
            assert!(
                err.contains("--webhook-") && !err.contains('\n'),
                "{extra:?}: {err}"
            );
        }
        let pct = parse(&[
            "--webhook-listen",
            "127.0.0.1:8000",
            "--webhook-buffer",
            "10%",
            "--webhook-min-replicas",
            "1",
            "--webhook-max-replicas",
            "10",
        ])
        .unwrap();
        assert!(pct.validate().is_ok());
    }

    #[test]
    fn ten_seconds_is_the_floor() {
        assert_eq!(parse(&["--period", "10s"]).unwrap().period, MIN_PERIOD);
    }
}
