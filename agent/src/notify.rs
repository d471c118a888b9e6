//! Optional webhook notifications (Slack, Teams, anything taking a JSON POST) at a drain's
//! moments: started, hard deadline, cancelled, deregistered or empty.
//!
//! The reconciler hands each one over with a `try_send` on a bounded queue, so a slow or
//! dead receiver never holds a drain step: a full queue drops the notification (counted).
//! One task posts them in order, each attempt bounded by `--notify-timeout`, retrying
//! connection failures, timeouts, 429 and 5xx a bounded number of times. Every outcome is
//! counted in `lastcall_notifications_total{event,outcome}`; a failure is a warning log.
//!
//! The URL carries the receiver's token, so it is read from a file (a Secret's volume) or
//! `LASTCALL_NOTIFY_URL`, never from an argument, and never written to a log: reqwest's
//! errors are logged without their URL.

pub mod template;

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::metrics::{EventOutcome, Metrics};
pub use template::{Template, Values};

/// The environment variable a Secret may fill instead of `--notify-url-file`.
pub const URL_ENV: &str = "LASTCALL_NOTIFY_URL";
/// Notifications waiting to be posted; more are dropped (a drain has at most a handful).
pub const QUEUE: usize = 32;
/// Attempts per notification (the first and two retries).
const ATTEMPTS: u32 = 3;
/// Pause before the first retry; doubled before the next.
const RETRY_PAUSE: Duration = Duration::from_millis(500);
/// The longest `Retry-After` of a 429 or 503 that is honoured.
const RETRY_AFTER_MAX: Duration = Duration::from_secs(10);
/// Characters of an error answer's body kept for the log.
const BODY_IN_LOG: usize = 200;

/// The drain moments that notify.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Event {
    /// The fence that started a drain (the `DrainStarted` Event).
    DrainStarted,
    /// lastcall began ending matches at `deadline − grace` (the `MatchesEnded` Event).
    HardDeadline,
    /// The signal cleared and lastcall undid its changes (the `DrainCancelled` Event).
    DrainCancelled,
    /// The empty node was deregistered from FleetIQ (the `Deregistered` Event).
    Deregistered,
    /// Without FleetIQ: the drained node is empty and may be taken.
    Empty,
}

impl Event {
    pub const ALL: [Event; 5] = [
        Self::DrainStarted,
        Self::HardDeadline,
        Self::DrainCancelled,
        Self::Deregistered,
        Self::Empty,
    ];

    /// The `{event}` value and the metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::DrainStarted => "drain_started",
            Self::HardDeadline => "hard_deadline",
            Self::DrainCancelled => "drain_cancelled",
            Self::Deregistered => "deregistered",
            Self::Empty => "empty",
        }
    }
}

/// One notification, as the reconciler knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    pub event: Event,
    /// The drain's cause (`viability`, `preemption`, …), `{reason}`.
    pub reason: String,
    /// The signal source that drives the drain, `{source}`.
    pub source: String,
    /// RFC 3339, or empty.
    pub deadline: String,
    pub message: String,
}

/// Where and how notifications are posted.
pub struct Settings {
    /// Secret: never logged.
    url: url::Url,
    pub template: Template,
    pub timeout: Duration,
    pub node: String,
    pub cluster: String,
}

impl Settings {
    /// The URL from `file`, else from `env` (the value of [`URL_ENV`]); `Ok(None)` when
    /// neither is set (notifications off). Errors name the file or the variable, never
    /// the URL.
    pub fn url(file: Option<&Path>, env: Option<String>) -> anyhow::Result<Option<url::Url>> {
        let (raw, from) = match (file, env) {
            (Some(f), _) => (
                std::fs::read_to_string(f)
                    .with_context(|| format!("reading --notify-url-file {}", f.display()))?,
                format!("--notify-url-file {}", f.display()),
            ),
            (None, Some(v)) => (v, URL_ENV.to_string()),
            (None, None) => return Ok(None),
        };
        let raw = raw.trim();
        if raw.is_empty() {
            anyhow::bail!("{from} is empty: expected the webhook URL");
        }
        let u = url::Url::parse(raw)
            .map_err(|e| anyhow::anyhow!("{from} does not hold a URL ({e})"))?;
        if !matches!(u.scheme(), "http" | "https") || u.host_str().is_none() {
            anyhow::bail!("{from} must hold an http:// or https:// URL");
        }
        Ok(Some(u))
    }

    pub fn new(
        url: url::Url,
        template: Template,
        timeout: Duration,
        node: String,
        cluster: String,
    ) -> Self {
        Self {
            url,
            template,
            timeout,
            node,
            cluster,
        }
    }
}

/// The reconciler's end: never blocks, never fails a drain step.
#[derive(Clone)]
pub struct Notifier {
    tx: Option<mpsc::Sender<Notification>>,
    metrics: Option<Metrics>,
}

impl Notifier {
    /// No webhook configured: every notification is ignored.
    pub fn off() -> Self {
        Self {
            tx: None,
            metrics: None,
        }
    }

    pub fn is_on(&self) -> bool {
        self.tx.is_some()
    }

    /// Whether it tells the moment a drained node may be taken (`empty`): only without
    /// FleetIQ (`deregister`), whose deregistration is told instead. An operator may take the
    /// node on it, so it is a hand-off like any other.
    pub fn tells_empty(&self, deregister: bool) -> bool {
        self.is_on() && !deregister
    }

    /// Queues `n`; a full queue drops it (counted and logged).
    pub fn send(&self, n: Notification) {
        let Some(tx) = &self.tx else {
            return;
        };
        let event = n.event;
        if tx.try_send(n).is_err() {
            warn!(
                message = "notification queue full; dropping a notification",
                event = event.as_str()
            );
            if let Some(m) = &self.metrics {
                count(m, event, "dropped");
            }
        }
    }
}

fn count(m: &Metrics, event: Event, outcome: &'static str) {
    m.notifications
        .get_or_create(&EventOutcome {
            event: event.as_str(),
            outcome,
        })
        .inc();
}

/// Builds the HTTP client and the queue; the returned [`Poster`] is the task that posts.
pub fn start(settings: Settings, metrics: Metrics) -> anyhow::Result<(Notifier, Poster)> {
    let http = reqwest::Client::builder()
        .timeout(settings.timeout)
        .connect_timeout(settings.timeout.min(Duration::from_secs(2)))
        // A redirect is a failure: the token-bearing request goes nowhere else.
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .context("building the notification HTTP client")?;
    let (tx, rx) = mpsc::channel(QUEUE);
    info!(
        message = "webhook notifications on",
        host = settings.url.host_str().unwrap_or(""),
        timeout_ms = settings.timeout.as_millis() as u64
    );
    Ok((
        Notifier {
            tx: Some(tx),
            metrics: Some(metrics.clone()),
        },
        Poster {
            settings,
            http,
            rx,
            metrics,
        },
    ))
}

/// Posts queued notifications, one at a time, in order.
pub struct Poster {
    settings: Settings,
    http: reqwest::Client,
    rx: mpsc::Receiver<Notification>,
    metrics: Metrics,
}

/// Why an attempt failed, and whether another may succeed.
struct Failure {
    retry: bool,
    retry_after: Option<Duration>,
    what: String,
}

impl Poster {
    /// Runs until `stop`; what is still queued then is not sent.
    pub async fn run(mut self, stop: CancellationToken) {
        loop {
            let n = tokio::select! {
                () = stop.cancelled() => return,
                n = self.rx.recv() => n,
            };
            let Some(n) = n else {
                stop.cancelled().await;
                return;
            };
            tokio::select! {
                () = stop.cancelled() => return,
                () = self.post(n) => {}
            }
        }
    }

    fn values(&self, n: &Notification) -> Values {
        Values {
            event: n.event.as_str().into(),
            node: self.settings.node.clone(),
            cluster: self.settings.cluster.clone(),
            reason: n.reason.clone(),
            source: n.source.clone(),
            deadline: n.deadline.clone(),
            message: n.message.clone(),
        }
    }

    async fn post(&self, n: Notification) {
        let event = n.event.as_str();
        let body = match self.settings.template.render(&self.values(&n)) {
            Ok(b) => b,
            Err(e) => {
                warn!(message = "notification not sent: the template rendered no JSON", event, error = %e);
                count(&self.metrics, n.event, "failed");
                return;
            }
        };
        let mut pause = RETRY_PAUSE;
        for attempt in 1..=ATTEMPTS {
            let failure = match self.attempt(&body).await {
                Ok(()) => {
                    debug!(message = "notification sent", event, attempt);
                    count(&self.metrics, n.event, "sent");
                    return;
                }
                Err(f) => f,
            };
            if !failure.retry || attempt == ATTEMPTS {
                warn!(message = "notification failed; the drain goes on without it", event, attempts = attempt, error = %failure.what);
                count(&self.metrics, n.event, "failed");
                return;
            }
            let wait = failure
                .retry_after
                .map_or(pause, |d| d.min(RETRY_AFTER_MAX));
            debug!(message = "notification failed; retrying", event, attempt, error = %failure.what, retry_in_ms = wait.as_millis() as u64);
            tokio::time::sleep(wait).await;
            pause *= 2;
        }
    }

    async fn attempt(&self, body: &str) -> Result<(), Failure> {
        let resp = self
            .http
            .post(self.settings.url.clone())
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.to_string())
            .send()
            .await
            .map_err(|e| Failure {
                retry: e.is_connect() || e.is_timeout() || e.is_request(),
                retry_after: None,
                // reqwest puts the URL, token and all, in its errors.
                what: e.without_url().to_string(),
            })?;
        let status = resp.status();
        if status.is_success() {
            return Ok(());
        }
        let retry_after = resp
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let text = tokio::time::timeout(self.settings.timeout, resp.text())
            .await
            .ok()
            .and_then(Result::ok)
            .unwrap_or_default();
        let mut text: String = text
            .replace(self.settings.url.as_str(), "<url>")
            .replace(self.settings.url.path(), "<path>")
            .chars()
            .filter(|c| !c.is_control())
            .take(BODY_IN_LOG)
            .collect();
        if text.is_empty() {
            text = "(no body)".into();
        }
        Err(Failure {
            retry: status.as_u16() == 429 || status.is_server_error(),
            retry_after,
            what: format!("HTTP {status}: {text}"),
        })
    }
}

#[cfg(test)]
mod tests;
