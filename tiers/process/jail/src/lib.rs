//! The inside of Strata's process jail.
//!
//! [`forward`] relays the jail's `127.0.0.1:3128` to the host egress proxy. [`proto`] is the control protocol the host (crate `strata-tier-process`) speaks with the jail; [`init`] is
//! the jail's own code (the `strata-jail` binary: the keeper and PID 1); [`seccomp`] is the job's system-call
//! allowlist; [`files`] and [`watch`] are PID 1's filesystem methods and inotify watches; [`tree`] stores and restores the overlay's upper layer (snapshots and forks); [`service`] is the jail's supervised start command. The host side, which spawns the jail, sets up its cgroup and runs jobs, lives in
//! `strata-tier-process`'s `jail` module.

#![warn(missing_docs)]

pub mod files;
pub mod forward;
pub mod init;
pub mod inject;
pub mod proto;
pub mod seccomp;
pub mod service;
mod steps;
pub mod sudo;
pub mod sys;
pub mod tree;
pub mod tty;
pub mod userns;
pub mod users;
pub mod watch;
pub mod zygote;
