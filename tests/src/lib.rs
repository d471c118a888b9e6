//! lastcall's test kit: faithful stand-ins for the systems lastcall talks to.
//!
//! Real clients (`kube::Client`, `aws-sdk-gamelift`, `reqwest`, `redis`) talk to
//! these emulators over real HTTP / TCP, so what is tested is the production code path.
#![forbid(unsafe_code)]

pub mod agent;
pub mod bins;
pub mod cluster;
pub mod demo;
pub mod eventually;
pub mod gamelift;
pub mod gce;
pub mod imds;
pub mod kube;
pub mod redis;
pub mod webhook;
pub mod world;
