//! Generators: structured inputs from the fuzzer's bytes.
//!
//! [`Cursor`] reads an input byte by byte in a format simple enough that a seed can be written by hand (see
//! [`crate::seeds`]); [`arbitrary::Unstructured`] turns the rest of an input into well-formed values (messages,
//! descriptor chains) that reach past a parser's first checks.

use arbitrary::{Result, Unstructured};
use strata_guest_proto::{
    Bytes, EntryKind, ExitStatus, GuestMessage, MAX_CHUNK, MAX_PATH, OutputStream, RequestId, Rusage, TreeEntry,
};

/// Reads an input front to back; past the end every read is zero or empty, so any input is a valid script.
#[derive(Debug)]
pub struct Cursor<'a> {
    data: &'a [u8],
}

impl<'a> Cursor<'a> {
    /// Reads `data`.
    pub fn new(data: &'a [u8]) -> Self {
        Cursor { data }
    }

    /// Whether the input is used up.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The next byte (0 past the end).
    pub fn u8(&mut self) -> u8 {
        let (&first, rest) = self.data.split_first().unwrap_or((&0, &[]));
        self.data = rest;
        first
    }

    /// The next two bytes, little endian.
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    /// The next four bytes, little endian.
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    /// The next `len` bytes (fewer at the end).
    pub fn bytes(&mut self, len: usize) -> &'a [u8] {
        let (head, tail) = self.data.split_at(len.min(self.data.len()));
        self.data = tail;
        head
    }

    /// A byte string with a 2-byte length before it.
    pub fn block(&mut self) -> &'a [u8] {
        let len = usize::from(self.u16());
        self.bytes(len)
    }

    /// Everything left.
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.data)
    }
}

/// Writes what [`Cursor`] reads: for seeds.
#[derive(Debug, Default)]
pub struct Script {
    /// The input so far.
    pub bytes: Vec<u8>,
}

impl Script {
    /// Appends one byte.
    pub fn u8(&mut self, value: u8) -> &mut Self {
        self.bytes.push(value);
        self
    }

    /// Appends two bytes, little endian.
    pub fn u16(&mut self, value: u16) -> &mut Self {
        self.bytes.extend_from_slice(&value.to_le_bytes());
        self
    }

    /// Appends four bytes, little endian.
    pub fn u32(&mut self, value: u32) -> &mut Self {
        self.bytes.extend_from_slice(&value.to_le_bytes());
        self
    }

    /// Appends a byte string with a 2-byte length before it (at most 65535 bytes).
    pub fn block(&mut self, data: &[u8]) -> &mut Self {
        let len = u16::try_from(data.len()).expect("a seed block fits 64 KiB");
        self.u16(len);
        self.bytes.extend_from_slice(data);
        self
    }

    /// Appends raw bytes.
    pub fn raw(&mut self, data: &[u8]) -> &mut Self {
        self.bytes.extend_from_slice(data);
        self
    }
}

/// One of a few values that sit on the edges parsers check, or any value.
pub fn edgy_u64(u: &mut Unstructured<'_>, edges: &[u64]) -> Result<u64> {
    if edges.is_empty() || u.ratio(1, 4)? {
        return u.arbitrary();
    }
    Ok(*u.choose(edges)?)
}

fn text(u: &mut Unstructured<'_>, max: usize) -> Result<String> {
    let len = u.int_in_range(0..=max)?;
    let mut s: String = u.arbitrary()?;
    if s.len() > len {
        let mut cut = len;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
    Ok(s)
}

fn payload(u: &mut Unstructured<'_>) -> Result<Bytes> {
    // Mostly small; now and then exactly at or just past the chunk limit, which the host must refuse.
    let len = match u.int_in_range(0u8..=15)? {
        0 => MAX_CHUNK,
        1 => MAX_CHUNK + 1,
        _ => u.int_in_range(0..=64)?,
    };
    let fill: u8 = u.arbitrary()?;
    Ok(Bytes(vec![fill; len]))
}

/// A message an agent could send about one of `ids` (the requests the host has made), or about any id.
pub fn guest_message(u: &mut Unstructured<'_>, ids: &[u64]) -> Result<GuestMessage> {
    let id = if ids.is_empty() || u.ratio(1, 8)? { RequestId(u.arbitrary()?) } else { RequestId(*u.choose(ids)?) };
    let stream = if u.arbitrary()? { OutputStream::Stdout } else { OutputStream::Stderr };
    let small = |u: &mut Unstructured<'_>| edgy_u64(u, &[0, 1, 5, 64, 4096, 65_536, u64::MAX]);
    Ok(match u.int_in_range(0u8..=12)? {
        0 => GuestMessage::Hello {
            version: if u.arbitrary()? { strata_guest_proto::PROTOCOL_VERSION } else { u.arbitrary()? },
            agent_version: text(u, 16)?,
            kernel: text(u, 16)?,
        },
        1 => GuestMessage::Started { id, pid: u.arbitrary()? },
        2 | 3 => GuestMessage::Output { id, stream, data: payload(u)? },
        4 => GuestMessage::Exited {
            id,
            status: match u.int_in_range(0u8..=3)? {
                0 => ExitStatus::Code(u.int_in_range(0..=255)?),
                1 => ExitStatus::Signal(u.int_in_range(1..=64)?),
                2 => ExitStatus::Code(u.arbitrary()?),
                _ => ExitStatus::Signal(u.arbitrary()?),
            },
            rusage: Rusage { user_us: u.arbitrary()?, sys_us: u.arbitrary()?, max_rss_kb: u.arbitrary()? },
            oom_killed: u.arbitrary()?,
            stdout_bytes: small(u)?,
            stderr_bytes: small(u)?,
        },
        5 => GuestMessage::ExecFailed { id, errno: u.arbitrary()?, message: text(u, 32)? },
        6 => GuestMessage::FileData { id, data: payload(u)? },
        7 => GuestMessage::FileDone { id, size: small(u)? },
        8 => GuestMessage::FileError { id, errno: u.arbitrary()?, message: text(u, 32)? },
        9 => {
            let count = match u.int_in_range(0u8..=7)? {
                0 => strata_guest_proto::MAX_TREE_BATCH + 1,
                _ => u.int_in_range(0..=4)?,
            };
            let mut entries = Vec::with_capacity(count);
            for _ in 0..count {
                entries.push(tree_entry(u)?);
            }
            GuestMessage::TreeEntries { id, entries }
        }
        10 => GuestMessage::TreeDone { id, count: small(u)?, skipped: u.arbitrary()? },
        11 => GuestMessage::Ack { id },
        _ => GuestMessage::Error { id: if u.arbitrary()? { Some(id) } else { None }, message: text(u, 32)? },
    })
}

fn tree_entry(u: &mut Unstructured<'_>) -> Result<TreeEntry> {
    let kind = *u.choose(&[EntryKind::File, EntryKind::Dir, EntryKind::Symlink])?;
    let path = match u.int_in_range(0u8..=7)? {
        0 => "p".repeat(MAX_PATH + 1),
        1 => "../escape".to_owned(),
        2 => "/abs".to_owned(),
        _ => text(u, 24)?,
    };
    Ok(TreeEntry {
        path,
        kind,
        mode: u.arbitrary()?,
        size: u.arbitrary()?,
        target: if u.arbitrary()? { Some(text(u, 24)?) } else { None },
    })
}

/// `body` as one frame on the wire: its length, little endian, then the body.
pub fn frame(body: &[u8]) -> Vec<u8> {
    let mut out = u32::try_from(body.len()).unwrap_or(u32::MAX).to_le_bytes().to_vec();
    out.extend_from_slice(body);
    out
}

/// A connected `SOCK_SEQPACKET` pair, for targets that feed a protocol's messages through a real socket (made once
/// per process by each such target: a fresh pair per input would spend the input's time in the kernel).
pub fn seqpacket_pair() -> std::sync::Mutex<(std::os::fd::OwnedFd, std::os::fd::OwnedFd)> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
    let pair = socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)
        .expect("a seqpacket socket pair");
    std::sync::Mutex::new(pair)
}
