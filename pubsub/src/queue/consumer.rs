//! The SQS side: long-polling receivers, one message handled at a time per message (in
//! parallel within a batch), its visibility extended while it is handled, and deleted only
//! once every event in it is on its Node (or can never be: unreadable, ignored, unmanaged).
//!
//! At least once: a message whose relay failed is left to come back after its visibility
//! timeout; one whose instance has no Node yet comes back sooner, until `--queue-node-wait`
//! after SQS received it. A redelivery finds its events already on the Node and writes
//! nothing.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use aws_sdk_sqs::types::{Message, MessageSystemAttributeName};
use jiff::{SignedDuration, Timestamp};
use lastcall_common::admin::Health;
use lastcall_common::aws_events::Relayed;
use tokio_util::sync::CancellationToken;

use super::event::{self, Parsed};
use super::metrics::{KindLabels, QueueMetrics, ReasonLabels};
use super::nodes::{Lookup, NodeIndex};
use super::relay::{self, Outcome};

/// Name of the readiness check that the queue is being read.
pub const READY_QUEUE: &str = "queue";
/// How soon a message whose instance has no Node yet is looked at again.
const NODE_RECHECK: Duration = Duration::from_secs(10);
/// How far in the future (past SQS's own receipt) an event's time may lie.
const FUTURE_SLACK: SignedDuration = SignedDuration::from_secs(300);
/// Detail-types logged once each; past this many, new ones are counted only.
const LOGGED_TYPES: usize = 256;

/// What becomes of one message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Delete it; the reason is a metric label.
    Delete(&'static str),
    /// Let it come back after this long.
    RetryIn(Duration),
    /// Leave it: it comes back after its visibility timeout.
    Leave,
}

/// Where one event of a message stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventFate {
    Done,
    Unmanaged,
    /// No Node yet, still within the wait.
    Waiting,
    Failed,
}

/// The message's fate from its events'. Pure.
/// `recheck`: how soon a message waiting for a Node comes back.
pub fn decide(fates: &[EventFate], recheck: Duration) -> Decision {
    if fates.contains(&EventFate::Failed) {
        Decision::Leave
    } else if fates.contains(&EventFate::Waiting) {
        Decision::RetryIn(recheck)
    } else if !fates.is_empty() && fates.iter().all(|f| *f == EventFate::Unmanaged) {
        Decision::Delete("unmanaged")
    } else {
        Decision::Delete("relayed")
    }
}

/// Whether an instance without a Node is still looked for: until `node_wait` after SQS
/// received the message (SQS's time, which a sender cannot forge).
pub fn still_waiting(sent: Timestamp, node_wait: Duration, now: Timestamp) -> bool {
    let wait = SignedDuration::try_from(node_wait).unwrap_or(SignedDuration::MAX);
    sent.checked_add(wait).map_or(true, |until| now < until)
}

pub struct Consumer {
    pub sqs: aws_sdk_sqs::Client,
    pub queue_url: String,
    pub kube: kube::Client,
    pub index: NodeIndex,
    pub metrics: QueueMetrics,
    pub health: Health,
    pub visibility: Duration,
    pub wait: Duration,
    pub node_wait: Duration,
    logged: Mutex<HashSet<String>>,
}

impl Consumer {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        sqs: aws_sdk_sqs::Client,
        queue_url: String,
        kube: kube::Client,
        index: NodeIndex,
        metrics: QueueMetrics,
        health: Health,
        visibility: Duration,
        wait: Duration,
        node_wait: Duration,
    ) -> Self {
        Self {
            sqs,
            queue_url,
            kube,
            index,
            metrics,
            health,
            visibility,
            wait,
            node_wait,
            logged: Mutex::default(),
        }
    }

    /// One receiver: long polls until `shutdown`, backing off (jittered, up to 30 s) after a
    /// failed receive. Never returns early.
    pub async fn receive_loop(&self, shutdown: CancellationToken) {
        let mut backoff = Duration::from_secs(1);
        loop {
            let received = tokio::select! {
                () = shutdown.cancelled() => return,
                r = self.receive() => r,
            };
            match received {
                Ok(messages) => {
                    backoff = Duration::from_secs(1);
                    self.health.set(READY_QUEUE, true, "");
                    let handled = futures::future::join_all(
                        messages.iter().map(|m| self.handle_with_visibility(m)),
                    );
                    // A message being handled is finished even on shutdown: its relay is a
                    // single patch, and cutting it would only make it come back.
                    handled.await;
                }
                Err(reason) => {
                    self.metrics.error("ReceiveMessage", reason);
                    self.health.set(
                        READY_QUEUE,
                        false,
                        format!("ReceiveMessage failed: {reason}"),
                    );
                    let pause = lastcall_common::backoff::jitter(backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(30));
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(pause) => {}
                    }
                }
            }
        }
    }

    async fn receive(&self) -> Result<Vec<Message>, &'static str> {
        let out = self
            .sqs
            .receive_message()
            .queue_url(&self.queue_url)
            .max_number_of_messages(10)
            .wait_time_seconds(i32::try_from(self.wait.as_secs()).unwrap_or(20))
            .visibility_timeout(secs(self.visibility))
            .message_system_attribute_names(MessageSystemAttributeName::SentTimestamp)
            .send()
            .await
            .map_err(|e| {
                tracing::warn!(message = "receiving from the queue failed; backing off", error = %aws_sdk_sqs::error::DisplayErrorContext(&e));
                sdk_reason(&e)
            })?;
        let messages = out.messages.unwrap_or_default();
        let now = Timestamp::now();
        // An empty receive means nothing waits: the age goes back to 0.
        let age = messages
            .iter()
            .filter_map(sent_at)
            .min()
            .map_or(0.0, |oldest| {
                now.duration_since(oldest).as_secs_f64().max(0.0)
            });
        self.metrics.oldest_message_age.set(age);
        Ok(messages)
    }

    /// Handles one message while keeping it hidden from other receivers, then deletes it or
    /// lets it come back.
    pub async fn handle_with_visibility(&self, m: &Message) {
        let Some(receipt) = m.receipt_handle() else {
            return;
        };
        let handling = self.handle(m);
        futures::pin_mut!(handling);
        let every = self.visibility / 2;
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        let decision = loop {
            tokio::select! {
                d = &mut handling => break d,
                _ = tick.tick() => self.change_visibility(receipt, self.visibility).await,
            }
        };
        match decision {
            Decision::Delete(reason) => {
                match self
                    .sqs
                    .delete_message()
                    .queue_url(&self.queue_url)
                    .receipt_handle(receipt)
                    .send()
                    .await
                {
                    Ok(_) => {
                        self.metrics
                            .deleted
                            .get_or_create(&ReasonLabels { reason })
                            .inc();
                    }
                    Err(e) => {
                        // It comes back; its events are on their Nodes, so it changes nothing.
                        self.metrics.error("DeleteMessage", sdk_reason(&e));
                        tracing::warn!(message = "deleting a handled message failed; it will come back and change nothing", error = %aws_sdk_sqs::error::DisplayErrorContext(&e));
                    }
                }
            }
            Decision::RetryIn(d) => self.change_visibility(receipt, d).await,
            Decision::Leave => {}
        }
    }

    async fn change_visibility(&self, receipt: &str, d: Duration) {
        if let Err(e) = self
            .sqs
            .change_message_visibility()
            .queue_url(&self.queue_url)
            .receipt_handle(receipt)
            .visibility_timeout(secs(d))
            .send()
            .await
        {
            self.metrics
                .error("ChangeMessageVisibility", sdk_reason(&e));
            tracing::warn!(message = "changing a message's visibility failed", error = %aws_sdk_sqs::error::DisplayErrorContext(&e));
        }
    }

    /// Reads one message and relays its events. Never panics on any body.
    pub async fn handle(&self, m: &Message) -> Decision {
        self.metrics.received.inc();
        let now = Timestamp::now();
        let sent = sent_at(m).unwrap_or(now);
        let parsed = match event::parse(m.body().unwrap_or_default()) {
            Ok(p) => p,
            Err(e) => {
                self.metrics
                    .parse_errors
                    .get_or_create(&ReasonLabels {
                        reason: e.metric_label(),
                    })
                    .inc();
                self.log_once(e.detail_type(), e.metric_label(), &e.to_string());
                return Decision::Delete("parse_error");
            }
        };
        let events = match parsed {
            Parsed::Ignored { why } => {
                self.metrics
                    .ignored
                    .get_or_create(&ReasonLabels {
                        reason: why.metric_label(),
                    })
                    .inc();
                return Decision::Delete("ignored");
            }
            Parsed::Relay(events) => events,
        };
        if let Some(future) = events.iter().find(|e| {
            sent.checked_add(FUTURE_SLACK)
                .is_ok_and(|limit| e.time > limit)
        }) {
            self.metrics
                .parse_errors
                .get_or_create(&ReasonLabels {
                    reason: "future_time",
                })
                .inc();
            self.log_once(
                future.event.kind(),
                "future_time",
                &format!(
                    "event time {} is after the queue received it ({sent})",
                    future.time
                ),
            );
            return Decision::Delete("parse_error");
        }
        let mut fates = Vec::with_capacity(events.len());
        for e in &events {
            fates.push(self.relay_one(e, sent).await);
        }
        decide(
            &fates,
            NODE_RECHECK.min(self.node_wait).max(Duration::from_secs(1)),
        )
    }

    async fn relay_one(&self, e: &Relayed, sent: Timestamp) -> EventFate {
        let kind = KindLabels {
            kind: e.event.kind(),
        };
        let missing = || {
            if still_waiting(sent, self.node_wait, Timestamp::now()) {
                EventFate::Waiting
            } else {
                self.metrics.unmanaged.get_or_create(&kind).inc();
                tracing::info!(message = "no Node of this cluster runs the event's instance; the message is deleted", instance = %e.instance, kind = kind.kind, id = %e.id);
                EventFate::Unmanaged
            }
        };
        let entry = match self.index.lookup(&e.instance) {
            Lookup::Found(entry) => entry,
            Lookup::NotReady => return EventFate::Waiting,
            Lookup::NoNode => return missing(),
        };
        let node = entry.name.clone();
        match relay::relay(&self.kube, &e.instance, entry, e).await {
            Ok(Outcome::Written(entry)) => {
                self.index.wrote(&e.instance, entry);
                self.metrics.relayed.get_or_create(&kind).inc();
                let latency = Timestamp::now().duration_since(e.time).as_secs_f64();
                self.metrics.relay_latency.observe(latency.max(0.0));
                tracing::info!(message = "relayed an event to its Node", node = %node, instance = %e.instance, kind = kind.kind, id = %e.id);
                EventFate::Done
            }
            Ok(Outcome::Duplicate) => {
                self.metrics.duplicates.get_or_create(&kind).inc();
                EventFate::Done
            }
            Ok(Outcome::NodeGone) => missing(),
            Err(err) => {
                self.metrics.error("PatchNode", err.metric_label());
                tracing::warn!(message = "relaying an event to its Node failed; the message will come back", node = %node, instance = %e.instance, kind = kind.kind, error = %err);
                EventFate::Failed
            }
        }
    }

    /// Logs a message that could not be read once per detail-type (bounded), so a rule that
    /// sends something unexpected is told without flooding the log.
    fn log_once(&self, detail_type: &str, reason: &'static str, error: &str) {
        let key = format!("{reason}/{detail_type}");
        let mut logged = self.logged.lock().unwrap_or_else(|e| e.into_inner());
        if logged.contains(&key) || logged.len() >= LOGGED_TYPES {
            return;
        }
        logged.insert(key);
        drop(logged);
        tracing::warn!(
            message = "a queue message lastcall cannot use; deleted (told once per detail-type)",
            detail_type,
            reason,
            error
        );
    }
}

fn sent_at(m: &Message) -> Option<Timestamp> {
    let ms: i64 = m
        .attributes()?
        .get(&MessageSystemAttributeName::SentTimestamp)?
        .parse()
        .ok()?;
    Timestamp::from_millisecond(ms).ok()
}

fn secs(d: Duration) -> i32 {
    i32::try_from(d.as_secs().max(1)).unwrap_or(43_200)
}

fn sdk_reason<E, R>(e: &aws_sdk_sqs::error::SdkError<E, R>) -> &'static str
where
    E: aws_sdk_sqs::error::ProvideErrorMetadata,
{
    use aws_sdk_sqs::error::SdkError;
    match e {
        SdkError::TimeoutError(_) | SdkError::DispatchFailure(_) => "unreachable",
        SdkError::ServiceError(s) => match s.err().code() {
            Some("AccessDenied" | "AccessDeniedException") => "access_denied",
            Some(c) if c.contains("Throttl") || c == "RequestThrottled" => "throttled",
            Some(c) if c.contains("NonExistentQueue") || c.contains("QueueDoesNotExist") => {
                "no_queue"
            }
            Some(c) if c.contains("ReceiptHandleIsInvalid") => "receipt_invalid",
            _ => "error",
        },
        _ => "error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decide_(fates: &[EventFate]) -> Decision {
        decide(fates, NODE_RECHECK)
    }

    #[test]
    fn a_message_is_deleted_only_when_no_event_is_pending() {
        use EventFate::*;
        assert_eq!(decide_(&[Done]), Decision::Delete("relayed"));
        assert_eq!(decide_(&[Done, Unmanaged]), Decision::Delete("relayed"));
        assert_eq!(
            decide_(&[Unmanaged, Unmanaged]),
            Decision::Delete("unmanaged")
        );
        assert_eq!(decide_(&[Done, Waiting]), Decision::RetryIn(NODE_RECHECK));
        assert_eq!(decide_(&[Waiting, Failed]), Decision::Leave);
        assert_eq!(
            decide_(&[Done, Failed]),
            Decision::Leave,
            "a failed write is never deleted"
        );
    }

    #[test]
    fn an_instance_is_waited_for_from_when_sqs_received_it() {
        let sent: Timestamp = "2026-12-01T10:00:00Z".parse().unwrap();
        let wait = Duration::from_secs(120);
        assert!(still_waiting(
            sent,
            wait,
            "2026-12-01T10:01:59Z".parse().unwrap()
        ));
        assert!(!still_waiting(
            sent,
            wait,
            "2026-12-01T10:02:00Z".parse().unwrap()
        ));
        assert!(still_waiting(
            sent,
            Duration::MAX,
            "2026-12-01T10:02:00Z".parse().unwrap()
        ));
    }
}
