//! One world, two backends: the scene a drain scenario plays on, written once and run on the
//! emulator or on the box.
//!
//! A scene is a node with Ready and Allocated game servers (standalone GameServers, no
//! Fleet), Agones' PDB in their namespace, and the agent started with the chart's arguments.
//! A scenario speaks to it through a few verbs ([`Scene::node`], [`Scene::allocate`],
//! [`Scene::end_match`], [`Scene::agent_writes`], [`Scene::stop`], …) and never asks which
//! backend it is on:
//!
//! - [`Backend::Box`] ([`on_box`]): the real control plane, the Agones stand-in, the real
//!   agent process with the chart's arguments, RBAC and Downward API values; writes ordered
//!   by the audit log's resourceVersions.
//! - [`Backend::Emulator`] ([`on_emulator`]): the kube emulator with its cluster model, the
//!   agent in-process (built as the binary builds itself, from the same chart arguments);
//!   writes ordered by the emulator journal's `seq`.
//!
//! Both run the test kit's one Agones model (`lastcall_emulators::cluster::agones`: on the
//! emulator's store there, against the real API server on the box) and play the game, the
//! allocator and the operator with the same API writes ([`crate::kube_box::agones::Agones`]).

pub mod history;
pub mod on_box;
pub mod on_emulator;
pub mod writes;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{DynamicObject, ListParams, Patch, PatchParams};
use serde_json::{Value, json};

use crate::agent::InProcessAgent;
use crate::cluster::GameServerSpec;
use crate::kube::WatchDelay;
use crate::kube_box::agent::{AgentProcess, Extra};
use crate::kube_box::agones::{Agones, Allocation, Crd, Server, on_node};
use crate::kube_box::audit::describe;
use crate::kube_box::proxy::FaultProxy;
use history::History;
use on_box::{BoxScene, DRAIN_LABEL};
use on_emulator::{AGENT_IDENTITY, EmulatorScene};

/// lastcall's fence taint key.
pub const TAINT: &str = "lastcall.dev/draining";

/// The Node (as JSON) is cordoned.
pub fn cordoned(n: &Value) -> bool {
    n.pointer("/spec/unschedulable").and_then(Value::as_bool) == Some(true)
}

/// The Node (as JSON) carries lastcall's fence taint.
pub fn tainted(n: &Value) -> bool {
    n.pointer("/spec/taints")
        .and_then(Value::as_array)
        .is_some_and(|t| t.iter().any(|t| t["key"] == TAINT))
}
pub use writes::Write;

/// Where a scene runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// The test kit's kube emulator and cluster model; the agent in-process.
    Emulator,
    /// A real kube-apiserver, etcd, controllers, scheduler and kwok; the agent process.
    Box,
}

enum Side {
    Emulator(Box<EmulatorScene>),
    /// The box, and the fault proxy the agent talks to the API server through (once started).
    Box(Box<BoxScene>, Option<Box<FaultProxy>>),
}

/// A place in the backend's journal (the emulator's `seq`, the audit log's line), to ask
/// what came after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Mark(u64);

enum Agent {
    InProcess(InProcessAgent),
    Process(Box<AgentProcess>),
}

/// A node with game servers, on one backend, and (once started) its agent.
pub struct Scene {
    pub backend: Backend,
    pub ns: String,
    pub node: String,
    /// The Ready servers the scene began with.
    pub idle: Vec<Server>,
    /// The servers allocated before the agent started.
    pub matches: Vec<Server>,
    client: kube::Client,
    agones: Agones,
    side: Side,
    agent: Option<Agent>,
    history: History,
}

impl Scene {
    /// `idle` Ready and `matches` Allocated servers on one node, named `gs-0`, `gs-1`, …
    /// (the matches last), under Agones 1.58+ (`status.nodeName` selectable); `name` names
    /// the box namespace and the node (`{name}-n1`).
    pub async fn start(backend: Backend, name: &str, idle: usize, matches: usize) -> Scene {
        Self::start_with(backend, name, idle, matches, Crd::SelectableNodeName).await
    }

    /// [`Scene::start`] with the GameServer CRD as `crd` (`Crd::LabelsOnly`: an Agones
    /// before 1.58, where the agent claims its servers by label).
    pub async fn start_with(
        backend: Backend,
        name: &str,
        idle: usize,
        matches: usize,
        crd: Crd,
    ) -> Scene {
        let (side, client, ns, node) = match backend {
            Backend::Box => {
                let b = BoxScene::start(name, crd).await;
                let (c, ns, node) = (b.client.clone(), b.ns.clone(), b.node.clone());
                (Side::Box(Box::new(b), None), c, ns, node)
            }
            Backend::Emulator => {
                let e = EmulatorScene::start(name, crd == Crd::SelectableNodeName).await;
                let (c, ns, node) = (e.cluster.client(), e.ns.clone(), e.node.clone());
                (Side::Emulator(Box::new(e)), c, ns, node)
            }
        };
        let history = History::start(&client, &ns)
            .await
            .expect("the scene's watches");
        let agones = match &side {
            Side::Box(b, _) => b.agones.clone(),
            Side::Emulator(e) => e.agones().await,
        };
        let made = futures::future::join_all((0..idle + matches).map(|i| {
            let (agones, node) = (agones.clone(), node.clone());
            async move {
                agones
                    .ready(on_node(GameServerSpec::new(format!("gs-{i}")), &node))
                    .await
            }
        }))
        .await;
        let mut servers: Vec<Server> = made
            .into_iter()
            .map(|r| r.expect("a Ready GameServer"))
            .collect();
        let mut s = Scene {
            backend,
            ns,
            node,
            idle: vec![],
            matches: servers.split_off(idle),
            client,
            agones,
            side,
            agent: None,
            history,
        };
        s.idle = servers;
        for m in s.matches.clone() {
            s.allocate(&m).await;
        }
        s
    }

    /// Starts the node's agent with the chart's arguments plus `extra` (`--flag=value`
    /// replaces the chart's value) and waits until it is ready and sees every server on
    /// its node.
    pub async fn start_agent(&mut self, extra: &[&str]) {
        let extra: Vec<String> = extra.iter().map(|a| a.to_string()).collect();
        let agent = match &mut self.side {
            Side::Box(b, proxy) => {
                let p = b.kbox.fault_proxy().await.expect("the fault proxy");
                let agent = AgentProcess::start_at(
                    &b.kbox,
                    &p.url(),
                    &b.node,
                    Extra {
                        args: extra,
                        env: vec![],
                    },
                )
                .await
                .expect("the agent process");
                agent.ready().await.expect("the agent ready");
                *proxy = Some(Box::new(p));
                Agent::Process(Box::new(agent))
            }
            Side::Emulator(e) => Agent::InProcess(e.start_agent(&extra).await),
        };
        self.agent = Some(agent);
        let n = self.idle.len() + self.matches.len();
        crate::eventually::wait_for("the agent sees every server on its node", || async {
            let seen =
                crate::agent::metric_sum(&self.agent_metrics().await, "lastcall_game_servers", &[]);
            (seen as usize == n).then_some(())
        })
        .await;
    }

    /// A server whose pod is created bound to the node (past the scheduler: as a scheduler
    /// binds from a cache of a moment before the fence), Ready, then allocated: a match on
    /// the node that the agent did not let in.
    pub async fn late_server(&self, name: &str) -> Server {
        let s = self
            .agones
            .ready(on_node(GameServerSpec::new(name), &self.node).bound_to(self.node.as_str()))
            .await
            .expect("the late server");
        self.allocate(&s).await;
        s
    }

    /// Waits until the agent has completed `n` reconcile passes that each began after this
    /// call (its own count, `lastcall_reconciles_total`), each asked for by a foreign
    /// annotation on the node (any Node change wakes the agent), not waited for by a clock.
    pub async fn passes(&self, n: u64) {
        let count = || async {
            crate::agent::metric_sum(
                &self.agent_metrics().await,
                "lastcall_reconciles_total",
                &[],
            ) as u64
        };
        let from = count().await;
        // A pass in flight now may have begun before the call: one more than asked.
        for i in 1..=n + 1 {
            self.patch_node(
                json!({"metadata": {"annotations": {"example.com/nudge": format!("{from}-{i}")}}}),
            )
            .await;
            crate::eventually::wait_for("the agent's next pass", || async {
                (count().await >= from + i).then_some(())
            })
            .await;
        }
    }

    /// The agent's metrics page.
    ///
    /// # Panics
    /// Before [`Scene::start_agent`].
    pub async fn agent_metrics(&self) -> String {
        match self.agent.as_ref().expect("no agent started") {
            Agent::InProcess(a) => a.metrics().await,
            Agent::Process(a) => a.metrics().await,
        }
    }

    pub async fn node(&self) -> Node {
        Api::<Node>::all(self.client.clone())
            .get(&self.node)
            .await
            .expect("the node")
    }

    /// A merge patch of the node, as someone else (the operator, another controller)
    /// writes it.
    pub async fn patch_node(&self, patch: Value) {
        Api::<Node>::all(self.client.clone())
            .patch(&self.node, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .expect("patch the node");
    }

    /// The operator's drain label, set (`true`) or removed.
    pub async fn drain_label(&self, on: bool) {
        let v = if on { json!("true") } else { Value::Null };
        self.patch_node(json!({"metadata": {"labels": {DRAIN_LABEL: v}}}))
            .await;
    }

    /// A merge patch of the GameServer `name` (someone else's labels or annotations).
    pub async fn patch_server(&self, name: &str, patch: Value) {
        self.agones
            .api()
            .patch(name, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .expect("patch the GameServer");
    }

    /// The GameServer `name`, if it exists.
    pub async fn game_server(&self, name: &str) -> Option<DynamicObject> {
        self.agones.get(name).await.expect("read a GameServer")
    }

    /// The scene's pods bound to its node (the game servers'; the agent's own pod lives in
    /// the chart's namespace).
    pub async fn pods_on_node(&self) -> Vec<String> {
        let lp = ListParams::default().fields(&format!("spec.nodeName={}", self.node));
        Api::<Pod>::namespaced(self.client.clone(), &self.ns)
            .list(&lp)
            .await
            .expect("list pods")
            .items
            .into_iter()
            .filter_map(|p| p.metadata.name)
            .collect()
    }

    /// The allocator's Ready → Allocated write (with the resourceVersion it read); it must
    /// win.
    pub async fn allocate(&self, s: &Server) {
        let got = self.agones.allocate(&s.name).await.expect("allocate");
        assert!(
            matches!(got, Allocation::Allocated(_)),
            "{}: {got:?}",
            s.name
        );
    }

    /// The match on `s` ends: the game's SDK `Shutdown()` and its exit, then Agones deletes
    /// the server and its pod goes (the same writes, and the same controller, on both).
    pub async fn end_match(&self, s: &Server) {
        self.agones.shutdown(s).await.expect("shutdown");
    }

    /// The agent's accepted writes to the node and to the scene's pods and GameServers, in
    /// the order the API server applied them ([`writes`]): by the resourceVersion each one
    /// produced, on both backends (a DELETE that removed its object at once, by the
    /// history's DELETED event), so they order against [`Scene::history`] too.
    ///
    /// # Panics
    /// For a write whose place neither answer nor history gives (an Eviction's `Status`
    /// answer carries no resourceVersion): a scenario that evicts must order those
    /// otherwise.
    pub async fn agent_writes(&self) -> Vec<Write> {
        match &self.side {
            Side::Emulator(e) => {
                let mut out = writes::from_emulator(
                    &e.cluster.emulator().journal().entries(),
                    AGENT_IDENTITY,
                    &self.node,
                    &self.ns,
                );
                for w in &mut out {
                    w.at = match writes::rv_of(&w.response) {
                        Some(rv) => rv,
                        None => {
                            let uid = writes::uid_sent(&w.request).unwrap_or_default();
                            crate::eventually::wait_for(
                                &format!("the DELETED event of {}", w.describe()),
                                || async { self.history.deleted(&w.resource, &w.name, &uid) },
                            )
                            .await
                        }
                    };
                }
                out.sort_by_key(|w| (w.at, w.seq));
                out
            }
            Side::Box(b, _) => {
                let mut out = vec![];
                for e in b.journal().iter().filter(|e| {
                    e.by_agent()
                        && e.is_write()
                        && e.ok()
                        && writes::KINDS.contains(&e.resource.as_str())
                }) {
                    let at = b
                        .place(e)
                        .await
                        .unwrap_or_else(|| panic!("no place in etcd's order for {}", describe(e)));
                    out.push((
                        e.received,
                        Write {
                            at,
                            seq: 0,
                            when: e.received,
                            verb: e.verb.clone(),
                            resource: e.resource.clone(),
                            subresource: e.subresource.clone(),
                            name: e.name.clone(),
                            request: e.request.clone(),
                            response: e.response.clone(),
                        },
                    ));
                }
                // A write that changed nothing keeps the object's revision: then arrival.
                out.sort_by_key(|(received, w)| (w.at, *received));
                out.into_iter().map(|(_, w)| w).collect()
            }
        }
    }

    /// The agent's requests refused 401 or 403, described: on the box its RBAC is the
    /// chart's, so a permission the chart lacks shows here; the emulator authorizes every
    /// caller, so there it only shows a refusal a fault injected.
    pub fn agent_refusals(&self) -> Vec<String> {
        match &self.side {
            Side::Emulator(e) => e
                .cluster
                .emulator()
                .journal()
                .entries()
                .iter()
                .filter(|j| {
                    j.identity.as_deref() == Some(AGENT_IDENTITY)
                        && (j.status == 401 || j.status == 403)
                })
                .map(|j| format!("#{} {} {} -> {}", j.seq, j.method, j.path, j.status))
                .collect(),
            Side::Box(b, _) => b
                .kbox
                .audit()
                .iter()
                .filter(|e| e.by_agent() && (e.code == 401 || e.code == 403))
                .map(describe)
                .collect(),
        }
    }

    /// Every version of the scene's pods and GameServers so far ([`history`]).
    pub fn history(&self) -> &History {
        &self.history
    }

    /// From now on the agent's watches of pods and GameServers deliver nothing (open ones
    /// too) until [`Scene::release_agent_watches`]: its caches lag for as long as the test
    /// says. On the emulator a hold of its watch fault rules; on the box the fault proxy
    /// the agent talks through keeps the lines.
    pub fn hold_agent_watches(&self) {
        match &self.side {
            Side::Emulator(e) => {
                for resource in ["pods", "gameservers"] {
                    e.cluster.emulator().faults().hold_watches(
                        WatchDelay::resource(resource, std::time::Duration::ZERO)
                            .identity(AGENT_IDENTITY),
                    );
                }
            }
            Side::Box(_, proxy) => proxy
                .as_ref()
                .expect("the agent talks through the proxy")
                .hold_watches(
                    "agent watches",
                    &[
                        "/api/v1/pods",
                        "/api/v1/namespaces/*/pods",
                        "/apis/agones.dev/v1/gameservers",
                        "/apis/agones.dev/v1/namespaces/*/gameservers",
                    ],
                ),
        }
    }

    /// Lets the held watch lines go, in order.
    pub fn release_agent_watches(&self) {
        match &self.side {
            Side::Emulator(e) => e.cluster.emulator().faults().release_watch_holds(),
            Side::Box(_, proxy) => proxy
                .as_ref()
                .expect("the agent talks through the proxy")
                .release_watches(),
        }
    }

    /// How many watch lines a hold has kept from the agent so far: the lag happened.
    pub fn held_watch_lines(&self) -> usize {
        match &self.side {
            Side::Emulator(e) => e.cluster.emulator().faults().held_lines(),
            Side::Box(_, proxy) => proxy.as_ref().map_or(0, |p| p.held_lines().len()),
        }
    }

    /// The journal's end now: what the API server receives later comes after it.
    pub fn mark(&self) -> Mark {
        match &self.side {
            Side::Emulator(e) => Mark(
                e.cluster
                    .emulator()
                    .journal()
                    .entries()
                    .last()
                    .map_or(0, |j| j.seq + 1),
            ),
            Side::Box(b, _) => Mark(b.kbox.audit().len() as u64),
        }
    }

    /// The agent's reads (LIST, not watches) of `resource` the API server answered after
    /// `mark`, described (with their query).
    pub fn agent_lists_since(&self, mark: Mark, resource: &str) -> Vec<String> {
        match &self.side {
            Side::Emulator(e) => e
                .cluster
                .emulator()
                .journal()
                .entries()
                .iter()
                .filter(|j| {
                    j.seq >= mark.0
                        && j.identity.as_deref() == Some(AGENT_IDENTITY)
                        && j.verb == crate::kube::journal::Verb::List
                        && j.resource.as_deref() == Some(resource)
                })
                .map(|j| format!("#{} list {}?{} -> {}", j.seq, j.path, j.query, j.status))
                .collect(),
            Side::Box(b, _) => b
                .kbox
                .audit()
                .iter()
                .skip(mark.0 as usize)
                .filter(|e| e.by_agent() && e.verb == "list" && e.resource == resource)
                .map(|e| format!("{} {}", describe(e), e.uri))
                .collect(),
        }
    }

    /// Stops the agent as SIGTERM does (the process must exit on it).
    pub async fn stop(mut self) {
        match self.agent.take() {
            Some(Agent::InProcess(a)) => a.stop().await.expect("the agent stops"),
            Some(Agent::Process(a)) => {
                a.stop().await.expect("the agent stops on SIGTERM");
            }
            None => {}
        }
    }
}
