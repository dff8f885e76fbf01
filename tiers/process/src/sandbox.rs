//! A live jail that runs several jobs in turn: its filesystem (the overlay's upper layer) persists between them.

use std::path::Path;
use std::sync::Arc;

use strata_core::{
    Capabilities, ExecOptions, Job, Limits, Outcome, Sandbox, SandboxHandle, Snapshot, TierError, TierKind,
};

use crate::jail::{Jail, JailError, Lanes};
use crate::{PreparedJob, Runner, jail_error, run_in};

/// The most `read_file` returns.
const MAX_READ: u64 = 256 * 1024 * 1024;

/// A process-tier sandbox (from [`ProcessTier::start`](crate::ProcessTier)).
#[derive(Debug)]
pub struct ProcessSandbox {
    jail: Option<Jail>,
    caps: Capabilities,
    limits: Limits,
    /// What its snapshots record and are sealed with.
    origin: crate::snapshot::Origin,
}

impl ProcessSandbox {
    pub(crate) fn new(
        jail: Jail,
        caps: Capabilities,
        limits: Limits,
        origin: crate::snapshot::Origin,
    ) -> ProcessSandbox {
        ProcessSandbox { jail: Some(jail), caps, limits, origin }
    }

    /// The id of the snapshot this sandbox was forked from, if it was.
    pub fn parent(&self) -> Option<&str> {
        self.origin.parent.as_deref()
    }

    pub(crate) fn jail(&mut self) -> Result<&mut Jail, TierError> {
        match &mut self.jail {
            Some(jail) if !jail.has_ended() => Ok(jail),
            _ => Err(TierError::SessionEnded { reason: "the sandbox's jail has ended".into() }),
        }
    }
}

fn guest_path(path: &str) -> Result<&str, TierError> {
    if !path.starts_with('/') || path.split('/').any(|c| c == "..") || path.contains('\0') {
        return Err(TierError::GuestPath { path: path.to_owned(), reason: "must be absolute, without `..`".into() });
    }
    Ok(path)
}

fn file_error(path: &str, err: JailError) -> TierError {
    match err {
        JailError::File { message, .. } => TierError::GuestPath { path: path.to_owned(), reason: message },
        other => jail_error(other),
    }
}

impl Sandbox for ProcessSandbox {
    fn tier(&self) -> TierKind {
        TierKind::Process
    }

    fn exec(&mut self, job: &Job, opts: ExecOptions) -> Result<Outcome, TierError> {
        let limits = opts.limits.clone().unwrap_or_else(|| self.limits.clone());
        let prepared = PreparedJob::new(job, &self.caps, &limits)?;
        let stdin = opts.stdin.clone().unwrap_or_else(|| self.caps.stdin.clone());
        let caps = self.caps.clone();
        let jail = self.jail()?;
        run_in(Runner::Jail(jail), prepared, &caps, &limits, &stdin, &opts)
    }

    /// Jobs and file operations on lanes of the jail: each job in a child cgroup of the sandbox's, with its own
    /// limits (the job's, else the sandbox's) inside the sandbox's. See [`Lanes`].
    fn handle(&mut self) -> Option<Arc<dyn SandboxHandle>> {
        let (caps, limits) = (self.caps.clone(), self.limits.clone());
        let lanes = self.jail().ok()?.lanes().ok()?;
        Some(Arc::new(ProcessHandle { lanes, caps, limits }))
    }

    fn write_file(&mut self, path: &str, contents: &[u8]) -> Result<(), TierError> {
        let path = guest_path(path)?;
        self.jail()?.write_file(path, contents, 0o644).map_err(|e| file_error(path, e))
    }

    fn read_file(&mut self, path: &str) -> Result<Vec<u8>, TierError> {
        let path = guest_path(path)?;
        self.jail()?.read_file(path, MAX_READ).map_err(|e| file_error(path, e))
    }

    fn snapshot(&mut self, destination: &Path) -> Result<Snapshot, TierError> {
        let (caps, limits, origin) = (self.caps.clone(), self.limits.clone(), self.origin.clone());
        crate::snapshot::take(self.jail()?, destination, &caps, &limits, &origin)
    }

    fn close(mut self: Box<Self>) -> Result<(), TierError> {
        if let Some(jail) = self.jail.take() {
            jail.close();
        }
        Ok(())
    }
}

/// A process sandbox's [`SandboxHandle`]: its jobs run on lanes of the jail.
struct ProcessHandle {
    lanes: Arc<Lanes>,
    caps: Capabilities,
    limits: Limits,
}

impl SandboxHandle for ProcessHandle {
    fn exec(&self, job: &Job, opts: ExecOptions) -> Result<Outcome, TierError> {
        let limits = opts.limits.clone().unwrap_or_else(|| self.limits.clone());
        let prepared = PreparedJob::new(job, &self.caps, &limits)?;
        let stdin = opts.stdin.clone().unwrap_or_else(|| self.caps.stdin.clone());
        run_in(Runner::Lane(&self.lanes), prepared, &self.caps, &limits, &stdin, &opts)
    }

    fn write_file(&self, path: &str, contents: &[u8]) -> Result<(), TierError> {
        let path = guest_path(path)?;
        self.lanes.write_file(path, contents, 0o644).map_err(|e| file_error(path, e))
    }

    fn read_file(&self, path: &str) -> Result<Vec<u8>, TierError> {
        let path = guest_path(path)?;
        self.lanes.read_file(path, MAX_READ).map_err(|e| file_error(path, e))
    }
}
