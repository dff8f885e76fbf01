//! The E2B layer's request parsers, for the fuzz targets (`fuzz/`): what a handler makes of a client's bytes
//! before it touches a sandbox. Not an API.

use super::*;

/// A Connect-RPC request body: one envelope, its JSON message.
pub fn connect_envelope(body: &[u8]) -> Result<Value, String> {
    parse_envelope(body)
}

/// `process.Process/Start`'s message as the handler reads it: the argv it runs and whether stdin stays open.
pub fn process_start(message: Value) -> Result<(Vec<String>, bool), ApiError> {
    let request = serde_json::from_value::<StartRequest>(message)
        .map_err(|e| ApiError::bad_request("invalid_argument", e.to_string()))?;
    let stdin = request.stdin;
    command_argv(request.process).map(|argv| (argv, stdin))
}

/// The pid a unary `process.Process/*` message names, and `SendInput`'s bytes when it carries any.
pub fn process_unary(body: &[u8]) -> Result<(u32, Option<Vec<u8>>), ApiError> {
    let request: Value = serde_json::from_slice(body).map_err(|e| invalid_argument(e.to_string()))?;
    let pid = request["process"]["pid"].as_u64().and_then(|p| u32::try_from(p).ok());
    let pid = pid.ok_or_else(|| invalid_argument("process.pid is required"))?;
    let input = match request["input"]["stdin"].as_str() {
        Some(text) => Some(BASE64.decode(text).map_err(|e| invalid_argument(format!("input.stdin: {e}")))?),
        None => None,
    };
    Ok((pid, input))
}

/// The control plane's and the code interpreter's JSON bodies: `POST /sandboxes`, `/timeout`, `/execute`.
pub fn control_bodies(body: &[u8]) -> [bool; 3] {
    [
        serde_json::from_slice::<CreateRequest>(body).is_ok(),
        serde_json::from_slice::<TimeoutRequest>(body).is_ok(),
        serde_json::from_slice::<ExecuteRequest>(body).is_ok(),
    ]
}

/// The filesystem call `call` (`stat`, `list`, `mkdir`, `move`, `remove`) as the argv of the sandbox's program.
pub fn filesystem_call(call: &str, body: &[u8]) -> Result<Vec<String>, ApiError> {
    let request: Value =
        serde_json::from_slice(body).map_err(|e| ApiError::bad_request("invalid_argument", e.to_string()))?;
    crate::e2b_fs::fuzzing::operation(call, &request)
}
