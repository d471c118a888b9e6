//! The dry run's narration: every step the drain would take, in order, each with when it
//! would happen and how long after the drain started, as one structured log line (target
//! `lastcall::dry_run`) and one entry in a bounded in-memory list (read in-process by tests
//! and embedders through [`Narration`]).
//!
//! Steps come from two places: each action the dry run did not send (told as it is "applied",
//! in plan order), and what each pass's plan shows once those have "landed" through the
//! [`overlay`](super::overlay): the signal, the deadlines, the wait for matches, a match that
//! ended, the settle before deregistration. Each is told once, when it first holds or changes.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use jiff::Timestamp;
use tracing::info;

use super::overlay::Found;
use crate::eviction::{self, Subject, Verdict};
use crate::keys;
use crate::notice::Severity;
use crate::observed::Observed;
use crate::policy::{Action, DeadlineView, NodeEvent, Phase, Plan, PolicyConfig};
use crate::progress::{Progress, format_precise};

/// Steps kept in memory; the log has them all.
const MAX_KEPT: usize = 1000;

/// One narrated step.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    /// 1, 2, 3, … in the order told.
    pub n: u64,
    /// Fixed name of the step (`fence`, `release`, `protect`, `deadline`, …; see docs/agent.md).
    pub kind: &'static str,
    /// When the step happened, or would happen (a `settle` or a `match_deadline` tells a
    /// moment ahead in its text).
    pub at: Timestamp,
    /// Seconds since the drain started (the simulated `lastcall.dev/drain-started`); 0
    /// before it has.
    pub after_start_s: f64,
    pub text: String,
}

/// The narration so far: cheap to clone, shared by the narrator and whoever reads it.
#[derive(Clone, Debug, Default)]
pub struct Narration {
    steps: Arc<Mutex<Vec<Step>>>,
}

impl Narration {
    /// The steps told so far, in order (the first `MAX_KEPT`).
    pub fn steps(&self) -> Vec<Step> {
        self.steps.lock().map(|s| s.clone()).unwrap_or_default()
    }

    fn push(&self, step: Step) {
        if let Ok(mut s) = self.steps.lock()
            && s.len() < MAX_KEPT
        {
            s.push(step);
        }
    }
}

/// What one pass showed, once its steps were told.
pub struct PassView<'a> {
    pub plan: &'a Plan,
    /// The view the plan was made on (with the overlay).
    pub observed: &'a Observed,
    pub deadlines: &'a DeadlineView,
    pub config: &'a PolicyConfig,
    pub now: Timestamp,
    /// What the overlay found while laying itself over this pass's view.
    pub found: &'a [Found],
}

#[derive(Default)]
pub struct Narrator {
    out: Narration,
    n: u64,
    /// The driver last told: (cause, source, severity, deadline).
    signal: Option<String>,
    deadline: Option<String>,
    /// Per in-use server (uid), what was last told of its hard deadline.
    fates: BTreeMap<String, String>,
    /// In-use servers (uid → namespace/name) seen at the last complete pass.
    in_use: BTreeMap<String, String>,
    waiting: Option<Vec<String>>,
    settle: Option<String>,
    claimed: BTreeSet<(String, String)>,
    phase: Option<Phase>,
}

/// A pass that had to read servers it could not see yet shows an incomplete node: nothing
/// is concluded from it.
fn complete(plan: &Plan) -> bool {
    !plan
        .actions
        .iter()
        .any(|a| matches!(a, Action::ClaimGameServer { .. }))
}

fn since(start: Option<Timestamp>, at: Timestamp) -> f64 {
    start.map_or(0.0, |s| {
        let d = at.duration_since(s).as_secs_f64();
        (d * 1000.0).round() / 1000.0
    })
}

impl Narrator {
    pub fn new(out: Narration) -> Self {
        Self {
            out,
            ..Self::default()
        }
    }

    fn tell(&mut self, kind: &'static str, observed: &Observed, at: Timestamp, text: String) {
        self.n += 1;
        let start = Progress::from_annotations(&observed.node.annotations).start();
        let after_start_s = since(start, at);
        info!(target: "lastcall::dry_run", n = self.n, step = kind, at = %format_precise(at), after_start_s, "dry run: {text}");
        self.out.push(Step {
            n: self.n,
            kind,
            at,
            after_start_s,
            text,
        });
    }

    /// A step the dry run did not send, told as it would have been sent.
    pub fn applied(&mut self, action: &Action, observed: &Observed, now: Timestamp) {
        let (kind, text) = match action {
            Action::PatchNode(p) => {
                let added: Vec<String> = p
                    .taints
                    .iter()
                    .flatten()
                    .filter(|t| !observed.node.taints.iter().any(|o| o.key == t.key))
                    .map(|t| {
                        format!(
                            "{}={}:{}",
                            t.key,
                            t.value.as_deref().unwrap_or(""),
                            t.effect
                        )
                    })
                    .collect();
                let removed: Vec<&str> = observed
                    .node
                    .taints
                    .iter()
                    .filter(|o| {
                        p.taints
                            .as_ref()
                            .is_some_and(|ts| !ts.iter().any(|t| t.key == o.key))
                    })
                    .map(|t| t.key.as_str())
                    .collect();
                let mut what = vec![];
                match p.unschedulable {
                    Some(true) => what.push("cordon the node".to_string()),
                    Some(false) => what.push("uncordon the node".to_string()),
                    None => {}
                }
                if !added.is_empty() {
                    what.push(format!("taint it {}", added.join(", ")));
                }
                if !removed.is_empty() {
                    what.push(format!("remove the taint {}", removed.join(", ")));
                }
                let set: Vec<&str> = p
                    .set_annotations
                    .keys()
                    .chain(p.set_labels.keys())
                    .map(String::as_str)
                    .collect();
                if !set.is_empty() {
                    what.push(format!("write {}", set.join(", ")));
                }
                let gone: Vec<&str> = p
                    .remove_annotations
                    .iter()
                    .chain(p.remove_labels.iter())
                    .map(String::as_str)
                    .collect();
                if !gone.is_empty() {
                    what.push(format!("remove {}", gone.join(", ")));
                }
                let kind = if p.events.contains(&NodeEvent::NodeFenced) {
                    "fence"
                } else if p.events.contains(&NodeEvent::DrainCancelled) {
                    "cancel"
                } else {
                    "node_write"
                };
                (
                    kind,
                    format!(
                        "would {} (one JSON patch of the Node, guarded by its resourceVersion)",
                        what.join(", ")
                    ),
                )
            }
            Action::ClaimGameServer { namespace, name } => {
                if !self.claimed.insert((namespace.clone(), name.clone())) {
                    return;
                }
                (
                    "claim",
                    format!(
                        "would label GameServer {namespace}/{name} {}={} so the agent's watch sees it (read directly instead)",
                        keys::LABEL_NODE,
                        keys::node_label_value(&observed.node.name)
                    ),
                )
            }
            Action::Release { gs } => (
                "release",
                format!(
                    "would delete Ready GameServer {}/{} (preconditions uid {}, resourceVersion {}); its Fleet would replace it on another node. Not deleted: it stays Ready, and planning treats it as gone",
                    gs.namespace, gs.name, gs.uid, gs.resource_version
                ),
            ),
            Action::Exclude { gs } => (
                "exclude",
                format!(
                    "would label Ready GameServer {}/{} {}=true while release pacing holds it",
                    gs.namespace,
                    gs.name,
                    keys::LABEL_NODE_DRAINING
                ),
            ),
            Action::Protect {
                gs,
                deadline,
                reason,
            } => {
                let state = observed
                    .game_servers
                    .iter()
                    .find(|g| g.uid == gs.uid)
                    .map_or("in-use", |g| g.state.metric_label());
                (
                    "protect",
                    format!(
                        "would protect {state} GameServer {}/{}: label {}=true, annotate {}={deadline} and {}={reason}; it is never deleted",
                        gs.namespace,
                        gs.name,
                        keys::LABEL_NODE_DRAINING,
                        keys::ANN_GS_DEADLINE,
                        keys::ANN_GS_REASON
                    ),
                )
            }
            Action::Unprotect { gs } => (
                "unprotect",
                format!(
                    "would remove lastcall's drain label and annotations from GameServer {}/{}",
                    gs.namespace, gs.name
                ),
            ),
            Action::EndGracefully { namespace, pod, .. } => {
                let grace = observed.termination_grace(namespace, pod);
                (
                    "end_match",
                    format!(
                        "would start pod {namespace}/{pod}'s graceful termination now (a DELETE preconditioned on its uid, no grace override): SIGTERM, then its {} s grace before the node's deadline",
                        grace.as_secs()
                    ),
                )
            }
            Action::AnnotatePod {
                namespace,
                pod,
                changes,
            } => (
                "annotate_pod",
                format!(
                    "would set autoscaler annotations on pod {namespace}/{pod}: {}",
                    changes
                        .iter()
                        .map(|(k, v)| format!("{k}={}", v.as_deref().unwrap_or("(removed)")))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ),
            Action::Tolerate { namespace, pod, .. } => (
                "tolerate",
                format!(
                    "would add the {}=true:NoExecute toleration to pod {namespace}/{pod}",
                    keys::COMPAT_TAINT_DRAINING
                ),
            ),
            Action::Deregister => (
                "deregister",
                format!(
                    "would deregister this node's game server from FleetIQ (DeregisterGameServer, once) and record {} on the Node",
                    keys::ANN_DEREGISTERED
                ),
            ),
        };
        self.tell(kind, observed, now, text);
    }

    /// Before a pass's steps: what the overlay found, and the signal when it changed.
    pub fn planned(&mut self, v: &PassView<'_>) {
        let (plan, obs, now) = (v.plan, v.observed, v.now);
        for f in v.found {
            let text = match f {
                Found::AllocatedAfterRelease { namespace, name } => format!(
                    "GameServer {namespace}/{name}, released in this dry run, was allocated for real (nothing fenced it); a real run would have deleted it first. Planned as the match it is now"
                ),
                Found::EndedMatchGone { namespace, pod } => format!(
                    "pod {namespace}/{pod}, whose graceful termination this dry run started, is past its grace period: treated as gone"
                ),
            };
            self.tell("overlay", obs, now, text);
        }
        let signal = plan.driver.as_ref().map(|d| {
            let deadline = d
                .deadline
                .map_or("no deadline".to_string(), |t| format!("deadline {t}"));
            format!(
                "{} from {} ({}, {deadline})",
                d.cause.as_str(),
                d.source.as_str(),
                d.severity.as_str()
            )
        });
        if signal != self.signal {
            match &signal {
                Some(s) => self.tell("signal", obs, now, format!("drain signal: {s}")),
                None if self.signal.is_some() => {
                    self.tell("signal", obs, now, "the drain signal cleared".into())
                }
                None => {}
            }
            self.signal = signal;
        }
        if complete(plan) {
            self.ended(obs, now);
        }
    }

    /// What the pass shows once its steps have "landed": the deadlines, the wait for
    /// matches, a match that ended, the settle, the end.
    pub fn passed(&mut self, v: &PassView<'_>) {
        let (plan, obs, now) = (v.plan, v.observed, v.now);
        let complete = complete(plan);
        let draining = matches!(plan.phase, Phase::Fencing | Phase::Draining);
        if complete && draining {
            self.deadlines(v);
        }
        if complete && plan.phase == Phase::Draining && plan.actions.is_empty() {
            let mut waiting: Vec<String> = self.in_use.values().cloned().collect();
            waiting.sort();
            if self.waiting.as_ref() != Some(&waiting) {
                let text = if waiting.is_empty() {
                    "waiting for the node's game-server pods to leave (terminating or starting)"
                        .to_string()
                } else {
                    format!(
                        "nothing more to do until {} match(es) end: {}",
                        waiting.len(),
                        waiting.join(", ")
                    )
                };
                self.tell("waiting", obs, now, text);
                self.waiting = Some(waiting);
            }
        }
        if plan.phase == Phase::Empty && !plan.actions.contains(&Action::Deregister) {
            let (kind, text) = match plan.wake_at {
                Some(at) if v.config.deregister => (
                    "settle",
                    Some(format!(
                        "node empty: would deregister at {} (the fence must stand --deregister-settle first)",
                        format_precise(at)
                    )),
                ),
                _ if v.config.deregister => ("settle", None),
                _ => (
                    "done",
                    Some(
                        "drain complete: the node is empty (nothing to deregister: FleetIQ is off); it stays fenced while the signal lasts"
                            .to_string(),
                    ),
                ),
            };
            if text.is_some() && text != self.settle {
                let t = text.clone().unwrap_or_default();
                self.tell(kind, obs, now, t);
                self.settle = text;
            }
        }
        if self.phase != Some(plan.phase) {
            if plan.phase == Phase::Deregistered && self.phase.is_some() {
                self.tell(
                    "done",
                    obs,
                    now,
                    "drain complete: the node is empty and deregistered; it stays fenced".into(),
                );
            }
            if !draining {
                self.waiting = None;
            }
            if plan.phase != Phase::Empty {
                self.settle = None;
            }
            if matches!(plan.phase, Phase::Idle | Phase::Cancelling) {
                // A drain that starts again is told again from its start.
                self.deadline = None;
                self.fates.clear();
            }
            self.phase = Some(plan.phase);
        }
        // Forget servers that are gone, so the memory stays O(servers on this node).
        let live: BTreeSet<(String, String)> = obs
            .pods
            .iter()
            .filter_map(|p| Some((p.namespace.clone(), p.gameserver.clone()?)))
            .chain(obs.game_servers.iter().map(|g| g.key()))
            .collect();
        self.claimed.retain(|k| live.contains(k));
    }

    /// The matches that ended since the last complete pass, before this pass's steps (the
    /// deregistration an empty node gets follows them).
    fn ended(&mut self, obs: &Observed, now: Timestamp) {
        let in_use: BTreeMap<String, String> = obs
            .game_servers
            .iter()
            .filter(|g| g.state.is_in_use() && !g.deleting)
            .map(|g| (g.uid.clone(), format!("{}/{}", g.namespace, g.name)))
            .collect();
        let ended: Vec<String> = self
            .in_use
            .iter()
            .filter(|(uid, _)| !in_use.contains_key(*uid))
            .map(|(_, name)| name.clone())
            .collect();
        for name in ended {
            self.tell(
                "match_ended",
                obs,
                now,
                format!("the match on {name} ended (its GameServer is Shutdown or gone)"),
            );
        }
        self.in_use = in_use;
        self.fates.retain(|uid, _| self.in_use.contains_key(uid));
    }

    /// The deadline told once per change, and each match's hard deadline once per change.
    fn deadlines(&mut self, v: &PassView<'_>) {
        let (obs, now) = (v.observed, v.now);
        if self.in_use.is_empty() {
            return;
        }
        let d = v.deadlines;
        let hard = d
            .pressure
            .filter(|p| p.severity == Severity::Terminate)
            .map(|p| {
                p.deadline.map_or(
                    "the node goes at an unknown moment (no hard deadline to end matches by)"
                        .to_string(),
                    |t| format!("hard deadline {}", format_precise(t)),
                )
            })
            .unwrap_or_else(|| "no hard deadline: a Drain never ends a match".into());
        let deadline = format!(
            "announced deadline {} (reason {}) on every protected match; {hard}",
            d.announced, d.reason
        );
        if self.deadline.as_ref() != Some(&deadline) {
            self.tell("deadline", obs, now, deadline.clone());
            self.deadline = Some(deadline);
        }
        for gs in obs
            .game_servers
            .iter()
            .filter(|g| g.state.is_in_use() && !g.deleting)
        {
            let pod = obs.pod_of(gs);
            let safe = match &gs.eviction_safe {
                eviction::EvictionSafe::Never => "eviction.safe Never".to_string(),
                eviction::EvictionSafe::OnUpgrade => "eviction.safe OnUpgrade".to_string(),
                eviction::EvictionSafe::Always => "eviction.safe Always".to_string(),
                eviction::EvictionSafe::Unknown(raw) => {
                    format!("eviction.safe {raw:?}, treated as Never")
                }
            };
            let verdict = eviction::verdict(
                &Subject::of(gs, pod),
                d.pressure.as_ref(),
                &v.config.eviction,
                now,
            );
            let fate = match (verdict, pod.filter(|p| p.deleting)) {
                (Verdict::Protect { at_risk }, Some(p)) => format!(
                    "its pod is terminating: the match is ending{}{}",
                    p.deletion_timestamp
                        .map(|t| format!(", killed by {}", format_precise(t)))
                        .unwrap_or_default(),
                    if at_risk {
                        " (after the hard deadline: at risk)"
                    } else {
                        ""
                    }
                ),
                (Verdict::EndGracefully { at, at_risk }, _) => format!(
                    "would end it gracefully at {} (hard deadline − its {} s grace; {safe}){}",
                    format_precise(at),
                    pod.map_or(0, |p| p.termination_grace.as_secs()),
                    if at_risk {
                        ": too late for its whole grace"
                    } else {
                        ""
                    }
                ),
                (Verdict::Protect { .. }, None) if pod.is_none() => {
                    "its pod is not seen (gone, or not yet seen): never ended early".to_string()
                }
                (Verdict::Protect { at_risk: true }, None) => format!(
                    "at risk: would not be ended early ({safe}), and the node may go before the match ends"
                ),
                _ => "runs to its end".to_string(),
            };
            if self.fates.get(&gs.uid) != Some(&fate) {
                self.tell(
                    "match_deadline",
                    obs,
                    now,
                    format!("match on {}/{}: {fate}", gs.namespace, gs.name),
                );
                self.fates.insert(gs.uid.clone(), fate);
            }
        }
    }
}
