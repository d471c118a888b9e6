//! AWS events relayed from an EventBridge → SQS queue (queue mode): pubsub writes each event
//! onto the Node of its instance (`lastcall.dev/aws-events`), and this source reads it from
//! the agent's own cached Node. No IMDS, no host network, no call of its own.
//!
//! A relayed event is treated exactly as the same event read on the node by the
//! instance-metadata source (`aws_imds`):
//!
//! | event | notice |
//! |---|---|
//! | Spot interruption warning | preemption, Terminate at the event's time + 2 minutes (hibernation: at once, AWS gives it no two minutes); never cancellable, never later |
//! | Capacity Reservation interruption warning | as a Spot warning |
//! | rebalance recommendation | rebalance, Drain, cancellable; lapses after `--rebalance-ttl` |
//! | state change to `stopping`, `stopped`, `shutting-down`, `terminated` | preemption, Terminate now (the event's time) |
//! | Health scheduled change | maintenance at the window's start, classified as the same scheduled event in instance metadata (`aws_imds::scheduled_notice`) |
//! | terminate lifecycle action | scale-down, Terminate; with `--asg-lifecycle` the `asg_lifecycle` source holds the wait instead |
//!
//! Only events for the instance the Node runs now (its `spec.providerID`) count: an event
//! relayed for an earlier instance under the same Node name is ignored. An event stops
//! counting after its time plus [`LIVE_FOR`] (a rebalance: `--rebalance-ttl`), so an
//! instance stopped and started again (same id, same Node) is not drained by its old event.
//! A record that cannot be read is rejected whole (counted, logged once) and the last view
//! stands: it neither drains nor clears.

use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use jiff::{SignedDuration, Timestamp};
use kube::runtime::reflector::ObjectRef;
use lastcall_common::aws_events::{
    ANNOTATION, Event, Record, Relayed, SpotAction, instance_of_provider_id,
};
use tracing::warn;

use super::aws_imds::{self, Code, Scheduled};
use super::{Report, SourceContext};
use crate::metrics::{SourceLabel, SourceReason, SourceStatus};
use crate::notice::{Cause, Notice, Severity, Source};

pub const SOURCE: Source = Source("aws_queue");

/// EC2 gives a Spot (or capacity-reservation) interruption two minutes' notice.
const SPOT_NOTICE: SignedDuration = SignedDuration::from_secs(120);
/// How long after its time (its deadline for a Spot warning) an event keeps counting. Past
/// it, the instance either went or lived on (stopped and started again).
pub const LIVE_FOR: SignedDuration = SignedDuration::from_secs(3600);
/// An Auto Scaling lifecycle wait lasts at most 48 hours.
const LIFECYCLE_LIVE_FOR: SignedDuration = SignedDuration::from_secs(172_800);
/// How often the cached Node is looked at: a local read.
const LOOK_EVERY: Duration = Duration::from_millis(200);

/// Settings, from the agent's flags.
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    pub rebalance_ttl: Duration,
    pub maintenance_lead: Duration,
    /// `--asg-lifecycle`: the lifecycle source holds terminate actions; this one says nothing
    /// of them.
    pub lifecycle_held_elsewhere: bool,
}

fn after(t: Timestamp, d: SignedDuration) -> Timestamp {
    t.checked_add(d).unwrap_or(Timestamp::MAX)
}

/// The notices of the events relayed for this instance, at `now`. Pure.
pub fn notices(events: &[&Relayed], s: &Settings, now: Timestamp) -> Vec<Notice> {
    let n = |cause, severity, deadline, cancellable, detail: String| {
        Notice::new(SOURCE, cause, severity, deadline, cancellable, detail)
    };
    let mut out: Vec<Notice> = vec![];
    // Spot and capacity-reservation warnings: the earliest deadline (never later).
    let mut interrupted: Option<(Timestamp, &Relayed)> = None;
    let mut ending: Option<(Timestamp, &Relayed)> = None;
    let mut rebalance: Option<Timestamp> = None;
    let mut lifecycle: Option<&Relayed> = None;
    for e in events {
        match &e.event {
            Event::SpotInterruption { action } => {
                let deadline = if *action == SpotAction::Hibernate {
                    e.time
                } else {
                    after(e.time, SPOT_NOTICE)
                };
                if now < after(deadline, LIVE_FOR) && interrupted.is_none_or(|(d, _)| deadline < d)
                {
                    interrupted = Some((deadline, e));
                }
            }
            Event::CapacityReservationInterruption => {
                let deadline = after(e.time, SPOT_NOTICE);
                if now < after(deadline, LIVE_FOR) && interrupted.is_none_or(|(d, _)| deadline < d)
                {
                    interrupted = Some((deadline, e));
                }
            }
            Event::StateChange { .. } => {
                if now < after(e.time, LIVE_FOR) && ending.is_none_or(|(d, _)| e.time < d) {
                    ending = Some((e.time, e));
                }
            }
            Event::RebalanceRecommendation => {
                let ttl = SignedDuration::try_from(s.rebalance_ttl).unwrap_or_default();
                if now < after(e.time, ttl) {
                    rebalance = Some(rebalance.map_or(e.time, |r: Timestamp| r.min(e.time)));
                }
            }
            Event::ScheduledChange {
                code,
                start,
                aws_code,
            } => {
                let Some(code) = Code::parse(code) else {
                    continue;
                };
                if now >= after(*start, LIVE_FOR) {
                    continue;
                }
                let scheduled = Scheduled {
                    id: e.id.clone(),
                    code,
                    not_before: *start,
                };
                let imds = aws_imds::scheduled_notice(&scheduled, s.maintenance_lead, now);
                out.push(Notice {
                    source: SOURCE,
                    id: format!("{}:{}", SOURCE.as_str(), e.id),
                    detail: format!("AWS Health {aws_code}: {}", imds.detail),
                    ..imds
                });
            }
            Event::TerminateLifecycleAction { .. } => {
                if !s.lifecycle_held_elsewhere && now < after(e.time, LIFECYCLE_LIVE_FOR) {
                    lifecycle = Some(e);
                }
            }
        }
    }
    if let Some((deadline, e)) = interrupted {
        out.push(n(
            Cause::Preemption,
            Severity::Terminate,
            Some(deadline),
            false,
            format!("{} (event {}) relayed from the queue", e.event.kind(), e.id),
        ));
    }
    if let Some((at, e)) = ending {
        let state = match &e.event {
            Event::StateChange { state } => state.as_str(),
            _ => "",
        };
        out.push(n(
            Cause::Preemption,
            Severity::Terminate,
            Some(at),
            false,
            format!(
                "the instance is {state} (event {}), relayed from the queue",
                e.id
            ),
        ));
    }
    if let Some(t) = rebalance {
        out.push(n(
            Cause::Rebalance,
            Severity::Drain,
            None,
            true,
            format!("rebalance recommendation at {t}, relayed from the queue"),
        ));
    }
    if let Some(e) = lifecycle {
        let (group, hook) = match &e.event {
            Event::TerminateLifecycleAction { group, hook } => (group.as_str(), hook.as_str()),
            _ => ("", ""),
        };
        out.push(n(
            Cause::ScaleDown,
            Severity::Terminate,
            None,
            false,
            format!("Auto Scaling group {group} is terminating the instance (hook {hook}), relayed from the queue"),
        ));
    }
    out
}

pub fn start(ctx: SourceContext) -> Option<BoxFuture<'static, ()>> {
    if !ctx.config.aws_queue {
        return None;
    }
    let Some(kube) = ctx.kube.clone() else {
        warn!(message = "queue mode needs the API server's Node; AWS queue source off");
        return None;
    };
    Some(run(ctx, kube).boxed())
}

async fn run(ctx: SourceContext, kube: super::KubeAccess) {
    let c = ctx.config.clone();
    let settings = Settings {
        rebalance_ttl: c.rebalance_ttl,
        maintenance_lead: c.maintenance_lead,
        lifecycle_held_elsewhere: c.asg_lifecycle,
    };
    let metrics = ctx.metrics.clone();
    let node_ref = ObjectRef::new(&c.node_name);
    // What was read last: (instance, raw annotation) and the record it held.
    let mut last_raw: Option<(Option<String>, Option<String>)> = None;
    let mut record: Option<Record> = None;
    let mut instance: Option<String> = None;
    let mut no_instance_told = false;
    loop {
        if let Some(node) = kube.node.get(&node_ref) {
            let iid = node
                .spec
                .as_ref()
                .and_then(|s| s.provider_id.as_deref())
                .and_then(instance_of_provider_id)
                .map(str::to_string);
            let raw = node
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(ANNOTATION))
                .cloned();
            let key = (iid.clone(), raw.clone());
            if last_raw.as_ref() != Some(&key) {
                last_raw = Some(key);
                instance = iid;
                if instance.is_none() && !no_instance_told {
                    warn!(
                        message = "the Node's spec.providerID names no EC2 instance (aws:///<zone>/<id>): relayed events cannot be matched to it"
                    );
                    no_instance_told = true;
                }
                match raw.as_deref().map(Record::parse) {
                    None => record = Some(Record::empty()),
                    Some(Ok(r)) => record = Some(r),
                    Some(Err(e)) => {
                        metrics
                            .signals_rejected
                            .get_or_create(&SourceReason {
                                source: SOURCE.as_str(),
                                reason: e.metric_label(),
                            })
                            .inc();
                        warn!(message = "rejected the relayed AWS events on the Node; the last reading stands", error = %e);
                    }
                }
            }
            metrics
                .source_up
                .get_or_create(&SourceLabel {
                    source: SOURCE.as_str(),
                })
                .set(i64::from(instance.is_some()));
            if let (Some(r), Some(iid)) = (&record, &instance) {
                let mine: Vec<&Relayed> = r.for_instance(iid).collect();
                let out = notices(&mine, &settings, Timestamp::now());
                let counted: Vec<&'static str> = out.iter().map(|n| n.cause.as_str()).collect();
                if super::publish(&ctx.out, Report::Known(out)) {
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
        tokio::select! {
            () = ctx.shutdown.cancelled() => return,
            () = tokio::time::sleep(LOOK_EVERY) => {}
        }
    }
}

#[cfg(test)]
mod tests;
