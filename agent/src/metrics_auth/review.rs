//! The two questions put to the API server about a caller, as Kubernetes' own components
//! put them (their delegated authentication and authorization): a TokenReview says who the
//! token belongs to, a SubjectAccessReview whether that user may `get` the non-resource URL
//! `/metrics`. What each answer means follows the API reference of `authentication.k8s.io/v1`
//! and `authorization.k8s.io/v1`; the requests are built and read here, apart from sending.

use std::fmt;

use k8s_openapi::api::authentication::v1::{
    TokenReview, TokenReviewSpec, TokenReviewStatus, UserInfo,
};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec, SubjectAccessReviewStatus,
};
use kube::api::{Api, PostParams};
use tokio::time::Instant;

/// The path and verb a scraper must be allowed (`nonResourceURLs: ["/metrics"]`, `get`).
pub const PATH: &str = "/metrics";
pub const VERB: &str = "get";

/// What the API server decided about a token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Authenticated, and allowed to `get` `/metrics`.
    Allowed,
    /// Authenticated as `user`, who may not.
    Forbidden { user: String },
    /// Not a token the API server accepts (unknown, expired, revoked, its pod gone).
    Unauthenticated,
}

/// Which review failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Review {
    Token,
    Access,
}

impl Review {
    pub fn label(self) -> &'static str {
        match self {
            Review::Token => "token",
            Review::Access => "access",
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Review::Token => "TokenReview",
            Review::Access => "SubjectAccessReview",
        }
    }
}

/// Why a review gave no decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// No answer within the review's deadline.
    Timeout,
    /// The API server refused the agent itself (401/403): its RBAC lacks `create` on
    /// `tokenreviews` or `subjectaccessreviews`.
    Refused,
    /// Unreachable, or an error status (429, 5xx, ...).
    Error,
    /// An answer that does not say what the API reference promises.
    Invalid,
}

impl Reason {
    pub fn label(self) -> &'static str {
        match self {
            Reason::Timeout => "timeout",
            Reason::Refused => "refused",
            Reason::Error => "error",
            Reason::Invalid => "invalid",
        }
    }
}

/// A review without a decision: the request fails closed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub review: Review,
    pub reason: Reason,
    pub detail: String,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.review.kind(),
            self.reason.label(),
            self.detail
        )
    }
}

/// The TokenReview of `token`, for the API server's own audiences (those of its
/// ServiceAccount tokens).
pub fn token_review(token: &str) -> TokenReview {
    TokenReview {
        spec: TokenReviewSpec {
            token: Some(token.to_string()),
            audiences: None,
        },
        ..TokenReview::default()
    }
}

/// The user a TokenReview's answer names: `Ok(None)` when the token is not authenticated.
/// `authenticated` without a user name is not an answer (fail closed).
pub fn authenticated(status: Option<TokenReviewStatus>) -> Result<Option<UserInfo>, String> {
    let status = status.ok_or("a TokenReview answered without status")?;
    if status.authenticated != Some(true) {
        return Ok(None);
    }
    match status.user {
        Some(user) if user.username.as_deref().is_some_and(|u| !u.is_empty()) => Ok(Some(user)),
        _ => Err("a TokenReview answered authenticated without a user name".into()),
    }
}

/// Whether `user` may `get` `/metrics`: their name, uid, groups and extra, as the token
/// review gave them.
pub fn access_review(user: &UserInfo) -> SubjectAccessReview {
    SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: user.username.clone(),
            uid: user.uid.clone(),
            groups: user.groups.clone(),
            extra: user.extra.clone(),
            non_resource_attributes: Some(NonResourceAttributes {
                path: Some(PATH.into()),
                verb: Some(VERB.into()),
            }),
            resource_attributes: None,
        },
        ..SubjectAccessReview::default()
    }
}

/// A SubjectAccessReview's answer: allowed only when `allowed` and not `denied` (the two
/// together are not a valid answer, and refused).
pub fn allowed(status: Option<SubjectAccessReviewStatus>) -> Result<bool, String> {
    let status = status.ok_or("a SubjectAccessReview answered without status")?;
    Ok(status.allowed && status.denied != Some(true))
}

/// A name for messages: never longer than a Kubernetes name.
fn shown(user: &UserInfo) -> String {
    user.username
        .as_deref()
        .unwrap_or_default()
        .chars()
        .take(253)
        .collect()
}

fn failure(review: Review, e: kube::Error) -> Failure {
    let reason = match &e {
        kube::Error::Api(s) if s.code == 401 || s.code == 403 => Reason::Refused,
        _ => Reason::Error,
    };
    Failure {
        review,
        reason,
        detail: e.to_string(),
    }
}

/// Sends `review` and waits at most until `deadline`.
async fn ask<K>(
    client: &kube::Client,
    review: Review,
    request: &K,
    deadline: Instant,
) -> Result<K, Failure>
where
    K: kube::Resource<Scope = kube::core::ClusterResourceScope>
        + Clone
        + k8s_openapi::serde::de::DeserializeOwned
        + k8s_openapi::serde::Serialize
        + fmt::Debug,
    K::DynamicType: Default,
{
    let api = Api::<K>::all(client.clone());
    match tokio::time::timeout_at(deadline, api.create(&PostParams::default(), request)).await {
        Ok(answer) => answer.map_err(|e| failure(review, e)),
        Err(_) => Err(Failure {
            review,
            reason: Reason::Timeout,
            detail: "no answer in time".into(),
        }),
    }
}

/// Asks the API server about `token`: a TokenReview, then, for an authenticated user, a
/// SubjectAccessReview; both answered by `deadline`.
pub async fn decide(
    client: &kube::Client,
    token: &str,
    deadline: Instant,
) -> Result<Decision, Failure> {
    let invalid = |review, detail| Failure {
        review,
        reason: Reason::Invalid,
        detail,
    };
    let answer = ask(client, Review::Token, &token_review(token), deadline).await?;
    let Some(user) = authenticated(answer.status).map_err(|d| invalid(Review::Token, d))? else {
        return Ok(Decision::Unauthenticated);
    };
    let answer = ask(client, Review::Access, &access_review(&user), deadline).await?;
    if allowed(answer.status).map_err(|d| invalid(Review::Access, d))? {
        Ok(Decision::Allowed)
    } else {
        Ok(Decision::Forbidden { user: shown(&user) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn token_status(v: serde_json::Value) -> Option<TokenReviewStatus> {
        Some(serde_json::from_value(v).unwrap())
    }

    fn access_status(v: serde_json::Value) -> Option<SubjectAccessReviewStatus> {
        Some(serde_json::from_value(v).unwrap())
    }

    #[test]
    fn the_token_review_asks_for_the_api_servers_own_audiences() {
        let v = serde_json::to_value(token_review("abc")).unwrap();
        assert_eq!(v["apiVersion"], "authentication.k8s.io/v1");
        assert_eq!(v["kind"], "TokenReview");
        assert_eq!(v["spec"], json!({"token": "abc"}));
    }

    #[test]
    fn a_token_review_answer_names_a_user_or_nobody() {
        // The API reference's shapes: an authenticated ServiceAccount token, a bad one.
        let sa = authenticated(token_status(json!({
            "authenticated": true,
            "audiences": ["https://kubernetes.default.svc.cluster.local"],
            "user": {"username": "system:serviceaccount:monitoring:prometheus", "uid": "u1",
                     "groups": ["system:serviceaccounts", "system:serviceaccounts:monitoring",
                                "system:authenticated"],
                     "extra": {"authentication.kubernetes.io/pod-name": ["prometheus-0"]}},
        })))
        .unwrap()
        .unwrap();
        assert_eq!(
            sa.username.as_deref(),
            Some("system:serviceaccount:monitoring:prometheus")
        );
        assert_eq!(
            authenticated(token_status(
                json!({"authenticated": false, "error": "invalid bearer token"})
            )),
            Ok(None)
        );
        assert_eq!(authenticated(token_status(json!({"user": {}}))), Ok(None));
        // Not an answer: fail closed rather than guess.
        assert!(authenticated(None).is_err());
        assert!(authenticated(token_status(json!({"authenticated": true}))).is_err());
        assert!(
            authenticated(token_status(
                json!({"authenticated": true, "user": {"username": ""}})
            ))
            .is_err()
        );
    }

    #[test]
    fn the_access_review_asks_for_get_on_metrics_as_the_whole_user() {
        let user: UserInfo = serde_json::from_value(json!({
            "username": "system:serviceaccount:monitoring:prometheus", "uid": "u1",
            "groups": ["system:serviceaccounts", "system:authenticated"],
            "extra": {"authentication.kubernetes.io/node-name": ["n1"]},
        }))
        .unwrap();
        let v = serde_json::to_value(access_review(&user)).unwrap();
        assert_eq!(v["apiVersion"], "authorization.k8s.io/v1");
        assert_eq!(v["kind"], "SubjectAccessReview");
        assert_eq!(
            v["spec"],
            json!({
                "user": "system:serviceaccount:monitoring:prometheus", "uid": "u1",
                "groups": ["system:serviceaccounts", "system:authenticated"],
                "extra": {"authentication.kubernetes.io/node-name": ["n1"]},
                "nonResourceAttributes": {"path": "/metrics", "verb": "get"},
            })
        );
    }

    #[test]
    fn only_allowed_and_not_denied_is_allowed() {
        assert_eq!(allowed(access_status(json!({"allowed": true}))), Ok(true));
        assert_eq!(
            allowed(access_status(json!({"allowed": true, "denied": false}))),
            Ok(true)
        );
        // No opinion, an explicit denial, an error: not allowed.
        assert_eq!(allowed(access_status(json!({"allowed": false}))), Ok(false));
        assert_eq!(
            allowed(access_status(json!({"allowed": false, "denied": true}))),
            Ok(false)
        );
        assert_eq!(
            allowed(access_status(
                json!({"allowed": false, "evaluationError": "webhook down"})
            )),
            Ok(false)
        );
        // Both is not a valid answer: refused.
        assert_eq!(
            allowed(access_status(json!({"allowed": true, "denied": true}))),
            Ok(false)
        );
        assert!(allowed(None).is_err());
    }

    #[test]
    fn a_refusal_of_the_agent_itself_is_named_apart_from_other_errors() {
        let api = |code: u16| {
            kube::Error::Api(
                kube::core::Status::failure("no", "Forbidden")
                    .with_code(code)
                    .boxed(),
            )
        };
        assert_eq!(failure(Review::Token, api(403)).reason, Reason::Refused);
        assert_eq!(failure(Review::Access, api(401)).reason, Reason::Refused);
        assert_eq!(failure(Review::Token, api(429)).reason, Reason::Error);
        assert_eq!(failure(Review::Token, api(500)).reason, Reason::Error);
        let f = failure(Review::Access, api(403));
        assert!(
            f.to_string().starts_with("SubjectAccessReview refused: "),
            "{f}"
        );
    }
}
