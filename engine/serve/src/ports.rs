//! Ports a sandbox serves, reached through the server: an HTTP request (a WebSocket upgrade included) forwarded to
//! `127.0.0.1:PORT` inside the sandbox and its answer streamed back, both ways, without buffering either body.
//!
//! Three ways in, one proxy: the native `/v1/sandboxes/{id}/ports/{port}/...` (the API's keys and owners), E2B's
//! `E2b-Sandbox-Id` + `E2b-Sandbox-Port` headers on the server's own address, and a Host name
//! `{port}-{sandboxId}.{domain}` when the server has a domain (`--domain`, behind a wildcard DNS name); the E2B
//! ways take the sandbox's traffic token (`E2B-Traffic-Access-Token`) or access token (`X-Access-Token`), or nothing
//! on a server without keys (which only listens where the API needs no key either).
//!
//! What the host does for a client, bounded: one TCP connection into the sandbox per request (opened by the tier
//! from inside the sandbox's own network namespace, so it reaches that loopback and nothing else), at most
//! [`MAX_CONNECTIONS`] per sandbox at once; bodies flow as they come (the sandbox's server and the client set the
//! pace, nothing piles up in the server); the server's own credentials (`Authorization`, `X-API-Key`, the tokens)
//! are never passed into the sandbox.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;

use crate::error::ApiError;
pub use crate::registry::MAX_PORT_CONNECTIONS as MAX_CONNECTIONS;
use crate::registry::SandboxEntry;
use crate::service::blocking;
use strata_core::PortStream;

/// Headers that carry the server's or the sandbox's credentials, never passed into the sandbox.
const CREDENTIALS: [&str; 6] =
    ["authorization", "x-api-key", "x-access-token", "e2b-traffic-access-token", "e2b-sandbox-id", "e2b-sandbox-port"];

/// A port number from a path segment or header: 1–65535.
pub fn parse_port(text: &str) -> Result<u16, ApiError> {
    text.parse::<u16>().ok().filter(|port| *port != 0).ok_or_else(|| {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_port", format!("{text:?} is not a port number (1-65535)"))
    })
}

/// How the request reaches the sandbox's server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostHeader {
    /// `Host: 127.0.0.1:PORT`, as a client inside the sandbox would send it (the native route: the server's own
    /// address means nothing to the sandbox's server, and development servers accept local names).
    Local,
    /// The client's own `Host` (`{port}-{id}.{domain}`), as E2B's proxy passes it.
    Kept,
}

/// Forwards `request` (its path and query already the sandbox-side ones) to `port` of `entry`'s sandbox and returns
/// the answer; a `101 Switching Protocols` joins the two upgraded connections until either side closes.
pub async fn proxy(
    entry: Arc<SandboxEntry>,
    port: u16,
    path_and_query: &str,
    host: HostHeader,
    request: Request<Body>,
) -> Result<Response, ApiError> {
    let slot = entry.port_connections.take(&entry.id)?;
    let target = entry.clone();
    let stream = blocking(move || target.call(|sandbox| sandbox.connect_port(port))).await?;
    let internal = |e: std::io::Error| ApiError::internal(format!("port {port}: {e}"));
    match stream {
        PortStream::Tcp(stream) => {
            stream.set_nonblocking(true).map_err(internal)?;
            let stream = tokio::net::TcpStream::from_std(stream).map_err(internal)?;
            relay(stream, slot, port, path_and_query, host, request).await
        }
        PortStream::Unix(stream) => {
            stream.set_nonblocking(true).map_err(internal)?;
            let stream = tokio::net::UnixStream::from_std(stream).map_err(internal)?;
            relay(stream, slot, port, path_and_query, host, request).await
        }
    }
}

/// [`proxy`] over the connection `stream` to the sandbox's port.
async fn relay<S>(
    stream: S,
    slot: crate::registry::Slot,
    port: u16,
    path_and_query: &str,
    host: HostHeader,
    mut request: Request<Body>,
) -> Result<Response, ApiError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::Builder::new()
        .handshake::<_, Body>(TokioIo::new(stream))
        .await
        .map_err(|e| bad_gateway(port, &e))?;
    tokio::spawn(async move {
        // The slot is held while the connection (or what it was upgraded to) lives.
        let _slot = slot;
        let _ = connection.with_upgrades().await;
    });
    *request.uri_mut() = path_and_query
        .parse()
        .map_err(|_| ApiError::bad_request("invalid_path", format!("{path_and_query:?} is not a request path")))?;
    strip(request.headers_mut(), host, port);
    let upgrading = request.headers().get(header::UPGRADE).is_some();
    let client_side = upgrading.then(|| hyper::upgrade::on(&mut request));
    let mut response = sender.send_request(request).await.map_err(|e| bad_gateway(port, &e))?;
    if response.status() == StatusCode::SWITCHING_PROTOCOLS
        && let Some(client_side) = client_side
    {
        let sandbox_side = hyper::upgrade::on(&mut response);
        tokio::spawn(async move {
            if let (Ok(client), Ok(sandbox)) = (client_side.await, sandbox_side.await) {
                let _ = tokio::io::copy_bidirectional(&mut TokioIo::new(client), &mut TokioIo::new(sandbox)).await;
            }
        });
    }
    Ok(response.map(Body::new).into_response())
}

fn bad_gateway(port: u16, err: &dyn std::fmt::Display) -> ApiError {
    ApiError::new(StatusCode::BAD_GATEWAY, "port_closed", format!("the sandbox's server on port {port}: {err}"))
}

/// Takes the credentials out of a request bound for the sandbox and sets its `Host`.
fn strip(headers: &mut HeaderMap, host: HostHeader, port: u16) {
    for name in CREDENTIALS {
        headers.remove(HeaderName::from_static(name));
    }
    if host == HostHeader::Local
        && let Ok(value) = HeaderValue::from_str(&format!("127.0.0.1:{port}"))
    {
        headers.insert(header::HOST, value);
    }
}

/// The sandbox and port of a Host name `{port}-{id}.{domain}` (the port first, as E2B's `get_host` makes it).
pub fn from_host<'a>(host: &'a str, domain: &str) -> Option<(&'a str, u16)> {
    let host = host.split(':').next()?;
    let label = host.strip_suffix(domain)?.strip_suffix('.')?;
    let (port, id) = label.split_once('-')?;
    if id.is_empty() || id.contains('.') {
        return None;
    }
    Some((id, port.parse().ok().filter(|p| *p != 0)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_name_names_a_port_and_a_sandbox_of_the_domain_only() {
        assert_eq!(from_host("8000-sb_abc.sandbox.example", "sandbox.example"), Some(("sb_abc", 8000)));
        assert_eq!(from_host("8000-sb_abc.sandbox.example:3000", "sandbox.example"), Some(("sb_abc", 8000)));
        assert_eq!(from_host("8000-sb_abc.other.example", "sandbox.example"), None);
        assert_eq!(from_host("sandbox.example", "sandbox.example"), None);
        assert_eq!(from_host("x-sb_abc.sandbox.example", "sandbox.example"), None);
        assert_eq!(from_host("0-sb_abc.sandbox.example", "sandbox.example"), None);
        assert_eq!(from_host("8000-.sandbox.example", "sandbox.example"), None);
        assert_eq!(from_host("8000-a.b.sandbox.example", "sandbox.example"), None);
        assert_eq!(from_host("8000-sb_abcsandbox.example", "sandbox.example"), None);
    }

    #[test]
    fn credentials_never_reach_the_sandbox() {
        let mut headers = HeaderMap::new();
        for name in CREDENTIALS {
            headers.insert(HeaderName::from_static(name), HeaderValue::from_static("secret"));
        }
        headers.insert(header::COOKIE, HeaderValue::from_static("app=1"));
        headers.insert(header::HOST, HeaderValue::from_static("127.0.0.1:3000"));
        strip(&mut headers, HostHeader::Local, 8000);
        assert_eq!(headers.len(), 2, "{headers:?}");
        assert_eq!(headers[header::HOST], "127.0.0.1:8000");
        assert_eq!(headers[header::COOKIE], "app=1");
        assert!(parse_port("0").is_err() && parse_port("65536").is_err() && parse_port("x").is_err());
        assert_eq!(parse_port("8000").ok(), Some(8000));
    }
}
