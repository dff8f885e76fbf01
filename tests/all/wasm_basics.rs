//! Running WASI command modules: output, exit codes, arguments, environment, stdin, traps and bad input.

use std::sync::{Arc, Mutex};

use strata_core::{
    CancelToken, Capabilities, EnvVar, Fuel, Limits, Net, Outcome, OutputSink, Status, Stream, TierError, TierKind,
};
use strata_engine::{EngineError, RunRequest, TierChoice};
use strata_test_programs as programs;

use crate::util::{engine, job, limits, run, run_with_stdin, stdout, try_run};

#[test]
fn hello_prints_its_greeting() {
    let outcome = run(programs::HELLO, &["Strata"], &Capabilities::default(), &Limits::default());
    assert_eq!(outcome.status, Status::Exited { code: 0 });
    assert_eq!(outcome.tier, TierKind::Wasm);
    assert!(stdout(&outcome).starts_with("Hello, Strata!"), "{outcome:?}");
    assert_eq!(outcome.usage.stdout_bytes, outcome.stdout.len() as u64);
    assert!(outcome.usage.peak_memory > 0);
    assert_eq!(outcome.usage.fuel, None, "unmetered by default");
}

#[test]
fn exit_codes_are_reported() {
    for code in [0, 1, 3, 42, 125] {
        let outcome = run(programs::EXIT, &[&code.to_string()], &Capabilities::default(), &Limits::default());
        assert_eq!(outcome.status, Status::Exited { code }, "{outcome:?}");
        assert_eq!(outcome.exit_code(), code);
        assert_eq!(String::from_utf8_lossy(&outcome.stderr), "to stderr\n");
    }
}

#[test]
fn args_env_and_stdin_reach_the_guest() {
    let caps = Capabilities {
        env: vec!["GREETING=hi there".parse().expect("env"), "EMPTY=".parse().expect("env")],
        ..Capabilities::default()
    };
    let outcome = run_with_stdin(programs::ECHO, &["a b", "--flag", ""], &caps, b"line one\nline two");
    let text = stdout(&outcome);
    assert_eq!(outcome.status, Status::Exited { code: 0 });
    assert!(text.contains("arg[0]=echo.wasm\narg[1]=a b\narg[2]=--flag\narg[3]=\n"), "{text}");
    assert!(text.contains("env EMPTY=\nenv GREETING=hi there\n"), "{text}");
    assert!(text.ends_with("stdin=line one\nline two\n"), "{text}");
    assert!(!text.contains("env PATH="), "the host environment must not leak: {text}");
}

#[test]
fn secrets_are_in_the_environment_but_redacted_from_output() {
    let caps = Capabilities {
        secrets: vec![EnvVar { name: "API_KEY".into(), value: "sk-live-0123456789".into() }],
        ..Capabilities::default()
    };
    let outcome = run(programs::ECHO, &["sk-live-0123456789"], &caps, &Limits::default());
    let text = stdout(&outcome);
    assert!(text.contains("env API_KEY=[REDACTED:API_KEY]"), "{text}");
    assert!(text.contains("arg[1]=[REDACTED:API_KEY]"), "{text}");
    assert!(!text.contains("sk-live"), "{text}");
}

#[test]
fn a_panicking_guest_is_trapped_with_its_message_on_stderr() {
    let outcome = run(programs::PANIC, &["loudly"], &Capabilities::default(), &Limits::default());
    let Status::Trapped { message } = &outcome.status else { panic!("expected a trap: {outcome:?}") };
    assert!(message.contains("unreachable"), "{message}");
    assert!(String::from_utf8_lossy(&outcome.stderr).contains("guest panicked loudly"), "{outcome:?}");
    assert_eq!(outcome.exit_code(), 125);
}

#[test]
fn a_module_importing_an_unknown_function_is_rejected_by_name() {
    let err = try_run(programs::UNKNOWN_IMPORT_WAT, &[], &Capabilities::default(), &Limits::default())
        .expect_err("must not run");
    assert!(matches!(err, EngineError::Tier(TierError::UnknownImport { .. })), "{err:?}");
    assert!(err.to_string().contains("env::launch_missiles"), "{err}");
}

#[test]
fn a_reactor_module_is_rejected() {
    let err = try_run(programs::REACTOR_WAT, &[], &Capabilities::default(), &Limits::default()).expect_err("reactor");
    assert!(err.to_string().contains("no `_start` export"), "{err}");
}

#[test]
fn bad_inputs_are_typed_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let text = dir.path().join("notes.wasm");
    std::fs::write(&text, "just some text").expect("write");
    let truncated = dir.path().join("truncated.wasm");
    let hello = std::fs::read(programs::HELLO).expect("read");
    std::fs::write(&truncated, &hello[..hello.len() / 2]).expect("write");
    let caps = Capabilities::default();
    let limits = Limits::default();

    let err = try_run(text.to_str().expect("utf8"), &[], &caps, &limits).expect_err("text");
    assert_eq!(err.code(), "wrong_format", "{err}");
    let err = try_run(truncated.to_str().expect("utf8"), &[], &caps, &limits).expect_err("truncated");
    assert_eq!(err.code(), "invalid_module", "{err}");
    let err = try_run("/nonexistent/strata/missing.wasm", &[], &caps, &limits).expect_err("missing");
    assert_eq!(err.code(), "input_unreadable", "{err}");
    assert!(err.to_string().contains("/nonexistent/strata/missing.wasm"), "{err}");
    let err = try_run(dir.path().to_str().expect("utf8"), &[], &caps, &limits).expect_err("a directory");
    assert_eq!(err.code(), "wrong_format", "{err}");
}

#[test]
fn a_grant_whose_host_directory_is_missing_is_refused() {
    let caps =
        Capabilities { grants: vec!["/nonexistent/strata:/data:ro".parse().expect("grant")], ..Default::default() };
    let err = try_run(programs::HELLO, &[], &caps, &Limits::default()).expect_err("missing grant");
    assert_eq!(err.to_string(), "grant host path /nonexistent/strata does not exist");
}

#[test]
fn network_and_unregistered_tools_are_refused() {
    let caps = Capabilities { net: Net::allow(["example.com:443"]).expect("valid allowlist"), ..Default::default() };
    let err = try_run(programs::HELLO, &[], &caps, &Limits::default()).expect_err("net");
    assert_eq!(err.code(), "unsupported", "{err}");
    let caps = Capabilities { tools: vec!["search".into()], ..Default::default() };
    let err = try_run(programs::HELLO, &[], &caps, &Limits::default()).expect_err("unregistered tool");
    assert_eq!((err.code(), err.to_string().as_str()), ("invalid_tool", "no tool named search is registered"));
}

#[test]
fn a_tier_not_in_this_build_or_the_wrong_tier_is_a_typed_error() {
    let command = strata_core::Job::Command { argv: vec!["true".into()] };
    let err = engine()
        .execute(RunRequest::new(&command).limits(Limits::default()).tier(TierChoice::Tier(TierKind::Microvm)))
        .expect_err("microvm tier");
    assert_eq!(err.code(), "tier_unavailable", "{err}");
    // A WebAssembly job on a native tier is refused before the tier starts.
    let hello = job(programs::HELLO, &[]);
    let err = engine()
        .execute(RunRequest::new(&hello).limits(Limits::default()).tier(TierChoice::Tier(TierKind::Process)))
        .expect_err("process tier");
    assert_eq!(err.code(), "wrong_job", "{err}");
}

#[test]
fn fuel_metered_jobs_report_the_fuel_they_used() {
    let outcome = run(programs::HELLO, &[], &Capabilities::default(), &limits("fuel = 100000000"));
    assert_eq!(outcome.status, Status::Exited { code: 0 });
    let fuel = outcome.usage.fuel.expect("metered");
    assert!(fuel > 0 && fuel < 100_000_000, "{fuel}");
    assert_eq!(Limits::default().fuel, Fuel::Unlimited);
}

#[derive(Default)]
struct Collect(Mutex<Vec<(Stream, Vec<u8>)>>);

impl OutputSink for Collect {
    fn output(&self, stream: Stream, chunk: &[u8]) {
        self.0.lock().expect("lock").push((stream, chunk.to_vec()));
    }
}

#[test]
fn the_output_sink_sees_what_the_outcome_captures() {
    let sink = Arc::new(Collect::default());
    let flood = job(programs::FLOOD, &["20000"]);
    let outcome = engine()
        .execute(RunRequest::new(&flood).limits(limits("output = \"10KiB\"")).on_output(sink.clone()))
        .expect("runs");
    let chunks = sink.0.lock().expect("lock");
    let streamed = |which| chunks.iter().filter(|(s, _)| *s == which).flat_map(|(_, c)| c.clone()).collect::<Vec<u8>>();
    assert_eq!(streamed(Stream::Stdout), outcome.stdout);
    assert_eq!(streamed(Stream::Stderr), outcome.stderr);
    assert_eq!(outcome.stdout.len(), 10 << 10);
}

#[test]
fn a_cancelled_job_stops_with_a_typed_error() {
    let cancel = CancelToken::new();
    let canceller = {
        let cancel = cancel.clone();
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(100));
            cancel.cancel();
        })
    };
    let spin = job(programs::SPIN, &[]);
    let result = engine().execute(RunRequest::new(&spin).limits(limits("wall = \"60s\"")).cancel(cancel));
    canceller.join().expect("join");
    assert!(matches!(result, Err(EngineError::Tier(TierError::Cancelled))), "{result:?}");
}

#[test]
fn a_real_outcome_round_trips_through_json() {
    let outcome = run(programs::EXIT, &["7"], &Capabilities::default(), &Limits::default());
    let json = serde_json::to_string(&outcome).expect("json");
    let back: Outcome = serde_json::from_str(&json).expect("parse");
    assert_eq!(back.status, outcome.status);
    assert_eq!(back.stdout, outcome.stdout);
}

#[test]
fn jobs_run_when_called_from_inside_an_async_runtime() {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let outcome = runtime
        .block_on(async { engine().execute(RunRequest::new(&job(programs::EXIT, &["9"])).limits(Limits::default())) });
    assert_eq!(outcome.expect("runs").status, Status::Exited { code: 9 });
    let outcome = runtime.block_on(async {
        tokio::task::spawn_blocking(|| {
            engine().execute(RunRequest::new(&job(programs::EXIT, &["8"])).limits(Limits::default()))
        })
        .await
        .expect("join")
    });
    assert_eq!(outcome.expect("runs").status, Status::Exited { code: 8 });
}
