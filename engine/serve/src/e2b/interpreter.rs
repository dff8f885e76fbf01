//! The code interpreter's `POST /execute` (`E2b-Sandbox-Port: 49999`): a cell run by the value of its last
//! expression as the main result, answered as NDJSON. Cells wasm can run go to a live wasm Python session of the
//! sandbox (state carries over as in Jupyter); the others run with the sandbox's own `python3`, carrying imports,
//! definitions and picklable values to the next such cell. Both see the sandbox's [`HOME`].

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Instant, SystemTime};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use strata_core::{CancelToken, Capabilities, ExecOptions, Grant, GrantMode, Job, Limits, PythonSource, TierKind};
use strata_engine::TierChoice;

use super::connect::EnvdSandbox;
use super::control::rfc3339;
use super::process::command_limits;
use super::{E2bError, HOME};
use crate::AppState;
use crate::error::ApiError;
use crate::registry::{SandboxEntry, lock};
use crate::service::{CancelOnDrop, blocking, record_job};

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
    let meta = state.e2b.sandbox(&entry.id).ok_or_else(|| ApiError::sandbox_not_found(&entry.id))?;
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

const CELL_MARKER: &str = "\u{1e}STRATA-CELL ";

#[derive(Debug, Deserialize)]
pub(super) struct ExecuteRequest {
    code: String,
}

pub(super) async fn execute(
    State(state): State<Arc<AppState>>,
    EnvdSandbox(entry, _): EnvdSandbox,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, E2bError> {
    let request: ExecuteRequest =
        serde_json::from_slice(&body).map_err(|e| E2bError::invalid_argument(format!("invalid cell: {e}")))?;
    let limits = command_limits(&entry, &headers);
    let count = state.e2b.sandbox(&entry.id).map(|m| m.executions.fetch_add(1, Ordering::Relaxed) + 1).unwrap_or(1);
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
        crate::service::exec_in(&state, entry, job, opts).await
    };
    let outcome = outcome?;
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
    Ok(([(header::CONTENT_TYPE, "application/x-ndjson")], text).into_response())
}
