//! Autoscaler cooperation (opt-in): the annotations that let the cluster autoscaler and
//! Karpenter take a node holding only idle game servers, and never one holding a match.
//!
//! The facts behind it are in `docs/autoscalers.md`. In short: the cluster autoscaler will
//! not pick a node with a pod that is owned by a custom controller (a GameServer) unless the
//! pod says `cluster-autoscaler.kubernetes.io/safe-to-evict: "true"`, and it re-reads pods
//! after tainting the node; Karpenter will not pick a node with a `karpenter.sh/do-not-disrupt`
//! pod and will not evict such a pod. So lastcall keeps, on each game-server pod of its node:
//!
//! | game server | mode `in-use` | mode `all` |
//! |---|---|---|
//! | Allocated, Reserved, unknown state | `do-not-disrupt: "true"`, `safe-to-evict: "false"` | same |
//! | Ready, or not Ready yet | no `do-not-disrupt`, `safe-to-evict: "true"` | `do-not-disrupt: "true"`, `safe-to-evict: "false"` |
//!
//! `all` keeps autoscalers off every game-server node (idle servers leave only when lastcall
//! releases them on a signal). With `off`, lastcall removes what it set and restores Agones'
//! own `safe-to-evict` value (`"true"` for `eviction.safe: Always`, else `"false"`).
//!
//! A key the user set in the GameServer's pod template is never touched. The pod records what
//! lastcall manages in `lastcall.dev/managed-annotations`, so turning the feature off undoes
//! exactly that. Pure: the planner turns [`desired`] into one merge patch per pod that needs
//! one, so the load stays O(own node) and a transition costs one write.

use std::collections::BTreeMap;

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
    /// Matches are protected; idle servers may be taken with their node.
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
    state.is_in_use() || mode == Mode::All
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
    let mut want: BTreeMap<&str, Option<String>> = BTreeMap::new();
    if mode == Mode::Off {
        for k in &managed {
            want.insert(
                k,
                (*k == ANN_SAFE_TO_EVICT).then(|| agones_default(&gs.eviction_safe).to_string()),
            );
        }
    } else {
        let keep = protected(&gs.state, mode);
        for k in [ANN_DO_NOT_DISRUPT, ANN_SAFE_TO_EVICT] {
            if users(k) {
                continue;
            }
            let v = match (k, keep) {
                (ANN_DO_NOT_DISRUPT, true) => Some("true".to_string()),
                (ANN_DO_NOT_DISRUPT, false) => None,
                (_, true) => Some("false".to_string()),
                (_, false) => Some("true".to_string()),
            };
            want.insert(k, v);
        }
    }
    let mut changes = Changes::new();
    for (k, v) in &want {
        if current(k) != *v {
            changes.insert((*k).to_string(), v.clone());
        }
    }
    let marker: Vec<&str> = if mode == Mode::Off {
        vec![]
    } else {
        want.keys().copied().collect()
    };
    let marker = (!marker.is_empty()).then(|| marker.join(","));
    if current(ANN_MANAGED) != marker {
        changes.insert(ANN_MANAGED.to_string(), marker);
    }
    changes
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
