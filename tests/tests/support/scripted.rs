//! A source that says whatever notice the test gives it: for scenarios that need a cause, a
//! severity and a deadline no real protocol combines. One file, one registry line.

use std::sync::OnceLock;

use futures::FutureExt;
use futures::future::BoxFuture;
use lastcall_agent::notice::{Notice, Source};
use lastcall_agent::sources::{Kind, Registered, Report, SourceContext, publish};
use tokio::sync::watch;

pub const SOURCE: Source = Source("scripted");

/// The registry line.
pub const LINE: Registered = Registered {
    source: SOURCE,
    kind: Kind::Task(start),
};

fn channel() -> &'static watch::Sender<Vec<Notice>> {
    static CHANNEL: OnceLock<watch::Sender<Vec<Notice>>> = OnceLock::new();
    CHANNEL.get_or_init(|| watch::channel(vec![]).0)
}

/// The test's side: what the source says now (one process-wide script: one test at a time).
pub fn say(notices: Vec<Notice>) {
    channel().send_replace(notices);
}

fn start(ctx: SourceContext) -> Option<BoxFuture<'static, ()>> {
    let mut rx = channel().subscribe();
    Some(
        async move {
            loop {
                let r = Report::Known(rx.borrow_and_update().clone());
                publish(&ctx.out, r);
                tokio::select! {
                    () = ctx.shutdown.cancelled() => return,
                    c = rx.changed() => if c.is_err() { return },
                }
            }
        }
        .boxed(),
    )
}
