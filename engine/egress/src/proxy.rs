//! The proxy itself: listeners, the per-connection state machine, the relay, shutdown.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixListener};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot};
use tokio::task::JoinSet;

use crate::allow::{Allowlist, Host};
use crate::http::{RequestHead, head_end, parse_head};
use crate::record::{EgressKind, EgressLog, EgressRecord, EgressVerdict};
use crate::secrets::{EgressSecrets, SecretUse};
use crate::sni::{ClientHelloParse, HANDSHAKE_RECORD, MAX_CLIENT_HELLO, parse_client_hello};

/// Relay buffer per direction per connection.
const RELAY_BUFFER: usize = 64 * 1024;

/// How the proxy listens and what it allows. Build with [`EgressConfig::new`] and the `with_*` methods; every
/// default is documented on its field.
#[derive(Debug, Clone)]
pub struct EgressConfig {
    /// What may be reached. Default: nothing.
    pub allowlist: Allowlist,
    /// Listen on this Unix socket path (created by `start`, removed when the handle is dropped; it must not
    /// exist). Default: none.
    pub unix_socket: Option<PathBuf>,
    /// Listen on this TCP address (`127.0.0.1:0` picks a free port). Default: none.
    pub tcp: Option<SocketAddr>,
    /// Client connections served at once; more are closed at accept with a `503`. Default: 256.
    pub max_connections: usize,
    /// Largest request head accepted; a larger one gets `431`. Default: 16 KiB.
    pub max_header_bytes: usize,
    /// A connection with no bytes moving in either direction for this long is closed (also bounds the time to
    /// send a request head). Default: 60 s.
    pub idle_timeout: Duration,
    /// Bound on resolving and connecting to an origin. Default: 10 s.
    pub connect_timeout: Duration,
    /// Records kept until drained; further ones are counted in [`EgressHandle::records_dropped`]. Default: 10 000.
    pub max_records: usize,
    /// Threads serving connections (1: a single-threaded runtime). Default: 1.
    pub worker_threads: usize,
    /// Secrets put into the headers of plain-HTTP requests to the hosts each is bound to. Default: none.
    pub secrets: EgressSecrets,
}

impl EgressConfig {
    /// A config with the defaults documented on each field and this allowlist; add at least one listener.
    pub fn new(allowlist: Allowlist) -> EgressConfig {
        EgressConfig {
            allowlist,
            unix_socket: None,
            tcp: None,
            max_connections: 256,
            max_header_bytes: 16 * 1024,
            idle_timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(10),
            max_records: 10_000,
            worker_threads: 1,
            secrets: EgressSecrets::default(),
        }
    }

    /// Sets [`EgressConfig::secrets`].
    pub fn with_secrets(mut self, secrets: EgressSecrets) -> Self {
        self.secrets = secrets;
        self
    }

    /// Also listen on this Unix socket path.
    pub fn with_unix_socket(mut self, path: impl Into<PathBuf>) -> Self {
        self.unix_socket = Some(path.into());
        self
    }

    /// Also listen on this TCP address.
    pub fn with_tcp(mut self, addr: SocketAddr) -> Self {
        self.tcp = Some(addr);
        self
    }

    /// Sets [`EgressConfig::max_connections`].
    pub fn with_max_connections(mut self, n: usize) -> Self {
        self.max_connections = n;
        self
    }

    /// Sets [`EgressConfig::max_header_bytes`].
    pub fn with_max_header_bytes(mut self, n: usize) -> Self {
        self.max_header_bytes = n;
        self
    }

    /// Sets [`EgressConfig::idle_timeout`].
    pub fn with_idle_timeout(mut self, d: Duration) -> Self {
        self.idle_timeout = d;
        self
    }

    /// Sets [`EgressConfig::connect_timeout`].
    pub fn with_connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }

    /// Sets [`EgressConfig::worker_threads`].
    pub fn with_worker_threads(mut self, n: usize) -> Self {
        self.worker_threads = n;
        self
    }
}

/// Why the proxy could not start.
#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    /// Neither a Unix socket nor a TCP address was configured.
    #[error("the egress proxy needs a Unix socket path or a TCP address to listen on")]
    NoListener,
    /// A limit is zero.
    #[error("egress proxy setting {0} must be above zero")]
    ZeroLimit(&'static str),
    /// The Unix socket path already exists.
    #[error("egress proxy socket {0} already exists")]
    SocketExists(PathBuf),
    /// Binding the Unix socket failed.
    #[error("cannot listen on egress proxy socket {path}")]
    BindUnix {
        /// The path.
        path: PathBuf,
        /// The failure.
        #[source]
        source: io::Error,
    },
    /// Binding the TCP address failed.
    #[error("cannot listen on egress proxy address {addr}")]
    BindTcp {
        /// The address.
        addr: SocketAddr,
        /// The failure.
        #[source]
        source: io::Error,
    },
    /// The runtime or its thread could not be created.
    #[error("cannot start the egress proxy's runtime")]
    Runtime(#[source] io::Error),
}

/// Entry point: see [`EgressProxy::start`].
#[derive(Debug)]
pub struct EgressProxy;

/// State every connection task shares.
#[derive(Debug)]
struct Shared {
    /// Replaced while the proxy runs ([`AllowlistSwitch`]); each connection checks the one in force when it comes.
    allowlist: std::sync::RwLock<Arc<Allowlist>>,
    max_header_bytes: usize,
    idle_timeout: Duration,
    connect_timeout: Duration,
    max_connections: usize,
    permits: Arc<Semaphore>,
    log: Mutex<EgressLog>,
    secrets: EgressSecrets,
}

impl Shared {
    fn log(&self) -> MutexGuard<'_, EgressLog> {
        // A panic while holding the lock leaves a Vec that is still valid.
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn allowlist(&self) -> Arc<Allowlist> {
        self.allowlist.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn in_flight(&self) -> usize {
        self.max_connections.saturating_sub(self.permits.available_permits())
    }
}

impl EgressProxy {
    /// Binds the configured listeners and starts serving on a thread of its own (`strata-egress`, with its own
    /// tokio runtime, so callers need no runtime and may drop the handle anywhere).
    ///
    /// Dropping the returned handle stops the proxy: the listeners close, every connection is cancelled (and
    /// recorded with the bytes it moved), the runtime's threads are joined and the Unix socket file is removed.
    pub fn start(config: EgressConfig) -> Result<EgressHandle, EgressError> {
        if config.unix_socket.is_none() && config.tcp.is_none() {
            return Err(EgressError::NoListener);
        }
        for (name, v) in [
            ("max_connections", config.max_connections),
            ("max_header_bytes", config.max_header_bytes),
            ("worker_threads", config.worker_threads),
            ("max_records", config.max_records),
        ] {
            if v == 0 {
                return Err(EgressError::ZeroLimit(name));
            }
        }
        let runtime = if config.worker_threads == 1 {
            tokio::runtime::Builder::new_current_thread()
        } else {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(config.worker_threads);
            b
        }
        .enable_io()
        .enable_time()
        .max_blocking_threads(4)
        .thread_name("strata-egress")
        .build()
        .map_err(EgressError::Runtime)?;

        let (tcp, tcp_addr) = match config.tcp {
            None => (None, None),
            Some(addr) => {
                let bind = |source| EgressError::BindTcp { addr, source };
                let l = std::net::TcpListener::bind(addr).map_err(bind)?;
                l.set_nonblocking(true).map_err(bind)?;
                let local = l.local_addr().map_err(bind)?;
                let _enter = runtime.enter();
                (Some(TcpListener::from_std(l).map_err(bind)?), Some(local))
            }
        };
        let unix = match &config.unix_socket {
            None => None,
            Some(path) => {
                if path.symlink_metadata().is_ok() {
                    return Err(EgressError::SocketExists(path.clone()));
                }
                let bind = |source| EgressError::BindUnix { path: path.clone(), source };
                let l = std::os::unix::net::UnixListener::bind(path).map_err(bind)?;
                let converted = l.set_nonblocking(true).and_then(|()| {
                    let _enter = runtime.enter();
                    UnixListener::from_std(l)
                });
                match converted {
                    Ok(l) => Some(l),
                    Err(e) => {
                        let _ = std::fs::remove_file(path);
                        return Err(bind(e));
                    }
                }
            }
        };

        let shared = Arc::new(Shared {
            allowlist: std::sync::RwLock::new(Arc::new(config.allowlist)),
            max_header_bytes: config.max_header_bytes,
            idle_timeout: config.idle_timeout,
            connect_timeout: config.connect_timeout,
            max_connections: config.max_connections,
            permits: Arc::new(Semaphore::new(config.max_connections)),
            log: Mutex::new(EgressLog { records: Vec::new(), dropped: 0, cap: config.max_records }),
            secrets: config.secrets,
        });
        let (stop_tx, stop_rx) = oneshot::channel();
        let serve_shared = shared.clone();
        let spawned = std::thread::Builder::new().name("strata-egress".into()).spawn(move || {
            runtime.block_on(serve(tcp, unix, serve_shared, stop_rx));
            // Dropping the runtime joins its worker and blocking threads (a DNS lookup in progress included).
            drop(runtime);
        });
        let thread = match spawned {
            Ok(t) => t,
            Err(e) => {
                if let Some(p) = &config.unix_socket {
                    let _ = std::fs::remove_file(p);
                }
                return Err(EgressError::Runtime(e));
            }
        };
        Ok(EgressHandle {
            tcp_addr,
            unix_socket: config.unix_socket,
            shared,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }
}

/// Replaces a running proxy's allowlist: connections accepted afterwards are checked against the new one;
/// connections already relayed go on (a connection is allowed once, when it is made).
#[derive(Debug, Clone)]
pub struct AllowlistSwitch(std::sync::Weak<Shared>);

impl AllowlistSwitch {
    /// Puts `allowlist` in force; `false` when the proxy has stopped.
    pub fn set(&self, allowlist: Allowlist) -> bool {
        match self.0.upgrade() {
            Some(shared) => {
                *shared.allowlist.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(allowlist);
                true
            }
            None => false,
        }
    }

    /// The allowlist in force, while the proxy runs.
    pub fn get(&self) -> Option<Arc<Allowlist>> {
        self.0.upgrade().map(|shared| shared.allowlist())
    }
}

/// A running proxy. Dropping it stops the proxy (see [`EgressProxy::start`]).
#[derive(Debug)]
pub struct EgressHandle {
    tcp_addr: Option<SocketAddr>,
    unix_socket: Option<PathBuf>,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl EgressHandle {
    /// The TCP address listened on (with the port picked when `:0` was asked).
    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        self.tcp_addr
    }

    /// The Unix socket listened on.
    pub fn unix_socket(&self) -> Option<&Path> {
        self.unix_socket.as_deref()
    }

    /// The allowlist in force.
    pub fn allowlist(&self) -> Arc<Allowlist> {
        self.shared.allowlist()
    }

    /// The guest's environment for the proxy's egress secrets: each `NAME` = its placeholder.
    pub fn secret_env(&self) -> Vec<(String, String)> {
        self.shared.secrets.guest_env()
    }

    /// A handle that replaces the allowlist while the proxy runs (it outlives nothing: once the proxy stops, a
    /// change is a no-op).
    pub fn switch(&self) -> AllowlistSwitch {
        AllowlistSwitch(Arc::downgrade(&self.shared))
    }

    /// A copy of the records of finished connections, oldest first.
    pub fn records(&self) -> Vec<EgressRecord> {
        self.shared.log().records.clone()
    }

    /// Takes the records of finished connections (the next call returns only newer ones): one job's egress.
    pub fn drain_records(&self) -> Vec<EgressRecord> {
        std::mem::take(&mut self.shared.log().records)
    }

    /// Records not kept because [`EgressConfig::max_records`] were already held (since the last
    /// [`EgressHandle::drain_records_settled`]).
    pub fn records_dropped(&self) -> u64 {
        self.shared.log().dropped
    }

    /// Client connections being served right now.
    pub fn active_connections(&self) -> usize {
        self.shared.in_flight()
    }

    /// Waits up to `timeout` for every connection in flight to finish (a job has ended; its last connections are
    /// closing), then drains the records, and the count of those not kept meanwhile. Connections still open after
    /// `timeout` are recorded when they end.
    pub fn drain_records_settled(&self, timeout: Duration) -> Drained {
        let deadline = Instant::now() + timeout;
        while self.shared.in_flight() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        let mut log = self.shared.log();
        Drained { records: std::mem::take(&mut log.records), dropped: std::mem::take(&mut log.dropped) }
    }

    /// Stops the proxy (as dropping does) and returns every record not yet drained, connections cancelled by the
    /// shutdown included.
    pub fn shutdown(mut self) -> Vec<EgressRecord> {
        self.stop_and_join();
        self.drain_records()
    }

    fn stop_and_join(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Some(p) = &self.unix_socket {
            let _ = std::fs::remove_file(p);
        }
    }
}

impl Drop for EgressHandle {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

/// One job's share of the log ([`EgressHandle::drain_records_settled`]).
#[derive(Debug, Default)]
pub struct Drained {
    /// The records, oldest first.
    pub records: Vec<EgressRecord>,
    /// Records not kept because the log was full.
    pub dropped: u64,
}

impl Drained {
    /// The records as the Outcome's entries, and the count not kept.
    pub fn into_entries(self) -> (Vec<strata_core::outcome::EgressEntry>, u64) {
        (self.records.into_iter().map(Into::into).collect(), self.dropped)
    }
}

/// Accepts from an optional listener; never resolves when there is none.
async fn accept_opt<L: Listener>(l: &Option<L>) -> io::Result<L::Stream> {
    match l {
        Some(l) => l.accept_stream().await,
        None => std::future::pending().await,
    }
}

/// The two listener kinds, accepted alike.
trait Listener {
    type Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    fn accept_stream(&self) -> impl Future<Output = io::Result<Self::Stream>> + Send;
    fn refuse(stream: &Self::Stream, msg: &[u8]);
}

impl Listener for TcpListener {
    type Stream = TcpStream;
    async fn accept_stream(&self) -> io::Result<TcpStream> {
        let (s, _) = self.accept().await?;
        s.set_nodelay(true)?;
        Ok(s)
    }
    fn refuse(stream: &TcpStream, msg: &[u8]) {
        let _ = stream.try_write(msg);
    }
}

impl Listener for UnixListener {
    type Stream = tokio::net::UnixStream;
    async fn accept_stream(&self) -> io::Result<Self::Stream> {
        Ok(self.accept().await?.0)
    }
    fn refuse(stream: &Self::Stream, msg: &[u8]) {
        let _ = stream.try_write(msg);
    }
}

const BUSY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";

async fn serve(
    tcp: Option<TcpListener>,
    unix: Option<UnixListener>,
    shared: Arc<Shared>,
    mut stop: oneshot::Receiver<()>,
) {
    let mut tasks = JoinSet::new();
    loop {
        tokio::select! {
            _ = &mut stop => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            r = accept_opt(&tcp) => match r {
                Ok(s) => admit::<TcpListener>(s, &shared, &mut tasks),
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await, // EMFILE and the like
            },
            r = accept_opt(&unix) => match r {
                Ok(s) => admit::<UnixListener>(s, &shared, &mut tasks),
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            },
        }
    }
    drop(tcp);
    drop(unix);
    // Cancels every connection; each records itself as it is dropped.
    tasks.shutdown().await;
}

fn admit<L: Listener>(stream: L::Stream, shared: &Arc<Shared>, tasks: &mut JoinSet<()>) {
    match shared.permits.clone().try_acquire_owned() {
        Ok(permit) => {
            let shared = shared.clone();
            tasks.spawn(async move {
                let mut conn = Connection::new(shared, permit);
                conn.run(stream).await;
            });
        }
        Err(_) => L::refuse(&stream, BUSY),
    }
}

/// Milliseconds since the connection started of the last byte moved.
#[derive(Debug)]
struct Activity {
    t0: Instant,
    last_ms: AtomicU64,
}

impl Activity {
    fn touch(&self) {
        self.last_ms.store(self.t0.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// Resolves once nothing has moved for `idle`.
    async fn idle(&self, idle: Duration) {
        loop {
            let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
            let quiet_until = self.t0 + last + idle;
            if Instant::now() >= quiet_until {
                return;
            }
            tokio::time::sleep_until(quiet_until.into()).await;
        }
    }
}

/// One client connection; its record is written when it is dropped (finished or cancelled).
#[derive(Debug)]
struct Connection {
    shared: Arc<Shared>,
    host: String,
    port: u16,
    kind: EgressKind,
    verdict: EgressVerdict,
    started: SystemTime,
    up: AtomicU64,
    down: AtomicU64,
    activity: Activity,
    /// Whether the client sent anything (an empty connection leaves no record).
    spoke: bool,
    /// Egress secrets this request concerned.
    secrets: SecretUse,
    // Released after the record is written, so `active_connections() == 0` implies every record is in.
    _permit: OwnedSemaphorePermit,
}

impl Drop for Connection {
    fn drop(&mut self) {
        if !self.spoke {
            return;
        }
        let record = EgressRecord {
            host: std::mem::take(&mut self.host),
            port: self.port,
            kind: self.kind,
            bytes_up: self.up.load(Ordering::Relaxed),
            bytes_down: self.down.load(Ordering::Relaxed),
            verdict: std::mem::replace(&mut self.verdict, EgressVerdict::Allowed),
            secrets: std::mem::take(&mut self.secrets),
            started: self.started,
            duration: self.activity.t0.elapsed(),
        };
        self.shared.log().push(record);
    }
}

/// How a relay ended early.
enum Stop {
    /// The client broke a rule mid-stream (SNI).
    Denied(String),
    /// A socket error or the idle timeout: the connection just ends.
    Closed,
}

/// How reaching the origin failed.
enum Unreachable {
    Denied(String),
    Failed(String),
}

impl Connection {
    fn new(shared: Arc<Shared>, permit: OwnedSemaphorePermit) -> Connection {
        Connection {
            shared,
            host: String::new(),
            port: 0,
            kind: EgressKind::Http,
            verdict: EgressVerdict::Allowed,
            started: SystemTime::now(),
            up: AtomicU64::new(0),
            down: AtomicU64::new(0),
            activity: Activity { t0: Instant::now(), last_ms: AtomicU64::new(0) },
            spoke: false,
            secrets: SecretUse::default(),
            _permit: permit,
        }
    }

    fn deny(&mut self, reason: String) {
        self.verdict = EgressVerdict::Denied { reason };
    }

    async fn run<S: AsyncRead + AsyncWrite + Unpin + Send>(&mut self, mut client: S) {
        let mut buf = Vec::with_capacity(2048);
        let idle = self.shared.idle_timeout;
        let end = match tokio::time::timeout(idle, self.read_head(&mut client, &mut buf)).await {
            Ok(Ok(Some(end))) => end,
            Ok(Ok(None)) => return, // closed before a whole head; recorded as denied if it sent anything
            Ok(Err(status)) => {
                respond(&mut client, status, self.verdict.reason().unwrap_or_default()).await;
                return;
            }
            Err(_) => {
                if self.spoke {
                    self.deny("no complete request head before the idle timeout".into());
                    respond(&mut client, "408 Request Timeout", "request head timed out").await;
                }
                return;
            }
        };
        let (head_bytes, leftover) = buf.split_at(end);
        let mut head = match parse_head(head_bytes) {
            Ok(h) => h,
            Err(e) => {
                self.deny(e.to_string());
                respond(&mut client, e.status(), &e.to_string()).await;
                return;
            }
        };
        self.host = head.host.to_string();
        self.port = head.port;
        self.kind = if head.is_connect() { EgressKind::Connect } else { EgressKind::Http };
        if !self.shared.allowlist().allows(&head.host, head.port) {
            let reason = format!("{}:{} is not in the allowlist", head.host.to_authority(), head.port);
            respond(&mut client, "403 Forbidden", &reason).await;
            self.deny(reason);
            return;
        }
        if !head.is_connect() {
            let max = self.shared.max_header_bytes;
            match self.shared.secrets.apply(&mut head.headers, &head.host, head.port, max) {
                Ok(used) => self.secrets = used,
                Err(e) => {
                    respond(&mut client, "431 Request Header Fields Too Large", &e.to_string()).await;
                    self.deny(e.to_string());
                    return;
                }
            }
        }
        let origin = match connect_origin(&self.shared, &head.host, head.port).await {
            Ok(o) => o,
            Err(Unreachable::Denied(reason)) => {
                respond(&mut client, "403 Forbidden", &reason).await;
                self.deny(reason);
                return;
            }
            Err(Unreachable::Failed(reason)) => {
                respond(&mut client, "502 Bad Gateway", &reason).await;
                self.verdict = EgressVerdict::Failed { reason };
                return;
            }
        };
        self.activity.touch();
        let leftover = leftover.to_vec();
        drop(buf);
        let result = if head.is_connect() {
            self.tunnel(client, origin, &head, leftover).await
        } else {
            self.forward(client, origin, &head, leftover).await
        };
        if let Err(Stop::Denied(reason)) = result {
            self.deny(reason);
        }
    }

    /// Reads until the blank line ending the head. `Ok(None)`: the client closed first. `Err(status)`: refused
    /// (the verdict is set).
    async fn read_head<S: AsyncRead + Unpin>(
        &mut self,
        client: &mut S,
        buf: &mut Vec<u8>,
    ) -> Result<Option<usize>, &'static str> {
        let max = self.shared.max_header_bytes;
        let mut chunk = [0u8; 4096];
        loop {
            let n = match client.read(&mut chunk).await {
                Ok(0) | Err(_) => {
                    if self.spoke {
                        self.deny("connection closed before a complete request head".into());
                    }
                    return Ok(None);
                }
                Ok(n) => n,
            };
            self.spoke = true;
            let from = buf.len().saturating_sub(3);
            buf.extend_from_slice(&chunk[..n]);
            if let Some(end) = head_end(&buf[from..]) {
                let end = from + end;
                if end <= max {
                    return Ok(Some(end));
                }
            }
            if buf.len() > max {
                self.deny(format!("request head larger than {max} bytes"));
                return Err("431 Request Header Fields Too Large");
            }
        }
    }

    /// CONNECT: `200`, then bytes both ways; a TLS ClientHello's SNI must match the CONNECT host.
    async fn tunnel<S: AsyncRead + AsyncWrite + Unpin + Send>(
        &self,
        client: S,
        mut origin: TcpStream,
        head: &RequestHead,
        leftover: Vec<u8>,
    ) -> Result<(), Stop> {
        let (mut cr, mut cw) = tokio::io::split(client);
        cw.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n").await.map_err(|_| Stop::Closed)?;
        let (mut or, mut ow) = origin.split();
        let up = async {
            let first = self.gate_tls(&mut cr, &head.host, leftover).await?;
            if let Some(first) = first {
                ow.write_all(&first).await.map_err(|_| Stop::Closed)?;
                self.up.fetch_add(first.len() as u64, Ordering::Relaxed);
                pump(&mut cr, &mut ow, &self.up, &self.activity, None).await?;
            }
            let _ = ow.shutdown().await;
            Ok::<(), Stop>(())
        };
        let down = async {
            pump(&mut or, &mut cw, &self.down, &self.activity, None).await?;
            let _ = cw.shutdown().await;
            Ok::<(), Stop>(())
        };
        self.with_idle_timeout(async { tokio::try_join!(up, down).map(|_| ()) }).await
    }

    /// Reads the tunnel's first bytes; when they start a TLS record, the whole ClientHello, whose SNI must be the
    /// CONNECT host (no SNI only for an IP literal). Returns the bytes to forward first, `None` when the client
    /// closed without sending any.
    async fn gate_tls<R: AsyncRead + Unpin>(
        &self,
        client: &mut R,
        host: &Host,
        mut pending: Vec<u8>,
    ) -> Result<Option<Vec<u8>>, Stop> {
        let mut chunk = [0u8; 4096];
        loop {
            if let Some(&first) = pending.first() {
                if first != HANDSHAKE_RECORD {
                    return Ok(Some(pending)); // not TLS: a plain TCP tunnel
                }
                match parse_client_hello(&pending) {
                    Ok(ClientHelloParse::Complete(sni)) => {
                        check_sni(host, sni.as_deref()).map_err(Stop::Denied)?;
                        return Ok(Some(pending));
                    }
                    Ok(ClientHelloParse::Incomplete) if pending.len() <= MAX_CLIENT_HELLO + 1024 => {}
                    Ok(ClientHelloParse::Incomplete) => {
                        return Err(Stop::Denied("TLS ClientHello too large".into()));
                    }
                    Err(e) => return Err(Stop::Denied(e.to_string())),
                }
            }
            let n = client.read(&mut chunk).await.map_err(|_| Stop::Closed)?;
            if n == 0 {
                return match pending.first() {
                    None => Ok(None),
                    Some(_) => Err(Stop::Denied("connection closed inside a TLS ClientHello".into())),
                };
            }
            self.activity.touch();
            pending.extend_from_slice(&chunk[..n]);
        }
    }

    /// Absolute-form HTTP: the rewritten head and exactly `Content-Length` body bytes up, the response down until
    /// the origin closes (it was sent `Connection: close`). Bytes the client sends past the body are never
    /// forwarded: one request per connection.
    async fn forward<S: AsyncRead + AsyncWrite + Unpin + Send>(
        &self,
        client: S,
        mut origin: TcpStream,
        head: &RequestHead,
        leftover: Vec<u8>,
    ) -> Result<(), Stop> {
        let (mut cr, mut cw) = tokio::io::split(client);
        let (mut or, mut ow) = origin.split();
        let up = async {
            let origin_head = head.origin_head();
            ow.write_all(&origin_head).await.map_err(|_| Stop::Closed)?;
            self.up.fetch_add(origin_head.len() as u64, Ordering::Relaxed);
            let mut body_left = head.content_length;
            let first = usize::try_from(body_left).map_or(leftover.len(), |b| b.min(leftover.len()));
            if first > 0 {
                ow.write_all(&leftover[..first]).await.map_err(|_| Stop::Closed)?;
                self.up.fetch_add(first as u64, Ordering::Relaxed);
                body_left -= first as u64;
            }
            if body_left > 0 {
                pump(&mut cr, &mut ow, &self.up, &self.activity, Some(body_left)).await?;
            }
            Ok::<(), Stop>(())
        };
        let down = async {
            pump(&mut or, &mut cw, &self.down, &self.activity, None).await?;
            let _ = cw.shutdown().await;
            Ok::<(), Stop>(())
        };
        self.with_idle_timeout(async { tokio::try_join!(up, down).map(|_| ()) }).await
    }

    async fn with_idle_timeout(&self, relay: impl Future<Output = Result<(), Stop>>) -> Result<(), Stop> {
        tokio::select! {
            r = relay => r,
            () = self.activity.idle(self.shared.idle_timeout) => Err(Stop::Closed),
        }
    }
}

/// Copies `r` to `w` until EOF (or `limit` bytes), counting and marking activity.
async fn pump<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    r: &mut R,
    w: &mut W,
    counter: &AtomicU64,
    activity: &Activity,
    mut limit: Option<u64>,
) -> Result<(), Stop> {
    let mut buf = vec![0u8; RELAY_BUFFER];
    loop {
        let want = match limit {
            Some(0) => return Ok(()),
            Some(l) => usize::try_from(l).map_or(buf.len(), |l| l.min(buf.len())),
            None => buf.len(),
        };
        let n = r.read(&mut buf[..want]).await.map_err(|_| Stop::Closed)?;
        if n == 0 {
            return Ok(());
        }
        w.write_all(&buf[..n]).await.map_err(|_| Stop::Closed)?;
        counter.fetch_add(n as u64, Ordering::Relaxed);
        activity.touch();
        if let Some(l) = &mut limit {
            *l -= n as u64;
        }
    }
}

/// The SNI rule: equal to a CONNECT name (both normalised); absent only for an IP-literal CONNECT.
fn check_sni(host: &Host, sni: Option<&str>) -> Result<(), String> {
    match (host, sni) {
        (Host::Name(h), Some(s)) if h == s => Ok(()),
        (Host::Ip(_), None) => Ok(()),
        (h, Some(s)) => Err(format!("TLS SNI {s} differs from the CONNECT host {h}")),
        (h, None) => Err(format!("TLS ClientHello without SNI for the CONNECT host {h}")),
    }
}

/// Resolves (names by the host's resolver) and connects, applying the DNS-rebinding rule.
async fn connect_origin(shared: &Shared, host: &Host, port: u16) -> Result<TcpStream, Unreachable> {
    let limit = shared.connect_timeout;
    let addrs: Vec<SocketAddr> = match host {
        Host::Ip(ip) => vec![SocketAddr::new(*ip, port)],
        Host::Name(name) => {
            let found = tokio::time::timeout(limit, tokio::net::lookup_host((name.as_str(), port)))
                .await
                .map_err(|_| Unreachable::Failed(format!("resolving {name} timed out")))?
                .map_err(|e| Unreachable::Failed(format!("cannot resolve {name}: {e}")))?;
            let all: Vec<SocketAddr> = found.collect();
            let permitted: Vec<SocketAddr> = {
                let allowlist = shared.allowlist();
                all.iter().copied().filter(|a| allowlist.permits_resolved(host, a.ip(), port)).collect()
            };
            match (all.first(), permitted.is_empty()) {
                (None, _) => return Err(Unreachable::Failed(format!("{name} resolves to no address"))),
                (Some(a), true) => {
                    return Err(Unreachable::Denied(format!(
                        "{name} resolves to the non-public address {} that the allowlist does not name",
                        a.ip()
                    )));
                }
                (Some(_), false) => permitted,
            }
        }
    };
    let mut last = String::from("no address");
    for addr in addrs {
        match tokio::time::timeout(limit, TcpStream::connect(addr)).await {
            Ok(Ok(s)) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Ok(Err(e)) => last = e.to_string(),
            Err(_) => last = "timed out".into(),
        }
    }
    Err(Unreachable::Failed(format!("cannot connect to {}:{port}: {last}", host.to_authority())))
}

/// Writes a short plain-text answer and closes.
async fn respond<S: AsyncWrite + Unpin>(client: &mut S, status: &str, reason: &str) {
    let body = format!("strata egress: {reason}\n");
    let msg = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        let _ = client.write_all(msg.as_bytes()).await;
        let _ = client.shutdown().await;
    })
    .await;
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn sni_must_equal_the_connect_name() {
        let name = Host::Name("example.com".into());
        assert!(check_sni(&name, Some("example.com")).is_ok());
        assert!(check_sni(&name, Some("evil.com")).is_err());
        assert!(check_sni(&name, None).is_err());
        let ip = Host::Ip("10.0.0.1".parse().unwrap());
        assert!(check_sni(&ip, None).is_ok());
        assert!(check_sni(&ip, Some("example.com")).is_err());
    }
}
