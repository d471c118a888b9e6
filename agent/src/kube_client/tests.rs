//! Both clients' connections carry TCP keepalive, as the kernel reports it: the test server
//! accepts the client's connection and reads the client socket's timer from the kernel's
//! socket table (Linux only; the agent runs on Linux nodes).

use std::net::SocketAddr;

use tokio::net::TcpListener;

use super::*;

/// The keepalive timer of the established connection from `client` to `server`, in clock
/// ticks (1/100 s) until the next probe, as `/proc/net/tcp` shows it (`tr` 2 is the
/// keepalive timer). `None` while the socket has no keepalive timer running.
fn keepalive_ticks(client: SocketAddr, server: SocketAddr) -> Option<u64> {
    let table = std::fs::read_to_string("/proc/net/tcp").expect("reading /proc/net/tcp");
    let port = |field: &str| {
        field
            .rsplit(':')
            .next()
            .and_then(|p| u16::from_str_radix(p, 16).ok())
    };
    table.lines().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        let ours = f.len() > 5
            && port(f[1]) == Some(client.port())
            && port(f[2]) == Some(server.port())
            && f[3] == "01"; // ESTABLISHED
        let (timer, when) = f.get(5)?.split_once(':')?;
        (ours && timer == "02")
            .then(|| u64::from_str_radix(when, 16).ok())
            .flatten()
    })
}

/// Builds a client for a test server with `build`, makes it connect, and returns the
/// keepalive timer of its connection once the kernel shows one (or `None` after a generous
/// wait: the request's data may hold a retransmit timer until the server's ACK).
async fn keepalive_of(build: impl FnOnce(kube::Config) -> kube::Client) -> Option<u64> {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("binding");
    let server = listener.local_addr().expect("local address");
    let cfg = kube::Config::new(format!("http://{server}").parse().expect("url"));
    let client = build(cfg);
    let request = tokio::spawn(async move {
        let req = axum::http::Request::get("/version")
            .body(vec![])
            .expect("request");
        client.request_text(req).await
    });
    let (_conn, peer) = listener.accept().await.expect("accepting");
    let mut ticks = None;
    for _ in 0..200 {
        ticks = keepalive_ticks(peer, server);
        if ticks.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    request.abort();
    ticks
}

#[cfg(target_os = "linux")]
#[tokio::test]
async fn both_clients_probe_idle_connections_after_the_keepalive_idle_time() {
    let (metrics, _) = Metrics::new();
    let requests = keepalive_of(|cfg| {
        for_requests(
            cfg,
            Duration::from_secs(5),
            &metrics,
            &Throttle::new(metrics.clone()),
        )
        .expect("request client")
    })
    .await;
    let watches = keepalive_of(|cfg| {
        for_watches(cfg, &Throttle::new(metrics.clone())).expect("watch client")
    })
    .await;
    // The first probe is due within the idle time, not the kernel's default two hours.
    let limit = KEEPALIVE_IDLE.as_secs() * 100;
    for (client, ticks) in [("requests", requests), ("watches", watches)] {
        let ticks =
            ticks.unwrap_or_else(|| panic!("the {client} client's socket has no keepalive timer"));
        assert!(
            ticks <= limit,
            "the {client} client's first probe is {ticks} ticks away, more than {limit}"
        );
    }
}
