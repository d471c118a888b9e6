//! The overlay alone carries a whole drain through the unchanged policy: the world never
//! changes except for a match that ends for real, yet each plan follows from the last.

use std::collections::BTreeMap;
use std::time::Duration;

use jiff::Timestamp;

use super::*;
use crate::notice::{Cause, Notice, Severity};
use crate::observed::{GameServerView, GsState, NodeView, PodView};
use crate::policy::{self, Phase, Plan, PolicyConfig};
use crate::sources::fleetiq;

fn t0() -> Timestamp {
    "2026-11-30T05:00:00Z".parse().unwrap()
}

fn cfg() -> PolicyConfig {
    PolicyConfig {
        compat_taints: false,
        deregister: true,
        default_deadline: Duration::from_secs(600),
        deregister_settle: Duration::from_secs(5),
        hand_back: false,
        eviction: Default::default(),
        cooperation: Default::default(),
        pacing: Default::default(),
        claim_unseen: true,
    }
}

fn gs(name: &str, state: GsState) -> GameServerView {
    GameServerView {
        namespace: "default".into(),
        name: name.into(),
        uid: format!("uid-{name}"),
        resource_version: "10".into(),
        state,
        deleting: false,
        node_name: Some("n1".into()),
        labels: BTreeMap::new(),
        annotations: BTreeMap::new(),
        eviction_safe: crate::eviction::EvictionSafe::Always,
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
        termination_grace: Duration::from_secs(30),
        finished: false,
    }
}

fn world(gss: Vec<GameServerView>) -> Observed {
    Observed {
        node: NodeView {
            name: "n1".into(),
            resource_version: "100".into(),
            unschedulable: false,
            taints: vec![],
            labels: BTreeMap::new(),
            annotations: BTreeMap::new(),
            boot_id: None,
            ready_since: None,
        },
        pods: gss.iter().map(pod_for).collect(),
        game_servers: gss,
        fleets: BTreeMap::new(),
    }
}

fn notice(severity: Severity, deadline: Option<Timestamp>) -> Notice {
    Notice {
        source: fleetiq::SOURCE,
        id: "i-1".into(),
        cause: Cause::Preemption,
        severity,
        deadline,
        cancellable: false,
        cordon: true,
        can_start_early: false,
        estimated_deadline: false,
        restated: false,
        detail: String::new(),
    }
}

/// One reconcile pass as a dry run makes it: the real world with the overlay laid over it,
/// the plan, and every step recorded as if it had landed.
fn pass(real: &Observed, overlay: &mut Overlay, n: &Notice, now: Timestamp) -> Plan {
    let mut seen = real.clone();
    overlay.lay_over(&mut seen, now);
    let plan = policy::plan(&policy::Inputs {
        notices: std::slice::from_ref(n),
        unknown_sources: &[],
        fleetiq_deregistered: false,
        observed: &seen,
        config: &cfg(),
        now,
    });
    for a in &plan.actions {
        overlay.record(a, &seen, now);
    }
    plan
}

fn kinds(plan: &Plan) -> Vec<&'static str> {
    plan.actions.iter().map(Action::metric_label).collect()
}

#[test]
fn the_whole_drain_follows_from_what_the_dry_run_did_not_send() {
    let mut real = world(vec![
        gs("ready", GsState::Ready),
        gs("match", GsState::Allocated),
    ]);
    let deadline = t0() + jiff::SignedDuration::from_secs(120);
    let n = notice(Severity::Terminate, Some(deadline));
    let mut o = Overlay::default();

    let p = pass(&real, &mut o, &n, t0());
    assert_eq!(p.phase, Phase::Fencing);
    assert_eq!(kinds(&p), ["patch_node", "release", "protect"]);
    // Nothing is planned twice: the fence stands, the released server is gone, the match
    // carries its deadline; the match's end is due at deadline − 30 s.
    let t1 = t0() + jiff::SignedDuration::from_secs(1);
    let p = pass(&real, &mut o, &n, t1);
    assert_eq!((p.phase, kinds(&p)), (Phase::Draining, vec![]));
    assert_eq!(
        p.wake_at,
        Some(deadline - jiff::SignedDuration::from_secs(30))
    );
    let mut seen = real.clone();
    o.lay_over(&mut seen, t1);
    assert!(seen.node.unschedulable && seen.node.has_taint(keys::TAINT_DRAINING));
    assert_eq!(seen.game_servers.len(), 1, "the released server is gone");
    assert_eq!(seen.pods.len(), 1, "and so is its pod");
    assert_eq!(real.game_servers.len(), 2, "the world itself is untouched");

    // At deadline − grace the match is ended gracefully, once; then its pod terminates.
    let due = deadline - jiff::SignedDuration::from_secs(30);
    let p = pass(&real, &mut o, &n, due);
    assert_eq!(kinds(&p), ["end_gracefully"]);
    let p = pass(&real, &mut o, &n, due);
    assert_eq!((p.phase, kinds(&p)), (Phase::Draining, vec![]));

    // The match ends for real: the node is empty, and deregisters after the settle.
    real = world(vec![gs("ready", GsState::Ready)]);
    let later = deadline;
    let p = pass(&real, &mut o, &n, later);
    assert_eq!((p.phase, kinds(&p)), (Phase::Empty, vec!["deregister"]));
    let p = pass(&real, &mut o, &n, later);
    assert_eq!((p.phase, kinds(&p)), (Phase::Deregistered, vec![]));
}

#[test]
fn without_the_overlay_the_plan_never_gets_past_the_fence() {
    let real = world(vec![
        gs("ready", GsState::Ready),
        gs("match", GsState::Allocated),
    ]);
    let n = notice(Severity::Drain, None);
    for _ in 0..3 {
        let p = policy::plan(&policy::Inputs {
            notices: std::slice::from_ref(&n),
            unknown_sources: &[],
            fleetiq_deregistered: false,
            observed: &real,
            config: &cfg(),
            now: t0(),
        });
        assert_eq!(p.phase, Phase::Fencing);
    }
}

#[test]
fn a_released_server_allocated_for_real_comes_back_as_a_match() {
    let mut real = world(vec![gs("ready", GsState::Ready)]);
    let n = notice(Severity::Drain, None);
    let mut o = Overlay::default();
    let p = pass(&real, &mut o, &n, t0());
    assert_eq!(kinds(&p), ["patch_node", "release"]);
    // Nothing fenced it for real, so an allocator took it.
    real.game_servers[0].state = GsState::Allocated;
    real.game_servers[0].resource_version = "11".into();
    let mut seen = real.clone();
    let found = o.lay_over(&mut seen, t0());
    assert_eq!(
        found,
        [Found::AllocatedAfterRelease {
            namespace: "default".into(),
            name: "ready".into()
        }]
    );
    assert_eq!(seen.game_servers.len(), 1);
    let p = pass(&real, &mut o, &n, t0());
    assert_eq!(kinds(&p), ["protect"]);
}

#[test]
fn what_is_gone_for_real_is_forgotten() {
    let real = world(vec![
        gs("ready", GsState::Ready),
        gs("match", GsState::Allocated),
    ]);
    let n = notice(Severity::Drain, None);
    let mut o = Overlay::default();
    pass(&real, &mut o, &n, t0());
    assert_eq!((o.released.len(), o.servers.len()), (1, 1));
    let mut empty = world(vec![]);
    o.lay_over(&mut empty, t0());
    assert!(o.released.is_empty() && o.servers.is_empty() && o.pods.is_empty());
    // The fence is the node's, and stays.
    assert!(empty.node.has_taint(keys::TAINT_DRAINING));
}

#[test]
fn a_cancel_takes_the_simulated_taint_away_again() {
    let real = world(vec![]);
    let mut o = Overlay::default();
    let mut n = notice(Severity::Drain, None);
    n.cancellable = true;
    pass(&real, &mut o, &n, t0());
    let mut seen = real.clone();
    o.lay_over(&mut seen, t0());
    assert!(seen.node.has_taint(keys::TAINT_DRAINING));
    // The signal clears: the cancel's patch removes what the fence added.
    let plan = policy::plan(&policy::Inputs {
        notices: &[],
        unknown_sources: &[],
        fleetiq_deregistered: false,
        observed: &seen,
        config: &cfg(),
        now: t0(),
    });
    assert_eq!(plan.phase, Phase::Cancelling);
    for a in &plan.actions {
        o.record(a, &seen, t0());
    }
    let mut seen = real.clone();
    o.lay_over(&mut seen, t0());
    assert!(!seen.node.has_taint(keys::TAINT_DRAINING) && !seen.node.unschedulable);
    assert!(!seen.node.annotations.contains_key(keys::ANN_STARTED));
}
