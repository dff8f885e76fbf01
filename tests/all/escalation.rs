//! Dynamic escalation: a Python job `auto` sent to wasm that fails there for a reason the policy
//! marks escalatable re-runs on the native tier, from a clean state: the failed attempt's writes to a read-write
//! grant never reach the host, the native run's are applied once, and `escalations` says why. A policy that forbids
//! it, a reason it does not list, an explicit `--tier wasm` and an ordinary exception leave the wasm result (and its
//! writes) as they are.
//!
//! The scripts import `resource`, which Debian's CPython has and the wasm build lacks, through a name the import
//! scan cannot see (`importlib.import_module('res' + 'ource')`), so the router sends them to wasm first.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use strata_core::{
    Capabilities, Grant, GrantMode, Job, Limits, Outcome, OutputSink, PythonSource, Status, Stream, TierKind,
};
use strata_engine::{Engine, EngineConfig, Policy, RunRequest, TierChoice, escalate};

/// An engine on the shared `$STRATA_HOME` with this policy, keeping scratch copies in `scratch`.
fn engine_with(policy: &str, scratch: &Path) -> Engine {
    let policy = Policy::from_toml(policy, Path::new("escalation-policy.toml")).expect("policy");
    let home = strata_engine::strata_home().expect("STRATA_HOME or HOME");
    Engine::new(EngineConfig {
        home: Some(home),
        policy,
        scratch_dir: Some(scratch.to_owned()),
        ..EngineConfig::default()
    })
    .expect("engine")
}

/// Whether the process tier runs here; prints the skip line when it does not.
fn process_tier_runs(engine: &Engine, test: &str) -> bool {
    match engine.process() {
        Ok(_) => true,
        Err(err) => {
            eprintln!("skip {test}: the process tier cannot run on this host: {err}");
            false
        }
    }
}

/// A read-write grant at `/data/out` holding `log.txt`, and a directory for scratch copies.
struct Fixture {
    _root: tempfile::TempDir,
    out: PathBuf,
    scratch: PathBuf,
}

impl Fixture {
    fn new() -> Fixture {
        let root = tempfile::tempdir().expect("tempdir");
        let (out, scratch) = (root.path().join("out"), root.path().join("scratch"));
        std::fs::create_dir(&out).expect("mkdir out");
        std::fs::write(out.join("log.txt"), "start\n").expect("write log");
        std::fs::write(out.join("doomed.txt"), "the wasm attempt deletes me").expect("write doomed");
        Fixture { _root: root, out, scratch }
    }

    fn caps(&self) -> Capabilities {
        Capabilities {
            grants: vec![Grant::new(&self.out, "/data/out", GrantMode::Rw).expect("grant")],
            ..Capabilities::default()
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.out.join("log.txt")).expect("log.txt")
    }

    fn has(&self, name: &str) -> bool {
        self.out.join(name).exists()
    }

    /// No scratch copy is left behind.
    fn assert_no_scratch_left(&self) {
        let left: Vec<_> = match std::fs::read_dir(&self.scratch) {
            Ok(entries) => entries.filter_map(|e| e.ok()).map(|e| e.path()).collect(),
            Err(_) => Vec::new(),
        };
        assert!(left.is_empty(), "scratch copies left behind: {left:?}");
    }
}

/// Writes a file named for where it runs and appends to `log.txt` (which must happen once), reads stdin, then
/// `tail`.
fn script(tail: &str) -> Job {
    let code = format!(
        "import importlib, os, sys\n\
         where = 'wasm' if sys.platform == 'wasi' else 'native'\n\
         with open('/data/out/attempt-' + where + '.txt', 'w') as f:\n\
         \x20   f.write(where)\n\
         with open('/data/out/log.txt', 'a') as f:\n\
         \x20   f.write('line\\n')\n\
         print('before', where, sys.stdin.read())\n\
         {tail}\n"
    );
    Job::Python { source: PythonSource::Code(code), args: Vec::new() }
}

/// Imports `resource` by a computed name and uses it.
const IMPORT_RESOURCE: &str = "mod = importlib.import_module('res' + 'ource')\nprint('after', where, \
                               hasattr(mod, 'getrusage'))";

/// What the fixture's jobs read on stdin (both the wasm attempt and a native rerun get it).
const STDIN: &[u8] = b"from stdin";

fn run(engine: &Engine, request: RunRequest<'_>) -> Outcome {
    engine.execute(request.limits(Limits::default())).expect("runs")
}

fn stderr(outcome: &Outcome) -> String {
    String::from_utf8_lossy(&outcome.stderr).into_owned()
}

#[test]
fn the_import_scan_does_not_see_the_computed_import() {
    let fx = Fixture::new();
    let engine = engine_with("", &fx.scratch);
    let route = engine.route(TierChoice::Auto, &script(IMPORT_RESOURCE)).expect("route");
    assert_eq!(route.decision.tier, TierKind::Wasm, "{:?}", route.decision);
    let modules = engine.wasm_modules().expect("module list");
    assert!(!modules.has("resource"), "the wasm build has `resource` now: pick another module for these tests");
}

#[test]
fn a_missing_module_escalates_and_only_the_native_run_writes() {
    let fx = Fixture::new();
    let engine = engine_with("", &fx.scratch);
    if !process_tier_runs(&engine, "a_missing_module_escalates...") {
        return;
    }
    let collected = Arc::new(Collect::default());
    let tail = format!("if where == 'wasm':\n    os.remove('/data/out/doomed.txt')\n{IMPORT_RESOURCE}");
    let outcome = run(
        &engine,
        RunRequest::new(&script(&tail)).caps(&fx.caps()).stdin(STDIN.to_vec()).on_output(collected.clone()),
    );
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{}", stderr(&outcome));
    assert_ne!(outcome.tier, TierKind::Wasm);
    assert_eq!(outcome.stdout, b"before native from stdin\nafter native True\n", "{}", stderr(&outcome));
    assert_eq!(outcome.escalations.len(), 1, "{:?}", outcome.escalations);
    let escalation = &outcome.escalations[0];
    assert_eq!((escalation.from, escalation.to), (TierKind::Wasm, outcome.tier));
    assert!(
        escalation.reason.starts_with("missing module 'resource' (the wasm attempt failed after "),
        "{escalation:?}"
    );
    assert!(escalation.reason.contains("ModuleNotFoundError"), "{escalation:?}");
    // The route is the router's decision; the escalation says where the job went after.
    assert_eq!(outcome.route.as_ref().map(|r| r.tier), Some(TierKind::Wasm));
    // The failed attempt's writes never reached the host; the native run's were applied once.
    assert!(fx.has("attempt-native.txt") && !fx.has("attempt-wasm.txt"));
    assert_eq!(fx.log(), "start\nline\n");
    assert!(fx.has("doomed.txt"), "the failed attempt's deletion reached the host");
    fx.assert_no_scratch_left();
    // A streaming caller saw only the native run's output.
    assert_eq!(collected.stdout(), outcome.stdout);
}

#[test]
fn a_stdin_stream_reaches_the_native_rerun_whole() {
    let fx = Fixture::new();
    let engine = engine_with("[tiers]\nnative = \"process\"\n", &fx.scratch);
    if !process_tier_runs(&engine, "a_stdin_stream_reaches_the_native_rerun_whole") {
        return;
    }
    // stdin as a stream the caller has written and closed: the wasm attempt must not use it up.
    let (stream, mut writer) = strata_core::StdinStream::pipe().expect("pipe");
    std::io::Write::write_all(&mut writer, b"streamed in").expect("write");
    drop(writer);
    let caps = fx.caps();
    let outcome = run(&engine, RunRequest::new(&script(IMPORT_RESOURCE)).caps(&caps).stdin_stream(stream));
    assert_eq!(outcome.escalations.len(), 1, "{:?}", outcome.escalations);
    assert_eq!(outcome.stdout, b"before native streamed in\nafter native True\n", "{}", stderr(&outcome));
}

#[test]
fn an_unsupported_call_escalates() {
    let fx = Fixture::new();
    let engine = engine_with("[tiers]\nnative = \"process\"\n", &fx.scratch);
    if !process_tier_runs(&engine, "an_unsupported_call_escalates") {
        return;
    }
    let job = script("print('parent', getattr(os, 'get' + 'ppid')() >= 0)");
    let outcome = run(&engine, RunRequest::new(&job).caps(&fx.caps()).stdin(STDIN.to_vec()));
    assert_eq!((outcome.tier, &outcome.status), (TierKind::Process, &Status::Exited { code: 0 }), "{outcome:?}");
    assert_eq!(outcome.stdout, b"before native from stdin\nparent True\n");
    let reasons: Vec<&str> = outcome.escalations.iter().map(|e| e.reason.as_str()).collect();
    assert!(reasons.len() == 1 && reasons[0].starts_with("unsupported call: os.getppid ("), "{reasons:?}");
    assert!(fx.has("attempt-native.txt") && !fx.has("attempt-wasm.txt"));
    assert_eq!(fx.log(), "start\nline\n");
    fx.assert_no_scratch_left();
}

/// With escalation forbidden the wasm failure is the result, so its writes are the job's and reach the host.
#[test]
fn a_policy_that_forbids_escalation_keeps_the_wasm_result_and_its_writes() {
    let fx = Fixture::new();
    for policy in [
        "[escalation]\nallowed = false\n",
        // Allowed, but not for this reason: the wasm attempt ran against a scratch copy, committed as the result.
        "[escalation]\non = [\"unsupported_call\"]\n",
    ] {
        let engine = engine_with(policy, &fx.scratch);
        std::fs::write(fx.out.join("log.txt"), "start\n").expect("reset log");
        let outcome = run(&engine, RunRequest::new(&script(IMPORT_RESOURCE)).caps(&fx.caps()).stdin(STDIN.to_vec()));
        assert_eq!((outcome.tier, outcome.exit_code()), (TierKind::Wasm, 1), "{policy}: {outcome:?}");
        assert!(outcome.escalations.is_empty(), "{policy}: {:?}", outcome.escalations);
        assert_eq!(outcome.stdout, b"before wasm from stdin\n");
        assert!(stderr(&outcome).contains("ModuleNotFoundError"), "{}", stderr(&outcome));
        assert!(fx.has("attempt-wasm.txt"), "{policy}: the wasm result's write is committed");
        assert_eq!(fx.log(), "start\nline\n", "{policy}");
        fx.assert_no_scratch_left();
    }
}

#[test]
fn an_explicit_wasm_tier_never_escalates() {
    let fx = Fixture::new();
    let engine = engine_with("", &fx.scratch);
    let (job, caps) = (script(IMPORT_RESOURCE), fx.caps());
    let outcome =
        run(&engine, RunRequest::new(&job).caps(&caps).stdin(STDIN.to_vec()).tier(TierChoice::Tier(TierKind::Wasm)));
    assert_eq!((outcome.tier, outcome.exit_code()), (TierKind::Wasm, 1), "{outcome:?}");
    assert!(outcome.escalations.is_empty());
    assert!(fx.has("attempt-wasm.txt"));
    assert_eq!(fx.log(), "start\nline\n");
    fx.assert_no_scratch_left();
}

#[test]
fn an_ordinary_exception_does_not_escalate_and_its_writes_are_committed() {
    let fx = Fixture::new();
    let engine = engine_with("", &fx.scratch);
    let collected = Arc::new(Collect::default());
    let job = script("raise ValueError('not a platform problem')");
    let outcome =
        run(&engine, RunRequest::new(&job).caps(&fx.caps()).stdin(STDIN.to_vec()).on_output(collected.clone()));
    assert_eq!((outcome.tier, outcome.exit_code()), (TierKind::Wasm, 1), "{outcome:?}");
    assert!(outcome.escalations.is_empty());
    assert!(stderr(&outcome).ends_with("ValueError: not a platform problem\n"), "{}", stderr(&outcome));
    assert!(fx.has("attempt-wasm.txt") && !fx.has("attempt-native.txt"));
    assert_eq!(fx.log(), "start\nline\n");
    fx.assert_no_scratch_left();
    // The held-back output reached the streaming caller once the wasm attempt was the result.
    assert_eq!(collected.stdout(), outcome.stdout);
}

/// Read-write grants larger than the disk limit get no scratch copy: the job runs on wasm writing to the host
/// directly, and does not escalate.
#[test]
fn grants_over_the_disk_limit_do_not_escalate() {
    let fx = Fixture::new();
    let engine = engine_with("", &fx.scratch);
    std::fs::write(fx.out.join("big.bin"), vec![0u8; 64 << 10]).expect("write big");
    let limits = Limits { disk: strata_core::ByteSize(16 << 10), ..Limits::default() };
    let outcome = engine
        .execute(RunRequest::new(&script(IMPORT_RESOURCE)).caps(&fx.caps()).stdin(STDIN.to_vec()).limits(limits))
        .expect("runs");
    assert_eq!((outcome.tier, outcome.exit_code()), (TierKind::Wasm, 1), "{outcome:?}");
    assert!(outcome.escalations.is_empty());
    assert!(fx.has("attempt-wasm.txt"));
    fx.assert_no_scratch_left();
}

/// Every attribute the escalation takes for an unsupported call is indeed missing on wasm: one that appears
/// there (a newer runtime) fails this test and should leave the list.
#[test]
fn every_unsupported_attribute_is_missing_on_wasm() {
    let fx = Fixture::new();
    let engine = engine_with("", &fx.scratch);
    let entries: Vec<(&str, &[&str])> = escalate::UNSUPPORTED_ATTRIBUTES.to_vec();
    let code = format!(
        "import importlib, json\nfor module, names in json.loads({:?}):\n    m = importlib.import_module(module)\n    \
         for name in names:\n        if hasattr(m, name): print(module + '.' + name)\n",
        serde_json::to_string(&entries).expect("json")
    );
    let job = Job::Python { source: PythonSource::Code(code), args: Vec::new() };
    let outcome = run(&engine, RunRequest::new(&job).tier(TierChoice::Tier(TierKind::Wasm)));
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{}", stderr(&outcome));
    assert_eq!(String::from_utf8_lossy(&outcome.stdout), "", "present on wasm after all");
}

/// Collects streamed stdout.
#[derive(Default)]
struct Collect(Mutex<Vec<u8>>);

impl Collect {
    fn stdout(&self) -> Vec<u8> {
        self.0.lock().expect("lock").clone()
    }
}

impl OutputSink for Collect {
    fn output(&self, stream: Stream, chunk: &[u8]) {
        if stream == Stream::Stdout {
            self.0.lock().expect("lock").extend_from_slice(chunk);
        }
    }
}
