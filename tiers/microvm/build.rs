//! Builds what the tier embeds, so every program that links it carries them without a second file to install:
//!
//! - the monitor binary `strata-vmm` (crate `tiers/microvm/vmm`), linked statically (`crt-static`): each microVM
//!   runs in a monitor process of its own, started from a sealed memfd, which `pivot_root`s away from the host's
//!   libraries;
//! - the guest agent (`guest-images/agent`) for `x86_64-unknown-linux-musl`: the initramfs (`strata images build
//!   initramfs`) takes it as `/init`.
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
    build_monitor(&manifest_dir, &out_dir);
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

/// `strata-vmm`, static, for the host's own target.
fn build_monitor(manifest_dir: &std::path::Path, out_dir: &std::path::Path) {
    let vmm_dir = manifest_dir.join("vmm");
    println!("cargo:rerun-if-changed={}", vmm_dir.join("Cargo.toml").display());
    println!("cargo:rerun-if-changed={}", vmm_dir.join("src").display());
    let target = env::var("TARGET").expect("TARGET");
    let target_dir = out_dir.join(format!("vmm-target-{:016x}", source_key(&vmm_dir)));
    let status = NestedCargo::release(&vmm_dir.join("Cargo.toml"), &target, &target_dir)
        .args(["-p", "strata-vmm", "--bin", "strata-vmm"])
        .env("CARGO_ENCODED_RUSTFLAGS", "-Ctarget-feature=+crt-static")
        // Small: every engine process copies it into a memfd once.
        .small()
        .env("CARGO_PROFILE_RELEASE_PANIC", "abort")
        .run()
        .expect("run cargo for strata-vmm");
    assert!(status.success(), "building strata-vmm failed ({status})");
    let binary = target_dir.join(&target).join("release/strata-vmm");
    assert!(binary.exists(), "strata-vmm was not built at {}", binary.display());
    println!("cargo:rustc-env=STRATA_VMM_BINARY={}", binary.display());
}
