//! The semantics of each emulated FleetIQ operation, on decoded (JSON) input.
//!
//! Each handler validates everything before it mutates anything, so a rejected call
//! leaves the world untouched, as the real service does.

use std::time::SystemTime;

use ciborium::Value;
use serde_json::Value as Json;

use super::InstanceStatus;
use super::Malformed;
use super::cbor::{structure, text, timestamp};
use super::state::{GameServer, World};

/// Most `InstanceIds` one `DescribeGameServerInstances` call may name.
pub const MAX_INSTANCE_IDS: usize = 20;

/// A successful reply: `None` is an operation without output (empty body).
pub(crate) type Reply = Option<Value>;

/// An error reply: HTTP status, the error's shape name and its message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ApiError {
    pub(crate) status: u16,
    pub(crate) code: String,
    pub(crate) message: String,
}

impl ApiError {
    pub(crate) fn new(status: u16, code: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code: code.to_string(),
            message: message.into(),
        }
    }
    fn conflict(message: impl Into<String>) -> ApiError {
        ApiError::new(400, "ConflictException", message)
    }
    fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(400, "NotFoundException", message)
    }
    fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(400, "InvalidRequestException", message)
    }
    pub(crate) fn throttling() -> ApiError {
        ApiError::new(400, "ThrottlingException", "Rate exceeded")
    }
    pub(crate) fn serialization(message: impl Into<String>) -> ApiError {
        ApiError::new(400, "SerializationException", message)
    }
    /// An injected failure: the error name follows the status the test asked for.
    pub(crate) fn injected(status: u16) -> ApiError {
        let code = match status {
            429 => "ThrottlingException",
            401 | 403 => "UnauthorizedException",
            404 => "NotFoundException",
            409 => "ConflictException",
            s if s >= 500 => "InternalServiceException",
            _ => "InvalidRequestException",
        };
        ApiError::new(status, code, format!("injected failure ({status})"))
    }
}

/// Runs one operation against the world.
pub(crate) fn dispatch(
    world: &mut World,
    op: &str,
    input: &Json,
    now: SystemTime,
) -> Result<Reply, ApiError> {
    match op {
        "RegisterGameServer" => register(world, input, now),
        "ClaimGameServer" => claim(world, input, now),
        "UpdateGameServer" => update(world, input, now),
        "DeregisterGameServer" => deregister(world, input),
        "DescribeGameServer" => describe(world, input, now),
        "DescribeGameServerInstances" => describe_instances(world, input),
        other => Err(ApiError::new(
            404,
            "UnknownOperationException",
            format!("operation {other} is not emulated"),
        )),
    }
}

fn required<'a>(input: &'a Json, member: &str) -> Result<&'a str, ApiError> {
    match input.get(member) {
        Some(Json::String(s)) if !s.is_empty() => Ok(s),
        Some(Json::String(_)) => Err(ApiError::invalid(format!("{member} must not be empty"))),
        Some(Json::Null) | None => Err(ApiError::invalid(format!("{member} is required"))),
        Some(_) => Err(ApiError::serialization(format!(
            "{member} must be a string"
        ))),
    }
}

fn optional<'a>(input: &'a Json, member: &str) -> Result<Option<&'a str>, ApiError> {
    match input.get(member) {
        Some(Json::String(s)) => Ok(Some(s)),
        Some(Json::Null) | None => Ok(None),
        Some(_) => Err(ApiError::serialization(format!(
            "{member} must be a string"
        ))),
    }
}

/// Resolves the group (name or ARN) to its name, or the error the operation models.
fn group_name(
    world: &World,
    input: &Json,
    missing: fn(String) -> ApiError,
) -> Result<String, ApiError> {
    let requested = required(input, "GameServerGroupName")?;
    world
        .group(requested)
        .map(|g| g.name.clone())
        .ok_or_else(|| missing(format!("game server group {requested} not found")))
}

fn registered_mut<'w>(
    world: &'w mut World,
    group: &str,
    id: &str,
) -> Result<&'w mut GameServer, ApiError> {
    world
        .servers
        .get_mut(&(group.to_string(), id.to_string()))
        .filter(|gs| gs.registered)
        .ok_or_else(|| {
            ApiError::not_found(format!(
                "game server {id} is not registered in group {group}"
            ))
        })
}

fn game_server_value(gs: &GameServer, now: SystemTime) -> Value {
    structure([
        ("GameServerGroupName", Some(text(&gs.group))),
        ("GameServerGroupArn", Some(text(World::arn_for(&gs.group)))),
        ("GameServerId", Some(text(&gs.id))),
        ("InstanceId", gs.instance_id.as_deref().map(text)),
        ("ConnectionInfo", gs.connection_info.as_deref().map(text)),
        ("GameServerData", gs.data.as_deref().map(text)),
        ("ClaimStatus", gs.is_claimed(now).then(|| text("CLAIMED"))),
        ("UtilizationStatus", Some(text(&gs.utilization))),
        ("RegistrationTime", Some(timestamp(gs.registered_at))),
        ("LastClaimTime", gs.claimed_at.map(timestamp)),
        ("LastHealthCheckTime", gs.last_health_check.map(timestamp)),
    ])
}

fn wrap_game_server(world: &World, group: &str, id: &str, now: SystemTime) -> Reply {
    let gs = world.servers.get(&(group.to_string(), id.to_string()))?;
    Some(structure([(
        "GameServer",
        Some(game_server_value(gs, now)),
    )]))
}

/// `RegisterGameServer`: a new (or previously deregistered) game server, AVAILABLE and unclaimed.
/// FleetIQ does not model `NotFoundException` here, so an unknown group is an invalid request.
fn register(world: &mut World, input: &Json, now: SystemTime) -> Result<Reply, ApiError> {
    let group = group_name(world, input, ApiError::invalid)?;
    let id = required(input, "GameServerId")?.to_string();
    let instance_id = required(input, "InstanceId")?.to_string();
    let connection_info = optional(input, "ConnectionInfo")?.map(str::to_string);
    let data = optional(input, "GameServerData")?.map(str::to_string);
    let key = (group.clone(), id.clone());
    if world.servers.get(&key).is_some_and(|gs| gs.registered) {
        return Err(ApiError::conflict(format!(
            "game server {id} is already registered in group {group}"
        )));
    }
    let deregistered_count = world
        .servers
        .get(&key)
        .map_or(0, |gs| gs.deregistered_count);
    world.servers.insert(
        key,
        GameServer {
            group: group.clone(),
            id: id.clone(),
            instance_id: Some(instance_id),
            connection_info,
            data,
            claimed_at: None,
            utilization: "AVAILABLE".to_string(),
            health_checks: 0,
            last_health_check: None,
            registered_at: now,
            registered: true,
            deregistered_count,
        },
    );
    Ok(wrap_game_server(world, &group, &id, now))
}

/// Instance statuses a claim may land on: ACTIVE, plus whatever `FilterOption` adds.
fn claimable_statuses(input: &Json) -> Result<Vec<InstanceStatus>, ApiError> {
    let mut allowed = vec![InstanceStatus::Active];
    let Some(filter) = input.get("FilterOption").filter(|f| !f.is_null()) else {
        return Ok(allowed);
    };
    let statuses = match filter.get("InstanceStatuses") {
        None | Some(Json::Null) => return Ok(allowed),
        Some(Json::Array(items)) => items,
        Some(_) => return Err(ApiError::serialization("InstanceStatuses must be a list")),
    };
    allowed.clear();
    for s in statuses {
        match s.as_str() {
            Some("ACTIVE") => allowed.push(InstanceStatus::Active),
            Some("DRAINING") => allowed.push(InstanceStatus::Draining),
            other => {
                return Err(ApiError::invalid(format!(
                    "FilterOption.InstanceStatuses has an invalid value {other:?}"
                )));
            }
        }
    }
    Ok(allowed)
}

/// `ClaimGameServer`: by id, or the first claimable game server of the group.
fn claim(world: &mut World, input: &Json, now: SystemTime) -> Result<Reply, ApiError> {
    let group = group_name(world, input, ApiError::not_found)?;
    let requested = optional(input, "GameServerId")?.map(str::to_string);
    let data = optional(input, "GameServerData")?.map(str::to_string);
    let allowed = claimable_statuses(input)?;
    // An instance the test never added counts as ACTIVE.
    let instance_ok = |world: &World, gs: &GameServer| {
        let status = gs
            .instance_id
            .as_deref()
            .and_then(|i| world.instance_status(i))
            .unwrap_or(InstanceStatus::Active);
        allowed.contains(&status)
    };
    let id = match requested {
        Some(id) => {
            let gs = registered_mut(world, &group, &id)?;
            if gs.utilization == "UTILIZED" {
                return Err(ApiError::conflict(format!("game server {id} is UTILIZED")));
            }
            if gs.is_claimed(now) {
                return Err(ApiError::conflict(format!(
                    "game server {id} is already claimed"
                )));
            }
            let gs = world
                .servers
                .get(&(group.clone(), id.clone()))
                .ok_or_else(|| ApiError::not_found(format!("game server {id} vanished")))?;
            if !instance_ok(world, gs) {
                return Err(ApiError::conflict(format!(
                    "game server {id} runs on an instance whose status the claim does not allow"
                )));
            }
            id
        }
        None => world
            .servers
            .values()
            .find(|gs| {
                gs.group == group
                    && gs.registered
                    && gs.utilization == "AVAILABLE"
                    && !gs.is_claimed(now)
                    && instance_ok(world, gs)
            })
            .map(|gs| gs.id.clone())
            .ok_or_else(|| {
                ApiError::new(
                    400,
                    "OutOfCapacityException",
                    format!("no claimable game server in group {group}"),
                )
            })?,
    };
    let gs = registered_mut(world, &group, &id)?;
    gs.claimed_at = Some(now);
    if data.is_some() {
        gs.data = data;
    }
    Ok(wrap_game_server(world, &group, &id, now))
}

/// `UpdateGameServer`: heartbeat, utilization and data. UTILIZED → AVAILABLE is refused.
fn update(world: &mut World, input: &Json, now: SystemTime) -> Result<Reply, ApiError> {
    let group = group_name(world, input, ApiError::not_found)?;
    let id = required(input, "GameServerId")?.to_string();
    let data = optional(input, "GameServerData")?.map(str::to_string);
    let utilization = optional(input, "UtilizationStatus")?;
    let health = optional(input, "HealthCheck")?;
    if let Some(u) = utilization
        && u != "AVAILABLE"
        && u != "UTILIZED"
    {
        return Err(ApiError::invalid(format!(
            "invalid UtilizationStatus {u:?}"
        )));
    }
    if let Some(h) = health
        && h != "HEALTHY"
    {
        return Err(ApiError::invalid(format!("invalid HealthCheck {h:?}")));
    }
    let gs = registered_mut(world, &group, &id)?;
    if utilization == Some("AVAILABLE") && gs.utilization == "UTILIZED" {
        return Err(ApiError::invalid(format!(
            "game server {id} cannot go from UTILIZED back to AVAILABLE"
        )));
    }
    if let Some(u) = utilization {
        gs.utilization = u.to_string();
    }
    if health.is_some() {
        gs.health_checks += 1;
        gs.last_health_check = Some(now);
    }
    if data.is_some() {
        gs.data = data;
    }
    Ok(wrap_game_server(world, &group, &id, now))
}

/// `DeregisterGameServer`: the record stays (unregistered) so tests can inspect it.
fn deregister(world: &mut World, input: &Json) -> Result<Reply, ApiError> {
    let group = group_name(world, input, ApiError::not_found)?;
    let id = required(input, "GameServerId")?.to_string();
    let gs = registered_mut(world, &group, &id)?;
    gs.registered = false;
    gs.deregistered_count += 1;
    gs.claimed_at = None;
    Ok(None)
}

fn describe(world: &mut World, input: &Json, now: SystemTime) -> Result<Reply, ApiError> {
    let group = group_name(world, input, ApiError::not_found)?;
    let id = required(input, "GameServerId")?.to_string();
    registered_mut(world, &group, &id)?;
    Ok(wrap_game_server(world, &group, &id, now))
}

pub(crate) const TOKEN_PREFIX: &str = "dgsi-";

/// `DescribeGameServerInstances`: the group's instances (optionally only `InstanceIds`),
/// paged by `Limit` (or the emulator's default page size) and an offset `NextToken`.
fn describe_instances(world: &mut World, input: &Json) -> Result<Reply, ApiError> {
    let group = group_name(world, input, ApiError::not_found)?;
    let wanted: Option<Vec<&str>> = match input.get("InstanceIds") {
        None | Some(Json::Null) => None,
        Some(Json::Array(ids)) => {
            if ids.is_empty() || ids.len() > MAX_INSTANCE_IDS {
                return Err(ApiError::invalid(format!(
                    "InstanceIds must name 1 to {MAX_INSTANCE_IDS} instances, got {}",
                    ids.len()
                )));
            }
            let ids = ids
                .iter()
                .map(|v| {
                    v.as_str()
                        .ok_or_else(|| ApiError::serialization("InstanceIds must be strings"))
                })
                .collect::<Result<Vec<_>, _>>()?;
            Some(ids)
        }
        Some(_) => return Err(ApiError::serialization("InstanceIds must be a list")),
    };
    let limit = match input.get("Limit") {
        None | Some(Json::Null) => world.default_page_size.max(1),
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => usize::try_from(n).unwrap_or(usize::MAX),
            _ => {
                return Err(ApiError::invalid(format!(
                    "Limit must be at least 1, got {v}"
                )));
            }
        },
    };
    let start = match optional(input, "NextToken")? {
        None => 0,
        Some(token) => token
            .strip_prefix(TOKEN_PREFIX)
            .and_then(|n| n.parse::<usize>().ok())
            .ok_or_else(|| ApiError::invalid(format!("invalid NextToken {token:?}")))?,
    };
    let g = world
        .groups
        .get(&group)
        .ok_or_else(|| ApiError::not_found(format!("game server group {group} not found")))?;
    let selected: Vec<&(String, InstanceStatus)> = g
        .instances
        .iter()
        .filter(|(id, _)| wanted.as_ref().is_none_or(|w| w.contains(&id.as_str())))
        .collect();
    if start > selected.len() {
        return Err(ApiError::invalid("NextToken is past the end of the list"));
    }
    let end = start.saturating_add(limit).min(selected.len());
    let entries = selected[start..end]
        .iter()
        .enumerate()
        .map(|(i, (id, status))| {
            // A malformed group corrupts the first entry of every page.
            let fault = if i == 0 { g.malformed } else { None };
            let status = match fault {
                Some(Malformed::UnknownStatus) => Some(text("EXPLODING")),
                Some(Malformed::MissingStatus) => None,
                _ => Some(text(status.as_str())),
            };
            let id = match fault {
                Some(Malformed::MissingInstanceId) => None,
                _ => Some(text(id)),
            };
            structure([
                ("GameServerGroupName", Some(text(&g.name))),
                ("GameServerGroupArn", Some(text(&g.arn))),
                ("InstanceId", id),
                ("InstanceStatus", status),
            ])
        })
        .collect();
    let next = (end < selected.len()).then(|| text(format!("{TOKEN_PREFIX}{end}")));
    Ok(Some(structure([
        ("GameServerInstances", Some(Value::Array(entries))),
        ("NextToken", next),
    ])))
}
