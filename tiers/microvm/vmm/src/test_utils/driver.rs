//! The guest side of the virtio devices: a minimal virtio-mmio driver over guest memory.
//!
//! [`Driver`] puts a device behind an [`MmioTransport`] on an MMIO bus and makes the whole handshake through its
//! registers; each [`GuestQueue`] lays real descriptors out in guest memory with virtio-queue's own driver-side
//! mock ([`MockSplitQueue`]) for the descriptor table and the available ring. [`VsockGuest`] is the guest half
//! of a vsock driver (RX buffers, TX packets, [`Hdr`]); the `BLK_*` constants and [`Driver::write_blk_header`]
//! make virtio-blk requests. Nothing here runs a vCPU: [`Driver::pump_until`] does what a backend thread would.
//!
//! [`write_reg`], [`read_reg`] and [`activate`] are the bare handshake for a transport inside a tiny machine,
//! whose rings a test only needs to be valid.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use virtio_queue::desc::RawDescriptor;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::mock::{MockSplitQueue, UsedRing};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::devices::bus::{Bus, BusDevice};
use crate::devices::virtio::mmio::{MMIO_LEN, MmioTransport};
use crate::devices::virtio::{Interrupt, VirtioDevice};

/// Where the device sits on the MMIO bus.
pub const MMIO_BASE: u64 = 0xd000_0000;
/// Guest RAM.
pub const MEM_SIZE: u64 = 64 << 20;
/// Queue `i`'s rings live at `QUEUE_AREA * (i + 1)`.
pub const QUEUE_AREA: u64 = 0x1_0000;
/// Buffers start here.
pub const BUFFERS: u64 = 0x10_0000;

/// `VIRTQ_DESC_F_NEXT`: the chain goes on.
pub const F_NEXT: u16 = 1;
/// `VIRTQ_DESC_F_WRITE`: the buffer is device-writable.
pub const F_WRITE: u16 = 2;

/// The `Status` register's offset.
pub const STATUS: u64 = 0x70;
/// `Status`: ACKNOWLEDGE.
pub const ACK: u32 = 1;
/// `Status`: DRIVER.
pub const DRIVER: u32 = 2;
/// `Status`: DRIVER_OK.
pub const DRIVER_OK: u32 = 4;
/// `Status`: FEATURES_OK.
pub const FEATURES_OK: u32 = 8;

/// Guest RAM of [`MEM_SIZE`] bytes from address 0.
pub fn memory() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)]).expect("guest memory")
}

/// One virtqueue as the driver sees it.
pub struct GuestQueue<'m> {
    /// Descriptor table and available ring.
    pub vq: MockSplitQueue<'m, GuestMemoryMmap>,
    /// The used ring. (The mock's own is placed over the end of its available ring for queues larger than a
    /// handful of entries: `SplitQueueRing::end` counts elements, not bytes.)
    pub used: UsedRing<'m, GuestMemoryMmap>,
    /// Where the used ring is.
    pub used_addr: u64,
    /// The queue size.
    pub size: u16,
    next_desc: u16,
    /// The available index the driver published last.
    pub avail_idx: u16,
    used_seen: u16,
}

impl fmt::Debug for GuestQueue<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuestQueue")
            .field("desc_table", &self.vq.desc_table_addr())
            .field("avail", &self.vq.avail_addr())
            .field("used_addr", &self.used_addr)
            .field("size", &self.size)
            .field("next_desc", &self.next_desc)
            .field("avail_idx", &self.avail_idx)
            .field("used_seen", &self.used_seen)
            .finish()
    }
}

impl<'m> GuestQueue<'m> {
    fn new(mem: &'m GuestMemoryMmap, base: u64, size: u16) -> GuestQueue<'m> {
        let vq = MockSplitQueue::create(mem, GuestAddress(base), size);
        let used_addr = (vq.avail_addr().0 + 6 + 2 * u64::from(size) + 0xff) & !0xff;
        let used = UsedRing::new(mem, GuestAddress(used_addr), size);
        GuestQueue { vq, used, used_addr, size, next_desc: 0, avail_idx: 0, used_seen: 0 }
    }

    /// Writes descriptor `index` as is.
    pub fn write_desc(&self, index: u16, addr: u64, len: u32, flags: u16, next: u16) {
        self.vq
            .desc_table()
            .store(index, RawDescriptor::from(Descriptor::new(addr, len, flags, next)))
            .expect("descriptor index inside the table");
    }

    /// Offers chain `head` in the available ring.
    pub fn publish(&mut self, head: u16) {
        self.vq
            .avail()
            .ring()
            .ref_at(usize::from(self.avail_idx % self.size))
            .expect("available ring slot")
            .store(head);
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.vq.avail().idx().store(self.avail_idx);
    }

    /// Sets the available index the device sees to anything.
    pub fn set_avail_idx(&mut self, idx: u16) {
        self.avail_idx = idx;
        self.vq.avail().idx().store(idx);
    }

    /// Builds a chain of (address, length, device-writable) buffers from the next free descriptors and offers
    /// it; returns its head.
    pub fn add_chain(&mut self, buffers: &[(u64, u32, bool)]) -> u16 {
        let head = self.next_desc;
        let count = buffers.len() as u16;
        for (i, &(addr, len, writable)) in buffers.iter().enumerate() {
            let index = (head + i as u16) % self.size;
            let last = i as u16 + 1 == count;
            let flags = if writable { F_WRITE } else { 0 } | if last { 0 } else { F_NEXT };
            self.write_desc(index, addr, len, flags, if last { 0 } else { (index + 1) % self.size });
        }
        self.next_desc = (head + count) % self.size;
        self.publish(head);
        head
    }

    /// Used entries the device added since the last call: (head, length).
    pub fn take_used(&mut self) -> Vec<(u16, u32)> {
        let idx = self.used.idx().load();
        let mut out = Vec::new();
        while self.used_seen != idx {
            let elem = self.used.ring().ref_at(usize::from(self.used_seen % self.size)).expect("used ring slot").load();
            out.push((elem.id() as u16, elem.len()));
            self.used_seen = self.used_seen.wrapping_add(1);
        }
        out
    }

    /// The used ring's index as the device left it.
    pub fn used_idx(&self) -> u16 {
        self.used.idx().load()
    }
}

/// A driver bound to one device.
pub struct Driver<'m, D: VirtioDevice + 'static> {
    /// Guest memory, shared with the transport.
    pub mem: &'m GuestMemoryMmap,
    /// The MMIO bus the transport is on, at [`MMIO_BASE`].
    pub bus: Bus,
    /// The transport.
    pub transport: Arc<Mutex<MmioTransport<D>>>,
    /// The transport's interrupt line.
    pub interrupt: Interrupt,
    /// The queues [`Driver::init`] set up.
    pub queues: Vec<GuestQueue<'m>>,
}

impl<D: VirtioDevice + 'static> fmt::Debug for Driver<'_, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Driver").field("queues", &self.queues).finish_non_exhaustive()
    }
}

impl<'m, D: VirtioDevice + 'static> Driver<'m, D> {
    /// Puts `device` behind a transport on a bus.
    pub fn new(mem: &'m GuestMemoryMmap, device: D) -> Driver<'m, D> {
        let interrupt = Interrupt::new().expect("interrupt eventfd");
        let transport = MmioTransport::new(mem.clone(), device, interrupt).expect("transport");
        Driver::with_transport(mem, Arc::new(Mutex::new(transport)))
    }

    /// A driver for an existing transport (a restored one, say).
    pub fn with_transport(mem: &'m GuestMemoryMmap, transport: Arc<Mutex<MmioTransport<D>>>) -> Driver<'m, D> {
        let interrupt = transport.lock().expect("transport lock").interrupt().clone();
        let mut bus = Bus::new();
        bus.insert(transport.clone(), MMIO_BASE, MMIO_LEN).expect("transport on the bus");
        Driver { mem, bus, transport, interrupt, queues: Vec::new() }
    }

    /// The transport, locked.
    pub fn transport(&self) -> MutexGuard<'_, MmioTransport<D>> {
        self.transport.lock().expect("transport lock")
    }

    /// A 32-bit register read through the bus.
    pub fn read(&self, offset: u64) -> u32 {
        let mut data = [0u8; 4];
        assert!(self.bus.read(MMIO_BASE + offset, &mut data), "nothing on the bus at register {offset:#x}");
        u32::from_le_bytes(data)
    }

    /// A 32-bit register write through the bus.
    pub fn write(&self, offset: u64, value: u32) {
        assert!(self.bus.write(MMIO_BASE + offset, &value.to_le_bytes()), "nothing on the bus at register {offset:#x}");
    }

    /// `len` bytes of the device configuration space from `offset`.
    pub fn config(&self, offset: u64, len: usize) -> Vec<u8> {
        let mut data = vec![0u8; len];
        assert!(self.bus.read(MMIO_BASE + 0x100 + offset, &mut data), "nothing on the bus at config {offset:#x}");
        data
    }

    /// The whole handshake: reset, ACKNOWLEDGE, DRIVER, accept every offered feature, FEATURES_OK, every queue at
    /// `min(max, queue_size)`, DRIVER_OK. Returns the accepted features.
    pub fn init(&mut self, num_queues: u32, queue_size: u16) -> u64 {
        assert_eq!(self.read(0x000), 0x7472_6976, "magic");
        assert_eq!(self.read(0x004), 2, "version");
        self.write(STATUS, 0);
        assert_eq!(self.read(STATUS), 0);
        self.write(STATUS, ACK);
        self.write(STATUS, ACK | DRIVER);
        self.write(0x014, 0);
        let low = self.read(0x010);
        self.write(0x014, 1);
        let high = self.read(0x010);
        let features = u64::from(high) << 32 | u64::from(low);
        self.write(0x024, 0);
        self.write(0x020, low);
        self.write(0x024, 1);
        self.write(0x020, high);
        self.write(STATUS, ACK | DRIVER | FEATURES_OK);
        assert_eq!(self.read(STATUS), ACK | DRIVER | FEATURES_OK, "features accepted");
        self.queues.clear();
        for i in 0..num_queues {
            self.write(0x030, i);
            assert_eq!(self.read(0x044), 0, "queue {i} starts disabled");
            let max = self.read(0x034) as u16;
            assert!(max > 0, "queue {i} exists");
            let size = max.min(queue_size);
            let queue = GuestQueue::new(self.mem, QUEUE_AREA * (u64::from(i) + 1), size);
            self.write(0x038, u32::from(size));
            let (desc, avail, used) = (queue.vq.desc_table_addr().0, queue.vq.avail_addr().0, queue.used_addr);
            for (offset, value) in [(0x080, desc), (0x090, avail), (0x0a0, used)] {
                self.write(offset, value as u32);
                self.write(offset + 4, (value >> 32) as u32);
            }
            self.write(0x044, 1);
            assert_eq!(self.read(0x044), 1, "queue {i} enabled");
            self.queues.push(queue);
        }
        self.write(STATUS, ACK | DRIVER | FEATURES_OK | DRIVER_OK);
        assert_eq!(self.read(STATUS), ACK | DRIVER | FEATURES_OK | DRIVER_OK, "device live");
        features
    }

    /// Notifies queue `queue` (`QueueNotify`): the device processes it before this returns.
    pub fn notify(&self, queue: u32) {
        self.write(0x050, queue);
    }

    /// Interrupts signalled on the irqfd since the last call (acknowledging them).
    pub fn interrupts(&self) -> u64 {
        let count = self.interrupt.irqfd().read().unwrap_or(0);
        let status = self.read(0x060);
        self.write(0x064, status);
        count
    }

    /// Writes `bytes` to guest memory at `addr`.
    pub fn write_mem(&self, addr: u64, bytes: &[u8]) {
        self.mem.write_slice(bytes, GuestAddress(addr)).expect("write inside guest memory");
    }

    /// Reads `len` bytes of guest memory at `addr`.
    pub fn read_mem(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        self.mem.read_slice(&mut out, GuestAddress(addr)).expect("read inside guest memory");
        out
    }

    /// Writes a virtio-blk request header at `addr`: `request_type` (`BLK_T_*`) at `sector`.
    pub fn write_blk_header(&self, addr: u64, request_type: u32, sector: u64) {
        let mut header = [0u8; 16];
        header[..4].copy_from_slice(&request_type.to_le_bytes());
        header[8..].copy_from_slice(&sector.to_le_bytes());
        self.write_mem(addr, &header);
    }

    /// Runs the backend (as a backend thread would) until `done` holds; panics after 5 s.
    pub fn pump_until(&mut self, mut done: impl FnMut(&mut Self) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            self.transport().process_backend();
            if done(self) {
                return;
            }
            assert!(Instant::now() < deadline, "timed out waiting for the device");
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// virtio-blk request type: read (virtio 1.2, 5.2.6).
pub const BLK_T_IN: u32 = 0;
/// virtio-blk request type: write.
pub const BLK_T_OUT: u32 = 1;
/// virtio-blk request type: flush.
pub const BLK_T_FLUSH: u32 = 4;
/// virtio-blk request type: get the device ID.
pub const BLK_T_GET_ID: u32 = 8;
/// virtio-blk status: done.
pub const BLK_S_OK: u8 = 0;
/// virtio-blk status: I/O error.
pub const BLK_S_IOERR: u8 = 1;
/// virtio-blk status: unsupported request.
pub const BLK_S_UNSUPP: u8 = 2;

/// A vsock packet header (virtio 1.2, 5.10.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Hdr {
    /// Source CID.
    pub src_cid: u64,
    /// Destination CID.
    pub dst_cid: u64,
    /// Source port.
    pub src_port: u32,
    /// Destination port.
    pub dst_port: u32,
    /// Payload length.
    pub len: u32,
    /// Socket type (1: STREAM).
    pub type_: u16,
    /// Operation (`OP_*`).
    pub op: u16,
    /// SHUTDOWN flags (1: no more receiving, 2: no more sending).
    pub flags: u32,
    /// The sender's receive buffer.
    pub buf_alloc: u32,
    /// Bytes the sender has consumed.
    pub fwd_cnt: u32,
}

impl Hdr {
    /// The 44 bytes on the wire.
    pub fn to_bytes(self) -> [u8; 44] {
        let mut b = [0u8; 44];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.type_.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }

    /// Parses the header at the start of `b`; panics when `b` is shorter than 44 bytes.
    pub fn from_bytes(b: &[u8]) -> Hdr {
        let b: &[u8; 44] = b.get(..44).and_then(|b| b.try_into().ok()).expect("a vsock header is 44 bytes");
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let u16_at = |o: usize| u16::from_le_bytes(b[o..o + 2].try_into().expect("2 bytes"));
        Hdr {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            type_: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        }
    }
}

/// vsock operation: connection request.
pub const OP_REQUEST: u16 = 1;
/// vsock operation: connection accepted.
pub const OP_RESPONSE: u16 = 2;
/// vsock operation: reset.
pub const OP_RST: u16 = 3;
/// vsock operation: shutdown.
pub const OP_SHUTDOWN: u16 = 4;
/// vsock operation: data.
pub const OP_RW: u16 = 5;
/// vsock operation: credit update.
pub const OP_CREDIT_UPDATE: u16 = 6;
/// vsock operation: credit request.
pub const OP_CREDIT_REQUEST: u16 = 7;
/// The host's CID.
pub const HOST_CID: u64 = 2;
/// The vsock RX queue.
pub const RX: u32 = 0;
/// The vsock TX queue.
pub const TX: u32 = 1;

/// The guest half of a vsock driver: RX buffers (header + data descriptors) and TX slots.
#[derive(Debug)]
pub struct VsockGuest {
    /// The guest's CID.
    pub cid: u64,
    /// RX buffers by head index: (header address, data address).
    rx_buffers: HashMap<u16, (u64, u64)>,
    /// Each RX buffer's data length.
    pub rx_data_len: u32,
    rx_base: u64,
    tx_base: u64,
    tx_slot: u64,
    tx_slots: u64,
}

/// A packet the guest received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// Its header.
    pub hdr: Hdr,
    /// Its payload (empty when the used length did not cover it).
    pub data: Vec<u8>,
    /// The used length the device reported.
    pub used_len: u32,
}

impl VsockGuest {
    /// Where RX buffers go.
    pub const RX_AREA: u64 = 0x40_0000;
    /// Where TX packets go.
    pub const TX_AREA: u64 = 0x200_0000;

    /// A guest with CID `cid` whose RX buffers take `rx_data_len` bytes of payload each.
    pub fn new(cid: u64, rx_data_len: u32) -> VsockGuest {
        VsockGuest {
            cid,
            rx_buffers: HashMap::new(),
            rx_data_len,
            rx_base: VsockGuest::RX_AREA,
            tx_base: VsockGuest::TX_AREA,
            tx_slot: 0,
            tx_slots: 64,
        }
    }

    fn rx_stride(&self) -> u64 {
        (u64::from(self.rx_data_len) + 64 + 0xfff) & !0xfff
    }

    /// Posts `count` RX buffers (a 44-byte header descriptor and a data descriptor each).
    pub fn post_rx<D: VirtioDevice>(&mut self, d: &mut Driver<'_, D>, count: usize) {
        let rx = &mut d.queues[RX as usize];
        for _ in 0..count {
            let slot = rx.next_desc / 2;
            let hdr = self.rx_base + u64::from(slot) * self.rx_stride();
            let data = hdr + 64;
            let head = rx.add_chain(&[(hdr, 44, true), (data, self.rx_data_len, true)]);
            self.rx_buffers.insert(head, (hdr, data));
        }
    }

    /// Packets the device delivered since the last call; their buffers are posted again.
    pub fn recv<D: VirtioDevice>(&mut self, d: &mut Driver<'_, D>) -> Vec<Received> {
        let used = d.queues[RX as usize].take_used();
        let mut out = Vec::new();
        for &(head, used_len) in &used {
            let (hdr_addr, data_addr) =
                *self.rx_buffers.get(&head).expect("the device used an RX buffer the guest posted");
            let hdr = Hdr::from_bytes(&d.read_mem(hdr_addr, 44));
            let len = hdr.len.min(self.rx_data_len) as usize;
            let data = if used_len as usize >= 44 + len { d.read_mem(data_addr, len) } else { Vec::new() };
            out.push(Received { hdr, data, used_len });
        }
        self.post_rx(d, used.len());
        if !used.is_empty() {
            d.notify(RX);
        }
        out
    }

    /// Queues a packet on TX without notifying; returns the chain head.
    pub fn queue_tx<D: VirtioDevice>(&mut self, d: &mut Driver<'_, D>, hdr: Hdr, data: &[u8]) -> u16 {
        let stride = 0x1_1000;
        let base = self.tx_base + (self.tx_slot % self.tx_slots) * stride;
        self.tx_slot += 1;
        d.write_mem(base, &hdr.to_bytes());
        if data.is_empty() {
            d.queues[TX as usize].add_chain(&[(base, 44, false)])
        } else {
            d.write_mem(base + 64, data);
            d.queues[TX as usize].add_chain(&[(base, 44, false), (base + 64, data.len() as u32, false)])
        }
    }

    /// Sends one packet (queue + notify).
    pub fn send<D: VirtioDevice>(&mut self, d: &mut Driver<'_, D>, hdr: Hdr, data: &[u8]) {
        self.queue_tx(d, hdr, data);
        d.notify(TX);
    }

    /// A STREAM header from this guest to the host.
    pub fn hdr(&self, op: u16, src_port: u32, dst_port: u32) -> Hdr {
        Hdr {
            src_cid: self.cid,
            dst_cid: HOST_CID,
            src_port,
            dst_port,
            type_: 1,
            op,
            buf_alloc: 256 * 1024,
            ..Hdr::default()
        }
    }
}

/// A 32-bit little-endian register write, as a driver makes it.
pub fn write_reg(device: &mut dyn BusDevice, offset: u64, value: u32) {
    device.write(offset, &value.to_le_bytes());
}

/// A 32-bit register read.
pub fn read_reg(device: &mut dyn BusDevice, offset: u64) -> u32 {
    let mut data = [0u8; 4];
    device.read(offset, &mut data);
    u32::from_le_bytes(data)
}

/// ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK.
pub const STATUS_LIVE: u32 = 0xf;

/// Drives a transport through the virtio-mmio handshake from the host, as a guest driver would: every queue set
/// up with `size` entries in guest RAM from `rings` on (0x3000 bytes a queue), then DRIVER_OK.
pub fn activate(device: &mut dyn BusDevice, queues: u32, size: u32, rings: u64) {
    for status in [0, 1, 3] {
        write_reg(device, 0x70, status);
    }
    write_reg(device, 0x24, 1); // DriverFeaturesSel: page 1
    write_reg(device, 0x20, 1); // VIRTIO_F_VERSION_1
    write_reg(device, 0x70, 0xb); // FEATURES_OK
    for q in 0..queues {
        let base = rings + u64::from(q) * 0x3000;
        write_reg(device, 0x30, q);
        write_reg(device, 0x38, size);
        write_reg(device, 0x80, base as u32);
        write_reg(device, 0x90, (base + 0x1000) as u32);
        write_reg(device, 0xa0, (base + 0x2000) as u32);
        write_reg(device, 0x44, 1);
    }
    write_reg(device, 0x70, STATUS_LIVE);
}
