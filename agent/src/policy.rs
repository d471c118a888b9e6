//! The rules of the drain, as one pure function.
//!
//! `plan(inputs)` reads notices, the observed node, its game servers and pods, and the
//! progress stored on the Node, and returns the ordered actions that move the world toward
//! the desired state. No I/O, no clock, no randomness: `now` is an input. Running it again on
//! the state its own actions produced yields no actions (idempotence), which the tests check.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Taint, Toleration};

use crate::keys;
use crate::notice::{Cause, Notice, Severity, Source};
use crate::observed::{GameServerView, GsState, Observed};
use crate::progress::{Progress, format_ts};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyConfig {
    /// Reproduce the original adapter's NoExecute taints and toleration.
    pub compat_taints: bool,
    /// FleetIQ is in use: deregister the game server once the node is empty.
    pub deregister: bool,
    /// Deadline announced to protected game servers when the notice has none.
    pub default_deadline: Duration,
}

pub struct Inputs<'a> {
    pub notices: &'a [Notice],
    /// Sources that are configured but have not reported a first view yet (just started,
    /// or never reachable). Unknown is not "all clear": a drain they may have started is
    /// held, not cancelled.
    pub unknown_sources: &'a [Source],
    pub observed: &'a Observed,
    pub config: &'a PolicyConfig,
    pub now: Timestamp,
}

/// Where the node is in its drain. Also the `phase` metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    Idle,
    Fencing,
    Draining,
    Empty,
    Deregistered,
    Cancelling,
}

impl Phase {
    pub const ALL: [Phase; 6] = [
        Self::Idle,
        Self::Fencing,
        Self::Draining,
        Self::Empty,
        Self::Deregistered,
        Self::Cancelling,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Idle => "idle",
            Self::Fencing => "fencing",
            Self::Draining => "draining",
            Self::Empty => "empty",
            Self::Deregistered => "deregistered",
            Self::Cancelling => "cancelling",
        }
    }
}

/// Identity of a GameServer as observed; deletes are preconditioned on it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GsRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub resource_version: String,
}

impl GsRef {
    fn of(gs: &GameServerView) -> Self {
        Self {
            namespace: gs.namespace.clone(),
            name: gs.name.clone(),
            uid: gs.uid.clone(),
            resource_version: gs.resource_version.clone(),
        }
    }
}

/// One guarded write to the Node: applied only if the Node still has `resource_version`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodePatch {
    pub resource_version: String,
    pub unschedulable: Option<bool>,
    /// The complete new taint list (foreign taints included), when it changes.
    pub taints: Option<Vec<Taint>>,
    pub set_annotations: BTreeMap<String, String>,
    pub remove_annotations: BTreeSet<String>,
}

impl NodePatch {
    fn is_empty(&self) -> bool {
        self.unschedulable.is_none()
            && self.taints.is_none()
            && self.set_annotations.is_empty()
            && self.remove_annotations.is_empty()
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Cordon/uncordon, taints and progress, in one conflict-checked write.
    PatchNode(NodePatch),
    /// Put `lastcall.dev/node=<node>` on a GameServer whose pod runs here, so the agent's
    /// label-filtered watch sees it.
    ClaimGameServer { namespace: String, name: String },
    /// Add (`true`) or remove the `lastcall.dev/node-draining` label.
    MarkDraining { gs: GsRef, draining: bool },
    /// Delete a Ready GameServer, preconditioned on uid and resourceVersion.
    Release { gs: GsRef },
    /// Annotate an in-use GameServer with the drain deadline and reason.
    Protect {
        gs: GsRef,
        deadline: String,
        reason: String,
    },
    /// Remove lastcall's drain label and annotations from a GameServer.
    Unprotect { gs: GsRef },
    /// Compat mode: add the original draining toleration to an in-use GameServer's pod.
    Tolerate {
        namespace: String,
        pod: String,
        resource_version: String,
    },
    /// FleetIQ `DeregisterGameServer`, then record it on the Node. Once per node.
    Deregister,
}

impl Action {
    /// Fixed label for the actions metric.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::PatchNode(_) => "patch_node",
            Self::ClaimGameServer { .. } => "claim_gameserver",
            Self::MarkDraining { .. } => "mark_draining",
            Self::Release { .. } => "release",
            Self::Protect { .. } => "protect",
            Self::Unprotect { .. } => "unprotect",
            Self::Tolerate { .. } => "tolerate",
            Self::Deregister => "deregister",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub phase: Phase,
    /// Applied in order; the reconciler stops at the first failure, so nothing later (a
    /// release, a deregistration) runs before what must precede it (the fence).
    pub actions: Vec<Action>,
    /// The notice driving the drain, if any.
    pub driver: Option<Notice>,
}

/// The original adapter's toleration, added to in-use pods in compat mode.
pub fn compat_toleration() -> Toleration {
    Toleration {
        key: Some(keys::COMPAT_TAINT_DRAINING.to_string()),
        operator: Some("Equal".to_string()),
        value: Some("true".to_string()),
        effect: Some("NoExecute".to_string()),
        toleration_seconds: None,
    }
}

fn taint(key: &str, value: &str, effect: &str) -> Taint {
    Taint {
        key: key.to_string(),
        value: Some(value.to_string()),
        effect: effect.to_string(),
        time_added: None,
    }
}

/// The operator's manual drain label, as a notice.
pub fn manual_notice(observed: &Observed) -> Option<Notice> {
    let v = observed.node.labels.get(keys::LABEL_MANUAL_DRAIN)?;
    (v == "true").then(|| Notice {
        source: Source::Manual,
        id: format!("label:{}", keys::LABEL_MANUAL_DRAIN),
        cause: Cause::Manual,
        severity: Severity::Drain,
        deadline: None,
        cancellable: true,
        detail: format!("node label {}=true", keys::LABEL_MANUAL_DRAIN),
    })
}

pub fn plan(inp: &Inputs<'_>) -> Plan {
    let obs = inp.observed;
    let progress = Progress::from_annotations(&obs.node.annotations);
    let mut notices: Vec<Notice> = inp.notices.to_vec();
    notices.extend(manual_notice(obs));
    let driver = Notice::strongest(&notices).cloned();

    let mut actions = claim_unlabelled(obs);
    // A game-server pod whose GameServer we cannot see yet may host a match: until it is
    // claimed and seen, the node is not empty and nothing may be tainted NoExecute.
    let unseen_servers = actions.len();
    let phase = if progress.deregistered.is_some() {
        // Deregistration is final: the instance is leaving. Keep the fence up and stop.
        if let Some(p) = fence_patch(inp, &progress, driver.as_ref()) {
            actions.push(Action::PatchNode(p));
        }
        Phase::Deregistered
    } else if let Some(n) = &driver {
        drain(inp, &progress, n, unseen_servers, &mut actions)
    } else if progress.started.is_some()
        && progress.cause != Some(Cause::Manual)
        && !inp.unknown_sources.is_empty()
    {
        // A restarted agent has not heard from FleetIQ yet: keep the drain exactly as it is.
        Phase::Draining
    } else if progress.started.is_some() {
        cancel(inp, &progress, &mut actions);
        Phase::Cancelling
    } else {
        idle(inp, &progress, &mut actions);
        if actions
            .iter()
            .any(|a| matches!(a, Action::Unprotect { .. } | Action::PatchNode(_)))
        {
            Phase::Cancelling
        } else {
            Phase::Idle
        }
    };
    Plan {
        phase,
        actions,
        driver,
    }
}

/// GameServer pods on this node whose GameServer the label-filtered watch cannot see yet.
fn claim_unlabelled(obs: &Observed) -> Vec<Action> {
    let seen: BTreeSet<(&str, &str)> = obs
        .game_servers
        .iter()
        .map(|g| (g.namespace.as_str(), g.name.as_str()))
        .collect();
    let mut out = vec![];
    for pod in &obs.pods {
        if let Some(gs) = &pod.gameserver
            && !pod.deleting
            && !seen.contains(&(pod.namespace.as_str(), gs.as_str()))
        {
            out.push(Action::ClaimGameServer {
                namespace: pod.namespace.clone(),
                name: gs.clone(),
            });
        }
    }
    out
}

/// The node-level fence: cordon, our taint, progress annotations. `None` when already there.
fn fence_patch(
    inp: &Inputs<'_>,
    progress: &Progress,
    driver: Option<&Notice>,
) -> Option<NodePatch> {
    let node = &inp.observed.node;
    let mut patch = NodePatch {
        resource_version: node.resource_version.clone(),
        ..Default::default()
    };
    if !node.unschedulable {
        patch.unschedulable = Some(true);
        if !progress.cordoned_by_us {
            patch
                .set_annotations
                .insert(keys::ANN_CORDONED.into(), "true".into());
        }
    }
    if !node.has_taint(keys::TAINT_DRAINING) {
        let source = driver.map_or("lastcall", |d| d.source.as_str());
        let mut taints = node.taints.clone();
        taints.push(taint(keys::TAINT_DRAINING, source, "NoSchedule"));
        patch.taints = Some(taints);
    }
    if progress.started.is_none() && progress.deregistered.is_none() {
        patch
            .set_annotations
            .insert(keys::ANN_STARTED.into(), format_ts(inp.now));
    }
    if let Some(d) = driver
        && progress.cause != Some(d.cause)
        && progress.deregistered.is_none()
    {
        patch
            .set_annotations
            .insert(keys::ANN_CAUSE.into(), d.cause.as_str().into());
    }
    (!patch.is_empty()).then_some(patch)
}

fn drain(
    inp: &Inputs<'_>,
    progress: &Progress,
    driver: &Notice,
    unseen_servers: usize,
    actions: &mut Vec<Action>,
) -> Phase {
    let obs = inp.observed;
    let fence = fence_patch(inp, progress, Some(driver));
    let fencing = fence.is_some();
    if let Some(p) = fence {
        actions.push(Action::PatchNode(p));
    }

    let started = progress
        .started
        .filter(|t| *t > Timestamp::UNIX_EPOCH)
        .unwrap_or(inp.now);
    let deadline = driver.deadline.unwrap_or_else(|| {
        started
            .checked_add(
                jiff::SignedDuration::try_from(inp.config.default_deadline).unwrap_or_default(),
            )
            .unwrap_or(started)
    });
    let deadline_s = format_ts(deadline);
    let reason = driver.cause.as_str().to_string();

    let mut busy = unseen_servers > 0;
    let mut all_in_use_tolerate = unseen_servers == 0;
    // Releases go right after the fence, in one concurrent batch; marking and protecting
    // in-use servers follows. That keeps the fence-to-released time to about two round trips.
    let mut releases = vec![];
    let mut in_use = vec![];
    let pods: BTreeMap<(&str, &str), &crate::observed::PodView> = obs
        .pods
        .iter()
        .map(|p| ((p.namespace.as_str(), p.name.as_str()), p))
        .collect();
    for gs in &obs.game_servers {
        if gs.deleting
            || matches!(
                gs.state,
                GsState::Shutdown | GsState::Error | GsState::Unhealthy
            )
        {
            continue;
        }
        let r = GsRef::of(gs);
        // A Ready server is released as it is: labelling it first would change its
        // resourceVersion and make our own preconditioned delete fail.
        if gs.state != GsState::Ready
            && gs.labels.get(keys::LABEL_NODE_DRAINING).map(String::as_str) != Some("true")
        {
            in_use.push(Action::MarkDraining {
                gs: r.clone(),
                draining: true,
            });
        }
        if gs.state == GsState::Ready {
            busy = true;
            releases.push(Action::Release { gs: r });
        } else if gs.state.is_in_use() {
            busy = true;
            if gs.annotations.get(keys::ANN_GS_DEADLINE) != Some(&deadline_s)
                || gs.annotations.get(keys::ANN_GS_REASON) != Some(&reason)
            {
                in_use.push(Action::Protect {
                    gs: r,
                    deadline: deadline_s.clone(),
                    reason: reason.clone(),
                });
            }
            if inp.config.compat_taints {
                match pods.get(&(gs.namespace.as_str(), gs.name.as_str())) {
                    Some(pod) if !pod.tolerations.contains(&compat_toleration()) => {
                        all_in_use_tolerate = false;
                        in_use.push(Action::Tolerate {
                            namespace: pod.namespace.clone(),
                            pod: pod.name.clone(),
                            resource_version: pod.resource_version.clone(),
                        });
                    }
                    Some(_) => {}
                    // Pod not seen yet: do not taint until we can tolerate it.
                    None => all_in_use_tolerate = false,
                }
            }
        } else if gs.state.is_before_ready() {
            // Cordoned, so it started before the fence; it is released once Ready.
            busy = true;
        }
    }
    actions.extend(releases);
    actions.extend(in_use);

    if inp.config.compat_taints
        && !fencing
        && all_in_use_tolerate
        && !obs
            .game_servers
            .iter()
            .any(|g| !g.deleting && (g.state == GsState::Ready || g.state.is_before_ready()))
        && !obs.node.has_taint(keys::COMPAT_TAINT_DRAINING)
    {
        // Last, as the original did: every in-use pod tolerates it and no Ready server is
        // left for the taint manager to kill outside the race-safe delete.
        let mut taints = obs.node.taints.clone();
        taints.push(taint(keys::COMPAT_TAINT_DRAINING, "true", "NoExecute"));
        actions.push(Action::PatchNode(NodePatch {
            resource_version: obs.node.resource_version.clone(),
            taints: Some(taints),
            ..Default::default()
        }));
    }

    if fencing {
        Phase::Fencing
    } else if busy {
        Phase::Draining
    } else if inp.config.deregister {
        actions.push(Action::Deregister);
        Phase::Empty
    } else {
        Phase::Empty
    }
}

/// Undo exactly what lastcall did: our taints, our labels and annotations, and the cordon
/// only if we made it.
fn cancel(inp: &Inputs<'_>, progress: &Progress, actions: &mut Vec<Action>) {
    unprotect_all(inp.observed, actions);
    let node = &inp.observed.node;
    let mut patch = NodePatch {
        resource_version: node.resource_version.clone(),
        ..Default::default()
    };
    let ours = |t: &Taint| t.key == keys::TAINT_DRAINING || t.key == keys::COMPAT_TAINT_DRAINING;
    if node.taints.iter().any(ours) {
        patch.taints = Some(node.taints.iter().filter(|t| !ours(t)).cloned().collect());
    }
    if progress.cordoned_by_us && node.unschedulable {
        patch.unschedulable = Some(false);
    }
    for k in [keys::ANN_STARTED, keys::ANN_CAUSE, keys::ANN_CORDONED] {
        if node.annotations.contains_key(k) {
            patch.remove_annotations.insert(k.to_string());
        }
    }
    if !patch.is_empty() {
        actions.push(Action::PatchNode(patch));
    }
}

/// Not draining: clear leftovers of an interrupted cancel; in compat mode keep the original's
/// `active` taint on a registered node.
fn idle(inp: &Inputs<'_>, progress: &Progress, actions: &mut Vec<Action>) {
    unprotect_all(inp.observed, actions);
    let node = &inp.observed.node;
    if node.has_taint(keys::TAINT_DRAINING) {
        cancel(inp, progress, actions);
        return;
    }
    if inp.config.compat_taints
        && progress.registered.is_some()
        && !node.has_taint(keys::COMPAT_TAINT_ACTIVE)
    {
        let mut taints = node.taints.clone();
        taints.push(taint(keys::COMPAT_TAINT_ACTIVE, "true", "NoExecute"));
        actions.push(Action::PatchNode(NodePatch {
            resource_version: node.resource_version.clone(),
            taints: Some(taints),
            ..Default::default()
        }));
    }
}

fn unprotect_all(obs: &Observed, actions: &mut Vec<Action>) {
    for gs in &obs.game_servers {
        if gs.deleting {
            continue;
        }
        let marked = gs.labels.contains_key(keys::LABEL_NODE_DRAINING)
            || gs.annotations.contains_key(keys::ANN_GS_DEADLINE)
            || gs.annotations.contains_key(keys::ANN_GS_REASON);
        if marked {
            actions.push(Action::Unprotect { gs: GsRef::of(gs) });
        }
    }
}

#[cfg(test)]
mod tests;
