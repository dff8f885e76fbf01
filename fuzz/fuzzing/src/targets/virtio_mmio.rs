//! The virtio-mmio transport's registers (`tiers/microvm/vmm/src/devices/virtio/mmio.rs`), as a hostile driver
//! writes them: any register, any width, any value, any order, queue notifications included, around a block and
//! a vsock device.
//!
//! Input: a device byte, then accesses of 6 bytes each (offset and width byte, 4 value bytes... see [`run`]).
//!
//! Oracles: nothing panics; the identification registers never change; an activated device accepted
//! `VIRTIO_F_VERSION_1` and nothing that was not offered; every ready queue has a power-of-two size no larger
//! than its maximum; `InterruptStatus` holds only defined bits.

use strata_tier_microvm::devices::bus::BusDevice;
use strata_tier_microvm::devices::virtio::block::{BlockConfig, BlockDevice};
use strata_tier_microvm::devices::virtio::mmio::{MMIO_MAGIC_VALUE, MmioTransport};
use strata_tier_microvm::devices::virtio::vsock::{VsockConfig, VsockDevice};
use strata_tier_microvm::devices::virtio::{INTERRUPT_STATUS_MASK, Interrupt, VIRTIO_F_VERSION_1, VirtioDevice};

use crate::generate::Cursor;
use crate::virtio::Guest;

/// Runs the accesses in `data`.
pub fn run(data: &[u8]) {
    let mut input = Cursor::new(data);
    if input.u8().is_multiple_of(2) {
        let path = super::virtio_block::disk_path();
        let device = BlockDevice::new(BlockConfig { path, file: None, id: None }).expect("the device");
        drive(device, &mut input);
    } else {
        let uds = crate::scratch::dir().join("mmio.sock");
        let _ = std::fs::remove_file(&uds);
        let device = VsockDevice::new(VsockConfig { guest_cid: 3, uds_path: uds }).expect("the device");
        drive(device, &mut input);
    }
}

fn drive<D: VirtioDevice>(device: D, input: &mut Cursor<'_>) {
    let offered = device.avail_features();
    let maxima = device.queue_max_sizes().to_vec();
    let guest = Guest::new(&[]);
    let mut transport =
        MmioTransport::new(guest.mem.clone(), device, Interrupt::new().expect("an eventfd")).expect("the transport");
    for _ in 0..256 {
        if input.is_empty() {
            break;
        }
        // Offset (a register, or any offset in the window), width, then the value.
        let op = input.u8();
        let offset = if op & 0x80 == 0 { u64::from(op & 0x3f) * 4 } else { u64::from(input.u16()) };
        let width = [4usize, 4, 4, 1, 2, 8, 0, 3][usize::from((op >> 4) & 7)];
        let value = input.u32().to_le_bytes();
        let mut bytes = [value[0], value[1], value[2], value[3], 0, 0, 0, 0];
        if op & 0x40 == 0 {
            transport.write(offset, &bytes[..width]);
        } else {
            transport.read(offset, &mut bytes[..width]);
        }
        let mut word = [0u8; 4];
        transport.read(0, &mut word);
        assert_eq!(u32::from_le_bytes(word), MMIO_MAGIC_VALUE);
        assert_eq!(transport.interrupt().status() & !INTERRUPT_STATUS_MASK, 0);
        if transport.is_activated() {
            let acked = transport.acked_features();
            assert!(acked & VIRTIO_F_VERSION_1 != 0, "activated without VERSION_1");
            assert_eq!(acked & !offered, 0, "activated with features never offered: {acked:#x}");
        }
        for (index, max) in maxima.iter().enumerate() {
            if let Some((size, true)) = transport.queue_config(index) {
                assert!(size.is_power_of_two() && size <= *max, "queue {index} ready with size {size}");
            }
        }
    }
}
