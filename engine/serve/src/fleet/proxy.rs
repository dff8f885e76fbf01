//! Requests between nodes: one node sends a request to another as it came (its path, query, headers and body),
//! marked with [`HOP`], and returns the answer unchanged; an upgrade (a WebSocket) joins both connections.
//!
//! A forwarded request carries [`HOP`] (the forwarding node's name): a node never forwards such a request again,
//! so a stale catalog can cost one hop but never a loop. A create forwarded with a reservation carries
//! [`PLACED`] (the reserved sandbox id): the receiving node confirms that reservation in etcd before it creates
//! anything, so a header alone places nothing.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;

use crate::ApiError;

/// The header of a request one node forwarded to another: the forwarding node's name.
pub const HOP: &str = "x-strata-fleet-hop";

/// The header of a create forwarded with a reservation: the sandbox id reserved on the receiving node.
pub const PLACED: &str = "x-strata-fleet-placed";

/// How long a node waits to connect to another.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// A node's or an etcd member's URL: `http://host:port` or `https://host:port` (nothing after the port).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeUrl {
    /// `https://`.
    pub tls: bool,
    /// `host:port`, as written.
    pub authority: String,
    /// The host (an IPv6 address without its brackets).
    pub host: String,
}

impl NodeUrl {
    /// Parses `url`.
    pub fn parse(url: &str) -> Result<NodeUrl, String> {
        let (tls, rest) = match (url.strip_prefix("http://"), url.strip_prefix("https://")) {
            (Some(rest), _) => (false, rest),
            (_, Some(rest)) => (true, rest),
            _ => return Err("not an http:// or https:// URL".into()),
        };
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        if rest.is_empty() || rest.contains(['/', '?', '#', '@']) {
            return Err("not a bare scheme://host:port URL".into());
        }
        let (host, port) = rest.rsplit_once(':').ok_or("no port")?;
        port.parse::<u16>().map_err(|_| "not a port number")?;
        let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
        if host.is_empty() {
            return Err("no host".into());
        }
        Ok(NodeUrl { tls, authority: rest.to_owned(), host: host.to_owned() })
    }

    /// Whether the host is a loopback address (or `localhost`): traffic to it never leaves the machine.
    pub fn is_loopback(&self) -> bool {
        self.host.eq_ignore_ascii_case("localhost")
            || self.host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
    }
}

/// Idle connections to other nodes, by URL: a forwarded request that is not an upgrade reuses one (no new TCP or
/// TLS handshake) and gives it back once its answer is done. A connection idle for 15 s (well below a
/// node's keep-alive timeout) or closed by its node is dropped; a request a pooled connection could not send is
/// sent on the next one or a new one, so a connection closed meanwhile costs no request.
#[derive(Default)]
pub struct Pool {
    idle: std::sync::Mutex<Idle>,
}

/// Idle connections by node URL, each with the time it became idle.
type Idle = std::collections::HashMap<String, Vec<(SendRequest<Body>, Instant)>>;

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("idle", &self.idle_connections()).finish()
    }
}

/// How long a connection to another node stays in the pool unused.
const IDLE_MAX: Duration = Duration::from_secs(15);

/// Idle connections kept per node.
const IDLE_PER_NODE: usize = 16;

impl Pool {
    fn lock(&self) -> std::sync::MutexGuard<'_, Idle> {
        self.idle.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The idle connections held, to every node.
    pub fn idle_connections(&self) -> usize {
        self.lock().values().map(Vec::len).sum()
    }

    /// An idle connection to `node` that may take a request now.
    fn take(&self, node: &str) -> Option<SendRequest<Body>> {
        let mut idle = self.lock();
        let list = idle.get_mut(node)?;
        while let Some((sender, since)) = list.pop() {
            if since.elapsed() < IDLE_MAX && sender.is_ready() {
                return Some(sender);
            }
        }
        None
    }

    /// Gives `sender` back once its exchange is done (its answer read to the end), unless its node closed it.
    fn give_back(self: &Arc<Self>, node: String, mut sender: SendRequest<Body>) {
        let pool = self.clone();
        tokio::spawn(async move {
            if sender.ready().await.is_err() {
                return;
            }
            let mut idle = pool.lock();
            let list = idle.entry(node).or_default();
            list.retain(|(s, since)| since.elapsed() < IDLE_MAX && !s.is_closed());
            if list.len() < IDLE_PER_NODE {
                list.push((sender, Instant::now()));
            }
        });
    }
}

/// Sends `request` to the node at `advertise` as it is (its path, query, headers and body), marked with [`HOP`],
/// and returns the node's answer unchanged; an upgrade (`101`) joins the two connections until either closes.
/// An `https://` node is reached over mutual TLS with `tls` (its certificate verified against the fleet CA, this
/// node's presented); without `tls` only `http://` nodes are reached. With a `pool`, a request that is not an
/// upgrade goes over an idle connection to that node when there is one.
pub async fn forward(
    from: &str,
    advertise: &str,
    tls: Option<&tokio_rustls::TlsConnector>,
    pool: Option<&Arc<Pool>>,
    mut request: Request,
) -> Result<Response, ApiError> {
    let unreachable =
        |why: String| ApiError::new(StatusCode::BAD_GATEWAY, "node_unreachable", format!("node at {advertise}: {why}"));
    let url = NodeUrl::parse(advertise).map_err(unreachable)?;
    let path = request.uri().path_and_query().map_or("/", |p| p.as_str()).to_owned();
    *request.uri_mut() = path.parse().map_err(|_| ApiError::bad_request("invalid_path", "an unusable request path"))?;
    if let Ok(value) = HeaderValue::from_str(from) {
        request.headers_mut().insert(HOP, value);
    }
    let upgrading = request.headers().get(header::UPGRADE).is_some();
    if !upgrading {
        // Hop-by-hop headers are the client's connection's business, not the next hop's: a client's
        // `Connection: close` would close the pooled connection to the node after every request.
        for name in [header::CONNECTION, header::TE, header::TRAILER, header::PROXY_AUTHORIZATION] {
            request.headers_mut().remove(name);
        }
        request.headers_mut().remove("keep-alive");
        request.headers_mut().remove("proxy-connection");
    }
    let pool = pool.filter(|_| !upgrading);
    if let Some(pool) = pool {
        while let Some(mut sender) = pool.take(advertise) {
            match sender.try_send_request(request).await {
                Ok(response) => {
                    pool.give_back(advertise.to_owned(), sender);
                    return Ok(response.map(Body::new).into_response());
                }
                // Not sent (the node closed the connection meanwhile): the next connection takes it.
                Err(mut err) => match err.take_message() {
                    Some(unsent) => request = unsent,
                    None => return Err(unreachable(err.error().to_string())),
                },
            }
        }
    }
    let connect = async {
        let stream = tokio::net::TcpStream::connect(&url.authority).await.map_err(|e| e.to_string())?;
        let _ = stream.set_nodelay(true);
        Ok::<_, String>(stream)
    };
    let stream = tokio::time::timeout(CONNECT_TIMEOUT, connect)
        .await
        .map_err(|_| unreachable("no connection".into()))?
        .map_err(unreachable)?;
    let sender = match (url.tls, tls) {
        (false, _) => handshake(stream).await.map_err(unreachable)?,
        (true, Some(connector)) => {
            let name = rustls::pki_types::ServerName::try_from(url.host.clone())
                .map_err(|e| unreachable(format!("{}: {e}", url.host)))?;
            let stream = tokio::time::timeout(CONNECT_TIMEOUT, connector.connect(name, stream))
                .await
                .map_err(|_| unreachable("no TLS handshake".into()))?
                .map_err(|e| unreachable(format!("TLS: {e}")))?;
            handshake(stream).await.map_err(unreachable)?
        }
        (true, None) => return Err(unreachable("an https:// node, and this node has no fleet certificate".into())),
    };
    send(sender, request, pool.map(|pool| (pool, advertise))).await.map_err(unreachable)
}

/// One HTTP/1 connection over `io`, driven on its own task (upgrades included).
async fn handshake<S>(io: S) -> Result<SendRequest<Body>, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, connection) = hyper::client::conn::http1::Builder::new()
        .handshake::<_, Body>(TokioIo::new(io))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        let _ = connection.with_upgrades().await;
    });
    Ok(sender)
}

/// Sends `request` on a new connection and returns the answer; an upgrade joins the connections. A connection
/// that took no upgrade goes to `pool` once its answer is done.
async fn send(
    mut sender: SendRequest<Body>,
    mut request: Request,
    pool: Option<(&Arc<Pool>, &str)>,
) -> Result<Response, String> {
    let upgrading = request.headers().get(header::UPGRADE).is_some();
    let client_side = upgrading.then(|| hyper::upgrade::on(&mut request));
    let mut response = sender.send_request(request).await.map_err(|e| e.to_string())?;
    if response.status() == StatusCode::SWITCHING_PROTOCOLS
        && let Some(client_side) = client_side
    {
        let node_side = hyper::upgrade::on(&mut response);
        tokio::spawn(async move {
            if let (Ok(client), Ok(node)) = (client_side.await, node_side.await) {
                let _ = tokio::io::copy_bidirectional(&mut TokioIo::new(client), &mut TokioIo::new(node)).await;
            }
        });
    } else if let Some((pool, node)) = pool {
        pool.give_back(node.to_owned(), sender);
    }
    Ok(response.map(Body::new).into_response())
}

#[cfg(test)]
mod tests {
    use super::NodeUrl;

    #[test]
    fn node_urls_are_bare_http_or_https_authorities() {
        let url = NodeUrl::parse("https://[::1]:8443/").expect("parse");
        assert_eq!((url.tls, url.authority.as_str(), url.host.as_str()), (true, "[::1]:8443", "::1"));
        assert!(url.is_loopback());
        let url = NodeUrl::parse("http://10.0.0.7:3000").expect("parse");
        assert!(!url.tls && !url.is_loopback());
        assert!(NodeUrl::parse("http://localhost:1").expect("parse").is_loopback());
        for bad in ["ftp://a:1", "http://a", "http://a:x", "http://:1", "http://a:1/path", "http://u@a:1", "https://"] {
            assert!(NodeUrl::parse(bad).is_err(), "{bad}");
        }
    }
}
