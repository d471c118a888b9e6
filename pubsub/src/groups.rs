//! The game server groups file: the `fleetiqconfig` ConfigMap's `fleetiq.conf`,
//! `{"GameServerGroups": ["group-a", "group-b"]}`.
//!
//! It is re-read every cycle rather than watched: the kubelet updates a ConfigMap volume by
//! swapping a `..data` symlink, which defeats inotify and mtime-based caching. An invalid edit
//! keeps the last good list, so a typo in the ConfigMap never stops publishing.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;

/// A ConfigMap value is at most 1 MiB; anything larger is not our file.
pub const MAX_FILE_BYTES: usize = 1024 * 1024;

/// GameLift's limit for a group name or ARN.
const MAX_GROUP_CHARS: usize = 256;

/// Why the groups file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum GroupsError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0} bytes is over the {MAX_FILE_BYTES}-byte limit")]
    TooLarge(usize),
    #[error("invalid JSON (expected {{\"GameServerGroups\": [\"name\", ...]}}): {0}")]
    Json(#[source] serde_json::Error),
    #[error("invalid game server group name {0:?}")]
    InvalidName(String),
}

impl GroupsError {
    /// Bounded label for logs and metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Read { .. } => "read",
            Self::TooLarge(_) => "too_large",
            Self::Json(_) => "invalid_json",
            Self::InvalidName(_) => "invalid_name",
        }
    }
}

#[derive(Deserialize)]
struct Document {
    #[serde(rename = "GameServerGroups")]
    groups: Vec<String>,
}

/// The name a group is known by whether it is listed by name or by ARN
/// (`arn:aws:gamelift:<region>:<account>:gameservergroup/<name>`), so one group listed both
/// ways is polled once.
pub fn group_identity(name_or_arn: &str) -> &str {
    if name_or_arn.starts_with("arn:")
        && let Some((_, name)) = name_or_arn.rsplit_once(":gameservergroup/")
        && !name.is_empty()
    {
        return name;
    }
    name_or_arn
}

/// Parses the file's bytes into the list of groups, in file order, duplicates dropped
/// (a group listed by name and by ARN is a duplicate).
pub fn parse_groups(bytes: &[u8]) -> Result<Vec<String>, GroupsError> {
    if bytes.len() > MAX_FILE_BYTES {
        return Err(GroupsError::TooLarge(bytes.len()));
    }
    let doc: Document = serde_json::from_slice(bytes).map_err(GroupsError::Json)?;
    let mut out: Vec<String> = Vec::with_capacity(doc.groups.len());
    for name in doc.groups {
        let valid = !name.is_empty()
            && name.chars().count() <= MAX_GROUP_CHARS
            && !name.chars().any(|c| c.is_whitespace() || c.is_control());
        if !valid {
            return Err(GroupsError::InvalidName(
                lastcall_common::fleetiq::trim_for_log(&name, 80),
            ));
        }
        let id = group_identity(&name);
        if !out.iter().any(|g| group_identity(g) == id) {
            out.push(name);
        }
    }
    Ok(out)
}

/// Reads at most one byte over the limit, so a huge file (a wrong mount) is refused without
/// being read whole.
async fn read_bounded(path: &Path) -> std::io::Result<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let file = tokio::fs::File::open(path).await?;
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .await?;
    Ok(bytes)
}

/// The outcome of one re-read.
#[derive(Debug)]
pub struct Reload {
    /// The list to poll this cycle: the fresh one, or the last good one after an error.
    /// `None` only when no valid file has been read since start.
    pub groups: Option<Arc<[String]>>,
    /// `Ok(true)` when the list differs from the previous good one.
    pub result: Result<bool, GroupsError>,
}

/// The groups file and the last list read from it successfully.
#[derive(Debug)]
pub struct GroupsFile {
    path: PathBuf,
    last_good: Option<Arc<[String]>>,
}

impl GroupsFile {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            last_good: None,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads and parses the file again, keeping the last good list on any error.
    pub async fn reload(&mut self) -> Reload {
        let result = match read_bounded(&self.path).await {
            Ok(bytes) => parse_groups(&bytes),
            Err(source) => Err(GroupsError::Read {
                path: self.path.clone(),
                source,
            }),
        };
        match result {
            Ok(groups) => {
                let changed = self.last_good.as_deref() != Some(groups.as_slice());
                if changed {
                    self.last_good = Some(groups.into());
                }
                Reload {
                    groups: self.last_good.clone(),
                    result: Ok(changed),
                }
            }
            Err(e) => Reload {
                groups: self.last_good.clone(),
                result: Err(e),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_configmap_format() {
        let groups = parse_groups(br#"{"GameServerGroups": ["a", "b-1.x", "a"], "Other": 1}"#);
        assert_eq!(groups.unwrap(), vec!["a".to_string(), "b-1.x".to_string()]);
        assert!(
            parse_groups(br#"{"GameServerGroups": []}"#)
                .unwrap()
                .is_empty()
        );
        let arn = r#"{"GameServerGroups": ["arn:aws:gamelift:us-west-2:1:gameservergroup/g"]}"#;
        assert_eq!(parse_groups(arn.as_bytes()).unwrap().len(), 1);
        let both =
            r#"{"GameServerGroups": ["g", "arn:aws:gamelift:us-west-2:1:gameservergroup/g", "h"]}"#;
        assert_eq!(
            parse_groups(both.as_bytes()).unwrap(),
            vec!["g".to_string(), "h".to_string()],
            "a group listed by name and by ARN is polled once"
        );
    }

    #[test]
    fn rejects_bad_documents_with_labels() {
        let cases: &[(&[u8], &str)] = &[
            (b"{", "invalid_json"),
            (br#"{"Groups": ["a"]}"#, "invalid_json"),
            (br#"{"GameServerGroups": "a"}"#, "invalid_json"),
            (br#"{"GameServerGroups": [1]}"#, "invalid_json"),
            (br#"{"GameServerGroups": [""]}"#, "invalid_name"),
            (br#"{"GameServerGroups": ["a b"]}"#, "invalid_name"),
        ];
        for (body, label) in cases {
            let err = parse_groups(body).unwrap_err();
            assert_eq!(
                err.metric_label(),
                *label,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        let big = vec![b' '; MAX_FILE_BYTES + 1];
        assert_eq!(parse_groups(&big).unwrap_err().metric_label(), "too_large");
    }

    #[tokio::test]
    async fn a_huge_file_is_refused_after_reading_one_byte_over_the_limit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fleetiq.conf");
        std::fs::write(&path, vec![b' '; 3 * MAX_FILE_BYTES]).unwrap();
        assert_eq!(read_bounded(&path).await.unwrap().len(), MAX_FILE_BYTES + 1);
        let r = GroupsFile::new(&path).reload().await;
        assert_eq!(r.result.unwrap_err().metric_label(), "too_large");
    }

    #[tokio::test]
    async fn keeps_the_last_good_list_across_bad_edits() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fleetiq.conf");
        let mut file = GroupsFile::new(&path);

        let r = file.reload().await;
        assert!(r.groups.is_none());
        assert_eq!(r.result.unwrap_err().metric_label(), "read");

        std::fs::write(&path, r#"{"GameServerGroups": ["a"]}"#).unwrap();
        let r = file.reload().await;
        assert!(r.result.unwrap());
        assert_eq!(r.groups.as_deref(), Some(&["a".to_string()][..]));

        let r = file.reload().await;
        assert!(!r.result.unwrap(), "same list is not a change");

        std::fs::write(&path, r#"{"GameServerGroups": ["a", "#).unwrap();
        let r = file.reload().await;
        assert_eq!(r.result.unwrap_err().metric_label(), "invalid_json");
        assert_eq!(r.groups.as_deref(), Some(&["a".to_string()][..]));

        std::fs::write(&path, r#"{"GameServerGroups": ["a", "b"]}"#).unwrap();
        let r = file.reload().await;
        assert!(r.result.unwrap());
        assert_eq!(r.groups.unwrap().len(), 2);
    }
}
