//! GCE metadata: host maintenance and preemption.
//!
//! `instance/maintenance-event` and `instance/preempted` are each watched with their own
//! hanging GET (`wait_for_change` with `last_etag` always passed, `timeout_sec` below the
//! client timeout), after one plain read at start so an event already pending is acted on.
//! `instance/upcoming-maintenance?alt=json` is polled. An error never means `NONE`: the last
//! view is kept, retried with capped backoff. A metadata server that cannot be reached (GKE
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
/// Failed first reads after which the metadata server counts as unreachable.
const UNREACHABLE_AFTER: u32 = 3;

/// What `instance/maintenance-event` says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MaintenanceEvent {
    None,
    /// Live migration: the VM survives. Observed, never drained.
    Migrate,
    /// The VM will be stopped (`TERMINATE_ON_HOST_MAINTENANCE`, or any other value: the
    /// docs show older names, so an unknown value is treated as the worse case).
    Terminate(String),
}

pub fn parse_event(body: &str) -> MaintenanceEvent {
    match body.trim() {
        "NONE" => MaintenanceEvent::None,
        "MIGRATE_ON_HOST_MAINTENANCE" => MaintenanceEvent::Migrate,
        other => MaintenanceEvent::Terminate(other.chars().take(64).collect()),
    }
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("preempted is neither TRUE nor FALSE: {0:?}")]
    Preempted(String),
    #[error("upcoming-maintenance is not a notice: {0}")]
    Upcoming(String),
}

impl ParseError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Preempted(_) => "bad_preempted",
            Self::Upcoming(_) => "bad_upcoming",
        }
    }
}

pub fn parse_preempted(body: &str) -> Result<bool, ParseError> {
    match body.trim() {
        "TRUE" => Ok(true),
        "FALSE" => Ok(false),
        other => Err(ParseError::Preempted(other.chars().take(64).collect())),
    }
}

/// Scheduled host maintenance from `upcoming-maintenance`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Upcoming {
    pub window_start: Timestamp,
    /// `PENDING`, `ONGOING`, …
    pub status: String,
    /// The maintenance may be started early (GKE hand-back).
    pub can_reschedule: bool,
}

/// `Ok(None)`: nothing known to be scheduled (404, `NONE`, `{}`, an error body); only a 200
/// with a parseable notice is a notice. Anything else is rejected, never acted on.
pub fn parse_upcoming(status: u16, body: &str) -> Result<Option<Upcoming>, ParseError> {
    if status == 404 {
        return Ok(None);
    }
    let t = body.trim();
    if t.is_empty() || t == "NONE" {
        return Ok(None);
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
    if obj.is_empty() || obj.contains_key("error") {
        return Ok(None);
    }
    let text = |k: &str| obj.get(k).and_then(|x| x.as_str());
    let start = text("window_start_time")
        .ok_or_else(|| ParseError::Upcoming("no window_start_time".into()))?
        .parse::<Timestamp>()
        .map_err(|e| ParseError::Upcoming(format!("window_start_time: {e}")))?;
    let status = text("maintenance_status").unwrap_or("UNKNOWN").to_string();
    if status == "COMPLETE" {
        return Ok(None);
    }
    // `can_reschedule` is a string on the metadata server, a bool in the Compute API.
    let can_reschedule = match obj.get("can_reschedule") {
        Some(serde_json::Value::String(s)) => s.eq_ignore_ascii_case("true"),
        Some(serde_json::Value::Bool(b)) => *b,
        _ => false,
    };
    Ok(Some(Upcoming {
        window_start: start,
        status: status.chars().take(32).collect(),
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
    pub upcoming: Option<Upcoming>,
}

fn plus(t: Timestamp, d: Duration) -> Option<Timestamp> {
    t.checked_add(SignedDuration::try_from(d).ok()?).ok()
}

/// The notices of a view: unknown until both watched keys have been read once.
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
        MaintenanceEvent::Terminate(v) => out.push(estimated(n(
            Cause::Maintenance,
            Severity::Terminate,
            plus(*event_at, s.terminate_notice),
            true,
            format!("maintenance-event={v}"),
        ))),
    }
    if let Some(u) = &view.upcoming {
        let lead = SignedDuration::try_from(s.maintenance_lead).unwrap_or_default();
        let from = u.window_start.checked_sub(lead).unwrap_or(u.window_start);
        let severity = if u.status == "ONGOING" {
            Severity::Terminate
        } else if now >= from {
            Severity::Drain
        } else {
            Severity::Observe
        };
        let mut notice = n(
            Cause::Maintenance,
            severity,
            Some(u.window_start),
            true,
            format!("upcoming maintenance {} at {}", u.status, u.window_start),
        );
        notice.can_start_early = u.can_reschedule && u.status == "PENDING";
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
            match key {
                KEY_EVENT => {
                    let e = parse_event(body);
                    let label = match &e {
                        MaintenanceEvent::None => "none",
                        MaintenanceEvent::Migrate => "migrate",
                        MaintenanceEvent::Terminate(_) => "terminate",
                    };
                    if v.event.as_ref().map(|(old, _)| old) != Some(&e) {
                        v.event = Some((e, now));
                    }
                    label
                }
                _ => match parse_preempted(body) {
                    Ok(p) => {
                        if v.preempted.map(|(old, _)| old) != Some(p) {
                            v.preempted = Some((p, now));
                        }
                        if p { "preempted" } else { "not_preempted" }
                    }
                    Err(e) => {
                        drop(v);
                        self.reject(&e);
                        return;
                    }
                },
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
        warn!(message = "rejected GCE metadata value", error = %e);
    }

    /// One key: a plain read, then hanging GETs that always pass the last ETag.
    async fn watch(self, key: &'static str, shutdown: CancellationToken) {
        let mut etag: Option<String> = None;
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
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
        loop {
            match self.fetch(&url).await {
                Ok(Fetched::Value { body, .. }) => self.upcoming(200, &body),
                Ok(Fetched::Status(404, body)) => self.upcoming(404, &body),
                // Any other answer is unknown, never "cleared": keep the last view.
                Ok(Fetched::Status(code, _)) => self.error(if code >= 500 {
                    "server_error"
                } else {
                    "client_error"
                }),
                Err(_) => self.error("unreachable"),
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(self.settings.upcoming_interval) => {}
            }
        }
    }

    fn upcoming(&self, status: u16, body: &str) {
        match parse_upcoming(status, body) {
            Ok(u) => {
                if let Ok(mut v) = self.view.lock() {
                    v.upcoming = u;
                }
                self.publish();
            }
            Err(e) => self.reject(&e),
        }
    }
}

#[cfg(test)]
mod tests;
