//! AWS instance metadata (IMDSv2): Spot interruptions, rebalance recommendations, scheduled
//! events and the Auto Scaling target lifecycle state. This is the signal on EKS Auto Mode
//! and Karpenter-less EC2 fleets, where there is no FleetIQ.
//!
//! It uses `aws-config`'s IMDS client, which fetches and refreshes the session token (and
//! retries once on 401); there is no IMDSv1 fallback. Polled every `--aws-imds-interval`:
//! the endpoint never leaves the node. 404 means "no notice"; any other failure keeps the last
//! view (never "all clear"), is counted, and is retried on the next poll.

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

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {why}")]
pub struct ParseError {
    pub key: &'static str,
    pub why: String,
}

fn bad(key: &'static str, why: impl Into<String>) -> ParseError {
    ParseError {
        key,
        why: why.into(),
    }
}

fn json(key: &'static str, body: &str) -> Result<serde_json::Value, ParseError> {
    serde_json::from_str(body).map_err(|e| bad(key, e.to_string()))
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

/// One scheduled event that is still active.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scheduled {
    pub code: String,
    pub not_before: Timestamp,
}

/// `events/maintenance/scheduled`: a JSON array; only `active` events count (`canceled` and
/// `completed` ones clear). Times are like `21 Jan 2019 09:00:43 GMT`.
pub fn parse_scheduled(body: &str) -> Result<Vec<Scheduled>, ParseError> {
    let v = json("scheduled", body)?;
    let Some(events) = v.as_array() else {
        return Err(bad("scheduled", "not an array"));
    };
    let mut out = vec![];
    for e in events {
        let text = |k: &str| e.get(k).and_then(|x| x.as_str());
        let state = text("State").unwrap_or("active");
        if state != "active" {
            continue;
        }
        let code = text("Code").ok_or_else(|| bad("scheduled", "event without Code"))?;
        let nb = text("NotBefore").ok_or_else(|| bad("scheduled", "event without NotBefore"))?;
        let not_before = jiff::fmt::strtime::parse("%d %b %Y %H:%M:%S GMT", nb)
            .and_then(|t| t.to_datetime())
            .and_then(|dt| dt.to_zoned(jiff::tz::TimeZone::UTC))
            .map(|z| z.timestamp())
            .map_err(|e| bad("scheduled", format!("NotBefore {nb:?}: {e}")))?;
        out.push(Scheduled {
            code: code.chars().take(48).collect(),
            not_before,
        });
    }
    Ok(out)
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

/// The notices of a view: unknown until every key has been read once.
pub fn report(view: &View, rebalance_ttl: Duration, now: Timestamp) -> Report {
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
        let ttl = SignedDuration::try_from(rebalance_ttl).unwrap_or_default();
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
    for e in scheduled {
        let reboot = e.code.ends_with("reboot");
        out.push(n(
            Cause::Maintenance,
            if reboot {
                Severity::Drain
            } else {
                Severity::Terminate
            },
            Some(e.not_before),
            true,
            format!("scheduled event {}", e.code),
        ));
    }
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
    let ttl = c.rebalance_ttl;
    let (out, metrics, shutdown) = (ctx.out, ctx.metrics, ctx.shutdown);
    Some(
        async move {
            let mut view = View::default();
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
                            if let Err(e) = apply(&mut view, key, body.as_deref(), Timestamp::now())
                            {
                                metrics
                                    .signals_rejected
                                    .get_or_create(&SourceReason {
                                        source: SOURCE.as_str(),
                                        reason: "invalid",
                                    })
                                    .inc();
                                warn!(message = "rejected IMDS notice", error = %e);
                            }
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
                let r = report(&view, ttl, Timestamp::now());
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

/// Folds one key's answer into the view. A body that does not parse changes nothing.
pub fn apply(
    view: &mut View,
    key: &str,
    body: Option<&str>,
    now: Timestamp,
) -> Result<(), ParseError> {
    match key {
        SPOT => {
            let t = body.map(parse_spot).transpose()?;
            view.spot = Some(t);
        }
        REBALANCE => {
            // Keep the first time it was seen if the body does not say.
            let t = body.map(parse_rebalance).transpose()?;
            view.rebalance = Some(t.map(|t| t.min(now)));
        }
        SCHEDULED => {
            view.scheduled = Some(body.map(parse_scheduled).transpose()?.unwrap_or_default());
        }
        _ => view.terminating = Some(body.is_some_and(|b| b.trim() == "Terminated")),
    }
    Ok(())
}

#[cfg(test)]
mod tests;
