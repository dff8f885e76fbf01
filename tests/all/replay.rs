//! Reproducible wasm runs: a seed fixes a job's clocks and randomness; a recording re-runs a job with the same
//! inputs and judges that its output and status are byte-identical, or says where they diverged.

use std::sync::Arc;

use strata_core::replay::{Input, MAX_RECORDING_BYTES};
use strata_core::{
    Capabilities, Determinism, Divergence, ExecOptions, Job, Limits, Outcome, PythonSource, Recorder, Recording,
    ReplayError, Replayer, Status, Stream, TierError, TierKind,
};
use strata_engine::{EngineError, RunRequest, TierChoice};
use strata_test_programs as programs;

use crate::util::{python_engine, stderr, stdout};

/// Prints the wall clock, `random`, `os.urandom` and a `uuid4`: everything a run reads from its host's entropy.
const ENTROPY: &str = "import time, random, os, uuid\n\
                       print(time.time(), time.monotonic(), random.random(), os.urandom(8).hex(), uuid.uuid4())";

fn code(text: &str) -> Job {
    Job::Python { source: PythonSource::Code(text.into()), args: vec!["arg".into()] }
}

/// Runs `job` on the wasm tier with `determinism` and `stdin`.
fn run_with(job: &Job, caps: &Capabilities, determinism: Determinism, stdin: &[u8]) -> Result<Outcome, EngineError> {
    let opts = ExecOptions { stdin: Some(stdin.to_vec()), determinism: Some(determinism), ..ExecOptions::default() };
    python_engine().execute(
        RunRequest::new(job).caps(caps).limits(Limits::default()).tier(TierChoice::Tier(TierKind::Wasm)).options(opts),
    )
}

fn seeded(text: &str, seed: u64) -> Outcome {
    let outcome = run_with(&code(text), &Capabilities::default(), Determinism::Seed(seed), b"").expect("run");
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{}", stderr(&outcome));
    outcome
}

/// Records `job`, returning its outcome and recording (through JSON, as a file holds it).
fn record(job: &Job, caps: &Capabilities, stdin: &[u8]) -> (Outcome, Recording) {
    let recorder = Arc::new(Recorder::new(None));
    let outcome = run_with(job, caps, Determinism::Record(recorder.clone()), stdin).expect("recorded run");
    let recording = recorder.finish(&outcome).expect("a recording");
    (outcome, Recording::from_slice(&recording.to_json()).expect("the recording parses"))
}

/// Replays `recording` as `strata replay` does, returning the outcome and the verdict.
fn replay(recording: Recording) -> (Outcome, Result<(), Divergence>) {
    let job = recording.job().expect("the recorded job");
    let caps = recording.caps();
    let stdin = recording.stdin.0.clone();
    let replayer = Arc::new(Replayer::new(recording));
    let outcome = run_with(&job, &caps, Determinism::Replay(replayer.clone()), &stdin).expect("replayed run");
    let verdict = replayer.verdict(&outcome);
    (outcome, verdict)
}

#[test]
fn the_same_seed_gives_byte_identical_output_and_another_seed_another() {
    let first = seeded(ENTROPY, 7);
    let second = seeded(ENTROPY, 7);
    assert_eq!(stdout(&first), stdout(&second));
    assert_eq!(first.stderr, second.stderr);
    let other = seeded(ENTROPY, 8);
    assert_ne!(stdout(&first), stdout(&other));
    // Each field differs, not only the clock.
    let fields = |o: &Outcome| stdout(o).split_whitespace().map(str::to_owned).collect::<Vec<_>>();
    for (a, b) in fields(&first).iter().zip(fields(&other)).skip(2) {
        assert_ne!(*a, b, "{} vs {}", stdout(&first), stdout(&other));
    }
    // The seeded wall clock is in 2024-2025, whatever the host's says.
    let time: f64 = fields(&first)[0].parse().expect("a time");
    assert!((1_704_067_200.0..1_704_067_200.0 + 367.0 * 86_400.0).contains(&time), "{time}");
}

#[test]
fn a_recorded_python_job_replays_byte_for_byte() {
    let job = code(&format!("import sys\n{ENTROPY}\nprint(sys.argv, sys.stdin.read())\nsys.exit(3)"));
    let caps = Capabilities { env: vec!["GREETING=hi".parse().expect("env")], ..Capabilities::default() };
    let (outcome, recording) = record(&job, &caps, b"the input");
    assert_eq!(outcome.status, Status::Exited { code: 3 }, "{}", stderr(&outcome));
    assert!(stdout(&outcome).ends_with("['-c', 'arg'] the input\n"), "{}", stdout(&outcome));
    assert!(!recording.random.0.is_empty() && !recording.wall_clock_ns.is_empty());
    let (replayed, verdict) = replay(recording);
    assert_eq!(verdict, Ok(()));
    assert_eq!((replayed.stdout, replayed.stderr, replayed.status), (outcome.stdout, outcome.stderr, outcome.status));
}

#[test]
fn a_recorded_python_script_replays_from_the_recording_when_the_file_is_gone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let script = dir.path().join("job.py");
    std::fs::write(&script, format!("{ENTROPY}\nprint(__file__.endswith('job.py'))\n")).expect("write");
    let job = Job::Python { source: PythonSource::File(script.clone()), args: Vec::new() };
    let (outcome, recording) = record(&job, &Capabilities::default(), b"");
    assert!(stdout(&outcome).ends_with("True\n"), "{}", stderr(&outcome));
    std::fs::remove_file(&script).expect("remove");
    let (replayed, verdict) = replay(recording);
    assert_eq!(verdict, Ok(()));
    assert_eq!(replayed.stdout, outcome.stdout);
}

#[test]
fn a_recorded_wasm_module_replays_identically() {
    let job = Job::wasm_file(programs::ECHO, vec!["one".into(), "two".into()]);
    let caps = Capabilities { env: vec!["K=v".parse().expect("env")], ..Capabilities::default() };
    let (outcome, recording) = record(&job, &caps, b"stdin bytes");
    assert_eq!(outcome.status, Status::Exited { code: 0 });
    assert!(stdout(&outcome).contains("arg[2]=two") && stdout(&outcome).contains("stdin=stdin bytes"));
    let (replayed, verdict) = replay(recording);
    assert_eq!(verdict, Ok(()));
    assert_eq!(replayed.stdout, outcome.stdout);
}

#[test]
fn a_tampered_expected_stdout_is_a_divergence_at_its_offset() {
    let (outcome, mut recording) = record(&code("print('hello world')"), &Capabilities::default(), b"");
    assert_eq!(stdout(&outcome), "hello world\n");
    recording.expected.stdout.0 = b"hello World\n".to_vec();
    let (_, verdict) = replay(recording);
    let divergence = verdict.expect_err("a divergence");
    assert_eq!(
        divergence,
        Divergence::Output {
            stream: Stream::Stdout,
            offset: 6,
            expected: "\"World\\n\"".into(),
            actual: "\"world\\n\"".into()
        }
    );
    assert_eq!(divergence.to_string(), r#"stdout differs at byte 6: expected "World\n", got "world\n""#);
}

#[test]
fn a_recording_with_fewer_random_bytes_is_a_divergence() {
    let (_, mut recording) = record(&code("import os\nprint(os.urandom(64).hex())"), &Capabilities::default(), b"");
    let keep = recording.random.0.len() - 32;
    recording.random.0.truncate(keep);
    let (_, verdict) = replay(recording);
    let divergence = verdict.expect_err("a divergence");
    assert!(
        matches!(divergence, Divergence::MissingInput { input: Input::RandomBytes, recorded, .. } if recorded == keep),
        "{divergence:?}"
    );
    assert!(divergence.to_string().contains("asked for more random bytes"), "{divergence}");
}

#[test]
fn a_different_exit_status_is_a_divergence() {
    let (_, mut recording) = record(&code("print(1)"), &Capabilities::default(), b"");
    recording.expected.status = Status::Exited { code: 2 };
    let (_, verdict) = replay(recording);
    assert!(matches!(verdict, Err(Divergence::Status { .. })), "{verdict:?}");
}

#[test]
fn tool_answers_are_recorded_and_replayed_without_the_tool() {
    let caps = Capabilities { tools: vec!["add".into()], ..Capabilities::default() };
    let (outcome, recording) = record(&code("from host import tools\nprint(tools.add(40))"), &caps, b"");
    assert_eq!(stdout(&outcome), "42\n", "{}", stderr(&outcome));
    assert!(!recording.tool_exchanges.is_empty());
    // The replay's capabilities name no tool: every answer is the recording's.
    assert!(recording.caps().tools.is_empty());
    let (replayed, verdict) = replay(recording.clone());
    assert_eq!((verdict, stdout(&replayed)), (Ok(()), "42\n".to_owned()));

    let mut fewer = recording;
    fewer.tool_exchanges.pop();
    let (_, verdict) = replay(fewer);
    let divergence = verdict.expect_err("a divergence");
    assert!(matches!(divergence, Divergence::MissingInput { input: Input::ToolAnswer, .. }), "{divergence:?}");
}

#[test]
fn malformed_and_oversized_recordings_are_typed_errors() {
    assert!(matches!(Recording::from_slice(b"not json"), Err(ReplayError::Malformed(_))));
    assert!(matches!(Recording::from_slice(br#"{"format":"other","version":1}"#), Err(ReplayError::Format(_))));
    let (_, recording) = record(&code("print(1)"), &Capabilities::default(), b"");
    let mut json: serde_json::Value = serde_json::from_slice(&recording.to_json()).expect("json");
    json["surprise"] = serde_json::json!(1);
    let err = Recording::from_slice(&serde_json::to_vec(&json).expect("json")).expect_err("an unknown field");
    assert!(matches!(err, ReplayError::Malformed(_)) && err.to_string().contains("surprise"), "{err}");

    let dir = tempfile::tempdir().expect("tempdir");
    let big = dir.path().join("big.json");
    std::fs::File::create(&big).and_then(|f| f.set_len(MAX_RECORDING_BYTES + 1)).expect("a sparse file");
    let err = Recording::read(&big).expect_err("too large");
    assert!(matches!(err, ReplayError::TooLarge { .. }), "{err}");
    assert_eq!(err.code(), "invalid_recording");
}

#[test]
fn a_changed_module_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let module = dir.path().join("echo.wasm");
    std::fs::copy(programs::ECHO, &module).expect("copy");
    let (_, recording) = record(&Job::wasm_file(&module, Vec::new()), &Capabilities::default(), b"");
    std::fs::copy(programs::HELLO, &module).expect("replace");
    assert!(matches!(recording.job(), Err(ReplayError::ModuleChanged { .. })));
}

#[test]
fn other_tiers_and_streams_refuse_reproducible_runs() {
    // A recording cannot hold a secret's value.
    let caps = Capabilities { secrets: vec!["TOKEN=s3cret".parse().expect("secret")], ..Capabilities::default() };
    let recorder = Arc::new(Recorder::new(None));
    let err = run_with(&code("print(1)"), &caps, Determinism::Record(recorder), b"").expect_err("refused");
    assert!(matches!(err, EngineError::Tier(TierError::Replay(ReplayError::Secrets(_)))), "{err}");
    // The process tier refuses rather than run the job unseeded.
    if let Some(process) = crate::util::process_tier("other_tiers_and_streams_refuse_reproducible_runs") {
        use strata_core::Tier;
        let opts = ExecOptions { determinism: Some(Determinism::Seed(1)), ..ExecOptions::default() };
        let err = process.run(&code("print(1)"), &Capabilities::default(), &Limits::default(), opts);
        assert!(matches!(err, Err(TierError::Unsupported { tier: TierKind::Process, .. })), "{err:?}");
    }
}
