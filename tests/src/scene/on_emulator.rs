//! The scene on the emulator: the kube emulator with its cluster model (scheduler, kubelet,
//! Agones' GameServer controller, Agones' PDB), one node, standalone GameServers (no Fleet,
//! as on the box), and the agent in-process, built as the binary builds itself from the
//! chart's arguments, with the Downward API values of a pod the test creates on the node.

use std::time::Duration;

use clap::Parser;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::PostParams;
use lastcall_agent::config::Config;

use crate::agent::InProcessAgent;
use crate::cluster::{
    Cluster, ClusterConfig, GameServerSpec, GameServerState, GameServerView, NodeSpec,
};
use crate::kube_box::agent::{NAMESPACE, args_with, pod_for};
use crate::kube_box::agones::Server;

/// The namespace of the game servers (the one the model gives Agones' PDB).
pub const NS: &str = "default";
/// The agent's identity in the emulator's journal (its bearer token).
pub const AGENT_IDENTITY: &str = "lastcall-agent";

pub struct EmulatorScene {
    pub cluster: Cluster,
    pub ns: String,
    pub node: String,
}

impl EmulatorScene {
    /// A cluster whose GameServer CRD declares `status.nodeName` selectable (Agones 1.58+)
    /// when `selectable`, with the node `{name}-n1`.
    pub async fn start(name: &str, selectable: bool) -> EmulatorScene {
        let cluster = Cluster::start(ClusterConfig {
            agones_selectable_fields: selectable,
            ..ClusterConfig::default()
        })
        .await
        .expect("the emulated cluster");
        let node = format!("{name}-n1");
        cluster
            .add_node(NodeSpec::new(node.as_str()))
            .expect("the node");
        EmulatorScene {
            cluster,
            ns: NS.to_string(),
            node,
        }
    }

    /// `n` Ready servers (`gs-0`, `gs-1`, …) on the node; their pods have 1 s of grace, as
    /// the box's stand-in gives them.
    pub async fn ready_servers(&self, n: usize) -> Vec<Server> {
        let names: Vec<String> = (0..n).map(|i| format!("gs-{i}")).collect();
        for name in &names {
            self.cluster
                .create_game_server(
                    GameServerSpec::new(name.as_str())
                        .namespace(self.ns.as_str())
                        .grace_seconds(1),
                )
                .expect("a GameServer");
        }
        let node = self.node.clone();
        let views: Vec<GameServerView> = self
            .cluster
            .wait_until(
                &format!("{n} Ready servers on {node}"),
                Duration::from_secs(30),
                |c| {
                    let ready: Vec<GameServerView> = c
                        .game_servers()
                        .into_iter()
                        .filter(|g| {
                            names.contains(&g.name)
                                && g.state == Some(GameServerState::Ready)
                                && g.node.as_deref() == Some(node.as_str())
                        })
                        .collect();
                    (ready.len() == n).then_some(ready)
                },
            )
            .await
            .expect("Ready servers");
        let mut servers: Vec<Server> = views
            .into_iter()
            .map(|g| Server {
                namespace: g.namespace,
                name: g.name,
                uid: g.uid,
            })
            .collect();
        servers.sort_by(|a, b| a.name.cmp(&b.name));
        servers
    }

    /// The agent for the node, in-process: the chart's arguments (`--listen` on 127.0.0.1)
    /// plus `extra`, and for the Downward API values the chart passes as environment, the
    /// same values as flags, from an agent pod created on the node.
    pub async fn start_agent(&self, extra: &[String]) -> InProcessAgent {
        // The DaemonSet's pod, bound to the node; the model runs no such pod (its kubelet
        // runs game servers only), and the agent needs only its name and uid.
        let pod = Api::<Pod>::namespaced(self.cluster.client(), NAMESPACE)
            .create(
                &PostParams::default(),
                &pod_for(&self.node).expect("the chart's agent pod"),
            )
            .await
            .expect("the agent's pod");
        let mut argv = vec![
            "lastcall-agent".to_string(),
            format!("--node-name={}", self.node),
            format!("--pod-name={}", pod.metadata.name.unwrap_or_default()),
            format!("--pod-namespace={NAMESPACE}"),
            format!("--pod-uid={}", pod.metadata.uid.unwrap_or_default()),
        ];
        argv.extend(args_with(extra).expect("the chart's arguments"));
        let config = Config::try_parse_from(&argv)
            .unwrap_or_else(|e| panic!("the chart's arguments: {e}\n{argv:?}"));
        let kube = self
            .cluster
            .emulator()
            .config_for(AGENT_IDENTITY)
            .await
            .expect("the agent's kube config");
        InProcessAgent::start(config, kube, None)
            .await
            .expect("the in-process agent")
    }
}
