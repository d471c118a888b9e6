//! Agent scenarios written once and run on both backends (`lastcall_testkit::scene`): the
//! emulator (its cluster model, the agent in-process) and the box (a real control plane,
//! the Agones stand-in, the real agent process with the chart's arguments and RBAC). Each
//! body is one `async fn` taking a [`Backend`]; each backend gets its own `#[tokio::test]`.
//!
//! Orders come from [`Scene::agent_writes`]: the emulator journal's `seq` or the audit log's
//! resourceVersions, whichever backend it is.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use lastcall_testkit::agent::metric;
use lastcall_testkit::eventually::try_eventually;
use lastcall_testkit::gce::GceMetadataEmulator;
use lastcall_testkit::kube_box::agones::Crd;
use lastcall_testkit::scene::writes::dump;
use lastcall_testkit::scene::{Backend, Scene, Write};
use lastcall_testkit::scene::{cordoned, tainted};
use serde_json::{Value, json};

const DEADLINE: &str = "lastcall.dev/drain-deadline";
/// The marks a drain puts on a server (the claim label `lastcall.dev/node` is not one: the
/// agent writes it at start-up under label selection, before any drain).
const DRAIN_MARKS: [&str; 3] = [
    "lastcall.dev/drain-deadline",
    "lastcall.dev/drain-reason",
    "lastcall.dev/node-draining",
];

fn fenced(n: &Value) -> bool {
    cordoned(n) && tainted(n)
}

async fn node_json(s: &Scene) -> Value {
    serde_json::to_value(s.node().await).unwrap_or(Value::Null)
}

/// Waits up to `secs` for `check`; on a timeout fails naming `what` and the agent's writes.
async fn until<T, F, Fut>(s: &Scene, what: &str, secs: u64, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    match try_eventually(
        what,
        Duration::from_secs(secs),
        Duration::from_millis(100),
        check,
    )
    .await
    {
        Ok(v) => v,
        Err(e) => {
            let w = s.agent_writes().await;
            panic!(
                "{:?}: {e}\nthe agent's writes:\n{}",
                s.backend,
                dump(&w.iter().collect::<Vec<_>>())
            )
        }
    }
}

/// The fence: the agent's first node write that cordons or taints; it must do both.
fn the_fence<'a>(s: &Scene, writes: &'a [Write]) -> &'a Write {
    let node_writes: Vec<&Write> = writes.iter().filter(|w| w.resource == "nodes").collect();
    let first = node_writes
        .iter()
        .find(|w| cordoned(&w.response) || tainted(&w.response))
        .unwrap_or_else(|| {
            panic!(
                "{:?}: no fence write by the agent:\n{}",
                s.backend,
                dump(&node_writes)
            )
        });
    assert!(
        fenced(&first.response),
        "{:?}: the fence must cordon and taint in one write: {}",
        s.backend,
        first.describe()
    );
    first
}

/// The agent's writes to a GameServer that set its node-claim label `lastcall.dev/node`
/// (and not the drain's `lastcall.dev/node-draining`).
fn claims(writes: &[Write]) -> Vec<&Write> {
    writes
        .iter()
        .filter(|w| {
            let sent = w.request.to_string();
            w.resource == "gameservers"
                && w.verb == "patch"
                && sent.contains("lastcall.dev/node")
                && !sent.contains("node-draining")
        })
        .collect()
}

/// Waits until the node is fenced, the idle servers and their pods are gone and every match
/// carries the drain deadline.
async fn drained(s: &Scene) {
    until(
        s,
        "fenced, idle servers and their pods gone, the matches protected",
        40,
        || async {
            if !fenced(&node_json(s).await) {
                return None;
            }
            let pods = s.pods_on_node().await;
            for srv in &s.idle {
                if s.game_server(&srv.name).await.is_some() || pods.contains(&srv.name) {
                    return None;
                }
            }
            for m in &s.matches {
                let gs = s.game_server(&m.name).await?;
                gs.metadata.annotations?.get(DEADLINE)?;
            }
            Some(())
        },
    )
    .await;
}

/// A release's resourceVersion precondition is exactly the version of the server the agent
/// read while it was Ready: the server's last version before the DELETE took effect (by the
/// scene's history: every version, in the API server's order), in state Ready. An empty or
/// other version (a later read, a guess) fails.
async fn assert_read_while_ready(
    s: &Scene,
    d: &Write,
    srv: &lastcall_testkit::kube_box::agones::Server,
) {
    let backend = s.backend;
    // The DELETE's own version (its deletionTimestamp) is in the history: so is every one
    // before it.
    s.history().reached("gameservers", &srv.name, d.at).await;
    let sent = d
        .request
        .pointer("/preconditions/resourceVersion")
        .and_then(Value::as_str)
        .unwrap_or_else(|| {
            panic!(
                "{backend:?}: the release of {} without a resourceVersion precondition: {}",
                srv.name,
                d.describe()
            )
        });
    let read = s
        .history()
        .at("gameservers", &srv.name, &srv.uid, d.at - 1)
        .unwrap_or_else(|| panic!("{backend:?}: no version of {} before its release", srv.name));
    assert_eq!(
        sent,
        read.rv.to_string(),
        "{backend:?}: the release of {} must name the version it read ({}): {}\n{}",
        srv.name,
        read.describe(),
        d.describe(),
        s.history()
            .of("gameservers", &srv.name)
            .iter()
            .map(|v| v.describe())
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(
        read.state(),
        Some("Ready"),
        "{backend:?}: {} was released from a version that was not Ready: {}",
        srv.name,
        read.describe()
    );
}

fn annotated(w: &Write, key: &str) -> bool {
    w.response
        .pointer(&format!("/metadata/annotations/{}", key.replace('/', "~1")))
        .is_some()
}

/// The operator's `lastcall.dev/drain=true`, end to end: the fence (cordon and taint in one
/// write), exactly the idle servers released (uid-preconditioned, after the fence) with
/// their pods gone, the match protected (its deadline written after the fence) and never
/// deleted; then the match ends, the node is empty, the agent says so and the node stays
/// fenced.
async fn a_manual_drain_end_to_end(backend: Backend) {
    let mut s = Scene::start(backend, "sc-drain", 2, 1).await;
    s.start_agent(&[]).await;
    let busy = s.matches[0].clone();
    s.drain_label(true).await;
    drained(&s).await;

    let writes = s.agent_writes().await;
    let fence = the_fence(&s, &writes);
    let deletes: BTreeMap<&str, &Write> = writes
        .iter()
        .filter(|w| w.resource == "gameservers" && w.is_delete())
        .map(|w| (w.name.as_str(), w))
        .collect();
    assert_eq!(
        deletes.keys().copied().collect::<BTreeSet<_>>(),
        s.idle.iter().map(|x| x.name.as_str()).collect(),
        "{backend:?}: exactly the idle servers are released"
    );
    for srv in &s.idle {
        let d = deletes[srv.name.as_str()];
        assert!(
            d.at > fence.at,
            "{backend:?}: {} released before the fence:\n{}\n{}",
            srv.name,
            d.describe(),
            fence.describe()
        );
        assert_eq!(
            d.request
                .pointer("/preconditions/uid")
                .and_then(Value::as_str),
            Some(srv.uid.as_str()),
            "{backend:?}: the release of {} names its uid: {}",
            srv.name,
            d.describe()
        );
        assert_read_while_ready(&s, d, srv).await;
    }
    let protect = writes
        .iter()
        .find(|w| w.resource == "gameservers" && w.name == busy.name && annotated(w, DEADLINE))
        .unwrap_or_else(|| panic!("{backend:?}: {} never protected", busy.name));
    assert!(
        protect.at > fence.at,
        "{backend:?}: {} protected before the fence",
        busy.name
    );

    s.end_match(&busy).await;
    until(&s, "the node empty and the agent saying so", 60, || async {
        let m = s.agent_metrics().await;
        (s.game_server(&busy.name).await.is_none()
            && s.pods_on_node().await.is_empty()
            && metric(&m, "lastcall_drain_phase", &[("phase", "empty")]) == Some(1.0))
        .then_some(())
    })
    .await;
    assert!(
        fenced(&node_json(&s).await),
        "{backend:?}: the emptied node must stay fenced"
    );
    let writes = s.agent_writes().await;
    let fence_at = the_fence(&s, &writes).at;
    for w in writes
        .iter()
        .filter(|w| w.resource == "nodes" && w.at > fence_at)
    {
        assert!(
            fenced(&w.response),
            "{backend:?}: the agent lifted its fence: {}",
            w.describe()
        );
    }
    assert!(
        !writes
            .iter()
            .any(|w| w.resource == "gameservers" && w.is_delete() && w.name == busy.name),
        "{backend:?}: the agent deleted the match's server"
    );
    // Agones 1.58+: the agent selects its servers by `status.nodeName` and writes nothing
    // to a server to see it.
    let claimed = claims(&writes);
    assert!(
        claimed.is_empty(),
        "{backend:?}: claims written although status.nodeName is selectable:\n{}",
        dump(&claimed)
    );
    eprintln!(
        "{backend:?}: the agent's writes in order:\n{}",
        writes
            .iter()
            .map(|w| format!("{} {}/{}", w.verb, w.resource, w.name))
            .collect::<Vec<_>>()
            .join("\n")
    );
    never_refused(&s, backend);
    s.stop().await;
}

type NodeShape = (
    BTreeMap<String, String>,
    BTreeMap<String, String>,
    Value,
    bool,
);
type ServerShape = (BTreeMap<String, String>, BTreeMap<String, String>);

/// What a cancel must restore: the node's labels, annotations, taints and cordon, and the
/// match's labels and annotations.
async fn shape(s: &Scene, server: &str) -> (NodeShape, ServerShape) {
    let n = s.node().await;
    let spec = n.spec.unwrap_or_default();
    let node = (
        n.metadata.labels.unwrap_or_default(),
        n.metadata.annotations.unwrap_or_default(),
        serde_json::to_value(spec.taints.unwrap_or_default()).unwrap_or(Value::Null),
        spec.unschedulable.unwrap_or(false),
    );
    let gs = s.game_server(server).await.expect("the match's server");
    let srv: ServerShape = (
        gs.metadata.labels.unwrap_or_default().into_iter().collect(),
        gs.metadata
            .annotations
            .unwrap_or_default()
            .into_iter()
            .collect(),
    );
    (node, srv)
}

/// A drain by the operator's label, then the label removed: the node (with someone else's
/// taint, label and annotation on it) and the match are exactly as before the drain, no
/// cordon, no lastcall taint, no drain mark left, and it was the agent's own write that
/// lifted its fence.
async fn a_cancel_restores_exactly_what_was_there(backend: Backend) {
    let mut s = Scene::start(backend, "sc-cancel", 0, 1).await;
    let busy = s.matches[0].clone();
    s.patch_server(
        &busy.name,
        json!({"metadata": {"annotations": {"example.com/match": "42"}}}),
    )
    .await;
    let mut taints: Vec<Value> = s
        .node()
        .await
        .spec
        .and_then(|x| x.taints)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|t| serde_json::to_value(t).ok())
        .collect();
    taints.push(json!({"key": "example.com/foreign", "value": "x", "effect": "NoSchedule"}));
    s.patch_node(json!({
        "metadata": {"labels": {"example.com/pool": "a"},
                     "annotations": {"example.com/keep": "yes"}},
        "spec": {"taints": taints},
    }))
    .await;
    s.start_agent(&[]).await;
    // The agent's start-up write (its ownership of the node) is part of what was there.
    until(&s, "the agent owns the node", 30, || async {
        s.node()
            .await
            .metadata
            .annotations?
            .contains_key("lastcall.dev/owner")
            .then_some(())
    })
    .await;
    let before = shape(&s, &busy.name).await;

    s.drain_label(true).await;
    until(&s, "fenced and the match protected", 40, || async {
        let gs = s.game_server(&busy.name).await?;
        (fenced(&node_json(&s).await) && gs.metadata.annotations?.contains_key(DEADLINE))
            .then_some(())
    })
    .await;
    s.drain_label(false).await;
    let restored = try_eventually(
        "everything as it was before the drain",
        Duration::from_secs(40),
        Duration::from_millis(100),
        || async { (shape(&s, &busy.name).await == before).then_some(()) },
    )
    .await;
    if let Err(e) = restored {
        let now = shape(&s, &busy.name).await;
        panic!("{backend:?}: {e}\nbefore the drain: {before:#?}\nafter the cancel: {now:#?}");
    }
    let n = node_json(&s).await;
    assert!(
        !cordoned(&n) && !tainted(&n),
        "{backend:?}: still fenced: {n}"
    );
    let gs = s.game_server(&busy.name).await.expect("the match's server");
    let left: Vec<String> = gs
        .metadata
        .labels
        .unwrap_or_default()
        .into_keys()
        .chain(gs.metadata.annotations.unwrap_or_default().into_keys())
        .filter(|k| DRAIN_MARKS.contains(&k.as_str()))
        .collect();
    assert!(left.is_empty(), "{backend:?}: drain marks left: {left:?}");
    assert_eq!(
        gs.data.pointer("/status/state"),
        Some(&json!("Allocated")),
        "{backend:?}: the match goes on"
    );
    let writes = s.agent_writes().await;
    let fence = the_fence(&s, &writes);
    assert!(
        writes.iter().any(|w| w.resource == "nodes"
            && w.at > fence.at
            && !cordoned(&w.response)
            && !tainted(&w.response)),
        "{backend:?}: the agent's own write lifted the fence:\n{}",
        dump(&writes.iter().collect::<Vec<_>>())
    );
    never_refused(&s, backend);
    s.stop().await;
}

/// Under an Agones before 1.58 (no selectable `status.nodeName`) the agent, on its own
/// (`--gameserver-selector=auto`, the chart's), claims each server on its node with the
/// label `lastcall.dev/node` exactly once, before the drain, and drains as by the field:
/// the idle servers released after the fence with their uid, the match protected.
async fn under_an_older_agones_each_server_is_claimed_once(backend: Backend) {
    let mut s = Scene::start_with(backend, "sc-label", 2, 1, Crd::LabelsOnly).await;
    s.start_agent(&[]).await;
    s.drain_label(true).await;
    drained(&s).await;
    let writes = s.agent_writes().await;
    let fence = the_fence(&s, &writes);
    let claimed = claims(&writes);
    for srv in s.idle.iter().chain(&s.matches) {
        let mine: Vec<&Write> = claimed
            .iter()
            .copied()
            .filter(|w| w.name == srv.name)
            .collect();
        assert_eq!(
            mine.len(),
            1,
            "{backend:?}: {} must be claimed once:\n{}",
            srv.name,
            dump(&claimed)
        );
        assert!(
            mine[0].at < fence.at,
            "{backend:?}: {} claimed only after the drain began:\n{}\n{}",
            srv.name,
            mine[0].describe(),
            fence.describe()
        );
    }
    for srv in &s.idle {
        let d = writes
            .iter()
            .find(|w| w.resource == "gameservers" && w.is_delete() && w.name == srv.name)
            .unwrap_or_else(|| panic!("{backend:?}: {} never released", srv.name));
        assert!(
            d.at > fence.at
                && d.request
                    .pointer("/preconditions/uid")
                    .and_then(Value::as_str)
                    == Some(srv.uid.as_str()),
            "{backend:?}: the release of {} must follow the fence and name its uid: {}",
            srv.name,
            d.describe()
        );
    }
    never_refused(&s, backend);
    s.stop().await;
}

/// GKE's maintenance label the agent writes to hand a node back early.
const HAND_BACK_LABEL: &str = "cloud.google.com/perform-maintenance";

/// GCE's `upcoming-maintenance`: a window half an hour out that may start early
/// (`can_reschedule`), which is what lets lastcall hand an empty node back.
fn maintenance_that_may_start_early() -> String {
    let start = jiff::Timestamp::now()
        .checked_add(jiff::SignedDuration::from_mins(30))
        .unwrap_or(jiff::Timestamp::MAX)
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string();
    json!({"can_reschedule": "true", "maintenance_status": "PENDING", "type": "SCHEDULED",
           "window_start_time": start})
    .to_string()
}

/// The agent's arguments for GCE's metadata server at `url` with the hand-back to GKE on.
fn hand_back_args(url: &str, settle_s: u64) -> Vec<String> {
    vec![
        "--gce-metadata".into(),
        format!("--gce-metadata-endpoint={url}"),
        "--gce-wait-timeout=2s".into(),
        "--gce-upcoming-interval=200ms".into(),
        "--gke-hand-back".into(),
        format!("--deregister-settle={settle_s}s"),
    ]
}

/// The agent's write that hands the node back to GKE, if any.
fn hand_back(writes: &[Write]) -> Option<&Write> {
    writes.iter().find(|w| {
        w.resource == "nodes"
            && w.response
                .pointer(&format!(
                    "/metadata/labels/{}",
                    HAND_BACK_LABEL.replace('/', "~1")
                ))
                .is_some()
    })
}

/// The settle passed before the late pod landed (a machine too slow for the round).
struct Early;

/// Row 7's fresh read: the agent's watches of pods and GameServers lag past the settle, while
/// a pod a scheduler bound from its cache of a moment before the fence has landed on the node
/// and holds a match; the hand-back to GKE falls due then, and only the gate's fresh read of
/// the node's pods can see the match. Up to three rounds, each with a settle twice as long,
/// when a machine too slow lets the settle pass before the late pod lands (the round then
/// proves nothing and says so).
async fn a_lagging_watch_never_hands_over_a_busy_node(backend: Backend) {
    let mut settle = 10;
    for round in 0..3 {
        match lag_round(backend, round, settle).await {
            Ok(()) => return,
            Err(Early) => {
                eprintln!(
                    "{backend:?}: round {round}: the settle ({settle} s) passed before the late pod landed"
                );
                settle *= 2;
            }
        }
    }
    panic!("{backend:?}: the settle passed before the late pod landed in every round");
}

async fn lag_round(backend: Backend, round: usize, settle: u64) -> Result<(), Early> {
    let mut s = Scene::start(backend, &format!("sc-lag{round}"), 1, 0).await;
    let gce = GceMetadataEmulator::start().await.expect("GCE metadata");
    let args = hand_back_args(&gce.url(), settle);
    s.start_agent(&args.iter().map(String::as_str).collect::<Vec<_>>())
        .await;
    // The maintenance drains the node, and the hand-back is due once it is empty and the
    // fence has stood its settle.
    gce.set("upcoming-maintenance", &maintenance_that_may_start_early());
    let idle = s.idle[0].clone();
    until(
        &s,
        "fenced, the idle server gone, the agent saying empty",
        40,
        || async {
            let m = s.agent_metrics().await;
            (fenced(&node_json(&s).await)
                && s.game_server(&idle.name).await.is_none()
                && s.pods_on_node().await.is_empty()
                && metric(&m, "lastcall_drain_phase", &[("phase", "empty")]) == Some(1.0))
            .then_some(())
        },
    )
    .await;
    // From now on the agent's pod and GameServer watches deliver nothing.
    s.hold_agent_watches();
    let late = s.late_server("gs-late").await;
    let mark = s.mark();
    s.history().reached("pods", &late.name, 0).await;
    let late_pod = s.history().of("pods", &late.name);
    let landed = late_pod
        .first()
        .unwrap_or_else(|| panic!("{backend:?}: no version of the late pod"))
        .rv;
    if let Some(w) = hand_back(&s.agent_writes().await)
        && w.at < landed
    {
        s.stop().await;
        return Err(Early);
    }
    // The agent's own view lacks the late match: its watches lag.
    let seen =
        lastcall_testkit::agent::metric_sum(&s.agent_metrics().await, "lastcall_game_servers", &[]);
    assert_eq!(
        seen, 0.0,
        "{backend:?}: the agent saw the late server: the hold did not hold"
    );
    // The agent's decision: its fresh read of the node's pods (or a hand-back), then two
    // passes more.
    until(
        &s,
        "the agent's fresh read of the node's pods, or a hand-back",
        settle + 40,
        || async {
            let read = !s.agent_lists_since(mark, "pods").is_empty();
            (read || hand_back(&s.agent_writes().await).is_some()).then_some(())
        },
    )
    .await;
    s.passes(2).await;
    let writes = s.agent_writes().await;
    if let Some(w) = hand_back(&writes) {
        let history: Vec<String> = s
            .history()
            .of("pods", &late.name)
            .iter()
            .map(|v| v.describe())
            .collect();
        panic!(
            "{backend:?}: the node was handed back while the late match ran: {}\nthe late pod: {}",
            w.describe(),
            history.join("; ")
        );
    }
    assert!(
        s.held_watch_lines() > 0,
        "{backend:?}: no watch line was held: the agent's caches did not lag"
    );
    eprintln!(
        "{backend:?}: the agent's fresh reads while its watches lagged: {:?}",
        s.agent_lists_since(mark, "pods")
    );
    assert!(
        s.pods_on_node().await.contains(&late.name),
        "{backend:?}: the late match's pod must still run"
    );
    // The watches catch up, the match ends, and the node is handed back after its pod and
    // server are gone.
    s.release_agent_watches();
    until(&s, "the agent sees the late server", 30, || async {
        let m = s.agent_metrics().await;
        (lastcall_testkit::agent::metric_sum(&m, "lastcall_game_servers", &[]) == 1.0).then_some(())
    })
    .await;
    s.end_match(&late).await;
    let w = until(&s, "the hand-back after the late match", 60, || async {
        hand_back(&s.agent_writes().await).cloned()
    })
    .await;
    // After the late match ended, by the API server's order: its game said Shutdown() (or
    // its server is being deleted) and its pod stopped running (finished or gone).
    // (Waited for: the scene's history may be a moment behind the API server.)
    let (ended, stopped) = until(&s, "the late match's end in the history", 30, || async {
        let history = s.history();
        let ended = history
            .of("gameservers", &late.name)
            .into_iter()
            .find(|v| {
                v.uid == late.uid
                    && (v.state() == Some("Shutdown") || v.terminating() || v.event == "DELETED")
            })?;
        let stopped = history.of("pods", &late.name).into_iter().find(|v| {
            v.uid == late_pod[0].uid
                && (matches!(v.state(), Some("Succeeded" | "Failed")) || v.event == "DELETED")
        })?;
        Some((Some(ended.rv), Some(stopped.rv)))
    })
    .await;
    assert!(
        ended.is_some_and(|g| w.at > g) && stopped.is_some_and(|p| w.at > p),
        "{backend:?}: handed back at {} before the late match ended (server {ended:?}, pod {stopped:?})",
        w.at
    );
    never_refused(&s, backend);
    s.stop().await;
    Ok(())
}

/// Row 7's settle: an empty node whose maintenance may start early is handed back only once
/// the fence has stood `--deregister-settle`, by the API server's own clock (a scheduler
/// deciding on a cache from before the cordon may still bind a pod until then).
async fn the_hand_back_waits_for_the_settle(backend: Backend) {
    const SETTLE_S: u64 = 3;
    let mut s = Scene::start(backend, "sc-settle", 0, 0).await;
    let gce = GceMetadataEmulator::start().await.expect("GCE metadata");
    let args = hand_back_args(&gce.url(), SETTLE_S);
    s.start_agent(&args.iter().map(String::as_str).collect::<Vec<_>>())
        .await;
    gce.set("upcoming-maintenance", &maintenance_that_may_start_early());
    let handed = until(&s, "the hand-back", 40, || async {
        hand_back(&s.agent_writes().await).cloned()
    })
    .await;
    let writes = s.agent_writes().await;
    let fence = the_fence(&s, &writes);
    let (Some(fenced_at), Some(handed_at)) = (fence.when, handed.when) else {
        panic!("{backend:?}: a write without its time");
    };
    let stood = handed_at.duration_since(fenced_at);
    assert!(
        stood >= jiff::SignedDuration::from_secs(SETTLE_S as i64),
        "{backend:?}: handed back {stood:?} after the fence, before the {SETTLE_S} s settle:\n{}\n{}",
        fence.describe(),
        handed.describe()
    );
    assert!(
        fenced(&node_json(&s).await),
        "{backend:?}: a node handed back stays fenced"
    );
    never_refused(&s, backend);
    s.stop().await;
}

/// The gate's fresh read after the node was reported empty: a drain by the operator's label
/// empties the node (the agent reports it empty: nobody waits for it), its watches then lag
/// while a late pod lands with a match, and only then does a maintenance that may start
/// early make the hand-back to GKE due. The hand-back must wait for the match like any other.
async fn a_hand_back_after_the_node_was_reported_empty_reads_afresh(backend: Backend) {
    let mut s = Scene::start(backend, "sc-told", 1, 0).await;
    let gce = GceMetadataEmulator::start().await.expect("GCE metadata");
    let args = hand_back_args(&gce.url(), 1);
    s.start_agent(&args.iter().map(String::as_str).collect::<Vec<_>>())
        .await;
    s.drain_label(true).await;
    until(&s, "the agent reports the node empty", 40, || async {
        let m = s.agent_metrics().await;
        (s.pods_on_node().await.is_empty()
            && metric(&m, "lastcall_drain_phase", &[("phase", "empty")]) == Some(1.0))
        .then_some(())
    })
    .await;
    s.passes(1).await;
    s.hold_agent_watches();
    let late = s.late_server("gs-late").await;
    let mark = s.mark();
    gce.set("upcoming-maintenance", &maintenance_that_may_start_early());
    until(&s, "the agent hears the maintenance", 30, || async {
        let m = s.agent_metrics().await;
        (lastcall_testkit::agent::metric_sum(
            &m,
            "lastcall_source_notices",
            &[("source", "gce_metadata")],
        ) > 0.0)
            .then_some(())
    })
    .await;
    s.passes(2).await;
    let writes = s.agent_writes().await;
    eprintln!(
        "{backend:?}: the agent's fresh reads after the maintenance: {:?}\nits writes:\n{}",
        s.agent_lists_since(mark, "pods"),
        dump(&writes.iter().collect::<Vec<_>>())
    );
    if let Some(w) = hand_back(&writes) {
        panic!(
            "{backend:?}: handed back to GKE while the late match on {} runs, without a fresh read: {}",
            late.name,
            w.describe()
        );
    }
    assert!(
        !s.agent_lists_since(mark, "pods").is_empty(),
        "{backend:?}: no fresh read of the node's pods after the maintenance"
    );
    assert!(
        s.held_watch_lines() > 0,
        "{backend:?}: no watch line was held: the agent's caches did not lag"
    );
    s.release_agent_watches();
    never_refused(&s, backend);
    s.stop().await;
}

macro_rules! on_both {
    ($($body:ident => $emulator:ident, $on_box:ident;)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $emulator() {
                $body(Backend::Emulator).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $on_box() {
                $body(Backend::Box).await;
            }
        )*
    };
}

on_both! {
    a_lagging_watch_never_hands_over_a_busy_node => lagging_watch_on_the_emulator, lagging_watch_on_the_box;
    the_hand_back_waits_for_the_settle => settle_on_the_emulator, settle_on_the_box;
    a_hand_back_after_the_node_was_reported_empty_reads_afresh => told_empty_on_the_emulator, told_empty_on_the_box;
    a_manual_drain_end_to_end => manual_drain_on_the_emulator, manual_drain_on_the_box;
    a_cancel_restores_exactly_what_was_there => cancel_on_the_emulator, cancel_on_the_box;
    under_an_older_agones_each_server_is_claimed_once => label_claims_on_the_emulator, label_claims_on_the_box;
}

/// The agent was never refused (401/403): a permission the chart lacks fails here.
fn never_refused(s: &Scene, backend: Backend) {
    let refused = s.agent_refusals();
    assert!(
        refused.is_empty(),
        "{backend:?}: the agent was refused:\n{}",
        refused.join("\n")
    );
}
