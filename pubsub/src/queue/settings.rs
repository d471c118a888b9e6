//! Queue mode's flags, flattened into pubsub's `Config`.

use std::time::Duration;

use clap::Args;
use lastcall_common::duration::parse_duration;

/// SQS allows a visibility timeout of at most 12 hours.
const MAX_VISIBILITY: Duration = Duration::from_secs(43_200);

#[derive(Clone, Debug, Args)]
pub struct QueueFlags {
    /// URL of the SQS queue EventBridge delivers EC2 interruption events to
    /// (`https://sqs.<region>.amazonaws.com/<account>/<name>`). Set: queue mode is on, and
    /// `--redis-url` becomes optional (without it pubsub reads only the queue). Each event is
    /// relayed to the agent of its instance's Node, on the Node itself.
    #[arg(long, env = "LASTCALL_QUEUE_URL", value_parser = parse_queue_url)]
    pub queue_url: Option<String>,

    /// Receivers polling the queue at once, each taking up to 10 messages per long poll.
    #[arg(long, env = "LASTCALL_QUEUE_RECEIVERS", default_value_t = 4,
          value_parser = clap::value_parser!(u16).range(1..=64))]
    pub queue_receivers: u16,

    /// How long a received message stays hidden from other receivers; extended every half of
    /// it while the message is being handled, so a slow API server never makes it return
    /// mid-relay. A failed relay leaves it to come back after this.
    #[arg(long, env = "LASTCALL_QUEUE_VISIBILITY", default_value = "30s", value_parser = parse_visibility)]
    pub queue_visibility: Duration,

    /// Long-poll wait of one receive (0s to 20s, SQS's limit).
    #[arg(long, env = "LASTCALL_QUEUE_WAIT", default_value = "20s", value_parser = parse_wait)]
    pub queue_wait: Duration,

    /// How long after an event an instance with no Node yet is looked for again (a launch
    /// racing its own event) before the message is counted as unmanaged and deleted.
    #[arg(long, env = "LASTCALL_QUEUE_NODE_WAIT", default_value = "2m", value_parser = parse_duration)]
    pub queue_node_wait: Duration,

    /// SQS endpoint override (`http://` or `https://`), e.g. a VPC endpoint or a test server.
    #[arg(long, env = "AWS_ENDPOINT_URL_SQS", value_parser = parse_endpoint)]
    pub sqs_endpoint: Option<String>,
}

fn parse_queue_url(raw: &str) -> Result<String, String> {
    let url = url::Url::parse(raw).map_err(|e| format!("{raw:?} is not a URL: {e}"))?;
    if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none_or(str::is_empty) {
        return Err(format!("{raw:?} is not an http(s) URL of an SQS queue"));
    }
    let segments: Vec<&str> = url
        .path_segments()
        .map(Iterator::collect)
        .unwrap_or_default();
    if segments.len() != 2 || segments.iter().any(|s| s.is_empty()) {
        return Err(format!(
            "{raw:?} is not a queue URL (…/<account>/<queue-name>)"
        ));
    }
    Ok(raw.to_string())
}

fn parse_visibility(raw: &str) -> Result<Duration, String> {
    let d = parse_duration(raw)?;
    if d < Duration::from_secs(2) || d > MAX_VISIBILITY {
        return Err(format!("{raw} must be between 2s and 12h (SQS's limit)"));
    }
    Ok(d)
}

fn parse_wait(raw: &str) -> Result<Duration, String> {
    let d = parse_duration(raw)?;
    if d > Duration::from_secs(20) {
        return Err(format!("{raw} is above SQS's longest poll, 20s"));
    }
    Ok(d)
}

fn parse_endpoint(raw: &str) -> Result<String, String> {
    let url = url::Url::parse(raw).map_err(|e| format!("{raw:?} is not a URL: {e}"))?;
    if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none_or(str::is_empty) {
        return Err(format!("{raw:?} must be an http:// or https:// URL"));
    }
    Ok(raw.trim_end_matches('/').to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_urls_and_durations_are_checked() {
        assert!(
            parse_queue_url("https://sqs.us-east-2.amazonaws.com/123456789012/lastcall").is_ok()
        );
        assert!(parse_queue_url("http://127.0.0.1:5000/123456789012/q").is_ok());
        for bad in [
            "sqs.us-east-2.amazonaws.com/1/q",
            "ftp://h/1/q",
            "https://h/q",
            "https://h/1/q/x",
            "https://h/1/",
        ] {
            assert!(parse_queue_url(bad).is_err(), "{bad}");
        }
        assert!(parse_visibility("1s").is_err());
        assert!(parse_visibility("13h").is_err());
        assert!(parse_wait("21s").is_err());
        assert_eq!(parse_wait("0s"), Ok(Duration::ZERO));
    }
}
