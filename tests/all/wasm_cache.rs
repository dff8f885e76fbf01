//! The precompiled-module cache: only the first run compiles, and a corrupt entry is rebuilt, never run.

use strata_core::{Capabilities, ExecOptions, Job, Limits, ModuleSource, Status, Tier};
use strata_test_programs as programs;
use strata_tier_wasm::{CacheOutcome, WasmTier, WasmTierConfig};

fn tier(dir: &std::path::Path) -> WasmTier {
    WasmTier::new(WasmTierConfig { cache_dir: Some(dir.to_owned()), ..WasmTierConfig::default() })
}

#[test]
fn only_the_first_process_compiles_and_a_corrupt_entry_is_rebuilt() {
    let dir = tempfile::tempdir().expect("tempdir");
    let module = ModuleSource::File(programs::HELLO.into());
    let limits = Limits::default();

    assert_eq!(tier(dir.path()).prepare(&module, &limits).expect("compile"), Some(CacheOutcome::Compiled));
    // A new tier stands for a new process: it has nothing in memory and must map the entry.
    assert_eq!(tier(dir.path()).prepare(&module, &limits).expect("load"), Some(CacheOutcome::Hit));
    // The same tier does not touch the disk again.
    let warm = tier(dir.path());
    warm.prepare(&module, &limits).expect("load");
    assert_eq!(warm.prepare(&module, &limits).expect("memory"), None);

    // Corrupt every compiled entry in the middle of its code.
    for entry in std::fs::read_dir(dir.path()).expect("ls") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "cwasm") {
            let mut bytes = std::fs::read(&path).expect("read");
            let at = bytes.len() / 2;
            bytes[at..at + 64].fill(0xcc);
            std::fs::write(&path, bytes).expect("corrupt");
        }
    }
    let fresh = tier(dir.path());
    assert_eq!(fresh.prepare(&module, &limits).expect("rebuild"), Some(CacheOutcome::Rebuilt));
    let job = Job::Wasm { module, args: vec!["again".into()] };
    let outcome = fresh.run(&job, &Capabilities::default(), &limits, ExecOptions::default()).expect("runs");
    assert_eq!(outcome.status, Status::Exited { code: 0 });
    assert!(String::from_utf8_lossy(&outcome.stdout).starts_with("Hello, again!"));
    assert_eq!(tier(dir.path()).prepare(&job_module(), &limits).expect("load"), Some(CacheOutcome::Hit));
}

fn job_module() -> ModuleSource {
    ModuleSource::File(programs::HELLO.into())
}

#[test]
fn metered_and_unmetered_code_are_separate_entries() {
    let dir = tempfile::tempdir().expect("tempdir");
    let module = ModuleSource::File(programs::TRIVIAL_WAT.into());
    let metered: Limits = crate::util::limits("fuel = 1000000");
    let t = tier(dir.path());
    assert_eq!(t.prepare(&module, &Limits::default()).expect("compile"), Some(CacheOutcome::Compiled));
    assert_eq!(t.prepare(&module, &metered).expect("compile"), Some(CacheOutcome::Compiled));
    let compiled = std::fs::read_dir(dir.path())
        .expect("ls")
        .filter(|e| e.as_ref().is_ok_and(|e| e.path().extension().is_some_and(|x| x == "cwasm")))
        .count();
    assert_eq!(compiled, 2, "one compiled module per fuel mode");
}

#[test]
fn modules_given_as_bytes_run_and_are_cached_by_content() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bytes = std::fs::read(programs::TRIVIAL_WAT).expect("read");
    let module = ModuleSource::Bytes { name: "trivial".into(), bytes: bytes.into() };
    let t = tier(dir.path());
    let job = Job::Wasm { module: module.clone(), args: Vec::new() };
    let outcome = t.run(&job, &Capabilities::default(), &Limits::default(), ExecOptions::default()).expect("runs");
    assert_eq!(outcome.stdout, b"hello\n");
    assert_eq!(tier(dir.path()).prepare(&module, &Limits::default()).expect("load"), Some(CacheOutcome::Hit));
}
