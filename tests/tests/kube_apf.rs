//! The emulator's API Priority and Fairness (`lastcall_emulators::kube::apf`): its 429 is
//! the real server's, as the real clients see it (kubectl retries on `Retry-After` and
//! then prints client-go's message; kube-rs reports code 429; kube's own retry waits
//! `Retry-After`), watches are exempt, and a user that floods is refused while a light
//! user still gets through.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{PostParams, WatchParams};
use lastcall_testkit::eventually::wait_for;
use lastcall_testkit::kube::apf::{FLOW_SCHEMA_UID_HEADER, TOO_MANY_REQUESTS};
use lastcall_testkit::kube::{ApfConfig, Emulator, FaultRule, JournalEntry, Method, Verb};
use serde_json::json;

async fn emulator_with_node() -> Emulator {
    let emu = Emulator::start().await.expect("emulator");
    let nodes: Api<Node> = Api::all(emu.client().await.expect("client"));
    let node = serde_json::from_value(json!({"metadata": {"name": "n1"}})).expect("node");
    nodes
        .create(&PostParams::default(), &node)
        .await
        .expect("create n1");
    emu
}

/// Holds the only seat with a request that hangs until [`Faults::release_hangs`].
async fn hold_the_seat(emu: &Emulator) -> tokio::task::JoinHandle<()> {
    emu.faults()
        .inject(FaultRule::hang(Some(Method::GET), "/api/v1/nodes/held", 1));
    let nodes: Api<Node> = Api::all(emu.client_no_retry("holder").await.expect("client"));
    let task = tokio::spawn(async move {
        let _ = nodes.get_opt("held").await;
    });
    wait_for("the seat is held", || async {
        (emu.faults().hung_now() == 1).then_some(())
    })
    .await;
    task
}

fn requests_of(emu: &Emulator, who: &str) -> Vec<JournalEntry> {
    emu.journal()
        .filter(|e| e.identity.as_deref() == Some(who) && e.verb != Verb::Watch)
}

/// kubectl sends no bearer token to a plain-HTTP server: its requests have no identity.
fn kubectl_requests(emu: &Emulator) -> Vec<JournalEntry> {
    emu.journal()
        .filter(|e| e.identity.is_none() && e.verb != Verb::Watch)
}

/// The gaps between consecutive requests, as the journal timed them.
fn gaps(entries: &[JournalEntry]) -> Vec<Duration> {
    entries
        .windows(2)
        .map(|w| w[1].at.duration_since(w[0].at).unwrap_or_default())
        .collect()
}

fn kubectl(args: &[&str], kubeconfig: &Path, home: &Path) -> (bool, String) {
    let out = std::process::Command::new("kubectl")
        .args(args)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", home)
        .env("KUBECONFIG", kubeconfig)
        .output()
        .unwrap_or_else(|e| panic!("running kubectl (.ci/run installs it): {e}"));
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_is_the_real_servers_to_kubectl_kube_rs_and_raw_http() {
    let emu = emulator_with_node().await;
    emu.apf().enable(ApfConfig {
        concurrency: 1,
        queue_per_flow: 0,
        retry_after_secs: 1,
        ..ApfConfig::default()
    });
    let held = hold_the_seat(&emu).await;

    // On the wire: plain text and Retry-After, as kube-apiserver's filter writes it.
    let raw = reqwest::Client::new()
        .get(format!("{}/api/v1/nodes/n1", emu.url()))
        .bearer_auth("raw")
        .send()
        .await
        .expect("raw GET");
    assert_eq!(raw.status(), 429);
    let h = raw.headers().clone();
    assert_eq!(h["retry-after"], "1");
    assert_eq!(h["content-type"], "text/plain; charset=utf-8");
    assert_eq!(h["x-content-type-options"], "nosniff");
    assert!(h.contains_key(FLOW_SCHEMA_UID_HEADER));
    assert_eq!(raw.text().await.expect("body"), TOO_MANY_REQUESTS);

    // kube-rs without retry: Error::Api with code 429 and the server's text.
    let nodes: Api<Node> = Api::all(emu.client_no_retry("kube-rs").await.expect("client"));
    match nodes.get("n1").await {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 429, "{s:?}");
            assert_eq!(s.message, TOO_MANY_REQUESTS.trim(), "{s:?}");
        }
        other => panic!("expected a 429, got {other:?}"),
    }

    // A watch is long-running: it takes no seat, so it starts while the seat is held.
    let watcher: Api<Node> = Api::all(emu.client_no_retry("watcher").await.expect("client"));
    let stream = watcher.watch(&WatchParams::default().timeout(1), "0").await;
    assert!(stream.is_ok(), "a watch is exempt");
    drop(stream);

    // kubectl (client-go) retries a 429 after Retry-After, up to 10 times, then prints
    // client-go's message for it.
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = dir.path().join("kubeconfig");
    emu.write_kubeconfig(&kubeconfig, "kubectl")
        .expect("kubeconfig");
    let (ok, out) = tokio::task::spawn_blocking({
        let (k, h) = (kubeconfig.clone(), dir.path().to_path_buf());
        move || kubectl(&["get", "--raw", "/api/v1/nodes/n1"], &k, &h)
    })
    .await
    .expect("kubectl");
    assert!(
        !ok,
        "kubectl must fail while every request is refused: {out}"
    );
    assert!(
        out.contains(
            "the server has received too many requests and has asked us to try again later"
        ),
        "{out}"
    );
    let tried = kubectl_requests(&emu);
    assert!(tried.len() >= 2, "kubectl retried: {}", tried.len());
    assert!(tried.iter().all(|e| e.status == 429));
    for g in gaps(&tried) {
        assert!(
            g >= Duration::from_millis(990),
            "kubectl came back {g:?} after a Retry-After of 1 s"
        );
    }
    eprintln!(
        "kubectl: {} requests, all 429, gaps {:?}",
        tried.len(),
        gaps(&tried)
    );

    // kube's default retry honours Retry-After too, and gets through once the seat is free.
    let retrying: Api<Node> = Api::all(emu.client_as("kube-rs-retry").await.expect("client"));
    let got = tokio::spawn(async move { retrying.get("n1").await });
    wait_for("kube-rs refused once", || async {
        (!requests_of(&emu, "kube-rs-retry").is_empty()).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    emu.faults().release_hangs();
    held.await.expect("holder");
    let node = got
        .await
        .expect("task")
        .expect("served after the seat came free");
    assert_eq!(node.metadata.name.as_deref(), Some("n1"));
    let tried = requests_of(&emu, "kube-rs-retry");
    assert_eq!(tried.first().map(|e| e.status), Some(429));
    assert_eq!(tried.last().map(|e| e.status), Some(200));
    for (g, next) in gaps(&tried).iter().zip(&tried[1..]) {
        assert!(
            *g >= Duration::from_millis(990),
            "kube retried {g:?} after a Retry-After of 1 s ({})",
            next.status
        );
    }

    // Every refusal is journaled and counted per user.
    let stats = emu.apf().stats();
    for who in [Some("raw"), Some("kube-rs"), None, Some("kube-rs-retry")] {
        let journaled = emu
            .journal()
            .count(|e| e.identity.as_deref() == who && e.status == 429);
        let counted = stats
            .rejected
            .get(&who.map(str::to_string))
            .copied()
            .unwrap_or(0);
        assert_eq!(counted as usize, journaled, "{who:?}");
        assert!(journaled >= 1, "{who:?}");
    }
    assert_eq!(stats.rejected_for("watcher"), 0);
    assert_eq!(stats.peak_in_flight, 1);
    let seqs: Vec<u64> = emu.apf().rejections().iter().map(|r| r.seq).collect();
    let journaled: Vec<u64> = emu
        .journal()
        .filter(|e| e.status == 429)
        .iter()
        .map(|e| e.seq)
        .collect();
    assert_eq!(seqs, journaled);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_user_is_refused_while_a_light_user_gets_through() {
    let emu = emulator_with_node().await;
    emu.apf().enable(ApfConfig {
        concurrency: 4,
        rate: Some(40.0),
        burst: 4,
        queue_per_flow: 2,
        queue_wait: Duration::from_secs(10),
        retry_after_secs: 1,
    });
    let stop = Arc::new(AtomicBool::new(false));
    let mut flood = vec![];
    for _ in 0..12 {
        let nodes: Api<Node> = Api::all(emu.client_no_retry("flood").await.expect("client"));
        let stop = stop.clone();
        flood.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                if nodes.get("n1").await.is_err() {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        }));
    }
    wait_for("the flooder is refused", || async {
        (emu.apf().stats().rejected_for("flood") >= 10).then_some(())
    })
    .await;

    // The light user: one request at a time, each served within its flow's turn.
    let light: Api<Node> = Api::all(emu.client_no_retry("light").await.expect("client"));
    let started = SystemTime::now();
    for i in 0..15 {
        light
            .get("n1")
            .await
            .unwrap_or_else(|e| panic!("the light user's request {i} was refused: {e}"));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // kubectl as a light user too (discovery included).
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = dir.path().join("kubeconfig");
    emu.write_kubeconfig(&kubeconfig, "kubectl")
        .expect("kubeconfig");
    let (ok, out) = tokio::task::spawn_blocking({
        let (k, h) = (kubeconfig.clone(), dir.path().to_path_buf());
        move || kubectl(&["get", "nodes", "-o", "name"], &k, &h)
    })
    .await
    .expect("kubectl");
    // It gets through; its discovery burst may overflow its queue, which it retries.
    assert!(ok && out.contains("node/n1"), "{out}");
    let flood_during = emu
        .journal()
        .count(|e| e.identity.as_deref() == Some("flood") && e.status == 429 && e.at >= started);
    stop.store(true, Ordering::SeqCst);
    for t in flood {
        t.await.expect("flood task");
    }

    let stats = emu.apf().stats();
    assert_eq!(stats.rejected_for("light"), 0);
    assert!(
        requests_of(&emu, "light").iter().all(|e| e.status == 200),
        "every light request served"
    );
    assert!(
        flood_during >= 10,
        "the flooder kept being refused meanwhile: {flood_during}"
    );
    assert!(stats.peak_in_flight <= 4, "{stats:?}");
    assert!(stats.queued_total > 0, "requests waited: {stats:?}");
    // Each flow holds at most 2 waiting: 3 flows at most.
    assert!(stats.peak_queued <= 6, "{stats:?}");
    assert_eq!(
        stats.rejected_for("flood") as usize,
        emu.journal()
            .count(|e| e.identity.as_deref() == Some("flood") && e.status == 429)
    );
    eprintln!(
        "{stats:?}; kubectl's requests {}",
        kubectl_requests(&emu).len()
    );
}
