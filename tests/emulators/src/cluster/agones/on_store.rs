//! The controller on the emulator's store: the cluster model's loop runs one pass per
//! round ([`run`]). The store answers at once, so a pass completes on its first poll.
//!
//! The store also plays the garbage collector's part here, which the box leaves to the real
//! one: a pod whose GameServer is gone is deleted.

use std::collections::HashSet;

use futures::FutureExt;
use serde_json::Value;

use super::{AgonesApi, ApiFailure, Snapshot, agones_pdb};
use crate::cluster::objects::{GameServerView, PodInfo, keys};
use crate::cluster::writes::{list_parsed, report};
use crate::kube::resources::{GAMESERVERS, NODES, PDBS, PODS};
use crate::kube::status::ApiError;
use crate::kube::store::{DeleteOptions, Store};

/// The store as [`AgonesApi`]: every namespace in scope.
pub struct StoreApi<'a>(pub &'a Store);

fn failure(e: ApiError) -> ApiFailure {
    ApiFailure {
        code: e.code,
        message: e.to_string(),
    }
}

impl AgonesApi for StoreApi<'_> {
    async fn read(&self) -> Result<Snapshot, ApiFailure> {
        Ok(Snapshot {
            game_servers: self.0.list(&GAMESERVERS, None).0,
            pods: self.0.list(&PODS, None).0,
            nodes: self.0.list(&NODES, None).0,
        })
    }

    async fn create_pod(&self, ns: &str, pod: Value) -> Result<(), ApiFailure> {
        self.0
            .create(&PODS, Some(ns), pod)
            .map(drop)
            .map_err(failure)
    }

    async fn update_game_server(&self, gs: Value) -> Result<(), ApiFailure> {
        let view = GameServerView::parse(&gs).map_err(|e| ApiFailure {
            code: 422,
            message: e.to_string(),
        })?;
        self.0
            .replace(&GAMESERVERS, Some(&view.namespace), &view.name, gs)
            .map(drop)
            .map_err(failure)
    }

    async fn delete_game_server(&self, ns: &str, name: &str) -> Result<(), ApiFailure> {
        self.0
            .delete(&GAMESERVERS, Some(ns), name, &DeleteOptions::default())
            .map(drop)
            .map_err(failure)
    }

    async fn delete_pod(&self, ns: &str, name: &str) -> Result<(), ApiFailure> {
        self.0
            .delete(&PODS, Some(ns), name, &DeleteOptions::default())
            .map(drop)
            .map_err(failure)
    }
}

/// One pass of the GameServer controller over the store, then the garbage collector's.
pub(crate) fn run(store: &Store) {
    match super::sync(&StoreApi(store)).now_or_never() {
        Some(Ok(_)) => {}
        Some(Err(e)) => tracing::warn!(error = %e, "Agones controller could not read the store"),
        None => tracing::error!("the store answered later than at once: a model bug"),
    }
    collect_orphans(store);
}

/// Pods whose controlling GameServer no longer exists are deleted, as Kubernetes' garbage
/// collector deletes dependents whose owner is gone.
fn collect_orphans(store: &Store) {
    let live: HashSet<String> = list_parsed(store, &GAMESERVERS, GameServerView::parse)
        .into_iter()
        .map(|(gs, _)| gs.uid)
        .collect();
    for (pod, _) in list_parsed(store, &PODS, PodInfo::parse) {
        if let Some(owner) = &pod.owner_gameserver_uid
            && !live.contains(owner)
            && !pod.deleting
        {
            let opts = DeleteOptions {
                precondition_uid: Some(pod.uid.clone()),
                ..Default::default()
            };
            report(
                "delete orphaned gameserver pod",
                &pod.namespace,
                &pod.name,
                store.delete(&PODS, Some(&pod.namespace), &pod.name, &opts),
            );
        }
    }
}

/// Creates the Agones PDB in each namespace (the chart installs one per
/// `gameservers.namespaces` entry); an existing one is left alone.
pub(crate) fn ensure_pdbs(store: &Store, namespaces: &[String]) -> Result<(), ApiError> {
    for ns in namespaces {
        if store.get(&PDBS, Some(ns), keys::AGONES_PDB).is_some() {
            continue;
        }
        match store.create(&PDBS, Some(ns), agones_pdb(ns)) {
            Ok(_) => {}
            Err(e) if e.reason == "AlreadyExists" => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
