//! The invariant checker: reads the kube journal (with each accepted write's resulting
//! object) and the GameLift calls of a run, sets them against the script's truth, and lists
//! every violation with the requests that show it.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use serde_json::Value;

use super::providers::Consent;
use super::runner::{
    AZURE_POLL, COMPAT_ACTIVE, COMPAT_DRAINING, DRAIN_NODE_ANNOTATIONS, IMDS_POLL, NODE, PodSeen,
    REQUEST_TIMEOUT, Run, agent_pod,
};
use super::script::{Action, KubeFault, Safe};
use super::truth::{Change, Live, Signal, SignalId, Truth, asks_drain, consent, earliest};
use crate::autoscaling::Happening;
use crate::gamelift;
use crate::kube::journal::{JournalEntry, Verb};
use crate::promises::allocation::allocated_after_marked;
use crate::promises::body::written;
use crate::promises::graceful::{ends_a_match, request_faults};

/// The allocator's identity in the journal.
const ALLOCATOR: &str = "agones-allocator";

/// How long the agent may take to notice a change of the truth (IMDS polls every 200 ms,
/// the rest is pushed; a loaded CI machine adds the rest). `TIMELINE_LAG_MS` overrides it.
pub const DEFAULT_LAG: Duration = Duration::from_millis(1500);

fn lag() -> Duration {
    std::env::var("TIMELINE_LAG_MS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .map(Duration::from_millis)
        .unwrap_or(DEFAULT_LAG)
}
/// How long an agent may take to act on a read that showed it a change (its pass in flight,
/// the requests before the one judged): the part of the reaction time a read does not
/// shorten.
pub const READ_TO_ACT: Duration = Duration::from_millis(700);

/// The event documents the agents poll, whose reads bound what an agent could still believe
/// after a change ([`Ctx::still_believable`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Polled {
    /// IMDS' scheduled events.
    Imds,
    /// Azure's scheduled events.
    Azure,
    /// GCE's `maintenance-event`, read by hanging GETs.
    Gce,
}

impl Polled {
    fn of(id: SignalId) -> Option<Polled> {
        match id {
            SignalId::ImdsScheduled => Some(Polled::Imds),
            SignalId::Azure(_) => Some(Polled::Azure),
            SignalId::GceMaintenance => Some(Polled::Gce),
            _ => None,
        }
    }

    /// The met count of a cancel read with time to spare ([`cancels_read_early`]).
    fn read_early_count(self) -> &'static str {
        match self {
            Polled::Imds => JUDGED_READ_BOUND,
            Polled::Azure => JUDGED_AZURE_READ_BOUND,
            Polled::Gce => JUDGED_GCE_READ_BOUND,
        }
    }

    /// How long after a read another agent's could still come: the agents' poll interval
    /// of the document, as the runner sets it (IMDS' and Azure's reads are not told apart
    /// by agent). GCE's reads are each agent's own ([`Ctx::first_read_after`]): none.
    fn poll(self) -> Duration {
        match self {
            Polled::Imds => IMDS_POLL,
            Polled::Azure => AZURE_POLL,
            Polled::Gce => Duration::ZERO,
        }
    }
}

/// Extra allowed on deadlines the agent counts from its first sight of a signal (GCE), plus
/// whatever the process stalled meanwhile ([`Ctx::relative_slack`]).
pub const RELATIVE_SLACK: Duration = Duration::from_millis(1500);

/// The invariants, by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Invariant {
    /// A match ended by lastcall without a current deadline within the pod's grace.
    MatchEndedEarly,
    /// An eviction or pod DELETE by lastcall without a uid precondition, or overriding the
    /// pod's own grace period.
    MatchEndedUngracefully,
    /// An Allocated server deleted by lastcall.
    AllocatedDeleted,
    /// With the exclusion selector, an allocation after lastcall's fence write to the server.
    AllocatedAfterFence,
    /// A drain deadline announced later than the earliest current deadline.
    AnnouncedTooLate,
    /// A second DeregisterGameServer, or a FleetIQ lifecycle call after the first.
    DeregisteredTwice,
    /// Uncordoned or untainted by lastcall after deregistration.
    UncordonedAfterDeregister,
    /// Something lastcall did not write removed by lastcall.
    ForeignRemoved,
    /// lastcall's marks left after the drain was cancelled.
    LeftAfterCancel,
    /// The drain undone while a signal stayed live.
    UndoneWhileLive,
    /// The drain did not end within the bound after the signals settled.
    DrainNeverEnded,
    /// `CompleteLifecycleAction` while a match ran on the node, or before deregistration.
    AsgCompletedEarly,
    /// More than one successful `CompleteLifecycleAction`.
    AsgCompletedTwice,
    /// The termination hook timed out while a match ran (no heartbeat kept it).
    AsgTimedOut,
    /// An Azure event approved while a match ran.
    AzureApprovedEarly,
    /// An Azure event approved more than once.
    AzureApprovedTwice,
    /// An agent stopped in a rollout whose stop returned an error or never ended.
    AgentStopFailed,
    /// An agent wrote while the Node's owner annotation named another agent's pod.
    StandbyWrote,
    /// The machine handed over (deregistered, lifecycle action completed, Azure event
    /// approved) while a game-server pod was on the node, terminating ones included.
    HandedOverBusy,
    /// Liveness: a match `eviction.safe` lets lastcall end for a live hard deadline was not
    /// asked to end by deadline − grace (plus the reaction time): the machine would go
    /// under it with no graceful termination.
    MatchNotEnded,
    /// Liveness: the termination hook timed out on a node that had been empty long enough
    /// to hand it over (the instance waited out the timeout for nothing).
    AsgNotCompleted,
    /// Liveness: with `--azure-approve-when-empty`, an Azure event that asked for the drain
    /// was not approved though the node had been empty long enough.
    AzureNotApproved,
    /// With `--dry-run`, the agent sent a write: to Kubernetes, GameLift, Auto Scaling or
    /// Azure.
    DryRunWrote,
    /// The node deregistered from FleetIQ though no signal had asked for a drain within the
    /// reaction time: a machine handed over that should have been kept (a cancel ignored).
    HandedOverUnasked,
    /// Liveness: a signal asked for a drain and, the reaction time later, still did, yet the
    /// Node carried no `lastcall.dev/drain-started`: a source not heard.
    DrainNotStarted,
    /// A running match's pod deleted by the taint manager: a NoExecute taint (only lastcall
    /// puts one on the node, in compat mode) it did not tolerate. The world ended the match,
    /// so no request of the agent's shows it.
    MatchKilledByTaint,
    /// A FleetIQ machine that came back with nothing asking for a drain was not registered
    /// with FleetIQ again: an old life's deregistration taken as current.
    NotRegisteredAgain,
}

impl Invariant {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::MatchEndedEarly => "match-ended-early",
            Self::MatchEndedUngracefully => "match-ended-ungracefully",
            Self::AllocatedDeleted => "allocated-deleted",
            Self::AllocatedAfterFence => "allocated-after-fence",
            Self::AnnouncedTooLate => "announced-too-late",
            Self::DeregisteredTwice => "deregistered-twice",
            Self::UncordonedAfterDeregister => "uncordoned-after-deregister",
            Self::ForeignRemoved => "foreign-removed",
            Self::LeftAfterCancel => "left-after-cancel",
            Self::UndoneWhileLive => "undone-while-live",
            Self::DrainNeverEnded => "drain-never-ended",
            Self::AsgCompletedEarly => "asg-completed-early",
            Self::AsgCompletedTwice => "asg-completed-twice",
            Self::AsgTimedOut => "asg-timed-out",
            Self::AzureApprovedEarly => "azure-approved-early",
            Self::AzureApprovedTwice => "azure-approved-twice",
            Self::AgentStopFailed => "agent-stop-failed",
            Self::StandbyWrote => "standby-wrote",
            Self::HandedOverBusy => "handed-over-busy",
            Self::MatchNotEnded => "match-not-ended",
            Self::AsgNotCompleted => "asg-not-completed",
            Self::AzureNotApproved => "azure-not-approved",
            Self::DryRunWrote => "dry-run-wrote",
            Self::HandedOverUnasked => "handed-over-unasked",
            Self::DrainNotStarted => "drain-not-started",
            Self::MatchKilledByTaint => "match-killed-by-taint",
            Self::NotRegisteredAgain => "not-registered-again",
        }
    }
}

/// One violation: what, when, and the journal entries (by `seq`) that show it.
#[derive(Clone, Debug)]
pub struct Hit {
    pub invariant: Invariant,
    pub at: SystemTime,
    pub detail: String,
    pub seqs: Vec<u64>,
}

fn ok(e: &JournalEntry) -> bool {
    (200..300).contains(&e.status)
}

/// A request the API server refused before reading its body (restarting, or throttled):
/// the journal keeps nothing of what it asked.
fn refused_unread(e: &JournalEntry) -> bool {
    e.request.is_none() && matches!(e.status, 429 | 503)
}

/// Made by one of the node's agents (each writes as its own user, [`agent_pod`]).
pub fn by_agent(e: &JournalEntry) -> bool {
    e.identity.as_deref().and_then(agent_pod).is_some()
}

fn is_kind(v: &Value, kind: &str) -> bool {
    v["kind"].as_str() == Some(kind)
}

fn label<'a>(v: &'a Value, k: &str) -> Option<&'a str> {
    v["metadata"]["labels"][k].as_str()
}

fn annotation<'a>(v: &'a Value, k: &str) -> Option<&'a str> {
    v["metadata"]["annotations"][k].as_str()
}

fn taint_keys(v: &Value) -> BTreeSet<String> {
    v["spec"]["taints"]
        .as_array()
        .map(|t| {
            t.iter()
                .filter_map(|t| t["key"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

fn unschedulable(v: &Value) -> bool {
    v["spec"]["unschedulable"].as_bool().unwrap_or(false)
}

fn parse_time(s: &str) -> Option<SystemTime> {
    let t: jiff::Timestamp = s.parse().ok()?;
    Some(SystemTime::from(t))
}

/// Keys lastcall owns on a Node (its manual label belongs to the operator); in compat mode
/// also the original adapter's taints, which only it writes here.
fn own_key(k: &str, compat: bool) -> bool {
    (k.starts_with("lastcall.dev/") && k != "lastcall.dev/drain")
        || (compat && [COMPAT_ACTIVE, COMPAT_DRAINING].contains(&k))
}

/// Keys the cluster model writes without going through the API (so absent from the
/// journal's history): never judged.
fn model_key(k: &str) -> bool {
    k.starts_with("node.kubernetes.io/")
}

/// How long, within `[from, to]`, the process could not run: the overlap of each stall
/// (its end, its length) with the window.
pub fn stalled_within(
    stalls: &[(SystemTime, Duration)],
    from: SystemTime,
    to: SystemTime,
) -> Duration {
    stalls
        .iter()
        .map(|(end, len)| {
            let start = end.checked_sub(*len).unwrap_or(*end);
            let (a, b) = (start.max(from), (*end).min(to));
            b.duration_since(a).unwrap_or_default()
        })
        .sum()
}

struct Ctx<'a> {
    run: &'a Run,
    truth: Truth,
    /// When a server's match ended (the game's `Shutdown()`), by name.
    ended: BTreeMap<String, SystemTime>,
    /// The `seq` of a server's successful allocation (0: allocated before the start).
    allocated: BTreeMap<String, u64>,
    /// When a server (or its pod) was first deleted or evicted, by name.
    gone: BTreeMap<String, SystemTime>,
    /// When the machine came back (each starts a new life).
    returns: Vec<SystemTime>,
    /// When each server was reserved by its game, and until when (`None`: still at the end).
    reserved: BTreeMap<String, Vec<(SystemTime, Option<SystemTime>)>>,
    /// How many cases each liveness check judged (not just could have): coverage.
    judged: std::cell::RefCell<BTreeMap<&'static str, usize>>,
    /// When each agent pod's client was closed by a 429 with `Retry-After`: (pod, from, to).
    paused: Vec<(String, SystemTime, SystemTime)>,
}

/// When each agent's client was held closed by the API server's 429s with `Retry-After`
/// (which the agent must honour by sending nothing): from the refusal to that agent's first
/// request the API server journaled once the wait it asked for was over. How much longer than
/// the wait the agent held back (its jitter) is read from the journal's order, never copied
/// from the agent; an agent that sent nothing after it is held for the wait asked only (one
/// that never comes back is caught by the liveness checks and the settle). A 429 to an
/// eviction is a PodDisruptionBudget's refusal, not a throttle.
fn throttle_pauses(
    journal: &[JournalEntry],
    retry_after: Duration,
) -> Vec<(String, SystemTime, SystemTime)> {
    let mut out = vec![];
    for e in journal {
        let Some(pod) = e.identity.as_deref().and_then(agent_pod) else {
            continue;
        };
        if e.status != 429 || e.subresource.as_deref() == Some("eviction") {
            continue;
        }
        let open = e.at + retry_after;
        let next = journal
            .iter()
            .filter(|n| n.identity == e.identity && n.at >= open)
            .map(|n| n.at)
            .min()
            .unwrap_or(open);
        out.push((pod.to_string(), e.at, next));
    }
    out
}

impl Ctx<'_> {
    fn judged(&self, what: &'static str) {
        *self.judged.borrow_mut().entry(what).or_default() += 1;
    }

    /// Which life of the machine `t` is in (0 before any return).
    fn life_of(&self, t: SystemTime) -> usize {
        self.returns.iter().filter(|r| **r <= t).count()
    }

    /// When `life` began: the run's start, or the machine's return.
    fn life_start(&self, life: usize) -> SystemTime {
        life.checked_sub(1)
            .and_then(|i| self.returns.get(i).copied())
            .unwrap_or(self.run.t0)
    }

    /// Whether a drain was asked for as `life` began (within the reaction time of its start):
    /// an agent starting then rightly registers nothing with FleetIQ.
    fn drain_asked_at_start(&self, life: usize) -> bool {
        let start = self.life_start(life);
        self.truth
            .during(start, start + lag() * 2)
            .into_iter()
            .any(asks_drain)
    }

    /// The first successful `DeregisterGameServer` of `life`.
    fn deregistered_in(&self, life: usize) -> Option<&gamelift::Call> {
        self.run.calls.iter().find(|c| {
            c.op == "DeregisterGameServer" && c.outcome == "ok" && self.life_of(c.at) == life
        })
    }

    /// Whether GameLift held the game server registered in `life`: a successful
    /// `RegisterGameServer` then, or a registration that stood from before the life began
    /// and was not ended in it (GameLift answers a second registration of a registered game
    /// server with a conflict: one that never left need not, and cannot, register again).
    fn registered_in(&self, life: usize) -> bool {
        let start = self.life_start(life);
        let ok = |c: &&gamelift::Call, op: &str| c.op == op && c.outcome == "ok";
        let registered_then = self
            .run
            .calls
            .iter()
            .any(|c| ok(&c, "RegisterGameServer") && self.life_of(c.at) == life);
        // The registration as the life began: the last successful Register or Deregister
        // before it, or GameLift dropping the server on its own.
        let mut events: Vec<(SystemTime, bool)> = self
            .run
            .calls
            .iter()
            .filter(|c| c.at < start)
            .filter_map(|c| match c.op.as_str() {
                "RegisterGameServer" if c.outcome == "ok" => Some((c.at, true)),
                "DeregisterGameServer" if c.outcome == "ok" => Some((c.at, false)),
                _ => None,
            })
            .collect();
        events.extend(
            self.run
                .applied
                .iter()
                .filter(|a| {
                    matches!(a.action, Action::GameLiftForgets) && a.note == "true" && a.at < start
                })
                .map(|a| (a.at, false)),
        );
        let stood = events.iter().max_by_key(|(at, _)| *at).is_some_and(|e| e.1)
            && self.deregistered_in(life).is_none()
            && self.forgotten_in(life).is_none();
        registered_then || stood
    }

    /// When GameLift dropped the server on its own during `life`.
    fn forgotten_in(&self, life: usize) -> Option<SystemTime> {
        self.run
            .applied
            .iter()
            .find(|a| {
                matches!(a.action, Action::GameLiftForgets)
                    && a.note == "true"
                    && self.life_of(a.at) == life
            })
            .map(|a| a.at)
    }

    /// The reaction time allowed for write `e`: [`Ctx::base_lag_for`] its writer, plus
    /// however long the process could not run within it (a stall delays the agent as much
    /// as it delays the clock's hands; on a quiet machine there are none).
    fn lag_for(&self, e: &JournalEntry) -> Duration {
        let t = e.at;
        let writer = e.identity.as_deref().and_then(agent_pod);
        let base = self.base_lag_for(t, writer);
        let mut allowed = base;
        for _ in 0..8 {
            let from = t.checked_sub(allowed).unwrap_or(t);
            let next = base + self.stalled(from, t) + self.throttled(writer, from, t);
            if next == allowed {
                break;
            }
            allowed = next;
        }
        allowed
    }

    /// Whether a write at `t` was judged only by a state of the truth already past: the
    /// reaction window was used (counted, so a run shows how much it leans on it).
    fn window_used(&self, _at: SystemTime, justified_now: bool) {
        self.judged(WINDOW_JUDGED);
        if !justified_now {
            self.judged(WINDOW_USED);
        }
    }

    /// Whether the writer of `e` could still have believed a state that `end` ended: always
    /// while it held, and after any change but a polled event document's ([`Polled`]: an
    /// IMDS or Azure event listed, moved or gone, GCE's `maintenance-event` set or back to
    /// `NONE`) within the reaction window.
    /// After those, only until the first read of the document that saw the change, plus
    /// [`READ_TO_ACT`], one poll (the read may have been another agent's: reads are not told
    /// apart by agent) and whatever the window allows beyond the bare reaction time (a hang,
    /// stalls, a `Retry-After`). Not where an agent started during the run from shortly
    /// before the change to the write: a new instance's first reads come late. Those that
    /// started before the run had set up and were polling.
    fn still_believable(&self, e: &JournalEntry, end: Option<Change>) -> bool {
        let Some((c, Some(id))) = end else {
            return true;
        };
        let Some(source) = Polled::of(id) else {
            return true;
        };
        if self.started_around(c, e.at) {
            return true;
        }
        let writer = e.identity.as_deref().and_then(agent_pod);
        let Some(read) = self.first_read_after(source, c, writer) else {
            return true;
        };
        e.at.duration_since(read)
            .map_or(true, |since| since <= self.read_to_act(e, source))
    }

    /// Whether an agent started during the run from shortly before the change at `c` to
    /// `to`: its first reads may come late, so reads do not bound what it believed.
    fn started_around(&self, c: SystemTime, to: SystemTime) -> bool {
        let from = c.checked_sub(lag() * 2).unwrap_or(c).max(self.run.t0);
        self.run.starts.iter().any(|(s, _)| *s >= from && *s <= to)
    }

    /// The first read of `source`'s document answered after `c`: any agent's for IMDS and
    /// Azure (not told apart), agent pod `reader`'s own for GCE (any agent's for `None`).
    fn first_read_after(
        &self,
        source: Polled,
        c: SystemTime,
        reader: Option<&str>,
    ) -> Option<SystemTime> {
        let reads = match source {
            Polled::Imds => &self.run.imds_scheduled_reads,
            Polled::Azure => &self.run.azure_event_reads,
            Polled::Gce => {
                return self
                    .run
                    .gce_maintenance_reads
                    .iter()
                    .find(|(r, pod)| *r > c && reader.is_none_or(|w| w == pod))
                    .map(|(r, _)| *r);
            }
        };
        reads.iter().find(|r| **r > c).copied()
    }

    /// How long after the first read that showed a change the writer of `e` may still act
    /// on what it read before ([`still_believable`](Self::still_believable)).
    fn read_to_act(&self, e: &JournalEntry, source: Polled) -> Duration {
        READ_TO_ACT + source.poll() + self.lag_for(e).saturating_sub(lag())
    }

    /// When the agent instance that made `e` started: the last start in its pod at or
    /// before it (a restart keeps its pod), one request deadline before `e` at the latest. A
    /// request a stopped instance sent may land after its successor started (seed 4264), so
    /// near a start it may be the previous instance's.
    fn instance_start(&self, e: &JournalEntry) -> Option<SystemTime> {
        let pod = e.identity.as_deref().and_then(agent_pod)?;
        let sent_by = e.at.checked_sub(REQUEST_TIMEOUT)?;
        self.run
            .starts
            .iter()
            .filter(|(s, p)| p == pod && *s <= sent_by)
            .map(|(s, _)| *s)
            .next_back()
    }

    /// The reaction time allowed after the truth changed at `c`: as [`Ctx::lag_for`], with
    /// the stalls counted forwards from the change.
    ///
    /// An agent (re)started within the window starts over: it gets its own window from its
    /// start (doubled, as after any start); so does a request made to hang, or an API server
    /// restart, within it. The first agent too, where the signal came before it (a NodeClaim
    /// Karpenter registered the node under); and an agent asked to stop within it, from its
    /// successor's start.
    fn reaction_after(&self, c: SystemTime) -> Duration {
        let base = self.base_lag_at(c + lag());
        let lag = lag();
        let mut allowed = base;
        for _ in 0..8 {
            let end = c + allowed;
            let within = |t: SystemTime| t > c && t <= end;
            let since = |t: SystemTime| t.duration_since(c).unwrap_or_default();
            let mut next =
                base + self.stalled(c, c + allowed) + self.throttled(None, c, c + allowed);
            for (s, _) in self.run.starts.iter().filter(|(s, _)| within(*s)) {
                next = next.max(since(*s) + lag * 2 + self.stalled(*s, *s + lag * 2));
            }
            // A Node write the API server refused (5xx): the window starts over where that
            // agent tried again, by the journal's order (seed 1182: five in a row); how long it
            // backed off is its own. One that never tried again gets no more.
            let node_write = |e: &&JournalEntry| {
                by_agent(e)
                    && e.resource.as_deref() == Some("nodes")
                    && e.name.as_deref() == Some(NODE)
                    && e.subresource.is_none()
                    && e.verb.is_mutating()
            };
            for e in self
                .run
                .journal
                .iter()
                .filter(node_write)
                .filter(|e| e.status >= 500 && within(e.at))
            {
                let retry = self
                    .run
                    .journal
                    .iter()
                    .filter(node_write)
                    .find(|n| n.seq > e.seq && n.identity == e.identity);
                if let Some(r) = retry {
                    next = next.max(since(r.at) + lag + self.stalled(r.at, r.at + lag));
                }
            }
            for a in self.run.applied.iter().filter(|a| within(a.at)) {
                // An agent asked to stop (restarted, killed, the machine back) within the
                // window acts no more: the window starts over at its successor's start,
                // however long the stop took (seed 3327).
                if matches!(
                    a.action,
                    Action::RestartAgent | Action::AbortAgent { .. } | Action::MachineReturns
                ) && let Some((s, _)) = self.run.starts.iter().find(|(s, _)| *s > a.at)
                {
                    next = next.max(since(*s) + lag * 2 + self.stalled(*s, *s + lag * 2));
                }
                let more = match a.action {
                    Action::Fault(KubeFault::HangNode | KubeFault::HangGameServers) => {
                        lag * 2 + REQUEST_TIMEOUT
                    }
                    Action::ApiRestart { down_ms } => {
                        lag + Duration::from_millis(down_ms) + REQUEST_TIMEOUT
                    }
                    _ => continue,
                };
                next = next.max(since(a.at) + more + self.stalled(a.at, a.at + more));
            }
            if next == allowed {
                break;
            }
            allowed = next;
        }
        allowed
    }

    /// How long, within `[from, to]`, the API server's `Retry-After` held `writer`'s client
    /// closed (any agent's, for `None`: the liveness checks, where any agent may act).
    fn throttled(&self, writer: Option<&str>, from: SystemTime, to: SystemTime) -> Duration {
        let spans: Vec<(SystemTime, Duration)> = self
            .paused
            .iter()
            .filter(|(pod, _, _)| writer.is_none_or(|w| w == pod))
            .map(|(_, a, b)| (*b, b.duration_since(*a).unwrap_or_default()))
            .collect();
        // Overlapping pauses (two refusals at once) count once.
        let mut total = Duration::ZERO;
        let mut cursor = from;
        let mut sorted = spans;
        sorted.sort_by_key(|(end, len)| end.checked_sub(*len).unwrap_or(*end));
        for (end, len) in sorted {
            let start = end.checked_sub(len).unwrap_or(end).max(cursor);
            let end = end.min(to);
            if end > start {
                total += end.duration_since(start).unwrap_or_default();
                cursor = end;
            }
        }
        total
    }

    fn stalled(&self, from: SystemTime, to: SystemTime) -> Duration {
        stalled_within(&self.run.stalls, from, to)
    }

    /// How much later than the truth's a deadline counted from the agent's first sight may
    /// be, for a judgement of `[from, to]`: [`RELATIVE_SLACK`], and the stalls within (the
    /// agent's first sight is as late as the process could run).
    fn relative_slack(&self, from: SystemTime, to: SystemTime) -> Duration {
        RELATIVE_SLACK + self.stalled(from.checked_sub(RELATIVE_SLACK).unwrap_or(from), to)
    }

    /// The reaction time allowed at `t` on a machine that runs the process: doubled shortly
    /// after any agent (re)start, which reads every source and the cluster afresh; one
    /// request deadline more after a request was made to hang (the agent waits that long
    /// for it, then retries), and after an API server restart its downtime and one request
    /// deadline more (then every watch re-lists). For the liveness checks, where any agent
    /// may act.
    fn base_lag_at(&self, t: SystemTime) -> Duration {
        let restarted = self
            .run
            .starts
            .iter()
            .skip(1)
            .any(|(s, _)| Self::within(*s, t, lag() * 2));
        self.with_hangs(t, restarted)
    }

    /// As [`Ctx::base_lag_at`] for a write by agent pod `writer`: doubled only after that
    /// instance's own start (another agent starting beside it changes nothing it knows).
    fn base_lag_for(&self, t: SystemTime, writer: Option<&str>) -> Duration {
        let restarted = self
            .run
            .starts
            .iter()
            .skip(1)
            .any(|(s, pod)| Some(pod.as_str()) == writer && Self::within(*s, t, lag() * 2));
        self.with_hangs(t, restarted)
    }

    fn within(from: SystemTime, t: SystemTime, d: Duration) -> bool {
        from <= t && t.duration_since(from).unwrap_or_default() < d
    }

    fn with_hangs(&self, t: SystemTime, restarted: bool) -> Duration {
        let lag = lag();
        let hung = self.run.applied.iter().any(|a| {
            matches!(
                a.action,
                Action::Fault(KubeFault::HangNode | KubeFault::HangGameServers)
            ) && Self::within(a.at, t, lag * 2 + REQUEST_TIMEOUT)
        });
        // An API server restart: down for a moment, then every watch re-lists.
        let down: Duration = self
            .run
            .applied
            .iter()
            .filter_map(|a| match a.action {
                Action::ApiRestart { down_ms } => {
                    let down = Duration::from_millis(down_ms);
                    Self::within(a.at, t, lag * 2 + down + REQUEST_TIMEOUT)
                        .then_some(down + REQUEST_TIMEOUT)
                }
                _ => None,
            })
            .sum();
        let base = if restarted { lag * 2 } else { lag } + down;
        if hung { base + REQUEST_TIMEOUT } else { base }
    }

    /// Servers whose match was running at `at`: allocated (by `known` before, so the agent
    /// could know), not ended by the game, and neither deleted nor evicted.
    fn running_at(&self, at: SystemTime, known: Duration) -> Vec<String> {
        let known = at.checked_sub(known).unwrap_or(at);
        self.allocated
            .keys()
            .filter(|name| {
                self.allocated_at(name).is_some_and(|t| t <= known)
                    && self.ended.get(*name).is_none_or(|t| *t > at)
                    && self.gone.get(*name).is_none_or(|t| *t > at)
            })
            .cloned()
            .collect()
    }

    /// When `name` was first allocated (before the start: long known).
    fn allocated_at(&self, name: &str) -> Option<SystemTime> {
        match *self.allocated.get(name)? {
            0 => Some(SystemTime::UNIX_EPOCH),
            seq => self.run.journal.iter().find(|e| e.seq == seq).map(|e| e.at),
        }
    }

    /// Whether the game had reserved `name` at `at` (and not ended since).
    fn reserved_at(&self, name: &str, at: SystemTime) -> bool {
        self.reserved.get(name).is_some_and(|spans| {
            spans
                .iter()
                .any(|(from, to)| *from <= at && to.is_none_or(|t| at < t))
        }) && self.ended.get(name).is_none_or(|t| *t > at)
    }

    fn in_use(&self, name: &str, seq: u64, at: SystemTime) -> bool {
        self.allocated.get(name).is_some_and(|s| *s < seq)
            && self.ended.get(name).is_none_or(|t| *t > at)
    }
}

/// What the liveness checks judged in a run: a check that never judged proves nothing.
pub const JUDGED_DEADLINE: &str = "a match due to end by deadline − grace";
pub const JUDGED_ASG: &str = "a hook timing out after the node emptied";
pub const JUDGED_AZURE: &str = "an Azure event listed on an empty node";
pub const JUDGED_STARTED: &str = "a signal asking for a drain the reaction time long";
/// An IMDS cancel read with time to spare before a match lastcall may end was due: a match
/// ended at the old time would be judged by the reads that saw the cancel, not the window.
pub const JUDGED_READ_BOUND: &str = "an IMDS cancel read before a match was due";
/// The same for an Azure event gone from the document.
pub const JUDGED_AZURE_READ_BOUND: &str = "an Azure event's removal read before a match was due";
/// The same for GCE's `maintenance-event` back to `NONE`.
pub const JUDGED_GCE_READ_BOUND: &str = "a GCE maintenance cancel read before a match was due";
/// Writes judged against the truth (matches ended, deadlines announced, drains undone).
pub const WINDOW_JUDGED: &str = "a write judged against the truth";
/// Of those, the ones only a state already past justified: the reaction window used.
pub const WINDOW_USED: &str = "a write justified only by its reaction window";

/// Counts [`JUDGED_READ_BOUND`], [`JUDGED_AZURE_READ_BOUND`] and [`JUDGED_GCE_READ_BOUND`]: where
/// [`Ctx::still_believable`] would decide a match ended at a cancelled event's old deadline.
fn cancels_read_early(cx: &Ctx<'_>) {
    if cx.run.timeline.allocated[Safe::Always as usize] == 0 {
        return;
    }
    let grace = Duration::from_secs(cx.run.timeline.grace_of(Safe::Always) as u64);
    let mut deadlines: BTreeMap<SignalId, SystemTime> = BTreeMap::new();
    for a in &cx.run.applied {
        let Some((id, s)) = a.effect else { continue };
        let cancel = match &a.action {
            Action::ImdsScheduled { .. } | Action::AzureEvent { .. } | Action::GceTerminate => {
                // A repeated GCE TERMINATE is the same event: its end stays where it was.
                let anchored = a.action == Action::GceTerminate && deadlines.contains_key(&id);
                if let Some(hard) = s.and_then(|s| s.hard)
                    && !anchored
                {
                    deadlines.insert(id, hard);
                }
                continue;
            }
            Action::ImdsScheduledCancel | Action::AzureGone { .. } | Action::GceNone => id,
            _ => continue,
        };
        let Some(source) = Polled::of(cancel) else {
            continue;
        };
        let Some(due) = deadlines.remove(&cancel).and_then(|d| d.checked_sub(grace)) else {
            continue;
        };
        if !cx.started_around(a.at, due)
            && cx
                .first_read_after(source, a.at, None)
                .is_some_and(|r| r + READ_TO_ACT + source.poll() < due)
        {
            cx.judged(source.read_early_count());
        }
    }
}

/// Every invariant hit of `run`.
pub fn check(run: &Run) -> Vec<Hit> {
    check_counted(run).0
}

/// Every invariant hit of `run`, and how many cases each liveness check judged.
pub fn check_counted(run: &Run) -> (Vec<Hit>, BTreeMap<&'static str, usize>) {
    let truth = Truth::build(&run.applied);
    let mut ended = BTreeMap::new();
    for a in &run.applied {
        if matches!(a.action, Action::EndMatch) {
            for n in a.note.split(',').filter(|s| !s.is_empty()) {
                ended.entry(n.to_string()).or_insert(a.at);
            }
        }
    }
    let mut allocated: BTreeMap<String, u64> = run
        .allocated_at_start
        .iter()
        .map(|n| (n.clone(), 0))
        .collect();
    for e in &run.journal {
        if e.identity.as_deref() == Some(ALLOCATOR)
            && e.verb == Verb::Update
            && e.resource.as_deref() == Some("gameservers")
            && ok(e)
            && let Some(name) = &e.name
        {
            allocated.entry(name.clone()).or_insert(e.seq);
        }
    }
    let mut gone = BTreeMap::new();
    for e in &run.journal {
        let removes = matches!(e.resource.as_deref(), Some("pods" | "gameservers"))
            && ok(e)
            && ((e.verb == Verb::Create && e.subresource.as_deref() == Some("eviction"))
                || (e.verb == Verb::Delete && e.subresource.is_none()));
        if removes && let Some(name) = &e.name {
            gone.entry(name.clone()).or_insert(e.at);
        }
    }
    let returns = run
        .applied
        .iter()
        .filter(|a| matches!(a.action, Action::MachineReturns))
        .map(|a| a.at)
        .collect();
    let mut reserved: BTreeMap<String, Vec<(SystemTime, Option<SystemTime>)>> = BTreeMap::new();
    for a in &run.applied {
        match a.action {
            Action::Reserve if !a.note.is_empty() => {
                reserved
                    .entry(a.note.clone())
                    .or_default()
                    .push((a.at, None));
            }
            Action::Unreserve if !a.note.is_empty() => {
                if let Some(open) = reserved
                    .get_mut(&a.note)
                    .and_then(|spans| spans.iter_mut().rfind(|(_, to)| to.is_none()))
                {
                    open.1 = Some(a.at);
                }
            }
            _ => {}
        }
    }
    let cx = Ctx {
        run,
        truth,
        ended,
        allocated,
        gone,
        returns,
        reserved,
        judged: Default::default(),
        paused: throttle_pauses(&run.journal, super::runner::RELEASE_RETRY_AFTER),
    };
    let mut hits = vec![];
    if run.timeline.mode.dry_run {
        // The whole promise of a dry run: nothing sent. Nothing else is judged (no drain
        // happens, so the liveness checks would only count what the flag forbids).
        dry_run_writes(&cx, &mut hits);
        hits.sort_by_key(|h| h.at);
        return (hits, cx.judged.take());
    }
    matches_ended(&cx, &mut hits);
    cancels_read_early(&cx);
    killed_by_taint(&cx, &mut hits);
    servers(&cx, &mut hits);
    announced(&cx, &mut hits);
    deregistration(&cx, &mut hits);
    node_writes(&cx, &mut hits);
    settled(&cx, &mut hits);
    asg_lifecycle(&cx, &mut hits);
    azure_approvals(&cx, &mut hits);
    standby(&cx, &mut hits);
    handed_over_busy(&cx, &mut hits);
    handed_over_unasked(&cx, &mut hits);
    drain_started_in_time(&cx, &mut hits);
    registered_again(&cx, &mut hits);
    matches_ended_in_time(&cx, &mut hits);
    asg_completed_once_empty(&cx, &mut hits);
    azure_approved_once_empty(&cx, &mut hits);
    for e in &run.agent_errors {
        hits.push(Hit {
            invariant: Invariant::AgentStopFailed,
            at: run.settled_from,
            detail: e.clone(),
            seqs: vec![],
        });
    }
    hits.sort_by_key(|h| h.at);
    (hits, cx.judged.take())
}

/// No match is ended by the world on lastcall's account: the pod of a server in use
/// (allocated before and not ended by its game, or reserved) deleted by the taint manager.
fn killed_by_taint(cx: &Ctx<'_>, hits: &mut Vec<Hit>) {
    for p in &cx.run.pods {
        let Some(at) = p.taint_deleted else { continue };
        let running = cx.allocated_at(&p.name).is_some_and(|t| t <= at)
            && cx.ended.get(&p.name).is_none_or(|t| *t > at);
        if !running && !cx.reserved_at(&p.name, at) {
            continue;
        }
        // The Node write that put the NoExecute taint there, for the report.
        let tainted = cx.run.journal.iter().rfind(|e| {
            is_node_write(e)
                && e.at <= at
                && e.response.as_deref().is_some_and(|v| {
                    v["spec"]["taints"]
                        .as_array()
                        .is_some_and(|ts| ts.iter().any(|t| t["effect"] == "NoExecute"))
                })
        });
        hits.push(Hit {
            invariant: Invariant::MatchKilledByTaint,
            at,
            detail: format!(
                "{}'s pod deleted by the taint manager while its match ran",
                p.name
            ),
            seqs: tainted.map(|e| e.seq).into_iter().collect(),
        });
    }
}

/// With `--dry-run`, no write leaves the agent: no mutating Kubernetes request (answered or
/// not), no GameLift write, no Auto Scaling call but reads, no Azure approval.
fn dry_run_writes(cx: &Ctx<'_>, hits: &mut Vec<Hit>) {
    let mut hit = |at: SystemTime, detail: String, seqs: Vec<u64>| {
        hits.push(Hit {
            invariant: Invariant::DryRunWrote,
            at,
            detail,
            seqs,
        });
    };
    for e in cx
        .run
        .journal
        .iter()
        .filter(|e| by_agent(e) && e.verb.is_mutating())
    {
        hit(
            e.at,
            format!("{} {}{} ({})", e.method, e.path, e.query, e.status),
            vec![e.seq],
        );
    }
    // GameLift's writes, by name: its journal also holds whatever else reached its port (a
    // request for another server: seed 1980 saw a Kubernetes path there).
    let gamelift_write = |op: &str| {
        matches!(
            op,
            "RegisterGameServer" | "UpdateGameServer" | "ClaimGameServer" | "DeregisterGameServer"
        )
    };
    for c in cx.run.calls.iter().filter(|c| gamelift_write(&c.op)) {
        hit(c.at, format!("GameLift {} ({})", c.op, c.outcome), vec![]);
    }
    for (at, h) in &cx.run.asg {
        if let Happening::Call { action, .. } = h
            && !action.starts_with("Describe")
        {
            hit(*at, format!("Auto Scaling {action}"), vec![]);
        }
    }
    for (id, at) in &cx.run.azure_approvals {
        hit(*at, format!("Azure approval of {id}"), vec![]);
    }
}

/// No match ended by lastcall (eviction or pod DELETE of an in-use server's pod) unless a
/// live hard deadline that `eviction.safe` lets it act on was within the pod's grace.
fn matches_ended(cx: &Ctx<'_>, hits: &mut Vec<Hit>) {
    let tl = &cx.run.timeline;
    // Every ending request, accepted or not, asks for the pod's own graceful termination:
    // judged by its body, so not where the server refused it unread (restarting, or
    // throttled: seed 140, an eviction answered 503 while the API server restarted).
    for e in cx
        .run
        .journal
        .iter()
        .filter(|e| by_agent(e) && ends_a_match(e) && !refused_unread(e))
    {
        let grace = e
            .name
            .as_deref()
            .and_then(Safe::of_server)
            .map(|safe| tl.grace_of(safe));
        let faults = request_faults(e, None, grace);
        if !faults.is_empty() {
            hits.push(Hit {
                invariant: Invariant::MatchEndedUngracefully,
                at: e.at,
                detail: format!("{:?}: {}", e.name, faults.join("; ")),
                seqs: vec![e.seq],
            });
        }
    }
    for e in cx.run.journal.iter().filter(|e| by_agent(e) && ok(e)) {
        let ends = ends_a_match(e);
        let Some(pod) = e.name.as_deref() else {
            continue;
        };
        if !ends || !(cx.in_use(pod, e.seq, e.at) || cx.reserved_at(pod, e.at)) {
            continue;
        }
        let Some(safe) = Safe::of_server(pod) else {
            continue;
        };
        let grace = Duration::from_secs(tl.grace_of(safe) as u64);
        let justifies_by = |live: &Live, relative_only: bool| {
            live.values().any(|s| {
                (s.relative || !relative_only)
                    && s.hard
                        .is_some_and(|d| d <= e.at + grace + Duration::from_millis(50))
                    && consent(safe, s, tl.graceful_termination).allows()
            })
        };
        let justifies = |live: &Live| justifies_by(live, false);
        // Not before the writer's instance started: it read no source before then, and the
        // drain it found recorded on the Node ends no match until a source confirms it. But a
        // deadline counted from first sight (GCE's notices, FleetIQ's Spot) is kept from the
        // record once its source says the same again: the agent cannot tell a repeat from the
        // same event, so over the whole window for those (seed 2314).
        let window = e.at.checked_sub(cx.lag_for(e)).unwrap_or(e.at);
        let from = cx.instance_start(e).map_or(window, |s| window.max(s));
        let states = cx.truth.during_with_ends(from, e.at);
        let justified = states
            .iter()
            .any(|(live, end)| justifies(live) && cx.still_believable(e, *end))
            || cx
                .truth
                .during_with_ends(window, e.at)
                .into_iter()
                .any(|(l, end)| justifies_by(l, true) && cx.still_believable(e, end));
        // Justified by the window alone, but not once the source's reads bound it.
        let read_bound = if justified {
            None
        } else {
            states
                .iter()
                .filter(|(live, _)| justifies(live))
                .find_map(|(_, end)| end.and_then(|(_, id)| id).and_then(Polled::of))
        };
        if justified {
            cx.window_used(e.at, justifies(cx.truth.at(e.at)));
        } else {
            hits.push(Hit {
                invariant: Invariant::MatchEndedEarly,
                at: e.at,
                detail: format!(
                    "{} {pod} ({safe:?}, grace {}s) with live signals {:?}{}",
                    if e.verb == Verb::Create {
                        "evicted"
                    } else {
                        "deleted pod"
                    },
                    grace.as_secs(),
                    cx.truth.at(e.at),
                    if let Some(source) = read_bound {
                        format!(
                            " (a read of {source:?}'s events showed the change more than {} ms before)",
                            cx.read_to_act(e, source).as_millis()
                        )
                    } else if from > window {
                        format!(
                            " (judged from its instance's start, {} ms before)",
                            e.at.duration_since(from).unwrap_or_default().as_millis()
                        )
                    } else {
                        String::new()
                    }
                ),
                seqs: vec![e.seq],
            });
        }
    }
}

/// No in-use server deleted by lastcall; with the exclusion selector, no allocation of a
/// server whose last write by lastcall marked it draining (or deleted it)
/// ([`allocated_after_marked`], the rule every race test holds the agent to).
fn servers(cx: &Ctx<'_>, hits: &mut Vec<Hit>) {
    for e in &cx.run.journal {
        if e.resource.as_deref() != Some("gameservers") || !ok(e) {
            continue;
        }
        let Some(name) = e.name.as_deref() else {
            continue;
        };
        if by_agent(e) && e.verb == Verb::Delete && cx.in_use(name, e.seq, e.at) {
            hits.push(Hit {
                invariant: Invariant::AllocatedDeleted,
                at: e.at,
                detail: format!("deleted in-use {name}"),
                seqs: vec![cx.allocated.get(name).copied().unwrap_or(0), e.seq],
            });
        }
        // The world's own word: the server as the API server answered the DELETE.
        let state = e
            .response
            .as_deref()
            .filter(|v| is_kind(v, "GameServer"))
            .and_then(|v| v["status"]["state"].as_str());
        if by_agent(e)
            && e.verb == Verb::Delete
            && matches!(state, Some("Allocated" | "Reserved"))
            && !cx.in_use(name, e.seq, e.at)
        {
            hits.push(Hit {
                invariant: Invariant::AllocatedDeleted,
                at: e.at,
                detail: format!("deleted {name} while {}", state.unwrap_or_default()),
                seqs: vec![e.seq],
            });
        }
    }
    if !cx.run.timeline.exclusion_selector {
        return;
    }
    for late in allocated_after_marked(&cx.run.journal, by_agent, ALLOCATOR) {
        let at = cx
            .run
            .journal
            .iter()
            .find(|e| e.seq == late.seq)
            .map_or(cx.run.settled_from, |e| e.at);
        hits.push(Hit {
            invariant: Invariant::AllocatedAfterFence,
            at,
            detail: format!(
                "{} allocated after lastcall's write #{}",
                late.name, late.after
            ),
            seqs: vec![late.after, late.seq],
        });
    }
}

/// The deadline announced on game servers is never later than the earliest current hard
/// deadline: neither when written, nor left standing after the deadline moved earlier.
fn announced(cx: &Ctx<'_>, hits: &mut Vec<Hit>) {
    let bound = |from: SystemTime, to: SystemTime| -> Option<SystemTime> {
        // The latest earliest-deadline over the window; None when some moment had none.
        let mut worst = Some(SystemTime::UNIX_EPOCH);
        let slack = cx.relative_slack(from, to);
        for live in cx.truth.during(from, to) {
            match (earliest(live, to, slack), worst) {
                (None, _) => worst = None,
                (Some(d), Some(w)) => worst = Some(w.max(d)),
                (Some(_), None) => {}
            }
        }
        worst
    };
    // Per server: (at, seq, announced value) of every accepted write, in order.
    let mut history: BTreeMap<String, Vec<(SystemTime, u64, Option<SystemTime>)>> = BTreeMap::new();
    for e in cx
        .run
        .journal
        .iter()
        .filter(|e| e.resource.as_deref() == Some("gameservers") && ok(e))
    {
        let (Some(name), Some(v)) = (e.name.as_deref(), e.response.as_deref()) else {
            continue;
        };
        if !is_kind(v, "GameServer") {
            continue;
        }
        let value = annotation(v, "lastcall.dev/drain-deadline");
        let parsed = value.and_then(parse_time);
        history
            .entry(name.to_string())
            .or_default()
            .push((e.at, e.seq, parsed));
        // A DELETE's answer is the object as it stood: what it carries was written before
        // (and is judged there), not by the DELETE.
        let judged = (by_agent(e) && e.verb != Verb::Delete)
            .then_some(parsed)
            .flatten()
            .zip(bound(e.at.checked_sub(cx.lag_for(e)).unwrap_or(e.at), e.at));
        if let Some((d, b)) = judged
            && d <= b
        {
            cx.window_used(e.at, bound(e.at, e.at).is_none_or(|now| d <= now));
        }
        if let Some((d, b)) = judged
            && d > b
        {
            hits.push(Hit {
                invariant: Invariant::AnnouncedTooLate,
                at: e.at,
                detail: format!(
                    "{name}: wrote {} while the earliest current deadline was {}",
                    value.unwrap_or_default(),
                    jiff::Timestamp::try_from(b)
                        .map(|t| t.to_string())
                        .unwrap_or_default()
                ),
                seqs: vec![e.seq],
            });
        }
    }
    // Left standing: the lag after each change of the truth, every in-use server's value.
    for c in cx.truth.changes() {
        let at = c + cx.reaction_after(c);
        let Some(b) = bound(c, at) else { continue };
        for (name, h) in &history {
            let Some((_, seq, Some(d))) = h.iter().rev().find(|(t, _, _)| *t <= at) else {
                continue;
            };
            // A match whose pod was already evicted or deleted (by lastcall at an earlier
            // deadline, within the rules, or by anyone) has been told to end: there is
            // nothing left to announce to it.
            let told_to_end = cx.gone.get(name).is_some_and(|t| *t <= at);
            if *d > b && cx.in_use(name, *seq + 1, at) && !told_to_end {
                hits.push(Hit {
                    invariant: Invariant::AnnouncedTooLate,
                    at,
                    detail: format!(
                        "{name}: still announced {} {} ms after the earliest deadline became {}",
                        jiff::Timestamp::try_from(*d)
                            .map(|t| t.to_string())
                            .unwrap_or_default(),
                        at.duration_since(c).unwrap_or_default().as_millis(),
                        jiff::Timestamp::try_from(b)
                            .map(|t| t.to_string())
                            .unwrap_or_default()
                    ),
                    seqs: vec![*seq],
                });
            }
        }
    }
}

/// At most one DeregisterGameServer, no FleetIQ lifecycle call after it, and the node
/// never uncordoned or untainted by lastcall after it.
fn deregistration(cx: &Ctx<'_>, hits: &mut Vec<Hit>) {
    // Each life of the machine is judged on its own: one that came back registers again.
    for life in 0..=cx.returns.len() {
        let Some(first) = cx.deregistered_in(life) else {
            continue;
        };
        // The agent never heard the first one succeed: it goes on as registered (asks
        // again, heartbeats) until GameLift says the server is gone; a call that found
        // nothing changed nothing.
        let unheard = cx.run.answers_lost.contains(&first.seq);
        for c in cx
            .run
            .calls
            .iter()
            .filter(|c| c.seq > first.seq && cx.life_of(c.at) == life)
        {
            if unheard && c.outcome != "ok" {
                continue;
            }
            if matches!(
                c.op.as_str(),
                "DeregisterGameServer"
                    | "RegisterGameServer"
                    | "UpdateGameServer"
                    | "ClaimGameServer"
            ) {
                hits.push(Hit {
                    invariant: Invariant::DeregisteredTwice,
                    at: c.at,
                    detail: format!(
                        "GameLift {} ({}) after DeregisterGameServer #{}",
                        c.op, c.outcome, first.seq
                    ),
                    seqs: vec![],
                });
            }
        }
        let mut prev: Option<&Value> = None;
        for e in cx.run.journal.iter().filter(|e| is_node_write(e)) {
            let Some(v) = e.response.as_deref() else {
                continue;
            };
            if let Some(p) = prev
                && by_agent(e)
                && e.at > first.at
                && cx.life_of(e.at) == life
            {
                let uncordoned = unschedulable(p) && !unschedulable(v);
                let untainted = taint_keys(p).contains("lastcall.dev/draining")
                    && !taint_keys(v).contains("lastcall.dev/draining");
                if uncordoned || untainted {
                    hits.push(Hit {
                        invariant: Invariant::UncordonedAfterDeregister,
                        at: e.at,
                        detail: format!(
                            "{} after the deregistration",
                            if uncordoned {
                                "uncordoned"
                            } else {
                                "untainted"
                            }
                        ),
                        seqs: vec![e.seq],
                    });
                }
            }
            prev = Some(v);
        }
    }
}

/// Liveness: every signal that asks for a drain and still does the reaction time later finds
/// the drain started by then (`lastcall.dev/drain-started` on the Node, by the journal's
/// last Node state). Judged from each moment a signal appears that none live before asked
/// for; the Auto Scaling wait is seen late (its own slack), and a GCE signal the agent may
/// not have read (a metadata glitch) is not judged.
fn drain_started_in_time(cx: &Ctx<'_>, hits: &mut Vec<Hit>) {
    let mut before: Option<&Live> = None;
    let mut starts = vec![];
    for c in std::iter::once(SystemTime::UNIX_EPOCH).chain(cx.truth.changes()) {
        let live = cx.truth.at(c);
        let was = before.is_some_and(asks_drain);
        if asks_drain(live) && !was {
            starts.push(c);
        }
        before = Some(live);
    }
    for a in starts {
        let live = cx.truth.at(a);
        let slack = live
            .keys()
            .map(|id| super::truth::extra_slack(*id))
            .max()
            .unwrap_or_default();
        let due = a + cx.reaction_after(a) + slack;
        if due > cx.run.settled_from {
            continue;
        }
        // Asked for all along: some signal live at every moment until the due time.
        if cx.truth.during(a, due).iter().any(|l| !asks_drain(l)) {
            continue;
        }
        // Where GCE alone asks, at the start or at the due time (another signal that asked
        // first may have cleared meanwhile), a metadata glitch may have kept the agent from
        // reading it: an unreadable source starts nothing.
        let gce_only = |l: &Live| {
            l.iter()
                .filter(|(_, s)| s.asks())
                .all(|(id, _)| matches!(id, SignalId::GceMaintenance | SignalId::GcePreempted))
        };
        if (gce_only(live) || gce_only(cx.truth.at(due))) && gce_unread(cx, a, due) {
            continue;
        }
        cx.judged(JUDGED_STARTED);
        let started = cx
            .run
            .journal
            .iter()
            .rfind(|e| is_node_write(e) && e.at <= due)
            .and_then(|e| e.response.as_deref())
            .is_some_and(|v| annotation(v, "lastcall.dev/drain-started").is_some());
        if !started {
            hits.push(Hit {
                invariant: Invariant::DrainNotStarted,
                at: due,
                detail: format!(
                    "a drain asked for since {} ms before ({:?} first, {:?} now); none started",
                    due.duration_since(a).unwrap_or_default().as_millis(),
                    live.keys().collect::<Vec<_>>(),
                    cx.truth.at(due).keys().collect::<Vec<_>>()
                ),
                seqs: vec![],
            });
        }
    }
}

/// A FleetIQ machine that came back registers with FleetIQ again, unless a drain was asked
/// for as its new life began: an old life's deregistration is not this one's (judged where
/// the run ended by the settle, so the agent had its chance).
fn registered_again(cx: &Ctx<'_>, hits: &mut Vec<Hit>) {
    if !cx.run.timeline.fleetiq || cx.run.settled.is_err() {
        return;
    }
    for life in 1..=cx.returns.len() {
        if cx.drain_asked_at_start(life) {
            continue;
        }
        if !cx.registered_in(life) {
            hits.push(Hit {
                invariant: Invariant::NotRegisteredAgain,
                at: cx.life_start(life),
                detail: format!(
                    "the machine came back (life {life}) with nothing asking for a drain and never registered with FleetIQ again"
                ),
                seqs: vec![],
            });
        }
    }
}

/// The node is deregistered only while some signal asks for the drain (or did within the
/// reaction time): a signal that clears before the node is empty cancels the drain, and a
/// cancelled drain hands nothing over.
fn handed_over_unasked(cx: &Ctx<'_>, hits: &mut Vec<Hit>) {
    for c in cx
        .run
        .calls
        .iter()
        .filter(|c| c.op == "DeregisterGameServer" && c.outcome == "ok")
    {
        let from = c.at.checked_sub(cx.reaction_after(c.at)).unwrap_or(c.at);
        let asked = cx
            .truth
            .during(from, c.at)
            .into_iter()
            .any(|live| !live.is_empty());
        if !asked {
            hits.push(Hit {
                invariant: Invariant::HandedOverUnasked,
                at: c.at,
                detail: format!(
                    "DeregisterGameServer #{} with no signal live since {} ms before",
                    c.seq,
                    c.at.duration_since(from).unwrap_or_default().as_millis()
                ),
                seqs: vec![],
            });
        }
    }
}

/// Nothing is handed over while a game-server pod is on the node: not the FleetIQ
/// deregistration, not the Auto Scaling CONTINUE, not an Azure approval. A pod first seen
/// within a moment of the hand-off (its request already on the way) is not held against it.
fn handed_over_busy(cx: &Ctx<'_>, hits: &mut Vec<Hit>) {
    let mut handoffs: Vec<(SystemTime, String)> = cx
        .run
        .calls
        .iter()
        .filter(|c| c.op == "DeregisterGameServer" && c.outcome == "ok")
        .map(|c| (c.at, "DeregisterGameServer".to_string()))
        .collect();
    handoffs.extend(cx.run.asg.iter().filter_map(|(at, h)| match h {
        Happening::Call {
            action,
            error: None,
            ..
        } if action == "CompleteLifecycleAction" => Some((*at, action.clone())),
        _ => None,
    }));
    handoffs.extend(
        cx.run
            .azure_approvals
            .iter()
            .map(|(id, at)| (*at, format!("approval of {id}"))),
    );
    let settle = Duration::from_millis(cx.run.timeline.deregister_settle_ms()) - LIST_TAKES;
    for (at, what) in handoffs {
        let moment = HANDOFF_IN_FLIGHT
            + cx.stalled(at.checked_sub(Duration::from_secs(1)).unwrap_or(at), at);
        // On the node at the hand-off, or landing after it although the scheduler placed
        // it as the fence went up and it landed within the settle (which is there so that
        // it lands, and is seen, first). One that landed later than the settle is beyond
        // any agent (see docs/agent.md, "What it cannot promise").
        let landed_within_settle = |p: &PodSeen| {
            cx.run.late_servers.iter().any(|(n, made)| {
                n == &p.name
                    && *made < at
                    && fence_before(cx, *made).is_some_and(|f| p.first < f + settle)
            })
        };
        let busy: Vec<&str> = cx
            .run
            .pods
            .iter()
            .filter(|p| p.last > at && (p.first + moment < at || landed_within_settle(p)))
            .map(|p| p.name.as_str())
            .collect();
        if !busy.is_empty() {
            hits.push(Hit {
                invariant: Invariant::HandedOverBusy,
                at,
                detail: format!("{what} while pods {} were on the node", busy.join(",")),
                seqs: vec![],
            });
        }
    }
}

/// How long before a hand-off a pod may have landed unseen: the agent confirms the node is
/// empty on a fresh LIST just before it hands over.
const HANDOFF_IN_FLIGHT: Duration = Duration::from_millis(150);
/// What a LIST may take to answer: a pod landing that much before the settle ends may be
/// missed by it.
const LIST_TAKES: Duration = Duration::from_millis(30);

/// Where the settle of the agent's latest accepted write that put lastcall's taint on the
/// Node, at or before `t`, counts from: the drain start it wrote with the fence (stamped
/// before the request went out), else the moment the write took effect.
pub fn fence_before_in(run: &Run, t: SystemTime) -> Option<SystemTime> {
    fence_up_before(&run.journal, t)
}

fn fence_before(cx: &Ctx<'_>, t: SystemTime) -> Option<SystemTime> {
    fence_up_before(&cx.run.journal, t)
}

/// When lastcall's last fence before `t` went up (its own taint appearing on the Node).
fn fence_up_before(journal: &[JournalEntry], t: SystemTime) -> Option<SystemTime> {
    let mut prev: Option<&Value> = None;
    let mut at = None;
    for e in journal.iter().filter(|e| is_node_write(e)) {
        let Some(v) = e.response.as_deref() else {
            continue;
        };
        if e.at <= t
            && by_agent(e)
            && taint_keys(v).contains("lastcall.dev/draining")
            && prev.is_none_or(|p| !taint_keys(p).contains("lastcall.dev/draining"))
        {
            let stamped = annotation(v, "lastcall.dev/drain-started").and_then(parse_time);
            at = Some(stamped.map_or(e.at, |s| s.min(e.at)));
        }
        prev = Some(v);
    }
    at
}

/// The pod the Node's `lastcall.dev/owner` annotation names (`namespace/name/uid`).
fn owner_pod(node: &Value) -> Option<String> {
    annotation(node, "lastcall.dev/owner")?
        .split('/')
        .nth(1)
        .map(String::from)
}

/// One agent acts at a time: every write request of an agent (accepted or not; Events
/// aside, as an agent that stood down still tells what it did as the owner) is made while
/// the Node's owner annotation names its own pod or nobody, or is a Node write naming
/// itself the owner. Each agent writes as its own user, so the journal tells them
/// apart.
fn standby(cx: &Ctx<'_>, hits: &mut Vec<Hit>) {
    let mut owner: Option<String> = None;
    for e in &cx.run.journal {
        let after = is_node_write(e)
            .then(|| e.response.as_deref().map(owner_pod))
            .flatten();
        // Taking over (the owner's pod is gone) is a Node write naming itself the owner;
        // it may be refused and tried again.
        let claims = |pod: &str| {
            e.resource.as_deref() == Some("nodes")
                && e.request.as_deref().is_some_and(|b| {
                    written(b, &["metadata", "annotations", "lastcall.dev/owner"])
                        .and_then(|v| {
                            v.as_str()
                                .and_then(|o| o.split('/').nth(1).map(String::from))
                        })
                        .as_deref()
                        == Some(pod)
                })
        };
        // A Node write the API server refused unread (restarting, throttled) says nothing
        // the journal kept: once the owner's pod is gone, it is taken for the takeover it
        // would be (seed 2961).
        let unread_takeover = |o: &str| {
            e.resource.as_deref() == Some("nodes")
                && refused_unread(e)
                && cx.run.journal.iter().any(|d| {
                    d.verb == Verb::Delete
                        && d.resource.as_deref() == Some("pods")
                        && d.name.as_deref() == Some(o)
                        && ok(d)
                        && d.at <= e.at
                })
        };
        if let Some(pod) = e.identity.as_deref().and_then(agent_pod)
            && e.verb.is_mutating()
            && e.resource.as_deref() != Some("events")
            && let Some(o) = owner.as_deref()
            && o != pod
            && !claims(pod)
            && !unread_takeover(o)
        {
            hits.push(Hit {
                invariant: Invariant::StandbyWrote,
                at: e.at,
                detail: format!(
                    "{pod} wrote {} {} while {o} owned the node",
                    e.verb.as_str(),
                    e.path
                ),
                seqs: vec![e.seq],
            });
        }
        if let Some(a) = after {
            owner = a;
        }
    }
}

fn is_node_write(e: &JournalEntry) -> bool {
    e.resource.as_deref() == Some("nodes")
        && e.name.as_deref() == Some(NODE)
        && e.subresource.is_none()
        && ok(e)
        && e.response.as_deref().is_some_and(|v| is_kind(v, "Node"))
}

/// lastcall removes nothing it did not write, and does not undo a drain while a signal
/// that fences the node has stayed live.
fn node_writes(cx: &Ctx<'_>, hits: &mut Vec<Hit>) {
    let mut prev: Option<&Value> = None;
    let mut cordon_by: Option<String> = None;
    for e in cx.run.journal.iter().filter(|e| is_node_write(e)) {
        let Some(v) = e.response.as_deref() else {
            continue;
        };
        if let Some(p) = prev {
            if !unschedulable(p) && unschedulable(v) {
                cordon_by = e.identity.clone();
            }
            if by_agent(e) {
                let mut gone = vec![];
                for (what, before, after) in [
                    ("label", keys(p, "labels"), keys(v, "labels")),
                    ("annotation", keys(p, "annotations"), keys(v, "annotations")),
                    ("taint", taint_keys(p), taint_keys(v)),
                ] {
                    gone.extend(
                        before
                            .difference(&after)
                            .filter(|k| {
                                !own_key(k, cx.run.timeline.mode.compat_taints) && !model_key(k)
                            })
                            .map(|k| format!("{what} {k}")),
                    );
                }
                if unschedulable(p)
                    && !unschedulable(v)
                    && cordon_by.as_deref().is_none_or(|c| agent_pod(c).is_none())
                {
                    gone.push(format!(
                        "the cordon of {}",
                        cordon_by.as_deref().unwrap_or("someone")
                    ));
                }
                if !gone.is_empty() {
                    hits.push(Hit {
                        invariant: Invariant::ForeignRemoved,
                        at: e.at,
                        detail: format!("removed {}", gone.join(", ")),
                        seqs: vec![e.seq],
                    });
                }
                let undone = taint_keys(p).contains("lastcall.dev/draining")
                    && !taint_keys(v).contains("lastcall.dev/draining");
                if undone {
                    let from = e.at.checked_sub(cx.lag_for(e)).unwrap_or(e.at);
                    let states = cx.truth.during(from, e.at);
                    let steady: Vec<_> = states[0]
                        .iter()
                        .filter(|(id, s)| s.fences && states.iter().all(|l| l.get(id) == Some(s)))
                        .map(|(id, _)| *id)
                        .collect();
                    if steady.is_empty() {
                        cx.window_used(e.at, !cx.truth.at(e.at).values().any(|s| s.fences));
                    } else {
                        hits.push(Hit {
                            invariant: Invariant::UndoneWhileLive,
                            at: e.at,
                            detail: format!("drain undone while {steady:?} stayed live"),
                            seqs: vec![e.seq],
                        });
                    }
                }
            }
            if unschedulable(p) && !unschedulable(v) {
                cordon_by = None;
            }
        } else if unschedulable(v) {
            cordon_by = e.identity.clone();
        }
        prev = Some(v);
    }
    // After a cancel (nothing live at the end, never deregistered), nothing of lastcall's
    // is left: read from the last state each object reached in the journal.
    // Deregistration is final within a life (GameLift dropping the server too, once the
    // agent knows it): judged in the last life only.
    let last_life = cx.returns.len();
    // A record GameLift agrees with counts too: the server dropped on its own, or never
    // registered in this life because it began draining (an agent started on a node already
    // draining registers nothing, and its deregistration finds nothing to remove).
    let registered_in_life = cx.run.calls.iter().any(|c| {
        c.op == "RegisterGameServer" && c.outcome == "ok" && cx.life_of(c.at) == last_life
    });
    let deregistered = cx.deregistered_in(last_life).is_some()
        || ((cx.forgotten_in(last_life).is_some()
            || (!registered_in_life && cx.drain_asked_at_start(last_life)))
            && cx
                .run
                .journal
                .iter()
                .rfind(|e| is_node_write(e))
                .and_then(|e| e.response.as_deref())
                .is_some_and(|v| annotation(v, "lastcall.dev/deregistered").is_some()));
    if deregistered || !cx.truth.last().is_empty() || cx.run.settled.is_err() {
        return;
    }
    let settle_end = cx
        .run
        .settled
        .as_ref()
        .copied()
        .unwrap_or(cx.run.settled_from);
    let mut left = vec![];
    let mut seqs = vec![];
    if let Some(e) = cx
        .run
        .journal
        .iter()
        .rfind(|e| is_node_write(e) && e.at <= settle_end)
        && let Some(v) = e.response.as_deref()
    {
        for k in ["lastcall.dev/draining", COMPAT_DRAINING] {
            if taint_keys(v).contains(k) {
                left.push(format!("Node taint {k}"));
            }
        }
        for k in DRAIN_NODE_ANNOTATIONS {
            if annotation(v, k).is_some() {
                left.push(format!("Node annotation {k}"));
            }
        }
        if unschedulable(v) && !cx.run.timeline.foreign_cordon {
            left.push("the cordon".into());
        }
        if !left.is_empty() {
            seqs.push(e.seq);
        }
    }
    let mut last_gs: BTreeMap<&str, &JournalEntry> = BTreeMap::new();
    for e in cx
        .run
        .journal
        .iter()
        .filter(|e| e.resource.as_deref() == Some("gameservers") && ok(e) && e.at <= settle_end)
    {
        if let Some(n) = e.name.as_deref() {
            last_gs.insert(n, e);
        }
    }
    for (name, e) in last_gs {
        let Some(v) = e.response.as_deref().filter(|v| is_kind(v, "GameServer")) else {
            continue;
        };
        // Ended by its game or by lastcall (the model deletes the server then, outside the
        // journal): nothing of it is left to clean.
        if v["metadata"]["deletionTimestamp"].is_string()
            || cx.ended.contains_key(name)
            || cx.gone.contains_key(name)
        {
            continue;
        }
        for k in ["lastcall.dev/drain-deadline", "lastcall.dev/drain-reason"] {
            if annotation(v, k).is_some() {
                left.push(format!("{name} annotation {k}"));
                seqs.push(e.seq);
            }
        }
        if label(v, "lastcall.dev/node-draining").is_some() {
            left.push(format!("{name} label lastcall.dev/node-draining"));
            seqs.push(e.seq);
        }
    }
    if !left.is_empty() {
        hits.push(Hit {
            invariant: Invariant::LeftAfterCancel,
            at: settle_end,
            detail: format!("after the cancel: {}", left.join(", ")),
            seqs,
        });
    }
}

fn keys(v: &Value, field: &str) -> BTreeSet<String> {
    v["metadata"][field]
        .as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default()
}

/// The Auto Scaling wait: completed only once the node is empty and deregistered, at most
/// once, and never timed out while a match ran (the agent heartbeats).
fn asg_lifecycle(cx: &Ctx<'_>, hits: &mut Vec<Hit>) {
    // The instance terminates: it never comes back, so there is one life. GameLift dropping
    // the server stands for the deregistration.
    let deregistered = [cx.deregistered_in(0).map(|c| c.at), cx.forgotten_in(0)]
        .into_iter()
        .flatten()
        .min();
    // A server registered with FleetIQ must be deregistered before the instance goes; one
    // never registered (the agent started on a node already draining) has nothing to undo.
    let registered_before = |t: SystemTime| {
        cx.run.timeline.fleetiq
            && cx
                .run
                .calls
                .iter()
                .any(|c| c.op == "RegisterGameServer" && c.outcome == "ok" && c.at < t)
    };
    let mut completions = 0;
    for (at, h) in &cx.run.asg {
        match h {
            Happening::Call {
                action,
                error: None,
                ..
            } if action == "CompleteLifecycleAction" => {
                completions += 1;
                let running = cx.running_at(*at, lag());
                let early = if !running.is_empty() {
                    Some(format!("while {} ran", running.join(",")))
                } else if registered_before(*at) && deregistered.is_none_or(|d| d > *at) {
                    Some("before the FleetIQ deregistration".to_string())
                } else {
                    None
                };
                if let Some(why) = early {
                    hits.push(Hit {
                        invariant: Invariant::AsgCompletedEarly,
                        at: *at,
                        detail: format!("CompleteLifecycleAction {why}"),
                        seqs: vec![],
                    });
                }
                if completions > 1 {
                    hits.push(Hit {
                        invariant: Invariant::AsgCompletedTwice,
                        at: *at,
                        detail: format!("CompleteLifecycleAction succeeded {completions} times"),
                        seqs: vec![],
                    });
                }
            }
            // Whether or not the agent knew of the match, it heartbeats until it completes:
            // within each heartbeat timeout it must get a heartbeat in, given the reaction
            // time to run in (doubled just after an agent start, which reads the hook's wait
            // afresh and must own the node before it may send anything). A process stalled for more of the timeout than that leaves
            // (the timeout here is seconds, not production's minutes) could not have, and
            // is not held against the agent.
            Happening::TimedOut { global, result } => {
                let running = cx.running_at(*at, Duration::ZERO);
                let last = cx
                    .run
                    .asg
                    .iter()
                    .filter(|(t, h)| {
                        t <= at
                            && matches!(
                                h,
                                Happening::WaitStarted { .. } | Happening::HeartbeatRecorded
                            )
                    })
                    .map(|(t, _)| *t)
                    .max();
                let timeout = Duration::from_secs(cx.run.timeline.asg_heartbeat_s);
                let could_run =
                    last.map_or(timeout, |l| timeout.saturating_sub(cx.stalled(l, *at)));
                if !running.is_empty() && (*global || could_run >= cx.base_lag_at(*at)) {
                    hits.push(Hit {
                        invariant: Invariant::AsgTimedOut,
                        at: *at,
                        detail: format!(
                            "the hook timed out (global {global}, {result}) while {} ran",
                            running.join(",")
                        ),
                        seqs: vec![],
                    });
                }
            }
            _ => {}
        }
    }
}

/// Azure approvals (`--azure-approve-when-empty`): never while a match runs, once per event.
fn azure_approvals(cx: &Ctx<'_>, hits: &mut Vec<Hit>) {
    let mut seen = BTreeSet::new();
    for (id, at) in &cx.run.azure_approvals {
        let running = cx.running_at(*at, lag());
        if !running.is_empty() {
            hits.push(Hit {
                invariant: Invariant::AzureApprovedEarly,
                at: *at,
                detail: format!("approved {id} while {} ran", running.join(",")),
                seqs: vec![],
            });
        }
        // Once per life of the machine: one that came back starts over (the platform still
        // listing an event the old life approved is asked again, and nothing of the old
        // life's hand-off stays on the Node).
        if !seen.insert((cx.life_of(*at), id)) {
            hits.push(Hit {
                invariant: Invariant::AzureApprovedTwice,
                at: *at,
                detail: format!("approved {id} again"),
                seqs: vec![],
            });
        }
    }
}

/// When the run ended: the drain's end, or, when it never ended, the settle's bound.
fn run_end(run: &Run) -> SystemTime {
    run.settled
        .as_ref()
        .map_or(run.settled_from + super::runner::SETTLE, |t| *t)
}

/// Every hard-deadline signal the truth held, with the moment it began to hold it as it is
/// (a moved deadline is another one).
fn held_signals(truth: &Truth) -> Vec<(SignalId, Signal, SystemTime)> {
    let mut out = vec![];
    let mut before = Live::new();
    for c in std::iter::once(SystemTime::UNIX_EPOCH).chain(truth.changes()) {
        let live = truth.at(c);
        for (id, s) in live {
            if s.hard.is_some() && before.get(id) != Some(s) {
                out.push((*id, *s, c));
            }
        }
        before = live.clone();
    }
    out
}

/// Liveness of hard deadlines: a running match on the node that `eviction.safe` lets
/// lastcall end for a hard deadline D is asked to end (an eviction or a pod DELETE by an
/// agent, answered or not) by D − grace (for a deadline the agent counts from its first
/// sight, [`RELATIVE_SLACK`] later), plus the reaction time. Judged only where the signal
/// held unchanged from its start until then, the agent could have seen it, and the run
/// lasted that long.
fn matches_ended_in_time(cx: &Ctx<'_>, hits: &mut Vec<Hit>) {
    let tl = &cx.run.timeline;
    let end = run_end(cx.run);
    let on_node = |name: &str| cx.run.pods.iter().any(|p| p.name == name);
    for (id, s, since) in held_signals(&cx.truth) {
        let Some(deadline) = s.hard else { continue };
        for safe in Safe::ALL {
            // Judged only where the game consents for sure; where the signal leaves it open,
            // ending the match and keeping it are both the agent's to choose.
            if consent(safe, &s, tl.graceful_termination) != Consent::Yes {
                continue;
            }
            let grace = Duration::from_secs(tl.grace_of(safe) as u64);
            let mut expected = deadline.checked_sub(grace).unwrap_or(deadline);
            if s.relative {
                expected += cx.relative_slack(since, expected);
            }
            let from = expected.max(since);
            let due = from + cx.reaction_after(from);
            let held = cx
                .truth
                .during(since, due)
                .iter()
                .all(|live| live.get(&id) == Some(&s));
            if !held {
                continue;
            }
            // Judged by the deadline the machine goes by: the earliest hard one live. A later
            // one whose cause would permit the end (a maintenance after a scale-in) never
            // comes; whether the match may end for it is the eviction policy's question.
            // A tie goes to no one: a scale-down due the same second may be the cause the
            // agent weighs (seed 56: Karpenter's time and GCE's on one second).
            let earliest_live = cx.truth.during(since, due).iter().all(|live| {
                live.iter().all(|(oid, o)| {
                    *oid == id
                        || o.hard.is_none_or(|h| {
                            h > deadline
                                || (h == deadline
                                    && consent(safe, o, tl.graceful_termination) == Consent::Yes)
                        })
                })
            });
            if !earliest_live {
                continue;
            }
            // An agent that started while the metadata server answered an empty body has
            // never read GCE: the deadline it has from the record is unconfirmed, which
            // protects and never ends a match (by design: it may have been cancelled).
            if matches!(id, SignalId::GceMaintenance | SignalId::GcePreempted)
                && gce_unread(cx, since, due)
            {
                continue;
            }
            // The matches running when this deadline asked for their end, known by then.
            for name in cx.running_at(from, cx.reaction_after(from)) {
                if Safe::of_server(&name) != Some(safe) || !on_node(&name) {
                    continue;
                }
                let asked = cx.run.journal.iter().any(|e| {
                    by_agent(e)
                        && ends_a_match(e)
                        && e.name.as_deref() == Some(&name)
                        && e.at <= due
                });
                // Ended by the game or removed by someone else in time, or the run ended
                // first: nothing to judge.
                let moot = cx.ended.get(&name).is_some_and(|t| *t <= due)
                    || cx.gone.get(&name).is_some_and(|t| *t <= due)
                    || due > end;
                if asked {
                    cx.judged(JUDGED_DEADLINE);
                } else if !moot {
                    cx.judged(JUDGED_DEADLINE);
                    hits.push(Hit {
                        invariant: Invariant::MatchNotEnded,
                        at: due,
                        detail: format!(
                            "{name} ({safe:?}, grace {}s) still running, never asked to end, {} ms after deadline − grace of {id:?} (deadline {})",
                            grace.as_secs(),
                            due.duration_since(expected).unwrap_or_default().as_millis(),
                            jiff::Timestamp::try_from(deadline)
                                .map(|t| t.to_string())
                                .unwrap_or_default()
                        ),
                        seqs: vec![],
                    });
                }
            }
        }
    }
}

/// Whether the agent may not have read GCE's value in `[from, to]`: the metadata server
/// answered an empty body at some moment of it (from a `GceEmpty` step until the next real
/// value, which the runner restores at the settle at the latest; a value it replaced at once
/// was never seen), or the agent running at `to` (re)started during such a glitch.
fn gce_unread(cx: &Ctx<'_>, from: SystemTime, to: SystemTime) -> bool {
    let mut glitch_since: Option<SystemTime> = None;
    let mut spells = vec![];
    for a in &cx.run.applied {
        match a.action {
            Action::GceEmpty => {
                glitch_since.get_or_insert(a.at);
            }
            Action::GceTerminate | Action::GceNone | Action::GceMigrating => {
                if let Some(g) = glitch_since.take() {
                    spells.push((g, a.at));
                }
            }
            _ => {}
        }
    }
    if let Some(g) = glitch_since {
        spells.push((g, cx.run.settled_from));
    }
    cx.run.applied.iter().any(|a| {
        let start = match a.action {
            Action::RestartAgent | Action::Rollout { .. } | Action::MachineReturns => a.at,
            Action::AbortAgent { gap_ms } => a.at + Duration::from_millis(gap_ms),
            _ => return false,
        };
        // Started during a glitch that lasted until too close to `to` for a read after it.
        start <= to
            && spells
                .iter()
                .any(|(g, e)| *g <= start && start < *e && *e + lag() > to)
    }) || spells.iter().any(|(g, e)| *g <= to && *e > from)
}

/// The node's empty spells, `[from, to)`, within the run: no game-server pod bound to it
/// (terminating ones included), as the pod sampler saw it.
fn empty_spells(cx: &Ctx<'_>, start: SystemTime, end: SystemTime) -> Vec<(SystemTime, SystemTime)> {
    let mut busy: Vec<(SystemTime, SystemTime)> =
        cx.run.pods.iter().map(|p| (p.first, p.last)).collect();
    busy.sort();
    let mut spells = vec![];
    let mut cursor = start;
    for (first, last) in busy {
        if first > cursor {
            spells.push((cursor, first.min(end)));
        }
        cursor = cursor.max(last);
    }
    if cursor < end {
        spells.push((cursor, end));
    }
    spells.retain(|(a, b)| a < b);
    spells
}

/// When a hand-off is due once the node is empty from `from`: the gate waits out the settle
/// since the fence (usually long past), then a fresh pod LIST, within the reaction time.
/// When GameLift failed the deregistration that comes first (a fault, or an answer lost),
/// the hand-off waits for its first conclusive answer (`ok` heard, or NotFound) instead.
fn handoff_due(cx: &Ctx<'_>, from: SystemTime) -> SystemTime {
    let settle = Duration::from_millis(cx.run.timeline.deregister_settle_ms());
    let mut gate = fence_before(cx, from).map_or(from, |f| (f + settle).max(from));
    let deregs = || {
        cx.run
            .calls
            .iter()
            .filter(|c| c.op == "DeregisterGameServer" && c.at >= from)
    };
    let heard = |c: &gamelift::Call| {
        (c.outcome == "ok" && !cx.run.answers_lost.contains(&c.seq))
            || c.outcome == "NotFoundException"
    };
    if deregs().any(|c| !heard(c))
        && let Some(concluded) = deregs().find(|c| heard(c))
    {
        gate = gate.max(concluded.at);
    }
    gate + cx.reaction_after(gate)
}

/// Liveness of the Auto Scaling hand-off: the hook never times out on a node that has been
/// empty, with the instance terminating, for longer than a hand-off takes.
fn asg_completed_once_empty(cx: &Ctx<'_>, hits: &mut Vec<Hit>) {
    let Some(began) = cx
        .run
        .asg
        .iter()
        .find_map(|(t, h)| matches!(h, Happening::WaitStarted { .. }).then_some(*t))
    else {
        return;
    };
    for (at, h) in &cx.run.asg {
        let Happening::TimedOut { .. } = h else {
            continue;
        };
        for (from, to) in empty_spells(cx, began, *at) {
            if to == *at {
                cx.judged(JUDGED_ASG);
            }
            if to == *at && handoff_due(cx, from) < *at {
                hits.push(Hit {
                    invariant: Invariant::AsgNotCompleted,
                    at: *at,
                    detail: format!(
                        "the hook timed out {} ms after the node emptied (the hand-off was due after {} ms)",
                        at.duration_since(from).unwrap_or_default().as_millis(),
                        handoff_due(cx, from).duration_since(from).unwrap_or_default().as_millis()
                    ),
                    seqs: vec![],
                });
            }
        }
    }
}

/// Liveness of Azure approvals (`--azure-approve-when-empty`): an event that asks for the
/// drain and stays listed while the node is empty is approved within a hand-off's time.
fn azure_approved_once_empty(cx: &Ctx<'_>, hits: &mut Vec<Hit>) {
    let tl = &cx.run.timeline;
    if !tl.azure_approve {
        return;
    }
    let end = run_end(cx.run);
    for (from, to) in empty_spells(cx, cx.run.t0, end) {
        // Each event listed during the spell, judged from the first moment it was listed
        // (or the spell began) with a hand-off's time to go, if it stayed listed that long.
        let starts =
            std::iter::once(from).chain(cx.truth.changes().filter(|c| *c > from && *c < to));
        let mut judged = BTreeSet::new();
        for st in starts {
            // An event that asks for no drain (a freeze) is the agent's to approve or not.
            for (id, _) in cx.truth.at(st).iter().filter(|(_, s)| s.asks()) {
                let SignalId::Azure(episode) = id else {
                    continue;
                };
                if !judged.insert(*episode) {
                    continue;
                }
                let due = handoff_due(cx, st);
                let event = super::runner::azure_event_id(tl.seed, *episode);
                let approved = cx
                    .run
                    .azure_approvals
                    .iter()
                    .any(|(e, t)| *e == event && *t <= due);
                // Not approved, and the spell or the event ended first (it left the
                // document, or the truth), or it was not listed then: nothing to judge.
                let listed =
                    |t: SystemTime| super::truth::azure_listed(&cx.run.applied, *episode, t);
                let moot = due >= to
                    || !listed(st)
                    || cx.truth.changes().any(|c| c > st && c <= due && !listed(c))
                    || !cx.truth.during(st, due).iter().all(|l| l.contains_key(id));
                if !approved && moot {
                    continue;
                }
                cx.judged(JUDGED_AZURE);
                if !approved {
                    hits.push(Hit {
                        invariant: Invariant::AzureNotApproved,
                        at: due,
                        detail: format!(
                            "{event} not approved {} ms after it was listed on the empty node",
                            due.duration_since(st).unwrap_or_default().as_millis()
                        ),
                        seqs: vec![],
                    });
                }
            }
        }
    }
}

fn settled(cx: &Ctx<'_>, hits: &mut Vec<Hit>) {
    if let Err(e) = &cx.run.settled {
        hits.push(Hit {
            invariant: Invariant::DrainNeverEnded,
            at: cx.run.settled_from,
            detail: e.clone(),
            seqs: vec![],
        });
    }
}

/// The failure report: seed, the drawn timeline, what was applied when, each hit and the
/// journal slice around it.
pub fn report(run: &Run, hits: &[Hit]) -> String {
    let t0 = run.t0;
    let rel = |t: SystemTime| -> String {
        match t.duration_since(t0) {
            Ok(d) => format!("t+{}ms", d.as_millis()),
            Err(e) => format!("t-{}ms", e.duration().as_millis()),
        }
    };
    let mut s = String::new();
    let _ = writeln!(
        s,
        "TIMELINE_SEED={} cargo test -p lastcall-testkit --test timeline",
        run.timeline.seed
    );
    let _ = write!(s, "{}", run.timeline);
    let _ = writeln!(s, "applied:");
    for a in &run.applied {
        let _ = writeln!(
            s,
            "  {:>9}  {:?}{}",
            rel(a.at),
            a.action,
            if a.note.is_empty() {
                String::new()
            } else {
                format!("  [{}]", a.note)
            }
        );
    }
    for (at, h) in run.asg.iter().filter(
        |(_, h)| !matches!(h, Happening::Call { action, .. } if action.starts_with("Describe")),
    ) {
        let _ = writeln!(s, "  {:>9}  autoscaling {h:?}", rel(*at));
    }
    for (id, at) in &run.azure_approvals {
        let _ = writeln!(s, "  {:>9}  azure approved {id}", rel(*at));
    }
    let stalled: Duration = run.stalls.iter().map(|(_, d)| *d).sum();
    let longest = run.stalls.iter().map(|(_, d)| *d).max().unwrap_or_default();
    let _ = writeln!(
        s,
        "stalls (the process could not run): {} ms in all, longest {} ms",
        stalled.as_millis(),
        longest.as_millis()
    );
    let _ = writeln!(
        s,
        "settled: {}",
        match &run.settled {
            Ok(t) => format!("at {} (last step at {})", rel(*t), rel(run.settled_from)),
            Err(e) => e.clone(),
        }
    );
    // `TIMELINE_JOURNAL` (replaying a seed): every write (`all`: every request) and every game
    // pod seen on the node.
    if std::env::var_os("TIMELINE_JOURNAL").is_some() {
        let _ = writeln!(s, "journal (writes):");
        let all = std::env::var("TIMELINE_JOURNAL").is_ok_and(|v| v == "all");
        for e in run
            .journal
            .iter()
            .filter(|e| (all || e.verb.is_mutating()) && e.identity.is_some())
        {
            let _ = writeln!(s, "    {}", entry_line(e, &rel));
        }
        for p in &run.pods {
            let _ = writeln!(s, "  pod {p:?}");
        }
    }
    for h in hits {
        let _ = writeln!(
            s,
            "HIT {} at {}: {}",
            h.invariant.as_str(),
            rel(h.at),
            h.detail
        );
        let lo =
            h.at.checked_sub(Duration::from_millis(1500))
                .unwrap_or(h.at);
        let hi = h.at + Duration::from_millis(200);
        let slice: Vec<&JournalEntry> = if h.invariant == Invariant::DrainNeverEnded {
            // Where the agent stopped: its last writes.
            let mine: Vec<&JournalEntry> = run
                .journal
                .iter()
                .filter(|e| by_agent(e) && e.verb.is_mutating())
                .collect();
            mine[mine.len().saturating_sub(12)..].to_vec()
        } else {
            run.journal
                .iter()
                .filter(|e| {
                    h.seqs.contains(&e.seq)
                        || (e.at >= lo
                            && e.at <= hi
                            && e.verb.is_mutating()
                            && e.identity.is_some())
                })
                .collect()
        };
        for e in slice {
            let _ = writeln!(s, "    {}", entry_line(e, &rel));
        }
        if matches!(
            h.invariant,
            Invariant::DeregisteredTwice | Invariant::UncordonedAfterDeregister
        ) {
            for c in run
                .calls
                .iter()
                .filter(|c| c.op != "DescribeGameServerInstances")
            {
                let _ = writeln!(
                    s,
                    "    gamelift #{} {} {} {}",
                    c.seq,
                    rel(c.at),
                    c.op,
                    c.outcome
                );
            }
        }
    }
    s
}

fn entry_line(e: &JournalEntry, rel: &dyn Fn(SystemTime) -> String) -> String {
    let mut extra = String::new();
    if let Some(v) = e.response.as_deref() {
        if is_kind(v, "Node") {
            extra = super::runner::node_summary(v);
        } else if is_kind(v, "GameServer") {
            extra = format!(
                "state={} node-draining={} drain-deadline={}",
                v["status"]["state"].as_str().unwrap_or("-"),
                label(v, "lastcall.dev/node-draining").unwrap_or("-"),
                annotation(v, "lastcall.dev/drain-deadline").unwrap_or("-")
            );
        }
    }
    format!(
        "#{} {} {} {} {}{} {} {}",
        e.seq,
        rel(e.at),
        e.identity.as_deref().unwrap_or("-"),
        e.verb.as_str(),
        e.name.as_deref().unwrap_or(e.path.as_str()),
        e.subresource
            .as_deref()
            .map(|s| format!("/{s}"))
            .unwrap_or_default(),
        e.status,
        extra
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stalls_count_where_they_overlap_the_window() {
        let t = |ms: u64| SystemTime::UNIX_EPOCH + Duration::from_millis(1_000_000 + ms);
        let ms = Duration::from_millis;
        // [100, 400] and [900, 1000].
        let stalls = [(t(400), ms(300)), (t(1000), ms(100))];
        assert_eq!(stalled_within(&stalls, t(0), t(2000)), ms(400));
        assert_eq!(stalled_within(&stalls, t(300), t(950)), ms(150));
        assert_eq!(stalled_within(&stalls, t(400), t(900)), ms(0));
        assert_eq!(stalled_within(&[], t(0), t(2000)), ms(0));
    }
}
