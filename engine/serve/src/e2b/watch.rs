//! The E2B agent's directory watchers, for the SDK's `files.watch_dir`. The sync SDK calls
//! `filesystem.Filesystem/CreateWatcher` (`{"path","recursive"}` → `{"watcherId"}`), `GetWatcherEvents`
//! (`{"watcherId"}` → `{"events":[{"name","type"}]}`, the events since the last call) and `RemoveWatcher`; the async
//! SDK calls the server-streaming `WatchDir` (`{"start":{}}`, then `{"filesystem":{…}}` per change; the watcher
//! stops when the client closes the stream).
//!
//! A watcher is the sandbox's own watch ([`strata_core::Watcher`], through [`crate::service::watch`]): the tier
//! reports each change as it happens (a file that lives for a few milliseconds is seen created and removed), and a
//! thread of the server hands its events on as envd's (`EVENT_TYPE_CREATE`, `WRITE`, `CHMOD`, `RENAME` for the
//! old name of a move, `REMOVE`), named relative to the watched directory as in E2B. Every queue is bounded: the
//! tier's, and here at most [`MAX_EVENTS`] events wait for `GetWatcherEvents` or a slow stream (older ones, or
//! newer ones for a stream, are dropped past it); a watch past the tier's bound on a sandbox's watches is
//! `resource_exhausted`. A watcher ends with `RemoveWatcher` (or its stream) or with its
//! sandbox; then `GetWatcherEvents` is `not_found` and a stream ends.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Json, Response};
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{Value, json};
use strata_core::{GuestPath, WatchEvent, WatchEventKind, Watcher};
use tokio::sync::mpsc;

use super::fs::guest_path;
use crate::AppState;
use crate::e2b::connect::{ConnectRequest, END_STREAM, EnvdSandbox, envelope};
use crate::e2b::{ConnectCode, E2bError, E2bMeta};
use crate::error::ApiError;
use crate::registry::lock;

/// The most events a watcher keeps for its reader.
const MAX_EVENTS: usize = 10_000;

/// How often a `WatchDir` stream without events sends a keepalive.
const KEEPALIVE: Duration = Duration::from_secs(5);

/// How long a watcher's thread waits for an event before it looks whether it was stopped.
const STOP_CHECK: Duration = Duration::from_millis(100);

/// The watchers of one E2B sandbox, by id.
#[derive(Debug, Default)]
pub struct Watchers(Mutex<HashMap<String, Arc<Watching>>>);

impl Watchers {
    /// Stops and forgets every watcher.
    pub(super) fn stop_all(&self) {
        for (_, watching) in lock(&self.0).drain() {
            watching.stop();
        }
    }

    /// Stops and forgets watcher `id`.
    fn stop(&self, id: &str) {
        if let Some(watching) = lock(&self.0).remove(id) {
            watching.stop();
        }
    }

    /// How many watchers run.
    pub(super) fn len(&self) -> usize {
        lock(&self.0).len()
    }
}

/// One watcher, as the E2B layer keeps it.
#[derive(Debug, Default)]
pub struct Watching {
    stopped: AtomicBool,
    /// Events kept for `GetWatcherEvents` (a streamed watcher sends them instead).
    events: Mutex<VecDeque<Value>>,
}

impl Watching {
    fn stop(&self) {
        self.stopped.store(true, Ordering::Relaxed);
    }
}

/// Where a watcher's events go.
enum Sink {
    /// Kept for `GetWatcherEvents`.
    Kept(Arc<Watching>),
    /// Sent on a `WatchDir` stream.
    Stream(mpsc::Sender<Value>),
}

impl Sink {
    /// Hands one event on; `false` once nobody will read it.
    fn send(&self, event: Value) -> bool {
        match self {
            Sink::Kept(watching) => {
                let mut events = lock(&watching.events);
                if events.len() >= MAX_EVENTS {
                    events.pop_front();
                }
                events.push_back(event);
                true
            }
            Sink::Stream(stream) => !matches!(stream.try_send(event), Err(mpsc::error::TrySendError::Closed(_))),
        }
    }
}

/// envd's event type of a change.
fn event_type(kind: WatchEventKind) -> &'static str {
    match kind {
        WatchEventKind::Create => "EVENT_TYPE_CREATE",
        WatchEventKind::Write => "EVENT_TYPE_WRITE",
        WatchEventKind::Chmod => "EVENT_TYPE_CHMOD",
        WatchEventKind::Rename => "EVENT_TYPE_RENAME",
        WatchEventKind::Remove => "EVENT_TYPE_REMOVE",
    }
}

/// A change as envd's `FilesystemEvent`, named relative to the watched directory; `None` for the directory itself.
fn event_json(watched: &GuestPath, event: &WatchEvent) -> Option<Value> {
    let name = event.path.relative_to(watched).filter(|name| !name.is_empty())?;
    Some(json!({"name": name, "type": event_type(event.kind)}))
}

/// Hands the events of `watcher` on to `sink` (blocking) until `watching` is stopped or nobody reads them; the
/// tier's watch ends when it returns.
fn pump(watcher: Watcher, watched: GuestPath, watching: Arc<Watching>, sink: Sink) {
    while !watching.stopped.load(Ordering::Relaxed) {
        let Some(event) = watcher.next_timeout(STOP_CHECK) else {
            if let Sink::Stream(stream) = &sink
                && stream.is_closed()
            {
                break;
            }
            continue;
        };
        if let Some(event) = event_json(&watched, &event)
            && !sink.send(event)
        {
            break;
        }
    }
}

/// The request of `CreateWatcher` and `WatchDir`.
#[derive(Debug, Deserialize)]
pub(crate) struct WatchRequest {
    #[serde(default)]
    path: String,
    #[serde(default)]
    recursive: bool,
}

/// The request of `GetWatcherEvents` and `RemoveWatcher`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct WatcherRequest {
    #[serde(default)]
    watcher_id: String,
}

/// The watcher a request names, of the sandbox `meta` is of.
fn watcher(meta: &E2bMeta, request: &WatcherRequest) -> Result<Arc<Watching>, E2bError> {
    if request.watcher_id.is_empty() {
        return Err(E2bError::invalid_argument("watcherId is required"));
    }
    lock(&meta.watchers.0)
        .get(&request.watcher_id)
        .cloned()
        .ok_or_else(|| E2bError::not_found(format!("no watcher {}", request.watcher_id)))
}

/// Starts a watcher of `request`'s directory in the sandbox `entry`; its events go to `stream` when given, else are
/// kept for `GetWatcherEvents`. Returns its id.
async fn start(
    state: &AppState,
    EnvdSandbox(entry, meta): EnvdSandbox,
    request: &WatchRequest,
    stream: Option<mpsc::Sender<Value>>,
) -> Result<String, E2bError> {
    let path = guest_path("path", &request.path)?;
    let watcher = crate::service::watch(state, entry, path.clone(), request.recursive).await.map_err(|err| {
        // The sandbox watches as much as it may (its tier bounds its watches): a limit, not an outage.
        match err.code {
            "capacity" => E2bError::new(ConnectCode::ResourceExhausted, err.message),
            _ => E2bError::from(err),
        }
    })?;
    let watching = Arc::new(Watching::default());
    let sink = match stream {
        Some(stream) => Sink::Stream(stream),
        None => Sink::Kept(watching.clone()),
    };
    let id = crate::registry::new_id("watch_");
    lock(&meta.watchers.0).insert(id.clone(), watching.clone());
    let (pump_meta, pump_id) = (meta.clone(), id.clone());
    let started = std::thread::Builder::new().name("strata-e2b-watch".into()).spawn(move || {
        pump(watcher, path, watching, sink);
        // Ended (removed, its stream gone, its sandbox gone): nothing more will come.
        pump_meta.watchers.stop(&pump_id);
    });
    if let Err(err) = started {
        meta.watchers.stop(&id);
        return Err(ApiError::internal(format!("cannot start a watcher thread: {err}")).into());
    }
    Ok(id)
}

/// `filesystem.Filesystem/CreateWatcher`.
pub(crate) async fn create(
    State(state): State<Arc<AppState>>,
    sandbox: EnvdSandbox,
    ConnectRequest(request): ConnectRequest<WatchRequest>,
) -> Result<Json<Value>, E2bError> {
    let id = start(&state, sandbox, &request, None).await?;
    Ok(Json(json!({"watcherId": id})))
}

/// Stops a streamed watcher when its response stream is dropped (the client went away or ended it).
struct StopOnDrop(Arc<E2bMeta>, String);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.watchers.stop(&self.1);
    }
}

/// `filesystem.Filesystem/WatchDir`: server-streaming.
pub(crate) async fn watch_dir(
    State(state): State<Arc<AppState>>,
    sandbox: EnvdSandbox,
    ConnectRequest(request): ConnectRequest<WatchRequest>,
) -> Result<Response, E2bError> {
    let meta = sandbox.1.clone();
    let (tx, rx) = mpsc::channel::<Value>(MAX_EVENTS);
    let id = start(&state, sandbox, &request, Some(tx)).await?;
    let start = futures_util::stream::once(async { envelope(0, &json!({"start": {}})) });
    // A keepalive now and then also finds a client that went away (writing to it fails), which stops the watcher.
    let events = futures_util::stream::unfold((rx, StopOnDrop(meta, id)), |(mut rx, guard)| async move {
        let frame = match tokio::time::timeout(KEEPALIVE, rx.recv()).await {
            Ok(event) => json!({"filesystem": event?}),
            Err(_) => json!({"keepalive": {}}),
        };
        Some((envelope(0, &frame), (rx, guard)))
    });
    let end = futures_util::stream::once(async { envelope(END_STREAM, &json!({})) });
    let frames = start.chain(events).chain(end).map(Ok::<Bytes, std::convert::Infallible>);
    Ok(([(header::CONTENT_TYPE, "application/connect+json")], Body::from_stream(frames)).into_response())
}

/// `filesystem.Filesystem/GetWatcherEvents`.
pub(crate) async fn events(
    EnvdSandbox(_, meta): EnvdSandbox,
    ConnectRequest(request): ConnectRequest<WatcherRequest>,
) -> Result<Json<Value>, E2bError> {
    let watching = watcher(&meta, &request)?;
    let events: Vec<Value> = lock(&watching.events).drain(..).collect();
    Ok(Json(json!({"events": events})))
}

/// `filesystem.Filesystem/RemoveWatcher`.
pub(crate) async fn remove(
    EnvdSandbox(_, meta): EnvdSandbox,
    ConnectRequest(request): ConnectRequest<WatcherRequest>,
) -> Result<Json<Value>, E2bError> {
    watcher(&meta, &request)?;
    meta.watchers.stop(&request.watcher_id);
    Ok(Json(json!({})))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(text: &str) -> GuestPath {
        GuestPath::new(text).expect("a guest path")
    }

    #[test]
    fn events_are_named_relative_to_the_watched_directory_with_envd_types() {
        let watched = path("/home/user");
        let event = |kind, at: &str| WatchEvent { kind, path: path(at) };
        let created = event_json(&watched, &event(WatchEventKind::Create, "/home/user/sub/n.txt"));
        assert_eq!(created, Some(json!({"name": "sub/n.txt", "type": "EVENT_TYPE_CREATE"})));
        let moved = event_json(&watched, &event(WatchEventKind::Rename, "/home/user/a"));
        assert_eq!(moved, Some(json!({"name": "a", "type": "EVENT_TYPE_RENAME"})));
        assert_eq!(event_json(&watched, &event(WatchEventKind::Remove, "/home/user")), None);
        let kinds = [WatchEventKind::Write, WatchEventKind::Chmod, WatchEventKind::Remove];
        let types: Vec<_> = kinds.into_iter().map(event_type).collect();
        assert_eq!(types, ["EVENT_TYPE_WRITE", "EVENT_TYPE_CHMOD", "EVENT_TYPE_REMOVE"]);
    }

    #[test]
    fn kept_events_are_bounded_and_the_pump_stops_when_told() {
        let watching = Arc::new(Watching::default());
        let sink = Sink::Kept(watching.clone());
        for n in 0..MAX_EVENTS + 5 {
            assert!(sink.send(json!(n)));
        }
        let events = lock(&watching.events);
        assert_eq!((events.len(), events.front()), (MAX_EVENTS, Some(&json!(5))), "the oldest are dropped");
        drop(events);

        let stopped = Arc::new(AtomicBool::new(false));
        let flag = stopped.clone();
        let (tx, watcher) = Watcher::channel(4, move || flag.store(true, Ordering::Relaxed));
        assert!(tx.send(WatchEvent { kind: WatchEventKind::Create, path: path("/w/f") }));
        let watched = Arc::new(Watching::default());
        let pumping = watched.clone();
        let thread = std::thread::spawn(move || pump(watcher, path("/w"), pumping.clone(), Sink::Kept(pumping)));
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while lock(&watched.events).is_empty() {
            assert!(std::time::Instant::now() < deadline, "the event was not handed on");
            std::thread::sleep(Duration::from_millis(5));
        }
        watched.stop();
        thread.join().expect("the pump ends");
        assert!(stopped.load(Ordering::Relaxed), "the tier's watch ends with the pump");
        assert_eq!(lock(&watched.events).front(), Some(&json!({"name": "f", "type": "EVENT_TYPE_CREATE"})));
    }
}
