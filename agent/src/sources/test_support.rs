//! One task source run by itself, for the tests beside each source: the context the agent
//! would give it, every report it publishes, and its metrics.

use std::sync::{Arc, Mutex};

use clap::Parser;
use lastcall_common::admin::Health;
use lastcall_emulators::eventually::wait_for;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{Report, SourceContext, StartTask};
use crate::config::Config;
use crate::metrics::{Metrics, SourceLabel, SourceReason, SourceStatus};
use crate::notice::{Notice, Source};

/// A started source; dropping it stops the source.
pub struct Started {
    source: Source,
    metrics: Metrics,
    reports: Arc<Mutex<Vec<Report>>>,
    /// Every Warning Event the source asked for on the Node: (reason, note).
    warned: Arc<Mutex<Vec<(&'static str, String)>>>,
    shutdown: CancellationToken,
    /// What the reconciler would say: the node is empty and handed off.
    pub node_empty: watch::Sender<bool>,
    /// Whether the source's agent acts on the node (`false`: a standby). Starts `true`.
    pub acting: Arc<std::sync::atomic::AtomicBool>,
    /// The source's reports as published, to wait on each in order (no timer).
    pub updates: watch::Receiver<Report>,
}

impl Drop for Started {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Starts `source` through its `start`, with the config of `lastcall-agent --node-name n1`
/// followed by `args`.
///
/// # Panics
/// If the flags do not parse or the source does not start for them.
pub fn start_source(source: Source, start: StartTask, args: &[&str]) -> Started {
    start_source_with(source, start, args, None)
}

/// [`start_source`], with the agent's cached Node (`kube`) where the source reads one.
pub fn start_source_with(
    source: Source,
    start: StartTask,
    args: &[&str],
    kube: Option<super::KubeAccess>,
) -> Started {
    let argv = ["lastcall-agent", "--node-name", "n1"]
        .iter()
        .chain(args)
        .copied();
    let config = Config::try_parse_from(argv).unwrap_or_else(|e| panic!("bad test flags: {e}"));
    let (metrics, _) = Metrics::new();
    let (out, mut rx) = watch::channel(Report::Unknown);
    let shutdown = CancellationToken::new();
    let (node_empty, empty_rx) = watch::channel(false);
    let warnings: Arc<Mutex<Vec<(&'static str, String)>>> = Arc::default();
    let acting = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let acts = acting.clone();
    let warned = warnings.clone();
    let task = start(SourceContext {
        config: Arc::new(config),
        metrics: metrics.clone(),
        health: Health::new(&[]),
        out,
        fleetiq: None,
        node_empty: empty_rx,
        aws_credentials: Some(aws_sdk_autoscaling::config::Credentials::new(
            "AKIDLASTCALLTEST",
            "lastcall-test-secret",
            None,
            None,
            "lastcall-tests",
        )),
        kube,
        node_warnings: super::NodeWarnings::new(move |reason, note| {
            warned
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((reason, note));
        }),
        acting: super::Acting::new(move || acts.load(std::sync::atomic::Ordering::SeqCst)),
        shutdown: shutdown.clone(),
    })
    .unwrap_or_else(|| panic!("{} did not start for {args:?}", source.as_str()));
    tokio::spawn(task);
    let updates = rx.clone();
    // The source publishes only on change and the recorder is woken by each one, so a
    // report that stood between two others is recorded too.
    let reports = Arc::new(Mutex::new(vec![rx.borrow_and_update().clone()]));
    let log = reports.clone();
    tokio::spawn(async move {
        while rx.changed().await.is_ok() {
            let r = rx.borrow_and_update().clone();
            log.lock().unwrap_or_else(|e| e.into_inner()).push(r);
        }
    });
    Started {
        source,
        metrics,
        reports,
        warned: warnings,
        shutdown,
        node_empty,
        acting,
        updates,
    }
}

impl Started {
    /// Every report published so far, the first being the initial `Unknown`.
    pub fn reports(&self) -> Vec<Report> {
        self.reports
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Every Warning Event the source asked for on the Node, as (reason, note).
    pub fn warnings(&self) -> Vec<(&'static str, String)> {
        self.warned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The latest report.
    pub fn current(&self) -> Report {
        self.reports().pop().unwrap_or_default()
    }

    /// Waits (bounded) for a known report whose notices satisfy `want`, and returns them.
    pub async fn wait_for_notices(
        &self,
        what: &str,
        want: impl Fn(&[Notice]) -> bool,
    ) -> Vec<Notice> {
        wait_for(what, || async {
            match self.current() {
                Report::Known(n) if want(&n) => Some(n),
                _ => None,
            }
        })
        .await
    }

    /// `lastcall_signals_total{source, status}`.
    pub fn signals(&self, status: &'static str) -> u64 {
        self.metrics
            .signals
            .get_or_create(&SourceStatus {
                source: self.source.as_str(),
                status,
            })
            .get()
    }

    /// The process metrics the source was given (to read any series, or to stand in for
    /// what other parts of the agent publish).
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// `lastcall_signals_rejected_total{source, reason}`.
    pub fn rejected(&self, reason: &'static str) -> u64 {
        self.metrics
            .signals_rejected
            .get_or_create(&SourceReason {
                source: self.source.as_str(),
                reason,
            })
            .get()
    }

    /// `lastcall_source_errors_total{source, reason}`.
    pub fn errors(&self, reason: &'static str) -> u64 {
        self.metrics
            .source_errors
            .get_or_create(&SourceReason {
                source: self.source.as_str(),
                reason,
            })
            .get()
    }

    /// `lastcall_asg_lifecycle_calls_total{operation, result}`.
    pub fn asg_calls(&self, operation: &'static str, result: &'static str) -> u64 {
        self.metrics
            .asg_calls
            .get_or_create(&crate::metrics::OperationResult { operation, result })
            .get()
    }

    /// `lastcall_source_up{source}`.
    pub fn up(&self) -> i64 {
        self.metrics
            .source_up
            .get_or_create(&SourceLabel {
                source: self.source.as_str(),
            })
            .get()
    }
}
