//! Runs the Kubernetes API emulator as a process, for demos and for testing components
//! as real binaries: `lastcall-kube-emulator --listen 127.0.0.1:0 --kubeconfig-out FILE`.
//!
//! Prints the server URL on stdout, writes a kubeconfig pointing at it, and serves until
//! SIGTERM or SIGINT, then exits 0.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;
use lastcall_emulators::kube::{DEFAULT_HISTORY, Emulator, Store};
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
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let emulator = Emulator::start_with(Store::new(args.history), args.listen).await?;
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
