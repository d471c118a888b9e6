//! Wiring: builds every part, supervises every task, and shuts down cleanly.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use anyhow::Context;
use k8s_openapi::api::core::v1::Node;
use lastcall_common::admin::{self, Health};
use lastcall_common::backoff::Backoff;
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::actuator::Actuator;
use crate::config::Config;
use crate::fleetiq::gamelift::{self, GameLift};
use crate::fleetiq::imds::Imds;
use crate::fleetiq::lifecycle::{self, HEALTH_REGISTRATION};
use crate::fleetiq::source::{RedisSource, run_fallback};
use crate::fleetiq::view::FleetIqView;
use crate::metrics::Metrics;
use crate::policy::PolicyConfig;
use crate::reconciler::{HEALTH_KUBE, Reconciler};
use crate::{sources, watches};

/// Pre-built clients, for running the agent in-process (tests, the demo).
#[derive(Default)]
pub struct Overrides {
    /// Where the Kubernetes API is; the client is built from it exactly as in production.
    pub kube: Option<kube::Config>,
    pub gamelift: Option<aws_sdk_gamelift::Client>,
    /// Receives the bound admin address (when listening on port 0).
    pub bound: Option<tokio::sync::oneshot::Sender<std::net::SocketAddr>>,
    /// Sources registered in-process, after [`sources::REGISTRY`]'s: a source added by a
    /// test or an embedder is its module plus one line here.
    pub sources: Vec<sources::Registered>,
}

/// How long shutdown may take before remaining tasks are abandoned (SIGTERM → exit < 5 s).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(3);

pub async fn run(
    config: Config,
    overrides: Overrides,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let (metrics, registry) = Metrics::new();
    // The heartbeat check joins once heartbeats start (after FleetIQ start-up).
    let health = Health::new(&[HEALTH_KUBE]);

    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("binding --listen {}", config.listen))?;
    let bound = listener.local_addr()?;
    if let Some(tx) = overrides.bound {
        let _ = tx.send(bound);
    }
    info!(message = "lastcall-agent starting", node = %config.node_name, listen = %bound,
          dry_run = config.dry_run, fleetiq = config.fleetiq_enabled(), compat_taints = config.compat_taints);

    let cfg = match overrides.kube {
        Some(c) => c,
        None => kube::Config::infer()
            .await
            .context("loading the Kubernetes client config")?,
    };
    let client = kube_client(cfg)?;

    let mut tasks = JoinSet::new();
    let stop = shutdown.child_token();
    tasks.spawn(admin_task(
        listener,
        admin::router(registry, health.clone()),
        stop.clone(),
    ));

    let trigger = Arc::new(Notify::new());
    let (stores, watch_tasks) = watches::spawn(
        client.clone(),
        &config.node_name,
        trigger.clone(),
        metrics.clone(),
        stop.clone(),
    );
    for handle in watch_tasks {
        // A watch task that panics must not leave the reconciler on a frozen cache.
        tasks.spawn(async move {
            let _ = handle.await;
            "watch"
        });
    }
    let (view_tx, view_rx) = watch::channel(FleetIqView::default());
    let (iid_tx, iid_rx) = watch::channel(config.instance_id.clone());
    let shared_config = Arc::new(config.clone());
    let fleetiq_inputs = config.fleetiq_enabled().then(|| sources::fleetiq::Inputs {
        view: view_rx.clone(),
        instance_id: iid_rx.clone(),
    });
    let registry: Vec<sources::Registered> = sources::REGISTRY
        .iter()
        .chain(overrides.sources.iter())
        .copied()
        .collect();
    let (board, source_tasks) = sources::start_all(
        &registry,
        |out| sources::SourceContext {
            config: shared_config.clone(),
            metrics: metrics.clone(),
            health: health.clone(),
            out,
            fleetiq: fleetiq_inputs.clone(),
            shutdown: stop.clone(),
        },
        sources::NodeSignalConfig {
            maintenance_lead: config.maintenance_lead,
            drain_on_foreign_cordon: config.drain_on_foreign_cordon,
        },
        trigger.clone(),
        stop.clone(),
    );
    for (source, task) in source_tasks {
        // A source task runs until shutdown; one that ends early is fatal, like any task.
        let name = source.as_str();
        tasks.spawn(async move {
            task.await;
            name
        });
    }
    let actuator = Actuator::new(
        client.clone(),
        config.node_name.clone(),
        config.dry_run,
        metrics.clone(),
    );

    let reconciler = Reconciler::new(
        config.node_name.clone(),
        stores,
        board,
        actuator.clone(),
        metrics.clone(),
        health.clone(),
        PolicyConfig {
            compat_taints: config.compat_taints,
            deregister: config.fleetiq_enabled(),
            default_deadline: config.drain_deadline,
            deregister_settle: config.deregister_settle,
            hand_back: config.gke_hand_back,
            eviction: crate::eviction::EvictionConfig {
                graceful_termination: config.graceful_termination,
            },
            cooperation: config.autoscaler_cooperation,
            pacing: crate::policy::Pacing {
                floor: config.release_floor,
                interval: config.release_interval,
                batch: config.release_batch,
                hold_max: config.release_hold_max,
            },
        },
        config.release_concurrency as usize,
        config.resync_interval,
        trigger,
    );
    if config.publish_drain_state
        && let Some(target) = config.redis_url.clone()
    {
        let publisher = crate::drain_state::Publisher {
            target,
            ca: config.redis_ca_file.clone(),
            node: config.node_name.clone(),
            counts: reconciler.drain_state.subscribe(),
            metrics: metrics.clone(),
        };
        let s = stop.clone();
        tasks.spawn(async move {
            publisher.run(s).await;
            "drain_state"
        });
    }
    let s = stop.clone();
    tasks.spawn(async move {
        reconciler.run(s).await;
        "reconciler"
    });

    if config.fleetiq_enabled() {
        let ctx = FleetIqTask {
            config: config.clone(),
            client: client.clone(),
            sdk: overrides.gamelift,
            actuator: actuator.clone(),
            metrics: metrics.clone(),
            health: health.clone(),
            view: view_tx,
            iid: iid_tx,
        };
        let s = stop.clone();
        tasks.spawn(async move {
            ctx.run(s).await;
            "fleetiq"
        });
        let m = metrics.clone();
        let rx = view_rx.clone();
        let s = stop.clone();
        tasks.spawn(async move {
            let started = Instant::now();
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    () = s.cancelled() => return "message-age",
                    _ = tick.tick() => {}
                }
                let last = rx.borrow().last_seen.unwrap_or(started);
                m.last_message_age.set(last.elapsed().as_secs_f64());
            }
        });
    }

    // Every task runs until shutdown; one that ends early is a bug we must not hide.
    let failure = tokio::select! {
        biased;
        () = shutdown.cancelled() => None,
        ended = tasks.join_next() => match ended {
            // Tasks end on their own only after shutdown began.
            _ if shutdown.is_cancelled() => None,
            Some(Ok(name)) => Some(format!("task {name} ended unexpectedly")),
            Some(Err(e)) => Some(format!("a task failed: {e}")),
            None => Some("no tasks".to_string()),
        },
    };
    if let Some(why) = &failure {
        error!(message = "stopping: a supervised task ended", reason = %why);
    }

    if config.deregister_on_exit && failure.is_none() {
        match tokio::time::timeout(SHUTDOWN_GRACE, actuator.fleetiq().deregister_on_exit()).await {
            Ok(Ok(true)) => info!(message = "deregistered on exit (--deregister-on-exit)"),
            Ok(Ok(false)) => info!(message = "deregister on exit: nothing to do"),
            Ok(Err(e)) => warn!(message = "deregister on exit failed", error = %e),
            Err(_) => warn!(message = "deregister on exit timed out"),
        }
    }
    stop.cancel();
    let _ = tokio::time::timeout(SHUTDOWN_GRACE, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    tasks.abort_all();
    info!(message = "lastcall-agent stopped");
    match failure {
        Some(why) => Err(anyhow::anyhow!(why)),
        None => Ok(()),
    }
}

/// The agent's Kubernetes client. kube retries 429/503/504 up to 15 times on its own, for
/// minutes; the reconciler has its own capped, jittered backoff and must stay responsive to
/// new signals, so that retry is off. Tests build their agents through this too.
pub fn kube_client(mut cfg: kube::Config) -> anyhow::Result<kube::Client> {
    cfg.default_retry = false;
    kube::Client::try_from(cfg).context("building the Kubernetes client")
}

async fn admin_task(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    stop: CancellationToken,
) -> &'static str {
    if let Err(e) = admin::serve(listener, router, stop.clone()).await {
        error!(message = "admin listener failed", error = %e);
    }
    stop.cancelled().await;
    "admin"
}

struct FleetIqTask {
    config: Config,
    client: kube::Client,
    sdk: Option<aws_sdk_gamelift::Client>,
    actuator: Actuator,
    metrics: Metrics,
    health: Health,
    view: watch::Sender<FleetIqView>,
    iid: watch::Sender<Option<String>>,
}

impl FleetIqTask {
    async fn instance_id(&self, stop: &CancellationToken) -> Option<String> {
        if let Some(id) = &self.config.instance_id {
            return Some(id.clone());
        }
        let mut imds = Imds::new(&self.config.imds_endpoint);
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
        loop {
            match imds.instance_id().await {
                Ok(id) => {
                    info!(message = "instance id from IMDS", instance_id = %id);
                    return Some(id);
                }
                Err(e) => {
                    let d = backoff.next_delay();
                    warn!(message = "instance id unavailable; FleetIQ waits, other signals continue", error = %e, retry_in_ms = d.as_millis() as u64);
                    tokio::select! {
                        () = stop.cancelled() => return None,
                        () = tokio::time::sleep(d) => {}
                    }
                }
            }
        }
    }

    async fn run(self, stop: CancellationToken) {
        self.health
            .set(HEALTH_REGISTRATION, false, "waiting for the instance id");
        let Some(iid) = self.instance_id(&stop).await else {
            stop.cancelled().await;
            return;
        };
        let _ = self.iid.send(Some(iid.clone()));
        let group = self.config.game_server_group.clone().unwrap_or_default();
        let sdk = match self.sdk {
            Some(c) => c,
            None => {
                gamelift::sdk_client(
                    self.config.aws_region.as_deref(),
                    self.config.gamelift_endpoint.as_deref(),
                )
                .await
            }
        };
        let gsid = self
            .config
            .game_server_id
            .clone()
            .unwrap_or_else(|| iid.clone());
        let gl = GameLift::new(sdk, group, gsid, iid.clone(), self.metrics.clone());
        self.actuator.fleetiq().connect(gl.clone());

        let mut tasks = JoinSet::new();
        let nodes: kube::Api<Node> = kube::Api::all(self.client.clone());
        let a = self.actuator.clone();
        let (s, node_name) = (stop.clone(), self.config.node_name.clone());
        let heartbeat = lifecycle::heartbeat_loop(
            self.actuator.fleetiq().clone(),
            self.config.heartbeat_interval,
            self.config.failure_threshold,
            self.metrics.clone(),
            self.health.clone(),
            stop.clone(),
        );
        // Heartbeats start once start-up is done (registered, or found already draining), so
        // the first one never reaches GameLift before the registration. They run on their own
        // task from then on, independent of Redis.
        let health = self.health.clone();
        tasks.spawn(async move {
            health.set(
                HEALTH_REGISTRATION,
                false,
                "registering and claiming in FleetIQ",
            );
            lifecycle::start_up(&a, nodes, &node_name, &s).await;
            health.set(HEALTH_REGISTRATION, true, "start-up done");
            heartbeat.await;
            // Heartbeats end after deregistration; the task itself lives until shutdown.
            s.cancelled().await;
        });
        if let Some(target) = self.config.redis_url.clone() {
            let src = RedisSource {
                target,
                channel: self
                    .config
                    .redis_channel
                    .clone()
                    .unwrap_or_else(|| iid.clone()),
                instance_id: iid.clone(),
                metrics: self.metrics.clone(),
                view: self.view.clone(),
                ping_every: self.config.redis_ping_interval,
                ca_file: self.config.redis_ca_file.clone(),
            };
            tasks.spawn(src.run(stop.clone()));
        } else {
            warn!(
                message = "no --redis-url: FleetIQ status comes from direct GameLift checks only"
            );
        }
        let stale_after = self.config.publish_period * self.config.stale_periods;
        tasks.spawn(run_fallback(
            gl,
            self.view.clone(),
            if self.config.redis_url.is_some() {
                stale_after
            } else {
                Duration::ZERO
            },
            Duration::from_secs(self.config.healthcheck_interval),
            self.metrics.clone(),
            stop.clone(),
        ));
        // Every FleetIQ task runs until shutdown. One that ends early (a panic) ends this
        // task, which the top level treats as fatal: heartbeats must never stop silently.
        if let Some(r) = tasks.join_next().await
            && !stop.is_cancelled()
        {
            error!(message = "a FleetIQ task ended unexpectedly", error = ?r.err());
            return;
        }
        stop.cancelled().await;
    }
}
