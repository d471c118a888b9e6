//! A real SQS- and EventBridge-compatible server for the queue-mode tests: moto's server
//! (PyPI `moto[server]`), started on a free loopback port per test. Not a model of ours:
//! its SQS (visibility, receipt handles, redelivery, `SentTimestamp`) and its EventBridge
//! (rules with event patterns delivering to SQS targets) are moto's.
//!
//! The program comes from the project's virtualenv, which `hack/tools.sh` fills when it is
//! missing (serialised across test processes by `flock`), so `cargo test` needs nothing
//! installed by hand. Calls here speak AWS's JSON protocols over plain HTTP (moto checks no
//! signatures), so this crate needs no AWS SDK beyond those lastcall already builds.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context, bail};
use serde_json::{Value, json};

/// The account moto answers as.
pub const ACCOUNT: &str = "123456789012";
pub const REGION: &str = "us-east-1";

static INSTALLED: Mutex<Option<Result<PathBuf, String>>> = Mutex::new(None);

/// `moto_server` from the project's virtualenv, installing it (`hack/tools.sh`) when missing.
pub fn moto_server() -> anyhow::Result<PathBuf> {
    let mut g = INSTALLED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(r) = g.as_ref() {
        return r.clone().map_err(anyhow::Error::msg);
    }
    let r = install().map_err(|e| format!("{e:#}"));
    *g = Some(r.clone());
    r.map_err(anyhow::Error::msg)
}

fn install() -> anyhow::Result<PathBuf> {
    let venv = std::env::var("LASTCALL_VENV").unwrap_or_else(|_| "/var/tmp/lastcall-venv".into());
    let bin = PathBuf::from(&venv).join("bin/moto_server");
    if bin.is_file() {
        return Ok(bin);
    }
    let tools = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../hack/tools.sh");
    eprintln!("lastcall test kit: installing moto's server into {venv} (hack/tools.sh)");
    let out = std::process::Command::new("flock")
        .arg("/var/tmp/lastcall-venv.lock")
        .arg(&tools)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {}", tools.display()))?;
    if !out.status.success() || !bin.is_file() {
        bail!(
            "hack/tools.sh did not install moto_server ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(bin)
}

/// One call of an AWS JSON-protocol operation (`AmazonSQS.CreateQueue`, `AWSEvents.PutRule`,
/// …) against a local stand-in at `url`, unsigned (the stand-ins check no signatures).
pub(crate) async fn aws_json_call(
    http: &reqwest::Client,
    url: &str,
    target: &str,
    body: Value,
) -> anyhow::Result<Value> {
    let (service, version) = match target.split_once('.') {
        Some(("AmazonSQS", _)) => ("sqs", "1.0"),
        Some(("AWSEvents", _)) => ("events", "1.1"),
        _ => bail!("unknown target {target}"),
    };
    let r = http
        .post(url)
        .header("X-Amz-Target", target)
        .header("Content-Type", format!("application/x-amz-json-{version}"))
        .header(
            "Authorization",
            format!("AWS4-HMAC-SHA256 Credential=test/20260101/{REGION}/{service}/aws4_request, SignedHeaders=host, Signature=0"),
        )
        .body(body.to_string())
        .send()
        .await
        .with_context(|| target.to_string())?;
    let status = r.status();
    let text = r.text().await?;
    if !status.is_success() {
        bail!("{target}: {status}: {text}");
    }
    Ok(if text.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).with_context(|| format!("{target}: {text}"))?
    })
}

/// `CreateQueue` on an SQS JSON-protocol endpoint: the new queue's URL.
pub(crate) async fn create_queue(
    http: &reqwest::Client,
    url: &str,
    name: &str,
) -> anyhow::Result<String> {
    let r = aws_json_call(
        http,
        url,
        "AmazonSQS.CreateQueue",
        json!({"QueueName": name}),
    )
    .await?;
    r["QueueUrl"]
        .as_str()
        .map(String::from)
        .context("CreateQueue gave no QueueUrl")
}

/// Sends up to 10 raw bodies to `queue_url` in one `SendMessageBatch` (SQS's limit per
/// call); fails if any entry failed.
pub(crate) async fn send_message_batch(
    http: &reqwest::Client,
    url: &str,
    queue_url: &str,
    bodies: &[String],
) -> anyhow::Result<()> {
    let entries: Vec<Value> = bodies
        .iter()
        .enumerate()
        .map(|(i, b)| json!({"Id": i.to_string(), "MessageBody": b}))
        .collect();
    let r = aws_json_call(
        http,
        url,
        "AmazonSQS.SendMessageBatch",
        json!({"QueueUrl": queue_url, "Entries": entries}),
    )
    .await?;
    let failed = r["Failed"].as_array().map_or(0, Vec::len);
    let sent = r["Successful"].as_array().map_or(0, Vec::len);
    if failed != 0 || sent != bodies.len() {
        bail!("SendMessageBatch: {r}");
    }
    Ok(())
}

/// One moto server; killed when dropped.
pub struct Moto {
    child: tokio::process::Child,
    port: u16,
    http: reqwest::Client,
}

impl Moto {
    /// Starts moto on a free loopback port and waits until it answers.
    pub async fn start() -> anyhow::Result<Self> {
        let bin = tokio::task::spawn_blocking(moto_server).await??;
        let port = crate::net::try_free_port()?;
        let child = tokio::process::Command::new(&bin)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .env("AWS_DEFAULT_REGION", REGION)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let me = Self {
            child,
            port,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()?,
        };
        let url = format!("{}/moto-api/", me.url());
        let http = me.http.clone();
        crate::eventually::wait_for("moto's server answers", || {
            let (http, url) = (http.clone(), url.clone());
            async move {
                http.get(&url)
                    .send()
                    .await
                    .ok()
                    .filter(|r| r.status().is_success())
                    .map(|_| ())
            }
        })
        .await;
        Ok(me)
    }

    /// `http://127.0.0.1:<port>`: the endpoint of every service it serves.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// One call of an AWS JSON-protocol operation (`AmazonSQS.CreateQueue`,
    /// `AWSEvents.PutRule`, …).
    pub async fn call(&self, target: &str, body: Value) -> anyhow::Result<Value> {
        aws_json_call(&self.http, &self.url(), target, body).await
    }

    /// Creates a queue and returns its URL.
    pub async fn create_queue(&self, name: &str) -> anyhow::Result<String> {
        create_queue(&self.http, &self.url(), name).await
    }

    pub fn queue_arn(name: &str) -> String {
        format!("arn:aws:sqs:{REGION}:{ACCOUNT}:{name}")
    }

    /// Sends a raw body to the queue (what something with `sqs:SendMessage` could send).
    pub async fn send(&self, queue_url: &str, body: &str) -> anyhow::Result<()> {
        self.call(
            "AmazonSQS.SendMessage",
            json!({"QueueUrl": queue_url, "MessageBody": body}),
        )
        .await
        .map(|_| ())
    }

    /// Sends up to 10 raw bodies in one `SendMessageBatch` (SQS's limit per call); fails if
    /// any entry failed.
    pub async fn send_batch(&self, queue_url: &str, bodies: &[String]) -> anyhow::Result<()> {
        send_message_batch(&self.http, &self.url(), queue_url, bodies).await
    }

    /// The queue's `ApproximateNumberOfMessages` and `…NotVisible`.
    pub async fn depth(&self, queue_url: &str) -> anyhow::Result<(u64, u64)> {
        let r = self
            .call(
                "AmazonSQS.GetQueueAttributes",
                json!({"QueueUrl": queue_url, "AttributeNames": ["All"]}),
            )
            .await?;
        let n = |k: &str| {
            r["Attributes"][k]
                .as_str()
                .and_then(|s| s.parse().ok())
                .unwrap_or(0)
        };
        Ok((
            n("ApproximateNumberOfMessages"),
            n("ApproximateNumberOfMessagesNotVisible"),
        ))
    }

    /// An EventBridge rule on the default bus with `pattern`, delivering to the queue.
    pub async fn rule_to_queue(
        &self,
        rule: &str,
        pattern: &Value,
        queue: &str,
    ) -> anyhow::Result<()> {
        self.call(
            "AWSEvents.PutRule",
            json!({"Name": rule, "EventPattern": pattern.to_string(), "State": "ENABLED"}),
        )
        .await?;
        let r = self
            .call(
                "AWSEvents.PutTargets",
                json!({"Rule": rule, "Targets": [{"Id": "lastcall", "Arn": Self::queue_arn(queue)}]}),
            )
            .await?;
        if r["FailedEntryCount"].as_u64().unwrap_or(0) != 0 {
            bail!("PutTargets: {r}");
        }
        Ok(())
    }

    /// Puts one event on the default bus (`source`, `detail-type`, `detail`, `resources`).
    pub async fn put_event(
        &self,
        source: &str,
        detail_type: &str,
        detail: &Value,
        resources: &[String],
    ) -> anyhow::Result<()> {
        let r = self
            .call(
                "AWSEvents.PutEvents",
                json!({"Entries": [{
                    "Source": source,
                    "DetailType": detail_type,
                    "Detail": detail.to_string(),
                    "Resources": resources,
                }]}),
            )
            .await?;
        if r["FailedEntryCount"].as_u64().unwrap_or(0) != 0 {
            bail!("PutEvents: {r}");
        }
        Ok(())
    }
}
