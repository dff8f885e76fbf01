//! Strata's microVM tier: a KVM monitor in the spirit of Firecracker, on the rust-vmm crates.
//!
//! - [`vstate`]: the KVM VM (irqchip, PIT, clock), vCPUs (registers, CPUID, MSRs, the run loop and its exits) and
//!   memfd-backed guest memory.
//! - [`boot`]: direct 64-bit Linux boot (boot params, GDT, identity page tables, command line).
//! - [`devices`]: the buses the vCPUs' port and MMIO exits dispatch to, the serial console, and the virtio-mmio
//!   devices (vsock, block). Every guest-controlled value is bounds-checked: a hostile guest breaks its own device,
//!   never the host.
//! - [`snapshot`]: pausing a VM at a safe point, saving it into a snapshot directory, restoring it into a new
//!   monitor and forking it over its memory file mapped copy-on-write.
//! - [`session`]: a guest running jobs in turn through its agent, whatever hosts the agent, and [`files`], its
//!   file methods; [`tier`]: the tier (one-shot jobs, sandboxes, snapshots and forks of booted VMs).

#![warn(missing_docs)]

pub mod boot;
pub mod builder;
pub mod devices;
pub mod files;
pub mod grants;
pub mod guest;
pub mod session;
pub mod snapshot;
pub mod tier;
pub mod vstate;
