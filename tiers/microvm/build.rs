//! Builds the guest agent (`guest-images/agent`) for `x86_64-unknown-linux-musl` so the tier can embed it: the
//! initramfs (`strata images build initramfs`) takes it as `/init`, with no second file to install beside Strata.
//!
//! The agent must be static (the initramfs has no C library), hence musl. Where that Rust target is not installed
//! (`rustup target add x86_64-unknown-linux-musl`; tests/run does it), the tier is built without an agent and
//! `agent_binary()` says how to get one, instead of failing the whole build.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const GUEST_TARGET: &str = "x86_64-unknown-linux-musl";

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let images = manifest_dir.join("../../guest-images");
    for dir in ["agent/src", "agent/Cargo.toml", "proto/src", "proto/Cargo.toml"] {
        println!("cargo:rerun-if-changed={}", images.join(dir).display());
    }
    println!("cargo::rustc-check-cfg=cfg(strata_no_agent)");
    if !target_installed() {
        println!("cargo:warning=the {GUEST_TARGET} target is missing: building without the guest agent");
        println!("cargo:rustc-cfg=strata_no_agent");
        return;
    }
    let target_dir = out_dir.join("agent-target");
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args([
        "build",
        "--release",
        "--quiet",
        "-p",
        "strata-agent",
        "--bin",
        "strata-agent",
        "--target",
        GUEST_TARGET,
    ])
    .arg("--manifest-path")
    .arg(images.join("agent/Cargo.toml"))
    .arg("--target-dir")
    .arg(&target_dir)
    // Small: it is copied into every initramfs and unpacked at every boot.
    .env("CARGO_PROFILE_RELEASE_OPT_LEVEL", "s")
    .env("CARGO_PROFILE_RELEASE_LTO", "true")
    .env("CARGO_PROFILE_RELEASE_CODEGEN_UNITS", "1")
    .env("CARGO_PROFILE_RELEASE_DEBUG", "false")
    .env("CARGO_PROFILE_RELEASE_STRIP", "symbols");
    // The outer build's settings are for the outer build.
    for var in [
        "CARGO_ENCODED_RUSTFLAGS",
        "RUSTFLAGS",
        "CARGO_BUILD_RUSTFLAGS",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTC_WRAPPER",
        "CARGO_MAKEFLAGS",
    ] {
        cmd.env_remove(var);
    }
    let status = cmd.status().expect("run cargo for strata-agent");
    assert!(status.success(), "building strata-agent for {GUEST_TARGET} failed ({status})");
    let binary = target_dir.join(GUEST_TARGET).join("release/strata-agent");
    assert!(binary.exists(), "strata-agent was not built at {}", binary.display());
    println!("cargo:rustc-env=STRATA_AGENT_BINARY={}", binary.display());
}

/// Whether the musl target's standard library is installed in the toolchain that builds this crate.
fn target_installed() -> bool {
    let rustc = env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let Ok(output) = Command::new(rustc).args(["--print", "sysroot"]).output() else { return false };
    let sysroot = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    let lib = Path::new(&sysroot).join("lib/rustlib").join(GUEST_TARGET).join("lib");
    // Installing the target later rebuilds with the agent (a path that does not exist yet reruns this script
    // on every build, a cheap check until the target is there).
    println!("cargo:rerun-if-changed={}", lib.display());
    lib.is_dir()
}
