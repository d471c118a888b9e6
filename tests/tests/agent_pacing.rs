//! Release pacing end to end: a node with 10 Ready servers of one Fleet drains with a floor
//! of 4. Sampled throughout, the Fleet never has fewer than 4 Ready servers (Ready and not
//! being deleted, on any node), and every idle server on the node is still released in the
//! end, as replacements come up elsewhere.

use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};
use lastcall_testkit::agent::{InProcessAgent, config};
use lastcall_testkit::cluster::{
    Cluster, ClusterConfig, FleetSpec, GameServerState as S, NodeSpec,
};
use lastcall_testkit::eventually::eventually;

const FLOOR: usize = 4;

fn ready(cluster: &Cluster) -> usize {
    cluster
        .game_servers()
        .iter()
        .filter(|g| g.state == Some(S::Ready) && !g.deleting)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_keeps_its_floor_of_ready_servers_while_the_node_drains() {
    let cluster = Cluster::start(ClusterConfig::default())
        .await
        .expect("cluster");
    cluster.add_node(NodeSpec::new("n1")).expect("n1");
    cluster
        .create_fleet(FleetSpec::new("fleet", 10).grace_seconds(0))
        .expect("fleet");
    cluster
        .wait_ready("default", "fleet", 10)
        .await
        .expect("ready");
    cluster.add_node(NodeSpec::new("n2")).expect("n2");
    let kube = cluster
        .emulator()
        .config_for("agent-n1")
        .await
        .expect("client");
    let agent = InProcessAgent::start(
        config("n1", &["--release-floor", "4", "--resync-interval", "1s"]),
        kube,
        None,
    )
    .await
    .expect("agent");
    eventually(
        "claimed",
        Duration::from_secs(20),
        Duration::from_millis(10),
        || async {
            cluster
                .game_servers()
                .iter()
                .all(|g| g.labels.contains_key("lastcall.dev/node"))
                .then_some(())
        },
    )
    .await;
    Api::<Node>::all(cluster.client())
        .patch(
            "n1",
            &PatchParams::default(),
            &Patch::Merge(
                &serde_json::json!({"metadata": {"labels": {"lastcall.dev/drain": "true"}}}),
            ),
        )
        .await
        .expect("label");
    let mut samples = 0;
    let mut lowest = usize::MAX;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let r = ready(&cluster);
        lowest = lowest.min(r);
        samples += 1;
        assert!(
            r >= FLOOR,
            "the Fleet fell to {r} Ready servers (floor {FLOOR})"
        );
        let left_on_n1 = cluster
            .game_servers()
            .iter()
            .filter(|g| g.node.as_deref() == Some("n1") && !g.deleting)
            .count();
        if left_on_n1 == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{left_on_n1} servers still on n1 after 60 s"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    eprintln!("{samples} samples, lowest Ready count {lowest} (floor {FLOOR})");
    assert!(samples > 10, "the drain was sampled");
    agent.stop().await.expect("clean stop");
}
