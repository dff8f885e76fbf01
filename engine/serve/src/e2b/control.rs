//! E2B's control plane (behind API-key authentication): create, list, get, kill, time out, connect to and keep alive
//! E2B sandboxes, answered as E2B's API does.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Extension, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use strata_core::{Capabilities, EnvVar, Grant, GrantMode, TierKind, UserName};
use strata_engine::TierChoice;

use super::{E2bError, E2bMeta, ENVD_VERSION, HOME, e2b_sandbox, rfc3339, sandbox_json};
use crate::error::ApiError;
use crate::registry::{SandboxEntry, new_id};
use crate::service::start_sandbox;
use crate::{AppState, Principal};

/// `POST /sandboxes`, `POST /v2/sandboxes`: the body the SDK sends (unknown fields are ignored: SDK versions add
/// options this server does not have).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct CreateRequest {
    #[serde(rename = "templateID")]
    template_id: Option<String>,
    timeout: Option<u64>,
    #[serde(default)]
    metadata: Option<Value>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
    #[serde(default)]
    network: Option<super::network::NetworkConfig>,
    /// `lifecycle={"on_timeout": "pause"}`: paused, not killed, when its timeout ends.
    #[serde(default)]
    auto_pause: Option<bool>,
    /// `lifecycle={"auto_resume": True}`: resumed by the next envd call while paused.
    #[serde(default)]
    auto_resume: Option<AutoResume>,
}

/// `autoResume` of a create request.
#[derive(Debug, Deserialize)]
pub(super) struct AutoResume {
    #[serde(default)]
    enabled: bool,
}

fn listed_json(entry: &SandboxEntry, meta: &E2bMeta) -> Value {
    let end = UNIX_EPOCH + Duration::from_secs(entry.expires_at());
    json!({
        "templateID": meta.template,
        "alias": meta.template,
        "sandboxID": entry.id,
        "clientID": "strata",
        "startedAt": rfc3339(entry.created),
        "endAt": rfc3339(end),
        "cpuCount": entry.limits.vcpus,
        "memoryMB": entry.limits.memory.0 >> 20,
        "diskSizeMB": entry.limits.disk.0 >> 20,
        "metadata": meta.metadata,
        "state": "running",
        "envdVersion": ENVD_VERSION,
    })
}

pub(super) async fn create(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    body: Bytes,
) -> Result<Response, E2bError> {
    let req: CreateRequest = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request("invalid_json", format!("invalid sandbox request: {e}")))?;
    let env = req
        .env_vars
        .unwrap_or_default()
        .into_iter()
        .map(|(name, value)| {
            if name.is_empty() || name.contains(['=', '\0']) || value.contains('\0') {
                return Err(ApiError::bad_request("invalid_capability", format!("invalid envVars name {name:?}")));
            }
            Ok(EnvVar { name, value })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let ttl = crate::service::ttl(&state, req.timeout)?;
    let template = req.template_id.unwrap_or_else(|| "base".to_owned());
    // `Sandbox.create(snapshot_id)`: a fork of one of the key's snapshots.
    let metadata = req.metadata.clone().unwrap_or_else(|| json!({}));
    if let Some((entry, meta)) =
        super::lifecycle::create_from_snapshot(&state, &principal, &template, metadata, ttl).await?
    {
        return Ok((StatusCode::CREATED, Json(sandbox_json(&entry, &meta, state.domain.as_deref()))).into_response());
    }
    // Commands run as the image's `user` (uid 1000, passwordless sudo), in its home, which is part of the sandbox's
    // own filesystem (so its snapshots and forks hold it). The wasm-Python template instead shares `/home/user`
    // with its wasm Python session as a host directory, and runs commands as the sandbox's root.
    let (home, grants, user) = if template == super::WASM_TEMPLATE {
        let home = state.snapshot_dir.join("e2b").join(new_id("home_"));
        std::fs::create_dir_all(&home)
            .map_err(|e| ApiError::internal(format!("cannot create {}: {e}", home.display())))?;
        let grant = Grant::new(&home, HOME, GrantMode::Rw).map_err(|e| ApiError::internal(e.to_string()))?;
        (Some(home), vec![grant], None)
    } else {
        (None, Vec::new(), Some(UserName::new(super::USER).map_err(|e| ApiError::internal(e.to_string()))?))
    };
    let image = super::template_image(&state, &template)?;
    // A custom image's account is its own unless a command names one (E2B's templates have `user`).
    let user = if image.is_some() { None } else { user };
    let network = req.network.unwrap_or_default();
    // Always a proxy, even with nothing allowed: `update_network` can open it later.
    let net = network.net(&state)?;
    let egress_secrets = match network.rules() {
        Some(rules) => super::secrets::rules_to_secrets(&state, &principal, rules, net.allowlist())?,
        None => Vec::new(),
    };
    let caps = Capabilities { env: env.clone(), grants, net, user, egress_secrets, image, ..Capabilities::default() };
    let mut meta = E2bMeta::new(
        template,
        new_id("tok_") + &new_id(""),
        req.metadata.unwrap_or_else(|| json!({})),
        home.clone(),
        env,
    );
    meta.owner = Some(principal.clone());
    meta.auto_pause = req.auto_pause.unwrap_or(false);
    meta.auto_resume = req.auto_resume.is_some_and(|auto| auto.enabled);
    let limits = state.engine.default_limits().clone();
    let choice = TierChoice::Tier(TierKind::Process);
    let entry = match start_sandbox(&state, &principal, choice, caps, limits, ttl).await {
        Ok(entry) => entry,
        Err(err) => {
            if let Some(home) = &home {
                let _ = std::fs::remove_dir_all(home);
            }
            return Err(err.into());
        }
    };
    let meta = state.e2b.adopt_started(&entry, meta);
    Ok((StatusCode::CREATED, Json(sandbox_json(&entry, &meta, state.domain.as_deref()))).into_response())
}

/// `GET /sandboxes`, `GET /v2/sandboxes?state=running&state=paused&metadata=…`: the key's E2B sandboxes, running and
/// paused, filtered as asked (one page: no `x-next-token`).
pub(super) async fn list(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    uri: axum::http::Uri,
) -> Json<Value> {
    let filter = ListFilter::of_query(uri.query().unwrap_or(""));
    let list = state
        .registry
        .list(Some(&principal.name))
        .iter()
        .filter_map(|entry| state.e2b.sandbox(&entry.id).map(|meta| listed_json(entry, &meta)))
        .chain(state.e2b.lifecycle.listed(&state, &principal.name))
        .filter(|sandbox| filter.keeps(sandbox))
        .collect();
    Json(Value::Array(list))
}

/// What a list query keeps: the states named (all when none is), and the sandboxes whose metadata holds every pair.
#[derive(Debug, Default, PartialEq)]
struct ListFilter {
    states: Vec<String>,
    metadata: Vec<(String, String)>,
}

impl ListFilter {
    /// `state` may repeat; `metadata` is itself a form (`k=v&k2=v2`, each part percent-encoded once more).
    fn of_query(query: &str) -> ListFilter {
        let mut filter = ListFilter::default();
        for (key, value) in form_urlencoded::parse(query.as_bytes()) {
            match key.as_ref() {
                "state" => filter.states.extend(value.split(',').map(str::to_owned)),
                "metadata" => filter
                    .metadata
                    .extend(form_urlencoded::parse(value.as_bytes()).map(|(k, v)| (k.into_owned(), v.into_owned()))),
                _ => {}
            }
        }
        filter
    }

    fn keeps(&self, sandbox: &Value) -> bool {
        let state = sandbox["state"].as_str().unwrap_or("running");
        (self.states.is_empty() || self.states.iter().any(|s| s == state))
            && self.metadata.iter().all(|(k, v)| sandbox["metadata"][k.as_str()].as_str() == Some(v.as_str()))
    }
}

pub(super) async fn detail(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<Value>, E2bError> {
    state.e2b.lifecycle.settle(&state, &id).await;
    if let Some(paused) = state.e2b.lifecycle.detail(&state, &id, &principal.name) {
        return Ok(Json(paused));
    }
    let (entry, meta) = e2b_sandbox(&state, &id, &principal)?;
    let mut detail = listed_json(&entry, &meta);
    detail["envdAccessToken"] = json!(meta.access_token);
    detail["trafficAccessToken"] = json!(meta.traffic_token);
    Ok(Json(detail))
}

/// `?start=&end=` of a metrics request: Unix seconds.
#[derive(Debug, Default, Deserialize)]
pub(super) struct MetricsQuery {
    start: Option<f64>,
    end: Option<f64>,
}

/// One sample in E2B's `SandboxMetric` shape.
fn metric_json(sample: &crate::usage::UsageSample) -> Value {
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_secs_f64(sample.timestamp);
    json!({
        "timestamp": super::rfc3339(at),
        "timestampUnix": sample.timestamp as u64,
        "cpuCount": sample.cpu_count,
        "cpuUsedPct": sample.cpu_used_pct,
        "memUsed": sample.memory_used,
        "memTotal": sample.memory_total,
        "memCache": sample.memory_cache,
        "diskUsed": sample.disk_used,
        "diskTotal": sample.disk_total,
    })
}

/// `GET /sandboxes/{id}/metrics`: the sandbox's samples ([`crate::usage`]) between `start` and `end`, a fresh one
/// taken now among them, in E2B's `SandboxMetric` shape.
pub(super) async fn metrics(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    query: Result<axum::extract::Query<MetricsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, E2bError> {
    let axum::extract::Query(query) = query.map_err(crate::error::ApiError::from)?;
    let (entry, _) = e2b_sandbox(&state, &id, &principal)?;
    let sampled = entry.clone();
    crate::service::blocking(move || sampled.sample_usage()).await?;
    let samples = entry.usage.between(query.start, query.end);
    Ok(Json(Value::Array(samples.iter().map(metric_json).collect())))
}

/// `?sandbox_ids=a,b` of a batch metrics request.
#[derive(Debug, Deserialize)]
pub(super) struct BatchQuery {
    sandbox_ids: String,
}

/// The most sandboxes one batch metrics request names.
const MAX_BATCH: usize = 100;

/// `GET /sandboxes/metrics?sandbox_ids=a,b`: the latest sample of each of the key's E2B sandboxes named, taken now,
/// as `{"sandboxes": {id: SandboxMetric}}`; ids that name no such sandbox are left out.
pub(super) async fn batch_metrics(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    query: Result<axum::extract::Query<BatchQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, E2bError> {
    let axum::extract::Query(query) = query.map_err(crate::error::ApiError::from)?;
    let ids: Vec<&str> = query.sandbox_ids.split(',').filter(|id| !id.is_empty()).collect();
    if ids.len() > MAX_BATCH {
        return Err(E2bError::invalid_argument(format!("{} sandbox ids (at most {MAX_BATCH})", ids.len())));
    }
    let entries: Vec<_> =
        ids.iter().filter_map(|id| e2b_sandbox(&state, id, &principal).ok().map(|(e, _)| e)).collect();
    let sampled = crate::service::blocking(move || {
        Ok::<_, crate::error::ApiError>(
            entries
                .into_iter()
                .filter(|entry| entry.sample_usage().is_ok())
                .filter_map(|entry| entry.usage.between(None, None).last().map(|s| (entry.id.clone(), metric_json(s))))
                .collect::<serde_json::Map<String, Value>>(),
        )
    })
    .await?;
    Ok(Json(json!({ "sandboxes": sampled })))
}

pub(super) async fn kill(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<StatusCode, E2bError> {
    state.e2b.lifecycle.settle(&state, &id).await;
    if state.e2b.lifecycle.kill(&state, &id, &principal.name) {
        return Ok(StatusCode::NO_CONTENT);
    }
    let (_, meta) = e2b_sandbox(&state, &id, &principal)?;
    // Its commands and watchers stop first, so that killing it does not wait on them; the rest goes with it.
    meta.stop_jobs();
    crate::service::kill_sandbox(&state, &principal, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize)]
pub(super) struct TimeoutRequest {
    timeout: u64,
}

pub(super) async fn set_timeout(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<StatusCode, E2bError> {
    let req: TimeoutRequest =
        serde_json::from_slice(&body).map_err(|e| ApiError::bad_request("invalid_json", e.to_string()))?;
    let (entry, _) = e2b_sandbox(&state, &id, &principal)?;
    entry.set_ttl(crate::service::ttl(&state, Some(req.timeout))?);
    Ok(StatusCode::NO_CONTENT)
}

pub(super) async fn connect(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, E2bError> {
    let timeout = serde_json::from_slice::<TimeoutRequest>(&body).ok().map(|req| req.timeout);
    // A paused sandbox is resumed (201), a running one only given its new timeout (200), as E2B answers.
    state.e2b.lifecycle.settle(&state, &id).await;
    if state.e2b.lifecycle.is_paused(&state, &id, &principal.name) {
        let ttl = crate::service::ttl(&state, timeout)?;
        let (entry, meta) = super::lifecycle::resume(&state, &principal, &id, ttl).await?;
        return Ok((StatusCode::CREATED, Json(sandbox_json(&entry, &meta, state.domain.as_deref()))).into_response());
    }
    let (entry, meta) = e2b_sandbox(&state, &id, &principal)?;
    if let Some(timeout) = timeout {
        entry.set_ttl(crate::service::ttl(&state, Some(timeout))?);
    }
    Ok(Json(sandbox_json(&entry, &meta, state.domain.as_deref())).into_response())
}

pub(super) async fn refresh(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<StatusCode, E2bError> {
    e2b_sandbox(&state, &id, &principal)?;
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_queries_filter_by_state_and_metadata_as_the_sdk_sends_them() {
        // `SandboxQuery(metadata={"user id": "a&b"}, state=["paused"])` as the Python SDK encodes it.
        let filter = ListFilter::of_query("metadata=user%2520id%3Da%2526b&state=paused&state=running&limit=100");
        assert_eq!(filter.states, ["paused", "running"]);
        assert_eq!(filter.metadata, [("user id".to_owned(), "a&b".to_owned())]);
        assert!(filter.keeps(&json!({"state": "paused", "metadata": {"user id": "a&b", "x": "y"}})));
        assert!(!filter.keeps(&json!({"state": "paused", "metadata": {"user id": "a"}})));
        assert!(ListFilter::of_query("").keeps(&json!({"state": "running", "metadata": {}})));
        assert!(!ListFilter::of_query("state=paused").keeps(&json!({"state": "running", "metadata": {}})));
    }

    #[test]
    fn rfc3339_prints_utc_dates() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000000Z");
        assert_eq!(rfc3339(UNIX_EPOCH + Duration::from_secs(951_782_400)), "2000-02-29T00:00:00.000000Z");
        assert_eq!(rfc3339(UNIX_EPOCH + Duration::from_millis(1_796_105_201_500)), "2026-12-01T06:06:41.500000Z");
    }
}
