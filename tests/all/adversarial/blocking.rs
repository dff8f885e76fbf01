//! A wall limit that a blocked guest escapes: every host call a guest can wait in — sleeps and clock waits,
//! stdin held open by its writer, a host tool that never answers, a socket whose server never answers, a read or an
//! `accept` on the native tiers — must be cut short by the job's wall limit and by a cancel, on every tier.
//!
//! Each case blocks for an hour unless stopped; it must end as `limit_exceeded`/`wall` under a 1 s limit, or as
//! `cancelled` when its token is cancelled 300 ms in, within [`BOUND`] (a sanity bound, not a measurement). A run
//! that does not return within the bound fails the test rather than hang it.

use std::sync::OnceLock;
use std::sync::mpsc::RecvTimeoutError;
use std::time::{Duration, Instant};

use strata_core::{
    CancelToken, Capabilities, ExecOptions, Job, LimitKind, Limits, Net, Outcome, PythonSource, Status, StdinStream,
    TierKind, Tool,
};
use strata_engine::{Engine, EngineError, RunRequest, TierChoice};
use strata_test_programs as programs;

use crate::util::{limits, python_engine};

/// How long a stopped job may take to return, from its start (a sanity bound).
const BOUND: Duration = Duration::from_secs(10);

/// When a cancel case cancels its job.
const CANCEL_AFTER: Duration = Duration::from_millis(300);

/// How long the `hang` tool takes to answer: far longer than [`BOUND`].
const HANG: Duration = Duration::from_secs(60);

/// One way to block: a job, its capabilities, and whether its stdin is a stream whose writer stays open.
struct Case {
    name: &'static str,
    tier: TierKind,
    job: Job,
    caps: Capabilities,
    stdin_held_open: bool,
}

impl Case {
    fn new(name: &'static str, tier: TierKind, job: Job) -> Case {
        Case { name, tier, job, caps: Capabilities::default(), stdin_held_open: false }
    }

    fn stdin_held_open(self) -> Case {
        Case { stdin_held_open: true, ..self }
    }

    fn caps(self, caps: Capabilities) -> Case {
        Case { caps, ..self }
    }
}

fn wasm(args: &[&str]) -> Job {
    Job::wasm_file(programs::BLOCK, args.iter().map(|a| a.to_string()).collect())
}

fn component(program: &str, args: &[&str]) -> Job {
    Job::wasm_file(program, args.iter().map(|a| a.to_string()).collect())
}

fn python(code: &str) -> Job {
    Job::Python { source: PythonSource::Code(code.into()), args: Vec::new() }
}

fn command(argv: &[&str]) -> Job {
    Job::Command { argv: argv.iter().map(|a| a.to_string()).collect() }
}

/// The engine of these tests: the real `$STRATA_HOME` (the Python runtime, the process tier's image) and, beside
/// the shared test tools, `hang`, a tool whose handler takes [`HANG`] to answer.
fn engine() -> &'static Engine {
    static HANG_TOOL: OnceLock<()> = OnceLock::new();
    let engine = python_engine();
    HANG_TOOL.get_or_init(|| {
        let hang = Tool::new("hang", "Answers after a minute.", serde_json::json!({"type": "object"}), |_| {
            std::thread::sleep(HANG);
            Ok(serde_json::json!("late"))
        })
        .expect("hang tool");
        engine.tools().register(hang).expect("register hang");
    });
    engine
}

/// Runs `f` on a thread of its own and returns what it returned, failing the test when that takes longer than
/// [`BOUND`] (the thread is left behind: the run it makes is what the test found stuck).
fn within_bound<T: Send + 'static>(name: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(BOUND) {
        Ok(value) => value,
        Err(RecvTimeoutError::Timeout) => panic!("{name}: still running {BOUND:?} after it started"),
        Err(RecvTimeoutError::Disconnected) => panic!("{name}: the run panicked"),
    }
}

/// Runs `case` under `limits` and `cancel`, with its stdin stream's writer held open for the whole run.
fn run(case: &Case, limits: Limits, cancel: Option<CancelToken>) -> (Result<Outcome, EngineError>, Duration) {
    let (stdin_stream, writer) = if case.stdin_held_open {
        let (stream, writer) = StdinStream::pipe().expect("pipe");
        (Some(stream), Some(writer))
    } else {
        (None, None)
    };
    let (tier, job, caps) = (case.tier, case.job.clone(), case.caps.clone());
    within_bound(case.name, move || {
        let mut request = RunRequest::new(&job).caps(&caps).limits(limits).tier(TierChoice::Tier(tier));
        if let Some(stream) = stdin_stream {
            request = request.stdin_stream(stream);
        }
        if let Some(cancel) = cancel {
            request = request.cancel(cancel);
        }
        let started = Instant::now();
        let result = engine().execute(request);
        let took = started.elapsed();
        drop(writer);
        (result, took)
    })
}

/// The case ends at a 1 s wall limit, reported as such, without ever waking.
fn ends_at_the_wall_limit(case: &Case) {
    let (result, took) = run(case, limits("wall = \"1s\""), None);
    let outcome = result.unwrap_or_else(|err| panic!("{}: {err}", case.name));
    assert_eq!(outcome.status, Status::LimitExceeded { limit: LimitKind::Wall }, "{}: {outcome:?}", case.name);
    assert!(!String::from_utf8_lossy(&outcome.stdout).contains("woke"), "{}: {outcome:?}", case.name);
    assert!(took < BOUND, "{}: took {took:?}", case.name);
}

/// The case ends when its token is cancelled, long before its (one hour) wall limit.
fn ends_at_a_cancel(case: &Case) {
    let cancel = CancelToken::new();
    let canceller = {
        let cancel = cancel.clone();
        std::thread::spawn(move || {
            std::thread::sleep(CANCEL_AFTER);
            cancel.cancel();
        })
    };
    let (result, took) = run(case, limits("wall = \"1h\""), Some(cancel));
    canceller.join().expect("canceller");
    match result {
        Err(err) => assert_eq!(err.code(), "cancelled", "{}: {err}", case.name),
        Ok(outcome) => panic!("{}: not cancelled: {outcome:?}", case.name),
    }
    assert!(took < BOUND, "{}: took {took:?}", case.name);
}

fn stopped_both_ways(case: Case) {
    ends_at_the_wall_limit(&case);
    ends_at_a_cancel(&case);
}

#[test]
fn a_wasm_sleep_is_stopped() {
    stopped_both_ways(Case::new("sleep", TierKind::Wasm, wasm(&["sleep"])));
}

#[test]
fn a_wasm_wait_for_an_absolute_clock_is_stopped() {
    stopped_both_ways(Case::new("sleep-abs", TierKind::Wasm, wasm(&["sleep-abs"])));
}

#[test]
fn wasm_naps_one_after_another_are_stopped() {
    stopped_both_ways(Case::new("naps", TierKind::Wasm, wasm(&["naps"])));
}

#[test]
fn a_wasm_poll_on_stdin_held_open_is_stopped() {
    stopped_both_ways(Case::new("poll-stdin", TierKind::Wasm, wasm(&["poll-stdin"])).stdin_held_open());
}

#[test]
fn a_wasm_read_of_stdin_held_open_is_stopped() {
    stopped_both_ways(Case::new("read-stdin", TierKind::Wasm, wasm(&["read-stdin"])).stdin_held_open());
}

#[test]
fn a_wasm_call_to_a_tool_that_never_answers_is_stopped() {
    let caps = Capabilities { tools: vec!["hang".into()], ..Capabilities::default() };
    stopped_both_ways(Case::new("tool", TierKind::Wasm, wasm(&["tool", "hang"])).caps(caps));
}

#[test]
fn a_tool_that_never_answers_holds_no_job_run_from_inside_an_async_runtime() {
    // A server calls jobs from inside its runtime; the job then runs on a thread of its own, whose end must not
    // wait for the tool's handler.
    let caps = Capabilities { tools: vec!["hang".into()], ..Capabilities::default() };
    let job = wasm(&["tool", "hang"]);
    let (outcome, took) = within_bound("tool inside a runtime", move || {
        let runtime = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        runtime.block_on(async {
            let started = Instant::now();
            let request = RunRequest::new(&job)
                .caps(&caps)
                .limits(limits("wall = \"1s\""))
                .tier(TierChoice::Tier(TierKind::Wasm));
            let outcome = engine().execute(request);
            (outcome, started.elapsed())
        })
    });
    let outcome = outcome.expect("runs");
    assert_eq!(outcome.status, Status::LimitExceeded { limit: LimitKind::Wall }, "{outcome:?}");
    assert!(took < BOUND, "took {took:?}");
}

#[test]
fn a_wasm_open_of_a_fifo_in_a_grant_is_refused_rather_than_waited_on() {
    // A FIFO with no writer (put there by the host, or by another job sharing the directory): open(2) waits for one.
    let dir = tempfile::tempdir().expect("tempdir");
    let fifo = dir.path().join("fifo");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
    assert!(made.success(), "mkfifo {}", fifo.display());
    let grant = strata_core::Grant::new(dir.path(), "/data", strata_core::GrantMode::Ro).expect("grant");
    let caps = Capabilities { grants: vec![grant], ..Capabilities::default() };
    let case = Case::new("fifo", TierKind::Wasm, wasm(&["open", "/data/fifo"])).caps(caps.clone());
    // Refused outright (it could only be opened by waiting on the job's thread): the job goes on and ends.
    let (result, _) = run(&case, limits("wall = \"1s\""), None);
    let outcome = result.expect("runs");
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{outcome:?}");
    assert!(String::from_utf8_lossy(&outcome.stdout).starts_with("open: Permission denied"), "{outcome:?}");
    let case = Case::new("component fifo", TierKind::Wasm, component(programs::COMPONENT_TOOL, &["cat", "/data/fifo"]));
    let (result, _) = run(&case.caps(caps), limits("wall = \"1s\""), None);
    let outcome = result.expect("runs");
    assert_eq!(outcome.status, Status::Exited { code: 1 }, "{outcome:?}");
    assert!(String::from_utf8_lossy(&outcome.stdout).starts_with("refused: Permission denied"), "{outcome:?}");
}

#[test]
fn a_component_sleep_is_stopped() {
    stopped_both_ways(Case::new(
        "component sleep",
        TierKind::Wasm,
        component(programs::COMPONENT_TOOL, &["sleep", "3600000"]),
    ));
}

#[test]
fn a_component_read_of_stdin_held_open_is_stopped() {
    stopped_both_ways(
        Case::new("component stdin", TierKind::Wasm, component(programs::COMPONENT_TOOL, &["echo"])).stdin_held_open(),
    );
}

#[test]
fn a_component_read_from_a_server_that_never_answers_is_stopped() {
    // The server accepts every connection and never writes: the guest's read of the answer waits for ever.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            held.push(stream);
        }
    });
    let target = format!("127.0.0.1:{port}");
    let caps = Capabilities { net: Net::allow([target.clone()]).expect("valid allowlist"), ..Capabilities::default() };
    let job = component(programs::COMPONENT_NET, &["get", &target]);
    stopped_both_ways(Case::new("component socket", TierKind::Wasm, job).caps(caps));
}

/// Warms the Python runtime up (its first load may compile it), so that a case's time is the case's.
fn python_ready() {
    let outcome = engine()
        .execute(RunRequest::new(&python("pass")).limits(Limits::default()).tier(TierChoice::Tier(TierKind::Wasm)))
        .expect("python runs");
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{outcome:?}");
}

#[test]
fn a_python_sleep_is_stopped() {
    python_ready();
    stopped_both_ways(Case::new(
        "python sleep",
        TierKind::Wasm,
        python("import time\ntime.sleep(3600)\nprint('woke')"),
    ));
}

#[test]
fn a_python_read_of_stdin_held_open_is_stopped() {
    python_ready();
    let job = python("import sys\nsys.stdin.read()\nprint('woke')");
    stopped_both_ways(Case::new("python stdin", TierKind::Wasm, job).stdin_held_open());
}

#[test]
fn a_python_session_turn_that_sleeps_is_stopped() {
    python_ready();
    let engine = engine();
    for cancelled in [false, true] {
        let sandbox = engine
            .start(TierChoice::Tier(TierKind::Wasm), &Capabilities::default(), &Limits::default())
            .expect("sandbox");
        let first = sandbox.exec(&python("x = 1"), ExecOptions::default()).expect("first turn");
        assert_eq!(first.status, Status::Exited { code: 0 }, "{first:?}");
        let cancel = CancelToken::new();
        let opts = ExecOptions {
            limits: Some(limits(if cancelled { "wall = \"1h\"" } else { "wall = \"1s\"" })),
            cancel: Some(cancel.clone()),
            ..ExecOptions::default()
        };
        if cancelled {
            let cancel = cancel.clone();
            std::thread::spawn(move || {
                std::thread::sleep(CANCEL_AFTER);
                cancel.cancel();
            });
        }
        let (result, took) = within_bound("session turn", move || {
            let started = Instant::now();
            let result = sandbox.exec(&python("import time\ntime.sleep(3600)"), opts);
            (result, started.elapsed())
        });
        match (cancelled, result) {
            (false, Ok(outcome)) => {
                assert_eq!(outcome.status, Status::LimitExceeded { limit: LimitKind::Wall }, "{outcome:?}")
            }
            (true, Err(err)) => assert_eq!(err.code(), "cancelled", "{err}"),
            (_, other) => panic!("cancelled {cancelled}: {other:?}"),
        }
        assert!(took < BOUND, "took {took:?}");
    }
}

/// Whether the tier runs here; one skip line when it does not.
fn tier_runs(tier: TierKind, test: &str) -> bool {
    let available = match tier {
        TierKind::Process => engine().process().map(|_| ()),
        TierKind::Microvm => engine().microvm().map(|_| ()),
        TierKind::Wasm => Ok(()),
    };
    match available {
        Ok(()) => true,
        Err(err) => {
            eprintln!("skip {test}: the {tier} tier cannot run on this host: {err}");
            false
        }
    }
}

/// The blocking cases of a native tier: a sleep, a read of stdin held open, and (where the image has python3) an
/// `accept` nobody connects to.
fn native_cases(tier: TierKind, python3: bool) -> Vec<Case> {
    let mut cases = vec![
        Case::new("native sleep", tier, command(&["sleep", "3600"])),
        Case::new("native read of stdin", tier, command(&["head", "-c", "1"])).stdin_held_open(),
    ];
    if python3 {
        let accept =
            "import socket\ns = socket.socket()\ns.bind(('127.0.0.1', 0))\ns.listen()\ns.accept()\nprint('woke')";
        cases.push(Case::new("native accept", tier, command(&["python3", "-c", accept])));
    }
    cases
}

#[test]
fn process_jobs_blocked_in_sleep_read_or_accept_are_stopped() {
    if !tier_runs(TierKind::Process, "process_jobs_blocked_in_sleep_read_or_accept_are_stopped") {
        return;
    }
    for case in native_cases(TierKind::Process, true) {
        stopped_both_ways(case);
    }
}

#[test]
fn microvm_jobs_blocked_in_sleep_read_or_accept_are_stopped() {
    if !tier_runs(TierKind::Microvm, "microvm_jobs_blocked_in_sleep_read_or_accept_are_stopped") {
        return;
    }
    // The microVM's default image is the initramfs (busybox, no python3).
    for case in native_cases(TierKind::Microvm, false) {
        stopped_both_ways(case);
    }
}
