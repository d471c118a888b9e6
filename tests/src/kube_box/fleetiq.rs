//! FleetIQ for a box test: the GameLift emulator holding the node's instance, an IMDS
//! emulator the agent learns its instance id from, a private redis-server, and the real
//! `lastcall-pubsub` process polling GameLift and publishing to Redis, started with the
//! arguments of the chart's pubsub Deployment (`manifests/lastcall-fleetiq.yaml`; only the
//! config file, listen address and period changed: 10 s, GameLift's advised minimum, and
//! no jitter, so a status change is published within one period).

use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use serde_json::Value;
use tokio::process::{Child, Command};

use super::agent::Extra;
use crate::gamelift::{GameLiftEmulator, InstanceStatus, instance_id};
use crate::imds::ImdsEmulator;
use crate::redis::RedisServer;

pub const GROUP: &str = "box-game-server-group";

pub struct FleetIq {
    pub gl: GameLiftEmulator,
    pub imds: ImdsEmulator,
    pub redis: RedisServer,
    pub instance_id: String,
    pubsub: Child,
    log: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for FleetIq {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "---- lastcall-pubsub ----\n{}",
                super::procs::tail(&self.log, 40)
            );
        }
    }
}

/// The chart's pubsub container arguments.
fn chart_pubsub_args() -> anyhow::Result<Vec<String>> {
    let path = crate::paths::package_dir().join("../manifests/lastcall-fleetiq.yaml");
    let text = std::fs::read_to_string(&path)?;
    let docs: Vec<Value> = serde_saphyr::from_multiple(&text)?;
    let args = docs
        .iter()
        .find(|d| d["kind"] == "Deployment" && d["metadata"]["name"] == "lastcall-pubsub")
        .and_then(|d| d.pointer("/spec/template/spec/containers/0/args"))
        .and_then(Value::as_array)
        .context("no pubsub Deployment args in manifests/lastcall-fleetiq.yaml")?;
    args.iter()
        .map(|a| a.as_str().map(str::to_string).context("a non-string arg"))
        .collect()
}

impl FleetIq {
    /// Everything for `node`'s instance, ACTIVE in [`GROUP`], with pubsub publishing.
    pub async fn start(node: &str) -> anyhow::Result<FleetIq> {
        let iid = instance_id(node);
        let gl = GameLiftEmulator::start().await?;
        gl.add_instances(GROUP, std::slice::from_ref(&iid), InstanceStatus::Active);
        let imds = ImdsEmulator::start(&iid, node).await?;
        let redis = RedisServer::start().await?;
        let dir = tempfile::Builder::new()
            .prefix("lastcall-box-pubsub-")
            .tempdir()?;
        let conf = dir.path().join("fleetiq.conf");
        std::fs::write(&conf, format!("{{\"GameServerGroups\":[\"{GROUP}\"]}}"))?;
        let mut args = chart_pubsub_args()?;
        for a in &mut args {
            let flag = a.split('=').next().unwrap_or_default().to_string();
            match flag.as_str() {
                "--config-file" => *a = format!("--config-file={}", conf.display()),
                "--listen" => *a = "--listen=127.0.0.1:0".into(),
                "--period" => *a = "--period=10s".into(),
                "--cycle-jitter" => *a = "--cycle-jitter=0s".into(),
                _ => {}
            }
        }
        let log = dir.path().join("pubsub.log");
        let out = std::fs::File::create(&log)?;
        let bin = tokio::task::spawn_blocking(|| {
            crate::bins::try_workspace_binary("lastcall-pubsub", "lastcall-pubsub")
        })
        .await??;
        let pubsub = Command::new(bin)
            .env_clear()
            .env("HOME", dir.path())
            .env("REDIS_URL", redis.url())
            .env("AWS_REGION", "us-west-2")
            .env("AWS_ENDPOINT_URL_GAMELIFT", gl.url())
            .env("AWS_ACCESS_KEY_ID", "AKIDLASTCALLBOX")
            .env("AWS_SECRET_ACCESS_KEY", "lastcall-box-secret")
            .env("AWS_EC2_METADATA_DISABLED", "true")
            .args(&args)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .kill_on_drop(true)
            .spawn()
            .context("starting lastcall-pubsub")?;
        Ok(FleetIq {
            gl,
            imds,
            redis,
            instance_id: iid,
            pubsub,
            log,
            _dir: dir,
        })
    }

    /// What the chart adds to the agent with `fleetiq.enabled` (the group; Redis, region and
    /// GameLift endpoint as environment), pointed at the emulators.
    pub fn agent_extra(&self) -> Extra {
        Extra {
            args: vec![
                format!("--game-server-group={GROUP}"),
                format!("--imds-endpoint={}", self.imds.url()),
            ],
            env: vec![
                ("REDIS_URL".into(), self.redis.url()),
                ("AWS_REGION".into(), "us-west-2".into()),
                ("AWS_ENDPOINT_URL_GAMELIFT".into(), self.gl.url()),
                ("AWS_ACCESS_KEY_ID".into(), "AKIDLASTCALLBOX".into()),
                ("AWS_SECRET_ACCESS_KEY".into(), "lastcall-box-secret".into()),
                ("AWS_EC2_METADATA_DISABLED".into(), "true".into()),
            ],
        }
    }

    /// GameLift now reports the instance as `status` (pubsub publishes it next period).
    pub fn set(&self, status: InstanceStatus) {
        self.gl.set_instance_status(&self.instance_id, status);
    }

    /// Whether pubsub is still running.
    pub fn pubsub_running(&mut self) -> bool {
        matches!(self.pubsub.try_wait(), Ok(None))
    }

    /// The longest a status change takes to be published.
    pub const PUBLISH_WITHIN: Duration = Duration::from_secs(25);
}
