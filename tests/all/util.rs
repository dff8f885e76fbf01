//! Helpers shared by the integration tests.

use std::path::Path;
use std::sync::OnceLock;

use strata_core::{Capabilities, ExecOptions, Job, Limits, LimitsOverride, Outcome};
use strata_engine::{Engine, EngineConfig, EngineError};

/// One engine for the whole test binary, caching modules in a private home, as a server process would.
pub fn engine() -> &'static Engine {
    static ENGINE: OnceLock<(tempfile::TempDir, Engine)> = OnceLock::new();
    let (_, engine) = ENGINE.get_or_init(|| {
        let home = tempfile::tempdir().expect("tempdir");
        let engine = Engine::new(EngineConfig { home: Some(home.path().to_owned()), ..EngineConfig::default() })
            .expect("engine");
        (home, engine)
    });
    engine
}

/// Default limits with some replaced, e.g. `limits("wall = \"200ms\"")`.
pub fn limits(toml_overrides: &str) -> Limits {
    let patch: LimitsOverride = toml::from_str(toml_overrides).expect("valid limits");
    patch.apply(&Limits::default())
}

pub fn job(program: &str, args: &[&str]) -> Job {
    Job::wasm_file(program, args.iter().map(|a| a.to_string()).collect())
}

pub fn try_run(program: &str, args: &[&str], caps: &Capabilities, limits: &Limits) -> Result<Outcome, EngineError> {
    engine().run(&job(program, args), caps, limits, ExecOptions::default())
}

pub fn run(program: &str, args: &[&str], caps: &Capabilities, limits: &Limits) -> Outcome {
    try_run(program, args, caps, limits).unwrap_or_else(|e| panic!("{program} {args:?}: {e}"))
}

pub fn stdout(outcome: &Outcome) -> String {
    String::from_utf8_lossy(&outcome.stdout).into_owned()
}

/// Lines of `dir` listing, sorted, for before/after comparisons.
pub fn listing(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut entries: Vec<(String, Vec<u8>)> = walk(dir, dir);
    entries.sort();
    entries
}

fn walk(root: &Path, dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).expect("read_dir") {
        let entry = entry.expect("entry");
        let path = entry.path();
        let name = path.strip_prefix(root).expect("prefix").display().to_string();
        let meta = std::fs::symlink_metadata(&path).expect("meta");
        if meta.is_dir() {
            out.push((format!("{name}/"), Vec::new()));
            out.extend(walk(root, &path));
        } else if meta.file_type().is_symlink() {
            out.push((format!("{name}@"), std::fs::read_link(&path).expect("link").display().to_string().into()));
        } else {
            out.push((name, std::fs::read(&path).expect("read")));
        }
    }
    out
}
