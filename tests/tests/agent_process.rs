//! The real `lastcall-agent` binary as a process: flags and exit codes, the admin endpoints,
//! stop signals, `--deregister-on-exit`, and a crash in the middle of a drain (issue
//! scenario 3). Each process gets a clean environment (only HOME, KUBECONFIG, AWS
//! credentials, region and the GameLift endpoint), so nothing leaks in from the shell.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::CommandFactory;
use k8s_openapi::api::core::v1::Node;
use lastcall_common::fleetiq::InstanceStatus as Status;
use lastcall_testkit::agent::{metric, metric_sum, scrape};
use lastcall_testkit::bins::workspace_binary;
use lastcall_testkit::cluster::GameServerState as S;
use lastcall_testkit::eventually::wait_for;
use lastcall_testkit::kube::{FaultRule, Method};
use lastcall_testkit::process::{exited_within, signal};
use lastcall_testkit::world::{GROUP, IID, NS, WorldSpec};
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};

/// How long a stop signal may take to end the process (the agent's promise).
const EXIT_WITHIN: Duration = Duration::from_secs(5);

// ---------------------------------------------------------------------------------------
// The world: cluster model, GameLift emulator, real Redis
// ---------------------------------------------------------------------------------------

/// The shared scenario world plus a directory for the processes' HOME and kubeconfig.
struct World {
    base: lastcall_testkit::world::World,
    dir: tempfile::TempDir,
}

impl std::ops::Deref for World {
    type Target = lastcall_testkit::world::World;
    fn deref(&self) -> &Self::Target {
        &self.base
    }
}

/// n1 holds a Fleet of `ready + allocated` servers; `extra_nodes` join afterwards so that
/// replacements have somewhere to go.
async fn world(ready: usize, allocated: usize, extra_nodes: &[&str]) -> World {
    let base = lastcall_testkit::world::World::start(
        WorldSpec::new(ready, allocated, 0).extra_nodes(extra_nodes),
    )
    .await;
    let dir = tempfile::Builder::new()
        .prefix("lastcall-agent-proc-")
        .tempdir()
        .unwrap();
    base.cluster
        .emulator()
        .write_kubeconfig(&dir.path().join("kubeconfig"), "agent-n1")
        .unwrap();
    World { base, dir }
}

impl World {
    /// The agent binary with a clean environment pointing at this world.
    async fn command(&self) -> Command {
        let mut cmd = Command::new(agent_binary().await);
        cmd.env_clear()
            .env("HOME", self.dir.path())
            .env("KUBECONFIG", self.dir.path().join("kubeconfig"))
            .env("AWS_ACCESS_KEY_ID", "AKIDLASTCALLPROC")
            .env("AWS_SECRET_ACCESS_KEY", "lastcall-proc-secret")
            .env("AWS_EC2_METADATA_DISABLED", "true")
            .env("AWS_REGION", "us-west-2")
            .env("AWS_ENDPOINT_URL_GAMELIFT", self.gl.url())
            .args(["--node-name", "n1", "--listen", "127.0.0.1:0"])
            .stdin(Stdio::null())
            .kill_on_drop(true);
        cmd
    }

    /// FleetIQ on for i-n1 with fast heartbeats and resyncs, plus `extra` flags.
    async fn fleetiq_agent(&self, extra: &[&str]) -> AgentProcess {
        let mut cmd = self.command().await;
        cmd.args(["--game-server-group", GROUP, "--instance-id", IID])
            .args(["--redis-url", &self.redis.url()])
            .args(["--heartbeat-interval", "1s", "--resync-interval", "1s"])
            .args(extra);
        AgentProcess::spawn(cmd).await
    }

    /// Node requests that changed something, made by the agents so far.
    fn agent_node_writes(&self) -> usize {
        self.cluster.emulator().journal().count(|e| {
            e.identity.as_deref() == Some("agent-n1")
                && e.verb.is_mutating()
                && e.resource.as_deref() == Some("nodes")
        })
    }
}

fn annotations(n: &Node) -> BTreeMap<String, String> {
    n.metadata.annotations.clone().unwrap_or_default()
}

fn fenced(n: &Node) -> bool {
    let cordoned = n.spec.as_ref().and_then(|s| s.unschedulable) == Some(true);
    let tainted = n
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == "lastcall.dev/draining"));
    cordoned && tainted
}

// ---------------------------------------------------------------------------------------
// The process
// ---------------------------------------------------------------------------------------

async fn agent_binary() -> PathBuf {
    tokio::task::spawn_blocking(|| workspace_binary("lastcall-agent", "lastcall-agent"))
        .await
        .unwrap()
}

/// A running agent process. Its stdout (JSON logs) and stderr are collected; they are
/// printed if the test panics while the process is alive. Dropping it kills the process.
struct AgentProcess {
    child: Child,
    admin: SocketAddr,
    output: Arc<Mutex<Vec<String>>>,
    http: reqwest::Client,
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "---- lastcall-agent (pid {:?}) output ----\n{}",
                self.child.id(),
                self.output()
            );
        }
    }
}

/// Collects lines; on stdout, reports the admin address from the start-up log line.
async fn collect(
    stream: impl AsyncRead + Unpin,
    output: Arc<Mutex<Vec<String>>>,
    mut bound: Option<tokio::sync::oneshot::Sender<SocketAddr>>,
) {
    let mut lines = BufReader::new(stream).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if bound.is_some()
            && let Ok(v) = serde_json::from_str::<serde_json::Value>(&line)
            && v["message"] == "lastcall-agent starting"
            && let Some(addr) = v["listen"].as_str().and_then(|a| a.parse().ok())
            && let Some(tx) = bound.take()
        {
            let _ = tx.send(addr);
        }
        output.lock().unwrap().push(line);
    }
}

impl AgentProcess {
    /// Spawns `cmd` and waits for the admin listener's address in its log.
    async fn spawn(mut cmd: Command) -> AgentProcess {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let output = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(collect(
            child.stdout.take().unwrap(),
            output.clone(),
            Some(tx),
        ));
        tokio::spawn(collect(child.stderr.take().unwrap(), output.clone(), None));
        let admin = match tokio::time::timeout(Duration::from_secs(20), rx).await {
            Ok(Ok(a)) => a,
            _ => panic!(
                "lastcall-agent did not report its admin address; output:\n{}",
                output.lock().unwrap().join("\n")
            ),
        };
        AgentProcess {
            child,
            admin,
            output,
            http: reqwest::Client::new(),
        }
    }

    fn output(&self) -> String {
        self.output.lock().unwrap().join("\n")
    }

    async fn get(&self, path: &str) -> (u16, String) {
        let r = self
            .http
            .get(format!("http://{}{path}", self.admin))
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.text().await.unwrap())
    }

    async fn metrics(&self) -> String {
        scrape(self.admin).await
    }

    async fn metric(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        metric(&self.metrics().await, name, labels)
    }

    async fn wait_ready(&self) {
        wait_for("the agent reports ready", || async {
            (self.get("/readyz").await.0 == 200).then_some(())
        })
        .await;
    }

    /// Sends a signal with `kill(1)`, as a kubelet or an operator would.
    async fn signal(&self, sig: &str) {
        let pid = self.child.id().expect("the process is running");
        signal(pid, sig).await.unwrap();
    }

    /// The exit status, which must come within [`EXIT_WITHIN`].
    async fn exit_status(&mut self, after: &str) -> ExitStatus {
        exited_within(&mut self.child, EXIT_WITHIN)
            .await
            .unwrap()
            .unwrap_or_else(|| {
                panic!("lastcall-agent did not exit within {EXIT_WITHIN:?} after {after}")
            })
    }

    /// SIGKILL: a crash, with no chance to clean up.
    async fn crash(mut self) -> ExitStatus {
        self.child.kill().await.unwrap();
        self.child.wait().await.unwrap()
    }
}

// ---------------------------------------------------------------------------------------
// Prometheus / OpenMetrics text, parsed strictly
// ---------------------------------------------------------------------------------------

#[derive(Debug, PartialEq)]
struct Sample {
    name: String,
    labels: Labels,
    value: f64,
}

fn is_name(s: &str, colon: bool) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || (colon && c == ':'))
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || (colon && c == ':'))
}

type Labels = Vec<(String, String)>;

/// Parses `{k="v",...}` at the start of `s`; returns the labels and the rest.
fn parse_labels(s: &str) -> Result<(Labels, &str), String> {
    let mut rest = s.strip_prefix('{').ok_or("expected {")?;
    let mut labels = vec![];
    loop {
        if let Some(r) = rest.strip_prefix('}') {
            return Ok((labels, r));
        }
        if !labels.is_empty() {
            rest = rest.strip_prefix(',').ok_or("expected , between labels")?;
        }
        let eq = rest.find('=').ok_or("label without =")?;
        let key = &rest[..eq];
        if !is_name(key, false) {
            return Err(format!("bad label name {key:?}"));
        }
        rest = rest[eq + 1..]
            .strip_prefix('"')
            .ok_or("label value must be quoted")?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next() {
                None => return Err("unterminated label value".into()),
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c @ ('\\' | '"'))) => value.push(c),
                    other => return Err(format!("bad escape {other:?}")),
                },
                Some((_, c)) => value.push(c),
            }
        };
        labels.push((key.to_string(), value));
        rest = &rest[end + 1..];
    }
}

/// Every line must be a known comment (`# HELP|TYPE|UNIT name ...`, `# EOF` last) or
/// `name{labels} value` with a float value, and every sample must belong to a family
/// declared by `# TYPE` with a suffix its type allows.
fn parse_exposition(text: &str) -> Result<Vec<Sample>, String> {
    let mut families: BTreeMap<String, String> = BTreeMap::new();
    let mut samples = vec![];
    let lines: Vec<&str> = text
        .strip_suffix('\n')
        .unwrap_or(text)
        .split('\n')
        .collect();
    for (i, line) in lines.iter().enumerate() {
        let err = |m: String| format!("line {}: {m}: {line:?}", i + 1);
        if *line == "# EOF" {
            if i + 1 != lines.len() {
                return Err(err("# EOF before the end".into()));
            }
            continue;
        }
        if let Some(c) = line.strip_prefix("# ") {
            let mut parts = c.splitn(3, ' ');
            let (kind, name) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            if !is_name(name, true) {
                return Err(err(format!("bad family name {name:?}")));
            }
            match kind {
                "HELP" | "UNIT" => {}
                "TYPE" => {
                    let t = parts.next().unwrap_or("");
                    let known = [
                        "counter",
                        "gauge",
                        "histogram",
                        "gaugehistogram",
                        "summary",
                        "info",
                        "stateset",
                        "unknown",
                    ];
                    if !known.contains(&t) {
                        return Err(err(format!("unknown type {t:?}")));
                    }
                    families.insert(name.to_string(), t.to_string());
                }
                _ => return Err(err(format!("unknown comment {kind:?}"))),
            }
            continue;
        }
        let name_end = line
            .find(['{', ' '])
            .ok_or_else(|| err("no value".into()))?;
        let name = &line[..name_end];
        if !is_name(name, true) {
            return Err(err(format!("bad metric name {name:?}")));
        }
        let (labels, rest) = if line[name_end..].starts_with('{') {
            parse_labels(&line[name_end..]).map_err(err)?
        } else {
            (vec![], &line[name_end..])
        };
        let value = rest
            .strip_prefix(' ')
            .ok_or_else(|| err("expected one space before the value".into()))?;
        let value: f64 = value
            .parse()
            .map_err(|e| err(format!("value {value:?} is not a float: {e}")))?;
        let declared = families.iter().any(|(fam, t)| {
            let suffixes: &[&str] = match t.as_str() {
                "counter" => &["_total", "_created"],
                "histogram" | "gaugehistogram" => &["_bucket", "_sum", "_count", "_created"],
                "summary" => &["", "_sum", "_count", "_created"],
                "info" => &["_info"],
                _ => &[""],
            };
            suffixes.iter().any(|s| name == format!("{fam}{s}"))
        });
        if !declared {
            return Err(err(format!("{name} belongs to no declared family")));
        }
        samples.push(Sample {
            name: name.to_string(),
            labels,
            value,
        });
    }
    Ok(samples)
}

#[test]
fn exposition_parser_is_strict() {
    let good = "# HELP a_x Help.\n# TYPE a_x counter\na_x_total{k=\"v\\\"q\",l=\"2\"} 3\n# TYPE h histogram\nh_bucket{le=\"+Inf\"} 1\nh_sum 0.5\n# EOF\n";
    let s = parse_exposition(good).unwrap();
    assert_eq!(s.len(), 3);
    assert_eq!(s[0].labels[0], ("k".to_string(), "v\"q".to_string()));
    for bad in [
        "# TYPE a counter\na_total 1 2\n",
        "# TYPE a counter\na_total{k=v} 1\n",
        "# TYPE a counter\na_total one\n",
        "# TYPE a gauge\nb 1\n",
        "# TYPE a gauge\n\na 1\n",
        "# EOF\n# TYPE a gauge\n",
        "# WHAT a\n",
    ] {
        assert!(parse_exposition(bad).is_err(), "accepted {bad:?}");
    }
}

// ---------------------------------------------------------------------------------------
// Flags
// ---------------------------------------------------------------------------------------

/// Bad flags: exit code 2 before anything starts, and an error that names the flag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_flags_exit_2_and_name_the_flag() {
    let home = tempfile::tempdir().unwrap();
    let bin = agent_binary().await;
    let cases: &[(&[&str], &str)] = &[
        (
            &["--node-name", "n1", "--heartbeat-interval", "5m"],
            "--heartbeat-interval",
        ),
        (
            &["--node-name", "n1", "--redis-url", "http://x"],
            "--redis-url",
        ),
        (
            &["--node-name", "n1", "--release-concurrency", "0"],
            "--release-concurrency",
        ),
        (&["--node-name", "n1", "--listen", "nowhere"], "--listen"),
        (&["--redis-url", "cache:6379"], "--node-name"),
    ];
    for (args, flag) in cases {
        let out = Command::new(&bin)
            .env_clear()
            .env("HOME", home.path())
            .args(*args)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output()
            .await
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?}: nothing on stdout");
        let stderr = String::from_utf8_lossy(&out.stderr);
        // The error paragraph, before clap's usage line and tip.
        let error: String = stderr
            .lines()
            .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more"))
            .collect();
        assert!(error.starts_with("error:"), "{args:?}: {stderr:?}");
        assert!(
            error.contains(flag),
            "{args:?}: {stderr:?} does not name {flag}"
        );
    }
}

/// The contract: the error is exactly one line (clap's default rendering adds a blank line,
/// a usage line and a tip).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_flag_error_is_one_line() {
    let home = tempfile::tempdir().unwrap();
    let bin = agent_binary().await;
    for (args, flag) in [
        (
            vec!["--node-name", "n1", "--redis-url", "http://x"],
            "--redis-url",
        ),
        (vec![], "--node-name"),
    ] {
        let out = Command::new(&bin)
            .env_clear()
            .env("HOME", home.path())
            .args(&args)
            .output()
            .await
            .unwrap();
        assert_eq!(out.status.code(), Some(2));
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{args:?}: one line expected: {stderr:?}");
        assert!(lines[0].contains(flag), "{stderr:?}");
    }
}

/// `--help` exits 0 and documents every option the config defines, with its variable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn help_documents_every_option() {
    let home = tempfile::tempdir().unwrap();
    let out = Command::new(agent_binary().await)
        .env_clear()
        .env("HOME", home.path())
        .arg("--help")
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let help = String::from_utf8_lossy(&out.stdout);
    let cmd = lastcall_agent::config::Config::command();
    let mut longs = 0;
    for arg in cmd.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        longs += 1;
        assert!(help.contains(&format!("--{long}")), "--{long} missing");
        if !matches!(long, "help" | "version") {
            assert!(arg.get_help().is_some(), "--{long} has no help text");
        }
        if let Some(env) = arg.get_env() {
            let env = env.to_string_lossy();
            assert!(help.contains(&format!("[env: {env}=")), "{env} missing");
        }
    }
    assert!(longs >= 20, "only {longs} options found");
    for name in [
        "--node-name",
        "--instance-id",
        "--game-server-group",
        "--redis-url",
        "--heartbeat-interval",
        "--healthcheck-interval",
        "--deregister-on-exit",
        "--dry-run",
        "--compat-taints",
        "NODE_NAME",
        "REDIS_URL",
        "GAME_SERVER_GROUP_NAME",
    ] {
        assert!(help.contains(name), "--help does not document {name}");
    }
}

// ---------------------------------------------------------------------------------------
// Admin endpoints and stop signals
// ---------------------------------------------------------------------------------------

/// `/healthz` answers at once; `/readyz` stays 503 while a watch cannot list and turns 200
/// once it has; `/metrics` is valid exposition text with the drain phase. SIGINT exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_endpoints_serve_metrics_health_and_readiness() {
    let w = world(0, 0, &[]).await;
    let faults = w.cluster.emulator().faults();
    // Every pod LIST/WATCH fails until cleared: the initial lists cannot complete.
    faults.inject(FaultRule::status(
        Some(Method::GET),
        "/api/v1/pods",
        1_000_000,
        500,
    ));
    let agent = AgentProcess::spawn(w.command().await).await;
    assert_eq!(agent.get("/healthz").await.0, 200);
    wait_for("a failed pod list is counted", || async {
        (agent
            .metric("lastcall_watch_errors_total", &[("source", "pod")])
            .await
            .unwrap_or(0.0)
            >= 1.0)
            .then_some(())
    })
    .await;
    let (code, body) = agent.get("/readyz").await;
    assert_eq!(code, 503, "not ready before the watches listed: {body}");
    let report: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(report["kube_watches"]["ok"], false, "{body}");

    faults.clear();
    agent.wait_ready().await;
    assert_eq!(agent.get("/healthz").await.0, 200);

    let r = agent
        .http
        .get(format!("http://{}/metrics", agent.admin))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let ct = r.headers()["content-type"].to_str().unwrap().to_string();
    assert!(ct.starts_with("application/openmetrics-text"), "{ct}");
    wait_for("the first reconcile sets the drain phase", || async {
        let m = agent.metrics().await;
        (metric(&m, "lastcall_drain_phase", &[("phase", "idle")]) == Some(1.0)).then_some(())
    })
    .await;
    let text = agent.metrics().await;
    let samples = parse_exposition(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert!(
        text.ends_with("# EOF\n"),
        "OpenMetrics text ends with # EOF"
    );
    let phases: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.name == "lastcall_drain_phase")
        .collect();
    assert_eq!(phases.len(), 6, "one sample per phase: {phases:?}");
    assert_eq!(phases.iter().map(|s| s.value).sum::<f64>(), 1.0);
    assert!(
        samples
            .iter()
            .any(|s| s.name == "lastcall_reconciles_total" && s.value >= 1.0)
    );

    let mut agent = agent;
    agent.signal("INT").await;
    let status = agent.exit_status("SIGINT").await;
    assert_eq!(status.code(), Some(0), "clean exit on SIGINT");
}

/// SIGTERM on a registered FleetIQ agent: exit 0 within 5 s, and no deregistration (the
/// default: a rollout must not hand a busy node back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_exits_0_without_deregistering() {
    let w = world(1, 0, &[]).await;
    let mut agent = w.fleetiq_agent(&[]).await;
    wait_for("registered and claimed", || async {
        (w.gl.count("ClaimGameServer") == 1).then_some(())
    })
    .await;
    agent.wait_ready().await;
    wait_for("a heartbeat", || async {
        (agent
            .metric("lastcall_heartbeats_total", &[("result", "ok")])
            .await
            .unwrap_or(0.0)
            >= 1.0)
            .then_some(())
    })
    .await;
    agent.signal("TERM").await;
    let status = agent.exit_status("SIGTERM").await;
    assert_eq!(status.code(), Some(0), "clean exit on SIGTERM");
    assert_eq!(w.gl.count("DeregisterGameServer"), 0);
    let gs = w.gl.game_server(GROUP, IID).unwrap();
    assert!(gs.registered, "still registered after SIGTERM");
}

/// With `--deregister-on-exit`, SIGTERM deregisters a node with no game server exactly once,
/// then exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deregister_on_exit_deregisters_once_on_sigterm() {
    let w = world(0, 0, &[]).await;
    let mut agent = w.fleetiq_agent(&["--deregister-on-exit"]).await;
    wait_for("registered and claimed", || async {
        (w.gl.count("ClaimGameServer") == 1).then_some(())
    })
    .await;
    agent.wait_ready().await;
    assert_eq!(
        w.gl.count("DeregisterGameServer"),
        0,
        "not before the signal"
    );
    agent.signal("TERM").await;
    let status = agent.exit_status("SIGTERM").await;
    assert_eq!(status.code(), Some(0));
    assert_eq!(w.gl.count("DeregisterGameServer"), 1);
    let gs = w.gl.game_server(GROUP, IID).unwrap();
    assert!(!gs.registered);
    assert_eq!(gs.deregistered_count, 1);
}

// ---------------------------------------------------------------------------------------
// Issue scenario 3: a crash mid-drain
// ---------------------------------------------------------------------------------------

/// The agent is SIGKILLed after fencing and releasing; a new process resumes from the
/// progress on the Node: no re-register, no re-claim, no undoing of the fence, and exactly
/// one deregistration once the match ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_mid_drain_resumes_without_reregistering_or_deregistering_twice() {
    let w = world(2, 1, &["n2"]).await;
    let allocated = w
        .on("n1")
        .into_iter()
        .find(|g| g.state == Some(S::Allocated))
        .unwrap();

    let first = w.fleetiq_agent(&[]).await;
    wait_for("registration recorded on the Node", || async {
        annotations(&w.node().await)
            .contains_key("lastcall.dev/registered")
            .then_some(())
    })
    .await;
    wait_for("first agent subscribed", || async {
        (first.metric("lastcall_redis_connected", &[]).await == Some(1.0)).then_some(())
    })
    .await;
    wait_for("game servers labelled for the agent's watch", || async {
        w.on("n1")
            .iter()
            .all(|g| g.labels.get("lastcall.dev/node").map(String::as_str) == Some("n1"))
            .then_some(())
    })
    .await;

    w.status(Status::Draining).await;
    wait_for(
        "fenced, Ready servers released, the match protected",
        || async {
            let here = w.on("n1");
            let protected = here.len() == 1
                && here[0].uid == allocated.uid
                && here[0]
                    .annotations
                    .contains_key("lastcall.dev/drain-deadline");
            (fenced(&w.node().await) && protected).then_some(())
        },
    )
    .await;
    let killed = first.crash().await;
    assert_eq!(killed.signal(), Some(9), "killed by SIGKILL: {killed:?}");
    let before = annotations(&w.node().await);
    let node_writes = w.agent_node_writes();
    assert_eq!(w.gl.count("RegisterGameServer"), 1);
    assert_eq!(w.gl.count("ClaimGameServer"), 1);

    let mut second = w.fleetiq_agent(&[]).await;
    second.wait_ready().await;
    wait_for("the new agent resumes the drain", || async {
        let m = second.metrics().await;
        (metric(&m, "lastcall_drain_phase", &[("phase", "draining")]) == Some(1.0)
            && metric(&m, "lastcall_redis_connected", &[]) == Some(1.0))
        .then_some(())
    })
    .await;
    wait_for("the new agent heartbeats", || async {
        (second
            .metric("lastcall_heartbeats_total", &[("result", "ok")])
            .await
            .unwrap_or(0.0)
            >= 2.0)
            .then_some(())
    })
    .await;
    let n = w.node().await;
    assert!(fenced(&n), "the node stays fenced");
    assert_eq!(
        annotations(&n).get("lastcall.dev/drain-started"),
        before.get("lastcall.dev/drain-started"),
        "the drain is resumed, not restarted"
    );
    assert_eq!(
        w.agent_node_writes(),
        node_writes,
        "resuming a fenced node writes nothing to it (no cancel and re-fence)"
    );
    let g = w.cluster.game_server(NS, &allocated.name).unwrap();
    assert_eq!(g.uid, allocated.uid);
    assert!(!g.deleting, "the match is not deleted");
    assert_eq!(g.state, Some(S::Allocated));
    assert!(g.annotations.contains_key("lastcall.dev/drain-deadline"));
    assert_eq!(
        g.labels
            .get("lastcall.dev/node-draining")
            .map(String::as_str),
        Some("true")
    );
    let m = second.metrics().await;
    assert_eq!(metric_sum(&m, "lastcall_releases_total", &[]), 0.0);
    assert_eq!(w.gl.count("RegisterGameServer"), 1, "no re-register");
    assert_eq!(w.gl.count("ClaimGameServer"), 1, "no re-claim");
    assert_eq!(
        w.gl.count("DeregisterGameServer"),
        0,
        "not while the match runs"
    );

    w.cluster.sdk_shutdown(NS, &allocated.name).unwrap();
    wait_for("deregistered once the node is empty", || async {
        (w.gl.count("DeregisterGameServer") == 1).then_some(())
    })
    .await;
    wait_for("deregistration recorded on the Node", || async {
        annotations(&w.node().await)
            .contains_key("lastcall.dev/deregistered")
            .then_some(())
    })
    .await;
    // Let several resync passes (1 s) run: still exactly once.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(w.gl.count("DeregisterGameServer"), 1);
    assert_eq!(w.gl.count("RegisterGameServer"), 1);
    assert_eq!(w.gl.count("ClaimGameServer"), 1);
    assert_eq!(
        second
            .metric("lastcall_drain_phase", &[("phase", "deregistered")])
            .await,
        Some(1.0)
    );
    second.signal("TERM").await;
    assert_eq!(second.exit_status("SIGTERM").await.code(), Some(0));
}
