//! lastcall-pubsub: polls GameLift FleetIQ for the viability of every game-server instance
//! and publishes each status on Redis, as a drop-in for the original FleetIQ adapter's pubsub
//! app (same channel, same message bytes, same groups file) without its failure modes.
//!
//! Layers, each usable on its own, and imports flow one way (down this list):
//! - [`metrics`] (metric definitions and their label values) and [`rate`] at the bottom;
//!   [`config`] (flags and env, the webhook's own flags flattened in from
//!   [`webhook::settings`]) and [`groups`] (the groups file) beside them;
//! - [`publisher`] (atomic Redis writes), [`poller`] (GameLift paging and backoff, producing
//!   what the publisher takes), and [`webhook`] (Agones' FleetAutoscaler webhook: the Buffer
//!   policy plus what draining nodes are about to lose, read from the drain state agents
//!   publish), which imports nothing of the poller or publisher;
//! - [`queue`] (queue mode: SQS → the Node of each event's instance), beside the poller;
//! - [`liveness`] (is the polling loop turning) beside [`run`];
//! - [`run`] on top: the cycle, the loop and the process.
#![forbid(unsafe_code)]

pub mod config;
pub mod groups;
pub mod liveness;
pub mod metrics;
pub mod poller;
pub mod publisher;
pub mod queue;
pub mod rate;
pub mod run;
pub mod webhook;

pub use config::Config;
pub use poller::gamelift_client;
pub use run::{CycleReport, Pubsub};
