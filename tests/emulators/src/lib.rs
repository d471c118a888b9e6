//! Faithful stand-ins for the systems lastcall talks to, and the helpers every test shares.
//!
//! Real clients (`kube::Client`, `aws-sdk-gamelift`, `reqwest`, `redis`) talk to these
//! emulators over real HTTP / TCP, so what is tested is the production code path.
//!
//! This crate is separate from `lastcall-testkit` and imports nothing from lastcall itself
//! (agent, pubsub, common): each lastcall crate can then take it as a dev-dependency and
//! test a source against its emulator right beside the source, and no emulator can borrow
//! the parsing or the assumptions of the code it is there to check.
#![forbid(unsafe_code)]

pub mod autoscaling;
pub mod azure;
pub mod bins;
pub mod cluster;
pub mod elasticmq;
pub mod eventually;
pub mod gamelift;
pub mod gce;
pub mod imds;
pub mod kube;
pub mod moto;
pub mod net;
pub mod process;
pub mod redis;
pub mod tools;
pub mod webhook_receiver;
