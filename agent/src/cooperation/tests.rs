use std::collections::BTreeMap;

use super::*;
use crate::observed::DEFAULT_TERMINATION_GRACE;

fn gs(state: GsState) -> GameServerView {
    GameServerView {
        namespace: "default".into(),
        name: "g".into(),
        uid: "u".into(),
        resource_version: "1".into(),
        state,
        deleting: false,
        node_name: Some("n1".into()),
        labels: BTreeMap::new(),
        annotations: BTreeMap::new(),
        eviction_safe: EvictionSafe::Never,
        template_annotations: Default::default(),
    }
}

fn pod(annotations: &[(&str, &str)]) -> PodView {
    PodView {
        namespace: "default".into(),
        name: "g".into(),
        uid: "p".into(),
        resource_version: "1".into(),
        gameserver: Some("g".into()),
        annotations: annotations
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        tolerations: vec![],
        deleting: false,
        deletion_timestamp: None,
        termination_grace: DEFAULT_TERMINATION_GRACE,
        finished: false,
    }
}

fn set(pairs: &[(&str, Option<&str>)]) -> Changes {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.map(str::to_string)))
        .collect()
}

/// Applies changes to a pod, as the merge patch does.
fn apply(p: &mut PodView, c: &Changes) {
    for (k, v) in c {
        match v {
            Some(v) => p.annotations.insert(k.clone(), v.clone()),
            None => p.annotations.remove(k),
        };
    }
}

const AGONES_NEVER: (&str, &str) = (ANN_SAFE_TO_EVICT, "false");

#[test]
fn matches_are_kept_from_autoscalers_and_idle_servers_keep_agones_values() {
    // Agones put "false" on every pod (eviction.safe Never).
    let p = pod(&[AGONES_NEVER]);
    assert_eq!(
        desired(&gs(GsState::Allocated), &p, Mode::InUse),
        set(&[
            (ANN_DO_NOT_DISRUPT, Some("true")),
            (
                ANN_MANAGED,
                Some(&format!("{ANN_SAFE_TO_EVICT},{ANN_DO_NOT_DISRUPT}"))
            ),
        ])
    );
    // An idle server is never marked evictable: were it allocated while no agent runs, it
    // would stay so.
    for s in [GsState::Ready, GsState::Scheduled, GsState::Empty] {
        assert!(desired(&gs(s), &p, Mode::InUse).is_empty());
    }
    for safe in [EvictionSafe::Never, EvictionSafe::OnUpgrade] {
        let mut g = gs(GsState::Ready);
        g.eviction_safe = safe;
        let mut p = pod(&[AGONES_NEVER]);
        for state in [GsState::Ready, GsState::Allocated, GsState::Ready] {
            g.state = state;
            let c = desired(&g, &p, Mode::InUse);
            apply(&mut p, &c);
            assert_ne!(
                p.annotations.get(ANN_SAFE_TO_EVICT).map(String::as_str),
                Some("true"),
                "{:?}",
                g.state
            );
        }
    }
    // Mode all: idle servers are protected too.
    assert_eq!(
        desired(&gs(GsState::Ready), &p, Mode::All)
            .get(ANN_DO_NOT_DISRUPT)
            .cloned(),
        Some(Some("true".into()))
    );
    // Reserved and unknown states count as in use.
    for s in [GsState::Reserved, GsState::Unknown("Future".into())] {
        assert_eq!(
            desired(&gs(s), &p, Mode::InUse)
                .get(ANN_DO_NOT_DISRUPT)
                .cloned(),
            Some(Some("true".into()))
        );
    }
}

#[test]
fn each_transition_is_one_change_set_and_then_nothing() {
    let mut p = pod(&[AGONES_NEVER]);
    let mut g = gs(GsState::Ready);
    for (state, dnd, ste) in [
        (GsState::Allocated, Some("true"), "false"),
        (GsState::Ready, None, "false"),
        (GsState::Reserved, Some("true"), "false"),
    ] {
        g.state = state;
        let c = desired(&g, &p, Mode::InUse);
        assert!(!c.is_empty());
        apply(&mut p, &c);
        assert!(desired(&g, &p, Mode::InUse).is_empty(), "converged");
        assert_eq!(
            p.annotations.get(ANN_DO_NOT_DISRUPT).map(String::as_str),
            dnd
        );
        assert_eq!(
            p.annotations.get(ANN_SAFE_TO_EVICT).map(String::as_str),
            Some(ste)
        );
    }
}

#[test]
fn values_the_user_set_in_the_template_are_never_touched() {
    let mut g = gs(GsState::Allocated);
    g.template_annotations.insert(ANN_SAFE_TO_EVICT.into());
    let p = pod(&[(ANN_SAFE_TO_EVICT, "false")]);
    let c = desired(&g, &p, Mode::InUse);
    assert!(!c.contains_key(ANN_SAFE_TO_EVICT), "{c:?}");
    assert_eq!(
        c.get(ANN_MANAGED).cloned(),
        Some(Some(ANN_DO_NOT_DISRUPT.into()))
    );
    g.template_annotations.insert(ANN_DO_NOT_DISRUPT.into());
    let p = pod(&[(ANN_SAFE_TO_EVICT, "false"), (ANN_DO_NOT_DISRUPT, "true")]);
    assert!(desired(&g, &p, Mode::InUse).is_empty());
}

#[test]
fn off_undoes_exactly_what_lastcall_set_and_restores_agones_value() {
    let mut p = pod(&[AGONES_NEVER, ("other.example/keep", "x")]);
    let mut g = gs(GsState::Allocated);
    let c = desired(&g, &p, Mode::InUse);
    apply(&mut p, &c);
    g.state = GsState::Ready;
    let c = desired(&g, &p, Mode::InUse);
    apply(&mut p, &c);
    let c = desired(&g, &p, Mode::Off);
    apply(&mut p, &c);
    assert_eq!(
        p.annotations,
        [AGONES_NEVER, ("other.example/keep", "x")]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<BTreeMap<_, _>>()
    );
    // Never written, nothing to undo.
    assert!(desired(&g, &pod(&[AGONES_NEVER]), Mode::Off).is_empty());
    // Always: Agones' own value is "true".
    let mut always = gs(GsState::Allocated);
    always.eviction_safe = EvictionSafe::Always;
    let mut p = pod(&[(ANN_SAFE_TO_EVICT, "true")]);
    let c = desired(&always, &p, Mode::InUse);
    apply(&mut p, &c);
    assert_eq!(
        p.annotations.get(ANN_SAFE_TO_EVICT).map(String::as_str),
        Some("false")
    );
    let c = desired(&always, &p, Mode::Off);
    apply(&mut p, &c);
    assert_eq!(
        p.annotations.get(ANN_SAFE_TO_EVICT).map(String::as_str),
        Some("true")
    );
    assert!(!p.annotations.contains_key(ANN_DO_NOT_DISRUPT));
}

#[test]
fn the_node_label_picks_the_mode_per_node_pool() {
    let labels = |v: &str| BTreeMap::from([(LABEL_MODE.to_string(), v.to_string())]);
    assert_eq!(Mode::for_node(&BTreeMap::new(), Mode::Off), Ok(Mode::Off));
    assert_eq!(
        Mode::for_node(&labels("in-use"), Mode::Off),
        Ok(Mode::InUse)
    );
    assert_eq!(Mode::for_node(&labels("all"), Mode::InUse), Ok(Mode::All));
    assert_eq!(Mode::for_node(&labels("off"), Mode::All), Ok(Mode::Off));
    assert_eq!(
        Mode::for_node(&labels("yes"), Mode::InUse),
        Err("yes".into())
    );
}

#[test]
fn an_in_use_server_is_exposed_until_its_protection_lands() {
    let g = gs(GsState::Allocated);
    let agones = pod(&[AGONES_NEVER]);
    assert!(exposed(&g, &agones, Mode::InUse), "no do-not-disrupt yet");
    assert!(
        !exposed(&g, &agones, Mode::Off),
        "cooperation off: not lastcall's"
    );
    assert!(!exposed(&gs(GsState::Ready), &agones, Mode::InUse));
    let mut p = agones.clone();
    let c = desired(&g, &p, Mode::InUse);
    apply(&mut p, &c);
    assert!(!exposed(&g, &p, Mode::InUse));
    // A webhook sets safe-to-evict back to "true".
    p.annotations
        .insert(ANN_SAFE_TO_EVICT.into(), "true".into());
    assert!(exposed(&g, &p, Mode::InUse));
    // The user's own template value is the user's choice.
    let mut users = g.clone();
    users.template_annotations.insert(ANN_SAFE_TO_EVICT.into());
    assert!(!exposed(&users, &p, Mode::InUse));
}
