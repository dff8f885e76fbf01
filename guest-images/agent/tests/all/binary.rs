//! The real `strata-agent` binary in host mode: it connects to a Unix socket and serves that connection.
//! `STRATA_AGENT_BIN` runs these tests against another build (the static musl one).

use std::os::unix::net::UnixListener;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use strata_guest_proto::{AgentClient, ClientConfig, ClientError, ExitStatus};

use crate::{argv, run, sh};

struct Spawned {
    child: Child,
    client: Option<AgentClient>,
    _dir: tempfile::TempDir,
}

fn binary() -> std::ffi::OsString {
    std::env::var_os("STRATA_AGENT_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_strata-agent").into())
}

fn spawn(extra: &[&str]) -> Spawned {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("agent.sock");
    let listener = UnixListener::bind(&path).expect("bind");
    let child = Command::new(binary()).arg("--unix").arg(&path).args(extra).spawn().expect("spawn strata-agent");
    let (stream, _) = listener.accept().expect("accept");
    let client = AgentClient::connect(stream, ClientConfig::default()).expect("connect");
    Spawned { child, client: Some(client), _dir: dir }
}

impl Spawned {
    fn client(&self) -> &AgentClient {
        self.client.as_ref().expect("client")
    }

    fn power_off(mut self) -> std::process::ExitStatus {
        self.client.take().expect("client").power_off().expect("power off");
        self.child.wait().expect("wait")
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        drop(self.client.take());
        let _ = self.child.wait();
    }
}

/// Processes whose parent is `pid`: (pid, command, state).
fn children_of(pid: u32) -> Vec<(u32, String, char)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        // pid (comm) state ppid ...
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { continue };
        let fields: Vec<&str> = stat[close + 2..].split(' ').collect();
        let (Some(state), Some(ppid)) = (fields.first(), fields.get(1)) else { continue };
        if ppid.parse::<u32>().ok() == Some(pid) {
            let child = stat[..open].trim().parse().unwrap_or(0);
            found.push((child, stat[open + 1..close].to_owned(), state.chars().next().unwrap_or('?')));
        }
    }
    found
}

#[test]
fn the_binary_serves_a_unix_socket_and_exits_on_power_off() {
    let agent = spawn(&[]);
    let ran = run(agent.client(), &sh("echo from the binary; exit 4"), b"");
    assert_eq!(ran.stdout, b"from the binary\n");
    assert_eq!(ran.report.status, ExitStatus::Code(4));
    let err = agent.client().start(&argv(&["no-such-program-strata"])).expect_err("missing");
    assert!(matches!(err, ClientError::ExecFailed { errno: libc::ENOENT, .. }), "{err}");
    assert!(agent.power_off().success());
}

#[test]
fn reaping_everything_reaps_orphans_and_still_reports_each_exec() {
    let agent = spawn(&["--reap-all"]);
    let pid = agent.child.id();
    // The shell exits at once; its background sleep is reparented to the agent (a child subreaper).
    let ran = run(agent.client(), &sh("sleep 0.3 & exit 0"), b"");
    assert_eq!(ran.report.status, ExitStatus::Code(0));
    // The orphan may still be the forked shell that has not exec'd `sleep` yet: wait for it to become one.
    let deadline = Instant::now() + Duration::from_secs(2);
    while !children_of(pid).iter().any(|(_, command, _)| command == "sleep") {
        assert!(Instant::now() < deadline, "the orphan was not reparented: {:?}", children_of(pid));
        std::thread::sleep(Duration::from_millis(5));
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while !children_of(pid).is_empty() {
        assert!(Instant::now() < deadline, "left behind: {:?}", children_of(pid));
        std::thread::sleep(Duration::from_millis(20));
    }
    // Exits, failures to start and concurrent execs all go through the one reaper.
    let plain = agent._dir.path().join("plain");
    std::fs::write(&plain, "#!/bin/sh\n").expect("write");
    let err = agent.client().start(&argv(&[plain.to_str().expect("utf-8")])).expect_err("not executable");
    assert!(matches!(err, ClientError::ExecFailed { errno: libc::EACCES, .. }), "{err}");
    let client = agent.client();
    std::thread::scope(|scope| {
        let runs: Vec<_> = (0..8).map(|i| scope.spawn(move || run(client, &sh(&format!("exit {i}")), b""))).collect();
        for (i, handle) in runs.into_iter().enumerate() {
            assert_eq!(handle.join().expect("thread").report.status, ExitStatus::Code(i as i32));
        }
    });
    let handle = agent.client().start(&argv(&["sleep", "100"])).expect("start");
    handle.control().signal(libc::SIGKILL).expect("kill");
    assert_eq!(handle.wait(|_, _| {}).expect("wait").status, ExitStatus::Signal(libc::SIGKILL));
    assert!(children_of(pid).is_empty(), "{:?}", children_of(pid));
    assert!(agent.power_off().success());
}

#[test]
fn bad_arguments_are_a_usage_error() {
    let status = Command::new(binary()).arg("--bogus").stderr(std::process::Stdio::null()).status().expect("run");
    assert_eq!(status.code(), Some(2));
}
