//! The interfaces every tier implements: [`Tier`] for one-shot jobs and sandboxes, [`Sandbox`] for a live
//! sandbox that runs several jobs, in turn or at once as its tier allows.

use std::fmt;
use std::io::Read;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;

use crate::caps::Capabilities;
use crate::error::TierError;
use crate::fs::{EntryInfo, Watcher};
use crate::guest_path::GuestPath;
use crate::job::Job;
use crate::limits::Limits;
use crate::outcome::{Outcome, TierKind};
use crate::replay::Determinism;
use crate::snapshot::Snapshot;
use crate::terminal::Terminal;

pub use crate::outcome::Stream;

/// Receives guest output as it is produced, for callers that stream it (the CLI's terminal output, the
/// server's WebSocket). It sees exactly the bytes the [`Outcome`] captures: secrets redacted, nothing past the
/// output limit. It is called on the job's thread, so it must not block; queue and return.
pub trait OutputSink: Send + Sync {
    /// A chunk of output.
    fn output(&self, stream: Stream, chunk: &[u8]);

    /// Whether this sink takes the whole of both streams: the capture then forwards every byte here, beyond the
    /// output limit too, and keeps none (the outcome's stdout and stderr are empty; `usage` still counts the
    /// bytes). For a job that lives as long as a service does, such as a code-interpreter kernel; the sink bounds
    /// what it holds.
    fn takes_all(&self) -> bool {
        false
    }
}

/// Cancels a running job from another thread (a client that went away). Cheap to clone; all clones share one
/// state.
#[derive(Debug, Clone, Default)]
pub struct CancelToken(tokio_util::sync::CancellationToken);

impl CancelToken {
    /// A token that is not cancelled.
    pub fn new() -> CancelToken {
        CancelToken::default()
    }

    /// Cancels every job that holds a clone of this token.
    pub fn cancel(&self) {
        self.0.cancel();
    }

    /// Whether [`cancel`](CancelToken::cancel) was called.
    pub fn is_cancelled(&self) -> bool {
        self.0.is_cancelled()
    }

    /// Completes when the token is cancelled.
    pub async fn cancelled(&self) {
        self.0.cancelled().await
    }
}

/// Per-job options besides the job itself.
#[derive(Clone, Default)]
pub struct ExecOptions {
    /// Limits for this job; the sandbox's limits when `None`.
    pub limits: Option<Limits>,
    /// The bytes this job reads on stdin; `None`: stdin is at its end (the one place a job's stdin is given,
    /// besides the stream below).
    pub stdin: Option<Vec<u8>>,
    /// stdin for this job as a stream the caller writes while the job runs (instead of `stdin`), read by the job as
    /// it arrives, inside the job's limits, on every tier: the process tier gives the descriptor to the job as its
    /// stdin, the others pump it in ([`StdinStream::pump`]). Closing the writer is the job's end of input.
    pub stdin_stream: Option<StdinStream>,
    /// Where output goes as it is produced, besides the [`Outcome`].
    pub sink: Option<Arc<dyn OutputSink>>,
    /// Cancels the job.
    pub cancel: Option<CancelToken>,
    /// Seeded clocks and randomness, or the record or replay of the job's inputs ([`crate::replay`]). Only the
    /// wasm tier's one-shot jobs take it; every other tier and a session's turn refuse it
    /// ([`TierError::Unsupported`]) rather than run the job as if it were not asked for.
    pub determinism: Option<Determinism>,
    /// Run the job on a pseudo-terminal ([`Terminal`]): its stdin, stdout and stderr are one terminal, its output
    /// comes as [`Stream::Stdout`], its input from `stdin_stream` (or `stdin`), and its window follows the
    /// handle's size. The process and microVM tiers make one; the wasm tier answers [`TierError::Unsupported`].
    pub terminal: Option<Terminal>,
    /// Run the job as this account of the sandbox's image instead of the sandbox's user
    /// ([`crate::Capabilities::user`]); `root` is the sandbox's root. Tiers without accounts refuse any other
    /// ([`ExecOptions::refuse_user`]).
    pub user: Option<crate::UserName>,
}

impl fmt::Debug for ExecOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecOptions")
            .field("limits", &self.limits)
            .field("stdin_len", &self.stdin.as_ref().map(Vec::len))
            .field("stdin_stream", &self.stdin_stream)
            .field("sink", &self.sink.is_some())
            .field("cancel", &self.cancel)
            .field("determinism", &self.determinism)
            .field("terminal", &self.terminal)
            .field("user", &self.user)
            .finish()
    }
}

impl ExecOptions {
    /// Refuses [`ExecOptions::terminal`] on a tier that has no terminals.
    pub fn refuse_terminal(&self, tier: TierKind) -> Result<(), TierError> {
        match &self.terminal {
            None => Ok(()),
            Some(_) => Err(TierError::Unsupported {
                tier,
                what: "terminals (a job on a pseudo-terminal runs on the process or microVM tier)".into(),
            }),
        }
    }

    /// Refuses [`ExecOptions::user`] (other than root) on a tier whose guests have no accounts.
    pub fn refuse_user(&self, tier: TierKind) -> Result<(), TierError> {
        crate::caps::refuse_user(self.user.as_ref(), tier)
    }

    /// Refuses [`ExecOptions::determinism`] on a tier that cannot honour it: `tier` cannot make `what`
    /// reproducible.
    pub fn refuse_determinism(&self, tier: TierKind, what: &str) -> Result<(), TierError> {
        match &self.determinism {
            None => Ok(()),
            Some(_) => Err(TierError::Unsupported {
                tier,
                what: format!("seeded, recorded or replayed runs of {what} (only one-shot wasm jobs are reproducible)"),
            }),
        }
    }
}

pub use crate::limits::MAX_BUFFERED_STDIN;

/// A job's stdin as a stream: the read end of a pipe (any readable descriptor) whose writer the caller keeps while
/// the job runs; closing the writer is the job's end of input. Clones share the descriptor.
#[derive(Debug, Clone)]
pub struct StdinStream(Arc<OwnedFd>);

impl StdinStream {
    /// A stream reading from `fd`.
    pub fn new(fd: OwnedFd) -> StdinStream {
        StdinStream(Arc::new(fd))
    }

    /// A pipe: the stream, and the writer that feeds it.
    pub fn pipe() -> std::io::Result<(StdinStream, std::io::PipeWriter)> {
        let (reader, writer) = std::io::pipe()?;
        Ok((StdinStream::new(OwnedFd::from(reader)), writer))
    }

    /// The descriptor.
    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }

    /// Reads the stream on a thread of its own as its bytes arrive, handing each chunk (at most `chunk` bytes,
    /// at least one) to `to`, then its end ([`Pumped::End`], the writer closed) or a read error; `to` returning
    /// `false` stops the pump. This is how a tier that cannot give the descriptor to the job itself streams it
    /// in (the wasm tier's stdin, the microVM agent's `StdinData`, an escalation's tee).
    ///
    /// The thread waits in `poll(2)` on the stream and on the returned [`PumpStop`], so dropping that wakes it
    /// and it ends without reading further: a writer that holds the pipe open keeps no thread past its job. A
    /// pump blocked inside `to` ends once `to` returns; `to` must therefore block only on something the job's
    /// end releases (a channel whose receiver goes with the job, a pipe whose reader does). The descriptor stays
    /// as it is (blocking or not: `O_NONBLOCK` lives on the open file description, which the caller may share).
    pub fn pump(&self, chunk: usize, to: impl FnMut(Pumped<'_>) -> bool + Send + 'static) -> std::io::Result<PumpStop> {
        self.pump_after(Vec::new(), chunk, to)
    }

    /// [`StdinStream::pump`], handing `first` to `to` before anything read from the stream (a prefix the job reads
    /// before its stdin, as a process-tier fork reads its source first).
    pub fn pump_after(
        &self,
        first: Vec<u8>,
        chunk: usize,
        mut to: impl FnMut(Pumped<'_>) -> bool + Send + 'static,
    ) -> std::io::Result<PumpStop> {
        let (stop, wake) = std::io::pipe()?;
        let fd = Arc::clone(&self.0);
        let mut buf = vec![0u8; chunk.max(1)];
        std::thread::Builder::new().name("strata-stdin".into()).spawn(move || {
            if !first.is_empty() && !to(Pumped::Data(&first)) {
                return;
            }
            loop {
                match wait_readable(fd.as_fd(), stop.as_fd()) {
                    Ok(true) => {}
                    Ok(false) => return,
                    Err(err) => {
                        to(Pumped::Failed(err));
                        return;
                    }
                }
                match nix::unistd::read(fd.as_fd(), &mut buf) {
                    Ok(0) => {
                        to(Pumped::End);
                        return;
                    }
                    Ok(n) => {
                        if !to(Pumped::Data(&buf[..n.min(buf.len())])) {
                            return;
                        }
                    }
                    Err(nix::errno::Errno::EINTR | nix::errno::Errno::EAGAIN) => {}
                    Err(err) => {
                        to(Pumped::Failed(err.into()));
                        return;
                    }
                }
            }
        })?;
        Ok(PumpStop { _wake: wake })
    }

    /// Everything until the writer closes; more than `cap` bytes is an error.
    pub fn read_to_end(&self, cap: usize) -> Result<Vec<u8>, TierError> {
        let read_err = |source| TierError::ReadInput { path: "stdin stream".into(), source };
        let file = std::fs::File::from(self.0.try_clone().map_err(read_err)?);
        let mut data = Vec::new();
        file.take(cap as u64 + 1).read_to_end(&mut data).map_err(read_err)?;
        if data.len() > cap {
            return Err(read_err(std::io::Error::new(
                std::io::ErrorKind::FileTooLarge,
                format!("more than {cap} bytes (the most read into memory at once)"),
            )));
        }
        Ok(data)
    }
}

/// What a [`StdinStream::pump`] hands on.
#[derive(Debug)]
pub enum Pumped<'a> {
    /// Bytes that arrived.
    Data(&'a [u8]),
    /// The writer closed the stream: end of input.
    End,
    /// Reading failed; nothing more comes.
    Failed(std::io::Error),
}

/// Stops a [`StdinStream::pump`] when dropped (its thread wakes and ends without reading more).
#[derive(Debug)]
pub struct PumpStop {
    _wake: std::io::PipeWriter,
}

/// Waits until `fd` can be read without blocking (data, its end or an error) or `stop`'s writer is closed:
/// `Ok(true)` for the first, `Ok(false)` for the second.
fn wait_readable(fd: BorrowedFd<'_>, stop: BorrowedFd<'_>) -> std::io::Result<bool> {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    loop {
        let mut fds = [PollFd::new(fd, PollFlags::POLLIN), PollFd::new(stop, PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(err) => return Err(err.into()),
        }
        let [stream, stop] = fds.map(|fd| fd.revents().unwrap_or(PollFlags::empty()));
        if !stop.is_empty() {
            return Ok(false);
        }
        if stream.contains(PollFlags::POLLNVAL) {
            return Err(std::io::Error::from_raw_os_error(nix::libc::EBADF));
        }
        if !stream.is_empty() {
            return Ok(true);
        }
    }
}

/// What a live sandbox uses now ([`Sandbox::usage`]): the numbers a dashboard samples over time (the rate of CPU
/// use is the difference of two samples' `cpu_time`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct SandboxUsage {
    /// CPUs its jobs may use at once.
    pub cpu_count: u32,
    /// CPU time all its processes have used since it started.
    pub cpu_time: std::time::Duration,
    /// Memory charged to it now, in bytes (the page cache of its files included).
    pub memory_used: u64,
    /// Of that, page cache.
    pub memory_cache: u64,
    /// Its memory limit.
    pub memory_total: u64,
    /// Bytes its writable filesystem holds.
    pub disk_used: u64,
    /// The size of its writable filesystem.
    pub disk_total: u64,
}

/// A connection to a port a sandbox serves ([`Sandbox::connect_port`]): bytes both ways, as the server wrote them.
#[derive(Debug)]
pub enum PortStream {
    /// A TCP connection to the sandbox's loopback.
    Tcp(std::net::TcpStream),
    /// A stream a guest agent relays to its TCP connection.
    Unix(std::os::unix::net::UnixStream),
}

/// A way to run jobs: wasm, process or microVM.
pub trait Tier: Send + Sync {
    /// Which tier this is.
    fn kind(&self) -> TierKind;

    /// Runs one job to completion in a fresh sandbox that is gone afterwards.
    ///
    /// `Err` means the job could not be started (bad input, missing grant, unsupported request); a job that
    /// started and then failed, trapped or hit a limit is an `Ok` [`Outcome`] saying so.
    fn run(&self, job: &Job, caps: &Capabilities, limits: &Limits, opts: ExecOptions) -> Result<Outcome, TierError>;

    /// Starts a sandbox that keeps its capabilities and state across several [`Sandbox::exec`] calls.
    fn start(&self, caps: &Capabilities, limits: &Limits) -> Result<Box<dyn Sandbox>, TierError>;

    /// Starts a sandbox from a snapshot of this tier ([`Sandbox::snapshot`]), opened by a [`crate::SnapshotTrust`]:
    /// the tier re-opens it with its own ([`crate::SnapshotTrust::reopen`]) before it takes anything from it.
    ///
    /// The fork starts from exactly the snapshot's state ([`crate::snapshot::Manifest::persists`] says which
    /// state a tier keeps) and is independent: its writes, to memory or files, are invisible to the snapshot, to
    /// the sandbox it was taken from and to every other fork. Each fork gets fresh randomness (no two forks read
    /// the same `os.urandom` bytes) and its own identity, and its clock moves forward from the snapshot's, never
    /// back. Forks share the snapshot's unchanged memory copy-on-write where the tier can (wasm and microVM
    /// memory images are mapped private; the process tier's live forks are `fork()`s of a zygote).
    fn fork(&self, snapshot: &Snapshot) -> Result<Box<dyn Sandbox>, TierError> {
        let _ = snapshot;
        Err(TierError::Unsupported { tier: self.kind(), what: "forking snapshots".into() })
    }
}

/// A live sandbox: several jobs and file calls against one set of capabilities and limits, whose state (files,
/// an interpreter, processes left running) lasts from one job to the next. Dropping it releases everything it
/// holds, as [`close`](Sandbox::close) does.
///
/// Every method takes `&self` and may be called from any thread. What may run at the same time is the tier's:
/// a call the sandbox cannot take beside what it is doing answers [`TierError::Busy`] at once (it never waits for
/// the other call to end). The process tier runs any number of jobs and file calls at once, each job metered
/// and limited on its own inside the sandbox's limits; the wasm tier runs WASI commands and file calls beside
/// each other and one Python turn at a time (its one interpreter); the microVM tier runs one job at a time, with
/// file calls beside it. A snapshot is taken between jobs only.
pub trait Sandbox: Send + Sync {
    /// The tier it runs on.
    fn tier(&self) -> TierKind;

    /// Runs a job inside the sandbox. Its limits are `opts.limits`, else the sandbox's.
    fn exec(&self, job: &Job, opts: ExecOptions) -> Result<Outcome, TierError>;

    /// Writes a file at a guest path (a read-write grant's, or the sandbox's own filesystem where it has one).
    fn write_file(&self, guest_path: &str, contents: &[u8]) -> Result<(), TierError>;

    /// Reads a file at a guest path.
    fn read_file(&self, guest_path: &str) -> Result<Vec<u8>, TierError>;

    /// Saves the sandbox's complete state, between jobs, into a new snapshot directory at `destination` (written
    /// atomically by a [`crate::SnapshotWriter`]; it must not exist). The sandbox goes on running afterwards.
    /// See [`Tier::fork`] for what a fork of it gets.
    fn snapshot(&self, destination: &Path) -> Result<Snapshot, TierError> {
        let _ = destination;
        Err(TierError::Unsupported { tier: self.tier(), what: "snapshots".into() })
    }

    /// Lists the directory at `path`: its entries, and theirs down to `depth` levels (1: the directory's own
    /// entries). Links are listed, not followed. At most [`crate::fs::MAX_LIST_ENTRIES`] entries.
    fn list_dir(&self, path: &GuestPath, depth: u32) -> Result<Vec<EntryInfo>, TierError>;

    /// Describes the file or directory at `path` (a link itself, not its target).
    fn stat(&self, path: &GuestPath) -> Result<EntryInfo, TierError>;

    /// Makes the directory `path` and any missing parents; `false` when it already existed.
    fn make_dir(&self, path: &GuestPath) -> Result<bool, TierError>;

    /// Moves `from` to `to` (replacing a file there) and describes it at its new path.
    fn rename(&self, from: &GuestPath, to: &GuestPath) -> Result<EntryInfo, TierError>;

    /// Removes the file or link at `path`, or the directory and everything in it.
    fn remove(&self, path: &GuestPath) -> Result<(), TierError>;

    /// Watches the directory `path` (and, when `recursive`, every directory below it, including those made
    /// later): creates, writes, permission changes, renames and removals arrive on the [`Watcher`] as they
    /// happen, however short-lived the file. Dropping the watcher ends the watch.
    fn watch(&self, path: &GuestPath, recursive: bool) -> Result<Watcher, TierError>;

    /// Opens a connection to `port` on the sandbox's own loopback (`127.0.0.1`), where its jobs listen: how a server
    /// reaches a port a sandbox serves (the process tier: a TCP socket in the jail's network namespace; the microVM:
    /// a stream the guest agent relays to its TCP connection). [`TierError::PortClosed`] when nothing accepts there;
    /// tiers without a network of their own answer [`TierError::Unsupported`].
    fn connect_port(&self, port: u16) -> Result<PortStream, TierError> {
        let _ = port;
        Err(TierError::Unsupported {
            tier: self.tier(),
            what: "ports (connections to a port the sandbox serves)".into(),
        })
    }

    /// Puts `net` in force for the connections the sandbox's jobs make from now on (connections already made go
    /// on): the process tier replaces its egress proxy's allowlist. Tiers that cannot answer
    /// [`TierError::Unsupported`].
    fn set_network(&self, net: &crate::Net) -> Result<(), TierError> {
        let _ = net;
        Err(TierError::Unsupported { tier: self.tier(), what: "changing the network of a running sandbox".into() })
    }

    /// What the sandbox uses now: CPU time, memory and disk ([`SandboxUsage`]). Tiers that cannot measure it
    /// answer [`TierError::Unsupported`].
    fn usage(&self) -> Result<SandboxUsage, TierError> {
        Err(TierError::Unsupported { tier: self.tier(), what: "usage metrics".into() })
    }

    /// Starts the sandbox's service ([`crate::service`]): `spec.command`, run by `/bin/sh -c` as the sandbox's
    /// jobs run, supervised by the sandbox's init until the sandbox closes, which stops it gracefully first. One
    /// per sandbox: a second is [`TierError::Busy`]. Answers once it has been started (a command that cannot be
    /// started at all is an error; one that fails later shows in [`Sandbox::service`]). Tiers without one answer
    /// [`TierError::Unsupported`].
    fn start_service(&self, spec: &crate::ServiceSpec) -> Result<(), TierError> {
        let _ = spec;
        Err(TierError::Unsupported { tier: self.tier(), what: "services (a supervised start command)".into() })
    }

    /// The sandbox's service as it is now; `None` when it has none (or its tier has no services).
    fn service(&self) -> Result<Option<crate::ServiceStatus>, TierError> {
        Ok(None)
    }

    /// Shuts the sandbox down and releases its resources; idempotent. Its service, if it has one, is stopped
    /// first, gracefully ([`crate::ServiceSpec::stop_grace`]). Jobs still running are stopped (cancel them
    /// through their [`CancelToken`]s first to have them end as cancelled); every later call answers
    /// [`TierError::SessionEnded`].
    fn close(&self) -> Result<(), TierError>;

    /// Runs `job` as the sandbox's last, then closes it: [`Sandbox::exec`] then [`Sandbox::close`], the job's
    /// error first. Nothing uses the sandbox's state again, so a tier may end the job as a program ends instead
    /// of tearing the state down at close: the wasm tier runs a Python interpreter's `atexit` handlers and
    /// flushes its streams inside the job (their output is in its outcome) and never finalises it.
    fn exec_and_close(&self, job: &Job, opts: ExecOptions) -> Result<Outcome, TierError> {
        let outcome = self.exec(job, opts);
        let closed = self.close();
        let outcome = outcome?;
        closed?;
        Ok(outcome)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

    use std::io::Write;

    use super::*;

    #[test]
    fn a_stream_is_read_to_its_end_and_refused_past_the_cap() {
        let (stream, mut writer) = StdinStream::pipe().unwrap();
        writer.write_all(b"hello").unwrap();
        drop(writer);
        assert_eq!(stream.read_to_end(5).unwrap(), b"hello");

        let (stream, mut writer) = StdinStream::pipe().unwrap();
        writer.write_all(b"12345").unwrap();
        drop(writer);
        let err = stream.read_to_end(4).unwrap_err();
        assert!(matches!(err, TierError::ReadInput { .. }) && err.to_string().contains("more than 4 bytes"), "{err}");
    }

    /// What a pump hands on, as text: `data` chunks, then `end` or `failed`.
    fn pumped(stream: &StdinStream) -> (PumpStop, std::sync::mpsc::Receiver<String>) {
        let (tx, rx) = std::sync::mpsc::channel();
        let stop = stream
            .pump(64, move |pumped| {
                let text = match pumped {
                    Pumped::Data(data) => String::from_utf8_lossy(data).into_owned(),
                    Pumped::End => "end".into(),
                    Pumped::Failed(err) => format!("failed: {err}"),
                };
                tx.send(text).is_ok()
            })
            .unwrap();
        (stop, rx)
    }

    #[test]
    fn a_pump_hands_on_each_write_as_it_comes_then_the_end() {
        let (stream, mut writer) = StdinStream::pipe().unwrap();
        let (_stop, rx) = pumped(&stream);
        let wait = std::time::Duration::from_secs(10);
        writer.write_all(b"one\n").unwrap();
        assert_eq!(rx.recv_timeout(wait).unwrap(), "one\n");
        writer.write_all(b"two\n").unwrap();
        assert_eq!(rx.recv_timeout(wait).unwrap(), "two\n");
        drop(writer);
        assert_eq!(rx.recv_timeout(wait).unwrap(), "end");
        assert!(rx.recv_timeout(wait).is_err(), "the pump's thread ended");
    }

    #[test]
    fn a_stopped_pump_ends_while_the_writer_holds_the_stream_open() {
        let (stream, mut writer) = StdinStream::pipe().unwrap();
        let (stop, rx) = pumped(&stream);
        drop(stop);
        // The thread ends (dropping its sender) without waiting for the writer, and reads nothing more.
        let ended = rx.recv_timeout(std::time::Duration::from_secs(10));
        assert!(matches!(ended, Err(std::sync::mpsc::RecvTimeoutError::Disconnected)), "{ended:?}");
        writer.write_all(b"late").unwrap();
        let mut left = [0u8; 8];
        let n = nix::unistd::read(stream.as_fd(), &mut left).unwrap();
        assert_eq!(&left[..n], b"late", "the stopped pump left the stream's bytes unread");
    }
}
