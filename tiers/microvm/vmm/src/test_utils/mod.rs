//! Test support, behind the `test-utils` feature: what the microVM tier's integration tests and benches share
//! (fuzz targets may too), instead of test files included by path.
//!
//! - [`driver`]: the guest side of the virtio devices, a minimal virtio-mmio driver over guest memory (queues,
//!   the vsock guest, virtio-blk requests), for device tests that run no vCPU.
//!
//! This is test support: a helper that cannot do its part panics with a message saying what failed, instead of
//! returning an error the test would unwrap anyway. Nothing outside tests and benches may use it.

#![forbid(unsafe_code)]

pub mod driver;
