//! The connection muxer: guest vsock streams ↔ host Unix-socket streams, in the spirit of Firecracker's
//! vsock-over-UDS backend.
//!
//! - **Host-initiated**: a host process connects to the device's Unix socket `<uds>` and writes
//!   `CONNECT <port>\n`; the muxer picks a free host port, sends the guest a REQUEST from it to `<port>`, and on
//!   the guest's RESPONSE writes `OK <host_port>\n` to the host stream, which from then on carries the
//!   connection's bytes. A guest that does not answer within 2 s, or answers RST, gets the host stream closed.
//! - **Guest-initiated**: a guest REQUEST to host port `P` makes the muxer connect (non-blocking) to
//!   `<uds>_<P>`; success answers RESPONSE, failure RST.
//!
//! Flow control is virtio-vsock's credit scheme. The muxer advertises [`CONN_BUF_SIZE`] bytes of buffer per
//! connection and tells the guest how much it has forwarded (`fwd_cnt`); guest data the host socket does not
//! take at once waits in that buffer, and a guest that sends beyond its credit has the connection reset. Host
//! data is read straight into the guest's RX buffer, never more than the guest's advertised free space.
//!
//! Closing: a host that shuts down its sending side (EOF) makes the guest get SHUTDOWN(SEND) once the data
//! before it is delivered, and the guest may go on sending; a host that hangs up entirely has what is left in its
//! stream delivered (as the guest gives credit), then SHUTDOWN(SEND|RCV), and the guest has 2 s to answer RST. A
//! guest SHUTDOWN of both directions has what the host has not taken yet flushed, then an RST back.
//!
//! Nothing a guest sends can make the host panic or grow memory without bound: packets with wrong CIDs are
//! dropped, packets for unknown connections or with unknown operations get an RST, the RSTs waiting for RX
//! buffers are capped ([`MAX_QUEUED_RESETS`], the rest are dropped), and connections ([`MAX_CONNECTIONS`]) and
//! unfinished host handshakes ([`MAX_PENDING_HANDSHAKES`]) are capped too.
//!
//! Host sockets are written with `write(2)`: a host peer that closes early raises SIGPIPE, which Rust binaries
//! ignore (the runtime sets it to SIG_IGN before `main`); the write then fails with EPIPE and the connection is
//! reset.

use std::collections::{HashMap, VecDeque};
use std::io::{self, ErrorKind, Read, Write};
use std::net::Shutdown;
use std::num::Wrapping;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket};
use nix::sys::time::TimeSpec;
use nix::sys::timerfd::{ClockId, Expiration, TimerFd, TimerFlags, TimerSetTimeFlags};
use virtio_vsock::packet::VsockPacket;
use vm_memory::{ReadVolatile, VolatileMemoryError, VolatileSlice, WriteVolatile};

use super::packet::{
    MAX_PKT_DATA, RxHeader, TxHeader, VSOCK_FLAGS_SHUTDOWN_RCV, VSOCK_FLAGS_SHUTDOWN_SEND, VSOCK_HOST_CID,
    VSOCK_TYPE_STREAM, VsockOp,
};

/// The receive buffer the host side advertises per connection (`buf_alloc`); guest data waiting for the host
/// socket never exceeds it.
pub const CONN_BUF_SIZE: u32 = 256 * 1024;
/// Tell the guest about freed buffer space once this much is unreported.
const CREDIT_UPDATE_THRESHOLD: u32 = CONN_BUF_SIZE / 2;
/// Open connections at most; further requests are reset.
pub const MAX_CONNECTIONS: usize = 1024;
/// Host connections still sending their `CONNECT` line, at most; further ones are closed at once.
pub const MAX_PENDING_HANDSHAKES: usize = 64;
/// RSTs waiting for an RX buffer, at most; further ones are dropped.
pub const MAX_QUEUED_RESETS: usize = 1024;
/// The longest `CONNECT <port>\n` line.
const CONNECT_LINE_MAX: usize = 32;
/// How long the guest has to answer a host-initiated REQUEST.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the guest has to answer our SHUTDOWN with RST, or the host to drain a closing connection.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the listener rests after an unexpected accept error (e.g. out of descriptors).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// Host ports the muxer allocates for host-initiated connections start here.
const LOCAL_PORT_BASE: u32 = 1 << 30;
const EVENTS_PER_CALL: usize = 64;
const ACCEPTS_PER_CALL: usize = 16;

const TOKEN_LISTENER: u64 = 0;
const TOKEN_TIMER: u64 = 1;
const FIRST_TOKEN: u64 = 2;

const PENDING_REQUEST: u8 = 1 << 0;
const PENDING_RESPONSE: u8 = 1 << 1;
const PENDING_RW: u8 = 1 << 2;
const PENDING_CREDIT_UPDATE: u8 = 1 << 3;

/// Why the muxer could not start.
#[derive(Debug, thiserror::Error)]
pub enum MuxerError {
    /// The host-side socket could not be created.
    #[error("cannot listen on {path}")]
    Bind {
        /// The socket path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The event loop could not be set up.
    #[error("cannot set up the vsock event loop")]
    Setup(#[source] io::Error),
}

/// A connection as the guest names it: (host port, guest port).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct ConnKey {
    local_port: u32,
    peer_port: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ConnState {
    /// Host-initiated; REQUEST queued or sent to the guest, waiting for RESPONSE.
    LocalInit,
    Established,
    /// The host closed its stream entirely and everything in it reached the guest; SHUTDOWN (both directions)
    /// sent, waiting for the guest's RST.
    LocalClosed,
    /// The guest shut both directions down; flushing what the host has not taken yet, then RST.
    PeerClosing,
}

#[derive(Debug)]
struct Connection {
    stream: UnixStream,
    token: u64,
    state: ConnState,
    /// Whether the stream is in the epoll set (it leaves it on hang-up, which epoll would report forever).
    registered: bool,
    interest: EpollFlags,
    pending: u8,
    /// Whether the connection is in the RX queue.
    queued: bool,
    /// Bytes for the host before any guest data (`OK <port>\n`).
    host_line: Vec<u8>,
    /// Guest data the host socket has not taken yet: `tx_buf[tx_head..]`.
    tx_buf: Vec<u8>,
    tx_head: usize,
    /// Data bytes received from the guest, in total.
    rx_from_guest: Wrapping<u32>,
    /// The `fwd_cnt` the guest last heard from us.
    last_fwd_cnt_sent: Wrapping<u32>,
    /// Data bytes sent to the guest, in total.
    rx_cnt: Wrapping<u32>,
    peer_buf_alloc: u32,
    peer_fwd_cnt: Wrapping<u32>,
    /// SHUTDOWN flags the guest sent.
    peer_shutdown: u32,
    /// The host stream reached EOF (the host shut its sending side; it may still read).
    host_eof: bool,
    deadline: Option<Instant>,
}

impl Connection {
    fn new(stream: UnixStream, token: u64, state: ConnState) -> Connection {
        Connection {
            stream,
            token,
            state,
            registered: true,
            interest: EpollFlags::empty(),
            pending: 0,
            queued: false,
            host_line: Vec::new(),
            tx_buf: Vec::new(),
            tx_head: 0,
            rx_from_guest: Wrapping(0),
            last_fwd_cnt_sent: Wrapping(0),
            rx_cnt: Wrapping(0),
            peer_buf_alloc: 0,
            peer_fwd_cnt: Wrapping(0),
            peer_shutdown: 0,
            host_eof: false,
            deadline: None,
        }
    }

    fn tx_pending(&self) -> usize {
        self.tx_buf.len().saturating_sub(self.tx_head)
    }

    /// Guest bytes handed to the host socket so far.
    fn fwd_cnt(&self) -> Wrapping<u32> {
        self.rx_from_guest - Wrapping(self.tx_pending() as u32)
    }

    /// How much more the guest can take on this connection.
    fn peer_credit(&self) -> u32 {
        let in_flight = (self.rx_cnt - self.peer_fwd_cnt).0;
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    fn wants_host_data(&self) -> bool {
        self.state == ConnState::Established
            && !self.host_eof
            && self.peer_shutdown & VSOCK_FLAGS_SHUTDOWN_RCV == 0
            && self.peer_credit() > 0
    }
}

#[derive(Debug)]
struct Handshake {
    stream: UnixStream,
    line: Vec<u8>,
}

#[derive(Debug, Clone, Copy)]
enum Source {
    Handshake,
    Conn(ConnKey),
}

#[derive(Debug, Clone, Copy)]
enum RxItem {
    Conn(ConnKey),
    Rst(ConnKey),
}

/// What a flush of a connection's host-bound bytes came to.
enum Flushed {
    /// Everything that could be written was.
    Ok,
    /// The connection is done (closing and drained): reset it.
    Done,
    /// The host socket failed.
    Failed,
}

/// The muxer. Not thread-safe by itself: the device calls it under the transport's lock.
#[derive(Debug)]
pub(super) struct VsockMuxer {
    guest_cid: u64,
    uds_path: PathBuf,
    listener: UnixListener,
    /// Set while the listener rests after an accept error.
    listener_paused_until: Option<Instant>,
    epoll: Epoll,
    timer: TimerFd,
    timer_dirty: bool,
    conns: HashMap<ConnKey, Connection>,
    handshakes: HashMap<u64, Handshake>,
    tokens: HashMap<u64, Source>,
    rxq: VecDeque<RxItem>,
    queued_resets: usize,
    next_token: u64,
    next_local_port: u32,
}

fn is_would_block(e: &VolatileMemoryError) -> bool {
    matches!(e, VolatileMemoryError::IOError(io) if io.kind() == ErrorKind::WouldBlock)
}

fn is_interrupted(e: &VolatileMemoryError) -> bool {
    matches!(e, VolatileMemoryError::IOError(io) if io.kind() == ErrorKind::Interrupted)
}

fn connect_nonblocking(path: &Path) -> io::Result<UnixStream> {
    let addr = UnixAddr::new(path)?;
    let fd: OwnedFd =
        socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC, None)?;
    connect(fd.as_raw_fd(), &addr)?;
    Ok(UnixStream::from(fd))
}

fn parse_connect_line(line: &[u8]) -> Option<u32> {
    let text = std::str::from_utf8(line).ok()?;
    text.strip_prefix("CONNECT ")?.trim_end_matches('\r').parse().ok()
}

impl VsockMuxer {
    /// Binds `uds_path` (which must not exist) and sets up the event loop.
    pub(super) fn new(guest_cid: u64, uds_path: PathBuf) -> Result<VsockMuxer, MuxerError> {
        let setup = |e: nix::Error| MuxerError::Setup(e.into());
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).map_err(setup)?;
        let timer = TimerFd::new(ClockId::CLOCK_MONOTONIC, TimerFlags::TFD_NONBLOCK | TimerFlags::TFD_CLOEXEC)
            .map_err(setup)?;
        epoll.add(&timer, EpollEvent::new(EpollFlags::EPOLLIN, TOKEN_TIMER)).map_err(setup)?;
        let listener =
            UnixListener::bind(&uds_path).map_err(|source| MuxerError::Bind { path: uds_path.clone(), source })?;
        let muxer = VsockMuxer {
            guest_cid,
            uds_path,
            listener,
            listener_paused_until: None,
            epoll,
            timer,
            timer_dirty: false,
            conns: HashMap::new(),
            handshakes: HashMap::new(),
            tokens: HashMap::new(),
            rxq: VecDeque::new(),
            queued_resets: 0,
            next_token: FIRST_TOKEN,
            next_local_port: LOCAL_PORT_BASE,
        };
        // From here on, dropping `muxer` removes the socket file.
        muxer.listener.set_nonblocking(true).map_err(MuxerError::Setup)?;
        muxer.epoll.add(&muxer.listener, EpollEvent::new(EpollFlags::EPOLLIN, TOKEN_LISTENER)).map_err(setup)?;
        Ok(muxer)
    }

    pub(super) fn uds_path(&self) -> &Path {
        &self.uds_path
    }

    pub(super) fn set_guest_cid(&mut self, guest_cid: u64) {
        self.guest_cid = guest_cid;
    }

    /// Readable when host sockets (or the timer) have something for [`VsockMuxer::process_events`].
    pub(super) fn epoll_fd(&self) -> BorrowedFd<'_> {
        self.epoll.0.as_fd()
    }

    pub(super) fn has_pending_rx(&self) -> bool {
        !self.rxq.is_empty()
    }

    pub(super) fn connection_count(&self) -> usize {
        self.conns.len()
    }

    /// Drops every connection (device reset): host streams are closed, nothing is sent to the guest.
    pub(super) fn reset(&mut self) {
        for (_, conn) in self.conns.drain() {
            if conn.registered {
                let _ = self.epoll.delete(&conn.stream);
            }
            self.tokens.remove(&conn.token);
        }
        self.rxq.clear();
        self.queued_resets = 0;
        self.timer_dirty = true;
        self.rearm_timer();
    }

    fn alloc_token(&mut self) -> u64 {
        loop {
            let token = self.next_token;
            self.next_token = self.next_token.checked_add(1).unwrap_or(FIRST_TOKEN);
            if !self.tokens.contains_key(&token) {
                return token;
            }
        }
    }

    fn queue_reset(&mut self, key: ConnKey) {
        if self.queued_resets >= MAX_QUEUED_RESETS {
            log::debug!("vsock: RST queue full; dropping RST for {key:?}");
            return;
        }
        self.queued_resets += 1;
        self.rxq.push_back(RxItem::Rst(key));
    }

    /// Forgets a connection and closes its host stream.
    fn remove(&mut self, key: ConnKey) {
        if let Some(conn) = self.conns.remove(&key) {
            if conn.registered {
                let _ = self.epoll.delete(&conn.stream);
            }
            self.tokens.remove(&conn.token);
            if conn.deadline.is_some() {
                self.timer_dirty = true;
            }
        }
    }

    /// Resets a connection: closes the host stream, sends the guest an RST.
    fn kill(&mut self, key: ConnKey) {
        if self.conns.contains_key(&key) {
            self.remove(key);
            self.queue_reset(key);
        }
    }

    /// After anything changed on a connection: request a credit update when due, queue it for RX when it has
    /// something to send, and make its epoll interest match what it can do now.
    fn refresh(&mut self, key: ConnKey) {
        let Some(conn) = self.conns.get_mut(&key) else { return };
        if conn.state != ConnState::LocalInit && (conn.fwd_cnt() - conn.last_fwd_cnt_sent).0 >= CREDIT_UPDATE_THRESHOLD
        {
            conn.pending |= PENDING_CREDIT_UPDATE;
        }
        // A hung-up stream is out of the epoll set: what is left in it is read whenever the guest has room.
        if !conn.registered && conn.wants_host_data() {
            conn.pending |= PENDING_RW;
        }
        if conn.pending != 0 && !conn.queued {
            conn.queued = true;
            self.rxq.push_back(RxItem::Conn(key));
        }
        if !conn.registered {
            return;
        }
        let mut want = EpollFlags::empty();
        if conn.pending & PENDING_RW == 0 && conn.wants_host_data() {
            want |= EpollFlags::EPOLLIN;
        }
        if !conn.host_line.is_empty() || conn.tx_pending() > 0 {
            want |= EpollFlags::EPOLLOUT;
        }
        if want != conn.interest {
            match self.epoll.modify(&conn.stream, &mut EpollEvent::new(want, conn.token)) {
                Ok(()) => conn.interest = want,
                Err(e) => {
                    log::warn!("vsock: cannot update epoll interest for {key:?}: {e}");
                    self.kill(key);
                }
            }
        }
    }

    fn flush(conn: &mut Connection) -> Flushed {
        while !conn.host_line.is_empty() {
            match conn.stream.write(&conn.host_line) {
                Ok(0) => return Flushed::Failed,
                Ok(n) => drop(conn.host_line.drain(..n.min(conn.host_line.len()))),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Flushed::Ok,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return Flushed::Failed,
            }
        }
        while conn.tx_pending() > 0 {
            let Some(bytes) = conn.tx_buf.get(conn.tx_head..) else { return Flushed::Failed };
            match conn.stream.write(bytes) {
                Ok(0) => return Flushed::Failed,
                Ok(n) => conn.tx_head = conn.tx_head.saturating_add(n),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Flushed::Ok,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return Flushed::Failed,
            }
        }
        conn.tx_buf.clear();
        conn.tx_head = 0;
        if conn.state == ConnState::PeerClosing {
            return Flushed::Done;
        }
        if conn.peer_shutdown & VSOCK_FLAGS_SHUTDOWN_SEND != 0 {
            let _ = conn.stream.shutdown(Shutdown::Write);
        }
        Flushed::Ok
    }

    fn flush_or_kill(&mut self, key: ConnKey) {
        let Some(conn) = self.conns.get_mut(&key) else { return };
        match VsockMuxer::flush(conn) {
            Flushed::Ok => {}
            Flushed::Done | Flushed::Failed => self.kill(key),
        }
    }

    // ---- guest → host ----

    /// Handles a packet the guest sent.
    pub(super) fn send_pkt(&mut self, pkt: &VsockPacket<'_, ()>) {
        let hdr = TxHeader::of(pkt);
        if hdr.src_cid != self.guest_cid || hdr.dst_cid != VSOCK_HOST_CID {
            log::debug!("vsock: dropping packet from CID {} to CID {}", hdr.src_cid, hdr.dst_cid);
            return;
        }
        let key = ConnKey { local_port: hdr.dst_port, peer_port: hdr.src_port };
        let op = VsockOp::from_u16(hdr.op);
        if hdr.type_ != VSOCK_TYPE_STREAM {
            if op != Some(VsockOp::Rst) {
                self.remove(key);
                self.queue_reset(key);
            }
            return;
        }
        let Some(conn) = self.conns.get_mut(&key) else {
            match op {
                Some(VsockOp::Request) => self.guest_connect(key, &hdr),
                Some(VsockOp::Rst) => {}
                _ => self.queue_reset(key),
            }
            self.rearm_timer();
            return;
        };
        conn.peer_buf_alloc = hdr.buf_alloc;
        conn.peer_fwd_cnt = Wrapping(hdr.fwd_cnt);
        match (conn.state, op) {
            (_, Some(VsockOp::Rst)) => self.remove(key),
            (ConnState::LocalInit, Some(VsockOp::Response)) => {
                conn.state = ConnState::Established;
                conn.deadline = None;
                conn.host_line = format!("OK {}\n", key.local_port).into_bytes();
                self.timer_dirty = true;
                self.flush_or_kill(key);
            }
            (ConnState::LocalInit, _) => self.kill(key),
            (ConnState::PeerClosing, Some(VsockOp::Rw)) => self.kill(key),
            (_, Some(VsockOp::Rw)) => self.guest_data(key, pkt),
            (_, Some(VsockOp::CreditUpdate)) => {}
            (_, Some(VsockOp::CreditRequest)) => conn.pending |= PENDING_CREDIT_UPDATE,
            (_, Some(VsockOp::Shutdown)) => {
                conn.peer_shutdown |= hdr.flags & (VSOCK_FLAGS_SHUTDOWN_RCV | VSOCK_FLAGS_SHUTDOWN_SEND);
                if conn.peer_shutdown == VSOCK_FLAGS_SHUTDOWN_RCV | VSOCK_FLAGS_SHUTDOWN_SEND {
                    // Full close: deliver what the host has not taken yet, then RST.
                    conn.state = ConnState::PeerClosing;
                    conn.deadline = Some(Instant::now() + CLOSE_TIMEOUT);
                    self.timer_dirty = true;
                }
                self.flush_or_kill(key);
            }
            // REQUEST or RESPONSE on an open connection, or an unknown operation.
            _ => self.kill(key),
        }
        self.refresh(key);
        self.rearm_timer();
    }

    fn guest_connect(&mut self, key: ConnKey, hdr: &TxHeader) {
        if self.conns.len() >= MAX_CONNECTIONS {
            log::debug!("vsock: connection limit reached; refusing {key:?}");
            self.queue_reset(key);
            return;
        }
        let mut path = self.uds_path.clone().into_os_string();
        path.push(format!("_{}", key.local_port));
        let stream = match connect_nonblocking(Path::new(&path)) {
            Ok(stream) => stream,
            Err(e) => {
                log::debug!("vsock: guest connection to port {} refused: {e}", key.local_port);
                self.queue_reset(key);
                return;
            }
        };
        let token = self.alloc_token();
        if let Err(e) = self.epoll.add(&stream, EpollEvent::new(EpollFlags::empty(), token)) {
            log::warn!("vsock: cannot watch connection {key:?}: {e}");
            self.queue_reset(key);
            return;
        }
        let mut conn = Connection::new(stream, token, ConnState::Established);
        conn.peer_buf_alloc = hdr.buf_alloc;
        conn.peer_fwd_cnt = Wrapping(hdr.fwd_cnt);
        conn.pending = PENDING_RESPONSE;
        self.conns.insert(key, conn);
        self.tokens.insert(token, Source::Conn(key));
        self.refresh(key);
    }

    fn guest_data(&mut self, key: ConnKey, pkt: &VsockPacket<'_, ()>) {
        let Some(data) = pkt.data_slice() else { return };
        let Some(conn) = self.conns.get_mut(&key) else { return };
        if conn.peer_shutdown & VSOCK_FLAGS_SHUTDOWN_SEND != 0 {
            self.kill(key);
            return;
        }
        let len = data.len();
        let mut written = 0;
        if conn.tx_pending() == 0 && conn.host_line.is_empty() {
            loop {
                match conn.stream.write_volatile(data) {
                    Ok(n) => written = n,
                    Err(e) if is_interrupted(&e) => continue,
                    Err(e) if is_would_block(&e) => {}
                    Err(_) => {
                        self.kill(key);
                        return;
                    }
                }
                break;
            }
        }
        if written < len {
            let rest = len - written;
            if conn.tx_pending().saturating_add(rest) > CONN_BUF_SIZE as usize {
                log::debug!("vsock: guest overran its credit on {key:?}");
                self.kill(key);
                return;
            }
            if conn.tx_head > 0 {
                conn.tx_buf.drain(..conn.tx_head.min(conn.tx_buf.len()));
                conn.tx_head = 0;
            }
            let start = conn.tx_buf.len();
            conn.tx_buf.resize(start + rest, 0);
            match (data.offset(written), conn.tx_buf.get_mut(start..)) {
                (Ok(src), Some(dst)) => {
                    src.copy_to(dst);
                }
                _ => {
                    self.kill(key);
                    return;
                }
            }
        }
        conn.rx_from_guest += Wrapping(len as u32);
    }

    // ---- host → guest ----

    /// Fills one RX buffer with the next packet for the guest; `None` when there is nothing this buffer can
    /// carry (the buffer is then left for later).
    pub(super) fn fill_rx(&mut self, pkt: &mut VsockPacket<'_, ()>) -> Option<u32> {
        let mut result = None;
        for _ in 0..self.rxq.len() {
            let Some(item) = self.rxq.pop_front() else { break };
            match item {
                RxItem::Rst(key) => {
                    self.queued_resets = self.queued_resets.saturating_sub(1);
                    result = Some(self.reset_header(key).write(pkt));
                }
                RxItem::Conn(key) => {
                    let Some(conn) = self.conns.get_mut(&key) else { continue };
                    conn.queued = false;
                    result = self.fill_from_connection(key, pkt);
                    self.refresh(key);
                }
            }
            if result.is_some() {
                break;
            }
        }
        self.rearm_timer();
        result
    }

    fn reset_header(&self, key: ConnKey) -> RxHeader {
        RxHeader {
            dst_cid: self.guest_cid,
            src_port: key.local_port,
            dst_port: key.peer_port,
            op: VsockOp::Rst,
            flags: 0,
            len: 0,
            buf_alloc: 0,
            fwd_cnt: 0,
        }
    }

    fn conn_header(guest_cid: u64, key: ConnKey, conn: &mut Connection, op: VsockOp, flags: u32, len: u32) -> RxHeader {
        let fwd_cnt = conn.fwd_cnt();
        conn.last_fwd_cnt_sent = fwd_cnt;
        conn.pending &= !PENDING_CREDIT_UPDATE;
        RxHeader {
            dst_cid: guest_cid,
            src_port: key.local_port,
            dst_port: key.peer_port,
            op,
            flags,
            len,
            buf_alloc: CONN_BUF_SIZE,
            fwd_cnt: fwd_cnt.0,
        }
    }

    fn fill_from_connection(&mut self, key: ConnKey, pkt: &mut VsockPacket<'_, ()>) -> Option<u32> {
        let guest_cid = self.guest_cid;
        let conn = self.conns.get_mut(&key)?;
        for op in [PENDING_REQUEST, PENDING_RESPONSE] {
            if conn.pending & op != 0 {
                conn.pending &= !op;
                let vsock_op = if op == PENDING_REQUEST { VsockOp::Request } else { VsockOp::Response };
                return Some(VsockMuxer::conn_header(guest_cid, key, conn, vsock_op, 0, 0).write(pkt));
            }
        }
        if conn.pending & PENDING_RW != 0
            && let Some(slice) = pkt.data_slice()
        {
            let max = (slice.len() as u64).min(u64::from(conn.peer_credit())).min(u64::from(MAX_PKT_DATA)) as usize;
            match read_host(&mut conn.stream, slice, max) {
                HostRead::Data(n) => {
                    conn.rx_cnt += Wrapping(n);
                    // A full buffer means the socket may hold more: keep reading while the guest has room.
                    if n as usize != max || !conn.wants_host_data() {
                        conn.pending &= !PENDING_RW;
                    }
                    return Some(VsockMuxer::conn_header(guest_cid, key, conn, VsockOp::Rw, 0, n).write(pkt));
                }
                HostRead::Eof => {
                    conn.pending &= !PENDING_RW;
                    conn.host_eof = true;
                    // A host that only shut its sending side still reads: the guest may go on sending. A host
                    // that hung up entirely (the stream left the epoll set) takes nothing more.
                    let mut flags = VSOCK_FLAGS_SHUTDOWN_SEND;
                    if !conn.registered {
                        flags |= VSOCK_FLAGS_SHUTDOWN_RCV;
                        conn.state = ConnState::LocalClosed;
                        conn.deadline = Some(Instant::now() + CLOSE_TIMEOUT);
                        self.timer_dirty = true;
                    }
                    return Some(VsockMuxer::conn_header(guest_cid, key, conn, VsockOp::Shutdown, flags, 0).write(pkt));
                }
                HostRead::Nothing => conn.pending &= !PENDING_RW,
                HostRead::Failed => {
                    self.remove(key);
                    return Some(self.reset_header(key).write(pkt));
                }
            }
        }
        if conn.pending & PENDING_CREDIT_UPDATE != 0 {
            return Some(VsockMuxer::conn_header(guest_cid, key, conn, VsockOp::CreditUpdate, 0, 0).write(pkt));
        }
        None
    }

    // ---- host events ----

    /// Handles whatever is ready on the host side: new connections, handshake lines, readable and writable
    /// streams, hang-ups, timeouts.
    pub(super) fn process_events(&mut self) {
        let mut events = [EpollEvent::empty(); EVENTS_PER_CALL];
        let count = match self.epoll.wait(&mut events, EpollTimeout::ZERO) {
            Ok(count) => count,
            Err(e) => {
                log::error!("vsock: epoll_wait failed: {e}");
                return;
            }
        };
        for event in events.iter().take(count) {
            match event.data() {
                TOKEN_LISTENER => self.accept(),
                TOKEN_TIMER => self.expire(),
                token => match self.tokens.get(&token).copied() {
                    Some(Source::Handshake) => self.handshake_ready(token),
                    Some(Source::Conn(key)) => self.conn_ready(key, event.events()),
                    None => {}
                },
            }
        }
        self.rearm_timer();
    }

    fn accept(&mut self) {
        for _ in 0..ACCEPTS_PER_CALL {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if self.handshakes.len() >= MAX_PENDING_HANDSHAKES || self.conns.len() >= MAX_CONNECTIONS {
                        log::warn!("vsock: too many host connections; closing a new one");
                        continue;
                    }
                    let token = self.alloc_token();
                    let watched = stream.set_nonblocking(true).is_ok()
                        && self.epoll.add(&stream, EpollEvent::new(EpollFlags::EPOLLIN, token)).is_ok();
                    if watched {
                        self.handshakes.insert(token, Handshake { stream, line: Vec::with_capacity(CONNECT_LINE_MAX) });
                        self.tokens.insert(token, Source::Handshake);
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    // Out of descriptors, most likely: rest the listener instead of spinning on it.
                    log::warn!("vsock: accept on {} failed: {e}", self.uds_path.display());
                    if self.epoll.delete(&self.listener).is_ok() {
                        self.listener_paused_until = Some(Instant::now() + ACCEPT_BACKOFF);
                        self.timer_dirty = true;
                    }
                    return;
                }
            }
        }
    }

    fn handshake_ready(&mut self, token: u64) {
        let Some(handshake) = self.handshakes.get_mut(&token) else { return };
        // One byte at a time: whatever follows the line belongs to the connection.
        let port = loop {
            let mut byte = [0u8; 1];
            match handshake.stream.read(&mut byte) {
                Ok(0) => break None,
                Ok(_) if byte == [b'\n'] => break parse_connect_line(&handshake.line),
                Ok(_) if handshake.line.len() >= CONNECT_LINE_MAX => break None,
                Ok(_) => handshake.line.extend_from_slice(&byte),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => break None,
            }
        };
        let Some(handshake) = self.handshakes.remove(&token) else { return };
        self.tokens.remove(&token);
        let Some(peer_port) = port else {
            log::debug!("vsock: bad CONNECT line {:?}", String::from_utf8_lossy(&handshake.line));
            let _ = self.epoll.delete(&handshake.stream);
            return;
        };
        let Some(local_port) = self.alloc_local_port(peer_port) else {
            let _ = self.epoll.delete(&handshake.stream);
            return;
        };
        if self.conns.len() >= MAX_CONNECTIONS
            || self.epoll.modify(&handshake.stream, &mut EpollEvent::new(EpollFlags::empty(), token)).is_err()
        {
            let _ = self.epoll.delete(&handshake.stream);
            return;
        }
        let key = ConnKey { local_port, peer_port };
        let mut conn = Connection::new(handshake.stream, token, ConnState::LocalInit);
        conn.pending = PENDING_REQUEST;
        conn.deadline = Some(Instant::now() + CONNECT_TIMEOUT);
        self.timer_dirty = true;
        self.conns.insert(key, conn);
        self.tokens.insert(token, Source::Conn(key));
        self.refresh(key);
    }

    fn alloc_local_port(&mut self, peer_port: u32) -> Option<u32> {
        for _ in 0..=MAX_CONNECTIONS {
            let port = self.next_local_port;
            self.next_local_port = port.checked_add(1).unwrap_or(LOCAL_PORT_BASE);
            if !self.conns.contains_key(&ConnKey { local_port: port, peer_port }) {
                return Some(port);
            }
        }
        None
    }

    fn conn_ready(&mut self, key: ConnKey, events: EpollFlags) {
        let Some(conn) = self.conns.get_mut(&key) else { return };
        if events.contains(EpollFlags::EPOLLERR) {
            self.kill(key);
            return;
        }
        if events.contains(EpollFlags::EPOLLOUT) {
            match VsockMuxer::flush(conn) {
                Flushed::Ok => {}
                Flushed::Done | Flushed::Failed => {
                    self.kill(key);
                    return;
                }
            }
        }
        let Some(conn) = self.conns.get_mut(&key) else { return };
        if events.contains(EpollFlags::EPOLLHUP) {
            // The host closed its end. Epoll reports a hang-up forever, so the stream leaves the set; what it
            // still holds is read as the guest makes room (see `refresh`, however long the guest takes to give
            // credit), then the guest gets SHUTDOWN. With nothing left to deliver, the connection is reset.
            let _ = self.epoll.delete(&conn.stream);
            conn.registered = false;
            conn.interest = EpollFlags::empty();
            let can_deliver = conn.state == ConnState::Established
                && !conn.host_eof
                && conn.peer_shutdown & VSOCK_FLAGS_SHUTDOWN_RCV == 0;
            if !can_deliver {
                self.kill(key);
                return;
            }
        } else if events.contains(EpollFlags::EPOLLIN) && conn.state == ConnState::Established {
            conn.pending |= PENDING_RW;
        }
        self.refresh(key);
    }

    fn expire(&mut self) {
        let _ = self.timer.wait();
        let now = Instant::now();
        let expired: Vec<ConnKey> =
            self.conns.iter().filter(|(_, c)| c.deadline.is_some_and(|d| d <= now)).map(|(k, _)| *k).collect();
        for key in expired {
            log::debug!("vsock: connection {key:?} timed out");
            self.kill(key);
        }
        if self.listener_paused_until.is_some_and(|t| t <= now)
            && self.epoll.add(&self.listener, EpollEvent::new(EpollFlags::EPOLLIN, TOKEN_LISTENER)).is_ok()
        {
            self.listener_paused_until = None;
        }
        self.timer_dirty = true;
    }

    fn rearm_timer(&mut self) {
        if !self.timer_dirty {
            return;
        }
        self.timer_dirty = false;
        let next = self.conns.values().filter_map(|c| c.deadline).chain(self.listener_paused_until).min();
        let result = match next {
            Some(at) => {
                let wait = at.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
                self.timer.set(Expiration::OneShot(TimeSpec::from(wait)), TimerSetTimeFlags::empty())
            }
            None => self.timer.unset(),
        };
        if let Err(e) = result {
            log::error!("vsock: cannot arm the connection timer: {e}");
        }
    }
}

impl Drop for VsockMuxer {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.uds_path) {
            log::debug!("vsock: cannot remove {}: {e}", self.uds_path.display());
        }
    }
}

enum HostRead {
    Data(u32),
    Eof,
    Nothing,
    Failed,
}

/// Reads up to `max` bytes from the host stream straight into the guest buffer.
fn read_host(stream: &mut UnixStream, slice: &VolatileSlice<'_, ()>, max: usize) -> HostRead {
    if max == 0 {
        return HostRead::Nothing;
    }
    let Ok(mut dst) = slice.subslice(0, max) else { return HostRead::Nothing };
    loop {
        return match stream.read_volatile(&mut dst) {
            Ok(0) => HostRead::Eof,
            Ok(n) => u32::try_from(n).map_or(HostRead::Failed, HostRead::Data),
            Err(e) if is_interrupted(&e) => continue,
            Err(e) if is_would_block(&e) => HostRead::Nothing,
            Err(_) => HostRead::Failed,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_lines() {
        assert_eq!(parse_connect_line(b"CONNECT 52"), Some(52));
        assert_eq!(parse_connect_line(b"CONNECT 52\r"), Some(52));
        assert_eq!(parse_connect_line(b"CONNECT 4294967295"), Some(u32::MAX));
        for bad in [&b"CONNECT"[..], b"CONNECT ", b"connect 5", b"CONNECT -1", b"CONNECT 4294967296", b"\xff"] {
            assert_eq!(parse_connect_line(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn credit_arithmetic_wraps_and_never_underflows() {
        let (a, _b) = UnixStream::pair().expect("pair");
        let mut conn = Connection::new(a, 9, ConnState::Established);
        conn.peer_buf_alloc = 1000;
        conn.rx_cnt = Wrapping(u32::MAX - 10);
        conn.peer_fwd_cnt = Wrapping(u32::MAX - 100);
        assert_eq!(conn.peer_credit(), 910);
        // A guest claiming to have consumed more than it was sent has no credit at all.
        conn.peer_fwd_cnt = Wrapping(5);
        assert_eq!(conn.peer_credit(), 0);
        conn.rx_from_guest = Wrapping(3);
        conn.tx_buf = vec![0; 10];
        assert_eq!(conn.fwd_cnt(), Wrapping(3u32.wrapping_sub(10)));
    }

    #[test]
    fn socket_file_is_removed_on_drop() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("v.sock");
        let muxer = VsockMuxer::new(3, path.clone()).expect("muxer");
        assert!(path.exists());
        assert!(matches!(VsockMuxer::new(3, path.clone()), Err(MuxerError::Bind { .. })));
        drop(muxer);
        assert!(!path.exists());
    }
}
