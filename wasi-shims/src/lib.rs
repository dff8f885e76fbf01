//! What WASI lacks and Strata adds on the wasm tier, under the same capability checks as the rest of Strata.
//!
//! [`WasiOutput`], the core output capture (caps and secret redaction, never blocking the guest) as WASI's
//! stdout/stderr; [`StreamedStdin`], a guest stdin read from a stream as it arrives; [`poll`], preview1's
//! `poll_oneoff` with every wait asynchronous, so a job's wall limit and cancel end a guest blocked in it; and
//! [`open`], which lets a guest open only files whose open cannot wait (no FIFO, no device).

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod capture;
pub mod open;
pub mod poll;
pub mod stdin;

pub use capture::WasiOutput;
pub use stdin::{StdinSource, StreamedStdin};
