//! Requests between nodes: one node sends a request to another as it came (its path, query, headers and body),
//! marked with [`HOP`], and returns the answer unchanged; an upgrade (a WebSocket) joins both connections.
//!
//! A forwarded request carries [`HOP`] (the forwarding node's name): a node never forwards such a request again,
//! so a stale catalog can cost one hop but never a loop. A create forwarded with a reservation carries
//! [`PLACED`] (the reserved sandbox id): the receiving node confirms that reservation in etcd before it creates
//! anything, so a header alone places nothing.

use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
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

/// Sends `request` to the node at `advertise` as it is (its path, query, headers and body), marked with [`HOP`],
/// and returns the node's answer unchanged; an upgrade (`101`) joins the two connections until either closes.
/// An `https://` node is reached over mutual TLS with `tls` (its certificate verified against the fleet CA, this
/// node's presented); without `tls` only `http://` nodes are reached.
pub async fn forward(
    from: &str,
    advertise: &str,
    tls: Option<&tokio_rustls::TlsConnector>,
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
    let connect = async {
        let stream = tokio::net::TcpStream::connect(&url.authority).await.map_err(|e| e.to_string())?;
        let _ = stream.set_nodelay(true);
        Ok::<_, String>(stream)
    };
    let stream = tokio::time::timeout(CONNECT_TIMEOUT, connect)
        .await
        .map_err(|_| unreachable("no connection".into()))?
        .map_err(unreachable)?;
    match (url.tls, tls) {
        (false, _) => send(stream, request).await.map_err(unreachable),
        (true, Some(connector)) => {
            let name = rustls::pki_types::ServerName::try_from(url.host.clone())
                .map_err(|e| unreachable(format!("{}: {e}", url.host)))?;
            let stream = tokio::time::timeout(CONNECT_TIMEOUT, connector.connect(name, stream))
                .await
                .map_err(|_| unreachable("no TLS handshake".into()))?
                .map_err(|e| unreachable(format!("TLS: {e}")))?;
            send(stream, request).await.map_err(unreachable)
        }
        (true, None) => Err(unreachable("an https:// node, and this node has no fleet certificate".into())),
    }
}

/// Sends `request` over `io` (one HTTP/1 connection) and returns the answer; an upgrade joins the connections.
async fn send<S>(io: S, mut request: Request) -> Result<Response, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::Builder::new()
        .handshake::<_, Body>(TokioIo::new(io))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        let _ = connection.with_upgrades().await;
    });
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
