//! GCE metadata: host maintenance and preemption.
//!
//! `instance/maintenance-event` and `instance/preempted` are each watched with their own
//! hanging GET (`wait_for_change` with `last_etag` always passed, `timeout_sec` below the
//! client timeout), after one plain read at start so an event already pending is acted on.
//! `instance/upcoming-maintenance?alt=json` is polled. An error never means `NONE`: the last
//! view is kept, retried with capped backoff. Neither does an unreadable answer: an empty
//! body, a value this version does not know, or an upcoming-maintenance `NONE`, `{}` or
//! error object is rejected (counted, logged) and the last reading stands; with none yet
//! the source stays unknown, so a drain it started is held, never cancelled. A metadata server that cannot be reached (GKE
//! Workload Identity without hostNetwork, Autopilot) is reported once as degraded, with a
//! metric and a `/readyz` detail; the other sources go on.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use jiff::{SignedDuration, Timestamp};
use lastcall_common::admin::Health;
use lastcall_common::backoff::Backoff;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{Report, SourceContext};
use crate::metrics::{Metrics, SourceLabel, SourceReason, SourceStatus};
use crate::notice::{Cause, Notice, Severity, Source};

pub const SOURCE: Source = Source("gce_metadata");
/// `/readyz` detail (never failing: a missing metadata server is a degraded source, not an
/// unready agent).
pub const HEALTH: &str = "gce_metadata";

const KEY_EVENT: &str = "maintenance-event";
const KEY_PREEMPTED: &str = "preempted";
const KEY_UPCOMING: &str = "upcoming-maintenance";
/// The VM's own host-maintenance policy: what an `ONGOING` maintenance does to it.
const KEY_ON_HOST_MAINTENANCE: &str = "scheduling/on-host-maintenance";

/// `scheduling/on-host-maintenance`: whether host maintenance live-migrates this VM or
/// stops it (Spot and preemptible VMs, GPU VMs: always stopped).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnHostMaintenance {
    Migrate,
    Terminate,
}

/// `MIGRATE` or `TERMINATE`; anything else is rejected, never guessed.
pub fn parse_on_host_maintenance(body: &str) -> Result<OnHostMaintenance, ParseError> {
    match body.trim() {
        "MIGRATE" => Ok(OnHostMaintenance::Migrate),
        "TERMINATE" => Ok(OnHostMaintenance::Terminate),
        other => Err(ParseError::UpcomingValue {
            field: "scheduling/on-host-maintenance",
            value: trimmed(other),
        }),
    }
}
/// Failed first reads after which the metadata server counts as unreachable.
const UNREACHABLE_AFTER: u32 = 3;
/// A read that got no answer is tried again after this, doubling up to [`RETRY_MAX`]: the
/// metadata server is on the VM's own host, and while a key is unread the source is unknown
/// (a drain it asked for is held, a machine that came back stays fenced).
const RETRY_FIRST: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// What `instance/maintenance-event` says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MaintenanceEvent {
    None,
    /// Live migration: the VM survives. Observed, never drained.
    Migrate,
    /// `TERMINATE_ON_HOST_MAINTENANCE`: the VM will be stopped.
    Terminate,
}

impl MaintenanceEvent {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "NONE",
            Self::Migrate => "MIGRATE_ON_HOST_MAINTENANCE",
            Self::Terminate => "TERMINATE_ON_HOST_MAINTENANCE",
        }
    }
}

fn trimmed(s: &str) -> String {
    s.chars().take(64).collect()
}

/// The three documented values; anything else (an empty body included) is not read as any
/// of them: it is rejected, and the last reading stands.
pub fn parse_event(body: &str) -> Result<MaintenanceEvent, ParseError> {
    match body.trim() {
        "NONE" => Ok(MaintenanceEvent::None),
        "MIGRATE_ON_HOST_MAINTENANCE" => Ok(MaintenanceEvent::Migrate),
        "TERMINATE_ON_HOST_MAINTENANCE" => Ok(MaintenanceEvent::Terminate),
        "" => Err(ParseError::Empty(KEY_EVENT)),
        other => Err(ParseError::Event(trimmed(other))),
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("{0} answered an empty body")]
    Empty(&'static str),
    #[error(
        "maintenance-event {0:?} is not NONE, MIGRATE_ON_HOST_MAINTENANCE or TERMINATE_ON_HOST_MAINTENANCE"
    )]
    Event(String),
    #[error("preempted is neither TRUE nor FALSE: {0:?}")]
    Preempted(String),
    /// Empty, `NONE`, `{}` or an error object: nothing definite either way.
    #[error("upcoming-maintenance says nothing definite ({0})")]
    UpcomingUnknown(String),
    #[error("upcoming-maintenance {field} {value:?} is not a value this version knows")]
    UpcomingValue { field: &'static str, value: String },
    #[error("upcoming-maintenance is not a notice: {0}")]
    Upcoming(String),
}

impl ParseError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Empty(_) => "empty",
            Self::Event(_) | Self::UpcomingValue { .. } => "unknown_value",
            Self::Preempted(_) => "bad_preempted",
            Self::UpcomingUnknown(_) => "upcoming_unknown",
            Self::Upcoming(_) => "bad_upcoming",
        }
    }
}

pub fn parse_preempted(body: &str) -> Result<bool, ParseError> {
    match body.trim() {
        "TRUE" => Ok(true),
        "FALSE" => Ok(false),
        "" => Err(ParseError::Empty(KEY_PREEMPTED)),
        other => Err(ParseError::Preempted(trimmed(other))),
    }
}

/// `maintenance_status` of a notice that is still to come or under way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpcomingStatus {
    /// Scheduled; may be started early when `can_reschedule`.
    Pending,
    /// Under way: the VM is being stopped.
    Ongoing,
    /// The documented `UNKNOWN`: a window is announced, its state is not.
    Unknown,
}

impl UpcomingStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "PENDING",
            Self::Ongoing => "ONGOING",
            Self::Unknown => "UNKNOWN",
        }
    }
}

/// Scheduled host maintenance from `upcoming-maintenance`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Upcoming {
    pub window_start: Timestamp,
    pub status: UpcomingStatus,
    /// The maintenance may be started early (GKE hand-back).
    pub can_reschedule: bool,
}

/// `Ok(None)`: nothing is scheduled, said positively (404: the key is not defined, or
/// `maintenance_status: COMPLETE`). `Ok(Some)`: a notice. Anything else is an error and
/// never changes what was known: an empty body, `NONE`, `{}` or an error object say nothing
/// definite (`UpcomingUnknown`), and a field value this version does not know is rejected,
/// never guessed.
pub fn parse_upcoming(status: u16, body: &str) -> Result<Option<Upcoming>, ParseError> {
    if status == 404 {
        return Ok(None);
    }
    let t = body.trim();
    if t.is_empty() || t == "NONE" {
        return Err(ParseError::UpcomingUnknown(format!("{t:?}")));
    }
    let v: serde_json::Value =
        serde_json::from_str(t).map_err(|e| ParseError::Upcoming(e.to_string()))?;
    let Some(obj) = v.as_object() else {
        return Err(ParseError::Upcoming("not an object".into()));
    };
    // The docs print it wrapped in a label; accept that form too.
    let obj = match obj.get("Upcoming maintenance").and_then(|w| w.as_object()) {
        Some(inner) => inner,
        None => obj,
    };
    if obj.is_empty() {
        return Err(ParseError::UpcomingUnknown("{}".into()));
    }
    if let Some(e) = obj.get("error") {
        return Err(ParseError::UpcomingUnknown(trimmed(&e.to_string())));
    }
    let text = |k: &str| obj.get(k).and_then(|x| x.as_str());
    let value = |field: &'static str, v: Option<&str>| ParseError::UpcomingValue {
        field,
        value: v.map_or_else(|| "<missing>".into(), trimmed),
    };
    let status = match text("maintenance_status") {
        Some("PENDING") => UpcomingStatus::Pending,
        Some("ONGOING") => UpcomingStatus::Ongoing,
        Some("UNKNOWN") => UpcomingStatus::Unknown,
        Some("COMPLETE") => return Ok(None),
        other => return Err(value("maintenance_status", other)),
    };
    match text("type") {
        None | Some("SCHEDULED" | "UNSCHEDULED" | "MULTIPLE" | "UNKNOWN_TYPE") => {}
        other => return Err(value("type", other)),
    }
    // `can_reschedule` is a string on the metadata server, a bool in the Compute API.
    let can_reschedule = match obj.get("can_reschedule") {
        None => false,
        Some(serde_json::Value::Bool(b)) => *b,
        Some(serde_json::Value::String(s)) if s.eq_ignore_ascii_case("true") => true,
        Some(serde_json::Value::String(s)) if s.eq_ignore_ascii_case("false") => false,
        Some(other) => return Err(value("can_reschedule", Some(&other.to_string()))),
    };
    let start = text("window_start_time")
        .ok_or_else(|| ParseError::Upcoming("no window_start_time".into()))?
        .parse::<Timestamp>()
        .map_err(|e| ParseError::Upcoming(format!("window_start_time: {e}")))?;
    Ok(Some(Upcoming {
        window_start: start,
        status,
        can_reschedule,
    }))
}

/// Settings, from the agent's flags.
#[derive(Clone, Debug)]
pub struct Settings {
    pub endpoint: String,
    pub wait_timeout: Duration,
    pub preemption_notice: Duration,
    pub terminate_notice: Duration,
    pub upcoming_interval: Duration,
    pub maintenance_lead: Duration,
}

/// Everything read so far, with when each value was first seen (deadlines anchor there).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct View {
    pub event: Option<(MaintenanceEvent, Timestamp)>,
    pub preempted: Option<(bool, Timestamp)>,
    /// `None` until upcoming-maintenance has said something definite; then `Some(None)`
    /// for "nothing scheduled".
    pub upcoming: Option<Option<Upcoming>>,
    /// The VM's host-maintenance policy, once read (`None`: not read, or unreadable).
    pub on_host_maintenance: Option<OnHostMaintenance>,
}

fn plus(t: Timestamp, d: Duration) -> Option<Timestamp> {
    t.checked_add(SignedDuration::try_from(d).ok()?).ok()
}

/// The notices of a view: unknown until both watched keys have been read once, and, while
/// upcoming-maintenance has said nothing definite, unknown unless another key asks for a
/// drain (a pending window may be behind it: an unreadable answer is never "all clear").
pub fn report(view: &View, s: &Settings, now: Timestamp) -> Report {
    let (Some((event, event_at)), Some((preempted, preempted_at))) = (&view.event, &view.preempted)
    else {
        return Report::Unknown;
    };
    let n = |cause, severity, deadline, cancellable, detail: String| {
        Notice::new(SOURCE, cause, severity, deadline, cancellable, detail)
    };
    let mut out = vec![];
    // Both deadlines are counted from first sight: a restart counts them again, later.
    let estimated = |n: Notice| Notice {
        estimated_deadline: true,
        ..n
    };
    if *preempted {
        out.push(estimated(n(
            Cause::Preemption,
            Severity::Terminate,
            plus(*preempted_at, s.preemption_notice),
            false,
            "instance/preempted=TRUE".into(),
        )));
    }
    match event {
        MaintenanceEvent::None => {}
        MaintenanceEvent::Migrate => out.push(n(
            Cause::Maintenance,
            Severity::Observe,
            None,
            true,
            "MIGRATE_ON_HOST_MAINTENANCE (live migration; the VM survives)".into(),
        )),
        MaintenanceEvent::Terminate => out.push(estimated(n(
            Cause::Maintenance,
            Severity::Terminate,
            plus(*event_at, s.terminate_notice),
            true,
            format!("maintenance-event={}", event.as_str()),
        ))),
    }
    let Some(upcoming) = &view.upcoming else {
        return if out.iter().any(|n| n.severity >= Severity::Drain) {
            Report::Known(out)
        } else {
            Report::Unknown
        };
    };
    if let Some(u) = upcoming {
        let lead = SignedDuration::try_from(s.maintenance_lead).unwrap_or_default();
        let from = u.window_start.checked_sub(lead).unwrap_or(u.window_start);
        // ONGOING ends every process only on a VM that host maintenance stops; one that
        // live-migrates loses nothing. Unread, the policy is not guessed: a Terminate at an
        // ongoing window's start would end every match at once on a VM that may well
        // migrate (GCE's default), and a match ended cannot be given back. The window drains
        // meanwhile (no new match) and the policy is read again within seconds.
        let policy = view.on_host_maintenance;
        let stopped = policy == Some(OnHostMaintenance::Terminate);
        let severity = if u.status == UpcomingStatus::Ongoing && stopped {
            Severity::Terminate
        } else if u.status == UpcomingStatus::Ongoing || now >= from {
            Severity::Drain
        } else {
            Severity::Observe
        };
        let mut notice = n(
            Cause::Maintenance,
            severity,
            Some(u.window_start),
            true,
            format!(
                "upcoming maintenance {} at {}{}",
                u.status.as_str(),
                u.window_start,
                match policy {
                    Some(OnHostMaintenance::Migrate) => " (the VM live-migrates)",
                    Some(OnHostMaintenance::Terminate) => " (the VM is stopped)",
                    None => " (the VM's host-maintenance policy is not read yet)",
                }
            ),
        );
        // Handing the node back is final until the machine returns with a new boot id,
        // which a live migration never brings: only a VM that maintenance stops is handed
        // back early. One that migrates keeps its node, and its drain ends with the window.
        notice.can_start_early = u.can_reschedule && u.status == UpcomingStatus::Pending && stopped;
        out.push(notice);
    }
    Report::Known(out)
}

pub fn start(ctx: SourceContext) -> Option<BoxFuture<'static, ()>> {
    let c = &ctx.config;
    if !c.gce_metadata {
        return None;
    }
    let settings = Settings {
        endpoint: c.gce_metadata_endpoint.clone(),
        wait_timeout: c.gce_wait_timeout,
        preemption_notice: c.gce_preemption_notice,
        terminate_notice: c.gce_terminate_notice,
        upcoming_interval: c.gce_upcoming_interval,
        maintenance_lead: c.maintenance_lead,
    };
    let http = match reqwest::Client::builder()
        // Above timeout_sec, so a hanging GET that times out is answered, not cut.
        .timeout(settings.wait_timeout + Duration::from_secs(10))
        .connect_timeout(Duration::from_secs(2))
        .build()
    {
        Ok(h) => h,
        Err(e) => {
            warn!(message = "GCE metadata client could not be built; source off", error = %e);
            return None;
        }
    };
    let src = Gce {
        http,
        settings,
        view: Arc::default(),
        out: ctx.out,
        metrics: ctx.metrics,
        health: ctx.health,
        degraded: Arc::default(),
    };
    let shutdown = ctx.shutdown;
    Some(
        async move {
            src.health.set(HEALTH, true, "starting");
            tokio::join!(
                src.clone().watch(KEY_EVENT, shutdown.clone()),
                src.clone().watch(KEY_PREEMPTED, shutdown.clone()),
                src.clone().poll_upcoming(shutdown.clone()),
            );
        }
        .boxed(),
    )
}

#[derive(Clone)]
struct Gce {
    http: reqwest::Client,
    settings: Settings,
    view: Arc<Mutex<View>>,
    out: watch::Sender<Report>,
    metrics: Metrics,
    health: Health,
    degraded: Arc<Mutex<bool>>,
}

enum Fetched {
    Value { body: String, etag: Option<String> },
    Status(u16, String),
}

impl Gce {
    fn url(&self, key: &str) -> String {
        format!(
            "{}/computeMetadata/v1/instance/{key}",
            self.settings.endpoint
        )
    }

    async fn fetch(&self, url: &str) -> Result<Fetched, reqwest::Error> {
        let r = self
            .http
            .get(url)
            .header("Metadata-Flavor", "Google")
            .send()
            .await?;
        let status = r.status().as_u16();
        let etag = r
            .headers()
            .get("etag")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let body = r.text().await?;
        if status == 200 {
            Ok(Fetched::Value { body, etag })
        } else {
            Ok(Fetched::Status(status, body))
        }
    }

    fn publish(&self) {
        let view = self.view.lock().map(|v| v.clone()).unwrap_or_default();
        let r = report(&view, &self.settings, Timestamp::now());
        super::publish(&self.out, r);
    }

    fn error(&self, reason: &'static str) {
        self.metrics
            .source_errors
            .get_or_create(&SourceReason {
                source: SOURCE.as_str(),
                reason,
            })
            .inc();
    }

    fn set_up(&self, up: bool, why: &str) {
        self.metrics
            .source_up
            .get_or_create(&SourceLabel {
                source: SOURCE.as_str(),
            })
            .set(i64::from(up));
        let Ok(mut d) = self.degraded.lock() else {
            return;
        };
        if up && *d {
            *d = false;
            info!(message = "GCE metadata server reachable again");
            self.health.set(HEALTH, true, "watching");
        } else if !up && !*d {
            *d = true;
            warn!(message = "GCE metadata server unreachable; GCE signals degraded, other sources go on", error = %why);
            self.health.set(
                HEALTH,
                true,
                format!("degraded: metadata server unreachable ({why}); needs hostNetwork under Workload Identity, not available on Autopilot"),
            );
        } else if up {
            self.health.set(HEALTH, true, "watching");
        }
    }

    fn record(&self, key: &str, body: &str) {
        let now = Timestamp::now();
        let status = {
            let Ok(mut v) = self.view.lock() else { return };
            let read = if key == KEY_EVENT {
                parse_event(body).map(|e| {
                    if v.event.map(|(old, _)| old) != Some(e) {
                        v.event = Some((e, now));
                    }
                    match e {
                        MaintenanceEvent::None => "none",
                        MaintenanceEvent::Migrate => "migrate",
                        MaintenanceEvent::Terminate => "terminate",
                    }
                })
            } else {
                parse_preempted(body).map(|p| {
                    if v.preempted.map(|(old, _)| old) != Some(p) {
                        v.preempted = Some((p, now));
                    }
                    if p { "preempted" } else { "not_preempted" }
                })
            };
            match read {
                Ok(status) => status,
                Err(e) => {
                    drop(v);
                    // Unreadable is unknown: the last reading stands (none yet: the source
                    // stays unknown, which holds a drain it started).
                    self.reject(&e);
                    return;
                }
            }
        };
        self.metrics
            .signals
            .get_or_create(&SourceStatus {
                source: SOURCE.as_str(),
                status,
            })
            .inc();
        self.publish();
    }

    fn reject(&self, e: &ParseError) {
        self.metrics
            .signals_rejected
            .get_or_create(&SourceReason {
                source: SOURCE.as_str(),
                reason: e.metric_label(),
            })
            .inc();
        warn!(message = "rejected GCE metadata value; the last reading stands", error = %e);
    }

    /// One key: a plain read, then hanging GETs that always pass the last ETag.
    async fn watch(self, key: &'static str, shutdown: CancellationToken) {
        let mut etag: Option<String> = None;
        let mut backoff = Backoff::new(RETRY_FIRST, RETRY_MAX);
        loop {
            let url = match &etag {
                None => self.url(key),
                Some(e) => format!(
                    "{}?wait_for_change=true&last_etag={}&timeout_sec={}",
                    self.url(key),
                    url::form_urlencoded::byte_serialize(e.as_bytes()).collect::<String>(),
                    self.settings.wait_timeout.as_secs().max(1)
                ),
            };
            let result = tokio::select! {
                () = shutdown.cancelled() => return,
                r = self.fetch(&url) => r,
            };
            let failure = match result {
                Ok(Fetched::Value { body, etag: new }) => {
                    backoff.reset();
                    self.set_up(true, "");
                    // A timeout answers with the same ETag: nothing changed, nothing to do.
                    if new.is_none() || new != etag || etag.is_none() {
                        self.record(key, &body);
                    }
                    etag = new.or(etag);
                    continue;
                }
                Ok(Fetched::Status(code, body)) => {
                    self.error(if code >= 500 {
                        "server_error"
                    } else {
                        "client_error"
                    });
                    format!(
                        "{key}: HTTP {code}: {}",
                        body.chars().take(120).collect::<String>()
                    )
                }
                Err(e) => {
                    self.error(if e.is_timeout() {
                        "timeout"
                    } else {
                        "unreachable"
                    });
                    if (e.is_connect() || e.is_timeout())
                        && backoff.attempts() + 1 >= UNREACHABLE_AFTER
                    {
                        self.set_up(false, &e.to_string());
                    }
                    format!("{key}: {e}")
                }
            };
            // The view is kept as it is: an error is never "NONE".
            let d = backoff.next_delay();
            warn!(message = "GCE metadata read failed; retrying", error = %failure, retry_in_ms = d.as_millis() as u64);
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(d) => {}
            }
        }
    }

    async fn poll_upcoming(self, shutdown: CancellationToken) {
        let url = format!("{}?alt=json", self.url(KEY_UPCOMING));
        // An unchanged answer is not read again: a steady `{}` is counted once, not per poll.
        let mut last: Option<(u16, String)> = None;
        let mut last_policy: Option<String> = None;
        // A read that got no answer is tried again soon, not a whole interval later: until
        // both are read the source is unknown (a drain it asked for is held, a machine that
        // came back stays fenced) or an ongoing window waits for the VM's policy.
        let mut retry = Backoff::new(RETRY_FIRST, RETRY_MAX.min(self.settings.upcoming_interval));
        loop {
            let answer = match self.fetch(&url).await {
                Ok(Fetched::Value { body, .. }) => Some((200, body)),
                Ok(Fetched::Status(404, body)) => Some((404, body)),
                // Any other answer is unknown, never "cleared": keep the last view.
                Ok(Fetched::Status(code, body)) => {
                    self.error(if code >= 500 {
                        "server_error"
                    } else {
                        "client_error"
                    });
                    warn!(message = "GCE upcoming-maintenance read failed; the last reading stands", status = code, body = %trimmed(&body));
                    None
                }
                Err(e) => {
                    self.error("unreachable");
                    warn!(message = "GCE upcoming-maintenance read failed; the last reading stands", error = %e);
                    None
                }
            };
            // The VM's policy first, so an ONGOING answer is read with it.
            let policy_read = self.read_policy(&mut last_policy).await;
            let answered = answer.is_some();
            if let Some(a) = answer
                && last.as_ref() != Some(&a)
            {
                self.upcoming(a.0, &a.1);
                last = Some(a);
            }
            let wait = if answered && policy_read {
                retry.reset();
                self.settings.upcoming_interval
            } else {
                retry.next_delay()
            };
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// Reads `scheduling/on-host-maintenance`; an error or an unknown value keeps what was
    /// known (counted, logged), and a change is published. `false` when it got no answer.
    async fn read_policy(&self, last: &mut Option<String>) -> bool {
        let body = match self.fetch(&self.url(KEY_ON_HOST_MAINTENANCE)).await {
            Ok(Fetched::Value { body, .. }) => body,
            Ok(Fetched::Status(code, body)) => {
                self.error(if code >= 500 {
                    "server_error"
                } else {
                    "client_error"
                });
                warn!(message = "reading the VM's host-maintenance policy failed; an ongoing window drains without ending a match until it is read", status = code, body = %trimmed(&body));
                return false;
            }
            Err(e) => {
                self.error("unreachable");
                warn!(message = "reading the VM's host-maintenance policy failed; an ongoing window drains without ending a match until it is read", error = %e);
                return false;
            }
        };
        if last.as_deref() == Some(body.as_str()) {
            return true;
        }
        match parse_on_host_maintenance(&body) {
            Ok(p) => {
                if let Ok(mut v) = self.view.lock() {
                    v.on_host_maintenance = Some(p);
                }
                self.publish();
            }
            Err(e) => self.reject(&e),
        }
        *last = Some(body);
        true
    }

    fn upcoming(&self, status: u16, body: &str) {
        match parse_upcoming(status, body) {
            Ok(u) => {
                if let Ok(mut v) = self.view.lock() {
                    v.upcoming = Some(u);
                }
                self.publish();
            }
            Err(e) => self.reject(&e),
        }
    }
}

#[cfg(test)]
mod tests;
