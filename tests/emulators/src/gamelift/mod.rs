//! An emulated GameLift FleetIQ endpoint speaking Smithy RPC v2 CBOR, the protocol
//! `aws-sdk-gamelift` 1.137 uses, so the real SDK client can be pointed at it, and the
//! AWS JSON 1.1 protocol (`POST /`, `X-Amz-Target: GameLift.<Operation>`) that
//! boto3-based tools speak, so Python tooling can run against it unchanged.
//!
//! Every request is checked against the service model's constraints (required members,
//! lengths, patterns, enums) before it runs, and refused with `ValidationException`
//! as the real service does; see [`validate`].
//!
//! Wire facts (checked against the SDK sources):
//! - requests: `POST /service/GameLift/operation/<Operation>`, `content-type: application/cbor`,
//!   `smithy-protocol: rpc-v2-cbor`, body an (indefinite-length) CBOR map;
//! - replies carry the same two headers; timestamps are tag 1 around epoch seconds;
//! - errors are any non-2xx status with a CBOR map `{"__type": "com.amazonaws.gamelift#<Name>",
//!   "Message": ..}`. The SDK keeps what follows `#` (a bare name works too) and maps it onto the
//!   operation's error enum; a name the operation does not model (`ThrottlingException`)
//!   surfaces as an unhandled error whose `code()` is that name.
//!
//! Retries: the SDK's standard retry mode (3 attempts) retries `ThrottlingException` by error
//! code and 500/502/503/504 by status. Use [`GameLiftEmulator::sdk_client_without_retries`]
//! to see raw errors.
//!
//! See `docs/testing/cloud.md` for what is and is not emulated.

mod cbor;
mod faults;
mod json;
mod ops;
mod state;
pub mod validate;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use tokio_util::sync::CancellationToken;

use self::faults::Faults;
use self::ops::ApiError;
use self::state::World;

pub use self::ops::MAX_INSTANCE_IDS;
pub use self::state::{CLAIM_DURATION, DEFAULT_PAGE_SIZE};

/// A realistic, stable EC2 instance id for a test name (a node name, say), so test worlds
/// pass the service's `^i-[0-9a-zA-Z]{17}$` pattern: the name's letters and digits,
/// left-padded with zeros (`n1` → `i-000000000000000n1`, `node-a` → `i-000000000000nodea`),
/// or, for a longer name, `i-0` and 16 hex digits of its FNV-1a hash.
pub fn instance_id(name: &str) -> String {
    let alnum: String = name.chars().filter(char::is_ascii_alphanumeric).collect();
    if !alnum.is_empty() && alnum.len() <= 17 {
        return format!("i-{alnum:0>17}");
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("i-0{h:016x}")
}

/// Status of an instance in a game server group, as `DescribeGameServerInstances` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InstanceStatus {
    Active,
    Draining,
    SpotTerminating,
}

impl InstanceStatus {
    /// The wire value (`ACTIVE`, `DRAINING`, `SPOT_TERMINATING`).
    pub fn as_str(self) -> &'static str {
        match self {
            InstanceStatus::Active => "ACTIVE",
            InstanceStatus::Draining => "DRAINING",
            InstanceStatus::SpotTerminating => "SPOT_TERMINATING",
        }
    }
}

/// What the emulator knows about one game server (kept after deregistration).
#[derive(Clone, Debug)]
pub struct GameServerRecord {
    pub group: String,
    pub game_server_id: String,
    pub instance_id: Option<String>,
    /// Claimed by `ClaimGameServer` less than [`CLAIM_DURATION`] ago.
    pub claimed: bool,
    /// `AVAILABLE` or `UTILIZED`.
    pub utilization: String,
    /// Number of accepted `UpdateGameServer HealthCheck=HEALTHY` calls.
    pub health_checks: usize,
    pub registered: bool,
    /// Number of successful `DeregisterGameServer` calls.
    pub deregistered_count: usize,
}

/// One call the emulator answered, in the order it was handled.
#[derive(Clone, Debug)]
pub struct Call {
    pub seq: u64,
    pub at: SystemTime,
    /// Operation name (or the request path if it was not an operation URL).
    pub op: String,
    /// The decoded request (`null` if it could not be decoded).
    pub input: serde_json::Value,
    /// `"ok"` or the error name (`ConflictException`, `ThrottlingException`, ...).
    pub outcome: String,
}

/// A bad `DescribeGameServerInstances` entry, for tests of how callers handle bad answers.
#[derive(Clone, Copy, Debug)]
pub enum Malformed {
    /// `InstanceStatus` is `"EXPLODING"`, which the SDK reports as `Unknown(..)`.
    UnknownStatus,
    /// The `InstanceId` member is absent from the CBOR map.
    MissingInstanceId,
    /// The `InstanceStatus` member is absent from the CBOR map.
    MissingStatus,
}

#[derive(Default)]
pub(crate) struct Inner {
    world: World,
    faults: Faults,
    journal: Vec<Call>,
    next_seq: u64,
    gate: Arc<HangGate>,
    /// The journal `seq` of each call applied whose answer was then lost
    /// ([`GameLiftEmulator::lose_next`]).
    answers_lost: Vec<u64>,
}

/// Holds hung calls until released; counts them while held.
struct HangGate {
    release: tokio::sync::watch::Sender<u64>,
    hung: std::sync::atomic::AtomicUsize,
}

impl Default for HangGate {
    fn default() -> Self {
        HangGate {
            release: tokio::sync::watch::Sender::new(0),
            hung: std::sync::atomic::AtomicUsize::new(0),
        }
    }
}

impl HangGate {
    /// Waits for the next release; dropping the future (the client went away) ends it too.
    async fn hold(&self) {
        use std::sync::atomic::Ordering;
        struct Count<'a>(&'a std::sync::atomic::AtomicUsize);
        impl Drop for Count<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        let mut rx = self.release.subscribe();
        self.hung.fetch_add(1, Ordering::SeqCst);
        let _count = Count(&self.hung);
        // The sender lives as long as the gate, so this only returns on a release.
        let _ = rx.changed().await;
    }
}

pub(crate) type Shared = Arc<Mutex<Inner>>;

pub(crate) fn lock(shared: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    // A panic while holding the lock leaves consistent data behind (every mutation is
    // validated first), so a poisoned lock is still usable.
    shared.lock().unwrap_or_else(|p| p.into_inner())
}

/// A FleetIQ endpoint on `127.0.0.1`, alive until dropped.
pub struct GameLiftEmulator {
    addr: SocketAddr,
    shared: Shared,
    stop: CancellationToken,
}

impl Drop for GameLiftEmulator {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl GameLiftEmulator {
    /// Starts the emulator on a free `127.0.0.1` port.
    pub async fn start() -> anyhow::Result<GameLiftEmulator> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let shared: Shared = Arc::default();
        let app = Router::new()
            .route("/service/GameLift/operation/{op}", post(operation))
            .route("/", post(json::operation))
            .fallback(not_an_operation)
            .with_state(shared.clone());
        let (stop, _) = crate::net::serve(listener, app, "the GameLift emulator");
        Ok(GameLiftEmulator { addr, shared, stop })
    }

    /// Base URL to pass as the SDK's `endpoint_url`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn inner(&self) -> MutexGuard<'_, Inner> {
        lock(&self.shared)
    }

    /// Creates a game server group (idempotent) and returns its ARN.
    pub fn add_group(&self, name: &str) -> String {
        self.inner().world.add_group(name)
    }

    /// The ARN the emulator uses for a group of this name.
    pub fn group_arn(name: &str) -> String {
        World::arn_for(name)
    }

    /// Adds instances to a group (creating the group if needed); an instance already in the
    /// group only gets its status set.
    ///
    /// # Panics
    /// If an id is not one the service accepts (`^i-[0-9a-zA-Z]{17}$`): the real service
    /// never reports such an instance, so that is a bug in the test. [`instance_id`] makes
    /// realistic ids.
    pub fn add_instances(&self, group: &str, ids: &[String], status: InstanceStatus) {
        if let Some(bad) = ids.iter().find(|id| !validate::instance_id_ok(id)) {
            panic!(
                "add_instances: {bad:?} is not an EC2 instance id ({}); use gamelift::instance_id",
                validate::INSTANCE_ID_PATTERN
            );
        }
        let mut inner = self.inner();
        inner.world.add_group(group);
        if let Some(g) = inner.world.groups.get_mut(group) {
            for id in ids {
                match g.instances.iter_mut().find(|(i, _)| i == id) {
                    Some(entry) => entry.1 = status,
                    None => g.instances.push((id.clone(), status)),
                }
            }
        }
    }

    /// Removes instances from a group (scale-in); unknown ids are ignored.
    pub fn remove_instances(&self, group: &str, ids: &[String]) {
        if let Some(g) = self.inner().world.groups.get_mut(group) {
            g.instances.retain(|(i, _)| !ids.contains(i));
        }
    }

    /// Sets the status of an instance, whichever group holds it.
    ///
    /// # Panics
    /// If no group holds the instance: that is a bug in the test.
    pub fn set_instance_status(&self, instance_id: &str, status: InstanceStatus) {
        let mut inner = self.inner();
        let entry = inner
            .world
            .groups
            .values_mut()
            .flat_map(|g| g.instances.iter_mut())
            .find(|(i, _)| i == instance_id);
        match entry {
            Some(entry) => entry.1 = status,
            None => panic!("set_instance_status: no group holds instance {instance_id}"),
        }
    }

    /// The instances of a group in paging order (empty for an unknown group).
    pub fn instances(&self, group: &str) -> Vec<(String, InstanceStatus)> {
        self.inner()
            .world
            .groups
            .get(group)
            .map(|g| g.instances.clone())
            .unwrap_or_default()
    }

    /// Deletes a group with its instances and game servers (like `DeleteGameServerGroup`);
    /// later calls naming it get `NotFoundException`.
    pub fn remove_group(&self, name: &str) {
        let mut inner = self.inner();
        inner.world.groups.remove(name);
        inner.world.servers.retain(|(g, _), _| g != name);
    }

    /// The emulator's record of a game server, registered or not.
    pub fn game_server(&self, group: &str, id: &str) -> Option<GameServerRecord> {
        let now = SystemTime::now();
        self.inner()
            .world
            .servers
            .get(&(group.to_string(), id.to_string()))
            .map(|gs| gs.record(now))
    }

    /// GameLift drops a game server on its own, as it does with one whose heartbeats
    /// stopped: unregistered, with no `DeregisterGameServer` call counted. `false` when there
    /// was no such registered server.
    pub fn forget_game_server(&self, group: &str, id: &str) -> bool {
        let mut inner = self.inner();
        match inner
            .world
            .servers
            .get_mut(&(group.to_string(), id.to_string()))
        {
            Some(gs) if gs.registered => {
                gs.registered = false;
                gs.claimed_at = None;
                true
            }
            _ => false,
        }
    }

    /// Lets every current claim lapse, as if [`CLAIM_DURATION`] had passed.
    pub fn expire_claims(&self) {
        for gs in self.inner().world.servers.values_mut() {
            gs.claimed_at = None;
        }
    }

    /// Every call handled so far, in order.
    pub fn calls(&self) -> Vec<Call> {
        self.inner().journal.clone()
    }

    /// Number of calls of one operation, whatever their outcome (retries count).
    pub fn count(&self, op: &str) -> usize {
        self.inner().journal.iter().filter(|c| c.op == op).count()
    }

    pub fn clear_calls(&self) {
        self.inner().journal.clear();
    }

    /// Page size for `DescribeGameServerInstances` calls without `Limit`
    /// (default [`DEFAULT_PAGE_SIZE`]; 0 is treated as 1).
    pub fn set_default_page_size(&self, n: usize) {
        self.inner().world.default_page_size = n.max(1);
    }

    /// Seeds the RNG behind [`set_throttle_ratio`](Self::set_throttle_ratio).
    pub fn set_seed(&self, seed: u64) {
        self.inner().faults.set_seed(seed);
    }

    /// That fraction (0..=1) of calls answers `ThrottlingException`, drawn from a seeded RNG.
    pub fn set_throttle_ratio(&self, ratio: f64) {
        self.inner().faults.set_throttle_ratio(ratio);
    }

    /// The next `n` calls (any operation) answer `ThrottlingException` (HTTP 400).
    pub fn throttle_next(&self, n: usize) {
        self.inner().faults.throttle_next(n);
    }

    /// The next `n` calls of `op` (`"*"` for any) fail with `status`. The error name follows
    /// the status: 5xx `InternalServiceException`, 429 `ThrottlingException`, 401/403
    /// `UnauthorizedException`, 404 `NotFoundException`, 409 `ConflictException`, other
    /// `InvalidRequestException`.
    pub fn fail_next(&self, op: &str, n: usize, status: u16) {
        self.inner()
            .faults
            .fail_next(op, n, ApiError::injected(status));
    }

    /// The next `n` calls for page `page` (0-based, at the default page size) of `group`'s
    /// `DescribeGameServerInstances` fail with `status` (named as in
    /// [`fail_next`](Self::fail_next)); other pages and groups answer as usual. For
    /// retries of one page failing while the pages before it were served.
    pub fn fail_page(&self, group: &str, page: usize, n: usize, status: u16) {
        let mut inner = self.inner();
        let start = page.saturating_mul(inner.world.default_page_size.max(1));
        inner
            .faults
            .fail_page(group, start, n, ApiError::injected(status));
    }

    /// Like [`fail_next`](Self::fail_next) with an explicit error name.
    pub fn fail_next_with(&self, op: &str, n: usize, status: u16, code: &str) {
        self.inner().faults.fail_next(
            op,
            n,
            ApiError::new(status, code, format!("injected {code} ({status})")),
        );
    }

    /// The next `n` calls of `op` (`"*"` for any) are accepted and never answered: the
    /// client waits until its own timeout, or until [`release_hangs`](Self::release_hangs)
    /// lets them be served normally. A call the client gave up on is never served (nor
    /// journaled).
    pub fn hang_next(&self, op: &str, n: usize) {
        self.inner().faults.hang_next(op, n);
    }

    /// The next `n` calls of `op` (`"*"` for any) that succeed are applied and then
    /// answered `InternalServiceException` (500), as if the answer were lost on the way
    /// back: the world changed, the client cannot know. The journal records what was
    /// applied (`ok`).
    pub fn lose_next(&self, op: &str, n: usize) {
        self.inner().faults.lose_next(op, n);
    }

    /// The journal `seq` of every call applied whose answer was then lost: proof the fault
    /// met a call, and which.
    pub fn answers_lost(&self) -> Vec<u64> {
        self.inner().answers_lost.clone()
    }

    /// Serves every hung call now and drops the hang rules not used yet.
    pub fn release_hangs(&self) {
        let mut inner = self.inner();
        inner.faults.clear_hang_rules();
        inner.gate.release.send_modify(|g| *g += 1);
    }

    /// Calls held by [`hang_next`](Self::hang_next) right now.
    pub fn hung_now(&self) -> usize {
        self.inner()
            .gate
            .hung
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Delay before every answer.
    pub fn set_latency(&self, d: Duration) {
        self.inner().faults.latency = d;
    }

    /// Makes `DescribeGameServerInstances` for `group` corrupt the first entry of every page.
    ///
    /// # Panics
    /// If the group does not exist: that is a bug in the test.
    pub fn set_malformed(&self, group: &str, m: Option<Malformed>) {
        match self.inner().world.groups.get_mut(group) {
            Some(g) => g.malformed = m,
            None => panic!("set_malformed: no group {group}"),
        }
    }

    /// SDK configuration for this emulator: region us-west-2, static test credentials,
    /// default (standard) retries. The retry partition is private to this emulator, so one
    /// test draining the SDK's retry quota cannot starve another test in the same process.
    pub fn sdk_config_builder(&self) -> aws_sdk_gamelift::config::Builder {
        sdk_config_for(
            &self.url(),
            &format!("lastcall-gamelift-emulator-{}", self.addr.port()),
        )
    }

    /// A real SDK client pointed at this emulator, with default retries.
    pub async fn sdk_client(&self) -> aws_sdk_gamelift::Client {
        aws_sdk_gamelift::Client::from_conf(self.sdk_config_builder().build())
    }

    /// A real SDK client with retries disabled, to see raw errors.
    pub async fn sdk_client_without_retries(&self) -> aws_sdk_gamelift::Client {
        use aws_sdk_gamelift::config::retry::RetryConfig;
        aws_sdk_gamelift::Client::from_conf(
            self.sdk_config_builder()
                .retry_config(RetryConfig::disabled())
                .build(),
        )
    }
}

const CBOR: &str = "application/cbor";
const PROTOCOL: &str = "rpc-v2-cbor";

/// Checks the two protocol headers the SDK always sends.
fn check_headers(headers: &HeaderMap, body: &[u8]) -> Result<(), ApiError> {
    let protocol = headers.get("smithy-protocol").and_then(|v| v.to_str().ok());
    if protocol != Some(PROTOCOL) {
        return Err(ApiError::serialization(format!(
            "smithy-protocol header must be {PROTOCOL}, got {protocol:?}"
        )));
    }
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    if !body.is_empty() && content_type != Some(CBOR) {
        return Err(ApiError::serialization(format!(
            "content-type must be {CBOR}, got {content_type:?}"
        )));
    }
    Ok(())
}

async fn operation(
    State(shared): State<Shared>,
    Path(op): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let decoded = check_headers(&headers, &body).and_then(|()| {
        cbor::decode_request(&body).map_err(|e| ApiError::serialization(e.to_string()))
    });
    let (seq, result) = run(&shared, op, decoded).await;
    reply(seq, result)
}

/// Runs one decoded call, whatever protocol carried it: hang and latency faults first,
/// then injected failures, then model validation, then the operation. Returns the
/// journal sequence number and the outcome.
pub(crate) async fn run(
    shared: &Shared,
    op: String,
    decoded: Result<serde_json::Value, ApiError>,
) -> (u64, Result<ops::Reply, ApiError>) {
    let hang = {
        let mut inner = lock(shared);
        inner.faults.take_hang(&op).then(|| inner.gate.clone())
    };
    if let Some(gate) = hang {
        gate.hold().await;
    }
    let latency = lock(shared).faults.latency;
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
    let now = SystemTime::now();
    let mut inner = lock(shared);
    let inner = &mut *inner;
    let (input, result) = match decoded {
        Ok(input) => {
            let injected = inner
                .faults
                .take_page(&op, &input)
                .or_else(|| inner.faults.take(&op));
            let result = match injected {
                Some(injected) => Err(injected),
                None => validate::input(&op, &input)
                    .and_then(|()| ops::dispatch(&mut inner.world, &op, &input, now)),
            };
            (input, result)
        }
        Err(e) => (serde_json::Value::Null, Err(e)),
    };
    let lost = result.is_ok() && inner.faults.take_lose(&op);
    let seq = record(inner, now, op, input, &result);
    if lost {
        inner.answers_lost.push(seq);
        return (
            seq,
            Err(ApiError::new(
                500,
                "InternalServiceException",
                "injected: the call was applied and its answer lost",
            )),
        );
    }
    (seq, result)
}

async fn not_an_operation(State(shared): State<Shared>, uri: Uri) -> Response {
    let result = Err(ApiError::new(
        404,
        "UnknownOperationException",
        format!("{uri} is not a GameLift operation URL"),
    ));
    let seq = record(
        &mut lock(&shared),
        SystemTime::now(),
        uri.path().to_string(),
        serde_json::Value::Null,
        &result,
    );
    reply(seq, result)
}

pub(crate) fn record(
    inner: &mut Inner,
    at: SystemTime,
    op: String,
    input: serde_json::Value,
    result: &Result<ops::Reply, ApiError>,
) -> u64 {
    let seq = inner.next_seq;
    inner.next_seq += 1;
    let outcome = match result {
        Ok(_) => "ok".to_string(),
        Err(e) => e.code.clone(),
    };
    inner.journal.push(Call {
        seq,
        at,
        op,
        input,
        outcome,
    });
    seq
}

fn reply(seq: u64, result: Result<ops::Reply, ApiError>) -> Response {
    let (status, body) = match result {
        Ok(Some(value)) => (StatusCode::OK, cbor::encode(&value)),
        Ok(None) => (StatusCode::OK, Vec::new()),
        Err(e) => (
            StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            cbor::error_body(&e.code, &e.message),
        ),
    };
    let mut response = (status, body).into_response();
    let h = response.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(CBOR));
    h.insert("smithy-protocol", HeaderValue::from_static(PROTOCOL));
    if let Ok(id) = HeaderValue::from_str(&format!("lastcall-emulator-{seq}")) {
        h.insert("x-amzn-requestid", id);
    }
    response
}

/// An SDK configuration for the emulator at `url` (in this process or another), with test
/// credentials and its own retry partition (the client-side retry quota), as each agent
/// process has.
pub fn sdk_config_for(url: &str, retry_partition: &str) -> aws_sdk_gamelift::config::Builder {
    use aws_sdk_gamelift::config::retry::RetryPartition;
    use aws_sdk_gamelift::config::{BehaviorVersion, Credentials, Region};
    aws_sdk_gamelift::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-west-2"))
        .credentials_provider(Credentials::new(
            "AKIDLASTCALLTEST",
            "lastcall-test-secret",
            None,
            None,
            "lastcall-testkit",
        ))
        .endpoint_url(url)
        .retry_partition(RetryPartition::new(retry_partition.to_string()))
}
