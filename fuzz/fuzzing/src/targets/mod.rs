//! The targets: each `run` takes the fuzzer's bytes and panics only when an oracle fails.

pub mod agent_client;
pub mod agent_frames;
pub mod egress_allowlist;
pub mod egress_request;
pub mod egress_sni;
pub mod jail_frames;
