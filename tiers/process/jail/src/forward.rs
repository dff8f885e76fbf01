//! The jail's egress forwarder: TCP on the jail's `127.0.0.1:3128` relayed to the host egress proxy's Unix socket,
//! bind-mounted at [`GUEST_SOCKET`].
//!
//! It lives in PID 1's event loop (no thread: PID 1 forks jobs and must stay single-threaded; no process of its
//! own: a job could kill it, and `HostFrame::Kill` would). Everything is non-blocking; each connection has one
//! bounded buffer per direction, read only when empty, so a slow side stalls its peer instead of growing memory.
//! A half-close is relayed (`shutdown(SHUT_WR)` on the other side); an error on either side closes both. At most
//! [`MAX_CONNECTIONS`] connections are relayed at once; more wait in the listen backlog.
//!
//! PID 1 runs under the jail's seccomp filter like every job; what this needs (`socket`, `bind`, `listen`,
//! `accept4`, `connect`, `shutdown`, `poll`) is in the allowlist.

use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use nix::poll::{PollFd, PollFlags};

/// Where the egress proxy's socket is bound in the jail.
pub const GUEST_SOCKET: &str = "/run/strata/egress.sock";

/// The forwarder's address in the jail's network namespace: jobs get `HTTP_PROXY=http://127.0.0.1:3128`.
pub const LISTEN: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 3128);

/// Connections relayed at once.
pub const MAX_CONNECTIONS: usize = 64;

/// Buffer per direction per connection (allocated lazily by the kernel: pages a connection never fills cost
/// nothing). 256 KiB relays a 512 MiB download at ~0.9–1.3 GB/s on 2 cores (64 KiB: ~0.55 GB/s).
const BUFFER: usize = 256 * 1024;

/// The listener and the connections being relayed.
#[derive(Debug)]
pub struct Forwarder {
    listener: TcpListener,
    socket: PathBuf,
    relays: Vec<Relay>,
}

/// One direction of a connection.
#[derive(Debug)]
struct Pipe {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// The source reached end of file.
    eof: bool,
    /// The end of file was passed on (`shutdown(SHUT_WR)` of the destination).
    done: bool,
}

#[derive(Debug)]
struct Relay {
    tcp: TcpStream,
    unix: UnixStream,
    /// Job → proxy.
    up: Pipe,
    /// Proxy → job.
    down: Pipe,
}

impl Forwarder {
    /// Listens on [`LISTEN`] (the jail's loopback must be up) and forwards to the Unix socket at `socket`.
    pub fn bind(socket: impl Into<PathBuf>) -> std::io::Result<Forwarder> {
        let listener = TcpListener::bind(LISTEN)?;
        listener.set_nonblocking(true)?;
        Ok(Forwarder { listener, socket: socket.into(), relays: Vec::new() })
    }

    /// Connections being relayed.
    pub fn connections(&self) -> usize {
        self.relays.len()
    }

    /// The descriptors to poll and what for, appended to `fds`.
    pub fn poll_fds<'a>(&'a self, fds: &mut Vec<PollFd<'a>>) {
        if self.relays.len() < MAX_CONNECTIONS {
            fds.push(PollFd::new(self.listener.as_fd(), PollFlags::POLLIN));
        }
        for relay in &self.relays {
            let (tcp, unix) = relay.interest();
            fds.push(PollFd::new(relay.tcp.as_fd(), tcp));
            fds.push(PollFd::new(relay.unix.as_fd(), unix));
        }
    }

    /// Moves every connection's bytes as far as they go without blocking, drops the connections that are
    /// finished or failed, and accepts what is waiting. `revents` are the returned events of the descriptors
    /// [`Forwarder::poll_fds`] gave, in that order.
    pub fn pump(&mut self, revents: &[PollFlags]) {
        let listening = usize::from(self.relays.len() < MAX_CONNECTIONS);
        let mut events = revents.get(listening..).unwrap_or_default().chunks(2);
        self.relays.retain_mut(|relay| {
            let (tcp, unix) = match events.next() {
                Some([tcp, unix]) => (*tcp, *unix),
                _ => (PollFlags::empty(), PollFlags::empty()),
            };
            relay.pump(tcp, unix).unwrap_or(false)
        });
        while self.relays.len() < MAX_CONNECTIONS {
            match self.listener.accept() {
                Ok((tcp, _)) => {
                    if let Some(relay) = self.open(tcp) {
                        self.relays.push(relay);
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                // WouldBlock, or an error of one pending connection (ECONNABORTED): try again on the next wakeup.
                Err(_) => break,
            }
        }
    }

    fn open(&self, tcp: TcpStream) -> Option<Relay> {
        let mut relay = Relay::new(tcp, UnixStream::connect(&self.socket).ok()?)?;
        // Whatever the job already sent goes at once.
        relay.pump(PollFlags::empty(), PollFlags::empty()).ok()?.then_some(relay)
    }
}

impl Relay {
    fn new(tcp: TcpStream, unix: UnixStream) -> Option<Relay> {
        // The connect to a local socket (in `open`) completes or fails at once (a full backlog fails with
        // EAGAIN): the proxy accepts continuously.
        tcp.set_nonblocking(true).ok()?;
        unix.set_nonblocking(true).ok()?;
        let _ = tcp.set_nodelay(true);
        Some(Relay { tcp, unix, up: Pipe::new(), down: Pipe::new() })
    }
}

impl Pipe {
    fn new() -> Pipe {
        Pipe { buf: vec![0; BUFFER].into_boxed_slice(), start: 0, end: 0, eof: false, done: false }
    }

    fn has_data(&self) -> bool {
        self.start < self.end
    }

    fn wants_input(&self) -> bool {
        !self.has_data() && !self.eof
    }

    /// Moves bytes from `src` to `dst` until one would block; `shut` half-closes `dst`. Errors end the connection.
    fn pump(
        &mut self,
        mut src: impl Read,
        mut dst: impl Write,
        shut: impl FnOnce() -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        loop {
            if self.has_data() {
                match dst.write(&self.buf[self.start..self.end]) {
                    Ok(0) => return Err(ErrorKind::WriteZero.into()),
                    Ok(n) => self.start += n,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
                continue;
            }
            (self.start, self.end) = (0, 0);
            if self.eof {
                if !self.done {
                    self.done = true;
                    // The peer may already be gone; the other direction then ends with its own error or EOF.
                    let _ = shut();
                }
                return Ok(());
            }
            match src.read(&mut self.buf) {
                Ok(0) => self.eof = true,
                Ok(n) => self.end = n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
}

impl Relay {
    /// Poll flags for the TCP side and the Unix side.
    fn interest(&self) -> (PollFlags, PollFlags) {
        let flags = |read: bool, write: bool| {
            let mut f = PollFlags::empty();
            if read {
                f |= PollFlags::POLLIN;
            }
            if write {
                f |= PollFlags::POLLOUT;
            }
            f
        };
        (flags(self.up.wants_input(), self.down.has_data()), flags(self.down.wants_input(), self.up.has_data()))
    }

    /// Moves bytes both ways, given what poll returned for each side. Returns whether the connection is still
    /// open.
    ///
    /// Poll reports an error or a hang-up whether asked or not, so a side in either state must end the
    /// connection, or PID 1 would spin: an error (a reset) on either side ends it; a hang-up (both directions
    /// shut) ends it once that side's end of file has been passed on, since nothing can be delivered to it.
    fn pump(&mut self, tcp_events: PollFlags, unix_events: PollFlags) -> std::io::Result<bool> {
        let (tcp, unix) = (&self.tcp, &self.unix);
        self.up.pump(tcp, unix, || unix.shutdown(Shutdown::Write))?;
        self.down.pump(unix, tcp, || tcp.shutdown(Shutdown::Write))?;
        let failed = PollFlags::POLLERR | PollFlags::POLLNVAL;
        if tcp_events.intersects(failed) || unix_events.intersects(failed) {
            return Ok(false);
        }
        let hung_up = (tcp_events.contains(PollFlags::POLLHUP) && self.up.done)
            || (unix_events.contains(PollFlags::POLLHUP) && self.down.done);
        let finished = self.up.done && self.down.done;
        Ok(!(hung_up || finished))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn pipe_relays_then_half_closes() {
        let (a, mut a_peer) = UnixStream::pair().unwrap();
        let (b, mut b_peer) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        b.set_nonblocking(true).unwrap();
        a_peer.write_all(b"hello").unwrap();
        a_peer.shutdown(Shutdown::Write).unwrap();
        let mut pipe = Pipe::new();
        pipe.pump(&a, &b, || b.shutdown(Shutdown::Write)).unwrap();
        assert!(pipe.done);
        let mut got = Vec::new();
        b_peer.read_to_end(&mut got).unwrap();
        assert_eq!(got, b"hello");
    }

    #[test]
    fn a_relay_whose_proxy_side_hung_up_ends_even_if_the_job_keeps_its_socket() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let job = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (tcp, _) = listener.accept().unwrap();
        let (unix, mut proxy) = UnixStream::pair().unwrap();
        let mut relay = Relay::new(tcp, unix).unwrap();
        proxy.write_all(b"response").unwrap();
        drop(proxy);
        // The response and its end of file go to the job; the job's side stays open. (The end of file may come
        // late: a test beside this one that forks holds a copy of `proxy` until its child exits.)
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !relay.down.done {
            assert!(relay.pump(PollFlags::empty(), PollFlags::POLLIN).unwrap());
            assert!(std::time::Instant::now() < deadline, "the proxy side's end of file never came");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(!relay.up.done);
        assert!(!relay.pump(PollFlags::empty(), PollFlags::POLLHUP).unwrap());
        let mut got = Vec::new();
        (&job).read_to_end(&mut got).unwrap();
        assert_eq!(got, b"response");
    }
}
