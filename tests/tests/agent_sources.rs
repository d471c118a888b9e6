//! Every signal family through the one reconciler: GCE metadata, AWS IMDS and Azure
//! Scheduled Events (against their emulators), Node signals (Karpenter, cluster autoscaler, GKE labels, manual), and several at once.

use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};
use lastcall_common::fleetiq::InstanceStatus as Status;
use lastcall_testkit::agent::{InProcessAgent, metric};
use lastcall_testkit::cluster::GameServerState as S;
use lastcall_testkit::cluster::fixtures::taint;
use lastcall_testkit::eventually::{eventually, wait_for};
use lastcall_testkit::gce::GceMetadataEmulator;
use lastcall_testkit::imds::ImdsEmulator;
use lastcall_testkit::kube::faults::{FaultRule, Method};
use lastcall_testkit::kube::journal::Verb;
use lastcall_testkit::world::{IID, NODE, World, WorldSpec, cordoned, has_taint, subscribed};

#[path = "support/passes.rs"]
mod passes;
use passes::after_passes;

async fn gce_agent(w: &World, gce: &GceMetadataEmulator, extra: &[&str]) -> InProcessAgent {
    let url = gce.url();
    let mut args: Vec<&str> = vec![
        "--gce-metadata",
        "--gce-metadata-endpoint",
        &url,
        "--gce-wait-timeout",
        "2s",
        "--resync-interval",
        "1s",
    ];
    args.extend_from_slice(extra);
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    w.start_agent(&args).await
}

fn idle_released(w: &World) -> Option<()> {
    w.on(NODE)
        .iter()
        .all(|g| g.deleting || g.state == Some(S::Allocated))
        .then_some(())
}

async fn readyz(agent: &InProcessAgent) -> serde_json::Value {
    let r = reqwest::get(format!("http://{}/readyz", agent.admin))
        .await
        .unwrap();
    r.json().await.unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gce_terminate_fences_from_the_hanging_get_and_none_restores_the_node() {
    let w = World::start(WorldSpec::new(2, 1, 0)).await;
    let gce = GceMetadataEmulator::start().await.unwrap();
    let agent = gce_agent(&w, &gce, &[]).await;
    w.claimed_all().await;
    wait_for("hanging GETs in place", || async {
        (gce.requests().iter().filter(|(_, _, wait)| *wait).count() >= 2).then_some(())
    })
    .await;
    let reads_before = gce.requests().len();
    gce.set("maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE");
    wait_for("fenced", || async {
        let n = w.node().await;
        (cordoned(&n) && has_taint(&n, "lastcall.dev/draining")).then_some(())
    })
    .await;
    // The change arrived on the hanging GET already open: no new read was needed.
    let event_reads = gce.requests()[..]
        .iter()
        .skip(reads_before)
        .filter(|(k, _, _)| k == "maintenance-event")
        .count();
    // (One new hanging GET after the answer; a second only if a 2 s wait timed out just then.)
    assert!(event_reads <= 2, "{event_reads} reads after the change");
    assert!(
        gce.requests().iter().all(|(_, flavor, _)| *flavor),
        "Metadata-Flavor always sent"
    );
    wait_for("idle released", || async { idle_released(&w) }).await;
    gce.set("maintenance-event", "NONE");
    wait_for("cancelled and restored", || async {
        let n = w.node().await;
        (!cordoned(&n) && !has_taint(&n, "lastcall.dev/draining")).then_some(())
    })
    .await;
    agent.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gce_live_migration_with_503_blips_changes_nothing() {
    let w = World::start(WorldSpec::new(2, 1, 0)).await;
    let gce = GceMetadataEmulator::start().await.unwrap();
    let agent = gce_agent(&w, &gce, &[]).await;
    w.claimed_all().await;
    let j = w.cluster.emulator().journal();
    let mutating = || {
        j.count(|r| {
            r.identity.as_deref() == Some("agent-n1")
                && r.verb.is_mutating()
                && r.resource.as_deref() != Some("events")
        })
    };
    let before = mutating();
    gce.fail_next(3);
    gce.set("maintenance-event", "MIGRATE_ON_HOST_MAINTENANCE");
    wait_for("migration seen", || async {
        let m = agent.metrics().await;
        (metric(
            &m,
            "lastcall_signals_total",
            &[("source", "gce_metadata"), ("status", "migrate")],
        ) >= Some(1.0))
        .then_some(())
    })
    .await;
    // Blips answered while the migration is known, passes after them; then the migration
    // over, read, and passes after that.
    let asked = gce.requests().len();
    gce.fail_next(2);
    wait_for("both blips answered", || async {
        (gce.requests().len() >= asked + 2).then_some(())
    })
    .await;
    after_passes(&agent, 2).await;
    let reads = gce.reads("maintenance-event").len();
    gce.set("maintenance-event", "NONE");
    wait_for("the migration's end read", || async {
        (gce.reads("maintenance-event").len() > reads).then_some(())
    })
    .await;
    after_passes(&agent, 2).await;
    assert_eq!(
        mutating(),
        before,
        "a live migration made a mutating request"
    );
    assert!(!cordoned(&w.node().await));
    agent.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gce_preemption_releases_every_idle_server_at_once() {
    let w = World::start(WorldSpec::new(6, 1, 0)).await;
    let gce = GceMetadataEmulator::start().await.unwrap();
    let agent = gce_agent(&w, &gce, &[]).await;
    w.claimed_all().await;
    // Every DELETE is held unanswered: released at once, all six are in flight together;
    // released one after another, only one ever is.
    w.cluster
        .emulator()
        .faults()
        .inject(FaultRule::hang(Some(Method::DELETE), "/gameservers/", 6));
    gce.set("preempted", "TRUE");
    wait_for("all six DELETEs in flight together", || async {
        (w.cluster.emulator().faults().hung_now() == 6).then_some(())
    })
    .await;
    w.cluster.emulator().faults().release_hangs();
    eventually(
        "every idle server released within 5 s",
        Duration::from_secs(5),
        Duration::from_millis(20),
        || async { idle_released(&w) },
    )
    .await;
    // The match is told why; that write follows the releases.
    wait_for("the match is told why", || async {
        (w.allocated()
            .annotations
            .get("lastcall.dev/drain-reason")
            .map(String::as_str)
            == Some("preemption"))
        .then_some(())
    })
    .await;
    let j = w.cluster.emulator().journal();
    let deletes = j.filter(|r| r.verb == Verb::Delete && r.identity.as_deref() == Some("agent-n1"));
    assert_eq!(deletes.len(), 6, "one DELETE per idle server");
    assert!(deletes.iter().all(|r| r.status < 300), "{deletes:#?}");
    agent.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_already_pending_at_start_is_acted_on() {
    let w = World::start(WorldSpec::new(1, 1, 0)).await;
    let gce = GceMetadataEmulator::start().await.unwrap();
    gce.set("maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE");
    let agent = gce_agent(&w, &gce, &[]).await;
    wait_for("fenced at start", || async {
        has_taint(&w.node().await, "lastcall.dev/draining").then_some(())
    })
    .await;
    wait_for("idle released", || async { idle_released(&w) }).await;
    agent.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_metadata_server_degrades_gce_only() {
    let w = World::start(WorldSpec::new(2, 1, 0)).await;
    let gce = GceMetadataEmulator::start().await.unwrap();
    gce.set_unreachable(true).await.unwrap();
    let mut args = w.fleetiq_args();
    args.extend(
        [
            "--instance-id",
            lastcall_testkit::world::IID,
            "--gce-metadata",
            "--gce-metadata-endpoint",
            &gce.url(),
        ]
        .map(String::from),
    );
    let agent = w.start_agent(&args).await;
    subscribed(&agent).await;
    wait_for("degraded reported", || async {
        let r = readyz(&agent).await;
        r["gce_metadata"]["detail"]
            .as_str()
            .is_some_and(|d| d.starts_with("degraded"))
            .then_some(())
    })
    .await;
    let m = agent.metrics().await;
    assert_eq!(
        metric(&m, "lastcall_source_up", &[("source", "gce_metadata")]),
        Some(0.0)
    );
    // FleetIQ still drains the node.
    w.claimed_all().await;
    w.status(Status::Draining).await;
    wait_for("FleetIQ drain goes on", || async {
        has_taint(&w.node().await, "lastcall.dev/draining").then_some(())
    })
    .await;
    wait_for("idle released", || async { idle_released(&w) }).await;
    assert_eq!(
        metric(
            &agent.metrics().await,
            "lastcall_source_up",
            &[("source", "gce_metadata")]
        ),
        Some(0.0)
    );
    agent.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn karpenter_and_fleetiq_together_make_one_drain_without_a_second_cordon() {
    let w = World::start(WorldSpec::new(2, 1, 0)).await;
    let agent = w.agent(&[]).await;
    subscribed(&agent).await;
    w.claimed_all().await;
    w.cluster
        .add_taint(NODE, taint("karpenter.sh/disrupted", "", "NoSchedule"))
        .unwrap();
    wait_for("game-server work under Karpenter's taint", || async {
        idle_released(&w)
    })
    .await;
    let n = w.node().await;
    assert!(
        !cordoned(&n),
        "Karpenter keeps pods off itself: no cordon on top"
    );
    assert!(has_taint(&n, "lastcall.dev/draining"));
    w.status(Status::SpotTerminating).await;
    wait_for("the Spot deadline is announced", || async {
        w.allocated()
            .annotations
            .get("lastcall.dev/drain-reason")
            .is_some_and(|r| r == "preemption")
            .then_some(())
    })
    .await;
    let node_events = Api::<k8s_openapi::api::events::v1::Event>::all(w.cluster.client())
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("DrainStarted"))
        .count();
    assert_eq!(node_events, 1, "one drain, one DrainStarted");
    agent.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gke_scheduled_maintenance_drains_from_the_lead_time() {
    let w = World::start(WorldSpec::new(1, 1, 0)).await;
    let agent = w
        .start_agent(&[
            "--resync-interval".into(),
            "1s".into(),
            "--maintenance-lead".into(),
            "1h".into(),
        ])
        .await;
    w.claimed_all().await;
    let client = w.cluster.client();
    let set = |epoch: i64| {
        let client = client.clone();
        async move {
            Api::<Node>::all(client)
            .patch(
                NODE,
                &PatchParams::default(),
                &Patch::Merge(&serde_json::json!({"metadata": {"labels": {"cloud.google.com/scheduled-maintenance-time": epoch.to_string()}}})),
            )
            .await
            .unwrap();
        }
    };
    let now = jiff::Timestamp::now().as_second();
    set(now + 3 * 3600).await;
    // Seen (a pass planned with it, outside the lead), and passes after it.
    wait_for("the maintenance time observed", || async {
        (source_notices(&agent.metrics().await, "gke", "observe") == Some(1.0)).then_some(())
    })
    .await;
    after_passes(&agent, 2).await;
    assert!(
        !has_taint(&w.node().await, "lastcall.dev/draining"),
        "3 h out: not yet"
    );
    set(now + 1800).await;
    wait_for("inside the lead: drained", || async {
        has_taint(&w.node().await, "lastcall.dev/draining").then_some(())
    })
    .await;
    let deadline = wait_for("deadline announced", || async {
        w.allocated()
            .annotations
            .get("lastcall.dev/drain-deadline")
            .cloned()
    })
    .await;
    let expected = jiff::Timestamp::from_second(now + 1800)
        .unwrap()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string();
    assert_eq!(deadline, expected, "the window start is the deadline");
    agent.stop().await.unwrap();
}

async fn imds_agent(w: &World, imds: &ImdsEmulator, extra: &[&str]) -> InProcessAgent {
    let url = imds.url();
    let mut args: Vec<&str> = vec![
        "--aws-imds",
        "--imds-endpoint",
        &url,
        "--aws-imds-interval",
        "200ms",
        "--resync-interval",
        "1s",
    ];
    args.extend_from_slice(extra);
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    w.start_agent(&args).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spot_interruption_from_imds_releases_idle_servers_with_its_deadline() {
    let w = World::start(WorldSpec::new(4, 1, 0)).await;
    let imds = ImdsEmulator::start(IID, "ip-10-0-0-1.ec2.internal")
        .await
        .unwrap();
    let agent = imds_agent(&w, &imds, &[]).await;
    w.claimed_all().await;
    let time = "2030-01-01T00:02:00Z";
    imds.set_spot_action(Some(
        serde_json::json!({"action": "terminate", "time": time}),
    ));
    wait_for("idle released", || async { idle_released(&w) }).await;
    wait_for("the Spot time is the deadline", || async {
        (w.allocated()
            .annotations
            .get("lastcall.dev/drain-deadline")
            .map(String::as_str)
            == Some(time))
        .then_some(())
    })
    .await;
    agent.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_imds_token_expiring_mid_drain_is_refreshed_without_falling_back_to_v1() {
    let w = World::start(WorldSpec::new(1, 1, 0)).await;
    let imds = ImdsEmulator::start(IID, "ip-10-0-0-1.ec2.internal")
        .await
        .unwrap();
    let agent = imds_agent(&w, &imds, &["--rebalance-ttl", "1h"]).await;
    w.claimed_all().await;
    let now = jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string();
    imds.set_rebalance(Some(serde_json::json!({"noticeTime": now})));
    wait_for("rebalance drains", || async {
        has_taint(&w.node().await, "lastcall.dev/draining").then_some(())
    })
    .await;
    imds.expire_tokens();
    imds.set_spot_action(Some(
        serde_json::json!({"action": "terminate", "time": "2030-01-01T00:02:00Z"}),
    ));
    wait_for(
        "the Spot notice is read after the token expired",
        || async {
            (w.allocated()
                .annotations
                .get("lastcall.dev/drain-reason")
                .map(String::as_str)
                == Some("preemption"))
            .then_some(())
        },
    )
    .await;
    // No IMDSv1: every GET that was refused for its token is followed by a new token
    // before the next successful GET.
    let reqs = imds.requests();
    let mut pending_401 = false;
    for (method, path, status) in &reqs {
        if method == "PUT" && path == "/latest/api/token" {
            pending_401 = false;
        } else if method == "GET" && *status == 401 {
            pending_401 = true;
        } else if method == "GET" && *status == 200 {
            assert!(
                !pending_401,
                "a GET succeeded without a fresh token: {reqs:?}"
            );
        }
    }
    assert!(
        reqs.iter().any(|(_, _, s)| *s == 401),
        "the token did expire"
    );
    agent.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebalance_that_never_escalates_clears_after_its_ttl() {
    let w = World::start(WorldSpec::new(1, 1, 0)).await;
    let imds = ImdsEmulator::start(IID, "ip-10-0-0-1.ec2.internal")
        .await
        .unwrap();
    let agent = imds_agent(&w, &imds, &["--rebalance-ttl", "3s"]).await;
    w.claimed_all().await;
    let now = jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string();
    imds.set_rebalance(Some(serde_json::json!({"noticeTime": now})));
    wait_for("rebalance drains", || async {
        let n = w.node().await;
        (cordoned(&n) && has_taint(&n, "lastcall.dev/draining")).then_some(())
    })
    .await;
    wait_for("uncordoned after the TTL", || async {
        let n = w.node().await;
        (!cordoned(&n) && !has_taint(&n, "lastcall.dev/draining")).then_some(())
    })
    .await;
    agent.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_holds_a_gce_maintenance_drain_while_upcoming_maintenance_says_nothing_definite()
{
    let w = World::start(WorldSpec::new(1, 1, 0)).await;
    let gce = GceMetadataEmulator::start().await.unwrap();
    let start = jiff::Timestamp::now()
        .checked_add(jiff::SignedDuration::from_mins(30))
        .unwrap()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string();
    gce.set(
        "upcoming-maintenance",
        &serde_json::json!({"can_reschedule": "false", "maintenance_status": "PENDING", "type": "SCHEDULED", "window_start_time": start}).to_string(),
    );
    let extra = ["--gce-upcoming-interval", "200ms"];
    let agent = gce_agent(&w, &gce, &extra).await;
    w.claimed_all().await;
    wait_for("drained for the window", || async {
        let n = w.node().await;
        (cordoned(&n) && has_taint(&n, "lastcall.dev/draining")).then_some(())
    })
    .await;
    agent.stop().await.unwrap();
    // After the restart the metadata server answers `{ }`: nothing definite, not "all clear".
    gce.set("upcoming-maintenance", "{ }");
    let polls = |gce: &GceMetadataEmulator| {
        gce.requests()
            .iter()
            .filter(|(k, _, _)| k == "upcoming-maintenance")
            .count()
    };
    let before = polls(&gce);
    let agent = gce_agent(&w, &gce, &extra).await;
    wait_for(
        "five upcoming-maintenance polls after the restart",
        || async { (polls(&gce) >= before + 5).then_some(()) },
    )
    .await;
    after_passes(&agent, 2).await;
    let n = w.node().await;
    assert!(
        cordoned(&n) && has_taint(&n, "lastcall.dev/draining"),
        "the drain was cancelled on an answer that says nothing"
    );
    // A definite answer (404: nothing defined) cancels it.
    gce.remove("upcoming-maintenance");
    wait_for("cancelled and restored", || async {
        let n = w.node().await;
        (!cordoned(&n) && !has_taint(&n, "lastcall.dev/draining")).then_some(())
    })
    .await;
    agent.stop().await.unwrap();
}

/// An AWS `NotBefore` (`21 Jan 2019 09:00:43 GMT`) `secs` from now, and its RFC 3339 form.
fn aws_time(secs: i64) -> (String, String) {
    let t = jiff::Timestamp::now()
        .checked_add(jiff::SignedDuration::from_secs(secs))
        .unwrap();
    (
        t.strftime("%-d %b %Y %H:%M:%S GMT").to_string(),
        t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string(),
    )
}

fn source_notices(m: &str, source: &str, severity: &str) -> Option<f64> {
    metric(
        m,
        "lastcall_source_notices",
        &[
            ("source", source),
            ("cause", "maintenance"),
            ("severity", severity),
        ],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aws_reboot_is_a_terminate_for_matches_and_system_maintenance_never_fences_early() {
    let w = World::start(WorldSpec::new(2, 1, 0)).await;
    let imds = ImdsEmulator::start(IID, "ip-10-0-0-1.ec2.internal")
        .await
        .unwrap();
    let agent = imds_agent(&w, &imds, &[]).await;
    w.claimed_all().await;
    // Network maintenance three hours out (the lead is one hour): nothing is stopped, so
    // the node keeps taking matches and no match is told to end.
    let (far, _) = aws_time(3 * 3600);
    imds.set_scheduled_events(serde_json::json!([{
        "Code": "system-maintenance", "Description": "scheduled network maintenance",
        "EventId": "instance-event-0d59937288b749b32", "NotBefore": far,
        "NotAfter": far, "State": "active"
    }]));
    wait_for("the maintenance observed", || async {
        let m = agent.metrics().await;
        (source_notices(&m, "aws_imds", "observe") == Some(1.0)).then_some(())
    })
    .await;
    after_passes(&agent, 2).await;
    let n = w.node().await;
    assert!(
        !cordoned(&n) && !has_taint(&n, "lastcall.dev/draining"),
        "fenced for maintenance that stops nothing"
    );
    // A system reboot kills every process on the node: a Terminate at NotBefore.
    let (soon, soon_rfc3339) = aws_time(1800);
    imds.set_scheduled_events(serde_json::json!([{
        "Code": "system-reboot", "Description": "scheduled reboot",
        "EventId": "instance-event-0a1b2c3d4e5f60718", "NotBefore": soon,
        "NotAfter": soon, "State": "active"
    }]));
    wait_for("idle released", || async { idle_released(&w) }).await;
    wait_for("the reboot time is the match's deadline", || async {
        (w.allocated()
            .annotations
            .get("lastcall.dev/drain-deadline")
            .map(String::as_str)
            == Some(soon_rfc3339.as_str()))
        .then_some(())
    })
    .await;
    let m = agent.metrics().await;
    assert_eq!(
        source_notices(&m, "aws_imds", "terminate"),
        Some(1.0),
        "a reboot is not a plain drain"
    );
    // Completed after the fact: the drain is cancelled.
    imds.set_scheduled_events(serde_json::json!([{
        "Code": "system-reboot", "Description": "[Completed] scheduled reboot",
        "EventId": "instance-event-0a1b2c3d4e5f60718", "NotBefore": soon,
        "NotAfter": soon, "State": "completed"
    }]));
    wait_for("cancelled and restored", || async {
        let n = w.node().await;
        (!cordoned(&n) && !has_taint(&n, "lastcall.dev/draining")).then_some(())
    })
    .await;
    agent.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_azure_reboot_drains_and_is_approved_only_once_the_node_is_empty() {
    use lastcall_emulators::azure::{AzureMetadataEmulator, event};
    let w = World::start(WorldSpec::new(2, 1, 0)).await;
    let vm = "aks-games-12345678-vmss_0";
    let azure = AzureMetadataEmulator::start(vm).await.unwrap();
    let url = azure.url();
    let args: Vec<String> = [
        "--azure-events",
        "--azure-metadata-endpoint",
        &url,
        "--azure-events-interval",
        "200ms",
        "--azure-approve-when-empty",
        "--resync-interval",
        "1s",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let agent = w.start_agent(&args).await;
    w.claimed_all().await;
    azure.set_events(vec![event(
        "reboot-1",
        "Reboot",
        vm,
        "Tue, 01 Jan 2030 01:00:00 GMT",
    )]);
    wait_for("fenced and idle released", || async {
        let n = w.node().await;
        (cordoned(&n) && has_taint(&n, "lastcall.dev/draining"))
            .then_some(())
            .and_then(|()| idle_released(&w))
    })
    .await;
    wait_for("NotBefore is the match's deadline", || async {
        (w.allocated()
            .annotations
            .get("lastcall.dev/drain-deadline")
            .map(String::as_str)
            == Some("2030-01-01T01:00:00Z"))
        .then_some(())
    })
    .await;
    // Passes that knew the match, and reads of the document after them: its chance to
    // approve came and went.
    after_passes(&agent, 2).await;
    let polls = azure.requests().len();
    wait_for("two more reads of the events", || async {
        (azure.requests().len() >= polls + 2).then_some(())
    })
    .await;
    assert!(azure.approvals().is_empty(), "approved while a match runs");
    let keep = w.allocated();
    w.cluster
        .sdk_shutdown(lastcall_testkit::world::NS, &keep.name)
        .unwrap();
    wait_for("node empty", || async {
        w.on(NODE).is_empty().then_some(())
    })
    .await;
    wait_for("approved", || async {
        (!azure.approvals().is_empty()).then_some(())
    })
    .await;
    // More reads of the still-listed event, and passes: no second approval.
    let polls = azure.requests().len();
    wait_for("five more reads of the events", || async {
        (azure.requests().len() >= polls + 5).then_some(())
    })
    .await;
    after_passes(&agent, 2).await;
    assert_eq!(azure.approvals(), ["reboot-1"], "once");
    assert!(azure.requests().iter().all(|r| r.metadata_header));
    agent.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maintenance_that_can_start_early_is_handed_back_once_only_when_asked() {
    for hand_back in [true, false] {
        let w = World::start(WorldSpec::new(1, 1, 0)).await;
        let gce = GceMetadataEmulator::start().await.unwrap();
        // A short settle: the gate opens soon after the node empties.
        let extra: &[&str] = if hand_back {
            &[
                "--gke-hand-back",
                "--gce-upcoming-interval",
                "200ms",
                "--deregister-settle",
                "300ms",
            ]
        } else {
            &[
                "--gce-upcoming-interval",
                "200ms",
                "--deregister-settle",
                "300ms",
            ]
        };
        let agent = gce_agent(&w, &gce, extra).await;
        w.claimed_all().await;
        let start = jiff::Timestamp::now()
            .checked_add(jiff::SignedDuration::from_mins(30))
            .unwrap()
            .strftime("%Y-%m-%dT%H:%M:%SZ")
            .to_string();
        gce.set(
            "upcoming-maintenance",
            &serde_json::json!({"can_reschedule": "true", "maintenance_status": "PENDING", "type": "SCHEDULED", "window_start_time": start}).to_string(),
        );
        wait_for("drained for the window", || async {
            has_taint(&w.node().await, "lastcall.dev/draining").then_some(())
        })
        .await;
        let label = |n: &Node| {
            n.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("cloud.google.com/perform-maintenance").cloned())
        };
        assert_eq!(label(&w.node().await), None, "not while a match runs");
        let keep = w.allocated();
        w.cluster
            .sdk_shutdown(lastcall_testkit::world::NS, &keep.name)
            .unwrap();
        wait_for("node empty", || async {
            w.on(NODE).is_empty().then_some(())
        })
        .await;
        if hand_back {
            wait_for("handed back", || async {
                (label(&w.node().await).as_deref() == Some("true")).then_some(())
            })
            .await;
        } else {
            // The gate open (the settle past the drain start the agent recorded), then passes
            // after it: its chance to hand back came and went.
            let started: jiff::Timestamp = w
                .node()
                .await
                .metadata
                .annotations
                .and_then(|a| a.get("lastcall.dev/drain-started").cloned())
                .expect("the drain start recorded")
                .parse()
                .expect("a time");
            let open =
                std::time::SystemTime::from(started + jiff::SignedDuration::from_millis(300));
            wait_for("the settle past", || async {
                (std::time::SystemTime::now() >= open).then_some(())
            })
            .await;
            after_passes(&agent, 2).await;
            assert_eq!(label(&w.node().await), None, "off unless asked");
        }
        if hand_back {
            // Once: the record does not move over further passes (resync is 1 s).
            let handed = |n: &Node| {
                n.metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get("lastcall.dev/handed-back").cloned())
            };
            let first = handed(&w.node().await).expect("recorded");
            after_passes(&agent, 3).await;
            assert_eq!(handed(&w.node().await), Some(first));
        }
        agent.stop().await.unwrap();
    }
}

/// A VM that live-migrates (`scheduling/on-host-maintenance=MIGRATE`, GCE's default for a
/// standard VM) whose pending maintenance may start early is not handed back to GKE: a
/// hand-back is final until the machine returns with a new boot id, and a live migration
/// keeps the VM running (the same boot). Its drain ends with the window instead: once the
/// maintenance is complete, the node takes game servers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_migrating_vm_is_not_handed_back_and_its_drain_ends_with_the_window() {
    let w = World::start(WorldSpec::new(1, 0, 0)).await;
    w.cluster.set_boot_id(NODE, "boot-1").expect("boot id");
    let gce = GceMetadataEmulator::start().await.unwrap();
    gce.set("scheduling/on-host-maintenance", "MIGRATE");
    let agent = gce_agent(
        &w,
        &gce,
        &[
            "--gke-hand-back",
            "--gce-upcoming-interval",
            "200ms",
            "--deregister-settle",
            "0s",
        ],
    )
    .await;
    w.claimed_all().await;
    let start = jiff::Timestamp::now()
        .checked_add(jiff::SignedDuration::from_mins(30))
        .unwrap()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string();
    let window = |status: &str| {
        serde_json::json!({"can_reschedule": "true", "maintenance_status": status, "type": "SCHEDULED", "window_start_time": start}).to_string()
    };
    gce.set("upcoming-maintenance", &window("PENDING"));
    wait_for("drained for the window, and empty", || async {
        let m = agent.metrics().await;
        (has_taint(&w.node().await, "lastcall.dev/draining")
            && metric(&m, "lastcall_drain_phase", &[("phase", "empty")]) == Some(1.0))
        .then_some(())
    })
    .await;
    // Empty, settled, and the window may start early: two more passes of the agent.
    let ok = |m: &str| metric(m, "lastcall_reconciles_total", &[("result", "ok")]).unwrap_or(0.0);
    let passes = ok(&agent.metrics().await);
    wait_for("two more passes", || async {
        (ok(&agent.metrics().await) >= passes + 2.0).then_some(())
    })
    .await;
    let node = w.node().await;
    let labels = node.metadata.labels.clone().unwrap_or_default();
    let annotations = node.metadata.annotations.clone().unwrap_or_default();
    assert!(
        !labels.contains_key("cloud.google.com/perform-maintenance")
            && !annotations.contains_key("lastcall.dev/handed-back"),
        "a VM that live-migrates was handed back to GKE: {labels:?} {annotations:?}"
    );
    // The maintenance happens: a live migration (the same boot id), then it is complete.
    gce.set("upcoming-maintenance", &window("ONGOING"));
    gce.set("upcoming-maintenance", &window("COMPLETE"));
    wait_for("the drain ended with the window", || async {
        let n = w.node().await;
        (!cordoned(&n) && !has_taint(&n, "lastcall.dev/draining")).then_some(())
    })
    .await;
    agent.stop().await.unwrap();
}

async fn label_n1(w: &World, value: Option<&str>) {
    let nodes: Api<Node> = Api::all(w.cluster.client());
    nodes
        .patch(
            "n1",
            &PatchParams::default(),
            &Patch::Merge(
                &serde_json::json!({"metadata": {"labels": {"lastcall.dev/drain": value}}}),
            ),
        )
        .await
        .expect("label n1");
}

/// Scenario 8: the manual label drains the node; removing it mid-drain cancels the drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_manual_label_drains_and_removing_it_mid_drain_cancels() {
    let w = World::start(WorldSpec::new(2, 1, 0).extra_nodes(&["n2"])).await;
    let agent = w.start_agent(&[]).await;
    w.claimed_all().await;
    let keep = w.allocated();
    label_n1(&w, Some("true")).await;
    w.fenced_and_released(&keep).await;
    assert_eq!(
        w.allocated()
            .annotations
            .get("lastcall.dev/drain-reason")
            .map(String::as_str),
        Some("manual")
    );
    // Mid-drain: the match is still running when the operator changes their mind.
    label_n1(&w, None).await;
    wait_for("drain cancelled and the node restored", || async {
        let n = w.node().await;
        let g = w.allocated();
        (!cordoned(&n)
            && !has_taint(&n, "lastcall.dev/draining")
            && !g.annotations.contains_key("lastcall.dev/drain-deadline")
            && !g.labels.contains_key("lastcall.dev/node-draining"))
        .then_some(())
    })
    .await;
    let g = w.allocated();
    assert_eq!(g.uid, keep.uid, "the match ran on");
    assert!(!g.deleting);
    let m = agent.metrics().await;
    assert_eq!(
        metric(&m, "lastcall_drain_phase", &[("phase", "idle")]),
        Some(1.0)
    );
    agent.stop().await.unwrap();
}
