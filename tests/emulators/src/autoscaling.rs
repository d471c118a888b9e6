//! An emulated EC2 Auto Scaling API: the lifecycle-hook subset a node agent uses, over the
//! real wire protocol (`aws-sdk-autoscaling` talks to it through `endpoint_url`).
//!
//! Protocol: AWS Query. Every call is `POST /` with a form-encoded body carrying `Action`,
//! `Version=2011-01-01` and the parameters (lists as `Name.member.N`); answers are XML
//! `<{Action}Response>` documents with a `<{Action}Result>` and `<ResponseMetadata>`, and errors
//! are `<ErrorResponse><Error><Type/><Code/><Message/></Error><RequestId/></ErrorResponse>`.
//!
//! Model: groups with termination lifecycle hooks, and instances. [`AutoScalingEmulator::begin_termination`]
//! moves an instance to `Terminating:Wait` for the group's termination hook (as a scale-in,
//! instance refresh or AZ rebalance would). While it waits:
//! - `RecordLifecycleActionHeartbeat` restarts the heartbeat timeout;
//! - the whole wait is capped by the global timeout, min(48 h, 100 × heartbeat timeout);
//! - when either elapses the hook's `DefaultResult` applies; for termination both `CONTINUE`
//!   and `ABANDON` end in `Terminated`;
//! - `CompleteLifecycleAction` ends it at once.
//!
//! A call for an instance that is not waiting fails as AWS does (`ValidationError`, "No active
//! Lifecycle Action found"). Deviation, on purpose: heartbeat timeouts under AWS's 30 s minimum
//! are accepted, so tests can outlive a timeout in seconds. See `docs/testing/cloud.md`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The API version every request must carry.
pub const VERSION: &str = "2011-01-01";
const XMLNS: &str = "http://autoscaling.amazonaws.com/doc/2011-01-01/";
/// The transition a termination hook has.
pub const TERMINATING: &str = "autoscaling:EC2_INSTANCE_TERMINATING";
/// AWS's cap on a whole lifecycle wait.
pub const MAX_GLOBAL_TIMEOUT_SECS: u64 = 172_800;

/// A lifecycle hook on a group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hook {
    pub name: String,
    pub transition: String,
    pub heartbeat_timeout_secs: u64,
    /// `CONTINUE` or `ABANDON`.
    pub default_result: String,
}

impl Hook {
    /// A termination hook with `heartbeat_timeout_secs` and `DefaultResult=CONTINUE`.
    pub fn terminating(name: &str, heartbeat_timeout_secs: u64) -> Self {
        Self {
            name: name.to_string(),
            transition: TERMINATING.to_string(),
            heartbeat_timeout_secs,
            default_result: "CONTINUE".to_string(),
        }
    }

    /// min(48 h, 100 × heartbeat timeout), as AWS computes it.
    pub fn global_timeout_secs(&self) -> u64 {
        (self.heartbeat_timeout_secs * 100).min(MAX_GLOBAL_TIMEOUT_SECS)
    }
}

/// Where an instance is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LifecycleState {
    InService,
    TerminatingWait,
    TerminatingProceed,
    Terminated,
}

impl LifecycleState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InService => "InService",
            Self::TerminatingWait => "Terminating:Wait",
            Self::TerminatingProceed => "Terminating:Proceed",
            Self::Terminated => "Terminated",
        }
    }
}

/// What happened to an instance, or a call the API answered, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Happening {
    /// A call, with the error code it was answered with (`None`: success).
    Call {
        action: String,
        instance: Option<String>,
        error: Option<String>,
    },
    WaitStarted {
        hook: String,
    },
    HeartbeatRecorded,
    /// `CompleteLifecycleAction` ended the wait with this result.
    Completed {
        result: String,
    },
    /// The heartbeat or the global timeout elapsed and the default result applied.
    TimedOut {
        global: bool,
        result: String,
    },
    Terminated,
}

#[derive(Clone, Debug)]
pub struct Entry {
    pub at: Instant,
    pub instance: Option<String>,
    pub happening: Happening,
}

struct Wait {
    hook: Hook,
    heartbeat_deadline: Instant,
    global_deadline: Instant,
}

struct InstanceRec {
    group: String,
    state: LifecycleState,
    wait: Option<Wait>,
}

struct FaultRule {
    action: String,
    code: String,
    status: u16,
    remaining: Option<usize>,
}

#[derive(Default)]
struct State {
    groups: BTreeMap<String, Vec<Hook>>,
    instances: BTreeMap<String, InstanceRec>,
    journal: Vec<Entry>,
    faults: Vec<FaultRule>,
    /// `DescribeAutoScalingInstances` answers still to give from before the termination
    /// began (the API is eventually consistent; IMDS may be ahead of it).
    stale_describes: usize,
    next_request: u64,
    /// (action, calls left) applied and then answered `InternalFailure`: the answer lost.
    lose: Vec<(String, usize)>,
    /// How many answers were lost so far.
    answers_lost: usize,
}

type Shared = Arc<Mutex<State>>;

fn lock(shared: &Mutex<State>) -> MutexGuard<'_, State> {
    shared.lock().unwrap_or_else(|p| p.into_inner())
}

/// An Auto Scaling endpoint on `127.0.0.1`, alive until dropped.
pub struct AutoScalingEmulator {
    addr: SocketAddr,
    shared: Shared,
    stop: CancellationToken,
}

impl Drop for AutoScalingEmulator {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl AutoScalingEmulator {
    /// Starts an empty Auto Scaling API on a free `127.0.0.1` port.
    pub async fn start() -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let shared: Shared = Arc::default();
        let app = Router::new().fallback(handle).with_state(shared.clone());
        let (stop, _) = crate::net::serve(listener, app, "the Auto Scaling emulator");
        // Timeouts elapse on their own, so the journal says when an instance really went.
        let (ticker, s) = (stop.clone(), shared.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(20));
            loop {
                tokio::select! {
                    () = ticker.cancelled() => return,
                    _ = tick.tick() => expire(&mut lock(&s), Instant::now()),
                }
            }
        });
        Ok(Self { addr, shared, stop })
    }

    /// Base URL, for the SDK's `endpoint_url`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.shared)
    }

    /// Adds a group with its hooks (replacing one of the same name).
    pub fn add_group(&self, name: &str, hooks: Vec<Hook>) {
        self.state().groups.insert(name.to_string(), hooks);
    }

    /// Adds an `InService` instance to `group`.
    pub fn add_instance(&self, group: &str, instance_id: &str) {
        self.state().instances.insert(
            instance_id.to_string(),
            InstanceRec {
                group: group.to_string(),
                state: LifecycleState::InService,
                wait: None,
            },
        );
    }

    /// The group decides to terminate the instance: it waits on the group's first termination
    /// hook, or goes at once when the group has none.
    pub fn begin_termination(&self, instance_id: &str) -> anyhow::Result<()> {
        let now = Instant::now();
        let mut s = self.state();
        let State {
            groups,
            instances,
            journal,
            ..
        } = &mut *s;
        let rec = instances
            .get_mut(instance_id)
            .ok_or_else(|| anyhow::anyhow!("no instance {instance_id}"))?;
        anyhow::ensure!(
            rec.state == LifecycleState::InService,
            "{instance_id} is {}",
            rec.state.as_str()
        );
        let hook = groups
            .get(&rec.group)
            .and_then(|h| h.iter().find(|h| h.transition == TERMINATING))
            .cloned();
        let id = Some(instance_id.to_string());
        match hook {
            Some(hook) => {
                rec.state = LifecycleState::TerminatingWait;
                journal.push(Entry {
                    at: now,
                    instance: id,
                    happening: Happening::WaitStarted {
                        hook: hook.name.clone(),
                    },
                });
                rec.wait = Some(Wait {
                    heartbeat_deadline: now + Duration::from_secs(hook.heartbeat_timeout_secs),
                    global_deadline: now + Duration::from_secs(hook.global_timeout_secs()),
                    hook,
                });
            }
            None => {
                rec.state = LifecycleState::Terminated;
                journal.push(Entry {
                    at: now,
                    instance: id,
                    happening: Happening::Terminated,
                });
            }
        }
        Ok(())
    }

    /// The instance's lifecycle state now.
    pub fn lifecycle_state(&self, instance_id: &str) -> Option<LifecycleState> {
        let mut s = self.state();
        expire(&mut s, Instant::now());
        s.instances.get(instance_id).map(|r| r.state)
    }

    /// Every call and happening so far, in order.
    pub fn journal(&self) -> Vec<Entry> {
        let mut s = self.state();
        expire(&mut s, Instant::now());
        s.journal.clone()
    }

    /// Successful calls of `action` so far.
    pub fn calls(&self, action: &str) -> usize {
        self.journal()
            .iter()
            .filter(|e| {
                matches!(&e.happening, Happening::Call { action: a, error: None, .. } if a == action)
            })
            .count()
    }

    /// Answers `action` with error `code` and HTTP `status`, `times` times (`None`: until
    /// cleared). `AccessDenied` is 403, `Throttling` and `ValidationError` 400.
    pub fn fail(&self, action: &str, code: &str, status: u16, times: Option<usize>) {
        self.state().faults.push(FaultRule {
            action: action.to_string(),
            code: code.to_string(),
            status,
            remaining: times,
        });
    }

    /// The next `n` `DescribeAutoScalingInstances` answers say `InService`, whatever the
    /// instance's state: the API lags behind instance metadata, as it may for a while after
    /// a termination begins.
    pub fn lag_describes(&self, n: usize) {
        self.state().stale_describes = n;
    }

    pub fn clear_faults(&self) {
        self.state().faults.clear();
    }

    /// The next `n` successful calls of `action` are applied and then answered
    /// `InternalFailure` (500), as if the answer were lost on the way back: the journal
    /// records them as the successes they were.
    pub fn lose_next(&self, action: &str, n: usize) {
        if n > 0 {
            self.state().lose.push((action.to_string(), n));
        }
    }

    /// How many calls were applied and their answers lost so far.
    pub fn answers_lost(&self) -> usize {
        self.state().answers_lost
    }
}

/// Applies every elapsed timeout: the default result, then termination.
fn expire(s: &mut State, now: Instant) {
    let State {
        instances, journal, ..
    } = s;
    for (id, rec) in instances.iter_mut() {
        let Some(w) = &rec.wait else { continue };
        // A heartbeat never pushes the heartbeat deadline past the cap, so the earlier of
        // the two is when the wait ends, and it is the cap when they meet.
        let at = w.heartbeat_deadline.min(w.global_deadline);
        if now < at {
            continue;
        }
        let global = w.global_deadline <= w.heartbeat_deadline;
        journal.push(Entry {
            at,
            instance: Some(id.clone()),
            happening: Happening::TimedOut {
                global,
                result: w.hook.default_result.clone(),
            },
        });
        journal.push(Entry {
            at,
            instance: Some(id.clone()),
            happening: Happening::Terminated,
        });
        rec.wait = None;
        rec.state = LifecycleState::Terminated;
    }
}

/// An AWS error answer.
struct ApiError {
    status: u16,
    code: String,
    message: String,
}

fn validation(message: impl Into<String>) -> ApiError {
    ApiError {
        status: 400,
        code: "ValidationError".into(),
        message: message.into(),
    }
}

async fn handle(
    axum::extract::State(shared): axum::extract::State<Shared>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let params: BTreeMap<String, String> = url::form_urlencoded::parse(&body)
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    let action = params.get("Action").cloned().unwrap_or_default();
    let instance = params.get("InstanceId").cloned().or_else(|| {
        params
            .get("InstanceIds.member.1")
            .cloned()
            .filter(|_| action == "DescribeAutoScalingInstances")
    });
    let now = Instant::now();
    let mut s = lock(&shared);
    expire(&mut s, now);
    s.next_request += 1;
    let request_id = format!("00000000-0000-4000-8000-{:012x}", s.next_request);
    let result = answer(&mut s, &headers, &action, &params, now);
    let lost = result.is_ok()
        && match s
            .lose
            .iter_mut()
            .find(|(a, left)| *a == action && *left > 0)
        {
            Some(rule) => {
                rule.1 -= 1;
                true
            }
            None => false,
        };
    s.lose.retain(|(_, left)| *left > 0);
    s.answers_lost += usize::from(lost);
    s.journal.push(Entry {
        at: now,
        instance: instance.clone(),
        happening: Happening::Call {
            action: action.clone(),
            instance,
            error: result.as_ref().err().map(|e| e.code.clone()),
        },
    });
    drop(s);
    let result = if lost {
        Err(ApiError {
            status: 500,
            code: "InternalFailure".into(),
            message: "injected: the call was applied and its answer lost".into(),
        })
    } else {
        result
    };
    let (status, xml) = match result {
        Ok(inner) => (
            StatusCode::OK,
            format!(
                "<{action}Response xmlns=\"{XMLNS}\"><{action}Result>{inner}</{action}Result><ResponseMetadata><RequestId>{request_id}</RequestId></ResponseMetadata></{action}Response>"
            ),
        ),
        Err(e) => (
            StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST),
            format!(
                "<ErrorResponse xmlns=\"{XMLNS}\"><Error><Type>Sender</Type><Code>{}</Code><Message>{}</Message></Error><RequestId>{request_id}</RequestId></ErrorResponse>",
                escape(&e.code),
                escape(&e.message)
            ),
        ),
    };
    let mut r = (status, xml).into_response();
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/xml"));
    r
}

fn answer(
    s: &mut State,
    headers: &HeaderMap,
    action: &str,
    p: &BTreeMap<String, String>,
    now: Instant,
) -> Result<String, ApiError> {
    let form = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/x-www-form-urlencoded"));
    if !form {
        return Err(validation("the Query protocol needs a form-encoded body"));
    }
    let signed = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("AWS4-HMAC-SHA256 "));
    if !signed {
        return Err(ApiError {
            status: 403,
            code: "MissingAuthenticationToken".into(),
            message: "Request is missing Authentication Token".into(),
        });
    }
    if p.get("Version").map(String::as_str) != Some(VERSION) {
        return Err(ApiError {
            status: 400,
            code: "InvalidAction".into(),
            message: format!("Version must be {VERSION}"),
        });
    }
    if let Some(i) = s
        .faults
        .iter()
        .position(|f| f.action == action && f.remaining != Some(0))
    {
        let f = &mut s.faults[i];
        if let Some(n) = &mut f.remaining {
            *n -= 1;
        }
        return Err(ApiError {
            status: f.status,
            code: f.code.clone(),
            message: format!("injected {} for {action}", f.code),
        });
    }
    let need = |k: &str| {
        p.get(k)
            .filter(|v| !v.is_empty())
            .cloned()
            .ok_or_else(|| validation(format!("1 validation error detected: Value null at '{k}' failed to satisfy constraint: Member must not be null")))
    };
    match action {
        "DescribeAutoScalingInstances" => {
            let ids: Vec<&String> = (1..)
                .map_while(|i| p.get(&format!("InstanceIds.member.{i}")))
                .collect();
            let mut out = String::from("<AutoScalingInstances>");
            for (id, rec) in &s.instances {
                if !ids.is_empty() && !ids.contains(&id) {
                    continue;
                }
                // Terminated instances leave the group.
                if rec.state == LifecycleState::Terminated {
                    continue;
                }
                let state = if s.stale_describes > 0 {
                    LifecycleState::InService
                } else {
                    rec.state
                };
                out.push_str(&format!(
                    "<member><InstanceId>{}</InstanceId><InstanceType>c5.xlarge</InstanceType><AutoScalingGroupName>{}</AutoScalingGroupName><AvailabilityZone>us-west-2a</AvailabilityZone><LifecycleState>{}</LifecycleState><HealthStatus>HEALTHY</HealthStatus><ProtectedFromScaleIn>false</ProtectedFromScaleIn></member>",
                    escape(id),
                    escape(&rec.group),
                    state.as_str()
                ));
            }
            s.stale_describes = s.stale_describes.saturating_sub(1);
            out.push_str("</AutoScalingInstances>");
            Ok(out)
        }
        "DescribeLifecycleHooks" => {
            let group = need("AutoScalingGroupName")?;
            let Some(hooks) = s.groups.get(&group) else {
                return Err(validation(format!("Group {group} not found")));
            };
            let names: Vec<&String> = (1..)
                .map_while(|i| p.get(&format!("LifecycleHookNames.member.{i}")))
                .collect();
            let mut out = String::from("<LifecycleHooks>");
            for h in hooks
                .iter()
                .filter(|h| names.is_empty() || names.contains(&&h.name))
            {
                out.push_str(&format!(
                    "<member><LifecycleHookName>{}</LifecycleHookName><AutoScalingGroupName>{}</AutoScalingGroupName><LifecycleTransition>{}</LifecycleTransition><HeartbeatTimeout>{}</HeartbeatTimeout><GlobalTimeout>{}</GlobalTimeout><DefaultResult>{}</DefaultResult></member>",
                    escape(&h.name),
                    escape(&group),
                    escape(&h.transition),
                    h.heartbeat_timeout_secs,
                    h.global_timeout_secs(),
                    escape(&h.default_result)
                ));
            }
            out.push_str("</LifecycleHooks>");
            Ok(out)
        }
        "RecordLifecycleActionHeartbeat" | "CompleteLifecycleAction" => {
            let group = need("AutoScalingGroupName")?;
            let hook = need("LifecycleHookName")?;
            let result = if action == "CompleteLifecycleAction" {
                let r = need("LifecycleActionResult")?;
                if r != "CONTINUE" && r != "ABANDON" {
                    return Err(validation(format!(
                        "LifecycleActionResult must be CONTINUE or ABANDON, not {r}"
                    )));
                }
                Some(r)
            } else {
                None
            };
            let Some(id) = p.get("InstanceId").cloned() else {
                return Err(validation(
                    "either InstanceId or LifecycleActionToken must be given (this emulator takes InstanceId)",
                ));
            };
            let no_action = || {
                validation(format!(
                    "No active Lifecycle Action found with instance ID {id}"
                ))
            };
            let rec = s.instances.get_mut(&id).ok_or_else(no_action)?;
            let waiting =
                rec.group == group && rec.wait.as_ref().is_some_and(|w| w.hook.name == hook);
            if !waiting {
                return Err(no_action());
            }
            let entry = |happening| Entry {
                at: now,
                instance: Some(id.clone()),
                happening,
            };
            match result {
                None => {
                    if let Some(w) = &mut rec.wait {
                        w.heartbeat_deadline = (now
                            + Duration::from_secs(w.hook.heartbeat_timeout_secs))
                        .min(w.global_deadline);
                    }
                    s.journal.push(entry(Happening::HeartbeatRecorded));
                }
                Some(result) => {
                    rec.wait = None;
                    rec.state = LifecycleState::Terminated;
                    s.journal.push(entry(Happening::Completed { result }));
                    s.journal.push(entry(Happening::Terminated));
                }
            }
            Ok(String::new())
        }
        other => Err(ApiError {
            status: 400,
            code: "InvalidAction".into(),
            message: format!("The action {other} is not valid for this web service"),
        }),
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests;
