//! The interfaces every tier implements: [`Tier`] for one-shot jobs and sandboxes, [`Sandbox`] for a live
//! sandbox that runs several jobs in turn.

use std::fmt;
use std::io::Read;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;

use crate::caps::Capabilities;
use crate::error::TierError;
use crate::job::Job;
use crate::limits::Limits;
use crate::outcome::{Outcome, TierKind};
use crate::snapshot::Snapshot;

/// Which output stream a chunk came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// Receives guest output as it is produced, for callers that stream it (the CLI's terminal output, the
/// server's WebSocket). It sees exactly the bytes the [`Outcome`] captures: secrets redacted, nothing past the
/// output limit. It is called on the job's thread, so it must not block; queue and return.
pub trait OutputSink: Send + Sync {
    /// A chunk of output.
    fn output(&self, stream: Stream, chunk: &[u8]);
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
    /// stdin for this job; the capabilities' stdin when `None`.
    pub stdin: Option<Vec<u8>>,
    /// stdin for this job as a stream the caller writes while the job runs (instead of `stdin`): the process tier
    /// gives it to the job as its stdin; the tiers that start a job with all of its stdin read it to its end first
    /// ([`ExecOptions::buffered`]).
    pub stdin_stream: Option<StdinStream>,
    /// Where output goes as it is produced, besides the [`Outcome`].
    pub sink: Option<Arc<dyn OutputSink>>,
    /// Cancels the job.
    pub cancel: Option<CancelToken>,
}

impl fmt::Debug for ExecOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecOptions")
            .field("limits", &self.limits)
            .field("stdin_len", &self.stdin.as_ref().map(Vec::len))
            .field("stdin_stream", &self.stdin_stream)
            .field("sink", &self.sink.is_some())
            .field("cancel", &self.cancel)
            .finish()
    }
}

impl ExecOptions {
    /// These options with `stdin_stream`, if any, read to its end into `stdin` (at most [`MAX_BUFFERED_STDIN`]
    /// bytes): what a tier that starts a job with all of its stdin calls first.
    pub fn buffered(mut self) -> Result<ExecOptions, TierError> {
        if let Some(stream) = self.stdin_stream.take() {
            self.stdin = Some(stream.read_to_end(MAX_BUFFERED_STDIN)?);
        }
        Ok(self)
    }
}

/// The most stdin a tier without streamed stdin takes from a [`StdinStream`].
pub const MAX_BUFFERED_STDIN: usize = 64 << 20;

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

    /// Everything until the writer closes; more than `cap` bytes is an error.
    pub fn read_to_end(&self, cap: usize) -> Result<Vec<u8>, TierError> {
        let read_err = |source| TierError::ReadInput { path: "stdin stream".into(), source };
        let file = std::fs::File::from(self.0.try_clone().map_err(read_err)?);
        let mut data = Vec::new();
        file.take(cap as u64 + 1).read_to_end(&mut data).map_err(read_err)?;
        if data.len() > cap {
            return Err(read_err(std::io::Error::new(
                std::io::ErrorKind::FileTooLarge,
                format!("more than {cap} bytes (the most this tier takes before a job starts)"),
            )));
        }
        Ok(data)
    }
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

/// A live sandbox. Dropping it releases everything it holds, as [`close`](Sandbox::close) does.
pub trait Sandbox: Send {
    /// The tier it runs on.
    fn tier(&self) -> TierKind;

    /// Runs a job inside the sandbox.
    fn exec(&mut self, job: &Job, opts: ExecOptions) -> Result<Outcome, TierError>;

    /// Writes a file at a guest path (inside a read-write grant).
    fn write_file(&mut self, guest_path: &str, contents: &[u8]) -> Result<(), TierError>;

    /// Reads a file at a guest path (inside a grant).
    fn read_file(&mut self, guest_path: &str) -> Result<Vec<u8>, TierError>;

    /// Saves the sandbox's complete state, between jobs, into a new snapshot directory at `destination` (written
    /// atomically by a [`crate::SnapshotWriter`]; it must not exist). The sandbox goes on running afterwards.
    /// See [`Tier::fork`] for what a fork of it gets.
    fn snapshot(&mut self, destination: &Path) -> Result<Snapshot, TierError> {
        let _ = destination;
        Err(TierError::Unsupported { tier: self.tier(), what: "snapshots".into() })
    }

    /// A handle that runs jobs and file operations in this sandbox at the same time as each other and as this
    /// sandbox's own calls, from any thread; `None` where the tier runs one job at a time. Each job a handle runs
    /// is metered and limited on its own (its CPU time, memory and limits are its own), while the sandbox's
    /// limits bound all of them together. Stopping a job the sandbox's own [`exec`](Sandbox::exec) runs (a limit, a
    /// cancel) leaves the handle's jobs running. The handle stops working when the sandbox is closed.
    fn handle(&mut self) -> Option<Arc<dyn SandboxHandle>> {
        None
    }

    /// Shuts the sandbox down and releases its resources.
    fn close(self: Box<Self>) -> Result<(), TierError>;
}

/// Jobs and file operations on a live sandbox that run concurrently (from [`Sandbox::handle`]).
pub trait SandboxHandle: Send + Sync {
    /// Runs a job inside the sandbox, beside any others running there.
    fn exec(&self, job: &Job, opts: ExecOptions) -> Result<Outcome, TierError>;

    /// Writes a file at a guest path.
    fn write_file(&self, guest_path: &str, contents: &[u8]) -> Result<(), TierError>;

    /// Reads a file at a guest path.
    fn read_file(&self, guest_path: &str) -> Result<Vec<u8>, TierError>;
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

    use std::io::Write;

    use super::*;

    #[test]
    fn a_stream_is_buffered_to_its_end_and_refused_past_the_cap() {
        let (stream, mut writer) = StdinStream::pipe().unwrap();
        writer.write_all(b"hello").unwrap();
        drop(writer);
        let opts = ExecOptions { stdin_stream: Some(stream), ..ExecOptions::default() }.buffered().unwrap();
        assert_eq!((opts.stdin.as_deref(), opts.stdin_stream.is_none()), (Some(&b"hello"[..]), true));
        assert!(ExecOptions::default().buffered().unwrap().stdin.is_none());

        let (stream, mut writer) = StdinStream::pipe().unwrap();
        writer.write_all(b"12345").unwrap();
        drop(writer);
        let err = stream.read_to_end(4).unwrap_err();
        assert!(matches!(err, TierError::ReadInput { .. }) && err.to_string().contains("more than 4 bytes"), "{err}");
    }
}
