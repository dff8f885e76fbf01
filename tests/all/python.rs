//! Python on the wasm tier: CPython 3.15 with numpy and pandas, one-shot jobs, sessions, limits, grants, tools.

use strata_core::{
    Capabilities, ExecOptions, Grant, GrantMode, Job, LimitKind, Limits, PythonSource, Status, Tier, TierError,
    TierKind,
};
use strata_engine::{EngineError, RunRequest, TierChoice};

use crate::util::{limits, python, python_engine, stderr, stdout};

fn code(text: &str) -> Job {
    Job::Python { source: PythonSource::Code(text.into()), args: Vec::new() }
}

#[test]
fn print_reaches_stdout() {
    let outcome = python("print(1)", &Capabilities::default(), &Limits::default());
    assert_eq!(outcome.status, Status::Exited { code: 0 });
    assert_eq!(stdout(&outcome), "1\n");
    assert_eq!(outcome.usage.fuel, None);
    assert!(outcome.usage.peak_memory >= 40 << 20, "CPython's memory starts at 40 MiB: {:?}", outcome.usage);
}

#[test]
fn numpy_and_pandas_compute_the_right_values() {
    let outcome = python(
        "import numpy as np, pandas as pd\n\
         a = np.arange(1, 101, dtype=np.int64)\n\
         print(int(a.sum()), float(np.linalg.det(np.array([[2.0, 1.0], [1.0, 3.0]]))))\n\
         df = pd.DataFrame({'city': ['a', 'b', 'a', 'c'], 'sales': [10, 20, 30, 40]})\n\
         print(df.groupby('city')['sales'].sum().to_dict())\n\
         print(pd.Series([1.5, 2.5, None]).mean())",
        &Capabilities::default(),
        &Limits::default(),
    );
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{}", stderr(&outcome));
    assert_eq!(stdout(&outcome), "5050 5.000000000000001\n{'a': 40, 'b': 20, 'c': 40}\n2.0\n");
}

#[test]
fn an_uncaught_exception_prints_its_traceback_and_exits_1() {
    let outcome = python("def f():\n    return 1 / 0\nf()", &Capabilities::default(), &Limits::default());
    assert_eq!(outcome.status, Status::Exited { code: 1 });
    let err = stderr(&outcome);
    assert!(err.starts_with("Traceback (most recent call last):\n  File \"<string>\", line 3, in <module>"), "{err}");
    assert!(
        err.contains("  File \"<string>\", line 2, in f\n") && err.ends_with("ZeroDivisionError: division by zero\n"),
        "{err}"
    );
    assert!(!err.contains("__strata"), "the wrapper's frames are hidden: {err}");
}

#[test]
fn sys_exit_sets_the_exit_status() {
    let outcome = python("import sys\nprint('before')\nsys.exit(3)", &Capabilities::default(), &Limits::default());
    assert_eq!((&outcome.status, stdout(&outcome).as_str()), (&Status::Exited { code: 3 }, "before\n"));
    let outcome = python("raise SystemExit('fatal')", &Capabilities::default(), &Limits::default());
    assert_eq!((&outcome.status, stderr(&outcome).as_str()), (&Status::Exited { code: 1 }, "fatal\n"));
}

#[test]
fn argv_stdin_and_main_reach_the_program() {
    let job = Job::Python {
        source: PythonSource::Code(
            "import sys\nprint(sys.argv, __name__)\nprint(sys.stdin.read().splitlines())".into(),
        ),
        args: vec!["a b".into(), "--flag".into()],
    };
    let request = RunRequest::new(&job).limits(Limits::default()).stdin(b"line one\nline two\n".to_vec());
    let outcome = python_engine().execute(request).expect("runs");
    assert_eq!(stdout(&outcome), "['-c', 'a b', '--flag'] __main__\n['line one', 'line two']\n");
}

#[test]
fn scripts_and_modules_run_as_main() {
    let dir = tempfile::tempdir().expect("tempdir");
    let script = dir.path().join("report.py");
    std::fs::write(&script, "import sys\nprint(__name__, __file__ == sys.argv[0], sys.argv[1:])\n").expect("write");
    let job = Job::Python { source: PythonSource::File(script.clone()), args: vec!["x".into()] };
    let outcome = python_engine().execute(RunRequest::new(&job).limits(Limits::default()));
    assert_eq!(stdout(&outcome.expect("script")), "__main__ True ['x']\n");

    let job = Job::Python { source: PythonSource::Module("json.tool".into()), args: vec!["--sort-keys".into()] };
    let request = RunRequest::new(&job).limits(Limits::default()).stdin(br#"{"b": 1, "a": [1, 2]}"#.to_vec());
    let outcome = python_engine().execute(request).expect("module");
    assert_eq!(stdout(&outcome), "{\n    \"a\": [\n        1,\n        2\n    ],\n    \"b\": 1\n}\n");
}

#[test]
fn atexit_handlers_run_and_buffered_output_is_flushed() {
    let outcome = python(
        "import atexit, sys\natexit.register(lambda: print('bye'))\nsys.stdout.write('no newline')",
        &Capabilities::default(),
        &Limits::default(),
    );
    assert_eq!(stdout(&outcome), "no newlinebye\n");
}

/// As natively, a program's end drops `__main__`'s names: a file it left open is flushed to the host, and
/// `__del__` methods run (their output in the outcome).
#[test]
fn a_file_left_open_is_flushed_and_finalizers_run_at_exit() {
    let out = tempfile::tempdir().expect("tempdir");
    let caps = Capabilities {
        grants: vec![Grant::new(out.path(), "/out", GrantMode::Rw).expect("grant")],
        ..Capabilities::default()
    };
    let program = "f = open('/out/left-open.txt', 'w')\nf.write('written')\n\
                   class Noisy:\n    def __del__(self):\n        print('finalised')\nn = Noisy()\nprint('end')";
    let outcome = python(program, &caps, &Limits::default());
    assert_eq!(stdout(&outcome), "end\nfinalised\n");
    let written = std::fs::read_to_string(out.path().join("left-open.txt")).expect("the file");
    assert_eq!(written, "written");
}

#[test]
fn a_session_keeps_state_across_five_turns() {
    let sandbox = python_engine().start(TierChoice::Auto, &Capabilities::default(), &Limits::default()).expect("start");
    let turns = [
        ("import math\ntotal = 0", ""),
        ("total += 10", ""),
        ("def double(x):\n    return 2 * x", ""),
        ("total = double(total) + int(math.sqrt(16))", ""),
        ("total", "24\n"),
    ];
    for (source, expected) in turns {
        let outcome = sandbox.exec(&code(source), ExecOptions::default()).expect("turn");
        assert_eq!(outcome.status, Status::Exited { code: 0 }, "{source}: {}", stderr(&outcome));
        assert_eq!(stdout(&outcome), expected, "{source}");
    }
    // An exception ends the turn, not the session.
    let outcome = sandbox.exec(&code("undefined_name"), ExecOptions::default()).expect("turn");
    assert_eq!(outcome.status, Status::Exited { code: 1 });
    assert!(stderr(&outcome).contains("NameError"));
    let outcome = sandbox.exec(&code("print(total + 1)"), ExecOptions::default()).expect("turn");
    assert_eq!(stdout(&outcome), "25\n");
    sandbox.close().expect("close");
}

#[test]
fn a_limit_ends_the_session_with_a_typed_outcome() {
    let sandbox = python_engine().start(TierChoice::Auto, &Capabilities::default(), &Limits::default()).expect("start");
    sandbox.exec(&code("x = 1"), ExecOptions::default()).expect("turn");
    let opts = ExecOptions { limits: Some(limits("wall = \"300ms\"")), ..ExecOptions::default() };
    let outcome = sandbox.exec(&code("while True: pass"), opts).expect("turn");
    assert_eq!(outcome.status, Status::LimitExceeded { limit: LimitKind::Wall });
    let err = sandbox.exec(&code("x"), ExecOptions::default()).expect_err("ended");
    assert!(matches!(err, TierError::SessionEnded { .. }), "{err}");
    assert!(err.to_string().contains("wall limit exceeded"), "{err}");
}

#[test]
fn exit_in_a_session_ends_it() {
    let sandbox = python_engine().start(TierChoice::Auto, &Capabilities::default(), &Limits::default()).expect("start");
    let outcome = sandbox.exec(&code("exit(2)"), ExecOptions::default()).expect("turn");
    assert_eq!(outcome.status, Status::Exited { code: 2 });
    assert!(matches!(sandbox.exec(&code("1"), ExecOptions::default()), Err(TierError::SessionEnded { .. })));
}

#[test]
fn an_infinite_loop_hits_the_wall_limit() {
    let outcome = python("while True: pass", &Capabilities::default(), &limits("wall = \"500ms\""));
    assert_eq!(outcome.status, Status::LimitExceeded { limit: LimitKind::Wall });
}

#[test]
fn an_infinite_loop_runs_out_of_fuel() {
    let outcome = python("while True: pass", &Capabilities::default(), &limits("fuel = 200000000"));
    assert_eq!(outcome.status, Status::LimitExceeded { limit: LimitKind::Fuel });
    assert_eq!(outcome.usage.fuel, Some(200_000_000));
    let outcome = python("print(sum(range(1000)))", &Capabilities::default(), &limits("fuel = 1000000000"));
    assert_eq!(stdout(&outcome), "499500\n");
    assert!(outcome.usage.fuel.is_some_and(|f| f > 0 && f < 1_000_000_000), "{:?}", outcome.usage);
}

#[test]
fn a_gigabyte_bytearray_hits_the_memory_limit() {
    let outcome =
        python("b = bytearray(1 << 30)\nprint('allocated')", &Capabilities::default(), &limits("memory = \"256MiB\""));
    assert_eq!(outcome.status, Status::LimitExceeded { limit: LimitKind::Memory }, "{}", stderr(&outcome));
    assert!(!stdout(&outcome).contains("allocated"));
    assert!(outcome.usage.peak_memory <= 256 << 20);
}

#[test]
fn a_ten_megabyte_print_is_truncated_at_the_output_limit() {
    let outcome = python("print('x' * 10_000_000)", &Capabilities::default(), &limits("output = \"1MiB\""));
    assert_eq!(outcome.status, Status::Exited { code: 0 });
    assert!(outcome.truncated.stdout && !outcome.truncated.stderr);
    assert_eq!(outcome.stdout.len(), 1 << 20);
    assert_eq!(outcome.usage.stdout_bytes, 10_000_001);
}

#[test]
fn grants_are_readable_and_read_only_ones_refuse_writes() {
    let data = tempfile::tempdir().expect("tempdir");
    std::fs::write(data.path().join("input.csv"), "a,b\n1,2\n3,4\n").expect("write");
    let out = tempfile::tempdir().expect("tempdir");
    let caps = Capabilities {
        grants: vec![
            Grant::new(data.path(), "/data", GrantMode::Ro).expect("grant"),
            Grant::new(out.path(), "/out", GrantMode::Rw).expect("grant"),
        ],
        ..Capabilities::default()
    };
    let outcome = python(
        "import pandas as pd\n\
         df = pd.read_csv('/data/input.csv')\n\
         df.sum().to_csv('/out/sums.csv')\n\
         try:\n    open('/data/new.txt', 'w')\nexcept OSError as e:\n    print('ro refused:', type(e).__name__)\n\
         try:\n    open('/etc/passwd')\nexcept OSError as e:\n    print('outside refused:', type(e).__name__)",
        &caps,
        &Limits::default(),
    );
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{}", stderr(&outcome));
    assert_eq!(stdout(&outcome), "ro refused: PermissionError\noutside refused: FileNotFoundError\n");
    assert_eq!(std::fs::read_to_string(out.path().join("sums.csv")).expect("written"), ",0\na,4\nb,6\n");
    assert!(!data.path().join("new.txt").exists());
}

#[test]
fn the_scratch_tmp_is_private_and_removed_after_the_job() {
    let outcome = python(
        "import os\nopen('/tmp/scratch.txt', 'w').write('hi')\nprint(os.listdir('/tmp'), os.environ['TMPDIR'])",
        &Capabilities::default(),
        &Limits::default(),
    );
    assert_eq!(stdout(&outcome), "['scratch.txt'] /tmp\n");
    let outcome = python("import os\nprint(os.listdir('/tmp'))", &Capabilities::default(), &Limits::default());
    assert_eq!(stdout(&outcome), "[]\n", "each job gets a fresh /tmp");
}

/// Every socket call a job may make fails as documented, `OSError: [Errno 58] Not supported`: name lookups too
/// (the wasm build's `_socket` has no resolver, so they used to raise `AttributeError`).
const SOCKET_CALLS: &str = r#"import socket
for name, call in [
    ('connect', lambda: socket.socket().connect(('1.1.1.1', 80))),
    ('create_connection', lambda: socket.create_connection(('example.org', 80), timeout=5)),
    ('getaddrinfo', lambda: socket.getaddrinfo('localhost', 80)),
    ('gethostbyname', lambda: socket.gethostbyname('localhost')),
    ('getservbyname', lambda: socket.getservbyname('http')),
]:
    try:
        call()
        print(name, 'worked')
    except OSError as e:
        print(name, e)
"#;

fn socket_calls_expected() -> String {
    ["connect", "create_connection", "getaddrinfo", "gethostbyname", "getservbyname"]
        .iter()
        .map(|name| format!("{name} [Errno 58] Not supported\n"))
        .collect()
}

#[test]
fn sockets_and_subprocesses_fail_inside_the_guest() {
    let outcome = python(
        "import socket, subprocess\n\
         try:\n    socket.socket().connect(('1.1.1.1', 80))\nexcept OSError as e:\n    print('socket:', e)\n\
         try:\n    subprocess.run(['ls'])\nexcept OSError as e:\n    print('subprocess:', e)",
        &Capabilities::default(),
        &Limits::default(),
    );
    assert_eq!(
        stdout(&outcome),
        "socket: [Errno 58] Not supported\nsubprocess: [Errno 58] wasi does not support processes.\n"
    );
    let outcome = python(SOCKET_CALLS, &Capabilities::default(), &Limits::default());
    assert_eq!(stdout(&outcome), socket_calls_expected(), "{}", stderr(&outcome));
    // In a session too, with socket imported in an earlier turn or not.
    let session = python_engine()
        .start(TierChoice::Tier(TierKind::Wasm), &Capabilities::default(), &Limits::default())
        .expect("start");
    for _ in 0..2 {
        let outcome = session.exec(&code(SOCKET_CALLS), ExecOptions::default()).expect("turn");
        assert_eq!(stdout(&outcome), socket_calls_expected(), "{}", stderr(&outcome));
    }
    // And in a fork of it.
    let dir = tempfile::tempdir().expect("tempdir");
    session.snapshot(&dir.path().join("snap")).expect("snapshot");
    let snapshot = python_engine().snapshots().open_for(&dir.path().join("snap"), TierKind::Wasm).expect("open");
    let fork = python_engine().wasm().fork(&snapshot).expect("fork");
    let outcome = fork.exec(&code(SOCKET_CALLS), ExecOptions::default()).expect("turn");
    assert_eq!(stdout(&outcome), socket_calls_expected(), "{}", stderr(&outcome));
    fork.close().expect("close");
    session.close().expect("close");
}

#[test]
fn the_standard_library_cannot_be_shadowed_by_a_grant() {
    let dir = tempfile::tempdir().expect("tempdir");
    let caps = Capabilities {
        grants: vec![Grant::new(dir.path(), "/usr/local/lib", GrantMode::Ro).expect("grant")],
        ..Default::default()
    };
    let err = python_engine()
        .execute(RunRequest::new(&code("print(1)")).caps(&caps).limits(Limits::default()))
        .expect_err("reserved");
    assert!(matches!(err, EngineError::Tier(TierError::GuestPath { .. })), "{err}");
}

#[test]
fn tools_round_trip_and_failures_reach_the_guest() {
    let caps = Capabilities { tools: vec!["add".into(), "fail".into()], ..Capabilities::default() };
    let outcome = python(
        "from host import tools, ToolError, ToolArgumentError\n\
         print(tools.add(40), tools.add(a=1, b=1))\n\
         try:\n    tools.fail('no region')\nexcept ToolError as e:\n    print('failed:', e)\n\
         try:\n    tools.add('x')\nexcept ToolArgumentError as e:\n    print('refused:', e)",
        &caps,
        &Limits::default(),
    );
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{}", stderr(&outcome));
    assert_eq!(
        stdout(&outcome),
        "42 2\nfailed: cannot: no region\nrefused: add: argument a: expected integer, got string\n"
    );
    let record: Vec<(Option<&str>, Option<&str>, &str)> =
        outcome.tools.iter().map(|c| (c.op.as_deref(), c.tool.as_deref(), c.outcome.as_str())).collect();
    assert_eq!(
        record,
        [
            (Some("list"), None, "ok"),
            (Some("call"), Some("add"), "ok"),
            (Some("call"), Some("add"), "ok"),
            (Some("call"), Some("fail"), "tool_error"),
            (Some("call"), Some("add"), "invalid_arguments"),
        ]
    );
}

#[test]
fn a_job_without_tools_has_no_host() {
    let outcome = python("from host import tools", &Capabilities::default(), &Limits::default());
    assert_eq!(outcome.status, Status::Exited { code: 1 });
    assert!(stderr(&outcome).contains("ImportError: this run has no tools"), "{}", stderr(&outcome));
    assert!(outcome.tools.is_empty());
}

#[test]
fn matplotlib_renders_with_its_data_files() {
    let outcome = python(
        "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt, os\n\
         plt.plot([1, 2, 3], [4, 5, 6])\nplt.savefig('/tmp/p.png')\nprint(open('/tmp/p.png', 'rb').read(4))",
        &Capabilities::default(),
        &Limits::default(),
    );
    assert_eq!(stdout(&outcome), "b'\\x89PNG'\n", "{}", stderr(&outcome));
}

/// A one-shot job run in an instance primed ahead of it (`WasmTier::prestart_python`, what a warm daemon's Python
/// spare does) gives exactly the outcome it gives in an instance made for it: its own arguments, stdin, grants and
/// scratch `/tmp`, not the priming's; exceptions, exit codes, `atexit`, `-m` and scripts as usual; the
/// interpreter's own names in `__main__` as usual. A job with an environment of its own does not take the instance
/// (the interpreter read the priming's at its first turn), nor one whose memory limit is below what the instance
/// holds. Each case runs unprimed, then primed, in an engine of the test's own (a primed instance is left to its
/// process's exit after its job, one pool slot each).
#[test]
fn a_job_in_a_primed_instance_gives_the_outcome_of_a_fresh_one() {
    use strata_core::EnvVar;
    use strata_engine::{Engine, EngineConfig};

    let home = strata_engine::strata_home().expect("STRATA_HOME or HOME");
    let engine = Engine::new(EngineConfig { home: Some(home), ..EngineConfig::default() }).expect("engine");
    let data = tempfile::tempdir().expect("tempdir");
    std::fs::write(data.path().join("input.txt"), "granted\n").expect("write");
    let script = data.path().join("script.py");
    std::fs::write(&script, "import sys\nprint('script', __file__, sys.argv[1:])\n").expect("write");
    let caps = Capabilities {
        grants: vec![Grant::new(data.path(), "/data", GrantMode::Ro).expect("grant")],
        ..Capabilities::default()
    };
    let with_env =
        Capabilities { env: vec![EnvVar { name: "GREETING".into(), value: "hello".into() }], ..caps.clone() };
    let probe = "import os, sys\n\
                 print(os.environ.get('GREETING'), os.environ['HOME'], sorted(os.listdir('/data')))\n\
                 print(open('/data/input.txt').read().strip(), sys.argv, sys.stdin.read().strip(),\n\
                       os.listdir('/tmp'))\n\
                 open('/tmp/mine', 'w').write('x')\n\
                 print(sorted(n for n in dir() if n.startswith('__strata')))";
    let probe_job = Job::Python { source: PythonSource::Code(probe.into()), args: vec!["a".into(), "b c".into()] };
    let cases: Vec<(Job, Option<&[u8]>)> = vec![
        (probe_job.clone(), Some(b"in\n")),
        (code("print(1)"), None),
        (code("import sys\nprint('out')\nsys.exit(3)"), None),
        (code("def f():\n    raise ValueError('boom')\nf()"), None),
        (code("import atexit\natexit.register(lambda: print('bye'))\nprint(__name__)"), None),
        (Job::Python { source: PythonSource::Module("json.tool".into()), args: Vec::new() }, Some(b"{\"b\": [1, 2]}")),
        (Job::Python { source: PythonSource::File(script.clone()), args: vec!["x".into()] }, None),
    ];
    let run = |job: &Job, caps: &Capabilities, stdin: Option<&[u8]>| {
        let mut request =
            RunRequest::new(job).caps(caps).limits(Limits::default()).tier(TierChoice::Tier(TierKind::Wasm));
        if let Some(bytes) = stdin {
            request = request.stdin(bytes.to_vec());
        }
        engine.execute(request).expect("job")
    };
    let wasm = engine.wasm();
    for (index, (job, stdin)) in cases.iter().enumerate() {
        let fresh = run(job, &caps, *stdin);
        wasm.prestart_python(&Limits::default()).expect("prestart");
        assert!(wasm.python_primed());
        if index % 2 == 1 {
            // As a daemon's spare does: its memory made resident first.
            wasm.make_primed_python_resident();
        }
        let primed = run(job, &caps, *stdin);
        assert!(!wasm.python_primed(), "the job took the primed instance: {job:?}");
        assert_eq!(
            (&primed.status, stdout(&primed), stderr(&primed)),
            (&fresh.status, stdout(&fresh), stderr(&fresh)),
            "{job:?}"
        );
    }
    wasm.prestart_python(&Limits::default()).expect("prestart");
    let primed = run(&probe_job, &caps, Some(b"in\n"));
    assert_eq!(
        stdout(&primed),
        "None /tmp ['input.txt', 'script.py']\ngranted ['-c', 'a', 'b c'] in []\n['__strata_exit', '__strata_job']\n"
    );
    // Its own environment: not in the primed instance, which waits for the next job.
    wasm.prestart_python(&Limits::default()).expect("prestart");
    let own_env = run(&probe_job, &with_env, Some(b"in\n"));
    assert!(stdout(&own_env).starts_with("hello /tmp "), "{}", stdout(&own_env));
    assert!(wasm.python_primed());
    // A memory limit below what the primed instance holds: it is left unused, and the job meets the limit as
    // a fresh instance does.
    let small = limits("memory = \"16MiB\"");
    let outcome = engine
        .execute(RunRequest::new(&code("print(1)")).limits(small).tier(TierChoice::Tier(TierKind::Wasm)))
        .expect("job");
    assert_eq!(outcome.status, Status::LimitExceeded { limit: LimitKind::Memory });
    let after = run(&code("print(2)"), &caps, None);
    assert_eq!((&after.status, stdout(&after)), (&Status::Exited { code: 0 }, "2\n".to_owned()));
    assert!(!wasm.python_primed());
}
