//! Builds the `strata-jail` binary (crate `tiers/process/jail`) so the tier can embed it: every program that links
//! the process tier can start jails without a second file to install next to it.
//!
//! The jail is linked statically (`crt-static`): it runs on the host, then `pivot_root`s away from the host's
//! libraries, so nothing may be loaded lazily afterwards.

use std::env;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let jail_dir = manifest_dir.join("jail");
    println!("cargo:rerun-if-changed={}", jail_dir.join("Cargo.toml").display());
    println!("cargo:rerun-if-changed={}", jail_dir.join("src").display());

    let target = env::var("TARGET").expect("TARGET");
    let target_dir = out_dir.join("jail-target");
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "--release", "--quiet", "-p", "strata-jail", "--bin", "strata-jail", "--target", &target])
        .arg("--manifest-path")
        .arg(jail_dir.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target_dir)
        .env("CARGO_ENCODED_RUSTFLAGS", "-Ctarget-feature=+crt-static")
        // Small and self-contained: every engine process copies it into a memfd once, so its size is start-up
        // time (1.9 MB took 0.9 ms).
        .env("CARGO_PROFILE_RELEASE_OPT_LEVEL", "s")
        .env("CARGO_PROFILE_RELEASE_LTO", "true")
        .env("CARGO_PROFILE_RELEASE_CODEGEN_UNITS", "1")
        .env("CARGO_PROFILE_RELEASE_PANIC", "abort")
        .env("CARGO_PROFILE_RELEASE_DEBUG", "false")
        .env("CARGO_PROFILE_RELEASE_STRIP", "symbols");
    // The outer build's settings are for the outer build.
    for var in [
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
    let status = cmd.status().expect("run cargo for strata-jail");
    assert!(status.success(), "building strata-jail failed ({status})");
    let binary = target_dir.join(&target).join("release/strata-jail");
    assert!(binary.exists(), "strata-jail was not built at {}", binary.display());
    println!("cargo:rustc-env=STRATA_JAIL_BINARY={}", binary.display());
}
