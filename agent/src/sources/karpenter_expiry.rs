//! Karpenter NodeClaim expiry: the node's end, known from the day it was created.
//!
//! Karpenter v1 copies a NodePool's `expireAfter` to each NodeClaim's `spec.expireAfter`
//! (EKS Auto Mode caps it at 21 days) and deletes the NodeClaim at `creationTimestamp +
//! expireAfter`, whatever is running: expiry is forceful, no budget or `do-not-disrupt`
//! stops it. The node is then tainted and drained; with a `terminationGracePeriod` every pod
//! still there is deleted at `expiry + terminationGracePeriod` (each at that time less its
//! own grace), and the instance goes.
//!
//! **The end announced to games** is `expiry + terminationGracePeriod` when the NodeClaim
//! has one: that is when a running match is killed, and the same time Karpenter later writes
//! as `karpenter.sh/nodeclaim-termination-timestamp`, so the two sources agree. Without one
//! nothing forces a running match off (Karpenter waits for its pod), so the announced end is
//! the expiry itself: the moment the node starts being taken, the latest a game should plan
//! to finish. Either way the node **stops taking new matches `--maintenance-lead` before the
//! expiry** (Observe until then), so matches that start before then end on their own before
//! Karpenter starts taking the node. With a grace period the notice is a Terminate (the
//! node will die at its deadline); without one a Drain (nothing dies).
//!
//! **Finding the NodeClaim, at no steady-state cost.** Karpenter makes the NodeClaim the
//! owner of its Node (`ownerReferences`, kind `NodeClaim`, `karpenter.sh/v1`) when the node
//! registers, so the agent reads the name from the Node it already watches, and never lists
//! NodeClaims (`status.nodeName` is not a field selector of the CRD: matching on it would
//! cost every agent a cluster-wide list). The NodeClaim's `spec` is immutable and
//! `creationTimestamp` never changes, so **one GET** per NodeClaim is all it takes: no
//! watch, no poll. When Karpenter deletes the NodeClaim early (consolidation, drift,
//! interruption), it taints the Node, which the `karpenter` Node signal reads.
//!
//! Never a drain from a fault: a node without the owner reference (not Karpenter's), a
//! NodeClaim that is not served or gone (404), a GET RBAC refuses (403), `expireAfter:
//! Never`, and a value that does not parse are all "no expiry", each logged once and counted
//! in `lastcall_karpenter_nodeclaim_reads_total{result}`. A 403 is retried every
//! [`FORBIDDEN_RETRY`] (fixed RBAC takes effect without a restart) and marks the source down;
//! other failures keep the last view and are retried with backoff.

use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::reflector::ObjectRef;
use tracing::{info, warn};

use super::{Report, SourceContext};
use crate::metrics::{ResultLabel, SourceLabel, SourceReason, SourceStatus};
use crate::notice::{Cause, Notice, Severity, Source};

pub const SOURCE: Source = Source("karpenter_expiry");

/// Karpenter's API group; only `v1` NodeClaims carry `spec.expireAfter`.
pub const GROUP: &str = "karpenter.sh";
pub const VERSION: &str = "v1";
pub const KIND: &str = "NodeClaim";
pub const PLURAL: &str = "nodeclaims";

/// How often a GET refused by RBAC is tried again.
pub const FORBIDDEN_RETRY: Duration = Duration::from_secs(600);
/// How often the cached Node is looked at again for its owner (memory only, no request).
const NODE_RECHECK: Duration = Duration::from_secs(10);
/// How soon to look again while the Node is not cached yet (the watch's first list).
const NODE_FIRST_LOOK: Duration = Duration::from_millis(200);

/// The NodeClaim named as the Node's owner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    pub name: String,
    pub uid: String,
    /// The owner reference's `apiVersion` (`karpenter.sh/v1`).
    pub api_version: String,
}

/// The Node's Karpenter NodeClaim owner, if Karpenter launched it.
pub fn owner(node: &Node) -> Option<Owner> {
    node.metadata
        .owner_references
        .as_ref()?
        .iter()
        .find(|r| {
            r.kind == KIND
                && r.api_version
                    .split_once('/')
                    .is_some_and(|(g, _)| g == GROUP)
        })
        .map(|r| Owner {
            name: r.name.clone(),
            uid: r.uid.clone(),
            api_version: r.api_version.clone(),
        })
}

/// `spec.expireAfter`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpireAfter {
    Never,
    After(Duration),
}

/// What a NodeClaim says about its node's end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claim {
    pub name: String,
    pub created: Timestamp,
    pub expire_after: ExpireAfter,
    /// `spec.terminationGracePeriod`.
    pub termination_grace: Option<Duration>,
}

/// Why a NodeClaim could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("NodeClaim {name}: {why}")]
pub struct ParseError {
    pub name: String,
    pub why: String,
}

/// A Go `time.Duration` string as Kubernetes writes `metav1.Duration` (`720h`, `1h30m`,
/// `336h0m0s`, `1.5h`, `0`). Negative values are refused.
pub fn parse_go_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    if s.is_empty() {
        return Err("empty duration".into());
    }
    let mut rest = s;
    let mut nanos = 0f64;
    while !rest.is_empty() {
        let n = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number: f64 = rest[..n]
            .parse()
            .map_err(|_| format!("{s:?}: a number is missing or malformed"))?;
        rest = &rest[n..];
        let u = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let per = match &rest[..u] {
            "ns" => 1.0,
            "us" | "µs" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3600e9,
            other => return Err(format!("{s:?}: unknown unit {other:?}")),
        };
        nanos += number * per;
        rest = &rest[u..];
    }
    Duration::try_from_secs_f64(nanos / 1e9).map_err(|e| format!("{s:?}: {e}"))
}

/// Reads a NodeClaim as the API returns it.
pub fn read_claim(obj: &serde_json::Value) -> Result<Claim, ParseError> {
    let name = obj
        .pointer("/metadata/name")
        .and_then(|v| v.as_str())
        .unwrap_or_default()
        .to_string();
    let bad = |why: String| ParseError {
        name: name.clone(),
        why,
    };
    let created = obj
        .pointer("/metadata/creationTimestamp")
        .and_then(|v| v.as_str())
        .ok_or_else(|| bad("no metadata.creationTimestamp".into()))?
        .parse::<Timestamp>()
        .map_err(|e| bad(format!("metadata.creationTimestamp: {e}")))?;
    // Karpenter defaults expireAfter to 720h; a NodeClaim without one is read that way.
    let expire_after = match obj.pointer("/spec/expireAfter").and_then(|v| v.as_str()) {
        Some("Never") => ExpireAfter::Never,
        Some(v) => ExpireAfter::After(
            parse_go_duration(v).map_err(|e| bad(format!("spec.expireAfter: {e}")))?,
        ),
        None => ExpireAfter::After(Duration::from_secs(720 * 3600)),
    };
    let termination_grace = obj
        .pointer("/spec/terminationGracePeriod")
        .and_then(|v| v.as_str())
        .map(parse_go_duration)
        .transpose()
        .map_err(|e| bad(format!("spec.terminationGracePeriod: {e}")))?;
    Ok(Claim {
        name: name.clone(),
        created,
        expire_after,
        termination_grace,
    })
}

fn add(t: Timestamp, d: Duration) -> Option<Timestamp> {
    t.checked_add(SignedDuration::try_from(d).ok()?).ok()
}

impl Claim {
    /// When Karpenter deletes the NodeClaim; `None` for `Never`.
    pub fn expiry(&self) -> Option<Timestamp> {
        match self.expire_after {
            ExpireAfter::Never => None,
            ExpireAfter::After(d) => add(self.created, d),
        }
    }

    /// The end announced to games: when a running match is killed (`expiry +
    /// terminationGracePeriod`), or the expiry where nothing kills it.
    pub fn end(&self) -> Option<Timestamp> {
        let expiry = self.expiry()?;
        match self.termination_grace {
            Some(g) => add(expiry, g),
            None => Some(expiry),
        }
    }

    /// From when the node takes no new match.
    pub fn fence_at(&self, lead: Duration) -> Option<Timestamp> {
        let expiry = self.expiry()?;
        let lead = SignedDuration::try_from(lead).unwrap_or_default();
        Some(expiry.checked_sub(lead).unwrap_or(expiry))
    }

    /// The notice at `now`: Observe until `expiry − lead`, then Terminate (with a grace
    /// period: the node dies at its end) or Drain; `None` for `Never`.
    pub fn notice(&self, lead: Duration, now: Timestamp) -> Option<Notice> {
        let (expiry, end, from) = (self.expiry()?, self.end()?, self.fence_at(lead)?);
        let severity = match (now >= from, self.termination_grace.is_some()) {
            (false, _) => Severity::Observe,
            (true, true) => Severity::Terminate,
            (true, false) => Severity::Drain,
        };
        let grace = self
            .termination_grace
            .map(|g| {
                format!(
                    "; its pods are deleted by {end} (terminationGracePeriod {}s)",
                    g.as_secs()
                )
            })
            .unwrap_or_default();
        Some(Notice::new(
            SOURCE,
            Cause::Upgrade,
            severity,
            Some(end),
            true,
            format!(
                "Karpenter NodeClaim {} expires at {expiry} (created {}, expireAfter {}s){grace}",
                self.name,
                self.created,
                match self.expire_after {
                    ExpireAfter::After(d) => d.as_secs(),
                    ExpireAfter::Never => 0,
                }
            ),
        ))
    }
}

/// What one GET of the NodeClaim gave.
#[derive(Debug)]
enum Read {
    Claim(Claim),
    /// A clear "no expiry" (404, 403, unreadable, `Never`, other API version), with the
    /// `result` label; `retry` after this long, if at all.
    Nothing {
        result: &'static str,
        retry: Option<Duration>,
    },
    /// A transient failure: keep the last view, retry with backoff.
    Failed(&'static str),
}

pub fn start(ctx: SourceContext) -> Option<BoxFuture<'static, ()>> {
    let kube = ctx.kube.clone()?;
    Some(run(ctx, kube).boxed())
}

async fn run(ctx: SourceContext, kube: super::KubeAccess) {
    let node_name = ctx.config.node_name.clone();
    let lead = ctx.config.maintenance_lead;
    let metrics = ctx.metrics.clone();
    let count = |result: &'static str| {
        metrics
            .nodeclaim_reads
            .get_or_create(&ResultLabel { result })
            .inc();
    };
    let up = |ok: bool| {
        metrics
            .source_up
            .get_or_create(&SourceLabel {
                source: SOURCE.as_str(),
            })
            .set(i64::from(ok));
    };
    let ar = ApiResource {
        group: GROUP.into(),
        version: VERSION.into(),
        api_version: format!("{GROUP}/{VERSION}"),
        kind: KIND.into(),
        plural: PLURAL.into(),
    };
    let api: Api<DynamicObject> = Api::all_with(kube.client.clone(), &ar);
    // Whose NodeClaim was last read (by uid), what it said, and when to read it again.
    let mut read_for: Option<String> = None;
    let mut claim: Option<Claim> = None;
    let mut retry_at: Option<tokio::time::Instant> = None;
    let mut backoff = Duration::from_secs(1);
    let mut not_karpenter_logged = false;
    loop {
        let now = tokio::time::Instant::now();
        let cached = kube.node.get(&ObjectRef::new(&node_name));
        // Never `Store::wait_until_ready`: its readiness wakes one waiter only, and the
        // reconciler waits on it. Until the Node is cached nothing is known (Unknown).
        let mut recheck = NODE_RECHECK;
        match cached.as_deref().map(owner) {
            None => recheck = NODE_FIRST_LOOK,
            Some(None) => {
                if !not_karpenter_logged {
                    info!(
                        message = "the Node has no Karpenter NodeClaim owner: no NodeClaim expiry on this node"
                    );
                    count("not_karpenter");
                    up(true);
                    not_karpenter_logged = true;
                }
                claim = None;
                read_for = None;
                super::publish(&ctx.out, Report::Known(vec![]));
            }
            Some(Some(o)) => {
                let due = read_for.as_deref() != Some(o.uid.as_str())
                    || retry_at.is_some_and(|at| now >= at);
                if due {
                    read_for = Some(o.uid.clone());
                    retry_at = None;
                    match get(&api, &o).await {
                        Read::Claim(c) => {
                            count(if c.expiry().is_some() { "ok" } else { "never" });
                            up(true);
                            backoff = Duration::from_secs(1);
                            info!(message = "read the node's Karpenter NodeClaim", nodeclaim = %c.name, expiry = ?c.expiry(), end = ?c.end(), fence_at = ?c.fence_at(lead));
                            claim = Some(c);
                        }
                        Read::Nothing { result, retry } => {
                            count(result);
                            up(result != "forbidden");
                            if result == "invalid" {
                                metrics
                                    .signals_rejected
                                    .get_or_create(&SourceReason {
                                        source: SOURCE.as_str(),
                                        reason: "invalid",
                                    })
                                    .inc();
                            } else if result == "forbidden" {
                                metrics
                                    .source_errors
                                    .get_or_create(&SourceReason {
                                        source: SOURCE.as_str(),
                                        reason: "forbidden",
                                    })
                                    .inc();
                            }
                            retry_at = retry.map(|d| now + d);
                            claim = None;
                        }
                        Read::Failed(reason) => {
                            count("error");
                            up(false);
                            metrics
                                .source_errors
                                .get_or_create(&SourceReason {
                                    source: SOURCE.as_str(),
                                    reason,
                                })
                                .inc();
                            retry_at = Some(now + backoff);
                            backoff = (backoff * 2).min(Duration::from_secs(300));
                            // The last view stands (Unknown at first): never "all clear".
                            sleep_or_stop(&ctx, retry_at).await;
                            if ctx.shutdown.is_cancelled() {
                                return;
                            }
                            continue;
                        }
                    }
                }
                let notice = claim
                    .as_ref()
                    .and_then(|c| c.notice(lead, Timestamp::now()));
                let status = notice.as_ref().map(|n| n.cause.as_str());
                let changed = super::publish(&ctx.out, Report::Known(notice.into_iter().collect()));
                if changed && let Some(status) = status {
                    metrics
                        .signals
                        .get_or_create(&SourceStatus {
                            source: SOURCE.as_str(),
                            status,
                        })
                        .inc();
                }
            }
        }
        // Wake for the fence (the notice's severity changes then), a retry, or a fresh look
        // at the cached Node, whichever comes first.
        let mut wake = now + recheck;
        if let Some(at) = retry_at {
            wake = wake.min(at);
        }
        if let Some(from) = claim.as_ref().and_then(|c| c.fence_at(lead)) {
            let left = from.duration_since(Timestamp::now());
            if left.is_positive() {
                let left = Duration::try_from(left).unwrap_or_default();
                wake = wake.min(now + left + Duration::from_millis(10));
            }
        }
        sleep_or_stop(&ctx, Some(wake)).await;
        if ctx.shutdown.is_cancelled() {
            return;
        }
    }
}

async fn sleep_or_stop(ctx: &SourceContext, until: Option<tokio::time::Instant>) {
    let until = until.unwrap_or_else(tokio::time::Instant::now);
    tokio::select! {
        () = ctx.shutdown.cancelled() => {}
        () = tokio::time::sleep_until(until) => {}
    }
}

/// One GET of the owner NodeClaim, classified.
async fn get(api: &Api<DynamicObject>, o: &Owner) -> Read {
    if o.api_version != format!("{GROUP}/{VERSION}") {
        warn!(message = "the Node's NodeClaim is not karpenter.sh/v1 (Karpenter before v1 keeps expireAfter on the NodePool): no NodeClaim expiry", api_version = %o.api_version, nodeclaim = %o.name);
        return Read::Nothing {
            result: "unsupported_version",
            retry: None,
        };
    }
    match api.get(&o.name).await {
        Ok(obj) => {
            if obj.metadata.uid.as_deref() != Some(o.uid.as_str()) {
                warn!(message = "the NodeClaim named as the Node's owner is another object now: no NodeClaim expiry", nodeclaim = %o.name);
                return Read::Nothing {
                    result: "not_found",
                    retry: None,
                };
            }
            let value = match serde_json::to_value(&obj) {
                Ok(v) => v,
                Err(e) => {
                    warn!(message = "unreadable NodeClaim: no NodeClaim expiry", nodeclaim = %o.name, error = %e);
                    return Read::Nothing {
                        result: "invalid",
                        retry: None,
                    };
                }
            };
            match read_claim(&value) {
                Ok(c) => {
                    if c.expire_after == ExpireAfter::Never {
                        info!(message = "the node's NodeClaim never expires (expireAfter: Never)", nodeclaim = %o.name);
                    }
                    Read::Claim(c)
                }
                Err(e) => {
                    warn!(message = "unreadable NodeClaim: no NodeClaim expiry", error = %e);
                    Read::Nothing {
                        result: "invalid",
                        retry: None,
                    }
                }
            }
        }
        Err(kube::Error::Api(s)) if s.code == 404 => {
            warn!(message = "the Node's NodeClaim is not served (no Karpenter v1 CRD) or gone: no NodeClaim expiry", nodeclaim = %o.name);
            Read::Nothing {
                result: "not_found",
                retry: None,
            }
        }
        Err(kube::Error::Api(s)) if s.code == 403 => {
            warn!(message = "reading the node's NodeClaim is forbidden: no NodeClaim expiry; grant get on nodeclaims.karpenter.sh (docs/install.md)", nodeclaim = %o.name, error = %s.message);
            Read::Nothing {
                result: "forbidden",
                retry: Some(FORBIDDEN_RETRY),
            }
        }
        Err(e) => {
            warn!(message = "reading the node's NodeClaim failed; retrying", nodeclaim = %o.name, error = %e);
            Read::Failed(match e {
                kube::Error::Api(_) => "server_error",
                _ => "unreachable",
            })
        }
    }
}

#[cfg(test)]
mod tests;
