//! `GET /v1/sandboxes/{id}/exec/ws`: a job streamed over a WebSocket.
//!
//! Protocol:
//! 1. The client's first message is the job, as JSON ([`crate::service::JobRequest`]).
//! 2. With `"stdin_stream": true`, the next messages (binary or text) are the job's stdin, written into a pipe as
//!    they come, up to an empty message (EOF, the pipe closed). On every tier the job reads each message as it
//!    arrives, and its answers stream back meanwhile ([`strata_core::ExecOptions::stdin_stream`]). A job that stops
//!    reading stops the reading of further messages (back-pressure), never the output.
//! 3. The server sends text messages as output comes: `{"type":"stdout"|"stderr","data":"…"}` (with
//!    `"encoding":"base64"` when the chunk is not UTF-8), then `{"type":"outcome","outcome":{…}}` — the Outcome as
//!    `strata run --json` prints it — or `{"type":"error","error":{"code","message"}}`, and closes.
//!
//! A client that closes the socket, or goes away, before the outcome cancels the job. The job must come within the
//! server's body timeout, and a client that stops reading is gone once a write has waited for the write timeout
//! ([`crate::connections`]).

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Extension, Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde_json::json;
use strata_core::{CancelToken, ExecOptions, OutputSink, Stream};
use tokio::sync::mpsc;

use crate::error::ApiError;
use crate::registry::SandboxEntry;
use crate::service::{CancelOnDrop, JobRequest, blocking, limits, record_job, stdin_writer};
use crate::{AppState, Principal};

/// The WebSocket route (behind authentication).
pub fn routes() -> Router<Arc<AppState>> {
    Router::new().route("/v1/sandboxes/{id}/exec/ws", get(exec_ws))
}

async fn exec_ws(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    upgrade: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Result<Response, ApiError> {
    state.admit()?;
    let entry = crate::service::sandbox(&state, &principal, &id)?;
    let upgrade = upgrade.map_err(|r| ApiError::bad_request("websocket_required", r.body_text()))?;
    let upgrade = upgrade.protocols([crate::auth::WS_PROTOCOL]);
    Ok(upgrade.on_upgrade(move |socket| session(state, entry, socket)).into_response())
}

/// Forwards output chunks to the session's task; never blocks.
struct ChannelSink(mpsc::UnboundedSender<(Stream, Vec<u8>)>);

impl OutputSink for ChannelSink {
    fn output(&self, stream: Stream, chunk: &[u8]) {
        let _ = self.0.send((stream, chunk.to_vec()));
    }
}

fn chunk_message(stream: Stream, bytes: &[u8]) -> Message {
    let kind = match stream {
        Stream::Stdout => "stdout",
        Stream::Stderr => "stderr",
    };
    let value = match std::str::from_utf8(bytes) {
        Ok(text) => json!({"type": kind, "data": text}),
        Err(_) => json!({"type": kind, "data": BASE64.encode(bytes), "encoding": "base64"}),
    };
    Message::Text(value.to_string().into())
}

fn error_message(err: &ApiError) -> Message {
    Message::Text(json!({"type": "error", "error": {"code": err.code, "message": err.message}}).to_string().into())
}

async fn finish(mut socket: WebSocket, last: Message) {
    let _ = socket.send(last).await;
    let _ = socket.send(Message::Close(None)).await;
}

/// The next data message; `None` when the client closed or went away.
async fn next_data(socket: &mut WebSocket) -> Option<Message> {
    loop {
        match socket.recv().await {
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
            Some(Ok(Message::Close(_))) | Some(Err(_)) | None => return None,
            Some(Ok(message)) => return Some(message),
        }
    }
}

/// Gives a client's message to the job's stdin: an empty one closes it. Messages after that, or without
/// `stdin_stream`, are ignored.
async fn feed(stdin: &mut Option<mpsc::Sender<Vec<u8>>>, chunk: Vec<u8>) {
    let Some(tx) = stdin else { return };
    if chunk.is_empty() || tx.send(chunk).await.is_err() {
        *stdin = None;
    }
}

async fn session(state: Arc<AppState>, entry: Arc<SandboxEntry>, mut socket: WebSocket) {
    // The job is the socket's request body: it must come within the body timeout, like any other.
    let timeout = state.connections.limits().body_timeout;
    let request = match tokio::time::timeout(timeout, next_data(&mut socket)).await {
        Ok(Some(Message::Text(text))) => serde_json::from_str::<JobRequest>(&text),
        Ok(Some(Message::Binary(bytes))) => serde_json::from_slice::<JobRequest>(&bytes),
        Ok(_) => return,
        Err(_) => {
            let err = ApiError::new(
                axum::http::StatusCode::REQUEST_TIMEOUT,
                "body_timeout",
                format!("the job did not come within {timeout:?} of the upgrade"),
            );
            return finish(socket, error_message(&err)).await;
        }
    };
    let prepared = request
        .map_err(|e| ApiError::bad_request("invalid_json", format!("the first message must be the job: {e}")))
        .and_then(|req| {
            let job = req.to_job()?;
            let limits = limits(&state, &entry.limits, &req.limits)?;
            let user = req.user()?;
            Ok((req, job, limits, user))
        });
    let (req, job, limits, user) = match prepared {
        Ok(prepared) => prepared,
        Err(err) => return finish(socket, error_message(&err)).await,
    };
    // No stdin unless the job brings some: a wasm Python session takes stdin only when it starts.
    let (stdin_stream, mut stdin_tx) = if req.stdin_stream {
        match stdin_writer() {
            Ok((stream, tx)) => (Some(stream), Some(tx)),
            Err(err) => return finish(socket, error_message(&err)).await,
        }
    } else {
        (None, None)
    };

    let (tx, mut rx) = mpsc::unbounded_channel();
    let token = CancelToken::new();
    let mut guard = CancelOnDrop(Some(token.clone()));
    let opts = ExecOptions {
        limits: Some(limits),
        stdin: req.stdin.map(String::into_bytes),
        stdin_stream,
        sink: Some(Arc::new(ChannelSink(tx))),
        cancel: Some(token.clone()),
        determinism: None,
        terminal: None,
        user,
    };
    let started = Instant::now();
    let tier = entry.tier;
    let job_entry = entry.clone();
    let mut job = std::pin::pin!(blocking(move || job_entry.exec(&job, opts)));
    let mut client_gone = false;
    let mut sink_open = true;
    let result = loop {
        tokio::select! {
            chunk = rx.recv(), if sink_open => match chunk {
                Some((stream, bytes)) => {
                    if !client_gone && socket.send(chunk_message(stream, &bytes)).await.is_err() {
                        client_gone = true;
                        token.cancel();
                    }
                }
                None => sink_open = false,
            },
            message = socket.recv(), if !client_gone => match message {
                Some(Ok(Message::Close(_))) | Some(Err(_)) | None => {
                    tracing::info!(sandbox = %entry.id, "client went away; cancelling the job");
                    client_gone = true;
                    token.cancel();
                }
                Some(Ok(Message::Binary(bytes))) => feed(&mut stdin_tx, bytes.to_vec()).await,
                Some(Ok(Message::Text(text))) => feed(&mut stdin_tx, text.as_bytes().to_vec()).await,
                Some(Ok(_)) => {}
            },
            result = &mut job => break result,
        }
    };
    guard.0 = None;
    record_job(&state, tier, "exec_ws", started, &result);
    if client_gone {
        return;
    }
    while let Ok((stream, bytes)) = rx.try_recv() {
        if socket.send(chunk_message(stream, &bytes)).await.is_err() {
            return;
        }
    }
    let last = match result {
        Ok(outcome) => match serde_json::to_value(&outcome) {
            Ok(outcome) => Message::Text(json!({"type": "outcome", "outcome": outcome}).to_string().into()),
            Err(e) => error_message(&ApiError::internal(format!("cannot encode the outcome: {e}"))),
        },
        Err(err) => error_message(&err),
    };
    finish(socket, last).await;
}
