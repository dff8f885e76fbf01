//! The E2B agent's `filesystem.Filesystem` calls the SDK's `files.list`, `exists`, `get_info`, `make_dir`,
//! `rename` and `remove` make: unary Connect-RPC with JSON bodies (`ListDir`, `Stat`, `MakeDir`, `Move`,
//! `Remove`), each answered with protobuf-JSON `EntryInfo`s (`type` is `FILE_TYPE_FILE`, `FILE_TYPE_DIRECTORY` or
//! `FILE_TYPE_SYMLINK`; `modifiedTime` RFC 3339; `isSymlink` and `symlinkTarget` for links).
//!
//! Each call runs as one job in the sandbox: a small Python program, run by the sandbox's own `python3`, does the
//! operation as the jail sees the filesystem (no host-side path resolution that a planted link could steer) and
//! prints the answer as JSON. Relative paths are relative to `/home/user`, as in E2B. Errors keep E2B's codes:
//! `not_found` (the SDK's `exists` answers `false`, the others raise `NotFoundException`), `already_exists` (a
//! `make_dir` of an existing directory answers `false`), `invalid_argument`, `permission_denied`. Calls run beside
//! the sandbox's commands (a process sandbox runs jobs at the same time).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Json, Response};
use serde_json::{Value, json};
use strata_core::{ExecOptions, Job, Status};

use crate::AppState;
use crate::api::blocking;
use crate::error::ApiError;

/// The program each call runs: `python3 -c PROGRAM OP ARGS…`; prints `{"error":{"code","message"}}` or the answer.
const PROGRAM: &str = r#"import datetime, grp, json, os, pwd, shutil, stat, sys
def full(p):
    return os.path.normpath(p if p.startswith('/') else os.path.join('/home/user', p))
def owner(get, i):
    try:
        return get(i)[0]
    except KeyError:
        return str(i)
def info(p):
    st = os.lstat(p)
    link = stat.S_ISLNK(st.st_mode)
    try:
        seen = os.stat(p) if link else st
    except OSError:
        seen = st
    kind = ('FILE_TYPE_DIRECTORY' if stat.S_ISDIR(seen.st_mode) else 'FILE_TYPE_FILE' if stat.S_ISREG(seen.st_mode)
            else 'FILE_TYPE_SYMLINK' if link else 'FILE_TYPE_UNSPECIFIED')
    when = datetime.datetime.fromtimestamp(st.st_mtime, datetime.timezone.utc)
    entry = {'name': os.path.basename(p) or '/', 'type': kind, 'path': p, 'size': str(st.st_size),
             'mode': st.st_mode & 0o7777, 'permissions': stat.filemode(st.st_mode),
             'owner': owner(pwd.getpwuid, st.st_uid), 'group': owner(grp.getgrgid, st.st_gid),
             'modifiedTime': when.strftime('%Y-%m-%dT%H:%M:%S.%fZ'), 'isSymlink': link}
    if link:
        entry['symlinkTarget'] = os.readlink(p)
    return entry
def listing(p, depth):
    out = []
    for name in sorted(os.listdir(p)):
        child = os.path.join(p, name)
        out.append(info(child))
        if depth > 1 and os.path.isdir(child) and not os.path.islink(child):
            out.extend(listing(child, depth - 1))
    return out
def main(op, args):
    if op == 'stat':
        return {'entry': info(full(args[0]))}
    if op == 'list':
        p = full(args[0])
        if not os.path.isdir(p):
            raise NotADirectoryError(f'{p} is not a directory')
        return {'entries': listing(p, max(1, int(args[1])))}
    if op == 'mkdir':
        p = full(args[0])
        if os.path.lexists(p):
            raise FileExistsError(f'{p} already exists')
        os.makedirs(p)
        return {'entry': info(p)}
    if op == 'move':
        src, dst = full(args[0]), full(args[1])
        os.lstat(src)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.rename(src, dst)
        return {'entry': info(dst)}
    if op == 'remove':
        p = full(args[0])
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.remove(p)
        return {}
    raise ValueError(f'unknown operation {op}')
codes = [(FileNotFoundError, 'not_found'), (FileExistsError, 'already_exists'),
         (PermissionError, 'permission_denied'), (OSError, 'invalid_argument'), (ValueError, 'invalid_argument')]
try:
    answer = main(sys.argv[1], sys.argv[2:])
except tuple(c for c, _ in codes) as e:
    code = next(name for c, name in codes if isinstance(e, c))
    answer = {'error': {'code': code, 'message': str(e)}}
print(json.dumps(answer))
"#;

/// The operation a call names, with its arguments, from the request body.
fn operation(call: &str, request: &Value) -> Result<Vec<String>, ApiError> {
    let text = |field: &str| match request[field].as_str() {
        Some(value) if !value.is_empty() && !value.contains('\0') => Ok(value.to_owned()),
        _ => Err(ApiError::new(StatusCode::BAD_REQUEST, "invalid_argument", format!("{field} is required"))),
    };
    Ok(match call {
        "stat" | "mkdir" | "remove" => vec![call.to_owned(), text("path")?],
        "list" => {
            let depth = request["depth"].as_u64().unwrap_or(1).clamp(1, 64);
            vec!["list".to_owned(), text("path")?, depth.to_string()]
        }
        "move" => vec!["move".to_owned(), text("source")?, text("destination")?],
        other => return Err(ApiError::internal(format!("no filesystem operation {other}"))),
    })
}

/// Runs one call in the sandbox the request's headers name.
async fn call(state: Arc<AppState>, headers: HeaderMap, body: Bytes, op: &'static str) -> Response {
    let result = async {
        let entry = crate::e2b::envd_sandbox(&state, &headers)?;
        let request: Value = serde_json::from_slice(&body)
            .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_argument", e.to_string()))?;
        let mut argv = vec!["python3".to_owned(), "-c".to_owned(), PROGRAM.to_owned()];
        argv.extend(operation(op, &request)?);
        let outcome = blocking(move || entry.exec(&Job::Command { argv }, ExecOptions::default())).await?;
        let answer: Value = match (&outcome.status, serde_json::from_slice::<Value>(&outcome.stdout)) {
            (Status::Exited { code: 0 }, Ok(answer)) if !outcome.truncated.stdout => answer,
            _ => {
                let stderr = String::from_utf8_lossy(&outcome.stderr);
                return Err(ApiError::internal(format!("the filesystem call failed ({}): {stderr}", outcome.status)));
            }
        };
        Ok(answer)
    }
    .await;
    match result {
        Ok(answer) => match answer.get("error") {
            Some(error) => {
                let code = error["code"].as_str().unwrap_or("internal");
                let status = match code {
                    "not_found" => StatusCode::NOT_FOUND,
                    "already_exists" => StatusCode::CONFLICT,
                    "permission_denied" => StatusCode::FORBIDDEN,
                    "invalid_argument" => StatusCode::BAD_REQUEST,
                    _ => StatusCode::INTERNAL_SERVER_ERROR,
                };
                (status, Json(json!({"code": code, "message": error["message"]}))).into_response()
            }
            None => Json(answer).into_response(),
        },
        Err(err) => crate::e2b::unary_error(&err),
    }
}

/// `filesystem.Filesystem/Stat`.
pub(crate) async fn stat(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    call(state, headers, body, "stat").await
}

/// `filesystem.Filesystem/ListDir`.
pub(crate) async fn list_dir(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    call(state, headers, body, "list").await
}

/// `filesystem.Filesystem/MakeDir`.
pub(crate) async fn make_dir(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    call(state, headers, body, "mkdir").await
}

/// `filesystem.Filesystem/Move`.
pub(crate) async fn move_entry(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    call(state, headers, body, "move").await
}

/// `filesystem.Filesystem/Remove`.
pub(crate) async fn remove(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    call(state, headers, body, "remove").await
}

/// The request parser, for the fuzz targets (`fuzz/`).
#[doc(hidden)]
pub(crate) mod fuzzing;
