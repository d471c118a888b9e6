//! A Kubernetes API emulator that the real `kube::Client` talks to over HTTP.
//!
//! It serves the API paths, JSON and `Status` errors of a real API server for the types
//! lastcall touches (see [`resources`]), with the semantics lastcall depends on:
//! cluster-wide resourceVersions and 409 conflicts, delete preconditions, finalizers and
//! pod grace periods, merge and JSON patches, resumable watches with 410 Gone and
//! selector transitions, field and label selectors, the eviction subresource with
//! PodDisruptionBudget checks, the main/`/status` split, 422 validation and the
//! DefaultTolerationSeconds admission (see [`validation`]). It keeps no scheduler,
//! kubelet or controllers: the cluster model in `crate::cluster` drives those through
//! [`Store`]. Every request is journaled, and faults can be injected (failures, delays,
//! hangs, late watch delivery). `docs/testing/kube-emulator.md` lists what is and is not
//! implemented.

pub mod admin;
pub mod apf;
pub mod discovery;
pub mod eviction;
pub mod fanout;
pub mod faults;
pub mod journal;
pub mod patch;
pub mod resources;
pub mod selectors;
pub mod server;
pub mod status;
pub mod store;
pub mod validation;
pub mod watch;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use apf::{Apf, ApfConfig, ApfStats};
pub use faults::{FaultAction, FaultRule, Faults, Method, WatchDelay, WatchKey};
pub use journal::{Journal, JournalEntry, Traffic, Verb};
pub use resources::ResourceType;
pub use status::ApiError;
pub use store::{DeleteOptions, EventKind, Part, Store, StoreEvent, Txn};

use server::ServerState;

/// Watch events kept for resumption by [`Emulator::start`]. Small on purpose, as a real
/// watch cache is: clients that fall further behind relist after a 410.
pub const DEFAULT_HISTORY: usize = 10_000;

/// Default interval between BOOKMARK events on watches that allow them.
pub const DEFAULT_BOOKMARK_INTERVAL: Duration = Duration::from_secs(10);

/// Tunables of a server.
#[derive(Clone, Debug)]
pub struct Options {
    pub bookmark_interval: Duration,
    /// Serve the journal endpoints and the restart endpoint of [`admin`] (for an emulator in
    /// its own process).
    pub admin: bool,
    /// API Priority and Fairness from the start (see [`apf`]); `None`: off until
    /// [`Emulator::apf`] enables it.
    pub apf: Option<ApfConfig>,
    /// The GameServer CRD declares `status.state` and `status.nodeName` selectable, as
    /// Agones 1.58 and later install it; off: an older Agones (only labels select).
    pub agones_selectable_fields: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            bookmark_interval: DEFAULT_BOOKMARK_INTERVAL,
            admin: false,
            apf: None,
            agones_selectable_fields: false,
        }
    }
}

/// A running emulator: an HTTP server on 127.0.0.1 over a [`Store`].
pub struct Emulator {
    state: Arc<ServerState>,
    addr: SocketAddr,
    stop: CancellationToken,
    task: JoinHandle<()>,
    /// Stops the watch fan-out task when the emulator goes.
    _fanout: tokio_util::sync::DropGuard,
}

impl Emulator {
    /// A fresh store on `127.0.0.1:0`.
    pub async fn start() -> anyhow::Result<Emulator> {
        Self::start_with(
            Store::new(DEFAULT_HISTORY),
            SocketAddr::from(([127, 0, 0, 1], 0)),
        )
        .await
    }

    /// Serves `store` on `addr`.
    pub async fn start_with(store: Store, addr: SocketAddr) -> anyhow::Result<Emulator> {
        Self::start_with_options(store, addr, Options::default()).await
    }

    pub async fn start_with_options(
        store: Store,
        addr: SocketAddr,
        options: Options,
    ) -> anyhow::Result<Emulator> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding the Kubernetes API emulator to {addr}"))?;
        let addr = listener.local_addr()?;
        let fanout_stop = CancellationToken::new();
        let fanout = fanout::Fanout::start(&store, fanout_stop.clone());
        let apf = Apf::default();
        if let Some(c) = options.apf {
            apf.enable(c);
        }
        let state = Arc::new(ServerState {
            store,
            journal: Journal::default(),
            faults: Faults::default(),
            watches: Mutex::new(CancellationToken::new()),
            bookmark_interval: options.bookmark_interval,
            addr,
            fanout,
            apf,
            agones_selectable_fields: options.agones_selectable_fields.into(),
            down_until: Mutex::new(None),
        });
        let mut app = axum::Router::new();
        if options.admin {
            app = admin::routes(app);
        }
        let app = app.fallback(server::handle).with_state(state.clone());
        let (stop, task) = crate::net::serve(listener, app, "the Kubernetes API emulator");
        Ok(Emulator {
            state,
            addr,
            stop,
            task,
            _fanout: fanout_stop.drop_guard(),
        })
    }

    pub fn store(&self) -> &Store {
        &self.state.store
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A client with identity `"test"`.
    pub async fn client(&self) -> anyhow::Result<::kube::Client> {
        self.client_as("test").await
    }

    /// A client whose bearer token, and so journaled identity, is `identity`.
    ///
    /// It has kube's defaults, including the built-in retry of 429, 503 and 504 answers
    /// (up to 15 times with exponential backoff), exactly as a production client built
    /// from a kubeconfig would.
    pub async fn client_as(&self, identity: &str) -> anyhow::Result<::kube::Client> {
        Ok(::kube::Client::try_from(self.config_for(identity).await?)?)
    }

    /// Like [`Emulator::client_as`], without kube's automatic retry, so callers see 429
    /// (e.g. an eviction blocked by a PDB) and 503/504 answers at once.
    pub async fn client_no_retry(&self, identity: &str) -> anyhow::Result<::kube::Client> {
        let mut config = self.config_for(identity).await?;
        config.default_retry = false;
        Ok(::kube::Client::try_from(config)?)
    }

    /// The client config for `identity`, for code that builds its own client from it (the
    /// agent does, exactly as in production).
    pub async fn config_for(&self, identity: &str) -> anyhow::Result<::kube::Config> {
        config_for_url(&self.url(), identity).await
    }

    /// A kubeconfig for this server (token = `identity`, namespace `default`).
    pub fn kubeconfig_yaml(&self, identity: &str) -> String {
        kubeconfig_yaml(&self.url(), identity)
    }

    /// Writes the kubeconfig atomically (temporary file, then rename), so a process
    /// waiting for the file never reads half of it.
    pub fn write_kubeconfig(&self, path: &Path, identity: &str) -> std::io::Result<()> {
        let tmp = path.with_extension("tmp-lastcall");
        std::fs::write(&tmp, self.kubeconfig_yaml(identity))?;
        std::fs::rename(&tmp, path)
    }

    pub fn journal(&self) -> &Journal {
        &self.state.journal
    }

    pub fn faults(&self) -> &Faults {
        &self.state.faults
    }

    /// Installs (or removes) the GameServer CRD's selectable fields, as an Agones upgrade
    /// (or a reinstall without `gameservers.selectableFields`) would; open watches go on.
    pub fn set_agones_selectable_fields(&self, on: bool) {
        self.state
            .agones_selectable_fields
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// API Priority and Fairness: off by default; [`Apf::enable`] turns it on.
    pub fn apf(&self) -> &Apf {
        &self.state.apf
    }

    /// Ends every open watch stream now (clients see the stream close and re-watch).
    pub fn drop_watches(&self) {
        self.state.drop_watches();
    }

    /// Restarts the API server as its clients see it: every open watch ends, every request
    /// is answered 503 for `down`, and the watch history is gone, so a watch resumed from
    /// before answers 410 and its client lists again. The store keeps every object.
    /// Returns the resourceVersion the new watch cache starts at: a watch from it or later
    /// resumes without listing.
    pub fn restart(&self, down: Duration) -> u64 {
        self.state.restart(down)
    }

    /// Ends open watches and stops the server, waiting for in-flight requests.
    pub async fn shutdown(self) {
        self.state.drop_watches();
        self.stop.cancel();
        if let Err(e) = self.task.await {
            tracing::error!(error = %e, "Kubernetes API emulator task failed");
        }
    }
}

/// A kubeconfig for the server at `url` (token = `identity`, namespace `default`).
pub fn kubeconfig_yaml(url: &str, identity: &str) -> String {
    // JSON strings are valid YAML scalars, so quoting needs no YAML library.
    let q = |s: &str| serde_json::Value::String(s.to_string()).to_string();
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: lastcall-emulator\n  cluster:\n    server: {server}\ncontexts:\n- name: lastcall-emulator\n  context:\n    cluster: lastcall-emulator\n    user: {user}\n    namespace: default\ncurrent-context: lastcall-emulator\nusers:\n- name: {user}\n  user:\n    token: {user}\n",
        server = q(url),
        user = q(identity),
    )
}

/// The client config for `identity` on the server at `url` (an emulator in another process).
pub async fn config_for_url(url: &str, identity: &str) -> anyhow::Result<::kube::Config> {
    let kubeconfig = ::kube::config::Kubeconfig::from_yaml(&kubeconfig_yaml(url, identity))?;
    Ok(::kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &::kube::config::KubeConfigOptions::default(),
    )
    .await?)
}
