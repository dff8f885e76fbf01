//! The control protocol between the host (the process tier) and the jail's PID 1.
//!
//! One `SOCK_SEQPACKET` Unix socket, the jail process's standard input ([`CONTROL_FD`]) when it starts (so the
//! host can spawn it with `posix_spawn`, without a fork of its own, possibly large, address space). Each message is one JSON document; file
//! descriptors (the job's stdin/stdout/stderr pipes, a program to copy in, a file being read or written) travel
//! beside it as `SCM_RIGHTS`. A document larger than [`MAX_INLINE`] is sent as the message [`SPILL`] with a
//! sealed memfd holding the document as its last descriptor, so argv and env are not bounded by the socket buffer.
//!
//! The host writes [`HostFrame`]s and reads [`JailFrame`]s. Neither side trusts the other's sizes: a message is
//! read into a bounded buffer, a truncated one is an error, and a spilled document is capped at [`MAX_SPILL`].

use std::io::{Read, Seek, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::PathBuf;

use nix::errno::Errno;
use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::socket::MsgFlags;
use serde::{Deserialize, Serialize, de::DeserializeOwned};

/// The protocol version; [`Setup::version`] must equal it.
pub const PROTOCOL_VERSION: u32 = 8;

/// The control socket's descriptor number when the jail process starts: its standard input.
pub const CONTROL_FD: RawFd = 0;

/// The largest document sent inline.
pub const MAX_INLINE: usize = 48 * 1024;

/// The largest spilled document (argv + env of one exec are bounded by the kernel at a few MiB anyway).
pub const MAX_SPILL: u64 = 16 * 1024 * 1024;

/// The message that stands for a document carried in a memfd.
pub const SPILL: &[u8] = b"@spill";

/// The most descriptors one message carries.
pub const MAX_FDS: usize = 10;

/// What the host asks of the jail.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub enum HostFrame {
    /// Build the jail. The first frame, exactly once.
    Setup(Setup),
    /// Run a job. Descriptors: stdin, stdout, stderr (none with [`Exec::tty`]: a terminal of the jail's is all
    /// three), then [`Exec::cgroup_files`] cgroup files (the job writes `0` into each before it runs), then the
    /// program when [`Exec::program_copy`] is set. Answered by `Started` (with the terminal's master attached,
    /// with a tty) or `ExecFailed`; `Exited` follows when the job's main process ends. One job at a time per
    /// connection.
    Exec(Exec),
    /// On the first connection: kill every process in the jail but PID 1 (the running job and anything it left
    /// behind), except, once a lane was opened, the lanes' jobs (each in a child cgroup of the jail's). On a lane:
    /// kill that lane's job's process group (the host kills its cgroup).
    Kill,
    /// Open a lane: the descriptor is a `SOCK_SEQPACKET` socket that PID 1 serves as another connection, beside
    /// this one and every other, until the host closes it. A lane takes `Exec`, `Kill`, `Lane` and the file
    /// frames (`WriteFile`, `ReadFile`, `ListDir`, `Stat`, `MakeDir`, `Rename`, `Remove`, `Watch`, `Unwatch`); a
    /// job started on a lane is reported on that lane, so jobs on different lanes run at once. When a lane closes
    /// with its job still running, the job's process group is killed, and its watches end. No reply.
    Lane,
    /// Write a file from the descriptor (a memfd) passed along. Answered by `FileWritten` or `FileError`.
    WriteFile {
        /// Absolute path in the jail.
        path: String,
        /// Permission bits (set-user-ID and set-group-ID are dropped).
        mode: u32,
    },
    /// Open a regular file for reading. Answered by `FileOpened` (with the descriptor) or `FileError`.
    ReadFile {
        /// Absolute path in the jail.
        path: String,
    },
    /// Start the zygote: a job that sets itself up, writes a byte to descriptor 3 when it is ready and then blocks
    /// reading descriptor 0 (which PID 1 supplies and never writes). Descriptors: stdout, stderr. Answered by
    /// `Started`, then `ZygoteReady` once it is held stopped at that read — or `ZygoteRefused` (it was killed)
    /// or `Exited` (it ended before it was ready). Only in a jail set up with [`Setup::zygote`], once.
    Zygote(Exec),
    /// Fork the zygote into a fresh jail of its own and let the fork resume the zygote's read on its own stdin.
    /// Descriptors: stdin, stdout, stderr, the status pipe (PID 1 writes the fork's `Exited` frame there, as
    /// JSON, when it ends), then the fork's cgroup files (PID 1 writes the fork's PID into each before it runs).
    /// Answered by `Forked` with a pidfd of the fork, or `ForkFailed`.
    Fork(Fork),
    /// Hand over a descriptor of the overlay's upper directory (for a snapshot; the host walks it with `*at`
    /// calls only). Answered by `UpperOpened` with the descriptor.
    OpenUpper,
    /// End the jail: PID 1 exits and the kernel kills everything in its PID namespace.
    Shutdown,
    /// Describe a directory's entries, down to `depth` levels (1: its own entries), links listed and not
    /// followed. Answered by `Entries` frames, the last one `done`, or by `ListTooLarge` or `FileError`.
    ListDir {
        /// Absolute path in the jail.
        path: String,
        /// How many levels to descend (1 or more).
        depth: u32,
        /// The most entries to answer; a directory with more is refused (`ListTooLarge`).
        max_entries: u32,
    },
    /// Describe one path without following a symlink it names. Answered by `Entry` or `FileError`.
    Stat {
        /// Absolute path in the jail.
        path: String,
    },
    /// Create a directory and its missing parents. Answered by `DirMade` or `FileError`.
    MakeDir {
        /// Absolute path in the jail.
        path: String,
    },
    /// Move a file or directory. Answered by `Entry` (the moved entry, at `to`) or `FileError`.
    Rename {
        /// Absolute path in the jail.
        from: String,
        /// Absolute path in the jail.
        to: String,
    },
    /// Remove a file or link, or a directory with everything in it, never following a link. Answered by
    /// `Removed` or `FileError`.
    Remove {
        /// Absolute path in the jail.
        path: String,
    },
    /// Watch a directory (and, `recursive`, every directory below it, including those made later) with
    /// inotify. Answered by `Watching` or `FileError`; then `WatchEvents` frames arrive on this connection as
    /// things happen, until `Unwatch` or the connection closes.
    Watch {
        /// The watch's number on this connection.
        id: u64,
        /// Absolute path in the jail.
        path: String,
        /// Whether directories below are watched too.
        recursive: bool,
    },
    /// Stop a watch of this connection. No reply.
    Unwatch {
        /// The watch's number.
        id: u64,
    },
    /// Start the jail's service ([`crate::service`]): a command PID 1 runs like a job (its account, rlimits,
    /// session and the jail's seccomp filter; no terminal, no stdin, no program to copy in) and restarts whenever
    /// it ends, until it ended [`Service::burst`] times within [`Service::burst_window_ms`]. Its stdout and stderr
    /// go to PID 1, which keeps their tail and writes them to [`crate::service::LOG_FILE`]. Descriptors: the
    /// service's cgroup files ([`Exec::cgroup_files`] of them; it joins that cgroup at each start). Answered by
    /// `ServiceStatus` once it runs, or `ExecFailed` (stage `busy` with `EBUSY` when the jail has a service
    /// already: one per jail). Taken on any connection.
    Service(Service),
    /// Describe the service. Answered by `ServiceStatus`, or `NoService`. Taken on any connection.
    ServiceStatus,
    /// Stop the service for good: `SIGTERM` to its process group, `SIGKILL` to it `grace_ms` later if it still
    /// runs. Answered, on the connection it came on, by `ServiceStatus` (state `stopped`) once it has ended (at
    /// once when it was not running), or `NoService`. Taken on any connection.
    StopService {
        /// How long the service may take to end after `SIGTERM`; [`Service::stop_grace_ms`] when `None`.
        #[serde(default)]
        grace_ms: Option<u64>,
    },
}

/// The jail's service: a command that PID 1 starts, restarts and stops ([`HostFrame::Service`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Service {
    /// What to run, as a job's (without `tty` or `program_copy`).
    pub exec: Exec,
    /// How long after it ended it is started again (at least [`crate::service::MIN_RESTART_DELAY`]).
    pub restart_delay_ms: u64,
    /// The most starts within [`Service::burst_window_ms`]: a service that ends when it has started that many
    /// times within the window is `failed`, and not started again (at least 1).
    pub burst: u32,
    /// The window over which starts are counted.
    pub burst_window_ms: u64,
    /// How long a stop waits after `SIGTERM` before `SIGKILL`, unless `StopService` names its own.
    pub stop_grace_ms: u64,
}

/// What the service is doing ([`JailFrame::ServiceStatus`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ServiceState {
    /// It runs, started less than [`crate::service::START_SECONDS`] ago.
    Starting,
    /// It runs, and has run at least [`crate::service::START_SECONDS`].
    Running,
    /// It ended while still starting; it is started again after the restart delay.
    Backoff,
    /// It ended after it had been running; it is started again after the restart delay.
    Exited,
    /// It ended too often within the burst window (or could not be started again): it stays down.
    Failed,
    /// It was stopped (`StopService`): it stays down.
    Stopped,
}

/// How a run of the service ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ServiceExit {
    /// It exited with this code.
    Code(i32),
    /// This signal killed it.
    Signal(i32),
}

/// The most layers an image may stack (each is one mount in the jail, and overlayfs's options are one page).
pub const MAX_LOWERS: usize = 64;

/// How to build the jail.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Setup {
    /// Must be [`PROTOCOL_VERSION`].
    pub version: u32,
    /// Files the jail process writes `0` into, in order, to move itself into its cgroup before it creates any
    /// namespace or process.
    pub join_cgroup: Vec<PathBuf>,
    /// The image: its read-only layers on the host, the top one first (overlayfs's `lowerdir` order), at most
    /// [`MAX_LOWERS`]. One tree (the Debian image) or a built or imported image's stack, whose upper layers hold
    /// overlayfs whiteouts and opaque directories.
    pub lowers: Vec<PathBuf>,
    /// An existing, empty host directory over which the jail mounts its private tmpfs (in its own mount
    /// namespace, so the host never sees it).
    pub scratch_mount: PathBuf,
    /// Size of that tmpfs: the overlay's upper layer, `/dev/shm` and the jail's writes together.
    pub scratch_bytes: u64,
    /// Host paths bind-mounted into the jail.
    pub binds: Vec<Bind>,
    /// The jail's hostname.
    pub hostname: String,
    /// PID 1 exits as soon as the first job ends (a one-shot run).
    pub one_shot: bool,
    /// Run jobs in a user namespace with this mapping (and mount the image and grants idmapped through it);
    /// `None` runs them as host root with every capability dropped.
    pub id_map: Option<IdMap>,
    /// The upper layer starts as the [`crate::tree`] file passed as this frame's descriptor (a fork), restored
    /// before the overlay is mounted; otherwise it starts empty.
    pub restore_upper: bool,
    /// The host egress proxy's Unix socket: bound into the jail at [`crate::forward::GUEST_SOCKET`], with PID 1
    /// forwarding [`crate::forward::LISTEN`] to it. `None`: no network beyond loopback.
    #[serde(default)]
    pub egress_socket: Option<PathBuf>,
    /// The jail holds a zygote ([`HostFrame::Zygote`]) and forks it: PID 1 keeps `ptrace`, `setns` and the mount
    /// calls (it builds each fork), and the zygote gets a filter of its own that takes them away again.
    #[serde(default)]
    pub zygote: bool,
    /// The account of the jail (looked up in its `/etc/passwd` once it is built) that owns what the file frames
    /// create; the jail's root when `None`. Needs [`Setup::id_map`].
    #[serde(default)]
    pub files_owner: Option<String>,
}

/// One fork of the zygote.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fork {
    /// Size of the fork's private tmpfs (its writable layer over the zygote's filesystem, its `/dev/shm`).
    pub scratch_bytes: u64,
}

/// A user namespace's ID mapping: IDs `0..count` inside are `base..base + count` on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdMap {
    /// The host ID of the jail's root.
    pub base: u32,
    /// How many IDs are mapped.
    pub count: u32,
}

/// A host path bind-mounted at a jail path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Bind {
    /// Canonical host path.
    pub host: PathBuf,
    /// Absolute, normalised jail path.
    pub guest: String,
    /// Remounted read-only.
    pub read_only: bool,
}

/// One job.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Exec {
    /// The argument vector; `argv[0]` is looked up in `PATH` unless it contains a `/`.
    pub argv: Vec<String>,
    /// The complete environment.
    pub env: Vec<(String, String)>,
    /// Working directory in the jail.
    pub cwd: String,
    /// Copy the fourth descriptor to this jail path (mode 0755) before running: a host program.
    pub program_copy: Option<String>,
    /// Limit on open files (`RLIMIT_NOFILE`).
    pub nofile: u64,
    /// CPU seconds per process (`RLIMIT_CPU`), a backstop to the cgroup's accounting.
    pub cpu_seconds: u64,
    /// How many cgroup files follow the standard streams (the job's own cgroup; at most one per hierarchy).
    #[serde(default)]
    pub cgroup_files: u32,
    /// Run the job on a pseudo-terminal of this window size from the jail's `devpts` ([`crate::tty`]): its
    /// standard streams and controlling terminal. The host gets the terminal's master with `Started`.
    #[serde(default)]
    pub tty: Option<TtySize>,
    /// Run the job as this account of the jail ([`crate::users`]: its IDs and groups from the jail's
    /// `/etc/passwd` and `/etc/group`; `HOME`, `USER` and `LOGNAME` set from it; an empty [`Exec::cwd`] is its
    /// home) instead of the jail's root. Needs [`Setup::id_map`].
    #[serde(default)]
    pub user: Option<String>,
}

/// A terminal's window size in character cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TtySize {
    /// Rows.
    pub rows: u16,
    /// Columns.
    pub cols: u16,
}

/// What the jail tells the host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub enum JailFrame {
    /// The jail is built and waits for jobs. A descriptor of the overlay's upper directory is attached: the host
    /// reads how full the writable layer is from it (`fstatvfs`), and walks nothing through it.
    Ready {
        /// PID 1 as the host sees it (killing it ends the whole PID namespace).
        host_pid: i32,
        /// What the jail did differently from what was asked, and why (e.g. a grant on a filesystem without
        /// idmapped mounts, bind-mounted plainly).
        notes: Vec<String>,
    },
    /// Building the jail failed; PID 1 exits after sending this.
    SetupFailed {
        /// Which step.
        stage: String,
        /// The error.
        message: String,
    },
    /// The job's program is running. A job with [`Exec::tty`] has its terminal's master attached.
    Started {
        /// Its PID inside the jail.
        pid: i32,
    },
    /// The job could not be started.
    ExecFailed {
        /// Which step (`lookup`, `copy`, `chdir`, `exec`, ...).
        stage: String,
        /// The OS error number, when there is one.
        errno: i32,
        /// The error.
        message: String,
    },
    /// The job's main process ended.
    Exited {
        /// Exit code, when it exited.
        code: Option<i32>,
        /// The signal that killed it, when one did.
        signal: Option<i32>,
    },
    /// The zygote is held stopped at its read of descriptor 0, ready to fork.
    ZygoteReady {
        /// Its PID inside the jail.
        pid: i32,
    },
    /// The zygote could not be held as one (it was killed; the jail can fork nothing).
    ZygoteRefused {
        /// Why.
        message: String,
    },
    /// A fork runs; its pidfd is attached.
    Forked {
        /// Its PID inside the zygote's jail.
        pid: i32,
    },
    /// A fork could not be made (nothing of it is left).
    ForkFailed {
        /// Which step.
        stage: String,
        /// The error.
        message: String,
    },
    /// A `WriteFile` completed.
    FileWritten,
    /// A `ReadFile` opened the file; the descriptor is attached.
    FileOpened {
        /// Its size when opened.
        size: u64,
    },
    /// The descriptor of the overlay's upper directory is attached.
    UpperOpened,
    /// A file operation failed.
    FileError {
        /// The OS error number.
        errno: i32,
        /// The error.
        message: String,
    },
    /// Entries of a `ListDir`, in chunks; the last chunk is `done`.
    Entries {
        /// The entries of this chunk.
        entries: Vec<Entry>,
        /// Whether this is the last chunk.
        done: bool,
    },
    /// A `ListDir` found more than its `max_entries` (or more bytes than [`MAX_LIST_BYTES`]) and answers none.
    ListTooLarge {
        /// The limit it passed.
        limit: u32,
    },
    /// The entry a `Stat` or `Rename` describes.
    Entry {
        /// The entry.
        entry: Entry,
    },
    /// A `MakeDir` completed.
    DirMade {
        /// Whether a directory was created (false: it existed already).
        created: bool,
    },
    /// A `Remove` completed.
    Removed,
    /// A `Watch` started.
    Watching {
        /// The watch's number.
        id: u64,
    },
    /// The service, as `Service`, `ServiceStatus` and `StopService` answer.
    ServiceStatus {
        /// What it is doing.
        state: ServiceState,
        /// How many times it was started again after it ended.
        restarts: u32,
        /// Its PID in the jail while it runs.
        pid: Option<u32>,
        /// How its last run ended.
        last_exit: Option<ServiceExit>,
        /// The end of its combined stdout and stderr, at most [`crate::service::LOG_TAIL`] bytes (invalid UTF-8
        /// replaced).
        log_tail: String,
    },
    /// The jail has no service (`ServiceStatus`, `StopService`).
    NoService,
    /// Events of a watch, in the order they happened.
    WatchEvents {
        /// The watch's number.
        id: u64,
        /// What happened.
        events: Vec<WatchEvent>,
        /// Events were lost before these (the kernel's queue or the jail's overflowed).
        overflowed: bool,
    },
}

/// The most bytes of paths and link targets one listing carries (beyond it: `ListTooLarge`).
pub const MAX_LIST_BYTES: usize = 64 << 20;

/// One file or directory as PID 1 describes it (IDs as the jail's jobs see them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    /// Its absolute path in the jail.
    pub path: String,
    /// What it is.
    pub kind: EntryKind,
    /// Its size in bytes.
    pub size: u64,
    /// Its permission bits.
    pub mode: u32,
    /// Its owner.
    pub uid: u32,
    /// Its group.
    pub gid: u32,
    /// Its modification time: seconds and nanoseconds since the epoch.
    pub modified: Option<(i64, u32)>,
    /// Where a symlink points.
    pub link: Option<String>,
}

/// What kind of file an [`Entry`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EntryKind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link.
    Symlink,
    /// Anything else.
    Other,
}

/// One event of a watch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WatchEvent {
    /// What happened.
    pub kind: WatchKind,
    /// The absolute path in the jail it happened to.
    pub path: String,
}

/// What happened to a watched path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum WatchKind {
    /// Created, or moved in.
    Create,
    /// Written.
    Write,
    /// Its mode or owner changed.
    Chmod,
    /// Moved away (the old path).
    Rename,
    /// Removed.
    Remove,
}

/// A control message that could not be sent or received.
#[derive(Debug)]
pub enum ProtoError {
    /// The socket failed.
    Io(std::io::Error),
    /// The peer sent something that is not a valid frame.
    Malformed(String),
}

impl std::fmt::Display for ProtoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProtoError::Io(err) => write!(f, "control socket: {err}"),
            ProtoError::Malformed(what) => write!(f, "malformed control message: {what}"),
        }
    }
}

impl std::error::Error for ProtoError {}

impl From<Errno> for ProtoError {
    fn from(errno: Errno) -> Self {
        ProtoError::Io(errno.into())
    }
}

impl From<std::io::Error> for ProtoError {
    fn from(err: std::io::Error) -> Self {
        ProtoError::Io(err)
    }
}

/// Sends one frame with `fds` attached.
pub fn send<T: Serialize>(socket: BorrowedFd<'_>, frame: &T, fds: &[BorrowedFd<'_>]) -> Result<(), ProtoError> {
    send_with(socket, frame, fds, true)
}

/// Sends one frame without waiting for room in the socket's buffer (`EAGAIN` when there is none).
pub fn send_nowait<T: Serialize>(socket: BorrowedFd<'_>, frame: &T) -> Result<(), ProtoError> {
    send_with(socket, frame, &[], false)
}

fn send_with<T: Serialize>(
    socket: BorrowedFd<'_>,
    frame: &T,
    fds: &[BorrowedFd<'_>],
    wait: bool,
) -> Result<(), ProtoError> {
    let doc = serde_json::to_vec(frame).map_err(|e| ProtoError::Malformed(e.to_string()))?;
    let mut raw: Vec<RawFd> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
    let spill;
    let payload: &[u8] = if doc.len() > MAX_INLINE {
        spill = spill_to_memfd(&doc)?;
        raw.push(spill.as_raw_fd());
        SPILL
    } else {
        &doc
    };
    if raw.len() > MAX_FDS + 1 {
        return Err(ProtoError::Malformed(format!("{} descriptors in one message", raw.len())));
    }
    let flags = if wait { MsgFlags::MSG_NOSIGNAL } else { MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT };
    Ok(strata_fdpass::send(socket, payload, &raw, flags)?)
}

fn spill_to_memfd(doc: &[u8]) -> Result<OwnedFd, ProtoError> {
    let fd = memfd_create("strata-frame", MFdFlags::MFD_CLOEXEC)?;
    let mut file = std::fs::File::from(fd);
    file.write_all(doc)?;
    Ok(file.into())
}

/// Receives one frame and the descriptors beside it; `Ok(None)` when the peer closed the socket.
pub fn recv<T: DeserializeOwned>(socket: BorrowedFd<'_>) -> Result<Option<(T, Vec<OwnedFd>)>, ProtoError> {
    let mut buf = vec![0u8; MAX_INLINE + 1];
    let received = strata_fdpass::recv::<{ MAX_FDS + 1 }>(socket, &mut buf)?;
    let (len, mut fds) = (received.len, received.fds);
    if received.truncated || len > MAX_INLINE {
        return Err(ProtoError::Malformed("message too large".into()));
    }
    if len == 0 && fds.is_empty() {
        return Ok(None);
    }
    let doc = if &buf[..len] == SPILL {
        let fd = fds.pop().ok_or_else(|| ProtoError::Malformed("spilled frame without its memfd".into()))?;
        read_spill(fd)?
    } else {
        buf.truncate(len);
        buf
    };
    let frame = serde_json::from_slice(&doc).map_err(|e| ProtoError::Malformed(e.to_string()))?;
    Ok(Some((frame, fds)))
}

fn read_spill(fd: OwnedFd) -> Result<Vec<u8>, ProtoError> {
    let mut file = std::fs::File::from(fd);
    let size = file.metadata()?.len();
    if size > MAX_SPILL {
        return Err(ProtoError::Malformed(format!("spilled frame of {size} bytes")));
    }
    file.rewind()?;
    let mut doc = Vec::with_capacity(size as usize);
    file.take(MAX_SPILL).read_to_end(&mut doc)?;
    Ok(doc)
}

/// Borrows every descriptor of a list, for [`send`].
pub fn borrow_all(fds: &[OwnedFd]) -> Vec<BorrowedFd<'_>> {
    fds.iter().map(|fd| fd.as_fd()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};

    fn pair() -> (OwnedFd, OwnedFd) {
        socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC).expect("socketpair")
    }

    #[test]
    fn small_and_spilled_frames_round_trip() {
        let (a, b) = pair();
        send(a.as_fd(), &HostFrame::Kill, &[]).expect("send");
        let (frame, fds): (HostFrame, _) = recv(b.as_fd()).expect("recv").expect("frame");
        assert!(matches!(frame, HostFrame::Kill));
        assert!(fds.is_empty());

        let big = "x".repeat(300_000);
        let exec = Exec {
            argv: vec!["python3".into(), "-c".into(), big.clone()],
            env: vec![],
            cwd: "/".into(),
            program_copy: None,
            nofile: 64,
            cpu_seconds: 1,
            cgroup_files: 0,
            tty: None,
            user: None,
        };
        let (r, w) = nix::unistd::pipe().expect("pipe");
        send(a.as_fd(), &HostFrame::Exec(exec), &[r.as_fd(), w.as_fd()]).expect("send");
        let (frame, fds): (HostFrame, _) = recv(b.as_fd()).expect("recv").expect("frame");
        let HostFrame::Exec(exec) = frame else { panic!("not exec") };
        assert_eq!(exec.argv[2], big);
        assert_eq!(fds.len(), 2);
    }

    #[test]
    fn service_frames_round_trip() {
        let (a, b) = pair();
        let exec = Exec {
            argv: vec!["/bin/sh".into(), "-c".into(), "serve".into()],
            env: vec![("PATH".into(), "/bin".into())],
            cwd: "/root".into(),
            program_copy: None,
            nofile: 1024,
            cpu_seconds: u64::MAX,
            cgroup_files: 0,
            tty: None,
            user: Some("user".into()),
        };
        let service = Service { exec, restart_delay_ms: 1000, burst: 5, burst_window_ms: 60_000, stop_grace_ms: 2000 };
        send(a.as_fd(), &HostFrame::Service(service), &[]).expect("send");
        let (frame, _): (HostFrame, _) = recv(b.as_fd()).expect("recv").expect("frame");
        assert!(matches!(frame, HostFrame::Service(Service { burst: 5, .. })));
        // A stop without a grace of its own takes the service's.
        let stop: HostFrame = serde_json::from_str(r#"{"StopService":{}}"#).expect("parses");
        assert!(matches!(stop, HostFrame::StopService { grace_ms: None }));

        let status = JailFrame::ServiceStatus {
            state: ServiceState::Backoff,
            restarts: 2,
            pid: None,
            last_exit: Some(ServiceExit::Code(3)),
            log_tail: "\0".repeat(16 * 1024),
        };
        // Escaped, the tail is larger than an inline message: it spills.
        send(b.as_fd(), &status, &[]).expect("send");
        let (frame, fds): (JailFrame, _) = recv(a.as_fd()).expect("recv").expect("frame");
        assert_eq!(frame, status);
        assert!(fds.is_empty());
        let json = serde_json::to_string(&ServiceExit::Signal(15)).expect("serialises");
        assert_eq!(json, r#"{"signal":15}"#);
    }

    #[test]
    fn closed_peer_is_none() {
        let (a, b) = pair();
        drop(a);
        assert!(recv::<HostFrame>(b.as_fd()).expect("recv").is_none());
    }

    #[test]
    fn garbage_is_malformed() {
        let (a, b) = pair();
        nix::sys::socket::send(a.as_raw_fd(), b"{not json", MsgFlags::empty()).expect("send");
        assert!(matches!(recv::<HostFrame>(b.as_fd()), Err(ProtoError::Malformed(_))));
    }
}
