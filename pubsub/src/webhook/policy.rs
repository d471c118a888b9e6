//! The scaling rule, pure: Agones' Buffer policy plus the Ready servers on draining nodes.
//!
//! `desired = clamp(buffer_target + extra, min, max)`, where `buffer_target` is Agones'
//! own Buffer formula (`allocated + n`, or `ceil(allocated × 100 / (100 − p))` for `p%`)
//! and `extra` is the Fleet's Ready servers on draining nodes. `min` and `max` bound the
//! final answer, extra included: `max` stays a hard cap on the Fleet's size.
//!
//! When the drain state cannot be seen (Redis unreadable, or a stale entry names the
//! Fleet) the answer is *held*: it may grow the Fleet but never shrink it below its current
//! size (except down to `max`), since a guessed zero would scale down just as a node's
//! capacity leaves.
//!
//! Settings are validated with Agones' own `BufferPolicy` rules, so whatever a Buffer
//! FleetAutoscaler accepts, this accepts, and means the same.

use std::fmt;
use std::str::FromStr;

/// Largest replica count: Agones' `replicas` is an int32.
pub const MAX_REPLICAS: u32 = i32::MAX as u32;

/// The Ready buffer to keep: a number of servers, or a share of the Fleet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buffer {
    /// Keep this many Ready servers (at least 1).
    Absolute(u32),
    /// Keep this percentage of the Fleet Ready (1–99).
    Percent(u8),
}

impl fmt::Display for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Absolute(n) => write!(f, "{n}"),
            Self::Percent(p) => write!(f, "{p}%"),
        }
    }
}

impl FromStr for Buffer {
    type Err = PolicyError;

    /// `5` or `10%`, as Agones' `bufferSize`.
    fn from_str(raw: &str) -> Result<Self, Self::Err> {
        let s = raw.trim();
        let bad = || PolicyError::Buffer(raw.to_string());
        if let Some(p) = s.strip_suffix('%') {
            let p: u8 = p.parse().map_err(|_| bad())?;
            if !(1..=99).contains(&p) {
                return Err(bad());
            }
            return Ok(Self::Percent(p));
        }
        let n: u32 = s.parse().map_err(|_| bad())?;
        if n == 0 || n > MAX_REPLICAS {
            return Err(bad());
        }
        Ok(Self::Absolute(n))
    }
}

/// A replica bound (`min` or `max`): 0 to 2^31 − 1.
pub fn parse_replicas(raw: &str) -> Result<u32, PolicyError> {
    raw.trim()
        .parse::<u32>()
        .ok()
        .filter(|n| *n <= MAX_REPLICAS)
        .ok_or_else(|| PolicyError::Replicas(raw.to_string()))
}

/// Settings Agones' Buffer policy would refuse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error(
        "buffer {0:?} is neither a count of at least 1 (5) nor a percentage from 1% to 99% (10%)"
    )]
    Buffer(String),
    #[error("replica count {0:?} is not a whole number from 0 to 2147483647")]
    Replicas(String),
    #[error("min replicas {min} is above max replicas {max}")]
    MinAboveMax { min: u32, max: u32 },
    #[error("max replicas {max} is below the buffer {buffer}")]
    MaxBelowBuffer { max: u32, buffer: u32 },
    #[error("min replicas {min} is below the buffer {buffer} (use 0 or at least the buffer)")]
    MinBelowBuffer { min: u32, buffer: u32 },
    #[error(
        "a percentage buffer needs min replicas of at least 1, or the Fleet can never grow from 0"
    )]
    PercentNeedsMin,
}

/// A validated buffer policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    buffer: Buffer,
    min: u32,
    max: u32,
}

impl Policy {
    /// Checks the settings with Agones' `BufferPolicy` rules.
    pub fn new(buffer: Buffer, min: u32, max: u32) -> Result<Self, PolicyError> {
        if min > max {
            return Err(PolicyError::MinAboveMax { min, max });
        }
        match buffer {
            Buffer::Absolute(n) => {
                if max < n {
                    return Err(PolicyError::MaxBelowBuffer { max, buffer: n });
                }
                if min != 0 && min < n {
                    return Err(PolicyError::MinBelowBuffer { min, buffer: n });
                }
            }
            Buffer::Percent(_) if min < 1 => return Err(PolicyError::PercentNeedsMin),
            Buffer::Percent(_) => {}
        }
        Ok(Self { buffer, min, max })
    }

    pub fn buffer(&self) -> Buffer {
        self.buffer
    }

    pub fn min(&self) -> u32 {
        self.min
    }

    pub fn max(&self) -> u32 {
        self.max
    }

    /// This policy with some settings replaced (per-Fleet overrides), validated again.
    /// An override may lower the max but never raise it: `self.max` (the flag) stays a
    /// hard cap, and an overridden min is brought down to it too.
    pub fn with(&self, o: &Overrides) -> Result<Self, PolicyError> {
        Self::new(
            o.buffer.unwrap_or(self.buffer),
            o.min.map_or(self.min, |m| m.min(self.max)),
            o.max.map_or(self.max, |m| m.min(self.max)),
        )
    }
}

/// Per-Fleet replacements for the service-wide settings.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Overrides {
    pub buffer: Option<Buffer>,
    pub min: Option<u32>,
    pub max: Option<u32>,
}

impl Overrides {
    /// `self`, with each setting `other` has taking precedence.
    pub fn or(self, other: Overrides) -> Overrides {
        Overrides {
            buffer: other.buffer.or(self.buffer),
            min: other.min.or(self.min),
            max: other.max.or(self.max),
        }
    }
}

/// What the webhook is told about the Fleet (from its status).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FleetCounts {
    pub replicas: u32,
    pub allocated: u32,
}

/// Which bound changed the answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bound {
    Min,
    Max,
}

impl Bound {
    pub fn label(self) -> &'static str {
        match self {
            Self::Min => "min",
            Self::Max => "max",
        }
    }
}

/// The answer and how it was reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    /// The replica count to ask for.
    pub replicas: u32,
    /// Whether that differs from the Fleet's current replicas.
    pub scale: bool,
    /// Agones' Buffer formula alone, before extra and bounds.
    pub buffer_target: u64,
    /// Ready servers on draining nodes, added to the target.
    pub extra: u64,
    /// The bound that changed the answer, if any.
    pub clamped: Option<Bound>,
    /// A scale-down was refused because the drain state was not fully known.
    pub held: bool,
}

/// Agones' Buffer target for `allocated` servers, unbounded.
pub fn buffer_target(buffer: Buffer, allocated: u32) -> u64 {
    let allocated = u64::from(allocated);
    match buffer {
        Buffer::Absolute(n) => allocated + u64::from(n),
        // Ready must be p% of the Fleet, so allocated must be (100 − p)%: ceil(a·100/(100−p)).
        Buffer::Percent(p) => (allocated * 100).div_ceil(100 - u64::from(p)),
    }
}

/// The replica count for `fleet` under `policy`, with `extra` Ready servers on draining
/// nodes to replace. With `hold_at` (the drain state is not fully known, so `extra` may be
/// short) the answer never goes below that size, except down to `max`. The size to hold
/// is the Fleet's own `spec.replicas` when it can be read: Agones writes the answer into
/// `spec.replicas`, so holding at `status.replicas` (spec + surge during a rolling update)
/// would ratchet the Fleet up at every held sync.
pub fn decide(policy: &Policy, fleet: FleetCounts, extra: u64, hold_at: Option<u32>) -> Decision {
    let target = buffer_target(policy.buffer, fleet.allocated);
    let wanted = target.saturating_add(extra);
    let (replicas, clamped) = if wanted < u64::from(policy.min) {
        (policy.min, Some(Bound::Min))
    } else if wanted > u64::from(policy.max) {
        (policy.max, Some(Bound::Max))
    } else {
        // wanted ≤ max ≤ u32::MAX here.
        (u32::try_from(wanted).unwrap_or(policy.max), None)
    };
    let (replicas, clamped, held) = match hold_at {
        Some(size) if size.min(policy.max) > replicas => (size.min(policy.max), None, true),
        _ => (replicas, clamped, false),
    };
    Decision {
        replicas,
        // Agones applies `status.replicas` when `scale` is false, so any other answer
        // must say `scale: true`.
        scale: replicas != fleet.replicas,
        buffer_target: target,
        extra,
        clamped,
        held,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(buffer: &str, min: u32, max: u32) -> Policy {
        Policy::new(buffer.parse().unwrap(), min, max).unwrap()
    }

    fn fleet(replicas: u32, allocated: u32) -> FleetCounts {
        FleetCounts {
            replicas,
            allocated,
        }
    }

    #[test]
    fn percentages_round_up_as_agones_does() {
        // (buffer, allocated, expected target): ceil(allocated * 100 / (100 - p)).
        let rows: &[(&str, u32, u64)] = &[
            ("30%", 8, 12), // 11.43 → 12, Agones' own example
            ("50%", 10, 20),
            ("50%", 11, 22),
            ("10%", 9, 10),
            ("10%", 10, 12), // 11.11 → 12
            ("1%", 99, 100),
            ("1%", 100, 102), // 101.01 → 102
            ("99%", 1, 100),
            ("99%", 3, 300),
            ("25%", 0, 0),
            ("5", 0, 5),
            ("5", 7, 12),
            ("1", u32::MAX, u64::from(u32::MAX) + 1),
        ];
        for &(buffer, allocated, want) in rows {
            let got = buffer_target(buffer.parse().unwrap(), allocated);
            assert_eq!(got, want, "{buffer} with {allocated} allocated");
        }
    }

    #[test]
    fn bounds_apply_to_the_answer_extra_included() {
        // (buffer, min, max, replicas, allocated, extra) → (replicas, clamped)
        type Row = (&'static str, u32, u32, u32, u32, u64, u32, Option<Bound>);
        let rows: &[Row] = &[
            ("5", 0, 100, 10, 5, 0, 10, None),
            ("5", 0, 100, 10, 5, 6, 16, None), // exactly 6 more than the buffer
            ("5", 10, 100, 10, 0, 0, 10, Some(Bound::Min)), // zero allocated → min
            ("5", 10, 100, 10, 0, 6, 11, None), // extra lifts it above min
            ("5", 0, 100, 0, 0, 0, 5, None),   // zero allocated, no min → buffer
            ("5", 0, 20, 20, 18, 0, 20, Some(Bound::Max)),
            ("5", 0, 20, 15, 10, 6, 20, Some(Bound::Max)), // max is a hard cap
            ("10%", 1, 100, 1, 0, 0, 1, Some(Bound::Min)), // percentage of nothing → min
            ("10%", 1, 100, 12, 10, 3, 15, None),
            ("50%", 2, 1000, 4, 2, 0, 4, None),
            (
                "5",
                0,
                MAX_REPLICAS,
                1,
                0,
                u64::MAX,
                MAX_REPLICAS,
                Some(Bound::Max),
            ),
        ];
        for &(buffer, min, max, replicas, allocated, extra, want, clamped) in rows {
            let d = decide(
                &policy(buffer, min, max),
                fleet(replicas, allocated),
                extra,
                None,
            );
            assert_eq!(
                (d.replicas, d.clamped),
                (want, clamped),
                "buffer {buffer}, min {min}, max {max}, allocated {allocated}, extra {extra}"
            );
            assert_eq!(d.scale, want != replicas);
            assert_eq!(d.extra, extra);
        }
    }

    #[test]
    fn a_held_answer_grows_but_never_shrinks_below_the_current_size_or_above_max() {
        // (replicas, allocated, extra) under buffer 5, min 0, max 20 → (replicas, held)
        let rows: &[(u32, u32, u64, u32, bool)] = &[
            (16, 5, 0, 16, true),  // would be 10: held at 16
            (10, 5, 0, 10, false), // nothing to hold
            (10, 8, 0, 13, false), // growth is allowed
            (10, 5, 3, 13, false), // growth with what could be read
            (25, 5, 0, 20, true),  // above max: down to max, not below
            (25, 18, 0, 20, false),
        ];
        let p = policy("5", 0, 20);
        for &(replicas, allocated, extra, want, held) in rows {
            let d = decide(&p, fleet(replicas, allocated), extra, Some(replicas));
            assert_eq!(
                (d.replicas, d.held),
                (want, held),
                "replicas {replicas}, allocated {allocated}, extra {extra}"
            );
            assert_eq!(d.scale, want != replicas);
            let plain = decide(&p, fleet(replicas, allocated), extra, None);
            assert!(d.replicas >= plain.replicas, "holding never asks for less");
        }
    }

    #[test]
    fn a_hold_keeps_the_fleets_spec_not_its_status() {
        let p = policy("5", 0, 100);
        // A rolling update: spec 10, status 13 (the surge), 2 allocated: buffer 7.
        let d = decide(&p, fleet(13, 2), 0, Some(10));
        assert_eq!((d.replicas, d.scale, d.held), (10, true, true));
        // Scaling up: spec 20, status 15 (servers still being created): not shrunk to 17.
        let d = decide(&p, fleet(15, 12), 0, Some(20));
        assert_eq!((d.replicas, d.held), (20, true));
    }

    #[test]
    fn buffer_and_replica_parsing() {
        assert_eq!("5".parse(), Ok(Buffer::Absolute(5)));
        assert_eq!(" 10% ".parse(), Ok(Buffer::Percent(10)));
        for bad in [
            "0",
            "0%",
            "100%",
            "-1",
            "5.5",
            "%",
            "",
            "ten",
            "1e3",
            "2147483648",
        ] {
            assert!(bad.parse::<Buffer>().is_err(), "{bad:?}");
        }
        assert_eq!(parse_replicas("0"), Ok(0));
        assert_eq!(parse_replicas("2147483647"), Ok(MAX_REPLICAS));
        for bad in ["-1", "2147483648", "x", ""] {
            assert!(parse_replicas(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn settings_follow_agones_buffer_policy_validation() {
        let abs = Buffer::Absolute(5);
        assert!(Policy::new(abs, 0, 5).is_ok());
        assert!(Policy::new(abs, 5, 5).is_ok());
        assert_eq!(
            Policy::new(abs, 6, 5),
            Err(PolicyError::MinAboveMax { min: 6, max: 5 })
        );
        assert_eq!(
            Policy::new(abs, 0, 4),
            Err(PolicyError::MaxBelowBuffer { max: 4, buffer: 5 })
        );
        assert_eq!(
            Policy::new(abs, 3, 10),
            Err(PolicyError::MinBelowBuffer { min: 3, buffer: 5 })
        );
        assert_eq!(
            Policy::new(Buffer::Percent(10), 0, 10),
            Err(PolicyError::PercentNeedsMin)
        );
        assert!(Policy::new(Buffer::Percent(10), 1, 1).is_ok());
    }

    #[test]
    fn overrides_replace_only_what_they_name_and_are_revalidated() {
        let base = policy("5", 0, 100);
        let o = Overrides {
            buffer: Some(Buffer::Percent(20)),
            min: Some(2),
            max: None,
        };
        let p = base.with(&o).unwrap();
        assert_eq!(
            (p.buffer(), p.min(), p.max()),
            (Buffer::Percent(20), 2, 100)
        );
        let raised = Overrides {
            min: Some(150),
            max: Some(500),
            ..Overrides::default()
        };
        let p = base.with(&raised).unwrap();
        assert_eq!(
            (p.min(), p.max()),
            (100, 100),
            "the flags' max is a hard cap"
        );
        let too_small = Overrides {
            max: Some(3),
            ..Overrides::default()
        };
        assert!(base.with(&too_small).is_err());
        let query = Overrides {
            min: Some(7),
            ..Overrides::default()
        };
        let annotations = Overrides {
            min: Some(9),
            max: Some(50),
            ..Overrides::default()
        };
        assert_eq!(
            annotations.or(query),
            Overrides {
                buffer: None,
                min: Some(7),
                max: Some(50)
            }
        );
    }
}
