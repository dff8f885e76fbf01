//! The virtio devices driven by the guest-side driver of `strata_vmm::test_utils::driver`: the real virtio-mmio
//! handshake through the MMIO bus, real descriptors in real guest memory (virtio-queue's `MockSplitQueue` for the
//! descriptor table and the available ring), a real file behind virtio-blk and real Unix sockets behind
//! virtio-vsock.

#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use strata_tier_microvm::devices::virtio::Interrupt;
use strata_tier_microvm::devices::virtio::block::{BlockConfig, BlockDevice, SECTOR_SIZE};
use strata_tier_microvm::devices::virtio::mmio::MmioTransport;
use strata_tier_microvm::devices::virtio::persist::{MmioTransportConstructorArgs, Persist};
use strata_tier_microvm::devices::virtio::vsock::{MAX_QUEUED_RESETS, VsockConfig, VsockDevice};
use strata_vmm::test_utils::driver::*;
use strata_vmm::test_utils::process::shared;
use vm_memory::GuestMemoryMmap;

// ---------------------------------------------------------------------------------------------------------------
// virtio-blk

const DISK_SECTORS: u64 = 64;
/// Where block requests put their header, data and status.
const HEADER: u64 = BUFFERS;
const DATA: u64 = BUFFERS + 0x1000;
const STATUS_BYTE: u64 = BUFFERS + 0x20_0000;
const CANARY: u8 = 0x5a;

fn sector_byte(offset: u64) -> u8 {
    let sector = offset / SECTOR_SIZE;
    (sector as u8).wrapping_mul(31) ^ (offset as u8)
}

fn disk_image() -> tempfile::NamedTempFile {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    let bytes: Vec<u8> = (0..DISK_SECTORS * SECTOR_SIZE).map(sector_byte).collect();
    file.write_all(&bytes).unwrap();
    file
}

fn block_driver<'m>(mem: &'m GuestMemoryMmap, image: &tempfile::NamedTempFile) -> Driver<'m, BlockDevice> {
    let device =
        BlockDevice::new(BlockConfig { path: image.path().into(), file: None, id: Some("strata-root".into()) })
            .unwrap();
    let mut d = Driver::new(mem, device);
    let features = d.init(1, 256);
    assert_ne!(features & (1 << 5), 0, "VIRTIO_BLK_F_RO");
    d
}

/// Submits a request (header at HEADER, the given data buffers, status at STATUS_BYTE) and returns (status,
/// used length).
fn blk_request(
    d: &mut Driver<'_, BlockDevice>,
    request_type: u32,
    sector: u64,
    data: &[(u64, u32, bool)],
) -> (u8, u32) {
    d.write_blk_header(HEADER, request_type, sector);
    d.write_mem(STATUS_BYTE, &[0xee]);
    let mut chain = vec![(HEADER, 16, false)];
    chain.extend_from_slice(data);
    chain.push((STATUS_BYTE, 1, true));
    let head = d.queues[0].add_chain(&chain);
    d.notify(0);
    let used = d.queues[0].take_used();
    assert_eq!(used.len(), 1, "one request, one used entry");
    assert_eq!(used[0].0, head);
    (d.read_mem(STATUS_BYTE, 1)[0], used[0].1)
}

#[test]
fn blk_config_space_reports_capacity_and_limits() {
    let _shared = shared();
    let mem = memory();
    let image = disk_image();
    let d = block_driver(&mem, &image);
    assert_eq!(d.read(0x008), 2, "device ID: block");
    assert_eq!(u64::from_le_bytes(d.config(0, 8).try_into().unwrap()), DISK_SECTORS);
    let low = u32::from_le_bytes(d.config(0, 4).try_into().unwrap());
    let high = u32::from_le_bytes(d.config(4, 4).try_into().unwrap());
    assert_eq!(u64::from(high) << 32 | u64::from(low), DISK_SECTORS, "two 32-bit reads");
    assert_eq!(u32::from_le_bytes(d.config(12, 4).try_into().unwrap()), 128, "seg_max");
}

#[test]
fn blk_reads_known_sectors_byte_exact() {
    let _shared = shared();
    let mem = memory();
    let image = disk_image();
    let mut d = block_driver(&mem, &image);
    assert_eq!(d.interrupts(), 0);
    for (sector, lens) in [(0u64, vec![512u32]), (5, vec![2048, 1024]), (DISK_SECTORS - 8, vec![4096])] {
        let mut buffers = Vec::new();
        let mut addr = DATA;
        for &len in &lens {
            d.write_mem(addr, &vec![CANARY; len as usize]);
            buffers.push((addr, len, true));
            addr += 0x10000;
        }
        let (status, used_len) = blk_request(&mut d, BLK_T_IN, sector, &buffers);
        assert_eq!(status, BLK_S_OK);
        let total: u32 = lens.iter().sum();
        assert_eq!(used_len, total + 1, "used length is data + status");
        let mut offset = sector * SECTOR_SIZE;
        for &(addr, len, _) in &buffers {
            let expected: Vec<u8> = (offset..offset + u64::from(len)).map(sector_byte).collect();
            assert_eq!(d.read_mem(addr, len as usize), expected, "sector {sector}");
            offset += u64::from(len);
        }
        assert!(d.interrupts() >= 1, "used buffers are signalled on the irqfd");
    }
}

#[test]
fn blk_batches_several_requests_per_notification() {
    let _shared = shared();
    let mem = memory();
    let image = disk_image();
    let mut d = block_driver(&mem, &image);
    let mut heads = Vec::new();
    for i in 0..8u64 {
        let header = HEADER + i * 0x20;
        d.write_blk_header(header, BLK_T_IN, i * 2);
        let data = DATA + i * 0x1000;
        heads.push(d.queues[0].add_chain(&[(header, 16, false), (data, 1024, true), (STATUS_BYTE + i, 1, true)]));
    }
    d.notify(0);
    let used = d.queues[0].take_used();
    assert_eq!(used.iter().map(|u| u.0).collect::<Vec<_>>(), heads);
    for i in 0..8u64 {
        assert_eq!(d.read_mem(STATUS_BYTE + i, 1), [BLK_S_OK]);
        let expected: Vec<u8> = (i * 1024..(i + 1) * 1024).map(sector_byte).collect();
        assert_eq!(d.read_mem(DATA + i * 0x1000, 1024), expected);
    }
}

#[test]
fn blk_get_id_flush_write_and_unknown() {
    let _shared = shared();
    let mem = memory();
    let image = disk_image();
    let original = std::fs::read(image.path()).unwrap();
    let mut d = block_driver(&mem, &image);

    d.write_mem(DATA, &[CANARY; 32]);
    let (status, used_len) = blk_request(&mut d, BLK_T_GET_ID, 0, &[(DATA, 32, true)]);
    assert_eq!((status, used_len), (BLK_S_OK, 21));
    let mut expected = b"strata-root".to_vec();
    expected.resize(20, 0);
    expected.extend_from_slice(&[CANARY; 12]);
    assert_eq!(d.read_mem(DATA, 32), expected, "20-byte ID, nothing past it");

    assert_eq!(blk_request(&mut d, BLK_T_FLUSH, 0, &[]), (BLK_S_OK, 1));

    d.write_mem(DATA, &[0xff; 512]);
    assert_eq!(blk_request(&mut d, BLK_T_OUT, 0, &[(DATA, 512, false)]).0, BLK_S_IOERR, "the disk is read-only");
    assert_eq!(std::fs::read(image.path()).unwrap(), original, "file untouched");

    assert_eq!(blk_request(&mut d, 99, 0, &[(DATA, 512, true)]).0, BLK_S_UNSUPP);
}

#[test]
fn blk_out_of_range_reads_fail_without_touching_the_buffer() {
    let _shared = shared();
    let mem = memory();
    let image = disk_image();
    let mut d = block_driver(&mem, &image);
    for (sector, len) in [(DISK_SECTORS, 512u32), (DISK_SECTORS - 1, 1024), (u64::MAX, 512), (u64::MAX / 512, 512)] {
        d.write_mem(DATA, &vec![CANARY; len as usize]);
        let (status, used_len) = blk_request(&mut d, BLK_T_IN, sector, &[(DATA, len, true)]);
        assert_eq!((status, used_len), (BLK_S_IOERR, 1), "sector {sector}");
        assert_eq!(d.read_mem(DATA, len as usize), vec![CANARY; len as usize], "no short read into the buffer");
    }
    // The last sector itself is fine.
    assert_eq!(blk_request(&mut d, BLK_T_IN, DISK_SECTORS - 1, &[(DATA, 512, true)]).0, BLK_S_OK);
}

/// A malformed chain, described by its raw descriptors: (index, addr, len, flags, next), and the head to offer.
struct BadChain {
    what: &'static str,
    descs: Vec<(u16, u64, u32, u16, u16)>,
    head: u16,
    /// What the device must answer: `Some(status)` with used length 1, or `None` (used length 0, status byte
    /// untouched).
    expect: Option<u8>,
}

fn bad(what: &'static str, descs: Vec<(u16, u64, u32, u16, u16)>, expect: Option<u8>) -> BadChain {
    BadChain { what, descs, head: 0, expect }
}

#[test]
fn blk_malformed_chains_are_refused_without_writing_outside_them() {
    let _shared = shared();
    let mem = memory();
    let image = disk_image();
    let mut d = block_driver(&mem, &image);
    const N: u16 = F_NEXT;
    const W: u16 = F_WRITE;
    const OUTSIDE: u64 = MEM_SIZE + 0x1000;
    let data = DATA;
    let st = STATUS_BYTE;
    let cases = vec![
        bad(
            "header too short",
            vec![(0, HEADER, 8, N, 1), (1, data, 512, W | N, 2), (2, st, 1, W, 0)],
            Some(BLK_S_IOERR),
        ),
        bad(
            "header write-only",
            vec![(0, HEADER, 16, W | N, 1), (1, data, 512, W | N, 2), (2, st, 1, W, 0)],
            Some(BLK_S_IOERR),
        ),
        bad(
            "header outside memory",
            vec![(0, OUTSIDE, 16, N, 1), (1, data, 512, W | N, 2), (2, st, 1, W, 0)],
            Some(BLK_S_IOERR),
        ),
        bad("status read-only", vec![(0, HEADER, 16, N, 1), (1, data, 512, W | N, 2), (2, st, 1, 0, 0)], None),
        bad("status zero-length", vec![(0, HEADER, 16, N, 1), (1, data, 512, W | N, 2), (2, st, 0, W, 0)], None),
        bad(
            "status outside memory",
            vec![(0, HEADER, 16, N, 1), (1, data, 512, W | N, 2), (2, OUTSIDE, 1, W, 0)],
            None,
        ),
        bad("only a status", vec![(0, st, 1, W, 0)], Some(BLK_S_IOERR)),
        bad(
            "data outside memory",
            vec![(0, HEADER, 16, N, 1), (1, OUTSIDE, 512, W | N, 2), (2, st, 1, W, 0)],
            Some(BLK_S_IOERR),
        ),
        bad(
            "data straddles the end of memory",
            vec![(0, HEADER, 16, N, 1), (1, MEM_SIZE - 512, 1024, W | N, 2), (2, st, 1, W, 0)],
            Some(BLK_S_IOERR),
        ),
        bad(
            "data read-only for IN",
            vec![(0, HEADER, 16, N, 1), (1, data, 512, N, 2), (2, st, 1, W, 0)],
            Some(BLK_S_IOERR),
        ),
        bad(
            "data not sector-sized",
            vec![(0, HEADER, 16, N, 1), (1, data, 500, W | N, 2), (2, st, 1, W, 0)],
            Some(BLK_S_IOERR),
        ),
        bad(
            "data above size_max",
            vec![(0, HEADER, 16, N, 1), (1, data, 1 << 20, W | N, 2), (2, st, 1, W, 0)],
            Some(BLK_S_IOERR),
        ),
        bad(
            "lengths overflow 32 bits",
            vec![
                (0, HEADER, 16, N, 1),
                (1, data, 0xffff_fe00, W | N, 2),
                (2, data, 0xffff_fe00, W | N, 3),
                (3, st, 1, W, 0),
            ],
            None,
        ),
        bad("descriptor loop", vec![(0, HEADER, 16, N, 1), (1, data, 512, W | N, 0)], None),
        bad("next index out of range", vec![(0, HEADER, 16, N, 1), (1, data, 512, W | N, 999)], None),
        bad("next index at the table's end", vec![(0, HEADER, 16, N, 1), (1, data, 512, W | N, 256)], None),
    ];
    for case in cases {
        // Canary the whole buffer arena.
        d.write_mem(BUFFERS, &vec![CANARY; 0x21_0000]);
        d.write_blk_header(HEADER, BLK_T_IN, 0);
        for &(index, addr, len, flags, next) in &case.descs {
            d.queues[0].write_desc(index, addr, len, flags, next);
        }
        d.queues[0].publish(case.head);
        d.notify(0);
        let used = d.queues[0].take_used();
        assert_eq!(used.len(), 1, "{}: the chain is returned", case.what);
        let status = d.read_mem(STATUS_BYTE, 1)[0];
        match case.expect {
            Some(expected) => {
                assert_eq!((status, used[0].1), (expected, 1), "{}", case.what);
            }
            None => {
                assert_eq!(used[0].1, 0, "{}: used length", case.what);
                assert_eq!(status, CANARY, "{}: nothing written", case.what);
            }
        }
        // Nothing outside the status byte changed (and the data buffer only on success, never here).
        let arena = d.read_mem(BUFFERS, 0x21_0000);
        let header_end = (HEADER - BUFFERS) as usize + 16;
        for (i, &byte) in arena.iter().enumerate() {
            let at = BUFFERS + i as u64;
            if i < header_end || at == STATUS_BYTE {
                continue;
            }
            assert_eq!(byte, CANARY, "{}: byte at {at:#x} changed", case.what);
        }
    }
    // A chain far too long for seg_max is refused whole.
    let mut long = Vec::new();
    long.push((HEADER, 16, false));
    for i in 0..140u64 {
        long.push((DATA + i * 512, 512, true));
    }
    long.push((STATUS_BYTE, 1, true));
    d.write_mem(STATUS_BYTE, &[CANARY]);
    d.queues[0].add_chain(&long);
    d.notify(0);
    assert_eq!(d.queues[0].take_used()[0].1, 0, "too many segments");
    // After all that, the device still serves a good request.
    assert_eq!(blk_request(&mut d, BLK_T_IN, 3, &[(DATA, 512, true)]).0, BLK_S_OK);
}

#[test]
fn blk_hostile_avail_ring_is_survived() {
    let _shared = shared();
    let mem = memory();
    let image = disk_image();
    let mut d = block_driver(&mem, &image);
    // A head index past the table: nothing to return, nothing written.
    d.write_mem(STATUS_BYTE, &[CANARY]);
    d.queues[0].publish(999);
    d.notify(0);
    assert!(d.queues[0].take_used().is_empty());
    // The available index jumps by more than the queue size: the device processes nothing.
    let before = d.queues[0].avail_idx;
    d.queues[0].set_avail_idx(before.wrapping_add(300));
    d.notify(0);
    assert!(d.queues[0].take_used().is_empty());
    assert_eq!(d.read_mem(STATUS_BYTE, 1), [CANARY]);
    // Back to sane: requests work again.
    d.queues[0].set_avail_idx(before);
    assert_eq!(blk_request(&mut d, BLK_T_IN, 1, &[(DATA, 512, true)]).0, BLK_S_OK);
}

#[test]
fn blk_snapshot_restore_continues_the_ring() {
    let _shared = shared();
    let mem = memory();
    let image = disk_image();
    let mut d = block_driver(&mem, &image);
    for sector in 0..5 {
        assert_eq!(blk_request(&mut d, BLK_T_IN, sector, &[(DATA, 512, true)]).0, BLK_S_OK);
    }
    let (transport_state, block_state) = {
        let t = d.transport();
        (t.save(), t.device().save())
    };
    assert_eq!(transport_state.queues[0].next_avail, 5);
    assert_eq!(transport_state.queues[0].next_used, 5);
    // Rebuild from the states, in order: device, then transport.
    let device = BlockDevice::restore(
        strata_tier_microvm::devices::virtio::block::persist::BlockConstructorArgs::at(image.path()),
        &block_state,
    )
    .unwrap();
    let args = MmioTransportConstructorArgs { mem: mem.clone(), device, interrupt: Interrupt::new().unwrap() };
    let restored = MmioTransport::restore(args, &transport_state).unwrap();
    assert!(restored.is_activated());
    let queues = std::mem::take(&mut d.queues);
    let mut d = Driver::with_transport(&mem, Arc::new(Mutex::new(restored)));
    d.queues = queues;
    assert_eq!(d.read(0x070), ACK | DRIVER | FEATURES_OK | DRIVER_OK);
    d.write_mem(DATA, &[0; 512]);
    assert_eq!(blk_request(&mut d, BLK_T_IN, 7, &[(DATA, 512, true)]).0, BLK_S_OK);
    let expected: Vec<u8> = (7 * 512..8 * 512).map(sector_byte).collect();
    assert_eq!(d.read_mem(DATA, 512), expected);
    assert!(d.interrupts() >= 1, "the new interrupt line is used");
}

#[test]
fn blk_reset_and_reinit() {
    let _shared = shared();
    let mem = memory();
    let image = disk_image();
    let mut d = block_driver(&mem, &image);
    assert_eq!(blk_request(&mut d, BLK_T_IN, 0, &[(DATA, 512, true)]).0, BLK_S_OK);
    d.write(STATUS, 0);
    assert!(!d.transport().is_activated());
    d.notify(0);
    d.init(1, 64);
    assert_eq!(blk_request(&mut d, BLK_T_IN, 9, &[(DATA, 512, true)]).0, BLK_S_OK);
}

// ---------------------------------------------------------------------------------------------------------------
// virtio-vsock

const GUEST_CID: u64 = 3;

struct VsockSetup {
    dir: tempfile::TempDir,
}

impl VsockSetup {
    fn new() -> VsockSetup {
        VsockSetup { dir: tempfile::tempdir().unwrap() }
    }

    fn uds(&self) -> std::path::PathBuf {
        self.dir.path().join("v.sock")
    }

    fn driver<'m>(&self, mem: &'m GuestMemoryMmap) -> (Driver<'m, VsockDevice>, VsockGuest) {
        let device = VsockDevice::new(VsockConfig { guest_cid: GUEST_CID, uds_path: self.uds() }).unwrap();
        let mut d = Driver::new(mem, device);
        d.init(3, 128);
        assert_eq!(d.read(0x008), 19, "device ID: vsock");
        assert_eq!(u64::from_le_bytes(d.config(0, 8).try_into().unwrap()), GUEST_CID);
        let mut guest = VsockGuest::new(GUEST_CID, 64 * 1024);
        guest.post_rx(&mut d, 32);
        d.notify(RX);
        (d, guest)
    }
}

/// Waits for the next packets the guest receives.
fn recv_some(d: &mut Driver<'_, VsockDevice>, guest: &mut VsockGuest) -> Vec<Received> {
    let mut got = Vec::new();
    d.pump_until(|d| {
        got = guest.recv(d);
        !got.is_empty()
    });
    got
}

fn read_line(stream: &mut UnixStream) -> String {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while byte != [b'\n'] {
        stream.read_exact(&mut byte).unwrap();
        line.push(byte[0]);
    }
    String::from_utf8(line).unwrap()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed) ^ (i >> 8) as u8).collect()
}

/// Host-initiated connection up to the `OK` line; returns (host stream, host port, guest port).
fn host_connect(
    setup: &VsockSetup,
    d: &mut Driver<'_, VsockDevice>,
    guest: &mut VsockGuest,
    guest_port: u32,
) -> (UnixStream, u32) {
    let mut host = UnixStream::connect(setup.uds()).unwrap();
    host.write_all(format!("CONNECT {guest_port}\n").as_bytes()).unwrap();
    let got = recv_some(d, guest);
    assert_eq!(got.len(), 1);
    let req = got[0].hdr;
    assert_eq!(
        (req.op, req.src_cid, req.dst_cid, req.dst_port, req.type_),
        (OP_REQUEST, HOST_CID, GUEST_CID, guest_port, 1)
    );
    assert!(req.src_port >= 1 << 30, "host port from the muxer's range");
    assert_eq!(got[0].used_len, 44);
    guest.send(d, guest.hdr(OP_RESPONSE, guest_port, req.src_port), &[]);
    host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(read_line(&mut host), format!("OK {}\n", req.src_port));
    (host, req.src_port)
}

#[test]
fn vsock_host_initiated_connection_carries_data_both_ways() {
    let _shared = shared();
    let mem = memory();
    let setup = VsockSetup::new();
    let (mut d, mut guest) = setup.driver(&mem);
    d.interrupts();
    let (mut host, host_port) = host_connect(&setup, &mut d, &mut guest, 1234);
    assert!(d.interrupts() >= 1, "RX delivery is signalled");
    assert_eq!(d.transport().device().connection_count(), 1);

    // Host → guest: 300 KB, more than one RX buffer and more than the guest's credit (256 KiB) at once.
    let sent = pattern(300_000, 1);
    let writer = {
        let mut host = host.try_clone().unwrap();
        let sent = sent.clone();
        std::thread::spawn(move || host.write_all(&sent).unwrap())
    };
    let mut received = Vec::new();
    let mut fwd_cnt = 0u32;
    d.pump_until(|d| {
        for p in guest.recv(d) {
            assert_eq!((p.hdr.op, p.hdr.src_port, p.hdr.dst_port), (OP_RW, host_port, 1234), "{p:?}");
            assert!(p.hdr.len <= 64 * 1024);
            assert_eq!(p.used_len, 44 + p.hdr.len);
            received.extend_from_slice(&p.data);
            // The guest application consumed it: tell the host side.
            fwd_cnt += p.hdr.len;
            let mut update = guest.hdr(OP_CREDIT_UPDATE, 1234, host_port);
            update.fwd_cnt = fwd_cnt;
            guest.send(d, update, &[]);
        }
        received.len() >= sent.len()
    });
    writer.join().unwrap();
    assert_eq!(received, sent, "host → guest byte-exact");

    // Guest → host: 200 KB in 64 KiB packets.
    let data = pattern(200_000, 9);
    let reader = {
        let mut host = host.try_clone().unwrap();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 200_000];
            host.read_exact(&mut buf).unwrap();
            buf
        })
    };
    for chunk in data.chunks(64 * 1024) {
        let mut hdr = guest.hdr(OP_RW, 1234, host_port);
        hdr.len = chunk.len() as u32;
        hdr.fwd_cnt = fwd_cnt;
        guest.send(&mut d, hdr, chunk);
    }
    // Whatever the host socket did not take at once is flushed by the backend.
    let reader_done = Arc::new(Mutex::new(None));
    {
        let done = reader_done.clone();
        std::thread::spawn(move || *done.lock().unwrap() = Some(reader.join().unwrap()));
    }
    d.pump_until(|_| reader_done.lock().unwrap().is_some());
    assert_eq!(reader_done.lock().unwrap().take().unwrap(), data, "guest → host byte-exact");
    let credit: Vec<Received> = guest.recv(&mut d);
    assert!(credit.iter().all(|p| p.hdr.op == OP_CREDIT_UPDATE), "{credit:?}");

    // Credit request → credit update with the forwarded count.
    guest.send(&mut d, guest.hdr(OP_CREDIT_REQUEST, 1234, host_port), &[]);
    let got = recv_some(&mut d, &mut guest);
    let last = got.last().unwrap().hdr;
    assert_eq!(last.op, OP_CREDIT_UPDATE);
    assert_eq!(last.fwd_cnt, 200_000);
    assert_eq!(last.buf_alloc, 256 * 1024);

    // Guest closes: SHUTDOWN both ways → the device answers RST and closes the host stream.
    let mut shutdown = guest.hdr(OP_SHUTDOWN, 1234, host_port);
    shutdown.flags = 3;
    guest.send(&mut d, shutdown, &[]);
    let got = recv_some(&mut d, &mut guest);
    assert_eq!(got[0].hdr.op, OP_RST);
    let mut rest = Vec::new();
    assert_eq!(host.read_to_end(&mut rest).unwrap(), 0, "host sees EOF");
    assert_eq!(d.transport().device().connection_count(), 0);
}

#[test]
fn vsock_host_half_close_lets_the_guest_answer() {
    let _shared = shared();
    let mem = memory();
    let setup = VsockSetup::new();
    let (mut d, mut guest) = setup.driver(&mem);
    let (mut host, host_port) = host_connect(&setup, &mut d, &mut guest, 80);
    host.write_all(b"ping").unwrap();
    host.shutdown(std::net::Shutdown::Write).unwrap();
    let mut got = Vec::new();
    d.pump_until(|d| {
        got.extend(guest.recv(d));
        got.len() >= 2
    });
    assert_eq!((got[0].hdr.op, got[0].data.as_slice()), (OP_RW, &b"ping"[..]));
    assert_eq!((got[1].hdr.op, got[1].hdr.flags), (OP_SHUTDOWN, 2), "the host only stopped sending");
    let mut hdr = guest.hdr(OP_RW, 80, host_port);
    hdr.len = 4;
    guest.send(&mut d, hdr, b"pong");
    let mut buf = [0u8; 4];
    host.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"pong");
    let mut close = guest.hdr(OP_SHUTDOWN, 80, host_port);
    close.flags = 3;
    guest.send(&mut d, close, &[]);
    assert_eq!(guest.recv(&mut d)[0].hdr.op, OP_RST);
    let mut rest = Vec::new();
    assert_eq!(host.read_to_end(&mut rest).unwrap(), 0);
}

#[test]
fn vsock_host_hang_up_delivers_everything_as_credit_allows() {
    let _shared = shared();
    let mem = memory();
    let setup = VsockSetup::new();
    let (mut d, mut guest) = setup.driver(&mem);
    // The guest only has 16 KiB of receive buffer for this connection.
    let mut host = UnixStream::connect(setup.uds()).unwrap();
    host.write_all(b"CONNECT 81\n").unwrap();
    let req = recv_some(&mut d, &mut guest)[0].hdr;
    let mut response = guest.hdr(OP_RESPONSE, 81, req.src_port);
    response.buf_alloc = 16 * 1024;
    guest.send(&mut d, response, &[]);
    host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert!(read_line(&mut host).starts_with("OK "));
    // The host writes 100 KB; the guest takes its 16 KiB and gives no credit back yet.
    let sent = pattern(100_000, 3);
    host.write_all(&sent).unwrap();
    let mut received = Vec::new();
    d.pump_until(|d| {
        received.extend(guest.recv(d).into_iter().flat_map(|p| p.data));
        received.len() == 16 * 1024
    });
    // The host hangs up while the guest has no credit: what it wrote must still arrive.
    drop(host);
    for _ in 0..10 {
        d.transport().process_backend();
    }
    assert_eq!(d.transport().device().connection_count(), 1, "kept until its data is delivered");
    let (mut fwd_cnt, mut shutdown) = (0u32, None);
    d.pump_until(|d| {
        for p in guest.recv(d) {
            match p.hdr.op {
                OP_RW => {
                    assert!(received.len() as u32 + p.hdr.len <= fwd_cnt + 16 * 1024, "credit respected");
                    received.extend_from_slice(&p.data);
                }
                OP_SHUTDOWN => shutdown = Some(p.hdr.flags),
                other => panic!("unexpected op {other}"),
            }
        }
        // The guest application reads slowly: credit comes back in 4 KiB steps.
        if (received.len() as u32) > fwd_cnt {
            fwd_cnt = (fwd_cnt + 4096).min(received.len() as u32);
            let mut update = guest.hdr(OP_CREDIT_UPDATE, 81, req.src_port);
            update.buf_alloc = 16 * 1024;
            update.fwd_cnt = fwd_cnt;
            guest.send(d, update, &[]);
        }
        shutdown.is_some()
    });
    assert_eq!(received, sent, "nothing lost to the hang-up");
    assert_eq!(shutdown, Some(3));
    guest.send(&mut d, guest.hdr(OP_RST, 81, req.src_port), &[]);
    assert_eq!(d.transport().device().connection_count(), 0);
}

#[test]
fn vsock_host_initiated_connection_refused_by_guest() {
    let _shared = shared();
    let mem = memory();
    let setup = VsockSetup::new();
    let (mut d, mut guest) = setup.driver(&mem);
    let mut host = UnixStream::connect(setup.uds()).unwrap();
    host.write_all(b"CONNECT 77\n").unwrap();
    let req = recv_some(&mut d, &mut guest)[0].hdr;
    assert_eq!(req.op, OP_REQUEST);
    guest.send(&mut d, guest.hdr(OP_RST, 77, req.src_port), &[]);
    let mut rest = Vec::new();
    host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(host.read_to_end(&mut rest).unwrap(), 0, "host stream closed");
    assert_eq!(d.transport().device().connection_count(), 0);

    // A malformed CONNECT line gets the stream closed.
    let mut host = UnixStream::connect(setup.uds()).unwrap();
    host.write_all(b"HELLO 77\n").unwrap();
    host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut rest = Vec::new();
    for _ in 0..5 {
        d.transport().process_backend();
    }
    assert_eq!(host.read_to_end(&mut rest).unwrap(), 0);
    assert_eq!(d.transport().device().connection_count(), 0);
}

#[test]
fn vsock_guest_initiated_connection() {
    let _shared = shared();
    let mem = memory();
    let setup = VsockSetup::new();
    let listener = UnixListener::bind(format!("{}_5000", setup.uds().display())).unwrap();
    let (mut d, mut guest) = setup.driver(&mem);

    guest.send(&mut d, guest.hdr(OP_REQUEST, 40_000, 5000), &[]);
    let got = guest.recv(&mut d);
    assert_eq!(got.len(), 1, "RESPONSE delivered in the TX notification itself");
    let resp = got[0].hdr;
    assert_eq!((resp.op, resp.src_port, resp.dst_port, resp.dst_cid), (OP_RESPONSE, 5000, 40_000, GUEST_CID));
    let (mut host, _) = listener.accept().unwrap();
    host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();

    let mut hdr = guest.hdr(OP_RW, 40_000, 5000);
    hdr.len = 5;
    guest.send(&mut d, hdr, b"hello");
    let mut buf = [0u8; 5];
    host.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"hello");

    host.write_all(b"world").unwrap();
    let got = recv_some(&mut d, &mut guest);
    assert_eq!((got[0].hdr.op, got[0].data.as_slice()), (OP_RW, &b"world"[..]));

    // The host closes: the guest gets SHUTDOWN, answers RST, the connection is gone.
    drop(host);
    let got = recv_some(&mut d, &mut guest);
    assert_eq!((got[0].hdr.op, got[0].hdr.flags), (OP_SHUTDOWN, 3));
    guest.send(&mut d, guest.hdr(OP_RST, 40_000, 5000), &[]);
    assert_eq!(d.transport().device().connection_count(), 0);

    // Nobody listens on port 5001: RST.
    guest.send(&mut d, guest.hdr(OP_REQUEST, 40_001, 5001), &[]);
    let got = guest.recv(&mut d);
    assert_eq!((got[0].hdr.op, got[0].hdr.src_port, got[0].hdr.dst_port), (OP_RST, 5001, 40_001));
}

#[test]
fn vsock_hostile_packets_get_rst_or_are_dropped() {
    let _shared = shared();
    let mem = memory();
    let setup = VsockSetup::new();
    let (mut d, mut guest) = setup.driver(&mem);

    // Wrong source CID, wrong destination CID: dropped silently.
    let mut h = guest.hdr(OP_REQUEST, 1, 2);
    h.src_cid = 99;
    guest.send(&mut d, h, &[]);
    let mut h = guest.hdr(OP_REQUEST, 1, 2);
    h.dst_cid = 7;
    guest.send(&mut d, h, &[]);
    assert!(guest.recv(&mut d).is_empty());

    // Unknown op, a non-STREAM type, RW and SHUTDOWN for unknown connections: RST each.
    let mut seqpacket = guest.hdr(OP_REQUEST, 10, 11);
    seqpacket.type_ = 2;
    let unknown_op = guest.hdr(99, 12, 13);
    let mut rw = guest.hdr(OP_RW, 14, 15);
    rw.len = 3;
    for (h, data) in [(seqpacket, &b""[..]), (unknown_op, b""), (rw, b"abc"), (guest.hdr(OP_SHUTDOWN, 16, 17), b"")] {
        guest.send(&mut d, h, data);
    }
    let got = guest.recv(&mut d);
    let rsts: Vec<(u16, u32, u32)> = got.iter().map(|p| (p.hdr.op, p.hdr.dst_port, p.hdr.src_port)).collect();
    assert_eq!(rsts, vec![(OP_RST, 10, 11), (OP_RST, 12, 13), (OP_RST, 14, 15), (OP_RST, 16, 17)]);
    // An RST for an unknown connection gets nothing back.
    guest.send(&mut d, guest.hdr(OP_RST, 18, 19), &[]);
    assert!(guest.recv(&mut d).is_empty());

    // Malformed TX chains: the header claims more data than the descriptor holds, more than 64 KiB, a short or
    // write-only header descriptor, a header outside memory.
    let before = d.transport().device().metrics();
    let mut lying = guest.hdr(OP_RW, 20, 21);
    lying.len = 1000;
    guest.send(&mut d, lying, b"short");
    let mut huge = guest.hdr(OP_RW, 20, 21);
    huge.len = 1 << 20;
    guest.send(&mut d, huge, b"x");
    let base = VsockGuest::TX_AREA + 0x100_0000;
    d.write_mem(base, &guest.hdr(OP_REQUEST, 22, 23).to_bytes());
    d.queues[TX as usize].add_chain(&[(base, 20, false)]);
    d.queues[TX as usize].add_chain(&[(base, 44, true)]);
    d.queues[TX as usize].add_chain(&[(MEM_SIZE + 0x10, 44, false)]);
    d.queues[TX as usize].add_chain(&[(MEM_SIZE - 20, 44, false)]);
    d.notify(TX);
    let after = d.transport().device().metrics();
    assert_eq!(after.tx_malformed - before.tx_malformed, 6);
    assert_eq!(d.queues[TX as usize].take_used().len() as u64, after.tx_packets + after.tx_malformed);
    assert!(guest.recv(&mut d).is_empty(), "malformed chains are dropped");
}

#[test]
fn vsock_rx_buffers_without_room_for_a_header_are_returned_empty() {
    let _shared = shared();
    let mem = memory();
    let setup = VsockSetup::new();
    let device = VsockDevice::new(VsockConfig { guest_cid: GUEST_CID, uds_path: setup.uds() }).unwrap();
    let mut d = Driver::new(&mem, device);
    d.init(3, 256);
    let small = d.queues[RX as usize].add_chain(&[(VsockGuest::RX_AREA, 20, true)]);
    let read_only = d.queues[RX as usize].add_chain(&[(VsockGuest::RX_AREA + 0x1000, 4096, false)]);
    let outside = d.queues[RX as usize].add_chain(&[(MEM_SIZE + 0x1000, 4096, true)]);
    let mut guest = VsockGuest::new(GUEST_CID, 4096);
    guest.send(&mut d, guest.hdr(OP_RW, 30, 31), &[]);
    let used = d.queues[RX as usize].take_used();
    assert_eq!(used, vec![(small, 0), (read_only, 0), (outside, 0)]);
    assert_eq!(d.transport().device().metrics().rx_malformed, 3);
    // The RST is still waiting, and goes out in the next usable buffer.
    d.queues[RX as usize].add_chain(&[(VsockGuest::RX_AREA + 0x2000, 128, true)]);
    d.notify(RX);
    let used = d.queues[RX as usize].take_used();
    assert_eq!(used.len(), 1);
    assert_eq!(used[0].1, 44);
    assert_eq!(Hdr::from_bytes(&d.read_mem(VsockGuest::RX_AREA + 0x2000, 44)).op, OP_RST);
}

#[test]
fn vsock_flood_is_bounded() {
    let _shared = shared();
    let mem = memory();
    let setup = VsockSetup::new();
    let device = VsockDevice::new(VsockConfig { guest_cid: GUEST_CID, uds_path: setup.uds() }).unwrap();
    let mut d = Driver::new(&mem, device);
    d.init(3, 256);
    let mut guest = VsockGuest::new(GUEST_CID, 4096);
    // 5000 connection requests to ports nobody listens on, with no RX buffer to answer in.
    for i in 0..5000u32 {
        guest.queue_tx(&mut d, guest.hdr(OP_REQUEST, 10_000 + i, 1 + i % 7), &[]);
        if i % 128 == 127 {
            d.notify(TX);
        }
    }
    d.notify(TX);
    assert_eq!(d.transport().device().metrics().tx_packets, 5000);
    assert_eq!(d.transport().device().connection_count(), 0);
    // Only the capped number of RSTs comes out once buffers arrive.
    guest.post_rx(&mut d, 64);
    d.notify(RX);
    let mut rsts = 0;
    loop {
        let got = guest.recv(&mut d);
        if got.is_empty() {
            break;
        }
        assert!(got.iter().all(|p| p.hdr.op == OP_RST));
        rsts += got.len();
    }
    assert_eq!(rsts, MAX_QUEUED_RESETS);
}

#[test]
fn vsock_guest_overrunning_its_credit_is_reset() {
    let _shared = shared();
    let mem = memory();
    let setup = VsockSetup::new();
    let (mut d, mut guest) = setup.driver(&mem);
    let (host, host_port) = host_connect(&setup, &mut d, &mut guest, 600);
    // The host never reads: the socket buffer fills, then the device's 256 KiB, then the guest is over.
    let chunk = vec![7u8; 64 * 1024];
    let mut reset = false;
    for _ in 0..64 {
        let mut hdr = guest.hdr(OP_RW, 600, host_port);
        hdr.len = chunk.len() as u32;
        guest.send(&mut d, hdr, &chunk);
        if guest.recv(&mut d).iter().any(|p| p.hdr.op == OP_RST) {
            reset = true;
            break;
        }
    }
    assert!(reset, "a guest ignoring its credit is reset");
    assert_eq!(d.transport().device().connection_count(), 0);
    drop(host);
}

#[test]
fn vsock_device_reset_drops_connections() {
    let _shared = shared();
    let mem = memory();
    let setup = VsockSetup::new();
    let (mut d, mut guest) = setup.driver(&mem);
    let (mut host, _) = host_connect(&setup, &mut d, &mut guest, 42);
    assert_eq!(d.transport().device().connection_count(), 1);
    d.write(STATUS, 0);
    assert_eq!(d.transport().device().connection_count(), 0);
    let mut rest = Vec::new();
    assert_eq!(host.read_to_end(&mut rest).unwrap(), 0, "host stream closed on reset");
    // The device comes back after a new handshake and accepts new connections.
    d.init(3, 128);
    let mut guest = VsockGuest::new(GUEST_CID, 64 * 1024);
    guest.post_rx(&mut d, 8);
    d.notify(RX);
    let (_host, _) = host_connect(&setup, &mut d, &mut guest, 43);
}

#[test]
fn vsock_backend_thread_pushes_rx_and_signals() {
    use strata_tier_microvm::devices::virtio::mmio::BackendThread;
    let _shared = shared();
    let mem = memory();
    let setup = VsockSetup::new();
    let (mut d, mut guest) = setup.driver(&mem);
    d.interrupts();
    let backend = BackendThread::spawn(d.transport.clone()).unwrap();
    let mut host = UnixStream::connect(setup.uds()).unwrap();
    host.write_all(b"CONNECT 9\n").unwrap();
    // No pumping from the test: the backend thread does it.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while d.queues[RX as usize].used_idx() == 0 {
        assert!(std::time::Instant::now() < deadline, "backend thread delivered nothing");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(d.interrupt.irqfd().read().unwrap() >= 1, "irqfd signalled by the backend thread");
    let got = guest.recv(&mut d);
    assert_eq!(got[0].hdr.op, OP_REQUEST);
    backend.stop();
}

#[test]
fn vsock_snapshot_restore_sends_transport_reset() {
    use strata_tier_microvm::devices::virtio::vsock::persist::VsockConstructorArgs;
    let _shared = shared();
    let mem = memory();
    let setup = VsockSetup::new();
    let (mut d, mut guest) = setup.driver(&mem);
    // The guest posts an event buffer.
    let event_buf = 0x300_0000u64;
    d.write_mem(event_buf, &[0xff; 4]);
    let head = d.queues[2].add_chain(&[(event_buf, 4, true)]);
    d.notify(2);
    let (_host, _) = host_connect(&setup, &mut d, &mut guest, 5);
    let (transport_state, vsock_state) = {
        let t = d.transport();
        (t.save(), t.device().save())
    };
    let queues = std::mem::take(&mut d.queues);
    drop(d);
    // A fork: new socket, new CID.
    let args = VsockConstructorArgs { uds_path: setup.dir.path().join("fork.sock"), guest_cid: Some(4) };
    let device = VsockDevice::restore(args, &vsock_state).unwrap();
    assert_eq!(device.connection_count(), 0, "connections are not part of a snapshot");
    let args = MmioTransportConstructorArgs { mem: mem.clone(), device, interrupt: Interrupt::new().unwrap() };
    let restored = MmioTransport::restore(args, &transport_state).unwrap();
    assert!(!restored.device().transport_reset_pending(), "the event went out at activation");
    let mut d = Driver::with_transport(&mem, Arc::new(Mutex::new(restored)));
    d.queues = queues;
    assert_eq!(u64::from_le_bytes(d.config(0, 8).try_into().unwrap()), 4, "the fork's CID");
    assert_eq!(d.queues[2].take_used(), vec![(head, 4)]);
    assert_eq!(d.read_mem(event_buf, 4), [0, 0, 0, 0], "VIRTIO_VSOCK_EVENT_TRANSPORT_RESET");
    assert!(d.interrupts() >= 1);
    // The fork's socket serves new connections.
    let mut host = UnixStream::connect(setup.dir.path().join("fork.sock")).unwrap();
    host.write_all(b"CONNECT 5\n").unwrap();
    guest.cid = 4;
    let got = recv_some(&mut d, &mut guest);
    assert_eq!((got[0].hdr.op, got[0].hdr.dst_cid), (OP_REQUEST, 4));
}

/// The egress tunnel's host half: a guest stream to port 1028 is connected by the muxer to `<uds>_1028`, where a
/// sandbox's egress proxy listens; the proxy judges what the guest sends.
#[test]
fn vsock_guest_streams_to_the_egress_port_reach_the_egress_proxy() {
    use strata_egress::{Allowlist, EgressConfig, EgressProxy};
    let _shared = shared();
    let origin = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let origin_port = origin.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in origin.incoming() {
            let mut stream = stream.unwrap();
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).is_ok_and(|n| n == 1) {
                head.push(byte[0]);
            }
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello");
        }
    });
    let mem = memory();
    let setup = VsockSetup::new();
    let port = strata_guest_proto::EGRESS_PORT;
    let allow = Allowlist::parse([format!("127.0.0.1:{origin_port}")]).unwrap();
    let proxy =
        EgressProxy::start(EgressConfig::new(allow).with_unix_socket(format!("{}_{port}", setup.uds().display())))
            .unwrap();
    let (mut d, mut guest) = setup.driver(&mem);

    let mut fetch = |guest_port: u32, host: &str| -> String {
        guest.send(&mut d, guest.hdr(OP_REQUEST, guest_port, port), &[]);
        assert_eq!(guest.recv(&mut d)[0].hdr.op, OP_RESPONSE);
        let request = format!("GET http://{host}/ HTTP/1.1\r\nHost: {host}\r\n\r\n");
        let mut hdr = guest.hdr(OP_RW, guest_port, port);
        hdr.len = request.len() as u32;
        guest.send(&mut d, hdr, request.as_bytes());
        let mut answer = Vec::new();
        loop {
            let got = recv_some(&mut d, &mut guest);
            answer.extend(got.iter().filter(|p| p.hdr.op == OP_RW).flat_map(|p| p.data.clone()));
            if got.iter().any(|p| p.hdr.op == OP_SHUTDOWN || p.hdr.op == OP_RST) {
                break;
            }
        }
        guest.send(&mut d, guest.hdr(OP_RST, guest_port, port), &[]);
        String::from_utf8_lossy(&answer).into_owned()
    };
    let allowed = fetch(40_000, &format!("127.0.0.1:{origin_port}"));
    assert!(allowed.starts_with("HTTP/1.1 200") && allowed.ends_with("hello"), "{allowed}");
    let denied = fetch(40_001, "example.com:80");
    assert!(denied.starts_with("HTTP/1.1 403"), "{denied}");
    let records = proxy.drain_records_settled(Duration::from_secs(2)).records;
    let verdicts: Vec<&str> = records.iter().map(|r| r.verdict.as_str()).collect();
    assert_eq!(verdicts, ["allowed", "denied"], "{records:?}");
}
