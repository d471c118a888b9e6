//! The current deadline: which one is true now, where it came from, and whether it may end
//! a match.
//!
//! lastcall ends `OnUpgrade`/`Always` matches itself at `deadline − grace`, so a deadline that
//! is no longer true kills matches for nothing. This module is the one place that decides
//! which deadline is true. Pure: no I/O, no clock (`now` is an input).
//!
//! Every (source, cause, severity) that asks for the drain is a [`Claim`]. Its deadline is:
//!
//! | claim | deadline | standing |
//! |---|---|---|
//! | live, a time the provider stated and may restate (cancellable, or restated like an Azure `Preempt`) | the live one: the source may move it later (a rescheduled event) | current |
//! | live, not cancellable and never restated (EC2 Spot), or a deadline lastcall counted from first seen | the earlier of the live and the recorded one: a restart or a lagging replica re-anchors it later | current |
//! | recorded, not cancellable, source silent or withdrawn | the recorded one | current |
//! | recorded, not cancellable but restated (an Azure `Preempt`), its source unknown since a restart | the recorded one | unconfirmed: the platform may have moved it meanwhile |
//! | recorded, cancellable, its source unknown since a restart | the recorded one | unconfirmed |
//! | recorded, cancellable, its source known and no longer asking | – (withdrawn) | gone |
//!
//! - The deadline announced to games is the earliest of every claim's deadline, or, for a
//!   claim without one, its first-seen time plus the default deadline. Unconfirmed claims
//!   count (earlier is the safe side for a game that plans its ending).
//! - Only a **current** Terminate deadline may end a match. An unconfirmed one (the event may
//!   have been cancelled or moved while the agent was down) protects and warns instead.
//! - A deadline moves later only when the source that set it says so: live claims replace
//!   their own recorded deadline only when the provider stated it and may restate it.

use std::time::Duration;

use jiff::{SignedDuration, Timestamp};

use crate::notice::{Cause, Notice, Severity, Source};

pub use crate::progress::Entry;

/// One claim per source, cause and severity: a reboot (Drain) and a stop (Terminate) of one
/// provider are two claims, so a Drain's date never becomes a Terminate's.
trait Key {
    fn key(&self) -> (Source, &'static str, Severity);
}

impl Key for Entry {
    fn key(&self) -> (Source, &'static str, Severity) {
        (self.source, self.cause.as_str(), self.severity)
    }
}

/// Whether a claim's deadline is true now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Standing {
    /// Its source says it now, or it cannot be withdrawn.
    Current,
    /// Recorded before a restart; its source has not reported since.
    Unconfirmed,
}

/// A (source, cause, severity) asking for the drain, with its deadline as this module judged
/// it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claim {
    pub entry: Entry,
    pub standing: Standing,
    /// The deadline was read from a live notice (not from the record).
    pub live: bool,
}

/// Where an announced deadline came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// A live notice of this source stated it.
    Live(Source),
    /// The Node's record holds it for this source.
    Record(Source),
    /// This source gave no deadline: its first-seen time plus `--drain-deadline`.
    Default(Source),
}

/// A deadline and where it came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dated {
    pub at: Timestamp,
    pub origin: Origin,
}

/// What presses on the node, as the eviction verdict reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pressure {
    pub cause: Cause,
    pub severity: Severity,
    /// A current deadline a source gave. Never the configured default (an invented
    /// deadline must not end a match), never an unconfirmed one.
    pub deadline: Option<Timestamp>,
}

impl Pressure {
    pub fn of(notice: &Notice) -> Self {
        Self {
            cause: notice.cause,
            severity: notice.severity,
            deadline: notice.deadline,
        }
    }

    /// When a match whose pod has `grace` between SIGTERM and SIGKILL may be ended:
    /// `deadline − grace` of a current Terminate deadline (a grace too long to represent:
    /// at once). `None`: nothing here may end a match. (Whether `eviction.safe` permits it
    /// is the verdict's question.)
    pub fn ends_at(&self, grace: Duration) -> Option<Timestamp> {
        match (self.severity, self.deadline) {
            (Severity::Terminate, Some(d)) => Some(
                SignedDuration::try_from(grace)
                    .ok()
                    .and_then(|g| d.checked_sub(g).ok())
                    .unwrap_or(Timestamp::MIN),
            ),
            _ => None,
        }
    }

    /// Whether such a match may be ended at `now`.
    pub fn may_end(&self, grace: Duration, now: Timestamp) -> bool {
        self.ends_at(grace).is_some_and(|at| at <= now)
    }
}

/// What the deadline rule reads.
#[derive(Clone, Copy, Debug)]
pub struct Inputs<'a> {
    /// Every live notice (Observe ones are ignored: they ask for nothing).
    pub live: &'a [Notice],
    /// The Node's record of who asked.
    pub record: &'a [Entry],
    /// Sources that have not reported since this agent started.
    pub unknown: &'a [Source],
    /// `--drain-deadline`: what a claim without a deadline announces, from its first sight.
    pub default_deadline: Duration,
    /// When a claim the record does not hold yet is first seen: normally now.
    pub now: Timestamp,
}

/// The answer: every claim, the deadline announced to games, and what presses on the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Deadlines {
    /// Every claim, current and unconfirmed: the Node's next record.
    pub claims: Vec<Claim>,
    /// The earliest deadline of any claim (a default one for claims without a deadline).
    pub announced: Option<Dated>,
    /// What the eviction verdict reads; its deadline is current or absent.
    pub pressure: Option<Pressure>,
}

impl Deadlines {
    /// The record to store: every claim, in a stable order.
    pub fn record(&self) -> Vec<Entry> {
        self.claims.iter().map(|c| c.entry.clone()).collect()
    }
}

fn min_some(a: Option<Timestamp>, b: Option<Timestamp>) -> Option<Timestamp> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, y) => x.or(y),
    }
}

/// The deadline rule (see the module table).
pub fn current(inp: &Inputs<'_>) -> Deadlines {
    // Live notices, one group per (source, cause, severity).
    let mut groups: Vec<Entry> = vec![];
    // Whether every notice of the group has a deadline the provider stated and may move
    // (cancellable, or restated while it stands).
    let mut authoritative: Vec<bool> = vec![];
    for n in inp.live.iter().filter(|n| n.severity >= Severity::Drain) {
        let stated = (n.cancellable || n.restated) && !n.estimated_deadline;
        let key = (n.source, n.cause.as_str(), n.severity);
        if let Some(i) = groups.iter().position(|g| g.key() == key) {
            let g = &mut groups[i];
            g.deadline = min_some(g.deadline, n.deadline);
            g.cancellable &= n.cancellable;
            g.restated &= n.restated;
            authoritative[i] &= stated;
            continue;
        }
        groups.push(Entry {
            source: n.source,
            cause: n.cause,
            severity: n.severity,
            deadline: n.deadline,
            cancellable: n.cancellable,
            first_seen: inp.now,
            restated: n.restated,
        });
        authoritative.push(stated);
    }
    let mut claims: Vec<Claim> = vec![];
    for (g, authoritative) in groups.into_iter().zip(authoritative) {
        let entry = match inp.record.iter().find(|r| r.key() == g.key()) {
            // The source stated this deadline and may move it: it replaces the record's.
            // (A record that could not be withdrawn is replaced only by a notice that cannot
            // be either: the same restated event, not a weaker claim under its key.)
            Some(r) if authoritative && (r.cancellable || !g.cancellable) => Entry {
                first_seen: r.first_seen,
                ..g.clone()
            },
            // Not cancellable, or counted from first sight: never later than recorded.
            Some(r) => Entry {
                deadline: min_some(r.deadline, g.deadline),
                cancellable: r.cancellable && g.cancellable,
                first_seen: r.first_seen,
                ..g.clone()
            },
            None => g.clone(),
        };
        claims.push(Claim {
            live: entry.deadline.is_some() && entry.deadline == g.deadline,
            entry,
            standing: Standing::Current,
        });
    }
    // Recorded claims no live notice repeats.
    for r in inp.record {
        if claims.iter().any(|c| c.entry.key() == r.key()) {
            continue;
        }
        let unknown = inp.unknown.contains(&r.source);
        // A claim that cannot be withdrawn stays current, unless its time may have moved
        // while its source was unheard (a restated one, an Azure `Preempt` postponed before
        // a restart could record it).
        let standing = match (r.cancellable, unknown) {
            (false, false) => Standing::Current,
            (false, true) if !r.restated => Standing::Current,
            (_, true) => Standing::Unconfirmed,
            // Its source is known and no longer asks: withdrawn.
            (true, false) => continue,
        };
        claims.push(Claim {
            entry: r.clone(),
            standing,
            live: false,
        });
    }
    claims.sort_by(|a, b| a.entry.key().cmp(&b.entry.key()));

    let default = SignedDuration::try_from(inp.default_deadline).unwrap_or_default();
    let announced = claims
        .iter()
        .filter_map(|c| {
            let e = &c.entry;
            Some(match e.deadline {
                Some(at) if c.live => Dated {
                    at,
                    origin: Origin::Live(e.source),
                },
                Some(at) => Dated {
                    at,
                    origin: Origin::Record(e.source),
                },
                None => Dated {
                    at: e.first_seen.checked_add(default).ok()?,
                    origin: Origin::Default(e.source),
                },
            })
        })
        .min_by_key(|d| d.at);

    let strongest = |standing: Standing| {
        let notices: Vec<Notice> = claims
            .iter()
            .filter(|c| c.standing == standing)
            .map(|c| c.entry.as_notice())
            .collect();
        Notice::strongest(&notices).map(Pressure::of)
    };
    let pressure = match (
        strongest(Standing::Current),
        strongest(Standing::Unconfirmed),
    ) {
        // Something unconfirmed presses harder: protect (and warn), never end. Nothing
        // outranks a current Terminate, so its deadline stands whatever else is unknown.
        (c, Some(u)) if c.is_none_or(|c| u.severity > c.severity) => Some(Pressure {
            deadline: None,
            ..u
        }),
        (c, _) => c,
    };
    Deadlines {
        claims,
        announced,
        pressure,
    }
}

#[cfg(test)]
mod tests;
