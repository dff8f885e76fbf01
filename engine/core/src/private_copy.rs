//! Private copies of files that the host maps: what a snapshot's memory image becomes before any sandbox maps
//! it.
//!
//! A file mapped into the host (a fork's guest memory is a `MAP_PRIVATE` mapping of its snapshot's memory image)
//! stays tied to that file: if anyone truncates it, the next touch of a page past the new end raises `SIGBUS` in
//! the host process, and if anyone rewrites it, pages the fork has not read yet show bytes nobody verified. A
//! snapshot directory is untrusted data (a job may be able to write where snapshots live), so what is mapped is
//! never the file: [`PrivateCopy::copy_from`] copies it once, handing every byte to the caller's check on the
//! way, into a file no one else can reach:
//!
//! - **an unnamed file** (`O_TMPFILE`) in a directory the host names (the home's `run/`), when that directory is
//!   on a disk filesystem (ext4, xfs, btrfs). It has no path, so no other process can open, truncate or write it;
//!   its pages are page cache like the original's (large folios, reclaimable under memory pressure), and its
//!   blocks are freed when the last descriptor and mapping go.
//! - **a sealed memfd** otherwise: sealed against shrinking, growing and writing (`F_SEAL_SHRINK | F_SEAL_GROW |
//!   F_SEAL_WRITE`, then `F_SEAL_SEAL`), so the kernel refuses every change from any process. On the
//!   kernel's internal shmem mount it has no size limit, so reading a hole never fails for want of room (a hole
//!   of a file on a full tmpfs, read through a mapping, is `SIGBUS` too). It costs unreclaimable memory without
//!   swap, and faults are slower than on a disk filesystem's large folios (a wasm fork took ~35 % longer).
//!
//! Pages that are all zero are not written: they stay holes, cost nothing on disk, and read as zero. A source
//! that is a file ([`PrivateCopy::copy_file`]) is copied by its data regions only (`SEEK_DATA`/`SEEK_HOLE`): its
//! holes are never read, and without a check that needs the bytes, its data is copied inside the kernel
//! (`copy_file_range`).

use std::ffi::CStr;
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{FcntlArg, SealFlag, copy_file_range, fcntl};
use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::statfs::{FsType, fstatfs};
use nix::unistd::{Whence, lseek};

use crate::file_stamp::FileStamp;

/// The unit in which zero pages are skipped.
const PAGE: usize = 4096;
/// How much is read at a time.
const CHUNK: usize = 1 << 20;

/// Filesystems whose holes read as zero without allocating anything: an unnamed file may live there.
const DISK_FILESYSTEMS: [FsType; 3] = [
    FsType(0xef53),      // ext2/3/4
    FsType(0x5846_5342), // xfs
    FsType(0x9123_683e), // btrfs
];

/// What is handed every byte of a copy, in order (to hash it).
pub type Inspect<'a> = &'a mut dyn FnMut(&[u8]);

/// Where a private copy lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backing {
    /// An unnamed file on a disk filesystem.
    Unnamed,
    /// A sealed memfd.
    SealedMemfd,
    /// A file the host keeps for later processes ([`PrivateCopy::keep`]), in a directory only the host writes.
    Kept,
}

/// A file's bytes copied where no other process can change them, fixed in size and content for as long as it
/// exists. Share it with `Arc`; each mapping of it keeps it alive on its own.
#[derive(Debug)]
pub struct PrivateCopy {
    file: File,
    len: u64,
    backing: Backing,
}

impl PrivateCopy {
    /// Copies exactly `len` bytes of `source` into a new unnamed file in `dir` (when given and on a disk
    /// filesystem) or a new sealed memfd named `name` (for `/proc/PID/maps`), giving every chunk to `inspect`
    /// in order (to hash it). Fewer bytes than `len` is an [`io::ErrorKind::UnexpectedEof`] error, more an
    /// [`io::ErrorKind::InvalidData`] one: the copy is the file as it was meant to be, or nothing.
    pub fn copy_from(
        dir: Option<&Path>,
        name: &CStr,
        source: impl Read,
        len: u64,
        mut inspect: impl FnMut(&[u8]),
    ) -> io::Result<PrivateCopy> {
        let (file, backing) = create(dir, name, len)?;
        let mut input = source.take(len.saturating_add(1));
        let mut buf = vec![0u8; CHUNK];
        let mut offset = 0u64;
        loop {
            let n = match input.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                Err(err) => return Err(err),
            };
            if offset + n as u64 > len {
                return Err(io::Error::new(io::ErrorKind::InvalidData, format!("more than the {len} bytes expected")));
            }
            let chunk = &buf[..n];
            inspect(chunk);
            write_nonzero(&file, chunk, offset)?;
            offset += n as u64;
        }
        if offset != len {
            return Err(short(offset, len));
        }
        finish(file, len, backing)
    }

    /// As [`PrivateCopy::copy_from`], from a file read by its data regions: a hole is given to `inspect` as
    /// zeros and never read, and with no `inspect` the data is copied inside the kernel. The file's size is
    /// checked after the copy: a file that shrank or grew meanwhile is an error, as a short or long source is
    /// there.
    pub fn copy_file(
        dir: Option<&Path>,
        name: &CStr,
        source: &File,
        len: u64,
        mut inspect: Option<Inspect<'_>>,
    ) -> io::Result<PrivateCopy> {
        let (file, backing) = create(dir, name, len)?;
        let mut buf = Vec::new();
        let mut in_kernel = inspect.is_none();
        let mut offset = 0u64;
        while offset < len {
            let data = match lseek(source, to_off(offset)?, Whence::SeekData) {
                Ok(data) => u64::try_from(data).map_err(io::Error::other)?.min(len),
                // No data past `offset`: the rest is a hole (or the file shrank, found below).
                Err(Errno::ENXIO) => len,
                Err(err) => return Err(err.into()),
            };
            if let Some(inspect) = inspect.as_deref_mut() {
                inspect_zeros(inspect, data - offset);
            }
            if data == len {
                break;
            }
            let hole = u64::try_from(lseek(source, to_off(data)?, Whence::SeekHole)?).map_err(io::Error::other)?;
            let end = hole.min(len);
            let mut at = data;
            if in_kernel {
                match copy_in_kernel(source, &file, at, end) {
                    Ok(copied) => at = copied,
                    // Another filesystem, or one that cannot: copied through a buffer instead.
                    Err(Errno::EXDEV | Errno::EINVAL | Errno::ENOSYS | Errno::EOPNOTSUPP) => in_kernel = false,
                    Err(err) => return Err(err.into()),
                }
            }
            while at < end {
                if buf.is_empty() {
                    buf = vec![0u8; CHUNK];
                }
                let want = usize::try_from(end - at).unwrap_or(CHUNK).min(CHUNK);
                let n = match source.read_at(&mut buf[..want], at) {
                    Ok(0) => return Err(short(at, len)),
                    Ok(n) => n,
                    Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                    Err(err) => return Err(err),
                };
                let chunk = &buf[..n];
                if let Some(inspect) = inspect.as_deref_mut() {
                    inspect(chunk);
                }
                write_nonzero(&file, chunk, at)?;
                at += n as u64;
            }
            offset = end;
        }
        let size = source.metadata()?.len();
        if size > len {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("more than the {len} bytes expected")));
        }
        if size < len {
            return Err(short(size, len));
        }
        finish(file, len, backing)
    }

    /// The file, to map (`MAP_PRIVATE`) or read. Never write to it.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Its size in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where it lives.
    pub fn backing(&self) -> Backing {
        self.backing
    }

    /// A copy an earlier process kept at `path` ([`PrivateCopy::keep`]), if it is a regular file of `len` bytes
    /// (never reached through a link) and `stamp` (what the keeper recorded) is its [`FileStamp`]: a write,
    /// truncation, `chmod` or replacement since changes the stamp, and a user process cannot set a change time
    /// back. Whoever can write where kept copies live can make the host map anything: that must be the host
    /// alone (a grant of it is refused).
    pub fn open_kept(path: &Path, len: u64, stamp: &FileStamp) -> Option<PrivateCopy> {
        let flags = nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK | nix::libc::O_NOCTTY | nix::libc::O_CLOEXEC;
        let file = std::fs::OpenOptions::new().read(true).custom_flags(flags).open(path).ok()?;
        let meta = file.metadata().ok()?;
        (meta.is_file() && meta.len() == len && FileStamp::of_metadata(&meta) == *stamp).then_some(PrivateCopy {
            file,
            len,
            backing: Backing::Kept,
        })
    }

    /// Keeps this copy (an unnamed file) at `path`, in a directory on its filesystem, for later processes
    /// ([`PrivateCopy::open_kept`]): its data made durable first (so a crash can never leave a kept file whose
    /// stamp vouches for blocks that were not written), then linked under a temporary name (`.NAME.PID.N.tmp`,
    /// swept like the module cache's if the process dies) and renamed into place. Returns the stamp it has there,
    /// which the caller records. Read-only for its owner; from now on [`Backing::Kept`].
    pub fn keep(&mut self, path: &Path) -> io::Result<FileStamp> {
        use std::os::fd::AsRawFd;
        if self.backing != Backing::Unnamed {
            return Err(io::Error::new(io::ErrorKind::Unsupported, "only an unnamed file can be kept"));
        }
        let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "a kept copy needs a directory and a name"));
        };
        self.file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o400))?;
        self.file.sync_data()?;
        let temporary = temporary_beside(dir, &name.to_string_lossy());
        // An unnamed file gets a name through its descriptor's link in /proc (linkat with AT_EMPTY_PATH would
        // need CAP_DAC_READ_SEARCH).
        let own = PathBuf::from(format!("/proc/self/fd/{}", self.file.as_raw_fd()));
        nix::unistd::linkat(
            nix::fcntl::AT_FDCWD,
            own.as_path(),
            nix::fcntl::AT_FDCWD,
            temporary.as_path(),
            nix::fcntl::AtFlags::AT_SYMLINK_FOLLOW,
        )?;
        if let Err(err) = std::fs::rename(&temporary, path) {
            let _ = std::fs::remove_file(&temporary);
            return Err(err);
        }
        self.backing = Backing::Kept;
        // After the link and the rename, which change the change time.
        Ok(FileStamp::of_metadata(&self.file.metadata()?))
    }
}

/// A temporary name for `name` in `dir`: `.NAME.PID.N.tmp`, as the module cache names its temporaries, so that a
/// prune sweeps those of processes that died.
pub(crate) fn temporary_beside(dir: &Path, name: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    dir.join(format!(".{name}.{}.{n}.tmp", std::process::id()))
}

/// A new file of `len` bytes (all a hole) for a copy: unnamed in `dir` if it can be, else a memfd.
fn create(dir: Option<&Path>, name: &CStr, len: u64) -> io::Result<(File, Backing)> {
    let (file, backing) = match dir.and_then(unnamed_in) {
        Some(file) => (file, Backing::Unnamed),
        None => {
            let fd = memfd_create(name, MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)?;
            (File::from(fd), Backing::SealedMemfd)
        }
    };
    file.set_len(len)?;
    Ok((file, backing))
}

/// The copy, once every byte is in: a memfd sealed against every change.
fn finish(file: File, len: u64, backing: Backing) -> io::Result<PrivateCopy> {
    if backing == Backing::SealedMemfd {
        let seals = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_WRITE | SealFlag::F_SEAL_SEAL;
        fcntl(&file, FcntlArg::F_ADD_SEALS(seals))?;
    }
    Ok(PrivateCopy { file, len, backing })
}

fn short(found: u64, len: u64) -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, format!("{found} bytes where {len} were expected"))
}

fn to_off(offset: u64) -> io::Result<i64> {
    i64::try_from(offset).map_err(io::Error::other)
}

/// Gives `inspect` `count` zero bytes, a chunk at a time.
fn inspect_zeros(inspect: &mut dyn FnMut(&[u8]), count: u64) {
    static ZEROS: [u8; PAGE * 16] = [0; PAGE * 16];
    let mut left = count;
    while left > 0 {
        let n = usize::try_from(left).unwrap_or(ZEROS.len()).min(ZEROS.len());
        inspect(&ZEROS[..n]);
        left -= n as u64;
    }
}

/// Copies `[from, to)` of `source` to the same offsets of `copy` inside the kernel; returns where it stopped
/// (before `to` only at the source's end, which the caller finds on reading on).
fn copy_in_kernel(source: &File, copy: &File, from: u64, to: u64) -> Result<u64, Errno> {
    let mut at = from;
    while at < to {
        let mut off_in = i64::try_from(at).map_err(|_| Errno::EOVERFLOW)?;
        let mut off_out = off_in;
        let want = usize::try_from(to - at).unwrap_or(usize::MAX).min(1 << 30);
        match copy_file_range(source, Some(&mut off_in), copy, Some(&mut off_out), want) {
            Ok(0) => break,
            Ok(n) => at += n as u64,
            Err(Errno::EINTR) => {}
            Err(err) => return Err(err),
        }
    }
    Ok(at)
}

/// A new unnamed file in `dir`, if `dir` is on a disk filesystem and takes one.
fn unnamed_in(dir: &Path) -> Option<File> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_TMPFILE | nix::libc::O_CLOEXEC)
        .open(dir)
        .ok()?;
    let kind = fstatfs(&file).ok()?.filesystem_type();
    DISK_FILESYSTEMS.contains(&kind).then_some(file)
}

/// Writes the pages of `chunk` that are not all zero at `offset`, leaving the others holes.
fn write_nonzero(file: &File, chunk: &[u8], offset: u64) -> io::Result<()> {
    let mut at = 0;
    while at < chunk.len() {
        // A run of pages with data, written with one call.
        let start = at;
        while at < chunk.len() && !is_zero(&chunk[at..(at + PAGE).min(chunk.len())]) {
            at = (at + PAGE).min(chunk.len());
        }
        if at > start {
            file.write_all_at(&chunk[start..at], offset + start as u64)?;
        }
        while at < chunk.len() && is_zero(&chunk[at..(at + PAGE).min(chunk.len())]) {
            at = (at + PAGE).min(chunk.len());
        }
    }
    Ok(())
}

fn is_zero(bytes: &[u8]) -> bool {
    // Eight bytes at a time: a page of zeros is checked in a few hundred instructions.
    let (words, rest) = bytes.as_chunks::<8>();
    words.iter().all(|w| u64::from_ne_bytes(*w) == 0) && rest.iter().all(|&b| b == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(dir: Option<&Path>, bytes: &[u8]) -> PrivateCopy {
        PrivateCopy::copy_from(dir, c"test", bytes, bytes.len() as u64, |_| {}).expect("copy")
    }

    fn sample() -> Vec<u8> {
        let mut bytes = vec![0u8; 3 * PAGE + 100];
        bytes[5] = 1;
        bytes[2 * PAGE + 7] = 2;
        bytes[3 * PAGE + 99] = 3;
        bytes
    }

    fn read_all(copy: &PrivateCopy) -> Vec<u8> {
        let mut read = vec![0u8; usize::try_from(copy.len()).expect("len")];
        copy.file().read_exact_at(&mut read, 0).expect("read the copy");
        read
    }

    #[test]
    fn a_memfd_copy_has_the_bytes_and_refuses_every_change() {
        let bytes = sample();
        let copy = copy(None, &bytes);
        assert_eq!(copy.backing(), Backing::SealedMemfd);
        assert_eq!(read_all(&copy), bytes);
        copy.file().set_len(0).expect_err("shrinking is refused");
        copy.file().set_len(1 << 20).expect_err("growing is refused");
        copy.file().write_all_at(b"x", 0).expect_err("writing is refused");
        let seals = fcntl(copy.file(), FcntlArg::F_GET_SEALS).expect("seals");
        assert!(SealFlag::from_bits_truncate(seals).contains(SealFlag::F_SEAL_SEAL));
    }

    #[test]
    fn an_unnamed_copy_on_a_disk_filesystem_has_no_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bytes = sample();
        let copy = copy(Some(dir.path()), &bytes);
        assert_eq!(read_all(&copy), bytes);
        match copy.backing() {
            Backing::Unnamed => {
                assert_eq!(std::fs::read_dir(dir.path()).expect("ls").count(), 0, "nothing in the directory");
                let link =
                    std::fs::read_link(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(copy.file())))
                        .expect("fd link");
                assert!(link.to_string_lossy().ends_with("(deleted)"), "{}", link.display());
            }
            // The temporary directory is not on a disk filesystem here: the memfd is used, as it should be.
            Backing::SealedMemfd => eprintln!("skipped: {} is not on a disk filesystem", dir.path().display()),
            Backing::Kept => panic!("a new copy is never a kept one"),
        }
    }

    #[test]
    fn zero_pages_stay_holes() {
        let mut bytes = vec![0u8; 256 * PAGE];
        bytes[0] = 1;
        let copy = copy(None, &bytes);
        let blocks = nix::sys::stat::fstat(copy.file()).expect("stat").st_blocks as u64 * 512;
        assert!(blocks < 16 * PAGE as u64, "{blocks} bytes allocated for one page of data");
    }

    #[test]
    fn a_short_or_long_source_is_an_error() {
        let err = PrivateCopy::copy_from(None, c"test", &b"abc"[..], 4, |_| {}).expect_err("short");
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        let err = PrivateCopy::copy_from(None, c"test", &b"abcde"[..], 4, |_| {}).expect_err("long");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn every_byte_is_inspected_in_order() {
        let bytes: Vec<u8> = (0..3 * CHUNK + 17).map(|i| (i % 251) as u8).collect();
        let mut seen = Vec::new();
        PrivateCopy::copy_from(None, c"test", &bytes[..], bytes.len() as u64, |chunk| seen.extend_from_slice(chunk))
            .expect("copy");
        assert_eq!(seen, bytes);
    }

    /// `bytes` in a file whose zero pages are holes.
    fn sparse_file(dir: &Path, bytes: &[u8]) -> File {
        let file =
            File::options().read(true).write(true).create(true).truncate(true).open(dir.join("src")).expect("src");
        file.set_len(bytes.len() as u64).expect("len");
        write_nonzero(&file, bytes, 0).expect("write");
        file
    }

    #[test]
    fn a_sparse_file_is_copied_by_its_data_and_its_holes_are_inspected_as_zeros() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut bytes = vec![0u8; 64 * PAGE + 100];
        bytes[5] = 1;
        bytes[40 * PAGE + 7] = 2;
        bytes[64 * PAGE + 99] = 3;
        let source = sparse_file(dir.path(), &bytes);
        for place in [None, Some(dir.path())] {
            let copy = PrivateCopy::copy_file(place, c"test", &source, bytes.len() as u64, None).expect("copy");
            assert_eq!(read_all(&copy), bytes);
            let blocks = nix::sys::stat::fstat(copy.file()).expect("stat").st_blocks as u64 * 512;
            assert!(blocks < 16 * PAGE as u64, "{blocks} bytes allocated for three pages of data");
        }
        let mut seen = Vec::new();
        let mut inspect = |chunk: &[u8]| seen.extend_from_slice(chunk);
        PrivateCopy::copy_file(None, c"test", &source, bytes.len() as u64, Some(&mut inspect)).expect("copy");
        assert_eq!(seen, bytes);
    }

    #[test]
    fn a_file_of_another_size_than_expected_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let source = sparse_file(dir.path(), &sample());
        let len = sample().len() as u64;
        let err = PrivateCopy::copy_file(None, c"test", &source, len + 1, None).expect_err("short");
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        let err = PrivateCopy::copy_file(None, c"test", &source, len - 1, None).expect_err("long");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn a_directory_that_takes_no_unnamed_file_falls_back_to_the_memfd() {
        let copy = copy(Some(Path::new("/proc")), &sample());
        assert_eq!(copy.backing(), Backing::SealedMemfd);
    }
}
