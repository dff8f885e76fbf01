//! E2B's ways to a sandbox's port (`crate::ports` proxies): the `E2b-Sandbox-Id` and `E2b-Sandbox-Port` headers on
//! the server's own address, and a Host name `{port}-{sandboxId}.{domain}` when the server has a domain. envd's
//! port (49983) and the code interpreter's (49999) are this server's own routes, never proxied.
//!
//! A request for a port carries the sandbox's traffic token (`E2B-Traffic-Access-Token`) or its access token
//! (`X-Access-Token`); a server without keys asks for neither, as its API asks for no key.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::AppState;
use crate::error::ApiError;
use crate::ports::{self, HostHeader};

/// envd's port and the code interpreter's: served by this server's own routes.
const OWN_PORTS: [u16; 2] = [49983, 49999];

/// Middleware: a request for a sandbox's port is proxied to it; anything else goes on to the routes.
pub(crate) async fn route(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let Some((id, port)) = target(&state, &request) else { return next.run(request).await };
    match proxied(&state, &id, port, request).await {
        Ok(response) => response,
        Err(err) => err.into_response(),
    }
}

/// The sandbox and port a request is for, if it is for one.
fn target(state: &AppState, request: &Request<Body>) -> Option<(String, u16)> {
    let headers = request.headers();
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if let (Some(id), Some(port)) = (header("e2b-sandbox-id"), header("e2b-sandbox-port")) {
        let port = port.parse::<u16>().ok()?;
        return (!OWN_PORTS.contains(&port)).then(|| (id.to_owned(), port));
    }
    let domain = state.domain.as_deref()?;
    let host = header("host")?;
    let (id, port) = ports::from_host(host, domain)?;
    (!OWN_PORTS.contains(&port)).then(|| (id.to_owned(), port))
}

async fn proxied(state: &AppState, id: &str, port: u16, request: Request) -> Result<Response, ApiError> {
    if port == 0 {
        return Err(ApiError::bad_request("invalid_port", "port 0"));
    }
    let entry = state.registry.get_any(id).ok_or_else(|| ApiError::sandbox_not_found(id))?;
    if state.keys.is_some() {
        let meta = state.e2b.sandbox(id).ok_or_else(|| ApiError::sandbox_not_found(id))?;
        let given = |name: &str| request.headers().get(name).and_then(|v| v.to_str().ok());
        let access = given("x-access-token").is_some_and(|t| super::signature::same_secret(t, &meta.access_token));
        let traffic =
            given("e2b-traffic-access-token").is_some_and(|t| super::signature::same_secret(t, &meta.traffic_token));
        if !access && !traffic {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                "a sandbox's ports take its E2B-Traffic-Access-Token or X-Access-Token",
            ));
        }
    }
    let path = request.uri().path_and_query().map_or("/", |p| p.as_str()).to_owned();
    ports::proxy(entry, port, &path, HostHeader::Kept, request).await
}
