//! The virtio-blk device (`tiers/microvm/vmm/src/devices/virtio/block`) behind its virtio-mmio transport, fed the
//! descriptor chains a hostile guest driver posts: headers, data and status buffers in and out of memory, loops
//! and bad `next` indices, requests past the disk's end, too many or oddly sized segments.
//!
//! Input: [`arbitrary`] bytes for up to 4 rounds of chains, each round posted and notified.
//!
//! Oracles: nothing panics; the device writes guest memory only inside device-writable buffers and the used
//! ring ([`Guest::check_writes`]); a used length is never above the writable bytes of all posted chains; the
//! status byte of a chain the device answered is OK, IOERR or UNSUPP.

use std::io::Write;
use std::path::PathBuf;
use std::sync::OnceLock;

use arbitrary::{Result, Unstructured};
use strata_tier_microvm::devices::bus::BusDevice;
use strata_tier_microvm::devices::virtio::block::{BLOCK_QUEUE_SIZE, BlockConfig, BlockDevice, SECTOR_SIZE};
use strata_tier_microvm::devices::virtio::mmio::MmioTransport;
use strata_tier_microvm::devices::virtio::{Interrupt, VirtioDevice};
use virtio_queue::desc::RawDescriptor;
use virtio_queue::desc::split::Descriptor;

use crate::virtio::{BUFFERS, F_WRITE, Guest, QUEUE_NOTIFY, descriptor, poke, post_chains};

/// Sectors of the disk.
const SECTORS: u64 = 16;

/// The disk image, for the other device targets.
pub fn disk_path() -> PathBuf {
    disk().clone()
}

/// A disk of [`SECTORS`] sectors whose every byte says where it is, made once per process.
fn disk() -> &'static PathBuf {
    static DISK: OnceLock<PathBuf> = OnceLock::new();
    DISK.get_or_init(|| {
        let path = crate::scratch::dir().join("disk.img");
        let bytes: Vec<u8> = (0..SECTORS * SECTOR_SIZE).map(|i| (i % 251) as u8).collect();
        std::fs::File::create(&path).and_then(|mut f| f.write_all(&bytes)).expect("the disk image");
        path
    })
}

/// Runs the chains in `data`.
pub fn run(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let size = [1u16, 2, 4, 8, 16][usize::from(data.first().copied().unwrap_or(0) % 5)].min(BLOCK_QUEUE_SIZE);
    let guest = Guest::new(&[size]);
    let device = BlockDevice::new(BlockConfig { path: disk().clone(), file: None, id: Some("fuzz".into()) })
        .expect("the device");
    let features = device.avail_features();
    let interrupt = Interrupt::new().expect("an eventfd");
    let mut transport = MmioTransport::new(guest.mem.clone(), device, interrupt).expect("the transport");
    guest.set_up(&mut transport, features);
    assert!(transport.is_activated(), "a well-behaved driver's setup was refused");
    let mut writable = 0u64;
    for _ in 0..4 {
        let Ok(chains) = round(&mut u, &guest, size) else { break };
        post_chains(&guest, 0, &chains);
        writable += chains
            .iter()
            .flatten()
            .map(|raw| Descriptor::from(*raw))
            .filter(|d| d.flags() & F_WRITE != 0)
            .map(|d| u64::from(d.len()))
            .sum::<u64>();
        let before = guest.snapshot();
        transport.write(QUEUE_NOTIFY, &0u32.to_le_bytes());
        guest.check_writes(&before);
        for (head, len) in guest.used(0) {
            assert!(head < u32::from(size), "used element for descriptor {head} of a {size}-entry table");
            assert!(u64::from(len) <= writable, "used length {len} above the {writable} writable bytes posted");
        }
    }
}

/// One round: a few chains, each a header (with its request written into memory), data buffers and a status
/// byte, any part of which the generator may bend.
fn round(u: &mut Unstructured<'_>, guest: &Guest, size: u16) -> Result<Vec<Vec<RawDescriptor>>> {
    let mut chains = Vec::new();
    let mut next_buffer = BUFFERS;
    for _ in 0..u.int_in_range(1..=3)? {
        let mut chain = Vec::new();
        // The header: type, reserved, sector.
        let kind: u32 = *u.choose(&[0, 1, 4, 8, 0xdead])?; // IN, OUT, FLUSH, GET_ID, unknown
        let sector = crate::generate::edgy_u64(u, &[0, 1, SECTORS - 1, SECTORS, u64::MAX / 512, u64::MAX])?;
        let mut header = kind.to_le_bytes().to_vec();
        header.extend_from_slice(&[0; 4]);
        header.extend_from_slice(&sector.to_le_bytes());
        poke(guest, next_buffer, &header);
        chain.push(RawDescriptor::from(Descriptor::new(next_buffer, 16, 0, 0)));
        next_buffer += 16;
        for _ in 0..u.int_in_range(0..=3)? {
            let len = u32::from(u.int_in_range(0u8..=3)?) * 512 + u32::from(u.ratio(1, 8)?);
            let d = Descriptor::from(descriptor(u, size, len, true)?);
            let addr = if u.ratio(7, 8)? { next_buffer } else { d.addr().0 };
            chain.push(RawDescriptor::from(Descriptor::new(addr, d.len(), d.flags(), d.next())));
            next_buffer += u64::from(len).min(4096);
        }
        chain.push(descriptor(u, size, 1, true)?);
        if u.ratio(1, 4)? {
            let i = u.choose_index(chain.len())?;
            let (len, write) = (u.arbitrary()?, u.arbitrary()?);
            chain[i] = descriptor(u, size, len, write)?;
        }
        chains.push(chain);
    }
    Ok(chains)
}
