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
use lastcall_common::fleetiq::{InstanceStatus, StatusMessage, cache_key};
use lastcall_pubsub::{Config, CycleReport, Pubsub, gamelift_client};
use lastcall_testkit::eventually::{eventually, wait_for};
use lastcall_testkit::gamelift::{self as emu, GameLiftEmulator, Malformed};
use lastcall_testkit::redis::RedisServer;
use redis::AsyncCommands;

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
        report.redis_round_trips, 3,
        "one pipelined round trip per group"
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
    assert_eq!(counter(&m, "redis_round_trips", &[("result", "ok")]), 3.0);
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

    let report = h.cycle().await;
    assert_eq!(
        report.groups_failed, 1,
        "only the unknown group fails: {report:?}"
    );
    assert_eq!(
        report.invalid_instances, 9,
        "first entry of each of 3 pages in 3 groups"
    );
    assert_eq!(report.instances, 45 + 3 * 42);
    assert_eq!(report.published, 45 + 3 * 42);

    let got = sub.wait_for_count(45).await;
    assert_eq!(
        per_channel(&got).len(),
        45,
        "the good group is fully published"
    );

    let mut conn = h.redis().await;
    for g in ["bad-status", "no-status"] {
        let group = ids(g, 45);
        for (i, iid) in group.iter().enumerate() {
            let cached: Option<String> = conn.get(cache_key(iid)).await.unwrap();
            let corrupted = i % 20 == 0;
            assert_eq!(cached.is_none(), corrupted, "{iid}");
        }
    }
    let m = h.metrics();
    for reason in ["unknown_status", "missing_instance_id", "missing_status"] {
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
// The binary
// ---------------------------------------------------------------------------------------

/// The `lastcall-pubsub` binary, built on first use. A bin of another workspace crate is
/// not built for this test target, so it is built here with the same cargo and target dir
/// (a no-op when up to date), and found next to this test's `deps/` directory.
fn pubsub_binary() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let exe = std::env::current_exe().unwrap();
            let profile_dir = exe.parent().and_then(Path::parent).unwrap().to_path_buf();
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let mut cmd = std::process::Command::new(cargo);
            cmd.args(["build", "-p", "lastcall-pubsub", "--bin", "lastcall-pubsub"])
                .current_dir(env!("CARGO_MANIFEST_DIR"));
            if profile_dir.file_name().is_some_and(|n| n == "release") {
                cmd.arg("--release");
            }
            if let (None, Some(target)) =
                (std::env::var_os("CARGO_TARGET_DIR"), profile_dir.parent())
            {
                cmd.env("CARGO_TARGET_DIR", target);
            }
            let status = cmd
                .status()
                .expect("running cargo build for lastcall-pubsub");
            assert!(status.success(), "cargo build -p lastcall-pubsub failed");
            let bin = profile_dir.join("lastcall-pubsub");
            assert!(bin.is_file(), "{} missing after the build", bin.display());
            bin
        })
        .clone()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A command for the binary with a clean environment: nothing from the developer's shell
/// (REDIS_URL, AWS_*, RUST_LOG) leaks in.
fn pubsub_command(home: &Path) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(pubsub_binary());
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
        "FLEETIQ_CONFIG",
        "REDIS_URL",
        "AWS_REGION",
        "AWS_ENDPOINT_URL_GAMELIFT",
    ] {
        assert!(help.contains(flag), "--help does not document {flag}");
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

    let pid = child.id().unwrap().to_string();
    let kill = tokio::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await
        .unwrap();
    assert!(kill.success());
    let status = eventually(
        "exit after SIGTERM",
        Duration::from_secs(5),
        Duration::from_millis(20),
        || {
            let status = child.try_wait().unwrap();
            async move { status }
        },
    )
    .await;
    assert_eq!(status.code(), Some(0), "clean exit on SIGTERM");
}
