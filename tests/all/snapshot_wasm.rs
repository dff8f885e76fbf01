//! Snapshots and forks on the wasm tier: a Python session's interpreter (variables, imported modules, its
//! scratch `/tmp`) carried into forks that are independent of each other and of their parent, with fresh
//! randomness and a clock that moves forward; damaged and foreign snapshots refused.

use std::path::Path;

use strata_core::{
    Capabilities, EnvVar, ExecOptions, Grant, GrantMode, Job, Limits, Persisted, PythonSource, Sandbox, Snapshot,
    SnapshotError, Status, Tier, TierError, TierKind,
};
use strata_test_programs as programs;

use crate::util::{engine, job, python_engine, stderr, stdout};

fn code(text: &str) -> Job {
    Job::Python { source: PythonSource::Code(text.into()), args: Vec::new() }
}

/// Runs `text` in `sandbox` and returns its stdout, asserting it exited 0.
fn py(sandbox: &mut dyn Sandbox, text: &str) -> String {
    let outcome = sandbox.exec(&code(text), ExecOptions::default()).unwrap_or_else(|e| panic!("{text}: {e}"));
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{text}: {}", stderr(&outcome));
    stdout(&outcome)
}

fn python_session() -> Box<dyn Sandbox> {
    python_engine().wasm().start(&Capabilities::default(), &Limits::default()).expect("start")
}

fn fork(snapshot: &Snapshot) -> Box<dyn Sandbox> {
    python_engine().wasm().fork(snapshot).expect("fork")
}

/// A session that imported numpy, set `x = 41` and wrote `/tmp/note.txt`, and its snapshot at `dir/snap`.
fn numpy_snapshot(dir: &Path) -> (Box<dyn Sandbox>, Snapshot) {
    let mut session = python_session();
    py(
        session.as_mut(),
        "import numpy as np, random, time\nx = 41\nt0 = time.time()\nm0 = time.monotonic()\n\
         open('/tmp/note.txt', 'w').write('written before the snapshot')",
    );
    let made = session.snapshot(&dir.join("snap")).expect("snapshot");
    let snapshot = python_engine().snapshots().open_for(&dir.join("snap"), TierKind::Wasm).expect("open");
    assert_eq!(snapshot.manifest, made.manifest);
    (session, snapshot)
}

#[test]
fn a_fork_starts_from_the_snapshot_state() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (session, snapshot) = numpy_snapshot(dir.path());
    assert_eq!(snapshot.manifest.persists, [Persisted::Memory, Persisted::Filesystem, Persisted::Descriptors]);
    assert!(snapshot.manifest.parent.is_none());
    session.close().expect("close");

    let mut forked = fork(&snapshot);
    assert_eq!(py(forked.as_mut(), "print(x + 1)"), "42\n");
    assert_eq!(py(forked.as_mut(), "print(int(np.arange(5).sum()))"), "10\n");
    assert_eq!(py(forked.as_mut(), "print(open('/tmp/note.txt').read())"), "written before the snapshot\n");
    // A snapshot of a fork names its parent.
    let child = forked.snapshot(&dir.path().join("child")).expect("snapshot of a fork");
    assert_eq!(child.manifest.parent.as_deref(), Some(snapshot.manifest.id.as_str()));
    forked.close().expect("close");
    let mut grandchild = fork(&child);
    assert_eq!(py(grandchild.as_mut(), "print(x)"), "41\n");
}

#[test]
fn forks_are_independent_of_each_other_and_of_their_parent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut session, snapshot) = numpy_snapshot(dir.path());
    let mut a = fork(&snapshot);
    let mut b = fork(&snapshot);
    py(a.as_mut(), "x = 100\nopen('/tmp/a.txt', 'w').write('a')\nopen('/tmp/note.txt', 'w').write('changed by a')");
    let probe = "import os\nprint(x, os.path.exists('/tmp/a.txt'), open('/tmp/note.txt').read())";
    assert_eq!(py(b.as_mut(), probe), "41 False written before the snapshot\n");
    assert_eq!(py(session.as_mut(), probe), "41 False written before the snapshot\n");
    assert_eq!(py(a.as_mut(), probe), "100 True changed by a\n");
    // Writes in the parent after the snapshot do not reach forks made later.
    py(session.as_mut(), "x = -1");
    let mut c = fork(&snapshot);
    assert_eq!(py(c.as_mut(), "print(x)"), "41\n");
}

#[test]
fn each_fork_gets_fresh_randomness() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_session, snapshot) = numpy_snapshot(dir.path());
    let draw = "import os\nprint(os.urandom(16).hex(), random.random(), np.random.random())";
    let mut a = fork(&snapshot);
    let mut b = fork(&snapshot);
    let (a, b) = (py(a.as_mut(), draw), py(b.as_mut(), draw));
    let (a, b): (Vec<&str>, Vec<&str>) = (a.split_whitespace().collect(), b.split_whitespace().collect());
    assert_eq!((a.len(), b.len()), (3, 3));
    for (x, y) in a.iter().zip(&b) {
        assert_ne!(x, y, "two forks drew the same value");
    }
}

#[test]
fn a_forks_clocks_move_forward_from_the_snapshot() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_session, snapshot) = numpy_snapshot(dir.path());
    let mut forked = fork(&snapshot);
    assert_eq!(py(forked.as_mut(), "print(time.time() >= t0, time.monotonic() >= m0)"), "True True\n");
}

#[test]
fn a_damaged_snapshot_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut session = python_session();
    py(session.as_mut(), "x = 41");
    let snapshot = session.snapshot(&dir.path().join("snap")).expect("snapshot");
    let memory = snapshot.file("memory.img");
    let mut bytes = std::fs::read(&memory).expect("read");
    let middle = bytes.len() / 2;
    bytes[middle] ^= 1;
    std::fs::write(&memory, &bytes).expect("flip a byte");
    let err = python_engine().snapshots().open_for(&snapshot.dir, TierKind::Wasm).expect_err("refused");
    assert!(matches!(err, SnapshotError::Checksum(_)), "{err}");
    assert_eq!(err.code(), "snapshot_invalid");

    // A state file that does not fit the memory file is refused by the fork, before anything runs.
    bytes[middle] ^= 1;
    std::fs::write(&memory, &bytes).expect("restore");
    let state = snapshot.file("state.json");
    let text = std::fs::read_to_string(&state).expect("state");
    std::fs::write(&state, text.replace("\"format\": 1", "\"format\": 7")).expect("edit");
    let resealed = reseal(&snapshot.dir, &dir.path().join("resealed"));
    let err = python_engine().wasm().fork(&resealed).err().expect("refused");
    assert!(matches!(err, TierError::Snapshot(SnapshotError::InvalidManifest { .. })), "{err}");
}

/// Copies a snapshot's files into a new, validly sealed snapshot (to test what the manifest cannot catch).
fn reseal(from: &Path, to: &Path) -> Snapshot {
    let old = python_engine().snapshots().manifest(from).expect("manifest");
    let writer = python_engine().snapshots().writer(to).expect("writer");
    for file in &old.files {
        let target = writer.dir().join(&file.path);
        std::fs::create_dir_all(target.parent().expect("parent")).expect("mkdir");
        std::fs::copy(from.join(&file.path), target).expect("copy");
    }
    writer.commit(old.tier, None, old.persists, old.meta).expect("commit")
}

#[test]
fn a_snapshot_of_another_tier_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let writer = engine().snapshots().writer(&dir.path().join("process")).expect("writer");
    std::fs::write(writer.dir().join("upper.tar"), b"not ours").expect("write");
    let foreign =
        writer.commit(TierKind::Process, None, vec![Persisted::Filesystem], serde_json::json!({})).expect("commit");
    let err = engine().snapshots().open_for(&foreign.dir, TierKind::Wasm).expect_err("refused");
    assert_eq!(err.code(), "snapshot_tier");
    let err = engine().wasm().fork(&foreign).err().expect("refused");
    assert!(matches!(err, TierError::Snapshot(SnapshotError::WrongTier { found: TierKind::Process, .. })), "{err}");
}

#[test]
fn open_files_block_a_snapshot_until_closed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut session = python_session();
    py(session.as_mut(), "f = open('/tmp/open.txt', 'w')");
    let err = session.snapshot(&dir.path().join("snap")).expect_err("refused");
    assert!(matches!(err, TierError::Unsupported { .. }) && err.to_string().contains("files open"), "{err}");
    assert!(!dir.path().join("snap").exists(), "nothing is left of a refused snapshot");
    py(session.as_mut(), "f.write('done'); f.close()");
    let snapshot = session.snapshot(&dir.path().join("snap")).expect("snapshot");
    let mut forked = fork(&snapshot);
    assert_eq!(py(forked.as_mut(), "print(open('/tmp/open.txt').read(), f.closed)"), "done True\n");
}

#[test]
fn a_plain_wasm_sandbox_forks_with_its_capabilities() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rw = tempfile::tempdir().expect("tempdir");
    let caps = Capabilities {
        grants: vec![Grant::new(rw.path(), "/work", GrantMode::Rw).expect("grant")],
        ..Capabilities::default()
    };
    let sandbox = engine().wasm().start(&caps, &Limits::default()).expect("start");
    let outcome =
        sandbox.exec(&job(programs::FS, &["write", "/work/a.txt", "before"]), ExecOptions::default()).expect("exec");
    assert_eq!(outcome.status, Status::Exited { code: 0 });
    let snapshot = sandbox.snapshot(&dir.path().join("snap")).expect("snapshot");
    assert!(snapshot.manifest.persists.is_empty(), "grants are host directories, not snapshot state");
    let forked = engine().wasm().fork(&snapshot).expect("fork");
    let outcome = forked.exec(&job(programs::FS, &["read", "/work/a.txt"]), ExecOptions::default()).expect("exec");
    assert_eq!(outcome.stdout, b"before");
    forked.close().expect("close");
}

#[test]
fn secrets_are_never_written_to_a_snapshot() {
    let dir = tempfile::tempdir().expect("tempdir");
    let caps = Capabilities {
        secrets: vec![EnvVar { name: "TOKEN".into(), value: "s3cr3t-value".into() }],
        ..Capabilities::default()
    };
    // A Python session holds the value in its memory: no snapshot of it.
    let mut session = python_engine().wasm().start(&caps, &Limits::default()).expect("start");
    py(session.as_mut(), "import os\nassert os.environ['TOKEN']");
    let err = session.snapshot(&dir.path().join("python")).expect_err("refused");
    assert!(matches!(err, TierError::Unsupported { .. }) && err.to_string().contains("TOKEN"), "{err}");
    assert!(!dir.path().join("python").exists());

    // A sandbox without an interpreter records the secret's name only, and its fork is refused without it.
    let sandbox = engine().wasm().start(&caps, &Limits::default()).expect("start");
    let snapshot = sandbox.snapshot(&dir.path().join("plain")).expect("snapshot");
    for file in std::fs::read_dir(&snapshot.dir).expect("ls") {
        let text = std::fs::read(file.expect("entry").path()).expect("read");
        assert!(!String::from_utf8_lossy(&text).contains("s3cr3t-value"));
    }
    let err = engine().wasm().fork(&snapshot).err().expect("refused");
    assert!(matches!(err, TierError::Unsupported { .. }) && err.to_string().contains("TOKEN"), "{err}");
}

/// A fork's last job ends as a program does: `atexit` handlers run inside the job, their output and their
/// failures (reported as CPython reports them) in its outcome, and the fork is closed after it.
#[test]
fn a_forks_last_job_runs_atexit_handlers_into_its_outcome() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut session = python_session();
    py(session.as_mut(), "import atexit\nx = 1");
    let snapshot = session.snapshot(&dir.path().join("snap")).expect("snapshot");
    session.close().expect("close");

    let forked = fork(&snapshot);
    let job = code("atexit.register(print, 'bye')\nprint(x)");
    let outcome = forked.exec_and_close(&job, ExecOptions::default()).expect("exec");
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{}", stderr(&outcome));
    assert_eq!(stdout(&outcome), "1\nbye\n");
    assert!(matches!(forked.exec(&code("x"), ExecOptions::default()), Err(TierError::SessionEnded { .. })));

    let forked = fork(&snapshot);
    let job = code("def fail():\n    1 / 0\natexit.register(fail)\nprint('ran')");
    let outcome = forked.exec_and_close(&job, ExecOptions::default()).expect("exec");
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{}", stderr(&outcome));
    assert_eq!(stdout(&outcome), "ran\n");
    let err = stderr(&outcome);
    assert!(err.contains("Exception ignored in atexit callback") && err.contains("ZeroDivisionError"), "{err}");
}
