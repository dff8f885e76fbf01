//! Applying one layer tar to an empty directory, safely, as host root: the layer's tree in overlayfs's own form.
//!
//! [`apply_layer`] reads the tar itself (the `tar` crate only decodes a header block's fields) and creates every
//! entry relative to directory descriptors it opened without following a link, so nothing a layer holds can steer
//! a write outside its directory or make something the host should not have:
//!
//! - **Names**: a leading `/` and `.` components are dropped; a `..` component, an empty or NUL-holding name, a
//!   component over 255 bytes or a path over 4096 bytes is refused ([`OciError::Hostile`]). The entry naming the
//!   root itself (`./`) may only be a directory, whose owner, mode and time the root takes.
//! - **Links**: each parent directory is opened component by component with `O_NOFOLLOW | O_DIRECTORY`; a parent
//!   that is a symlink (or not a directory) is refused, so nothing is ever created through a link. A missing parent
//!   is created (mode 0755, root's). Symlink targets are stored verbatim: the jail resolves them inside itself.
//! - **Hard links** only to a regular file extracted earlier in this same layer; to anything else (an earlier
//!   layer's file, a directory, a path outside) they are refused.
//! - **Devices**: character and block devices are refused. OCI whiteouts become overlayfs's: `dir/.wh.NAME` is a
//!   character device 0/0 `dir/NAME`, `dir/.wh..wh..opq` sets `trusted.overlay.opaque=y` on `dir`; any other
//!   `.wh.` name is refused. FIFOs are made.
//! - **Metadata**: regular files and directories keep their mode bits (setuid, setgid and sticky too: the store is
//!   mode 0700 and jails mount it `nosuid`), owners (the image's own IDs, refused from 65536 on: the jail maps
//!   65536 IDs) and modification times; symlinks and FIFOs their owners (and times).
//! - **Extended attributes** (PAX `SCHILY.xattr.*`): `user.*` and `security.capability` (a well-formed v2 value,
//!   or v3 for the namespace's root) are set on files and directories; every other one is dropped and counted in
//!   [`LayerStats::dropped_xattrs`] — `trusted.overlay.*` and `user.overlay.*` above all, which would forge
//!   overlayfs's own metadata.
//! - **Replacing**: an entry whose name exists already in this layer replaces it (an earlier non-directory is
//!   removed, an empty directory too); a directory over a directory merges; over a non-empty directory it is refused.
//! - **Bounds**, checked before the work: at most [`ImportLimits::max_entries`] records (never more than
//!   [`MAX_ENTRIES`]), at most [`ImportLimits::max_layer_bytes`] of uncompressed stream (an entry whose declared
//!   size passes it is refused before a byte is written), PAX and GNU long-name records of at most 1 MiB.
//!
//! Layers may be plain or gzip-compressed tars (gzip is known by its magic); zstd is refused. Sparse (GNU) entries
//! are refused; PAX global headers are read and ignored.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat};
use nix::sys::stat::{Mode, SFlag, fstatat, mkdirat, mknodat};
use nix::sys::time::TimeSpec;
use nix::unistd::{Gid, Uid, UnlinkatFlags};
use sha2::{Digest, Sha256};

use crate::store::StoreError;

/// Why an import failed.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    /// Not an image this importer reads: a missing or malformed document, an unsupported form or layer type.
    #[error("{0}")]
    Format(String),
    /// A blob is not what its digest says.
    #[error("{what}: sha256 mismatch: expected {expected}, found {found}")]
    Digest {
        /// The blob (a path in the layout or archive, or a layer).
        what: String,
        /// The digest the manifest or config gives.
        expected: String,
        /// The digest of what is there.
        found: String,
    },
    /// A layer entry that would reach outside its directory or make something dangerous.
    #[error("layer entry {entry:?} refused: {reason}")]
    Hostile {
        /// The entry's name as the tar gives it.
        entry: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Over a bound ([`ImportLimits`], the largest JSON document, the most layers, …).
    #[error("too large: {0}")]
    TooLarge(String),
    /// A filesystem call failed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// Where (a layer entry's name, relative to its layer, or a file of the source).
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The most records (entries, PAX and long-name records) one layer may have, whatever the limits say.
pub const MAX_ENTRIES: u64 = 1 << 22;
/// The longest path an entry may have, in bytes.
pub const MAX_PATH: usize = 4096;
/// The longest name (path component), in bytes.
pub const MAX_NAME: usize = 255;
/// Owner and group IDs must be below this (the jail maps this many IDs).
pub const MAX_ID: u64 = 65_536;

const BLOCK: u64 = 512;
/// The largest PAX or GNU long-name record.
const MAX_META: u64 = 1 << 20;
const MAX_XATTRS: usize = 256;
const MAX_XATTR_VALUE: usize = 64 * 1024;
/// Bytes of paths kept in memory (regular files for hard links, directories for their times).
const MAX_REMEMBERED: usize = 256 << 20;
/// Modification times are kept within ±2^40 seconds (beyond any date a filesystem stores).
const MAX_TIME: i64 = 1 << 40;

/// What an import may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImportLimits {
    /// Bytes of one layer's uncompressed tar stream (headers, contents and padding).
    pub max_layer_bytes: u64,
    /// Records in one layer's tar (never more than [`MAX_ENTRIES`]).
    pub max_entries: u64,
    /// Bytes of all the image's layers' uncompressed streams together.
    pub max_image_bytes: u64,
}

impl Default for ImportLimits {
    /// 16 GiB a layer, 4 Mi entries, 64 GiB an image.
    fn default() -> ImportLimits {
        ImportLimits { max_layer_bytes: 16 << 30, max_entries: MAX_ENTRIES, max_image_bytes: 64 << 30 }
    }
}

/// What [`apply_layer`] made.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayerStats {
    /// Entries applied (directories, files, links, FIFOs, whiteouts, opaque marks).
    pub entries: u64,
    /// Bytes of regular files' contents.
    pub file_bytes: u64,
    /// Bytes of the uncompressed tar stream.
    pub stream_bytes: u64,
    /// The uncompressed stream's digest (`sha256:<hex>`): the layer's OCI `diff_id`.
    pub diff_id: String,
    /// Whether the stream was gzip-compressed.
    pub compressed: bool,
    /// Whiteouts made (character devices 0/0).
    pub whiteouts: u64,
    /// Directories marked opaque.
    pub opaque_dirs: u64,
    /// Extended attributes left out (not `user.*` or a valid `security.capability`, or on a symlink or FIFO).
    pub dropped_xattrs: u64,
}

/// Applies the layer tar `input` (plain or gzip) to the empty directory `root`; see the module docs for what is
/// made, refused and dropped. Reads `input` to its end (the digest covers the whole stream). On an error the
/// directory holds part of the layer: the caller removes it.
pub fn apply_layer(input: impl Read, root: &Path, limits: &ImportLimits) -> Result<LayerStats, OciError> {
    let (stream, compressed) = open_stream(input)?;
    let root_fd: OwnedFd = File::options()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(root)
        .map_err(|source| OciError::Io { what: "opening", path: root.to_owned(), source })?
        .into();
    let mut stream = Stream::new(stream, limits.max_layer_bytes);
    let mut x = Extractor {
        root: root_fd,
        cached: None,
        files: HashSet::new(),
        dir_times: Vec::new(),
        root_time: None,
        remembered: 0,
        stats: LayerStats { compressed, ..LayerStats::default() },
    };
    let max_entries = limits.max_entries.min(MAX_ENTRIES);
    let mut records = 0u64;
    let mut meta = Meta::default();
    while let Some(block) = next_header(&mut stream)? {
        records += 1;
        if records > max_entries {
            return Err(OciError::TooLarge(format!("a layer of more than {max_entries} tar records")));
        }
        let header = tar::Header::from_byte_slice(&block);
        let size = header.entry_size().map_err(|e| format_error(format!("a header's size: {e}")))?;
        match header.entry_type().as_byte() {
            b'x' => {
                let data = read_meta(&mut stream, size)?;
                parse_pax(&data, &mut meta)?;
                continue;
            }
            b'g' => {
                // Global PAX records set defaults for the rest of the archive: none that matter here.
                read_meta(&mut stream, size)?;
                continue;
            }
            b'L' => {
                meta.path = Some(trim_nul(read_meta(&mut stream, size)?));
                continue;
            }
            b'K' => {
                meta.link = Some(trim_nul(read_meta(&mut stream, size)?));
                continue;
            }
            _ => {}
        }
        let entry = Entry::new(header, std::mem::take(&mut meta), size)?;
        let padded = entry.size.checked_next_multiple_of(BLOCK).unwrap_or(u64::MAX);
        if stream.count.saturating_add(padded) > stream.limit {
            return Err(OciError::TooLarge(format!(
                "entry {:?} declares {} bytes, past the layer's limit of {} bytes",
                shown(&entry.path),
                entry.size,
                stream.limit
            )));
        }
        let consumed = x.apply(&entry, &mut stream)?;
        stream.skip(padded - consumed)?;
    }
    // The digest covers the whole stream, zero blocks and all.
    stream.drain()?;
    x.finish()?;
    let mut stats = x.stats;
    stats.stream_bytes = stream.count;
    stats.diff_id = format!("sha256:{}", strata_image_util::hex(&stream.hasher.finalize()));
    Ok(stats)
}

/// The layer `input` uncompressed (gzip known by its magic), and whether it was compressed.
pub(crate) fn open_stream<'a>(input: impl Read + 'a) -> Result<(Box<dyn Read + 'a>, bool), OciError> {
    let mut input = input;
    let mut magic = [0u8; 4];
    let mut got = 0;
    while got < magic.len() {
        match input.read(&mut magic[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(stream_error(e)),
        }
    }
    let head = io::Cursor::new(magic[..got].to_vec());
    let whole = head.chain(input);
    if magic[..got].starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        return Err(format_error("a zstd-compressed layer (only plain and gzip layers are supported)"));
    }
    if magic[..got].starts_with(&[0x1f, 0x8b]) {
        Ok((Box::new(flate2::read::MultiGzDecoder::new(whole)), true))
    } else {
        Ok((Box::new(whole), false))
    }
}

/// The uncompressed digest (`sha256:<hex>`) and size of the layer `input`, read to its end, at most `limit` bytes.
pub(crate) fn layer_digest(input: impl Read, limit: u64) -> Result<(String, u64), OciError> {
    let (stream, _) = open_stream(input)?;
    let mut stream = Stream::new(stream, limit);
    stream.drain()?;
    Ok((format!("sha256:{}", strata_image_util::hex(&stream.hasher.finalize())), stream.count))
}

fn format_error(what: impl Into<String>) -> OciError {
    OciError::Format(what.into())
}

fn hostile(entry: &[u8], reason: impl Into<String>) -> OciError {
    OciError::Hostile { entry: shown(entry), reason: reason.into() }
}

/// An entry's name for messages (lossy, at most 300 bytes of it).
fn shown(path: &[u8]) -> String {
    let cut = &path[..path.len().min(300)];
    let mut text = String::from_utf8_lossy(cut).into_owned();
    if cut.len() < path.len() {
        text.push('…');
    }
    text
}

fn os_error<'a>(what: &'static str, entry: &'a [u8]) -> impl FnOnce(Errno) -> OciError + 'a {
    move |errno| OciError::Io { what, path: PathBuf::from(OsStr::from_bytes(entry)), source: io::Error::from(errno) }
}

fn stream_error(err: io::Error) -> OciError {
    match err.kind() {
        io::ErrorKind::InvalidData | io::ErrorKind::InvalidInput | io::ErrorKind::UnexpectedEof => {
            format_error(format!("the layer stream: {err}"))
        }
        _ => OciError::Io { what: "reading", path: PathBuf::from("the layer stream"), source: err },
    }
}

/// The uncompressed tar stream: hashed, counted and bounded.
struct Stream<R> {
    inner: R,
    hasher: Sha256,
    count: u64,
    limit: u64,
}

impl<R: Read> Stream<R> {
    fn new(inner: R, limit: u64) -> Stream<R> {
        Stream { inner, hasher: Sha256::new(), count: 0, limit }
    }

    /// Reads some bytes (0 at the end of the stream).
    fn some(&mut self, buf: &mut [u8]) -> Result<usize, OciError> {
        loop {
            match self.inner.read(buf) {
                Ok(n) => {
                    self.hasher.update(&buf[..n]);
                    self.count += n as u64;
                    if self.count > self.limit {
                        return Err(OciError::TooLarge(format!(
                            "a layer of more than {} bytes uncompressed",
                            self.limit
                        )));
                    }
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(stream_error(e)),
            }
        }
    }

    /// Fills `buf` unless the stream ends first; returns the bytes read.
    fn full(&mut self, buf: &mut [u8]) -> Result<usize, OciError> {
        let mut got = 0;
        while got < buf.len() {
            let n = self.some(&mut buf[got..])?;
            if n == 0 {
                break;
            }
            got += n;
        }
        Ok(got)
    }

    fn exact(&mut self, buf: &mut [u8]) -> Result<(), OciError> {
        if self.full(buf)? < buf.len() {
            return Err(format_error("the layer tar ends inside an entry"));
        }
        Ok(())
    }

    fn skip(&mut self, mut n: u64) -> Result<(), OciError> {
        let mut buf = [0u8; 8192];
        while n > 0 {
            let want = usize::try_from(n).map_or(buf.len(), |n| n.min(buf.len()));
            self.exact(&mut buf[..want])?;
            n -= want as u64;
        }
        Ok(())
    }

    fn drain(&mut self) -> Result<(), OciError> {
        let mut buf = vec![0u8; 64 * 1024];
        while self.some(&mut buf)? > 0 {}
        Ok(())
    }
}

/// The next header block, `None` at the end of the archive (a zero block, or the stream's end between entries).
fn next_header<R: Read>(stream: &mut Stream<R>) -> Result<Option<[u8; 512]>, OciError> {
    let mut block = [0u8; 512];
    match stream.full(&mut block)? {
        0 => return Ok(None),
        512 => {}
        _ => return Err(format_error("the layer tar ends inside a header")),
    }
    if block.iter().all(|b| *b == 0) {
        return Ok(None);
    }
    check_sum(&block)?;
    Ok(Some(block))
}

/// Checks a header block's checksum (the unsigned sum, or the signed one old tars wrote).
pub(crate) fn check_sum(block: &[u8; 512]) -> Result<(), OciError> {
    let header = tar::Header::from_byte_slice(block);
    let stored = header.cksum().map_err(|e| format_error(format!("a header's checksum field: {e}")))?;
    let (mut unsigned, mut signed) = (0u32, 0i32);
    for (i, b) in block.iter().enumerate() {
        let b = if (148..156).contains(&i) { b' ' } else { *b };
        unsigned += u32::from(b);
        signed += i32::from(b as i8);
    }
    if stored != unsigned && i64::from(stored) != i64::from(signed) {
        return Err(format_error("a header whose checksum is wrong (not a tar, or a corrupt one)"));
    }
    Ok(())
}

/// Reads a PAX or GNU long-name record's data (and its padding).
fn read_meta<R: Read>(stream: &mut Stream<R>, size: u64) -> Result<Vec<u8>, OciError> {
    if size > MAX_META {
        return Err(OciError::TooLarge(format!("a PAX or long-name record of {size} bytes (at most {MAX_META})")));
    }
    let mut data = vec![0u8; size as usize];
    stream.exact(&mut data)?;
    stream.skip(size.next_multiple_of(BLOCK) - size)?;
    Ok(data)
}

pub(crate) fn trim_nul(mut bytes: Vec<u8>) -> Vec<u8> {
    if let Some(end) = bytes.iter().position(|b| *b == 0) {
        bytes.truncate(end);
    }
    bytes
}

/// What PAX and GNU long-name records say about the entry after them.
#[derive(Debug, Default)]
pub(crate) struct Meta {
    pub(crate) path: Option<Vec<u8>>,
    pub(crate) link: Option<Vec<u8>>,
    pub(crate) size: Option<u64>,
    uid: Option<u64>,
    gid: Option<u64>,
    mtime: Option<TimeSpec>,
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    /// Attributes in a form not kept (`LIBARCHIVE.xattr.*`).
    dropped: u64,
}

/// Parses a PAX extended header's records (`<len> <key>=<value>\n`, values may hold any byte) into `meta`.
pub(crate) fn parse_pax(data: &[u8], meta: &mut Meta) -> Result<(), OciError> {
    let bad = |what: &str| format_error(format!("a malformed PAX record: {what}"));
    let mut rest = data;
    while !rest.is_empty() {
        if rest.iter().all(|b| *b == 0) {
            break;
        }
        let space = rest.iter().take(20).position(|b| *b == b' ').ok_or_else(|| bad("no length"))?;
        let len = std::str::from_utf8(&rest[..space])
            .ok()
            .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|s| s.parse::<usize>().ok())
            .ok_or_else(|| bad("a length that is not a number"))?;
        if len <= space + 1 || len > rest.len() || rest[len - 1] != b'\n' {
            return Err(bad("a length past the record"));
        }
        let record = &rest[space + 1..len - 1];
        let equals = record.iter().position(|b| *b == b'=').ok_or_else(|| bad("no `=`"))?;
        let (key, value) = (&record[..equals], &record[equals + 1..]);
        pax_record(key, value, meta)?;
        rest = &rest[len..];
    }
    Ok(())
}

fn pax_number(key: &[u8], value: &[u8]) -> Result<u64, OciError> {
    std::str::from_utf8(value)
        .ok()
        .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format_error(format!("PAX {} is not a number", String::from_utf8_lossy(key))))
}

fn pax_record(key: &[u8], value: &[u8], meta: &mut Meta) -> Result<(), OciError> {
    match key {
        b"path" => meta.path = (!value.is_empty()).then(|| value.to_vec()),
        b"linkpath" => meta.link = (!value.is_empty()).then(|| value.to_vec()),
        b"size" => meta.size = Some(pax_number(key, value)?),
        b"uid" => meta.uid = Some(pax_number(key, value)?),
        b"gid" => meta.gid = Some(pax_number(key, value)?),
        b"mtime" => meta.mtime = Some(pax_time(value)?),
        k if k.starts_with(b"GNU.sparse.") => {
            return Err(format_error("a sparse file (GNU sparse PAX records are not supported)"));
        }
        k if k.starts_with(b"SCHILY.xattr.") => {
            if meta.xattrs.len() >= MAX_XATTRS {
                return Err(OciError::TooLarge(format!("an entry with more than {MAX_XATTRS} extended attributes")));
            }
            meta.xattrs.push((k["SCHILY.xattr.".len()..].to_vec(), value.to_vec()));
        }
        k if k.starts_with(b"LIBARCHIVE.xattr.") => meta.dropped += 1,
        _ => {}
    }
    Ok(())
}

/// A PAX time: `[-]seconds[.fraction]`.
fn pax_time(value: &[u8]) -> Result<TimeSpec, OciError> {
    let bad = || format_error(format!("PAX mtime {:?} is not a time", String::from_utf8_lossy(value)));
    let text = std::str::from_utf8(value).map_err(|_| bad())?;
    let (negative, text) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (secs, frac) = text.split_once('.').unwrap_or((text, ""));
    if secs.is_empty() || !secs.bytes().all(|b| b.is_ascii_digit()) || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let secs = secs.parse::<u64>().map_or(MAX_TIME, |s| i64::try_from(s).unwrap_or(MAX_TIME).min(MAX_TIME));
    let mut nanos = 0i64;
    for (i, digit) in frac.bytes().take(9).enumerate() {
        nanos += i64::from(digit - b'0') * 10i64.pow(8 - i as u32);
    }
    Ok(match (negative, nanos) {
        (false, _) => TimeSpec::new(secs, nanos),
        (true, 0) => TimeSpec::new(-secs, 0),
        (true, _) => TimeSpec::new(-secs - 1, 1_000_000_000 - nanos),
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    File,
    HardLink,
    Symlink,
    Char,
    Block,
    Dir,
    Fifo,
}

/// One entry: its header with the PAX and long-name records before it applied.
#[derive(Debug)]
struct Entry {
    path: Vec<u8>,
    kind: Kind,
    /// Bytes of data after the header.
    size: u64,
    mode: u32,
    uid: u64,
    gid: u64,
    mtime: TimeSpec,
    link: Option<Vec<u8>>,
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    dropped: u64,
}

impl Entry {
    fn new(header: &tar::Header, meta: Meta, header_size: u64) -> Result<Entry, OciError> {
        let path = meta.path.unwrap_or_else(|| header.path_bytes().into_owned());
        let field = |what: &str, e: io::Error| format_error(format!("entry {:?}: its {what}: {e}", shown(&path)));
        let kind = match header.entry_type().as_byte() {
            b'0' | b'7' => Kind::File,
            // Pre-POSIX tars mark a directory by a trailing slash.
            0 if path.ends_with(b"/") => Kind::Dir,
            0 => Kind::File,
            b'1' => Kind::HardLink,
            b'2' => Kind::Symlink,
            b'3' => Kind::Char,
            b'4' => Kind::Block,
            b'5' => Kind::Dir,
            b'6' => Kind::Fifo,
            b'S' => return Err(format_error(format!("entry {:?} is a GNU sparse file (not supported)", shown(&path)))),
            other => {
                return Err(format_error(format!(
                    "entry {:?} has type {:?} (not supported)",
                    shown(&path),
                    other as char
                )));
            }
        };
        let mode = header.mode().map_err(|e| field("mode", e))?;
        let uid = match meta.uid {
            Some(uid) => uid,
            None => header.uid().map_err(|e| field("owner", e))?,
        };
        let gid = match meta.gid {
            Some(gid) => gid,
            None => header.gid().map_err(|e| field("group", e))?,
        };
        let mtime = match meta.mtime {
            Some(mtime) => mtime,
            None => {
                let secs = header.mtime().map_err(|e| field("time", e))?;
                TimeSpec::new(i64::try_from(secs).unwrap_or(MAX_TIME).min(MAX_TIME), 0)
            }
        };
        let link = meta.link.or_else(|| header.link_name_bytes().map(|l| l.into_owned()));
        Ok(Entry {
            size: meta.size.unwrap_or(header_size),
            path,
            kind,
            mode,
            uid,
            gid,
            mtime,
            link,
            xattrs: meta.xattrs,
            dropped: meta.dropped,
        })
    }
}

/// A tar path's components: a leading `/` and `.` components dropped; refused (the reason) when it is empty,
/// holds a NUL or a `..`, is over [`MAX_PATH`] bytes or has a component over [`MAX_NAME`] bytes.
pub(crate) fn components(raw: &[u8]) -> Result<Vec<&[u8]>, &'static str> {
    if raw.is_empty() {
        return Err("an empty name");
    }
    if raw.contains(&0) {
        return Err("a NUL in its name");
    }
    if raw.len() > MAX_PATH {
        return Err("a path longer than 4096 bytes");
    }
    let mut parts = Vec::new();
    for part in raw.split(|b| *b == b'/') {
        match part {
            b"" | b"." => {}
            b".." => return Err("a `..` component (it would reach outside the layer)"),
            part if part.len() > MAX_NAME => return Err("a name longer than 255 bytes"),
            part => parts.push(part),
        }
    }
    Ok(parts)
}

fn join(parts: &[&[u8]]) -> Vec<u8> {
    parts.join(&b'/')
}

const OPAQUE: &[u8] = b".wh..wh..opq";
const WHITEOUT: &[u8] = b".wh.";

/// Whether an extended attribute from a layer is set (else it is dropped).
fn keep_xattr(name: &[u8], value: &[u8]) -> bool {
    if name.is_empty() || name.len() > MAX_NAME || name.contains(&0) || value.len() > MAX_XATTR_VALUE {
        return false;
    }
    match name {
        b"security.capability" => valid_capability(value),
        n => n.starts_with(b"user.") && !n.starts_with(b"user.overlay."),
    }
}

/// A file capability the kernel takes as the image means it: v2, or v3 for the root of the user namespace
/// (rootid 0). A v3 value for another namespace's root names an ID of the machine that built the image.
fn valid_capability(value: &[u8]) -> bool {
    let Some(magic) = value.get(..4).map(|m| u32::from_le_bytes([m[0], m[1], m[2], m[3]])) else { return false };
    match (magic & 0xFF00_0000, value.len()) {
        (0x0200_0000, 20) => true,
        (0x0300_0000, 24) => value[20..24] == [0, 0, 0, 0],
        _ => false,
    }
}

/// Creates the entries, relative to directory descriptors only.
struct Extractor {
    root: OwnedFd,
    /// The directory the last entry went into: its path (components joined by `/`), depth and descriptor.
    cached: Option<(Vec<u8>, usize, OwnedFd)>,
    /// Regular files made by this layer (what a hard link may name).
    files: HashSet<Vec<u8>>,
    /// Directories' modification times, set at the end (their entries change them meanwhile).
    dir_times: Vec<(Vec<u8>, TimeSpec)>,
    root_time: Option<TimeSpec>,
    /// Bytes of paths in `files` and `dir_times`.
    remembered: usize,
    stats: LayerStats,
}

const DIR_FLAGS: OFlag = OFlag::O_RDONLY.union(OFlag::O_DIRECTORY).union(OFlag::O_NOFOLLOW).union(OFlag::O_CLOEXEC);

impl Extractor {
    /// Applies one entry; returns the bytes of its data it read.
    fn apply<R: Read>(&mut self, e: &Entry, stream: &mut Stream<R>) -> Result<u64, OciError> {
        let parts = components(&e.path).map_err(|reason| hostile(&e.path, reason))?;
        if e.uid >= MAX_ID || e.gid >= MAX_ID {
            return Err(hostile(
                &e.path,
                format!("owner {}:{} (IDs from {MAX_ID} on are outside the jail's mapping)", e.uid, e.gid),
            ));
        }
        self.stats.dropped_xattrs += e.dropped;
        let Some((name, parents)) = parts.split_last() else {
            if e.kind != Kind::Dir {
                return Err(hostile(&e.path, "names the layer's root, as something else than a directory"));
            }
            let root = self.root.try_clone().map_err(|source| io_error("opening", &e.path, source))?;
            self.set_meta(root.as_fd(), e)?;
            self.root_time = Some(e.mtime);
            self.stats.entries += 1;
            return Ok(0);
        };
        if parents.iter().any(|p| p.starts_with(WHITEOUT)) {
            return Err(hostile(&e.path, "a directory named .wh.* (whiteouts are files)"));
        }
        if name.starts_with(WHITEOUT) {
            return self.whiteout(e, parents, name);
        }
        let parent = self.parent(parents, &e.path)?;
        let key = join(&parts);
        match e.kind {
            Kind::Char | Kind::Block => {
                let what = if e.kind == Kind::Char { "a character device" } else { "a block device" };
                Err(hostile(&e.path, format!("{what} (device nodes are not made; whiteouts are .wh. files)")))
            }
            Kind::Dir => {
                let exists = self.clear(parent.as_fd(), name, &e.path, &key, true)?;
                if !exists {
                    mkdirat(parent.as_fd(), *name, Mode::from_bits_truncate(0o700))
                        .map_err(os_error("creating", &e.path))?;
                }
                let dir =
                    openat(parent.as_fd(), *name, DIR_FLAGS, Mode::empty()).map_err(os_error("opening", &e.path))?;
                self.set_meta(dir.as_fd(), e)?;
                self.remember(key.len())?;
                self.dir_times.push((key, e.mtime));
                self.stats.entries += 1;
                Ok(0)
            }
            Kind::File => {
                self.clear(parent.as_fd(), name, &e.path, &key, false)?;
                let fd = openat(
                    parent.as_fd(),
                    *name,
                    OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                    Mode::from_bits_truncate(0o600),
                )
                .map_err(os_error("creating", &e.path))?;
                let mut file = File::from(fd);
                write_contents(stream, &mut file, e.size, &e.path)?;
                self.set_meta(file.as_fd(), e)?;
                nix::sys::stat::futimens(file.as_fd(), &e.mtime, &e.mtime)
                    .map_err(os_error("setting the time of", &e.path))?;
                self.remember(key.len())?;
                self.files.insert(key);
                self.stats.file_bytes += e.size;
                self.stats.entries += 1;
                Ok(e.size)
            }
            Kind::Symlink => {
                let target = e.link.as_deref().unwrap_or_default();
                if target.is_empty() || target.contains(&0) || target.len() > MAX_PATH {
                    return Err(hostile(&e.path, "a symlink with an empty, NUL-holding or over-long target"));
                }
                self.clear(parent.as_fd(), name, &e.path, &key, false)?;
                nix::unistd::symlinkat(OsStr::from_bytes(target), parent.as_fd(), *name)
                    .map_err(os_error("creating", &e.path))?;
                nix::unistd::fchownat(
                    parent.as_fd(),
                    *name,
                    Some(Uid::from_raw(e.uid as u32)),
                    Some(Gid::from_raw(e.gid as u32)),
                    AtFlags::AT_SYMLINK_NOFOLLOW,
                )
                .map_err(os_error("setting the owner of", &e.path))?;
                nix::sys::stat::utimensat(
                    parent.as_fd(),
                    *name,
                    &e.mtime,
                    &e.mtime,
                    nix::sys::stat::UtimensatFlags::NoFollowSymlink,
                )
                .map_err(os_error("setting the time of", &e.path))?;
                self.stats.dropped_xattrs += e.xattrs.len() as u64;
                self.stats.entries += 1;
                Ok(0)
            }
            Kind::HardLink => {
                self.hard_link(e, parent.as_fd(), name, key)?;
                Ok(0)
            }
            Kind::Fifo => {
                self.clear(parent.as_fd(), name, &e.path, &key, false)?;
                mknodat(parent.as_fd(), *name, SFlag::S_IFIFO, Mode::from_bits_truncate(0o600), 0)
                    .map_err(os_error("creating", &e.path))?;
                // Opening a FIFO to read without blocking returns at once; O_NOFOLLOW: the node just made.
                let fd = openat(
                    parent.as_fd(),
                    *name,
                    OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                    Mode::empty(),
                )
                .map_err(os_error("opening", &e.path))?;
                set_owner_mode(fd.as_fd(), e)?;
                nix::sys::stat::futimens(fd.as_fd(), &e.mtime, &e.mtime)
                    .map_err(os_error("setting the time of", &e.path))?;
                self.stats.dropped_xattrs += e.xattrs.len() as u64;
                self.stats.entries += 1;
                Ok(0)
            }
        }
    }

    /// `dir/.wh.NAME` (a whiteout of `dir/NAME`) or `dir/.wh..wh..opq` (`dir` opaque).
    fn whiteout(&mut self, e: &Entry, parents: &[&[u8]], name: &[u8]) -> Result<u64, OciError> {
        if e.kind != Kind::File {
            return Err(hostile(&e.path, "a whiteout (.wh. name) that is not a plain file"));
        }
        let parent = self.parent(parents, &e.path)?;
        if name == OPAQUE {
            xattr::set(parent.as_fd(), b"trusted.overlay.opaque", b"y").map_err(os_error("marking opaque", &e.path))?;
            self.stats.opaque_dirs += 1;
            self.stats.entries += 1;
            return Ok(0);
        }
        let hidden = &name[WHITEOUT.len()..];
        if hidden.starts_with(WHITEOUT) {
            return Err(hostile(&e.path, "a .wh..wh. name other than the opaque marker .wh..wh..opq"));
        }
        if hidden.is_empty() || hidden == b"." || hidden == b".." {
            return Err(hostile(&e.path, "a whiteout of no name, `.` or `..`"));
        }
        let mut parts = parents.to_vec();
        parts.push(hidden);
        let key = join(&parts);
        self.clear(parent.as_fd(), hidden, &e.path, &key, false)?;
        mknodat(parent.as_fd(), hidden, SFlag::S_IFCHR, Mode::empty(), 0)
            .map_err(os_error("creating a whiteout", &e.path))?;
        self.stats.whiteouts += 1;
        self.stats.entries += 1;
        Ok(0)
    }

    fn hard_link(&mut self, e: &Entry, parent: BorrowedFd<'_>, name: &[u8], key: Vec<u8>) -> Result<(), OciError> {
        let raw = e.link.as_deref().unwrap_or_default();
        let target =
            components(raw).map_err(|reason| hostile(&e.path, format!("a hard link to a name with {reason}")))?;
        let target_key = join(&target);
        if !self.files.contains(&target_key) {
            return Err(hostile(
                &e.path,
                format!(
                    "a hard link to {:?}, which is not a regular file this layer made before it (links to another \
                     layer's files, directories, devices or links are refused)",
                    shown(raw)
                ),
            ));
        }
        if target_key == key {
            return Err(hostile(&e.path, "a hard link to itself"));
        }
        let Some((target_name, target_parents)) = target.split_last() else {
            return Err(hostile(&e.path, "a hard link to the layer's root"));
        };
        let from = self.parent(target_parents, &e.path)?;
        let st = fstatat(from.as_fd(), *target_name, AtFlags::AT_SYMLINK_NOFOLLOW)
            .map_err(os_error("looking at the target of", &e.path))?;
        if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT != SFlag::S_IFREG {
            return Err(hostile(&e.path, "a hard link to something that is not a regular file"));
        }
        self.clear(parent, name, &e.path, &key, false)?;
        // linkat without AT_SYMLINK_FOLLOW links the name itself, never what a link names.
        nix::unistd::linkat(from.as_fd(), *target_name, parent, name, AtFlags::empty())
            .map_err(os_error("linking", &e.path))?;
        self.remember(key.len())?;
        self.files.insert(key);
        self.stats.entries += 1;
        Ok(())
    }

    /// Makes way for an entry at `name` in `parent`: an earlier non-directory is removed, an empty directory
    /// too unless the entry is a directory (then it merges: returns true); a non-empty one is refused.
    fn clear(
        &mut self,
        parent: BorrowedFd<'_>,
        name: &[u8],
        entry: &[u8],
        key: &[u8],
        dir: bool,
    ) -> Result<bool, OciError> {
        let st = match fstatat(parent, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::ENOENT) => return Ok(false),
            Err(errno) => return Err(os_error("looking at", entry)(errno)),
        };
        if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFDIR {
            if dir {
                return Ok(true);
            }
            match nix::unistd::unlinkat(parent, name, UnlinkatFlags::RemoveDir) {
                Ok(()) => {}
                Err(Errno::ENOTEMPTY | Errno::EEXIST) => {
                    return Err(hostile(entry, "replaces a directory this layer filled with something else"));
                }
                Err(errno) => return Err(os_error("removing", entry)(errno)),
            }
            // The cached directory may have been it.
            self.cached = None;
            return Ok(false);
        }
        nix::unistd::unlinkat(parent, name, UnlinkatFlags::NoRemoveDir).map_err(os_error("replacing", entry))?;
        self.files.remove(key);
        Ok(false)
    }

    /// The directory `parents` (components under the root), opened without following a link and made when
    /// missing. A component that is a symlink or not a directory is refused.
    fn parent(&mut self, parents: &[&[u8]], entry: &[u8]) -> Result<OwnedFd, OciError> {
        let key = join(parents);
        let (mut dir, skip) = match &self.cached {
            Some((path, _, fd)) if *path == key => {
                return fd.try_clone().map_err(|source| io_error("opening", entry, source));
            }
            Some((path, depth, fd))
                if key.starts_with(path) && (path.is_empty() || key.get(path.len()) == Some(&b'/')) =>
            {
                (fd.try_clone().map_err(|source| io_error("opening", entry, source))?, *depth)
            }
            _ => (self.root.try_clone().map_err(|source| io_error("opening", entry, source))?, 0),
        };
        for part in &parents[skip..] {
            dir = self.step(dir.as_fd(), part, entry)?;
        }
        let cached = dir.try_clone().map_err(|source| io_error("opening", entry, source))?;
        self.cached = Some((key, parents.len(), cached));
        Ok(dir)
    }

    fn step(&mut self, dir: BorrowedFd<'_>, part: &[u8], entry: &[u8]) -> Result<OwnedFd, OciError> {
        match openat(dir, part, DIR_FLAGS, Mode::empty()) {
            Ok(fd) => Ok(fd),
            Err(Errno::ENOENT) => {
                mkdirat(dir, part, Mode::from_bits_truncate(0o755)).map_err(os_error("creating a parent of", entry))?;
                let fd = openat(dir, part, DIR_FLAGS, Mode::empty()).map_err(os_error("opening a parent of", entry))?;
                // Not the umask's: jobs of any user traverse it.
                nix::sys::stat::fchmod(fd.as_fd(), Mode::from_bits_truncate(0o755))
                    .map_err(os_error("setting the mode of a parent of", entry))?;
                Ok(fd)
            }
            Err(Errno::ELOOP | Errno::ENOTDIR) => {
                let symlink = fstatat(dir, part, AtFlags::AT_SYMLINK_NOFOLLOW)
                    .is_ok_and(|st| SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFLNK);
                let what = if symlink { "a symlink (nothing is created through a link)" } else { "not a directory" };
                Err(hostile(entry, format!("its parent {:?} is {what}", shown(part))))
            }
            Err(errno) => Err(os_error("opening a parent of", entry)(errno)),
        }
    }

    fn remember(&mut self, bytes: usize) -> Result<(), OciError> {
        self.remembered += bytes;
        if self.remembered > MAX_REMEMBERED {
            return Err(OciError::TooLarge(format!("a layer whose paths take more than {MAX_REMEMBERED} bytes")));
        }
        Ok(())
    }

    /// Owner, mode (after the owner: chown clears setuid) and extended attributes (after both: chown clears a
    /// file capability) of a file or directory.
    fn set_meta(&mut self, fd: BorrowedFd<'_>, e: &Entry) -> Result<(), OciError> {
        set_owner_mode(fd, e)?;
        for (name, value) in &e.xattrs {
            if keep_xattr(name, value) {
                xattr::set(fd, name, value).map_err(os_error("setting an extended attribute of", &e.path))?;
            } else {
                self.stats.dropped_xattrs += 1;
            }
        }
        Ok(())
    }

    /// Sets the directories' times, now that nothing more goes into them.
    fn finish(&mut self) -> Result<(), OciError> {
        self.cached = None;
        for (path, mtime) in std::mem::take(&mut self.dir_times) {
            let Ok(parts) = components(&path) else { continue };
            let Ok(mut dir) = self.root.try_clone() else { continue };
            let mut found = true;
            for part in &parts {
                match openat(dir.as_fd(), *part, DIR_FLAGS, Mode::empty()) {
                    Ok(next) => dir = next,
                    // Replaced by a later entry.
                    Err(_) => {
                        found = false;
                        break;
                    }
                }
            }
            if found {
                nix::sys::stat::futimens(dir.as_fd(), &mtime, &mtime)
                    .map_err(os_error("setting the time of", &path))?;
            }
        }
        if let Some(mtime) = self.root_time {
            nix::sys::stat::futimens(self.root.as_fd(), &mtime, &mtime)
                .map_err(os_error("setting the time of", b"."))?;
        }
        Ok(())
    }
}

/// Owner, then mode (chown clears setuid and setgid).
fn set_owner_mode(fd: BorrowedFd<'_>, e: &Entry) -> Result<(), OciError> {
    nix::unistd::fchown(fd, Some(Uid::from_raw(e.uid as u32)), Some(Gid::from_raw(e.gid as u32)))
        .map_err(os_error("setting the owner of", &e.path))?;
    nix::sys::stat::fchmod(fd, Mode::from_bits_truncate(e.mode & 0o7777))
        .map_err(os_error("setting the mode of", &e.path))
}

fn io_error(what: &'static str, entry: &[u8], source: io::Error) -> OciError {
    OciError::Io { what, path: PathBuf::from(OsStr::from_bytes(entry)), source }
}

/// Copies `size` bytes of the stream into `file`; runs of zeros become holes.
fn write_contents<R: Read>(stream: &mut Stream<R>, file: &mut File, size: u64, entry: &[u8]) -> Result<(), OciError> {
    let mut buf = vec![0u8; 64 * 1024];
    let mut left = size;
    while left > 0 {
        let want = usize::try_from(left).map_or(buf.len(), |n| n.min(buf.len()));
        stream.exact(&mut buf[..want])?;
        let chunk = &buf[..want];
        if chunk.iter().all(|b| *b == 0) {
            file.seek(SeekFrom::Current(want as i64)).map_err(|source| io_error("writing", entry, source))?;
        } else {
            file.write_all(chunk).map_err(|source| io_error("writing", entry, source))?;
        }
        left -= want as u64;
    }
    file.set_len(size).map_err(|source| io_error("writing", entry, source))
}

/// Extended attributes through a descriptor (nix has no binding for them).
#[allow(unsafe_code)]
mod xattr {
    use std::ffi::CString;
    use std::os::fd::{AsRawFd, BorrowedFd};

    use nix::errno::Errno;

    /// Sets the attribute `name` of the file `fd` refers to.
    pub(super) fn set(fd: BorrowedFd<'_>, name: &[u8], value: &[u8]) -> Result<(), Errno> {
        let name = CString::new(name).map_err(|_| Errno::EINVAL)?;
        // SAFETY: fsetxattr reads the NUL-terminated `name` and `value.len()` bytes of `value`, both valid for the
        // call; `fd` is a descriptor the caller holds open.
        let rc = unsafe { libc::fsetxattr(fd.as_raw_fd(), name.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
        Errno::result(rc).map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_normalised_and_escapes_refused() {
        let ok = |raw: &[u8]| components(raw).map(|p| join(&p));
        assert_eq!(ok(b"./usr/bin/").as_deref(), Ok(&b"usr/bin"[..]));
        assert_eq!(ok(b"/abs//x/./y").as_deref(), Ok(&b"abs/x/y"[..]));
        assert_eq!(ok(b"./").as_deref(), Ok(&b""[..]));
        assert!(components(b"../escape").is_err());
        assert!(components(b"/abs/../../x").is_err());
        assert!(components(b"a/..").is_err());
        assert!(components(b"").is_err());
        assert!(components(b"a\0b").is_err());
        assert!(components(&[b'a'; 256]).is_err());
        assert!(components(&b"a/".repeat(2049)).is_err());
    }

    #[test]
    fn pax_records_may_hold_newlines_and_times_fractions() {
        let value = b"\x01\n\x02";
        let record = |k: &str, v: &[u8]| {
            let body = [k.as_bytes(), b"=", v, b"\n"].concat();
            let base = body.len() + 1;
            let mut len = base + base.to_string().len();
            if len.to_string().len() != base.to_string().len() {
                len = base + len.to_string().len();
            }
            let mut out = format!("{len} ").into_bytes();
            out.extend(body);
            assert_eq!(out.len(), len, "length prefix");
            out
        };
        let data = [record("SCHILY.xattr.user.x", value), record("mtime", b"-1.5"), record("path", b"p")].concat();
        let mut meta = Meta::default();
        parse_pax(&data, &mut meta).expect("pax");
        assert_eq!(meta.xattrs, vec![(b"user.x".to_vec(), value.to_vec())]);
        assert_eq!(meta.mtime, Some(TimeSpec::new(-2, 500_000_000)));
        assert_eq!(meta.path.as_deref(), Some(&b"p"[..]));
        assert!(parse_pax(b"99 path=x\n", &mut Meta::default()).is_err());
        assert!(parse_pax(b"x", &mut Meta::default()).is_err());
    }

    #[test]
    fn only_user_and_well_formed_capability_attributes_are_kept() {
        assert!(keep_xattr(b"user.mime", b"text"));
        assert!(!keep_xattr(b"user.overlay.opaque", b"y"));
        assert!(!keep_xattr(b"trusted.overlay.opaque", b"y"));
        assert!(!keep_xattr(b"security.selinux", b"x"));
        let mut v2 = vec![0u8; 20];
        v2[..4].copy_from_slice(&0x0200_0001u32.to_le_bytes());
        assert!(keep_xattr(b"security.capability", &v2));
        let mut v3 = vec![0u8; 24];
        v3[..4].copy_from_slice(&0x0300_0000u32.to_le_bytes());
        assert!(keep_xattr(b"security.capability", &v3));
        v3[20] = 1;
        assert!(!keep_xattr(b"security.capability", &v3));
        assert!(!keep_xattr(b"security.capability", b"short"));
    }
}
