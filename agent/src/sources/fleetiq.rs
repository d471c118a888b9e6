//! FleetIQ's instance status (Redis, with the GameLift fallback) as a source. The Redis
//! subscription and the fallback live with the FleetIQ integration (`crate::fleetiq`), which
//! also owns the game server's lifecycle; this adapter turns its view into a report.

use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::sync::watch;

use super::{Report, SourceContext};
use crate::fleetiq::view::FleetIqView;
pub use crate::fleetiq::view::SOURCE;

/// What the FleetIQ integration hands the source.
#[derive(Clone)]
pub struct Inputs {
    pub view: watch::Receiver<FleetIqView>,
    pub instance_id: watch::Receiver<Option<String>>,
}

/// Unknown until the first status arrives (from a message, the cache or GameLift).
pub fn report(view: &FleetIqView, instance_id: &str) -> Report {
    if view.status.is_none() {
        return Report::Unknown;
    }
    Report::Known(view.notice(instance_id).into_iter().collect())
}

pub fn start(ctx: SourceContext) -> Option<BoxFuture<'static, ()>> {
    let Inputs {
        mut view,
        mut instance_id,
    } = ctx.fleetiq?;
    let out = ctx.out;
    let shutdown = ctx.shutdown;
    Some(
        async move {
            loop {
                let id = instance_id.borrow().clone().unwrap_or_default();
                let r = report(&view.borrow(), &id);
                super::publish(&out, r);
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    c = view.changed() => if c.is_err() { shutdown.cancelled().await; return; },
                    c = instance_id.changed() => if c.is_err() { shutdown.cancelled().await; return; },
                }
            }
        }
        .boxed(),
    )
}
