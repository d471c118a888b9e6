//! One test's part of the box: its namespace (with Agones' PDB), its kwok node, Agones
//! there (the test kit's one model, its controller running as its own user), a watch
//! placing GameServer deletions, and the real agent process.
//!
//! The box tests (`box_drain.rs`, `box_faults.rs`) and the two-backend scenarios
//! ([`super::Scene`]) all set their scene up here, so a box scene means one thing.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Node, ServiceAccount};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use crate::agent::metric_sum;
use crate::eventually::{try_eventually, wait_for};
use crate::kube_box::agent::{AgentProcess, Extra};
use crate::kube_box::agones::{self, Agones, Allocation, Crd, Deletions, Server};
use crate::kube_box::audit::Entry;
use crate::kube_box::{self, Lease, create_node};

/// The operator's drain label.
pub const DRAIN_LABEL: &str = "lastcall.dev/drain";

/// A test's turn on the shared box and what it set up there.
pub struct BoxScene {
    pub kbox: Lease,
    /// The admin client (the tests play Agones and the operator with it).
    pub client: kube::Client,
    pub ns: String,
    pub node: String,
    pub agones: Agones,
    pub deletions: Deletions,
}

impl BoxScene {
    /// Takes the box's turn, installs the GameServer CRD as `crd`, and creates namespace
    /// `name` (with its default ServiceAccount and Agones' PDB) and the kwok node
    /// `{name}-n1`.
    pub async fn start(name: &str, crd: Crd) -> BoxScene {
        let kbox = kube_box::lease().await;
        eprintln!("box started in {:?}", kbox.started_in());
        let client = kbox.client().await.expect("admin client");
        agones::install_crd(&client, crd)
            .await
            .expect("GameServer CRD");
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}}))
            .expect("a Namespace object");
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .expect("namespace");
        let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), name);
        wait_for("the namespace's default ServiceAccount", || async {
            sas.get_opt("default").await.ok().flatten().map(|_| ())
        })
        .await;
        agones::ensure_pdb(&client, name).await.expect("Agones PDB");
        let node = format!("{name}-n1");
        create_node(&client, &node).await.expect("kwok node");
        let agones = Agones::on_box(&kbox, name).await.expect("Agones' clients");
        let deletions = Deletions::watch(&client, name)
            .await
            .expect("a GameServer watch");
        BoxScene {
            kbox,
            client,
            ns: name.to_string(),
            node,
            agones,
            deletions,
        }
    }

    /// `n` Ready servers (`gs-0`, `gs-1`, …) on the node, created together.
    pub async fn ready_servers(&self, n: usize) -> Vec<Server> {
        self.servers(&vec!["Never"; n]).await
    }

    /// One Ready server per entry, `gs-{i}` with `eviction.safe` = `safe[i]`, created
    /// together.
    pub async fn servers(&self, safe: &[&str]) -> Vec<Server> {
        let made = futures::future::join_all(safe.iter().enumerate().map(|(i, safe)| {
            let name = format!("gs-{i}");
            async move {
                self.agones
                    .ready_server_evictable(&name, &self.node, safe)
                    .await
            }
        }))
        .await;
        made.into_iter()
            .map(|r| r.expect("a Ready GameServer"))
            .collect()
    }

    /// The allocator's Ready → Allocated write for `s`; it must win.
    pub async fn allocate(&self, s: &Server) {
        let got = self.agones.allocate(&s.name).await.expect("allocate");
        assert!(
            matches!(got, Allocation::Allocated(_)),
            "{}: {got:?}",
            s.name
        );
    }

    pub fn nodes(&self) -> Api<Node> {
        Api::all(self.client.clone())
    }

    pub async fn node_obj(&self) -> Node {
        self.nodes().get(&self.node).await.expect("the node")
    }

    /// The agent process for the node, as the chart runs it plus `extra`, once ready.
    pub async fn start_agent(&self, extra: Extra) -> AgentProcess {
        let agent = AgentProcess::start(&self.kbox, &self.node, extra)
            .await
            .expect("the agent process");
        agent.ready().await.expect("agent ready");
        agent
    }

    /// Waits until the agent sees `n` GameServers on its node.
    pub async fn agent_sees(&self, agent: &AgentProcess, n: usize) {
        wait_for("the agent sees every server on its node", || async {
            let seen = metric_sum(&agent.metrics().await, "lastcall_game_servers", &[]);
            (seen as usize == n).then_some(())
        })
        .await;
    }

    /// Waits until the agent has completed `n` reconcile passes that each began after this
    /// call (its own count, `lastcall_reconciles_total`): the agent had its chance to act on
    /// everything that happened before. Each pass is asked for by a foreign annotation on the
    /// node (any Node change wakes the agent), not waited for by a clock.
    pub async fn passes(&self, agent: &AgentProcess, n: u64) {
        let count = || async {
            metric_sum(&agent.metrics().await, "lastcall_reconciles_total", &[]) as u64
        };
        let from = count().await;
        // A pass in flight now may have begun before the call: one more than asked.
        for i in 1..=n + 1 {
            self.nodes()
                .patch(
                    &self.node,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"metadata": {"annotations": {
                        "example.com/nudge": format!("{from}-{i}")}}})),
                )
                .await
                .expect("nudge the agent");
            wait_for("the agent's next pass", || async {
                (count().await >= from + i).then_some(())
            })
            .await;
        }
    }

    /// The operator's drain label, set (`true`) or removed.
    pub async fn drain_label(&self, on: bool) {
        let v = if on { json!("true") } else { Value::Null };
        self.nodes()
            .patch(
                &self.node,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {DRAIN_LABEL: v}}})),
            )
            .await
            .expect("label the node");
    }

    /// The resourceVersion at which `name` was deleted (from the scene's watch).
    pub async fn deleted(&self, name: &str) -> u64 {
        let got = try_eventually(
            &format!("the DELETED event of {name}"),
            Duration::from_secs(30),
            Duration::from_millis(50),
            || async { self.deletions.of(name) },
        )
        .await;
        got.unwrap_or_else(|e| panic!("{e}"))
    }

    /// Where a write stands in etcd's order: the revision it produced (a GameServer DELETE
    /// answers with the server it left terminating, under Agones' finalizer; one that
    /// removed it at once answers a bare Status, and is placed by its DELETED event).
    /// `None` for a write whose answer carries no revision (an Eviction's Status, a refused
    /// write).
    pub async fn place(&self, e: &Entry) -> Option<u64> {
        match e.rv() {
            Some(rv) => Some(rv),
            None if e.verb == "delete" && e.resource == "gameservers" && e.ok() => {
                Some(self.deleted(&e.name).await)
            }
            None => None,
        }
    }

    /// This test's entries of the audit log: its node, its namespace.
    pub fn journal(&self) -> Vec<Entry> {
        self.kbox
            .audit()
            .into_iter()
            .filter(|e| (e.resource == "nodes" && e.name == self.node) || e.namespace == self.ns)
            .collect()
    }
}
