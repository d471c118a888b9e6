//! Drain state: what each draining node tells the FleetAutoscaler webhook, through Redis.
//!
//! A Fleet's Ready servers on a draining node still count as Ready in the Fleet's status,
//! but no player will land on them and the agent is about to delete them. The webhook adds
//! them to the buffer so their replacements start before that capacity disappears. This
//! module is the one definition of that contract; the agent writes it, pubsub reads it.
//!
//! **Format.** One Redis hash, [`KEY`] (`lastcall:drain-state`): field = the node name,
//! value = the JSON of a [`NodeDrainState`]:
//!
//! ```json
//! {"node":"gke-pool-1-abcd","updated_at_ms":1767225600000,
//!  "fleets":[{"namespace":"default","name":"simple-game","ready":6,"allocated":3}]}
//! ```
//!
//! Reading is one `HGETALL`, O(draining nodes): a node that is not draining has no field.
//! One more field, [`EPOCH_FIELD`], dates the hash itself, so a reader can tell a hash that
//! Redis lost (restarted without persistence) from one where nothing drains.
//! Unknown JSON keys are ignored, so the format can grow without breaking older readers.
//!
//! **What counts.** A server the agent releases (deletes) is replaced by its GameServerSet
//! at once, since a set does not count servers being deleted; adding it to the buffer too
//! would create it twice. So the webhook adds only what is about to be lost and not yet
//! replaced: `held` (Ready servers the agent keeps for now, not released: release pacing)
//! plus `at_risk` (in-use servers on a node whose drain has a deadline). A writer that
//! sends neither (an older agent) is read as before: `ready` counts.
//!
//! **Writer's duties (the agent).** While the node drains, [`publish`] the current counts
//! whenever they change and at least every [`REFRESH_EVERY`], so `updated_at_ms` stays
//! fresh; [`clear`] the field when the drain ends or is cancelled. An entry older than the
//! reader's max age counts as zero, so a dead agent's entry stops inflating the buffer on
//! its own; readers [`prune`] entries far older than that.

use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

/// The Redis hash holding one field per draining node, for the default (unnamed) cluster.
pub const KEY: &str = "lastcall:drain-state";

/// Longest cluster name accepted (a DNS label).
pub const MAX_CLUSTER_NAME_BYTES: usize = 63;

/// The hash of cluster `cluster` (`--cluster-name`): [`KEY`] for the empty name, which
/// keeps the key every earlier release used, else `lastcall:drain-state:<cluster>`, so
/// clusters that share one Redis never read each other's drains.
pub fn key_for(cluster: &str) -> String {
    if cluster.is_empty() {
        KEY.to_string()
    } else {
        format!("{KEY}:{cluster}")
    }
}

/// Checks a `--cluster-name`: empty (the default key), or a DNS label (lowercase letters,
/// digits and `-`, at most 63 bytes, starting and ending with a letter or digit).
pub fn check_cluster_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Ok(());
    }
    let ok_char = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-';
    if name.len() > MAX_CLUSTER_NAME_BYTES
        || !name.chars().all(ok_char)
        || name.starts_with('-')
        || name.ends_with('-')
    {
        return Err(format!(
            "{:?} is not a DNS label (lowercase letters, digits and '-', at most {MAX_CLUSTER_NAME_BYTES} characters, not starting or ending with '-')",
            crate::fleetiq::trim_for_log(name, 80)
        ));
    }
    Ok(())
}

/// Largest entry a reader accepts. A node with a few hundred Fleets fits in a few KiB.
pub const MAX_ENTRY_BYTES: usize = 64 * 1024;

/// How often a writer refreshes its entry while draining, even when nothing changed.
pub const REFRESH_EVERY: Duration = Duration::from_secs(30);

/// Readers delete entries older than this many max ages: long dead, not merely late.
pub const PRUNE_AFTER_MAX_AGES: u32 = 10;

/// The hash field that dates the hash itself (Unix ms, written by the first reader that
/// finds it missing, see [`mark_epoch`]). It cannot be a Node name (those are DNS names), so
/// writers never touch it, and it keeps the hash in existence when no node drains. A hash
/// without it was lost (a Redis restarted without persistence, a flush): what agents had
/// written is gone, and an empty read would look like "nothing drains". Readers hold
/// every answer until [`RESTART_SETTLE`] after the epoch, by when every live draining
/// agent has written again.
pub const EPOCH_FIELD: &str = "#epoch";

/// How long after the epoch readers hold: two refresh periods, so every draining agent
/// has refreshed (once, with a retry's margin) since the hash was lost.
pub const RESTART_SETTLE: Duration = Duration::from_secs(60);

/// The hash field naming the Redis server run (its `INFO server` `run_id`) on which the
/// epoch was set. A Redis restored from an old snapshot, or a replica promoted while it
/// lagged, keeps an old hash *with* its epoch, so the epoch alone cannot tell that writes
/// made since the snapshot are gone; but either is another server run. A reader that finds
/// another run here (or none) dates the hash again, and answers hold as after a loss.
pub const RUN_FIELD: &str = "#run";

/// Fields starting with this are the hash's own ([`EPOCH_FIELD`], [`RUN_FIELD`]), never a
/// Node's (Node names are DNS names).
const RESERVED_PREFIX: u8 = b'#';

/// Why a read dated the hash again ([`read_dated`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Redated {
    /// The hash was dated before, on this server run: nothing was lost.
    No,
    /// The hash had no epoch: lost (a restart without persistence, a flush) or new.
    Missing,
    /// The epoch was set on another server run (or by a release that did not record the
    /// run): Redis restarted from a snapshot or failed over, and may have lost writes.
    OtherRun,
}

/// Longest node, namespace or Fleet name accepted (Kubernetes names are at most 253).
const MAX_NAME_BYTES: usize = 253;

/// One draining node's game servers, per Fleet.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeDrainState {
    /// The Node's name; also the hash field.
    pub node: String,
    /// When the writer wrote this entry (Unix milliseconds, the writer's wall clock): its
    /// publisher is alive.
    pub updated_at_ms: i64,
    /// When the counts were computed (Unix milliseconds, the writer's clock, at most
    /// `updated_at_ms`): a live publisher may repeat counts its planner no longer updates.
    /// Absent from older writers: then `updated_at_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counted_at_ms: Option<i64>,
    /// The writer left Fleets out to stay within [`MAX_ENTRY_BYTES`]: the listed ones count,
    /// and every Fleet is held, since any of them may be among those left out.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
    /// Fleets with game servers on this node; each Fleet at most once.
    pub fleets: Vec<FleetOnNode>,
}

/// One Fleet's game servers on a draining node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FleetOnNode {
    /// The Fleet's namespace.
    pub namespace: String,
    /// The Fleet's name (the `agones.dev/fleet` label of its GameServers).
    pub name: String,
    /// Ready GameServers of this Fleet on the node: capacity about to disappear.
    pub ready: u32,
    /// Allocated GameServers of this Fleet on the node (informational).
    pub allocated: u32,
    /// Of `ready`, those the agent holds (does not release in its current plan). Absent
    /// from older writers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held: Option<u32>,
    /// In-use (Allocated or Reserved) servers of this Fleet on the node when the drain has
    /// a deadline: lost at that deadline. Absent from older writers, and when no deadline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at_risk: Option<u32>,
}

impl FleetOnNode {
    /// Servers of this Fleet the webhook adds to the buffer: `held + at_risk` when the
    /// writer sends either, else `ready` (an older writer).
    pub fn to_replace(&self) -> u64 {
        if self.held.is_none() && self.at_risk.is_none() {
            return u64::from(self.ready);
        }
        u64::from(self.held.unwrap_or(0)) + u64::from(self.at_risk.unwrap_or(0))
    }
}

/// Why an entry is unusable. Each variant has a fixed metric label.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EntryError {
    #[error("entry is {0} bytes, over the {MAX_ENTRY_BYTES}-byte limit")]
    Oversize(usize),
    #[error("node field or value is not UTF-8")]
    NotUtf8,
    #[error("entry is not a drain state: {0}")]
    Json(String),
    #[error("field {field:?} holds the state of node {node:?}")]
    NodeMismatch { field: String, node: String },
    #[error("{0}")]
    InvalidName(String),
    #[error("fleet {namespace}/{name} is listed twice")]
    DuplicateFleet { namespace: String, name: String },
    #[error("counts dated {counted_at_ms} ms, after the entry's own {updated_at_ms} ms")]
    CountedAfterUpdate {
        counted_at_ms: i64,
        updated_at_ms: i64,
    },
}

impl EntryError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Oversize(_) => "oversize",
            Self::NotUtf8 => "not_utf8",
            Self::Json(_) => "invalid_json",
            Self::NodeMismatch { .. } => "node_mismatch",
            Self::InvalidName(_) => "invalid_name",
            Self::DuplicateFleet { .. } => "duplicate_fleet",
            Self::CountedAfterUpdate { .. } => "counted_after_update",
        }
    }
}

/// Errors of [`publish`].
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The state would be rejected by every reader, so it is not written.
    #[error("refusing to publish an invalid drain state: {0}")]
    Invalid(#[source] EntryError),
    #[error("writing the drain state to Redis: {0}")]
    Redis(#[source] redis::RedisError),
}

fn check_name(what: &str, value: &str) -> Result<(), EntryError> {
    if value.is_empty() || value.len() > MAX_NAME_BYTES || value.chars().any(char::is_control) {
        return Err(EntryError::InvalidName(format!(
            "{what} {:?} is empty, longer than {MAX_NAME_BYTES} bytes or has control characters",
            crate::fleetiq::trim_for_log(value, 64)
        )));
    }
    Ok(())
}

impl NodeDrainState {
    /// The rules every reader applies; writers check them before writing (the size, too:
    /// see [`NodeDrainState::fit`]).
    pub fn validate(&self) -> Result<(), EntryError> {
        check_name("node", &self.node)?;
        if let Some(counted_at_ms) = self.counted_at_ms
            && counted_at_ms > self.updated_at_ms
        {
            return Err(EntryError::CountedAfterUpdate {
                counted_at_ms,
                updated_at_ms: self.updated_at_ms,
            });
        }
        let mut seen: Vec<(&str, &str)> = Vec::with_capacity(self.fleets.len());
        for f in &self.fleets {
            check_name("fleet namespace", &f.namespace)?;
            check_name("fleet name", &f.name)?;
            let key = (f.namespace.as_str(), f.name.as_str());
            if seen.contains(&key) {
                return Err(EntryError::DuplicateFleet {
                    namespace: f.namespace.clone(),
                    name: f.name.clone(),
                });
            }
            seen.push(key);
        }
        Ok(())
    }

    /// The hash value: compact JSON.
    pub fn to_json(&self) -> String {
        // Serialising plain strings and integers cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// When the counts were computed: `counted_at_ms`, or `updated_at_ms` for an older
    /// writer (never later than `updated_at_ms`).
    pub fn counted_at(&self) -> i64 {
        self.counted_at_ms
            .map_or(self.updated_at_ms, |c| c.min(self.updated_at_ms))
    }

    /// Makes the entry fit in [`MAX_ENTRY_BYTES`], as readers require: if its JSON is
    /// larger, the Fleets with the fewest servers to replace are left out until it fits,
    /// and it is marked `truncated` (readers then hold every Fleet). Returns how many
    /// Fleets were left out (0: unchanged).
    pub fn fit(&mut self) -> usize {
        if self.to_json().len() <= MAX_ENTRY_BYTES {
            return 0;
        }
        self.truncated = true;
        // Keep the Fleets that matter most to the webhook; a stable order otherwise.
        self.fleets
            .sort_by_key(|f| std::cmp::Reverse((f.to_replace(), u64::from(f.ready))));
        let before = self.fleets.len();
        // Each Fleet's share of the JSON, plus the comma between entries.
        let mut size = serde_json::to_string(&NodeDrainState {
            fleets: vec![],
            ..self.clone()
        })
        .map_or(MAX_ENTRY_BYTES, |j| j.len());
        let mut keep = 0;
        for f in &self.fleets {
            let len = serde_json::to_string(f).map_or(MAX_ENTRY_BYTES, |j| j.len()) + 1;
            if size + len > MAX_ENTRY_BYTES {
                break;
            }
            size += len;
            keep += 1;
        }
        self.fleets.truncate(keep);
        before - keep
    }

    /// Decodes the value of hash field `field`, with every reader-side check.
    pub fn parse(field: &[u8], value: &[u8]) -> Result<Self, EntryError> {
        if value.len() > MAX_ENTRY_BYTES {
            return Err(EntryError::Oversize(value.len()));
        }
        let field = std::str::from_utf8(field).map_err(|_| EntryError::NotUtf8)?;
        let state: NodeDrainState = serde_json::from_slice(value)
            .map_err(|e| EntryError::Json(crate::fleetiq::trim_for_log(&e.to_string(), 200)))?;
        if state.node != field {
            return Err(EntryError::NodeMismatch {
                field: crate::fleetiq::trim_for_log(field, 64),
                node: crate::fleetiq::trim_for_log(&state.node, 64),
            });
        }
        state.validate()?;
        Ok(state)
    }
}

/// Why an entry did not count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Skip {
    Malformed(EntryError),
    /// Older than the max age: its writer stopped refreshing it. Until it is older than
    /// the hold limit, the Fleets it names are held (no scale-down), unless its Node is gone.
    Stale {
        age_ms: i64,
    },
    /// Refreshed within the max age, but its counts were computed longer ago than that:
    /// the writer's publisher is alive, its planner is not keeping the counts current. Held
    /// like a stale entry (the counts are unknown), up to the hold limit.
    StaleCounts {
        age_ms: i64,
    },
    /// Older than the hold limit: counts for nothing and holds nothing (a writer that
    /// stays silent this long is gone; the alert on held Fleets has fired long before).
    Expired {
        age_ms: i64,
    },
    /// Dated more than the max age ahead of the reader's clock: invalid (a writer clock
    /// far off would otherwise keep its entry fresh, or holding, forever). Counts for
    /// nothing and holds nothing.
    Future {
        ahead_ms: i64,
    },
}

impl Skip {
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Malformed(e) => e.metric_label(),
            Self::Stale { .. } => "stale",
            Self::StaleCounts { .. } => "stale_counts",
            Self::Expired { .. } => "expired",
            Self::Future { .. } => "future",
        }
    }
}

/// An entry that did not count, with its raw value for a compare-and-delete [`prune`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Skipped {
    /// The hash field, lossily decoded for logs.
    pub node: String,
    pub field: Vec<u8>,
    pub value: Vec<u8>,
    pub why: Skip,
}

/// A dated entry that still matters: fresh (it counts) or stale within the hold limit (it
/// holds the Fleets it names), as long as its Node exists.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Live {
    pub node: String,
    pub updated_at_ms: i64,
    /// Why it holds rather than counts, if it does: its writer went silent
    /// ([`HOLD_STALE_ENTRY`]) or its counts are old ([`HOLD_STALE_COUNTS`]).
    pub stale: Option<&'static str>,
    /// Fleets were left out to fit the size limit: every Fleet is held.
    pub truncated: bool,
    pub fleets: Vec<FleetOnNode>,
}

/// Hold reason (a metric label) of a Fleet named by an entry its writer stopped refreshing.
pub const HOLD_STALE_ENTRY: &str = "stale_entry";
/// Hold reason of a Fleet named by an entry refreshed with counts older than the max age.
pub const HOLD_STALE_COUNTS: &str = "stale_counts";
/// Hold reason of every Fleet while an entry that left Fleets out (to fit) is live.
pub const HOLD_TRUNCATED: &str = "truncated_entry";

/// What the drain state says about one Fleet, once dead nodes are set aside.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FleetDrain {
    /// Servers to replace, from fresh entries of nodes that exist.
    pub extra: u64,
    /// Nodes whose stale entry names the Fleet (and that exist), or whose entry left Fleets
    /// out: its answer must not shrink it.
    pub holding: Vec<String>,
    /// Why, of the holding entries, the first one holds (a metric label), if any does.
    pub hold_reason: Option<&'static str>,
    /// Nodes whose entry names the Fleet but which are gone: they count for nothing.
    pub gone: Vec<String>,
}

/// The drain state as of one read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Fresh and stale-but-holding entries.
    pub live: Vec<Live>,
    /// Entries that counted.
    pub fresh_nodes: usize,
    /// Entries that did not, and why.
    pub skipped: Vec<Skipped>,
    /// The [`EPOCH_FIELD`]'s time, if the hash has one that parses.
    pub epoch_ms: Option<i64>,
}

impl Snapshot {
    /// Builds the snapshot from raw hash entries: pure, so staleness is testable with any
    /// `now_ms`. An entry is fresh when `|now − updated_at| ≤ max_age`; stale (holding)
    /// when older, up to `hold_limit`; expired past that; future-dated (invalid) when
    /// more than `max_age` ahead.
    pub fn from_entries(
        entries: Vec<(Vec<u8>, Vec<u8>)>,
        now_ms: i64,
        max_age: Duration,
        hold_limit: Duration,
    ) -> Self {
        let ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        let (max_age_ms, hold_ms) = (ms(max_age), ms(hold_limit.max(max_age)));
        let mut snap = Snapshot::default();
        for (field, value) in entries {
            if field == EPOCH_FIELD.as_bytes() {
                snap.epoch_ms = std::str::from_utf8(&value)
                    .ok()
                    .and_then(|v| v.trim().parse().ok());
                continue;
            }
            if field.first() == Some(&RESERVED_PREFIX) {
                continue;
            }
            let why = match NodeDrainState::parse(&field, &value) {
                Err(e) => Skip::Malformed(e),
                Ok(state) => {
                    let age_ms = now_ms.saturating_sub(state.updated_at_ms);
                    let counts_age_ms = now_ms.saturating_sub(state.counted_at());
                    if age_ms < max_age_ms.saturating_neg() {
                        Skip::Future {
                            ahead_ms: age_ms.saturating_neg(),
                        }
                    } else if counts_age_ms > hold_ms {
                        Skip::Expired {
                            age_ms: counts_age_ms,
                        }
                    } else {
                        let stale = if age_ms > max_age_ms {
                            Some(Skip::Stale { age_ms })
                        } else if counts_age_ms > max_age_ms {
                            Some(Skip::StaleCounts {
                                age_ms: counts_age_ms,
                            })
                        } else {
                            None
                        };
                        let reason = stale.as_ref().map(|s| match s {
                            Skip::StaleCounts { .. } => HOLD_STALE_COUNTS,
                            _ => HOLD_STALE_ENTRY,
                        });
                        match stale {
                            Some(why) => snap.skipped.push(Skipped {
                                node: state.node.clone(),
                                field,
                                value,
                                why,
                            }),
                            None => snap.fresh_nodes += 1,
                        }
                        snap.live.push(Live {
                            node: state.node,
                            updated_at_ms: state.updated_at_ms,
                            stale: reason,
                            truncated: state.truncated,
                            fleets: state.fleets,
                        });
                        continue;
                    }
                }
            };
            snap.skipped.push(Skipped {
                node: String::from_utf8_lossy(&field).into_owned(),
                field,
                value,
                why,
            });
        }
        snap
    }

    /// Whether the hash was lost recently, so answers must hold: it has no epoch (the
    /// reader marks one), or its epoch is less than [`RESTART_SETTLE`] old. An epoch more
    /// than `max_age` in the future (a reader clock far ahead) is ignored.
    pub fn settling(&self, now_ms: i64, max_age: Duration) -> bool {
        let Some(epoch) = self.epoch_ms else {
            return true;
        };
        let ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        let age = now_ms.saturating_sub(epoch);
        age >= ms(max_age).saturating_neg() && age < ms(RESTART_SETTLE)
    }

    /// Nodes whose fresh or stale entry names Fleet `namespace/name`, or left Fleets out
    /// (so may name it): the ones whose existence decides the answer.
    pub fn nodes_naming<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> impl Iterator<Item = &'a Live> + 'a {
        self.live.iter().filter(move |e| {
            e.truncated
                || e.fleets
                    .iter()
                    .any(|f| f.namespace == namespace && f.name == name)
        })
    }

    /// Fleet `namespace/name` with the entries of gone nodes (as `gone` says, given the
    /// entry) set aside: the servers fresh entries ask to replace (see
    /// [`FleetOnNode::to_replace`]), and the nodes whose stale entries hold it.
    pub fn fleet(&self, namespace: &str, name: &str, gone: impl Fn(&Live) -> bool) -> FleetDrain {
        let mut out = FleetDrain::default();
        for entry in self.nodes_naming(namespace, name) {
            if gone(entry) {
                out.gone.push(entry.node.clone());
                continue;
            }
            if let Some(reason) = entry.stale {
                out.holding.push(entry.node.clone());
                out.hold_reason.get_or_insert(reason);
                continue;
            }
            if entry.truncated {
                out.holding.push(entry.node.clone());
                out.hold_reason.get_or_insert(HOLD_TRUNCATED);
            }
            for f in &entry.fleets {
                if f.namespace == namespace && f.name == name {
                    out.extra = out.extra.saturating_add(f.to_replace());
                }
            }
        }
        out
    }

    /// Entries old enough to delete: stale or expired, more than [`PRUNE_AFTER_MAX_AGES`]
    /// max ages.
    pub fn prunable(&self, max_age: Duration) -> impl Iterator<Item = &Skipped> {
        let limit = i64::try_from(max_age.saturating_mul(PRUNE_AFTER_MAX_AGES).as_millis())
            .unwrap_or(i64::MAX);
        self.skipped.iter().filter(move |s| {
            matches!(s.why, Skip::Stale { age_ms } | Skip::StaleCounts { age_ms } | Skip::Expired { age_ms } if age_ms > limit)
        })
    }
}

/// Unix milliseconds of `t` (0 before the epoch): the clock `updated_at_ms` is read against.
pub fn unix_ms(t: SystemTime) -> i64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Writes (replaces) `state` as its node's field of [`KEY`].
pub async fn publish<C>(conn: &mut C, state: &NodeDrainState) -> Result<(), PublishError>
where
    C: redis::aio::ConnectionLike + Send,
{
    publish_to(conn, KEY, state).await
}

/// Writes (replaces) `state` as its node's field of hash `key` (see [`key_for`]). An entry
/// over [`MAX_ENTRY_BYTES`] is refused, as every reader would skip it: call
/// [`NodeDrainState::fit`] first.
pub async fn publish_to<C>(
    conn: &mut C,
    key: &str,
    state: &NodeDrainState,
) -> Result<(), PublishError>
where
    C: redis::aio::ConnectionLike + Send,
{
    state.validate().map_err(PublishError::Invalid)?;
    let json = state.to_json();
    if json.len() > MAX_ENTRY_BYTES {
        return Err(PublishError::Invalid(EntryError::Oversize(json.len())));
    }
    redis::cmd("HSET")
        .arg(key)
        .arg(&state.node)
        .arg(json)
        .query_async::<i64>(conn)
        .await
        .map(|_| ())
        .map_err(PublishError::Redis)
}

/// Removes `node`'s field: its drain ended or was cancelled. Returns whether it existed.
pub async fn clear<C>(conn: &mut C, node: &str) -> redis::RedisResult<bool>
where
    C: redis::aio::ConnectionLike + Send,
{
    clear_in(conn, KEY, node).await
}

/// [`clear`] in hash `key` (see [`key_for`]).
pub async fn clear_in<C>(conn: &mut C, key: &str, node: &str) -> redis::RedisResult<bool>
where
    C: redis::aio::ConnectionLike + Send,
{
    redis::cmd("HDEL")
        .arg(key)
        .arg(node)
        .query_async::<i64>(conn)
        .await
        .map(|n| n > 0)
}

/// Reads every entry in one `HGETALL` and keeps the fresh ones (see
/// [`Snapshot::from_entries`]). A malformed entry never fails the read.
pub async fn read_all<C>(
    conn: &mut C,
    key: &str,
    now_ms: i64,
    max_age: Duration,
    hold_limit: Duration,
) -> redis::RedisResult<Snapshot>
where
    C: redis::aio::ConnectionLike + Send,
{
    // Raw bytes, so one entry that is not UTF-8 is skipped instead of failing the read.
    let entries: Vec<(Vec<u8>, Vec<u8>)> = redis::cmd("HGETALL").arg(key).query_async(conn).await?;
    Ok(Snapshot::from_entries(entries, now_ms, max_age, hold_limit))
}

/// Hash fields and values as Redis returns them.
type RawEntries = Vec<(Vec<u8>, Vec<u8>)>;

/// Reads every entry like [`read_all`], in the same atomic script that first checks the
/// hash's date: when it has no epoch, or its epoch was set on another run of the Redis
/// server ([`RUN_FIELD`]: a restore from a snapshot, a failover to a replica), the epoch is
/// set to `now_ms` on this run, so [`Snapshot::settling`] holds answers while the agents
/// write again. One round trip; a concurrent reader's date is kept (the script is atomic).
pub async fn read_dated<C>(
    conn: &mut C,
    key: &str,
    now_ms: i64,
    max_age: Duration,
    hold_limit: Duration,
) -> redis::RedisResult<(Snapshot, Redated)>
where
    C: redis::aio::ConnectionLike + Send,
{
    const READ_DATED: &str = r"
local run = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)') or ''
local epoch = tonumber(redis.call('HGET', KEYS[1], ARGV[1]))
local by = redis.call('HGET', KEYS[1], ARGV[2])
local why = 0
if not epoch then why = 1 elseif by ~= run then why = 2 end
if why > 0 then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3], ARGV[2], run)
end
return {why, redis.call('HGETALL', KEYS[1])}
";
    let (why, entries): (i64, RawEntries) = redis::Script::new(READ_DATED)
        .key(key)
        .arg(EPOCH_FIELD)
        .arg(RUN_FIELD)
        .arg(now_ms)
        .invoke_async(conn)
        .await?;
    let redated = match why {
        0 => Redated::No,
        1 => Redated::Missing,
        _ => Redated::OtherRun,
    };
    Ok((
        Snapshot::from_entries(entries, now_ms, max_age, hold_limit),
        redated,
    ))
}

/// Dates the hash if nothing has ([`EPOCH_FIELD`]; a value that is not a number is
/// replaced), on the server's current run ([`RUN_FIELD`]). Returns the epoch now held.
pub async fn mark_epoch<C>(conn: &mut C, now_ms: i64) -> redis::RedisResult<i64>
where
    C: redis::aio::ConnectionLike + Send,
{
    mark_epoch_in(conn, KEY, now_ms).await
}

/// [`mark_epoch`] in hash `key` (see [`key_for`]).
pub async fn mark_epoch_in<C>(conn: &mut C, key: &str, now_ms: i64) -> redis::RedisResult<i64>
where
    C: redis::aio::ConnectionLike + Send,
{
    // Set if missing or not a number (so a garbled epoch cannot hold for ever); another
    // reader's valid epoch is kept.
    const SET_IF_MISSING: &str = r"
local run = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)') or ''
local held = tonumber(redis.call('HGET', KEYS[1], ARGV[1]))
if held then
  redis.call('HSET', KEYS[1], ARGV[3], run)
  return held
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2], ARGV[3], run)
return tonumber(ARGV[2])
";
    redis::Script::new(SET_IF_MISSING)
        .key(key)
        .arg(EPOCH_FIELD)
        .arg(now_ms)
        .arg(RUN_FIELD)
        .invoke_async::<i64>(conn)
        .await
}

/// Deletes `field` only if it still holds `value`, so a writer that refreshed its entry in
/// the meantime keeps it. Returns whether it was deleted.
pub async fn prune<C>(
    conn: &mut C,
    key: &str,
    field: &[u8],
    value: &[u8],
) -> redis::RedisResult<bool>
where
    C: redis::aio::ConnectionLike + Send,
{
    const COMPARE_AND_DELETE: &str = r"
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
";
    redis::Script::new(COMPARE_AND_DELETE)
        .key(key)
        .arg(field)
        .arg(value)
        .invoke_async::<i64>(conn)
        .await
        .map(|n| n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_secs(60);
    /// The hold limit in these tests: five max ages.
    const HOLD: Duration = Duration::from_secs(300);

    fn extra(snap: &Snapshot, namespace: &str, name: &str) -> u64 {
        snap.fleet(namespace, name, |_| false).extra
    }

    fn state(node: &str, at: i64, fleets: &[(&str, &str, u32, u32)]) -> NodeDrainState {
        NodeDrainState {
            node: node.into(),
            updated_at_ms: at,
            counted_at_ms: None,
            truncated: false,
            fleets: fleets
                .iter()
                .map(|&(namespace, name, ready, allocated)| FleetOnNode {
                    namespace: namespace.into(),
                    name: name.into(),
                    ready,
                    allocated,
                    held: None,
                    at_risk: None,
                })
                .collect(),
        }
    }

    fn entry(s: &NodeDrainState) -> (Vec<u8>, Vec<u8>) {
        (s.node.clone().into_bytes(), s.to_json().into_bytes())
    }

    #[test]
    fn the_wire_form_is_stable() {
        let s = state(
            "node-a",
            1_767_225_600_000,
            &[("default", "simple-game", 6, 3)],
        );
        assert_eq!(
            s.to_json(),
            r#"{"node":"node-a","updated_at_ms":1767225600000,"fleets":[{"namespace":"default","name":"simple-game","ready":6,"allocated":3}]}"#
        );
        assert_eq!(
            NodeDrainState::parse(b"node-a", s.to_json().as_bytes()),
            Ok(s)
        );
        // Unknown keys (a newer writer) are accepted.
        let newer = br#"{"node":"n","updated_at_ms":1,"fleets":[],"cause":"preemption"}"#;
        assert!(NodeDrainState::parse(b"n", newer).is_ok());
    }

    #[test]
    fn fresh_entries_add_up_per_fleet_across_nodes() {
        let now = 1_000_000;
        let snap = Snapshot::from_entries(
            vec![
                entry(&state(
                    "a",
                    now - 5_000,
                    &[("ns", "f", 4, 1), ("ns", "g", 2, 0)],
                )),
                entry(&state("b", now, &[("ns", "f", 2, 0), ("other", "f", 7, 0)])),
            ],
            now,
            MIN,
            HOLD,
        );
        assert_eq!(snap.fresh_nodes, 2);
        assert_eq!(extra(&snap, "ns", "f"), 6);
        assert_eq!(extra(&snap, "ns", "g"), 2);
        assert_eq!(extra(&snap, "other", "f"), 7);
        assert_eq!(extra(&snap, "ns", "missing"), 0);
        assert!(snap.skipped.is_empty());
    }

    #[test]
    fn stale_future_and_malformed_entries_count_zero() {
        let now = 10_000_000;
        let ok = state("ok", now - 60_000, &[("ns", "f", 1, 0)]); // exactly max age: fresh
        let stale = state("stale", now - 60_001, &[("ns", "f", 10, 0)]);
        let ahead = state("ahead", now + 60_001, &[("ns", "f", 100, 0)]);
        let dup = state("dup", now, &[("ns", "f", 1, 0), ("ns", "f", 1, 0)]);
        let cases: Vec<(Vec<u8>, Vec<u8>)> = vec![
            entry(&ok),
            entry(&stale),
            entry(&ahead),
            entry(&dup),
            (b"bad".to_vec(), b"{not json".to_vec()),
            (b"neg".to_vec(), br#"{"node":"neg","updated_at_ms":1,"fleets":[{"namespace":"ns","name":"f","ready":-1,"allocated":0}]}"#.to_vec()),
            (b"other".to_vec(), ok.to_json().into_bytes()),
            (vec![0xff, 0xfe], b"{}".to_vec()),
            (b"big".to_vec(), vec![b' '; MAX_ENTRY_BYTES + 1]),
            (b"empty".to_vec(), br#"{"node":"empty","updated_at_ms":1,"fleets":[{"namespace":"","name":"f","ready":1,"allocated":0}]}"#.to_vec()),
        ];
        let snap = Snapshot::from_entries(cases, now, MIN, HOLD);
        assert_eq!(snap.fresh_nodes, 1);
        assert_eq!(extra(&snap, "ns", "f"), 1);
        let labels: Vec<(&str, &str)> = snap
            .skipped
            .iter()
            .map(|s| (s.node.as_str(), s.why.metric_label()))
            .collect();
        assert_eq!(
            labels,
            [
                ("stale", "stale"),
                ("ahead", "future"),
                ("dup", "duplicate_fleet"),
                ("bad", "invalid_json"),
                ("neg", "invalid_json"),
                ("other", "node_mismatch"),
                ("\u{fffd}\u{fffd}", "not_utf8"),
                ("big", "oversize"),
                ("empty", "invalid_name"),
            ]
        );
    }

    #[test]
    fn held_and_at_risk_replace_ready_when_the_writer_sends_them() {
        let now = 1_000_000;
        let mut newer = state("new", now, &[("ns", "f", 6, 3), ("ns", "g", 4, 0)]);
        // f: 6 Ready of which 2 held, 3 in use with a deadline; g: all 4 being released.
        newer.fleets[0].held = Some(2);
        newer.fleets[0].at_risk = Some(3);
        newer.fleets[1].held = Some(0);
        let json = newer.to_json();
        assert!(json.contains(r#""held":2,"at_risk":3"#), "{json}");
        let snap = Snapshot::from_entries(
            vec![
                (b"new".to_vec(), json.into_bytes()),
                entry(&state("old", now, &[("ns", "f", 5, 1)])),
            ],
            now,
            MIN,
            HOLD,
        );
        assert_eq!(
            extra(&snap, "ns", "f"),
            2 + 3 + 5,
            "an older writer's ready counts"
        );
        assert_eq!(
            extra(&snap, "ns", "g"),
            0,
            "released servers are replaced by their set"
        );
    }

    #[test]
    fn a_stale_entry_holds_until_the_hold_limit_and_a_future_one_never_does() {
        let now = 100_000_000;
        let snap = Snapshot::from_entries(
            vec![
                entry(&state("late", now - 2 * 60_000, &[("ns", "f", 3, 0)])),
                entry(&state("expired", now - 300_001, &[("ns", "g", 3, 0)])),
                entry(&state("ahead", now + 60_001, &[("ns", "h", 3, 0)])),
            ],
            now,
            MIN,
            HOLD,
        );
        assert_eq!(snap.fleet("ns", "f", |_| false).holding, ["late"]);
        for name in ["g", "h"] {
            assert_eq!(
                snap.fleet("ns", name, |_| false),
                FleetDrain::default(),
                "{name} counts for nothing and holds nothing"
            );
        }
        let labels: Vec<&str> = snap.skipped.iter().map(|s| s.why.metric_label()).collect();
        assert_eq!(labels, ["stale", "expired", "future"]);
    }

    #[test]
    fn a_gone_node_counts_for_nothing_and_holds_nothing() {
        let now = 100_000_000;
        let snap = Snapshot::from_entries(
            vec![
                entry(&state("dead-fresh", now, &[("ns", "f", 6, 0)])),
                entry(&state("dead-stale", now - 2 * 60_000, &[("ns", "f", 2, 0)])),
                entry(&state("alive", now, &[("ns", "f", 1, 0)])),
            ],
            now,
            MIN,
            HOLD,
        );
        let f = snap.fleet("ns", "f", |e| e.node.starts_with("dead"));
        assert_eq!(f.extra, 1);
        assert!(f.holding.is_empty());
        assert_eq!(f.gone, ["dead-fresh", "dead-stale"]);
    }

    #[test]
    fn a_hash_without_an_epoch_or_with_a_young_one_is_settling() {
        let now = 100_000_000;
        let epoch = |v: &str| (EPOCH_FIELD.as_bytes().to_vec(), v.as_bytes().to_vec());
        let snap = |entries| Snapshot::from_entries(entries, now, MIN, HOLD);
        let lost = snap(vec![entry(&state("n", now, &[("ns", "f", 1, 0)]))]);
        assert!(lost.settling(now, MIN), "no epoch: lost");
        assert_eq!(lost.fresh_nodes, 1);
        let young = snap(vec![epoch(&(now - 59_999).to_string())]);
        assert!(young.settling(now, MIN));
        assert!(young.skipped.is_empty(), "the epoch is not an entry");
        assert!(!snap(vec![epoch(&(now - 60_000).to_string())]).settling(now, MIN));
        assert!(
            !snap(vec![epoch(&(now + 60_001).to_string())]).settling(now, MIN),
            "an epoch far ahead is ignored"
        );
        assert!(snap(vec![epoch("junk")]).settling(now, MIN));
    }

    #[test]
    fn only_long_dead_entries_are_prunable() {
        let now = 100_000_000;
        let snap = Snapshot::from_entries(
            vec![
                entry(&state("late", now - 2 * 60_000, &[])),
                entry(&state("dead", now - 11 * 60_000, &[])),
                (b"bad".to_vec(), b"x".to_vec()),
            ],
            now,
            MIN,
            HOLD,
        );
        let prunable: Vec<&str> = snap.prunable(MIN).map(|s| s.node.as_str()).collect();
        assert_eq!(prunable, ["dead"], "malformed entries are never deleted");
    }

    #[test]
    fn writers_cannot_publish_what_readers_reject() {
        assert!(state("", 1, &[]).validate().is_err());
        assert!(state("n", 1, &[("ns", "", 1, 0)]).validate().is_err());
        assert!(
            state("n", 1, &[("ns", "f", 1, 0), ("ns", "f", 2, 0)])
                .validate()
                .is_err()
        );
        assert!(
            state("n", 1, &[("ns", "f", 1, 0), ("ns2", "f", 2, 0)])
                .validate()
                .is_ok()
        );
    }

    #[test]
    fn old_counts_hold_and_a_fitted_entry_holds_every_fleet() {
        let now = 100_000_000;
        let mut repeated = state("repeated", now, &[("ns", "f", 3, 0)]);
        repeated.counted_at_ms = Some(now - 2 * 60_000);
        let mut ancient = state("ancient", now, &[("ns", "g", 3, 0)]);
        ancient.counted_at_ms = Some(now - 300_001);
        let mut wide = state("wide", now, &[]);
        wide.fleets = (0..2000)
            .map(|i| FleetOnNode {
                namespace: "ns".into(),
                name: format!("fleet-with-a-long-name-{i:05}"),
                ready: u32::from(i == 1999),
                allocated: 0,
                held: None,
                at_risk: None,
            })
            .collect();
        assert!(wide.to_json().len() > MAX_ENTRY_BYTES);
        let left_out = wide.fit();
        assert!(left_out > 0 && wide.truncated);
        assert!(wide.to_json().len() <= MAX_ENTRY_BYTES);
        assert_eq!(wide.fleets.len() + left_out, 2000);
        assert_eq!(wide.fleets[0].name, "fleet-with-a-long-name-01999");
        let snap = Snapshot::from_entries(
            vec![entry(&repeated), entry(&ancient), entry(&wide)],
            now,
            MIN,
            HOLD,
        );
        let f = snap.fleet("ns", "f", |_| false);
        assert_eq!(f.hold_reason, Some(HOLD_STALE_COUNTS));
        assert_eq!(f.holding, ["repeated", "wide"]);
        assert_eq!(
            snap.fleet("ns", "fleet-with-a-long-name-01999", |_| false),
            FleetDrain {
                extra: 1,
                holding: vec!["wide".into()],
                hold_reason: Some(HOLD_TRUNCATED),
                gone: vec![],
            }
        );
        let labels: Vec<&str> = snap.skipped.iter().map(|s| s.why.metric_label()).collect();
        assert_eq!(labels, ["stale_counts", "expired"]);
        let mut later = state("n", now, &[]);
        later.counted_at_ms = Some(now + 1);
        assert_eq!(
            later.validate().unwrap_err().metric_label(),
            "counted_after_update"
        );
    }

    #[test]
    fn cluster_names_are_dns_labels_and_the_empty_one_keeps_the_old_key() {
        assert_eq!(key_for(""), KEY);
        assert_eq!(key_for("eu-1"), "lastcall:drain-state:eu-1");
        for ok in ["", "a", "eu-west-1", &"a".repeat(63)] {
            assert!(check_cluster_name(ok).is_ok(), "{ok}");
        }
        for bad in ["-a", "a-", "A", "a_b", "a:b", "a b", &"a".repeat(64)] {
            assert!(check_cluster_name(bad).is_err(), "{bad}");
        }
    }
}
