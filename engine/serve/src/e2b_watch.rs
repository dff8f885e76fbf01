//! The E2B agent's directory watchers, for the SDK's `files.watch_dir`. The sync SDK calls
//! `filesystem.Filesystem/CreateWatcher` (`{"path","recursive"}` → `{"watcherId"}`), `GetWatcherEvents`
//! (`{"watcherId"}` → `{"events":[{"name","type"}]}`, the events since the last call) and `RemoveWatcher`; the async
//! SDK calls the server-streaming `WatchDir` (`{"start":{}}`, then `{"filesystem":{…}}` per change; the watcher
//! stops when the client closes the stream).
//!
//! A watcher is a job in the sandbox, beside its commands: the sandbox's own `python3` lists the directory (its
//! whole tree when `recursive`) every [`POLL`] and prints what changed as JSON lines, which the server keeps until
//! the client asks. Names are relative to the watched directory, as in E2B. Being a comparison of listings, it
//! reports `EVENT_TYPE_CREATE`, `EVENT_TYPE_REMOVE`, `EVENT_TYPE_WRITE` (size or modification time changed) and
//! `EVENT_TYPE_CHMOD`; a rename shows as a removal and a creation, and a change undone within one poll is not seen.
//! A watcher ends with `RemoveWatcher` (or its stream), with its sandbox, or after about 60 000 events ([`MAX_OUTPUT`]:
//! a job's output is kept in memory, so it is bounded); then `GetWatcherEvents` is `not_found` and a stream ends.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Json, Response};
use futures_util::StreamExt;
use serde_json::{Value, json};
use strata_core::{CancelToken, ExecOptions, Job, OutputSink, Stream};
use tokio::sync::{mpsc, oneshot};

use crate::AppState;
use crate::error::ApiError;
use crate::registry::lock;

/// How often a watcher lists its directory.
const POLL: &str = "0.1";

/// The most events a watcher keeps between two `GetWatcherEvents` (older ones are dropped past it).
const MAX_EVENTS: usize = 10_000;

/// How often a `WatchDir` stream without events sends a keepalive.
const KEEPALIVE: Duration = Duration::from_secs(5);

/// How long `CreateWatcher` waits for the first listing.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// The most a watcher prints: its output is kept (and capped) like any job's, so it ends there rather than go on
/// silently. About 60 000 events.
const MAX_OUTPUT: u64 = 4 << 20;

/// The watcher: `python3 -c PROGRAM DIR RECURSIVE POLL MAX_BYTES`. Prints `{"ready":true}` (or `{"error":…}` and
/// ends), then one event per line, and ends before it has printed `MAX_BYTES`.
const PROGRAM: &str = r#"import json, os, sys, time
root = os.path.normpath(sys.argv[1] if sys.argv[1].startswith('/') else os.path.join('/home/user', sys.argv[1]))
recursive, poll, budget = sys.argv[2] == 'true', float(sys.argv[3]), int(sys.argv[4]) - 8192
def scan():
    seen = {}
    def walk(d, prefix):
        try:
            entries = list(os.scandir(d))
        except OSError:
            return
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            name = prefix + e.name
            seen[name] = (st.st_mode, st.st_size, st.st_mtime_ns)
            if recursive and e.is_dir(follow_symlinks=False):
                walk(e.path, name + '/')
    walk(root, '')
    return seen
if not os.path.isdir(root):
    code = 'not_found' if not os.path.lexists(root) else 'invalid_argument'
    print(json.dumps({'error': {'code': code, 'message': f'{root} is not a directory'}}), flush=True)
    sys.exit(0)
before = scan()
print(json.dumps({'ready': True}), flush=True)
while True:
    time.sleep(poll)
    now = scan()
    events = [(n, 'EVENT_TYPE_REMOVE') for n in before if n not in now]
    for n, (mode, size, mtime) in now.items():
        old = before.get(n)
        if old is None:
            events.append((n, 'EVENT_TYPE_CREATE'))
        elif (size, mtime) != old[1:]:
            events.append((n, 'EVENT_TYPE_WRITE'))
        elif mode != old[0]:
            events.append((n, 'EVENT_TYPE_CHMOD'))
    for n, kind in events:
        line = json.dumps({'name': n, 'type': kind})
        budget -= len(line.encode()) + 1
        if budget < 0:
            sys.exit(0)
        print(line, flush=True)
    before = now
"#;

/// The watchers of every E2B sandbox, by id.
#[derive(Debug, Default)]
pub struct Watchers(Mutex<HashMap<String, Arc<Watcher>>>);

impl Watchers {
    /// Stops and forgets the watchers of sandbox `id`.
    pub(crate) fn remove_sandbox(&self, id: &str) {
        lock(&self.0).retain(|_, watcher| {
            let keep = watcher.sandbox != id;
            if !keep {
                watcher.cancel.cancel();
            }
            keep
        });
    }
}

/// One watcher.
#[derive(Debug)]
pub struct Watcher {
    sandbox: String,
    cancel: CancelToken,
    sink: Arc<EventSink>,
}

/// Takes the watcher job's stdout: the first line answers `CreateWatcher`, the next are events.
#[derive(Debug, Default)]
struct EventSink {
    inner: Mutex<SinkState>,
}

#[derive(Debug, Default)]
struct SinkState {
    partial: Vec<u8>,
    /// Events kept for `GetWatcherEvents`.
    events: Vec<Value>,
    /// Where events go instead, for `WatchDir`.
    stream: Option<mpsc::UnboundedSender<Value>>,
    first: Option<oneshot::Sender<Value>>,
}

impl OutputSink for EventSink {
    fn output(&self, stream: Stream, chunk: &[u8]) {
        if stream != Stream::Stdout {
            return;
        }
        let mut state = lock(&self.inner);
        state.partial.extend_from_slice(chunk);
        while let Some(end) = state.partial.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = state.partial.drain(..=end).collect();
            let Ok(value) = serde_json::from_slice::<Value>(&line) else { continue };
            if let Some(first) = state.first.take() {
                let _ = first.send(value);
            } else if let Some(stream) = &state.stream {
                let _ = stream.send(value);
            } else {
                if state.events.len() >= MAX_EVENTS {
                    state.events.remove(0);
                }
                state.events.push(value);
            }
        }
    }
}

fn bad_request(message: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, "invalid_argument", message)
}

fn body(bytes: &Bytes) -> Result<Value, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| bad_request(e.to_string()))
}

/// The watcher a request names, of the sandbox its headers name.
fn watcher(state: &AppState, headers: &HeaderMap, bytes: &Bytes) -> Result<(String, Arc<Watcher>), ApiError> {
    let entry = crate::e2b::envd_sandbox(state, headers)?;
    let request = body(bytes)?;
    let id = request["watcherId"].as_str().ok_or_else(|| bad_request("watcherId is required"))?;
    match lock(&state.e2b.watchers.0).get(id) {
        Some(watcher) if watcher.sandbox == entry.id => Ok((id.to_owned(), watcher.clone())),
        _ => Err(ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no watcher {id}"))),
    }
}

/// Starts a watcher of `request`'s `path` in the sandbox the headers name and waits for its first listing; its
/// events go to `stream` when given, else are kept for `GetWatcherEvents`. Returns its id.
async fn start(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    request: &Value,
    stream: Option<mpsc::UnboundedSender<Value>>,
) -> Result<String, ApiError> {
    let entry = crate::e2b::envd_sandbox(state, headers)?;
    let path = match request["path"].as_str() {
        Some(path) if !path.is_empty() && !path.contains('\0') => path.to_owned(),
        _ => return Err(bad_request("path is required")),
    };
    let recursive = request["recursive"].as_bool().unwrap_or(false);
    let (first_tx, first_rx) = oneshot::channel();
    let sink = SinkState { first: Some(first_tx), stream, ..SinkState::default() };
    let sink = Arc::new(EventSink { inner: Mutex::new(sink) });
    let cancel = CancelToken::new();
    let id = crate::registry::new_id("watch_");
    let cap = MAX_OUTPUT.to_string();
    let argv = ["python3", "-c", PROGRAM, &path, if recursive { "true" } else { "false" }, POLL, &cap];
    let job = Job::Command { argv: argv.map(str::to_owned).to_vec() };
    // It runs until removed: the sandbox's own TTL bounds it, not a job's wall or CPU limit.
    let mut limits = entry.limits.clone();
    limits.wall = Duration::from_secs(7 * 24 * 3600);
    limits.cpu = limits.wall;
    limits.output = strata_core::ByteSize(MAX_OUTPUT);
    let opts = ExecOptions {
        limits: Some(limits),
        sink: Some(sink.clone()),
        cancel: Some(cancel.clone()),
        ..ExecOptions::default()
    };
    let watcher = Arc::new(Watcher { sandbox: entry.id.clone(), cancel: cancel.clone(), sink });
    lock(&state.e2b.watchers.0).insert(id.clone(), watcher);
    let (task_state, task_id, job_entry) = (state.clone(), id.clone(), entry.clone());
    tokio::spawn(async move {
        let _ = crate::api::blocking(move || job_entry.exec(&job, opts)).await;
        // Ended (removed, its sandbox gone, or a limit): nothing more will come.
        lock(&task_state.e2b.watchers.0).remove(&task_id);
    });
    let first = match tokio::time::timeout(START_TIMEOUT, first_rx).await {
        Ok(Ok(first)) => first,
        // The job ended, or never answered.
        _ => {
            cancel.cancel();
            return Err(ApiError::internal("the watcher did not start"));
        }
    };
    if let Some(error) = first.get("error") {
        cancel.cancel();
        let message = error["message"].as_str().unwrap_or("cannot watch").to_owned();
        return Err(match error["code"].as_str() {
            Some("not_found") => ApiError::new(StatusCode::NOT_FOUND, "not_found", message),
            _ => bad_request(message),
        });
    }
    Ok(id)
}

/// `filesystem.Filesystem/CreateWatcher`.
pub(crate) async fn create(State(state): State<Arc<AppState>>, headers: HeaderMap, bytes: Bytes) -> Response {
    let result = async { start(&state, &headers, &body(&bytes)?, None).await }.await;
    match result {
        Ok(id) => Json(json!({"watcherId": id})).into_response(),
        Err(err) => crate::e2b::unary_error(&err),
    }
}

/// Stops a streamed watcher when its response stream is dropped (the client went away or ended it).
struct StopOnDrop(Arc<AppState>, String);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        if let Some(watcher) = lock(&self.0.e2b.watchers.0).remove(&self.1) {
            watcher.cancel.cancel();
        }
    }
}

/// `filesystem.Filesystem/WatchDir`: server-streaming.
pub(crate) async fn watch_dir(State(state): State<Arc<AppState>>, headers: HeaderMap, bytes: Bytes) -> Response {
    use crate::e2b::{connect_code, envelope, parse_envelope, rpc_error};
    let request = match parse_envelope(&bytes) {
        Ok(request) => request,
        Err(message) => return rpc_error(StatusCode::BAD_REQUEST, "invalid_argument", message),
    };
    let (tx, rx) = mpsc::unbounded_channel::<Value>();
    let id = match start(&state, &headers, &request, Some(tx)).await {
        Ok(id) => id,
        Err(err) => return rpc_error(err.status, connect_code(&err), err.message),
    };
    let start = futures_util::stream::once(async { envelope(0, &json!({"start": {}})) });
    // A keepalive now and then also finds a client that went away (writing to it fails), which stops the watcher.
    let events = futures_util::stream::unfold((rx, StopOnDrop(state, id)), |(mut rx, guard)| async move {
        let frame = match tokio::time::timeout(KEEPALIVE, rx.recv()).await {
            Ok(event) => json!({"filesystem": event?}),
            Err(_) => json!({"keepalive": {}}),
        };
        Some((envelope(0, &frame), (rx, guard)))
    });
    let end = futures_util::stream::once(async { envelope(2, &json!({})) });
    let frames = start.chain(events).chain(end).map(Ok::<Bytes, std::convert::Infallible>);
    ([(header::CONTENT_TYPE, "application/connect+json")], Body::from_stream(frames)).into_response()
}

/// `filesystem.Filesystem/GetWatcherEvents`.
pub(crate) async fn events(State(state): State<Arc<AppState>>, headers: HeaderMap, bytes: Bytes) -> Response {
    match watcher(&state, &headers, &bytes) {
        Ok((_, watcher)) => {
            let events = std::mem::take(&mut lock(&watcher.sink.inner).events);
            Json(json!({"events": events})).into_response()
        }
        Err(err) => crate::e2b::unary_error(&err),
    }
}

/// `filesystem.Filesystem/RemoveWatcher`.
pub(crate) async fn remove(State(state): State<Arc<AppState>>, headers: HeaderMap, bytes: Bytes) -> Response {
    match watcher(&state, &headers, &bytes) {
        Ok((id, watcher)) => {
            watcher.cancel.cancel();
            lock(&state.e2b.watchers.0).remove(&id);
            Json(json!({})).into_response()
        }
        Err(err) => crate::e2b::unary_error(&err),
    }
}
