//! The FleetIQ integration: this node's game server in its GameLift group, behind one
//! handle that owns the GameLift client and the only in-memory "deregistered" state.
//!
//! It is not a source (the status it hears is, through `sources::fleetiq`); it is the
//! lifecycle the drain ends: register, claim, heartbeat, deregister. Every call goes through
//! one lock and is refused once the server is deregistered, so a registration still in flight
//! at start-up can never land after the drain's deregistration. The durable record is the
//! Node annotation `lastcall.dev/deregistered`, written by the actuator. Nothing is sent
//! while another agent owns the node (`crate::owner_handle`), checked under the same lock.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use tracing::{info, warn};

use super::gamelift::{GameLift, GameLiftError};
use crate::dry_run::DryRun;
use crate::metrics::{Metrics, ResultLabel};
use crate::owner_handle::Owner;

/// How a deregistration ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Deregistered {
    /// This call deregistered the server.
    Now,
    /// It already was (an earlier agent's call went through, or GameLift said NotFound).
    Already,
    /// Dry run: nothing sent.
    DryRun,
}

#[derive(Clone)]
pub struct FleetIq {
    inner: Arc<Inner>,
}

struct Inner {
    /// Set once the instance id is known (IMDS may be slow); until then every call waits.
    client: OnceLock<GameLift>,
    /// Deregistered in this life of the machine (by this agent, or before it, as the Node or
    /// GameLift said at start-up).
    deregistered: AtomicBool,
    /// Which life of the machine this is: a new boot id starts a new one (see
    /// [`FleetIq::new_life`]), and start-up is decided again for it.
    life: tokio::sync::watch::Sender<u64>,
    /// Serialises every lifecycle call, so none can follow (or overtake) the deregistration.
    lock: tokio::sync::Mutex<()>,
    /// Set once at start when ownership is on; unset, this agent is the node's only one.
    owner: OnceLock<Owner>,
    dry_run: DryRun,
    metrics: Metrics,
}

impl FleetIq {
    pub fn new(dry_run: DryRun, metrics: Metrics) -> Self {
        Self {
            inner: Arc::new(Inner {
                client: OnceLock::new(),
                deregistered: AtomicBool::new(false),
                life: tokio::sync::watch::channel(0).0,
                lock: tokio::sync::Mutex::new(()),
                owner: OnceLock::new(),
                dry_run,
                metrics,
            }),
        }
    }

    /// Hands the integration its client, once the instance id is known.
    pub fn connect(&self, gl: GameLift) {
        if self.inner.client.set(gl).is_err() {
            warn!(message = "FleetIQ client set twice; keeping the first");
        }
    }

    /// Sends nothing from now on unless `owner` says this agent owns the node.
    pub fn gate(&self, owner: Owner) {
        if self.inner.owner.set(owner).is_err() {
            warn!(message = "FleetIQ owner gate set twice; keeping the first");
        }
    }

    fn is_owner(&self) -> bool {
        self.inner.owner.get().is_none_or(Owner::is_owner)
    }

    pub fn client(&self) -> Option<&GameLift> {
        self.inner.client.get()
    }

    pub fn is_deregistered(&self) -> bool {
        self.inner.deregistered.load(Ordering::SeqCst)
    }

    /// The Node, or GameLift for a server that had been registered, says an earlier agent
    /// deregistered this server: nothing may follow, and policy treats the node as deregistered.
    pub fn deregistered_earlier(&self) {
        self.inner.deregistered.store(true, Ordering::SeqCst);
    }

    /// The machine came back (a new boot id) and the reconciler has settled the new life on
    /// the Node (lifted the old drain, or started it again): what start-up decided from the
    /// last life, a deregistration above all, is not this one's. Start-up runs again
    /// ([`Self::lives`]). Called once the Node write that ends the old life has landed, so
    /// a registration never precedes it. (The only call that sets "deregistered" is the
    /// reconciler's own, so none is in flight meanwhile.)
    pub fn new_life(&self) {
        if self.inner.deregistered.swap(false, Ordering::SeqCst) {
            info!(
                message =
                    "a new life of the machine: the last life's deregistration no longer holds"
            );
        }
        self.inner.life.send_modify(|l| *l += 1);
    }

    /// Which life of the machine start-up last decided for; changes with [`Self::new_life`].
    pub fn lives(&self) -> tokio::sync::watch::Receiver<u64> {
        self.inner.life.subscribe()
    }

    async fn call<F, Fut>(&self, kind: &'static str, what: &str, f: F) -> Result<(), GameLiftError>
    where
        F: FnOnce(GameLift) -> Fut,
        Fut: std::future::Future<Output = Result<(), GameLiftError>>,
    {
        let Some(gl) = self.client().cloned() else {
            return Ok(());
        };
        let _serial = self.inner.lock.lock().await;
        if self.is_deregistered() {
            return Err(GameLiftError::Deregistered);
        }
        if !self.is_owner() {
            return Err(GameLiftError::NotOwner);
        }
        if self
            .inner
            .dry_run
            .skip(kind, format!("GameLift {what} {}", gl.game_server_id))
        {
            return Ok(());
        }
        f(gl).await
    }

    pub async fn register(&self) -> Result<(), GameLiftError> {
        self.call("gamelift_register", "RegisterGameServer", |gl| async move {
            gl.register().await
        })
        .await
    }

    pub async fn claim(&self) -> Result<(), GameLiftError> {
        self.call("gamelift_claim", "ClaimGameServer", |gl| async move {
            gl.claim().await
        })
        .await
    }

    pub async fn heartbeat(&self) -> Result<(), GameLiftError> {
        self.call(
            "gamelift_heartbeat",
            "UpdateGameServer HEALTHY",
            |gl| async move { gl.heartbeat().await },
        )
        .await
    }

    pub async fn utilized(&self) -> Result<(), GameLiftError> {
        self.call(
            "gamelift_utilized",
            "UpdateGameServer UTILIZED",
            |gl| async move { gl.set_utilized().await },
        )
        .await
    }

    /// Deregisters the server, once. GameLift is asked first whether it is still registered,
    /// so a restart that cut between an earlier call and its Node record never sends the
    /// call twice; NotFound counts as done. `Err(NotReady)`-like: no client yet.
    pub async fn deregister(&self) -> Result<Deregistered, GameLiftError> {
        let Some(gl) = self.client().cloned() else {
            return Err(GameLiftError::Unreachable(
                "FleetIQ is not ready yet (instance id unknown)".into(),
            ));
        };
        let _serial = self.inner.lock.lock().await;
        if self.is_deregistered() {
            return Ok(Deregistered::Already);
        }
        if !self.is_owner() {
            return Err(GameLiftError::NotOwner);
        }
        if self.inner.dry_run.skip(
            "deregister",
            format!(
                "GameLift DeregisterGameServer {}/{}",
                gl.group, gl.game_server_id
            ),
        ) {
            return Ok(Deregistered::DryRun);
        }
        let count = |result: &'static str| {
            self.inner
                .metrics
                .deregistrations
                .get_or_create(&ResultLabel { result })
                .inc();
        };
        if !gl.is_registered().await? {
            count("already");
            info!(
                message = "the game server is not registered (an earlier deregistration went through); not calling again"
            );
            self.inner.deregistered.store(true, Ordering::SeqCst);
            return Ok(Deregistered::Already);
        }
        match gl.deregister().await {
            Ok(()) => count("ok"),
            Err(GameLiftError::NotFound(m)) => {
                count("not_found");
                info!(message = "game server already deregistered", detail = %m);
            }
            Err(e) => {
                count(e.metric_label());
                return Err(e);
            }
        }
        self.inner.deregistered.store(true, Ordering::SeqCst);
        Ok(Deregistered::Now)
    }

    /// Whether GameLift still has this server (`DescribeGameServer`), asked where a crash may
    /// have cut between a deregistration and its Node record: before heartbeating a draining
    /// node at start-up, and before a drain is cancelled. NotFound is `Ok(false)`; the caller
    /// knows whether the server had been registered (then it is deregistered: see
    /// [`Self::deregistered_earlier`]) or never was.
    pub async fn still_registered(&self) -> Result<bool, GameLiftError> {
        let Some(gl) = self.client().cloned() else {
            return Err(GameLiftError::Unreachable(
                "FleetIQ is not ready yet (instance id unknown)".into(),
            ));
        };
        let _serial = self.inner.lock.lock().await;
        if self.is_deregistered() {
            return Ok(false);
        }
        if !self.is_owner() {
            return Err(GameLiftError::NotOwner);
        }
        gl.is_registered().await
    }

    /// `--deregister-on-exit`: the original adapter's behaviour on SIGTERM. Serialised with
    /// the other lifecycle calls and never repeated; not recorded on the Node, so the next
    /// agent on this node registers again, as the original did. `Ok(false)`: nothing sent.
    pub async fn deregister_on_exit(&self) -> Result<bool, GameLiftError> {
        let Some(gl) = self.client().cloned() else {
            warn!(message = "deregister on exit skipped: FleetIQ never became ready");
            return Ok(false);
        };
        let _serial = self.inner.lock.lock().await;
        if self.is_deregistered() {
            return Ok(false);
        }
        if !self.is_owner() {
            info!(message = "deregister on exit skipped: another agent owns the node");
            return Ok(false);
        }
        if self.inner.dry_run.skip(
            "deregister",
            format!(
                "GameLift DeregisterGameServer {}/{} (on exit)",
                gl.group, gl.game_server_id
            ),
        ) {
            return Ok(false);
        }
        // Asked first: a pass cut short (an earlier exit, a crash) may have deregistered it
        // already, and a second Deregister must never be sent.
        if !gl.is_registered().await? {
            info!(
                message = "deregister on exit: the game server is no longer registered; not calling again"
            );
            self.inner.deregistered.store(true, Ordering::SeqCst);
            return Ok(false);
        }
        let r = match gl.deregister().await {
            Ok(()) => Ok(true),
            Err(GameLiftError::NotFound(_)) => Ok(false),
            Err(e) => Err(e),
        };
        if r.is_ok() {
            self.inner.deregistered.store(true, Ordering::SeqCst);
        }
        r
    }
}
