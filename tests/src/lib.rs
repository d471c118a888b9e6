//! lastcall's test kit: the agent run in-process, whole test worlds, the demo, and the
//! end-to-end scenarios and benchmarks under `tests/tests` and `tests/benches`.
//!
//! The emulators and the shared helpers live in `lastcall-emulators` (`tests/emulators`),
//! which imports nothing from lastcall; they are re-exported here under their old paths.
#![forbid(unsafe_code)]

pub use lastcall_emulators::{
    autoscaling, bins, cluster, eventually, gamelift, gce, imds, kube, moto, net, process, redis,
    tools, webhook_receiver,
};

pub mod agent;
pub mod agent_writes;
pub mod asg;
pub mod bench;
pub mod conformance;
pub mod demo;
pub mod demo_box;

pub mod kube_box;
pub mod paths;
pub mod promises;
pub mod queue;
pub mod scale;
pub mod scale_agents;
pub mod scale_redis;
pub mod scale_restart;
pub mod scene;
pub mod timeline;
pub mod webhook;
pub mod world;
