//! The cluster model behaves like a real cluster with Agones, seen through the real API.
//!
//! Every scenario runs the emulator plus the model and talks to it with `kube::Client`
//! over HTTP wherever a client is involved (allocation, eviction, deletes); state is
//! checked on the objects themselves. Waiting is bounded polling (`wait_for`).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use futures::future::join_all;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, DeleteParams, DynamicObject, EvictParams, Preconditions};
use lastcall_testkit::cluster::allocator::gameserver_resource;
use lastcall_testkit::cluster::{
    ALLOCATOR_IDENTITY, AllocationRequest, Cluster, ClusterConfig, EvictionSafe, FleetSpec,
    GameServerSpec, GameServerState, GameServerView, NodeSpec, for_seconds, keys, taint,
    toleration_equal, toleration_exists,
};
use lastcall_testkit::eventually::wait_for;
use lastcall_testkit::kube::EventKind;
use lastcall_testkit::kube::resources::GAMESERVERS;
use serde_json::Value;

const NS: &str = "default";

async fn cluster_with(nodes: &[&str], cfg: ClusterConfig) -> Cluster {
    let cluster = Cluster::start(cfg).await.unwrap();
    for n in nodes {
        cluster.add_node(NodeSpec::new(*n)).unwrap();
    }
    cluster
}

async fn cluster(nodes: &[&str]) -> Cluster {
    cluster_with(nodes, ClusterConfig::default()).await
}

fn gs_api(cluster: &Cluster, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(cluster.client(), ns, &gameserver_resource())
}

fn api_code<T: std::fmt::Debug>(res: Result<T, kube::Error>) -> u16 {
    match res {
        Err(kube::Error::Api(s)) => s.code,
        other => panic!("expected an API error, got {other:?}"),
    }
}

fn state_of(c: &Cluster, ns: &str, name: &str) -> Option<GameServerState> {
    c.game_server(ns, name).and_then(|g| g.state)
}

fn label<'a>(obj: &'a Value, key: &str) -> Option<&'a str> {
    obj.pointer("/metadata/labels")
        .and_then(|l| l.get(key))
        .and_then(Value::as_str)
}

fn annotation<'a>(obj: &'a Value, key: &str) -> Option<&'a str> {
    obj.pointer("/metadata/annotations")
        .and_then(|l| l.get(key))
        .and_then(Value::as_str)
}

fn uid(obj: &Value) -> String {
    obj.pointer("/metadata/uid")
        .and_then(Value::as_str)
        .unwrap()
        .to_string()
}

fn node_of(obj: &Value) -> Option<&str> {
    obj.pointer("/spec/nodeName").and_then(Value::as_str)
}

/// Every GameServer state change seen in the store, in order: (name, state, event kind).
type StateLog = Arc<Mutex<Vec<(String, Option<GameServerState>, EventKind)>>>;

fn record_states(cluster: &Cluster) -> StateLog {
    let log: StateLog = Arc::default();
    let mut rx = cluster.store().subscribe();
    let sink = log.clone();
    tokio::spawn(async move {
        while let Ok(ev) = rx.recv().await {
            if ev.rt == GAMESERVERS {
                let state = GameServerView::parse(&ev.object).ok().and_then(|g| g.state);
                sink.lock().unwrap().push((ev.name.clone(), state, ev.kind));
            }
        }
    });
    log
}

fn states_seen(log: &StateLog, name: &str) -> Vec<Option<GameServerState>> {
    let mut out: Vec<Option<GameServerState>> = Vec::new();
    for (n, s, _) in log.lock().unwrap().iter() {
        if n == name && out.last() != Some(s) {
            out.push(*s);
        }
    }
    out
}

/// The states of `name` once the recorder has seen `state` (it runs behind the store).
async fn seen_until(
    log: &StateLog,
    name: &str,
    state: GameServerState,
) -> Vec<Option<GameServerState>> {
    wait_for(&format!("{name} to be seen {state}"), || async move {
        let seen = states_seen(log, name);
        seen.contains(&Some(state)).then_some(seen)
    })
    .await
}

/// The only Ready GameServer of `fleet` whose name is not `old`, once there is one.
async fn replacement(c: &Cluster, fleet: &str, old: &str) -> GameServerView {
    wait_for(&format!("a Ready replacement for {old}"), || async move {
        c.fleet_game_servers(NS, fleet)
            .into_iter()
            .find(|g| g.name != old && g.state == Some(GameServerState::Ready) && !g.deleting)
    })
    .await
}

// ---- allocation ---------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocation_race_allocates_each_server_exactly_once() {
    let c = cluster(&["n1", "n2", "n3"]).await;
    c.create_fleet(FleetSpec::new("arena", 10)).unwrap();
    c.wait_ready(NS, "arena", 10).await.unwrap();

    let req = AllocationRequest::fleet(NS, "arena");
    let results = join_all((0..50).map(|_| c.allocate(&req))).await;
    let winners: Vec<String> = results
        .into_iter()
        .map(|r| r.unwrap())
        .filter_map(|a| a.map(|gs| gs.name))
        .collect();
    assert_eq!(
        winners.len(),
        10,
        "exactly 10 allocations succeed: {winners:?}"
    );
    let distinct: BTreeSet<&String> = winners.iter().collect();
    assert_eq!(
        distinct.len(),
        10,
        "no server is allocated twice: {winners:?}"
    );

    let servers = c.fleet_game_servers(NS, "arena");
    assert_eq!(servers.len(), 10, "the fleet did not grow");
    for gs in &servers {
        assert_eq!(
            gs.state,
            Some(GameServerState::Allocated),
            "{} is Allocated",
            gs.name
        );
        assert!(winners.contains(&gs.name), "{} was handed out", gs.name);
        assert!(gs.annotations.contains_key(keys::LAST_ALLOCATED));
    }
    // The allocator went over HTTP as the real one does: list, then PUT.
    let puts = c.emulator().journal().count(|e| {
        e.identity.as_deref() == Some(ALLOCATOR_IDENTITY) && e.method == "PUT" && e.status == 200
    });
    assert_eq!(
        puts, 10,
        "each allocation is one successful full update over HTTP"
    );
    // Nothing is left to allocate.
    assert!(c.allocate(&req).await.unwrap().is_none());
    let cr = &c;
    let st = wait_for("fleet status shows 10 allocated", || async move {
        cr.fleet_status(NS, "arena")
            .filter(|s| s.allocated_replicas == 10)
    })
    .await;
    assert_eq!((st.replicas, st.ready_replicas), (10, 0), "{st:?}");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocation_and_guarded_delete_never_both_win() {
    let c = cluster(&["n1", "n2"]).await;
    c.create_fleet(FleetSpec::new("arena", 8).grace_seconds(0))
        .unwrap();
    let ready = c.wait_ready(NS, "arena", 8).await.unwrap();
    let api = gs_api(&c, NS);

    // For every Ready server, race a delete guarded by what was observed while Ready
    // (lastcall's fence) against an allocation.
    let deletes = ready.iter().map(|gs| {
        let api = api.clone();
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(gs.uid.clone()),
                resource_version: Some(gs.resource_version.clone()),
            }),
            ..Default::default()
        };
        let name = gs.name.clone();
        async move { (name.clone(), api.delete(&name, &dp).await) }
    });
    let req = AllocationRequest::fleet(NS, "arena");
    let allocs = (0..8).map(|_| c.allocate(&req));
    let (deleted, allocated) = tokio::join!(join_all(deletes), join_all(allocs));

    let winners: BTreeSet<String> = allocated
        .into_iter()
        .filter_map(|r| r.unwrap().map(|g| g.name))
        .collect();
    for (name, res) in deleted {
        match res {
            Ok(_) => assert!(
                !winners.contains(&name),
                "{name} was deleted and also allocated"
            ),
            Err(kube::Error::Api(s)) => {
                assert_eq!(s.code, 409, "{name}: {s:?}");
                assert!(
                    winners.contains(&name),
                    "{name}: the delete lost to an allocation"
                );
                let gs = c.game_server(NS, &name).unwrap();
                assert_eq!(gs.state, Some(GameServerState::Allocated));
                assert!(!gs.deleting, "{name} stays");
            }
            Err(e) => panic!("{name}: {e}"),
        }
    }
    c.shutdown().await;
}

// ---- eviction -------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agones_pdb_blocks_eviction_of_default_gameservers() {
    let c = cluster(&["n1"]).await;
    let pdb = Api::<PodDisruptionBudget>::namespaced(c.client(), NS)
        .get(keys::AGONES_PDB)
        .await
        .unwrap();
    let spec = pdb.spec.unwrap();
    assert_eq!(
        spec.max_unavailable,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String("0%".into()))
    );
    assert_eq!(
        spec.selector
            .unwrap()
            .match_labels
            .unwrap()
            .get(keys::SAFE_TO_EVICT_LABEL)
            .map(String::as_str),
        Some("false")
    );

    c.create_fleet(FleetSpec::new("arena", 1).grace_seconds(0))
        .unwrap();
    let gs = c.wait_ready(NS, "arena", 1).await.unwrap().remove(0);
    let pods: Api<Pod> = Api::namespaced(c.client_without_retry("test").await.unwrap(), NS);
    let res = pods.evict(&gs.name, &EvictParams::default()).await;
    match res {
        Err(kube::Error::Api(s)) => {
            assert_eq!(
                (s.code, s.reason.as_str()),
                (429, "TooManyRequests"),
                "{s:?}"
            );
        }
        other => panic!("eviction must be refused, got {other:?}"),
    }
    let pod = c.pod(NS, &gs.name).expect("the pod stays");
    assert!(pod.pointer("/metadata/deletionTimestamp").is_none());
    let evictions = c
        .emulator()
        .journal()
        .filter(|e| e.subresource.as_deref() == Some("eviction"));
    assert_eq!(evictions.len(), 1, "{evictions:?}");
    assert_eq!(evictions[0].status, 429);
    c.wait_stable(lastcall_testkit::cluster::DEFAULT_WAIT)
        .await
        .unwrap();
    assert_eq!(state_of(&c, NS, &gs.name), Some(GameServerState::Ready));
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicting_a_safe_gameserver_pod_makes_it_unhealthy_and_the_fleet_replaces_it() {
    let c = cluster(&["n1"]).await;
    let log = record_states(&c);
    c.create_fleet(
        FleetSpec::new("arena", 1)
            .eviction_safe(EvictionSafe::Always)
            .grace_seconds(1),
    )
    .unwrap();
    let gs = c.wait_ready(NS, "arena", 1).await.unwrap().remove(0);
    let pod_uid = uid(&c.pod(NS, &gs.name).unwrap());

    let pods: Api<Pod> = Api::namespaced(c.client(), NS);
    pods.evict(&gs.name, &EvictParams::default()).await.unwrap();
    let pod = c
        .pod(NS, &gs.name)
        .expect("terminating, not gone yet (1 s grace)");
    assert!(pod.pointer("/metadata/deletionTimestamp").is_some());
    assert_eq!(
        pod.pointer("/metadata/deletionGracePeriodSeconds"),
        Some(&Value::from(1))
    );

    let c = &c;
    let name = gs.name.as_str();
    let pod_uid = pod_uid.as_str();
    wait_for("the evicted pod to be gone", || async move {
        c.pod(NS, name)
            .filter(|p| uid(p) == pod_uid)
            .is_none()
            .then_some(())
    })
    .await;
    let new = replacement(c, "arena", name).await;
    wait_for("the old server to be gone", || async move {
        c.game_server(NS, name).is_none().then_some(())
    })
    .await;
    // A pod deleted under a live GameServer makes it Unhealthy.
    let seen = seen_until(&log, name, GameServerState::Unhealthy).await;
    assert_eq!(
        seen.last(),
        Some(&Some(GameServerState::Unhealthy)),
        "{seen:?}"
    );
    assert!(
        seen.contains(&Some(GameServerState::Unhealthy)),
        "a pod deleted under a live GameServer makes it Unhealthy: {seen:?}"
    );
    assert_ne!(new.name, gs.name);
    let new_pod = c.pod(NS, &new.name).unwrap();
    assert_eq!(label(&new_pod, keys::SAFE_TO_EVICT_LABEL), Some("true"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_pdb_eviction_deletes_the_pod() {
    // Namespace "open" is not a game-server namespace of this cluster: no Agones PDB there.
    let c = cluster(&["n1"]).await;
    let pdbs = Api::<PodDisruptionBudget>::namespaced(c.client(), "open");
    assert_eq!(api_code(pdbs.get(keys::AGONES_PDB).await), 404);
    c.create_fleet(
        FleetSpec::new("arena", 1)
            .namespace("open")
            .grace_seconds(0),
    )
    .unwrap();
    let gs = wait_for("a Ready server in namespace open", || {
        let c = &c;
        async move {
            c.fleet_game_servers("open", "arena")
                .into_iter()
                .find(|g| g.state == Some(GameServerState::Ready))
        }
    })
    .await;
    let pod = c.pod("open", &gs.name).unwrap();
    assert_eq!(
        label(&pod, keys::SAFE_TO_EVICT_LABEL),
        Some("false"),
        "default Never"
    );
    let pods: Api<Pod> = Api::namespaced(c.client(), "open");
    pods.evict(&gs.name, &EvictParams::default()).await.unwrap();
    let c = &c;
    let name = gs.name.as_str();
    let old_uid = uid(&pod);
    let old_uid = old_uid.as_str();
    wait_for("the pod to be gone", || async move {
        c.pod("open", name)
            .filter(|p| uid(p) == old_uid)
            .is_none()
            .then_some(())
    })
    .await;
    wait_for("the server to go Unhealthy or away", || async move {
        match c.game_server("open", name) {
            None => Some(()),
            Some(g) if g.state == Some(GameServerState::Unhealthy) || g.deleting => Some(()),
            Some(_) => None,
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_safe_maps_to_pod_label_annotation_and_status() {
    let c = cluster(&["n1"]).await;
    let cases = [
        ("never", None, "false", "false", EvictionSafe::Never),
        (
            "upgrade",
            Some(EvictionSafe::OnUpgrade),
            "false",
            "true",
            EvictionSafe::OnUpgrade,
        ),
        (
            "always",
            Some(EvictionSafe::Always),
            "true",
            "true",
            EvictionSafe::Always,
        ),
    ];
    for (fleet, safe, _, _, _) in &cases {
        let mut f = FleetSpec::new(*fleet, 1);
        if let Some(s) = safe {
            f = f.eviction_safe(*s);
        }
        c.create_fleet(f).unwrap();
    }
    // A template that already says "safe to evict" forces Always and keeps its own label.
    c.create_fleet(
        FleetSpec::new("user", 1)
            .pod_annotation(keys::CA_SAFE_TO_EVICT, "true")
            .pod_label(keys::SAFE_TO_EVICT_LABEL, "custom"),
    )
    .unwrap();
    for (fleet, _, annotation_value, label_value, status) in cases {
        let gs = c.wait_ready(NS, fleet, 1).await.unwrap().remove(0);
        let pod = c.pod(NS, &gs.name).unwrap();
        assert_eq!(
            annotation(&pod, keys::CA_SAFE_TO_EVICT),
            Some(annotation_value),
            "{fleet}"
        );
        assert_eq!(
            label(&pod, keys::SAFE_TO_EVICT_LABEL),
            Some(label_value),
            "{fleet}"
        );
        assert_eq!(gs.eviction_status, Some(status), "{fleet}");
        assert_eq!(
            gs.eviction_spec,
            Some(status),
            "{fleet}: the default is written to the spec"
        );
        // The pod is the GameServer's: same name, Agones labels, controller ownerRef.
        assert_eq!(label(&pod, keys::ROLE_LABEL), Some("gameserver"));
        assert_eq!(label(&pod, keys::GAMESERVER_LABEL), Some(gs.name.as_str()));
        assert_eq!(
            pod.pointer("/metadata/ownerReferences/0/kind"),
            Some(&Value::from("GameServer"))
        );
        assert_eq!(
            pod.pointer("/metadata/ownerReferences/0/uid"),
            Some(&Value::from(gs.uid.clone()))
        );
        assert_eq!(
            pod.pointer("/metadata/ownerReferences/0/controller"),
            Some(&Value::from(true))
        );
        assert!(
            gs.finalizers
                .iter()
                .any(|f| f == keys::GAMESERVER_FINALIZER)
        );
        assert_eq!(gs.node.as_deref(), Some("n1"));
    }
    let gs = c.wait_ready(NS, "user", 1).await.unwrap().remove(0);
    let pod = c.pod(NS, &gs.name).unwrap();
    assert_eq!(gs.eviction_status, Some(EvictionSafe::Always));
    assert_eq!(annotation(&pod, keys::CA_SAFE_TO_EVICT), Some("true"));
    assert_eq!(
        label(&pod, keys::SAFE_TO_EVICT_LABEL),
        Some("custom"),
        "only set when missing"
    );
    c.shutdown().await;
}

// ---- scheduler and taint manager ------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scheduler_honours_cordon_taints_and_node_selector() {
    let c = Cluster::start(ClusterConfig::default()).await.unwrap();
    c.add_node(NodeSpec::new("cordoned").cordoned()).unwrap();
    c.add_node(NodeSpec::new("dedicated").label("pool", "game").taint(
        "dedicated",
        "game",
        "NoSchedule",
    ))
    .unwrap();
    c.add_node(NodeSpec::new("general").label("pool", "general"))
        .unwrap();

    c.create_fleet(FleetSpec::new("plain", 2)).unwrap();
    c.create_fleet(
        FleetSpec::new("tolerant", 2)
            .toleration(toleration_equal("dedicated", "game", "NoSchedule"))
            .node_selector("pool", "game"),
    )
    .unwrap();
    c.create_fleet(
        FleetSpec::new("wrong-value", 1)
            .toleration(toleration_equal("dedicated", "other", ""))
            .node_selector("pool", "game"),
    )
    .unwrap();
    c.create_fleet(FleetSpec::new("picky", 1).node_selector("pool", "special"))
        .unwrap();

    for gs in c.wait_ready(NS, "plain", 2).await.unwrap() {
        assert_eq!(
            gs.node.as_deref(),
            Some("general"),
            "no cordoned or tainted node"
        );
    }
    for gs in c.wait_ready(NS, "tolerant", 2).await.unwrap() {
        assert_eq!(
            gs.node.as_deref(),
            Some("dedicated"),
            "tolerated taint, selected pool"
        );
    }
    c.wait_stable(lastcall_testkit::cluster::DEFAULT_WAIT)
        .await
        .unwrap();
    assert!(c.pods_on("cordoned").is_empty());
    for fleet in ["wrong-value", "picky"] {
        let gs = c.fleet_game_servers(NS, fleet).remove(0);
        assert_eq!(
            gs.state,
            Some(GameServerState::Starting),
            "{fleet} is not scheduled"
        );
        assert_eq!(gs.node, None);
        let pod = c.pod(NS, &gs.name).unwrap();
        assert_eq!(node_of(&pod), None);
        assert_eq!(pod.pointer("/status/phase"), Some(&Value::from("Pending")));
        let cond = pod
            .pointer("/status/conditions")
            .and_then(Value::as_array)
            .and_then(|cs| cs.iter().find(|c| c["type"] == "PodScheduled"))
            .cloned()
            .unwrap();
        assert_eq!(cond["status"], "False");
        assert_eq!(cond["reason"], "Unschedulable");
        assert!(
            cond["message"]
                .as_str()
                .unwrap()
                .starts_with("0/3 nodes are available"),
            "{cond}"
        );
    }

    // A node that fits arrives: the pending pod is bound there. Uncordoning makes the
    // cordoned node usable for new pods too.
    c.add_node(NodeSpec::new("special").label("pool", "special"))
        .unwrap();
    let picky = c.wait_ready(NS, "picky", 1).await.unwrap().remove(0);
    assert_eq!(picky.node.as_deref(), Some("special"));
    c.set_unschedulable("cordoned", false).unwrap();
    c.scale_fleet(NS, "plain", 4).unwrap();
    let plain = c.wait_ready(NS, "plain", 4).await.unwrap();
    assert!(
        plain.iter().any(|g| g.node.as_deref() == Some("cordoned")),
        "the uncordoned node takes new pods (fewest pods first): {plain:?}"
    );
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn taint_manager_evicts_untolerating_pods_and_honours_toleration_seconds() {
    let c = cluster(&["n1"]).await;
    c.create_fleet(FleetSpec::new("plain", 1).grace_seconds(0))
        .unwrap();
    c.create_fleet(
        FleetSpec::new("timed", 1)
            .grace_seconds(0)
            .toleration(for_seconds(toleration_exists("drain", "NoExecute"), 3)),
    )
    .unwrap();
    c.create_fleet(
        FleetSpec::new("forever", 1)
            .grace_seconds(0)
            .toleration(toleration_exists("", "")),
    )
    .unwrap();
    let plain = c.wait_ready(NS, "plain", 1).await.unwrap().remove(0);
    let timed = c.wait_ready(NS, "timed", 1).await.unwrap().remove(0);
    let forever = c.wait_ready(NS, "forever", 1).await.unwrap().remove(0);
    let uid_of = |name: &str| uid(&c.pod(NS, name).unwrap());
    let (plain_pod, timed_pod, forever_pod) = (
        uid_of(&plain.name),
        uid_of(&timed.name),
        uid_of(&forever.name),
    );

    c.add_taint("n1", taint("drain", "true", "NoExecute"))
        .unwrap();
    let c = &c;
    let gone = |name: String, pod_uid: String| async move {
        c.pod(NS, &name)
            .filter(|p| uid(p) == pod_uid)
            .is_none()
            .then_some(())
    };
    wait_for("the untolerating pod to be deleted", || {
        gone(plain.name.clone(), plain_pod.clone())
    })
    .await;
    let timed_now = c
        .pod(NS, &timed.name)
        .expect("a 3 s toleration keeps the pod for now");
    assert!(timed_now.pointer("/metadata/deletionTimestamp").is_none());
    wait_for(
        "the timed pod to be deleted after tolerationSeconds",
        || gone(timed.name.clone(), timed_pod.clone()),
    )
    .await;
    let stays = c
        .pod(NS, &forever.name)
        .expect("a toleration without seconds keeps the pod");
    assert_eq!(uid(&stays), forever_pod);
    assert!(stays.pointer("/metadata/deletionTimestamp").is_none());
    assert_eq!(state_of(c, NS, &forever.name), Some(GameServerState::Ready));

    // The evicted server's replacement cannot run on the tainted node; a clean node takes it.
    c.add_node(NodeSpec::new("n2")).unwrap();
    let replaced = replacement(c, "plain", &plain.name).await;
    assert_eq!(replaced.node.as_deref(), Some("n2"));
}

// ---- Fleet replacement and GameServer deletion ------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_ready_gameserver_with_preconditions_brings_a_replacement_elsewhere() {
    let c = cluster(&["n1", "n2"]).await;
    c.create_fleet(FleetSpec::new("arena", 2).grace_seconds(1))
        .unwrap();
    let ready = c.wait_ready(NS, "arena", 2).await.unwrap();
    let victim = ready
        .iter()
        .find(|g| g.node.as_deref() == Some("n1"))
        .unwrap()
        .clone();
    c.set_unschedulable("n1", true).unwrap();
    let api = gs_api(&c, NS);

    // A stale resourceVersion: 409, and the server stays.
    let stale = DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some(victim.uid.clone()),
            resource_version: Some("1".into()),
        }),
        ..Default::default()
    };
    assert_eq!(api_code(api.delete(&victim.name, &stale).await), 409);
    let kept = c.game_server(NS, &victim.name).unwrap();
    assert!(!kept.deleting);
    assert_eq!(kept.resource_version, victim.resource_version);

    let guarded = DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some(victim.uid.clone()),
            resource_version: Some(victim.resource_version.clone()),
        }),
        ..Default::default()
    };
    api.delete(&victim.name, &guarded).await.unwrap();
    let deleting = c
        .game_server(NS, &victim.name)
        .expect("held by the Agones finalizer");
    assert!(deleting.deleting);
    assert_eq!(
        deleting.state,
        Some(GameServerState::Ready),
        "state unchanged on delete (agones#3159)"
    );

    let new = replacement(&c, "arena", &victim.name).await;
    assert_eq!(
        new.node.as_deref(),
        Some("n2"),
        "the cordoned node gets no replacement"
    );
    let c = &c;
    let name = victim.name.as_str();
    wait_for("the deleted server to be gone", || async move {
        c.game_server(NS, name).is_none().then_some(())
    })
    .await;
    assert!(c.pod(NS, name).is_none());
    assert_eq!(c.fleet_game_servers(NS, "arena").len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gameserver_delete_keeps_state_until_its_pod_is_gone() {
    let c = cluster(&["n1"]).await;
    // A long grace period: only the game's exit can end the pod within the test.
    c.create_game_server(GameServerSpec::new("solo").grace_seconds(600))
        .unwrap();
    let c = &c;
    wait_for("solo to be Ready", || async move {
        (state_of(c, NS, "solo") == Some(GameServerState::Ready)).then_some(())
    })
    .await;
    gs_api(c, NS)
        .delete("solo", &DeleteParams::default())
        .await
        .unwrap();
    let pod = wait_for("the controller to delete the pod", || async move {
        c.pod(NS, "solo")
            .filter(|p| p.pointer("/metadata/deletionTimestamp").is_some())
    })
    .await;
    assert_eq!(
        pod.pointer("/metadata/deletionGracePeriodSeconds"),
        Some(&Value::from(600))
    );
    let gs = c
        .game_server(NS, "solo")
        .expect("the finalizer holds the server while its pod terminates");
    assert!(gs.deleting);
    assert_eq!(
        gs.state,
        Some(GameServerState::Ready),
        "agones#3159: still Ready"
    );
    assert!(
        gs.finalizers
            .iter()
            .any(|f| f == keys::GAMESERVER_FINALIZER)
    );

    c.game_exit(NS, "solo").unwrap();
    wait_for("pod and server to be gone", || async move {
        (c.pod(NS, "solo").is_none() && c.game_server(NS, "solo").is_none()).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_shutdown_of_an_allocated_server_removes_it_and_the_fleet_replaces_it() {
    let c = cluster(&["n1", "n2"]).await;
    // Without the game's exit the pod would take 600 s: Shutdown must end it at once.
    c.create_fleet(FleetSpec::new("arena", 2).grace_seconds(600))
        .unwrap();
    c.wait_ready(NS, "arena", 2).await.unwrap();
    let won = c
        .allocate(&AllocationRequest::fleet(NS, "arena").label("match", "m1"))
        .await
        .unwrap()
        .expect("a Ready server");
    assert_eq!(won.state, Some(GameServerState::Allocated));
    assert_eq!(won.labels.get("match").map(String::as_str), Some("m1"));

    c.sdk_shutdown(NS, &won.name).unwrap();
    let c = &c;
    let name = won.name.as_str();
    wait_for("the shut-down server and its pod to be gone", || async move {
        (c.game_server(NS, name).is_none() && c.pod(NS, name).is_none()).then_some(())
    })
    .await;
    let st = wait_for("the fleet back to 2 Ready", || async move {
        c.fleet_status(NS, "arena")
            .filter(|s| s.ready_replicas == 2 && s.replicas == 2)
    })
    .await;
    assert_eq!(st.allocated_replicas, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_pod_of_an_allocated_server_makes_it_unhealthy() {
    let c = cluster(&["n1"]).await;
    let log = record_states(&c);
    c.create_fleet(FleetSpec::new("arena", 1).grace_seconds(0))
        .unwrap();
    c.wait_ready(NS, "arena", 1).await.unwrap();
    let won = c
        .allocate(&AllocationRequest::fleet(NS, "arena"))
        .await
        .unwrap()
        .unwrap();
    Api::<Pod>::namespaced(c.client(), NS)
        .delete(&won.name, &DeleteParams::default())
        .await
        .unwrap();
    let new = replacement(&c, "arena", &won.name).await;
    assert_ne!(new.name, won.name);
    let seen = seen_until(&log, &won.name, GameServerState::Unhealthy).await;
    let allocated_at = seen
        .iter()
        .position(|s| *s == Some(GameServerState::Allocated))
        .unwrap();
    assert_eq!(
        seen.get(allocated_at + 1),
        Some(&Some(GameServerState::Unhealthy)),
        "Allocated → Unhealthy when its pod goes: {seen:?}"
    );
}

// ---- lifecycle, status and scaling ------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manual_sdk_ready_and_state_sequence() {
    let c = cluster(&["n1"]).await;
    let log = record_states(&c);
    c.create_game_server(GameServerSpec::new("manual").manual_ready())
        .unwrap();
    c.wait_stable(lastcall_testkit::cluster::DEFAULT_WAIT)
        .await
        .unwrap();
    let gs = c.game_server(NS, "manual").unwrap();
    assert_eq!(
        gs.state,
        Some(GameServerState::Scheduled),
        "waits for the game's Ready()"
    );
    assert_eq!(gs.node.as_deref(), Some("n1"));
    assert!(matches!(
        c.reserve(NS, "nope"),
        Err(lastcall_testkit::cluster::ClusterError::Api { .. })
    ));
    c.sdk_ready(NS, "manual").unwrap();
    let c = &c;
    wait_for("manual to be Ready", || async move {
        (state_of(c, NS, "manual") == Some(GameServerState::Ready)).then_some(())
    })
    .await;
    c.reserve(NS, "manual").unwrap();
    assert_eq!(state_of(c, NS, "manual"), Some(GameServerState::Reserved));
    assert!(
        c.allocate(&AllocationRequest::new(NS))
            .await
            .unwrap()
            .is_none(),
        "a Reserved server is not allocatable"
    );
    c.sdk_allocate(NS, "manual").unwrap();
    assert!(matches!(
        c.reserve(NS, "manual"),
        Err(lastcall_testkit::cluster::ClusterError::InvalidState { .. })
    ));
    use GameServerState as S;
    let log = &log;
    let seen = wait_for("the recorder to see Allocated", || async move {
        let seen = states_seen(log, "manual");
        (seen.last() == Some(&Some(S::Allocated))).then_some(seen)
    })
    .await;
    assert_eq!(
        seen,
        vec![
            None,
            Some(S::Creating),
            Some(S::Starting),
            Some(S::Scheduled),
            Some(S::RequestReady),
            Some(S::Ready),
            Some(S::Reserved),
            Some(S::Allocated)
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_scales_down_around_allocated_servers_and_reports_status() {
    let c = cluster(&["n1", "n2"]).await;
    c.create_fleet(FleetSpec::new("arena", 3).grace_seconds(0))
        .unwrap();
    c.wait_ready(NS, "arena", 3).await.unwrap();
    let won = c
        .allocate(&AllocationRequest::fleet(NS, "arena").on_node("n2"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(won.node.as_deref(), Some("n2"));
    let c = &c;
    let st = wait_for("status 2 Ready + 1 Allocated", || async move {
        c.fleet_status(NS, "arena")
            .filter(|s| s.ready_replicas == 2 && s.allocated_replicas == 1)
    })
    .await;
    assert_eq!(st.replicas, 3);

    c.scale_fleet(NS, "arena", 1).unwrap();
    let left = wait_for("only the Allocated server to remain", || async move {
        let all = c.fleet_game_servers(NS, "arena");
        (all.len() == 1).then_some(all)
    })
    .await;
    assert_eq!(
        left[0].name, won.name,
        "scale-down never removes an Allocated server"
    );
    let st = wait_for("status 1 Allocated", || async move {
        c.fleet_status(NS, "arena").filter(|s| s.replicas == 1)
    })
    .await;
    assert_eq!((st.ready_replicas, st.allocated_replicas), (0, 1));

    c.scale_fleet(NS, "arena", 3).unwrap();
    let ready = c.wait_ready(NS, "arena", 2).await.unwrap();
    assert_eq!(ready.len(), 2);
    let labels: BTreeMap<String, String> = ready[0].labels.clone();
    assert_eq!(
        labels.get(keys::FLEET_LABEL).map(String::as_str),
        Some("arena")
    );
    assert!(labels.contains_key(keys::GAMESERVERSET_LABEL));
}

fn taint_keys(node: &Value) -> Vec<(String, String)> {
    node.pointer("/spec/taints")
        .and_then(Value::as_array)
        .map(|ts| {
            ts.iter()
                .map(|t| {
                    (
                        t["key"].as_str().unwrap_or_default().to_string(),
                        t["effect"].as_str().unwrap_or_default().to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

fn rv(obj: &Value) -> u64 {
    obj.pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        .unwrap()
        .parse()
        .unwrap()
}

const UNSCHEDULABLE: &str = "node.kubernetes.io/unschedulable";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cordon_gets_the_unschedulable_taint_and_a_new_resource_version() {
    use k8s_openapi::api::core::v1::Node;
    use kube::api::{Patch, PatchParams};
    let c = cluster(&["n1"]).await;
    c.wait_stable(lastcall_testkit::cluster::DEFAULT_WAIT)
        .await
        .unwrap();
    // Cordon over HTTP, as kubectl (or lastcall) does; keep the resourceVersion we got.
    let nodes: Api<Node> = Api::all(c.client());
    let cordoned = nodes
        .patch(
            "n1",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"unschedulable": true}})),
        )
        .await
        .unwrap();
    let cordon_rv: u64 = cordoned
        .metadata
        .resource_version
        .as_deref()
        .unwrap()
        .parse()
        .unwrap();
    let tainted = wait_for("the node lifecycle taint", || async {
        c.node("n1").filter(|n| {
            taint_keys(n).contains(&(UNSCHEDULABLE.to_string(), "NoSchedule".to_string()))
        })
    })
    .await;
    assert!(rv(&tainted) > cordon_rv, "the taint is a write of its own");
    // A write guarded by the cordon's resourceVersion now loses, as on a real cluster.
    let mut stale = cordoned.clone();
    stale
        .metadata
        .labels
        .get_or_insert_default()
        .insert("x".into(), "1".into());
    let code = api_code(nodes.replace("n1", &Default::default(), &stale).await);
    assert_eq!(code, 409);
    // Uncordon: the taint goes, with another new resourceVersion.
    // Read before the uncordon: the controller may remove the taint at once.
    let before = rv(&c.node("n1").unwrap());
    c.set_unschedulable("n1", false).unwrap();
    let untainted = wait_for("the taint to be removed", || async {
        c.node("n1").filter(|n| taint_keys(n).is_empty())
    })
    .await;
    assert!(
        rv(&untainted) >= before + 2,
        "the uncordon and the taint's removal are two writes"
    );
    c.shutdown().await;

    // Off by configuration: a cordon stays a bare spec field.
    let off = cluster_with(
        &["n1"],
        ClusterConfig {
            node_lifecycle_taints: false,
            ..ClusterConfig::default()
        },
    )
    .await;
    off.set_unschedulable("n1", true).unwrap();
    off.wait_stable(lastcall_testkit::cluster::DEFAULT_WAIT)
        .await
        .unwrap();
    assert!(taint_keys(&off.node("n1").unwrap()).is_empty());
    off.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_tolerating_unschedulable_or_everything_land_on_cordoned_nodes() {
    let c = Cluster::start(ClusterConfig::default()).await.unwrap();
    c.add_node(NodeSpec::new("only").cordoned().taint(
        "lastcall.dev/draining",
        "true",
        "NoSchedule",
    ))
    .unwrap();
    // A blanket `operator: Exists` toleration tolerates the cordon and every taint.
    c.create_fleet(FleetSpec::new("blanket", 1).toleration(toleration_exists("", "")))
        .unwrap();
    // Tolerating the unschedulable taint is not enough while another taint is untolerated.
    c.create_fleet(
        FleetSpec::new("daemonish", 1).toleration(toleration_exists(UNSCHEDULABLE, "NoSchedule")),
    )
    .unwrap();
    c.create_fleet(FleetSpec::new("plain", 1)).unwrap();
    let blanket = c.wait_ready(NS, "blanket", 1).await.unwrap().remove(0);
    assert_eq!(blanket.node.as_deref(), Some("only"));
    c.wait_stable(lastcall_testkit::cluster::DEFAULT_WAIT)
        .await
        .unwrap();
    for fleet in ["daemonish", "plain"] {
        let gs = c.fleet_game_servers(NS, fleet).remove(0);
        assert_eq!(gs.node, None, "{fleet} stays pending");
        let pod = c.pod(NS, &gs.name).unwrap();
        let msg = pod
            .pointer("/status/conditions")
            .and_then(Value::as_array)
            .and_then(|cs| cs.iter().find(|c| c["type"] == "PodScheduled"))
            .and_then(|c| c["message"].as_str())
            .unwrap_or_default()
            .to_string();
        let expected = if fleet == "plain" {
            "0/1 nodes are available: 1 node(s) were unschedulable."
        } else {
            "0/1 nodes are available: 1 node(s) had untolerated taint(s)."
        };
        assert_eq!(msg, expected, "{fleet}");
    }
    // Once the other taint goes, the pod tolerating the cordon is scheduled there too.
    c.remove_taint("only", "lastcall.dev/draining", "").unwrap();
    let daemonish = c.wait_ready(NS, "daemonish", 1).await.unwrap().remove(0);
    assert_eq!(daemonish.node.as_deref(), Some("only"));
    assert!(c.fleet_game_servers(NS, "plain")[0].node.is_none());
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controllers_write_status_through_status() {
    let c = cluster(&["n1"]).await;
    c.create_fleet(FleetSpec::new("arena", 2)).unwrap();
    let ready = c.wait_ready(NS, "arena", 2).await.unwrap();
    // The pods' running status and the Fleet's counters were written through /status
    // (a main-resource write would have been dropped); the binding set the node.
    let pod = c.pod(NS, &ready[0].name).unwrap();
    assert_eq!(pod["status"]["phase"], "Running");
    assert_eq!(node_of(&pod), Some("n1"));
    wait_for("fleet status", || async {
        (c.fleet_status(NS, "arena").map(|s| s.ready_replicas) == Some(2)).then_some(())
    })
    .await;
    // New pods carry the DefaultTolerationSeconds tolerations.
    let tols = pod["spec"]["tolerations"].as_array().unwrap();
    assert!(
        tols.iter()
            .any(|t| t["key"] == "node.kubernetes.io/not-ready" && t["tolerationSeconds"] == 300)
    );
    // A node readiness flip goes through /status and the node keeps its spec.
    c.set_unschedulable("n1", true).unwrap();
    c.set_node_ready("n1", false).unwrap();
    let node = c.node("n1").unwrap();
    assert_eq!(node["spec"]["unschedulable"], true);
    let ready_cond = node["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Ready")
        .cloned()
        .unwrap();
    assert_eq!(ready_cond["status"], "False");
    c.shutdown().await;
}
