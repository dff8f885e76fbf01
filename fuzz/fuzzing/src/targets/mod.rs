//! The targets: each `run` takes the fuzzer's bytes and panics only when an oracle fails.

pub mod agent_client;
pub mod agent_frames;
pub mod api_bodies;
pub mod dockerfile;
pub mod e2b_connect;
pub mod egress_allowlist;
pub mod egress_proxy;
pub mod egress_request;
pub mod egress_sni;
pub mod fleet_records;
pub mod jail_frames;
pub mod kernel_events;
pub mod oci_layer;
pub mod policy_toml;
pub mod port_routes;
pub mod replay_recording;
pub mod snapshot_open;
pub mod snapshot_upper_tree;
pub mod snapshot_vm_state;
pub mod snapshot_wasm;
pub mod virtio_block;
pub mod virtio_mmio;
pub mod virtio_vsock;
pub mod vmm_control;
pub mod warm_requests;
pub mod wasm_cache_entry;
