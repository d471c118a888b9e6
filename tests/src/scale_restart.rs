//! Scale scenario: the API server restarts under every agent (a control-plane upgrade).
//!
//! Every watch ends, every request is answered 503 for a while, and the watch history is
//! gone, so each watch resumed from before is answered 410 and its agent lists that kind
//! again. What a cluster pays is the re-list storm: how many requests and bytes, how spread
//! out (kube's watcher backs off with jitter), whether the priority level refuses agents,
//! and that no agent writes anything because of it. Read from the emulator's journal.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant, SystemTime};

use anyhow::ensure;

use crate::kube::{JournalEntry, Traffic, Verb};
use crate::scale::{CpuSample, ScaleWorld, is_agent, traffic_delta};

/// The kinds every agent watches.
pub const WATCHED: [&str; 3] = ["nodes", "pods", "gameservers"];

/// What one restart cost.
#[derive(Debug)]
pub struct RestartReport {
    pub agents: usize,
    /// How long requests were answered 503.
    pub down: Duration,
    /// From the end of the down time to the last agent's last re-list, and to its watch
    /// resumed after it.
    pub last_list: Duration,
    pub last_watch: Duration,
    /// Each (agent, kind)'s successful re-list, from the end of the down time.
    pub list_after_up: Vec<Duration>,
    /// Watches resumed without a re-list: their client held a resourceVersion at least
    /// as new as the restart's (a filtered watch whose last event or bookmark was the
    /// newest write).
    pub resumed_without_list: usize,
    /// The agents' requests by `verb resource status`.
    pub by_kind: BTreeMap<String, u64>,
    /// The agents' requests and bytes (watch events included) from the restart until
    /// every watch was back.
    pub agent_traffic: Traffic,
    /// Successful LISTs per agent: 3 when each kind was listed once.
    pub lists_per_agent_max: u64,
    /// Agent requests with a mutating verb (the promise: 0).
    pub agent_writes: Vec<String>,
    /// Successful agent LISTs in the busiest second, and all agent requests then.
    pub peak_lists_per_s: u64,
    pub peak_agent_rps: u64,
    /// 429s: to agents, to everyone.
    pub agent_429: u64,
    pub status_429: u64,
    /// Requests that waited in an APF queue meanwhile.
    pub apf_queued: u64,
    pub cpu: CpuSample,
}

/// Per (agent, kind): the time of its last successful LIST, if it listed again, and of the
/// first watch accepted after it from a resourceVersion the restarted server still serves.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Back {
    listed: Option<SystemTime>,
    resumed: Option<SystemTime>,
}

type Relists = HashMap<(String, String), Back>;

/// The `resourceVersion` a request asked for.
pub fn resource_version(query: &str) -> Option<u64> {
    query
        .split('&')
        .find_map(|kv| kv.strip_prefix("resourceVersion="))
        .and_then(|rv| rv.parse().ok())
}

/// Reads each agent watch's way back from the journal after a restart whose watch cache
/// starts at `floor`. A watch from before `floor` is accepted (200) and then ends with an
/// in-stream 410, so only a watch from `floor` or later counts as resumed: one whose
/// client held a resourceVersion that new resumes without listing, as a real server would.
fn relists(entries: &[JournalEntry], floor: u64) -> Relists {
    let mut out: Relists = HashMap::new();
    for e in entries {
        let (Some(id), Some(kind)) = (e.identity.as_deref(), e.resource.as_deref()) else {
            continue;
        };
        if !is_agent(id) || e.status != 200 || !WATCHED.contains(&kind) {
            continue;
        }
        let key = (id.to_string(), kind.to_string());
        match e.verb {
            Verb::List => {
                out.insert(
                    key,
                    Back {
                        listed: Some(e.at),
                        resumed: None,
                    },
                );
            }
            Verb::Watch if resource_version(&e.query).is_some_and(|rv| rv >= floor) => {
                out.entry(key).or_default().resumed.get_or_insert(e.at);
            }
            _ => {}
        }
    }
    out
}

impl ScaleWorld {
    /// Restarts the API server with `down` of 503s, waits until every agent has resumed
    /// the watch of each kind it watches (listing again first unless its resourceVersion
    /// was still served; at most `limit`), then
    /// until the agents are quiet, and reads what it cost from the journal.
    pub async fn restart_api(
        &self,
        down: Duration,
        limit: Duration,
    ) -> anyhow::Result<RestartReport> {
        let n = self.spec.agents;
        let seq0 = self.next_seq().await?;
        let t0 = self.journal.traffic().await?;
        let apf0 = self.journal.apf().await?;
        let cpu0 = self.cpu();
        let started = Instant::now();
        let floor = self.journal.restart(down).await?;
        let up = SystemTime::now() + down;
        let deadline = started + limit;
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let entries = self.journal.entries_since(seq0).await?;
            let r = relists(&entries, floor);
            let back = r.values().filter(|v| v.resumed.is_some()).count();
            if back >= n * WATCHED.len() {
                break;
            }
            if Instant::now() >= deadline {
                let missing: Vec<String> = r
                    .iter()
                    .filter(|(_, v)| v.resumed.is_none())
                    .map(|(k, _)| format!("{}/{} (listed, no watch after)", k.0, k.1))
                    .chain(
                        entries
                            .iter()
                            .filter_map(|e| e.identity.as_deref())
                            .filter(|id| is_agent(id))
                            .collect::<std::collections::BTreeSet<_>>()
                            .into_iter()
                            .flat_map(|id| WATCHED.iter().map(move |k| (id, *k)))
                            .filter(|(id, k)| !r.contains_key(&(id.to_string(), k.to_string())))
                            .map(|(id, k)| format!("{id}/{k} (no watch from {floor} or later)")),
                    )
                    .take(8)
                    .collect();
                ensure!(
                    false,
                    "after {limit:?}, {back} of {} agent watches resumed; e.g. {missing:?}",
                    n * WATCHED.len()
                );
            }
        }
        self.settle(Duration::from_secs(2), limit).await?;
        let entries = self.journal.entries_since(seq0).await?;
        let t1 = self.journal.traffic().await?;
        let apf1 = self.journal.apf().await?;
        let cpu = self.cpu().since(&cpu0);
        let r = relists(&entries, floor);
        let since_up = |at: SystemTime| at.duration_since(up).unwrap_or_default();
        let list_after_up: Vec<Duration> =
            r.values().filter_map(|v| v.listed).map(since_up).collect();
        let last_list = list_after_up.iter().max().copied().unwrap_or_default();
        let last_watch = r
            .values()
            .filter_map(|v| v.resumed)
            .map(since_up)
            .max()
            .unwrap_or_default();
        let by_agent = |e: &&JournalEntry| e.identity.as_deref().is_some_and(is_agent);
        let mut by_kind = BTreeMap::new();
        let mut lists: HashMap<&str, u64> = HashMap::new();
        let mut per_sec: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
        for e in entries.iter().filter(by_agent) {
            *by_kind
                .entry(format!(
                    "{} {} {}",
                    e.verb.as_str(),
                    e.resource.as_deref().unwrap_or("-"),
                    e.status
                ))
                .or_default() += 1;
            let s = per_sec
                .entry(
                    e.at.duration_since(SystemTime::UNIX_EPOCH)
                        .unwrap_or_default()
                        .as_secs(),
                )
                .or_default();
            s.1 += 1;
            if e.verb == Verb::List && e.status == 200 {
                s.0 += 1;
                *lists
                    .entry(e.identity.as_deref().unwrap_or("-"))
                    .or_default() += 1;
            }
        }
        Ok(RestartReport {
            agents: n,
            down,
            last_list,
            last_watch,
            resumed_without_list: r
                .values()
                .filter(|v| v.listed.is_none() && v.resumed.is_some())
                .count(),
            list_after_up,
            by_kind,
            agent_traffic: traffic_delta(&t1, &t0, is_agent),
            lists_per_agent_max: lists.values().max().copied().unwrap_or(0),
            agent_writes: entries
                .iter()
                .filter(by_agent)
                .filter(|e| e.verb.is_mutating())
                .map(|e| {
                    format!(
                        "{} {} {}/{} {}",
                        e.identity.as_deref().unwrap_or("-"),
                        e.verb.as_str(),
                        e.resource.as_deref().unwrap_or("-"),
                        e.name.as_deref().unwrap_or("-"),
                        e.status
                    )
                })
                .collect(),
            peak_lists_per_s: per_sec.values().map(|v| v.0).max().unwrap_or(0),
            peak_agent_rps: per_sec.values().map(|v| v.1).max().unwrap_or(0),
            agent_429: entries
                .iter()
                .filter(by_agent)
                .filter(|e| e.status == 429)
                .count() as u64,
            status_429: entries.iter().filter(|e| e.status == 429).count() as u64,
            apf_queued: apf1.queued_total.saturating_sub(apf0.queued_total),
            cpu,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(seq: u64, id: &str, verb: Verb, kind: &str, status: u16) -> JournalEntry {
        JournalEntry {
            seq,
            identity: Some(id.into()),
            verb,
            method: String::new(),
            path: String::new(),
            query: String::new(),
            status,
            resource: Some(kind.into()),
            namespace: None,
            name: None,
            subresource: None,
            at: SystemTime::UNIX_EPOCH + Duration::from_secs(seq),
            response: None,
            request: None,
        }
    }

    fn w(seq: u64, id: &str, kind: &str, rv: u64, status: u16) -> JournalEntry {
        JournalEntry {
            query: format!("fieldSelector=x&resourceVersion={rv}&watch=true"),
            ..e(seq, id, Verb::Watch, kind, status)
        }
    }

    #[test]
    fn a_watch_counts_as_resumed_only_from_the_restarts_resource_version_or_later() {
        let at = |s| Some(SystemTime::UNIX_EPOCH + Duration::from_secs(s));
        let j = vec![
            // Refused while down, then accepted from before the restart (ends with 410).
            w(1, "agent-n1", "pods", 40, 503),
            w(2, "agent-n1", "pods", 40, 200),
            e(3, "agent-n1", Verb::List, "pods", 429),
            e(4, "agent-n1", Verb::List, "nodes", 200),
            e(5, "agent-n1", Verb::List, "pods", 200),
            w(6, "agent-n1", "pods", 120, 200),
            w(7, "agent-n1", "pods", 130, 200),
            // Resumed from exactly the restart's resourceVersion: no list needed.
            w(8, "agent-n2", "nodes", 100, 200),
            e(9, "kubelet", Verb::List, "gameservers", 200),
            w(10, "agent-n1", "events", 120, 200),
        ];
        let r = relists(&j, 100);
        assert_eq!(r.len(), 3, "{r:?}");
        let get = |id: &str, k: &str| r[&(id.to_string(), k.to_string())];
        assert_eq!(
            get("agent-n1", "pods"),
            Back {
                listed: at(5),
                resumed: at(6)
            }
        );
        assert_eq!(
            get("agent-n1", "nodes"),
            Back {
                listed: at(4),
                resumed: None
            },
            "listed, not yet watching"
        );
        assert_eq!(
            get("agent-n2", "nodes"),
            Back {
                listed: None,
                resumed: at(8)
            }
        );
    }

    #[test]
    fn the_resource_version_is_read_from_the_query() {
        assert_eq!(resource_version("watch=true&resourceVersion=42"), Some(42));
        assert_eq!(resource_version("resourceVersion=&watch=true"), None);
        assert_eq!(resource_version("watch=true"), None);
    }
}
