//! Strata's microVM tier: KVM microVMs run by a monitor on the rust-vmm crates (crate `strata-vmm`), and the guest
//! agent's channel.
//!
//! - [`monitor`]: the engine's side of a monitor process (one per microVM, jailed, under seccomp): the only
//!   microVM code that runs in the engine's process.
//! - [`builder`]: a microVM that boots Linux, and reaching its guest agent.
//! - [`snapshot`]: a machine saved into a sealed snapshot directory, verified, restored and forked.
//! - [`session`]: a guest running jobs in turn through its agent, whatever hosts the agent, and [`files`], its
//!   file methods; [`tier`]: the tier (one-shot jobs, sandboxes, snapshots and forks of booted VMs).
//!
//! The monitor's own modules are re-exported as they were: [`vstate`], [`boot`], [`devices`], [`machine`],
//! [`persist`].

#![warn(missing_docs)]

pub use strata_vmm::{boot, devices, machine, persist, vstate};

pub mod builder;
pub mod files;
pub mod grants;
pub mod guest;
pub mod monitor;
pub mod session;
pub mod snapshot;
pub mod tier;
