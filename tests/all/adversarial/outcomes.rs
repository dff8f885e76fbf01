//! Outcomes that must not lie under pressure, on the process tier: a memory kill is `limit_exceeded`/`memory`
//! whatever memory it was (an inode flood is kernel memory, which no process's resident set shows) and whoever
//! the kernel would have picked, and the job is the victim, not the jail's PID 1; a job that fills its writable
//! layer (`--disk`: bytes or inodes) is `limit_exceeded`/`disk`, not the `exited 0` its shell made of `ENOSPC`.
//! One-shot runs and a live sandbox (whose jobs each run in a cgroup of their own: the jail's first connection's
//! jobs cgroup, or a lane's).

use std::time::Duration;

use strata_core::{
    ByteSize, Capabilities, ExecOptions, Job, LimitKind, Limits, Outcome, Sandbox, Status, TierError, TierKind,
};
use strata_engine::{Engine, RunRequest, TierChoice};

use crate::util::python_engine;

fn sh(script: &str) -> Job {
    Job::Command { argv: vec!["sh".into(), "-c".into(), script.into()] }
}

/// The engine, when this host runs the process tier (else one skip line).
fn process(test: &str) -> Option<&'static Engine> {
    crate::util::process_tier(test).map(|_| python_engine())
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Empty files made as fast as a shell can, with no process of its own per file: the memory this takes is the
/// kernel's (inodes and dentries of the overlay and its tmpfs), while the shell's resident set stays under the
/// jail's PID 1's. `dir` is where.
fn inode_flood(dir: &str) -> Job {
    sh(&format!("mkdir -p {dir} && cd {dir} && i=0; while true > f$i; do i=$((i+1)); done; echo stopped at $i; exit 0"))
}

/// A small memory limit and a disk limit whose inodes take far more kernel memory than it.
fn flood_limits() -> Limits {
    Limits { memory: ByteSize(40 << 20), wall: Duration::from_secs(60), ..Limits::default() }
}

fn memory_kill(outcome: &Outcome) -> bool {
    outcome.status == (Status::LimitExceeded { limit: LimitKind::Memory })
}

fn describe(outcome: &Outcome) -> String {
    format!("{:?} (stdout {:?}, stderr {:?})", outcome.status, text(&outcome.stdout), text(&outcome.stderr))
}

#[test]
fn an_inode_flood_is_always_a_memory_kill_of_the_job() {
    let Some(engine) = process("an_inode_flood_is_always_a_memory_kill_of_the_job") else { return };
    let mut seen = Vec::new();
    for dir in ["/tmp/flood", "/dev/shm/flood"] {
        for _ in 0..4 {
            let job = inode_flood(dir);
            let outcome = engine
                .execute(RunRequest::new(&job).limits(flood_limits()).tier(TierChoice::Tier(TierKind::Process)))
                .expect("run");
            seen.push(format!("{dir}: {}", describe(&outcome)));
        }
    }
    assert!(seen.iter().all(|line| line.contains("LimitExceeded { limit: Memory }")), "{seen:#?}");
}

fn ok(outcome: &Outcome) -> String {
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{}", describe(outcome));
    text(&outcome.stdout)
}

/// What became of a sandbox's next job after a memory kill: `Ok(true)` it ran, `Ok(false)` the sandbox says it
/// has ended; anything else (another kill, an error) is not a sandbox that goes on or ends cleanly.
fn usable_or_ended(result: Result<Outcome, TierError>) -> Result<bool, String> {
    match result {
        Ok(outcome) if outcome.status == (Status::Exited { code: 0 }) && outcome.stdout == b"alive\n" => Ok(true),
        Ok(outcome) => Err(describe(&outcome)),
        Err(TierError::SessionEnded { .. }) => Ok(false),
        Err(err) => Err(format!("{err:?}")),
    }
}

#[test]
fn an_inode_flood_in_a_sandbox_is_a_memory_kill_and_the_sandbox_goes_on() {
    let Some(engine) = process("an_inode_flood_in_a_sandbox_is_a_memory_kill_and_the_sandbox_goes_on") else {
        return;
    };
    for round in 0..3 {
        let sandbox = engine
            .start(TierChoice::Tier(TierKind::Process), &Capabilities::default(), &flood_limits())
            .expect("start");
        let flood = sandbox.exec(&inode_flood("/tmp/flood"), ExecOptions::default()).expect("flood");
        assert!(memory_kill(&flood), "round {round}: {}", describe(&flood));
        // What the flood left pins the cgroup's memory, but a sandbox that goes on has room for a small job.
        let next = sandbox.exec(&sh("echo alive"), ExecOptions::default());
        if usable_or_ended(next).unwrap_or_else(|e| panic!("round {round}: after the kill: {e}")) {
            // A cleanup that fits in that room removes it, and then anything runs.
            assert_eq!(
                ok(&sandbox.exec(&frugal_cleanup("/tmp/flood"), ExecOptions::default()).expect("exec")),
                "clean\n"
            );
            assert_eq!(ok(&sandbox.exec(&sh("echo again"), ExecOptions::default()).expect("exec")), "again\n");
        } else {
            let err = sandbox.exec(&sh("true"), ExecOptions::default()).expect_err("an ended sandbox");
            assert!(matches!(err, TierError::SessionEnded { .. }), "round {round}: {err:?}");
        }
        sandbox.close().expect("close");
    }
}

fn process_sandbox(engine: &Engine, limits: &Limits) -> Box<dyn Sandbox> {
    engine.start(TierChoice::Tier(TierKind::Process), &Capabilities::default(), limits).expect("start")
}

/// Removes what [`inode_flood`] made in `dir` a tenth at a time, in a few MiB: `rm -rf` reads a whole
/// directory before it unlinks anything (tens of thousands of entries here), which may need more than the room
/// a sandbox that goes on after a memory kill promises, and be killed for memory in turn. Prints `clean`.
fn frugal_cleanup(dir: &str) -> Job {
    sh(&format!("cd {dir} && for d in 0 1 2 3 4 5 6 7 8 9; do rm -f f*$d; done && cd / && rmdir {dir} && echo clean"))
}

#[test]
fn inode_floods_in_one_sandbox_are_each_a_memory_kill_of_that_job() {
    let Some(engine) = process("inode_floods_in_one_sandbox_are_each_a_memory_kill_of_that_job") else { return };
    let sandbox = process_sandbox(engine, &flood_limits());
    for round in 0..3 {
        let dir = format!("/tmp/flood{round}");
        let flood = sandbox.exec(&inode_flood(&dir), ExecOptions::default()).expect("flood");
        assert!(memory_kill(&flood), "round {round}: {}", describe(&flood));
        let next = sandbox.exec(&sh("echo alive"), ExecOptions::default());
        if !usable_or_ended(next).unwrap_or_else(|e| panic!("round {round}: after the kill: {e}")) {
            // Ended cleanly: every call says so.
            let err = sandbox.exec(&sh("true"), ExecOptions::default()).expect_err("an ended sandbox");
            assert!(matches!(err, TierError::SessionEnded { .. }), "{err:?}");
            break;
        }
        assert_eq!(ok(&sandbox.exec(&frugal_cleanup(&dir), ExecOptions::default()).expect("cleanup")), "clean\n");
    }
    sandbox.close().expect("close");
}

#[test]
fn a_memory_kill_that_frees_its_memory_leaves_the_sandbox_usable() {
    let Some(engine) = process("a_memory_kill_that_frees_its_memory_leaves_the_sandbox_usable") else { return };
    let sandbox = process_sandbox(engine, &flood_limits());
    let hog = sh("python3 -c \"x = b'x' * (64 << 20)\"");
    for round in 0..2 {
        let killed = sandbox.exec(&hog, ExecOptions::default()).expect("hog");
        assert!(memory_kill(&killed), "round {round}: {}", describe(&killed));
        let next = sandbox.exec(&sh("echo alive"), ExecOptions::default());
        assert_eq!(usable_or_ended(next), Ok(true), "round {round}: a sandbox whose memory came back was ended");
    }
    sandbox.close().expect("close");
}

fn disk_limits(disk: u64) -> Limits {
    Limits { disk: ByteSize(disk), wall: Duration::from_secs(60), ..Limits::default() }
}

fn disk_full(outcome: &Outcome) -> bool {
    outcome.status == (Status::LimitExceeded { limit: LimitKind::Disk })
}

/// Writes until `ENOSPC`, and ignores it.
const FILL_BYTES: &str = "head -c 1G /dev/zero > /tmp/big 2>/dev/null; echo filled; exit 0";

/// Makes empty files until `ENOSPC` (the layer's inodes, one per 4 KiB of `--disk`), and ignores it.
const FILL_INODES: &str = "mkdir /tmp/many && cd /tmp/many && i=0; while true > f$i 2>/dev/null; do i=$((i+1)); done; \
                           echo made $i; exit 0";

#[test]
fn filling_the_disk_is_a_disk_limit_not_exit_0() {
    let Some(engine) = process("filling_the_disk_is_a_disk_limit_not_exit_0") else { return };
    let run = |job: &Job| {
        engine
            .execute(RunRequest::new(job).limits(disk_limits(8 << 20)).tier(TierChoice::Tier(TierKind::Process)))
            .expect("run")
    };
    let bytes = run(&sh(FILL_BYTES));
    assert!(disk_full(&bytes), "bytes: {}", describe(&bytes));
    let inodes = run(&sh(FILL_INODES));
    assert!(disk_full(&inodes), "inodes: {}", describe(&inodes));
    let made: u64 = text(&inodes.stdout)
        .trim()
        .trim_start_matches("made ")
        .parse()
        .unwrap_or_else(|_| panic!("{}", describe(&inodes)));
    assert!((1000..=2048).contains(&made), "8 MiB of disk holds 2048 inodes, made {made}");
    // A job that fills it and cleans up after itself exited as it said.
    let cleaned = run(&sh("head -c 1G /dev/zero > /tmp/big 2>/dev/null; rm /tmp/big; exit 3"));
    assert_eq!(cleaned.status, Status::Exited { code: 3 }, "{}", describe(&cleaned));
}

#[test]
fn filling_a_sandboxs_disk_is_a_disk_limit_for_that_job_only() {
    let Some(engine) = process("filling_a_sandboxs_disk_is_a_disk_limit_for_that_job_only") else { return };
    let sandbox = process_sandbox(engine, &disk_limits(8 << 20));
    let exec = |script: &str| sandbox.exec(&sh(script), ExecOptions::default()).expect(script);
    assert!(disk_full(&exec(FILL_BYTES)));
    // The layer is still full: a job that merely runs meanwhile did not fill it.
    assert_eq!(exec("echo still").status, Status::Exited { code: 0 });
    assert_eq!(text(&exec("rm /tmp/big && echo freed").stdout), "freed\n");
    assert!(disk_full(&exec(FILL_INODES)));
    assert_eq!(text(&exec("rm -r /tmp/many && echo freed").stdout), "freed\n");
    sandbox.close().expect("close");
}
