//! SIGTERM / SIGINT handling: one cancellation token that every task watches.

use futures::StreamExt;
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook_tokio::Signals;
use tokio_util::sync::CancellationToken;

/// Which signal asked us to stop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopSignal {
    Term,
    Int,
}

/// Installs the handlers now (so a signal that arrives during start-up is not lost) and
/// cancels `token` on the first SIGTERM or SIGINT. The returned handle yields the signal.
pub fn install(
    token: CancellationToken,
) -> std::io::Result<tokio::task::JoinHandle<Option<StopSignal>>> {
    let mut signals = Signals::new([SIGTERM, SIGINT])?;
    Ok(tokio::spawn(async move {
        let sig = tokio::select! {
            s = signals.next() => s,
            () = token.cancelled() => None,
        };
        let stop = sig.map(|s| {
            if s == SIGINT {
                StopSignal::Int
            } else {
                StopSignal::Term
            }
        });
        if let Some(s) = stop {
            tracing::info!(message = "stop signal received", signal = ?s);
        }
        token.cancel();
        stop
    }))
}
