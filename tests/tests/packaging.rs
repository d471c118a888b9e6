//! The shipped artifacts stay true to the binaries:
//!
//! - RBAC: the chart's rules (as rendered in `manifests/`) equal the API calls the agent makes
//!   in end-to-end flows against the emulator — nothing used is missing, nothing granted is
//!   unused — and pubsub calls nothing and is granted nothing;
//! - the admission policies' table (`charts/lastcall/agent-writes.yaml`): every write the
//!   agents make in the same flows is one it lists, and every entry is a write they make;
//! - IAM: the policies `docs/install.md` gives equal the AWS SDK operations each binary's code
//!   calls, both directions;
//! - every agent and pubsub flag has a chart value with the binary's default, passed by the
//!   templates;
//! - the agent DaemonSet tolerates every taint lastcall and the platforms put on a draining
//!   node, and is scheduled like a node agent;
//! - `docs/configuration.md` is what the binaries' `--help` says;
//! - the Grafana dashboard and the alert rules use only metrics the binaries export, and the
//!   binaries' real `/metrics` passes `promtool check metrics`;
//! - the runbook's `kubectl` commands (`docs/operations.md`) work, run by the real `kubectl`
//!   against the emulator while a real agent drains.
//!
//! `manifests/` itself is checked against the chart by `hack/chart.py manifests --check` (CI),
//! so these tests and that check together tie the chart to the code.
//!
//! `LASTCALL_BLESS=1 cargo test -p lastcall-testkit --test packaging configuration` rewrites
//! `docs/configuration.md` (that is what `hack/gen-docs.sh` runs).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};
use lastcall_common::fleetiq::InstanceStatus as Status;
use lastcall_testkit::agent::{InProcessAgent, config, scrape};
use lastcall_testkit::agent_writes::{self, Options, Table};
use lastcall_testkit::bins::workspace_binary;
use lastcall_testkit::cluster::GameServerState as S;
use lastcall_testkit::cluster::fixtures::toleration_equal;
use lastcall_testkit::eventually::wait_for;
use lastcall_testkit::gamelift::{GameLiftEmulator, InstanceStatus as GlStatus};
use lastcall_testkit::gce::GceMetadataEmulator;
use lastcall_testkit::kube::JournalEntry;
use lastcall_testkit::net::free_port;
use lastcall_testkit::world::{World, WorldSpec, cordoned, has_taint, subscribed};
use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_path_buf()
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo().join(rel)).unwrap_or_else(|e| panic!("reading {rel}: {e}"))
}

/// Every object of a multi-document YAML file under `manifests/`.
fn manifest(file: &str) -> Vec<Value> {
    let text = read(&format!("manifests/{file}"));
    let docs: Vec<Value> = serde_saphyr::from_multiple(&text)
        .unwrap_or_else(|e| panic!("manifests/{file} is not YAML: {e}"));
    docs.into_iter().filter(Value::is_object).collect()
}

fn find<'a>(objs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objs.iter().filter(|o| o["kind"] == kind).collect()
}

fn agent_daemonset(objs: &[Value]) -> &Value {
    let ds = find(objs, "DaemonSet");
    assert_eq!(ds.len(), 1, "one agent DaemonSet");
    ds[0]
}

// ---------------------------------------------------------------------------------------
// RBAC
// ---------------------------------------------------------------------------------------

/// One permission as RBAC states it: (verb, API group, resource, subresource).
type Permission = (String, String, String, String);

/// The API group of a request path: `/api/v1/...` is the core group `""`.
fn api_group(path: &str) -> Option<String> {
    if path.starts_with("/api/") {
        Some(String::new())
    } else {
        path.strip_prefix("/apis/")
            .and_then(|rest| rest.split('/').next())
            .map(str::to_string)
    }
}

/// The permissions `identities` exercised, from the emulator's journal. Non-resource paths
/// (discovery) are left out: every authenticated client may read them (`system:discovery`).
fn used(entries: &[JournalEntry], identities: &[&str]) -> BTreeSet<Permission> {
    entries
        .iter()
        .filter(|e| {
            e.identity
                .as_deref()
                .is_some_and(|i| identities.contains(&i))
        })
        .filter_map(|e| {
            let resource = e.resource.clone()?;
            Some((
                e.verb.as_str().to_string(),
                api_group(&e.path)?,
                resource,
                e.subresource.clone().unwrap_or_default(),
            ))
        })
        .collect()
}

/// The permissions the manifests grant the ServiceAccount `sa`, through every
/// (Cluster)RoleBinding naming it. Wildcards fail the test outright.
fn granted(objs: &[Value], sa: &str) -> BTreeSet<Permission> {
    let mut out = BTreeSet::new();
    for binding in objs
        .iter()
        .filter(|o| o["kind"] == "ClusterRoleBinding" || o["kind"] == "RoleBinding")
    {
        let subjects = binding["subjects"].as_array().cloned().unwrap_or_default();
        if !subjects
            .iter()
            .any(|s| s["kind"] == "ServiceAccount" && s["name"] == sa)
        {
            continue;
        }
        let role_ref = &binding["roleRef"];
        let role = objs
            .iter()
            .find(|o| o["kind"] == role_ref["kind"] && o["metadata"]["name"] == role_ref["name"])
            .unwrap_or_else(|| panic!("{role_ref} is not in the manifests"));
        for rule in role["rules"].as_array().cloned().unwrap_or_default() {
            let list = |k: &str| -> Vec<String> {
                rule[k]
                    .as_array()
                    .unwrap_or_else(|| panic!("rule without {k}: {rule}"))
                    .iter()
                    .map(|v| v.as_str().unwrap_or_default().to_string())
                    .collect()
            };
            for verb in list("verbs") {
                for group in list("apiGroups") {
                    for resource in list("resources") {
                        assert!(
                            !verb.contains('*') && !group.contains('*') && !resource.contains('*'),
                            "wildcard in {rule}"
                        );
                        let (res, sub) = resource.split_once('/').unwrap_or((&resource, ""));
                        out.insert((verb.clone(), group.clone(), res.into(), sub.into()));
                    }
                }
            }
        }
    }
    out
}

fn show(set: &BTreeSet<Permission>) -> String {
    set.iter()
        .map(|(v, g, r, s)| {
            let g = if g.is_empty() { "core" } else { g };
            let s = if s.is_empty() {
                String::new()
            } else {
                format!("/{s}")
            };
            format!("  {v} {g} {r}{s}")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The agent container's arguments.
fn agent_args(objs: &[Value]) -> Vec<String> {
    agent_daemonset(objs)["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .expect("the agent container has args")
        .iter()
        .filter_map(|a| a.as_str().map(str::to_string))
        .collect()
}

/// The calls `--metrics-auth=kubernetes` makes for each scraper's token. The emulator serves
/// no TokenReview, so the flows here never make them: `box_metrics_auth.rs` proves on the
/// real API server (its audit log) that the agent makes both, and needs both.
fn metrics_auth_calls() -> BTreeSet<Permission> {
    [
        ("authentication.k8s.io", "tokenreviews"),
        ("authorization.k8s.io", "subjectaccessreviews"),
    ]
    .into_iter()
    .map(|(g, r)| ("create".into(), g.into(), r.into(), String::new()))
    .collect()
}

/// Both directions: nothing used is missing, nothing granted is unused.
fn assert_rbac_matches(file: &str, calls: &BTreeSet<Permission>) {
    let objs = manifest(file);
    let sa = agent_daemonset(&objs)["spec"]["template"]["spec"]["serviceAccountName"]
        .as_str()
        .expect("the agent DaemonSet names its ServiceAccount")
        .to_string();
    let mut calls = calls.clone();
    if agent_args(&objs)
        .iter()
        .any(|a| a == "--metrics-auth=kubernetes")
    {
        calls.extend(metrics_auth_calls());
    }
    let calls = &calls;
    let rules = granted(&objs, &sa);
    let missing: BTreeSet<_> = calls.difference(&rules).cloned().collect();
    let unused: BTreeSet<_> = rules.difference(calls).cloned().collect();
    assert!(
        missing.is_empty() && unused.is_empty(),
        "manifests/{file}: the agent's RBAC differs from what it calls.\n\
         Used but not granted (add a rule to charts/lastcall/templates/agent-rbac.yaml):\n{}\n\
         Granted but never used (remove it):\n{}\n\
         Then run hack/chart.py manifests.",
        show(&missing),
        show(&unused)
    );
}

/// Labels (`Some`) or unlabels (`None`) a Node as an operator would.
async fn label_node(w: &World, node: &str, key: &str, value: Option<&str>) {
    let c = w.cluster.emulator().client().await.unwrap();
    Api::<Node>::all(c)
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(&serde_json::json!({"metadata": {"labels": {key: value}}})),
        )
        .await
        .unwrap();
}

async fn node(w: &World, name: &str) -> Node {
    Api::<Node>::all(w.cluster.client())
        .get(name)
        .await
        .unwrap()
}

/// A second agent, without FleetIQ, guarding `node` as identity `agent-<node>`.
async fn label_agent(w: &World, node: &str, extra: &[&str]) -> InProcessAgent {
    let mut args = vec!["--resync-interval", "1s"];
    args.extend_from_slice(extra);
    let kube = w
        .cluster
        .emulator()
        .config_for(&format!("agent-{node}"))
        .await
        .unwrap();
    InProcessAgent::start(config(node, &args), kube, None)
        .await
        .unwrap()
}

/// Every taint on the node that lastcall set (or the API set for its cordon), as
/// (key, value, effect).
fn taints(n: &Node) -> Vec<(String, String, String)> {
    n.spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|t| (t.key, t.value.unwrap_or_default(), t.effect))
        .collect()
}

/// Kubernetes' toleration matching: an empty effect matches every effect; `Exists` with no
/// key matches every taint; `Equal` (the default operator) needs key and value to match.
fn tolerates(tolerations: &[Value], (key, value, effect): &(String, String, String)) -> bool {
    tolerations.iter().any(|t| {
        let effect_ok = t["effect"]
            .as_str()
            .is_none_or(|e| e.is_empty() || e == effect);
        let t_key = t["key"].as_str().unwrap_or_default();
        let matches = if t["operator"] == "Exists" {
            t_key.is_empty() || t_key == key
        } else {
            t_key == key && t["value"].as_str().unwrap_or_default() == value
        };
        effect_ok && matches
    })
}

#[test]
fn toleration_matching_follows_kubernetes() {
    let t = |k: &str, v: &str, e: &str| (k.to_string(), v.to_string(), e.to_string());
    let exists = [serde_json::json!({"key": "a", "operator": "Exists", "effect": "NoExecute"})];
    assert!(tolerates(&exists, &t("a", "x", "NoExecute")));
    assert!(!tolerates(&exists, &t("a", "x", "NoSchedule")));
    assert!(!tolerates(&exists, &t("b", "x", "NoExecute")));
    let equal = [serde_json::json!({"key": "a", "value": "x"})];
    assert!(tolerates(&equal, &t("a", "x", "NoSchedule")));
    assert!(!tolerates(&equal, &t("a", "y", "NoSchedule")));
    let all = [serde_json::json!({"operator": "Exists"})];
    assert!(tolerates(&all, &t("z", "", "NoExecute")));
}

fn assert_tolerated(file: &str, seen: &BTreeSet<(String, String, String)>) {
    let objs = manifest(file);
    let tolerations = agent_daemonset(&objs)["spec"]["template"]["spec"]["tolerations"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    for taint in seen {
        assert!(
            tolerates(&tolerations, taint),
            "manifests/{file}: the agent does not tolerate {taint:?}, which a drain sets"
        );
    }
}

/// The agents' writes in `w`, named by the admission policies' table
/// (`lastcall_testkit::agent_writes`): each name is added to `seen`, and each name the table
/// does not admit in a release with `options` is returned with its request.
fn writes_outside_the_table(
    table: &Table,
    w: &World,
    options: Options,
    seen: &mut BTreeSet<String>,
) -> Vec<String> {
    let store = w.cluster.store();
    let floor = store.oldest_resumable();
    assert!(
        floor <= 1,
        "the store history no longer starts at the world's start (rv {floor}): raise its limit"
    );
    let history = store
        .events_since(floor)
        .expect("the store history since the world started");
    let writes =
        agent_writes::journal_writes(table, &w.cluster.emulator().journal().entries(), &history)
            .unwrap_or_else(|e| panic!("naming the agents' writes: {e:#}"));
    let mut outside = Vec::new();
    for wr in writes {
        for n in &wr.names {
            seen.insert(n.clone());
            if !table.admits(options, n) {
                outside.push(format!("  {n}: {}", wr.request));
            }
        }
    }
    outside
}

/// Flows without compat mode: a FleetIQ drain that is cancelled, drains again and
/// deregisters (Events, including a repeated one); a Node-label drain and its cancel; a
/// Node-label drain in dry-run mode. Then, in a second world, the compat-mode drain; in a
/// third, a Spot deadline's graceful termination; in a fourth, a GKE maintenance handed back.
///
/// The same writes against the admission policies' table, both ways: a write the table does
/// not list (the policies would refuse it: the agent's drain would fail on a real cluster),
/// and an entry no flow makes (the policies would admit a write the agent never makes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_grants_the_agent_exactly_what_it_calls() {
    let mut seen_taints = BTreeSet::new();

    // World 1: FleetIQ drain with a cancel in the middle, then a Node-label drain of n2.
    let w = World::start(WorldSpec::new(2, 1, 0).extra_nodes(&["n2", "n3"])).await;
    // n1's owner annotation names an agent pod that is gone: the agent looks it up (a pod
    // GET) and takes the node over.
    Api::<Node>::all(w.cluster.client())
        .patch(
            "n1",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({
                "metadata": {"annotations": {"lastcall.dev/owner": "lastcall/agent-gone/u-gone"}}
            })),
        )
        .await
        .unwrap();
    let agent = w
        .agent(&[
            "--autoscaler-cooperation",
            "in-use",
            "--release-floor",
            "1",
            "--pod-name",
            "agent-n1",
            "--pod-namespace",
            "lastcall",
            "--pod-uid",
            "u-n1",
        ])
        .await;
    subscribed(&agent).await;
    w.claimed_all().await;
    let keep = w.allocated();
    w.status(Status::Draining).await;
    w.fenced_and_released(&keep).await;
    seen_taints.extend(taints(&w.node().await));
    w.status(Status::Active).await;
    wait_for("drain cancelled", || async {
        (!cordoned(&w.node().await)).then_some(())
    })
    .await;
    w.status(Status::Draining).await; // DrainStarted again: the Event becomes a series
    w.fenced_and_released(&keep).await;
    w.finish_drain(&keep).await;
    agent.stop().await.unwrap();

    // The released servers' replacements run on n2 or n3 (wherever the scheduler put them).
    let other = wait_for("replacements running on n2 or n3", || async {
        ["n2", "n3"]
            .into_iter()
            .find(|n| w.on(n).iter().any(|g| g.state == Some(S::Ready)))
    })
    .await;
    let by_label = label_agent(&w, other, &[]).await;
    label_node(&w, other, "lastcall.dev/drain", Some("true")).await;
    wait_for("fenced by hand", || async {
        let n = node(&w, other).await;
        (cordoned(&n) && has_taint(&n, "lastcall.dev/draining")).then_some(())
    })
    .await;
    seen_taints.extend(taints(&node(&w, other).await));
    // Another writer uncordons the draining node: the agent puts its fence back, and marks
    // when (`lastcall.dev/fence-restored`, the settle counts from it).
    Api::<Node>::all(w.cluster.client())
        .patch(
            other,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"unschedulable": false}})),
        )
        .await
        .unwrap();
    wait_for("the stripped fence put back", || async {
        let n = node(&w, other).await;
        (cordoned(&n)
            && n.metadata
                .annotations
                .as_ref()?
                .contains_key("lastcall.dev/fence-restored"))
        .then_some(())
    })
    .await;
    label_node(&w, other, "lastcall.dev/drain", None).await;
    wait_for("manual drain cancelled", || async {
        (!cordoned(&node(&w, other).await)).then_some(())
    })
    .await;
    by_label.stop().await.unwrap();

    // World 2: compat mode on n1, then a dry-run Node-label drain of n2.
    // As with the original adapter, the Fleet's pods tolerate its `active` taint.
    let w2 = World::start(
        WorldSpec::new(1, 1, 0)
            .extra_nodes(&["n2"])
            .tolerate(toleration_equal(
                "gamelift.status/active",
                "true",
                "NoExecute",
            )),
    )
    .await;
    let compat = w2.agent(&["--compat-taints"]).await;
    subscribed(&compat).await;
    w2.claimed_all().await;
    wait_for("compat active taint after the claim", || async {
        has_taint(&w2.node().await, "gamelift.status/active").then_some(())
    })
    .await;
    seen_taints.extend(taints(&w2.node().await));
    w2.status(Status::Draining).await;
    wait_for("compat draining taint", || async {
        has_taint(&w2.node().await, "gamelift.status/draining").then_some(())
    })
    .await;
    seen_taints.extend(taints(&w2.node().await));
    compat.stop().await.unwrap();
    wait_for(
        "the released server's replacement is Ready on n2",
        || async {
            w2.on("n2")
                .iter()
                .any(|g| g.state == Some(S::Ready))
                .then_some(())
        },
    )
    .await;
    let dry = label_agent(&w2, "n2", &["--dry-run"]).await;
    label_node(&w2, "n2", "lastcall.dev/drain", Some("true")).await;
    wait_for("dry-run release planned", || async {
        let m = dry.metrics().await;
        lastcall_testkit::agent::metric(
            &m,
            "lastcall_actions_total",
            &[("action", "release"), ("result", "dry_run")],
        )
        .is_some_and(|v| v >= 1.0)
        .then_some(())
    })
    .await;
    dry.stop().await.unwrap();

    // World 3: a Spot interruption (deadline 2 min) on a node whose match needs a 200 s
    // grace period, with --graceful-termination: the match's graceful termination starts
    // at once: a DELETE preconditioned on its uid (Agones' PDB over a `Never` pod is not asked).
    // Its node is a Karpenter node (a NodeClaim that never expires): the agent reads it.
    let w3 = World::start(WorldSpec::new(0, 1, 0).grace_seconds(200)).await;
    w3.cluster
        .karpenter(lastcall_testkit::cluster::autoscaler::karpenter::Config::default())
        .await
        .unwrap()
        .launch(
            "n1",
            &lastcall_testkit::cluster::autoscaler::karpenter::NodeClaimSpec {
                expire_after: "Never".into(),
                termination_grace_period: None,
            },
        )
        .await
        .unwrap();
    let hard = w3.agent(&["--graceful-termination"]).await;
    subscribed(&hard).await;
    w3.claimed_all().await;
    w3.status(Status::SpotTerminating).await;
    wait_for("the match's pod is terminating", || async {
        let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::all(w3.cluster.client());
        let list = pods.list(&Default::default()).await.ok()?;
        list.items
            .iter()
            .any(|p| p.metadata.deletion_timestamp.is_some())
            .then_some(())
    })
    .await;
    wait_for("the NodeClaim read", || async {
        (w3.cluster.emulator().journal().count(|r| {
            r.identity.as_deref() == Some("agent-n1") && r.resource.as_deref() == Some("nodeclaims")
        }) > 0)
            .then_some(())
    })
    .await;
    hard.stop().await.unwrap();

    // World 4: GKE maintenance that may start early, with --gke-hand-back, on a node whose
    // kubelet reports its boot id: the drain records it, and the empty node is handed back.
    // The match is `eviction.safe: Always` (Agones says safe-to-evict "true"), so autoscaler
    // cooperation writes "false" on its pod.
    let w4 = World::start(
        WorldSpec::new(1, 1, 0).eviction_safe(lastcall_testkit::cluster::EvictionSafe::Always),
    )
    .await;
    w4.cluster.set_boot_id("n1", "boot-1").unwrap();
    let gce = GceMetadataEmulator::start().await.unwrap();
    let gce_url = gce.url();
    let gke = w4
        .start_agent(
            &[
                "--gce-metadata",
                "--gce-metadata-endpoint",
                &gce_url,
                "--gce-wait-timeout",
                "2s",
                "--gce-upcoming-interval",
                "200ms",
                "--gke-hand-back",
                "--autoscaler-cooperation",
                "in-use",
                "--resync-interval",
                "1s",
            ]
            .map(String::from),
        )
        .await;
    w4.claimed_all().await;
    let window = jiff::Timestamp::now()
        .checked_add(jiff::SignedDuration::from_mins(30))
        .unwrap()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string();
    gce.set(
        "upcoming-maintenance",
        &serde_json::json!({"can_reschedule": "true", "maintenance_status": "PENDING",
                            "type": "SCHEDULED", "window_start_time": window})
        .to_string(),
    );
    wait_for("drained for the maintenance window", || async {
        has_taint(&w4.node().await, "lastcall.dev/draining").then_some(())
    })
    .await;
    let keep = w4.allocated();
    w4.cluster
        .sdk_shutdown(lastcall_testkit::world::NS, &keep.name)
        .unwrap();
    wait_for("handed back to GKE", || async {
        let n = w4.node().await;
        (n.metadata
            .labels?
            .get("cloud.google.com/perform-maintenance")?
            == "true")
            .then_some(())
    })
    .await;
    gke.stop().await.unwrap();

    // Every write of every flow against the policies' table.
    let table = Table::load(&repo()).expect("charts/lastcall/agent-writes.yaml");
    let mut seen = BTreeSet::new();
    let compat = Options {
        compat_taints: true,
        ..Options::default()
    };
    let hand_back = Options {
        gke_hand_back: true,
        ..Options::default()
    };
    let outside: Vec<String> = [
        (&w, Options::default()),
        (&w2, compat),
        (&w3, Options::default()),
        (&w4, hand_back),
    ]
    .into_iter()
    .flat_map(|(world, options)| writes_outside_the_table(&table, world, options, &mut seen))
    .collect();
    assert!(
        outside.is_empty(),
        "the agents made writes the admission policies' table ({}) does not list for their \
         release, so the policies refuse them: add them to the table (and to the policies if \
         the table's vocabulary lacks them), or stop making them:\n{}",
        agent_writes::TABLE,
        outside.join("\n")
    );
    let unmade: Vec<String> = table
        .kinds(Options::ALL)
        .into_iter()
        .filter(|group| group.is_disjoint(&seen))
        .map(|group| format!("  {}", group.into_iter().collect::<Vec<_>>().join(" | ")))
        .collect();
    assert!(
        unmade.is_empty(),
        "the admission policies' table ({}) lists writes no agent made in these flows, so the \
         policies admit writes the agent never makes: remove them, or add the flow that makes \
         them:\n{}\nseen: {seen:#?}",
        agent_writes::TABLE,
        unmade.join("\n")
    );

    let agents = ["agent-n1", "agent-n2", "agent-n3"];
    let plain: BTreeSet<Permission> = used(&w.cluster.emulator().journal().entries(), &agents)
        .into_iter()
        .chain(used(
            &w2.cluster.emulator().journal().entries(),
            &["agent-n2"],
        ))
        .chain(used(&w3.cluster.emulator().journal().entries(), &agents))
        .collect();
    let all: BTreeSet<Permission> = plain
        .iter()
        .cloned()
        .chain(used(&w2.cluster.emulator().journal().entries(), &agents))
        .collect();
    let pod_patch: Permission = ("patch".into(), String::new(), "pods".into(), String::new());
    assert!(
        used(&w2.cluster.emulator().journal().entries(), &["agent-n1"]).contains(&pod_patch),
        "compat mode patches pods (the toleration)"
    );
    assert!(
        plain.contains(&pod_patch),
        "autoscaler cooperation patches pods (the annotations)"
    );
    assert_rbac_matches("lastcall.yaml", &plain);
    assert_rbac_matches("lastcall-fleetiq.yaml", &all);

    // A drain never evicts its own agent.
    for key in [
        "lastcall.dev/draining",
        "gamelift.status/active",
        "gamelift.status/draining",
    ] {
        assert!(
            seen_taints.iter().any(|(k, _, _)| k == key),
            "the flows should have set {key}: {seen_taints:?}"
        );
    }
    assert_tolerated("lastcall.yaml", &seen_taints);
    assert_tolerated("lastcall-fleetiq.yaml", &seen_taints);

    // Every Event reason the flows produced is documented.
    let events_md = read("docs/events.md");
    let mut reasons = BTreeSet::new();
    for world in [&w, &w2] {
        let (events, _) = world
            .cluster
            .store()
            .list(&lastcall_testkit::kube::resources::EVENTS_K8S, None);
        reasons.extend(
            events
                .iter()
                .filter_map(|e| e["reason"].as_str().map(str::to_string)),
        );
    }
    assert!(
        reasons.contains("DrainStarted") && reasons.contains("Deregistered"),
        "the flows produced too few Events: {reasons:?}"
    );
    // And every reason the agent can emit, whether or not these flows reached it.
    reasons.extend(
        lastcall_agent::drain_events::REASONS
            .iter()
            .map(|r| r.to_string()),
    );
    for r in &reasons {
        assert!(
            events_md.contains(&format!("| `{r}` |")),
            "docs/events.md does not describe the Event reason {r}"
        );
    }
}

/// pubsub makes no Kubernetes call, so the chart grants it nothing and mounts no token. The
/// real binary runs a cycle with a kubeconfig for the emulator in reach: a future API call
/// through it would show up here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pubsub_is_granted_nothing_and_calls_nothing() {
    let w = World::start(WorldSpec::new(0, 0, 0).extra_nodes(&[])).await;
    let run = PubsubRun::start(&w.gl, &w.redis.url(), Some(&w.cluster)).await;
    run.wait_cycle().await;
    drop(run);
    assert_eq!(
        w.cluster
            .emulator()
            .journal()
            .count(|e| e.identity.as_deref() == Some("pubsub")),
        0,
        "pubsub called the Kubernetes API: give it a Role in the chart and extend this test"
    );
    let objs = manifest("lastcall-fleetiq.yaml");
    let deploy = find(&objs, "Deployment")
        .into_iter()
        .find(|d| d["metadata"]["labels"]["app.kubernetes.io/component"] == "pubsub")
        .expect("the pubsub Deployment");
    let pod = &deploy["spec"]["template"]["spec"];
    let sa = pod["serviceAccountName"].as_str().unwrap();
    assert!(granted(&objs, sa).is_empty(), "pubsub needs no RBAC");
    assert_eq!(pod["automountServiceAccountToken"], false);
}

/// The `REDIS_URL` the chart gives one component for the bundled Redis
/// (`redis://lastcall-<component>:$(REDIS_PASSWORD)@…`, expanded by the kubelet), with the
/// Secret key its password comes from.
fn redis_env(objs: &[Value], component: &str) -> (String, String) {
    let pod = objs
        .iter()
        .find(|o| {
            o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == component
        })
        .unwrap_or_else(|| panic!("no {component} workload"));
    let env = pod["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .unwrap();
    let names: Vec<&str> = env.iter().filter_map(|e| e["name"].as_str()).collect();
    let pw = names.iter().position(|n| *n == "REDIS_PASSWORD");
    let url = names.iter().position(|n| *n == "REDIS_URL");
    assert!(
        pw.is_some() && pw < url,
        "{component}: REDIS_PASSWORD must come before REDIS_URL for $(…) expansion"
    );
    (
        env[url.unwrap()]["value"].as_str().unwrap().to_string(),
        env[pw.unwrap()]["valueFrom"]["secretKeyRef"]["key"]
            .as_str()
            .unwrap()
            .to_string(),
    )
}

/// A connection as `url`'s user.
async fn redis_as(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("connecting as {url}: {e}"))
}

/// The error code of a command Redis refused (`NOPERM`), or `None` when it ran.
async fn refused(
    con: &mut redis::aio::MultiplexedConnection,
    cmd: &mut redis::Cmd,
) -> Option<String> {
    match cmd.query_async::<redis::Value>(con).await {
        Ok(_) => None,
        Err(e) => Some(e.code().unwrap_or("?").to_string()),
    }
}

/// Agents cannot speak for pubsub. The bundled Redis as the chart runs it (its container's
/// command with the real `redis-server`, both passwords from the Secret's keys) and the URLs
/// the chart gives each component: the agents' user gets `NOPERM` for PUBLISH, for a status
/// key (SET, or a hash over it), for a script and for the drain state where the agents do not
/// publish it, and may subscribe and read the statuses; pubsub's user publishes. Then the whole
/// FleetIQ drain runs on those users: the real pubsub process as `lastcall-pubsub` polls the
/// GameLift emulator and publishes `DRAINING`, the agent as `lastcall-agent` hears it, drains
/// and deregisters once the match ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_and_pubsub_have_their_own_redis_users_and_the_drain_works() {
    let objs = manifest("lastcall-fleetiq.yaml");
    let (agent_template, agent_key) = redis_env(&objs, "agent");
    let (pubsub_template, pubsub_key) = redis_env(&objs, "pubsub");
    assert!(
        agent_template.starts_with("redis://lastcall-agent:$(REDIS_PASSWORD)@"),
        "{agent_template}"
    );
    assert!(
        pubsub_template.starts_with("redis://lastcall-pubsub:$(REDIS_PASSWORD)@"),
        "{pubsub_template}"
    );
    assert_ne!(agent_key, pubsub_key, "agents and pubsub share a password");
    let passwords = [
        (pubsub_key.as_str(), "Zq7lastcallPubsubPw"),
        (agent_key.as_str(), "Zq7lastcallAgentPw"),
    ];
    let bundled = BundledRedis::start(&objs, &passwords).await;
    // What the kubelet does: expand $(REDIS_PASSWORD); the Service name points here instead.
    let url = |template: &str, pw: &str, port: u16| {
        let host = template
            .split('@')
            .nth(1)
            .expect("a host after the credentials");
        template
            .replace("$(REDIS_PASSWORD)", pw)
            .replace(host, &format!("127.0.0.1:{port}"))
    };
    let agent_url = url(&agent_template, passwords[1].1, bundled.port);
    let pubsub_url = url(&pubsub_template, passwords[0].1, bundled.port);

    // The agents' credential, as a compromised node would use it.
    let mut agent = redis_as(&agent_url).await;
    let spot = lastcall_testkit::world::World::message(Status::SpotTerminating);
    let iid = lastcall_testkit::world::IID;
    for (what, cmd) in [
        (
            "PUBLISH a SPOT_TERMINATING",
            redis::cmd("PUBLISH").arg(iid).arg(&spot).clone(),
        ),
        (
            "SET a status key",
            redis::cmd("SET")
                .arg(format!("lastcall:status:{iid}"))
                .arg(&spot)
                .clone(),
        ),
        (
            "HSET over a status key",
            redis::cmd("HSET")
                .arg(format!("lastcall:status:{iid}"))
                .arg("a")
                .arg("b")
                .clone(),
        ),
        (
            "DEL a status key",
            redis::cmd("DEL")
                .arg(format!("lastcall:status:{iid}"))
                .clone(),
        ),
        (
            "a script that publishes",
            redis::cmd("EVAL")
                .arg("return redis.call('PUBLISH', KEYS[1], ARGV[1])")
                .arg(1)
                .arg(iid)
                .arg(&spot)
                .clone(),
        ),
        (
            "HSET the drain state (not published by these agents)",
            redis::cmd("HSET")
                .arg("lastcall:drain-state")
                .arg("n9")
                .arg("{}")
                .clone(),
        ),
        ("FLUSHALL", redis::cmd("FLUSHALL").clone()),
    ] {
        let mut cmd = cmd;
        assert_eq!(
            refused(&mut agent, &mut cmd).await.as_deref(),
            Some("NOPERM"),
            "the agents' credential may {what}"
        );
    }
    let mut pubsub = redis_as(&pubsub_url).await;
    assert_eq!(
        refused(
            &mut pubsub,
            redis::cmd("SET")
                .arg(format!("lastcall:status:{iid}"))
                .arg("x")
        )
        .await,
        None
    );
    assert_eq!(
        refused(
            &mut agent,
            redis::cmd("GET").arg(format!("lastcall:status:{iid}"))
        )
        .await,
        None
    );
    assert_eq!(
        refused(
            &mut pubsub,
            redis::cmd("DEL").arg(format!("lastcall:status:{iid}"))
        )
        .await
        .as_deref(),
        Some("NOPERM"),
        "pubsub deletes nothing"
    );
    assert_eq!(
        refused(&mut pubsub, redis::cmd("PUBLISH").arg("i-x").arg("y")).await,
        None
    );
    // The default user is off: no password alone gets in.
    let anon = redis::Client::open(format!("redis://127.0.0.1:{}", bundled.port)).unwrap();
    let mut anon = anon.get_multiplexed_async_connection().await.unwrap();
    assert!(
        refused(&mut anon, &mut redis::cmd("PING")).await.is_some(),
        "the default user answers"
    );

    // The whole FleetIQ drain on those two users.
    let w = World::start(WorldSpec::new(1, 1, 0)).await;
    let run = PubsubRun::start_polling(&w.gl, &pubsub_url, &[lastcall_testkit::world::GROUP]).await;
    let mut args = w.fleetiq_args();
    let i = args.iter().position(|a| a == "--redis-url").unwrap();
    args[i + 1] = agent_url.clone();
    args.extend(["--instance-id", iid].map(String::from));
    let agent = w.start_agent(&args).await;
    subscribed(&agent).await;
    w.claimed_all().await;
    let keep = w.allocated();
    w.gl.set_instance_status(iid, GlStatus::Draining);
    w.fenced_and_released(&keep).await;
    w.finish_drain(&keep).await;
    let m = run.metrics().await;
    assert_eq!(
        lastcall_testkit::agent::metric(&m, "lastcall_pubsub_redis_up", &[]),
        Some(1.0),
        "{m}"
    );
    agent.stop().await.unwrap();
    drop(run);
    drop(bundled);

    // With the drain state published (the webhook), the agents' user may write that hash.
    let objs = helm_template(&[
        REG,
        "pubsub.webhook.enabled=true",
        "pubsub.webhook.maxReplicas=10",
        "redis.bundled.auth.existingSecret=s",
    ])
    .unwrap();
    let bundled = BundledRedis::start(&objs, &passwords).await;
    let (template, _) = redis_env(&objs, "agent");
    let mut agent = redis_as(&url(&template, passwords[1].1, bundled.port)).await;
    assert_eq!(
        refused(
            &mut agent,
            redis::cmd("HSET")
                .arg("lastcall:drain-state")
                .arg("n1")
                .arg("{}")
        )
        .await,
        None
    );
    assert_eq!(
        refused(&mut agent, redis::cmd("PUBLISH").arg(iid).arg(&spot))
            .await
            .as_deref(),
        Some("NOPERM")
    );
}

// ---------------------------------------------------------------------------------------
// IAM: the policies docs/install.md gives equal the AWS calls the code makes
// ---------------------------------------------------------------------------------------

/// The version of `krate` in Cargo.lock.
fn locked_version(krate: &str) -> Option<String> {
    let lock = read("Cargo.lock");
    let mut lines = lock.lines();
    while let Some(l) = lines.next() {
        if l == format!("name = \"{krate}\"") {
            return lines
                .next()
                .and_then(|v| v.strip_prefix("version = \""))
                .map(|v| v.trim_end_matches('"').to_string());
        }
    }
    None
}

/// Every operation of an AWS SDK crate, as its fluent method name (`describe_game_server`),
/// from the crate's own `src/operation/` directory in the cargo registry.
fn sdk_operations(krate: &str) -> BTreeSet<String> {
    let version = locked_version(krate).unwrap_or_else(|| panic!("{krate} is not in Cargo.lock"));
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cargo")))
        .expect("CARGO_HOME or HOME");
    let registries = std::fs::read_dir(cargo_home.join("registry/src"))
        .unwrap_or_else(|e| panic!("{}: {e}", cargo_home.display()));
    for reg in registries.filter_map(Result::ok) {
        let dir = reg.path().join(format!("{krate}-{version}/src/operation"));
        if let Ok(entries) = std::fs::read_dir(&dir) {
            return entries
                .filter_map(Result::ok)
                .filter(|e| e.path().is_dir())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
        }
    }
    panic!(
        "the sources of {krate} {version} are not in {}/registry/src",
        cargo_home.display()
    );
}

/// Rust sources of a crate, without their test modules.
fn crate_sources(dir: &Path, out: &mut Vec<(PathBuf, String)>) {
    for e in std::fs::read_dir(dir).unwrap().filter_map(Result::ok) {
        let p = e.path();
        if p.is_dir() {
            crate_sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs")
            && !p
                .file_name()
                .is_some_and(|n| n == "tests.rs" || n == "test_support.rs")
        {
            let text = std::fs::read_to_string(&p).unwrap();
            let code = text
                .split("#[cfg(test)]")
                .next()
                .unwrap_or_default()
                .to_string();
            out.push((p, code));
        }
    }
}

/// `describe_game_server` → `DescribeGameServer` (the IAM action name).
fn pascal(snake: &str) -> String {
    snake
        .split('_')
        .map(|w| {
            let mut c = w.chars();
            c.next()
                .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
                .unwrap_or_default()
        })
        .collect()
}

/// The IAM actions (`gamelift:DescribeGameServer`) a binary's crate calls: every
/// `.<operation>(` of each `aws-sdk-<service>` it depends on, in its non-test sources.
fn aws_actions(krate_dir: &str) -> BTreeSet<String> {
    let manifest = read(&format!("{krate_dir}/Cargo.toml"));
    let mut sources = Vec::new();
    crate_sources(&repo().join(krate_dir).join("src"), &mut sources);
    let mut actions = BTreeSet::new();
    for line in manifest.lines() {
        let Some(sdk) = line
            .split(['=', '.', ' '])
            .next()
            .filter(|n| n.starts_with("aws-sdk-"))
        else {
            continue;
        };
        let service = sdk.trim_start_matches("aws-sdk-");
        for op in sdk_operations(sdk) {
            if sources
                .iter()
                .any(|(_, code)| code.contains(&format!(".{op}(")))
            {
                actions.insert(format!("{service}:{}", pascal(&op)));
            }
        }
    }
    actions
}

/// The policy document `doc` writes with `cat > <file> <<JSON` (or `<<'JSON'`), the shell
/// variables it names (`$ACCOUNT`) filled with sample values.
fn policy_document(doc: &str, file: &str) -> Value {
    let md = read(doc);
    let body = ["<<JSON\n", "<<'JSON'\n"]
        .iter()
        .find_map(|h| md.split_once(&format!("cat > {file} {h}")))
        .and_then(|(_, rest)| rest.split_once("\nJSON\n"))
        .map(|(body, _)| body)
        .unwrap_or_else(|| panic!("{doc} has no `cat > {file} <<JSON` heredoc"));
    let body = body
        .replace("$ACCOUNT", "123456789012")
        .replace("$REGION", "us-west-2")
        .replace("$ASG_NAME", "game-nodes");
    assert!(
        !body.contains('$'),
        "{doc}: {file} names an unknown variable: {body}"
    );
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{doc}: {file} is not JSON: {e}"))
}

/// Actions that AWS's Service Authorization Reference lists with no resource type: a policy
/// can grant them only on `*`. Every other action must name its resources.
const NO_RESOURCE_LEVEL: &[&str] = &[
    "autoscaling:DescribeAutoScalingInstances",
    "autoscaling:DescribeLifecycleHooks",
];

/// The `Allow` actions of the policy document `doc` writes with `cat > <file> <<JSON`.
fn documented_policy(doc: &str, file: &str) -> BTreeSet<String> {
    let doc = policy_document(doc, file);
    let mut out = BTreeSet::new();
    for st in doc["Statement"].as_array().expect("Statement") {
        assert_eq!(st["Effect"], "Allow", "{file}: only Allow statements");
        match &st["Action"] {
            Value::String(a) => {
                out.insert(a.clone());
            }
            Value::Array(list) => {
                out.extend(list.iter().filter_map(|a| a.as_str().map(String::from)))
            }
            other => panic!("{file}: Action {other}"),
        }
    }
    out
}

/// Both directions, as for RBAC: an SDK call without its IAM action fails in production
/// (AccessDenied, e.g. a deregistration that never happens), an action nobody calls is
/// privilege nobody needs.
#[test]
fn the_documented_iam_policies_are_exactly_the_aws_calls_the_code_makes() {
    // The agent's optional Auto Scaling lifecycle permissions are documented with that
    // feature; together with the install policy they must be exactly what it calls.
    for (krate, policies) in [
        (
            "agent",
            &[
                ("docs/install.md", "lastcall-agent-policy.json"),
                ("docs/asg-lifecycle.md", "lastcall-asg-policy.json"),
            ][..],
        ),
        (
            "pubsub",
            &[
                ("docs/install.md", "lastcall-pubsub-policy.json"),
                ("docs/queue.md", "lastcall-queue-policy.json"),
            ][..],
        ),
    ] {
        let calls = aws_actions(krate);
        assert!(
            !calls.is_empty(),
            "{krate}: found no AWS SDK call; the scan is broken"
        );
        let policy: BTreeSet<String> = policies
            .iter()
            .flat_map(|(doc, file)| documented_policy(doc, file))
            .collect();
        let file = policies
            .iter()
            .map(|(doc, file)| format!("{doc} {file}"))
            .collect::<Vec<_>>()
            .join(" + ");
        let missing: Vec<_> = calls.difference(&policy).collect();
        let unused: Vec<_> = policy.difference(&calls).collect();
        assert!(
            missing.is_empty() && unused.is_empty(),
            "{file} differs from the AWS calls {krate}/src makes.\n\
             Called but not allowed (add to the policy): {missing:?}\n\
             Allowed but never called (remove): {unused:?}"
        );
    }
    assert!(
        aws_actions("agent").contains("gamelift:DescribeGameServer"),
        "the scan must see the check before deregistration"
    );
}

/// The documented policies name their resources: a statement on `*` holds only actions AWS
/// grants on nothing narrower; a GameLift statement names game server groups, an Auto
/// Scaling one its groups.
#[test]
fn the_documented_iam_policies_name_their_resources() {
    for (doc, file) in [
        ("docs/install.md", "lastcall-agent-policy.json"),
        ("docs/install.md", "lastcall-pubsub-policy.json"),
        ("docs/asg-lifecycle.md", "lastcall-asg-policy.json"),
    ] {
        let policy = policy_document(doc, file);
        for st in policy["Statement"].as_array().expect("Statement") {
            let actions: Vec<&str> = match &st["Action"] {
                Value::String(a) => vec![a.as_str()],
                Value::Array(l) => l.iter().filter_map(Value::as_str).collect(),
                other => panic!("{file}: Action {other}"),
            };
            let resources: Vec<&str> = match &st["Resource"] {
                Value::String(r) => vec![r.as_str()],
                Value::Array(l) => l.iter().filter_map(Value::as_str).collect(),
                other => panic!("{file}: Resource {other}"),
            };
            for r in &resources {
                if *r == "*" {
                    let wide: Vec<_> = actions
                        .iter()
                        .filter(|a| !NO_RESOURCE_LEVEL.contains(a))
                        .collect();
                    assert!(
                        wide.is_empty(),
                        "{doc}: {file} grants {wide:?} on every resource; name the game server \
                         groups' or Auto Scaling groups' ARNs"
                    );
                    continue;
                }
                for a in &actions {
                    let want = match a.split(':').next() {
                        Some("gamelift") => ":gameservergroup/",
                        Some("autoscaling") => ":autoScalingGroup:",
                        _ => panic!("{file}: an action of another service: {a}"),
                    };
                    assert!(
                        r.starts_with("arn:aws:") && r.contains(want),
                        "{doc}: {file} grants {a} on {r}, not a {want} ARN"
                    );
                }
            }
        }
    }
}

#[test]
fn iam_action_names_follow_the_sdk_method_names() {
    assert_eq!(
        pascal("describe_game_server_instances"),
        "DescribeGameServerInstances"
    );
    assert_eq!(pascal("register_game_server"), "RegisterGameServer");
}

// ---------------------------------------------------------------------------------------
// The DaemonSet's promises
// ---------------------------------------------------------------------------------------

/// Taints a node carries while it drains, from every party that drains nodes: Karpenter
/// (which evicts pods that do not tolerate `karpenter.sh/disrupted`), the cluster autoscaler,
/// GKE, the cordon, and lastcall itself.
const DRAIN_TAINTS: &[(&str, &str)] = &[
    ("karpenter.sh/disrupted", "NoSchedule"),
    ("ToBeDeletedByClusterAutoscaler", "NoSchedule"),
    ("DeletionCandidateOfClusterAutoscaler", "PreferNoSchedule"),
    ("cloud.google.com/impending-node-termination", "NoSchedule"),
    ("node.kubernetes.io/unschedulable", "NoSchedule"),
    ("node.kubernetes.io/not-ready", "NoExecute"),
    ("lastcall.dev/draining", "NoSchedule"),
    ("gamelift.status/draining", "NoExecute"),
    ("agones.dev/gameservers", "NoExecute"),
];

#[test]
fn the_agent_daemonset_keeps_its_promises() {
    for file in ["lastcall.yaml", "lastcall-fleetiq.yaml"] {
        let objs = manifest(file);
        let ds = agent_daemonset(&objs);
        let pod = &ds["spec"]["template"]["spec"];
        // A class the chart owns, so GKE's gcp-critical-pods quota (system-node-critical
        // only in kube-system) does not refuse the agents.
        let class = pod["priorityClassName"].as_str().expect("a priority class");
        let pc = find(&objs, "PriorityClass");
        assert!(
            pc.iter().any(|p| p["metadata"]["name"] == class),
            "{file}: the agent's priority class {class} is not in the manifests"
        );
        assert!(!class.starts_with("system-"), "{file}: {class}");
        assert_eq!(pod["nodeSelector"]["role"], "game-servers", "{file}");
        // Node-agent scheduling: Linux, the images' architectures.
        let terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            ["nodeSelectorTerms"][0]["matchExpressions"]
            .to_string();
        for needle in ["kubernetes.io/os", "kubernetes.io/arch", "arm64", "amd64"] {
            assert!(terms.contains(needle), "{file}: affinity lacks {needle}");
        }
        let tolerations = pod["tolerations"].as_array().cloned().unwrap_or_default();
        for (key, effect) in DRAIN_TAINTS {
            assert!(
                tolerates(
                    &tolerations,
                    &(key.to_string(), "true".into(), effect.to_string())
                ),
                "{file}: the agent does not tolerate {key}:{effect}, so it is evicted from a draining node"
            );
        }
        assert_eq!(
            ds["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/part-of"], "lastcall",
            "{file}: the scrape label the docs promise"
        );
        let c = &pod["containers"][0];
        let env = c["env"].as_array().unwrap();
        let node_name = env.iter().find(|e| e["name"] == "NODE_NAME").unwrap();
        assert_eq!(
            node_name["valueFrom"]["fieldRef"]["fieldPath"], "spec.nodeName",
            "{file}"
        );
        let sc = &c["securityContext"];
        assert_eq!(sc["runAsNonRoot"], true, "{file}");
        assert_eq!(sc["readOnlyRootFilesystem"], true, "{file}");
        assert_eq!(sc["allowPrivilegeEscalation"], false, "{file}");
        assert_eq!(
            sc["capabilities"]["drop"],
            serde_json::json!(["ALL"]),
            "{file}"
        );
        assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault", "{file}");
        for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
            assert_eq!(c[probe]["httpGet"]["path"], path, "{file}");
        }
        assert!(c["resources"]["requests"].is_object(), "{file}");
        let ru = &ds["spec"]["updateStrategy"]["rollingUpdate"];
        if pod["hostNetwork"] == true {
            // Instance metadata needs the node's network; two agents cannot share its port.
            assert_eq!(pod["dnsPolicy"], "ClusterFirstWithHostNet", "{file}");
        }
        // A large cluster rolls many nodes at once. Off the host network the new agent
        // surges beside the old one, nothing unavailable: a new agent Pending on a packed node
        // holds one surge slot while the old one keeps the node, so one such node of eight
        // cannot hold the rest. On it (one port per node) the old agent stops first.
        let budget = if pod["hostNetwork"] == true {
            assert_eq!(ru["maxSurge"], 0, "{file}");
            &ru["maxUnavailable"]
        } else {
            assert_eq!(ru["maxUnavailable"], 0, "{file}");
            assert!(
                replaced_at_once(&ru["maxSurge"], 8) >= 2,
                "{file}: a surge of {} on 8 nodes: one packed node holds the rollout",
                ru["maxSurge"]
            );
            &ru["maxSurge"]
        };
        let at_once = replaced_at_once(budget, 2000);
        assert!(
            at_once >= 100,
            "{file}: {budget} replaces {at_once} of 2,000 agents at a time"
        );
        // /metrics binds the pod's own IP (the node's with hostNetwork), not 0.0.0.0, and the
        // agent takes it for either family. With hostNetwork the probes are on the node's
        // loopback, where the kubelet (on the node) reaches them and nothing else does, and
        // /metrics asks for a token.
        let args = agent_args(&objs);
        let arg = |flag: &str| {
            args.iter()
                .find_map(|a| a.strip_prefix(&format!("{flag}=")))
                .map(str::to_string)
        };
        let host_network = pod["hostNetwork"] == true;
        let (metrics_flag, auth) = if host_network {
            ("--metrics-listen", "kubernetes")
        } else {
            ("--listen", "none")
        };
        assert_eq!(arg("--metrics-auth").as_deref(), Some(auth), "{file}");
        if host_network {
            let probes = arg("--listen").expect("--listen");
            let (ip, probe_port) = probes.rsplit_once(':').expect("ip:port");
            assert_eq!(ip, "127.0.0.1", "{file}: the probes' listener");
            for probe in ["livenessProbe", "readinessProbe"] {
                let get = &c[probe]["httpGet"];
                assert_eq!(get["host"], "127.0.0.1", "{file}: {probe}");
                assert_eq!(get["port"].to_string(), probe_port, "{file}: {probe}");
            }
        } else {
            assert_eq!(arg("--metrics-listen"), None, "{file}");
            for probe in ["livenessProbe", "readinessProbe"] {
                assert_eq!(c[probe]["httpGet"]["port"], "metrics", "{file}: {probe}");
                assert!(c[probe]["httpGet"].get("host").is_none(), "{file}: {probe}");
            }
        }
        let listen = arg(metrics_flag).unwrap_or_else(|| panic!("{file}: {metrics_flag}"));
        let pod_ip = env.iter().find(|e| e["name"] == "POD_IP").expect("POD_IP");
        assert_eq!(pod_ip["valueFrom"]["fieldRef"]["fieldPath"], "status.podIP");
        assert!(listen.contains("$(POD_IP)"), "{file}: --listen={listen}");
        let port = c["ports"][0]["containerPort"].as_u64().unwrap();
        for ip in ["10.0.0.5", "fd00::5"] {
            let arg = format!("{metrics_flag}={}", listen.replace("$(POD_IP)", ip));
            let cfg = <lastcall_agent::config::Config as clap::Parser>::try_parse_from([
                "lastcall-agent",
                "--node-name",
                "n1",
                &arg,
            ])
            .unwrap_or_else(|e| panic!("{file}: {arg}: {e}"));
            let bound = cfg.metrics_listen.unwrap_or(cfg.listen);
            assert_eq!(bound.ip().to_string(), ip, "{file}");
            assert_eq!(u64::from(bound.port()), port, "{file}");
        }
        // Annotation-based Prometheus discovery finds the metrics port.
        let ann = &ds["spec"]["template"]["metadata"]["annotations"];
        assert_eq!(ann["prometheus.io/scrape"], "true", "{file}");
        assert_eq!(ann["prometheus.io/port"], port.to_string(), "{file}");
        assert_eq!(ann["prometheus.io/path"], "/metrics", "{file}");
    }
    // FleetIQ reads the instance id from IMDS: hostNetwork by default (hop limit 1).
    let fleetiq = manifest("lastcall-fleetiq.yaml");
    assert_eq!(
        agent_daemonset(&fleetiq)["spec"]["template"]["spec"]["hostNetwork"],
        true
    );
    // pubsub and Redis stay off game-server nodes (they would keep a WhenEmpty node).
    for d in find(&fleetiq, "Deployment") {
        let terms = d["spec"]["template"]["spec"]["affinity"]["nodeAffinity"].to_string();
        assert!(
            terms.contains("\"NotIn\"") && terms.contains("game-servers"),
            "{}: not kept off game-server nodes",
            d["metadata"]["name"]
        );
    }
}

/// Pods a DaemonSet's `maxUnavailable` lets go at once on `nodes` nodes (a percentage rounds
/// up, as the DaemonSet controller does).
fn replaced_at_once(v: &Value, nodes: u64) -> u64 {
    match v {
        Value::Number(n) => n.as_u64().unwrap_or(0),
        Value::String(s) => match s.strip_suffix('%').and_then(|p| p.parse::<u64>().ok()) {
            Some(p) => (p * nodes).div_ceil(100),
            None => s.parse().unwrap_or(0),
        },
        _ => 0,
    }
}

#[test]
fn rollout_size_follows_kubernetes_rounding() {
    assert_eq!(replaced_at_once(&Value::from("10%"), 2000), 200);
    assert_eq!(replaced_at_once(&Value::from("10%"), 5), 1);
    assert_eq!(replaced_at_once(&Value::from(1), 2000), 1);
    assert_eq!(replaced_at_once(&Value::from("x"), 2000), 0);
}

/// The plain FleetIQ manifest works as applied: both binaries get the region, and pubsub,
/// in the pod network, has an IRSA role of its own (the node's is out of reach there).
#[test]
fn the_fleetiq_manifest_gives_both_binaries_a_region_and_a_role() {
    let objs = manifest("lastcall-fleetiq.yaml");
    for component in ["agent", "pubsub"] {
        let w = objs
            .iter()
            .find(|o| {
                o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
                    == component
            })
            .unwrap_or_else(|| panic!("no {component} workload"));
        let pod = &w["spec"]["template"]["spec"];
        let env = pod["containers"][0]["env"].as_array().unwrap();
        assert!(
            env.iter()
                .any(|e| e["name"] == "AWS_REGION"
                    && e["value"].as_str().is_some_and(|v| !v.is_empty())),
            "{component}: no AWS_REGION"
        );
        let sa = pod["serviceAccountName"].as_str().unwrap();
        let account = find(&objs, "ServiceAccount")
            .into_iter()
            .find(|a| a["metadata"]["name"] == sa)
            .unwrap_or_else(|| panic!("{component}: ServiceAccount {sa} not in the manifest"));
        let role = account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"]
            .as_str()
            .unwrap_or_default();
        assert!(
            role.starts_with("arn:aws:iam::") && role.ends_with(&format!("lastcall-{component}")),
            "{component}: no IRSA role ({role:?})"
        );
    }
}

/// The bundled Redis as the chart runs it: its container's command with the real
/// `redis-server` (on 127.0.0.1 and a free port, its config in a temp dir), each Secret key's
/// password in the variable the container reads it from. `redis-server` on the PATH records
/// the arguments it is started with (Redis rewrites its own process title, so /proc would not
/// show them), then runs the real one.
struct BundledRedis {
    port: u16,
    spec: String,
    recorded: PathBuf,
    child: tokio::process::Child,
    _conf: tempfile::TempDir,
}

impl BundledRedis {
    async fn start(objs: &[Value], passwords: &[(&str, &str)]) -> BundledRedis {
        let redis = find(objs, "Deployment")
            .into_iter()
            .find(|d| d["metadata"]["name"] == "lastcall-redis")
            .expect("the bundled Redis");
        let c = &redis["spec"]["template"]["spec"]["containers"][0];
        let spec = c.to_string();
        let mut argv: Vec<String> = c["command"]
            .as_array()
            .unwrap()
            .iter()
            .chain(c["args"].as_array().unwrap())
            .map(|a| a.as_str().unwrap().to_string())
            .collect();
        assert_eq!(argv[..2], ["sh", "-c"], "{spec}");
        let conf = tempfile::tempdir().unwrap();
        let port = free_port();
        argv[2] = argv[2].replace("/run/redis", &conf.path().to_string_lossy())
            + &format!(
                " --port {port} --bind 127.0.0.1 --dir {}",
                conf.path().display()
            );
        let real = std::process::Command::new("sh")
            .args(["-c", "command -v redis-server"])
            .output()
            .expect("sh");
        let real = String::from_utf8_lossy(&real.stdout).trim().to_string();
        assert!(!real.is_empty(), "redis-server is not installed");
        let bin = conf.path().join("bin");
        std::fs::create_dir(&bin).unwrap();
        let recorded = conf.path().join("argv");
        std::fs::write(
            bin.join("redis-server"),
            format!(
                "#!/bin/sh\nprintf '%s\\n' \"$0\" \"$@\" > '{}'\nexec '{real}' \"$@\"\n",
                recorded.display()
            ),
        )
        .unwrap();
        std::process::Command::new("chmod")
            .args(["+x", &bin.join("redis-server").to_string_lossy()])
            .status()
            .unwrap();
        let path = format!(
            "{}:{}",
            bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut cmd = tokio::process::Command::new(&argv[0]);
        cmd.args(&argv[1..]).env("PATH", path);
        for e in c["env"].as_array().unwrap() {
            let key = e["valueFrom"]["secretKeyRef"]["key"].as_str().unwrap();
            let pw = passwords
                .iter()
                .find(|(k, _)| *k == key)
                .unwrap_or_else(|| panic!("no password for Secret key {key}"))
                .1;
            cmd.env(e["name"].as_str().unwrap(), pw);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("sh");
        let up = BundledRedis {
            port,
            spec,
            recorded,
            child,
            _conf: conf,
        };
        wait_for("the bundled Redis started", || async {
            std::fs::metadata(&up.recorded).ok().map(drop)?;
            tokio::net::TcpStream::connect(("127.0.0.1", up.port))
                .await
                .ok()
                .map(drop)
        })
        .await;
        up
    }
}

/// The bundled Redis as the chart runs it: each user's password from its Secret key is
/// required, and no password is on a command line (`ps` on the node, the pod spec).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bundled_redis_requires_the_passwords_it_never_shows_on_a_command_line() {
    let objs = manifest("lastcall-fleetiq.yaml");
    let redis = find(&objs, "Deployment")
        .into_iter()
        .find(|d| d["metadata"]["name"] == "lastcall-redis")
        .expect("the bundled Redis");
    let c = &redis["spec"]["template"]["spec"]["containers"][0];
    // Not a lastcall image: the pinned public one docs/release.md lists, which a release
    // does not push (the_release_chart_names_only_images_the_release_pushes_or_documents_as_public).
    let public = first_cells(&read("docs/release.md"), "Images a release does not push");
    assert!(
        public.iter().any(|p| c["image"] == p.as_str()),
        "the Redis image {} is not a public image of docs/release.md: {public:?}",
        c["image"]
    );
    let (pubsub_pw, agent_pw) = ("Zq7lastcallBundledPw", "Zq7lastcallAgentPw2");
    let (_, pubsub_key) = redis_env(&objs, "pubsub");
    let (_, agent_key) = redis_env(&objs, "agent");
    let mut redis =
        BundledRedis::start(&objs, &[(&pubsub_key, pubsub_pw), (&agent_key, agent_pw)]).await;
    let url = |user: &str, pw: &str| format!("redis://{user}:{pw}@127.0.0.1:{}/", redis.port);
    let ping = |u: String| async move {
        let c = redis::Client::open(u).ok()?;
        let mut con = c.get_multiplexed_async_connection().await.ok()?;
        redis::cmd("PING")
            .query_async::<String>(&mut con)
            .await
            .ok()
    };
    wait_for(
        "the bundled Redis answers each user with its password",
        || async {
            ping(url("lastcall-pubsub", pubsub_pw)).await?;
            ping(url("lastcall-agent", agent_pw)).await
        },
    )
    .await;
    for (user, pw) in [
        ("lastcall-pubsub", "not-the-password"),
        ("lastcall-agent", pubsub_pw),
        ("lastcall-pubsub", agent_pw),
        ("default", pubsub_pw),
    ] {
        assert_eq!(
            ping(url(user, pw)).await,
            None,
            "{user} with a wrong password passed"
        );
    }
    let argv = std::fs::read_to_string(&redis.recorded).expect("redis-server's arguments");
    assert!(argv.contains("redis-server"), "{argv}");
    for pw in [pubsub_pw, agent_pw] {
        assert!(
            !argv.contains(pw),
            "a password is on redis-server's command line: {argv}"
        );
    }
    assert!(!redis.spec.contains("$(REDIS_PASSWORD)"), "{}", redis.spec);
    redis.child.kill().await.ok();
}

/// `helm template` of the chart with the box's helm, default values plus `sets`.
fn helm_template(sets: &[&str]) -> Result<Vec<Value>, String> {
    helm_template_with(&[], sets)
}

/// `helm template` of the chart with values files (in order) and then `--set`s.
fn helm_template_with(files: &[&Path], sets: &[&str]) -> Result<Vec<Value>, String> {
    let bin = lastcall_testkit::kube_box::bin_dir()
        .map_err(|e| e.to_string())?
        .join("helm");
    let home = tempfile::tempdir().map_err(|e| e.to_string())?;
    let chart = repo().join("charts/lastcall");
    let mut cmd = std::process::Command::new(bin);
    cmd.args([
        "template",
        "lastcall",
        &chart.to_string_lossy(),
        "-n",
        "lastcall",
    ])
    .env("HOME", home.path())
    .env("HELM_CACHE_HOME", home.path().join("c"))
    .env("HELM_CONFIG_HOME", home.path().join("g"))
    .env("HELM_DATA_HOME", home.path().join("d"));
    for f in files {
        cmd.arg("-f").arg(f);
    }
    for s in sets {
        cmd.args(["--set", s]);
    }
    let out = cmd.output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let docs: Vec<Value> = serde_saphyr::from_multiple(&String::from_utf8_lossy(&out.stdout))
        .map_err(|e| e.to_string())?;
    Ok(docs.into_iter().filter(|d| !d.is_null()).collect())
}

const REG: &str = "image.registry=registry.example.com/lastcall";

#[test]
fn the_chart_refuses_what_would_fail_later_and_renders_each_option() {
    // No registry: refused, naming the value and the docs.
    let err = helm_template(&[]).expect_err("rendered without image.registry");
    assert!(
        err.contains("image.registry is required") && err.contains("docs/install.md"),
        "{err}"
    );
    // The webhook without maxReplicas: refused (no silent cap).
    let webhook = [REG, "pubsub.webhook.enabled=true", "redis.url=redis:6379"];
    let err = helm_template(&webhook).expect_err("rendered the webhook without maxReplicas");
    assert!(
        err.contains("pubsub.webhook.maxReplicas is required"),
        "{err}"
    );
    let with_max = [&webhook[..], &["pubsub.webhook.maxReplicas=900"]].concat();
    let objs = helm_template(&with_max).unwrap();
    let args = find(&objs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
        .to_string();
    assert!(args.contains("--webhook-max-replicas=900"), "{args}");
    // One webhook replica: no PDB (it would block its node's drains); two: one kept.
    assert!(find(&objs, "PodDisruptionBudget").is_empty());
    let two = [&with_max[..], &["pubsub.replicas=2"]].concat();
    let objs = helm_template(&two).unwrap();
    let pdb = find(&objs, "PodDisruptionBudget");
    assert_eq!(pdb.len(), 1, "a webhook PDB with two replicas");
    assert_eq!(pdb[0]["spec"]["minAvailable"], 1);
    assert_eq!(
        pdb[0]["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"],
        "pubsub"
    );
    // Azure Scheduled Events put the agent in the host network under `auto` (AKS pods may
    // be blocked from IMDS).
    let objs = helm_template(&[REG, "agent.azureEvents=true"]).unwrap();
    assert_eq!(
        agent_daemonset(&objs)["spec"]["template"]["spec"]["hostNetwork"],
        true
    );
    // A surge with hostNetwork is refused; without, it is a surge with nothing unavailable.
    let err = helm_template(&[REG, "agent.hostNetwork=true", "agent.maxSurge=10%"])
        .expect_err("a surge in the host network");
    assert!(
        err.contains("agent.maxSurge must be 0 or auto with hostNetwork"),
        "{err}"
    );
    // Who may read /metrics: a token on the host network (the scraper's token sent by the
    // agents' own monitor, pubsub's sends none); `none` leaves the agent without the review
    // role and the reader role out; `kubernetes` works in the pod network too.
    let objs = helm_template(&[
        REG,
        "agent.hostNetwork=true",
        "metrics.podMonitor.enabled=true",
        "metrics.serviceMonitor.enabled=true",
        "pubsub.webhook.enabled=true",
        "pubsub.webhook.maxReplicas=9",
        "redis.url=redis:6379",
    ])
    .unwrap();
    assert_eq!(
        granted(&objs, "lastcall-agent")
            .intersection(&metrics_auth_calls())
            .count(),
        2
    );
    let reader = find(&objs, "ClusterRole")
        .into_iter()
        .find(|r| r["metadata"]["name"] == "lastcall-metrics-reader")
        .expect("the metrics-reader ClusterRole");
    assert_eq!(
        reader["rules"],
        serde_json::json!([{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}])
    );
    let secret = find(&objs, "Secret")
        .into_iter()
        .find(|s| s["metadata"]["name"] == "lastcall-metrics-scraper-token")
        .expect("the scraper's token Secret");
    assert_eq!(secret["type"], "kubernetes.io/service-account-token");
    for kind in ["PodMonitor", "ServiceMonitor"] {
        let monitors = find(&objs, kind);
        assert_eq!(monitors.len(), 2, "{kind}: the agents' and pubsub's");
        for m in monitors {
            let components = m["spec"]["selector"]["matchExpressions"][0]["values"].to_string();
            let endpoints = m["spec"]
                .get("podMetricsEndpoints")
                .unwrap_or(&m["spec"]["endpoints"]);
            let auth = &endpoints[0]["authorization"];
            if components == r#"["agent"]"# {
                assert_eq!(
                    auth["credentials"]["name"],
                    "lastcall-metrics-scraper-token"
                );
                assert_eq!(auth["credentials"]["key"], "token");
            } else {
                assert_eq!(components, r#"["pubsub"]"#, "{kind}");
                assert!(
                    auth.is_null(),
                    "{kind}: pubsub's scrape carries a token: {auth}"
                );
            }
        }
    }
    let objs = helm_template(&[REG, "agent.hostNetwork=true", "agent.metricsAuth=none"]).unwrap();
    assert!(agent_args(&objs).contains(&"--metrics-auth=none".to_string()));
    assert!(agent_args(&objs).contains(&"--listen=127.0.0.1:9091".to_string()));
    assert!(granted(&objs, "lastcall-agent").is_disjoint(&metrics_auth_calls()));
    assert!(
        find(&objs, "ClusterRole")
            .iter()
            .all(|r| r["metadata"]["name"] != "lastcall-metrics-reader")
    );
    let objs = helm_template(&[REG, "agent.metricsAuth=kubernetes"]).unwrap();
    assert!(agent_args(&objs).contains(&"--metrics-auth=kubernetes".to_string()));
    assert!(agent_args(&objs).contains(&"--listen=[$(POD_IP)]:9090".to_string()));
    assert_eq!(
        granted(&objs, "lastcall-agent")
            .intersection(&metrics_auth_calls())
            .count(),
        2
    );
    let err = helm_template(&[REG, "agent.hostNetwork=true", "agent.probePort=9090"])
        .expect_err("the probes on /metrics' port");
    assert!(
        err.contains("agent.probePort must differ from agent.port"),
        "{err}"
    );
    let objs = helm_template(&[REG, "agent.maxSurge=10%"]).unwrap();
    let ru = &agent_daemonset(&objs)["spec"]["updateStrategy"]["rollingUpdate"];
    assert_eq!(
        (&ru["maxSurge"], &ru["maxUnavailable"]),
        (&Value::from("10%"), &Value::from(0))
    );
    // `auto` is a surge off the host network and none on it; a count is an integer (the API
    // server refuses a string that is not a percentage).
    for (sets, surge, unavailable) in [
        (&[REG][..], Value::from("25%"), Value::from(0)),
        (
            &[REG, "agent.hostNetwork=true"][..],
            Value::from(0),
            Value::from("10%"),
        ),
        (
            &[REG, "agent.maxSurge=3"][..],
            Value::from(3),
            Value::from(0),
        ),
        (
            &[REG, "agent.hostNetwork=true", "agent.maxUnavailable=2"][..],
            Value::from(0),
            Value::from(2),
        ),
    ] {
        let objs = helm_template(sets).unwrap();
        let ru = &agent_daemonset(&objs)["spec"]["updateStrategy"]["rollingUpdate"];
        assert_eq!(
            (&ru["maxSurge"], &ru["maxUnavailable"]),
            (&surge, &unavailable),
            "{sets:?}"
        );
    }
    // serviceAccount.create=false: no ServiceAccount rendered, the named one used and bound.
    let objs = helm_template(&[
        REG,
        "agent.serviceAccount.create=false",
        "agent.serviceAccount.name=mine",
        "fleetiq.enabled=true",
        "fleetiq.gameServerGroup=g",
        "redis.url=redis:6379",
        "pubsub.serviceAccount.create=false",
        "pubsub.serviceAccount.name=theirs",
    ])
    .unwrap();
    // (FleetIQ puts the agent on the host network, where /metrics asks for a token: the
    // chart's scraper ServiceAccount is the only one rendered.)
    assert!(
        find(&objs, "ServiceAccount")
            .iter()
            .all(|s| s["metadata"]["name"] == "lastcall-metrics-scraper"),
        "a ServiceAccount was rendered"
    );
    assert_eq!(
        agent_daemonset(&objs)["spec"]["template"]["spec"]["serviceAccountName"],
        "mine"
    );
    assert!(
        granted(&objs, "mine")
            .iter()
            .any(|(v, _, r, _)| v == "patch" && r == "nodes")
    );
    let pubsub = find(&objs, "Deployment")
        .into_iter()
        .find(|d| d["metadata"]["name"] == "lastcall-pubsub")
        .expect("pubsub");
    assert_eq!(
        pubsub["spec"]["template"]["spec"]["serviceAccountName"],
        "theirs"
    );
    // Scrape annotations can be turned off.
    let objs = helm_template(&[REG, "metrics.scrapeAnnotations=false"]).unwrap();
    assert!(
        agent_daemonset(&objs)["spec"]["template"]["metadata"]["annotations"]
            .get("prometheus.io/scrape")
            .is_none()
    );
    // The uninstall hook runs as its own ServiceAccount, not the agents' (which the node
    // restriction confines to one node), with exactly the calls it makes.
    let objs = helm_template(&[REG, "agent.autoscalerCooperation=in-use"]).unwrap();
    let job = find(&objs, "Job")[0];
    let sa = job["spec"]["template"]["spec"]["serviceAccountName"]
        .as_str()
        .unwrap();
    assert_ne!(sa, "lastcall-agent");
    let rules: BTreeSet<String> = granted(&objs, sa)
        .into_iter()
        .map(|(v, g, r, _)| format!("{v} {g}/{r}"))
        .collect();
    assert_eq!(
        rules,
        ["list /pods", "patch /pods", "get agones.dev/gameservers"]
            .into_iter()
            .map(String::from)
            .collect::<BTreeSet<_>>()
    );
}

// ---------------------------------------------------------------------------------------
// Every flag of both binaries has a chart value, with the binary's default
// ---------------------------------------------------------------------------------------

/// Where a flag is set from, when it is not `<component>.<camelCaseFlag>` (or, for
/// pubsub's `--webhook-*`, `pubsub.webhook.<camelCase>`). The paths must exist in
/// values.yaml; their defaults are not compared (the flag is composed or per node).
const FLAG_PATHS: &[(&str, &str, &[&str])] = &[
    // The uninstall hook's one-shot mode, set by its Job (templates/cooperation-cleanup.yaml).
    (
        "agent",
        "--cleanup-cooperation",
        &["agent.autoscalerCooperation"],
    ),
    ("agent", "--node-name", &[]), // the Downward API (spec.nodeName)
    ("agent", "--pod-name", &[]),  // the Downward API (metadata.name)
    ("agent", "--pod-namespace", &[]), // the Downward API (metadata.namespace)
    ("agent", "--pod-uid", &[]),   // the Downward API (metadata.uid)
    ("agent", "--instance-id", &["agent.imdsEndpoint"]), // per node: read from IMDS
    ("agent", "--game-server-id", &[]), // per node: the instance id
    ("agent", "--redis-channel", &[]), // per node: the instance id
    ("agent", "--game-server-group", &["fleetiq.gameServerGroup"]),
    (
        "agent",
        "--redis-url",
        &["redis.url", "redis.existingSecret", "redis.bundled.enabled"],
    ),
    ("agent", "--redis-ca-file", &["redis.tls.caSecret"]),
    ("agent", "--aws-region", &["fleetiq.region"]),
    (
        "agent",
        "--gamelift-endpoint",
        &["fleetiq.gameliftEndpoint"],
    ),
    (
        "agent",
        "--listen",
        &["agent.listenHost", "agent.port", "agent.probePort"],
    ),
    (
        "agent",
        "--metrics-listen",
        &["agent.listenHost", "agent.port"],
    ),
    // `auto` (by hostNetwork) in the chart; the binary cannot know it is on the host network.
    ("agent", "--metrics-auth", &["agent.metricsAuth"]),
    ("agent", "--publish-period", &["pubsub.period"]),
    ("agent", "--aws-queue", &["queue.enabled"]), // queue mode: pubsub and the agents together
    ("pubsub", "--sqs-endpoint", &["queue.endpoint"]),
    // The webhook URL is a secret: a file mounted from notifications.existingSecret.
    (
        "agent",
        "--notify-url-file",
        &[
            "notifications.enabled",
            "notifications.existingSecret",
            "notifications.existingSecretKey",
        ],
    ),
    ("pubsub", "--config-file", &["fleetiq.gameServerGroups"]),
    (
        "pubsub",
        "--redis-url",
        &["redis.url", "redis.existingSecret", "redis.bundled.enabled"],
    ),
    ("pubsub", "--redis-ca-file", &["redis.tls.caSecret"]),
    ("pubsub", "--aws-region", &["fleetiq.region"]),
    (
        "pubsub",
        "--gamelift-endpoint",
        &["fleetiq.gameliftEndpoint"],
    ),
    ("pubsub", "--listen", &["pubsub.port"]),
    (
        "pubsub",
        "--webhook-listen",
        &["pubsub.webhook.enabled", "pubsub.webhook.port"],
    ),
    (
        "pubsub",
        "--webhook-tls-cert",
        &[
            "pubsub.webhook.tls.enabled",
            "pubsub.webhook.tls.secretName",
        ],
    ),
    (
        "pubsub",
        "--webhook-tls-key",
        &[
            "pubsub.webhook.tls.enabled",
            "pubsub.webhook.tls.secretName",
        ],
    ),
];

/// Values whose chart default deliberately differs from the binary's (which has none).
const CHART_DEFAULTS: &[(&str, &str)] = &[(
    "pubsub.webhook.maxReplicas",
    "required by the binary with --webhook-listen",
)];

fn camel(kebab: &str) -> String {
    let mut out = String::new();
    let mut up = false;
    for ch in kebab.chars() {
        if ch == '-' {
            up = true;
        } else if up {
            out.push(ch.to_ascii_uppercase());
            up = false;
        } else {
            out.push(ch);
        }
    }
    out
}

fn value_at<'a>(values: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(values, |v, k| v.get(k))
}

/// A YAML scalar as `--help` would print it.
fn as_flag_value(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// Every problem with one binary's flags against values.yaml and the template that passes
/// them, one line per flag, saying what to add.
fn flag_value_problems(component: &str, help: &str, values: &Value, template: &str) -> Vec<String> {
    let mut problems = Vec::new();
    for o in parse_help(help) {
        if o.flag == "--help" || o.flag == "--version" {
            continue;
        }
        if let Some((_, _, paths)) = FLAG_PATHS
            .iter()
            .find(|(c, f, _)| *c == component && *f == o.flag)
        {
            for p in *paths {
                if value_at(values, p).is_none() {
                    problems.push(format!("{component} {}: values.yaml has no {p}", o.flag));
                }
            }
            continue;
        }
        let name = o.flag.trim_start_matches("--");
        let path = match (name.strip_prefix("webhook-"), name.strip_prefix("notify-")) {
            (Some(rest), _) if component == "pubsub" => {
                format!("pubsub.webhook.{}", camel(rest))
            }
            // Queue mode's values are the top-level `queue` block (both binaries use it).
            _ if component == "pubsub" && name.starts_with("queue-") => {
                format!("queue.{}", camel(name.trim_start_matches("queue-")))
            }
            (_, Some(rest)) if component == "agent" => format!("notifications.{}", camel(rest)),
            _ => format!("{component}.{}", camel(name)),
        };
        let Some(v) = value_at(values, &path) else {
            problems.push(format!(
                "{component} {} has no chart value: add `{path}` (default {}) to charts/lastcall/values.yaml with a `# --` comment, \
                 to values.schema.json, and pass it in charts/lastcall/templates/{}",
                o.flag,
                o.default.as_deref().map_or("unset".to_string(), |d| format!("`{d}`")),
                if component == "agent" { "agent-daemonset.yaml" } else { "pubsub.yaml" }
            ));
            continue;
        };
        if !template.contains(&format!("{}=", o.flag))
            && !template.contains(&format!("- {}\n", o.flag))
        {
            problems.push(format!(
                "{component} {}: `{path}` exists but charts/lastcall/templates/{} never passes the flag",
                o.flag,
                if component == "agent" { "agent-daemonset.yaml" } else { "pubsub.yaml" }
            ));
        }
        let chart_default = as_flag_value(v);
        let binary_default = match (&o.default, &o.value) {
            // clap quotes a default that is empty or holds spaces or quotes, with Rust's
            // string escapes (JSON's, for what a default holds).
            (Some(d), _) if d.len() >= 2 && d.starts_with('"') && d.ends_with('"') => {
                serde_json::from_str::<String>(d).unwrap_or_else(|_| d.clone())
            }
            (Some(d), _) => d.clone(),
            (None, None) => "false".to_string(), // a switch
            (None, Some(_)) => String::new(),    // unset
        };
        if chart_default != binary_default && !CHART_DEFAULTS.iter().any(|(p, _)| *p == path) {
            problems.push(format!(
                "{component} {}: `{path}` defaults to `{chart_default}` in values.yaml, the binary to `{binary_default}`",
                o.flag
            ));
        }
    }
    problems
}

#[test]
fn every_flag_has_a_chart_value_with_the_binarys_default() {
    let values: Value =
        serde_saphyr::from_str(&read("charts/lastcall/values.yaml")).expect("values.yaml is YAML");
    let mut problems = Vec::new();
    for (component, bin, template) in [
        ("agent", "lastcall-agent", "agent-daemonset.yaml"),
        ("pubsub", "lastcall-pubsub", "pubsub.yaml"),
    ] {
        let help = help_of(bin);
        let template = read(&format!("charts/lastcall/templates/{template}"));
        problems.extend(flag_value_problems(component, &help, &values, &template));
    }
    assert!(
        problems.is_empty(),
        "the chart does not cover every flag:\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn a_new_flag_without_a_value_is_named() {
    let values: Value = serde_json::json!({"agent": {"dryRun": false, "drainDeadline": "30m"}});
    let help = "x\n\nOptions:\n      --dry-run\n          Dry [env: D=]\n      --drain-deadline <D>\n          Deadline [env: X=] [default: 45m]\n      --brand-new <N>\n          New [env: N=] [default: 3]\n";
    let template = "- --dry-run\n- --drain-deadline={{ x }}\n";
    let p = flag_value_problems("agent", help, &values, template);
    assert_eq!(p.len(), 2, "{p:#?}");
    assert!(
        p[0].contains("--drain-deadline") && p[0].contains("`45m`"),
        "{}",
        p[0]
    );
    assert!(
        p[1].contains("--brand-new has no chart value: add `agent.brandNew` (default `3`)"),
        "{}",
        p[1]
    );
}

/// What CI can check of the images without building them (the build itself is
/// `hack/build-images.sh`, run by hand): a static musl build for amd64 and arm64, an empty
/// final stage, a non-root user, the binary as the entrypoint.
#[test]
fn dockerfiles_build_static_non_root_images_from_scratch() {
    for c in ["agent", "pubsub"] {
        let text = read(&format!("Dockerfile.{c}"));
        let lines: Vec<&str> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .collect();
        let last_from = lines
            .iter()
            .rposition(|l| l.starts_with("FROM "))
            .expect("a FROM");
        let final_stage = &lines[last_from..];
        assert_eq!(final_stage[0], "FROM scratch", "Dockerfile.{c}");
        assert!(
            final_stage.contains(&"USER 65532:65532"),
            "Dockerfile.{c}: the final stage must run as 65532"
        );
        assert_eq!(
            final_stage.last().copied(),
            Some(format!("ENTRYPOINT [\"/lastcall-{c}\"]").as_str()),
            "Dockerfile.{c}"
        );
        assert!(
            !final_stage.iter().any(|l| l.starts_with("RUN ")),
            "Dockerfile.{c}: no RUN in a stage without a shell"
        );
        assert!(
            text.contains("x86_64-unknown-linux-musl")
                && text.contains("aarch64-unknown-linux-musl")
                && text.contains("ARG TARGETARCH")
                && text.contains(&format!("--bin lastcall-{c}")),
            "Dockerfile.{c}: the builder must produce the static musl binary for amd64 and arm64"
        );
        assert!(
            text.contains("ca-certificates.crt"),
            "Dockerfile.{c}: CA bundle"
        );
    }
}

/// Every `image` of every container (init and ephemeral ones too) in rendered objects.
fn images(objs: &[Value]) -> BTreeSet<String> {
    fn walk(v: &Value, out: &mut BTreeSet<String>) {
        match v {
            Value::Object(m) => {
                for (k, x) in m {
                    if matches!(
                        k.as_str(),
                        "containers" | "initContainers" | "ephemeralContainers"
                    ) {
                        for c in x.as_array().into_iter().flatten() {
                            if let Some(i) = c["image"].as_str() {
                                out.insert(i.to_string());
                            }
                        }
                    }
                    walk(x, out);
                }
            }
            Value::Array(a) => a.iter().for_each(|x| walk(x, out)),
            _ => {}
        }
    }
    let mut out = BTreeSet::new();
    objs.iter().for_each(|o| walk(o, &mut out));
    out
}

/// The backticked first cells of the table rows of `section` (a `## ` heading) of `doc`.
fn first_cells(doc: &str, section: &str) -> Vec<String> {
    let body = doc
        .split_once(&format!("\n## {section}\n"))
        .map(|(_, rest)| rest.split("\n## ").next().unwrap_or(""))
        .unwrap_or_else(|| panic!("no section {section:?}"));
    body.lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split_once('`').map(|(cell, _)| cell.to_string()))
        .collect()
}

/// A user who installs a release must be able to pull every image its chart names: each one
/// is pushed by the release (`docs/release.md`'s artifact table, as `hack/release.sh`
/// pushes them) or is one of the public images that page lists. Rendered as the release
/// renders its package: every component on, `image.registry` the release registry, the
/// chart's own version.
#[test]
fn the_release_chart_names_only_images_the_release_pushes_or_documents_as_public() {
    let doc = read("docs/release.md");
    let registry = "registry.invalid/lastcall";
    let version = read("charts/lastcall/Chart.yaml")
        .lines()
        .find_map(|l| l.strip_prefix("appVersion:"))
        .map(|v| v.trim().trim_matches('"').to_string())
        .expect("Chart.yaml's appVersion");
    // The artifact table: `<registry>/lastcall-agent:<version>`, … (the chart row is oci://).
    let pushed: BTreeSet<String> = doc
        .lines()
        .take_while(|l| !l.starts_with("## "))
        .filter(|l| l.starts_with('|') && l.contains(" image |"))
        .filter_map(|l| l.split('`').nth(1))
        .map(|r| {
            r.replace("<registry>", registry)
                .replace("<version>", &version)
        })
        .collect();
    assert_eq!(
        pushed.len(),
        2,
        "docs/release.md's artifact table: {pushed:?}"
    );
    let script = read("hack/release.sh");
    let components = script
        .lines()
        .find_map(|l| l.strip_prefix("COMPONENTS=("))
        .and_then(|l| l.strip_suffix(')'))
        .expect("hack/release.sh's COMPONENTS");
    let script_pushes: BTreeSet<String> = components
        .split_whitespace()
        .map(|c| format!("{registry}/lastcall-{c}:{version}"))
        .collect();
    assert_eq!(
        script_pushes, pushed,
        "hack/release.sh pushes other images than docs/release.md says"
    );
    let public: BTreeSet<String> = first_cells(&doc, "Images a release does not push")
        .into_iter()
        .collect();
    for p in &public {
        let (name, tag) = p.rsplit_once(':').expect("a tag");
        assert!(
            name.split('/').next().is_some_and(|h| h.contains('.'))
                && tag.chars().next().is_some_and(|c| c.is_ascii_digit()),
            "docs/release.md's public image {p} must name its registry and a release tag"
        );
    }

    let all_on = repo().join("charts/lastcall/ci/all-on-values.yaml");
    let set = format!("image.registry={registry}");
    let objs = helm_template_with(&[&all_on], &[&set]).expect("the release's render");
    let named = images(&objs);
    let stray: Vec<&String> = named
        .iter()
        .filter(|i| !pushed.contains(*i) && !public.contains(*i))
        .collect();
    assert!(
        stray.is_empty(),
        "the release's chart names {stray:?}: not pushed by the release ({pushed:?}), not a \
         public image of docs/release.md ({public:?}); a release install would not pull it"
    );
    for p in &pushed {
        assert!(named.contains(p), "the release's chart never names {p}");
    }
    // The bundled Redis is the documented public one, in a default render too.
    let redis = helm_template(&[
        REG,
        "fleetiq.enabled=true",
        "fleetiq.gameServerGroup=g",
        "redis.bundled.auth.existingSecret=s",
    ])
    .expect("FleetIQ with the bundled Redis");
    let named = images(&redis);
    assert!(
        named.iter().any(|i| public.contains(i)),
        "the bundled Redis is not docs/release.md's public image: {named:?}"
    );
    // The keys that put it under image.registry are refused, not ignored.
    for old in ["redis.bundled.repository=redis", "redis.bundled.tag=7.2"] {
        let err = helm_template(&[REG, old]).expect_err(old);
        assert!(err.contains("additional properties"), "{old}: {err}");
    }
}

#[test]
fn the_readme_links_every_doc() {
    let readme = read("README.md");
    let mut docs: Vec<String> = std::fs::read_dir(repo().join("docs"))
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    docs.push("charts/lastcall/README.md".into());
    for d in docs {
        assert!(
            readme.contains(&format!("]({d})")),
            "README.md does not link {d}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// docs/configuration.md from --help
// ---------------------------------------------------------------------------------------

/// One option as `--help` prints it.
#[derive(Debug)]
struct Opt {
    flag: String,
    value: Option<String>,
    env: Option<String>,
    default: Option<String>,
    possible: Option<String>,
    help: String,
}

/// Parses clap's `--help` (long form: option line, then an indented description that ends
/// with `[env: X=]`, `[default: v]`, `[possible values: …]`).
fn parse_help(text: &str) -> Vec<Opt> {
    let mut opts: Vec<Opt> = Vec::new();
    let mut in_options = false;
    for line in text.lines() {
        if line.trim_end() == "Options:" {
            in_options = true;
            continue;
        }
        if !in_options || line.trim().is_empty() {
            continue;
        }
        let indent = line.len() - line.trim_start().len();
        let t = line.trim();
        if indent <= 6 && (t.starts_with("--") || t.starts_with('-')) {
            let long = t
                .split_whitespace()
                .find(|w| w.starts_with("--"))
                .unwrap_or(t);
            let (flag, value) = match t.split_once(' ').filter(|_| !t.starts_with("-h")) {
                _ if t.starts_with('-') && !t.starts_with("--") => {
                    (long.trim_end_matches(',').to_string(), None)
                }
                Some((f, v)) => (f.to_string(), Some(v.trim().to_string())),
                None => (t.to_string(), None),
            };
            opts.push(Opt {
                flag,
                value,
                env: None,
                default: None,
                possible: None,
                help: String::new(),
            });
        } else if let Some(o) = opts.last_mut() {
            let mut rest = t.to_string();
            for (tag, slot) in [
                ("[possible values: ", &mut o.possible),
                ("[default: ", &mut o.default),
                ("[env: ", &mut o.env),
            ] {
                if let Some(i) = rest.rfind(tag) {
                    let v = rest[i + tag.len()..].trim_end_matches(']').to_string();
                    *slot = Some(v.trim_end_matches('=').to_string());
                    rest.truncate(i);
                    rest = rest.trim_end().to_string();
                }
            }
            if !o.help.is_empty() {
                o.help.push(' ');
            }
            o.help.push_str(&rest);
        }
    }
    opts
}

fn help_of(bin: &str) -> String {
    let path = workspace_binary(bin, bin);
    let out = std::process::Command::new(path)
        .arg("--help")
        .env_clear()
        .output()
        .unwrap();
    assert!(out.status.success(), "{bin} --help failed");
    String::from_utf8(out.stdout).unwrap()
}

fn cell(s: &str) -> String {
    s.replace('|', "\\|")
}

fn configuration_md() -> String {
    let mut md = String::from(
        "# Configuration\n\n\
         <!-- Generated from the binaries' --help by hack/gen-docs.sh; do not edit. \
         tests/tests/packaging.rs fails when this file and --help differ. -->\n\n\
         Every option of both binaries is a command-line flag and an environment variable; the \
         flag wins when both are set. A bad value exits with code 2 and one line on stderr \
         naming the flag. Durations take `ms`, `s`, `m` or `h`; a bare number is seconds. The \
         chart has a value for every flag (`charts/lastcall/README.md`; the packaging test \
         checks the names and the defaults against `--help`), and takes anything else through \
         `agent.extraArgs` / `pubsub.extraArgs` or `extraEnv`.\n\n\
         Other environment the binaries read: `KUBECONFIG` or the in-cluster service account \
         (agent), the AWS SDK's credential chain (`AWS_ACCESS_KEY_ID`, `AWS_PROFILE`, IRSA's \
         `AWS_WEB_IDENTITY_TOKEN_FILE` / `AWS_ROLE_ARN`, EKS Pod Identity), and `RUST_LOG`, \
         which overrides `--log-level`.\n",
    );
    for bin in ["lastcall-agent", "lastcall-pubsub"] {
        let help = help_of(bin);
        let about = help.lines().next().unwrap_or_default();
        md.push_str(&format!("\n## {bin}\n\n{about}\n\n"));
        md.push_str("| Flag | Environment | Default | Meaning |\n|---|---|---|---|\n");
        for o in parse_help(&help) {
            let flag = match &o.value {
                Some(v) => format!("`{} {}`", o.flag, v),
                None => format!("`{}`", o.flag),
            };
            let env = o
                .env
                .as_deref()
                .map(|e| format!("`{e}`"))
                .unwrap_or("–".into());
            let default = o
                .default
                .as_deref()
                .map(|d| format!("`{d}`"))
                .unwrap_or("–".into());
            let help = match &o.possible {
                Some(p) => format!("{} (one of: {p})", o.help),
                None => o.help.clone(),
            };
            md.push_str(&format!(
                "| {} | {} | {} | {} |\n",
                cell(&flag),
                env,
                cell(&default),
                cell(&help)
            ));
        }
        md.push_str(&format!(
            "\n<details><summary><code>{bin} --help</code></summary>\n\n```text\n{}\n```\n\n</details>\n",
            help.trim_end()
        ));
    }
    md
}

#[test]
fn configuration_md_is_what_the_binaries_help_says() {
    let want = configuration_md();
    let path = repo().join("docs/configuration.md");
    if std::env::var_os("LASTCALL_BLESS").is_some() {
        std::fs::write(&path, &want).unwrap();
        return;
    }
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    if have != want {
        let first = have
            .lines()
            .zip(want.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(have.lines().count().min(want.lines().count()));
        panic!(
            "docs/configuration.md differs from the binaries' --help from line {} on:\n  doc:  {:?}\n  help: {:?}\nRun hack/gen-docs.sh and commit.",
            first + 1,
            have.lines().nth(first),
            want.lines().nth(first)
        );
    }
}

#[test]
fn help_parser_reads_flags_env_and_defaults() {
    let help = "About\n\nUsage: x\n\nOptions:\n      --period <PERIOD>\n          Time between cycles [env: P=] [default: 60s]\n      --flag [<B>]\n          A bool [env: B=] [default: true] [possible values: true, false]\n  -h, --help\n          Print help\n";
    let o = parse_help(help);
    assert_eq!(o.len(), 3);
    assert_eq!(o[0].flag, "--period");
    assert_eq!(o[0].value.as_deref(), Some("<PERIOD>"));
    assert_eq!(o[0].env.as_deref(), Some("P"));
    assert_eq!(o[0].default.as_deref(), Some("60s"));
    assert_eq!(o[0].help, "Time between cycles");
    assert_eq!(o[1].possible.as_deref(), Some("true, false"));
    assert_eq!(o[2].flag, "--help");
    assert_eq!(o[2].env, None);
}

// ---------------------------------------------------------------------------------------
// Metrics: dashboard and alerts vs. what the binaries export; promtool check metrics
// ---------------------------------------------------------------------------------------

/// The webhook's metrics with the families the alerts use filled: a Fleet held by a stale
/// drain-state entry, and a review with a bad per-Fleet setting.
async fn webhook_metrics(redis: &lastcall_testkit::redis::RedisServer) -> String {
    use lastcall_common::drain_state::{self, FleetOnNode, NodeDrainState};
    use lastcall_testkit::webhook::{FleetStatus, WebhookServer, agones_review};
    let hook = WebhookServer::start(&redis.url(), &["--webhook-max-replicas", "100"], None)
        .await
        .unwrap()
        .with_fleets(&[("default", "pkg-fleet", 20)])
        .await
        .unwrap();
    hook.add_nodes(&["pkg-node"]).await.unwrap();
    let stale = NodeDrainState {
        node: "pkg-node".into(),
        updated_at_ms: drain_state::unix_ms(std::time::SystemTime::now()) - 3 * 60_000,
        counted_at_ms: None,
        truncated: false,
        fleets: vec![FleetOnNode {
            namespace: "default".into(),
            name: "pkg-fleet".into(),
            ready: 2,
            allocated: 0,
            held: None,
            at_risk: None,
        }],
    };
    let mut conn = redis.client().await.unwrap();
    drain_state::publish(&mut conn, &stale).await.unwrap();
    let status = FleetStatus {
        replicas: 20,
        ready: 10,
        reserved: 0,
        allocated: 10,
    };
    let http = reqwest::Client::new();
    for (uid, annotations) in [
        ("held", &[][..]),
        ("typo", &[("lastcall.dev/autoscaler-buffer", "lots")][..]),
    ] {
        let r = http
            .post(hook.url())
            .body(agones_review(
                uid,
                "default",
                "pkg-fleet",
                status,
                annotations,
            ))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    hook.metrics_text()
}

/// The real pubsub binary in queue mode alone (no Redis) against moto's SQS and the kube
/// emulator, after relaying one event and deleting one unreadable message.
async fn queue_metrics(w: &World) -> String {
    use lastcall_testkit::queue::{QueueRig, REGION, set_provider_id};
    let instance = "i-0123456789abcdef0";
    let admin = w.cluster.emulator().config_for("admin").await.unwrap();
    set_provider_id(&admin, "n1", instance).await;
    let rig = QueueRig::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    w.cluster
        .emulator()
        .write_kubeconfig(&kubeconfig, "pubsub")
        .unwrap();
    let port = free_port();
    let bin =
        tokio::task::spawn_blocking(|| workspace_binary("lastcall-pubsub", "lastcall-pubsub"))
            .await
            .unwrap();
    let mut child = tokio::process::Command::new(bin)
        .env_clear()
        .env("HOME", dir.path())
        .env("AWS_ACCESS_KEY_ID", "AKIDPACKAGING")
        .env("AWS_SECRET_ACCESS_KEY", "packaging-secret")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env("KUBECONFIG", &kubeconfig)
        .args([
            "--queue-url",
            &rig.queue_url,
            "--sqs-endpoint",
            &rig.moto.url(),
        ])
        .args(["--aws-region", REGION, "--queue-wait", "1s"])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    rig.spot(instance, "terminate").await;
    rig.moto.send(&rig.queue_url, "{not json").await.unwrap();
    let addr = ([127, 0, 0, 1], port).into();
    let text = wait_for(
        "pubsub relayed one event and deleted the bad message",
        || async {
            let text = scrape(addr).await;
            (text.contains("lastcall_pubsub_queue_messages_deleted_total{reason=\"relayed\"} 1")
                && text.contains(
                    "lastcall_pubsub_queue_messages_deleted_total{reason=\"parse_error\"} 1",
                ))
            .then_some(text)
        },
    )
    .await;
    let _ = child.start_kill();
    text
}

/// The real pubsub binary polling a group with instances and a group that does not exist;
/// its `/metrics` port.
struct PubsubRun {
    child: tokio::process::Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl PubsubRun {
    async fn start(
        gl: &GameLiftEmulator,
        redis_url: &str,
        cluster: Option<&lastcall_testkit::cluster::Cluster>,
    ) -> PubsubRun {
        gl.add_instances(
            "pkg-group",
            &[
                lastcall_testkit::gamelift::instance_id("pkg0"),
                lastcall_testkit::gamelift::instance_id("pkg1"),
            ],
            GlStatus::Draining,
        );
        // pkg-missing does not exist: its NotFound fills the group-error family.
        Self::start_with(gl, redis_url, cluster, &["pkg-group", "pkg-missing"]).await
    }

    /// The real pubsub polling `groups` of `gl`, publishing to `redis_url`.
    async fn start_polling(gl: &GameLiftEmulator, redis_url: &str, groups: &[&str]) -> PubsubRun {
        Self::start_with(gl, redis_url, None, groups).await
    }

    async fn start_with(
        gl: &GameLiftEmulator,
        redis_url: &str,
        cluster: Option<&lastcall_testkit::cluster::Cluster>,
        group_names: &[&str],
    ) -> PubsubRun {
        let dir = tempfile::tempdir().unwrap();
        let groups = dir.path().join("fleetiq.conf");
        std::fs::write(
            &groups,
            serde_json::json!({"GameServerGroups": group_names}).to_string(),
        )
        .unwrap();
        let port = free_port();
        let bin =
            tokio::task::spawn_blocking(|| workspace_binary("lastcall-pubsub", "lastcall-pubsub"))
                .await
                .unwrap();
        let mut cmd = tokio::process::Command::new(bin);
        cmd.env_clear()
            .env("HOME", dir.path())
            .env("AWS_ACCESS_KEY_ID", "AKIDPACKAGING")
            .env("AWS_SECRET_ACCESS_KEY", "packaging-secret")
            .env("AWS_EC2_METADATA_DISABLED", "true")
            .env("AWS_REGION", "us-west-2")
            .env("AWS_ENDPOINT_URL_GAMELIFT", gl.url())
            .env("REDIS_URL", redis_url)
            .args(["--config-file", groups.to_str().unwrap()])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--period", "10s", "--cycle-jitter", "0s"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        if let Some(c) = cluster {
            let kubeconfig = dir.path().join("kubeconfig");
            c.emulator()
                .write_kubeconfig(&kubeconfig, "pubsub")
                .unwrap();
            cmd.env("KUBECONFIG", kubeconfig);
        }
        PubsubRun {
            child: cmd.spawn().unwrap(),
            port,
            _dir: dir,
        }
    }

    async fn metrics(&self) -> String {
        scrape(([127, 0, 0, 1], self.port).into()).await
    }

    async fn wait_cycle(&self) {
        wait_for("pubsub completed a cycle", || async {
            self.metrics()
                .await
                .lines()
                .any(|l| l.starts_with("lastcall_pubsub_cycles_total{"))
                .then_some(())
        })
        .await;
    }
}

impl Drop for PubsubRun {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

/// Every series name an exposition can contain: the samples present, plus what each `# TYPE`
/// family yields (`_total` for counters, `_bucket`/`_sum`/`_count` for histograms), so a
/// family with no sample yet still counts as exported.
fn exported_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
                continue;
            };
            let suffixes: &[&str] = match kind {
                "counter" => &["_total", "_created"],
                "histogram" => &["_bucket", "_sum", "_count", "_created"],
                "summary" => &["", "_sum", "_count", "_created"],
                "info" => &["_info"],
                _ => &[""],
            };
            for s in suffixes {
                names.insert(format!("{name}{s}"));
            }
        } else if !line.starts_with('#') && !line.is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            names.insert(line[..end].to_string());
        }
    }
    names
}

/// Every `lastcall_…` identifier in a PromQL expression.
fn metric_refs(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while let Some(pos) = expr[i..].find("lastcall_") {
        let start = i + pos;
        let boundary = start == 0 || {
            let c = bytes[start - 1];
            !(c.is_ascii_alphanumeric() || c == b'_' || c == b'"')
        };
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        if boundary {
            out.insert(expr[start..end].to_string());
        }
        i = end;
    }
    out
}

/// (panel title, expressions) of the dashboard.
fn dashboard_panels() -> Vec<(String, Vec<String>)> {
    let d: Value = serde_json::from_str(&read("charts/lastcall/dashboards/lastcall.json"))
        .expect("the dashboard is JSON");
    d["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .map(|p| {
            let exprs = p["targets"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| t["expr"].as_str().map(str::to_string))
                .collect();
            (p["title"].as_str().unwrap_or_default().to_string(), exprs)
        })
        .collect()
}

/// (alert name, expression) of the rendered rule file.
fn alert_rules() -> Vec<(String, String)> {
    let doc: Value = serde_saphyr::from_str(&read("manifests/prometheus-rules.yaml")).unwrap();
    doc["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
        .map(|r| {
            (
                r["alert"]
                    .as_str()
                    .or(r["record"].as_str())
                    .unwrap_or_default()
                    .to_string(),
                r["expr"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// `promtool check metrics` on a real exposition. promtool 2.x lints the Prometheus text
/// format, while the binaries serve OpenMetrics, where a counter family `x` (with `# HELP x`)
/// has samples `x_total`; promtool reports those samples as having no help text. That one
/// finding is accepted for exactly those counters; any other finding, or a parse error, fails.
fn promtool_check_metrics(what: &str, text: &str) {
    use std::io::Write;
    lastcall_testkit::tools::ensure("promtool", "prometheus").unwrap_or_else(|e| panic!("{e:#}"));
    let mut child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("promtool is needed (apt-get install prometheus; .ci/run installs it): {e}")
        });
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let openmetrics_counter = |finding: &str| {
        finding
            .strip_suffix(" no help text")
            .and_then(|s| s.strip_suffix("_total"))
            .is_some_and(|family| {
                text.contains(&format!("# TYPE {family} counter\n"))
                    && text.contains(&format!("# HELP {family} "))
            })
    };
    let findings: Vec<&str> = stdout
        .lines()
        .chain(stderr.lines())
        .map(str::trim)
        .filter(|l| !l.is_empty() && !openmetrics_counter(l))
        .collect();
    assert!(
        findings.is_empty(),
        "promtool check metrics rejects {what}'s /metrics:\n{}",
        findings.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_and_alerts_use_only_metrics_the_binaries_export() {
    // prometheus-client leaves a labelled family out of /metrics until it has a sample, so
    // the flow fills every family the dashboard and alerts use: a drain to the end, a
    // rejected message, a pubsub group that fails.
    let w = World::start(WorldSpec::new(1, 1, 0)).await;
    let agent = w.agent(&[]).await;
    subscribed(&agent).await;
    w.claimed_all().await;
    wait_for("a heartbeat", || async {
        (lastcall_testkit::agent::metric_sum(
            &agent.metrics().await,
            "lastcall_heartbeats_total",
            &[],
        ) >= 1.0)
            .then_some(())
    })
    .await;
    let keep = w.allocated();
    w.status(Status::Draining).await;
    w.fenced_and_released(&keep).await;
    w.raw("{not json").await; // a rejected signal
    wait_for("the bad message is counted", || async {
        agent
            .metrics()
            .await
            .contains("lastcall_signals_rejected_total{")
            .then_some(())
    })
    .await;
    w.finish_drain(&keep).await; // a deregistration and a drain duration
    let agent_text = agent.metrics().await;
    agent.stop().await.unwrap();
    let pubsub = PubsubRun::start(&w.gl, &w.redis.url(), None).await;
    pubsub.wait_cycle().await;
    let pubsub_text = pubsub.metrics().await;
    drop(pubsub);
    let webhook_text = webhook_metrics(&w.redis).await;
    let queue_text = queue_metrics(&w).await;

    promtool_check_metrics("lastcall-agent", &agent_text);
    promtool_check_metrics("lastcall-pubsub", &pubsub_text);
    promtool_check_metrics("lastcall-pubsub (webhook)", &webhook_text);
    promtool_check_metrics("lastcall-pubsub (queue)", &queue_text);
    let pubsub_text = format!("{pubsub_text}\n{webhook_text}\n{queue_text}");

    let exported: BTreeSet<String> = exported_names(&agent_text)
        .into_iter()
        .chain(exported_names(&pubsub_text))
        .collect();
    assert!(exported.contains("lastcall_drain_phase"), "{agent_text}");
    assert!(
        exported.contains("lastcall_pubsub_cycle_duration_seconds_bucket"),
        "{pubsub_text}"
    );

    // Every family the binaries export is documented.
    let metrics_md = read("docs/metrics.md");
    for line in agent_text.lines().chain(pubsub_text.lines()) {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut parts = rest.split_whitespace();
        let (Some(family), Some(kind)) = (parts.next(), parts.next()) else {
            continue;
        };
        let name = if kind == "counter" {
            format!("{family}_total")
        } else {
            family.to_string()
        };
        assert!(
            metrics_md.contains(&format!("| `{name}` |")),
            "docs/metrics.md does not describe {name}"
        );
    }

    let mut unknown: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let panels = dashboard_panels();
    for (title, exprs) in &panels {
        let refs: BTreeSet<String> = exprs.iter().flat_map(|e| metric_refs(e)).collect();
        assert!(
            !refs.is_empty(),
            "dashboard panel {title:?} queries no lastcall metric"
        );
        for r in refs.difference(&exported) {
            unknown
                .entry(format!("dashboard panel {title:?}"))
                .or_default()
                .insert(r.clone());
        }
    }
    let rules = alert_rules();
    for (name, expr) in &rules {
        // An alert on kube-state-metrics' figures (a node with no agent, or a Pending agent,
        // has no agent to export anything) names those instead.
        if KUBE_STATE_ALERTS.contains(&name.as_str()) {
            assert!(
                expr.contains("kube_daemonset_status_") || expr.contains("kube_pod_"),
                "alert {name} is listed as kube-state-metrics' but does not use its DaemonSet or pod figures: {expr}"
            );
            continue;
        }
        let refs = metric_refs(expr);
        assert!(!refs.is_empty(), "alert {name} uses no lastcall metric");
        for r in refs.difference(&exported) {
            unknown
                .entry(format!("alert {name}"))
                .or_default()
                .insert(r.clone());
        }
    }
    assert!(
        unknown.is_empty(),
        "metrics the binaries do not export: {unknown:#?}"
    );

    // The panels and alerts the issue asks for are all there.
    let titles: BTreeSet<&str> = panels.iter().map(|(t, _)| t.as_str()).collect();
    for t in [
        "Nodes draining, by phase",
        "Signals by source",
        "Signal → fence latency",
        "Drain duration",
        "Game servers protected and released",
        "Matches at risk",
        "FleetIQ heartbeats",
        "Redis health",
        "pubsub cycle time",
    ] {
        assert!(titles.contains(t), "dashboard panel {t:?} missing");
    }
    let alerts: BTreeSet<&str> = rules.iter().map(|(n, _)| n.as_str()).collect();
    for a in [
        "LastcallDrainTooLong",
        "LastcallRedisDisconnected",
        "LastcallHeartbeatFailures",
        "LastcallSignalsRejected",
        "LastcallMatchesAtRisk",
        "LastcallEmptyNodeStillRegistered",
        "LastcallSourceDown",
        "LastcallGameLiftErrors",
    ] {
        assert!(alerts.contains(a), "alert {a} missing");
    }
}

/// A real Prometheus (Debian's `prometheus`) scrapes a real agent with the shipped rule file
/// loaded: every rule evaluates without error, a drain shows up in a query, and a rejected
/// signal fires `LastcallSignalsRejected`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scrapes_the_agent_and_evaluates_the_alerts() {
    let w = World::start(WorldSpec::new(1, 1, 0)).await;
    let agent = w.agent(&[]).await;
    subscribed(&agent).await;
    w.claimed_all().await;

    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let config = format!(
        "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n\
         rule_files: [{rules:?}]\n\
         scrape_configs:\n  - job_name: lastcall\n    static_configs:\n      - targets: [\"{target}\"]\n        \
         labels: {{namespace: lastcall, pod: lastcall-agent-x, node: n1}}\n",
        rules = repo().join("manifests/prometheus-rules.yaml"),
        target = agent.admin,
    );
    std::fs::write(dir.path().join("prometheus.yml"), config).unwrap();
    lastcall_testkit::tools::ensure("prometheus", "prometheus").unwrap_or_else(|e| panic!("{e:#}"));
    let mut prom = tokio::process::Command::new("prometheus")
        .arg(format!(
            "--config.file={}",
            dir.path().join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("prometheus is needed (apt-get install prometheus): {e}"));
    let http = reqwest::Client::new();
    let api = |path: String| {
        let http = http.clone();
        async move {
            let r = http
                .get(format!("http://127.0.0.1:{port}/api/v1/{path}"))
                .send()
                .await
                .ok()?;
            r.json::<Value>().await.ok()
        }
    };
    let query = |q: &str| {
        api(format!(
            "query?query={}",
            url::form_urlencoded::byte_serialize(q.as_bytes()).collect::<String>()
        ))
    };

    w.status(Status::Draining).await;
    let keep = w.allocated();
    w.fenced_and_released(&keep).await;
    let slow = std::time::Duration::from_secs(30);
    let step = std::time::Duration::from_millis(250);
    lastcall_testkit::eventually::eventually("Prometheus sees the drain", slow, step, || async {
        let v = query(r#"sum(lastcall_drain_phase{phase="draining",node="n1"})"#).await?;
        (v["data"]["result"][0]["value"][1] == "1").then_some(())
    })
    .await;

    // Two rejected messages, one scrape apart, so increase() over them is positive.
    w.raw("{not json").await;
    lastcall_testkit::eventually::eventually(
        "Prometheus scraped the first rejection",
        slow,
        step,
        || async {
            let v = query("sum(lastcall_signals_rejected_total)").await?;
            (v["data"]["result"][0]["value"][1] == "1").then_some(())
        },
    )
    .await;
    w.raw("{still not json").await;
    lastcall_testkit::eventually::eventually(
        "LastcallSignalsRejected fires",
        slow,
        step,
        || async {
            let v = api("alerts".into()).await?;
            v["data"]["alerts"]
                .as_array()?
                .iter()
                .any(|a| {
                    a["labels"]["alertname"] == "LastcallSignalsRejected" && a["state"] == "firing"
                })
                .then_some(())
        },
    )
    .await;

    // Every rule has been evaluated, and without error.
    let expected = alert_rules().len();
    let health =
        lastcall_testkit::eventually::eventually("every rule evaluated", slow, step, || async {
            let v = api("rules".into()).await?;
            let health: Vec<(String, String, String)> = v["data"]["groups"]
                .as_array()?
                .iter()
                .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
                .map(|r| {
                    (
                        r["name"].as_str().unwrap_or_default().to_string(),
                        r["health"].as_str().unwrap_or_default().to_string(),
                        r["lastError"].as_str().unwrap_or_default().to_string(),
                    )
                })
                .collect();
            (health.len() == expected && health.iter().all(|(_, h, _)| h != "unknown"))
                .then_some(health)
        })
        .await;
    for (name, h, err) in health {
        assert_eq!(h, "ok", "rule {name} does not evaluate: {err}");
    }
    prom.start_kill().ok();
    agent.stop().await.unwrap();
}

#[test]
fn metric_references_are_found_in_promql() {
    let refs = metric_refs(
        r#"sum by (le) (rate(lastcall_x_bucket{a="lastcall_not_a_metric"}[5m])) / lastcall_y"#,
    );
    assert_eq!(
        refs,
        ["lastcall_x_bucket", "lastcall_y"]
            .map(String::from)
            .into_iter()
            .collect()
    );
    let names =
        exported_names("# TYPE lastcall_a counter\n# TYPE lastcall_h histogram\nlastcall_g 1\n");
    for n in [
        "lastcall_a_total",
        "lastcall_h_bucket",
        "lastcall_h_count",
        "lastcall_g",
    ] {
        assert!(names.contains(n), "{n}");
    }
    assert!(!names.contains("lastcall_a"));
}

// ---------------------------------------------------------------------------------------
// The runbook, run with the real kubectl
// ---------------------------------------------------------------------------------------

/// Alerts built on kube-state-metrics' figures, not on a lastcall binary's.
const KUBE_STATE_ALERTS: &[&str] = &["LastcallAgentMissing", "LastcallAgentPending"];

/// `kubectl` commands in docs/operations.md that are not run here, and why.
const NOT_RUN: &[(&str, &str)] = &[
    (
        "kubectl apply -f manifests/",
        "the emulator serves only the kinds lastcall itself touches (no apps/v1, rbac, ServiceAccounts), and kubectl apply needs the OpenAPI documents",
    ),
    (
        "kubectl -n lastcall rollout",
        "DaemonSets (apps/v1) are not served by the emulator",
    ),
    (
        "kubectl -n lastcall logs",
        "the emulator has no kubelet log endpoint",
    ),
    (
        "kubectl -n lastcall get pods",
        "the emulator's pods are game servers only; lastcall's own pods do not exist there",
    ),
    (
        "kubectl -n lastcall exec",
        "the emulator runs no containers: exec needs a kubelet and a container runtime",
    ),
    (
        "kubectl -n lastcall get serviceaccount",
        "ServiceAccounts are not served by the emulator",
    ),
    (
        "kubectl -n lastcall rollout restart",
        "Deployments and DaemonSets (apps/v1) are not served by the emulator",
    ),
    (
        "kubectl get events -A --field-selector reason=NodeRestrictionUnenforceable",
        "the emulator's agents run without a pod-bound token, so none posts this Event (the box's install test runs it)",
    ),
    (
        "kubectl -n lastcall get events --field-selector reason=FailedScheduling",
        "the emulator schedules no agent pods, so none is ever Pending (the box's install test runs it)",
    ),
    (
        "kubectl get validatingadmissionpolicies",
        "admission policies (admissionregistration.k8s.io) are not served by the emulator",
    ),
    (
        "kubectl get gameservers -A --field-selector status.nodeName=\"$NODE\" -o jsonpath='{range .items[?(@.status.state==\"Ready\")]}",
        "deletes an idle game server so that a Pending agent takes its room: the scheduler's queue and the DaemonSet's rollout are the box's (the emulator runs neither)",
    ),
    (
        "kubectl delete gameserver",
        "deleting a match by hand ends it; the test keeps the match running to check the rollback",
    ),
];

/// One fenced block of the runbook: the heading it sits under and its command lines.
#[derive(Debug)]
struct Block {
    heading: String,
    tested: bool,
    commands: Vec<String>,
}

/// Fenced `sh` blocks. A block whose info string is `sh runbook` is run by the test; every
/// other `kubectl` line must be listed in [`NOT_RUN`]. Comment lines are skipped and
/// backslash continuations joined.
fn runbook_blocks(md: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut heading = String::new();
    let mut lines = md.lines();
    while let Some(line) = lines.next() {
        if line.starts_with('#') && !line.starts_with("#!") {
            heading = line.trim_start_matches('#').trim().to_string();
            continue;
        }
        let Some(info) = line.strip_prefix("```") else {
            continue;
        };
        let info = info.trim();
        let mut commands = Vec::new();
        let mut pending = String::new();
        for l in lines.by_ref() {
            if l.starts_with("```") {
                break;
            }
            let t = l.trim();
            if t.starts_with('#') || t.is_empty() {
                continue;
            }
            if let Some(head) = t.strip_suffix('\\') {
                pending.push_str(head);
                continue;
            }
            pending.push_str(t);
            commands.push(std::mem::take(&mut pending));
        }
        if info.starts_with("sh") {
            out.push(Block {
                heading: heading.clone(),
                tested: info == "sh runbook",
                commands,
            });
        }
    }
    out
}

/// Runs one runbook command line with bash, the real kubectl and the emulator's kubeconfig.
fn run_command(cmd: &str, kubeconfig: &Path, home: &Path) -> (bool, String) {
    let out = std::process::Command::new("bash")
        .args(["-o", "pipefail", "-c", cmd])
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", home)
        .env("KUBECONFIG", kubeconfig)
        .env("NODE", "n1")
        .output()
        .unwrap_or_else(|e| panic!("running bash: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runbook_works_with_the_real_kubectl() {
    lastcall_testkit::tools::ensure("kubectl", "kubernetes-client")
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert!(
        std::process::Command::new("kubectl")
            .args(["version", "--client"])
            .output()
            .is_ok_and(|o| o.status.success()),
        "kubectl is needed (.ci/run installs it when missing)"
    );
    let md = read("docs/operations.md");
    let blocks = runbook_blocks(&md);
    // Every kubectl line is either run or explained.
    for b in blocks.iter().filter(|b| !b.tested) {
        for c in b.commands.iter().filter(|c| c.contains("kubectl")) {
            assert!(
                NOT_RUN.iter().any(|(prefix, _)| c.starts_with(prefix)),
                "docs/operations.md ({}) has a kubectl command that is neither in a `sh runbook` block nor in NOT_RUN: {c}",
                b.heading
            );
        }
    }
    let tested: Vec<&Block> = blocks.iter().filter(|b| b.tested).collect();
    let section = |name: &str| -> Vec<String> {
        let cmds: Vec<String> = tested
            .iter()
            .filter(|b| b.heading == name)
            .flat_map(|b| b.commands.clone())
            .collect();
        assert!(
            !cmds.is_empty(),
            "docs/operations.md has no `sh runbook` block under {name:?}"
        );
        cmds
    };

    // n1 runs a match and an idle server; the agent (label source only) guards it. Agones
    // is 1.58 or later: the runbook finds a node's servers by `status.nodeName`.
    let w = World::start(
        WorldSpec::new(1, 1, 0)
            .extra_nodes(&["n2"])
            .selectable_fields(),
    )
    .await;
    let agent = w
        .start_agent(&["--resync-interval".into(), "1s".into()])
        .await;
    w.agent_sees_all(&agent).await;
    let keep = w.allocated();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    w.cluster
        .emulator()
        .write_kubeconfig(&kubeconfig, "operator")
        .unwrap();
    let run_all = |name: &str| -> String {
        let mut transcript = String::new();
        for c in section(name) {
            let (ok, out) = run_command(&c, &kubeconfig, dir.path());
            assert!(ok, "runbook command failed ({name}): {c}\n{out}");
            transcript.push_str(&format!("$ {c}\n{out}"));
        }
        transcript
    };

    // 1. Drain a node by hand: the agent fences it and keeps the match.
    run_all("Drain a node by hand");
    w.fenced_and_released(&keep).await;

    // 2. Read its drain state: the commands show what the agent recorded.
    let state = run_all("Read a node's drain state");
    for needle in [
        "lastcall.dev/drain-started",
        "lastcall.dev/draining=",
        "Unschedulable:",
        "DrainStarted",
        &keep.name,
    ] {
        assert!(
            state.contains(needle),
            "the drain-state commands do not show {needle}:\n{state}"
        );
    }

    // 3. A drain that is stuck: the commands find the match holding the node.
    let stuck = run_all("A drain is stuck");
    assert!(
        stuck.contains(&keep.name),
        "the stuck-drain commands do not show {}:\n{stuck}",
        keep.name
    );

    // 3b. A node that stays empty but registered, and a source that is down: the commands
    //     show the drain's progress marks and the node's game servers.
    let empty = run_all("A node stays empty but registered");
    assert!(
        empty.contains("started=20") && empty.contains("deregistered=\n"),
        "the empty-node commands do not show drain-started and a missing deregistration:\n{empty}"
    );
    assert!(empty.contains(&keep.name), "{empty}");
    let down = run_all("A signal source is down");
    assert!(
        down.contains("cause=manual") && down.contains("started=20"),
        "the source-down commands do not show the drain's cause:\n{down}"
    );

    // 4. Roll back: the drain is cancelled and the node is as before.
    run_all("Roll back");
    wait_for(
        "node uncordoned and untainted after the rollback",
        || async {
            let n = w.node().await;
            (!cordoned(&n) && !has_taint(&n, "lastcall.dev/draining")).then_some(())
        },
    )
    .await;
    wait_for("the match is unmarked", || async {
        w.on("n1")
            .iter()
            .filter(|g| g.uid == keep.uid)
            .all(|g| !g.labels.contains_key("lastcall.dev/node-draining"))
            .then_some(())
    })
    .await;
    assert!(w.on("n1").iter().any(|g| g.uid == keep.uid && !g.deleting));

    // 5. lastcall removed mid-drain: the cleanup commands leave no mark behind.
    label_node(&w, "n1", "lastcall.dev/drain", Some("true")).await;
    w.fenced_and_released(&keep).await;
    agent.stop().await.unwrap();
    run_all("Clean up a node by hand after removing lastcall");
    let n = w.node().await;
    assert!(!cordoned(&n), "still cordoned");
    assert!(!has_taint(&n, "lastcall.dev/draining"), "still tainted");
    let ann = n.metadata.annotations.unwrap_or_default();
    for k in [
        "lastcall.dev/drain-started",
        "lastcall.dev/drain-cause",
        "lastcall.dev/cordoned-by-lastcall",
    ] {
        assert!(!ann.contains_key(k), "{k} left on the node");
    }
    assert!(
        !n.metadata
            .labels
            .unwrap_or_default()
            .contains_key("lastcall.dev/drain")
    );
    let g = w
        .on("n1")
        .into_iter()
        .find(|g| g.uid == keep.uid)
        .expect("the match survived");
    assert!(!g.labels.contains_key("lastcall.dev/node-draining"));
    assert!(!g.annotations.contains_key("lastcall.dev/drain-deadline"));
    assert!(!g.annotations.contains_key("lastcall.dev/drain-reason"));
}
