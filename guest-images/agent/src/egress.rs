//! The egress forwarder ([`strata_guest_proto::HostMessage::StartEgress`]): a guest has no NIC; jobs with network
//! reach the host egress proxy through this.
//!
//! It listens on the guest's `127.0.0.1:<listen_port>` (jobs get `HTTP(S)_PROXY=http://127.0.0.1:3128`) and, for
//! each accepted TCP connection, opens a new stream to the host ([`EgressDial`]: AF_VSOCK to the host's egress
//! port in a guest, which the vsock device hands to the proxy's Unix socket `<uds>_<port>`; the Unix socket
//! `<agent socket>_<port>` when the agent runs as a host process) and relays bytes both ways until both sides
//! are done. The forwarder sees no HTTP: the host proxy judges every request (allowlist, SNI, records).
//!
//! Each connection has two threads (one per direction, blocking I/O, a [`BUFFER`]-byte buffer each); a half-close
//! is passed on (`shutdown(SHUT_WR)` of the other side), an error closes both. At most `max_connections` relay at
//! once: a client beyond that gets `503 Service Unavailable` and is closed at once (the host proxy caps its own
//! connections too: a guest that bypasses this forwarder gains nothing). [`Forwarder::stop`] (or dropping it)
//! closes the listener and every connection and joins every thread: nothing listens after the agent's
//! connection ends.

use std::io::{self, ErrorKind, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use strata_guest_proto::transport::VMADDR_CID_HOST;
use strata_guest_proto::{MAX_EGRESS_CONNECTIONS, MAX_PORT_CONNECTIONS, PORT_CLOSED, Transport, VsockStream};

/// Relay buffer per direction per connection.
pub const BUFFER: usize = 64 * 1024;

/// Stack of a relay thread (its buffer is on the heap).
const RELAY_STACK: usize = 64 * 1024;

/// What a client beyond the connection cap gets.
const BUSY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";

/// How the forwarder reaches the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EgressDial {
    /// AF_VSOCK to the host (CID 2) at the port the host names (in a guest).
    Vsock,
    /// The Unix socket `<prefix>_<port>` (the agent run as a host process over the Unix socket `prefix`), as the
    /// vsock device names the host side of a guest's connection to `port`.
    Unix(PathBuf),
}

/// The host end of one tunnelled connection.
enum Upstream {
    Vsock(VsockStream),
    Unix(UnixStream),
}

impl EgressDial {
    fn connect(&self, port: u32) -> io::Result<Upstream> {
        match self {
            EgressDial::Vsock => VsockStream::connect(VMADDR_CID_HOST, port).map(Upstream::Vsock),
            EgressDial::Unix(prefix) => {
                let mut path = prefix.clone().into_os_string();
                path.push(format!("_{port}"));
                UnixStream::connect(path).map(Upstream::Unix)
            }
        }
    }
}

impl Upstream {
    fn try_clone(&self) -> io::Result<Upstream> {
        Ok(match self {
            Upstream::Vsock(s) => Upstream::Vsock(Transport::try_clone(s)?),
            Upstream::Unix(s) => Upstream::Unix(s.try_clone()?),
        })
    }

    fn raw_fd(&self) -> RawFd {
        match self {
            Upstream::Vsock(s) => s.as_raw_fd(),
            Upstream::Unix(s) => s.as_raw_fd(),
        }
    }
}

impl Read for Upstream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Upstream::Vsock(s) => s.read(buf),
            Upstream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Upstream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Upstream::Vsock(s) => s.write(buf),
            Upstream::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Shuts down one or both directions of a socket the relay holds a handle on.
fn shutdown(fd: RawFd, how: nix::sys::socket::Shutdown) {
    let _ = nix::sys::socket::shutdown(fd, how);
}

/// Why the forwarder could not start.
#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    /// A setting is out of range.
    #[error("egress forwarder setting {what} = {value} is out of range")]
    Setting {
        /// Which.
        what: &'static str,
        /// Its value.
        value: u64,
    },
    /// The listener could not be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address.
        addr: SocketAddrV4,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The accept thread could not be started.
    #[error("starting the egress forwarder's thread failed")]
    Thread(#[source] io::Error),
}

/// A live connection as [`Forwarder::stop`] sees it: handles to shut down.
struct Live {
    tcp: TcpStream,
    /// A handle of its own (never a bare descriptor number, which could be reused once the relay closes it).
    upstream: Option<Upstream>,
}

#[derive(Default)]
struct State {
    live: std::collections::HashMap<u64, Live>,
    threads: Vec<JoinHandle<()>>,
}

struct Shared {
    dial: EgressDial,
    host_port: u32,
    max_connections: usize,
    stopping: AtomicBool,
    next: AtomicU64,
    refused: AtomicU64,
    state: Mutex<State>,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The running forwarder.
pub struct Forwarder {
    shared: Arc<Shared>,
    listener: TcpListener,
    addr: SocketAddrV4,
    accept: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Forwarder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forwarder").field("addr", &self.addr).finish_non_exhaustive()
    }
}

impl Forwarder {
    /// Listens on `127.0.0.1:listen_port` and tunnels each connection to the host's `host_port` through `dial`.
    pub fn start(
        dial: EgressDial,
        listen_port: u16,
        host_port: u32,
        max_connections: u32,
    ) -> Result<Forwarder, EgressError> {
        if listen_port == 0 {
            return Err(EgressError::Setting { what: "listen_port", value: 0 });
        }
        if max_connections == 0 || max_connections > MAX_EGRESS_CONNECTIONS {
            return Err(EgressError::Setting { what: "max_connections", value: max_connections.into() });
        }
        let addr = SocketAddrV4::new(Ipv4Addr::LOCALHOST, listen_port);
        let listener = TcpListener::bind(addr).map_err(|source| EgressError::Bind { addr, source })?;
        let shared = Arc::new(Shared {
            dial,
            host_port,
            max_connections: max_connections as usize,
            stopping: AtomicBool::new(false),
            next: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            state: Mutex::new(State::default()),
        });
        let accepting = listener.try_clone().map_err(EgressError::Thread)?;
        let thread_shared = Arc::clone(&shared);
        let accept = std::thread::Builder::new()
            .name("egress-accept".into())
            .spawn(move || accept_loop(&thread_shared, &accepting))
            .map_err(EgressError::Thread)?;
        Ok(Forwarder { shared, listener, addr, accept: Some(accept) })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddrV4 {
        self.addr
    }

    /// Connections refused so far because [`Forwarder::start`]'s `max_connections` were open.
    pub fn refused(&self) -> u64 {
        self.shared.refused.load(Ordering::Relaxed)
    }

    /// Closes the listener and every connection, and joins every thread.
    pub fn stop(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        let Some(accept) = self.accept.take() else { return };
        self.shared.stopping.store(true, Ordering::SeqCst);
        // Wakes the accept thread: accept(2) on a shut-down listener fails at once.
        shutdown(self.listener.as_raw_fd(), nix::sys::socket::Shutdown::Both);
        let _ = accept.join();
        shut_down_all(&self.shared.state);
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.stop_now();
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener) {
    loop {
        let accepted = listener.accept();
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        let client = match accepted {
            Ok((client, _)) => client,
            Err(e) if e.kind() == ErrorKind::Interrupted || e.kind() == ErrorKind::ConnectionAborted => continue,
            Err(_) => {
                // Out of descriptors or memory, most likely: rest instead of spinning.
                std::thread::sleep(std::time::Duration::from_millis(50));
                continue;
            }
        };
        let mut state = shared.state();
        state.threads.retain(|t| !t.is_finished());
        if state.live.len() >= shared.max_connections {
            drop(state);
            shared.refused.fetch_add(1, Ordering::Relaxed);
            refuse(client);
            continue;
        }
        let id = shared.next.fetch_add(1, Ordering::Relaxed);
        let Ok(handle) = client.try_clone() else { continue };
        state.live.insert(id, Live { tcp: handle, upstream: None });
        let thread_shared = Arc::clone(shared);
        let spawned = std::thread::Builder::new()
            .name("egress-up".into())
            .stack_size(RELAY_STACK)
            .spawn(move || tunnel(&thread_shared, id, client));
        match spawned {
            Ok(thread) => state.threads.push(thread),
            Err(_) => drop(state.live.remove(&id)),
        }
    }
}

/// A typed refusal: `503`, then close.
fn refuse(mut client: TcpStream) {
    let _ = client.set_nonblocking(true);
    let _ = client.write_all(BUSY);
    let _ = client.shutdown(Shutdown::Both);
}

/// One connection: dial the host, relay both ways, forget the connection.
fn tunnel(shared: &Arc<Shared>, id: u64, client: TcpStream) {
    relay(shared, id, client);
    shared.state().live.remove(&id);
}

fn relay(shared: &Arc<Shared>, id: u64, mut client: TcpStream) {
    let Ok(upstream) = shared.dial.connect(shared.host_port) else {
        let _ = client.write_all(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        return;
    };
    let (Ok(mut down_client), Ok(mut down_upstream), Ok(watched)) =
        (client.try_clone(), upstream.try_clone(), upstream.try_clone())
    else {
        return;
    };
    let mut up_upstream = upstream;
    {
        let mut state = shared.state();
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        match state.live.get_mut(&id) {
            Some(live) => live.upstream = Some(watched),
            None => return,
        }
    }
    let down = std::thread::Builder::new()
        .name("egress-down".into())
        .stack_size(RELAY_STACK)
        .spawn(move || copy(&mut down_upstream, &mut down_client, |c| c.shutdown(Shutdown::Write)));
    let Ok(down) = down else { return };
    copy(&mut client, &mut up_upstream, |u| {
        shutdown(u.raw_fd(), nix::sys::socket::Shutdown::Write);
        Ok(())
    });
    let _ = down.join();
}

/// The connections the host opened to the guest's TCP servers ([`strata_guest_proto::HostMessage::OpenPort`]): the
/// reverse of the forwarder. Each connects to the guest's `127.0.0.1:<port>`, dials the host's vsock port named for
/// it, and relays the two (two threads, as the forwarder's connections) until either side ends; at most
/// [`MAX_PORT_CONNECTIONS`] at once. [`PortRelays::stop`] shuts every one down and joins its threads.
pub struct PortRelays {
    dial: EgressDial,
    state: Arc<Mutex<State>>,
    next: AtomicU64,
}

impl std::fmt::Debug for PortRelays {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PortRelays").finish_non_exhaustive()
    }
}

/// Why a port could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum PortError {
    /// Nothing accepts on the guest's `127.0.0.1:<port>`.
    #[error("{PORT_CLOSED}: nothing accepts on 127.0.0.1:{port} ({source})")]
    Closed {
        /// The port.
        port: u16,
        /// The connect error.
        #[source]
        source: io::Error,
    },
    /// [`MAX_PORT_CONNECTIONS`] are open.
    #[error("{MAX_PORT_CONNECTIONS} port connections are open already")]
    Busy,
    /// The host's end could not be reached, or a relay thread not started.
    #[error("relaying to the host's port {host_port}")]
    Host {
        /// The host's vsock port.
        host_port: u32,
        /// The error.
        #[source]
        source: io::Error,
    },
}

/// How long connecting to a guest server may take.
const PORT_CONNECT: std::time::Duration = std::time::Duration::from_secs(5);

impl PortRelays {
    /// Relays that dial the host through `dial`.
    pub fn new(dial: EgressDial) -> PortRelays {
        PortRelays { dial, state: Arc::new(Mutex::new(State::default())), next: AtomicU64::new(0) }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Connects to the guest's `127.0.0.1:port`, then to the host's `host_port`, and relays them.
    pub fn open(&self, port: u16, host_port: u32) -> Result<(), PortError> {
        {
            let mut state = self.state();
            state.threads.retain(|thread| !thread.is_finished());
            if state.live.len() >= MAX_PORT_CONNECTIONS {
                return Err(PortError::Busy);
            }
        }
        let addr = std::net::SocketAddr::from(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port));
        let guest =
            TcpStream::connect_timeout(&addr, PORT_CONNECT).map_err(|source| PortError::Closed { port, source })?;
        let host_err = |source| PortError::Host { host_port, source };
        let host = self.dial.connect(host_port).map_err(host_err)?;
        let (mut down_guest, mut down_host) =
            (guest.try_clone().map_err(host_err)?, host.try_clone().map_err(host_err)?);
        let (watched_guest, watched_host) = (guest.try_clone().map_err(host_err)?, host.try_clone().map_err(host_err)?);
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let state = Arc::clone(&self.state);
        let (mut up_guest, mut up_host) = (guest, host);
        let relay = std::thread::Builder::new().name("port-relay".into()).stack_size(RELAY_STACK).spawn(move || {
            let down = std::thread::Builder::new().name("port-down".into()).stack_size(RELAY_STACK).spawn(move || {
                copy(&mut down_guest, &mut down_host, |h| {
                    shutdown(h.raw_fd(), nix::sys::socket::Shutdown::Write);
                    Ok(())
                })
            });
            copy(&mut up_host, &mut up_guest, |g| g.shutdown(Shutdown::Write));
            if let Ok(down) = down {
                let _ = down.join();
            }
            state.lock().unwrap_or_else(PoisonError::into_inner).live.remove(&id);
        });
        let mut state = self.state();
        state.live.insert(id, Live { tcp: watched_guest, upstream: Some(watched_host) });
        match relay {
            Ok(thread) => {
                state.threads.push(thread);
                Ok(())
            }
            Err(source) => {
                if let Some(live) = state.live.remove(&id) {
                    let _ = live.tcp.shutdown(Shutdown::Both);
                }
                Err(PortError::Host { host_port, source })
            }
        }
    }

    /// Shuts every connection down and joins its threads.
    pub fn stop(&self) {
        shut_down_all(&self.state);
    }
}

/// Shuts down both ends of every live connection in `state` and joins the threads relaying them (outside the lock,
/// which a finishing relay takes to forget its connection).
fn shut_down_all(state: &Mutex<State>) {
    let threads = {
        let mut state = state.lock().unwrap_or_else(PoisonError::into_inner);
        for live in state.live.values() {
            let _ = live.tcp.shutdown(Shutdown::Both);
            if let Some(upstream) = &live.upstream {
                shutdown(upstream.raw_fd(), nix::sys::socket::Shutdown::Both);
            }
        }
        std::mem::take(&mut state.threads)
    };
    for thread in threads {
        let _ = thread.join();
    }
}

/// Copies `from` to `to` until end of file (then `close_write(to)`) or an error (then both are shut down).
fn copy<R: Read + AsRawFdish, W: Write + AsRawFdish>(
    from: &mut R,
    to: &mut W,
    close_write: impl FnOnce(&mut W) -> io::Result<()>,
) {
    let mut buf = vec![0u8; BUFFER];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => {
                let _ = close_write(to);
                return;
            }
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        if to.write_all(buf.get(..n).unwrap_or_default()).is_err() {
            break;
        }
    }
    shutdown(from.fd(), nix::sys::socket::Shutdown::Both);
    shutdown(to.fd(), nix::sys::socket::Shutdown::Both);
}

/// A socket whose descriptor the relay can shut down.
trait AsRawFdish {
    fn fd(&self) -> RawFd;
}

impl AsRawFdish for TcpStream {
    fn fd(&self) -> RawFd {
        self.as_raw_fd()
    }
}

impl AsRawFdish for Upstream {
    fn fd(&self) -> RawFd {
        self.raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
    }

    #[test]
    fn bad_settings_are_refused() {
        let dial = EgressDial::Unix("/nonexistent".into());
        assert!(matches!(Forwarder::start(dial.clone(), 0, 1028, 4), Err(EgressError::Setting { .. })));
        assert!(matches!(Forwarder::start(dial.clone(), free_port(), 1028, 0), Err(EgressError::Setting { .. })));
        assert!(matches!(
            Forwarder::start(dial, free_port(), 1028, MAX_EGRESS_CONNECTIONS + 1),
            Err(EgressError::Setting { .. })
        ));
    }

    #[test]
    fn relays_both_ways_and_stops_listening() {
        let dir = tempfile::tempdir().expect("tempdir");
        let prefix = dir.path().join("agent.sock");
        let host = UnixListener::bind(dir.path().join("agent.sock_1028")).expect("bind");
        let port = free_port();
        let forwarder = Forwarder::start(EgressDial::Unix(prefix), port, 1028, 2).expect("start");
        let echo = std::thread::spawn(move || {
            let (mut s, _) = host.accept().expect("accept");
            let mut got = Vec::new();
            s.read_to_end(&mut got).expect("read");
            s.write_all(&got).expect("echo");
        });
        let mut c = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        c.write_all(b"hello through the tunnel").expect("write");
        c.shutdown(Shutdown::Write).expect("half close");
        let mut back = Vec::new();
        c.read_to_end(&mut back).expect("read back");
        assert_eq!(back, b"hello through the tunnel");
        echo.join().expect("echo");
        forwarder.stop();
        assert!(TcpStream::connect(("127.0.0.1", port)).is_err(), "still listening after stop");
    }

    #[test]
    fn beyond_the_cap_a_client_gets_503() {
        let dir = tempfile::tempdir().expect("tempdir");
        let prefix = dir.path().join("a.sock");
        let host = UnixListener::bind(dir.path().join("a.sock_7")).expect("bind");
        let port = free_port();
        let forwarder = Forwarder::start(EgressDial::Unix(prefix), port, 7, 1).expect("start");
        let first = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        let (_held, _) = host.accept().expect("the first is tunnelled");
        let mut second = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        let mut answer = String::new();
        second.read_to_string(&mut answer).expect("read");
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        assert_eq!(forwarder.refused(), 1);
        drop(first);
        forwarder.stop();
    }
}
