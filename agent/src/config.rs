//! Flags and environment variables, in one validated type.
//!
//! Validation lives in clap value parsers, so a bad value exits with code 2 and a one-line
//! error naming the flag, before anything starts. The original adapter's names (`REDIS_URL`,
//! `GAME_SERVER_GROUP_NAME`, `AWS_REGION`, `--healthcheck-interval`, `--failure-threshold`)
//! are accepted.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use lastcall_common::duration::parse_duration;
use lastcall_common::redis_url::RedisTarget;

#[derive(Parser, Debug, Clone)]
#[command(
    name = "lastcall-agent",
    version,
    about = "Per-node disruption agent for Agones game-server nodes: fences a doomed node, \
             releases idle game servers, protects running matches and deregisters the empty node."
)]
pub struct Config {
    /// Kubernetes Node this agent guards. Set it from the Downward API (spec.nodeName).
    #[arg(long, env = "NODE_NAME", value_parser = non_empty)]
    pub node_name: String,

    /// EC2 instance id. Default: read from instance metadata (IMDSv2).
    #[arg(long, env = "INSTANCE_ID", value_parser = non_empty)]
    pub instance_id: Option<String>,

    /// FleetIQ game server group. Enables FleetIQ (register, claim, heartbeat, Redis status,
    /// deregister). Without it the agent reacts to node labels only.
    #[arg(long = "game-server-group", env = "GAME_SERVER_GROUP_NAME", value_parser = non_empty)]
    pub game_server_group: Option<String>,

    /// FleetIQ GameServerId. Default: the instance id, as the original adapter used.
    #[arg(long, env = "GAME_SERVER_ID", value_parser = non_empty)]
    pub game_server_id: Option<String>,

    /// Redis channel carrying this instance's status. Default: the instance id.
    #[arg(long, env = "REDIS_CHANNEL", value_parser = non_empty)]
    pub redis_channel: Option<String>,

    /// Redis endpoint: host[:port][/db] (the original form), redis://… or rediss://… (TLS),
    /// optionally with user:password@; a Redis Cluster as redis+cluster://[user:pass@]host[:port]
    /// or rediss+cluster://…, naming the configuration endpoint or one or more nodes
    /// (comma-separated host:port). On a cluster the subscription goes through the first
    /// node named and moves to another known node when that one fails.
    #[arg(long, env = "REDIS_URL", value_parser = RedisTarget::parse)]
    pub redis_url: Option<RedisTarget>,

    /// PEM file with the CA certificate(s) of the Redis server, for rediss:// URLs. Unset:
    /// the public web roots. A missing or certificate-less file fails the flag.
    #[arg(long, env = "REDIS_CA_FILE", value_parser = lastcall_common::redis_conn::CaFile::parse)]
    pub redis_ca_file: Option<lastcall_common::redis_conn::CaFile>,

    /// AWS region for GameLift.
    #[arg(long, env = "AWS_REGION", value_parser = non_empty)]
    pub aws_region: Option<String>,

    /// GameLift endpoint override (tests, VPC endpoints).
    #[arg(long, env = "AWS_ENDPOINT_URL_GAMELIFT", value_parser = http_url)]
    pub gamelift_endpoint: Option<String>,

    /// Instance metadata endpoint.
    #[arg(long, env = "LASTCALL_IMDS_ENDPOINT", default_value = "http://169.254.169.254", value_parser = http_url)]
    pub imds_endpoint: String,

    /// Address of the HTTP listener for /healthz and /readyz, and for /metrics unless
    /// `--metrics-listen` is set. The IP may be in brackets whatever its family
    /// (`[10.0.0.5]:9090`, `[fd00::5]:9090`), so one `[$(POD_IP)]:9090` serves IPv4 and IPv6
    /// pods alike.
    #[arg(long, env = "LASTCALL_LISTEN", default_value = "0.0.0.0:9090", value_parser = listen_addr)]
    pub listen: SocketAddr,

    /// A listener of its own for /metrics (same forms as `--listen`), which then serves only
    /// the probes: on the host network the chart puts the probes on 127.0.0.1 (the kubelet
    /// reaches the node's loopback) and /metrics on the node's address. Unset: /metrics is on
    /// `--listen`.
    #[arg(long, env = "LASTCALL_METRICS_LISTEN", value_parser = listen_addr)]
    pub metrics_listen: Option<SocketAddr>,

    /// Who may read /metrics: `none`, anyone who reaches it; `kubernetes`, a caller whose
    /// bearer token the API server authenticates (TokenReview) and authorizes for `get` on
    /// the non-resource URL /metrics (SubjectAccessReview), as Kubernetes' own components
    /// do: 401 without a valid token, 403 without the permission, 503 while a review cannot
    /// be made. Needs `create` on tokenreviews and subjectaccessreviews. The probes never
    /// ask for a token.
    #[arg(
        long,
        env = "LASTCALL_METRICS_AUTH",
        value_enum,
        default_value = "none"
    )]
    pub metrics_auth: crate::metrics_auth::Mode,

    /// Interval between FleetIQ HEALTHY heartbeats (GameLift advises at most 60 s).
    #[arg(long, env = "LASTCALL_HEARTBEAT_INTERVAL", default_value = "30s", value_parser = heartbeat)]
    pub heartbeat_interval: Duration,

    /// How often pubsub publishes; used to decide when Redis has gone quiet.
    #[arg(long, env = "LASTCALL_PUBLISH_PERIOD", default_value = "60s", value_parser = positive_duration)]
    pub publish_period: Duration,

    /// After this many publish periods without a message, ask GameLift directly
    /// (DescribeGameServerInstances for this instance only).
    #[arg(long, env = "LASTCALL_STALE_PERIODS", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub stale_periods: u32,

    /// Seconds between direct GameLift checks while Redis is quiet (original adapter flag;
    /// 5..60, clamped like the original).
    #[arg(long, env = "LASTCALL_HEALTHCHECK_INTERVAL", default_value = "60", value_parser = clamp_5_60)]
    pub healthcheck_interval: u64,

    /// Consecutive failed heartbeats after which /readyz reports not ready (original adapter
    /// flag; 1..5, clamped like the original).
    #[arg(long, env = "LASTCALL_FAILURE_THRESHOLD", default_value = "3", value_parser = clamp_1_5)]
    pub failure_threshold: u32,

    /// Reproduce the original adapter's taints: gamelift.status/active=true:NoExecute after
    /// claim, gamelift.status/draining=true:NoExecute (after tolerating in-use pods) on drain.
    #[arg(long, env = "LASTCALL_COMPAT_TAINTS")]
    pub compat_taints: bool,

    /// Send no mutating call: log and count each instead, and narrate the whole drain
    /// (fence, releases, protections, deadlines, deregistration) as if each had landed.
    #[arg(long, env = "LASTCALL_DRY_RUN")]
    pub dry_run: bool,

    /// Deregister from FleetIQ on SIGTERM, as the original adapter always did, but only a
    /// node with no game-server pod on a fresh read of its pods (a rollout never hands a busy
    /// node back; skipped ones count as deregistrations_total{result="exit_skipped"}).
    #[arg(long, env = "LASTCALL_DEREGISTER_ON_EXIT")]
    pub deregister_on_exit: bool,

    /// Deadline announced to protected game servers when the signal gives none.
    #[arg(long, env = "LASTCALL_DRAIN_DEADLINE", default_value = "30m", value_parser = positive_duration)]
    pub drain_deadline: Duration,

    /// How long the fence must have stood before an empty node is handed over (FleetIQ
    /// deregistration, an Auto Scaling hook completed, an Azure event approved, the hand-back
    /// to GKE): a scheduler deciding on a cache from before the cordon may still bind a pod.
    #[arg(long, env = "LASTCALL_DEREGISTER_SETTLE", default_value = "5s", value_parser = lastcall_common::duration::parse_duration)]
    pub deregister_settle: Duration,

    /// Poll EC2 instance metadata (IMDSv2, `--imds-endpoint`) for Spot interruptions,
    /// rebalance recommendations, scheduled events and the Auto Scaling lifecycle state.
    #[arg(long, env = "LASTCALL_AWS_IMDS")]
    pub aws_imds: bool,

    /// How often instance metadata is polled for notices (it never leaves the node).
    #[arg(long, env = "LASTCALL_AWS_IMDS_INTERVAL", default_value = "1s", value_parser = positive_duration)]
    pub aws_imds_interval: Duration,

    /// Queue mode: read the AWS events pubsub relays from an EventBridge → SQS queue onto
    /// this Node (`lastcall.dev/aws-events`): Spot and capacity-reservation warnings,
    /// rebalance recommendations, state changes, Health scheduled changes, Auto Scaling
    /// terminations. Needs no instance metadata and no host network.
    #[arg(long, env = "LASTCALL_AWS_QUEUE")]
    pub aws_queue: bool,

    /// How long a rebalance recommendation that never escalates keeps the node draining.
    #[arg(long, env = "LASTCALL_REBALANCE_TTL", default_value = "30m", value_parser = positive_duration)]
    pub rebalance_ttl: Duration,

    /// Hold the instance through an EC2 Auto Scaling termination lifecycle hook: when the
    /// group parks it in `Terminating:Wait`, announce the wait's end to games, keep it with
    /// `RecordLifecycleActionHeartbeat` while matches run, and complete the action
    /// (`CONTINUE`) once the node is empty. Reads IMDS (`--imds-endpoint`).
    #[arg(long, env = "LASTCALL_ASG_LIFECYCLE")]
    pub asg_lifecycle: bool,

    /// Auto Scaling group of this instance. Default: discovered (DescribeAutoScalingInstances).
    #[arg(long, env = "LASTCALL_ASG_GROUP_NAME", value_parser = non_empty)]
    pub asg_group_name: Option<String>,

    /// Termination lifecycle hook to complete. Default: the group's only termination hook.
    #[arg(long, env = "LASTCALL_ASG_HOOK_NAME", value_parser = non_empty)]
    pub asg_hook_name: Option<String>,

    /// How often instance metadata is read for the Auto Scaling target lifecycle state.
    #[arg(long, env = "LASTCALL_ASG_INTERVAL", default_value = "5s", value_parser = positive_duration)]
    pub asg_interval: Duration,

    /// Auto Scaling endpoint override (tests, VPC endpoints).
    #[arg(long, env = "AWS_ENDPOINT_URL_AUTO_SCALING", value_parser = http_url)]
    pub asg_endpoint: Option<String>,

    /// Watch the GCE metadata server for host maintenance and preemption (GCE and GKE
    /// Standard; needs hostNetwork under Workload Identity).
    #[arg(long, env = "LASTCALL_GCE_METADATA")]
    pub gce_metadata: bool,

    /// GCE metadata server.
    #[arg(long, env = "LASTCALL_GCE_METADATA_ENDPOINT", default_value = "http://169.254.169.254", value_parser = http_url)]
    pub gce_metadata_endpoint: String,

    /// `timeout_sec` of each hanging GET on the metadata server (the client waits 10 s more).
    #[arg(long, env = "LASTCALL_GCE_WAIT_TIMEOUT", default_value = "60s", value_parser = positive_duration)]
    pub gce_wait_timeout: Duration,

    /// Time from `preempted=TRUE` to the VM's end (30 s on GCE; GKE can extend it to 120 s).
    #[arg(long, env = "LASTCALL_GCE_PREEMPTION_NOTICE", default_value = "30s", value_parser = positive_duration)]
    pub gce_preemption_notice: Duration,

    /// Deadline announced for `TERMINATE_ON_HOST_MAINTENANCE`, counted from when it is seen.
    #[arg(long, env = "LASTCALL_GCE_TERMINATE_NOTICE", default_value = "1h", value_parser = positive_duration)]
    pub gce_terminate_notice: Duration,

    /// How often `instance/upcoming-maintenance` is read.
    #[arg(long, env = "LASTCALL_GCE_UPCOMING_INTERVAL", default_value = "60s", value_parser = positive_duration)]
    pub gce_upcoming_interval: Duration,

    /// When the node is empty and pending GCE maintenance may start early
    /// (`can_reschedule`), set `cloud.google.com/perform-maintenance=true` on the Node, once,
    /// so GKE starts it now instead of at the window.
    #[arg(long, env = "LASTCALL_GKE_HAND_BACK")]
    pub gke_hand_back: bool,

    /// Poll Azure Scheduled Events (instance metadata) for this VM's freezes, reboots,
    /// redeploys, Spot evictions and scale-set terminations (AKS and other Azure VMs).
    #[arg(long, env = "LASTCALL_AZURE_EVENTS")]
    pub azure_events: bool,

    /// Azure instance metadata endpoint.
    #[arg(long, env = "LASTCALL_AZURE_METADATA_ENDPOINT", default_value = "http://169.254.169.254", value_parser = http_url)]
    pub azure_metadata_endpoint: String,

    /// How often Azure Scheduled Events are polled (the endpoint never leaves the node).
    #[arg(long, env = "LASTCALL_AZURE_EVENTS_INTERVAL", default_value = "1s", value_parser = positive_duration)]
    pub azure_events_interval: Duration,

    /// This VM's name as Scheduled Events list it in `Resources` (on AKS the scale-set
    /// instance name, not the Kubernetes node name). Default: read from instance metadata
    /// (`compute/name`).
    #[arg(long, env = "LASTCALL_AZURE_VM_NAME", value_parser = non_empty)]
    pub azure_vm_name: Option<String>,

    /// Approve (start now) this VM's pending Scheduled Events once the node is empty, so
    /// a reboot, redeploy or termination does not wait for its NotBefore.
    #[arg(
        long,
        env = "LASTCALL_AZURE_APPROVE_WHEN_EMPTY",
        requires = "azure_events"
    )]
    pub azure_approve_when_empty: bool,

    /// How long before a known maintenance window (GKE `scheduled-maintenance-time`, GCE
    /// upcoming maintenance, AWS `system-maintenance`) or the expiry of the node's Karpenter
    /// NodeClaim (`expireAfter`, EKS Auto Mode) the node stops taking new matches, so matches
    /// that start before then end on their own before the window.
    #[arg(long, env = "LASTCALL_MAINTENANCE_LEAD", default_value = "1h", value_parser = lastcall_common::duration::parse_duration)]
    pub maintenance_lead: Duration,

    /// Treat a cordon lastcall did not make (kubectl cordon, a GKE upgrade) as a drain
    /// signal: release idle game servers, protect running matches. Never un-cordons.
    #[arg(long, env = "LASTCALL_DRAIN_ON_FOREIGN_CORDON")]
    pub drain_on_foreign_cordon: bool,

    /// At a Terminate deadline, also end gracefully the matches whose `eviction.safe` does
    /// not permit it (`Never`, or `OnUpgrade` under an autoscaler): their pods get SIGTERM
    /// at `deadline − terminationGracePeriodSeconds`, so the game has its whole grace
    /// period instead of dying with the VM. Off: lastcall never ends such a match; it warns
    /// (`MatchesAtRisk` Event, `lastcall_matches_at_risk`).
    #[arg(long, env = "LASTCALL_GRACEFUL_TERMINATION")]
    pub graceful_termination: bool,

    /// Keep `karpenter.sh/do-not-disrupt: "true"` and
    /// `cluster-autoscaler.kubernetes.io/safe-to-evict: "false"` on this node's game-server
    /// pods that hold a match (`in-use`), or on all of them (`all`), so no autoscaler takes a
    /// node holding a match. lastcall never marks a pod evictable. A Node label
    /// `lastcall.dev/autoscaler-cooperation` overrides it per node pool. See
    /// docs/autoscalers.md.
    #[arg(
        long,
        env = "LASTCALL_AUTOSCALER_COOPERATION",
        value_enum,
        default_value = "off"
    )]
    pub autoscaler_cooperation: crate::cooperation::Mode,

    /// Publish this node's drain state (per Fleet, Ready and Allocated servers while it
    /// drains) to the Redis of `--redis-url`, for pubsub's FleetAutoscaler webhook
    /// (docs/webhook.md). Works with or without FleetIQ.
    #[arg(long, env = "LASTCALL_PUBLISH_DRAIN_STATE", requires = "redis_url")]
    pub publish_drain_state: bool,

    /// This cluster's name, when clusters share one Redis: the drain state goes to
    /// `lastcall:drain-state:<name>`, which pubsub's webhook started with the same
    /// `--cluster-name` reads. Empty (the default): `lastcall:drain-state`, the key of
    /// earlier releases. A DNS label.
    #[arg(long, env = "LASTCALL_CLUSTER_NAME", default_value = "",
          value_parser = parse_cluster_name)]
    pub cluster_name: String,

    /// Release pacing: while draining, keep at least this many Ready servers in each Fleet on
    /// nodes that are not draining (the Fleet's status, less its servers labelled
    /// `lastcall.dev/node-draining`) when releasing this node's idle ones; the rest wait for
    /// replacements to become Ready elsewhere, for `--release-hold-max` at most. 0 = off.
    /// A Terminate deadline overrides it. Needs `get` on Agones Fleets.
    #[arg(long, env = "LASTCALL_RELEASE_FLOOR", default_value_t = 0)]
    pub release_floor: u32,

    /// Release pacing: at most `--release-batch` Ready servers of each Fleet released per
    /// this interval (e.g. `500ms`); 0 = no limit. A Terminate deadline overrides it.
    #[arg(long, env = "LASTCALL_RELEASE_INTERVAL", default_value = "0s", value_parser = lastcall_common::duration::parse_duration)]
    pub release_interval: Duration,

    /// Release pacing: how many Ready servers of one Fleet each `--release-interval` releases
    /// (the per-Fleet concurrency; `--release-concurrency` bounds all Fleets together).
    #[arg(long, env = "LASTCALL_RELEASE_BATCH", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub release_batch: u32,

    /// Release pacing: the longest a drain holds a node's Ready servers back (an unreadable
    /// Fleet, a floor the Fleet cannot reach); then they are all released. The notice's own
    /// deadline, when earlier, ends the hold too. Held servers are labelled
    /// `lastcall.dev/node-draining=true` at once.
    #[arg(long, env = "LASTCALL_RELEASE_HOLD_MAX", default_value = "10m", value_parser = positive_duration)]
    pub release_hold_max: Duration,

    /// Ready game servers deleted at once while releasing.
    #[arg(long, env = "LASTCALL_RELEASE_CONCURRENCY", default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub release_concurrency: u32,

    /// Keep-alive PING period on the Redis subscription; a silently dead connection is
    /// replaced within about this long.
    #[arg(long, env = "LASTCALL_REDIS_PING_INTERVAL", default_value = "15s", value_parser = positive_duration)]
    pub redis_ping_interval: Duration,

    /// How the agent finds its node's GameServers: `field` watches them by `status.nodeName`
    /// (Agones 1.58 or later on Kubernetes 1.31 or later; no writes), `label` labels each one
    /// whose pod lands on the node with `lastcall.dev/node` (one merge patch per server) and
    /// watches the label, `auto` asks the API server once at start and uses `field` where it
    /// is served. `field` on a server that refuses it ends start-up with an error.
    #[arg(long, env = "LASTCALL_GAMESERVER_SELECTOR", value_enum, default_value_t = crate::gameserver_selector::Selector::Auto)]
    pub gameserver_selector: crate::gameserver_selector::Selector,

    /// Re-plan at least this often even when nothing changes.
    #[arg(long, env = "LASTCALL_RESYNC_INTERVAL", default_value = "10s", value_parser = positive_duration)]
    pub resync_interval: Duration,

    /// Deadline of every Kubernetes API request (watches keep their own, longer, long-poll
    /// timeout): a request on a connection that stopped answering fails after this long and
    /// is retried, instead of stopping the agent.
    #[arg(long, env = "LASTCALL_REQUEST_TIMEOUT", default_value = "10s", value_parser = positive_duration)]
    pub request_timeout: Duration,

    /// This agent's pod name. Set it from the Downward API (metadata.name); with --pod-uid it
    /// lets one agent at a time own the node (see docs/agent.md). Without both, the agent
    /// assumes it is the node's only agent.
    #[arg(long, env = "POD_NAME", value_parser = non_empty, requires = "pod_uid")]
    pub pod_name: Option<String>,

    /// This agent's pod namespace (Downward API metadata.namespace). Default: the
    /// namespace of the service account.
    #[arg(long, env = "POD_NAMESPACE", value_parser = non_empty)]
    pub pod_namespace: Option<String>,

    /// This agent's pod uid (Downward API metadata.uid).
    #[arg(long, env = "POD_UID", value_parser = non_empty, requires = "pod_name")]
    pub pod_uid: Option<String>,
    /// Remove lastcall's autoscaler-cooperation annotations from every game-server pod in
    /// the cluster (Agones' own values come back), then exit: for uninstalling (the chart
    /// runs it as a pre-delete hook). Needs `list`/`patch` on pods and `get` on GameServers.
    #[arg(long, env = "LASTCALL_CLEANUP_COOPERATION")]
    pub cleanup_cooperation: bool,

    /// File holding the webhook URL that drain notifications are POSTed to (Slack incoming
    /// webhook, Teams workflow, any JSON receiver); mount it from a Secret. Unset: the
    /// environment variable LASTCALL_NOTIFY_URL if set, else no notifications. The URL is
    /// never logged. See docs/notifications.md.
    #[arg(long, env = "LASTCALL_NOTIFY_URL_FILE")]
    pub notify_url_file: Option<std::path::PathBuf>,

    /// Body of each notification: JSON with placeholders {event}, {node}, {cluster},
    /// {reason}, {source}, {deadline}, {message}, filled in JSON-escaped (so they go inside
    /// JSON strings). Checked at start-up: an unknown placeholder or a body that is not a
    /// JSON object fails the flag.
    #[arg(long, env = "LASTCALL_NOTIFY_TEMPLATE", default_value = crate::notify::template::DEFAULT, value_parser = crate::notify::Template::parse)]
    pub notify_template: crate::notify::Template,

    /// Time limit of each notification attempt (connecting, at most 2 s of it, and the
    /// answer); failed attempts are retried twice, then the notification is dropped.
    #[arg(long, env = "LASTCALL_NOTIFY_TIMEOUT", default_value = "5s", value_parser = positive_duration)]
    pub notify_timeout: Duration,

    /// The cluster's name for {cluster} in notifications.
    #[arg(long, env = "LASTCALL_NOTIFY_CLUSTER", default_value = "")]
    pub notify_cluster: String,

    /// Log filter, e.g. info or lastcall_agent=debug,info. RUST_LOG overrides it.
    #[arg(long, env = "LASTCALL_LOG_LEVEL", default_value = "info", value_parser = lastcall_common::telemetry::parse_level)]
    pub log_level: String,
}

impl Config {
    /// FleetIQ integration is on when a game server group is configured.
    pub fn fleetiq_enabled(&self) -> bool {
        self.game_server_group.is_some()
    }
}

/// `ip:port`, `[ipv6]:port`, or `[ipv4]:port` (what `[$(POD_IP)]:port` becomes on an IPv4 pod).
fn listen_addr(s: &str) -> Result<SocketAddr, String> {
    let t = s.trim();
    if let Ok(a) = t.parse::<SocketAddr>() {
        return Ok(a);
    }
    let bracketed = t
        .strip_prefix('[')
        .and_then(|r| r.split_once("]:"))
        .and_then(|(ip, port)| {
            Some((
                ip.parse::<std::net::Ipv4Addr>().ok()?,
                port.parse::<u16>().ok()?,
            ))
        });
    match bracketed {
        Some((ip, port)) => Ok(SocketAddr::from((ip, port))),
        None => Err(format!(
            "`{t}` is not an address: expected ip:port or [ip]:port"
        )),
    }
}

fn non_empty(s: &str) -> Result<String, String> {
    let t = s.trim();
    if t.is_empty() {
        Err("must not be empty".into())
    } else {
        Ok(t.to_string())
    }
}

fn http_url(s: &str) -> Result<String, String> {
    let u = url::Url::parse(s).map_err(|e| format!("{s:?} is not a URL: {e}"))?;
    match u.scheme() {
        "http" | "https" if u.host_str().is_some() => Ok(s.trim_end_matches('/').to_string()),
        _ => Err(format!("{s:?} must be an http:// or https:// URL")),
    }
}

fn positive_duration(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d.is_zero() {
        Err("must be greater than zero".into())
    } else {
        Ok(d)
    }
}

fn heartbeat(s: &str) -> Result<Duration, String> {
    let d = positive_duration(s)?;
    if d > Duration::from_secs(60) {
        return Err(
            "must be at most 60s: FleetIQ deregisters servers that stop heartbeating".into(),
        );
    }
    Ok(d)
}

fn clamp_int(s: &str, lo: u64, hi: u64) -> Result<u64, String> {
    let v: i64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not an integer"))?;
    Ok((v.max(0) as u64).clamp(lo, hi))
}

fn clamp_5_60(s: &str) -> Result<u64, String> {
    clamp_int(s, 5, 60)
}

fn clamp_1_5(s: &str) -> Result<u32, String> {
    clamp_int(s, 1, 5).map(|v| v as u32)
}

fn parse_cluster_name(raw: &str) -> Result<String, String> {
    lastcall_common::drain_state::check_cluster_name(raw).map(|()| raw.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Config, clap::Error> {
        let mut v = vec!["lastcall-agent", "--node-name", "n1"];
        v.extend_from_slice(args);
        Config::try_parse_from(v)
    }

    #[test]
    fn defaults_and_original_flags() {
        let c = parse(&["--healthcheck-interval", "300", "--failure-threshold", "0"]).unwrap();
        assert_eq!(c.healthcheck_interval, 60, "clamped like the original");
        assert_eq!(c.failure_threshold, 1);
        assert_eq!(c.heartbeat_interval, Duration::from_secs(30));
        assert!(!c.fleetiq_enabled() && !c.dry_run && !c.deregister_on_exit);
        // One listener for everything, open to whoever reaches it: as before these flags.
        assert_eq!(c.metrics_listen, None);
        assert_eq!(c.metrics_auth, crate::metrics_auth::Mode::None);
        let c = parse(&[
            "--listen=127.0.0.1:9091",
            "--metrics-listen=[fd00::5]:9090",
            "--metrics-auth=kubernetes",
        ])
        .unwrap();
        assert_eq!(c.listen.to_string(), "127.0.0.1:9091");
        assert_eq!(
            c.metrics_listen.map(|a| a.to_string()).as_deref(),
            Some("[fd00::5]:9090")
        );
        assert_eq!(c.metrics_auth, crate::metrics_auth::Mode::Kubernetes);
    }

    #[test]
    fn the_listener_takes_a_bracketed_ip_of_either_family() {
        for (arg, want) in [
            ("[10.0.0.5]:9090", "10.0.0.5:9090"),
            ("[fd00::5]:9090", "[fd00::5]:9090"),
            ("0.0.0.0:9090", "0.0.0.0:9090"),
        ] {
            assert_eq!(
                listen_addr(arg).map(|a| a.to_string()),
                Ok(want.to_string())
            );
        }
        for bad in [
            "[]:9090",
            "[10.0.0.5]",
            "[10.0.0.5]:x",
            "10.0.0.5",
            "[$(POD_IP)]:9090",
        ] {
            assert!(listen_addr(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bad_values_name_the_flag() {
        for (args, flag) in [
            (vec!["--redis-url", "http://x"], "--redis-url"),
            (
                vec!["--redis-ca-file", "/nonexistent.pem"],
                "--redis-ca-file",
            ),
            (vec!["--heartbeat-interval", "5m"], "--heartbeat-interval"),
            (vec!["--publish-period", "0s"], "--publish-period"),
            (vec!["--imds-endpoint", "ftp://x"], "--imds-endpoint"),
            (vec!["--release-concurrency", "0"], "--release-concurrency"),
            (vec!["--listen", "nowhere"], "--listen"),
            (
                vec!["--metrics-listen", "[$(POD_IP)]:9090"],
                "--metrics-listen",
            ),
            (vec!["--metrics-auth", "token"], "--metrics-auth"),
            (
                vec!["--notify-template", r#"{"text":"{nodename}"}"#],
                "--notify-template",
            ),
            (vec!["--notify-timeout", "0s"], "--notify-timeout"),
        ] {
            let err = parse(&args).unwrap_err();
            assert_eq!(err.exit_code(), 2);
            assert!(err.to_string().contains(flag), "{flag}: {err}");
        }
        let err = Config::try_parse_from(["lastcall-agent"]).unwrap_err();
        assert!(err.to_string().contains("--node-name"), "{err}");
    }
}
