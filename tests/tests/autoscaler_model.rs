//! The modelled node autoscalers behave as `docs/autoscalers.md` §2–§3 found in their
//! sources, end to end against the cluster model (issue 9 §3).
//!
//! Each scenario starts a cluster, puts Agones game servers on a node, asks the Cluster
//! Autoscaler or Karpenter to take that node, and checks what happened from the outcome,
//! the stored objects and the emulator's journal (every request of `cluster-autoscaler`
//! and `karpenter` is in it). Times are scaled down to fractions of a second; waiting is
//! bounded (`wait_until`, `wait_for`).

use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams};
use lastcall_testkit::cluster::autoscaler::cluster_autoscaler::{self as ca, Blocker, Failure};
use lastcall_testkit::cluster::autoscaler::karpenter::{self, Method};
use lastcall_testkit::cluster::autoscaler::{
    CLUSTER_AUTOSCALER_IDENTITY, KARPENTER_IDENTITY, keys as ak,
};
use lastcall_testkit::cluster::{
    ALLOCATOR_IDENTITY, AllocationRequest, Cluster, ClusterConfig, DEFAULT_WAIT, EvictionSafe,
    FleetSpec, GameServerSpec, GameServerState, NodeSpec, keys,
};
use lastcall_testkit::eventually::wait_for;
use lastcall_testkit::kube::{FaultRule, JournalEntry, Method as HttpMethod, Verb};
use serde_json::{Value, json};

const NS: &str = "default";

async fn cluster(nodes: &[&str]) -> Cluster {
    let c = Cluster::start(ClusterConfig::default()).await.unwrap();
    for n in nodes {
        c.add_node(NodeSpec::new(*n)).unwrap();
    }
    c
}

/// CA with its waits scaled from seconds and minutes to fractions of a second.
fn fast_ca() -> ca::Config {
    ca::Config {
        delete_delay_after_taint: Duration::from_millis(800),
        taint_conflict_deadline: Duration::from_secs(2),
        taint_conflict_retry: Duration::from_millis(100),
        eviction_retry: Duration::from_millis(100),
        max_pod_eviction_time: Duration::from_secs(1),
        pod_wait_poll: Duration::from_millis(100),
        pod_eviction_headroom: Duration::from_secs(3),
        ..ca::Config::default()
    }
}

/// Karpenter, scaled the same way; `give_up_after` bounds a drain that cannot finish.
fn fast_karpenter() -> karpenter::Config {
    karpenter::Config {
        validation: Duration::from_millis(300),
        replacement_ready: Duration::from_millis(200),
        drain_interval: Duration::from_millis(100),
        eviction_backoff_min: Duration::from_millis(50),
        eviction_backoff_max: Duration::from_millis(400),
        give_up_after: Duration::from_secs(10),
        ..karpenter::Config::default()
    }
}

/// Requests by `identity`, in order.
fn requests_of(c: &Cluster, identity: &str) -> Vec<JournalEntry> {
    c.emulator()
        .journal()
        .filter(|e| e.identity.as_deref() == Some(identity))
}

/// Eviction requests by `identity`: (pod, status), in order.
fn evictions_by(c: &Cluster, identity: &str) -> Vec<(String, u16)> {
    requests_of(c, identity)
        .into_iter()
        .filter(|e| e.subresource.as_deref() == Some("eviction"))
        .map(|e| (e.name.unwrap_or_default(), e.status))
        .collect()
}

/// Mutating requests by `identity` on `resource`/`name` with `verb`.
fn writes(
    c: &Cluster,
    identity: &str,
    verb: Verb,
    resource: &str,
    name: &str,
) -> Vec<JournalEntry> {
    requests_of(c, identity)
        .into_iter()
        .filter(|e| {
            e.verb == verb
                && e.resource.as_deref() == Some(resource)
                && e.name.as_deref() == Some(name)
                && e.subresource.is_none()
        })
        .collect()
}

fn taint_of<'a>(node: &'a Value, key: &str) -> Option<&'a Value> {
    node.pointer("/spec/taints")
        .and_then(Value::as_array)
        .and_then(|ts| {
            ts.iter()
                .find(|t| t.get("key").and_then(Value::as_str) == Some(key))
        })
}

fn cordoned(node: &Value) -> bool {
    node.pointer("/spec/unschedulable").and_then(Value::as_bool) == Some(true)
}

/// The node as soon as it carries the taint `key`.
async fn wait_tainted(c: &Cluster, node: &str, key: &str) -> Value {
    c.wait_until(&format!("{node} tainted {key}"), DEFAULT_WAIT, |c| {
        c.node(node).filter(|n| taint_of(n, key).is_some())
    })
    .await
    .unwrap()
}

async fn annotate_pod(c: &Cluster, pod: &str, key: &str, value: &str) {
    Api::<Pod>::namespaced(c.client(), NS)
        .patch(
            pod,
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "annotations": { key: value } } })),
        )
        .await
        .unwrap();
}

async fn annotate_node(c: &Cluster, node: &str, key: &str, value: &str) {
    Api::<Node>::all(c.client())
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "annotations": { key: value } } })),
        )
        .await
        .unwrap();
}

/// Warning Events with `reason` about `node`.
async fn warnings(c: &Cluster, node: &str, reason: &str) -> Vec<Event> {
    Api::<Event>::namespaced(c.client(), NS)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| {
            e.reason.as_deref() == Some(reason)
                && e.type_.as_deref() == Some("Warning")
                && e.involved_object.name.as_deref() == Some(node)
        })
        .collect()
}

/// Starts a Fleet of `n` servers while `node` is the only node, then adds `spare` (where
/// replacements go), so the servers under test all sit on `node`.
async fn fleet_on(c: &Cluster, node: &str, spare: Option<&str>, fleet: FleetSpec) -> Vec<String> {
    let (name, n) = (fleet.name.clone(), fleet.replicas as usize);
    c.create_fleet(fleet).unwrap();
    let ready = c.wait_ready(NS, &name, n).await.unwrap();
    assert!(ready.iter().all(|g| g.node.as_deref() == Some(node)));
    if let Some(spare) = spare {
        c.add_node(NodeSpec::new(spare)).unwrap();
    }
    ready.into_iter().map(|g| g.name).collect()
}

fn key(pod: &str) -> String {
    format!("{NS}/{pod}")
}

// ---- Cluster Autoscaler ---------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ca_refuses_game_servers_without_safe_to_evict_true_and_disabled_nodes() {
    let c = cluster(&["n1"]).await;
    // Agones' default (Never) and OnUpgrade both write safe-to-evict "false"; the pod's
    // GameServer owner blocks before that annotation is even read (rule order).
    let servers = fleet_on(&c, "n1", None, FleetSpec::new("never", 1).grace_seconds(0)).await;
    let on_upgrade = fleet_on(
        &c,
        "n1",
        None,
        FleetSpec::new("upgrade", 1)
            .grace_seconds(0)
            .eviction_safe(EvictionSafe::OnUpgrade),
    )
    .await;
    let autoscaler = c.cluster_autoscaler(fast_ca()).await.unwrap();
    let outcome = autoscaler.scale_down("n1").await.unwrap();
    let first = servers[0].clone().min(on_upgrade[0].clone());
    assert_eq!(
        outcome,
        ca::Outcome::Refused {
            why: Blocker::NotReplicated {
                pod: key(&first),
                owner_kind: Some("GameServer".into()),
            }
        }
    );

    // Removing "false" does not help: only "true" makes a GameServer pod movable.
    for pod in servers.iter().chain(&on_upgrade) {
        Api::<Pod>::namespaced(c.client(), NS)
            .patch(
                pod,
                &PatchParams::default(),
                &Patch::Merge(
                    json!({ "metadata": { "annotations": { keys::CA_SAFE_TO_EVICT: null } } }),
                ),
            )
            .await
            .unwrap();
    }
    let outcome = autoscaler.scale_down("n1").await.unwrap();
    assert!(
        matches!(
            outcome,
            ca::Outcome::Refused {
                why: Blocker::NotReplicated { .. }
            }
        ),
        "{outcome:?}"
    );

    annotate_node(&c, "n1", ak::CA_SCALE_DOWN_DISABLED, "true").await;
    assert_eq!(
        autoscaler.scale_down("n1").await.unwrap(),
        ca::Outcome::Refused {
            why: Blocker::ScaleDownDisabled
        }
    );

    let node = c.node("n1").unwrap();
    assert!(taint_of(&node, ak::CA_TO_BE_DELETED_TAINT).is_none());
    assert!(!cordoned(&node));
    let mutating: Vec<JournalEntry> = requests_of(&c, CLUSTER_AUTOSCALER_IDENTITY)
        .into_iter()
        .filter(|e| e.verb.is_mutating())
        .collect();
    assert!(
        mutating.is_empty(),
        "a refusal writes nothing: {mutating:?}"
    );
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ca_takes_a_node_whose_pods_all_say_safe_to_evict_true() {
    let c = cluster(&["n1"]).await;
    let servers = fleet_on(
        &c,
        "n1",
        Some("n2"),
        FleetSpec::new("arena", 2)
            .grace_seconds(1)
            .eviction_safe(EvictionSafe::Always),
    )
    .await;
    let autoscaler = c.cluster_autoscaler(fast_ca()).await.unwrap();
    let run = autoscaler.scale_down("n1");

    let marked = wait_tainted(&c, "n1", ak::CA_TO_BE_DELETED_TAINT).await;
    let taint = taint_of(&marked, ak::CA_TO_BE_DELETED_TAINT).unwrap();
    assert_eq!(taint["effect"], "NoSchedule");
    let since: i64 = taint["value"].as_str().unwrap().parse().unwrap();
    assert!(since > 1_600_000_000, "unix seconds: {since}");
    assert!(cordoned(&marked), "cordoned with the taint");

    let mut expected: Vec<String> = servers.iter().map(|s| key(s)).collect();
    expected.sort();
    assert_eq!(
        run.await.unwrap(),
        ca::Outcome::NodeDeleted {
            evicted: expected.clone()
        }
    );
    assert!(c.node("n1").is_none());

    // By the journal: one mark, every pod evicted once (accepted), then the Node delete.
    let marks = writes(&c, CLUSTER_AUTOSCALER_IDENTITY, Verb::Update, "nodes", "n1");
    assert_eq!(marks.len(), 1, "{marks:?}");
    let evictions = evictions_by(&c, CLUSTER_AUTOSCALER_IDENTITY);
    let mut evicted: Vec<String> = evictions.iter().map(|(p, _)| key(p)).collect();
    evicted.sort();
    assert_eq!(evicted, expected);
    assert!(evictions.iter().all(|(_, s)| *s == 201), "{evictions:?}");
    let deletes = writes(&c, CLUSTER_AUTOSCALER_IDENTITY, Verb::Delete, "nodes", "n1");
    assert_eq!(deletes.len(), 1);
    let first_eviction = requests_of(&c, CLUSTER_AUTOSCALER_IDENTITY)
        .into_iter()
        .find(|e| e.subresource.as_deref() == Some("eviction"))
        .unwrap();
    assert!(marks[0].seq < first_eviction.seq && first_eviction.seq < deletes[0].seq);

    // The Fleet replaced its servers on the remaining node.
    let ready = c.wait_ready(NS, "arena", 2).await.unwrap();
    assert!(
        ready.iter().all(|g| g.node.as_deref() == Some("n2")),
        "{ready:?}"
    );
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ca_aborts_at_the_recheck_when_a_pod_turns_false_after_the_taint() {
    let c = cluster(&["n1"]).await;
    let servers = fleet_on(
        &c,
        "n1",
        Some("n2"),
        FleetSpec::new("arena", 2)
            .grace_seconds(1)
            .eviction_safe(EvictionSafe::Always),
    )
    .await;
    let autoscaler = c.cluster_autoscaler(fast_ca()).await.unwrap();
    let run = autoscaler.scale_down("n1");
    wait_tainted(&c, "n1", ak::CA_TO_BE_DELETED_TAINT).await;
    // As lastcall would for a server that just got allocated.
    annotate_pod(&c, &servers[1], keys::CA_SAFE_TO_EVICT, "false").await;

    let outcome = run.await.unwrap();
    let ca::Outcome::Aborted {
        why: Blocker::NotReplicated { pod, .. },
    } = &outcome
    else {
        panic!("expected an abort at the re-check, got {outcome:?}");
    };
    assert_eq!(pod, &key(&servers[1]));
    let node = c.node("n1").expect("the node stays");
    assert!(
        taint_of(&node, ak::CA_TO_BE_DELETED_TAINT).is_none(),
        "untainted"
    );
    assert!(!cordoned(&node), "uncordoned");
    assert!(evictions_by(&c, CLUSTER_AUTOSCALER_IDENTITY).is_empty());
    assert_eq!(
        writes(&c, CLUSTER_AUTOSCALER_IDENTITY, Verb::Update, "nodes", "n1").len(),
        2,
        "mark and unmark"
    );
    assert_eq!(warnings(&c, "n1", ca::SCALE_DOWN_FAILED).await.len(), 1);
    for s in &servers {
        assert_eq!(
            c.game_server(NS, s).and_then(|g| g.state),
            Some(GameServerState::Ready)
        );
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ca_gives_up_after_max_pod_eviction_time_under_the_agones_pdb_and_untaints() {
    let c = cluster(&["n1"]).await;
    // eviction.safe Never: label "false" (the 0 % PDB selects it), annotation "false".
    let servers = fleet_on(&c, "n1", None, FleetSpec::new("arena", 1).grace_seconds(0)).await;
    let pod = &servers[0];
    let stored = c.pod(NS, pod).unwrap();
    assert_eq!(
        stored.pointer(&format!(
            "/metadata/labels/{}",
            keys::SAFE_TO_EVICT_LABEL.replace('/', "~1")
        )),
        Some(&json!("false"))
    );
    // "true" passes CA's pick (that rule runs before the PDB rule); the API's PDB check
    // still refuses the eviction.
    annotate_pod(&c, pod, keys::CA_SAFE_TO_EVICT, "true").await;

    let autoscaler = c.cluster_autoscaler(fast_ca()).await.unwrap();
    let outcome = autoscaler.scale_down("n1").await.unwrap();
    assert_eq!(
        outcome,
        ca::Outcome::GaveUp {
            why: Failure::EvictionsFailed {
                pods: vec![(key(pod), Some(429))]
            }
        }
    );
    let evictions = evictions_by(&c, CLUSTER_AUTOSCALER_IDENTITY);
    assert!(evictions.len() >= 2, "retried: {evictions:?}");
    assert!(
        evictions.iter().all(|(p, s)| p == pod && *s == 429),
        "{evictions:?}"
    );
    let node = c.node("n1").expect("the node stays");
    assert!(taint_of(&node, ak::CA_TO_BE_DELETED_TAINT).is_none());
    assert!(!cordoned(&node));
    assert!(writes(&c, CLUSTER_AUTOSCALER_IDENTITY, Verb::Delete, "nodes", "n1").is_empty());
    assert_eq!(warnings(&c, "n1", ca::SCALE_DOWN_FAILED).await.len(), 1);
    assert!(
        c.pod(NS, pod)
            .unwrap()
            .pointer("/metadata/deletionTimestamp")
            .is_none()
    );
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ca_evicts_a_server_allocated_after_the_taint_when_nobody_protects_it() {
    // eviction.safe Always and nobody (no lastcall) turning the annotation to "false":
    // an allocation between the taint and the eviction is evicted, the residual of
    // docs/autoscalers.md §5.
    let c = cluster(&["n1"]).await;
    let servers = fleet_on(
        &c,
        "n1",
        Some("n2"),
        FleetSpec::new("arena", 1)
            .grace_seconds(1)
            .eviction_safe(EvictionSafe::Always),
    )
    .await;
    let autoscaler = c.cluster_autoscaler(fast_ca()).await.unwrap();
    let run = autoscaler.scale_down("n1");
    wait_tainted(&c, "n1", ak::CA_TO_BE_DELETED_TAINT).await;
    let allocated = c
        .allocate(&AllocationRequest::fleet(NS, "arena"))
        .await
        .unwrap()
        .expect("the allocator ignores taints and cordon");
    assert_eq!(allocated.name, servers[0]);

    assert_eq!(
        run.await.unwrap(),
        ca::Outcome::NodeDeleted {
            evicted: vec![key(&servers[0])]
        }
    );
    let allocation = requests_of(&c, ALLOCATOR_IDENTITY)
        .into_iter()
        .find(|e| e.verb == Verb::Update && e.status == 200)
        .unwrap();
    let eviction = requests_of(&c, CLUSTER_AUTOSCALER_IDENTITY)
        .into_iter()
        .find(|e| e.subresource.as_deref() == Some("eviction"))
        .unwrap();
    assert!(allocation.seq < eviction.seq);
    let name = servers[0].as_str();
    let cr = &c;
    wait_for(
        "the allocated server to end Unhealthy or gone",
        || async move {
            match cr.game_server(NS, name) {
                None => Some(()),
                Some(g) if g.state == Some(GameServerState::Unhealthy) => Some(()),
                Some(_) => None,
            }
        },
    )
    .await;
    c.shutdown().await;
}

// ---- Karpenter --------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn karpenter_graceful_methods_refuse_do_not_disrupt_and_exhausted_pdbs() {
    let c = Cluster::start(ClusterConfig::default()).await.unwrap();
    c.add_node(NodeSpec::new("dnd").label("pool", "dnd"))
        .unwrap();
    c.add_node(NodeSpec::new("pdb").label("pool", "pdb"))
        .unwrap();
    c.add_node(NodeSpec::new("held").label("pool", "held"))
        .unwrap();
    c.add_node(NodeSpec::new("busy").label("pool", "busy"))
        .unwrap();
    c.create_game_server(
        GameServerSpec::new("in-a-match")
            .node_selector("pool", "dnd")
            .eviction_safe(EvictionSafe::OnUpgrade)
            .pod_annotation(ak::KARPENTER_DO_NOT_DISRUPT, "true"),
    )
    .unwrap();
    // Agones' default Never: the 0 % PDB selects the pod.
    c.create_game_server(GameServerSpec::new("never").node_selector("pool", "pdb"))
        .unwrap();
    c.create_game_server(
        GameServerSpec::new("idle")
            .node_selector("pool", "busy")
            .eviction_safe(EvictionSafe::OnUpgrade),
    )
    .unwrap();
    wait_servers_ready(&c, &["in-a-match", "never", "idle"]).await;
    annotate_node(&c, "held", ak::KARPENTER_DO_NOT_DISRUPT, "true").await;

    let k = c.karpenter(fast_karpenter()).await.unwrap();
    for method in [Method::Consolidation, Method::Drift] {
        assert_eq!(
            k.disrupt("dnd", method).await.unwrap(),
            karpenter::Outcome::Refused {
                why: karpenter::Blocker::PodDoNotDisrupt {
                    pod: key("in-a-match")
                }
            },
            "{method:?}"
        );
    }
    assert_eq!(
        k.disrupt("pdb", Method::Consolidation).await.unwrap(),
        karpenter::Outcome::Refused {
            why: karpenter::Blocker::PdbExhausted {
                pod: key("never"),
                pdb: format!("{NS}/{}", keys::AGONES_PDB),
            }
        }
    );
    assert_eq!(
        k.disrupt("held", Method::Emptiness).await.unwrap(),
        karpenter::Outcome::Refused {
            why: karpenter::Blocker::NodeDoNotDisrupt
        }
    );
    // Nothing blocks consolidation of "busy", but it is not empty.
    assert_eq!(
        k.disrupt("busy", Method::Emptiness).await.unwrap(),
        karpenter::Outcome::Refused {
            why: karpenter::Blocker::NotEmpty { pod: key("idle") }
        }
    );
    let mutating: Vec<JournalEntry> = requests_of(&c, KARPENTER_IDENTITY)
        .into_iter()
        .filter(|e| e.verb.is_mutating())
        .collect();
    assert!(
        mutating.is_empty(),
        "a refusal writes nothing: {mutating:?}"
    );
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn karpenter_consolidation_takes_a_node_of_ready_servers() {
    let c = cluster(&["n1"]).await;
    let servers = fleet_on(
        &c,
        "n1",
        Some("n2"),
        FleetSpec::new("arena", 2)
            .grace_seconds(1)
            .eviction_safe(EvictionSafe::OnUpgrade),
    )
    .await;
    let k = c.karpenter(fast_karpenter()).await.unwrap();
    let run = k.disrupt("n1", Method::Consolidation);
    let tainted = wait_tainted(&c, "n1", ak::KARPENTER_DISRUPTED_TAINT).await;
    let taint = taint_of(&tainted, ak::KARPENTER_DISRUPTED_TAINT).unwrap();
    assert_eq!(taint["effect"], "NoSchedule");
    assert!(taint.get("value").is_none_or(Value::is_null));
    assert_eq!(
        tainted.pointer(&format!(
            "/metadata/labels/{}",
            ak::EXCLUDE_FROM_LB_LABEL.replace('/', "~1")
        )),
        Some(&json!("karpenter"))
    );
    assert!(!cordoned(&tainted), "Karpenter does not cordon");

    let mut expected: Vec<String> = servers.iter().map(|s| key(s)).collect();
    expected.sort();
    assert_eq!(
        run.await.unwrap(),
        karpenter::Outcome::NodeDeleted {
            evicted: expected.clone(),
            deleted: vec![],
            at_deadline: false,
        }
    );
    assert!(c.node("n1").is_none());
    let ours = requests_of(&c, KARPENTER_IDENTITY);
    let taint_patch = ours
        .iter()
        .position(|e| e.verb == Verb::Patch && e.resource.as_deref() == Some("nodes"))
        .unwrap();
    let pod_lists = ours[..taint_patch]
        .iter()
        .filter(|e| e.verb == Verb::List && e.resource.as_deref() == Some("pods"))
        .count();
    assert_eq!(pod_lists, 2, "picked, then validated, before the taint");
    let evictions = evictions_by(&c, KARPENTER_IDENTITY);
    let mut evicted: Vec<String> = evictions.iter().map(|(p, _)| key(p)).collect();
    evicted.sort();
    assert_eq!(evicted, expected, "each queued pod evicted once");
    assert!(evictions.iter().all(|(_, s)| *s == 201));
    assert_eq!(
        writes(&c, KARPENTER_IDENTITY, Verb::Delete, "nodes", "n1").len(),
        1
    );
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn karpenter_replacement_failure_removes_the_taint() {
    let c = cluster(&["n1"]).await;
    fleet_on(
        &c,
        "n1",
        None,
        FleetSpec::new("arena", 1).eviction_safe(EvictionSafe::Always),
    )
    .await;
    let k = c
        .karpenter(karpenter::Config {
            fail_replacement: true,
            ..fast_karpenter()
        })
        .await
        .unwrap();
    let run = k.disrupt("n1", Method::Consolidation);
    wait_tainted(&c, "n1", ak::KARPENTER_DISRUPTED_TAINT).await;
    assert_eq!(run.await.unwrap(), karpenter::Outcome::ReplacementFailed);
    let node = c.node("n1").unwrap();
    assert!(taint_of(&node, ak::KARPENTER_DISRUPTED_TAINT).is_none());
    assert!(evictions_by(&c, KARPENTER_IDENTITY).is_empty());
    c.shutdown().await;
}

/// A standalone server on `n1` (the only node when it is created) with `grace` seconds.
async fn server_on_n1(c: &Cluster, name: &str, grace: i64, do_not_disrupt: bool) {
    let mut gs = GameServerSpec::new(name)
        .grace_seconds(grace)
        .node_selector("kubernetes.io/hostname", "n1");
    if do_not_disrupt {
        gs = gs.pod_annotation(ak::KARPENTER_DO_NOT_DISRUPT, "true");
    }
    c.create_game_server(gs).unwrap();
}

async fn wait_servers_ready(c: &Cluster, names: &[&str]) {
    c.wait_until("servers Ready", DEFAULT_WAIT, |c| {
        names
            .iter()
            .all(|n| c.game_server(NS, n).and_then(|g| g.state) == Some(GameServerState::Ready))
            .then_some(())
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn karpenter_never_evicts_a_do_not_disrupt_pod_and_waits_for_it() {
    let c = cluster(&["n1", "n2"]).await;
    server_on_n1(&c, "match", 1, true).await;
    c.create_game_server(
        GameServerSpec::new("idle")
            .grace_seconds(1)
            .eviction_safe(EvictionSafe::OnUpgrade)
            .node_selector("kubernetes.io/hostname", "n1"),
    )
    .unwrap();
    wait_servers_ready(&c, &["match", "idle"]).await;

    let k = c.karpenter(fast_karpenter()).await.unwrap();
    // Forceful: no pick, so do-not-disrupt does not stop the node, only the eviction.
    let run = k.disrupt("n1", Method::Expiration);
    c.wait_until("the idle pod gone", DEFAULT_WAIT, |c| {
        c.pod(NS, "idle").is_none().then_some(())
    })
    .await
    .unwrap();
    assert!(!run.is_finished(), "still waiting for the match");
    let matched = c.pod(NS, "match").unwrap();
    assert!(matched.pointer("/metadata/deletionTimestamp").is_none());

    // The match ends; the drain completes and the node goes.
    c.game_exit(NS, "match").unwrap();
    assert_eq!(
        run.await.unwrap(),
        karpenter::Outcome::NodeDeleted {
            evicted: vec![key("idle")],
            deleted: vec![],
            at_deadline: false,
        }
    );
    let evictions = evictions_by(&c, KARPENTER_IDENTITY);
    assert!(evictions.iter().all(|(p, _)| p == "idle"), "{evictions:?}");
    let pod_deletes = requests_of(&c, KARPENTER_IDENTITY)
        .into_iter()
        .filter(|e| e.verb == Verb::Delete && e.resource.as_deref() == Some("pods"))
        .count();
    assert_eq!(pod_deletes, 0);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn karpenter_without_tgp_keeps_the_node_tainted_and_waiting() {
    let c = cluster(&["n1"]).await;
    server_on_n1(&c, "match", 1, true).await;
    wait_servers_ready(&c, &["match"]).await;
    let k = c
        .karpenter(karpenter::Config {
            give_up_after: Duration::from_millis(1500),
            ..fast_karpenter()
        })
        .await
        .unwrap();
    assert_eq!(
        k.disrupt("n1", Method::Interruption).await.unwrap(),
        karpenter::Outcome::Waiting {
            remaining: vec![key("match")],
            evicted: vec![],
        }
    );
    let node = c.node("n1").expect("the node stays");
    assert!(
        taint_of(&node, ak::KARPENTER_DISRUPTED_TAINT).is_some(),
        "still tainted"
    );
    assert!(evictions_by(&c, KARPENTER_IDENTITY).is_empty());
    assert_eq!(
        c.game_server(NS, "match").and_then(|g| g.state),
        Some(GameServerState::Ready)
    );
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn karpenter_with_tgp_deletes_remaining_pods_at_deadline_minus_grace() {
    let c = cluster(&["n1"]).await;
    // A match (do-not-disrupt) and a server the Agones PDB protects (Never): neither can be
    // evicted, both go at the deadline minus their grace.
    server_on_n1(&c, "match", 2, true).await;
    server_on_n1(&c, "never", 2, false).await;
    wait_servers_ready(&c, &["match", "never"]).await;
    let tgp = Duration::from_secs(4);
    let k = c
        .karpenter(karpenter::Config {
            termination_grace_period: Some(tgp),
            ..fast_karpenter()
        })
        .await
        .unwrap();
    let run = k.disrupt("n1", Method::Expiration);

    // Each pod is deleted with at most the time left until the deadline as its grace.
    for name in ["match", "never"] {
        let grace = c
            .wait_until(&format!("{name} terminating"), DEFAULT_WAIT, |c| {
                c.pod(NS, name)
                    .filter(|p| p.pointer("/metadata/deletionTimestamp").is_some())
                    .and_then(|p| {
                        p.pointer("/metadata/deletionGracePeriodSeconds")
                            .and_then(Value::as_i64)
                    })
            })
            .await
            .unwrap();
        assert!(
            (0..2).contains(&grace),
            "{name}: grace {grace} is the time left, under its own 2 s"
        );
    }
    let outcome = run.await.unwrap();
    let karpenter::Outcome::NodeDeleted { deleted, .. } = &outcome else {
        panic!("{outcome:?}");
    };
    assert_eq!(deleted, &vec![key("match"), key("never")]);
    assert!(c.node("n1").is_none());

    // The match was never evicted. The PDB refused every eviction of the other until the
    // deadline delete made its pod terminating; the queue, still retrying, then gets
    // through (the API skips PDBs for terminating pods), as Karpenter's queue would.
    let ours = requests_of(&c, KARPENTER_IDENTITY);
    let deleted_at = |name: &str| {
        let d = writes(&c, KARPENTER_IDENTITY, Verb::Delete, "pods", name);
        assert_eq!(d.len(), 1, "{name}: {d:?}");
        d[0].seq
    };
    let never_deleted = deleted_at("never");
    deleted_at("match");
    let evictions: Vec<&JournalEntry> = ours
        .iter()
        .filter(|e| e.subresource.as_deref() == Some("eviction"))
        .collect();
    assert!(
        evictions.iter().all(|e| e.name.as_deref() == Some("never")),
        "{evictions:?}"
    );
    assert!(
        evictions.iter().any(|e| e.status == 429),
        "the PDB-protected pod was tried"
    );
    for e in &evictions {
        assert!(e.status == 429 || e.seq > never_deleted, "{e:?}");
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn karpenter_deletes_the_node_at_the_tgp_deadline_whatever_remains() {
    let c = cluster(&["n1"]).await;
    server_on_n1(&c, "match", 1, true).await;
    wait_servers_ready(&c, &["match"]).await;
    // Every pod DELETE fails: the pod is still there at the deadline.
    c.emulator().faults().inject(FaultRule::status(
        Some(HttpMethod::DELETE),
        "/pods/match",
        1_000,
        500,
    ));
    let k = c
        .karpenter(karpenter::Config {
            termination_grace_period: Some(Duration::from_secs(2)),
            ..fast_karpenter()
        })
        .await
        .unwrap();
    assert_eq!(
        k.disrupt("n1", Method::Expiration).await.unwrap(),
        karpenter::Outcome::NodeDeleted {
            evicted: vec![],
            deleted: vec![],
            at_deadline: true,
        }
    );
    assert!(c.node("n1").is_none());
    assert!(!writes(&c, KARPENTER_IDENTITY, Verb::Delete, "pods", "match").is_empty());
    c.emulator().faults().clear();
    // The pod GC removes the pods of the vanished node.
    c.wait_until("the match pod gone with its node", DEFAULT_WAIT, |c| {
        c.pod(NS, "match").is_none().then_some(())
    })
    .await
    .unwrap();
    c.shutdown().await;
}
