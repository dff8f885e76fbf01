//! The E2B layer's request parsers, for the fuzz targets (`fuzz/`): what a handler makes of a client's bytes
//! before it touches a sandbox. Not an API.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde_json::Value;

use super::E2bError;
pub use super::connect::StreamMessage;
use super::connect::{EnvelopeReader, parse_envelope};
use super::control::{CreateRequest, TimeoutRequest};
use super::encoding::{ContentCoding, gunzip};
use super::fs::{MoveRequest, PathRequest};
use super::interpreter::ExecuteRequest;
pub use super::kernel::{KernelEvent, MAX_EVENT, parse_event};
use super::process::{StartRequest, command_argv, selected_pid};
pub use super::signature::{FileOperation, SignedQuery, file_signature};

/// A client stream of envelopes (`StreamInput`'s body) read with its bytes split at `splits` (offsets into
/// `body`), as they may arrive: the messages, or the refusal.
pub fn envelope_stream(body: &[u8], splits: &[usize], max: usize) -> Result<Vec<StreamMessage>, String> {
    let mut reader = EnvelopeReader::new(max);
    let mut messages = Vec::new();
    let mut start = 0;
    for end in splits.iter().copied().chain([body.len()]) {
        let end = end.clamp(start, body.len());
        reader.push(&body[start..end]);
        start = end;
        while let Some(message) = reader.next_message()? {
            messages.push(message);
        }
    }
    Ok(messages)
}

/// A Connect-RPC request body: one envelope, its JSON message.
pub fn connect_envelope(body: &[u8]) -> Result<Value, String> {
    parse_envelope(body)
}

/// `process.Process/Start`'s message as the handler reads it: the argv it runs and whether stdin stays open.
pub fn process_start(message: Value) -> Result<(Vec<String>, bool), E2bError> {
    let request =
        serde_json::from_value::<StartRequest>(message).map_err(|e| E2bError::invalid_argument(e.to_string()))?;
    let stdin = request.stdin;
    command_argv(request.process).map(|argv| (argv, stdin))
}

/// The pid a unary `process.Process/*` message names, and `SendInput`'s bytes when it carries any.
pub fn process_unary(body: &[u8]) -> Result<(u32, Option<Vec<u8>>), E2bError> {
    let request: Value = serde_json::from_slice(body).map_err(|e| E2bError::invalid_argument(e.to_string()))?;
    let pid = selected_pid(&request)?;
    let input = match request["input"]["stdin"].as_str() {
        Some(text) => Some(BASE64.decode(text).map_err(|e| E2bError::invalid_argument(format!("input.stdin: {e}")))?),
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

/// The filesystem call `call` (`stat`, `list`, `mkdir`, `move`, `remove`) as its handler reads it: the call's name,
/// then the guest paths it acts on (and a listing's depth).
pub fn filesystem_call(call: &str, body: &[u8]) -> Result<Vec<String>, E2bError> {
    let invalid = |e: serde_json::Error| E2bError::invalid_argument(e.to_string());
    let mut read = vec![call.to_owned()];
    match call {
        "stat" | "mkdir" | "remove" | "list" => {
            let request = serde_json::from_slice::<PathRequest>(body).map_err(invalid)?;
            read.push(request.path()?.as_str().to_owned());
            if call == "list" {
                read.push(request.depth().to_string());
            }
        }
        "move" => {
            let (from, to) = serde_json::from_slice::<MoveRequest>(body).map_err(invalid)?.paths()?;
            read.extend([from.as_str().to_owned(), to.as_str().to_owned()]);
        }
        other => return Err(E2bError::internal(format!("no filesystem call {other}"))),
    }
    Ok(read)
}

/// What the server makes of a kernel's stdout written in these chunks: its checked events, and the line each sends
/// to the SDKs.
pub fn kernel_output(chunks: &[&[u8]]) -> Vec<(KernelEvent, Option<Value>)> {
    super::kernel::events_of(chunks)
        .into_iter()
        .map(|event| {
            let line = super::kernel::e2b_line(&event);
            (event, line)
        })
        .collect()
}

/// A `/files` request's query (`path=…&signature=…`) as the envd extractor reads it, checked as a signed
/// `operation` against the access token `token` at Unix time `now`: the query when the signature passes, or the
/// refusal (a query no request line could carry is `invalid_argument`).
pub fn signed_files_query(
    query: &str,
    operation: FileOperation,
    token: &str,
    now: i64,
) -> Result<SignedQuery, E2bError> {
    let uri = axum::http::Uri::try_from(format!("/files?{query}"))
        .map_err(|e| E2bError::invalid_argument(format!("not a request target: {e}")))?;
    let query = SignedQuery::of_uri(&uri)?;
    query.check(operation, token, now)?;
    Ok(query)
}

/// An upload's body (already within the body limit) as `POST /files` takes it with this `Content-Encoding`: the
/// bytes it writes, at most `max` once decompressed, or the refusal.
pub fn files_upload(content_encoding: Option<&str>, body: &[u8], max: usize) -> Result<Vec<u8>, E2bError> {
    match ContentCoding::of_content_encoding(content_encoding)? {
        ContentCoding::Identity => Ok(body.to_vec()),
        ContentCoding::Gzip => Ok(gunzip(body, max)?),
    }
}

/// Whether `GET /files` answers gzipped for this `Accept-Encoding`, or the refusal.
pub fn files_download_gzipped(accept_encoding: Option<&str>) -> Result<bool, E2bError> {
    Ok(ContentCoding::accepted(accept_encoding)? == ContentCoding::Gzip)
}

/// `bytes` as the one gzip member a download sends.
pub fn gzip(bytes: &[u8]) -> Vec<u8> {
    super::encoding::gzip(bytes).unwrap_or_default()
}
