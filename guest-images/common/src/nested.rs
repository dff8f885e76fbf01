//! Cargo builds that a build script runs for another target or profile: the binaries Strata embeds (the
//! process tier's `strata-jail`, the microVM's guest agent) and the test suite's guest programs.
//!
//! A nested build must not inherit the outer build's settings (its flags are for the host, its target directory is
//! locked by the outer build), and checkouts that share a target directory must not share a nested build's output
//! (cargo compares modification times, so one checkout could embed a binary built from another's sources).

use std::env;
use std::ffi::OsStr;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::{Command, ExitStatus};

/// The outer build's settings, removed from every nested build.
const OUTER_SETTINGS: &[&str] = &[
    "CARGO_ENCODED_RUSTFLAGS",
    "RUSTFLAGS",
    "CARGO_BUILD_RUSTFLAGS",
    "CARGO_TARGET_DIR",
    "CARGO_BUILD_TARGET",
    "RUSTC_WORKSPACE_WRAPPER",
    "RUSTC_WRAPPER",
    "CARGO_MAKEFLAGS",
    "CARGO_PROFILE_RELEASE_DEBUG",
];

/// `cargo build --release` of another workspace's crate for `target`, from a build script.
#[derive(Debug)]
pub struct NestedCargo {
    command: Command,
}

impl NestedCargo {
    /// A quiet release build of the workspace at `manifest` for `target`, into `target_dir`; the outer build's
    /// settings removed.
    pub fn release(manifest: &Path, target: &str, target_dir: &Path) -> NestedCargo {
        let mut command = Command::new(env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
        command
            .args(["build", "--release", "--quiet", "--target", target, "--manifest-path"])
            .arg(manifest)
            .arg("--target-dir")
            .arg(target_dir);
        for var in OUTER_SETTINGS {
            command.env_remove(var);
        }
        NestedCargo { command }
    }

    /// More arguments (`-p NAME`, `--bin NAME`, `--bins`).
    pub fn args<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(mut self, args: I) -> NestedCargo {
        self.command.args(args);
        self
    }

    /// A variable of the nested build's environment (`CARGO_ENCODED_RUSTFLAGS` for its own flags).
    pub fn env(mut self, name: &str, value: impl AsRef<OsStr>) -> NestedCargo {
        self.command.env(name, value);
        self
    }

    /// A binary as small as the compiler makes it: for what is copied at every start or boot.
    pub fn small(self) -> NestedCargo {
        self.env("CARGO_PROFILE_RELEASE_OPT_LEVEL", "s")
            .env("CARGO_PROFILE_RELEASE_LTO", "true")
            .env("CARGO_PROFILE_RELEASE_CODEGEN_UNITS", "1")
            .env("CARGO_PROFILE_RELEASE_DEBUG", "false")
            .env("CARGO_PROFILE_RELEASE_STRIP", "symbols")
    }

    /// Runs the build, its output going to the outer build's.
    pub fn run(mut self) -> io::Result<ExitStatus> {
        self.command.status()
    }
}

/// A key for the source tree at `dir` (FNV-1a of its canonical path): a nested build's target directory named by
/// it belongs to that checkout alone.
pub fn source_key(dir: &Path) -> u64 {
    let path = dir.canonicalize().unwrap_or_else(|_| dir.to_owned());
    path.as_os_str()
        .as_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325, |hash, &byte| (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3))
}

/// Whether the standard library for `target` is installed in the toolchain running the build script. Tells cargo
/// to run the script again once it is (a path that does not exist yet reruns it on every build, a cheap check).
pub fn target_installed(target: &str) -> bool {
    let rustc = env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let Ok(output) = Command::new(rustc).args(["--print", "sysroot"]).output() else { return false };
    let sysroot = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    let lib = Path::new(&sysroot).join("lib/rustlib").join(target).join("lib");
    println!("cargo:rerun-if-changed={}", lib.display());
    lib.is_dir()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_keys_tell_checkouts_apart_and_name_one_checkout_alike() {
        let here = env::current_dir().expect("cwd");
        assert_eq!(source_key(&here), source_key(&here.join(".")));
        assert_ne!(source_key(&here), source_key(&here.join("src")));
    }

    #[test]
    fn a_nested_build_drops_the_outer_builds_settings() {
        let build = NestedCargo::release(Path::new("x/Cargo.toml"), "wasm32-wasip1", Path::new("t")).small();
        let envs: Vec<_> = build.command.get_envs().collect();
        for var in OUTER_SETTINGS.iter().filter(|var| **var != "CARGO_PROFILE_RELEASE_DEBUG") {
            assert!(envs.contains(&(OsStr::new(var), None)), "{var} is not removed");
        }
        assert!(envs.contains(&(OsStr::new("CARGO_PROFILE_RELEASE_DEBUG"), Some(OsStr::new("false")))));
        let args: Vec<_> = build.command.get_args().collect();
        assert_eq!(args[..6], ["build", "--release", "--quiet", "--target", "wasm32-wasip1", "--manifest-path"]);
    }
}
