//! Randomized whole timelines for one node, checked against the emulators' journals.
//!
//! A seeded draw ([`script::Timeline::draw`]) gives signals from several sources appearing,
//! moving, cancelled and re-appearing (IMDS scheduled events and Spot, GCE maintenance and
//! preemption, FleetIQ over Redis, the manual label, Karpenter's taint), agent restarts,
//! kills and rollouts, API faults, allocations and match ends. [`runner::run`] plays it in
//! real time against a fresh world with the agent built exactly as the binary builds it;
//! [`check::check`] reads the kube journal (with each accepted write's resulting object)
//! and the GameLift calls and lists every invariant hit. Deadlines are a few seconds out,
//! so a timeline takes a few seconds; [`run_many`] runs several at once.

pub mod check;
pub mod providers;
pub mod runner;
pub mod script;
pub mod truth;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use futures::StreamExt;

use crate::redis::RedisServer;
use check::{Hit, Invariant};
use script::{Dimensions, Timeline};

/// The outcome of one timeline.
pub struct Outcome {
    pub seed: u64,
    pub hits: Vec<Hit>,
    /// The failure report (empty when there are no hits).
    pub report: String,
    pub wall: Duration,
    /// Of which building the world and starting the agent.
    pub setup: Duration,
    /// The run itself failed (world set-up); not an invariant hit.
    pub error: Option<String>,
    /// What the run exercised (edges met, faults answered, cases judged).
    pub met: Met,
}

/// What a run exercised, not just drew: each count is something that happened (an edge
/// met, a fault answered, a case a liveness check judged), by name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Met(pub BTreeMap<&'static str, usize>);

/// GameLift dropped a registered game server on its own.
pub const FORGOTTEN: &str = "GameLift forgetting a registered server";
/// The machine came back with a new boot id.
pub const RETURNED: &str = "a machine coming back";
/// A pod the scheduler placed as the fence went up landed on the node.
pub const LATE_POD: &str = "a pod landing as the fence went up";
/// The Auto Scaling API lagged IMDS and the instance began terminating.
pub const ASG_LAGGED: &str = "a lagging Auto Scaling API";
/// Hand-offs judged (deregistrations, lifecycle completions, Azure approvals).
pub const HANDOFF: &str = "a hand-off";
/// A match ended by lastcall (an accepted eviction or pod DELETE of an in-use server).
pub const MATCH_ENDED: &str = "a match ended by lastcall";
/// An allocation on the node after lastcall's fence went up.
pub const ALLOCATED_AFTER_FENCE: &str = "an allocation after the fence";
/// An agent restarted, killed or rolled out while the node was fenced.
pub const RESTART_MID_DRAIN: &str = "an agent restart mid-drain";
/// An agent request answered with a fault (a 5xx or a 429).
pub const FAULT_MET: &str = "an API fault answered to the agent";
/// A Node signal from a cloud or an autoscaler was put on the node (taint or label).
pub const NODE_SIGNAL: &str = "a cloud's or autoscaler's Node signal";
/// A rebalance recommendation, GCE's upcoming maintenance, or a foreign cordon taken as a
/// drain.
pub const MORE_SIGNAL: &str = "a rebalance, upcoming maintenance or foreign cordon";
/// A timeline with the agent in a mode (dry run, drain state published, release pacing,
/// autoscaler cooperation).
pub const IN_A_MODE: &str = "an agent mode (dry run, drain state, pacing, cooperation)";
/// A dry run (the only thing judged there: nothing sent).
pub const DRY_RUN: &str = "a dry run";
/// The API server restarted and an agent listed again after it (its watches were answered
/// 410).
pub const RELISTED: &str = "an API server restart, then a re-list";
/// A game on the node reserved its server.
pub const RESERVED: &str = "a server reserved by its game";
/// A server that was still starting turned Ready during the timeline.
pub const SLOW_READY: &str = "a slow starter turning Ready";
/// A GameLift call or a kube write was applied and its answer lost.
pub const ANSWER_LOST: &str = "an answer lost after the write";
/// A signal's own time came in the run: a rebalance's TTL ran out, a NodeClaim's expiry
/// came within the lead.
pub const SIGNAL_TIMED: &str = "a rebalance's TTL or a NodeClaim's lead passing";
/// In compat mode, the agent put the original adapter's draining taint (NoExecute) on.
pub const COMPAT_TAINTED: &str = "a compat-mode NoExecute draining taint";
/// A machine came back and its kubelet posted the new boot id only after the restarted
/// agents' first reads of the Node (they saw the old boot).
pub const BOOT_ID_LATE: &str = "a new boot id posted after the agent read the Node";
/// On a VM that migrates live with `--gke-hand-back`, the node emptied under reschedulable
/// maintenance: a hand-back was due.
pub const HAND_BACK_DUE: &str = "a hand-back due on a VM that migrates live";
/// An upcoming maintenance window went `ONGOING` on a VM that migrates live while a match
/// lastcall could end ran (no deadline: nothing may end).
pub const MIGRATE_ONGOING: &str = "an ONGOING window on a VM that migrates live";
/// A pod landed on an empty node, its release refused, and an Auto Scaling termination or an
/// Azure event appeared while it was there.
pub const STALE_EMPTY: &str = "a hand-off asked for while a stray pod was refused release";

impl Met {
    /// Every count, the floors' names first.
    const NAMES: [&str; 32] = [
        FORGOTTEN,
        RETURNED,
        LATE_POD,
        ASG_LAGGED,
        HANDOFF,
        MATCH_ENDED,
        ALLOCATED_AFTER_FENCE,
        RESTART_MID_DRAIN,
        FAULT_MET,
        NODE_SIGNAL,
        MORE_SIGNAL,
        IN_A_MODE,
        DRY_RUN,
        RELISTED,
        RESERVED,
        SLOW_READY,
        ANSWER_LOST,
        SIGNAL_TIMED,
        COMPAT_TAINTED,
        BOOT_ID_LATE,
        HAND_BACK_DUE,
        MIGRATE_ONGOING,
        STALE_EMPTY,
        check::JUDGED_DEADLINE,
        check::JUDGED_AZURE,
        check::JUDGED_STARTED,
        check::JUDGED_READ_BOUND,
        check::JUDGED_AZURE_READ_BOUND,
        check::JUDGED_GCE_READ_BOUND,
        check::JUDGED_ASG,
        check::WINDOW_JUDGED,
        check::WINDOW_USED,
    ];
    /// The counts a default run must meet (the rest are reported): a hook timing out after
    /// the node emptied happens only when the agent fails, so it has no floor.
    const FLOORED: usize = 29;

    fn of(run: &runner::Run, judged: &BTreeMap<&'static str, usize>) -> Met {
        let count = |f: &dyn Fn(&script::Action) -> bool| {
            run.applied.iter().filter(|a| f(&a.action)).count()
        };
        let asg_began = count(&|a| matches!(a, script::Action::AsgTerminate));
        let agent = |e: &&crate::kube::journal::JournalEntry| check::by_agent(e);
        let in_use: BTreeSet<&str> = run
            .journal
            .iter()
            .filter(|e| {
                e.identity.as_deref() == Some("agones-allocator")
                    && e.resource.as_deref() == Some("gameservers")
                    && (200..300).contains(&e.status)
            })
            .filter_map(|e| e.name.as_deref())
            .chain(run.allocated_at_start.iter().map(String::as_str))
            .collect();
        let on_node = |name: &str| run.pods.iter().any(|p| p.name == name);
        let mut m = BTreeMap::new();
        m.insert(
            FORGOTTEN,
            run.applied
                .iter()
                .filter(|a| matches!(a.action, script::Action::GameLiftForgets) && a.note == "true")
                .count(),
        );
        m.insert(
            RETURNED,
            count(&|a| matches!(a, script::Action::MachineReturns)),
        );
        m.insert(
            LATE_POD,
            run.late_servers
                .iter()
                .filter(|(n, _)| run.pods.iter().any(|p| &p.name == n))
                .count(),
        );
        m.insert(
            ASG_LAGGED,
            usize::from(asg_began > 0 && run.timeline.asg_lag > 0),
        );
        m.insert(
            HANDOFF,
            run.calls
                .iter()
                .filter(|c| c.op == "DeregisterGameServer" && c.outcome == "ok")
                .count()
                + run
                    .asg
                    .iter()
                    .filter(|(_, h)| {
                        matches!(h, crate::autoscaling::Happening::Call { action, error: None, .. }
                            if action == "CompleteLifecycleAction")
                    })
                    .count()
                + run.azure_approvals.len(),
        );
        m.insert(
            MATCH_ENDED,
            run.journal
                .iter()
                .filter(agent)
                .filter(|e| {
                    (200..300).contains(&e.status)
                        && crate::promises::graceful::ends_a_match(e)
                        && e.name.as_deref().is_some_and(|n| in_use.contains(n))
                })
                .count(),
        );
        m.insert(
            ALLOCATED_AFTER_FENCE,
            run.journal
                .iter()
                .filter(|e| {
                    e.identity.as_deref() == Some("agones-allocator")
                        && e.verb == crate::kube::journal::Verb::Update
                        && e.resource.as_deref() == Some("gameservers")
                        && (200..300).contains(&e.status)
                        && e.name.as_deref().is_some_and(on_node)
                        && check::fence_before_in(run, e.at).is_some()
                })
                .count(),
        );
        m.insert(
            RESTART_MID_DRAIN,
            run.applied
                .iter()
                .filter(|a| {
                    matches!(
                        a.action,
                        script::Action::RestartAgent
                            | script::Action::AbortAgent { .. }
                            | script::Action::Rollout { .. }
                    ) && check::fence_before_in(run, a.at).is_some()
                })
                .count(),
        );
        m.insert(
            FAULT_MET,
            run.journal
                .iter()
                .filter(agent)
                .filter(|e| e.status == 429 || e.status >= 500)
                .count(),
        );
        m.insert(
            NODE_SIGNAL,
            count(&|a| {
                matches!(
                    a,
                    script::Action::KarpenterAt { .. }
                        | script::Action::Autoscaler(true)
                        | script::Action::GkeTaint(true)
                        | script::Action::GkeOngoing(true)
                        | script::Action::GkeMaintenance { epoch_ms: Some(_) }
                        | script::Action::NodeClaimFence { .. }
                )
            }),
        );
        m.insert(
            MORE_SIGNAL,
            count(&|a| {
                matches!(
                    a,
                    script::Action::ImdsRebalance | script::Action::GceUpcoming { .. }
                )
            }) + run
                .applied
                .iter()
                .filter(|a| {
                    matches!(a.action, script::Action::OperatorCordon(true)) && !a.note.is_empty()
                })
                .count(),
        );
        let mode = run.timeline.mode;
        m.insert(
            IN_A_MODE,
            usize::from(
                mode.dry_run
                    || mode.publish_drain_state
                    || mode.pacing
                    || mode.cooperation.is_some(),
            ),
        );
        m.insert(DRY_RUN, usize::from(mode.dry_run));
        m.insert(
            RELISTED,
            run.applied
                .iter()
                .filter(|a| matches!(a.action, script::Action::ApiRestart { .. }))
                .filter(|a| {
                    run.journal.iter().filter(agent).any(|e| {
                        e.verb == crate::kube::journal::Verb::List
                            && e.at > a.at
                            && e.at.duration_since(a.at).unwrap_or_default()
                                < Duration::from_secs(3)
                    })
                })
                .count(),
        );
        let noted = |f: &dyn Fn(&script::Action) -> bool| {
            run.applied
                .iter()
                .filter(|a| f(&a.action) && !a.note.is_empty())
                .count()
        };
        m.insert(RESERVED, noted(&|a| matches!(a, script::Action::Reserve)));
        m.insert(
            SLOW_READY,
            noted(&|a| matches!(a, script::Action::TurnsReady)),
        );
        m.insert(
            ANSWER_LOST,
            run.answers_lost.len() + run.kube_answers_lost.len() + run.asg_answers_lost,
        );
        m.insert(
            SIGNAL_TIMED,
            count(&|a| {
                matches!(
                    a,
                    script::Action::RebalanceExpires | script::Action::NodeClaimFence { .. }
                )
            }),
        );
        m.insert(
            COMPAT_TAINTED,
            usize::from(run.journal.iter().filter(agent).any(|e| {
                e.resource.as_deref() == Some("nodes")
                    && (200..300).contains(&e.status)
                    && e.response.as_deref().is_some_and(|v| {
                        v["spec"]["taints"].as_array().is_some_and(|ts| {
                            ts.iter().any(|t| t["key"] == runner::COMPAT_DRAINING)
                        })
                    })
            })),
        );
        m.insert(BOOT_ID_LATE, run.boot_reads.len());
        m.insert(
            HAND_BACK_DUE,
            usize::from(
                run.timeline.gke_hand_back
                    && check::fence_before_in(run, run.settled_from).is_some()
                    && run.pods.iter().all(|p| p.last < run.settled_from),
            ),
        );
        let migrates = run.timeline.host_maintenance == providers::HostMaintenance::Migrate;
        m.insert(
            MIGRATE_ONGOING,
            run.applied
                .iter()
                .filter(|a| {
                    migrates
                        && matches!(
                            a.action,
                            script::Action::GceUpcoming {
                                status: script::Upcoming::Ongoing,
                                ..
                            }
                        )
                        && run.allocated_at_start.iter().any(|n| {
                            script::Safe::of_server(n) == Some(script::Safe::Always)
                                && run.pods.iter().any(|p| p.name == *n && p.last > a.at)
                        })
                })
                .count(),
        );
        let hand_off_asked = |from: std::time::SystemTime, to: std::time::SystemTime| {
            run.applied.iter().any(|a| {
                matches!(
                    a.action,
                    script::Action::AsgTerminate | script::Action::AzureEvent { .. }
                ) && a.at >= from
                    && a.at <= to
            })
        };
        m.insert(
            STALE_EMPTY,
            run.pods
                .iter()
                .filter(|p| p.name == runner::STRAY && hand_off_asked(p.first, p.last))
                .count(),
        );
        for name in [
            check::JUDGED_DEADLINE,
            check::JUDGED_AZURE,
            check::JUDGED_STARTED,
            check::JUDGED_READ_BOUND,
            check::JUDGED_AZURE_READ_BOUND,
            check::JUDGED_GCE_READ_BOUND,
            check::JUDGED_ASG,
            check::WINDOW_JUDGED,
            check::WINDOW_USED,
        ] {
            m.insert(name, judged.get(name).copied().unwrap_or(0));
        }
        Met(m)
    }

    /// The sum over `outcomes`.
    pub fn total(outcomes: &[Outcome]) -> Met {
        let mut m = BTreeMap::new();
        for o in outcomes {
            for (k, v) in &o.met.0 {
                *m.entry(*k).or_default() += v;
            }
        }
        Met(m)
    }

    /// The counts with a floor met fewer than `floor` times: a run that never met one proves
    /// nothing of it.
    pub fn below(&self, floor: usize) -> Vec<&'static str> {
        Self::NAMES[..Self::FLOORED]
            .iter()
            .filter(|n| self.0.get(*n).copied().unwrap_or(0) < floor)
            .copied()
            .collect()
    }
}

impl std::fmt::Display for Met {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = Self::NAMES
            .iter()
            .map(|n| format!("{n}: {}", self.0.get(n).copied().unwrap_or(0)))
            .collect();
        write!(f, "{}", parts.join("; "))
    }
}

/// Runs one timeline and checks it.
pub async fn run_one(seed: u64, dims: Dimensions, redis: &RedisServer) -> Outcome {
    let started = std::time::Instant::now();
    let tl = Timeline::draw(seed, dims);
    match runner::run(tl.clone(), redis).await {
        Ok(run) => {
            let (hits, judged) = check::check_counted(&run);
            let met = Met::of(&run, &judged);
            let verbose = std::env::var_os("TIMELINE_VERBOSE").is_some();
            let report = if hits.is_empty() && !verbose {
                String::new()
            } else {
                check::report(&run, &hits)
            };
            Outcome {
                seed,
                hits,
                report,
                wall: started.elapsed(),
                setup: run.setup,
                error: None,
                met,
            }
        }
        Err(e) => Outcome {
            seed,
            hits: vec![],
            report: format!("{tl}run failed: {e:#}"),
            wall: started.elapsed(),
            setup: Duration::ZERO,
            error: Some(format!("{e:#}")),
            met: Met::default(),
        },
    }
}

/// Runs the timelines of `seeds`, `concurrency` at a time, sharing one Redis.
pub async fn run_many(seeds: Vec<u64>, dims: Dimensions, concurrency: usize) -> Vec<Outcome> {
    // A loaded machine can keep a fresh redis-server from answering its first PING in time
    // (it ended a long bench run between two chunks): try again before giving up.
    let mut started = RedisServer::start().await;
    for _ in 0..2 {
        if started.is_ok() {
            break;
        }
        started = RedisServer::start().await;
    }
    let redis = started.expect("redis-server");
    let redis = &redis;
    futures::stream::iter(seeds)
        .map(|seed| run_one(seed, dims, redis))
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await
}

/// Seeds and settings from the environment: `TIMELINE_SEED` (one seed, to replay),
/// `TIMELINE_SEEDS` (a comma-separated list), `TIMELINE_COUNT` (else `default_count`), `TIMELINE_FIRST` (first seed, default 1),
/// `TIMELINE_CONCURRENCY` (default 4), `TIMELINE_DISABLE` (dimension names to switch off).
/// `TIMELINE_VERBOSE` prints every timeline's report, hits or not.
pub fn from_env(default_count: u64) -> (Vec<u64>, Dimensions, usize) {
    let num = |k: &str| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    let listed: Vec<u64> = std::env::var("TIMELINE_SEEDS")
        .unwrap_or_default()
        .split(',')
        .filter_map(|v| v.trim().parse().ok())
        .collect();
    let seeds = match num("TIMELINE_SEED") {
        Some(s) => vec![s],
        None if !listed.is_empty() => listed,
        None => {
            let first = num("TIMELINE_FIRST").unwrap_or(1);
            (first..first + num("TIMELINE_COUNT").unwrap_or(default_count)).collect()
        }
    };
    let dims = Dimensions::without(&std::env::var("TIMELINE_DISABLE").unwrap_or_default())
        .unwrap_or_else(|e| panic!("TIMELINE_DISABLE: {e}"));
    let concurrency = num("TIMELINE_CONCURRENCY").unwrap_or(4) as usize;
    (seeds, dims, concurrency)
}

/// Hits per invariant, with the seeds that hit it.
pub fn summary(outcomes: &[Outcome]) -> BTreeMap<Invariant, Vec<u64>> {
    let mut by: BTreeMap<Invariant, Vec<u64>> = BTreeMap::new();
    for o in outcomes {
        let seen: BTreeSet<Invariant> = o.hits.iter().map(|h| h.invariant).collect();
        for i in seen {
            by.entry(i).or_default().push(o.seed);
        }
    }
    for v in by.values_mut() {
        v.sort_unstable();
    }
    by
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_edge_never_met_is_below_its_floor() {
        let mut met = Met(Met::NAMES.iter().map(|n| (*n, 9)).collect());
        met.0.insert(FORGOTTEN, 0);
        met.0.insert(ASG_LAGGED, 4);
        met.0.insert(check::JUDGED_ASG, 0);
        met.0.insert(check::WINDOW_USED, 0);
        assert_eq!(met.below(5), vec![FORGOTTEN, ASG_LAGGED]);
        assert_eq!(Met::total(&[]).below(1).len(), Met::FLOORED);
    }
}
