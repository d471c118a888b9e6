//! Every disruption signal, through one registry.
//!
//! A source is one module plus one line in [`REGISTRY`]. Each says what it currently sees as
//! a [`Report`] (level, not edge). A [`NoticeBoard`] merges the reports and says which
//! sources are still unknown; the reconciler and policy only ever see the board, never a
//! source by name. Signals read from the agent's own Node are plain functions of the
//! observed Node, evaluated on every pass.

pub mod asg_lifecycle;
pub mod aws_imds;
pub mod aws_queue;
pub mod azure_events;
pub mod fleetiq;
pub mod gce_metadata;
pub mod karpenter_expiry;
pub mod node;
#[cfg(test)]
mod test_support;

use std::sync::Arc;

use futures::future::BoxFuture;
use jiff::Timestamp;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

use crate::notice::{Notice, Source};
use crate::observed::NodeView;

/// What one source currently says.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Report {
    /// Nothing heard since start (or never reachable). Not "all clear": a drain this source
    /// started is held, never cancelled.
    #[default]
    Unknown,
    /// Its current notices; empty means nothing is wrong.
    Known(Vec<Notice>),
}

/// Settings the Node signals read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeSignalConfig {
    /// How long before a known maintenance window the node stops taking new matches.
    pub maintenance_lead: std::time::Duration,
    /// Treat a cordon lastcall did not make as a drain signal.
    pub drain_on_foreign_cordon: bool,
}

/// A signal read from the agent's own Node.
pub type NodeSignal = fn(&NodeView, &NodeSignalConfig, Timestamp) -> Option<Notice>;

/// What a task source gets: where to report, and the process's shared pieces it may use.
pub struct SourceContext {
    pub config: Arc<crate::config::Config>,
    pub metrics: crate::metrics::Metrics,
    pub health: lastcall_common::admin::Health,
    pub out: watch::Sender<Report>,
    /// The FleetIQ integration's view of this instance, when FleetIQ is on.
    pub fleetiq: Option<fleetiq::Inputs>,
    /// `true` once this agent's node is empty and every hand-off before it is done (FleetIQ
    /// deregistered where it is on): a source whose platform waits for the node (a
    /// lifecycle hook, an approvable event) may then let it go, once. Published by the
    /// reconciler; a source honours `--dry-run` itself (counts, never sends).
    pub node_empty: watch::Receiver<bool>,
    /// Credentials for AWS clients a source builds; `None`: the default chain.
    pub aws_credentials: Option<aws_sdk_autoscaling::config::Credentials>,
    /// The agent's own Node as its watch caches it, and a client for what the Node points
    /// at (its Karpenter NodeClaim). `None` where there is no API server (unit tests).
    pub kube: Option<KubeAccess>,
    /// Warning Events on the agent's own Node, for what an operator must fix.
    pub node_warnings: NodeWarnings,
    /// Whether this agent acts on the node now: a standby agent (a rollout runs two) reads
    /// and reports, but sends nothing to a platform (heartbeats, completions, approvals).
    pub acting: Acting,
    pub shutdown: CancellationToken,
}

/// Whether this agent is the one acting on its node (see `owner`); checked before every
/// write a source makes to a platform.
#[derive(Clone)]
pub struct Acting(Arc<dyn Fn() -> bool + Send + Sync>);

impl Acting {
    pub fn new(f: impl Fn() -> bool + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
    }

    /// Always acting: the only agent on its node (tests, no ownership).
    pub fn always() -> Self {
        Self::new(|| true)
    }

    pub fn now(&self) -> bool {
        (self.0)()
    }
}

/// What a source may read from the API server: the cached Node (free to read as often as
/// it likes) and a client for its own, rare requests.
#[derive(Clone)]
pub struct KubeAccess {
    pub client: kube::Client,
    pub node: kube::runtime::reflector::Store<k8s_openapi::api::core::v1::Node>,
    /// Changes each time the Node watch delivers an event (the store already has it).
    pub node_changes: watch::Receiver<()>,
}

/// Queues a Warning Event on the agent's own Node: never blocks, never fails (the actuator
/// counts a dropped one, and only logs it under `--dry-run`).
#[derive(Clone)]
pub struct NodeWarnings(Arc<dyn Fn(&'static str, String) + Send + Sync>);

impl NodeWarnings {
    pub fn new(f: impl Fn(&'static str, String) + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
    }

    /// Says `note` under `reason` on the Node.
    pub fn warn(&self, reason: &'static str, note: String) {
        (self.0)(reason, note);
    }
}

/// Starts a task source; `None` when it is not configured on this node.
pub type StartTask = fn(SourceContext) -> Option<BoxFuture<'static, ()>>;

#[derive(Clone, Copy)]
pub enum Kind {
    Node(NodeSignal),
    Task(StartTask),
}

/// One registry line: a source's name and how it runs.
#[derive(Clone, Copy)]
pub struct Registered {
    pub source: Source,
    pub kind: Kind,
}

/// Every source lastcall knows. Adding one: its module, and one line here.
#[rustfmt::skip]
pub const REGISTRY: &[Registered] = &[
    Registered { source: fleetiq::SOURCE, kind: Kind::Task(fleetiq::start) },
    Registered { source: gce_metadata::SOURCE, kind: Kind::Task(gce_metadata::start) },
    Registered { source: aws_imds::SOURCE, kind: Kind::Task(aws_imds::start) },
    Registered { source: aws_queue::SOURCE, kind: Kind::Task(aws_queue::start) },
    Registered { source: azure_events::SOURCE, kind: Kind::Task(azure_events::start) },
    Registered { source: asg_lifecycle::SOURCE, kind: Kind::Task(asg_lifecycle::start) },
    Registered { source: karpenter_expiry::SOURCE, kind: Kind::Task(karpenter_expiry::start) },
    Registered { source: node::MANUAL, kind: Kind::Node(node::manual) },
    Registered { source: node::KARPENTER, kind: Kind::Node(node::karpenter) },
    Registered { source: node::CLUSTER_AUTOSCALER, kind: Kind::Node(node::cluster_autoscaler) },
    Registered { source: node::GKE, kind: Kind::Node(node::gke) },
    Registered { source: node::FOREIGN_CORDON, kind: Kind::Node(node::foreign_cordon) },
];

/// The merged view of every running source, read by the reconciler.
#[derive(Clone)]
pub struct NoticeBoard {
    tasks: Vec<(Source, watch::Receiver<Report>)>,
    /// When a task source's report last changed (for signal-to-fence latency).
    last_change: Arc<std::sync::Mutex<Option<tokio::time::Instant>>>,
    node_signals: Vec<(Source, NodeSignal)>,
    node_config: NodeSignalConfig,
}

impl NoticeBoard {
    pub fn new(registry: &[Registered], node_config: NodeSignalConfig) -> Self {
        Self {
            tasks: vec![],
            node_signals: registry
                .iter()
                .filter_map(|r| match r.kind {
                    Kind::Node(f) => Some((r.source, f)),
                    Kind::Task(_) => None,
                })
                .collect(),
            node_config,
            last_change: Arc::default(),
        }
    }

    /// When a task source's report last changed, if one has.
    pub fn last_change(&self) -> Option<tokio::time::Instant> {
        self.last_change.lock().ok().and_then(|g| *g)
    }

    /// Adds a running task source; every change to it pokes `trigger`.
    pub fn add(
        &mut self,
        source: Source,
        rx: watch::Receiver<Report>,
        trigger: Arc<Notify>,
        shutdown: CancellationToken,
    ) {
        let mut changes = rx.clone();
        let last_change = self.last_change.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    r = changes.changed() => {
                        if r.is_err() {
                            return;
                        }
                        if let Ok(mut g) = last_change.lock() {
                            *g = Some(tokio::time::Instant::now());
                        }
                        trigger.notify_one();
                    }
                }
            }
        });
        self.tasks.push((source, rx));
    }

    /// Every current notice: the task sources' and the Node signals'.
    pub fn notices(&self, node: &NodeView, now: Timestamp) -> Vec<Notice> {
        let mut out: Vec<Notice> = self
            .tasks
            .iter()
            .filter_map(|(_, rx)| match &*rx.borrow() {
                Report::Known(n) => Some(n.clone()),
                Report::Unknown => None,
            })
            .flatten()
            .collect();
        out.extend(
            self.node_signals
                .iter()
                .filter_map(|(_, f)| f(node, &self.node_config, now)),
        );
        out
    }

    /// Sources that have not reported yet. Node signals are always known.
    pub fn unknown(&self) -> Vec<Source> {
        self.tasks
            .iter()
            .filter(|(_, rx)| matches!(*rx.borrow(), Report::Unknown))
            .map(|(s, _)| *s)
            .collect()
    }
}

/// Publishes a source's current report; `true` when it changed (only then are readers woken).
pub fn publish(out: &watch::Sender<Report>, report: Report) -> bool {
    out.send_if_modified(|cur| {
        let changed = *cur != report;
        *cur = report;
        changed
    })
}

/// Starts every configured task source of `registry` (normally [`REGISTRY`], plus any a
/// test or an embedder registers in-process) and returns the board that reads them.
pub fn start_all(
    registry: &[Registered],
    make: impl Fn(watch::Sender<Report>) -> SourceContext,
    node_config: NodeSignalConfig,
    trigger: Arc<Notify>,
    shutdown: CancellationToken,
) -> (NoticeBoard, Vec<(Source, BoxFuture<'static, ()>)>) {
    let mut board = NoticeBoard::new(registry, node_config);
    let mut tasks = vec![];
    Source::remember(registry.iter().map(|r| r.source));
    for r in registry {
        if let Kind::Task(start) = r.kind {
            let (tx, rx) = watch::channel(Report::Unknown);
            if let Some(task) = start(make(tx)) {
                board.add(r.source, rx, trigger.clone(), shutdown.clone());
                tasks.push((r.source, task));
            }
        }
    }
    (board, tasks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_names_are_unique_and_the_built_in_names() {
        let mut names: Vec<&str> = REGISTRY.iter().map(|r| r.source.as_str()).collect();
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n, "duplicate source names");
        let mut built_in: Vec<&str> = crate::notice::BUILT_IN.iter().map(|s| s.as_str()).collect();
        built_in.sort_unstable();
        assert_eq!(
            names, built_in,
            "notice::BUILT_IN lists every registered source"
        );
        for r in REGISTRY {
            assert_eq!(Source::by_name(r.source.as_str()), Some(r.source));
        }
        assert_eq!(Source::by_name("mars"), None);
    }

    /// A record an in-process source asked for reads back as written, so the fence does not
    /// write it again on every pass.
    #[test]
    fn an_embedded_sources_record_reads_back() {
        use crate::deadline::Entry;
        use crate::progress::DrainRecord;
        const MOON: Source = Source("moon");
        let record = DrainRecord {
            entries: vec![Entry {
                source: MOON,
                cause: crate::notice::Cause::Maintenance,
                severity: crate::notice::Severity::Terminate,
                deadline: None,
                cancellable: false,
                first_seen: Timestamp::UNIX_EPOCH,
                restated: false,
            }],
        };
        assert_eq!(
            DrainRecord::parse(&record.to_annotation()),
            None,
            "unknown yet"
        );
        Source::remember([MOON]);
        assert_eq!(Source::by_name("moon"), Some(MOON));
        assert_eq!(
            DrainRecord::parse(&record.to_annotation()),
            Some(record.clone())
        );
    }
}
