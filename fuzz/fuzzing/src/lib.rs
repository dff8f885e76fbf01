//! Generators and oracles for Strata's fuzz targets, as wasmtime's `crates/fuzzing` keeps them: the libFuzzer
//! binaries in `fuzz/fuzz_targets/` are one line each and call [`targets`]; this library is also what replays
//! every target's seed corpus (`fuzz/corpus/<target>/`) as a plain `cargo test`, so a regression input runs on
//! every test run, with or without libFuzzer.
//!
//! - [`targets`]: one module per target, each a `run(&[u8])` that feeds the bytes to one parser a guest or a
//!   client controls and panics when an oracle (a property the parser promises) fails. [`TARGETS`] lists them.
//! - [`generate`]: generators of structured inputs (well-formed agent messages, virtio descriptor chains) from the
//!   fuzzer's bytes, built on [`arbitrary`], and [`generate::Cursor`] for inputs whose seeds are written by hand.
//! - [`scratch`]: the one directory per process where targets keep their files, removed at exit.
//! - [`seeds`]: the real examples (frames, requests, ClientHellos, policies) the committed corpus starts from.
//!
//! Adding a target: see `fuzz/README.md`.

pub mod generate;
mod oci_seeds;
pub mod scratch;
mod seed;
pub mod seeds;
mod snapshot_seeds;
pub mod targets;
pub mod virtio;

/// A fuzz target: the name of its libFuzzer binary and corpus folder, and its entry point.
#[derive(Debug, Clone, Copy)]
pub struct Target {
    /// `fuzz/fuzz_targets/<name>.rs`, `fuzz/corpus/<name>/`.
    pub name: &'static str,
    /// Feeds one input to the parser; panics when an oracle fails.
    pub run: fn(&[u8]),
}

/// Every target.
pub const TARGETS: &[Target] = &[
    Target { name: "agent_frames", run: targets::agent_frames::run },
    Target { name: "agent_client", run: targets::agent_client::run },
    Target { name: "jail_frames", run: targets::jail_frames::run },
    Target { name: "egress_request", run: targets::egress_request::run },
    Target { name: "egress_sni", run: targets::egress_sni::run },
    Target { name: "egress_allowlist", run: targets::egress_allowlist::run },
    Target { name: "egress_proxy", run: targets::egress_proxy::run },
    Target { name: "policy_toml", run: targets::policy_toml::run },
    Target { name: "virtio_mmio", run: targets::virtio_mmio::run },
    Target { name: "virtio_block", run: targets::virtio_block::run },
    Target { name: "virtio_vsock", run: targets::virtio_vsock::run },
    Target { name: "e2b_connect", run: targets::e2b_connect::run },
    Target { name: "api_bodies", run: targets::api_bodies::run },
    Target { name: "wasm_cache_entry", run: targets::wasm_cache_entry::run },
    Target { name: "snapshot_open", run: targets::snapshot_open::run },
    Target { name: "snapshot_transfer", run: targets::snapshot_transfer::run },
    Target { name: "snapshot_wasm", run: targets::snapshot_wasm::run },
    Target { name: "snapshot_vm_state", run: targets::snapshot_vm_state::run },
    Target { name: "snapshot_upper_tree", run: targets::snapshot_upper_tree::run },
    Target { name: "replay_recording", run: targets::replay_recording::run },
    Target { name: "kernel_events", run: targets::kernel_events::run },
    Target { name: "warm_requests", run: targets::warm_requests::run },
    Target { name: "port_routes", run: targets::port_routes::run },
    Target { name: "oci_layer", run: targets::oci_layer::run },
    Target { name: "dockerfile", run: targets::dockerfile::run },
    Target { name: "vmm_control", run: targets::vmm_control::run },
    Target { name: "fleet_records", run: targets::fleet_records::run },
];

/// The target called `name`.
pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.name == name)
}
