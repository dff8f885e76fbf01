//! The code interpreter (`E2b-Sandbox-Port: 49999`): `POST /execute` streaming NDJSON, and the contexts API
//! (`POST`/`GET /contexts`, `POST /contexts/{id}/restart`, `DELETE /contexts/{id}`).
//!
//! A sandbox's cells run in its contexts, each one interpreter for its whole life ([`super::kernel`]): an IPython
//! kernel inside the sandbox (process tier, the sandbox's own `python3` with numpy, pandas, matplotlib and scipy),
//! or one bash. A cell never runs anywhere else. The `strata-wasm-python` template instead runs its Python cells
//! in one wasm Python session of the sandbox (microsecond cells, wasm32 semantics: numpy's default integer is
//! `int32` there); a cell that needs what wasm lacks fails with a typed error naming the tier that would run it.
//! Both see the sandbox's [`HOME`].
//!
//! These routes are authorised by the sandbox's access token (`X-Access-Token`) or its traffic token
//! (`E2B-Traffic-Access-Token`, which the SDKs send on the contexts calls).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Instant, SystemTime};

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::{FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use strata_core::{CancelToken, Capabilities, ExecOptions, Grant, GrantMode, Job, Limits, PythonSource, TierKind};
use strata_engine::TierChoice;

use super::kernel::{Context, Language};
use super::process::{cell_wall, command_limits};
use super::rfc3339;
use super::{E2bError, E2bMeta, HOME};
use crate::AppState;
use crate::error::ApiError;
use crate::registry::{SandboxEntry, lock};
use crate::service::{CancelOnDrop, blocking, record_job};

pub use super::WASM_TEMPLATE;

/// The most code a cell may carry.
const MAX_CELL: usize = 4 << 20;

/// The sandbox a code-interpreter request is for, by `E2b-Sandbox-Id`, checked against its access token or its
/// traffic token.
pub(super) struct InterpreterSandbox(Arc<SandboxEntry>, Arc<E2bMeta>);

impl FromRequestParts<Arc<AppState>> for InterpreterSandbox {
    type Rejection = E2bError;

    async fn from_request_parts(parts: &mut Parts, state: &Arc<AppState>) -> Result<Self, E2bError> {
        let headers = &parts.headers;
        let id = headers
            .get("e2b-sandbox-id")
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| E2bError::invalid_argument("code-interpreter calls need the E2b-Sandbox-Id header"))?;
        let entry = state.registry.get_any(id).ok_or_else(|| E2bError::sandbox_gone(id))?;
        let meta = state.e2b.sandbox(id).ok_or_else(|| E2bError::sandbox_gone(id))?;
        let given = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        let access = given("x-access-token").is_some_and(|t| super::signature::same_secret(t, &meta.access_token));
        let traffic =
            given("e2b-traffic-access-token").is_some_and(|t| super::signature::same_secret(t, &meta.traffic_token));
        if !access && !traffic {
            return Err(E2bError::new(
                super::ConnectCode::Unauthenticated,
                "missing or wrong X-Access-Token or E2B-Traffic-Access-Token for this sandbox",
            ));
        }
        Ok(InterpreterSandbox(entry, meta))
    }
}

/// A cell in the live wasm session: every statement, then the last one's value (if it is an expression) as the main
/// result, reported after a record separator on stderr with any exception; inside a function that removes itself so
/// that the session's names are the cells' own; the call with the cell and its variables as JSON (valid Python
/// literals) is appended.
const SESSION_DRIVER: &str = r#"def __strata_cell(src, env):
    import ast, json, os, sys, traceback
    g = sys.modules["__main__"].__dict__
    out = {"result": None, "error": None}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
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
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    sys.stdout.flush()
    sys.stderr.write("\x1eSTRATA-CELL " + json.dumps(out) + "\n")
    sys.stderr.flush()
"#;

/// Runs a cell in the sandbox's wasm Python session (started on first use, in [`HOME`], with the sandbox's
/// environment and the shared home directory; restarted once if the last cell ended it). Blocking.
fn session_cell(
    state: &AppState,
    entry: &SandboxEntry,
    code: &str,
    env: &BTreeMap<String, String>,
    limits: Limits,
    cancel: CancelToken,
) -> Result<strata_core::Outcome, ApiError> {
    let meta = state.e2b.sandbox(&entry.id).ok_or_else(|| ApiError::sandbox_not_found(&entry.id))?;
    let literal = serde_json::to_string(code).map_err(|e| ApiError::internal(e.to_string()))?;
    let env = serde_json::to_string(env).map_err(|e| ApiError::internal(e.to_string()))?;
    // Appended, never substituted: the cell's text is not searched for anything.
    let driver =
        format!("{SESSION_DRIVER}try:\n    __strata_cell({literal}, {env})\nfinally:\n    del __strata_cell\n");
    let job = Job::Python { source: PythonSource::Code(driver), args: Vec::new() };
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
            let started = state.engine.start(TierChoice::Tier(TierKind::Wasm), &caps, &limits)?;
            let chdir = Job::Python {
                source: PythonSource::Code(format!("import os\nos.chdir({HOME:?})\ndel os")),
                args: Vec::new(),
            };
            started.exec(&chdir, ExecOptions::default())?;
            *session = Some(started);
        }
        let Some(python) = session.as_ref() else { continue };
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

/// Starts the default Python context's kernel in the background when the sandbox is made from a code-interpreter
/// template (`code-interpreter-v1`, the SDK's default), so that its first cell does not wait for IPython to start;
/// a sandbox of another template starts it on its first cell. A failed start is reported by that cell.
pub(super) fn prestart(entry: &Arc<SandboxEntry>, meta: &Arc<E2bMeta>) {
    if !meta.template.starts_with("code-interpreter") {
        return;
    }
    let Ok(context) = meta.contexts.default_for(Language::Python, HOME) else { return };
    let entry = entry.clone();
    let spawned = std::thread::Builder::new().name("strata-kernel-start".into()).spawn(move || {
        if let Err(why) = context.ensure_started(&entry) {
            tracing::debug!(sandbox = %entry.id, %why, "the default kernel did not start ahead");
        }
    });
    if let Err(err) = spawned {
        tracing::warn!(error = %err, "cannot start the default kernel ahead");
    }
}

#[derive(Debug, Deserialize)]
pub(super) struct ExecuteRequest {
    code: String,
    #[serde(default)]
    context_id: Option<String>,
    #[serde(default)]
    language: Option<String>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
}

/// `POST /execute`: the cell runs in its context (or the language's default context), its events streamed as
/// NDJSON while it runs.
pub(super) async fn execute(
    State(state): State<Arc<AppState>>,
    InterpreterSandbox(entry, meta): InterpreterSandbox,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, E2bError> {
    let request: ExecuteRequest =
        serde_json::from_slice(&body).map_err(|e| E2bError::invalid_argument(format!("invalid cell: {e}")))?;
    if request.code.len() > MAX_CELL {
        return Err(E2bError::invalid_argument(format!("a cell holds at most {} MiB of code", MAX_CELL >> 20)));
    }
    if request.context_id.is_some() && request.language.is_some() {
        return Err(E2bError::invalid_argument("give a context or a language, not both"));
    }
    let wall = cell_wall(&entry, &headers);
    let limits = Limits { wall, cpu: wall, ..command_limits(&entry) };
    if meta.template == WASM_TEMPLATE {
        Language::parse(request.language.as_deref()).and_then(|language| match language {
            Language::Python => Ok(()),
            Language::Bash => Err(E2bError::invalid_argument(format!(
                "the {WASM_TEMPLATE} template runs Python only: create a sandbox of another template for bash"
            ))),
        })?;
        if let Some(id) = request.context_id.as_deref().filter(|id| *id != WASM_CONTEXT) {
            return Err(E2bError::not_found(format!("no code context {id}")));
        }
        return wasm_cell(state, entry, meta, request, limits).await;
    }
    let context = match &request.context_id {
        Some(id) => meta.contexts.get(id).ok_or_else(|| E2bError::not_found(format!("no code context {id}")))?,
        None => meta.contexts.default_for(Language::parse(request.language.as_deref())?, HOME)?,
    };
    meta.executions.fetch_add(1, Ordering::Relaxed);
    let (tx, rx) = tokio::sync::mpsc::channel::<Value>(super::kernel::CELL_QUEUE);
    let env = request.env_vars.unwrap_or_default();
    let started = Instant::now();
    let task_state = state.clone();
    std::thread::Builder::new()
        .name("strata-cell".into())
        .spawn(move || {
            context.run_cell(&entry, &request.code, &env, limits.wall, &tx);
            let _ = tx.blocking_send(json!({"type": "end_of_execution"}));
            task_state.metrics.latency(TierKind::Process.as_str(), "run_code", started.elapsed());
        })
        .map_err(|e| E2bError::internal(format!("cannot start the cell's thread: {e}")))?;
    Ok(ndjson(rx))
}

/// The id of the one context of a [`WASM_TEMPLATE`] sandbox.
const WASM_CONTEXT: &str = "wasm-python";

/// Streams lines as NDJSON.
fn ndjson(rx: tokio::sync::mpsc::Receiver<Value>) -> Response {
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|line| {
            let mut text = line.to_string();
            text.push('\n');
            (Ok::<Bytes, Infallible>(Bytes::from(text)), rx)
        })
    });
    ([(header::CONTENT_TYPE, "application/x-ndjson")], Body::from_stream(stream)).into_response()
}

/// A cell of a [`WASM_TEMPLATE`] sandbox: in its wasm Python session, if wasm can run it; otherwise a typed error
/// naming what it needs and the tier that would run it (never another interpreter).
async fn wasm_cell(
    state: Arc<AppState>,
    entry: Arc<SandboxEntry>,
    meta: Arc<E2bMeta>,
    request: ExecuteRequest,
    limits: Limits,
) -> Result<Response, E2bError> {
    let count = meta.executions.fetch_add(1, Ordering::Relaxed) + 1;
    let mut lines = vec![json!({"type": "number_of_executions", "execution_count": count})];
    let cell = Job::Python { source: PythonSource::Code(request.code.clone()), args: Vec::new() };
    let route = state.engine.route(TierChoice::Auto, &cell).map_err(|e| E2bError::from(ApiError::from(e)));
    // numpy is what this template is for (its wasm32 semantics stated); anything else bound elsewhere is refused.
    let refused = match route {
        Ok(route) if route.decision.tier != TierKind::Wasm && !route.decision.reason.contains("wasm32") => {
            Some(route.decision)
        }
        Ok(_) => None,
        Err(err) => return Err(err),
    };
    if let Some(decision) = refused {
        lines.push(json!({"type": "error", "name": "SessionTierError",
            "value": format!("this context is a wasm32 Python session ({WASM_TEMPLATE}) for its whole life, and \
                this cell needs the {} tier ({}): run it in a sandbox of another template", decision.tier,
                decision.reason),
            "traceback": ""}));
        return Ok(lines_response(lines));
    }
    let started = Instant::now();
    let session_state = state.clone();
    let token = CancelToken::new();
    let mut guard = CancelOnDrop(Some(token.clone()));
    let code = request.code;
    let env = request.env_vars.unwrap_or_default();
    let result = blocking(move || session_cell(&session_state, &entry, &code, &env, limits, token)).await;
    guard.0 = None;
    record_job(&state, TierKind::Wasm, "run_code", started, &result);
    let outcome = result?;
    let now = rfc3339(SystemTime::now());
    let stderr = String::from_utf8_lossy(&outcome.stderr).into_owned();
    let (stderr, trailer) = match stderr.rfind(CELL_MARKER) {
        Some(at) => {
            let trailer = stderr[at + CELL_MARKER.len()..].trim_end();
            (stderr[..at].to_owned(), serde_json::from_str::<Value>(trailer).ok())
        }
        None => (stderr, None),
    };
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
    Ok(lines_response(lines))
}

/// Lines known at once, as NDJSON ending in `end_of_execution`.
fn lines_response(mut lines: Vec<Value>) -> Response {
    lines.push(json!({"type": "end_of_execution"}));
    let mut text = String::new();
    for line in lines {
        text.push_str(&line.to_string());
        text.push('\n');
    }
    ([(header::CONTENT_TYPE, "application/x-ndjson")], text).into_response()
}

const CELL_MARKER: &str = "\u{1e}STRATA-CELL ";

#[derive(Debug, Default, Deserialize)]
pub(super) struct CreateContext {
    #[serde(default)]
    language: Option<String>,
    #[serde(default)]
    cwd: Option<String>,
}

/// `POST /contexts`: a new context, its kernel started before the answer (so a bad `cwd` fails here).
pub(super) async fn create_context(
    InterpreterSandbox(entry, meta): InterpreterSandbox,
    body: Bytes,
) -> Result<Json<Value>, E2bError> {
    let request: CreateContext = match body.is_empty() {
        true => CreateContext::default(),
        false => {
            serde_json::from_slice(&body).map_err(|e| E2bError::invalid_argument(format!("invalid context: {e}")))?
        }
    };
    let language = Language::parse(request.language.as_deref())?;
    if meta.template == WASM_TEMPLATE {
        return Err(E2bError::invalid_argument(format!(
            "a {WASM_TEMPLATE} sandbox has one context, its wasm Python session ({WASM_CONTEXT})"
        )));
    }
    let context = meta.contexts.create(language, request.cwd.as_deref().unwrap_or(HOME))?;
    let started = context.clone();
    let result =
        blocking(move || started.ensure_started(&entry).map_err(|why| ApiError::bad_request("kernel_start", why)))
            .await;
    if let Err(err) = result {
        meta.contexts.remove(&context.id);
        return Err(err.into());
    }
    Ok(Json(context.json()))
}

/// `GET /contexts`.
pub(super) async fn list_contexts(InterpreterSandbox(_, meta): InterpreterSandbox) -> Json<Value> {
    if meta.template == WASM_TEMPLATE {
        return Json(json!([{"id": WASM_CONTEXT, "language": "python", "cwd": HOME}]));
    }
    Json(Value::Array(meta.contexts.list().iter().map(|c| c.json()).collect()))
}

/// `POST /contexts/{id}/restart`: a fresh kernel (its variables gone), started before the answer.
pub(super) async fn restart_context(
    InterpreterSandbox(entry, meta): InterpreterSandbox,
    Path(id): Path<String>,
) -> Result<Json<Value>, E2bError> {
    if meta.template == WASM_TEMPLATE && id == WASM_CONTEXT {
        let session = lock(&meta.python).take();
        if let Some(session) = session {
            let _ = blocking(move || session.close()).await;
        }
        return Ok(Json(json!({})));
    }
    let context: Arc<Context> =
        meta.contexts.get(&id).ok_or_else(|| E2bError::not_found(format!("no code context {id}")))?;
    context.stop();
    blocking(move || context.ensure_started(&entry).map_err(ApiError::internal)).await?;
    Ok(Json(json!({})))
}

/// `DELETE /contexts/{id}`.
pub(super) async fn remove_context(
    InterpreterSandbox(_, meta): InterpreterSandbox,
    Path(id): Path<String>,
) -> Result<StatusCode, E2bError> {
    match meta.contexts.remove(&id) {
        true => Ok(StatusCode::NO_CONTENT),
        false => Err(E2bError::not_found(format!("no code context {id}"))),
    }
}
