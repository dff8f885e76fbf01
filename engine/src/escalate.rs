//! Dynamic escalation (DESIGN §2, Router): a Python job that `--tier auto` sent to wasm and that failed there for
//! a reason the policy marks escalatable re-runs on the native tier, from a clean state.
//!
//! **What escalates** ([`diagnose`]). Only a run that ended like an uncaught exception (exit status 1, stderr not
//! truncated) whose *final* traceback's exception line says one of:
//!
//! - a missing module ([`EscalationReason::MissingModule`]): `ModuleNotFoundError` (or `ImportError`) with `No
//!   module named 'X'`, `Unsupported platform for standard library module 'X'` or `Standard library module 'X' was
//!   not found`, and only when the top-level module of `X` is indeed absent from the wasm build
//!   ([`WasmModules`]); a submodule missing from a package wasm has is the script's own error;
//! - an unsupported OS call ([`EscalationReason::UnsupportedCall`]): `OSError: [Errno 58] …` (WASI `ENOTSUP`:
//!   sockets, `subprocess`) or `[Errno 52]` (`ENOSYS`), `OSError: … is unavailable on wasm32-wasi` (`ctypes`,
//!   `mmap`), `RuntimeError: can't start new thread`, `NotImplementedError: This Python build lacks …`, or an
//!   `AttributeError`/`ImportError` for an attribute the wasm build's `os`, `signal` or `time` lacks and Linux
//!   CPython has ([`UNSUPPORTED_ATTRIBUTES`]: `os.fork`, `os.kill`, `signal.alarm`, …).
//!
//! An ordinary exception (`ValueError`, a `SyntaxError`, a missing module native Python lacks too because the
//! submodule does not exist) is the job's own result. The exception line is the guest's own output: a script can
//! print one to be re-run natively, which gains it nothing the policy's `auto` routing does not already allow.
//!
//! **Clean state** ([`ScratchGrants`]). While an escalation is possible, the wasm attempt runs against a scratch
//! copy of each read-write grant (read-only grants are used as they are): copied without following symbolic links
//! (a link is copied as a link), into a private temporary directory. When the wasm attempt is the result (it
//! succeeded, or failed for a reason that does not escalate), what it changed in the copy is committed to the host
//! grant ([`ScratchGrants::commit`]): files created or changed (each moved into place with one `rename` in its own
//! directory, so a reader sees the old file or the new one), links, directories, and what it deleted. The host tree
//! is walked one component at a time with `O_NOFOLLOW` from the grant's own descriptor, so no path leads outside
//! the grant whatever links the host tree holds. When the job escalates, the copies are discarded and the native
//! run sees the host grants exactly as they were: nothing the failed attempt did is applied, nothing is applied
//! twice. The temporary directory is removed in every case (it is removed when [`ScratchGrants`] is dropped); one
//! left by an engine process that was killed mid-job is removed by the next job that makes copies there.
//!
//! **Size bound.** Copying costs time and disk, so the read-write grants' files together may hold at most the
//! job's disk limit (and [`MAX_ENTRIES`] entries each). A job over it, or with a grant that holds something other
//! than files, directories and links (or cannot be copied at all), or whose read-write grant overlaps another
//! grant, gets no scratch copy and does **not** escalate: its wasm run writes to the host grants directly and is its
//! result (the engine logs a warning saying why). No job is refused for it.
//!
//! **Streamed output.** The wasm attempt's output is held back ([`HeldOutput`]) while it may still be discarded,
//! and passed to the caller's sink only when the wasm attempt is the result; after an escalation the sink sees only
//! the native run's output.
//!
//! **Streamed stdin** ([`StdinTee`]). A job's stdin stream is read as it arrives by both runs, never up front: the
//! wasm attempt reads it through a tee that records every byte it takes from the caller's stream (at most
//! [`MAX_TEED_STDIN`]), and the native rerun reads a stream that replays those bytes and then carries on with the
//! rest of the caller's stream, live, until its writer closes it. An attempt that took more than the cap is its
//! job's result: the rerun could not be given all of its input.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::io::PipeWriter;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat, renameat};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::stat::{Mode, SFlag, fchmod, fstatat, mkdirat};
use nix::unistd::{UnlinkatFlags, symlinkat, unlinkat};
use strata_core::dirfd::{DIR_FLAGS, kind_of, open_beneath, remove_at};
use strata_core::{Capabilities, GrantMode, Outcome, OutputSink, Status, StdinStream, Stream};

use crate::policy::EscalationReason;
use crate::scan::WasmModules;

/// The most entries one read-write grant may hold to get a scratch copy.
pub const MAX_ENTRIES: u64 = 100_000;

/// The longest exception text an escalation reason quotes.
const MAX_QUOTED: usize = 200;

/// Attributes of the wasm build's `os`, `signal` and `time` that Linux CPython has and WASI does not: a job that
/// reaches for one (`AttributeError: module 'os' has no attribute 'fork'`, `ImportError: cannot import name 'fork'
/// from 'os'`) made an unsupported call. Found by asking the wasm build (3.15) and Debian's CPython (3.11) for
/// each; the integration tests check every entry is still missing on wasm.
pub const UNSUPPORTED_ATTRIBUTES: &[(&str, &[&str])] = &[
    (
        "os",
        &[
            "fork",
            "forkpty",
            "system",
            "posix_spawn",
            "posix_spawnp",
            "spawnv",
            "spawnvp",
            "spawnl",
            "spawnlp",
            "spawnve",
            "spawnvpe",
            "spawnle",
            "spawnlpe",
            "execv",
            "execve",
            "wait",
            "wait3",
            "wait4",
            "waitpid",
            "waitid",
            "kill",
            "killpg",
            "pipe",
            "getppid",
            "chown",
            "lchown",
            "fchown",
            "setsid",
            "getsid",
            "getpgid",
            "setpgid",
            "getpgrp",
            "setpgrp",
            "nice",
            "setuid",
            "setgid",
            "seteuid",
            "setegid",
            "getuid",
            "getgid",
            "geteuid",
            "getegid",
            "getgroups",
            "setgroups",
            "umask",
            "chroot",
            "mkfifo",
            "mknod",
            "getlogin",
            "openpty",
            "ttyname",
            "tcgetpgrp",
            "register_at_fork",
            "sched_setaffinity",
            "sched_getaffinity",
            "getloadavg",
            "setpriority",
            "getpriority",
            "pidfd_open",
            "memfd_create",
            "eventfd",
            "splice",
            "sendfile",
            "fchmod",
            "get_terminal_size",
            "statvfs",
            "fstatvfs",
            "sync",
            "getrandom",
        ],
    ),
    (
        "signal",
        &[
            "alarm",
            "setitimer",
            "getitimer",
            "pause",
            "pthread_kill",
            "pthread_sigmask",
            "sigwait",
            "sigwaitinfo",
            "sigtimedwait",
            "sigpending",
            "siginterrupt",
        ],
    ),
    ("time", &["clock_settime", "tzset", "thread_time"]),
];

/// Why a wasm run may escalate: what [`diagnose`] found in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WasmFailure {
    /// The policy's name for it (`[escalation] on`).
    pub reason: EscalationReason,
    /// What failed: `missing module 'resource'`, `unsupported call: os.fork`.
    pub what: String,
    /// The final exception line, as the guest printed it (at most 200 characters).
    pub exception: String,
}

impl WasmFailure {
    /// The escalation's reason, as the outcome's `escalations` records it: what failed, then what the wasm attempt
    /// printed and how it ended.
    pub fn describe(&self, attempt: &Outcome) -> String {
        let wall = attempt.usage.wall;
        let after = if wall.as_secs() == 0 {
            format!("{} ms", wall.as_millis())
        } else {
            format!("{:.1} s", wall.as_secs_f64())
        };
        format!("{} (the wasm attempt failed after {after}: {}; its output is discarded)", self.what, self.exception)
    }
}

/// Whether a wasm run of a Python job failed for a reason that may escalate (see the module docs); `modules` is the
/// wasm build's module list, without which a missing module is never taken for one.
pub fn diagnose(outcome: &Outcome, modules: Option<&WasmModules>) -> Option<WasmFailure> {
    if outcome.status != (Status::Exited { code: 1 }) || outcome.truncated.stderr {
        return None;
    }
    let stderr = String::from_utf8_lossy(&outcome.stderr);
    let line = final_exception(&stderr)?;
    let (reason, what) = match modules.and_then(|modules| missing_module(line, modules)) {
        Some(module) => (EscalationReason::MissingModule, format!("missing module '{module}'")),
        None => (EscalationReason::UnsupportedCall, format!("unsupported call: {}", unsupported_call(line)?)),
    };
    Some(WasmFailure { reason, what, exception: quote(line) })
}

fn quote(line: &str) -> String {
    let mut text: String = line.chars().take(MAX_QUOTED).collect();
    if line.chars().count() > MAX_QUOTED {
        text.push('…');
    }
    text
}

/// The exception line of the last traceback on stderr: the first unindented line after the last `Traceback (most
/// recent call last):` header.
fn final_exception(stderr: &str) -> Option<&str> {
    const HEADER: &str = "Traceback (most recent call last):";
    let mut lines = stderr.lines().collect::<Vec<_>>();
    let start = lines.iter().rposition(|line| *line == HEADER)?;
    lines.drain(..=start);
    lines.into_iter().find(|line| !line.is_empty() && !line.starts_with([' ', '\t']))
}

/// The text between the first pair of single quotes after `prefix` in `text`.
fn quoted_after<'t>(text: &'t str, prefix: &str) -> Option<(&'t str, &'t str)> {
    let rest = text.strip_prefix(prefix)?.strip_prefix('\'')?;
    let end = rest.find('\'')?;
    Some((&rest[..end], &rest[end + 1..]))
}

fn is_dotted_name(name: &str) -> bool {
    !name.is_empty()
        && name.split('.').all(|part| {
            let mut chars = part.chars();
            chars.next().is_some_and(|c| c == '_' || c.is_alphabetic())
                && chars.all(|c| c == '_' || c.is_alphanumeric())
        })
}

/// The module a `ModuleNotFoundError`/`ImportError` line says is missing, when its top level is absent from wasm.
fn missing_module<'l>(line: &'l str, modules: &WasmModules) -> Option<&'l str> {
    let (kind, message) = line.split_once(": ")?;
    if kind != "ModuleNotFoundError" && kind != "ImportError" {
        return None;
    }
    let module = [
        ("No module named ", ""),
        ("Unsupported platform for standard library module ", ""),
        ("Standard library module ", " was not found"),
    ]
    .into_iter()
    .find_map(|(prefix, suffix)| {
        let (name, rest) = quoted_after(message, prefix)?;
        rest.starts_with(suffix).then_some(name)
    })?;
    let top = module.split('.').next()?;
    (is_dotted_name(module) && !modules.has(top)).then_some(module)
}

/// What unsupported call an exception line reports, if any.
fn unsupported_call(line: &str) -> Option<String> {
    let (kind, message) = line.split_once(": ")?;
    match kind {
        "OSError" => {
            for (errno, name) in [("[Errno 58] ", "ENOTSUP"), ("[Errno 52] ", "ENOSYS")] {
                if let Some(text) = message.strip_prefix(errno) {
                    return Some(format!("{} ({name})", text.trim_end_matches('.')));
                }
            }
            message.ends_with(" is unavailable on wasm32-wasi").then(|| message.to_owned())
        }
        "RuntimeError" => (message == "can't start new thread").then(|| "starting a thread".to_owned()),
        "NotImplementedError" => {
            message.starts_with("This Python build lacks ").then(|| message.trim_end_matches('.').to_owned())
        }
        "AttributeError" => {
            let (module, rest) = quoted_after(message, "module ")?;
            let (attribute, _) = quoted_after(rest, " has no attribute ")?;
            unsupported_attribute(module, attribute)
        }
        "ImportError" => {
            let (attribute, rest) = quoted_after(message, "cannot import name ")?;
            let (module, _) = quoted_after(rest, " from ")?;
            unsupported_attribute(module, attribute)
        }
        _ => None,
    }
}

fn unsupported_attribute(module: &str, attribute: &str) -> Option<String> {
    UNSUPPORTED_ATTRIBUTES
        .iter()
        .any(|(name, attributes)| *name == module && attributes.contains(&attribute))
        .then(|| format!("{module}.{attribute}"))
}

/// An [`OutputSink`] that keeps what it is given until [`release`](HeldOutput::release) passes it on (or it is
/// dropped, discarding it). It holds only what the outcome captures, so the output limit bounds it.
#[derive(Default)]
pub struct HeldOutput {
    chunks: Mutex<Vec<(Stream, Vec<u8>)>>,
}

impl HeldOutput {
    /// Passes everything held to `sink`, in order.
    pub fn release(&self, sink: &dyn OutputSink) {
        let chunks = match self.chunks.lock() {
            Ok(mut chunks) => std::mem::take(&mut *chunks),
            Err(poisoned) => std::mem::take(&mut *poisoned.into_inner()),
        };
        for (stream, chunk) in chunks {
            sink.output(stream, &chunk);
        }
    }
}

impl std::fmt::Debug for HeldOutput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held = self.chunks.lock().map_or(0, |chunks| chunks.len());
        f.debug_struct("HeldOutput").field("chunks", &held).finish()
    }
}

impl OutputSink for HeldOutput {
    fn output(&self, stream: Stream, chunk: &[u8]) {
        let mut chunks = match self.chunks.lock() {
            Ok(chunks) => chunks,
            Err(poisoned) => poisoned.into_inner(),
        };
        chunks.push((stream, chunk.to_vec()));
    }
}

/// The most stdin a wasm attempt may take from a stream and still escalate (the native rerun replays it).
pub const MAX_TEED_STDIN: usize = strata_core::MAX_BUFFERED_STDIN;

/// How long a tee's thread waits on a descriptor before it looks whether it was stopped.
const TEE_POLL: Duration = Duration::from_millis(50);

/// The most a tee reads or writes at once: one pipe buffer page, which a pipe with room takes without blocking.
const TEE_CHUNK: usize = 4096;

/// stdin shared by an escalating job's two runs (see the module docs): the wasm attempt's side of the caller's
/// stream and the record of what it took.
pub struct StdinTee {
    original: StdinStream,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    recording: Arc<Mutex<Recording>>,
}

/// What a tee took from the caller's stream.
#[derive(Debug, Default)]
struct Recording {
    bytes: Vec<u8>,
    /// More than the cap was taken; `bytes` holds only the first part.
    over_cap: bool,
    /// The stream ended (its writer closed it, or reading failed).
    ended: bool,
}

/// Feeds a native rerun its stdin; stops doing so when dropped.
#[derive(Debug)]
pub struct StdinReplay {
    stop: Arc<AtomicBool>,
}

impl Drop for StdinReplay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl std::fmt::Debug for StdinTee {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StdinTee").finish_non_exhaustive()
    }
}

impl StdinTee {
    /// Tees `original` into the stream the wasm attempt reads (returned beside the tee), recording at most `cap`
    /// bytes. A thread of its own copies the bytes as they arrive.
    pub fn start(original: StdinStream, cap: usize) -> io::Result<(StdinTee, StdinStream)> {
        let (attempt, writer) = StdinStream::pipe()?;
        let stop = Arc::new(AtomicBool::new(false));
        let recording = Arc::new(Mutex::new(Recording::default()));
        let thread = {
            let (original, stop, recording) = (original.clone(), stop.clone(), recording.clone());
            std::thread::Builder::new().name("strata-stdin-tee".into()).spawn(move || {
                // Dropped when the thread ends: the attempt's end of input.
                let to_attempt = writer;
                copy_live(&original, &stop, |chunk| {
                    let Some(bytes) = chunk else {
                        lock(&recording).ended = true;
                        return false;
                    };
                    {
                        let mut record = lock(&recording);
                        if !record.over_cap && record.bytes.len().saturating_add(bytes.len()) <= cap {
                            record.bytes.extend_from_slice(bytes);
                        } else {
                            record.over_cap = true;
                        }
                    }
                    // Taken from the stream and recorded: the rerun replays it even if the attempt is gone.
                    write_all_until(&to_attempt, bytes, &stop)
                });
            })?
        };
        Ok((StdinTee { original, stop, thread: Some(thread), recording }, attempt))
    }

    /// Stops teeing once the wasm attempt is over and returns the rerun's stdin: what the attempt took, then the
    /// rest of the caller's stream as it arrives, fed by a thread of its own until the [`StdinReplay`] is dropped.
    /// `None` when the attempt took more than the cap.
    pub fn rerun(mut self) -> io::Result<Option<(StdinStream, StdinReplay)>> {
        self.halt();
        let recording = std::mem::take(&mut *lock(&self.recording));
        if recording.over_cap {
            return Ok(None);
        }
        let (rerun, writer) = StdinStream::pipe()?;
        let stop = Arc::new(AtomicBool::new(false));
        let (original, feeding) = (self.original.clone(), stop.clone());
        std::thread::Builder::new().name("strata-stdin-tee".into()).spawn(move || {
            if !write_all_until(&writer, &recording.bytes, &feeding) || recording.ended {
                return;
            }
            copy_live(&original, &feeding, |chunk| match chunk {
                Some(bytes) => write_all_until(&writer, bytes, &feeding),
                None => false,
            });
        })?;
        Ok(Some((rerun, StdinReplay { stop })))
    }

    /// Stops the tee's thread and waits for it, so every byte it took from the stream is in the recording.
    fn halt(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for StdinTee {
    fn drop(&mut self) {
        // Without waiting: the thread sees the flag within one poll interval.
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// Reads `from` as its bytes arrive and hands each chunk to `to` (`None` at its end, or when reading fails), until
/// `to` returns false, the end, or `stop` is set (looked at every [`TEE_POLL`]).
fn copy_live(from: &StdinStream, stop: &AtomicBool, mut to: impl FnMut(Option<&[u8]>) -> bool) {
    let mut buf = [0u8; TEE_CHUNK];
    while !stop.load(Ordering::Relaxed) {
        match wait_for(from.as_fd(), PollFlags::POLLIN) {
            Ok(false) => continue,
            Ok(true) => {}
            Err(_) => {
                to(None);
                return;
            }
        }
        match nix::unistd::read(from.as_fd(), &mut buf) {
            Ok(0) => {
                to(None);
                return;
            }
            Ok(n) => {
                if !to(Some(&buf[..n.min(buf.len())])) {
                    return;
                }
            }
            Err(Errno::EINTR | Errno::EAGAIN) => {}
            Err(_) => {
                to(None);
                return;
            }
        }
    }
}

/// Writes all of `bytes` into a pipe, never blocking for longer than [`TEE_POLL`] without looking at `stop`;
/// false when stopped or when the pipe's reader is gone.
fn write_all_until(to: &PipeWriter, mut bytes: &[u8], stop: &AtomicBool) -> bool {
    while !bytes.is_empty() {
        if stop.load(Ordering::Relaxed) {
            return false;
        }
        match wait_for(to.as_fd(), PollFlags::POLLOUT) {
            Ok(false) => continue,
            Ok(true) => {}
            Err(_) => return false,
        }
        let chunk = &bytes[..bytes.len().min(TEE_CHUNK)];
        match nix::unistd::write(to, chunk) {
            Ok(n) => bytes = &bytes[n.min(bytes.len())..],
            Err(Errno::EINTR | Errno::EAGAIN) => {}
            // EPIPE: the reader is gone (SIGPIPE is ignored in Rust programs).
            Err(_) => return false,
        }
    }
    true
}

/// Waits up to [`TEE_POLL`] for `events` on `fd`: `Ok(true)` when they came (or the other end hung up, or an
/// error is pending: the next read or write says which), `Ok(false)` when the time passed.
fn wait_for(fd: std::os::fd::BorrowedFd<'_>, events: PollFlags) -> io::Result<bool> {
    let mut fds = [PollFd::new(fd, events)];
    let timeout = PollTimeout::try_from(TEE_POLL).unwrap_or(PollTimeout::MAX);
    match poll(&mut fds, timeout) {
        Ok(0) | Err(Errno::EINTR) => Ok(false),
        Ok(_) => {
            let revents = fds[0].revents().unwrap_or(PollFlags::empty());
            if revents.contains(PollFlags::POLLNVAL) {
                return Err(io::Error::from_raw_os_error(nix::libc::EBADF));
            }
            Ok(true)
        }
        Err(err) => Err(err.into()),
    }
}

/// Why the scratch copies of a job's read-write grants could not be made or committed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ScratchError {
    /// The read-write grants' files are larger than the job's disk limit.
    #[error("the read-write grants hold more than {cap} bytes of files (the disk limit)")]
    TooLarge {
        /// The disk limit, in bytes.
        cap: u64,
    },
    /// A read-write grant holds more than [`MAX_ENTRIES`] entries.
    #[error("read-write grant {} holds more than {MAX_ENTRIES} entries", .0.display())]
    TooManyEntries(PathBuf),
    /// A read-write grant holds something that is not a file, a directory or a symbolic link.
    #[error("{} is not a file, a directory or a symbolic link", .0.display())]
    Unsupported(PathBuf),
    /// A read-write grant's host directory contains, or is inside, another grant's.
    #[error("read-write grant {} overlaps grant {}", rw.display(), other.display())]
    Overlap {
        /// The read-write grant's host directory.
        rw: PathBuf,
        /// The other grant's host directory.
        other: PathBuf,
    },
    /// Making the copies failed.
    #[error("cannot copy {} into scratch: {source}", path.display())]
    Copy {
        /// The host path being copied.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Committing the copy's changes to the host grant failed (what was already moved into place stays).
    #[error("cannot commit the job's writes to {}: {source}", path.display())]
    Commit {
        /// The host path being written.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A host directory on the way to a changed file is now a symbolic link or not a directory: nothing is written
    /// through it.
    #[error("cannot commit the job's writes to {}: a directory on the way is a symbolic link or not a directory", .0.display())]
    NotADirectory(PathBuf),
}

/// One node of a tree, as far as committing needs to tell whether it changed.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Node {
    Dir { mode: u32 },
    // `ctime` changes with every write and cannot be set back by the guest: same inode and ctime, same file.
    File { ino: u64, ctime: (i64, i64), size: u64, mode: u32 },
    Symlink { target: PathBuf },
}

impl Node {
    fn same_kind(&self, other: &Node) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
    }
}

type Tree = BTreeMap<PathBuf, Node>;

/// The copy of one read-write grant.
#[derive(Debug)]
struct ScratchGrant {
    /// Its index in the job's grants.
    index: usize,
    host: PathBuf,
    copy: PathBuf,
    /// The copy as made, before the job.
    baseline: Tree,
}

/// Scratch copies of a job's read-write grants (see the module docs). Dropping it discards them.
#[derive(Debug)]
pub struct ScratchGrants {
    grants: Vec<ScratchGrant>,
    dir: tempfile::TempDir,
}

/// What [`ScratchGrants::commit`] changed on the host.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Committed {
    /// Files and links written.
    pub written: u64,
    /// Directories made.
    pub dirs: u64,
    /// Entries removed (a directory and its contents count one each).
    pub removed: u64,
}

impl ScratchGrants {
    /// Copies every read-write grant of `caps` into a new directory under `parent`; `None` when there is none.
    /// The copies' files may hold `cap` bytes together.
    pub fn prepare(caps: &Capabilities, cap: u64, parent: &Path) -> Result<Option<ScratchGrants>, ScratchError> {
        if !caps.grants.iter().any(|grant| grant.mode == GrantMode::Rw) {
            return Ok(None);
        }
        check_overlaps(caps)?;
        std::fs::create_dir_all(parent).map_err(|source| ScratchError::Copy { path: parent.to_owned(), source })?;
        sweep_stale(parent);
        let dir = tempfile::Builder::new()
            .prefix(&format!("scratch-{}-", std::process::id()))
            .tempdir_in(parent)
            .map_err(|source| ScratchError::Copy { path: parent.to_owned(), source })?;
        let mut budget = Budget { bytes: cap, cap, entries: 0 };
        let mut grants = Vec::new();
        for (index, grant) in caps.grants.iter().enumerate() {
            if grant.mode != GrantMode::Rw {
                continue;
            }
            let copy = dir.path().join(index.to_string());
            // The grant's own path may be a link the user named (as the tiers follow it); nothing below it is.
            let host = std::fs::canonicalize(&grant.host)
                .map_err(|source| ScratchError::Copy { path: grant.host.clone(), source })?;
            if !host.is_dir() {
                return Err(ScratchError::Unsupported(grant.host.clone()));
            }
            budget.entries = 0;
            copy_tree(&host, &copy, &mut budget)?;
            let baseline = walk(&copy).map_err(|source| ScratchError::Copy { path: copy.clone(), source })?;
            grants.push(ScratchGrant { index, host, copy, baseline });
        }
        settle_clock(dir.path()).map_err(|source| ScratchError::Copy { path: dir.path().to_owned(), source })?;
        Ok(Some(ScratchGrants { grants, dir }))
    }

    /// `caps` with each read-write grant's host side replaced by its copy.
    pub fn caps(&self, caps: &Capabilities) -> Capabilities {
        let mut caps = caps.clone();
        for grant in &self.grants {
            if let Some(target) = caps.grants.get_mut(grant.index) {
                target.host = grant.copy.clone();
            }
        }
        caps
    }

    /// The directory holding the copies (removed when `self` is dropped).
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Applies what the job changed in each copy to its host grant, then removes the copies.
    pub fn commit(self) -> Result<Committed, ScratchError> {
        let mut done = Committed::default();
        for grant in &self.grants {
            commit_grant(grant, &mut done)?;
        }
        Ok(done)
    }
}

/// Removes the scratch directories under `parent` of engine processes that are gone (killed before they could
/// remove their own): each is named `scratch-PID-…`.
pub(crate) fn sweep_stale(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix("scratch-")).and_then(|n| n.split('-').next()) else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else { continue };
        if pid != std::process::id() && !Path::new("/proc").join(pid.to_string()).exists() {
            // remove_dir_all never follows a link out of the tree it removes.
            if let Err(err) = std::fs::remove_dir_all(entry.path()) {
                log::warn!("cannot remove stale scratch directory {}: {err}", entry.path().display());
            }
        }
    }
}

fn check_overlaps(caps: &Capabilities) -> Result<(), ScratchError> {
    let canonical = |path: &Path| std::fs::canonicalize(path).unwrap_or_else(|_| path.to_owned());
    for (i, rw) in caps.grants.iter().enumerate().filter(|(_, grant)| grant.mode == GrantMode::Rw) {
        let rw_path = canonical(&rw.host);
        for (j, other) in caps.grants.iter().enumerate() {
            let other_path = canonical(&other.host);
            if i != j && (rw_path.starts_with(&other_path) || other_path.starts_with(&rw_path)) {
                return Err(ScratchError::Overlap { rw: rw.host.clone(), other: other.host.clone() });
            }
        }
    }
    Ok(())
}

/// Waits until the file system's clock, as inode change times show it, has moved past the copies' (one tick of
/// the kernel's coarse clock at most, a few milliseconds): a file the job writes afterwards then has another
/// change time than its baseline, however soon it writes.
fn settle_clock(dir: &Path) -> io::Result<()> {
    let marker = dir.join(".clock");
    std::fs::write(&marker, b"")?;
    let changed_at = |mode: u32| -> io::Result<(i64, i64)> {
        std::fs::set_permissions(&marker, std::fs::Permissions::from_mode(mode))?;
        let meta = std::fs::symlink_metadata(&marker)?;
        Ok((meta.ctime(), meta.ctime_nsec()))
    };
    let first = changed_at(0o600)?;
    for round in 0..1000u32 {
        std::thread::sleep(std::time::Duration::from_millis(1));
        if changed_at(if round % 2 == 0 { 0o644 } else { 0o600 })? != first {
            break;
        }
    }
    std::fs::remove_file(&marker)
}

struct Budget {
    bytes: u64,
    cap: u64,
    entries: u64,
}

/// Copies the tree at `src` to the new path `dst` without following links.
fn copy_tree(src: &Path, dst: &Path, budget: &mut Budget) -> Result<(), ScratchError> {
    let copy_err = |path: &Path| {
        let path = path.to_owned();
        move |source| ScratchError::Copy { path, source }
    };
    budget.entries += 1;
    if budget.entries > MAX_ENTRIES {
        return Err(ScratchError::TooManyEntries(src.to_owned()));
    }
    let meta = std::fs::symlink_metadata(src).map_err(copy_err(src))?;
    let kind = meta.file_type();
    if kind.is_dir() {
        std::fs::create_dir(dst).map_err(copy_err(dst))?;
        let mut names = Vec::new();
        for entry in std::fs::read_dir(src).map_err(copy_err(src))? {
            names.push(entry.map_err(copy_err(src))?.file_name());
        }
        names.sort();
        for name in names {
            copy_tree(&src.join(&name), &dst.join(&name), budget)?;
        }
        std::fs::set_permissions(dst, std::fs::Permissions::from_mode(meta.mode() & 0o7777)).map_err(copy_err(dst))?;
    } else if kind.is_file() {
        budget.bytes = budget.bytes.checked_sub(meta.len()).ok_or(ScratchError::TooLarge { cap: budget.cap })?;
        let mut from = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(OFlag::O_NOFOLLOW.bits())
            .open(src)
            .map_err(copy_err(src))?;
        let mut to =
            std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(dst).map_err(copy_err(dst))?;
        // A file that grew since it was measured still counts against the cap.
        let copied =
            io::copy(&mut io::Read::take(&mut from, budget.bytes + meta.len() + 1), &mut to).map_err(copy_err(dst))?;
        if copied > meta.len() {
            budget.bytes =
                budget.bytes.checked_sub(copied - meta.len()).ok_or(ScratchError::TooLarge { cap: budget.cap })?;
        }
        to.set_permissions(std::fs::Permissions::from_mode(meta.mode() & 0o7777)).map_err(copy_err(dst))?;
    } else if kind.is_symlink() {
        let target = std::fs::read_link(src).map_err(copy_err(src))?;
        std::os::unix::fs::symlink(&target, dst).map_err(copy_err(dst))?;
    } else {
        return Err(ScratchError::Unsupported(src.to_owned()));
    }
    Ok(())
}

/// The tree at `root` (its entries, relative to it), without following links; what is neither a file, a directory
/// nor a link is left out.
fn walk(root: &Path) -> io::Result<Tree> {
    let mut tree = Tree::new();
    let mut pending = vec![PathBuf::new()];
    while let Some(rel) = pending.pop() {
        for entry in std::fs::read_dir(root.join(&rel))? {
            let entry = entry?;
            let child = rel.join(entry.file_name());
            let meta = std::fs::symlink_metadata(root.join(&child))?;
            let kind = meta.file_type();
            let node = if kind.is_dir() {
                pending.push(child.clone());
                Node::Dir { mode: meta.mode() & 0o7777 }
            } else if kind.is_file() {
                Node::File {
                    ino: meta.ino(),
                    ctime: (meta.ctime(), meta.ctime_nsec()),
                    size: meta.len(),
                    mode: meta.mode() & 0o7777,
                }
            } else if kind.is_symlink() {
                Node::Symlink { target: std::fs::read_link(root.join(&child))? }
            } else {
                continue;
            };
            tree.insert(child, node);
        }
    }
    Ok(tree)
}

/// Permission bits committed: set-user-ID and set-group-ID are dropped.
const KEPT_MODE: u32 = 0o1777;

/// A fresh name for a file being moved into place in a host directory.
fn staging_name() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(".strata-commit-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

fn split(rel: &Path) -> (&Path, &OsStr) {
    let name = rel.file_name().unwrap_or_default();
    (rel.parent().unwrap_or(Path::new("")), name)
}

fn commit_grant(grant: &ScratchGrant, done: &mut Committed) -> Result<(), ScratchError> {
    let at = |rel: &Path| grant.host.join(rel);
    let host_err = |rel: &Path, errno: Errno| match errno {
        Errno::ELOOP | Errno::ENOTDIR => ScratchError::NotADirectory(at(rel)),
        other => ScratchError::Commit { path: at(rel), source: io::Error::from(other) },
    };
    let now = walk(&grant.copy).map_err(|source| ScratchError::Copy { path: grant.copy.clone(), source })?;
    let root = nix::fcntl::open(&grant.host, DIR_FLAGS, Mode::empty()).map_err(|e| host_err(Path::new(""), e))?;

    // What the job removed (or replaced by another kind), shallowest first; a removed directory takes its
    // contents with it.
    let mut removed: Vec<&Path> = Vec::new();
    for (rel, old) in &grant.baseline {
        if removed.iter().any(|gone| rel.starts_with(gone)) {
            continue;
        }
        if now.get(rel).is_some_and(|node| node.same_kind(old)) {
            continue;
        }
        let (parent, name) = split(rel);
        let parent = match open_beneath(&root, parent) {
            Ok(fd) => fd,
            // Gone from the host already, or no longer ours to walk through.
            Err(Errno::ENOENT | Errno::ENOTDIR | Errno::ELOOP) => continue,
            Err(e) => return Err(host_err(rel, e)),
        };
        done.removed += remove_at(&parent, name).map_err(|e| host_err(rel, e))?;
        removed.push(rel);
    }

    // What the job created or changed, parents first (the tree is ordered component by component).
    let mut dir_modes = Vec::new();
    for (rel, node) in &now {
        let old = grant.baseline.get(rel);
        if old == Some(node) {
            continue;
        }
        let (parent_rel, name) = split(rel);
        let parent = open_beneath(&root, parent_rel).map_err(|e| host_err(parent_rel, e))?;
        let existing = match fstatat(&parent, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(stat) => Some(kind_of(&stat)),
            Err(Errno::ENOENT) => None,
            Err(e) => return Err(host_err(rel, e)),
        };
        match node {
            Node::Dir { mode } => {
                if existing != Some(SFlag::S_IFDIR) {
                    if existing.is_some() {
                        done.removed += remove_at(&parent, name).map_err(|e| host_err(rel, e))?;
                    }
                    mkdirat(&parent, name, Mode::from_bits_truncate(0o700)).map_err(|e| host_err(rel, e))?;
                    done.dirs += 1;
                }
                dir_modes.push((rel.as_path(), *mode & KEPT_MODE));
            }
            Node::File { mode, .. } => {
                let staged = staging_name();
                let fd = openat(
                    &parent,
                    staged.as_str(),
                    OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_CLOEXEC,
                    Mode::from_bits_truncate(0o600),
                )
                .map_err(|e| host_err(rel, e))?;
                let mut to = File::from(fd);
                let written = copy_file(&grant.copy.join(rel), &mut to)
                    .and_then(|()| fchmod(&to, Mode::from_bits_truncate(*mode & KEPT_MODE)).map_err(io::Error::from));
                drop(to);
                if let Err(source) = written {
                    let _ = unlinkat(&parent, staged.as_str(), UnlinkatFlags::NoRemoveDir);
                    return Err(ScratchError::Commit { path: at(rel), source });
                }
                move_into_place(&parent, &staged, name, existing, done).map_err(|e| host_err(rel, e))?;
                done.written += 1;
            }
            Node::Symlink { target } => {
                let staged = staging_name();
                symlinkat(target.as_path(), &parent, staged.as_str()).map_err(|e| host_err(rel, e))?;
                move_into_place(&parent, &staged, name, existing, done).map_err(|e| host_err(rel, e))?;
                done.written += 1;
            }
        }
    }
    // Modes last, deepest first, so a directory made read-only still received its files.
    for (rel, mode) in dir_modes.into_iter().rev() {
        let dir = open_beneath(&root, rel).map_err(|e| host_err(rel, e))?;
        fchmod(&dir, Mode::from_bits_truncate(mode)).map_err(|e| host_err(rel, e))?;
    }
    Ok(())
}

/// Renames `staged` over `name` in `parent` (a directory in the way is removed first); on failure `staged` goes.
fn move_into_place(
    parent: &OwnedFd,
    staged: &str,
    name: &OsStr,
    existing: Option<SFlag>,
    done: &mut Committed,
) -> Result<(), Errno> {
    let result = (|| {
        if existing == Some(SFlag::S_IFDIR) {
            done.removed += remove_at(parent, name)?;
        }
        renameat(parent, staged, parent, name)
    })();
    if result.is_err() {
        let _ = unlinkat(parent, staged, UnlinkatFlags::NoRemoveDir);
    }
    result
}

/// Copies the scratch file at `path` (opened without following a link) into `to`.
fn copy_file(path: &Path, to: &mut File) -> io::Result<()> {
    let mut from = std::fs::OpenOptions::new().read(true).custom_flags(OFlag::O_NOFOLLOW.bits()).open(path)?;
    io::copy(&mut from, to)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use strata_core::{Grant, TierKind, Truncated, Usage};

    use super::*;

    fn failed(stderr: &str) -> Outcome {
        Outcome {
            tier: TierKind::Wasm,
            status: Status::Exited { code: 1 },
            stdout: Vec::new(),
            stderr: stderr.as_bytes().to_vec(),
            truncated: Truncated::default(),
            usage: Usage::default(),
            escalations: Vec::new(),
            tools: Vec::new(),
            route: None,
            egress: Vec::new(),
        }
    }

    fn traceback(line: &str) -> String {
        format!("Traceback (most recent call last):\n  File \"<string>\", line 1, in <module>\n    import x\n{line}\n")
    }

    fn modules() -> WasmModules {
        WasmModules::new(["json.pyc", "numpy/__init__.pyc", "os.pyc"], ["sys", "_io"])
    }

    fn what(line: &str) -> Option<(EscalationReason, String)> {
        diagnose(&failed(&traceback(line)), Some(&modules())).map(|f| (f.reason, f.what))
    }

    #[test]
    fn a_module_absent_from_wasm_is_a_missing_module() {
        use EscalationReason::MissingModule;
        for line in [
            "ModuleNotFoundError: No module named 'resource'",
            "ModuleNotFoundError: Unsupported platform for standard library module 'resource'",
            "ImportError: No module named 'resource'",
        ] {
            assert_eq!(what(line), Some((MissingModule, "missing module 'resource'".into())), "{line}");
        }
        assert_eq!(
            what("ModuleNotFoundError: Standard library module '_ssl' was not found"),
            Some((MissingModule, "missing module '_ssl'".into()))
        );
        assert_eq!(
            what("ModuleNotFoundError: No module named 'lxml.etree'"),
            Some((MissingModule, "missing module 'lxml.etree'".into()))
        );
    }

    #[test]
    fn a_module_wasm_has_or_a_malformed_name_is_not_a_missing_module() {
        assert_eq!(what("ModuleNotFoundError: No module named 'numpy.nothing'"), None);
        assert_eq!(what("ModuleNotFoundError: No module named 'json'"), None);
        assert_eq!(what("ModuleNotFoundError: No module named 'a b'"), None);
        assert_eq!(what("ModuleNotFoundError: No module named ''"), None);
        assert_eq!(what("ModuleNotFoundError: no quotes"), None);
        // Without the module list, only unsupported calls are recognised.
        let outcome = failed(&traceback("ModuleNotFoundError: No module named 'resource'"));
        assert_eq!(diagnose(&outcome, None), None);
        let outcome = failed(&traceback("RuntimeError: can't start new thread"));
        let call = Some((EscalationReason::UnsupportedCall, "unsupported call: starting a thread".to_owned()));
        assert_eq!(diagnose(&outcome, None).map(|f| (f.reason, f.what)), call);
    }

    #[test]
    fn what_wasi_cannot_do_is_an_unsupported_call() {
        use EscalationReason::UnsupportedCall;
        for (line, expected) in [
            ("OSError: [Errno 58] wasi does not support processes.", "wasi does not support processes (ENOTSUP)"),
            ("OSError: [Errno 58] Not supported", "Not supported (ENOTSUP)"),
            ("OSError: [Errno 52] Function not implemented", "Function not implemented (ENOSYS)"),
            ("OSError: ctypes is unavailable on wasm32-wasi", "ctypes is unavailable on wasm32-wasi"),
            ("RuntimeError: can't start new thread", "starting a thread"),
            ("AttributeError: module 'os' has no attribute 'fork'", "os.fork"),
            (
                "AttributeError: module 'os' has no attribute 'pipe'. Did you mean '.pipe2' instead of '.pipe'?",
                "os.pipe",
            ),
            ("ImportError: cannot import name 'alarm' from 'signal' (unknown location)", "signal.alarm"),
            (
                "NotImplementedError: This Python build lacks multiprocessing.synchronize, usually due to named \
                 semaphores being unavailable on this platform.",
                "This Python build lacks multiprocessing.synchronize, usually due to named semaphores being \
                 unavailable on this platform",
            ),
        ] {
            assert_eq!(what(line), Some((UnsupportedCall, format!("unsupported call: {expected}"))), "{line}");
        }
    }

    #[test]
    fn ordinary_failures_do_not_escalate() {
        for line in [
            "ValueError: x",
            "OSError: [Errno 2] No such file or directory: 'x'",
            "AttributeError: module 'os' has no attribute 'frok'",
            "AttributeError: 'NoneType' object has no attribute 'fork'",
            "RuntimeError: something else",
            "ImportError: cannot import name 'dumps' from 'json'",
            "SyntaxError: invalid syntax",
        ] {
            assert_eq!(what(line), None, "{line}");
        }
        // Only the final traceback counts, and only its exception line (not a chained cause, not a note).
        let chained = format!(
            "{}\nDuring handling of the above exception, another exception occurred:\n\n{}",
            traceback("ModuleNotFoundError: No module named 'resource'"),
            traceback("ValueError: fallback failed")
        );
        assert_eq!(diagnose(&failed(&chained), Some(&modules())), None);
        let fixed = format!("{}ModuleNotFoundError: No module named 'resource'\n", traceback("KeyError: 'k'"));
        assert_eq!(diagnose(&failed(&fixed), Some(&modules())), None);
        // Printed without a traceback, or with another exit status, or cut off: no.
        let line = "ModuleNotFoundError: No module named 'resource'\n";
        assert_eq!(diagnose(&failed(line), Some(&modules())), None);
        let mut outcome = failed(&traceback(line.trim_end()));
        assert!(diagnose(&outcome, Some(&modules())).is_some());
        outcome.status = Status::Exited { code: 2 };
        assert_eq!(diagnose(&outcome, Some(&modules())), None);
        outcome.status = Status::Exited { code: 1 };
        outcome.truncated.stderr = true;
        assert_eq!(diagnose(&outcome, Some(&modules())), None);
    }

    #[test]
    fn the_reason_says_what_the_wasm_attempt_did() {
        let mut outcome = failed(&traceback("ModuleNotFoundError: No module named 'resource'"));
        outcome.usage.wall = std::time::Duration::from_micros(31_500);
        let failure = diagnose(&outcome, Some(&modules())).expect("escalates");
        assert_eq!(
            failure.describe(&outcome),
            "missing module 'resource' (the wasm attempt failed after 31 ms: ModuleNotFoundError: No module named \
             'resource'; its output is discarded)"
        );
        outcome.usage.wall = std::time::Duration::from_millis(2_300);
        assert!(failure.describe(&outcome).contains(" failed after 2.3 s: "), "{}", failure.describe(&outcome));
    }

    #[test]
    fn held_output_passes_on_only_when_released() {
        #[derive(Default)]
        struct Collect(Mutex<Vec<u8>>);
        impl OutputSink for Collect {
            fn output(&self, _: Stream, chunk: &[u8]) {
                self.0.lock().expect("lock").extend_from_slice(chunk);
            }
        }
        let held = HeldOutput::default();
        held.output(Stream::Stdout, b"a");
        held.output(Stream::Stderr, b"b");
        let sink = Collect::default();
        assert!(sink.0.lock().expect("lock").is_empty());
        held.release(&sink);
        assert_eq!(*sink.0.lock().expect("lock"), b"ab");
    }

    struct Fixture {
        root: tempfile::TempDir,
    }

    impl Fixture {
        fn new() -> Fixture {
            let root = tempfile::tempdir().expect("tempdir");
            for dir in ["rw", "rw/sub", "ro", "outside", "scratch"] {
                std::fs::create_dir(root.path().join(dir)).expect("mkdir");
            }
            std::fs::write(root.path().join("rw/keep.txt"), "keep").expect("write");
            std::fs::write(root.path().join("rw/change.txt"), "old").expect("write");
            std::fs::write(root.path().join("rw/delete.txt"), "delete me").expect("write");
            std::fs::write(root.path().join("rw/sub/deep.txt"), "deep").expect("write");
            std::fs::write(root.path().join("outside/secret.txt"), "secret").expect("write");
            std::fs::write(root.path().join("ro/in.txt"), "in").expect("write");
            symlink("../outside", root.path().join("rw/link")).expect("symlink");
            Fixture { root }
        }

        fn path(&self, rel: &str) -> PathBuf {
            self.root.path().join(rel)
        }

        fn caps(&self) -> Capabilities {
            Capabilities {
                grants: vec![
                    Grant::new(self.path("ro"), "/in", GrantMode::Ro).expect("grant"),
                    Grant::new(self.path("rw"), "/out", GrantMode::Rw).expect("grant"),
                ],
                ..Capabilities::default()
            }
        }

        fn scratch_is_empty(&self) -> bool {
            std::fs::read_dir(self.path("scratch")).expect("scratch").next().is_none()
        }
    }

    fn read(path: PathBuf) -> String {
        std::fs::read_to_string(path).expect("read")
    }

    #[test]
    fn no_rw_grant_needs_no_scratch() {
        let fx = Fixture::new();
        let caps = Capabilities { grants: fx.caps().grants[..1].to_vec(), ..Capabilities::default() };
        assert!(ScratchGrants::prepare(&caps, 1 << 20, &fx.path("scratch")).expect("prepare").is_none());
    }

    #[test]
    fn only_rw_grants_are_copied_and_links_stay_links() {
        let fx = Fixture::new();
        let scratch = ScratchGrants::prepare(&fx.caps(), 1 << 20, &fx.path("scratch")).expect("prepare").expect("rw");
        let caps = scratch.caps(&fx.caps());
        assert_eq!(caps.grants[0], fx.caps().grants[0], "the ro grant is used as it is");
        let copy = caps.grants[1].host.clone();
        assert!(copy.starts_with(scratch.path()));
        assert_eq!(read(copy.join("sub/deep.txt")), "deep");
        assert_eq!(std::fs::read_link(copy.join("link")).expect("link"), Path::new("../outside"));
        assert!(!copy.join("secret.txt").exists() && !copy.join("link/secret.txt").exists());
        drop(scratch);
        assert!(fx.scratch_is_empty(), "the copies are removed when dropped");
    }

    #[test]
    fn a_commit_applies_creations_changes_and_deletions_and_nothing_else() {
        let fx = Fixture::new();
        let scratch = ScratchGrants::prepare(&fx.caps(), 1 << 20, &fx.path("scratch")).expect("prepare").expect("rw");
        let copy = scratch.caps(&fx.caps()).grants[1].host.clone();
        std::fs::write(copy.join("change.txt"), "new").expect("change");
        std::fs::write(copy.join("created.txt"), "created").expect("create");
        std::fs::remove_file(copy.join("delete.txt")).expect("delete");
        std::fs::create_dir_all(copy.join("new/dir")).expect("mkdir");
        std::fs::write(copy.join("new/dir/f.txt"), "f").expect("write");
        std::fs::remove_dir_all(copy.join("sub")).expect("rmdir");
        std::fs::write(copy.join("sub"), "a file where a directory was").expect("write");
        symlink("created.txt", copy.join("new-link")).expect("symlink");
        // Meanwhile on the host, a file the job did not touch changes: the commit leaves it alone.
        std::fs::write(fx.path("rw/keep.txt"), "changed on the host").expect("write");
        let done = scratch.commit().expect("commit");
        assert_eq!(read(fx.path("rw/change.txt")), "new");
        assert_eq!(read(fx.path("rw/created.txt")), "created");
        assert!(!fx.path("rw/delete.txt").exists());
        assert_eq!(read(fx.path("rw/new/dir/f.txt")), "f");
        assert_eq!(read(fx.path("rw/sub")), "a file where a directory was");
        assert_eq!(std::fs::read_link(fx.path("rw/new-link")).expect("link"), Path::new("created.txt"));
        assert_eq!(read(fx.path("rw/keep.txt")), "changed on the host");
        assert_eq!(std::fs::read_link(fx.path("rw/link")).expect("link"), Path::new("../outside"));
        assert_eq!(done, Committed { written: 5, dirs: 2, removed: 3 });
        assert!(fx.scratch_is_empty());
        let leftovers: Vec<_> = std::fs::read_dir(fx.path("rw"))
            .expect("rw")
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with(".strata-commit-"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }

    #[test]
    fn a_commit_never_writes_through_a_host_link() {
        let fx = Fixture::new();
        let scratch = ScratchGrants::prepare(&fx.caps(), 1 << 20, &fx.path("scratch")).expect("prepare").expect("rw");
        let copy = scratch.caps(&fx.caps()).grants[1].host.clone();
        // The job makes `link` a directory with a file in it; on the host `link` points outside the grant.
        std::fs::remove_file(copy.join("link")).expect("unlink");
        std::fs::create_dir(copy.join("link")).expect("mkdir");
        std::fs::write(copy.join("link/secret.txt"), "overwritten").expect("write");
        // And writes under `sub`, which the host meanwhile turns into a link to outside.
        std::fs::write(copy.join("sub/deep.txt"), "through").expect("write");
        std::fs::remove_dir_all(fx.path("rw/sub")).expect("rm");
        symlink("../outside", fx.path("rw/sub")).expect("symlink");
        std::fs::write(fx.path("outside/deep.txt"), "untouched").expect("write");
        let err = scratch.commit().expect_err("refused");
        assert!(matches!(err, ScratchError::NotADirectory(_)), "{err}");
        assert_eq!(read(fx.path("outside/secret.txt")), "secret");
        assert_eq!(read(fx.path("outside/deep.txt")), "untouched");
        // The link the job replaced by a directory was replaced on the host too, not followed.
        assert!(fx.path("rw/link").is_dir() && !fx.path("rw/link").is_symlink());
        assert!(fx.scratch_is_empty());
    }

    #[test]
    fn a_grant_named_through_a_link_is_copied_and_committed_as_its_directory() {
        let fx = Fixture::new();
        symlink(fx.path("rw"), fx.path("rw-link")).expect("symlink");
        let caps = Capabilities {
            grants: vec![Grant::new(fx.path("rw-link"), "/out", GrantMode::Rw).expect("grant")],
            ..Capabilities::default()
        };
        let scratch = ScratchGrants::prepare(&caps, 1 << 20, &fx.path("scratch")).expect("prepare").expect("rw");
        let copy = scratch.caps(&caps).grants[0].host.clone();
        assert!(copy.is_dir() && !copy.is_symlink(), "a copy, not a link to the host directory");
        std::fs::write(copy.join("change.txt"), "new").expect("change");
        assert_eq!(read(fx.path("rw/change.txt")), "old");
        scratch.commit().expect("commit");
        assert_eq!(read(fx.path("rw/change.txt")), "new");
    }

    #[test]
    fn a_discarded_scratch_changes_nothing() {
        let fx = Fixture::new();
        let scratch = ScratchGrants::prepare(&fx.caps(), 1 << 20, &fx.path("scratch")).expect("prepare").expect("rw");
        let copy = scratch.caps(&fx.caps()).grants[1].host.clone();
        std::fs::write(copy.join("change.txt"), "new").expect("change");
        std::fs::remove_file(copy.join("delete.txt")).expect("delete");
        drop(scratch);
        assert_eq!(read(fx.path("rw/change.txt")), "old");
        assert_eq!(read(fx.path("rw/delete.txt")), "delete me");
        assert!(fx.scratch_is_empty());
    }

    #[test]
    fn scratch_left_by_a_dead_engine_is_swept() {
        let fx = Fixture::new();
        // No process has PID u32::MAX (Linux PIDs stay below 2^22); this process is alive.
        let stale = fx.path("scratch/scratch-4294967295-abc");
        let live = fx.path(&format!("scratch/scratch-{}-abc", std::process::id()));
        let other = fx.path("scratch/unrelated");
        for dir in [&stale, &live, &other] {
            std::fs::create_dir_all(dir.join("0")).expect("mkdir");
        }
        symlink(fx.path("outside"), stale.join("0/link")).expect("symlink");
        let scratch = ScratchGrants::prepare(&fx.caps(), 1 << 20, &fx.path("scratch")).expect("prepare");
        assert!(!stale.exists() && live.exists() && other.exists());
        assert_eq!(read(fx.path("outside/secret.txt")), "secret");
        drop(scratch);
    }

    #[test]
    fn grants_over_the_disk_limit_or_overlapping_get_no_scratch() {
        let fx = Fixture::new();
        let err = ScratchGrants::prepare(&fx.caps(), 10, &fx.path("scratch")).expect_err("too large");
        assert!(matches!(err, ScratchError::TooLarge { cap: 10 }), "{err}");
        assert!(fx.scratch_is_empty(), "a refused copy leaves nothing");
        let mut caps = fx.caps();
        caps.grants.push(Grant::new(fx.path("rw/sub"), "/sub", GrantMode::Ro).expect("grant"));
        let err = ScratchGrants::prepare(&caps, 1 << 20, &fx.path("scratch")).expect_err("overlap");
        assert!(matches!(err, ScratchError::Overlap { .. }), "{err}");
        // 4 + 3 + 9 + 4 bytes of files fit in 20.
        assert!(ScratchGrants::prepare(&fx.caps(), 20, &fx.path("scratch")).expect("fits").is_some());
    }
}
