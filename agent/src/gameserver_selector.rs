//! How the agent finds its node's GameServers.
//!
//! Agones 1.58 and later declare `status.nodeName` a selectable field of the GameServer CRD
//! (Kubernetes 1.31 and later serve it), so the agent's watch can select
//! `status.nodeName=<node>` and never write anything to see a server. Older Agones, older
//! Kubernetes, or an Agones installed with the field removed leave only labels: the agent
//! then labels each GameServer whose pod it sees (`lastcall.dev/node`, one merge patch in
//! the server's life) and watches that label. `--gameserver-selector auto` asks the API
//! server once at start which one it serves.
//!
//! Deciding is pure ([`decide`]); the probe is one `LIST ...?fieldSelector=...&limit=1`.

use std::time::Duration;

use kube::api::{Api, DynamicObject, ListParams};
use kube::runtime::watcher;
use lastcall_common::backoff::Backoff;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::keys;
use crate::metrics::{Metrics, SourceLabel};
use crate::observed::gameserver_resource;

/// The GameServer field that names its node (Agones sets it when the pod is bound).
pub const NODE_FIELD: &str = "status.nodeName";

/// `--gameserver-selector`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Selector {
    /// Ask the API server at start: the field where it is served, else the label.
    #[default]
    Auto,
    /// Watch by `status.nodeName`; start-up fails if the API server does not serve it.
    Field,
    /// Label every GameServer seen on the node and watch the label.
    Label,
}

/// What the agent uses, once decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Selection {
    Field,
    Label,
}

impl Selection {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Field => "field",
            Self::Label => "label",
        }
    }

    /// Whether a server becomes visible only once the agent labels it.
    pub fn claims(self) -> bool {
        self == Self::Label
    }

    /// The selector of this node's GameServers.
    pub fn watch_config(self, node_name: &str) -> watcher::Config {
        match self {
            Self::Field => watcher::Config::default().fields(&field_selector(node_name)),
            Self::Label => watcher::Config::default().labels(&format!(
                "{}={}",
                keys::LABEL_NODE,
                keys::node_label_value(node_name)
            )),
        }
    }
}

fn field_selector(node_name: &str) -> String {
    format!("{NODE_FIELD}={node_name}")
}

/// What the probe heard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Probe {
    /// The list was served: the field is selectable.
    Served,
    /// 400: the API server does not know the field (the CRD does not declare it, or
    /// Kubernetes predates custom resource field selectors).
    Refused(String),
    /// Anything else (unreachable, 5xx, 403, 404: no GameServer CRD yet): no answer.
    Failed(String),
}

/// What to do with a probe's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    Use(Selection),
    /// Ask again after a back-off: a failure is no answer, and never a reason to pick.
    Retry,
    /// `--gameserver-selector field` on a server that refuses it.
    Fail(String),
}

/// Whether to probe at all: only `auto` and `field` ask.
pub fn without_probe(flag: Selector) -> Option<Selection> {
    (flag == Selector::Label).then_some(Selection::Label)
}

pub fn decide(flag: Selector, probe: &Probe) -> Decision {
    match (flag, probe) {
        (Selector::Label, _) => Decision::Use(Selection::Label),
        (_, Probe::Served) => Decision::Use(Selection::Field),
        (Selector::Auto, Probe::Refused(_)) => Decision::Use(Selection::Label),
        (Selector::Field, Probe::Refused(why)) => Decision::Fail(format!(
            "--gameserver-selector field: the API server does not select GameServers by {NODE_FIELD} \
             ({why}); it needs Agones 1.58 or later (gameservers.selectableFields) on Kubernetes \
             1.31 or later, or --gameserver-selector auto or label"
        )),
        (_, Probe::Failed(_)) => Decision::Retry,
    }
}

/// Whether a watch error says the field is no longer served (Agones reinstalled without
/// it): the watch can never list again, so the agent must decide anew.
pub fn field_withdrawn(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s)) => s.code == 400,
        _ => false,
    }
}

async fn probe(client: &kube::Client, node_name: &str) -> Probe {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &gameserver_resource());
    let params = ListParams::default()
        .fields(&field_selector(node_name))
        .limit(1);
    match api.list_metadata(&params).await {
        Ok(_) => Probe::Served,
        Err(kube::Error::Api(s)) if s.code == 400 => Probe::Refused(s.message.clone()),
        Err(e) => Probe::Failed(e.to_string()),
    }
}

/// Decides how to select this node's GameServers, asking the API server until it answers.
/// `None` on shutdown; `Some(Err)` when `--gameserver-selector field` cannot be had.
pub async fn resolve(
    client: &kube::Client,
    node_name: &str,
    flag: Selector,
    metrics: &Metrics,
    shutdown: &CancellationToken,
) -> Option<Result<Selection, String>> {
    if let Some(s) = without_probe(flag) {
        return Some(Ok(s));
    }
    let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
    loop {
        let heard = tokio::select! {
            () = shutdown.cancelled() => return None,
            p = probe(client, node_name) => p,
        };
        match decide(flag, &heard) {
            Decision::Use(s) => {
                match &heard {
                    Probe::Refused(why) => info!(
                        message = "GameServers are not selectable by status.nodeName (Agones before 1.58 or Kubernetes before 1.31): labelling each server seen on this node instead",
                        field = NODE_FIELD, answer = %why
                    ),
                    _ => info!(
                        message =
                            "selecting this node's GameServers by status.nodeName: no claim writes",
                        field = NODE_FIELD
                    ),
                }
                return Some(Ok(s));
            }
            Decision::Fail(why) => return Some(Err(why)),
            Decision::Retry => {
                metrics
                    .watch_errors
                    .get_or_create(&SourceLabel {
                        source: "gameserver",
                    })
                    .inc();
                let d = backoff.next_delay();
                if let Probe::Failed(e) = &heard {
                    warn!(message = "asking the API server how to select GameServers failed; retrying", error = %e, retry_in_ms = d.as_millis() as u64);
                }
                tokio::select! {
                    () = shutdown.cancelled() => return None,
                    () = tokio::time::sleep(d) => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_never_asks_and_never_fails() {
        assert_eq!(without_probe(Selector::Label), Some(Selection::Label));
        assert_eq!(without_probe(Selector::Auto), None);
        assert_eq!(without_probe(Selector::Field), None);
        for p in [
            Probe::Served,
            Probe::Refused("no".into()),
            Probe::Failed("down".into()),
        ] {
            assert_eq!(decide(Selector::Label, &p), Decision::Use(Selection::Label));
        }
    }

    #[test]
    fn auto_follows_the_answer_and_waits_for_one() {
        assert_eq!(
            decide(Selector::Auto, &Probe::Served),
            Decision::Use(Selection::Field)
        );
        assert_eq!(
            decide(
                Selector::Auto,
                &Probe::Refused("field label not supported".into())
            ),
            Decision::Use(Selection::Label)
        );
        // A failure is no answer: neither mode is guessed from it.
        assert_eq!(
            decide(Selector::Auto, &Probe::Failed("503".into())),
            Decision::Retry
        );
    }

    #[test]
    fn field_demanded_but_refused_fails_with_the_remedy() {
        assert_eq!(
            decide(Selector::Field, &Probe::Served),
            Decision::Use(Selection::Field)
        );
        assert_eq!(
            decide(Selector::Field, &Probe::Failed("timeout".into())),
            Decision::Retry
        );
        let Decision::Fail(why) = decide(Selector::Field, &Probe::Refused("unknown".into())) else {
            panic!("a refused field must fail");
        };
        assert!(why.contains("Agones 1.58") && why.contains("auto"), "{why}");
    }

    #[test]
    fn only_the_label_selection_claims() {
        assert!(Selection::Label.claims());
        assert!(!Selection::Field.claims());
    }

    #[test]
    fn a_refused_list_means_the_field_was_withdrawn() {
        let status = |code| {
            kube::Error::Api(Box::new(kube::core::Status {
                code,
                message: "x".into(),
                ..Default::default()
            }))
        };
        assert!(field_withdrawn(&watcher::Error::InitialListFailed(status(
            400
        ))));
        assert!(field_withdrawn(&watcher::Error::WatchStartFailed(status(
            400
        ))));
        assert!(!field_withdrawn(&watcher::Error::InitialListFailed(
            status(500)
        )));
        assert!(!field_withdrawn(&watcher::Error::NoResourceVersion));
    }
}
