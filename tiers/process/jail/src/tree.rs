//! The overlay's upper layer as one file: what a process-tier snapshot stores and a fork restores.
//!
//! [`write_tree`] runs on the host: it walks the jail's upper directory through a descriptor PID 1 hands over
//! (the directory is on the jail's private tmpfs, out of the host's sight), relative to directory descriptors
//! only, never following a symlink. [`extract_tree`] runs in a new jail's PID 1, into its empty upper directory,
//! before the overlay is mounted over it — so the fork's tmpfs pages are charged to the fork's own cgroup.
//!
//! What is kept: directories, regular files (holes stay holes), symlinks (the link itself, never its target),
//! hard links, FIFOs, overlay whiteouts (character devices 0/0: files the job deleted from the image stay
//! deleted), permission bits (setuid/setgid/sticky too), owners, modification times, and the extended attributes
//! that carry meaning: `trusted.overlay.opaque` (a directory that replaced the image's), `user.*` and
//! `security.capability`. What is not: sockets (live endpoints), device nodes other than whiteouts, other
//! extended attributes (overlay's own bookkeeping such as `trusted.overlay.origin` refers to the mount it was
//! made on and is rebuilt by the fork's; ACLs and security labels are skipped); each skip is reported in
//! [`TreeStats::skipped`]. An upper layer that depends on the image's inode layout (a `trusted.overlay.redirect`
//! or `metacopy` entry, which the jail's mount options rule out) is refused.
//!
//! Owners are stored as the jail sees them (0 is the jail's root), so a fork restores them through its own ID
//! mapping; an ID outside the mapping is stored as 65534, the overflow ID the jail saw for it. What a restore
//! makes — setuid bits and whiteout devices included — exists only in the new jail's private tmpfs, under its
//! own mapping, never in a host directory; a restore refuses `..`, absolute and non-plain paths, a record outside
//! the directory it just made, a hard link to anything but a file it restored, and more than [`MAX_ENTRIES`]
//! records, and follows no link it made.
//!
//! The format (version 1), integers little-endian:
//!
//! ```text
//! "strata-tree1"                                   magic, 12 bytes
//! record*                                          depth-first, a directory before its entries; the root first
//!   u8 kind  u16 len + path  u32 mode  u32 uid  u32 gid  i64 mtime_sec  u32 mtime_nsec
//!   u8 count, count × (u8 len + name, u32 len + value)          extended attributes
//!   file:     u64 size, u32 extents, extents × (u64 offset, u64 len, bytes)
//!   symlink:  u16 len + target        hard link: u16 len + path of the first link (an earlier file record)
//! 0xFF u64 records                                 the end, with the number of records before it
//! ```

use std::collections::{HashMap, HashSet};
use std::ffi::{CString, OsStr};
use std::fmt;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat, readlinkat};
use nix::sys::stat::{FchmodatFlags, FileStat, Mode, SFlag, UtimensatFlags, fstat, fstatat, mkdirat, mknodat};
use nix::sys::time::TimeSpec;
use nix::unistd::{Gid, Uid, Whence};

use crate::proto::IdMap;

/// The file's first bytes.
pub const MAGIC: &[u8; 12] = b"strata-tree1";

/// The name of the format, for manifests.
pub const FORMAT: &str = "strata-tree/1";

/// The ID an owner outside the jail's mapping is stored as (the kernel's overflow ID, what the jail sees).
pub const OVERFLOW_ID: u32 = 65_534;

/// Directories nested deeper than this are refused (each level holds a descriptor while it is walked).
pub const MAX_DEPTH: usize = 256;

/// A tree of more records than this is refused, by the writer and by a restore (which stops there): a restore
/// keeps every path in memory to refuse duplicates.
pub const MAX_ENTRIES: u64 = 1 << 22;

const MAX_PATH: usize = 4096;
const MAX_NAME: usize = 255;
const MAX_XATTR_VALUE: usize = 64 * 1024;
const MAX_XATTR_LIST: usize = 64 * 1024;
/// Skipped entries listed by name; more are only counted.
const MAX_SKIPPED_LISTED: usize = 100;

const KIND_DIR: u8 = 1;
const KIND_FILE: u8 = 2;
const KIND_SYMLINK: u8 = 3;
const KIND_WHITEOUT: u8 = 4;
const KIND_FIFO: u8 = 5;
const KIND_HARDLINK: u8 = 6;
const KIND_END: u8 = 0xFF;

/// Why a tree could not be written or restored.
#[derive(Debug)]
pub enum TreeError {
    /// A system call on an entry failed.
    Os {
        /// The entry, relative to the upper layer's root (`/` is the root).
        path: String,
        /// What was being done.
        op: &'static str,
        /// The error.
        errno: Errno,
    },
    /// The output or input stream failed.
    Stream(std::io::Error),
    /// The file is not a valid tree.
    Format(String),
    /// The upper layer holds something a fork could not rebuild.
    Unsupported {
        /// The entry.
        path: String,
        /// Why.
        reason: String,
    },
}

impl fmt::Display for TreeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TreeError::Os { path, op, errno } => write!(f, "{op} /{path}: {}", errno.desc()),
            TreeError::Stream(err) => write!(f, "tree stream: {err}"),
            TreeError::Format(what) => write!(f, "not a valid {FORMAT} file: {what}"),
            TreeError::Unsupported { path, reason } => write!(f, "/{path}: {reason}"),
        }
    }
}

impl std::error::Error for TreeError {}

impl From<std::io::Error> for TreeError {
    fn from(err: std::io::Error) -> Self {
        TreeError::Stream(err)
    }
}

fn os<'a>(path: &'a str, op: &'static str) -> impl FnOnce(Errno) -> TreeError + 'a {
    move |errno| TreeError::Os { path: path.to_owned(), op, errno }
}

fn format_error(what: impl Into<String>) -> TreeError {
    TreeError::Format(what.into())
}

/// An entry left out of the tree, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// The entry (relative to the upper layer's root).
    pub path: String,
    /// What was left out (`socket`, `device node`, `xattr security.selinux`, ...).
    pub what: String,
    /// Why.
    pub reason: &'static str,
}

/// What a tree holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TreeStats {
    /// Records (entries, the root included).
    pub entries: u64,
    /// Bytes of file contents.
    pub data_bytes: u64,
    /// Whiteouts (files of the image deleted in the sandbox).
    pub whiteouts: u64,
    /// Entries or attributes left out (at most 100 listed).
    pub skipped: Vec<Skipped>,
    /// How many were left out in all.
    pub skipped_count: u64,
}

impl TreeStats {
    fn skip(&mut self, path: &str, what: impl Into<String>, reason: &'static str) {
        self.skipped_count += 1;
        if self.skipped.len() < MAX_SKIPPED_LISTED {
            self.skipped.push(Skipped { path: path.to_owned(), what: what.into(), reason });
        }
    }
}

/// An extended attribute: name, value.
type Xattr = (Vec<u8>, Vec<u8>);

/// What to do with an extended attribute.
enum XattrPolicy {
    Keep,
    /// Overlay's bookkeeping about the mount it was made on; the fork's overlay makes its own.
    Drop,
    Skip(&'static str),
    Refuse(&'static str),
}

fn xattr_policy(name: &[u8]) -> XattrPolicy {
    match name {
        b"trusted.overlay.opaque" | b"security.capability" => XattrPolicy::Keep,
        b"trusted.overlay.redirect" | b"trusted.overlay.metacopy" => XattrPolicy::Refuse(
            "a renamed directory or a metadata-only copy of the image (overlay redirect/metacopy), which only the \
             mount that made it can follow",
        ),
        n if n.starts_with(b"user.") => XattrPolicy::Keep,
        n if n.starts_with(b"trusted.overlay.") => XattrPolicy::Drop,
        n if n.starts_with(b"system.posix_acl") => XattrPolicy::Skip("ACLs are not stored"),
        _ => XattrPolicy::Skip("only user.*, security.capability and the overlay's opaque mark are stored"),
    }
}

/// The host IDs ↔ the jail's IDs.
fn to_jail(id: u32, map: Option<IdMap>) -> u32 {
    match map {
        None => id,
        Some(map) if id >= map.base && id - map.base < map.count => id - map.base,
        Some(_) => OVERFLOW_ID,
    }
}

fn to_host(id: u32, map: Option<IdMap>) -> Result<u32, TreeError> {
    match map {
        None => Ok(id),
        Some(map) if id < map.count => Ok(map.base + id),
        Some(map) => Err(format_error(format!("owner {id} is outside the jail's {} IDs", map.count))),
    }
}

struct Out<W: Write> {
    out: W,
    records: u64,
}

impl<W: Write> Out<W> {
    fn bytes(&mut self, b: &[u8]) -> Result<(), TreeError> {
        self.out.write_all(b).map_err(TreeError::Stream)
    }
    fn u8(&mut self, v: u8) -> Result<(), TreeError> {
        self.bytes(&[v])
    }
    fn u16_bytes(&mut self, b: &[u8]) -> Result<(), TreeError> {
        let len = u16::try_from(b.len()).map_err(|_| format_error("a string longer than 65535 bytes"))?;
        self.bytes(&len.to_le_bytes())?;
        self.bytes(b)
    }
    fn u32(&mut self, v: u32) -> Result<(), TreeError> {
        self.bytes(&v.to_le_bytes())
    }
    fn u64(&mut self, v: u64) -> Result<(), TreeError> {
        self.bytes(&v.to_le_bytes())
    }
}

/// Walks the upper directory `root` (a descriptor of it) and writes the tree to `out`. `map` is the jail's ID
/// mapping (`None` when its jobs run as host IDs).
pub fn write_tree(root: BorrowedFd<'_>, out: impl Write, map: Option<IdMap>) -> Result<TreeStats, TreeError> {
    let mut w = Walker { out: Out { out, records: 0 }, map, stats: TreeStats::default(), links: HashMap::new() };
    w.out.bytes(MAGIC)?;
    let st = fstat(root).map_err(os("", "stat"))?;
    let xattrs = w.xattrs(root, "")?;
    w.header(KIND_DIR, "", &st, &xattrs)?;
    w.dir(root, "", 1)?;
    w.out.u8(KIND_END)?;
    let records = w.out.records;
    w.out.u64(records)?;
    w.out.out.flush()?;
    w.stats.entries = records;
    Ok(w.stats)
}

struct Walker<W: Write> {
    out: Out<W>,
    map: Option<IdMap>,
    stats: TreeStats,
    /// (device, inode) of files with several links → the path written first.
    links: HashMap<(u64, u64), String>,
}

impl<W: Write> Walker<W> {
    fn header(&mut self, kind: u8, path: &str, st: &FileStat, xattrs: &[Xattr]) -> Result<(), TreeError> {
        self.out.records += 1;
        if self.out.records > MAX_ENTRIES {
            return Err(TreeError::Unsupported {
                path: path.to_owned(),
                reason: format!("more than {MAX_ENTRIES} files and directories"),
            });
        }
        self.out.u8(kind)?;
        self.out.u16_bytes(path.as_bytes())?;
        self.out.u32(st.st_mode & 0o7777)?;
        self.out.u32(to_jail(st.st_uid, self.map))?;
        self.out.u32(to_jail(st.st_gid, self.map))?;
        self.out.bytes(&st.st_mtime.to_le_bytes())?;
        self.out.u32(u32::try_from(st.st_mtime_nsec).unwrap_or(0))?;
        self.out.u8(u8::try_from(xattrs.len()).map_err(|_| TreeError::Unsupported {
            path: path.to_owned(),
            reason: "more than 255 extended attributes".into(),
        })?)?;
        for (name, value) in xattrs {
            self.out.u8(u8::try_from(name.len()).map_err(|_| format_error("an attribute name over 255 bytes"))?)?;
            self.out.bytes(name)?;
            self.out.u32(u32::try_from(value.len()).map_err(|_| format_error("an attribute over 4 GiB"))?)?;
            self.out.bytes(value)?;
        }
        Ok(())
    }

    /// The extended attributes of an open directory or file that the tree keeps.
    fn xattrs(&mut self, fd: BorrowedFd<'_>, path: &str) -> Result<Vec<Xattr>, TreeError> {
        let names = list_xattrs(fd).map_err(os(path, "list attributes of"))?;
        let mut kept = Vec::new();
        for name in names.split(|b| *b == 0).filter(|n| !n.is_empty()) {
            let shown = String::from_utf8_lossy(name);
            match xattr_policy(name) {
                XattrPolicy::Drop => {}
                XattrPolicy::Skip(reason) => self.stats.skip(path, format!("xattr {shown}"), reason),
                XattrPolicy::Refuse(reason) => {
                    return Err(TreeError::Unsupported { path: path.to_owned(), reason: format!("{shown}: {reason}") });
                }
                XattrPolicy::Keep => {
                    let value = get_xattr(fd, name).map_err(os(path, "read an attribute of"))?;
                    kept.push((name.to_vec(), value));
                }
            }
        }
        Ok(kept)
    }

    fn dir(&mut self, dir: BorrowedFd<'_>, path: &str, depth: usize) -> Result<(), TreeError> {
        if depth > MAX_DEPTH {
            return Err(TreeError::Unsupported {
                path: path.to_owned(),
                reason: format!("directories nested deeper than {MAX_DEPTH}"),
            });
        }
        let names = list_dir(dir).map_err(os(path, "list"))?;
        for name in names {
            let child = if path.is_empty() {
                String::from_utf8_lossy(&name).into_owned()
            } else {
                format!("{path}/{}", String::from_utf8_lossy(&name))
            };
            if std::str::from_utf8(&name).is_err() {
                self.stats.skip(&child, "entry", "its name is not UTF-8");
                continue;
            }
            let name = OsStr::from_bytes(&name);
            let st = match fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
                Ok(st) => st,
                // Removed since the listing (a process of the jail still running): nothing to store.
                Err(Errno::ENOENT) => continue,
                Err(errno) => return Err(TreeError::Os { path: child, op: "stat", errno }),
            };
            match SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) {
                SFlag::S_IFDIR => {
                    let fd = open_same(dir, name, &st, OFlag::O_DIRECTORY, &child)?;
                    let xattrs = self.xattrs(fd.as_fd(), &child)?;
                    self.header(KIND_DIR, &child, &st, &xattrs)?;
                    self.dir(fd.as_fd(), &child, depth + 1)?;
                }
                SFlag::S_IFREG => self.file(dir, name, &st, &child)?,
                SFlag::S_IFLNK => {
                    let target = readlinkat(dir, name).map_err(os(&child, "read link"))?;
                    self.header(KIND_SYMLINK, &child, &st, &[])?;
                    self.out.u16_bytes(target.as_bytes())?;
                }
                SFlag::S_IFCHR if st.st_rdev == 0 => {
                    self.stats.whiteouts += 1;
                    self.header(KIND_WHITEOUT, &child, &st, &[])?;
                }
                SFlag::S_IFIFO => self.header(KIND_FIFO, &child, &st, &[])?,
                SFlag::S_IFSOCK => self.stats.skip(&child, "socket", "a socket is a live endpoint, not data"),
                _ => self.stats.skip(&child, "device node", "device nodes are not stored"),
            }
        }
        Ok(())
    }

    fn file(&mut self, dir: BorrowedFd<'_>, name: &OsStr, st: &FileStat, path: &str) -> Result<(), TreeError> {
        if st.st_nlink > 1 {
            let key = (st.st_dev, st.st_ino);
            if let Some(first) = self.links.get(&key).cloned() {
                self.header(KIND_HARDLINK, path, st, &[])?;
                return self.out.u16_bytes(first.as_bytes());
            }
            self.links.insert(key, path.to_owned());
        }
        let fd = open_same(dir, name, st, OFlag::O_NONBLOCK | OFlag::O_NOCTTY, path)?;
        let xattrs = self.xattrs(fd.as_fd(), path)?;
        let size = u64::try_from(st.st_size).map_err(|_| format_error("a negative file size"))?;
        let extents = data_extents(fd.as_fd(), size).map_err(os(path, "find the data of"))?;
        self.header(KIND_FILE, path, st, &xattrs)?;
        self.out.u64(size)?;
        self.out.u32(u32::try_from(extents.len()).map_err(|_| format_error("too many extents"))?)?;
        let mut buf = vec![0u8; 256 * 1024];
        for (offset, len) in extents {
            self.out.u64(offset)?;
            self.out.u64(len)?;
            let mut done = 0u64;
            while done < len {
                let want = usize::try_from((len - done).min(buf.len() as u64)).unwrap_or(buf.len());
                let at = i64::try_from(offset + done).map_err(|_| format_error("an offset past 2^63"))?;
                let n = match nix::sys::uio::pread(fd.as_fd(), &mut buf[..want], at) {
                    Ok(0) => {
                        return Err(TreeError::Unsupported {
                            path: path.to_owned(),
                            reason: "the file shrank while it was being stored".into(),
                        });
                    }
                    Ok(n) => n,
                    Err(Errno::EINTR) => continue,
                    Err(errno) => return Err(TreeError::Os { path: path.to_owned(), op: "read", errno }),
                };
                self.out.bytes(&buf[..n])?;
                done += n as u64;
            }
            self.stats.data_bytes += len;
        }
        Ok(())
    }
}

/// Opens `name` in `dir` without following a symlink, and checks it is still the entry `st` described.
fn open_same(dir: BorrowedFd<'_>, name: &OsStr, st: &FileStat, extra: OFlag, path: &str) -> Result<OwnedFd, TreeError> {
    let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | extra;
    let fd = openat(dir, name, flags, Mode::empty()).map_err(os(path, "open"))?;
    let now = fstat(fd.as_fd()).map_err(os(path, "stat"))?;
    if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) {
        return Err(TreeError::Unsupported {
            path: path.to_owned(),
            reason: "it was replaced while being stored".into(),
        });
    }
    Ok(fd)
}

/// The names in a directory, sorted, without `.` and `..`.
fn list_dir(dir: BorrowedFd<'_>) -> Result<Vec<Vec<u8>>, Errno> {
    let fd = openat(dir, ".", OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())?;
    let mut listing = nix::dir::Dir::from_fd(fd)?;
    let mut names = Vec::new();
    for entry in listing.iter() {
        let name = entry?.file_name().to_bytes().to_vec();
        if name != b"." && name != b".." {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// The data ranges of a file (holes left out), from `SEEK_DATA`/`SEEK_HOLE`.
fn data_extents(fd: BorrowedFd<'_>, size: u64) -> Result<Vec<(u64, u64)>, Errno> {
    let mut extents = Vec::new();
    let end = i64::try_from(size).map_err(|_| Errno::EFBIG)?;
    let mut at = 0i64;
    while at < end {
        let data = match nix::unistd::lseek(fd, at, Whence::SeekData) {
            Ok(data) => data,
            Err(Errno::ENXIO) => break,
            // A filesystem without hole reporting: one extent.
            Err(Errno::EINVAL) => return Ok(vec![(0, size)]),
            Err(errno) => return Err(errno),
        };
        if data >= end {
            break;
        }
        let hole = nix::unistd::lseek(fd, data, Whence::SeekHole)?.min(end);
        extents.push((data as u64, (hole - data) as u64));
        at = hole;
    }
    Ok(extents)
}

fn list_xattrs(fd: BorrowedFd<'_>) -> Result<Vec<u8>, Errno> {
    let mut buf = vec![0u8; 4096];
    loop {
        // SAFETY: flistxattr writes at most `buf.len()` bytes into `buf`, which is valid for writes of that size.
        let n = unsafe { libc::flistxattr(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n >= 0 {
            buf.truncate(n as usize);
            return Ok(buf);
        }
        match Errno::last() {
            Errno::ERANGE if buf.len() < MAX_XATTR_LIST => buf.resize(buf.len() * 4, 0),
            Errno::ENOTSUP => return Ok(Vec::new()),
            errno => return Err(errno),
        }
    }
}

fn get_xattr(fd: BorrowedFd<'_>, name: &[u8]) -> Result<Vec<u8>, Errno> {
    let name = CString::new(name).map_err(|_| Errno::EINVAL)?;
    let mut buf = vec![0u8; 256];
    loop {
        // SAFETY: fgetxattr reads the NUL-terminated `name` and writes at most `buf.len()` bytes into `buf`.
        let n = unsafe { libc::fgetxattr(fd.as_raw_fd(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if n >= 0 {
            buf.truncate(n as usize);
            return Ok(buf);
        }
        match Errno::last() {
            Errno::ERANGE if buf.len() < MAX_XATTR_VALUE => buf.resize((buf.len() * 4).min(MAX_XATTR_VALUE), 0),
            errno => return Err(errno),
        }
    }
}

fn set_xattr(fd: BorrowedFd<'_>, name: &[u8], value: &[u8]) -> Result<(), Errno> {
    let name = CString::new(name).map_err(|_| Errno::EINVAL)?;
    // SAFETY: fsetxattr reads the NUL-terminated `name` and `value.len()` bytes of `value`.
    let rc = unsafe { libc::fsetxattr(fd.as_raw_fd(), name.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
    if rc < 0 { Err(Errno::last()) } else { Ok(()) }
}

/// A tree being read: bounded reads of a stream that is not trusted to be well-formed.
struct In<R: Read> {
    input: R,
}

impl<R: Read> In<R> {
    fn exact(&mut self, buf: &mut [u8]) -> Result<(), TreeError> {
        self.input.read_exact(buf).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => format_error("it ends in the middle of a record"),
            _ => TreeError::Stream(e),
        })
    }
    fn u8(&mut self) -> Result<u8, TreeError> {
        let mut b = [0u8; 1];
        self.exact(&mut b)?;
        Ok(b[0])
    }
    fn u16(&mut self) -> Result<u16, TreeError> {
        let mut b = [0u8; 2];
        self.exact(&mut b)?;
        Ok(u16::from_le_bytes(b))
    }
    fn u32(&mut self) -> Result<u32, TreeError> {
        let mut b = [0u8; 4];
        self.exact(&mut b)?;
        Ok(u32::from_le_bytes(b))
    }
    fn u64(&mut self) -> Result<u64, TreeError> {
        let mut b = [0u8; 8];
        self.exact(&mut b)?;
        Ok(u64::from_le_bytes(b))
    }
    fn string(&mut self, max: usize, what: &str) -> Result<Vec<u8>, TreeError> {
        let len = usize::from(self.u16()?);
        if len > max {
            return Err(format_error(format!("a {what} of {len} bytes")));
        }
        let mut b = vec![0u8; len];
        self.exact(&mut b)?;
        if b.contains(&0) {
            return Err(format_error(format!("a {what} containing NUL")));
        }
        Ok(b)
    }
}

/// A record's common part.
struct Header {
    path: String,
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: TimeSpec,
    xattrs: Vec<Xattr>,
}

fn read_header<R: Read>(input: &mut In<R>) -> Result<Header, TreeError> {
    let path = input.string(MAX_PATH, "path")?;
    let path = String::from_utf8(path).map_err(|_| format_error("a path that is not UTF-8"))?;
    let mode = input.u32()?;
    if mode & !0o7777 != 0 {
        return Err(format_error(format!("mode {mode:o} of /{path}")));
    }
    let uid = input.u32()?;
    let gid = input.u32()?;
    let sec = i64::from_le_bytes({
        let mut b = [0u8; 8];
        input.exact(&mut b)?;
        b
    });
    let nsec = input.u32()?;
    if nsec >= 1_000_000_000 {
        return Err(format_error(format!("a modification time of /{path} with {nsec} ns")));
    }
    let count = input.u8()?;
    let mut xattrs = Vec::with_capacity(usize::from(count));
    for _ in 0..count {
        let len = usize::from(input.u8()?);
        let mut name = vec![0u8; len];
        input.exact(&mut name)?;
        let len = usize::try_from(input.u32()?).unwrap_or(usize::MAX);
        if len > MAX_XATTR_VALUE {
            return Err(format_error(format!("an attribute of /{path} of {len} bytes")));
        }
        let mut value = vec![0u8; len];
        input.exact(&mut value)?;
        if name.contains(&0) || !matches!(xattr_policy(&name), XattrPolicy::Keep) {
            return Err(format_error(format!("attribute {:?} of /{path}", String::from_utf8_lossy(&name))));
        }
        xattrs.push((name, value));
    }
    Ok(Header { path, mode, uid, gid, mtime: TimeSpec::new(sec, i64::from(nsec)), xattrs })
}

/// Splits a record's path into its parent and its name, checking every component is plain.
fn split_path(path: &str) -> Result<(&str, &str), TreeError> {
    if path.is_empty() || path.len() > MAX_PATH {
        return Err(format_error("an empty or over-long path"));
    }
    if path.split('/').any(|c| c.is_empty() || c == "." || c == ".." || c.len() > MAX_NAME) {
        return Err(format_error(format!("path {path:?} is not plain")));
    }
    Ok(path.rsplit_once('/').unwrap_or(("", path)))
}

/// Restores a tree from `input` into the empty directory `root`, as the jail with mapping `map` will see it.
/// Nothing is followed: every entry is created relative to a directory this restore created itself, in the
/// order the records come (a directory before its entries), and a duplicate or out-of-order record is refused.
pub fn extract_tree(input: impl Read, root: BorrowedFd<'_>, map: Option<IdMap>) -> Result<TreeStats, TreeError> {
    let mut input = In { input };
    let mut magic = [0u8; 12];
    input.exact(&mut magic)?;
    if &magic != MAGIC {
        return Err(format_error("wrong magic"));
    }
    let mut stats = TreeStats::default();
    let kind = input.u8()?;
    if kind != KIND_DIR {
        return Err(format_error("the first record is not the root directory"));
    }
    let first = read_header(&mut input)?;
    if !first.path.is_empty() {
        return Err(format_error("the first record is not the root directory"));
    }
    let root_fd = nix::unistd::dup(root).map_err(os("", "open"))?;
    apply_owner_mode(root_fd.as_fd(), &first, map)?;
    // Open directories from the root down to the last one created, with their paths and times.
    let mut stack: Vec<(String, OwnedFd, TimeSpec)> = vec![(String::new(), root_fd, first.mtime)];
    let mut files: HashSet<String> = HashSet::new();
    let mut seen: HashSet<String> = HashSet::new();
    stats.entries = 1;
    loop {
        let kind = input.u8()?;
        if kind == KIND_END {
            let records = input.u64()?;
            if records != stats.entries {
                return Err(format_error(format!("{} records, the trailer says {records}", stats.entries)));
            }
            let mut extra = [0u8; 1];
            if input.input.read(&mut extra).map_err(TreeError::Stream)? != 0 {
                return Err(format_error("bytes after the end"));
            }
            break;
        }
        if !(KIND_DIR..=KIND_HARDLINK).contains(&kind) {
            return Err(format_error(format!("record kind {kind}")));
        }
        let header = read_header(&mut input)?;
        let (parent, name) = split_path(&header.path)?;
        if !seen.insert(header.path.clone()) {
            return Err(format_error(format!("/{} appears twice", header.path)));
        }
        while stack.last().is_some_and(|(path, _, _)| path != parent) {
            close_dir(&mut stack)?;
        }
        let Some((_, dir, _)) = stack.last() else {
            return Err(format_error(format!("/{} comes outside its directory", header.path)));
        };
        let dir = dir.try_clone().map_err(TreeError::Stream)?;
        stats.entries += 1;
        if stats.entries > MAX_ENTRIES {
            return Err(format_error(format!("more than {MAX_ENTRIES} records")));
        }
        match kind {
            KIND_DIR => {
                if stack.len() > MAX_DEPTH {
                    return Err(format_error(format!("directories nested deeper than {MAX_DEPTH}")));
                }
                mkdirat(dir.as_fd(), name, Mode::from_bits_truncate(0o700)).map_err(os(&header.path, "create"))?;
                let fd = openat(
                    dir.as_fd(),
                    name,
                    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                    Mode::empty(),
                )
                .map_err(os(&header.path, "open"))?;
                apply_owner_mode(fd.as_fd(), &header, map)?;
                stack.push((header.path.clone(), fd, header.mtime));
            }
            KIND_FILE => {
                let fd = openat(
                    dir.as_fd(),
                    name,
                    OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                    Mode::from_bits_truncate(0o600),
                )
                .map_err(os(&header.path, "create"))?;
                stats.data_bytes += restore_contents(&mut input, fd.as_fd(), &header.path)?;
                apply_owner_mode(fd.as_fd(), &header, map)?;
                nix::sys::stat::futimens(fd.as_fd(), &header.mtime, &header.mtime)
                    .map_err(os(&header.path, "set the time of"))?;
                files.insert(header.path.clone());
            }
            KIND_SYMLINK => {
                let target = input.string(MAX_PATH, "link target")?;
                nix::unistd::symlinkat(OsStr::from_bytes(&target), dir.as_fd(), name)
                    .map_err(os(&header.path, "create"))?;
                chown_at(dir.as_fd(), name, &header, map)?;
                nix::sys::stat::utimensat(
                    dir.as_fd(),
                    name,
                    &header.mtime,
                    &header.mtime,
                    UtimensatFlags::NoFollowSymlink,
                )
                .map_err(os(&header.path, "set the time of"))?;
            }
            KIND_WHITEOUT | KIND_FIFO => {
                let (sflag, dev) = if kind == KIND_WHITEOUT { (SFlag::S_IFCHR, 0) } else { (SFlag::S_IFIFO, 0) };
                let perm = Mode::from_bits_truncate(header.mode);
                mknodat(dir.as_fd(), name, sflag, perm, dev).map_err(os(&header.path, "create"))?;
                chown_at(dir.as_fd(), name, &header, map)?;
                // Just created by this restore, and not a symlink: following is harmless.
                nix::sys::stat::fchmodat(dir.as_fd(), name, perm, FchmodatFlags::FollowSymlink)
                    .map_err(os(&header.path, "set the mode of"))?;
                if kind == KIND_WHITEOUT {
                    stats.whiteouts += 1;
                }
            }
            KIND_HARDLINK => {
                let target = input.string(MAX_PATH, "link target")?;
                let target = String::from_utf8(target).map_err(|_| format_error("a link target that is not UTF-8"))?;
                if !files.contains(&target) {
                    return Err(format_error(format!("/{} links to /{target}, not an earlier file", header.path)));
                }
                let root = &stack[0].1;
                nix::unistd::linkat(root.as_fd(), target.as_str(), dir.as_fd(), name, AtFlags::empty())
                    .map_err(os(&header.path, "link"))?;
            }
            _ => unreachable!("kind checked above"),
        }
    }
    while !stack.is_empty() {
        close_dir(&mut stack)?;
    }
    Ok(stats)
}

/// Pops the innermost open directory, setting its modification time now that its entries are in.
fn close_dir(stack: &mut Vec<(String, OwnedFd, TimeSpec)>) -> Result<(), TreeError> {
    if let Some((path, fd, mtime)) = stack.pop() {
        nix::sys::stat::futimens(fd.as_fd(), &mtime, &mtime).map_err(os(&path, "set the time of"))?;
    }
    Ok(())
}

fn apply_owner_mode(fd: BorrowedFd<'_>, header: &Header, map: Option<IdMap>) -> Result<(), TreeError> {
    let (uid, gid) = (to_host(header.uid, map)?, to_host(header.gid, map)?);
    nix::unistd::fchown(fd, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))
        .map_err(os(&header.path, "set the owner of"))?;
    // After chown, which clears setuid/setgid.
    nix::sys::stat::fchmod(fd, Mode::from_bits_truncate(header.mode)).map_err(os(&header.path, "set the mode of"))?;
    for (name, value) in &header.xattrs {
        set_xattr(fd, name, value).map_err(os(&header.path, "set an attribute of"))?;
    }
    Ok(())
}

fn chown_at(dir: BorrowedFd<'_>, name: &str, header: &Header, map: Option<IdMap>) -> Result<(), TreeError> {
    let (uid, gid) = (to_host(header.uid, map)?, to_host(header.gid, map)?);
    nix::unistd::fchownat(dir, name, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)), AtFlags::AT_SYMLINK_NOFOLLOW)
        .map_err(os(&header.path, "set the owner of"))
}

/// Reads a file record's body and writes its extents; returns the data bytes.
fn restore_contents<R: Read>(input: &mut In<R>, fd: BorrowedFd<'_>, path: &str) -> Result<u64, TreeError> {
    let size = input.u64()?;
    let size_i = i64::try_from(size).map_err(|_| format_error(format!("/{path} has size {size}")))?;
    let extents = input.u32()?;
    let mut end = 0u64;
    let mut total = 0u64;
    let mut buf = vec![0u8; 256 * 1024];
    let file = File::from(nix::unistd::dup(fd).map_err(os(path, "open"))?);
    for _ in 0..extents {
        let offset = input.u64()?;
        let len = input.u64()?;
        let stop = offset.checked_add(len).filter(|s| *s <= size && offset >= end);
        let Some(stop) = stop else {
            return Err(format_error(format!("an extent of /{path} out of order or past its size")));
        };
        let mut done = 0u64;
        while done < len {
            let want = usize::try_from((len - done).min(buf.len() as u64)).unwrap_or(buf.len());
            input.exact(&mut buf[..want])?;
            let mut written = 0;
            while written < want {
                let at = (offset + done) as i64 + written as i64;
                match nix::sys::uio::pwrite(file.as_fd(), &buf[written..want], at) {
                    Ok(n) => written += n,
                    Err(Errno::EINTR) => {}
                    Err(errno) => return Err(TreeError::Os { path: path.to_owned(), op: "write", errno }),
                }
            }
            done += want as u64;
        }
        end = stop;
        total += len;
    }
    nix::unistd::ftruncate(file.as_fd(), size_i).map_err(os(path, "set the size of"))?;
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};

    fn tree_of(dir: &std::path::Path) -> (Vec<u8>, TreeStats) {
        let fd = File::open(dir).expect("open");
        let mut out = Vec::new();
        let stats = write_tree(fd.as_fd(), &mut out, None).expect("write");
        (out, stats)
    }

    fn restore(bytes: &[u8], into: &std::path::Path) -> Result<TreeStats, TreeError> {
        let fd = File::open(into).expect("open");
        extract_tree(bytes, fd.as_fd(), None)
    }

    #[test]
    fn a_tree_round_trips_with_modes_links_holes_and_fifos() {
        let src = tempfile::tempdir().expect("tmp");
        let s = src.path();
        fs::create_dir_all(s.join("a/b")).expect("mkdir");
        fs::write(s.join("a/b/file"), b"hello").expect("write");
        fs::set_permissions(s.join("a/b/file"), fs::Permissions::from_mode(0o4751)).expect("chmod");
        fs::hard_link(s.join("a/b/file"), s.join("a/hard")).expect("link");
        symlink("/etc/passwd", s.join("a/abs-link")).expect("symlink");
        symlink("../..", s.join("a/b/up")).expect("symlink");
        let sparse = File::create(s.join("sparse")).expect("create");
        sparse.set_len(10 << 20).expect("truncate");
        nix::sys::uio::pwrite(&sparse, b"tail", (10 << 20) - 4).expect("pwrite");
        nix::unistd::mkfifo(&s.join("fifo"), Mode::from_bits_truncate(0o640)).expect("mkfifo");
        fs::set_permissions(s.join("a"), fs::Permissions::from_mode(0o1777)).expect("chmod");

        let (bytes, stats) = tree_of(s);
        assert!(bytes.len() < 1 << 20, "holes are not stored: {}", bytes.len());
        // The 10 MiB file's data is its last block.
        assert!(stats.data_bytes <= 5 + 64 * 1024, "{stats:?}");
        let dst = tempfile::tempdir().expect("tmp");
        let d = dst.path();
        let restored = restore(&bytes, d).expect("restore");
        assert_eq!(restored.entries, stats.entries);
        assert_eq!(fs::read(d.join("a/b/file")).expect("read"), b"hello");
        assert_eq!(fs::metadata(d.join("a/b/file")).expect("meta").mode() & 0o7777, 0o4751);
        assert_eq!(fs::metadata(d.join("a")).expect("meta").mode() & 0o7777, 0o1777);
        assert_eq!(
            fs::metadata(d.join("a/hard")).expect("meta").ino(),
            fs::metadata(d.join("a/b/file")).expect("m").ino()
        );
        assert_eq!(fs::read_link(d.join("a/abs-link")).expect("link"), std::path::Path::new("/etc/passwd"));
        assert_eq!(fs::read_link(d.join("a/b/up")).expect("link"), std::path::Path::new("../.."));
        let sparse = fs::metadata(d.join("sparse")).expect("meta");
        assert_eq!(sparse.len(), 10 << 20);
        assert!(sparse.blocks() * 512 < 1 << 20, "the hole stays a hole");
        assert!(fs::symlink_metadata(d.join("fifo")).expect("fifo").file_type().is_fifo());
        assert_eq!(
            fs::metadata(d.join("a/b/file")).expect("m").mtime(),
            fs::metadata(s.join("a/b/file")).expect("m").mtime()
        );
        // Restoring twice into the same place is refused (nothing is overwritten).
        assert!(matches!(restore(&bytes, d), Err(TreeError::Os { errno: Errno::EEXIST, .. })));
    }

    use std::os::unix::fs::FileTypeExt;

    #[test]
    fn hostile_trees_are_refused() {
        let src = tempfile::tempdir().expect("tmp");
        fs::create_dir(src.path().join("d")).expect("mkdir");
        fs::write(src.path().join("d/f"), b"x").expect("write");
        let (good, _) = tree_of(src.path());

        let refused = |bytes: &[u8]| {
            let dst = tempfile::tempdir().expect("tmp");
            let err = restore(bytes, dst.path()).expect_err("refused");
            // Nothing escaped the destination's parent.
            assert!(!dst.path().parent().expect("parent").join("f").exists());
            err
        };
        assert!(matches!(refused(&good[..good.len() - 3]), TreeError::Format(_)));
        assert!(matches!(refused(b"not a tree at all"), TreeError::Format(_)));
        let mut extra = good.clone();
        extra.push(0);
        assert!(matches!(refused(&extra), TreeError::Format(_)));
        // A path with `..`, spliced in place of `d/f` (same length).
        let at = good.windows(3).position(|w| w == b"d/f").expect("path");
        let mut dotdot = good.clone();
        dotdot[at..at + 3].copy_from_slice(b"../");
        assert!(matches!(refused(&dotdot), TreeError::Format(_)));
        // A file placed under a directory that is not the one just created.
        let mut elsewhere = good.clone();
        elsewhere[at..at + 3].copy_from_slice(b"e/f");
        assert!(matches!(refused(&elsewhere), TreeError::Format(_)));
    }

    #[test]
    fn sockets_and_unknown_attributes_are_skipped_with_a_reason() {
        let src = tempfile::tempdir().expect("tmp");
        let _listener = std::os::unix::net::UnixListener::bind(src.path().join("sock")).expect("bind");
        let (_, stats) = tree_of(src.path());
        assert_eq!(stats.skipped_count, 1);
        assert_eq!(stats.skipped[0].what, "socket");
    }

    #[test]
    fn owners_are_stored_as_the_jail_sees_them() {
        let map = Some(IdMap { base: 1_000_000_000, count: 65_536 });
        assert_eq!(to_jail(1_000_000_000, map), 0);
        assert_eq!(to_jail(1_000_001_000, map), 1000);
        assert_eq!(to_jail(0, map), OVERFLOW_ID);
        assert_eq!(to_jail(42, None), 42);
        assert_eq!(to_host(1000, map).expect("in range"), 1_000_001_000);
        assert!(to_host(70_000, map).is_err());
    }
}
