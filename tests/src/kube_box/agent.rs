//! The real `lastcall-agent` process on the box, as the chart deploys it.
//!
//! The chart is the source of truth: the ServiceAccount, ClusterRole and ClusterRoleBinding
//! are applied from the rendered `manifests/lastcall.yaml`, and the agent runs with that
//! DaemonSet container's arguments (only `--listen` moved to 127.0.0.1, an ephemeral port,
//! plus what a test adds as chart values would: `--game-server-group`, the IMDS endpoint).
//! Its credentials are a ServiceAccount token from the TokenRequest API, so a permission
//! the chart lacks is a 403 on the box. Its pod exists on its node (created by the test as
//! the DaemonSet controller would, bound by name) and the Downward API variables the chart
//! sets (`NODE_NAME`, `POD_NAME`, `POD_NAMESPACE`, `POD_UID`, `POD_IP`) are that pod's.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail};
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};

use super::KubeBox;
use crate::eventually::try_eventually;

/// The chart's namespace and agent ServiceAccount (default values).
pub const NAMESPACE: &str = "lastcall";
pub const SERVICE_ACCOUNT: &str = "lastcall-agent";

fn manifest_path() -> PathBuf {
    crate::paths::package_dir().join("../manifests/lastcall.yaml")
}

/// Every document of the rendered default manifest.
pub fn manifest() -> anyhow::Result<Vec<Value>> {
    let path = manifest_path();
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let docs: Vec<Value> = serde_saphyr::from_multiple(&text)
        .with_context(|| format!("parsing {}", path.display()))?;
    Ok(docs.into_iter().filter(|d| !d.is_null()).collect())
}

fn doc<'a>(docs: &'a [Value], kind: &str, name: &str) -> anyhow::Result<&'a Value> {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .with_context(|| format!("{kind} {name} not in manifests/lastcall.yaml"))
}

/// The agent container of the chart's DaemonSet.
fn container(docs: &[Value]) -> anyhow::Result<&Value> {
    doc(docs, "DaemonSet", "lastcall-agent")?
        .pointer("/spec/template/spec/containers/0")
        .context("the agent DaemonSet has no container")
}

/// The chart's agent arguments.
pub fn chart_args() -> anyhow::Result<Vec<String>> {
    let docs = manifest()?;
    let args = container(&docs)?
        .get("args")
        .and_then(Value::as_array)
        .context("the agent container has no args")?;
    args.iter()
        .map(|a| a.as_str().map(str::to_string).context("a non-string arg"))
        .collect()
}

/// The Downward API variables the chart passes (name → fieldPath).
pub fn chart_env() -> anyhow::Result<Vec<(String, String)>> {
    let docs = manifest()?;
    let env = container(&docs)?
        .get("env")
        .and_then(Value::as_array)
        .context("the agent container has no env")?;
    Ok(env
        .iter()
        .filter_map(|e| {
            Some((
                e.get("name")?.as_str()?.to_string(),
                e.pointer("/valueFrom/fieldRef/fieldPath")?
                    .as_str()?
                    .to_string(),
            ))
        })
        .collect())
}

/// Applies the chart's Namespace-scoped ServiceAccount and the ClusterRole and binding of
/// the agent (an existing object is replaced, so the box always holds the chart's rules).
pub async fn install_rbac(client: &kube::Client) -> anyhow::Result<()> {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NAMESPACE}}))?;
    match Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => return Err(e.into()),
    }
    let docs = manifest()?;
    for (kind, plural, group, version) in [
        ("ServiceAccount", "serviceaccounts", "", "v1"),
        (
            "ClusterRole",
            "clusterroles",
            "rbac.authorization.k8s.io",
            "v1",
        ),
        (
            "ClusterRoleBinding",
            "clusterrolebindings",
            "rbac.authorization.k8s.io",
            "v1",
        ),
    ] {
        let mut obj: DynamicObject =
            serde_json::from_value(doc(&docs, kind, SERVICE_ACCOUNT)?.clone())?;
        let ar = ApiResource {
            group: group.into(),
            version: version.into(),
            api_version: if group.is_empty() {
                version.into()
            } else {
                format!("{group}/{version}")
            },
            kind: kind.into(),
            plural: plural.into(),
        };
        let api: Api<DynamicObject> = match obj.metadata.namespace.as_deref() {
            Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
            None => Api::all_with(client.clone(), &ar),
        };
        match api.get_opt(SERVICE_ACCOUNT).await? {
            None => {
                api.create(&PostParams::default(), &obj).await?;
            }
            Some(have) => {
                obj.metadata.resource_version = have.metadata.resource_version;
                api.replace(SERVICE_ACCOUNT, &PostParams::default(), &obj)
                    .await?;
            }
        }
    }
    Ok(())
}

/// A token for the agent's ServiceAccount from the TokenRequest API (one hour), bound to
/// its pod as a kubelet's projected token is.
pub async fn token(client: &kube::Client, pod: &Pod) -> anyhow::Result<String> {
    let api: Api<ServiceAccount> = Api::namespaced(client.clone(), NAMESPACE);
    let req: TokenRequest = serde_json::from_value(json!({
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {
            "audiences": [],
            "expirationSeconds": 3600,
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod",
                               "name": pod.metadata.name, "uid": pod.metadata.uid},
        },
    }))?;
    let got: TokenRequest = api
        .create_subresource("token", SERVICE_ACCOUNT, &PostParams::default(), &req)
        .await?;
    Ok(got.status.context("TokenRequest without status")?.token)
}

/// A token for the agent's ServiceAccount bound to no object: the API server gives it no
/// node (`authentication.kubernetes.io/node-name`).
pub async fn unbound_token(client: &kube::Client) -> anyhow::Result<String> {
    let api: Api<ServiceAccount> = Api::namespaced(client.clone(), NAMESPACE);
    let req: TokenRequest = serde_json::from_value(json!({
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {"audiences": [], "expirationSeconds": 3600},
    }))?;
    let got: TokenRequest = api
        .create_subresource("token", SERVICE_ACCOUNT, &PostParams::default(), &req)
        .await?;
    Ok(got.status.context("TokenRequest without status")?.token)
}

/// Creates the agent's pod on `node`, bound by name as the DaemonSet controller does, and
/// waits until kwok runs it (it then has an IP).
pub async fn create_pod(client: &kube::Client, node: &str) -> anyhow::Result<Pod> {
    let pod = pod_for(node)?;
    let name = pod.metadata.name.clone().unwrap_or_default();
    let api: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    api.create(&PostParams::default(), &pod).await?;
    let got = try_eventually(
        &format!("agent pod {name} running on {node}"),
        Duration::from_secs(60),
        Duration::from_millis(100),
        || async {
            let p = api.get(&name).await.ok()?;
            let st = p.status.as_ref()?;
            (st.phase.as_deref() == Some("Running") && st.pod_ip.is_some()).then_some(p)
        },
    )
    .await?;
    Ok(got)
}

/// The agent's pod on `node` from the chart's DaemonSet template (its labels, tolerations
/// and ServiceAccount), bound by name.
pub fn pod_for(node: &str) -> anyhow::Result<Pod> {
    let docs = manifest()?;
    let template = doc(&docs, "DaemonSet", "lastcall-agent")?
        .pointer("/spec/template")
        .context("the agent DaemonSet has no template")?;
    let name = format!("lastcall-agent-{node}");
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE,
                     "labels": template.pointer("/metadata/labels").cloned().unwrap_or(json!({}))},
        "spec": {
            "nodeName": node,
            "serviceAccountName": SERVICE_ACCOUNT,
            "tolerations": template.pointer("/spec/tolerations").cloned().unwrap_or(json!([])),
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "agent", "image": "lastcall-agent:0.1.0"}],
        },
    }))?;
    Ok(pod)
}

/// The chart's agent arguments with `--listen` on 127.0.0.1 (an ephemeral port) and `extra`
/// in place of the chart's value of the same flag (`--flag=value`), or added.
pub fn args_with(extra: &[String]) -> anyhow::Result<Vec<String>> {
    let mut args = chart_args()?;
    for a in &mut args {
        if a.starts_with("--listen=") {
            *a = "--listen=127.0.0.1:0".into();
        }
    }
    for a in extra {
        if let Some((flag, _)) = a.split_once('=')
            && let Some(slot) = args.iter_mut().find(|x| x.starts_with(&format!("{flag}=")))
        {
            *slot = a.clone();
        } else {
            args.push(a.clone());
        }
    }
    Ok(args)
}

/// What a test adds to the chart's agent: chart values (arguments), and environment.
#[derive(Clone, Debug, Default)]
pub struct Extra {
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
}

/// A running agent process. Its output is kept and printed if the test panics; dropping it
/// kills the process.
pub struct AgentProcess {
    child: Child,
    pub admin: SocketAddr,
    pub pod: Pod,
    output: Arc<Mutex<Vec<String>>>,
    _dir: tempfile::TempDir,
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

impl AgentProcess {
    /// Starts the agent for `node` as the chart runs it, with `extra`.
    pub async fn start(kbox: &KubeBox, node: &str, extra: Extra) -> anyhow::Result<AgentProcess> {
        Self::start_at(kbox, &kbox.server(), node, extra).await
    }

    /// [`Self::start`] with the agent's kubeconfig naming `server` (a fault proxy in front
    /// of the box's API server, serving the box's certificate).
    pub async fn start_at(
        kbox: &KubeBox,
        server: &str,
        node: &str,
        extra: Extra,
    ) -> anyhow::Result<AgentProcess> {
        Self::start_with(kbox, server, node, extra, true).await
    }

    /// [`Self::start`] with a token of the agent's ServiceAccount bound to no pod (so it
    /// carries no node): a credential that is not the DaemonSet's own.
    pub async fn start_unbound(
        kbox: &KubeBox,
        node: &str,
        extra: Extra,
    ) -> anyhow::Result<AgentProcess> {
        Self::start_with(kbox, &kbox.server(), node, extra, false).await
    }

    async fn start_with(
        kbox: &KubeBox,
        server: &str,
        node: &str,
        extra: Extra,
        bound: bool,
    ) -> anyhow::Result<AgentProcess> {
        let client = kbox.client().await?;
        install_rbac(&client).await?;
        let pod = create_pod(&client, node).await?;
        let token = if bound {
            token(&client, &pod).await?
        } else {
            unbound_token(&client).await?
        };
        let args = args_with(&extra.args)?;
        let pod_json = serde_json::to_value(&pod)?;
        let mut env = Vec::new();
        for (name, path) in chart_env()? {
            let value = match path.as_str() {
                "spec.nodeName" => Some(Value::String(node.to_string())),
                p => pod_json
                    .pointer(&format!("/{}", p.replace('.', "/")))
                    .cloned(),
            };
            let Some(Value::String(v)) = value else {
                bail!("the chart's {name} ({path}) has no value on the agent's pod");
            };
            env.push((name, v));
        }
        env.extend(extra.env.iter().cloned());
        AgentProcess::spawn(kbox, server, pod, &token, args, env).await
    }

    /// Runs `lastcall-agent` on the host as `pod`'s container: `args`, only the `env` given
    /// (nothing inherited), and a kubeconfig holding `token` for `server`.
    pub async fn spawn(
        kbox: &KubeBox,
        server: &str,
        pod: Pod,
        token: &str,
        args: Vec<String>,
        env: Vec<(String, String)>,
    ) -> anyhow::Result<AgentProcess> {
        let dir = tempfile::Builder::new()
            .prefix("lastcall-box-agent-")
            .tempdir()?;
        let kubeconfig = dir.path().join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            kbox.kubeconfig_at(server, token, "lastcall-agent"),
        )?;
        let mut cmd = Command::new(
            tokio::task::spawn_blocking(|| {
                crate::bins::try_workspace_binary("lastcall-agent", "lastcall-agent")
            })
            .await??,
        );
        cmd.env_clear()
            .env("HOME", dir.path())
            .env("KUBECONFIG", &kubeconfig)
            .envs(env)
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn().context("starting lastcall-agent")?;
        let output = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = tokio::sync::oneshot::channel();
        let stdout = child.stdout.take().context("no stdout")?;
        let stderr = child.stderr.take().context("no stderr")?;
        tokio::spawn(collect(stdout, output.clone(), Some(tx)));
        tokio::spawn(collect(stderr, output.clone(), None));
        let admin = match tokio::time::timeout(Duration::from_secs(60), rx).await {
            Ok(Ok(a)) => a,
            _ => bail!(
                "lastcall-agent did not report its admin address; output:\n{}",
                output.lock().unwrap_or_else(|e| e.into_inner()).join("\n")
            ),
        };
        Ok(AgentProcess {
            child,
            admin,
            pod,
            output,
            _dir: dir,
        })
    }

    pub fn output(&self) -> String {
        self.output
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .join("\n")
    }

    /// `Some(status)` once the process has exited (a test names it instead of timing out).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    pub async fn metrics(&self) -> String {
        crate::agent::scrape(self.admin).await
    }

    /// Waits until `/readyz` answers 200.
    pub async fn ready(&self) -> anyhow::Result<()> {
        let url = format!("http://{}/readyz", self.admin);
        let http = reqwest::Client::new();
        try_eventually(
            "the agent reports ready",
            Duration::from_secs(60),
            Duration::from_millis(100),
            || async {
                let r = http.get(&url).send().await.ok()?;
                r.status().is_success().then_some(())
            },
        )
        .await?;
        Ok(())
    }

    /// SIGTERM, as the kubelet stops it, and the exit.
    pub async fn stop(mut self) -> anyhow::Result<std::process::ExitStatus> {
        let pid = self.child.id().context("the agent already exited")?;
        crate::process::signal(pid, "TERM").await?;
        match crate::process::exited_within(&mut self.child, Duration::from_secs(10)).await? {
            Some(s) => Ok(s),
            None => bail!("lastcall-agent did not exit within 10 s of SIGTERM"),
        }
    }
}

async fn collect(
    stream: impl AsyncRead + Unpin,
    output: Arc<Mutex<Vec<String>>>,
    mut bound: Option<tokio::sync::oneshot::Sender<SocketAddr>>,
) {
    let mut lines = BufReader::new(stream).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if bound.is_some()
            && let Ok(v) = serde_json::from_str::<Value>(&line)
            && v["message"] == "lastcall-agent starting"
            && let Some(addr) = v["listen"].as_str().and_then(|a| a.parse().ok())
            && let Some(tx) = bound.take()
        {
            let _ = tx.send(addr);
        }
        output.lock().unwrap_or_else(|e| e.into_inner()).push(line);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chart_gives_the_agent_its_arguments_and_downward_api() {
        let args = chart_args().unwrap();
        assert!(args.iter().any(|a| a.starts_with("--listen=")), "{args:?}");
        assert!(
            args.iter().any(|a| a == "--gameserver-selector=auto"),
            "{args:?}"
        );
        let env: Vec<String> = chart_env().unwrap().into_iter().map(|(n, _)| n).collect();
        for want in [
            "NODE_NAME",
            "POD_NAME",
            "POD_NAMESPACE",
            "POD_UID",
            "POD_IP",
        ] {
            assert!(env.iter().any(|n| n == want), "{want} missing: {env:?}");
        }
        let docs = manifest().unwrap();
        for kind in ["ServiceAccount", "ClusterRole", "ClusterRoleBinding"] {
            doc(&docs, kind, SERVICE_ACCOUNT).unwrap();
        }
        assert!(doc(&docs, "ClusterRole", "no-such-role").is_err());
    }
}
