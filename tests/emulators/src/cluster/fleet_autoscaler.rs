//! Agones' FleetAutoscaler controller with a Webhook policy, for one Fleet.
//!
//! Every sync period (Agones: `spec.sync.fixedInterval.seconds`, 30 s by default) it reads
//! the Fleet, POSTs a `FleetAutoscaleReview` in the shape Agones' controller marshals (no
//! `apiVersion`/`kind`, `"response": null`, the Fleet's status, labels and annotations) to
//! the webhook URL, and, when the answer says `scale: true`, sets the Fleet's
//! `spec.replicas` to the answer's `replicas`. An error (no answer, a non-200, a body it
//! cannot read, a negative count) leaves the Fleet as it is, as Agones does. Each sync is
//! recorded, so a test can read what was asked and answered in order.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::Cluster;
use crate::kube::resources::FLEETS;

/// What one sync did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sync {
    /// The webhook answered; `from` is the Fleet's `spec.replicas` before, `to` after.
    Scaled { from: i64, to: i64 },
    /// The webhook answered `scale: false`.
    Unchanged { replicas: i64 },
    /// No usable answer: the Fleet was left as it is.
    Failed(String),
}

/// The FleetAutoscaler of Fleet `namespace/name`, pointed at `url`.
#[derive(Clone)]
pub struct FleetAutoscaler {
    namespace: String,
    fleet: String,
    url: String,
    http: reqwest::Client,
    journal: Arc<Mutex<Vec<Sync>>>,
}

impl FleetAutoscaler {
    pub fn new(namespace: &str, fleet: &str, url: &str) -> Self {
        Self {
            namespace: namespace.to_string(),
            fleet: fleet.to_string(),
            url: url.to_string(),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()
                .unwrap_or_default(),
            journal: Arc::default(),
        }
    }

    /// Every sync so far, in order.
    pub fn journal(&self) -> Vec<Sync> {
        self.journal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// One sync now.
    pub async fn sync(&self, cluster: &Cluster) -> Sync {
        let outcome = self.sync_inner(cluster).await;
        self.journal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(outcome.clone());
        outcome
    }

    /// Syncs every `period` until `stop` (the first sync one period from now).
    pub async fn run(self, cluster: &Cluster, period: Duration, stop: CancellationToken) {
        let mut tick = tokio::time::interval(period);
        tick.tick().await;
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            self.sync(cluster).await;
        }
    }

    async fn sync_inner(&self, cluster: &Cluster) -> Sync {
        let Some(fleet) = cluster
            .store()
            .get(&FLEETS, Some(&self.namespace), &self.fleet)
        else {
            return Sync::Failed("the Fleet is gone".into());
        };
        let spec_replicas = fleet
            .pointer("/spec/replicas")
            .and_then(Value::as_i64)
            .unwrap_or(0);
        let n = |f: &str| {
            fleet
                .pointer(&format!("/status/{f}"))
                .and_then(Value::as_i64)
                .unwrap_or(0)
        };
        let uid = format!("review-{}", rand::random::<u64>());
        let review = json!({
            "request": {
                "uid": uid,
                "name": self.fleet,
                "namespace": self.namespace,
                "status": {
                    "replicas": n("replicas"),
                    "readyReplicas": n("readyReplicas"),
                    "reservedReplicas": n("reservedReplicas"),
                    "allocatedReplicas": n("allocatedReplicas"),
                },
                "labels": fleet.pointer("/metadata/labels").cloned().unwrap_or(json!({})),
                "annotations": fleet.pointer("/metadata/annotations").cloned().unwrap_or(json!({})),
            },
            "response": null,
        });
        let answer = match self.http.post(&self.url).json(&review).send().await {
            Ok(r) if r.status().is_success() => r.json::<Value>().await,
            Ok(r) => return Sync::Failed(format!("status {}", r.status())),
            Err(e) => return Sync::Failed(e.to_string()),
        };
        let answer = match answer {
            Ok(a) => a,
            Err(e) => return Sync::Failed(format!("body: {e}")),
        };
        let response = answer.get("response").cloned().unwrap_or(Value::Null);
        if response.get("uid").and_then(Value::as_str) != Some(uid.as_str()) {
            return Sync::Failed("the answer does not echo the uid".into());
        }
        let scale = response
            .get("scale")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let replicas = response.get("replicas").and_then(Value::as_i64);
        match (scale, replicas) {
            (false, _) => Sync::Unchanged {
                replicas: spec_replicas,
            },
            (true, Some(to)) if to >= 0 => {
                match cluster.scale_fleet(&self.namespace, &self.fleet, to) {
                    Ok(()) => Sync::Scaled {
                        from: spec_replicas,
                        to,
                    },
                    Err(e) => Sync::Failed(e.to_string()),
                }
            }
            (true, other) => Sync::Failed(format!("bad replicas {other:?}")),
        }
    }
}
