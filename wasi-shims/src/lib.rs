//! What WASI lacks and Strata adds on the wasm tier, under the same capability checks as the rest of Strata.
//!
//! Today: [`OutputCapture`], guest stdout/stderr captured with per-stream caps and secret redaction that never
//! blocks the guest. Egress-checked sockets, the scratch overlay for rw grants and host tool calls join it as
//! the capability model grows (DESIGN §1).

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod capture;

pub use capture::{Captured, OutputCapture};
