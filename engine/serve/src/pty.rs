//! Terminals: a job on a pseudo-terminal inside a sandbox ([`strata_core::Terminal`]) that outlives the client
//! who opened it.
//!
//! - `POST /v1/sandboxes/{id}/ptys` starts one (`/bin/bash -i -l` unless a command is given, `TERM=xterm-256color`)
//!   and answers its id at once; it lives until its program exits, it is killed, or the sandbox ends.
//! - `GET /v1/sandboxes/{id}/ptys/{pty}/ws` attaches a WebSocket, as many at once as clients like: the server
//!   first sends what the terminal printed lately (its last [`SCROLLBACK`] bytes, so a client that comes back sees
//!   the screen it left) and then its output as it comes, as binary messages; the client's binary messages are
//!   typed input (`0x03` is Ctrl-C), its text messages JSON controls: `{"type":"resize","rows":R,"cols":C}`,
//!   `{"type":"input","data":"…"}`, `{"type":"kill"}`. When the program ends the server sends
//!   `{"type":"exit","outcome":{…}}` (or `{"type":"error","error":{…}}`) and closes. A client that goes away
//!   leaves the terminal running.
//! - `POST …/ptys/{pty}/resize`, `DELETE …/ptys/{pty}` (answers once it is gone), `GET …/ptys`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Json;
use axum::Router;
use axum::extract::rejection::JsonRejection;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Extension, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use strata_core::{CancelToken, ExecOptions, Job, OutputSink, Stream, Terminal, WindowSize};
use tokio::sync::{broadcast, mpsc, watch};
use utoipa::ToSchema;

use crate::error::{ApiError, ErrorBody};
use crate::registry::{SandboxEntry, lock, new_id};
use crate::service::{JOB_LIFE, blocking, record_job, sandbox, stdin_writer};
use crate::{AppState, Principal};

/// What a terminal printed lately, replayed to a client that attaches.
pub const SCROLLBACK: usize = 64 * 1024;

/// The most terminals one sandbox holds at once (the jail's `devpts` holds 64, its jobs' own included).
pub const MAX_PTYS: usize = 32;

/// Output chunks kept for an attached client that reads slower than the terminal writes; one that falls further
/// behind loses the oldest.
const BACKLOG: usize = 1024;

/// How long `DELETE` waits for the terminal's program to be gone.
const KILL_WAIT: Duration = Duration::from_secs(10);

/// The routes (behind authentication).
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/sandboxes/{id}/ptys", post(create).get(list))
        .route("/v1/sandboxes/{id}/ptys/{pty}", delete(kill))
        .route("/v1/sandboxes/{id}/ptys/{pty}/resize", post(resize))
        .route("/v1/sandboxes/{id}/ptys/{pty}/ws", get(attach))
}

/// The terminals of every sandbox, by sandbox id; a sandbox's go when it is killed.
#[derive(Debug, Default)]
pub struct Ptys(Mutex<HashMap<String, HashMap<String, Arc<Pty>>>>);

impl Ptys {
    fn get(&self, sandbox: &str, pty: &str) -> Result<Arc<Pty>, ApiError> {
        lock(&self.0).get(sandbox).and_then(|ptys| ptys.get(pty)).cloned().ok_or_else(|| {
            ApiError::new(StatusCode::NOT_FOUND, "pty_not_found", format!("no terminal {pty} in sandbox {sandbox}"))
        })
    }

    /// Adds `pty` to `entry`'s terminals; the first one makes the sandbox's end drop them all.
    fn add(self: &Arc<Self>, entry: &SandboxEntry, pty: Arc<Pty>) -> Result<(), ApiError> {
        let mut all = lock(&self.0);
        let first = !all.contains_key(&entry.id);
        let ptys = all.entry(entry.id.clone()).or_default();
        if ptys.len() >= MAX_PTYS {
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_ptys",
                format!("the sandbox already has {MAX_PTYS} terminals"),
            ));
        }
        ptys.insert(pty.id.clone(), pty);
        drop(all);
        if first {
            let (ptys, id) = (Arc::downgrade(self), entry.id.clone());
            entry.on_kill(move || {
                if let Some(ptys) = ptys.upgrade() {
                    for pty in lock(&ptys.0).remove(&id).unwrap_or_default().into_values() {
                        pty.cancel.cancel();
                    }
                }
            });
        }
        Ok(())
    }

    fn remove(&self, sandbox: &str, pty: &str) {
        if let Some(ptys) = lock(&self.0).get_mut(sandbox) {
            ptys.remove(pty);
        }
    }

    /// How many terminals run in sandbox `id`.
    pub fn running(&self, id: &str) -> usize {
        lock(&self.0).get(id).map_or(0, HashMap::len)
    }
}

/// One terminal.
#[derive(Debug)]
pub(crate) struct Pty {
    id: String,
    command: Vec<String>,
    terminal: Terminal,
    cancel: CancelToken,
    /// Its input, while the program runs.
    input: mpsc::Sender<Vec<u8>>,
    /// Its output from now on, for attached clients.
    output: broadcast::Sender<Arc<[u8]>>,
    /// Its latest output, and whether it ended; the sink and attaching clients take this lock, so a client sees
    /// every byte exactly once: in the replay or on its receiver.
    screen: Mutex<VecDeque<u8>>,
    /// The last message, once the program has ended.
    ended: watch::Sender<Option<Value>>,
    attached: std::sync::atomic::AtomicUsize,
}

/// The terminal's output sink: into the scrollback and to every attached client. Never blocks.
struct Screen(Arc<Pty>);

impl OutputSink for Screen {
    fn output(&self, _: Stream, chunk: &[u8]) {
        let mut screen = lock(&self.0.screen);
        screen.extend(chunk);
        let excess = screen.len().saturating_sub(SCROLLBACK);
        screen.drain(..excess);
        let _ = self.0.output.send(chunk.into());
    }

    /// A terminal lives as long as its program: its output goes to its clients, none is kept in the outcome.
    fn takes_all(&self) -> bool {
        true
    }
}

/// A terminal to start.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct PtyRequest {
    /// The program and its arguments; `["/bin/bash", "-i", "-l"]` when absent.
    pub command: Option<Vec<String>>,
    /// Environment variables besides the sandbox's (`TERM` is `xterm-256color` unless given here).
    pub env: BTreeMap<String, String>,
    /// Its working directory.
    pub cwd: Option<String>,
    /// Window rows (24 when absent).
    pub rows: Option<u16>,
    /// Window columns (80 when absent).
    pub cols: Option<u16>,
}

/// A terminal's size.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResizeRequest {
    /// Rows.
    pub rows: u16,
    /// Columns.
    pub cols: u16,
}

/// A running terminal.
#[derive(Debug, Serialize, ToSchema)]
pub struct PtyInfo {
    /// Its id, for the other `ptys` routes.
    pub id: String,
    /// Its program and arguments.
    pub command: Vec<String>,
    /// Window rows.
    pub rows: u16,
    /// Window columns.
    pub cols: u16,
    /// WebSocket clients attached now.
    pub attached: usize,
}

impl PtyInfo {
    fn of(pty: &Pty) -> PtyInfo {
        let size = pty.terminal.size();
        PtyInfo {
            id: pty.id.clone(),
            command: pty.command.clone(),
            rows: size.rows,
            cols: size.cols,
            attached: pty.attached.load(std::sync::atomic::Ordering::SeqCst),
        }
    }
}

/// A sandbox's terminals.
#[derive(Debug, Serialize, ToSchema)]
pub struct PtyList {
    /// Running terminals.
    pub ptys: Vec<PtyInfo>,
}

fn window(rows: u16, cols: u16) -> Result<WindowSize, ApiError> {
    if rows == 0 || cols == 0 {
        return Err(ApiError::bad_request("invalid_size", "rows and cols must be at least 1"));
    }
    Ok(WindowSize { rows, cols })
}

/// The argv of a terminal's program: `env [-C DIR] K=V… PROGRAM ARGS`.
fn argv(req: PtyRequest) -> Result<(Vec<String>, Vec<String>), ApiError> {
    let invalid = |message: String| ApiError::bad_request("invalid_pty", message);
    let command = req.command.unwrap_or_else(|| ["/bin/bash", "-i", "-l"].map(String::from).to_vec());
    if command.first().is_none_or(String::is_empty) {
        return Err(invalid("command must name a program".into()));
    }
    let mut env = req.env;
    env.entry("TERM".into()).or_insert_with(|| "xterm-256color".into());
    let mut argv = vec!["/usr/bin/env".to_owned()];
    if let Some(cwd) = req.cwd {
        argv.extend(["-C".to_owned(), cwd]);
    }
    for (name, value) in env {
        if name.is_empty() || name.contains(['=', '\0']) {
            return Err(invalid(format!("invalid environment name {name:?}")));
        }
        argv.push(format!("{name}={value}"));
    }
    argv.extend(command.iter().cloned());
    if argv.iter().any(|a| a.contains('\0')) {
        return Err(invalid("arguments must not contain NUL".into()));
    }
    Ok((argv, command))
}

fn json<T>(body: Result<Json<T>, JsonRejection>) -> Result<T, ApiError> {
    body.map(|Json(value)| value).map_err(ApiError::from)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/ptys", tag = "ptys", request_body = PtyRequest,
    responses((status = 201, body = PtyInfo, description = "the terminal runs; attach to it with `…/ws`"),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 429, body = ErrorBody),
        (status = 501, body = ErrorBody, description = "the sandbox's tier has no terminals (wasm)")))]
pub(crate) async fn create(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    body: Result<Json<PtyRequest>, JsonRejection>,
) -> Result<(StatusCode, Json<PtyInfo>), ApiError> {
    state.admit()?;
    let req = json(body)?;
    let entry = sandbox(&state, &principal, &id)?;
    let size = window(req.rows.unwrap_or(24), req.cols.unwrap_or(80))?;
    let (argv, command) = argv(req)?;
    let pty = start(&state, &entry, Job::Command { argv }, command, size)?;
    Ok((StatusCode::CREATED, Json(PtyInfo::of(&pty))))
}

/// Starts `job` on a terminal of `size` in `entry`, as a task of its own that outlives every client.
fn start(
    state: &Arc<AppState>,
    entry: &Arc<SandboxEntry>,
    job: Job,
    command: Vec<String>,
    size: WindowSize,
) -> Result<Arc<Pty>, ApiError> {
    if entry.tier == strata_core::TierKind::Wasm {
        return Err(ApiError::from(strata_core::TierError::Unsupported {
            tier: entry.tier,
            what: "terminals (start the sandbox on the process or microVM tier)".into(),
        }));
    }
    let (stream, input) = stdin_writer()?;
    let (ended, _) = watch::channel(None);
    let pty = Arc::new(Pty {
        id: new_id("pty_"),
        command,
        terminal: Terminal::new(size),
        cancel: CancelToken::new(),
        input,
        output: broadcast::channel(BACKLOG).0,
        screen: Mutex::new(VecDeque::new()),
        ended,
        attached: std::sync::atomic::AtomicUsize::new(0),
    });
    state.ptys.add(entry, pty.clone())?;
    let opts = ExecOptions {
        limits: Some(strata_core::Limits { wall: JOB_LIFE, cpu: JOB_LIFE, ..entry.limits.clone() }),
        stdin_stream: Some(stream),
        sink: Some(Arc::new(Screen(pty.clone()))),
        cancel: Some(pty.cancel.clone()),
        terminal: Some(pty.terminal.clone()),
        ..ExecOptions::default()
    };
    let (task_state, task_entry, task_pty) = (state.clone(), entry.clone(), pty.clone());
    tokio::spawn(async move {
        let started = Instant::now();
        let job_entry = task_entry.clone();
        let result = blocking(move || job_entry.exec(&job, opts)).await;
        record_job(&task_state, task_entry.tier, "pty", started, &result);
        task_state.ptys.remove(&task_entry.id, &task_pty.id);
        let last = match result {
            Ok(outcome) => json!({"type": "exit", "outcome": outcome}),
            Err(err) => json!({"type": "error", "error": {"code": err.code, "message": err.message}}),
        };
        // Under the screen's lock: a client attaching now either sees the end or subscribes before it.
        let _screen = lock(&task_pty.screen);
        task_pty.ended.send_replace(Some(last));
    });
    Ok(pty)
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/ptys", tag = "ptys",
    responses((status = 200, body = PtyList), (status = 404, body = ErrorBody)))]
pub(crate) async fn list(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<PtyList>, ApiError> {
    let entry = sandbox(&state, &principal, &id)?;
    let ptys = lock(&state.ptys.0).get(&entry.id).map(|ptys| ptys.values().map(|p| PtyInfo::of(p)).collect());
    Ok(Json(PtyList { ptys: ptys.unwrap_or_default() }))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/ptys/{pty}/resize", tag = "ptys", request_body = ResizeRequest,
    responses((status = 204), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub(crate) async fn resize(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path((id, pty)): Path<(String, String)>,
    body: Result<Json<ResizeRequest>, JsonRejection>,
) -> Result<StatusCode, ApiError> {
    let req = json(body)?;
    let entry = sandbox(&state, &principal, &id)?;
    state.ptys.get(&entry.id, &pty)?.terminal.resize(window(req.rows, req.cols)?);
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}/ptys/{pty}", tag = "ptys",
    responses((status = 204, description = "the terminal's program and everything it started are gone"),
        (status = 404, body = ErrorBody)))]
pub(crate) async fn kill(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path((id, pty)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    let entry = sandbox(&state, &principal, &id)?;
    let pty = state.ptys.get(&entry.id, &pty)?;
    pty.cancel.cancel();
    let mut ended = pty.ended.subscribe();
    let _ = tokio::time::timeout(KILL_WAIT, ended.wait_for(Option::is_some)).await;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/ptys/{pty}/ws", tag = "ptys",
    description = "A WebSocket on the terminal: binary messages from the server are its output (first what it \
        printed lately, up to 64 KiB), binary messages from the client typed input; the client's text messages are \
        JSON controls `{\"type\":\"resize\",\"rows\":R,\"cols\":C}`, `{\"type\":\"input\",\"data\":\"…\"}` and \
        `{\"type\":\"kill\"}`; the server's last message is `{\"type\":\"exit\",\"outcome\":{…}}` or \
        `{\"type\":\"error\",\"error\":{…}}`. Closing the socket leaves the terminal running.",
    responses((status = 101, description = "switching to the WebSocket protocol"),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub(crate) async fn attach(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path((id, pty)): Path<(String, String)>,
    upgrade: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Result<Response, ApiError> {
    let entry = sandbox(&state, &principal, &id)?;
    let pty = state.ptys.get(&entry.id, &pty)?;
    let upgrade = upgrade.map_err(|r| ApiError::bad_request("websocket_required", r.body_text()))?;
    let upgrade = upgrade.protocols([crate::auth::WS_PROTOCOL]);
    Ok(upgrade.on_upgrade(move |socket| session(pty, socket)).into_response())
}

/// A control message of an attached client.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
enum Control {
    Resize { rows: u16, cols: u16 },
    Input { data: String },
    Kill,
}

async fn session(pty: Arc<Pty>, mut socket: WebSocket) {
    use std::sync::atomic::Ordering;
    pty.attached.fetch_add(1, Ordering::SeqCst);
    let (replay, mut output, mut ended) = {
        let screen = lock(&pty.screen);
        let replay: Vec<u8> = screen.iter().copied().collect();
        (replay, pty.output.subscribe(), pty.ended.subscribe())
    };
    // A terminal that already ended is seen as a change at once.
    ended.mark_changed();
    let mut open = replay.is_empty() || socket.send(Message::Binary(replay.into())).await.is_ok();
    while open {
        tokio::select! {
            chunk = output.recv() => match chunk {
                Ok(bytes) => open = socket.send(Message::Binary(bytes.to_vec().into())).await.is_ok(),
                Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => break,
            },
            changed = ended.changed() => {
                let last = ended.borrow_and_update().clone();
                let last = match (last, changed) {
                    (Some(last), _) => last,
                    (None, Ok(())) => continue,
                    (None, Err(_)) => Value::default(),
                };
                // What the program printed last is on the receiver before its end.
                while let Ok(bytes) = output.try_recv() {
                    if socket.send(Message::Binary(bytes.to_vec().into())).await.is_err() {
                        break;
                    }
                }
                let _ = socket.send(Message::Text(last.to_string().into())).await;
                let _ = socket.send(Message::Close(None)).await;
                break;
            }
            message = socket.recv() => match message {
                Some(Ok(Message::Binary(bytes))) => {
                    let _ = pty.input.send(bytes.to_vec()).await;
                }
                Some(Ok(Message::Text(text))) => match serde_json::from_str::<Control>(&text) {
                    Ok(Control::Resize { rows, cols }) => match window(rows, cols) {
                        Ok(size) => pty.terminal.resize(size),
                        Err(err) => open = send_error(&mut socket, &err).await,
                    },
                    Ok(Control::Input { data }) => {
                        let _ = pty.input.send(data.into_bytes()).await;
                    }
                    Ok(Control::Kill) => pty.cancel.cancel(),
                    Err(err) => {
                        let err = ApiError::bad_request("invalid_control", format!("not a control message: {err}"));
                        open = send_error(&mut socket, &err).await;
                    }
                },
                Some(Ok(_)) => {}
                Some(Err(_)) | None => open = false,
            },
        }
    }
    pty.attached.fetch_sub(1, Ordering::SeqCst);
}

/// Tells the client its message was refused; whether the socket is still open.
async fn send_error(socket: &mut WebSocket, err: &ApiError) -> bool {
    let message = json!({"type": "error", "error": {"code": err.code, "message": err.message}});
    socket.send(Message::Text(message.to_string().into())).await.is_ok()
}
