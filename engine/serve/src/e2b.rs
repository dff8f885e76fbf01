//! The E2B-compatible layer, over the same sandbox registry as the native API, so that the official E2B SDK works
//! unmodified with `E2B_API_URL` and `E2B_SANDBOX_URL` both set to this server (`docs/DESIGN.md` §8).
//!
//! - Control plane (API key in `X-API-Key`): `POST /sandboxes` and `/v2/sandboxes` (201 with `templateID`,
//!   `sandboxID`, `clientID`, `envdVersion`, `envdAccessToken`), `GET /sandboxes` and `/v2/sandboxes`,
//!   `GET /sandboxes/{id}`, `DELETE /sandboxes/{id}`, `POST /sandboxes/{id}/timeout`, `POST /sandboxes/{id}/connect` (and `/v2/…`),
//!   `POST /sandboxes/{id}/refreshes`. Errors are `{"code":<status>,"message":…}`.
//! - The in-sandbox agent ("envd"), routed by the `E2b-Sandbox-Id` header and authorised by the sandbox's
//!   `X-Access-Token`: Connect-RPC (JSON, 5-byte envelopes, end-of-stream frame) `process.Process/Start` streaming the
//!   start event, stdout/stderr data and the end event (a command outlives the client that started it);
//!   `process.Process/Connect` streaming a running command's start event and its frames from then on;
//!   `SendInput` and `CloseStdin` for a command started with `stdin: true` (its stdin is a pipe the job reads as the
//!   input comes); `SendSignal` and `List`; `filesystem.Filesystem/{ListDir,Stat,MakeDir,Move,Remove}`
//!   (`e2b_fs`) and `{CreateWatcher,GetWatcherEvents,RemoveWatcher,WatchDir}` (`e2b_watch`); `GET`/`POST /files`
//!   (multipart or octet-stream); `GET /health`. Commands, file calls and watchers run at the same time.
//! - The code interpreter (`E2b-Sandbox-Port: 49999`): `POST /execute` streaming NDJSON, the cell run by the
//!   value of its last expression as the main result. The router picks the cell's tier: cells wasm can run go to a
//!   live wasm Python session of the sandbox (state carries over as in Jupyter); the others run with the sandbox's
//!   own `python3`, carrying imports, definitions and picklable values to the next such cell. Both see the
//!   sandbox's `/home/user` (a host directory granted to each).
//!
//! An E2B sandbox runs `/bin/bash -l -c CMD`, so it lives on the process tier.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Extension, FromRequest, Multipart, Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde::Deserialize;
use serde_json::{Value, json};
use strata_core::{
    CancelToken, Capabilities, EnvVar, ExecOptions, Grant, GrantMode, Job, Limits, OutputSink, PythonSource, Status,
    Stream, TierKind,
};
use strata_engine::TierChoice;
use tokio::sync::{broadcast, mpsc};

use crate::api::{CancelOnDrop, blocking, record_job, start_sandbox};
use crate::error::ApiError;
use crate::registry::{SandboxEntry, lock, new_id};
use crate::{AppState, Principal};

/// The envd version this server reports: new enough for octet-stream uploads and `stdin: false` (≥ 0.5.7).
pub const ENVD_VERSION: &str = "0.5.7";

/// What the E2B layer keeps about one of its sandboxes.
pub struct E2bMeta {
    /// The template the client asked for (`base`, `code-interpreter-v1`, …); every template is the same image.
    pub template: String,
    /// The token envd calls must carry in `X-Access-Token`.
    pub access_token: String,
    /// The client's metadata, returned as given.
    pub metadata: Value,
    /// Cells run by `/execute`.
    pub executions: AtomicU64,
    /// The host directory shared by the sandbox and its Python session at [`HOME`] (removed with the sandbox).
    pub home: Option<PathBuf>,
    /// The sandbox's environment, for its Python session.
    pub env: Vec<EnvVar>,
    /// The code interpreter's live wasm Python session, started by the first cell the router sends to wasm.
    pub python: std::sync::Mutex<Option<Box<dyn strata_core::Sandbox>>>,
    /// Cancels the cell running in the Python session, if any.
    pub cell: std::sync::Mutex<Option<CancelToken>>,
    /// Set when the sandbox is killed: no new cell starts.
    pub closed: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for E2bMeta {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("E2bMeta")
            .field("template", &self.template)
            .field("home", &self.home)
            .field("python", &self.python.try_lock().map(|p| p.is_some()).ok())
            .finish_non_exhaustive()
    }
}

/// Where an E2B sandbox's shared home directory is, in the sandbox and in its Python session.
pub const HOME: &str = "/home/user";

impl E2bMeta {
    /// Closes the Python session and removes the shared home directory (blocking; called when the sandbox is
    /// killed).
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        if let Some(cell) = lock(&self.cell).as_ref() {
            cell.cancel();
        }
        if let Some(session) = lock(&self.python).take() {
            let _ = session.close();
        }
        if let Some(home) = &self.home
            && let Err(err) = std::fs::remove_dir_all(home)
            && err.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(dir = %home.display(), error = %err, "removing an E2B home directory failed");
        }
    }
}

/// A command started through `process.Process/Start` that has not ended.
#[derive(Debug)]
struct RunningCommand {
    cancel: CancelToken,
    cmd: String,
    args: Vec<String>,
    /// Its stdin while open, when it was started with `stdin: true` (`SendInput` writes, `CloseStdin` closes).
    stdin: Option<mpsc::Sender<Vec<u8>>>,
    /// Its frames from now on, for `process.Process/Connect`.
    events: broadcast::Sender<Bytes>,
}

/// The E2B layer's own state: running commands by sandbox and pid.
#[derive(Debug, Default)]
pub struct E2bState {
    next_pid: AtomicU32,
    running: std::sync::Mutex<HashMap<(String, u32), RunningCommand>>,
    /// Directory watchers ([`crate::e2b_watch`]).
    pub(crate) watchers: crate::e2b_watch::Watchers,
}

impl E2bState {
    fn pid(&self) -> u32 {
        // Small positive pids, as a shell would see them.
        1000 + self.next_pid.fetch_add(1, Ordering::Relaxed) % 4_000_000
    }
}

/// The control-plane routes (behind API-key authentication).
pub fn control_routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/sandboxes", post(create).get(list))
        .route("/v2/sandboxes", post(create).get(list))
        .route("/sandboxes/{id}", get(detail).delete(kill))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/v2/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/refreshes", post(refresh))
}

/// The envd and code-interpreter routes (authorised by each sandbox's access token).
pub fn envd_routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/process.Process/Start", post(process_start))
        .route("/process.Process/SendSignal", post(process_signal))
        .route("/process.Process/Connect", post(process_connect))
        .route("/process.Process/SendInput", post(process_send_input))
        .route("/process.Process/CloseStdin", post(process_close_stdin))
        .route("/process.Process/List", post(process_list))
        .route("/filesystem.Filesystem/Stat", post(crate::e2b_fs::stat))
        .route("/filesystem.Filesystem/ListDir", post(crate::e2b_fs::list_dir))
        .route("/filesystem.Filesystem/MakeDir", post(crate::e2b_fs::make_dir))
        .route("/filesystem.Filesystem/Move", post(crate::e2b_fs::move_entry))
        .route("/filesystem.Filesystem/Remove", post(crate::e2b_fs::remove))
        .route("/filesystem.Filesystem/CreateWatcher", post(crate::e2b_watch::create))
        .route("/filesystem.Filesystem/GetWatcherEvents", post(crate::e2b_watch::events))
        .route("/filesystem.Filesystem/RemoveWatcher", post(crate::e2b_watch::remove))
        .route("/filesystem.Filesystem/WatchDir", post(crate::e2b_watch::watch_dir))
        .route("/files", get(files_read).post(files_write))
        .route("/execute", post(execute))
}

/// A control-plane error: `{"code":<status>,"message":…}`.
pub(crate) struct ControlError(pub(crate) ApiError);

impl From<ApiError> for ControlError {
    fn from(err: ApiError) -> ControlError {
        ControlError(err)
    }
}

impl IntoResponse for ControlError {
    fn into_response(self) -> Response {
        let status = self.0.status;
        (status, Json(json!({"code": status.as_u16(), "message": self.0.message}))).into_response()
    }
}

/// RFC 3339 UTC time, as E2B's API prints it.
fn rfc3339(time: SystemTime) -> String {
    let since = time.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        since.subsec_micros()
    )
}

/// `POST /sandboxes`, `POST /v2/sandboxes`: the body the SDK sends (unknown fields are ignored: SDK versions add
/// options this server does not have).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct CreateRequest {
    #[serde(rename = "templateID")]
    template_id: Option<String>,
    timeout: Option<u64>,
    #[serde(default)]
    metadata: Option<Value>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
}

fn sandbox_json(entry: &SandboxEntry, meta: &E2bMeta) -> Value {
    json!({
        "templateID": meta.template,
        "sandboxID": entry.id,
        "alias": meta.template,
        "clientID": "strata",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": meta.access_token,
    })
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

/// The sandbox `id` of `principal` if it is an E2B sandbox.
fn e2b_sandbox(state: &AppState, id: &str, principal: &Principal) -> Result<Arc<SandboxEntry>, ControlError> {
    let entry = state.registry.get(id, &principal.name)?;
    if entry.e2b.is_none() {
        return Err(ApiError::sandbox_not_found(id).into());
    }
    Ok(entry)
}

async fn create(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    body: Bytes,
) -> Result<Response, ControlError> {
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
    let ttl = crate::api::ttl(&state, req.timeout)?;
    // /home/user is a host directory shared with the code interpreter's wasm session.
    let home = state.snapshot_dir.join("e2b").join(new_id("home_"));
    std::fs::create_dir_all(&home).map_err(|e| ApiError::internal(format!("cannot create {}: {e}", home.display())))?;
    let grant = Grant::new(&home, HOME, GrantMode::Rw).map_err(|e| ApiError::internal(e.to_string()))?;
    let caps = Capabilities {
        env: env.clone(),
        grants: vec![grant],
        net: state.policy.network.net_with(&[]),
        ..Capabilities::default()
    };
    let meta = E2bMeta {
        template: req.template_id.unwrap_or_else(|| "base".to_owned()),
        access_token: new_id("tok_") + &new_id(""),
        metadata: req.metadata.unwrap_or_else(|| json!({})),
        executions: AtomicU64::new(0),
        home: Some(home.clone()),
        env,
        python: std::sync::Mutex::new(None),
        cell: std::sync::Mutex::new(None),
        closed: std::sync::atomic::AtomicBool::new(false),
    };
    let limits = state.engine.default_limits().clone();
    let choice = TierChoice::Tier(TierKind::Process);
    let entry = match start_sandbox(&state, &principal, choice, caps, limits, ttl, Some(meta)).await {
        Ok(entry) => entry,
        Err(err) => {
            let _ = std::fs::remove_dir_all(&home);
            return Err(err.into());
        }
    };
    let meta = entry.e2b.as_ref().ok_or_else(|| ApiError::internal("the sandbox lost its E2B metadata"))?;
    Ok((StatusCode::CREATED, Json(sandbox_json(&entry, meta))).into_response())
}

async fn list(State(state): State<Arc<AppState>>, Extension(principal): Extension<Principal>) -> Json<Value> {
    let list = state
        .registry
        .list(Some(&principal.name))
        .iter()
        .filter_map(|entry| entry.e2b.as_ref().map(|meta| listed_json(entry, meta)))
        .collect();
    Json(Value::Array(list))
}

async fn detail(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ControlError> {
    let entry = e2b_sandbox(&state, &id, &principal)?;
    let meta = entry.e2b.as_ref().ok_or_else(|| ApiError::sandbox_not_found(&id))?;
    let mut detail = listed_json(&entry, meta);
    detail["envdAccessToken"] = json!(meta.access_token);
    Ok(Json(detail))
}

async fn kill(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<StatusCode, ControlError> {
    e2b_sandbox(&state, &id, &principal)?;
    let entry = state.registry.remove(&id, &principal.name)?;
    cancel_commands(&state, &id);
    crate::api::kill(&state, entry).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize)]
struct TimeoutRequest {
    timeout: u64,
}

async fn set_timeout(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<StatusCode, ControlError> {
    let req: TimeoutRequest =
        serde_json::from_slice(&body).map_err(|e| ApiError::bad_request("invalid_json", e.to_string()))?;
    let entry = e2b_sandbox(&state, &id, &principal)?;
    entry.set_ttl(crate::api::ttl(&state, Some(req.timeout))?);
    Ok(StatusCode::NO_CONTENT)
}

async fn connect(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Json<Value>, ControlError> {
    let entry = e2b_sandbox(&state, &id, &principal)?;
    if let Ok(req) = serde_json::from_slice::<TimeoutRequest>(&body) {
        entry.set_ttl(crate::api::ttl(&state, Some(req.timeout))?);
    }
    let meta = entry.e2b.as_ref().ok_or_else(|| ApiError::sandbox_not_found(&id))?;
    Ok(Json(sandbox_json(&entry, meta)))
}

async fn refresh(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<StatusCode, ControlError> {
    e2b_sandbox(&state, &id, &principal)?;
    Ok(StatusCode::NO_CONTENT)
}

/// Cancels every command and watcher still running in sandbox `id`.
fn cancel_commands(state: &AppState, id: &str) {
    for ((sandbox, _), command) in lock(&state.e2b.running).iter() {
        if sandbox == id {
            command.cancel.cancel();
        }
    }
    state.e2b.watchers.remove_sandbox(id);
}

// ---- envd ----

/// An envd error: Connect's unary form `{"code":"not_found","message":…}` with its HTTP status.
pub(crate) fn rpc_error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    (status, Json(json!({"code": code, "message": message.into()}))).into_response()
}

/// An envd REST error: `{"code":<status>,"message":…}`.
fn rest_error(err: &ApiError) -> Response {
    (err.status, Json(json!({"code": err.status.as_u16(), "message": err.message}))).into_response()
}

/// The sandbox an envd request is for, by `E2b-Sandbox-Id`, checked against its access token.
pub(crate) fn envd_sandbox(state: &AppState, headers: &HeaderMap) -> Result<Arc<SandboxEntry>, ApiError> {
    let id = headers
        .get("e2b-sandbox-id")
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| ApiError::bad_request("missing_sandbox_id", "envd calls need the E2b-Sandbox-Id header"))?;
    let entry = state.registry.get_any(id).ok_or_else(|| ApiError::sandbox_not_found(id))?;
    let meta = entry.e2b.as_ref().ok_or_else(|| ApiError::sandbox_not_found(id))?;
    let token = headers.get("x-access-token").and_then(|v| v.to_str().ok());
    if token != Some(meta.access_token.as_str()) {
        return Err(ApiError::unauthorized("missing or wrong X-Access-Token for this sandbox"));
    }
    Ok(entry)
}

/// `GET /health` with an `E2b-Sandbox-Id` header: 204 while the sandbox runs, 502 when it does not.
pub async fn health(State(state): State<Arc<AppState>>, headers: HeaderMap) -> StatusCode {
    match headers.get("e2b-sandbox-id").and_then(|v| v.to_str().ok()) {
        None => StatusCode::NO_CONTENT,
        Some(id) => match state.registry.get_any(id) {
            Some(entry) if entry.e2b.is_some() => StatusCode::NO_CONTENT,
            _ => StatusCode::BAD_GATEWAY,
        },
    }
}

/// One Connect envelope: flags, big-endian length, JSON.
pub(crate) fn envelope(flags: u8, body: &Value) -> Bytes {
    let payload = body.to_string().into_bytes();
    let mut frame = Vec::with_capacity(payload.len() + 5);
    frame.push(flags);
    frame.extend_from_slice(&u32::try_from(payload.len()).unwrap_or(u32::MAX).to_be_bytes());
    frame.extend_from_slice(&payload);
    Bytes::from(frame)
}

/// The JSON message of a request made of one uncompressed envelope.
pub(crate) fn parse_envelope(body: &[u8]) -> Result<Value, String> {
    let Some((&[flags, a, b, c, d], rest)) = body.split_first_chunk::<5>() else {
        return Err("the request is shorter than a Connect envelope".to_owned());
    };
    if flags & 1 != 0 {
        return Err("compressed envelopes are not supported".to_owned());
    }
    let len = usize::try_from(u32::from_be_bytes([a, b, c, d])).map_err(|e| e.to_string())?;
    let payload = rest.get(..len).ok_or("the envelope is longer than the request")?;
    serde_json::from_slice(payload).map_err(|e| format!("invalid message: {e}"))
}

#[derive(Debug, Deserialize)]
struct StartRequest {
    process: ProcessConfig,
    /// Keep stdin open for `SendInput` (the SDK's `commands.run(..., stdin=True)`); closed at once otherwise.
    #[serde(default)]
    stdin: bool,
}

#[derive(Debug, Deserialize)]
struct ProcessConfig {
    cmd: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    envs: BTreeMap<String, String>,
    #[serde(default)]
    cwd: Option<String>,
}

/// Where a command's frames go: the `Start` stream, and every `Connect` stream attached meanwhile. Never blocks.
#[derive(Clone)]
struct EventSink {
    start: mpsc::UnboundedSender<Bytes>,
    connected: broadcast::Sender<Bytes>,
}

impl EventSink {
    fn emit(&self, frame: Bytes) {
        // No receiver attached is not an error.
        let _ = self.connected.send(frame.clone());
        let _ = self.start.send(frame);
    }
}

impl OutputSink for EventSink {
    fn output(&self, stream: Stream, chunk: &[u8]) {
        let key = match stream {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        };
        self.emit(envelope(0, &json!({"event": {"data": {key: BASE64.encode(chunk)}}})));
    }
}

/// Frames kept for a `Connect` stream that reads slower than the command writes; one that falls further behind
/// loses the oldest (the `Start` stream never does).
const CONNECT_BACKLOG: usize = 1024;

/// The argv of a process config: `env -C CWD K=V … CMD ARGS` when it sets a directory or variables.
fn command_argv(config: ProcessConfig) -> Result<Vec<String>, ApiError> {
    let mut argv = Vec::new();
    if config.cwd.is_some() || !config.envs.is_empty() {
        argv.push("/usr/bin/env".to_owned());
        if let Some(cwd) = config.cwd {
            argv.push("-C".to_owned());
            argv.push(cwd);
        }
        for (name, value) in config.envs {
            if name.is_empty() || name.contains(['=', '\0']) {
                return Err(ApiError::bad_request("invalid_argument", format!("invalid environment name {name:?}")));
            }
            argv.push(format!("{name}={value}"));
        }
    }
    argv.push(config.cmd);
    argv.extend(config.args);
    if argv.iter().any(|a| a.contains('\0')) {
        return Err(ApiError::bad_request("invalid_argument", "arguments must not contain NUL"));
    }
    Ok(argv)
}

/// The wall limit of a command: the sandbox's, or the client's `connect-timeout-ms` when shorter.
fn command_limits(entry: &SandboxEntry, headers: &HeaderMap) -> Limits {
    let mut limits = entry.limits.clone();
    let asked = headers.get("connect-timeout-ms").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if let Some(ms) = asked.filter(|ms| *ms > 0) {
        limits.wall = limits.wall.min(Duration::from_millis(ms));
    }
    limits
}

async fn process_start(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    let entry = match envd_sandbox(&state, &headers) {
        Ok(entry) => entry,
        Err(err) => return rpc_error(err.status, connect_code(&err), err.message),
    };
    let request = parse_envelope(&body)
        .and_then(|value| serde_json::from_value::<StartRequest>(value).map_err(|e| e.to_string()));
    let argv = match request.map_err(|e| ApiError::bad_request("invalid_argument", e)).and_then(|r| {
        let (cmd, args) = (r.process.cmd.clone(), r.process.args.clone());
        command_argv(r.process).map(|argv| (argv, cmd, args, r.stdin))
    }) {
        Ok(argv) => argv,
        Err(err) => return rpc_error(StatusCode::BAD_REQUEST, "invalid_argument", err.message),
    };
    let (argv, cmd, args, keep_stdin) = argv;
    let (stdin_stream, stdin) = if keep_stdin {
        match crate::ws::stdin_writer() {
            Ok((stream, tx)) => (Some(stream), Some(tx)),
            Err(err) => return rpc_error(err.status, connect_code(&err), err.message),
        }
    } else {
        (None, None)
    };
    let limits = command_limits(&entry, &headers);
    let pid = state.e2b.pid();
    let token = CancelToken::new();
    let key = (entry.id.clone(), pid);
    let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
    let (connected, _) = broadcast::channel(CONNECT_BACKLOG);
    let sink = EventSink { start: tx.clone(), connected: connected.clone() };
    let command = RunningCommand { cancel: token.clone(), cmd, args, stdin, events: connected };
    lock(&state.e2b.running).insert(key.clone(), command);
    let _ = tx.send(envelope(0, &json!({"event": {"start": {"pid": pid}}})));
    let task_state = state.clone();
    tokio::spawn(async move {
        let mut guard = CancelOnDrop(Some(token.clone()));
        let opts = ExecOptions {
            limits: Some(limits),
            stdin: None,
            stdin_stream,
            sink: Some(Arc::new(sink.clone())),
            cancel: Some(token.clone()),
        };
        let started = Instant::now();
        let tier = entry.tier;
        let job = Job::Command { argv };
        let job_entry = entry.clone();
        // A client that goes away does not end the command (as in E2B: `Connect` attaches to it again, `SendSignal`
        // or the sandbox's end stops it).
        let result = blocking(move || job_entry.exec(&job, opts)).await;
        guard.0 = None;
        record_job(&task_state, tier, "e2b_command", started, &result);
        lock(&task_state.e2b.running).remove(&key);
        let end = match result {
            Ok(outcome) => {
                let exited = matches!(outcome.status, Status::Exited { .. });
                let mut end = json!({
                    "exitCode": outcome.status.exit_code(),
                    "exited": exited,
                    "status": match &outcome.status {
                        Status::Exited { code } => format!("exit status {code}"),
                        other => other.to_string(),
                    },
                });
                if !exited {
                    end["error"] = json!(outcome.status.to_string());
                }
                sink.emit(envelope(0, &json!({"event": {"end": end}})));
                json!({})
            }
            Err(err) => json!({"error": {"code": connect_code(&err), "message": err.message}}),
        };
        sink.emit(envelope(2, &end));
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|frame| (Ok::<Bytes, Infallible>(frame), rx))
    });
    ([(header::CONTENT_TYPE, "application/connect+json")], Body::from_stream(stream)).into_response()
}

/// `process.Process/Connect`: the start event of a running command, then its frames from now on, to its end.
async fn process_connect(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    let entry = match envd_sandbox(&state, &headers) {
        Ok(entry) => entry,
        Err(err) => return rpc_error(err.status, connect_code(&err), err.message),
    };
    let pid = match parse_envelope(&body).and_then(|request| {
        request["process"]["pid"]
            .as_u64()
            .and_then(|p| u32::try_from(p).ok())
            .ok_or_else(|| "process.pid is required".to_owned())
    }) {
        Ok(pid) => pid,
        Err(message) => return rpc_error(StatusCode::BAD_REQUEST, "invalid_argument", message),
    };
    let Some(events) = lock(&state.e2b.running).get(&(entry.id.clone(), pid)).map(|c| c.events.subscribe()) else {
        return rpc_error(StatusCode::NOT_FOUND, "not_found", format!("process with pid {pid} not found"));
    };
    let start = envelope(0, &json!({"event": {"start": {"pid": pid}}}));
    let stream = futures_util::stream::unfold((Some(start), events), |(first, mut events)| async move {
        if let Some(frame) = first {
            return Some((Ok::<Bytes, Infallible>(frame), (None, events)));
        }
        loop {
            match events.recv().await {
                Ok(frame) => return Some((Ok(frame), (None, events))),
                // Output it fell behind on is lost to this stream only.
                Err(broadcast::error::RecvError::Lagged(_)) => continue,
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    });
    ([(header::CONTENT_TYPE, "application/connect+json")], Body::from_stream(stream)).into_response()
}

/// The Connect code of an API error.
pub(crate) fn connect_code(err: &ApiError) -> &'static str {
    match err.status.as_u16() {
        400 => "invalid_argument",
        401 => "unauthenticated",
        403 => "permission_denied",
        404 => "not_found",
        409 => "aborted",
        429 => "resource_exhausted",
        499 => "canceled",
        501 => "unimplemented",
        503 => "unavailable",
        _ => "internal",
    }
}

async fn process_signal(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    // Every signal ends the command: the engine cancels jobs, it does not deliver signals.
    let result = command_request(&state, &headers, &body)
        .and_then(|(key, _)| with_command(&state, &key, |command| command.cancel.cancel()));
    unary_reply(result)
}

/// A unary Connect error for an API error.
pub(crate) fn unary_error(err: &ApiError) -> Response {
    rpc_error(err.status, connect_code(err), err.message.clone())
}

/// The unary reply: `{}`, or the Connect error.
fn unary_reply(result: Result<(), ApiError>) -> Response {
    match result {
        Ok(()) => Json(json!({})).into_response(),
        Err(err) => rpc_error(err.status, err.code, err.message),
    }
}

/// The command a unary `process.Process/*` request selects (its sandbox and pid), and the request.
fn command_request(state: &AppState, headers: &HeaderMap, body: &[u8]) -> Result<((String, u32), Value), ApiError> {
    let entry = envd_sandbox(state, headers).map_err(|err| ApiError { code: connect_code(&err), ..err })?;
    let request: Value = serde_json::from_slice(body).map_err(|e| invalid_argument(e.to_string()))?;
    let pid = request["process"]["pid"].as_u64().and_then(|p| u32::try_from(p).ok());
    let pid = pid.ok_or_else(|| invalid_argument("process.pid is required"))?;
    Ok(((entry.id.clone(), pid), request))
}

fn invalid_argument(message: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, "invalid_argument", message)
}

/// `f` on the running command `key`; `not_found` when there is none.
fn with_command<T>(
    state: &AppState,
    key: &(String, u32),
    f: impl FnOnce(&mut RunningCommand) -> T,
) -> Result<T, ApiError> {
    let mut running = lock(&state.e2b.running);
    let command = running.get_mut(key).ok_or_else(|| {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("process with pid {} not found", key.1))
    })?;
    Ok(f(command))
}

/// `process.Process/SendInput`: `input.stdin` (base64, as protobuf JSON writes bytes) to a command started with
/// `stdin: true`. It waits while the command is not reading (at most [`crate::ws`]'s queue of chunks ahead).
async fn process_send_input(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    let prepared = command_request(&state, &headers, &body).and_then(|(key, request)| {
        let data = match request["input"]["stdin"].as_str() {
            Some(text) => BASE64.decode(text).map_err(|e| invalid_argument(format!("input.stdin: {e}")))?,
            None if request["input"]["pty"].is_string() => {
                return Err(ApiError::new(
                    StatusCode::NOT_IMPLEMENTED,
                    "unimplemented",
                    "commands have no terminal here",
                ));
            }
            None => return Err(invalid_argument("input.stdin is required")),
        };
        let stdin = with_command(&state, &key, |command| command.stdin.clone())?;
        let stdin = stdin.ok_or_else(|| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "failed_precondition",
                format!("process {} has no open stdin (start it with stdin, and do not close it)", key.1),
            )
        })?;
        Ok((key.1, data, stdin))
    });
    let result = match prepared {
        Ok((pid, data, stdin)) => {
            if data.is_empty() || stdin.send(data).await.is_ok() {
                Ok(())
            } else {
                Err(ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("process with pid {pid} has ended")))
            }
        }
        Err(err) => Err(err),
    };
    unary_reply(result)
}

/// `process.Process/CloseStdin`: the command reads end-of-file once what was sent before is written.
async fn process_close_stdin(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    let result = command_request(&state, &headers, &body)
        .and_then(|(key, _)| with_command(&state, &key, |command| command.stdin = None));
    unary_reply(result)
}

async fn process_list(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    let entry = match envd_sandbox(&state, &headers) {
        Ok(entry) => entry,
        Err(err) => return rpc_error(err.status, connect_code(&err), err.message),
    };
    let processes: Vec<Value> = lock(&state.e2b.running)
        .iter()
        .filter(|((sandbox, _), _)| *sandbox == entry.id)
        .map(|((_, pid), command)| json!({"pid": pid, "config": {"cmd": command.cmd, "args": command.args}}))
        .collect();
    Json(json!({ "processes": processes })).into_response()
}

#[derive(Debug, Deserialize)]
struct FileQuery {
    path: Option<String>,
}

async fn files_read(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Query(query): Query<FileQuery>,
) -> Response {
    let result = async {
        let entry = envd_sandbox(&state, &headers)?;
        let path = query.path.ok_or_else(|| ApiError::bad_request("invalid_query", "path is required"))?;
        blocking(move || entry.with_calls(|calls| read_in(calls, entry.tier, &path))).await
    }
    .await;
    match result {
        Ok(bytes) => ([(header::CONTENT_TYPE, "application/octet-stream")], bytes).into_response(),
        Err(err) => rest_error(&err),
    }
}

async fn files_write(State(state): State<Arc<AppState>>, Query(query): Query<FileQuery>, request: Request) -> Response {
    let headers = request.headers().clone();
    let result = async {
        let entry = envd_sandbox(&state, &headers)?;
        let multipart = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("multipart/form-data"));
        let mut files: Vec<(String, Bytes)> = Vec::new();
        if multipart {
            let mut form = Multipart::from_request(request, &state)
                .await
                .map_err(|e| ApiError::bad_request("invalid_argument", e.body_text()))?;
            while let Some(field) =
                form.next_field().await.map_err(|e| ApiError::bad_request("invalid_argument", e.body_text()))?
            {
                let name = field.file_name().map(str::to_owned);
                let data = field.bytes().await.map_err(|e| {
                    crate::connections::rejected_body(e.status(), &e)
                        .unwrap_or_else(|| ApiError::bad_request("invalid_argument", e.body_text()))
                })?;
                let path = match (&query.path, name) {
                    (Some(path), _) if files.is_empty() => path.clone(),
                    (_, Some(name)) if name.starts_with('/') => name,
                    _ => return Err(ApiError::bad_request("invalid_argument", "a file part needs an absolute path")),
                };
                files.push((path, data));
            }
        } else {
            if headers.get(header::CONTENT_ENCODING).is_some_and(|v| v != "identity") {
                return Err(ApiError::bad_request("invalid_argument", "compressed uploads are not supported"));
            }
            let path = query.path.clone().ok_or_else(|| ApiError::bad_request("invalid_query", "path is required"))?;
            let max = state.connections.limits().max_body;
            let body = axum::body::to_bytes(request.into_body(), max).await.map_err(|e| {
                crate::connections::body_error(&e, Some(max))
                    .unwrap_or_else(|| ApiError::bad_request("invalid_argument", e.to_string()))
            })?;
            files.push((path, body));
        }
        let written: Vec<Value> = files
            .iter()
            .map(|(path, _)| {
                let name = path.rsplit('/').next().unwrap_or(path);
                json!({"name": name, "type": "file", "path": path})
            })
            .collect();
        blocking(move || {
            entry.with_calls(|calls| {
                for (path, data) in &files {
                    write_in(calls, entry.tier, path, data)?;
                }
                Ok(())
            })
        })
        .await?;
        Ok(written)
    }
    .await;
    match result {
        Ok(written) => Json(Value::Array(written)).into_response(),
        Err(err) => rest_error(&err),
    }
}

/// Whether `path` is inside the shared home directory.
fn in_home(path: &str) -> bool {
    path.strip_prefix(HOME).is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// Writes a file in the sandbox. Inside [`HOME`] (a grant) the process tier's `write_file` fails with EOVERFLOW for
/// a directory owned by a user outside the jail's namespace, so the file is written from inside the sandbox by
/// `cat`, which resolves the path as the jail does (no host-side path resolution that a planted symlink could steer).
fn write_in(
    sandbox: &dyn strata_core::SandboxHandle,
    tier: TierKind,
    path: &str,
    data: &[u8],
) -> Result<(), strata_core::TierError> {
    if !in_home(path) || tier == TierKind::Wasm {
        return sandbox.write_file(path, data);
    }
    let job = Job::Command { argv: ["sh", "-c", "cat > \"$1\"", "sh", path].map(str::to_owned).to_vec() };
    let outcome = sandbox.exec(&job, ExecOptions { stdin: Some(data.to_vec()), ..ExecOptions::default() })?;
    match outcome.status {
        Status::Exited { code: 0 } => Ok(()),
        _ => Err(strata_core::TierError::GuestPath {
            path: path.to_owned(),
            reason: String::from_utf8_lossy(&outcome.stderr).trim().to_owned(),
        }),
    }
}

/// Reads a file in the sandbox; inside [`HOME`] from inside the sandbox, as [`write_in`] writes.
fn read_in(
    sandbox: &dyn strata_core::SandboxHandle,
    tier: TierKind,
    path: &str,
) -> Result<Vec<u8>, strata_core::TierError> {
    if !in_home(path) || tier == TierKind::Wasm {
        return sandbox.read_file(path);
    }
    let job = Job::Command { argv: ["cat", "--", path].map(str::to_owned).to_vec() };
    let outcome = sandbox.exec(&job, ExecOptions::default())?;
    match outcome.status {
        Status::Exited { code: 0 } if !outcome.truncated.stdout => Ok(outcome.stdout),
        Status::Exited { code: 0 } => Err(strata_core::TierError::GuestPath {
            path: path.to_owned(),
            reason: "larger than the output limit".to_owned(),
        }),
        _ => Err(strata_core::TierError::GuestPath {
            path: path.to_owned(),
            reason: String::from_utf8_lossy(&outcome.stderr).trim().to_owned(),
        }),
    }
}

/// Runs a cell in `__main__`: every statement, then the last one's value (if it is an expression) as the main result,
/// which it reports after a record separator on stderr with any exception.
///
/// Each cell is a fresh `python3`, so state is carried in `/tmp/.strata-cells`: the source of every top-level
/// import, `def` and `class` is replayed before the next cell, and every picklable value is restored. What does not
/// pickle (open files, generators, sockets) does not survive from one cell to the next.
const CELL_DRIVER: &str = r#"import ast as _s_ast, json as _s_json, os as _s_os, pickle as _s_pickle, sys as _s_sys
import traceback as _s_tb, types as _s_types
_s_ns = globals()
_s_path = "/tmp/.strata-cells"
_s_out = {"result": None, "error": None}
_s_saved = {"defs": [], "values": {}}
try:
    with open(_s_path, "rb") as _s_f:
        _s_saved = _s_pickle.load(_s_f)
except Exception:
    pass
for _s_src in _s_saved["defs"]:
    try:
        exec(compile(_s_src, "<history>", "exec"), _s_ns)
    except BaseException:
        pass
for _s_name, _s_blob in _s_saved["values"].items():
    try:
        _s_ns[_s_name] = _s_pickle.loads(_s_blob)
    except BaseException:
        pass
_s_cell = _s_sys.argv[1]
try:
    _s_tree = _s_ast.parse(_s_cell, "<cell>", "exec")
    for _s_node in _s_tree.body:
        if isinstance(_s_node, (_s_ast.Import, _s_ast.ImportFrom, _s_ast.FunctionDef, _s_ast.AsyncFunctionDef,
                                _s_ast.ClassDef)):
            _s_src = _s_ast.get_source_segment(_s_cell, _s_node)
            if _s_src:
                _s_saved["defs"].append(_s_src)
    _s_last = None
    if _s_tree.body and isinstance(_s_tree.body[-1], _s_ast.Expr):
        _s_last = _s_ast.Expression(_s_tree.body.pop().value)
    exec(compile(_s_tree, "<cell>", "exec"), _s_ns)
    if _s_last is not None:
        _s_value = eval(compile(_s_last, "<cell>", "eval"), _s_ns)
        if _s_value is not None:
            _s_out["result"] = repr(_s_value)
except BaseException as _s_e:
    _s_out["error"] = {"name": type(_s_e).__name__, "value": str(_s_e), "traceback": _s_tb.format_exc()}
_s_values = {}
for _s_name, _s_value in list(_s_ns.items()):
    if _s_name.startswith(("_s_", "__")) or isinstance(_s_value, (_s_types.ModuleType, _s_types.FunctionType, type)):
        continue
    try:
        _s_values[_s_name] = _s_pickle.dumps(_s_value)
    except BaseException:
        pass
_s_saved["values"] = _s_values
try:
    with open(_s_path + ".tmp", "wb") as _s_f:
        _s_pickle.dump(_s_saved, _s_f)
    _s_os.replace(_s_path + ".tmp", _s_path)
except Exception:
    pass
_s_sys.stdout.flush()
_s_sys.stderr.write("\x1eSTRATA-CELL " + _s_json.dumps(_s_out) + "\n")
_s_sys.stderr.flush()
"#;

/// A cell in the live wasm session: the same protocol as [`CELL_DRIVER`], inside a function that removes itself so
/// that the session's names are the cells' own. `{CODE}` is the cell as a JSON string (a valid Python literal).
const SESSION_DRIVER: &str = r#"def __strata_cell(src):
    import ast, json, sys, traceback
    g = sys.modules["__main__"].__dict__
    out = {"result": None, "error": None}
    try:
        tree = ast.parse(src, "<cell>", "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, "<cell>", "exec"), g)
        if last is not None:
            value = eval(compile(last, "<cell>", "eval"), g)
            if value is not None:
                out["result"] = repr(value)
    except BaseException as e:
        out["error"] = {"name": type(e).__name__, "value": str(e), "traceback": traceback.format_exc()}
    sys.stdout.flush()
    sys.stderr.write("\x1eSTRATA-CELL " + json.dumps(out) + "\n")
    sys.stderr.flush()
try:
    __strata_cell({CODE})
finally:
    del __strata_cell
"#;

/// Runs a cell in the sandbox's wasm Python session (started on first use, in [`HOME`], with the sandbox's
/// environment and the shared home directory; restarted once if the last cell ended it). Blocking.
fn session_cell(
    state: &AppState,
    entry: &SandboxEntry,
    code: &str,
    limits: Limits,
    cancel: CancelToken,
) -> Result<strata_core::Outcome, ApiError> {
    let meta = entry.e2b.as_ref().ok_or_else(|| ApiError::sandbox_not_found(&entry.id))?;
    let literal = serde_json::to_string(code).map_err(|e| ApiError::internal(e.to_string()))?;
    let job = Job::Python { source: PythonSource::Code(SESSION_DRIVER.replace("{CODE}", &literal)), args: Vec::new() };
    let mut session = lock(&meta.python);
    *lock(&meta.cell) = Some(cancel.clone());
    // `close` sets `closed` before it looks at `cell`: one of the two sees the other.
    if meta.closed.load(Ordering::SeqCst) {
        return Err(ApiError::sandbox_not_found(&entry.id));
    }
    for attempt in 0..2 {
        if session.is_none() {
            let grants = match &meta.home {
                Some(home) => {
                    vec![Grant::new(home, HOME, GrantMode::Rw).map_err(|e| ApiError::internal(e.to_string()))?]
                }
                None => Vec::new(),
            };
            let caps = Capabilities { env: meta.env.clone(), grants, ..Capabilities::default() };
            let mut started = state.engine.start(TierChoice::Tier(TierKind::Wasm), &caps, &limits)?;
            let chdir = Job::Python {
                source: PythonSource::Code(format!("import os\nos.chdir({HOME:?})\ndel os")),
                args: Vec::new(),
            };
            started.exec(&chdir, ExecOptions::default())?;
            *session = Some(started);
        }
        let Some(python) = session.as_mut() else { continue };
        let opts = ExecOptions { limits: Some(limits.clone()), cancel: Some(cancel.clone()), ..ExecOptions::default() };
        match python.exec(&job, opts) {
            Err(strata_core::TierError::SessionEnded { .. }) if attempt == 0 => {
                if let Some(ended) = session.take() {
                    let _ = ended.close();
                }
            }
            other => return other.map_err(ApiError::from),
        }
    }
    Err(ApiError::internal("the Python session could not be restarted"))
}

const CELL_MARKER: &str = "\u{1e}STRATA-CELL ";

#[derive(Debug, Deserialize)]
struct ExecuteRequest {
    code: String,
}

async fn execute(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    let entry = match envd_sandbox(&state, &headers) {
        Ok(entry) => entry,
        Err(err) => return rest_error(&err),
    };
    let request: ExecuteRequest = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(e) => return rest_error(&ApiError::bad_request("invalid_json", e.to_string())),
    };
    let limits = command_limits(&entry, &headers);
    let count = entry.e2b.as_ref().map(|m| m.executions.fetch_add(1, Ordering::Relaxed) + 1).unwrap_or(1);
    let cell = Job::Python { source: PythonSource::Code(request.code.clone()), args: Vec::new() };
    let on_wasm = state.engine.route(TierChoice::Auto, &cell).is_ok_and(|route| route.decision.tier == TierKind::Wasm);
    let outcome = if on_wasm {
        let started = Instant::now();
        let session_state = state.clone();
        let token = CancelToken::new();
        let mut guard = CancelOnDrop(Some(token.clone()));
        let result = blocking(move || session_cell(&session_state, &entry, &request.code, limits, token)).await;
        guard.0 = None;
        record_job(&state, TierKind::Wasm, "run_code", started, &result);
        result
    } else {
        let job = Job::Python { source: PythonSource::Code(CELL_DRIVER.to_owned()), args: vec![request.code] };
        let opts = ExecOptions { limits: Some(limits), ..ExecOptions::default() };
        crate::api::exec_in(&state, entry, job, opts).await
    };
    let outcome = match outcome {
        Ok(outcome) => outcome,
        Err(err) => return rest_error(&err),
    };
    let now = rfc3339(SystemTime::now());
    let stderr = String::from_utf8_lossy(&outcome.stderr).into_owned();
    let (stderr, trailer) = match stderr.rfind(CELL_MARKER) {
        Some(at) => {
            let trailer = stderr[at + CELL_MARKER.len()..].trim_end();
            (stderr[..at].to_owned(), serde_json::from_str::<Value>(trailer).ok())
        }
        None => (stderr, None),
    };
    let mut lines = vec![json!({"type": "number_of_executions", "execution_count": count})];
    let stdout = String::from_utf8_lossy(&outcome.stdout);
    if !stdout.is_empty() {
        lines.push(json!({"type": "stdout", "text": stdout, "timestamp": now}));
    }
    if !stderr.is_empty() {
        lines.push(json!({"type": "stderr", "text": stderr, "timestamp": now}));
    }
    match trailer {
        Some(trailer) => {
            if let Some(text) = trailer["result"].as_str() {
                lines.push(json!({"type": "result", "text": text, "is_main_result": true}));
            }
            if trailer["error"].is_object() {
                let error = &trailer["error"];
                lines.push(json!({"type": "error", "name": error["name"], "value": error["value"],
                    "traceback": error["traceback"]}));
            }
        }
        None => lines.push(json!({"type": "error", "name": "SandboxError", "value": outcome.status.to_string(),
            "traceback": ""})),
    }
    lines.push(json!({"type": "end_of_execution"}));
    let mut text = String::new();
    for line in lines {
        text.push_str(&line.to_string());
        text.push('\n');
    }
    ([(header::CONTENT_TYPE, "application/x-ndjson")], text).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_prints_utc_dates() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000000Z");
        assert_eq!(rfc3339(UNIX_EPOCH + Duration::from_secs(951_782_400)), "2000-02-29T00:00:00.000000Z");
        assert_eq!(rfc3339(UNIX_EPOCH + Duration::from_millis(1_796_105_201_500)), "2026-12-01T06:06:41.500000Z");
    }

    #[test]
    fn envelopes_round_trip_and_bad_ones_are_refused() {
        let frame = envelope(0, &json!({"process": {"cmd": "/bin/bash"}}));
        assert_eq!(parse_envelope(&frame), Ok(json!({"process": {"cmd": "/bin/bash"}})));
        assert!(parse_envelope(&frame[..3]).is_err());
        assert!(parse_envelope(&frame[..frame.len() - 1]).is_err());
        let mut compressed = frame.to_vec();
        compressed[0] = 1;
        assert!(parse_envelope(&compressed).is_err());
    }

    #[test]
    fn cwd_and_envs_become_an_env_prefix() {
        let config = ProcessConfig {
            cmd: "/bin/bash".into(),
            args: vec!["-c".into(), "pwd".into()],
            envs: BTreeMap::from([("A".to_owned(), "1".to_owned())]),
            cwd: Some("/tmp".into()),
        };
        assert_eq!(
            command_argv(config).expect("argv"),
            ["/usr/bin/env", "-C", "/tmp", "A=1", "/bin/bash", "-c", "pwd"].map(String::from).to_vec()
        );
    }
}

/// Entry points of the fuzz targets (`fuzz/`): the parsers a client feeds, reachable without a server.
#[doc(hidden)]
pub mod fuzzing;
