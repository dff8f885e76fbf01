//! Snapshots on disk, attacked by whoever can write where they live: capabilities smuggled into a manifest or a
//! state file (grants of host `/`, environment, network), files swapped, manifests carried over from another
//! home, and hostile input that would cost unbounded work (a 1 TiB sparse file, huge claimed sizes, links, FIFOs,
//! directory bombs). A snapshot is trusted only under the seal of this home's key; everything else is refused as
//! `snapshot_invalid` (or `snapshot_too_large`) before anything of it is used, and quickly. Also: writers killed
//! mid-snapshot leave nothing that is ever trusted, and a full disk is a typed error.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use strata_core::{
    Capabilities, ExecOptions, Grant, GrantMode, Job, Limits, ModuleSource, Persisted, SnapshotError, SnapshotKey,
    SnapshotTrust, Status, Tier, TierError, TierKind,
};
use strata_engine::{Engine, EngineConfig, RunRequest};
use strata_test_programs as programs;
use strata_tier_wasm::{CacheOutcome, WasmTier, WasmTierConfig};

use crate::util::{engine, job, process_tier, python_engine, stdout};

/// What an attacker without the key does to a snapshot: changes one file, then fixes up the manifest's size and
/// sha256 for it (and the total) so that every check but the seal passes.
fn rewrite(dir: &Path, name: &str, edit: impl FnOnce(Vec<u8>) -> Vec<u8>) {
    let bytes = edit(std::fs::read(dir.join(name)).expect("read"));
    std::fs::write(dir.join(name), &bytes).expect("write");
    rewrite_manifest(dir, |manifest| {
        let files = manifest["files"].as_array_mut().expect("files");
        let entry = files.iter_mut().find(|f| f["path"] == name).expect("listed");
        entry["size"] = json!(bytes.len());
        entry["sha256"] = json!(hex(&Sha256::digest(&bytes)));
        let total: u64 = files.iter().filter_map(|f| f["size"].as_u64()).sum();
        manifest["total_bytes"] = json!(total);
    });
}

fn rewrite_manifest(dir: &Path, edit: impl FnOnce(&mut Value)) {
    let path = dir.join("manifest.json");
    let mut manifest: Value = serde_json::from_slice(&std::fs::read(&path).expect("manifest")).expect("json");
    edit(&mut manifest);
    std::fs::write(&path, serde_json::to_vec_pretty(&manifest).expect("json")).expect("write");
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A host directory with a file no sandbox was given.
struct Victim {
    dir: tempfile::TempDir,
}

impl Victim {
    fn new() -> Victim {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("secret.txt"), b"host secret\n").expect("write");
        Victim { dir }
    }

    fn secret(&self) -> PathBuf {
        self.dir.path().join("secret.txt")
    }

    fn untouched(&self) {
        assert_eq!(std::fs::read(self.secret()).expect("read"), b"host secret\n", "the host file was written");
        let names: Vec<_> =
            std::fs::read_dir(self.dir.path()).expect("ls").map(|e| e.expect("e").file_name()).collect();
        assert_eq!(names, ["secret.txt"], "a file was planted on the host");
    }
}

/// The grant every attack adds: the host's `/`, read-write, at `/host`.
fn host_root() -> Value {
    serde_json::to_value(Grant::new("/", "/host", GrantMode::Rw).expect("grant")).expect("json")
}

fn assert_invalid(err: &dyn std::fmt::Display, code: &str) {
    assert_eq!(code, "snapshot_invalid", "{err}");
}

#[test]
fn a_wasm_state_rewritten_to_grant_host_root_is_refused() {
    let victim = Victim::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let sandbox = engine().wasm().start(&Capabilities::default(), &Limits::default()).expect("start");
    let snapshot = sandbox.snapshot(&dir.path().join("snap")).expect("snapshot");
    rewrite(&snapshot.dir, "state.json", |bytes| {
        let mut state: Value = serde_json::from_slice(&bytes).expect("state");
        state["caps"]["grants"].as_array_mut().expect("grants").push(host_root());
        state["caps"]["env"].as_array_mut().expect("env").push(json!({"name": "PWNED", "value": "1"}));
        serde_json::to_vec(&state).expect("json")
    });
    match engine().wasm().fork(&snapshot) {
        Ok(fork) => {
            // What the attack gets when the fork is made: the host's files, through the smuggled grant.
            let secret = format!("/host{}", victim.secret().display());
            let read = fork.exec(&job(programs::FS, &["read", &secret]), ExecOptions::default()).expect("read");
            let _ = fork.exec(&job(programs::FS, &["write", &secret, "pwned"]), ExecOptions::default());
            victim.untouched();
            panic!("the rewritten snapshot was forked; it read the host file: {:?}", stdout(&read));
        }
        Err(err) => {
            assert!(matches!(err, TierError::Snapshot(SnapshotError::Seal(_))), "{err}");
            assert_invalid(&err, err.code());
        }
    }
    let err = engine().open_snapshot(&snapshot.dir).expect_err("refused when opened too");
    assert_invalid(&err, err.code());
    victim.untouched();
}

#[test]
fn a_process_manifest_rewritten_to_grant_host_root_is_refused() {
    let Some(tier) = process_tier("a_process_manifest_rewritten_to_grant_host_root_is_refused") else { return };
    let victim = Victim::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let sandbox = tier.start(&Capabilities::default(), &Limits::default()).expect("start");
    let snapshot = sandbox.snapshot(&dir.path().join("snap")).expect("snapshot");
    rewrite_manifest(&snapshot.dir, |manifest| {
        let caps = &mut manifest["meta"]["caps"];
        caps["grants"].as_array_mut().expect("grants").push(host_root());
        caps["env"].as_array_mut().expect("env").push(json!({"name": "PWNED", "value": "1"}));
        caps["net"] = json!({"allow": ["*.com", "*.org", "*.net"]});
    });
    match tier.fork(&snapshot) {
        Ok(fork) => {
            let secret = format!("/host{}", victim.secret().display());
            let script = format!("cat {secret}; echo pwned > {secret}; echo $PWNED");
            let job = Job::Command { argv: vec!["sh".into(), "-c".into(), script] };
            let read = fork.exec(&job, ExecOptions::default()).expect("exec");
            victim.untouched();
            panic!("the rewritten snapshot was forked; it read the host file: {:?}", stdout(&read));
        }
        Err(err) => {
            assert!(matches!(err, TierError::Snapshot(SnapshotError::Seal(_))), "{err}");
            assert_invalid(&err, err.code());
        }
    }
    // Re-opened from the directory (what `strata run --snapshot` does) it is refused as well.
    let err = python_engine().open_snapshot(&snapshot.dir).expect_err("refused");
    assert_invalid(&err, err.code());
    victim.untouched();
}

#[test]
fn a_file_swapped_after_the_snapshot_was_opened_is_refused_at_fork() {
    let victim = Victim::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let rw = tempfile::tempdir().expect("tempdir");
    let caps = Capabilities {
        grants: vec![Grant::new(rw.path(), "/work", GrantMode::Rw).expect("grant")],
        ..Capabilities::default()
    };
    let sandbox = engine().wasm().start(&caps, &Limits::default()).expect("start");
    let snapshot = sandbox.snapshot(&dir.path().join("snap")).expect("snapshot");
    let opened = engine().open_snapshot(&snapshot.dir).expect("whole");
    let state = opened.dir.join("state.json");
    let original = std::fs::read(&state).expect("state");

    // A state file with other capabilities, in place (same size, so only its contents tell).
    let mut forged: Value = serde_json::from_slice(&original).expect("state");
    forged["caps"]["grants"][0]["host"] = json!(victim.dir.path());
    let mut forged = serde_json::to_vec(&forged).expect("json");
    forged.resize(original.len(), b' ');
    std::fs::write(&state, &forged).expect("swap");
    let err = engine().wasm().fork(&opened).err().expect("refused");
    assert_invalid(&err, err.code());
    // A symlink to a host file in its place; a FIFO in its place (refused at once, never waited on).
    std::fs::remove_file(&state).expect("rm");
    std::os::unix::fs::symlink(victim.secret(), &state).expect("symlink");
    let err = engine().wasm().fork(&opened).err().expect("refused");
    assert_invalid(&err, err.code());
    std::fs::remove_file(&state).expect("rm");
    nix_mkfifo(&state);
    let started = Instant::now();
    let err = engine().wasm().fork(&opened).err().expect("refused");
    assert_invalid(&err, err.code());
    assert!(started.elapsed() < Duration::from_secs(5), "a FIFO is not waited on: {:?}", started.elapsed());
    // Put back, the same snapshot forks again.
    std::fs::remove_file(&state).expect("rm");
    std::fs::write(&state, &original).expect("restore");
    let fork = engine().wasm().fork(&opened).expect("fork of the restored snapshot");
    let outcome = fork.exec(&job(programs::FS, &["write", "/work/a.txt", "ok"]), ExecOptions::default()).expect("run");
    assert_eq!(outcome.status, Status::Exited { code: 0 });
    victim.untouched();
}

/// A fork's memory is never a mapping of the snapshot's file: truncated under a live fork, a mapped file raised
/// SIGBUS in the host at the fork's next touch of a page past the new end, killing the server with every
/// sandbox in it. The fork maps a private copy, so it runs on; new forks re-verify the file and are refused.
#[test]
fn a_memory_image_truncated_or_rewritten_under_live_forks_reaches_none_of_them() {
    let py = |code: &str| Job::Python { source: strata_core::PythonSource::Code(code.into()), args: Vec::new() };
    let dir = tempfile::tempdir().expect("tempdir");
    let engine = python_engine();
    let sandbox = engine.wasm().start(&Capabilities::default(), &Limits::default()).expect("start");
    sandbox.exec(&py("x = 41"), ExecOptions::default()).expect("turn");
    let snapshot = sandbox.snapshot(&dir.path().join("snap")).expect("snapshot");
    let image = snapshot.dir.join("memory.img");
    let length = std::fs::metadata(&image).expect("memory.img").len();
    let first = engine.wasm().fork(&snapshot).expect("fork");
    let second = engine.wasm().fork(&snapshot).expect("fork");

    std::fs::OpenOptions::new().write(true).open(&image).expect("open").set_len(0).expect("truncate");
    // A full collection walks every object the interpreter has: pages of the image the fork never touched.
    let code = "import gc; gc.collect(); print(sum(range(10**6)), x + 1)";
    let outcome = first.exec(&py(code), ExecOptions::default()).expect("the fork runs on");
    assert_eq!((&outcome.status, stdout(&outcome).as_str()), (&Status::Exited { code: 0 }, "499999500000 42\n"));
    let err = engine.wasm().fork(&snapshot).err().expect("a new fork of the truncated file is refused");
    assert_invalid(&err, err.code());

    // Rewritten at its size with other bytes: the same.
    std::fs::write(&image, vec![0xcc; usize::try_from(length).expect("size")]).expect("rewrite");
    let outcome = second.exec(&py(code), ExecOptions::default()).expect("the other fork runs on");
    assert_eq!(stdout(&outcome), "499999500000 42\n");
    let err = engine.wasm().fork(&snapshot).err().expect("a new fork of the rewritten file is refused");
    assert_invalid(&err, err.code());
    let err = engine.open_snapshot(&snapshot.dir).expect_err("and opening it again");
    assert_invalid(&err, err.code());
}

fn nix_mkfifo(path: &Path) {
    let status = Command::new("mkfifo").arg(path).status().expect("mkfifo");
    assert!(status.success());
}

#[test]
fn a_snapshot_from_another_home_or_an_older_format_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sandbox = engine().wasm().start(&Capabilities::default(), &Limits::default()).expect("start");
    let snapshot = sandbox.snapshot(&dir.path().join("snap")).expect("snapshot");
    // Another home has another key: its engine refuses the snapshot, and so does its wasm tier's fork.
    let other_home = tempfile::tempdir().expect("tempdir");
    let other =
        Engine::new(EngineConfig { home: Some(other_home.path().to_owned()), ..EngineConfig::default() }).expect("e");
    let err = other.open_snapshot(&snapshot.dir).expect_err("another home's snapshot");
    assert!(err.to_string().contains("another key"), "{err}");
    assert_invalid(&err, err.code());
    let err = other.wasm().fork(&snapshot).err().expect("refused by the other home's tier");
    assert_invalid(&err, err.code());
    // A key given by the embedder is a key like any other.
    let given = SnapshotTrust::new(SnapshotKey::from_bytes([1; 32]));
    assert!(matches!(given.open(&snapshot.dir), Err(SnapshotError::Seal(_))));
    // A snapshot of format 1 had no seal: refused with a message that says what to do.
    std::fs::remove_file(snapshot.dir.join("manifest.seal")).expect("rm");
    rewrite_manifest(&snapshot.dir, |manifest| manifest["format"] = json!(1));
    let err = engine().open_snapshot(&snapshot.dir).expect_err("format 1");
    assert!(err.to_string().contains("format 2") && err.to_string().contains("make it again"), "{err}");
    assert_invalid(&err, err.code());
}

#[test]
fn no_job_is_granted_the_directory_of_the_snapshot_key() {
    let home = tempfile::tempdir().expect("tempdir");
    let engine =
        Engine::new(EngineConfig { home: Some(home.path().to_owned()), ..EngineConfig::default() }).expect("e");
    let keys = home.path().join("keys");
    // Whether the key exists yet or not: the home, its parent, the key's directory itself.
    for made in [false, true] {
        if made {
            engine.snapshots().key().expect("key");
        }
        for dir in [home.path(), home.path().parent().expect("parent"), keys.as_path()] {
            if !dir.exists() {
                continue;
            }
            let err = refused_grant(&engine, dir);
            assert!(err.contains("snapshot key"), "{err}");
        }
    }
    // What the host maps into itself (compiled code, memory images, kept snapshot copies) and its records of
    // verified snapshots: neither the directories nor anything in them.
    for (dir, what) in
        [("modules", "maps into itself"), ("run/copies", "snapshot memory"), ("run/verified", "verified")]
    {
        let dir = home.path().join(dir);
        std::fs::create_dir_all(dir.join("inside")).expect("mkdir");
        for granted in [dir.clone(), dir.join("inside")] {
            let err = refused_grant(&engine, &granted);
            assert!(err.contains(what), "{err}");
        }
    }
    // A directory beside them is fine (the E2B server's sandbox homes live in run/serve).
    for beside in ["data", "run/serve/sandbox"] {
        let data = home.path().join(beside);
        std::fs::create_dir_all(&data).expect("mkdir");
        let caps = Capabilities {
            grants: vec![Grant::new(&data, "/h", GrantMode::Rw).expect("grant")],
            ..Capabilities::default()
        };
        engine.start(strata_engine::TierChoice::Auto, &caps, &Limits::default()).expect("a grant beside the key");
    }
}

/// Grants `dir` to a sandbox and to a job of `engine`; both must be refused as `invalid_capability`. Returns the
/// message.
fn refused_grant(engine: &Engine, dir: &Path) -> String {
    let caps =
        Capabilities { grants: vec![Grant::new(dir, "/h", GrantMode::Ro).expect("grant")], ..Capabilities::default() };
    let err = engine.start(strata_engine::TierChoice::Auto, &caps, &Limits::default()).err().expect("refused");
    assert_eq!(err.code(), "invalid_capability", "{err}");
    let job = job(programs::HELLO, &[]);
    let refused = engine.execute(RunRequest::new(&job).caps(&caps).limits(Limits::default())).expect_err("refused");
    assert_eq!(refused.code(), "invalid_capability", "{refused}");
    err.to_string()
}

#[test]
fn hostile_sizes_links_fifos_and_directory_bombs_are_refused_quickly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sandbox = engine().wasm().start(&Capabilities::default(), &Limits::default()).expect("start");
    let snapshot = sandbox.snapshot(&dir.path().join("snap")).expect("snapshot");
    let state = snapshot.dir.join("state.json");
    let original = std::fs::read(&state).expect("state");
    let quickly = |what: &str| {
        let started = Instant::now();
        let err = engine().open_snapshot(&snapshot.dir).expect_err(what);
        // A generous sanity bound (hashing 1 TiB took about 17 minutes), not a performance claim.
        assert!(started.elapsed() < Duration::from_secs(5), "{what}: {:?}", started.elapsed());
        err
    };

    // A sparse file of 1 TiB in place of the state file, the manifest left alone: refused from `stat`.
    let huge = std::fs::File::create(&state).expect("create");
    huge.set_len(1 << 40).expect("sparse");
    let err = quickly("a 1 TiB sparse file");
    assert!(matches!(err.code(), "snapshot_invalid"), "{err}");
    // The same with the manifest claiming it (and everything an attacker can compute): the seal refuses it.
    rewrite_manifest(&snapshot.dir, |manifest| {
        manifest["files"][0]["size"] = json!(1u64 << 40);
        manifest["total_bytes"] = json!(1u64 << 40);
    });
    assert_invalid(&"", quickly("a manifest claiming 1 TiB").code());
    drop(huge);
    // And sealed with the key (as only the host could): the bounds refuse it before a byte is hashed.
    let text = std::fs::read(snapshot.dir.join("manifest.json")).expect("manifest");
    let key = engine().snapshots().key().expect("key");
    strata_core::snapshot::test_utils::seal(&snapshot.dir, &key, &text).expect("seal");
    assert_eq!(quickly("a sealed claim of 1 TiB").code(), "snapshot_too_large");

    // Back to the true manifest; now a symlink to a host file, then a FIFO, in place of the state file.
    let fresh = dir.path().join("fresh");
    let made = engine().wasm().start(&Capabilities::default(), &Limits::default()).expect("start").snapshot(&fresh);
    let fresh_snapshot = made.expect("snapshot");
    for name in ["manifest.json", "manifest.seal"] {
        std::fs::copy(fresh_snapshot.dir.join(name), snapshot.dir.join(name)).expect("copy");
    }
    std::fs::write(&state, std::fs::read(fresh_snapshot.dir.join("state.json")).expect("state")).expect("restore");
    engine().open_snapshot(&snapshot.dir).expect("whole again");
    std::fs::remove_file(&state).expect("rm");
    std::os::unix::fs::symlink("/etc/passwd", &state).expect("symlink");
    assert_invalid(&"", quickly("a symlinked file").code());
    std::fs::remove_file(&state).expect("rm");
    nix_mkfifo(&state);
    assert_invalid(&"", quickly("a FIFO").code());
    std::fs::remove_file(&state).expect("rm");
    std::fs::write(&state, std::fs::read(fresh_snapshot.dir.join("state.json")).expect("state")).expect("restore");

    // A directory bomb: 20 000 directories; and a tree 200 levels deep.
    for i in 0..20_000 {
        std::fs::create_dir(snapshot.dir.join(format!("d{i}"))).expect("mkdir");
    }
    assert_eq!(quickly("a directory bomb").code(), "snapshot_too_large");
    for i in 0..20_000 {
        std::fs::remove_dir(snapshot.dir.join(format!("d{i}"))).expect("rmdir");
    }
    let deep: PathBuf = std::iter::once(snapshot.dir.clone()).chain((0..200).map(|_| PathBuf::from("d"))).collect();
    std::fs::create_dir_all(&deep).expect("deep");
    assert_eq!(quickly("a deep tree").code(), "snapshot_too_large");
    let _ = original;
}

/// The child of [`a_killed_writer_leaves_a_whole_snapshot_or_none`]: writes snapshots in a loop until killed.
#[test]
#[ignore = "run by a_killed_writer_leaves_a_whole_snapshot_or_none in a process it kills"]
fn killed_writer_child() {
    let Some(dir) = std::env::var_os("STRATA_TEST_SNAPSHOT_WRITER_DIR") else { return };
    let dir = PathBuf::from(dir);
    let trust = SnapshotTrust::new(SnapshotKey::from_bytes([42; 32]));
    let block = vec![0x5au8; 1 << 20];
    for i in 0.. {
        let writer = trust.writer(&dir.join(format!("snap-{i}"))).expect("writer");
        let mut file = std::fs::File::create(writer.dir().join("memory")).expect("create");
        for _ in 0..16 {
            std::io::Write::write_all(&mut file, &block).expect("write");
        }
        std::fs::write(writer.dir().join("state.json"), format!("{{\"i\":{i}}}")).expect("state");
        writer.commit(TierKind::Wasm, None, vec![Persisted::Memory], json!({"i": i})).expect("commit");
    }
}

#[test]
fn a_killed_writer_leaves_a_whole_snapshot_or_none() {
    let dir = tempfile::tempdir().expect("tempdir");
    let trust = SnapshotTrust::new(SnapshotKey::from_bytes([42; 32]));
    let exe = std::env::current_exe().expect("test binary");
    let (mut kills, mut whole, mut partial, mut sealed) = (0, 0, 0, 0);
    for delay_ms in [5u64, 40, 90, 150, 230, 370] {
        let mut child = Command::new(&exe)
            .args(["adversarial::snapshots::killed_writer_child", "--exact", "--ignored", "--quiet"])
            .env("STRATA_TEST_SNAPSHOT_WRITER_DIR", dir.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn the writer");
        std::thread::sleep(Duration::from_millis(delay_ms));
        child.kill().expect("SIGKILL");
        child.wait().expect("reap");
        kills += 1;
        // Every snapshot there is whole and valid; nothing half-written is ever opened as one.
        for entry in std::fs::read_dir(dir.path()).expect("ls") {
            let name = entry.expect("entry").file_name().to_string_lossy().into_owned();
            if name.starts_with("snap-") {
                let opened = trust.open(&dir.path().join(&name)).unwrap_or_else(|e| panic!("{name}: {e}"));
                assert_eq!(opened.manifest.total_bytes, (16 << 20) + opened.listed("state.json").expect("state").size);
                whole += 1;
            } else {
                // A writer killed before its seal leaves a staging directory that is refused; one killed between
                // the seal and the rename leaves one that opens only as whole as a committed snapshot would.
                assert!(name.starts_with(".snap-") && name.contains(".partial-"), "{name}");
                match trust.open(&dir.path().join(&name)) {
                    Ok(opened) => {
                        let state = opened.listed("state.json").expect("state").size;
                        assert_eq!(opened.manifest.total_bytes, (16 << 20) + state, "{name}");
                        sealed += 1;
                    }
                    Err(err) => {
                        assert!(
                            matches!(
                                err,
                                SnapshotError::NotASnapshot(_) | SnapshotError::Unsealed(_) | SnapshotError::Seal(_)
                            ),
                            "{name} refused for another reason than its missing seal: {err}"
                        );
                        assert_invalid(&err, err.code());
                        partial += 1;
                    }
                }
            }
        }
    }
    eprintln!(
        "{kills} writers killed; seen {whole} whole snapshots, {partial} unsealed staging directories and {sealed} \
         sealed ones on the way"
    );
    assert!(whole > 0, "the writer never finished a snapshot: the test proves nothing");
    // The next writer sweeps what the dead ones left.
    let writer = trust.writer(&dir.path().join("after")).expect("writer");
    drop(writer);
    let left: Vec<String> = std::fs::read_dir(dir.path())
        .expect("ls")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|name| name.contains(".partial-"))
        .collect();
    assert!(left.is_empty(), "staging directories of dead writers were left: {left:?}");
}

/// A small tmpfs mounted for the test, unmounted when dropped.
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    /// A tmpfs of `size` bytes, or `None` (with a skip line) where this host cannot mount one.
    fn mount(test: &str, size: u64) -> Option<Tmpfs> {
        let dir = tempfile::tempdir().expect("tempdir");
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0755"), "tmpfs"])
            .arg(dir.path())
            .stderr(std::process::Stdio::null())
            .status();
        match status {
            Ok(status) if status.success() => Some(Tmpfs { dir }),
            _ => {
                eprintln!("skip {test}: cannot mount a tmpfs here (not root?)");
                None
            }
        }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Fills the filesystem up to `leave` free bytes.
    fn fill(&self, leave: u64) -> PathBuf {
        let stat = nix::sys::statvfs::statvfs(self.path()).expect("statvfs");
        let free = stat.blocks_available() * stat.fragment_size();
        let filler = self.path().join("filler");
        let file = std::fs::File::create(&filler).expect("filler");
        let mut left = free.saturating_sub(leave);
        let block = vec![1u8; 64 << 10];
        let mut out = std::io::BufWriter::new(file);
        while left > 0 {
            let n = left.min(block.len() as u64) as usize;
            if std::io::Write::write_all(&mut out, &block[..n]).is_err() {
                break;
            }
            left -= n as u64;
        }
        let _ = std::io::Write::flush(&mut out);
        filler
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(self.dir.path()).status();
    }
}

fn partials(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .expect("ls")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|name| name.contains(".partial-") || name.ends_with(".tmp"))
        .collect()
}

#[test]
fn a_full_home_is_a_typed_error_and_leaves_nothing_trusted() {
    let Some(home) = Tmpfs::mount("a_full_home_is_a_typed_error_and_leaves_nothing_trusted", 4 << 20) else {
        return;
    };
    let engine =
        Engine::new(EngineConfig { home: Some(home.path().to_owned()), ..EngineConfig::default() }).expect("engine");
    // A sandbox whose state is larger than the room left: its environment holds 256 KiB.
    let caps = Capabilities {
        env: vec![strata_core::EnvVar { name: "BIG".into(), value: "x".repeat(256 << 10) }],
        ..Capabilities::default()
    };
    let sandbox = engine.wasm().start(&caps, &Limits::default()).expect("start");
    // With no room for the key itself: a typed error, no key file and no temporary left.
    let filler = home.fill(0);
    let err = sandbox.snapshot(&home.path().join("snap")).expect_err("no room for the key");
    assert_eq!(err.code(), "snapshot_key", "{err}");
    assert!(!home.path().join("keys/snapshot.key").exists());
    assert!(partials(&home.path().join("keys")).is_empty());
    std::fs::remove_file(&filler).expect("free");
    engine.snapshots().key().expect("the key, now that there is room");

    // Room for the key but not the state.
    let filler = home.fill(64 << 10);
    let err = sandbox.snapshot(&home.path().join("snap")).expect_err("disk full");
    assert_eq!(err.code(), "snapshot_io", "{err}");
    assert!(err.to_string().contains("No space left"), "{err}");
    assert!(!home.path().join("snap").exists(), "no snapshot appears");
    assert!(partials(home.path()).is_empty(), "{:?}", partials(home.path()));
    std::fs::remove_file(&filler).expect("free");
    let snapshot = sandbox.snapshot(&home.path().join("snap")).expect("a snapshot, now that there is room");
    engine.open_snapshot(&snapshot.dir).expect("whole");
    let fork = engine.wasm().fork(&snapshot).expect("fork");
    let outcome = fork.exec(&job(programs::HELLO, &["fork"]), ExecOptions::default()).expect("run");
    assert_eq!(outcome.status, Status::Exited { code: 0 });
}

#[test]
fn a_full_module_cache_compiles_anyway_and_keeps_no_half_entry() {
    let Some(home) = Tmpfs::mount("a_full_module_cache_compiles_anyway_and_keeps_no_half_entry", 4 << 20) else {
        return;
    };
    let cache = home.path().join("modules");
    std::fs::create_dir(&cache).expect("mkdir");
    let tier = || WasmTier::new(WasmTierConfig { cache_dir: Some(cache.clone()), ..WasmTierConfig::default() });
    let module = ModuleSource::File(programs::HELLO.into());
    let limits = Limits::default();
    let filler = home.fill(16 << 10);
    // The entry cannot be stored: the job runs all the same, from the module compiled in memory.
    let full = tier();
    assert_eq!(full.prepare(&module, &limits).expect("compiles"), Some(CacheOutcome::Compiled));
    let job = Job::Wasm { module: module.clone(), args: vec!["full".into()] };
    let outcome = full.run(&job, &Capabilities::default(), &limits, ExecOptions::default()).expect("runs");
    assert!(stdout(&outcome).starts_with("Hello, full!"), "{outcome:?}");
    assert!(partials(&cache).is_empty(), "{:?}", partials(&cache));
    // Nothing it left is trusted: with room again, the next tier compiles (no entry), the one after loads it.
    std::fs::remove_file(&filler).expect("free");
    assert_eq!(tier().prepare(&module, &limits).expect("compile"), Some(CacheOutcome::Compiled));
    assert_eq!(tier().prepare(&module, &limits).expect("load"), Some(CacheOutcome::Hit));
}

/// A later process skips hashing a snapshot only where a sealed record of its last verification vouches for the
/// files: kept in the home (never in the snapshot directory, which whoever made the snapshot may write), sealed
/// with the home's key, and naming each file's device, inode, size and times. Whoever can write the snapshot
/// directory cannot make that record vouch for a change: a file rewritten in place (its times put back), replaced
/// by another file, or a record edited without the key all lead to the files being hashed, and refused.
#[test]
fn a_verified_stamp_vouches_only_for_files_left_as_they_were() {
    let home = tempfile::tempdir().expect("tempdir");
    let new_engine =
        || Engine::new(EngineConfig { home: Some(home.path().to_owned()), ..EngineConfig::default() }).expect("e");
    let dir = tempfile::tempdir().expect("tempdir");
    let rw = tempfile::tempdir().expect("tempdir");
    let caps = Capabilities {
        grants: vec![Grant::new(rw.path(), "/work", GrantMode::Rw).expect("grant")],
        ..Capabilities::default()
    };
    let snapshot = {
        let engine = new_engine();
        let sandbox = engine.wasm().start(&caps, &Limits::default()).expect("start");
        sandbox.snapshot(&dir.path().join("snap")).expect("snapshot")
    };
    let listing = |path: &Path| -> Vec<_> {
        let mut names: Vec<_> = std::fs::read_dir(path).expect("ls").map(|e| e.expect("e").file_name()).collect();
        names.sort();
        names
    };
    let before = listing(&snapshot.dir);
    // Files changed within a second of their check are not recorded (file times are coarse): once they settle,
    // a new process (a new engine on the same home) hashes them once, and the next one does not.
    std::thread::sleep(strata_core::file_stamp::SETTLE + Duration::from_millis(100));
    assert!(new_engine().open_snapshot(&snapshot.dir).expect("whole").bytes_hashed() > 0);
    let engine = new_engine();
    let opened = engine.open_snapshot(&snapshot.dir).expect("whole");
    assert_eq!(opened.bytes_hashed(), 0, "vouched for by the record");
    let fork = engine.wasm().fork(&opened).expect("fork");
    let outcome = fork.exec(&job(programs::FS, &["write", "/work/a.txt", "ok"]), ExecOptions::default()).expect("run");
    assert_eq!(outcome.status, Status::Exited { code: 0 });
    // The record is the home's, private to it; the snapshot directory holds what it held.
    let records = home.path().join(strata_core::snapshot::VERIFIED_DIR);
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&records).expect("records").permissions());
    assert_eq!(mode & 0o777, 0o700);
    assert_eq!(listing(&snapshot.dir), before);
    let record = std::fs::read_dir(&records).expect("ls").next().expect("a record").expect("entry").path();
    let genuine = std::fs::read_to_string(&record).expect("record");

    // The state file, rewritten in place (same size) with a grant of the victim's directory, its modification
    // time put back: the change time moved, so it is hashed, and refused.
    let victim = Victim::new();
    let state = snapshot.dir.join("state.json");
    let original = std::fs::read(&state).expect("state");
    let mut forged: Value = serde_json::from_slice(&original).expect("state");
    forged["caps"]["grants"][0]["host"] = json!(victim.dir.path());
    let mut forged = serde_json::to_vec(&forged).expect("json");
    forged.resize(original.len(), b' ');
    let mtime = std::fs::metadata(&state).and_then(|m| m.modified()).expect("mtime");
    let file = std::fs::OpenOptions::new().write(true).open(&state).expect("open");
    std::os::unix::fs::FileExt::write_all_at(&file, &forged, 0).expect("write");
    file.set_modified(mtime).expect("utimens");
    drop(file);
    let err = new_engine().open_snapshot(&snapshot.dir).expect_err("rewritten in place");
    assert_invalid(&err, err.code());
    // The record edited to vouch for the file as it is now (its line found by the inode, which an in-place
    // write keeps), without the key to seal it again: ignored, so the file is hashed, and refused.
    std::thread::sleep(strata_core::file_stamp::SETTLE + Duration::from_millis(100));
    let now = strata_core::FileStamp::of_metadata(&std::fs::symlink_metadata(&state).expect("stat"));
    let old = genuine.lines().find(|line| line.split(' ').nth(1) == Some(now.ino.to_string().as_str()));
    let edited = genuine.replacen(old.expect("the record has a line for state.json"), &now.render(), 1);
    assert_ne!(edited, genuine);
    std::fs::write(&record, &edited).expect("forge the record");
    let err = new_engine().open_snapshot(&snapshot.dir).expect_err("a forged record");
    assert_invalid(&err, err.code());
    // Replaced by another file (a new inode) with the forged bytes, as a rename over it: refused.
    std::fs::write(dir.path().join("forged"), &forged).expect("write");
    std::fs::rename(dir.path().join("forged"), &state).expect("rename");
    let err = new_engine().open_snapshot(&snapshot.dir).expect_err("replaced");
    assert_invalid(&err, err.code());
    // Put back (a new file with the original bytes): hashed, whole, and forked.
    std::fs::write(dir.path().join("original"), &original).expect("write");
    std::fs::rename(dir.path().join("original"), &state).expect("rename");
    let engine = new_engine();
    let opened = engine.open_snapshot(&snapshot.dir).expect("whole again");
    assert!(opened.bytes_hashed() > 0);
    engine.wasm().fork(&opened).expect("fork of the restored snapshot");
    victim.untouched();
}
