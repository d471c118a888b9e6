//! Azure Scheduled Events (instance metadata): freezes, reboots, redeploys, Spot evictions
//! and scale-set terminations of this VM. The signal on AKS and other Azure VMs.
//!
//! `GET /metadata/scheduledevents?api-version=2020-07-01` with `Metadata: true`, every
//! `--azure-events-interval` (the endpoint never leaves the node). The document lists events
//! for every VM of the availability set or scale set; only those naming this VM in
//! `Resources` count (its name from `--azure-vm-name` or `compute/name`). Each `EventType`
//! maps to what happens to a running process at `NotBefore`:
//!
//! | EventType | a running process | notice |
//! |---|---|---|
//! | `Freeze` | paused for `DurationInSeconds`, survives | Observe; Drain when longer than [`FREEZE_DRAIN_AFTER`] (never ends a match) |
//! | `Reboot` | ends; the VM returns | Terminate at `NotBefore`, maintenance |
//! | `Redeploy` | ends; the VM moves host, local disk lost | Terminate at `NotBefore`, maintenance |
//! | `Preempt` | ends; Spot eviction | Terminate at `NotBefore`, preemption, not cancellable |
//! | `Terminate` | ends; scale-in with terminate notification | Terminate at `NotBefore`, scale_down |
//!
//! A scheduled event's deadline is its `NotBefore` as the platform states it now: a Reboot,
//! Redeploy or `Preempt` postponed is later (`Notice::restated`), as for every other source (the deadline rule decides what
//! that moves; see `deadline`). `NotBefore` is empty once an event has `Started`: its
//! deadline is then when it was first seen `Started` (or the `NotBefore` it had, if earlier), an estimate
//! the deadline rule never lets a restart move later. An event that vanishes from the document was
//! completed or cancelled: its notice goes (a Spot eviction's stays: it cannot be withdrawn).
//! An unreachable endpoint, an error status or a document that does not parse is "unknown",
//! never "clear": the last view is kept (none yet: the source stays unknown, so a drain it
//! started is held). An event type or status this version does not know is rejected and
//! counted, never a drain.
//!
//! With `--azure-approve-when-empty`, once the node is empty, each pending event of this VM
//! that asked for the drain is approved (`POST {"StartRequests": [{"EventId": …}]}`) once,
//! so the platform may start it now.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use jiff::Timestamp;
use lastcall_common::backoff::Backoff;
use tracing::{debug, info, warn};

use super::{Report, SourceContext};
use crate::metrics::{ActionResult, Metrics, SourceLabel, SourceReason, SourceStatus};
use crate::notice::{Cause, Notice, Severity, Source};

pub const SOURCE: Source = Source("azure_events");
/// The Scheduled Events API version this source speaks.
pub const API_VERSION: &str = "2020-07-01";
const NAME_API_VERSION: &str = "2021-02-01";
/// A freeze longer than this keeps new matches off the node; a shorter one (live migration
/// pauses for seconds) is only observed. Neither ends a match: every process survives.
pub const FREEZE_DRAIN_AFTER: Duration = Duration::from_secs(60);
/// `lastcall_actions_total{action}` of an approval.
pub const APPROVE_ACTION: &str = "azure_approve_event";

/// What happens to this VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventType {
    Freeze,
    Reboot,
    Redeploy,
    Preempt,
    Terminate,
}

impl EventType {
    pub const ALL: [EventType; 5] = [
        Self::Freeze,
        Self::Reboot,
        Self::Redeploy,
        Self::Preempt,
        Self::Terminate,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Freeze => "Freeze",
            Self::Reboot => "Reboot",
            Self::Redeploy => "Redeploy",
            Self::Preempt => "Preempt",
            Self::Terminate => "Terminate",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.as_str() == s)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventStatus {
    Scheduled,
    Started,
}

/// One event of the document, as read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    pub id: String,
    pub kind: EventType,
    pub status: EventStatus,
    /// `None` once `Started` (the platform empties it).
    pub not_before: Option<Timestamp>,
    pub resources: Vec<String>,
    /// `DurationInSeconds`; `None` when absent or not positive (unknown).
    pub duration: Option<Duration>,
}

impl Event {
    /// Whether the event names this VM.
    pub fn is_for(&self, vm: &str) -> bool {
        self.resources.iter().any(|r| r.eq_ignore_ascii_case(vm))
    }
}

/// One entry of `Events`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    Event(Event),
    /// Not readable by this version: never a drain, and its last reading (if any) stands.
    Unknown {
        id: String,
        error: ParseError,
    },
}

/// A Scheduled Events document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Document {
    pub incarnation: u64,
    pub entries: Vec<Entry>,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("not JSON: {0}")]
    Json(String),
    #[error("not a Scheduled Events document: {0}")]
    Shape(String),
    #[error("event {id}: EventType {value:?} is not one this version knows")]
    UnknownType { id: String, value: String },
    #[error("event {id}: EventStatus {value:?} is not Scheduled or Started")]
    UnknownStatus { id: String, value: String },
    #[error("event {id}: {why}")]
    Invalid { id: String, why: String },
}

impl ParseError {
    /// Bounded label for `lastcall_signals_rejected_total{reason}`.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Json(_) => "invalid_json",
            Self::Shape(_) => "not_object",
            Self::UnknownType { .. } => "unknown_type",
            Self::UnknownStatus { .. } => "unknown_status",
            Self::Invalid { .. } => "invalid",
        }
    }
}

fn trimmed(s: &str) -> String {
    s.chars().take(64).collect()
}

/// `NotBefore`: RFC 1123 (`Mon, 19 Sep 2016 18:29:47 GMT`); empty once the event started.
pub fn parse_not_before(s: &str) -> Result<Option<Timestamp>, String> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(None);
    }
    jiff::fmt::strtime::parse("%a, %d %b %Y %H:%M:%S GMT", s)
        .and_then(|t| t.to_datetime())
        .and_then(|dt| dt.to_zoned(jiff::tz::TimeZone::UTC))
        .map(|z| Some(z.timestamp()))
        .map_err(|e| format!("NotBefore {:?}: {e}", trimmed(s)))
}

/// `{"DocumentIncarnation": N, "Events": [...]}`. The document must have that shape; each
/// event is read on its own.
pub fn parse_document(body: &str) -> Result<Document, ParseError> {
    let v: serde_json::Value =
        serde_json::from_str(body).map_err(|e| ParseError::Json(trimmed(&e.to_string())))?;
    let incarnation = v
        .get("DocumentIncarnation")
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| ParseError::Shape("no DocumentIncarnation".into()))?;
    let events = v
        .get("Events")
        .and_then(serde_json::Value::as_array)
        .ok_or_else(|| ParseError::Shape("no Events array".into()))?;
    Ok(Document {
        incarnation,
        entries: events.iter().map(entry).collect(),
    })
}

fn entry(e: &serde_json::Value) -> Entry {
    let text = |k: &str| e.get(k).and_then(serde_json::Value::as_str);
    let id = text("EventId").map(trimmed).unwrap_or_default();
    let invalid = |why: String| Entry::Unknown {
        id: id.clone(),
        error: ParseError::Invalid {
            id: id.clone(),
            why,
        },
    };
    if id.is_empty() {
        return invalid("no EventId".into());
    }
    let raw_type = text("EventType").unwrap_or("");
    let Some(kind) = EventType::parse(raw_type) else {
        return Entry::Unknown {
            id: id.clone(),
            error: ParseError::UnknownType {
                id,
                value: trimmed(raw_type),
            },
        };
    };
    let status = match text("EventStatus") {
        Some("Scheduled") => EventStatus::Scheduled,
        Some("Started") => EventStatus::Started,
        other => {
            return Entry::Unknown {
                id: id.clone(),
                error: ParseError::UnknownStatus {
                    id,
                    value: other.map_or_else(|| "<missing>".into(), trimmed),
                },
            };
        }
    };
    let not_before = match parse_not_before(text("NotBefore").unwrap_or("")) {
        Ok(t) => t,
        Err(why) => return invalid(why),
    };
    if not_before.is_none() && status == EventStatus::Scheduled {
        return invalid("Scheduled without NotBefore".into());
    }
    let Some(resources) = e.get("Resources").and_then(serde_json::Value::as_array) else {
        return invalid("no Resources".into());
    };
    let duration = e
        .get("DurationInSeconds")
        .and_then(serde_json::Value::as_i64)
        .filter(|d| *d > 0)
        .map(|d| Duration::from_secs(d.unsigned_abs()));
    Entry::Event(Event {
        id,
        kind,
        status,
        not_before,
        resources: resources
            .iter()
            .filter_map(|r| r.as_str().map(str::to_string))
            .collect(),
        duration,
    })
}

/// One event of this VM, with the deadline it was first given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tracked {
    pub event: Event,
    /// `NotBefore` as stated now; once `Started`, when it was first seen `Started` (or the
    /// `NotBefore` it had, if earlier).
    pub deadline: Timestamp,
}

/// This VM's events as last read; `None` until a document has been read.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct View {
    pub incarnation: Option<u64>,
    pub events: BTreeMap<String, Tracked>,
}

/// Folds a document into the view and returns what it rejected.
pub fn apply(view: &mut View, doc: Document, vm: &str, now: Timestamp) -> Vec<ParseError> {
    let mut rejected = vec![];
    let mut next = BTreeMap::new();
    for entry in doc.entries {
        match entry {
            Entry::Event(e) if e.is_for(vm) => {
                // The platform's own time stands as stated, later or earlier. A started
                // event is under way: due when first seen started (or at the time it had,
                // if earlier), and it stays there.
                let deadline = match (e.not_before, view.events.get(&e.id)) {
                    (Some(stated), _) => stated,
                    (None, Some(t)) if t.event.status == EventStatus::Started => t.deadline,
                    (None, Some(t)) => t.deadline.min(now),
                    (None, None) => now,
                };
                next.insert(e.id.clone(), Tracked { event: e, deadline });
            }
            Entry::Event(e) => debug!(message = "Azure event for another VM", event_id = %e.id),
            Entry::Unknown { id, error } => {
                if let Some(t) = view.events.get(&id) {
                    next.insert(id, t.clone());
                }
                rejected.push(error);
            }
        }
    }
    // A vanished event was completed or cancelled; a Spot eviction cannot be withdrawn.
    for (id, t) in &view.events {
        if t.event.kind == EventType::Preempt && !next.contains_key(id) {
            next.insert(id.clone(), t.clone());
        }
    }
    view.events = next;
    view.incarnation = Some(doc.incarnation);
    rejected
}

/// The notice of one event of this VM.
pub fn notice(t: &Tracked) -> Notice {
    let e = &t.event;
    let (cause, severity, cancellable) = match e.kind {
        EventType::Freeze => {
            let long = e.duration.is_some_and(|d| d > FREEZE_DRAIN_AFTER);
            let severity = if long {
                Severity::Drain
            } else {
                Severity::Observe
            };
            (Cause::Maintenance, severity, true)
        }
        EventType::Reboot | EventType::Redeploy => (Cause::Maintenance, Severity::Terminate, true),
        EventType::Preempt => (Cause::Preemption, Severity::Terminate, false),
        EventType::Terminate => (Cause::ScaleDown, Severity::Terminate, true),
    };
    let status = match e.status {
        EventStatus::Scheduled => "scheduled",
        EventStatus::Started => "started",
    };
    let duration = e
        .duration
        .map(|d| format!(", {} s", d.as_secs()))
        .unwrap_or_default();
    Notice {
        id: format!("{}:{}", SOURCE.as_str(), e.id),
        // Once started, the deadline is counted from when lastcall saw it: a restart would
        // count it again, later, so the recorded one stands.
        estimated_deadline: e.not_before.is_none(),
        // The platform may postpone any scheduled event, a Spot eviction included: its
        // `NotBefore` as stated now is the deadline.
        restated: true,
        ..Notice::new(
            SOURCE,
            cause,
            severity,
            Some(t.deadline),
            cancellable,
            format!(
                "Azure {} {} ({status}{duration}) not before {}",
                e.kind.as_str(),
                e.id,
                t.deadline
            ),
        )
    }
}

/// Unknown until a document has been read.
pub fn report(view: &View) -> Report {
    if view.incarnation.is_none() {
        return Report::Unknown;
    }
    Report::Known(view.events.values().map(notice).collect())
}

/// Events to approve now: this VM's scheduled ones that ask for a drain, not yet approved.
pub fn to_approve(view: &View, approved: &BTreeSet<String>) -> Vec<String> {
    view.events
        .values()
        .filter(|t| t.event.status == EventStatus::Scheduled)
        .filter(|t| notice(t).severity >= Severity::Drain)
        .filter(|t| !approved.contains(&t.event.id))
        .map(|t| t.event.id.clone())
        .collect()
}

pub fn start(ctx: SourceContext) -> Option<BoxFuture<'static, ()>> {
    let c = &ctx.config;
    if !c.azure_events {
        return None;
    }
    let http = match reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .connect_timeout(Duration::from_secs(1))
        .build()
    {
        Ok(h) => h,
        Err(e) => {
            warn!(message = "Azure metadata client could not be built; source off", error = %e);
            return None;
        }
    };
    let azure = Azure {
        http,
        endpoint: c.azure_metadata_endpoint.clone(),
        metrics: ctx.metrics,
        dry_run: c.dry_run,
    };
    let (vm_flag, interval, approve) = (
        c.azure_vm_name.clone(),
        c.azure_events_interval,
        c.azure_approve_when_empty,
    );
    let (out, shutdown, empty, acting) = (ctx.out, ctx.shutdown, ctx.node_empty, ctx.acting);
    Some(
        async move {
            let vm = match vm_flag {
                Some(vm) => vm,
                None => tokio::select! {
                    () = shutdown.cancelled() => return,
                    vm = azure.vm_name() => vm,
                },
            };
            info!(message = "watching Azure Scheduled Events", vm = %vm);
            let mut view = View::default();
            let mut last_body: Option<String> = None;
            let mut approved = BTreeSet::new();
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    _ = tick.tick() => {}
                }
                match azure.get(&azure.events_url()).await {
                    Ok(body) => {
                        azure.set_up(true);
                        // An unchanged document is not read again: a bad one is counted once.
                        if last_body.as_ref() != Some(&body) {
                            azure.read(&mut view, &body, &vm);
                            last_body = Some(body);
                        }
                    }
                    Err(reason) => {
                        azure.set_up(false);
                        azure.count_error(reason);
                    }
                }
                let r = report(&view);
                let counted: Vec<&'static str> = match &r {
                    Report::Known(n) => n.iter().map(|n| n.cause.as_str()).collect(),
                    Report::Unknown => vec![],
                };
                if super::publish(&out, r) {
                    for status in counted {
                        azure
                            .metrics
                            .signals
                            .get_or_create(&SourceStatus {
                                source: SOURCE.as_str(),
                                status,
                            })
                            .inc();
                    }
                }
                // A standby agent approves nothing: the acting one does.
                if approve && *empty.borrow() && acting.now() {
                    for id in to_approve(&view, &approved) {
                        if azure.approve(&id).await {
                            approved.insert(id);
                        }
                    }
                }
            }
        }
        .boxed(),
    )
}

struct Azure {
    http: reqwest::Client,
    endpoint: String,
    metrics: Metrics,
    dry_run: bool,
}

impl Azure {
    fn events_url(&self) -> String {
        format!(
            "{}/metadata/scheduledevents?api-version={API_VERSION}",
            self.endpoint
        )
    }

    /// A 200 body, or a bounded error reason.
    async fn get(&self, url: &str) -> Result<String, &'static str> {
        let r = self
            .http
            .get(url)
            .header("Metadata", "true")
            .send()
            .await
            .map_err(|e| {
                if e.is_timeout() {
                    "timeout"
                } else {
                    "unreachable"
                }
            })?;
        let status = r.status();
        let body = r.text().await.map_err(|_| "unreachable")?;
        match status.as_u16() {
            200 => Ok(body),
            s if s >= 500 => Err("server_error"),
            _ => Err("client_error"),
        }
    }

    /// This VM's name from `compute/name`, retried with capped backoff until known.
    async fn vm_name(&self) -> String {
        let url = format!(
            "{}/metadata/instance/compute/name?api-version={NAME_API_VERSION}&format=text",
            self.endpoint
        );
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
        loop {
            match self.get(&url).await {
                Ok(name) if !name.trim().is_empty() => return name.trim().to_string(),
                Ok(_) => self.count_error("unexpected"),
                Err(reason) => {
                    self.set_up(false);
                    self.count_error(reason);
                }
            }
            let d = backoff.next_delay();
            warn!(
                message = "Azure VM name not known yet; retrying (or set --azure-vm-name)",
                retry_in_ms = d.as_millis() as u64
            );
            tokio::time::sleep(d).await;
        }
    }

    fn read(&self, view: &mut View, body: &str, vm: &str) {
        let rejected = match parse_document(body) {
            Ok(doc) => {
                if view.incarnation != Some(doc.incarnation) {
                    debug!(
                        message = "Azure Scheduled Events document",
                        incarnation = doc.incarnation
                    );
                }
                apply(view, doc, vm, Timestamp::now())
            }
            Err(e) => vec![e],
        };
        for e in rejected {
            self.metrics
                .signals_rejected
                .get_or_create(&SourceReason {
                    source: SOURCE.as_str(),
                    reason: e.metric_label(),
                })
                .inc();
            warn!(message = "rejected Azure Scheduled Events entry; the last view stands", error = %e);
        }
    }

    /// Approves one event; `true` once it is done (or counted in a dry run).
    async fn approve(&self, id: &str) -> bool {
        let count = |result: &'static str| {
            self.metrics
                .actions
                .get_or_create(&ActionResult {
                    action: APPROVE_ACTION,
                    result,
                })
                .inc();
        };
        if self.dry_run {
            info!(message = "dry run: would approve Azure event", event_id = %id);
            count("dry_run");
            return true;
        }
        let body = serde_json::json!({ "StartRequests": [ { "EventId": id } ] });
        let sent = self
            .http
            .post(format!(
                "{}/metadata/scheduledevents?api-version={API_VERSION}",
                self.endpoint
            ))
            .header("Metadata", "true")
            .json(&body)
            .send()
            .await;
        match sent {
            Ok(r) if r.status().is_success() => {
                info!(message = "node empty: approved Azure event to start now", event_id = %id);
                count("ok");
                true
            }
            Ok(r) => {
                let status = r.status().as_u16();
                warn!(message = "Azure event approval refused; retrying", event_id = %id, status);
                count("error");
                false
            }
            Err(e) => {
                warn!(message = "Azure event approval failed; retrying", event_id = %id, error = %e);
                count("error");
                false
            }
        }
    }

    fn count_error(&self, reason: &'static str) {
        self.metrics
            .source_errors
            .get_or_create(&SourceReason {
                source: SOURCE.as_str(),
                reason,
            })
            .inc();
    }

    fn set_up(&self, up: bool) {
        self.metrics
            .source_up
            .get_or_create(&SourceLabel {
                source: SOURCE.as_str(),
            })
            .set(i64::from(up));
    }
}

#[cfg(test)]
mod tests;
