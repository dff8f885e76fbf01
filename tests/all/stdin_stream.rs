//! stdin as a stream (`ExecOptions::stdin_stream`): the job reads each line as the caller writes it, on every tier
//! (the process tier gives the pipe to the job itself; the wasm tier pumps it into the guest, a Python session's
//! turn included). Both in one-shot runs and in sandboxes.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use strata_core::{
    Capabilities, ExecOptions, Job, Limits, OutputSink, PythonSource, Status, StdinStream, Stream, TierKind,
};
use strata_engine::{RunRequest, TierChoice};

use crate::util::python_engine;

#[derive(Default)]
struct Collect(Mutex<Vec<u8>>);

impl OutputSink for Collect {
    fn output(&self, stream: Stream, chunk: &[u8]) {
        if stream == Stream::Stdout {
            self.0.lock().expect("lock").extend_from_slice(chunk);
        }
    }
}

impl Collect {
    fn wait_for(&self, text: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !String::from_utf8_lossy(&self.0.lock().expect("lock")).contains(text) {
            assert!(
                Instant::now() < deadline,
                "no {text:?} in {:?}",
                String::from_utf8_lossy(&self.0.lock().expect("lock"))
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Echoes each line of stdin as `got <line>`, flushing, until EOF.
fn echo_lines() -> Job {
    Job::Python {
        source: PythonSource::Code(
            "import sys\nfor line in sys.stdin:\n    print('got', line.strip(), flush=True)\n".into(),
        ),
        args: Vec::new(),
    }
}

#[test]
fn the_process_tier_reads_a_stream_while_the_caller_writes_it() {
    let engine = python_engine();
    if let Err(err) = engine.process() {
        eprintln!("skip: the process tier cannot run on this host: {err}");
        return;
    }
    reads_a_stream_while_the_caller_writes_it(TierKind::Process);
}

#[test]
fn the_wasm_tier_reads_a_stream_while_the_caller_writes_it() {
    reads_a_stream_while_the_caller_writes_it(TierKind::Wasm);
}

fn reads_a_stream_while_the_caller_writes_it(tier: TierKind) {
    let engine = python_engine();
    let choice = TierChoice::Tier(tier);
    let (caps, limits) = (Capabilities::default(), Limits::default());
    let sandbox = engine.start(choice, &caps, &limits).expect("sandbox");
    for round in 0..2 {
        let (stream, mut writer) = StdinStream::pipe().expect("pipe");
        let sink = Arc::new(Collect::default());
        let opts = ExecOptions { stdin_stream: Some(stream), sink: Some(sink.clone()), ..ExecOptions::default() };
        let outcome = std::thread::scope(|scope| {
            let job = scope.spawn(|| {
                if round == 0 {
                    let job = echo_lines();
                    let request = RunRequest::new(&job).caps(&caps).limits(limits.clone()).tier(choice);
                    engine.execute(request.options(opts)).expect("one-shot run")
                } else {
                    sandbox.exec(&echo_lines(), opts).expect("sandbox exec")
                }
            });
            // The job answers the first line before the second is written: it reads the stream as it comes.
            writer.write_all(b"one\n").expect("write");
            sink.wait_for("got one\n");
            writer.write_all(b"two\n").expect("write");
            sink.wait_for("got two\n");
            drop(writer);
            job.join().expect("job thread")
        });
        assert_eq!((outcome.tier, outcome.status.clone()), (tier, Status::Exited { code: 0 }), "{outcome:?}");
        assert_eq!(String::from_utf8_lossy(&outcome.stdout), "got one\ngot two\n", "round {round}");
    }
    sandbox.close().expect("close");
}

/// An escalating job reads its stream live on both runs: the wasm attempt takes the first line and fails for want
/// of a module; the native rerun gets that line again (replayed) and then the rest as the caller writes it, after
/// the rerun has started (its own output says so).
#[test]
fn an_escalating_job_reads_its_stream_live_on_both_runs() {
    let scratch = tempfile::tempdir().expect("scratch");
    let policy =
        strata_engine::Policy::from_toml("[tiers]\nnative = \"process\"\n", std::path::Path::new("policy.toml"))
            .expect("policy");
    let home = strata_engine::strata_home().expect("STRATA_HOME or HOME");
    let engine = strata_engine::Engine::new(strata_engine::EngineConfig {
        home: Some(home),
        policy,
        scratch_dir: Some(scratch.path().to_owned()),
        ..strata_engine::EngineConfig::default()
    })
    .expect("engine");
    if let Err(err) = engine.process() {
        eprintln!("skip: the process tier cannot run on this host: {err}");
        return;
    }
    // `resource` through a name the import scan cannot see: the router sends the job to wasm, which lacks it.
    let job = Job::Python {
        source: PythonSource::Code(
            "import importlib, sys\n\
             print('first', sys.stdin.readline().strip(), flush=True)\n\
             importlib.import_module('res' + 'ource')\n\
             print('rest', sys.stdin.read().strip(), flush=True)\n"
                .into(),
        ),
        args: Vec::new(),
    };
    let (stream, mut writer) = StdinStream::pipe().expect("pipe");
    let sink = Arc::new(Collect::default());
    let request = RunRequest::new(&job).limits(Limits::default()).stdin_stream(stream).on_output(sink.clone());
    let outcome = std::thread::scope(|scope| {
        let job = scope.spawn(|| engine.execute(request).expect("runs"));
        writer.write_all(b"one\n").expect("write");
        // Only the native run's output reaches the sink: it has read the replayed line.
        sink.wait_for("first one\n");
        writer.write_all(b"two\nthree\n").expect("write");
        drop(writer);
        job.join().expect("job thread")
    });
    assert_eq!(outcome.escalations.len(), 1, "{outcome:?}");
    assert_eq!((outcome.tier, outcome.status.clone()), (TierKind::Process, Status::Exited { code: 0 }), "{outcome:?}");
    assert_eq!(String::from_utf8_lossy(&outcome.stdout), "first one\nrest two\nthree\n");
}
