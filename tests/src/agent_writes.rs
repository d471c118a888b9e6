//! The agent's writes as the chart lists them (`charts/lastcall/agent-writes.yaml`, the one
//! table of them, which the chart's admission policies are rendered from), and what one write
//! changes, named in the table's words.
//!
//! Two checks read it: `tests/tests/packaging.rs` names every write of the agents in the
//! suite's drains (from the emulator's journal and store history) and fails on a name the
//! table does not list, or a table entry no drain made; `tests/tests/box_admission.rs` sends
//! one write per entry to a real API server under the policies (admitted on the agent's node,
//! refused on another) and the writes just outside the table (refused).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;

use lastcall_emulators::kube::store::StoreEvent;
use lastcall_emulators::kube::{JournalEntry, Verb};
use serde_json::Value;

/// The release options that widen the table (`when: <value>` names `agent.<value>`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Options {
    pub compat_taints: bool,
    pub gke_hand_back: bool,
}

impl Options {
    pub const ALL: Options = Options {
        compat_taints: true,
        gke_hand_back: true,
    };

    fn has(&self, when: Option<&str>) -> bool {
        match when {
            None => true,
            Some("compatTaints") => self.compat_taints,
            Some("gkeHandBack") => self.gke_hand_back,
            Some(other) => panic!("agent-writes.yaml: unknown `when: {other}`"),
        }
    }
}

/// One entry of a key list: the key, its one value (if the table fixes it) and its option.
#[derive(Clone, Debug)]
pub struct Key {
    pub key: String,
    pub value: Option<String>,
    pub when: Option<String>,
}

/// A taint or toleration entry, as the table writes it.
#[derive(Clone, Debug)]
pub struct Taint {
    pub key: String,
    pub value: Option<String>,
    pub operator: Option<String>,
    pub effect: String,
    pub when: Option<String>,
}

/// `charts/lastcall/agent-writes.yaml`, parsed.
#[derive(Clone, Debug)]
pub struct Table {
    pub node_spec: Vec<String>,
    pub node_taints: Vec<Taint>,
    pub node_labels: Vec<Key>,
    pub node_annotations: Vec<Key>,
    pub pod_annotations: Vec<Key>,
    pub pod_tolerations: Vec<Taint>,
    pub pod_delete: bool,
    pub gs_labels: Vec<Key>,
    pub gs_annotations: Vec<Key>,
    pub gs_delete_states: Vec<String>,
    pub event_namespace: String,
    pub event_controller: String,
    pub event_verbs: Vec<String>,
}

pub const TABLE: &str = "charts/lastcall/agent-writes.yaml";

fn strs(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .map(|s| s.as_str().unwrap_or_default().to_string())
                .collect()
        })
        .unwrap_or_default()
}

fn opt(v: &Value, k: &str) -> Option<String> {
    v.get(k).and_then(Value::as_str).map(str::to_string)
}

fn keys(v: &Value) -> Vec<Key> {
    v.as_array()
        .map(|a| {
            a.iter()
                .map(|e| Key {
                    key: opt(e, "key").expect("an entry without a key"),
                    value: opt(e, "value"),
                    when: opt(e, "when"),
                })
                .collect()
        })
        .unwrap_or_default()
}

fn taints(v: &Value) -> Vec<Taint> {
    v.as_array()
        .map(|a| {
            a.iter()
                .map(|e| Taint {
                    key: opt(e, "key").expect("a taint without a key"),
                    value: opt(e, "value"),
                    operator: opt(e, "operator"),
                    effect: opt(e, "effect").expect("a taint without an effect"),
                    when: opt(e, "when"),
                })
                .collect()
        })
        .unwrap_or_default()
}

impl Table {
    /// The table in the repository at `root`.
    pub fn load(root: &Path) -> anyhow::Result<Table> {
        let text = std::fs::read_to_string(root.join(TABLE))?;
        let v: Value = serde_saphyr::from_str(&text)?;
        Ok(Table::parse(&v))
    }

    pub fn parse(v: &Value) -> Table {
        Table {
            node_spec: strs(&v["node"]["spec"]),
            node_taints: taints(&v["node"]["taints"]),
            node_labels: keys(&v["node"]["labels"]),
            node_annotations: keys(&v["node"]["annotations"]),
            pod_annotations: keys(&v["pod"]["annotations"]),
            pod_tolerations: taints(&v["pod"]["tolerations"]),
            pod_delete: v["pod"]["delete"] == Value::Bool(true),
            gs_labels: keys(&v["gameServer"]["labels"]),
            gs_annotations: keys(&v["gameServer"]["annotations"]),
            gs_delete_states: strs(&v["gameServer"]["deleteInStates"]),
            event_namespace: opt(&v["event"], "namespace").unwrap_or_default(),
            event_controller: opt(&v["event"], "reportingController").unwrap_or_default(),
            event_verbs: strs(&v["event"]["verbs"]),
        }
    }

    /// Every kind of write the table lists for a release with `options`, by the names
    /// [`Named`] gives writes, in groups: a group is made when any one of its names is (a
    /// key's set and removal; a release's delete in any of the states listed).
    pub fn kinds(&self, o: Options) -> Vec<BTreeSet<String>> {
        let mut out: Vec<BTreeSet<String>> = Vec::new();
        let one = |s: String| BTreeSet::from([s]);
        for f in &self.node_spec {
            out.push(one(format!("Node spec.{f}")));
        }
        for t in self.node_taints.iter().filter(|t| o.has(t.when.as_deref())) {
            out.push(one(format!("Node taint {}:{}", t.key, t.effect)));
        }
        let key_group = |kind: &str, what: &str, k: &Key| -> BTreeSet<String> {
            match &k.value {
                Some(v) => BTreeSet::from([
                    format!("{kind} {what} {}={v}", k.key),
                    format!("{kind} {what} {} removed", k.key),
                ]),
                None => one(format!("{kind} {what} {}", k.key)),
            }
        };
        for (kind, what, list) in [
            ("Node", "label", &self.node_labels),
            ("Node", "annotation", &self.node_annotations),
            ("Pod", "annotation", &self.pod_annotations),
            ("GameServer", "label", &self.gs_labels),
            ("GameServer", "annotation", &self.gs_annotations),
        ] {
            for k in list.iter().filter(|k| o.has(k.when.as_deref())) {
                out.push(key_group(kind, what, k));
            }
        }
        for t in self
            .pod_tolerations
            .iter()
            .filter(|t| o.has(t.when.as_deref()))
        {
            out.push(one(toleration_name(
                &t.key,
                t.operator.as_deref(),
                t.value.as_deref(),
                &t.effect,
            )));
        }
        if self.pod_delete {
            out.push(one("Pod delete".into()));
        }
        out.push(
            self.gs_delete_states
                .iter()
                .map(|s| format!("GameServer delete in state {s:?}"))
                .collect(),
        );
        for v in &self.event_verbs {
            out.push(one(format!("Event {v}")));
        }
        out
    }

    /// Whether the table admits a write of that name in a release with `options`.
    pub fn admits(&self, o: Options, name: &str) -> bool {
        self.kinds(o).iter().any(|g| g.contains(name))
    }
}

fn toleration_name(key: &str, operator: Option<&str>, value: Option<&str>, effect: &str) -> String {
    format!(
        "Pod toleration {key} {} {}:{effect} appended",
        operator.unwrap_or("Equal"),
        value.unwrap_or("")
    )
}

fn map_at<'a>(obj: &'a Value, path: &[&str]) -> BTreeMap<&'a str, &'a Value> {
    let mut v = obj;
    for p in path {
        v = &v[*p];
    }
    v.as_object()
        .map(|m| m.iter().map(|(k, v)| (k.as_str(), v)).collect())
        .unwrap_or_default()
}

/// The keys of `path` (labels, annotations) that differ between `old` and `new`, named
/// `<kind> <what> <key>`, `… <key>=<value>` for a key the table fixes a value of, or
/// `… <key> removed`.
fn key_changes(
    kind: &str,
    what: &str,
    path: &[&str],
    old: &Value,
    new: &Value,
    valued: &BTreeSet<&str>,
    out: &mut BTreeSet<String>,
) {
    let (o, n) = (map_at(old, path), map_at(new, path));
    let all: BTreeSet<&str> = o.keys().chain(n.keys()).copied().collect();
    for k in all {
        if o.get(k) == n.get(k) {
            continue;
        }
        match n.get(k) {
            None if valued.contains(k) => out.insert(format!("{kind} {what} {k} removed")),
            Some(v) if valued.contains(k) => out.insert(format!(
                "{kind} {what} {k}={}",
                v.as_str().unwrap_or_default()
            )),
            _ => out.insert(format!("{kind} {what} {k}")),
        };
    }
}

/// Top-level fields of `path` other than `except` that differ, named `<kind> <path>.<field>`.
fn field_changes(
    kind: &str,
    path: &str,
    old: &Value,
    new: &Value,
    except: &[&str],
    out: &mut BTreeSet<String>,
) {
    let (o, n) = (map_at(old, &[path]), map_at(new, &[path]));
    let all: BTreeSet<&str> = o.keys().chain(n.keys()).copied().collect();
    for f in all.into_iter().filter(|f| !except.contains(f)) {
        if o.get(f) != n.get(f) {
            out.insert(format!("{kind} {path}.{f}"));
        }
    }
}

fn taint_list(obj: &Value, path: &[&str]) -> Vec<Value> {
    let mut v = obj;
    for p in path {
        v = &v[*p];
    }
    v.as_array().cloned().unwrap_or_default()
}

/// A taint as (key, value, effect), `timeAdded` aside (the API server may stamp it).
fn taint_id(t: &Value) -> (String, String, String) {
    let s = |k: &str| t[k].as_str().unwrap_or_default().to_string();
    (s("key"), s("value"), s("effect"))
}

/// A game-server pod by Agones' marks: `agones.dev/role=gameserver`, `agones.dev/gameserver`,
/// and a controller reference to a GameServer.
pub fn is_game_server_pod(pod: &Value) -> bool {
    let labels = &pod["metadata"]["labels"];
    labels["agones.dev/role"] == "gameserver"
        && labels.get("agones.dev/gameserver").is_some()
        && pod["metadata"]["ownerReferences"]
            .as_array()
            .is_some_and(|refs| {
                refs.iter().any(|r| {
                    r["kind"] == "GameServer"
                        && r["apiVersion"]
                            .as_str()
                            .is_some_and(|v| v.starts_with("agones.dev/"))
                        && r["controller"] == true
                })
            })
}

/// What one write of the agent of `node` did, in the table's words.
pub struct Named<'a> {
    pub table: &'a Table,
    /// The writing agent's node.
    pub node: &'a str,
}

impl Named<'_> {
    fn valued(list: &[Key]) -> BTreeSet<&str> {
        list.iter()
            .filter(|k| k.value.is_some())
            .map(|k| k.key.as_str())
            .collect()
    }

    /// An update of a Node from `old` to `new`.
    pub fn node_update(&self, old: &Value, new: &Value) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        if old["metadata"]["name"] != self.node {
            out.insert("Node update of another node".into());
        }
        let ours: BTreeSet<&str> = self
            .table
            .node_taints
            .iter()
            .map(|t| t.key.as_str())
            .collect();
        let (ot, nt) = (
            taint_list(old, &["spec", "taints"]),
            taint_list(new, &["spec", "taints"]),
        );
        let others = |l: &[Value]| -> Vec<(String, String, String)> {
            l.iter()
                .map(taint_id)
                .filter(|t| !ours.contains(t.0.as_str()))
                .collect()
        };
        if others(&ot) != others(&nt) {
            out.insert("Node taints of others changed".into());
        }
        let ids = |l: &[Value]| -> BTreeMap<(String, String, String), usize> {
            let mut m = BTreeMap::new();
            for t in l.iter().map(taint_id) {
                *m.entry(t).or_insert(0) += 1;
            }
            m
        };
        let (oi, ni) = (ids(&ot), ids(&nt));
        for t in oi.keys().chain(ni.keys()) {
            if oi.get(t) != ni.get(t) && ours.contains(t.0.as_str()) {
                out.insert(format!("Node taint {}:{}", t.0, t.2));
            }
        }
        field_changes("Node", "spec", old, new, &["taints"], &mut out);
        key_changes(
            "Node",
            "label",
            &["metadata", "labels"],
            old,
            new,
            &Self::valued(&self.table.node_labels),
            &mut out,
        );
        key_changes(
            "Node",
            "annotation",
            &["metadata", "annotations"],
            old,
            new,
            &Self::valued(&self.table.node_annotations),
            &mut out,
        );
        self.metadata_and_status("Node", old, new, &mut out);
        out
    }

    fn metadata_and_status(
        &self,
        kind: &str,
        old: &Value,
        new: &Value,
        out: &mut BTreeSet<String>,
    ) {
        for f in ["finalizers", "ownerReferences", "deletionTimestamp"] {
            if old["metadata"][f] != new["metadata"][f] {
                out.insert(format!("{kind} metadata.{f}"));
            }
        }
        if old["status"] != new["status"] {
            out.insert(format!("{kind} status"));
        }
    }

    /// An update of a Pod from `old` to `new`.
    pub fn pod_update(&self, old: &Value, new: &Value) -> BTreeSet<String> {
        let mut out = self.pod_where(old);
        let (ot, nt) = (
            taint_list(old, &["spec", "tolerations"]),
            taint_list(new, &["spec", "tolerations"]),
        );
        if ot != nt {
            match nt.split_last() {
                Some((added, rest)) if rest == ot.as_slice() => {
                    out.insert(toleration_name(
                        added["key"].as_str().unwrap_or_default(),
                        added["operator"].as_str(),
                        added["value"].as_str(),
                        added["effect"].as_str().unwrap_or_default(),
                    ));
                    if added.get("tolerationSeconds").is_some() {
                        out.insert("Pod toleration with tolerationSeconds".into());
                    }
                }
                _ => {
                    out.insert("Pod spec.tolerations".into());
                }
            }
        }
        field_changes("Pod", "spec", old, new, &["tolerations"], &mut out);
        key_changes(
            "Pod",
            "label",
            &["metadata", "labels"],
            old,
            new,
            &BTreeSet::new(),
            &mut out,
        );
        key_changes(
            "Pod",
            "annotation",
            &["metadata", "annotations"],
            old,
            new,
            &Self::valued(&self.table.pod_annotations),
            &mut out,
        );
        self.metadata_and_status("Pod", old, new, &mut out);
        out
    }

    /// Where a pod write lands: on another node, or on a pod that is no game server.
    fn pod_where(&self, pod: &Value) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        if pod["spec"]["nodeName"] != self.node {
            out.insert("Pod write on another node".into());
        }
        if !is_game_server_pod(pod) {
            out.insert("Pod write to a pod that is no game server".into());
        }
        out
    }

    /// A DELETE (`evict`: an Eviction, which the table never lists: RBAC grants the agent
    /// none) of `pod`, `uid_precondition` as sent.
    pub fn pod_end(&self, pod: &Value, evict: bool, uid_precondition: bool) -> BTreeSet<String> {
        let mut out = self.pod_where(pod);
        out.insert(if evict { "Pod eviction" } else { "Pod delete" }.into());
        if !uid_precondition {
            out.insert("Pod delete or eviction without a uid precondition".into());
        }
        out
    }

    /// An update of a GameServer from `old` to `new`.
    pub fn gs_update(&self, old: &Value, new: &Value) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        if old["status"]["nodeName"] != self.node || new["status"]["nodeName"] != self.node {
            out.insert("GameServer write on another node".into());
        }
        let mut labels = BTreeSet::new();
        key_changes(
            "GameServer",
            "label",
            &["metadata", "labels"],
            old,
            new,
            &Self::valued(&self.table.gs_labels),
            &mut labels,
        );
        // The claim's value is the node's own label value: named as the table names it.
        let own = lastcall_agent::keys::node_label_value(self.node);
        for l in labels {
            match self
                .table
                .gs_labels
                .iter()
                .find(|k| k.value.as_deref() == Some("nodeName"))
            {
                Some(k) if l == format!("GameServer label {}={own}", k.key) => {
                    out.insert(format!("GameServer label {}=nodeName", k.key));
                }
                _ => {
                    out.insert(l);
                }
            }
        }
        key_changes(
            "GameServer",
            "annotation",
            &["metadata", "annotations"],
            old,
            new,
            &Self::valued(&self.table.gs_annotations),
            &mut out,
        );
        if old["spec"] != new["spec"] {
            out.insert("GameServer spec".into());
        }
        self.metadata_and_status("GameServer", old, new, &mut out);
        out
    }

    /// A DELETE of the GameServer `gs` (as stored when deleted), preconditions as sent.
    pub fn gs_delete(&self, gs: &Value, preconditioned: bool) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        if gs["status"]["nodeName"] != self.node {
            out.insert("GameServer write on another node".into());
        }
        let state = gs["status"]["state"].as_str().unwrap_or_default();
        out.insert(format!("GameServer delete in state {state:?}"));
        if !preconditioned {
            out.insert("GameServer delete without uid and resourceVersion preconditions".into());
        }
        out
    }

    /// An Event written with `verb` (`create`, `patch`) through `group`.
    pub fn event(&self, group: &str, verb: &str, ev: &Value) -> BTreeSet<String> {
        let mut out = BTreeSet::from([format!("Event {verb}")]);
        if group != "events.k8s.io" {
            out.insert(format!("Event through the {group:?} API group"));
        }
        if ev["metadata"]["namespace"] != self.table.event_namespace.as_str() {
            out.insert("Event in another namespace".into());
        }
        let r = &ev["regarding"];
        let own = r["kind"] == "Node"
            && r["name"] == self.node
            && ev["reportingController"] == self.table.event_controller.as_str()
            && ev["reportingInstance"] == self.node;
        if !own {
            out.insert("Event about another object than its own Node".into());
        }
        out
    }
}

/// The API group of a request path: `/api/v1/...` is the core group `""`.
fn api_group(path: &str) -> String {
    if path.starts_with("/api/") {
        String::new()
    } else {
        path.strip_prefix("/apis/")
            .and_then(|rest| rest.split('/').next())
            .unwrap_or_default()
            .to_string()
    }
}

/// One write of an agent, named.
#[derive(Clone, Debug)]
pub struct NamedWrite {
    /// The agent's identity, the request and its status, for the failure message.
    pub request: String,
    pub names: BTreeSet<String>,
}

/// The versions of every object in an emulator's store history, by (resource, namespace,
/// name) and resourceVersion.
struct Versions<'a> {
    by_rv: BTreeMap<u64, &'a StoreEvent>,
    by_key: BTreeMap<(String, String, String), Vec<&'a Value>>,
}

impl<'a> Versions<'a> {
    fn new(history: &'a [Arc<StoreEvent>]) -> Self {
        let mut v = Versions {
            by_rv: BTreeMap::new(),
            by_key: BTreeMap::new(),
        };
        for ev in history {
            v.by_rv.insert(ev.rv, ev.as_ref());
            let key = (
                ev.rt.plural.to_string(),
                ev.namespace.clone().unwrap_or_default(),
                ev.name.clone(),
            );
            let list = v.by_key.entry(key).or_default();
            list.extend(ev.old.iter());
            list.push(&ev.object);
        }
        v
    }

    /// A version of the object with `uid` (and `rv`, when given).
    fn find(
        &self,
        resource: &str,
        ns: &str,
        name: &str,
        uid: &str,
        rv: Option<&str>,
    ) -> Option<&'a Value> {
        self.by_key
            .get(&(resource.to_string(), ns.to_string(), name.to_string()))?
            .iter()
            .rev()
            .find(|o| {
                o["metadata"]["uid"] == uid
                    && rv.is_none_or(|rv| o["metadata"]["resourceVersion"] == rv)
            })
            .copied()
    }
}

/// Every write the agents of the emulator's `journal` sent (identities `agent-<node>`),
/// named by [`Named`] against the store's `history`: an update by the change its answer's
/// resourceVersion made; a DELETE (or an Eviction, which the agent must not send: it is
/// named so the table check reports it) by the object its preconditions name. Updates the server
/// refused changed nothing and are left out. Fails when the history no longer holds a version
/// a write needs.
pub fn journal_writes(
    table: &Table,
    journal: &[JournalEntry],
    history: &[Arc<StoreEvent>],
) -> anyhow::Result<Vec<NamedWrite>> {
    let versions = Versions::new(history);
    let mut out = Vec::new();
    for e in journal {
        let Some(node) = e.identity.as_deref().and_then(|i| i.strip_prefix("agent-")) else {
            continue;
        };
        if !e.verb.is_mutating() {
            continue;
        }
        let named = Named { table, node };
        let ok = (200..300).contains(&e.status);
        let resource = e.resource.clone().unwrap_or_default();
        let sub = e.subresource.clone().unwrap_or_default();
        let group = api_group(&e.path);
        let ns = e.namespace.clone().unwrap_or_default();
        let name = e.name.clone().unwrap_or_default();
        let request = format!(
            "{} {} {} {} → {}",
            e.identity.as_deref().unwrap_or_default(),
            e.method,
            e.path,
            e.request
                .as_deref()
                .map(Value::to_string)
                .unwrap_or_default(),
            e.status
        );
        let body = e.request.as_deref().cloned().unwrap_or(Value::Null);
        let names = match (resource.as_str(), sub.as_str(), e.verb) {
            (_, "", Verb::Patch | Verb::Update) => {
                if !ok {
                    continue;
                }
                let rv = e
                    .response
                    .as_deref()
                    .and_then(|r| r["metadata"]["resourceVersion"].as_str())
                    .and_then(|rv| rv.parse::<u64>().ok())
                    .ok_or_else(|| {
                        anyhow::anyhow!("{request}: no resourceVersion in the answer")
                    })?;
                let ev = versions.by_rv.get(&rv).ok_or_else(|| {
                    anyhow::anyhow!("{request}: the store history no longer holds rv {rv}")
                })?;
                let old = ev.old.as_ref().unwrap_or(&Value::Null);
                match resource.as_str() {
                    "nodes" => named.node_update(old, &ev.object),
                    "pods" => named.pod_update(old, &ev.object),
                    "gameservers" => named.gs_update(old, &ev.object),
                    "events" => named.event(&group, "patch", &ev.object),
                    other => BTreeSet::from([format!("{} {group}/{other}", e.verb.as_str())]),
                }
            }
            ("events", "", Verb::Create) => {
                if !ok {
                    continue;
                }
                named.event(
                    &group,
                    "create",
                    e.response.as_deref().unwrap_or(&Value::Null),
                )
            }
            ("pods", "eviction" | "", Verb::Create | Verb::Delete) => {
                let evict = sub == "eviction";
                let opts = if evict { &body["deleteOptions"] } else { &body };
                let uid = opts["preconditions"]["uid"].as_str();
                let pod = versions
                    .find("pods", &ns, &name, uid.unwrap_or_default(), None)
                    .ok_or_else(|| {
                        anyhow::anyhow!("{request}: no version of the pod with that uid")
                    })?;
                named.pod_end(pod, evict, uid.is_some())
            }
            ("gameservers", "", Verb::Delete) => {
                let uid = body["preconditions"]["uid"].as_str();
                let rv = body["preconditions"]["resourceVersion"].as_str();
                let gs = versions
                    .find("gameservers", &ns, &name, uid.unwrap_or_default(), rv)
                    .ok_or_else(|| {
                        anyhow::anyhow!(
                            "{request}: no version of the GameServer its preconditions name"
                        )
                    })?;
                named.gs_delete(gs, uid.is_some() && rv.is_some())
            }
            (other, sub, verb) => BTreeSet::from([format!(
                "{} {group}/{other}{}",
                verb.as_str(),
                if sub.is_empty() {
                    String::new()
                } else {
                    format!("/{sub}")
                }
            )]),
        };
        out.push(NamedWrite { request, names });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn table() -> Table {
        Table::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("..")).expect("the table")
    }

    #[test]
    fn a_node_update_is_named_by_what_changed() {
        let t = table();
        let n = Named {
            table: &t,
            node: "a",
        };
        let old = json!({"metadata": {"name": "a", "labels": {"x": "1"}},
                         "spec": {"taints": [{"key": "other", "effect": "NoSchedule"}]}});
        let new = json!({"metadata": {"name": "a", "labels": {"x": "1", "cloud.google.com/perform-maintenance": "true"},
                                      "annotations": {"lastcall.dev/drain-started": "t"}},
                         "spec": {"unschedulable": true,
                                  "taints": [{"key": "other", "effect": "NoSchedule"},
                                             {"key": "lastcall.dev/draining", "value": "manual", "effect": "NoSchedule"}]}});
        assert_eq!(
            n.node_update(&old, &new),
            BTreeSet::from([
                "Node annotation lastcall.dev/drain-started".to_string(),
                "Node label cloud.google.com/perform-maintenance=true".into(),
                "Node spec.unschedulable".into(),
                "Node taint lastcall.dev/draining:NoSchedule".into(),
            ])
        );
        // A foreign taint removed, a foreign label, another node.
        let bad = json!({"metadata": {"name": "b", "labels": {"x": "2"}}, "spec": {}});
        let got = n.node_update(&json!({"metadata": {"name": "b", "labels": {"x": "1"}},
                                        "spec": {"taints": [{"key": "other", "effect": "NoSchedule"}]}}), &bad);
        for name in [
            "Node update of another node",
            "Node taints of others changed",
            "Node label x",
        ] {
            assert!(got.contains(name), "{name}: {got:?}");
        }
        assert!(
            !got.iter()
                .any(|g| t.admits(Options::ALL, g) && g.contains("other"))
        );
    }

    #[test]
    fn every_name_of_the_table_is_a_name_a_write_gets() {
        let t = table();
        let kinds = t.kinds(Options::ALL);
        assert!(kinds.len() > 20, "{kinds:?}");
        assert!(t.admits(
            Options::ALL,
            "Node taint gamelift.status/draining:NoExecute"
        ));
        assert!(!t.admits(
            Options::default(),
            "Node taint gamelift.status/draining:NoExecute"
        ));
        assert!(t.admits(Options::default(), "GameServer delete in state \"Ready\""));
        assert!(!t.admits(Options::ALL, "GameServer delete in state \"Allocated\""));
        assert!(t.admits(Options::ALL, "GameServer label lastcall.dev/node=nodeName"));
    }
}
