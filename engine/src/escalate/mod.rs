//! Dynamic escalation (docs/DESIGN.md §2, routing and escalation): a Python job that `--tier auto` sent to wasm and that failed there for
//! a reason the policy marks escalatable re-runs on the native tier, from a clean state.
//!
//! **What escalates** ([`diagnose()`]). Only a run that ended like an uncaught exception (exit status 1, stderr not
//! truncated) whose *final* traceback's exception line says one of:
//!
//! - a missing module ([`EscalationReason::MissingModule`](crate::policy::EscalationReason::MissingModule)): `ModuleNotFoundError` (or `ImportError`) with `No
//!   module named 'X'`, `Unsupported platform for standard library module 'X'` or `Standard library module 'X' was
//!   not found`, and only when the top-level module of `X` is indeed absent from the wasm build
//!   ([`WasmModules`](crate::scan::WasmModules)); a submodule missing from a package wasm has is the script's own error;
//! - an unsupported OS call ([`EscalationReason::UnsupportedCall`](crate::policy::EscalationReason::UnsupportedCall)): `OSError: [Errno 58] …` (WASI `ENOTSUP`:
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
//!
//! The parts: [`diagnose`](mod@diagnose) (what failed, and whether it escalates), [`held`] (what an attempt holds back until
//! it is known to be the result: its output, and the stdin it read) and [`scratch`] (the copies of read-write
//! grants an attempt writes to).

pub mod diagnose;
pub mod held;
pub mod scratch;

pub use diagnose::{UNSUPPORTED_ATTRIBUTES, WasmFailure, diagnose};
pub use held::{HeldOutput, MAX_TEED_STDIN, StdinReplay, StdinTee};
pub(crate) use scratch::sweep_stale;
pub use scratch::{Committed, MAX_ENTRIES, ScratchError, ScratchGrants};
