//! Test support, behind the `test-utils` feature: what the microVM tier's integration tests and benches share
//! (fuzz targets may too), instead of test files included by path.
//!
//! - [`driver`]: the guest side of the virtio devices, a minimal virtio-mmio driver over guest memory (queues,
//!   the vsock guest, virtio-blk requests), for device tests that run no vCPU.
//! - [`tiny`]: tiny hand-assembled guests on real KVM, as a bare vCPU or as a paused [`Machine`](crate::machine::Machine).
//! - [`process`]: tests sharing one process: who runs alone (vCPUs, leak checks), and what the process holds.
//!
//! This is test support: a helper that cannot do its part panics with a message saying what failed, instead of
//! returning an error the test would unwrap anyway. Nothing outside tests and benches may use it.

#![forbid(unsafe_code)]

pub mod driver;
pub mod process;
pub mod tiny;
