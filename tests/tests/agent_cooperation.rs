//! Autoscaler cooperation end to end: the agent keeps `karpenter.sh/do-not-disrupt` and
//! `cluster-autoscaler.kubernetes.io/safe-to-evict` on its game-server pods as their servers
//! are allocated and return to Ready, per node pool, with one write per transition. It never
//! marks a pod evictable, so an agent that is gone leaves no allocated pod evictable; the
//! cleanup removes what it wrote; a write an admission webhook reverts backs off.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{Patch, PatchParams};
use lastcall_testkit::cluster::AllocationRequest;
use lastcall_testkit::eventually::wait_for;
use lastcall_testkit::kube::journal::Verb;
use lastcall_testkit::world::{NS, World, WorldSpec};

#[path = "support/passes.rs"]
mod passes;
use passes::after_passes;

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

/// Agones' own values for `eviction.safe: Never`, nothing of lastcall's.
fn agones_never(a: &BTreeMap<String, String>) -> bool {
    !a.contains_key(DND)
        && !a.contains_key(MANAGED)
        && a.get(STE).map(String::as_str) == Some("false")
}

fn pod_patches(w: &World) -> usize {
    w.cluster.emulator().journal().count(|e| {
        e.identity.as_deref() == Some("agent-n1")
            && e.verb == Verb::Patch
            && e.resource.as_deref() == Some("pods")
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_of_matches_are_kept_from_autoscalers_and_idle_ones_keep_agones_values() {
    let w = World::start(WorldSpec::new(2, 0, 0)).await;
    let agent = w
        .start_agent(&[
            "--autoscaler-cooperation".into(),
            "in-use".into(),
            "--resync-interval".into(),
            "1s".into(),
        ])
        .await;
    w.claimed_all().await;
    let names: Vec<String> = w.on("n1").into_iter().map(|g| g.name).collect();
    // Idle pods: nothing written over passes after the claims.
    after_passes(&agent, 2).await;
    for n in &names {
        assert!(agones_never(&pod_annotations(&w, n).await), "{n}");
    }
    let settled = pod_patches(&w);
    assert_eq!(settled, 0, "no write for idle pods");
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
    assert!(agones_never(&pod_annotations(&w, other).await));
    assert_eq!(
        pod_annotations(&w, &gs.name)
            .await
            .get(MANAGED)
            .map(String::as_str),
        Some("cluster-autoscaler.kubernetes.io/safe-to-evict,karpenter.sh/do-not-disrupt")
    );
    // The game returns its server to the pool: Agones' values again.
    w.cluster.sdk_ready(NS, &gs.name).expect("Ready()");
    wait_for("returned pod back to Agones' values", || async {
        agones_never(&pod_annotations(&w, &gs.name).await).then_some(())
    })
    .await;
    assert_eq!(pod_patches(&w), settled + 2, "one write per transition");
    // Nothing more while nothing changes (passes re-plan the same state).
    after_passes(&agent, 2).await;
    assert_eq!(pod_patches(&w), settled + 2, "no write without a change");

    // The node pool opts out by label: lastcall undoes exactly what it wrote, and Agones'
    // own value (Never → "false") is back.
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
            agones_never(&pod_annotations(&w, n).await).then_some(())
        })
        .await;
    }
    agent.stop().await.expect("clean stop");
}

/// The agent runs, then is gone (a crash loop, an outage, an uninstall without the hook).
/// A server allocated meanwhile, with `eviction.safe: OnUpgrade` (no PDB behind it), must not
/// be left evictable by the cluster autoscaler because of something lastcall wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_is_gone_leaves_no_allocated_pod_evictable() {
    let w = World::start(WorldSpec::new(2, 0, 0)).await;
    let agent = w
        .start_agent(&[
            "--autoscaler-cooperation".into(),
            "in-use".into(),
            "--resync-interval".into(),
            "1s".into(),
        ])
        .await;
    w.claimed_all().await;
    // Passes over the idle pods (on the old behaviour they wrote "true" on both).
    after_passes(&agent, 3).await;
    agent.stop().await.expect("stop");
    let gs = w
        .cluster
        .allocate(&AllocationRequest::fleet(NS, "fleet"))
        .await
        .expect("allocate")
        .expect("a Ready server");
    let a = pod_annotations(&w, &gs.name).await;
    assert_ne!(
        a.get(STE).map(String::as_str),
        Some("true"),
        "the allocated pod is evictable: {a:?}"
    );
}

/// The uninstall path: `--cleanup-cooperation` (the chart's pre-delete hook) removes every key
/// lastcall wrote, cluster-wide, and puts Agones' own value back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cleanup_removes_what_cooperation_wrote() {
    let w = World::start(WorldSpec::new(1, 1, 0)).await;
    let agent = w
        .start_agent(&["--autoscaler-cooperation".into(), "all".into()])
        .await;
    w.claimed_all().await;
    let names: Vec<String> = w.on("n1").into_iter().map(|g| g.name).collect();
    for n in &names {
        wait_for("every pod protected (mode all)", || async {
            protected(&pod_annotations(&w, n).await).then_some(())
        })
        .await;
    }
    agent.stop().await.expect("stop");
    let kube = w
        .cluster
        .emulator()
        .config_for("lastcall-cleanup")
        .await
        .expect("client");
    let summary = lastcall_agent::run::cleanup_cooperation(
        &lastcall_testkit::agent::config("n1", &["--cleanup-cooperation"]),
        Some(kube),
    )
    .await
    .expect("cleanup");
    assert_eq!(summary.cleaned, names.len());
    assert_eq!(summary.failed, 0);
    for n in &names {
        let a = pod_annotations(&w, n).await;
        assert!(agones_never(&a), "{n}: {a:?}");
    }
}

/// An admission webhook that sets `safe-to-evict: "true"` on every pod write (a policy
/// engine's default): the agent's protection of the match comes back reverted. It backs off
/// exponentially instead of re-writing in a tight loop, counts it and says so; the exposed
/// match shows in the gauge the alert reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_that_is_reverted_backs_off() {
    let w = World::start(WorldSpec::new(0, 1, 0)).await;
    w.cluster
        .emulator()
        .faults()
        .revert(lastcall_testkit::kube::faults::Revert::set(
            "pods",
            &format!("/metadata/annotations/{}", STE.replace('/', "~1")),
            serde_json::json!("true"),
        ));
    let agent = w
        .start_agent(&[
            "--autoscaler-cooperation".into(),
            "in-use".into(),
            "--resync-interval".into(),
            "1s".into(),
        ])
        .await;
    w.claimed_all().await;
    wait_for("the first protection written", || async {
        (pod_patches(&w) >= 1).then_some(())
    })
    .await;
    // Twelve passes more (each reverted write wakes one, and the resync is 1 s): backing off
    // 1 s, 2 s, 4 s, 8 s, a handful of writes over them however fast they come; a loop
    // writing on every pass makes one each.
    let before = pod_patches(&w);
    after_passes(&agent, 12).await;
    let writes = pod_patches(&w) - before;
    assert!(writes <= 6, "{writes} pod writes over twelve passes");
    let m = agent.metrics().await;
    let reverted = lastcall_testkit::agent::metric(
        &m,
        "lastcall_writes_reverted_total",
        &[("action", "annotate_pod")],
    );
    assert!(reverted.is_some_and(|v| v >= 1.0), "{reverted:?}");
    assert_eq!(
        lastcall_testkit::agent::metric(&m, "lastcall_cooperation_exposed_matches", &[]),
        Some(1.0)
    );
    wait_for("a WriteReverted Warning Event", || async {
        Api::<k8s_openapi::api::events::v1::Event>::all(w.cluster.client())
            .list(&Default::default())
            .await
            .ok()?
            .items
            .iter()
            .any(|e| {
                e.reason.as_deref() == Some("WriteReverted")
                    && e.type_.as_deref() == Some("Warning")
            })
            .then_some(())
    })
    .await;
    agent.stop().await.expect("clean stop");
}
