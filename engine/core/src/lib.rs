//! Strata's core model, shared by the engine and every tier (DESIGN §2): what to run ([`Job`]), what it may
//! touch ([`Capabilities`]), what it may use ([`Limits`]), how it ended ([`Outcome`]), and the [`Tier`] and
//! [`Sandbox`] traits that the tiers implement. No wasmtime, no KVM here.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod caps;
pub mod dirfd;
pub mod error;
pub mod job;
pub mod limits;
pub mod outcome;
pub mod private_copy;
pub mod redact;
pub mod snapshot;
pub mod snapshot_key;
pub mod tier;
pub mod tools;
pub mod units;

pub use caps::{Capabilities, CapsError, EnvVar, Grant, GrantMode, Net};
pub use error::TierError;
pub use job::{Job, JobKind, ModuleSource, PythonSource};
pub use limits::{Fuel, LimitKind, Limits, LimitsError, LimitsOverride};
pub use outcome::{EgressEntry, Escalation, Outcome, RouteDecision, Status, TierKind, Truncated, Usage};
pub use private_copy::PrivateCopy;
pub use redact::{Redactor, Secret};
pub use snapshot::{
    Manifest, Persisted, Snapshot, SnapshotBounds, SnapshotError, SnapshotKey, SnapshotTrust, SnapshotWriter,
};
pub use tier::{
    CancelToken, ExecOptions, MAX_BUFFERED_STDIN, OutputSink, PumpStop, Pumped, Sandbox, SandboxHandle, StdinStream,
    Stream, Tier,
};
pub use tools::{Tool, ToolCall, ToolDefinitionError, ToolFailure, ToolRegistry};
pub use units::{ByteSize, UnitsError, format_duration, parse_duration};
