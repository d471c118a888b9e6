//! Drain progress, stored as annotations on the Node.
//!
//! Memory is lost when the agent restarts; the Node is not. Reading progress from the Node
//! is what lets a restarted agent resume a drain without re-registering, re-claiming or
//! deregistering twice.

use std::collections::BTreeMap;

use jiff::Timestamp;

use crate::keys;
use crate::notice::{Cause, Notice, Severity, Source};

/// One (source, cause, severity) that asked for the drain, as remembered on the Node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub source: Source,
    pub cause: Cause,
    pub severity: Severity,
    pub deadline: Option<Timestamp>,
    pub cancellable: bool,
    /// When lastcall first saw this source ask; a claim without a deadline gets the default
    /// deadline counted from here, so it never moves.
    pub first_seen: Timestamp,
    /// The provider stated this deadline and restates it while the claim stands, so it may
    /// move later (an Azure `Preempt` the platform postpones): while its source is unheard
    /// since a restart, the recorded time is not known to be true, even for a claim that
    /// cannot be withdrawn. Absent (false) in records older agents wrote.
    pub restated: bool,
}

impl Entry {
    /// The entry as policy sees a live notice (a recorded drain that must go on).
    pub fn as_notice(&self) -> Notice {
        Notice {
            id: format!("recorded:{}:{}", self.source.as_str(), self.cause.as_str()),
            detail: format!("recorded on the Node since {}", self.first_seen),
            restated: self.restated,
            ..Notice::new(
                self.source,
                self.cause,
                self.severity,
                self.deadline,
                self.cancellable,
                String::new(),
            )
        }
    }
}

/// Who asked for the drain, persisted on the Node: one entry per (source, cause), each with
/// its severity, deadline, cancellability and first sight. What the next record holds is the
/// deadline rule's answer (`deadline::current`), so a restarted agent knows which source set
/// which deadline, and holds the drain while any of them is unknown.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DrainRecord {
    pub entries: Vec<Entry>,
}

/// The record as read from the Node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Recorded {
    #[default]
    Absent,
    Valid(DrainRecord),
    /// Present but unreadable (edited by hand?): never read as "may be cancelled".
    Garbled,
}

impl Recorded {
    /// The recorded entries; none when absent or unreadable.
    pub fn entries(&self) -> &[Entry] {
        match self {
            Self::Valid(r) => &r.entries,
            Self::Absent | Self::Garbled => &[],
        }
    }
}

impl DrainRecord {
    /// A JSON list of entries.
    pub fn to_annotation(&self) -> String {
        let list: Vec<serde_json::Value> = self
            .entries
            .iter()
            .map(|e| {
                let mut v = serde_json::json!({
                    "source": e.source.as_str(),
                    "cause": e.cause.as_str(),
                    "severity": e.severity.as_str(),
                    "cancellable": e.cancellable,
                    "firstSeen": format_precise(e.first_seen),
                });
                if let Some(d) = e.deadline {
                    v["deadline"] = serde_json::Value::String(format_precise(d));
                }
                if e.restated {
                    v["restated"] = serde_json::Value::Bool(true);
                }
                v
            })
            .collect();
        serde_json::Value::Array(list).to_string()
    }

    /// Reads the list this version writes, and the single object older agents wrote (as
    /// one entry). Anything else, an empty list, or one unreadable entry: `None`.
    pub fn parse(s: &str) -> Option<Self> {
        let entries = match serde_json::from_str(s).ok()? {
            serde_json::Value::Array(list) => {
                list.iter().map(parse_entry).collect::<Option<Vec<_>>>()?
            }
            one @ serde_json::Value::Object(_) => vec![parse_entry(&one)?],
            _ => return None,
        };
        (!entries.is_empty()).then_some(Self { entries })
    }
}

fn parse_entry(v: &serde_json::Value) -> Option<Entry> {
    let text = |k: &str| v.get(k).and_then(|x| x.as_str());
    let deadline = match v.get("deadline") {
        None | Some(serde_json::Value::Null) => None,
        Some(d) => Some(d.as_str()?.parse().ok()?),
    };
    Some(Entry {
        source: Source::by_name(text("source")?)?,
        cause: Cause::parse(text("cause")?)?,
        severity: Severity::parse(text("severity")?)?,
        deadline,
        cancellable: v.get("cancellable")?.as_bool()?,
        first_seen: text("firstSeen")?.parse().ok()?,
        restated: match v.get("restated") {
            None | Some(serde_json::Value::Null) => false,
            Some(r) => r.as_bool()?,
        },
    })
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    pub started: Option<Timestamp>,
    /// The latest moment the fence can have been made: the start, or for a start stored to
    /// the whole second (older agents) the second after it. `None` when unreadable.
    /// A fence put back later (`lastcall.dev/fence-restored`) counts from then.
    pub fenced_by: Option<Timestamp>,
    pub cause: Option<Cause>,
    /// lastcall cordoned the node (it was schedulable before), so a cancel may uncordon it.
    pub cordoned_by_us: bool,
    pub deregistered: Option<Timestamp>,
    pub registered: Option<Timestamp>,
    pub record: Recorded,
    /// lastcall added the compat draining taint.
    pub compat_draining_ours: bool,
    /// lastcall asked GKE to start maintenance early (the epoch when unreadable).
    pub handed_back: Option<Timestamp>,
    /// The machine's boot id when the drain started (drains started by older agents have
    /// none: whether their machine came back cannot be told).
    pub boot_id: Option<String>,
}

impl Progress {
    /// Reads progress; a garbled annotation reads as absent for timestamps, but the
    /// presence of the started key alone still means "a drain is in progress".
    pub fn from_annotations(ann: &BTreeMap<String, String>) -> Self {
        let ts = |k: &str| ann.get(k).and_then(|v| v.parse::<Timestamp>().ok());
        let started = ann
            .get(keys::ANN_STARTED)
            .map(|v| v.parse().unwrap_or(Timestamp::UNIX_EPOCH));
        let fenced_by = ann.get(keys::ANN_STARTED).and_then(|v| {
            let t: Timestamp = v.parse().ok()?;
            if v.contains('.') {
                Some(t)
            } else {
                t.checked_add(jiff::SignedDuration::from_secs(1)).ok()
            }
        });
        // A fence put back after another writer stripped it has stood only since then; an
        // unreadable mark is written anew by the next fence, so it never shortens the settle.
        let restored = ann
            .get(keys::ANN_FENCE_RESTORED)
            .map(|v| v.parse::<Timestamp>().ok());
        let fenced_by = match restored {
            None => fenced_by,
            Some(None) => None,
            Some(Some(r)) => fenced_by.map(|f| f.max(r)),
        };
        Self {
            started,
            fenced_by,
            cause: ann.get(keys::ANN_CAUSE).and_then(|c| Cause::parse(c)),
            cordoned_by_us: ann.get(keys::ANN_CORDONED).map(String::as_str) == Some("true"),
            deregistered: ts(keys::ANN_DEREGISTERED).or_else(|| {
                ann.contains_key(keys::ANN_DEREGISTERED)
                    .then_some(Timestamp::UNIX_EPOCH)
            }),
            registered: ts(keys::ANN_REGISTERED),
            record: match ann.get(keys::ANN_NOTICE) {
                None => Recorded::Absent,
                Some(v) => DrainRecord::parse(v).map_or(Recorded::Garbled, Recorded::Valid),
            },
            compat_draining_ours: ann.get(keys::ANN_COMPAT_DRAINING).map(String::as_str)
                == Some("true"),
            handed_back: ts(keys::ANN_HANDED_BACK).or_else(|| {
                ann.contains_key(keys::ANN_HANDED_BACK)
                    .then_some(Timestamp::UNIX_EPOCH)
            }),
            boot_id: ann
                .get(keys::ANN_BOOT_ID)
                .filter(|b| !b.is_empty())
                .cloned(),
        }
    }

    /// The drain's start, when it is readable (a garbled one reads as the epoch).
    pub fn start(&self) -> Option<Timestamp> {
        self.started.filter(|t| *t > Timestamp::UNIX_EPOCH)
    }

    /// The node was handed back to GKE during this drain: final, never cancelled. A mark
    /// older than the drain's start is a leftover of an earlier drain, not this one; an
    /// unreadable one counts (GKE may be taking the node).
    pub fn handed_back_final(&self) -> bool {
        match (self.handed_back, self.start()) {
            (None, _) => false,
            // Compared to the second: either may have been written to the second only.
            (Some(h), Some(s)) if h > Timestamp::UNIX_EPOCH => h.as_second() >= s.as_second(),
            (Some(_), _) => self.is_draining(),
        }
    }

    pub fn is_draining(&self) -> bool {
        self.started.is_some() || self.deregistered.is_some()
    }
}

/// RFC 3339 with second precision, as Kubernetes writes times.
pub fn format_ts(t: Timestamp) -> String {
    t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// RFC 3339 with the fractional seconds (when there are any), for times lastcall counts
/// from: a start stored to the second would make a settle up to a second short. Readers
/// take both forms.
pub fn format_precise(t: Timestamp) -> String {
    t.strftime("%Y-%m-%dT%H:%M:%S%.9fZ").to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_tolerates_garbage() {
        let t: Timestamp = "2026-11-30T05:00:00Z".parse().unwrap();
        let mut ann = BTreeMap::new();
        ann.insert(keys::ANN_STARTED.to_string(), format_ts(t));
        ann.insert(keys::ANN_CAUSE.to_string(), "viability".to_string());
        ann.insert(keys::ANN_CORDONED.to_string(), "true".to_string());
        let p = Progress::from_annotations(&ann);
        assert_eq!(p.started, Some(t));
        assert_eq!(p.cause, Some(Cause::Viability));
        assert!(p.cordoned_by_us && p.is_draining() && p.deregistered.is_none());

        ann.insert(keys::ANN_STARTED.to_string(), "yesterday-ish".to_string());
        ann.insert(keys::ANN_DEREGISTERED.to_string(), "???".to_string());
        let p = Progress::from_annotations(&ann);
        assert!(
            p.started.is_some(),
            "a garbled start time still means draining"
        );
        assert!(
            p.deregistered.is_some(),
            "a garbled deregistered mark must never allow a second call"
        );
        assert!(Progress::from_annotations(&BTreeMap::new()) == Progress::default());
    }

    fn entry(source: &str, deadline: Option<&str>, cancellable: bool) -> Entry {
        Entry {
            source: Source::by_name(source).unwrap(),
            cause: Cause::Maintenance,
            severity: Severity::Terminate,
            deadline: deadline.map(|d| d.parse().unwrap()),
            cancellable,
            first_seen: "2026-11-30T05:00:00.25Z".parse().unwrap(),
            restated: false,
        }
    }

    #[test]
    fn record_lists_every_source_and_reads_the_older_single_entry_form() {
        let r = DrainRecord {
            entries: vec![
                entry("aws_imds", Some("2026-11-30T09:00:00.5Z"), true),
                entry("fleetiq", None, false),
            ],
        };
        let text = r.to_annotation();
        assert!(
            text.starts_with('[') && text.contains("05:00:00.250000000Z"),
            "{text}"
        );
        assert_eq!(DrainRecord::parse(&text), Some(r.clone()));
        assert!(!text.contains("restated"), "written only when true: {text}");
        // A claim whose time the provider may restate says so.
        let mut restated = r.clone();
        restated.entries[1].restated = true;
        let t = restated.to_annotation();
        assert!(t.contains(r#""restated":true"#), "{t}");
        assert_eq!(DrainRecord::parse(&t), Some(restated));
        // What older agents wrote: one object, times to the second.
        let old = r#"{"source":"fleetiq","cause":"preemption","severity":"terminate","deadline":"2026-11-30T05:02:00Z","cancellable":false,"firstSeen":"2026-11-30T05:00:00Z"}"#;
        let parsed = DrainRecord::parse(old).unwrap();
        assert_eq!(parsed.entries.len(), 1);
        let e = &parsed.entries[0];
        assert_eq!(
            (e.source.as_str(), e.cause, e.severity, e.cancellable),
            ("fleetiq", Cause::Preemption, Severity::Terminate, false)
        );
        assert_eq!(e.deadline, Some("2026-11-30T05:02:00Z".parse().unwrap()));
        assert_eq!(e.first_seen, "2026-11-30T05:00:00Z".parse().unwrap());
        assert!(!e.restated, "absent in older records");
        for bad in [
            "",
            "{}",
            "[]",
            "[1]",
            "7",
            r#"{"source":"mars","cause":"viability","severity":"drain","cancellable":true,"firstSeen":"2026-11-30T05:00:00Z"}"#,
            // One unreadable entry spoils the list: never read as fewer sources.
            r#"[{"source":"fleetiq","cause":"viability","severity":"drain","cancellable":true,"firstSeen":"2026-11-30T05:00:00Z"},{"source":"fleetiq"}]"#,
            r#"{"source":"fleetiq","cause":"viability","severity":"drain","cancellable":true,"firstSeen":"2026-11-30T05:00:00Z","deadline":5}"#,
            r#"{"source":"fleetiq","cause":"viability","severity":"drain","cancellable":true,"firstSeen":"2026-11-30T05:00:00Z","restated":"yes"}"#,
        ] {
            assert_eq!(DrainRecord::parse(bad), None, "{bad}");
        }
        let mut ann = BTreeMap::new();
        ann.insert(keys::ANN_NOTICE.to_string(), "{garbage".to_string());
        assert_eq!(Progress::from_annotations(&ann).record, Recorded::Garbled);
        assert!(Recorded::Garbled.entries().is_empty());
        ann.insert(keys::ANN_NOTICE.to_string(), text);
        assert_eq!(
            Progress::from_annotations(&ann).record.entries(),
            r.entries.as_slice()
        );
    }

    #[test]
    fn times_are_stored_to_the_sub_second_and_read_in_both_forms() {
        let t: Timestamp = "2026-11-30T05:00:00.123456789Z".parse().unwrap();
        assert_eq!(format_precise(t), "2026-11-30T05:00:00.123456789Z");
        assert_eq!(format_ts(t), "2026-11-30T05:00:00Z");
        let whole: Timestamp = "2026-11-30T05:00:00Z".parse().unwrap();
        assert_eq!(format_precise(whole), "2026-11-30T05:00:00.000000000Z");
        let mut ann = BTreeMap::new();
        ann.insert(keys::ANN_STARTED.to_string(), format_precise(t));
        let p = Progress::from_annotations(&ann);
        assert_eq!((p.start(), p.fenced_by), (Some(t), Some(t)));
        ann.insert(keys::ANN_STARTED.to_string(), format_precise(whole));
        let p = Progress::from_annotations(&ann);
        assert_eq!((p.start(), p.fenced_by), (Some(whole), Some(whole)));
        // Stored to the second: the fence may have been made up to a second later.
        ann.insert(keys::ANN_STARTED.to_string(), format_ts(whole));
        let p = Progress::from_annotations(&ann);
        let next: Timestamp = "2026-11-30T05:00:01Z".parse().unwrap();
        assert_eq!((p.start(), p.fenced_by), (Some(whole), Some(next)));
        ann.insert(keys::ANN_STARTED.to_string(), "garbage".to_string());
        let p = Progress::from_annotations(&ann);
        assert!(p.started.is_some() && p.start().is_none() && p.fenced_by.is_none());
    }

    #[test]
    fn a_hand_back_is_final_only_for_the_drain_it_was_made_in() {
        let mut ann = BTreeMap::new();
        let at = |k: &str, v: &str, ann: &mut BTreeMap<String, String>| {
            ann.insert(k.to_string(), v.to_string());
        };
        assert!(!Progress::from_annotations(&ann).handed_back_final());
        at(keys::ANN_STARTED, "2026-11-30T05:00:00.5Z", &mut ann);
        assert!(!Progress::from_annotations(&ann).handed_back_final());
        at(keys::ANN_HANDED_BACK, "2026-11-30T06:00:00Z", &mut ann);
        assert!(Progress::from_annotations(&ann).handed_back_final());
        // The same second, written to the second by an older agent: this drain's.
        at(keys::ANN_HANDED_BACK, "2026-11-30T05:00:00Z", &mut ann);
        assert!(Progress::from_annotations(&ann).handed_back_final());
        // A leftover of an earlier drain.
        at(keys::ANN_HANDED_BACK, "2026-11-30T04:59:59Z", &mut ann);
        assert!(!Progress::from_annotations(&ann).handed_back_final());
        // Unreadable: GKE may be taking the node, so final while draining.
        at(keys::ANN_HANDED_BACK, "soon", &mut ann);
        assert!(Progress::from_annotations(&ann).handed_back_final());
        ann.remove(keys::ANN_STARTED);
        assert!(!Progress::from_annotations(&ann).handed_back_final());
        at(keys::ANN_DEREGISTERED, "2026-11-30T07:00:00Z", &mut ann);
        assert!(Progress::from_annotations(&ann).handed_back_final());
    }
}
