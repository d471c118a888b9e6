//! lastcall-agent: keeps game sessions alive while the node under them is taken away.
//!
//! Data flows one way: sources publish notices, a pure policy turns notices and observed
//! state into a plan, the reconciler applies the plan through the actuator.
#![forbid(unsafe_code)]

pub mod actuator;
pub mod config;
pub mod cooperation;
pub mod deadline;
pub mod drain_events;
pub mod drain_state;
pub mod drain_timing;
pub mod dry_run;
pub mod eviction;
pub mod fleetiq;
pub mod gameserver_selector;
pub mod keys;
pub mod kube_client;
pub mod metrics;
pub mod metrics_auth;
pub mod node_restriction;
pub mod notice;
pub mod notify;
pub mod observed;
pub mod own_writes;
pub mod owner;
pub mod owner_handle;
pub mod policy;
pub mod progress;
pub mod reconciler;
pub mod request_deadline;
pub mod reverted;
pub mod run;
pub mod sources;
pub mod throttle;
pub mod watch_pacing;
pub mod watches;
