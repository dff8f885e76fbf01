//! The virtio-mmio transport, version 2 ("modern" virtio 1.x register layout), as a [`BusDevice`].
//!
//! The guest driver probes the device (`MagicValue`, `Version`, `DeviceID`), resets it (`Status` ← 0), sets
//! ACKNOWLEDGE and DRIVER, reads the offered features page by page, writes the subset it accepts and sets
//! FEATURES_OK (refused, so that the bit does not stick, when it accepts a feature that was not offered or does
//! not accept `VIRTIO_F_VERSION_1`), sets every queue up (`QueueSel`, `QueueNum`, ring addresses, `QueueReady`:
//! refused unless the size is a power of two no larger than `QueueNumMax` and the rings are aligned and inside
//! guest memory), and sets DRIVER_OK, which activates the device.
//!
//! **Queue notifications are synchronous.** A write to `QueueNotify` runs the device's queue processing right
//! there, on the vCPU thread that made the write and under the transport's lock: no ioeventfd, no device
//! thread. A monitor that prefers ioeventfds can call [`MmioTransport::notify_queue`] from its event loop
//! instead. Work that starts on the host side (a vsock peer sending data) runs on a backend thread,
//! [`BackendThread`], which polls the device's [`VirtioDevice::backend_fd`] and calls
//! [`MmioTransport::process_backend`] under the same lock.
//!
//! Registers are 32-bit: other access widths read as zero and are ignored on write. The device configuration
//! space starts at 0x100 and takes any width.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::eventfd::{EfdFlags, EventFd as StopFd};
use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK, VIRTIO_CONFIG_S_FAILED,
    VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET,
};
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddress, GuestMemoryMmap};

use super::{ActivateError, Interrupt, InterruptKind, VIRTIO_F_VERSION_1, VirtioDevice};
use crate::devices::bus::BusDevice;

/// The size of a virtio-mmio device's window on the MMIO bus.
pub const MMIO_LEN: u64 = 0x1000;
/// `MagicValue`: "virt" in little endian.
pub const MMIO_MAGIC_VALUE: u32 = 0x7472_6976;
/// `Version`: the modern layout.
pub const MMIO_VERSION: u32 = 2;
/// `VendorID`.
pub const MMIO_VENDOR_ID: u32 = 0;
/// Where the device configuration space starts.
pub const MMIO_CONFIG_OFFSET: u64 = 0x100;

// Register offsets (virtio 1.2, 4.2.2).
const MAGIC_VALUE: u64 = 0x000;
const VERSION: u64 = 0x004;
const DEVICE_ID: u64 = 0x008;
const VENDOR_ID: u64 = 0x00c;
const DEVICE_FEATURES: u64 = 0x010;
const DEVICE_FEATURES_SEL: u64 = 0x014;
const DRIVER_FEATURES: u64 = 0x020;
const DRIVER_FEATURES_SEL: u64 = 0x024;
const QUEUE_SEL: u64 = 0x030;
const QUEUE_NUM_MAX: u64 = 0x034;
const QUEUE_NUM: u64 = 0x038;
const QUEUE_READY: u64 = 0x044;
const QUEUE_NOTIFY: u64 = 0x050;
const INTERRUPT_STATUS: u64 = 0x060;
const INTERRUPT_ACK: u64 = 0x064;
const STATUS: u64 = 0x070;
const QUEUE_DESC_LOW: u64 = 0x080;
const QUEUE_DESC_HIGH: u64 = 0x084;
const QUEUE_DRIVER_LOW: u64 = 0x090;
const QUEUE_DRIVER_HIGH: u64 = 0x094;
const QUEUE_DEVICE_LOW: u64 = 0x0a0;
const QUEUE_DEVICE_HIGH: u64 = 0x0a4;
const SHM_LEN_LOW: u64 = 0x0b0;
const SHM_LEN_HIGH: u64 = 0x0b4;
const SHM_BASE_LOW: u64 = 0x0b8;
const SHM_BASE_HIGH: u64 = 0x0bc;
const CONFIG_GENERATION: u64 = 0x0fc;

pub(super) const S_ACK: u32 = VIRTIO_CONFIG_S_ACKNOWLEDGE;
pub(super) const S_DRIVER: u32 = VIRTIO_CONFIG_S_DRIVER;
pub(super) const S_FEATURES_OK: u32 = VIRTIO_CONFIG_S_FEATURES_OK;
pub(super) const S_DRIVER_OK: u32 = VIRTIO_CONFIG_S_DRIVER_OK;
pub(super) const S_NEEDS_RESET: u32 = VIRTIO_CONFIG_S_NEEDS_RESET;
pub(super) const S_FAILED: u32 = VIRTIO_CONFIG_S_FAILED;

/// Why a transport could not be built around a device.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MmioError {
    /// The device declared no queue.
    #[error("the device has no queues")]
    NoQueues,
    /// A queue's maximum size is zero, above 32768 or not a power of two.
    #[error("device queue {index} has invalid maximum size {max_size}")]
    QueueMaxSize {
        /// The queue.
        index: usize,
        /// Its declared maximum.
        max_size: u16,
    },
}

/// Why a queue configuration (from the driver, or from a snapshot) was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QueueConfigError {
    /// The size is zero, not a power of two, or above the queue's maximum.
    #[error("queue size {size} is not a power of two in 1..={max}")]
    Size {
        /// The requested size.
        size: u32,
        /// The queue's maximum.
        max: u16,
    },
    /// The descriptor table is not 16-byte aligned.
    #[error("descriptor table address {0:#x} is not 16-byte aligned")]
    DescAlignment(u64),
    /// The available ring is not 2-byte aligned, or sits at address 0 (which virtio-queue reads as "unset").
    #[error("available ring address {0:#x} is not 2-byte aligned or is 0")]
    DriverAlignment(u64),
    /// The used ring is not 4-byte aligned.
    #[error("used ring address {0:#x} is not 4-byte aligned")]
    DeviceAlignment(u64),
    /// A ring does not lie inside guest memory.
    #[error(
        "queue rings (desc {desc:#x}, driver {driver:#x}, device {device:#x}, size {size}) are not inside guest memory"
    )]
    OutsideMemory {
        /// Descriptor table.
        desc: u64,
        /// Available ring.
        driver: u64,
        /// Used ring.
        device: u64,
        /// Queue size.
        size: u16,
    },
}

/// Applies a queue configuration to `queue` and marks it ready, or leaves it not ready and says why.
pub(super) fn configure_queue(
    queue: &mut Queue,
    mem: &GuestMemoryMmap,
    size: u32,
    desc: u64,
    driver: u64,
    device: u64,
) -> Result<(), QueueConfigError> {
    queue.set_ready(false);
    let max = queue.max_size();
    let size16 = u16::try_from(size).map_err(|_| QueueConfigError::Size { size, max })?;
    queue.try_set_size(size16).map_err(|_| QueueConfigError::Size { size, max })?;
    queue.try_set_desc_table_address(GuestAddress(desc)).map_err(|_| QueueConfigError::DescAlignment(desc))?;
    if driver == 0 {
        return Err(QueueConfigError::DriverAlignment(driver));
    }
    queue.try_set_avail_ring_address(GuestAddress(driver)).map_err(|_| QueueConfigError::DriverAlignment(driver))?;
    queue.try_set_used_ring_address(GuestAddress(device)).map_err(|_| QueueConfigError::DeviceAlignment(device))?;
    queue.set_ready(true);
    if !queue.is_valid(mem) {
        queue.set_ready(false);
        return Err(QueueConfigError::OutsideMemory { desc, driver, device, size: size16 });
    }
    Ok(())
}

/// One queue as the driver configures it: the raw register values, applied to `queue` on `QueueReady` ← 1.
#[derive(Debug)]
pub(super) struct QueueSlot {
    pub(super) queue: Queue,
    pub(super) size: u32,
    pub(super) desc: u64,
    pub(super) driver: u64,
    pub(super) device: u64,
}

impl QueueSlot {
    fn new(max_size: u16) -> Option<QueueSlot> {
        let queue = Queue::new(max_size).ok()?;
        Some(QueueSlot { queue, size: u32::from(max_size), desc: 0, driver: 0, device: 0 })
    }

    fn reset(&mut self) {
        self.queue.reset();
        self.size = u32::from(self.queue.max_size());
        self.desc = 0;
        self.driver = 0;
        self.device = 0;
    }
}

/// The virtio-mmio register block around device `D`.
#[derive(Debug)]
pub struct MmioTransport<D> {
    pub(super) device: D,
    pub(super) mem: GuestMemoryMmap,
    pub(super) interrupt: Interrupt,
    pub(super) queues: Vec<QueueSlot>,
    pub(super) device_features_sel: u32,
    pub(super) driver_features_sel: u32,
    /// What the driver wrote to `DriverFeatures` (pages 0 and 1).
    pub(super) driver_features: u64,
    /// The driver wrote a non-zero value to a feature page above 1: it accepts something never offered.
    pub(super) driver_features_invalid: bool,
    /// The features fixed at FEATURES_OK.
    pub(super) acked_features: u64,
    pub(super) queue_select: u32,
    pub(super) status: u32,
    pub(super) config_generation: u32,
    pub(super) activated: bool,
}

fn set_low(value: &mut u64, low: u32) {
    *value = (*value & 0xffff_ffff_0000_0000) | u64::from(low);
}

fn set_high(value: &mut u64, high: u32) {
    *value = (*value & 0xffff_ffff) | (u64::from(high) << 32);
}

impl<D: VirtioDevice> MmioTransport<D> {
    /// A transport in the reset state around `device`, whose queues will live in `mem` and whose interrupts go
    /// through `interrupt`.
    pub fn new(mem: GuestMemoryMmap, device: D, interrupt: Interrupt) -> Result<MmioTransport<D>, MmioError> {
        let max_sizes = device.queue_max_sizes();
        if max_sizes.is_empty() {
            return Err(MmioError::NoQueues);
        }
        let queues = max_sizes
            .iter()
            .enumerate()
            .map(|(index, &max_size)| QueueSlot::new(max_size).ok_or(MmioError::QueueMaxSize { index, max_size }))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(MmioTransport {
            device,
            mem,
            interrupt,
            queues,
            device_features_sel: 0,
            driver_features_sel: 0,
            driver_features: 0,
            driver_features_invalid: false,
            acked_features: 0,
            queue_select: 0,
            status: 0,
            config_generation: 0,
            activated: false,
        })
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// The device, mutably (for device-specific host-side calls).
    pub fn device_mut(&mut self) -> &mut D {
        &mut self.device
    }

    /// The interrupt line (its irqfd is what the monitor registers with KVM).
    pub fn interrupt(&self) -> &Interrupt {
        &self.interrupt
    }

    /// The `Status` register.
    pub fn status(&self) -> u32 {
        self.status
    }

    /// The features the driver accepted (valid once FEATURES_OK is set).
    pub fn acked_features(&self) -> u64 {
        self.acked_features
    }

    /// Whether the driver set DRIVER_OK and the device accepted activation.
    pub fn is_activated(&self) -> bool {
        self.activated
    }

    /// Runs queue `index`'s processing, as a `QueueNotify` write of `index` does. Ignored (and logged) before
    /// activation and for an index the device does not have.
    pub fn notify_queue(&mut self, index: u32) {
        if !self.activated {
            log::debug!("virtio-mmio: notify of queue {index} before activation ignored");
            return;
        }
        match usize::try_from(index) {
            Ok(i) if i < self.queues.len() => self.device.process_queue(i),
            _ => log::warn!("virtio-mmio: notify of nonexistent queue {index} ignored"),
        }
    }

    /// Lets the device handle its backend's pending work; see [`BackendThread`].
    pub fn process_backend(&mut self) {
        self.device.process_backend();
    }

    /// Bumps `ConfigGeneration` and raises a configuration-change interrupt (after the host changed the
    /// device's configuration space).
    pub fn notify_config_change(&mut self) {
        self.config_generation = self.config_generation.wrapping_add(1);
        self.interrupt.trigger(InterruptKind::ConfigChange);
    }

    /// The guest's view of the transport's queues, for tests and diagnostics: (size, ready) per queue.
    pub fn queue_config(&self, index: usize) -> Option<(u16, bool)> {
        self.queues.get(index).map(|slot| (slot.queue.size(), slot.queue.ready()))
    }

    fn reset(&mut self) {
        self.device.reset();
        for slot in &mut self.queues {
            slot.reset();
        }
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.driver_features = 0;
        self.driver_features_invalid = false;
        self.acked_features = 0;
        self.queue_select = 0;
        self.status = 0;
        self.interrupt.set_status(0);
        self.activated = false;
    }

    fn features_acceptable(&self) -> bool {
        !self.driver_features_invalid
            && self.driver_features & !self.device.avail_features() == 0
            && self.driver_features & VIRTIO_F_VERSION_1 != 0
    }

    pub(super) fn activate_device(&mut self) -> Result<(), ActivateError> {
        let queues = self
            .queues
            .iter()
            .enumerate()
            .map(|(i, slot)| Queue::try_from(slot.queue.state()).map_err(|_| ActivateError::InvalidQueue(i)))
            .collect::<Result<Vec<_>, _>>()?;
        self.device.activate(self.mem.clone(), queues, self.interrupt.clone(), self.acked_features)
    }

    fn set_status(&mut self, value: u32) {
        if value == 0 {
            self.reset();
            return;
        }
        let old = self.status;
        if value & S_FAILED != 0 {
            // The driver gave up on the device; it stays as it is until the next reset.
            self.status |= S_FAILED;
            return;
        }
        let acked = S_ACK | S_DRIVER;
        let features_ok = acked | S_FEATURES_OK;
        match (old, value) {
            (0, S_ACK) => self.status = value,
            (S_ACK, v) if v == acked => self.status = value,
            (o, v) if o == acked && v == features_ok => {
                if self.features_acceptable() {
                    self.acked_features = self.driver_features;
                    self.status = value;
                } else {
                    log::warn!(
                        "virtio-mmio: FEATURES_OK refused: driver features {:#x} (offered {:#x}{})",
                        self.driver_features,
                        self.device.avail_features(),
                        if self.driver_features_invalid { ", and bits above 63" } else { "" }
                    );
                }
            }
            (o, v) if o == features_ok && v == features_ok | S_DRIVER_OK => match self.activate_device() {
                Ok(()) => {
                    self.status = value;
                    self.activated = true;
                }
                Err(e) => {
                    log::warn!("virtio-mmio: device activation failed: {e}");
                    self.status = value | S_NEEDS_RESET;
                    self.config_generation = self.config_generation.wrapping_add(1);
                    self.interrupt.trigger(InterruptKind::ConfigChange);
                }
            },
            _ => log::warn!("virtio-mmio: invalid status transition {old:#x} -> {value:#x} ignored"),
        }
    }

    fn write_driver_features(&mut self, value: u32) {
        if self.status & (S_DRIVER | S_FEATURES_OK | S_FAILED) != S_DRIVER {
            log::warn!("virtio-mmio: DriverFeatures written in status {:#x}; ignored", self.status);
            return;
        }
        match self.driver_features_sel {
            0 => set_low(&mut self.driver_features, value),
            1 => set_high(&mut self.driver_features, value),
            _ if value != 0 => self.driver_features_invalid = true,
            _ => {}
        }
    }

    fn selected_queue(&mut self) -> Option<&mut QueueSlot> {
        usize::try_from(self.queue_select).ok().and_then(|i| self.queues.get_mut(i))
    }

    fn write_queue_register(&mut self, offset: u64, value: u32) {
        // Queues are configured between FEATURES_OK and DRIVER_OK.
        if self.status & (S_FEATURES_OK | S_DRIVER_OK | S_FAILED) != S_FEATURES_OK {
            log::warn!("virtio-mmio: queue register {offset:#x} written in status {:#x}; ignored", self.status);
            return;
        }
        let mem = self.mem.clone();
        let select = self.queue_select;
        let Some(slot) = self.selected_queue() else {
            log::warn!("virtio-mmio: queue register {offset:#x} written for nonexistent queue {select}");
            return;
        };
        if slot.queue.ready() && offset != QUEUE_READY {
            log::warn!("virtio-mmio: queue {select} is enabled; register {offset:#x} write ignored");
            return;
        }
        match offset {
            QUEUE_NUM => slot.size = value,
            QUEUE_DESC_LOW => set_low(&mut slot.desc, value),
            QUEUE_DESC_HIGH => set_high(&mut slot.desc, value),
            QUEUE_DRIVER_LOW => set_low(&mut slot.driver, value),
            QUEUE_DRIVER_HIGH => set_high(&mut slot.driver, value),
            QUEUE_DEVICE_LOW => set_low(&mut slot.device, value),
            QUEUE_DEVICE_HIGH => set_high(&mut slot.device, value),
            QUEUE_READY if value == 1 => {
                if let Err(e) = configure_queue(&mut slot.queue, &mem, slot.size, slot.desc, slot.driver, slot.device) {
                    log::warn!("virtio-mmio: queue {select} not enabled: {e}");
                }
            }
            QUEUE_READY => slot.queue.set_ready(false),
            _ => {}
        }
    }

    fn read_register(&mut self, offset: u64) -> u32 {
        match offset {
            MAGIC_VALUE => MMIO_MAGIC_VALUE,
            VERSION => MMIO_VERSION,
            DEVICE_ID => self.device.device_type(),
            VENDOR_ID => MMIO_VENDOR_ID,
            DEVICE_FEATURES => {
                let features = self.device.avail_features();
                match self.device_features_sel {
                    0 => features as u32,
                    1 => (features >> 32) as u32,
                    _ => 0,
                }
            }
            QUEUE_NUM_MAX => self.selected_queue().map_or(0, |slot| u32::from(slot.queue.max_size())),
            QUEUE_READY => self.selected_queue().map_or(0, |slot| u32::from(slot.queue.ready())),
            INTERRUPT_STATUS => self.interrupt.status(),
            STATUS => self.status,
            // No shared memory regions: their length reads as -1.
            SHM_LEN_LOW | SHM_LEN_HIGH | SHM_BASE_LOW | SHM_BASE_HIGH => u32::MAX,
            CONFIG_GENERATION => self.config_generation,
            _ => {
                log::debug!("virtio-mmio: read of unknown register {offset:#x}");
                0
            }
        }
    }
}

impl<D: VirtioDevice> BusDevice for MmioTransport<D> {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if let Some(config_offset) = offset.checked_sub(MMIO_CONFIG_OFFSET) {
            self.device.read_config(config_offset, data);
            return;
        }
        if data.len() != 4 {
            log::warn!("virtio-mmio: {}-byte read of register {offset:#x}", data.len());
            data.fill(0);
            return;
        }
        let value = self.read_register(offset);
        for (byte, v) in data.iter_mut().zip(value.to_le_bytes()) {
            *byte = v;
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let Some(config_offset) = offset.checked_sub(MMIO_CONFIG_OFFSET) {
            self.device.write_config(config_offset, data);
            return;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            log::warn!("virtio-mmio: {}-byte write of register {offset:#x} ignored", data.len());
            return;
        };
        let value = u32::from_le_bytes(bytes);
        match offset {
            DEVICE_FEATURES_SEL => self.device_features_sel = value,
            DRIVER_FEATURES => self.write_driver_features(value),
            DRIVER_FEATURES_SEL => self.driver_features_sel = value,
            QUEUE_SEL => self.queue_select = value,
            QUEUE_NUM | QUEUE_READY | QUEUE_DESC_LOW | QUEUE_DESC_HIGH | QUEUE_DRIVER_LOW | QUEUE_DRIVER_HIGH
            | QUEUE_DEVICE_LOW | QUEUE_DEVICE_HIGH => self.write_queue_register(offset, value),
            QUEUE_NOTIFY => self.notify_queue(value),
            INTERRUPT_ACK => self.interrupt.ack(value),
            STATUS => self.set_status(value),
            _ => log::warn!("virtio-mmio: write of {value:#x} to unknown or read-only register {offset:#x} ignored"),
        }
    }
}

/// The kernel command-line argument that declares a virtio-mmio device at `base` with interrupt `gsi`.
pub fn kernel_cmdline_device(base: u64, gsi: u32) -> String {
    format!("virtio_mmio.device=4K@{base:#x}:{gsi}")
}

/// Why a backend thread could not start.
#[derive(Debug, thiserror::Error)]
pub enum BackendThreadError {
    /// The device has no host-side backend to poll.
    #[error("the device has no backend to poll")]
    NoBackend,
    /// Duplicating the backend descriptor, creating the stop event or spawning the thread failed.
    #[error("cannot start the backend thread")]
    Io(#[source] io::Error),
}

fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A thread that polls a device's [`VirtioDevice::backend_fd`] and runs [`MmioTransport::process_backend`]
/// when it is readable (vsock: accepts host connections, reads host sockets, pushes RX packets into the guest).
/// Dropping it (or [`BackendThread::stop`]) stops and joins the thread.
#[derive(Debug)]
pub struct BackendThread {
    stop: Arc<StopFd>,
    handle: Option<JoinHandle<()>>,
}

impl BackendThread {
    /// Starts the thread for `transport`'s device.
    pub fn spawn<D: VirtioDevice + 'static>(
        transport: Arc<Mutex<MmioTransport<D>>>,
    ) -> Result<BackendThread, BackendThreadError> {
        let backend: OwnedFd = {
            let guard = lock(&transport);
            let fd = guard.device.backend_fd().ok_or(BackendThreadError::NoBackend)?;
            fd.try_clone_to_owned().map_err(BackendThreadError::Io)?
        };
        let stop = Arc::new(
            StopFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
                .map_err(|e| BackendThreadError::Io(e.into()))?,
        );
        let thread_stop = stop.clone();
        // In a monitor process the thread runs under the worker filter.
        let handle =
            crate::seccomp::spawn(crate::seccomp::ThreadKind::Worker, "strata-virtio-backend".into(), move || {
                backend_loop(&transport, &backend, &thread_stop)
            })
            .map_err(BackendThreadError::Io)?;
        Ok(BackendThread { stop, handle: Some(handle) })
    }

    /// Stops and joins the thread.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if let Some(handle) = self.handle.take() {
            if let Err(e) = self.stop.write(1) {
                log::error!("virtio backend thread: cannot signal stop: {e}");
            }
            if handle.join().is_err() {
                log::error!("virtio backend thread panicked");
            }
        }
    }
}

impl Drop for BackendThread {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn backend_loop<D: VirtioDevice>(transport: &Mutex<MmioTransport<D>>, backend: &OwnedFd, stop: &StopFd) {
    loop {
        let mut fds = [PollFd::new(backend.as_fd(), PollFlags::POLLIN), PollFd::new(stop.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) => {}
            Err(Errno::EINTR) => continue,
            Err(e) => {
                log::error!("virtio backend thread: poll failed: {e}");
                return;
            }
        }
        let [backend_ready, stop_ready] = fds.map(|fd| fd.revents().is_some_and(|r| !r.is_empty()));
        if stop_ready {
            return;
        }
        if backend_ready {
            lock(transport).process_backend();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::testing::Recorder;

    fn transport() -> MmioTransport<Recorder> {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).expect("memory");
        let device = Recorder { config: *b"abcdefgh", ..Recorder::default() };
        MmioTransport::new(mem, device, Interrupt::new().expect("eventfd")).expect("transport")
    }

    fn r(t: &mut MmioTransport<Recorder>, offset: u64) -> u32 {
        let mut data = [0u8; 4];
        t.read(offset, &mut data);
        u32::from_le_bytes(data)
    }

    fn w(t: &mut MmioTransport<Recorder>, offset: u64, value: u32) {
        t.write(offset, &value.to_le_bytes());
    }

    fn negotiate(t: &mut MmioTransport<Recorder>, features: u64) {
        w(t, STATUS, 0);
        w(t, STATUS, S_ACK);
        w(t, STATUS, S_ACK | S_DRIVER);
        w(t, DRIVER_FEATURES_SEL, 0);
        w(t, DRIVER_FEATURES, features as u32);
        w(t, DRIVER_FEATURES_SEL, 1);
        w(t, DRIVER_FEATURES, (features >> 32) as u32);
        w(t, STATUS, S_ACK | S_DRIVER | S_FEATURES_OK);
    }

    fn setup_queue(t: &mut MmioTransport<Recorder>, index: u32, size: u32, desc: u64, driver: u64, device: u64) {
        w(t, QUEUE_SEL, index);
        w(t, QUEUE_NUM, size);
        w(t, QUEUE_DESC_LOW, desc as u32);
        w(t, QUEUE_DESC_HIGH, (desc >> 32) as u32);
        w(t, QUEUE_DRIVER_LOW, driver as u32);
        w(t, QUEUE_DRIVER_HIGH, (driver >> 32) as u32);
        w(t, QUEUE_DEVICE_LOW, device as u32);
        w(t, QUEUE_DEVICE_HIGH, (device >> 32) as u32);
        w(t, QUEUE_READY, 1);
    }

    #[test]
    fn identity_registers() {
        let mut t = transport();
        assert_eq!(r(&mut t, MAGIC_VALUE), 0x7472_6976);
        assert_eq!(r(&mut t, VERSION), 2);
        assert_eq!(r(&mut t, DEVICE_ID), 42);
        assert_eq!(r(&mut t, VENDOR_ID), 0);
        w(&mut t, DEVICE_FEATURES_SEL, 0);
        assert_eq!(r(&mut t, DEVICE_FEATURES), 0b101);
        w(&mut t, DEVICE_FEATURES_SEL, 1);
        assert_eq!(r(&mut t, DEVICE_FEATURES), 1);
        w(&mut t, DEVICE_FEATURES_SEL, 7);
        assert_eq!(r(&mut t, DEVICE_FEATURES), 0);
        w(&mut t, QUEUE_SEL, 1);
        assert_eq!(r(&mut t, QUEUE_NUM_MAX), 8);
        w(&mut t, QUEUE_SEL, 2);
        assert_eq!(r(&mut t, QUEUE_NUM_MAX), 0);
        let mut config = [0u8; 2];
        t.read(0x106, &mut config);
        assert_eq!(&config, b"gh");
        t.read(0x107, &mut config);
        assert_eq!(&config, b"h\0");
        t.read(u64::MAX, &mut config);
        assert_eq!(config, [0, 0]);
    }

    #[test]
    fn odd_widths_and_offsets_never_panic() {
        let mut t = transport();
        for offset in [0u64, 1, 3, 0x4f, 0x50, 0xfd, 0xfe, 0xff, 0x100, 0xfff, u64::MAX - 1] {
            for len in [0usize, 1, 2, 3, 4, 8] {
                let mut data = vec![0xaa; len];
                t.read(offset, &mut data);
                t.write(offset, &data);
            }
        }
        let mut data = [0xaa; 2];
        t.read(MAGIC_VALUE, &mut data);
        assert_eq!(data, [0, 0]);
    }

    #[test]
    fn features_not_offered_are_refused() {
        let mut t = transport();
        negotiate(&mut t, VIRTIO_F_VERSION_1 | 0b10);
        assert_eq!(r(&mut t, STATUS), S_ACK | S_DRIVER, "FEATURES_OK must not stick");
        negotiate(&mut t, 0b1);
        assert_eq!(r(&mut t, STATUS), S_ACK | S_DRIVER, "a legacy driver is refused");
        w(&mut t, STATUS, 0);
        w(&mut t, STATUS, S_ACK);
        w(&mut t, STATUS, S_ACK | S_DRIVER);
        w(&mut t, DRIVER_FEATURES_SEL, 1);
        w(&mut t, DRIVER_FEATURES, 1);
        w(&mut t, DRIVER_FEATURES_SEL, 2);
        w(&mut t, DRIVER_FEATURES, 1);
        w(&mut t, STATUS, S_ACK | S_DRIVER | S_FEATURES_OK);
        assert_eq!(r(&mut t, STATUS), S_ACK | S_DRIVER, "bits above 63 are never offered");
        negotiate(&mut t, VIRTIO_F_VERSION_1 | 0b100);
        assert_eq!(r(&mut t, STATUS), S_ACK | S_DRIVER | S_FEATURES_OK);
        assert_eq!(t.acked_features(), VIRTIO_F_VERSION_1 | 0b100);
    }

    #[test]
    fn queue_ready_is_refused_for_bad_configurations() {
        let mut t = transport();
        negotiate(&mut t, VIRTIO_F_VERSION_1);
        let cases: [(u32, u64, u64, u64); 7] = [
            (0, 0x1000, 0x2000, 0x3000),  // size 0
            (12, 0x1000, 0x2000, 0x3000), // not a power of two
            (32, 0x1000, 0x2000, 0x3000), // above the maximum
            (16, 0x1008, 0x2000, 0x3000), // misaligned descriptor table
            (16, 0x1000, 0x2001, 0x3000), // misaligned available ring
            (16, 0x1000, 0x2000, 0x3002), // misaligned used ring
            (16, 0x1000, 0x2000, 0xfff0), // used ring runs past the end of memory
        ];
        for (size, desc, driver, device) in cases {
            setup_queue(&mut t, 0, size, desc, driver, device);
            assert_eq!(r(&mut t, QUEUE_READY), 0, "size {size} desc {desc:#x} driver {driver:#x} device {device:#x}");
        }
        setup_queue(&mut t, 0, 16, 0x1_0000_1000, 0x2000, 0x3000);
        assert_eq!(r(&mut t, QUEUE_READY), 0, "descriptor table above memory");
        setup_queue(&mut t, 0, 16, 0x1000, 0x2000, 0x3000);
        assert_eq!(r(&mut t, QUEUE_READY), 1);
        assert_eq!(t.queue_config(0), Some((16, true)));
        // An enabled queue's configuration is frozen.
        w(&mut t, QUEUE_NUM, 4);
        assert_eq!(t.queue_config(0), Some((16, true)));
    }

    #[test]
    fn driver_ok_activates_and_notify_processes_synchronously() {
        let mut t = transport();
        w(&mut t, QUEUE_NOTIFY, 0);
        assert!(t.device().processed.is_empty(), "no processing before activation");
        negotiate(&mut t, VIRTIO_F_VERSION_1 | 0b1);
        setup_queue(&mut t, 0, 16, 0x1000, 0x2000, 0x3000);
        w(&mut t, STATUS, S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK);
        assert!(t.is_activated());
        assert_eq!(t.device().activated, Some(VIRTIO_F_VERSION_1 | 0b1));
        w(&mut t, QUEUE_NOTIFY, 1);
        w(&mut t, QUEUE_NOTIFY, 2);
        w(&mut t, QUEUE_NOTIFY, u32::MAX);
        assert_eq!(t.device().processed, vec![1]);
        // Queue registers are frozen after DRIVER_OK.
        setup_queue(&mut t, 1, 8, 0x4000, 0x5000, 0x6000);
        assert_eq!(t.queue_config(1), Some((8, false)));
        // Interrupt status and ack.
        t.interrupt().trigger(InterruptKind::UsedBuffer);
        assert_eq!(r(&mut t, INTERRUPT_STATUS), 1);
        w(&mut t, INTERRUPT_ACK, 1);
        assert_eq!(r(&mut t, INTERRUPT_STATUS), 0);
        // Reset on 0.
        w(&mut t, STATUS, 0);
        assert_eq!(r(&mut t, STATUS), 0);
        assert!(!t.is_activated());
        assert_eq!(t.device().activated, None);
        assert_eq!(t.queue_config(0), Some((16, false)));
    }

    #[test]
    fn failed_activation_sets_needs_reset() {
        let mut t = transport();
        negotiate(&mut t, VIRTIO_F_VERSION_1);
        w(&mut t, STATUS, S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK);
        assert!(!t.is_activated());
        assert_ne!(r(&mut t, STATUS) & S_NEEDS_RESET, 0);
        assert_eq!(r(&mut t, INTERRUPT_STATUS), 2);
        assert_eq!(r(&mut t, CONFIG_GENERATION), 1);
    }

    #[test]
    fn out_of_order_status_is_ignored() {
        let mut t = transport();
        w(&mut t, STATUS, S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK);
        assert_eq!(r(&mut t, STATUS), 0);
        w(&mut t, STATUS, S_ACK);
        w(&mut t, STATUS, S_ACK | S_DRIVER | S_FEATURES_OK);
        assert_eq!(r(&mut t, STATUS), S_ACK);
        w(&mut t, STATUS, S_ACK | S_FAILED);
        assert_eq!(r(&mut t, STATUS), S_ACK | S_FAILED);
    }
}
