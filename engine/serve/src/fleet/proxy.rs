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

/// The `host:port` of an `http://host:port[/]` URL (the only form nodes and etcd are named by here).
pub fn authority(url: &str) -> Result<&str, String> {
    let rest = url.strip_prefix("http://").ok_or("not an http:// URL (TLS between nodes is not built yet)")?;
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.is_empty() || rest.contains(['/', '?', '#', '@']) {
        return Err("not a bare http://host:port URL".into());
    }
    let (_, port) = rest.rsplit_once(':').ok_or("no port")?;
    port.parse::<u16>().map_err(|_| "not a port number")?;
    Ok(rest)
}

/// Sends `request` to the node at `advertise` as it is (its path, query, headers and body), marked with [`HOP`],
/// and returns the node's answer unchanged; an upgrade (`101`) joins the two connections until either closes.
pub async fn forward(from: &str, advertise: &str, mut request: Request) -> Result<Response, ApiError> {
    let unreachable =
        |why: String| ApiError::new(StatusCode::BAD_GATEWAY, "node_unreachable", format!("node at {advertise}: {why}"));
    let authority = authority(advertise).map_err(|e| unreachable(e.to_owned()))?;
    let stream = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(authority))
        .await
        .map_err(|_| unreachable("no connection".into()))?
        .map_err(|e| unreachable(e.to_string()))?;
    let _ = stream.set_nodelay(true);
    let (mut sender, connection) = hyper::client::conn::http1::Builder::new()
        .handshake::<_, Body>(TokioIo::new(stream))
        .await
        .map_err(|e| unreachable(e.to_string()))?;
    tokio::spawn(async move {
        let _ = connection.with_upgrades().await;
    });
    let path = request.uri().path_and_query().map_or("/", |p| p.as_str()).to_owned();
    *request.uri_mut() = path.parse().map_err(|_| ApiError::bad_request("invalid_path", "an unusable request path"))?;
    if let Ok(value) = HeaderValue::from_str(from) {
        request.headers_mut().insert(HOP, value);
    }
    let upgrading = request.headers().get(header::UPGRADE).is_some();
    let client_side = upgrading.then(|| hyper::upgrade::on(&mut request));
    let mut response = sender.send_request(request).await.map_err(|e| unreachable(e.to_string()))?;
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
