//! `--dry-run` narrates the whole drain it would do, and does none of it: fence, releases,
//! protection, deadlines, the wait for matches (which end for real, in the emulator), and
//! the deregistration, each told in order, while the kube emulator's journal and the
//! GameLift emulator's journal hold no mutating request of the agent's.

use lastcall_common::fleetiq::InstanceStatus as Status;
use lastcall_testkit::agent::InProcessAgent;
use lastcall_testkit::cluster::{EvictionSafe, GameServerState as S};
use lastcall_testkit::eventually::wait_for;
use lastcall_testkit::world::{NODE, NS, World, WorldSpec, cordoned, subscribed};

/// The narrated step kinds so far, in order.
fn kinds(agent: &InProcessAgent) -> Vec<&'static str> {
    agent.narration.steps().iter().map(|s| s.kind).collect()
}

fn texts(agent: &InProcessAgent) -> String {
    agent
        .narration
        .steps()
        .iter()
        .map(|s| {
            format!(
                "{:>3} {:>8.3}s {:<15} {}",
                s.n, s.after_start_s, s.kind, s.text
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Where the first and the last step of `kind` are.
fn first(got: &[&str], kind: &str) -> usize {
    got.iter()
        .position(|k| *k == kind)
        .unwrap_or_else(|| panic!("no {kind} step in {got:?}"))
}

fn last(got: &[&str], kind: &str) -> usize {
    got.iter()
        .rposition(|k| *k == kind)
        .unwrap_or_else(|| panic!("no {kind} step in {got:?}"))
}

/// Each step kind of `order` is told, and all of one kind come before the first of the next.
fn assert_order(agent: &InProcessAgent, order: &[&str]) {
    let got = kinds(agent);
    for pair in order.windows(2) {
        assert!(
            last(&got, pair[0]) < first(&got, pair[1]),
            "every {} before the first {}:\n{}",
            pair[0],
            pair[1],
            texts(agent)
        );
    }
}

async fn wait_for_step(agent: &InProcessAgent, kind: &str) {
    wait_for(&format!("the dry run narrates {kind}"), || async {
        kinds(agent).contains(&kind).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_narrates_the_whole_drain_and_sends_nothing() {
    // Two Ready servers and one match on n1; the game accepts a graceful end on preemption.
    let w = World::start(
        WorldSpec::new(2, 1, 0)
            .extra_nodes(&["n2"])
            .eviction_safe(EvictionSafe::Always),
    )
    .await;
    let ready: Vec<String> = w
        .on(NODE)
        .into_iter()
        .filter(|g| g.state == Some(S::Ready))
        .map(|g| g.name)
        .collect();
    let matched = w.allocated();
    let agent = w.agent(&["--dry-run"]).await;
    subscribed(&agent).await;

    // A Spot interruption: Terminate, two minutes out.
    w.status(Status::SpotTerminating).await;
    wait_for_step(&agent, "waiting").await;
    let steps = agent.narration.steps();
    let got = kinds(&agent);
    // The order a real drain takes: the fence before any release or protection (the one
    // Node write is a barrier), then the deadlines, then the wait.
    assert_order(
        &agent,
        &["signal", "fence", "release", "deadline", "waiting"],
    );
    assert_order(
        &agent,
        &["fence", "protect", "deadline", "match_deadline", "waiting"],
    );
    // Every Ready server released once, the match protected, never released.
    for name in &ready {
        let n = steps
            .iter()
            .filter(|s| s.kind == "release" && s.text.contains(&format!("{NS}/{name} ")))
            .count();
        assert_eq!(n, 1, "{name} released once:\n{}", texts(&agent));
    }
    assert!(
        !steps
            .iter()
            .any(|s| s.kind == "release" && s.text.contains(&matched.name)),
        "{}",
        texts(&agent)
    );
    let fence = steps.iter().find(|s| s.kind == "fence").expect("fence");
    assert!(
        fence.text.contains("cordon the node")
            && fence
                .text
                .contains("lastcall.dev/draining=fleetiq:NoSchedule"),
        "{}",
        fence.text
    );
    let deadline = steps
        .iter()
        .find(|s| s.kind == "deadline")
        .expect("deadline");
    assert!(
        deadline.text.contains("reason preemption") && deadline.text.contains("hard deadline"),
        "{}",
        deadline.text
    );
    let fate = steps
        .iter()
        .find(|s| s.kind == "match_deadline")
        .expect("match_deadline");
    assert!(
        fate.text.contains(&matched.name)
            && fate.text.contains("would end it gracefully at")
            && fate.text.contains("1 s grace"),
        "{}",
        fate.text
    );
    let waiting = steps.iter().find(|s| s.kind == "waiting").expect("waiting");
    assert!(waiting.text.contains(&matched.name), "{}", waiting.text);
    // Timing: numbered in order, times never going back, and counted from the drain's start.
    assert!(
        steps
            .windows(2)
            .all(|p| p[0].n < p[1].n && p[0].at <= p[1].at)
    );
    assert!(steps.iter().all(|s| s.after_start_s >= 0.0));
    assert!(
        !got.contains(&"deregister"),
        "not while a match runs:\n{}",
        texts(&agent)
    );

    // The match ends for real: the narration goes on to the deregistration.
    w.cluster
        .sdk_shutdown(NS, &matched.name)
        .expect("sdk shutdown");
    wait_for_step(&agent, "done").await;
    let got = kinds(&agent);
    assert_order(
        &agent,
        &[
            "signal",
            "fence",
            "protect",
            "match_ended",
            "deregister",
            "done",
        ],
    );
    assert!(first(&got, "waiting") < first(&got, "match_ended"));
    assert_eq!(
        got.iter().filter(|k| **k == "deregister").count(),
        1,
        "{}",
        texts(&agent)
    );
    assert_eq!(got.iter().filter(|k| **k == "fence").count(), 1);
    println!("{}", texts(&agent));

    // Zero mutating requests: nothing of the agent's in the kube journal but reads...
    let writes = w
        .cluster
        .emulator()
        .journal()
        .filter(|r| r.identity.as_deref() == Some("agent-n1") && r.verb.is_mutating());
    assert!(
        writes.is_empty(),
        "dry run wrote: {:?}",
        writes
            .iter()
            .map(|r| format!("{} {}", r.method, r.path))
            .collect::<Vec<_>>()
    );
    // ...and nothing but reads at GameLift: no registration at start-up, no heartbeat, no
    // deregistration.
    let calls: Vec<String> = w.gl.calls().into_iter().map(|c| c.op).collect();
    assert!(
        calls
            .iter()
            .all(|op| op.starts_with("Describe") || op.starts_with("List")),
        "{calls:?}"
    );
    // The world is as it was: not cordoned, the Ready servers still there and Ready.
    assert!(!cordoned(&w.node().await));
    for name in &ready {
        assert!(
            w.on(NODE)
                .iter()
                .any(|g| &g.name == name && g.state == Some(S::Ready) && !g.deleting),
            "{name}"
        );
    }
    agent.stop().await.unwrap();
}

/// At `deadline − grace` a dry run tells the match's end as the real agent sends it, a pod
/// DELETE preconditioned on the pod's uid with no grace override, and sends nothing: no
/// DELETE and no Eviction in the journal, the pod not terminating.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_narrates_a_matchs_end_as_a_preconditioned_delete_and_sends_none() {
    use lastcall_testkit::agent::config;
    use lastcall_testkit::cluster::{
        AllocationRequest, Cluster, ClusterConfig, FleetSpec, NodeSpec,
    };
    use lastcall_testkit::imds::ImdsEmulator;

    let cluster = Cluster::start(ClusterConfig::default())
        .await
        .expect("cluster");
    cluster.add_node(NodeSpec::new("n1")).expect("n1");
    cluster
        .create_fleet(
            FleetSpec::new("always", 1)
                .eviction_safe(EvictionSafe::Always)
                .grace_seconds(1),
        )
        .expect("fleet");
    cluster
        .wait_ready("default", "always", 1)
        .await
        .expect("ready");
    let matched = cluster
        .allocate(&AllocationRequest::fleet("default", "always"))
        .await
        .expect("allocate")
        .expect("an allocated server");
    let imds = ImdsEmulator::start("i-0123456789abcdef0", "n1")
        .await
        .expect("imds");
    let url = imds.url();
    let flags = [
        "--dry-run",
        "--resync-interval",
        "1s",
        "--aws-imds",
        "--imds-endpoint",
        &url,
    ];
    let kube = cluster
        .emulator()
        .config_for("agent-n1")
        .await
        .expect("client");
    let agent = InProcessAgent::start(config("n1", &flags), kube, None)
        .await
        .expect("agent");
    wait_for("the agent reads the Spot notice", || async {
        imds.requests()
            .iter()
            .any(|(m, path, status)| {
                m == "GET" && path.ends_with("/spot/instance-action") && *status == 404
            })
            .then_some(())
    })
    .await;
    // A Spot interruption 3 s from now (to the second, as IMDS says it).
    let deadline = (jiff::Timestamp::now() + jiff::SignedDuration::from_secs(3))
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string();
    imds.set_spot_action(Some(
        serde_json::json!({"action": "terminate", "time": deadline}),
    ));
    wait_for_step(&agent, "end_match").await;
    let steps = agent.narration.steps();
    let end = steps
        .iter()
        .find(|s| s.kind == "end_match")
        .expect("end_match");
    assert!(
        end.text.contains(&matched.name)
            && end
                .text
                .contains("a DELETE preconditioned on its uid, no grace override")
            && !end.text.contains("Eviction"),
        "{}",
        end.text
    );
    agent.stop().await.unwrap();
    let writes = cluster
        .emulator()
        .journal()
        .filter(|r| r.identity.as_deref() == Some("agent-n1") && r.verb.is_mutating());
    assert!(
        writes.is_empty(),
        "dry run wrote: {:?}",
        writes
            .iter()
            .map(|r| format!("{} {} {}", r.method, r.path, r.status))
            .collect::<Vec<_>>()
    );
    let pods: kube::Api<k8s_openapi::api::core::v1::Pod> =
        kube::Api::namespaced(cluster.client(), "default");
    for p in pods.list(&Default::default()).await.expect("pods").items {
        assert!(
            p.metadata.deletion_timestamp.is_none(),
            "{:?} is terminating",
            p.metadata.name
        );
    }
    cluster.shutdown().await;
}
