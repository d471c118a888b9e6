//! An incoming-webhook receiver (what Slack's incoming webhooks and Teams' Workflows accept
//! as a URL): records every POST in arrival order, and answers as the test sets it, well,
//! with a status (429, 500), or never.
//!
//! The URL carries a token in its path, as real webhook URLs do, so a test can check the
//! token never reaches a log.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use tokio_util::sync::CancellationToken;

use crate::net::serve;

/// How the receiver answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// 200 with Slack's `ok` body.
    Ok,
    /// This status, with a short body.
    Status(u16),
    /// Accept the request and never answer (the client must time out).
    Hang,
}

/// One POST as received.
#[derive(Clone, Debug)]
pub struct Received {
    pub path: String,
    pub content_type: Option<String>,
    pub body: String,
    /// The body as JSON, when it is.
    pub json: Option<serde_json::Value>,
}

#[derive(Default)]
struct Inner {
    answer: Option<Answer>,
    received: Vec<Received>,
}

/// A receiver on 127.0.0.1, serving until dropped.
pub struct WebhookReceiver {
    addr: SocketAddr,
    token: String,
    inner: Arc<Mutex<Inner>>,
    stop: CancellationToken,
}

impl WebhookReceiver {
    pub async fn start() -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let inner = Arc::new(Mutex::new(Inner::default()));
        let app = Router::new()
            .route("/{*path}", post(receive))
            .with_state(inner.clone());
        let (stop, _task) = serve(listener, app, "webhook receiver");
        let token = format!("T0LASTCALL/B0TEST/{:016x}", rand::random::<u64>());
        Ok(Self {
            addr,
            token,
            inner,
            stop,
        })
    }

    /// The webhook URL, token included (a secret, like a real one).
    pub fn url(&self) -> String {
        format!("http://{}/services/{}", self.addr, self.token)
    }

    /// The secret part of [`Self::url`].
    pub fn token(&self) -> &str {
        &self.token
    }

    pub fn answer(&self, a: Answer) {
        self.lock().answer = Some(a);
    }

    /// Every POST so far, in arrival order.
    pub fn received(&self) -> Vec<Received> {
        self.lock().received.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for WebhookReceiver {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A URL on 127.0.0.1 where nothing listens: connections are refused.
pub fn refusing_url() -> String {
    let port = crate::net::free_port();
    format!("http://127.0.0.1:{port}/services/T0REFUSED/B0TEST/nobody-listens")
}

async fn receive(
    State(inner): State<Arc<Mutex<Inner>>>,
    axum::extract::Path(path): axum::extract::Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, String) {
    let body = String::from_utf8_lossy(&body).into_owned();
    let answer = {
        let mut g = inner.lock().unwrap_or_else(|p| p.into_inner());
        g.received.push(Received {
            path: format!("/{path}"),
            content_type: headers
                .get(axum::http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .map(String::from),
            json: serde_json::from_str(&body).ok(),
            body,
        });
        g.answer.unwrap_or(Answer::Ok)
    };
    match answer {
        Answer::Ok => (StatusCode::OK, "ok".into()),
        Answer::Status(s) => (
            StatusCode::from_u16(s).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            "receiver_error".into(),
        ),
        Answer::Hang => {
            std::future::pending::<()>().await;
            (StatusCode::OK, String::new())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn records_posts_in_order_and_answers_as_set() {
        let r = WebhookReceiver::start().await.expect("receiver");
        let http = reqwest::Client::new();
        let a = http
            .post(r.url())
            .header("content-type", "application/json")
            .body(r#"{"text":"one"}"#)
            .send()
            .await
            .expect("post");
        assert_eq!(a.status(), 200);
        r.answer(Answer::Status(503));
        let b = http.post(r.url()).body("two").send().await.expect("post");
        assert_eq!(b.status(), 503);
        let got = r.received();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].json, Some(serde_json::json!({"text": "one"})));
        assert_eq!(got[0].content_type.as_deref(), Some("application/json"));
        assert!(got[0].path.ends_with(r.token()), "{}", got[0].path);
        assert_eq!((got[1].body.as_str(), got[1].json.is_none()), ("two", true));
        assert!(http.post(refusing_url()).send().await.is_err());
    }
}
