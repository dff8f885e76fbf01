//! Connections: the accept loop, its caps, and the timeouts of a connection that never finishes a request — all
//! before a request reaches routing or authentication.
//!
//! - **Caps at accept.** A connection beyond [`ConnectionLimits::max_connections_per_peer`] (peers are IPv4
//!   addresses, IPv6 ones by their /64: one host holds a whole /64) or [`ConnectionLimits::max_connections`] gets
//!   a fixed `429`/`503 too_many_connections` written without reading a byte, and is closed.
//! - **Header timeout.** A request's header must be whole within [`ConnectionLimits::header_timeout`] of its first
//!   byte (of the connection's opening, for its first request).
//! - **Keep-alive timeout.** A connection with no request in flight is closed after
//!   [`ConnectionLimits::keep_alive_timeout`]. A request in flight — a job that takes minutes, a server-streaming
//!   call, a WebSocket once upgraded — is never idle: what bounds those is the job's own limits and the next item.
//! - **Write timeout.** A write the client accepts no byte of for [`ConnectionLimits::write_timeout`] fails the
//!   connection (a client that opened a stream and stopped reading): it applies to upgraded WebSockets too.
//! - **Body limits.** A body whose `Content-Length` is over [`ConnectionLimits::max_body`] gets `413
//!   body_too_large` before routing; any body is cut at that size (413) and must arrive whole within
//!   [`ConnectionLimits::body_timeout`] of its request's start (`408 body_timeout`).
//!
//! Why not `axum::serve`: it exposes neither hyper's builder nor a hook per connection, and hyper's own
//! `header_read_timeout` starts when a connection goes idle, so it cannot tell a slow header from a keep-alive
//! connection. Here each connection is hyper's HTTP/1 connection (the only protocol the server speaks) under a
//! watchdog that knows the request's phase from the service wrapper and the first byte from the socket wrapper.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::http::{HeaderValue, Request, Response, header};
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use tokio::time::Sleep;
use tower::ServiceExt;

use crate::registry::lock;
use crate::tls::{NodePeer, Tls};

/// The largest request body by default (files, jobs).
pub const DEFAULT_MAX_BODY: usize = 64 << 20;

/// How a server bounds its connections. [`Default`] gives the values `strata serve` uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Time to receive a request's whole header, from its first byte (a new connection's opening, for the first).
    pub header_timeout: Duration,
    /// Time a connection may stay open with no request in flight.
    pub keep_alive_timeout: Duration,
    /// Time to receive a request's whole body, from the end of its header.
    pub body_timeout: Duration,
    /// Time a write may wait for the client to accept a byte (a client that stops reading).
    pub write_timeout: Duration,
    /// The largest request body, in bytes.
    pub max_body: usize,
    /// Connections open at once, from every peer.
    pub max_connections: usize,
    /// Connections open at once from one peer (an IPv4 address; an IPv6 /64).
    pub max_connections_per_peer: usize,
}

impl Default for ConnectionLimits {
    /// Header 10 s, keep-alive 60 s, body 60 s, write 60 s, 64 MiB bodies, 1024 connections, 256 per peer.
    fn default() -> ConnectionLimits {
        ConnectionLimits {
            header_timeout: Duration::from_secs(10),
            keep_alive_timeout: Duration::from_secs(60),
            body_timeout: Duration::from_secs(60),
            write_timeout: Duration::from_secs(60),
            max_body: DEFAULT_MAX_BODY,
            max_connections: 1024,
            max_connections_per_peer: 256,
        }
    }
}

/// Why a connection was refused or closed by the server, for `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Closed {
    PerPeerCap,
    TotalCap,
    HeaderTimeout,
    KeepAliveTimeout,
    TlsHandshake,
}

impl Closed {
    fn label(self) -> &'static str {
        match self {
            Closed::PerPeerCap => "per_peer_cap",
            Closed::TotalCap => "total_cap",
            Closed::HeaderTimeout => "header_timeout",
            Closed::KeepAliveTimeout => "keep_alive_timeout",
            Closed::TlsHandshake => "tls_handshake",
        }
    }
}

#[derive(Debug, Default)]
struct Counts {
    total: usize,
    by_peer: HashMap<IpAddr, usize>,
}

/// The server's open connections, by peer, under its [`ConnectionLimits`].
#[derive(Debug)]
pub struct Connections {
    limits: ConnectionLimits,
    counts: Mutex<Counts>,
    closed: Mutex<BTreeMap<Closed, u64>>,
}

impl Connections {
    /// No connection yet, under `limits`.
    pub fn new(limits: ConnectionLimits) -> Connections {
        Connections { limits, counts: Mutex::default(), closed: Mutex::default() }
    }

    /// The limits.
    pub fn limits(&self) -> &ConnectionLimits {
        &self.limits
    }

    /// Connections open now (upgraded WebSockets included).
    pub fn open(&self) -> usize {
        lock(&self.counts).total
    }

    fn count(&self, why: Closed) {
        *lock(&self.closed).entry(why).or_default() += 1;
    }

    /// A slot for a connection from `peer`, or which cap it is over.
    fn admit(self: &Arc<Self>, peer: IpAddr) -> Result<Slot, Closed> {
        let key = peer_key(peer);
        let mut counts = lock(&self.counts);
        if counts.total >= self.limits.max_connections {
            return Err(Closed::TotalCap);
        }
        let of_peer = counts.by_peer.entry(key).or_default();
        if *of_peer >= self.limits.max_connections_per_peer {
            return Err(Closed::PerPeerCap);
        }
        *of_peer += 1;
        counts.total += 1;
        Ok(Slot { table: self.clone(), peer: key })
    }

    /// Appends the connection series to a `/metrics` text.
    pub fn render_metrics(&self, out: &mut String) {
        use std::fmt::Write as _;
        out.push_str("# HELP strata_connections_open Open client connections.\n# TYPE strata_connections_open gauge\n");
        let _ = writeln!(out, "strata_connections_open {}", self.open());
        out.push_str(
            "# HELP strata_connections_closed_total Connections the server refused at accept or closed, by reason.\n\
             # TYPE strata_connections_closed_total counter\n",
        );
        for (why, n) in lock(&self.closed).iter() {
            let _ = writeln!(out, "strata_connections_closed_total{{reason=\"{}\"}} {n}", why.label());
        }
    }
}

/// What a peer's connections are counted under: its IPv4 address, or its IPv6 /64.
fn peer_key(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & !u128::from(u64::MAX))),
        v4 => v4,
    }
}

/// One open connection's place in [`Connections`]; freed when the socket is dropped (upgraded or not).
#[derive(Debug)]
struct Slot {
    table: Arc<Connections>,
    peer: IpAddr,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut counts = lock(&self.table.counts);
        counts.total = counts.total.saturating_sub(1);
        if let Some(n) = counts.by_peer.get_mut(&self.peer) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.by_peer.remove(&self.peer);
            }
        }
    }
}

/// Where a connection is between requests.
#[derive(Debug, Clone, Copy)]
enum Phase {
    /// Receiving a header, since this instant (its first byte, or the connection's opening).
    Header(Instant),
    /// This many requests in flight (their responses not yet sent whole).
    Busy(usize),
    /// No request in flight since this instant, and no byte of the next one.
    Idle(Instant),
}

/// A connection's phase, shared by its socket, its service and its watchdog.
#[derive(Debug)]
struct Activity {
    phase: Mutex<Phase>,
    changed: Notify,
}

impl Activity {
    fn new() -> Activity {
        Activity { phase: Mutex::new(Phase::Header(Instant::now())), changed: Notify::new() }
    }

    fn set(&self, f: impl FnOnce(Phase) -> Phase) {
        let mut phase = lock(&self.phase);
        *phase = f(*phase);
        drop(phase);
        self.changed.notify_one();
    }

    /// Bytes arrived: an idle connection starts a header.
    fn read(&self) {
        if matches!(*lock(&self.phase), Phase::Idle(_)) {
            self.set(|_| Phase::Header(Instant::now()));
        }
    }

    fn request_started(self: &Arc<Self>) -> InFlight {
        self.set(|phase| match phase {
            Phase::Busy(n) => Phase::Busy(n.saturating_add(1)),
            _ => Phase::Busy(1),
        });
        InFlight(self.clone())
    }

    /// When the connection is to be closed unless something happens first, and why.
    fn deadline(&self, limits: &ConnectionLimits) -> Option<(Instant, Closed)> {
        match *lock(&self.phase) {
            Phase::Header(since) => Some((since + limits.header_timeout, Closed::HeaderTimeout)),
            Phase::Idle(since) => Some((since + limits.keep_alive_timeout, Closed::KeepAliveTimeout)),
            Phase::Busy(_) => None,
        }
    }
}

/// A request in flight, until its response has been sent whole (or dropped).
#[derive(Debug)]
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.set(|phase| match phase {
            Phase::Busy(n) if n > 1 => Phase::Busy(n - 1),
            _ => Phase::Idle(Instant::now()),
        });
    }
}

/// A client's socket: notes the first byte of each request, fails writes the client accepts nothing of for the
/// write timeout, and holds the connection's [`Slot`].
struct Socket {
    tcp: TcpStream,
    activity: Arc<Activity>,
    write_timeout: Duration,
    stalled: Option<Pin<Box<Sleep>>>,
    _slot: Slot,
}

impl Socket {
    /// A write is pending: fails it once it has been pending for the write timeout.
    fn poll_stall<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        let timeout = self.write_timeout;
        let stalled = self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        ready!(stalled.as_mut().poll(cx));
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the client accepted nothing for {timeout:?}"),
        )))
    }

    fn wrote<T>(&mut self, result: Poll<io::Result<T>>, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        match result {
            Poll::Ready(result) => {
                self.stalled = None;
                Poll::Ready(result)
            }
            Poll::Pending => self.poll_stall(cx),
        }
    }
}

impl AsyncRead for Socket {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        ready!(Pin::new(&mut self.tcp).poll_read(cx, buf))?;
        if buf.filled().len() > before {
            self.activity.read();
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Socket {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.tcp).poll_write(cx, buf);
        self.wrote(result, cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs);
        self.wrote(result, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let result = Pin::new(&mut self.tcp).poll_flush(cx);
        self.wrote(result, cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let result = Pin::new(&mut self.tcp).poll_shutdown(cx);
        self.wrote(result, cx)
    }
}

/// A request body past its time or size: the error its reader gets.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive whole within {0:?}")]
pub struct BodyTimeout(pub Duration);

/// A request's body, cut at the size limit and the body timeout.
struct RequestBody {
    inner: http_body_util::Limited<Incoming>,
    deadline: tokio::time::Instant,
    timeout: Duration,
    timer: Option<Pin<Box<Sleep>>>,
}

impl HttpBody for RequestBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => Poll::Ready(frame),
            Poll::Pending => {
                let deadline = this.deadline;
                let timer = this.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                ready!(timer.as_mut().poll(cx));
                Poll::Ready(Some(Err(Box::new(BodyTimeout(this.timeout)))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A response's body, holding its request's [`InFlight`] until hyper has sent it whole or dropped it.
struct ResponseBody {
    inner: axum::body::Body,
    _in_flight: InFlight,
}

impl HttpBody for ResponseBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Answers a request refused before routing because its declared body is over `max_body` bytes (given the
/// request's path and headers, for the shape of its answer); the connection closes after it.
pub(crate) type TooLarge =
    fn(path: &str, headers: &axum::http::HeaderMap, max_body: usize) -> Response<axum::body::Body>;

/// Accepts connections on `listener` and serves `app` on each until `shutdown` completes; then stops accepting,
/// asks every connection to finish its request in flight and close, and returns once they have.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    table: Arc<Connections>,
    tls: Option<Arc<Tls>>,
    too_large: TooLarge,
    shutdown: impl Future<Output = ()>,
) {
    let (stop_tx, stop_rx) = watch::channel(false);
    // Each connection holds a receiver; `closed()` completes when the last is dropped.
    let (open_tx, open_rx) = watch::channel(());
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        let (tcp, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(err) if is_connection_error(&err) => continue,
            Err(err) => {
                // Out of descriptors, most likely: wait for connections to close rather than spin.
                tracing::error!(error = %err, "accepting a connection failed; retrying in 1 s");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let slot = match table.admit(peer.ip()) {
            Ok(slot) => slot,
            Err(why) => {
                table.count(why);
                refuse(&tcp, why, &table.limits);
                tracing::debug!(%peer, reason = why.label(), "refused a connection");
                continue;
            }
        };
        // Small streamed frames (Connect envelopes, WebSocket chunks) must not wait for Nagle's delayed ACK.
        let _ = tcp.set_nodelay(true);
        let (app, table, stop, open) = (app.clone(), table.clone(), stop_rx.clone(), open_rx.clone());
        // The configuration of the moment: a reload applies to the connections accepted after it.
        let acceptor = tls.as_ref().map(|tls| tls.acceptor());
        tokio::spawn(async move {
            connection(tcp, peer, slot, app, table, acceptor, too_large, stop).await;
            drop(open);
        });
    }
    drop(listener);
    drop(open_rx);
    let _ = stop_tx.send(true);
    open_tx.closed().await;
}

/// Writes the refusal of a connection over a cap, if the socket takes it at once, without reading anything.
fn refuse(tcp: &TcpStream, why: Closed, limits: &ConnectionLimits) {
    let (status, message) = match why {
        Closed::PerPeerCap => (
            "429 Too Many Requests",
            format!("this address has {} connections open, the most it may", limits.max_connections_per_peer),
        ),
        _ => (
            "503 Service Unavailable",
            format!("the server has {} connections open, the most it holds", limits.max_connections),
        ),
    };
    let body = serde_json::json!({"error": {"code": "too_many_connections", "message": message}}).to_string();
    let response = format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\
         retry-after: 1\r\n\r\n{body}",
        body.len()
    );
    let _ = tcp.try_write(response.as_bytes());
}

fn is_connection_error(err: &io::Error) -> bool {
    matches!(
        err.kind(),
        io::ErrorKind::ConnectionRefused | io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset
    )
}

/// Serves one connection under its watchdog, after its TLS handshake when the server has TLS (the handshake
/// must be done within the header timeout).
#[allow(clippy::too_many_arguments)]
async fn connection(
    tcp: TcpStream,
    peer: SocketAddr,
    slot: Slot,
    app: Router,
    table: Arc<Connections>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    too_large: TooLarge,
    stop: watch::Receiver<bool>,
) {
    let limits = table.limits.clone();
    let activity = Arc::new(Activity::new());
    let socket =
        Socket { tcp, activity: activity.clone(), write_timeout: limits.write_timeout, stalled: None, _slot: slot };
    let Some(acceptor) = tls else {
        return serve_connection(socket, false, peer, activity, app, table, too_large, stop).await;
    };
    match tokio::time::timeout(limits.header_timeout, acceptor.accept(socket)).await {
        Ok(Ok(stream)) => {
            // A certificate was presented and verified against the fleet CA (one that does not verify fails the
            // handshake): another node's connection.
            let node = stream.get_ref().1.peer_certificates().is_some_and(|certs| !certs.is_empty());
            serve_connection(stream, node, peer, activity, app, table, too_large, stop).await;
        }
        Ok(Err(err)) => {
            table.count(Closed::TlsHandshake);
            tracing::debug!(%peer, error = %err, "TLS handshake failed");
        }
        Err(_) => {
            table.count(Closed::TlsHandshake);
            tracing::debug!(%peer, "TLS handshake not done within the header timeout");
        }
    }
}

/// Serves the requests of one connection (plain or TLS) under its watchdog; `node` marks each request with
/// [`NodePeer`].
#[allow(clippy::too_many_arguments)]
async fn serve_connection<S>(
    io: S,
    node: bool,
    peer: SocketAddr,
    activity: Arc<Activity>,
    app: Router,
    table: Arc<Connections>,
    too_large: TooLarge,
    mut stop: watch::Receiver<bool>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let limits = table.limits.clone();
    let service_activity = activity.clone();
    let (max_body, body_timeout) = (limits.max_body, limits.body_timeout);
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let in_flight = service_activity.request_started();
        let app = app.clone();
        async move {
            let mut request = request;
            if node {
                request.extensions_mut().insert(NodePeer);
            }
            let response = if request.body().size_hint().lower() > max_body as u64 {
                let mut response = too_large(request.uri().path(), request.headers(), max_body);
                response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
                response
            } else {
                let request = request.map(|inner| {
                    axum::body::Body::new(RequestBody {
                        inner: http_body_util::Limited::new(inner, max_body),
                        deadline: tokio::time::Instant::now() + body_timeout,
                        timeout: body_timeout,
                        timer: None,
                    })
                });
                match app.oneshot(request).await {
                    Ok(response) => response,
                    Err(never) => match never {},
                }
            };
            Ok::<_, Infallible>(response.map(|inner| ResponseBody { inner, _in_flight: in_flight }))
        }
    });
    // No hyper timer: the watchdog below times headers from their first byte, which hyper's cannot.
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.header_read_timeout(None);
    let conn = builder.serve_connection(TokioIo::new(io), service).with_upgrades();
    let mut conn = std::pin::pin!(conn);
    let mut stopping = false;
    loop {
        let deadline = activity.deadline(&limits);
        let expiry = async {
            match deadline {
                Some((at, _)) => tokio::time::sleep_until(at.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(err) = result {
                    tracing::debug!(%peer, error = %err, "connection ended with an error");
                }
                return;
            }
            () = activity.changed.notified() => {}
            _ = stop.changed(), if !stopping => {
                stopping = true;
                conn.as_mut().graceful_shutdown();
            }
            () = expiry => {
                if let Some((at, why)) = activity.deadline(&limits)
                    && at <= Instant::now()
                {
                    table.count(why);
                    tracing::debug!(%peer, reason = why.label(), "closing a connection");
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv6_peers_count_by_their_64_and_mapped_ipv4_as_ipv4() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().expect("ip");
        let b: IpAddr = "2001:db8:1:2:bbbb::2".parse().expect("ip");
        let c: IpAddr = "2001:db8:1:3::1".parse().expect("ip");
        assert_eq!(peer_key(a), peer_key(b));
        assert_ne!(peer_key(a), peer_key(c));
        let mapped: IpAddr = "::ffff:10.0.0.7".parse().expect("ip");
        assert_eq!(peer_key(mapped), "10.0.0.7".parse::<IpAddr>().expect("ip"));
    }

    #[test]
    fn slots_are_capped_per_peer_and_in_all_and_freed_on_drop() {
        let limits =
            ConnectionLimits { max_connections: 3, max_connections_per_peer: 2, ..ConnectionLimits::default() };
        let table = Arc::new(Connections::new(limits));
        let one: IpAddr = "127.0.0.1".parse().expect("ip");
        let two: IpAddr = "127.0.0.2".parse().expect("ip");
        let a = table.admit(one).expect("first");
        let _b = table.admit(one).expect("second");
        assert_eq!(table.admit(one).map(|_| ()), Err(Closed::PerPeerCap));
        let _c = table.admit(two).expect("another peer");
        assert_eq!(table.admit(two).map(|_| ()), Err(Closed::TotalCap));
        assert_eq!(table.open(), 3);
        drop(a);
        assert_eq!(table.open(), 2);
        let _d = table.admit(one).expect("a freed slot");
    }
}
