//! What the webhook reads of Nodes from the Kubernetes API: whether the Nodes that
//! drain-state entries name still exist (Fleets come from a watch: [`super::fleets`]).
//!
//! Optional: without a client (no in-cluster credentials, no kubeconfig) or when a read
//! fails, a Node counts as present (its entry counts, or holds, by its age alone). Every
//! read is bounded by the webhook's timeout, and Node answers are cached for
//! [`NODE_CACHE_FOR`], so a review costs at most one GET per draining node every few
//! seconds. The names come from the drain state agents write, never from a review.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use lastcall_common::drain_state::Live;
use tokio::time::Instant;

use crate::metrics::{Metrics, WebhookMetrics};

/// How long a Node's presence or absence is trusted before it is read again.
pub const NODE_CACHE_FOR: Duration = Duration::from_secs(10);

/// What was seen of a Node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeSeen {
    /// It exists.
    Present,
    /// The API server says there is no such Node.
    Absent,
    /// It could not be read (no client, an error, the timeout).
    Unknown,
}

/// Whether `entry` belongs to a Node that is gone. An unknown Node is not gone: its entry
/// counts, or holds, by its age alone. (A new Node that reuses a dead one's name is not
/// told apart: the dead one's entry then ends by age, at the hold limit.)
pub fn is_gone(seen: NodeSeen, _entry: &Live) -> bool {
    seen == NodeSeen::Absent
}

/// The webhook's Kubernetes reads.
pub struct KubeReads {
    client: kube::Client,
    timeout: Duration,
    nodes: Mutex<HashMap<String, (Instant, NodeSeen)>>,
    metrics: WebhookMetrics,
}

impl std::fmt::Debug for KubeReads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeReads")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl KubeReads {
    pub fn new(client: kube::Client, timeout: Duration, metrics: WebhookMetrics) -> Self {
        Self {
            client,
            timeout,
            nodes: Mutex::new(HashMap::new()),
            metrics,
        }
    }

    /// What is known of each of `names`, reading the ones not cached, all at once, within
    /// the timeout and by `deadline`.
    pub async fn nodes(&self, names: &[&str], deadline: Instant) -> HashMap<String, NodeSeen> {
        let now = Instant::now();
        let mut out = HashMap::new();
        let mut wanted = Vec::new();
        {
            let mut cache = self.nodes.lock().unwrap_or_else(|p| p.into_inner());
            cache.retain(|_, (at, _)| now.saturating_duration_since(*at) < NODE_CACHE_FOR);
            for name in names {
                match cache.get(*name) {
                    Some((_, seen)) => {
                        out.insert((*name).to_string(), *seen);
                    }
                    None if !wanted.contains(name) => wanted.push(*name),
                    None => {}
                }
            }
        }
        if wanted.is_empty() {
            return out;
        }
        let api: Api<Node> = Api::all(self.client.clone());
        let reads = futures::future::join_all(wanted.iter().map(|name| {
            let api = api.clone();
            async move { (name.to_string(), api.get_metadata_opt(name).await) }
        }));
        let read = tokio::time::timeout_at(deadline.min(now + self.timeout), reads).await;
        let mut cache = self.nodes.lock().unwrap_or_else(|p| p.into_inner());
        let Ok(read) = read else {
            Metrics::result(&self.metrics.node_reads, "error");
            tracing::debug!(message = "reading Nodes timed out", nodes = wanted.len());
            for name in wanted {
                out.insert(name.to_string(), NodeSeen::Unknown);
            }
            return out;
        };
        for (name, result) in read {
            let seen = match result {
                Ok(Some(_)) => NodeSeen::Present,
                Ok(None) => NodeSeen::Absent,
                Err(e) => {
                    tracing::debug!(message = "reading a Node failed", node = %name, error = %e);
                    NodeSeen::Unknown
                }
            };
            Metrics::result(
                &self.metrics.node_reads,
                match seen {
                    NodeSeen::Present => "present",
                    NodeSeen::Absent => "absent",
                    NodeSeen::Unknown => "error",
                },
            );
            if seen != NodeSeen::Unknown {
                cache.insert(name.clone(), (now, seen));
            }
            out.insert(name, seen);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(updated_at_ms: i64) -> Live {
        Live {
            node: "n".into(),
            updated_at_ms,
            stale: None,
            truncated: false,
            fleets: Vec::new(),
        }
    }

    #[test]
    fn only_absent_nodes_are_gone() {
        let e = entry(1_000);
        assert!(is_gone(NodeSeen::Absent, &e));
        assert!(!is_gone(NodeSeen::Unknown, &e));
        assert!(!is_gone(NodeSeen::Present, &e));
    }
}
