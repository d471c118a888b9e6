//! `lastcall-agent --cleanup-cooperation`: removes lastcall's autoscaler-cooperation keys
//! from every game-server pod in the cluster, restoring Agones' own values, exactly as
//! `off` does on one node. For uninstalling (the chart runs it as a pre-delete hook) or
//! turning the feature off while agents are down: what lastcall wrote protects matches, so
//! leaving it is safe, but it would also keep autoscalers off idle servers that once ran one.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams};
use tracing::{info, warn};

use super::{ANN_MANAGED, Mode, desired};
use crate::keys;
use crate::observed::{GameServerView, GsState, PodView, gameserver_resource};

/// What a cleanup did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// Pods whose cooperation keys were removed.
    pub cleaned: usize,
    /// Pods whose patch failed (logged); the run reports failure.
    pub failed: usize,
}

/// One cluster-wide LIST of game-server pods, then one merge patch per pod that carries
/// `lastcall.dev/managed-annotations`. A pod whose GameServer is gone gets Agones' `Never`
/// value back (`safe-to-evict: "false"`), the most protective.
pub async fn run(client: kube::Client) -> Result<Summary, kube::Error> {
    let pods: Api<Pod> = Api::all(client.clone());
    let lp = ListParams::default().labels(&format!("{}=gameserver", keys::AGONES_ROLE));
    let mut summary = Summary::default();
    for pod in pods.list(&lp).await?.items {
        let Ok(view) = PodView::from_pod(&pod) else {
            continue;
        };
        if !view.annotations.contains_key(ANN_MANAGED) {
            continue;
        }
        let gs = match &view.gameserver {
            Some(name) => {
                let api: Api<DynamicObject> =
                    Api::namespaced_with(client.clone(), &view.namespace, &gameserver_resource());
                api.get_opt(name)
                    .await?
                    .and_then(|o| GameServerView::from_dynamic(&o).ok())
            }
            None => None,
        };
        let gs = gs.unwrap_or_else(|| gone(&view));
        let changes = desired(&gs, &view, Mode::Off);
        if changes.is_empty() {
            continue;
        }
        let body = serde_json::json!({"metadata": {"annotations": changes}});
        let api: Api<Pod> = Api::namespaced(client.clone(), &view.namespace);
        match api
            .patch(&view.name, &PatchParams::default(), &Patch::Merge(&body))
            .await
        {
            Ok(_) => summary.cleaned += 1,
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => {
                warn!(message = "removing lastcall's cooperation annotations failed", namespace = %view.namespace, pod = %view.name, error = %e);
                summary.failed += 1;
            }
        }
    }
    info!(
        message = "autoscaler cooperation cleaned up",
        pods = summary.cleaned,
        failed = summary.failed
    );
    Ok(summary)
}

/// Stands in for a GameServer that no longer exists: `eviction.safe` Never, no template keys.
fn gone(pod: &PodView) -> GameServerView {
    GameServerView {
        namespace: pod.namespace.clone(),
        name: pod.gameserver.clone().unwrap_or_else(|| pod.name.clone()),
        uid: String::new(),
        resource_version: String::new(),
        state: GsState::Empty,
        deleting: true,
        node_name: None,
        labels: Default::default(),
        annotations: Default::default(),
        eviction_safe: crate::eviction::EvictionSafe::Never,
        template_annotations: Default::default(),
    }
}
