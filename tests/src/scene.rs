//! The scene a drain scenario plays on: a node with Ready and Allocated game servers, Agones'
//! PDB, and the agent started with the chart's arguments.
//!
//! `on_box` sets it up on the box (a real control plane, the Agones stand-in, the agent
//! process); the box tests build on it directly.

pub mod on_box;
