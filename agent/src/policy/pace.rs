//! Release pacing (see [`Pacing`](super::Pacing)): how many of a Fleet's Ready servers
//! leave a draining node in this pass, and which are held back.

use std::collections::BTreeMap;

use jiff::Timestamp;

use crate::deadline::Pressure;
use crate::keys;
use crate::notice::Severity;
use crate::observed::GsState;
use crate::progress::Progress;

use super::{Action, GsRef, Inputs};

/// With a floor, how long after its drain started a node first releases a paced server.
pub(super) const FLOOR_SETTLE: jiff::SignedDuration = jiff::SignedDuration::from_secs(2);

/// How long a Fleet held back by the floor waits before its status is read again.
pub(super) const FLOOR_RECHECK: jiff::SignedDuration = jiff::SignedDuration::from_secs(1);

fn wake(wake_at: &mut Option<Timestamp>, at: Timestamp) {
    *wake_at = Some(wake_at.map_or(at, |w| w.min(at)));
}

/// Release pacing (see [`Pacing`]) on this pass's releases: those that go now, and the
/// labels for the Ready servers held back that do not carry `lastcall.dev/node-draining`
/// yet. Only Ready servers are paced: they are the Fleet's capacity. One not Ready yet, or
/// whose pod is already terminating, goes at once; so does everything under a Terminate
/// notice or once the hold has lasted its longest.
pub(super) fn pace(
    inp: &Inputs<'_>,
    pressure: Option<&Pressure>,
    releases: Vec<Action>,
    wake_at: &mut Option<Timestamp>,
) -> (Vec<Action>, Vec<Action>) {
    if !inp.config.pacing.is_on() || pressure.is_some_and(|p| p.severity == Severity::Terminate) {
        return (releases, vec![]);
    }
    let hold_end = hold_end(inp, pressure);
    if hold_end <= inp.now {
        return (releases, vec![]);
    }
    let obs = inp.observed;
    let mut budget: BTreeMap<(String, String), i64> = BTreeMap::new();
    let mut out = vec![];
    let mut held = vec![];
    let mut holding = false;
    for a in releases {
        let paced = match &a {
            Action::Release { gs } => obs
                .game_servers
                .iter()
                .find(|g| g.uid == gs.uid)
                .filter(|g| g.state == GsState::Ready)
                .filter(|g| obs.pod_of(g).is_none_or(|p| !p.deleting))
                .and_then(|g| Some((g, (g.namespace.clone(), g.fleet()?.to_string())))),
            _ => None,
        };
        let Some((g, fleet)) = paced else {
            out.push(a);
            continue;
        };
        let labelled = g.labels.get(keys::LABEL_NODE_DRAINING).map(String::as_str) == Some("true");
        if inp.config.pacing.floor > 0 && !labelled {
            // With a floor, every Ready server on a draining node is marked before any goes,
            // so the agents of other draining nodes count it as leaving, not as capacity.
            held.push(Action::Exclude { gs: GsRef::of(g) });
            continue;
        }
        let left = budget
            .entry(fleet.clone())
            .or_insert_with(|| fleet_budget(inp, &fleet, wake_at));
        if *left > 0 {
            *left -= 1;
            out.push(a);
            continue;
        }
        holding = true;
        if !labelled {
            held.push(Action::Exclude { gs: GsRef::of(g) });
        }
    }
    if holding {
        wake(wake_at, hold_end);
    }
    (out, held)
}

/// When release pacing stops holding Ready servers back: the notice's deadline, or
/// `hold_max` after the drain started, whichever comes first.
fn hold_end(inp: &Inputs<'_>, pressure: Option<&Pressure>) -> Timestamp {
    let started = Progress::from_annotations(&inp.observed.node.annotations)
        .started
        .filter(|t| *t > Timestamp::UNIX_EPOCH)
        .unwrap_or(inp.now);
    let max = jiff::SignedDuration::try_from(inp.config.pacing.hold_max)
        .ok()
        .and_then(|d| started.checked_add(d).ok())
        .unwrap_or(Timestamp::MAX);
    pressure
        .and_then(|p| p.deadline)
        .map_or(max, |d| d.min(max))
}

/// How many of a Fleet's Ready servers this pass may release.
fn fleet_budget(
    inp: &Inputs<'_>,
    (ns, fleet): &(String, String),
    wake_at: &mut Option<Timestamp>,
) -> i64 {
    let pacing = inp.config.pacing;
    let facts = inp
        .observed
        .fleets
        .get(&(ns.clone(), fleet.clone()))
        .cloned()
        .unwrap_or_default();
    let mut budget = i64::MAX;
    if let Ok(interval) = jiff::SignedDuration::try_from(pacing.interval)
        && !interval.is_zero()
    {
        if let Some(next) = facts
            .last_release
            .and_then(|l| l.checked_add(interval).ok())
            && next > inp.now
        {
            wake(wake_at, next);
            return 0;
        }
        budget = i64::from(pacing.batch.max(1));
    }
    if pacing.floor > 0 {
        // Nodes that started draining at about the same time mark their servers within a
        // round trip or two: decide once they can have, so none counts another's as capacity.
        let started = Progress::from_annotations(&inp.observed.node.annotations)
            .started
            .filter(|t| *t > Timestamp::UNIX_EPOCH)
            .unwrap_or(inp.now);
        if let Ok(settled) = started.checked_add(FLOOR_SETTLE)
            && settled > inp.now
        {
            wake(wake_at, settled);
            return 0;
        }
        // Keep here what the floor needs beyond the Ready servers elsewhere.
        let here = inp.observed.ready_here(ns, fleet);
        let spare = match facts.ready_elsewhere {
            Some(elsewhere) => here - (i64::from(pacing.floor) - elsewhere).max(0),
            // Unknown: hold (the Fleet's capacity is what the floor protects), and look again.
            None => 0,
        };
        if spare <= 0
            && let Ok(t) = inp.now.checked_add(FLOOR_RECHECK)
        {
            wake(wake_at, t);
        }
        budget = budget.min(spare.max(0));
    }
    budget
}
