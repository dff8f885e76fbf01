//! Tiny hand-made guests through the jailed monitor process: what the guest does, what the jail looks like from
//! the host, what a call outside a thread's filter does, and what is left afterwards.
//!
//! Without `/dev/kvm` each test prints one `skip:` line and passes.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use strata_tier_microvm::monitor::{MONITOR_ID_BASE, Monitor, MonitorConfig, MonitorError, Stopped};
use strata_vmm::proto::{MachineSpec, PROBE_ADDRESS, Payload, ThreadKind};
use strata_vmm::test_utils::process::{Held, kvm};
use strata_vmm::test_utils::tiny::{CODE, HLT, counter_code, print};

fn spec(code: Vec<u8>, probe: bool, vsock: bool) -> MachineSpec {
    let mut spec = MachineSpec::code(code, CODE, 2 << 20);
    if let Payload::Boot(boot) = &mut spec.payload {
        boot.probe = probe;
    }
    if vsock { spec.with_vsock("vsock.sock") } else { spec }
}

fn config(dir: &Path) -> MonitorConfig {
    MonitorConfig::new(dir.join("run"))
}

/// Polls the monitor until its guest stops (or `limit` passes).
fn wait_stopped(monitor: &mut Monitor, limit: Duration) -> Result<Stopped, MonitorError> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(stopped) = monitor.status()? {
            return Ok(stopped);
        }
        assert!(Instant::now() < deadline, "the guest did not stop within {limit:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_tiny_guest_prints_hello_through_the_jailed_monitor() {
    let Some(_kvm) = kvm() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let mut code = print(b"hello\n");
    code.push(HLT);
    let mut monitor = Monitor::start(&config(dir.path()), &spec(code, false, false), &[], 1, 2 << 20).expect("start");
    let stopped = wait_stopped(&mut monitor, Duration::from_secs(10)).expect("status");
    assert_eq!(stopped.exits, vec!["Hlt".to_owned()]);
    let (console, dropped) = monitor.console().expect("console");
    assert_eq!(console, "hello\n");
    assert_eq!(dropped, 0);
    monitor.stop();
}

fn status_field<'a>(status: &'a str, name: &str) -> Option<&'a str> {
    status.lines().find_map(|l| l.strip_prefix(name).map(|v| v.trim_start_matches(':').trim()))
}

fn namespace(pid: &str, kind: &str) -> PathBuf {
    std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).expect("namespace link")
}

#[test]
fn every_monitor_thread_is_jailed_and_filtered() {
    let Some(_kvm) = kvm() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    // Spins (`jmp $`): the vCPU thread stays up while the host looks.
    let code = vec![0xeb, 0xfe];
    let monitor = Monitor::start(&config(dir.path()), &spec(code, false, true), &[], 1, 2 << 20).expect("start");
    let pid = monitor.pid().to_string();
    // The monitor answers `start` before its vCPU thread has necessarily been spawned: wait for every kind.
    let deadline = Instant::now() + Duration::from_secs(10);
    let tasks = loop {
        let tasks: Vec<(String, String)> = std::fs::read_dir(format!("/proc/{pid}/task"))
            .expect("tasks")
            .filter_map(|e| {
                let task = e.expect("task").file_name().to_string_lossy().into_owned();
                let status = std::fs::read_to_string(format!("/proc/{pid}/task/{task}/status")).ok()?;
                Some((task, status))
            })
            .collect();
        let has =
            |prefix: &str| tasks.iter().any(|(_, s)| status_field(s, "Name").is_some_and(|n| n.starts_with(prefix)));
        if (has("strata-vcpu") && has("strata-virtio")) || Instant::now() > deadline {
            break tasks;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let mut names = BTreeSet::new();
    for (_, status) in &tasks {
        let name = status_field(status, "Name").unwrap_or("?").to_owned();
        assert_eq!(status_field(status, "Seccomp"), Some("2"), "thread {name} has no filter");
        assert_eq!(status_field(status, "NoNewPrivs"), Some("1"), "thread {name}");
        for caps in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
            assert_eq!(status_field(status, caps), Some("0000000000000000"), "thread {name}: {caps}");
        }
        let uid = status_field(status, "Uid").expect("Uid");
        let first: u32 = uid.split_whitespace().next().expect("uid").parse().expect("a number");
        assert!(first >= MONITOR_ID_BASE, "thread {name} runs as host user {first}");
        names.insert(name);
    }
    // The main thread, the spawner, the vCPU and the vsock backend.
    assert!(tasks.len() >= 4, "threads: {names:?}");
    assert!(names.iter().any(|n| n.starts_with("strata-vcpu")), "{names:?}");
    assert!(names.iter().any(|n| n.starts_with("strata-virtio")), "{names:?}");
    // The main thread by its name, not the descriptor it was started through (`/proc/self/fd/N`).
    assert!(names.contains("strata-vmm"), "{names:?}");
    let me = std::process::id().to_string();
    for kind in ["mnt", "pid", "net", "ipc", "uts", "user", "cgroup"] {
        assert_ne!(namespace(&pid, kind), namespace(&me, kind), "the monitor shares our {kind} namespace");
    }
    // Its root holds only /run, which holds only the VM's sockets.
    let root: BTreeSet<String> = std::fs::read_dir(format!("/proc/{pid}/root"))
        .expect("root")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(root, BTreeSet::from(["run".to_owned()]));
    let run: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/root/run"))
        .expect("run")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(run, vec!["vsock.sock".to_owned()]);
    assert!(monitor.socket_dir().join("vsock.sock").exists(), "the engine sees the socket where it expects it");
    // In its own cgroup.
    if let Some(cgroup) = monitor.cgroup() {
        assert!(cgroup.pids().contains(&monitor.pid()), "the monitor is not in its cgroup");
    }
    monitor.stop();
}

#[test]
fn a_call_outside_the_vmm_filter_kills_the_monitor_and_says_which() {
    let Some(_kvm) = kvm() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let code = vec![0xeb, 0xfe];
    let mut monitor = Monitor::start(&config(dir.path()), &spec(code, false, false), &[], 1, 2 << 20).expect("start");
    match monitor.probe(ThreadKind::Vmm) {
        Err(MonitorError::Crashed { seccomp: true, report, .. }) => {
            assert!(report.contains("the vmm thread made system call 41"), "{report}");
        }
        other => panic!("the probe did not kill the monitor: {other:?}"),
    }
    assert!(monitor.has_ended());
    // Every later request says the same.
    assert!(matches!(monitor.status(), Err(MonitorError::Crashed { seccomp: true, .. })));
}

#[test]
fn a_guest_that_drives_its_vcpu_thread_outside_the_filter_kills_the_monitor() {
    let Some(_kvm) = kvm() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    // mov dword [PROBE_ADDRESS], 1; then spin.
    let mut code = vec![0xc7, 0x04, 0x25];
    code.extend((PROBE_ADDRESS as u32).to_le_bytes());
    code.extend(1u32.to_le_bytes());
    code.extend([0xeb, 0xfe]);
    // The guest runs as soon as its vCPU starts: the monitor may die before or after it says it started.
    let crash = match Monitor::start(&config(dir.path()), &spec(code, true, false), &[], 1, 2 << 20) {
        Err(e) => e,
        Ok(mut monitor) => {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                match monitor.status() {
                    Ok(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
                    Ok(status) => panic!("the monitor survived its vCPU's forbidden call: {status:?}"),
                    Err(e) => break e,
                }
            }
        }
    };
    match crash {
        MonitorError::Crashed { seccomp: true, report, .. } => {
            assert!(report.contains("the vcpu thread made system call 41"), "{report}");
        }
        other => panic!("unexpected: {other:?}"),
    }
}

#[test]
fn a_monitor_with_the_probe_refuses_more_ram_than_its_address() {
    let Some(_kvm) = kvm() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let mut spec = spec(vec![HLT], true, false);
    if let Payload::Boot(boot) = &mut spec.payload {
        boot.memory_bytes = PROBE_ADDRESS + (2 << 20);
    }
    match Monitor::start(&config(dir.path()), &spec, &[], 1, 2 << 20) {
        Err(MonitorError::Failed { stage, message }) => {
            assert_eq!(stage, "start");
            assert!(message.contains("probe"), "{message}");
        }
        other => panic!("accepted: {other:?}"),
    }
}

#[test]
fn stopped_killed_and_crashed_monitors_leave_nothing_behind() {
    let Some(_kvm) = kvm() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let config = config(dir.path());
    // The embedded binary's memfd is made once per process: make it before counting.
    drop(Monitor::start(&config, &spec(vec![HLT], false, false), &[], 1, 2 << 20).expect("start"));
    let held = Held::now();
    let cgroups = config.cgroups.as_ref().map(|c| c.count());
    let mut pids = Vec::new();
    for round in 0..3 {
        let mut monitor =
            Monitor::start(&config, &spec(vec![0xeb, 0xfe], false, true), &[], 1, 2 << 20).expect("start");
        pids.push(monitor.pid());
        match round {
            0 => monitor.stop(),
            1 => drop(monitor),
            _ => {
                let _ = monitor.probe(ThreadKind::Vmm);
                drop(monitor);
            }
        }
    }
    for pid in pids {
        assert!(!Path::new(&format!("/proc/{pid}")).exists(), "monitor {pid} is still there");
    }
    let left = Held::now().since(&held);
    assert!(left.is_empty(), "left behind: {left:?}");
    assert_eq!(config.cgroups.as_ref().map(|c| c.count()), cgroups, "cgroups leaked");
    let left: Vec<_> = std::fs::read_dir(&config.run_dir).expect("run dir").collect();
    assert!(left.is_empty(), "VM directories left: {left:?}");
}

fn console_len(monitor: &mut Monitor) -> u64 {
    let (text, dropped) = monitor.console().expect("console");
    text.len() as u64 + dropped
}

#[test]
fn a_guest_saved_by_one_monitor_runs_on_in_a_forked_one() {
    use std::os::fd::AsFd;
    let Some(_kvm) = kvm() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let config = config(dir.path());
    let mut parent = Monitor::start(&config, &spec(counter_code(), false, false), &[], 1, 2 << 20).expect("start");
    let deadline = Instant::now() + Duration::from_secs(10);
    while console_len(&mut parent) < 100 {
        assert!(Instant::now() < deadline, "the counter did not count");
        std::thread::sleep(Duration::from_millis(2));
    }
    let state = tempfile::tempfile().expect("state file");
    let memory = tempfile::tempfile().expect("memory file");
    let state_bytes = parent.snapshot(&state, &memory).expect("snapshot");
    assert_eq!(state.metadata().expect("stat").len(), state_bytes);
    assert_eq!(memory.metadata().expect("stat").len(), 2 << 20, "the memory file is the guest's RAM");
    // The parent resumed.
    let before = console_len(&mut parent);
    let deadline = Instant::now() + Duration::from_secs(10);
    while console_len(&mut parent) == before {
        assert!(Instant::now() < deadline, "the parent did not resume");
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(parent.status().expect("status"), None);

    let fork_spec = MachineSpec::fork();
    let mut state_reader = &state;
    std::io::Seek::rewind(&mut state_reader).expect("rewind");
    let mut fork = Monitor::start(&config, &fork_spec, &[state.as_fd(), memory.as_fd()], 1, 2 << 20).expect("fork");
    assert_ne!(fork.pid(), parent.pid());
    let deadline = Instant::now() + Duration::from_secs(10);
    while console_len(&mut fork) < 100 {
        assert!(Instant::now() < deadline, "the fork did not run on");
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(fork.status().expect("status"), None);
    // A damaged state is refused by the monitor, which says why.
    let broken = tempfile::tempfile().expect("file");
    std::fs::write(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&broken)), b"STRATAVMgarbage")
        .expect("write");
    match Monitor::start(&config, &fork_spec, &[broken.as_fd(), memory.as_fd()], 1, 2 << 20) {
        Err(MonitorError::Failed { stage, message }) => {
            assert_eq!(stage, "start");
            assert!(message.contains("state"), "{message}");
        }
        other => panic!("a damaged state was accepted: {other:?}"),
    }
    fork.stop();
    parent.stop();
}

#[test]
fn the_vsock_socket_answers_through_the_jail_and_its_worker_filter() {
    use std::io::{Read, Write};
    let Some(_kvm) = kvm() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let mut monitor =
        Monitor::start(&config(dir.path()), &spec(vec![0xeb, 0xfe], false, true), &[], 1, 2 << 20).expect("start");
    let socket = monitor.socket_dir().join("vsock.sock");
    // The worker thread accepts host connections and reads their CONNECT line; a guest without a driver never
    // answers, so the host waits — and the monitor lives on.
    let mut streams = Vec::new();
    for _ in 0..4 {
        let mut stream = std::os::unix::net::UnixStream::connect(&socket).expect("connect");
        stream.write_all(b"CONNECT 1024\n").expect("write");
        stream.set_read_timeout(Some(Duration::from_millis(100))).expect("timeout");
        let mut buf = [0u8; 16];
        assert!(stream.read(&mut buf).is_err(), "an answer came from a guest without a driver");
        streams.push(stream);
    }
    // A malformed line gets the connection closed, and nothing else.
    let mut bad = std::os::unix::net::UnixStream::connect(&socket).expect("connect");
    bad.write_all(b"HELLO\n").expect("write");
    bad.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    let mut buf = [0u8; 16];
    assert_eq!(bad.read(&mut buf).expect("read"), 0, "a malformed CONNECT was not closed");
    assert_eq!(monitor.status().expect("status"), None);
    drop(streams);
    monitor.stop();
}

#[test]
fn the_directories_of_dead_engines_are_removed_and_no_others() {
    let _shared = strata_vmm::test_utils::process::shared();
    let dir = tempfile::tempdir().expect("tempdir");
    let dead = dir.path().join(format!("vm-{}-0", u32::MAX - 1));
    let mine = dir.path().join(format!("vm-{}-7", std::process::id()));
    let other = dir.path().join("not-a-vm");
    for d in [&dead, &mine, &other] {
        std::fs::create_dir_all(d.join("sock")).expect("mkdir");
    }
    assert_eq!(strata_tier_microvm::monitor::remove_stale(dir.path()), 1);
    assert!(!dead.exists() && mine.exists() && other.exists());
}

#[test]
fn a_monitor_outlives_the_thread_that_started_it() {
    let Some(_kvm) = kvm() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let config = config(dir.path());
    let mut monitor = std::thread::spawn(move || {
        Monitor::start(&config, &spec(vec![0xeb, 0xfe], false, false), &[], 1, 2 << 20).expect("start")
    })
    .join()
    .expect("the starting thread");
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(monitor.status().expect("the monitor lives on"), None);
    monitor.stop();
}
