//! Pages through `DescribeGameServerInstances` for one group, with our own backoff.
//!
//! The SDK's retries are disabled (see [`gamelift_client`]) so that every attempt, every
//! throttle and every backoff is visible in metrics and bounded by the cycle's request budget.
//! Throttling, 5xx, timeouts and connection failures are retried with jittered exponential
//! backoff; anything else (unknown group, bad credentials, invalid request) fails the group for
//! this cycle only.

use std::error::Error as StdError;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use aws_sdk_gamelift::config::Credentials;
use aws_sdk_gamelift::config::http::HttpResponse;
use aws_sdk_gamelift::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_gamelift::types::GameServerInstance;
use lastcall_common::backoff::Backoff;
use lastcall_common::fleetiq::{InstanceStatus, python_json, trim_for_log};
use tokio::time::Instant;

use crate::config::Config;
use crate::metrics::{Metrics, ReasonLabels};
use crate::publisher::Outgoing;
use crate::rate::RateLimiter;

/// Metric label for statuses this version does not know (published as-is).
pub use crate::metrics::UNKNOWN_STATUS;

/// Builds the GameLift client the way production runs it: region and endpoint from the
/// config, credentials from the SDK's default chain unless `credentials` is given (tests),
/// the SDK's own retries off and a timeout per attempt.
pub async fn gamelift_client(
    config: &Config,
    credentials: Option<Credentials>,
) -> aws_sdk_gamelift::Client {
    use aws_config::retry::RetryConfig;
    use aws_config::timeout::TimeoutConfig;

    let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .retry_config(RetryConfig::disabled())
        .timeout_config(
            TimeoutConfig::builder()
                .connect_timeout(config.api_timeout)
                .operation_attempt_timeout(config.api_timeout)
                .build(),
        );
    if let Some(region) = &config.aws_region {
        loader = loader.region(aws_config::Region::new(region.clone()));
    }
    if let Some(endpoint) = &config.gamelift_endpoint {
        loader = loader.endpoint_url(endpoint.clone());
    }
    if let Some(credentials) = credentials {
        loader = loader.credentials_provider(credentials);
    }
    aws_sdk_gamelift::Client::new(&loader.load().await)
}

/// Why polling a group failed (or why one attempt failed). Labels are fixed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PollErrorKind {
    Throttled,
    ServerError,
    Timeout,
    Connection,
    NotFound,
    Unauthorized,
    InvalidRequest,
    Credentials,
    MalformedResponse,
    PaginationLoop,
    BudgetExhausted,
    Deadline,
    Other,
}

impl PollErrorKind {
    pub const ALL: [PollErrorKind; 13] = [
        Self::Throttled,
        Self::ServerError,
        Self::Timeout,
        Self::Connection,
        Self::NotFound,
        Self::Unauthorized,
        Self::InvalidRequest,
        Self::Credentials,
        Self::MalformedResponse,
        Self::PaginationLoop,
        Self::BudgetExhausted,
        Self::Deadline,
        Self::Other,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Self::Throttled => "throttled",
            Self::ServerError => "server_error",
            Self::Timeout => "timeout",
            Self::Connection => "connection",
            Self::NotFound => "not_found",
            Self::Unauthorized => "unauthorized",
            Self::InvalidRequest => "invalid_request",
            Self::Credentials => "credentials",
            Self::MalformedResponse => "malformed_response",
            Self::PaginationLoop => "pagination_loop",
            Self::BudgetExhausted => "budget_exhausted",
            Self::Deadline => "deadline",
            Self::Other => "other",
        }
    }

    /// Transient failures worth another attempt after a backoff.
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            Self::Throttled | Self::ServerError | Self::Timeout | Self::Connection
        )
    }
}

/// A group that could not be polled this cycle.
#[derive(Debug, thiserror::Error)]
#[error("{kind:?} after {attempts} attempt(s): {message}")]
pub struct PollError {
    pub kind: PollErrorKind,
    pub attempts: u32,
    pub message: String,
}

/// Maps an SDK error to a fixed kind. GameLift's throttling error is not modelled, so it
/// arrives as an unhandled service error with code `ThrottlingException`.
pub fn classify<E: ProvideErrorMetadata + StdError + 'static>(
    err: &SdkError<E, HttpResponse>,
) -> PollErrorKind {
    match err {
        SdkError::ServiceError(se) => {
            let status = se.raw().status().as_u16();
            match se.err().code() {
                Some(
                    "ThrottlingException"
                    | "ThrottledException"
                    | "TooManyRequestsException"
                    | "RequestLimitExceeded",
                ) => PollErrorKind::Throttled,
                Some("NotFoundException") => PollErrorKind::NotFound,
                Some(
                    "UnauthorizedException"
                    | "AccessDeniedException"
                    | "UnrecognizedClientException"
                    | "InvalidSignatureException"
                    | "ExpiredTokenException",
                ) => PollErrorKind::Unauthorized,
                Some("InvalidRequestException" | "ValidationException") => {
                    PollErrorKind::InvalidRequest
                }
                Some("InternalServiceException" | "ServiceUnavailableException") => {
                    PollErrorKind::ServerError
                }
                _ if status == 429 => PollErrorKind::Throttled,
                _ if status >= 500 => PollErrorKind::ServerError,
                _ => PollErrorKind::Other,
            }
        }
        SdkError::TimeoutError(_) => PollErrorKind::Timeout,
        SdkError::DispatchFailure(df) => {
            if mentions_credentials(err) {
                PollErrorKind::Credentials
            } else if df.is_timeout() {
                PollErrorKind::Timeout
            } else if df.is_io() {
                PollErrorKind::Connection
            } else {
                PollErrorKind::Other
            }
        }
        SdkError::ResponseError(_) => PollErrorKind::MalformedResponse,
        SdkError::ConstructionFailure(_) if mentions_credentials(err) => PollErrorKind::Credentials,
        _ => PollErrorKind::Other,
    }
}

/// Credential resolution failures surface as generic dispatch or construction errors; the
/// only stable signal is the provider's message in the source chain.
fn mentions_credentials(err: &(dyn StdError + 'static)) -> bool {
    let mut cur: Option<&(dyn StdError + 'static)> = Some(err);
    while let Some(e) = cur {
        if e.to_string().to_ascii_lowercase().contains("credential") {
            return true;
        }
        cur = e.source();
    }
    false
}

/// Why one instance entry of an answer was skipped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InvalidInstance {
    MissingInstanceId,
    InvalidInstanceId(String),
    MissingStatus,
    /// A status string that could not be a GameLift enum value (empty, long, odd bytes).
    InvalidStatus(String),
}

impl InvalidInstance {
    pub fn label(&self) -> &'static str {
        match self {
            Self::MissingInstanceId => "missing_instance_id",
            Self::InvalidInstanceId(_) => "invalid_instance_id",
            Self::MissingStatus => "missing_status",
            Self::InvalidStatus(_) => "invalid_status",
        }
    }
}

/// One instance as polled: what to publish, and its status if this version knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Polled {
    pub outgoing: Outgoing,
    /// `None` for a status this version does not know; it is published as-is all the same,
    /// as the original did, and agents hold on it.
    pub status: Option<InstanceStatus>,
}

/// Parses one entry of GameLift's answer into the message published for it, keeping the
/// fields exactly as GameLift returned them (that is what the original published).
pub fn to_polled(inst: &GameServerInstance, polled_at: Instant) -> Result<Polled, InvalidInstance> {
    let instance_id = inst
        .instance_id()
        .filter(|s| !s.is_empty())
        .ok_or(InvalidInstance::MissingInstanceId)?;
    // The id becomes a Redis channel and key: keep it to something an EC2 id can look like.
    if instance_id.len() > 128
        || instance_id
            .chars()
            .any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(InvalidInstance::InvalidInstanceId(trim_for_log(
            instance_id,
            64,
        )));
    }
    let raw_status = inst
        .instance_status()
        .ok_or(InvalidInstance::MissingStatus)?
        .as_str();
    let plausible = !raw_status.is_empty()
        && raw_status.len() <= 64
        && raw_status
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
    if !plausible {
        return Err(InvalidInstance::InvalidStatus(trim_for_log(raw_status, 64)));
    }
    Ok(Polled {
        outgoing: Outgoing {
            instance_id: instance_id.to_string(),
            body: python_json(
                inst.game_server_group_name(),
                inst.game_server_group_arn(),
                instance_id,
                raw_status,
            ),
            polled_at,
        },
        status: InstanceStatus::parse(raw_status),
    })
}

/// Calls left in the current cycle (retries included).
#[derive(Debug)]
pub struct Budget(AtomicU32);

impl Budget {
    pub fn new(calls: u32) -> Self {
        Self(AtomicU32::new(calls))
    }

    fn try_take(&self) -> bool {
        self.0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok()
    }
}

/// Counts for one group's poll, kept even when it fails.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PollStats {
    pub api_calls: u64,
    pub pages: u64,
    pub retries: u64,
    pub invalid: u64,
}

/// The result of polling one group: its pages went to the caller's channel as they came.
#[derive(Debug)]
pub struct GroupPoll {
    pub stats: PollStats,
    pub result: Result<(), PollError>,
}

/// Where each page's statuses go as soon as the page is read.
pub type Pages = tokio::sync::mpsc::UnboundedSender<Vec<Polled>>;

/// Most invalid entries logged one by one per group and cycle; the rest are summarised.
const INVALID_LOG_LINES: u64 = 5;

/// Polls groups through one GameLift client.
#[derive(Clone, Debug)]
pub struct Poller {
    client: aws_sdk_gamelift::Client,
    retry_base: Duration,
    retry_max: Duration,
    max_attempts: u32,
    metrics: Metrics,
}

impl Poller {
    pub fn new(client: aws_sdk_gamelift::Client, config: &Config, metrics: Metrics) -> Self {
        Self {
            client,
            retry_base: config.retry_base,
            retry_max: config.retry_max,
            max_attempts: config.api_max_attempts,
            metrics,
        }
    }

    /// Every instance of `group`, following `NextToken` to the end, each page sent to
    /// `pages` as soon as it is read: a later page that fails (after its retries) costs
    /// only that page and the ones after it, never the statuses already read (a
    /// SPOT_TERMINATING among them). Entries GameLift answered badly are counted, logged
    /// and skipped; the rest of the page is kept.
    pub async fn poll_group(
        &self,
        group: &str,
        budget: &Budget,
        limiter: &RateLimiter,
        deadline: Instant,
        pages: &Pages,
    ) -> GroupPoll {
        let mut stats = PollStats::default();
        let mut seen_tokens: Vec<String> = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let (page, polled_at) = match self
                .describe_page(group, token.clone(), budget, limiter, deadline, &mut stats)
                .await
            {
                Ok(page) => page,
                Err(e) => {
                    return GroupPoll {
                        stats,
                        result: Err(e),
                    };
                }
            };
            stats.pages += 1;
            let mut messages = Vec::with_capacity(page.game_server_instances().len());
            for inst in page.game_server_instances() {
                match to_polled(inst, polled_at) {
                    Ok(m) => messages.push(m),
                    Err(invalid) => self.skip_invalid(group, &invalid, &mut stats),
                }
            }
            if !messages.is_empty() {
                // The receiver outlives the poll; if it is gone the cycle is over anyway.
                let _ = pages.send(messages);
            }
            match page.next_token().filter(|t| !t.is_empty()) {
                None => break,
                Some(next) if seen_tokens.iter().any(|t| t == next) => {
                    let e = PollError {
                        kind: PollErrorKind::PaginationLoop,
                        attempts: 1,
                        message: format!("NextToken repeated after {} pages", stats.pages),
                    };
                    return GroupPoll {
                        stats,
                        result: Err(e),
                    };
                }
                Some(next) => {
                    seen_tokens.push(next.to_string());
                    token = Some(next.to_string());
                }
            }
        }
        if stats.invalid > INVALID_LOG_LINES {
            tracing::warn!(
                message = "skipped invalid instance entries",
                group,
                skipped = stats.invalid
            );
        }
        GroupPoll {
            stats,
            result: Ok(()),
        }
    }

    fn skip_invalid(&self, group: &str, invalid: &InvalidInstance, stats: &mut PollStats) {
        stats.invalid += 1;
        Metrics::reason(&self.metrics.invalid_instances, invalid.label());
        if stats.invalid <= INVALID_LOG_LINES {
            tracing::warn!(
                message = "skipping invalid instance entry",
                group,
                reason = invalid.label(),
                detail = ?invalid
            );
        }
    }

    /// One page, retried with backoff while the failure is transient.
    async fn describe_page(
        &self,
        group: &str,
        token: Option<String>,
        budget: &Budget,
        limiter: &RateLimiter,
        deadline: Instant,
        stats: &mut PollStats,
    ) -> Result<
        (
            aws_sdk_gamelift::operation::describe_game_server_instances::DescribeGameServerInstancesOutput,
            Instant,
        ),
        PollError,
    >{
        let mut backoff = Backoff::new(self.retry_base, self.retry_max);
        let mut attempts = 0u32;
        loop {
            if !budget.try_take() {
                return Err(PollError {
                    kind: PollErrorKind::BudgetExhausted,
                    attempts,
                    message: "the cycle's API budget (--api-budget) is used up".into(),
                });
            }
            match limiter.acquire(deadline).await {
                Ok(waited) => {
                    self.metrics
                        .api_rate_wait_seconds
                        .inc_by(waited.as_secs_f64());
                }
                Err(waited) => {
                    self.metrics
                        .api_rate_wait_seconds
                        .inc_by(waited.as_secs_f64());
                    return Err(PollError {
                        kind: PollErrorKind::Deadline,
                        attempts,
                        message: "the cycle deadline (--cycle-deadline) passed while waiting for the API rate limit".into(),
                    });
                }
            }
            attempts += 1;
            stats.api_calls += 1;
            let started = Instant::now();
            // The answer reflects GameLift at some moment after this: the status is at
            // least this fresh, which is what ordering between replicas needs.
            let sent_at = Instant::now();
            let sent = self
                .client
                .describe_game_server_instances()
                .game_server_group_name(group)
                .set_next_token(token.clone())
                .send()
                .await;
            self.metrics
                .api_call_duration
                .observe(started.elapsed().as_secs_f64());
            let err = match sent {
                Ok(out) => {
                    self.metrics.api_call("ok");
                    limiter.succeeded();
                    return Ok((out, sent_at));
                }
                Err(err) => err,
            };
            let kind = classify(&err);
            self.metrics.api_call(kind.label());
            let message = trim_for_log(&DisplayErrorContext(&err).to_string(), 300);
            if kind == PollErrorKind::Throttled {
                // Everyone slows down, not only this page, and also when this was the
                // page's last attempt: the throttle was GameLift's answer to all of us.
                limiter.throttled();
                self.metrics.api_throttle_slowdowns.inc();
            }
            if !kind.is_retryable() || attempts >= self.max_attempts {
                return Err(PollError {
                    kind,
                    attempts,
                    message,
                });
            }
            let delay = backoff.next_delay();
            if Instant::now() + delay > deadline {
                return Err(PollError {
                    kind: PollErrorKind::Deadline,
                    attempts,
                    message: format!("the cycle deadline passes before the next retry ({message})"),
                });
            }
            stats.retries += 1;
            Metrics::reason(&self.metrics.api_retries, kind.label());
            self.metrics
                .api_backoff_seconds
                .get_or_create(&ReasonLabels {
                    reason: kind.label(),
                })
                .inc_by(delay.as_secs_f64());
            tracing::debug!(
                message = "GameLift call failed, backing off",
                group,
                reason = kind.label(),
                attempt = attempts,
                delay_ms = delay.as_millis() as u64,
                error = %message
            );
            tokio::time::sleep(delay).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_sdk_gamelift::types::GameServerInstanceStatus;

    fn inst() -> aws_sdk_gamelift::types::builders::GameServerInstanceBuilder {
        GameServerInstance::builder()
            .game_server_group_name("g")
            .game_server_group_arn("arn:aws:gamelift:us-west-2:1:gameservergroup/g")
            .instance_id("i-1")
    }

    #[test]
    fn converts_entries_keeping_gamelift_fields() {
        let at = Instant::now();
        let m = to_polled(
            &inst()
                .instance_status(GameServerInstanceStatus::Draining)
                .build(),
            at,
        )
        .unwrap();
        assert_eq!(m.status, Some(InstanceStatus::Draining));
        assert_eq!(m.outgoing.polled_at, at);
        assert_eq!(
            m.outgoing.body,
            r#"{"GameServerGroupName": "g", "GameServerGroupArn": "arn:aws:gamelift:us-west-2:1:gameservergroup/g", "InstanceId": "i-1", "InstanceStatus": "DRAINING"}"#
        );
        let bare = GameServerInstance::builder()
            .instance_id("i-2")
            .instance_status(GameServerInstanceStatus::Active)
            .build();
        assert_eq!(
            to_polled(&bare, Instant::now()).unwrap().outgoing.body,
            r#"{"InstanceId": "i-2", "InstanceStatus": "ACTIVE"}"#
        );
    }

    #[test]
    fn unknown_statuses_are_published_as_is() {
        let m = to_polled(
            &inst()
                .instance_status(GameServerInstanceStatus::from("HIBERNATING"))
                .build(),
            Instant::now(),
        )
        .unwrap();
        assert_eq!(m.status, None);
        assert!(
            m.outgoing
                .body
                .ends_with(r#""InstanceStatus": "HIBERNATING"}"#)
        );
    }

    #[test]
    fn rejects_unusable_entries() {
        let cases = [
            (inst().build(), "missing_status"),
            (
                inst()
                    .instance_status(GameServerInstanceStatus::from("exploding now"))
                    .build(),
                "invalid_status",
            ),
            (
                GameServerInstance::builder()
                    .instance_status(GameServerInstanceStatus::Active)
                    .build(),
                "missing_instance_id",
            ),
            (
                inst()
                    .instance_id("")
                    .instance_status(GameServerInstanceStatus::Active)
                    .build(),
                "missing_instance_id",
            ),
            (
                inst()
                    .instance_id("i-1 2")
                    .instance_status(GameServerInstanceStatus::Active)
                    .build(),
                "invalid_instance_id",
            ),
        ];
        for (entry, label) in cases {
            assert_eq!(
                to_polled(&entry, Instant::now()).unwrap_err().label(),
                label,
                "{entry:?}"
            );
        }
    }

    #[test]
    fn budget_runs_out() {
        let b = Budget::new(2);
        assert!(b.try_take());
        assert!(b.try_take());
        assert!(!b.try_take());
    }

    fn service_error(
        code: &str,
        status: u16,
    ) -> SdkError<
        aws_sdk_gamelift::operation::describe_game_server_instances::DescribeGameServerInstancesError,
        HttpResponse,
    >{
        use aws_sdk_gamelift::error::ErrorMetadata;
        use aws_sdk_gamelift::operation::describe_game_server_instances::DescribeGameServerInstancesError as E;
        let err = E::generic(
            ErrorMetadata::builder()
                .code(code)
                .message("injected")
                .build(),
        );
        let raw = HttpResponse::new(
            status.try_into().unwrap(),
            aws_smithy_types::body::SdkBody::empty(),
        );
        SdkError::service_error(err, raw)
    }

    #[test]
    fn classifies_service_errors() {
        let cases = [
            ("ThrottlingException", 400, PollErrorKind::Throttled),
            ("NotFoundException", 400, PollErrorKind::NotFound),
            ("UnauthorizedException", 401, PollErrorKind::Unauthorized),
            (
                "InvalidRequestException",
                400,
                PollErrorKind::InvalidRequest,
            ),
            ("InternalServiceException", 500, PollErrorKind::ServerError),
            ("SomethingNew", 503, PollErrorKind::ServerError),
            ("SomethingNew", 429, PollErrorKind::Throttled),
            ("SomethingNew", 400, PollErrorKind::Other),
        ];
        for (code, status, kind) in cases {
            assert_eq!(
                classify(&service_error(code, status)),
                kind,
                "{code} {status}"
            );
        }
    }

    #[test]
    fn classifies_transport_errors() {
        use aws_sdk_gamelift::error::ConnectorError;
        type E = aws_sdk_gamelift::operation::describe_game_server_instances::DescribeGameServerInstancesError;
        let timeout: SdkError<E, HttpResponse> = SdkError::timeout_error("slow");
        assert_eq!(classify(&timeout), PollErrorKind::Timeout);
        let refused: SdkError<E, HttpResponse> =
            SdkError::dispatch_failure(ConnectorError::io("connection refused".into()));
        assert_eq!(classify(&refused), PollErrorKind::Connection);
        let creds: SdkError<E, HttpResponse> = SdkError::dispatch_failure(ConnectorError::other(
            "failed to load credentials".into(),
            None,
        ));
        assert_eq!(classify(&creds), PollErrorKind::Credentials);
        let other: SdkError<E, HttpResponse> = SdkError::construction_failure("bad input");
        assert_eq!(classify(&other), PollErrorKind::Other);
    }

    /// The real path: a provider that finds no credentials fails the call before it is sent.
    #[tokio::test]
    async fn missing_credentials_are_classified_as_such() {
        if std::env::var_os("AWS_ACCESS_KEY_ID").is_some() {
            return; // this environment has credentials
        }
        let conf = aws_sdk_gamelift::Config::builder()
            .behavior_version(aws_sdk_gamelift::config::BehaviorVersion::latest())
            .region(aws_sdk_gamelift::config::Region::new("us-west-2"))
            .endpoint_url("http://127.0.0.1:9")
            .retry_config(aws_sdk_gamelift::config::retry::RetryConfig::disabled())
            .credentials_provider(
                aws_config::environment::EnvironmentVariableCredentialsProvider::new(),
            )
            .build();
        let err = aws_sdk_gamelift::Client::from_conf(conf)
            .describe_game_server_instances()
            .game_server_group_name("g")
            .send()
            .await
            .unwrap_err();
        assert_eq!(
            classify(&err),
            PollErrorKind::Credentials,
            "{}",
            DisplayErrorContext(&err)
        );
    }

    #[test]
    fn retry_only_transient_errors() {
        let retryable: Vec<_> = PollErrorKind::ALL
            .iter()
            .filter(|k| k.is_retryable())
            .map(|k| k.label())
            .collect();
        assert_eq!(
            retryable,
            ["throttled", "server_error", "timeout", "connection"]
        );
    }
}
