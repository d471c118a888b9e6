//! Ports for processes and servers a test starts.

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
