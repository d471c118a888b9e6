//! The README's demo command works: `lastcall-demo` runs the whole story against real
//! agent and pubsub processes and exits 0.

use std::process::Stdio;
use std::time::Duration;

/// Generous: the demo may first build the agent and pubsub binaries (cargo, shared cores).
const DEMO_WITHIN: Duration = Duration::from_secs(600);

/// Runs `lastcall-demo` with `args` and returns its stdout once it exited 0.
async fn demo_succeeds(args: &[&std::ffi::OsStr]) -> String {
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_lastcall-demo"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let out = tokio::time::timeout(DEMO_WITHIN, child.wait_with_output())
        .await
        .expect("the demo finishes (it bounds each of its own steps)")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(0),
        "demo {args:?} failed\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
    );
    stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_runs_the_drain_story_and_exits_0() {
    let dir = tempfile::tempdir().unwrap();
    let stdout = demo_succeeds(&[
        "--timeout-secs".as_ref(),
        "60".as_ref(),
        "--log-dir".as_ref(),
        dir.path().as_os_str(),
    ])
    .await;
    for milestone in [
        "node-a fenced: cordoned and tainted lastcall.dev/draining",
        "released ",
        "protected ",
        "replacement ",
        "lastcall called DeregisterGameServer(demo-group, i-000000000000nodea); node-a is deregistered",
        "DeregisterGameServer calls after SIGTERM: 1",
        "Demo complete",
    ] {
        assert!(
            stdout.contains(milestone),
            "missing {milestone:?} in the demo's output:\n{stdout}"
        );
    }
    let lines_with = |s: &str| stdout.lines().filter(|l| l.contains(s)).count();
    // Two Ready servers released, two matches protected (one Allocated, one Reserved), two
    // replacements elsewhere.
    assert_eq!(lines_with(" released demo-"), 2, "{stdout}");
    assert_eq!(lines_with(" protected demo-"), 2, "{stdout}");
    assert_eq!(lines_with(" replacement demo-"), 2, "{stdout}");
    // The summary: exactly one deregistration in the GameLift journal, and the agent's own
    // metrics agree.
    let summary = stdout
        .split_once("\nSummary\n")
        .map(|(_, s)| s)
        .unwrap_or_else(|| panic!("no summary in:\n{stdout}"));
    let row = |first: &str| -> Vec<String> {
        summary
            .lines()
            .map(str::split_whitespace)
            .map(|w| w.map(str::to_string).collect::<Vec<_>>())
            .find(|w| w.first().map(String::as_str) == Some(first))
            .unwrap_or_else(|| panic!("no {first} row in:\n{stdout}"))
    };
    assert_eq!(row("DeregisterGameServer")[1], "1");
    assert_eq!(row("lastcall_releases_total")[1..3], ["ok", "2,"]);
    assert_eq!(row("lastcall_deregistrations_total")[1..], ["ok", "1"]);
    assert_eq!(row("lastcall_drain_phase")[1], "deregistered");
    // Each of the four processes stopped on SIGTERM with exit code 0.
    assert_eq!(
        stdout.matches("SIGTERM -> exit code 0").count(),
        4,
        "{stdout}"
    );
    // The processes' logs were written where asked.
    for log in [
        "agent-node-a.log",
        "agent-node-b.log",
        "agent-node-c.log",
        "pubsub.log",
    ] {
        let text = std::fs::read_to_string(dir.path().join(log)).unwrap();
        assert!(!text.is_empty(), "{log} is empty");
    }
}

#[tokio::test]
async fn demo_rejects_a_bad_flag_with_exit_2() {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_lastcall-demo"))
        .args(["--timeout-secs", "0"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--timeout-secs"));
}

/// `lastcall-demo --box`: the same drain on the box's real API server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_on_the_box_runs_the_drain_story_and_exits_0() {
    let stdout = demo_succeeds(&["--box".as_ref(), "--timeout-secs".as_ref(), "60".as_ref()]).await;
    for milestone in [
        "box-node-a fenced: cordoned and tainted lastcall.dev/draining",
        "released gs-0",
        "protected gs-3",
        "lastcall called DeregisterGameServer once",
        "Demo on the box complete",
    ] {
        assert!(
            stdout.contains(milestone),
            "missing {milestone:?}\n--- stdout\n{stdout}"
        );
    }
}
