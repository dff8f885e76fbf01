//! envd's `process.Process` service: commands started, attached to, fed, signalled and listed. A command outlives the
//! client that started it; its frames go to the `Start` stream and to every `Connect` stream attached meanwhile.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde::Deserialize;
use serde_json::{Value, json};
use strata_core::{CancelToken, ExecOptions, Job, Limits, OutputSink, Status, Stream, Terminal, UserName, WindowSize};
use tokio::sync::{broadcast, mpsc};

use super::connect::{ConnectRequest, END_STREAM, EnvdSandbox, EnvelopeReader, StreamMessage, envelope};
use super::{ConnectCode, E2bError, E2bMeta, RunningCommand};
use crate::AppState;
use crate::registry::{SandboxEntry, lock};
use crate::service::{CancelOnDrop, blocking, record_job};

#[derive(Debug, Deserialize)]
pub(super) struct StartRequest {
    pub(super) process: ProcessConfig,
    /// Keep stdin open for `SendInput` (the SDK's `commands.run(..., stdin=True)`); closed at once otherwise.
    #[serde(default)]
    pub(super) stdin: bool,
    /// Run the command on a terminal of this size (the SDK's `pty.create`): its input comes from `SendInput` and
    /// `StreamInput` as `input.pty`, its output goes out as `data.pty`, `Update` resizes it.
    #[serde(default)]
    pty: Option<PtyConfig>,
}

/// envd's `PTY` message.
#[derive(Debug, Default, Deserialize)]
struct PtyConfig {
    #[serde(default)]
    size: PtySize,
}

/// envd's `PTY.Size`.
#[derive(Debug, Default, Deserialize)]
struct PtySize {
    #[serde(default)]
    cols: u32,
    #[serde(default)]
    rows: u32,
}

impl PtySize {
    /// The window size; a dimension left out is the traditional one, a huge one the largest a terminal has.
    fn window(&self) -> WindowSize {
        let fit = |n: u32, default: u16| if n == 0 { default } else { u16::try_from(n).unwrap_or(u16::MAX) };
        let default = WindowSize::default();
        WindowSize { rows: fit(self.rows, default.rows), cols: fit(self.cols, default.cols) }
    }
}

#[derive(Debug, Deserialize)]
pub(super) struct ProcessConfig {
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
    /// The command runs on a terminal: its output is `data.pty`, and all of it passes (a terminal lives as long
    /// as its program, past any output limit); the `Start` stream then holds at most [`PTY_QUEUED`] bytes its
    /// client has not read, dropping what comes beyond.
    pty: Option<Arc<AtomicUsize>>,
}

/// The most bytes of a terminal's output queued for a `Start` stream whose client does not read.
const PTY_QUEUED: usize = 8 << 20;

impl EventSink {
    fn emit(&self, frame: Bytes) {
        // No receiver attached is not an error.
        let _ = self.connected.send(frame.clone());
        if let Some(queued) = &self.pty {
            let room = |q: usize| q.checked_add(frame.len()).filter(|after| *after <= PTY_QUEUED);
            if queued.fetch_update(Ordering::SeqCst, Ordering::SeqCst, room).is_err() {
                return;
            }
        }
        let _ = self.start.send(frame);
    }
}

impl OutputSink for EventSink {
    fn output(&self, stream: Stream, chunk: &[u8]) {
        let key = match (stream, &self.pty) {
            (_, Some(_)) => "pty",
            (Stream::Stdout, None) => "stdout",
            (Stream::Stderr, None) => "stderr",
        };
        self.emit(envelope(0, &json!({"event": {"data": {key: BASE64.encode(chunk)}}})));
    }

    fn takes_all(&self) -> bool {
        self.pty.is_some()
    }
}

/// Frames kept for a `Connect` stream that reads slower than the command writes; one that falls further behind
/// loses the oldest (the `Start` stream never does).
const CONNECT_BACKLOG: usize = 1024;

/// The argv of a process config: `env -C CWD K=V … CMD ARGS` when it sets a directory or variables.
pub(super) fn command_argv(config: ProcessConfig) -> Result<Vec<String>, E2bError> {
    let mut argv = Vec::new();
    if config.cwd.is_some() || !config.envs.is_empty() {
        argv.push("/usr/bin/env".to_owned());
        if let Some(cwd) = config.cwd {
            argv.push("-C".to_owned());
            argv.push(cwd);
        }
        for (name, value) in config.envs {
            if name.is_empty() || name.contains(['=', '\0']) {
                return Err(E2bError::invalid_argument(format!("invalid environment name {name:?}")));
            }
            argv.push(format!("{name}={value}"));
        }
    }
    argv.push(config.cmd);
    argv.extend(config.args);
    if argv.iter().any(|a| a.contains('\0')) {
        return Err(E2bError::invalid_argument("arguments must not contain NUL"));
    }
    Ok(argv)
}

/// How long a command may live as a job: until it exits, is killed, or its sandbox ends (which this bounds), as in
/// E2B. The request's timeout (`connect-timeout-ms`, the SDK's `timeout`, 60 s by default) bounds the client's
/// stream, which the SDK ends itself; the command goes on without it (`Connect` attaches to it again), so a
/// background server outlives the timeout its `run(..., background=True)` was given.
pub(super) const COMMAND_LIFE: Duration = crate::service::JOB_LIFE;

/// The limits of a command: the sandbox's, but for wall and CPU time, which are [`COMMAND_LIFE`].
pub(super) fn command_limits(entry: &SandboxEntry) -> Limits {
    Limits { wall: COMMAND_LIFE, cpu: COMMAND_LIFE, ..entry.limits.clone() }
}

/// The wall limit of a code cell: the request's timeout (`connect-timeout-ms`; the SDK's `run_code(timeout=300)`),
/// [`COMMAND_LIFE`] when it is 0 (no limit), the sandbox's job wall limit when the request gives none.
pub(super) fn cell_wall(entry: &SandboxEntry, headers: &HeaderMap) -> Duration {
    let asked = headers.get("connect-timeout-ms").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    match asked {
        Some(0) => COMMAND_LIFE,
        Some(ms) => Duration::from_millis(ms).min(COMMAND_LIFE),
        None => entry.limits.wall,
    }
}

/// How long `SendSignal` waits for the command to be gone before it answers anyway.
const KILL_WAIT: Duration = Duration::from_secs(10);

/// The Linux user an envd call names (`Authorization: Basic base64("<user>:")`, the SDK's `user=`), `user` when it
/// names none.
pub(super) fn envd_user(headers: &HeaderMap) -> String {
    let basic = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Basic "));
    let decoded = basic.and_then(|b| BASE64.decode(b.trim()).ok()).and_then(|b| String::from_utf8(b).ok());
    match decoded.as_deref().and_then(|d| d.split(':').next()).filter(|name| !name.is_empty()) {
        Some(name) => name.to_owned(),
        None => "user".to_owned(),
    }
}

/// The account a command of the call runs as: the one it names (`user=`, [`super::USER`] when none), or, in a
/// sandbox whose home is shared with a wasm Python session (owned by the sandbox's root), the sandbox's root.
pub(super) fn job_user(meta: &E2bMeta, headers: &HeaderMap) -> Result<Option<UserName>, E2bError> {
    if meta.home.is_some() {
        return Ok(None);
    }
    let name = envd_user(headers);
    UserName::new(name).map(Some).map_err(|e| E2bError::invalid_argument(e.to_string()))
}

/// Where a command of `user` starts when its request names no directory: its home, as envd does.
pub(super) fn home_of(user: &str) -> &'static str {
    if user == "root" { "/root" } else { super::HOME }
}

pub(super) async fn start(
    State(state): State<Arc<AppState>>,
    EnvdSandbox(entry, meta): EnvdSandbox,
    headers: HeaderMap,
    ConnectRequest(mut request): ConnectRequest<StartRequest>,
) -> Result<Response, E2bError> {
    if request.process.cwd.is_none() {
        request.process.cwd = Some(home_of(&envd_user(&headers)).to_owned());
    }
    let user = job_user(&meta, &headers)?;
    let (cmd, args, keep_stdin) = (request.process.cmd.clone(), request.process.args.clone(), request.stdin);
    let terminal = request.pty.as_ref().map(|pty| Terminal::new(pty.size.window()));
    let argv = command_argv(request.process)?;
    // A terminal's input is always open: what is typed comes through `SendInput`.
    let (stdin_stream, stdin) = if keep_stdin || terminal.is_some() {
        let (stream, tx) = crate::service::stdin_writer()?;
        (Some(stream), Some(tx))
    } else {
        (None, None)
    };
    let limits = command_limits(&entry);
    let pid = state.e2b.pid();
    let token = CancelToken::new();
    let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
    let (connected, _) = broadcast::channel(CONNECT_BACKLOG);
    let queued = terminal.as_ref().map(|_| Arc::new(AtomicUsize::new(0)));
    let sink = EventSink { start: tx.clone(), connected: connected.clone(), pty: queued.clone() };
    let command =
        RunningCommand { cancel: token.clone(), cmd, args, stdin, events: connected, terminal: terminal.clone() };
    lock(&meta.commands).insert(pid, command);
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
            determinism: None,
            terminal,
            user,
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
        lock(&meta.commands).remove(&pid);
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
            // Killed (`SendSignal`, `commands.kill`): reported as envd reports a process a signal ended.
            Err(err) if err.code == "cancelled" => {
                let end =
                    json!({"exitCode": -1, "exited": false, "status": "signal: killed", "error": "signal: killed"});
                sink.emit(envelope(0, &json!({"event": {"end": end}})));
                json!({})
            }
            Err(err) => E2bError::from(err).end_of_stream(),
        };
        sink.emit(envelope(END_STREAM, &end));
    });
    let stream = futures_util::stream::unfold((rx, queued), |(mut rx, queued)| async move {
        let frame = rx.recv().await?;
        if let Some(queued) = &queued {
            // Frames sent past the count (the start and end events) take nothing off it.
            let _ = queued.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |q| Some(q.saturating_sub(frame.len())));
        }
        Some((Ok::<Bytes, Infallible>(frame), (rx, queued)))
    });
    Ok(([(header::CONTENT_TYPE, "application/connect+json")], Body::from_stream(stream)).into_response())
}

/// `process.Process/Connect`: the start event of a running command, then its frames from now on, to its end.
pub(super) async fn connect(
    EnvdSandbox(_, meta): EnvdSandbox,
    ConnectRequest(request): ConnectRequest<Value>,
) -> Result<Response, E2bError> {
    let pid = selected_pid(&request)?;
    let events = lock(&meta.commands).get(&pid).map(|c| c.events.subscribe());
    let events = events.ok_or_else(|| E2bError::not_found(format!("process with pid {pid} not found")))?;
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
    Ok(([(header::CONTENT_TYPE, "application/connect+json")], Body::from_stream(stream)).into_response())
}

/// `process.Process/SendSignal`: ends the command and answers once it is gone (its job ended: its processes
/// killed, its jail torn down), or after [`KILL_WAIT`].
pub(super) async fn send_signal(
    EnvdSandbox(_, meta): EnvdSandbox,
    ConnectRequest(request): ConnectRequest<Value>,
) -> Result<Json<Value>, E2bError> {
    // Every signal ends the command: the engine cancels jobs, it does not deliver signals.
    let mut events = with_command(&meta, selected_pid(&request)?, |command| {
        command.cancel.cancel();
        command.events.subscribe()
    })?;
    // The command's frames end (the channel closes) when its task has ended the job and dropped its senders.
    let _ = tokio::time::timeout(KILL_WAIT, async {
        loop {
            match events.recv().await {
                Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => continue,
                Err(broadcast::error::RecvError::Closed) => return,
            }
        }
    })
    .await;
    Ok(Json(json!({})))
}

/// The pid a `process.Process/*` request selects.
pub(super) fn selected_pid(request: &Value) -> Result<u32, E2bError> {
    let pid = request["process"]["pid"].as_u64().and_then(|p| u32::try_from(p).ok());
    pid.ok_or_else(|| E2bError::invalid_argument("process.pid is required"))
}

/// `f` on the sandbox's running command `pid`; `not_found` when there is none.
fn with_command<T>(meta: &E2bMeta, pid: u32, f: impl FnOnce(&mut RunningCommand) -> T) -> Result<T, E2bError> {
    let mut commands = lock(&meta.commands);
    let command =
        commands.get_mut(&pid).ok_or_else(|| E2bError::not_found(format!("process with pid {pid} not found")))?;
    Ok(f(command))
}

/// `process.Process/SendInput`: `input.stdin` (base64, as protobuf JSON writes bytes) to a command started with
/// `stdin: true`. It waits while the command is not reading (at most [`crate::ws`]'s queue of chunks ahead).
pub(super) async fn send_input(
    EnvdSandbox(_, meta): EnvdSandbox,
    ConnectRequest(request): ConnectRequest<Value>,
) -> Result<Json<Value>, E2bError> {
    let pid = selected_pid(&request)?;
    give_input(&meta, pid, &request["input"]).await?;
    Ok(Json(json!({})))
}

/// Gives a `ProcessInput` (`stdin` or `pty`, base64 as protobuf JSON writes bytes) to command `pid`: `pty` to a
/// command on a terminal, `stdin` to one started with `stdin: true`. It waits while the command is not reading
/// (at most [`crate::ws`]'s queue of chunks ahead).
async fn give_input(meta: &E2bMeta, pid: u32, input: &Value) -> Result<(), E2bError> {
    let (data, pty) = match (input["stdin"].as_str(), input["pty"].as_str()) {
        (Some(text), None) => (text, false),
        (None, Some(text)) => (text, true),
        _ => return Err(E2bError::invalid_argument("input needs one of stdin and pty")),
    };
    let data = BASE64.decode(data).map_err(|e| E2bError::invalid_argument(format!("input: {e}")))?;
    let (stdin, terminal) = with_command(meta, pid, |command| (command.stdin.clone(), command.terminal.is_some()))?;
    if pty != terminal {
        let message = match pty {
            true => format!("process {pid} has no terminal (send input.stdin)"),
            false => format!("process {pid} runs on a terminal (send input.pty)"),
        };
        return Err(E2bError::new(ConnectCode::FailedPrecondition, message));
    }
    let stdin = stdin.ok_or_else(|| {
        E2bError::new(
            ConnectCode::FailedPrecondition,
            format!("process {pid} has no open stdin (start it with stdin, and do not close it)"),
        )
    })?;
    if !data.is_empty() && stdin.send(data).await.is_err() {
        return Err(E2bError::not_found(format!("process with pid {pid} has ended")));
    }
    Ok(())
}

/// The most bytes of one `StreamInput` message.
const MAX_INPUT_MESSAGE: usize = 1 << 20;

/// `process.Process/StreamInput`: a client stream of `ProcessInput`s, the first message naming the command
/// (`start.process`), then `data.input` messages (and `keepalive`s), each given to it as `SendInput` would.
/// Answered with one empty message once the client's stream ends.
pub(super) async fn stream_input(
    EnvdSandbox(_, meta): EnvdSandbox,
    request: axum::extract::Request,
) -> Result<Response, E2bError> {
    use futures_util::StreamExt;
    let mut body = request.into_body().into_data_stream();
    let mut reader = EnvelopeReader::new(MAX_INPUT_MESSAGE);
    let mut pid = None;
    loop {
        while let Some(StreamMessage { end, message }) = reader.next_message().map_err(E2bError::invalid_argument)? {
            if end {
                continue;
            }
            if let Some(start) = message.get("start") {
                pid = Some(selected_pid(start)?);
            } else if let Some(data) = message.get("data") {
                let pid = pid.ok_or_else(|| E2bError::invalid_argument("the first message must be start"))?;
                give_input(&meta, pid, &data["input"]).await?;
            }
        }
        match body.next().await {
            Some(Ok(chunk)) => reader.push(&chunk),
            Some(Err(err)) => return Err(E2bError::invalid_argument(format!("reading the stream: {err}"))),
            None if reader.is_partial() => return Err(E2bError::invalid_argument("the stream ends inside a message")),
            None => break,
        }
    }
    let frames = [envelope(0, &json!({})), envelope(END_STREAM, &json!({}))].concat();
    Ok(([(header::CONTENT_TYPE, "application/connect+json")], frames).into_response())
}

/// `process.Process/Update`: resizes the terminal of command `process` to `pty.size`.
pub(super) async fn update(
    EnvdSandbox(_, meta): EnvdSandbox,
    ConnectRequest(request): ConnectRequest<Value>,
) -> Result<Json<Value>, E2bError> {
    let pid = selected_pid(&request)?;
    let size: PtySize = serde_json::from_value(request["pty"]["size"].clone())
        .map_err(|e| E2bError::invalid_argument(format!("pty.size: {e}")))?;
    let terminal = with_command(&meta, pid, |command| command.terminal.clone())?;
    let terminal = terminal.ok_or_else(|| {
        E2bError::new(ConnectCode::FailedPrecondition, format!("process {pid} has no terminal to resize"))
    })?;
    terminal.resize(size.window());
    Ok(Json(json!({})))
}

/// `process.Process/CloseStdin`: the command reads end-of-file once what was sent before is written.
pub(super) async fn close_stdin(
    EnvdSandbox(_, meta): EnvdSandbox,
    ConnectRequest(request): ConnectRequest<Value>,
) -> Result<Json<Value>, E2bError> {
    with_command(&meta, selected_pid(&request)?, |command| command.stdin = None)?;
    Ok(Json(json!({})))
}

pub(super) async fn list(EnvdSandbox(_, meta): EnvdSandbox) -> Json<Value> {
    let processes: Vec<Value> = lock(&meta.commands)
        .iter()
        .map(|(pid, command)| json!({"pid": pid, "config": {"cmd": command.cmd, "args": command.args}}))
        .collect();
    Json(json!({ "processes": processes }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_user_comes_from_basic_auth_and_chooses_the_home() {
        let with = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::AUTHORIZATION, value.parse().expect("header"));
            envd_user(&headers)
        };
        assert_eq!(envd_user(&HeaderMap::new()), "user");
        assert_eq!(with(&format!("Basic {}", BASE64.encode("root:"))), "root");
        assert_eq!(with("Basic !!!"), "user");
        assert_eq!(with(&format!("Basic {}", BASE64.encode(":"))), "user");
        assert_eq!((home_of("root"), home_of("user"), home_of("other")), ("/root", "/home/user", "/home/user"));
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
