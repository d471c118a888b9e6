//! The scene on the emulator: the kube emulator with its cluster model (scheduler, kubelet,
//! Agones' GameServer controller, Agones' PDB), one node, standalone GameServers (no Fleet,
//! as on the box), and the agent in-process, built as the binary builds itself from the
//! chart's arguments, with the Downward API values of a pod the test creates on the node.

use clap::Parser;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::PostParams;
use lastcall_agent::config::Config;

use crate::agent::InProcessAgent;
use crate::cluster::{ALLOCATOR_IDENTITY, Cluster, ClusterConfig, NodeSpec};
use crate::kube_box::agent::{NAMESPACE, args_with, pod_for};
use crate::kube_box::agones::Agones;

/// The namespace of the game servers (the one the model gives Agones' PDB).
pub const NS: &str = "default";
/// The agent's identity in the emulator's journal (its bearer token).
pub const AGENT_IDENTITY: &str = "lastcall-agent";
/// The games' SDK calls' identity in the journal.
pub const SDK_IDENTITY: &str = "agones-sdk";

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

    /// The game's and the allocator's part of Agones here: the cluster model runs the
    /// controller on its store; the SDK calls and allocations go over HTTP, as on the box,
    /// each as its own identity in the journal.
    pub async fn agones(&self) -> Agones {
        let client = |identity: &'static str| async move {
            let config = self
                .cluster
                .emulator()
                .config_for(identity)
                .await
                .expect("a kube config");
            kube::Client::try_from(config).expect("a client")
        };
        Agones::without_controller(
            &client(SDK_IDENTITY).await,
            &client(ALLOCATOR_IDENTITY).await,
            &self.ns,
        )
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
