//! Hard deadlines end to end: `eviction.safe` × cause on an emulated node with a Terminate
//! deadline, checked against the emulator's journal: which game-server pods got their
//! graceful termination (SIGTERM: a pod DELETE preconditioned on its uid, never an
//! Eviction), and when, relative to `deadline − grace` and the deadline.
//!
//! One node, three Allocated servers of three Fleets (`Never`, `OnUpgrade`, `Always`), a
//! 2 s termination grace period, and a test-only source (`support/scripted.rs`) that says
//! "Terminate at now + 5 s" with the cause under test. Each ending request is set against
//! the deadline by the time the API server's journal gives it: a graceful termination
//! starts at `deadline − grace`, not before, and before the machine goes (with a resync of
//! 5 s, only the agent waking for that moment itself makes it in time); the matches the case
//! keeps are still untouched after passes that followed.
//!
//! And a deadline that stops being true ends nothing: an AWS scheduled event (from the IMDS
//! emulator) or an Azure Spot eviction (`Preempt`, from the Azure emulator: it cannot be
//! withdrawn, but the platform may postpone it) moved later is not acted on at its old
//! `deadline − grace`, judged after passes the agent ran once that moment had come.

#[path = "support/scripted.rs"]
mod scripted;

#[path = "support/passes.rs"]
mod passes;
use passes::after_passes;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use lastcall_agent::notice::{Cause, Notice, Severity};
use lastcall_emulators::azure::{AzureMetadataEmulator, event as azure_event};
use lastcall_testkit::agent::{InProcessAgent, config, metric};
use lastcall_testkit::cluster::{
    AllocationRequest, Cluster, ClusterConfig, EvictionSafe, FleetSpec, NodeSpec,
};
use lastcall_testkit::eventually::wait_for;
use lastcall_testkit::imds::ImdsEmulator;
use lastcall_testkit::kube::journal::JournalEntry;
use lastcall_testkit::promises::graceful::{PodFacts, assert_graceful, ends_a_match, evictions};

const GRACE: i64 = 2;
const LEAD: i64 = 5;
/// The agents' resync: longer than the grace period, so that only an agent that wakes for
/// `deadline − grace` itself ends a match before the deadline.
const RESYNC: &str = "5s";

struct Case {
    cause: Cause,
    graceful_termination: bool,
    /// The Fleets whose match must get its graceful termination.
    ended: &'static [&'static str],
}

/// The agent's requests that started a pod's graceful termination, by pod name.
fn sigterms(entries: &[JournalEntry]) -> BTreeMap<String, Vec<&JournalEntry>> {
    let mut out: BTreeMap<String, Vec<&JournalEntry>> = BTreeMap::new();
    for e in entries
        .iter()
        .filter(|e| e.identity.as_deref() == Some("agent-n1") && ends_a_match(e))
    {
        out.entry(e.name.clone().unwrap_or_default())
            .or_default()
            .push(e);
    }
    out
}

/// How much earlier than the deadline a pod ended gracefully may end (the agent's own
/// wake-up at `deadline − grace` is timed on the same clock as the test's deadline).
const ENDS_EARLY_BY: Duration = Duration::from_millis(100);

/// The stored pods, by name.
async fn stored_pods(pods: &Api<Pod>) -> BTreeMap<String, serde_json::Value> {
    pods.list(&Default::default())
        .await
        .expect("pods")
        .items
        .into_iter()
        .map(|p| {
            (
                p.metadata.name.clone().unwrap_or_default(),
                serde_json::to_value(p).expect("a pod as JSON"),
            )
        })
        .collect()
}

async fn run(case: &Case) {
    let cluster = Cluster::start(ClusterConfig::default())
        .await
        .expect("cluster");
    cluster.add_node(NodeSpec::new("n1")).expect("n1");
    let fleets = [
        ("never", EvictionSafe::Never),
        ("upgrade", EvictionSafe::OnUpgrade),
        ("always", EvictionSafe::Always),
    ];
    for (name, safe) in fleets {
        cluster
            .create_fleet(
                FleetSpec::new(name, 1)
                    .eviction_safe(safe)
                    .grace_seconds(GRACE),
            )
            .expect("fleet");
        cluster.wait_ready("default", name, 1).await.expect("ready");
        cluster
            .allocate(&AllocationRequest::fleet("default", name))
            .await
            .expect("allocate")
            .expect("an allocated server");
    }
    let fleet_of: BTreeMap<String, String> = cluster
        .game_servers()
        .into_iter()
        .filter_map(|g| Some((g.name.clone(), g.labels.get("agones.dev/fleet")?.clone())))
        .collect();
    let mut flags = vec!["--resync-interval", RESYNC];
    if case.graceful_termination {
        flags.push("--graceful-termination");
    }
    let kube = cluster
        .emulator()
        .config_for("agent-n1")
        .await
        .expect("client");
    let agent =
        InProcessAgent::start_with_sources(config("n1", &flags), kube, None, vec![scripted::LINE])
            .await
            .expect("agent");
    wait_for("claimed", || async {
        cluster
            .game_servers()
            .iter()
            .all(|g| g.labels.get("lastcall.dev/node").map(String::as_str) == Some("n1"))
            .then_some(())
    })
    .await;
    let pods: Api<Pod> = Api::namespaced(cluster.client(), "default");
    let pods_before: BTreeMap<String, PodFacts> = stored_pods(&pods)
        .await
        .iter()
        .filter_map(|(name, p)| Some((name.clone(), PodFacts::of(p)?)))
        .collect();

    let deadline = jiff::Timestamp::now() + jiff::SignedDuration::from_secs(LEAD);
    scripted::say(vec![Notice::new(
        scripted::SOURCE,
        case.cause,
        Severity::Terminate,
        Some(deadline),
        false,
        "the test's hard deadline".into(),
    )]);
    // Each match the case ends asked to end, by the journal; read at once, before any grace
    // period has run out: each pod ended gracefully is still terminating.
    let asked = |fleet: &str| {
        let pod = fleet_of
            .iter()
            .find(|(_, f)| f.as_str() == fleet)
            .map(|(p, _)| p);
        cluster.emulator().journal().count(|e| {
            e.identity.as_deref() == Some("agent-n1")
                && ends_a_match(e)
                && e.status < 300
                && e.name.as_ref() == pod
        }) > 0
    };
    wait_for("every match the case ends asked to end", || async {
        case.ended.iter().all(|f| asked(f)).then_some(())
    })
    .await;
    let pods_after = stored_pods(&pods).await;
    // Passes after those: the agent's chance to end a match the case keeps.
    after_passes(&agent, 2).await;
    let m = agent.metrics().await;
    agent.stop().await.expect("clean stop");
    scripted::say(vec![]);

    let entries = cluster.emulator().journal().entries();
    // One fence. (A record the agent could not read back once made it write the Node again
    // on every pass: thousands of PATCHes in these few seconds.)
    let node_writes = entries
        .iter()
        .filter(|e| {
            e.identity.as_deref() == Some("agent-n1")
                && e.verb.is_mutating()
                && e.resource.as_deref() == Some("nodes")
        })
        .count();
    assert!(
        (1..=2).contains(&node_writes),
        "{:?}: {node_writes} Node writes",
        case.cause
    );
    let terms = sigterms(&entries);
    let ended: BTreeSet<&str> = terms
        .iter()
        .filter(|(_, reqs)| reqs.iter().any(|r| r.status < 300))
        .map(|(pod, _)| fleet_of[pod].as_str())
        .collect();
    let want: BTreeSet<&str> = case.ended.iter().copied().collect();
    assert_eq!(
        ended, want,
        "{:?}, --graceful-termination {}: {terms:#?}",
        case.cause, case.graceful_termination
    );
    // When each took effect, by the API server's journal, against the deadline.
    let due = std::time::SystemTime::from(deadline - jiff::SignedDuration::from_secs(GRACE));
    let gone = std::time::SystemTime::from(deadline);
    for (pod, reqs) in &terms {
        for r in reqs {
            assert!(
                r.at + ENDS_EARLY_BY >= due,
                "{pod}: graceful termination started before deadline − grace ({:?})",
                case.cause
            );
            assert!(
                r.at < gone,
                "{pod}: graceful termination started after the deadline ({:?}): the agent did not wake for deadline − grace",
                case.cause
            );
        }
    }
    // No Eviction at all: a budget is not asked at a hard deadline (`Never` pods are under
    // Agones' 0% PodDisruptionBudget here, and still end under --graceful-termination).
    let evicted = evictions(&entries, "agent-n1");
    assert!(
        evicted.is_empty(),
        "{:?}, --graceful-termination {}: the agent sent Evictions: {evicted:#?}",
        case.cause,
        case.graceful_termination
    );
    // The pods lastcall ended really are terminating, with their own grace period (every
    // pod DELETE preconditioned on the pod's uid, no grace override, no pod ending before
    // the deadline); the others are untouched.
    assert_graceful(
        &entries,
        "agent-n1",
        &pods_before,
        &pods_after,
        deadline.into(),
        ENDS_EARLY_BY,
    );
    for (name, fleet) in &fleet_of {
        let p = pods_after
            .get(name)
            .unwrap_or_else(|| panic!("{fleet}'s pod is gone: killed, not ended"));
        assert_eq!(
            p["metadata"]["deletionTimestamp"].is_string(),
            want.contains(fleet.as_str()),
            "{fleet}'s pod"
        );
    }
    // A `Never` match that may not be ended counts as at risk.
    let at_risk = 3 - want.len();
    assert_eq!(
        metric(&m, "lastcall_matches_at_risk", &[]),
        Some(at_risk as f64),
        "{:?}",
        case.cause
    );
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_safe_by_cause_decides_which_matches_get_sigterm_and_when() {
    // One test, run in order: the scripted source is process-wide.
    for case in [
        Case {
            cause: Cause::Maintenance,
            graceful_termination: false,
            ended: &["upgrade", "always"],
        },
        Case {
            cause: Cause::ScaleDown,
            graceful_termination: false,
            ended: &["always"],
        },
        Case {
            cause: Cause::ScaleDown,
            graceful_termination: true,
            ended: &["never", "upgrade", "always"],
        },
    ] {
        run(&case).await;
    }
}

/// `NotBefore` as IMDS writes it (to the second).
fn not_before(t: jiff::Timestamp) -> String {
    t.strftime("%-d %b %Y %H:%M:%S GMT").to_string()
}

fn instance_stop(at: jiff::Timestamp) -> serde_json::Value {
    serde_json::json!([{
        "Code": "instance-stop",
        "Description": "The instance is scheduled for stop",
        "EventId": "instance-event-0d59937288b749b32",
        "NotBefore": not_before(at),
        "State": "active",
    }])
}

/// A provider whose notice the test moves later: where the agent reads it, and how.
enum Provider {
    Imds(ImdsEmulator),
    Azure(AzureMetadataEmulator),
}

impl Provider {
    async fn start(azure: bool) -> Provider {
        if azure {
            Provider::Azure(AzureMetadataEmulator::start(AZURE_VM).await.expect("azure"))
        } else {
            Provider::Imds(
                ImdsEmulator::start("i-0123456789abcdef0", "ip-10-0-0-1.ec2.internal")
                    .await
                    .expect("imds"),
            )
        }
    }

    fn flags(&self) -> Vec<String> {
        let flags = match self {
            Provider::Imds(imds) => vec![
                "--aws-imds".to_string(),
                "--imds-endpoint".into(),
                imds.url(),
                "--aws-imds-interval".into(),
                "200ms".into(),
            ],
            Provider::Azure(azure) => vec![
                "--azure-events".to_string(),
                "--azure-metadata-endpoint".into(),
                azure.url(),
                "--azure-events-interval".into(),
                "200ms".into(),
            ],
        };
        [flags, vec!["--resync-interval".into(), "1s".into()]].concat()
    }

    /// The instance stops (IMDS) or is evicted (Azure `Preempt`) at `at`.
    fn schedule(&self, at: jiff::Timestamp) {
        match self {
            Provider::Imds(imds) => imds.set_scheduled_events(instance_stop(at)),
            Provider::Azure(azure) => azure.set_events(vec![azure_event(
                "preempt-1",
                "Preempt",
                AZURE_VM,
                &at.strftime("%a, %d %b %Y %H:%M:%S GMT").to_string(),
            )]),
        }
    }

    /// Successful reads of the notice document so far.
    fn reads(&self) -> usize {
        match self {
            Provider::Imds(imds) => imds
                .requests()
                .iter()
                .filter(|(m, path, status)| {
                    m == "GET" && path.ends_with("/events/maintenance/scheduled") && *status == 200
                })
                .count(),
            Provider::Azure(azure) => azure
                .requests()
                .iter()
                .filter(|r| {
                    r.method == "GET" && r.path == "/metadata/scheduledevents" && r.status == 200
                })
                .count(),
        }
    }
}

const AZURE_VM: &str = "aks-games-12345678-vmss_0";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduled_event_moved_later_ends_no_match_at_its_old_deadline() {
    moved_later(false).await;
}

/// An Azure Spot eviction cannot be withdrawn, but the platform may postpone it: its new
/// `NotBefore` is the deadline (the timeline found the old one kept, seed 1495).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_azure_spot_eviction_postponed_ends_no_match_at_its_old_deadline() {
    moved_later(true).await;
}

async fn moved_later(azure: bool) {
    const OLD_LEAD: i64 = 12;
    let cluster = Cluster::start(ClusterConfig::default())
        .await
        .expect("cluster");
    cluster.add_node(NodeSpec::new("n1")).expect("n1");
    cluster
        .create_fleet(
            FleetSpec::new("upgrade", 1)
                .eviction_safe(EvictionSafe::OnUpgrade)
                .grace_seconds(GRACE),
        )
        .expect("fleet");
    cluster
        .wait_ready("default", "upgrade", 1)
        .await
        .expect("ready");
    cluster
        .allocate(&AllocationRequest::fleet("default", "upgrade"))
        .await
        .expect("allocate")
        .expect("an allocated server");
    let provider = Provider::start(azure).await;
    let flags = provider.flags();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let kube = cluster
        .emulator()
        .config_for("agent-n1")
        .await
        .expect("client");
    let agent = InProcessAgent::start(config("n1", &flags), kube, None)
        .await
        .expect("agent");
    wait_for("claimed", || async {
        cluster
            .game_servers()
            .iter()
            .all(|g| g.labels.get("lastcall.dev/node").map(String::as_str) == Some("n1"))
            .then_some(())
    })
    .await;
    let announced = || {
        cluster
            .game_servers()
            .iter()
            .find_map(|g| g.annotations.get("lastcall.dev/drain-deadline").cloned())
    };
    let to_second = |t: jiff::Timestamp| jiff::Timestamp::from_second(t.as_second()).expect("ts");
    let rfc3339 = |t: jiff::Timestamp| t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string();

    // Monday: the instance stops in OLD_LEAD seconds.
    let t0 = jiff::Timestamp::now();
    let monday = to_second(t0 + jiff::SignedDuration::from_secs(OLD_LEAD));
    provider.schedule(monday);
    wait_for("Monday announced to the game", || async {
        (announced() == Some(rfc3339(monday))).then_some(())
    })
    .await;
    // The provider reschedules it to Saturday; the game is told.
    let saturday = monday + jiff::SignedDuration::from_hours(5 * 24);
    let before = provider.reads();
    provider.schedule(saturday);
    wait_for("the agent read the move twice", || async {
        (provider.reads() >= before + 2).then_some(())
    })
    .await;
    wait_for("Saturday announced to the game", || async {
        (announced() == Some(rfc3339(saturday))).then_some(())
    })
    .await;
    // The move told before Monday's deadline − grace, by the journal: else this run says
    // nothing of the old deadline.
    let old_due = std::time::SystemTime::from(monday - jiff::SignedDuration::from_secs(GRACE));
    let told = cluster
        .emulator()
        .journal()
        .filter(|e| {
            e.identity.as_deref() == Some("agent-n1")
                && e.resource.as_deref() == Some("gameservers")
                && e.response.as_deref().is_some_and(|v| {
                    v["metadata"]["annotations"]["lastcall.dev/drain-deadline"]
                        == rfc3339(saturday).as_str()
                })
        })
        .first()
        .map(|e| e.at)
        .expect("the move written");
    assert!(
        told < old_due,
        "the move must land before Monday's deadline − grace for this test to mean anything"
    );
    // Monday's deadline − grace comes, then passes after it: the agent's chance to act on
    // the old date.
    wait_for("Monday's deadline − grace", || async {
        (std::time::SystemTime::now() >= old_due).then_some(())
    })
    .await;
    after_passes(&agent, 2).await;
    agent.stop().await.expect("clean stop");

    let entries = cluster.emulator().journal().entries();
    let terms = sigterms(&entries);
    let ended: Vec<_> = terms.values().flatten().collect();
    assert!(
        ended.is_empty(),
        "a match was ended on the old date: {ended:#?}"
    );
    let pods: Api<Pod> = Api::namespaced(cluster.client(), "default");
    for p in pods.list(&Default::default()).await.expect("pods").items {
        assert!(
            p.metadata.deletion_timestamp.is_none(),
            "{:?} is terminating",
            p.metadata.name
        );
    }
    assert_eq!(
        announced(),
        Some(rfc3339(saturday)),
        "the game is told the new date"
    );
    cluster.shutdown().await;
}

/// A match due to end at `deadline − grace` whose pod DELETE the API server turns away with
/// 429 (API Priority and Fairness: a plain-text body and `Retry-After`): the agent waits out
/// the `Retry-After` and sends the same preconditioned DELETE again. Ordered by the journal:
/// the throttled DELETE, then an accepted one no earlier than `Retry-After` after it (the
/// server's own times); no Eviction of the agent's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_throttled_by_the_api_server_is_sent_again_after_retry_after() {
    use lastcall_testkit::kube::faults::{FaultRule, Method};
    const RETRY_AFTER: Duration = Duration::from_secs(1);
    let cluster = Cluster::start(ClusterConfig::default())
        .await
        .expect("cluster");
    cluster.add_node(NodeSpec::new("n1")).expect("n1");
    cluster
        .create_fleet(
            FleetSpec::new("always", 1)
                .eviction_safe(EvictionSafe::Always)
                .grace_seconds(GRACE),
        )
        .expect("fleet");
    cluster
        .wait_ready("default", "always", 1)
        .await
        .expect("ready");
    cluster
        .allocate(&AllocationRequest::fleet("default", "always"))
        .await
        .expect("allocate")
        .expect("an allocated server");
    let imds = ImdsEmulator::start("i-0123456789abcdef0", "n1")
        .await
        .expect("imds");
    let url = imds.url();
    let flags = [
        "--resync-interval",
        "1s",
        "--aws-imds",
        "--imds-endpoint",
        &url,
    ];
    let kube = cluster
        .emulator()
        .config_for("agent-n1")
        .await
        .expect("client");
    let agent = InProcessAgent::start(config("n1", &flags), kube, None)
        .await
        .expect("agent");
    wait_for("claimed", || async {
        cluster
            .game_servers()
            .iter()
            .all(|g| g.labels.get("lastcall.dev/node").map(String::as_str) == Some("n1"))
            .then_some(())
    })
    .await;
    let pods: Api<Pod> = Api::namespaced(cluster.client(), "default");
    let before: BTreeMap<String, PodFacts> = stored_pods(&pods)
        .await
        .iter()
        .filter_map(|(name, p)| Some((name.clone(), PodFacts::of(p)?)))
        .collect();
    // The next pod DELETE is turned away by APF.
    cluster.emulator().faults().inject(FaultRule::throttle(
        Some(Method::DELETE),
        "/pods/",
        1,
        RETRY_AFTER,
    ));
    // A Spot interruption LEAD s from now (to the second, as IMDS says it).
    let deadline = (jiff::Timestamp::now() + jiff::SignedDuration::from_secs(LEAD))
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string();
    imds.set_spot_action(Some(
        serde_json::json!({"action": "terminate", "time": deadline}),
    ));
    let deadline: jiff::Timestamp = deadline.parse().expect("a timestamp");
    let journal = cluster.emulator().journal();
    let by_agent =
        || journal.filter(|e| e.identity.as_deref() == Some("agent-n1") && ends_a_match(e));
    wait_for("a pod DELETE accepted", || async {
        by_agent().iter().any(|e| e.status < 300).then_some(())
    })
    .await;
    let pods_after = stored_pods(&pods).await;
    agent.stop().await.expect("clean stop");
    let entries = journal.entries();
    let evicted = evictions(&entries, "agent-n1");
    assert!(evicted.is_empty(), "the agent sent Evictions: {evicted:#?}");
    let ends = by_agent();
    let throttled = ends
        .iter()
        .find(|e| e.status == 429)
        .expect("the first DELETE was throttled");
    let accepted = ends.iter().find(|e| e.status < 300).expect("accepted");
    assert!(throttled.seq < accepted.seq, "{ends:#?}");
    assert!(
        accepted.at.duration_since(throttled.at).unwrap_or_default() >= RETRY_AFTER,
        "sent again before its Retry-After: {ends:#?}"
    );
    // The accepted DELETE names the pod's uid and overrides no grace (the throttled one was
    // turned away before its body was read), and the pod ends gracefully.
    assert_graceful(
        &entries,
        "agent-n1",
        &before,
        &pods_after,
        deadline.into(),
        ENDS_EARLY_BY,
    );
    cluster.shutdown().await;
}
