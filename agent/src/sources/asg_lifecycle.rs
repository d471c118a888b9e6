//! EC2 Auto Scaling termination lifecycle hooks: keep the instance until its matches end.
//!
//! A group with a termination hook parks a leaving instance (scale-in, instance refresh, AZ
//! rebalance, a managed node group update) in `Terminating:Wait`, and instance metadata says
//! so: `autoscaling/target-lifecycle-state` reads `Terminated`. This source then finds the
//! group and the hook (`DescribeAutoScalingInstances`, `DescribeLifecycleHooks`), announces
//! the wait's true end (the global cap) as the deadline, keeps the instance in the wait with
//! `RecordLifecycleActionHeartbeat` while the node still holds matches, and completes the
//! action with `CONTINUE` once the node is empty (and deregistered where FleetIQ is on).
//!
//! Off by default (`--asg-lifecycle`). The only steady-state cost is one local IMDS read per
//! `--asg-interval`; the Auto Scaling API is called only once the instance is leaving. In
//! queue mode (`--aws-queue`) the termination comes from the `EC2 Instance-terminate
//! Lifecycle Action` pubsub relayed onto the agent's Node, and the instance id from the
//! Node's `spec.providerID`: no IMDS, so no host network; the hold is the same.

use std::time::Duration;

use aws_sdk_autoscaling::error::{ProvideErrorMetadata, SdkError};
use futures::FutureExt;
use futures::future::BoxFuture;
use jiff::{SignedDuration, Timestamp};
use tracing::{info, warn};

use super::{Report, SourceContext};
use crate::metrics::{Metrics, OperationResult, SourceLabel, SourceReason};
use crate::notice::{Cause, Notice, Severity, Source};

pub const SOURCE: Source = Source("asg_lifecycle");

/// The transition of a termination hook.
pub const TERMINATING: &str = "autoscaling:EC2_INSTANCE_TERMINATING";
/// AWS caps a whole lifecycle wait at 48 hours or 100 heartbeat timeouts, whichever is less.
const MAX_WAIT: Duration = Duration::from_secs(172_800);
/// How long an Auto Scaling API that still says the instance has not reached its wait is
/// read again: the longest heartbeat timeout a hook may have. Past it, any wait has ended.
const LAG_LIMIT: Duration = Duration::from_secs(7_200);
const LIFECYCLE_PATH: &str = "/latest/meta-data/autoscaling/target-lifecycle-state";
const INSTANCE_ID_PATH: &str = "/latest/meta-data/instance-id";

/// A lifecycle hook, as `DescribeLifecycleHooks` tells it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HookInfo {
    pub name: String,
    pub transition: String,
    pub heartbeat_timeout: Duration,
    /// `GlobalTimeout`, when AWS says; otherwise computed from the heartbeat timeout.
    pub global_timeout: Option<Duration>,
}

impl HookInfo {
    /// The cap on the whole wait.
    pub fn global_timeout(&self) -> Duration {
        self.global_timeout
            .unwrap_or_else(|| (self.heartbeat_timeout * 100).min(MAX_WAIT))
            .min(MAX_WAIT)
    }
}

/// Why a termination hook could not be chosen.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum PickError {
    #[error("the group has no termination lifecycle hook (create one: see docs/install.md)")]
    NoTerminationHook,
    #[error("the group has no termination hook named {0:?} (--asg-hook-name)")]
    NotFound(String),
    #[error("the group has several termination hooks ({0}); name one with --asg-hook-name")]
    Ambiguous(String),
}

/// The termination hook this agent completes: the one named, or the only one.
pub fn pick_hook(hooks: &[HookInfo], wanted: Option<&str>) -> Result<HookInfo, PickError> {
    let terminating: Vec<&HookInfo> = hooks
        .iter()
        .filter(|h| h.transition == TERMINATING)
        .collect();
    match (wanted, terminating.as_slice()) {
        (Some(name), _) => terminating
            .iter()
            .find(|h| h.name == name)
            .map(|h| (*h).clone())
            .ok_or_else(|| PickError::NotFound(name.to_string())),
        (None, []) => Err(PickError::NoTerminationHook),
        (None, [one]) => Ok((*one).clone()),
        (None, many) => Err(PickError::Ambiguous(
            many.iter()
                .map(|h| h.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        )),
    }
}

/// One wait this agent holds, and what it knows of its end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hold {
    pub group: String,
    pub hook: HookInfo,
    /// The latest the wait can have begun (first sight, less one IMDS poll interval).
    pub began: Timestamp,
    /// The global cap: the instance goes then whatever happens.
    pub cap: Timestamp,
    /// Without a further heartbeat the hook times out then.
    pub expires: Timestamp,
    /// Heartbeats were refused for good (AccessDenied): the instance goes at `expires`.
    pub heartbeats_denied: bool,
    /// The denial was told on the Node (a Warning Event, once, by the acting agent).
    pub denial_told: bool,
}

impl Hold {
    pub fn new(group: String, hook: HookInfo, seen: Timestamp, poll: Duration) -> Self {
        let began = seen
            .checked_sub(SignedDuration::try_from(poll).unwrap_or_default())
            .unwrap_or(seen);
        let add = |d: Duration| {
            began
                .checked_add(SignedDuration::try_from(d).unwrap_or_default())
                .unwrap_or(began)
        };
        Self {
            cap: add(hook.global_timeout()),
            expires: add(hook.heartbeat_timeout),
            group,
            hook,
            began,
            heartbeats_denied: false,
            denial_told: false,
        }
    }

    /// The end announced to games: the cap while heartbeats can keep the instance, the
    /// heartbeat timeout once they cannot. Never later than an end announced before: a
    /// denied heartbeat that later succeeds does not move it back.
    pub fn deadline(&self) -> Timestamp {
        if self.heartbeats_denied {
            self.expires.min(self.cap)
        } else {
            self.cap
        }
    }

    /// A heartbeat was accepted at `now`.
    pub fn heartbeat_accepted(&mut self, now: Timestamp) {
        let next = now
            .checked_add(SignedDuration::try_from(self.hook.heartbeat_timeout).unwrap_or_default())
            .unwrap_or(now);
        // Once the end was announced as the heartbeat timeout, it stays there.
        if !self.heartbeats_denied {
            self.expires = next.min(self.cap);
        }
    }

    /// How often to send a heartbeat: a third of the timeout, so two can fail in a row.
    pub fn heartbeat_every(&self) -> Duration {
        (self.hook.heartbeat_timeout / 3).max(Duration::from_millis(500))
    }

    /// The notice for this wait.
    pub fn notice(&self) -> Notice {
        let why = if self.heartbeats_denied {
            "; heartbeats are refused (AccessDenied), so the instance goes at the hook's timeout"
        } else {
            ""
        };
        // Counted from when this agent first saw the wait: a restarted agent counts later,
        // so the earlier (recorded) end stands.
        Notice {
            estimated_deadline: true,
            ..Notice::new(
                SOURCE,
                Cause::ScaleDown,
                Severity::Terminate,
                Some(self.deadline()),
                false,
                format!(
                    "Auto Scaling group {} is terminating the instance; lifecycle hook {} holds it until {}{why}",
                    self.group,
                    self.hook.name,
                    self.deadline()
                ),
            )
        }
    }
}

/// What an Auto Scaling call's failure means here.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// The instance is not waiting on the hook (completed, timed out, or never waited).
    #[error("no active lifecycle action: {0}")]
    NoActiveAction(String),
    /// Instance metadata says the instance is leaving, but the Auto Scaling API still
    /// reports a state before the termination wait (it is eventually consistent).
    #[error("the Auto Scaling API still reports lifecycle state {0:?}; reading it again")]
    Lagging(String),
    #[error("access denied: {0}")]
    AccessDenied(String),
    #[error("throttled: {0}")]
    Throttled(String),
    #[error("unreachable: {0}")]
    Unreachable(String),
    #[error("{0}")]
    Other(String),
}

impl CallError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::NoActiveAction(_) => "no_active_action",
            Self::Lagging(_) => "lagging",
            Self::AccessDenied(_) => "access_denied",
            Self::Throttled(_) => "throttled",
            Self::Unreachable(_) => "unreachable",
            Self::Other(_) => "error",
        }
    }
}

fn classify<E, R>(e: SdkError<E, R>) -> CallError
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
    R: std::fmt::Debug,
{
    let text = e
        .message()
        .map(str::to_string)
        .unwrap_or_else(|| format!("{e:?}"));
    if matches!(e, SdkError::TimeoutError(_) | SdkError::DispatchFailure(_)) {
        return CallError::Unreachable(text);
    }
    match e.code() {
        Some("AccessDenied" | "AccessDeniedException" | "UnauthorizedOperation") => {
            CallError::AccessDenied(text)
        }
        Some("Throttling" | "ThrottlingException" | "RequestLimitExceeded") => {
            CallError::Throttled(text)
        }
        Some("ValidationError") if text.contains("No active Lifecycle Action") => {
            CallError::NoActiveAction(text)
        }
        _ => CallError::Other(text),
    }
}

/// The Auto Scaling calls this source makes, each counted by operation and result.
struct Api {
    client: aws_sdk_autoscaling::Client,
    instance: String,
    metrics: Metrics,
    /// `--dry-run`: heartbeats and the completion are counted (`dry_run`), never sent.
    dry_run: bool,
    warnings: super::NodeWarnings,
}

impl Api {
    fn count(&self, operation: &'static str, r: &Result<(), &CallError>) {
        let result = match r {
            Ok(()) => "ok",
            Err(e) => e.metric_label(),
        };
        self.metrics
            .asg_calls
            .get_or_create(&OperationResult { operation, result })
            .inc();
    }

    fn count_dry_run(&self, operation: &'static str) {
        self.metrics
            .asg_calls
            .get_or_create(&OperationResult {
                operation,
                result: "dry_run",
            })
            .inc();
    }

    /// The instance's group and lifecycle state; `None` when the group no longer lists it.
    async fn describe_instance(&self) -> Result<Option<(String, String)>, CallError> {
        let r = self
            .client
            .describe_auto_scaling_instances()
            .instance_ids(&self.instance)
            .send()
            .await
            .map_err(classify);
        self.count("DescribeAutoScalingInstances", &r.as_ref().map(|_| ()));
        Ok(r?.auto_scaling_instances().iter().find_map(|i| {
            (i.instance_id() == Some(self.instance.as_str())).then(|| {
                (
                    i.auto_scaling_group_name().unwrap_or_default().to_string(),
                    i.lifecycle_state().unwrap_or_default().to_string(),
                )
            })
        }))
    }

    async fn hooks(&self, group: &str) -> Result<Vec<HookInfo>, CallError> {
        let r = self
            .client
            .describe_lifecycle_hooks()
            .auto_scaling_group_name(group)
            .send()
            .await
            .map_err(classify);
        self.count("DescribeLifecycleHooks", &r.as_ref().map(|_| ()));
        let secs = |s: Option<i32>| {
            s.and_then(|s| u64::try_from(s).ok())
                .map(Duration::from_secs)
        };
        Ok(r?
            .lifecycle_hooks()
            .iter()
            .filter_map(|h| {
                Some(HookInfo {
                    name: h.lifecycle_hook_name()?.to_string(),
                    transition: h.lifecycle_transition()?.to_string(),
                    heartbeat_timeout: secs(h.heartbeat_timeout())?,
                    global_timeout: secs(h.global_timeout()),
                })
            })
            .collect())
    }

    async fn heartbeat(&self, hold: &Hold) -> Result<(), CallError> {
        if self.dry_run {
            self.count_dry_run("RecordLifecycleActionHeartbeat");
            return Ok(());
        }
        let r = self
            .client
            .record_lifecycle_action_heartbeat()
            .auto_scaling_group_name(&hold.group)
            .lifecycle_hook_name(&hold.hook.name)
            .instance_id(&self.instance)
            .send()
            .await
            .map(|_| ())
            .map_err(classify);
        self.count("RecordLifecycleActionHeartbeat", &r.as_ref().copied());
        r
    }

    async fn complete(&self, hold: &Hold) -> Result<(), CallError> {
        if self.dry_run {
            info!(message = "dry run: would complete the Auto Scaling lifecycle action (CONTINUE)", group = %hold.group, hook = %hold.hook.name);
            self.count_dry_run("CompleteLifecycleAction");
            return Ok(());
        }
        let r = self
            .client
            .complete_lifecycle_action()
            .auto_scaling_group_name(&hold.group)
            .lifecycle_hook_name(&hold.hook.name)
            .instance_id(&self.instance)
            .lifecycle_action_result("CONTINUE")
            .send()
            .await
            .map(|_| ())
            .map_err(classify);
        self.count("CompleteLifecycleAction", &r.as_ref().copied());
        r
    }
}

/// Where the source is.
enum Stage {
    /// The instance is in service (or IMDS has not said otherwise yet).
    Watching,
    /// It is leaving; the wait could not be read yet (retried every poll). With the group
    /// and hook known (the API lags behind instance metadata), the wait is heartbeated and
    /// its end announced all the same: it began when instance metadata said so.
    Leaving(Option<Hold>),
    /// Holding the wait.
    Holding(Hold),
    /// Nothing left to do: completed, or there was no wait to hold. The notice stays.
    Done(Option<Timestamp>),
}

/// Builds the Auto Scaling client from the default AWS chain (or the given credentials),
/// with the same bounded retries and timeouts as the GameLift client.
pub async fn sdk_client(
    region: Option<&str>,
    endpoint: Option<&str>,
    credentials: Option<aws_sdk_autoscaling::config::Credentials>,
) -> aws_sdk_autoscaling::Client {
    let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest());
    if let Some(r) = region {
        loader = loader.region(aws_config::Region::new(r.to_string()));
    }
    if let Some(c) = credentials {
        loader = loader.credentials_provider(c);
    }
    let shared = loader.load().await;
    let mut b = aws_sdk_autoscaling::config::Builder::from(&shared)
        .retry_config(aws_config::retry::RetryConfig::standard().with_max_attempts(3))
        .timeout_config(
            aws_config::timeout::TimeoutConfig::builder()
                .operation_attempt_timeout(Duration::from_secs(5))
                .operation_timeout(Duration::from_secs(15))
                .build(),
        );
    if let Some(ep) = endpoint {
        b = b.endpoint_url(ep);
    }
    aws_sdk_autoscaling::Client::from_conf(b.build())
}

/// Where the source learns that the instance is leaving, and which instance it is.
enum Watch {
    /// Instance metadata: `autoscaling/target-lifecycle-state` and `instance-id`.
    Imds(aws_config::imds::client::Client),
    /// Queue mode (`--aws-queue`): the termination lifecycle action pubsub relayed onto the
    /// agent's own Node, and the instance its `spec.providerID` names. No IMDS at all.
    Node(super::KubeAccess, String),
}

impl Watch {
    fn node_instance(kube: &super::KubeAccess, node: &str) -> Option<String> {
        let n = kube
            .node
            .get(&kube::runtime::reflector::ObjectRef::new(node))?;
        let pid = n.spec.as_ref()?.provider_id.as_deref()?;
        lastcall_common::aws_events::instance_of_provider_id(pid).map(str::to_string)
    }

    async fn instance_id(&self) -> Option<String> {
        match self {
            Self::Imds(imds) => match imds.get(INSTANCE_ID_PATH).await {
                Ok(v) if !v.as_ref().trim().is_empty() => Some(v.as_ref().trim().to_string()),
                _ => None,
            },
            Self::Node(kube, node) => Self::node_instance(kube, node),
        }
    }

    /// `Ok(true)`: the group is terminating the instance; `Err`: unknown (not "in service"),
    /// with a bounded reason.
    async fn leaving(&self) -> Result<bool, &'static str> {
        match self {
            Self::Imds(imds) => match imds.get(LIFECYCLE_PATH).await {
                Ok(v) => Ok(v.as_ref().trim() == "Terminated"),
                // Not in an Auto Scaling group (or nothing said yet): not leaving.
                Err(aws_config::imds::client::error::ImdsError::ErrorResponse(r))
                    if r.response().status().as_u16() == 404 =>
                {
                    Ok(false)
                }
                Err(_) => Err("imds"),
            },
            Self::Node(kube, node) => {
                use lastcall_common::aws_events::{ANNOTATION, Event, Record};
                let n = kube
                    .node
                    .get(&kube::runtime::reflector::ObjectRef::new(node))
                    .ok_or("node")?;
                let instance = Self::node_instance(kube, node).ok_or("node")?;
                let Some(raw) = n
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(ANNOTATION))
                else {
                    return Ok(false);
                };
                // An unreadable record is the queue source's to report; here it says nothing.
                let record = Record::parse(raw).map_err(|_| "node")?;
                let now = Timestamp::now();
                Ok(record.for_instance(&instance).any(|e| {
                    matches!(e.event, Event::TerminateLifecycleAction { .. })
                        && e.time
                            .checked_add(SignedDuration::try_from(MAX_WAIT).unwrap_or_default())
                            .is_ok_and(|end| now < end)
                }))
            }
        }
    }
}

pub fn start(ctx: SourceContext) -> Option<BoxFuture<'static, ()>> {
    if !ctx.config.asg_lifecycle {
        return None;
    }
    if ctx.config.aws_queue {
        let Some(kube) = ctx.kube.clone() else {
            warn!(
                message =
                    "queue mode needs the API server's Node; Auto Scaling lifecycle source off"
            );
            return None;
        };
        let node = ctx.config.node_name.clone();
        return Some(run(ctx, Watch::Node(kube, node)).boxed());
    }
    let imds = match aws_config::imds::client::Client::builder()
        .endpoint(&ctx.config.imds_endpoint)
        .map(|b| {
            b.connect_timeout(Duration::from_secs(1))
                .read_timeout(Duration::from_secs(1))
                .max_attempts(2)
                .build()
        }) {
        Ok(c) => c,
        Err(e) => {
            warn!(message = "bad --imds-endpoint; Auto Scaling lifecycle source off", error = %e);
            return None;
        }
    };
    Some(run(ctx, Watch::Imds(imds)).boxed())
}

async fn run(ctx: SourceContext, watch: Watch) {
    let c = ctx.config.clone();
    let metrics = ctx.metrics.clone();
    let up = |ok: bool| {
        metrics
            .source_up
            .get_or_create(&SourceLabel {
                source: SOURCE.as_str(),
            })
            .set(i64::from(ok));
    };
    let error = |reason: &'static str| {
        metrics
            .source_errors
            .get_or_create(&SourceReason {
                source: SOURCE.as_str(),
                reason,
            })
            .inc();
    };
    // The instance id: from the flag, else IMDS or the Node (retried until it answers).
    let instance = loop {
        if let Some(id) = &c.instance_id {
            break id.clone();
        }
        match watch.instance_id().await {
            Some(id) => break id,
            None => {
                up(false);
                error("instance_id");
                tokio::select! {
                    () = ctx.shutdown.cancelled() => return,
                    () = tokio::time::sleep(c.asg_interval) => continue,
                }
            }
        }
    };
    let api = Api {
        client: sdk_client(
            c.aws_region.as_deref(),
            c.asg_endpoint.as_deref(),
            ctx.aws_credentials.clone(),
        )
        .await,
        instance,
        metrics: metrics.clone(),
        dry_run: c.dry_run,
        warnings: ctx.node_warnings.clone(),
    };
    let mut empty = ctx.node_empty.clone();
    let mut empty_open = true;
    let mut stage = Stage::Watching;
    // When instance metadata first said the instance is leaving: the wait began then at the
    // latest, however long the Auto Scaling API lags behind.
    let mut leaving_since: Option<Timestamp> = None;
    // Since when the API has lagged behind instance metadata.
    let mut lagging_since: Option<tokio::time::Instant> = None;
    let mut next_poll = tokio::time::Instant::now();
    let mut next_heartbeat = next_poll;
    loop {
        let wake = match &stage {
            Stage::Watching | Stage::Leaving(None) => next_poll,
            Stage::Leaving(Some(_)) => next_poll.min(next_heartbeat),
            // A standby also looks again each second: it completes nothing until it acts.
            Stage::Holding(_) if !ctx.acting.now() => {
                next_heartbeat.min(tokio::time::Instant::now() + STANDBY_RECHECK)
            }
            Stage::Holding(_) => next_heartbeat,
            Stage::Done(_) => next_poll + Duration::from_secs(86_400),
        };
        tokio::select! {
            () = ctx.shutdown.cancelled() => return,
            () = tokio::time::sleep_until(wake) => {}
            r = empty.changed(), if empty_open => empty_open = r.is_ok(),
        }
        let now = tokio::time::Instant::now();
        // IMDS: is the instance leaving? Read every --asg-interval until it is.
        if matches!(stage, Stage::Watching | Stage::Leaving(_)) && now >= next_poll {
            next_poll = now + c.asg_interval;
            match watch.leaving().await {
                Ok(true) => {
                    up(true);
                    let seen = *leaving_since.get_or_insert_with(Timestamp::now);
                    let known = match &mut stage {
                        Stage::Leaving(h) => h.take(),
                        _ => None,
                    };
                    let was_known = known.is_some();
                    stage = match discover(&api, &c, seen, known.clone()).await {
                        Ok(Discovered::Stage(s)) => s,
                        Ok(Discovered::Lagging(state, hold)) => {
                            let since = *lagging_since.get_or_insert(now);
                            let lag = now.saturating_duration_since(since);
                            metrics
                                .asg_state_lag
                                .set(i64::try_from(lag.as_secs()).unwrap_or(i64::MAX));
                            error("lagging");
                            if lag >= LAG_LIMIT {
                                warn!(message = "Auto Scaling lifecycle: the API never reported the termination wait; any wait has ended by now", state = %state, lagged_secs = lag.as_secs());
                                Stage::Done(None)
                            } else {
                                if !was_known {
                                    info!(message = "Auto Scaling lifecycle: instance metadata says the instance is leaving, but the API still reports an earlier state; heartbeating the wait and reading again", state = %state, group = %hold.group, hook = %hold.hook.name, deadline = %hold.deadline());
                                    next_heartbeat = now;
                                }
                                Stage::Leaving(Some(hold))
                            }
                        }
                        Err(CallError::Lagging(state)) => {
                            let since = *lagging_since.get_or_insert(now);
                            let lag = now.saturating_duration_since(since);
                            metrics
                                .asg_state_lag
                                .set(i64::try_from(lag.as_secs()).unwrap_or(i64::MAX));
                            error("lagging");
                            if lag >= LAG_LIMIT {
                                warn!(message = "Auto Scaling lifecycle: the API never reported the termination wait; any wait has ended by now", state = %state, lagged_secs = lag.as_secs());
                                Stage::Done(None)
                            } else {
                                info!(message = "Auto Scaling lifecycle: instance metadata says the instance is leaving, but the API still reports an earlier state; reading again", state = %state, lagged_secs = lag.as_secs());
                                Stage::Leaving(None)
                            }
                        }
                        Err(e) => {
                            error(e.metric_label());
                            warn!(message = "Auto Scaling lifecycle: the instance is leaving, but its hook wait could not be read; retrying", error = %e);
                            // A wait already known is still heartbeated meanwhile.
                            Stage::Leaving(known)
                        }
                    };
                    if !matches!(stage, Stage::Leaving(_)) && lagging_since.take().is_some() {
                        metrics.asg_state_lag.set(0);
                    }
                    if let Stage::Holding(h) = &stage {
                        info!(message = "Auto Scaling lifecycle wait found; holding the instance", group = %h.group, hook = %h.hook.name, deadline = %h.deadline());
                        next_heartbeat = now;
                    }
                }
                Ok(false) => up(true),
                Err(reason) => {
                    // Unknown is not "in service": keep the last report.
                    up(false);
                    error(reason);
                    continue;
                }
            }
        }
        let node_empty = *empty.borrow();
        if let Stage::Leaving(Some(hold)) = &mut stage {
            // The wait the API does not show yet: kept with heartbeats, never completed
            // before it shows (an answer of "no active action" says nothing yet).
            lagging_heartbeat(&api, hold, &mut next_heartbeat, &error).await;
        }
        if let Stage::Holding(hold) = &mut stage {
            let acting = ctx.acting.now();
            stage = hold_step(&api, hold, acting, node_empty, &mut next_heartbeat, &error).await;
            if !matches!(stage, Stage::Holding(_)) {
                metrics.asg_heartbeat_denied.set(0);
            }
        }
        let report = match &stage {
            Stage::Watching => Report::Known(vec![]),
            Stage::Leaving(None) => Report::Known(vec![leaving(None)]),
            Stage::Leaving(Some(h)) => Report::Known(vec![h.notice()]),
            Stage::Holding(h) => Report::Known(vec![h.notice()]),
            Stage::Done(deadline) => Report::Known(vec![leaving(*deadline)]),
        };
        super::publish(&ctx.out, report);
    }
}

/// Heartbeats a wait the API does not show yet, when due. A heartbeat only moves the
/// wait's timeout, so a standby sends it too (as while holding). Refused for good
/// (AccessDenied), or answered "no active action" (the API lags here too, or the wait is
/// not there): tried again at the next heartbeat time, the wait read again meanwhile.
async fn lagging_heartbeat(
    api: &Api,
    hold: &mut Hold,
    next_heartbeat: &mut tokio::time::Instant,
    error: &impl Fn(&'static str),
) {
    let now = tokio::time::Instant::now();
    if now < *next_heartbeat || Timestamp::now() >= hold.cap {
        return;
    }
    *next_heartbeat = now + hold.heartbeat_every();
    match api.heartbeat(hold).await {
        Ok(()) => hold.heartbeat_accepted(Timestamp::now()),
        Err(e) => {
            error(e.metric_label());
            warn!(message = "Auto Scaling lifecycle: heartbeat of a wait the API does not show yet failed; trying again", error = %e);
        }
    }
}

/// How often a standby agent holding a wait looks whether it acts yet.
const STANDBY_RECHECK: Duration = Duration::from_secs(1);

/// One step of holding the wait: complete it once the node is empty (the acting agent
/// only), else heartbeat when due. Returns the next stage.
///
/// A standby heartbeats too, while the node holds matches. A heartbeat changes nothing but
/// when the wait times out, and were only the owner to send them, nobody would from the
/// old owner's last heartbeat through its stop and the successor's takeover: a slow stop or
/// refused Node writes during a rollout could outlast the hook's timeout and take the
/// instance from under its matches. Completing stays the owner's alone, and a standby
/// raises no Warning Event.
async fn hold_step(
    api: &Api,
    hold: &mut Hold,
    acting: bool,
    node_empty: bool,
    next_heartbeat: &mut tokio::time::Instant,
    error: &impl Fn(&'static str),
) -> Stage {
    let now = tokio::time::Instant::now();
    // A denial seen while standing by is told once this agent acts.
    tell_denial(api, hold, acting);
    if node_empty && !acting {
        // Nothing left to keep: the wait is the owner's to complete, or to time out.
        return Stage::Holding(hold.clone());
    }
    if node_empty {
        return match api.complete(hold).await {
            Ok(()) | Err(CallError::NoActiveAction(_)) => {
                info!(message = "Auto Scaling lifecycle action completed (CONTINUE): the node is empty", group = %hold.group, hook = %hold.hook.name);
                Stage::Done(Some(hold.deadline()))
            }
            Err(e) => {
                error(e.metric_label());
                warn!(message = "completing the Auto Scaling lifecycle action failed; retrying", error = %e);
                *next_heartbeat = now + Duration::from_secs(1);
                Stage::Holding(hold.clone())
            }
        };
    }
    if Timestamp::now() >= hold.cap {
        // The wait is over whatever anyone does: the instance is going.
        return Stage::Done(Some(hold.deadline()));
    }
    if now < *next_heartbeat {
        return Stage::Holding(hold.clone());
    }
    *next_heartbeat = now + hold.heartbeat_every();
    match api.heartbeat(hold).await {
        Ok(()) => {
            hold.heartbeat_accepted(Timestamp::now());
            api.metrics.asg_heartbeat_denied.set(0);
        }
        Err(CallError::NoActiveAction(e)) => {
            // Completed elsewhere, or timed out: nothing left to hold.
            info!(message = "no active Auto Scaling lifecycle action left to hold", detail = %e);
            return Stage::Done(Some(hold.deadline()));
        }
        Err(e) => {
            error(e.metric_label());
            if matches!(e, CallError::AccessDenied(_)) {
                if !hold.heartbeats_denied {
                    warn!(message = "RecordLifecycleActionHeartbeat is denied: the instance goes at the hook's heartbeat timeout; grant autoscaling:RecordLifecycleActionHeartbeat (docs/install.md)", error = %e, deadline = %hold.expires);
                }
                api.metrics.asg_heartbeat_denied.set(1);
                hold.heartbeats_denied = true;
                tell_denial(api, hold, acting);
            } else {
                warn!(message = "Auto Scaling lifecycle heartbeat failed; retrying", error = %e);
                *next_heartbeat = now + Duration::from_secs(1).min(hold.heartbeat_every());
            }
        }
    }
    Stage::Holding(hold.clone())
}

/// Tells refused heartbeats on the Node, once, and only as the acting agent.
fn tell_denial(api: &Api, hold: &mut Hold, acting: bool) {
    if acting && hold.heartbeats_denied && !hold.denial_told {
        api.warnings
            .warn(HEARTBEAT_DENIED, heartbeat_denied_note(hold));
        hold.denial_told = true;
    }
}

/// The Warning Event's reason when the Auto Scaling API refuses heartbeats.
pub const HEARTBEAT_DENIED: &str = "LifecycleHeartbeatDenied";

/// Says what is missing and what it costs: without heartbeats the wait ends at the hook's
/// heartbeat timeout, whatever is still running.
pub fn heartbeat_denied_note(hold: &Hold) -> String {
    format!(
        "The Auto Scaling API refused RecordLifecycleActionHeartbeat (AccessDenied): the node's IAM role lacks autoscaling:RecordLifecycleActionHeartbeat on group {}. lastcall cannot hold the instance past lifecycle hook {}'s heartbeat timeout: it goes at {} whatever is still running. Grant the action (docs/asg-lifecycle.md).",
        hold.group,
        hold.hook.name,
        hold.expires.min(hold.cap)
    )
}

/// The notice while no wait is held: the instance is going, when is not known.
fn leaving(deadline: Option<Timestamp>) -> Notice {
    Notice::new(
        SOURCE,
        Cause::ScaleDown,
        Severity::Terminate,
        deadline,
        false,
        "Auto Scaling group is terminating the instance".into(),
    )
}

/// What reading the group found.
enum Discovered {
    Stage(Stage),
    /// Instance metadata says the instance is leaving, the API still reports this earlier
    /// state: the wait, as far as it can be known (group and hook), to heartbeat meanwhile.
    Lagging(String, Hold),
}

/// Finds the wait to hold; `Done` when the instance is leaving without one. `seen` is when
/// instance metadata first said the instance is leaving (the wait began by then); `known`,
/// the wait as read while the API lagged (its hook is not read again).
async fn discover(
    api: &Api,
    c: &crate::config::Config,
    seen: Timestamp,
    known: Option<Hold>,
) -> Result<Discovered, CallError> {
    let Some((group, state)) = api.describe_instance().await? else {
        return Ok(Discovered::Stage(Stage::Done(None)));
    };
    let group = c.asg_group_name.clone().unwrap_or(group);
    let waiting = match lifecycle(&state) {
        Lifecycle::Waiting => true,
        // Already proceeding (completed before a restart, or no hook): nothing to hold.
        Lifecycle::Past => return Ok(Discovered::Stage(Stage::Done(None))),
        // IMDS is ahead of the API: the wait is there or coming; read again.
        Lifecycle::Before => false,
    };
    let hold = match known.filter(|h| h.group == group) {
        Some(h) => h,
        None => {
            let hooks = api.hooks(&group).await?;
            match pick_hook(&hooks, c.asg_hook_name.as_deref()) {
                Ok(hook) => Hold::new(group, hook, seen, c.asg_interval),
                Err(e) if waiting => return Err(CallError::Other(e.to_string())),
                // No hook to hold (yet): read again while the API lags.
                Err(_) => return Err(CallError::Lagging(state)),
            }
        }
    };
    Ok(if waiting {
        Discovered::Stage(Stage::Holding(hold))
    } else {
        Discovered::Lagging(state, hold)
    })
}

/// Where a lifecycle state stands against the termination wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lifecycle {
    /// Not there yet: in service, or terminating before the hook parked it.
    Before,
    Waiting,
    /// Proceeding, terminated, or some other state no wait follows (detaching, standby).
    Past,
}

fn lifecycle(state: &str) -> Lifecycle {
    match state {
        "Terminating:Wait" => Lifecycle::Waiting,
        "InService" | "Terminating" | "Pending" | "Pending:Wait" | "Pending:Proceed" => {
            Lifecycle::Before
        }
        _ => Lifecycle::Past,
    }
}

#[cfg(test)]
mod tests;
