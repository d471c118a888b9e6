//! The agent DaemonSet's rollout on the box (the real DaemonSet controller and scheduler, kwok
//! nodes with capacity): a node packed so that a second agent cannot be scheduled there keeps
//! its running agent through a chart upgrade, and the rollout still reaches every other node.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::Api;
use kube::api::{ListParams, PostParams};
use lastcall_testkit::eventually::try_eventually;
use lastcall_testkit::kube_box::install::Shell;
use lastcall_testkit::kube_box::{self, create_node};
use serde_json::json;

const NS: &str = "lastcall";
const NODES: [&str; 5] = ["roll-a", "roll-b", "roll-c", "roll-d", "roll-e"];
const PACKED: &str = "roll-c";
const SELECTOR: &str = "app.kubernetes.io/component=agent";

/// Millicores of a CPU quantity (`500m`, `2`, `1k`: kwok's default allocatable).
fn millis(q: &Quantity) -> i64 {
    let s = q.0.as_str();
    let (n, scale) = match s.strip_suffix('m') {
        Some(m) => (m, 1.0),
        None => match s.strip_suffix('k') {
            Some(k) => (k, 1_000_000.0),
            None => (s, 1000.0),
        },
    };
    n.parse::<f64>()
        .map(|c| (c * scale) as i64)
        .unwrap_or_else(|_| panic!("a CPU quantity: {s}"))
}

/// The agent pods on `node`, by what the DaemonSet controller pinned them to (an unscheduled
/// DaemonSet pod names its node only in its affinity).
fn on_node<'a>(pods: &'a [Pod], node: &str) -> Vec<&'a Pod> {
    pods.iter()
        .filter(|p| {
            let v = serde_json::to_value(p).unwrap_or_default();
            v.pointer("/spec/nodeName").and_then(|n| n.as_str()) == Some(node)
                || v.pointer("/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution/nodeSelectorTerms/0/matchFields/0/values/0")
                    .and_then(|n| n.as_str())
                    == Some(node)
        })
        .collect()
}

fn hash(p: &Pod) -> String {
    p.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get("controller-revision-hash"))
        .cloned()
        .unwrap_or_default()
}

fn describe(p: &Pod) -> String {
    let v = serde_json::to_value(p).unwrap_or_default();
    format!(
        "{} node={:?} hash={} phase={:?} deleting={} conditions={}",
        p.metadata.name.as_deref().unwrap_or(""),
        v.pointer("/spec/nodeName"),
        hash(p),
        v.pointer("/status/phase"),
        p.metadata.deletion_timestamp.is_some(),
        v.pointer("/status/conditions").cloned().unwrap_or_default()
    )
}

fn running(p: &Pod) -> bool {
    p.metadata.deletion_timestamp.is_none()
        && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_packed_node_keeps_its_agent_and_the_rollout_reaches_the_others() {
    let kbox = kube_box::lease().await;
    let client = kbox.client().await.expect("admin client");
    for n in NODES {
        create_node(&client, n).await.expect("a game node");
    }
    let shell = Shell::new(&kbox, &[]).expect("a shell");
    let install = |extra: &str| {
        format!(
            "helm upgrade --install lastcall charts/lastcall -n {NS} --create-namespace \
             --set image.registry=registry.example.com/lastcall \
             --set-string agent.nodeSelector.type=kwok {extra}"
        )
    };
    // Extra chart values from the environment, so the break can be tried without an edit.
    let extra = std::env::var("LASTCALL_ROLLOUT_EXTRA").unwrap_or_default();
    shell.sh(&install(&extra)).await.expect("helm install");
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let lp = ListParams::default().labels(SELECTOR);
    let first = try_eventually(
        "an agent running on every node",
        Duration::from_secs(120),
        Duration::from_millis(200),
        || async {
            let all = pods.list(&lp).await.ok()?.items;
            NODES
                .iter()
                .all(|n| on_node(&all, n).iter().any(|p| running(p)))
                .then_some(all)
        },
    )
    .await
    .expect("the first rollout");
    let old_hash = hash(on_node(&first, PACKED)[0]);
    // A steady fleet: every agent available by the DaemonSet controller's count
    // (minReadySeconds), so the upgrade's surge is what replaces them.
    let ds: Api<k8s_openapi::api::apps::v1::DaemonSet> = Api::namespaced(client.clone(), NS);
    try_eventually(
        "every agent available",
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async {
            let st = ds.get("lastcall-agent").await.ok()?.status?;
            (st.number_available == Some(NODES.len() as i32)).then_some(())
        },
    )
    .await
    .expect("the first rollout available");

    // Pack the node: a pod (a game server's stand-in, below the agent's priority) takes every
    // millicore the pods already there leave.
    let node = Api::<Node>::all(client.clone()).get(PACKED).await.unwrap();
    let alloc = millis(&node.status.unwrap().allocatable.unwrap()["cpu"]);
    let used: i64 = Api::<Pod>::all(client.clone())
        .list(&ListParams::default().fields(&format!("spec.nodeName={PACKED}")))
        .await
        .unwrap()
        .items
        .iter()
        .flat_map(|p| p.spec.as_ref().unwrap().containers.iter())
        .filter_map(|c| {
            c.resources
                .as_ref()?
                .requests
                .as_ref()?
                .get("cpu")
                .map(millis)
        })
        .sum();
    let filler: Pod = serde_json::from_value(json!({
        "metadata": {"name": "game-filler", "namespace": "default"},
        "spec": {
            "nodeName": PACKED,
            "tolerations": [{"operator": "Exists"}],
            "containers": [{"name": "game", "image": "game",
                            "resources": {"requests": {"cpu": format!("{}m", alloc - used)}}}],
        },
    }))
    .unwrap();
    Api::<Pod>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &filler)
        .await
        .expect("the filler pod");

    // A chart upgrade that changes the agent's pod template.
    shell
        .sh(&install(&format!(
            "{extra} --set-string agent.podAnnotations.rollout=two"
        )))
        .await
        .expect("helm upgrade");

    // The new agent on the packed node exists and cannot be scheduled ...
    let all = try_eventually(
        "the packed node's new agent refused by the scheduler",
        Duration::from_secs(120),
        Duration::from_millis(200),
        || async {
            let all = pods.list(&lp).await.ok()?.items;
            on_node(&all, PACKED)
                .iter()
                .any(|p| {
                    hash(p) != old_hash
                        && p.status
                            .as_ref()
                            .and_then(|s| s.conditions.as_ref())
                            .is_some_and(|c| {
                                c.iter().any(|c| {
                                    c.type_ == "PodScheduled"
                                        && c.status == "False"
                                        && c.reason.as_deref() == Some("Unschedulable")
                                })
                            })
                })
                .then_some(all)
        },
    )
    .await
    .expect("the new agent Pending on the packed node");
    // ... while its old agent still runs there: the node is never unwatched.
    let packed = on_node(&all, PACKED);
    assert!(
        packed.iter().any(|p| hash(p) == old_hash && running(p)),
        "the packed node has no running agent while its new one waits: {:?}",
        packed
            .iter()
            .map(|p| (
                &p.metadata.name,
                hash(p),
                p.status.as_ref().and_then(|s| s.phase.clone())
            ))
            .collect::<Vec<_>>()
    );

    // The rollout reaches every other node: each runs only the new agent.
    try_eventually(
        "the new agent alone on every other node",
        Duration::from_secs(90),
        Duration::from_millis(200),
        || async {
            let all = pods.list(&lp).await.ok()?.items;
            NODES
                .iter()
                .filter(|n| **n != PACKED)
                .all(|n| {
                    let here = on_node(&all, n);
                    here.len() == 1 && hash(here[0]) != old_hash && running(here[0])
                })
                .then_some(())
        },
    )
    .await
    .ok();
    let all = pods.list(&lp).await.unwrap().items;
    let state: Vec<String> = all.iter().map(describe).collect();
    assert!(
        NODES.iter().filter(|n| **n != PACKED).all(|n| {
            let here = on_node(&all, n);
            here.len() == 1 && hash(here[0]) != old_hash && running(here[0])
        }),
        "the rollout stalled behind the packed node (old revision {old_hash}): {state:#?}"
    );
    // The packed node still has its old agent, running.
    let all = pods.list(&lp).await.unwrap().items;
    assert!(
        on_node(&all, PACKED)
            .iter()
            .any(|p| hash(p) == old_hash && running(p)),
        "the packed node lost its agent"
    );
    Api::<Pod>::namespaced(client.clone(), "default")
        .delete("game-filler", &Default::default())
        .await
        .ok();
    shell
        .sh(&format!("helm -n {NS} uninstall lastcall --wait"))
        .await
        .ok();
}
