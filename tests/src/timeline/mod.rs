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
    /// What the run exercised of the hand-off edges.
    pub met: Met,
}

/// The hand-off edges a run met, not just drew: each counts only when it happened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Met {
    /// GameLift dropped a registered game server.
    pub forgotten: usize,
    /// The machine came back with a new boot id.
    pub returned: usize,
    /// A pod the scheduler placed as the fence went up landed on the node.
    pub late_pods: usize,
    /// The Auto Scaling API lagged IMDS and the instance began terminating.
    pub asg_lagged: usize,
    /// Hand-offs judged (deregistrations, lifecycle completions, Azure approvals).
    pub handoffs: usize,
}

impl Met {
    fn of(run: &runner::Run) -> Met {
        let count = |f: &dyn Fn(&script::Action) -> bool| {
            run.applied.iter().filter(|a| f(&a.action)).count()
        };
        let asg_began = count(&|a| matches!(a, script::Action::AsgTerminate));
        Met {
            forgotten: run
                .applied
                .iter()
                .filter(|a| matches!(a.action, script::Action::GameLiftForgets) && a.note == "true")
                .count(),
            returned: count(&|a| matches!(a, script::Action::MachineReturns)),
            late_pods: run
                .late_servers
                .iter()
                .filter(|(n, _)| run.pods.iter().any(|p| &p.name == n))
                .count(),
            asg_lagged: usize::from(asg_began > 0 && run.timeline.asg_lag > 0),
            handoffs: run
                .calls
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
        }
    }

    /// The sum over `outcomes`.
    pub fn total(outcomes: &[Outcome]) -> Met {
        outcomes.iter().fold(Met::default(), |a, o| Met {
            forgotten: a.forgotten + o.met.forgotten,
            returned: a.returned + o.met.returned,
            late_pods: a.late_pods + o.met.late_pods,
            asg_lagged: a.asg_lagged + o.met.asg_lagged,
            handoffs: a.handoffs + o.met.handoffs,
        })
    }

    /// The edges met fewer than `floor` times: a run that never met one proves nothing of it.
    pub fn below(&self, floor: usize) -> Vec<&'static str> {
        [
            ("GameLift forgetting a registered server", self.forgotten),
            ("a machine coming back", self.returned),
            ("a pod landing as the fence went up", self.late_pods),
            ("a lagging Auto Scaling API", self.asg_lagged),
            ("a hand-off", self.handoffs),
        ]
        .into_iter()
        .filter(|(_, n)| *n < floor)
        .map(|(what, _)| what)
        .collect()
    }
}

/// Runs one timeline and checks it.
pub async fn run_one(seed: u64, dims: Dimensions, redis: &RedisServer) -> Outcome {
    let started = std::time::Instant::now();
    let tl = Timeline::draw(seed, dims);
    match runner::run(tl.clone(), redis).await {
        Ok(run) => {
            let hits = check::check(&run);
            let met = Met::of(&run);
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
        let met = Met {
            forgotten: 0,
            returned: 7,
            late_pods: 13,
            asg_lagged: 4,
            handoffs: 41,
        };
        assert_eq!(
            met.below(5),
            vec![
                "GameLift forgetting a registered server",
                "a lagging Auto Scaling API"
            ]
        );
        assert!(Met::total(&[]).below(1).len() == 5);
    }
}
