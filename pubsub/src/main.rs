//! The `lastcall-pubsub` binary: parse the config, start logging, run until SIGTERM.
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use lastcall_pubsub::Config;

#[tokio::main]
async fn main() -> ExitCode {
    let config = match Config::try_parse() {
        Ok(c) => c,
        Err(e) => return ExitCode::from(lastcall_common::cli::report_parse_error(&e)),
    };
    if let Err(e) = config.validate() {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    if let Err(e) = lastcall_common::telemetry::init(&config.log_level) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    match lastcall_pubsub::run::serve(config).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(message = "fatal", error = %e);
            ExitCode::FAILURE
        }
    }
}
