//! Instance → Node, from one watch of every Node.
//!
//! The instance is read from the Node's `spec.providerID` (`aws:///<zone>/<instance-id>`),
//! never from a DNS name: node names need not match instance hostnames. `providerID` is in
//! the spec, so a metadata-only watch cannot see it; the watch keeps, per Node, only its
//! name, instance, resourceVersion and the relayed record (a few hundred bytes), never the
//! whole object. The index is swapped whole after each (re)list, so a Node deleted while the
//! watch was down is forgotten.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use lastcall_common::aws_events::{ANNOTATION, instance_of_provider_id};
use tokio_util::sync::CancellationToken;

use super::metrics::QueueMetrics;

/// What the relay needs of one Node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeEntry {
    pub name: String,
    pub resource_version: String,
    /// The relayed record as the watch last saw it (`None`: no annotation).
    pub record: Option<String>,
    /// Whether the Node has an annotations map at all (a JSON patch must add it first).
    pub has_annotations: bool,
}

impl NodeEntry {
    /// The entry of a Node that runs an EC2 instance, with that instance.
    pub fn of(node: &Node) -> Option<(String, NodeEntry)> {
        let instance = node
            .spec
            .as_ref()
            .and_then(|s| s.provider_id.as_deref())
            .and_then(instance_of_provider_id)?
            .to_string();
        let meta = &node.metadata;
        Some((
            instance,
            NodeEntry {
                name: meta.name.clone()?,
                resource_version: meta.resource_version.clone().unwrap_or_default(),
                record: meta
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(ANNOTATION))
                    .cloned(),
                has_annotations: meta.annotations.is_some(),
            },
        ))
    }
}

/// The index: instance id → its Node. Read by every receiver, written by the watch alone.
#[derive(Clone, Default)]
pub struct NodeIndex {
    inner: Arc<RwLock<Inner>>,
}

#[derive(Default)]
struct Inner {
    by_instance: HashMap<String, NodeEntry>,
    /// Node name → instance, to drop a Node's entry when it is deleted or changes instance.
    by_name: HashMap<String, String>,
    /// Filled during a (re)list, swapped in at its end.
    listing: Option<HashMap<String, NodeEntry>>,
    ready: bool,
}

/// What a lookup found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    Found(NodeEntry),
    /// The watch has listed every Node, and none runs this instance.
    NoNode,
    /// The first list has not finished: nothing can be said yet.
    NotReady,
}

impl NodeIndex {
    pub fn lookup(&self, instance: &str) -> Lookup {
        let g = self.inner.read().unwrap_or_else(|e| e.into_inner());
        match g.by_instance.get(instance) {
            Some(e) => Lookup::Found(e.clone()),
            None if g.ready => Lookup::NoNode,
            None => Lookup::NotReady,
        }
    }

    pub fn is_ready(&self) -> bool {
        self.inner.read().unwrap_or_else(|e| e.into_inner()).ready
    }

    pub fn len(&self) -> usize {
        self.inner
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .by_instance
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What this process just wrote: its next write tests this resourceVersion, so a second
    /// event for the same Node need not wait for the watch to echo the first.
    pub fn wrote(&self, instance: &str, entry: NodeEntry) {
        let mut g = self.inner.write().unwrap_or_else(|e| e.into_inner());
        if let Some(cur) = g.by_instance.get_mut(instance)
            && cur.name == entry.name
        {
            *cur = entry;
        }
    }

    /// Folds one watch event in (synchronous, so tests feed hand-built Nodes).
    pub fn apply(&self, event: Event<Node>) {
        let mut g = self.inner.write().unwrap_or_else(|e| e.into_inner());
        match event {
            Event::Init => g.listing = Some(HashMap::new()),
            Event::InitApply(node) => {
                if let (Some(listing), Some((instance, entry))) =
                    (g.listing.as_mut(), NodeEntry::of(&node))
                {
                    listing.insert(instance, entry);
                }
            }
            Event::InitDone => {
                let listing = g.listing.take().unwrap_or_default();
                g.by_name = listing
                    .iter()
                    .map(|(i, e)| (e.name.clone(), i.clone()))
                    .collect();
                g.by_instance = listing;
                g.ready = true;
            }
            Event::Apply(node) => {
                let name = node.metadata.name.clone().unwrap_or_default();
                if let Some(old) = g.by_name.remove(&name) {
                    g.by_instance.remove(&old);
                }
                if let Some((instance, entry)) = NodeEntry::of(&node) {
                    g.by_name.insert(entry.name.clone(), instance.clone());
                    g.by_instance.insert(instance, entry);
                }
            }
            Event::Delete(node) => {
                let name = node.metadata.name.clone().unwrap_or_default();
                if let Some(old) = g.by_name.remove(&name) {
                    g.by_instance.remove(&old);
                }
            }
        }
    }

    /// Keeps the index in step with the API server until `shutdown`: one watch of every Node,
    /// retried with kube's jittered backoff. Every error is counted and logged, never fatal.
    pub async fn watch(
        &self,
        client: kube::Client,
        metrics: QueueMetrics,
        shutdown: CancellationToken,
    ) {
        let api: kube::Api<Node> = kube::Api::all(client);
        let stream = watcher::watcher(api, watcher::Config::default()).default_backoff();
        futures::pin_mut!(stream);
        loop {
            let next = tokio::select! {
                () = shutdown.cancelled() => return,
                n = stream.next() => n,
            };
            match next {
                Some(Ok(event)) => {
                    self.apply(event);
                    metrics
                        .nodes
                        .set(i64::try_from(self.len()).unwrap_or(i64::MAX));
                }
                Some(Err(e)) => {
                    metrics.error("watch_nodes", "error");
                    tracing::warn!(message = "the Node watch failed; retrying with backoff", error = %e);
                }
                None => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::NodeSpec;
    use kube::api::ObjectMeta;

    fn node(name: &str, provider_id: Option<&str>, rv: &str) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                resource_version: Some(rv.into()),
                ..Default::default()
            },
            spec: Some(NodeSpec {
                provider_id: provider_id.map(String::from),
                ..Default::default()
            }),
            status: None,
        }
    }

    const A: &str = "i-0aaaaaaaaaaaaaaaa";
    const B: &str = "i-0bbbbbbbbbbbbbbbb";

    #[test]
    fn the_index_follows_the_watch_and_knows_when_it_cannot_say() {
        let idx = NodeIndex::default();
        assert_eq!(idx.lookup(A), Lookup::NotReady, "before the first list");
        idx.apply(Event::Init);
        idx.apply(Event::InitApply(node(
            "n1",
            Some(&format!("aws:///us-east-2a/{A}")),
            "1",
        )));
        idx.apply(Event::InitApply(node(
            "n2",
            Some("ip-10-0-0-1.ec2.internal"),
            "2",
        )));
        idx.apply(Event::InitApply(node("n3", None, "3")));
        assert_eq!(idx.lookup(A), Lookup::NotReady, "mid-list");
        idx.apply(Event::InitDone);
        assert!(matches!(idx.lookup(A), Lookup::Found(e) if e.name == "n1"));
        assert_eq!(idx.lookup(B), Lookup::NoNode);
        assert_eq!(idx.len(), 1, "only Nodes with an EC2 providerID");

        // The Node name is reused by a new instance: the old instance has no Node any more.
        idx.apply(Event::Apply(node(
            "n1",
            Some(&format!("aws:///us-east-2b/{B}")),
            "4",
        )));
        assert_eq!(idx.lookup(A), Lookup::NoNode);
        assert!(
            matches!(idx.lookup(B), Lookup::Found(e) if e.name == "n1" && e.resource_version == "4")
        );
        idx.apply(Event::Delete(node("n1", None, "5")));
        assert_eq!(idx.lookup(B), Lookup::NoNode);

        // A relist forgets what is no longer there.
        idx.apply(Event::Apply(node(
            "n1",
            Some(&format!("aws:///us-east-2a/{A}")),
            "6",
        )));
        idx.apply(Event::Init);
        idx.apply(Event::InitDone);
        assert_eq!(idx.lookup(A), Lookup::NoNode);
    }
}
