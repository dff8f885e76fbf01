//! Snapshots across the fleet.
//!
//! A snapshot lives on the node that took it, which records in etcd that it holds it (`{prefix}snapshots/{id}`,
//! [`strata_fleet::Protocol::hold_snapshot`]); every node finds it there, and a request for it (delete, fork,
//! manifest, files) through another node is forwarded to the holder like a sandbox's ([`super::route`]). A fork
//! goes to the holder first (no copy needed). When the holder has no room for it (`503`), the node asked fetches
//! the snapshot (`fetch`): its manifest first, checked against this node's snapshot bounds before a byte of its
//! files is fetched, then each file, streamed to disk within its listed size, over the fleet's connection (mutual
//! TLS in a fleet with TLS) with the client's own credentials (the holder checks the snapshot is theirs). The copy
//! is sealed with this node's key only if its files are exactly the manifest's — names, sizes, sha256
//! ([`strata_core::snapshot::SnapshotWriter::commit_copy`]) — and forked here. A copy serves later forks on this
//! node until a lookup finds the original gone (then it is removed) or the node stops.
//!
//! What a crash loses: a snapshot is on its holder only (copies are this node's cache, not replicas): when the
//! holder leaves the fleet, the snapshot is `410 snapshot_lost` on every node. No second node acknowledges a
//! snapshot when it is taken; replicating each one would double the write of every snapshot (hundreds of MB for a
//! process-tier one) on the path of `POST …/snapshot`, for the rarer case of a holder lost.

use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{HeaderMap, Method, StatusCode};
use http_body_util::BodyExt;
use strata_core::snapshot::Manifest;

use crate::registry::SnapshotEntry;
use crate::{ApiError, AppState, Principal};

/// A fork of a snapshot another node holds, made here because the holder has no room: where the holder is.
#[derive(Debug, Clone)]
pub struct RemoteSnapshot {
    /// The holder's URL.
    pub advertise: String,
}

/// The request headers passed to the holder: the client's credentials, which the holder checks.
const CREDENTIALS: [&str; 2] = ["authorization", "x-api-key"];

/// The longest a fetch waits for the next bytes from the holder.
const STALL: Duration = Duration::from_secs(30);

/// Room kept free beside a fetched copy on the snapshots' filesystem.
const SPARE_DISK: u64 = 256 << 20;

/// The bytes read from a snapshot file per chunk sent.
const CHUNK: usize = 256 << 10;

/// A snapshot file's bytes as a response body, read on a blocking thread a chunk at a time as the client takes
/// them.
pub fn file_body(mut file: std::fs::File) -> Body {
    let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<Bytes>>(4);
    tokio::task::spawn_blocking(move || {
        loop {
            let mut chunk = vec![0u8; CHUNK];
            let sent = match file.read(&mut chunk) {
                Ok(0) => return,
                Ok(n) => {
                    chunk.truncate(n);
                    tx.blocking_send(Ok(Bytes::from(chunk)))
                }
                Err(err) => tx.blocking_send(Err(err)),
            };
            if sent.is_err() {
                return;
            }
        }
    });
    Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|item| (item, rx)) }))
}

/// In a fleet, records that this node holds snapshot `id`. A failure is logged: the snapshot still serves
/// through this node, and other nodes answer `404` for it until it is recorded.
pub(crate) async fn hold(state: &AppState, id: &str) {
    if let Some(fleet) = &state.fleet
        && let Err(err) = fleet.hold_snapshot(id).await
    {
        tracing::warn!(snapshot = %id, error = %err, "cannot record the snapshot in the fleet; other nodes will not find it");
    }
}

/// In a fleet, deletes the record of snapshot `id` (deleted here).
pub(crate) async fn release(state: &AppState, id: &str) {
    if let Some(fleet) = &state.fleet
        && let Err(err) = fleet.drop_snapshot(id).await
    {
        tracing::warn!(snapshot = %id, error = %err, "cannot delete the snapshot's record in the fleet");
    }
}

/// Removes this node's copy of snapshot `id`, whose original is gone.
pub(crate) fn forget_copy(state: &AppState, id: &str) {
    if let Some(copy) = state.registry.remove_copy(id) {
        remove_later(copy.dir.clone());
    }
}

fn remove_later(dir: PathBuf) {
    tokio::task::spawn_blocking(move || {
        let _ = std::fs::remove_dir_all(dir);
    });
}

/// A request to the holder for `path`, with the client's credentials.
fn to_holder(path: &str, headers: &HeaderMap) -> Result<Request, ApiError> {
    let mut request = Request::builder()
        .method(Method::GET)
        .uri(path)
        .body(Body::empty())
        .map_err(|e| ApiError::internal(format!("a request to the holder: {e}")))?;
    for name in CREDENTIALS {
        if let Some(value) = headers.get(name) {
            request.headers_mut().insert(name, value.clone());
        }
    }
    Ok(request)
}

fn holder_error(id: &str, advertise: &str, why: impl std::fmt::Display) -> ApiError {
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        "snapshot_fetch_failed",
        format!("cannot fetch snapshot {id} from the node at {advertise}: {why}"),
    )
}

/// A snapshot received that this node refuses: over its bounds (`413`), or not what its manifest says (`502`: the
/// holder sent something else, which is not the client's doing).
fn received(err: strata_core::SnapshotError) -> ApiError {
    let status = match err.code() {
        "snapshot_too_large" => StatusCode::PAYLOAD_TOO_LARGE,
        _ => StatusCode::BAD_GATEWAY,
    };
    ApiError::new(status, err.code(), format!("the snapshot received: {err}"))
}

/// The holder's refusal as this node's error: `404 snapshot_not_found` as it is (not the caller's snapshot, or
/// gone), anything else a `snapshot_fetch_failed` with the holder's status and message.
async fn holder_answer(id: &str, advertise: &str, response: axum::response::Response) -> ApiError {
    let status = response.status();
    if status == StatusCode::NOT_FOUND {
        return ApiError::snapshot_not_found(id);
    }
    let body = tokio::time::timeout(STALL, axum::body::to_bytes(response.into_body(), 64 << 10)).await;
    let message = body
        .ok()
        .and_then(Result::ok)
        .and_then(|bytes| serde_json::from_slice::<serde_json::Value>(&bytes).ok())
        .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
        .unwrap_or_default();
    ApiError::new(
        if status.is_server_error() { StatusCode::BAD_GATEWAY } else { status },
        "snapshot_fetch_failed",
        format!("the node at {advertise} holding snapshot {id} answered {status}: {message}"),
    )
}

/// This node's copy of snapshot `id`, held by the node at `advertise`: the one fetched earlier, or fetched now
/// and checked against its manifest (see the module's documentation).
pub(crate) async fn fetch(
    state: &Arc<AppState>,
    principal: &Principal,
    headers: &HeaderMap,
    id: &str,
    advertise: &str,
) -> Result<Arc<SnapshotEntry>, ApiError> {
    if let Some(copy) = state.registry.copy(id, &principal.name) {
        return Ok(copy);
    }
    let Some(fleet) = state.fleet.clone() else {
        return Err(crate::registry::RegistryError::SnapshotNotFound(id.to_owned()).into());
    };
    let failed = |why: String| holder_error(id, advertise, why);
    // The manifest: at most 1 MiB read, checked against the bounds before any file is fetched.
    let response = fleet.forward(advertise, to_holder(&format!("/v1/snapshots/{id}/manifest"), headers)?).await?;
    if response.status() != StatusCode::OK {
        // The holder's own answer (not the caller's snapshot, say) is the answer.
        return Err(holder_answer(id, advertise, response).await);
    }
    let bytes = tokio::time::timeout(STALL, axum::body::to_bytes(response.into_body(), (1 << 20) + 1))
        .await
        .map_err(|_| failed("the manifest did not arrive".into()))?
        .map_err(|e| failed(format!("the manifest: {e}")))?;
    let origin = PathBuf::from(format!("{advertise}/v1/snapshots/{id}"));
    let manifest = Manifest::parse_received(&origin, &bytes, &state.engine.snapshot_bounds()).map_err(received)?;
    let dir = state.snapshot_dir.join(crate::registry::new_id(&format!("copy-{id}-")));
    let (room_dir, needed) = (state.snapshot_dir.clone(), manifest.total_bytes);
    let writer = crate::service::blocking({
        let (engine, dir) = (state.engine.clone(), dir.clone());
        move || {
            let free = nix::sys::statvfs::statvfs(&room_dir)
                .map(|st| st.blocks_available().saturating_mul(st.fragment_size()))
                .unwrap_or(u64::MAX);
            if free < needed.saturating_add(SPARE_DISK) {
                return Err(ApiError::new(
                    StatusCode::INSUFFICIENT_STORAGE,
                    "insufficient_storage",
                    format!("a copy of the snapshot needs {needed} bytes; this node has {free} free"),
                ));
            }
            engine.snapshot_writer(&dir).map_err(ApiError::from)
        }
    })
    .await?;
    for file in &manifest.files {
        let query: String = form_urlencoded::Serializer::new(String::new()).append_pair("path", &file.path).finish();
        let request = to_holder(&format!("/v1/snapshots/{id}/file?{query}"), headers)?;
        let response = fleet.forward(advertise, request).await?;
        if response.status() != StatusCode::OK {
            return Err(holder_answer(id, advertise, response).await);
        }
        save(response.into_body(), writer.dir().join(&file.path), file.size).await.map_err(&failed)?;
    }
    // Every file is hashed and compared with the manifest before the copy is sealed with this node's key.
    let snapshot = crate::service::blocking(move || writer.commit_copy(&manifest).map_err(received)).await?;
    let (copy, replaced) = state.registry.add_copy(SnapshotEntry {
        id: id.to_owned(),
        owner: principal.name.clone(),
        source: String::new(),
        created: std::time::SystemTime::now(),
        snapshot,
        dir,
    });
    if let Some(replaced) = replaced {
        remove_later(replaced.dir.clone());
    }
    tracing::info!(snapshot = %id, from = %advertise, bytes = needed, "fetched a copy of the snapshot");
    Ok(copy)
}

/// Writes `body` to the new file `path` (its parent directories made as needed), refusing more than `size`
/// bytes; fewer are found when the copy is committed.
async fn save(body: Body, path: PathBuf, size: u64) -> Result<(), String> {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(8);
    let writer = tokio::task::spawn_blocking(move || -> Result<(), String> {
        let shown = path.display().to_string();
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| format!("{shown}: {e}"))?;
        }
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(Path::new(&path))
            .map_err(|e| format!("{shown}: {e}"))?;
        while let Some(chunk) = rx.blocking_recv() {
            file.write_all(&chunk).map_err(|e| format!("{shown}: {e}"))?;
        }
        Ok(())
    });
    let mut body = body;
    let mut received = 0u64;
    let outcome = loop {
        let frame = match tokio::time::timeout(STALL, body.frame()).await {
            Err(_) => break Err(format!("no bytes for {}s", STALL.as_secs())),
            Ok(None) => break Ok(()),
            Ok(Some(Err(err))) => break Err(err.to_string()),
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else { continue };
        received = received.saturating_add(data.len() as u64);
        if received > size {
            break Err(format!("more than the {size} bytes the manifest lists"));
        }
        if tx.send(data).await.is_err() {
            break Ok(());
        }
    };
    drop(tx);
    let written = writer.await.map_err(|e| e.to_string())?;
    outcome.and(written)
}
