//! Pieces shared by `lastcall-agent` and `lastcall-pubsub`.
//!
//! Kept in its own crate so that the pubsub service does not link the agent, and so the
//! wire contract between them (the FleetIQ status message) has exactly one definition.
#![forbid(unsafe_code)]

pub mod admin;
pub mod backoff;
pub mod cli;
pub mod duration;
pub mod fleetiq;
pub mod redis_conn;
pub mod redis_url;
pub mod shutdown;
pub mod telemetry;
