//! The fleet's operations API: `GET /v1/nodes` (every node: state, capacity, what it holds) and
//! `POST /v1/nodes/{name}/drain` (no new placements on it; what it runs runs out), forwarded to the node named.

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Serialize;
use strata_fleet::Bins;

use super::placement::fleet_error;
use crate::{ApiError, AppState};

/// The routes (behind the API's authentication).
pub fn routes() -> Router<Arc<AppState>> {
    Router::new().route("/v1/nodes", get(nodes)).route("/v1/nodes/{name}/drain", post(drain))
}

/// One node as `GET /v1/nodes` shows it.
#[derive(Debug, Serialize)]
pub struct NodeInfo {
    /// Its name.
    pub name: String,
    /// `up`, `draining`, or `lost` (its lease expired while its alloc still holds sandboxes).
    pub state: &'static str,
    /// Where nodes reach it (absent once lost).
    pub advertise: Option<String>,
    /// Its current registration.
    pub incarnation: Option<u64>,
    /// CPUs, vCPU slots per CPU, slots in use.
    pub cpus: u32,
    /// vCPU slots per CPU.
    pub slots_per_cpu: u32,
    /// vCPU slots taken by its sandboxes.
    pub slots_used: u64,
    /// Bytes of memory limits it admits in all.
    pub memory: u64,
    /// Bytes of memory limits its sandboxes hold.
    pub memory_used: u64,
    /// Sandboxes placed on it (reserved or running).
    pub sandboxes: usize,
    /// Whether it is the node that answered.
    pub this: bool,
}

/// `GET /v1/nodes`.
#[derive(Debug, Serialize)]
pub struct NodeList {
    /// The answering node's name; `null` for a server that is not in a fleet.
    pub node: Option<String>,
    /// Every node, by name.
    pub nodes: Vec<NodeInfo>,
}

async fn nodes(State(state): State<Arc<AppState>>) -> Result<Json<NodeList>, ApiError> {
    let Some(fleet) = state.fleet.clone() else { return Ok(Json(NodeList { node: None, nodes: Vec::new() })) };
    let view = fleet.nodes().await.map_err(fleet_error)?;
    let mut names: Vec<&String> = view.nodes.keys().chain(view.allocs.keys()).collect();
    names.sort();
    names.dedup();
    let mut nodes = Vec::new();
    for name in names {
        let record = view.nodes.get(name).map(|r| &r.value);
        let alloc = view.allocs.get(name).map(|a| &a.value);
        let entries = alloc.map(|a| a.entries.as_slice()).unwrap_or_default();
        if record.is_none() && entries.is_empty() {
            continue;
        }
        let (cpus, slots) = record.map_or((0, 0), |r| (r.cpus, r.slots));
        let slots_used = Bins::with_entries(cpus, slots, entries).map_or(0, |bins| bins.slots_used());
        nodes.push(NodeInfo {
            name: name.clone(),
            state: match record {
                None => "lost",
                Some(r) if r.draining => "draining",
                Some(_) => "up",
            },
            advertise: record.map(|r| r.advertise.clone()),
            incarnation: record.map(|r| r.incarnation),
            cpus,
            slots_per_cpu: slots,
            slots_used,
            memory: record.map_or(0, |r| r.memory),
            memory_used: entries.iter().map(|e| e.memory).sum(),
            sandboxes: entries.len(),
            this: name == fleet.node(),
        });
    }
    Ok(Json(NodeList { node: Some(fleet.node().to_owned()), nodes }))
}

/// `POST /v1/nodes/{name}/drain`: this node's own, or forwarded to the node named.
async fn drain(State(state): State<Arc<AppState>>, Path(name): Path<String>, request: Request) -> Response {
    let Some(fleet) = state.fleet.clone() else {
        return ApiError::new(StatusCode::CONFLICT, "not_in_fleet", "this server is not a node of a fleet")
            .into_response();
    };
    if name == fleet.node() {
        return match fleet.set_draining(true).await {
            Ok(()) => {
                tracing::info!(node = %name, "draining: no new placements");
                (StatusCode::OK, Json(serde_json::json!({ "node": name, "state": "draining" }))).into_response()
            }
            Err(err) => fleet_error(err).into_response(),
        };
    }
    if request.headers().contains_key(super::proxy::HOP) {
        return ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("this node is not {name}")).into_response();
    }
    let view = match fleet.nodes().await {
        Ok(view) => view,
        Err(err) => return fleet_error(err).into_response(),
    };
    match view.nodes.get(&name) {
        Some(record) => match fleet.forward(&record.value.advertise, request).await {
            Ok(response) => response,
            Err(err) => err.into_response(),
        },
        None => {
            ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no node {name} in the fleet")).into_response()
        }
    }
}
