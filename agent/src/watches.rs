//! Server-side filtered watches of exactly this node's objects, cached in reflector stores.
//!
//! Load on the API server is O(objects on this node): the Node by name, pods by
//! `spec.nodeName`, GameServers by `status.nodeName` or the `lastcall.dev/node` label (see
//! [`crate::gameserver_selector`]). No periodic LIST.

use std::fmt::Debug;
use std::sync::{Arc, OnceLock};

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DynamicObject};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{error, warn};

use crate::gameserver_selector::{self, Selection, Selector};
use crate::metrics::{Metrics, SourceLabel};
use crate::observed::gameserver_resource;
use crate::watch_pacing::paced;

#[derive(Clone)]
pub struct Stores {
    pub node: Store<Node>,
    pub pods: Store<Pod>,
    pub gameservers: Store<DynamicObject>,
    /// Changes each time the Node watch delivers an event, after the store has it: what a
    /// source reading the cached Node waits on instead of looking again and again.
    pub node_changes: tokio::sync::watch::Receiver<()>,
    /// How GameServers are selected, once decided (before their store is ready).
    pub selection: Arc<OnceLock<Selection>>,
}

impl Stores {
    /// Waits for every initial list; `false` if a watch task ended first.
    pub async fn ready(&self) -> bool {
        self.node.wait_until_ready().await.is_ok()
            && self.pods.wait_until_ready().await.is_ok()
            && self.gameservers.wait_until_ready().await.is_ok()
    }
}

/// Whether a watch error ends the watch (and with it the process) instead of a retry.
/// [`drive`] returns `true` when one did.
type Fatal = fn(&watcher::Error) -> bool;

async fn drive<S, K>(
    stream: S,
    kind: &'static str,
    fatal: Option<Fatal>,
    trigger: Arc<Notify>,
    metrics: Metrics,
    shutdown: CancellationToken,
) -> bool
where
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    K: Debug + Send + 'static,
{
    let mut stream = std::pin::pin!(stream);
    loop {
        let next = tokio::select! {
            () = shutdown.cancelled() => return false,
            n = stream.next() => n,
        };
        match next {
            Some(Ok(_)) => trigger.notify_one(),
            Some(Err(e)) => {
                metrics
                    .watch_errors
                    .get_or_create(&SourceLabel { source: kind })
                    .inc();
                if fatal.is_some_and(|f| f(&e)) {
                    error!(message = "the GameServer CRD no longer selects by status.nodeName (Agones reinstalled without gameservers.selectableFields?); exiting so the restarted agent selects by label", kind, error = %e);
                    return true;
                }
                warn!(message = "watch error; retrying with backoff", kind, error = %e);
            }
            None => return false,
        }
    }
}

// The caches keep only what `observed` reads: a Node's status (its image list alone can be
// tens of kB), a pod's containers and volumes, a GameServer's pod template and every object's
// managed fields would otherwise be most of the agent's memory, for nothing.

fn slim_node(n: &mut Node) {
    n.metadata.managed_fields = None;
    // The boot id alone: a new one means the machine came back.
    let boot_id = n
        .status
        .take()
        .and_then(|s| s.node_info)
        .map(|i| i.boot_id)
        .filter(|b| !b.is_empty());
    n.status = boot_id.map(|boot_id| k8s_openapi::api::core::v1::NodeStatus {
        node_info: Some(k8s_openapi::api::core::v1::NodeSystemInfo {
            boot_id,
            ..Default::default()
        }),
        ..Default::default()
    });
}

fn slim_pod(p: &mut Pod) {
    p.metadata.managed_fields = None;
    // The phase alone: a Failed or Succeeded pod hosts no match.
    let phase = p.status.take().and_then(|s| s.phase);
    p.status = phase.map(|phase| k8s_openapi::api::core::v1::PodStatus {
        phase: Some(phase),
        ..Default::default()
    });
    if let Some(spec) = p.spec.as_mut() {
        spec.containers = Vec::new();
        spec.init_containers = None;
        spec.ephemeral_containers = None;
        spec.volumes = None;
        spec.affinity = None;
    }
}

fn slim_gameserver(o: &mut DynamicObject) {
    o.metadata.managed_fields = None;
    // The pod template's spec is most of a GameServer; its annotations say which values
    // the user set (never touched by autoscaler cooperation).
    if let Some(template) = o
        .data
        .pointer_mut("/spec/template")
        .and_then(|t| t.as_object_mut())
    {
        template.remove("spec");
    }
}

/// The clients of the watches: `watch` for the long polls, `request` for the one probe of
/// [`gameserver_selector::resolve`].
pub struct Clients {
    pub watch: kube::Client,
    pub request: kube::Client,
}

/// Starts the three watches; every change pokes `trigger`. The GameServer watch starts once
/// `selector` is resolved; its task ends (ending the agent) if `--gameserver-selector field`
/// is refused, or if the field it selects by is withdrawn.
pub fn spawn(
    clients: Clients,
    node_name: &str,
    selector: Selector,
    trigger: Arc<Notify>,
    metrics: Metrics,
    shutdown: CancellationToken,
) -> (Stores, Vec<tokio::task::JoinHandle<&'static str>>) {
    let client = clients.watch;
    let mut handles = Vec::with_capacity(3);
    let (trigger_node, metrics_node, shutdown_node) =
        (trigger.clone(), metrics.clone(), shutdown.clone());
    let node_api: Api<Node> = Api::all(client.clone());
    let (node, w) = reflector::store();
    let s = paced(watcher(
        node_api,
        watcher::Config::default().fields(&format!("metadata.name={node_name}")),
    ))
    .modify(slim_node)
    .reflect(w);
    let (node_changed, node_changes) = tokio::sync::watch::channel(());
    let s = futures::TryStreamExt::inspect_ok(s, move |_| {
        node_changed.send_replace(());
    });
    handles.push(tokio::spawn(async move {
        drive(s, "node", None, trigger_node, metrics_node, shutdown_node).await;
        "node watch"
    }));

    let (trigger_pod, metrics_pod, shutdown_pod) =
        (trigger.clone(), metrics.clone(), shutdown.clone());
    let pod_api: Api<Pod> = Api::all(client.clone());
    let (pods, w) = reflector::store();
    let s = paced(watcher(
        pod_api,
        watcher::Config::default().fields(&format!("spec.nodeName={node_name}")),
    ))
    .modify(slim_pod)
    .reflect(w);
    handles.push(tokio::spawn(async move {
        drive(s, "pod", None, trigger_pod, metrics_pod, shutdown_pod).await;
        "pod watch"
    }));

    let ar = gameserver_resource();
    let gs_api: Api<DynamicObject> = Api::all_with(client, &ar);
    let w = reflector::store::Writer::new(ar);
    let gameservers = w.as_reader();
    let selection = Arc::new(OnceLock::new());
    let decided = selection.clone();
    let node_name = node_name.to_string();
    handles.push(tokio::spawn(async move {
        let chosen = match gameserver_selector::resolve(
            &clients.request,
            &node_name,
            selector,
            &metrics,
            &shutdown,
        )
        .await
        {
            None => return "gameserver watch",
            Some(Ok(s)) => s,
            Some(Err(why)) => {
                error!(message = "cannot select this node's GameServers", error = %why);
                return "gameserver watch: --gameserver-selector field is not served by this API server (see the error before)";
            }
        };
        let _ = decided.set(chosen);
        metrics.gameserver_selection(chosen.as_str());
        let s = paced(watcher(gs_api, chosen.watch_config(&node_name)))
            .modify(slim_gameserver)
            .reflect(w);
        let fatal: Option<Fatal> =
            (chosen == Selection::Field).then_some(gameserver_selector::field_withdrawn);
        if drive(s, "gameserver", fatal, trigger, metrics, shutdown).await {
            "gameserver watch: status.nodeName is no longer a selectable field (see the error before)"
        } else {
            "gameserver watch"
        }
    }));

    (
        Stores {
            node,
            pods,
            gameservers,
            node_changes,
            selection,
        },
        handles,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observed::{GameServerView, PodView};

    #[test]
    fn slimming_keeps_everything_observed_reads() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "default", "resourceVersion": "7",
                "labels": {"agones.dev/role": "gameserver", "agones.dev/gameserver": "gs"},
                "managedFields": [{"manager": "kubelet"}]},
            "spec": {"nodeName": "n1", "terminationGracePeriodSeconds": 90,
                "tolerations": [{"key": "k", "operator": "Exists"}],
                "containers": [{"name": "game", "image": "x"}]},
            "status": {"phase": "Running", "podIP": "10.0.0.1",
                "containerStatuses": [{"name": "game", "image": "x", "imageID": "", "ready": true, "restartCount": 0}]}
        }))
        .expect("pod");
        let mut slim = pod.clone();
        slim_pod(&mut slim);
        assert!(slim.metadata.managed_fields.is_none());
        assert_eq!(
            serde_json::to_value(&slim.status).expect("status"),
            serde_json::json!({"phase": "Running"}),
            "only the phase is kept"
        );
        assert_eq!(
            PodView::from_pod(&slim).expect("view"),
            PodView::from_pod(&pod).expect("view")
        );

        let gs: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "agones.dev/v1", "kind": "GameServer",
            "metadata": {"name": "gs", "namespace": "default", "uid": "u", "resourceVersion": "3",
                "labels": {"lastcall.dev/node": "n1"}, "managedFields": [{"manager": "agones"}]},
            "spec": {"eviction": {"safe": "OnUpgrade"}, "template": {
                "metadata": {"annotations": {"karpenter.sh/do-not-disrupt": "true"}},
                "spec": {"containers": []}}},
            "status": {"state": "Allocated", "nodeName": "n1", "eviction": {"safe": "OnUpgrade"}}
        }))
        .expect("gs");
        let mut slim = gs.clone();
        slim_gameserver(&mut slim);
        assert!(slim.data.pointer("/spec/template/spec").is_none());
        assert_eq!(
            GameServerView::from_dynamic(&slim).expect("view"),
            GameServerView::from_dynamic(&gs).expect("view")
        );
    }
}
