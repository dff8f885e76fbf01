//! Helpers shared by the integration tests.

use std::path::Path;
use std::sync::OnceLock;

use strata_core::{Capabilities, Job, Limits, LimitsOverride, Outcome, TierKind};
use strata_engine::{Engine, EngineConfig, EngineError, RunRequest, TierChoice};

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

/// An engine whose home is the real `$STRATA_HOME` (tests/run sets it), so the Python runtime is fetched and
/// compiled once across test runs rather than once per run.
pub fn python_engine() -> &'static Engine {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let home = strata_engine::strata_home().expect("STRATA_HOME or HOME");
        let engine = Engine::new(EngineConfig { home: Some(home), ..EngineConfig::default() }).expect("engine");
        register_test_tools(engine.tools());
        engine
    })
}

/// The process tier of [`python_engine`], or `None` after one skip line naming `test` where this host cannot run
/// it (`STRATA_REQUIRE_PROCESS_TIER` set turns that into a failure).
pub fn process_tier(test: &str) -> Option<&'static strata_tier_process::ProcessTier> {
    match python_engine().process() {
        Ok(tier) => Some(tier),
        Err(err) => {
            assert!(std::env::var_os("STRATA_REQUIRE_PROCESS_TIER").is_none(), "process tier required: {err}");
            eprintln!("skip {test}: the process tier cannot run on this host: {err}");
            None
        }
    }
}

/// Tools the Python tests call: `add(a, b=2)` and `fail(reason)`.
fn register_test_tools(registry: &strata_core::ToolRegistry) {
    use serde_json::json;
    use strata_core::{Tool, ToolFailure};
    let add = Tool::new(
        "add",
        "Adds two integers.",
        json!({
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer", "default": 2}},
            "required": ["a"],
            "additionalProperties": false
        }),
        |args| Ok(json!(args["a"].as_i64().unwrap_or(0) + args.get("b").and_then(|b| b.as_i64()).unwrap_or(2))),
    )
    .expect("add");
    let fail = Tool::new(
        "fail",
        "Always fails.",
        json!({"type": "object", "properties": {"reason": {"type": "string"}}, "required": ["reason"]}),
        |args| Err(ToolFailure::Error(format!("cannot: {}", args["reason"].as_str().unwrap_or("?")))),
    )
    .expect("fail");
    registry.register(add).expect("register add");
    registry.register(fail).expect("register fail");
}

/// Runs Python `code` on the wasm tier (whatever its imports would route it to).
pub fn python(code: &str, caps: &Capabilities, limits: &Limits) -> Outcome {
    let job = Job::Python { source: strata_core::PythonSource::Code(code.into()), args: Vec::new() };
    python_engine()
        .execute(RunRequest::new(&job).caps(caps).limits(limits.clone()).tier(TierChoice::Tier(TierKind::Wasm)))
        .unwrap_or_else(|e| panic!("{code}: {e}"))
}

pub fn stderr(outcome: &Outcome) -> String {
    String::from_utf8_lossy(&outcome.stderr).into_owned()
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
    engine().execute(RunRequest::new(&job(program, args)).caps(caps).limits(limits.clone()))
}

/// [`run`], with `stdin` as the job's input.
pub fn run_with_stdin(program: &str, args: &[&str], caps: &Capabilities, stdin: &[u8]) -> Outcome {
    let job = job(program, args);
    let request = RunRequest::new(&job).caps(caps).limits(Limits::default()).stdin(stdin.to_vec());
    engine().execute(request).unwrap_or_else(|e| panic!("{program} {args:?}: {e}"))
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

/// What [`Origin`] answers every request with.
pub const ORIGIN_BODY: &str = "hello from the host";

/// A host HTTP server on 127.0.0.1 answering every request with [`ORIGIN_BODY`], counting the connections it
/// accepted.
pub struct Origin {
    /// Its port.
    pub port: u16,
    hits: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Origin {
    /// Starts it on a thread of its own (it lives as long as the test process).
    pub fn start() -> Origin {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind origin");
        let port = listener.local_addr().expect("addr").port();
        let hits = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = hits.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let _ = serve_origin(&mut stream);
            }
        });
        Origin { port, hits }
    }

    /// Connections accepted so far.
    pub fn hits(&self) -> usize {
        self.hits.load(std::sync::atomic::Ordering::SeqCst)
    }
}

fn serve_origin(stream: &mut std::net::TcpStream) -> std::io::Result<()> {
    use std::io::{Read, Write};
    stream.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let response =
        format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{ORIGIN_BODY}", ORIGIN_BODY.len());
    stream.write_all(response.as_bytes())
}
