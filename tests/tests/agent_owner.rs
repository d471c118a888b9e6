//! One agent acts on a node, a deregistration is final, and no request can stop the agent:
//! - a deregistration whose Node record is lost (failed write, crash) is never undone by a
//!   cancel, and nothing reaches FleetIQ after it;
//! - two agents on one node (a DaemonSet rollout with maxSurge) act as one: one owner,
//!   handed over on SIGTERM, taken over when the owner pod is gone;
//! - a request that never gets an answer, at any step of a drain, fails at
//!   `--request-timeout` and the drain completes.
//!
//! Orderings come from the emulators' journals.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use lastcall_common::fleetiq::InstanceStatus as Status;
use lastcall_testkit::agent::{InProcessAgent, config, metric, metric_sum};
use lastcall_testkit::eventually::{eventually, wait_for};
use lastcall_testkit::gamelift::Call;
use lastcall_testkit::kube::faults::{FaultRule, Method};
use lastcall_testkit::kube::journal::Verb;
use lastcall_testkit::world::{
    GROUP, IID, LIFECYCLE, NODE, NS, World, WorldSpec, annotation, cordoned, has_taint, subscribed,
};

/// Lifecycle calls (Register, Claim, Update, Deregister) after the first successful
/// Deregister, by name.
fn lifecycle_after_deregister(calls: &[Call]) -> Vec<String> {
    let Some(at) = calls
        .iter()
        .position(|c| c.op == "DeregisterGameServer" && c.outcome == "ok")
    else {
        return vec![];
    };
    calls[at + 1..]
        .iter()
        .filter(|c| LIFECYCLE.contains(&c.op.as_str()))
        .map(|c| c.op.clone())
        .collect()
}

/// Waits until the agent registered and claimed, and recorded it on the Node.
async fn registered(w: &World) {
    wait_for("registration recorded on the Node", || async {
        annotation(&w.node().await, "lastcall.dev/registered").map(|_| ())
    })
    .await;
}

/// Drains n1 down to its one match, then ends it while every write to the Node fails, and
/// waits until the (only) Deregister went through: the deregistration's Node record is
/// not written.
async fn deregister_without_record(w: &World) {
    let keep = w.allocated();
    w.status(Status::Draining).await;
    w.fenced_and_released(&keep).await;
    w.cluster.emulator().faults().inject(FaultRule::status(
        Some(Method::PATCH),
        "/api/v1/nodes/n1",
        1_000_000,
        500,
    ));
    w.cluster
        .sdk_shutdown(NS, &keep.name)
        .expect("sdk shutdown");
    wait_for("deregistered", || async {
        (w.gl.count("DeregisterGameServer") == 1).then_some(())
    })
    .await;
    assert_eq!(
        annotation(&w.node().await, "lastcall.dev/deregistered"),
        None,
        "the record was not written"
    );
}

/// The signal clears while the deregistration's record cannot be written: the agent knows
/// it deregistered, so it keeps the node fenced and writes the record once it can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_that_clears_after_deregistration_never_uncordons() {
    let w = World::start(WorldSpec::new(1, 1, 0)).await;
    let agent = w.agent(&[]).await;
    subscribed(&agent).await;
    w.claimed_all().await;
    registered(&w).await;
    deregister_without_record(&w).await;
    w.status(Status::Active).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    w.cluster.emulator().faults().clear();
    wait_for("deregistration recorded on the Node", || async {
        annotation(&w.node().await, "lastcall.dev/deregistered").map(|_| ())
    })
    .await;
    // A few resync passes (1 s) with the signal cleared: still fenced.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let n = w.node().await;
    assert!(cordoned(&n), "a deregistered node is never uncordoned");
    assert!(has_taint(&n, "lastcall.dev/draining"));
    assert_eq!(w.gl.count("DeregisterGameServer"), 1);
    assert_eq!(
        lifecycle_after_deregister(&w.gl.calls()),
        Vec::<String>::new()
    );
    agent.stop().await.unwrap();
}

/// An agent deregisters and dies before writing its record (and, with `signal_clears`, the
/// FleetIQ signal clears meanwhile); returns the world and the next agent once that agent
/// has recorded the deregistration.
async fn crash_between_deregistration_and_its_record(
    signal_clears: bool,
) -> (World, InProcessAgent) {
    let w = World::start(WorldSpec::new(1, 1, 0)).await;
    let first = w.agent(&[]).await;
    subscribed(&first).await;
    w.claimed_all().await;
    registered(&w).await;
    deregister_without_record(&w).await;
    first.abort();
    if signal_clears {
        w.status(Status::Active).await;
    }
    w.cluster.emulator().faults().clear();

    let second = w.agent(&[]).await;
    subscribed(&second).await;
    wait_for("deregistration recorded on the Node", || async {
        annotation(&w.node().await, "lastcall.dev/deregistered").map(|_| ())
    })
    .await;
    (w, second)
}

/// The agent dies after the Deregister, before its record; the signal clears. The next
/// agent asks GameLift before its first heartbeat and before cancelling: the server is
/// gone, so the node stays fenced, the record is written, and nothing reaches FleetIQ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_deregistration_and_its_record_is_final() {
    let (w, second) = crash_between_deregistration_and_its_record(true).await;
    // Heartbeats run every second: give several a chance to be (wrongly) sent.
    tokio::time::sleep(Duration::from_millis(3000)).await;
    let n = w.node().await;
    assert!(cordoned(&n), "a deregistered node is never uncordoned");
    assert!(has_taint(&n, "lastcall.dev/draining"));
    assert_eq!(
        lifecycle_after_deregister(&w.gl.calls()),
        Vec::<String>::new(),
        "no lifecycle call after Deregister"
    );
    assert_eq!(w.gl.count("DeregisterGameServer"), 1);
    second.stop().await.unwrap();
}

/// The agent dies after the Deregister, before its record, while the node still drains:
/// the next agent asks GameLift before its first heartbeat, so not one lifecycle call
/// follows the deregistration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_crash_no_heartbeat_follows_the_deregistration() {
    let (w, second) = crash_between_deregistration_and_its_record(false).await;
    // Heartbeats run every second: give several a chance to be (wrongly) sent.
    tokio::time::sleep(Duration::from_millis(3000)).await;
    assert_eq!(
        lifecycle_after_deregister(&w.gl.calls()),
        Vec::<String>::new(),
        "no lifecycle call after Deregister"
    );
    assert_eq!(w.gl.count("DeregisterGameServer"), 1);
    second.stop().await.unwrap();
}

// ---------------------------------------------------------------------------------------
// Two agents on one node
// ---------------------------------------------------------------------------------------

/// An agent pod as the DaemonSet would make it (only its identity matters here).
async fn agent_pod(w: &World, name: &str) -> String {
    let pods: Api<Pod> = Api::namespaced(w.cluster.client(), NS);
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {"app": "lastcall-agent"}},
        "spec": {"containers": [{"name": "agent", "image": "lastcall-agent"}]},
    }))
    .expect("pod");
    let created = pods
        .create(&PostParams::default(), &pod)
        .await
        .expect("agent pod");
    created.metadata.uid.expect("uid")
}

/// A FleetIQ agent for n1 in pod `pod` (uid `uid`), with its own API identity so the
/// journal tells the two agents apart.
async fn pod_agent(w: &World, pod: &str, uid: &str, extra: &[&str]) -> InProcessAgent {
    let mut args = w.fleetiq_args();
    args.extend(
        [
            "--instance-id",
            IID,
            "--pod-name",
            pod,
            "--pod-namespace",
            NS,
            "--pod-uid",
            uid,
        ]
        .map(String::from),
    );
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let kube = w.cluster.emulator().config_for(pod).await.expect("client");
    InProcessAgent::start(config(NODE, &args), kube, Some(w.gl.sdk_client().await))
        .await
        .expect("agent")
}

async fn owner_is(w: &World, pod: &str) {
    let want = format!("{NS}/{pod}/");
    wait_for(&format!("{pod} owns n1"), || async {
        annotation(&w.node().await, "lastcall.dev/owner")
            .is_some_and(|o| o.starts_with(&want))
            .then_some(())
    })
    .await;
}

/// Mutating requests `identity` made (the owner annotation aside, which a standby agent
/// writes only when it takes over).
fn writes_by(w: &World, identity: &str) -> Vec<String> {
    w.cluster
        .emulator()
        .journal()
        .entries()
        .iter()
        .filter(|e| e.identity.as_deref() == Some(identity) && e.verb.is_mutating())
        .map(|e| format!("{} {}", e.method, e.path))
        .collect()
}

/// Old and new agent side by side through a whole drain: one registration, one claim,
/// one Deregister, nothing after it, and the standby agent writes nothing; when the old
/// one stops, the new one takes the node over (and, the node being deregistered, sends
/// nothing to FleetIQ).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_agents_on_one_node_act_as_one_through_a_drain() {
    let w = World::start(WorldSpec::new(2, 1, 0)).await;
    let old_uid = agent_pod(&w, "agent-old").await;
    let new_uid = agent_pod(&w, "agent-new").await;
    let old = pod_agent(&w, "agent-old", &old_uid, &[]).await;
    owner_is(&w, "agent-old").await;
    subscribed(&old).await;
    w.claimed_all().await;
    registered(&w).await;
    let new = pod_agent(&w, "agent-new", &new_uid, &[]).await;
    subscribed(&new).await;
    wait_for("the new agent is ready on standby", || async {
        let m = new.metrics().await;
        (metric(&m, "lastcall_node_owner", &[]) == Some(0.0)).then_some(())
    })
    .await;
    let ready = reqwest::get(format!("http://{}/readyz", new.admin))
        .await
        .expect("readyz");
    assert!(ready.status().is_success(), "a standby agent is ready");

    let keep = w.allocated();
    w.status(Status::Draining).await;
    w.fenced_and_released(&keep).await;
    w.finish_drain(&keep).await;
    assert_eq!(w.gl.count("RegisterGameServer"), 1, "one registration");
    assert_eq!(w.gl.count("ClaimGameServer"), 1, "one claim");
    assert_eq!(
        lifecycle_after_deregister(&w.gl.calls()),
        Vec::<String>::new()
    );
    assert_eq!(
        writes_by(&w, "agent-new"),
        Vec::<String>::new(),
        "the standby agent writes nothing"
    );

    old.stop().await.unwrap();
    owner_is(&w, "agent-new").await;
    tokio::time::sleep(Duration::from_millis(2000)).await;
    assert_eq!(w.gl.count("DeregisterGameServer"), 1);
    assert_eq!(
        lifecycle_after_deregister(&w.gl.calls()),
        Vec::<String>::new()
    );
    let n = w.node().await;
    assert!(cordoned(&n) && has_taint(&n, "lastcall.dev/draining"));
    new.stop().await.unwrap();
    assert_eq!(
        annotation(&w.node().await, "lastcall.dev/owner"),
        None,
        "handed over on stop"
    );
}

/// With --deregister-on-exit, the old agent's SIGTERM deregisters (it owns the node, and no
/// game server runs on it), and only then does the new agent register: the new registration
/// stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_old_agents_deregister_on_exit_never_removes_the_new_registration() {
    let w = World::start(WorldSpec::new(0, 0, 0)).await;
    let old_uid = agent_pod(&w, "agent-old").await;
    let new_uid = agent_pod(&w, "agent-new").await;
    let old = pod_agent(&w, "agent-old", &old_uid, &["--deregister-on-exit"]).await;
    owner_is(&w, "agent-old").await;
    registered(&w).await;
    let new = pod_agent(&w, "agent-new", &new_uid, &["--deregister-on-exit"]).await;
    subscribed(&new).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        w.gl.count("RegisterGameServer"),
        1,
        "the standby agent does not register"
    );

    old.stop().await.unwrap();
    owner_is(&w, "agent-new").await;
    wait_for("the new agent registered and claimed", || async {
        (w.gl.count("ClaimGameServer") == 2).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let calls = w.gl.calls();
    let ops: Vec<&str> = calls
        .iter()
        .map(|c| c.op.as_str())
        .filter(|op| ["RegisterGameServer", "DeregisterGameServer"].contains(op))
        .collect();
    assert_eq!(
        ops,
        [
            "RegisterGameServer",
            "DeregisterGameServer",
            "RegisterGameServer"
        ],
        "the old agent deregistered before the new one registered"
    );
    let gs = w.gl.game_server(GROUP, IID).expect("game server");
    assert!(gs.registered, "the new registration stays");
    new.stop().await.unwrap();
}

/// A rollout on a node whose match runs: the old agent's `--deregister-on-exit` passes the
/// hand-off gate's fresh read, finds the game-server pod, and sends nothing, so FleetIQ's
/// hold on the node (its claimed game server) stays under the match, and the new agent
/// heartbeats the same registration. GameLift's journal: no Deregister at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_node_is_not_deregistered_on_exit_during_a_rollout() {
    let w = World::start(WorldSpec::new(0, 1, 0)).await;
    let old_uid = agent_pod(&w, "agent-old").await;
    let new_uid = agent_pod(&w, "agent-new").await;
    let old = pod_agent(&w, "agent-old", &old_uid, &["--deregister-on-exit"]).await;
    owner_is(&w, "agent-old").await;
    registered(&w).await;
    let new = pod_agent(&w, "agent-new", &new_uid, &["--deregister-on-exit"]).await;
    subscribed(&new).await;
    let journal = w.cluster.emulator().journal();
    let before = journal.entries().len();
    old.stop().await.unwrap();
    owner_is(&w, "agent-new").await;
    let heartbeats = w.gl.count("UpdateGameServer");
    wait_for("the new agent heartbeats", || async {
        (w.gl.count("UpdateGameServer") > heartbeats + 1).then_some(())
    })
    .await;
    assert_eq!(
        w.gl.count("DeregisterGameServer"),
        0,
        "a node whose match runs was deregistered on exit: {:#?}",
        w.gl.calls()
    );
    let gs = w.gl.game_server(GROUP, IID).expect("game server");
    assert!(gs.registered, "the registration stays under the match");
    // The old agent read the node's pods afresh on its way out.
    let listed = journal.entries().into_iter().skip(before).any(|e| {
        e.identity.as_deref() == Some("agent-old")
            && e.resource.as_deref() == Some("pods")
            && e.verb == Verb::List
            && e.status < 300
    });
    assert!(listed, "the exit read the node's pods");
    assert!(
        w.on(NODE)
            .iter()
            .any(|g| g.state == Some(lastcall_testkit::cluster::GameServerState::Allocated)),
        "the match runs on"
    );
    new.stop().await.unwrap();
}

/// A deregistration on exit that does not answer in time may still land. The old agent then
/// does not hand the node over: the new one may register only once the old pod is gone, so
/// a late Deregister can never follow (and remove) the new registration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deregistration_on_exit_that_times_out_does_not_hand_the_node_over() {
    let w = World::start(WorldSpec::new(0, 0, 0)).await;
    let old_uid = agent_pod(&w, "agent-old").await;
    let new_uid = agent_pod(&w, "agent-new").await;
    let old = pod_agent(&w, "agent-old", &old_uid, &["--deregister-on-exit"]).await;
    owner_is(&w, "agent-old").await;
    registered(&w).await;
    let new = pod_agent(&w, "agent-new", &new_uid, &["--deregister-on-exit"]).await;
    subscribed(&new).await;
    w.gl.hang_next("DeregisterGameServer", 1);
    let hung = async {
        wait_for("the Deregister in flight", || async {
            (w.gl.hung_now() == 1).then_some(())
        })
        .await;
    };
    let (stopped, ()) = tokio::join!(old.stop(), hung);
    stopped.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    owner_is(&w, "agent-old").await;
    assert_eq!(
        w.gl.count("RegisterGameServer"),
        1,
        "the new agent must not register while the old Deregister may still land"
    );
    // The old pod goes: the new agent takes over.
    Api::<Pod>::namespaced(w.cluster.client(), NS)
        .delete("agent-old", &DeleteParams::default().grace_period(0))
        .await
        .expect("delete the old pod");
    owner_is(&w, "agent-new").await;
    new.stop().await.unwrap();
}

/// The owner dies without handing over; once its pod is gone, the standby agent takes
/// over and drains the node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_is_taken_over_when_the_owner_pod_is_gone() {
    let w = World::start(WorldSpec::new(2, 0, 0)).await;
    let old_uid = agent_pod(&w, "agent-old").await;
    let new_uid = agent_pod(&w, "agent-new").await;
    let old = pod_agent(&w, "agent-old", &old_uid, &[]).await;
    owner_is(&w, "agent-old").await;
    w.claimed_all().await;
    let new = pod_agent(&w, "agent-new", &new_uid, &[]).await;
    subscribed(&new).await;
    old.abort();
    // The pod is still there (its process crashed, its container restarts): no takeover.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    owner_is(&w, "agent-old").await;
    Api::<Pod>::namespaced(w.cluster.client(), NS)
        .delete("agent-old", &DeleteParams::default().grace_period(0))
        .await
        .expect("delete the old pod");
    eventually(
        "agent-new owns n1",
        Duration::from_secs(30),
        Duration::from_millis(100),
        || async {
            annotation(&w.node().await, "lastcall.dev/owner")
                .is_some_and(|o| o.starts_with(&format!("{NS}/agent-new/")))
                .then_some(())
        },
    )
    .await;
    w.status(Status::Draining).await;
    wait_for("the new owner fences and releases", || async {
        let n = w.node().await;
        (cordoned(&n) && w.on(NODE).is_empty()).then_some(())
    })
    .await;
    assert!(
        writes_by(&w, "agent-new")
            .iter()
            .any(|w| w.starts_with("DELETE")),
        "the new owner released the idle servers"
    );
    new.stop().await.unwrap();
}

// ---------------------------------------------------------------------------------------
// Hung requests
// ---------------------------------------------------------------------------------------

/// Every step of a drain meets a request that never gets an answer: the start-up Node read,
/// the fence PATCH, a release DELETE, a GameServer PATCH, the LIST before deregistering and
/// the Deregister itself. Each fails at its deadline and is retried: the drain completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_request_at_every_step_of_a_drain_does_not_stop_it() {
    let w = World::start(WorldSpec::new(2, 1, 0)).await;
    let faults = w.cluster.emulator().faults().clone();
    faults.inject(FaultRule::hang(Some(Method::GET), "/api/v1/nodes/n1", 1));
    let agent = w.agent(&["--request-timeout", "1s"]).await;
    subscribed(&agent).await;
    w.claimed_all().await;
    registered(&w).await;

    let keep = w.allocated();
    faults.inject(FaultRule::hang(Some(Method::PATCH), "/api/v1/nodes/n1", 1));
    faults.inject(FaultRule::hang(Some(Method::DELETE), "/gameservers/", 1));
    faults.inject(FaultRule::hang(Some(Method::PATCH), "/gameservers/", 1));
    w.status(Status::Draining).await;
    w.fenced_and_released(&keep).await;

    faults.inject(FaultRule::hang(
        Some(Method::GET),
        "fieldSelector=spec.nodeName",
        1,
    ));
    w.gl.hang_next("DeregisterGameServer", 1);
    w.finish_drain(&keep).await;
    assert_eq!(faults.pending(), 0, "every hang was met");

    let m = agent.metrics().await;
    for verb in ["get", "patch", "delete"] {
        assert!(
            metric_sum(
                &m,
                "lastcall_kube_request_timeouts_total",
                &[("verb", verb)]
            ) >= 1.0,
            "a {verb} timed out and was counted"
        );
    }
    agent.stop().await.unwrap();
}
