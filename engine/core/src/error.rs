//! Why a tier could not run a job at all (as opposed to a job that ran and failed, which is an
//! [`Outcome`](crate::Outcome)).

use std::path::PathBuf;

use crate::caps::CapsError;
use crate::job::JobKind;
use crate::outcome::TierKind;

/// A job or sandbox request that a tier refused or could not carry out.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TierError {
    /// The job's input file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    ReadInput {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The input is not what the job says it is (e.g. a `.wasm` file without the wasm magic).
    #[error("{what} is not {expected}")]
    WrongFormat {
        /// The input, as the user named it.
        what: String,
        /// What it should have been.
        expected: &'static str,
    },
    /// A WebAssembly module that fails to validate or compile.
    #[error("invalid WebAssembly module {name}: {reason}")]
    InvalidModule {
        /// The module's name.
        name: String,
        /// The validator's or compiler's message.
        reason: String,
    },
    /// A module imports something the tier does not provide.
    #[error("module {name} imports {import}, which Strata does not provide")]
    UnknownImport {
        /// The module's name.
        name: String,
        /// `module::field` of the import.
        import: String,
    },
    /// A capability is malformed or its host side is missing.
    #[error(transparent)]
    Capability(#[from] CapsError),
    /// The tier cannot do what the job asks (yet, or on this host).
    #[error("the {tier} tier does not support {what}")]
    Unsupported {
        /// The tier.
        tier: TierKind,
        /// What it cannot do.
        what: String,
    },
    /// A job a session cannot run where it lives: a session is one interpreter on one tier for its whole life, so
    /// a job that needs another tier fails with the reason and the tier that would run it (never runs elsewhere).
    #[error(
        "this session runs on the {session} tier for its whole life, and this job needs the {needs} tier ({reason}); \
         start the session on the {needs} tier to run it"
    )]
    SessionTier {
        /// Where the session lives.
        session: TierKind,
        /// The tier that would run the job.
        needs: TierKind,
        /// Why, as the router says it.
        reason: String,
    },
    /// The job kind is not one this tier runs.
    #[error("the {tier} tier cannot run {job} jobs")]
    WrongJob {
        /// The tier.
        tier: TierKind,
        /// The job kind.
        job: JobKind,
    },
    /// The job was cancelled through its [`CancelToken`](crate::CancelToken) before it finished.
    #[error("job cancelled")]
    Cancelled,
    /// Nothing in the sandbox accepts connections on this port of its loopback.
    #[error("nothing in the sandbox accepts connections on port {port}: {reason}")]
    PortClosed {
        /// The port.
        port: u16,
        /// What connecting said.
        reason: String,
    },
    /// Every slot of the tier is busy; retry later or raise its capacity.
    #[error("the {tier} tier is at capacity: {reason}")]
    Capacity {
        /// The tier.
        tier: TierKind,
        /// Which resource ran out.
        reason: String,
    },
    /// A file of Strata's own cache or state could not be used.
    #[error("{what} {}: {source}", path.display())]
    Storage {
        /// What the file is for.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A guest path for `read_file`/`write_file` outside every grant, or in a read-only one.
    #[error("guest path {path}: {reason}")]
    GuestPath {
        /// The guest path.
        path: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// The sandbox is doing something that cannot share it with this call (a tier that runs one job at a time
    /// while a job runs, a snapshot while a job runs, a job while a snapshot is taken); retry when it is done.
    #[error("the {tier} sandbox is busy: {doing}")]
    Busy {
        /// The tier.
        tier: TierKind,
        /// What it is busy with.
        doing: &'static str,
    },
    /// A sandbox session that ended (a trap, a limit, `exit()`, or `close`) was asked to run more.
    #[error("the session has ended: {reason}")]
    SessionEnded {
        /// What ended it.
        reason: String,
    },
    /// A runtime artifact (e.g. the Python runtime) could not be installed or verified.
    #[error("{0}")]
    Artifact(String),
    /// A tool named in the capabilities is unknown, or a tool definition is invalid.
    #[error(transparent)]
    Tool(#[from] crate::tools::ToolDefinitionError),
    /// The program of a native job or command does not exist in the guest (`command not found`).
    #[error("{program}")]
    ProgramNotFound {
        /// The program and why it was not found.
        program: String,
    },
    /// The image the capabilities name is not in the host's image store.
    #[error(
        "no image named {image:?} (`strata images list` shows the images; `strata images build` or `import` makes one)"
    )]
    ImageNotFound {
        /// The name.
        image: String,
    },
    /// The program exists but could not be executed (not executable, wrong format).
    #[error("cannot execute {message}")]
    ExecFailed {
        /// The program and the error.
        message: String,
    },
    /// A recording could not be made, read or replayed.
    #[error(transparent)]
    Replay(#[from] crate::replay::ReplayError),
    /// A snapshot could not be written, or was refused when read.
    #[error(transparent)]
    Snapshot(#[from] crate::snapshot::SnapshotError),
    /// The tier's runtime failed in a way that is not the guest's doing. Made with [`TierError::internal`] or,
    /// when a lower error caused it, [`TierError::internal_from`], which keeps that error as the source.
    #[error("{tier} tier internal error: {message}{}", caused_by(.source))]
    #[non_exhaustive]
    Internal {
        /// The tier.
        tier: TierKind,
        /// What failed.
        message: String,
        /// The error that made it fail, when there is one (shown after the message, as the other variants of
        /// this enum show theirs).
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
    },
}

/// `": {source}"` after an internal error's message, or nothing.
fn caused_by(source: &Option<Box<dyn std::error::Error + Send + Sync + 'static>>) -> String {
    source.as_ref().map(|source| format!(": {source}")).unwrap_or_default()
}

impl TierError {
    /// A failure of `tier` itself, in words, with no lower error behind it.
    pub fn internal(tier: TierKind, message: impl Into<String>) -> TierError {
        TierError::Internal { tier, message: message.into(), source: None }
    }

    /// A failure of `tier` itself while doing `what`, caused by `source` (kept: `std::error::Error::source` and
    /// a downcast reach it).
    pub fn internal_from(
        tier: TierKind,
        what: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> TierError {
        TierError::Internal { tier, message: what.into(), source: Some(source.into()) }
    }

    /// A stable, machine-readable code for this error (the `kind` of `{"error":{"kind":…}}`).
    pub fn code(&self) -> &'static str {
        match self {
            TierError::ReadInput { .. } => "input_unreadable",
            TierError::WrongFormat { .. } => "wrong_format",
            TierError::InvalidModule { .. } => "invalid_module",
            TierError::UnknownImport { .. } => "unknown_import",
            TierError::Capability(_) => "invalid_capability",
            TierError::Unsupported { .. } => "unsupported",
            TierError::WrongJob { .. } => "wrong_job",
            TierError::SessionTier { .. } => "session_tier",
            TierError::Cancelled => "cancelled",
            TierError::PortClosed { .. } => "port_closed",
            TierError::Capacity { .. } => "capacity",
            TierError::Storage { .. } => "storage",
            TierError::GuestPath { .. } => "guest_path",
            TierError::SessionEnded { .. } => "session_ended",
            TierError::Busy { .. } => "sandbox_busy",
            TierError::Artifact(_) => "artifact",
            TierError::Tool(_) => "invalid_tool",
            TierError::ProgramNotFound { .. } => "program_not_found",
            TierError::ExecFailed { .. } => "exec_failed",
            TierError::ImageNotFound { .. } => "image_not_found",
            TierError::Snapshot(err) => err.code(),
            TierError::Replay(err) => err.code(),
            TierError::Internal { .. } => "internal",
        }
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    #[test]
    fn an_internal_error_keeps_its_source_typed_and_names_it_once() {
        let io = std::io::Error::new(std::io::ErrorKind::PermissionDenied, "no entry");
        let err = TierError::internal_from(TierKind::Process, "opening the cgroup", io);
        assert_eq!(err.to_string(), "process tier internal error: opening the cgroup: no entry");
        let source = err.source().expect("a source").downcast_ref::<std::io::Error>().expect("the io::Error");
        assert_eq!(source.kind(), std::io::ErrorKind::PermissionDenied);
        let bare = TierError::internal(TierKind::Wasm, "the job thread panicked");
        assert_eq!(bare.to_string(), "wasm tier internal error: the job thread panicked");
        assert!(bare.source().is_none());
        assert_eq!(bare.code(), "internal");
    }
}
