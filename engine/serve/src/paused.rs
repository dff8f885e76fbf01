//! Paused sandboxes: a live sandbox's state kept as a snapshot under its id, with no jail, no memory and no
//! admission place, until it is resumed (a fork of that snapshot registered under the same id) or deleted. The
//! native API's `POST /v1/sandboxes/{id}/pause` and `/resume` and E2B's `pause()` / `connect()` are this one thing.
//!
//! What a pause keeps is what the sandbox's tier snapshots ([`strata_core::snapshot::Persisted`]): on the process
//! tier, its filesystem, not its processes. A sandbox with jobs running is paused once they are cancelled by the
//! caller or have ended (a snapshot waits [`QUIESCE`] for the calls in flight). At most [`MAX_PAUSED`] sandboxes are
//! kept paused; each holds its snapshot in the server's snapshot directory.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use axum::http::StatusCode;
use strata_core::{Limits, Snapshot, TierKind};
use strata_engine::TierChoice;

use crate::error::ApiError;
use crate::registry::{RegistryError, SandboxEntry, lock, new_id};
use crate::service::blocking;
use crate::{AppState, Principal};

/// The most paused sandboxes the server keeps; a pause past it is refused (429).
pub const MAX_PAUSED: usize = 256;

/// How long a pause waits for the sandbox's calls in flight to end before it gives up.
pub const QUIESCE: Duration = Duration::from_secs(10);

/// One paused sandbox.
#[derive(Debug)]
pub struct PausedSandbox {
    /// Its id, as it had and will have again.
    pub id: String,
    /// The key that paused it, whose quotas its resume is counted against.
    pub owner: Principal,
    /// The tier it ran and will run on.
    pub tier: TierKind,
    /// Its limits.
    pub limits: Limits,
    /// When it was first created.
    pub created: SystemTime,
    /// When it was paused.
    pub paused_at: SystemTime,
    snapshot: Snapshot,
    dir: PathBuf,
}

/// Every paused sandbox, by id.
#[derive(Debug, Default)]
pub struct Paused(Mutex<HashMap<String, Arc<PausedSandbox>>>);

impl Paused {
    /// Paused sandbox `id` of `owner`.
    pub fn get(&self, id: &str, owner: &str) -> Option<Arc<PausedSandbox>> {
        lock(&self.0).get(id).filter(|paused| paused.owner.name == owner).cloned()
    }

    /// Paused sandbox `id`, whoever paused it.
    pub fn get_any(&self, id: &str) -> Option<Arc<PausedSandbox>> {
        lock(&self.0).get(id).cloned()
    }

    /// The paused sandboxes of `owner`, oldest pause first.
    pub fn list(&self, owner: &str) -> Vec<Arc<PausedSandbox>> {
        let mut listed: Vec<_> = lock(&self.0).values().filter(|p| p.owner.name == owner).cloned().collect();
        listed.sort_by_key(|paused| paused.paused_at);
        listed
    }

    /// How many are paused.
    pub fn len(&self) -> usize {
        lock(&self.0).len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Deletes paused sandbox `id` of `owner` and its snapshot (blocking); whether there was one.
    pub fn delete(&self, id: &str, owner: &str) -> bool {
        match self.take(id, owner) {
            Some(paused) => {
                remove_dir(&paused.dir);
                true
            }
            None => false,
        }
    }

    fn take(&self, id: &str, owner: &str) -> Option<Arc<PausedSandbox>> {
        let mut all = lock(&self.0);
        if all.get(id).is_some_and(|paused| paused.owner.name == owner) { all.remove(id) } else { None }
    }

    fn insert(&self, paused: PausedSandbox) -> Arc<PausedSandbox> {
        let paused = Arc::new(paused);
        lock(&self.0).insert(paused.id.clone(), paused.clone());
        paused
    }
}

fn remove_dir(dir: &Path) {
    if let Err(err) = std::fs::remove_dir_all(dir)
        && err.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(dir = %dir.display(), error = %err, "removing a paused sandbox's snapshot failed");
    }
}

/// Snapshots `entry` into a new directory under `snapshot_dir`, waiting up to [`QUIESCE`] for the calls in
/// flight to end (blocking).
pub(crate) fn checkpoint_blocking(snapshot_dir: &Path, entry: &SandboxEntry) -> Result<(Snapshot, PathBuf), ApiError> {
    let dir = snapshot_dir.join(new_id("snap_"));
    let deadline = Instant::now() + QUIESCE;
    loop {
        match entry.snapshot(&dir) {
            Err(RegistryError::Tier(strata_core::TierError::Busy { .. })) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            other => return other.map(|snapshot| (snapshot, dir)).map_err(ApiError::from),
        }
    }
}

/// Refuses to keep `snapshot` (in `dir`, then removed) as a paused sandbox when no fork could be made of it: one
/// taken with secrets, whose values are never written to disk.
fn resumable(snapshot: &Snapshot, dir: &Path) -> Result<(), ApiError> {
    let secrets = snapshot.manifest.meta.get("secret_names").and_then(serde_json::Value::as_array);
    if secrets.is_some_and(|names| !names.is_empty()) {
        remove_dir(dir);
        return Err(ApiError::bad_request(
            "unsupported",
            "a sandbox holding secrets cannot be paused: their values are never written to disk, so it could not \
             be resumed",
        ));
    }
    Ok(())
}

/// [`checkpoint_blocking`] off the runtime.
pub(crate) async fn checkpoint(
    state: &Arc<AppState>,
    entry: &Arc<SandboxEntry>,
) -> Result<(Snapshot, PathBuf), ApiError> {
    let (snapshot_dir, entry) = (state.snapshot_dir.clone(), entry.clone());
    blocking(move || checkpoint_blocking(&snapshot_dir, &entry)).await
}

fn too_many() -> ApiError {
    ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        "too_many_paused",
        format!("this server keeps at most {MAX_PAUSED} paused sandboxes; delete or resume some"),
    )
}

/// Pauses sandbox `id` of `principal`: snapshots it, then takes it out of the registry and closes it. Cancel its
/// jobs first (a snapshot is taken between jobs).
pub(crate) async fn pause(
    state: &Arc<AppState>,
    principal: &Principal,
    id: &str,
) -> Result<Arc<PausedSandbox>, ApiError> {
    if state.paused.len() >= MAX_PAUSED {
        return Err(too_many());
    }
    let entry = crate::service::sandbox(state, principal, id)?;
    let (snapshot, dir) = checkpoint(state, &entry).await?;
    resumable(&snapshot, &dir)?;
    let paused = state.paused.insert(paused_of(&entry, principal.clone(), snapshot, dir));
    crate::service::kill_sandbox(state, principal, id).await?;
    tracing::info!(sandbox = %id, "sandbox paused");
    Ok(paused)
}

/// Pauses `entry`, already out of the registry (its TTL ended and the reaper kills it next), on behalf of `owner`
/// (blocking). Whether it was paused.
pub(crate) fn pause_taken(state: &AppState, entry: &SandboxEntry, owner: Principal) -> bool {
    if state.paused.len() >= MAX_PAUSED {
        tracing::warn!(sandbox = %entry.id, "cannot pause it: {MAX_PAUSED} sandboxes are paused already");
        return false;
    }
    match checkpoint_blocking(&state.snapshot_dir, entry).and_then(|(snapshot, dir)| {
        resumable(&snapshot, &dir)?;
        Ok((snapshot, dir))
    }) {
        Ok((snapshot, dir)) => {
            state.paused.insert(paused_of(entry, owner, snapshot, dir));
            tracing::info!(sandbox = %entry.id, "sandbox timed out; paused");
            true
        }
        Err(err) => {
            tracing::warn!(sandbox = %entry.id, error = %err.message, "pausing a timed-out sandbox failed");
            false
        }
    }
}

fn paused_of(entry: &SandboxEntry, owner: Principal, snapshot: Snapshot, dir: PathBuf) -> PausedSandbox {
    PausedSandbox {
        id: entry.id.clone(),
        owner,
        tier: entry.tier,
        limits: entry.limits.clone(),
        created: entry.created,
        paused_at: SystemTime::now(),
        snapshot,
        dir,
    }
}

/// Resumes paused sandbox `id` of `principal` as a fork of its snapshot under the same id, living `ttl`, counted
/// against the key that paused it; the snapshot goes once it runs. A start that fails leaves it paused.
pub(crate) async fn resume(
    state: &Arc<AppState>,
    principal: &Principal,
    id: &str,
    ttl: Duration,
) -> Result<Arc<SandboxEntry>, ApiError> {
    let paused = state.paused.take(id, &principal.name).ok_or_else(|| ApiError::sandbox_not_found(id))?;
    match start_fork(state, &paused.owner, id.to_owned(), &paused.snapshot, paused.limits.clone(), ttl).await {
        Ok(entry) => {
            remove_dir(&paused.dir);
            tracing::info!(sandbox = %id, "sandbox resumed");
            Ok(entry)
        }
        Err(err) => {
            lock(&state.paused.0).insert(id.to_owned(), paused);
            Err(err)
        }
    }
}

/// Starts a fork of `snapshot` registered as sandbox `id` of `principal`.
pub(crate) async fn start_fork(
    state: &Arc<AppState>,
    principal: &Principal,
    id: String,
    snapshot: &Snapshot,
    limits: Limits,
    ttl: Duration,
) -> Result<Arc<SandboxEntry>, ApiError> {
    let mut reservation = crate::service::reserve(state, principal, 1, &limits)?;
    crate::service::fleet_reserve(state, &id, &limits).await?;
    let (engine, snapshot) = (state.engine.clone(), snapshot.clone());
    let started = Instant::now();
    let forked =
        blocking(move || engine.fork(TierChoice::Tier(snapshot.tier), &snapshot).map_err(ApiError::from)).await;
    let sandbox = match forked {
        Ok(sandbox) => sandbox,
        Err(err) => {
            crate::service::fleet_abandon(state, &id);
            return Err(err);
        }
    };
    let tier = sandbox.tier();
    state.metrics.sandbox_created(tier);
    state.metrics.latency(tier.as_str(), "fork", started.elapsed());
    let entry = reservation.commit(SandboxEntry::new(id, principal.name.clone(), sandbox, limits, ttl));
    crate::service::fleet_follow(state, &entry);
    Ok(entry)
}
