//! When a failed watch is tried again: kube's jittered exponential backoff (0.8 s doubling
//! to 30 s, reset by any event), except that a watch answered 410 Gone lists again at once.
//!
//! A 410 says the server is up and no longer holds the history the watch resumed from; the
//! next request is the LIST that re-syncs, and it has to be made anyway. Waiting the
//! backoff first only lengthens the time the agent acts on an old view of its node: after
//! an API server restart the backoff has grown to its cap while the server was down, so the
//! wait after the 410 came on top of the wait before it (measured with 2,000 agents: the
//! last re-list 108 s after a 30 s outage ended). The 410s themselves arrive spread by the
//! jitter of the retries that met them, so listing at once adds no burst. One prompt re-list
//! per watch per [`PROMPT_RELIST_EVERY`] at most: a server that answered 410 to every fresh
//! list would otherwise hold the agent in a tight loop of LISTs.

use std::pin::Pin;
use std::time::Duration;

use futures::{Stream, StreamExt};
use kube::runtime::utils::Backoff;
use kube::runtime::watcher::{self, DefaultBackoff};
use tokio::time::Instant;

/// The shortest time between two re-lists of one watch made without a backoff.
pub const PROMPT_RELIST_EVERY: Duration = Duration::from_secs(60);

/// Whether a watch error may be followed at once by the next request (the decision alone,
/// apart from the stream it paces).
#[derive(Debug, Default)]
pub struct Pacing {
    last_prompt: Option<Instant>,
}

impl Pacing {
    /// `true` for a 410 when no other prompt re-list was made in the last
    /// [`PROMPT_RELIST_EVERY`]; it is then recorded as made.
    pub fn prompt(&mut self, gone: bool, now: Instant) -> bool {
        if !gone
            || self
                .last_prompt
                .is_some_and(|t| now.duration_since(t) < PROMPT_RELIST_EVERY)
        {
            return false;
        }
        self.last_prompt = Some(now);
        true
    }
}

/// The watcher's "history gone, list again" error: a watch answered 410 Gone (`Expired`).
pub fn is_gone(e: &watcher::Error) -> bool {
    matches!(e, watcher::Error::WatchError(s) if s.code == 410)
}

type Item<K> = Result<watcher::Event<K>, watcher::Error>;

struct State<S> {
    stream: Pin<Box<S>>,
    backoff: DefaultBackoff,
    pacing: Pacing,
    /// The wait before the next request, decided when the last error was seen.
    wait: Option<Duration>,
    given_up: bool,
}

/// `stream` retried after errors as [`kube::runtime::WatchStreamExt::default_backoff`]
/// does (each error is passed on at once, then the next poll waits the backoff; any event
/// resets it), but with no wait after a 410 that [`Pacing`] lets through.
pub fn paced<S, K>(stream: S) -> impl Stream<Item = Item<K>> + Send
where
    S: Stream<Item = Item<K>> + Send + 'static,
    K: Send + 'static,
{
    let state = State {
        stream: Box::pin(stream),
        backoff: DefaultBackoff::default(),
        pacing: Pacing::default(),
        wait: None,
        given_up: false,
    };
    futures::stream::unfold(state, |mut st| async move {
        if st.given_up {
            return None;
        }
        if let Some(d) = st.wait.take() {
            tokio::time::sleep(d).await;
        }
        let item = st.stream.next().await?;
        match &item {
            Ok(_) => st.backoff.reset(),
            Err(e) if st.pacing.prompt(is_gone(e), Instant::now()) => {}
            Err(_) => match st.backoff.next() {
                Some(d) => st.wait = Some(d),
                None => st.given_up = true,
            },
        }
        Some((item, st))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::Status;

    fn gone() -> watcher::Error {
        watcher::Error::WatchError(
            Status::failure("too old resource version", "Expired")
                .with_code(410)
                .boxed(),
        )
    }

    fn unavailable() -> watcher::Error {
        watcher::Error::WatchError(
            Status::failure("the server is restarting", "ServiceUnavailable")
                .with_code(503)
                .boxed(),
        )
    }

    #[test]
    fn only_a_410_is_prompt_and_only_once_a_minute() {
        let t0 = Instant::now();
        let mut p = Pacing::default();
        assert!(!p.prompt(false, t0), "a 503 waits the backoff");
        assert!(p.prompt(true, t0), "the first 410 lists at once");
        assert!(
            !p.prompt(true, t0 + Duration::from_secs(59)),
            "a second 410 within a minute waits"
        );
        assert!(
            p.prompt(true, t0 + PROMPT_RELIST_EVERY),
            "a minute later, at once again"
        );
    }

    /// Polls `errors` through [`paced`] and returns the (paused) time each item arrived.
    async fn arrivals(errors: Vec<watcher::Error>) -> Vec<Duration> {
        let items: Vec<Item<()>> = errors.into_iter().map(Err).collect();
        let mut s = std::pin::pin!(paced(futures::stream::iter(items)));
        let t0 = Instant::now();
        let mut at = vec![];
        while s.next().await.is_some() {
            at.push(t0.elapsed());
        }
        at
    }

    #[tokio::test(start_paused = true)]
    async fn the_request_after_a_410_is_not_delayed() {
        let at = arrivals(vec![unavailable(), unavailable(), gone(), unavailable()]).await;
        assert_eq!(at.len(), 4);
        // kube's backoff: at least 0.8 s, then at least 1.6 s.
        assert!(at[1] >= Duration::from_millis(800), "{at:?}");
        assert!(at[2] - at[1] >= Duration::from_millis(1600), "{at:?}");
        assert_eq!(at[3], at[2], "the next request waited after a 410: {at:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_410_after_a_prompt_relist_waits_the_backoff() {
        let at = arrivals(vec![gone(), gone(), gone()]).await;
        assert_eq!(at[1], at[0], "{at:?}");
        assert!(
            at[2] - at[1] >= Duration::from_millis(800),
            "two prompt re-lists in a row: {at:?}"
        );
    }
}
