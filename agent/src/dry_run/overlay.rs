//! What a dry run "wrote", laid over what the agent observes, so that the next plan follows
//! as if each write had landed: the fence stands, protected servers carry their deadline,
//! the deregistration is recorded. Without it nothing a dry run "does" shows in what it sees
//! next, and the narration would never get past the fence.
//!
//! Planning only: nothing here is sent, and the policy is the same pure function.
//!
//! What a simulated step means for planning:
//!
//! | step | the overlay |
//! |---|---|
//! | Node patch (fence, record, cancel) | its cordon, taints, labels and annotations on the Node view |
//! | release of a Ready server | the server **and its pod** are treated as gone (the real one is not deleted and stays Ready); if the real one is then allocated (nothing fenced it for real), it comes back and is protected like any match |
//! | protect, exclude, unprotect | the drain label and annotations on the GameServer view |
//! | graceful end of a match | its pod is terminating from then, and gone once its grace period has passed (the kubelet would have killed it) |
//! | pod annotations, compat toleration | on the pod view |
//! | deregistration | `lastcall.dev/deregistered` on the Node view |
//!
//! Matches that end for real (the pod gone, the GameServer `Shutdown` or deleted) are seen as
//! usual. Entries about objects that are gone for real are forgotten, so the overlay stays
//! O(objects on this node).

use std::collections::{BTreeMap, BTreeSet};

use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Taint, Toleration};

use crate::keys;
use crate::observed::{NodeView, Observed};
use crate::policy::{Action, NodePatch, compat_toleration};
use crate::progress::format_ts;

/// `Some(v)` sets, `None` removes.
type Changes = BTreeMap<String, Option<String>>;

#[derive(Debug, Default)]
struct NodeDelta {
    unschedulable: Option<bool>,
    /// By (key, effect).
    taints_added: BTreeMap<(String, String), Taint>,
    taints_removed: BTreeSet<(String, String)>,
    annotations: Changes,
    labels: Changes,
}

#[derive(Debug, Default)]
struct ServerMarks {
    namespace: String,
    name: String,
    labels: Changes,
    annotations: Changes,
}

#[derive(Debug, Default)]
struct PodDelta {
    annotations: Changes,
    tolerations: Vec<Toleration>,
    /// A graceful end the dry run started: when the kubelet would kill the pod.
    killed_at: Option<Timestamp>,
}

/// A server the dry run released: its real object stays, the plan sees it gone.
#[derive(Clone, Debug)]
struct Released {
    namespace: String,
    name: String,
}

/// Something the overlay found while laying itself over the world, for the narration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found {
    /// A server the dry run released was allocated for real (no real fence kept allocators
    /// away): a real run would have deleted it first. It is planned as the match it is now.
    AllocatedAfterRelease { namespace: String, name: String },
    /// A match the dry run ended gracefully is past its grace period: treated as gone.
    EndedMatchGone { namespace: String, pod: String },
}

#[derive(Debug, Default)]
pub struct Overlay {
    node: NodeDelta,
    /// uid → server.
    released: BTreeMap<String, Released>,
    /// uid → the server's simulated drain marks.
    servers: BTreeMap<String, ServerMarks>,
    /// (namespace, pod) → the pod's simulated changes.
    pods: BTreeMap<(String, String), PodDelta>,
}

fn set(map: &mut Changes, k: &str, v: Option<&str>) -> bool {
    let v = v.map(str::to_string);
    map.insert(k.to_string(), v.clone()) != Some(v)
}

fn apply_changes(target: &mut BTreeMap<String, String>, changes: &Changes) {
    for (k, v) in changes {
        match v {
            Some(v) => {
                target.insert(k.clone(), v.clone());
            }
            None => {
                target.remove(k);
            }
        }
    }
}

fn taint_key(t: &Taint) -> (String, String) {
    (t.key.clone(), t.effect.clone())
}

impl Overlay {
    /// Records a step the dry run did not send, as if it had landed. `observed` is the view
    /// it was planned on (already overlaid), `now` the plan's clock. Returns whether planning
    /// sees anything new, so a re-planned step that changes nothing never spins the loop.
    pub fn record(&mut self, action: &Action, observed: &Observed, now: Timestamp) -> bool {
        match action {
            Action::PatchNode(p) => self.patch_node(p, &observed.node),
            Action::Release { gs } => self
                .released
                .insert(
                    gs.uid.clone(),
                    Released {
                        namespace: gs.namespace.clone(),
                        name: gs.name.clone(),
                    },
                )
                .is_none(),
            Action::Protect {
                gs,
                deadline,
                reason,
            } => {
                let m = self.marks(&gs.uid, &gs.namespace, &gs.name);
                let a = set(&mut m.labels, keys::LABEL_NODE_DRAINING, Some("true"));
                let b = set(
                    &mut m.annotations,
                    keys::ANN_GS_DEADLINE,
                    Some(deadline.as_str()),
                );
                let c = set(
                    &mut m.annotations,
                    keys::ANN_GS_REASON,
                    Some(reason.as_str()),
                );
                a | b | c
            }
            Action::Exclude { gs } => {
                let m = self.marks(&gs.uid, &gs.namespace, &gs.name);
                set(&mut m.labels, keys::LABEL_NODE_DRAINING, Some("true"))
            }
            Action::Unprotect { gs } => {
                let m = self.marks(&gs.uid, &gs.namespace, &gs.name);
                let a = set(&mut m.labels, keys::LABEL_NODE_DRAINING, None);
                let b = set(&mut m.annotations, keys::ANN_GS_DEADLINE, None);
                let c = set(&mut m.annotations, keys::ANN_GS_REASON, None);
                a | b | c
            }
            Action::AnnotatePod {
                namespace,
                pod,
                changes,
            } => {
                let d = self.pod(namespace, pod);
                let mut changed = false;
                for (k, v) in changes {
                    changed |= set(&mut d.annotations, k, v.as_deref());
                }
                changed
            }
            Action::Tolerate { namespace, pod, .. } => {
                let t = compat_toleration();
                let d = self.pod(namespace, pod);
                if d.tolerations.contains(&t) {
                    return false;
                }
                d.tolerations.push(t);
                true
            }
            Action::EndGracefully { namespace, pod, .. } => {
                let grace = observed.termination_grace(namespace, pod);
                let kill_at = jiff::SignedDuration::try_from(grace)
                    .ok()
                    .and_then(|g| now.checked_add(g).ok())
                    .unwrap_or(Timestamp::MAX);
                let d = self.pod(namespace, pod);
                if d.killed_at.is_some() {
                    return false;
                }
                d.killed_at = Some(kill_at);
                true
            }
            Action::Deregister => set(
                &mut self.node.annotations,
                keys::ANN_DEREGISTERED,
                Some(format_ts(now).as_str()),
            ),
            // A read in a dry run (see `Actuator::claim_gameserver`).
            Action::ClaimGameServer { .. } => false,
        }
    }

    fn marks(&mut self, uid: &str, namespace: &str, name: &str) -> &mut ServerMarks {
        self.servers
            .entry(uid.to_string())
            .or_insert_with(|| ServerMarks {
                namespace: namespace.to_string(),
                name: name.to_string(),
                ..ServerMarks::default()
            })
    }

    fn pod(&mut self, namespace: &str, pod: &str) -> &mut PodDelta {
        self.pods
            .entry((namespace.to_string(), pod.to_string()))
            .or_default()
    }

    fn patch_node(&mut self, p: &NodePatch, node: &NodeView) -> bool {
        let before = self.lay_node(node.clone());
        let d = &mut self.node;
        if let Some(u) = p.unschedulable {
            d.unschedulable = Some(u);
        }
        if let Some(taints) = &p.taints {
            let new: BTreeSet<(String, String)> = taints.iter().map(taint_key).collect();
            for t in &before.taints {
                let k = taint_key(t);
                if !new.contains(&k) {
                    d.taints_added.remove(&k);
                    d.taints_removed.insert(k);
                }
            }
            let old: BTreeSet<(String, String)> = before.taints.iter().map(taint_key).collect();
            for t in taints {
                let k = taint_key(t);
                if !old.contains(&k) {
                    d.taints_removed.remove(&k);
                    d.taints_added.insert(k, t.clone());
                }
            }
        }
        for (k, v) in &p.set_annotations {
            d.annotations.insert(k.clone(), Some(v.clone()));
        }
        for k in &p.remove_annotations {
            d.annotations.insert(k.clone(), None);
        }
        for (k, v) in &p.set_labels {
            d.labels.insert(k.clone(), Some(v.clone()));
        }
        for k in &p.remove_labels {
            d.labels.insert(k.clone(), None);
        }
        self.lay_node(node.clone()) != before
    }

    fn lay_node(&self, mut node: NodeView) -> NodeView {
        let d = &self.node;
        if let Some(u) = d.unschedulable {
            node.unschedulable = u;
        }
        node.taints
            .retain(|t| !d.taints_removed.contains(&taint_key(t)));
        for (k, t) in &d.taints_added {
            if !node.taints.iter().any(|x| &taint_key(x) == k) {
                node.taints.push(t.clone());
            }
        }
        apply_changes(&mut node.annotations, &d.annotations);
        apply_changes(&mut node.labels, &d.labels);
        node
    }

    /// Lays the simulated writes over `observed`, as of `now`. Also forgets what is gone
    /// for real, and tells what the narration should hear about.
    pub fn lay_over(&mut self, observed: &mut Observed, now: Timestamp) -> Vec<Found> {
        let mut found = vec![];
        observed.node = self.lay_node(observed.node.clone());

        // Released servers allocated for real come back; the rest are gone, with their pods.
        let mut hidden: BTreeSet<(String, String)> = BTreeSet::new();
        for gs in &observed.game_servers {
            if let Some(r) = self.released.get(&gs.uid) {
                if gs.state.is_in_use() {
                    found.push(Found::AllocatedAfterRelease {
                        namespace: r.namespace.clone(),
                        name: r.name.clone(),
                    });
                    self.released.remove(&gs.uid);
                } else {
                    hidden.insert((r.namespace.clone(), r.name.clone()));
                }
            }
        }
        // The pod of a released server hides with it (even while its GameServer is unseen).
        for r in self.released.values() {
            hidden.insert((r.namespace.clone(), r.name.clone()));
        }
        // Matches the dry run ended, past their grace: gone too.
        for p in &mut observed.pods {
            if let Some(kill_at) = self
                .pods
                .get(&(p.namespace.clone(), p.name.clone()))
                .and_then(|d| d.killed_at)
            {
                if kill_at <= now {
                    if let Some(gs) = &p.gameserver
                        && hidden.insert((p.namespace.clone(), gs.clone()))
                    {
                        found.push(Found::EndedMatchGone {
                            namespace: p.namespace.clone(),
                            pod: p.name.clone(),
                        });
                    }
                } else {
                    p.deleting = true;
                    p.deletion_timestamp = Some(kill_at);
                }
            }
        }
        // Forget what is gone for real: a released or marked server whose GameServer and pod
        // have both left. (A GameServer can be briefly unseen in a dry run, between reads of
        // it: its pod keeps the entry.)
        let present: BTreeSet<(String, String)> = observed
            .game_servers
            .iter()
            .map(|g| (g.namespace.clone(), g.name.clone()))
            .chain(
                observed
                    .pods
                    .iter()
                    .filter_map(|p| Some((p.namespace.clone(), p.gameserver.clone()?))),
            )
            .collect();
        let pods_present: BTreeSet<(String, String)> = observed
            .pods
            .iter()
            .map(|p| (p.namespace.clone(), p.name.clone()))
            .collect();
        self.released
            .retain(|_, r| present.contains(&(r.namespace.clone(), r.name.clone())));
        self.servers
            .retain(|_, m| present.contains(&(m.namespace.clone(), m.name.clone())));
        self.pods.retain(|k, _| pods_present.contains(k));

        observed
            .game_servers
            .retain(|g| !hidden.contains(&(g.namespace.clone(), g.name.clone())));
        observed.pods.retain(|p| {
            p.gameserver
                .as_ref()
                .is_none_or(|g| !hidden.contains(&(p.namespace.clone(), g.clone())))
        });
        for gs in &mut observed.game_servers {
            if let Some(m) = self.servers.get(&gs.uid) {
                apply_changes(&mut gs.labels, &m.labels);
                apply_changes(&mut gs.annotations, &m.annotations);
            }
        }
        for p in &mut observed.pods {
            if let Some(d) = self.pods.get(&(p.namespace.clone(), p.name.clone())) {
                apply_changes(&mut p.annotations, &d.annotations);
                for t in &d.tolerations {
                    if !p.tolerations.contains(t) {
                        p.tolerations.push(t.clone());
                    }
                }
            }
        }
        found
    }

    /// When the overlay itself next changes what planning sees without any event: the
    /// earliest kill, after `now`, of a match the dry run ended.
    pub fn wake_at(&self, now: Timestamp) -> Option<Timestamp> {
        self.pods
            .values()
            .filter_map(|d| d.killed_at)
            .filter(|t| *t > now)
            .min()
    }
}

#[cfg(test)]
mod tests;
