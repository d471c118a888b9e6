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
/// Operators set this label to `true` on a Node to drain it by hand.
pub const LABEL_MANUAL_DRAIN: &str = "lastcall.dev/drain";

/// Annotations on protected (Allocated/Reserved) GameServers, for the game to read.
pub const ANN_GS_DEADLINE: &str = "lastcall.dev/drain-deadline";
pub const ANN_GS_REASON: &str = "lastcall.dev/drain-reason";

/// Drain progress kept on the Node, so a restarted agent resumes instead of repeating.
pub const ANN_STARTED: &str = "lastcall.dev/drain-started";
pub const ANN_CAUSE: &str = "lastcall.dev/drain-cause";
pub const ANN_CORDONED: &str = "lastcall.dev/cordoned-by-lastcall";
pub const ANN_DEREGISTERED: &str = "lastcall.dev/deregistered";
pub const ANN_REGISTERED: &str = "lastcall.dev/registered";

/// The original adapter's taints and toleration (compatibility mode).
pub const COMPAT_TAINT_ACTIVE: &str = "gamelift.status/active";
pub const COMPAT_TAINT_DRAINING: &str = "gamelift.status/draining";

/// Agones.
pub const AGONES_ROLE: &str = "agones.dev/role";
pub const AGONES_GAMESERVER: &str = "agones.dev/gameserver";
pub const AGONES_FLEET: &str = "agones.dev/fleet";
