//! `strata daemon`: a `strata run` handed to the warm daemon answers exactly as one run without it (output, exit
//! status, stdin, files of its working directory, `--json`), a client the daemon should not serve runs the
//! command itself, signals reach the job and a client's death ends it, and the daemon is private and leaves
//! nothing behind.
//!
//! Each test runs its own daemon on a socket of its own (`STRATA_DAEMON`), with one fixed environment for every
//! process it starts (the daemon serves only clients of its own environment), on the shared `$STRATA_HOME`
//! where the Python runtime is compiled.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use strata_test_programs as programs;

fn shared_home() -> PathBuf {
    std::env::var_os("STRATA_HOME")
        .map(Into::into)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/strata"))
}

/// A daemon of this test's own, stopped (and waited for) when dropped.
struct Daemon {
    dir: tempfile::TempDir,
    env: Vec<(String, String)>,
}

impl Daemon {
    fn start(idle: &str) -> Daemon {
        let dir = tempfile::tempdir().expect("tempdir");
        let tmp = dir.path().join("tmp");
        std::fs::create_dir(&tmp).expect("tmp");
        let env = vec![
            // The jobs' scratch directories go here, where a test can see that none is left behind.
            ("TMPDIR".to_owned(), tmp.display().to_string()),
            ("PATH".to_owned(), std::env::var("PATH").unwrap_or_default()),
            ("HOME".to_owned(), std::env::var("HOME").unwrap_or_default()),
            ("STRATA_HOME".to_owned(), shared_home().display().to_string()),
            ("STRATA_DAEMON".to_owned(), dir.path().join("run/warm.sock").display().to_string()),
        ];
        let daemon = Daemon { dir, env };
        let out = daemon.command(&["daemon", "start", "--idle", idle]).output().expect("daemon start");
        assert!(out.status.success(), "daemon start: {}", String::from_utf8_lossy(&out.stderr));
        daemon
    }

    /// What the jobs left in the temporary directory.
    fn leftovers(&self) -> Vec<String> {
        std::fs::read_dir(self.dir.path().join("tmp"))
            .expect("tmp")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect()
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("run/warm.sock")
    }

    /// `strata ARGS` with exactly the daemon's environment.
    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(env!("CARGO_BIN_EXE_strata"));
        command.env_clear().envs(self.env.iter().map(|(k, v)| (k, v))).args(args);
        command
    }

    fn status(&self) -> serde_json::Value {
        let out = self.command(&["daemon", "status", "--json"]).output().expect("daemon status");
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("status JSON ({e}): {:?}", out))
    }

    fn served(&self) -> u64 {
        self.status()["served"].as_u64().unwrap_or(0)
    }

    /// Waits until the daemon reports no running job.
    fn idle(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.status()["running"].as_u64() != Some(0) {
            assert!(Instant::now() < deadline, "a job still runs: {}", self.status());
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Daemon {
    /// Stops the daemon; one still alive after 10 s (a failed test left a job running) is killed. Never panics.
    fn drop(&mut self) {
        let Some(pid) = self.status()["pid"].as_i64() else { return };
        let _ = self.command(&["daemon", "stop"]).output();
        let deadline = Instant::now() + Duration::from_secs(10);
        while alive(pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        if alive(pid) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL);
        }
    }
}

fn alive(pid: i64) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains(") Z "))
}

fn wait_gone(pid: i64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while alive(pid) {
        assert!(Instant::now() < deadline, "process {pid} is still alive");
        std::thread::sleep(Duration::from_millis(20));
    }
}

struct Ran {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

fn run(mut command: Command, cwd: &Path, stdin: &[u8]) -> Ran {
    let mut child = command
        .current_dir(cwd)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn strata");
    child.stdin.take().expect("stdin").write_all(stdin).expect("write stdin");
    let out = child.wait_with_output().expect("wait");
    Ran {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// The outcome's fields that do not measure time or memory.
fn stable(json: &str) -> serde_json::Value {
    let value: serde_json::Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("JSON ({e}): {json}"));
    let mut out = serde_json::Map::new();
    for key in ["status", "tier", "stdout", "stderr", "exit_code", "error"] {
        if let Some(v) = value.get(key) {
            out.insert(key.into(), v.clone());
        }
    }
    out.into()
}

#[test]
fn a_run_through_the_daemon_answers_as_a_run_without_it() {
    let daemon = Daemon::start("5m");
    let cwd = tempfile::tempdir().expect("tempdir");
    std::fs::write(cwd.path().join("input.txt"), "from the working directory\n").expect("write");
    let cases: Vec<(Vec<&str>, &[u8])> = vec![
        (vec!["run", "--python", "-c", "print(1)"], b""),
        (vec!["run", "--python", "-c", "import sys; print(input()[::-1]); sys.exit(3)"], b"olleh\n"),
        (vec!["run", "--python", "-c", "import sys; print('to stderr', file=sys.stderr); 1/0"], b""),
        (vec!["run", "--dir", ".:/work", "--python", "-c", "print(open('/work/input.txt').read(), end='')"], b""),
        (vec!["run", "--python", "-c", "import numpy as np; print(np.arange(10**6).sum())"], b""),
        // An environment of its own: not the daemon's primed interpreter (whose environment is the default).
        (vec!["run", "--env", "GREETING=hi", "--python", "-c", "import os; print(os.environ['GREETING'])"], b""),
        (vec!["run", "-m", "json.tool"], b"{\"b\": [1, 2]}"),
        (vec!["run", programs::HELLO, "--", "daemon"], b""),
        (vec!["run", "--timeout", "200ms", programs::SPIN], b""),
        (vec!["run", "--python"], b""),
        (vec!["run", "--memory", "lots", "--python", "-c", "1"], b""),
    ];
    for (args, stdin) in &cases {
        let before = daemon.served();
        let warm = run(daemon.command(args), cwd.path(), stdin);
        assert_eq!(daemon.served(), before + 1, "{args:?} went through the daemon");
        let mut cold = daemon.command(args);
        cold.env("STRATA_DAEMON", "off");
        let cold = run(cold, cwd.path(), stdin);
        assert_eq!(
            (warm.code, &warm.stdout, &warm.stderr),
            (cold.code, &cold.stdout, &cold.stderr),
            "{args:?}: through the daemon, then without it"
        );
    }
    let json = ["run", "--json", "--python", "-c", "import sys; print('out'); sys.exit(4)"];
    let warm = run(daemon.command(&json), cwd.path(), b"");
    let mut cold = daemon.command(&json);
    cold.env("STRATA_DAEMON", "off");
    let cold = run(cold, cwd.path(), b"");
    assert_eq!((warm.code, stable(&warm.stdout)), (cold.code, stable(&cold.stdout)));
    assert_eq!(warm.code, Some(4));
    // A grant of `.` is the client's working directory, not the daemon's.
    let mut umask =
        daemon.command(&["run", "--dir", ".:/work:rw", "--python", "-c", "open('/work/made.txt', 'w').write('x')"]);
    umask.current_dir(cwd.path());
    let out = umask.output().expect("run");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(cwd.path().join("made.txt").exists(), "the job wrote into the client's working directory");
}

#[test]
fn without_the_daemon_a_signal_cancels_the_job_cleanly_too() {
    let daemon = Daemon::start("5m");
    let client = sleeper(&daemon, false);
    signal_and_wait(client, nix::sys::signal::Signal::SIGTERM);
    assert_eq!(daemon.leftovers(), Vec::<String>::new(), "the cancelled job removed its scratch directory");
    assert_eq!(daemon.served(), 0);
}

#[test]
fn the_process_tier_runs_through_the_daemon_too() {
    let daemon = Daemon::start("5m");
    let cwd = tempfile::tempdir().expect("tempdir");
    let probe = run(daemon.command(&["run", "--json", "--tier", "process", "--", "true"]), cwd.path(), b"");
    if probe.code != Some(0) {
        eprintln!("skip: the process tier cannot run on this host: {}", probe.stdout.trim());
        return;
    }
    let before = daemon.served();
    let warm = run(daemon.command(&["run", "--tier", "process", "--", "sh", "-c", "echo hi; exit 5"]), cwd.path(), b"");
    assert_eq!((warm.code, warm.stdout.as_str()), (Some(5), "hi\n"), "{}", warm.stderr);
    assert_eq!(daemon.served(), before + 1);
}

#[test]
fn a_client_the_daemon_should_not_serve_runs_the_command_itself() {
    let daemon = Daemon::start("5m");
    let cwd = tempfile::tempdir().expect("tempdir");
    let before = daemon.served();
    let mut other = daemon.command(&["run", "--python", "-c", "print(2)"]);
    other.env("SOME_SETTING", "1");
    let ran = run(other, cwd.path(), b"");
    assert_eq!((ran.code, ran.stdout.as_str()), (Some(0), "2\n"), "{}", ran.stderr);
    let status = daemon.status();
    assert_eq!(status["served"].as_u64(), Some(before), "{status}");
    assert_eq!(status["refused"].as_u64(), Some(1), "{status}");
    assert_eq!(status["last_refusal"], "another environment (differs in SOME_SETTING)", "{status}");
    // One confined more tightly than the daemon would escape its confinement through it: refused too.
    let confined: [(&[&str], &str); 3] = [
        (&["prlimit", "--nofile=512:512", "--"], "resource limits"),
        (&["setpriv", "--no-new-privs", "--"], "NoNewPrivs"),
        (&["unshare", "--mount", "--"], "mnt namespace"),
    ];
    let mut refused = 1;
    for (wrapper, what) in confined {
        let runs = Command::new(wrapper[0]).args(&wrapper[1..]).arg("true").status().is_ok_and(|s| s.success());
        if !runs {
            eprintln!("skip: {} cannot run here", wrapper.join(" "));
            continue;
        }
        let mut command = Command::new(wrapper[0]);
        command
            .env_clear()
            .envs(daemon.env.iter().map(|(k, v)| (k, v)))
            .args(&wrapper[1..])
            .arg(env!("CARGO_BIN_EXE_strata"))
            .args(["run", "--python", "-c", "print(4)"]);
        let ran = run(command, cwd.path(), b"");
        assert_eq!((ran.code, ran.stdout.as_str()), (Some(0), "4\n"), "{wrapper:?}: {}", ran.stderr);
        refused += 1;
        let status = daemon.status();
        assert_eq!(status["refused"].as_u64(), Some(refused), "{wrapper:?}: {status}");
        assert_eq!(status["last_refusal"], format!("a client confined otherwise ({what})"), "{status}");
    }
    assert_eq!(daemon.served(), before);
    // And one that asks for no daemon never talks to it.
    let mut off = daemon.command(&["run", "--python", "-c", "print(3)"]);
    off.env("STRATA_DAEMON", "off");
    assert_eq!(run(off, cwd.path(), b"").stdout, "3\n");
    assert_eq!(daemon.status()["refused"].as_u64(), Some(refused));
}

/// Whether this process ignores signal `number` (its children inherit that).
fn ignored(number: u32) -> bool {
    let status = std::fs::read_to_string("/proc/self/status").expect("status");
    let mask = status.lines().find_map(|l| l.strip_prefix("SigIgn:")).map(str::trim).unwrap_or("0");
    u64::from_str_radix(mask, 16).is_ok_and(|mask| mask & (1 << (number - 1)) != 0)
}

/// Sends `signal` to `client` and checks it ended as its job did: by that signal, or, where this process ignores
/// it (started in the background of a non-interactive shell, which ignores SIGINT), with 128 + its number as a
/// shell reports it (the job still gets it and ends).
fn signal_and_wait(mut client: Child, signal: nix::sys::signal::Signal) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(client.id() as i32), signal).expect("signal the client");
    let status = client.wait().expect("wait");
    let number = signal as i32;
    if ignored(number as u32) {
        assert_eq!(status.code(), Some(128 + number), "strata reports its job's {signal} ({status:?})");
    } else {
        assert_eq!(status.signal(), Some(number), "strata ends as its job did: by {signal} ({status:?})");
    }
}

/// Starts a job that prints `ready` and sleeps, and returns its client once `ready` arrived (on the wasm tier
/// named, since `auto` holds a Python job's output back until it knows the job will not escalate);
/// `through_daemon`: whether the client may hand it to the daemon.
fn sleeper(daemon: &Daemon, through_daemon: bool) -> Child {
    let code = "import time; print('ready', flush=True); time.sleep(50)";
    let mut command = daemon.command(&["run", "--tier", "wasm", "--timeout", "60s", "--python", "-c", code]);
    if !through_daemon {
        command.env("STRATA_DAEMON", "off");
    }
    let mut child = command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::null()).spawn().expect("spawn");
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().expect("stdout")).read_line(&mut line).expect("read");
    assert_eq!(line, "ready\n");
    child
}

#[test]
fn a_signal_reaches_the_job_and_a_client_that_dies_takes_its_job_along() {
    let daemon = Daemon::start("5m");
    let client = sleeper(&daemon, true);
    assert_eq!(daemon.status()["running"].as_u64(), Some(1));
    signal_and_wait(client, nix::sys::signal::Signal::SIGINT);
    daemon.idle();
    assert_eq!(daemon.leftovers(), Vec::<String>::new(), "the cancelled job removed its scratch directory");

    let mut client = sleeper(&daemon, true);
    client.kill().expect("SIGKILL the client");
    let _ = client.wait();
    daemon.idle();
}

#[test]
fn the_daemon_is_private_stops_when_asked_or_idle_and_leaves_nothing() {
    let daemon = Daemon::start("5m");
    let socket = daemon.socket();
    let dir_mode = std::fs::metadata(socket.parent().expect("dir")).expect("dir").permissions().mode() & 0o777;
    let socket_mode = std::fs::metadata(&socket).expect("socket").permissions().mode() & 0o777;
    assert_eq!((dir_mode, socket_mode), (0o700, 0o600));
    let pid = daemon.status()["pid"].as_i64().expect("pid");
    let threads = std::fs::read_dir(format!("/proc/{pid}/task")).expect("tasks").count();
    assert_eq!(threads, 1, "the daemon forks, so it keeps one thread");
    // A second start finds it and starts nothing.
    let again = daemon.command(&["daemon", "start"]).output().expect("start");
    assert!(String::from_utf8_lossy(&again.stderr).contains("already answers"), "{again:?}");
    let out = daemon.command(&["daemon", "stop"]).output().expect("stop");
    assert!(out.status.success());
    wait_gone(pid);
    assert!(!socket.exists(), "the socket file is removed");
    let status = daemon.command(&["daemon", "status"]).output().expect("status");
    assert_eq!(status.status.code(), Some(1), "no daemon: status 1");

    let idle = Daemon::start("1s");
    let pid = idle.status()["pid"].as_i64().expect("pid");
    wait_gone(pid);
    assert!(!idle.socket().exists(), "an idle daemon removes its socket");
}

/// The PIDs of `pid`'s descendants (children, their children, …).
fn descendants(pid: i64) -> Vec<i64> {
    let mut parents: Vec<(i64, i64)> = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(child) = entry.file_name().to_str().and_then(|n| n.parse::<i64>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else { continue };
        // The fields after the command name, which may hold spaces: state, then the parent's PID.
        let Some(ppid) = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)) else { continue };
        if let Ok(ppid) = ppid.parse::<i64>() {
            parents.push((child, ppid));
        }
    }
    let mut found = vec![pid];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(parents.iter().filter(|(_, p)| *p == parent).map(|(c, _)| *c));
        i += 1;
    }
    found.remove(0);
    found
}

#[test]
fn spare_children_prepare_the_default_jail_and_a_run_of_another_jail_builds_its_own() {
    let daemon = Daemon::start("5m");
    let cwd = tempfile::tempdir().expect("tempdir");
    let mut cold = daemon.command(&["run", "--json", "--tier", "process", "--", "true"]);
    cold.env("STRATA_DAEMON", "off");
    let probe = run(cold, cwd.path(), b"");
    if probe.code != Some(0) {
        eprintln!("skip: the process tier cannot run on this host: {}", probe.stdout.trim());
        return;
    }
    let pid = daemon.status()["pid"].as_i64().expect("pid");
    let ready = |daemon: &Daemon| {
        let deadline = Instant::now() + Duration::from_secs(60);
        // Two of each kind: jails, and Python instances.
        while daemon.status()["spares"].as_u64() != Some(4) {
            assert!(Instant::now() < deadline, "the daemon keeps four spares: {}", daemon.status());
            std::thread::sleep(Duration::from_millis(50));
        }
        // Each spare has built its jail once a jail process runs beside it.
        while descendants(pid).iter().filter(|p| jail_process(**p)).count() < 2 {
            assert!(Instant::now() < deadline, "each spare prepares a jail: {:?}", descendants(pid));
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    ready(&daemon);

    // A default run takes a spare's jail and answers as a run without the daemon.
    let before = daemon.served();
    let warm = run(daemon.command(&["run", "--tier", "process", "--", "sh", "-c", "echo hi; exit 5"]), cwd.path(), b"");
    assert_eq!((warm.code, warm.stdout.as_str()), (Some(5), "hi\n"), "{}", warm.stderr);
    // One whose jail differs (a 1 MiB writable layer) builds its own: the spare's (1 GiB) would let this write.
    let fill = "head -c 4000000 /dev/zero > /tmp/fill && echo wrote";
    let small =
        run(daemon.command(&["run", "--tier", "process", "--disk", "1MiB", "--", "sh", "-c", fill]), cwd.path(), b"");
    assert_ne!(small.code, Some(0), "a 1 MiB layer cannot hold 4 MB: {} {}", small.stdout, small.stderr);
    assert!(!small.stdout.contains("wrote"), "{}", small.stdout);
    let big = run(daemon.command(&["run", "--tier", "process", "--", "sh", "-c", fill]), cwd.path(), b"");
    assert_eq!((big.code, big.stdout.as_str()), (Some(0), "wrote\n"), "{}", big.stderr);
    assert_eq!(daemon.served(), before + 3, "all three ran through the daemon");

    // Stopping the daemon ends its spares and their jails, and their cgroups go with them.
    daemon.idle();
    ready(&daemon);
    let left = descendants(pid);
    let out = daemon.command(&["daemon", "stop"]).output().expect("stop");
    assert!(out.status.success());
    wait_gone(pid);
    for child in &left {
        wait_gone(*child);
    }
    let owners: Vec<String> = left.iter().map(|p| format!("{p}-")).collect();
    let cgroups: Vec<String> = std::fs::read_dir("/sys/fs/cgroup/pids/strata")
        .map(|dir| dir.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    let leaked: Vec<&String> = cgroups.iter().filter(|name| owners.iter().any(|o| name.starts_with(o))).collect();
    assert!(leaked.is_empty(), "cgroups of the spares are removed: {leaked:?}");
}

/// Whether `pid` runs the embedded `strata-jail` (from its sealed memfd).
fn jail_process(pid: i64) -> bool {
    std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|exe| exe.to_string_lossy().contains("strata-jail"))
}
