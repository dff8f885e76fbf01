//! The E2B agent's `filesystem.Filesystem` calls the SDK's `files.list`, `exists`, `get_info`, `make_dir`,
//! `rename` and `remove` make: unary Connect-RPC with JSON bodies (`ListDir`, `Stat`, `MakeDir`, `Move`,
//! `Remove`), each answered with protobuf-JSON `EntryInfo`s ([`entry_json`]: `type` is `FILE_TYPE_FILE`,
//! `FILE_TYPE_DIRECTORY` or `FILE_TYPE_SYMLINK`; `modifiedTime` RFC 3339; `isSymlink` and `symlinkTarget` for links;
//! `owner` and `group` are `root` for ID 0, else the numeric ID).
//!
//! Each call is the sandbox's own filesystem method (through [`crate::service`]), which the tier does as the
//! sandbox sees its files, beside its running commands. Relative paths are relative to `/home/user`, as in E2B.
//! Errors keep E2B's codes: `not_found` for a path that is not there (the SDK's `exists` answers `false`, the others
//! raise `NotFoundException`), `already_exists` (a `make_dir` of an existing path answers `false`),
//! `invalid_argument` for a path that is not one, `unimplemented` where the tier has no such method. envd's REST
//! `/files` (multipart or octet-stream uploads, downloads, either gzipped: [`encoding`]) is the sandbox's
//! `write_file` and `read_file`.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Multipart, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Json, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use strata_core::fs::MAX_LIST_DEPTH;
use strata_core::{EntryInfo, FileType, GuestPath};

use super::HOME;
use super::connect::{ConnectRequest, EnvdSandbox};
use super::encoding::{self, ContentCoding};
use super::rfc3339;
use super::{ConnectCode, E2bError};
use crate::AppState;
use crate::service;

/// The request of `Stat`, `MakeDir` and `Remove`; `ListDir` adds `depth`.
#[derive(Debug, Deserialize)]
pub(crate) struct PathRequest {
    #[serde(default)]
    path: String,
    #[serde(default)]
    depth: Option<u64>,
}

/// The request of `Move`.
#[derive(Debug, Deserialize)]
pub(crate) struct MoveRequest {
    #[serde(default)]
    source: String,
    #[serde(default)]
    destination: String,
}

impl PathRequest {
    /// The path it names.
    pub(super) fn path(&self) -> Result<GuestPath, E2bError> {
        guest_path("path", &self.path)
    }

    /// The levels a listing goes down: 1 unless asked, at most [`MAX_LIST_DEPTH`].
    pub(super) fn depth(&self) -> u32 {
        let depth = self.depth.unwrap_or(1).clamp(1, u64::from(MAX_LIST_DEPTH));
        u32::try_from(depth).unwrap_or(MAX_LIST_DEPTH)
    }
}

impl MoveRequest {
    /// Its source and destination.
    pub(super) fn paths(&self) -> Result<(GuestPath, GuestPath), E2bError> {
        Ok((guest_path("source", &self.source)?, guest_path("destination", &self.destination)?))
    }
}

/// A path of a request as E2B takes it: relative to [`HOME`] unless absolute. `field` names it in the error.
pub(super) fn guest_path(field: &str, path: &str) -> Result<GuestPath, E2bError> {
    if path.is_empty() {
        return Err(E2bError::invalid_argument(format!("{field} is required")));
    }
    let full = if path.starts_with('/') { path.to_owned() } else { format!("{HOME}/{path}") };
    GuestPath::new(&full).map_err(|e| E2bError::invalid_argument(e.to_string()))
}

/// An entry as envd's `EntryInfo` in protobuf JSON.
pub(super) fn entry_json(info: &EntryInfo) -> Value {
    let kind = match info.file_type {
        FileType::File => "FILE_TYPE_FILE",
        FileType::Dir => "FILE_TYPE_DIRECTORY",
        FileType::Symlink => "FILE_TYPE_SYMLINK",
        FileType::Other => "FILE_TYPE_UNSPECIFIED",
    };
    let name = if info.path.is_root() { "/" } else { info.name.as_str() };
    let mut entry = json!({
        "name": name,
        "type": kind,
        "path": info.path.as_str(),
        "size": info.size.to_string(),
        "mode": info.mode,
        "permissions": permissions(info.file_type, info.mode),
        "owner": id_name(info.uid),
        "group": id_name(info.gid),
        "isSymlink": info.file_type == FileType::Symlink,
    });
    if let Some(modified) = info.modified {
        entry["modifiedTime"] = Value::String(rfc3339(modified));
    }
    if let Some(target) = &info.symlink_target {
        entry["symlinkTarget"] = Value::String(target.clone());
    }
    entry
}

/// An owner or group as envd names it: `root` for ID 0, else the numeric ID (the server does not read the guest's
/// `/etc/passwd`, which the guest controls).
fn id_name(id: u32) -> String {
    if id == 0 { "root".to_owned() } else { id.to_string() }
}

/// `ls -l`'s mode string (`-rw-r--r--`, `drwxr-sr-t`) of an entry of this type and permission bits.
fn permissions(file_type: FileType, mode: u32) -> String {
    let kind = match file_type {
        FileType::File => '-',
        FileType::Dir => 'd',
        FileType::Symlink => 'l',
        FileType::Other => '?',
    };
    let mut text = String::with_capacity(10);
    text.push(kind);
    // Each class: its read, write and execute bits, and the special bit shown in its execute place.
    let classes = [(6, 0o4000, 's'), (3, 0o2000, 's'), (0, 0o1000, 't')];
    for (shift, special, mark) in classes {
        let bits = (mode >> shift) & 0o7;
        text.push(if bits & 0o4 != 0 { 'r' } else { '-' });
        text.push(if bits & 0o2 != 0 { 'w' } else { '-' });
        text.push(match (bits & 0o1 != 0, mode & special != 0) {
            (true, true) => mark,
            (false, true) => mark.to_ascii_uppercase(),
            (true, false) => 'x',
            (false, false) => '-',
        });
    }
    text
}

/// `filesystem.Filesystem/Stat`.
pub(crate) async fn stat(
    State(state): State<Arc<AppState>>,
    EnvdSandbox(entry, _): EnvdSandbox,
    ConnectRequest(request): ConnectRequest<PathRequest>,
) -> Result<Json<Value>, E2bError> {
    let path = request.path()?;
    let info = service::stat(&state, entry, path).await?;
    Ok(Json(json!({"entry": entry_json(&info)})))
}

/// `filesystem.Filesystem/ListDir`: `depth` levels (1 by default), at most [`MAX_LIST_DEPTH`].
pub(crate) async fn list_dir(
    State(state): State<Arc<AppState>>,
    EnvdSandbox(entry, _): EnvdSandbox,
    ConnectRequest(request): ConnectRequest<PathRequest>,
) -> Result<Json<Value>, E2bError> {
    let listed = service::list_dir(&state, entry, request.path()?, request.depth()).await?;
    Ok(Json(json!({"entries": listed.iter().map(entry_json).collect::<Vec<_>>()})))
}

/// `filesystem.Filesystem/MakeDir`: `already_exists` when something is at the path.
pub(crate) async fn make_dir(
    State(state): State<Arc<AppState>>,
    EnvdSandbox(entry, _): EnvdSandbox,
    ConnectRequest(request): ConnectRequest<PathRequest>,
) -> Result<Json<Value>, E2bError> {
    let path = request.path()?;
    let exists = || E2bError::new(ConnectCode::AlreadyExists, format!("{path} already exists"));
    match service::make_dir(&state, entry.clone(), path.clone()).await {
        Ok(true) => {}
        Ok(false) => return Err(exists()),
        // A file in the way: it exists, as E2B says.
        Err(err) => {
            return match service::stat(&state, entry, path.clone()).await {
                Ok(_) => Err(exists()),
                Err(_) => Err(err.into()),
            };
        }
    }
    let info = service::stat(&state, entry, path).await?;
    Ok(Json(json!({"entry": entry_json(&info)})))
}

/// `filesystem.Filesystem/Move`: the destination's missing parents are made, as envd does.
pub(crate) async fn move_entry(
    State(state): State<Arc<AppState>>,
    EnvdSandbox(entry, _): EnvdSandbox,
    ConnectRequest(request): ConnectRequest<MoveRequest>,
) -> Result<Json<Value>, E2bError> {
    let (from, to) = request.paths()?;
    // A missing source is not_found before anything is made for the destination.
    service::stat(&state, entry.clone(), from.clone()).await?;
    if let Some(parent) = to.parent().filter(|parent| !parent.is_root()) {
        service::make_dir(&state, entry.clone(), parent).await?;
    }
    let info = service::rename(&state, entry, from, to).await?;
    Ok(Json(json!({"entry": entry_json(&info)})))
}

/// `filesystem.Filesystem/Remove`.
pub(crate) async fn remove(
    State(state): State<Arc<AppState>>,
    EnvdSandbox(entry, _): EnvdSandbox,
    ConnectRequest(request): ConnectRequest<PathRequest>,
) -> Result<Json<Value>, E2bError> {
    let path = request.path()?;
    service::remove(&state, entry, path).await?;
    Ok(Json(json!({})))
}

// ---- envd's REST `/files` ----

/// The query of `GET` and `POST /files` (its `signature` and `signature_expiration`, if any, are checked by
/// [`EnvdSandbox`] before the handler runs).
#[derive(Debug, Deserialize)]
pub(super) struct FileQuery {
    path: Option<String>,
    /// The user the call is made as (the SDK's `user=`); a relative path is relative to their home.
    username: Option<String>,
}

impl FileQuery {
    /// `path` (or, for an upload's part, its own name) made absolute: relative to the user's home, as envd does.
    fn absolute(&self, path: &str) -> String {
        if path.starts_with('/') {
            return path.to_owned();
        }
        let home = super::process::home_of(self.username.as_deref().unwrap_or("user"));
        format!("{home}/{path}")
    }
}

/// `GET /files`: the file's bytes, gzipped when the client's `Accept-Encoding` prefers it ([`encoding`]).
pub(super) async fn read_file(
    State(state): State<Arc<AppState>>,
    EnvdSandbox(entry, _): EnvdSandbox,
    Query(query): Query<FileQuery>,
    headers: HeaderMap,
) -> Result<Response, E2bError> {
    let path = query.path.as_deref().ok_or_else(|| E2bError::invalid_argument("path is required"))?;
    let accept = headers.get(header::ACCEPT_ENCODING).and_then(|v| v.to_str().ok());
    let coding = ContentCoding::accepted(accept)?;
    let bytes = service::read_file(&state, entry, query.absolute(path)).await?;
    let octets = (header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
    // The answer depends on Accept-Encoding: caches keep one per value.
    let vary = (header::VARY, HeaderValue::from_static("accept-encoding"));
    match coding {
        ContentCoding::Identity => Ok(([octets, vary], bytes).into_response()),
        ContentCoding::Gzip => {
            let gzipped = tokio::task::spawn_blocking(move || encoding::gzip(&bytes))
                .await
                .map_err(|e| E2bError::internal(e.to_string()))?
                .map_err(|e| E2bError::internal(format!("gzip: {e}")))?;
            let gzip = (header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
            Ok(([octets, vary, gzip], gzipped).into_response())
        }
    }
}

/// `POST /files`: an octet-stream body (to `path`) or a multipart form (each part to `path` or its own name),
/// either of which may be gzipped whole (`Content-Encoding: gzip`), and is then held to the body limit once
/// decompressed too ([`encoding`]).
pub(super) async fn write_file(
    State(state): State<Arc<AppState>>,
    EnvdSandbox(entry, _): EnvdSandbox,
    Query(query): Query<FileQuery>,
    request: Request,
) -> Result<Json<Value>, E2bError> {
    let max = state.connections.limits().max_body;
    let content_encoding = request.headers().get(header::CONTENT_ENCODING).and_then(|v| v.to_str().ok());
    let request = match ContentCoding::of_content_encoding(content_encoding)? {
        ContentCoding::Identity => request,
        ContentCoding::Gzip => {
            let (mut parts, body) = request.into_parts();
            let compressed = body_bytes(body, max).await?;
            let plain = tokio::task::spawn_blocking(move || encoding::gunzip(&compressed, max))
                .await
                .map_err(|e| E2bError::internal(e.to_string()))??;
            parts.headers.remove(header::CONTENT_ENCODING);
            parts.headers.remove(header::CONTENT_LENGTH);
            Request::from_parts(parts, Body::from(plain))
        }
    };
    let multipart = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("multipart/form-data"));
    let files = if multipart {
        form_files(&state, &query, request).await?
    } else {
        let path = query.path.as_deref().ok_or_else(|| E2bError::invalid_argument("path is required"))?;
        vec![(query.absolute(path), body_bytes(request.into_body(), max).await?)]
    };
    let written: Vec<Value> = files
        .iter()
        .map(|(path, _)| {
            let name = path.rsplit('/').next().unwrap_or(path);
            json!({"name": name, "type": "file", "path": path})
        })
        .collect();
    for (path, data) in files {
        service::write_file(&state, entry.clone(), path, data.to_vec()).await?;
    }
    Ok(Json(Value::Array(written)))
}

/// A body of at most `max` bytes; a longer one is 413, as the server's limit answers.
async fn body_bytes(body: Body, max: usize) -> Result<Bytes, E2bError> {
    axum::body::to_bytes(body, max).await.map_err(|e| {
        crate::error::ApiError::of_body(&e, Some(max))
            .map(E2bError::from)
            .unwrap_or_else(|| E2bError::invalid_argument(e.to_string()))
    })
}

/// The files of a multipart upload: the first to `path` when given, each other to its part's file name.
async fn form_files(
    state: &Arc<AppState>,
    query: &FileQuery,
    request: Request,
) -> Result<Vec<(String, Bytes)>, E2bError> {
    let mut form =
        Multipart::from_request(request, state).await.map_err(|e| E2bError::invalid_argument(e.body_text()))?;
    let mut files: Vec<(String, Bytes)> = Vec::new();
    while let Some(field) = form.next_field().await.map_err(|e| E2bError::invalid_argument(e.body_text()))? {
        let name = field.file_name().map(str::to_owned);
        let data = field.bytes().await.map_err(|e| {
            crate::error::ApiError::of_rejected_body(e.status(), &e)
                .map(E2bError::from)
                .unwrap_or_else(|| E2bError::invalid_argument(e.body_text()))
        })?;
        let path = match (&query.path, name) {
            (Some(path), _) if files.is_empty() => query.absolute(path),
            (_, Some(name)) if !name.is_empty() => query.absolute(&name),
            _ => return Err(E2bError::invalid_argument("a file part needs a path")),
        };
        files.push((path, data));
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;

    fn entry(path: &str, file_type: FileType, mode: u32) -> EntryInfo {
        let path = GuestPath::new(path).expect("a guest path");
        EntryInfo {
            name: path.file_name().unwrap_or_default().to_owned(),
            path,
            file_type,
            size: 3,
            mode,
            uid: 0,
            gid: 1000,
            modified: Some(UNIX_EPOCH + Duration::from_micros(1_767_323_045_678_901)),
            symlink_target: None,
        }
    }

    #[test]
    fn entries_take_envd_shape() {
        let file = entry_json(&entry("/home/user/f.txt", FileType::File, 0o644));
        assert_eq!(
            file,
            json!({"name": "f.txt", "type": "FILE_TYPE_FILE", "path": "/home/user/f.txt", "size": "3", "mode": 0o644,
                "permissions": "-rw-r--r--", "owner": "root", "group": "1000", "isSymlink": false,
                "modifiedTime": "2026-01-02T03:04:05.678901Z"})
        );
        let mut link = entry("/home/user/l", FileType::Symlink, 0o777);
        link.symlink_target = Some("../x".into());
        let link = entry_json(&link);
        assert_eq!(
            (&link["type"], &link["isSymlink"], &link["symlinkTarget"]),
            (&json!("FILE_TYPE_SYMLINK"), &json!(true), &json!("../x"))
        );
        let mut root = entry("/", FileType::Dir, 0o755);
        root.modified = None;
        let root = entry_json(&root);
        assert_eq!(
            (&root["name"], &root["permissions"], root.get("modifiedTime")),
            (&json!("/"), &json!("drwxr-xr-x"), None)
        );
    }

    #[test]
    fn permissions_show_the_special_bits_as_ls_does() {
        assert_eq!(permissions(FileType::Dir, 0o1777), "drwxrwxrwt");
        assert_eq!(permissions(FileType::File, 0o4755), "-rwsr-xr-x");
        assert_eq!(permissions(FileType::File, 0o2640), "-rw-r-S---");
        assert_eq!(permissions(FileType::Other, 0o1000), "?--------T");
    }

    #[test]
    fn paths_are_relative_to_home_unless_absolute_and_must_be_guest_paths() {
        assert_eq!(guest_path("path", "d/e").map(|p| p.as_str().to_owned()), Ok("/home/user/d/e".to_owned()));
        assert_eq!(guest_path("path", "/tmp//x/").map(|p| p.as_str().to_owned()), Ok("/tmp/x".to_owned()));
        for bad in ["", "../etc", "/a\0b"] {
            assert_eq!(guest_path("path", bad).map_err(|e| e.code), Err(ConnectCode::InvalidArgument), "{bad:?}");
        }
    }
}
