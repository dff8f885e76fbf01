//! What WASI lacks and Strata adds on the wasm tier, under the same capability checks as the rest of Strata.
//!
//! Today: [`OutputCapture`], guest stdout/stderr captured with per-stream caps and secret redaction that never
//! blocks the guest; [`StreamedStdin`], a guest stdin read from a stream as it arrives; [`poll`], preview1's
//! `poll_oneoff` with every wait asynchronous, so a job's wall limit and cancel end a guest blocked in it; and
//! [`open`], which lets a guest open only files whose open cannot wait (no FIFO, no device).
//! Egress-checked sockets, the scratch overlay for rw grants and host tool calls join it as the capability model
//! grows (DESIGN §1).

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod capture;
pub mod open;
pub mod poll;
pub mod stdin;

pub use capture::{Captured, OutputCapture};
pub use stdin::{StdinSource, StreamedStdin};
