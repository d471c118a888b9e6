//! Whether the chart's node restriction can hold this agent, said once at start-up.
//!
//! The agent's ClusterRole grants its writes cluster-wide; only the chart's admission policies
//! narrow them to its own node, and they can do so only when the agent's token carries its
//! node (`authentication.kubernetes.io/node-name`, a pod-bound token on Kubernetes 1.30 and
//! later) and the API server serves ValidatingAdmissionPolicy v1. Where either is missing the
//! agent runs with power over every node's objects: it says so in a log line, in
//! `lastcall_node_restriction_enforceable` (0) and in a Warning Event on its Node, instead of
//! running so in silence. Two reads, no write: a SelfSubjectReview (every authenticated user
//! may create one) and the API server's discovery.
//!
//! Only an agent that runs in a pod (`POD_NAME`/`POD_UID`, as the chart's DaemonSet sets them)
//! checks: another credential is not the DaemonSet's, and says nothing about it.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use kube::api::{Api, PostParams};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::actuator::Actuator;
use crate::metrics::Metrics;

/// The Warning Event's reason (docs/events.md).
pub const REASON: &str = "NodeRestrictionUnenforceable";
/// The user extra a pod-bound token carries its node in.
pub const NODE_CLAIM: &str = "authentication.kubernetes.io/node-name";
const POLICY_GROUP: &str = "admissionregistration.k8s.io/v1";
const POLICY_RESOURCE: &str = "validatingadmissionpolicies";
/// Tries of each read, and the pause after a failed one: an API server that is briefly
/// unreachable at start-up is not a missing restriction.
const TRIES: u32 = 5;
const PAUSE: Duration = Duration::from_secs(3);

/// Why the restriction cannot hold this agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Gap {
    /// The token carries no node, or another one: the policies refuse its every write or,
    /// where they are not installed, nothing narrows it.
    NoNodeClaim { user: String, claim: Vec<String> },
    /// The API server does not serve ValidatingAdmissionPolicy v1 (before Kubernetes 1.30).
    NoPolicyApi,
    /// A read failed every try: the agent cannot tell.
    Unknown(String),
}

impl std::fmt::Display for Gap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Gap::NoNodeClaim { user, claim } if claim.is_empty() => write!(
                f,
                "the API server sees {user} without {NODE_CLAIM} (a token not bound to a pod, or Kubernetes before 1.30)"
            ),
            Gap::NoNodeClaim { user, claim } => write!(
                f,
                "the API server sees {user} with {NODE_CLAIM} {claim:?}, not this node"
            ),
            Gap::NoPolicyApi => write!(
                f,
                "the API server does not serve ValidatingAdmissionPolicy v1 (Kubernetes 1.30 or later)"
            ),
            Gap::Unknown(why) => write!(f, "the check could not complete: {why}"),
        }
    }
}

/// The gaps, from what the API server said: the reviewed user's name and extra, and whether
/// its discovery lists the policy kind. Pure.
pub fn gaps(
    user: &str,
    extra: &BTreeMap<String, Vec<String>>,
    node: &str,
    policy_api: bool,
) -> Vec<Gap> {
    let mut out = Vec::new();
    let claim = extra.get(NODE_CLAIM).cloned().unwrap_or_default();
    if claim != [node] {
        out.push(Gap::NoNodeClaim {
            user: user.to_string(),
            claim,
        });
    }
    if !policy_api {
        out.push(Gap::NoPolicyApi);
    }
    out
}

/// Retries `read` a few times on errors other than 404 (an API the server does not serve);
/// the last error.
async fn tries<T, F, Fut>(stop: &CancellationToken, mut read: F) -> Result<T, kube::Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, kube::Error>>,
{
    let mut last = None;
    for attempt in 1..=TRIES {
        match read().await {
            Ok(v) => return Ok(v),
            Err(kube::Error::Api(s)) if s.code == 404 => return Err(kube::Error::Api(s)),
            Err(e) => last = Some(e),
        }
        if attempt < TRIES {
            tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep(PAUSE) => {}
            }
        }
    }
    Err(last.unwrap_or_else(|| kube::Error::Service("stopped".into())))
}

/// What the API server says of this agent's credentials and of the policy API.
async fn check(client: &kube::Client, node: &str, stop: &CancellationToken) -> Vec<Gap> {
    let reviews: Api<SelfSubjectReview> = Api::all(client.clone());
    let review = match tries(stop, || async {
        reviews
            .create(&PostParams::default(), &SelfSubjectReview::default())
            .await
    })
    .await
    {
        Ok(r) => r,
        Err(e) => return vec![Gap::Unknown(format!("SelfSubjectReview: {e}"))],
    };
    let info = review.status.and_then(|s| s.user_info).unwrap_or_default();
    let discovery = tries(stop, || client.list_api_group_resources(POLICY_GROUP)).await;
    let policy_api = match discovery {
        Ok(list) => list.resources.iter().any(|r| r.name == POLICY_RESOURCE),
        // The group version is not served at all.
        Err(kube::Error::Api(s)) if s.code == 404 => false,
        Err(e) => return vec![Gap::Unknown(format!("discovery of {POLICY_GROUP}: {e}"))],
    };
    gaps(
        info.username.as_deref().unwrap_or_default(),
        &info.extra.unwrap_or_default(),
        node,
        policy_api,
    )
}

/// The start-up check as a task: checks once, reports, then waits for `stop`.
pub async fn run(
    client: kube::Client,
    actuator: Actuator,
    metrics: Metrics,
    node: String,
    stop: CancellationToken,
) -> &'static str {
    let found = tokio::select! {
        () = stop.cancelled() => return "node restriction check",
        found = check(&client, &node, &stop) => found,
    };
    metrics
        .node_restriction_enforceable
        .set(i64::from(found.is_empty()));
    if found.is_empty() {
        info!(message = "the node restriction can hold this agent: its token carries its node and the API server serves ValidatingAdmissionPolicy v1", node = %node);
    } else {
        let why: Vec<String> = found.iter().map(ToString::to_string).collect();
        let note = format!(
            "This agent may write every node's Nodes, Pods and GameServers, not only this node's: {}. See docs/install.md, \"Agents can write only their own node\".",
            why.join("; ")
        );
        warn!(message = "the node restriction cannot hold this agent", node = %node, why = %why.join("; "));
        actuator.queue_event(&actuator.node_ref(), REASON, note, true);
    }
    stop.cancelled().await;
    "node restriction check"
}

#[cfg(test)]
mod tests {
    use super::*;

    fn extra(node: &[&str]) -> BTreeMap<String, Vec<String>> {
        BTreeMap::from([(
            NODE_CLAIM.to_string(),
            node.iter().map(|s| s.to_string()).collect(),
        )])
    }

    #[test]
    fn a_pod_bound_token_on_a_policy_api_server_has_no_gap() {
        assert_eq!(gaps("sa", &extra(&["n1"]), "n1", true), vec![]);
    }

    #[test]
    fn each_gap_is_named() {
        assert_eq!(
            gaps("sa", &BTreeMap::new(), "n1", true),
            vec![Gap::NoNodeClaim {
                user: "sa".into(),
                claim: vec![]
            }]
        );
        assert_eq!(
            gaps("sa", &extra(&["n2"]), "n1", false),
            vec![
                Gap::NoNodeClaim {
                    user: "sa".into(),
                    claim: vec!["n2".into()]
                },
                Gap::NoPolicyApi
            ]
        );
        assert!(
            Gap::NoPolicyApi
                .to_string()
                .contains("ValidatingAdmissionPolicy")
        );
    }
}
