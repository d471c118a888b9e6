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
//! | Capacity Reservation interruption warning | as a Spot warning, or earlier when the event states an earlier `instance-termination-time` |
//! | rebalance recommendation | rebalance, Drain, cancellable; lapses after `--rebalance-ttl` |
//! | state change to `stopping`, `stopped`, `shutting-down`, `terminated` | preemption, Terminate now (the event's time) |
//! | Health scheduled change | maintenance at the window's start, classified as the same scheduled event in instance metadata (`aws_imds::scheduled_notice`); the latest update of each Health event (by its ARN) counts, and a `closed` one withdraws it, as instance metadata drops a completed or canceled event |
//! | terminate lifecycle action | scale-down, Terminate; with `--asg-lifecycle` the `asg_lifecycle` source holds the wait instead |
//!
//! Only events for the instance the Node runs now (its `spec.providerID`) count: an event
//! relayed for an earlier instance under the same Node name is ignored. An event stops
//! counting after its time plus [`LIVE_FOR`] (a rebalance: `--rebalance-ttl`), so an
//! instance stopped and started again (same id, same Node) is not drained by its old event.
//! A record that cannot be read is rejected whole (counted, logged once) and the last view
//! stands: it neither drains nor clears.
//!
//! The source wakes when the Node watch delivers a change (pubsub's write reaches it as one)
//! and at the next moment its notices change by the clock alone ([`Reading::next_change`]):
//! it never polls the cache.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use jiff::{SignedDuration, Timestamp};
use kube::runtime::reflector::ObjectRef;
use lastcall_common::aws_events::{
    ANNOTATION, Event, HealthStatus, Record, Relayed, SpotAction, instance_of_provider_id,
};
use tracing::warn;

use super::aws_imds::{self, Code, Scheduled};
use super::{Report, SourceContext};
use crate::metrics::{SourceLabel, SourceReason, SourceStatus};
use crate::notice::{Cause, Notice, Severity, Source};

pub const SOURCE: Source = Source("aws_queue");

/// EC2 gives a Spot interruption two minutes' notice ("Spot Instance interruption notices",
/// Amazon EC2 User Guide). A Capacity Reservation interruption warning too: "If you're
/// running instances in an interruptible reservation, you receive this notification 2
/// minutes before your instances are terminated" ("Monitor interruptible Capacity
/// Reservations with EventBridge and CloudTrail"; and "Instance lifecycle in a group":
/// "instances receive an interruption notice 2 minutes before termination").
const SPOT_NOTICE: SignedDuration = SignedDuration::from_secs(120);
/// How long after its time (its deadline for a Spot warning) an event keeps counting. Past
/// it, the instance either went or lived on (stopped and started again).
pub const LIVE_FOR: SignedDuration = SignedDuration::from_secs(3600);
/// An Auto Scaling lifecycle wait lasts at most 48 hours.
const LIFECYCLE_LIVE_FOR: SignedDuration = SignedDuration::from_secs(172_800);

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

fn before(t: Timestamp, d: SignedDuration) -> Timestamp {
    t.checked_sub(d).unwrap_or(Timestamp::MIN)
}

/// What the relayed events say at one moment.
#[derive(Clone, Debug, PartialEq)]
pub struct Reading {
    pub notices: Vec<Notice>,
    /// The next moment the notices change by the clock alone (an event lapses, a
    /// maintenance enters its lead): the source looks again then, or at the next Node change.
    pub next_change: Option<Timestamp>,
}

/// The moments after `now` at which a reading changes by the clock alone.
struct Changes {
    now: Timestamp,
    next: Option<Timestamp>,
}

impl Changes {
    /// Notes `at` when it is still ahead.
    fn at(&mut self, at: Timestamp) {
        if at > self.now {
            self.next = Some(self.next.map_or(at, |n| n.min(at)));
        }
    }

    /// Whether something that counts until `end` still counts; `end` is noted.
    fn live_until(&mut self, end: Timestamp) -> bool {
        self.at(end);
        self.now < end
    }
}

/// The latest update of each Health event: by its ARN (its EventBridge id for records
/// written before the ARN was kept), the latest by time, then by status (they only move
/// forward: `upcoming`, `open`, `closed`).
fn latest_health_updates<'a>(events: &[&'a Relayed]) -> Vec<&'a Relayed> {
    let mut latest: BTreeMap<&str, &'a Relayed> = BTreeMap::new();
    for e in events {
        let Event::ScheduledChange { arn, status, .. } = &e.event else {
            continue;
        };
        let key = if arn.is_empty() { e.id.as_str() } else { arn };
        let newer = |seen: &&Relayed| match &seen.event {
            Event::ScheduledChange { status: s, .. } => (e.time, *status) > (seen.time, *s),
            _ => true,
        };
        if latest.get(key).is_none_or(newer) {
            latest.insert(key, e);
        }
    }
    latest.into_values().collect()
}

/// The notices of the events relayed for this instance, at `now`. Pure.
pub fn notices(events: &[&Relayed], s: &Settings, now: Timestamp) -> Vec<Notice> {
    read(events, s, now).notices
}

/// The notices of the events relayed for this instance at `now`, and when they next change
/// by the clock alone. Pure.
pub fn read(events: &[&Relayed], s: &Settings, now: Timestamp) -> Reading {
    let n = |cause, severity, deadline, cancellable, detail: String| {
        Notice::new(SOURCE, cause, severity, deadline, cancellable, detail)
    };
    let mut changes = Changes { now, next: None };
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
                if changes.live_until(after(deadline, LIVE_FOR))
                    && interrupted.is_none_or(|(d, _)| deadline < d)
                {
                    interrupted = Some((deadline, e));
                }
            }
            Event::CapacityReservationInterruption { terminates } => {
                // Two minutes after the warning (SPOT_NOTICE), or the termination time the
                // event states when that is earlier.
                let deadline = terminates.map_or(after(e.time, SPOT_NOTICE), |t| {
                    t.min(after(e.time, SPOT_NOTICE))
                });
                if changes.live_until(after(deadline, LIVE_FOR))
                    && interrupted.is_none_or(|(d, _)| deadline < d)
                {
                    interrupted = Some((deadline, e));
                }
            }
            Event::StateChange { .. } => {
                if changes.live_until(after(e.time, LIVE_FOR))
                    && ending.is_none_or(|(d, _)| e.time < d)
                {
                    ending = Some((e.time, e));
                }
            }
            Event::RebalanceRecommendation => {
                let ttl = SignedDuration::try_from(s.rebalance_ttl).unwrap_or_default();
                if changes.live_until(after(e.time, ttl)) {
                    rebalance = Some(rebalance.map_or(e.time, |r: Timestamp| r.min(e.time)));
                }
            }
            // Below, by the latest update of each.
            Event::ScheduledChange { .. } => {}
            Event::TerminateLifecycleAction { .. } => {
                if !s.lifecycle_held_elsewhere
                    && changes.live_until(after(e.time, LIFECYCLE_LIVE_FOR))
                {
                    lifecycle = Some(e);
                }
            }
        }
    }
    for e in latest_health_updates(events) {
        let Event::ScheduledChange {
            code,
            start,
            aws_code,
            arn,
            status,
        } = &e.event
        else {
            continue;
        };
        // Closed: the change is done or cancelled. Instance metadata drops such an event.
        if *status == HealthStatus::Closed {
            continue;
        }
        let Some(code) = Code::parse(code) else {
            continue;
        };
        if !changes.live_until(after(*start, LIVE_FOR)) {
            continue;
        }
        let lead = SignedDuration::try_from(s.maintenance_lead).unwrap_or_default();
        changes.at(before(*start, lead));
        let id = if arn.is_empty() { &e.id } else { arn };
        let scheduled = Scheduled {
            id: id.clone(),
            code,
            not_before: *start,
        };
        let imds = aws_imds::scheduled_notice(&scheduled, s.maintenance_lead, now);
        out.push(Notice {
            source: SOURCE,
            id: format!("{}:{id}", SOURCE.as_str()),
            detail: format!("AWS Health {aws_code}: {}", imds.detail),
            ..imds
        });
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
    Reading {
        notices: out,
        next_change: changes.next,
    }
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
    // Every change the Node watch delivers (pubsub's relay among them) wakes the source.
    let mut node_changes = kube.node_changes.clone();
    let mut watching = true;
    loop {
        let mut next_change: Option<Timestamp> = None;
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
                let reading = read(&mine, &settings, Timestamp::now());
                next_change = reading.next_change;
                let out = reading.notices;
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
        // Until the next Node change, or the moment the notices change by the clock alone.
        let clock = async {
            match next_change {
                Some(at) => {
                    let wait =
                        Duration::try_from(at.duration_since(Timestamp::now())).unwrap_or_default();
                    tokio::time::sleep(wait.max(Duration::from_millis(1))).await;
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = ctx.shutdown.cancelled() => return,
            r = node_changes.changed(), if watching => watching = r.is_ok(),
            () = clock => {}
        }
    }
}

#[cfg(test)]
mod tests;
