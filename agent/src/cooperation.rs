//! Autoscaler cooperation (opt-in): the annotations that keep the cluster autoscaler and
//! Karpenter off a node holding a match.
//!
//! The facts behind it are in `docs/autoscalers.md`. In short: the cluster autoscaler will
//! not pick a node with a pod that says `cluster-autoscaler.kubernetes.io/safe-to-evict:
//! "false"`, and re-reads pods after tainting the node; Karpenter will not pick a node with a
//! `karpenter.sh/do-not-disrupt` pod and will not evict such a pod. So lastcall keeps, on each
//! game-server pod of its node:
//!
//! | game server | mode `in-use` | mode `all` |
//! |---|---|---|
//! | Allocated, Reserved, unknown state | `do-not-disrupt: "true"`, `safe-to-evict: "false"` | same |
//! | Ready, or not Ready yet | Agones' own values (nothing of lastcall's) | `do-not-disrupt: "true"`, `safe-to-evict: "false"` |
//!
//! lastcall only ever writes protective values. Whatever it leaves behind when it is gone
//! (uninstalled, crash-looping, cut off) keeps a pod *more* protected than Agones would, never
//! less: a server allocated while no agent watches has exactly Agones' own values. (Writing
//! `safe-to-evict: "true"` on idle pods would let the cluster autoscaler take idle nodes, but
//! such a pod allocated while the agent is away would stay evictable for as long as it is
//! away.) With `off`, lastcall removes what it set and restores Agones' own `safe-to-evict`
//! value (`"true"` for `eviction.safe: Always`, else `"false"`); so does `lastcall-agent
//! --cleanup-cooperation` for the whole cluster (the chart's pre-delete hook).
//!
//! A key the user set in the GameServer's pod template is never touched. The pod records what
//! lastcall manages in `lastcall.dev/managed-annotations`, so turning the feature off undoes
//! exactly that. Pure: the planner turns [`desired`] into one merge patch per pod that needs
//! one, so the load stays O(own node) and a transition costs one write.

use std::collections::BTreeMap;

pub mod cleanup;

use crate::eviction::EvictionSafe;
use crate::observed::{GameServerView, GsState, PodView};

pub const ANN_DO_NOT_DISRUPT: &str = "karpenter.sh/do-not-disrupt";
pub const ANN_SAFE_TO_EVICT: &str = "cluster-autoscaler.kubernetes.io/safe-to-evict";
/// Which of the two keys lastcall wrote on this pod (comma-separated, sorted).
pub const ANN_MANAGED: &str = "lastcall.dev/managed-annotations";
/// Per node pool: a Node label that overrides `--autoscaler-cooperation`.
pub const LABEL_MODE: &str = "lastcall.dev/autoscaler-cooperation";

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// lastcall writes nothing (and removes what it wrote before).
    #[default]
    Off,
    /// Matches are protected; idle servers keep Agones' own values.
    InUse,
    /// Every game server is protected; only lastcall releases idle ones.
    All,
}

impl Mode {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "off" => Some(Self::Off),
            "in-use" => Some(Self::InUse),
            "all" => Some(Self::All),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::InUse => "in-use",
            Self::All => "all",
        }
    }

    /// The mode for this node: its label when that names a mode, else the flag. An unknown
    /// label value is reported (`Err`) and the flag applies.
    pub fn for_node(labels: &BTreeMap<String, String>, flag: Mode) -> Result<Mode, String> {
        match labels.get(LABEL_MODE) {
            None => Ok(flag),
            Some(v) => Self::parse(v).ok_or_else(|| v.clone()),
        }
    }
}

/// The annotation changes one pod needs: `Some(v)` sets, `None` removes. Empty: nothing.
pub type Changes = BTreeMap<String, Option<String>>;

fn protected(state: &GsState, mode: Mode) -> bool {
    match mode {
        Mode::Off => false,
        Mode::InUse => state.is_in_use(),
        Mode::All => true,
    }
}

/// What lastcall wants on `pod` (of `gs`) in `mode`, as changes against what is there.
pub fn desired(gs: &GameServerView, pod: &PodView, mode: Mode) -> Changes {
    let current = |k: &str| pod.annotations.get(k).cloned();
    let managed: Vec<&str> = pod
        .annotations
        .get(ANN_MANAGED)
        .map(|m| m.split(',').filter(|s| !s.is_empty()).collect())
        .unwrap_or_default();
    // The user's own values, from the GameServer's pod template: never ours to change.
    let users = |k: &str| gs.template_annotations.contains(k);
    let protect = protected(&gs.state, mode);
    let mut want: BTreeMap<&str, Option<String>> = BTreeMap::new();
    if protect {
        for (k, v) in [(ANN_DO_NOT_DISRUPT, "true"), (ANN_SAFE_TO_EVICT, "false")] {
            if !users(k) {
                want.insert(k, Some(v.to_string()));
            }
        }
    } else {
        // Nothing of lastcall's: Agones' own values back where lastcall wrote.
        for k in &managed {
            want.insert(
                k,
                (*k == ANN_SAFE_TO_EVICT).then(|| agones_default(&gs.eviction_safe).to_string()),
            );
        }
    }
    let mut changes = Changes::new();
    for (k, v) in &want {
        if current(k) != *v {
            changes.insert((*k).to_string(), v.clone());
        }
    }
    let marker: Vec<&str> = if protect {
        want.keys().copied().collect()
    } else {
        vec![]
    };
    let marker = (!marker.is_empty()).then(|| marker.join(","));
    if current(ANN_MANAGED) != marker {
        changes.insert(ANN_MANAGED.to_string(), marker);
    }
    changes
}

/// An in-use server whose pod an autoscaler may still take although cooperation is on for
/// its node: `safe-to-evict: "true"` or no `do-not-disrupt`, on keys that are not the
/// user's. True for a moment after an allocation, until lastcall's write lands; for longer,
/// something reverts it (an admission policy) or lastcall cannot write.
pub fn exposed(gs: &GameServerView, pod: &PodView, mode: Mode) -> bool {
    let users = |k: &str| gs.template_annotations.contains(k);
    let value = |k: &str| pod.annotations.get(k).map(String::as_str);
    mode != Mode::Off
        && gs.state.is_in_use()
        && ((!users(ANN_SAFE_TO_EVICT) && value(ANN_SAFE_TO_EVICT) == Some("true"))
            || (!users(ANN_DO_NOT_DISRUPT) && value(ANN_DO_NOT_DISRUPT) != Some("true")))
}

/// The value Agones itself puts on a game-server pod for its `eviction.safe`.
fn agones_default(safe: &EvictionSafe) -> &'static str {
    match safe {
        EvictionSafe::Always => "true",
        _ => "false",
    }
}

#[cfg(test)]
mod tests;
