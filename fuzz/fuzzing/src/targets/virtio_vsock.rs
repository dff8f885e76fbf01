//! The virtio-vsock device and its connection muxer (`tiers/microvm/vmm/src/devices/virtio/vsock`) behind the
//! virtio-mmio transport: packets a hostile guest sends on TX (any CIDs, ports, operations, lengths, credit),
//! RX buffers of any shape, and host peers that connect, send and hang up in between.
//!
//! Input: [`arbitrary`] bytes for up to 12 actions: post TX packets, post RX buffers, accept and feed the host
//! side of guest connections (the guest connects to host port 1028, where a listener waits), connect from the
//! host (`CONNECT <port>`), or let the backend run.
//!
//! Oracles: nothing panics; the device writes guest memory only inside device-writable buffers and the used
//! rings; a used RX length never exceeds the buffer it fills; connections stay under `MAX_CONNECTIONS`.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use arbitrary::{Result, Unstructured};
use strata_tier_microvm::devices::bus::BusDevice;
use strata_tier_microvm::devices::virtio::mmio::MmioTransport;
use strata_tier_microvm::devices::virtio::vsock::{MAX_CONNECTIONS, VsockConfig, VsockDevice};
use strata_tier_microvm::devices::virtio::{Interrupt, VirtioDevice};
use virtio_queue::desc::RawDescriptor;
use virtio_queue::desc::split::Descriptor;

use crate::generate::edgy_u64;
use crate::virtio::{BUFFERS, F_WRITE, Guest, QUEUE_NOTIFY, descriptor, poke, post_chains};

const GUEST_CID: u64 = 3;
const HOST_PORT: u32 = 1028;
const QUEUE: u16 = 8;
const OPS: [u16; 9] = [1, 2, 3, 4, 5, 6, 7, 0, 99];

fn socket_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| crate::scratch::fresh("vsock")).clone()
}

/// Runs the actions in `data`.
pub fn run(data: &[u8]) {
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let uds = socket_dir().join(format!("v{}", COUNT.fetch_add(1, Ordering::Relaxed)));
    let listener_path = PathBuf::from(format!("{}_{HOST_PORT}", uds.display()));
    let _ = std::fs::remove_file(&listener_path);
    let listener = UnixListener::bind(&listener_path).expect("the host listener");
    listener.set_nonblocking(true).expect("non-blocking");
    let device = VsockDevice::new(VsockConfig { guest_cid: GUEST_CID, uds_path: uds.clone() }).expect("the device");
    let features = device.avail_features();
    let guest = Guest::new(&[QUEUE, QUEUE, QUEUE]);
    let interrupt = Interrupt::new().expect("an eventfd");
    let mut transport = MmioTransport::new(guest.mem.clone(), device, interrupt).expect("the transport");
    guest.set_up(&mut transport, features);
    assert!(transport.is_activated(), "a well-behaved driver's setup was refused");

    let mut u = Unstructured::new(data);
    let mut peers: Vec<UnixStream> = Vec::new();
    let mut rx_posted: Vec<u32> = Vec::new();
    for _ in 0..12 {
        if u.is_empty() {
            break;
        }
        if act(&mut u, &guest, &mut transport, &listener, &uds, &mut peers, &mut rx_posted).is_err() {
            break;
        }
        assert!(transport.device().connection_count() <= MAX_CONNECTIONS);
    }
    let largest = rx_posted.iter().copied().max().unwrap_or(0);
    for (_, len) in guest.used(0) {
        assert!(len <= largest, "an RX used length of {len} bytes, above every buffer posted ({largest})");
    }
    drop(transport);
    let _ = std::fs::remove_file(&listener_path);
}

fn act(
    u: &mut Unstructured<'_>,
    guest: &Guest,
    transport: &mut MmioTransport<VsockDevice>,
    listener: &UnixListener,
    uds: &std::path::Path,
    peers: &mut Vec<UnixStream>,
    rx_posted: &mut Vec<u32>,
) -> Result<()> {
    match u.int_in_range(0u8..=5)? {
        0 | 1 => {
            let mut chains = Vec::new();
            let mut at = BUFFERS;
            for _ in 0..u.int_in_range(1..=3)? {
                let len = u32::from(u.int_in_range(0u8..=64)?);
                let header = tx_header(u, len)?;
                poke(guest, at, &header);
                let mut chain = vec![RawDescriptor::from(Descriptor::new(at, 44, 0, 0))];
                at += 64;
                if len > 0 || u.ratio(1, 4)? {
                    let payload: Vec<u8> = (0..len).map(|i| i as u8).collect();
                    poke(guest, at, &payload);
                    chain.push(RawDescriptor::from(Descriptor::new(at, len, 0, 0)));
                    at += 128;
                }
                if u.ratio(1, 6)? {
                    let i = u.choose_index(chain.len())?;
                    let (len, write) = (u.arbitrary()?, u.arbitrary()?);
                    chain[i] = descriptor(u, QUEUE, len, write)?;
                }
                chains.push(chain);
            }
            post_chains(guest, 1, &chains);
            device_runs(guest, || transport.write(QUEUE_NOTIFY, &1u32.to_le_bytes()));
        }
        2 => {
            let mut chains = Vec::new();
            let mut at = BUFFERS + 0x8000;
            for _ in 0..u.int_in_range(1..=3)? {
                let data_len = u32::from(*u.choose(&[0u16, 1, 64, 4096])?);
                let mut chain = vec![RawDescriptor::from(Descriptor::new(at, 44, F_WRITE, 0))];
                if data_len > 0 {
                    chain.push(RawDescriptor::from(Descriptor::new(at + 64, data_len, F_WRITE, 0)));
                }
                if u.ratio(1, 6)? {
                    let i = u.choose_index(chain.len())?;
                    let len = u.arbitrary()?;
                    chain[i] = descriptor(u, QUEUE, len, true)?;
                }
                rx_posted.push(chain.iter().map(|raw| Descriptor::from(*raw).len()).fold(0u32, u32::saturating_add));
                chains.push(chain);
                at += 64 + 4096;
            }
            post_chains(guest, 0, &chains);
            device_runs(guest, || transport.write(QUEUE_NOTIFY, &0u32.to_le_bytes()));
        }
        3 => {
            while let Ok((stream, _)) = listener.accept() {
                stream.set_nonblocking(true).expect("non-blocking");
                peers.push(stream);
            }
            let mut sink = [0u8; 4096];
            for peer in peers.iter_mut() {
                while matches!(peer.read(&mut sink), Ok(n) if n > 0) {}
                let reply: Vec<u8> = vec![b'h'; usize::from(u.int_in_range(0u16..=300)?)];
                let _ = peer.write(&reply);
            }
            if u.ratio(1, 4)? && !peers.is_empty() {
                let i = u.choose_index(peers.len())?;
                let peer = peers.remove(i);
                if u.arbitrary()? {
                    let _ = peer.shutdown(std::net::Shutdown::Write);
                    peers.push(peer);
                }
            }
            device_runs(guest, || transport.process_backend());
        }
        4 => {
            if let Ok(mut stream) = UnixStream::connect(uds) {
                let port = edgy_u64(u, &[1024, 0, u64::from(u32::MAX)])?;
                let line =
                    if u.ratio(1, 4)? { u.bytes(16)?.to_vec() } else { format!("CONNECT {port}\n").into_bytes() };
                let _ = stream.write_all(&line);
                stream.set_nonblocking(true).expect("non-blocking");
                peers.push(stream);
            }
            device_runs(guest, || transport.process_backend());
        }
        _ => device_runs(guest, || transport.process_backend()),
    }
    Ok(())
}

/// Lets the device run, and checks what it wrote.
fn device_runs(guest: &Guest, run: impl FnOnce()) {
    let before = guest.snapshot();
    run();
    guest.check_writes(&before);
}

/// A TX packet header: mostly from the guest's CID to the host's, about port 1028, any operation.
fn tx_header(u: &mut Unstructured<'_>, len: u32) -> Result<Vec<u8>> {
    let src_cid = edgy_u64(u, &[GUEST_CID, GUEST_CID, 2, 0, u64::MAX])?;
    let dst_cid = edgy_u64(u, &[2, 2, GUEST_CID, u64::MAX])?;
    let src_port: u32 = if u.ratio(3, 4)? { 50_000 + u32::from(u.int_in_range(0u8..=3)?) } else { u.arbitrary()? };
    let dst_port: u32 = if u.ratio(3, 4)? { HOST_PORT } else { u.arbitrary()? };
    let len = if u.ratio(1, 8)? { u.arbitrary()? } else { len };
    let type_: u16 = if u.ratio(7, 8)? { 1 } else { u.arbitrary()? };
    let op = *u.choose(&OPS)?;
    let flags: u32 = u.int_in_range(0..=3)?;
    let buf_alloc = edgy_u64(u, &[0, 64, 65_536, 1 << 20, u64::from(u32::MAX)])? as u32;
    let fwd_cnt = edgy_u64(u, &[0, 64, u64::from(u32::MAX)])? as u32;
    let mut h = Vec::with_capacity(44);
    h.extend_from_slice(&src_cid.to_le_bytes());
    h.extend_from_slice(&dst_cid.to_le_bytes());
    h.extend_from_slice(&src_port.to_le_bytes());
    h.extend_from_slice(&dst_port.to_le_bytes());
    h.extend_from_slice(&len.to_le_bytes());
    h.extend_from_slice(&type_.to_le_bytes());
    h.extend_from_slice(&op.to_le_bytes());
    h.extend_from_slice(&flags.to_le_bytes());
    h.extend_from_slice(&buf_alloc.to_le_bytes());
    h.extend_from_slice(&fwd_cnt.to_le_bytes());
    Ok(h)
}
