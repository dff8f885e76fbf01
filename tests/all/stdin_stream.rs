//! stdin as a stream (`ExecOptions::stdin_stream`): the process tier gives the pipe to the job itself, so the job
//! reads each line as the caller writes it; the wasm tier, which starts a job with all of its stdin, reads the stream
//! to its end first. Both in one-shot runs and in sandboxes.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use strata_core::{
    Capabilities, ExecOptions, Job, Limits, OutputSink, PythonSource, Status, StdinStream, Stream, TierKind,
};
use strata_engine::TierChoice;

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
    let choice = TierChoice::Tier(TierKind::Process);
    let (caps, limits) = (Capabilities::default(), Limits::default());
    let mut sandbox = engine.start(choice, &caps, &limits).expect("sandbox");
    for round in 0..2 {
        let (stream, mut writer) = StdinStream::pipe().expect("pipe");
        let sink = Arc::new(Collect::default());
        let opts = ExecOptions { stdin_stream: Some(stream), sink: Some(sink.clone()), ..ExecOptions::default() };
        let outcome = std::thread::scope(|scope| {
            let job = scope.spawn(|| {
                if round == 0 {
                    engine.run_on(choice, &echo_lines(), &caps, &limits, opts).expect("one-shot run")
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
        assert_eq!(outcome.status, Status::Exited { code: 0 }, "{outcome:?}");
        assert_eq!(String::from_utf8_lossy(&outcome.stdout), "got one\ngot two\n", "round {round}");
    }
    sandbox.close().expect("close");
}

#[test]
fn the_wasm_tier_reads_a_stream_to_its_end_before_the_job_starts() {
    let engine = python_engine();
    let (caps, limits) = (Capabilities::default(), Limits::default());
    let (stream, mut writer) = StdinStream::pipe().expect("pipe");
    let writing = std::thread::spawn(move || {
        for line in ["one\n", "two\n"] {
            writer.write_all(line.as_bytes()).expect("write");
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    let opts = ExecOptions { stdin_stream: Some(stream), ..ExecOptions::default() };
    let outcome = engine.run_on(TierChoice::Tier(TierKind::Wasm), &echo_lines(), &caps, &limits, opts).expect("runs");
    writing.join().expect("writer");
    assert_eq!((outcome.tier, outcome.status.clone()), (TierKind::Wasm, Status::Exited { code: 0 }), "{outcome:?}");
    assert_eq!(String::from_utf8_lossy(&outcome.stdout), "got one\ngot two\n");
}
