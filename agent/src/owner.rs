//! One agent acts on a node at a time.
//!
//! A DaemonSet rollout with `maxSurge` runs the old and the new agent side by side on every
//! node. The in-memory lifecycle lock and "deregistered" flag are per process, so without an
//! owner both could fence, release, register or deregister. The owner is named in the Node
//! annotation `lastcall.dev/owner` (`<namespace>/<pod>/<uid>`):
//!
//! - it is taken with a resourceVersion test, so of two contenders one wins;
//! - it is read from the Node watch the agent keeps anyway: no request in steady state;
//! - when it names another pod, that pod is looked up (a GET, uid compared) and the node is
//!   taken over only once the pod is gone: a crashed or killed owner is replaced;
//! - the owner clears it on SIGTERM (guarded by the same test), after its last action.
//!
//! A non-owner keeps its caches and stays ready, but sends nothing that mutates.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::runtime::reflector::{ObjectRef, Store};
use lastcall_common::backoff::Backoff;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::actuator::{ActError, Actuator};
use crate::keys;
use crate::metrics::Metrics;
pub use crate::owner_handle::Owner;
use crate::policy::NodePatch;

/// A pod, as named in the owner annotation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodId {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl PodId {
    pub fn annotation(&self) -> String {
        format!("{}/{}/{}", self.namespace, self.name, self.uid)
    }

    pub fn parse(s: &str) -> Option<Self> {
        let mut parts = s.trim().split('/');
        let (ns, name, uid) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || ns.is_empty() || name.is_empty() || uid.is_empty() {
            return None;
        }
        Some(Self {
            namespace: ns.into(),
            name: name.into(),
            uid: uid.into(),
        })
    }
}

/// Who owns the node, as its annotations say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Claim {
    /// This agent.
    Mine,
    /// Nobody (never taken, released, or unreadable): free to take.
    Free,
    /// Another agent, alive or not.
    Other(PodId),
}

/// Reads the owner annotation. An unreadable value names nobody: it is taken over.
pub fn claim(annotations: &BTreeMap<String, String>, me: &PodId) -> Claim {
    match annotations
        .get(keys::ANN_OWNER)
        .and_then(|v| PodId::parse(v))
    {
        None => Claim::Free,
        Some(p) if p == *me => Claim::Mine,
        Some(p) => Claim::Other(p),
    }
}

/// How often the cached Node is looked at (memory only, no request).
const LOOK_EVERY: Duration = Duration::from_millis(250);
/// How often a live foreign owner's pod is looked up, at least. Only a standby agent asks
/// (a rollout's new pod until the old one hands over, or the replacement of an owner that
/// died without handing over), and a node whose owner is gone mid-drain waits this long, so
/// it is short: one GET a second on the few nodes rolling at once.
const RECHECK_OTHER: Duration = Duration::from_secs(1);

/// Takes and keeps the node's ownership; see the module doc.
pub struct Ownership {
    pub me: PodId,
    pub node_name: String,
    pub node: Store<Node>,
    pub actuator: Actuator,
    pub owner: Owner,
    pub metrics: Metrics,
}

/// What a look at the owner pod found.
enum Peer {
    Alive,
    Gone,
}

impl Ownership {
    fn cached(&self) -> Option<Arc<Node>> {
        self.node.get(&ObjectRef::new(&self.node_name))
    }

    fn set(&self, owner: bool) {
        if owner != self.owner.is_owner() {
            info!(
                message = if owner { "this agent owns the node" } else { "another agent owns the node; standing by" },
                pod = %self.me.annotation()
            );
        }
        self.owner.set(owner);
        self.metrics.node_owner.set(i64::from(owner));
    }

    async fn peer(&self, p: &PodId) -> Result<Peer, kube::Error> {
        let pods: Api<Pod> = Api::namespaced(self.actuator.client(), &p.namespace);
        Ok(match pods.get_opt(&p.name).await? {
            Some(pod) if pod.metadata.uid.as_deref() == Some(p.uid.as_str()) => Peer::Alive,
            _ => Peer::Gone,
        })
    }

    /// Names this agent as owner, if the Node is still at `node`'s version.
    async fn take(&self, node: &Node) -> Result<(), ActError> {
        let annotations = node.metadata.annotations.clone().unwrap_or_default();
        let mut patch = NodePatch {
            resource_version: node.metadata.resource_version.clone().unwrap_or_default(),
            ..Default::default()
        };
        patch
            .set_annotations
            .insert(keys::ANN_OWNER.into(), self.me.annotation());
        let has_labels = node.metadata.labels.as_ref().is_some_and(|l| !l.is_empty());
        self.actuator
            .patch_node(&patch, !annotations.is_empty(), has_labels)
            .await
            .map(|_| ())
    }

    /// Keeps `owner` up to date until shutdown: takes the node when it is free or its owner
    /// is gone, and notices when another agent has taken it.
    pub async fn run(self, stop: CancellationToken) {
        // The version our take was based on: a cache still showing it has not seen the take.
        let mut taken_from: Option<String> = None;
        let mut next_check = tokio::time::Instant::now();
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
        loop {
            if let Some(node) = self.cached()
                && node.metadata.resource_version != taken_from
            {
                taken_from = None;
                let ann = node.metadata.annotations.clone().unwrap_or_default();
                let take = match claim(&ann, &self.me) {
                    Claim::Mine => {
                        self.set(true);
                        false
                    }
                    Claim::Free => true,
                    Claim::Other(p) => {
                        self.set(false);
                        if tokio::time::Instant::now() < next_check {
                            false
                        } else {
                            match self.peer(&p).await {
                                Ok(Peer::Alive) => {
                                    next_check = tokio::time::Instant::now() + RECHECK_OTHER;
                                    false
                                }
                                Ok(Peer::Gone) => {
                                    info!(message = "the owner pod is gone; taking the node over", previous = %p.annotation());
                                    true
                                }
                                Err(e) => {
                                    let d = backoff.next_delay();
                                    warn!(message = "looking up the node's owner pod failed", error = %e, retry_in_ms = d.as_millis() as u64);
                                    next_check = tokio::time::Instant::now() + d;
                                    false
                                }
                            }
                        }
                    }
                };
                if take {
                    match self.take(&node).await {
                        Ok(()) => {
                            backoff.reset();
                            taken_from = node.metadata.resource_version.clone();
                            self.set(true);
                        }
                        // Someone else wrote the Node first: decide again on its new version.
                        Err(ActError::Conflict(_)) => {}
                        Err(e) => {
                            let d = backoff.next_delay();
                            warn!(message = "taking the node's ownership failed", error = %e, retry_in_ms = d.as_millis() as u64);
                            tokio::select! {
                                () = stop.cancelled() => return,
                                () = tokio::time::sleep(d) => {}
                            }
                        }
                    }
                }
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(LOOK_EVERY) => {}
            }
        }
    }
}

/// Reads whether this agent still owns the node, from the API server (at shutdown, when a
/// decision must not rest on a cache).
pub async fn still_owner(actuator: &Actuator, node_name: &str, me: &PodId) -> bool {
    match Api::<Node>::all(actuator.client()).get(node_name).await {
        Ok(n) => claim(&n.metadata.annotations.unwrap_or_default(), me) == Claim::Mine,
        Err(e) => {
            warn!(message = "reading the node's owner failed; acting as a non-owner", error = %e);
            false
        }
    }
}

/// Clears the owner annotation if it still names this agent (guarded by the Node's
/// resourceVersion, retried on a conflict), so the next agent takes over at once.
pub async fn release(actuator: &Actuator, node_name: &str, me: &PodId) -> Result<bool, ActError> {
    let nodes = Api::<Node>::all(actuator.client());
    for _ in 0..3 {
        let n = nodes.get(node_name).await?;
        let ann = n.metadata.annotations.clone().unwrap_or_default();
        if claim(&ann, me) != Claim::Mine {
            return Ok(false);
        }
        let mut patch = NodePatch {
            resource_version: n.metadata.resource_version.clone().unwrap_or_default(),
            ..Default::default()
        };
        patch.remove_annotations.insert(keys::ANN_OWNER.into());
        let has_labels = n.metadata.labels.as_ref().is_some_and(|l| !l.is_empty());
        match actuator.patch_node(&patch, true, has_labels).await {
            Ok(_) => return Ok(true),
            Err(ActError::Conflict(_)) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(ActError::Conflict(
        "the Node kept changing while releasing ownership".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me() -> PodId {
        PodId {
            namespace: "lastcall".into(),
            name: "agent-a".into(),
            uid: "u-1".into(),
        }
    }

    fn ann(v: &str) -> BTreeMap<String, String> {
        [(keys::ANN_OWNER.to_string(), v.to_string())].into()
    }

    #[test]
    fn claims_by_name_and_uid() {
        assert_eq!(claim(&BTreeMap::new(), &me()), Claim::Free);
        assert_eq!(claim(&ann("lastcall/agent-a/u-1"), &me()), Claim::Mine);
        assert_eq!(
            claim(&ann("lastcall/agent-a/u-0"), &me()),
            Claim::Other(PodId {
                namespace: "lastcall".into(),
                name: "agent-a".into(),
                uid: "u-0".into()
            }),
            "same name, another pod: a restarted StatefulSet-like name is not us"
        );
        for garbled in ["", "x", "a/b", "a/b/c/d", "//"] {
            assert_eq!(claim(&ann(garbled), &me()), Claim::Free, "{garbled:?}");
        }
        assert_eq!(PodId::parse(&me().annotation()), Some(me()));
    }

    #[tokio::test]
    async fn owner_handle_waits_for_ownership() {
        let o = Owner::contender();
        assert!(!o.is_owner());
        let stop = CancellationToken::new();
        let waiting = {
            let (o, stop) = (o.clone(), stop.clone());
            tokio::spawn(async move { o.owned(&stop).await })
        };
        o.set(true);
        assert!(waiting.await.unwrap());
        assert!(Owner::sole().is_owner());
        stop.cancel();
        assert!(!Owner::contender().owned(&stop).await);
    }
}
