//! Running `lastcall-agent` in-process against the emulators, and reading its metrics.

use std::net::SocketAddr;

use clap::Parser;
use lastcall_agent::config::Config;
use lastcall_agent::run::{Overrides, run};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A config for node `node` listening on an ephemeral port, plus `extra` flags.
pub fn config(node: &str, extra: &[&str]) -> Config {
    let mut args = vec![
        "lastcall-agent",
        "--node-name",
        node,
        "--listen",
        "127.0.0.1:0",
    ];
    args.extend_from_slice(extra);
    Config::try_parse_from(args).unwrap_or_else(|e| panic!("bad test config: {e}"))
}

/// One agent task in this process.
pub struct InProcessAgent {
    pub admin: SocketAddr,
    /// Under `--dry-run`, the steps the agent narrated, in order.
    pub narration: lastcall_agent::dry_run::narration::Narration,
    shutdown: CancellationToken,
    handle: JoinHandle<anyhow::Result<()>>,
}

impl InProcessAgent {
    /// Starts an agent whose Kubernetes client is built from `kube` by the agent itself,
    /// exactly as the binary builds it (same retry settings).
    pub async fn start(
        config: Config,
        kube: kube::Config,
        gamelift: Option<aws_sdk_gamelift::Client>,
    ) -> anyhow::Result<Self> {
        Self::start_with_sources(config, kube, gamelift, vec![]).await
    }

    /// As [`Self::start`], with sources registered in-process after the built-in ones.
    pub async fn start_with_sources(
        config: Config,
        kube: kube::Config,
        gamelift: Option<aws_sdk_gamelift::Client>,
        sources: Vec<lastcall_agent::sources::Registered>,
    ) -> anyhow::Result<Self> {
        let shutdown = CancellationToken::new();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let narration = lastcall_agent::dry_run::narration::Narration::default();
        let overrides = Overrides {
            kube: Some(kube),
            gamelift,
            bound: Some(tx),
            sources,
            aws_credentials: Some(test_credentials()),
            narration: Some(narration.clone()),
        };
        let handle = tokio::spawn(run(config, overrides, shutdown.clone()));
        let admin = rx
            .await
            .map_err(|_| anyhow::anyhow!("agent exited before binding"))?;
        Ok(Self {
            admin,
            narration,
            shutdown,
            handle,
        })
    }

    pub async fn metrics(&self) -> String {
        scrape(self.admin).await
    }

    /// Stops the agent as SIGTERM would and returns its result.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        self.handle
            .await
            .map_err(|e| anyhow::anyhow!("agent task: {e}"))?
    }

    /// Stops the agent as SIGTERM would, and kills the task if it has not ended within
    /// `within` (a request that never comes back can hold a clean stop). `Ok(true)`: it
    /// ended by itself; `Ok(false)`: it had to be killed.
    pub async fn stop_within(self, within: std::time::Duration) -> anyhow::Result<bool> {
        self.shutdown.cancel();
        let mut handle = self.handle;
        match tokio::time::timeout(within, &mut handle).await {
            Ok(r) => r
                .map_err(|e| anyhow::anyhow!("agent task: {e}"))?
                .map(|()| true),
            Err(_) => {
                handle.abort();
                Ok(false)
            }
        }
    }

    /// The agent's result if it ends by itself within `within` (a supervised task ended);
    /// `None`: still running (then it is stopped).
    pub async fn ended_within(self, within: std::time::Duration) -> Option<anyhow::Result<()>> {
        let mut handle = self.handle;
        match tokio::time::timeout(within, &mut handle).await {
            Ok(r) => Some(
                r.map_err(|e| anyhow::anyhow!("agent task: {e}"))
                    .and_then(|r| r),
            ),
            Err(_) => {
                self.shutdown.cancel();
                let _ = handle.await;
                None
            }
        }
    }

    /// Waits until the agent has decided to select its GameServers `by` (`field` or
    /// `label`), as `lastcall_gameserver_selection` says.
    pub async fn selects_gameservers_by(&self, by: &str) {
        crate::eventually::wait_for(
            &format!("the agent selects GameServers by {by}"),
            || async {
                (metric(
                    &self.metrics().await,
                    "lastcall_gameserver_selection",
                    &[("by", by)],
                ) == Some(1.0))
                .then_some(())
            },
        )
        .await;
    }

    /// Kills the task without a clean shutdown (a crash).
    pub fn abort(self) {
        self.handle.abort();
    }

    /// Kills the task without a clean shutdown (a crash), and returns once it is gone: an
    /// abort only asks, and a task busy on another worker may still send a request or two.
    /// A test that changes the world "after the crash" waits for it here.
    pub async fn crash(self) {
        self.handle.abort();
        let _ = self.handle.await;
    }

    /// Aborts the agent from elsewhere (a machine going down under an agent that a rollout
    /// is stopping).
    pub fn abort_handle(&self) -> tokio::task::AbortHandle {
        self.handle.abort_handle()
    }
}

/// The static credentials in-process agents sign AWS requests with (the emulators check
/// that a request is signed, not by whom).
pub fn test_credentials() -> aws_sdk_autoscaling::config::Credentials {
    aws_sdk_autoscaling::config::Credentials::new(
        "AKIDLASTCALLTEST",
        "lastcall-test-secret",
        None,
        None,
        "lastcall-testkit",
    )
}

/// GETs `/metrics` from an admin listener.
pub async fn scrape(addr: SocketAddr) -> String {
    match reqwest::get(format!("http://{addr}/metrics")).await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// The value of the sample `name{labels}` in Prometheus/OpenMetrics text, if present.
/// `labels` must all match; other labels on the sample are ignored.
pub fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (n, rest) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            if n != name {
                return None;
            }
            let all = labels
                .iter()
                .all(|(k, v)| rest.split(',').any(|kv| kv == format!("{k}=\"{v}\"")));
            if all { value.parse().ok() } else { None }
        })
}

/// Sum of every sample of `name` whose labels include `labels`.
pub fn metric_sum(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (n, rest) = series.split_once('{').unwrap_or((series, ""));
            let rest = rest.trim_end_matches('}');
            (n == name
                && labels
                    .iter()
                    .all(|(k, v)| rest.split(',').any(|kv| kv == format!("{k}=\"{v}\""))))
            .then(|| value.parse::<f64>().ok())
            .flatten()
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_lookup() {
        let text = "# HELP x y\nlastcall_releases_total{result=\"ok\"} 3\nlastcall_releases_total{result=\"conflict\"} 1\nlastcall_redis_connected 1\n";
        assert_eq!(
            metric(text, "lastcall_releases_total", &[("result", "ok")]),
            Some(3.0)
        );
        assert_eq!(metric(text, "lastcall_redis_connected", &[]), Some(1.0));
        assert_eq!(metric(text, "lastcall_missing", &[]), None);
        assert_eq!(metric_sum(text, "lastcall_releases_total", &[]), 4.0);
    }
}
