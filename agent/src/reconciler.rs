//! The level-triggered loop: on any change, re-read state, re-plan, apply the difference.
//!
//! It never depends on how many messages arrived or which change woke it. Progress lives on
//! the Node; the only memory kept here is read-your-writes (the Node we just patched, the
//! releases we just made) so that a watch that lags behind our own writes does not cause a
//! repeated action.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::DynamicObject;
use lastcall_common::admin::Health;
use lastcall_common::backoff::Backoff;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::actuator::{ActError, Actuator, Release, ReleaseOutcome};
use crate::drain_events::PassLog;
use crate::drain_timing::DrainTiming;
use crate::dry_run::narration::{Narration, Narrator, PassView};
use crate::dry_run::overlay::{Found, Overlay};
use crate::metrics::{
    ActionLabel, ActionResult, Metrics, NoticeLabels, PhaseLabel, ResultLabel, StateLabel,
};
use crate::observed::{GameServerView, NodeView, Observed, PodView};
use crate::own_writes::OwnWrites;
use crate::policy::{self, Action, GsRef, NodePatch, Phase, Plan, PolicyConfig};
use crate::progress::Progress;
use crate::reverted::{self, GameServerWrite, NodeWrite, Reverted, Target};
use crate::sources::NoticeBoard;
use crate::watches::Stores;

pub const HEALTH_KUBE: &str = "kube_watches";

pub struct Reconciler {
    pub node_name: String,
    pub stores: Stores,
    pub board: NoticeBoard,
    pub actuator: Actuator,
    pub metrics: Metrics,
    pub health: Health,
    pub config: PolicyConfig,
    pub release_concurrency: usize,
    pub resync: Duration,
    pub trigger: Arc<Notify>,
    /// This node's drain state for the FleetAutoscaler webhook (see `drain_state`).
    pub drain_state: watch::Sender<crate::drain_state::Counts>,
    /// Whether the node is empty and handed off (see `sources::SourceContext::node_empty`).
    pub node_empty: watch::Sender<bool>,
    /// A platform waits for the hand-off (an Auto Scaling hook, Azure approvals): only then
    /// is a hand-off alone (no deregistration or hand-back in the plan) confirmed on a
    /// fresh read, which costs a LIST.
    pub hand_off_waiters: bool,
    /// Plans and acts only while this agent owns the node (`crate::owner`).
    pub owner: crate::owner::Owner,
    /// When the API server asked the agent to wait (429 with Retry-After): no pass before.
    pub throttle: Option<crate::throttle::Throttle>,
    /// Webhook notifications of the drain's moments (`crate::notify`); off by default.
    pub notifier: crate::notify::Notifier,
    state: LocalState,
    own: OwnWrites,
    /// Pods (by uid) whose graceful termination this agent started: a pass planned from a
    /// watch that has not shown the termination yet does not send it again.
    ended: std::collections::BTreeSet<String>,
    timing: DrainTiming,
    reverted: Reverted,
    /// Dry run only: what it did not send, laid over what it observes, and its narration.
    sim: Option<Simulation>,
}

/// A dry run's memory (see `dry_run`).
struct Simulation {
    overlay: Overlay,
    narrator: Narrator,
    /// What the overlay found in this pass's view, for the narration.
    found: Vec<Found>,
}

#[derive(Default)]
struct LocalState {
    /// Warnings already sent as Events by this process.
    warned: HashSet<policy::Warning>,
    last_phase: Option<Phase>,
    /// Label sets of `lastcall_source_notices` set so far, so one that clears goes to 0.
    notice_labels: std::collections::BTreeSet<NoticeLabels>,
    /// Release pacing: when each Fleet last had a Ready server released here.
    last_release: BTreeMap<(String, String), jiff::Timestamp>,
    /// Release pacing: what was last read of each Fleet, and releases it may not show yet.
    fleet_reads: BTreeMap<(String, String), FleetRead>,
    /// Notifications: the hard deadline of this drain was told (once per drain).
    told_deadline: bool,
    /// Notifications: this process saw this drain with game servers still on the node, so
    /// the node becoming empty is a moment it saw happen (not one a restart finds).
    seen_busy: bool,
    /// The steps of passes that failed part-way, not told yet, and when the first of them
    /// ran, with the drain's cause as it was last told (see [`Reconciler::tell`]).
    untold: Option<(PassLog, Instant, String)>,
}

/// Release pacing's view of one Fleet's status.
struct FleetRead {
    ready: Option<i64>,
    /// The Fleet's Ready servers on other draining nodes, at the last read.
    draining_elsewhere: i64,
    at: Instant,
    /// Read again at the next pass, whatever `FLEET_READ_TTL` says.
    stale: bool,
    /// The Fleet's Ready servers on draining nodes (this node's, plus the others' at the last
    /// read), as seen on each pass within `STATUS_LAG`: the status may have been written at
    /// any of those moments, so the most of them is what it may still count that is not
    /// Ready elsewhere.
    here: std::collections::VecDeque<(Instant, i64)>,
}

/// How stale a Fleet's status may be (the Agones controller rewrites it within about a
/// second of a change). Releases count against the floor until then.
const STATUS_LAG: Duration = Duration::from_secs(5);

/// How long a Fleet's Ready count is reused before it is read again.
const FLEET_READ_TTL: Duration = Duration::from_millis(500);

fn earliest(a: Option<jiff::Timestamp>, b: Option<jiff::Timestamp>) -> Option<jiff::Timestamp> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The warnings of this pass not told yet. One whose condition is gone (its server deleted,
/// its label fixed) is forgotten, so the set stays as small as what is wrong now, whatever
/// the game-server churn, and is told again if it comes back.
fn new_warnings(
    warned: &mut HashSet<policy::Warning>,
    current: &[policy::Warning],
) -> Vec<policy::Warning> {
    warned.retain(|w| current.contains(w));
    current
        .iter()
        .filter(|w| warned.insert((*w).clone()))
        .cloned()
        .collect()
}

enum Pass {
    /// Nothing more to do until something changes, or until the given moment.
    Settled(Option<jiff::Timestamp>),
    /// Progress was made: plan again at once.
    Again,
    /// Someone else changed an object under us: plan again shortly, on fresh state.
    Conflicted,
}

/// Pause before re-planning after a conflict, so a lagging watch cannot make us spin.
const CONFLICT_PAUSE: Duration = Duration::from_millis(100);

/// Passes in a row that each applied something before the loop treats the plan as not
/// converging and backs off like a failure. A drain takes a handful (fence, releases,
/// protections, each as its own pass at most); a plan that asks for the same writes for
/// ever (a write that never shows, a planning gap) would otherwise spin the reconciler,
/// and with it every write it sends, as fast as the API answers.
const MAX_PASSES_AGAIN: u32 = 16;

/// The longest the steps of passes that failed part-way wait for the pass that finishes
/// before they are told in an Event of their own (see [`Reconciler::tell`]).
const EVENT_HOLD: Duration = Duration::from_secs(5);

impl Reconciler {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        node_name: String,
        stores: Stores,
        board: NoticeBoard,
        actuator: Actuator,
        metrics: Metrics,
        health: Health,
        config: PolicyConfig,
        release_concurrency: usize,
        resync: Duration,
        trigger: Arc<Notify>,
    ) -> Self {
        let dry_run = actuator.is_dry_run();
        Self {
            node_name,
            stores,
            board,
            actuator,
            metrics,
            health,
            config,
            release_concurrency,
            resync,
            trigger,
            state: LocalState::default(),
            own: OwnWrites::default(),
            ended: Default::default(),
            timing: DrainTiming::default(),
            reverted: Reverted::default(),
            sim: dry_run.then(|| Simulation {
                overlay: Overlay::default(),
                narrator: Narrator::new(Narration::default()),
                found: vec![],
            }),
            drain_state: watch::channel(None).0,
            node_empty: watch::channel(false).0,
            hand_off_waiters: true,
            owner: crate::owner::Owner::sole(),
            throttle: None,
            notifier: crate::notify::Notifier::off(),
        }
    }

    /// A dry run tells its steps to `out` too (tests and embedders read it in-process).
    pub fn narrate_to(&mut self, out: Narration) {
        if let Some(sim) = &mut self.sim {
            sim.narrator = Narrator::new(out);
        }
    }

    pub async fn run(mut self, shutdown: CancellationToken) {
        self.health
            .set(HEALTH_KUBE, false, "waiting for the initial lists");
        // Until every watch has listed, a notice still fences: the fence needs only the Node.
        let stores = self.stores.clone();
        let ready = stores.ready();
        tokio::pin!(ready);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                ok = &mut ready => {
                    if !ok {
                        warn!(message = "a watch ended before its first list");
                        return;
                    }
                    break;
                }
                () = self.trigger.notified() => self.fence_early().await,
                () = tokio::time::sleep(self.resync) => self.fence_early().await,
            }
        }
        self.health.set(HEALTH_KUBE, true, "watching");
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(30));
        // Its own, short: an unsettled pass still applies every action it plans (a hard
        // deadline's among them), so its retries must stay close together.
        let mut unsettled = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        let mut again = 0u32;
        loop {
            if !self.owner.is_owner() {
                // What this agent did as the owner is told before it stands by; a hand-off
                // it told is not this standby's to keep telling.
                self.tell_untold();
                self.retract_empty("this agent no longer owns the node");
                // Another agent acts on this node: keep the caches warm, stay ready, write
                // nothing until it hands over (or is gone).
                if !self.owner.owned(&shutdown).await {
                    return;
                }
                continue;
            }
            let pass = self.pass().await;
            again = if matches!(pass, Ok(Pass::Again)) {
                again + 1
            } else {
                0
            };
            let wait = match pass {
                Ok(Pass::Again) if again > MAX_PASSES_AGAIN => {
                    let d = unsettled.next_delay();
                    self.metrics
                        .reconciles
                        .get_or_create(&ResultLabel {
                            result: "unsettled",
                        })
                        .inc();
                    warn!(
                        message = "the plan keeps applying writes that do not settle; backing off",
                        passes = again,
                        retry_in_ms = d.as_millis() as u64
                    );
                    d
                }
                Ok(Pass::Again) => {
                    backoff.reset();
                    unsettled.reset();
                    // Let the watches and the rest of the runtime run between passes.
                    tokio::task::yield_now().await;
                    Duration::ZERO
                }
                Ok(Pass::Settled(wake_at)) => {
                    backoff.reset();
                    let until_wake = wake_at.map(|t| {
                        let d = t.duration_since(jiff::Timestamp::now());
                        Duration::try_from(d).unwrap_or(Duration::ZERO) + Duration::from_millis(10)
                    });
                    until_wake.map_or(self.resync, |w| w.min(self.resync))
                }
                Ok(Pass::Conflicted) => {
                    self.retract_empty("a write conflicted");
                    CONFLICT_PAUSE
                }
                Err(e) => {
                    self.retract_empty("a pass failed");
                    let d = backoff.next_delay();
                    warn!(message = "reconcile failed; retrying", error = %e, retry_in_ms = d.as_millis() as u64);
                    d
                }
            };
            // Throttled: sleep out the server's Retry-After here, responsive to shutdown,
            // rather than plan and then wait inside the client.
            let wait = wait.max(
                self.throttle
                    .as_ref()
                    .map_or(Duration::ZERO, |t| t.remaining()),
            );
            if wait.is_zero() {
                continue;
            }
            tokio::select! {
                () = shutdown.cancelled() => {
                    self.tell_untold();
                    return;
                }
                () = self.trigger.notified() => {}
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// The node is no longer told empty: only a pass that succeeds, on state read after
    /// the failure, tells it again (confirmed on a fresh read first). A hand-off told before
    /// may have gone stale: a pod that landed since, whose release keeps failing (429s),
    /// makes every pass fail, and a platform that comes asking meanwhile (an Auto Scaling
    /// hook, an Azure event) must not be handed a busy machine.
    fn retract_empty(&self, why: &str) {
        if self
            .node_empty
            .send_if_modified(|v| std::mem::replace(v, false))
        {
            info!(
                message = "the node is no longer told empty until a pass succeeds again",
                reason = why
            );
        }
    }

    /// A notice asks for a drain, or one is under way (started, or our taint is up).
    fn drain_asked_or_under_way(&self, observed: &Observed) -> bool {
        let node = &observed.node;
        Progress::from_annotations(&node.annotations).is_draining()
            || node.has_taint(crate::keys::TAINT_DRAINING)
            || crate::notice::Notice::strongest(&self.board.notices(node, jiff::Timestamp::now()))
                .is_some()
    }

    /// The fence, before the pods and GameServers are listed (see [`policy::fence_only`]).
    async fn fence_early(&mut self) {
        if !self.owner.is_owner() {
            return;
        }
        let Some(node) = self.current_node() else {
            return;
        };
        let node = match NodeView::from_node(&node) {
            Ok(n) => n,
            Err(e) => {
                warn!(message = "cannot read the Node to fence it", error = %e);
                return;
            }
        };
        let observed = Observed {
            node,
            game_servers: vec![],
            pods: vec![],
            fleets: Default::default(),
        };
        let now = jiff::Timestamp::now();
        let notices = self.board.notices(&observed.node, now);
        let unknown = self.board.unknown();
        let inputs = self.inputs(&notices, &unknown, &observed, now);
        let Some(patch) = policy::fence_only(&inputs) else {
            return;
        };
        let plan = Plan {
            phase: Phase::Fencing,
            driver: crate::notice::Notice::strongest(&notices).cloned(),
            actions: vec![Action::PatchNode(patch)],
            wake_at: None,
            warnings: vec![],
            at_risk: 0,
            hand_off: false,
        };
        info!(message = "fencing before this node's pods and GameServers are listed");
        match self.apply(&plan, &observed).await {
            Ok(_) => {}
            Err(e) => warn!(message = "early fence failed; retrying", error = %e),
        }
    }

    fn current_node(&mut self) -> Option<Node> {
        let watched = self
            .stores
            .node
            .state()
            .into_iter()
            .find(|n| n.metadata.name.as_deref() == Some(self.node_name.as_str()))
            .map(|n| (*n).clone());
        self.own.node(watched)
    }

    fn observe(&mut self) -> Result<Observed, String> {
        if let Some(s) = self.stores.selection.get() {
            self.config.claim_unseen = s.claims();
        }
        let node = self
            .current_node()
            .ok_or_else(|| format!("Node {} not found", self.node_name))?;
        let node = NodeView::from_node(&node).map_err(|e| e.to_string())?;
        let watched: Vec<k8s_openapi::api::core::v1::Pod> = self
            .stores
            .pods
            .state()
            .iter()
            .map(|p| (**p).clone())
            .collect();
        let pods: Vec<PodView> = self
            .own
            .pods(watched, Instant::now())
            .iter()
            .filter_map(|p| {
                PodView::from_pod(p)
                    .map_err(|e| debug!(message = "skipping pod", error = %e))
                    .ok()
            })
            .collect();
        let game_servers = self.game_servers();
        // The pod of a server we deleted is on its way out: never claimed again.
        let mut pods = pods;
        for p in &mut pods {
            if p.gameserver
                .as_deref()
                .is_some_and(|g| self.own.released_name(&p.namespace, g))
            {
                p.deleting = true;
            }
        }

        let mut observed = Observed {
            node,
            game_servers,
            pods,
            fleets: BTreeMap::new(),
        };
        if let Some(sim) = &mut self.sim {
            sim.found = sim.overlay.lay_over(&mut observed, jiff::Timestamp::now());
        }
        Ok(observed)
    }

    /// Release pacing only: what it knows of each Fleet with Ready servers here (one GET
    /// per Fleet and, with a floor, one label-selected LIST of its servers on draining
    /// nodes; both reused for `FLEET_READ_TTL`). A failed read is `None`, which holds that
    /// Fleet's releases (for `--release-hold-max` at most): never a guess.
    async fn fleet_facts(&mut self, observed: &mut Observed) {
        if !self.config.pacing.is_on() {
            return;
        }
        let fleets: std::collections::BTreeSet<(String, String)> = observed
            .game_servers
            .iter()
            .filter(|g| g.state == crate::observed::GsState::Ready)
            .filter_map(|g| Some((g.namespace.clone(), g.fleet()?.to_string())))
            .collect();
        self.state.fleet_reads.retain(|k, _| fleets.contains(k));
        for key in fleets {
            let now = Instant::now();
            let here = observed.ready_here(&key.0, &key.1);
            let fresh =
                self.state.fleet_reads.get(&key).is_some_and(|r| {
                    !r.stale && now.saturating_duration_since(r.at) < FLEET_READ_TTL
                });
            if !fresh {
                let (ready, draining_elsewhere) = self.read_fleet(&key).await;
                let read = self
                    .state
                    .fleet_reads
                    .entry(key.clone())
                    .or_insert(FleetRead {
                        ready: None,
                        draining_elsewhere: 0,
                        at: now,
                        stale: false,
                        here: Default::default(),
                    });
                read.stale = false;
                read.ready = ready;
                read.draining_elsewhere = draining_elsewhere;
                read.at = now;
            }
            let Some(read) = self.state.fleet_reads.get_mut(&key) else {
                continue;
            };
            read.here.push_back((now, here + read.draining_elsewhere));
            while read.here.len() > 1
                && read
                    .here
                    .front()
                    .is_some_and(|(t, _)| now.saturating_duration_since(*t) > STATUS_LAG)
            {
                read.here.pop_front();
            }
            let most_here = read.here.iter().map(|(_, h)| *h).max().unwrap_or(here);
            observed.fleets.insert(
                key.clone(),
                crate::observed::FleetFacts {
                    ready_elsewhere: read.ready.map(|r| r - most_here),
                    last_release: self.state.last_release.get(&key).copied(),
                },
            );
        }
    }

    /// One Fleet's `status.readyReplicas` and, when a floor is set, how many of its Ready
    /// servers on other draining nodes (they all carry `lastcall.dev/node-draining`) that
    /// count includes: those are leaving too, not capacity elsewhere. `None` when either
    /// read failed.
    async fn read_fleet(&self, (ns, fleet): &(String, String)) -> (Option<i64>, i64) {
        let api: kube::Api<DynamicObject> = kube::Api::namespaced_with(
            self.actuator.client(),
            ns,
            &crate::observed::fleet_resource(),
        );
        let ready = match api.get(fleet).await {
            Ok(f) => f
                .data
                .pointer("/status/readyReplicas")
                .and_then(|v| v.as_i64()),
            Err(e) => {
                warn!(message = "reading a Fleet for release pacing failed; holding its releases", namespace = %ns, fleet = %fleet, error = %e);
                None
            }
        };
        if self.config.pacing.floor == 0 || ready.is_none() {
            return (ready, 0);
        }
        let gss: kube::Api<DynamicObject> = kube::Api::namespaced_with(
            self.actuator.client(),
            ns,
            &crate::observed::gameserver_resource(),
        );
        let lp = kube::api::ListParams::default().labels(&format!(
            "{}={fleet},{}=true",
            crate::keys::AGONES_FLEET,
            crate::keys::LABEL_NODE_DRAINING
        ));
        match gss.list(&lp).await {
            Ok(list) => {
                let elsewhere = list
                    .items
                    .iter()
                    .filter_map(|o| GameServerView::from_dynamic(o).ok())
                    .filter(|g| {
                        !g.deleting
                            && g.state == crate::observed::GsState::Ready
                            && g.node_name.as_deref() != Some(self.node_name.as_str())
                    })
                    .count() as i64;
                (ready, elsewhere)
            }
            Err(e) => {
                warn!(message = "listing a Fleet's servers on draining nodes failed; holding its releases", namespace = %ns, fleet = %fleet, error = %e);
                (None, 0)
            }
        }
    }

    /// This node's GameServers: the watch's copies, overlaid with our own newer writes.
    fn game_servers(&mut self) -> Vec<GameServerView> {
        let watched: Vec<DynamicObject> = self
            .stores
            .gameservers
            .state()
            .iter()
            .map(|o| (**o).clone())
            .collect();
        self.own.watched_now(
            watched
                .iter()
                .filter_map(|o| {
                    let m = &o.metadata;
                    Some((m.uid.clone()?, (m.namespace.clone()?, m.name.clone()?)))
                })
                .collect(),
        );
        let objs = self.own.gameservers(watched, Instant::now());
        let mut out = vec![];
        for obj in &objs {
            match GameServerView::from_dynamic(obj) {
                // Only servers actually on this node, whatever their label says.
                Ok(mut gs) if gs.node_name.as_deref().is_none_or(|n| n == self.node_name) => {
                    // One we deleted is on its way out, whatever a lagging watch shows: it
                    // is not claimed, labelled or unprotected again.
                    gs.deleting |= self.own.is_released(&gs.uid);
                    out.push(gs)
                }
                Ok(_) => {}
                Err(e) => debug!(message = "skipping game server", error = %e),
            }
        }
        out
    }

    fn remember(&mut self, obj: Option<DynamicObject>) {
        if let Some(o) = obj {
            self.own.wrote_gameserver(o, Instant::now());
        }
    }

    /// Each source's current notices, by cause and severity: several sources for one node
    /// give one drain, but each still shows what it says.
    fn record_notices(&mut self, notices: &[crate::notice::Notice]) {
        let mut now: BTreeMap<NoticeLabels, i64> = BTreeMap::new();
        for n in notices {
            *now.entry(NoticeLabels {
                source: n.source.as_str(),
                cause: n.cause.as_str(),
                severity: n.severity.as_str(),
            })
            .or_default() += 1;
        }
        for l in &self.state.notice_labels {
            if !now.contains_key(l) {
                self.metrics.notices.get_or_create(l).set(0);
            }
        }
        for (l, v) in now {
            self.metrics.notices.get_or_create(&l).set(v);
            self.state.notice_labels.insert(l);
        }
    }

    fn record_gauges(&mut self, plan: &Plan, observed: &Observed) {
        self.metrics.matches_at_risk.set(plan.at_risk as i64);
        let forgotten = plan
            .warnings
            .iter()
            .any(|w| w.reason == policy::DEREGISTERED_WHILE_BUSY);
        self.metrics
            .deregistered_while_busy
            .set(i64::from(forgotten));
        let held = plan
            .warnings
            .iter()
            .any(|w| w.reason == policy::MACHINE_RETURNED_HELD);
        self.metrics.machine_returned_held.set(i64::from(held));
        let mode =
            crate::cooperation::Mode::for_node(&observed.node.labels, self.config.cooperation)
                .unwrap_or(self.config.cooperation);
        let exposed = observed
            .game_servers
            .iter()
            .filter(|g| !g.deleting)
            .filter_map(|g| Some((g, observed.pod_of(g).filter(|p| !p.deleting)?)))
            .filter(|(g, p)| crate::cooperation::exposed(g, p, mode))
            .count();
        self.metrics.cooperation_exposed.set(exposed as i64);
        let counts = crate::drain_state::counts(plan, observed);
        self.drain_state.send_if_modified(|cur| {
            let changed = *cur != counts;
            *cur = counts;
            changed
        });
        for p in Phase::ALL {
            let v = i64::from(p == plan.phase);
            self.metrics
                .phase
                .get_or_create(&PhaseLabel { phase: p.as_str() })
                .set(v);
        }
        let mut counts: BTreeMap<&'static str, i64> = [
            "ready",
            "allocated",
            "reserved",
            "starting",
            "terminal",
            "unknown",
        ]
        .into_iter()
        .map(|s| (s, 0))
        .collect();
        for gs in &observed.game_servers {
            *counts.entry(gs.state.metric_label()).or_default() += 1;
        }
        for (state, n) in counts {
            self.metrics
                .game_servers
                .get_or_create(&StateLabel { state })
                .set(n);
        }
        if self.state.last_phase != Some(plan.phase) {
            info!(
                message = "drain phase",
                phase = plan.phase.as_str(),
                game_servers = observed.game_servers.len()
            );
            self.state.last_phase = Some(plan.phase);
        }
    }

    fn count(&self, a: &Action, result: &'static str) {
        if self.actuator.is_dry_run() {
            return; // counted once per distinct call by the actuator
        }
        self.metrics
            .actions
            .get_or_create(&ActionResult {
                action: a.metric_label(),
                result,
            })
            .inc();
    }

    async fn pass(&mut self) -> Result<Pass, String> {
        let mut observed = match self.observe() {
            Ok(o) => o,
            Err(e) => {
                self.metrics
                    .reconciles
                    .get_or_create(&ResultLabel { result: "error" })
                    .inc();
                return Err(e);
            }
        };
        // Fleets matter only to a drain pacing its releases: an idle node reads none (at
        // 2,000 nodes that would be a GET and a LIST per node per pass, and one 429 would
        // then hold fences cluster-wide).
        if self.drain_asked_or_under_way(&observed) {
            self.fleet_facts(&mut observed).await;
        }
        // Forget releases of servers that are gone: the set stays O(servers on this node).
        let live: HashSet<&str> = observed
            .game_servers
            .iter()
            .map(|g| g.uid.as_str())
            .collect();
        let watched: HashSet<String> = self
            .stores
            .gameservers
            .state()
            .iter()
            .filter_map(|o| o.metadata.uid.clone())
            .collect();
        let pods: HashSet<(String, String)> = observed
            .pods
            .iter()
            .filter_map(|p| Some((p.namespace.clone(), p.gameserver.clone()?)))
            .collect();
        self.own.forget_released(&live, &watched, &pods);
        self.reverted.retain(|t| match t {
            Target::Node => true,
            Target::Pod { namespace, name } => observed
                .pods
                .iter()
                .any(|p| &p.namespace == namespace && &p.name == name),
            Target::GameServer { namespace, name } => observed
                .game_servers
                .iter()
                .any(|g| &g.namespace == namespace && &g.name == name),
        });
        let now = jiff::Timestamp::now();
        let notices = self.board.notices(&observed.node, now);
        self.record_notices(&notices);
        let unknown = self.board.unknown();
        let mut plan = policy::plan(&self.inputs(&notices, &unknown, &observed, now));
        if self.gone_from_fleetiq(&plan, &observed).await? {
            plan = policy::plan(&policy::Inputs {
                fleetiq_deregistered: true,
                ..self.inputs(&notices, &unknown, &observed, now)
            });
        }
        // Every hand-off (deregistration, the hand-back to GKE, a platform told it may have
        // the machine, an operator notified that it may be taken) is final, and the watch
        // caches can lag behind a pod bound just before the fence: "empty" is confirmed on a
        // fresh, consistent read first. A hand-off already told is not read again on every
        // pass, unless this pass also writes one (the hand-back to GKE, a deregistration).
        let already_told =
            plan.hand_off && *self.node_empty.borrow() && !plan.hands_over_by_writing();
        let nobody_waits = !self.hand_off_waiters
            && !self.notifier.tells_empty(self.config.deregister)
            && !plan.hands_over_by_writing();
        let confirming = plan.hands_over() && !already_told && !nobody_waits;
        if confirming && !self.actuator.is_dry_run() {
            let fresh = self.confirm(&observed).await.map_err(|e| {
                self.metrics
                    .reconciles
                    .get_or_create(&ResultLabel { result: "error" })
                    .inc();
                format!("confirming the node is empty: {e}")
            })?;
            plan = policy::plan(&self.inputs(&notices, &unknown, &fresh, jiff::Timestamp::now()));
            if !plan.hands_over() {
                info!(
                    message = "a fresh read found game-server pods the watches had not shown yet; not handing the node over"
                );
            }
            observed = fresh;
        }
        for w in new_warnings(&mut self.state.warned, &plan.warnings) {
            warn!(message = "not done", reason = w.reason, note = %w.note);
            self.actuator
                .queue_event(&self.actuator.node_ref(), w.reason, w.note, true);
        }
        self.record_gauges(&plan, &observed);
        self.timing
            .planned(&plan, self.board.last_change(), Instant::now());
        let deadlines = self.sim.is_some().then(|| {
            policy::deadline_view(
                &self.inputs(&notices, &unknown, &observed, now),
                plan.driver.as_ref(),
            )
        });

        if let (Some(sim), Some(deadlines)) = (&mut self.sim, &deadlines) {
            let found = std::mem::take(&mut sim.found);
            sim.narrator.planned(&PassView {
                plan: &plan,
                observed: &observed,
                deadlines,
                config: &self.config,
                now,
                found: &found,
            });
        }
        let result = self.apply(&plan, &observed).await;
        if let (Some(sim), Some(deadlines)) = (&mut self.sim, &deadlines) {
            sim.narrator.passed(&PassView {
                plan: &plan,
                observed: &observed,
                deadlines,
                config: &self.config,
                now: jiff::Timestamp::now(),
                found: &[],
            });
        }
        let label = match &result {
            Ok(_) => "ok",
            Err(ActError::Conflict(_)) => "conflict",
            Err(_) => "error",
        };
        self.metrics
            .reconciles
            .get_or_create(&ResultLabel { result: label })
            .inc();
        match result {
            Ok(applied) => {
                // Sources honour --dry-run themselves (they count, never send).
                let empty = applied == 0 && plan.hand_off;
                let was_empty = *self.node_empty.borrow();
                self.node_empty
                    .send_if_modified(|v| std::mem::replace(v, empty) != empty);
                self.notify_empty(&plan, empty, was_empty);
                let progress = Progress::from_annotations(&observed.node.annotations);
                self.timing
                    .applied(&plan, &progress, &self.metrics, Instant::now());
                Ok(if applied > 0 {
                    Pass::Again
                } else {
                    let overlay = self
                        .sim
                        .as_ref()
                        .and_then(|s| s.overlay.wake_at(jiff::Timestamp::now()));
                    Pass::Settled(earliest(
                        earliest(plan.wake_at, self.reverted_retry()),
                        overlay,
                    ))
                })
            }
            Err(ActError::Conflict(e)) => {
                debug!(message = "conflict; re-planning on fresh state", error = %e);
                self.own.forget_node();
                if let Ok(n) = kube::Api::<Node>::all(self.actuator.client())
                    .get(&self.node_name)
                    .await
                {
                    self.own.wrote_node(n);
                }
                Ok(Pass::Conflicted)
            }
            Err(e) => Err(e.to_string()),
        }
    }

    /// What one plan is made from: the sources' notices and the observed state, now.
    fn inputs<'a>(
        &'a self,
        notices: &'a [crate::notice::Notice],
        unknown: &'a [crate::notice::Source],
        observed: &'a Observed,
        now: jiff::Timestamp,
    ) -> policy::Inputs<'a> {
        policy::Inputs {
            notices,
            unknown_sources: unknown,
            fleetiq_deregistered: self.actuator.fleetiq().is_deregistered(),
            observed,
            config: &self.config,
            now,
        }
    }

    /// Before a drain is cancelled on a node whose game server had been registered, asks
    /// FleetIQ whether it still is: a crash or a failed write may have lost the record of a
    /// deregistration, and a deregistered node must never be uncordoned. `Ok(true)`: it is
    /// gone, plan again as deregistered. An unanswered question holds the cancel (retried).
    async fn gone_from_fleetiq(&self, plan: &Plan, observed: &Observed) -> Result<bool, String> {
        let progress = Progress::from_annotations(&observed.node.annotations);
        let cancelling = plan.phase == Phase::Cancelling && progress.started.is_some();
        // A machine that came back starts a new life, whatever GameLift remembers of the last.
        if !cancelling
            || observed.node.machine_returned(&progress)
            || !self.config.deregister
            || progress.registered.is_none()
            || self.actuator.is_dry_run()
        {
            return Ok(false);
        }
        let fleetiq = self.actuator.fleetiq();
        match fleetiq.still_registered().await {
            Ok(true) => Ok(false),
            Ok(false) => {
                warn!(
                    message = "not cancelling: GameLift no longer has this game server, so it was deregistered; the node stays fenced"
                );
                fleetiq.deregistered_earlier();
                Ok(true)
            }
            Err(e) => {
                self.metrics
                    .reconciles
                    .get_or_create(&ResultLabel { result: "error" })
                    .inc();
                Err(format!(
                    "cancel held: asking FleetIQ whether the game server is still registered: {e}"
                ))
            }
        }
    }

    /// Applies the plan in order. Node patches and deregistration are barriers: if one
    /// fails, nothing after it runs. Consecutive releases run concurrently. Returns how many
    /// actions changed something.
    async fn apply(&mut self, plan: &Plan, observed: &Observed) -> Result<usize, ActError> {
        let mut log = PassLog::default();
        let mut failed = false;
        let result = self
            .apply_steps(plan, observed, &mut log, &mut failed)
            .await;
        self.notify(plan, &log, observed);
        self.tell(plan, log, failed || result.is_err());
        result
    }

    /// Webhook notifications for the pass's moments, from the same log as its Event, so
    /// each is sent once per transition: a drain's start and cancel are decided by the
    /// Node's record (a restarted agent finds the drain recorded and starts none), a
    /// deregistration happens once per node.
    fn notify(&mut self, plan: &Plan, log: &PassLog, observed: &Observed) {
        use crate::notify::{Event, Notification};
        if !self.notifier.is_on() {
            return;
        }
        let progress = Progress::from_annotations(&observed.node.annotations);
        let (reason, source) = match &plan.driver {
            Some(d) => (d.cause.as_str(), d.source.as_str()),
            // A cancel has no driver left: what the Node recorded.
            None => (
                progress.cause.map_or("", |c| c.as_str()),
                progress
                    .record
                    .entries()
                    .first()
                    .map_or("", |e| e.source.as_str()),
            ),
        };
        let hard = plan.driver.as_ref().and_then(|d| d.deadline);
        let announced = log.deadline.as_ref().map(|(d, _)| d.clone());
        let note = |event: Event, deadline: Option<String>, message: String| Notification {
            event,
            reason: reason.to_string(),
            source: source.to_string(),
            deadline: deadline.unwrap_or_default(),
            message,
        };
        let mut out = vec![];
        for e in &log.node {
            match e {
                policy::NodeEvent::DrainStarted => {
                    self.state.told_deadline = false;
                    let deadline = announced.clone().or(hard.map(|t| t.to_string()));
                    let until = deadline
                        .as_deref()
                        .map(|d| format!(" Running matches may go on until {d}."))
                        .unwrap_or_default();
                    out.push(note(
                        Event::DrainStarted,
                        deadline,
                        format!(
                            "Drain started: {reason} ({source}). No new game servers land here; idle ones are released.{until}"
                        ),
                    ));
                }
                policy::NodeEvent::DrainCancelled => {
                    self.state.told_deadline = false;
                    self.state.seen_busy = false;
                    out.push(note(
                        Event::DrainCancelled,
                        None,
                        "Signal cleared before the node was empty; lastcall undid its changes and the node takes game servers again.".into(),
                    ));
                }
                policy::NodeEvent::NodeFenced | policy::NodeEvent::MachineReturned => {}
            }
        }
        if !log.ended.is_empty() && !self.state.told_deadline {
            self.state.told_deadline = true;
            let deadline = hard.map(|t| t.to_string());
            let at = deadline.as_deref().unwrap_or("its deadline");
            out.push(note(
                Event::HardDeadline,
                deadline.clone(),
                format!(
                    "The node goes at {at}: started the graceful termination of {} match(es) so each gets its whole grace period.",
                    log.ended.len()
                ),
            ));
        }
        if log.deregistered {
            self.state.seen_busy = false;
            out.push(note(
                Event::Deregistered,
                None,
                "No game servers in use; deregistered from FleetIQ.".into(),
            ));
        }
        for n in out {
            info!(message = "notifying", event = n.event.as_str());
            self.notifier.send(n);
        }
    }

    /// Without FleetIQ, the moment a drain's node is empty and may be taken. Sent only when
    /// this process saw the drain busy first, so a restart on an empty node sends none.
    fn notify_empty(&mut self, plan: &Plan, empty_now: bool, was_empty: bool) {
        if !self.notifier.tells_empty(self.config.deregister) {
            return;
        }
        match plan.phase {
            Phase::Idle | Phase::Cancelling => self.state.seen_busy = false,
            Phase::Fencing | Phase::Draining => self.state.seen_busy = true,
            Phase::Empty | Phase::Deregistered => {}
        }
        if empty_now && !was_empty && self.state.seen_busy {
            self.state.seen_busy = false;
            info!(message = "notifying", event = "empty");
            self.notifier.send(crate::notify::Notification {
                event: crate::notify::Event::Empty,
                reason: plan
                    .driver
                    .as_ref()
                    .map_or("", |d| d.cause.as_str())
                    .to_string(),
                source: plan
                    .driver
                    .as_ref()
                    .map_or("", |d| d.source.as_str())
                    .to_string(),
                deadline: String::new(),
                message: "No game servers left; the drained node may be taken.".into(),
            });
        }
    }

    /// One Event for the pass, on the Node, telling each step that succeeded. A pass that
    /// failed part-way is retried soon (after a 429's Retry-After, or the error backoff):
    /// its steps wait for the pass that finishes, for `EVENT_HOLD` at most, so a drain
    /// refused pass by pass still tells its steps in one Event, not one per pass.
    fn tell(&mut self, plan: &Plan, log: PassLog, failed: bool) {
        let now = Instant::now();
        let why = plan
            .driver
            .as_ref()
            .map(|d| format!("{} ({})", d.cause.as_str(), d.source.as_str()))
            .unwrap_or_else(|| "signal cleared".into());
        let (mut merged, since) = match self.state.untold.take() {
            Some((l, t, _)) => (l, t),
            None => (PassLog::default(), now),
        };
        merged.merge(log);
        if merged.is_empty() {
            return;
        }
        if failed && now.duration_since(since) < EVENT_HOLD {
            self.state.untold = Some((merged, since, why));
            return;
        }
        self.tell_now(&why, &merged);
    }

    /// Tells what waits in [`Self::tell`] now (shutting down).
    fn tell_untold(&mut self) {
        if let Some((log, _, why)) = self.state.untold.take() {
            self.tell_now(&why, &log);
        }
    }

    fn tell_now(&self, why: &str, log: &PassLog) {
        if let Some((reason, note)) = log.event(why) {
            info!(message = "drain event", reason, note = %note);
            self.actuator
                .queue_event(&self.actuator.node_ref(), reason, note, false);
        }
    }

    async fn apply_steps(
        &mut self,
        plan: &Plan,
        observed: &Observed,
        log: &mut PassLog,
        failed: &mut bool,
    ) -> Result<usize, ActError> {
        let mut applied = 0;
        let mut first_error: Option<ActError> = None;
        let mut i = 0;
        while i < plan.actions.len() {
            let action = &plan.actions[i];
            if let Action::Release { .. } = action {
                let mut batch = vec![];
                while let Some(Action::Release { gs }) = plan.actions.get(i) {
                    batch.push(gs.clone());
                    i += 1;
                }
                let (done, failed) = self.release_batch(batch, observed, log).await;
                applied += done;
                if let Some(e) = failed {
                    first_error.get_or_insert(e);
                }
                continue;
            }
            if let Action::EndGracefully { .. } = action {
                let mut batch = vec![];
                while let Some(a @ Action::EndGracefully { .. }) = plan.actions.get(i) {
                    batch.push(a);
                    i += 1;
                }
                let (done, failed) = self.end_batch(&batch, observed, log).await;
                applied += done;
                if let Some(e) = failed {
                    first_error.get_or_insert(e);
                }
                continue;
            }
            i += 1;
            if write_target(action).is_some_and(|t| self.reverted.paused(&t, Instant::now())) {
                // Its last write was reverted: wait out the pause. The Node write is a
                // barrier: nothing after it runs without it.
                if matches!(action, Action::PatchNode(_)) {
                    break;
                }
                continue;
            }
            match self.apply_one(action, observed, log).await {
                // A dry run made progress only if the step changed what planning sees (or
                // read a server it could not see): a re-planned step never spins the loop.
                Ok(done) if self.sim.is_some() => {
                    let changed = self.simulate(action, observed);
                    if changed || (done && matches!(action, Action::ClaimGameServer { .. })) {
                        applied += 1;
                    }
                }
                Ok(true) => {
                    applied += 1;
                    self.count(action, "ok");
                }
                Ok(false) => {}
                Err(e) => {
                    self.count(action, e.metric_label());
                    warn!(message = "action failed", action = action.metric_label(), error = %e);
                    if matches!(action, Action::PatchNode(_) | Action::Deregister) {
                        return Err(e);
                    }
                    first_error.get_or_insert(e);
                }
            }
        }
        *failed = first_error.is_some();
        match first_error {
            // Something failed: retry with backoff (never wait for the resync: a Ready server
            // whose delete failed must not stay allocatable for long).
            Some(e) if applied == 0 => Err(e),
            Some(_) | None => Ok(applied),
        }
    }

    async fn apply_one(
        &mut self,
        action: &Action,
        observed: &Observed,
        log: &mut PassLog,
    ) -> Result<bool, ActError> {
        let a = self.actuator.clone();
        match action {
            Action::PatchNode(p) => {
                let has_ann = !observed.node.annotations.is_empty();
                let has_labels = !observed.node.labels.is_empty();
                if let Some(n) = a.patch_node(p, has_ann, has_labels).await? {
                    self.check_kept(action, reverted::node_kept(node_write(p), &n));
                    self.own.wrote_node(n);
                    if p.events.contains(&policy::NodeEvent::MachineReturned) {
                        // The last life's drain is settled on the Node: FleetIQ start-up is
                        // decided again for this one.
                        a.fleetiq().new_life();
                    }
                }
                log.node.extend(p.events.iter().copied());
                log.cordoned |= p.unschedulable == Some(true);
                Ok(true)
            }
            Action::ClaimGameServer { namespace, name } => {
                let obj = a.claim_gameserver(namespace, name).await?;
                let claimed = obj.is_some();
                self.remember(obj);
                // In dry-run mode the "claim" is a read: the next pass plans with it.
                Ok(claimed)
            }
            Action::Protect {
                gs,
                deadline,
                reason,
            } => {
                let obj = a.protect(gs, deadline, reason).await?;
                if let Some(o) = &obj {
                    let write = GameServerWrite::Protected { deadline, reason };
                    self.check_kept(action, reverted::gameserver_kept(write, o));
                }
                self.remember(obj);
                log.protected.push(format!("{}/{}", gs.namespace, gs.name));
                log.deadline = Some((deadline.clone(), reason.clone()));
                Ok(true)
            }
            Action::Exclude { gs } => {
                let obj = a.label_draining(gs).await?;
                // The floor is checked again on fresh reads, which may now show the other
                // draining nodes' labels written meanwhile.
                for read in self.state.fleet_reads.values_mut() {
                    read.stale = true;
                }
                if let Some(o) = &obj {
                    let write = GameServerWrite::Labelled;
                    self.check_kept(action, reverted::gameserver_kept(write, o));
                }
                self.remember(obj);
                Ok(true)
            }
            Action::Unprotect { gs } => {
                let obj = a.unprotect(gs).await?;
                self.remember(obj);
                Ok(true)
            }
            Action::Tolerate {
                namespace,
                pod,
                resource_version,
            } => {
                let has = observed.pods.iter().any(|p| {
                    &p.namespace == namespace && &p.name == pod && !p.tolerations.is_empty()
                });
                a.tolerate(namespace, pod, resource_version, has)
                    .await
                    .map(|()| true)
            }
            Action::AnnotatePod {
                namespace,
                pod,
                changes,
            } => {
                let written = a.annotate_pod(namespace, pod, changes).await?;
                let wrote = written.is_some();
                if let Some(p) = written {
                    self.check_kept(action, reverted::pod_kept(changes, &p));
                    self.own.wrote_pod(p, Instant::now());
                }
                Ok(wrote)
            }
            // Run together by `end_batch`.
            Action::EndGracefully { .. } => Ok(false),
            Action::Deregister => {
                if let Some(n) = a.deregister().await? {
                    self.own.wrote_node(n);
                }
                info!(message = "node empty; deregistered from FleetIQ");
                log.deregistered = true;
                Ok(true)
            }
            Action::Release { .. } => Ok(false),
        }
    }

    /// Dry run: a step that was not sent, laid over what planning sees as if it had landed,
    /// and told. Returns whether planning sees anything new.
    fn simulate(&mut self, action: &Action, observed: &Observed) -> bool {
        let Some(sim) = &mut self.sim else {
            return false;
        };
        let now = jiff::Timestamp::now();
        let changed = sim.overlay.record(action, observed, now);
        if changed || matches!(action, Action::ClaimGameServer { .. }) {
            sim.narrator.applied(action, observed, now);
        }
        changed
    }

    /// After a write succeeded: whether its answer carries what it wrote. One that does not
    /// (an admission webhook reverted it) pauses writes to that object, doubling each time,
    /// and is told; one that does ends the pause.
    fn check_kept(&mut self, action: &Action, kept: bool) {
        let Some(t) = write_target(action) else {
            return;
        };
        if kept {
            self.reverted.kept(&t);
            return;
        }
        let pause = self.reverted.reverted(t.clone(), Instant::now());
        self.metrics
            .writes_reverted
            .get_or_create(&ActionLabel {
                action: action.metric_label(),
            })
            .inc();
        let note = format!(
            "The write ({}) to {} succeeded but came back without what it wrote: something (an admission webhook?) reverts it. Writing it again in {} s",
            action.metric_label(),
            t.describe(),
            pause.as_secs()
        );
        warn!(message = "write reverted; backing off", action = action.metric_label(), target = %t.describe(), pause_s = pause.as_secs());
        self.actuator
            .queue_event(&self.actuator.node_ref(), "WriteReverted", note, true);
    }

    /// When a paused write may be tried again, on the wall clock the plan uses.
    fn reverted_retry(&self) -> Option<jiff::Timestamp> {
        let now = Instant::now();
        let at = self.reverted.next_retry(now)?;
        let d = jiff::SignedDuration::try_from(at.saturating_duration_since(now)).ok()?;
        jiff::Timestamp::now().checked_add(d).ok()
    }

    /// Releases concurrently. Returns how many changed something, and the first failure.
    /// Starts the graceful termination of every match in `batch` at once: each is due now,
    /// and a slow or unanswered request for one must not hold the others past their own
    /// `deadline − grace` (one at a time, a hung request made the next match a request
    /// timeout late).
    async fn end_batch(
        &mut self,
        batch: &[&Action],
        observed: &Observed,
        log: &mut PassLog,
    ) -> (usize, Option<ActError>) {
        let actuator = self.actuator.clone();
        let batch: Vec<&Action> = batch
            .iter()
            .copied()
            .filter(|a| !matches!(a, Action::EndGracefully { uid, .. } if self.ended.contains(uid)))
            .collect();
        let results = futures::future::join_all(batch.iter().map(|action| {
            let a = actuator.clone();
            async move {
                match action {
                    Action::EndGracefully {
                        namespace,
                        pod,
                        uid,
                    } => a.end_gracefully(namespace, pod, uid).await,
                    _ => Ok(false),
                }
            }
        }))
        .await;
        let mut applied = 0;
        let mut failed = None;
        for (action, r) in batch.iter().zip(results) {
            let Action::EndGracefully { namespace, pod, .. } = action else {
                continue;
            };
            match r {
                Ok(_) if self.sim.is_some() => {
                    if self.simulate(action, observed) {
                        applied += 1;
                    }
                }
                Ok(true) => {
                    applied += 1;
                    self.count(action, "ok");
                    if let Action::EndGracefully { uid, .. } = action {
                        self.ended.insert(uid.clone());
                    }
                    info!(message = "started a match's graceful termination before the node's deadline", namespace = %namespace, pod = %pod);
                    log.ended.push(format!("{namespace}/{pod}"));
                }
                Ok(false) => {}
                Err(e) => {
                    self.count(action, e.metric_label());
                    warn!(message = "action failed", action = action.metric_label(), error = %e);
                    failed.get_or_insert(e);
                }
            }
        }
        (applied, failed)
    }

    async fn release_batch(
        &mut self,
        batch: Vec<GsRef>,
        observed: &Observed,
        log: &mut PassLog,
    ) -> (usize, Option<ActError>) {
        let todo: Vec<GsRef> = batch
            .into_iter()
            .filter(|g| !self.own.is_released(&g.uid))
            .collect();
        let actuator = self.actuator.clone();
        let results: Vec<(GsRef, ReleaseOutcome)> = futures::stream::iter(todo)
            .map(|gs| {
                let a = actuator.clone();
                async move {
                    let r = a.release(&gs).await;
                    (gs, r)
                }
            })
            .buffer_unordered(self.release_concurrency.max(1))
            .collect()
            .await;
        let mut applied = 0;
        let mut failed = None;
        for (gs, outcome) in results {
            self.remember(outcome.newest);
            let r = outcome.result;
            let label = match &r {
                Ok(Release::Deleted) => "ok",
                Ok(Release::Conflict) => "conflict",
                Ok(Release::Gone) => "gone",
                Err(_) => "error",
            };
            self.metrics
                .releases
                .get_or_create(&ResultLabel { result: label })
                .inc();
            self.count(&Action::Release { gs: gs.clone() }, label);
            match r {
                Ok(Release::Deleted) if self.sim.is_some() => {
                    // Not sent: the overlay treats the server as gone, for planning only.
                    let action = Action::Release { gs: gs.clone() };
                    if self.simulate(&action, observed) {
                        applied += 1;
                    }
                }
                Ok(Release::Deleted) => {
                    if let Some(fleet) = observed
                        .game_servers
                        .iter()
                        .find(|g| g.uid == gs.uid)
                        .and_then(|g| g.fleet())
                    {
                        let key = (gs.namespace.clone(), fleet.to_string());
                        self.state.last_release.insert(key, jiff::Timestamp::now());
                    }
                    applied += 1;
                    self.own.released(&gs.uid, &gs.namespace, &gs.name);
                    info!(message = "released idle game server", namespace = %gs.namespace, name = %gs.name);
                    log.released.push(format!("{}/{}", gs.namespace, gs.name));
                }
                Ok(Release::Conflict) => {
                    // The newer version is remembered: the next plan protects it (allocated)
                    // or releases exactly that version.
                    applied += 1;
                    info!(message = "game server changed before release (allocated?); re-planning", namespace = %gs.namespace, name = %gs.name);
                    log.skipped.push(format!("{}/{}", gs.namespace, gs.name));
                }
                Ok(Release::Gone) => {
                    self.own.released(&gs.uid, &gs.namespace, &gs.name);
                }
                Err(e) => {
                    warn!(message = "release failed; retrying with backoff", namespace = %gs.namespace, name = %gs.name, error = %e);
                    failed.get_or_insert(e);
                }
            }
        }
        (applied, failed)
    }

    /// Re-reads this node's pods straight from the API server (a consistent LIST), for
    /// decisions that cannot be undone. Pods are what runs here: a match has a pod, a pod
    /// the watches have not shown yet keeps the node busy (and gets its GameServer claimed),
    /// and a GameServer without a pod on this node runs nothing here. One LIST, not two.
    async fn confirm(&mut self, watched: &Observed) -> Result<Observed, kube::Error> {
        let pods = fresh_pods(&self.actuator, &self.node_name).await?;
        Ok(Observed {
            node: watched.node.clone(),
            game_servers: watched.game_servers.clone(),
            pods,
            fleets: watched.fleets.clone(),
        })
    }
}

/// This node's pods, straight from the API server (a consistent LIST): the fresh read of
/// the hand-off gate (see `policy::handoff`).
pub async fn fresh_pods(actuator: &Actuator, node: &str) -> Result<Vec<PodView>, kube::Error> {
    let pods: kube::Api<k8s_openapi::api::core::v1::Pod> = kube::Api::all(actuator.client());
    let lp = kube::api::ListParams::default().fields(&format!("spec.nodeName={node}"));
    Ok(pods
        .list(&lp)
        .await?
        .items
        .iter()
        .filter_map(|p| PodView::from_pod(p).ok())
        .collect())
}

/// The object of a write whose effect is checked for reverts; `None` for deletes and the
/// rest.
fn write_target(action: &Action) -> Option<Target> {
    match action {
        Action::PatchNode(_) => Some(Target::Node),
        Action::AnnotatePod { namespace, pod, .. } => Some(Target::Pod {
            namespace: namespace.clone(),
            name: pod.clone(),
        }),
        Action::Exclude { gs } | Action::Protect { gs, .. } => Some(Target::GameServer {
            namespace: gs.namespace.clone(),
            name: gs.name.clone(),
        }),
        _ => None,
    }
}

/// What a planned Node patch sets, for the revert check.
fn node_write(p: &NodePatch) -> NodeWrite<'_> {
    NodeWrite {
        unschedulable: p.unschedulable,
        taints: p.taints.as_deref(),
        set_annotations: &p.set_annotations,
        remove_annotations: &p.remove_annotations,
        set_labels: &p.set_labels,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn warning(n: usize) -> policy::Warning {
        policy::Warning {
            reason: "EvictionSafeUnknown",
            note: format!("GameServer default/gs-{n} has eviction.safe \"Sometimes\""),
        }
    }

    #[test]
    fn warnings_are_told_once_and_forgotten_with_their_objects() {
        let mut warned = HashSet::new();
        // Servers come and go, each with its own warning: told once each, and the set holds
        // only the live ones.
        for n in 0..1000 {
            let live = [warning(n), warning(n + 1)];
            let told = new_warnings(&mut warned, &live);
            let want = if n == 0 {
                live.to_vec()
            } else {
                vec![warning(n + 1)]
            };
            assert_eq!(told, want, "pass {n}");
            assert!(warned.len() <= 2, "{} remembered at pass {n}", warned.len());
        }
        // Still there: not told again. Gone and back: told again.
        assert!(new_warnings(&mut warned, &[warning(1000)]).is_empty());
        assert!(new_warnings(&mut warned, &[]).is_empty());
        assert_eq!(new_warnings(&mut warned, &[warning(1000)]), [warning(1000)]);
    }
}
