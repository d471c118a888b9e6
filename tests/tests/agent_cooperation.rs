//! Autoscaler cooperation end to end: the agent keeps `karpenter.sh/do-not-disrupt` and
//! `cluster-autoscaler.kubernetes.io/safe-to-evict` on its game-server pods as their servers
//! are allocated and return to Ready, per node pool, with one write per transition.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{Patch, PatchParams};
use lastcall_testkit::cluster::AllocationRequest;
use lastcall_testkit::eventually::wait_for;
use lastcall_testkit::kube::journal::Verb;
use lastcall_testkit::world::{NS, World, WorldSpec};

const DND: &str = "karpenter.sh/do-not-disrupt";
const STE: &str = "cluster-autoscaler.kubernetes.io/safe-to-evict";
const MANAGED: &str = "lastcall.dev/managed-annotations";

async fn pod_annotations(w: &World, gs: &str) -> BTreeMap<String, String> {
    Api::<Pod>::namespaced(w.cluster.client(), NS)
        .get(gs)
        .await
        .expect("pod")
        .metadata
        .annotations
        .unwrap_or_default()
}

fn protected(a: &BTreeMap<String, String>) -> bool {
    a.get(DND).map(String::as_str) == Some("true")
        && a.get(STE).map(String::as_str) == Some("false")
}

fn offered(a: &BTreeMap<String, String>) -> bool {
    !a.contains_key(DND) && a.get(STE).map(String::as_str) == Some("true")
}

fn pod_patches(w: &World) -> usize {
    w.cluster.emulator().journal().count(|e| {
        e.identity.as_deref() == Some("agent-n1")
            && e.verb == Verb::Patch
            && e.resource.as_deref() == Some("pods")
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_of_matches_are_kept_from_autoscalers_and_idle_ones_offered() {
    let w = World::start(WorldSpec::new(2, 0, 0)).await;
    let agent = w
        .start_agent(&["--autoscaler-cooperation".into(), "in-use".into()])
        .await;
    w.claimed_all().await;
    let names: Vec<String> = w.on("n1").into_iter().map(|g| g.name).collect();
    for n in &names {
        wait_for("idle pod offered to autoscalers", || async {
            offered(&pod_annotations(&w, n).await).then_some(())
        })
        .await;
    }
    let settled = pod_patches(&w);
    assert_eq!(settled, 2, "one write per pod");

    // Allocation: the match's pod is protected.
    let gs = w
        .cluster
        .allocate(&AllocationRequest::fleet(NS, "fleet"))
        .await
        .expect("allocate")
        .expect("a Ready server");
    wait_for("allocated pod protected", || async {
        protected(&pod_annotations(&w, &gs.name).await).then_some(())
    })
    .await;
    let other = names.iter().find(|n| **n != gs.name).expect("the other");
    assert!(offered(&pod_annotations(&w, other).await));
    assert_eq!(
        pod_annotations(&w, &gs.name)
            .await
            .get(MANAGED)
            .map(String::as_str),
        Some("cluster-autoscaler.kubernetes.io/safe-to-evict,karpenter.sh/do-not-disrupt")
    );
    // The game returns its server to the pool: offered again.
    w.cluster.sdk_ready(NS, &gs.name).expect("Ready()");
    wait_for("returned pod offered again", || async {
        offered(&pod_annotations(&w, &gs.name).await).then_some(())
    })
    .await;
    assert_eq!(pod_patches(&w), settled + 2, "one write per transition");
    // Nothing more while nothing changes (resyncs re-plan the same state).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(pod_patches(&w), settled + 2, "no write without a change");

    // The node pool opts out by label: lastcall undoes exactly what it wrote, and Agones'
    // own value (Never → "false") is back.
    Api::<Node>::all(w.cluster.client())
        .patch(
            "n1",
            &PatchParams::default(),
            &Patch::Merge(&serde_json::json!({"metadata": {"labels": {
                "lastcall.dev/autoscaler-cooperation": "off"
            }}})),
        )
        .await
        .expect("label");
    for n in &names {
        wait_for("lastcall's annotations removed", || async {
            let a = pod_annotations(&w, n).await;
            (!a.contains_key(DND)
                && !a.contains_key(MANAGED)
                && a.get(STE).map(String::as_str) == Some("false"))
            .then_some(())
        })
        .await;
    }
    agent.stop().await.expect("clean stop");
}
