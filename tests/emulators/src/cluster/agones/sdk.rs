//! The game's SDK calls that change its GameServer's state, as Agones' SDK server writes
//! them (`pkg/sdkserver/sdkserver.go`, `updateState`): a server being deleted (a
//! deletionTimestamp, or state Shutdown) or Unhealthy is left as it is ("there is no
//! escaping"); otherwise the state is set, `Reserve` sets or clears `status.reservedUntil`
//! (a duration of 0 reserves until allocated or shut down) and `Allocate` rewrites the
//! `agones.dev/last-allocated` annotation.
//!
//! On top of Agones' rule the test kit refuses a call from a state the game could not be
//! in when it makes it (`Ready()` before its pod runs, `Allocate()` of a server still
//! starting): a test that asks for one has a bug, and fails saying so.

use serde_json::{Value, json};

use crate::cluster::objects::{GameServerState, GameServerView, keys};
use crate::cluster::writes::object_at;
use crate::kube::store::now_rfc3339;

/// An SDK call that writes the GameServer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    /// `Ready()`: RequestReady; the controller then writes Ready.
    Ready,
    /// `Allocate()`: the game marks itself Allocated.
    Allocate,
    /// `Reserve(seconds)`: Reserved; 0 keeps it until allocated or shut down.
    Reserve { seconds: u32 },
    /// `Shutdown()`: Shutdown; the controller then deletes the server.
    Shutdown,
}

impl Call {
    pub fn name(self) -> &'static str {
        match self {
            Call::Ready => "Ready",
            Call::Allocate => "Allocate",
            Call::Reserve { .. } => "Reserve",
            Call::Shutdown => "Shutdown",
        }
    }

    /// The state the call writes.
    pub fn to(self) -> GameServerState {
        use GameServerState as S;
        match self {
            Call::Ready => S::RequestReady,
            Call::Allocate => S::Allocated,
            Call::Reserve { .. } => S::Reserved,
            Call::Shutdown => S::Shutdown,
        }
    }

    /// The states a game makes the call from (the test kit's guard, see the module).
    pub fn from(self) -> &'static [GameServerState] {
        use GameServerState as S;
        match self {
            Call::Ready => &[S::Scheduled, S::RequestReady, S::Allocated, S::Reserved],
            Call::Allocate => &[S::Ready, S::Reserved, S::Allocated],
            Call::Reserve { .. } => &[S::Scheduled, S::RequestReady, S::Ready, S::Reserved],
            Call::Shutdown => &[
                S::PortAllocation,
                S::Creating,
                S::Starting,
                S::Scheduled,
                S::RequestReady,
                S::Ready,
                S::Reserved,
                S::Allocated,
                S::Error,
                S::Unhealthy,
            ],
        }
    }
}

/// What a call did to the object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The object was changed: write it.
    Written,
    /// Agones leaves a server being deleted or Unhealthy as it is: nothing to write.
    Skipped,
}

/// A call the game could not make from the server's state (`None`: no state yet).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("SDK {call}() from state {state:?}")]
pub struct InvalidState {
    pub call: &'static str,
    pub state: Option<GameServerState>,
}

/// Applies `call` to the GameServer `obj`, as the SDK server would write it.
pub fn apply(call: Call, obj: &mut Value) -> Result<Outcome, InvalidState> {
    let view = GameServerView::parse(obj).ok();
    let state = view.as_ref().and_then(|v| v.state);
    if !state.is_some_and(|s| call.from().contains(&s)) {
        return Err(InvalidState {
            call: call.name(),
            state,
        });
    }
    if view.as_ref().is_some_and(GameServerView::is_being_deleted)
        || state == Some(GameServerState::Unhealthy)
    {
        return Ok(Outcome::Skipped);
    }
    let status = object_at(obj, &["status"]);
    status.insert("state".into(), json!(call.to().as_str()));
    match call {
        Call::Reserve { seconds } if seconds > 0 => {
            let until = k8s_openapi::jiff::Timestamp::now()
                + k8s_openapi::jiff::SignedDuration::from_secs(seconds.into());
            status.insert(
                "reservedUntil".into(),
                json!(until.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()),
            );
        }
        _ => {
            status.insert("reservedUntil".into(), Value::Null);
        }
    }
    if call == Call::Allocate {
        object_at(obj, &["metadata", "annotations"])
            .insert(keys::LAST_ALLOCATED.into(), json!(now_rfc3339()));
    }
    Ok(Outcome::Written)
}
