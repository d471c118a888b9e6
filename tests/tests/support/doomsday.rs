//! A source that exists only in this test: "the node is doomed" when the test says so.
//! The whole source is this file; registering it is one line (see `custom_source.rs`).

use std::sync::OnceLock;

use futures::FutureExt;
use futures::future::BoxFuture;
use lastcall_agent::notice::{Cause, Notice, Severity, Source};
use lastcall_agent::sources::{Report, SourceContext, publish};
use tokio::sync::watch;

pub const SOURCE: Source = Source("doomsday");

/// What the outside world says: `None` = all clear, `Some(detail)` = doomed.
fn channel() -> &'static watch::Sender<Option<String>> {
    static CHANNEL: OnceLock<watch::Sender<Option<String>>> = OnceLock::new();
    CHANNEL.get_or_init(|| watch::channel(None).0)
}

/// The test's side: doom the node, or clear it.
pub fn say(doomed: Option<&str>) {
    channel().send_replace(doomed.map(str::to_string));
}

/// A cancellable maintenance drain while doomed; nothing otherwise.
pub fn report(doomed: Option<&str>) -> Report {
    Report::Known(
        doomed
            .map(|d| {
                Notice::new(
                    SOURCE,
                    Cause::Maintenance,
                    Severity::Drain,
                    None,
                    true,
                    d.to_string(),
                )
            })
            .into_iter()
            .collect(),
    )
}

pub fn start(ctx: SourceContext) -> Option<BoxFuture<'static, ()>> {
    let mut rx = channel().subscribe();
    Some(
        async move {
            loop {
                let r = report(rx.borrow_and_update().as_deref());
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
