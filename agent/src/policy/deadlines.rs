//! What the deadline rule (see `deadline`) says for this pass: who asks, the deadline
//! announced to protected servers, and the pressure for hard deadlines.

use crate::deadline::{self, Pressure};
use crate::notice::{Cause, Notice};
use crate::progress::{Progress, Recorded, format_ts};

use super::Inputs;

/// The deadline rule's answer for this pass (see `deadline`).
pub(super) fn deadlines(inp: &Inputs<'_>, progress: &Progress) -> deadline::Deadlines {
    deadline::current(&deadline::Inputs {
        live: inp.notices,
        record: progress.record.entries(),
        unknown: inp.unknown_sources,
        default_deadline: inp.config.default_deadline,
        // A source not recorded yet is first seen now (and recorded in this pass). Where
        // no record is written (an older agent's drain, after deregistration), at the
        // drain's start, so its default deadline does not move from pass to pass.
        now: match &progress.record {
            Recorded::Valid(_) if progress.deregistered.is_none() => inp.now,
            _ => progress.start().unwrap_or(inp.now),
        },
    })
}

/// The deadline and reason announced to protected servers: the earliest currently valid
/// deadline (see `deadline`), else the start plus the default.
pub(super) fn announced(
    inp: &Inputs<'_>,
    progress: &Progress,
    driver: Option<&Notice>,
) -> (String, String) {
    let d = deadlines(inp, progress);
    let deadline = d.announced.map(|a| a.at).unwrap_or_else(|| {
        let started = progress.start().unwrap_or(inp.now);
        started
            .checked_add(
                jiff::SignedDuration::try_from(inp.config.default_deadline).unwrap_or_default(),
            )
            .unwrap_or(started)
    });
    let reason = driver
        .map(|d| d.cause)
        .or(d.pressure.map(|p| p.cause))
        .or(progress.cause)
        .map_or("drain", Cause::as_str);
    (format_ts(deadline), reason.to_string())
}

/// What presses on the node for hard deadlines: the strongest claim, with a deadline only
/// when it is current (see `deadline`). Never the configured default deadline.
pub(super) fn pressure(inp: &Inputs<'_>, progress: &Progress) -> Option<Pressure> {
    deadlines(inp, progress).pressure
}

/// The deadlines a plan works to, for telling them (the dry run's narration): the same rule
/// the plan applies, decided nowhere else.
#[derive(Clone, Debug, PartialEq)]
pub struct DeadlineView {
    /// Announced to protected servers (`lastcall.dev/drain-deadline`).
    pub announced: String,
    pub reason: String,
    /// What presses on the node for hard deadlines (see `eviction::verdict`).
    pub pressure: Option<Pressure>,
}

/// This pass's [`DeadlineView`], for the notice driving the drain (`Plan::driver`).
pub fn deadline_view(inp: &Inputs<'_>, driver: Option<&Notice>) -> DeadlineView {
    let progress = Progress::from_annotations(&inp.observed.node.annotations);
    let (announced, reason) = announced(inp, &progress, driver);
    DeadlineView {
        announced,
        reason,
        pressure: pressure(inp, &progress),
    }
}
