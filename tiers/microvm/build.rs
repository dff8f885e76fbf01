//! Builds the guest agent (`guest-images/agent`) for `x86_64-unknown-linux-musl` so the tier can embed it: the
//! initramfs (`strata images build initramfs`) takes it as `/init`, with no second file to install beside Strata.
//!
//! The agent must be static (the initramfs has no C library), hence musl. Where that Rust target is not installed
//! (`rustup target add x86_64-unknown-linux-musl`; tests/run does it), the tier is built without an agent and
//! `agent_binary()` says how to get one, instead of failing the whole build.

use std::env;
use std::path::PathBuf;

use strata_image_util::nested::{NestedCargo, source_key, target_installed};

const GUEST_TARGET: &str = "x86_64-unknown-linux-musl";

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let images = manifest_dir.join("../../guest-images");
    for dir in ["agent/src", "agent/Cargo.toml", "proto/src", "proto/Cargo.toml"] {
        println!("cargo:rerun-if-changed={}", images.join(dir).display());
    }
    println!("cargo::rustc-check-cfg=cfg(strata_no_agent)");
    if !target_installed(GUEST_TARGET) {
        println!("cargo:warning=the {GUEST_TARGET} target is missing: building without the guest agent");
        println!("cargo:rustc-cfg=strata_no_agent");
        return;
    }
    // One target directory per source tree (see strata_image_util::nested).
    let target_dir = out_dir.join(format!("agent-target-{:016x}", source_key(&images)));
    let status = NestedCargo::release(&images.join("agent/Cargo.toml"), GUEST_TARGET, &target_dir)
        .args(["-p", "strata-agent", "--bin", "strata-agent"])
        // Small: it is copied into every initramfs and unpacked at every boot.
        .small()
        .run()
        .expect("run cargo for strata-agent");
    assert!(status.success(), "building strata-agent for {GUEST_TARGET} failed ({status})");
    let binary = target_dir.join(GUEST_TARGET).join("release/strata-agent");
    assert!(binary.exists(), "strata-agent was not built at {}", binary.display());
    println!("cargo:rustc-env=STRATA_AGENT_BINARY={}", binary.display());
}
