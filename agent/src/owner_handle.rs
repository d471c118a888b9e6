//! Whether this agent acts on its node now: the handle every writer checks (the reconciler,
//! the FleetIQ calls, the sources). Set only by the ownership task (`owner`); kept apart
//! from it so the writers it gates need not depend on what it writes with.

use std::sync::Arc;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Whether this agent owns its node now. Cheap to clone; read before every mutating step.
#[derive(Clone)]
pub struct Owner {
    tx: Arc<watch::Sender<bool>>,
}

impl Owner {
    /// Ownership off (no pod identity, or dry run): this agent is the node's only agent.
    pub fn sole() -> Self {
        Self {
            tx: Arc::new(watch::channel(true).0),
        }
    }

    /// Not the owner until [`Ownership`] says so.
    pub fn contender() -> Self {
        Self {
            tx: Arc::new(watch::channel(false).0),
        }
    }

    pub fn is_owner(&self) -> bool {
        *self.tx.borrow()
    }

    /// Waits until this agent owns the node; `false` on shutdown.
    pub async fn owned(&self, stop: &CancellationToken) -> bool {
        let mut rx = self.tx.subscribe();
        tokio::select! {
            () = stop.cancelled() => false,
            r = rx.wait_for(|o| *o) => r.is_ok(),
        }
    }

    pub(crate) fn set(&self, owner: bool) {
        self.tx.send_if_modified(|cur| {
            let changed = *cur != owner;
            *cur = owner;
            changed
        });
    }
}
