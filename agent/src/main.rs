//! `lastcall-agent`: one per game-server node (DaemonSet).
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use lastcall_agent::config::Config;
use lastcall_agent::run::{Overrides, run};
use tokio_util::sync::CancellationToken;

fn main() -> ExitCode {
    // Bad flags exit 2 here with a one-line error naming the flag.
    let config = match Config::try_parse() {
        Ok(c) => c,
        Err(e) => return ExitCode::from(lastcall_common::cli::report_parse_error(&e)),
    };
    if let Err(e) = lastcall_common::telemetry::init(&config.log_level) {
        eprintln!("lastcall-agent: {e}");
        return ExitCode::from(2);
    }
    // One thread: the agent's work is a few requests per drain, and every worker thread costs
    // resident memory (its stack, its malloc arena) on each of thousands of nodes.
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("lastcall-agent: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async {
        let shutdown = CancellationToken::new();
        let _signals = lastcall_common::shutdown::install(shutdown.clone())?;
        if config.cleanup_cooperation {
            return lastcall_agent::run::cleanup_cooperation(&config, None)
                .await
                .map(drop);
        }
        run(config, Overrides::default(), shutdown).await
    });
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(message = "lastcall-agent failed", error = format!("{e:#}"));
            ExitCode::FAILURE
        }
    }
}
