//! The drain end to end on the box: a real kube-apiserver, etcd, controller-manager (garbage
//! collector, disruption controller), scheduler and kwok, the real `lastcall-agent` process
//! with the chart's arguments and RBAC, and the tests playing Agones (`kube_box::agones`).
//!
//! Every order is judged from the API server's audit log, by the resourceVersion each write
//! produced (one etcd: one revision counter across Nodes, Pods and GameServers).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};
use lastcall_testkit::agent::metric;
use lastcall_testkit::cluster::GameServerSpec;
use lastcall_testkit::cluster::agones::sdk::Call;
use lastcall_testkit::eventually::{eventually, try_eventually, wait_for};
use lastcall_testkit::gamelift::InstanceStatus;
use lastcall_testkit::kube_box::agent::{AgentProcess, Extra};
use lastcall_testkit::kube_box::agones::{self, Allocation, Crd, Server};
use lastcall_testkit::kube_box::audit::{Entry, describe};
use lastcall_testkit::kube_box::fleetiq::FleetIq;
use lastcall_testkit::kube_box::proxy::{Fault, Matcher};
use lastcall_testkit::kube_box::{ADMIN_USER, AGONES_USER, ALLOCATOR_USER};
use lastcall_testkit::scene::on_box::{BoxScene as Scene, DRAIN_LABEL};
use lastcall_testkit::scene::{cordoned, tainted};
use serde_json::{Value, json};

const DEADLINE: &str = "lastcall.dev/drain-deadline";
const CLAIM_LABEL: &str = "lastcall.dev/node";

/// One test's part of the box (`lastcall_testkit::scene::on_box`).
async fn scene(name: &str, crd: Crd) -> Scene {
    Scene::start(name, crd).await
}

/// Waits until the node is fenced, `released` are gone with their pods and `protected`
/// carry the drain deadline.
async fn drained(s: &Scene, released: &[Server], protected: &[Server]) {
    let done = try_eventually(
        "fenced, idle servers and their pods gone, matches protected",
        Duration::from_secs(40),
        Duration::from_millis(100),
        || async {
            if !fenced(&s.node_obj().await) {
                return None;
            }
            for srv in released {
                if s.agones.get(&srv.name).await.ok()?.is_some()
                    || !s.agones.pod_gone(&srv.name).await.ok()?
                {
                    return None;
                }
            }
            for srv in protected {
                let Some(gs) = s.agones.get(&srv.name).await.ok()? else {
                    // A server in use is gone: say who deleted it, at once.
                    let log = s.journal();
                    let deletes: Vec<&Entry> = log
                        .iter()
                        .filter(|e| {
                            e.resource == "gameservers" && e.verb == "delete" && e.name == srv.name
                        })
                        .collect();
                    return Some(Err(format!(
                        "{}, in use, was deleted:\n{}",
                        srv.name,
                        dump(&deletes)
                    )));
                };
                gs.metadata.annotations.as_ref()?.get(DEADLINE)?;
            }
            Some(Ok(()))
        },
    )
    .await;
    if let Ok(Err(lost)) = &done {
        panic!("{lost}");
    }
    if let Err(e) = done {
        // A request the chart's RBAC refused is the likeliest cause: name it.
        assert_nothing_forbidden(s);
        panic!("{e}");
    }
}

/// Where a write of the journal stands in etcd's order.
async fn write_rv(s: &Scene, e: &Entry) -> u64 {
    match s.place(e).await {
        Some(at) => at,
        None => rv(e),
    }
}

fn fenced(n: &Node) -> bool {
    let v = serde_json::to_value(n).unwrap_or(Value::Null);
    cordoned(&v) && tainted(&v)
}

fn rv(e: &Entry) -> u64 {
    e.rv()
        .unwrap_or_else(|| panic!("no resourceVersion in the answer of {}", describe(e)))
}

fn dump(entries: &[&Entry]) -> String {
    entries
        .iter()
        .map(|e| describe(e))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The chart's RBAC sufficed: the API server refused none of the agent's requests.
fn assert_nothing_forbidden(s: &Scene) {
    let refused: Vec<Entry> = s
        .kbox
        .audit()
        .into_iter()
        .filter(|e| e.by_agent() && (e.code == 401 || e.code == 403))
        .collect();
    assert!(
        refused.is_empty(),
        "the chart's RBAC refused the agent:\n{}",
        dump(&refused.iter().collect::<Vec<_>>())
    );
}

/// The fence: the agent's first Node write that cordons or taints must do both, in one
/// write. Returns it.
fn the_fence<'a>(log: &'a [Entry], node: &str) -> &'a Entry {
    let node_writes: Vec<&Entry> = log
        .iter()
        .filter(|e| e.by_agent() && e.is_write() && e.resource == "nodes" && e.name == node)
        .collect();
    let first = node_writes
        .iter()
        .find(|e| e.ok() && (cordoned(&e.response) || tainted(&e.response)))
        .unwrap_or_else(|| panic!("no fence write by the agent:\n{}", dump(&node_writes)));
    assert!(
        cordoned(&first.response) && tainted(&first.response),
        "the fence must cordon and taint in one write: {}",
        describe(first)
    );
    first
}

/// The agent's accepted DELETEs of GameServers, by server name.
fn releases(log: &[Entry]) -> BTreeMap<String, &Entry> {
    log.iter()
        .filter(|e| e.by_agent() && e.verb == "delete" && e.resource == "gameservers" && e.ok())
        .map(|e| (e.name.clone(), e))
        .collect()
}

/// Asserts the DELETE names the server it read: uid and resourceVersion preconditions.
fn assert_preconditioned(e: &Entry, s: &Server) {
    assert_eq!(
        e.sent("/preconditions/uid").and_then(Value::as_str),
        Some(s.uid.as_str()),
        "release of {} without its uid precondition: {}",
        s.name,
        e.request
    );
    assert!(
        e.sent("/preconditions/resourceVersion")
            .and_then(Value::as_str)
            .is_some_and(|v| !v.is_empty()),
        "release of {} without a resourceVersion precondition: {}",
        s.name,
        e.request
    );
}

/// Successful allocations (the allocator's Ready → Allocated updates): name → resourceVersion.
fn allocations(log: &[Entry]) -> Vec<(String, u64)> {
    log.iter()
        .filter(|e| {
            e.user == ALLOCATOR_USER
                && e.verb == "update"
                && e.resource == "gameservers"
                && e.ok()
                && e.response.pointer("/status/state") == Some(&json!("Allocated"))
        })
        .map(|e| (e.name.clone(), rv(e)))
        .collect()
}

/// The agent's writes to GameServers that set its node-claim label.
fn claims(log: &[Entry]) -> Vec<&Entry> {
    log.iter()
        .filter(|e| {
            e.by_agent()
                && e.verb == "patch"
                && e.resource == "gameservers"
                && e.ok()
                && e.request.to_string().contains(CLAIM_LABEL)
                && !e.request.to_string().contains("node-draining")
        })
        .collect()
}

/// Milliseconds between two audit entries' arrival.
fn ms_between(a: &Entry, b: &Entry) -> f64 {
    match (a.received, b.received) {
        (Some(a), Some(b)) => (b.as_millisecond() - a.as_millisecond()) as f64,
        _ => f64::NAN,
    }
}

/// The FleetIQ drain end to end, through the real pubsub: 3 idle servers, a match
/// (Allocated, its game keeping 600 s of grace) and a Reserved server (row 1: as busy as an
/// Allocated one). The idle ones are released after the fence, the two others protected and
/// never deleted. Then the Reserved one's game shuts down and exits, and the match's game
/// calls `Shutdown()` and keeps running into its grace: Agones deletes its server, which its
/// finalizer holds, and its pod, which kwok keeps terminating (rows 6 and 7). With the settle
/// passed and the agent's passes after, no deregistration; once the game exits, the pod
/// goes, Agones lets the server go, and the node is deregistered once. Then FleetIQ says
/// `ACTIVE` again (row 9): the agent hears it, and still never lifts its fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleetiq_drain_fences_releases_protects_and_deregisters_once() {
    const SETTLE: jiff::SignedDuration = jiff::SignedDuration::from_secs(5); // the chart's
    let s = scene("box-fleetiq", Crd::SelectableNodeName).await;
    let idle = s.ready_servers(3).await;
    let long = s
        .agones
        .ready(agones::on_node(GameServerSpec::new("gs-3"), &s.node).grace_seconds(600))
        .await
        .expect("gs-3");
    let reserved = s
        .agones
        .ready(agones::on_node(GameServerSpec::new("gs-4"), &s.node))
        .await
        .expect("gs-4");
    s.allocate(&long).await;
    s.agones.reserve(&reserved).await.expect("reserve");
    let busy = [long.clone(), reserved.clone()];
    let mut fiq = FleetIq::start(&s.node)
        .await
        .expect("FleetIQ emulators and pubsub");
    let agent = s.start_agent(fiq.agent_extra()).await;
    wait_for("registered with FleetIQ", || async {
        (fiq.gl.count("RegisterGameServer") == 1).then_some(())
    })
    .await;
    s.agent_sees(&agent, 5).await;

    let signalled = jiff::Timestamp::now();
    fiq.set(InstanceStatus::Draining);
    drained(&s, &idle, &busy).await;
    assert!(fiq.pubsub_running(), "pubsub exited");
    let log = s.journal();
    let fence = the_fence(&log, &s.node);
    let released = releases(&log);
    assert_eq!(
        released.keys().cloned().collect::<BTreeSet<_>>(),
        idle.iter().map(|s| s.name.clone()).collect(),
        "exactly the idle servers are released"
    );
    for srv in &idle {
        let d = released[&srv.name];
        assert_preconditioned(d, srv);
        let deleted = s.deleted(&srv.name).await;
        assert!(rv(d) > rv(fence), "{} released before the fence", srv.name);
        // Agones' controller deletes the released server's pod; its finalizer holds the
        // server until the pod is gone.
        let pod_deleted = log
            .iter()
            .find(|e| {
                e.user == AGONES_USER
                    && e.verb == "delete"
                    && e.resource == "pods"
                    && e.name == srv.name
                    && e.ok()
            })
            .unwrap_or_else(|| panic!("Agones never deleted pod {}", srv.name));
        assert!(
            rv(pod_deleted) > rv(d),
            "pod {} deleted before its server",
            srv.name
        );
        assert!(
            deleted > rv(pod_deleted),
            "{} gone (rv {deleted}) before its pod was deleted",
            srv.name
        );
    }
    for (b, state) in [(&long, "Allocated"), (&reserved, "Reserved")] {
        let protect = log
            .iter()
            .find(|e| {
                e.by_agent()
                    && e.verb == "patch"
                    && e.resource == "gameservers"
                    && e.name == b.name
                    && e.ok()
                    && e.response
                        .pointer(&format!(
                            "/metadata/annotations/{}",
                            DEADLINE.replace('/', "~1")
                        ))
                        .is_some()
            })
            .unwrap_or_else(|| panic!("{} never protected", b.name));
        assert!(
            rv(protect) > rv(fence),
            "{} protected before the fence",
            b.name
        );
        agones::expect_state(&s.agones, b, state).await.unwrap();
    }
    assert_eq!(
        fiq.gl.count("DeregisterGameServer"),
        0,
        "not while matches run"
    );

    // The Reserved server's game shuts down and exits; the match's game calls Shutdown()
    // and uses its grace: its server is held by Agones' finalizer, its pod terminating.
    s.agones.shutdown(&reserved).await.expect("shutdown");
    s.agones
        .sdk(&long.name, Call::Shutdown)
        .await
        .expect("Shutdown()");
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(s.client.clone(), &s.ns);
    wait_for(
        "gs-4 gone; gs-3 held by its finalizer, its pod terminating",
        || async {
            let gs = s.agones.get(&long.name).await.ok()??;
            let pod = pods.get_opt(&long.name).await.ok()??;
            (s.agones.get(&reserved.name).await.ok()?.is_none()
                && gs.metadata.deletion_timestamp.is_some()
                && gs
                    .metadata
                    .finalizers
                    .unwrap_or_default()
                    .contains(&"agones.dev/controller".to_string())
                && pod.metadata.deletion_timestamp.is_some())
            .then_some(())
        },
    )
    .await;
    // The agent had its chance: the fence has stood its settle (by the API server's clock),
    // and two passes began after that and after the pod turned terminating.
    let settled = fence.received.expect("the fence's time") + SETTLE;
    wait_for("the settle passed", || async {
        (jiff::Timestamp::now() > settled).then_some(())
    })
    .await;
    s.passes(&agent, 2).await;
    assert_eq!(
        fiq.gl.count("DeregisterGameServer"),
        0,
        "deregistered while a game pod was terminating under a server Agones' finalizer holds"
    );
    // The game exits: the pod goes, then Agones lets the server go.
    s.agones
        .game_exit(&long.name)
        .await
        .expect("the game exits");
    eventually(
        "deregistered once the node is empty",
        Duration::from_secs(60),
        Duration::from_millis(100),
        || async { (fiq.gl.count("DeregisterGameServer") == 1).then_some(()) },
    )
    .await;
    wait_for("deregistration recorded on the Node", || async {
        s.node_obj()
            .await
            .metadata
            .annotations?
            .contains_key("lastcall.dev/deregistered")
            .then_some(())
    })
    .await;
    let log = s.journal();
    let pod_gone = log
        .iter()
        .filter(|e| e.resource == "pods" && e.name == long.name && e.verb == "delete" && e.ok())
        .filter_map(|e| e.rv())
        .max()
        .expect("the match's pod deletions");
    let gs_gone = s.deleted(&long.name).await;
    assert!(
        gs_gone > pod_gone,
        "gs-3 let go (rv {gs_gone}) before its pod went (rv {pod_gone})"
    );

    // FleetIQ says ACTIVE again: the agent hears it, passes twice more, and keeps its fence.
    let heard = |m: &str| {
        metric(
            m,
            "lastcall_signals_total",
            &[("source", "fleetiq"), ("status", "ACTIVE")],
        )
        .unwrap_or(0.0)
    };
    let before = heard(&agent.metrics().await);
    fiq.set(InstanceStatus::Active);
    wait_for("the agent hears FleetIQ's ACTIVE", || async {
        (heard(&agent.metrics().await) > before).then_some(())
    })
    .await;
    s.passes(&agent, 2).await;
    let calls = fiq.gl.calls();
    let dereg = calls
        .iter()
        .position(|c| c.op == "DeregisterGameServer")
        .expect("the deregistration");
    assert_eq!(fiq.gl.count("DeregisterGameServer"), 1);
    let after: Vec<&str> = calls[dereg + 1..]
        .iter()
        .map(|c| c.op.as_str())
        .filter(|op| {
            matches!(
                *op,
                "RegisterGameServer" | "ClaimGameServer" | "UpdateGameServer"
            )
        })
        .collect();
    assert!(
        after.is_empty(),
        "FleetIQ lifecycle calls after deregistering: {after:?}"
    );
    let log = s.journal();
    assert!(fenced(&s.node_obj().await), "the node must stay fenced");
    for e in log.iter().filter(|e| {
        e.by_agent() && e.resource == "nodes" && e.is_write() && e.ok() && rv(e) > rv(fence)
    }) {
        assert!(
            cordoned(&e.response) && tainted(&e.response),
            "the agent lifted its fence: {}",
            describe(e)
        );
    }
    // The agent's requests for the drain, counted as the emulator's figure is: from the
    // signal on, watches excluded (they are open before and after), from every namespace
    // (its Events too).
    let mut requests: BTreeMap<String, usize> = BTreeMap::new();
    for e in s
        .kbox
        .audit()
        .iter()
        .filter(|e| e.by_agent() && e.verb != "watch" && e.received >= Some(signalled))
    {
        *requests
            .entry(format!("{} {} {}", e.verb, e.resource, e.code))
            .or_default() += 1;
    }
    eprintln!(
        "box: FleetIQ drain of 3 idle + 2 busy servers: {} agent requests {requests:?}",
        requests.values().sum::<usize>()
    );
    assert_nothing_forbidden(&s);
    agent.stop().await.expect("agent stops on SIGTERM");
}

/// A drain and its cancel by FleetIQ (`DRAINING`, then `ACTIVE` through the real pubsub):
/// what the agent found is what it leaves. (The operator's label and its removal is
/// `scenarios.rs`'s cancel, on both backends.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleetiq_back_to_active_restores_exactly_what_was_there() {
    let s = scene("box-cancel-fiq", Crd::SelectableNodeName).await;
    let srv = s.ready_servers(1).await.remove(0);
    s.allocate(&srv).await;
    s.agones
        .api()
        .patch(
            &srv.name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {"example.com/match": "42"}}})),
        )
        .await
        .unwrap();
    // Someone else's state on the node: a taint, a label and an annotation of theirs.
    let n = s.node_obj().await;
    let mut taints: Vec<Value> = n
        .spec
        .and_then(|s| s.taints)
        .unwrap_or_default()
        .into_iter()
        .map(|t| serde_json::to_value(t).unwrap())
        .collect();
    taints.push(json!({"key": "example.com/foreign", "value": "x", "effect": "NoSchedule"}));
    s.nodes()
        .patch(
            &s.node,
            &PatchParams::default(),
            &Patch::Merge(json!({
                "metadata": {"labels": {"example.com/pool": "a"},
                             "annotations": {"example.com/keep": "yes"}},
                "spec": {"taints": taints},
            })),
        )
        .await
        .unwrap();
    let fiq = FleetIq::start(&s.node).await.expect("FleetIQ");
    let agent = s.start_agent(fiq.agent_extra()).await;
    s.agent_sees(&agent, 1).await;
    wait_for("registered with FleetIQ", || async {
        (fiq.gl.count("RegisterGameServer") == 1).then_some(())
    })
    .await;
    // The agent's start-up writes (ownership, the registration record) are part of what
    // was there before the drain.
    wait_for("the agent's start-up writes on the node", || async {
        let a = s.node_obj().await.metadata.annotations?;
        (a.contains_key("lastcall.dev/owner") && a.contains_key("lastcall.dev/registered"))
            .then_some(())
    })
    .await;
    let before = (snapshot_node(&s).await, snapshot_gs(&s, &srv).await);

    fiq.set(InstanceStatus::Draining);
    drained(&s, &[], std::slice::from_ref(&srv)).await;
    fiq.set(InstanceStatus::Active);
    let restored = try_eventually(
        "everything as it was before the drain",
        Duration::from_secs(40),
        Duration::from_millis(100),
        || async {
            let now = (snapshot_node(&s).await, snapshot_gs(&s, &srv).await);
            (now == before).then_some(())
        },
    )
    .await;
    if let Err(e) = restored {
        let now = (snapshot_node(&s).await, snapshot_gs(&s, &srv).await);
        panic!("{e}\nbefore the drain: {before:#?}\nafter the cancel: {now:#?}");
    }
    let log = s.journal();
    let fence = the_fence(&log, &s.node);
    assert!(
        log.iter().any(|e| e.by_agent()
            && e.resource == "nodes"
            && e.is_write()
            && e.ok()
            && rv(e) > rv(fence)
            && !cordoned(&e.response)
            && !tainted(&e.response)),
        "the agent's own write lifted the fence"
    );
    agones::expect_state(&s.agones, &srv, "Allocated")
        .await
        .unwrap();
    assert_eq!(
        fiq.gl.count("DeregisterGameServer"),
        0,
        "a cancel never deregisters"
    );
    assert_nothing_forbidden(&s);
    agent.stop().await.expect("agent stops");
}

type NodeShape = (
    BTreeMap<String, String>,
    BTreeMap<String, String>,
    Value,
    Option<bool>,
);

/// What a cancel must restore on the node: labels, annotations, taints, cordon.
async fn snapshot_node(s: &Scene) -> NodeShape {
    let n = s.node_obj().await;
    let spec = n.spec.unwrap_or_default();
    (
        n.metadata.labels.unwrap_or_default(),
        n.metadata.annotations.unwrap_or_default(),
        serde_json::to_value(spec.taints.unwrap_or_default()).unwrap(),
        spec.unschedulable.filter(|u| *u),
    )
}

/// What a cancel must restore on a server: labels and annotations.
async fn snapshot_gs(
    s: &Scene,
    srv: &Server,
) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
    let gs = s.agones.get(&srv.name).await.unwrap().expect("the server");
    (
        gs.metadata.labels.unwrap_or_default(),
        gs.metadata.annotations.unwrap_or_default(),
    )
}

/// A label drain of 2 Ready and 1 Allocated servers under `crd`; returns the log, the
/// servers and the operator's label write.
async fn selection_drain(name: &str, crd: Crd) -> (Scene, Vec<Entry>, Vec<Server>) {
    let s = scene(name, crd).await;
    let servers = s.ready_servers(3).await;
    s.allocate(&servers[2]).await;
    let agent = s.start_agent(Extra::default()).await;
    s.agent_sees(&agent, servers.len()).await;
    s.drain_label(true).await;
    drained(&s, &servers[..2], &servers[2..]).await;
    let log = s.journal();
    let label = log
        .iter()
        .find(|e| {
            e.user == ADMIN_USER
                && e.resource == "nodes"
                && e.verb == "patch"
                && e.request.to_string().contains(DRAIN_LABEL)
        })
        .expect("the drain label write");
    let fence = the_fence(&log, &s.node);
    for srv in &servers[..2] {
        assert_preconditioned(releases(&log)[&srv.name], srv);
        assert!(
            s.deleted(&srv.name).await > rv(fence),
            "{} released before the fence",
            srv.name
        );
    }
    // Every request of the agent's user from the label to the drain's end (one agent runs
    // at a time on the box): reads, watches, Events included.
    let requests = s
        .kbox
        .audit()
        .iter()
        .filter(|e| e.by_agent() && e.received >= label.received)
        .count();
    eprintln!(
        "box ({crd:?}): label -> fence {:.0} ms; {requests} agent requests for a drain of 2 idle + 1 busy",
        ms_between(label, fence)
    );
    // The match ends: with no FleetIQ to hand the node to, it stays fenced and the agent
    // reports it empty.
    s.agones.shutdown(&servers[2]).await.expect("shutdown");
    wait_for("the agent reports the node empty", || async {
        let m = agent.metrics().await;
        (metric(&m, "lastcall_drain_phase", &[("phase", "empty")]) == Some(1.0)).then_some(())
    })
    .await;
    assert!(
        fenced(&s.node_obj().await),
        "the emptied node must stay fenced"
    );
    assert_nothing_forbidden(&s);
    agent.stop().await.expect("agent stops");
    let log = s.journal();
    for e in log
        .iter()
        .filter(|e| e.by_agent() && e.resource == "nodes" && e.is_write() && e.ok())
        .filter(|e| rv(e) > rv(fence))
    {
        assert!(
            cordoned(&e.response) && tainted(&e.response),
            "the agent lifted its fence: {}",
            describe(e)
        );
    }
    (s, log, servers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn selected_by_field_the_agent_writes_no_claim() {
    let (s, log, _) = selection_drain("box-field", Crd::SelectableNodeName).await;
    let claims = claims(&log);
    assert!(
        claims.is_empty(),
        "claims written although status.nodeName is selectable:\n{}",
        dump(&claims)
    );
    drop(s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn selected_by_label_the_agent_claims_each_server_once() {
    let (s, log, servers) = selection_drain("box-label", Crd::LabelsOnly).await;
    let claims = claims(&log);
    let label = log
        .iter()
        .find(|e| {
            e.user == ADMIN_USER
                && e.resource == "nodes"
                && e.request.to_string().contains(DRAIN_LABEL)
        })
        .expect("the drain label write");
    for srv in &servers {
        let mine: Vec<&&Entry> = claims.iter().filter(|e| e.name == srv.name).collect();
        assert_eq!(mine.len(), 1, "{}: claims\n{}", srv.name, dump(&claims));
        assert!(
            rv(mine[0]) < rv(label),
            "{} claimed only after the drain began",
            srv.name
        );
    }
    drop(s);
}

/// One node, 16 Ready servers, an allocator with the exclusion selector allocating from a
/// stale read in a loop while the agent fences and releases them. The race is made to
/// happen in every run: the agent's first release DELETE is held by the proxy in front of the
/// API server until the allocator has won that very server (a fresh read, an update with its
/// resourceVersion), then let go. By resourceVersion the allocation lands after the fence,
/// and the held DELETE, naming the version the agent read while the server was Ready, is
/// refused by its precondition: the match is kept. Then the promise, by resourceVersion: no
/// allocated server deleted, every release preconditioned and after the fence, no allocation
/// of a server after the agent's first accepted write to it past the fence, none on the node
/// once the first round of releases is answered (but on a server whose DELETE failed), and
/// every allocated server protected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocation_racing_the_drain_never_loses_a_match() {
    let s = scene("box-race", Crd::SelectableNodeName).await;
    let servers = s.ready_servers(16).await;
    let by_name: BTreeMap<String, Server> = servers
        .iter()
        .map(|s| (s.name.clone(), s.clone()))
        .collect();
    let proxy = s.kbox.fault_proxy().await.expect("the fault proxy");
    proxy.arm(
        "first release",
        Matcher::new(
            reqwest::Method::DELETE,
            &format!("/apis/agones.dev/v1/namespaces/{}/gameservers/*", s.ns),
        ),
        Fault::HoldUntilReleased,
        1,
    );
    let agent = AgentProcess::start_at(&s.kbox, &proxy.url(), &s.node, Extra::default())
        .await
        .expect("the agent process");
    agent.ready().await.expect("agent ready");
    s.agent_sees(&agent, servers.len()).await;

    let stop = tokio_util::sync::CancellationToken::new();
    let won = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let allocator = {
        let (a, stop, won) = (s.agones.clone(), stop.clone(), won.clone());
        tokio::spawn(async move {
            let mut n: u64 = 0;
            while !stop.is_cancelled() {
                n += 1;
                let Ok(list) = a.candidates().await else {
                    continue;
                };
                if list.is_empty() {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
                let pick = list[(n as usize * 7) % list.len()].clone();
                // The allocator's cache is a little behind: a write can land in between.
                tokio::time::sleep(Duration::from_millis(n % 25)).await;
                if let Ok(Allocation::Allocated(_)) = a.allocate_read(pick).await {
                    won.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    // Matches arrive now and then, not all at once.
                    tokio::time::sleep(Duration::from_millis(n % 30)).await;
                }
            }
        })
    };
    wait_for("the allocator won twice", || async {
        (won.load(std::sync::atomic::Ordering::SeqCst) >= 2).then_some(())
    })
    .await;
    s.drain_label(true).await;
    // The race: the agent's first release is held; the allocator wins that server.
    let held = proxy
        .wait_injected("first release", Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let raced = held
        .uri
        .split('?')
        .next()
        .and_then(|p| p.rsplit('/').next())
        .unwrap_or_default()
        .to_string();
    let _ = s.agones.allocate(&raced).await.expect("allocate");
    agones::expect_state(&s.agones, &by_name[&raced], "Allocated")
        .await
        .unwrap_or_else(|e| panic!("the raced server: {e}"));
    proxy.release("first release");
    eventually(
        "fenced and no Ready server left on the node",
        Duration::from_secs(40),
        Duration::from_millis(100),
        || async {
            if !fenced(&s.node_obj().await) {
                return None;
            }
            for srv in &servers {
                if let Some(gs) = s.agones.get(&srv.name).await.ok()?
                    && gs.metadata.deletion_timestamp.is_none()
                    && gs.data.pointer("/status/state") != Some(&json!("Allocated"))
                {
                    return None;
                }
            }
            Some(())
        },
    )
    .await;
    stop.cancel();
    allocator.await.expect("allocator task");
    // Every allocated server ends protected (its last writes are the agent's).
    wait_for("every allocated server protected", || async {
        for srv in &servers {
            if let Some(gs) = s.agones.get(&srv.name).await.ok()?
                && gs.metadata.deletion_timestamp.is_none()
                && !gs.metadata.annotations.as_ref()?.contains_key(DEADLINE)
            {
                return None;
            }
        }
        Some(())
    })
    .await;

    let log = s.journal();
    let fence = rv(the_fence(&log, &s.node));
    let allocs = allocations(&log);
    let released = releases(&log);
    // The race happened: the raced server was allocated after the fence, and the held
    // DELETE, naming the version read while it was Ready, was refused by its precondition.
    let raced_at = allocs
        .iter()
        .filter(|(n, _)| *n == raced)
        .map(|(_, at)| *at)
        .max()
        .unwrap_or_else(|| panic!("{raced} never allocated"));
    assert!(
        raced_at > fence,
        "{raced} allocated (rv {raced_at}) before the fence (rv {fence}): no race"
    );
    let refused: Vec<&Entry> = log
        .iter()
        .filter(|e| {
            e.by_agent() && e.verb == "delete" && e.resource == "gameservers" && e.name == raced
        })
        .collect();
    assert!(
        !refused.is_empty()
            && refused.iter().all(|e| e.code == 409)
            && refused.iter().all(|e| {
                e.sent("/preconditions/resourceVersion")
                    .and_then(Value::as_str)
                    .and_then(|v| v.parse::<u64>().ok())
                    .is_some_and(|v| v < raced_at)
            }),
        "the held release of {raced} must name a version before the allocation (rv {raced_at}) and be refused:\n{}",
        dump(&refused)
    );
    // 1. No match lost: nothing the allocator won was deleted by the agent, and every
    //    release named the server it read.
    let mut deleted_at: BTreeMap<&str, u64> = BTreeMap::new();
    for (name, d) in &released {
        assert_preconditioned(d, &by_name[name]);
        let at_delete = write_rv(&s, d).await;
        assert!(
            at_delete > fence,
            "{name} released (rv {at_delete}) before the fence (rv {fence})"
        );
        deleted_at.insert(name.as_str(), at_delete);
        if let Some((_, at)) = allocs.iter().find(|(n, _)| n == name) {
            panic!("the agent deleted {name} (rv {at_delete}) which was allocated (rv {at})");
        }
    }
    // 2. Per server: no allocation after the agent's first accepted write to it past the fence.
    let mut first_write: BTreeMap<String, u64> = BTreeMap::new();
    for e in log
        .iter()
        .filter(|e| e.by_agent() && e.resource == "gameservers" && e.is_write() && e.ok())
    {
        let at = write_rv(&s, e).await;
        if at > fence {
            let slot = first_write.entry(e.name.clone()).or_insert(at);
            *slot = (*slot).min(at);
        }
    }
    for (name, at) in &allocs {
        if let Some(first) = first_write.get(name) {
            assert!(
                at < first,
                "{name} allocated (rv {at}) after the agent's first write to it (rv {first})"
            );
        }
    }
    // 3. Node-wide: once the releases are answered, no allocation succeeds (but on a server
    //    whose own DELETE failed, as the promise allows).
    let failed_deletes: BTreeSet<&str> = log
        .iter()
        .filter(|e| e.by_agent() && e.verb == "delete" && e.resource == "gameservers" && !e.ok())
        .map(|e| e.name.as_str())
        .collect();
    if let Some(round_done) = deleted_at.values().copied().max() {
        let late: Vec<&(String, u64)> = allocs
            .iter()
            .filter(|(n, at)| *at > round_done && !failed_deletes.contains(n.as_str()))
            .collect();
        assert!(
            late.is_empty(),
            "allocations after the agent's releases were answered (rv {round_done}): {late:?}"
        );
    }
    // 4. Every allocated server is still there, Allocated.
    for (name, _) in &allocs {
        agones::expect_state(&s.agones, &by_name[name], "Allocated")
            .await
            .unwrap();
    }
    let after_fence = allocs.iter().filter(|(_, at)| *at > fence).count();
    eprintln!(
        "box race: {} allocations ({after_fence} after the fence, {raced} won against the agent's held release), {} released, {} release DELETEs refused",
        allocs.len(),
        released.len(),
        failed_deletes.len()
    );
    assert_nothing_forbidden(&s);
    agent.stop().await.expect("agent stops");
}

/// A Spot notice's deadline reaches the games on a real API server: at `deadline − grace`
/// the agent sends each match's pod one DELETE preconditioned on its uid, with no grace
/// override, under `--graceful-termination` both the `Always` server's and the `Never` one's
/// (Agones' PDB selects that pod; a hard deadline does not ask it: the machine goes anyway).
/// No Eviction, and no GameServer deleted by the agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spot_notice_ends_matches_by_a_preconditioned_delete_at_deadline_minus_grace() {
    const LEAD: i64 = 8;
    let s = scene("box-spot", Crd::SelectableNodeName).await;
    let always = s
        .agones
        .ready_server_evictable("gs-always", &s.node, "Always")
        .await
        .expect("server");
    let never = s
        .agones
        .ready_server_evictable("gs-never", &s.node, "Never")
        .await
        .expect("server");
    s.allocate(&always).await;
    s.allocate(&never).await;
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(s.client.clone(), &s.ns);
    let uid_of = |name: &str| {
        let pods = pods.clone();
        let name = name.to_string();
        async move {
            pods.get(&name)
                .await
                .expect("pod")
                .metadata
                .uid
                .expect("uid")
        }
    };
    let (always_pod, never_pod) = (uid_of("gs-always").await, uid_of("gs-never").await);
    let grace_ms = agones::GRACE_SECONDS * 1000;
    let iid = lastcall_testkit::gamelift::instance_id(&s.node);
    let imds = lastcall_testkit::imds::ImdsEmulator::start(&iid, &s.node)
        .await
        .expect("IMDS");
    // Chart values agent.awsImds, agent.gracefulTermination and agent.imdsEndpoint.
    let agent = s
        .start_agent(Extra {
            args: vec![
                "--aws-imds".into(),
                "--graceful-termination".into(),
                format!("--imds-endpoint={}", imds.url()),
            ],
            env: vec![],
        })
        .await;
    s.agent_sees(&agent, 2).await;

    let deadline = jiff::Timestamp::now() + jiff::SignedDuration::from_secs(LEAD);
    imds.set_spot_action(Some(json!({
        "action": "terminate",
        "time": deadline.strftime("%Y-%m-%dT%H:%M:%SZ").to_string(),
    })));
    // IMDS gives whole seconds: the deadline the agent sees.
    let deadline: jiff::Timestamp = deadline
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
        .parse()
        .expect("a timestamp");
    eventually(
        "both matches' pods ended",
        Duration::from_secs(LEAD as u64 + 30),
        Duration::from_millis(100),
        || async {
            (s.agones.pod_gone("gs-always").await.ok()?
                && s.agones.pod_gone("gs-never").await.ok()?)
            .then_some(())
        },
    )
    .await;
    let log = s.journal();
    let ends: Vec<&Entry> = log
        .iter()
        .filter(|e| {
            e.by_agent()
                && e.resource == "pods"
                && (e.subresource == "eviction" || e.verb == "delete")
        })
        .collect();
    // Never before `deadline − grace` (the game gets its whole grace, by the API server's
    // clock). How soon after it is a figure of the machine's load, not asserted.
    let earliest = deadline - jiff::SignedDuration::from_millis(grace_ms);
    for e in &ends {
        let at = e.received.expect("a timestamp");
        assert!(
            at >= earliest,
            "{} before deadline − grace ({earliest})",
            describe(e)
        );
    }
    // A request that finds the pod already gone (404) is harmless; the rest is the promise.
    let acted = |pod: &str| -> Vec<&Entry> {
        ends.iter()
            .filter(|e| e.name == pod && e.code != 404)
            .copied()
            .collect()
    };
    assert!(
        ends.iter().all(|e| e.subresource != "eviction"),
        "the agent sent an Eviction:\n{}",
        dump(&ends)
    );
    for (pod, uid) in [("gs-always", &always_pod), ("gs-never", &never_pod)] {
        let ended = acted(pod);
        assert!(
            ended.len() == 1 && ended[0].verb == "delete" && ended[0].ok(),
            "{pod} must be ended by one DELETE:\n{}",
            dump(&ends)
        );
        assert_eq!(
            ended[0].sent("/preconditions/uid"),
            Some(&json!(uid)),
            "the DELETE names {pod}'s uid"
        );
        assert_eq!(
            ended[0].sent("/gracePeriodSeconds"),
            None,
            "the DELETE of {pod} overrides no grace period"
        );
    }
    assert!(
        !log.iter()
            .any(|e| e.by_agent() && e.resource == "gameservers" && e.verb == "delete"),
        "the agent deleted a GameServer in a match"
    );
    assert_nothing_forbidden(&s);
    agent.stop().await.expect("agent stops");
}

/// Row 2 of the Guarantees without `--graceful-termination`: `eviction.safe` alone decides
/// which matches a Terminate deadline ends. Agones documents `Always` and `OnUpgrade` as
/// games that take `TERM` and end within their grace (docs `Advanced/controlling-disruption`:
/// "supports TERM and terminates within ten minutes" / "within an hour"), and `Never` as one
/// that does not; its pod alone carries `agones.dev/safe-to-evict: "false"`, which the
/// chart's PDB covers (`pkg/cloudproduct/eviction/eviction.go`). A Spot interruption takes
/// the machine whatever anyone decides, so at `deadline − grace` the `Always` and `OnUpgrade`
/// games are sent `TERM` by a DELETE of their pods preconditioned on the uid (never an
/// Eviction) and the `Never` game is left to run: no Eviction, no DELETE of its pod,
/// checked after the agent's passes that ended the others and two more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_graceful_termination_a_spot_notice_ends_only_the_games_that_take_term() {
    const LEAD: i64 = 8;
    let s = scene("box-safe", Crd::SelectableNodeName).await;
    let servers = s.servers(&["Never", "OnUpgrade", "Always"]).await;
    for srv in &servers {
        s.allocate(srv).await;
    }
    let (never, upgrade, always) = (&servers[0], &servers[1], &servers[2]);
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(s.client.clone(), &s.ns);
    let mut pod_uid = BTreeMap::new();
    for (srv, label, ca) in [
        (never, "false", "false"),
        (upgrade, "true", "false"),
        (always, "true", "true"),
    ] {
        let p = pods.get(&srv.name).await.expect("the pod");
        // Agones' table on the real server's objects (eviction.go).
        let labels = p.metadata.labels.clone().unwrap_or_default();
        let annotations = p.metadata.annotations.clone().unwrap_or_default();
        assert_eq!(
            (
                labels.get("agones.dev/safe-to-evict").map(String::as_str),
                annotations
                    .get("cluster-autoscaler.kubernetes.io/safe-to-evict")
                    .map(String::as_str)
            ),
            (Some(label), Some(ca)),
            "{}'s pod",
            srv.name
        );
        pod_uid.insert(srv.name.clone(), p.metadata.uid.expect("uid"));
    }
    let iid = lastcall_testkit::gamelift::instance_id(&s.node);
    let imds = lastcall_testkit::imds::ImdsEmulator::start(&iid, &s.node)
        .await
        .expect("IMDS");
    let agent = s
        .start_agent(Extra {
            args: vec![
                "--aws-imds".into(),
                format!("--imds-endpoint={}", imds.url()),
            ],
            env: vec![],
        })
        .await;
    s.agent_sees(&agent, 3).await;
    let deadline = jiff::Timestamp::now() + jiff::SignedDuration::from_secs(LEAD);
    let stamp = deadline.strftime("%Y-%m-%dT%H:%M:%SZ").to_string();
    imds.set_spot_action(Some(json!({"action": "terminate", "time": stamp})));
    let deadline: jiff::Timestamp = stamp.parse().expect("a timestamp");
    eventually(
        "the OnUpgrade and Always games' pods ended",
        Duration::from_secs(LEAD as u64 + 30),
        Duration::from_millis(100),
        || async {
            (s.agones.pod_gone(&upgrade.name).await.ok()?
                && s.agones.pod_gone(&always.name).await.ok()?)
            .then_some(())
        },
    )
    .await;
    // The agent had its chance at the Never game: the pass that ended the others, and two
    // more after them.
    s.passes(&agent, 2).await;
    let log = s.journal();
    let ends: Vec<&Entry> = log
        .iter()
        .filter(|e| {
            e.by_agent()
                && e.resource == "pods"
                && (e.subresource == "eviction" || e.verb == "delete")
        })
        .collect();
    assert!(
        ends.iter().all(|e| e.subresource != "eviction"),
        "the agent sent an Eviction:\n{}",
        dump(&ends)
    );
    let untouched: Vec<&&Entry> = ends.iter().filter(|e| e.name == never.name).collect();
    assert!(
        untouched.is_empty(),
        "the Never game was sent TERM without --graceful-termination:\n{}",
        dump(&untouched.iter().map(|e| **e).collect::<Vec<_>>())
    );
    let earliest = deadline - jiff::SignedDuration::from_secs(agones::GRACE_SECONDS);
    for srv in [upgrade, always] {
        let mine: Vec<&&Entry> = ends
            .iter()
            .filter(|e| e.name == srv.name && e.ok())
            .collect();
        assert!(
            !mine.is_empty() && mine.iter().all(|e| e.verb == "delete"),
            "{} must be ended by a pod DELETE:\n{}",
            srv.name,
            dump(&ends)
        );
        for e in &mine {
            assert_eq!(
                e.sent("/preconditions/uid"),
                Some(&json!(pod_uid[&srv.name])),
                "the DELETE names the pod's uid: {}",
                describe(e)
            );
            assert_eq!(
                e.sent("/gracePeriodSeconds"),
                None,
                "the DELETE overrides no grace period: {}",
                describe(e)
            );
            assert!(
                e.received.is_some_and(|t| t >= earliest),
                "{} before deadline − grace ({earliest})",
                describe(e)
            );
        }
    }
    assert!(
        !s.agones.pod_gone(&never.name).await.unwrap(),
        "the Never game's pod must still run"
    );
    agones::expect_state(&s.agones, never, "Allocated")
        .await
        .unwrap();
    assert!(
        !log.iter()
            .any(|e| e.by_agent() && e.resource == "gameservers" && e.verb == "delete"),
        "the agent deleted a GameServer in a match"
    );
    assert_nothing_forbidden(&s);
    agent.stop().await.expect("agent stops");
}
