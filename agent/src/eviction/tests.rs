//! The hard-deadline matrix as one decision table, a property sweep over a wider grid, the
//! at-risk count, and parsing at the edge.
//!
//! The table is written as rules over sets, not computed: every combination of the grid
//! must match exactly one row, so an overlap or a gap fails, and every row must be used.

use std::collections::BTreeMap;

use jiff::SignedDuration;
use k8s_openapi::api::core::v1::Pod;
use kube::api::DynamicObject;

use super::*;
use crate::notice::Cause::{
    Maintenance, Manual, Preemption, Rebalance, ScaleDown, Upgrade, Viability,
};

fn ts(s: &str) -> Timestamp {
    s.parse().unwrap()
}

fn now() -> Timestamp {
    ts("2026-11-30T05:00:00Z")
}

/// Every game-server pod in the matrix has ten minutes of grace.
const GRACE: Duration = Duration::from_secs(600);

/// Game-server classes of the matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum G {
    Ready,
    /// Ready, pod SIGTERM'd while starting (killed at 05:10).
    ReadyPodTerminating,
    Starting,
    StartingPodTerminating,
    /// Shows Ready while its deletion runs (agones#3159); its pod terminates too.
    ReadyDeleting,
    AllocatedDeleting,
    Shutdown,
    Error,
    Unhealthy,
    Allocated,
    Reserved,
    /// A state this version does not know.
    Teleporting,
    /// Allocated, its pod already terminating, killed at 05:01.
    AllocatedPodTerminating,
    /// Allocated, its pod not observed yet.
    AllocatedPodUnseen,
}

const ALL_G: &[G] = &[
    G::Ready,
    G::ReadyPodTerminating,
    G::Starting,
    G::StartingPodTerminating,
    G::ReadyDeleting,
    G::AllocatedDeleting,
    G::Shutdown,
    G::Error,
    G::Unhealthy,
    G::Allocated,
    G::Reserved,
    G::Teleporting,
    G::AllocatedPodTerminating,
    G::AllocatedPodUnseen,
];

struct Fixture {
    state: GsState,
    deleting: bool,
    pod: Option<PodFacts>,
}

impl G {
    fn fixture(self) -> Fixture {
        let running = Some(PodFacts {
            grace: GRACE,
            deletion: None,
        });
        let terminating = |at| {
            Some(PodFacts {
                grace: GRACE,
                deletion: Some(ts(at)),
            })
        };
        let (state, deleting, pod) = match self {
            G::Ready => (GsState::Ready, false, running),
            G::ReadyPodTerminating => (GsState::Ready, false, terminating("2026-11-30T05:10:00Z")),
            G::Starting => (GsState::Starting, false, running),
            G::StartingPodTerminating => (
                GsState::Starting,
                false,
                terminating("2026-11-30T05:10:00Z"),
            ),
            G::ReadyDeleting => (GsState::Ready, true, terminating("2026-11-30T05:10:00Z")),
            G::AllocatedDeleting => (GsState::Allocated, true, running),
            G::Shutdown => (GsState::Shutdown, false, running),
            G::Error => (GsState::Error, false, running),
            G::Unhealthy => (GsState::Unhealthy, false, running),
            G::Allocated => (GsState::Allocated, false, running),
            G::Reserved => (GsState::Reserved, false, running),
            G::Teleporting => (GsState::Unknown("Teleporting".into()), false, running),
            G::AllocatedPodTerminating => (
                GsState::Allocated,
                false,
                terminating("2026-11-30T05:01:00Z"),
            ),
            G::AllocatedPodUnseen => (GsState::Allocated, false, None),
        };
        Fixture {
            state,
            deleting,
            pod,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sf {
    Never,
    OnUpgrade,
    Always,
    Garbled,
}

const ALL_SAFE: &[Sf] = &[Sf::Never, Sf::OnUpgrade, Sf::Always, Sf::Garbled];

impl Sf {
    fn value(self) -> EvictionSafe {
        match self {
            Sf::Never => EvictionSafe::Never,
            Sf::OnUpgrade => EvictionSafe::OnUpgrade,
            Sf::Always => EvictionSafe::Always,
            Sf::Garbled => EvictionSafe::Unknown("Sometimes".into()),
        }
    }
}

const ALL_CAUSES: &[Cause] = &Cause::ALL;
/// Written out here, not taken from `upgrade_like`, so the table checks the classification.
const UPGRADE_LIKE: &[Cause] = &[Maintenance, Upgrade, Manual, Preemption];
const AUTOSCALER_LIKE: &[Cause] = &[ScaleDown, Rebalance, Viability];

/// What presses on the node. Dated Terminate deadlines carry their `deadline − grace`
/// and whether the full grace still fits, as literals.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum W {
    /// No notice at all.
    Quiet,
    /// Observe only, with a deadline in an hour.
    Observe,
    Drain,
    /// A Drain whose deadline has passed (GKE scheduled maintenance, late).
    DrainPassed,
    /// Terminate, no deadline (GKE `ONGOING`, ASG Terminated).
    TermUndated,
    /// Terminate at 07:00: grace starts at 06:50, fits.
    TermFar,
    /// Terminate at 05:05: grace would have started at 04:55.
    TermWithin,
    /// Terminate at 04:59, already past.
    TermPassed,
}

const ALL_W: &[W] = &[
    W::Quiet,
    W::Observe,
    W::Drain,
    W::DrainPassed,
    W::TermUndated,
    W::TermFar,
    W::TermWithin,
    W::TermPassed,
];
const QUIET: &[W] = &[W::Quiet, W::Observe];
const DRAINS: &[W] = &[
    W::Drain,
    W::DrainPassed,
    W::TermUndated,
    W::TermFar,
    W::TermWithin,
    W::TermPassed,
];
const DATED: &[W] = &[W::TermFar, W::TermWithin, W::TermPassed];

impl W {
    fn pressure(self, cause: Cause) -> Option<Pressure> {
        let (severity, deadline) = match self {
            W::Quiet => return None,
            W::Observe => (Severity::Observe, Some("2026-11-30T06:00:00Z")),
            W::Drain => (Severity::Drain, None),
            W::DrainPassed => (Severity::Drain, Some("2026-11-30T04:59:00Z")),
            W::TermUndated => (Severity::Terminate, None),
            W::TermFar => (Severity::Terminate, Some("2026-11-30T07:00:00Z")),
            W::TermWithin => (Severity::Terminate, Some("2026-11-30T05:05:00Z")),
            W::TermPassed => (Severity::Terminate, Some("2026-11-30T04:59:00Z")),
        };
        Some(Pressure {
            cause,
            severity,
            deadline: deadline.map(ts),
        })
    }

    /// `deadline − 10 min`, and whether that is still ahead (or now).
    fn end(self) -> (Timestamp, bool) {
        match self {
            W::TermFar => (ts("2026-11-30T06:50:00Z"), true),
            W::TermWithin => (ts("2026-11-30T04:55:00Z"), false),
            W::TermPassed => (ts("2026-11-30T04:49:00Z"), false),
            other => panic!("{other:?} has no dated Terminate deadline"),
        }
    }
}

const BOTH: &[bool] = &[false, true];
const ON: &[bool] = &[true];
const OFF: &[bool] = &[false];

#[derive(Clone, Copy, Debug)]
enum Exp {
    Keep,
    Leaving,
    Remove,
    Release,
    Protect {
        at_risk: bool,
    },
    /// `EndGracefully` at the row's `deadline − grace`; at risk when the grace no longer fits.
    End,
}

struct Row {
    why: &'static str,
    g: &'static [G],
    safe: &'static [Sf],
    cause: &'static [Cause],
    w: &'static [W],
    graceful: &'static [bool],
    expect: Exp,
}

const LEAVING: &[G] = &[
    G::Shutdown,
    G::Error,
    G::Unhealthy,
    G::ReadyDeleting,
    G::AllocatedDeleting,
];
const IDLE: &[G] = &[G::Ready, G::Starting];
/// Allocated, Reserved and unknown states, with their pod seen and running.
const IN_USE: &[G] = &[G::Allocated, G::Reserved, G::Teleporting];
const IN_USE_ALL: &[G] = &[
    G::Allocated,
    G::Reserved,
    G::Teleporting,
    G::AllocatedPodTerminating,
    G::AllocatedPodUnseen,
];

#[rustfmt::skip]
const ROWS: &[Row] = &[
    // §4: leaving, whatever the state says and whatever presses.
    Row { why: "terminal or deleting counts as leaving", g: LEAVING, safe: ALL_SAFE, cause: ALL_CAUSES, w: ALL_W, graceful: BOTH, expect: Exp::Leaving },
    // §4: SIGTERM'd while starting: out of allocation at once, drain or not.
    Row { why: "idle with a terminating pod leaves allocation now", g: &[G::ReadyPodTerminating, G::StartingPodTerminating], safe: ALL_SAFE, cause: ALL_CAUSES, w: ALL_W, graceful: BOTH, expect: Exp::Remove },
    // Idle servers.
    Row { why: "idle, nothing presses", g: IDLE, safe: ALL_SAFE, cause: ALL_CAUSES, w: QUIET, graceful: BOTH, expect: Exp::Keep },
    Row { why: "idle on a draining node is released", g: IDLE, safe: ALL_SAFE, cause: ALL_CAUSES, w: DRAINS, graceful: BOTH, expect: Exp::Release },
    // In use, whatever eviction.safe says.
    Row { why: "in use, nothing presses", g: IN_USE_ALL, safe: ALL_SAFE, cause: ALL_CAUSES, w: QUIET, graceful: BOTH, expect: Exp::Keep },
    Row { why: "a Drain never ends a match, even past its deadline", g: IN_USE_ALL, safe: ALL_SAFE, cause: ALL_CAUSES, w: &[W::Drain, W::DrainPassed], graceful: BOTH, expect: Exp::Protect { at_risk: false } },
    Row { why: "Terminate without a deadline: no moment to start from", g: IN_USE_ALL, safe: ALL_SAFE, cause: ALL_CAUSES, w: &[W::TermUndated], graceful: BOTH, expect: Exp::Protect { at_risk: true } },
    Row { why: "pod already terminating, killed before the deadline", g: &[G::AllocatedPodTerminating], safe: ALL_SAFE, cause: ALL_CAUSES, w: &[W::TermFar, W::TermWithin], graceful: BOTH, expect: Exp::Protect { at_risk: false } },
    Row { why: "pod already terminating, the VM dies first", g: &[G::AllocatedPodTerminating], safe: ALL_SAFE, cause: ALL_CAUSES, w: &[W::TermPassed], graceful: BOTH, expect: Exp::Protect { at_risk: true } },
    Row { why: "pod unseen: grace unknown, never ended", g: &[G::AllocatedPodUnseen], safe: ALL_SAFE, cause: ALL_CAUSES, w: DATED, graceful: BOTH, expect: Exp::Protect { at_risk: true } },
    // §1: dated Terminate deadlines, by eviction.safe and cause.
    Row { why: "Always: any cause", g: IN_USE, safe: &[Sf::Always], cause: ALL_CAUSES, w: DATED, graceful: BOTH, expect: Exp::End },
    Row { why: "OnUpgrade: upgrade-like causes", g: IN_USE, safe: &[Sf::OnUpgrade], cause: UPGRADE_LIKE, w: DATED, graceful: BOTH, expect: Exp::End },
    Row { why: "OnUpgrade, autoscaler-like, graceful termination on", g: IN_USE, safe: &[Sf::OnUpgrade], cause: AUTOSCALER_LIKE, w: DATED, graceful: ON, expect: Exp::End },
    Row { why: "OnUpgrade, autoscaler-like: never ended", g: IN_USE, safe: &[Sf::OnUpgrade], cause: AUTOSCALER_LIKE, w: DATED, graceful: OFF, expect: Exp::Protect { at_risk: true } },
    Row { why: "Never (and unknown), graceful termination on", g: IN_USE, safe: &[Sf::Never, Sf::Garbled], cause: ALL_CAUSES, w: DATED, graceful: ON, expect: Exp::End },
    Row { why: "Never (and unknown): never ended, at risk", g: IN_USE, safe: &[Sf::Never, Sf::Garbled], cause: ALL_CAUSES, w: DATED, graceful: OFF, expect: Exp::Protect { at_risk: true } },
];

#[test]
fn eviction_matrix() {
    let mut used = vec![0usize; ROWS.len()];
    let mut failures = vec![];
    let mut combos = 0;
    for &g in ALL_G {
        let f = g.fixture();
        for &sf in ALL_SAFE {
            let safe = sf.value();
            for &cause in ALL_CAUSES {
                for &w in ALL_W {
                    for &graceful in BOTH {
                        combos += 1;
                        let hits: Vec<usize> = ROWS
                            .iter()
                            .enumerate()
                            .filter(|(_, r)| {
                                r.g.contains(&g)
                                    && r.safe.contains(&sf)
                                    && r.cause.contains(&cause)
                                    && r.w.contains(&w)
                                    && r.graceful.contains(&graceful)
                            })
                            .map(|(i, _)| i)
                            .collect();
                        let case =
                            format!("{g:?} × {sf:?} × {cause:?} × {w:?} × graceful={graceful}");
                        let [i] = hits[..] else {
                            let whys: Vec<_> = hits.iter().map(|&i| ROWS[i].why).collect();
                            failures.push(format!("{case}: matched {} rows {whys:?}", hits.len()));
                            continue;
                        };
                        used[i] += 1;
                        let want = match ROWS[i].expect {
                            Exp::Keep => Verdict::Keep,
                            Exp::Leaving => Verdict::Leaving,
                            Exp::Remove => Verdict::RemoveFromAllocation,
                            Exp::Release => Verdict::Release,
                            Exp::Protect { at_risk } => Verdict::Protect { at_risk },
                            Exp::End => {
                                let (at, fits) = w.end();
                                Verdict::EndGracefully { at, at_risk: !fits }
                            }
                        };
                        let subject = Subject {
                            state: &f.state,
                            deleting: f.deleting,
                            safe: &safe,
                            pod: f.pod,
                        };
                        let got = verdict(
                            &subject,
                            w.pressure(cause).as_ref(),
                            &EvictionConfig {
                                graceful_termination: graceful,
                            },
                            now(),
                        );
                        if got != want {
                            failures.push(format!(
                                "{case} ({}): got {got:?}, want {want:?}",
                                ROWS[i].why
                            ));
                        }
                    }
                }
            }
        }
    }
    assert_eq!(combos, 14 * 4 * 7 * 8 * 2);
    for (i, n) in used.iter().enumerate() {
        assert!(*n > 0, "row {:?} matches nothing", ROWS[i].why);
    }
    assert!(
        failures.is_empty(),
        "{} of {combos} combinations failed, first ones:\n{}",
        failures.len(),
        failures[..failures.len().min(20)].join("\n")
    );
}

/// Over a wider grid (every state, every deadline from 2 h ago to 3 h ahead in 5-minute
/// steps, four grace periods), the verdict never ends a match early, never ends one
/// without a dated Terminate notice and a permission, and never touches an idle server
/// as if it were in use.
#[test]
fn never_ends_a_match_early() {
    let states = [
        GsState::PortAllocation,
        GsState::Creating,
        GsState::Starting,
        GsState::Scheduled,
        GsState::RequestReady,
        GsState::Ready,
        GsState::Reserved,
        GsState::Allocated,
        GsState::Shutdown,
        GsState::Error,
        GsState::Unhealthy,
        GsState::Empty,
        GsState::Unknown("Teleporting".into()),
    ];
    // No pod seen, or one running or terminating (killed in a minute), with each grace.
    let mut pods = vec![None];
    for grace in [0, 30, 600, 3600].map(Duration::from_secs) {
        pods.push(Some(PodFacts {
            grace,
            deletion: None,
        }));
        pods.push(Some(PodFacts {
            grace,
            deletion: Some(now() + SignedDuration::from_mins(1)),
        }));
    }
    // No deadline; every 10 minutes from 2 h ago to 3 h ahead; each grace boundary and a
    // second either side of it.
    let mut deadlines = vec![None];
    deadlines.extend((-12..=18).map(|k| Some(now() + SignedDuration::from_mins(10 * k))));
    // (60: the terminating pods' kill, a minute out.)
    for secs in [0, 30, 60, 600, 3600] {
        for delta in [-1, 0, 1] {
            deadlines.push(Some(now() + SignedDuration::from_secs(secs + delta)));
        }
    }
    // No notice, or each severity with each deadline (the cause is filled in below).
    let mut pressures = vec![None];
    for severity in [Severity::Observe, Severity::Drain, Severity::Terminate] {
        for &deadline in &deadlines {
            pressures.push(Some((severity, deadline)));
        }
    }
    let mut checked = 0usize;
    for state in &states {
        let in_use = matches!(
            state,
            GsState::Allocated | GsState::Reserved | GsState::Unknown(_)
        );
        let terminal = matches!(
            state,
            GsState::Shutdown | GsState::Error | GsState::Unhealthy
        );
        for deleting in [false, true] {
            for &pod in &pods {
                for sf in ALL_SAFE {
                    let safe = sf.value();
                    let subject = Subject {
                        state,
                        deleting,
                        safe: &safe,
                        pod,
                    };
                    for &cause in ALL_CAUSES {
                        for &p in &pressures {
                            for graceful in [false, true] {
                                checked += 1;
                                let pressure = p.map(|(severity, deadline)| Pressure {
                                    cause,
                                    severity,
                                    deadline,
                                });
                                let severity = p.map(|(s, _)| s);
                                let deadline = p.and_then(|(_, d)| d);
                                let cfg = EvictionConfig {
                                    graceful_termination: graceful,
                                };
                                let v = verdict(&subject, pressure.as_ref(), &cfg, now());
                                let ctx = || {
                                    format!(
                                        "{state:?} deleting={deleting} pod={pod:?} {sf:?} {cause:?} {p:?} graceful={graceful}: {v:?}"
                                    )
                                };

                                assert_eq!(
                                    v == Verdict::Leaving,
                                    deleting || terminal,
                                    "{}",
                                    ctx()
                                );
                                if in_use && !deleting {
                                    assert!(
                                        matches!(
                                            v,
                                            Verdict::Keep
                                                | Verdict::Protect { .. }
                                                | Verdict::EndGracefully { .. }
                                        ),
                                        "an in-use server is never released: {}",
                                        ctx()
                                    );
                                }
                                if !in_use {
                                    assert!(
                                        !matches!(
                                            v,
                                            Verdict::Protect { .. } | Verdict::EndGracefully { .. }
                                        ),
                                        "an idle server is never protected or ended: {}",
                                        ctx()
                                    );
                                }
                                if v.at_risk() {
                                    assert!(
                                        in_use && severity == Some(Severity::Terminate),
                                        "{}",
                                        ctx()
                                    );
                                }
                                // A match whose pod already terminates: protected, at
                                // risk only if the kubelet's kill comes after the VM's death.
                                if let (
                                    true,
                                    false,
                                    Some(Severity::Terminate),
                                    Some(d),
                                    Some(kill),
                                ) = (
                                    in_use,
                                    deleting || terminal,
                                    severity,
                                    deadline,
                                    pod.and_then(|p| p.deletion),
                                ) {
                                    assert_eq!(
                                        v,
                                        Verdict::Protect { at_risk: kill > d },
                                        "{}",
                                        ctx()
                                    );
                                }
                                if let Verdict::EndGracefully { at, at_risk } = v {
                                    assert_eq!(severity, Some(Severity::Terminate), "{}", ctx());
                                    let d = deadline.expect("ended without a Terminate deadline");
                                    let pod = pod.expect("ended a server whose pod is unseen");
                                    assert_eq!(pod.deletion, None, "{}", ctx());
                                    // Never before deadline − grace; now only once the
                                    // deadline is within grace.
                                    let grace = SignedDuration::try_from(pod.grace).unwrap();
                                    assert_eq!(at, d - grace, "{}", ctx());
                                    if at <= now() {
                                        assert!(d <= now() + grace, "{}", ctx());
                                    }
                                    assert_eq!(at_risk, at < now(), "{}", ctx());
                                    let permitted = graceful
                                        || *sf == Sf::Always
                                        || (*sf == Sf::OnUpgrade && UPGRADE_LIKE.contains(&cause));
                                    assert!(permitted, "ended without permission: {}", ctx());
                                    assert!(
                                        graceful || cause != ScaleDown || *sf == Sf::Always,
                                        "only Always (or the operator) lets an autoscaler end a match: {}",
                                        ctx()
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(checked > 500_000, "{checked}");
}

fn view(name: &str, state: GsState, safe: EvictionSafe) -> GameServerView {
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
        eviction_safe: safe,
        template_annotations: Default::default(),
    }
}

fn pod_of(gs: &GameServerView) -> PodView {
    PodView {
        namespace: gs.namespace.clone(),
        name: gs.name.clone(),
        uid: format!("pod-{}", gs.uid),
        resource_version: "20".into(),
        gameserver: Some(gs.name.clone()),
        annotations: Default::default(),
        tolerations: vec![],
        deleting: false,
        deletion_timestamp: None,
        termination_grace: GRACE,
        finished: false,
    }
}

#[test]
fn matches_at_risk_counts_threatened_matches_only() {
    let mut leaving = view("a-leaving", GsState::Allocated, EvictionSafe::Never);
    leaving.deleting = true;
    let servers = vec![
        view("a-never", GsState::Allocated, EvictionSafe::Never),
        view("s-never", GsState::Reserved, EvictionSafe::Never),
        view("a-always", GsState::Allocated, EvictionSafe::Always),
        view("r-never", GsState::Ready, EvictionSafe::Never),
        leaving,
        // No pod seen: grace unknown, so at risk even though Always permits ending it.
        view("a-unseen", GsState::Allocated, EvictionSafe::Always),
    ];
    let pods: Vec<PodView> = servers
        .iter()
        .filter(|g| g.name != "a-unseen")
        .map(pod_of)
        .collect();
    let off = EvictionConfig::default();
    let terminate = |deadline| Pressure {
        cause: Maintenance,
        severity: Severity::Terminate,
        deadline: Some(ts(deadline)),
    };
    // Far: the Always server gets its full grace; the Never ones and the unseen one do not.
    let far = terminate("2026-11-30T07:00:00Z");
    assert_eq!(matches_at_risk(&servers, &pods, Some(&far), &off, now()), 3);
    // Within grace: even the Always server's grace is cut short.
    let near = terminate("2026-11-30T05:05:00Z");
    assert_eq!(
        matches_at_risk(&servers, &pods, Some(&near), &off, now()),
        4
    );
    // With graceful termination on, far deadlines put only the unseen one at risk.
    let on = EvictionConfig {
        graceful_termination: true,
    };
    assert_eq!(matches_at_risk(&servers, &pods, Some(&far), &on, now()), 1);
    // A Drain, or nothing at all, puts no match at risk.
    let drain = Pressure {
        severity: Severity::Drain,
        ..far
    };
    assert_eq!(
        matches_at_risk(&servers, &pods, Some(&drain), &off, now()),
        0
    );
    assert_eq!(matches_at_risk(&servers, &pods, None, &off, now()), 0);
}

fn gameserver(
    spec_safe: Option<serde_json::Value>,
    status_safe: Option<serde_json::Value>,
) -> DynamicObject {
    let mut obj = serde_json::json!({
        "apiVersion": "agones.dev/v1", "kind": "GameServer",
        "metadata": {"name": "gs-1", "namespace": "default", "uid": "u1", "resourceVersion": "9"},
        "spec": {},
        "status": {"state": "Allocated"}
    });
    if let Some(v) = spec_safe {
        obj["spec"]["eviction"] = serde_json::json!({ "safe": v });
    }
    if let Some(v) = status_safe {
        obj["status"]["eviction"] = serde_json::json!({ "safe": v });
    }
    serde_json::from_value(obj).unwrap()
}

#[test]
fn eviction_safe_is_parsed_once_at_the_edge() {
    use serde_json::json;
    let safe = |spec, status| {
        GameServerView::from_dynamic(&gameserver(spec, status))
            .unwrap()
            .eviction_safe
    };
    // Absent is Agones' default.
    assert_eq!(safe(None, None), EvictionSafe::Never);
    // Spec when status has none yet; status (what Agones enforces) wins over spec.
    assert_eq!(
        safe(Some(json!("OnUpgrade")), None),
        EvictionSafe::OnUpgrade
    );
    assert_eq!(
        safe(Some(json!("Never")), Some(json!("Always"))),
        EvictionSafe::Always
    );
    assert_eq!(
        safe(Some(json!("Always")), Some(json!(""))),
        EvictionSafe::Always
    );
    // Unknown values and wrong types are kept as Unknown, and permit nothing.
    for (spec, status) in [
        (None, Some(json!("always"))),
        (Some(json!("Sometimes")), None),
        (Some(json!(true)), None),
    ] {
        let s = safe(spec, status);
        assert!(s.is_unknown(), "{s:?}");
        assert_eq!(s.metric_label(), "unknown");
        assert!(Cause::ALL.iter().all(|c| !s.permits(*c)), "{s:?}");
    }
}

#[test]
fn pod_grace_and_kill_time_are_parsed_once_at_the_edge() {
    let pod = |spec: serde_json::Value, deletion: Option<&str>| {
        let mut p = serde_json::json!({
            "metadata": {"name": "gs-1", "namespace": "default", "resourceVersion": "7",
                         "labels": {"agones.dev/role": "gameserver", "agones.dev/gameserver": "gs-1"}},
            "spec": spec
        });
        if let Some(d) = deletion {
            p["metadata"]["deletionTimestamp"] = serde_json::json!(d);
        }
        let p: Pod = serde_json::from_value(p).unwrap();
        PodView::from_pod(&p).unwrap()
    };
    let p = pod(
        serde_json::json!({"containers": [], "terminationGracePeriodSeconds": 2100}),
        Some("2026-11-30T05:35:00Z"),
    );
    assert_eq!(p.termination_grace, Duration::from_secs(2100));
    assert_eq!(p.deletion_timestamp, Some(ts("2026-11-30T05:35:00Z")));
    assert_eq!(PodFacts::of(&p).deletion, Some(ts("2026-11-30T05:35:00Z")));
    // Absent or invalid: Kubernetes' default.
    let p = pod(serde_json::json!({"containers": []}), None);
    assert_eq!(
        p.termination_grace,
        crate::observed::DEFAULT_TERMINATION_GRACE
    );
    assert_eq!(PodFacts::of(&p).deletion, None);
    let p = pod(
        serde_json::json!({"containers": [], "terminationGracePeriodSeconds": -5}),
        None,
    );
    assert_eq!(
        p.termination_grace,
        crate::observed::DEFAULT_TERMINATION_GRACE
    );
    // Deleting with no readable time is the latest possible kill: the at-risk side.
    let mut p = pod(serde_json::json!({"containers": []}), None);
    p.deleting = true;
    assert_eq!(PodFacts::of(&p).deletion, Some(Timestamp::MAX));
}
