//! Publishes this node's drain state for pubsub's FleetAutoscaler webhook: per Fleet, the
//! Ready and Allocated servers on this node while it drains (`lastcall_common::drain_state`
//! is the contract). The webhook asks for that many more replicas, so replacements start
//! before the capacity disappears.
//!
//! The reconciler hands the current counts over a `watch` channel (level, not edge) and never
//! waits on Redis: this task writes on every change and every `REFRESH_EVERY` while draining
//! (readers treat an old entry as zero), and clears the field when the drain is over. A
//! failure is logged, counted and retried with backoff; the last view is written once Redis is
//! back. Missing data only means "no extra replicas", never a wrong drain.
//!
//! Nothing is written before the reconciler's first plan: a restarted agent does not know
//! yet whether its node drains, and clearing the entry then would make a draining node's
//! servers vanish from the webhook's count until that plan (or, were the plan slow, for
//! longer). Each view carries when its counts were computed, and the entry says so
//! (`counted_at_ms`), so a webhook can tell a live publisher repeating old counts from a
//! current one.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime};

use lastcall_common::backoff::Backoff;
use lastcall_common::drain_state::{self, FleetOnNode, NodeDrainState};
use lastcall_common::redis_conn::{self, CaFile};
use lastcall_common::redis_url::RedisTarget;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::metrics::{Metrics, ResultLabel};
use crate::notice::Severity;
use crate::observed::{GsState, Observed};
use crate::policy::{Action, Phase, Plan};

/// What the reconciler last planned for the webhook; `None` until its first plan, when
/// nothing is known (and nothing is written or cleared).
pub type Counts = Option<View>;

/// One plan's view: this node's servers per Fleet while it drains (`None` when it is not
/// draining), and when they were computed.
#[derive(Clone, Debug)]
pub struct View {
    pub fleets: Option<Vec<FleetOnNode>>,
    /// When the plan that computed `fleets` ran (monotonic, so a clock step cannot age it).
    pub computed: Instant,
}

/// Views are equal when their counts are: a new plan with the same counts replaces the
/// view (and its time) without waking the publisher, which reads the time at its next
/// refresh.
impl PartialEq for View {
    fn eq(&self, other: &Self) -> bool {
        self.fleets == other.fleets
    }
}

impl View {
    /// The view of a plan computed just now.
    pub fn now(fleets: Option<Vec<FleetOnNode>>) -> Self {
        Self {
            fleets,
            computed: Instant::now(),
        }
    }
}

const TIMEOUT: Duration = Duration::from_secs(2);

/// What the webhook should know of this node now: nothing unless it is draining (fenced and
/// not cancelling); then, per Fleet, its Ready (not being deleted) and in-use servers here,
/// and what the Fleet is truly about to lose without a replacement on the way: `held`, the
/// Ready servers this pass keeps (release pacing; a released one is already being replaced
/// by its GameServerSet), and `at_risk`, the in-use servers when the node goes at a
/// Terminate deadline (their players need new matches then).
pub fn counts(plan: &Plan, observed: &Observed) -> Counts {
    Some(View::now(fleets(plan, observed)))
}

/// The per-Fleet counts of [`counts`]: `None` unless the node is draining.
fn fleets(plan: &Plan, observed: &Observed) -> Option<Vec<FleetOnNode>> {
    if !matches!(
        plan.phase,
        Phase::Fencing | Phase::Draining | Phase::Empty | Phase::Deregistered
    ) {
        return None;
    }
    let released: BTreeSet<&str> = plan
        .actions
        .iter()
        .filter_map(|a| match a {
            Action::Release { gs } => Some(gs.uid.as_str()),
            _ => None,
        })
        .collect();
    let terminating = plan
        .driver
        .as_ref()
        .is_some_and(|d| d.severity == Severity::Terminate && d.deadline.is_some());
    #[derive(Default)]
    struct Per {
        ready: u32,
        allocated: u32,
        held: u32,
    }
    let mut per: BTreeMap<(String, String), Per> = BTreeMap::new();
    for gs in observed.game_servers.iter().filter(|g| !g.deleting) {
        let Some(fleet) = gs.fleet() else { continue };
        let e = per
            .entry((gs.namespace.clone(), fleet.to_string()))
            .or_default();
        if gs.state == GsState::Ready {
            e.ready += 1;
            if !released.contains(gs.uid.as_str()) {
                e.held += 1;
            }
        } else if gs.state.is_in_use() {
            e.allocated += 1;
        }
    }
    Some(
        per.into_iter()
            .filter(|(_, p)| p.ready + p.allocated > 0)
            .map(|((namespace, name), p)| FleetOnNode {
                namespace,
                name,
                ready: p.ready,
                allocated: p.allocated,
                held: Some(p.held),
                at_risk: Some(if terminating { p.allocated } else { 0 }),
            })
            .collect(),
    )
}

pub struct Publisher {
    pub target: RedisTarget,
    pub ca: Option<CaFile>,
    pub node: String,
    /// The hash written (`--cluster-name`).
    pub key: String,
    pub counts: watch::Receiver<Counts>,
    pub metrics: Metrics,
}

impl Publisher {
    fn count(&self, result: &'static str) {
        self.metrics
            .drain_state
            .get_or_create(&ResultLabel { result })
            .inc();
    }

    /// Writes the current view once: the field while draining, nothing (cleared) otherwise.
    async fn write(&self, conn: &mut redis_conn::AnyConn, view: &View) -> Result<(), String> {
        match &view.fleets {
            Some(fleets) => {
                let now = drain_state::unix_ms(SystemTime::now());
                let age = i64::try_from(view.computed.elapsed().as_millis()).unwrap_or(i64::MAX);
                let mut state = NodeDrainState {
                    node: self.node.clone(),
                    updated_at_ms: now,
                    counted_at_ms: Some(now.saturating_sub(age)),
                    truncated: false,
                    fleets: fleets.clone(),
                };
                let left_out = state.fit();
                if left_out > 0 {
                    // Readers skip an entry over the limit: publish what fits, marked so the
                    // webhook holds every Fleet rather than miss the ones left out.
                    self.count("truncated");
                    warn!(
                        message = "drain state over the size readers accept: Fleets with the fewest servers to replace left out, and the entry marked truncated (the webhook holds every Fleet while it is live)",
                        left_out,
                        kept = state.fleets.len(),
                        limit_bytes = drain_state::MAX_ENTRY_BYTES,
                    );
                }
                drain_state::publish_to(conn, &self.key, &state)
                    .await
                    .map_err(|e| e.to_string())
            }
            None => drain_state::clear_in(conn, &self.key, &self.node)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
        }
    }

    pub async fn run(mut self, shutdown: CancellationToken) {
        let client = match redis_conn::any_client(&self.target, self.ca.as_ref()) {
            Ok(c) => c,
            Err(e) => {
                warn!(message = "drain state for the webhook disabled: bad Redis settings", error = %e);
                self.count("error");
                shutdown.cancelled().await;
                return;
            }
        };
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
        let mut conn: Option<redis_conn::AnyConn> = None;
        // Nothing was written by this process yet. Once the first plan is known, a field a
        // previous agent left is replaced or cleared.
        let mut written: Option<View> = None;
        loop {
            let Some(view) = self.counts.borrow_and_update().clone() else {
                // No plan yet: an earlier agent's entry, mid-drain, stays as it is.
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    c = self.counts.changed() => if c.is_err() { shutdown.cancelled().await; return; },
                }
                continue;
            };
            let refresh_due = view.fleets.is_some();
            if written.as_ref() != Some(&view) || refresh_due {
                if conn.is_none() {
                    match redis_conn::connect_any(&client, TIMEOUT).await {
                        Ok(c) => conn = Some(c),
                        Err(e) => {
                            warn!(message = "connecting to Redis for the drain state failed", error = %e)
                        }
                    }
                }
                let result = match conn.as_mut() {
                    Some(c) => self.write(c, &view).await,
                    None => Err("not connected".to_string()),
                };
                match result {
                    Ok(()) => {
                        if written.as_ref() != Some(&view) {
                            info!(
                                message = "drain state published for the webhook",
                                draining = view.fleets.is_some()
                            );
                        }
                        self.count("ok");
                        written = Some(view);
                        backoff.reset();
                    }
                    Err(e) => {
                        warn!(message = "publishing the drain state failed; retrying", error = %e);
                        self.count("error");
                        conn = None;
                        let d = backoff.next_delay();
                        tokio::select! {
                            () = shutdown.cancelled() => return,
                            () = tokio::time::sleep(d) => continue,
                        }
                    }
                }
            }
            let wait = if written.as_ref().is_some_and(|v| v.fleets.is_some()) {
                drain_state::REFRESH_EVERY
            } else {
                Duration::from_secs(3600)
            };
            tokio::select! {
                () = shutdown.cancelled() => return,
                c = self.counts.changed() => if c.is_err() { shutdown.cancelled().await; return; },
                () = tokio::time::sleep(wait) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::notice::{Cause, Notice, Source};
    use crate::observed::{GameServerView, NodeView};
    use crate::policy::GsRef;

    fn gs(name: &str, fleet: &str, state: GsState, deleting: bool) -> GameServerView {
        GameServerView {
            namespace: "default".into(),
            name: name.into(),
            uid: name.into(),
            resource_version: "1".into(),
            state,
            deleting,
            node_name: Some("n1".into()),
            labels: [("agones.dev/fleet".to_string(), fleet.to_string())].into(),
            annotations: Default::default(),
            eviction_safe: crate::eviction::EvictionSafe::Never,
            template_annotations: Default::default(),
        }
    }

    #[test]
    fn counts_ready_and_in_use_per_fleet_only_while_draining() {
        let observed = Observed {
            node: NodeView {
                name: "n1".into(),
                resource_version: "1".into(),
                unschedulable: true,
                taints: vec![],
                labels: Default::default(),
                annotations: Default::default(),
                boot_id: None,
                ready_since: None,
            },
            game_servers: vec![
                gs("a", "f", GsState::Ready, false),
                gs("b", "f", GsState::Ready, false),
                gs("c", "f", GsState::Ready, true),
                gs("d", "f", GsState::Allocated, false),
                gs("e", "g", GsState::Reserved, false),
                gs("s", "g", GsState::Starting, false),
            ],
            pods: vec![],
            fleets: Default::default(),
        };
        let plan = |phase: Phase, released: &[&str], driver: Option<Notice>| Plan {
            phase,
            actions: released
                .iter()
                .map(|n| Action::Release {
                    gs: GsRef {
                        namespace: "default".into(),
                        name: (*n).into(),
                        uid: (*n).into(),
                        resource_version: "1".into(),
                    },
                })
                .collect(),
            driver,
            wake_at: None,
            warnings: vec![],
            at_risk: 0,
            hand_off: false,
        };
        assert_eq!(fleets(&plan(Phase::Idle, &[], None), &observed), None);
        assert_eq!(fleets(&plan(Phase::Cancelling, &[], None), &observed), None);
        let fleet = |name: &str, ready, allocated, held, at_risk| FleetOnNode {
            namespace: "default".into(),
            name: name.into(),
            ready,
            allocated,
            held: Some(held),
            at_risk: Some(at_risk),
        };
        // A Drain: "a" is being released this pass (its GameServerSet replaces it), "b" is
        // held by pacing; in-use servers are not at risk without a Terminate deadline.
        let drain = Notice::new(
            Source("t"),
            Cause::Viability,
            Severity::Drain,
            None,
            true,
            String::new(),
        );
        assert_eq!(
            fleets(&plan(Phase::Draining, &["a"], Some(drain)), &observed),
            Some(vec![fleet("f", 2, 1, 1, 0), fleet("g", 0, 1, 0, 0)])
        );
        // A Terminate with a deadline: every in-use server is lost then.
        let spot = Notice::new(
            Source("t"),
            Cause::Preemption,
            Severity::Terminate,
            Some("2026-12-01T10:00:00Z".parse().unwrap()),
            false,
            String::new(),
        );
        assert_eq!(
            fleets(&plan(Phase::Draining, &["a", "b"], Some(spot)), &observed),
            Some(vec![fleet("f", 2, 1, 0, 1), fleet("g", 0, 1, 0, 1)])
        );
    }
}
