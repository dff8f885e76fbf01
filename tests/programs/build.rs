//! Builds the guest programs in `guests/` for wasm32-wasip1, those in `components/` for wasm32-wasip2 (WASI 0.2
//! command components) and the WAT modules in `wat/`, and writes a Rust file of constants naming each artifact's
//! path.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use strata_image_util::nested::{NestedCargo, target_installed};

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let guests = manifest_dir.join("guests");
    let components = manifest_dir.join("components");
    let wat_dir = manifest_dir.join("wat");
    for crate_dir in [&guests, &components] {
        println!("cargo:rerun-if-changed={}", crate_dir.join("Cargo.toml").display());
        println!("cargo:rerun-if-changed={}", crate_dir.join("src").display());
    }
    println!("cargo:rerun-if-changed={}", wat_dir.display());
    println!("cargo:rerun-if-changed={}", manifest_dir.join("native").display());

    let mut consts = String::new();
    for (name, path) in build_guests(&guests, "wasm32-wasip1", &out_dir.join("guest-target")) {
        writeln!(consts, "/// `guests/src/bin/{name}.rs`, built for wasm32-wasip1.").expect("fmt");
        writeln!(consts, "pub const {}: &str = {:?};", name.to_uppercase(), path.display()).expect("fmt");
    }
    for (name, path) in build_guests(&components, "wasm32-wasip2", &out_dir.join("component-target")) {
        writeln!(consts, "/// `components/src/bin/{name}.rs`, a WASI 0.2 command component (wasm32-wasip2).")
            .expect("fmt");
        writeln!(consts, "pub const COMPONENT_{}: &str = {:?};", name.to_uppercase(), path.display()).expect("fmt");
    }
    for (name, path) in build_wat(&wat_dir, &out_dir) {
        writeln!(consts, "/// `wat/{name}.wat`, assembled.").expect("fmt");
        writeln!(consts, "pub const {}_WAT: &str = {:?};", name.to_uppercase(), path.display()).expect("fmt");
    }
    let native = build_native(&manifest_dir.join("native"), &out_dir);
    writeln!(consts, "/// `native/hello.c`, a static x86_64 Linux executable (for the process and microVM tiers).")
        .expect("fmt");
    writeln!(consts, "pub const NATIVE_HELLO: &str = {:?};", native.display()).expect("fmt");
    let large = build_large(&out_dir);
    writeln!(consts, "/// A WASI command with a 5 MB data segment: big enough for compile progress messages.")
        .expect("fmt");
    writeln!(consts, "pub const LARGE_WAT: &str = {:?};", large.display()).expect("fmt");
    fs::write(out_dir.join("programs.rs"), consts).expect("write programs.rs");
}

/// Ends the build with one line (no panic, no backtrace) saying what to do.
fn fail(message: &str) -> ! {
    eprintln!("error: {message}");
    std::process::exit(1)
}

/// Ends the build with the one command that fixes it when `target`'s standard library is not installed.
fn require_target(target: &str) {
    if !target_installed(target) {
        fail(&format!(
            "the {target} Rust target is not installed (the test guest programs are built for it): run \
             `rustup target add {target}` (tests/run does this)"
        ));
    }
}

fn build_guests(guests: &Path, target: &str, target_dir: &Path) -> Vec<(String, PathBuf)> {
    require_target(target);
    let status = NestedCargo::release(&guests.join("Cargo.toml"), target, target_dir)
        .args(["--bins"])
        .run()
        .expect("run cargo for the guest programs");
    if !status.success() {
        fail(&format!("building the {target} guest programs in {} failed ({status}); see above", guests.display()));
    }
    let bin_dir = target_dir.join(target).join("release");
    let mut built = Vec::new();
    for entry in fs::read_dir(guests.join("src/bin")).expect("read guests/src/bin") {
        let path = entry.expect("dir entry").path();
        let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else {
            continue;
        };
        let wasm = bin_dir.join(format!("{stem}.wasm"));
        assert!(wasm.exists(), "guest {stem} was not built at {}", wasm.display());
        built.push((stem.to_owned(), wasm));
    }
    built.sort();
    built
}

fn build_wat(wat_dir: &Path, out_dir: &Path) -> Vec<(String, PathBuf)> {
    let mut built = Vec::new();
    for entry in fs::read_dir(wat_dir).expect("read wat/") {
        let path = entry.expect("dir entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("wat") {
            continue;
        }
        let stem = path.file_stem().and_then(|s| s.to_str()).expect("utf-8 name").to_owned();
        let bytes = wat::parse_file(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let wasm = out_dir.join(format!("{stem}.wasm"));
        fs::write(&wasm, bytes).expect("write wasm");
        built.push((stem, wasm));
    }
    built.sort();
    built
}

/// Builds `native/hello.c` into a static executable with the host's C compiler (`$CC`, else `cc`).
fn build_native(native_dir: &Path, out_dir: &Path) -> PathBuf {
    let source = native_dir.join("hello.c");
    let binary = out_dir.join("native-hello");
    let cc = env::var_os("CC").unwrap_or_else(|| "cc".into());
    let status = Command::new(&cc)
        .args(["-static", "-O2", "-Wall", "-o"])
        .arg(&binary)
        .arg(&source)
        .status()
        .unwrap_or_else(|e| panic!("run the C compiler {cc:?}: {e}; install gcc and libc6-dev (tests/run does)"));
    assert!(
        status.success(),
        "building {} failed ({status}); is libc6-dev (static libc.a) installed?",
        source.display()
    );
    binary
}

/// A module whose size comes from one large data segment, generated rather than checked in.
fn build_large(out_dir: &Path) -> PathBuf {
    let data = "s".repeat(5_000_000);
    let text = format!(
        r#"(module
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 80)
  (data (i32.const 64) "{data}")
  (func (export "_start")
    (i32.store (i32.const 0) (i32.const 64))
    (i32.store (i32.const 4) (i32.const 5))
    (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))))"#
    );
    let wasm = out_dir.join("large.wasm");
    fs::write(&wasm, wat::parse_str(&text).expect("large module")).expect("write large.wasm");
    wasm
}
