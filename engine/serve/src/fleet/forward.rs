//! Requests between nodes: a request for a sandbox another node holds is forwarded to it unchanged (a WebSocket
//! or other upgrade joined both ways), and a create is placed on the fleet and forwarded to the node chosen.
//!
//! A forwarded request carries [`HOP`] (the forwarding node's name): a node never forwards such a request again,
//! so a stale catalog can cost one hop but never a loop. A create forwarded with a reservation carries
//! [`PLACED`] (the reserved sandbox id): the receiving node confirms that reservation in etcd before it creates
//! anything, so a header alone places nothing.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;
use strata_fleet::{Owner, SandboxRequest};

use super::{Fleet, FleetError};
use crate::{ApiError, AppState};

/// The header of a request one node forwarded to another: the forwarding node's name.
pub const HOP: &str = "x-strata-fleet-hop";

/// The header of a create forwarded with a reservation: the sandbox id reserved on the receiving node.
pub const PLACED: &str = "x-strata-fleet-placed";

/// How long a node waits to connect to another.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// Nodes a create tries before it gives up.
const PLACEMENT_TRIES: usize = 4;

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

/// Whether the request creates sandboxes (and so is placed on the fleet).
fn creates(request: &Request) -> bool {
    request.method() == Method::POST && matches!(request.uri().path(), "/v1/sandboxes" | "/sandboxes" | "/v2/sandboxes")
}

/// The answer for a sandbox whose node is gone from the fleet.
fn lost(path: &str, headers: &axum::http::HeaderMap, id: &str, node: &str) -> Response {
    let err = ApiError::new(
        StatusCode::GONE,
        "sandbox_lost",
        format!("sandbox {id} was on node {node}, which left the fleet (its lease expired); the sandbox is lost"),
    );
    if crate::native_path(path) {
        return err.into_response();
    }
    crate::e2b::E2bError::from(err).answer_to(path, headers)
}

/// The fleet's middleware: forwards requests for sandboxes other nodes hold, answers `sandbox_lost` for those of
/// nodes gone, and places creates ([`Placement`]). Without a fleet, or for a request another node forwarded, it
/// does nothing.
pub async fn route(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let Some(fleet) = state.fleet.clone() else { return next.run(request).await };
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
    let Some(id) = sandbox_of(&state, &request) else { return next.run(request).await };
    if state.registry.get_any(&id).is_some() || state.paused.get_any(&id).is_some() {
        return next.run(request).await;
    }
    match fleet.lookup(&id).await {
        Ok(Owner::Remote { advertise }) => {
            let (path, headers) = (request.uri().path().to_owned(), request.headers().clone());
            match forward(fleet.node(), &advertise, request).await {
                Ok(response) => response,
                Err(err) => {
                    // The owner may be gone (and the sandbox lost): ask etcd, not what was remembered.
                    fleet.forget_owner(&id);
                    match fleet.lookup(&id).await {
                        Ok(Owner::Lost { node }) => lost(&path, &headers, &id, &node),
                        _ => err.into_response(),
                    }
                }
            }
        }
        Ok(Owner::Lost { node }) => lost(request.uri().path(), request.headers(), &id, &node),
        Ok(Owner::Local | Owner::Unknown) => next.run(request).await,
        // etcd cannot say: answer from what this node holds (not found, in the API's own shape).
        Err(err) => {
            tracing::warn!(sandbox = %id, error = %err, "cannot look the sandbox up in the fleet");
            next.run(request).await
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

/// A create's placement, in scope while its handler runs (a task-local: the handler's `start_sandbox` reads it).
#[derive(Clone)]
pub struct Placement {
    inner: Arc<PlacementInner>,
}

impl std::fmt::Debug for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Placement").field("placed", &self.inner.placed).finish_non_exhaustive()
    }
}

struct PlacementInner {
    /// Set for a create that came from a client: the fleet, and the request as it came (to forward it).
    client: Option<(Arc<Fleet>, axum::http::request::Parts, Bytes)>,
    /// Set for a create another node forwarded with a reservation: the reserved id.
    placed: Option<String>,
    /// The answer of the node the create went to, when not this one.
    forwarded: Mutex<Option<Response>>,
}

tokio::task_local! {
    static PLACEMENT: Placement;
}

/// Where a sandbox is created, as [`Placement::decide`] settled it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Here, as this id, reserved and confirmed in etcd.
    Here(String),
    /// On another node, whose answer the middleware returns.
    Forwarded,
}

impl Placement {
    fn client(fleet: Arc<Fleet>, parts: axum::http::request::Parts, body: Bytes) -> Placement {
        Placement {
            inner: Arc::new(PlacementInner {
                client: Some((fleet, parts, body)),
                placed: None,
                forwarded: Mutex::new(None),
            }),
        }
    }

    fn forwarded(id: String) -> Placement {
        Placement { inner: Arc::new(PlacementInner { client: None, placed: Some(id), forwarded: Mutex::new(None) }) }
    }

    async fn scope<F: std::future::Future<Output = Response>>(placement: Placement, f: F) -> Response {
        PLACEMENT.scope(placement, f).await
    }

    fn take_forwarded(&self) -> Option<Response> {
        self.inner.forwarded.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take()
    }

    /// The placement in scope, if the current task runs a create handler.
    pub fn current() -> Option<Placement> {
        PLACEMENT.try_with(Clone::clone).ok()
    }

    /// Decides where a sandbox of `vcpus` and `memory` goes. A create forwarded with a reservation is confirmed
    /// here. One from a client is placed on the fleet: when the node chosen is this one, reserved and confirmed
    /// here; else forwarded there with its reservation, and, when that node refuses, released and tried on the
    /// next one.
    pub async fn decide(&self, state: &AppState, vcpus: u32, memory: u64) -> Result<Decision, ApiError> {
        let Some(fleet) = state.fleet.clone() else { return Ok(Decision::Here(crate::registry::new_id("sb_"))) };
        if let Some(id) = &self.inner.placed {
            fleet.confirm(std::slice::from_ref(id)).await.map_err(fleet_error)?;
            return Ok(Decision::Here(id.clone()));
        }
        let Some((_, parts, body)) = &self.inner.client else {
            return Err(ApiError::internal("a placement without its request"));
        };
        let mut exclude = BTreeSet::new();
        for _ in 0..PLACEMENT_TRIES {
            let id = crate::registry::new_id("sb_");
            let request = [SandboxRequest { id: id.clone(), vcpus, memory }];
            let plan = fleet.place(&request, &exclude).await.map_err(fleet_error)?;
            if plan.node == fleet.node() {
                fleet.confirm(std::slice::from_ref(&id)).await.map_err(fleet_error)?;
                return Ok(Decision::Here(id));
            }
            let mut forwarded = Request::from_parts(parts.clone(), Body::from(body.clone()));
            if let Ok(value) = HeaderValue::from_str(&id) {
                forwarded.headers_mut().insert(PLACED, value);
            }
            let answer = forward(fleet.node(), &plan.advertise, forwarded).await;
            if let Ok(response) = &answer
                && response.status().is_success()
            {
                // The node confirmed the reservation before it created the sandbox.
                let response = answer.unwrap_or_else(IntoResponse::into_response);
                *self.inner.forwarded.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(response);
                return Ok(Decision::Forwarded);
            }
            // Released unless the node confirmed it after all (then it released the sandbox itself if creating it
            // failed), and its answer stands.
            let released = fleet
                .release_reservation(&plan.node, plan.incarnation, std::slice::from_ref(&id))
                .await
                .map_err(fleet_error)?;
            let retry = match &answer {
                Ok(response) => released && refused(response.status()),
                Err(_) => released,
            };
            if !retry {
                let response = answer.unwrap_or_else(IntoResponse::into_response);
                *self.inner.forwarded.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(response);
                return Ok(Decision::Forwarded);
            }
            let why = match &answer {
                Ok(response) => response.status().to_string(),
                Err(err) => err.message.clone(),
            };
            tracing::info!(node = %plan.node, sandbox = %id, %why, "the node refused a placement; trying another");
            exclude.insert(plan.node.clone());
        }
        Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "capacity_exhausted",
            format!("{PLACEMENT_TRIES} nodes of the fleet refused the sandbox"),
        ))
    }
}

/// Whether a node's answer to a forwarded create means it could not take it (so another node may): it is
/// full, draining, or out of the fleet, or it could not be reached.
fn refused(status: StatusCode) -> bool {
    matches!(status, StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS | StatusCode::BAD_GATEWAY)
}

/// A fleet failure as the API answers it.
pub fn fleet_error(err: FleetError) -> ApiError {
    match err {
        FleetError::Plan(plan) => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "capacity_exhausted", format!("the fleet: {plan}"))
        }
        FleetError::Request(err) => ApiError::bad_request("invalid_request", err.to_string()),
        FleetError::ReservationLost(_) => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "placement_lost", err.to_string())
        }
        FleetError::AlreadyTaken(_) => ApiError::new(StatusCode::CONFLICT, "already_created", err.to_string()),
        other => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "fleet_unavailable", other.to_string()),
    }
}
