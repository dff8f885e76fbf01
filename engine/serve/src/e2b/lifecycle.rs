//! E2B's lifecycle on Strata's snapshots: `pause` and resume (`connect`), `create_snapshot` / `list_snapshots` /
//! `delete_snapshot` and `Sandbox.create(snapshot_id)`, and `fork(count)`.
//!
//! What a pause keeps is what the sandbox's tier snapshots ([`strata_core::snapshot::Persisted`]): on the process
//! tier, every E2B sandbox's, that is its **filesystem** (the home and `/tmp` included), not its processes or
//! memory — E2B's `mode="filesystem"`. A paused sandbox holds no jail, no memory and no admission place; it keeps
//! its id, its tokens and its metadata, and `connect` starts it again as a fork of its snapshot under the same id,
//! so the SDK object that paused it goes on working. `fork` checkpoints the live sandbox the same way and starts
//! each fork from it independently (one that cannot start is an error in its place of the answer, the others run).
//!
//! A `strata-wasm-python` sandbox shares its home with the host, which no snapshot holds: it cannot be paused,
//! snapshotted or forked (a typed 400 says so).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Extension, Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use strata_core::{Limits, Snapshot};
use strata_engine::TierChoice;

use super::control::{e2b_sandbox, sandbox_json};
use super::{E2bError, E2bMeta};
use crate::error::ApiError;
use crate::registry::{SandboxEntry, lock, new_id};
use crate::service::blocking;
use crate::{AppState, Principal};

/// The most forks one `fork` makes (E2B's limit).
pub const MAX_FORKS: usize = 20;

/// How long a pause or a fork waits for the sandbox's calls in flight to end before it snapshots.
const QUIESCE: Duration = Duration::from_secs(10);

/// A paused sandbox: its snapshot and what the E2B layer and the registry knew of it.
#[derive(Debug)]
pub(super) struct Paused {
    owner: String,
    snapshot: Snapshot,
    dir: PathBuf,
    meta: Arc<E2bMeta>,
    limits: Limits,
    created: SystemTime,
    paused_at: SystemTime,
}

/// The E2B layer's lifecycle state: paused sandboxes, and the template each E2B snapshot was taken of.
#[derive(Debug, Default)]
pub(super) struct Lifecycle {
    paused: std::sync::Mutex<HashMap<String, Paused>>,
    templates: std::sync::Mutex<HashMap<String, (String, Option<String>)>>,
}

impl Lifecycle {
    /// Whether `owner` has a paused sandbox `id`.
    pub(super) fn is_paused(&self, id: &str, owner: &str) -> bool {
        lock(&self.paused).get(id).is_some_and(|paused| paused.owner == owner)
    }

    /// The paused sandboxes of `owner`, as E2B lists them.
    pub(super) fn listed(&self, owner: &str) -> Vec<Value> {
        lock(&self.paused).iter().filter(|(_, p)| p.owner == owner).map(|(id, p)| paused_json(id, p)).collect()
    }

    /// Paused sandbox `id` of `owner` as `GET /sandboxes/{id}` answers it.
    pub(super) fn detail(&self, id: &str, owner: &str) -> Option<Value> {
        let paused = lock(&self.paused);
        let p = paused.get(id).filter(|p| p.owner == owner)?;
        let mut detail = paused_json(id, p);
        detail["envdAccessToken"] = json!(p.meta.access_token);
        detail["trafficAccessToken"] = json!(p.meta.traffic_token);
        Some(detail)
    }

    /// Drops paused sandbox `id` of `owner` and its snapshot (`kill`); whether there was one.
    pub(super) fn kill(&self, id: &str, owner: &str) -> bool {
        let taken = {
            let mut paused = lock(&self.paused);
            if paused.get(id).is_some_and(|p| p.owner == owner) { paused.remove(id) } else { None }
        };
        match taken {
            Some(paused) => {
                remove_dir(&paused.dir);
                true
            }
            None => false,
        }
    }

    /// The E2B template snapshot `id` was taken of, and its name, when the E2B layer took it.
    pub(super) fn snapshot_template(&self, id: &str) -> Option<(String, Option<String>)> {
        lock(&self.templates).get(id).cloned()
    }
}

fn remove_dir(dir: &std::path::Path) {
    if let Err(err) = std::fs::remove_dir_all(dir)
        && err.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(dir = %dir.display(), error = %err, "removing a paused sandbox's snapshot failed");
    }
}

fn paused_json(id: &str, paused: &Paused) -> Value {
    json!({
        "templateID": paused.meta.template,
        "alias": paused.meta.template,
        "sandboxID": id,
        "clientID": "strata",
        "startedAt": super::rfc3339(paused.created),
        "endAt": super::rfc3339(paused.paused_at),
        "cpuCount": paused.limits.vcpus,
        "memoryMB": paused.limits.memory.0 >> 20,
        "diskSizeMB": paused.limits.disk.0 >> 20,
        "metadata": paused.meta.metadata,
        "state": "paused",
        "envdVersion": super::ENVD_VERSION,
    })
}

/// A sandbox whose home is a host directory cannot be snapshotted.
fn refuse_shared_home(meta: &E2bMeta, doing: &str) -> Result<(), E2bError> {
    if meta.home.is_some() {
        return Err(ApiError::bad_request(
            "unsupported",
            format!(
                "a {} sandbox cannot be {doing}: its /home/user is a host directory no snapshot holds",
                super::interpreter::WASM_TEMPLATE
            ),
        )
        .into());
    }
    Ok(())
}

/// Snapshots `entry` into a new directory under the server's, once the calls in flight have ended (its commands
/// were stopped first by the caller, or are waited for).
async fn checkpoint(state: &Arc<AppState>, entry: &Arc<SandboxEntry>) -> Result<(Snapshot, PathBuf), E2bError> {
    let dir = state.snapshot_dir.join(new_id("snap_"));
    let (entry, target) = (entry.clone(), dir.clone());
    let snapshot = blocking(move || {
        let deadline = Instant::now() + QUIESCE;
        loop {
            match entry.snapshot(&target) {
                Err(crate::registry::RegistryError::Tier(strata_core::TierError::Busy { .. }))
                    if Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(20));
                }
                other => return other.map_err(ApiError::from),
            }
        }
    })
    .await?;
    Ok((snapshot, dir))
}

/// `POST /sandboxes/{id}/pause`: stops the sandbox's commands, snapshots its filesystem and ends it; it keeps its
/// id and tokens until `connect` resumes it or `kill` drops it. 409 when it is already paused.
pub(super) async fn pause(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<StatusCode, E2bError> {
    if state.e2b.lifecycle.is_paused(&id, &principal.name) {
        return Err(ApiError::new(StatusCode::CONFLICT, "conflict", format!("sandbox {id} is already paused")).into());
    }
    let (entry, meta) = e2b_sandbox(&state, &id, &principal)?;
    refuse_shared_home(&meta, "paused")?;
    meta.stop_jobs();
    let (snapshot, dir) = checkpoint(&state, &entry).await?;
    let paused = Paused {
        owner: principal.name.clone(),
        snapshot,
        dir,
        meta: meta.clone(),
        limits: entry.limits.clone(),
        created: entry.created,
        paused_at: SystemTime::now(),
    };
    lock(&state.e2b.lifecycle.paused).insert(id.clone(), paused);
    crate::service::kill_sandbox(&state, &principal, &id).await?;
    tracing::info!(sandbox = %id, "sandbox paused");
    Ok(StatusCode::NO_CONTENT)
}

/// Resumes paused sandbox `id` of `principal` (from `connect`) as a fork of its snapshot under the same id and
/// tokens, living `ttl`; the snapshot goes once it runs. A start that fails leaves it paused.
pub(super) async fn resume(
    state: &Arc<AppState>,
    principal: &Principal,
    id: &str,
    ttl: Duration,
) -> Result<(Arc<SandboxEntry>, Arc<E2bMeta>), E2bError> {
    let paused = {
        let mut all = lock(&state.e2b.lifecycle.paused);
        match all.get(id) {
            Some(p) if p.owner == principal.name => all.remove(id),
            _ => None,
        }
    }
    .ok_or_else(|| ApiError::sandbox_not_found(id))?;
    let started = start_fork(state, principal, id.to_owned(), &paused.snapshot, paused.limits.clone(), ttl).await;
    let entry = match started {
        Ok(entry) => entry,
        Err(err) => {
            lock(&state.e2b.lifecycle.paused).insert(id.to_owned(), paused);
            return Err(err);
        }
    };
    let meta = state.e2b.adopt(&entry, paused.meta.renewed());
    super::interpreter::prestart(&entry, &meta);
    remove_dir(&paused.dir);
    tracing::info!(sandbox = %id, "sandbox resumed");
    Ok((entry, meta))
}

/// Starts a fork of `snapshot` registered as sandbox `id` of `principal`.
async fn start_fork(
    state: &Arc<AppState>,
    principal: &Principal,
    id: String,
    snapshot: &Snapshot,
    limits: Limits,
    ttl: Duration,
) -> Result<Arc<SandboxEntry>, E2bError> {
    let mut reservation = crate::service::reserve(state, principal, 1, &limits)?;
    let (engine, snapshot) = (state.engine.clone(), snapshot.clone());
    let started = Instant::now();
    let sandbox =
        blocking(move || engine.fork(TierChoice::Tier(snapshot.tier), &snapshot).map_err(ApiError::from)).await?;
    let tier = sandbox.tier();
    state.metrics.sandbox_created(tier);
    state.metrics.latency(tier.as_str(), "fork", started.elapsed());
    Ok(reservation.commit(SandboxEntry::new(id, principal.name.clone(), sandbox, limits, ttl)))
}

/// `POST /sandboxes/{id}/snapshots` `{name}`: a snapshot of the sandbox's filesystem, kept until deleted (a native
/// snapshot too: `GET /v1/snapshots` lists it), from which `Sandbox.create(snapshot_id)` starts sandboxes.
pub(super) async fn create_snapshot(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, E2bError> {
    #[derive(Debug, Default, Deserialize)]
    struct SnapshotRequest {
        name: Option<String>,
    }
    let req: SnapshotRequest = if body.is_empty() {
        SnapshotRequest::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| ApiError::bad_request("invalid_json", e.to_string()))?
    };
    if req.name.as_ref().is_some_and(|name| name.is_empty() || name.len() > 256 || name.contains('\0')) {
        return Err(E2bError::invalid_argument("a snapshot name is 1 to 256 characters"));
    }
    let (entry, meta) = e2b_sandbox(&state, &id, &principal)?;
    refuse_shared_home(&meta, "snapshotted")?;
    let (snapshot, dir) = checkpoint(&state, &entry).await?;
    let snap_id = dir.file_name().map_or_else(|| new_id("snap_"), |name| name.to_string_lossy().into_owned());
    let registered = state.registry.add_snapshot(crate::registry::SnapshotEntry {
        id: snap_id.clone(),
        owner: principal.name.clone(),
        source: id,
        created: SystemTime::now(),
        snapshot,
        dir,
    });
    lock(&state.e2b.lifecycle.templates).insert(registered.id.clone(), (meta.template.clone(), req.name.clone()));
    Ok((StatusCode::CREATED, Json(snapshot_json(&registered.id, req.name.as_deref()))).into_response())
}

fn snapshot_json(id: &str, name: Option<&str>) -> Value {
    json!({"snapshotID": id, "names": name.into_iter().collect::<Vec<_>>()})
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct SnapshotQuery {
    #[serde(rename = "sandboxID")]
    sandbox_id: Option<String>,
    name: Option<String>,
}

/// `GET /snapshots?sandboxID=&name=`: the key's snapshots, newest first (one page: no `nextToken`).
pub(super) async fn list_snapshots(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    query: Result<Query<SnapshotQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, E2bError> {
    let Query(query) = query.map_err(ApiError::from)?;
    let mut snapshots = state.registry.snapshots(&principal.name);
    snapshots.sort_by_key(|s| std::cmp::Reverse(s.created));
    let listed = snapshots
        .iter()
        .filter(|s| query.sandbox_id.as_ref().is_none_or(|source| *source == s.source))
        .filter_map(|s| {
            let name = state.e2b.lifecycle.snapshot_template(&s.id).and_then(|(_, name)| name);
            let wanted = query.name.as_ref().is_none_or(|asked| name.as_ref() == Some(asked));
            wanted.then(|| snapshot_json(&s.id, name.as_deref()))
        })
        .collect();
    Ok(Json(Value::Array(listed)))
}

/// `DELETE /templates/{id}`, as `delete_snapshot` calls it: removes one of the key's snapshots (404 when there is
/// none by that id: the SDK answers `False`).
pub(super) async fn delete_snapshot(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<StatusCode, E2bError> {
    let entry = state.registry.remove_snapshot(&id, &principal.name)?;
    lock(&state.e2b.lifecycle.templates).remove(&id);
    blocking(move || {
        std::fs::remove_dir_all(&entry.dir)
            .map_err(|e| ApiError::internal(format!("cannot remove snapshot {}: {e}", entry.id)))
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// A sandbox started from snapshot `snapshot_id` of `principal` (`Sandbox.create(snapshot_id)`), or `None` when the
/// key has no such snapshot (the name is then a template's).
pub(super) async fn create_from_snapshot(
    state: &Arc<AppState>,
    principal: &Principal,
    snapshot_id: &str,
    metadata: Value,
    ttl: Duration,
) -> Result<Option<(Arc<SandboxEntry>, Arc<E2bMeta>)>, E2bError> {
    let Ok(snapshot) = state.registry.snapshot(snapshot_id, &principal.name) else { return Ok(None) };
    let template = state.e2b.lifecycle.snapshot_template(snapshot_id).map_or_else(|| "base".to_owned(), |(t, _)| t);
    let limits = state.engine.default_limits().clone();
    let entry = start_fork(state, principal, new_id("sb_"), &snapshot.snapshot, limits, ttl).await?;
    let meta = E2bMeta::new(template, new_id("tok_") + &new_id(""), metadata, None, Vec::new());
    let meta = state.e2b.adopt(&entry, meta);
    super::interpreter::prestart(&entry, &meta);
    Ok(Some((entry, meta)))
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct ForkRequest {
    timeout: Option<u64>,
    count: Option<usize>,
}

/// `POST /sandboxes/{id}/fork` `{timeout, count}`: checkpoints the sandbox in place (its commands go on; calls in
/// flight are waited for) and starts `count` (1 to [`MAX_FORKS`]) forks of it, each a new E2B sandbox with its own
/// tokens, or, where one cannot start, the error in its place.
pub(super) async fn fork(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, E2bError> {
    let req: ForkRequest = if body.is_empty() {
        ForkRequest::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| ApiError::bad_request("invalid_json", e.to_string()))?
    };
    let count = req.count.unwrap_or(1);
    if count == 0 || count > MAX_FORKS {
        return Err(E2bError::invalid_argument(format!("count must be between 1 and {MAX_FORKS}")));
    }
    let ttl = crate::service::ttl(&state, req.timeout)?;
    let (entry, meta) = e2b_sandbox(&state, &id, &principal)?;
    refuse_shared_home(&meta, "forked")?;
    let (snapshot, dir) = checkpoint(&state, &entry).await?;
    let mut results = Vec::with_capacity(count);
    for _ in 0..count {
        let forked = start_fork(&state, &principal, new_id("sb_"), &snapshot, entry.limits.clone(), ttl).await;
        results.push(match forked {
            Ok(fork) => {
                let fork_meta = E2bMeta::new(
                    meta.template.clone(),
                    new_id("tok_") + &new_id(""),
                    meta.metadata.clone(),
                    None,
                    meta.env.clone(),
                );
                let fork_meta = state.e2b.adopt(&fork, fork_meta);
                super::interpreter::prestart(&fork, &fork_meta);
                json!({"sandbox": sandbox_json(&fork, &fork_meta, state.domain.as_deref())})
            }
            Err(err) => json!({"error": {"code": err.status.as_u16(), "message": err.message}}),
        });
    }
    remove_dir(&dir);
    Ok((StatusCode::CREATED, Json(Value::Array(results))).into_response())
}
