//! Karpenter's deadline reaches the games: when Karpenter terminates a node with a
//! `terminationGracePeriod`, it writes `karpenter.sh/nodeclaim-termination-timestamp` on the
//! Node, and the agent announces exactly that time on the running match's GameServer
//! (`lastcall.dev/drain-deadline`) instead of its own default.
//!
//! NodeClaim expiry (EKS Auto Mode, a NodePool's `expireAfter`): the node stops taking new
//! matches `--maintenance-lead` before the expiry, announces `expiry +
//! terminationGracePeriod`, and a match that ends on its own leaves Karpenter nothing to
//! kill. `Never`, a missing NodeClaim and a forbidden read never drain.

use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use lastcall_testkit::agent::{InProcessAgent, config, metric};
use lastcall_testkit::cluster::autoscaler::karpenter::{
    self, Method, NodeClaimSpec, Outcome, TERMINATION_TIMESTAMP_ANNOTATION, nodeclaim_name,
};
use lastcall_testkit::cluster::{AllocationRequest, Cluster, ClusterConfig, FleetSpec, NodeSpec};
use lastcall_testkit::eventually::{eventually, wait_for};
use lastcall_testkit::kube::faults::{FaultRule, Method as HttpMethod};
use lastcall_testkit::kube::journal::Verb;
use lastcall_testkit::promises::fence::first_fence;

#[path = "support/passes.rs"]
mod passes;
use passes::after_passes;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn karpenter_s_termination_timestamp_is_the_deadline_announced_to_the_match() {
    let c = Cluster::start(ClusterConfig::default()).await.unwrap();
    c.add_node(NodeSpec::new("n1")).unwrap();
    c.create_fleet(FleetSpec::new("arena", 1).grace_seconds(1))
        .unwrap();
    c.wait_ready("default", "arena", 1).await.unwrap();
    let playing = c
        .allocate(&AllocationRequest::fleet("default", "arena"))
        .await
        .unwrap()
        .expect("allocated");
    let kube = c.emulator().config_for("agent-n1").await.unwrap();
    let agent = InProcessAgent::start(
        config("n1", &["--resync-interval", "1s", "--drain-deadline", "2h"]),
        kube,
        None,
    )
    .await
    .unwrap();

    let k = c
        .karpenter(karpenter::Config {
            termination_grace_period: Some(Duration::from_secs(30)),
            give_up_after: Duration::from_secs(20),
            ..karpenter::Config::default()
        })
        .await
        .unwrap();
    let run = k.disrupt("n1", Method::Expiration);
    let want = wait_for("Karpenter's deadline on the Node", || async {
        c.node("n1")?["metadata"]["annotations"][TERMINATION_TIMESTAMP_ANNOTATION]
            .as_str()
            .map(str::to_string)
    })
    .await;
    let got = wait_for("the deadline announced to the match", || async {
        c.game_server("default", &playing.name)?
            .annotations
            .get("lastcall.dev/drain-deadline")
            .cloned()
    })
    .await;
    let (want, got): (jiff::Timestamp, jiff::Timestamp) =
        (want.parse().unwrap(), got.parse().unwrap());
    assert_eq!(
        got, want,
        "the match must be told Karpenter's deadline, not the 2 h default"
    );
    drop(run);
    agent.stop().await.unwrap();
    c.shutdown().await;
}

const LEAD_S: i64 = 15;
const EXPIRE_S: i64 = 40;
const GRACE_S: i64 = 20;

async fn agent_for(c: &Cluster, node: &str, extra: &[&str]) -> InProcessAgent {
    let kube = c
        .emulator()
        .config_for(&format!("agent-{node}"))
        .await
        .unwrap();
    let mut flags = vec!["--resync-interval", "1s"];
    flags.extend_from_slice(extra);
    InProcessAgent::start(config(node, &flags), kube, None)
        .await
        .unwrap()
}

async fn reads(agent: &InProcessAgent, result: &str) -> f64 {
    let m = agent.metrics().await;
    metric(
        &m,
        "lastcall_karpenter_nodeclaim_reads_total",
        &[("result", result)],
    )
    .unwrap_or(0.0)
}

fn fenced(c: &Cluster, node: &str) -> bool {
    let Some(n) = c.node(node) else { return false };
    n["spec"]["taints"]
        .as_array()
        .is_some_and(|ts| ts.iter().any(|t| t["key"] == "lastcall.dev/draining"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expiring_nodeclaim_fences_at_the_lead_and_its_match_ends_before_the_expiry() {
    let c = Cluster::start(ClusterConfig::default()).await.unwrap();
    c.add_node(NodeSpec::new("n1")).unwrap();
    c.add_node(NodeSpec::new("n2")).unwrap();
    // Both servers start on n1; n2 takes the replacements.
    c.set_unschedulable("n2", true).unwrap();
    c.create_fleet(FleetSpec::new("arena", 2).grace_seconds(1))
        .unwrap();
    c.wait_ready("default", "arena", 2).await.unwrap();
    let playing = c
        .allocate(&AllocationRequest::fleet("default", "arena"))
        .await
        .unwrap()
        .expect("allocated");
    assert_eq!(playing.node.as_deref(), Some("n1"));
    c.set_unschedulable("n2", false).unwrap();

    let k = c
        .karpenter(karpenter::Config {
            give_up_after: Duration::from_secs(30),
            ..karpenter::Config::default()
        })
        .await
        .unwrap();
    let claim = k
        .launch(
            "n1",
            &NodeClaimSpec {
                expire_after: format!("{EXPIRE_S}s"),
                termination_grace_period: Some(format!("{GRACE_S}s")),
            },
        )
        .await
        .unwrap();
    let created: Timestamp = claim["metadata"]["creationTimestamp"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let expiry = created + SignedDuration::from_secs(EXPIRE_S);
    let fence_at = expiry - SignedDuration::from_secs(LEAD_S);
    let end = expiry + SignedDuration::from_secs(GRACE_S);
    let expiration = k.expire("n1");
    let lead = format!("{LEAD_S}s");
    let agent = agent_for(&c, "n1", &["--maintenance-lead", &lead]).await;
    wait_for("the NodeClaim read", || async {
        (reads(&agent, "ok").await >= 1.0).then_some(())
    })
    .await;

    // The fence comes at expiry − lead.
    // Up to expiry − lead from now, and then some (eventually, never a timed assert).
    eventually(
        "the node fenced",
        Duration::from_secs(EXPIRE_S.unsigned_abs() + 60),
        Duration::from_millis(50),
        || async { fenced(&c, "n1").then_some(()) },
    )
    .await;
    let j = c.emulator().journal();
    let entries = j.entries();
    let fence = first_fence(&entries, "agent-n1", "n1").expect("the fence write");
    let fenced_at = Timestamp::try_from(fence.at).unwrap();
    assert!(
        fenced_at >= fence_at,
        "fenced at {fenced_at}, before expiry − lead ({fence_at})"
    );
    assert!(
        fenced_at < expiry,
        "fenced at {fenced_at}, not before the expiry {expiry}"
    );

    // The match is told the expiry-derived end: expiry + terminationGracePeriod.
    let announced = wait_for("the deadline announced to the match", || async {
        c.game_server("default", &playing.name)?
            .annotations
            .get("lastcall.dev/drain-deadline")?
            .parse::<Timestamp>()
            .ok()
    })
    .await;
    assert_eq!(announced, end, "expiry {expiry} + {GRACE_S} s");

    // New matches land elsewhere: n1's idle server is released, the next allocation goes to
    // its replacement on n2, and no allocation lands on n1 after the fence.
    wait_for("n1's idle server released", || async {
        c.game_servers()
            .iter()
            .filter(|g| g.node.as_deref() == Some("n1") && g.name != playing.name)
            .all(|g| g.deleting)
            .then_some(())
    })
    .await;
    let next = wait_for("a new match", || async {
        c.allocate(&AllocationRequest::fleet("default", "arena"))
            .await
            .ok()
            .flatten()
    })
    .await;
    assert_eq!(next.node.as_deref(), Some("n2"));
    let on_n1_after_fence: Vec<_> = c
        .emulator()
        .journal()
        .filter(|r| {
            r.seq > fence.seq
                && r.identity.as_deref() == Some("agones-allocator")
                && r.verb == Verb::Update
                && r.status < 300
                && r.response
                    .as_ref()
                    .is_some_and(|o| o["status"]["nodeName"] == "n1")
        })
        .into_iter()
        .map(|r| r.name)
        .collect();
    assert!(
        on_n1_after_fence.is_empty(),
        "allocations on n1 after the fence: {on_n1_after_fence:?}"
    );

    // The match ends on its own before the expiry; Karpenter then finds nothing to kill.
    c.sdk_shutdown("default", &playing.name).unwrap();
    assert!(
        Timestamp::now() < expiry,
        "the match ended after the expiry"
    );
    let outcome = tokio::time::timeout(
        Duration::from_secs((EXPIRE_S + GRACE_S).unsigned_abs() + 60),
        expiration,
    )
    .await
    .expect("the expiry ran")
    .unwrap();
    match outcome {
        Some(Outcome::NodeDeleted {
            evicted,
            deleted,
            at_deadline,
        }) => {
            assert!(
                evicted.is_empty() && deleted.is_empty() && !at_deadline,
                "Karpenter had to take pods: evicted {evicted:?}, deleted {deleted:?}"
            );
        }
        other => panic!("the expiry did not delete the empty node: {other:?}"),
    }
    let killed = c.emulator().journal().count(|r| {
        r.identity.as_deref() == Some("karpenter")
            && r.resource.as_deref() == Some("pods")
            && r.verb.is_mutating()
    });
    assert_eq!(killed, 0, "Karpenter touched a pod");
    agent.stop().await.unwrap();
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_missing_or_forbidden_nodeclaims_never_drain() {
    let c = Cluster::start(ClusterConfig::default()).await.unwrap();
    for n in ["n1", "n2", "n3", "n4"] {
        c.add_node(NodeSpec::new(n)).unwrap();
    }
    let k = c.karpenter(karpenter::Config::default()).await.unwrap();
    let spec = |e: &str| NodeClaimSpec {
        expire_after: e.into(),
        termination_grace_period: None,
    };
    // n1 never expires; n2's NodeClaim is not there (404); reading n3's is forbidden; n4
    // (the control) expires in 720 h, well inside the lead.
    k.launch("n1", &spec("Never")).await.unwrap();
    k.launch("n3", &spec("720h")).await.unwrap();
    k.launch("n4", &spec("720h")).await.unwrap();
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(c.client());
    nodes
        .patch(
            "n2",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"metadata": {"ownerReferences": [{
                "apiVersion": "karpenter.sh/v1", "kind": "NodeClaim", "name": "gone", "uid": "u-gone"
            }]}})),
        )
        .await
        .unwrap();
    c.emulator().faults().inject(FaultRule::status(
        Some(HttpMethod::GET),
        &format!("nodeclaims/{}", nodeclaim_name("n3")),
        usize::MAX,
        403,
    ));
    let lead = ["--maintenance-lead", "1000h"];
    let agents = [
        agent_for(&c, "n1", &lead).await,
        agent_for(&c, "n2", &lead).await,
        agent_for(&c, "n3", &lead).await,
        agent_for(&c, "n4", &lead).await,
    ];
    for (agent, result) in agents.iter().zip(["never", "not_found", "forbidden", "ok"]) {
        wait_for(&format!("NodeClaim read: {result}"), || async {
            (reads(agent, result).await >= 1.0).then_some(())
        })
        .await;
    }
    wait_for("the control node fenced", || async {
        fenced(&c, "n4").then_some(())
    })
    .await;
    // Two more passes of every agent after the control fenced.
    for a in &agents {
        after_passes(a, 2).await;
    }
    for n in ["n1", "n2", "n3"] {
        let node = c.node(n).unwrap();
        assert!(
            !fenced(&c, n) && node["spec"]["unschedulable"] != true,
            "{n} was drained: {node:#}"
        );
    }
    let m = agents[2].metrics().await;
    assert_eq!(
        metric(&m, "lastcall_source_up", &[("source", "karpenter_expiry")]),
        Some(0.0),
        "a forbidden read marks the source down"
    );
    for a in agents {
        a.stop().await.unwrap();
    }
    c.shutdown().await;
}
