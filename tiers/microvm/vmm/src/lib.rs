//! Strata's microVM monitor, in the spirit of Firecracker, on the rust-vmm crates.
//!
//! - [`vstate`]: the KVM VM (irqchip, PIT, clock, and their saved state), vCPUs (registers, CPUID, MSRs, the run
//!   loop and its exits) and memfd-backed guest memory (written and read back sparse).
//! - [`boot`]: direct 64-bit Linux boot (boot params, GDT, identity page tables, command line).
//! - [`devices`]: the buses the vCPUs' port and MMIO exits dispatch to, the serial console, and the virtio-mmio
//!   devices (vsock, block). Every guest-controlled value is bounds-checked: a hostile guest breaks its own device,
//!   never the host.
//! - [`machine`]: a VM with its memory, vCPUs and devices, paused at a safe point, saved, and rebuilt from a state.
//! - [`persist`]: the saved state's format; [`error`]: why a machine could not be paused, saved or rebuilt.
//! - [`monitor`]: the monitor process (binary `strata-vmm`): one machine per process, jailed (namespaces, a
//!   minimal root, its own cgroup, no capabilities, `no_new_privs`) with a seccomp filter per thread kind
//!   ([`seccomp`]), driven by the engine over a control socket ([`proto`]).
//! - `test_utils` (feature `test-utils`): the guest side of the devices, tiny hand-assembled guests and the rules
//!   of tests sharing a process, for tests and benches.

#![warn(missing_docs)]

pub mod boot;
pub mod devices;
pub mod error;
pub mod machine;
pub mod monitor;
pub mod persist;
pub mod proto;
pub mod seccomp;
#[cfg(feature = "test-utils")]
pub mod test_utils;
pub mod vstate;
