//! The rules of the drain, as one pure function.
//!
//! `plan(inputs)` reads notices, the observed node, its game servers and pods, and the
//! progress stored on the Node, and returns the ordered actions that move the world toward
//! the desired state. No I/O, no clock, no randomness: `now` is an input. Running it again on
//! the state its own actions produced yields no actions (idempotence), which the tests check.
//!
//! One file per step: `fence` (cordon, taint, progress), `game_servers` (release, protect,
//! end gracefully), `pace` (release pacing), `drain` (a drain's last steps once the node is
//! empty), `handoff` (the one gate every hand-off passes), `cancel` and `idle` (undoing a
//! drain), `cooperate` (autoscaler annotations), `deadlines` (what the deadline rule says for
//! this pass). [`plan`] is the only entry.

mod cancel;
mod cooperate;
mod deadlines;
mod drain;
mod fence;
mod game_servers;
mod handoff;
mod idle;
mod pace;
mod returned;
mod taints;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Taint;

use crate::cooperation;
use crate::deadline;
use crate::eviction::EvictionConfig;
use crate::keys;
use crate::notice::{Notice, Source};
use crate::observed::{GameServerView, Observed};
use crate::progress::Progress;

use cancel::{cancel, held};
use cooperate::cooperate;
pub use deadlines::{DeadlineView, deadline_view};
use drain::drain;
use fence::{fence_patch, unseen_servers};
use game_servers::{fenced_work, remove_terminating_from_allocation, warn_unknown_eviction_safe};
pub use handoff::{DEREGISTERED_WHILE_BUSY, hosts_games};
use idle::idle;
pub use returned::MACHINE_RETURNED_HELD;
pub use taints::compat_toleration;
#[cfg(test)]
use taints::{taint, tolerates};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyConfig {
    /// Reproduce the original adapter's NoExecute taints and toleration.
    pub compat_taints: bool,
    /// FleetIQ is in use: deregister the game server once the node is empty.
    pub deregister: bool,
    /// Deadline announced to protected game servers when the notice has none.
    pub default_deadline: Duration,
    /// How long the fence must have stood before an empty node is deregistered.
    pub deregister_settle: Duration,
    /// Ask GKE to start pending maintenance early once the node is empty.
    pub hand_back: bool,
    /// Hard deadlines: also end gracefully the matches whose `eviction.safe` does not permit
    /// it, at `deadline − terminationGracePeriodSeconds` (see `eviction`).
    pub eviction: EvictionConfig,
    /// Autoscaler cooperation by default (a Node label may override it per node pool).
    pub cooperation: cooperation::Mode,
    /// Release pacing per Fleet (off by default).
    pub pacing: Pacing,
    /// GameServers are watched by label: label each one whose pod is seen here before its
    /// server is (see `gameserver_selector`). Off when they are selected by `status.nodeName`.
    pub claim_unseen: bool,
}

/// Release pacing: idle servers leave a draining node per Fleet at a bounded rate, and never
/// so fast that the Fleet's Ready count falls below a floor. A Terminate deadline overrides
/// it: everything goes at once. So does the end of the hold: the notice's deadline, or
/// `hold_max` after the drain started, whichever comes first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pacing {
    /// The Fleet's Ready servers on nodes that are not draining that must remain after a
    /// release; 0 = no floor.
    pub floor: u32,
    /// At most `batch` Ready servers of a Fleet released per this interval; zero = no limit.
    pub interval: Duration,
    /// How many of a Fleet's Ready servers one interval releases (at least 1).
    pub batch: u32,
    /// The longest a drain holds Ready servers back (an unreadable Fleet, a floor larger
    /// than the Fleet): then the rest go at once.
    pub hold_max: Duration,
}

/// `--release-hold-max`'s default.
pub const DEFAULT_HOLD_MAX: Duration = Duration::from_secs(600);

impl Default for Pacing {
    fn default() -> Self {
        Self {
            floor: 0,
            interval: Duration::ZERO,
            batch: 1,
            hold_max: DEFAULT_HOLD_MAX,
        }
    }
}

impl Pacing {
    pub fn is_on(&self) -> bool {
        self.floor > 0 || !self.interval.is_zero()
    }
}

pub struct Inputs<'a> {
    pub notices: &'a [Notice],
    /// Sources that are configured but have not reported a first view yet (just started,
    /// or never reachable). Unknown is not "all clear": a drain they may have started is
    /// held, not cancelled.
    pub unknown_sources: &'a [Source],
    /// FleetIQ says this node's game server is deregistered (this agent deregistered it,
    /// or GameLift no longer has a server that had been registered) whatever the Node
    /// records: a crash or a failed write may have lost the record. Treated like the record.
    pub fleetiq_deregistered: bool,
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
    pub set_labels: BTreeMap<String, String>,
    pub remove_labels: BTreeSet<String>,
    /// What this write means, announced as Node Events once it succeeds.
    pub events: Vec<NodeEvent>,
}

/// Node-level moments of a drain, each an Event reason. Decided here, with the step that
/// causes it, rather than decoded from the patch afterwards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeEvent {
    DrainStarted,
    NodeFenced,
    DrainCancelled,
    /// The machine came back (a new boot id) after the drain it was handed over for.
    MachineReturned,
}

impl NodeEvent {
    pub fn reason(self) -> &'static str {
        match self {
            Self::DrainStarted => "DrainStarted",
            Self::NodeFenced => "NodeFenced",
            Self::DrainCancelled => "DrainCancelled",
            Self::MachineReturned => "MachineReturned",
        }
    }
}

impl NodePatch {
    fn is_empty(&self) -> bool {
        self.unschedulable.is_none()
            && self.taints.is_none()
            && self.set_labels.is_empty()
            && self.remove_labels.is_empty()
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
    /// Label a Ready GameServer that release pacing holds back `lastcall.dev/node-draining`,
    /// so allocators that exclude the label stop picking it while it waits.
    Exclude { gs: GsRef },
    /// Delete a GameServer that is not in use, preconditioned on uid and resourceVersion.
    /// The delete is itself the fence (allocators skip a server being deleted), so it is
    /// the one write; only when it fails does the actuator label the server
    /// `lastcall.dev/node-draining`, so allocators that exclude the label stop picking it
    /// while the delete is retried.
    Release { gs: GsRef },
    /// Label an in-use GameServer `lastcall.dev/node-draining` and annotate it with the
    /// drain deadline and reason, in one write.
    Protect {
        gs: GsRef,
        deadline: String,
        reason: String,
    },
    /// Remove lastcall's drain label and annotations from a GameServer.
    Unprotect { gs: GsRef },
    /// Start a game-server pod's own graceful termination (SIGTERM, then its full grace
    /// period) because the node dies at a Terminate deadline and `eviction.safe` (or the
    /// operator) permits ending the match: a pod DELETE preconditioned on the pod's uid,
    /// with no grace override. Not an Eviction: the VM takes the pod at the deadline
    /// whatever a disruption budget says.
    EndGracefully {
        namespace: String,
        pod: String,
        uid: String,
    },
    /// Autoscaler cooperation: set (`Some`) or remove (`None`) annotations on a game-server
    /// pod, in one merge patch touching only those keys (see `cooperation`).
    AnnotatePod {
        namespace: String,
        pod: String,
        changes: cooperation::Changes,
    },
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
            Self::Release { .. } => "release",
            Self::Exclude { .. } => "exclude",
            Self::Protect { .. } => "protect",
            Self::Unprotect { .. } => "unprotect",
            Self::Tolerate { .. } => "tolerate",
            Self::EndGracefully { .. } => "end_gracefully",
            Self::AnnotatePod { .. } => "annotate_pod",
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
    /// Plan again no later than this even if nothing changes (a settle period ends).
    pub wake_at: Option<Timestamp>,
    /// What lastcall chose not to do, for the operator (Warning Events, once each).
    pub warnings: Vec<Warning>,
    /// In-use servers whose match may not end before the Terminate deadline (the "matches
    /// at risk" gauge).
    pub at_risk: usize,
    /// The node is empty, the fence has stood its settle, and every hand-off that must come
    /// first is done (FleetIQ deregistration where it is on): a platform waiting for the
    /// node (an Auto Scaling hook, an Azure event) may have it, once a fresh read agrees.
    /// Never from what FleetIQ says alone.
    pub hand_off: bool,
}

impl Plan {
    /// Whether this plan hands the machine over: it deregisters, hands the node back to
    /// GKE, or lets a waiting platform have it. Each is final, so the reconciler confirms
    /// "empty" on a fresh read first.
    pub fn hands_over(&self) -> bool {
        self.hand_off || self.hands_over_by_writing()
    }

    /// Whether this plan itself writes a hand-over: a deregistration or the hand-back to
    /// GKE (as opposed to only telling a waiting platform).
    pub fn hands_over_by_writing(&self) -> bool {
        self.actions.iter().any(|a| match a {
            Action::Deregister => true,
            Action::PatchNode(p) => p
                .set_labels
                .contains_key(keys::LABEL_GKE_PERFORM_MAINTENANCE),
            _ => false,
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Warning {
    pub reason: &'static str,
    pub note: String,
}

/// The fence alone, for a node whose pods and GameServers are not listed yet (just after a
/// start, while a watch or the GameServer selector cannot reach the API server): it needs
/// only the Node and the notices, and keeps new matches off the node at once. `None` when
/// nothing asks for a drain, the fence is up, or the machine came back.
pub fn fence_only(inp: &Inputs<'_>) -> Option<NodePatch> {
    let progress = Progress::from_annotations(&inp.observed.node.annotations);
    if inp.observed.node.machine_returned(&progress) {
        return None;
    }
    let driver = Notice::strongest(inp.notices)?;
    fence_patch(inp, &progress, Some(driver))
}

/// The actions that move this node toward its desired state now (see the module docs).
pub fn plan(inp: &Inputs<'_>) -> Plan {
    let obs = inp.observed;
    let progress = Progress::from_annotations(&obs.node.annotations);
    let returned = obs.node.machine_returned(&progress);
    let mut notices: Vec<Notice> = inp.notices.to_vec();
    // A drain that cannot be withdrawn (a Spot interruption) stays, whatever a lagging
    // replica, a failover or a cache says after a restart; its deadline stays put too. Not
    // once the machine came back: that life is over.
    if progress.started.is_some() && !returned {
        notices.extend(
            progress
                .record
                .entries()
                .iter()
                .filter(|e| !e.cancellable)
                .map(deadline::Entry::as_notice),
        );
    }
    let driver = Notice::strongest(&notices).cloned();

    let unseen = unseen_servers(obs);
    // A game-server pod whose GameServer we cannot see yet may host a match: until it is
    // seen, the node is not empty and nothing may be tainted NoExecute.
    let unseen_servers = unseen.len();
    let mut out = Plan {
        phase: Phase::Idle,
        actions: if inp.config.claim_unseen {
            unseen
        } else {
            vec![]
        },
        driver: driver.clone(),
        wake_at: None,
        warnings: vec![],
        at_risk: 0,
        hand_off: false,
    };
    // Releasing idle servers on a node lastcall has fenced is safe whatever the signals say
    // now: nothing may start a match there, and a Fleet replaces them elsewhere.
    let fenced = obs.node.has_taint(keys::TAINT_DRAINING);
    out.phase = if returned && driver.is_none() && held(&progress, inp.unknown_sources) {
        // The machine came back and nothing asks yet, but a source that asked for the drain
        // has not reported in this life: the Node's and the cluster's signals (a label, a
        // taint, an expiring NodeClaim) outlive a reboot. Hold the fence as after any
        // restart; the new life begins once they have spoken.
        if let Some(p) = fence::refence(inp, &progress) {
            out.actions.push(Action::PatchNode(p));
        }
        returned::held(inp, &progress, &mut out);
        Phase::Draining
    } else if returned {
        returned::returned(inp, &progress, driver.as_ref(), &mut out.actions)
    } else if progress.deregistered.is_some() || inp.fleetiq_deregistered {
        // Deregistration is final: the instance is leaving. Keep the fence up, and keep
        // releasing whatever still lands here (pods with blanket tolerations).
        let fencing = match fence_patch(inp, &progress, driver.as_ref()) {
            Some(p) => {
                out.actions.push(Action::PatchNode(p));
                true
            }
            None => false,
        };
        let busy =
            !fenced || fenced_work(inp, &progress, driver.as_ref(), unseen_servers, &mut out).busy;
        // Deregistered is not empty: GameLift may have dropped a busy node's game server
        // on its own. Only the node itself opens the gate.
        let gate = handoff::gate(inp, &progress, fenced && !fencing, busy);
        handoff::wake(gate, &mut out.wake_at);
        if progress.deregistered.is_none() {
            if gate.is_open() {
                // The record was lost, or GameLift dropped the server: deregistering again
                // sends nothing to FleetIQ (it knows) and writes the record.
                out.actions.push(Action::Deregister);
            } else if busy && fenced {
                out.warnings.push(handoff::deregistered_while_busy());
            }
        }
        out.hand_off = gate.is_open() && progress.deregistered.is_some();
        Phase::Deregistered
    } else if let Some(n) = &driver {
        drain(inp, &progress, n, unseen_servers, &mut out)
    } else if progress.started.is_some()
        && (held(&progress, inp.unknown_sources) || progress.handed_back_final())
    {
        // A source that asked for this drain has not reported since a restart: keep the
        // drain exactly as it is, but keep the node from taking new matches (a fence another
        // writer stripped is put back). Likewise once GKE was asked to take the node: that
        // cannot be taken back.
        if let Some(p) = fence::refence(inp, &progress) {
            out.actions.push(Action::PatchNode(p));
        }
        if fenced {
            fenced_work(inp, &progress, None, unseen_servers, &mut out);
        }
        Phase::Draining
    } else if progress.started.is_some() {
        cancel(inp, &progress, &mut out.actions);
        Phase::Cancelling
    } else {
        idle(inp, &progress, &mut out);
        if out
            .actions
            .iter()
            .any(|a| matches!(a, Action::Unprotect { .. } | Action::PatchNode(_)))
        {
            Phase::Cancelling
        } else {
            Phase::Idle
        }
    };
    remove_terminating_from_allocation(inp, &mut out.actions);
    cooperate(inp, &mut out);
    warn_unknown_eviction_safe(inp.observed, &mut out.warnings);
    out
}

#[cfg(test)]
mod tests;
