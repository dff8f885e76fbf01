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
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Extension, Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{E2bError, E2bMeta, e2b_sandbox, sandbox_json};
use crate::error::ApiError;
use crate::paused::{PausedSandbox, checkpoint, start_fork};
use crate::registry::{SandboxEntry, lock, new_id};
use crate::service::blocking;
use crate::{AppState, Principal};

/// The most forks one `fork` makes (E2B's limit).
pub const MAX_FORKS: usize = 20;

/// The E2B layer's part of the lifecycle: what it knew of each paused E2B sandbox (its tokens, template, metadata;
/// the sandbox itself is in [`crate::paused`]), and the template each E2B snapshot was taken of.
#[derive(Debug, Default)]
pub(super) struct Lifecycle {
    paused: std::sync::Mutex<HashMap<String, Arc<E2bMeta>>>,
    templates: std::sync::Mutex<HashMap<String, (String, Option<String>)>>,
}

impl Lifecycle {
    /// Paused E2B sandbox `id` of `owner`: the paused sandbox and its E2B state.
    fn paused(&self, state: &AppState, id: &str, owner: &str) -> Option<(Arc<PausedSandbox>, Arc<E2bMeta>)> {
        let paused = state.paused.get(id, owner)?;
        let meta = lock(&self.paused).get(id).cloned()?;
        Some((paused, meta))
    }

    /// Waits while sandbox `id` is being paused by the reaper (`autoPause`: out of the registry, its snapshot not yet
    /// taken), so that no call sees it gone in between; at most [`crate::paused::QUIESCE`] and a little more.
    pub(super) async fn settle(&self, state: &AppState, id: &str) {
        let deadline = std::time::Instant::now() + crate::paused::QUIESCE + Duration::from_secs(5);
        while lock(&self.paused).contains_key(id)
            && state.paused.get_any(id).is_none()
            && state.registry.get_any(id).is_none()
            && std::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Whether `owner` has a paused E2B sandbox `id`.
    pub(super) fn is_paused(&self, state: &AppState, id: &str, owner: &str) -> bool {
        self.paused(state, id, owner).is_some()
    }

    /// The paused E2B sandboxes of `owner`, as E2B lists them.
    pub(super) fn listed(&self, state: &AppState, owner: &str) -> Vec<Value> {
        let metas = lock(&self.paused);
        state
            .paused
            .list(owner)
            .iter()
            .filter_map(|paused| metas.get(&paused.id).map(|meta| paused_json(paused, meta)))
            .collect()
    }

    /// Paused sandbox `id` of `owner` as `GET /sandboxes/{id}` answers it.
    pub(super) fn detail(&self, state: &AppState, id: &str, owner: &str) -> Option<Value> {
        let (paused, meta) = self.paused(state, id, owner)?;
        let mut detail = paused_json(&paused, &meta);
        detail["envdAccessToken"] = json!(meta.access_token);
        detail["trafficAccessToken"] = json!(meta.traffic_token);
        Some(detail)
    }

    /// Deletes paused sandbox `id` of `owner` and its snapshot (`kill`); whether there was one.
    pub(super) fn kill(&self, state: &AppState, id: &str, owner: &str) -> bool {
        if !state.paused.delete(id, owner) {
            return false;
        }
        lock(&self.paused).remove(id);
        true
    }

    /// The E2B state of the paused sandboxes, by id.
    pub(super) fn paused_metas(&self) -> &std::sync::Mutex<HashMap<String, Arc<E2bMeta>>> {
        &self.paused
    }

    /// The E2B template snapshot `id` was taken of, and its name, when the E2B layer took it.
    pub(super) fn snapshot_template(&self, id: &str) -> Option<(String, Option<String>)> {
        lock(&self.templates).get(id).cloned()
    }
}

fn paused_json(paused: &PausedSandbox, meta: &E2bMeta) -> Value {
    json!({
        "templateID": meta.template,
        "alias": meta.template,
        "sandboxID": paused.id,
        "clientID": "strata",
        "startedAt": super::rfc3339(paused.created),
        "endAt": super::rfc3339(paused.paused_at),
        "cpuCount": paused.limits.vcpus,
        "memoryMB": paused.limits.memory.0 >> 20,
        "diskSizeMB": paused.limits.disk.0 >> 20,
        "metadata": meta.metadata,
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
                super::WASM_TEMPLATE
            ),
        )
        .into());
    }
    Ok(())
}

/// `POST /sandboxes/{id}/pause`: stops the sandbox's commands and pauses it ([`crate::paused`]); it keeps its id
/// and tokens until `connect` resumes it or `kill` drops it. 409 when it is already paused.
pub(super) async fn pause(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<StatusCode, E2bError> {
    if state.e2b.lifecycle.is_paused(&state, &id, &principal.name) {
        return Err(ApiError::new(StatusCode::CONFLICT, "conflict", format!("sandbox {id} is already paused")).into());
    }
    let (_, meta) = e2b_sandbox(&state, &id, &principal)?;
    refuse_shared_home(&meta, "paused")?;
    meta.stop_jobs();
    lock(&state.e2b.lifecycle.paused).insert(id.clone(), meta);
    if let Err(err) = crate::paused::pause(&state, &principal, &id).await {
        lock(&state.e2b.lifecycle.paused).remove(&id);
        return Err(err.into());
    }
    Ok(StatusCode::NO_CONTENT)
}

/// Pauses an E2B sandbox with `autoPause` whose timeout ended instead of letting it go (the reaper took it out of
/// the registry and kills it next): blocking. Whether it was paused.
pub(crate) fn pause_on_expiry(state: &AppState, entry: &SandboxEntry) -> bool {
    let Some(meta) = state.e2b.sandbox(&entry.id).filter(|meta| meta.auto_pause && meta.home.is_none()) else {
        return false;
    };
    let Some(owner) = meta.owner.clone() else { return false };
    meta.stop_jobs();
    lock(&state.e2b.lifecycle.paused).insert(entry.id.clone(), meta);
    let paused = crate::paused::pause_taken(state, entry, owner);
    if !paused {
        lock(&state.e2b.lifecycle.paused).remove(&entry.id);
    }
    paused
}

/// Resumes paused sandbox `id` of `principal` (from `connect`) under the same id and tokens, living `ttl`.
pub(super) async fn resume(
    state: &Arc<AppState>,
    principal: &Principal,
    id: &str,
    ttl: Duration,
) -> Result<(Arc<SandboxEntry>, Arc<E2bMeta>), E2bError> {
    let meta = lock(&state.e2b.lifecycle.paused).get(id).cloned().ok_or_else(|| ApiError::sandbox_not_found(id))?;
    let entry = crate::paused::resume(state, principal, id, ttl).await?;
    lock(&state.e2b.lifecycle.paused).remove(id);
    let meta = state.e2b.adopt_started(&entry, meta.renewed());
    Ok((entry, meta))
}

/// Resumes paused sandbox `id` for an envd call when it was created with `autoResume` and the call is authorised
/// for it (`authorised` says, given its state); `Ok(false)` when it is not such a sandbox.
pub(super) async fn auto_resume(
    state: &Arc<AppState>,
    id: &str,
    authorised: impl FnOnce(&E2bMeta) -> bool,
) -> Result<bool, E2bError> {
    state.e2b.lifecycle.settle(state, id).await;
    let Some(meta) = lock(&state.e2b.lifecycle.paused).get(id).cloned().filter(|meta| meta.auto_resume) else {
        return Ok(false);
    };
    let Some(paused) = state.paused.get_any(id) else { return Ok(false) };
    if !authorised(&meta) {
        return Ok(false);
    }
    let ttl = crate::service::ttl(state, None)?;
    resume(state, &paused.owner, id, ttl).await?;
    Ok(true)
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
    let req: SnapshotRequest = super::json_or_default(&body)?;
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
    let mut meta = E2bMeta::new(template, new_id("tok_") + &new_id(""), metadata, None, Vec::new());
    meta.owner = Some(principal.clone());
    let meta = state.e2b.adopt_started(&entry, meta);
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
    let req: ForkRequest = super::json_or_default(&body)?;
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
                let mut fork_meta = E2bMeta::new(
                    meta.template.clone(),
                    new_id("tok_") + &new_id(""),
                    meta.metadata.clone(),
                    None,
                    meta.env.clone(),
                );
                fork_meta.owner = Some(principal.clone());
                (fork_meta.auto_pause, fork_meta.auto_resume) = (meta.auto_pause, meta.auto_resume);
                let fork_meta = state.e2b.adopt_started(&fork, fork_meta);
                json!({"sandbox": sandbox_json(&fork, &fork_meta, state.domain.as_deref())})
            }
            Err(err) => json!({"error": {"code": err.status.as_u16(), "message": err.message}}),
        });
    }
    if let Err(err) = std::fs::remove_dir_all(&dir) {
        tracing::warn!(dir = %dir.display(), error = %err, "removing a fork's snapshot failed");
    }
    Ok((StatusCode::CREATED, Json(Value::Array(results))).into_response())
}
