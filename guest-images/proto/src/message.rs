//! The messages: what the host asks ([`HostMessage`]) and what the agent answers ([`GuestMessage`]).
//!
//! Every request that expects an answer carries a [`RequestId`] chosen by the host, and every answer carries the
//! same id back, so answers to several requests (concurrent execs, a file read during an exec) can interleave on
//! one connection. `Hello` is variant 0 of both enums with the protocol version as its first field, in every
//! version of the protocol: a peer of another version can always read that much (see
//! [`crate::frame::peek_hello_version`]).

use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

/// Identifies one request (an exec, a file transfer, a snapshot step) on one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// What the host sends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum HostMessage {
    /// The first message on a connection; answered by [`GuestMessage::Hello`]. Must stay variant 0.
    Hello {
        /// The host's [`crate::PROTOCOL_VERSION`].
        version: u32,
    },
    /// Run a program. Answered by [`GuestMessage::Started`] (then output, then [`GuestMessage::Exited`]) or
    /// [`GuestMessage::ExecFailed`].
    Exec {
        /// Names this exec in every later message about it.
        id: RequestId,
        /// What to run.
        request: ExecRequest,
    },
    /// Bytes for a running exec's standard input (only when [`ExecRequest::stdin`] was set). No answer; bytes for
    /// an exec that has ended, or has closed its standard input, are dropped.
    StdinData {
        /// The exec.
        id: RequestId,
        /// At most [`crate::MAX_CHUNK`] bytes.
        data: Bytes,
    },
    /// End of a running exec's standard input. No answer.
    StdinClose {
        /// The exec.
        id: RequestId,
    },
    /// Send a signal to a running exec's process group. No answer; an exec that has ended is ignored.
    Signal {
        /// The exec.
        id: RequestId,
        /// The signal number (1..=64).
        signal: i32,
    },
    /// One chunk of a file to write. The first chunk of an id creates a temporary file beside `path`; the chunk
    /// with `last` set moves it into place (so a reader never sees half a file). Answered once per id, after the
    /// last chunk, by [`GuestMessage::Ack`] or, as soon as a chunk fails, by [`GuestMessage::FileError`] (the
    /// id's remaining chunks are then dropped).
    WriteFile {
        /// The transfer.
        id: RequestId,
        /// Absolute path in the guest; missing parent directories are created.
        path: String,
        /// Permission bits of the file (`0o7777` at most).
        mode: u32,
        /// At most [`crate::MAX_CHUNK`] bytes, in order.
        data: Bytes,
        /// This is the last chunk.
        last: bool,
    },
    /// Read a regular file. Answered by [`GuestMessage::FileData`] chunks and [`GuestMessage::FileDone`], or by
    /// [`GuestMessage::FileError`] (`EFBIG` when it holds more than `max` bytes).
    ReadFile {
        /// The transfer.
        id: RequestId,
        /// Absolute path in the guest.
        path: String,
        /// The most bytes the host accepts.
        max: u64,
    },
    /// Quiesce before a snapshot: flush filesystems. Answered by [`GuestMessage::Ack`], or
    /// [`GuestMessage::Error`] while an exec is running (a snapshot is of an idle sandbox).
    PrepareSnapshot {
        /// The request.
        id: RequestId,
    },
    /// The guest was restored from a snapshot (it may be one of several forks): reseed the kernel's random
    /// number generator and set the clock. Answered by [`GuestMessage::Ack`].
    AfterRestore {
        /// The request.
        id: RequestId,
        /// Fresh randomness from the host, credited to the guest kernel's pool.
        entropy: Entropy,
        /// The host's `CLOCK_REALTIME`, in nanoseconds since the Unix epoch.
        unix_time_ns: u64,
    },
    /// Flush filesystems and power the guest off. No answer: the connection closes.
    PowerOff,
    /// Create a directory (missing parents are created with mode `0o755`), or find one there, then set its
    /// permission bits to `mode`: sending it again for an existing directory only sets the bits. Answered by
    /// [`GuestMessage::Ack`] or [`GuestMessage::FileError`] (`ENOTEMPTY` when `empty` is set and the directory
    /// already has entries, `ENOTDIR` when something else is at `path`). Never follows a symbolic link at `path`.
    MakeDir {
        /// The request.
        id: RequestId,
        /// Absolute path in the guest.
        path: String,
        /// Permission bits (`0o7777` at most).
        mode: u32,
        /// Refuse a directory that already has entries (a grant's contents must be exactly the host's).
        empty: bool,
    },
    /// Create a symbolic link at `path` whose target is `target`, stored as given (never resolved). Answered by
    /// [`GuestMessage::Ack`] or [`GuestMessage::FileError`] (`EEXIST` when something is at `path`).
    MakeSymlink {
        /// The request.
        id: RequestId,
        /// Absolute path in the guest; missing parent directories are created.
        path: String,
        /// What the link points to: at most [`crate::MAX_PATH`] bytes, no NUL.
        target: String,
    },
    /// List the tree under the directory `path`, never following a symbolic link (the directory itself must not
    /// be one). Answered by [`GuestMessage::TreeEntries`] batches, every directory before its entries, then
    /// [`GuestMessage::TreeDone`]; or by [`GuestMessage::FileError`], possibly after some batches: `E2BIG` beyond
    /// `max_entries`, `ENAMETOOLONG` for a relative path or link target over [`crate::MAX_PATH`] bytes, `ENOTDIR`
    /// or `ELOOP` when `path` is not a directory. Entries that cannot be described (names that are not UTF-8,
    /// devices, FIFOs, sockets) are left out and counted in [`GuestMessage::TreeDone`]'s `skipped`.
    ListTree {
        /// The request.
        id: RequestId,
        /// Absolute path of a directory in the guest.
        path: String,
        /// The most entries the host accepts.
        max_entries: u64,
    },
    /// Give the jobs of this connection network egress: listen on the guest's `127.0.0.1:<listen_port>` and
    /// tunnel each accepted TCP connection, byte for byte, over a new stream to the host's egress port (AF_VSOCK
    /// CID 2 port `host_port` in a guest; `<socket>_<host_port>` when the agent runs over a Unix socket). At most
    /// `max_connections` tunnels at once; beyond that a client gets `503 Service Unavailable` and is closed.
    /// Answered by [`GuestMessage::Ack`] once the listener is bound, or [`GuestMessage::Error`] (already started,
    /// a bad value, the port taken). The forwarder stops when the connection ends; nothing listens unless asked.
    StartEgress {
        /// The request.
        id: RequestId,
        /// The guest TCP port on 127.0.0.1 (not 0).
        listen_port: u16,
        /// The host's egress port.
        host_port: u32,
        /// Tunnels open at once, at most (1..=[`crate::MAX_EGRESS_CONNECTIONS`]).
        max_connections: u32,
    },
    /// Describe the file at `path` without following a symbolic link there (`lstat`). Answered by
    /// [`GuestMessage::Entry`] or [`GuestMessage::FileError`] (`ENOENT` when nothing is there).
    Stat {
        /// The request.
        id: RequestId,
        /// Absolute path in the guest.
        path: String,
    },
    /// List the directory `path` (never a symbolic link) down to `depth` levels (1: its own entries), never
    /// entering a link. Answered by [`GuestMessage::DirEntries`] batches, every directory before its entries,
    /// then [`GuestMessage::DirDone`]; or by [`GuestMessage::FileError`], possibly after some batches: `E2BIG`
    /// beyond `max_entries`, `ENOTDIR` when `path` is not a directory. Entries whose path is not UTF-8 or longer
    /// than [`crate::MAX_PATH`] bytes are left out and counted in [`GuestMessage::DirDone`]'s `skipped`.
    ListDir {
        /// The request.
        id: RequestId,
        /// Absolute path of a directory in the guest.
        path: String,
        /// Levels to list (1..=[`crate::MAX_LIST_DEPTH`]).
        depth: u32,
        /// The most entries the host accepts.
        max_entries: u64,
    },
    /// Make the directory `path` and its missing parents (mode `0o755`), as `mkdir -p` does. Answered by
    /// [`GuestMessage::DirCreated`] (`created` is false when a directory was already there) or
    /// [`GuestMessage::FileError`] (`ENOTDIR` when something else, a symbolic link too, is in the way).
    CreateDir {
        /// The request.
        id: RequestId,
        /// Absolute path in the guest.
        path: String,
    },
    /// Move `from` to `to` (`rename(2)`: a file at `to` is replaced; a link is moved, not its target). Answered
    /// by [`GuestMessage::Entry`] describing `to`, or [`GuestMessage::FileError`].
    Rename {
        /// The request.
        id: RequestId,
        /// Absolute path in the guest.
        from: String,
        /// Absolute path in the guest.
        to: String,
    },
    /// Remove the file or symbolic link at `path`, or the directory and everything in it, never following a
    /// link. Answered by [`GuestMessage::Ack`] or [`GuestMessage::FileError`] (`ENOENT` when nothing is there).
    Remove {
        /// The request.
        id: RequestId,
        /// Absolute path in the guest.
        path: String,
    },
    /// Watch the directory `path` (never a symbolic link) with inotify and, when `recursive`, every directory
    /// below it, those made later too. Answered by [`GuestMessage::Ack`] once the watch is set up (or
    /// [`GuestMessage::FileError`]: `ENOTDIR`, `ENOSPC` beyond the agent's or the kernel's bound on watches),
    /// then by [`GuestMessage::WatchEvents`] as things happen, until [`HostMessage::Unwatch`] (after which
    /// nothing more is sent for the id) or [`GuestMessage::WatchEnded`].
    Watch {
        /// The watch.
        id: RequestId,
        /// Absolute path of a directory in the guest.
        path: String,
        /// Watch the directories below it too.
        recursive: bool,
    },
    /// End a watch. No answer; an id that is not a running watch is ignored.
    Unwatch {
        /// The watch.
        id: RequestId,
    },
    /// Change the window size of a running exec's terminal ([`ExecRequest::tty`]); its foreground process group
    /// gets `SIGWINCH`. No answer; an exec that has ended or has no terminal is ignored.
    Resize {
        /// The exec.
        id: RequestId,
        /// The new size.
        size: TtySize,
    },
    /// Reach a TCP server of the guest: connect to the guest's `127.0.0.1:port`, then open a stream to the host's
    /// vsock `host_port` (where the host listens for this one connection) and relay the two until either ends.
    /// Answered by [`GuestMessage::Ack`] once both are connected, or [`GuestMessage::Error`] (nothing listens there:
    /// its message starts with [`crate::PORT_CLOSED`]).
    OpenPort {
        /// The request.
        id: RequestId,
        /// The guest TCP port on 127.0.0.1 (not 0).
        port: u16,
        /// The host's vsock port for this connection.
        host_port: u32,
    },
}

/// A terminal's window size in character cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TtySize {
    /// Rows.
    pub rows: u16,
    /// Columns.
    pub cols: u16,
}

/// A program to run.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ExecRequest {
    /// The argument vector; `argv[0]` is looked up in the job's `PATH` unless it contains a `/`.
    pub argv: Vec<String>,
    /// The complete environment.
    pub env: Vec<(String, String)>,
    /// Working directory (absolute).
    pub cwd: String,
    /// Standard input comes from [`HostMessage::StdinData`] frames (else it is `/dev/null`).
    pub stdin: bool,
    /// Limits the agent applies to the exec.
    pub limits: ExecLimits,
    /// Run it on a pseudo-terminal of the guest's of this size: the terminal is its standard input, output and
    /// error and its controlling terminal; its output comes as [`OutputStream::Stdout`], [`HostMessage::StdinData`]
    /// is typed into it (always taken, whatever `stdin` says) and [`HostMessage::Resize`] resizes it.
    pub tty: Option<TtySize>,
}

/// Limits the agent applies to one exec. Wall time and memory are the host's business (it kills the VM; the
/// guest's RAM is its memory limit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ExecLimits {
    /// Forward at most this many bytes of each stream; the rest is read and counted
    /// ([`GuestMessage::Exited`] reports the totals), not sent.
    pub output: Option<u64>,
    /// `RLIMIT_NOFILE`.
    pub open_files: Option<u64>,
    /// `RLIMIT_CPU`, in seconds, per process.
    pub cpu_seconds: Option<u64>,
}

/// Which output stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum OutputStream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// What the agent sends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum GuestMessage {
    /// The answer to [`HostMessage::Hello`]. Must stay variant 0.
    Hello {
        /// The agent's [`crate::PROTOCOL_VERSION`]; the connection is useless unless it equals the host's.
        version: u32,
        /// The agent's crate version.
        agent_version: String,
        /// The guest kernel's release (`uname -r`).
        kernel: String,
    },
    /// An exec's program is running.
    Started {
        /// The exec.
        id: RequestId,
        /// Its PID in the guest.
        pid: i32,
    },
    /// A chunk of an exec's output, in order per stream.
    Output {
        /// The exec.
        id: RequestId,
        /// Which stream.
        stream: OutputStream,
        /// At most [`crate::MAX_CHUNK`] bytes.
        data: Bytes,
    },
    /// An exec's program ended; the last message about it (all of its forwarded output came before).
    Exited {
        /// The exec.
        id: RequestId,
        /// How it ended.
        status: ExitStatus,
        /// Its resource use (and its waited-for descendants').
        rusage: Rusage,
        /// The guest kernel's OOM killer ended it: report as the memory limit.
        oom_killed: bool,
        /// Bytes it wrote to standard output (forwarded or not).
        stdout_bytes: u64,
        /// Bytes it wrote to standard error (forwarded or not).
        stderr_bytes: u64,
    },
    /// An exec could not start; the last message about it.
    ExecFailed {
        /// The exec.
        id: RequestId,
        /// The OS error number (`ENOENT` for a missing program).
        errno: i32,
        /// What failed.
        message: String,
    },
    /// A chunk of a file being read, in order.
    FileData {
        /// The transfer.
        id: RequestId,
        /// At most [`crate::MAX_CHUNK`] bytes.
        data: Bytes,
    },
    /// A file read is complete.
    FileDone {
        /// The transfer.
        id: RequestId,
        /// Total bytes sent.
        size: u64,
    },
    /// A file operation failed.
    FileError {
        /// The transfer.
        id: RequestId,
        /// The OS error number.
        errno: i32,
        /// What failed, with the path.
        message: String,
    },
    /// A batch of a tree listing ([`HostMessage::ListTree`]): at most [`crate::MAX_TREE_BATCH`] entries, in
    /// order.
    TreeEntries {
        /// The request.
        id: RequestId,
        /// The entries.
        entries: Vec<TreeEntry>,
    },
    /// A tree listing is complete.
    TreeDone {
        /// The request.
        id: RequestId,
        /// Entries sent, over all batches.
        count: u64,
        /// Entries left out because they cannot be described (see [`HostMessage::ListTree`]).
        skipped: u64,
    },
    /// A request succeeded (a file write, a snapshot step).
    Ack {
        /// The request.
        id: RequestId,
    },
    /// A request, or the connection, could not be served.
    Error {
        /// The request, when the error concerns one; `None` for the connection (a malformed frame).
        id: Option<RequestId>,
        /// What was wrong.
        message: String,
    },
    /// A file described ([`HostMessage::Stat`], [`HostMessage::Rename`]).
    Entry {
        /// The request.
        id: RequestId,
        /// The file.
        entry: EntryInfo,
    },
    /// A batch of a directory listing ([`HostMessage::ListDir`]): at most [`crate::MAX_TREE_BATCH`] entries, in
    /// order.
    DirEntries {
        /// The request.
        id: RequestId,
        /// The entries.
        entries: Vec<EntryInfo>,
    },
    /// A directory listing is complete.
    DirDone {
        /// The request.
        id: RequestId,
        /// Entries sent, over all batches.
        count: u64,
        /// Entries left out (see [`HostMessage::ListDir`]).
        skipped: u64,
    },
    /// The answer to [`HostMessage::CreateDir`].
    DirCreated {
        /// The request.
        id: RequestId,
        /// The directory was made (false: it was already there).
        created: bool,
    },
    /// What a watch saw ([`HostMessage::Watch`]): at most [`crate::MAX_WATCH_BATCH`] events, in order.
    WatchEvents {
        /// The watch.
        id: RequestId,
        /// The events.
        events: Vec<WatchEvent>,
        /// Events were lost before these (the kernel's queue overflowed, or a directory could not be watched).
        overflowed: bool,
    },
    /// A watch ended on the agent's side (the watched directory was removed or moved); the last message about it.
    WatchEnded {
        /// The watch.
        id: RequestId,
        /// Why.
        reason: String,
    },
}

/// One entry of a tree listing ([`HostMessage::ListTree`]). The host validates every field: the guest controls
/// all of them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeEntry {
    /// The path relative to the listed directory, components separated by `/` (`sub/file`); at most
    /// [`crate::MAX_PATH`] bytes.
    pub path: String,
    /// What it is (never followed: a symbolic link is listed as one).
    pub kind: EntryKind,
    /// Permission bits (`0o7777` at most).
    pub mode: u32,
    /// Bytes of a regular file; the target's length for a symbolic link; 0 for a directory.
    pub size: u64,
    /// A symbolic link's target (at most [`crate::MAX_PATH`] bytes); `None` for anything else.
    pub target: Option<String>,
}

/// The kind of a [`TreeEntry`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum EntryKind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link.
    Symlink,
}

/// What a file is, as [`EntryInfo`] says (never followed: a symbolic link is one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FileType {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link.
    Symlink,
    /// A FIFO, socket or device node.
    Other,
}

/// A file or directory as [`HostMessage::Stat`], [`HostMessage::ListDir`] and [`HostMessage::Rename`] describe
/// it. The host validates every field: the guest controls all of them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntryInfo {
    /// Its absolute guest path; at most [`crate::MAX_PATH`] bytes.
    pub path: String,
    /// What it is.
    pub file_type: FileType,
    /// Bytes of a regular file; the target's length for a symbolic link.
    pub size: u64,
    /// Permission bits (`0o7777` at most).
    pub mode: u32,
    /// The owner's user ID in the guest.
    pub uid: u32,
    /// The group ID in the guest.
    pub gid: u32,
    /// When its contents last changed: seconds and nanoseconds (below 10^9) since the Unix epoch.
    pub modified: Option<(i64, u32)>,
    /// A symbolic link's target (at most [`crate::MAX_PATH`] bytes); `None` for anything else.
    pub target: Option<String>,
}

/// What a watch saw happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum WatchKind {
    /// Created, or moved in.
    Create,
    /// Written.
    Write,
    /// Its permissions or owner changed.
    Chmod,
    /// Moved away (the event names the old path).
    Rename,
    /// Removed.
    Remove,
}

/// One event of a watch ([`GuestMessage::WatchEvents`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchEvent {
    /// What happened.
    pub kind: WatchKind,
    /// The absolute guest path it happened to; at most [`crate::MAX_PATH`] bytes.
    pub path: String,
}

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExitStatus {
    /// It exited with this code (0..=255).
    Code(i32),
    /// This signal (1..=64) killed it.
    Signal(i32),
}

/// Resource use of an exec, from `wait4`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Rusage {
    /// User CPU time, microseconds.
    pub user_us: u64,
    /// System CPU time, microseconds.
    pub sys_us: u64,
    /// Peak resident set size, KiB.
    pub max_rss_kb: u64,
}

/// A byte string, encoded as bincode's length + bytes (a plain `Vec<u8>` goes through serde byte by byte).
#[derive(Clone, PartialEq, Eq, Default)]
pub struct Bytes(pub Vec<u8>);

impl fmt::Debug for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Bytes({} bytes)", self.0.len())
    }
}

impl From<Vec<u8>> for Bytes {
    fn from(bytes: Vec<u8>) -> Self {
        Bytes(bytes)
    }
}

impl From<&[u8]> for Bytes {
    fn from(bytes: &[u8]) -> Self {
        Bytes(bytes.to_vec())
    }
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl Serialize for Bytes {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        // `deserialize_bytes` borrows from the frame being decoded, so a length inside the frame is checked
        // against the bytes actually there before anything is copied.
        deserializer.deserialize_bytes(BytesVisitor { exact: None }).map(Bytes)
    }
}

struct BytesVisitor {
    exact: Option<usize>,
}

impl<'de> Visitor<'de> for BytesVisitor {
    type Value = Vec<u8>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.exact {
            Some(n) => write!(f, "{n} bytes"),
            None => f.write_str("bytes"),
        }
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
        match self.exact {
            Some(n) if v.len() != n => Err(E::invalid_length(v.len(), &self)),
            _ => Ok(v.to_vec()),
        }
    }

    fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
        match self.exact {
            Some(n) if v.len() != n => Err(E::invalid_length(v.len(), &self)),
            _ => Ok(v),
        }
    }
}

/// Randomness for [`HostMessage::AfterRestore`]: exactly [`Entropy::LEN`] bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct Entropy(pub [u8; Entropy::LEN]);

impl Entropy {
    /// 512 bits: enough to fully reseed the kernel's CRNG.
    pub const LEN: usize = 64;
}

impl fmt::Debug for Entropy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Entropy(..)")
    }
}

impl Serialize for Entropy {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for Entropy {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let bytes = deserializer.deserialize_bytes(BytesVisitor { exact: Some(Entropy::LEN) })?;
        let array: [u8; Entropy::LEN] =
            bytes.try_into().map_err(|v: Vec<u8>| de::Error::invalid_length(v.len(), &"64 bytes"))?;
        Ok(Entropy(array))
    }
}

impl GuestMessage {
    /// The request this message answers; `None` for `Hello` and a connection-level `Error`.
    pub fn request_id(&self) -> Option<RequestId> {
        match self {
            GuestMessage::Hello { .. } => None,
            GuestMessage::Error { id, .. } => *id,
            GuestMessage::Started { id, .. }
            | GuestMessage::Output { id, .. }
            | GuestMessage::Exited { id, .. }
            | GuestMessage::ExecFailed { id, .. }
            | GuestMessage::FileData { id, .. }
            | GuestMessage::FileDone { id, .. }
            | GuestMessage::FileError { id, .. }
            | GuestMessage::TreeEntries { id, .. }
            | GuestMessage::TreeDone { id, .. }
            | GuestMessage::Entry { id, .. }
            | GuestMessage::DirEntries { id, .. }
            | GuestMessage::DirDone { id, .. }
            | GuestMessage::DirCreated { id, .. }
            | GuestMessage::WatchEvents { id, .. }
            | GuestMessage::WatchEnded { id, .. }
            | GuestMessage::Ack { id } => Some(*id),
        }
    }

    /// The variant's name, for error messages (never the payload, which the guest controls).
    pub fn kind(&self) -> &'static str {
        match self {
            GuestMessage::Hello { .. } => "Hello",
            GuestMessage::Started { .. } => "Started",
            GuestMessage::Output { .. } => "Output",
            GuestMessage::Exited { .. } => "Exited",
            GuestMessage::ExecFailed { .. } => "ExecFailed",
            GuestMessage::FileData { .. } => "FileData",
            GuestMessage::FileDone { .. } => "FileDone",
            GuestMessage::FileError { .. } => "FileError",
            GuestMessage::TreeEntries { .. } => "TreeEntries",
            GuestMessage::TreeDone { .. } => "TreeDone",
            GuestMessage::Ack { .. } => "Ack",
            GuestMessage::Error { .. } => "Error",
            GuestMessage::Entry { .. } => "Entry",
            GuestMessage::DirEntries { .. } => "DirEntries",
            GuestMessage::DirDone { .. } => "DirDone",
            GuestMessage::DirCreated { .. } => "DirCreated",
            GuestMessage::WatchEvents { .. } => "WatchEvents",
            GuestMessage::WatchEnded { .. } => "WatchEnded",
        }
    }
}

impl HostMessage {
    /// The variant's name, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            HostMessage::Hello { .. } => "Hello",
            HostMessage::Exec { .. } => "Exec",
            HostMessage::StdinData { .. } => "StdinData",
            HostMessage::StdinClose { .. } => "StdinClose",
            HostMessage::Signal { .. } => "Signal",
            HostMessage::WriteFile { .. } => "WriteFile",
            HostMessage::ReadFile { .. } => "ReadFile",
            HostMessage::PrepareSnapshot { .. } => "PrepareSnapshot",
            HostMessage::AfterRestore { .. } => "AfterRestore",
            HostMessage::PowerOff => "PowerOff",
            HostMessage::MakeDir { .. } => "MakeDir",
            HostMessage::MakeSymlink { .. } => "MakeSymlink",
            HostMessage::ListTree { .. } => "ListTree",
            HostMessage::StartEgress { .. } => "StartEgress",
            HostMessage::Stat { .. } => "Stat",
            HostMessage::ListDir { .. } => "ListDir",
            HostMessage::CreateDir { .. } => "CreateDir",
            HostMessage::Rename { .. } => "Rename",
            HostMessage::Remove { .. } => "Remove",
            HostMessage::Watch { .. } => "Watch",
            HostMessage::Unwatch { .. } => "Unwatch",
            HostMessage::Resize { .. } => "Resize",
            HostMessage::OpenPort { .. } => "OpenPort",
        }
    }
}

impl ExitStatus {
    /// Whether the values are ones a real process can end with (code 0..=255, signal 1..=64).
    pub fn is_valid(self) -> bool {
        match self {
            ExitStatus::Code(code) => (0..=255).contains(&code),
            ExitStatus::Signal(signal) => (1..=64).contains(&signal),
        }
    }
}
