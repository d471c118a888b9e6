//! The box: a real Kubernetes control plane on 127.0.0.1 for end-to-end tests of the real
//! `lastcall-agent` process.
//!
//! [`KubeBox::start`] runs etcd, kube-apiserver (RBAC and the default admission plugins, its
//! own PKI, an audit log of every write to Nodes, Pods and GameServers),
//! kube-controller-manager (garbage collector, disruption controller, ServiceAccount tokens,
//! each controller with its own credentials), kube-scheduler and kwok (which plays the
//! kubelets of the nodes a test creates), each on a free port, and waits for each one's
//! health endpoint. There is no Agones: [`agones`] plays its part against the API server.
//! [`agent`] runs the agent with the chart's arguments and RBAC. [`proxy`] puts faults
//! between the agent and the API server; [`KubeBox::restart_apiserver`] kills the API server
//! and starts it again.
//!
//! One box serves a whole test binary ([`lease`]); tests take turns (the GameServer CRD is
//! cluster-wide and some tests change it) and keep to their own namespace and node names.

pub mod agent;
pub mod agones;
pub mod audit;
pub mod fleetiq;
pub mod install;
pub mod pki;
pub mod procs;
pub mod proxy;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::net::try_free_port;
use pki::Pki;
use procs::Group;

/// How long each component gets to report healthy.
const READY_WITHIN: Duration = Duration::from_secs(120);
/// Pause between health probes.
const PROBE_EVERY: Duration = Duration::from_millis(100);
/// The static admin token (group `system:masters`) the test and the control plane use.
const ADMIN_TOKEN: &str = "lastcall-box-admin-token";
/// kwok's own token, so its writes (pod and node status, final pod deletions) have a user
/// of their own in the audit log.
const KWOK_TOKEN: &str = "lastcall-box-kwok-token";
/// kwok's user name.
pub const KWOK_USER: &str = "kwok";
/// The user of the tests' own writes (the operator, the tests' set-up).
pub const ADMIN_USER: &str = "box-admin";
/// The Agones GameServer controller's user ([`agones::Agones::on_box`]).
pub const AGONES_USER: &str = "agones-controller";
/// The Agones allocator's user.
pub const ALLOCATOR_USER: &str = "agones-allocator";
/// The user of the games' SDK calls (Agones' SDK sidecar).
pub const SDK_USER: &str = "agones-sdk";
/// Users of the box with a static token each (group `system:masters`): the token is
/// `lastcall-box-<user>-token`.
const STATIC_USERS: [&str; 3] = [AGONES_USER, ALLOCATOR_USER, SDK_USER];

fn static_token(user: &str) -> String {
    format!("lastcall-box-{user}-token")
}
/// The garbage collector's user (`--use-service-account-credentials`).
pub const GC_USER: &str = "system:serviceaccount:kube-system:generic-garbage-collector";

/// A running control plane. Dropping it kills every process (see [`procs`]).
pub struct KubeBox {
    group: std::sync::Mutex<Group>,
    dir: tempfile::TempDir,
    api_port: u16,
    pki: Pki,
    started_in: Duration,
    bin: PathBuf,
}

impl std::fmt::Debug for KubeBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeBox")
            .field("dir", &self.dir.path())
            .field("api_port", &self.api_port)
            .finish()
    }
}

/// The directory holding the box's binaries: `LASTCALL_BOX_BIN`, else the last line
/// `hack/box/build.sh` prints (it builds them once into a cache).
pub fn bin_dir() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("LASTCALL_BOX_BIN") {
        return Ok(PathBuf::from(dir));
    }
    let package = crate::paths::package_dir();
    let root = package.parent().context("the workspace root")?;
    let script = root.join("hack/box/build.sh");
    if !script.is_file() {
        bail!(
            "no LASTCALL_BOX_BIN and no {}: the box needs etcd, kube-apiserver, \
             kube-controller-manager, kube-scheduler and kwok",
            script.display()
        );
    }
    let out = std::process::Command::new("bash")
        .arg(&script)
        .current_dir(root)
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !out.status.success() {
        bail!("{} failed ({})", script.display(), out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let last = text
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .context("hack/box/build.sh printed nothing")?;
    Ok(PathBuf::from(last.trim()))
}

impl KubeBox {
    /// Starts the control plane and waits until every component is healthy. A port picked
    /// free can be taken by another process before its component binds it (on a busy
    /// machine, by an outgoing connection's ephemeral port): then the whole box starts again
    /// on fresh ports, up to three times.
    pub async fn start() -> anyhow::Result<KubeBox> {
        let mut attempt = 1;
        loop {
            match Self::start_once().await {
                Err(e) if attempt < 3 && format!("{e:#}").contains("address already in use") => {
                    eprintln!(
                        "box: a port was taken before its component bound it; starting again ({e})"
                    );
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    async fn start_once() -> anyhow::Result<KubeBox> {
        let bin = tokio::task::spawn_blocking(bin_dir).await??;
        for b in [
            "etcd",
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler",
            "kwok",
        ] {
            if !bin.join(b).is_file() {
                bail!("{} missing from {}", b, bin.display());
            }
        }
        let stages = bin.join("../share/kwok-stages.yaml");
        if !stages.is_file() {
            bail!(
                "{} missing (hack/box/build.sh puts it there)",
                stages.display()
            );
        }
        let dir = tempfile::Builder::new()
            .prefix("lastcall-box-")
            .tempdir()
            .context("creating the box's temp dir")?;
        let began = Instant::now();
        let pki = Pki::generate(dir.path())?;
        let root = dir.path().to_path_buf();
        let d = |f: &str| root.join(f).to_string_lossy().into_owned();
        let mut tokens = format!(
            "{ADMIN_TOKEN},box-admin,box-admin,\"system:masters\"\n\
             {KWOK_TOKEN},{KWOK_USER},{KWOK_USER},\"system:masters\"\n"
        );
        for user in STATIC_USERS {
            tokens.push_str(&format!(
                "{},{user},{user},\"system:masters\"\n",
                static_token(user)
            ));
        }
        std::fs::write(dir.path().join("tokens.csv"), tokens)?;
        std::fs::write(dir.path().join("kwok-stages.yaml"), kwok_stages(&stages)?)?;
        std::fs::write(dir.path().join("audit-policy.yaml"), audit::POLICY)?;
        let [etcd, peer, api, kcm, sched, kwok] = [(); 6].map(|()| try_free_port());
        let (etcd, peer, api, kcm, sched, kwok) = (etcd?, peer?, api?, kcm?, sched?, kwok?);
        std::fs::write(
            dir.path().join("admin.kubeconfig"),
            kubeconfig(
                &format!("https://127.0.0.1:{api}"),
                &pki.ca_pem,
                ADMIN_TOKEN,
                "box-admin",
            ),
        )?;
        std::fs::write(
            dir.path().join("kwok.kubeconfig"),
            kubeconfig(
                &format!("https://127.0.0.1:{api}"),
                &pki.ca_pem,
                KWOK_TOKEN,
                KWOK_USER,
            ),
        )?;
        std::fs::write(dir.path().join("kwok-debug.yaml"), kwok_debug(dir.path())?)?;
        let mut group = Group::new(dir.path())?;
        group.spawn(
            "etcd",
            &bin.join("etcd"),
            &[
                "--name=box".into(),
                format!("--data-dir={}", d("etcd-data")),
                format!("--listen-client-urls=http://127.0.0.1:{etcd}"),
                format!("--advertise-client-urls=http://127.0.0.1:{etcd}"),
                format!("--listen-peer-urls=http://127.0.0.1:{peer}"),
                format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer}"),
                format!("--initial-cluster=box=http://127.0.0.1:{peer}"),
                "--unsafe-no-fsync".into(),
                "--log-level=warn".into(),
            ],
        )?;
        // The API server, controller-manager and scheduler all serve the box's certificate.
        let http = reqwest::Client::builder()
            .add_root_certificate(reqwest::Certificate::from_pem(&std::fs::read(
                &pki.ca_pem,
            )?)?)
            .timeout(Duration::from_secs(5))
            .build()?;
        let mut kbox = KubeBox {
            group: std::sync::Mutex::new(group),
            dir,
            api_port: api,
            pki: pki.clone(),
            started_in: Duration::ZERO,
            bin: bin.clone(),
        };
        kbox.wait_http("etcd", &http, &format!("http://127.0.0.1:{etcd}/health"))
            .await?;
        let admin = d("admin.kubeconfig");
        kbox.spawn(
            "kube-apiserver",
            vec![
                format!("--etcd-servers=http://127.0.0.1:{etcd}"),
                "--bind-address=127.0.0.1".into(),
                "--advertise-address=127.0.0.1".into(),
                format!("--secure-port={api}"),
                format!("--cert-dir={}", d("apiserver-certs")),
                format!("--tls-cert-file={}", pki.server_pem.display()),
                format!("--tls-private-key-file={}", pki.server_key.display()),
                format!("--client-ca-file={}", pki.ca_pem.display()),
                format!("--token-auth-file={}", d("tokens.csv")),
                "--authorization-mode=Node,RBAC".into(),
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
                format!("--service-account-key-file={}", pki.sa_pub.display()),
                format!(
                    "--service-account-signing-key-file={}",
                    pki.sa_key.display()
                ),
                "--service-cluster-ip-range=10.96.0.0/16".into(),
                "--endpoint-reconciler-type=none".into(),
                format!("--audit-policy-file={}", d("audit-policy.yaml")),
                format!("--audit-log-path={}", d("audit.log")),
                "--audit-log-mode=blocking".into(),
                "--audit-log-maxsize=0".into(),
                "--profiling=false".into(),
            ],
        )?;
        // /readyz is public (system:public-info-viewer).
        kbox.wait_http(
            "kube-apiserver",
            &http,
            &format!("https://127.0.0.1:{api}/readyz"),
        )
        .await?;
        kbox.spawn(
            "kube-controller-manager",
            vec![
                format!("--kubeconfig={admin}"),
                format!("--authentication-kubeconfig={admin}"),
                format!("--authorization-kubeconfig={admin}"),
                "--bind-address=127.0.0.1".into(),
                format!("--secure-port={kcm}"),
                format!("--tls-cert-file={}", pki.server_pem.display()),
                format!("--tls-private-key-file={}", pki.server_key.display()),
                "--leader-elect=false".into(),
                "--use-service-account-credentials=true".into(),
                format!(
                    "--service-account-private-key-file={}",
                    pki.sa_key.display()
                ),
                format!("--root-ca-file={}", pki.ca_pem.display()),
                "--controllers=*".into(),
                "--profiling=false".into(),
            ],
        )?;
        kbox.spawn(
            "kube-scheduler",
            vec![
                format!("--kubeconfig={admin}"),
                format!("--authentication-kubeconfig={admin}"),
                format!("--authorization-kubeconfig={admin}"),
                "--bind-address=127.0.0.1".into(),
                format!("--secure-port={sched}"),
                format!("--tls-cert-file={}", pki.server_pem.display()),
                format!("--tls-private-key-file={}", pki.server_key.display()),
                "--leader-elect=false".into(),
                "--profiling=false".into(),
            ],
        )?;
        kbox.spawn(
            "kwok",
            vec![
                format!("--kubeconfig={}", d("kwok.kubeconfig")),
                // kwok does nothing without stages: the release's "fast" ones, which
                // build.sh puts beside the binaries, with a kubelet's pod deletion
                // ([`kwok_stages`]).
                format!("--config={}", d("kwok-stages.yaml")),
                // `kubectl logs` / `exec` in the lastcall namespace ([`kwok_debug`]): the
                // API server reaches kwok as the nodes' kubelet on its own port.
                format!("--config={}", d("kwok-debug.yaml")),
                format!("--node-port={kwok}"),
                "--manage-all-nodes=false".into(),
                format!("--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake"),
                "--node-lease-duration-seconds=40".into(),
                format!("--server-address=127.0.0.1:{kwok}"),
                "--cidr=10.244.0.0/16".into(),
                "--node-ip=127.0.0.1".into(),
            ],
        )?;
        kbox.wait_http(
            "kube-controller-manager",
            &http,
            &format!("https://127.0.0.1:{kcm}/healthz"),
        )
        .await?;
        kbox.wait_http(
            "kube-scheduler",
            &http,
            &format!("https://127.0.0.1:{sched}/healthz"),
        )
        .await?;
        kbox.wait_http("kwok", &http, &format!("http://127.0.0.1:{kwok}/healthz"))
            .await?;
        kbox.started_in = began.elapsed();
        Ok(kbox)
    }

    fn spawn(&self, name: &str, args: Vec<String>) -> anyhow::Result<()> {
        self.lock().spawn(name, &self.bin.join(name), &args)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Group> {
        self.group.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An error naming the component and the log tails if any process has exited.
    fn check_alive(&self) -> anyhow::Result<()> {
        let mut g = self.lock();
        if let Some((name, status)) = g.exited() {
            bail!("{name} exited ({status}); logs:\n{}", g.tails(40));
        }
        Ok(())
    }

    async fn wait_http(&self, what: &str, http: &reqwest::Client, url: &str) -> anyhow::Result<()> {
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            self.check_alive()?;
            if let Ok(r) = http.get(url).send().await
                && r.status().is_success()
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "{what} not healthy at {url} within {READY_WITHIN:?}; logs:\n{}",
                    self.tails(40)
                );
            }
            tokio::time::sleep(PROBE_EVERY).await;
        }
    }

    /// From the first process started to the last one healthy (PKI generation included).
    pub fn started_in(&self) -> Duration {
        self.started_in
    }

    /// Kills kube-apiserver with SIGKILL, leaves it down for `down`, starts it again on the
    /// same port with the same flags (etcd keeps the state; the audit log goes on) and waits
    /// until `/readyz` answers. Returns how long that took after the start.
    pub async fn restart_apiserver(&self, down: Duration) -> anyhow::Result<Duration> {
        let status = self.lock().kill("kube-apiserver")?;
        tokio::time::sleep(down).await;
        self.lock().respawn("kube-apiserver")?;
        let began = Instant::now();
        let http = reqwest::Client::builder()
            .add_root_certificate(reqwest::Certificate::from_pem(&std::fs::read(
                &self.pki.ca_pem,
            )?)?)
            .timeout(Duration::from_secs(5))
            .build()?;
        self.wait_http(
            "kube-apiserver (restarted)",
            &http,
            &format!("{}/readyz", self.server()),
        )
        .await
        .with_context(|| format!("after SIGKILL ({status})"))?;
        Ok(began.elapsed())
    }

    /// A [`proxy::FaultProxy`] in front of this API server, serving the box's certificate.
    pub async fn fault_proxy(&self) -> anyhow::Result<proxy::FaultProxy> {
        proxy::FaultProxy::start(
            std::net::SocketAddr::from(([127, 0, 0, 1], self.api_port)),
            &self.pki.ca_pem,
            &self.pki.server_pem,
            &self.pki.server_key,
        )
        .await
    }

    /// `https://127.0.0.1:<port>`.
    pub fn server(&self) -> String {
        format!("https://127.0.0.1:{}", self.api_port)
    }

    pub fn ca_pem(&self) -> &Path {
        &self.pki.ca_pem
    }

    /// The box's directory (logs, PKI, the audit log).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The file kwok serves as the logs of the `lastcall` namespace's `container`
    /// containers (`agent`, `pubsub`, `redis`), in the CRI log format.
    pub fn pod_log(&self, container: &str) -> PathBuf {
        self.dir
            .path()
            .join("pod-logs")
            .join(format!("{container}.log"))
    }

    /// Where `kubectl exec` into a `redis` container of the `lastcall` namespace runs; its
    /// `bin/` is first on that command's PATH.
    pub fn redis_exec_dir(&self) -> PathBuf {
        self.dir.path().join("pod-exec/redis")
    }

    pub fn audit_log(&self) -> PathBuf {
        self.dir.path().join("audit.log")
    }

    /// Every request the audit policy records, so far.
    pub fn audit(&self) -> Vec<audit::Entry> {
        audit::read(&self.audit_log())
    }

    /// A kubeconfig for `token` (user name `user`) against this box.
    pub fn kubeconfig(&self, token: &str, user: &str) -> String {
        self.kubeconfig_at(&self.server(), token, user)
    }

    /// A kubeconfig for `token` against `server` (this box's API server, or a proxy in
    /// front of it serving the box's certificate).
    pub fn kubeconfig_at(&self, server: &str, token: &str, user: &str) -> String {
        kubeconfig(server, &self.pki.ca_pem, token, user)
    }

    /// The admin's client config (group `system:masters`).
    pub async fn admin_config(&self) -> anyhow::Result<kube::Config> {
        config_from(&self.kubeconfig(ADMIN_TOKEN, "box-admin")).await
    }

    /// A client as the admin. Build one per test: a client belongs to the runtime that made it.
    pub async fn client(&self) -> anyhow::Result<kube::Client> {
        Ok(kube::Client::try_from(self.admin_config().await?)?)
    }

    /// A client as `user`, one of [`AGONES_USER`], [`ALLOCATOR_USER`], [`SDK_USER`].
    pub async fn client_as(&self, user: &str) -> anyhow::Result<kube::Client> {
        anyhow::ensure!(STATIC_USERS.contains(&user), "no token for {user}");
        let config = config_from(&self.kubeconfig(&static_token(user), user)).await?;
        Ok(kube::Client::try_from(config)?)
    }

    /// The last `lines` of every process's log.
    pub fn tails(&self, lines: usize) -> String {
        self.lock().tails(lines)
    }
}

/// The `REDIS_PASSWORD` a command run by `kubectl exec` into a `redis` container sees: kwok's
/// exec environment is fixed when the box starts, before any test creates a Redis password
/// Secret, so a test's Redis accepts this password beside the Secret's.
pub const EXEC_REDIS_PASSWORD: &str = "lastcall-box-exec-redis-password";

/// kwok's answers to `kubectl logs` and `kubectl exec` for pods of the `lastcall` namespace,
/// whose containers run nowhere: the logs of a container named `agent`, `pubsub` or `redis`
/// are the CRI-format file [`KubeBox::pod_log`] (a test writes there what the host process
/// playing that container printed), and `exec` into `redis` runs the command on the host in
/// `pod-exec/redis`, with `pod-exec/redis/bin` first on PATH (where a test puts what reaches
/// the Redis it started) and [`EXEC_REDIS_PASSWORD`] as `REDIS_PASSWORD`.
fn kwok_debug(dir: &Path) -> anyhow::Result<String> {
    let mut logs = String::new();
    for c in ["agent", "pubsub", "redis"] {
        let f = dir.join("pod-logs").join(format!("{c}.log"));
        std::fs::create_dir_all(dir.join("pod-logs"))?;
        std::fs::write(&f, "")?;
        logs.push_str(&format!(
            "    - containers: [{c}]\n      logsFile: {}\n",
            f.display()
        ));
    }
    let exec = dir.join("pod-exec/redis");
    std::fs::create_dir_all(exec.join("bin"))?;
    Ok(format!(
        "apiVersion: kwok.x-k8s.io/v1alpha1\nkind: ClusterLogs\nmetadata:\n  name: box-logs\nspec:\n  \
         selector:\n    matchNamespaces: [lastcall]\n  logs:\n{logs}---\n\
         apiVersion: kwok.x-k8s.io/v1alpha1\nkind: ClusterExec\nmetadata:\n  name: box-exec\nspec:\n  \
         selector:\n    matchNamespaces: [lastcall]\n  execs:\n    - containers: [redis]\n      \
         local:\n        workDir: {exec}\n        envs:\n          - name: PATH\n            \
         value: {exec}/bin:/usr/bin:/bin\n          - name: REDIS_PASSWORD\n            \
         value: {EXEC_REDIS_PASSWORD}\n",
        exec = exec.display()
    ))
}

/// kwok's stages for the box: the release's "fast" ones (`stages`, from `hack/box/build.sh`)
/// but their pod deletion, which removes a deleted pod at once, whatever its grace period.
/// In its place, a kubelet's: a pod whose containers have all ended (phase `Succeeded` or
/// `Failed`) goes at once; any other stays terminating until its `deletionTimestamp` (the
/// request's time plus its grace period: the game was sent `TERM` and uses all of it), as
/// kwok's own "general" pod-delete stage delays by that timestamp.
fn kwok_stages(stages: &Path) -> anyhow::Result<String> {
    let text =
        std::fs::read_to_string(stages).with_context(|| format!("reading {}", stages.display()))?;
    let mut kept: Vec<&str> = text
        .split("\n---")
        .filter(|doc| !doc.trim().is_empty() && !doc.contains("name: pod-delete\n"))
        .collect();
    anyhow::ensure!(
        kept.len() + 1 == text.split("\n---").filter(|d| !d.trim().is_empty()).count(),
        "no pod-delete stage to replace in {}",
        stages.display()
    );
    kept.push(KUBELET_POD_DELETE);
    Ok(kept
        .iter()
        .map(|d| format!("---\n{}\n", d.trim_start_matches('-').trim()))
        .collect())
}

const KUBELET_POD_DELETE: &str = r#"apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-delete-exited
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'Exists'
    - key: '.status.phase'
      operator: 'In'
      values: ['Succeeded', 'Failed']
  next:
    delete: true
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-delete-after-grace
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'Exists'
    - key: '.status.phase'
      operator: 'NotIn'
      values: ['Succeeded', 'Failed']
  delay:
    durationMilliseconds: 0
    durationFrom:
      expressionFrom: '.metadata.deletionTimestamp'
  next:
    delete: true"#;

/// kwok manages only the nodes carrying this annotation (value `fake`).
pub const KWOK_ANNOTATION: &str = "kwok.x-k8s.io/node";

/// A kube client config from kubeconfig text.
pub async fn config_from(yaml: &str) -> anyhow::Result<kube::Config> {
    let kc = Kubeconfig::from_yaml(yaml)?;
    Ok(kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?)
}

fn kubeconfig(server: &str, ca: &Path, token: &str, user: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: box\n  cluster:\n    server: {server}\n    certificate-authority: {ca}\nusers:\n- name: {user}\n  user:\n    token: {token}\ncontexts:\n- name: box\n  context:\n    cluster: box\n    user: {user}\ncurrent-context: box\n",
        ca = ca.display()
    )
}

static SHARED: tokio::sync::OnceCell<KubeBox> = tokio::sync::OnceCell::const_new();
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A test's turn on the shared box. On a panic (a failing test) it prints the tails of the
/// control plane's logs.
pub struct Lease {
    pub kbox: &'static KubeBox,
    _turn: tokio::sync::MutexGuard<'static, ()>,
}

impl std::ops::Deref for Lease {
    type Target = KubeBox;
    fn deref(&self) -> &KubeBox {
        self.kbox
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "---- the box's logs (dir {}) ----\n{}",
                self.kbox.dir().display(),
                self.kbox.tails(30)
            );
        }
    }
}

/// The test binary's box, started on first use, and this test's turn on it.
///
/// # Panics
/// If the box cannot start (missing binaries, a component that never gets healthy).
pub async fn lease() -> Lease {
    let turn = TURN.lock().await;
    let kbox = SHARED
        .get_or_try_init(KubeBox::start)
        .await
        .unwrap_or_else(|e| panic!("starting the box: {e:#}"));
    Lease { kbox, _turn: turn }
}

/// Creates a Node that kwok plays the kubelet of (labelled as the chart's agent
/// `nodeSelector` expects, `role: game-servers`) and waits until it is Ready without the
/// not-ready taint, so the scheduler places pods on it.
pub async fn create_node(client: &kube::Client, name: &str) -> anyhow::Result<()> {
    use k8s_openapi::api::core::v1::Node;
    let node: Node = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                       "kubernetes.io/arch": "amd64", "role": "game-servers", "type": "kwok"},
            "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {},
    }))?;
    let api: kube::Api<Node> = kube::Api::all(client.clone());
    api.create(&kube::api::PostParams::default(), &node).await?;
    crate::eventually::try_eventually(
        &format!("node {name} Ready and untainted"),
        Duration::from_secs(60),
        Duration::from_millis(100),
        || async {
            let n = api.get(name).await.ok()?;
            let ready = n
                .status
                .as_ref()?
                .conditions
                .as_ref()?
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            let tainted = n
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .is_some_and(|t| !t.is_empty());
            (ready && !tainted).then_some(())
        },
    )
    .await?;
    Ok(())
}
