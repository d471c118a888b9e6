//! `REDIS_URL` with one meaning for every lastcall process.
//!
//! The original adapter took `host[:port][/db]` (optionally `user:pass@host`) and prefixed
//! `redis://`; operators also expect full `redis://` and `rediss://` (TLS) URLs. All of those
//! are accepted here and validated at start, so a typo fails the process with a clear message
//! instead of a reconnect loop.

use std::fmt;

use redis::IntoConnectionInfo;

/// A validated Redis endpoint.
#[derive(Clone)]
pub struct RedisTarget {
    url: String,
}

#[derive(Debug, thiserror::Error)]
pub enum RedisUrlError {
    #[error("empty Redis URL")]
    Empty,
    #[error("unsupported scheme {0:?}: use host[:port], redis:// or rediss://")]
    Scheme(String),
    #[error("invalid Redis URL: {0}")]
    Invalid(String),
}

impl RedisTarget {
    /// Accepts `host`, `host:port`, `host:port/db`, `user:pass@host:port`, `redis://…` and
    /// `rediss://…`.
    pub fn parse(raw: &str) -> Result<Self, RedisUrlError> {
        let raw = raw.trim();
        if raw.is_empty() {
            return Err(RedisUrlError::Empty);
        }
        let url = match raw.split_once("://") {
            Some(("redis" | "rediss", _)) => raw.to_string(),
            Some((scheme, _)) => return Err(RedisUrlError::Scheme(scheme.to_string())),
            None => format!("redis://{raw}"),
        };
        let parsed = url::Url::parse(&url).map_err(|e| RedisUrlError::Invalid(e.to_string()))?;
        if parsed.host_str().is_none_or(str::is_empty) {
            return Err(RedisUrlError::Invalid("missing host".into()));
        }
        url.as_str()
            .into_connection_info()
            .map_err(|e| RedisUrlError::Invalid(e.to_string()))?;
        Ok(Self { url })
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
                f.write_str(u.as_str())
            }
            Err(_) => f.write_str("<invalid>"),
        }
    }
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
