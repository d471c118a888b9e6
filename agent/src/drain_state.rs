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

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use lastcall_common::backoff::Backoff;
use lastcall_common::drain_state::{self, FleetOnNode, NodeDrainState};
use lastcall_common::redis_conn::{self, CaFile};
use lastcall_common::redis_url::RedisTarget;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::metrics::{Metrics, ResultLabel};
use crate::observed::{GsState, Observed};
use crate::policy::Phase;

/// This node's servers per Fleet while it drains; `None` when it is not draining.
pub type Counts = Option<Vec<FleetOnNode>>;

const TIMEOUT: Duration = Duration::from_secs(2);

/// What the webhook should know of this node now: nothing unless it is draining (fenced and
/// not cancelling); then each Fleet's Ready (not being deleted) and in-use servers here.
pub fn counts(phase: Phase, observed: &Observed) -> Counts {
    if !matches!(
        phase,
        Phase::Fencing | Phase::Draining | Phase::Empty | Phase::Deregistered
    ) {
        return None;
    }
    let mut per: BTreeMap<(String, String), (u32, u32)> = BTreeMap::new();
    for gs in observed.game_servers.iter().filter(|g| !g.deleting) {
        let Some(fleet) = gs.fleet() else { continue };
        let e = per
            .entry((gs.namespace.clone(), fleet.to_string()))
            .or_default();
        if gs.state == GsState::Ready {
            e.0 += 1;
        } else if gs.state.is_in_use() {
            e.1 += 1;
        }
    }
    Some(
        per.into_iter()
            .filter(|(_, (r, a))| r + a > 0)
            .map(|((namespace, name), (ready, allocated))| FleetOnNode {
                namespace,
                name,
                ready,
                allocated,
                held: None,
                at_risk: None,
            })
            .collect(),
    )
}

pub struct Publisher {
    pub target: RedisTarget,
    pub ca: Option<CaFile>,
    pub node: String,
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
    async fn write(&self, conn: &mut redis_conn::AnyConn, view: &Counts) -> Result<(), String> {
        match view {
            Some(fleets) => {
                let state = NodeDrainState {
                    node: self.node.clone(),
                    updated_at_ms: drain_state::unix_ms(SystemTime::now()),
                    fleets: fleets.clone(),
                };
                drain_state::publish(conn, &state)
                    .await
                    .map_err(|e| e.to_string())
            }
            None => drain_state::clear(conn, &self.node)
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
        // Nothing was written by this process yet: clear a field a previous agent left.
        let mut written: Option<Counts> = None;
        loop {
            let view = self.counts.borrow_and_update().clone();
            let refresh_due = view.is_some();
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
                                draining = view.is_some()
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
            let wait = if written.as_ref().is_some_and(Option::is_some) {
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
    use crate::observed::{GameServerView, NodeView};

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
        assert_eq!(counts(Phase::Idle, &observed), None);
        assert_eq!(counts(Phase::Cancelling, &observed), None);
        let c = counts(Phase::Draining, &observed).expect("draining");
        assert_eq!(
            c,
            vec![
                FleetOnNode {
                    namespace: "default".into(),
                    name: "f".into(),
                    ready: 2,
                    allocated: 1,
                    held: None,
                    at_risk: None,
                },
                FleetOnNode {
                    namespace: "default".into(),
                    name: "g".into(),
                    ready: 0,
                    allocated: 1,
                    held: None,
                    at_risk: None,
                },
            ]
        );
    }
}
