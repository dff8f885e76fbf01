//! The host <-> guest agent protocol (docs/DESIGN.md §4): versioned, length-prefixed bincode frames.
//!
//! A connection carries frames in both directions: a `u32` little-endian body length (at most [`MAX_FRAME`])
//! and a bincode-encoded body (serde, bincode's standard configuration). The host sends [`HostMessage`]s, the
//! agent [`GuestMessage`]s. The first exchange is `Hello` both ways; the agent answers with its
//! [`PROTOCOL_VERSION`], and the connection is only used when the versions are equal.
//!
//! - [`message`]: the messages.
//! - [`frame`]: [`FrameReader`] and [`FrameWriter`], which refuse oversize, truncated and malformed frames with
//!   a typed [`FrameError`].
//! - [`transport`]: the byte streams ([`Transport`]): a Unix socket on the host, AF_VSOCK in a guest.
//! - [`client`]: [`AgentClient`], the host's side, which trusts nothing the agent sends.

pub mod client;
pub mod frame;
pub mod message;
pub mod transport;

pub use client::{
    AgentClient, AgentInfo, AgentWatch, ClientConfig, ClientError, DirListing, ExecControl, ExecEvent, ExecHandle,
    ExitReport, FileUpload, TreeListing,
};
pub use frame::{FrameError, FrameReader, FrameWriter, MAX_FRAME};
pub use message::{
    Bytes, Entropy, EntryInfo, EntryKind, ExecLimits, ExecRequest, ExitStatus, FileType, GuestMessage, HostMessage,
    OutputStream, RequestId, Rusage, TreeEntry, TtySize, WatchEvent, WatchKind,
};
pub use transport::{Transport, VsockListener, VsockStream};

/// The protocol version both sides must speak. Raise it with any change to a message.
///
/// 2: `MakeDir`, `MakeSymlink` and `ListTree` (answered by `TreeEntries` and `TreeDone`), for file grants.
/// 3: `StartEgress`, the network egress tunnel.
/// 4: `Stat`, `ListDir`, `CreateDir`, `Rename`, `Remove`, `Watch` and `Unwatch` (answered by `Entry`,
///    `DirEntries` and `DirDone`, `DirCreated`, `WatchEvents` and `WatchEnded`), the sandbox's file methods.
/// 5: `ExecRequest::tty` and `Resize`, terminals.
/// 6: `OpenPort`, the host reaching a guest's TCP server.
pub const PROTOCOL_VERSION: u32 = 6;

/// How an [`HostMessage::OpenPort`] refused because nothing listens on the port starts its error message.
pub const PORT_CLOSED: &str = "port closed";

/// The most [`HostMessage::OpenPort`] connections a guest relays at once.
pub const MAX_PORT_CONNECTIONS: usize = 64;

/// The largest piece of output, stdin or file data in one message.
pub const MAX_CHUNK: usize = 64 * 1024;

/// The longest path in a tree listing (relative to the listed directory) or symbolic link target, in bytes
/// (Linux's `PATH_MAX`).
pub const MAX_PATH: usize = 4096;

/// The most entries in one [`GuestMessage::TreeEntries`] or [`GuestMessage::DirEntries`] batch.
pub const MAX_TREE_BATCH: usize = 100;

/// The most events in one [`GuestMessage::WatchEvents`] batch.
pub const MAX_WATCH_BATCH: usize = 64;

/// The deepest [`HostMessage::ListDir`] goes.
pub const MAX_LIST_DEPTH: u32 = 64;

// A full batch of the longest entries (or events) fits in a frame.
const _: () = assert!(MAX_TREE_BATCH * (2 * MAX_PATH + 96) + 64 <= MAX_FRAME);
const _: () = assert!(MAX_WATCH_BATCH * (MAX_PATH + 16) + 64 <= MAX_FRAME);

/// The vsock port the agent listens on unless told otherwise.
pub const DEFAULT_AGENT_PORT: u32 = 1024;

/// The host vsock port the agent's egress forwarder connects to, one stream per tunnelled connection
/// ([`HostMessage::StartEgress`]); the vsock device hands each to the Unix socket `<uds>_1028`.
pub const EGRESS_PORT: u32 = 1028;

/// The guest TCP port (on 127.0.0.1) the agent's egress forwarder listens on: jobs get
/// `HTTP(S)_PROXY=http://127.0.0.1:3128`.
pub const EGRESS_LISTEN_PORT: u16 = 3128;

/// The most tunnels [`HostMessage::StartEgress`] may ask for at once.
pub const MAX_EGRESS_CONNECTIONS: u32 = 1024;

/// Tunnels the host asks for at once by default (and the host proxy's own cap on the egress socket).
pub const DEFAULT_EGRESS_CONNECTIONS: u32 = 64;

/// An error and its sources, as one line (how both ends of the channel report a failure).
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
