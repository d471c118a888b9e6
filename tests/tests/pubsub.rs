//! lastcall-pubsub end to end: the real SDK client against the GameLift emulator, a real
//! `redis-server`, and the real binary for start-up, `/metrics` and signals.
//!
//! In-process scenarios drive one cycle at a time through `Pubsub::run_cycle`, so nothing
//! here waits for a period to pass.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Parser;
use futures::StreamExt;
use lastcall_agent::fleetiq::gamelift::GameLift;
use lastcall_agent::fleetiq::source::{RedisSource, run_fallback};
use lastcall_agent::fleetiq::view::FleetIqView;
use lastcall_common::fleetiq::polled_at_key;
use lastcall_common::fleetiq::{InstanceStatus, StatusMessage, cache_key};
use lastcall_common::redis_conn::CaFile;
use lastcall_common::redis_url::RedisTarget;
use lastcall_pubsub::{Config, CycleReport, Pubsub, gamelift_client};
use lastcall_testkit::bins::workspace_binary;
use lastcall_testkit::eventually::{eventually, wait_for};
use lastcall_testkit::gamelift::{self as emu, GameLiftEmulator, Malformed};
use lastcall_testkit::net::free_port;
use lastcall_testkit::process::{exited_within, signal};
use lastcall_testkit::redis::{RedisServer, TcpProxy};
use redis::AsyncCommands;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const DESCRIBE: &str = "DescribeGameServerInstances";

// ---------------------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------------------

fn ids(prefix: &str, n: usize) -> Vec<String> {
    // Realistic EC2 ids (`i-` and 17 alphanumerics), readable by their group.
    let p: String = prefix.chars().filter(char::is_ascii_alphanumeric).collect();
    (0..n).map(|i| format!("i-{p:0>13}{i:04}")).collect()
}

fn write_groups(path: &Path, groups: &[&str]) {
    let body = serde_json::json!({ "GameServerGroups": groups }).to_string();
    // Write-then-rename, like the kubelet's symlink swap: the reader never sees half a file.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, body).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Emulator + Redis + groups file + an in-process `Pubsub` built by the production builders.
struct Harness {
    emulator: GameLiftEmulator,
    redis: RedisServer,
    _dir: tempfile::TempDir,
    groups_file: PathBuf,
    pubsub: Pubsub,
}

impl Harness {
    async fn start(groups: &[&str], extra_args: &[&str]) -> Harness {
        let emulator = GameLiftEmulator::start().await.unwrap();
        let redis = RedisServer::start().await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let groups_file = dir.path().join("fleetiq.conf");
        write_groups(&groups_file, groups);
        let pubsub = build_pubsub(&emulator, &redis.host_port(), &groups_file, extra_args).await;
        Harness {
            emulator,
            redis,
            _dir: dir,
            groups_file,
            pubsub,
        }
    }

    async fn cycle(&self) -> CycleReport {
        self.pubsub.run_cycle().await
    }

    fn metrics(&self) -> Metrics {
        Metrics::parse(&self.pubsub.metrics_text())
    }

    async fn redis(&self) -> redis::aio::MultiplexedConnection {
        self.redis.client().await.unwrap()
    }
}

fn config(
    emulator: &GameLiftEmulator,
    redis_url: &str,
    groups_file: &Path,
    extra: &[&str],
) -> Config {
    let mut argv: Vec<String> = [
        "lastcall-pubsub",
        "--redis-url",
        redis_url,
        "--config-file",
        groups_file.to_str().unwrap(),
        "--aws-region",
        "us-west-2",
        "--gamelift-endpoint",
        &emulator.url(),
        "--cycle-jitter",
        "0s",
        "--listen",
        "127.0.0.1:0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    argv.extend(extra.iter().map(|s| s.to_string()));
    Config::try_parse_from(argv).unwrap()
}

async fn build_pubsub(
    emulator: &GameLiftEmulator,
    redis_url: &str,
    groups_file: &Path,
    extra: &[&str],
) -> Pubsub {
    let config = config(emulator, redis_url, groups_file, extra);
    let credentials = aws_sdk_gamelift::config::Credentials::new(
        "AKIDPUBSUBTEST",
        "pubsub-test-secret",
        None,
        None,
        "pubsub-tests",
    );
    let client = gamelift_client(&config, Some(credentials)).await;
    Pubsub::new(&config, client).unwrap()
}

/// Messages received, as (channel, payload).
type Received = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

/// A real SUBSCRIBE client, as an agent would use, recording everything it receives.
struct Subscriber {
    got: Received,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Subscriber {
    async fn start(url: &str, channels: &[String]) -> Subscriber {
        let client = redis::Client::open(url).unwrap();
        let mut pubsub = client.get_async_pubsub().await.unwrap();
        pubsub.subscribe(channels).await.unwrap();
        let got: Received = Arc::default();
        let sink = got.clone();
        let task = tokio::spawn(async move {
            let mut stream = pubsub.into_on_message();
            while let Some(msg) = stream.next().await {
                let entry = (
                    msg.get_channel_name().to_string(),
                    msg.get_payload_bytes().to_vec(),
                );
                sink.lock().unwrap().push(entry);
            }
        });
        Subscriber { got, task }
    }

    fn received(&self) -> Vec<(String, Vec<u8>)> {
        self.got.lock().unwrap().clone()
    }

    /// Waits until at least `n` messages arrived and returns them all.
    async fn wait_for_count(&self, n: usize) -> Vec<(String, Vec<u8>)> {
        wait_for(&format!("{n} messages on the subscriber"), || async {
            let got = self.received();
            (got.len() >= n).then_some(got)
        })
        .await
    }
}

fn per_channel(messages: &[(String, Vec<u8>)]) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for (channel, _) in messages {
        *counts.entry(channel.clone()).or_insert(0) += 1;
    }
    counts
}

/// Samples from a Prometheus text exposition, parsed strictly: every line that is not a
/// comment must be `name{labels} value` or `name value`.
struct Metrics {
    samples: Vec<(String, HashMap<String, String>, f64)>,
}

impl Metrics {
    fn parse(text: &str) -> Metrics {
        let mut samples = Vec::new();
        for line in text.lines() {
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (series, value) = line
                .rsplit_once(' ')
                .unwrap_or_else(|| panic!("no value: {line}"));
            let value: f64 = value
                .parse()
                .unwrap_or_else(|_| panic!("bad value: {line}"));
            let (name, labels) = match series.split_once('{') {
                None => (series.to_string(), HashMap::new()),
                Some((name, rest)) => {
                    let body = rest
                        .strip_suffix('}')
                        .unwrap_or_else(|| panic!("bad labels: {line}"));
                    (name.to_string(), parse_labels(body, line))
                }
            };
            assert!(
                !name.is_empty()
                    && name
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
                "bad metric name: {line}"
            );
            samples.push((name, labels, value));
        }
        Metrics { samples }
    }

    /// Sum of the samples of `name` whose labels include `labels`.
    fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.samples
            .iter()
            .filter(|(n, l, _)| {
                n == name
                    && labels
                        .iter()
                        .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|(_, _, v)| v)
            .sum()
    }

    fn has_series(&self, name: &str, labels: &[(&str, &str)]) -> bool {
        self.samples.iter().any(|(n, l, _)| {
            n == name
                && labels
                    .iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
    }
}

fn parse_labels(body: &str, line: &str) -> HashMap<String, String> {
    let mut labels = HashMap::new();
    let mut rest = body;
    while !rest.is_empty() {
        let (key, after) = rest
            .split_once("=\"")
            .unwrap_or_else(|| panic!("bad label: {line}"));
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = None;
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, e)) = chars.next() {
                        value.push(e);
                    }
                }
                '"' => {
                    end = Some(i);
                    break;
                }
                c => value.push(c),
            }
        }
        let end = end.unwrap_or_else(|| panic!("unterminated label: {line}"));
        labels.insert(key.to_string(), value);
        rest = after[end + 1..]
            .strip_prefix(',')
            .unwrap_or(&after[end + 1..]);
    }
    labels
}

fn counter(m: &Metrics, name: &str, labels: &[(&str, &str)]) -> f64 {
    m.value(&format!("lastcall_pubsub_{name}_total"), labels)
}

// ---------------------------------------------------------------------------------------
// Scenarios
// ---------------------------------------------------------------------------------------

/// A page that still fails after its retries costs only itself and the pages after it:
/// the pages read before it are published at once, a SPOT_TERMINATING among them. Before,
/// a group's statuses were published only once all its pages were in, so one failing page
/// threw away the whole group (and its Spot notice) for a period.
#[tokio::test]
async fn a_page_that_fails_costs_only_itself_and_the_pages_already_read_are_published() {
    let h = Harness::start(
        &["paged"],
        &[
            "--retry-base",
            "2ms",
            "--retry-max",
            "10ms",
            "--api-max-attempts",
            "3",
        ],
    )
    .await;
    h.emulator.set_default_page_size(20);
    let instances = ids("paged", 60);
    h.emulator
        .add_instances("paged", &instances, emu::InstanceStatus::Active);
    h.emulator
        .set_instance_status(&instances[3], emu::InstanceStatus::SpotTerminating);
    // The third page fails every attempt (503, retried, then given up).
    h.emulator.fail_page("paged", 2, 3, 503);
    let sub = Subscriber::start(&h.redis.url(), &instances).await;

    let report = h.cycle().await;
    assert_eq!(report.groups_failed, 1, "{report:?}");
    assert_eq!(report.pages, 2, "{report:?}");
    assert_eq!(report.published, 40, "the two pages read: {report:?}");
    let failed: Vec<_> = h
        .emulator
        .calls()
        .iter()
        .filter(|c| c.outcome != "ok")
        .map(|c| c.input["NextToken"].clone())
        .collect();
    assert_eq!(failed.len(), 3, "three attempts at the third page");
    assert!(failed.iter().all(|t| t == "dgsi-40"), "{failed:?}");
    let mut conn = h.redis().await;
    assert_eq!(
        cached_status(&mut conn, &instances[3]).await,
        Some(InstanceStatus::SpotTerminating),
        "the Spot notice on the first page is cached"
    );
    assert_eq!(cached_status(&mut conn, &instances[45]).await, None);
    let got = sub.wait_for_count(40).await;
    assert!(
        got.iter()
            .any(|(ch, body)| ch == &instances[3]
                && status_of(body) == InstanceStatus::SpotTerminating),
        "the Spot notice is published"
    );
    let m = h.metrics();
    assert_eq!(
        counter(
            &m,
            "group_errors",
            &[("group", "paged"), ("reason", "server_error")]
        ),
        1.0
    );

    // The next cycle reads every page.
    let report = h.cycle().await;
    assert_eq!((report.groups_failed, report.published), (0, 60));
}

#[tokio::test]
async fn groups_are_paged_and_every_instance_is_published_once_per_cycle() {
    let groups = ["g1", "g2", "g3"];
    let h = Harness::start(&groups, &[]).await;
    h.emulator.set_default_page_size(20);
    let mut all = Vec::new();
    for g in groups {
        let instances = ids(g, 45);
        h.emulator
            .add_instances(g, &instances, emu::InstanceStatus::Active);
        all.extend(instances);
    }
    h.emulator
        .set_instance_status("i-00000000000g20007", emu::InstanceStatus::Draining);
    let sub = Subscriber::start(&h.redis.url(), &all).await;
    assert!(
        !h.pubsub.health().is_ready(),
        "not ready before the first cycle"
    );

    let report = h.cycle().await;
    assert_eq!(report.groups, 3);
    assert_eq!(report.groups_failed, 0);
    assert_eq!(report.api_calls, 9, "3 groups x 3 pages of 20: {report:?}");
    assert_eq!(report.pages, 9);
    assert_eq!(h.emulator.count(DESCRIBE), 9);
    assert_eq!(report.instances, 135);
    assert_eq!(report.published, 135);
    assert_eq!(report.cached, 135);
    assert_eq!(
        report.redis_round_trips, 9,
        "one round trip per page, published as soon as it is read"
    );
    assert_eq!(report.errors, 0);
    assert!(h.pubsub.health().is_ready());

    // Paging followed NextToken: each group's second and third calls carry the token.
    let tokens: Vec<_> = h
        .emulator
        .calls()
        .iter()
        .filter(|c| c.input["GameServerGroupName"] == "g1")
        .map(|c| c.input["NextToken"].clone())
        .collect();
    assert_eq!(tokens.len(), 3);
    assert!(
        tokens[0].is_null() && tokens[1].is_string() && tokens[2].is_string(),
        "{tokens:?}"
    );

    let got = sub.wait_for_count(135).await;
    let counts = per_channel(&got);
    assert_eq!(counts.len(), 135, "every instance published");
    assert!(
        counts.values().all(|&n| n == 1),
        "exactly once each: {counts:?}"
    );
    for (channel, body) in &got {
        let msg = StatusMessage::parse(body).unwrap();
        assert_eq!(&msg.instance_id, channel);
        let expected = if channel == "i-00000000000g20007" {
            InstanceStatus::Draining
        } else {
            InstanceStatus::Active
        };
        assert_eq!(msg.status, expected, "{channel}");
    }

    // The last value is cached with a TTL of cache-ttl-periods x period (3 x 60 s).
    let mut conn = h.redis().await;
    let cached: Option<String> = conn.get(cache_key("i-00000000000g20007")).await.unwrap();
    let cached = cached.expect("cache key written");
    assert_eq!(
        StatusMessage::parse(cached.as_bytes()).unwrap().status,
        InstanceStatus::Draining
    );
    let ttl: i64 = conn.ttl(cache_key("i-00000000000g20007")).await.unwrap();
    assert!(ttl > 0 && ttl <= 180, "ttl {ttl}");

    let m = h.metrics();
    assert_eq!(
        m.value(
            "lastcall_pubsub_instances",
            &[("group", "g2"), ("status", "DRAINING")]
        ),
        1.0
    );
    assert_eq!(
        m.value(
            "lastcall_pubsub_instances",
            &[("group", "g2"), ("status", "ACTIVE")]
        ),
        44.0
    );
    assert_eq!(
        counter(
            &m,
            "api_calls",
            &[("operation", DESCRIBE), ("result", "ok")]
        ),
        9.0
    );
    assert_eq!(counter(&m, "messages_published", &[]), 135.0);
    assert_eq!(counter(&m, "redis_round_trips", &[("result", "ok")]), 9.0);
    assert_eq!(counter(&m, "cycles", &[("result", "ok")]), 1.0);
    assert!(
        m.value(
            "lastcall_pubsub_last_successful_cycle_timestamp_seconds",
            &[]
        ) > 1.0e9
    );
    assert_eq!(
        m.value("lastcall_pubsub_cycle_duration_seconds_count", &[]),
        1.0
    );
    assert_eq!(m.value("lastcall_pubsub_groups", &[]), 3.0);

    // The next cycle publishes everything once more (the original's behaviour).
    let report = h.cycle().await;
    assert_eq!(report.published, 135);
    let got = sub.wait_for_count(270).await;
    assert!(per_channel(&got).values().all(|&n| n == 2));
}

#[tokio::test]
async fn throttling_is_retried_with_backoff_and_every_cycle_completes() {
    let groups = ["t1", "t2", "t3"];
    let h = Harness::start(
        &groups,
        &[
            "--retry-base",
            "2ms",
            "--retry-max",
            "10ms",
            "--api-max-attempts",
            "12",
        ],
    )
    .await;
    h.emulator.set_default_page_size(20);
    for g in groups {
        h.emulator
            .add_instances(g, &ids(g, 45), emu::InstanceStatus::Active);
    }
    h.emulator.set_seed(42);
    h.emulator.set_throttle_ratio(0.3);

    let mut calls = 0;
    let mut retries = 0;
    for cycle in 0..5 {
        let report = h.cycle().await;
        assert_eq!(report.groups_failed, 0, "cycle {cycle}: {report:?}");
        assert_eq!(report.pages, 9, "cycle {cycle}");
        assert_eq!(report.published, 135, "cycle {cycle}");
        assert_eq!(report.api_calls, report.pages + report.api_retries);
        calls += report.api_calls;
        retries += report.api_retries;
    }
    assert!(retries > 0, "30% throttling must cause retries");
    assert_eq!(
        h.emulator.count(DESCRIBE) as u64,
        calls,
        "every attempt reached the emulator"
    );
    let throttled = h
        .emulator
        .calls()
        .iter()
        .filter(|c| c.outcome == "ThrottlingException")
        .count() as f64;

    let m = h.metrics();
    assert_eq!(
        counter(&m, "api_retries", &[("reason", "throttled")]),
        retries as f64
    );
    assert_eq!(
        counter(
            &m,
            "api_calls",
            &[("operation", DESCRIBE), ("result", "throttled")]
        ),
        throttled
    );
    assert!(counter(&m, "api_backoff_seconds", &[("reason", "throttled")]) > 0.0);
    assert_eq!(counter(&m, "cycles", &[("result", "ok")]), 5.0);
}

#[tokio::test]
async fn config_edits_are_picked_up_and_broken_json_keeps_the_last_groups() {
    let h = Harness::start(&["c1"], &[]).await;
    h.emulator
        .add_instances("c1", &ids("c1", 4), emu::InstanceStatus::Active);
    h.emulator
        .add_instances("c2", &ids("c2", 6), emu::InstanceStatus::Active);

    // An unreadable file at start: no groups yet, counted, not ready, and no exit.
    std::fs::remove_file(&h.groups_file).unwrap();
    let report = h.cycle().await;
    assert!(report.config_error);
    assert_eq!(report.groups, 0);
    assert_eq!(h.emulator.count(DESCRIBE), 0);
    assert!(!h.pubsub.health().is_ready());
    assert_eq!(
        counter(&h.metrics(), "config_reloads", &[("result", "error")]),
        1.0
    );

    write_groups(&h.groups_file, &["c1"]);
    let report = h.cycle().await;
    assert!(!report.config_error);
    assert_eq!((report.groups, report.published), (1, 4));
    assert!(h.pubsub.health().is_ready());

    // A group added to the file is polled in the next cycle.
    write_groups(&h.groups_file, &["c1", "c2"]);
    h.emulator.clear_calls();
    let report = h.cycle().await;
    assert_eq!((report.groups, report.published), (2, 10));
    let polled: Vec<_> = h
        .emulator
        .calls()
        .iter()
        .map(|c| c.input["GameServerGroupName"].clone())
        .collect();
    assert!(polled.contains(&serde_json::json!("c2")), "{polled:?}");

    // Broken JSON keeps the old groups and moves the error metric.
    std::fs::write(&h.groups_file, r#"{"GameServerGroups": ["c1", "c2""#).unwrap();
    let report = h.cycle().await;
    assert!(report.config_error);
    assert_eq!((report.groups, report.published), (2, 10), "{report:?}");
    let m = h.metrics();
    assert_eq!(counter(&m, "config_reloads", &[("result", "error")]), 2.0);
    assert_eq!(counter(&m, "cycles", &[("result", "error")]), 2.0);

    // Removing a group drops it and its per-group series.
    write_groups(&h.groups_file, &["c1"]);
    let report = h.cycle().await;
    assert_eq!((report.groups, report.published, report.errors), (1, 4, 0));
    let m = h.metrics();
    assert!(!m.has_series("lastcall_pubsub_instances", &[("group", "c2")]));
    assert!(m.has_series("lastcall_pubsub_instances", &[("group", "c1")]));
    assert_eq!(counter(&m, "config_reloads", &[("result", "ok")]), 3.0);
}

#[tokio::test]
async fn redis_outage_keeps_polling_and_publishing_resumes() {
    let mut h = Harness::start(
        &["r1"],
        &[
            "--redis-retry-base",
            "5ms",
            "--redis-retry-max",
            "20ms",
            "--redis-timeout",
            "2s",
        ],
    )
    .await;
    let instances = ids("r1", 10);
    h.emulator
        .add_instances("r1", &instances, emu::InstanceStatus::Active);
    let report = h.cycle().await;
    assert_eq!((report.published, report.errors), (10, 0));
    assert!(h.pubsub.health().is_ready());

    h.redis.kill().await;
    for cycle in 0..3 {
        let before = h.emulator.count(DESCRIBE);
        let report = h.cycle().await;
        assert_eq!(
            h.emulator.count(DESCRIBE),
            before + 1,
            "cycle {cycle} still polls"
        );
        assert_eq!(report.instances, 10);
        assert_eq!(report.published, 0);
        assert_eq!(report.publish_errors, 1, "cycle {cycle}: {report:?}");
        assert!(report.errors > 0);
    }
    assert!(!h.pubsub.health().is_ready(), "Redis down means not ready");
    let m = h.metrics();
    assert_eq!(counter(&m, "publish_errors", &[]), 3.0);
    assert!(counter(&m, "redis_round_trips", &[("result", "error")]) >= 1.0);
    assert_eq!(m.value("lastcall_pubsub_redis_up", &[]), 0.0);

    h.redis.restart().await.unwrap();
    let sub = Subscriber::start(&h.redis.url(), &instances).await;
    let report = wait_for("publishing resumes after Redis is back", || async {
        let r = h.cycle().await;
        (r.published == 10 && r.publish_errors == 0).then_some(r)
    })
    .await;
    assert_eq!(report.cached, 10);
    let got = sub.wait_for_count(10).await;
    assert_eq!(per_channel(&got).len(), 10);
    let mut conn = h.redis().await;
    let cached: Option<String> = conn.get(cache_key(&instances[3])).await.unwrap();
    assert!(cached.is_some(), "cache rebuilt after the restart");
    assert!(h.pubsub.health().is_ready());
    assert_eq!(h.metrics().value("lastcall_pubsub_redis_up", &[]), 1.0);
}

#[tokio::test]
async fn malformed_answers_and_unknown_groups_are_counted_and_skipped() {
    let groups = ["good", "bad-status", "no-id", "no-status", "missing"];
    let h = Harness::start(&groups, &[]).await;
    h.emulator.set_default_page_size(20);
    for g in &groups[..4] {
        h.emulator
            .add_instances(g, &ids(g, 45), emu::InstanceStatus::Active);
    }
    h.emulator
        .set_malformed("bad-status", Some(Malformed::UnknownStatus));
    h.emulator
        .set_malformed("no-id", Some(Malformed::MissingInstanceId));
    h.emulator
        .set_malformed("no-status", Some(Malformed::MissingStatus));
    let good = ids("good", 45);
    let sub = Subscriber::start(&h.redis.url(), &good).await;

    let bad = ids("bad-status", 45);
    let sub_bad = Subscriber::start(&h.redis.url(), &bad[..1]).await;

    let report = h.cycle().await;
    assert_eq!(
        report.groups_failed, 1,
        "only the unknown group fails: {report:?}"
    );
    assert_eq!(
        report.invalid_instances, 6,
        "first entry of each of 3 pages in 2 groups"
    );
    // Unknown statuses are published as-is, as the original did.
    assert_eq!(report.instances, 2 * 45 + 2 * 42);
    assert_eq!(report.published, 2 * 45 + 2 * 42);

    let got = sub.wait_for_count(45).await;
    assert_eq!(
        per_channel(&got).len(),
        45,
        "the good group is fully published"
    );
    let got = sub_bad.wait_for_count(1).await;
    assert!(
        String::from_utf8_lossy(&got[0].1).ends_with(r#""InstanceStatus": "EXPLODING"}"#),
        "{got:?}"
    );

    let mut conn = h.redis().await;
    for (i, iid) in bad.iter().enumerate() {
        let cached: Option<String> = conn.get(cache_key(iid)).await.unwrap();
        assert!(cached.is_some(), "{iid}: {i}");
    }
    for (i, iid) in ids("no-status", 45).iter().enumerate() {
        let cached: Option<String> = conn.get(cache_key(iid)).await.unwrap();
        assert_eq!(cached.is_none(), i % 20 == 0, "{iid}");
    }
    let m = h.metrics();
    assert_eq!(counter(&m, "unknown_statuses", &[]), 3.0);
    assert_eq!(
        m.value(
            "lastcall_pubsub_instances",
            &[("group", "bad-status"), ("status", "UNKNOWN")]
        ),
        3.0
    );
    for reason in ["missing_instance_id", "missing_status"] {
        assert_eq!(
            counter(&m, "invalid_instances", &[("reason", reason)]),
            3.0,
            "{reason}"
        );
    }
    assert_eq!(
        counter(
            &m,
            "group_errors",
            &[("group", "missing"), ("reason", "not_found")]
        ),
        1.0
    );
    assert_eq!(
        counter(
            &m,
            "api_calls",
            &[("operation", DESCRIBE), ("result", "not_found")]
        ),
        1.0,
        "not_found is not retried"
    );
    assert!(
        h.pubsub.health().is_ready(),
        "a failing group does not make the service unready"
    );
}

#[tokio::test]
async fn publish_unchanged_false_publishes_changes_only_and_refreshes_the_cache() {
    let h = Harness::start(
        &["u1"],
        &[
            "--publish-unchanged=false",
            "--period",
            "10s",
            "--cache-ttl-periods",
            "3",
        ],
    )
    .await;
    let instances = ids("u1", 5);
    h.emulator
        .add_instances("u1", &instances, emu::InstanceStatus::Active);
    let sub = Subscriber::start(&h.redis.url(), &instances).await;

    let report = h.cycle().await;
    assert_eq!(
        (report.published, report.unchanged, report.cached),
        (5, 0, 5)
    );
    sub.wait_for_count(5).await;

    // Shorten the TTLs so the refresh is visible.
    let mut conn = h.redis().await;
    for iid in &instances {
        let _: bool = conn.expire(cache_key(iid), 2).await.unwrap();
    }
    let report = h.cycle().await;
    assert_eq!(
        (report.published, report.unchanged, report.cached),
        (0, 5, 5),
        "{report:?}"
    );
    for iid in &instances {
        let ttl: i64 = conn.ttl(cache_key(iid)).await.unwrap();
        assert!(
            ttl > 2 && ttl <= 30,
            "{iid}: ttl {ttl} not refreshed to 3 x 10 s"
        );
    }

    h.emulator
        .set_instance_status(&instances[3], emu::InstanceStatus::Draining);
    let report = h.cycle().await;
    assert_eq!((report.published, report.unchanged), (1, 4));
    // Messages on one connection arrive in order: had the quiet cycle published anything,
    // it would sit between the first five and the change.
    let got = sub.wait_for_count(6).await;
    assert_eq!(got.len(), 6);
    assert_eq!(got[5].0, instances[3]);
    assert_eq!(
        StatusMessage::parse(&got[5].1).unwrap().status,
        InstanceStatus::Draining
    );
    assert_eq!(counter(&h.metrics(), "messages_unchanged", &[]), 9.0);
}

#[tokio::test]
async fn contract_published_bytes_equal_the_python_form_and_parse_in_the_agent() {
    let h = Harness::start(&["agones-game-server-group-01"], &[]).await;
    let group = "agones-game-server-group-01";
    let cases = [
        (
            "i-0123456789abcdef0",
            emu::InstanceStatus::Active,
            InstanceStatus::Active,
            "ACTIVE",
        ),
        (
            "i-0123456789abcdef1",
            emu::InstanceStatus::Draining,
            InstanceStatus::Draining,
            "DRAINING",
        ),
        (
            "i-0123456789abcdef2",
            emu::InstanceStatus::SpotTerminating,
            InstanceStatus::SpotTerminating,
            "SPOT_TERMINATING",
        ),
    ];
    for (iid, status, _, _) in &cases {
        h.emulator.add_instances(group, &[iid.to_string()], *status);
    }
    let channels: Vec<String> = cases.iter().map(|c| c.0.to_string()).collect();
    let sub = Subscriber::start(&h.redis.url(), &channels).await;
    h.cycle().await;
    let got = sub.wait_for_count(3).await;
    let mut conn = h.redis().await;
    for (iid, _, status, wire) in cases {
        // What the original Python pubsub sends for this GameLift answer: json.dumps of the
        // botocore dict, model key order, ", " and ": " separators.
        let golden = format!(
            "{{\"GameServerGroupName\": \"agones-game-server-group-01\", \"GameServerGroupArn\": \"arn:aws:gamelift:us-west-2:123456789012:gameservergroup/agones-game-server-group-01\", \"InstanceId\": \"{iid}\", \"InstanceStatus\": \"{wire}\"}}"
        );
        let (_, body) = got.iter().find(|(c, _)| c == iid).expect("published");
        assert_eq!(
            String::from_utf8_lossy(body),
            golden,
            "published bytes for {wire}"
        );
        let parsed = StatusMessage::parse(body).expect("the agent's parser accepts it");
        assert_eq!((parsed.instance_id.as_str(), parsed.status), (iid, status));
        assert_eq!(parsed.group_name.as_deref(), Some(group));
        let cached: String = conn.get(cache_key(iid)).await.unwrap();
        assert_eq!(cached, golden, "cached bytes for {wire}");
    }
}

// ---------------------------------------------------------------------------------------
// Faults: Redis recovery, ordering, uncertain writes, rate control, health
// ---------------------------------------------------------------------------------------

/// Log lines written while it is the thread's default subscriber (tests run on one thread,
/// so the tasks they spawn log here too).
#[derive(Clone, Default)]
struct LogCapture(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogCapture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogCapture {
    type Writer = LogCapture;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

impl LogCapture {
    fn install(&self) -> tracing::subscriber::DefaultGuard {
        tracing::subscriber::set_default(
            tracing_subscriber::fmt()
                .with_writer(self.clone())
                .with_ansi(false)
                .with_max_level(tracing::Level::DEBUG)
                .finish(),
        )
    }

    /// WARN lines containing every one of `parts`.
    fn warnings(&self, parts: &[&str]) -> Vec<String> {
        String::from_utf8_lossy(&self.0.lock().unwrap())
            .lines()
            .filter(|l| l.contains(" WARN ") && parts.iter().all(|p| l.contains(p)))
            .map(str::to_string)
            .collect()
    }
}

fn status_of(body: &[u8]) -> InstanceStatus {
    StatusMessage::parse(body).unwrap().status
}

async fn cached_status(
    conn: &mut redis::aio::MultiplexedConnection,
    iid: &str,
) -> Option<InstanceStatus> {
    let body: Option<Vec<u8>> = conn.get(cache_key(iid)).await.unwrap();
    body.map(|b| status_of(&b))
}

/// A half-open Redis (blackholed by a proxy) times out, the connection is rebuilt,
/// readiness fails while it lasts (liveness does not: the loop still turns, and the
/// webhook must keep answering), and publishing resumes within two cycles after it heals.
/// Before, the manager kept the dead connection and readiness stayed green.
#[tokio::test]
async fn blackholed_redis_fails_readiness_and_publishing_resumes_within_two_cycles() {
    let emulator = GameLiftEmulator::start().await.unwrap();
    let redis = RedisServer::start().await.unwrap();
    let proxy = TcpProxy::start(redis.port()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let groups_file = dir.path().join("fleetiq.conf");
    write_groups(&groups_file, &["b1"]);
    let instances = ids("b1", 5);
    emulator.add_instances("b1", &instances, emu::InstanceStatus::Active);
    let pubsub = build_pubsub(
        &emulator,
        &format!("127.0.0.1:{}", proxy.port()),
        &groups_file,
        &[
            "--redis-timeout",
            "300ms",
            "--redis-retry-base",
            "5ms",
            "--redis-retry-max",
            "20ms",
            "--liveness-timeout",
            "1s",
        ],
    )
    .await;
    let r = pubsub.run_cycle().await;
    assert_eq!((r.published, r.errors), (5, 0));
    assert!(pubsub.is_live());

    proxy.set_blackhole(true);
    let blackholed = tokio::time::Instant::now();
    eventually(
        "readiness fails while Redis is blackholed, past the liveness timeout",
        Duration::from_secs(20),
        Duration::from_millis(10),
        || async {
            let r = pubsub.run_cycle().await;
            assert_eq!(r.published, 0, "nothing can be published: {r:?}");
            assert!(pubsub.is_live(), "the loop turns: liveness holds");
            (!pubsub.health().is_ready() && blackholed.elapsed() > Duration::from_millis(1500))
                .then_some(())
        },
    )
    .await;
    let m = Metrics::parse(&pubsub.metrics_text());
    assert!(counter(&m, "publish_errors", &[("reason", "timeout")]) >= 1.0);

    proxy.set_blackhole(false);
    let sub = Subscriber::start(&redis.url(), &instances).await;
    // A period passes between cycles (longer than the connect backoff, which is capped
    // below half a period).
    tokio::time::sleep(Duration::from_millis(30)).await;
    let first = pubsub.run_cycle().await;
    let second = if first.published == 5 {
        first.clone()
    } else {
        tokio::time::sleep(Duration::from_millis(30)).await;
        pubsub.run_cycle().await
    };
    assert_eq!(
        second.published, 5,
        "within two cycles of the heal: {first:?} then {second:?}"
    );
    sub.wait_for_count(5).await;
    assert!(pubsub.is_live());
    let m = Metrics::parse(&pubsub.metrics_text());
    assert!(
        counter(&m, "redis_connects", &[]) >= 2.0,
        "the connection was rebuilt"
    );
}

/// A failover: the server pubsub is connected to becomes a replica (SET answers READONLY)
/// and the name now points at the new primary. pubsub notices, reconnects, and publishes
/// on the new primary. Before, the manager kept writing to the replica forever.
#[tokio::test]
async fn replicaof_failover_is_noticed_and_publishing_moves_to_the_new_primary() {
    let emulator = GameLiftEmulator::start().await.unwrap();
    let old = RedisServer::start().await.unwrap();
    let new = RedisServer::start().await.unwrap();
    let proxy = TcpProxy::start(old.port()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let groups_file = dir.path().join("fleetiq.conf");
    write_groups(&groups_file, &["f1"]);
    let instances = ids("f1", 4);
    emulator.add_instances("f1", &instances, emu::InstanceStatus::Active);
    let pubsub = build_pubsub(
        &emulator,
        &format!("127.0.0.1:{}", proxy.port()),
        &groups_file,
        &["--redis-retry-base", "5ms", "--redis-retry-max", "20ms"],
    )
    .await;
    assert_eq!(pubsub.run_cycle().await.published, 4);

    // The old primary follows the new one; the stable name now leads to the new primary.
    old.replica_of(Some(new.port())).await.unwrap();
    proxy.set_upstream(new.port());
    emulator.set_instance_status(&instances[0], emu::InstanceStatus::Draining);
    let sub = Subscriber::start(&new.url(), &instances).await;
    let r = pubsub.run_cycle().await;
    assert_eq!(r.published, 0, "the replica refuses the write: {r:?}");
    let m = Metrics::parse(&pubsub.metrics_text());
    assert_eq!(
        counter(&m, "publish_errors", &[("reason", "readonly")]),
        1.0
    );

    let r = pubsub.run_cycle().await;
    assert_eq!((r.published, r.errors), (4, 0), "{r:?}");
    let got = sub.wait_for_count(4).await;
    assert_eq!(per_channel(&got).len(), 4);
    let mut conn = new.client().await.unwrap();
    assert_eq!(
        cached_status(&mut conn, &instances[0]).await,
        Some(InstanceStatus::Draining)
    );
}

/// Two publishers (a rolling update), one whose path to Redis is slow: its older ACTIVE
/// arrives after the other's newer DRAINING and is dropped, atomically, so no subscriber
/// sees ACTIVE after DRAINING and the cache keeps DRAINING. Before, the last writer won.
#[tokio::test]
async fn a_delayed_replica_never_publishes_an_older_status_over_a_newer_one() {
    let emulator = GameLiftEmulator::start().await.unwrap();
    let redis = RedisServer::start().await.unwrap();
    let slow_path = TcpProxy::start(redis.port()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let groups_file = dir.path().join("fleetiq.conf");
    write_groups(&groups_file, &["o1"]);
    let instances = ids("o1", 3);
    emulator.add_instances("o1", &instances, emu::InstanceStatus::Active);
    let slow = build_pubsub(
        &emulator,
        &format!("127.0.0.1:{}", slow_path.port()),
        &groups_file,
        &[],
    )
    .await;
    let fast = build_pubsub(&emulator, &redis.host_port(), &groups_file, &[]).await;
    // Connect the slow one first, so only its publish is delayed.
    slow.run_cycle().await;
    let sub = Subscriber::start(&redis.url(), &instances).await;
    let mut conn = redis.client().await.unwrap();
    let _: () = conn
        .del(instances.iter().map(|i| cache_key(i)).collect::<Vec<_>>())
        .await
        .unwrap();
    let _: () = conn
        .del(
            instances
                .iter()
                .map(|i| polled_at_key(i))
                .collect::<Vec<_>>(),
        )
        .await
        .unwrap();

    slow_path.set_delay(Duration::from_millis(1500));
    emulator.clear_calls();
    let newer = async {
        wait_for("the slow replica has polled", || async {
            (emulator.count(DESCRIBE) >= 1).then_some(())
        })
        .await;
        for iid in &instances {
            emulator.set_instance_status(iid, emu::InstanceStatus::Draining);
        }
        fast.run_cycle().await
    };
    let (slow_report, fast_report) = tokio::join!(slow.run_cycle(), newer);
    assert_eq!(fast_report.published, 3);
    let r = slow_report;
    assert_eq!(
        (r.published, r.stale),
        (0, 3),
        "the older poll is dropped: {r:?}"
    );
    for iid in &instances {
        let at: Option<i64> = conn.get(polled_at_key(iid)).await.unwrap();
        assert!(at.is_some(), "the polled-at time sits beside the cache key");
    }

    // A marker after everything, so the subscriber has seen all that was published.
    let _: i64 = conn.publish(&instances[0], "marker").await.unwrap();
    let got = wait_for("marker", || async {
        let got = sub.received();
        got.iter().any(|(_, b)| b == b"marker").then_some(got)
    })
    .await;
    for iid in &instances {
        let seq: Vec<InstanceStatus> = got
            .iter()
            .filter(|(c, b)| c == iid && b != b"marker")
            .map(|(_, b)| status_of(b))
            .collect();
        assert_eq!(seq, vec![InstanceStatus::Draining], "{iid}");
        assert_eq!(
            cached_status(&mut conn, iid).await,
            Some(InstanceStatus::Draining)
        );
    }
    let m = Metrics::parse(&slow.metrics_text());
    assert_eq!(counter(&m, "messages_stale", &[]), 3.0);
}

/// A write whose answer was lost did publish DRAINING; when the status reverts to ACTIVE,
/// the revert is published even with `--publish-unchanged=false`. Before, the last-published
/// map still said ACTIVE and suppressed it.
#[tokio::test]
async fn an_uncertain_write_is_published_again_when_the_status_reverts() {
    let emulator = GameLiftEmulator::start().await.unwrap();
    let redis = RedisServer::start().await.unwrap();
    let proxy = TcpProxy::start(redis.port()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let groups_file = dir.path().join("fleetiq.conf");
    write_groups(&groups_file, &["w1"]);
    let iid = "i-00000000000w10000".to_string();
    emulator.add_instances(
        "w1",
        std::slice::from_ref(&iid),
        emu::InstanceStatus::Active,
    );
    let pubsub = build_pubsub(
        &emulator,
        &format!("127.0.0.1:{}", proxy.port()),
        &groups_file,
        &[
            "--publish-unchanged=false",
            "--redis-timeout",
            "300ms",
            "--redis-retry-base",
            "5ms",
            "--redis-retry-max",
            "10ms",
        ],
    )
    .await;
    let sub = Subscriber::start(&redis.url(), std::slice::from_ref(&iid)).await;
    assert_eq!(pubsub.run_cycle().await.published, 1);
    sub.wait_for_count(1).await;

    emulator.set_instance_status(&iid, emu::InstanceStatus::Draining);
    proxy.set_drop_replies(true);
    let r = pubsub.run_cycle().await;
    assert_eq!(
        (r.published, r.publish_errors),
        (0, 1),
        "the answer was lost: {r:?}"
    );
    let got = sub.wait_for_count(2).await;
    assert_eq!(
        status_of(&got[1].1),
        InstanceStatus::Draining,
        "yet it was delivered"
    );

    proxy.set_drop_replies(false);
    emulator.set_instance_status(&iid, emu::InstanceStatus::Active);
    let r = wait_for("the revert is published", || async {
        let r = pubsub.run_cycle().await;
        (r.publish_errors == 0).then_some(r)
    })
    .await;
    assert_eq!(r.published, 1, "{r:?}");
    let got = sub.wait_for_count(3).await;
    assert_eq!(status_of(&got[2].1), InstanceStatus::Active);
}

/// A key of another Redis type where an instance's keys go (a hash left by some other
/// tool) fails no batch: the script reads it as absent and overwrites it, counted and
/// logged. Before, the WRONGTYPE error failed the whole script, so every instance of the
/// batch went unpublished, every cycle.
#[tokio::test]
async fn a_key_of_the_wrong_type_fails_no_batch() {
    let h = Harness::start(&["wt"], &[]).await;
    let instances = ids("wt", 5);
    h.emulator
        .add_instances("wt", &instances, emu::InstanceStatus::Draining);
    let mut conn = h.redis().await;
    let _: i64 = conn
        .hset(polled_at_key(&instances[2]), "by", "another-tool")
        .await
        .unwrap();
    let _: i64 = conn
        .rpush(cache_key(&instances[4]), "not-a-status")
        .await
        .unwrap();
    let report = h.cycle().await;
    assert_eq!(
        (report.published, report.publish_errors),
        (5, 0),
        "{report:?}"
    );
    for iid in &instances {
        assert_eq!(
            cached_status(&mut conn, iid).await,
            Some(InstanceStatus::Draining),
            "{iid}"
        );
    }
    // The hash was read (polled-at) and counted; the list was only overwritten (the
    // status key is read only with --publish-unchanged=false).
    assert_eq!(counter(&h.metrics(), "wrong_type_keys", &[]), 1.0);
}

/// A Redis error on one group's batch (here an ACL that denies that group's keys) fails
/// that group only: the next group still publishes in the same cycle. Before, the shared
/// backoff skipped every other group's batch.
#[tokio::test]
async fn one_groups_redis_error_does_not_stop_the_others() {
    let emulator = GameLiftEmulator::start().await.unwrap();
    let redis = RedisServer::start().await.unwrap();
    let mut admin = redis.client().await.unwrap();
    let _: String = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("limited")
        .arg("on")
        .arg(">pw")
        .arg("~lastcall:*:*ok*")
        .arg("&*")
        .arg("+@all")
        .query_async(&mut admin)
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let groups_file = dir.path().join("fleetiq.conf");
    // "ok" first, so the failing group's batch is the cycle's last.
    write_groups(&groups_file, &["ok", "denied"]);
    emulator.add_instances("denied", &ids("denied", 3), emu::InstanceStatus::Active);
    let good = ids("ok", 3);
    emulator.add_instances("ok", &good, emu::InstanceStatus::Active);
    let pubsub = build_pubsub(
        &emulator,
        &format!("redis://limited:pw@127.0.0.1:{}", redis.port()),
        &groups_file,
        &["--concurrency", "1"],
    )
    .await;
    let sub = Subscriber::start(&redis.url(), &good).await;
    let r = pubsub.run_cycle().await;
    assert_eq!((r.published, r.publish_errors), (3, 1), "{r:?}");
    sub.wait_for_count(3).await;
    let m = Metrics::parse(&pubsub.metrics_text());
    assert_eq!(
        counter(&m, "publish_errors", &[("reason", "no_permission")]),
        1.0
    );
    assert_eq!(counter(&m, "publish_errors", &[("reason", "backoff")]), 0.0);
    assert_eq!(
        m.value(
            "lastcall_pubsub_group_failed_cycles",
            &[("group", "denied")]
        ),
        1.0
    );
    // Redis works (the other group published): readiness does not follow whichever batch
    // finished last, so it holds over cycles. Before, it was false after every cycle.
    for _ in 0..3 {
        assert!(
            pubsub.health().is_ready(),
            "ready despite one failing group"
        );
        pubsub.run_cycle().await;
    }
}

/// 250 groups x 200 instances with half the calls throttled: the shared bucket keeps the
/// call rate under `--api-rate`, the cycle deadline cuts what does not fit, and groups that
/// missed a cycle go first in the next, so none misses two in a row.
#[tokio::test]
async fn throttling_at_250_groups_stays_under_the_rate_and_no_group_misses_twice() {
    const GROUPS: usize = 250;
    let names: Vec<String> = (0..GROUPS).map(|g| format!("q{g:03}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let h = Harness::start(
        &refs,
        &[
            "--api-rate",
            "200",
            "--api-burst",
            "5",
            "--cycle-deadline",
            // A cycle fits about 160 of the 250 groups at this rate and throttling: enough
            // that the groups cut from one cycle all fit first in the next, with a margin
            // (at 4 s, about 130 fit and the tail of the 120 missed ones could miss again).
            "5s",
            "--retry-base",
            "2ms",
            "--retry-max",
            "10ms",
            "--api-max-attempts",
            "20",
            "--concurrency",
            "8",
        ],
    )
    .await;
    for (g, name) in names.iter().enumerate() {
        let instances: Vec<String> = (0..200).map(|i| format!("i-{g:012}{i:05}")).collect();
        h.emulator
            .add_instances(name, &instances, emu::InstanceStatus::Active);
    }
    h.emulator.set_seed(7);
    h.emulator.set_throttle_ratio(0.5);

    let mut missed_before: std::collections::HashSet<String> = Default::default();
    let mut any_missed = false;
    for cycle in 0..3 {
        let r = h.cycle().await;
        let m = h.metrics();
        let missed: std::collections::HashSet<String> = names
            .iter()
            .filter(|g| {
                m.value(
                    "lastcall_pubsub_group_failed_cycles",
                    &[("group", g.as_str())],
                ) > 0.0
            })
            .cloned()
            .collect();
        // Groups that missed go first, so they all fit whenever this cycle published at least
        // as many groups as missed the last one (always, unless the machine is far slower
        // than the rate allows).
        let fits = r.groups_published >= missed_before.len();
        for g in missed.iter().filter(|_| fits) {
            assert!(
                !missed_before.contains(g),
                "cycle {cycle}: {g} missed two cycles in a row ({r:?})"
            );
            assert_eq!(
                m.value(
                    "lastcall_pubsub_group_failed_cycles",
                    &[("group", g.as_str())]
                ),
                1.0
            );
        }
        any_missed |= !missed.is_empty();
        missed_before = missed;
    }
    assert!(
        any_missed,
        "the deadline should have cut some groups (else the test proves nothing)"
    );
    let calls = h.emulator.calls();
    let first = calls.first().unwrap().at;
    let last = calls.last().unwrap().at;
    let span = last.duration_since(first).unwrap().as_secs_f64();
    let rate = (calls.len() - 1) as f64 / span;
    // The bucket allows its burst at once and the configured rate after that.
    assert!(
        (calls.len() - 1) as f64 <= 200.0 * span + 5.0 * 3.0 + 1.0,
        "{} calls in {span:.2}s = {rate:.1}/s over the configured 200/s",
        calls.len()
    );
    let throttled = calls
        .iter()
        .filter(|c| c.outcome == "ThrottlingException")
        .count();
    assert!(
        throttled > calls.len() / 3,
        "half the calls are throttled: {throttled}/{}",
        calls.len()
    );
}

/// AccessDenied on every group: not ready (a rollout with broken IAM must not replace a
/// working pod). On one group only: ready, and that group's staleness and failed-cycle
/// gauges show it. An empty group list is not ready either. Before, any completed cycle
/// made the pod ready.
#[tokio::test]
async fn access_denied_everywhere_is_not_ready_and_on_one_group_shows_in_its_staleness() {
    let h = Harness::start(&["a1", "a2"], &["--concurrency", "1"]).await;
    h.emulator
        .add_instances("a1", &ids("a1", 2), emu::InstanceStatus::Active);
    h.emulator
        .add_instances("a2", &ids("a2", 2), emu::InstanceStatus::Active);

    h.emulator
        .fail_next_with(DESCRIBE, 2, 400, "AccessDeniedException");
    let r = h.cycle().await;
    assert_eq!(r.groups_failed, 2, "{r:?}");
    assert!(
        !h.pubsub.health().is_ready(),
        "every group failing is not ready"
    );

    h.emulator
        .fail_next_with(DESCRIBE, 1, 400, "AccessDeniedException");
    let r = h.cycle().await;
    assert_eq!((r.groups_failed, r.groups_published), (1, 1), "{r:?}");
    assert!(h.pubsub.health().is_ready(), "one group published is ready");
    let m = h.metrics();
    let stale = |g: &str| m.value("lastcall_pubsub_group_staleness_seconds", &[("group", g)]);
    let failed = |g: &str| m.value("lastcall_pubsub_group_failed_cycles", &[("group", g)]);
    assert_eq!((failed("a1"), failed("a2")), (2.0, 0.0));
    assert!(
        stale("a1") > stale("a2"),
        "a1 {} vs a2 {}",
        stale("a1"),
        stale("a2")
    );
    assert_eq!(
        counter(
            &m,
            "group_errors",
            &[("group", "a1"), ("reason", "unauthorized")]
        ),
        2.0
    );

    write_groups(&h.groups_file, &[]);
    h.cycle().await;
    assert!(!h.pubsub.health().is_ready(), "no groups is not ready");
}

/// With the webhook on and no groups, the webhook is the whole job: `/readyz` is ready once
/// the webhook serves and Redis answers, not waiting for a publish that never comes. Without
/// the webhook, the same empty list is still not ready.
#[tokio::test]
async fn webhook_only_is_ready_once_the_webhook_serves() {
    let mut h = Harness::start(
        &[],
        &[
            "--webhook-listen",
            "127.0.0.1:0",
            "--webhook-max-replicas",
            "100",
        ],
    )
    .await;
    let detail = |h: &Harness| format!("{:?}", h.pubsub.health());
    h.cycle().await;
    assert!(
        !h.pubsub.health().is_ready(),
        "not before the webhook serves: {}",
        detail(&h)
    );
    let webhook = h.pubsub.webhook().expect("webhook configured").clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let stop = CancellationToken::new();
    let served = tokio::spawn(lastcall_pubsub::webhook::serve(
        listener,
        webhook,
        None,
        stop.clone(),
    ));
    wait_for("the webhook serves", || async {
        h.pubsub.health().is_ready().then_some(())
    })
    .await;
    // Still ready after more cycles: nothing waits for a group to be published.
    h.cycle().await;
    assert!(h.pubsub.health().is_ready(), "{}", detail(&h));
    assert_eq!(h.emulator.calls().len(), 0, "no groups, no GameLift calls");
    // Redis is still required: it is where the drain state lives.
    h.redis.kill().await;
    h.cycle().await;
    assert!(!h.pubsub.health().is_ready(), "Redis down means not ready");
    h.redis.restart().await.unwrap();
    wait_for("ready again once Redis is back", || async {
        h.cycle().await;
        h.pubsub.health().is_ready().then_some(())
    })
    .await;
    // A stopped webhook listener is not ready.
    stop.cancel();
    served.await.unwrap().unwrap();
    assert!(!h.pubsub.health().is_ready(), "{}", detail(&h));

    // Without the webhook, an empty groups list stays not ready.
    let plain = Harness::start(&[], &[]).await;
    plain.cycle().await;
    assert!(!plain.pubsub.health().is_ready());
}

// ---------------------------------------------------------------------------------------
// With the agent's FleetIQ source
// ---------------------------------------------------------------------------------------

struct AgentSource {
    view: watch::Receiver<FleetIqView>,
    registry: Arc<prometheus_client::registry::Registry>,
    stop: CancellationToken,
}

impl Drop for AgentSource {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl AgentSource {
    /// The agent's Redis source (and, with `fallback`, its GameLift fallback), as the agent
    /// runs them, for instance `iid`.
    fn start(
        url: &str,
        ca: Option<CaFile>,
        iid: &str,
        ping_every: Duration,
        fallback: Option<(&GameLiftEmulator, Duration)>,
    ) -> AgentSource {
        let (metrics, registry) = lastcall_agent::metrics::Metrics::new();
        let (tx, rx) = watch::channel(FleetIqView::default());
        let stop = CancellationToken::new();
        let src = RedisSource {
            target: RedisTarget::parse(url).unwrap(),
            channel: iid.to_string(),
            instance_id: iid.to_string(),
            metrics: metrics.clone(),
            view: tx.clone(),
            ping_every,
            ca_file: ca,
        };
        tokio::spawn(src.run(stop.clone()));
        if let Some((emulator, stale_after)) = fallback {
            let client = aws_sdk_gamelift::Client::from_conf(emulator.sdk_config_builder().build());
            let gl = GameLift::new(client, "g".into(), iid.into(), iid.into(), metrics.clone());
            tokio::spawn(run_fallback(
                gl,
                tx,
                stale_after,
                Duration::from_millis(50),
                metrics.clone(),
                stop.clone(),
            ));
        }
        AgentSource {
            view: rx,
            registry,
            stop,
        }
    }

    fn status(&self) -> Option<InstanceStatus> {
        self.view.borrow().status
    }

    fn metrics(&self) -> Metrics {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).unwrap();
        Metrics::parse(&out)
    }

    fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.metrics().value(name, labels)
    }
}

/// With `--publish-unchanged=false` nothing is published while nothing changes. The agent
/// reads the polled-at key when a keep-alive period passes quietly, sees pubsub is alive,
/// and never falls back to GameLift. Before, every agent fell back once the stale time
/// passed: about 83 requests a second at 5,000 nodes.
#[tokio::test]
async fn quiet_pubsub_with_publish_unchanged_false_keeps_agents_off_the_fallback() {
    let h = Harness::start(&["p1"], &["--publish-unchanged=false"]).await;
    let iid = "i-00000000000p10000";
    h.emulator
        .add_instances("p1", &[iid.to_string()], emu::InstanceStatus::Active);
    assert_eq!(h.cycle().await.published, 1);
    let agent = AgentSource::start(
        &h.redis.url(),
        None,
        iid,
        Duration::from_millis(100),
        Some((&h.emulator, Duration::from_millis(600))),
    );
    wait_for("the agent read the cache", || async {
        agent.status().map(|_| ())
    })
    .await;
    h.emulator.clear_calls();
    // Ten quiet periods, each far longer than the agent's stale time in total.
    for _ in 0..10 {
        let r = h.cycle().await;
        assert_eq!((r.published, r.unchanged), (0, 1));
        tokio::time::sleep(Duration::from_millis(250)).await; // the period, not a sync
    }
    let agent_calls = h
        .emulator
        .calls()
        .iter()
        .filter(|c| !c.input["InstanceIds"].is_null())
        .count();
    assert_eq!(
        agent_calls, 0,
        "no fallback to GameLift while pubsub is alive"
    );
    assert_eq!(
        agent.metric("lastcall_fallback_checks_total", &[("result", "ok")]),
        0.0
    );
    assert!(
        agent.metric(
            "lastcall_signals_total",
            &[("source", "fleetiq"), ("status", "confirmed")]
        ) >= 3.0
    );
    assert_eq!(agent.status(), Some(InstanceStatus::Active));
}

/// An ACL user allowed only to subscribe (no GET on pubsub's keys) still gets live
/// messages: the cache and polled-at reads are skipped, the subscription is kept.
#[tokio::test]
async fn an_agent_allowed_only_to_subscribe_still_gets_live_messages() {
    let redis = RedisServer::start().await.unwrap();
    let mut admin = redis.client().await.unwrap();
    let _: String = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("subonly")
        .arg("on")
        .arg(">pw")
        .arg("resetkeys")
        .arg("&*")
        .arg("-@all")
        .arg("+subscribe")
        .arg("+ping")
        .arg("+hello")
        .arg("+client")
        .query_async(&mut admin)
        .await
        .unwrap();
    let iid = "i-0000000000sub0000";
    let _: () = admin
        .set(
            cache_key(iid),
            r#"{"InstanceId": "i-0000000000sub0000", "InstanceStatus": "ACTIVE"}"#,
        )
        .await
        .unwrap();
    let agent = AgentSource::start(
        &format!("redis://subonly:pw@127.0.0.1:{}", redis.port()),
        None,
        iid,
        Duration::from_millis(100),
        None,
    );
    let body = r#"{"InstanceId": "i-0000000000sub0000", "InstanceStatus": "DRAINING"}"#;
    wait_for("the agent receives the live message", || async {
        let _: i64 = admin.clone().publish(iid, body).await.unwrap();
        (agent.status() == Some(InstanceStatus::Draining)).then_some(())
    })
    .await;
    assert!(
        agent
            .metrics()
            .has_series("lastcall_redis_reconnects_total", &[])
    );
    assert_eq!(
        agent.metric("lastcall_redis_reconnects_total", &[]),
        0.0,
        "the subscription was never dropped"
    );
}

/// `rediss://user:pass@` with a CA file works end to end for pubsub and the agent, against a
/// TLS-only `redis-server` with an ACL user and a certificate made for this test. A wrong
/// password, an untrusted certificate and a plain-text URL against the TLS port each give a
/// counted, classified error, with no crash and no status change.
#[tokio::test]
async fn redis_tls_with_an_acl_user_works_and_each_misconfiguration_is_classified() {
    use lastcall_testkit::redis::{ACL_PASSWORD, ACL_USER, generate_tls};
    let redis = RedisServer::start_secure().await.unwrap();
    let tls = redis.tls().unwrap().clone();
    let ca = tls.ca_pem.to_str().unwrap().to_string();
    let other_dir = tempfile::tempdir().unwrap();
    let other_ca = generate_tls(other_dir.path(), "other")
        .await
        .unwrap()
        .ca_pem;
    let port = redis.port();
    let good = format!("rediss://{ACL_USER}:{ACL_PASSWORD}@127.0.0.1:{port}");
    let iid = "i-0000000000tls0000";

    let emulator = GameLiftEmulator::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let groups_file = dir.path().join("fleetiq.conf");
    write_groups(&groups_file, &["tls"]);
    emulator.add_instances("tls", &[iid.to_string()], emu::InstanceStatus::Draining);

    // The good path, both binaries.
    let pubsub = build_pubsub(
        &emulator,
        &good,
        &groups_file,
        &[
            "--redis-ca-file",
            &ca,
            "--redis-retry-base",
            "5ms",
            "--redis-retry-max",
            "10ms",
        ],
    )
    .await;
    let r = pubsub.run_cycle().await;
    assert_eq!((r.published, r.errors), (1, 0), "{r:?}");
    let mut conn = redis.client().await.unwrap();
    assert_eq!(
        cached_status(&mut conn, iid).await,
        Some(InstanceStatus::Draining)
    );

    // The password is rotated under pubsub and its connection dropped: the reconnect fails
    // auth. Once the password is back, the next connection works: an auth failure never
    // breaks the publisher for good.
    let acl = |pass: &str| {
        let mut cmd = redis::cmd("ACL");
        cmd.arg("SETUSER")
            .arg(ACL_USER)
            .arg("resetpass")
            .arg(format!(">{pass}"));
        cmd
    };
    let _: String = acl("rotated").query_async(&mut conn).await.unwrap();
    let _: redis::Value = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("USER")
        .arg(ACL_USER)
        .query_async(&mut conn)
        .await
        .unwrap_or(redis::Value::Nil);
    let r = wait_for("pubsub sees the auth failure", || async {
        let r = pubsub.run_cycle().await;
        let m = Metrics::parse(&pubsub.metrics_text());
        (counter(&m, "publish_errors", &[("reason", "auth")]) >= 1.0).then_some(r)
    })
    .await;
    assert_eq!(r.published, 0);
    let mut admin = {
        // A connection of its own: the kill above closed the harness's.
        let client = redis::Client::build_with_tls(
            format!("rediss://{ACL_USER}:rotated@127.0.0.1:{port}").as_str(),
            redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(std::fs::read(&tls.ca_pem).unwrap()),
            },
        )
        .unwrap();
        client.get_multiplexed_async_connection().await.unwrap()
    };
    let _: String = acl(ACL_PASSWORD).query_async(&mut admin).await.unwrap();
    wait_for(
        "pubsub publishes again after the password is back",
        || async { (pubsub.run_cycle().await.published == 1).then_some(()) },
    )
    .await;
    let agent = AgentSource::start(
        &good,
        Some(CaFile::parse(&ca).unwrap()),
        iid,
        Duration::from_secs(5),
        None,
    );
    wait_for("the agent reads the status over TLS", || async {
        (agent.status() == Some(InstanceStatus::Draining)).then_some(())
    })
    .await;
    drop(agent);

    let bad_password = format!("rediss://{ACL_USER}:wrong@127.0.0.1:{port}");
    let plain = format!("redis://{ACL_USER}:{ACL_PASSWORD}@127.0.0.1:{port}");
    let cases: [(&str, &str, &str); 3] = [
        (&bad_password, &ca, "auth"),
        (&good, other_ca.to_str().unwrap(), "tls"),
        (&plain, &ca, "handshake"),
    ];
    let logs = LogCapture::default();
    let _guard = logs.install();
    for (url, ca_file, reason) in cases {
        let pubsub = build_pubsub(
            &emulator,
            url,
            &groups_file,
            &[
                "--redis-ca-file",
                ca_file,
                "--redis-timeout",
                "1s",
                "--redis-retry-base",
                "5ms",
                "--redis-retry-max",
                "10ms",
            ],
        )
        .await;
        let r = pubsub.run_cycle().await;
        assert_eq!((r.published, r.publish_errors), (0, 1), "{reason}: {r:?}");
        let m = Metrics::parse(&pubsub.metrics_text());
        assert_eq!(
            counter(&m, "publish_errors", &[("reason", reason)]),
            1.0,
            "{reason}"
        );
        assert!(!pubsub.health().is_ready(), "{reason}");
        wait_for(
            &format!("pubsub retries after a {reason} error"),
            || async {
                pubsub.run_cycle().await;
                let m = Metrics::parse(&pubsub.metrics_text());
                (counter(&m, "publish_errors", &[("reason", reason)]) >= 3.0).then_some(())
            },
        )
        .await;
        let tagged = format!("reason=\"{reason}\"");
        let lines = logs.warnings(&["Redis round trip failed", &tagged]);
        assert_eq!(
            lines.len(),
            1,
            "{reason}: one warning line for three failures: {lines:#?}"
        );
        assert!(lines[0].contains("hint="), "{}", lines[0]);

        let agent = AgentSource::start(
            url,
            Some(CaFile::parse(ca_file).unwrap()),
            iid,
            Duration::from_secs(5),
            None,
        );
        wait_for(
            &format!("the agent retries after a {reason} error"),
            || async {
                (agent.metric(
                    "lastcall_redis_errors_total",
                    &[("source", "fleetiq"), ("reason", reason)],
                ) >= 3.0)
                    .then_some(())
            },
        )
        .await;
        let lines = logs.warnings(&["Redis unavailable", &tagged]);
        assert_eq!(
            lines.len(),
            1,
            "{reason}: one agent warning for three failures: {lines:#?}"
        );
        assert_eq!(
            agent.status(),
            None,
            "{reason}: a Redis error never changes the status"
        );
    }
}

// ---------------------------------------------------------------------------------------
// The binary
// ---------------------------------------------------------------------------------------

/// A command for the binary with a clean environment: nothing from the developer's shell
/// (REDIS_URL, AWS_*, RUST_LOG) leaks in.
fn pubsub_command(home: &Path) -> tokio::process::Command {
    let mut cmd =
        tokio::process::Command::new(workspace_binary("lastcall-pubsub", "lastcall-pubsub"));
    cmd.env_clear()
        .env("HOME", home)
        .env("AWS_ACCESS_KEY_ID", "AKIDPUBSUBTEST")
        .env("AWS_SECRET_ACCESS_KEY", "pubsub-test-secret")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    cmd
}

#[tokio::test]
async fn binary_rejects_bad_flags_with_exit_2_and_one_line_naming_the_flag() {
    let home = tempfile::tempdir().unwrap();
    let cases: &[(&[&str], &str)] = &[
        (&["--redis-url", "cache:6379", "--period", "5s"], "--period"),
        (&["--redis-url", "http://x"], "--redis-url"),
        (
            &["--redis-url", "cache", "--concurrency", "0"],
            "--concurrency",
        ),
        (&["--period", "60s"], "--redis-url"),
        // Flags that must agree: checked against each other at start.
        (
            &["--redis-url", "cache", "--cache-ttl-periods", "1"],
            "--cache-ttl-periods",
        ),
        (
            &["--redis-url", "cache", "--liveness-timeout", "30s"],
            "--liveness-timeout",
        ),
    ];
    for (args, flag) in cases {
        let out = pubsub_command(home.path())
            .args(*args)
            .output()
            .await
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<_> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(
            lines.len(),
            1,
            "{args:?}: one line expected, got {stderr:?}"
        );
        assert!(
            lines[0].contains(flag),
            "{args:?}: {stderr:?} does not name {flag}"
        );
    }
    // An invalid environment value is named by its flag as well.
    let out = pubsub_command(home.path())
        .env("REDIS_URL", "cache")
        .env("LASTCALL_PUBSUB_PERIOD", "1s")
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--period"));

    let help = pubsub_command(home.path())
        .arg("--help")
        .output()
        .await
        .unwrap();
    assert_eq!(help.status.code(), Some(0));
    let help = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--config-file",
        "--period",
        "--redis-url",
        "--aws-region",
        "--gamelift-endpoint",
        "--listen",
        "--publish-unchanged",
        "--cache-ttl-periods",
        "--concurrency",
        "--retry-base",
        "--retry-max",
        "--log-level",
        "--api-rate",
        "--api-burst",
        "--cycle-deadline",
        "--liveness-timeout",
        "--ready-periods",
        "--redis-ca-file",
        "REDIS_CA_FILE",
        "FLEETIQ_CONFIG",
        "REDIS_URL",
        "AWS_REGION",
        "AWS_ENDPOINT_URL_GAMELIFT",
    ] {
        assert!(help.contains(flag), "--help does not document {flag}");
    }
}

/// Redis down for longer than `--liveness-timeout` does not make the real binary's
/// `/healthz` fail: the kubelet would restart it into CrashLoopBackOff, and the
/// FleetAutoscaler webhook, which answers held without Redis, would give Agones connection
/// errors instead, so no Fleet could scale, not even up. `/readyz` reports Redis (503,
/// with the reason) and the webhook keeps answering 200: held, and still growing a Fleet.
/// Before, `/healthz` turned 503 once no Redis round trip had succeeded for the timeout.
#[tokio::test]
async fn binary_stays_live_and_answers_the_webhook_while_redis_never_answers() {
    let emulator = GameLiftEmulator::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let groups_file = dir.path().join("fleetiq.conf");
    write_groups(&groups_file, &["live-group"]);
    emulator.add_instances("live-group", &ids("live", 2), emu::InstanceStatus::Active);
    let (port, hook_port, no_redis) = (free_port(), free_port(), free_port());
    // The Kubernetes API the webhook watches Fleets in: a held answer keeps the Fleet's
    // spec.replicas, and without it would be refused.
    let api_server = lastcall_testkit::kube::Emulator::start().await.unwrap();
    let fleet: kube::api::DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "agones.dev/v1", "kind": "Fleet",
        "metadata": {"name": "arena", "namespace": "default"},
        "spec": {"replicas": 16, "template": {"spec": {"ports": []}}},
    }))
    .unwrap();
    kube::Api::<kube::api::DynamicObject>::namespaced_with(
        api_server.client().await.unwrap(),
        "default",
        &lastcall_pubsub::webhook::fleets::fleet_resource(),
    )
    .create(&kube::api::PostParams::default(), &fleet)
    .await
    .unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    api_server.write_kubeconfig(&kubeconfig, "pubsub").unwrap();
    let liveness_timeout = Duration::from_secs(20);
    let started = tokio::time::Instant::now();
    let _child = pubsub_command(dir.path())
        .env("KUBECONFIG", &kubeconfig)
        .args(["--config-file", groups_file.to_str().unwrap()])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--period", "10s", "--cycle-jitter", "0s"])
        .args(["--liveness-timeout", "20s", "--redis-timeout", "200ms"])
        .args(["--webhook-listen", &format!("127.0.0.1:{hook_port}")])
        .args(["--webhook-max-replicas", "100"])
        .env("REDIS_URL", format!("127.0.0.1:{no_redis}"))
        .env("AWS_REGION", "us-west-2")
        .env("AWS_ENDPOINT_URL_GAMELIFT", emulator.url())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    wait_for("the admin listener answers", || async {
        http.get(format!("{base}/healthz"))
            .send()
            .await
            .ok()
            .map(|_| ())
    })
    .await;
    let review = |uid: &str, replicas: i64, allocated: i64| {
        serde_json::json!({"request": {"uid": uid, "name": "arena", "namespace": "default",
            "status": {"replicas": replicas, "readyReplicas": replicas - allocated,
                       "reservedReplicas": 0, "allocatedReplicas": allocated},
            "labels": {}, "annotations": {}}, "response": null})
    };
    // Probe as the kubelet does, past the liveness timeout and a cycle more.
    let until = started + liveness_timeout + Duration::from_secs(6);
    let mut probes = 0;
    while tokio::time::Instant::now() < until {
        let r = http.get(format!("{base}/healthz")).send().await.unwrap();
        let code = r.status().as_u16();
        let body = r.text().await.unwrap();
        assert_eq!(
            code,
            200,
            "/healthz failed {:?} after start with Redis down: {body}",
            started.elapsed()
        );
        probes += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(probes > 40, "{probes} probes");
    let ready = http.get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 503);
    let text = ready.text().await.unwrap();
    assert!(text.contains("connection"), "{text}");

    // Agones' reviews are answered: held at the Fleet's spec, and growth still allowed.
    let hook = format!("http://127.0.0.1:{hook_port}/scale");
    for (uid, replicas, allocated, want) in [("held", 16, 5, 16), ("grow", 16, 14, 19)] {
        let r = http
            .post(&hook)
            .json(&review(uid, replicas, allocated))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(body["response"]["replicas"], want, "{uid}: {body}");
    }
}

#[tokio::test]
async fn binary_publishes_serves_metrics_and_exits_0_on_sigterm() {
    let emulator = GameLiftEmulator::start().await.unwrap();
    let redis = RedisServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let groups_file = dir.path().join("fleetiq.conf");
    write_groups(&groups_file, &["bin-group"]);
    let instances = ids("bin", 3);
    emulator.add_instances("bin-group", &instances, emu::InstanceStatus::Draining);
    let port = free_port();

    let mut child = pubsub_command(dir.path())
        .args(["--config-file", groups_file.to_str().unwrap()])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--period", "10s", "--cycle-jitter", "0s"])
        .env("REDIS_URL", redis.host_port()) // the original adapter's host:port form
        .env("AWS_REGION", "us-west-2")
        .env("AWS_ENDPOINT_URL_GAMELIFT", emulator.url())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();

    let http = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    wait_for("the binary becomes ready", || async {
        let r = http.get(format!("{base}/readyz")).send().await.ok()?;
        (r.status() == 200).then_some(())
    })
    .await;
    let healthz = http.get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(healthz.status(), 200);

    let mut conn = redis.client().await.unwrap();
    let cached: Option<String> = conn.get(cache_key(&instances[0])).await.unwrap();
    let cached = cached.expect("the binary cached the status");
    assert_eq!(
        StatusMessage::parse(cached.as_bytes()).unwrap().status,
        InstanceStatus::Draining
    );

    let response = http.get(format!("{base}/metrics")).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    let m = Metrics::parse(&text);
    assert!(m.samples.len() > 20, "{text}");
    assert!(counter(&m, "cycles", &[("result", "ok")]) >= 1.0, "{text}");
    assert!(counter(&m, "messages_published", &[]) >= 3.0, "{text}");
    assert_eq!(
        m.value(
            "lastcall_pubsub_instances",
            &[("group", "bin-group"), ("status", "DRAINING")]
        ),
        3.0
    );

    signal(child.id().unwrap(), "TERM").await.unwrap();
    let status = exited_within(&mut child, Duration::from_secs(5))
        .await
        .unwrap()
        .expect("exit after SIGTERM within 5s");
    assert_eq!(status.code(), Some(0), "clean exit on SIGTERM");
}

// ---------------------------------------------------------------------------------------
// Clocks: poll times come from each replica's wall clock
// ---------------------------------------------------------------------------------------

/// Redis' own clock, in Unix milliseconds.
/// A publishing deadline no test reaches.
fn far() -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_secs(60)
}

async fn redis_time_ms(conn: &mut redis::aio::MultiplexedConnection) -> i64 {
    let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(conn).await.unwrap();
    secs * 1000 + micros / 1000
}

fn body(iid: &str, status: InstanceStatus) -> String {
    StatusMessage {
        group_name: Some("c1".into()),
        group_arn: None,
        instance_id: iid.into(),
        status,
    }
    .to_python_json()
}

/// A publisher of its own (one writer), built as `Pubsub` builds it, with its registry.
fn publisher(
    emulator: &GameLiftEmulator,
    redis_url: &str,
    groups_file: &Path,
) -> (
    lastcall_pubsub::publisher::Publisher,
    prometheus_client::registry::Registry,
) {
    publisher_with(emulator, redis_url, groups_file, &[])
}

fn publisher_with(
    emulator: &GameLiftEmulator,
    redis_url: &str,
    groups_file: &Path,
    extra: &[&str],
) -> (
    lastcall_pubsub::publisher::Publisher,
    prometheus_client::registry::Registry,
) {
    let config = config(emulator, redis_url, groups_file, extra);
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = lastcall_pubsub::metrics::Metrics::register(&mut registry);
    let health = lastcall_common::admin::Health::new(&[lastcall_pubsub::publisher::READY_REDIS]);
    let p = lastcall_pubsub::publisher::Publisher::new(&config, metrics, health).unwrap();
    (p, registry)
}

fn registry_text(registry: &prometheus_client::registry::Registry) -> Metrics {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, registry).unwrap();
    Metrics::parse(&out)
}

/// A replica whose node clock ran ten minutes ahead (since replaced by a rollout) left a
/// poll time in the future. A SPOT_TERMINATING polled now is still cached and published,
/// and the time stored is not ahead of Redis' clock. Before, every write was dropped until
/// the real time passed the stored one (here: until the TTL), and the Spot notice was lost.
#[tokio::test]
async fn a_notice_is_written_over_a_poll_time_ahead_of_redis_time() {
    let h = Harness::start(&["c1"], &[]).await;
    let iid = ids("c1", 1).remove(0);
    h.emulator.add_instances(
        "c1",
        std::slice::from_ref(&iid),
        emu::InstanceStatus::SpotTerminating,
    );
    let mut conn = h.redis().await;
    let ahead = redis_time_ms(&mut conn).await + 10 * 60 * 1000;
    let _: () = conn
        .set(cache_key(&iid), body(&iid, InstanceStatus::Active))
        .await
        .unwrap();
    let _: () = conn.set(polled_at_key(&iid), ahead).await.unwrap();
    let sub = Subscriber::start(&h.redis.url(), std::slice::from_ref(&iid)).await;

    let r = h.cycle().await;
    assert_eq!((r.published, r.stale), (1, 0), "{r:?}");
    assert_eq!(
        cached_status(&mut conn, &iid).await,
        Some(InstanceStatus::SpotTerminating)
    );
    let got = sub.wait_for_count(1).await;
    assert_eq!(status_of(&got[0].1), InstanceStatus::SpotTerminating);
    let stored: i64 = conn.get(polled_at_key(&iid)).await.unwrap();
    assert!(
        stored <= redis_time_ms(&mut conn).await,
        "no poll time ahead of Redis is stored: {stored}"
    );
}

/// One writer's polls are ordered by its monotonic clock, not by when their scripts run:
/// a SPOT_TERMINATING polled last and written first is not overwritten by an ACTIVE polled
/// five seconds earlier whose script arrives late (a retried or delayed batch). Before,
/// a writer's own script always won, so the late ACTIVE replaced the notice. And the time
/// stored is Redis' `TIME` less the poll's age, so no replica's wall clock (stepped back
/// or ahead) enters it.
#[tokio::test]
async fn a_writers_older_poll_delivered_late_never_replaces_its_newer_one() {
    let emulator = GameLiftEmulator::start().await.unwrap();
    let redis = RedisServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let groups_file = dir.path().join("fleetiq.conf");
    write_groups(&groups_file, &["c1"]);
    let (p, _registry) = publisher(&emulator, &redis.host_port(), &groups_file);
    let iid = ids("c1", 1).remove(0);
    let mut conn = redis.client().await.unwrap();
    let at = |status, polled_at| lastcall_pubsub::publisher::Outgoing {
        instance_id: iid.clone(),
        body: body(&iid, status),
        polled_at,
    };
    let now = tokio::time::Instant::now();
    let earlier = now - Duration::from_secs(5);
    let before = redis_time_ms(&mut conn).await;
    let r = p
        .publish(&[at(InstanceStatus::SpotTerminating, now)], far())
        .await;
    assert_eq!(r.published, 1, "{r:?}");
    let stored: i64 = conn.get(polled_at_key(&iid)).await.unwrap();
    let after = redis_time_ms(&mut conn).await;
    assert!(
        before <= stored && stored <= after,
        "dated by Redis' clock: {before} <= {stored} <= {after}"
    );
    let r = p
        .publish(&[at(InstanceStatus::Active, earlier)], far())
        .await;
    assert_eq!((r.published, r.stale), (0, 1), "{r:?}");
    assert_eq!(
        cached_status(&mut conn, &iid).await,
        Some(InstanceStatus::SpotTerminating)
    );
    // Its next poll wins as usual.
    let r = p
        .publish(
            &[at(InstanceStatus::Active, tokio::time::Instant::now())],
            far(),
        )
        .await;
    assert_eq!((r.published, r.stale), (1, 0), "{r:?}");
}

/// Another replica holds a later poll (both clocks right), so this replica's DRAINING is
/// dropped, as it should be; but a dropped notice is a warning naming the instance and a
/// `notices_dropped_total{status}` series an alert watches. Before, only a counter of all
/// stale statuses moved.
#[tokio::test]
async fn a_dropped_notice_is_a_warning_and_a_metric() {
    let logs = LogCapture::default();
    let _guard = logs.install();
    let emulator = GameLiftEmulator::start().await.unwrap();
    let redis = RedisServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let groups_file = dir.path().join("fleetiq.conf");
    write_groups(&groups_file, &["c1"]);
    let (a, _) = publisher(&emulator, &redis.host_port(), &groups_file);
    let (b, b_registry) = publisher(&emulator, &redis.host_port(), &groups_file);
    let iid = ids("c1", 1).remove(0);
    let mut conn = redis.client().await.unwrap();
    let now = tokio::time::Instant::now();
    let out = |status, polled_at| lastcall_pubsub::publisher::Outgoing {
        instance_id: iid.clone(),
        body: body(&iid, status),
        polled_at,
    };
    assert_eq!(
        a.publish(&[out(InstanceStatus::Active, now)], far())
            .await
            .published,
        1
    );
    let r = b
        .publish(
            &[out(InstanceStatus::Draining, now - Duration::from_secs(5))],
            far(),
        )
        .await;
    assert_eq!((r.published, r.stale), (0, 1), "{r:?}");
    assert_eq!(
        cached_status(&mut conn, &iid).await,
        Some(InstanceStatus::Active)
    );
    let m = registry_text(&b_registry);
    assert_eq!(
        counter(&m, "notices_dropped", &[("status", "DRAINING")]),
        1.0
    );
    assert_eq!(logs.warnings(&[&iid, "DRAINING"]).len(), 1);
}

/// Between two replicas the later poll wins, whatever the statuses: replica A polled
/// DRAINING, replica B polled ACTIVE two seconds later (FleetIQ put the instance back), so
/// B's ACTIVE replaces A's DRAINING in the cache and on the channel, and agents cancel the
/// drain (`docs/pubsub.md`, "Which status wins"). Delivered the other way round (A's
/// DRAINING reaching Redis after B's later ACTIVE), the DRAINING is older and dropped, with
/// a warning and `notices_dropped_total`: no subscriber sees it after the ACTIVE.
#[tokio::test]
async fn between_two_replicas_the_later_poll_wins_whatever_the_status() {
    let emulator = GameLiftEmulator::start().await.unwrap();
    let redis = RedisServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let groups_file = dir.path().join("fleetiq.conf");
    write_groups(&groups_file, &["c1"]);
    let (a, a_registry) = publisher(&emulator, &redis.host_port(), &groups_file);
    let (b, _) = publisher(&emulator, &redis.host_port(), &groups_file);
    let iid = ids("c1", 1).remove(0);
    let sub = Subscriber::start(&redis.url(), std::slice::from_ref(&iid)).await;
    let mut conn = redis.client().await.unwrap();
    // Polls in the past, so no date is capped at Redis' present.
    let t0 = tokio::time::Instant::now() - Duration::from_secs(10);
    let out = |status, polled_at| lastcall_pubsub::publisher::Outgoing {
        instance_id: iid.clone(),
        body: body(&iid, status),
        polled_at,
    };
    let r = a.publish(&[out(InstanceStatus::Draining, t0)], far()).await;
    assert_eq!(r.published, 1, "{r:?}");
    let r = b
        .publish(
            &[out(InstanceStatus::Active, t0 + Duration::from_secs(2))],
            far(),
        )
        .await;
    assert_eq!(
        (r.published, r.stale),
        (1, 0),
        "the later ACTIVE replaces the DRAINING: {r:?}"
    );
    assert_eq!(
        cached_status(&mut conn, &iid).await,
        Some(InstanceStatus::Active)
    );
    // A's DRAINING polled between the two, delivered last: older than B's ACTIVE.
    let r = a
        .publish(
            &[out(InstanceStatus::Draining, t0 + Duration::from_secs(1))],
            far(),
        )
        .await;
    assert_eq!(
        (r.published, r.stale, r.notices_dropped),
        (0, 1, 1),
        "{r:?}"
    );
    assert_eq!(
        cached_status(&mut conn, &iid).await,
        Some(InstanceStatus::Active)
    );
    assert_eq!(
        counter(
            &registry_text(&a_registry),
            "notices_dropped",
            &[("status", "DRAINING")]
        ),
        1.0
    );
    // Ordered by the channel itself: a marker after everything.
    let _: i64 = conn.publish(&iid, "marker").await.unwrap();
    let got = wait_for("marker", || async {
        let got = sub.received();
        got.iter().any(|(_, b)| b == b"marker").then_some(got)
    })
    .await;
    let seq: Vec<InstanceStatus> = got
        .iter()
        .filter(|(_, b)| b != b"marker")
        .map(|(_, b)| status_of(b))
        .collect();
    assert_eq!(seq, [InstanceStatus::Draining, InstanceStatus::Active]);
}

/// Every call throttled and one attempt allowed: each page's only (so last) attempt is
/// throttled, and the shared rate still slows down. Before, a throttle on the last attempt
/// was returned as the group's error without touching the rate.
#[tokio::test]
async fn a_throttled_last_attempt_slows_the_shared_rate() {
    let h = Harness::start(&["t1", "t2"], &["--api-max-attempts", "1"]).await;
    for g in ["t1", "t2"] {
        h.emulator
            .add_instances(g, &ids(g, 3), emu::InstanceStatus::Active);
    }
    h.emulator.set_throttle_ratio(1.0);
    let r = h.cycle().await;
    assert_eq!((r.groups_failed, r.api_retries), (2, 0), "{r:?}");
    let m = h.metrics();
    assert_eq!(counter(&m, "api_throttle_slowdowns", &[]), 2.0);
}

// ---------------------------------------------------------------------------------------
// Listeners: idle clients cannot grow the process
// ---------------------------------------------------------------------------------------

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// 2,400 idle connections that never send a byte, half on the admin listener and half on
/// the plain-HTTP webhook: the process holds at most its connection cap per listener,
/// memory stays bounded, publishing goes on, and an idle connection is closed by the
/// server after the header timeout. Before, every connection was kept forever.
#[tokio::test]
async fn binary_idle_connections_are_capped_and_timed_out_and_publishing_goes_on() {
    const PER_LISTENER: usize = 1200;
    let emulator = GameLiftEmulator::start().await.unwrap();
    let redis = RedisServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let groups_file = dir.path().join("fleetiq.conf");
    write_groups(&groups_file, &["idle-group"]);
    let instances = ids("idle", 2);
    emulator.add_instances("idle-group", &instances, emu::InstanceStatus::Active);
    let (port, hook_port) = (free_port(), free_port());
    let mut child = pubsub_command(dir.path())
        .args(["--config-file", groups_file.to_str().unwrap()])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--webhook-listen", &format!("127.0.0.1:{hook_port}")])
        .args(["--webhook-max-replicas", "100"])
        .args(["--period", "10s", "--cycle-jitter", "0s"])
        .args(["--redis-url", &redis.host_port()])
        .env("AWS_REGION", "us-west-2")
        .env("AWS_ENDPOINT_URL_GAMELIFT", emulator.url())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = child.id().unwrap();
    let http = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    wait_for("the binary becomes ready", || async {
        let r = http.get(format!("{base}/readyz")).send().await.ok()?;
        (r.status() == 200).then_some(())
    })
    .await;
    let (fds_before, rss_before) = (open_fds(pid), rss_kib(pid));

    let mut idle = Vec::new();
    for p in [port, hook_port] {
        for _ in 0..PER_LISTENER {
            let connect = tokio::net::TcpStream::connect(("127.0.0.1", p));
            if let Ok(Ok(s)) = tokio::time::timeout(Duration::from_secs(1), connect).await {
                idle.push(s);
            }
        }
    }
    assert!(idle.len() >= 2000, "only {} connected", idle.len());
    // Give the server time to accept everything it will accept.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (fds, rss) = (open_fds(pid), rss_kib(pid));
    let cap = 2 * lastcall_common::admin::MAX_CONNECTIONS;
    assert!(
        fds <= fds_before + cap + 16,
        "{fds} fds open, {fds_before} before: connections are capped"
    );
    assert!(
        rss <= rss_before + 32 * 1024,
        "RSS grew from {rss_before} KiB to {rss} KiB"
    );

    // Publishing goes on while the idle connections sit there.
    let mut conn = redis.client().await.unwrap();
    let first: i64 = conn.get(polled_at_key(&instances[0])).await.unwrap();
    wait_for("another cycle publishes", || async {
        let mut conn = redis.client().await.ok()?;
        let at: i64 = conn.get(polled_at_key(&instances[0])).await.ok()?;
        (at > first).then_some(())
    })
    .await;

    // An idle connection the server accepted is closed after the header timeout.
    let mut first_idle = idle.remove(0);
    let mut buf = [0u8; 16];
    let closed = tokio::time::timeout(
        lastcall_common::admin::HEADER_TIMEOUT + Duration::from_secs(10),
        tokio::io::AsyncReadExt::read(&mut first_idle, &mut buf),
    )
    .await;
    assert!(
        matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
        "the server closed the idle connection: {closed:?}"
    );

    // Once the idle clients go, the listeners answer at once.
    drop(idle);
    wait_for("/metrics answers again", || async {
        let r = http
            .get(format!("{base}/metrics"))
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .ok()?;
        (r.status() == 200).then_some(())
    })
    .await;
    signal(pid, "TERM").await.unwrap();
    let status = exited_within(&mut child, Duration::from_secs(10))
        .await
        .unwrap()
        .expect("exit after SIGTERM");
    assert_eq!(status.code(), Some(0));
}

/// Thousands of hostile reviews at the real binary's webhook, with slow clients holding
/// every connection they can: names over Kubernetes' limits (a 300 KiB Fleet name),
/// invalid namespaces, 2,000 Fleets that do not exist, bodies over the size limit,
/// garbage, and 400 connections that trickle their headers (slowloris). Pubsub's memory
/// stays bounded (RSS from /proc, sampled throughout), `/healthz` keeps answering every
/// probe, FleetIQ statuses keep being published (a DRAINING set mid-attack reaches Redis),
/// and `/metrics` names no Fleet that does not exist. Before, every name was stored for
/// ten minutes, as a tracker key and a metric label: 150 reviews with 1 MiB names grew
/// pubsub from 28 to 320 MiB and `/metrics` to 150 MB. The figures are printed for
/// `docs/benchmarks.md` (`--nocapture`); this test asserts the bounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_withstands_hostile_reviews_and_slow_clients() {
    use tokio::io::AsyncWriteExt;
    let emulator = GameLiftEmulator::start().await.unwrap();
    let redis = RedisServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let groups_file = dir.path().join("fleetiq.conf");
    write_groups(&groups_file, &["hostile-group"]);
    let instances = ids("hostile", 20);
    emulator.add_instances("hostile-group", &instances, emu::InstanceStatus::Active);
    // The Kubernetes API the webhook watches Fleets in: one real Fleet.
    let api_server = lastcall_testkit::kube::Emulator::start().await.unwrap();
    let fleet: kube::api::DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "agones.dev/v1", "kind": "Fleet",
        "metadata": {"name": "arena", "namespace": "default"},
        "spec": {"replicas": 10, "template": {"spec": {"ports": []}}},
    }))
    .unwrap();
    kube::Api::<kube::api::DynamicObject>::namespaced_with(
        api_server.client().await.unwrap(),
        "default",
        &lastcall_pubsub::webhook::fleets::fleet_resource(),
    )
    .create(&kube::api::PostParams::default(), &fleet)
    .await
    .unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    api_server.write_kubeconfig(&kubeconfig, "pubsub").unwrap();
    // A drain state dated an hour ago: answers do not hold for a restart that did not
    // happen (a held review of a Fleet that does not exist is refused with 503).
    let mut conn = redis.client().await.unwrap();
    lastcall_common::drain_state::mark_epoch_in(
        &mut conn,
        lastcall_common::drain_state::KEY,
        lastcall_common::drain_state::unix_ms(std::time::SystemTime::now()) - 3_600_000,
    )
    .await
    .unwrap();
    let (port, hook_port) = (free_port(), free_port());
    let mut child = pubsub_command(dir.path())
        .env("KUBECONFIG", &kubeconfig)
        .args(["--config-file", groups_file.to_str().unwrap()])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--webhook-listen", &format!("127.0.0.1:{hook_port}")])
        .args(["--webhook-max-replicas", "100"])
        .args(["--period", "10s", "--cycle-jitter", "0s"])
        .args(["--redis-url", &redis.host_port()])
        .env("AWS_REGION", "us-west-2")
        .env("AWS_ENDPOINT_URL_GAMELIFT", emulator.url())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = child.id().unwrap();
    let probe = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let hook = format!("http://127.0.0.1:{hook_port}/scale");
    wait_for("the binary becomes ready", || async {
        let r = probe.get(format!("{base}/readyz")).send().await.ok()?;
        (r.status() == 200).then_some(())
    })
    .await;
    let idle_kib = rss_kib(pid);

    let review = |namespace: &str, name: &str, annotations: serde_json::Value| {
        serde_json::json!({"request": {"uid": "u", "name": name, "namespace": namespace,
            "status": {"replicas": 10, "readyReplicas": 5, "reservedReplicas": 0, "allocatedReplicas": 5},
            "annotations": annotations}, "response": null})
        .to_string()
    };
    let huge_name = "f".repeat(300 * 1024);
    let big_annotation = serde_json::json!({"kubectl.kubernetes.io/last-applied-configuration": "x".repeat(400 * 1024)});
    // What an attacker sends, and the status each must get.
    let bodies: Vec<(String, u16)> = (0..2600)
        .map(|i| match i % 13 {
            0 => (review("default", &huge_name, serde_json::json!({})), 400),
            1 => (review(&"n".repeat(64), "arena", serde_json::json!({})), 400),
            2 => ("x".repeat(600 * 1024), 413),
            3 => ("{\"request\": [1, 2".into(), 400),
            4 => (
                review("default", &format!("fleet-{i}"), big_annotation.clone()),
                200,
            ),
            _ => (
                review("default", &format!("fleet-{i}"), serde_json::json!({})),
                200,
            ),
        })
        .collect();
    let bodies = Arc::new(bodies);

    // 400 slow clients: they send headers a byte a second, never the end of them.
    let slow = tokio::spawn(async move {
        let mut held = Vec::new();
        for _ in 0..400 {
            if let Ok(Ok(s)) = tokio::time::timeout(
                Duration::from_secs(1),
                tokio::net::TcpStream::connect(("127.0.0.1", hook_port)),
            )
            .await
            {
                held.push(s);
            }
        }
        for _ in 0..20 {
            for s in &mut held {
                let _ = s.write_all(b"X").await;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
    let peak = Arc::new(std::sync::atomic::AtomicU64::new(idle_kib));
    let sampler = {
        let peak = peak.clone();
        tokio::spawn(async move {
            loop {
                peak.fetch_max(rss_kib(pid), std::sync::atomic::Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let probes = {
        let (probe, base) = (probe.clone(), base.clone());
        tokio::spawn(async move {
            let mut codes = Vec::new();
            for _ in 0..40 {
                let code = probe
                    .get(format!("{base}/healthz"))
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
                    .unwrap_or(0);
                codes.push(code);
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            codes
        })
    };
    let attack = {
        let (bodies, hook) = (bodies.clone(), hook.clone());
        // Past Agones' 15 s: a review may first wait in the kernel's accept queue while the
        // slow clients hold every connection (each for at most the 10 s header timeout).
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .unwrap();
        futures::stream::iter(0..bodies.len())
            .map(move |i| {
                let (bodies, hook, client) = (bodies.clone(), hook.clone(), client.clone());
                async move {
                    let r = client.post(&hook).body(bodies[i].0.clone()).send().await;
                    let code = match r {
                        Ok(r) => Some(r.status().as_u16()),
                        Err(e) => {
                            eprintln!("review {i}: {e:?}");
                            None
                        }
                    };
                    (i, code)
                }
            })
            .buffer_unordered(24)
            .collect::<Vec<_>>()
    };
    // Mid-attack, FleetIQ says one instance drains: it must reach Redis.
    let drained = async {
        emulator.set_instance_status(&instances[0], emu::InstanceStatus::Draining);
        wait_for("the DRAINING is published during the attack", || async {
            let mut conn = redis.client().await.ok()?;
            let body: Option<Vec<u8>> = conn.get(cache_key(&instances[0])).await.ok()?;
            (status_of(&body?) == InstanceStatus::Draining).then_some(())
        })
        .await;
    };
    let (answers, ()) = tokio::join!(attack, drained);
    let codes = probes.await.unwrap();
    sampler.abort();
    slow.abort();
    let peak_kib = peak.load(std::sync::atomic::Ordering::Relaxed);
    let mut wrong = Vec::new();
    for (i, code) in &answers {
        if *code != Some(bodies[*i].1) {
            wrong.push((i % 13, *code));
        }
    }
    wrong.dedup();
    // Under overload a review that gets no turn within the answer deadline is told 503, and
    // on a starved machine one may miss the client's own timeout (no answer); how many
    // depends on the machine's load, so neither is counted. Nothing else is: every other
    // answer is the review's own, and every kind of hostile review got its own at least once.
    assert!(
        wrong.iter().all(|(_, c)| matches!(c, Some(503) | None)),
        "each hostile review got its answer, a 503 or (starved) none: {wrong:?}"
    );
    let kinds = bodies.len().min(13);
    let answered: std::collections::BTreeSet<usize> = answers
        .iter()
        .filter(|(i, code)| *code == Some(bodies[*i].1))
        .map(|(i, _)| i % 13)
        .collect();
    assert_eq!(
        answered.len(),
        kinds,
        "a kind of hostile review never got its own answer: answered {answered:?}"
    );
    assert!(
        codes.iter().all(|c| *c == 200),
        "/healthz answered every probe: {codes:?}"
    );
    let metrics = probe.get(format!("{base}/metrics")).send().await.unwrap();
    let metrics = metrics.text().await.unwrap();
    assert!(
        !metrics.contains("fleet=\"fleet-"),
        "no series for Fleets that do not exist"
    );
    assert!(
        metrics.len() < 256 * 1024,
        "/metrics is {} bytes",
        metrics.len()
    );
    eprintln!(
        "hostile reviews: {} sent; pubsub RSS idle {} KiB, peak {} KiB ({:.2}x); /metrics {} bytes",
        answers.len(),
        idle_kib,
        peak_kib,
        peak_kib as f64 / idle_kib as f64,
        metrics.len()
    );
    assert!(
        peak_kib < 160 * 1024,
        "pubsub's RSS peaked at {peak_kib} KiB (idle {idle_kib} KiB)"
    );
    signal(pid, "TERM").await.unwrap();
    let status = exited_within(&mut child, Duration::from_secs(10))
        .await
        .unwrap()
        .expect("exit after SIGTERM");
    assert_eq!(status.code(), Some(0));
}

// ---------------------------------------------------------------------------------------
// Redis Cluster
// ---------------------------------------------------------------------------------------

/// A real Redis Cluster (three primaries, a replica each): pubsub publishes with one
/// atomic script per instance (its keys share a slot by hash tag), every PUBLISH reaches a
/// subscriber on any node, the agent's source reads the cache from the right primary; then
/// the primary serving an instance's slot fails over to its replica in the middle of
/// publishing, and within a few cycles every instance's new status is cached and
/// published again, and the agent has it. Before, `redis+cluster://` was refused, and a
/// single-node client against a cluster failed every batch (CROSSSLOT, MOVED).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_publishes_and_survives_a_primary_failover() {
    // Each step is bounded: a step that hangs (seen once under load in CI) fails by name
    // instead of holding the whole suite.
    async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
        tokio::time::timeout(Duration::from_secs(90), f)
            .await
            .unwrap_or_else(|_| panic!("{what} hung for 90 s"))
    }
    use lastcall_testkit::redis::RedisCluster;
    let cluster = RedisCluster::start(3, 1).await.unwrap();
    let emulator = GameLiftEmulator::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let groups_file = dir.path().join("fleetiq.conf");
    write_groups(&groups_file, &["k1"]);
    let instances = ids("k1", 30);
    emulator.add_instances("k1", &instances, emu::InstanceStatus::Active);
    let pubsub = build_pubsub(&emulator, &cluster.url(), &groups_file, &[]).await;
    let target = RedisTarget::parse(&cluster.url()).unwrap();
    let keys = target.keys();
    // A subscriber on the last node, an agent's source seeded with the cluster URL.
    let last = *cluster.ports().last().unwrap();
    let sub = Subscriber::start(&format!("redis://127.0.0.1:{last}"), &instances).await;
    let agent = AgentSource::start(
        &cluster.url(),
        None,
        &instances[0],
        Duration::from_secs(1),
        None,
    );
    let ccl =
        redis::cluster::ClusterClient::new(vec![format!("redis://127.0.0.1:{last}")]).unwrap();
    let mut cconn = ccl.get_async_connection().await.unwrap();

    let r = within("the first cycle", pubsub.run_cycle()).await;
    assert_eq!((r.published, r.publish_errors), (30, 0), "{r:?}");
    within("the subscriber's 30 messages", sub.wait_for_count(30)).await;
    for iid in &instances {
        let body: Option<Vec<u8>> =
            within("a GET through the cluster", cconn.get(keys.status(iid)))
                .await
                .unwrap();
        assert_eq!(
            body.map(|b| status_of(&b)),
            Some(InstanceStatus::Active),
            "{iid}"
        );
    }
    wait_for("the agent's source has the status", || async {
        (agent.status() == Some(InstanceStatus::Active)).then_some(())
    })
    .await;

    // The primary of instance 0's slot fails over while cycles publish DRAINING.
    let primary = cluster
        .primary_of(&keys.status(&instances[0]))
        .await
        .unwrap();
    let replica = cluster.replicas_of(primary).await.unwrap()[0];
    for iid in &instances {
        emulator.set_instance_status(iid, emu::InstanceStatus::Draining);
    }
    let failover = cluster.failover(replica);
    let publishing = async {
        let mut reports = Vec::new();
        for _ in 0..3 {
            reports.push(within("a cycle during the failover", pubsub.run_cycle()).await);
        }
        reports
    };
    let (failed_over, during) = within("the failover with cycles publishing", async {
        tokio::join!(failover, publishing)
    })
    .await;
    failed_over.unwrap();
    assert_eq!(
        cluster
            .primary_of(&keys.status(&instances[0]))
            .await
            .unwrap(),
        replica
    );
    let r = wait_for("a clean cycle after the failover", || async {
        let r = within("a cycle after the failover", pubsub.run_cycle()).await;
        (r.publish_errors == 0).then_some(r)
    })
    .await;
    assert_eq!(r.published, 30, "{r:?} after {during:?}");
    for iid in &instances {
        let body: Option<Vec<u8>> =
            within("a GET through the cluster", cconn.get(keys.status(iid)))
                .await
                .unwrap();
        assert_eq!(
            body.map(|b| status_of(&b)),
            Some(InstanceStatus::Draining),
            "{iid}"
        );
    }
    let got = sub.received();
    for iid in &instances {
        assert!(
            got.iter()
                .any(|(c, b)| c == iid && status_of(b) == InstanceStatus::Draining),
            "{iid} got DRAINING on a node that serves none of its keys"
        );
    }
    wait_for("the agent's source follows the failover", || async {
        (agent.status() == Some(InstanceStatus::Draining)).then_some(())
    })
    .await;
}

/// `--publish-unchanged=false` with two overlapping replicas: A publishes ACTIVE, B then
/// DRAINING, and when the status reverts A's ACTIVE is published, because "unchanged" is
/// judged against what Redis holds. Before, A compared with what it had sent itself
/// (ACTIVE), cached the revert silently, and subscribers stayed on DRAINING.
#[tokio::test]
async fn a_revert_after_another_replicas_write_is_published_with_publish_unchanged_false() {
    let emulator = GameLiftEmulator::start().await.unwrap();
    let redis = RedisServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let groups_file = dir.path().join("fleetiq.conf");
    write_groups(&groups_file, &["c1"]);
    let quiet = ["--publish-unchanged=false"];
    let (a, _) = publisher_with(&emulator, &redis.host_port(), &groups_file, &quiet);
    let (b, _) = publisher_with(&emulator, &redis.host_port(), &groups_file, &quiet);
    let iid = ids("c1", 1).remove(0);
    let sub = Subscriber::start(&redis.url(), std::slice::from_ref(&iid)).await;
    // Each poll just before its publish: later polls, in Redis' time too.
    let out = |status| lastcall_pubsub::publisher::Outgoing {
        instance_id: iid.clone(),
        body: body(&iid, status),
        polled_at: tokio::time::Instant::now(),
    };
    // Polls far enough apart that the order of their stamps (Redis' TIME less the poll's
    // age, each uncertain by a round trip) is their real order on a loaded machine too.
    let apart = || tokio::time::sleep(std::time::Duration::from_millis(250));
    assert_eq!(
        a.publish(&[out(InstanceStatus::Active)], far())
            .await
            .published,
        1
    );
    apart().await;
    assert_eq!(
        b.publish(&[out(InstanceStatus::Draining)], far())
            .await
            .published,
        1
    );
    apart().await;
    let r = a.publish(&[out(InstanceStatus::Active)], far()).await;
    assert_eq!((r.published, r.unchanged), (1, 0), "{r:?}");
    let got = sub.wait_for_count(3).await;
    let seq: Vec<InstanceStatus> = got.iter().map(|(_, b)| status_of(b)).collect();
    assert_eq!(
        seq,
        [
            InstanceStatus::Active,
            InstanceStatus::Draining,
            InstanceStatus::Active
        ]
    );
    // And nothing is published while it stays the same.
    let r = a.publish(&[out(InstanceStatus::Active)], far()).await;
    assert_eq!((r.published, r.unchanged), (0, 1), "{r:?}");
}

/// A Redis Cluster primary that accepts connections and never answers (`CLIENT PAUSE …
/// ALL`: its packets blackholed after the handshake), under a group of 1,500 instances:
/// the cycle ends within its deadline plus one Redis timeout, under the liveness timeout,
/// and what was not written by then fails the cycle (`reason="deadline"`) instead of
/// running on. Before, publishing had no deadline and every timeout threw the whole
/// cluster connection away and connected again at once (through the silent node), so the
/// cycle ran for many minutes and the kubelet restarted pubsub.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_cluster_primary_never_runs_a_cycle_past_its_deadline() {
    use lastcall_testkit::redis::RedisCluster;
    let cluster = RedisCluster::start(3, 0).await.unwrap();
    let emulator = GameLiftEmulator::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let groups_file = dir.path().join("fleetiq.conf");
    write_groups(&groups_file, &["s1"]);
    let instances = ids("s1", 1500);
    emulator.add_instances("s1", &instances, emu::InstanceStatus::Active);
    let ports = cluster.ports();
    let liveness = Duration::from_secs(10);
    let pubsub = build_pubsub(
        &emulator,
        &cluster.url_through(&ports[..2]),
        &groups_file,
        &[
            "--period",
            "10s",
            "--cycle-deadline",
            "4s",
            "--liveness-timeout",
            "10s",
            "--redis-timeout",
            "2s",
        ],
    )
    .await;
    let r = pubsub.run_cycle().await;
    assert!(r.published > 0, "connected and publishing: {r:?}");

    let mut pause = cluster.node(ports[2]).await.unwrap();
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(120_000)
        .arg("ALL")
        .query_async(&mut pause)
        .await
        .unwrap();
    let r = tokio::time::timeout(liveness * 3, pubsub.run_cycle())
        .await
        .expect("the cycle ends");
    assert!(
        r.duration < liveness,
        "a cycle of {:?} would fail /healthz: {r:?}",
        r.duration
    );
    let m = Metrics::parse(&pubsub.metrics_text());
    assert!(
        counter(&m, "publish_errors", &[("reason", "timeout")]) >= 1.0,
        "the silent primary's instances timed out, each within one Redis timeout: {r:?}"
    );
    assert!(
        counter(&m, "publish_errors", &[("reason", "deadline")]) >= 1.0,
        "what was left at the deadline failed the cycle: {r:?}"
    );
    assert!(
        r.published > 0,
        "the answering primaries' instances were written: {r:?}"
    );
    eprintln!(
        "{r:?}\n{}",
        pubsub
            .metrics_text()
            .lines()
            .filter(|l| l.contains("publish_errors"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// On a Redis Cluster each poll is dated by the clock of the node that stores it: writing
/// an instance whose keys live on another primary first reads that primary's own `TIME`.
/// Before, one reading (from whichever node dated the first batch) dated every node's
/// writes for 30 s, so a skew between the nodes' clocks could order an older poll after a
/// newer one and drop a notice. Seen with `MONITOR` on the second primary (its clock
/// cannot be skewed here: Debian's `redis-server` does not run under libfaketime).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_redis_cluster_each_node_dates_its_own_polls() {
    use lastcall_testkit::redis::RedisCluster;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let cluster = RedisCluster::start(3, 0).await.unwrap();
    let emulator = GameLiftEmulator::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let groups_file = dir.path().join("fleetiq.conf");
    write_groups(&groups_file, &["c1"]);
    let (p, _) = publisher(&emulator, &cluster.url(), &groups_file);
    let keys = RedisTarget::parse(&cluster.url()).unwrap().keys();
    let mut on: Vec<(u16, String)> = Vec::new();
    for iid in ids("c1", 40) {
        let port = cluster.primary_of(&keys.status(&iid)).await.unwrap();
        if !on.iter().any(|(p, _)| *p == port) {
            on.push((port, iid));
        }
        if on.len() == 2 {
            break;
        }
    }
    let [(_, first), (second_port, second)] = <[(u16, String); 2]>::try_from(on).unwrap();
    // Everything the second primary executes, as it executes it.
    let mut monitor = tokio::net::TcpStream::connect(("127.0.0.1", second_port))
        .await
        .unwrap();
    monitor.write_all(b"MONITOR\r\n").await.unwrap();
    let seen = Arc::new(Mutex::new(Vec::<u8>::new()));
    let sink = seen.clone();
    let reader = tokio::spawn(async move {
        let mut buf = vec![0u8; 8192];
        while let Ok(n) = monitor.read(&mut buf).await {
            if n == 0 {
                break;
            }
            sink.lock().unwrap().extend_from_slice(&buf[..n]);
        }
    });
    let out = |iid: &str| lastcall_pubsub::publisher::Outgoing {
        instance_id: iid.to_string(),
        body: body(iid, InstanceStatus::Active),
        polled_at: tokio::time::Instant::now(),
    };
    assert_eq!(p.publish(&[out(&first)], far()).await.published, 1);
    assert_eq!(p.publish(&[out(&second)], far()).await.published, 1);
    let status_key = keys.status(&second);
    let polled_at_key = keys.polled_at(&second);
    // The write (the script naming the polled-at key) is on the monitor, so everything
    // before it is too.
    let text = wait_for("the second primary ran the write", || async {
        let text = String::from_utf8_lossy(&seen.lock().unwrap()).into_owned();
        text.contains(polled_at_key.as_str()).then_some(text)
    })
    .await;
    let lines: Vec<&str> = text.lines().filter(|l| l.contains(&status_key)).collect();
    assert!(
        !lines[0].contains(polled_at_key.as_str()),
        "the first command for {second} on its node reads that node's clock, before the write: {lines:?}"
    );
    reader.abort();
}
