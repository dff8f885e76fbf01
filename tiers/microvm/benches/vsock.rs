//! Throughput of the virtio devices driven by the in-process guest driver of `strata_vmm::test_utils`: vsock
//! guest → host and host → guest (64 KiB packets, several per notification, a real Unix socket and a host thread
//! on the other end), and virtio-blk reads of a page-cached file. Each figure is printed beside its peer measured
//! in the same run (the same bytes through a bare Unix socket pair; `pread` of the same file into a buffer) and
//! the ratio; the vsock target is ≥ 1 GB/s.
//!
//! `STRATA_BENCH_MB` sets the bytes moved per figure (default 2048).

use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use strata_tier_microvm::devices::virtio::block::{BlockConfig, BlockDevice};
use strata_tier_microvm::devices::virtio::vsock::{VsockConfig, VsockDevice};
use strata_vmm::test_utils::driver::*;

const PACKET: u32 = 64 * 1024;
const PER_NOTIFY: usize = 8;
const GUEST_CID: u64 = 3;
const GUEST_PORT: u32 = 1000;
const TARGET_MB_S: f64 = 1000.0;

fn mb_s(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64() / 1e6
}

/// A live connection: the driver, the guest half, the host stream and the host port.
fn connect<'m>(
    mem: &'m vm_memory::GuestMemoryMmap,
    dir: &tempfile::TempDir,
    rx_buffers: usize,
    guest_buf_alloc: u32,
) -> (Driver<'m, VsockDevice>, VsockGuest, UnixStream, u32) {
    let uds = dir.path().join("v.sock");
    let device = VsockDevice::new(VsockConfig { guest_cid: GUEST_CID, uds_path: uds.clone() }).expect("vsock device");
    let mut d = Driver::new(mem, device);
    d.init(3, 256);
    let mut guest = VsockGuest::new(GUEST_CID, PACKET);
    guest.post_rx(&mut d, rx_buffers);
    d.notify(RX);
    let mut host = UnixStream::connect(&uds).expect("connect");
    host.write_all(format!("CONNECT {GUEST_PORT}\n").as_bytes()).expect("CONNECT");
    let mut request = None;
    d.pump_until(|d| {
        request = guest.recv(d).into_iter().next();
        request.is_some()
    });
    let host_port = request.expect("request").hdr.src_port;
    let mut response = guest.hdr(OP_RESPONSE, GUEST_PORT, host_port);
    response.buf_alloc = guest_buf_alloc;
    guest.send(&mut d, response, &[]);
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while byte != [b'\n'] {
        host.read_exact(&mut byte).expect("OK line");
        line.push(byte[0]);
    }
    assert!(line.starts_with(b"OK "));
    (d, guest, host, host_port)
}

fn guest_to_host(total: u64) -> f64 {
    let mem = memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut d, mut guest, host, host_port) = connect(&mem, &dir, 64, 256 * 1024);
    // The guest's payload, written once: every packet points at one of these slots.
    let slots: Vec<u64> = (0..PER_NOTIFY as u64).map(|i| 0x200_0000 + i * 0x2_0000).collect();
    for (i, &slot) in slots.iter().enumerate() {
        d.write_mem(slot + 64, &vec![i as u8; PACKET as usize]);
    }
    let reader = std::thread::spawn(move || {
        let mut host = host;
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0u64;
        while got < total {
            match host.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => got += n as u64,
                Err(e) => panic!("host read: {e}"),
            }
        }
        (got, Instant::now())
    });
    let start = Instant::now();
    let (mut sent, mut peer_fwd, peer_alloc) = (0u64, 0u32, 256 * 1024u32);
    while sent < total {
        let mut queued = 0;
        while queued < PER_NOTIFY && sent < total {
            let in_flight = (sent as u32).wrapping_sub(peer_fwd);
            if peer_alloc.saturating_sub(in_flight) < PACKET {
                break;
            }
            let slot = slots[queued];
            let mut hdr = guest.hdr(OP_RW, GUEST_PORT, host_port);
            hdr.len = PACKET;
            d.write_mem(slot, &hdr.to_bytes());
            d.queues[TX as usize].add_chain(&[(slot, 44, false), (slot + 64, PACKET, false)]);
            sent += u64::from(PACKET);
            queued += 1;
        }
        if queued > 0 {
            d.notify(TX);
            d.queues[TX as usize].take_used();
        } else {
            // Out of credit: the host socket is full; let the backend flush (as the backend thread would).
            d.transport().process_backend();
        }
        for p in guest.recv(&mut d) {
            peer_fwd = p.hdr.fwd_cnt;
        }
    }
    // What the host socket could not take yet is still in the device: flush it (as the backend thread would)
    // until the reader has it all, or joining the reader waits forever.
    while !reader.is_finished() {
        d.transport().process_backend();
        std::thread::yield_now();
    }
    let (got, end) = reader.join().expect("reader");
    assert_eq!(got, total);
    mb_s(total, end - start)
}

fn host_to_guest(total: u64) -> f64 {
    let mem = memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let buf_alloc = 4 << 20;
    let (mut d, mut guest, host, host_port) = connect(&mem, &dir, 64, buf_alloc);
    let writer = std::thread::spawn(move || {
        let mut host = host;
        let chunk = vec![0xa5u8; 256 * 1024];
        let mut left = total;
        while left > 0 {
            let n = left.min(chunk.len() as u64) as usize;
            host.write_all(&chunk[..n]).expect("host write");
            left -= n as u64;
        }
        host
    });
    let start = Instant::now();
    let (mut received, mut reported) = (0u64, 0u64);
    while received < total {
        d.transport().process_backend();
        for p in guest.recv(&mut d) {
            assert_eq!(p.hdr.op, OP_RW);
            received += u64::from(p.hdr.len);
        }
        if received - reported >= 1 << 20 {
            reported = received;
            let mut update = guest.hdr(OP_CREDIT_UPDATE, GUEST_PORT, host_port);
            update.buf_alloc = buf_alloc;
            update.fwd_cnt = received as u32;
            guest.send(&mut d, update, &[]);
            d.queues[TX as usize].take_used();
        }
    }
    let elapsed = start.elapsed();
    drop(writer.join().expect("writer"));
    mb_s(total, elapsed)
}

/// The peer: the same bytes through a bare Unix socket pair, 64 KiB writes, a reader thread.
fn socketpair(total: u64) -> f64 {
    let (mut a, b) = UnixStream::pair().expect("pair");
    let reader = std::thread::spawn(move || {
        let mut b = b;
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0u64;
        while got < total {
            got += b.read(&mut buf).expect("read") as u64;
        }
    });
    let chunk = vec![1u8; PACKET as usize];
    let start = Instant::now();
    let mut sent = 0u64;
    while sent < total {
        a.write_all(&chunk).expect("write");
        sent += u64::from(PACKET);
    }
    reader.join().expect("reader");
    mb_s(total, start.elapsed())
}

const BLK_FILE: u64 = 128 << 20;
const BLK_REQUEST: u32 = 256 * 1024;
const BLK_PER_NOTIFY: u64 = 32;

fn blk_file() -> tempfile::NamedTempFile {
    let mut file = tempfile::NamedTempFile::new().expect("temp file");
    let chunk: Vec<u8> = (0..1 << 20).map(|i: u32| (i % 251) as u8).collect();
    for _ in 0..BLK_FILE >> 20 {
        file.write_all(&chunk).expect("write");
    }
    file.as_file().sync_all().expect("sync");
    file
}

fn blk_read(file: &tempfile::NamedTempFile, total: u64) -> f64 {
    let mem = memory();
    let device =
        BlockDevice::new(BlockConfig { path: file.path().into(), file: None, id: None }).expect("block device");
    let mut d = Driver::new(&mem, device);
    d.init(1, 256);
    let segments = BLK_REQUEST / 65536;
    let start = Instant::now();
    let mut done = 0u64;
    let mut offset = 0u64;
    while done < total {
        for i in 0..BLK_PER_NOTIFY {
            let base = 0x100_0000 + i * 0x4_1000;
            d.write_blk_header(base, BLK_T_IN, offset / 512);
            let mut chain = vec![(base, 16, false)];
            for s in 0..u64::from(segments) {
                chain.push((base + 0x1000 + s * 65536, 65536, true));
            }
            chain.push((base + 0x800, 1, true));
            d.queues[0].add_chain(&chain);
            offset = (offset + u64::from(BLK_REQUEST)) % BLK_FILE;
        }
        d.notify(0);
        let used = d.queues[0].take_used();
        assert_eq!(used.len() as u64, BLK_PER_NOTIFY);
        assert!(used.iter().all(|&(_, len)| len == BLK_REQUEST + 1), "{used:?}");
        done += BLK_PER_NOTIFY * u64::from(BLK_REQUEST);
    }
    mb_s(done, start.elapsed())
}

/// The peer: `pread` of the same file, same request size, into one buffer.
fn pread(file: &tempfile::NamedTempFile, total: u64) -> f64 {
    let mut buf = vec![0u8; BLK_REQUEST as usize];
    let start = Instant::now();
    let (mut done, mut offset) = (0u64, 0u64);
    while done < total {
        file.as_file().read_exact_at(&mut buf, offset).expect("pread");
        offset = (offset + u64::from(BLK_REQUEST)) % BLK_FILE;
        done += u64::from(BLK_REQUEST);
    }
    mb_s(done, start.elapsed())
}

fn row(name: &str, strata: f64, peer_name: &str, peer: f64, target: Option<f64>) {
    let verdict = match target {
        Some(t) if strata >= t => format!("target ≥ {t:.0} MB/s: met"),
        Some(t) => format!("target ≥ {t:.0} MB/s: MISSED"),
        None => String::new(),
    };
    println!(
        "{name:<24} {strata:>9.0} MB/s   {peer_name:<18} {peer:>9.0} MB/s   ratio {:>5.2}   {verdict}",
        strata / peer
    );
}

fn main() {
    let mb: u64 = std::env::var("STRATA_BENCH_MB").ok().and_then(|v| v.parse().ok()).unwrap_or(2048);
    let total = mb << 20;
    println!("virtio device throughput, {mb} MiB per figure (in-process guest driver, real sockets and files)");
    // Warm up (page cache, allocator, socket buffers).
    guest_to_host(64 << 20);
    host_to_guest(64 << 20);
    let peer = socketpair(total);
    let g2h = guest_to_host(total);
    let h2g = host_to_guest(total);
    row("vsock guest→host", g2h, "unix socketpair", peer, Some(TARGET_MB_S));
    row("vsock host→guest", h2g, "unix socketpair", peer, Some(TARGET_MB_S));
    let file = blk_file();
    pread(&file, BLK_FILE);
    let peer = pread(&file, total);
    let blk = blk_read(&file, total);
    row("blk read (256 KiB reqs)", blk, "pread 256 KiB", peer, None);
}
