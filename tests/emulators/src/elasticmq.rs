//! A second real SQS-compatible server, for load: ElasticMQ (Maven Central
//! `org.elasticmq:elasticmq-server_2.13`), started on a free loopback port. moto's SQS slows
//! as its queue grows (a receive took 1.7 s with a thousand messages waiting); ElasticMQ's
//! does not, so a burst of thousands measures the consumer, not the server. It serves SQS
//! only (no EventBridge): events go in as the bodies an EventBridge rule delivers.
//!
//! The jars are fetched once by `mvn dependency:copy-dependencies` into
//! `$LASTCALL_ELASTICMQ_DIR` (default `/var/tmp/lastcall-elasticmq`), serialised across
//! processes by `flock`; the server runs on the system `java`.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context, bail};
use serde_json::{Value, json};

use crate::moto::{aws_json_call, create_queue, send_message_batch};

/// The pinned ElasticMQ release.
pub const VERSION: &str = "1.6.11";

static INSTALLED: Mutex<Option<Result<PathBuf, String>>> = Mutex::new(None);

/// The directory of ElasticMQ's jars, fetching them when missing.
pub fn elasticmq_jars() -> anyhow::Result<PathBuf> {
    let mut g = INSTALLED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(r) = g.as_ref() {
        return r.clone().map_err(anyhow::Error::msg);
    }
    let r = install().map_err(|e| format!("{e:#}"));
    *g = Some(r.clone());
    r.map_err(anyhow::Error::msg)
}

fn install() -> anyhow::Result<PathBuf> {
    let dir = PathBuf::from(
        std::env::var("LASTCALL_ELASTICMQ_DIR")
            .unwrap_or_else(|_| "/var/tmp/lastcall-elasticmq".into()),
    );
    let lib = dir.join(VERSION);
    let marker = lib.join(format!("elasticmq-server_2.13-{VERSION}.jar"));
    if marker.is_file() {
        return Ok(lib);
    }
    std::fs::create_dir_all(&dir)?;
    let pom = dir.join("pom.xml");
    std::fs::write(
        &pom,
        format!(
            r#"<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>dev.lastcall</groupId><artifactId>elasticmq-jars</artifactId><version>0</version>
  <dependencies>
    <dependency><groupId>org.elasticmq</groupId><artifactId>elasticmq-server_2.13</artifactId><version>{VERSION}</version></dependency>
  </dependencies>
</project>
"#
        ),
    )?;
    eprintln!(
        "lastcall test kit: fetching ElasticMQ {VERSION} into {}",
        lib.display()
    );
    let out = std::process::Command::new("flock")
        .arg(dir.join(".lock"))
        .args(["mvn", "-q", "-B", "-f"])
        .arg(&pom)
        .arg("dependency:copy-dependencies")
        .arg(format!("-DoutputDirectory={}", lib.display()))
        .stdin(Stdio::null())
        .output()
        .context("running mvn")?;
    if !out.status.success() || !marker.is_file() {
        bail!(
            "mvn did not fetch ElasticMQ ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stdout).trim()
        );
    }
    Ok(lib)
}

/// One ElasticMQ server; killed when dropped.
pub struct ElasticMq {
    child: tokio::process::Child,
    port: u16,
    http: reqwest::Client,
    _config: tempfile::TempDir,
}

impl ElasticMq {
    /// Starts ElasticMQ on a free loopback port and waits until it answers.
    pub async fn start() -> anyhow::Result<Self> {
        let lib = tokio::task::spawn_blocking(elasticmq_jars).await??;
        let port = crate::net::try_free_port()?;
        let config = tempfile::tempdir()?;
        let conf = config.path().join("elasticmq.conf");
        std::fs::write(
            &conf,
            format!(
                r#"include classpath("application.conf")
node-address {{ protocol = http, host = "127.0.0.1", port = {port}, context-path = "" }}
rest-sqs {{ enabled = true, bind-port = {port}, bind-hostname = "127.0.0.1", sqs-limits = strict }}
rest-stats {{ enabled = false }}
"#
            ),
        )?;
        let child = tokio::process::Command::new("java")
            .arg(format!("-Dconfig.file={}", conf.display()))
            .arg("-cp")
            .arg(lib.join("*"))
            .arg("org.elasticmq.server.Main")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("starting ElasticMQ (java)")?;
        let me = Self {
            child,
            port,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()?,
            _config: config,
        };
        crate::eventually::wait_for("ElasticMQ answers", || async {
            aws_json_call(&me.http, &me.url(), "AmazonSQS.ListQueues", json!({}))
                .await
                .ok()
                .map(|_| ())
        })
        .await;
        Ok(me)
    }

    /// `http://127.0.0.1:<port>`: its SQS endpoint.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// One SQS JSON-protocol call (`AmazonSQS.CreateQueue`, …).
    pub async fn call(&self, target: &str, body: Value) -> anyhow::Result<Value> {
        aws_json_call(&self.http, &self.url(), target, body).await
    }

    /// Creates a queue and returns its URL.
    pub async fn create_queue(&self, name: &str) -> anyhow::Result<String> {
        create_queue(&self.http, &self.url(), name).await
    }

    /// Sends up to 10 raw bodies in one `SendMessageBatch`.
    pub async fn send_batch(&self, queue_url: &str, bodies: &[String]) -> anyhow::Result<()> {
        send_message_batch(&self.http, &self.url(), queue_url, bodies).await
    }
}
