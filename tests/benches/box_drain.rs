//! The drain on the box (a real kube-apiserver, etcd, controller-manager, scheduler and kwok),
//! next to a bare client measured in the same run.
//!
//! Run: `cargo bench -p lastcall-testkit --bench box_drain [-- fence fleetiq]` (no names =
//! both). `LASTCALL_BOX_BENCH_DRAINS` sets the number of label drains (default 20, plus one
//! uncounted warm-up).
//!
//! 1. **fence**: the real agent process (the chart's arguments and RBAC, a TokenRequest
//!    token) on one kwok node, a bare kube-rs client on an identical node; each holds
//!    [`READY`] Ready and [`ALLOCATED`] Allocated GameServers. Each round the operator PATCHes
//!    `lastcall.dev/drain=true` on one node, then the other; the agent's drain is cancelled
//!    (label removed), the bare node is restored by the bench, and both are refilled. The
//!    latency is from the label PATCH's receipt to the fence PATCH's receipt, both by the API
//!    server's audit log (`requestReceivedTimestamp`), so neither side's client clock counts.
//!    The same rounds give the agent's requests per label drain (its ServiceAccount's
//!    requests from the label to the cancel, watches counted apart) against the bare
//!    client's writes, which are the minimum: 1 fence PATCH, a preconditioned DELETE per
//!    Ready server, a PATCH per Allocated one.
//! 2. **fleetiq**: one FleetIQ drain (the real `lastcall-pubsub`, the GameLift emulator)
//!    of [`READY`] Ready and [`ALLOCATED`] Allocated servers to the deregistration record:
//!    the agent's requests from the `DRAINING` status to 3 s after the record, against the
//!    minimum (the label drain's writes plus the record's PATCH).
//!
//! The bench fails (non-zero exit) if a drain does not complete in time or a count is
//! impossible (fewer agent requests than the minimum, a bare client that wrote other than
//! the minimum, a round without its label or fence in the audit log).

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use futures::StreamExt;
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{Namespace, Node, ServiceAccount};
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::Api;
use kube::api::{DeleteParams, DynamicObject, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::watcher::{self, Event};
use lastcall_agent::keys;
use lastcall_testkit::agent::{metric, metric_sum};
use lastcall_testkit::eventually::try_eventually;
use lastcall_testkit::gamelift::InstanceStatus;
use lastcall_testkit::kube_box::agent::{self as box_agent, AgentProcess, Extra};
use lastcall_testkit::kube_box::agones::{self, Agones, Allocation, Crd, Server};
use lastcall_testkit::kube_box::audit::{Entry, describe};
use lastcall_testkit::kube_box::fleetiq::FleetIq;
use lastcall_testkit::kube_box::{ADMIN_USER, KubeBox, create_node};
use serde_json::{Value, json};

const READY: usize = 3;
const ALLOCATED: usize = 2;
const DEFAULT_DRAINS: usize = 20;
const DRAINS_ENV: &str = "LASTCALL_BOX_BENCH_DRAINS";
const NS: &str = "bench";
const AGENT_NODE: &str = "bench-agent";
const BARE_NODE: &str = "bench-bare";
const FIQ_NODE: &str = "bench-fiq";
/// The bare client's ServiceAccount, bound to the chart's agent ClusterRole (the same rights).
const BARE_SA: &str = "bench-bare";
const BARE_USER: &str = "system:serviceaccount:bench:bench-bare";
/// How long one drain, cancel or refill may take before the bench fails.
const WITHIN: Duration = Duration::from_secs(40);
const EVERY: Duration = Duration::from_millis(50);

fn main() -> anyhow::Result<()> {
    let wanted: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let run = |name: &str| wanted.is_empty() || wanted.iter().any(|w| name.contains(w.as_str()));
    let drains = match std::env::var(DRAINS_ENV) {
        Err(_) => DEFAULT_DRAINS,
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => n,
            _ => bail!("{DRAINS_ENV}={v:?}: want a whole number of drains above 0"),
        },
    };
    let (fence, fleetiq) = (run("fence"), run("fleetiq"));
    if !fence && !fleetiq {
        bail!("nothing to run: the sections are `fence` and `fleetiq`, got {wanted:?}");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(bench(drains, fence, fleetiq))
}

async fn bench(drains: usize, fence: bool, fleetiq: bool) -> anyhow::Result<()> {
    let began = std::time::Instant::now();
    let kbox = KubeBox::start().await?;
    println!(
        "\nbox_drain: the box started in {:.1} s; {} CPUs",
        kbox.started_in().as_secs_f64(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let client = kbox.client().await?;
    agones::install_crd(&client, Crd::SelectableNodeName).await?;
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NS}}))?;
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await?;
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), NS);
    try_eventually(
        "the namespace's default ServiceAccount",
        WITHIN,
        EVERY,
        || async { sas.get_opt("default").await.ok().flatten().map(|_| ()) },
    )
    .await?;
    agones::ensure_pdb(&client, NS).await?;
    box_agent::install_rbac(&client).await?;
    let agones = Agones::new(&client, NS);
    let result = async {
        if fence {
            label_drains(&kbox, &client, &agones, drains).await?;
        }
        if fleetiq {
            fleetiq_drain(&kbox, &client, &agones).await?;
        }
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = &result {
        eprintln!(
            "---- the box's logs (dir {}) ----\n{}\nbox_drain failed: {e:#}",
            kbox.dir().display(),
            kbox.tails(30)
        );
    }
    result?;
    println!(
        "\n(box_drain: {:.1} s wall time)",
        began.elapsed().as_secs_f64()
    );
    Ok(())
}

// ---- shared -----------------------------------------------------------------------------

fn nodes(client: &kube::Client) -> Api<Node> {
    Api::all(client.clone())
}

fn cordoned(n: &Value) -> bool {
    n.pointer("/spec/unschedulable").and_then(Value::as_bool) == Some(true)
}

fn tainted(n: &Value) -> bool {
    n.pointer("/spec/taints")
        .and_then(Value::as_array)
        .is_some_and(|t| t.iter().any(|t| t["key"] == keys::TAINT_DRAINING))
}

async fn node_json(client: &kube::Client, node: &str) -> Option<Value> {
    let n = nodes(client).get(node).await.ok()?;
    serde_json::to_value(n).ok()
}

fn has_deadline(gs: &DynamicObject) -> bool {
    gs.metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(keys::ANN_GS_DEADLINE))
}

/// The operator's drain label on `node`: set, or removed (`None`).
async fn drain_label(client: &kube::Client, node: &str, on: bool) -> anyhow::Result<()> {
    let v = if on { json!("true") } else { Value::Null };
    nodes(client)
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {keys::LABEL_MANUAL_DRAIN: v}}})),
        )
        .await?;
    Ok(())
}

/// `READY` Ready servers on `node`, created together.
async fn fill(agones: &Agones, node: &str, tag: &str) -> anyhow::Result<Vec<Server>> {
    let names: Vec<String> = (0..READY).map(|i| format!("{node}-{tag}-{i}")).collect();
    futures::future::try_join_all(names.iter().map(|n| agones.ready_server(n, node))).await
}

/// `ALLOCATED` Allocated servers on `node`.
async fn busy(agones: &Agones, node: &str) -> anyhow::Result<Vec<Server>> {
    let mut out = Vec::new();
    for i in 0..ALLOCATED {
        let s = agones
            .ready_server(&format!("{node}-busy-{i}"), node)
            .await?;
        let got = agones.allocate(&s.name).await?;
        ensure!(
            matches!(got, Allocation::Allocated(_)),
            "allocating {}: {got:?}",
            s.name
        );
        out.push(s);
    }
    Ok(out)
}

/// Waits until `node` is fenced, `released` are gone and `protected` carry the drain deadline.
async fn drained(
    client: &kube::Client,
    agones: &Agones,
    node: &str,
    released: &[Server],
    protected: &[Server],
) -> anyhow::Result<()> {
    try_eventually(
        &format!("{node} fenced, its Ready servers gone, its Allocated ones protected"),
        WITHIN,
        EVERY,
        || async {
            let n = node_json(client, node).await?;
            if !(cordoned(&n) && tainted(&n)) {
                return None;
            }
            for s in released {
                if agones.get(&s.name).await.ok()?.is_some() {
                    return None;
                }
            }
            for s in protected {
                if !has_deadline(&agones.get(&s.name).await.ok()??) {
                    return None;
                }
            }
            Some(())
        },
    )
    .await?;
    Ok(())
}

/// Waits until `node` is unfenced and `protected` no longer carry the drain deadline.
async fn restored(
    client: &kube::Client,
    agones: &Agones,
    node: &str,
    protected: &[Server],
) -> anyhow::Result<()> {
    try_eventually(
        &format!("{node} unfenced and its servers unprotected"),
        WITHIN,
        EVERY,
        || async {
            let n = node_json(client, node).await?;
            if cordoned(&n) || tainted(&n) {
                return None;
            }
            for s in protected {
                if has_deadline(&agones.get(&s.name).await.ok()??) {
                    return None;
                }
            }
            Some(())
        },
    )
    .await?;
    Ok(())
}

/// Waits until the agent counts `n` GameServers on its node.
async fn agent_sees(agent: &AgentProcess, n: usize) -> anyhow::Result<()> {
    try_eventually(
        "the agent sees every server on its node",
        WITHIN,
        EVERY,
        || async {
            let seen = metric_sum(&agent.metrics().await, "lastcall_game_servers", &[]);
            (seen as usize == n).then_some(())
        },
    )
    .await?;
    Ok(())
}

fn label_value(e: &Entry) -> Option<&Value> {
    e.sent(&format!(
        "/metadata/labels/{}",
        keys::LABEL_MANUAL_DRAIN.replace('/', "~1")
    ))
}

/// The operator's label writes on `node`, in order: (set?, entry).
fn label_writes<'a>(log: &'a [Entry], node: &str) -> Vec<(bool, &'a Entry)> {
    log.iter()
        .filter(|e| {
            e.user == ADMIN_USER
                && e.verb == "patch"
                && e.resource == "nodes"
                && e.name == node
                && e.ok()
        })
        .filter_map(|e| match label_value(e) {
            Some(Value::String(v)) if v == "true" => Some((true, e)),
            Some(Value::Null) => Some((false, e)),
            _ => None,
        })
        .collect()
}

fn micros(e: &Entry) -> anyhow::Result<i64> {
    Ok(e.received
        .with_context(|| format!("no requestReceivedTimestamp: {}", describe(e)))?
        .as_microsecond())
}

/// The first write by `user` to `node` in `[from, to)` (receipt, µs) that cordons and taints.
fn fence_in<'a>(
    log: &'a [Entry],
    user: &str,
    node: &str,
    from: i64,
    to: i64,
) -> anyhow::Result<&'a Entry> {
    let mut first = None;
    for e in log.iter().filter(|e| {
        e.user == user && e.is_write() && e.resource == "nodes" && e.name == node && e.ok()
    }) {
        let at = micros(e)?;
        if at >= from && at < to && (cordoned(&e.response) || tainted(&e.response)) {
            first = Some(e);
            break;
        }
    }
    let e = first.with_context(|| format!("no fence write by {user} on {node} in the round"))?;
    ensure!(
        cordoned(&e.response) && tainted(&e.response),
        "the fence must cordon and taint in one write: {}",
        describe(e)
    );
    Ok(e)
}

/// Nearest-rank quantile of sorted samples.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    let i = ((sorted.len() as f64 * q).ceil() as usize)
        .saturating_sub(1)
        .min(sorted.len().saturating_sub(1));
    sorted.get(i).copied().unwrap_or(f64::NAN)
}

struct Spread {
    p50: f64,
    p90: f64,
    max: f64,
}

fn spread(mut v: Vec<f64>) -> Spread {
    v.sort_by(f64::total_cmp);
    Spread {
        p50: quantile(&v, 0.5),
        p90: quantile(&v, 0.9),
        max: v.last().copied().unwrap_or(f64::NAN),
    }
}

/// The agent's requests among `entries`: non-watch ones by "verb resource code", and watches.
fn agent_requests<'a>(
    entries: impl Iterator<Item = &'a Entry>,
) -> (BTreeMap<String, usize>, usize) {
    let mut by_kind = BTreeMap::new();
    let mut watches = 0;
    for e in entries.filter(|e| e.by_agent()) {
        if e.verb == "watch" {
            watches += 1;
        } else {
            let sub = if e.subresource.is_empty() {
                String::new()
            } else {
                format!("/{}", e.subresource)
            };
            *by_kind
                .entry(format!("{} {}{sub} {}", e.verb, e.resource, e.code))
                .or_default() += 1;
        }
    }
    (by_kind, watches)
}

// ---- the bare client --------------------------------------------------------------------

/// A bare kube-rs client: a Node watch on its one node and a GameServer watch on the servers
/// there (so it reads nothing else), reacting to the drain label with the minimum writes:
/// one cordon+taint PATCH, then a preconditioned DELETE per Ready server and a deadline
/// PATCH per Allocated one, all at once.
struct Bare {
    servers: Arc<Mutex<BTreeMap<String, DynamicObject>>>,
    /// Whether it has seen its node without the label since it last acted (ready to act).
    armed: Arc<Mutex<bool>>,
    errors: Arc<Mutex<Vec<String>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Bare {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Bare {
    /// Its own ServiceAccount (so the audit log tells its requests apart), bound to the
    /// chart's agent ClusterRole, with a TokenRequest token.
    async fn start(kbox: &KubeBox, admin: &kube::Client, node: &str) -> anyhow::Result<Bare> {
        let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": BARE_SA}}))?;
        let sas: Api<ServiceAccount> = Api::namespaced(admin.clone(), NS);
        sas.create(&PostParams::default(), &sa).await?;
        let crb: ClusterRoleBinding = serde_json::from_value(json!({
            "metadata": {"name": BARE_SA},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": box_agent::SERVICE_ACCOUNT},
            "subjects": [{"kind": "ServiceAccount", "name": BARE_SA, "namespace": NS}],
        }))?;
        Api::<ClusterRoleBinding>::all(admin.clone())
            .create(&PostParams::default(), &crb)
            .await?;
        let req: TokenRequest = serde_json::from_value(json!({
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"audiences": [], "expirationSeconds": 3600},
        }))?;
        let got: TokenRequest = sas
            .create_subresource("token", BARE_SA, &PostParams::default(), &req)
            .await?;
        let token = got.status.context("TokenRequest without status")?.token;
        let config =
            lastcall_testkit::kube_box::config_from(&kbox.kubeconfig(&token, BARE_SA)).await?;
        let client = kube::Client::try_from(config)?;
        let bare = Bare {
            servers: Arc::default(),
            armed: Arc::default(),
            errors: Arc::default(),
            tasks: Vec::new(),
        };
        let gs: Api<DynamicObject> =
            Api::namespaced_with(client.clone(), NS, &agones::gameservers_resource());
        let gs_task = {
            let (servers, errors) = (bare.servers.clone(), bare.errors.clone());
            let cfg = watcher::Config::default().fields(&format!("status.nodeName={node}"));
            tokio::spawn(async move {
                let mut stream = watcher::watcher(gs, cfg).boxed();
                while let Some(ev) = stream.next().await {
                    let mut s = lock(&servers);
                    match ev {
                        Ok(Event::Init) => s.clear(),
                        Ok(Event::InitApply(o) | Event::Apply(o)) => {
                            if let Some(n) = o.metadata.name.clone() {
                                s.insert(n, o);
                            }
                        }
                        Ok(Event::Delete(o)) => {
                            if let Some(n) = &o.metadata.name {
                                s.remove(n);
                            }
                        }
                        Ok(Event::InitDone) => {}
                        Err(e) => lock(&errors).push(format!("GameServer watch: {e}")),
                    }
                }
            })
        };
        let node_task = {
            let (servers, armed, errors) = (
                bare.servers.clone(),
                bare.armed.clone(),
                bare.errors.clone(),
            );
            let api: Api<Node> = Api::all(client.clone());
            let gs: Api<DynamicObject> =
                Api::namespaced_with(client, NS, &agones::gameservers_resource());
            let cfg = watcher::Config::default().fields(&format!("metadata.name={node}"));
            let node = node.to_string();
            tokio::spawn(async move {
                let mut stream = watcher::watcher(api.clone(), cfg).boxed();
                while let Some(ev) = stream.next().await {
                    let n = match ev {
                        Ok(Event::InitApply(n) | Event::Apply(n)) => n,
                        Ok(_) => continue,
                        Err(e) => {
                            lock(&errors).push(format!("Node watch: {e}"));
                            continue;
                        }
                    };
                    let labelled = n
                        .metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get(keys::LABEL_MANUAL_DRAIN))
                        .is_some_and(|v| v == "true");
                    let act = {
                        let mut a = lock(&armed);
                        let act = labelled && *a;
                        *a = !labelled;
                        act
                    };
                    if act && let Err(e) = bare_drain(&api, &gs, &node, &servers).await {
                        lock(&errors).push(format!("drain: {e:#}"));
                    }
                }
            })
        };
        let mut bare = bare;
        bare.tasks = vec![gs_task, node_task];
        Ok(bare)
    }

    /// Waits until it has seen its node unlabelled and `ready` Ready plus `allocated`
    /// Allocated servers on it, so the next label is a drain it acts on.
    async fn primed(&self, ready: usize, allocated: usize) -> anyhow::Result<()> {
        try_eventually(
            "the bare client armed and seeing every server on its node",
            WITHIN,
            EVERY,
            || async {
                let s = lock(&self.servers);
                let count = |state: &str| {
                    s.values()
                        .filter(|g| g.data.pointer("/status/state") == Some(&json!(state)))
                        .count()
                };
                (*lock(&self.armed) && count("Ready") == ready && count("Allocated") == allocated)
                    .then_some(())
            },
        )
        .await?;
        self.check()
    }

    fn check(&self) -> anyhow::Result<()> {
        let errors = lock(&self.errors);
        ensure!(errors.is_empty(), "the bare client failed: {errors:?}");
        Ok(())
    }
}

/// The bare client's drain: the fence, then every release and protection at once.
async fn bare_drain(
    nodes: &Api<Node>,
    gs: &Api<DynamicObject>,
    node: &str,
    servers: &Mutex<BTreeMap<String, DynamicObject>>,
) -> anyhow::Result<()> {
    // A strategic merge patch: taints merge by key, so nobody else's taint is lost.
    nodes
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Strategic(json!({"spec": {"unschedulable": true, "taints": [
                {"key": keys::TAINT_DRAINING, "value": "manual", "effect": "NoSchedule"}
            ]}})),
        )
        .await?;
    let snapshot: Vec<DynamicObject> = lock(servers).values().cloned().collect();
    let deadline = (jiff::Timestamp::now() + jiff::SignedDuration::from_secs(3600)).to_string();
    let writes = snapshot.into_iter().filter_map(|g| {
        let name = g.metadata.name.clone()?;
        let gs = gs.clone();
        let deadline = deadline.clone();
        let state = g.data.pointer("/status/state").and_then(Value::as_str);
        match state {
            Some("Ready") if g.metadata.deletion_timestamp.is_none() => {
                let dp = DeleteParams {
                    preconditions: Some(Preconditions {
                        uid: g.metadata.uid.clone(),
                        resource_version: g.metadata.resource_version.clone(),
                    }),
                    ..DeleteParams::default()
                };
                Some(futures::future::Either::Left(async move {
                    gs.delete(&name, &dp).await.map(|_| ())
                }))
            }
            Some("Allocated") => Some(futures::future::Either::Right(async move {
                gs.patch(
                    &name,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"metadata": {"annotations": {
                        keys::ANN_GS_DEADLINE: deadline}}})),
                )
                .await
                .map(|_| ())
            })),
            _ => None,
        }
    });
    futures::future::try_join_all(writes).await?;
    Ok(())
}

// ---- 1. label drains: fence latency and requests ----------------------------------------

async fn label_drains(
    kbox: &KubeBox,
    client: &kube::Client,
    agones: &Agones,
    drains: usize,
) -> anyhow::Result<()> {
    futures::future::try_join(
        create_node(client, AGENT_NODE),
        create_node(client, BARE_NODE),
    )
    .await?;
    let (agent_busy, bare_busy) =
        futures::future::try_join(busy(agones, AGENT_NODE), busy(agones, BARE_NODE)).await?;
    let agent = AgentProcess::start(kbox, AGENT_NODE, Extra::default()).await?;
    agent.ready().await?;
    let bare = Bare::start(kbox, client, BARE_NODE).await?;

    // Round 0 warms both sides up and is not counted.
    for round in 0..=drains {
        let tag = format!("r{round}");
        let (agent_ready, bare_ready) = futures::future::try_join(
            fill(agones, AGENT_NODE, &tag),
            fill(agones, BARE_NODE, &tag),
        )
        .await?;
        agent_sees(&agent, READY + ALLOCATED).await?;
        bare.primed(READY, ALLOCATED).await?;

        drain_label(client, AGENT_NODE, true).await?;
        drained(client, agones, AGENT_NODE, &agent_ready, &agent_busy)
            .await
            .with_context(|| format!("the agent's drain, round {round}"))?;
        drain_label(client, AGENT_NODE, false).await?;

        drain_label(client, BARE_NODE, true).await?;
        drained(client, agones, BARE_NODE, &bare_ready, &bare_busy)
            .await
            .with_context(|| format!("the bare client's drain, round {round}"))?;
        bare.check()?;
        // The bench, not the bare client, undoes its drain.
        nodes(client)
            .patch(
                BARE_NODE,
                &PatchParams::default(),
                &Patch::Merge(json!({
                    "metadata": {"labels": {keys::LABEL_MANUAL_DRAIN: null}},
                    "spec": {"unschedulable": null, "taints": null},
                })),
            )
            .await?;
        for s in &bare_busy {
            agones
                .api()
                .patch(
                    &s.name,
                    &PatchParams::default(),
                    &Patch::Merge(
                        json!({"metadata": {"annotations": {keys::ANN_GS_DEADLINE: null}}}),
                    ),
                )
                .await?;
        }
        futures::future::try_join(
            restored(client, agones, AGENT_NODE, &agent_busy),
            restored(client, agones, BARE_NODE, &bare_busy),
        )
        .await
        .with_context(|| format!("the cancel, round {round}"))?;
        eprint!(".");
    }
    eprintln!();
    // The agent's last cancel writes are answered before the log is read.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let log = kbox.audit();
    let m = agent.metrics().await;
    let agent_labels = label_writes(&log, AGENT_NODE);
    let bare_labels = label_writes(&log, BARE_NODE);
    let ons = |w: &[(bool, &Entry)]| w.iter().filter(|(on, _)| *on).count();
    ensure!(
        ons(&agent_labels) == drains + 1 && ons(&bare_labels) == drains + 1,
        "{} and {} label PATCHes in the audit log for {} rounds",
        ons(&agent_labels),
        ons(&bare_labels),
        drains + 1
    );
    // Each round: [label on, the next label write) on each node.
    let windows = |w: &[(bool, &Entry)]| -> anyhow::Result<Vec<(i64, i64)>> {
        let mut out = Vec::new();
        for (i, (on, e)) in w.iter().enumerate() {
            if *on {
                let (off_on, off) = w
                    .get(i + 1)
                    .with_context(|| format!("no label removal after {}", describe(e)))?;
                ensure!(!off_on, "two label PATCHes in a row: {}", describe(off));
                out.push((micros(e)?, micros(off)?));
            }
        }
        Ok(out)
    };
    let agent_windows = windows(&agent_labels)?;
    let bare_windows = windows(&bare_labels)?;
    let minimum = 1 + READY + ALLOCATED;
    let mut agent_ms = Vec::new();
    let mut bare_ms = Vec::new();
    let mut agent_total: BTreeMap<String, usize> = BTreeMap::new();
    let mut agent_counts = Vec::new();
    let mut agent_watches = 0;
    for (round, (&(a_on, a_off), &(b_on, b_off))) in
        agent_windows.iter().zip(&bare_windows).enumerate()
    {
        let a_fence = fence_in(&log, box_agent_user(), AGENT_NODE, a_on, a_off)?;
        let b_fence = fence_in(&log, BARE_USER, BARE_NODE, b_on, b_off)?;
        let (a, b) = (micros(a_fence)? - a_on, micros(b_fence)? - b_on);
        ensure!(
            a >= 0 && b >= 0,
            "round {round}: a fence received before its label ({a} µs, {b} µs)"
        );
        let in_window = |from: i64, to: i64| {
            let log = &log;
            log.iter().filter(move |e| {
                e.received
                    .is_some_and(|t| (from..to).contains(&t.as_microsecond()))
            })
        };
        let bare_writes: Vec<&Entry> = in_window(b_on, b_off)
            .filter(|e| e.user == BARE_USER)
            .collect();
        let bare_ok = bare_writes.iter().filter(|e| e.ok()).count();
        ensure!(
            bare_ok == minimum && bare_writes.len() == minimum,
            "round {round}: the bare client wrote {} times ({bare_ok} accepted), not {minimum}:\n{}",
            bare_writes.len(),
            bare_writes
                .iter()
                .map(|e| describe(e))
                .collect::<Vec<_>>()
                .join("\n")
        );
        let (by_kind, watches) = agent_requests(in_window(a_on, a_off));
        let total: usize = by_kind.values().sum();
        let deletes: usize = by_kind
            .iter()
            .filter(|(k, _)| k.starts_with("delete gameservers 2"))
            .map(|(_, n)| n)
            .sum();
        ensure!(
            total >= minimum && deletes == READY,
            "round {round}: {total} agent requests ({deletes} accepted GameServer DELETEs) for a drain that needs at least {minimum} ({READY} DELETEs): {by_kind:?}"
        );
        if round > 0 {
            agent_ms.push(a as f64 / 1e3);
            bare_ms.push(b as f64 / 1e3);
            agent_counts.push(total as f64);
            agent_watches += watches;
            for (k, n) in by_kind {
                *agent_total.entry(k).or_default() += n;
            }
        }
    }
    let refused = metric(&m, "lastcall_releases_total", &[("result", "conflict")]).unwrap_or(0.0);
    let a = spread(agent_ms);
    let b = spread(bare_ms);
    let c = spread(agent_counts);
    println!(
        "\n## 1. Label drains on the box: {drains} drains of a node with {READY} Ready + {ALLOCATED} Allocated servers (plus one warm-up)\n"
    );
    println!("| label PATCH received → fence PATCH received | p50 | p90 | max |");
    println!("|---|---|---|---|");
    println!(
        "| lastcall agent (real process, chart args) | {:.1} ms | {:.1} ms | {:.1} ms |",
        a.p50, a.p90, a.max
    );
    println!(
        "| bare kube-rs client (Node watch, one PATCH) | {:.1} ms | {:.1} ms | {:.1} ms |",
        b.p50, b.p90, b.max
    );
    println!(
        "| **ratio agent / bare** | **{:.1}×** | **{:.1}×** | **{:.1}×** |",
        a.p50 / b.p50,
        a.p90 / b.p90,
        a.max / b.max
    );
    println!();
    println!("| requests per label drain (label → drained, up to the cancel) | p50 | p90 | max |");
    println!("|---|---|---|---|");
    println!(
        "| lastcall agent, watches excluded | {:.0} | {:.0} | {:.0} |",
        c.p50, c.p90, c.max
    );
    println!(
        "| bare client (measured; its only other requests are its 2 watches) | {minimum} | {minimum} | {minimum} |"
    );
    println!(
        "| **ratio agent / bare** | **{:.1}×** | **{:.1}×** | **{:.1}×** |",
        c.p50 / minimum as f64,
        c.p90 / minimum as f64,
        c.max / minimum as f64
    );
    println!();
    println!(
        "Agent requests per drain by kind (mean over {drains}); watches opened in the windows: {agent_watches}; release conflicts over the run: {refused}"
    );
    println!();
    println!("| request | per drain |");
    println!("|---|---|");
    for (k, n) in &agent_total {
        println!("| {k} | {:.2} |", *n as f64 / drains as f64);
    }
    agent.stop().await?;
    bare.check()?;
    Ok(())
}

fn box_agent_user() -> &'static str {
    lastcall_testkit::kube_box::audit::AGENT_USER
}

// ---- 2. one FleetIQ drain: requests ----------------------------------------------------

async fn fleetiq_drain(
    kbox: &KubeBox,
    client: &kube::Client,
    agones: &Agones,
) -> anyhow::Result<()> {
    create_node(client, FIQ_NODE).await?;
    let protected = busy(agones, FIQ_NODE).await?;
    let released = fill(agones, FIQ_NODE, "fiq").await?;
    let mut fiq = FleetIq::start(FIQ_NODE).await?;
    let agent = AgentProcess::start(kbox, FIQ_NODE, fiq.agent_extra()).await?;
    agent.ready().await?;
    try_eventually("registered with FleetIQ", WITHIN, EVERY, || async {
        (fiq.gl.count("RegisterGameServer") == 1).then_some(())
    })
    .await?;
    agent_sees(&agent, READY + ALLOCATED).await?;
    // The agent's start-up writes are done before the clock starts.
    try_eventually(
        "the registration record on the Node",
        WITHIN,
        EVERY,
        || async {
            let n = node_json(client, FIQ_NODE).await?;
            n.pointer(&format!(
                "/metadata/annotations/{}",
                keys::ANN_REGISTERED.replace('/', "~1")
            ))
            .map(|_| ())
        },
    )
    .await?;
    let signalled = jiff::Timestamp::now();
    fiq.set(InstanceStatus::Draining);
    drained(client, agones, FIQ_NODE, &released, &protected)
        .await
        .context("the FleetIQ drain")?;
    for s in &protected {
        agones.shutdown(s).await?;
    }
    try_eventually(
        "deregistered and recorded on the Node",
        Duration::from_secs(60),
        Duration::from_millis(100),
        || async {
            let n = node_json(client, FIQ_NODE).await?;
            let recorded = n
                .pointer(&format!(
                    "/metadata/annotations/{}",
                    keys::ANN_DEREGISTERED.replace('/', "~1")
                ))
                .is_some();
            (fiq.gl.count("DeregisterGameServer") == 1 && recorded).then_some(())
        },
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    ensure!(fiq.pubsub_running(), "lastcall-pubsub exited");
    ensure!(
        fiq.gl.count("DeregisterGameServer") == 1,
        "deregistered {} times",
        fiq.gl.count("DeregisterGameServer")
    );
    let log = kbox.audit();
    let (by_kind, watches) = agent_requests(log.iter().filter(|e| e.received >= Some(signalled)));
    let total: usize = by_kind.values().sum();
    let minimum = 1 + READY + ALLOCATED + 1;
    let count = |prefix: &str| -> usize {
        by_kind
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(_, n)| n)
            .sum()
    };
    ensure!(
        total >= minimum && count("delete gameservers 2") == READY && count("patch nodes 2") >= 2,
        "{total} agent requests for a FleetIQ drain that needs at least {minimum}: {by_kind:?}"
    );
    println!(
        "\n## 2. One FleetIQ drain on the box: {READY} Ready + {ALLOCATED} Allocated, DRAINING → 3 s after the deregistration record\n"
    );
    println!("| requests | count |");
    println!("|---|---|");
    println!("| lastcall agent, watches excluded | {total} |");
    println!(
        "| bare minimum (1 fence PATCH, {READY} preconditioned DELETEs, {ALLOCATED} protect PATCHes, 1 deregistration-record PATCH) | {minimum} |"
    );
    println!(
        "| **ratio agent / bare** | **{:.1}×** |",
        total as f64 / minimum as f64
    );
    println!("| agent watches opened in the window | {watches} |");
    println!();
    println!("| request | count |");
    println!("|---|---|");
    for (k, n) in &by_kind {
        println!("| {k} | {n} |");
    }
    agent.stop().await?;
    Ok(())
}
