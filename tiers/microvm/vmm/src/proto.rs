//! The control protocol between the engine and a monitor process ([`crate::monitor`]).
//!
//! One `SOCK_SEQPACKET` socket, the monitor's standard input: each message is one JSON document of at most
//! [`MAX_MESSAGE`] bytes, with up to [`MAX_FDS`] descriptors beside it (`SCM_RIGHTS`). Big data never travels in a
//! message: the engine hands over files (`/dev/kvm`, the kernel, disks, a saved state and memory) and receives a
//! snapshot's state and memory in files it created. Every request gets exactly one reply, in order.
//!
//! ```text
//! engine                                  keeper (host root)            monitor (PID 1 of its namespaces)
//! Jail(JailSpec)  ───────────────────────▶ cgroup, namespaces, fork ──▶ minimal root, user namespace
//!                 ◀─────────────────────── Jailed { host_pid }
//!                 ◀──────────────────────────────────────────────────── Ready (capabilities dropped, filters on)
//! Start(MachineSpec) + fds ─────────────────────────────────────────▶ builds the machine, runs its vCPUs
//!                 ◀──────────────────────────────────────────────────── Started
//! Status | Console | Snapshot + fds | Probe | Stop ─────────────────────▶ ...one reply each
//! ```
//!
//! The monitor reads requests with a size cap and trusts nothing in them beyond what the engine could already do
//! (the engine starts it); the engine trusts nothing in replies: a monitor may be a guest's by then. A reply that
//! does not parse, or a closed socket, is a crashed monitor.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::PathBuf;

use nix::errno::Errno;
use nix::sys::socket::MsgFlags;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

pub use crate::seccomp::ThreadKind;
use crate::vstate::vcpu::cpuid::CpuidProfile;

/// The protocol version; the engine and the monitor it embeds always agree, the check catches a stale binary.
pub const PROTOCOL_VERSION: u32 = 1;
/// The largest message either side accepts.
pub const MAX_MESSAGE: usize = 64 * 1024;
/// The most descriptors one message carries.
pub const MAX_FDS: usize = 16;
/// Where the VM's socket directory appears inside the monitor's root.
pub const RUN_DIR: &str = "/run";

/// Why a message could not be sent or received.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    /// The socket failed.
    #[error("control socket: {0}")]
    Socket(#[from] Errno),
    /// The message is too large, truncated or not the expected JSON.
    #[error("malformed control message: {0}")]
    Malformed(String),
}

/// The engine's requests.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum Request {
    /// To the keeper, first: build the jail.
    Jail(JailSpec),
    /// To the monitor, once it is [`Reply::Ready`]: build the machine and start its vCPUs. Descriptors: `/dev/kvm`
    /// open read-write, then the payload's files ([`Payload`]), then one per disk (read-only).
    Start(MachineSpec),
    /// Whether the guest is still running ([`Reply::Status`]).
    Status,
    /// The serial console's log ([`Reply::Console`]).
    Console,
    /// Pause at a safe point, write the state and the memory into the two descriptors given (state, then
    /// memory; both empty files), resume ([`Reply::Saved`]).
    Snapshot,
    /// Make `thread` call a system call its filter does not allow (`socket(AF_INET, …)`): the monitor must die of
    /// it. For tests of the filters; a vCPU's probe is the probe device, which a guest reaches by writing to
    /// [`PROBE_ADDRESS`], and only exists when [`BootSpec::probe`] asked for it.
    Probe(ThreadKind),
    /// Stop the vCPUs and exit.
    Stop,
}

/// The monitor's replies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum Reply {
    /// From the keeper: the monitor's process ID in the engine's PID namespace.
    Jailed {
        /// The monitor's PID as the host sees it.
        host_pid: i32,
    },
    /// The monitor is in its jail and under its filter, waiting for [`Request::Start`].
    Ready,
    /// The machine is built and its vCPUs run.
    Started,
    /// Whether a vCPU has stopped on its own (the guest halted, shut down or crashed), and how each ended.
    Status {
        /// Whether the guest stopped.
        stopped: bool,
        /// How each vCPU's run ended, once stopped.
        exits: Vec<String>,
    },
    /// The console's log, as text (invalid UTF-8 replaced).
    Console {
        /// The log's last bytes (at most the log's capacity).
        text: String,
        /// Bytes that no longer fit in the log.
        dropped: u64,
    },
    /// The snapshot's files are written.
    Saved {
        /// The state file's length.
        state_bytes: u64,
    },
    /// The request was carried out.
    Done,
    /// The request failed; the monitor goes on (unless it was [`Request::Start`]).
    Failed {
        /// What was being done.
        stage: String,
        /// Why.
        message: String,
    },
}

/// How the monitor is jailed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JailSpec {
    /// Must be [`PROTOCOL_VERSION`].
    pub version: u32,
    /// The cgroup files the keeper writes `0` into to join its cgroup before anything else (the monitor inherits
    /// it).
    pub join_cgroup: Vec<PathBuf>,
    /// An empty directory of the engine's to mount the monitor's root (a tmpfs) on.
    pub root_dir: PathBuf,
    /// The VM's socket directory, bound read-write at [`RUN_DIR`] in the monitor's root; owned by `uid`.
    pub socket_dir: PathBuf,
    /// The host user ID the monitor's user namespace maps its root to (an ID no host file belongs to).
    pub uid: u32,
    /// The host group ID, likewise.
    pub gid: u32,
}

/// What the monitor runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MachineSpec {
    /// Must be [`PROTOCOL_VERSION`].
    pub version: u32,
    /// A new machine, or a saved one.
    pub payload: Payload,
    /// The vsock device's socket, a file name in [`RUN_DIR`] (it must not exist); none without vsock. A restored
    /// machine has vsock exactly when its state has.
    pub vsock_socket: Option<String>,
    /// The vsock CID: a new machine's, or a fork's new identity (`None` keeps the saved one).
    pub guest_cid: Option<u64>,
    /// Read-only disks, in order (one descriptor each). A restored machine gets exactly its saved disks.
    pub disks: Vec<DiskSpec>,
}

impl MachineSpec {
    /// A new machine of one vCPU, without irqchip or devices but the console, running hand-made `code` at guest
    /// address `at` (the tiny guests of tests and benches).
    pub fn code(code: Vec<u8>, at: u64, memory_bytes: u64) -> MachineSpec {
        MachineSpec {
            version: PROTOCOL_VERSION,
            payload: Payload::Boot(BootSpec {
                memory_bytes,
                vcpus: 1,
                cpuid: CpuidProfile::Standard,
                irqchip: false,
                image: BootImage::Code { code, at },
                probe: false,
            }),
            vsock_socket: None,
            guest_cid: None,
            disks: Vec::new(),
        }
    }

    /// A fork of a saved machine (descriptors: the state, the memory).
    pub fn fork() -> MachineSpec {
        MachineSpec {
            version: PROTOCOL_VERSION,
            payload: Payload::Restore { fork: true },
            vsock_socket: None,
            guest_cid: None,
            disks: Vec::new(),
        }
    }

    /// The same, with a vsock device whose socket is `name` in [`RUN_DIR`].
    pub fn with_vsock(mut self, name: &str) -> MachineSpec {
        self.vsock_socket = Some(name.to_owned());
        self
    }
}

/// A read-only virtio-blk disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskSpec {
    /// The disk ID the guest reads (at most 20 bytes); derived from the file when `None`.
    pub id: Option<String>,
    /// The name errors use.
    pub name: String,
}

/// What a machine starts from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum Payload {
    /// A new machine.
    Boot(BootSpec),
    /// A saved machine. Descriptors: the state file, the memory file (a private copy nobody else writes).
    Restore {
        /// Map the memory copy-on-write (`MAP_PRIVATE`) rather than copy it into a memfd.
        fork: bool,
    },
}

/// A new machine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BootSpec {
    /// Guest RAM in bytes.
    pub memory_bytes: u64,
    /// vCPUs (at least one).
    pub vcpus: u8,
    /// The CPUID mask.
    pub cpuid: CpuidProfile,
    /// The in-kernel irqchip (PICs, IOAPIC, LAPICs, PIT); a Linux guest needs it.
    pub irqchip: bool,
    /// What runs.
    pub image: BootImage,
    /// Place the probe device at [`PROBE_ADDRESS`] (for tests of the vCPU threads' filter).
    pub probe: bool,
}

/// What a new machine runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum BootImage {
    /// An ELF `vmlinux` booted with the 64-bit protocol; descriptors: the kernel, then the initramfs if
    /// `initramfs`. The monitor appends its devices to `cmdline`.
    Linux {
        /// The kernel command line, without the devices.
        cmdline: String,
        /// Whether an initramfs descriptor follows the kernel's.
        initramfs: bool,
    },
    /// Hand-made code at guest address `at`, entered in 64-bit long mode through the boot module's GDT and
    /// identity page tables (the tiny guests of the tests and benches). No descriptor.
    Code {
        /// The code.
        code: Vec<u8>,
        /// Where it goes (and where the vCPU starts).
        at: u64,
    },
}

/// Where the probe device sits on the MMIO bus: 256 MiB, inside the first GiB the boot page tables identity-map,
/// so a tiny guest reaches it. A machine with the probe has at most this much RAM (the address must not be RAM).
pub const PROBE_ADDRESS: u64 = 0x1000_0000;

/// Sends one message with `fds` beside it.
pub fn send<T: Serialize>(socket: BorrowedFd<'_>, message: &T, fds: &[BorrowedFd<'_>]) -> Result<(), ProtoError> {
    let doc = serde_json::to_vec(message).map_err(|e| ProtoError::Malformed(e.to_string()))?;
    if doc.len() > MAX_MESSAGE {
        return Err(ProtoError::Malformed(format!("a {}-byte message (at most {MAX_MESSAGE})", doc.len())));
    }
    if fds.len() > MAX_FDS {
        return Err(ProtoError::Malformed(format!("{} descriptors in one message (at most {MAX_FDS})", fds.len())));
    }
    let raw: Vec<RawFd> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
    Ok(strata_fdpass::send(socket, &doc, &raw, MsgFlags::MSG_NOSIGNAL)?)
}

/// Receives one message and its descriptors; `None` when the other side closed the socket.
pub fn recv<T: DeserializeOwned>(socket: BorrowedFd<'_>) -> Result<Option<(T, Vec<OwnedFd>)>, ProtoError> {
    let mut buf = vec![0u8; MAX_MESSAGE + 1];
    let received = strata_fdpass::recv::<MAX_FDS>(socket, &mut buf)?;
    let (len, fds) = (received.len, received.fds);
    if received.truncated || len > MAX_MESSAGE {
        return Err(ProtoError::Malformed("message too large".into()));
    }
    if len == 0 && fds.is_empty() {
        return Ok(None);
    }
    let message = serde_json::from_slice(&buf[..len]).map_err(|e| ProtoError::Malformed(e.to_string()))?;
    Ok(Some((message, fds)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
    use std::os::fd::AsFd;

    fn pair() -> (OwnedFd, OwnedFd) {
        socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC).expect("socketpair")
    }

    #[test]
    fn messages_and_descriptors_cross() {
        let (a, b) = pair();
        let file = tempfile::tempfile().expect("file");
        let mut spec = MachineSpec::code(vec![0xf4], 0x1000, 2 << 20);
        spec.disks.push(DiskSpec { id: Some("root".into()), name: "root".into() });
        let request = Request::Start(spec);
        send(a.as_fd(), &request, &[file.as_fd()]).expect("send");
        let (got, fds) = recv::<Request>(b.as_fd()).expect("recv").expect("a message");
        assert_eq!(got, request);
        assert_eq!(fds.len(), 1);
        drop(a);
        assert!(recv::<Request>(b.as_fd()).expect("recv").is_none(), "a closed socket is None");
    }

    #[test]
    fn bad_messages_are_typed_errors() {
        let (a, b) = pair();
        nix::sys::socket::send(a.as_raw_fd(), b"{\"surprise\":1}", MsgFlags::empty()).expect("send");
        assert!(matches!(recv::<Request>(b.as_fd()), Err(ProtoError::Malformed(_))));
        let huge = vec![b' '; MAX_MESSAGE + 10];
        nix::sys::socket::send(a.as_raw_fd(), &huge, MsgFlags::empty()).expect("send");
        assert!(matches!(recv::<Request>(b.as_fd()), Err(ProtoError::Malformed(_))));
        let too_big = Request::Start(MachineSpec::code(vec![0x90; MAX_MESSAGE], 0x1000, 2 << 20));
        assert!(matches!(send(a.as_fd(), &too_big, &[]), Err(ProtoError::Malformed(_))));
    }
}
