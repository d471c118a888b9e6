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

use crate::cooperation;
use crate::deadline::{self, Pressure};
use crate::eviction::{self, EvictionConfig, Subject, Verdict};
use crate::keys;
use crate::notice::{Cause, Notice, Severity, Source};
use crate::observed::{GameServerView, GsState, Observed};
use crate::progress::{DrainRecord, Progress, Recorded, format_precise, format_ts};

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
}

impl NodeEvent {
    pub fn reason(self) -> &'static str {
        match self {
            Self::DrainStarted => "DrainStarted",
            Self::NodeFenced => "NodeFenced",
            Self::DrainCancelled => "DrainCancelled",
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
    /// operator) permits ending the match: the Eviction API, preconditioned on the pod's
    /// uid. A PDB refusal (Agones' 0% budget for `Never`) falls back to a preconditioned
    /// pod DELETE: the VM takes the pod at the deadline whatever the budget says.
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
}

impl Plan {
    /// The node is empty and every hand-off that must come first is done (FleetIQ
    /// deregistration where it is on): a platform waiting for the node may have it now.
    pub fn is_handed_off(&self, config: &PolicyConfig) -> bool {
        match self.phase {
            Phase::Deregistered => true,
            Phase::Empty => !config.deregister,
            _ => false,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Warning {
    pub reason: &'static str,
    pub note: String,
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

pub fn plan(inp: &Inputs<'_>) -> Plan {
    let obs = inp.observed;
    let progress = Progress::from_annotations(&obs.node.annotations);
    let mut notices: Vec<Notice> = inp.notices.to_vec();
    // A drain that cannot be withdrawn (a Spot interruption) stays, whatever a lagging
    // replica, a failover or a cache says after a restart; its deadline stays put too.
    if progress.started.is_some() {
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

    let mut out = Plan {
        phase: Phase::Idle,
        actions: claim_unlabelled(obs),
        driver: driver.clone(),
        wake_at: None,
        warnings: vec![],
        at_risk: 0,
    };
    // A game-server pod whose GameServer we cannot see yet may host a match: until it is
    // claimed and seen, the node is not empty and nothing may be tainted NoExecute.
    let unseen_servers = out.actions.len();
    // Releasing idle servers on a node lastcall has fenced is safe whatever the signals say
    // now: nothing may start a match there, and a Fleet replaces them elsewhere.
    let fenced = obs.node.has_taint(keys::TAINT_DRAINING);
    out.phase = if progress.deregistered.is_some() || inp.fleetiq_deregistered {
        // Deregistration is final: the instance is leaving. Keep the fence up, and keep
        // releasing whatever still lands here (pods with blanket tolerations).
        if let Some(p) = fence_patch(inp, &progress, driver.as_ref()) {
            out.actions.push(Action::PatchNode(p));
        }
        if progress.deregistered.is_none() {
            // The record was lost: deregistering again sends nothing to FleetIQ (it knows)
            // and writes the record.
            out.actions.push(Action::Deregister);
        }
        if fenced {
            fenced_work(inp, &progress, driver.as_ref(), unseen_servers, &mut out);
        }
        Phase::Deregistered
    } else if let Some(n) = &driver {
        drain(inp, &progress, n, unseen_servers, &mut out)
    } else if progress.started.is_some()
        && (held(&progress, inp.unknown_sources) || progress.handed_back_final())
    {
        // A source that asked for this drain has not reported since a restart: keep the
        // drain exactly as it is, but keep the node from taking new matches. Likewise once
        // GKE was asked to take the node: that cannot be taken back.
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

/// An `eviction.safe` value this version does not know is treated as `Never` (the most
/// protective), and said once to the operator: never a guess that ends a match.
fn warn_unknown_eviction_safe(obs: &Observed, warnings: &mut Vec<Warning>) {
    for gs in &obs.game_servers {
        if let eviction::EvictionSafe::Unknown(raw) = &gs.eviction_safe {
            warnings.push(Warning {
                reason: "EvictionSafeUnknown",
                note: format!(
                    "GameServer {}/{} has eviction.safe {raw:?}, which lastcall does not know; treated as Never (never ended early)",
                    gs.namespace, gs.name
                ),
            });
        }
    }
}

/// Autoscaler cooperation: the annotations each game-server pod on this node should carry
/// for its server's state (see `cooperation`). One patch per pod that needs one; none when
/// the mode is off and lastcall never wrote any. Protecting a match comes first in the plan:
/// an autoscaler re-reads the pod seconds after choosing the node, and a failed Node write
/// (a conflict) must not hold it back; giving protection up comes last.
fn cooperate(inp: &Inputs<'_>, out: &mut Plan) {
    let obs = inp.observed;
    let mode = match cooperation::Mode::for_node(&obs.node.labels, inp.config.cooperation) {
        Ok(m) => m,
        Err(bad) => {
            out.warnings.push(Warning {
                reason: "CooperationLabelInvalid",
                note: format!(
                    "Node label {}={bad:?} is not off, in-use or all; using --autoscaler-cooperation={}",
                    cooperation::LABEL_MODE,
                    inp.config.cooperation.as_str()
                ),
            });
            inp.config.cooperation
        }
    };
    for gs in &obs.game_servers {
        if gs.deleting {
            continue;
        }
        let Some(pod) = obs.pod_of(gs).filter(|p| !p.deleting && !p.finished) else {
            continue;
        };
        let changes = cooperation::desired(gs, pod, mode);
        if changes.is_empty() {
            continue;
        }
        let protects = changes.get(cooperation::ANN_DO_NOT_DISRUPT) == Some(&Some("true".into()))
            || changes.get(cooperation::ANN_SAFE_TO_EVICT) == Some(&Some("false".into()));
        let a = Action::AnnotatePod {
            namespace: pod.namespace.clone(),
            pod: pod.name.clone(),
            changes,
        };
        if protects {
            out.actions.insert(0, a);
        } else {
            out.actions.push(a);
        }
    }
}

/// A Ready (or not yet Ready) GameServer whose pod is already terminating (SIGTERM'd while
/// starting, evicted, its node going) is deleted with its preconditions at once, in every
/// phase: Agones would still hand it to an allocator, and the match would start on a pod
/// that is dying.
fn remove_terminating_from_allocation(inp: &Inputs<'_>, actions: &mut Vec<Action>) {
    let obs = inp.observed;
    for gs in &obs.game_servers {
        let v = eviction::verdict(
            &Subject::of(gs, obs.pod_of(gs)),
            None,
            &inp.config.eviction,
            inp.now,
        );
        let planned = actions
            .iter()
            .any(|a| matches!(a, Action::Release { gs: g } if g.uid == gs.uid));
        if v == Verdict::RemoveFromAllocation && !planned {
            actions.push(Action::Release { gs: GsRef::of(gs) });
        }
    }
}

/// A restarted agent holds a drain while any source that asked for it is unknown (one of
/// them may still want it). Other unknown sources do not hold it: they did not ask for it.
fn held(progress: &Progress, unknown: &[Source]) -> bool {
    match &progress.record {
        Recorded::Valid(r) => r.entries.iter().any(|e| unknown.contains(&e.source)),
        // Written by an older agent, or unreadable: hold while any source is unknown,
        // except for a manual drain (its label is always known).
        Recorded::Absent | Recorded::Garbled => {
            progress.cause != Some(Cause::Manual) && !unknown.is_empty()
        }
    }
}

/// Whether `tolerations` let a pod stay on a node with `taint` for good (a NoExecute
/// toleration with `tolerationSeconds` only delays the eviction).
pub fn tolerates(tolerations: &[Toleration], taint: &Taint) -> bool {
    tolerations.iter().any(|t| {
        let op = t.operator.as_deref().unwrap_or("Equal");
        let key_ok = match t.key.as_deref() {
            None | Some("") => op == "Exists",
            Some(k) => k == taint.key,
        };
        let value_ok = op == "Exists"
            || t.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or("");
        let effect_ok = t
            .effect
            .as_deref()
            .is_none_or(|e| e.is_empty() || e == taint.effect);
        let forever = taint.effect != "NoExecute" || t.toleration_seconds.is_none();
        key_ok && value_ok && effect_ok && forever
    })
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
            && !pod.finished
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

/// The node-level fence: cordon, our taint, progress annotations and the drain record.
/// `None` when already there.
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
    // Karpenter, the cluster autoscaler or someone else may already keep new pods off the
    // node; then lastcall does only the game-server work and never cordons on top.
    if !node.unschedulable && driver.is_none_or(|d| d.cordon) {
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
    // To the sub-second (the settle counts from it); a garbled start is written anew, so
    // the settle is never shortened by it.
    if progress.start().is_none() && progress.deregistered.is_none() {
        patch
            .set_annotations
            .insert(keys::ANN_STARTED.into(), format_precise(inp.now));
    }
    if let Some(d) = driver
        && progress.deregistered.is_none()
    {
        if progress.cause != Some(d.cause) {
            patch
                .set_annotations
                .insert(keys::ANN_CAUSE.into(), d.cause.as_str().into());
        }
        // Who asks now, as the deadline rule keeps it.
        let record = DrainRecord {
            entries: deadlines(inp, progress).record(),
        };
        if !record.entries.is_empty() && progress.record != Recorded::Valid(record.clone()) {
            patch
                .set_annotations
                .insert(keys::ANN_NOTICE.into(), record.to_annotation());
        }
    }
    if progress.started.is_none() && patch.set_annotations.contains_key(keys::ANN_STARTED) {
        patch.events.push(NodeEvent::DrainStarted);
    }
    if patch.unschedulable == Some(true) || patch.taints.is_some() {
        patch.events.push(NodeEvent::NodeFenced);
    }
    (!patch.is_empty()).then_some(patch)
}

/// The deadline rule's answer for this pass (see `deadline`).
fn deadlines(inp: &Inputs<'_>, progress: &Progress) -> deadline::Deadlines {
    deadline::current(&deadline::Inputs {
        live: inp.notices,
        record: progress.record.entries(),
        unknown: inp.unknown_sources,
        default_deadline: inp.config.default_deadline,
        // A source not recorded yet is first seen now (and recorded in this pass). Where
        // no record is written (an older agent's drain, after deregistration), at the
        // drain's start, so its default deadline does not move from pass to pass.
        now: match &progress.record {
            Recorded::Valid(_) if progress.deregistered.is_none() => inp.now,
            _ => progress.start().unwrap_or(inp.now),
        },
    })
}

/// The deadline and reason announced to protected servers: the earliest currently valid
/// deadline (see `deadline`), else the start plus the default.
fn announced(inp: &Inputs<'_>, progress: &Progress, driver: Option<&Notice>) -> (String, String) {
    let d = deadlines(inp, progress);
    let deadline = d.announced.map(|a| a.at).unwrap_or_else(|| {
        let started = progress.start().unwrap_or(inp.now);
        started
            .checked_add(
                jiff::SignedDuration::try_from(inp.config.default_deadline).unwrap_or_default(),
            )
            .unwrap_or(started)
    });
    let reason = driver
        .map(|d| d.cause)
        .or(d.pressure.map(|p| p.cause))
        .or(progress.cause)
        .map_or("drain", Cause::as_str);
    (format_ts(deadline), reason.to_string())
}

/// The deadlines a plan works to, for telling them (the dry run's narration): the same rule
/// the plan applies, decided nowhere else.
#[derive(Clone, Debug, PartialEq)]
pub struct DeadlineView {
    /// Announced to protected servers (`lastcall.dev/drain-deadline`).
    pub announced: String,
    pub reason: String,
    /// What presses on the node for hard deadlines (see `eviction::verdict`).
    pub pressure: Option<Pressure>,
}

/// This pass's [`DeadlineView`], for the notice driving the drain (`Plan::driver`).
pub fn deadline_view(inp: &Inputs<'_>, driver: Option<&Notice>) -> DeadlineView {
    let progress = Progress::from_annotations(&inp.observed.node.annotations);
    let (announced, reason) = announced(inp, &progress, driver);
    DeadlineView {
        announced,
        reason,
        pressure: pressure(inp, &progress),
    }
}

/// What the game-server work found.
struct Work {
    /// Something on the node may still host or start a match.
    busy: bool,
    /// Every in-use pod tolerates the compat draining taint.
    all_in_use_tolerate: bool,
    /// The earliest graceful termination still to start.
    wake_at: Option<Timestamp>,
}

/// What presses on the node for hard deadlines: the strongest claim, with a deadline only
/// when it is current (see `deadline`). Never the configured default deadline.
fn pressure(inp: &Inputs<'_>, progress: &Progress) -> Option<Pressure> {
    deadlines(inp, progress).pressure
}

/// The game-server work on a fenced node, for the notice driving it (or the recorded one),
/// folded into the plan: its actions, the at-risk gauge and warning, the wake-up.
fn fenced_work(
    inp: &Inputs<'_>,
    progress: &Progress,
    driver: Option<&Notice>,
    unseen_servers: usize,
    out: &mut Plan,
) -> Work {
    let (deadline, reason) = announced(inp, progress, driver);
    let p = pressure(inp, progress);
    let work = game_server_work(
        inp,
        &deadline,
        &reason,
        p.as_ref(),
        unseen_servers,
        &mut out.actions,
    );
    let at_risk = eviction::matches_at_risk(
        &inp.observed.game_servers,
        &inp.observed.pods,
        p.as_ref(),
        &inp.config.eviction,
        inp.now,
    );
    note_work(&work, at_risk, &deadline, out);
    work
}

/// Folds a plan's game-server work into it: the gauge, the warning, the wake-up.
fn note_work(work: &Work, at_risk: usize, deadline: &str, out: &mut Plan) {
    out.at_risk = at_risk;
    if at_risk > 0 {
        out.warnings.push(Warning {
            reason: "MatchesAtRisk",
            note: format!(
                "{} match(es) in use may not end before the node goes at {deadline}; eviction.safe does not let lastcall end them early (see docs/eviction.md)",
                at_risk
            ),
        });
    }
    if let Some(at) = work.wake_at {
        out.wake_at = Some(out.wake_at.map_or(at, |w| w.min(at)));
    }
}

/// Releases idle and not-yet-ready servers, and labels and protects in-use ones.
/// Releases come first, in one concurrent batch, so the fence-to-released time stays at
/// about two round trips.
fn game_server_work(
    inp: &Inputs<'_>,
    deadline: &str,
    reason: &str,
    pressure: Option<&Pressure>,
    unseen_servers: usize,
    actions: &mut Vec<Action>,
) -> Work {
    let obs = inp.observed;
    let mut busy = unseen_servers > 0;
    let mut all_in_use_tolerate = unseen_servers == 0;
    let mut wake_at: Option<Timestamp> = None;
    let mut releases = vec![];
    let mut in_use = vec![];
    let mut endings = vec![];
    let pods: BTreeMap<(&str, &str), &crate::observed::PodView> = obs
        .pods
        .iter()
        .map(|p| ((p.namespace.as_str(), p.name.as_str()), p))
        .collect();
    let compat_draining = taint(keys::COMPAT_TAINT_DRAINING, "true", "NoExecute");
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
        if gs.state == GsState::Ready || gs.state.is_before_ready() {
            // Not in use, so deleting it (preconditioned on what we saw) ends no match. A
            // server that is not Ready yet cannot be allocated, and one stuck before Ready
            // would otherwise keep the node busy forever.
            busy = true;
            releases.push(Action::Release { gs: r });
        } else if gs.state.is_in_use() {
            busy = true;
            let labelled =
                gs.labels.get(keys::LABEL_NODE_DRAINING).map(String::as_str) == Some("true");
            if !labelled
                || gs
                    .annotations
                    .get(keys::ANN_GS_DEADLINE)
                    .map(String::as_str)
                    != Some(deadline)
                || gs.annotations.get(keys::ANN_GS_REASON).map(String::as_str) != Some(reason)
            {
                in_use.push(Action::Protect {
                    gs: r,
                    deadline: deadline.to_string(),
                    reason: reason.to_string(),
                });
            }
            let pod = obs.pod_of(gs);
            let v = eviction::verdict(
                &Subject::of(gs, pod),
                pressure,
                &inp.config.eviction,
                inp.now,
            );
            if let (Verdict::EndGracefully { at, .. }, Some(pod)) = (v, pod) {
                if at <= inp.now {
                    endings.push(Action::EndGracefully {
                        namespace: pod.namespace.clone(),
                        pod: pod.name.clone(),
                        uid: pod.uid.clone(),
                    });
                } else {
                    wake_at = Some(wake_at.map_or(at, |w| w.min(at)));
                }
            }
            if inp.config.compat_taints {
                match pods.get(&(gs.namespace.as_str(), gs.name.as_str())) {
                    Some(pod) if !tolerates(&pod.tolerations, &compat_draining) => {
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
        }
    }
    // A game-server pod that is still there, even one terminating, may be a game flushing
    // its results during its grace period: the instance must not be handed back under it.
    // A Failed or Succeeded pod runs nothing, and may never be deleted.
    if obs
        .pods
        .iter()
        .any(|p| p.gameserver.is_some() && !p.finished)
    {
        busy = true;
    }
    let (releases, held) = pace(inp, pressure, releases, &mut wake_at);
    actions.extend(releases);
    actions.extend(held);
    actions.extend(in_use);
    // After the protect writes, so the game has read its deadline when SIGTERM comes.
    actions.extend(endings);
    Work {
        busy,
        all_in_use_tolerate,
        wake_at,
    }
}

/// With a floor, how long after its drain started a node first releases a paced server.
const FLOOR_SETTLE: jiff::SignedDuration = jiff::SignedDuration::from_secs(2);

/// How long a Fleet held back by the floor waits before its status is read again.
const FLOOR_RECHECK: jiff::SignedDuration = jiff::SignedDuration::from_secs(1);

fn wake(wake_at: &mut Option<Timestamp>, at: Timestamp) {
    *wake_at = Some(wake_at.map_or(at, |w| w.min(at)));
}

/// Release pacing (see [`Pacing`]) on this pass's releases: those that go now, and the
/// labels for the Ready servers held back that do not carry `lastcall.dev/node-draining`
/// yet. Only Ready servers are paced: they are the Fleet's capacity. One not Ready yet, or
/// whose pod is already terminating, goes at once; so does everything under a Terminate
/// notice or once the hold has lasted its longest.
fn pace(
    inp: &Inputs<'_>,
    pressure: Option<&Pressure>,
    releases: Vec<Action>,
    wake_at: &mut Option<Timestamp>,
) -> (Vec<Action>, Vec<Action>) {
    if !inp.config.pacing.is_on() || pressure.is_some_and(|p| p.severity == Severity::Terminate) {
        return (releases, vec![]);
    }
    let hold_end = hold_end(inp, pressure);
    if hold_end <= inp.now {
        return (releases, vec![]);
    }
    let obs = inp.observed;
    let mut budget: BTreeMap<(String, String), i64> = BTreeMap::new();
    let mut out = vec![];
    let mut held = vec![];
    let mut holding = false;
    for a in releases {
        let paced = match &a {
            Action::Release { gs } => obs
                .game_servers
                .iter()
                .find(|g| g.uid == gs.uid)
                .filter(|g| g.state == GsState::Ready)
                .filter(|g| obs.pod_of(g).is_none_or(|p| !p.deleting))
                .and_then(|g| Some((g, (g.namespace.clone(), g.fleet()?.to_string())))),
            _ => None,
        };
        let Some((g, fleet)) = paced else {
            out.push(a);
            continue;
        };
        let labelled = g.labels.get(keys::LABEL_NODE_DRAINING).map(String::as_str) == Some("true");
        if inp.config.pacing.floor > 0 && !labelled {
            // With a floor, every Ready server on a draining node is marked before any goes,
            // so the agents of other draining nodes count it as leaving, not as capacity.
            held.push(Action::Exclude { gs: GsRef::of(g) });
            continue;
        }
        let left = budget
            .entry(fleet.clone())
            .or_insert_with(|| fleet_budget(inp, &fleet, wake_at));
        if *left > 0 {
            *left -= 1;
            out.push(a);
            continue;
        }
        holding = true;
        if !labelled {
            held.push(Action::Exclude { gs: GsRef::of(g) });
        }
    }
    if holding {
        wake(wake_at, hold_end);
    }
    (out, held)
}

/// When release pacing stops holding Ready servers back: the notice's deadline, or
/// `hold_max` after the drain started, whichever comes first.
fn hold_end(inp: &Inputs<'_>, pressure: Option<&Pressure>) -> Timestamp {
    let started = Progress::from_annotations(&inp.observed.node.annotations)
        .started
        .filter(|t| *t > Timestamp::UNIX_EPOCH)
        .unwrap_or(inp.now);
    let max = jiff::SignedDuration::try_from(inp.config.pacing.hold_max)
        .ok()
        .and_then(|d| started.checked_add(d).ok())
        .unwrap_or(Timestamp::MAX);
    pressure
        .and_then(|p| p.deadline)
        .map_or(max, |d| d.min(max))
}

/// How many of a Fleet's Ready servers this pass may release.
fn fleet_budget(
    inp: &Inputs<'_>,
    (ns, fleet): &(String, String),
    wake_at: &mut Option<Timestamp>,
) -> i64 {
    let pacing = inp.config.pacing;
    let facts = inp
        .observed
        .fleets
        .get(&(ns.clone(), fleet.clone()))
        .cloned()
        .unwrap_or_default();
    let mut budget = i64::MAX;
    if let Ok(interval) = jiff::SignedDuration::try_from(pacing.interval)
        && !interval.is_zero()
    {
        if let Some(next) = facts
            .last_release
            .and_then(|l| l.checked_add(interval).ok())
            && next > inp.now
        {
            wake(wake_at, next);
            return 0;
        }
        budget = i64::from(pacing.batch.max(1));
    }
    if pacing.floor > 0 {
        // Nodes that started draining at about the same time mark their servers within a
        // round trip or two: decide once they can have, so none counts another's as capacity.
        let started = Progress::from_annotations(&inp.observed.node.annotations)
            .started
            .filter(|t| *t > Timestamp::UNIX_EPOCH)
            .unwrap_or(inp.now);
        if let Ok(settled) = started.checked_add(FLOOR_SETTLE)
            && settled > inp.now
        {
            wake(wake_at, settled);
            return 0;
        }
        // Keep here what the floor needs beyond the Ready servers elsewhere.
        let here = inp.observed.ready_here(ns, fleet);
        let spare = match facts.ready_elsewhere {
            Some(elsewhere) => here - (i64::from(pacing.floor) - elsewhere).max(0),
            // Unknown: hold (the Fleet's capacity is what the floor protects), and look again.
            None => 0,
        };
        if spare <= 0
            && let Ok(t) = inp.now.checked_add(FLOOR_RECHECK)
        {
            wake(wake_at, t);
        }
        budget = budget.min(spare.max(0));
    }
    budget
}

fn drain(
    inp: &Inputs<'_>,
    progress: &Progress,
    driver: &Notice,
    unseen_servers: usize,
    out: &mut Plan,
) -> Phase {
    let obs = inp.observed;
    let fence = fence_patch(inp, progress, Some(driver));
    let fencing = fence.is_some();
    if let Some(p) = fence {
        out.actions.push(Action::PatchNode(p));
    }
    let work = fenced_work(inp, progress, Some(driver), unseen_servers, out);

    if inp.config.compat_taints
        && !fencing
        && work.all_in_use_tolerate
        && !obs
            .game_servers
            .iter()
            .any(|g| !g.deleting && (g.state == GsState::Ready || g.state.is_before_ready()))
        && !obs.node.has_taint(keys::COMPAT_TAINT_DRAINING)
    {
        // Last, as the original did: every in-use pod tolerates it and no Ready server is
        // left for the taint manager to kill outside the race-safe delete. Recorded, so a
        // cancel removes only a taint lastcall added.
        let mut taints = obs.node.taints.clone();
        taints.push(taint(keys::COMPAT_TAINT_DRAINING, "true", "NoExecute"));
        let mut set_annotations = BTreeMap::new();
        set_annotations.insert(keys::ANN_COMPAT_DRAINING.to_string(), "true".to_string());
        out.actions.push(Action::PatchNode(NodePatch {
            resource_version: obs.node.resource_version.clone(),
            taints: Some(taints),
            set_annotations,
            ..Default::default()
        }));
    }

    if !fencing
        && !work.busy
        && inp.config.hand_back
        && inp.notices.iter().any(|n| n.can_start_early)
        && !progress.handed_back_final()
    {
        // Empty, and the maintenance may start now: hand the node back early, once. The
        // annotation makes it once across restarts; the label is GKE's.
        let mut patch = NodePatch {
            resource_version: obs.node.resource_version.clone(),
            ..Default::default()
        };
        patch
            .set_labels
            .insert(keys::LABEL_GKE_PERFORM_MAINTENANCE.into(), "true".into());
        patch
            .set_annotations
            .insert(keys::ANN_HANDED_BACK.into(), format_precise(inp.now));
        out.actions.push(Action::PatchNode(patch));
    }

    if fencing {
        Phase::Fencing
    } else if work.busy {
        Phase::Draining
    } else if inp.config.deregister {
        // The fence must have stood for a while: a scheduler deciding on a cache from
        // before the cordon may still be binding a pod here.
        // Counted from the latest moment the fence can have been made; an unreadable
        // start is written anew by the fence, so it counts from now.
        let settle =
            jiff::SignedDuration::try_from(inp.config.deregister_settle).unwrap_or_default();
        let fenced_at = progress.fenced_by.unwrap_or(inp.now);
        let settled_at = fenced_at.checked_add(settle).unwrap_or(Timestamp::MAX);
        if progress.fenced_by.is_some() && inp.now >= settled_at {
            out.actions.push(Action::Deregister);
        } else {
            out.wake_at = Some(settled_at);
        }
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
    let ours = |t: &Taint| {
        t.key == keys::TAINT_DRAINING
            || (t.key == keys::COMPAT_TAINT_DRAINING && progress.compat_draining_ours)
    };
    if node.taints.iter().any(ours) {
        patch.taints = Some(node.taints.iter().filter(|t| !ours(t)).cloned().collect());
    }
    if progress.cordoned_by_us && node.unschedulable {
        patch.unschedulable = Some(false);
    }
    for k in [
        keys::ANN_STARTED,
        keys::ANN_CAUSE,
        keys::ANN_CORDONED,
        keys::ANN_NOTICE,
        keys::ANN_COMPAT_DRAINING,
        keys::ANN_HANDED_BACK,
    ] {
        if node.annotations.contains_key(k) {
            patch.remove_annotations.insert(k.to_string());
        }
    }
    // The hand-back label is ours only with our mark beside it (one write set both).
    if node.annotations.contains_key(keys::ANN_HANDED_BACK)
        && node
            .labels
            .contains_key(keys::LABEL_GKE_PERFORM_MAINTENANCE)
    {
        patch
            .remove_labels
            .insert(keys::LABEL_GKE_PERFORM_MAINTENANCE.to_string());
    }
    if patch.remove_annotations.contains(keys::ANN_STARTED) {
        patch.events.push(NodeEvent::DrainCancelled);
    }
    if !patch.is_empty() {
        actions.push(Action::PatchNode(patch));
    }
}

/// Not draining: clear leftovers of an interrupted cancel; in compat mode keep the original's
/// `active` taint on a registered node, but only where no running game would be evicted.
fn idle(inp: &Inputs<'_>, progress: &Progress, out: &mut Plan) {
    unprotect_all(inp.observed, &mut out.actions);
    let node = &inp.observed.node;
    if node.has_taint(keys::TAINT_DRAINING) || progress.handed_back.is_some() {
        cancel(inp, progress, &mut out.actions);
        return;
    }
    if inp.config.compat_taints
        && progress.registered.is_some()
        && !node.has_taint(keys::COMPAT_TAINT_ACTIVE)
    {
        let active = taint(keys::COMPAT_TAINT_ACTIVE, "true", "NoExecute");
        let intolerant: Vec<String> = inp
            .observed
            .pods
            .iter()
            .filter(|p| {
                p.gameserver.is_some() && !p.deleting && !tolerates(&p.tolerations, &active)
            })
            .map(|p| format!("{}/{}", p.namespace, p.name))
            .collect();
        if let Some(first) = intolerant.first() {
            out.warnings.push(Warning {
                reason: "CompatTaintSkipped",
                note: format!(
                    "Not adding {}=true:NoExecute: {} running game-server pod(s) do not tolerate it and would be evicted (first: {first})",
                    keys::COMPAT_TAINT_ACTIVE,
                    intolerant.len()
                ),
            });
        } else {
            let mut taints = node.taints.clone();
            taints.push(active);
            out.actions.push(Action::PatchNode(NodePatch {
                resource_version: node.resource_version.clone(),
                taints: Some(taints),
                ..Default::default()
            }));
        }
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
