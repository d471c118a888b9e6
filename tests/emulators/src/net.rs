//! Ports for processes and servers a test starts, and serving an emulator's router.

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A TCP port on 127.0.0.1 the kernel considers free right now: racy by nature, so only for
/// a server that binds it at once (a child process told `--port`, `--listen`).
pub fn try_free_port() -> std::io::Result<u16> {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
}

/// [`try_free_port`] for tests, which want a loud failure.
///
/// # Panics
/// If no ephemeral port can be bound on 127.0.0.1.
pub fn free_port() -> u16 {
    try_free_port().unwrap_or_else(|e| panic!("binding an ephemeral port on 127.0.0.1: {e}"))
}

/// Serves `app` on `listener` until the returned token is cancelled. The shutdown is
/// graceful: requests in flight are still answered, as when a real server is stopped. A
/// server that ends with an error is logged under `what`.
pub fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    what: &'static str,
) -> (CancellationToken, JoinHandle<()>) {
    let stop = CancellationToken::new();
    let stopped = stop.clone().cancelled_owned();
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app)
            .with_graceful_shutdown(stopped)
            .await
        {
            tracing::warn!(error = %e, "{what} ended");
        }
    });
    (stop, task)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_free_port_can_be_bound() {
        let port = free_port();
        assert_ne!(port, 0);
        let l = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
        assert_eq!(l.local_addr().unwrap().port(), port);
    }
}
