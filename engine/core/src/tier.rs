//! The interfaces every tier implements: [`Tier`] for one-shot jobs and sandboxes, [`Sandbox`] for a live
//! sandbox that runs several jobs in turn.

use std::fmt;
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
            .field("sink", &self.sink.is_some())
            .field("cancel", &self.cancel)
            .finish()
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

    /// Starts a sandbox from a snapshot of this tier ([`Sandbox::snapshot`]), verified by [`Snapshot::open`].
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

    /// Shuts the sandbox down and releases its resources.
    fn close(self: Box<Self>) -> Result<(), TierError>;
}
