//! Pieces shared by `lastcall-agent` and `lastcall-pubsub`.
//!
//! Kept in its own crate so that the pubsub service does not link the agent, and so the
//! wire contracts between them (the FleetIQ status message, the drain state the
//! FleetAutoscaler webhook reads) have exactly one definition.
#![forbid(unsafe_code)]

pub mod admin;
pub mod aws_events;
pub mod backoff;
pub mod cli;
pub mod drain_state;
pub mod duration;
pub mod fleetiq;
pub mod redis_conn;
pub mod redis_url;
pub mod shutdown;
pub mod telemetry;
