//! Karpenter's deadline reaches the games: when Karpenter terminates a node with a
//! `terminationGracePeriod`, it writes `karpenter.sh/nodeclaim-termination-timestamp` on the
//! Node, and the agent announces exactly that time on the running match's GameServer
//! (`lastcall.dev/drain-deadline`) instead of its own default.

use std::time::Duration;

use lastcall_testkit::agent::{InProcessAgent, config};
use lastcall_testkit::cluster::autoscaler::karpenter::{
    self, Method, TERMINATION_TIMESTAMP_ANNOTATION,
};
use lastcall_testkit::cluster::{AllocationRequest, Cluster, ClusterConfig, FleetSpec, NodeSpec};
use lastcall_testkit::eventually::wait_for;

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
