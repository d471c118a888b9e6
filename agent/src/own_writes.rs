//! Read-your-writes: the objects lastcall's own patches returned stand in for the watch's
//! copies until the watch catches up, so a lagging watch never causes a repeated write. And
//! the servers lastcall deleted: their delete is never sent again, and no earlier write of
//! ours brings them back.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DynamicObject, ObjectMeta};
use tokio::time::Instant;

/// How long a written GameServer stands in for the watch's copy.
pub const WRITTEN_TTL: Duration = Duration::from_secs(5);

fn rv_of(meta: &ObjectMeta) -> u64 {
    meta.resource_version
        .as_deref()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn key(o: &DynamicObject) -> (String, String) {
    (
        o.metadata.namespace.clone().unwrap_or_default(),
        o.metadata.name.clone().unwrap_or_default(),
    )
}

#[derive(Default)]
pub struct OwnWrites {
    /// The Node as our last successful patch returned it (newer than the watch, briefly).
    node: Option<Node>,
    /// GameServers as our own patches returned them (or, in dry-run mode, as read directly),
    /// until the watch catches up or `WRITTEN_TTL` passes.
    gameservers: HashMap<(String, String), (DynamicObject, Instant)>,
    /// GameServers deleted (or found gone): uid → (namespace, name).
    released: HashMap<String, (String, String)>,
    /// GameServers the watch showed at the last look: uid → (namespace, name).
    watched: HashMap<String, (String, String)>,
    /// Pods as our own annotation patches returned them, until the watch catches up.
    pods: HashMap<(String, String), (Pod, Instant)>,
}

impl OwnWrites {
    /// The newer of the watched Node and our own last write of it.
    pub fn node(&mut self, watched: Option<Node>) -> Option<Node> {
        match (watched, self.node.take()) {
            (Some(w), Some(ours)) if rv_of(&ours.metadata) > rv_of(&w.metadata) => {
                self.node = Some(ours.clone());
                Some(ours)
            }
            (Some(w), _) => Some(w),
            (None, ours) => ours,
        }
    }

    pub fn wrote_node(&mut self, n: Node) {
        self.node = Some(n);
    }

    /// After a conflict: our copy is no better than the watch's.
    pub fn forget_node(&mut self) {
        self.node = None;
    }

    /// The watched GameServers, overlaid with our own newer writes.
    pub fn gameservers(&mut self, watched: Vec<DynamicObject>, now: Instant) -> Vec<DynamicObject> {
        let mut objs: BTreeMap<(String, String), DynamicObject> =
            watched.into_iter().map(|o| (key(&o), o)).collect();
        let released = &self.released;
        self.gameservers.retain(|k, (written, at)| {
            // A server we deleted never comes back from our own earlier write.
            let deleted = written
                .metadata
                .uid
                .as_ref()
                .is_some_and(|u| released.contains_key(u));
            let fresh = now.saturating_duration_since(*at) < WRITTEN_TTL && !deleted;
            let newer = objs
                .get(k)
                .is_none_or(|w| rv_of(&written.metadata) > rv_of(&w.metadata));
            if fresh && newer {
                objs.insert(k.clone(), written.clone());
            }
            fresh && newer
        });
        objs.into_values().collect()
    }

    pub fn wrote_gameserver(&mut self, obj: DynamicObject, now: Instant) {
        self.gameservers.insert(key(&obj), (obj, now));
    }

    /// The watched pods, overlaid with our own newer writes (same rules as GameServers).
    pub fn pods(&mut self, watched: Vec<Pod>, now: Instant) -> Vec<Pod> {
        let pkey = |p: &Pod| {
            (
                p.metadata.namespace.clone().unwrap_or_default(),
                p.metadata.name.clone().unwrap_or_default(),
            )
        };
        let mut objs: BTreeMap<(String, String), Pod> =
            watched.into_iter().map(|p| (pkey(&p), p)).collect();
        self.pods.retain(|k, (written, at)| {
            let fresh = now.saturating_duration_since(*at) < WRITTEN_TTL;
            // Only over a watched copy: a pod that left the watch is gone.
            let newer = objs
                .get(k)
                .is_some_and(|w| rv_of(&written.metadata) > rv_of(&w.metadata));
            if fresh && newer {
                objs.insert(k.clone(), written.clone());
            }
            fresh && newer
        });
        objs.into_values().collect()
    }

    pub fn wrote_pod(&mut self, pod: Pod, now: Instant) {
        let k = (
            pod.metadata.namespace.clone().unwrap_or_default(),
            pod.metadata.name.clone().unwrap_or_default(),
        );
        self.pods.insert(k, (pod, now));
    }

    /// Notes the GameServers the watch shows now. One that vanished since the last look was
    /// deleted (its match ended, or anyone deleted it): its pod, still shutting down, must
    /// not be claimed again (each claim would be a write answered 404).
    pub fn watched_now(&mut self, now: HashMap<String, (String, String)>) {
        for (uid, key) in self.watched.drain() {
            if !now.contains_key(&uid) {
                self.released.entry(uid).or_insert(key);
            }
        }
        self.watched = now;
    }

    pub fn released(&mut self, uid: &str, namespace: &str, name: &str) {
        self.released
            .insert(uid.to_string(), (namespace.to_string(), name.to_string()));
    }

    pub fn is_released(&self, uid: &str) -> bool {
        self.released.contains_key(uid)
    }

    /// Whether a GameServer of this name was deleted by us (its pod is on its way out).
    pub fn released_name(&self, namespace: &str, name: &str) -> bool {
        self.released
            .values()
            .any(|(ns, n)| ns == namespace && n == name)
    }

    /// Forgets deleted servers that neither the plan, the watch nor a pod shows any more, so the
    /// set stays O(servers on this node).
    pub fn forget_released(
        &mut self,
        live: &HashSet<&str>,
        watched: &HashSet<String>,
        pods: &HashSet<(String, String)>,
    ) {
        // Kept while its pod is still there: that pod must not be claimed again.
        self.released.retain(|uid, key| {
            live.contains(uid.as_str()) || watched.contains(uid) || pods.contains(key)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gs(name: &str, uid: &str, rv: u64) -> DynamicObject {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "agones.dev/v1", "kind": "GameServer",
            "metadata": {"name": name, "namespace": "default", "uid": uid, "resourceVersion": rv.to_string()}
        }))
        .unwrap()
    }

    fn rvs(v: &[DynamicObject]) -> Vec<u64> {
        v.iter().map(|o| rv_of(&o.metadata)).collect()
    }

    #[test]
    fn a_server_that_left_the_watch_is_gone_until_its_pod_is() {
        let mut w = OwnWrites::default();
        let one = |uid: &str, name: &str| {
            HashMap::from([(uid.to_string(), ("default".to_string(), name.to_string()))])
        };
        w.watched_now(one("u1", "a"));
        assert!(!w.released_name("default", "a"), "still watched");
        w.watched_now(HashMap::new());
        assert!(w.released_name("default", "a"), "vanished from the watch");
        assert!(w.is_released("u1"));
        let pod = HashSet::from([("default".to_string(), "a".to_string())]);
        w.forget_released(&HashSet::new(), &HashSet::new(), &pod);
        assert!(w.is_released("u1"), "its pod is still there");
        w.forget_released(&HashSet::new(), &HashSet::new(), &HashSet::new());
        assert!(!w.is_released("u1"));
        // A server never watched (a late pod's) is not gone: it may still be claimed.
        w.watched_now(HashMap::new());
        assert!(!w.released_name("default", "b"));
    }

    #[test]
    fn own_writes_stand_in_until_the_watch_catches_up_or_they_expire() {
        let t0 = Instant::now();
        let mut w = OwnWrites::default();
        w.wrote_gameserver(gs("a", "u1", 5), t0);
        assert_eq!(
            rvs(&w.gameservers(vec![gs("a", "u1", 4)], t0)),
            [5],
            "ours is newer"
        );
        assert_eq!(
            rvs(&w.gameservers(vec![gs("a", "u1", 6)], t0)),
            [6],
            "the watch caught up"
        );
        w.wrote_gameserver(gs("b", "u2", 7), t0);
        assert_eq!(
            rvs(&w.gameservers(vec![], t0)),
            [7],
            "claimed, not watched yet"
        );
        assert!(
            w.gameservers(vec![], t0 + WRITTEN_TTL).is_empty(),
            "expired"
        );
    }

    #[test]
    fn a_deleted_server_never_comes_back_from_our_own_write() {
        let t0 = Instant::now();
        let mut w = OwnWrites::default();
        w.wrote_gameserver(gs("a", "u1", 5), t0);
        w.released("u1", "default", "a");
        assert!(w.released_name("default", "a"));
        assert!(w.gameservers(vec![], t0).is_empty());
        assert_eq!(
            rvs(&w.gameservers(vec![gs("a", "u1", 4)], t0)),
            [4],
            "the watch's copy shows it until the delete arrives"
        );
        assert!(w.is_released("u1"));
        let pod: HashSet<(String, String)> = [("default".to_string(), "a".to_string())].into();
        w.forget_released(&HashSet::new(), &HashSet::new(), &pod);
        assert!(w.is_released("u1"), "its pod is still there");
        w.forget_released(&HashSet::new(), &HashSet::new(), &HashSet::new());
        assert!(!w.is_released("u1"));
    }
}
