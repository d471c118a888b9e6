//! `lastcall-demo`: a simulated cluster with real lastcall processes, driven through one
//! FleetIQ drain. See `docs/demo.md`.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use lastcall_testkit::demo::{self, DemoError, Options};

#[derive(Parser, Debug)]
#[command(
    name = "lastcall-demo",
    about = "Runs lastcall locally: an emulated Kubernetes cluster with Agones, a GameLift \
             emulator and a private redis-server, with one real lastcall-agent process per node \
             and a real lastcall-pubsub; then GameLift drains node-a and the demo narrates what \
             lastcall does."
)]
struct Args {
    /// Also echo the processes' JSON logs to stdout, each line prefixed with its process
    /// name (they are always written to files in the log directory).
    #[arg(long)]
    verbose: bool,

    /// After the story, keep everything running until Ctrl-C, and print the kubeconfig
    /// path and the metrics URLs to poke at.
    #[arg(long)]
    keep_running: bool,

    /// Bound, in seconds, on each step's wait; a step not reached in time fails the demo
    /// (exit code 1).
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=3600))]
    timeout_secs: u64,

    /// Directory for the processes' logs, the kubeconfigs and the groups file. Default: a
    /// new directory under the system temp dir, kept after the demo.
    #[arg(long)]
    log_dir: Option<PathBuf>,

    /// Runs the drain on the box instead: a real kube-apiserver, etcd, controller manager,
    /// scheduler and kwok (built once from pinned Go modules by hack/box/build.sh, about 20
    /// minutes cold), with the real agent and pubsub processes. Slower to start; no Fleet
    /// controller there, so no replacements.
    #[arg(long = "box", conflicts_with_all = ["keep_running", "log_dir"])]
    on_box: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("lastcall-demo: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    if args.on_box {
        let result = rt.block_on(lastcall_testkit::demo_box::run(Duration::from_secs(
            args.timeout_secs,
        )));
        rt.shutdown_timeout(Duration::from_secs(1));
        return match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("DEMO FAILED: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    let result = rt.block_on(demo::run(Options {
        verbose: args.verbose,
        keep_running: args.keep_running,
        timeout: Duration::from_secs(args.timeout_secs),
        log_dir: args.log_dir,
    }));
    rt.shutdown_timeout(Duration::from_secs(1));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // 128 + SIGINT, as a shell reports an interrupted command.
        Err(DemoError::Interrupted(_)) => ExitCode::from(130),
        Err(_) => ExitCode::FAILURE,
    }
}
