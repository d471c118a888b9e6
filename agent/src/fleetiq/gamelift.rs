//! The GameLift FleetIQ calls the agent makes, with errors classified once.

use std::time::Duration;

use aws_sdk_gamelift::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_gamelift::types::{GameServerHealthCheck, GameServerUtilizationStatus};
use lastcall_common::fleetiq::InstanceStatus;

use crate::metrics::{Metrics, OperationResult};

/// What went wrong with a GameLift call, as far as the agent's logic cares.
#[derive(Debug, thiserror::Error)]
pub enum GameLiftError {
    #[error("conflict: {0}")]
    Conflict(String),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("throttled: {0}")]
    Throttled(String),
    #[error("unreachable: {0}")]
    Unreachable(String),
    #[error("{0}")]
    Other(String),
    /// Not sent: this node's game server is deregistered, and nothing may follow that.
    #[error("not sent: the game server is deregistered")]
    Deregistered,
    /// Not sent: another agent owns this node (see `crate::owner_handle`).
    #[error("not sent: another agent owns this node")]
    NotOwner,
}

impl GameLiftError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Conflict(_) => "conflict",
            Self::NotFound(_) => "not_found",
            Self::Throttled(_) => "throttled",
            Self::Unreachable(_) => "unreachable",
            Self::Other(_) => "error",
            Self::Deregistered => "deregistered",
            Self::NotOwner => "not_owner",
        }
    }
}

fn classify<E, R>(e: SdkError<E, R>) -> GameLiftError
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
    R: std::fmt::Debug,
{
    let text = match e.message() {
        Some(m) => m.to_string(),
        None => aws_smithy_error_display(&e),
    };
    match &e {
        SdkError::TimeoutError(_) | SdkError::DispatchFailure(_) => {
            return GameLiftError::Unreachable(text);
        }
        _ => {}
    }
    match e.code() {
        Some("ConflictException") => GameLiftError::Conflict(text),
        Some("NotFoundException") => GameLiftError::NotFound(text),
        Some("ThrottlingException") => GameLiftError::Throttled(text),
        _ => GameLiftError::Other(text),
    }
}

fn aws_smithy_error_display<E: std::error::Error + 'static, R: std::fmt::Debug>(
    e: &SdkError<E, R>,
) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

/// This node's game server in its FleetIQ group.
#[derive(Clone)]
pub struct GameLift {
    client: aws_sdk_gamelift::Client,
    pub group: String,
    pub game_server_id: String,
    pub instance_id: String,
    metrics: Metrics,
}

/// Builds the SDK client from the default AWS chain, with an optional endpoint override.
pub async fn sdk_client(region: Option<&str>, endpoint: Option<&str>) -> aws_sdk_gamelift::Client {
    let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest());
    if let Some(r) = region {
        loader = loader.region(aws_config::Region::new(r.to_string()));
    }
    let shared = loader.load().await;
    let mut b = configure(aws_sdk_gamelift::config::Builder::from(&shared));
    if let Some(ep) = endpoint {
        b = b.endpoint_url(ep);
    }
    aws_sdk_gamelift::Client::from_conf(b.build())
}

/// The agent's retry and timeout settings on a client built elsewhere (tests, embedders),
/// so that it behaves as the binary's.
pub fn with_timeouts(client: aws_sdk_gamelift::Client) -> aws_sdk_gamelift::Client {
    aws_sdk_gamelift::Client::from_conf(configure(client.config().to_builder()).build())
}

/// Three attempts, each cut after 5 s, 15 s in all: a call on a connection that stopped
/// answering fails and is retried by its caller, never blocks the lifecycle lock.
fn configure(b: aws_sdk_gamelift::config::Builder) -> aws_sdk_gamelift::config::Builder {
    b.retry_config(aws_config::retry::RetryConfig::standard().with_max_attempts(3))
        .timeout_config(
            aws_config::timeout::TimeoutConfig::builder()
                .connect_timeout(Duration::from_secs(3))
                .operation_attempt_timeout(Duration::from_secs(5))
                .operation_timeout(Duration::from_secs(15))
                .build(),
        )
}

impl GameLift {
    pub fn new(
        client: aws_sdk_gamelift::Client,
        group: String,
        game_server_id: String,
        instance_id: String,
        metrics: Metrics,
    ) -> Self {
        Self {
            client,
            group,
            game_server_id,
            instance_id,
            metrics,
        }
    }

    /// Awaits one SDK call, classifies its error and counts it by operation and result.
    async fn call<T, E, R>(
        &self,
        op: &'static str,
        fut: impl std::future::Future<Output = Result<T, SdkError<E, R>>>,
    ) -> Result<T, GameLiftError>
    where
        E: ProvideErrorMetadata + std::error::Error + 'static,
        R: std::fmt::Debug,
    {
        let r = fut.await.map_err(classify);
        let result = match &r {
            Ok(_) => "ok",
            Err(e) => e.metric_label(),
        };
        self.metrics
            .gamelift_calls
            .get_or_create(&OperationResult {
                operation: op,
                result,
            })
            .inc();
        r
    }

    pub async fn register(&self) -> Result<(), GameLiftError> {
        let req = self
            .client
            .register_game_server()
            .game_server_group_name(&self.group)
            .game_server_id(&self.game_server_id)
            .instance_id(&self.instance_id);
        self.call("RegisterGameServer", req.send())
            .await
            .map(|_| ())
    }

    pub async fn claim(&self) -> Result<(), GameLiftError> {
        let req = self
            .client
            .claim_game_server()
            .game_server_group_name(&self.group)
            .game_server_id(&self.game_server_id);
        self.call("ClaimGameServer", req.send()).await.map(|_| ())
    }

    fn update(
        &self,
    ) -> aws_sdk_gamelift::operation::update_game_server::builders::UpdateGameServerFluentBuilder
    {
        self.client
            .update_game_server()
            .game_server_group_name(&self.group)
            .game_server_id(&self.game_server_id)
    }

    pub async fn heartbeat(&self) -> Result<(), GameLiftError> {
        let req = self.update().health_check(GameServerHealthCheck::Healthy);
        self.call("UpdateGameServer", req.send()).await.map(|_| ())
    }

    pub async fn set_utilized(&self) -> Result<(), GameLiftError> {
        let req = self
            .update()
            .utilization_status(GameServerUtilizationStatus::Utilized);
        self.call("UpdateGameServer", req.send()).await.map(|_| ())
    }

    pub async fn deregister(&self) -> Result<(), GameLiftError> {
        let req = self
            .client
            .deregister_game_server()
            .game_server_group_name(&self.group)
            .game_server_id(&self.game_server_id);
        self.call("DeregisterGameServer", req.send())
            .await
            .map(|_| ())
    }

    /// Whether this game server is still registered (`DescribeGameServer`): asked before a
    /// deregistration that a crash may already have sent, so it is never sent twice.
    pub async fn is_registered(&self) -> Result<bool, GameLiftError> {
        let req = self
            .client
            .describe_game_server()
            .game_server_group_name(&self.group)
            .game_server_id(&self.game_server_id);
        match self.call("DescribeGameServer", req.send()).await {
            Ok(_) => Ok(true),
            Err(GameLiftError::NotFound(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// This instance's status straight from GameLift (the stale-Redis fallback). `Ok(None)`
    /// when GameLift does not list the instance or answers with a status we do not know.
    pub async fn describe_own_status(&self) -> Result<Option<InstanceStatus>, GameLiftError> {
        let req = self
            .client
            .describe_game_server_instances()
            .game_server_group_name(&self.group)
            .instance_ids(&self.instance_id);
        let out = self.call("DescribeGameServerInstances", req.send()).await?;
        Ok(out
            .game_server_instances()
            .iter()
            .find(|i| i.instance_id() == Some(self.instance_id.as_str()))
            .and_then(|i| i.instance_status())
            .and_then(|s| InstanceStatus::parse(s.as_str())))
    }
}
