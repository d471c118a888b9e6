//! The documented install, run as written: every shell block of the install pages goes
//! through a real `bash` onto the box, with the box's real `helm` and `kubectl` and stand-ins
//! only for the cloud CLIs (`tests/fixtures/cli/stand-in`).
//!
//! A page's blocks run in order in one shell session (variables a block sets reach the next
//! ones, files are written in one work directory where `charts/`, `manifests/` and `hack/`
//! are the repository's). A block that starts a fresh install (`kubectl create namespace
//! lastcall`, or `helm install … --create-namespace`) first gets a cluster without lastcall,
//! as a reader following one path has. An HTML comment on the line before a block tells the
//! test what the block is:
//!
//! - `<!-- test: not run: <reason> -->`: a shell block that does not run here (image builds);
//!   it may hold no `helm` or `kubectl` command;
//! - `<!-- test: server dry-run -->`: a YAML block applied with `kubectl apply
//!   --dry-run=server` (the API server validates it against the real CRD);
//! - `<!-- test: after section <N> -->`: the block runs on the install of section `<N>` of
//!   the same page, which is replayed first.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use serde_json::Value;

use super::KubeBox;

/// The pages whose shell blocks the install test runs, in its order.
pub const PAGES: &[&str] = &[
    "charts/lastcall/README.md",
    "docs/install.md",
    "docs/migration.md",
    "docs/notifications.md",
    "docs/operations.md",
];

/// What the test does with a block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mark {
    /// A shell block: run it.
    Run,
    /// Not a shell block, or a shell block marked not to run (with the reason).
    Skip(String),
    /// A YAML block the API server validates.
    ServerDryRun,
    /// Runs on the install of this section (its number) of the same page.
    After(String),
}

/// One fenced block of a page.
#[derive(Clone, Debug)]
pub struct Block {
    pub page: String,
    /// The `## ` heading the block is under.
    pub section: String,
    /// The page's line number of the block's first line of content (1-based).
    pub line: usize,
    pub lang: String,
    /// The content, without the fence's indentation.
    pub body: String,
    pub mark: Mark,
}

impl Block {
    /// Whether the block starts a fresh install of lastcall.
    pub fn fresh_install(&self) -> bool {
        let text = self.body.replace("\\\n", " ");
        text.lines().any(|l| {
            let l = l.trim();
            l.starts_with("kubectl create namespace lastcall")
                || (l.starts_with("helm install") && l.contains("--create-namespace"))
        })
    }

    /// The section's number (`3` of `3. EKS without FleetIQ`), if it has one.
    pub fn section_number(&self) -> Option<&str> {
        let n = self.section.split_once('.')?.0;
        n.chars().all(|c| c.is_ascii_digit()).then_some(n)
    }

    /// Where the block is, for messages: `docs/install.md:142 (§ 2. EKS with FleetIQ)`.
    pub fn place(&self) -> String {
        format!("{}:{} (§ {})", self.page, self.line, self.section)
    }
}

const SHELLS: &[&str] = &["sh", "bash", "shell"];

/// Every fenced block of `text` (the page `page`), with what the test does with it.
pub fn blocks(page: &str, text: &str) -> anyhow::Result<Vec<Block>> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut section = String::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        if let Some(h) = line.strip_prefix("## ") {
            section = h.trim().to_string();
        }
        let trimmed = line.trim_start();
        let Some(info) = trimmed.strip_prefix("```") else {
            i += 1;
            continue;
        };
        let indent = line.len() - trimmed.len();
        let lang = info.split_whitespace().next().unwrap_or("").to_string();
        let marker = lines[..i]
            .iter()
            .rev()
            .find(|l| !l.trim().is_empty())
            .and_then(|l| {
                l.trim()
                    .strip_prefix("<!-- test:")
                    .and_then(|m| m.strip_suffix("-->"))
            })
            .map(str::trim);
        let start = i + 1;
        let mut end = start;
        while end < lines.len() && !lines[end].trim_start().starts_with("```") {
            end += 1;
        }
        if end == lines.len() {
            bail!("{page}:{}: a block that is never closed", i + 1);
        }
        let body: String = lines[start..end]
            .iter()
            .map(|l| {
                let cut = l.len() - l.trim_start().len();
                format!("{}\n", &l[cut.min(indent)..])
            })
            .collect();
        let place = format!("{page}:{}", i + 1);
        let shell = SHELLS.contains(&lang.as_str());
        if lang == "console" {
            bail!(
                "{place}: a `console` block: write commands in `sh` blocks, output in `text` blocks"
            );
        }
        let mark = match marker {
            None if shell => Mark::Run,
            None => Mark::Skip(format!("a `{lang}` block")),
            Some(m) => {
                if let Some(reason) = m.strip_prefix("not run:") {
                    let reason = reason.trim();
                    if !shell || reason.is_empty() {
                        bail!("{place}: `not run:` needs a shell block and a reason");
                    }
                    if let Some(cmd) = body
                        .lines()
                        .map(str::trim)
                        .find(|l| l.starts_with("helm ") || l.starts_with("kubectl "))
                    {
                        bail!(
                            "{place}: a block marked not run holds `{cmd}`: every helm and kubectl command must run"
                        );
                    }
                    Mark::Skip(reason.to_string())
                } else if m == "server dry-run" {
                    if lang != "yaml" {
                        bail!("{place}: `server dry-run` is for yaml blocks");
                    }
                    Mark::ServerDryRun
                } else if let Some(n) = m.strip_prefix("after section") {
                    if !shell {
                        bail!("{place}: `after section` is for shell blocks");
                    }
                    Mark::After(n.trim().to_string())
                } else {
                    bail!("{place}: unknown test marker `{m}`");
                }
            }
        };
        out.push(Block {
            page: page.to_string(),
            section: section.clone(),
            line: start + 1,
            lang,
            body,
            mark,
        });
        i = end + 1;
    }
    Ok(out)
}

/// The repository's root.
pub fn repo_root() -> PathBuf {
    crate::paths::package_dir()
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// Every block of every page of [`PAGES`].
pub fn all_blocks() -> anyhow::Result<Vec<Block>> {
    let root = repo_root();
    let mut out = Vec::new();
    for page in PAGES {
        let text =
            std::fs::read_to_string(root.join(page)).with_context(|| format!("reading {page}"))?;
        out.extend(blocks(page, &text)?);
    }
    Ok(out)
}

/// The CRDs the box's build copied from Karpenter's and the Prometheus operator's modules
/// (`hack/box/build.sh`, `share/crds/`).
pub fn crd_files(kbox: &KubeBox) -> anyhow::Result<Vec<PathBuf>> {
    let dir = kbox.bin.join("../share/crds");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .with_context(|| format!("{} (hack/box/build.sh puts the CRDs there)", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    if files.len() < 5 {
        bail!(
            "{} holds {} CRDs, expected NodePool, NodeClaim, ServiceMonitor, PodMonitor, PrometheusRule",
            dir.display(),
            files.len()
        );
    }
    Ok(files)
}

/// Creates (or replaces) every CRD of [`crd_files`] and waits until each is Established.
pub async fn install_crds(kbox: &KubeBox, client: &kube::Client) -> anyhow::Result<()> {
    let ar = ApiResource {
        group: "apiextensions.k8s.io".into(),
        version: "v1".into(),
        api_version: "apiextensions.k8s.io/v1".into(),
        kind: "CustomResourceDefinition".into(),
        plural: "customresourcedefinitions".into(),
    };
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &ar);
    let mut names = Vec::new();
    for f in crd_files(kbox)? {
        let text = std::fs::read_to_string(&f)?;
        let docs: Vec<Value> = serde_saphyr::from_multiple(&text)
            .with_context(|| format!("parsing {}", f.display()))?;
        for d in docs.into_iter().filter(|d| !d.is_null()) {
            let mut obj: DynamicObject = serde_json::from_value(d)?;
            let name = obj.metadata.name.clone().context("a CRD without a name")?;
            match api.get_opt(&name).await? {
                None => {
                    api.create(&PostParams::default(), &obj).await?;
                }
                Some(have) => {
                    obj.metadata.resource_version = have.metadata.resource_version;
                    api.replace(&name, &PostParams::default(), &obj).await?;
                }
            }
            names.push(name);
        }
    }
    for name in names {
        crate::eventually::try_eventually(
            &format!("CRD {name} Established"),
            Duration::from_secs(30),
            Duration::from_millis(100),
            || async {
                let crd = api.get(&name).await.ok()?;
                let conds = crd.data.pointer("/status/conditions")?.as_array()?.clone();
                conds
                    .iter()
                    .any(|c| c["type"] == "Established" && c["status"] == "True")
                    .then_some(())
            },
        )
        .await?;
    }
    Ok(())
}

/// The namespace's Events, one line each (why a DaemonSet has no pods, say).
pub async fn events(client: &kube::Client, ns: &str) -> String {
    let api: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(client.clone(), ns);
    match api.list(&Default::default()).await {
        Ok(l) => l
            .items
            .iter()
            .map(|e| {
                format!(
                    "{} {}/{}: {}",
                    e.reason.as_deref().unwrap_or(""),
                    e.involved_object.kind.as_deref().unwrap_or(""),
                    e.involved_object.name.as_deref().unwrap_or(""),
                    e.message.as_deref().unwrap_or("")
                )
            })
            .collect::<Vec<_>>()
            .join("\n"),
        Err(e) => format!("(events of {ns}: {e})"),
    }
}

/// A bash session for one run of the pages: a work directory, the environment a reader has
/// (the box's kubeconfig, `helm` and `kubectl` first on PATH after the cloud CLIs' stand-ins)
/// and the variables a block leaves for the next.
pub struct Shell {
    dir: tempfile::TempDir,
    state: PathBuf,
    env: Vec<(String, String)>,
    cli_log: PathBuf,
    counter: std::sync::atomic::AtomicUsize,
}

/// What one block did.
#[derive(Debug)]
pub struct Ran {
    pub stdout: String,
    pub stderr: String,
}

impl Shell {
    /// A session against `kbox` as its admin; `vars` are the values the pages ask the reader
    /// to have (`REGISTRY`, `ACCOUNT`, …).
    pub fn new(kbox: &KubeBox, vars: &[(&str, &str)]) -> anyhow::Result<Shell> {
        let dir = tempfile::Builder::new()
            .prefix("lastcall-box-install-")
            .tempdir()?;
        let root = repo_root();
        let work = dir.path().join("work");
        let home = dir.path().join("home");
        std::fs::create_dir_all(&work)?;
        std::fs::create_dir_all(&home)?;
        for d in ["charts", "manifests", "hack"] {
            std::os::unix::fs::symlink(root.join(d), work.join(d))?;
        }
        let kubeconfig = dir.path().join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            kbox.kubeconfig(super::ADMIN_TOKEN, super::ADMIN_USER),
        )?;
        let state = dir.path().join("state.sh");
        std::fs::write(&state, "")?;
        let cli_log = dir.path().join("cli.log");
        std::fs::write(&cli_log, "")?;
        let stand_ins = root.join("tests/fixtures/cli");
        let path = format!(
            "{}:{}:/usr/local/bin:/usr/bin:/bin",
            stand_ins.display(),
            kbox.bin.display()
        );
        let mut env: Vec<(String, String)> = vec![
            ("PATH".into(), path),
            ("HOME".into(), home.display().to_string()),
            ("KUBECONFIG".into(), kubeconfig.display().to_string()),
            ("LANG".into(), "C.UTF-8".into()),
            ("LASTCALL_CLI_LOG".into(), cli_log.display().to_string()),
        ];
        env.extend(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        Ok(Shell {
            dir,
            state,
            env,
            cli_log,
            counter: Default::default(),
        })
    }

    /// The work directory (where the pages' files are written).
    pub fn work(&self) -> PathBuf {
        self.dir.path().join("work")
    }

    /// Every stand-in call so far: the CLI and its arguments, one call each.
    pub fn cli_calls(&self) -> Vec<Vec<String>> {
        std::fs::read(&self.cli_log)
            .unwrap_or_default()
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| {
                l.split(|b| *b == 0)
                    .filter(|a| !a.is_empty())
                    .map(|a| String::from_utf8_lossy(a).into_owned())
                    .collect()
            })
            .collect()
    }

    /// Runs `block` through bash (`set -e -o pipefail`: a failing command, or a failing
    /// command in a pipe, fails the block) and keeps the variables it set for the next block.
    /// An error names the block, the page's line of the failing command and bash's stderr.
    pub async fn run(&self, block: &Block) -> anyhow::Result<Ran> {
        let n = self
            .counter
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let script = self.dir.path().join(format!("block-{n}.sh"));
        std::fs::write(&script, &block.body)?;
        // The block is sourced, so $LINENO in the ERR trap is its own line number. A failing
        // command stops the block (as `set -e` would), and so does a pipe with a failing
        // member (`pipefail`), except a `grep` that matched nothing (exit 1) at the end of a
        // pipe whose other commands succeeded: a diagnostic that finds nothing is an answer.
        const DRIVER: &str = r#". "$1"
__lastcall_err() {
  local rc="$1" line="$2" cmd="$3"; shift 3
  # The block's own failures have ended the shell already: sourcing it "fails" only when
  # its last command was a grep that matched nothing.
  [ "$cmd" = '. "$2"' ] && return 0
  local ok=1 n=$# i=0 s
  for s in "$@"; do i=$((i + 1)); [ "$i" -lt "$n" ] && [ "$s" != 0 ] && ok=0; done
  if [ "$rc" = 1 ] && [ "$ok" = 1 ] && [[ "$cmd" == grep* ]]; then
    printf 'lastcall-install-test: no match at line %s: %s\n' "$line" "$cmd" >&2
    return 0
  fi
  printf '\nlastcall-install-test: failed at line %s (exit %s): %s\n' "$line" "$rc" "$cmd" >&2
  exit "$rc"
}
set -a -u -o pipefail
trap '__lastcall_err "$?" "$LINENO" "$BASH_COMMAND" "${PIPESTATUS[@]}"' ERR
. "$2"
trap - ERR
set +a +u
export -p >"$1.new" && mv "$1.new" "$1"
"#;
        let mut cmd = tokio::process::Command::new("bash");
        cmd.args(["--noprofile", "--norc", "-c", DRIVER, "block"])
            .arg(&self.state)
            .arg(&script)
            .current_dir(self.work())
            .env_clear()
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let child = cmd.spawn().context("starting bash")?;
        let out =
            match tokio::time::timeout(Duration::from_secs(300), child.wait_with_output()).await {
                Ok(o) => o?,
                Err(_) => bail!("{}: the block ran for more than 300 s", block.place()),
            };
        let ran = Ran {
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        };
        if !out.status.success() {
            // Our trap's line, else bash's own (`block-N.sh: line K: X: unbound variable`).
            let at = ran.stderr.lines().rev().find_map(|l| {
                let rest = l
                    .strip_prefix("lastcall-install-test: failed at line ")
                    .or_else(|| l.split_once(".sh: line ").map(|(_, r)| r))?;
                rest.split([' ', ':']).next()?.parse::<usize>().ok()
            });
            let (line, text) = match at {
                Some(k) => (
                    block.line + k - 1,
                    block.body.lines().nth(k - 1).unwrap_or("").to_string(),
                ),
                None => (block.line, String::from("(bash gave no line)")),
            };
            bail!(
                "{} failed ({}) at {}:{line}: {text}\n--- bash's stderr ---\n{}\n--- stdout ---\n{}",
                block.place(),
                out.status,
                block.page,
                ran.stderr.trim_end(),
                ran.stdout.trim_end()
            );
        }
        Ok(ran)
    }

    /// A command of the test's own (set-up, reset, checks), in the same environment.
    pub async fn sh(&self, script: &str) -> anyhow::Result<String> {
        let out = tokio::process::Command::new("bash")
            .args([
                "--noprofile",
                "--norc",
                "-e",
                "-o",
                "pipefail",
                "-c",
                script,
            ])
            .current_dir(self.work())
            .env_clear()
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .output()
            .await?;
        if !out.status.success() {
            bail!(
                "{script}: {}\n{}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

/// The agent as an install runs it, read back from the API server: the DaemonSet's agent
/// container (its args and env, `$(VAR)` references expanded as the kubelet does, Secrets
/// and the Downward API resolved), its pod on a node, and a token for the pod's
/// ServiceAccount from the TokenRequest API, bound to that pod as the kubelet's is.
#[derive(Debug)]
pub struct Installed {
    pub pod: k8s_openapi::api::core::v1::Pod,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub token: String,
}

/// `$(VAR)` references in `s`, from `vars` (as the kubelet expands env and args: an unknown
/// reference stays as written, `$$` is a `$`).
pub fn expand(s: &str, vars: &[(String, String)]) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        if let Some(t) = tail.strip_prefix("$$") {
            out.push('$');
            rest = t;
        } else if let Some(body) = tail.strip_prefix("$(")
            && let Some(end) = body.find(')')
            && let Some((_, v)) = vars.iter().rev().find(|(k, _)| *k == body[..end])
        {
            out.push_str(v);
            rest = &body[end + 1..];
        } else {
            out.push('$');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    out
}

/// Reads the DaemonSet `name` in `ns`, waits for its pod on `node` to run, and resolves its
/// container `container` as the kubelet would start it.
pub async fn installed_agent(
    client: &kube::Client,
    ns: &str,
    name: &str,
    container: &str,
    node: &str,
) -> anyhow::Result<Installed> {
    use k8s_openapi::api::apps::v1::DaemonSet;
    use k8s_openapi::api::authentication::v1::TokenRequest;
    use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, ServiceAccount};
    use kube::api::ListParams;

    let ds = Api::<DaemonSet>::namespaced(client.clone(), ns)
        .get(name)
        .await
        .with_context(|| format!("reading DaemonSet {ns}/{name}"))?;
    let spec = ds.spec.context("a DaemonSet without spec")?;
    let selector = spec
        .selector
        .match_labels
        .context("a DaemonSet selector without matchLabels")?
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    let c = spec
        .template
        .spec
        .context("a pod template without spec")?
        .containers
        .into_iter()
        .find(|c| c.name == container)
        .with_context(|| format!("DaemonSet {name} has no container {container}"))?;
    if c.env_from.as_ref().is_some_and(|e| !e.is_empty()) {
        bail!("container {container} has envFrom, which this reader does not resolve");
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let lp = ListParams::default()
        .labels(&selector)
        .fields(&format!("spec.nodeName={node}"));
    let pod = crate::eventually::try_eventually(
        &format!("the pod of DaemonSet {name} running on {node}"),
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async {
            let list = pods.list(&lp).await.ok()?;
            list.items.into_iter().find(|p| {
                p.metadata.deletion_timestamp.is_none()
                    && p.status.as_ref().is_some_and(|s| {
                        s.phase.as_deref() == Some("Running") && s.pod_ip.is_some()
                    })
            })
        },
    )
    .await?;
    let pod_json = serde_json::to_value(&pod)?;
    let mut env: Vec<(String, String)> = Vec::new();
    for e in c.env.unwrap_or_default() {
        let value = if let Some(v) = e.value {
            expand(&v, &env)
        } else if let Some(from) = e.value_from {
            if let Some(f) = from.field_ref {
                let path = match f.field_path.as_str() {
                    "metadata.name" => "/metadata/name",
                    "metadata.namespace" => "/metadata/namespace",
                    "metadata.uid" => "/metadata/uid",
                    "spec.nodeName" => "/spec/nodeName",
                    "spec.serviceAccountName" => "/spec/serviceAccountName",
                    "status.podIP" => "/status/podIP",
                    "status.hostIP" => "/status/hostIP",
                    other => bail!("{}: fieldRef {other} is not resolved here", e.name),
                };
                pod_json
                    .pointer(path)
                    .and_then(Value::as_str)
                    .with_context(|| format!("{}: the pod has no {}", e.name, f.field_path))?
                    .to_string()
            } else if let Some(r) = from.secret_key_ref {
                let secret = Api::<Secret>::namespaced(client.clone(), ns)
                    .get(&r.name)
                    .await
                    .with_context(|| format!("{}: Secret {}", e.name, r.name))?;
                match secret.data.unwrap_or_default().get(&r.key) {
                    Some(b) => String::from_utf8(b.0.clone())?,
                    None if r.optional == Some(true) => continue,
                    None => bail!("{}: Secret {} has no key {}", e.name, r.name, r.key),
                }
            } else if let Some(r) = from.config_map_key_ref {
                let cm = Api::<ConfigMap>::namespaced(client.clone(), ns)
                    .get(&r.name)
                    .await
                    .with_context(|| format!("{}: ConfigMap {}", e.name, r.name))?;
                match cm.data.unwrap_or_default().get(&r.key) {
                    Some(v) => v.clone(),
                    None if r.optional == Some(true) => continue,
                    None => bail!("{}: ConfigMap {} has no key {}", e.name, r.name, r.key),
                }
            } else {
                bail!("{}: a valueFrom this reader does not resolve", e.name);
            }
        } else {
            String::new()
        };
        env.push((e.name, value));
    }
    let mut args: Vec<String> = c.command.unwrap_or_default();
    args.extend(c.args.unwrap_or_default());
    let args = args.iter().map(|a| expand(a, &env)).collect();
    let sa = pod
        .spec
        .as_ref()
        .and_then(|s| s.service_account_name.clone())
        .unwrap_or_else(|| "default".into());
    let req: TokenRequest = serde_json::from_value(serde_json::json!({
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {
            "audiences": [],
            "expirationSeconds": 3600,
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod",
                               "name": pod.metadata.name, "uid": pod.metadata.uid},
        },
    }))?;
    let got: TokenRequest = Api::<ServiceAccount>::namespaced(client.clone(), ns)
        .create_subresource("token", &sa, &PostParams::default(), &req)
        .await
        .with_context(|| format!("a token for ServiceAccount {ns}/{sa}"))?;
    let token = got.status.context("TokenRequest without status")?.token;
    Ok(Installed {
        pod,
        args,
        env,
        token,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_read_with_their_marks_and_lines() {
        let page = "## 1. A\n\n<!-- test: not run: builds images -->\n```sh\ndocker build .\n```\n\n\
                    ```sh\nkubectl create namespace lastcall\n```\n  <!-- test: server dry-run -->\n  ```yaml\n  kind: X\n  ```\n\
                    ## 2. B\n<!-- test: after section 1 -->\n```bash\nhelm upgrade x\n```\n```text\nout\n```\n";
        let b = blocks("p.md", page).unwrap();
        assert_eq!(b.len(), 5, "{b:?}");
        assert_eq!(b[0].mark, Mark::Skip("builds images".into()));
        assert_eq!((b[1].mark.clone(), b[1].line), (Mark::Run, 9));
        assert!(b[1].fresh_install() && !b[0].fresh_install());
        assert_eq!(
            (b[2].mark.clone(), b[2].body.as_str()),
            (Mark::ServerDryRun, "kind: X\n")
        );
        assert_eq!(b[3].mark, Mark::After("1".into()));
        assert_eq!(b[3].section_number(), Some("2"));
        assert!(matches!(b[4].mark, Mark::Skip(_)));
    }

    #[test]
    fn env_references_expand_as_the_kubelet_does() {
        let vars = vec![("P".to_string(), "s3cr$t".to_string())];
        assert_eq!(
            expand("redis://:$(P)@h:6379", &vars),
            "redis://:s3cr$t@h:6379"
        );
        assert_eq!(expand("$(Q)-$$(P)-$", &vars), "$(Q)-$(P)-$");
    }

    #[test]
    fn a_mark_cannot_hide_a_helm_or_kubectl_command() {
        let page = "<!-- test: not run: no -->\n```sh\nkubectl apply -f x\n```\n";
        let e = blocks("p.md", page).unwrap_err().to_string();
        assert!(e.contains("every helm and kubectl command must run"), "{e}");
        assert!(blocks("p.md", "```console\n$ ls\n```\n").is_err());
        assert!(blocks("p.md", "<!-- test: sometimes -->\n```sh\nls\n```\n").is_err());
    }
}
