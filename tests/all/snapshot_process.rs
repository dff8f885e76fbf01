//! Process-tier snapshots and forks: the filesystem a setup job leaves (writes in `/tmp` and the workdir,
//! deletions from the image, a directory replaced whole) is what every fork starts from; forks are independent of
//! each other, of the sandbox and of the snapshot directory; damaged or foreign snapshots are refused with typed
//! errors; a hundred forks leave nothing behind.

use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use strata_core::{
    Capabilities, EnvVar, ExecOptions, Job, Limits, Outcome, Sandbox, Snapshot, SnapshotError, Status, Tier, TierError,
    TierKind,
};
use strata_tier_process::ProcessTier;

use crate::util::{process_tier, python_engine};

/// The trust the engine's tiers seal and open snapshots with.
fn trust() -> &'static strata_core::SnapshotTrust {
    python_engine().snapshots()
}

/// The tests here count jails and mounts: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn sh(script: &str) -> Job {
    Job::Command { argv: vec!["sh".into(), "-c".into(), script.into()] }
}

fn run(sandbox: &mut dyn Sandbox, script: &str) -> Outcome {
    let outcome = sandbox.exec(&sh(script), ExecOptions::default()).expect("exec");
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{script}: {outcome:?}");
    outcome
}

fn stdout(outcome: &Outcome) -> String {
    String::from_utf8_lossy(&outcome.stdout).into_owned()
}

/// The setup job: writes in `/tmp` and the workdir, deletes a file of the image, replaces a directory of the
/// image by one of its own, makes a symlink pointing out of the jail and a FIFO.
const SETUP: &str = "echo 41 > /tmp/x && echo work > /root/notes && rm /etc/debian_version && \
                     rm -rf /etc/apt && mkdir /etc/apt && echo mine > /etc/apt/only && \
                     ln -s /etc/shadow /root/link && mkfifo /root/fifo && chmod 0750 /root/notes && \
                     date +%s%N";

fn snapshot_after_setup(tier: &ProcessTier, dir: &Path, caps: &Capabilities) -> (Box<dyn Sandbox>, Snapshot, u128) {
    let mut sandbox = tier.start(caps, &Limits::default()).expect("start");
    let setup = run(sandbox.as_mut(), SETUP);
    let then: u128 = stdout(&setup).trim().parse().expect("date");
    let snapshot = sandbox.snapshot(&dir.join("snap")).expect("snapshot");
    (sandbox, snapshot, then)
}

#[test]
fn a_fork_starts_from_the_setup_jobs_filesystem() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(tier) = process_tier("a_fork_starts_from_the_setup_jobs_filesystem") else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut sandbox, snapshot, then) = snapshot_after_setup(tier, dir.path(), &Capabilities::default());
    let manifest = &snapshot.manifest;
    assert_eq!(manifest.tier, TierKind::Process);
    assert_eq!(manifest.persists, [strata_core::Persisted::Filesystem]);
    assert!(manifest.meta["processes"].as_str().is_some_and(|p| p.starts_with("not kept")), "{:?}", manifest.meta);
    assert!(manifest.meta["upper"]["whiteouts"].as_u64() >= Some(1), "{:?}", manifest.meta);
    // The sandbox goes on after its snapshot.
    assert_eq!(stdout(&run(sandbox.as_mut(), "cat /tmp/x")), "41\n");

    let mut fork = tier.fork(&snapshot).expect("fork");
    let seen = run(
        fork.as_mut(),
        "cat /tmp/x /root/notes; test -e /etc/debian_version && echo still-there; ls /etc/apt; \
         readlink /root/link; test -p /root/fifo && echo fifo; stat -c '%a %u' /root/notes; date +%s%N",
    );
    let text = stdout(&seen);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(&lines[..6], ["41", "work", "only", "/etc/shadow", "fifo", "750 0"], "{text}");
    let now: u128 = lines[6].parse().expect("date");
    assert!(now > then, "the fork's clock moves forward");
    assert_eq!(fork.read_file("/etc/apt/only").expect("read"), b"mine\n");
    fork.close().expect("close");
    sandbox.close().expect("close");
}

#[test]
fn forks_are_independent_of_each_other_the_sandbox_and_the_snapshot() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(tier) = process_tier("forks_are_independent") else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut sandbox, snapshot, _) = snapshot_after_setup(tier, dir.path(), &Capabilities::default());
    let stored = std::fs::read(snapshot.file("upper.tree")).expect("stored tree");

    let mut a = tier.fork(&snapshot).expect("fork a");
    let mut b = tier.fork(&snapshot).expect("fork b");
    run(a.as_mut(), "echo a > /tmp/x && echo a > /tmp/only-a && rm /root/notes");
    assert_eq!(stdout(&run(b.as_mut(), "cat /tmp/x; ls /tmp; cat /root/notes")), "41\nx\nwork\n");
    assert_eq!(stdout(&run(sandbox.as_mut(), "cat /tmp/x; ls /tmp")), "41\nx\n");
    assert_eq!(stdout(&run(a.as_mut(), "cat /tmp/x; ls /tmp")), "a\nonly-a\nx\n");
    // The snapshot directory is only ever read: byte for byte as written, and still verifies.
    assert_eq!(std::fs::read(snapshot.file("upper.tree")).expect("stored tree"), stored);
    trust().open_for(&snapshot.dir, TierKind::Process).expect("still whole");
    let c = tier.fork(&snapshot).expect("fork c after the others wrote");
    drop(c);

    // Fresh randomness and identity per fork.
    let random = "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'";
    let (ra, rb) = (stdout(&run(a.as_mut(), random)), stdout(&run(b.as_mut(), random)));
    assert_eq!(ra.len(), 32);
    assert_ne!(ra, rb, "two forks read the same random bytes");
    // A fork of a fork records its parent.
    let child = a.snapshot(&dir.path().join("child")).expect("snapshot of a fork");
    assert_eq!(child.manifest.parent.as_deref(), Some(snapshot.manifest.id.as_str()));
    let mut grandchild = tier.fork(&child).expect("fork of the fork's snapshot");
    assert_eq!(stdout(&run(grandchild.as_mut(), "cat /tmp/x /tmp/only-a; ls /root")), "a\na\nfifo\nlink\n");
}

#[test]
fn a_machine_id_made_by_the_setup_job_is_fresh_in_every_fork() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(tier) = process_tier("a_machine_id_made_by_the_setup_job") else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let mut sandbox = tier.start(&Capabilities::default(), &Limits::default()).expect("start");
    run(sandbox.as_mut(), "rm -f /etc/machine-id && echo 0123456789abcdef0123456789abcdef > /etc/machine-id");
    let snapshot = sandbox.snapshot(&dir.path().join("snap")).expect("snapshot");
    let ids: Vec<Vec<u8>> =
        (0..2).map(|_| tier.fork(&snapshot).expect("fork").read_file("/etc/machine-id").expect("machine-id")).collect();
    assert_eq!(ids[0].len(), 33);
    assert_ne!(ids[0], ids[1]);
    assert_ne!(ids[0], b"0123456789abcdef0123456789abcdef\n");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("ls") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), to.join(entry.file_name())).expect("copy");
    }
}

#[test]
fn damaged_foreign_and_secret_snapshots_are_refused_with_typed_errors() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(tier) = process_tier("damaged_foreign_and_secret_snapshots") else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let caps = Capabilities {
        secrets: vec![EnvVar { name: "TOKEN".into(), value: "s3cr3t-value".into() }],
        ..Capabilities::default()
    };
    let (_sandbox, snapshot, _) = snapshot_after_setup(tier, dir.path(), &caps);

    // A flipped byte in the stored layer, after the snapshot was opened.
    let corrupt = dir.path().join("corrupt");
    copy_dir(&snapshot.dir, &corrupt);
    let opened = trust().open_for(&corrupt, TierKind::Process).expect("whole before the flip");
    // Forked once while whole (the tier then skips re-hashing an unchanged directory), then damaged in place.
    drop(tier.fork_with(&opened, &caps, &Limits::default()).expect("fork while whole"));
    let mut bytes = std::fs::read(corrupt.join("upper.tree")).expect("read");
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(corrupt.join("upper.tree"), &bytes).expect("write");
    let err = tier.fork(&opened).err().expect("corrupt snapshot refused");
    assert!(matches!(err, TierError::Snapshot(SnapshotError::Checksum(_))), "{err}");
    assert_eq!(err.code(), "snapshot_invalid");

    // A manifest edited to say another tier breaks its seal; a genuine snapshot of another tier is refused.
    let foreign = dir.path().join("foreign");
    copy_dir(&snapshot.dir, &foreign);
    let manifest = std::fs::read_to_string(foreign.join("manifest.json")).expect("manifest");
    std::fs::write(foreign.join("manifest.json"), manifest.replacen("\"tier\": \"process\"", "\"tier\": \"wasm\"", 1))
        .expect("edit");
    let err = trust().open_for(&foreign, TierKind::Process).expect_err("edited manifest refused");
    assert!(matches!(err, SnapshotError::Seal(_)), "{err}");
    let wasm = python_engine().wasm().start(&Capabilities::default(), &Limits::default()).expect("wasm sandbox");
    let wasm_snapshot = wasm.snapshot(&dir.path().join("wasm")).expect("wasm snapshot");
    let err = trust().open_for(&wasm_snapshot.dir, TierKind::Process).expect_err("foreign refused");
    assert!(matches!(err, SnapshotError::WrongTier { found: TierKind::Wasm, .. }), "{err}");
    let err = tier.fork(&wasm_snapshot).err().expect("foreign snapshot refused");
    assert_eq!(err.code(), "snapshot_tier", "{err}");

    // Secrets are never written to disk: the plain fork is refused, a fork given the capabilities runs.
    let stored = std::fs::read(snapshot.dir.join("manifest.json")).expect("manifest");
    assert!(!String::from_utf8_lossy(&stored).contains("s3cr3t-value"));
    let err = tier.fork(&snapshot).err().expect("secrets missing");
    assert_eq!(err.code(), "unsupported", "{err}");
    assert!(err.to_string().contains("TOKEN"), "{err}");
    let mut fork = tier.fork_with(&snapshot, &caps, &Limits::default()).expect("fork with the capabilities");
    assert_eq!(stdout(&run(&mut fork, "cat /tmp/x; echo $TOKEN")), "41\n[REDACTED:TOKEN]\n");
}

fn count(dir: &str) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

fn children() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|tasks| {
            tasks
                .flatten()
                .map(|t| std::fs::read_to_string(t.path().join("children")).unwrap_or_default())
                .map(|c| c.split_whitespace().count())
                .sum()
        })
        .unwrap_or(0)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd)]
struct Held {
    mounts: usize,
    fds: usize,
    children: usize,
    cgroups: usize,
}

fn held(tier: &ProcessTier) -> Held {
    Held {
        mounts: std::fs::read_to_string("/proc/self/mountinfo").map(|m| m.lines().count()).unwrap_or(0),
        fds: count("/proc/self/fd"),
        children: children(),
        cgroups: tier.cgroups().count(),
    }
}

#[test]
fn a_hundred_forks_leave_nothing_behind() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(tier) = process_tier("a_hundred_forks_leave_nothing_behind") else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let (sandbox, snapshot, _) = snapshot_after_setup(tier, dir.path(), &Capabilities::default());
    drop(sandbox);
    // Warm up (the embedded jail binary's memfd, the engine's lazies).
    drop(tier.fork(&snapshot).expect("fork"));
    let before = held(tier);
    for i in 0..100 {
        let mut fork = tier.fork(&snapshot).unwrap_or_else(|e| panic!("fork {i}: {e}"));
        assert_eq!(stdout(&run(fork.as_mut(), "cat /tmp/x")), "41\n");
        if i % 2 == 0 {
            fork.close().expect("close");
        }
    }
    // Other tests of this binary start jails too: wait until theirs are gone as well.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut after = held(tier);
    while !(after.mounts <= before.mounts
        && after.fds <= before.fds
        && after.children <= before.children
        && after.cgroups <= before.cgroups)
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(50));
        after = held(tier);
    }
    assert!(
        after.mounts <= before.mounts
            && after.fds <= before.fds
            && after.children <= before.children
            && after.cgroups <= before.cgroups,
        "before {before:?}, after {after:?}"
    );
}

#[test]
fn a_fork_whose_disk_limit_cannot_hold_the_snapshot_is_refused() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(tier) = process_tier("a_fork_whose_disk_limit_cannot_hold_the_snapshot") else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let mut sandbox = tier.start(&Capabilities::default(), &Limits::default()).expect("start");
    run(sandbox.as_mut(), "head -c 6291456 /dev/zero > /root/six-mib");
    let snapshot = sandbox.snapshot(&dir.path().join("snap")).expect("snapshot");
    let small = Limits { disk: strata_core::ByteSize(2 << 20), ..Limits::default() };
    let err = tier.fork_with(&snapshot, &Capabilities::default(), &small).expect_err("too small");
    assert_eq!(err.code(), "unsupported", "{err}");
    assert!(err.to_string().contains("disk limit"), "{err}");
    let mut fork = tier.fork(&snapshot).expect("fork with the recorded limits");
    assert_eq!(stdout(&run(fork.as_mut(), "wc -c < /root/six-mib")), "6291456\n");
}
