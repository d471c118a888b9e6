//! AWS instance metadata (IMDSv2): Spot interruptions, rebalance recommendations, scheduled
//! events and the Auto Scaling target lifecycle state. This is the signal on EKS Auto Mode
//! and Karpenter-less EC2 fleets, where there is no FleetIQ.
//!
//! It uses `aws-config`'s IMDS client, which fetches and refreshes the session token (and
//! retries once on 401); there is no IMDSv1 fallback. Polled every `--aws-imds-interval`:
//! the endpoint never leaves the node. 404 means "no notice"; any other failure keeps the last
//! view (never "all clear"), is counted, and is retried on the next poll.
//!
//! Scheduled events are classified by what happens to a running process at `NotBefore`:
//! `instance-stop`, `instance-retirement` and the `*-reboot` codes end every process
//! (Terminate), `system-maintenance` ends none (Drain near the window, never ending a
//! match). Completed and canceled events are not signals; a code or state this version
//! does not know is rejected and counted, and never drains or clears anything.

use std::time::Duration;

use aws_config::imds::client::Client;
use aws_config::imds::client::error::ImdsError;
use futures::FutureExt;
use futures::future::BoxFuture;
use jiff::{SignedDuration, Timestamp};
use tracing::warn;

use super::{Report, SourceContext};
use crate::metrics::{SourceLabel, SourceReason, SourceStatus};
use crate::notice::{Cause, Notice, Severity, Source};

pub const SOURCE: Source = Source("aws_imds");

const SPOT: &str = "/latest/meta-data/spot/instance-action";
const REBALANCE: &str = "/latest/meta-data/events/recommendations/rebalance";
const SCHEDULED: &str = "/latest/meta-data/events/maintenance/scheduled";
const LIFECYCLE: &str = "/latest/meta-data/autoscaling/target-lifecycle-state";

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {why}")]
pub struct ParseError {
    pub key: &'static str,
    /// Bounded label for `lastcall_signals_rejected_total{reason}`.
    pub reason: &'static str,
    pub why: String,
}

fn bad(key: &'static str, why: impl Into<String>) -> ParseError {
    ParseError {
        key,
        reason: "invalid",
        why: why.into(),
    }
}

fn json(key: &'static str, body: &str) -> Result<serde_json::Value, ParseError> {
    serde_json::from_str(body).map_err(|e| bad(key, e.to_string()))
}

fn trimmed(s: &str) -> String {
    s.chars().take(64).collect()
}

/// `spot/instance-action`: `{"action": "terminate"|"stop"|"hibernate", "time": RFC 3339}`.
pub fn parse_spot(body: &str) -> Result<Timestamp, ParseError> {
    let v = json("spot", body)?;
    match v.get("action").and_then(|a| a.as_str()) {
        Some("terminate" | "stop" | "hibernate") => {}
        other => return Err(bad("spot", format!("unknown action {other:?}"))),
    }
    v.get("time")
        .and_then(|t| t.as_str())
        .ok_or_else(|| bad("spot", "no time"))?
        .parse()
        .map_err(|e| bad("spot", format!("time: {e}")))
}

/// `events/recommendations/rebalance`: `{"noticeTime": RFC 3339}`.
pub fn parse_rebalance(body: &str) -> Result<Timestamp, ParseError> {
    json("rebalance", body)?
        .get("noticeTime")
        .and_then(|t| t.as_str())
        .ok_or_else(|| bad("rebalance", "no noticeTime"))?
        .parse()
        .map_err(|e| bad("rebalance", format!("noticeTime: {e}")))
}

/// A scheduled event's code, classified by what it does to a running process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    /// The instance is stopped (started again on another host): every process ends.
    InstanceStop,
    /// The instance is stopped or terminated for good.
    InstanceRetirement,
    /// The instance is rebooted: every process ends, the node returns.
    InstanceReboot,
    /// The host is rebooted, and the instance with it.
    SystemReboot,
    /// Network or power maintenance: the instance is briefly affected, nothing is stopped.
    SystemMaintenance,
}

impl Code {
    pub const ALL: [Code; 5] = [
        Self::InstanceStop,
        Self::InstanceRetirement,
        Self::InstanceReboot,
        Self::SystemReboot,
        Self::SystemMaintenance,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::InstanceStop => "instance-stop",
            Self::InstanceRetirement => "instance-retirement",
            Self::InstanceReboot => "instance-reboot",
            Self::SystemReboot => "system-reboot",
            Self::SystemMaintenance => "system-maintenance",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.as_str() == s)
    }

    /// Whether every process on the node ends at `NotBefore` (a stop, a retirement or a
    /// reboot); otherwise the node stays up and matches go on.
    pub fn ends_processes(self) -> bool {
        !matches!(self, Self::SystemMaintenance)
    }
}

/// One scheduled event that is still active.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scheduled {
    /// `EventId` (or `Code@NotBefore` when IMDS gives none).
    pub id: String,
    pub code: Code,
    pub not_before: Timestamp,
}

/// One entry of `events/maintenance/scheduled`, as read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    Active(Scheduled),
    /// `completed` or `canceled` (or described `[Completed]`/`[Canceled]`): not a signal.
    Finished {
        id: String,
    },
    /// A code or state this version does not know, or a field that does not parse. Never
    /// a drain; its last known reading (if any) stands, so it never clears one either.
    Unknown {
        id: String,
        error: ParseError,
    },
}

/// `events/maintenance/scheduled`: a JSON array of `{Code, Description, EventId, NotAfter,
/// NotBefore, State}`; times are like `21 Jan 2019 09:00:43 GMT`. A body that is not an
/// array is an error; each event is classified on its own.
pub fn parse_scheduled(body: &str) -> Result<Vec<Entry>, ParseError> {
    let v = json("scheduled", body)?;
    let Some(events) = v.as_array() else {
        return Err(bad("scheduled", "not an array"));
    };
    Ok(events.iter().map(entry).collect())
}

fn entry(e: &serde_json::Value) -> Entry {
    let text = |k: &str| e.get(k).and_then(|x| x.as_str());
    let code = text("Code").unwrap_or("");
    let nb = text("NotBefore").unwrap_or("");
    let id = text("EventId").map_or_else(|| trimmed(&format!("{code}@{nb}")), trimmed);
    let unknown = |reason: &'static str, why: String| Entry::Unknown {
        id: id.clone(),
        error: ParseError {
            key: "scheduled",
            reason,
            why: format!("event {id}: {why}"),
        },
    };
    let described = text("Description").unwrap_or("");
    if described.starts_with("[Completed]") || described.starts_with("[Canceled]") {
        return Entry::Finished { id };
    }
    match text("State") {
        Some("active") => {}
        Some("completed" | "canceled") => return Entry::Finished { id },
        other => {
            return unknown(
                "unknown_state",
                format!("unknown State {:?}", other.map(trimmed)),
            );
        }
    }
    let Some(code) = Code::parse(code) else {
        return unknown("unknown_code", format!("unknown Code {:?}", trimmed(code)));
    };
    match parse_aws_time(nb) {
        Ok(not_before) => Entry::Active(Scheduled {
            id,
            code,
            not_before,
        }),
        Err(e) => unknown("invalid", format!("NotBefore {:?}: {e}", trimmed(nb))),
    }
}

fn parse_aws_time(s: &str) -> Result<Timestamp, jiff::Error> {
    jiff::fmt::strtime::parse("%d %b %Y %H:%M:%S GMT", s)
        .and_then(|t| t.to_datetime())
        .and_then(|dt| dt.to_zoned(jiff::tz::TimeZone::UTC))
        .map(|z| z.timestamp())
}

/// What was read, with the time each notice was first seen.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct View {
    pub spot: Option<Option<Timestamp>>,
    pub rebalance: Option<Option<Timestamp>>,
    pub scheduled: Option<Vec<Scheduled>>,
    /// `Some(true)` once the Auto Scaling group says `Terminated`.
    pub terminating: Option<bool>,
}

/// Settings, from the agent's flags.
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    pub rebalance_ttl: Duration,
    /// How long before `NotBefore` a maintenance that stops nothing starts draining.
    pub maintenance_lead: Duration,
}

/// The notice of one active scheduled event, classified by what happens to a running
/// process at `NotBefore`: a stop, a retirement or a reboot ends every process on the node
/// (Terminate); system maintenance ends none (Drain from `NotBefore − lead`, Observe
/// before), so it never ends a match.
pub fn scheduled_notice(e: &Scheduled, maintenance_lead: Duration, now: Timestamp) -> Notice {
    let severity = if e.code.ends_processes() {
        Severity::Terminate
    } else {
        let lead = SignedDuration::try_from(maintenance_lead).unwrap_or_default();
        let from = e.not_before.checked_sub(lead).unwrap_or(e.not_before);
        if now >= from {
            Severity::Drain
        } else {
            Severity::Observe
        }
    };
    Notice {
        id: format!("{}:{}", SOURCE.as_str(), e.id),
        ..Notice::new(
            SOURCE,
            Cause::Maintenance,
            severity,
            Some(e.not_before),
            true,
            format!(
                "scheduled event {} ({}) not before {}",
                e.code.as_str(),
                e.id,
                e.not_before
            ),
        )
    }
}

/// The notices of a view: unknown until every key has been read once.
pub fn report(view: &View, s: &Settings, now: Timestamp) -> Report {
    let (Some(spot), Some(rebalance), Some(scheduled), Some(terminating)) = (
        &view.spot,
        &view.rebalance,
        &view.scheduled,
        view.terminating,
    ) else {
        return Report::Unknown;
    };
    let n = |cause, severity, deadline, cancellable, detail: String| {
        Notice::new(SOURCE, cause, severity, deadline, cancellable, detail)
    };
    let mut out = vec![];
    if let Some(t) = spot {
        out.push(n(
            Cause::Preemption,
            Severity::Terminate,
            Some(*t),
            false,
            "Spot instance-action".into(),
        ));
    }
    if let Some(t) = rebalance {
        // A recommendation that never escalates must not keep the node cordoned forever.
        let ttl = SignedDuration::try_from(s.rebalance_ttl).unwrap_or_default();
        if t.checked_add(ttl).is_ok_and(|end| now < end) {
            out.push(n(
                Cause::Rebalance,
                Severity::Drain,
                None,
                true,
                format!("rebalance recommendation at {t}"),
            ));
        }
    }
    out.extend(
        scheduled
            .iter()
            .map(|e| scheduled_notice(e, s.maintenance_lead, now)),
    );
    if terminating {
        out.push(n(
            Cause::ScaleDown,
            Severity::Terminate,
            None,
            false,
            "Auto Scaling target lifecycle state Terminated".into(),
        ));
    }
    Report::Known(out)
}

pub fn start(ctx: SourceContext) -> Option<BoxFuture<'static, ()>> {
    let c = &ctx.config;
    if !c.aws_imds {
        return None;
    }
    let endpoint = c.imds_endpoint.clone();
    let build = move || {
        Client::builder().endpoint(&endpoint).map(|b| {
            b.connect_timeout(Duration::from_secs(1))
                .read_timeout(Duration::from_secs(1))
                .max_attempts(2)
                .build()
        })
    };
    let mut client = match build() {
        Ok(c) => c,
        Err(e) => {
            warn!(message = "bad --imds-endpoint; AWS IMDS source off", error = %e);
            return None;
        }
    };
    let interval = c.aws_imds_interval;
    let settings = Settings {
        rebalance_ttl: c.rebalance_ttl,
        maintenance_lead: c.maintenance_lead,
    };
    let (out, metrics, shutdown) = (ctx.out, ctx.metrics, ctx.shutdown);
    Some(
        async move {
            let mut view = View::default();
            // The last body of each key: an unchanged answer is not read again, so a bad
            // one is rejected (counted and logged) once, not on every poll.
            let mut last: std::collections::HashMap<&str, Option<String>> = Default::default();
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let mut ok = true;
                for key in [SPOT, REBALANCE, SCHEDULED, LIFECYCLE] {
                    let mut answer = read(&client, key).await;
                    if answer == Err(TOKEN_REJECTED) {
                        // The client keeps its token until the TTL it asked for; IMDS may
                        // drop it sooner. A new client fetches a new token: retry once.
                        if let Ok(fresh) = build() {
                            client = fresh;
                        }
                        answer = read(&client, key).await;
                    }
                    match answer {
                        Ok(body) => {
                            if last.get(key) == Some(&body) {
                                continue;
                            }
                            for e in apply(&mut view, key, body.as_deref(), Timestamp::now()) {
                                metrics
                                    .signals_rejected
                                    .get_or_create(&SourceReason {
                                        source: SOURCE.as_str(),
                                        reason: e.reason,
                                    })
                                    .inc();
                                warn!(message = "rejected IMDS notice; its last reading stands", error = %e);
                            }
                            last.insert(key, body);
                        }
                        Err(reason) => {
                            ok = false;
                            metrics
                                .source_errors
                                .get_or_create(&SourceReason {
                                    source: SOURCE.as_str(),
                                    reason,
                                })
                                .inc();
                        }
                    }
                }
                metrics
                    .source_up
                    .get_or_create(&SourceLabel {
                        source: SOURCE.as_str(),
                    })
                    .set(i64::from(ok));
                let r = report(&view, &settings, Timestamp::now());
                let counted: Vec<&'static str> = match &r {
                    Report::Known(n) => n.iter().map(|n| n.cause.as_str()).collect(),
                    Report::Unknown => vec![],
                };
                if super::publish(&out, r) {
                    for status in counted {
                        metrics
                            .signals
                            .get_or_create(&SourceStatus {
                                source: SOURCE.as_str(),
                                status,
                            })
                            .inc();
                    }
                }
            }
        }
        .boxed(),
    )
}

const TOKEN_REJECTED: &str = "token_rejected";

/// `Ok(None)` for 404 (no notice); `Err` carries a bounded metric reason.
async fn read(client: &Client, path: &str) -> Result<Option<String>, &'static str> {
    match client.get(path).await {
        Ok(v) => Ok(Some(v.as_ref().to_string())),
        Err(ImdsError::ErrorResponse(r)) if r.response().status().as_u16() == 404 => Ok(None),
        Err(ImdsError::ErrorResponse(r)) if r.response().status().as_u16() == 401 => {
            Err(TOKEN_REJECTED)
        }
        Err(ImdsError::ErrorResponse(_)) => Err("server_error"),
        Err(ImdsError::FailedToLoadToken(_)) => Err("token"),
        Err(ImdsError::IoError(_)) => Err("unreachable"),
        Err(_) => Err("unexpected"),
    }
}

/// Folds one key's answer into the view and returns what it rejected. A body that does
/// not parse changes nothing; a scheduled event this version cannot read keeps its last
/// reading (it neither drains nor clears).
pub fn apply(view: &mut View, key: &str, body: Option<&str>, now: Timestamp) -> Vec<ParseError> {
    let mut rejected = vec![];
    match key {
        SPOT => match body.map(parse_spot).transpose() {
            // EC2 never postpones a Spot interruption: a later time than one already read
            // is not believed (the instance goes at the first).
            Ok(Some(t)) => {
                let first = view.spot.flatten().map_or(t, |old| old.min(t));
                view.spot = Some(Some(first));
            }
            Ok(None) => view.spot = Some(None),
            Err(e) => rejected.push(e),
        },
        REBALANCE => match body.map(parse_rebalance).transpose() {
            // Keep the first time it was seen if the body does not say.
            Ok(t) => view.rebalance = Some(t.map(|t| t.min(now))),
            Err(e) => rejected.push(e),
        },
        SCHEDULED => match body.map(parse_scheduled).transpose() {
            Ok(entries) => {
                let before = view.scheduled.take().unwrap_or_default();
                let mut now_active = vec![];
                for entry in entries.unwrap_or_default() {
                    match entry {
                        Entry::Active(e) => now_active.push(e),
                        Entry::Finished { .. } => {}
                        Entry::Unknown { id, error } => {
                            now_active.extend(before.iter().find(|e| e.id == id).cloned());
                            rejected.push(error);
                        }
                    }
                }
                view.scheduled = Some(now_active);
            }
            Err(e) => rejected.push(e),
        },
        _ => view.terminating = Some(body.is_some_and(|b| b.trim() == "Terminated")),
    }
    rejected
}

#[cfg(test)]
mod tests;
