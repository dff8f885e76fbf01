//! A virtio driver for the device targets: guest memory, the virtio-mmio handshake through the transport's
//! registers (as a Linux driver makes it), and descriptor chains laid out with virtio-queue's own driver-side
//! mock ([`MockSplitQueue`], behind its `test-utils` feature) from a generator's choices.
//!
//! The oracle every device target shares, [`Guest::check_writes`]: a device writes guest memory only inside
//! the device-writable buffers the driver gave it and the used rings.

use arbitrary::{Result, Unstructured};
use strata_tier_microvm::devices::bus::BusDevice;
use strata_tier_microvm::devices::virtio::VirtioDevice;
use strata_tier_microvm::devices::virtio::mmio::MmioTransport;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// Guest memory size.
pub const MEM_SIZE: usize = 256 * 1024;
/// Where buffers live: above every queue's rings.
pub const BUFFERS: u64 = 0x2_0000;
/// `VIRTQ_DESC_F_NEXT`, `_WRITE`, `_INDIRECT`.
pub const F_NEXT: u16 = 1;
/// The buffer is device-writable.
pub const F_WRITE: u16 = 2;
/// The buffer is an indirect table.
pub const F_INDIRECT: u16 = 4;

// virtio-mmio registers (virtio 1.2, 4.2.2).
const DRIVER_FEATURES: u64 = 0x020;
const DRIVER_FEATURES_SEL: u64 = 0x024;
const QUEUE_SEL: u64 = 0x030;
const QUEUE_NUM: u64 = 0x038;
const QUEUE_READY: u64 = 0x044;
/// `QueueNotify`.
pub const QUEUE_NOTIFY: u64 = 0x050;
const STATUS: u64 = 0x070;
const QUEUE_DESC_LOW: u64 = 0x080;
const QUEUE_DRIVER_LOW: u64 = 0x090;
const QUEUE_DEVICE_LOW: u64 = 0x0a0;

/// A guest: its memory and where each queue's rings are.
#[derive(Debug)]
pub struct Guest {
    /// The memory the device sees.
    pub mem: GuestMemoryMmap,
    /// Each queue: (size, start of its descriptor table).
    pub queues: Vec<(u16, u64)>,
}

impl Guest {
    /// Zeroed memory, queues of `sizes` laid out from address 0, 16 KiB apart.
    pub fn new(sizes: &[u16]) -> Guest {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).expect("guest memory");
        let queues = sizes.iter().enumerate().map(|(i, &size)| (size, i as u64 * 0x4000)).collect();
        Guest { mem, queues }
    }

    /// The driver's view of queue `index`.
    pub fn queue(&self, index: usize) -> MockSplitQueue<'_, GuestMemoryMmap> {
        let (size, start) = self.queues[index];
        MockSplitQueue::create(&self.mem, GuestAddress(start), size)
    }

    /// Drives the transport through reset, feature negotiation (everything offered, as accepted), queue setup and
    /// DRIVER_OK, as a driver does.
    pub fn set_up<D: VirtioDevice>(&self, transport: &mut MmioTransport<D>, features: u64) {
        let write = |t: &mut MmioTransport<D>, offset: u64, value: u32| t.write(offset, &value.to_le_bytes());
        write(transport, STATUS, 0);
        write(transport, STATUS, 1);
        write(transport, STATUS, 3);
        write(transport, DRIVER_FEATURES_SEL, 0);
        write(transport, DRIVER_FEATURES, features as u32);
        write(transport, DRIVER_FEATURES_SEL, 1);
        write(transport, DRIVER_FEATURES, (features >> 32) as u32);
        write(transport, STATUS, 3 | 8);
        for index in 0..self.queues.len() {
            let queue = self.queue(index);
            write(transport, QUEUE_SEL, index as u32);
            write(transport, QUEUE_NUM, u32::from(self.queues[index].0));
            for (low, addr) in [
                (QUEUE_DESC_LOW, queue.desc_table_addr()),
                (QUEUE_DRIVER_LOW, queue.avail_addr()),
                (QUEUE_DEVICE_LOW, queue.used_addr()),
            ] {
                write(transport, low, addr.0 as u32);
                write(transport, low + 4, (addr.0 >> 32) as u32);
            }
            write(transport, QUEUE_READY, 1);
        }
        write(transport, STATUS, 3 | 8 | 4);
    }

    /// Queue `index`'s used elements so far: (descriptor id, length).
    pub fn used(&self, index: usize) -> Vec<(u32, u32)> {
        let (size, _) = self.queues[index];
        let ring = self.queue(index).used_addr().0;
        let idx: u16 = self.mem.read_obj(GuestAddress(ring + 2)).expect("the used index");
        (0..u64::from(idx.min(size)))
            .map(|i| {
                let at = ring + 4 + 8 * i;
                let id: u32 = self.mem.read_obj(GuestAddress(at)).expect("a used element");
                let len: u32 = self.mem.read_obj(GuestAddress(at + 4)).expect("a used element");
                (id, len)
            })
            .collect()
    }

    /// A copy of memory, to compare with after the device ran.
    pub fn snapshot(&self) -> Vec<u8> {
        let mut copy = vec![0; MEM_SIZE];
        self.mem.read_slice(&mut copy, GuestAddress(0)).expect("read guest memory");
        copy
    }

    /// Every byte that changed since `before` lies in a device-writable buffer of a descriptor table (an
    /// indirect one included) or in a used ring, as they were in `before`: a guest may place a buffer over its
    /// own rings, and the device may then overwrite the descriptor that allowed it.
    pub fn check_writes(&self, before: &[u8]) {
        let after = self.snapshot();
        let read = |at: u64| -> Option<Descriptor> {
            let at = usize::try_from(at).ok()?;
            let raw: [u8; 16] = before.get(at..at.checked_add(16)?)?.try_into().ok()?;
            let [a0, a1, a2, a3, a4, a5, a6, a7, l0, l1, l2, l3, f0, f1, n0, n1] = raw;
            Some(Descriptor::new(
                u64::from_le_bytes([a0, a1, a2, a3, a4, a5, a6, a7]),
                u32::from_le_bytes([l0, l1, l2, l3]),
                u16::from_le_bytes([f0, f1]),
                u16::from_le_bytes([n0, n1]),
            ))
        };
        let mut allowed: Vec<(u64, u64)> = Vec::new();
        let writable = |d: &Descriptor, allowed: &mut Vec<(u64, u64)>| {
            if d.flags() & F_WRITE != 0 {
                allowed.push((d.addr().0, d.addr().0.saturating_add(u64::from(d.len()))));
            }
        };
        for index in 0..self.queues.len() {
            let queue = self.queue(index);
            let used = queue.used_addr().0;
            allowed.push((used, used + 6 + 8 * u64::from(self.queues[index].0)));
            let table = queue.desc_table_addr().0;
            for slot in 0..u64::from(self.queues[index].0) {
                let Some(d) = read(table + 16 * slot) else { continue };
                writable(&d, &mut allowed);
                if d.flags() & F_INDIRECT != 0 {
                    for entry in 0..u64::from(d.len() / 16).min(256) {
                        if let Some(inner) = read(d.addr().0.saturating_add(16 * entry)) {
                            writable(&inner, &mut allowed);
                        }
                    }
                }
            }
        }
        // Page by page (a comparison of slices), then byte by byte where a page changed: the byte loop is
        // instrumented code, and most pages never change.
        for (page, (a, b)) in before.chunks(4096).zip(after.chunks(4096)).enumerate() {
            if a == b {
                continue;
            }
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                let offset = (page * 4096 + i) as u64;
                if x != y {
                    assert!(
                        allowed.iter().any(|&(start, end)| (start..end).contains(&offset)),
                        "the device wrote guest memory at {offset:#x}, outside every writable buffer and used ring"
                    );
                }
            }
        }
    }
}

/// One descriptor as a generator picks it: mostly a buffer inside memory, now and then on or past its edges.
pub fn descriptor(u: &mut Unstructured<'_>, table_len: u16, len: u32, write: bool) -> Result<RawDescriptor> {
    let addr = match u.int_in_range(0u8..=15)? {
        0 => u.arbitrary()?,
        1 => MEM_SIZE as u64 - u64::from(u.int_in_range(0u16..=64)?),
        2 => 0,
        _ => BUFFERS + u64::from(u.int_in_range(0u32..=(MEM_SIZE as u32 - BUFFERS as u32))?),
    };
    let len = if u.ratio(1, 16)? { u.arbitrary()? } else { len };
    let mut flags = if write { F_WRITE } else { 0 };
    if u.ratio(1, 16)? {
        flags ^= u.arbitrary::<u16>()? & (F_WRITE | F_INDIRECT);
    }
    let next = if u.ratio(1, 16)? { u.arbitrary()? } else { u.int_in_range(0..=table_len.saturating_sub(1))? };
    Ok(RawDescriptor::from(Descriptor::new(addr, len, flags, next)))
}

/// Writes `chains` into queue `index`'s table one after the other (each linked with NEXT unless the generator
/// broke the link) and makes their heads available.
pub fn post_chains(guest: &Guest, index: usize, chains: &[Vec<RawDescriptor>]) {
    let queue = guest.queue(index);
    let size = guest.queues[index].0;
    let mut flat: Vec<RawDescriptor> = Vec::new();
    for chain in chains {
        for (i, raw) in chain.iter().enumerate() {
            if flat.len() >= usize::from(size) {
                break;
            }
            let d = Descriptor::from(*raw);
            let last = i + 1 == chain.len();
            // Linked to the next slot unless the generator chose its own `next` (a loop, a bad index).
            let keep_next = d.next() != 0 && d.next() as usize != flat.len() + 1;
            let (flags, next) = match (last, keep_next) {
                (true, false) => (d.flags() & !F_NEXT, 0),
                (true, true) | (false, true) => (d.flags() | F_NEXT, d.next()),
                (false, false) => (d.flags() | F_NEXT, flat.len() as u16 + 1),
            };
            flat.push(RawDescriptor::from(Descriptor::new(d.addr().0, d.len(), flags, next)));
        }
    }
    if !flat.is_empty() {
        let _ = queue.add_desc_chains(&flat, 0);
    }
}

/// Writes `bytes` into guest memory at `addr` (ignored past its end).
pub fn poke(guest: &Guest, addr: u64, bytes: &[u8]) {
    let _ = guest.mem.write_slice(bytes, GuestAddress(addr));
}
