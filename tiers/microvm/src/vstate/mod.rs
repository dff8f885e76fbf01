//! KVM state: the VM, its vCPUs and guest memory.
//!
//! - [`memory`]: guest RAM in a memfd, mapped with vm-memory around the 32-bit MMIO gap; snapshots dump it, forks
//!   map the dump copy-on-write.

pub mod memory;
