//! Faults on the real API server: the real `lastcall-agent` process talks to the box's
//! kube-apiserver through `kube_box::proxy`, which injects one fault kind per test on each
//! of the drain's writes (the fence, a release, a protect write and a match's end): a 5xx, a
//! 429 with `Retry-After`, a request that never answers, and a write that is applied but
//! whose answer is lost. And the API server itself killed (SIGKILL) and restarted mid-drain.
//!
//! The drain is a Spot notice (IMDS) on a FleetIQ node: fence, release the idle servers,
//! protect the matches, end them at `deadline − grace` (a pod DELETE preconditioned on its
//! uid), deregister once the node is empty.
//! The promises are judged from the API server's audit log, by resourceVersion.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use kube::Api;
use kube::api::{DynamicObject, ListParams};
use lastcall_testkit::cluster::{EvictionSafe, GameServerSpec};
use lastcall_testkit::eventually::{eventually, try_eventually, wait_for};
use lastcall_testkit::kube_box::ALLOCATOR_USER;
use lastcall_testkit::kube_box::agent::AgentProcess;
use lastcall_testkit::kube_box::agones::{self, Crd, Server};
use lastcall_testkit::kube_box::audit::{AGENT_USER, as_journal};
use lastcall_testkit::kube_box::audit::{Entry, describe};
use lastcall_testkit::kube_box::fleetiq::FleetIq;
use lastcall_testkit::kube_box::proxy::{Fault, FaultProxy, Forwarded, Injection, Matcher};
use lastcall_testkit::promises;
use lastcall_testkit::scene::on_box::BoxScene as Scene;
use reqwest::Method;
use serde_json::{Value, json};

const TAINT: &str = "lastcall.dev/draining";
const DEADLINE: &str = "lastcall.dev/drain-deadline";
const DEREGISTERED: &str = "lastcall.dev/deregistered";
/// The Spot notice's lead: room for a fence retried after a hung first try (2 s) before
/// the matches' ends at `deadline − grace`.
const LEAD: i64 = 10;
/// The game pods' grace (the stand-in's `terminationGracePeriodSeconds`).
const GRACE_MS: i64 = 1000;
/// The agent's request deadline in these tests (chart value `agent.requestTimeout`; 10 s by
/// default), so a hung request costs 2 s.
const REQUEST_TIMEOUT: &str = "--request-timeout=2s";
/// How long a lost answer is held before it is lost: the test puts a replacement server in
/// place meanwhile.
const HOLD: Duration = Duration::from_millis(1500);

/// The four writes a fault is armed on.
const TARGETS: [&str; 4] = ["fence", "release", "protect", "end"];

/// One test's part of the box (`lastcall_testkit::scene::on_box`).
async fn scene(name: &str) -> Scene {
    Scene::start(name, Crd::SelectableNodeName).await
}

/// Three idle servers (`gs-0`..`gs-2`, `eviction.safe: Never`) and two matches (`gs-3`,
/// `gs-4`, `Always`: the Spot deadline ends them).
async fn servers(s: &Scene) -> (Vec<Server>, Vec<Server>) {
    let mut all = s
        .servers(&["Never", "Never", "Never", "Always", "Always"])
        .await;
    let busy = all.split_off(3);
    for b in &busy {
        s.allocate(b).await;
    }
    (all, busy)
}

/// Agones' part once the pods are gone: every server left is shut down and deleted.
async fn shut_down_the_rest(s: &Scene) {
    let left = s
        .agones
        .api()
        .list(&ListParams::default())
        .await
        .expect("list servers");
    for gs in left.items {
        let srv = server_of(&s.ns, &gs);
        s.agones.shutdown(&srv).await.expect("shutdown");
    }
}

fn server_of(ns: &str, gs: &DynamicObject) -> Server {
    Server {
        namespace: ns.to_string(),
        name: gs.metadata.name.clone().unwrap_or_default(),
        uid: gs.metadata.uid.clone().unwrap_or_default(),
    }
}

fn cordoned(n: &Value) -> bool {
    n.pointer("/spec/unschedulable").and_then(Value::as_bool) == Some(true)
}

fn taints(n: &Value) -> usize {
    n.pointer("/spec/taints")
        .and_then(Value::as_array)
        .map_or(0, |t| t.iter().filter(|t| t["key"] == TAINT).count())
}

fn rv(e: &Entry) -> u64 {
    e.rv()
        .unwrap_or_else(|| panic!("no resourceVersion in the answer of {}", describe(e)))
}

fn dump<'a>(entries: impl IntoIterator<Item = &'a Entry>) -> String {
    entries
        .into_iter()
        .map(describe)
        .collect::<Vec<_>>()
        .join("\n")
}

fn deadline_pointer() -> String {
    format!("/metadata/annotations/{}", DEADLINE.replace('/', "~1"))
}

/// The fence: a JSON patch of the node that cordons it.
fn is_fence(body: &Value) -> bool {
    body.as_array().is_some_and(|ops| {
        ops.iter()
            .any(|o| o["path"] == "/spec/unschedulable" && o["value"] == true)
    })
}

/// Arms `fault` on the first fence, release, protect write and match's end (a pod DELETE) of
/// the agent.
fn arm_all(p: &FaultProxy, s: &Scene, fault: &Fault) {
    let gs = format!("/apis/agones.dev/v1/namespaces/{}/gameservers/*", s.ns);
    let matchers = [
        Matcher::new(Method::PATCH, &format!("/api/v1/nodes/{}", s.node)).body(is_fence),
        Matcher::new(Method::DELETE, &gs),
        Matcher::new(Method::PATCH, &gs).body(|b| b.pointer(&deadline_pointer()).is_some()),
        Matcher::new(
            Method::DELETE,
            &format!("/api/v1/namespaces/{}/pods/*", s.ns),
        ),
    ];
    for (name, m) in TARGETS.into_iter().zip(matchers) {
        p.arm(name, m, fault.clone(), 1);
    }
}

/// The last path segment an injection was aimed at (a node, server or pod name).
fn target_name(i: &Injection) -> String {
    let path = i.uri.split('?').next().unwrap_or_default();
    path.rsplit('/').next().unwrap_or_default().to_string()
}

/// Allocations the allocator won (its Ready → Allocated updates): name, uid, rv.
fn allocations(log: &[Entry]) -> Vec<(String, String, u64)> {
    log.iter()
        .filter(|e| {
            e.user == ALLOCATOR_USER
                && e.verb == "update"
                && e.resource == "gameservers"
                && e.ok()
                && e.response.pointer("/status/state") == Some(&json!("Allocated"))
        })
        .map(|e| {
            let uid = e
                .response
                .pointer("/metadata/uid")
                .and_then(Value::as_str)
                .unwrap_or_default();
            (e.name.clone(), uid.to_string(), rv(e))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_5xx_on_each_write_of_a_drain() {
    drain_under("box-f-5xx", Fault::Status(503)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_with_retry_after_on_each_write_of_a_drain() {
    drain_under("box-f-429", Fault::TooManyRequests { retry_after: 1 }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_that_never_answers_at_each_step_of_a_drain() {
    drain_under("box-f-hang", Fault::Hang).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_applied_whose_connection_drops_at_each_step_of_a_drain() {
    drain_under("box-f-drop", Fault::ApplyThenDrop { hold: HOLD }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_applied_but_answered_500_at_each_step_of_a_drain() {
    drain_under(
        "box-f-lost500",
        Fault::ApplyThenStatus {
            status: 500,
            hold: HOLD,
        },
    )
    .await;
}

/// What the drain left for the checks.
struct Drained {
    s: Scene,
    fiq: FleetIq,
    idle: Vec<Server>,
    busy: Vec<Server>,
    /// A server created in place of a released one whose DELETE's answer was lost.
    replacement: Option<Server>,
    deadline: jiff::Timestamp,
    pods: BTreeMap<String, String>,
}

async fn drain_under(name: &str, fault: Fault) {
    let began = std::time::Instant::now();
    let s = scene(name).await;
    let (idle, busy) = servers(&s).await;
    let pods_api: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(s.client.clone(), &s.ns);
    let mut pods = BTreeMap::new();
    for b in &busy {
        let p = pods_api.get(&b.name).await.expect("pod");
        pods.insert(b.name.clone(), p.metadata.uid.expect("uid"));
    }
    let fiq = FleetIq::start(&s.node).await.expect("FleetIQ and pubsub");
    let proxy = s.kbox.fault_proxy().await.expect("the fault proxy");
    arm_all(&proxy, &s, &fault);
    let mut extra = fiq.agent_extra();
    extra.args.push("--aws-imds".into());
    extra.args.push(REQUEST_TIMEOUT.into());
    let mut agent = AgentProcess::start_at(&s.kbox, &proxy.url(), &s.node, extra)
        .await
        .expect("the agent process");
    agent.ready().await.expect("agent ready");
    wait_for("registered with FleetIQ", || async {
        (fiq.gl.count("RegisterGameServer") == 1).then_some(())
    })
    .await;
    wait_for("the agent sees every server on its node", || async {
        let m = agent.metrics().await;
        (lastcall_testkit::agent::metric_sum(&m, "lastcall_game_servers", &[]) as usize == 5)
            .then_some(())
    })
    .await;

    // An allocator with the exclusion selector, trying for one idle server (`gs-2`) every
    // 400 ms from a fresh list, from the signal on: it may win it before the agent's first
    // write to it, never after.
    let stop = tokio_util::sync::CancellationToken::new();
    let allocator = {
        let (a, stop) = (s.agones.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                tokio::time::sleep(Duration::from_millis(400)).await;
                if let Ok(list) = a.candidates().await
                    && let Some(pick) = list
                        .into_iter()
                        .find(|g| g.metadata.name.as_deref() == Some("gs-2"))
                {
                    let _ = a.allocate_read(pick).await;
                }
            }
        })
    };
    let deadline = jiff::Timestamp::now() + jiff::SignedDuration::from_secs(LEAD);
    let stamp = deadline.strftime("%Y-%m-%dT%H:%M:%SZ").to_string();
    fiq.imds
        .set_spot_action(Some(json!({"action": "terminate", "time": stamp})));
    let deadline: jiff::Timestamp = stamp.parse().expect("a timestamp");

    // A lost DELETE: once the old server is gone (Agones' finalizer holds it until its pod
    // is), a new server of the same name takes its place, a match in it; a DELETE the agent
    // sends again must not touch it. Its pod is created bound to the node (the node is
    // cordoned by then: as a scheduler's decision from before the cordon).
    let mut replacement = None;
    if fault.applies() {
        let i = proxy
            .wait_injected("release", Duration::from_secs(30))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let gs_name = target_name(&i);
        s.deleted(&gs_name).await;
        let made = s
            .agones
            .ready(
                agones::on_node(GameServerSpec::new(gs_name.as_str()), &s.node)
                    .bound_to(s.node.as_str())
                    .eviction_safe(EvictionSafe::Never),
            )
            .await
            .unwrap_or_else(|e| panic!("the replacement of {gs_name}: {e}"));
        s.allocate(&made).await;
        replacement = Some(made);
    }

    // The drain: fenced, the idle servers gone, the matches' pods ended.
    let done = try_eventually(
        "fenced, idle servers released, the matches' pods ended",
        Duration::from_secs(LEAD as u64 + 40),
        Duration::from_millis(100),
        || async {
            let n = serde_json::to_value(s.node_obj().await).ok()?;
            if !(cordoned(&n) && taints(&n) > 0) {
                return None;
            }
            for srv in &idle {
                if let Some(gs) = s.agones.get(&srv.name).await.ok()?
                    && gs.metadata.uid.as_deref() == Some(srv.uid.as_str())
                    && gs.data.pointer("/status/state") != Some(&json!("Allocated"))
                {
                    return None;
                }
            }
            for b in &busy {
                if !s.agones.pod_gone(&b.name).await.ok()? {
                    return None;
                }
            }
            Some(())
        },
    )
    .await;
    if let Err(e) = done {
        match agent.exited() {
            Some(status) => panic!("{e}: the agent exited ({status})"),
            None => panic!("{e}"),
        }
    }
    stop.cancel();
    allocator.await.expect("allocator");
    // The replacement's match still stands, Allocated; every ended match's server is
    // still there (Unhealthy once its pod is gone), never deleted.
    if let Some(r) = &replacement {
        agones::expect_state(&s.agones, r, "Allocated")
            .await
            .unwrap_or_else(|e| panic!("the replacement of a lost DELETE: {e}"));
    }
    for b in &busy {
        agones::expect_kept(&s.agones, b)
            .await
            .unwrap_or_else(|e| panic!("a match: {e}"));
    }
    // The ended matches' servers are Unhealthy (their pods are gone); the rest shut down, the
    // node empties and is handed over.
    shut_down_the_rest(&s).await;
    eventually(
        "deregistered once the node is empty",
        Duration::from_secs(40),
        Duration::from_millis(100),
        || async { (fiq.gl.count("DeregisterGameServer") == 1).then_some(()) },
    )
    .await;
    wait_for("deregistration recorded on the Node", || async {
        s.node_obj()
            .await
            .metadata
            .annotations?
            .contains_key(DEREGISTERED)
            .then_some(())
    })
    .await;
    // Two more passes of the agent's: anything it would write again after its deregistration
    // is in the audit log by then.
    s.passes(&agent, 2).await;

    // Every fault happened, on the write it was meant for.
    let injected = proxy.injected();
    for t in TARGETS {
        let i = injected
            .iter()
            .find(|i| i.rule == t)
            .unwrap_or_else(|| panic!("no {fault:?} injected on the {t}: {injected:?}"));
        if fault.applies() {
            assert!(
                i.applied.is_some_and(|c| (200..300).contains(&c)),
                "the {t} was not applied before its answer was lost: {i:?}"
            );
        }
    }
    let d = Drained {
        s,
        fiq,
        idle,
        busy,
        replacement,
        deadline,
        pods,
    };
    check_promises(&d, &injected, &proxy.forwarded_requests(), &fault).await;
    // The agent met each fault as a failure of that step (a lost answer too: no success
    // was reported to it), and said so.
    let output = agent.output();
    for (t, said) in TARGETS.into_iter().zip([
        &["\"action\":\"patch_node\""][..],
        &["release failed"],
        &["\"action\":\"protect\""],
        &["\"action\":\"end_gracefully\""],
    ]) {
        assert!(
            output
                .lines()
                .any(|l| l.contains("\"WARN\"") && said.iter().any(|s| l.contains(s))),
            "the agent never logged the {t} failing under {fault:?}"
        );
    }
    agent.stop().await.expect("agent stops");
    eprintln!(
        "box faults {fault:?}: {} injections, {} requests forwarded, {:.1} s",
        injected.len(),
        proxy.forwarded(),
        began.elapsed().as_secs_f64()
    );
}

async fn check_promises(
    d: &Drained,
    injected: &[Injection],
    forwarded: &[Forwarded],
    fault: &Fault,
) {
    let s = &d.s;
    let log = s.journal();
    let agent_writes = |resource: &str| -> Vec<&Entry> {
        log.iter()
            .filter(|e| e.by_agent() && e.is_write() && e.resource == resource)
            .collect()
    };
    // The fence: exactly one accepted write of the agent cordons the node; the taint is
    // there once in every answer; the node stays fenced.
    let nodes = agent_writes("nodes");
    let fences: Vec<&Entry> = nodes
        .iter()
        .copied()
        .filter(|e| e.ok() && is_fence(&e.request))
        .collect();
    assert_eq!(
        fences.len(),
        1,
        "the fence in effect:\n{}",
        dump(nodes.clone())
    );
    let fence = fences[0];
    assert!(
        cordoned(&fence.response) && taints(&fence.response) == 1,
        "the fence must cordon and taint once: {}",
        describe(fence)
    );
    for e in nodes.iter().filter(|e| e.ok() && rv(e) > rv(fence)) {
        assert!(
            cordoned(&e.response) && taints(&e.response) == 1,
            "after the fence, a node write of the agent left it {:?}: {}",
            e.response.pointer("/spec"),
            describe(e)
        );
    }
    let n = serde_json::to_value(s.node_obj().await).unwrap_or(Value::Null);
    assert!(
        cordoned(&n) && taints(&n) == 1,
        "the node must end fenced, its taint once: {}",
        n.pointer("/spec").unwrap_or(&Value::Null)
    );

    // Releases: each idle server deleted once (by the uid it had), after the fence, never a
    // match; nothing released before the fence was accepted.
    let deletes: Vec<&Entry> = agent_writes("gameservers")
        .into_iter()
        .filter(|e| e.verb == "delete")
        .collect();
    let mut accepted: BTreeMap<String, usize> = BTreeMap::new();
    let replacement_uid = d.replacement.as_ref().map(|r| r.uid.clone());
    for e in &deletes {
        let uid = e.sent("/preconditions/uid").and_then(Value::as_str);
        assert!(
            uid.is_some(),
            "a release without a uid precondition: {} {}",
            describe(e),
            e.request
        );
        if e.ok() {
            *accepted.entry(e.name.clone()).or_default() += 1;
            assert!(
                d.idle.iter().any(|i| Some(i.uid.as_str()) == uid),
                "the agent deleted a server that was not idle: {} {}",
                describe(e),
                e.request
            );
            assert!(
                replacement_uid.as_deref() != uid,
                "the agent deleted the replacement"
            );
        }
    }
    // Nothing released before the fence (row 4): every DELETE of a GameServer and every write
    // marking one draining or announcing its deadline was received while the node stood
    // fenced by the agent's own accepted write (the promise written once,
    // `lastcall_testkit::promises::fence`, on the audit log).
    let journal = as_journal(&log);
    promises::fence::assert_no_release_before_fence(&journal, AGENT_USER, &s.node);
    let release_like = journal
        .iter()
        .filter(|e| {
            e.identity.as_deref() == Some(AGENT_USER) && promises::fence::is_release_write(e)
        })
        .count();
    assert!(
        release_like > deletes.len(),
        "the fence's promise judged only DELETEs: no protect or label write of the agent's"
    );
    for srv in &d.idle {
        let allocated = allocations(&log).iter().any(|(_, uid, _)| *uid == srv.uid);
        if allocated {
            assert_eq!(
                accepted.get(&srv.name),
                None,
                "{} allocated, then deleted",
                srv.name
            );
        } else {
            assert_eq!(
                accepted.get(&srv.name),
                Some(&1),
                "{} released once:\n{}",
                srv.name,
                dump(deletes.iter().copied())
            );
        }
    }
    // No allocation of a server after the agent's first accepted write to it past the
    // fence, by resourceVersion, per server (its uid: a replacement of the same name is
    // another server).
    let mut first_write: BTreeMap<String, u64> = BTreeMap::new();
    for e in agent_writes("gameservers").into_iter().filter(|e| e.ok()) {
        let uid = e
            .response
            .pointer("/metadata/uid")
            .or_else(|| e.sent("/preconditions/uid"))
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let Some(at) = d.s.place(e).await else {
            continue;
        };
        if at > rv(fence) {
            let slot = first_write.entry(uid).or_insert(at);
            *slot = (*slot).min(at);
        }
    }
    for (name, uid, at) in allocations(&log) {
        if let Some(first) = first_write.get(&uid) {
            assert!(
                at < *first,
                "{name} allocated (rv {at}) after the agent's first write to it (rv {first})"
            );
        }
    }

    // Protect: every match carries one deadline; a write sent again carries the same one.
    for b in &d.busy {
        let values: BTreeSet<String> = agent_writes("gameservers")
            .into_iter()
            .filter(|e| e.name == b.name && e.verb == "patch")
            .filter_map(|e| e.sent(&deadline_pointer()).map(Value::to_string))
            .collect();
        assert_eq!(
            values.len(),
            1,
            "{}: the protect writes announce one deadline: {values:?}",
            b.name
        );
    }

    // Ends: each match ended by its own pod's graceful termination, a DELETE preconditioned
    // on its uid, no grace override, not before deadline − grace; no Eviction at all, and no
    // DELETE of another pod.
    let earliest = d.deadline - jiff::SignedDuration::from_millis(GRACE_MS);
    let ends: Vec<&Entry> = log
        .iter()
        .filter(|e| {
            e.by_agent()
                && e.resource == "pods"
                && (e.subresource == "eviction" || e.verb == "delete")
        })
        .collect();
    for e in &ends {
        assert_ne!(
            e.subresource,
            "eviction",
            "the agent sent an Eviction: {}",
            describe(e)
        );
        let uid = e.sent("/preconditions/uid");
        assert_eq!(
            uid.and_then(Value::as_str),
            d.pods.get(&e.name).map(String::as_str),
            "an end of a match without its pod's uid: {} {}",
            describe(e),
            e.request
        );
        assert!(
            e.sent("/deleteOptions/gracePeriodSeconds").is_none()
                && e.sent("/gracePeriodSeconds").is_none(),
            "a grace override: {} {}",
            describe(e),
            e.request
        );
        assert!(
            e.received.is_some_and(|t| t >= earliest),
            "{} before deadline − grace ({earliest})",
            describe(e)
        );
    }
    // The agent ends the matches due together: a slow request for one (unanswered, or
    // answered late) never holds another back. By the proxy's order of the agent's requests:
    // the other match's DELETE went through before the faulted one's request had ended
    // (one match at a time, the agent would have waited it out first).
    let faulted = injected.iter().find(|i| i.rule == "end").map(target_name);
    let slow = matches!(
        fault,
        Fault::Hang | Fault::ApplyThenDrop { .. } | Fault::ApplyThenStatus { .. }
    );
    for b in d
        .busy
        .iter()
        .filter(|b| slow && Some(&b.name) != faulted.as_ref())
    {
        let path = format!("/api/v1/namespaces/{}/pods/{}", s.ns, b.name);
        let first = forwarded
            .iter()
            .find(|f| f.method == "DELETE" && f.uri.split('?').next() == Some(path.as_str()))
            .unwrap_or_else(|| panic!("{} never ended through the proxy", b.name));
        assert!(
            !first.after_ended.iter().any(|r| r == "end"),
            "{} was ended only after the faulted end of {faulted:?} ended: held up by it ({first:?})",
            b.name
        );
    }
    for b in &d.busy {
        assert!(
            ends.iter().any(|e| e.name == b.name && e.ok()),
            "{} never ended:\n{}",
            b.name,
            dump(ends.iter().copied())
        );
    }

    // Deregistered once, no lifecycle call after it.
    let calls = d.fiq.gl.calls();
    assert_eq!(d.fiq.gl.count("DeregisterGameServer"), 1);
    let at = calls
        .iter()
        .position(|c| c.op == "DeregisterGameServer")
        .expect("deregistered");
    let after: Vec<&str> = calls[at + 1..]
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
        "lifecycle calls after deregistering: {after:?}"
    );
    let refused: Vec<&Entry> = log
        .iter()
        .filter(|e| e.by_agent() && (e.code == 401 || e.code == 403))
        .collect();
    assert!(refused.is_empty(), "RBAC refused:\n{}", dump(refused));
    eprintln!(
        "the agent's writes:\n{}",
        dump(log.iter().filter(|e| e.by_agent() && e.is_write()))
    );
    eprintln!(
        "injected: {}",
        injected
            .iter()
            .map(|i| format!(
                "{} {:?} {} {} -> applied {:?}",
                i.rule, i.fault, i.method, i.uri, i.applied
            ))
            .collect::<Vec<_>>()
            .join("; ")
    );
}

/// kube-apiserver killed (SIGKILL) mid-drain and started again on the same port with the
/// same flags; etcd keeps the state. The kill comes while a release is outstanding: the
/// agent's DELETEs of the last idle server are held by the proxy (never answered, every try,
/// until the server is back) and the others have landed. The agent's watches resume or re-list, the drain completes, and
/// nothing is written twice: one fence in effect, each release and each match's end once, each
/// match's deadline announced once, one deregistration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_server_killed_and_restarted_mid_drain() {
    const LEAD: i64 = 25;
    let s = scene("box-restart").await;
    let (idle, busy) = servers(&s).await;
    let fiq = FleetIq::start(&s.node).await.expect("FleetIQ and pubsub");
    let proxy = s.kbox.fault_proxy().await.expect("the fault proxy");
    let (held, landed) = idle.split_last().expect("idle servers");
    proxy.arm(
        "held release",
        Matcher::new(
            Method::DELETE,
            &format!(
                "/apis/agones.dev/v1/namespaces/{}/gameservers/{}",
                s.ns, held.name
            ),
        ),
        Fault::Hang,
        // Every try until the restart: the agent gives up on each at its request timeout.
        usize::MAX,
    );
    let mut extra = fiq.agent_extra();
    extra
        .args
        .extend(["--aws-imds".to_string(), REQUEST_TIMEOUT.to_string()]);
    let mut agent = AgentProcess::start_at(&s.kbox, &proxy.url(), &s.node, extra)
        .await
        .expect("the agent process");
    agent.ready().await.expect("agent ready");
    wait_for("registered with FleetIQ", || async {
        (fiq.gl.count("RegisterGameServer") == 1).then_some(())
    })
    .await;
    wait_for("the agent sees every server on its node", || async {
        let m = agent.metrics().await;
        (lastcall_testkit::agent::metric_sum(&m, "lastcall_game_servers", &[]) as usize == 5)
            .then_some(())
    })
    .await;
    let deadline = jiff::Timestamp::now() + jiff::SignedDuration::from_secs(LEAD);
    let stamp = deadline.strftime("%Y-%m-%dT%H:%M:%SZ").to_string();
    fiq.imds
        .set_spot_action(Some(json!({"action": "terminate", "time": stamp})));
    let deadline: jiff::Timestamp = stamp.parse().expect("a timestamp");
    proxy
        .wait_injected("held release", Duration::from_secs(20))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    eventually(
        "the other releases landed",
        Duration::from_secs(30),
        Duration::from_millis(10),
        || async {
            for srv in landed {
                let gs = s.agones.get(&srv.name).await.ok()?;
                gs.is_none_or(|g| g.metadata.deletion_timestamp.is_some())
                    .then_some(())?;
            }
            Some(())
        },
    )
    .await;
    let killed_at = jiff::Timestamp::now();
    let back_in = s
        .kbox
        .restart_apiserver(Duration::from_secs(1))
        .await
        .expect("restarting kube-apiserver");
    let ready_at = jiff::Timestamp::now();
    // The held release goes through from now on: after the restart.
    proxy.disarm("held release");
    eprintln!(
        "box restart: killed with the release of {} outstanding, ready {back_in:?} after the restart",
        held.name
    );
    let released = idle.len();
    let done = try_eventually(
        "the idle servers released and the matches' pods ended after the restart",
        Duration::from_secs(LEAD as u64 + 40),
        Duration::from_millis(100),
        || async {
            for srv in &idle {
                if s.agones.get(&srv.name).await.ok()?.is_some() {
                    return None;
                }
            }
            for b in &busy {
                if !s.agones.pod_gone(&b.name).await.ok()? {
                    return None;
                }
            }
            Some(())
        },
    )
    .await;
    if let Err(e) = done {
        match agent.exited() {
            Some(status) => panic!("{e}: the agent exited ({status})"),
            None => panic!("{e}"),
        }
    }
    for b in &busy {
        agones::expect_kept(&s.agones, b)
            .await
            .unwrap_or_else(|e| panic!("a match: {e}"));
    }
    shut_down_the_rest(&s).await;
    eventually(
        "deregistered once the node is empty",
        Duration::from_secs(40),
        Duration::from_millis(100),
        || async { (fiq.gl.count("DeregisterGameServer") == 1).then_some(()) },
    )
    .await;
    wait_for("deregistration recorded on the Node", || async {
        s.node_obj()
            .await
            .metadata
            .annotations?
            .contains_key(DEREGISTERED)
            .then_some(())
    })
    .await;
    // Two more passes of the agent's: anything it would write again after its deregistration
    // is in the audit log by then.
    s.passes(&agent, 2).await;

    let log = s.journal();
    let all = s.kbox.audit();
    // The restart really came between the drain's writes: releases before the kill, the
    // held one after it (the server was down in between: every request received after the
    // kill reached the restarted one, which serves before its /readyz says so).
    let accepted_deletes: Vec<&Entry> = log
        .iter()
        .filter(|e| e.by_agent() && e.verb == "delete" && e.resource == "gameservers" && e.ok())
        .collect();
    for e in &accepted_deletes {
        let before = landed.iter().any(|l| l.name == e.name);
        assert!(
            e.received
                .is_some_and(|t| if before { t < killed_at } else { t > killed_at }),
            "the restart must fall between the releases ({} {} the kill at {killed_at}):\n{}",
            e.name,
            if before { "before" } else { "after" },
            dump(accepted_deletes.iter().copied())
        );
    }
    // The agent's watches were opened again on the restarted server.
    let rewatched: BTreeSet<&str> = all
        .iter()
        .filter(|e| e.by_agent() && e.verb == "watch" && e.received.is_some_and(|t| t > killed_at))
        .map(|e| e.resource.as_str())
        .collect();
    for r in ["nodes", "gameservers", "pods"] {
        assert!(
            rewatched.contains(r),
            "no watch of {r} after the restart: {rewatched:?}"
        );
    }
    // Nothing written twice.
    let fences: Vec<&Entry> = log
        .iter()
        .filter(|e| e.by_agent() && e.resource == "nodes" && e.ok() && is_fence(&e.request))
        .collect();
    assert_eq!(fences.len(), 1, "one fence:\n{}", dump(fences.clone()));
    let n = serde_json::to_value(s.node_obj().await).unwrap_or(Value::Null);
    assert!(
        cordoned(&n) && taints(&n) == 1,
        "the node ends fenced, its taint once"
    );
    for srv in &idle {
        let mine: Vec<&&Entry> = accepted_deletes
            .iter()
            .filter(|e| e.name == srv.name)
            .collect();
        assert_eq!(
            mine.len(),
            1,
            "{} released once:\n{}",
            srv.name,
            dump(accepted_deletes.iter().copied())
        );
        assert_eq!(
            mine[0].sent("/preconditions/uid").and_then(Value::as_str),
            Some(srv.uid.as_str())
        );
    }
    assert_eq!(accepted_deletes.len(), released);
    for b in &busy {
        let protects: Vec<&Entry> = log
            .iter()
            .filter(|e| {
                e.by_agent()
                    && e.name == b.name
                    && e.resource == "gameservers"
                    && e.ok()
                    && e.sent(&deadline_pointer()).is_some()
            })
            .collect();
        // A write that changed nothing (the same deadline sent again after a re-list) leaves
        // the resourceVersion as it was: not a write in effect.
        let in_effect: BTreeSet<u64> = protects.iter().map(|e| rv(e)).collect();
        let values: BTreeSet<String> = protects
            .iter()
            .filter_map(|e| e.sent(&deadline_pointer()).map(Value::to_string))
            .collect();
        assert!(
            in_effect.len() == 1 && values.len() == 1,
            "{}: the deadline announced once:\n{}",
            b.name,
            dump(protects.clone())
        );
        let ends: Vec<&Entry> = log
            .iter()
            .filter(|e| {
                e.by_agent()
                    && e.resource == "pods"
                    && e.name == b.name
                    && (e.subresource == "eviction" || e.verb == "delete")
                    && e.ok()
            })
            .collect();
        assert_eq!(
            ends.len(),
            1,
            "{} ended once:\n{}",
            b.name,
            dump(ends.clone())
        );
        let earliest = deadline - jiff::SignedDuration::from_millis(GRACE_MS);
        assert!(
            ends[0].received.is_some_and(|t| t >= earliest),
            "{} ended before deadline − grace",
            describe(ends[0])
        );
    }
    assert_eq!(fiq.gl.count("DeregisterGameServer"), 1);
    // A restarted API server refuses requests (403) until its RBAC caches are synced, before
    // its /readyz says ready: the agent meets those as failures and retries. After it, the
    // chart's RBAC must suffice.
    let early = all
        .iter()
        .filter(|e| e.by_agent() && e.code == 403 && e.received < Some(ready_at))
        .count();
    let refused: Vec<&Entry> = all
        .iter()
        .filter(|e| e.by_agent() && (e.code == 401 || e.code == 403))
        .filter(|e| e.received >= Some(ready_at))
        .collect();
    assert!(refused.is_empty(), "RBAC refused:\n{}", dump(refused));
    eprintln!("box restart: {early} requests of the agent refused (403) before /readyz");
    agent.stop().await.expect("agent stops");
}
