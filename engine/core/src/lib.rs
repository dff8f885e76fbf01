//! Strata's core model, shared by the engine and every tier (docs/DESIGN.md §2): what to run ([`Job`]), what it may
//! touch ([`Capabilities`]), what it may use ([`Limits`]), how it ended ([`Outcome`]), and the [`Tier`] and
//! [`Sandbox`] traits that the tiers implement. No wasmtime, no KVM here.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod allow;
pub mod caps;
pub mod capture;
pub mod dirfd;
pub mod egress_secret;
pub mod error;
pub mod file_stamp;
pub mod fs;
pub mod guest_command;
pub mod guest_path;
pub mod image;
pub mod job;
pub mod limits;
pub mod outcome;
pub mod private_copy;
mod random;
pub mod redact;
pub mod replay;
pub mod service;
pub mod snapshot;
pub mod snapshot_key;
pub mod sync;
pub mod terminal;
pub mod tier;
pub mod tools;
pub mod units;
pub mod user;

pub use allow::{Allowlist, AllowlistError};
pub use caps::{Capabilities, CapsError, EnvVar, Grant, GrantMode, Net};
pub use capture::{Captured, OutputCapture};
pub use egress_secret::{EgressSecret, EgressSecretError};
pub use error::TierError;
pub use file_stamp::FileStamp;
pub use fs::{EntryInfo, FileType, GuestEntry, WatchEvent, WatchEventKind, WatchSender, Watcher};
pub use guest_command::{CopyIn, GuestCommand};
pub use guest_path::{GuestPath, GuestPathError};
pub use image::{ImageName, ImageNameError};
pub use job::{Job, JobKind, ModuleSource, PythonSource};
pub use limits::{Fuel, LimitKind, Limits, LimitsError, LimitsOverride};
pub use outcome::{EgressEntry, Escalation, Outcome, Platform, RouteDecision, Status, TierKind, Truncated, Usage};
pub use private_copy::PrivateCopy;
pub use redact::{Redactor, Secret};
pub use replay::{Determinism, Divergence, JobInputs, Recorder, Recording, ReplayError, Replayer};
pub use service::{ServiceExit, ServiceSpec, ServiceState, ServiceStatus};
pub use snapshot::{
    Manifest, Persisted, Snapshot, SnapshotBounds, SnapshotError, SnapshotKey, SnapshotTrust, SnapshotWriter,
};
pub use snapshot_key::SnapshotKeyError;
pub use terminal::{Terminal, WindowSize};
pub use tier::{
    CancelToken, ExecOptions, MAX_BUFFERED_STDIN, OutputSink, PortStream, PumpStop, Pumped, Sandbox, SandboxUsage,
    StdinStream, Stream, Tier,
};
pub use tools::{Tool, ToolCall, ToolDefinitionError, ToolFailure, ToolRegistry};
pub use units::{ByteSize, UnitsError, format_duration, parse_duration};
pub use user::{UserName, UserNameError};
