use std::time::Duration;

use strata_agent::ServeEnd;
use strata_guest_proto::{ClientError, ExitStatus, PROTOCOL_VERSION};

use crate::{argv, run, sh, start};

#[test]
fn hello_reports_the_version_and_kernel() {
    let agent = start();
    let info = agent.client().info();
    assert_eq!(info.version, PROTOCOL_VERSION);
    assert_eq!(info.agent_version, env!("CARGO_PKG_VERSION"));
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("osrelease");
    assert_eq!(info.kernel, release.trim());
}

#[test]
fn prepare_snapshot_acks_when_idle_and_refuses_during_an_exec() {
    let agent = start();
    agent.client().prepare_snapshot().expect("idle");
    let handle = agent.client().start(&argv(&["sleep", "100"])).expect("start");
    let err = agent.client().prepare_snapshot().expect_err("busy");
    assert!(matches!(&err, ClientError::Refused { message } if message.contains("running")), "{err}");
    handle.control().signal(libc::SIGKILL).expect("kill");
    handle.wait(|_, _| {}).expect("wait");
    agent.client().prepare_snapshot().expect("idle again");
}

#[test]
fn after_restore_acks_without_touching_the_host() {
    let agent = start();
    let before = std::time::SystemTime::now();
    // 1990: a host-mode agent must not set the host's clock.
    agent.client().after_restore([7; 64], 631_152_000_000_000_000).expect("ack");
    assert!(std::time::SystemTime::now() >= before);
}

#[test]
fn power_off_ends_the_serve_loop() {
    let agent = start();
    assert_eq!(run(agent.client(), &argv(&["true"]), b"").report.status, ExitStatus::Code(0));
    assert_eq!(agent.power_off().expect("serve"), ServeEnd::PowerOff);
}

#[test]
fn closing_the_connection_kills_running_execs() {
    let agent = start();
    let handle = agent.client().start(&sh("sleep 100")).expect("start");
    let pid = handle.pid();
    drop(handle);
    assert_eq!(agent.finish().expect("serve"), ServeEnd::Closed);
    // Killed and reaped before the serve loop returned.
    // SAFETY: kill() with signal 0 only checks that the process exists.
    let alive = unsafe { libc::kill(pid, 0) } == 0;
    assert!(!alive, "exec {pid} outlived its connection");
}

#[test]
fn an_abandoned_exec_does_not_disturb_the_next() {
    let agent = start();
    let handle = agent.client().start(&sh("for i in 1 2 3 4 5; do echo $i; sleep 0.02; done")).expect("start");
    drop(handle);
    let ran = run(agent.client(), &argv(&["echo", "next"]), b"");
    assert_eq!(ran.stdout, b"next\n");
    std::thread::sleep(Duration::from_millis(200));
    assert!(agent.client().failure().is_none());
    agent.client().prepare_snapshot().expect("the abandoned exec has ended");
}
