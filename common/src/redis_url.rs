//! `REDIS_URL` with one meaning for every lastcall process.
//!
//! The original adapter took `host[:port][/db]` (optionally `user:pass@host`) and prefixed
//! `redis://`; operators also expect full `redis://` and `rediss://` (TLS) URLs. All of those
//! are accepted here and validated at start, so a typo fails the process with a clear message
//! instead of a reconnect loop.
//!
//! `redis+cluster://` and `rediss+cluster://` name a Redis Cluster (cluster-mode ElastiCache,
//! Memorystore Cluster, or your own) by one or more of its nodes, comma-separated
//! (`redis+cluster://user:pw@10.0.0.1:6379,10.0.0.2:6379`; the credentials and TLS apply to
//! all): the client learns the slot map from any of them and follows `MOVED`/`ASK`, and
//! remembers the other nodes it learned, so losing the node it started from loses nothing.
//! In cluster mode the keys of one instance carry
//! its id as a hash tag (`lastcall:status:{i-0123…}`), so they share a slot and one atomic
//! script can write them all ([`InstanceKeys`]).

use std::fmt;

use redis::IntoConnectionInfo;

/// A validated Redis endpoint.
#[derive(Clone)]
pub struct RedisTarget {
    /// A `redis://` or `rediss://` URL (the `+cluster` marker is kept in `cluster`): the
    /// first node named.
    url: String,
    cluster: bool,
    /// The other nodes a cluster URL names, as `host:port`, in order.
    more_seeds: Vec<String>,
}

/// Names of the keys pubsub writes and agents read for one instance. The default is the
/// single-node naming.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InstanceKeys {
    cluster: bool,
}

impl InstanceKeys {
    /// `{id}` in cluster mode (a hash tag: all of an instance's keys in one slot), the bare
    /// id otherwise (the names single-node deployments have always used).
    fn id(self, instance_id: &str) -> std::borrow::Cow<'_, str> {
        if self.cluster {
            format!("{{{instance_id}}}").into()
        } else {
            instance_id.into()
        }
    }

    /// The cached status (see `fleetiq::cache_key`).
    pub fn status(self, instance_id: &str) -> String {
        format!("lastcall:status:{}", self.id(instance_id))
    }

    /// When the cached status was polled (see `fleetiq::polled_at_key`).
    pub fn polled_at(self, instance_id: &str) -> String {
        format!("lastcall:polled_at:{}", self.id(instance_id))
    }

    /// Which pubsub process wrote the polled-at time.
    pub fn polled_by(self, instance_id: &str) -> String {
        format!("lastcall:polled_by:{}", self.id(instance_id))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RedisUrlError {
    #[error("empty Redis URL")]
    Empty,
    #[error(
        "unsupported scheme {0:?}: use host[:port], redis://, rediss://, redis+cluster:// or rediss+cluster://"
    )]
    Scheme(String),
    #[error("invalid Redis URL: {0}")]
    Invalid(String),
}

impl RedisTarget {
    /// Accepts `host`, `host:port`, `host:port/db`, `user:pass@host:port`, `redis://…`,
    /// `rediss://…`, and the cluster forms `redis+cluster://…` and `rediss+cluster://…`.
    pub fn parse(raw: &str) -> Result<Self, RedisUrlError> {
        let raw = raw.trim();
        if raw.is_empty() {
            return Err(RedisUrlError::Empty);
        }
        let (url, cluster) = match raw.split_once("://") {
            Some(("redis" | "rediss", _)) => (raw.to_string(), false),
            Some(("redis+cluster", rest)) => (format!("redis://{rest}"), true),
            Some(("rediss+cluster", rest)) => (format!("rediss://{rest}"), true),
            Some((scheme, _)) => return Err(RedisUrlError::Scheme(scheme.to_string())),
            None => (format!("redis://{raw}"), false),
        };
        let (url, more_seeds) = if cluster {
            split_seeds(&url)?
        } else {
            (url, Vec::new())
        };
        let parsed = url::Url::parse(&url).map_err(|e| RedisUrlError::Invalid(e.to_string()))?;
        if parsed.host_str().is_none_or(str::is_empty) {
            return Err(RedisUrlError::Invalid("missing host".into()));
        }
        url.as_str()
            .into_connection_info()
            .map_err(|e| RedisUrlError::Invalid(e.to_string()))?;
        if cluster && !parsed.path().trim_matches('/').is_empty() && parsed.path() != "/0" {
            return Err(RedisUrlError::Invalid(
                "a Redis Cluster has only database 0".into(),
            ));
        }
        let target = Self {
            url,
            cluster,
            more_seeds: Vec::new(),
        };
        for seed in &more_seeds {
            let (host, port) = seed
                .rsplit_once(':')
                .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
                .ok_or_else(|| {
                    RedisUrlError::Invalid(format!("{seed:?}: a further node needs host:port"))
                })?;
            target.node(host, port)?;
        }
        Ok(Self {
            more_seeds,
            ..target
        })
    }

    /// Every node the URL names, first one first, each as a single-node target with the
    /// URL's scheme, credentials and database.
    pub fn seeds(&self) -> Vec<RedisTarget> {
        let mut out = vec![Self {
            url: self.url.clone(),
            cluster: false,
            more_seeds: Vec::new(),
        }];
        for seed in &self.more_seeds {
            if let Some((host, port)) = seed
                .rsplit_once(':')
                .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
                && let Ok(t) = self.node(host, port)
            {
                out.push(t);
            }
        }
        out
    }

    /// The single node `host:port` with this URL's scheme, credentials and database: how a
    /// node learned from a cluster's topology is reached.
    pub fn node(&self, host: &str, port: u16) -> Result<RedisTarget, RedisUrlError> {
        let mut u =
            url::Url::parse(&self.url).map_err(|e| RedisUrlError::Invalid(e.to_string()))?;
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let host = if bare.contains(':') {
            format!("[{bare}]")
        } else {
            bare.to_string()
        };
        u.set_host(Some(&host))
            .map_err(|e| RedisUrlError::Invalid(format!("{host}: {e}")))?;
        u.set_port(Some(port))
            .map_err(|()| RedisUrlError::Invalid(format!("{host}: no port allowed")))?;
        let url = u.to_string();
        url.as_str()
            .into_connection_info()
            .map_err(|e| RedisUrlError::Invalid(e.to_string()))?;
        Ok(Self {
            url,
            cluster: false,
            more_seeds: Vec::new(),
        })
    }

    /// Whether this names a Redis Cluster (`redis+cluster://`, `rediss+cluster://`).
    pub fn is_cluster(&self) -> bool {
        self.cluster
    }

    /// The key names for instances on this target.
    pub fn keys(&self) -> InstanceKeys {
        InstanceKeys {
            cluster: self.cluster,
        }
    }

    /// The full URL, credentials included: for the client only, never for logs.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Whether the connection uses TLS.
    pub fn is_tls(&self) -> bool {
        self.url.starts_with("rediss://")
    }

    /// Opens a client for this target (no I/O yet).
    pub fn client(&self) -> redis::RedisResult<redis::Client> {
        redis::Client::open(self.url.as_str())
    }
}

impl fmt::Display for RedisTarget {
    /// The URL with any password replaced, safe for logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match url::Url::parse(&self.url) {
            Ok(mut u) => {
                if u.password().is_some() {
                    let _ = u.set_password(Some("REDACTED"));
                }
                let shown = u.as_str();
                match shown.split_once("://") {
                    Some((scheme, rest)) if self.cluster => {
                        // The further nodes go after the first one's host and port.
                        let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
                        let (authority, tail) = rest.split_at(authority_end);
                        write!(f, "{scheme}+cluster://{authority}")?;
                        for seed in &self.more_seeds {
                            write!(f, ",{seed}")?;
                        }
                        f.write_str(tail)
                    }
                    _ => f.write_str(shown),
                }
            }
            Err(_) => f.write_str("<invalid>"),
        }
    }
}

/// Splits `scheme://[userinfo@]host1[:port1],host2:port2,…[/db][?query]` into the URL of
/// the first node and the further `host:port`s.
fn split_seeds(url: &str) -> Result<(String, Vec<String>), RedisUrlError> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Ok((url.to_string(), Vec::new()));
    };
    let start = rest.rfind('@').map_or(0, |at| at + 1);
    let end = rest[start..]
        .find(['/', '?'])
        .map_or(rest.len(), |i| start + i);
    let mut hosts = rest[start..end].split(',').map(str::trim);
    let first = hosts.next().unwrap_or_default();
    let more: Vec<String> = hosts.map(str::to_string).collect();
    if more.iter().any(String::is_empty) {
        return Err(RedisUrlError::Invalid("an empty node in the list".into()));
    }
    Ok((
        format!("{scheme}://{}{first}{}", &rest[..start], &rest[end..]),
        more,
    ))
}

impl fmt::Debug for RedisTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RedisTarget({self})")
    }
}

impl std::str::FromStr for RedisTarget {
    type Err = RedisUrlError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_original_and_url_forms() {
        for (raw, url) in [
            ("redis-master", "redis://redis-master"),
            ("redis-master:6380", "redis://redis-master:6380"),
            ("10.0.0.5:6379/2", "redis://10.0.0.5:6379/2"),
            ("user:secret@cache:6379", "redis://user:secret@cache:6379"),
            ("redis://cache:6379", "redis://cache:6379"),
            (
                "rediss://default:pw@cache.example:6380/0",
                "rediss://default:pw@cache.example:6380/0",
            ),
        ] {
            let t = RedisTarget::parse(raw).unwrap_or_else(|e| panic!("{raw}: {e}"));
            assert_eq!(t.url(), url);
        }
        assert!(RedisTarget::parse("rediss://cache:6380").unwrap().is_tls());
        assert!(!RedisTarget::parse("cache").unwrap().is_tls());
    }

    #[test]
    fn cluster_urls_and_their_key_names() {
        let t = RedisTarget::parse("rediss+cluster://u:pw@cfg.cache.example:6379").unwrap();
        assert!(t.is_cluster() && t.is_tls());
        assert_eq!(t.url(), "rediss://u:pw@cfg.cache.example:6379");
        assert_eq!(
            t.to_string(),
            "rediss+cluster://u:REDACTED@cfg.cache.example:6379"
        );
        let keys = t.keys();
        assert_eq!(keys.status("i-1"), "lastcall:status:{i-1}");
        assert_eq!(keys.polled_at("i-1"), "lastcall:polled_at:{i-1}");
        assert_eq!(keys.polled_by("i-1"), "lastcall:polled_by:{i-1}");
        let single = RedisTarget::parse("cache:6379").unwrap();
        assert!(!single.is_cluster());
        assert_eq!(
            single.keys().status("i-1"),
            crate::fleetiq::cache_key("i-1"),
            "single-node names never change"
        );
        assert_eq!(
            single.keys().polled_at("i-1"),
            crate::fleetiq::polled_at_key("i-1")
        );
        assert!(RedisTarget::parse("redis+cluster://cache:6379/2").is_err());
    }

    #[test]
    fn a_cluster_url_may_name_several_nodes() {
        let t =
            RedisTarget::parse("rediss+cluster://u:pw@10.0.0.1:6379,10.0.0.2:6380, node-c:7000")
                .unwrap();
        let seeds: Vec<String> = t.seeds().iter().map(|s| s.url().to_string()).collect();
        assert_eq!(
            seeds,
            [
                "rediss://u:pw@10.0.0.1:6379",
                "rediss://u:pw@10.0.0.2:6380",
                "rediss://u:pw@node-c:7000"
            ]
        );
        assert!(t.seeds().iter().all(|s| !s.is_cluster()));
        assert_eq!(
            t.to_string(),
            "rediss+cluster://u:REDACTED@10.0.0.1:6379,10.0.0.2:6380,node-c:7000"
        );
        assert_eq!(t.url(), "rediss://u:pw@10.0.0.1:6379");
        let one = RedisTarget::parse("redis+cluster://cache:6379").unwrap();
        assert_eq!(one.seeds().len(), 1);
        assert_eq!(
            one.node("10.1.2.3", 7001).unwrap().url(),
            "redis://10.1.2.3:7001"
        );
        assert_eq!(
            t.node("::1", 7001).unwrap().url(),
            "rediss://u:pw@[::1]:7001"
        );
        for bad in [
            "redis+cluster://a:1,",
            "redis+cluster://a:1,b",
            "redis+cluster://a:1,b:notaport",
        ] {
            assert!(RedisTarget::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn rejects_bad_urls() {
        for raw in [
            "",
            "   ",
            "http://cache:6379",
            "cache:notaport",
            "redis://:6379",
        ] {
            assert!(
                RedisTarget::parse(raw).is_err(),
                "{raw:?} should be rejected"
            );
        }
    }

    #[test]
    fn display_redacts_password() {
        let t = RedisTarget::parse("rediss://user:hunter2@cache:6380").unwrap();
        let shown = t.to_string();
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("REDACTED"), "{shown}");
    }
}
