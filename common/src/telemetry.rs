//! JSON logs through `tracing`, one object per line on stdout.

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber. `level` is an `EnvFilter` directive such as `info` or
/// `lastcall_agent=debug,info`; `RUST_LOG` overrides it when set.
pub fn init(level: &str) -> Result<(), String> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(v) if !v.is_empty() => EnvFilter::try_new(v),
        _ => EnvFilter::try_new(level),
    }
    .map_err(|e| format!("invalid log filter: {e}"))?;
    tracing_subscriber::fmt()
        .json()
        .flatten_event(true)
        .with_current_span(false)
        .with_target(true)
        .with_env_filter(filter)
        .with_writer(std::io::stdout)
        .try_init()
        .map_err(|e| format!("installing the log subscriber: {e}"))
}

/// Validates a log filter at flag-parse time, so a typo exits 2 naming `--log-level`.
pub fn parse_level(raw: &str) -> Result<String, String> {
    EnvFilter::try_new(raw)
        .map(|_| raw.to_string())
        .map_err(|e| e.to_string())
}
