//! The emulated FleetIQ world: game server groups, their instances and game servers.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use super::{GameServerRecord, InstanceStatus, Malformed};

/// Account and region baked into every ARN the emulator hands out.
pub const ARN_PREFIX: &str = "arn:aws:gamelift:us-west-2:123456789012:gameservergroup/";

/// How long a `ClaimGameServer` claim holds (FleetIQ: "at most 1 minute").
pub const CLAIM_DURATION: Duration = Duration::from_secs(60);

/// Page size used when a caller sends no `Limit` and the test set none.
pub const DEFAULT_PAGE_SIZE: usize = 100;

/// One game server group (an Auto Scaling group under FleetIQ).
#[derive(Debug)]
pub(crate) struct Group {
    pub(crate) name: String,
    pub(crate) arn: String,
    /// Instances in the order they were added; `DescribeGameServerInstances` pages in this order.
    pub(crate) instances: Vec<(String, InstanceStatus)>,
    pub(crate) malformed: Option<Malformed>,
}

/// One game server, kept after deregistration so tests can inspect what happened to it.
#[derive(Debug)]
pub(crate) struct GameServer {
    pub(crate) group: String,
    pub(crate) id: String,
    pub(crate) instance_id: Option<String>,
    pub(crate) connection_info: Option<String>,
    pub(crate) data: Option<String>,
    pub(crate) claimed_at: Option<SystemTime>,
    pub(crate) utilization: String,
    pub(crate) health_checks: usize,
    pub(crate) last_health_check: Option<SystemTime>,
    pub(crate) registered_at: SystemTime,
    pub(crate) registered: bool,
    pub(crate) deregistered_count: usize,
}

impl GameServer {
    /// A claim lapses on its own after [`CLAIM_DURATION`].
    pub(crate) fn is_claimed(&self, now: SystemTime) -> bool {
        self.claimed_at.is_some_and(|at| {
            now.duration_since(at)
                .map(|age| age < CLAIM_DURATION)
                .unwrap_or(true)
        })
    }

    pub(crate) fn record(&self, now: SystemTime) -> GameServerRecord {
        GameServerRecord {
            group: self.group.clone(),
            game_server_id: self.id.clone(),
            instance_id: self.instance_id.clone(),
            claimed: self.is_claimed(now),
            utilization: self.utilization.clone(),
            health_checks: self.health_checks,
            registered: self.registered,
            deregistered_count: self.deregistered_count,
        }
    }
}

/// Everything the operations read and write.
#[derive(Debug)]
pub(crate) struct World {
    pub(crate) groups: BTreeMap<String, Group>,
    /// Keyed by (group name, game server id): ids are unique per group, not globally.
    pub(crate) servers: BTreeMap<(String, String), GameServer>,
    pub(crate) default_page_size: usize,
}

impl Default for World {
    fn default() -> Self {
        World {
            groups: BTreeMap::new(),
            servers: BTreeMap::new(),
            default_page_size: DEFAULT_PAGE_SIZE,
        }
    }
}

impl World {
    /// The ARN FleetIQ would give a group of this name.
    pub(crate) fn arn_for(name: &str) -> String {
        format!("{ARN_PREFIX}{name}")
    }

    /// Creates the group if needed and returns its ARN.
    pub(crate) fn add_group(&mut self, name: &str) -> String {
        self.groups
            .entry(name.to_string())
            .or_insert_with(|| Group {
                name: name.to_string(),
                arn: Self::arn_for(name),
                instances: Vec::new(),
                malformed: None,
            })
            .arn
            .clone()
    }

    /// Resolves a `GameServerGroupName` parameter, which FleetIQ accepts as a name or an ARN.
    pub(crate) fn group(&self, name_or_arn: &str) -> Option<&Group> {
        let name = name_or_arn.strip_prefix(ARN_PREFIX).unwrap_or(name_or_arn);
        self.groups.get(name)
    }

    /// The status of an instance in any group.
    pub(crate) fn instance_status(&self, instance_id: &str) -> Option<InstanceStatus> {
        self.groups.values().find_map(|g| {
            g.instances
                .iter()
                .find(|(id, _)| id == instance_id)
                .map(|(_, s)| *s)
        })
    }
}
