//! Every write lastcall makes to the outside world, in one place.
//!
//! Node writes are JSON patches whose first op tests `metadata.resourceVersion`, so a
//! concurrent writer's taint is never lost: a failed test comes back as `Conflict` and the
//! reconciler re-plans on fresh state. GameServer label and annotation writes are merge
//! patches that touch only lastcall's own keys. In dry-run mode every mutating call is
//! logged, counted and recorded instead of sent — the same code path up to the wire.

use k8s_openapi::api::core::v1::{Node, ObjectReference, Pod};
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, Preconditions};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use serde_json::{Value, json};
use tracing::warn;

use crate::dry_run::DryRun;
use crate::fleetiq::gamelift::GameLiftError;
use crate::fleetiq::integration::FleetIq;
use crate::keys;
use crate::metrics::{Metrics, ResultLabel};
use crate::observed::gameserver_resource;
use crate::policy::{GsRef, NodePatch, compat_toleration};
use crate::progress::format_ts;

#[derive(Debug, thiserror::Error)]
pub enum ActError {
    /// The object changed since we read it; re-plan on fresh state.
    #[error("conflict: {0}")]
    Conflict(String),
    #[error("kubernetes: {0}")]
    Kube(#[from] kube::Error),
    #[error("gamelift: {0}")]
    GameLift(#[from] GameLiftError),
    #[error("invalid patch: {0}")]
    Invalid(String),
    /// FleetIQ is configured but the instance id is not known yet.
    #[error("FleetIQ is not ready yet (instance id unknown)")]
    NotReady,
}

impl ActError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Conflict(_) => "conflict",
            Self::Kube(_) => "kube_error",
            Self::GameLift(_) => "gamelift_error",
            Self::Invalid(_) => "invalid",
            Self::NotReady => "not_ready",
        }
    }
}

/// Result of a release: label (optionally), then a preconditioned GameServer delete.
#[derive(Debug, PartialEq, Eq)]
pub enum Release {
    Deleted,
    /// The server changed under us (an allocation got there first): the newer version is
    /// in `ReleaseOutcome::newest`, so the next plan protects it or releases that version.
    Conflict,
    Gone,
}

/// A release's result, plus the newest version of the object we learned on the way (the
/// label write's answer, or a re-read after a 409), for read-your-writes.
pub struct ReleaseOutcome {
    pub result: Result<Release, ActError>,
    pub newest: Option<DynamicObject>,
}

#[derive(Clone)]
pub struct Actuator {
    client: kube::Client,
    node_name: String,
    dry_run: DryRun,
    /// The FleetIQ integration: the GameLift client and the deregistered state live there.
    fleetiq: FleetIq,
    metrics: Metrics,
    /// Events go to a background publisher so they never delay a fence or a release.
    events: tokio::sync::mpsc::Sender<(ObjectReference, Event)>,
}

/// Tries of an Event the API server refused with 429 (each after its Retry-After, which the
/// client's throttle waits out before the next request leaves).
const EVENT_TRIES: usize = 3;

/// Publishes queued Events one by one; the queue is bounded so a slow API cannot grow it. An
/// Event refused by API Priority and Fairness is sent again, not lost: a throttled drain is
/// the one an operator most wants to read.
fn spawn_event_publisher(
    recorder: Recorder,
    metrics: Metrics,
) -> tokio::sync::mpsc::Sender<(ObjectReference, Event)> {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<(ObjectReference, Event)>(256);
    tokio::spawn(async move {
        while let Some((target, ev)) = rx.recv().await {
            let mut tries = 0;
            let result = loop {
                tries += 1;
                match recorder.publish(&ev, &target).await {
                    Ok(()) => break "ok",
                    Err(kube::Error::Api(s)) if s.code == 429 && tries < EVENT_TRIES => {}
                    Err(e) => {
                        warn!(message = "publishing a Kubernetes Event failed", reason = %ev.reason, tries, error = %e);
                        break "error";
                    }
                }
            };
            metrics.events.get_or_create(&ResultLabel { result }).inc();
        }
    });
    tx
}

/// Only 409 means "changed under us, re-plan". A 422 (a validation or admission policy
/// denial) would fail the same way again: it is an error, retried with backoff.
fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

fn api_code(e: &ActError) -> Option<u16> {
    match e {
        ActError::Kube(kube::Error::Api(s)) => Some(s.code),
        _ => None,
    }
}

fn pointer_escape(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

impl Actuator {
    pub fn new(client: kube::Client, node_name: String, dry_run: bool, metrics: Metrics) -> Self {
        let dry_run = DryRun::new(dry_run, metrics.clone());
        let reporter = Reporter {
            controller: "lastcall-agent".into(),
            instance: Some(node_name.clone()),
        };
        Self {
            events: spawn_event_publisher(Recorder::new(client.clone(), reporter), metrics.clone()),
            client,
            node_name,
            fleetiq: FleetIq::new(dry_run.clone(), metrics.clone()),
            dry_run,
            metrics,
        }
    }

    /// The agent's metrics, for a step taken outside the reconciler (the exit).
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub fn client(&self) -> kube::Client {
        self.client.clone()
    }

    /// The FleetIQ integration (its client is set once the instance id is known).
    pub fn fleetiq(&self) -> &FleetIq {
        &self.fleetiq
    }

    pub fn is_dry_run(&self) -> bool {
        self.dry_run.enabled()
    }

    /// What dry-run mode would have sent, in order.
    pub fn recorded(&self) -> Vec<String> {
        self.dry_run.recorded()
    }

    fn skip(&self, kind: &'static str, what: String) -> bool {
        self.dry_run.skip(kind, what)
    }

    fn nodes(&self) -> Api<Node> {
        Api::all(self.client.clone())
    }

    fn gameservers(&self, ns: &str) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), ns, &gameserver_resource())
    }

    /// The JSON patch for a node change, guarded by a resourceVersion test.
    pub fn node_patch_ops(p: &NodePatch, has_annotations: bool) -> Value {
        Self::node_patch_ops_with(p, has_annotations, true)
    }

    /// As `node_patch_ops`, creating the label map first when the Node has none.
    pub fn node_patch_ops_with(p: &NodePatch, has_annotations: bool, has_labels: bool) -> Value {
        let mut ops = vec![
            json!({"op": "test", "path": "/metadata/resourceVersion", "value": p.resource_version}),
        ];
        if let Some(u) = p.unschedulable {
            ops.push(json!({"op": "add", "path": "/spec/unschedulable", "value": u}));
        }
        if let Some(t) = &p.taints {
            ops.push(json!({"op": "add", "path": "/spec/taints", "value": t}));
        }
        if !p.set_annotations.is_empty() && !has_annotations {
            ops.push(json!({"op": "add", "path": "/metadata/annotations", "value": {}}));
        }
        for (k, v) in &p.set_annotations {
            ops.push(json!({"op": "add", "path": format!("/metadata/annotations/{}", pointer_escape(k)), "value": v}));
        }
        if !p.set_labels.is_empty() && !has_labels {
            ops.push(json!({"op": "add", "path": "/metadata/labels", "value": {}}));
        }
        for (k, v) in &p.set_labels {
            ops.push(json!({"op": "add", "path": format!("/metadata/labels/{}", pointer_escape(k)), "value": v}));
        }
        for k in &p.remove_annotations {
            ops.push(json!({"op": "remove", "path": format!("/metadata/annotations/{}", pointer_escape(k))}));
        }
        for k in &p.remove_labels {
            ops.push(
                json!({"op": "remove", "path": format!("/metadata/labels/{}", pointer_escape(k))}),
            );
        }
        Value::Array(ops)
    }

    /// Applies a guarded node patch. `Ok(None)` in dry-run mode.
    pub async fn patch_node(
        &self,
        p: &NodePatch,
        has_annotations: bool,
        has_labels: bool,
    ) -> Result<Option<Node>, ActError> {
        let ops = Self::node_patch_ops_with(p, has_annotations, has_labels);
        if self.skip(
            "patch_node",
            format!("PATCH node/{} {}", self.node_name, ops),
        ) {
            return Ok(None);
        }
        let patch: json_patch::Patch =
            serde_json::from_value(ops).map_err(|e| ActError::Invalid(e.to_string()))?;
        match self
            .nodes()
            .patch(
                &self.node_name,
                &PatchParams::default(),
                &Patch::Json::<()>(patch),
            )
            .await
        {
            Ok(n) => Ok(Some(n)),
            Err(e) if is_conflict(&e) => Err(ActError::Conflict(e.to_string())),
            // A failed `test` op answers 422, like a validation error. If the Node moved on
            // since we read it, it was our resourceVersion guard: re-plan on fresh state at
            // once. Otherwise the write itself is refused: an error, retried with backoff.
            Err(kube::Error::Api(s)) if s.code == 422 => {
                match self.nodes().get(&self.node_name).await {
                    Ok(n)
                        if n.metadata.resource_version.as_deref()
                            != Some(p.resource_version.as_str()) =>
                    {
                        Err(ActError::Conflict(format!(
                            "the Node changed since it was read ({})",
                            s.message
                        )))
                    }
                    _ => Err(kube::Error::Api(s).into()),
                }
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Merges lastcall-owned annotations into the Node (no list involved, so no guard needed).
    pub async fn annotate_node(&self, key: &str, value: &str) -> Result<Option<Node>, ActError> {
        let body = json!({"metadata": {"annotations": {key: value}}});
        if self.skip(
            "annotate_node",
            format!("PATCH node/{} {}", self.node_name, body),
        ) {
            return Ok(None);
        }
        Ok(Some(
            self.nodes()
                .patch(
                    &self.node_name,
                    &PatchParams::default(),
                    &Patch::Merge(&body),
                )
                .await?,
        ))
    }

    async fn merge_gs(
        &self,
        ns: &str,
        name: &str,
        body: Value,
    ) -> Result<Option<DynamicObject>, ActError> {
        if self.skip(
            "patch_gameserver",
            format!("PATCH gameservers/{ns}/{name} {body}"),
        ) {
            return Ok(None);
        }
        Ok(Some(
            self.gameservers(ns)
                .patch(name, &PatchParams::default(), &Patch::Merge(&body))
                .await?,
        ))
    }

    /// Labels a GameServer as this node's, so the label-filtered watch sees it. In dry-run
    /// mode the label cannot be written, so the GameServer is read directly instead.
    pub async fn claim_gameserver(
        &self,
        ns: &str,
        name: &str,
    ) -> Result<Option<DynamicObject>, ActError> {
        if self.is_dry_run() {
            return Ok(self.gameservers(ns).get_opt(name).await?);
        }
        let body = json!({"metadata": {"labels": {keys::LABEL_NODE: keys::node_label_value(&self.node_name)}}});
        match self.merge_gs(ns, name, body).await {
            // Deleted since its pod was seen: nothing to claim.
            Err(ActError::Kube(kube::Error::Api(s))) if s.code == 404 => Ok(None),
            other => other,
        }
    }

    /// The GameServer patches return the object as written (`None` in dry-run mode), so
    /// the reconciler can read its own writes before the watch delivers them.
    pub async fn label_draining(&self, gs: &GsRef) -> Result<Option<DynamicObject>, ActError> {
        let body = json!({"metadata": {"labels": {keys::LABEL_NODE_DRAINING: "true"}}});
        self.merge_gs(&gs.namespace, &gs.name, body).await
    }

    /// Label and annotations of an in-use server, in one write.
    pub async fn protect(
        &self,
        gs: &GsRef,
        deadline: &str,
        reason: &str,
    ) -> Result<Option<DynamicObject>, ActError> {
        let body = json!({"metadata": {
            "labels": {keys::LABEL_NODE_DRAINING: "true"},
            "annotations": {keys::ANN_GS_DEADLINE: deadline, keys::ANN_GS_REASON: reason}
        }});
        self.merge_gs(&gs.namespace, &gs.name, body).await
    }

    pub async fn unprotect(&self, gs: &GsRef) -> Result<Option<DynamicObject>, ActError> {
        let body = json!({"metadata": {
            "labels": {keys::LABEL_NODE_DRAINING: null},
            "annotations": {keys::ANN_GS_DEADLINE: null, keys::ANN_GS_REASON: null}
        }});
        match self.merge_gs(&gs.namespace, &gs.name, body).await {
            // Gone meanwhile: nothing of ours is left on it.
            Err(e) if api_code(&e) == Some(404) => Ok(None),
            other => other,
        }
    }

    /// Releases a server that is not in use: deletes the version we saw, preconditioned on
    /// uid and resourceVersion, so an allocation that wins the race is never deleted. The
    /// delete is the one write on the happy path. When it fails (a 5xx, a timeout), the
    /// server is labelled `lastcall.dev/node-draining` before the retry, so allocators that
    /// exclude the label stop picking it while deletes fail. Not after a 429: the label
    /// would wait out the same `Retry-After` as the retried delete (see `throttle`), so it
    /// could never land before it, and under a mass drain it would be one more write per
    /// refusal to a server that asked for fewer.
    pub async fn release(&self, gs: &GsRef) -> ReleaseOutcome {
        let target = gs.clone();
        let newest = None;
        let result = self.delete_exactly(&target).await;
        match result {
            Ok(Release::Conflict) => {
                // Changed under us, or a 409 with no change behind it? Only a re-read tells.
                match self.gameservers(&gs.namespace).get_opt(&gs.name).await {
                    Ok(None) => ReleaseOutcome {
                        result: Ok(Release::Gone),
                        newest: None,
                    },
                    Ok(Some(obj)) if obj.metadata.uid.as_deref() != Some(gs.uid.as_str()) => {
                        ReleaseOutcome {
                            result: Ok(Release::Gone),
                            newest: None,
                        }
                    }
                    Ok(Some(obj))
                        if obj.metadata.resource_version.as_deref()
                            == Some(target.resource_version.as_str()) =>
                    {
                        ReleaseOutcome {
                            result: Err(ActError::Invalid(
                                "409 on a delete whose preconditions still match; retrying".into(),
                            )),
                            newest,
                        }
                    }
                    // Changed since we saw it: a Starting server that turned Ready (then
                    // allocatable) is labelled now, not a pass later, so exclusion-selector
                    // allocators skip it until the next plan releases or protects it.
                    Ok(Some(obj)) => ReleaseOutcome {
                        result: Ok(Release::Conflict),
                        newest: self.label_after_failed_delete(gs).await.or(Some(obj)),
                    },
                    Err(e) => ReleaseOutcome {
                        result: Err(e.into()),
                        newest,
                    },
                }
            }
            Err(e) if api_code(&e) == Some(429) => ReleaseOutcome {
                result: Err(e),
                newest,
            },
            Err(e) => {
                let newest = self.label_after_failed_delete(gs).await;
                ReleaseOutcome {
                    result: Err(e),
                    newest,
                }
            }
            result => ReleaseOutcome { result, newest },
        }
    }

    /// After a failed delete: the label that keeps exclusion-selector allocators away while
    /// the delete is retried. Its answer is the version the retry deletes. Best effort.
    async fn label_after_failed_delete(&self, gs: &GsRef) -> Option<DynamicObject> {
        match self.label_draining(gs).await {
            Ok(Some(obj)) if obj.metadata.uid.as_deref() == Some(gs.uid.as_str()) => Some(obj),
            Ok(_) => None,
            Err(e) => {
                warn!(message = "labelling a game server whose delete failed also failed", namespace = %gs.namespace, name = %gs.name, error = %e);
                None
            }
        }
    }

    /// Deletes a GameServer only if it is still exactly the object `gs` names.
    async fn delete_exactly(&self, gs: &GsRef) -> Result<Release, ActError> {
        if self.skip(
            "release",
            format!(
                "DELETE gameservers/{}/{} preconditions uid={} resourceVersion={}",
                gs.namespace, gs.name, gs.uid, gs.resource_version
            ),
        ) {
            return Ok(Release::Deleted);
        }
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(gs.uid.clone()),
                resource_version: Some(gs.resource_version.clone()),
            }),
            ..DeleteParams::default()
        };
        match self.gameservers(&gs.namespace).delete(&gs.name, &dp).await {
            Ok(_) => Ok(Release::Deleted),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(Release::Conflict),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(Release::Gone),
            Err(e) => Err(e.into()),
        }
    }

    /// Starts a game-server pod's own graceful termination: a DELETE preconditioned on the
    /// pod's uid, with no grace override, so the game gets SIGTERM and its whole
    /// `terminationGracePeriodSeconds`. Not the Eviction API: at a Terminate deadline the
    /// node goes whatever a disruption budget says, and the planner asks only where
    /// `eviction.safe` or the operator permits ending the match (docs/eviction.md). A DELETE
    /// is also judged by the chart's admission policy on the stored pod alone, where an
    /// Eviction names only its pod and was judged against every pod of its namespace
    /// (docs/scale.md). A 429 is API Priority and Fairness: the throttle holds every request
    /// for its `Retry-After` and the next pass sends the DELETE again. `Ok(false)`: the pod
    /// is gone, or another pod now has its name.
    pub async fn end_gracefully(&self, ns: &str, pod: &str, uid: &str) -> Result<bool, ActError> {
        if self.skip(
            "end_gracefully",
            format!("DELETE pods/{ns}/{pod} preconditions uid={uid}"),
        ) {
            return Ok(true);
        }
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(uid.to_string()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match pods.delete(pod, &dp).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Autoscaler cooperation: one merge patch of a pod's annotations, touching only `changes`
    /// (`None` removes). Returns the patched pod (`None`: gone, or a dry run).
    pub async fn annotate_pod(
        &self,
        ns: &str,
        pod: &str,
        changes: &crate::cooperation::Changes,
    ) -> Result<Option<Pod>, ActError> {
        if self.skip(
            "annotate_pod",
            format!("PATCH pods/{ns}/{pod} annotations {changes:?}"),
        ) {
            return Ok(None);
        }
        let body = json!({"metadata": {"annotations": changes}});
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        match pods
            .patch(pod, &PatchParams::default(), &Patch::Merge(&body))
            .await
        {
            Ok(p) => Ok(Some(p)),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Compat mode: adds the original draining toleration, guarded by the pod's resourceVersion.
    pub async fn tolerate(
        &self,
        ns: &str,
        pod: &str,
        rv: &str,
        has_tolerations: bool,
    ) -> Result<(), ActError> {
        let tol = serde_json::to_value(compat_toleration())
            .map_err(|e| ActError::Invalid(e.to_string()))?;
        let add = if has_tolerations {
            json!({"op": "add", "path": "/spec/tolerations/-", "value": tol})
        } else {
            json!({"op": "add", "path": "/spec/tolerations", "value": [tol]})
        };
        let ops = json!([{"op": "test", "path": "/metadata/resourceVersion", "value": rv}, add]);
        if self.skip("tolerate", format!("PATCH pods/{ns}/{pod} {ops}")) {
            return Ok(());
        }
        let patch: json_patch::Patch =
            serde_json::from_value(ops).map_err(|e| ActError::Invalid(e.to_string()))?;
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        match pods
            .patch(pod, &PatchParams::default(), &Patch::Json::<()>(patch))
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if is_conflict(&e) => Err(ActError::Conflict(e.to_string())),
            Err(e) => Err(e.into()),
        }
    }

    /// Deregisters through the FleetIQ integration (once; it asks GameLift first, so a
    /// restart that cut between an earlier call and its record never sends it twice), then
    /// writes the Node record that makes it once-only across restarts.
    pub async fn deregister(&self) -> Result<Option<Node>, ActError> {
        if self.fleetiq.client().is_none() {
            return Err(ActError::NotReady);
        }
        self.fleetiq.deregister().await?;
        self.annotate_node(keys::ANN_DEREGISTERED, &format_ts(jiff::Timestamp::now()))
            .await
    }

    /// Queues a Kubernetes Event about `target`; failures are counted, never fatal.
    pub async fn event(&self, target: &ObjectReference, reason: &str, note: String, warning: bool) {
        self.queue_event(target, reason, note, warning);
    }

    /// Queues a Kubernetes Event about `target` without waiting for it.
    pub fn queue_event(&self, target: &ObjectReference, reason: &str, note: String, warning: bool) {
        if self.skip(
            "event",
            format!(
                "POST event {reason} on {:?}/{:?}: {note}",
                target.kind, target.name
            ),
        ) {
            return;
        }
        let ev = Event {
            type_: if warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: reason.into(),
            note: Some(note),
            action: reason.into(),
            secondary: None,
        };
        if self.events.try_send((target.clone(), ev)).is_err() {
            warn!(message = "Event queue full; dropping an Event", reason);
            self.metrics
                .events
                .get_or_create(&ResultLabel { result: "dropped" })
                .inc();
        }
    }

    pub fn node_ref(&self) -> ObjectReference {
        ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(self.node_name.clone()),
            ..ObjectReference::default()
        }
    }

    pub fn gs_ref(gs: &GsRef) -> ObjectReference {
        ObjectReference {
            api_version: Some("agones.dev/v1".into()),
            kind: Some("GameServer".into()),
            name: Some(gs.name.clone()),
            namespace: Some(gs.namespace.clone()),
            uid: Some(gs.uid.clone()),
            ..ObjectReference::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Taint;

    #[test]
    fn node_patch_is_guarded_and_escapes_keys() {
        let mut p = NodePatch {
            resource_version: "42".into(),
            unschedulable: Some(true),
            ..Default::default()
        };
        p.taints = Some(vec![Taint {
            key: "a".into(),
            effect: "NoSchedule".into(),
            ..Default::default()
        }]);
        p.set_annotations
            .insert(keys::ANN_STARTED.into(), "t".into());
        p.remove_annotations.insert(keys::ANN_CAUSE.into());
        p.remove_labels
            .insert(keys::LABEL_GKE_PERFORM_MAINTENANCE.into());
        let ops = Actuator::node_patch_ops(&p, false);
        let ops = ops.as_array().unwrap();
        assert_eq!(
            ops[0],
            json!({"op": "test", "path": "/metadata/resourceVersion", "value": "42"})
        );
        assert!(
            ops.iter()
                .any(|o| o["path"] == "/metadata/annotations" && o["op"] == "add")
        );
        assert!(
            ops.iter()
                .any(|o| o["path"] == "/metadata/annotations/lastcall.dev~1drain-started")
        );
        assert!(ops.iter().any(|o| o["op"] == "remove"
            && o["path"] == "/metadata/annotations/lastcall.dev~1drain-cause"));
        assert!(ops.iter().any(|o| o["op"] == "remove"
            && o["path"] == "/metadata/labels/cloud.google.com~1perform-maintenance"));
        // And it is a valid RFC 6902 document.
        let _: json_patch::Patch = serde_json::from_value(Value::Array(ops.clone())).unwrap();
    }
}
