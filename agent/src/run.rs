//! Wiring: builds every part, spawns and supervises every task, and shuts down cleanly.

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
use crate::owner::{self, Owner, Ownership, PodId};
use crate::policy::PolicyConfig;
use crate::reconciler::{HEALTH_KUBE, Reconciler};
use crate::throttle::Throttle;
use crate::{keys, kube_client, progress, sources, watches};

/// Pre-built clients, for running the agent in-process (tests, the demo).
#[derive(Default)]
pub struct Overrides {
    /// Where the Kubernetes API is; the client is built from it exactly as in production.
    pub kube: Option<kube::Config>,
    /// A GameLift client (endpoint, credentials); the agent applies its own retry and
    /// timeout settings to it, exactly as to the binary's.
    pub gamelift: Option<aws_sdk_gamelift::Client>,
    /// Receives the bound admin address (when listening on port 0).
    pub bound: Option<tokio::sync::oneshot::Sender<std::net::SocketAddr>>,
    /// Sources registered in-process, after [`sources::REGISTRY`]'s: a source added by a
    /// test or an embedder is its module plus one line here.
    pub sources: Vec<sources::Registered>,
    /// Credentials for the AWS clients sources build (the Auto Scaling lifecycle source);
    /// `None`: the default AWS chain, as in production.
    pub aws_credentials: Option<aws_sdk_autoscaling::config::Credentials>,
    /// Under `--dry-run`, the narration is also told here (read in-process).
    pub narration: Option<crate::dry_run::narration::Narration>,
}

/// How long the tasks may take to stop after SIGTERM before they are abandoned.
const TASKS_GRACE: Duration = Duration::from_millis(800);
/// How long `--deregister-on-exit` may take.
const DEREGISTER_GRACE: Duration = Duration::from_secs(2);
/// How long handing the node's ownership over may take (SIGTERM → exit stays under 5 s).
const HANDOVER_GRACE: Duration = Duration::from_secs(1);

/// Runs the agent until `shutdown`: build every part, spawn every task, supervise them and
/// shut down (see [`Agent::build`], [`Agent::spawn`], [`Running::supervise`]).
pub async fn run(
    config: Config,
    overrides: Overrides,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let agent = Agent::build(config, overrides).await?;
    agent.spawn(&shutdown).supervise(shutdown).await
}

/// Everything built before any task runs: a failure here ends start-up with an error.
pub struct Agent {
    config: Config,
    metrics: Metrics,
    registry: Arc<prometheus_client::registry::Registry>,
    health: Health,
    /// The probes, and `/metrics` unless it has a listener of its own.
    listener: tokio::net::TcpListener,
    /// `/metrics` alone (`--metrics-listen`).
    metrics_listener: Option<tokio::net::TcpListener>,
    /// Requests (deadline `--request-timeout`).
    client: kube::Client,
    /// Watches (their own long-poll timeout).
    watch_client: kube::Client,
    /// 429s' Retry-After, shared by both clients and the reconciler.
    throttle: Throttle,
    gamelift: Option<aws_sdk_gamelift::Client>,
    sources: Vec<sources::Registered>,
    /// This agent's pod, when ownership is on.
    identity: Option<PodId>,
    aws_credentials: Option<aws_sdk_autoscaling::config::Credentials>,
    narration: Option<crate::dry_run::narration::Narration>,
    /// Webhook notifications, when a URL is configured.
    notify: Option<(crate::notify::Notifier, crate::notify::Poster)>,
}

impl Agent {
    /// Binds the admin listener and builds the clients.
    pub async fn build(config: Config, overrides: Overrides) -> anyhow::Result<Self> {
        let (metrics, registry) = Metrics::new();
        // The heartbeat check joins once heartbeats start (after FleetIQ start-up).
        let health = Health::new(&[HEALTH_KUBE]);
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("binding --listen {}", config.listen))?;
        let bound = listener.local_addr()?;
        let metrics_listener = match config.metrics_listen {
            Some(addr) => Some(
                tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("binding --metrics-listen {addr}"))?,
            ),
            None => None,
        };
        let metrics_bound = match &metrics_listener {
            Some(l) => l.local_addr()?,
            None => bound,
        };
        if let Some(tx) = overrides.bound {
            let _ = tx.send(bound);
        }
        info!(message = "lastcall-agent starting", node = %config.node_name, listen = %bound,
              metrics_listen = %metrics_bound, metrics_auth = ?config.metrics_auth,
              dry_run = config.dry_run, fleetiq = config.fleetiq_enabled(), compat_taints = config.compat_taints);
        let cfg = match overrides.kube {
            Some(c) => c,
            None => kube::Config::infer()
                .await
                .context("loading the Kubernetes client config")?,
        };
        let identity = identity(&config, &cfg.default_namespace);
        let throttle = Throttle::new(metrics.clone());
        let client =
            kube_client::for_requests(cfg.clone(), config.request_timeout, &metrics, &throttle)?;
        let watch_client = kube_client::for_watches(cfg, &throttle)?;
        let notify = notifications(&config, &metrics)?;
        let sources = sources::REGISTRY
            .iter()
            .chain(overrides.sources.iter())
            .copied()
            .collect();
        Ok(Self {
            config,
            metrics,
            registry,
            health,
            listener,
            metrics_listener,
            client,
            watch_client,
            throttle,
            gamelift: overrides.gamelift.map(gamelift::with_timeouts),
            sources,
            identity,
            aws_credentials: overrides.aws_credentials,
            narration: overrides.narration,
            notify,
        })
    }

    /// Starts every task; each runs until `shutdown`. In order: the admin listener, the
    /// watches, the signal sources, node ownership, the reconciler, then FleetIQ.
    pub fn spawn(self, shutdown: &CancellationToken) -> Running {
        let Agent {
            config,
            metrics,
            registry,
            health,
            listener,
            metrics_listener,
            client,
            watch_client,
            throttle,
            gamelift,
            sources: registry_sources,
            identity,
            aws_credentials,
            narration,
            notify,
        } = self;
        let mut tasks = Tasks::new(shutdown.child_token());
        let metrics_routes = crate::metrics_auth::metrics_routes(
            config.metrics_auth,
            admin::metrics_router(registry),
            &client,
            &metrics,
        );
        let probes = admin::probe_router(health.clone());
        match metrics_listener {
            Some(own) => {
                tasks.spawn(|stop| admin_task("admin", listener, probes, stop));
                tasks.spawn(|stop| admin_task("metrics", own, metrics_routes, stop));
            }
            None => {
                let router = probes.merge(metrics_routes);
                tasks.spawn(|stop| admin_task("admin", listener, router, stop));
            }
        }
        let trigger = Arc::new(Notify::new());
        let clients = watches::Clients {
            watch: watch_client,
            request: client.clone(),
        };
        let stores = spawn_watches(clients, &config, &trigger, &metrics, &mut tasks);
        let feeds = Feeds::new(&config);
        // Before the sources: they may post Warning Events on the Node through it.
        let actuator = Actuator::new(
            client.clone(),
            config.node_name.clone(),
            config.dry_run,
            metrics.clone(),
        );
        // One agent acts on a node at a time (see `owner`); a dry run writes nothing, so
        // it needs no ownership. Before the sources: a standby's sources send nothing.
        let in_pod = identity.is_some();
        let identity = identity.filter(|_| !config.dry_run);
        let owner = spawn_ownership(
            identity.as_ref(),
            &config.node_name,
            &stores,
            &actuator,
            &metrics,
            &mut tasks,
        );
        // In a pod: whether the node restriction can hold this agent, said once (on the
        // Node by the acting agent only: a standby writes nothing).
        if in_pod {
            let (c, a, m, n, o) = (
                client.clone(),
                actuator.clone(),
                metrics.clone(),
                config.node_name.clone(),
                owner.clone(),
            );
            tasks.spawn(|stop| crate::node_restriction::run(c, a, m, n, o, stop));
        }
        let warn_on = actuator.clone();
        let warn_owner = owner.clone();
        let acting_owner = owner.clone();
        let shared = feeds.for_sources(
            aws_credentials,
            sources::KubeAccess {
                client: client.clone(),
                node: stores.node.clone(),
                node_changes: stores.node_changes.clone(),
            },
            sources::NodeWarnings::new(move |reason, note| {
                // A standby agent posts nothing; the acting one says the same.
                if warn_owner.is_owner() {
                    warn_on.queue_event(&warn_on.node_ref(), reason, note, true);
                }
            }),
            sources::Acting::new(move || acting_owner.is_owner()),
        );
        let board = spawn_sources(
            &config,
            &registry_sources,
            shared,
            &metrics,
            &health,
            &trigger,
            &mut tasks,
        );
        actuator.fleetiq().gate(owner.clone());
        let mut reconciler = Reconciler::new(
            config.node_name.clone(),
            stores,
            board,
            actuator.clone(),
            metrics.clone(),
            health.clone(),
            policy_config(&config),
            config.release_concurrency as usize,
            config.resync_interval,
            trigger,
        );
        reconciler.owner = owner.clone();
        reconciler.throttle = Some(throttle);
        reconciler.node_empty = feeds.empty_tx;
        reconciler.hand_off_waiters =
            config.asg_lifecycle || (config.azure_events && config.azure_approve_when_empty);
        if let Some(n) = narration {
            reconciler.narrate_to(n);
        }
        if let Some((notifier, poster)) = notify {
            reconciler.notifier = notifier;
            tasks.spawn(|stop| async move {
                poster.run(stop.clone()).await;
                stop.cancelled().await;
                "notify"
            });
        }
        spawn_drain_state(&config, &reconciler, &owner, &metrics, &mut tasks);
        tasks.spawn(|stop| async move {
            reconciler.run(stop).await;
            "reconciler"
        });
        if config.fleetiq_enabled() {
            let fleetiq = FleetIqTask {
                config: config.clone(),
                client,
                sdk: gamelift,
                actuator: actuator.clone(),
                owner,
                metrics: metrics.clone(),
                health,
                view: feeds.view_tx,
                iid: feeds.iid_tx,
            };
            fleetiq.spawn(feeds.view_rx, &mut tasks);
        }
        Running {
            config,
            tasks,
            actuator,
            identity,
        }
    }
}

/// The webhook notifier, when `--notify-url-file` or `LASTCALL_NOTIFY_URL` names a URL. An
/// unreadable or malformed URL fails start-up (the error never shows the URL). A dry run
/// sends none: it changes nothing, so it has nothing to announce.
fn notifications(
    config: &Config,
    metrics: &Metrics,
) -> anyhow::Result<Option<(crate::notify::Notifier, crate::notify::Poster)>> {
    use crate::notify::{Settings, URL_ENV};
    let env = std::env::var(URL_ENV).ok().filter(|v| !v.trim().is_empty());
    let Some(url) = Settings::url(config.notify_url_file.as_deref(), env)? else {
        return Ok(None);
    };
    if config.dry_run {
        info!(message = "dry run: webhook notifications are off");
        return Ok(None);
    }
    let settings = Settings::new(
        url,
        config.notify_template.clone(),
        config.notify_timeout,
        config.node_name.clone(),
        config.notify_cluster.clone(),
    );
    crate::notify::start(settings, metrics.clone()).map(Some)
}

/// The supervised tasks, each named for the supervisor's log, and the token that stops them.
struct Tasks {
    set: JoinSet<&'static str>,
    stop: CancellationToken,
}

impl Tasks {
    fn new(stop: CancellationToken) -> Self {
        Self {
            set: JoinSet::new(),
            stop,
        }
    }

    /// Starts the task `start` makes from the stop token; it returns its name when it ends.
    fn spawn<F>(&mut self, start: impl FnOnce(CancellationToken) -> F)
    where
        F: Future<Output = &'static str> + Send + 'static,
    {
        self.set.spawn(start(self.stop.clone()));
    }
}

/// The channels between the FleetIQ task, the sources and the reconciler.
struct Feeds {
    /// FleetIQ's current status, from Redis or the direct checks.
    view_tx: watch::Sender<FleetIqView>,
    view_rx: watch::Receiver<FleetIqView>,
    /// The instance id, once known (a flag, or IMDS).
    iid_tx: watch::Sender<Option<String>>,
    iid_rx: watch::Receiver<Option<String>>,
    /// Whether the node is empty, as the reconciler last planned.
    empty_tx: watch::Sender<bool>,
    empty_rx: watch::Receiver<bool>,
}

impl Feeds {
    fn new(config: &Config) -> Self {
        let (view_tx, view_rx) = watch::channel(FleetIqView::default());
        let (iid_tx, iid_rx) = watch::channel(config.instance_id.clone());
        let (empty_tx, empty_rx) = watch::channel(false);
        Self {
            view_tx,
            view_rx,
            iid_tx,
            iid_rx,
            empty_tx,
            empty_rx,
        }
    }

    fn for_sources(
        &self,
        aws_credentials: Option<aws_sdk_autoscaling::config::Credentials>,
        kube: sources::KubeAccess,
        node_warnings: sources::NodeWarnings,
        acting: sources::Acting,
    ) -> SourceShared {
        SourceShared {
            fleetiq: sources::fleetiq::Inputs {
                view: self.view_rx.clone(),
                instance_id: self.iid_rx.clone(),
            },
            node_empty: self.empty_rx.clone(),
            aws_credentials,
            kube,
            node_warnings,
            acting,
        }
    }
}

/// Starts the filtered watches of this node's objects; their stores feed the
/// reconciler.
fn spawn_watches(
    clients: watches::Clients,
    config: &Config,
    trigger: &Arc<Notify>,
    metrics: &Metrics,
    tasks: &mut Tasks,
) -> watches::Stores {
    let (stores, watch_tasks) = watches::spawn(
        clients,
        &config.node_name,
        config.gameserver_selector,
        trigger.clone(),
        metrics.clone(),
        tasks.stop.clone(),
    );
    for handle in watch_tasks {
        // A watch task that panics must not leave the reconciler on a frozen cache. Dropped
        // (the agent's tasks aborted), the wrapper takes the watch with it: awaiting alone
        // would leave it running, polling a server the agent no longer serves.
        let watch = AbortOnDrop(handle.abort_handle());
        tasks.spawn(|_| async move {
            let _watch = watch;
            handle.await.unwrap_or("watch (panicked)")
        });
    }
    stores
}

/// Aborts a spawned task when dropped.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// `--publish-drain-state`: publishes the reconciler's drain counts to Redis. It clears what
/// an earlier agent left, so only the owner runs it.
fn spawn_drain_state(
    config: &Config,
    reconciler: &Reconciler,
    owner: &Owner,
    metrics: &Metrics,
    tasks: &mut Tasks,
) {
    if !config.publish_drain_state {
        return;
    }
    if config.dry_run {
        // The webhook would ask Agones for replacements of a drain that is not happening.
        info!(message = "dry run: this node's drain state is not published");
        return;
    }
    let Some(target) = config.redis_url.clone() else {
        return;
    };
    let publisher = crate::drain_state::Publisher {
        target,
        ca: config.redis_ca_file.clone(),
        node: config.node_name.clone(),
        key: lastcall_common::drain_state::key_for(&config.cluster_name),
        counts: reconciler.drain_state.subscribe(),
        metrics: metrics.clone(),
    };
    let owner = owner.clone();
    tasks.spawn(|stop| async move {
        if owner.owned(&stop).await {
            publisher.run(stop).await;
        }
        "drain_state"
    });
}

/// What every task source is handed besides its config and metrics.
struct SourceShared {
    fleetiq: sources::fleetiq::Inputs,
    node_empty: watch::Receiver<bool>,
    aws_credentials: Option<aws_sdk_autoscaling::config::Credentials>,
    kube: sources::KubeAccess,
    node_warnings: sources::NodeWarnings,
    acting: sources::Acting,
}

/// Starts every registered signal source; they report to the returned board.
fn spawn_sources(
    config: &Config,
    registry: &[sources::Registered],
    shared: SourceShared,
    metrics: &Metrics,
    health: &Health,
    trigger: &Arc<Notify>,
    tasks: &mut Tasks,
) -> sources::NoticeBoard {
    let stop = &tasks.stop;
    let shared_config = Arc::new(config.clone());
    let fleetiq = config.fleetiq_enabled().then_some(shared.fleetiq);
    let (board, source_tasks) = sources::start_all(
        registry,
        |out| sources::SourceContext {
            config: shared_config.clone(),
            metrics: metrics.clone(),
            health: health.clone(),
            out,
            fleetiq: fleetiq.clone(),
            node_empty: shared.node_empty.clone(),
            aws_credentials: shared.aws_credentials.clone(),
            kube: Some(shared.kube.clone()),
            node_warnings: shared.node_warnings.clone(),
            acting: shared.acting.clone(),
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
        tasks.spawn(|_| async move {
            task.await;
            name
        });
    }
    board
}

/// Starts the ownership task when this agent has an identity; otherwise it is the node's
/// only agent.
fn spawn_ownership(
    identity: Option<&PodId>,
    node_name: &str,
    stores: &watches::Stores,
    actuator: &Actuator,
    metrics: &Metrics,
    tasks: &mut Tasks,
) -> Owner {
    let Some(me) = identity else {
        metrics.node_owner.set(1);
        return Owner::sole();
    };
    let owner = Owner::contender();
    let ownership = Ownership {
        me: me.clone(),
        node_name: node_name.to_string(),
        node: stores.node.clone(),
        actuator: actuator.clone(),
        owner: owner.clone(),
        metrics: metrics.clone(),
    };
    tasks.spawn(|stop| async move {
        ownership.run(stop).await;
        "ownership"
    });
    owner
}

/// `--cleanup-cooperation`: one pass over the cluster's game-server pods with a client built
/// as the agent builds its own (`kube`: where the API is; `None`: in-cluster); any failed
/// patch fails the run, so an uninstall hook shows it.
pub async fn cleanup_cooperation(
    config: &Config,
    kube: Option<kube::Config>,
) -> anyhow::Result<crate::cooperation::cleanup::Summary> {
    let cfg = match kube {
        Some(c) => c,
        None => kube::Config::infer()
            .await
            .context("loading the Kubernetes client config")?,
    };
    let (metrics, _) = Metrics::new();
    let client = kube_client::for_requests(
        cfg,
        config.request_timeout,
        &metrics,
        &Throttle::new(metrics.clone()),
    )?;
    let summary = crate::cooperation::cleanup::run(client).await?;
    if summary.failed > 0 {
        anyhow::bail!("{} pod(s) could not be cleaned up", summary.failed);
    }
    Ok(summary)
}

/// The policy's settings, from the flags.
fn policy_config(config: &Config) -> PolicyConfig {
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
        // Until the watch's selection is decided (see `Reconciler::observe`).
        claim_unseen: true,
    }
}

/// This agent's pod, from the Downward API flags; `None` (ownership off) without them.
fn identity(config: &Config, default_namespace: &str) -> Option<PodId> {
    match (&config.pod_name, &config.pod_uid) {
        (Some(name), Some(uid)) => Some(PodId {
            namespace: config
                .pod_namespace
                .clone()
                .unwrap_or_else(|| default_namespace.to_string()),
            name: name.clone(),
            uid: uid.clone(),
        }),
        _ => {
            warn!(
                message = "no POD_NAME/POD_UID: node ownership is off, this agent assumes it is the node's only agent"
            );
            None
        }
    }
}

/// Seconds since the last FleetIQ status, every second.
async fn message_age(
    metrics: Metrics,
    view: watch::Receiver<FleetIqView>,
    stop: CancellationToken,
) -> &'static str {
    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            () = stop.cancelled() => return "message-age",
            _ = tick.tick() => {}
        }
        let last = view.borrow().last_seen.unwrap_or(started);
        metrics.last_message_age.set(last.elapsed().as_secs_f64());
    }
}

/// The running agent: its tasks, and what shutting down needs.
pub struct Running {
    config: Config,
    tasks: Tasks,
    actuator: Actuator,
    identity: Option<PodId>,
}

impl Running {
    /// `--deregister-on-exit` passes the hand-off gate's fresh read: no game-server pod (a
    /// terminating one included) on a consistent LIST of the node's pods. Deregistering a
    /// node whose matches run (a rollout) would drop FleetIQ's hold on it under them; a node
    /// that is going away has had its game servers stopped first. Unread is not empty.
    async fn empty_on_exit(&self) -> bool {
        let node = &self.config.node_name;
        let skipped = |why: &str| {
            self.actuator
                .metrics()
                .deregistrations
                .get_or_create(&crate::metrics::ResultLabel {
                    result: "exit_skipped",
                })
                .inc();
            warn!(
                message = "not deregistering on exit (--deregister-on-exit)",
                reason = why
            );
            false
        };
        match tokio::time::timeout(
            DEREGISTER_GRACE,
            crate::reconciler::fresh_pods(&self.actuator, node),
        )
        .await
        {
            Ok(Ok(pods)) if crate::policy::hosts_games(&pods) => {
                skipped("game-server pods are on the node: its matches keep FleetIQ's hold")
            }
            Ok(Ok(_)) => true,
            Ok(Err(e)) => skipped(&format!("the node's pods could not be read: {e}")),
            Err(_) => skipped("the node's pods could not be read in time"),
        }
    }

    /// Waits for `shutdown` or for a task to end early (a bug we must not hide), then shuts
    /// down: stops the tasks, deregisters on exit if asked and still the owner, and hands
    /// the node's ownership over.
    pub async fn supervise(mut self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let failure = tokio::select! {
            biased;
            () = shutdown.cancelled() => None,
            ended = self.tasks.set.join_next() => match ended {
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
        self.shut_down(failure.is_none()).await;
        info!(message = "lastcall-agent stopped");
        match failure {
            Some(why) => Err(anyhow::anyhow!(why)),
            None => Ok(()),
        }
    }

    /// Nothing mutates after the tasks stop but the two exit steps, in this order: the
    /// owner's last action, then the handover, so the next agent starts after it.
    async fn shut_down(mut self, clean: bool) {
        self.tasks.stop.cancel();
        let _ = tokio::time::timeout(TASKS_GRACE, async {
            while self.tasks.set.join_next().await.is_some() {}
        })
        .await;
        self.tasks.set.abort_all();
        let node = self.config.node_name.clone();
        let owner = match &self.identity {
            Some(me) => tokio::time::timeout(
                HANDOVER_GRACE,
                owner::still_owner(&self.actuator, &node, me),
            )
            .await
            .unwrap_or(false),
            None => true,
        };
        // A Deregister whose outcome is unknown (timed out, failed mid-way) may still land:
        // the node is then not handed over, so the next agent registers only once this pod
        // is gone, never before a late Deregister.
        let mut hand_over = true;
        if self.config.deregister_on_exit && clean {
            if owner && !self.empty_on_exit().await {
                // Nothing was sent: the next agent may take the node over at once.
            } else if owner {
                match tokio::time::timeout(
                    DEREGISTER_GRACE,
                    self.actuator.fleetiq().deregister_on_exit(),
                )
                .await
                {
                    Ok(Ok(true)) => info!(message = "deregistered on exit (--deregister-on-exit)"),
                    Ok(Ok(false)) => info!(message = "deregister on exit: nothing to do"),
                    Ok(Err(e)) => {
                        hand_over = false;
                        warn!(message = "deregister on exit failed; not handing the node over (the next agent takes over once this pod is gone)", error = %e);
                    }
                    Err(_) => {
                        hand_over = false;
                        warn!(
                            message = "deregister on exit timed out; not handing the node over, so a late Deregister cannot follow the next agent's registration (it takes over once this pod is gone)"
                        );
                    }
                }
            } else {
                info!(message = "deregister on exit skipped: this agent does not own the node");
            }
        }
        if let Some(me) = &self.identity
            && owner
            && hand_over
        {
            match tokio::time::timeout(HANDOVER_GRACE, owner::release(&self.actuator, &node, me))
                .await
            {
                Ok(Ok(true)) => info!(message = "node ownership released for the next agent"),
                Ok(Ok(false)) => {}
                Ok(Err(e)) => {
                    warn!(message = "releasing node ownership failed; the next agent takes over once this pod is gone", error = %e)
                }
                Err(_) => warn!(
                    message = "releasing node ownership timed out; the next agent takes over once this pod is gone"
                ),
            }
        }
    }
}

/// One HTTP listener (`name`: `admin` for the probes, `metrics` for `--metrics-listen`).
async fn admin_task(
    name: &'static str,
    listener: tokio::net::TcpListener,
    router: axum::Router,
    stop: CancellationToken,
) -> &'static str {
    if let Err(e) = admin::serve(listener, router, stop.clone()).await {
        error!(message = "HTTP listener failed", listener = name, error = %e);
    }
    stop.cancelled().await;
    name
}

/// Register and claim, then heartbeat, whenever this agent owns the node. Heartbeats start
/// once start-up is done (registered, or found already draining and still registered), so
/// the first one never reaches GameLift before the registration nor after a
/// deregistration. They run on their own task, independent of Redis. A new life of the
/// machine (a new boot id, settled on the Node by the reconciler) decides start-up again:
/// what one Node read decided, perhaps before the kubelet posted the new boot id, is never
/// final.
async fn lifecycle_task(
    actuator: Actuator,
    owner: Owner,
    nodes: kube::Api<Node>,
    config: Config,
    metrics: Metrics,
    health: Health,
    stop: CancellationToken,
) {
    let fleetiq = actuator.fleetiq().clone();
    let mut lives = fleetiq.lives();
    loop {
        if !owner.is_owner() {
            // A standby agent is ready: the rollout must be able to go on.
            health.set(
                HEALTH_REGISTRATION,
                true,
                "standby: another agent owns the node",
            );
        }
        if !owner.owned(&stop).await {
            return;
        }
        lives.mark_unchanged();
        health.set(
            HEALTH_REGISTRATION,
            false,
            "registering and claiming in FleetIQ",
        );
        let heartbeat =
            match lifecycle::start_up(&fleetiq, nodes.clone(), &config.node_name, &stop).await {
                lifecycle::StartUp::Claimed => {
                    let now = progress::format_ts(jiff::Timestamp::now());
                    match actuator.annotate_node(keys::ANN_REGISTERED, &now).await {
                        Ok(_) => info!(message = "registered and claimed in FleetIQ"),
                        Err(e) => {
                            warn!(message = "recording registration on the Node failed", error = %e)
                        }
                    }
                    true
                }
                lifecycle::StartUp::Resumed { heartbeat } => heartbeat,
                lifecycle::StartUp::Returned => false,
            };
        health.set(HEALTH_REGISTRATION, true, "start-up done");
        if lives.has_changed().unwrap_or(false) {
            // A new life began while start-up read the last one: decide again.
            continue;
        }
        if heartbeat {
            lifecycle::heartbeat_loop(
                fleetiq.clone(),
                config.heartbeat_interval,
                config.failure_threshold,
                metrics.clone(),
                health.clone(),
                stop.clone(),
            )
            .await;
        }
        if stop.is_cancelled() {
            break;
        }
        if lives.has_changed().unwrap_or(false) {
            continue;
        }
        if fleetiq.is_deregistered() || owner.is_owner() {
            // Nothing to heartbeat in this life (deregistered, a draining node, a machine
            // that came back): that stays so until a new life begins.
            tokio::select! {
                () = stop.cancelled() => break,
                r = lives.changed() => if r.is_err() { break },
            }
            continue;
        }
        // Ownership was lost (another agent took the node): wait to get it back.
    }
    // Heartbeats end after deregistration; the task itself lives until shutdown.
    stop.cancelled().await;
}

struct FleetIqTask {
    config: Config,
    client: kube::Client,
    sdk: Option<aws_sdk_gamelift::Client>,
    actuator: Actuator,
    owner: Owner,
    metrics: Metrics,
    health: Health,
    view: watch::Sender<FleetIqView>,
    iid: watch::Sender<Option<String>>,
}

impl FleetIqTask {
    /// Starts the FleetIQ task and the message-age gauge it feeds.
    fn spawn(self, view: watch::Receiver<FleetIqView>, tasks: &mut Tasks) {
        let metrics = self.metrics.clone();
        tasks.spawn(|stop| message_age(metrics, view, stop));
        tasks.spawn(|stop| async move {
            self.run(stop).await;
            "fleetiq"
        });
    }

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

    /// The Redis subscription, when `--redis-url` is set: the channel defaults to the
    /// instance id.
    fn redis_source(&self, iid: &str) -> Option<RedisSource> {
        let target = self.config.redis_url.clone()?;
        Some(RedisSource {
            target,
            channel: self
                .config
                .redis_channel
                .clone()
                .unwrap_or_else(|| iid.to_string()),
            instance_id: iid.to_string(),
            metrics: self.metrics.clone(),
            view: self.view.clone(),
            ping_every: self.config.redis_ping_interval,
            ca_file: self.config.redis_ca_file.clone(),
        })
    }

    async fn run(mut self, stop: CancellationToken) {
        self.health
            .set(HEALTH_REGISTRATION, false, "waiting for the instance id");
        let Some(iid) = self.instance_id(&stop).await else {
            stop.cancelled().await;
            return;
        };
        let _ = self.iid.send(Some(iid.clone()));
        let group = self.config.game_server_group.clone().unwrap_or_default();
        let sdk = match self.sdk.take() {
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
        tasks.spawn(lifecycle_task(
            self.actuator.clone(),
            self.owner.clone(),
            kube::Api::all(self.client.clone()),
            self.config.clone(),
            self.metrics.clone(),
            self.health.clone(),
            stop.clone(),
        ));
        if let Some(src) = self.redis_source(&iid) {
            tasks.spawn(src.run(stop.clone()));
        } else {
            warn!(
                message = "no --redis-url: FleetIQ status comes from direct GameLift checks only"
            );
        }
        let stale_after = self.config.publish_period * self.config.stale_periods;
        let fallback = run_fallback(
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
        );
        // The fallback asks GameLift: only the node's owner does.
        let (owner, s) = (self.owner.clone(), stop.clone());
        tasks.spawn(async move {
            if owner.owned(&s).await {
                fallback.await;
            }
            s.cancelled().await;
        });
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
