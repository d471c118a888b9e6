//! The scale world's Redis: one private `redis-server`, or a Redis Cluster
//! (`LASTCALL_SCALE_REDIS_CLUSTER=<primaries>x<replicas>`), written to as pubsub writes
//! (the cluster's tagged key names, through a cluster connection) and read node by node
//! (`INFO` of every node, summed, and the busiest).

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Context as _;
use lastcall_common::redis_conn::{AnyConn, any_client, connect_any};
use lastcall_common::redis_url::{InstanceKeys, RedisTarget};

use crate::redis::{RedisCluster, RedisServer};

/// The world's Redis.
pub enum ScaleRedis {
    One(Box<RedisServer>),
    Cluster(RedisCluster),
}

/// `INFO all` of each node, as numbers.
#[derive(Clone, Debug, Default)]
pub struct RedisInfo {
    pub nodes: Vec<(u16, HashMap<String, f64>)>,
}

impl RedisInfo {
    /// `key` summed over the nodes.
    pub fn sum(&self, key: &str) -> f64 {
        self.nodes
            .iter()
            .map(|(_, i)| i.get(key).copied().unwrap_or(0.0))
            .sum()
    }

    /// The largest `key` of one node.
    pub fn max(&self, key: &str) -> f64 {
        self.nodes
            .iter()
            .map(|(_, i)| i.get(key).copied().unwrap_or(0.0))
            .fold(0.0, f64::max)
    }

    /// CPU seconds (user + sys), summed over the nodes.
    pub fn cpu(&self) -> f64 {
        self.sum("used_cpu_user") + self.sum("used_cpu_sys")
    }

    /// Each node's CPU seconds since `earlier`, largest first.
    pub fn cpu_by_node_since(&self, earlier: &RedisInfo) -> Vec<(u16, f64)> {
        let cpu = |i: &HashMap<String, f64>| {
            i.get("used_cpu_user").copied().unwrap_or(0.0)
                + i.get("used_cpu_sys").copied().unwrap_or(0.0)
        };
        let mut out: Vec<(u16, f64)> = self
            .nodes
            .iter()
            .map(|(port, now)| {
                let before = earlier
                    .nodes
                    .iter()
                    .find(|(p, _)| p == port)
                    .map_or(0.0, |(_, i)| cpu(i));
                (*port, cpu(now) - before)
            })
            .collect();
        out.sort_by(|a, b| b.1.total_cmp(&a.1));
        out
    }
}

/// `"<primaries>x<replicas>"`, e.g. `3x1`.
pub fn parse_cluster(s: &str) -> Option<(usize, usize)> {
    let (p, r) = s.split_once('x')?;
    let p: usize = p.trim().parse().ok()?;
    let r: usize = r.trim().parse().ok()?;
    (p >= 3).then_some((p, r))
}

async fn node_info(port: u16) -> anyhow::Result<HashMap<String, f64>> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}"))?;
    let mut conn = lastcall_common::redis_conn::connect(&client, Duration::from_secs(30)).await?;
    let text: String = redis::cmd("INFO").arg("all").query_async(&mut conn).await?;
    Ok(text
        .lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(':')?;
            Some((k.to_string(), v.trim().parse().ok()?))
        })
        .collect())
}

impl ScaleRedis {
    /// One redis-server, or a cluster of `primaries` with `replicas` each.
    pub async fn start(cluster: Option<(usize, usize)>) -> anyhow::Result<ScaleRedis> {
        Ok(match cluster {
            None => ScaleRedis::One(Box::new(RedisServer::start().await?)),
            Some((p, r)) => ScaleRedis::Cluster(
                RedisCluster::start(p, r)
                    .await
                    .context("starting the Redis Cluster")?,
            ),
        })
    }

    /// What the agents are given: the server's URL, or every node of the cluster (the
    /// first named first), as a chart user lists them.
    pub fn url(&self) -> String {
        match self {
            ScaleRedis::One(r) => r.url(),
            ScaleRedis::Cluster(c) => c.url_through(&c.ports()),
        }
    }

    pub fn describe(&self) -> String {
        match self {
            ScaleRedis::One(_) => "one redis-server".into(),
            ScaleRedis::Cluster(c) => format!("a Redis Cluster of {} nodes", c.ports().len()),
        }
    }

    /// The names pubsub writes an instance's keys under.
    pub fn keys(&self) -> InstanceKeys {
        RedisTarget::parse(&self.url())
            .map(|t| t.keys())
            .unwrap_or_default()
    }

    /// A connection for the harness's writes, as pubsub's: single-node, or a cluster
    /// connection that follows the slot map; 30 s timeouts, so a loaded machine slows the
    /// harness down instead of failing it.
    pub async fn conn(&self) -> anyhow::Result<AnyConn> {
        let target = RedisTarget::parse(&self.url()).map_err(|e| anyhow::anyhow!("{e}"))?;
        let client = any_client(&target, None)?;
        Ok(connect_any(&client, Duration::from_secs(30)).await?)
    }

    /// `INFO` of every node still running.
    pub async fn info(&self) -> anyhow::Result<RedisInfo> {
        let ports = match self {
            ScaleRedis::One(r) => vec![r.port()],
            ScaleRedis::Cluster(c) => c.live_ports(),
        };
        let mut nodes = vec![];
        for p in ports {
            nodes.push((p, node_info(p).await?));
        }
        Ok(RedisInfo { nodes })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_shapes() {
        assert_eq!(parse_cluster("3x1"), Some((3, 1)));
        assert_eq!(parse_cluster("4x0"), Some((4, 0)));
        assert_eq!(parse_cluster("2x1"), None, "a cluster needs 3 primaries");
        assert_eq!(parse_cluster("x1"), None);
        assert_eq!(parse_cluster("3"), None);
    }
}
