//! The E2B-compatible layer, over the same sandbox registry as the native API, so that the official E2B SDK works
//! unmodified with `E2B_API_URL` and `E2B_SANDBOX_URL` both set to this server (`docs/DESIGN.md` §8).
//!
//! - Control plane (API key in `X-API-Key`): `POST /sandboxes` and `/v2/sandboxes` (201 with `templateID`,
//!   `sandboxID`, `clientID`, `envdVersion`, `envdAccessToken`), `GET /sandboxes` and `/v2/sandboxes`,
//!   `GET /sandboxes/{id}`, `DELETE /sandboxes/{id}`, `POST /sandboxes/{id}/timeout`, `POST /sandboxes/{id}/connect` (and `/v2/…`),
//!   `POST /sandboxes/{id}/refreshes` (`control`); `/secrets` ([`secrets`]: write-only, per key, in memory), whose
//!   `${e2b.secrets.NAME}` placeholders in `network.rules` header transforms become egress secrets.
//! - The in-sandbox agent ("envd"), routed by the `E2b-Sandbox-Id` header (or a Host name `49983-{id}.{domain}`)
//!   and authorised by the sandbox's `X-Access-Token`, or, for `/files`, by a signed URL ([`signature`]): Connect-RPC (JSON, 5-byte envelopes, end-of-stream frame; [`connect`]) `process.Process/Start` (`process`) streaming the
//!   start event, stdout/stderr data and the end event (a command outlives the client that started it);
//!   `process.Process/Connect` streaming a running command's start event and its frames from then on;
//!   `SendInput` and `CloseStdin` for a command started with `stdin: true` (its stdin is a pipe the job reads as the
//!   input comes); `SendSignal` and `List`; `filesystem.Filesystem/{ListDir,Stat,MakeDir,Move,Remove}`
//!   and `GET`/`POST /files` (multipart or octet-stream, either gzipped: [`encoding`]) (`fs`), `{CreateWatcher,GetWatcherEvents,RemoveWatcher,
//!   WatchDir}` (`watch`), each the sandbox's own filesystem method; `GET /health`. Commands, file calls and
//!   watchers run at the same time.
//! - The code interpreter (`E2b-Sandbox-Port: 49999`, `interpreter`): `POST /execute` streaming NDJSON while the
//!   cell runs, and the contexts API. Each context is one IPython kernel (or one bash) inside the sandbox for its
//!   whole life ([`kernel`]), with IPython's rich results, `display()`, magics and streamed output; the
//!   `strata-wasm-python` template runs its cells in one wasm Python session instead. A cell never runs in another
//!   interpreter than its context's. All see the sandbox's `/home/user`.
//!
//! Every error under these routes, the router's own refusals included (an unknown path or method is
//! `unimplemented`, 501), takes E2B's shape for the route's protocol ([`error`]), so that the SDKs raise their own
//! exceptions; an envd call for a sandbox the server does not hold is answered as E2B's proxy does (502, "was not
//! found"). An E2B sandbox runs `/bin/bash -l -c CMD`, so it lives on the process tier.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use serde_json::{Value, json};
use strata_core::{CancelToken, EnvVar};
use tokio::sync::{broadcast, mpsc};

use crate::error::ApiError;
use crate::registry::{SandboxEntry, lock};
use crate::{AppState, Principal};

pub mod connect;
mod control;
pub mod encoding;
pub mod error;
mod fs;
mod interpreter;
pub mod kernel;
mod lifecycle;
mod network;
pub(crate) mod ports;
mod process;
pub mod secrets;
pub mod signature;
mod watch;

pub use error::{ConnectCode, E2bError};
pub(crate) use lifecycle::pause_on_expiry;

/// The envd version this server reports: new enough for octet-stream uploads and `stdin: false` (≥ 0.5.7).
pub const ENVD_VERSION: &str = "0.5.7";

/// What the E2B layer keeps about one of its sandboxes.
pub struct E2bMeta {
    /// The template the client asked for (`base`, `code-interpreter-v1`, …); every template is the same image
    /// (`strata-wasm-python` runs its cells in a wasm Python session).
    pub template: String,
    /// The token envd calls must carry in `X-Access-Token`.
    pub access_token: String,
    /// The token the code interpreter's calls may carry instead, in `E2B-Traffic-Access-Token` (the SDKs send it,
    /// and not the access token, on the contexts calls).
    pub traffic_token: String,
    /// The client's metadata, returned as given.
    pub metadata: Value,
    /// Cells run by `/execute`.
    pub executions: AtomicU64,
    /// The host directory shared by a `strata-wasm-python` sandbox and its Python session at [`HOME`] (removed
    /// with the sandbox); `None` for the other templates, whose home is in the sandbox's own filesystem.
    pub home: Option<PathBuf>,
    /// The sandbox's environment, for its Python session.
    pub env: Vec<EnvVar>,
    /// The code interpreter's contexts, each one kernel in the sandbox ([`kernel`]).
    pub contexts: kernel::Contexts,
    /// The wasm Python session of a `strata-wasm-python` sandbox, started by its first cell.
    pub python: std::sync::Mutex<Option<Box<dyn strata_core::Sandbox>>>,
    /// Cancels the cell running in the Python session, if any.
    pub cell: std::sync::Mutex<Option<CancelToken>>,
    /// Set when the sandbox is killed: no new cell starts.
    pub closed: std::sync::atomic::AtomicBool,
    /// The key that created it (whose quotas a resume or a fork is counted against).
    pub(crate) owner: Option<crate::Principal>,
    /// `autoPause` (`lifecycle={"on_timeout": "pause"}`): at the end of its timeout it is paused, not killed.
    pub(crate) auto_pause: bool,
    /// `autoResume`: an envd call for it while it is paused resumes it.
    pub(crate) auto_resume: bool,
    /// Its commands started through `process.Process/Start` that have not ended, by pid.
    commands: std::sync::Mutex<HashMap<u32, RunningCommand>>,
    /// Its directory watchers (`watch`).
    watchers: watch::Watchers,
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

/// RFC 3339 UTC time, as E2B's API prints it.
pub(crate) fn rfc3339(time: std::time::SystemTime) -> String {
    strata_image_util::rfc3339_micros(time)
}

/// The template whose Python cells run in a wasm Python session instead of an IPython kernel.
pub const WASM_TEMPLATE: &str = "strata-wasm-python";

/// The custom image an E2B template stands for: `None` for the built-in templates (`base`, `code-interpreter*`,
/// [`WASM_TEMPLATE`]: the Debian image), the server's alias for it, else the image of that name in the store; a
/// template that is none of these is `template_not_found` (404).
pub(crate) fn template_image(
    state: &AppState,
    template: &str,
) -> Result<Option<strata_core::ImageName>, crate::error::ApiError> {
    if template == "base" || template.starts_with("code-interpreter") || template == WASM_TEMPLATE {
        return Ok(None);
    }
    if let Some(image) = state.templates.get(template) {
        return Ok(Some(image.clone()));
    }
    let not_found = || {
        crate::error::ApiError::new(
            axum::http::StatusCode::NOT_FOUND,
            "template_not_found",
            format!(
                "no template {template:?}: not built in (base, code-interpreter-v1, {WASM_TEMPLATE}), not an alias of this server, not an image (`strata images list`)"
            ),
        )
    };
    let name = strata_core::ImageName::new(template).map_err(|_| not_found())?;
    let store = state.engine.image_store().map_err(crate::error::ApiError::from)?;
    match store.get(&name) {
        Ok(_) => Ok(Some(name)),
        Err(strata_image_store::StoreError::NotFound(_)) => Err(not_found()),
        Err(other) => Err(crate::error::ApiError::internal(other.to_string())),
    }
}

/// The home of the account E2B's commands run as by default ([`USER`]).
pub const HOME: &str = "/home/user";

/// The account E2B's commands run as unless a call names another (`user="root"`): the image's uid 1000, with
/// passwordless `sudo` to the sandbox's root.
pub const USER: &str = "user";

impl E2bMeta {
    /// What the layer knows of a new sandbox: its template, token, metadata, home directory and environment.
    fn new(
        template: String,
        access_token: String,
        metadata: Value,
        home: Option<PathBuf>,
        env: Vec<EnvVar>,
    ) -> E2bMeta {
        E2bMeta {
            template,
            access_token,
            traffic_token: crate::registry::new_id("trf_") + &crate::registry::new_id(""),
            contexts: kernel::Contexts::default(),
            metadata,
            executions: AtomicU64::new(0),
            home,
            env,
            python: std::sync::Mutex::new(None),
            cell: std::sync::Mutex::new(None),
            closed: std::sync::atomic::AtomicBool::new(false),
            commands: std::sync::Mutex::default(),
            watchers: watch::Watchers::default(),
            owner: None,
            auto_pause: false,
            auto_resume: false,
        }
    }

    /// The same sandbox's identity (template, tokens, metadata, environment) with nothing running: what a resumed
    /// sandbox starts with.
    fn renewed(&self) -> E2bMeta {
        let mut meta = E2bMeta::new(
            self.template.clone(),
            self.access_token.clone(),
            self.metadata.clone(),
            None,
            self.env.clone(),
        );
        meta.traffic_token = self.traffic_token.clone();
        meta.owner = self.owner.clone();
        (meta.auto_pause, meta.auto_resume) = (self.auto_pause, self.auto_resume);
        meta
    }

    /// Cancels every command and watcher still running in the sandbox.
    fn stop_jobs(&self) {
        for command in lock(&self.commands).values() {
            command.cancel.cancel();
        }
        self.contexts.stop_all();
        self.watchers.stop_all();
    }

    /// Stops its jobs, closes the Python session and removes the shared home directory (blocking; called when the
    /// sandbox is killed).
    pub fn close(&self) {
        self.stop_jobs();
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
    /// Its terminal, when it runs on one (`Update` resizes it).
    terminal: Option<strata_core::Terminal>,
}

/// The E2B layer's own state, by sandbox id: what it knows of each E2B sandbox ([`E2bMeta`]: its token, its
/// running commands and watchers, its Python session). A sandbox's part goes when the sandbox is killed
/// ([`SandboxEntry::on_kill`]).
#[derive(Debug, Default)]
pub struct E2bState {
    sandboxes: std::sync::Mutex<HashMap<String, Arc<E2bMeta>>>,
    next_pid: AtomicU32,
    /// Paused sandboxes and the E2B snapshots' templates.
    lifecycle: lifecycle::Lifecycle,
    /// Each key's secrets (`Secret.create`), for `network.rules` header transforms.
    secrets: secrets::SecretStore,
}

impl E2bState {
    fn pid(&self) -> u32 {
        // Small positive pids, as a shell would see them.
        1000 + self.next_pid.fetch_add(1, Ordering::Relaxed) % 4_000_000
    }

    /// What the layer knows of sandbox `id`, if it is an E2B sandbox.
    fn sandbox(&self, id: &str) -> Option<Arc<E2bMeta>> {
        lock(&self.sandboxes).get(id).cloned()
    }

    /// How many directory watchers sandbox `id` runs (none when it is not an E2B sandbox).
    pub fn watchers_running(&self, id: &str) -> usize {
        self.sandbox(id).map_or(0, |meta| meta.watchers.len())
    }

    /// Makes `entry` an E2B sandbox, whose state here is dropped (and closed) when it is killed.
    fn adopt(self: &Arc<Self>, entry: &SandboxEntry, meta: E2bMeta) -> Arc<E2bMeta> {
        let meta = Arc::new(meta);
        lock(&self.sandboxes).insert(entry.id.clone(), meta.clone());
        let (state, id) = (Arc::downgrade(self), entry.id.clone());
        entry.on_kill(move || {
            if let Some(state) = state.upgrade() {
                state.forget(&id);
            }
        });
        meta
    }

    /// Drops what the layer kept of paused sandbox `id` (deleted through the native API).
    pub fn forget_paused(&self, id: &str) {
        lock(self.lifecycle.paused_metas()).remove(id);
    }

    /// [`E2bState::adopt`], then the code interpreter's default kernel started ahead for a code-interpreter
    /// template ([`interpreter::prestart`]).
    fn adopt_started(self: &Arc<Self>, entry: &Arc<SandboxEntry>, meta: E2bMeta) -> Arc<E2bMeta> {
        let meta = self.adopt(entry, meta);
        interpreter::prestart(entry, &meta);
        meta
    }

    /// Drops sandbox `id`'s state: cancels its commands and watchers, closes its Python session and removes its
    /// home directory (blocking).
    fn forget(&self, id: &str) {
        let meta = lock(&self.sandboxes).remove(id);
        if let Some(meta) = meta {
            meta.close();
        }
    }
}

/// A sandbox as create and connect answer it; `domain`: the server's (`--domain`), from which the SDKs' `get_host(port)`
/// makes `{port}-{sandboxID}.{domain}` (null: the SDK's own default).
pub(super) fn sandbox_json(entry: &SandboxEntry, meta: &E2bMeta, domain: Option<&str>) -> Value {
    json!({
        "domain": domain,
        "templateID": meta.template,
        "sandboxID": entry.id,
        "alias": meta.template,
        "clientID": "strata",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": meta.access_token,
        "trafficAccessToken": meta.traffic_token,
    })
}

/// The sandbox `id` of `principal` if it is an E2B sandbox.
pub(super) fn e2b_sandbox(
    state: &AppState,
    id: &str,
    principal: &Principal,
) -> Result<(Arc<SandboxEntry>, Arc<E2bMeta>), E2bError> {
    let entry = crate::service::sandbox(state, principal, id)?;
    let meta = state.e2b.sandbox(id).ok_or_else(|| ApiError::sandbox_not_found(id))?;
    Ok((entry, meta))
}

/// A request body as JSON, or `T`'s default when the body is empty (the SDKs send no body for an all-default call).
fn json_or_default<T: serde::de::DeserializeOwned + Default>(body: &[u8]) -> Result<T, ApiError> {
    if body.is_empty() {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| ApiError::bad_request("invalid_json", e.to_string()))
}

/// The control-plane routes (behind API-key authentication).
pub fn control_routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/sandboxes", post(control::create).get(control::list))
        .route("/v2/sandboxes", post(control::create).get(control::list))
        .route("/sandboxes/{id}", get(control::detail).delete(control::kill))
        .route("/sandboxes/{id}/timeout", post(control::set_timeout))
        .route("/sandboxes/{id}/metrics", get(control::metrics))
        .route("/sandboxes/metrics", get(control::batch_metrics))
        .route("/sandboxes/{id}/connect", post(control::connect))
        .route("/v2/sandboxes/{id}/connect", post(control::connect))
        .route("/sandboxes/{id}/refreshes", post(control::refresh))
        .route("/sandboxes/{id}/pause", post(lifecycle::pause))
        .route("/sandboxes/{id}/resume", post(control::connect))
        .route("/sandboxes/{id}/snapshots", post(lifecycle::create_snapshot))
        .route("/sandboxes/{id}/fork", post(lifecycle::fork))
        .route("/sandboxes/{id}/network", axum::routing::put(network::update))
        .route("/secrets", post(secrets::create).get(secrets::list))
        .route("/secrets/{id}", get(secrets::get).post(secrets::update).delete(secrets::delete))
        .route("/snapshots", get(lifecycle::list_snapshots))
        .route("/templates/{id}", axum::routing::delete(lifecycle::delete_snapshot))
}

/// The envd and code-interpreter routes (authorised by each sandbox's access token).
pub fn envd_routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/process.Process/Start", post(process::start))
        .route("/process.Process/SendSignal", post(process::send_signal))
        .route("/process.Process/Connect", post(process::connect))
        .route("/process.Process/SendInput", post(process::send_input))
        .route("/process.Process/CloseStdin", post(process::close_stdin))
        .route("/process.Process/StreamInput", post(process::stream_input))
        .route("/process.Process/Update", post(process::update))
        .route("/process.Process/List", post(process::list))
        .route("/filesystem.Filesystem/Stat", post(fs::stat))
        .route("/filesystem.Filesystem/ListDir", post(fs::list_dir))
        .route("/filesystem.Filesystem/MakeDir", post(fs::make_dir))
        .route("/filesystem.Filesystem/Move", post(fs::move_entry))
        .route("/filesystem.Filesystem/Remove", post(fs::remove))
        .route("/filesystem.Filesystem/CreateWatcher", post(watch::create))
        .route("/filesystem.Filesystem/GetWatcherEvents", post(watch::events))
        .route("/filesystem.Filesystem/RemoveWatcher", post(watch::remove))
        .route("/filesystem.Filesystem/WatchDir", post(watch::watch_dir))
        .route("/files", get(fs::read_file).post(fs::write_file))
        .route("/execute", post(interpreter::execute))
        .route("/contexts", post(interpreter::create_context).get(interpreter::list_contexts))
        .route("/contexts/{id}", axum::routing::delete(interpreter::remove_context))
        .route("/contexts/{id}/restart", post(interpreter::restart_context))
}

/// `GET /health` with an `E2b-Sandbox-Id` header: 204 while the sandbox runs, 502 when it does not.
pub async fn health(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Result<StatusCode, E2bError> {
    match headers.get("e2b-sandbox-id").and_then(|v| v.to_str().ok()) {
        None => Ok(StatusCode::NO_CONTENT),
        Some(id) => match state.registry.get_any(id) {
            Some(_) if state.e2b.sandbox(id).is_some() => Ok(StatusCode::NO_CONTENT),
            _ => Err(E2bError::sandbox_gone(id)),
        },
    }
}

/// Entry points of the fuzz targets (`fuzz/`): the parsers a client feeds, reachable without a server.
#[doc(hidden)]
pub mod fuzzing;
