//! Builds the `strata-jail` binary (crate `tiers/process/jail`) so the tier can embed it: every program that links
//! the process tier can start jails without a second file to install next to it.
//!
//! The jail is linked statically: it runs on the host, then `pivot_root`s away from the host's libraries, so
//! nothing may be loaded lazily afterwards. It is built against musl where the toolchain has the musl target of
//! this architecture (`rustup target add x86_64-unknown-linux-musl`; tests/run does it), else against glibc with
//! `crt-static`. Musl's is the smaller binary by half (0.85 MB against 1.6 MB: a static glibc brings its
//! locale, `printf`/`scanf` and `dlopen` machinery), and every engine process copies it into a memfd once and
//! every jail `exec`s it, forks it twice and starts its runtime: a static glibc's start-up alone reads
//! `/proc/self/maps`.

use std::env;
use std::path::PathBuf;

use strata_image_util::nested::{NestedCargo, source_key, target_installed};

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let jail_dir = manifest_dir.join("jail");
    println!("cargo:rerun-if-changed={}", jail_dir.join("Cargo.toml").display());
    println!("cargo:rerun-if-changed={}", jail_dir.join("src").display());

    let target = env::var("TARGET").expect("TARGET");
    let musl = target.strip_suffix("-linux-gnu").map(|arch| format!("{arch}-linux-musl"));
    let jail_target = match musl {
        Some(musl) if target_installed(&musl) => musl,
        _ => target,
    };
    // One target directory per source tree (see strata_image_util::nested).
    let target_dir = out_dir.join(format!("jail-target-{:016x}", source_key(&jail_dir)));
    let status = NestedCargo::release(&jail_dir.join("Cargo.toml"), &jail_target, &target_dir)
        .args(["-p", "strata-jail", "--bin", "strata-jail"])
        // Static on glibc too (musl targets are static already).
        .env("CARGO_ENCODED_RUSTFLAGS", "-Ctarget-feature=+crt-static")
        // Small and self-contained: every engine process copies it into a memfd once, so its size is start-up
        // time (1.9 MB took 0.9 ms).
        .small()
        .env("CARGO_PROFILE_RELEASE_PANIC", "abort")
        .run()
        .expect("run cargo for strata-jail");
    assert!(status.success(), "building strata-jail for {jail_target} failed ({status})");
    let binary = target_dir.join(&jail_target).join("release/strata-jail");
    assert!(binary.exists(), "strata-jail was not built at {}", binary.display());
    println!("cargo:rustc-env=STRATA_JAIL_BINARY={}", binary.display());
}
