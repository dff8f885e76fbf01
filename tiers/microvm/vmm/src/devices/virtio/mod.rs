//! virtio devices over the MMIO transport.
//!
//! - [`mmio::MmioTransport`]: the virtio-mmio (version 2, "modern") register block a guest driver talks to. It is
//!   a [`BusDevice`](super::bus::BusDevice) and drives one [`VirtioDevice`]: feature negotiation, queue setup and
//!   validation, activation, queue notifications, reset.
//! - [`block::BlockDevice`]: virtio-blk over a read-only host file.
//! - [`vsock::VsockDevice`]: virtio-vsock, its connections multiplexed onto host Unix sockets.
//! - [`persist`]: the transport's snapshot state; each device's `persist.rs` adds its own.
//!
//! Everything a guest writes (register values, descriptors, packet headers) is checked before use: a hostile
//! driver breaks its own device, never the monitor.
//!
//! A monitor wires a device like this:
//!
//! ```no_run
//! # use std::sync::{Arc, Mutex};
//! # use strata_vmm::devices::bus::Bus;
//! # use strata_vmm::devices::virtio::{Interrupt, mmio::{MmioTransport, BackendThread, MMIO_LEN}};
//! # use strata_vmm::devices::virtio::vsock::{VsockConfig, VsockDevice};
//! # fn wire(mem: vm_memory::GuestMemoryMmap, bus: &mut Bus) -> Result<(), Box<dyn std::error::Error>> {
//! let device = VsockDevice::new(VsockConfig { guest_cid: 3, uds_path: "/run/strata/v.sock".into() })?;
//! let interrupt = Interrupt::new()?; // register interrupt.irqfd() with KVM_IRQFD for the device's GSI
//! let transport = Arc::new(Mutex::new(MmioTransport::new(mem, device, interrupt)?));
//! bus.insert(transport.clone(), 0xd000_0000, MMIO_LEN)?; // and `virtio_mmio.device=4K@0xd0000000:<gsi>`
//! let backend = BackendThread::spawn(transport.clone())?; // host sockets → RX queue; stops when dropped
//! # Ok(()) }
//! ```

#![forbid(unsafe_code)]

pub mod block;
pub mod mmio;
pub mod persist;
pub mod vsock;

use std::io;
use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use virtio_queue::{Queue, QueueState};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

/// `VIRTIO_F_VERSION_1`: the device is a modern (virtio 1.x) device. The transport refuses drivers that do not
/// accept it.
pub const VIRTIO_F_VERSION_1: u64 = 1 << virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;

/// Why a device could not be activated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ActivateError {
    /// The transport handed over a different number of queues than the device has.
    #[error("expected {expected} queues, got {got}")]
    QueueCount {
        /// What the device has.
        expected: usize,
        /// What it got.
        got: usize,
    },
    /// A queue's state could not be copied for the device.
    #[error("queue {0} has an invalid state")]
    InvalidQueue(usize),
    /// A queue the device needs was not set up by the driver.
    #[error("queue {0} is not ready")]
    QueueNotReady(usize),
}

/// The cause of an interrupt, as the guest reads it in `InterruptStatus`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InterruptKind {
    /// The device added buffers to a used ring (bit 0).
    UsedBuffer,
    /// The device's configuration changed (bit 1).
    ConfigChange,
}

impl InterruptKind {
    /// The `InterruptStatus` bit.
    pub fn bit(self) -> u32 {
        match self {
            InterruptKind::UsedBuffer => virtio_bindings::virtio_mmio::VIRTIO_MMIO_INT_VRING,
            InterruptKind::ConfigChange => virtio_bindings::virtio_mmio::VIRTIO_MMIO_INT_CONFIG,
        }
    }
}

/// Every `InterruptStatus` bit a device can raise.
pub const INTERRUPT_STATUS_MASK: u32 =
    virtio_bindings::virtio_mmio::VIRTIO_MMIO_INT_VRING | virtio_bindings::virtio_mmio::VIRTIO_MMIO_INT_CONFIG;

#[derive(Debug)]
struct InterruptInner {
    status: AtomicU32,
    irqfd: EventFd,
}

/// A device's interrupt line: the `InterruptStatus` bits and the EventFd the monitor registers with KVM as an
/// irqfd (edge: one write per interrupt). Cheap to clone; all clones share the line.
#[derive(Debug, Clone)]
pub struct Interrupt {
    inner: Arc<InterruptInner>,
}

impl Interrupt {
    /// A fresh line with a non-blocking EventFd and no status bit set.
    pub fn new() -> io::Result<Interrupt> {
        Ok(Interrupt {
            inner: Arc::new(InterruptInner { status: AtomicU32::new(0), irqfd: EventFd::new(EFD_NONBLOCK)? }),
        })
    }

    /// The EventFd to hand to `KVM_IRQFD` (or, in tests, to read).
    pub fn irqfd(&self) -> &EventFd {
        &self.inner.irqfd
    }

    /// Sets `kind`'s status bit and signals the irqfd.
    pub fn trigger(&self, kind: InterruptKind) {
        self.inner.status.fetch_or(kind.bit(), Ordering::SeqCst);
        if let Err(e) = self.inner.irqfd.write(1) {
            log::error!("virtio interrupt: cannot signal the irqfd: {e}");
        }
    }

    /// The `InterruptStatus` register.
    pub fn status(&self) -> u32 {
        self.inner.status.load(Ordering::SeqCst)
    }

    /// Clears the bits the driver acknowledged.
    pub(crate) fn ack(&self, bits: u32) {
        self.inner.status.fetch_and(!bits, Ordering::SeqCst);
    }

    /// Replaces the status bits (restore, reset).
    pub(crate) fn set_status(&self, bits: u32) {
        self.inner.status.store(bits & INTERRUPT_STATUS_MASK, Ordering::SeqCst);
    }
}

/// A virtio device behind a transport. The transport owns the driver-facing registers; the device owns the data
/// path. Every method may see guest-controlled values and must never panic on them.
pub trait VirtioDevice: Send {
    /// The virtio device ID (`VIRTIO_ID_*`).
    fn device_type(&self) -> u32;

    /// The feature bits the device offers (including [`VIRTIO_F_VERSION_1`]).
    fn avail_features(&self) -> u64;

    /// Each queue's maximum size (a power of two, at most 32768); the slice's length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];

    /// A guest read of the device configuration space at `offset` (relative to 0x100). Bytes past the end
    /// read as zero.
    fn read_config(&self, offset: u64, data: &mut [u8]);

    /// A guest write to the configuration space; devices whose configuration is read-only ignore it.
    fn write_config(&mut self, offset: u64, data: &[u8]);

    /// The driver set DRIVER_OK: start the data path. `queues` has one entry per queue (not-ready ones included,
    /// every ready one already validated against `mem`); `acked_features` is what the driver accepted.
    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        queues: Vec<Queue>,
        interrupt: Interrupt,
        acked_features: u64,
    ) -> Result<(), ActivateError>;

    /// The driver notified queue `index` (already checked to be a valid index). Runs on the notifying vCPU's
    /// thread, under the transport's lock.
    fn process_queue(&mut self, index: usize);

    /// The live state of the device's queues (next_avail/next_used included), empty when not activated.
    fn queue_states(&self) -> Vec<QueueState>;

    /// The device was reset by the driver: drop the queues and everything in flight.
    fn reset(&mut self);

    /// A descriptor that becomes readable when the device's host-side backend has work (vsock: host sockets).
    /// A backend thread polls it and calls [`VirtioDevice::process_backend`].
    fn backend_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }

    /// Handles the backend's pending work (accept connections, read host sockets, fill RX buffers).
    fn process_backend(&mut self) {}
}

/// A device for the transport's own tests.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use virtio_queue::QueueT;

    /// A device with two queues (16 and 8) that records what the transport asks of it.
    #[derive(Debug, Default)]
    pub(crate) struct Recorder {
        pub(crate) activated: Option<u64>,
        pub(crate) processed: Vec<usize>,
        pub(crate) resets: usize,
        pub(crate) config: [u8; 8],
        /// What `queue_states` reports.
        pub(crate) live: Option<Vec<QueueState>>,
    }

    impl VirtioDevice for Recorder {
        fn device_type(&self) -> u32 {
            42
        }
        fn avail_features(&self) -> u64 {
            VIRTIO_F_VERSION_1 | 0b101
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &[16, 8]
        }
        fn read_config(&self, offset: u64, data: &mut [u8]) {
            let start = usize::try_from(offset).unwrap_or(usize::MAX);
            for (i, byte) in data.iter_mut().enumerate() {
                *byte = start.checked_add(i).and_then(|j| self.config.get(j)).copied().unwrap_or(0);
            }
        }
        fn write_config(&mut self, _offset: u64, _data: &[u8]) {}
        fn activate(
            &mut self,
            _mem: GuestMemoryMmap,
            queues: Vec<Queue>,
            _interrupt: Interrupt,
            acked_features: u64,
        ) -> Result<(), ActivateError> {
            if !queues.first().is_some_and(|q| q.ready()) {
                return Err(ActivateError::QueueNotReady(0));
            }
            self.activated = Some(acked_features);
            Ok(())
        }
        fn process_queue(&mut self, index: usize) {
            self.processed.push(index);
        }
        fn queue_states(&self) -> Vec<QueueState> {
            self.live.clone().unwrap_or_default()
        }
        fn reset(&mut self) {
            self.activated = None;
            self.resets += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interrupt_sets_bits_signals_and_acks() {
        let interrupt = Interrupt::new().expect("eventfd");
        assert!(interrupt.irqfd().read().is_err(), "no signal yet");
        interrupt.trigger(InterruptKind::UsedBuffer);
        interrupt.clone().trigger(InterruptKind::ConfigChange);
        assert_eq!(interrupt.status(), 0x3);
        assert_eq!(interrupt.irqfd().read().expect("signalled"), 2);
        interrupt.ack(0x1);
        assert_eq!(interrupt.status(), 0x2);
        interrupt.set_status(0xff);
        assert_eq!(interrupt.status(), INTERRUPT_STATUS_MASK);
    }
}

/// Copies the device config bytes at `offset` into `data` (a guest read of config space); bytes past the end read
/// as zero, and no offset or length from the guest can index out of bounds.
pub(crate) fn read_config_bytes(config: &[u8], offset: u64, data: &mut [u8]) {
    let start = usize::try_from(offset).unwrap_or(usize::MAX);
    for (i, byte) in data.iter_mut().enumerate() {
        *byte = start.checked_add(i).and_then(|j| config.get(j)).copied().unwrap_or(0);
    }
}
