//! EC2 instance metadata (IMDSv2): the instance id.
//!
//! A session token is fetched with PUT and sent on every GET; a 401 means the token expired,
//! so it is refreshed once and the GET retried.

use std::time::Duration;

use reqwest::StatusCode;

const TOKEN_TTL_SECS: u32 = 21_600;

#[derive(Debug, thiserror::Error)]
pub enum ImdsError {
    #[error("instance metadata unreachable at {url}: {source}")]
    Unreachable { url: String, source: reqwest::Error },
    #[error("instance metadata answered {status} for {path}")]
    Status { path: String, status: StatusCode },
    #[error("instance metadata returned an empty {0}")]
    Empty(String),
}

pub struct Imds {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
}

impl Imds {
    pub fn new(base: &str) -> Self {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .connect_timeout(Duration::from_secs(1))
            .build()
            .unwrap_or_default();
        Self {
            http,
            base: base.trim_end_matches('/').to_string(),
            token: None,
        }
    }

    async fn fetch_token(&mut self) -> Result<String, ImdsError> {
        let url = format!("{}/latest/api/token", self.base);
        let resp = self
            .http
            .put(&url)
            .header(
                "X-aws-ec2-metadata-token-ttl-seconds",
                TOKEN_TTL_SECS.to_string(),
            )
            .send()
            .await
            .map_err(|source| ImdsError::Unreachable {
                url: url.clone(),
                source,
            })?;
        if !resp.status().is_success() {
            return Err(ImdsError::Status {
                path: "/latest/api/token".into(),
                status: resp.status(),
            });
        }
        let token = resp
            .text()
            .await
            .map_err(|source| ImdsError::Unreachable { url, source })?;
        self.token = Some(token.clone());
        Ok(token)
    }

    /// GETs a metadata path, e.g. `meta-data/instance-id`.
    pub async fn get(&mut self, path: &str) -> Result<String, ImdsError> {
        let url = format!("{}/latest/{}", self.base, path.trim_start_matches('/'));
        for attempt in 0..2 {
            let token = match (&self.token, attempt) {
                (Some(t), 0) => t.clone(),
                _ => self.fetch_token().await?,
            };
            let resp = self
                .http
                .get(&url)
                .header("X-aws-ec2-metadata-token", token)
                .send()
                .await
                .map_err(|source| ImdsError::Unreachable {
                    url: url.clone(),
                    source,
                })?;
            match resp.status() {
                StatusCode::UNAUTHORIZED if attempt == 0 => {
                    self.token = None;
                    continue;
                }
                s if s.is_success() => {
                    let body = resp.text().await.map_err(|source| ImdsError::Unreachable {
                        url: url.clone(),
                        source,
                    })?;
                    let body = body.trim().to_string();
                    if body.is_empty() {
                        return Err(ImdsError::Empty(path.to_string()));
                    }
                    return Ok(body);
                }
                status => {
                    return Err(ImdsError::Status {
                        path: path.to_string(),
                        status,
                    });
                }
            }
        }
        Err(ImdsError::Status {
            path: path.to_string(),
            status: StatusCode::UNAUTHORIZED,
        })
    }

    pub async fn instance_id(&mut self) -> Result<String, ImdsError> {
        self.get("meta-data/instance-id").await
    }
}
