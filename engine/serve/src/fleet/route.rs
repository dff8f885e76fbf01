//! The fleet's middleware: requests for sandboxes other nodes hold are forwarded to them ([`super::proxy`]),
//! those of nodes gone are answered `410 sandbox_lost`, and creates are placed on the fleet
//! ([`super::placement`]).

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use strata_fleet::Owner;

use super::Fleet;
use super::placement::Placement;
use super::proxy::{HOP, PLACED};
use crate::tls::NodePeer;
use crate::{ApiError, AppState};

/// The sandbox a request is for, by its path (`/v1/sandboxes/{id}…`, E2B's `/sandboxes/{id}…` and
/// `/v2/sandboxes/{id}…`) or, for the in-sandbox agent and ports, by E2B's `E2b-Sandbox-Id` header or a Host name
/// `{port}-{id}.{domain}`.
fn sandbox_of(state: &AppState, request: &Request) -> Option<String> {
    let path = request.uri().path();
    let under = ["/v1/sandboxes/", "/v2/sandboxes/", "/sandboxes/"];
    if let Some(rest) = under.iter().find_map(|prefix| path.strip_prefix(prefix)) {
        let id = rest.split('/').next().unwrap_or("");
        // `/sandboxes/metrics` is the batch of the key's own sandboxes.
        return (!id.is_empty() && id != "metrics").then(|| id.to_owned());
    }
    let headers = request.headers();
    if let Some(id) = headers.get("e2b-sandbox-id").and_then(|v| v.to_str().ok()) {
        return Some(id.to_owned());
    }
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok())?;
    let (id, _) = crate::ports::from_host(host, state.domain.as_deref()?)?;
    Some(id.to_owned())
}

/// The snapshot a request is for, by its path (`/v1/snapshots/{id}…`).
fn snapshot_of(request: &Request) -> Option<String> {
    let rest = request.uri().path().strip_prefix("/v1/snapshots/")?;
    let id = rest.split('/').next().unwrap_or("");
    (!id.is_empty()).then(|| id.to_owned())
}

/// A request for a snapshot: served here when this node holds it; else forwarded to the node that does, except a
/// fork that node has no room for (`503`), which is made here from a copy ([`super::snapshots`]).
async fn snapshot(state: &Arc<AppState>, fleet: &Arc<Fleet>, id: String, request: Request, next: Next) -> Response {
    if state.registry.holds_snapshot(&id) {
        return next.run(request).await;
    }
    match fleet.lookup_snapshot(&id).await {
        Ok(Owner::Remote { advertise }) => {
            fleet.counters.forwarded.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let forks = request.method() == Method::POST && request.uri().path().ends_with("/fork");
            if !forks {
                return fleet.forward(&advertise, request).await.unwrap_or_else(IntoResponse::into_response);
            }
            let (parts, body) = match buffered(state, request).await {
                Ok(both) => both,
                Err(response) => return response,
            };
            let again = || Request::from_parts(parts.clone(), Body::from(body.clone()));
            let answer = match fleet.forward(&advertise, again()).await {
                Ok(response) => full(response).await,
                Err(err) => {
                    tracing::info!(snapshot = %id, error = %err, "the snapshot's node did not answer a fork; forking a copy here");
                    Err(())
                }
            };
            match answer {
                Ok(response) => response,
                // The holder is full (or cannot be reached): fork here from a copy.
                Err(()) => {
                    let mut request = again();
                    request.extensions_mut().insert(super::snapshots::RemoteSnapshot { advertise });
                    next.run(request).await
                }
            }
        }
        Ok(Owner::Lost { node }) => {
            super::snapshots::forget_copy(state, &id);
            ApiError::new(
                StatusCode::GONE,
                "snapshot_lost",
                format!(
                    "snapshot {id} was on node {node}, which left the fleet (its lease expired); the snapshot is lost"
                ),
            )
            .into_response()
        }
        Ok(Owner::Local | Owner::Unknown) => {
            super::snapshots::forget_copy(state, &id);
            next.run(request).await
        }
        Err(err) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "fleet_unavailable",
            format!("cannot tell which node holds snapshot {id}: {err}"),
        )
        .into_response(),
    }
}

/// The holder's answer to a fork, or `Err` when it says it has no room (`503`, or `429 server_at_capacity`: its
/// own admission; a key's quota, `429 quota_exceeded`, is the answer).
async fn full(response: Response) -> Result<Response, ()> {
    match response.status() {
        StatusCode::SERVICE_UNAVAILABLE => Err(()),
        StatusCode::TOO_MANY_REQUESTS => {
            let (parts, body) = response.into_parts();
            let Ok(bytes) = axum::body::to_bytes(body, 64 << 10).await else { return Err(()) };
            let code = serde_json::from_slice::<serde_json::Value>(&bytes)
                .ok()
                .and_then(|v| v["error"]["code"].as_str().map(str::to_owned));
            if code.as_deref() == Some("server_at_capacity") {
                return Err(());
            }
            Ok(Response::from_parts(parts, Body::from(bytes)))
        }
        _ => Ok(response),
    }
}

/// Whether the request creates sandboxes (and so is placed on the fleet).
fn creates(request: &Request) -> bool {
    request.method() == Method::POST && matches!(request.uri().path(), "/v1/sandboxes" | "/sandboxes" | "/v2/sandboxes")
}

/// `err` in the shape of the route asked: the native API's, or E2B's.
fn answer(err: ApiError, path: &str, headers: &axum::http::HeaderMap) -> Response {
    if crate::native_path(path) {
        return err.into_response();
    }
    crate::e2b::E2bError::from(err).answer_to(path, headers)
}

/// The answer for a sandbox whose node is gone from the fleet.
fn lost(fleet: &Fleet, path: &str, headers: &axum::http::HeaderMap, id: &str, node: &str) -> Response {
    fleet.counters.lost.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let err = ApiError::new(
        StatusCode::GONE,
        "sandbox_lost",
        format!("sandbox {id} was on node {node}, which left the fleet (its lease expired); the sandbox is lost"),
    );
    answer(err, path, headers)
}

/// The fleet's middleware: forwards requests for sandboxes other nodes hold, answers `sandbox_lost` for those of
/// nodes gone, and places creates ([`Placement`]). Without a fleet, or for a request another node forwarded, it
/// does nothing.
pub async fn route(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let Some(fleet) = state.fleet.clone() else { return next.run(request).await };
    let internal = request.headers().contains_key(HOP) || request.headers().contains_key(PLACED);
    // In a fleet over mutual TLS only a node (a connection whose certificate chains to the fleet CA) may say a
    // request was forwarded; in a loopback fleet without TLS the headers are harmless (a hop only stops
    // forwarding, and a placement is confirmed in etcd before anything is created).
    if internal && fleet.mutual_tls() && request.extensions().get::<NodePeer>().is_none() {
        let err = ApiError::new(
            StatusCode::FORBIDDEN,
            "not_a_node",
            format!("{HOP} and {PLACED} are accepted only from the fleet's nodes (over mutual TLS)"),
        );
        return answer(err, request.uri().path(), request.headers());
    }
    if request.headers().contains_key(HOP) {
        let placed = request.headers().get(PLACED).and_then(|v| v.to_str().ok()).map(str::to_owned);
        return match placed {
            Some(id) if creates(&request) => Placement::scope(Placement::forwarded(id), next.run(request)).await,
            _ => next.run(request).await,
        };
    }
    if creates(&request) {
        return place(&state, &fleet, request, next).await;
    }
    if let Some(id) = snapshot_of(&request) {
        return snapshot(&state, &fleet, id, request, next).await;
    }
    let Some(id) = sandbox_of(&state, &request) else { return next.run(request).await };
    if state.registry.get_any(&id).is_some() || state.paused.get_any(&id).is_some() {
        return next.run(request).await;
    }
    match fleet.lookup(&id).await {
        Ok(Owner::Remote { advertise }) => {
            fleet.counters.forwarded.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let (path, headers) = (request.uri().path().to_owned(), request.headers().clone());
            match fleet.forward(&advertise, request).await {
                Ok(response) => response,
                Err(err) => {
                    // The owner may be gone (and the sandbox lost): ask etcd, not what was remembered.
                    fleet.forget_owner(&id);
                    match fleet.lookup(&id).await {
                        Ok(Owner::Lost { node }) => lost(&fleet, &path, &headers, &id, &node),
                        _ => err.into_response(),
                    }
                }
            }
        }
        Ok(Owner::Lost { node }) => lost(&fleet, request.uri().path(), request.headers(), &id, &node),
        Ok(Owner::Local | Owner::Unknown) => next.run(request).await,
        // etcd cannot say where it is: not "not found", which would be wrong if another node holds it.
        Err(err) => {
            tracing::warn!(sandbox = %id, error = %err, "cannot look the sandbox up in the fleet");
            let err = ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "fleet_unavailable",
                format!("cannot tell which node holds sandbox {id}: {err}"),
            );
            answer(err, request.uri().path(), request.headers())
        }
    }
}

/// Reads the whole body (up to the server's body limit) so the create can be sent on as it came.
async fn buffered(state: &AppState, request: Request) -> Result<(axum::http::request::Parts, Bytes), Response> {
    let (parts, body) = request.into_parts();
    let limit = state.connections.limits().max_body;
    match axum::body::to_bytes(body, limit).await {
        Ok(bytes) => Ok((parts, bytes)),
        Err(_) => Err(ApiError::too_large(Some(limit)).into_response()),
    }
}

/// Runs the create handler with a [`Placement`] in scope; when the handler's `start_sandbox` placed the sandbox
/// on another node, that node's answer is the answer.
async fn place(state: &AppState, fleet: &Arc<Fleet>, request: Request, next: Next) -> Response {
    let (parts, body) = match buffered(state, request).await {
        Ok(both) => both,
        Err(response) => return response,
    };
    let placement = Placement::client(fleet.clone(), parts.clone(), body.clone());
    let request = Request::from_parts(parts, Body::from(body));
    let response = Placement::scope(placement.clone(), next.run(request)).await;
    match placement.take_forwarded() {
        Some(forwarded) => forwarded,
        None => response,
    }
}
