//! Indexed fan-out of store events to watches, as a real API server's watch cache does it.
//!
//! One task reads the store's change feed and hands each event only to the watches that can
//! want it: the watches of its type without an indexable selector, and those whose
//! equality requirement (`metadata.name=`, `spec.nodeName=`, a `label=value`) holds for the
//! object before or after the change. Without it every event wakes every watch, so a
//! thousand agents each watching its own Node would make each kubelet heartbeat cost a
//! thousand wake-ups in the emulator: a cost of the emulator, not of the agents, that a
//! real server (which indexes pods by node and objects by name) does not have.
//!
//! A watch whose queue fills up is ended, as before when it fell behind the live feed;
//! its client resumes from the last resourceVersion it saw.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::{broadcast, mpsc};
use tokio_util::sync::CancellationToken;

use super::resources::ResourceType;
use super::selectors::{IndexKey, Selectors};
use super::store::{Store, StoreEvent};

/// Events one watch may have queued before it is ended.
const QUEUE: usize = 4096;

type Tx = mpsc::Sender<Arc<StoreEvent>>;

#[derive(Default)]
struct TypeSubs {
    all: HashMap<u64, Tx>,
    keyed: HashMap<IndexKey, HashMap<u64, Tx>>,
}

#[derive(Default)]
struct Subs {
    next: u64,
    types: HashMap<ResourceType, TypeSubs>,
}

/// The watches of one server, by type and index key. Cheap to clone.
#[derive(Clone, Default)]
pub struct Fanout {
    subs: Arc<Mutex<Subs>>,
}

/// One watch's feed; unregisters itself when dropped.
pub struct Subscription {
    pub rx: mpsc::Receiver<Arc<StoreEvent>>,
    fanout: Fanout,
    rt: ResourceType,
    key: Option<IndexKey>,
    id: u64,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut g = self.fanout.lock();
        if let Some(t) = g.types.get_mut(&self.rt) {
            match &self.key {
                None => {
                    t.all.remove(&self.id);
                }
                Some(k) => {
                    if let Some(m) = t.keyed.get_mut(k) {
                        m.remove(&self.id);
                        if m.is_empty() {
                            t.keyed.remove(k);
                        }
                    }
                }
            }
        }
    }
}

impl Fanout {
    fn lock(&self) -> MutexGuard<'_, Subs> {
        self.subs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts the task that reads `store`'s feed until `stop`.
    pub fn start(store: &Store, stop: CancellationToken) -> Fanout {
        let fanout = Fanout::default();
        let mut rx = store.subscribe();
        let f = fanout.clone();
        tokio::spawn(async move {
            loop {
                let r = tokio::select! {
                    () = stop.cancelled() => return,
                    r = rx.recv() => r,
                };
                match r {
                    Ok(ev) => f.dispatch(&ev),
                    // The feed outran this task: every watch may have missed an event, so
                    // every watch ends and its client resumes from its last resourceVersion.
                    Err(broadcast::error::RecvError::Lagged(_)) => f.end_all(),
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        });
        fanout
    }

    /// Registers a watch of `rt` with `selectors`. Register before reading the snapshot or
    /// history the watch starts from; events up to that point arrive too and are skipped
    /// by resourceVersion.
    pub fn subscribe(&self, rt: &ResourceType, selectors: &Selectors) -> Subscription {
        let (tx, rx) = mpsc::channel(QUEUE);
        let key = selectors.index_key();
        let mut g = self.lock();
        let id = g.next;
        g.next += 1;
        let t = g.types.entry(*rt).or_default();
        match &key {
            None => {
                t.all.insert(id, tx);
            }
            Some(k) => {
                t.keyed.entry(k.clone()).or_default().insert(id, tx);
            }
        }
        drop(g);
        Subscription {
            rx,
            fanout: self.clone(),
            rt: *rt,
            key,
            id,
        }
    }

    fn dispatch(&self, ev: &Arc<StoreEvent>) {
        let mut g = self.lock();
        let Some(t) = g.types.get_mut(&ev.rt) else {
            return;
        };
        t.all.retain(|_, tx| tx.try_send(ev.clone()).is_ok());
        if t.keyed.is_empty() {
            return;
        }
        // The index keys this event can match: each indexed key name, valued from the
        // object after and before the change.
        let names: Vec<IndexKey> = {
            let mut seen: Vec<IndexKey> = vec![];
            for k in t.keyed.keys() {
                let blank = k.with_value(String::new());
                if !seen.contains(&blank) {
                    seen.push(blank);
                }
            }
            seen
        };
        let mut targets: Vec<IndexKey> = vec![];
        for name in names {
            for obj in std::iter::once(&ev.object).chain(ev.old.as_ref()) {
                if let Some(v) = name.value_in(obj) {
                    let k = name.with_value(v);
                    if !targets.contains(&k) {
                        targets.push(k);
                    }
                }
            }
        }
        for k in targets {
            if let Some(m) = t.keyed.get_mut(&k) {
                m.retain(|_, tx| tx.try_send(ev.clone()).is_ok());
                if m.is_empty() {
                    t.keyed.remove(&k);
                }
            }
        }
    }

    fn end_all(&self) {
        self.lock().types.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kube::resources::{CONFIGMAPS, PODS};
    use serde_json::json;

    fn selectors(rt: &ResourceType, labels: Option<&str>, fields: Option<&str>) -> Selectors {
        Selectors::parse(rt, labels, fields).unwrap()
    }

    fn names(sub: &mut Subscription) -> Vec<String> {
        let mut out = vec![];
        while let Ok(ev) = sub.rx.try_recv() {
            out.push(ev.name.clone());
        }
        out
    }

    #[tokio::test]
    async fn events_reach_only_the_watches_that_can_want_them() {
        let store = Store::new(100);
        let stop = CancellationToken::new();
        let fanout = Fanout::start(&store, stop.clone());
        let mut on_a = fanout.subscribe(&PODS, &selectors(&PODS, None, Some("spec.nodeName=a")));
        let mut labelled = fanout.subscribe(&PODS, &selectors(&PODS, Some("app=x"), None));
        let mut every_pod = fanout.subscribe(&PODS, &selectors(&PODS, None, None));
        let mut configmaps = fanout.subscribe(&CONFIGMAPS, &selectors(&CONFIGMAPS, None, None));
        let pod = |name: &str, node: &str, app: &str| json!({"metadata": {"name": name, "labels": {"app": app}}, "spec": {"nodeName": node}});
        store
            .create(&PODS, Some("default"), pod("p1", "a", "y"))
            .unwrap();
        store
            .create(&PODS, Some("default"), pod("p2", "b", "x"))
            .unwrap();
        // Moving off the index key still reaches the watch that held it (its DELETED).
        store
            .modify(&PODS, Some("default"), "p2", |o| {
                o["metadata"]["labels"]["app"] = json!("z");
                Ok(())
            })
            .unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert_eq!(names(&mut on_a), ["p1"]);
        assert_eq!(names(&mut labelled), ["p2", "p2"]);
        assert_eq!(names(&mut every_pod), ["p1", "p2", "p2"]);
        assert!(names(&mut configmaps).is_empty());
        // A dropped watch is unregistered.
        drop(on_a);
        let field_keys = fanout.lock().types[&PODS]
            .keyed
            .keys()
            .filter(|k| matches!(k, IndexKey::Field { .. }))
            .count();
        assert_eq!(field_keys, 0);
        stop.cancel();
    }
}
