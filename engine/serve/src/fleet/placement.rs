//! Where a create goes: [`Placement`] is in scope (a task-local) while a create handler runs, and the handler's
//! `start_sandbox` asks it ([`Placement::decide`]): this node, as an id reserved and confirmed in etcd, or another
//! node, to which the create is forwarded with its reservation.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use strata_fleet::SandboxRequest;

use super::proxy::PLACED;
use super::{Fleet, FleetError};
use crate::{ApiError, AppState};

/// Nodes a create tries before it gives up.
const PLACEMENT_TRIES: usize = 4;

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
    pub(crate) fn client(fleet: Arc<Fleet>, parts: axum::http::request::Parts, body: Bytes) -> Placement {
        Placement {
            inner: Arc::new(PlacementInner {
                client: Some((fleet, parts, body)),
                placed: None,
                forwarded: Mutex::new(None),
            }),
        }
    }

    pub(crate) fn forwarded(id: String) -> Placement {
        Placement { inner: Arc::new(PlacementInner { client: None, placed: Some(id), forwarded: Mutex::new(None) }) }
    }

    pub(crate) async fn scope<F: std::future::Future<Output = Response>>(placement: Placement, f: F) -> Response {
        PLACEMENT.scope(placement, f).await
    }

    pub(crate) fn take_forwarded(&self) -> Option<Response> {
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
                fleet.counters.placed_here.fetch_add(1, Ordering::Relaxed);
                return Ok(Decision::Here(id));
            }
            let mut forwarded = Request::from_parts(parts.clone(), Body::from(body.clone()));
            if let Ok(value) = HeaderValue::from_str(&id) {
                forwarded.headers_mut().insert(PLACED, value);
            }
            let answer = fleet.forward(&plan.advertise, forwarded).await;
            if let Ok(response) = &answer
                && response.status().is_success()
            {
                // The node confirmed the reservation before it created the sandbox.
                fleet.counters.placed_elsewhere.fetch_add(1, Ordering::Relaxed);
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
            fleet.counters.refused.fetch_add(1, Ordering::Relaxed);
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
