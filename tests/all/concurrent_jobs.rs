//! Jobs at the same time in one process-tier sandbox (`Sandbox` calls from several threads): they run beside
//! each other and beside file calls, share its filesystem and loopback, and each is metered, limited and stopped
//! on its own (its own cgroup inside the sandbox's).

use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_core::{
    CancelToken, Capabilities, ExecOptions, Job, LimitKind, Limits, Outcome, PythonSource, Sandbox, Status, TierError,
    TierKind,
};
use strata_engine::TierChoice;

use crate::util::{limits, python_engine};

fn python(code: &str) -> Job {
    Job::Python { source: PythonSource::Code(code.into()), args: Vec::new() }
}

fn sh(script: &str) -> Job {
    Job::Command { argv: vec!["sh".into(), "-c".into(), script.into()] }
}

/// A process sandbox shared by the test's threads, or `None` (after a skip line) where the process tier cannot run.
fn sandbox(limits: &Limits) -> Option<Arc<dyn Sandbox>> {
    let engine = python_engine();
    if let Err(err) = engine.process() {
        eprintln!("skip: the process tier cannot run on this host: {err}");
        return None;
    }
    let sandbox = engine.start(TierChoice::Tier(TierKind::Process), &Capabilities::default(), limits).expect("sandbox");
    Some(Arc::from(sandbox))
}

fn ok(outcome: &Outcome) -> String {
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{outcome:?}");
    String::from_utf8_lossy(&outcome.stdout).into_owned()
}

/// The command lines of the sandbox's processes whose command line contains `needle`, seen from inside it.
fn processes(sandbox: &dyn Sandbox, needle: &str) -> String {
    let code = format!(
        "import os\nfor p in os.listdir('/proc'):\n    if p.isdigit():\n        try:\n            c = open(f'/proc/{{p}}/cmdline','rb').read().replace(b'\\0', b' ').decode()\n        except OSError:\n            continue\n        if {needle:?} in c and 'listdir' not in c:\n            print(c.strip())\n"
    );
    ok(&sandbox.exec(&python(&code), ExecOptions::default()).expect("ps"))
}

#[test]
fn a_server_job_and_a_client_job_run_at_once_and_talk_over_the_sandboxs_loopback() {
    let Some(sandbox) = sandbox(&Limits::default()) else { return };
    let server = python(
        "import socket\ns = socket.socket()\ns.bind(('127.0.0.1', 8123))\ns.listen()\nopen('/tmp/up', 'w').close()\n\
         c, _ = s.accept()\nc.sendall(b'hello ' + c.recv(64))\nc.close()\nprint('served')\n",
    );
    let client = python(
        "import os, socket, time\nwhile not os.path.exists('/tmp/up'):\n    time.sleep(0.01)\n\
         s = socket.create_connection(('127.0.0.1', 8123))\ns.sendall(b'client')\nprint(s.recv(64).decode())\n",
    );
    std::thread::scope(|scope| {
        let serving = scope.spawn(|| sandbox.exec(&server, ExecOptions::default()));
        // File calls and other jobs go on meanwhile: a file written here is read by the next job.
        sandbox.write_file("/tmp/note", b"from the host").expect("write beside the server");
        let echoed = sandbox.exec(&sh("cat /tmp/note"), ExecOptions::default()).expect("exec beside the server");
        assert_eq!(ok(&echoed), "from the host");
        let answer = sandbox.exec(&client, ExecOptions::default()).expect("client");
        assert_eq!(ok(&answer), "hello client\n");
        assert_eq!(ok(&serving.join().expect("server thread").expect("server")), "served\n");
    });
    sandbox.close().expect("close");
    // A closed sandbox refuses, with a typed error.
    let err = sandbox.exec(&sh("true"), ExecOptions::default()).expect_err("closed");
    assert!(matches!(err, TierError::SessionEnded { .. }), "{err:?}");
}

#[test]
fn each_job_is_metered_and_limited_on_its_own() {
    let Some(sandbox) = sandbox(&Limits::default()) else { return };
    // A fixed amount of CPU, however busy the host is.
    let burn = python("import time\nwhile time.process_time() < 1.0:\n    pass\n");
    let tight = limits("cpu = \"300ms\"\nmemory = \"64MiB\"");
    std::thread::scope(|scope| {
        let burning = scope.spawn(|| sandbox.exec(&burn, ExecOptions::default()));
        std::thread::sleep(Duration::from_millis(200));
        // A sleeper beside the burner: its CPU time is its own, not the sandbox's.
        let sleeper = sandbox.exec(&sh("sleep 0.5"), ExecOptions::default()).expect("sleeper");
        ok(&sleeper);
        assert!(sleeper.usage.cpu < Duration::from_millis(150), "{:?}", sleeper.usage);
        // Its own limits trip on its own use, and only it stops.
        let opts = || ExecOptions { limits: Some(tight.clone()), ..ExecOptions::default() };
        let spinning = sandbox.exec(&python("while True:\n    pass\n"), opts()).expect("cpu hog");
        assert_eq!(spinning.status, Status::LimitExceeded { limit: LimitKind::Cpu }, "{spinning:?}");
        let hungry = sandbox.exec(&python("x = bytearray(300 << 20)\nprint(len(x))"), opts()).expect("memory hog");
        assert_eq!(hungry.status, Status::LimitExceeded { limit: LimitKind::Memory }, "{hungry:?}");
        let burnt = burning.join().expect("burner thread").expect("burner");
        ok(&burnt);
        assert!(burnt.usage.cpu >= Duration::from_millis(900), "{:?}", burnt.usage);
    });
    sandbox.close().expect("close");
}

#[test]
fn stopping_a_job_kills_everything_it_started_and_nothing_else() {
    let Some(sandbox) = sandbox(&Limits::default()) else { return };
    let cancel = CancelToken::new();
    std::thread::scope(|scope| {
        let bystander = scope.spawn(|| sandbox.exec(&sh("sleep 2; echo still here"), ExecOptions::default()));
        let stopped = scope.spawn(|| {
            // Children that leave its process group and its session are its own all the same.
            let script = "sleep 1001 & setsid sleep 1002 & (sleep 1003 &) ; echo started; wait";
            let opts = ExecOptions { cancel: Some(cancel.clone()), ..ExecOptions::default() };
            sandbox.exec(&sh(script), opts)
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        while processes(sandbox.as_ref(), "sleep 100").lines().count() < 3 {
            assert!(Instant::now() < deadline, "the job's sleeps never started");
            std::thread::sleep(Duration::from_millis(20));
        }
        cancel.cancel();
        let err = stopped.join().expect("job thread").expect_err("cancelled");
        assert!(matches!(err, TierError::Cancelled), "{err:?}");
        assert_eq!(processes(sandbox.as_ref(), "sleep 100"), "", "a process of the stopped job survived");
        assert_eq!(ok(&bystander.join().expect("bystander thread").expect("bystander")), "still here\n");
    });
    sandbox.close().expect("close");
}

#[test]
fn a_jobs_background_processes_outlive_it_until_the_sandbox_closes() {
    let Some(sandbox) = sandbox(&Limits::default()) else { return };
    let started = sandbox.exec(&sh("sleep 1234 > /dev/null 2>&1 & echo started"), ExecOptions::default());
    assert_eq!(ok(&started.expect("job")), "started\n");
    assert_eq!(processes(sandbox.as_ref(), "sleep 1234"), "sleep 1234\n");
    // Later jobs still run (the lingering job's cgroup is kept, and removed once it empties).
    for _ in 0..3 {
        assert_eq!(ok(&sandbox.exec(&sh("echo again"), ExecOptions::default()).expect("job")), "again\n");
    }
    sandbox.close().expect("close");
}

#[test]
fn many_jobs_at_once_each_get_their_own_result() {
    let Some(sandbox) = sandbox(&Limits::default()) else { return };
    let results: Vec<String> = std::thread::scope(|scope| {
        let jobs: Vec<_> = (0..16)
            .map(|i| {
                let sandbox = sandbox.clone();
                scope.spawn(move || {
                    let script = format!("sleep 0.{}; echo job {i}; echo err {i} >&2; exit {}", i % 3, i % 4);
                    sandbox.exec(&sh(&script), ExecOptions::default()).expect("job")
                })
            })
            .collect();
        jobs.into_iter()
            .enumerate()
            .map(|(i, job)| {
                let outcome = job.join().expect("job thread");
                assert_eq!(outcome.status, Status::Exited { code: (i % 4) as i32 }, "{outcome:?}");
                assert_eq!(String::from_utf8_lossy(&outcome.stderr), format!("err {i}\n"));
                String::from_utf8_lossy(&outcome.stdout).into_owned()
            })
            .collect()
    });
    for (i, stdout) in results.iter().enumerate() {
        assert_eq!(stdout, &format!("job {i}\n"));
    }
    sandbox.close().expect("close");
}

#[test]
fn a_limit_on_one_job_leaves_the_others_running() {
    let Some(sandbox) = sandbox(&Limits::default()) else { return };
    std::thread::scope(|scope| {
        let bystander = scope.spawn(|| sandbox.exec(&sh("sleep 1.5; echo still here"), ExecOptions::default()));
        std::thread::sleep(Duration::from_millis(300));
        let opts = ExecOptions { limits: Some(limits("wall = \"300ms\"")), ..ExecOptions::default() };
        let stopped = sandbox.exec(&sh("sleep 30 & sleep 31"), opts).expect("exec");
        assert_eq!(stopped.status, Status::LimitExceeded { limit: LimitKind::Wall }, "{stopped:?}");
        assert_eq!(processes(sandbox.as_ref(), "sleep 3"), "", "the stopped job's processes survived");
        assert_eq!(ok(&bystander.join().expect("bystander thread").expect("bystander")), "still here\n");
    });
    sandbox.close().expect("close");
}

#[test]
fn a_job_alone_in_a_sandbox_is_metered_and_limited_on_its_own_too() {
    let Some(sandbox) = sandbox(&Limits::default()) else { return };
    // A job that leaves a process burning CPU behind it, then jobs one at a time: what it left is never theirs.
    let started = sandbox.exec(&sh("(while :; do :; done) > /dev/null 2>&1 & echo started"), ExecOptions::default());
    assert_eq!(ok(&started.expect("job")), "started\n");
    let sleeper = sandbox.exec(&sh("sleep 0.5"), ExecOptions::default()).expect("sleeper");
    ok(&sleeper);
    assert!(sleeper.usage.cpu < Duration::from_millis(150), "the burner's CPU counted: {:?}", sleeper.usage);
    let tight = limits("cpu = \"300ms\"\nmemory = \"64MiB\"");
    let opts = || ExecOptions { limits: Some(tight.clone()), ..ExecOptions::default() };
    let quiet = sandbox.exec(&sh("sleep 0.6; echo quiet"), opts()).expect("quiet");
    assert_eq!(ok(&quiet), "quiet\n", "a job under a tight CPU limit was stopped for another's CPU");
    // A job's own memory limit holds when it runs alone, as beside others.
    let hungry = sandbox.exec(&python("x = bytearray(300 << 20)\nprint(len(x))"), opts()).expect("memory hog");
    assert_eq!(hungry.status, Status::LimitExceeded { limit: LimitKind::Memory }, "{hungry:?}");
    assert_eq!(ok(&sandbox.exec(&sh("echo after"), ExecOptions::default()).expect("job")), "after\n");
    sandbox.close().expect("close");
}
