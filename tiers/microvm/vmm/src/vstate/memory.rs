//! Guest RAM: one memfd, mapped into the monitor with vm-memory.
//!
//! The layout follows Firecracker's: RAM starts at guest address 0 and runs up to the 32-bit MMIO gap
//! ([`MMIO_GAP_START`], 3.25 GiB); what does not fit below the gap continues at [`MMIO_GAP_END`] (4 GiB). Each region
//! maps the memfd at the file offset equal to the RAM it follows, so the file is the guest's RAM laid end to end,
//! without the gap. That is what a snapshot writes ([`GuestMemory::write_sparse`]) and what a fork maps back,
//! copy-on-write, with [`GuestMemory::from_file_private`].
//!
//! The memfd is sealed against growing and shrinking: a mapping can never point past the end of its file (which
//! would turn a guest access into SIGBUS in the monitor).

use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nix::fcntl::{FcntlArg, SealFlag, fcntl};
use nix::sys::memfd::{MFdFlags, memfd_create};
use vm_memory::mmap::{MmapRegionBuilder, MmapRegionError};
use vm_memory::{
    Address, Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
    GuestRegionCollectionError, GuestRegionMmap,
};

/// Start of the 32-bit MMIO gap (3.25 GiB): RAM stops here and devices (virtio-mmio, the IOAPIC, the LAPIC) live
/// above it.
pub const MMIO_GAP_START: u64 = 0xd000_0000;
/// End of the 32-bit MMIO gap (4 GiB): RAM that did not fit below the gap continues here.
pub const MMIO_GAP_END: u64 = 1 << 32;
/// Size of the MMIO gap.
pub const MMIO_GAP_SIZE: u64 = MMIO_GAP_END - MMIO_GAP_START;
/// Guest RAM is a whole number of 4 KiB pages.
pub const PAGE_SIZE: u64 = 4096;
/// The largest guest RAM accepted (64 GiB): far more than a sandbox needs, small enough that a typo in a limit is
/// refused instead of reserving address space the host does not have.
pub const MAX_MEMORY_SIZE: u64 = 64 << 30;

/// Why guest memory could not be created or used.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// A size of zero bytes.
    #[error("guest memory size must not be zero")]
    ZeroSize,
    /// A size that is not a whole number of pages.
    #[error("guest memory size {size:#x} is not a multiple of the 4 KiB page size")]
    Unaligned {
        /// The size asked for.
        size: u64,
    },
    /// A size above [`MAX_MEMORY_SIZE`].
    #[error("guest memory size {size:#x} exceeds the maximum of {max:#x}")]
    TooLarge {
        /// The size asked for.
        size: u64,
        /// [`MAX_MEMORY_SIZE`].
        max: u64,
    },
    /// `memfd_create` failed.
    #[error("cannot create the guest memory memfd")]
    Memfd(#[source] nix::Error),
    /// Sizing or sealing the memfd failed.
    #[error("cannot size or seal the guest memory memfd")]
    Resize(#[source] std::io::Error),
    /// A snapshot memory file could not be opened or measured.
    #[error("cannot open guest memory file {path}")]
    OpenFile {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Mapping a region into the monitor failed.
    #[error("cannot map guest memory region at {addr:#x} ({size:#x} bytes)")]
    Mmap {
        /// Guest physical start of the region.
        addr: u64,
        /// Its size.
        size: u64,
        /// Why.
        #[source]
        source: MmapRegionError,
    },
    /// The regions do not form a valid guest memory (overlap, overflow).
    #[error("invalid guest memory layout")]
    Layout(#[source] GuestRegionCollectionError),
    /// A region's guest range wraps around the address space.
    #[error("guest memory region at {addr:#x} wraps around the address space")]
    RegionOverflow {
        /// Guest physical start of the region.
        addr: u64,
    },
    /// Reading or writing guest memory, or copying it to a file, failed.
    #[error("guest memory access failed")]
    Access(#[source] vm_memory::GuestMemoryError),
}

/// Where guest RAM sits: `(guest physical start, size)` pairs, in address order, below and above the MMIO gap.
///
/// The file offset of each region is the sum of the sizes before it.
pub fn ram_layout(size: u64) -> Result<Vec<(GuestAddress, u64)>, MemoryError> {
    check_size(size)?;
    Ok(if size <= MMIO_GAP_START {
        vec![(GuestAddress(0), size)]
    } else {
        vec![(GuestAddress(0), MMIO_GAP_START), (GuestAddress(MMIO_GAP_END), size - MMIO_GAP_START)]
    })
}

fn check_size(size: u64) -> Result<(), MemoryError> {
    if size == 0 {
        return Err(MemoryError::ZeroSize);
    }
    if !size.is_multiple_of(PAGE_SIZE) {
        return Err(MemoryError::Unaligned { size });
    }
    if size > MAX_MEMORY_SIZE {
        return Err(MemoryError::TooLarge { size, max: MAX_MEMORY_SIZE });
    }
    Ok(())
}

/// How a region's pages are shared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backing {
    /// `MAP_SHARED` on the monitor's own memfd: the memfd is the RAM.
    Memfd,
    /// `MAP_PRIVATE` on a snapshot file: reads come from the file, writes are copied on write and never reach it.
    PrivateFile,
}

/// A guest's RAM, backed by one file and mapped into the monitor.
///
/// Cloning is cheap and shares the mappings (vm-memory keeps them in `Arc`s); they are unmapped when the last clone
/// is dropped. A VM registered with this memory keeps a clone, so the mapping outlives every vCPU that uses it.
#[derive(Debug, Clone)]
pub struct GuestMemory {
    mmap: GuestMemoryMmap,
    file: Arc<File>,
    size: u64,
    backing: Backing,
}

impl GuestMemory {
    /// `size` bytes of zeroed RAM in a fresh memfd, laid out around the MMIO gap ([`ram_layout`]).
    pub fn new(size: u64) -> Result<GuestMemory, MemoryError> {
        let layout = ram_layout(size)?;
        let fd: OwnedFd = memfd_create(c"strata-guest-ram", MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)
            .map_err(MemoryError::Memfd)?;
        let file = File::from(fd);
        file.set_len(size).map_err(MemoryError::Resize)?;
        fcntl(&file, FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SHRINK))
            .map_err(|e| MemoryError::Resize(e.into()))?;
        GuestMemory::map(Arc::new(file), size, &layout, Backing::Memfd)
    }

    /// Maps a memory file written by [`GuestMemory::write_sparse`] copy-on-write (`MAP_PRIVATE`): the fork's writes stay
    /// in its own anonymous pages, the file and every other fork of it see none of them. The RAM size is the file's
    /// length, which must be a valid guest memory size.
    pub fn from_file_private(path: &Path) -> Result<GuestMemory, MemoryError> {
        let open_error = |source| MemoryError::OpenFile { path: path.to_path_buf(), source };
        let file = File::open(path).map_err(open_error)?;
        GuestMemory::from_open_file_private(file, path)
    }

    /// [`GuestMemory::from_file_private`] of a file the caller opened (a snapshot's memory file, as it was
    /// verified); `path` names it in errors.
    pub fn from_open_file_private(file: File, path: &Path) -> Result<GuestMemory, MemoryError> {
        let open_error = |source| MemoryError::OpenFile { path: path.to_path_buf(), source };
        let size = file.metadata().map_err(open_error)?.len();
        let layout = ram_layout(size)?;
        GuestMemory::map(Arc::new(file), size, &layout, Backing::PrivateFile)
    }

    fn map(
        file: Arc<File>,
        size: u64,
        layout: &[(GuestAddress, u64)],
        backing: Backing,
    ) -> Result<GuestMemory, MemoryError> {
        let flags = libc::MAP_NORESERVE
            | match backing {
                Backing::Memfd => libc::MAP_SHARED,
                Backing::PrivateFile => libc::MAP_PRIVATE,
            };
        let mut regions = Vec::with_capacity(layout.len());
        let mut file_offset = 0u64;
        for &(addr, len) in layout {
            let mmap_error = |source| MemoryError::Mmap { addr: addr.raw_value(), size: len, source };
            let host_len = usize::try_from(len).map_err(|_| MemoryError::TooLarge { size, max: MAX_MEMORY_SIZE })?;
            let region = MmapRegionBuilder::new(host_len)
                .with_file_offset(FileOffset::from_arc(file.clone(), file_offset))
                .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
                .with_mmap_flags(flags)
                .build()
                .map_err(mmap_error)?;
            regions.push(
                GuestRegionMmap::new(region, addr).ok_or(MemoryError::RegionOverflow { addr: addr.raw_value() })?,
            );
            file_offset += len;
        }
        let mmap = GuestMemoryMmap::from_regions(regions).map_err(MemoryError::Layout)?;
        Ok(GuestMemory { mmap, file, size, backing })
    }

    /// Total RAM in bytes (the gap not counted).
    pub fn size(&self) -> u64 {
        self.size
    }

    /// How the pages are backed.
    pub fn backing(&self) -> Backing {
        self.backing
    }

    /// The file behind the RAM (the memfd, or the snapshot file of a fork).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The vm-memory view: what linux-loader, virtio queues and devices take.
    pub fn mmap(&self) -> &GuestMemoryMmap {
        &self.mmap
    }

    /// The end of RAM below the MMIO gap (exclusive): where "low memory" stops.
    pub fn low_end(&self) -> GuestAddress {
        GuestAddress(self.size.min(MMIO_GAP_START))
    }

    /// Each region as `(guest physical start, size, host address)`, for `KVM_SET_USER_MEMORY_REGION`.
    pub fn regions(&self) -> impl Iterator<Item = (GuestAddress, u64, *mut u8)> + '_ {
        self.mmap.iter().map(|r| (r.start_addr(), r.len(), r.as_ptr()))
    }

    /// Copies `data` into guest RAM at `addr`; fails when any byte falls outside RAM.
    pub fn write(&self, addr: GuestAddress, data: &[u8]) -> Result<(), MemoryError> {
        self.mmap.write_slice(data, addr).map_err(MemoryError::Access)
    }

    /// Fills `buf` from guest RAM at `addr`; fails when any byte falls outside RAM.
    pub fn read(&self, addr: GuestAddress, buf: &mut [u8]) -> Result<(), MemoryError> {
        self.mmap.read_slice(buf, addr).map_err(MemoryError::Access)
    }

    /// Writes all of RAM to `out` as a memory file (RAM laid end to end, the file
    /// [`GuestMemory::from_file_private`] maps back), sparse: a page of zeros is a hole, never written. A memfd is
    /// read with `pread` between its holes (reading its mapping would allocate every page); a fork's private
    /// mapping is read through the mapping, which holds its own writes. `out` ends up exactly [`Self::size`] long.
    pub fn write_sparse(&self, out: &File) -> io::Result<()> {
        let size = self.size;
        let mut copy = SparseCopy::new(out);
        match self.backing {
            Backing::Memfd => {
                for (start, len) in data_extents(&self.file, size) {
                    copy.copy_range(start, len, |offset, buf| self.file.read_exact_at(buf, offset))?;
                }
            }
            Backing::PrivateFile => {
                let mut file_offset = 0u64;
                for (addr, len, _) in self.regions() {
                    let base = file_offset;
                    copy.copy_range(base, len, |offset, buf| {
                        let at = addr.checked_add(offset - base).ok_or_else(|| io::Error::other("address overflow"))?;
                        self.read(at, buf).map_err(io::Error::other)
                    })?;
                    file_offset += len;
                }
            }
        }
        out.set_len(size)
    }

    /// Copies a memory file's data (`source`, [`Self::size`] bytes) into this memory's memfd, extent by extent,
    /// skipping holes and pages of zeros: they read as zero and cost nothing until the guest touches them.
    pub fn fill_sparse_from(&self, source: &File) -> io::Result<()> {
        let mut copy = SparseCopy::new(&self.file);
        for (start, len) in data_extents(source, self.size) {
            copy.copy_range(start, len, |offset, buf| source.read_exact_at(buf, offset))?;
        }
        Ok(())
    }
}

/// The chunk memory is copied in.
const COPY_CHUNK: usize = 1 << 20;

/// Data extents of `file` as `(offset, len)`, by `SEEK_DATA`/`SEEK_HOLE`; all of `0..size` when the filesystem
/// cannot tell.
fn data_extents(file: &File, size: u64) -> Vec<(u64, u64)> {
    use nix::unistd::{Whence, lseek};
    let whole = vec![(0, size)];
    let mut extents = Vec::new();
    let mut pos: u64 = 0;
    while pos < size {
        let Ok(offset) = i64::try_from(pos) else { return whole };
        let start = match lseek(file, offset, Whence::SeekData) {
            Ok(start) => start,
            Err(nix::errno::Errno::ENXIO) => break,
            Err(_) => return whole,
        };
        let Ok(end) = lseek(file, start, Whence::SeekHole) else { return whole };
        let (Ok(start), Ok(end)) = (u64::try_from(start), u64::try_from(end)) else { return whole };
        let end = end.min(size);
        if end <= start {
            break;
        }
        extents.push((start, end - start));
        pos = end;
    }
    extents
}

/// Copies memory into `out` chunk by chunk, writing only the runs of pages that are not all zeros.
struct SparseCopy<'a> {
    out: &'a File,
    buf: Vec<u8>,
}

impl<'a> SparseCopy<'a> {
    fn new(out: &'a File) -> SparseCopy<'a> {
        SparseCopy { out, buf: vec![0; COPY_CHUNK] }
    }

    /// Copies `start..start + len` (file offsets): `read` fills a buffer from an offset.
    fn copy_range(
        &mut self,
        start: u64,
        len: u64,
        mut read: impl FnMut(u64, &mut [u8]) -> io::Result<()>,
    ) -> io::Result<()> {
        let end = start.checked_add(len).ok_or_else(|| io::Error::other("memory range overflows"))?;
        let mut offset = start;
        while offset < end {
            let n = usize::try_from(end - offset).unwrap_or(usize::MAX).min(self.buf.len());
            let chunk = &mut self.buf[..n];
            read(offset, chunk)?;
            write_nonzero_runs(self.out, offset, chunk)?;
            offset += n as u64;
        }
        Ok(())
    }
}

/// Writes the runs of not-all-zero pages of `chunk` (which sits at file offset `offset`) to `out`.
fn write_nonzero_runs(out: &File, offset: u64, chunk: &[u8]) -> io::Result<()> {
    let page = PAGE_SIZE as usize;
    let mut run: Option<usize> = None;
    for (i, bytes) in chunk.chunks(page).enumerate() {
        let zero = bytes.iter().all(|b| *b == 0);
        match (zero, run) {
            (false, None) => run = Some(i * page),
            (true, Some(from)) => {
                out.write_all_at(&chunk[from..i * page], offset + from as u64)?;
                run = None;
            }
            _ => {}
        }
    }
    if let Some(from) = run {
        out.write_all_at(&chunk[from..], offset + from as u64)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_memory_is_one_region_below_the_gap() {
        assert_eq!(ram_layout(2 << 20).expect("layout"), vec![(GuestAddress(0), 2 << 20)]);
        assert_eq!(ram_layout(MMIO_GAP_START).expect("layout"), vec![(GuestAddress(0), MMIO_GAP_START)]);
    }

    #[test]
    fn large_memory_continues_above_the_gap() {
        let size = 4u64 << 30;
        assert_eq!(
            ram_layout(size).expect("layout"),
            vec![(GuestAddress(0), MMIO_GAP_START), (GuestAddress(MMIO_GAP_END), size - MMIO_GAP_START)]
        );
    }

    #[test]
    fn bad_sizes_are_refused_with_the_size() {
        assert!(matches!(GuestMemory::new(0), Err(MemoryError::ZeroSize)));
        assert!(matches!(GuestMemory::new(4097), Err(MemoryError::Unaligned { size: 4097 })));
        assert!(matches!(
            GuestMemory::new(MAX_MEMORY_SIZE + PAGE_SIZE),
            Err(MemoryError::TooLarge { max: MAX_MEMORY_SIZE, .. })
        ));
    }

    #[test]
    fn writes_land_in_the_memfd() {
        let mem = GuestMemory::new(1 << 20).expect("memory");
        mem.write(GuestAddress(0x1234), b"strata").expect("write");
        let mut buf = [0u8; 6];
        std::os::unix::fs::FileExt::read_exact_at(mem.file(), &mut buf, 0x1234).expect("pread");
        assert_eq!(&buf, b"strata");
        assert!(mem.write(GuestAddress((1 << 20) - 2), b"abc").is_err());
        assert!(mem.file().set_len(1 << 21).is_err(), "the memfd is sealed against growing");
    }

    #[test]
    fn a_private_mapping_of_a_dump_is_copy_on_write() {
        let mem = GuestMemory::new(1 << 20).expect("memory");
        mem.write(GuestAddress(0x2000), b"parent").expect("write");
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("mem");
        let file = File::create(&path).expect("create");
        mem.write_sparse(&file).expect("write");
        assert_eq!(file.metadata().expect("stat").len(), 1 << 20);
        drop(file);

        let fork = GuestMemory::from_file_private(&path).expect("fork");
        assert_eq!(fork.size(), 1 << 20);
        assert_eq!(fork.backing(), Backing::PrivateFile);
        let mut buf = [0u8; 6];
        fork.read(GuestAddress(0x2000), &mut buf).expect("read");
        assert_eq!(&buf, b"parent");
        fork.write(GuestAddress(0x2000), b"child!").expect("write");

        let again = GuestMemory::from_file_private(&path).expect("second fork");
        again.read(GuestAddress(0x2000), &mut buf).expect("read");
        assert_eq!(&buf, b"parent", "a fork's write reached the file");
    }

    #[test]
    fn a_file_of_the_wrong_size_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("mem");
        std::fs::write(&path, [0u8; 100]).expect("write");
        assert!(matches!(GuestMemory::from_file_private(&path), Err(MemoryError::Unaligned { size: 100 })));
        assert!(matches!(
            GuestMemory::from_file_private(&dir.path().join("missing")),
            Err(MemoryError::OpenFile { .. })
        ));
    }
}
