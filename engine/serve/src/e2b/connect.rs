//! Connect-RPC as envd speaks it (JSON only): the 5-byte envelope (flags, big-endian length, message) of streams,
//! an extractor for a call's request message, and the extractor of the sandbox an envd call is for.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{Method, header};
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::signature::{FileOperation, SignedQuery};
use super::{E2bError, E2bMeta};
use crate::AppState;
use crate::error::ApiError;
use crate::registry::SandboxEntry;

/// The envelope flag of a stream's last message.
pub const END_STREAM: u8 = 2;

/// One Connect envelope: flags, big-endian length, JSON.
pub fn envelope(flags: u8, body: &Value) -> Bytes {
    let payload = body.to_string().into_bytes();
    let mut frame = Vec::with_capacity(payload.len() + 5);
    frame.push(flags);
    frame.extend_from_slice(&u32::try_from(payload.len()).unwrap_or(u32::MAX).to_be_bytes());
    frame.extend_from_slice(&payload);
    Bytes::from(frame)
}

/// The JSON message of a request made of one uncompressed envelope.
pub fn parse_envelope(body: &[u8]) -> Result<Value, String> {
    let Some((&[flags, a, b, c, d], rest)) = body.split_first_chunk::<5>() else {
        return Err("the request is shorter than a Connect envelope".to_owned());
    };
    if flags & 1 != 0 {
        return Err("compressed envelopes are not supported".to_owned());
    }
    let len = usize::try_from(u32::from_be_bytes([a, b, c, d])).map_err(|e| e.to_string())?;
    let payload = rest.get(..len).ok_or("the envelope is longer than the request")?;
    serde_json::from_slice(payload).map_err(|e| format!("invalid message: {e}"))
}

/// A client's stream of Connect envelopes (a client-streaming call's body, `StreamInput`), read as its bytes
/// arrive: whole messages come out in order however the bytes were split, and a message announced larger than the
/// reader's bound, or compressed, is refused as soon as its header is in, before its bytes are kept.
#[derive(Debug)]
pub struct EnvelopeReader {
    buffer: Vec<u8>,
    max: usize,
}

/// One message of a client stream.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamMessage {
    /// The envelope's end-of-stream flag.
    pub end: bool,
    /// Its JSON message.
    pub message: Value,
}

impl EnvelopeReader {
    /// A reader of messages of at most `max` bytes.
    pub fn new(max: usize) -> EnvelopeReader {
        EnvelopeReader { buffer: Vec::new(), max }
    }

    /// Bytes that arrived.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buffer.extend_from_slice(bytes);
    }

    /// The next whole message, `None` until more bytes arrive.
    pub fn next_message(&mut self) -> Result<Option<StreamMessage>, String> {
        let Some(&[flags, a, b, c, d]) = self.buffer.first_chunk::<5>() else { return Ok(None) };
        let len = usize::try_from(u32::from_be_bytes([a, b, c, d])).unwrap_or(usize::MAX);
        if flags & 1 != 0 {
            return Err("compressed envelopes are not supported".to_owned());
        }
        if len > self.max {
            return Err(format!("a message of {len} bytes (at most {})", self.max));
        }
        if self.buffer.len() < 5 + len {
            return Ok(None);
        }
        let payload: Vec<u8> = self.buffer.drain(..5 + len).skip(5).collect();
        let end = flags & END_STREAM != 0;
        // An end-of-stream envelope may be empty (no error): nothing to parse.
        let message = if end && payload.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&payload).map_err(|e| format!("invalid message: {e}"))?
        };
        Ok(Some(StreamMessage { end, message }))
    }

    /// Whether bytes of an unfinished message are held.
    pub fn is_partial(&self) -> bool {
        !self.buffer.is_empty()
    }
}

/// A Connect call's request message: the JSON body of a unary call, or the one envelope of a server-streaming
/// call's request (sent as `application/connect+json`). A message that does not parse is `invalid_argument`.
#[derive(Debug)]
pub struct ConnectRequest<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ConnectRequest<T> {
    type Rejection = E2bError;

    async fn from_request(request: Request, state: &S) -> Result<Self, E2bError> {
        let streamed = request
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("application/connect+"));
        let body = Bytes::from_request(request, state).await.map_err(ApiError::from)?;
        let message = if streamed {
            parse_envelope(&body).map_err(E2bError::invalid_argument)?
        } else {
            serde_json::from_slice(&body).map_err(|e| E2bError::invalid_argument(format!("invalid message: {e}")))?
        };
        serde_json::from_value(message).map(ConnectRequest).map_err(|e| E2bError::invalid_argument(e.to_string()))
    }
}

/// The sandbox an envd call is for, and the E2B layer's state of it ([`envd_sandbox`]).
#[derive(Debug)]
pub struct EnvdSandbox(pub Arc<SandboxEntry>, pub Arc<E2bMeta>);

impl FromRequestParts<Arc<AppState>> for EnvdSandbox {
    type Rejection = E2bError;

    async fn from_request_parts(parts: &mut Parts, state: &Arc<AppState>) -> Result<Self, E2bError> {
        match envd_sandbox(state, parts) {
            Ok((entry, meta)) => Ok(EnvdSandbox(entry, meta)),
            // A paused sandbox created with `autoResume` wakes for an authorised call, as E2B's proxy wakes it.
            Err(gone) => {
                let Some(id) = sandbox_named(state, parts) else { return Err(gone) };
                if !super::lifecycle::auto_resume(state, &id, |meta| authorise(parts, meta).is_ok()).await? {
                    return Err(gone);
                }
                let (entry, meta) = envd_sandbox(state, parts)?;
                Ok(EnvdSandbox(entry, meta))
            }
        }
    }
}

/// envd's port, which a Host name `49983-{id}.{domain}` names.
const ENVD_PORT: u16 = 49983;

/// The sandbox an envd request is for and its E2B state: named by its `E2b-Sandbox-Id` header, or, on a server with
/// a domain, by a Host name `49983-{id}.{domain}` (the host of the SDKs' signed file URLs); authorised by its
/// `X-Access-Token`, or, for `GET` and `POST /files` without one, by the URL's signature ([`super::signature`]). One
/// this server does not hold is [`E2bError::sandbox_gone`], as E2B's proxy answers.
pub fn envd_sandbox(state: &AppState, parts: &Parts) -> Result<(Arc<SandboxEntry>, Arc<E2bMeta>), E2bError> {
    let id = sandbox_named(state, parts)
        .ok_or_else(|| E2bError::invalid_argument("envd calls need the E2b-Sandbox-Id header"))?;
    let id = id.as_str();
    let entry = state.registry.get_any(id).ok_or_else(|| E2bError::sandbox_gone(id))?;
    let meta = state.e2b.sandbox(id).ok_or_else(|| E2bError::sandbox_gone(id))?;
    authorise(parts, &meta)?;
    Ok((entry, meta))
}

/// The sandbox an envd request names: its `E2b-Sandbox-Id` header, or a Host name `49983-{id}.{domain}`.
fn sandbox_named(state: &AppState, parts: &Parts) -> Option<String> {
    let header = |name: &str| parts.headers.get(name).and_then(|v| v.to_str().ok());
    let by_host = || {
        let (id, port) = crate::ports::from_host(header("host")?, state.domain.as_deref()?)?;
        (port == ENVD_PORT).then_some(id)
    };
    header("e2b-sandbox-id").or_else(by_host).map(str::to_owned)
}

/// Whether an envd request may act on the sandbox of `meta`: a token, when it carries one, must be the sandbox's
/// (even beside a good signature, as envd has it); without one, only a signed `/files` request passes.
fn authorise(parts: &Parts, meta: &E2bMeta) -> Result<(), E2bError> {
    let unauthenticated =
        || E2bError::new(super::ConnectCode::Unauthenticated, "missing or wrong X-Access-Token for this sandbox");
    // An empty header is none, as envd reads it.
    if let Some(token) = parts.headers.get("x-access-token").filter(|v| !v.is_empty()) {
        let right = token.to_str().is_ok_and(|token| super::signature::same_secret(token, &meta.access_token));
        return if right { Ok(()) } else { Err(unauthenticated()) };
    }
    let operation = match (&parts.method, parts.uri.path()) {
        (&Method::GET, "/files") => FileOperation::Read,
        (&Method::POST, "/files") => FileOperation::Write,
        _ => return Err(unauthenticated()),
    };
    let query = SignedQuery::of_uri(&parts.uri)?;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    query.check(operation, &meta.access_token, i64::try_from(now).unwrap_or(i64::MAX))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_stream_gives_whole_messages_however_it_is_split_and_refuses_big_ones() {
        let body = [
            envelope(0, &serde_json::json!({"start": {"process": {"pid": 7}}})),
            envelope(END_STREAM, &serde_json::json!({})),
        ]
        .concat();
        for split in 0..body.len() {
            let mut reader = EnvelopeReader::new(1024);
            let mut got = Vec::new();
            for part in [&body[..split], &body[split..]] {
                reader.push(part);
                while let Some(message) = reader.next_message().expect("message") {
                    got.push(message);
                }
            }
            assert_eq!(got.len(), 2, "split at {split}");
            assert_eq!(got[0].message["start"]["process"]["pid"], 7);
            assert!(!got[0].end && got[1].end && !reader.is_partial());
        }
        let mut reader = EnvelopeReader::new(8);
        reader.push(&[0, 0, 0, 1, 0]);
        assert!(reader.next_message().expect_err("too big").contains("256 bytes"));
    }

    #[test]
    fn envelopes_round_trip_and_bad_ones_are_refused() {
        let frame = envelope(0, &serde_json::json!({"process": {"cmd": "/bin/bash"}}));
        assert_eq!(parse_envelope(&frame), Ok(serde_json::json!({"process": {"cmd": "/bin/bash"}})));
        assert!(parse_envelope(&frame[..3]).is_err());
        assert!(parse_envelope(&frame[..frame.len() - 1]).is_err());
        let mut compressed = frame.to_vec();
        compressed[0] = 1;
        assert!(parse_envelope(&compressed).is_err());
    }
}
