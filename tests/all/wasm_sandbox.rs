//! Sandboxes: several jobs in turn under one set of capabilities, and host-side file access to the grants.

use strata_core::{Capabilities, ExecOptions, Grant, GrantMode, LimitKind, Limits, Status, TierKind};
use strata_engine::TierChoice;
use strata_test_programs as programs;

use crate::util::{engine, job, limits};

#[test]
fn a_sandbox_runs_jobs_in_turn_and_shares_its_grants_with_the_host() {
    let rw = tempfile::tempdir().expect("tempdir");
    let ro = tempfile::tempdir().expect("tempdir");
    std::fs::write(ro.path().join("input.txt"), "read me").expect("write");
    let caps = Capabilities {
        grants: vec![
            Grant::new(rw.path(), "/work", GrantMode::Rw).expect("grant"),
            Grant::new(ro.path(), "/in", GrantMode::Ro).expect("grant"),
        ],
        ..Capabilities::default()
    };
    let sandbox = engine().start(TierChoice::Auto, &caps, &Limits::default()).expect("start");
    assert_eq!(sandbox.tier(), TierKind::Wasm);

    sandbox.write_file("/work/note.txt", b"from the host").expect("write");
    let outcome = sandbox.exec(&job(programs::FS, &["read", "/work/note.txt"]), ExecOptions::default()).expect("exec");
    assert_eq!(outcome.stdout, b"from the host");

    let outcome =
        sandbox.exec(&job(programs::FS, &["write", "/work/reply.txt", "from the guest"]), ExecOptions::default());
    assert_eq!(outcome.expect("exec").status, Status::Exited { code: 0 });
    assert_eq!(sandbox.read_file("/work/reply.txt").expect("read"), b"from the guest");
    assert_eq!(sandbox.read_file("/in/input.txt").expect("read"), b"read me");

    assert_eq!(sandbox.write_file("/in/x.txt", b"no").expect_err("ro").code(), "guest_path");
    assert_eq!(sandbox.write_file("/work/../in/x.txt", b"no").expect_err("dotdot").code(), "guest_path");
    assert_eq!(sandbox.read_file("/etc/passwd").expect_err("outside").code(), "guest_path");
    assert_eq!(sandbox.read_file("work/note.txt").expect_err("relative").code(), "guest_path");
    assert!(!ro.path().join("x.txt").exists());
    sandbox.close().expect("close");
}

#[test]
fn each_exec_can_bring_its_own_limits() {
    let sandbox = engine().start(TierChoice::Auto, &Capabilities::default(), &Limits::default()).expect("start");
    let opts = ExecOptions { limits: Some(limits("wall = \"100ms\"")), ..ExecOptions::default() };
    let outcome = sandbox.exec(&job(programs::SPIN, &[]), opts).expect("exec");
    assert_eq!(outcome.status, Status::LimitExceeded { limit: LimitKind::Wall });
    let outcome = sandbox.exec(&job(programs::EXIT, &["4"]), ExecOptions::default()).expect("exec");
    assert_eq!(outcome.status, Status::Exited { code: 4 }, "the sandbox survives a job that hit a limit");
}

#[test]
fn each_exec_reads_its_own_stdin_and_none_without_it() {
    let sandbox = engine().start(TierChoice::Auto, &Capabilities::default(), &Limits::default()).expect("start");
    let opts = ExecOptions { stdin: Some(b"from exec".to_vec()), ..ExecOptions::default() };
    let outcome = sandbox.exec(&job(programs::ECHO, &[]), opts).expect("exec");
    assert!(String::from_utf8_lossy(&outcome.stdout).ends_with("stdin=from exec\n"));
    let outcome = sandbox.exec(&job(programs::ECHO, &[]), ExecOptions::default()).expect("exec");
    assert!(String::from_utf8_lossy(&outcome.stdout).ends_with("stdin=\n"), "{outcome:?}");
}
