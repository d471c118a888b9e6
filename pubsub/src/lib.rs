//! lastcall-pubsub: polls GameLift FleetIQ for the viability of every game-server instance
//! and publishes each status on Redis, as a drop-in for the original FleetIQ adapter's pubsub
//! app (same channel, same message bytes, same groups file) without its failure modes.
//!
//! Layers, each usable on its own: [`config`] (flags and env), [`groups`] (the groups file),
//! [`poller`] (GameLift paging and backoff), [`publisher`] (pipelined Redis writes),
//! [`metrics`], and [`run`] (the cycle, the loop and the process). [`webhook`] serves
//! Agones' FleetAutoscaler webhook: the Buffer policy plus the Ready servers that draining
//! nodes are about to lose, read from the drain state agents publish.
#![forbid(unsafe_code)]

pub mod config;
pub mod groups;
pub mod metrics;
pub mod poller;
pub mod publisher;
pub mod rate;
pub mod run;
pub mod webhook;

pub use config::Config;
pub use poller::gamelift_client;
pub use run::{CycleReport, Pubsub};
