//! A live wasm sandbox: a set of capabilities and limits that several jobs run under, and file access to its
//! grants from the host side with the same confinement the guest has (the filesystem methods and watches are in
//! `grants` and `watch`). WASI commands run in fresh instances, beside each other and beside file calls; Python
//! runs in one live interpreter per sandbox, started by the first Python job, one turn at a time (a second turn,
//! or a snapshot, while one runs is [`TierError::Busy`]).

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, TryLockError};

use strata_core::sync::lock;
use strata_core::{
    Capabilities, EntryInfo, ExecOptions, Grant, GrantMode, GuestPath, Job, Limits, Outcome, Sandbox, Snapshot,
    SnapshotWriter, TierError, TierKind, Watcher,
};

use crate::TierInner;
use crate::grants::{self, open_grant};
use crate::python::PythonSession;
use crate::watch::{WatchTarget, Watches};

/// A sandbox on the wasm tier.
pub struct WasmSandbox {
    tier: Arc<TierInner>,
    caps: Capabilities,
    limits: Limits,
    /// Its one interpreter, once a Python job started it; held for the length of a turn.
    python: Mutex<Option<PythonSession>>,
    /// The interpreter's private `/tmp` on the host, once it runs: the file methods see it without waiting
    /// for a turn to end.
    python_tmp: Mutex<Option<PathBuf>>,
    /// The id of the snapshot it was forked from.
    parent: Option<String>,
    /// Its live watches, ended when it closes.
    watches: Mutex<Watches>,
    closed: AtomicBool,
}

impl std::fmt::Debug for WasmSandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WasmSandbox").field("caps", &self.caps).field("limits", &self.limits).finish()
    }
}

impl WasmSandbox {
    pub(crate) fn new(tier: Arc<TierInner>, caps: Capabilities, limits: Limits) -> WasmSandbox {
        WasmSandbox::restored(tier, caps, limits, None, None)
    }

    /// A sandbox forked from a snapshot, with its restored interpreter (if it had one).
    pub(crate) fn restored(
        tier: Arc<TierInner>,
        caps: Capabilities,
        limits: Limits,
        python: Option<PythonSession>,
        parent: Option<String>,
    ) -> WasmSandbox {
        let python_tmp = python.as_ref().and_then(PythonSession::scratch_dir).map(Path::to_path_buf);
        WasmSandbox {
            tier,
            caps,
            limits,
            python: Mutex::new(python),
            python_tmp: Mutex::new(python_tmp),
            parent,
            watches: Mutex::new(Watches::default()),
            closed: AtomicBool::new(false),
        }
    }

    /// Refuses every call once the sandbox is closed.
    fn open(&self) -> Result<(), TierError> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(TierError::SessionEnded { reason: "the sandbox was closed".into() });
        }
        Ok(())
    }

    /// The interpreter, for a turn or a snapshot: [`TierError::Busy`] while another holds it.
    fn python(&self, doing: &'static str) -> Result<std::sync::MutexGuard<'_, Option<PythonSession>>, TierError> {
        match self.python.try_lock() {
            Ok(guard) => Ok(guard),
            Err(TryLockError::Poisoned(poisoned)) => Ok(poisoned.into_inner()),
            Err(TryLockError::WouldBlock) => Err(TierError::Busy { tier: TierKind::Wasm, doing }),
        }
    }

    /// Finds the grant holding `guest_path` (the one mounted deepest above it) and the path inside it, for
    /// `read_file` and `write_file`.
    fn resolve(&self, guest_path: &str) -> Result<(Grant, PathBuf), TierError> {
        self.open()?;
        let path = GuestPath::new(guest_path)?;
        let visible = self.visible();
        let located = grants::locate_in_grant(&visible, &path)?;
        if located.parts.is_empty() {
            return Err(grants::bad(&path, "names a grant's directory, not a file in it"));
        }
        Ok((located.grant.clone(), PathBuf::from(located.relative())))
    }

    /// The directories the guest sees, as grants: the capabilities' grants and, once a Python session runs, its
    /// private scratch `/tmp` (read-write, as the guest has it).
    fn visible(&self) -> Cow<'_, [Grant]> {
        let scratch = lock(&self.python_tmp).clone();
        match scratch.map(|dir| Grant::new(dir, "/tmp", GrantMode::Rw)) {
            Some(Ok(tmp)) => {
                let mut all = self.caps.grants.clone();
                all.push(tmp);
                Cow::Owned(all)
            }
            _ => Cow::Borrowed(&self.caps.grants),
        }
    }

    /// The directories the file methods see, once the sandbox is known to be open.
    fn visible_open(&self) -> Result<Cow<'_, [Grant]>, TierError> {
        self.open()?;
        Ok(self.visible())
    }

    /// Runs a job; a Python one as the interpreter's last turn when `last`.
    fn exec_turn(&self, job: &Job, opts: ExecOptions, last: bool) -> Result<Outcome, TierError> {
        self.open()?;
        let limits = opts.limits.clone().unwrap_or_else(|| self.limits.clone());
        let Job::Python { source, args } = job else {
            return self.tier.run(job, &self.caps, &limits, opts);
        };
        let mut python = self.python("a Python turn")?;
        // Closed while this call waited for nothing (the lock is only tried): checked again under it.
        self.open()?;
        if python.is_none() {
            crate::exec::refuse_net(&self.caps, crate::exec::PYTHON)?;
            // The session's fuel mode is the sandbox's: fuel-metered code only when its limits set fuel.
            let (artifacts, module, runtime) = self.tier.python_session(self.limits.fuel.limit().is_some())?;
            let tools = self.tier.tools(&self.caps)?;
            let session = PythonSession::start(runtime, &module, &artifacts, &self.caps, &self.limits, tools, None)?;
            *lock(&self.python_tmp) = session.scratch_dir().map(Path::to_path_buf);
            *python = Some(session);
        }
        let Some(session) = python.as_mut() else {
            return Err(TierError::SessionEnded { reason: "the session did not start".into() });
        };
        let runtime = self.tier.runtime_of(session.metered(), session.allocation())?;
        if last {
            session.last_turn(runtime, source, args, &limits, &opts)
        } else {
            session.turn(runtime, source, args, &limits, &opts)
        }
    }
}

impl Sandbox for WasmSandbox {
    fn tier(&self) -> TierKind {
        TierKind::Wasm
    }

    fn exec(&self, job: &Job, opts: ExecOptions) -> Result<Outcome, TierError> {
        opts.refuse_terminal(TierKind::Wasm)?;
        opts.refuse_user(TierKind::Wasm)?;
        self.exec_turn(job, opts, false)
    }

    /// Ends a Python job as a program ends (see `PythonSession::last_turn`): closing afterwards has nothing
    /// to finalise.
    fn exec_and_close(&self, job: &Job, opts: ExecOptions) -> Result<Outcome, TierError> {
        let outcome = opts
            .refuse_terminal(TierKind::Wasm)
            .and_then(|()| opts.refuse_user(TierKind::Wasm))
            .and_then(|()| self.exec_turn(job, opts, true));
        let closed = self.close();
        let outcome = outcome?;
        closed?;
        Ok(outcome)
    }

    fn write_file(&self, guest_path: &str, contents: &[u8]) -> Result<(), TierError> {
        let (grant, relative) = self.resolve(guest_path)?;
        if grant.mode == GrantMode::Ro {
            return Err(TierError::GuestPath { path: guest_path.to_owned(), reason: "is in a read-only grant".into() });
        }
        open_grant(&grant)?
            .write(&relative, contents)
            .map_err(|e| TierError::GuestPath { path: guest_path.to_owned(), reason: format!("cannot write: {e}") })
    }

    fn read_file(&self, guest_path: &str) -> Result<Vec<u8>, TierError> {
        let (grant, relative) = self.resolve(guest_path)?;
        open_grant(&grant)?
            .read(&relative)
            .map_err(|e| TierError::GuestPath { path: guest_path.to_owned(), reason: format!("cannot read: {e}") })
    }

    fn list_dir(&self, path: &GuestPath, depth: u32) -> Result<Vec<EntryInfo>, TierError> {
        grants::list_dir(&self.visible_open()?, path, depth, grants::LIST_CAP)
    }

    fn stat(&self, path: &GuestPath) -> Result<EntryInfo, TierError> {
        grants::stat(&self.visible_open()?, path)
    }

    fn make_dir(&self, path: &GuestPath) -> Result<bool, TierError> {
        grants::make_dir(&self.visible_open()?, path)
    }

    fn rename(&self, from: &GuestPath, to: &GuestPath) -> Result<EntryInfo, TierError> {
        grants::rename(&self.visible_open()?, from, to)
    }

    fn remove(&self, path: &GuestPath) -> Result<(), TierError> {
        grants::remove(&self.visible_open()?, path)
    }

    fn watch(&self, path: &GuestPath, recursive: bool) -> Result<Watcher, TierError> {
        let visible = self.visible_open()?;
        let located = grants::locate_in_grant(&visible, path)?;
        located.dir(path)?;
        let parts = located.parts.iter().map(|part| (*part).to_owned()).collect();
        let target = WatchTarget { grant: open_grant(located.grant)?, parts, path: path.clone(), recursive };
        lock(&self.watches).start(target)
    }

    /// Secrets are never written to disk: a snapshot records their names only, and a Python session started
    /// with secrets (whose values are in the interpreter's memory) is not snapshotted at all.
    fn snapshot(&self, destination: &Path) -> Result<Snapshot, TierError> {
        self.open()?;
        let mut python = self.python("a Python turn; a snapshot is taken between turns")?;
        let secret_names: Vec<&str> = self.caps.secrets.iter().map(|s| s.name.as_str()).collect();
        if python.is_some() && !secret_names.is_empty() {
            return Err(TierError::Unsupported {
                tier: TierKind::Wasm,
                what: format!(
                    "snapshots of a Python session started with secrets ({}): their values are in the \
                     interpreter's memory, and secrets are never written to disk",
                    secret_names.join(", ")
                ),
            });
        }
        let mut caps = self.caps.clone();
        for secret in &mut caps.secrets {
            secret.value.clear();
        }
        let writer = SnapshotWriter::create(destination, &self.tier.config.snapshots)?;
        let python = match python.as_mut() {
            Some(session) => Some(session.snapshot(writer.dir())?),
            None => None,
        };
        let state = crate::snapshot::SandboxState {
            format: crate::snapshot::STATE_FORMAT,
            caps,
            limits: self.limits.clone(),
            python,
        };
        state.write(writer.dir())?;
        Ok(writer.commit(TierKind::Wasm, self.parent.clone(), state.persists(), state.meta())?)
    }

    /// Ends the watches, then finalises the interpreter once a turn that runs has ended (cancel it first to
    /// end it sooner). WASI commands leave nothing behind: each exec's instance is gone when it returns.
    fn close(&self) -> Result<(), TierError> {
        self.closed.store(true, Ordering::SeqCst);
        lock(&self.watches).close();
        let session = lock(&self.python).take();
        *lock(&self.python_tmp) = None;
        if let Some(mut session) = session
            && let Ok(runtime) = self.tier.runtime_of(session.metered(), session.allocation())
        {
            session.close(runtime);
        }
        Ok(())
    }
}

impl Drop for WasmSandbox {
    fn drop(&mut self) {
        let _ = self.close();
    }
}

/// The filesystem methods with real guest jobs: what a job writes into a grant is listed and watched from the
/// host, and guest paths are checked by the one rule set.
#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use strata_core::{FileType, ModuleSource, Status, Tier, WatchEventKind};
    use strata_test_programs as programs;

    use super::*;
    use crate::watch::tests::{event, path, until};

    fn sandbox(host: &Path, mode: GrantMode) -> Box<dyn Sandbox> {
        let caps =
            Capabilities { grants: vec![Grant::new(host, "/data", mode).expect("grant")], ..Capabilities::default() };
        crate::WasmTier::new(crate::WasmTierConfig::default()).start(&caps, &Limits::default()).expect("start")
    }

    fn fs_job(args: &[&str]) -> Job {
        Job::Wasm {
            module: ModuleSource::File(programs::FS.into()),
            args: args.iter().map(|a| (*a).to_owned()).collect(),
        }
    }

    #[test]
    fn a_guest_jobs_changes_arrive_on_a_watch_and_in_a_listing() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("existing.txt"), "original").expect("write");
        std::fs::create_dir(dir.path().join("subdir")).expect("mkdir");
        let sandbox = sandbox(dir.path(), GrantMode::Rw);
        let watcher = sandbox.watch(&path("/data"), true).expect("watch");
        let outcome = sandbox.exec(&fs_job(&["mutate", "/data"]), ExecOptions::default()).expect("exec");
        assert_eq!(outcome.status, Status::Exited { code: 0 }, "{outcome:?}");
        let seen = until(&watcher, &event(WatchEventKind::Remove, "/data/subdir"));
        for expected in [
            event(WatchEventKind::Create, "/data/new.txt"),
            event(WatchEventKind::Write, "/data/existing.txt"),
            event(WatchEventKind::Remove, "/data/existing.txt"),
            event(WatchEventKind::Create, "/data/newdir"),
            event(WatchEventKind::Remove, "/data/subdir"),
        ] {
            assert!(seen.contains(&expected), "{expected:?} missing from {seen:?}");
        }
        let listed = sandbox.list_dir(&path("/data"), 1).expect("list");
        let new = listed.iter().find(|e| e.name == "new.txt").expect("new.txt listed");
        assert_eq!((new.file_type, new.size), (FileType::File, 1));
        assert_eq!(sandbox.stat(&path("/data/newdir")).expect("stat").file_type, FileType::Dir);
        drop(sandbox);
        // What was queued before the close still arrives; then the watch ends.
        let closed = Instant::now();
        let mut left = 0;
        while watcher.next_timeout(Duration::from_secs(5)).is_some() {
            left += 1;
            assert!(left < 100, "the watch goes on after the sandbox closed");
        }
        assert!(closed.elapsed() < Duration::from_secs(4), "the watch ended rather than went quiet");
    }

    #[test]
    fn what_the_host_makes_the_guest_reads_and_a_read_only_grant_refuses_changes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let rw = sandbox(dir.path(), GrantMode::Rw);
        assert!(rw.make_dir(&path("/data/a/b")).expect("mkdir"));
        rw.write_file("/data/a/b/f.txt", b"made by the host").expect("write");
        let moved = rw.rename(&path("/data/a/b/f.txt"), &path("/data/a/g.txt")).expect("rename");
        assert_eq!(moved.path, "/data/a/g.txt");
        let outcome = rw.exec(&fs_job(&["read", "/data/a/g.txt"]), ExecOptions::default()).expect("exec");
        assert_eq!(outcome.stdout, b"made by the host");
        rw.remove(&path("/data/a")).expect("remove");
        assert!(!dir.path().join("a").exists());

        std::fs::write(dir.path().join("kept.txt"), "kept").expect("write");
        let ro = sandbox(dir.path(), GrantMode::Ro);
        for err in [
            ro.make_dir(&path("/data/x")).map(|_| ()),
            ro.remove(&path("/data/kept.txt")),
            ro.rename(&path("/data/kept.txt"), &path("/data/y")).map(|_| ()),
            ro.write_file("/data/kept.txt", b"changed"),
        ] {
            let err = err.expect_err("a read-only grant refuses");
            assert_eq!(err.code(), "guest_path");
            assert!(err.to_string().contains("read-only grant"), "{err}");
        }
        assert_eq!(std::fs::read(dir.path().join("kept.txt")).expect("read"), b"kept");
    }

    #[test]
    fn file_methods_check_guest_paths_by_the_one_rule_set() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("f"), "x").expect("write");
        let sandbox = sandbox(dir.path(), GrantMode::Rw);
        for (bad, why) in [
            ("data/f", "must be absolute"),
            ("/data/../etc/passwd", "must not contain `..`"),
            ("/data/f\0", "contains a NUL byte"),
            ("/elsewhere/f", "is not inside any grant"),
            ("/data", "names a grant's directory, not a file in it"),
        ] {
            let err = sandbox.read_file(bad).expect_err(bad);
            assert_eq!(err.code(), "guest_path", "{bad:?}: {err}");
            assert!(err.to_string().contains(why), "{bad:?}: {err}");
            assert_eq!(sandbox.write_file(bad, b"y").expect_err(bad).code(), "guest_path");
        }
        assert_eq!(sandbox.read_file("/data//./f").expect("a normalised path reads"), b"x");
    }
}
