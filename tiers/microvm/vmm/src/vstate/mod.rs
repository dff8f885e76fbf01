//! KVM state: the VM, its vCPUs and guest memory.
//!
//! - [`memory`]: guest RAM in a memfd, mapped with vm-memory around the 32-bit MMIO gap; snapshots dump it, forks
//!   map the dump copy-on-write.
//! - [`vm`]: the KVM VM (memory slots, irqchip, PIT, clock, irqfds) and the `KVM_CAP_*` facts it relies on.
//! - [`vcpu`]: CPUID mask, MSRs, entry registers, the run loop and its exits, stopping a vCPU from another thread,
//!   and the vCPU state for snapshots.

pub mod memory;
pub mod vcpu;
pub mod vm;
