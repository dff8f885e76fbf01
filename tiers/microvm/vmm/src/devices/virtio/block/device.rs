//! The virtio-blk device: one request queue, a read-only backing file read with `pread`.
//!
//! Requests: IN (read) is served; GET_ID writes the disk's 20-byte ID; FLUSH succeeds (there is nothing to
//! flush on a read-only disk; the device does not offer `VIRTIO_BLK_F_FLUSH`, so a well-behaved driver never
//! sends it); OUT fails with IOERR (the device offers `VIRTIO_BLK_F_RO`); anything else gets UNSUPP.
//!
//! Every chain is checked before the device touches the file: the first descriptor is the 16-byte header and
//! device-readable; the last is the status byte and device-writable; the data descriptors in between are
//! device-writable for IN, each a multiple of 512 bytes and at most [`SIZE_MAX`], at most [`SEG_MAX`] of them
//! (the limits the device advertises). A request that reaches past the end of the disk fails with IOERR before
//! any byte is read. A chain the device cannot answer (cut short by a loop or a bad `next` index, no writable
//! status byte, a status byte outside guest memory) is returned to the driver with used length 0 and nothing
//! written: the device looks at the status descriptor before it reads anything.

use std::fmt;
use std::fs::File;
use std::io::{Seek, SeekFrom};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_SIZE_MAX, VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_S_IOERR,
    VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};
use virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{DescriptorChain, Queue, QueueState, QueueT};
use vm_memory::{Bytes, GuestMemoryBackend, GuestMemoryMmap};

use crate::devices::virtio::{ActivateError, Interrupt, InterruptKind, VIRTIO_F_VERSION_1, VirtioDevice};

/// Bytes per sector.
pub const SECTOR_SIZE: u64 = 512;
/// The request queue's maximum size.
pub const BLOCK_QUEUE_SIZE: u16 = 256;
/// The most data descriptors in one request (`seg_max`).
pub const SEG_MAX: u32 = 128;
/// The largest data descriptor (`size_max`); with [`SEG_MAX`] it caps a request at 8 MiB.
pub const SIZE_MAX: u32 = 64 * 1024;
/// Length of the disk ID GET_ID returns.
pub const DISK_ID_LEN: usize = VIRTIO_BLK_ID_BYTES as usize;

/// Header, data descriptors, status.
const MAX_DESCRIPTORS: usize = SEG_MAX as usize + 2;
const HEADER_LEN: u32 = 16;
const CONFIG_LEN: usize = 24;

const S_OK: u8 = VIRTIO_BLK_S_OK as u8;
const S_IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;
const S_UNSUPP: u8 = VIRTIO_BLK_S_UNSUPP as u8;

/// The disk a block device serves.
#[derive(Debug)]
pub struct BlockConfig {
    /// The backing file (or block device), opened read-only; when `file` is given, only its name in errors.
    pub path: PathBuf,
    /// The backing file already open (read-only), for a process that cannot open `path` (the jailed monitor).
    pub file: Option<File>,
    /// The ID GET_ID returns (at most 20 bytes); derived from the file's device and inode when `None`.
    pub id: Option<String>,
}

/// Why a block device could not be created.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    /// The backing file could not be opened or measured.
    #[error("cannot open disk image {path}")]
    Open {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The backing file holds less than one sector.
    #[error("disk image {0} is smaller than one sector")]
    Empty(PathBuf),
    /// The disk ID is longer than 20 bytes.
    #[error("disk ID {0:?} is longer than 20 bytes")]
    IdTooLong(String),
}

/// The backing file and what the guest knows about it.
pub(super) struct Disk {
    pub(super) file: File,
    pub(super) path: PathBuf,
    /// Size in sectors.
    pub(super) capacity: u64,
    pub(super) id: [u8; DISK_ID_LEN],
}

impl Disk {
    /// Opens `path` read-only, or takes `file` (already open) and names it `path`.
    pub(super) fn open(path: &Path, file: Option<File>) -> Result<Disk, BlockError> {
        let open_error = |source| BlockError::Open { path: path.to_path_buf(), source };
        let mut file = match file {
            Some(file) => file,
            None => File::open(path).map_err(open_error)?,
        };
        let len = file.seek(SeekFrom::End(0)).map_err(open_error)?;
        let capacity = len / SECTOR_SIZE;
        if capacity == 0 {
            return Err(BlockError::Empty(path.to_path_buf()));
        }
        if len % SECTOR_SIZE != 0 {
            log::warn!(
                "disk image {} is not a whole number of sectors; its last {} bytes are hidden",
                path.display(),
                len % SECTOR_SIZE
            );
        }
        let meta = file.metadata().map_err(open_error)?;
        let mut id = [0u8; DISK_ID_LEN];
        let derived = format!("{:x}{:x}", meta.dev(), meta.ino());
        for (slot, byte) in id.iter_mut().zip(derived.bytes()) {
            *slot = byte;
        }
        Ok(Disk { file, path: path.to_path_buf(), capacity, id })
    }
}

struct Active {
    mem: GuestMemoryMmap,
    queue: Queue,
    interrupt: Interrupt,
}

/// A read-only virtio-blk device.
pub struct BlockDevice {
    pub(super) disk: Disk,
    config_space: [u8; CONFIG_LEN],
    active: Option<Active>,
    /// Scratch space between the file and guest memory, one data descriptor long.
    bounce: Vec<u8>,
    /// The chain being handled.
    descriptors: Vec<Descriptor>,
}

impl fmt::Debug for BlockDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockDevice")
            .field("path", &self.disk.path)
            .field("capacity_sectors", &self.disk.capacity)
            .field("active", &self.active.is_some())
            .finish_non_exhaustive()
    }
}

impl BlockDevice {
    /// Opens `config.path` read-only (or takes `config.file`) and describes it to the guest.
    pub fn new(config: BlockConfig) -> Result<BlockDevice, BlockError> {
        let mut disk = Disk::open(&config.path, config.file)?;
        if let Some(id) = config.id {
            disk.id = disk_id(&id)?;
        }
        Ok(BlockDevice::from_disk(disk))
    }

    pub(super) fn from_disk(disk: Disk) -> BlockDevice {
        let mut config_space = [0u8; CONFIG_LEN];
        let fields: [(usize, &[u8]); 4] = [
            (0, &disk.capacity.to_le_bytes()),
            (8, &SIZE_MAX.to_le_bytes()),
            (12, &SEG_MAX.to_le_bytes()),
            (20, &(SECTOR_SIZE as u32).to_le_bytes()),
        ];
        for (offset, bytes) in fields {
            for (slot, byte) in config_space.iter_mut().skip(offset).zip(bytes) {
                *slot = *byte;
            }
        }
        BlockDevice {
            disk,
            config_space,
            active: None,
            bounce: vec![0; SIZE_MAX as usize],
            descriptors: Vec::with_capacity(MAX_DESCRIPTORS),
        }
    }

    /// The disk's size in sectors.
    pub fn capacity_sectors(&self) -> u64 {
        self.disk.capacity
    }

    /// The 20-byte disk ID.
    pub fn disk_id(&self) -> [u8; DISK_ID_LEN] {
        self.disk.id
    }

    fn process_requests(&mut self) {
        let BlockDevice { disk, active, bounce, descriptors, .. } = self;
        let Some(active) = active.as_mut() else { return };
        let mut used = false;
        while let Some(chain) = active.queue.pop_descriptor_chain(&active.mem) {
            let head = chain.head_index();
            let len = handle_chain(disk, bounce, descriptors, &active.mem, chain);
            match active.queue.add_used(&active.mem, head, len) {
                Ok(()) => used = true,
                Err(e) => log::debug!("virtio-blk: cannot return chain {head}: {e}"),
            }
        }
        if used {
            active.interrupt.trigger(InterruptKind::UsedBuffer);
        }
    }
}

pub(super) fn disk_id(id: &str) -> Result<[u8; DISK_ID_LEN], BlockError> {
    let mut out = [0u8; DISK_ID_LEN];
    if id.len() > DISK_ID_LEN {
        return Err(BlockError::IdTooLong(id.to_owned()));
    }
    for (slot, byte) in out.iter_mut().zip(id.bytes()) {
        *slot = byte;
    }
    Ok(out)
}

/// Handles one chain; returns the used length (0 when the chain could not be answered at all).
fn handle_chain(
    disk: &Disk,
    bounce: &mut [u8],
    descriptors: &mut Vec<Descriptor>,
    mem: &GuestMemoryMmap,
    chain: DescriptorChain<&GuestMemoryMmap>,
) -> u32 {
    descriptors.clear();
    let mut too_long = false;
    for descriptor in chain {
        if descriptors.len() >= MAX_DESCRIPTORS {
            too_long = true;
            break;
        }
        descriptors.push(descriptor);
    }
    // The chain iterator stops silently on a loop, a `next` index past the table, an unreadable descriptor or a
    // total length above 4 GiB: the last descriptor it yielded then still says NEXT.
    let Some((status, rest)) = descriptors.split_last() else {
        log::debug!("virtio-blk: empty descriptor chain");
        return 0;
    };
    if too_long || status.has_next() {
        log::debug!("virtio-blk: descriptor chain too long or cut short");
        return 0;
    }
    if !status.is_write_only() || status.len() == 0 || !mem.address_in_range(status.addr()) {
        log::debug!("virtio-blk: status descriptor is not writable");
        return 0;
    }
    let (code, written) = match rest.split_first() {
        Some((header, data)) => execute(disk, bounce, mem, header, data),
        None => (S_IOERR, 0),
    };
    if mem.write_obj(code, status.addr()).is_err() {
        log::debug!("virtio-blk: cannot write the status byte at {:#x}", status.addr().0);
        return 0;
    }
    written.saturating_add(1)
}

/// Runs a request; returns the status and the number of data bytes written to the guest.
fn execute(
    disk: &Disk,
    bounce: &mut [u8],
    mem: &GuestMemoryMmap,
    header: &Descriptor,
    data: &[Descriptor],
) -> (u8, u32) {
    if header.is_write_only() || header.len() < HEADER_LEN {
        return (S_IOERR, 0);
    }
    let mut raw = [0u8; HEADER_LEN as usize];
    if mem.read_slice(&mut raw, header.addr()).is_err() {
        return (S_IOERR, 0);
    }
    let [t0, t1, t2, t3, _, _, _, _, s0, s1, s2, s3, s4, s5, s6, s7] = raw;
    let request_type = u32::from_le_bytes([t0, t1, t2, t3]);
    let sector = u64::from_le_bytes([s0, s1, s2, s3, s4, s5, s6, s7]);
    match request_type {
        VIRTIO_BLK_T_IN => read(disk, bounce, mem, sector, data),
        VIRTIO_BLK_T_OUT => (S_IOERR, 0),
        VIRTIO_BLK_T_FLUSH => (S_OK, 0),
        VIRTIO_BLK_T_GET_ID => get_id(disk, mem, data),
        _ => (S_UNSUPP, 0),
    }
}

fn read(disk: &Disk, bounce: &mut [u8], mem: &GuestMemoryMmap, sector: u64, data: &[Descriptor]) -> (u8, u32) {
    let mut total: u64 = 0;
    for d in data {
        if !d.is_write_only() || u64::from(d.len()) % SECTOR_SIZE != 0 || d.len() > SIZE_MAX {
            return (S_IOERR, 0);
        }
        total = total.saturating_add(u64::from(d.len()));
    }
    let in_range = sector.checked_add(total / SECTOR_SIZE).is_some_and(|end| end <= disk.capacity);
    let (Some(mut offset), true, Ok(total)) = (sector.checked_mul(SECTOR_SIZE), in_range, u32::try_from(total)) else {
        return (S_IOERR, 0);
    };
    for d in data {
        let len = d.len() as usize;
        let Some(buf) = bounce.get_mut(..len) else { return (S_IOERR, 0) };
        if let Err(e) = disk.file.read_exact_at(buf, offset) {
            log::warn!("virtio-blk: reading {len} bytes at {offset} of {}: {e}", disk.path.display());
            return (S_IOERR, 0);
        }
        if mem.write_slice(buf, d.addr()).is_err() {
            return (S_IOERR, 0);
        }
        offset = offset.saturating_add(u64::from(d.len()));
    }
    (S_OK, total)
}

fn get_id(disk: &Disk, mem: &GuestMemoryMmap, data: &[Descriptor]) -> (u8, u32) {
    let Some(d) = data.first().filter(|d| d.is_write_only()) else { return (S_IOERR, 0) };
    let len = (d.len() as usize).min(DISK_ID_LEN);
    let Some(id) = disk.id.get(..len) else { return (S_IOERR, 0) };
    match mem.write_slice(id, d.addr()) {
        Ok(()) => (S_OK, len as u32),
        Err(_) => (S_IOERR, 0),
    }
}

impl VirtioDevice for BlockDevice {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_BLOCK
    }

    fn avail_features(&self) -> u64 {
        VIRTIO_F_VERSION_1 | 1 << VIRTIO_BLK_F_RO | 1 << VIRTIO_BLK_F_SEG_MAX | 1 << VIRTIO_BLK_F_SIZE_MAX
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[BLOCK_QUEUE_SIZE]
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        super::super::read_config_bytes(&self.config_space, offset, data);
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        log::debug!("virtio-blk: write to read-only config space at {offset:#x} ignored");
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        queues: Vec<Queue>,
        interrupt: Interrupt,
        _acked_features: u64,
    ) -> Result<(), ActivateError> {
        let got = queues.len();
        let Ok([queue]) = <[Queue; 1]>::try_from(queues) else {
            return Err(ActivateError::QueueCount { expected: 1, got });
        };
        if !queue.ready() {
            return Err(ActivateError::QueueNotReady(0));
        }
        self.active = Some(Active { mem, queue, interrupt });
        Ok(())
    }

    fn process_queue(&mut self, index: usize) {
        if index == 0 {
            self.process_requests();
        }
    }

    fn queue_states(&self) -> Vec<QueueState> {
        self.active.iter().map(|a| a.queue.state()).collect()
    }

    fn reset(&mut self) {
        self.active = None;
    }
}
