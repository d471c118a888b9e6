//! Queue mode: EC2 interruption events from an EventBridge → SQS queue, relayed to the agent
//! of the node each event is for, on that Node (`docs/queue.md`).
//!
//! Layers, imports flowing down this list:
//! - [`settings`] (the `--queue-*` flags) and [`metrics`];
//! - [`event`]: what a message says, parsed strictly (pure);
//! - [`nodes`]: instance → Node, from one watch of every Node;
//! - [`relay`]: one guarded write of an event onto its Node;
//! - [`consumer`]: the receivers, visibility, deletion;
//! - this module: wiring, and the process when pubsub runs the queue alone.

pub mod consumer;
pub mod event;
pub mod metrics;
pub mod nodes;
pub mod relay;
pub mod settings;

use std::sync::Arc;
use std::time::Duration;

use lastcall_common::admin::Health;
use tokio_util::sync::CancellationToken;

pub use consumer::{Consumer, READY_QUEUE};
pub use metrics::QueueMetrics;
pub use nodes::NodeIndex;
pub use settings::QueueFlags;

/// The SQS client: the default AWS chain (IRSA, Pod Identity, env), bounded retries, and an
/// attempt timeout above the long poll's wait.
pub async fn sqs_client(
    region: Option<&str>,
    endpoint: Option<&str>,
    wait: Duration,
    credentials: Option<aws_sdk_sqs::config::Credentials>,
) -> aws_sdk_sqs::Client {
    use aws_config::retry::RetryConfig;
    use aws_config::timeout::TimeoutConfig;
    let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .retry_config(RetryConfig::standard().with_max_attempts(3))
        .timeout_config(
            TimeoutConfig::builder()
                .connect_timeout(Duration::from_secs(5))
                .operation_attempt_timeout(wait + Duration::from_secs(10))
                .build(),
        );
    if let Some(r) = region {
        loader = loader.region(aws_config::Region::new(r.to_string()));
    }
    if let Some(ep) = endpoint {
        loader = loader.endpoint_url(ep);
    }
    if let Some(c) = credentials {
        loader = loader.credentials_provider(c);
    }
    aws_sdk_sqs::Client::new(&loader.load().await)
}

/// The running queue mode: the Node watch and the receivers.
pub struct Queue {
    consumer: Arc<Consumer>,
    receivers: usize,
}

impl Queue {
    /// Wires queue mode; no I/O here. `None` when `--queue-url` is unset.
    pub fn new(
        flags: &QueueFlags,
        sqs: aws_sdk_sqs::Client,
        kube: kube::Client,
        metrics: QueueMetrics,
        health: Health,
    ) -> Option<Self> {
        let url = flags.queue_url.clone()?;
        Some(Self {
            consumer: Arc::new(Consumer::new(
                sqs,
                url,
                kube,
                NodeIndex::default(),
                metrics,
                health,
                flags.queue_visibility,
                flags.queue_wait,
                flags.queue_node_wait,
            )),
            receivers: usize::from(flags.queue_receivers.max(1)),
        })
    }

    pub fn index(&self) -> &NodeIndex {
        &self.consumer.index
    }

    /// Runs the watch and the receivers until `shutdown`. Receivers start once the first
    /// list of Nodes is in, so no message is judged against an empty index.
    pub async fn run(&self, shutdown: CancellationToken) {
        let c = self.consumer.clone();
        let watch = c
            .index
            .watch(c.kube.clone(), c.metrics.clone(), shutdown.clone());
        let receivers = async {
            while !c.index.is_ready() {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(Duration::from_millis(100)) => {}
                }
            }
            tracing::info!(message = "queue mode: Nodes listed; receiving", queue = %c.queue_url, nodes = c.index.len(), receivers = self.receivers);
            futures::future::join_all(
                (0..self.receivers).map(|_| c.receive_loop(shutdown.clone())),
            )
            .await;
        };
        tokio::join!(watch, receivers);
    }
}

/// Errors that stop queue-only mode at start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("queue mode needs the Kubernetes API (in-cluster credentials or KUBECONFIG): {0}")]
    Kube(#[source] kube::Error),
    #[error("binding the admin listener on {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("installing signal handlers: {0}")]
    Signals(#[source] std::io::Error),
    #[error("admin HTTP server failed: {0}")]
    Admin(#[source] std::io::Error),
}

/// The process when pubsub reads the queue alone (no `--redis-url`: no FleetIQ, no
/// webhook): the admin listener, the Node watch and the receivers, until SIGTERM.
pub async fn serve_alone(config: crate::Config) -> Result<(), ServeError> {
    let shutdown = CancellationToken::new();
    let signals =
        lastcall_common::shutdown::install(shutdown.clone()).map_err(ServeError::Signals)?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| ServeError::Bind {
            addr: config.listen,
            source,
        })?;
    let kube = kube::Client::try_default()
        .await
        .map_err(ServeError::Kube)?;
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = QueueMetrics::register(&mut registry);
    let health = Health::new(&[READY_QUEUE]);
    let sqs = sqs_client(
        config.aws_region.as_deref(),
        config.queue.sqs_endpoint.as_deref(),
        config.queue.queue_wait,
        None,
    )
    .await;
    let Some(queue) = Queue::new(&config.queue, sqs, kube, metrics, health.clone()) else {
        return Ok(());
    };
    tracing::info!(message = "starting (queue mode alone: no --redis-url)", version = env!("CARGO_PKG_VERSION"), listen = %config.listen);
    let admin = tokio::spawn(lastcall_common::admin::serve(
        listener,
        lastcall_common::admin::router(Arc::new(registry), health),
        shutdown.clone(),
    ));
    queue.run(shutdown.clone()).await;
    shutdown.cancel();
    let _ = signals.await;
    let admin = tokio::time::timeout(Duration::from_secs(2), admin).await;
    tracing::info!(message = "stopped");
    match admin {
        Ok(Ok(Err(e))) => Err(ServeError::Admin(e)),
        _ => Ok(()),
    }
}
