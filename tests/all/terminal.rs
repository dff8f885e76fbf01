//! Jobs on a pseudo-terminal (`ExecOptions::terminal`): the process tier makes it from the jail's own `devpts`;
//! the job's streams and controlling terminal are the terminal, its window follows the handle, typed bytes go
//! through the line discipline (echo, Ctrl-C), and the wasm tier refuses.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use strata_core::{
    Capabilities, ExecOptions, Job, Limits, OutputSink, Sandbox, Status, StdinStream, Stream, Terminal, Tier,
    TierError, TierKind, WindowSize,
};

use crate::util::{process_tier, python_engine};

/// What the terminal printed, as it comes.
#[derive(Default)]
struct Screen(Mutex<Vec<u8>>);

impl OutputSink for Screen {
    fn output(&self, stream: Stream, chunk: &[u8]) {
        assert_eq!(stream, Stream::Stdout, "a terminal's output is one stream");
        self.0.lock().expect("lock").extend_from_slice(chunk);
    }
}

impl Screen {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("lock")).into_owned()
    }

    fn wait_for(&self, text: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.text().contains(text) {
            assert!(Instant::now() < deadline, "no {text:?} on the screen: {:?}", self.text());
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn sh(script: &str) -> Job {
    Job::Command { argv: vec!["/bin/sh".into(), "-c".into(), script.into()] }
}

fn on_terminal(size: WindowSize, screen: &Arc<Screen>) -> (ExecOptions, Terminal) {
    let terminal = Terminal::new(size);
    let opts = ExecOptions { terminal: Some(terminal.clone()), sink: Some(screen.clone()), ..ExecOptions::default() };
    (opts, terminal)
}

#[test]
fn a_job_on_a_terminal_has_it_as_its_streams_and_controlling_terminal() {
    let Some(tier) = process_tier("a_job_on_a_terminal_has_it_as_its_streams_and_controlling_terminal") else {
        return;
    };
    let screen = Arc::new(Screen::default());
    let (opts, _) = on_terminal(WindowSize { rows: 33, cols: 101 }, &screen);
    let script = "tty; stty size; test -t 0 && test -t 1 && test -t 2 && echo all three; \
                  echo to-stderr >&2; ls /dev/pts | tr '\\n' ' '; echo; exit 7";
    let outcome = tier.run(&sh(script), &Capabilities::default(), &Limits::default(), opts).expect("run");
    assert_eq!(outcome.status, Status::Exited { code: 7 }, "{}", screen.text());
    let text = screen.text();
    // The terminal's line discipline turns each newline into CR LF, both streams arrive on it.
    for line in ["/dev/pts/0\r\n", "33 101\r\n", "all three\r\n", "to-stderr\r\n", "0 ptmx \r\n"] {
        assert!(text.contains(line), "no {line:?} in {text:?}");
    }
    assert!(outcome.stderr.is_empty(), "a terminal has no separate stderr: {:?}", outcome.stderr);
}

#[test]
fn a_terminal_takes_typed_input_and_signals_and_follows_resizes_in_a_sandbox() {
    let Some(tier) = process_tier("a_terminal_takes_typed_input_and_signals_and_follows_resizes_in_a_sandbox") else {
        return;
    };
    let sandbox = tier.start(&Capabilities::default(), &Limits::default()).expect("start");
    // Two at once: one on the jail's first connection, one on a lane beside it, each with its own terminal.
    let (first, second) = (Arc::new(Screen::default()), Arc::new(Screen::default()));
    std::thread::scope(|scope| {
        let run = |screen: &Arc<Screen>| {
            let screen = screen.clone();
            let sandbox = &sandbox;
            scope.spawn(move || interact(sandbox.as_ref(), &screen))
        };
        let (a, b) = (run(&first), run(&second));
        a.join().expect("first");
        b.join().expect("second");
    });
    sandbox.close().expect("close");
}

/// Types a line, resizes and presses Ctrl-C on a job of `sandbox`'s terminal, checking each answer.
fn interact(sandbox: &dyn Sandbox, screen: &Arc<Screen>) {
    let (stream, mut keys) = StdinStream::pipe().expect("pipe");
    let (mut opts, terminal) = on_terminal(WindowSize { rows: 24, cols: 80 }, screen);
    opts.stdin_stream = Some(stream);
    let script = "trap 'stty size' WINCH; trap 'echo interrupted; exit 3' INT; \
                  read line; echo \"got:$line\"; echo ready; while :; do sleep 0.05; done";
    std::thread::scope(|scope| {
        let job = scope.spawn(|| sandbox.exec(&sh(script), opts));
        keys.write_all(b"hello\n").expect("type");
        // The terminal echoes what is typed, then the job answers.
        screen.wait_for("hello\r\ngot:hello\r\nready\r\n");
        terminal.resize(WindowSize { rows: 40, cols: 120 });
        screen.wait_for("40 120\r\n");
        keys.write_all(&[0x03]).expect("Ctrl-C");
        let outcome = job.join().expect("job").expect("exec");
        assert_eq!(outcome.status, Status::Exited { code: 3 }, "{}", screen.text());
        assert!(screen.text().contains("interrupted"), "{}", screen.text());
    });
}

#[test]
fn a_cancelled_job_on_a_terminal_ends_as_cancelled() {
    let Some(tier) = process_tier("a_cancelled_job_on_a_terminal_ends_as_cancelled") else {
        return;
    };
    let sandbox = tier.start(&Capabilities::default(), &Limits::default()).expect("start");
    let screen = Arc::new(Screen::default());
    let (mut opts, _) = on_terminal(WindowSize::default(), &screen);
    let cancel = strata_core::CancelToken::new();
    opts.cancel = Some(cancel.clone());
    std::thread::scope(|scope| {
        let job = scope.spawn(|| sandbox.exec(&sh("echo up; exec sleep 600"), opts));
        screen.wait_for("up");
        cancel.cancel();
        let err = job.join().expect("job").expect_err("cancelled");
        assert!(matches!(err, TierError::Cancelled), "{err}");
    });
    // The sandbox goes on, and its next job gets a terminal again.
    let screen = Arc::new(Screen::default());
    let (opts, _) = on_terminal(WindowSize::default(), &screen);
    let outcome = sandbox.exec(&sh("tty"), opts).expect("exec");
    assert_eq!(outcome.status, Status::Exited { code: 0 });
    assert!(screen.text().starts_with("/dev/pts/"), "{}", screen.text());
    sandbox.close().expect("close");
}

#[test]
fn a_jails_terminals_are_its_own_and_bounded() {
    let Some(tier) = process_tier("a_jails_terminals_are_its_own_and_bounded") else {
        return;
    };
    // A job opens terminals until the jail's devpts refuses: a bounded number, numbered in the jail.
    let code = "import os\nn = 0\ntry:\n    while True:\n        os.openpty(); n += 1\nexcept OSError as e:\n    \
                print(n, e.errno)\nprint(sorted(os.listdir('/dev/pts'))[:3])\n";
    let job = Job::Command { argv: vec!["python3".into(), "-c".into(), code.into()] };
    let limits = Limits { files: 1024, ..Limits::default() };
    let outcome = tier.run(&job, &Capabilities::default(), &limits, ExecOptions::default()).expect("run");
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{}", String::from_utf8_lossy(&outcome.stderr));
    let text = String::from_utf8_lossy(&outcome.stdout);
    let opened: usize = text.split_whitespace().next().and_then(|n| n.parse().ok()).expect("a count");
    assert_eq!(opened, strata_jail::tty::MAX_PTYS as usize, "{text}");
    assert!(text.contains("['0', '1', '10']"), "the jail's own numbering, from 0: {text}");
}

#[test]
fn the_wasm_tier_has_no_terminals_and_python_on_one_goes_native() {
    let engine = python_engine();
    let job = Job::Python { source: strata_core::PythonSource::Code("print(1)".into()), args: Vec::new() };
    let opts = ExecOptions { terminal: Some(Terminal::new(WindowSize::default())), ..ExecOptions::default() };
    let err = engine
        .execute(
            strata_engine::RunRequest::new(&job).tier(strata_engine::TierChoice::Tier(TierKind::Wasm)).options(opts),
        )
        .expect_err("wasm has no terminals");
    assert_eq!(err.code(), "unsupported", "{err}");
    if engine.process().is_err() {
        eprintln!("skip the native half: the process tier cannot run on this host");
        return;
    }
    let screen = Arc::new(Screen::default());
    let (opts, _) = on_terminal(WindowSize::default(), &screen);
    let outcome = engine.execute(strata_engine::RunRequest::new(&job).options(opts)).expect("run");
    assert_eq!(outcome.tier, TierKind::Process);
    let reason = outcome.route.as_ref().map(|r| r.reason.clone()).unwrap_or_default();
    assert!(reason.contains("terminal"), "{reason}");
    assert!(screen.text().contains("1\r\n"), "{}", screen.text());
}
