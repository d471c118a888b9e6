//! Everything FleetIQ: the GameLift API, the instance identity, the Redis status source and
//! the server lifecycle (register, claim, heartbeat, deregister).

pub mod gamelift;
pub mod imds;
pub mod integration;
pub mod lifecycle;
pub mod source;
pub mod view;
