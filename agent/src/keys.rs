//! Every Kubernetes key lastcall reads or writes, in one place.
//!
//! Our own keys live under `lastcall.dev/`; the `gamelift.status/` ones reproduce the original
//! adapter on the wire in compatibility mode.

/// NoSchedule taint that keeps new pods (and Fleet replacements) off a draining node.
/// Its value names the source that started the drain.
pub const TAINT_DRAINING: &str = "lastcall.dev/draining";
/// Label on every GameServer of a draining node, so allocators can exclude them.
pub const LABEL_NODE_DRAINING: &str = "lastcall.dev/node-draining";
/// Label on the GameServers of a node, put there by that node's agent. It lets the agent watch
/// exactly its own GameServers (Agones' CRD has no field selector on `status.nodeName`).
pub const LABEL_NODE: &str = "lastcall.dev/node";

/// The value of `LABEL_NODE` for a node. Node names may be up to 253 characters, label
/// values only 63: a longer (or otherwise invalid) name becomes a stable prefix plus a hash,
/// so the label-filtered watch keeps working instead of failing with 400 forever.
pub fn node_label_value(node: &str) -> String {
    let valid = |s: &str| {
        s.len() <= 63
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && s.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
            && s.chars().last().is_some_and(|c| c.is_ascii_alphanumeric())
    };
    if valid(node) {
        return node.to_string();
    }
    // FNV-1a: stable across Rust versions and builds, unlike the std hasher.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in node.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    let prefix: String = node
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.'))
        .take(40)
        .collect();
    let prefix = prefix.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    if prefix.is_empty() {
        format!("h{h:016x}")
    } else {
        format!("{prefix}-h{h:016x}")
    }
}
/// Operators set this label to `true` on a Node to drain it by hand.
pub const LABEL_MANUAL_DRAIN: &str = "lastcall.dev/drain";

/// Annotations on protected (Allocated/Reserved) GameServers, for the game to read.
pub const ANN_GS_DEADLINE: &str = "lastcall.dev/drain-deadline";
pub const ANN_GS_REASON: &str = "lastcall.dev/drain-reason";

/// The machine's boot id (`status.nodeInfo.bootID`) when the drain started: a different
/// one means the machine came back (a stopped Spot VM restarted, a reboot, a preempted VM
/// started again) and the drain's finality belongs to a life that is over.
pub const ANN_BOOT_ID: &str = "lastcall.dev/drain-boot-id";
/// Drain progress kept on the Node, so a restarted agent resumes instead of repeating.
pub const ANN_STARTED: &str = "lastcall.dev/drain-started";
pub const ANN_CAUSE: &str = "lastcall.dev/drain-cause";
/// When lastcall last put back a fence another writer had stripped (its taint, or the
/// cordon it made): the fence has stood only since then, so the settle before any hand-off
/// counts from it.
pub const ANN_FENCE_RESTORED: &str = "lastcall.dev/fence-restored";
pub const ANN_CORDONED: &str = "lastcall.dev/cordoned-by-lastcall";
pub const ANN_DEREGISTERED: &str = "lastcall.dev/deregistered";
pub const ANN_REGISTERED: &str = "lastcall.dev/registered";
/// The agent that owns the node, as `<namespace>/<pod>/<uid>`: one agent acts at a time,
/// also while a rollout runs an old and a new agent side by side.
pub const ANN_OWNER: &str = "lastcall.dev/owner";
/// The notice driving the drain (source, cause, severity, deadline, cancellable, first
/// seen) as JSON, so a restarted agent decides exactly as before: a Spot interruption stays
/// final and its deadline does not move.
pub const ANN_NOTICE: &str = "lastcall.dev/drain-notice";
/// GKE starts pending host maintenance early when this label is `true` on the Node.
pub const LABEL_GKE_PERFORM_MAINTENANCE: &str = "cloud.google.com/perform-maintenance";
/// lastcall asked GKE to start maintenance early (set once, with the label, never again).
pub const ANN_HANDED_BACK: &str = "lastcall.dev/handed-back";
/// lastcall added the compat `gamelift.status/draining` taint; only then may a cancel remove it.
pub const ANN_COMPAT_DRAINING: &str = "lastcall.dev/compat-draining-taint";

/// The original adapter's taints and toleration (compatibility mode).
pub const COMPAT_TAINT_ACTIVE: &str = "gamelift.status/active";
pub const COMPAT_TAINT_DRAINING: &str = "gamelift.status/draining";

/// Agones.
pub const AGONES_ROLE: &str = "agones.dev/role";
pub const AGONES_GAMESERVER: &str = "agones.dev/gameserver";
pub const AGONES_FLEET: &str = "agones.dev/fleet";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_label_values_are_valid_and_stable() {
        assert_eq!(
            node_label_value("ip-10-0-1-2.ec2.internal"),
            "ip-10-0-1-2.ec2.internal"
        );
        let long = format!("{}.compute.internal", "gke-game-pool-".repeat(6));
        let v = node_label_value(&long);
        assert!(v.len() <= 63, "{v}");
        assert_eq!(v, node_label_value(&long), "stable");
        assert_ne!(v, node_label_value(&format!("{long}x")), "distinct");
        assert!(
            v.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.'))
        );
        assert!(node_label_value("...").starts_with('h'));
    }
}
