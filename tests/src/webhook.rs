//! The pubsub FleetAutoscaler webhook, served in-process on loopback for tests and
//! benchmarks, and `FleetAutoscaleReview` bodies in the shapes Agones sends.
//!
//! The server is the production one: `Pubsub::new` builds the webhook from parsed flags
//! and `lastcall_pubsub::webhook::serve` serves it (HTTP, or HTTPS with the given files).
//! GameLift is never called: no cycle runs.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use lastcall_pubsub::webhook::tls::ReloadingCert;
use lastcall_pubsub::{Config, Pubsub};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::redis::TlsFiles;

/// A Fleet's status as Agones reports it.
#[derive(Clone, Copy, Debug, Default)]
pub struct FleetStatus {
    pub replicas: i64,
    pub ready: i64,
    pub reserved: i64,
    pub allocated: i64,
}

/// A review body as Agones' controller marshals it: no `apiVersion`/`kind`,
/// `"response": null`, the full `FleetStatus` (players, counters and lists included), the
/// Fleet's labels and `annotations`.
pub fn agones_review(
    uid: &str,
    namespace: &str,
    name: &str,
    status: FleetStatus,
    annotations: &[(&str, &str)],
) -> String {
    let annotations: serde_json::Map<String, serde_json::Value> = annotations
        .iter()
        .map(|(k, v)| (k.to_string(), serde_json::Value::from(*v)))
        .collect();
    serde_json::json!({
        "request": {
            "uid": uid,
            "name": name,
            "namespace": namespace,
            "status": {
                "replicas": status.replicas,
                "readyReplicas": status.ready,
                "reservedReplicas": status.reserved,
                "allocatedReplicas": status.allocated,
                "players": {"count": 0, "capacity": 0},
                "counters": {"rooms": {"allocatedCount": 1, "allocatedCapacity": 4, "count": 2, "capacity": 8}},
                "lists": {"players": {"allocatedCount": 0, "allocatedCapacity": 0, "count": 0, "capacity": 10}}
            },
            "labels": {"app.kubernetes.io/name": name},
            "annotations": annotations,
        },
        "response": null,
    })
    .to_string()
}

/// The same review in the documented typed form: `apiVersion` and `kind` set, only the
/// four counts.
pub fn typed_review(uid: &str, namespace: &str, name: &str, status: FleetStatus) -> String {
    serde_json::json!({
        "apiVersion": "autoscaling.agones.dev/v1",
        "kind": "FleetAutoscaleReview",
        "request": {
            "uid": uid,
            "name": name,
            "namespace": namespace,
            "status": {
                "replicas": status.replicas,
                "readyReplicas": status.ready,
                "reservedReplicas": status.reserved,
                "allocatedReplicas": status.allocated,
            },
        },
    })
    .to_string()
}

/// A running webhook. Dropping it stops the server.
pub struct WebhookServer {
    pub pubsub: Arc<Pubsub>,
    addr: std::net::SocketAddr,
    tls: bool,
    shutdown: CancellationToken,
    /// The bare Kubernetes API the webhook watches Fleets in ([`WebhookServer::with_fleets`]).
    kube: Option<crate::kube::Emulator>,
}

impl Drop for WebhookServer {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl WebhookServer {
    /// Starts the webhook against `redis_url` with `extra` pubsub flags
    /// (`--webhook-max-replicas` is required), serving HTTPS when `tls` is given.
    pub async fn start(
        redis_url: &str,
        extra: &[&str],
        tls: Option<&TlsFiles>,
    ) -> anyhow::Result<WebhookServer> {
        let mut argv: Vec<String> = [
            "lastcall-pubsub",
            "--redis-url",
            redis_url,
            "--config-file",
            "/nonexistent/fleetiq.conf",
            "--aws-region",
            "us-west-2",
            "--gamelift-endpoint",
            "http://127.0.0.1:9",
            "--listen",
            "127.0.0.1:0",
            "--webhook-listen",
            "127.0.0.1:0",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if let Some(tls) = tls {
            argv.push("--webhook-tls-cert".into());
            argv.push(path_str(&tls.cert_pem)?);
            argv.push("--webhook-tls-key".into());
            argv.push(path_str(&tls.key_pem)?);
        }
        argv.extend(extra.iter().map(|s| s.to_string()));
        let config = Config::try_parse_from(argv)?;
        config.validate()?;
        // As in a cluster whose Redis has been up a while: the drain state is dated an hour
        // back, so answers do not hold for a restart that did not happen. A test of a
        // restart restarts Redis (or deletes the hash) after this.
        let redis = lastcall_common::redis_conn::any_client(
            config.redis_url.as_ref().context("--redis-url")?,
            None,
        )?;
        let mut conn =
            lastcall_common::redis_conn::connect_any(&redis, std::time::Duration::from_secs(5))
                .await?;
        let an_hour_ago =
            lastcall_common::drain_state::unix_ms(std::time::SystemTime::now()) - 3_600_000;
        let key = config
            .webhook_settings()?
            .context("the webhook is configured")?
            .drain_state_key;
        lastcall_common::drain_state::mark_epoch_in(&mut conn, &key, an_hour_ago).await?;
        let credentials = aws_sdk_gamelift::config::Credentials::new(
            "AKIDWEBHOOKTEST",
            "webhook-test-secret",
            None,
            None,
            "webhook-tests",
        );
        let gamelift = lastcall_pubsub::gamelift_client(&config, Some(credentials)).await;
        let pubsub = Arc::new(Pubsub::new(&config, gamelift)?);
        let webhook = pubsub
            .webhook()
            .context("the webhook is configured")?
            .clone();
        let cert = match (
            &config.webhook.webhook_tls_cert,
            &config.webhook.webhook_tls_key,
        ) {
            (Some(c), Some(k)) => Some(Arc::new(ReloadingCert::load(c, k)?)),
            _ => None,
        };
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shutdown = CancellationToken::new();
        tokio::spawn(lastcall_pubsub::webhook::serve(
            listener,
            webhook,
            cert,
            shutdown.clone(),
        ));
        Ok(WebhookServer {
            pubsub,
            addr,
            tls: tls.is_some(),
            shutdown,
            kube: None,
        })
    }

    /// `http://127.0.0.1:P/scale` (or `https://`).
    pub fn url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}/scale", self.addr)
    }

    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// Lets the webhook read Nodes and Fleets through `client` (the kube emulator), as the
    /// binary does with its in-cluster credentials.
    pub fn attach_kube(&self, client: kube::Client) {
        if let Some(w) = self.pubsub.webhook() {
            w.attach_kube(client);
        }
    }

    /// Gives the webhook a Kubernetes API (a bare emulator: no cluster model) holding these
    /// Fleets `(namespace, name, spec.replicas)`, as the binary has with its in-cluster
    /// credentials, and waits until its Fleet watch has listed them: held answers keep each
    /// one's `spec.replicas`.
    pub async fn with_fleets(mut self, fleets: &[(&str, &str, u32)]) -> anyhow::Result<Self> {
        let emulator = crate::kube::Emulator::start().await?;
        self.attach_kube(emulator.client_as("pubsub").await?);
        self.kube = Some(emulator);
        for (namespace, name, replicas) in fleets {
            self.set_fleet(namespace, name, *replicas).await?;
        }
        Ok(self)
    }

    /// Creates Fleet `namespace/name` with `spec.replicas` (or sets it) in the API of
    /// [`WebhookServer::with_fleets`], and waits until the webhook's cache has it.
    pub async fn set_fleet(
        &self,
        namespace: &str,
        name: &str,
        replicas: u32,
    ) -> anyhow::Result<()> {
        use ::kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
        let emulator = self.kube.as_ref().context("with_fleets first")?;
        let api: Api<DynamicObject> = Api::namespaced_with(
            emulator.client().await?,
            namespace,
            &lastcall_pubsub::webhook::fleets::fleet_resource(),
        );
        if api.get_opt(name).await?.is_some() {
            let patch = serde_json::json!({"spec": {"replicas": replicas}});
            api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
        } else {
            let fleet: DynamicObject = serde_json::from_value(serde_json::json!({
                "apiVersion": "agones.dev/v1",
                "kind": "Fleet",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {"replicas": replicas, "template": {"spec": {"ports": []}}},
            }))?;
            api.create(&PostParams::default(), &fleet).await?;
        }
        let webhook = self.pubsub.webhook().context("the webhook is configured")?;
        crate::eventually::wait_for("the webhook's Fleet cache has the Fleet", || async {
            (webhook.fleet_size(namespace, name)
                == lastcall_pubsub::webhook::fleets::FleetSize::Known(replicas))
            .then_some(())
        })
        .await;
        Ok(())
    }

    /// Creates these Nodes in the API of [`WebhookServer::with_fleets`]: drain-state
    /// entries of Nodes the API server does not have count for nothing and hold nothing.
    pub async fn add_nodes(&self, names: &[&str]) -> anyhow::Result<()> {
        use ::kube::api::{Api, PostParams};
        use k8s_openapi::api::core::v1::Node;
        let emulator = self.kube.as_ref().context("with_fleets first")?;
        let api: Api<Node> = Api::all(emulator.client().await?);
        for name in names {
            let node: Node = serde_json::from_value(serde_json::json!({
                "apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
            }))?;
            api.create(&PostParams::default(), &node).await?;
        }
        Ok(())
    }

    /// Waits until the webhook's Fleet cache knows Fleet `namespace/name` (after
    /// [`WebhookServer::attach_kube`]).
    pub async fn wait_fleet_listed(&self, namespace: &str, name: &str) {
        let Some(webhook) = self.pubsub.webhook() else {
            return;
        };
        crate::eventually::wait_for("the webhook's Fleet cache lists the Fleet", || async {
            matches!(
                webhook.fleet_size(namespace, name),
                lastcall_pubsub::webhook::fleets::FleetSize::Known(_)
            )
            .then_some(())
        })
        .await;
    }

    /// The bare Kubernetes API of [`WebhookServer::with_fleets`].
    pub fn kube(&self) -> Option<&crate::kube::Emulator> {
        self.kube.as_ref()
    }

    /// The process's metrics, as `/metrics` serves them.
    pub fn metrics_text(&self) -> String {
        self.pubsub.metrics_text()
    }
}

fn path_str(p: &Path) -> anyhow::Result<String> {
    p.to_str()
        .map(str::to_string)
        .context("temp paths are UTF-8")
}
