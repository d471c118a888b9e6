//! Table tests for the drain rules, plus an idempotence check: applying a plan to the
//! observed state and planning again must produce nothing new.

use k8s_openapi::api::core::v1::Toleration;

use super::*;
use crate::notice::{Cause, Severity};
use crate::observed::{GsState, NodeView, PodView};
use crate::progress::{Recorded, format_precise, format_ts};
use crate::sources::{NodeSignalConfig, fleetiq, node as node_signals};

/// The notices plus what the Node signals say, as the notice board gives them.
fn board(obs: &Observed, notices: &[Notice]) -> Vec<Notice> {
    let cfg = NodeSignalConfig {
        maintenance_lead: Duration::from_secs(3600),
        drain_on_foreign_cordon: false,
    };
    let mut all = notices.to_vec();
    all.extend(node_signals::manual(&obs.node, &cfg, now()));
    all
}

fn now() -> Timestamp {
    "2026-11-30T05:00:00Z".parse().unwrap()
}

fn cfg() -> PolicyConfig {
    PolicyConfig {
        compat_taints: false,
        deregister: true,
        default_deadline: Duration::from_secs(600),
        deregister_settle: Duration::ZERO,
        hand_back: false,
        eviction: Default::default(),
        cooperation: Default::default(),
        pacing: Default::default(),
        claim_unseen: true,
    }
}

fn node() -> NodeView {
    NodeView {
        name: "n1".into(),
        resource_version: "100".into(),
        unschedulable: false,
        taints: vec![taint("agones.dev/gameservers", "true", "NoExecute")],
        labels: BTreeMap::new(),
        annotations: BTreeMap::new(),
        boot_id: None,
        ready_since: None,
    }
}

fn gs(name: &str, state: GsState) -> GameServerView {
    let mut labels = BTreeMap::new();
    labels.insert(keys::LABEL_NODE.to_string(), "n1".to_string());
    GameServerView {
        namespace: "default".into(),
        name: name.into(),
        uid: format!("uid-{name}"),
        resource_version: "10".into(),
        state,
        deleting: false,
        node_name: Some("n1".into()),
        labels,
        annotations: BTreeMap::new(),
        eviction_safe: crate::eviction::EvictionSafe::Never,
        template_annotations: Default::default(),
    }
}

fn pod_for(g: &GameServerView) -> PodView {
    PodView {
        namespace: g.namespace.clone(),
        name: g.name.clone(),
        uid: format!("pod-{}", g.uid),
        resource_version: "20".into(),
        gameserver: Some(g.name.clone()),
        annotations: BTreeMap::new(),
        tolerations: vec![],
        deleting: false,
        deletion_timestamp: None,
        termination_grace: crate::observed::DEFAULT_TERMINATION_GRACE,
        finished: false,
    }
}

fn observed(gss: Vec<GameServerView>) -> Observed {
    let pods = gss.iter().map(pod_for).collect();
    Observed {
        node: node(),
        game_servers: gss,
        pods,
        fleets: BTreeMap::new(),
    }
}

fn mixed() -> Observed {
    observed(vec![
        gs("r1", GsState::Ready),
        gs("r2", GsState::Ready),
        gs("r3", GsState::Ready),
        gs("a1", GsState::Allocated),
        gs("a2", GsState::Allocated),
        gs("s1", GsState::Reserved),
    ])
}

fn draining() -> Notice {
    Notice {
        source: fleetiq::SOURCE,
        id: "i-1:DRAINING".into(),
        cause: Cause::Viability,
        severity: Severity::Drain,
        deadline: None,
        cancellable: true,
        cordon: true,
        can_start_early: false,
        estimated_deadline: false,
        restated: false,
        detail: String::new(),
    }
}

fn run(obs: &Observed, notices: &[Notice], config: &PolicyConfig) -> Plan {
    plan(&Inputs {
        notices: &board(obs, notices),
        observed: obs,
        config,
        unknown_sources: &[],
        fleetiq_deregistered: false,
        now: now(),
    })
}

fn gs_mut<'a>(o: &'a mut Observed, name: &str) -> &'a mut GameServerView {
    o.game_servers.iter_mut().find(|g| g.name == name).unwrap()
}

/// Every write gives an object a new resourceVersion, as the API server does.
fn bump(g: &mut GameServerView) {
    let rv: u64 = g.resource_version.parse().unwrap();
    g.resource_version = (rv + 1).to_string();
}

/// Applies a plan the way the reconciler would, to a copy of the observed state.
fn simulate(obs: &Observed, actions: &[Action]) -> Observed {
    let mut o = obs.clone();
    let mut rv: u64 = o.node.resource_version.parse().unwrap();
    for a in actions {
        match a {
            Action::PatchNode(p) => {
                assert_eq!(
                    p.resource_version, o.node.resource_version,
                    "patch must be guarded by the observed RV"
                );
                if let Some(u) = p.unschedulable {
                    o.node.unschedulable = u;
                }
                if let Some(t) = &p.taints {
                    o.node.taints = t.clone();
                }
                o.node.annotations.extend(p.set_annotations.clone());
                o.node.labels.extend(p.set_labels.clone());
                for k in &p.remove_annotations {
                    o.node.annotations.remove(k);
                }
                for k in &p.remove_labels {
                    o.node.labels.remove(k);
                }
                rv += 1;
                o.node.resource_version = rv.to_string();
            }
            Action::ClaimGameServer { .. } => {}
            Action::Release { gs, .. } => {
                let g = gs_mut(&mut o, &gs.name);
                assert_eq!(
                    (&g.uid, &g.resource_version),
                    (&gs.uid, &gs.resource_version),
                    "delete preconditions must still match: an earlier action of the same plan changed {}",
                    g.name
                );
                assert!(
                    g.state == GsState::Ready || g.state.is_before_ready(),
                    "only servers that are not in use may be released, not {:?}",
                    g.state
                );
                // Deleted: the server and, after its grace period, its pod are gone.
                let name = g.name.clone();
                o.game_servers.retain(|g| g.name != name);
                o.pods
                    .retain(|p| p.gameserver.as_deref() != Some(name.as_str()));
            }
            Action::Protect {
                gs,
                deadline,
                reason,
            } => {
                let g = gs_mut(&mut o, &gs.name);
                bump(g);
                g.labels
                    .insert(keys::LABEL_NODE_DRAINING.into(), "true".into());
                g.annotations
                    .insert(keys::ANN_GS_DEADLINE.into(), deadline.clone());
                g.annotations
                    .insert(keys::ANN_GS_REASON.into(), reason.clone());
            }
            Action::Exclude { gs } => {
                let g = gs_mut(&mut o, &gs.name);
                assert_eq!(g.state, GsState::Ready, "only held Ready servers");
                bump(g);
                g.labels
                    .insert(keys::LABEL_NODE_DRAINING.into(), "true".into());
            }
            Action::Unprotect { gs } => {
                let g = gs_mut(&mut o, &gs.name);
                bump(g);
                g.labels.remove(keys::LABEL_NODE_DRAINING);
                g.annotations.remove(keys::ANN_GS_DEADLINE);
                g.annotations.remove(keys::ANN_GS_REASON);
            }
            Action::Tolerate { pod, .. } => {
                let p = o.pods.iter_mut().find(|p| &p.name == pod).unwrap();
                p.tolerations.push(compat_toleration());
            }
            Action::AnnotatePod { pod, changes, .. } => {
                let p = o.pods.iter_mut().find(|p| &p.name == pod).unwrap();
                for (k, v) in changes {
                    match v {
                        Some(v) => p.annotations.insert(k.clone(), v.clone()),
                        None => p.annotations.remove(k),
                    };
                }
            }
            Action::EndGracefully { pod, uid, .. } => {
                let p = o.pods.iter_mut().find(|p| &p.name == pod).unwrap();
                assert_eq!(&p.uid, uid, "preconditioned on the pod's uid");
                p.deleting = true;
                p.deletion_timestamp = Some(now());
            }
            Action::Deregister => {
                o.node
                    .annotations
                    .insert(keys::ANN_DEREGISTERED.into(), format_ts(now()));
            }
        }
    }
    o
}

/// Plans and applies until nothing is left to do; returns the final state and every action.
fn converge(
    obs: &Observed,
    notices: &[Notice],
    config: &PolicyConfig,
) -> (Observed, Vec<Action>, Phase) {
    let mut o = obs.clone();
    let mut all = vec![];
    for _ in 0..6 {
        let p = run(&o, notices, config);
        if p.actions.is_empty() {
            return (o, all, p.phase);
        }
        o = simulate(&o, &p.actions);
        all.extend(p.actions);
    }
    panic!("policy did not converge: {all:#?}");
}

fn count(actions: &[Action], label: &str) -> usize {
    actions.iter().filter(|a| a.metric_label() == label).count()
}

#[test]
fn idle_node_needs_nothing() {
    let p = run(&mixed(), &[], &cfg());
    assert_eq!(p.phase, Phase::Idle);
    assert!(p.actions.is_empty(), "{:?}", p.actions);
}

#[test]
fn observe_only_notices_do_not_drain() {
    let mut n = draining();
    n.severity = Severity::Observe;
    let p = run(&mixed(), &[n], &cfg());
    assert_eq!(p.phase, Phase::Idle);
    assert!(p.actions.is_empty());
}

#[test]
fn unlabelled_gameserver_pods_are_claimed() {
    let mut o = mixed();
    o.game_servers.retain(|g| g.name != "a1");
    let p = run(&o, &[], &cfg());
    assert_eq!(
        p.actions,
        vec![Action::ClaimGameServer {
            namespace: "default".into(),
            name: "a1".into()
        }]
    );
    // Selected by status.nodeName, a server is seen once Agones names its node: no claim.
    let by_field = PolicyConfig {
        claim_unseen: false,
        ..cfg()
    };
    assert!(run(&o, &[], &by_field).actions.is_empty());
}

#[test]
fn draining_fences_first_then_releases_ready_and_protects_in_use() {
    let p = run(&mixed(), &[draining()], &cfg());
    assert_eq!(p.phase, Phase::Fencing);
    let Action::PatchNode(fence) = &p.actions[0] else {
        panic!("fence must come first: {:?}", p.actions)
    };
    assert_eq!(fence.unschedulable, Some(true));
    assert_eq!(
        fence
            .set_annotations
            .get(keys::ANN_CORDONED)
            .map(String::as_str),
        Some("true")
    );
    assert_eq!(
        fence
            .set_annotations
            .get(keys::ANN_CAUSE)
            .map(String::as_str),
        Some("viability")
    );
    assert_eq!(
        fence.set_annotations.get(keys::ANN_STARTED),
        Some(&format_precise(now()))
    );
    let taints = fence.taints.as_ref().unwrap();
    assert!(
        taints.iter().any(|t| t.key == "agones.dev/gameservers"),
        "foreign taint kept"
    );
    let ours = taints
        .iter()
        .find(|t| t.key == keys::TAINT_DRAINING)
        .unwrap();
    assert_eq!(
        (ours.value.as_deref(), ours.effect.as_str()),
        (Some("fleetiq"), "NoSchedule")
    );

    let released: Vec<_> = p
        .actions
        .iter()
        .filter_map(|a| match a {
            Action::Release { gs } => Some(gs.name.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(released, ["r1", "r2", "r3"]);
    let Some(Action::Release { gs, .. }) = p
        .actions
        .iter()
        .find(|a| matches!(a, Action::Release { .. }))
    else {
        unreachable!()
    };
    assert_eq!(
        (gs.uid.as_str(), gs.resource_version.as_str()),
        ("uid-r1", "10"),
        "delete preconditions"
    );
    let protected: BTreeSet<_> = p
        .actions
        .iter()
        .filter_map(|a| match a {
            Action::Protect {
                gs,
                deadline,
                reason,
            } => {
                assert_eq!(deadline, "2026-11-30T05:10:00Z");
                assert_eq!(reason, "viability");
                Some(gs.name.as_str())
            }
            _ => None,
        })
        .collect();
    assert_eq!(protected, BTreeSet::from(["a1", "a2", "s1"]));
    assert_eq!(count(&p.actions, "deregister"), 0, "in-use servers remain");
}

#[test]
fn drain_converges_and_second_pass_is_empty() {
    let (o, _, phase) = converge(&mixed(), &[draining()], &cfg());
    assert_eq!(phase, Phase::Draining);
    assert!(o.node.unschedulable && o.node.has_taint(keys::TAINT_DRAINING));
    // The games end: in-use servers go away. Now the node is empty and deregisters once.
    let mut o2 = o.clone();
    o2.game_servers.retain(|g| !g.state.is_in_use());
    let left: BTreeSet<String> = o2.game_servers.iter().map(|g| g.name.clone()).collect();
    o2.pods.retain(|p| left.contains(&p.name));
    let (o3, acts, phase) = converge(&o2, &[draining()], &cfg());
    assert_eq!(count(&acts, "deregister"), 1);
    assert_eq!(phase, Phase::Deregistered);
    assert!(o3.node.annotations.contains_key(keys::ANN_DEREGISTERED));
}

#[test]
fn deregistration_happens_once_even_if_the_notice_clears() {
    let mut o = observed(vec![]);
    o.node
        .annotations
        .insert(keys::ANN_STARTED.into(), format_ts(now()));
    o.node
        .annotations
        .insert(keys::ANN_DEREGISTERED.into(), format_ts(now()));
    o.node.unschedulable = true;
    o.node
        .taints
        .push(taint(keys::TAINT_DRAINING, "fleetiq", "NoSchedule"));
    for notices in [vec![draining()], vec![]] {
        let p = run(&o, &notices, &cfg());
        assert_eq!(p.phase, Phase::Deregistered);
        assert!(p.actions.is_empty(), "{:?}", p.actions);
    }
}

#[test]
fn no_fleetiq_means_no_deregistration() {
    let c = PolicyConfig {
        deregister: false,
        ..cfg()
    };
    let (_, acts, phase) = converge(&observed(vec![]), &[draining()], &c);
    assert_eq!(phase, Phase::Empty);
    assert_eq!(count(&acts, "deregister"), 0);
}

#[test]
fn deleting_and_terminal_servers_are_left_alone_and_unknown_states_are_protected() {
    let mut r = gs("r1", GsState::Ready);
    r.deleting = true;
    let o = observed(vec![
        r,
        gs("u1", GsState::Unhealthy),
        gs("x1", GsState::Unknown("Teleporting".into())),
    ]);
    let (_, acts, phase) = converge(&o, &[draining()], &cfg());
    assert_eq!(count(&acts, "release"), 0);
    assert_eq!(count(&acts, "protect"), 1, "unknown state counts as in use");
    assert_eq!(phase, Phase::Draining);
}

#[test]
fn servers_stuck_before_ready_are_released_so_the_node_can_empty() {
    for state in [
        GsState::Scheduled,
        GsState::RequestReady,
        GsState::Starting,
        GsState::Creating,
        GsState::PortAllocation,
        GsState::Empty,
    ] {
        let o = observed(vec![gs("c1", state.clone())]);
        let p = run(&o, &[draining()], &cfg());
        assert!(
            p.actions.iter().any(|a| matches!(a, Action::Release { gs } if gs.name == "c1" && gs.resource_version == "10")),
            "{state:?}: {:?}",
            p.actions
        );
        let (_, acts, phase) = converge(&o, &[draining()], &cfg());
        assert_eq!(phase, Phase::Deregistered, "{state:?}");
        assert_eq!(count(&acts, "deregister"), 1);
    }
}

#[test]
fn node_cordoned_by_someone_else_stays_cordoned_after_cancel() {
    let mut o = mixed();
    o.node.unschedulable = true;
    let (drained, acts, _) = converge(&o, &[draining()], &cfg());
    let fence = acts
        .iter()
        .find_map(|a| match a {
            Action::PatchNode(p) => Some(p),
            _ => None,
        })
        .unwrap();
    assert_eq!(fence.unschedulable, None);
    assert!(!fence.set_annotations.contains_key(keys::ANN_CORDONED));

    let (after, _, phase) = converge(&drained, &[], &cfg());
    assert_eq!(phase, Phase::Idle);
    assert!(
        after.node.unschedulable,
        "foreign cordon must survive the cancel"
    );
    assert!(!after.node.has_taint(keys::TAINT_DRAINING));
}

#[test]
fn cancel_undoes_exactly_what_lastcall_did() {
    let (drained, _, _) = converge(&mixed(), &[draining()], &cfg());
    let mut with_foreign = drained.clone();
    with_foreign
        .node
        .taints
        .push(taint("example.com/maintenance", "x", "NoSchedule"));
    let p = run(&with_foreign, &[], &cfg());
    assert_eq!(p.phase, Phase::Cancelling);
    let (after, _, phase) = converge(&with_foreign, &[], &cfg());
    assert_eq!(phase, Phase::Idle);
    assert!(
        !after.node.unschedulable,
        "we cordoned it, so we uncordon it"
    );
    let keys_left: Vec<_> = after.node.taints.iter().map(|t| t.key.as_str()).collect();
    assert_eq!(
        keys_left,
        ["agones.dev/gameservers", "example.com/maintenance"]
    );
    assert!(
        after.node.annotations.is_empty(),
        "{:?}",
        after.node.annotations
    );
    for g in after.game_servers.iter().filter(|g| !g.deleting) {
        assert!(
            !g.labels.contains_key(keys::LABEL_NODE_DRAINING),
            "{}",
            g.name
        );
        assert!(
            !g.annotations.contains_key(keys::ANN_GS_DEADLINE),
            "{}",
            g.name
        );
    }
}

#[test]
fn drain_cancel_drain_fences_again() {
    let (d1, _, _) = converge(&mixed(), &[draining()], &cfg());
    let (c, _, _) = converge(&d1, &[], &cfg());
    let p = run(&c, &[draining()], &cfg());
    assert_eq!(p.phase, Phase::Fencing);
    assert!(matches!(&p.actions[0], Action::PatchNode(f) if f.unschedulable == Some(true)));
}

#[test]
fn manual_label_drains_with_manual_cause() {
    let mut o = mixed();
    o.node
        .labels
        .insert(keys::LABEL_MANUAL_DRAIN.into(), "true".into());
    let p = run(&o, &[], &cfg());
    assert_eq!(p.driver.as_ref().map(|d| d.cause), Some(Cause::Manual));
    let Action::PatchNode(f) = &p.actions[0] else {
        panic!()
    };
    assert_eq!(
        f.set_annotations.get(keys::ANN_CAUSE).map(String::as_str),
        Some("manual")
    );
    o.node
        .labels
        .insert(keys::LABEL_MANUAL_DRAIN.into(), "nope".into());
    assert_eq!(run(&o, &[], &cfg()).phase, Phase::Idle);
}

#[test]
fn terminate_deadline_is_announced_to_players() {
    let mut n = draining();
    n.severity = Severity::Terminate;
    n.cause = Cause::Preemption;
    n.cancellable = false;
    n.deadline = Some("2026-11-30T05:02:00Z".parse().unwrap());
    let p = run(&mixed(), &[draining(), n], &cfg());
    let deadlines: BTreeSet<_> = p
        .actions
        .iter()
        .filter_map(|a| match a {
            Action::Protect {
                deadline, reason, ..
            } => Some((deadline.as_str(), reason.as_str())),
            _ => None,
        })
        .collect();
    assert_eq!(
        deadlines,
        BTreeSet::from([("2026-11-30T05:02:00Z", "preemption")])
    );
}

#[test]
fn compat_mode_tolerates_in_use_pods_before_the_noexecute_taint() {
    let c = PolicyConfig {
        compat_taints: true,
        ..cfg()
    };
    let p = run(&mixed(), &[draining()], &c);
    assert_eq!(count(&p.actions, "tolerate"), 3);
    let patches = p
        .actions
        .iter()
        .filter(|a| matches!(a, Action::PatchNode(_)))
        .count();
    assert_eq!(
        patches, 1,
        "no NoExecute taint while fencing or while Ready servers remain"
    );

    let (o, acts, _) = converge(&mixed(), &[draining()], &c);
    let t = o
        .node
        .taints
        .iter()
        .find(|t| t.key == keys::COMPAT_TAINT_DRAINING)
        .unwrap();
    assert_eq!(
        (t.value.as_deref(), t.effect.as_str()),
        (Some("true"), "NoExecute")
    );
    let tol_idx = acts
        .iter()
        .rposition(|a| matches!(a, Action::Tolerate { .. }))
        .unwrap();
    let taint_idx = acts
        .iter()
        .position(|a| matches!(a, Action::PatchNode(p) if p.taints.as_ref().is_some_and(|t| t.iter().any(|t| t.key == keys::COMPAT_TAINT_DRAINING))))
        .unwrap();
    assert!(tol_idx < taint_idx, "tolerations must precede the taint");
}

#[test]
fn compat_mode_adds_active_taint_once_registered() {
    let c = PolicyConfig {
        compat_taints: true,
        ..cfg()
    };
    let mut o = observed(vec![]);
    assert!(
        run(&o, &[], &c).actions.is_empty(),
        "not before registration"
    );
    o.node
        .annotations
        .insert(keys::ANN_REGISTERED.into(), format_ts(now()));
    let (after, _, phase) = converge(&o, &[], &c);
    assert_eq!(phase, Phase::Idle);
    let t = after
        .node
        .taints
        .iter()
        .find(|t| t.key == keys::COMPAT_TAINT_ACTIVE)
        .unwrap();
    assert_eq!(
        (t.value.as_deref(), t.effect.as_str()),
        (Some("true"), "NoExecute")
    );
}

#[test]
fn every_state_mix_converges_without_releasing_in_use_servers() {
    let states = [
        GsState::Ready,
        GsState::Allocated,
        GsState::Reserved,
        GsState::Scheduled,
        GsState::Shutdown,
    ];
    for mask in 0..(states.len() * states.len() * states.len()) {
        let mut m = mask;
        let gss: Vec<_> = (0..3)
            .map(|i| {
                let s = states[m % states.len()].clone();
                m /= states.len();
                gs(&format!("g{i}"), s)
            })
            .collect();
        let o = observed(gss);
        for config in [
            cfg(),
            PolicyConfig {
                compat_taints: true,
                ..cfg()
            },
        ] {
            // `simulate` asserts that only Ready servers are released.
            let (drained, _, _) = converge(&o, &[draining()], &config);
            let (_, _, phase) = converge(&drained, &[], &config);
            assert!(
                matches!(phase, Phase::Idle | Phase::Deregistered),
                "mask {mask}: {phase:?}"
            );
        }
    }
}

#[test]
fn a_drain_is_held_not_cancelled_while_its_source_is_unknown() {
    let (drained, _, _) = converge(&mixed(), &[draining()], &cfg());
    // A restarted agent: the Node says draining, FleetIQ has not reported yet.
    let held = plan(&Inputs {
        notices: &[],
        observed: &drained,
        config: &cfg(),
        unknown_sources: &[fleetiq::SOURCE],
        fleetiq_deregistered: false,
        now: now(),
    });
    assert_eq!(held.phase, Phase::Draining);
    assert!(held.actions.is_empty(), "{:?}", held.actions);
    // Once FleetIQ says ACTIVE (no notice, source known), the drain is cancelled.
    assert_eq!(run(&drained, &[], &cfg()).phase, Phase::Cancelling);
    // A manual drain whose label is gone is cancelled even while FleetIQ is unknown.
    let mut manual = mixed();
    manual
        .node
        .labels
        .insert(keys::LABEL_MANUAL_DRAIN.into(), "true".into());
    let (mut m, _, _) = converge(&manual, &[], &cfg());
    m.node.labels.remove(keys::LABEL_MANUAL_DRAIN);
    let p = plan(&Inputs {
        notices: &[],
        observed: &m,
        config: &cfg(),
        unknown_sources: &[fleetiq::SOURCE],
        fleetiq_deregistered: false,
        now: now(),
    });
    assert_eq!(p.phase, Phase::Cancelling);
}

#[test]
fn releases_come_right_after_the_fence_in_one_batch() {
    let p = run(&mixed(), &[draining()], &cfg());
    let labels: Vec<&str> = p.actions.iter().map(Action::metric_label).collect();
    assert_eq!(
        &labels[..4],
        ["patch_node", "release", "release", "release"],
        "{labels:?}"
    );
    assert!(labels[4..].iter().all(|l| *l != "release"), "{labels:?}");
}

#[test]
fn a_server_whose_gameserver_is_not_seen_yet_keeps_the_node_busy() {
    // a1's pod runs here but its GameServer is not in the (label-filtered) view yet, e.g.
    // its claim failed once. It may host a match: no deregistration, no NoExecute taint.
    let (mut o, _, _) = converge(
        &observed(vec![gs("a1", GsState::Allocated)]),
        &[draining()],
        &cfg(),
    );
    o.game_servers.clear();
    // By field, the same server is one Agones has not given `status.nodeName` yet (or its
    // controller is down): just as busy, and nothing to claim.
    for (config, claims) in [
        (cfg(), 1),
        (
            PolicyConfig {
                compat_taints: true,
                ..cfg()
            },
            1,
        ),
        (
            PolicyConfig {
                claim_unseen: false,
                ..cfg()
            },
            0,
        ),
        (
            PolicyConfig {
                compat_taints: true,
                claim_unseen: false,
                ..cfg()
            },
            0,
        ),
    ] {
        let p = run(&o, &[draining()], &config);
        assert_eq!(p.phase, Phase::Draining, "{:?}", p.actions);
        assert_eq!(count(&p.actions, "deregister"), 0, "{:?}", p.actions);
        assert_eq!(count(&p.actions, "claim_gameserver"), claims);
        assert!(
            !p.actions.iter().any(|a| matches!(a, Action::PatchNode(n) if n.taints.as_ref().is_some_and(|t| t.iter().any(|t| t.key == keys::COMPAT_TAINT_DRAINING)))),
            "{:?}",
            p.actions
        );
    }
}

#[test]
fn a_garbled_start_time_never_announces_a_deadline_in_the_past() {
    let mut o = mixed();
    o.node
        .annotations
        .insert(keys::ANN_STARTED.into(), "garbage".into());
    let p = run(&o, &[draining()], &cfg());
    for a in &p.actions {
        if let Action::Protect { deadline, .. } = a {
            assert_eq!(deadline, "2026-11-30T05:10:00Z");
        }
    }
    assert!(count(&p.actions, "protect") > 0);
}

fn spot(deadline: &str) -> Notice {
    Notice {
        source: fleetiq::SOURCE,
        id: "i-1:SPOT_TERMINATING".into(),
        cause: Cause::Preemption,
        severity: Severity::Terminate,
        deadline: Some(deadline.parse().unwrap()),
        cancellable: false,
        cordon: true,
        can_start_early: false,
        estimated_deadline: false,
        restated: false,
        detail: String::new(),
    }
}

fn protected_deadlines(o: &Observed) -> BTreeSet<String> {
    o.game_servers
        .iter()
        .filter_map(|g| g.annotations.get(keys::ANN_GS_DEADLINE).cloned())
        .collect()
}

#[test]
fn a_spot_drain_survives_a_restart_and_a_later_active_with_its_deadline() {
    let (drained, _, _) = converge(&mixed(), &[spot("2026-11-30T05:02:00Z")], &cfg());
    let rec = Progress::from_annotations(&drained.node.annotations).record;
    let Recorded::Valid(r) = rec else {
        panic!("the driving notice is recorded on the Node: {rec:?}")
    };
    assert!(
        r.entries
            .iter()
            .any(|e| !e.cancellable && e.severity == Severity::Terminate)
    );
    // A restarted agent hears ACTIVE (a lagging replica), or a re-anchored Spot deadline.
    for notices in [vec![], vec![spot("2026-11-30T05:07:00Z")]] {
        let (after, acts, phase) = converge(&drained, &notices, &cfg());
        assert_eq!(phase, Phase::Draining, "{notices:?}");
        assert!(after.node.unschedulable && after.node.has_taint(keys::TAINT_DRAINING));
        assert!(
            !acts.iter().any(|a| matches!(a, Action::Unprotect { .. })),
            "{acts:?}"
        );
        assert_eq!(
            protected_deadlines(&after),
            BTreeSet::from(["2026-11-30T05:02:00Z".to_string()]),
            "the deadline does not move"
        );
    }
}

#[test]
fn a_restart_holds_only_for_the_drains_own_source() {
    let (drained, _, _) = converge(&mixed(), &[draining()], &cfg());
    let hold = |unknown: &[Source]| {
        plan(&Inputs {
            notices: &[],
            observed: &drained,
            config: &cfg(),
            unknown_sources: unknown,
            fleetiq_deregistered: false,
            now: now(),
        })
        .phase
    };
    assert_eq!(hold(&[fleetiq::SOURCE]), Phase::Draining);
    // Another source being unknown does not hold a FleetIQ drain that FleetIQ withdrew.
    assert_eq!(hold(&[node_signals::MANUAL]), Phase::Cancelling);
    assert_eq!(hold(&[]), Phase::Cancelling);
}

/// A drained node on which a Fleet with a blanket toleration has put a new Ready server.
fn with_newcomer(mut o: Observed) -> Observed {
    let g = gs("late", GsState::Ready);
    o.pods.push(pod_for(&g));
    o.game_servers.push(g);
    o
}

#[test]
fn a_fenced_node_releases_idle_servers_during_a_hold_and_after_deregistration() {
    let (drained, _, _) = converge(&mixed(), &[draining()], &cfg());
    let held = plan(&Inputs {
        notices: &[],
        observed: &with_newcomer(drained.clone()),
        config: &cfg(),
        unknown_sources: &[fleetiq::SOURCE],
        fleetiq_deregistered: false,
        now: now(),
    });
    assert_eq!(held.phase, Phase::Draining);
    assert!(
        held.actions
            .iter()
            .any(|a| matches!(a, Action::Release { gs } if gs.name == "late")),
        "{:?}",
        held.actions
    );
    assert!(
        !held
            .actions
            .iter()
            .any(|a| matches!(a, Action::PatchNode(_) | Action::Deregister)),
        "a hold changes nothing else: {:?}",
        held.actions
    );

    let mut gone = drained.clone();
    gone.game_servers.clear();
    gone.pods.clear();
    let (deregistered, _, phase) = converge(&gone, &[draining()], &cfg());
    assert_eq!(phase, Phase::Deregistered);
    for notices in [vec![draining()], vec![]] {
        let p = run(&with_newcomer(deregistered.clone()), &notices, &cfg());
        assert_eq!(p.phase, Phase::Deregistered);
        assert_eq!(count(&p.actions, "release"), 1, "{:?}", p.actions);
        assert_eq!(count(&p.actions, "deregister"), 0);
    }
}

#[test]
fn a_terminating_game_server_pod_keeps_the_node_busy() {
    let (mut o, _, _) = converge(&mixed(), &[draining()], &cfg());
    // The matches ended: their GameServers are gone, one pod is still in its grace period.
    o.game_servers.clear();
    o.pods.truncate(1);
    o.pods[0].deleting = true;
    let p = run(&o, &[draining()], &cfg());
    assert_eq!(p.phase, Phase::Draining);
    assert_eq!(count(&p.actions, "deregister"), 0);
    o.pods.clear();
    assert_eq!(
        count(&run(&o, &[draining()], &cfg()).actions, "deregister"),
        1
    );
}

#[test]
fn an_empty_node_is_deregistered_only_after_the_fence_has_settled() {
    let c = PolicyConfig {
        deregister_settle: Duration::from_secs(5),
        ..cfg()
    };
    let (fenced, _, _) = converge(&observed(vec![]), &[draining()], &cfg_no_deregister());
    let at = |secs: i64| {
        now()
            .checked_add(jiff::SignedDuration::from_secs(secs))
            .unwrap()
    };
    let early = plan(&Inputs {
        notices: &[draining()],
        observed: &fenced,
        config: &c,
        unknown_sources: &[],
        fleetiq_deregistered: false,
        now: at(2),
    });
    assert_eq!(count(&early.actions, "deregister"), 0);
    assert_eq!(
        early.wake_at,
        Some(at(5)),
        "wakes when the settle period ends"
    );
    let later = plan(&Inputs {
        notices: &[draining()],
        observed: &fenced,
        config: &c,
        unknown_sources: &[],
        fleetiq_deregistered: false,
        now: at(5),
    });
    assert_eq!(count(&later.actions, "deregister"), 1);
}

fn cfg_no_deregister() -> PolicyConfig {
    PolicyConfig {
        deregister: false,
        ..cfg()
    }
}

#[test]
fn compat_active_taint_waits_until_every_game_pod_tolerates_it() {
    let c = PolicyConfig {
        compat_taints: true,
        ..cfg()
    };
    let mut o = observed(vec![gs("a1", GsState::Allocated)]);
    o.node
        .annotations
        .insert(keys::ANN_REGISTERED.into(), format_ts(now()));
    let p = run(&o, &[], &c);
    assert!(p.actions.is_empty(), "{:?}", p.actions);
    assert_eq!(p.warnings.len(), 1);
    assert_eq!(p.warnings[0].reason, "CompatTaintSkipped");
    assert!(
        p.warnings[0].note.contains("default/a1"),
        "{}",
        p.warnings[0].note
    );
    // A blanket toleration (as Agones' own system pods carry) is enough.
    o.pods[0].tolerations.push(Toleration {
        operator: Some("Exists".into()),
        ..Default::default()
    });
    let p = run(&o, &[], &c);
    assert!(p.warnings.is_empty());
    assert_eq!(count(&p.actions, "patch_node"), 1);
}

#[test]
fn cancel_keeps_a_compat_draining_taint_lastcall_did_not_add() {
    let c = PolicyConfig {
        compat_taints: true,
        ..cfg()
    };
    let mut o = mixed();
    o.node
        .taints
        .push(taint(keys::COMPAT_TAINT_DRAINING, "true", "NoExecute"));
    let (drained, _, _) = converge(&o, &[draining()], &c);
    let (after, _, _) = converge(&drained, &[], &c);
    assert!(
        after.node.has_taint(keys::COMPAT_TAINT_DRAINING),
        "not ours: kept"
    );
    // One lastcall added is removed.
    let (drained, _, _) = converge(
        &observed(vec![gs("a1", GsState::Allocated)]),
        &[draining()],
        &c,
    );
    assert!(drained.node.has_taint(keys::COMPAT_TAINT_DRAINING));
    let (after, _, _) = converge(&drained, &[], &c);
    assert!(
        !after.node.has_taint(keys::COMPAT_TAINT_DRAINING),
        "ours: removed"
    );
}

#[test]
fn toleration_matching_follows_kubernetes() {
    let t = taint("k", "v", "NoExecute");
    let tol = |key: Option<&str>,
               op: &str,
               value: Option<&str>,
               effect: Option<&str>,
               secs: Option<i64>| Toleration {
        key: key.map(Into::into),
        operator: Some(op.into()),
        value: value.map(Into::into),
        effect: effect.map(Into::into),
        toleration_seconds: secs,
    };
    assert!(tolerates(
        &[tol(Some("k"), "Equal", Some("v"), Some("NoExecute"), None)],
        &t
    ));
    assert!(tolerates(&[tol(Some("k"), "Exists", None, None, None)], &t));
    assert!(tolerates(&[tol(None, "Exists", None, None, None)], &t));
    assert!(!tolerates(
        &[tol(Some("k"), "Equal", Some("w"), None, None)],
        &t
    ));
    assert!(!tolerates(
        &[tol(Some("k"), "Exists", None, Some("NoSchedule"), None)],
        &t
    ));
    assert!(
        !tolerates(&[tol(Some("k"), "Exists", None, None, Some(300))], &t),
        "evicted later"
    );
    assert!(!tolerates(&[], &t));
}

#[test]
fn a_signal_whose_source_keeps_pods_off_gets_the_game_server_work_without_a_cordon() {
    let mut k = draining();
    k.source = node_signals::KARPENTER;
    k.cause = Cause::ScaleDown;
    k.cordon = false;
    let (o, acts, _) = converge(&mixed(), std::slice::from_ref(&k), &cfg());
    assert!(
        !o.node.unschedulable,
        "no cordon on top of Karpenter's taint"
    );
    assert!(o.node.has_taint(keys::TAINT_DRAINING));
    assert_eq!(count(&acts, "release"), 3);
    assert_eq!(count(&acts, "protect"), 3);
    // Karpenter gives up: everything lastcall did is undone, and nothing is uncordoned.
    let (after, _, phase) = converge(&o, &[], &cfg());
    assert_eq!(phase, Phase::Idle);
    assert!(!after.node.has_taint(keys::TAINT_DRAINING) && after.node.annotations.is_empty());
}

#[test]
fn an_empty_node_is_handed_back_to_gke_once_and_only_when_asked() {
    let mut m = draining();
    m.source = crate::sources::gce_metadata::SOURCE;
    m.cause = Cause::Maintenance;
    m.deadline = Some("2026-11-30T09:00:00Z".parse().unwrap());
    m.can_start_early = true;
    let on = PolicyConfig {
        hand_back: true,
        deregister: false,
        ..cfg()
    };
    let (o, acts, _) = converge(&mixed(), std::slice::from_ref(&m), &on);
    assert!(
        !acts
            .iter()
            .any(|a| matches!(a, Action::PatchNode(p) if !p.set_labels.is_empty())),
        "not while game servers remain"
    );
    let mut empty = o.clone();
    empty.game_servers.clear();
    empty.pods.clear();
    let (done, acts, _) = converge(&empty, std::slice::from_ref(&m), &on);
    let handed: Vec<_> = acts
        .iter()
        .filter(|a| matches!(a, Action::PatchNode(p) if p.set_labels.get(keys::LABEL_GKE_PERFORM_MAINTENANCE).map(String::as_str) == Some("true")))
        .collect();
    assert_eq!(handed.len(), 1, "{acts:?}");
    assert!(done.node.annotations.contains_key(keys::ANN_HANDED_BACK));
    // Off by default; and not when the maintenance cannot start early.
    let off = PolicyConfig {
        deregister: false,
        ..cfg()
    };
    let (_, acts, _) = converge(&empty, std::slice::from_ref(&m), &off);
    assert!(
        !acts
            .iter()
            .any(|a| matches!(a, Action::PatchNode(p) if !p.set_labels.is_empty()))
    );
    m.can_start_early = false;
    let (_, acts, _) = converge(&empty, std::slice::from_ref(&m), &on);
    assert!(
        !acts
            .iter()
            .any(|a| matches!(a, Action::PatchNode(p) if !p.set_labels.is_empty()))
    );
}

#[test]
fn node_events_come_with_the_steps_that_cause_them() {
    let events = |acts: &[Action]| -> Vec<NodeEvent> {
        acts.iter()
            .filter_map(|a| match a {
                Action::PatchNode(p) => Some(p.events.clone()),
                _ => None,
            })
            .flatten()
            .collect()
    };
    let (drained, acts, _) = converge(&mixed(), &[draining()], &cfg());
    assert_eq!(
        events(&acts),
        [NodeEvent::DrainStarted, NodeEvent::NodeFenced],
        "once each, with the fence"
    );
    let (_, acts, _) = converge(&drained, &[], &cfg());
    assert_eq!(events(&acts), [NodeEvent::DrainCancelled]);
}

fn terminate_at(cause: Cause, deadline: Timestamp) -> Notice {
    Notice::new(
        fleetiq::SOURCE,
        cause,
        Severity::Terminate,
        Some(deadline),
        false,
        String::new(),
    )
}

/// Applies plans until nothing is left to do (the fence, then the game-server work).
fn settle(mut o: Observed, notices: &[Notice], config: &PolicyConfig) -> (Observed, Plan) {
    for _ in 0..5 {
        let p = run(&o, notices, config);
        if p.actions.is_empty() {
            return (o, p);
        }
        o = simulate(&o, &p.actions);
    }
    panic!("did not settle");
}

#[test]
fn a_terminate_deadline_ends_permitted_matches_at_deadline_minus_grace_and_warns_for_the_rest() {
    let grace = crate::observed::DEFAULT_TERMINATION_GRACE.as_secs() as i64;
    let mut always = gs("always", GsState::Allocated);
    always.eviction_safe = crate::eviction::EvictionSafe::Always;
    let never = gs("never", GsState::Allocated);
    let o = observed(vec![always, never]);

    // Far from the deadline: both protected, nothing ended yet, a wake-up at deadline − grace.
    let deadline = now() + jiff::SignedDuration::from_secs(600);
    let notice = terminate_at(Cause::Maintenance, deadline);
    let (o, p) = settle(o, std::slice::from_ref(&notice), &cfg());
    assert!(o.pods.iter().all(|p| !p.deleting), "nothing ended early");
    assert_eq!(
        p.wake_at,
        Some(deadline - jiff::SignedDuration::from_secs(grace))
    );
    assert_eq!(p.at_risk, 1, "Never cannot be ended: at risk");
    assert!(p.warnings.iter().any(|w| w.reason == "MatchesAtRisk"));

    // Within the grace period of the deadline: the permitted one gets SIGTERM, after its
    // deadline annotation; the Never one is still never touched.
    let deadline = now() + jiff::SignedDuration::from_secs(grace - 5);
    let notice = terminate_at(Cause::Maintenance, deadline);
    let p = run(&o, std::slice::from_ref(&notice), &cfg());
    let ended: Vec<&str> = p
        .actions
        .iter()
        .filter_map(|a| match a {
            Action::EndGracefully { pod, .. } => Some(pod.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(ended, ["always"]);
    let protect_at = p
        .actions
        .iter()
        .position(|a| matches!(a, Action::Protect { gs, .. } if gs.name == "always"));
    let end_at = p
        .actions
        .iter()
        .position(|a| matches!(a, Action::EndGracefully { .. }));
    assert!(protect_at < end_at, "{:?}", p.actions);

    // OnUpgrade does not permit an autoscaler's scale-down, Never permits nothing; the
    // operator's switch ends both gracefully.
    let mut on_upgrade = gs("upgrade", GsState::Allocated);
    on_upgrade.eviction_safe = crate::eviction::EvictionSafe::OnUpgrade;
    let o = observed(vec![on_upgrade, gs("never", GsState::Allocated)]);
    let soon = terminate_at(Cause::ScaleDown, deadline);
    let (o2, p) = settle(o.clone(), std::slice::from_ref(&soon), &cfg());
    assert!(o2.pods.iter().all(|p| !p.deleting), "{:?}", p.actions);
    assert_eq!(p.at_risk, 2);
    let mut opted = cfg();
    opted.eviction.graceful_termination = true;
    let (o3, p) = settle(o, std::slice::from_ref(&soon), &opted);
    assert!(o3.pods.iter().all(|p| p.deleting), "{:?}", p.actions);
    assert_eq!(p.at_risk, 0);
}

#[test]
fn an_unknown_eviction_safe_is_never_ended_early_and_is_reported() {
    let mut weird = gs("weird", GsState::Allocated);
    weird.eviction_safe = crate::eviction::EvictionSafe::Unknown("Sometimes".into());
    let o = observed(vec![weird]);
    let notice = terminate_at(
        Cause::Maintenance,
        now() + jiff::SignedDuration::from_secs(5),
    );
    let (o, p) = settle(o, std::slice::from_ref(&notice), &cfg());
    assert!(o.pods.iter().all(|p| !p.deleting), "treated as Never");
    assert_eq!(p.at_risk, 1);
    assert!(
        p.warnings
            .iter()
            .any(|w| w.reason == "EvictionSafeUnknown" && w.note.contains("Sometimes")),
        "{:?}",
        p.warnings
    );
}

#[test]
fn a_ready_server_whose_pod_is_terminating_is_released_even_without_a_drain() {
    let mut o = observed(vec![
        gs("dying", GsState::Ready),
        gs("fine", GsState::Ready),
    ]);
    o.pods[0].deleting = true;
    o.pods[0].deletion_timestamp = Some(now());
    let p = run(&o, &[], &cfg());
    assert_eq!(p.phase, Phase::Idle);
    let released: Vec<&str> = p
        .actions
        .iter()
        .filter_map(|a| match a {
            Action::Release { gs } => Some(gs.name.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(released, ["dying"]);
    // Once deleted, nothing more.
    let o = simulate(&o, &p.actions);
    assert!(run(&o, &[], &cfg()).actions.is_empty());
}

/// A node whose drain started 10 s ago (past the floor's settle time).
fn fleet_servers(n: usize) -> Observed {
    let mut o = fleet_servers_now(n);
    o.node.annotations.insert(
        keys::ANN_STARTED.into(),
        format_ts(now() - jiff::SignedDuration::from_secs(10)),
    );
    o
}

fn fleet_servers_now(n: usize) -> Observed {
    let mut o = observed(
        (0..n)
            .map(|i| {
                let mut g = gs(&format!("r{i}"), GsState::Ready);
                g.labels.insert(keys::AGONES_FLEET.into(), "f".into());
                g
            })
            .collect(),
    );
    o.node
        .taints
        .push(taint(keys::TAINT_DRAINING, "fleetiq", "NoSchedule"));
    o.node.unschedulable = true;
    o
}

fn released(p: &Plan) -> usize {
    p.actions
        .iter()
        .filter(|a| matches!(a, Action::Release { .. }))
        .count()
}

#[test]
fn pacing_keeps_the_fleet_above_its_floor_and_a_terminate_deadline_overrides_it() {
    let mut c = cfg();
    c.pacing.floor = 4;
    let mut o = fleet_servers(10);
    for g in &mut o.game_servers {
        g.labels
            .insert(keys::LABEL_NODE_DRAINING.into(), "true".into());
    }
    let key = ("default".to_string(), "f".to_string());
    // None Ready elsewhere: 6 of the 10 here may go, 4 stay.
    o.fleets.insert(
        key.clone(),
        crate::observed::FleetFacts {
            ready_elsewhere: Some(0),
            last_release: None,
        },
    );
    assert_eq!(released(&run(&o, &[draining()], &c)), 6);
    // 3 elsewhere: only 1 must stay.
    o.fleets.get_mut(&key).unwrap().ready_elsewhere = Some(3);
    assert_eq!(released(&run(&o, &[draining()], &c)), 9);
    // Unknown: hold, and look again soon.
    o.fleets.get_mut(&key).unwrap().ready_elsewhere = None;
    let p = run(&o, &[draining()], &c);
    assert_eq!(released(&p), 0);
    assert!(p.wake_at.is_some());
    assert!(
        !p.actions.contains(&Action::Deregister) && p.phase != Phase::Empty,
        "held servers keep the node busy"
    );
    // 6 already released (being deleted), none Ready elsewhere yet: the 4 left stay.
    o.fleets.get_mut(&key).unwrap().ready_elsewhere = Some(0);
    for g in o.game_servers.iter_mut().take(6) {
        g.deleting = true;
    }
    assert_eq!(released(&run(&o, &[draining()], &c)), 0);
    // A Terminate deadline: everything at once.
    let spot = terminate_at(
        Cause::Preemption,
        now() + jiff::SignedDuration::from_secs(120),
    );
    assert_eq!(released(&run(&o, std::slice::from_ref(&spot), &c)), 4);
}

#[test]
fn pacing_releases_one_server_per_fleet_per_interval() {
    let mut c = cfg();
    c.pacing.interval = Duration::from_secs(2);
    let mut o = fleet_servers(3);
    let key = ("default".to_string(), "f".to_string());
    assert_eq!(released(&run(&o, &[draining()], &c)), 1);
    c.pacing.batch = 2;
    assert_eq!(released(&run(&o, &[draining()], &c)), 2, "two per interval");
    o.fleets.insert(
        key,
        crate::observed::FleetFacts {
            ready_elsewhere: None,
            last_release: Some(now() - jiff::SignedDuration::from_secs(1)),
        },
    );
    let p = run(&o, &[draining()], &c);
    assert_eq!(released(&p), 0);
    assert_eq!(p.wake_at, Some(now() + jiff::SignedDuration::from_secs(1)));
}

#[test]
fn a_deregistration_fleetiq_knows_of_is_final_even_without_its_record() {
    // Empty: a busy node GameLift forgot is not handed over (see
    // `a_busy_node_gamelift_forgot_is_never_handed_over`).
    let (mut drained, _, _) = converge(&mixed(), &[draining()], &cfg());
    drained.game_servers.clear();
    drained.pods.clear();
    assert!(drained.node.unschedulable);
    let gone = |notices: &[Notice]| {
        plan(&Inputs {
            notices: &board(&drained, notices),
            observed: &drained,
            config: &cfg(),
            unknown_sources: &[],
            fleetiq_deregistered: true,
            now: now(),
        })
    };
    for notices in [vec![], vec![draining()]] {
        let p = gone(&notices);
        assert_eq!(p.phase, Phase::Deregistered);
        assert!(
            p.actions.contains(&Action::Deregister),
            "the record is written"
        );
        assert!(
            !p.actions
                .iter()
                .any(|a| matches!(a, Action::PatchNode(n) if n.unschedulable == Some(false))),
            "never uncordoned: {:?}",
            p.actions
        );
        assert!(
            !p.actions
                .iter()
                .any(|a| matches!(a, Action::Unprotect { .. })),
            "{:?}",
            p.actions
        );
    }
    // With the record written, nothing is left to do.
    let mut recorded = drained.clone();
    recorded
        .node
        .annotations
        .insert(keys::ANN_DEREGISTERED.into(), format_ts(now()));
    let p = plan(&Inputs {
        notices: &[],
        observed: &recorded,
        config: &cfg(),
        unknown_sources: &[],
        fleetiq_deregistered: true,
        now: now(),
    });
    assert_eq!(p.phase, Phase::Deregistered);
    assert!(!p.actions.contains(&Action::Deregister));
}

fn excluded(p: &Plan) -> Vec<String> {
    p.actions
        .iter()
        .filter_map(|a| match a {
            Action::Exclude { gs } => Some(gs.name.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn held_servers_are_labelled_at_once_and_the_hold_is_bounded() {
    let mut c = cfg();
    c.pacing.floor = 4;
    let mut o = fleet_servers(10);
    let key = ("default".to_string(), "f".to_string());
    o.fleets.insert(
        key.clone(),
        crate::observed::FleetFacts {
            ready_elsewhere: Some(0),
            last_release: None,
        },
    );
    // With a floor, every Ready server is marked first, so other draining nodes count it as
    // leaving; none goes before.
    let p = run(&o, &[draining()], &c);
    assert_eq!(released(&p), 0);
    assert_eq!(excluded(&p).len(), 10, "{:#?}", p.actions);
    let o = simulate(&o, &p.actions);
    // Then 6 go and the 4 held already carry the label: nothing more to write for them.
    let p = run(&o, &[draining()], &c);
    assert_eq!(released(&p), 6);
    assert!(excluded(&p).is_empty(), "{:#?}", p.actions);
    let hold_max = jiff::SignedDuration::try_from(c.pacing.hold_max).unwrap();
    assert!(
        p.wake_at.is_some_and(|w| w <= now() + hold_max),
        "wakes for the end of the hold at the latest"
    );
    // A drain that has just started releases nothing for the first 2 s: other nodes
    // draining now have marked theirs by then.
    let mut fresh = simulate(
        &fleet_servers_now(10),
        &run(&fleet_servers_now(10), &[draining()], &c).actions,
    );
    fresh.fleets = o.fleets.clone();
    let p = run(&fresh, &[draining()], &c);
    assert_eq!(released(&p), 0);
    assert_eq!(p.wake_at, Some(now() + jiff::SignedDuration::from_secs(2)));
    // Without a floor, held servers are labelled in the pass that holds them.
    let mut paced = cfg();
    paced.pacing.interval = Duration::from_secs(60);
    let p = run(&fleet_servers(3), &[draining()], &paced);
    assert_eq!((released(&p), excluded(&p).len()), (1, 2));
    let mut o = o;
    // A failed Fleet read holds... but only until `hold_max` after the drain started.
    o.fleets.get_mut(&key).unwrap().ready_elsewhere = None;
    assert_eq!(released(&run(&o, &[draining()], &c)), 0);
    let mut late = o.clone();
    late.node.annotations.insert(
        keys::ANN_STARTED.into(),
        format_ts(now() - hold_max - jiff::SignedDuration::from_secs(1)),
    );
    assert_eq!(released(&run(&late, &[draining()], &c)), 10);
    // A floor the Fleet cannot reach: the same bound.
    late.fleets.get_mut(&key).unwrap().ready_elsewhere = Some(0);
    c.pacing.floor = 1000;
    assert_eq!(released(&run(&late, &[draining()], &c)), 10);
    // The notice's own deadline ends the hold when it comes first.
    let mut due = draining();
    due.deadline = Some(now() - jiff::SignedDuration::from_secs(1));
    assert_eq!(released(&run(&o, &[due], &c)), 10);
    let mut soon = draining();
    soon.deadline = Some(now() + jiff::SignedDuration::from_secs(30));
    let p = run(&o, &[soon], &c);
    assert_eq!(released(&p), 0);
    assert!(
        p.wake_at
            .is_some_and(|w| w <= now() + jiff::SignedDuration::from_secs(30))
    );
}

#[test]
fn a_finished_game_pod_does_not_keep_the_node_busy() {
    let mut o = observed(vec![]);
    let orphan = gs("failed", GsState::Ready);
    let mut pod = pod_for(&orphan);
    pod.finished = true;
    o.pods.push(pod.clone());
    // Fenced, with its fence settled, and nothing but a Failed pod left.
    let (drained, all, phase) = converge(&o, &[draining()], &cfg());
    assert_eq!(phase, Phase::Deregistered, "{all:#?}");
    assert_eq!(count(&all, "deregister"), 1);
    assert_eq!(
        count(&all, "claim_gameserver"),
        0,
        "a finished pod is not claimed"
    );
    assert!(drained.pods.contains(&pod), "the pod is still there");
    // A running one does keep it busy.
    let mut o = observed(vec![]);
    pod.finished = false;
    o.pods.push(pod);
    let p = run(&o, &[draining()], &cfg());
    assert!(!p.actions.contains(&Action::Deregister));
}

/// Plans at `at` with exactly these notices and unknown sources.
fn plan_at(
    o: &Observed,
    notices: &[Notice],
    unknown: &[Source],
    config: &PolicyConfig,
    at: Timestamp,
) -> Plan {
    plan(&Inputs {
        notices,
        observed: o,
        config,
        unknown_sources: unknown,
        fleetiq_deregistered: false,
        now: at,
    })
}

fn ended(p: &Plan) -> Vec<&str> {
    p.actions
        .iter()
        .filter_map(|a| match a {
            Action::EndGracefully { pod, .. } => Some(pod.as_str()),
            _ => None,
        })
        .collect()
}

/// A cancellable Terminate with a time the provider stated (an AWS scheduled event, a
/// GCE window under way).
fn scheduled(source: Source, at: Timestamp) -> Notice {
    Notice::new(
        source,
        Cause::Maintenance,
        Severity::Terminate,
        Some(at),
        true,
        String::new(),
    )
}

/// One OnUpgrade match: ended at a current upgrade-like deadline minus its grace.
fn on_upgrade_match() -> Observed {
    let mut g = gs("match", GsState::Allocated);
    g.eviction_safe = crate::eviction::EvictionSafe::OnUpgrade;
    observed(vec![g])
}

fn secs(s: i64) -> jiff::SignedDuration {
    jiff::SignedDuration::from_secs(s)
}

#[test]
fn an_event_rescheduled_later_ends_no_match_on_its_old_date() {
    let grace = crate::observed::DEFAULT_TERMINATION_GRACE.as_secs() as i64;
    let monday = now() + secs(3600);
    let saturday = now() + secs(5 * 86_400);
    for source in [
        crate::sources::aws_imds::SOURCE,
        crate::sources::gce_metadata::SOURCE,
    ] {
        let (o, _) = settle(on_upgrade_match(), &[scheduled(source, monday)], &cfg());
        // Past Monday's deadline − grace, the provider now says Saturday.
        let at = monday - secs(grace) + secs(1);
        let p = plan_at(&o, &[scheduled(source, saturday)], &[], &cfg(), at);
        assert_eq!(ended(&p), Vec::<&str>::new(), "{source:?}: {:?}", p.actions);
        let o = simulate(&o, &p.actions);
        assert_eq!(
            protected_deadlines(&o),
            BTreeSet::from([format_ts(saturday)]),
            "{source:?}: the game is told the new date"
        );
        // The record follows the source, so the next pass agrees.
        let p = plan_at(&o, &[scheduled(source, saturday)], &[], &cfg(), at);
        assert!(p.actions.is_empty(), "{source:?}: {:?}", p.actions);
        // Saturday's deadline − grace does end it.
        let p = plan_at(
            &o,
            &[scheduled(source, saturday)],
            &[],
            &cfg(),
            saturday - secs(grace),
        );
        assert_eq!(ended(&p), ["match"], "{source:?}");
    }
}

#[test]
fn an_event_cancelled_during_the_hold_after_a_restart_ends_no_match() {
    let grace = crate::observed::DEFAULT_TERMINATION_GRACE.as_secs() as i64;
    let imds = crate::sources::aws_imds::SOURCE;
    let deadline = now() + secs(3600);
    let (o, _) = settle(on_upgrade_match(), &[scheduled(imds, deadline)], &cfg());
    // A restarted agent, IMDS not read yet, past deadline − grace: the event may have been
    // cancelled meanwhile. The drain is held, the deadline still announced, nothing ended.
    let at = deadline - secs(grace) + secs(1);
    let held = plan_at(&o, &[], &[imds], &cfg(), at);
    assert_eq!(held.phase, Phase::Draining);
    assert_eq!(ended(&held), Vec::<&str>::new(), "{:?}", held.actions);
    assert!(held.actions.is_empty(), "{:?}", held.actions);
    assert_eq!(held.at_risk, 1, "unconfirmed: protected and warned");
    assert_eq!(
        protected_deadlines(&o),
        BTreeSet::from([format_ts(deadline)])
    );
    // IMDS answers: cancelled. The drain is undone.
    assert_eq!(plan_at(&o, &[], &[], &cfg(), at).phase, Phase::Cancelling);
    // Or: still on. Now it is current and ends the match.
    assert_eq!(
        ended(&plan_at(&o, &[scheduled(imds, deadline)], &[], &cfg(), at)),
        ["match"]
    );
}

#[test]
fn a_restart_with_two_recorded_sources_holds_while_either_is_unknown() {
    let imds = crate::sources::aws_imds::SOURCE;
    let rebalance = Notice::new(
        imds,
        Cause::Rebalance,
        Severity::Drain,
        None,
        true,
        String::new(),
    );
    // FleetIQ started the drain, IMDS joined it.
    let (o, _, _) = converge(&mixed(), &[draining()], &cfg());
    let (o, _, _) = converge(&o, &[draining(), rebalance.clone()], &cfg());
    let rec = Progress::from_annotations(&o.node.annotations).record;
    let sources: BTreeSet<&str> = rec.entries().iter().map(|e| e.source.as_str()).collect();
    assert_eq!(sources, BTreeSet::from(["aws_imds", "fleetiq"]), "{rec:?}");
    // A restart: FleetIQ says ACTIVE, IMDS has not answered. It may still want the drain.
    let p = plan_at(&o, &[], &[imds], &cfg(), now());
    assert_eq!(p.phase, Phase::Draining, "{:?}", p.actions);
    assert!(p.actions.is_empty(), "{:?}", p.actions);
    // And the other way round.
    let p = plan_at(
        &o,
        std::slice::from_ref(&rebalance),
        &[fleetiq::SOURCE],
        &cfg(),
        now(),
    );
    assert_eq!(p.phase, Phase::Draining, "{:?}", p.actions);
    // Both known, neither asking: cancelled.
    assert_eq!(
        plan_at(&o, &[], &[], &cfg(), now()).phase,
        Phase::Cancelling
    );
    // IMDS withdrew while FleetIQ still drains: it leaves the record, so a later restart
    // does not hold for it.
    let (o, _, _) = converge(&o, &[draining()], &cfg());
    let rec = Progress::from_annotations(&o.node.annotations).record;
    assert_eq!(rec.entries().len(), 1, "{rec:?}");
    assert_eq!(
        plan_at(&o, &[], &[imds], &cfg(), now()).phase,
        Phase::Cancelling
    );
}

#[test]
fn the_announced_deadline_does_not_move_later_when_a_later_event_joins() {
    let imds = crate::sources::aws_imds::SOURCE;
    // FleetIQ DRAINING gives no deadline: drain start + the default (10 min here).
    let (o, _, _) = converge(&mixed(), &[draining()], &cfg());
    let first = BTreeSet::from(["2026-11-30T05:10:00Z".to_string()]);
    assert_eq!(protected_deadlines(&o), first);
    // A scheduled event two hours out joins: the games keep the earlier deadline.
    let later = scheduled(imds, now() + secs(7200));
    let (o, _, _) = converge(&o, &[draining(), later.clone()], &cfg());
    assert_eq!(protected_deadlines(&o), first);
    // After a restart too (the default is counted from the recorded first sight).
    let p = plan_at(
        &o,
        &[draining(), later.clone()],
        &[],
        &cfg(),
        now() + secs(60),
    );
    assert!(p.actions.is_empty(), "{:?}", p.actions);
    // An earlier event moves it earlier.
    let sooner = scheduled(imds, now() + secs(300));
    let (o, _, _) = converge(&o, &[draining(), sooner], &cfg());
    assert_eq!(
        protected_deadlines(&o),
        BTreeSet::from(["2026-11-30T05:05:00Z".to_string()])
    );
}

#[test]
fn the_settle_is_not_shortened_by_a_start_stored_to_the_second() {
    let c = PolicyConfig {
        deregister_settle: Duration::from_secs(5),
        ..cfg()
    };
    let fenced_at = now() + jiff::SignedDuration::from_millis(900);
    let p = plan_at(&observed(vec![]), &[draining()], &[], &c, fenced_at);
    let o = simulate(&observed(vec![]), &p.actions);
    // 4.1 s after the fence: not yet.
    let early = plan_at(&o, &[draining()], &[], &c, now() + secs(5));
    assert_eq!(
        count(&early.actions, "deregister"),
        0,
        "{:?}",
        early.actions
    );
    assert_eq!(early.wake_at, Some(fenced_at + secs(5)));
    let due = plan_at(&o, &[draining()], &[], &c, fenced_at + secs(5));
    assert_eq!(count(&due.actions, "deregister"), 1);

    // A start an older agent stored to the second counts from its ceiling.
    let mut old = o.clone();
    old.node
        .annotations
        .insert(keys::ANN_STARTED.into(), format_ts(fenced_at));
    let p = plan_at(&old, &[draining()], &[], &c, now() + secs(5) + secs(0));
    assert_eq!(count(&p.actions, "deregister"), 0, "{:?}", p.actions);
    let p = plan_at(&old, &[draining()], &[], &c, now() + secs(6));
    assert_eq!(count(&p.actions, "deregister"), 1);
}

#[test]
fn a_garbled_start_never_shortens_the_settle() {
    let c = PolicyConfig {
        deregister_settle: Duration::from_secs(5),
        ..cfg()
    };
    let (mut o, _, _) = converge(&observed(vec![]), &[draining()], &cfg_no_deregister());
    o.node
        .annotations
        .insert(keys::ANN_STARTED.into(), "yesterday-ish".into());
    // Seen now: the start is written anew, nothing is deregistered.
    let p = plan_at(&o, &[draining()], &[], &c, now());
    assert_eq!(count(&p.actions, "deregister"), 0, "{:?}", p.actions);
    let rewritten = p.actions.iter().any(|a| {
        matches!(a, Action::PatchNode(n) if n.set_annotations.get(keys::ANN_STARTED) == Some(&format_precise(now())) && n.events.is_empty())
    });
    assert!(rewritten, "{:?}", p.actions);
    let o = simulate(&o, &p.actions);
    let p = plan_at(&o, &[draining()], &[], &c, now() + secs(4));
    assert_eq!(count(&p.actions, "deregister"), 0, "{:?}", p.actions);
    let p = plan_at(&o, &[draining()], &[], &c, now() + secs(5));
    assert_eq!(count(&p.actions, "deregister"), 1, "{:?}", p.actions);
}

/// Once deregistered, an unreadable `drain-started` is written anew as before it: the
/// settle before the hand-off that may still wait (an Auto Scaling hook, after FleetIQ's
/// deregistration) counts from then. Left unreadable, it would count from every pass's
/// `now`, and the hook would be heartbeated to its cap on an empty node.
#[test]
fn a_garbled_start_after_deregistration_is_written_anew_and_the_hand_off_follows() {
    let c = PolicyConfig {
        deregister_settle: Duration::from_secs(5),
        ..cfg()
    };
    let (mut o, _, _) = converge(&observed(vec![]), &[draining()], &cfg());
    assert!(o.node.annotations.contains_key(keys::ANN_DEREGISTERED));
    let later = now() + secs(3600);
    assert!(
        plan_at(&o, &[draining()], &[], &c, later).hand_off,
        "empty, deregistered, settled"
    );
    o.node
        .annotations
        .insert(keys::ANN_STARTED.into(), "yesterday-ish".into());
    let p = plan_at(&o, &[draining()], &[], &c, later);
    assert!(!p.hand_off, "{:?}", p.actions);
    let written = simulate(&o, &p.actions);
    assert!(!plan_at(&written, &[draining()], &[], &c, later + secs(4)).hand_off);
    let due = plan_at(&written, &[draining()], &[], &c, later + secs(5));
    assert!(
        due.hand_off && due.actions.is_empty(),
        "the settle after an unreadable start never ends: {due:?}"
    );
    let rewritten = p.actions.iter().any(|a| {
        matches!(a, Action::PatchNode(n)
            if n.set_annotations.get(keys::ANN_STARTED) == Some(&format_precise(later))
                && n.events.is_empty())
    });
    assert!(rewritten, "written anew, with no Event: {:?}", p.actions);
}

/// An empty node whose pending GCE maintenance may start early, handed back to GKE.
fn handed_back() -> (Observed, Notice, PolicyConfig) {
    let mut m = draining();
    m.source = crate::sources::gce_metadata::SOURCE;
    m.cause = Cause::Maintenance;
    m.deadline = Some("2026-11-30T09:00:00Z".parse().unwrap());
    m.can_start_early = true;
    let on = PolicyConfig {
        hand_back: true,
        deregister: false,
        ..cfg()
    };
    let (o, _, _) = converge(&observed(vec![]), std::slice::from_ref(&m), &on);
    assert!(o.node.annotations.contains_key(keys::ANN_HANDED_BACK));
    (o, m, on)
}

#[test]
fn a_hand_back_to_gke_is_final() {
    let (o, _, on) = handed_back();
    // The signal clears: GKE was asked to take the node, so nothing is undone, and an idle
    // server that still lands here is released.
    let p = plan_at(&with_newcomer(o.clone()), &[], &[], &on, now());
    assert_eq!(p.phase, Phase::Draining, "{:?}", p.actions);
    assert_eq!(count(&p.actions, "release"), 1, "{:?}", p.actions);
    assert!(
        !p.actions.iter().any(|a| matches!(a, Action::PatchNode(_))),
        "{:?}",
        p.actions
    );
}

#[test]
fn a_cancel_removes_everything_lastcall_wrote_including_a_stale_hand_back() {
    let (mut o, _, on) = handed_back();
    // A mark left by an earlier drain (older agents did not remove it on cancel).
    o.node
        .annotations
        .insert(keys::ANN_HANDED_BACK.into(), "2026-11-30T04:00:00Z".into());
    let (after, _, phase) = converge(&o, &[], &on);
    assert_eq!(phase, Phase::Idle);
    assert!(
        after.node.annotations.is_empty(),
        "{:?}",
        after.node.annotations
    );
    assert!(
        !after
            .node
            .labels
            .contains_key(keys::LABEL_GKE_PERFORM_MAINTENANCE),
        "{:?}",
        after.node.labels
    );
    assert!(!after.node.unschedulable && !after.node.has_taint(keys::TAINT_DRAINING));
    // A perform-maintenance label without lastcall's mark is someone else's: kept.
    let mut foreign = observed(vec![]);
    foreign
        .node
        .labels
        .insert(keys::LABEL_GKE_PERFORM_MAINTENANCE.into(), "true".into());
    let (drained, _, _) = converge(&foreign, &[draining()], &cfg());
    let (after, _, _) = converge(&drained, &[], &cfg());
    assert_eq!(
        after.node.labels.get(keys::LABEL_GKE_PERFORM_MAINTENANCE),
        Some(&"true".to_string())
    );
}

/// The phase names are metric label values and the Event reasons are what `kubectl get
/// events` shows: both are documented, so a rename is a breaking change, caught here.
#[test]
fn phase_names_and_event_reasons_are_the_documented_ones() {
    assert_eq!(
        Phase::ALL.map(Phase::as_str),
        [
            "idle",
            "fencing",
            "draining",
            "empty",
            "deregistered",
            "cancelling"
        ]
    );
    let events = include_str!("../../../docs/events.md");
    for e in [
        NodeEvent::DrainStarted,
        NodeEvent::NodeFenced,
        NodeEvent::DrainCancelled,
    ] {
        assert_eq!(e.reason(), format!("{e:?}"));
        assert!(
            events.contains(&format!("| `{}` |", e.reason())),
            "{e:?} in docs/events.md"
        );
    }
}

#[test]
fn pacing_is_on_only_with_a_floor_or_an_interval() {
    assert!(!Pacing::default().is_on());
    let batch_only = Pacing {
        batch: 5,
        ..Pacing::default()
    };
    assert!(!batch_only.is_on(), "a batch size alone paces nothing");
    let floor = Pacing {
        floor: 1,
        ..Pacing::default()
    };
    assert!(floor.is_on());
    let interval = Pacing {
        interval: Duration::from_millis(1),
        ..Pacing::default()
    };
    assert!(interval.is_on());
}

/// A platform waiting for the node (an Auto Scaling hook, an Azure event) may have it only
/// once it is empty, the fence has stood its settle, and, with FleetIQ, it is deregistered.
#[test]
fn the_node_is_handed_off_once_empty_settled_and_deregistered_where_fleetiq_is_on() {
    for fleetiq in [true, false] {
        let c = PolicyConfig {
            deregister: fleetiq,
            deregister_settle: Duration::from_secs(5),
            ..cfg()
        };
        // Busy: never, however long the fence has stood.
        let (busy, _, _) = converge(&mixed(), &[draining()], &c);
        let p = plan_at(&busy, &[draining()], &[], &c, now() + secs(3600));
        assert!(!p.hand_off && !p.hands_over(), "busy, FleetIQ {fleetiq}");
        // Empty, just fenced: not before the settle, and the plan wakes for it.
        let fence = plan_at(&observed(vec![]), &[draining()], &[], &c, now());
        assert!(!fence.hand_off, "fencing, FleetIQ {fleetiq}");
        let fenced = simulate(&observed(vec![]), &fence.actions);
        let early = plan_at(&fenced, &[draining()], &[], &c, now() + secs(4));
        assert!(!early.hand_off && !early.hands_over(), "FleetIQ {fleetiq}");
        assert_eq!(early.wake_at, Some(now() + secs(5)), "FleetIQ {fleetiq}");
        let due = plan_at(&fenced, &[draining()], &[], &c, now() + secs(5));
        assert!(due.hands_over(), "FleetIQ {fleetiq}: {:?}", due.actions);
        // With FleetIQ the deregistration comes first: its record, then the hand-off.
        assert_eq!(due.hand_off, !fleetiq, "{:?}", due.actions);
        assert_eq!(count(&due.actions, "deregister"), usize::from(fleetiq));
        if fleetiq {
            let gone = simulate(&fenced, &due.actions);
            let after = plan_at(&gone, &[draining()], &[], &c, now() + secs(6));
            assert!(after.hand_off && after.actions.is_empty(), "{after:?}");
        }
    }
}

/// The fence has stood only since it was last put back: a taint or cordon another writer
/// strips from an empty, long-fenced node is put back, and the settle before any hand-off
/// (FleetIQ's deregistration, or a waiting platform's) counts again from then. The scheduler
/// may have chosen the node while the fence was gone and bind its pod after the next fresh
/// read, exactly as just after the first fence.
#[test]
fn a_fence_put_back_restarts_the_settle() {
    type Strip = fn(&mut Observed);
    let strips: [(&str, Strip); 3] = [
        ("taint", |o| {
            o.node.taints.retain(|t| t.key != keys::TAINT_DRAINING)
        }),
        ("cordon", |o| o.node.unschedulable = false),
        ("both", |o| {
            o.node.taints.retain(|t| t.key != keys::TAINT_DRAINING);
            o.node.unschedulable = false;
        }),
    ];
    for fleetiq in [true, false] {
        let c = PolicyConfig {
            deregister: fleetiq,
            deregister_settle: Duration::from_secs(5),
            ..cfg()
        };
        let fence = plan_at(&observed(vec![]), &[draining()], &[], &c, now());
        let fenced = simulate(&observed(vec![]), &fence.actions);
        let later = now() + secs(3600);
        for (what, strip) in strips {
            let mut stripped = fenced.clone();
            strip(&mut stripped);
            let p = plan_at(&stripped, &[draining()], &[], &c, later);
            assert!(
                !p.hands_over(),
                "{what}, FleetIQ {fleetiq}: {:?}",
                p.actions
            );
            let marked = p.actions.iter().any(|a| {
                matches!(a, Action::PatchNode(n)
                    if n.set_annotations.get(keys::ANN_FENCE_RESTORED) == Some(&format_precise(later)))
            });
            assert!(marked, "{what}, FleetIQ {fleetiq}: {:?}", p.actions);
            let back = simulate(&stripped, &p.actions);
            assert!(back.node.unschedulable && back.node.has_taint(keys::TAINT_DRAINING));
            let early = plan_at(&back, &[draining()], &[], &c, later + secs(4));
            assert!(
                !early.hands_over() && early.actions.is_empty(),
                "{what}, FleetIQ {fleetiq}: handed over 4 s after the fence was put back: {:?}",
                early.actions
            );
            assert_eq!(early.wake_at, Some(later + secs(5)), "{what}");
            let due = plan_at(&back, &[draining()], &[], &c, later + secs(5));
            assert!(
                due.hands_over(),
                "{what}, FleetIQ {fleetiq}: {:?}",
                due.actions
            );
        }
        // A held drain (its source not heard since a restart) puts the fence back the same way.
        let mut stripped = fenced.clone();
        stripped
            .node
            .taints
            .retain(|t| t.key != keys::TAINT_DRAINING);
        let held = plan_at(&stripped, &[], &[fleetiq::SOURCE], &c, later);
        let marked = held.actions.iter().any(|a| {
            matches!(a, Action::PatchNode(n)
                if n.set_annotations.get(keys::ANN_FENCE_RESTORED) == Some(&format_precise(later)))
        });
        assert!(marked, "held, FleetIQ {fleetiq}: {:?}", held.actions);
        // An unreadable mark never shortens the settle: it is written anew.
        let mut garbled = fenced.clone();
        garbled
            .node
            .annotations
            .insert(keys::ANN_FENCE_RESTORED.into(), "soon".into());
        let p = plan_at(&garbled, &[draining()], &[], &c, later);
        assert!(!p.hands_over(), "{:?}", p.actions);
        let back = simulate(&garbled, &p.actions);
        assert!(!plan_at(&back, &[draining()], &[], &c, later + secs(4)).hands_over());
        assert!(plan_at(&back, &[draining()], &[], &c, later + secs(5)).hands_over());
        // A cancel takes the mark away with the rest of the drain's record.
        let cancelled = converge(&back, &[], &c).0;
        assert!(
            !cancelled
                .node
                .annotations
                .contains_key(keys::ANN_FENCE_RESTORED),
            "{:?}",
            cancelled.node.annotations
        );
    }
}

/// Deregistered is not empty: GameLift may drop a busy node's game server on its own
/// (heartbeats stopped while the agent was away, an old agent's deregistration on exit, a
/// wrong id). The node stays fenced, its matches protected, nothing is handed over, and the
/// operator is told; once the matches end, the node goes through the same gate as any.
#[test]
fn a_busy_node_gamelift_forgot_is_never_handed_over() {
    let c = PolicyConfig {
        deregister_settle: Duration::from_secs(5),
        ..cfg()
    };
    let (drained, _, _) = converge(&mixed(), &[draining()], &c);
    let forgotten = |o: &Observed, notices: &[Notice], at: Timestamp| {
        plan(&Inputs {
            notices,
            observed: o,
            config: &c,
            unknown_sources: &[],
            fleetiq_deregistered: true,
            now: at,
        })
    };
    for notices in [vec![], vec![draining()]] {
        let p = forgotten(&drained, &notices, now() + secs(3600));
        assert!(!p.hand_off && !p.hands_over(), "{:?}", p.actions);
        assert_eq!(count(&p.actions, "deregister"), 0, "{:?}", p.actions);
        assert!(
            p.warnings
                .iter()
                .any(|w| w.reason == DEREGISTERED_WHILE_BUSY),
            "{:?}",
            p.warnings
        );
        assert!(
            !p.actions.iter().any(|a| matches!(
                a,
                Action::PatchNode(n) if n.unschedulable == Some(false)
            ) || matches!(a, Action::Unprotect { .. })),
            "still fenced and protected: {:?}",
            p.actions
        );
    }
    // The matches end: the gate, then the record, then the hand-off.
    let mut empty = drained.clone();
    empty.game_servers.clear();
    empty.pods.clear();
    let p = forgotten(&empty, &[], now() + secs(3600));
    assert!(p.warnings.is_empty(), "{:?}", p.warnings);
    assert_eq!(count(&p.actions, "deregister"), 1, "{:?}", p.actions);
    let recorded = simulate(&empty, &p.actions);
    let p = forgotten(&recorded, &[], now() + secs(3601));
    assert!(p.hand_off, "{p:?}");
    // A pod that lands on the deregistered node (a blanket toleration) takes it back.
    let mut landed = recorded.clone();
    let g = gs("late", GsState::Ready);
    landed.pods.push(pod_for(&g));
    let p = forgotten(&landed, &[], now() + secs(3602));
    assert!(!p.hand_off && !p.hands_over(), "{p:?}");
}

/// The hand-back to GKE waits for the same settle as every other hand-off.
#[test]
fn the_hand_back_to_gke_waits_for_the_settle() {
    let mut m = draining();
    m.source = crate::sources::gce_metadata::SOURCE;
    m.cause = Cause::Maintenance;
    m.deadline = Some("2026-11-30T09:00:00Z".parse().unwrap());
    m.can_start_early = true;
    let c = PolicyConfig {
        hand_back: true,
        deregister: false,
        deregister_settle: Duration::from_secs(5),
        ..cfg()
    };
    let notices = std::slice::from_ref(&m);
    let fence = plan_at(&observed(vec![]), notices, &[], &c, now());
    let handed = |p: &Plan| {
        p.actions.iter().any(|a| matches!(a, Action::PatchNode(n) if n.set_labels.contains_key(keys::LABEL_GKE_PERFORM_MAINTENANCE)))
    };
    assert!(!handed(&fence), "{:?}", fence.actions);
    let fenced = simulate(&observed(vec![]), &fence.actions);
    let early = plan_at(&fenced, notices, &[], &c, now() + secs(4));
    assert!(
        !handed(&early) && !early.hands_over(),
        "{:?}",
        early.actions
    );
    let due = plan_at(&fenced, notices, &[], &c, now() + secs(5));
    assert!(handed(&due) && due.hands_over(), "{:?}", due.actions);
}

/// Without a readable record (an older agent's, or garbled), a restarted agent holds the
/// drain while any source is unknown, except a manual one (its label is always known).
#[test]
fn an_unreadable_record_holds_the_drain_while_any_source_is_unknown_unless_manual() {
    let unknown = [fleetiq::SOURCE];
    for record in [Recorded::Absent, Recorded::Garbled] {
        for cause in [None, Some(Cause::Viability), Some(Cause::Manual)] {
            let progress = Progress {
                cause,
                record: record.clone(),
                ..Progress::default()
            };
            assert_eq!(
                super::cancel::held(&progress, &unknown),
                cause != Some(Cause::Manual),
                "{record:?} {cause:?}, a source unknown"
            );
            assert!(
                !super::cancel::held(&progress, &[]),
                "{record:?} {cause:?}, every source known"
            );
        }
    }
}

/// A cancel takes back each mark it finds, even one left alone (a write that half
/// landed, an older agent's), and leaves GKE's maintenance label to whoever set it unless
/// lastcall's hand-back mark is beside it.
#[test]
fn a_cancel_takes_back_every_mark_and_only_its_own_gke_label() {
    let (mut drained, _, _) = converge(&mixed(), &[draining()], &cfg());
    drained
        .node
        .labels
        .insert(keys::LABEL_GKE_PERFORM_MAINTENANCE.into(), "true".into());
    // One mark each on the two matches and the reservation.
    let marks = [
        ("a1", keys::LABEL_NODE_DRAINING),
        ("a2", keys::ANN_GS_DEADLINE),
        ("s1", keys::ANN_GS_REASON),
    ];
    for (name, keep) in marks {
        let g = gs_mut(&mut drained, name);
        g.labels.remove(keys::LABEL_NODE_DRAINING);
        g.annotations.remove(keys::ANN_GS_DEADLINE);
        g.annotations.remove(keys::ANN_GS_REASON);
        if keep == keys::LABEL_NODE_DRAINING {
            g.labels.insert(keep.into(), "true".into());
        } else {
            g.annotations.insert(keep.into(), "x".into());
        }
    }
    let p = run(&drained, &[], &cfg());
    assert_eq!(p.phase, Phase::Cancelling);
    let mut unprotected: Vec<&str> = p
        .actions
        .iter()
        .filter_map(|a| match a {
            Action::Unprotect { gs } => Some(gs.name.as_str()),
            _ => None,
        })
        .collect();
    unprotected.sort_unstable();
    assert_eq!(unprotected, ["a1", "a2", "s1"]);
    let node_patch = p.actions.iter().find_map(|a| match a {
        Action::PatchNode(n) => Some(n),
        _ => None,
    });
    let node_patch = node_patch.expect("the cancel's Node write");
    assert!(
        !node_patch
            .remove_labels
            .contains(keys::LABEL_GKE_PERFORM_MAINTENANCE),
        "not lastcall's: no hand-back mark"
    );
}

fn annotated_pods(p: &Plan) -> Vec<(usize, &str, bool)> {
    p.actions
        .iter()
        .enumerate()
        .filter_map(|(i, a)| match a {
            Action::AnnotatePod { pod, changes, .. } => Some((
                i,
                pod.as_str(),
                changes.get(crate::cooperation::ANN_DO_NOT_DISRUPT) == Some(&Some("true".into())),
            )),
            _ => None,
        })
        .collect()
}

/// With cooperation on, a match's protection goes first in the plan (before the Node
/// write, which may conflict) and giving protection back goes last; a server or pod on its
/// way out gets nothing.
#[test]
fn cooperation_protects_matches_first_and_gives_protection_back_last() {
    use crate::cooperation::{ANN_DO_NOT_DISRUPT, ANN_MANAGED, ANN_SAFE_TO_EVICT, Mode};
    let c = PolicyConfig {
        cooperation: Mode::InUse,
        ..cfg()
    };
    let mut obs = mixed();
    // r1 was protected while it held a match; it is Ready again.
    let r1 = obs.pods.iter_mut().find(|p| p.name == "r1").expect("r1");
    r1.annotations
        .insert(ANN_DO_NOT_DISRUPT.into(), "true".into());
    r1.annotations
        .insert(ANN_SAFE_TO_EVICT.into(), "false".into());
    r1.annotations.insert(
        ANN_MANAGED.into(),
        format!("{ANN_DO_NOT_DISRUPT},{ANN_SAFE_TO_EVICT}"),
    );
    // a2 is being deleted; s1's pod is terminating; a3's pod has exited.
    gs_mut(&mut obs, "a2").deleting = true;
    let a3 = gs("a3", GsState::Allocated);
    let mut a3_pod = pod_for(&a3);
    a3_pod.finished = true;
    obs.game_servers.push(a3);
    obs.pods.push(a3_pod);
    obs.pods
        .iter_mut()
        .find(|p| p.name == "s1")
        .expect("s1")
        .deleting = true;
    let p = run(&obs, &[draining()], &c);
    let pods = annotated_pods(&p);
    let names: Vec<&str> = pods.iter().map(|(_, n, _)| *n).collect();
    assert_eq!(names, ["a1", "r1"], "{:?}", p.actions);
    let node_write = p
        .actions
        .iter()
        .position(|a| matches!(a, Action::PatchNode(_)))
        .expect("the fence");
    let (a1_at, _, a1_protects) = pods[0];
    let (r1_at, _, r1_protects) = pods[1];
    assert!(a1_protects && !r1_protects);
    assert!(a1_at < node_write, "protection before the Node write");
    assert_eq!(r1_at, p.actions.len() - 1, "giving back last");

    // The user's template sets do-not-disrupt itself: lastcall writes only safe-to-evict,
    // and that is protection too.
    let mut own = mixed();
    gs_mut(&mut own, "a1")
        .template_annotations
        .insert(ANN_DO_NOT_DISRUPT.into());
    let p = run(&own, &[draining()], &c);
    let node_write = p
        .actions
        .iter()
        .position(|a| matches!(a, Action::PatchNode(_)))
        .expect("the fence");
    let a1 = p.actions.iter().position(|a| {
        matches!(a, Action::AnnotatePod { pod, changes, .. }
            if pod == "a1" && changes.get(ANN_SAFE_TO_EVICT) == Some(&Some("false".into()))
                && !changes.contains_key(ANN_DO_NOT_DISRUPT))
    });
    assert!(a1.is_some_and(|i| i < node_write), "{:?}", p.actions);
}

#[test]
fn an_invalid_cooperation_label_warns_and_uses_the_flag() {
    let c = PolicyConfig {
        cooperation: crate::cooperation::Mode::InUse,
        ..cfg()
    };
    let mut obs = mixed();
    obs.node
        .labels
        .insert(crate::cooperation::LABEL_MODE.into(), "sometimes".into());
    let p = run(&obs, &[], &c);
    assert!(
        p.warnings
            .iter()
            .any(|w| w.reason == "CooperationLabelInvalid" && w.note.contains("sometimes")),
        "{:?}",
        p.warnings
    );
    let mut names: Vec<&str> = annotated_pods(&p).iter().map(|(_, n, _)| *n).collect();
    names.sort_unstable();
    assert_eq!(names, ["a1", "a2", "s1"], "in-use, from the flag");
}

/// A source that joins a recorded drain is first seen now (and recorded in this pass);
/// after deregistration nothing is recorded any more, so it counts from the drain's start
/// and its default deadline does not move from pass to pass.
#[test]
fn a_joining_source_is_first_seen_now_until_deregistration_then_at_the_start() {
    use crate::deadline::Entry;
    use crate::progress::DrainRecord;
    let start = now() - jiff::SignedDuration::from_mins(5);
    let obs = observed(vec![]);
    let notices = [draining()];
    let c = cfg();
    let inp = Inputs {
        notices: &notices,
        observed: &obs,
        config: &c,
        unknown_sources: &[],
        fleetiq_deregistered: false,
        now: now(),
    };
    let mut progress = Progress {
        started: Some(start),
        record: Recorded::Valid(DrainRecord {
            entries: vec![Entry {
                source: node_signals::MANUAL,
                cause: Cause::Manual,
                severity: Severity::Drain,
                deadline: None,
                cancellable: true,
                first_seen: start,
                restated: false,
            }],
        }),
        ..Progress::default()
    };
    let first_seen = |p: &Progress| {
        super::deadlines::deadlines(&inp, p)
            .claims
            .iter()
            .find(|c| c.entry.source == fleetiq::SOURCE)
            .map(|c| c.entry.first_seen)
    };
    assert_eq!(first_seen(&progress), Some(now()));
    progress.deregistered = Some(now() - jiff::SignedDuration::from_secs(30));
    assert_eq!(first_seen(&progress), Some(start));
}

/// The original's NoExecute taint comes only once no idle server is left to be killed
/// by the taint manager outside the race-safe delete: a Ready one or one still starting
/// holds it back, one already being deleted does not.
#[test]
fn compat_noexecute_taint_waits_for_every_idle_or_starting_server_to_go() {
    let c = PolicyConfig {
        compat_taints: true,
        ..cfg()
    };
    let (mut o, _, _) = converge(&mixed(), &[draining()], &c);
    o.node
        .taints
        .retain(|t| t.key != keys::COMPAT_TAINT_DRAINING);
    o.node.annotations.remove(keys::ANN_COMPAT_DRAINING);
    let adds_taint = |o: &Observed| {
        run(o, &[draining()], &c).actions.iter().any(|a| {
            matches!(a, Action::PatchNode(p) if p.taints.as_ref().is_some_and(|t| t.iter().any(|t| t.key == keys::COMPAT_TAINT_DRAINING)))
        })
    };
    assert!(adds_taint(&o), "nothing idle left: the taint");
    for (state, deleting, held) in [
        (GsState::Ready, false, true),
        (GsState::Scheduled, false, true),
        (GsState::Ready, true, false),
    ] {
        let mut with = o.clone();
        let mut g = gs("late", state.clone());
        g.deleting = deleting;
        with.pods.push(pod_for(&g));
        with.game_servers.push(g);
        assert_eq!(!adds_taint(&with), held, "{state:?}, deleting {deleting}");
    }
}

/// `NodeFenced` is told for a fence that only taints (someone else cordoned) and for one
/// that only cordons (our taint already there).
#[test]
fn node_fenced_is_told_for_a_taint_alone_and_for_a_cordon_alone() {
    let fence_events = |o: &Observed| {
        run(o, &[draining()], &cfg())
            .actions
            .iter()
            .find_map(|a| match a {
                Action::PatchNode(p) => Some(p.events.clone()),
                _ => None,
            })
            .expect("a fence")
    };
    let mut cordoned_elsewhere = mixed();
    cordoned_elsewhere.node.unschedulable = true;
    assert!(fence_events(&cordoned_elsewhere).contains(&NodeEvent::NodeFenced));
    let mut tainted_already = mixed();
    tainted_already
        .node
        .taints
        .push(taint(keys::TAINT_DRAINING, "fleetiq", "NoSchedule"));
    assert!(fence_events(&tainted_already).contains(&NodeEvent::NodeFenced));
}

/// A Terminate deadline moved earlier is announced again to every match, whether or not
/// its `eviction.safe` lets lastcall end it at the deadline.
#[test]
fn a_deadline_moved_earlier_is_announced_to_every_match() {
    use crate::eviction::EvictionSafe;
    let mk = |name: &str, safe: EvictionSafe| {
        let mut g = gs(name, GsState::Allocated);
        g.eviction_safe = safe;
        g
    };
    let obs0 = observed(vec![
        mk("never", EvictionSafe::Never),
        mk("always", EvictionSafe::Always),
        mk("upgrade", EvictionSafe::OnUpgrade),
    ]);
    let d1 = now() + jiff::SignedDuration::from_secs(8);
    let d2 = now() + jiff::SignedDuration::from_secs(7);
    let notice = |d| Notice {
        source: crate::sources::aws_imds::SOURCE,
        id: "imds:maintenance".into(),
        cause: Cause::Maintenance,
        severity: Severity::Terminate,
        deadline: Some(d),
        cancellable: true,
        cordon: true,
        can_start_early: false,
        estimated_deadline: false,
        restated: false,
        detail: String::new(),
    };
    let (o, _, _) = converge(&obs0, &[notice(d1)], &cfg());
    assert!(
        o.game_servers
            .iter()
            .all(|g| g.annotations.get(keys::ANN_GS_DEADLINE) == Some(&format_ts(d1)))
    );
    let p = run(&o, &[notice(d2)], &cfg());
    let protected: Vec<&str> = p
        .actions
        .iter()
        .filter_map(|a| match a {
            Action::Protect { gs, .. } => Some(gs.name.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(protected, ["never", "always", "upgrade"]);
    assert!(p.actions.iter().all(|a| match a {
        Action::Protect { deadline, .. } => *deadline == format_ts(d2),
        _ => true,
    }));
}

/// Pacing holds back Ready servers only: one not Ready yet cannot be allocated, so it goes
/// at once whatever the floor.
#[test]
fn pacing_never_holds_a_server_that_is_not_ready_yet() {
    let (c, mut o) = floor_of_four(3);
    o.game_servers[0].state = GsState::Scheduled;
    let p = run(&o, &[draining()], &c);
    let released: Vec<&str> = p
        .actions
        .iter()
        .filter_map(|a| match a {
            Action::Release { gs } => Some(gs.name.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(released, [o.game_servers[0].name.as_str()]);
}

/// No MatchesAtRisk warning when no match is at risk.
#[test]
fn matches_at_risk_is_warned_only_when_some_are() {
    let at_risk = |p: &Plan| p.warnings.iter().any(|w| w.reason == "MatchesAtRisk");
    let p = run(&mixed(), &[draining()], &cfg());
    assert_eq!(p.at_risk, 0);
    assert!(!at_risk(&p), "{:?}", p.warnings);
    let spot = terminate_at(
        Cause::Preemption,
        now() + jiff::SignedDuration::from_secs(120),
    );
    let p = run(&mixed(), std::slice::from_ref(&spot), &cfg());
    assert!(p.at_risk > 0 && at_risk(&p));
}

/// With no drain asked for, what an interrupted cancel left is taken back: our taint alone,
/// or a hand-back mark alone.
#[test]
fn an_idle_node_takes_back_a_lone_taint_or_hand_back_mark() {
    let mut tainted = mixed();
    tainted
        .node
        .taints
        .push(taint(keys::TAINT_DRAINING, "fleetiq", "NoSchedule"));
    let p = run(&tainted, &[], &cfg());
    assert!(
        p.actions.iter().any(|a| matches!(a, Action::PatchNode(n)
            if n.taints.as_ref().is_some_and(|t| !t.iter().any(|t| t.key == keys::TAINT_DRAINING)))),
        "{:?}",
        p.actions
    );
    let mut handed = mixed();
    handed
        .node
        .annotations
        .insert(keys::ANN_HANDED_BACK.into(), format_ts(now()));
    let p = run(&handed, &[], &cfg());
    assert!(
        p.actions.iter().any(|a| matches!(a, Action::PatchNode(n)
            if n.remove_annotations.contains(keys::ANN_HANDED_BACK))),
        "{:?}",
        p.actions
    );
}

/// The interval is measured from the last release: exactly one interval later, the next
/// batch goes.
#[test]
fn pacing_releases_again_exactly_one_interval_after_the_last() {
    let mut c = cfg();
    c.pacing.interval = Duration::from_secs(2);
    let mut o = fleet_servers(3);
    o.fleets.insert(
        ("default".to_string(), "f".to_string()),
        crate::observed::FleetFacts {
            ready_elsewhere: None,
            last_release: Some(now() - jiff::SignedDuration::from_secs(2)),
        },
    );
    assert_eq!(released(&run(&o, &[draining()], &c)), 1);
}

/// A garbled drain start does not end the hold: the bound counts from now instead.
#[test]
fn a_garbled_drain_start_does_not_end_the_pacing_hold() {
    let (c, mut o) = floor_of_four(10);
    o.node
        .annotations
        .insert(keys::ANN_STARTED.into(), "yesterday-ish".into());
    // Counted from now, the drain has just started: the floor waits for the other draining
    // nodes' marks, as at any start, and releases nothing yet (not everything, as an
    // epoch start, long past its hold, would).
    let p = run(&o, &[draining()], &c);
    assert_eq!(released(&p), 0);
    assert!(p.wake_at.is_some());
}

/// The floor decides once the other draining nodes can have marked their servers: exactly
/// `FLOOR_SETTLE` after the start, not later; while nothing may go it looks again after
/// `FLOOR_RECHECK`.
#[test]
fn the_floor_decides_at_its_settle_and_rechecks_while_nothing_may_go() {
    use super::pace::{FLOOR_RECHECK, FLOOR_SETTLE};
    let (c, mut o) = floor_of_four(10);
    o.node.annotations.insert(
        keys::ANN_STARTED.into(),
        format_precise(now() - FLOOR_SETTLE),
    );
    assert_eq!(released(&run(&o, &[draining()], &c)), 6);
    // Everything here is needed for the floor: nothing goes, and it looks again soon.
    let mut all_needed = c.clone();
    all_needed.pacing.floor = 10;
    let p = run(&o, &[draining()], &all_needed);
    assert_eq!(released(&p), 0);
    assert_eq!(p.wake_at, Some(now() + FLOOR_RECHECK));
}

/// A floor of 4 and `n` Ready servers of one Fleet here, already marked as leaving, none
/// Ready elsewhere.
fn floor_of_four(n: usize) -> (PolicyConfig, Observed) {
    let mut c = cfg();
    c.pacing.floor = 4;
    let mut o = fleet_servers(n);
    for g in &mut o.game_servers {
        g.labels
            .insert(keys::LABEL_NODE_DRAINING.into(), "true".into());
    }
    o.fleets.insert(
        ("default".to_string(), "f".to_string()),
        crate::observed::FleetFacts {
            ready_elsewhere: Some(0),
            last_release: None,
        },
    );
    (c, o)
}

/// A node drained to the end (fenced, deregistered) on boot `a`, its matches gone.
fn handed_over_on(boot: &str, notices: &[Notice]) -> Observed {
    let mut o = observed(vec![]);
    o.node.boot_id = Some(boot.into());
    let (mut o, _, phase) = converge(&o, notices, &cfg());
    assert_eq!(phase, Phase::Deregistered, "{:?}", o.node.annotations);
    assert_eq!(
        o.node
            .annotations
            .get(keys::ANN_BOOT_ID)
            .map(String::as_str),
        Some(boot),
        "the drain records the life it belongs to"
    );
    o.node.boot_id = Some(boot.into());
    o
}

fn lastcall_marks(o: &Observed) -> Vec<&String> {
    o.node
        .annotations
        .keys()
        .filter(|k| k.starts_with("lastcall.dev/") && k.as_str() != keys::ANN_REGISTERED)
        .collect()
}

/// A machine that comes back (a new boot id) after its drain was handed over starts a new
/// life: with no signal live, lastcall lifts everything it placed and says why; the same
/// boot keeps the node fenced for good, as before.
#[test]
fn a_machine_that_came_back_with_no_signal_is_unfenced_and_told() {
    for drain in [draining(), spot("2026-11-30T05:02:00Z")] {
        let done = handed_over_on("boot-a", std::slice::from_ref(&drain));
        // The same life: final, whatever the signals say now.
        let p = run(&done, &[], &cfg());
        assert_eq!(p.phase, Phase::Deregistered);
        assert!(
            !p.actions
                .iter()
                .any(|a| matches!(a, Action::PatchNode(n) if n.unschedulable == Some(false))),
            "{:?}",
            p.actions
        );
        // A new boot and no live signal: lifted, with the Event.
        let mut back = done.clone();
        back.node.boot_id = Some("boot-b".into());
        let p = run(&back, &[], &cfg());
        assert_eq!(p.phase, Phase::Cancelling, "{:?}", drain.cause);
        assert!(
            p.actions.iter().any(|a| matches!(a, Action::PatchNode(n) if n.events.contains(&NodeEvent::MachineReturned))),
            "{:?}",
            p.actions
        );
        assert_eq!(count(&p.actions, "deregister"), 0);
        let (after, _, phase) = converge(&back, &[], &cfg());
        assert_eq!(phase, Phase::Idle, "{:?}", after.node.annotations);
        assert!(!after.node.unschedulable, "uncordoned");
        assert!(!after.node.has_taint(keys::TAINT_DRAINING));
        assert!(
            lastcall_marks(&after).is_empty(),
            "{:?}",
            after.node.annotations
        );
        // An unknown boot id cannot tell: the node stays as it was.
        let mut unknown = done.clone();
        unknown.node.boot_id = None;
        assert_eq!(run(&unknown, &[], &cfg()).phase, Phase::Deregistered);
    }
}

/// Came back while a signal is still live: the fence stays, the old life's deregistration
/// is dropped, and the drain runs again in this life through the same gate.
#[test]
fn a_machine_that_came_back_under_a_live_signal_drains_again() {
    let done = handed_over_on("boot-a", &[draining()]);
    let mut back = done.clone();
    back.node.boot_id = Some("boot-b".into());
    let p = run(&back, &[draining()], &cfg());
    assert_eq!(p.phase, Phase::Fencing);
    assert!(
        !p.actions
            .iter()
            .any(|a| matches!(a, Action::PatchNode(n) if n.unschedulable == Some(false) || n.taints.is_some())),
        "the fence stays: {:?}",
        p.actions
    );
    let again = simulate(&back, &p.actions);
    assert!(!again.node.annotations.contains_key(keys::ANN_DEREGISTERED));
    assert_eq!(
        again
            .node
            .annotations
            .get(keys::ANN_BOOT_ID)
            .map(String::as_str),
        Some("boot-b")
    );
    // A match lands in the new life: protected, nothing handed over until it ends.
    let mut busy = again.clone();
    let m = gs("m1", GsState::Allocated);
    busy.pods.push(pod_for(&m));
    busy.game_servers.push(m);
    let p = run(&busy, &[draining()], &cfg());
    assert!(!p.hands_over(), "{:?}", p.actions);
    assert!(
        p.actions
            .iter()
            .any(|a| matches!(a, Action::Protect { .. }))
    );
    // Once empty again: deregistered again, in this life.
    let (_, acts, phase) = converge(&again, &[draining()], &cfg());
    assert_eq!(phase, Phase::Deregistered);
    assert_eq!(count(&acts, "deregister"), 1, "{acts:?}");
}

/// Came back before a source that asked for the drain has reported in the new life (a
/// NodeClaim's expiry is read with a GET after the start): the fence is held as after any
/// restart, not lifted to be put up again a moment later; once the sources have spoken the
/// new life begins, lifted or drained again.
#[test]
fn a_machine_that_came_back_holds_the_fence_until_the_sources_that_asked_report() {
    let done = handed_over_on("boot-a", &[draining()]);
    let mut back = done.clone();
    back.node.boot_id = Some("boot-b".into());
    let with = |unknown: &[crate::notice::Source], notices: &[Notice]| {
        plan(&Inputs {
            notices,
            observed: &back,
            config: &cfg(),
            unknown_sources: unknown,
            fleetiq_deregistered: false,
            now: now(),
        })
    };
    let held = with(&[fleetiq::SOURCE], &[]);
    assert_eq!(held.phase, Phase::Draining);
    assert!(
        !held.actions.iter().any(|a| matches!(a, Action::PatchNode(n)
            if n.unschedulable == Some(false)
                || n.taints.is_some()
                || n.events.contains(&NodeEvent::MachineReturned))),
        "nothing lifted or told yet: {:?}",
        held.actions
    );
    // An unknown source that never asked holds nothing.
    let other = crate::notice::Source("gce_metadata");
    assert_eq!(with(&[other], &[]).phase, Phase::Cancelling);
    // Heard from: nothing asks, so the new life starts lifted; or the drain goes on.
    assert_eq!(with(&[], &[]).phase, Phase::Cancelling);
    assert_eq!(with(&[], &[draining()]).phase, Phase::Fencing);
}

/// A machine that came back stays fenced while a source that asked for its last drain has
/// not reported; one that never does (down, or gone from the configuration) would keep it
/// fenced for good without a word. A minute after the machine is back (its Node Ready
/// again), the operator is told which source holds it, once; before that, the plan wakes
/// for that moment. Unsaid when it came back: told at once.
#[test]
fn a_machine_held_for_a_source_that_never_reports_is_told() {
    let done = handed_over_on("boot-a", &[draining()]);
    let mut back = done.clone();
    back.node.boot_id = Some("boot-b".into());
    back.node.ready_since = Some(now());
    let at = |o: &Observed, unknown: &[crate::notice::Source], t: Timestamp| {
        plan(&Inputs {
            notices: &[],
            observed: o,
            config: &cfg(),
            unknown_sources: unknown,
            fleetiq_deregistered: false,
            now: t,
        })
    };
    let told = |p: &Plan| {
        p.warnings
            .iter()
            .filter(|w| w.reason == MACHINE_RETURNED_HELD)
            .map(|w| w.note.clone())
            .collect::<Vec<_>>()
    };
    let early = at(&back, &[fleetiq::SOURCE], now() + secs(30));
    assert!(told(&early).is_empty(), "{:?}", early.warnings);
    assert_eq!(early.wake_at, Some(now() + secs(60)));
    let late = at(&back, &[fleetiq::SOURCE], now() + secs(60));
    let notes = told(&late);
    assert_eq!(notes.len(), 1, "{:?}", late.warnings);
    assert!(notes[0].contains("fleetiq"), "{notes:?}");
    assert_eq!(late.phase, Phase::Draining, "still held");
    // Heard from: nothing to tell.
    assert!(told(&at(&back, &[], now() + secs(600))).is_empty());
    // When the machine came back is not said: told at once.
    back.node.ready_since = None;
    assert_eq!(told(&at(&back, &[fleetiq::SOURCE], now())).len(), 1);
}

/// A drain held after a restart (its source not heard from yet) keeps the node fenced: a
/// taint or cordon another writer stripped meanwhile is put back, and nothing else moves.
#[test]
fn a_held_drain_puts_back_a_stripped_fence() {
    let (drained, _, _) = converge(&mixed(), &[draining()], &cfg());
    let mut stripped = drained.clone();
    stripped
        .node
        .taints
        .retain(|t| t.key != keys::TAINT_DRAINING);
    stripped.node.unschedulable = false;
    let held = plan(&Inputs {
        notices: &[],
        observed: &stripped,
        config: &cfg(),
        unknown_sources: &[fleetiq::SOURCE],
        fleetiq_deregistered: false,
        now: now(),
    });
    assert_eq!(held.phase, Phase::Draining);
    let patches: Vec<&NodePatch> = held
        .actions
        .iter()
        .filter_map(|a| match a {
            Action::PatchNode(p) => Some(p),
            _ => None,
        })
        .collect();
    assert_eq!(patches.len(), 1, "{:?}", held.actions);
    assert_eq!(patches[0].unschedulable, Some(true));
    assert!(
        patches[0]
            .taints
            .as_ref()
            .is_some_and(|t| t.iter().any(|t| t.key == keys::TAINT_DRAINING)),
        "{:?}",
        patches[0]
    );
    // The drain's record stays as it was; only the moment the fence stands again is kept.
    assert_eq!(
        patches[0].set_annotations.keys().collect::<Vec<_>>(),
        [keys::ANN_FENCE_RESTORED],
        "{:?}",
        patches[0]
    );
    assert!(patches[0].remove_annotations.is_empty());
    let again = simulate(&stripped, &held.actions);
    let p = plan(&Inputs {
        notices: &[],
        observed: &again,
        config: &cfg(),
        unknown_sources: &[fleetiq::SOURCE],
        fleetiq_deregistered: false,
        now: now(),
    });
    assert!(
        !p.actions.iter().any(|a| matches!(a, Action::PatchNode(_))),
        "{:?}",
        p.actions
    );
}
