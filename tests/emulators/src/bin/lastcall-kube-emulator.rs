//! Runs the Kubernetes API emulator as a process, for demos and for testing components
//! as real binaries: `lastcall-kube-emulator --listen 127.0.0.1:0 --kubeconfig-out FILE`.
//!
//! Prints the server URL on stdout, writes a kubeconfig pointing at it, and serves until
//! SIGTERM or SIGINT, then exits 0.
//!
//! For scale runs: `--preload-nodes N --preload-servers-per-node M` writes a store-only
//! world (`lastcall_emulators::cluster::preload`) before serving, and `--admin` serves the
//! journal at `/_emulator/traffic` and `/_emulator/journal` (`kube::admin`), so the
//! harness measures its agents in one process and the emulator's cost in this one, and
//! `POST /_emulator/restart?down_ms=N`, so it can restart the API server under them.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;
use lastcall_emulators::cluster::preload::{Preload, preload};
use lastcall_emulators::kube::{ApfConfig, DEFAULT_HISTORY, Emulator, Options, Store};
use tokio::signal::unix::{SignalKind, signal};

#[derive(Parser, Debug)]
#[command(about = "Kubernetes API emulator for lastcall tests")]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Where to write a kubeconfig for the server.
    #[arg(long)]
    kubeconfig_out: Option<PathBuf>,
    /// Bearer token (identity) written into the kubeconfig.
    #[arg(long, default_value = "lastcall")]
    identity: String,
    /// Watch events kept for resumption.
    #[arg(long, default_value_t = DEFAULT_HISTORY)]
    history: usize,
    /// Seconds between BOOKMARK events on watches that allow them (a real API server
    /// sends one about every minute).
    #[arg(long, default_value_t = 10)]
    bookmark_interval_secs: u64,
    /// Serve the journal endpoints and the restart under `/_emulator/`.
    #[arg(long)]
    admin: bool,
    /// Store-only nodes to create before serving.
    #[arg(long, default_value_t = 0)]
    preload_nodes: usize,
    /// GameServers (each with its Running pod) per preloaded node.
    #[arg(long, default_value_t = 0)]
    preload_servers_per_node: usize,
    /// Of those, how many are Allocated (the rest are Ready).
    #[arg(long, default_value_t = 0)]
    preload_allocated_per_node: usize,
    /// API Priority and Fairness: requests served at once over all users (0: APF off).
    #[arg(long, default_value_t = 0)]
    apf_concurrency: usize,
    /// APF: requests admitted per second over all users (0: no rate limit).
    #[arg(long, default_value_t = 0.0)]
    apf_rate: f64,
    /// APF: requests one user may have waiting; one more is refused at once.
    #[arg(long, default_value_t = 50)]
    apf_queue_per_flow: usize,
    /// APF: the `Retry-After` of every refusal, in seconds.
    #[arg(long, default_value_t = 1)]
    apf_retry_after_secs: u64,
    /// The GameServer CRD declares `status.nodeName` and `status.state` selectable
    /// (Agones 1.58 and later); without it only labels select GameServers.
    #[arg(long)]
    agones_selectable_fields: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let store = Store::new(args.history);
    if args.preload_nodes > 0 {
        preload(
            &store,
            &Preload {
                nodes: args.preload_nodes,
                servers_per_node: args.preload_servers_per_node,
                allocated_per_node: args.preload_allocated_per_node,
            },
        )
        .map_err(|e| anyhow::anyhow!("preloading the store: {e}"))?;
    }
    let options = Options {
        admin: args.admin,
        bookmark_interval: std::time::Duration::from_secs(args.bookmark_interval_secs.max(1)),
        apf: (args.apf_concurrency > 0).then(|| ApfConfig {
            concurrency: args.apf_concurrency,
            rate: (args.apf_rate > 0.0).then_some(args.apf_rate),
            burst: (args.apf_rate.ceil() as usize).max(1),
            queue_per_flow: args.apf_queue_per_flow,
            retry_after_secs: args.apf_retry_after_secs.max(1),
            ..ApfConfig::default()
        }),
        agones_selectable_fields: args.agones_selectable_fields,
    };
    let emulator = Emulator::start_with_options(store, args.listen, options).await?;
    if let Some(path) = &args.kubeconfig_out {
        emulator
            .write_kubeconfig(path, &args.identity)
            .with_context(|| format!("writing the kubeconfig to {}", path.display()))?;
    }
    println!("{}", emulator.url());
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    emulator.shutdown().await;
    Ok(())
}
