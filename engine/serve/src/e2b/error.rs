//! The E2B layer's errors, answered in the shapes the official SDKs parse:
//!
//! - REST (the control plane, envd's `/files` and `/health`, the code interpreter's `/execute`):
//!   `{"code": <HTTP status>, "message": "…"}` with that status;
//! - Connect unary calls (`process.Process/List`, `filesystem.Filesystem/Stat`, …): `{"code": "not_found",
//!   "message": "…"}` with the HTTP status the Connect protocol gives the code;
//! - Connect server streams (`process.Process/Start`, `Connect`, `filesystem.Filesystem/WatchDir`): HTTP 200 and one
//!   end-of-stream envelope `{"error": {"code": …, "message": …}}`, as the protocol has streams end.
//!
//! Which shape a response takes is the route's, not the error's: an [`E2bError`] renders as REST and carries itself
//! in the response's extensions, and [`render`] (a middleware over every E2B route) answers it in the shape of the
//! request it answers. The same middleware gives E2B's shape to what the router itself refuses under the E2B routes
//! (an unknown path or method, a body past the size limit).

use axum::Json;
use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::error::ApiError;

/// A Connect error code (the protocol's names, each with its HTTP status).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectCode {
    /// The call was cancelled.
    Canceled,
    /// An error with no better code.
    Unknown,
    /// The request is invalid.
    InvalidArgument,
    /// The call ran out of time.
    DeadlineExceeded,
    /// What the call names does not exist.
    NotFound,
    /// What the call would create exists.
    AlreadyExists,
    /// The caller may not do this.
    PermissionDenied,
    /// A quota or limit is exhausted.
    ResourceExhausted,
    /// The system is not in a state the call needs.
    FailedPrecondition,
    /// The call was aborted by a conflict.
    Aborted,
    /// The server does not implement the call.
    Unimplemented,
    /// A server error.
    Internal,
    /// The service (or the sandbox) is not available.
    Unavailable,
    /// The call carries no valid credentials.
    Unauthenticated,
}

impl ConnectCode {
    const ALL: [ConnectCode; 14] = [
        ConnectCode::Canceled,
        ConnectCode::Unknown,
        ConnectCode::InvalidArgument,
        ConnectCode::DeadlineExceeded,
        ConnectCode::NotFound,
        ConnectCode::AlreadyExists,
        ConnectCode::PermissionDenied,
        ConnectCode::ResourceExhausted,
        ConnectCode::FailedPrecondition,
        ConnectCode::Aborted,
        ConnectCode::Unimplemented,
        ConnectCode::Internal,
        ConnectCode::Unavailable,
        ConnectCode::Unauthenticated,
    ];

    /// Its name on the wire (`not_found`).
    pub fn as_str(self) -> &'static str {
        match self {
            ConnectCode::Canceled => "canceled",
            ConnectCode::Unknown => "unknown",
            ConnectCode::InvalidArgument => "invalid_argument",
            ConnectCode::DeadlineExceeded => "deadline_exceeded",
            ConnectCode::NotFound => "not_found",
            ConnectCode::AlreadyExists => "already_exists",
            ConnectCode::PermissionDenied => "permission_denied",
            ConnectCode::ResourceExhausted => "resource_exhausted",
            ConnectCode::FailedPrecondition => "failed_precondition",
            ConnectCode::Aborted => "aborted",
            ConnectCode::Unimplemented => "unimplemented",
            ConnectCode::Internal => "internal",
            ConnectCode::Unavailable => "unavailable",
            ConnectCode::Unauthenticated => "unauthenticated",
        }
    }

    /// The code named `name` on the wire.
    pub fn from_name(name: &str) -> Option<ConnectCode> {
        ConnectCode::ALL.into_iter().find(|code| code.as_str() == name)
    }

    /// The HTTP status the Connect protocol answers a unary error of this code with.
    pub fn status(self) -> StatusCode {
        match self {
            ConnectCode::Canceled => StatusCode::from_u16(499).unwrap_or(StatusCode::REQUEST_TIMEOUT),
            ConnectCode::InvalidArgument | ConnectCode::FailedPrecondition => StatusCode::BAD_REQUEST,
            ConnectCode::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            ConnectCode::NotFound => StatusCode::NOT_FOUND,
            ConnectCode::AlreadyExists | ConnectCode::Aborted => StatusCode::CONFLICT,
            ConnectCode::PermissionDenied => StatusCode::FORBIDDEN,
            ConnectCode::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            ConnectCode::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            ConnectCode::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ConnectCode::Unauthenticated => StatusCode::UNAUTHORIZED,
            ConnectCode::Unknown | ConnectCode::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The code of an HTTP error status (the inverse of [`status`](ConnectCode::status), and the nearest code for
    /// the statuses it does not produce).
    pub fn of_status(status: StatusCode) -> ConnectCode {
        match status.as_u16() {
            400 | 411 | 415 | 422 => ConnectCode::InvalidArgument,
            401 => ConnectCode::Unauthenticated,
            403 => ConnectCode::PermissionDenied,
            404 => ConnectCode::NotFound,
            405 | 501 => ConnectCode::Unimplemented,
            408 | 504 => ConnectCode::DeadlineExceeded,
            409 => ConnectCode::Aborted,
            412 => ConnectCode::FailedPrecondition,
            413 | 429 | 507 => ConnectCode::ResourceExhausted,
            499 => ConnectCode::Canceled,
            502 | 503 => ConnectCode::Unavailable,
            400..=499 => ConnectCode::InvalidArgument,
            500 => ConnectCode::Internal,
            _ => ConnectCode::Unknown,
        }
    }
}

/// An error of the E2B layer: the HTTP status a REST answer carries, the Connect code an RPC answer carries, and
/// what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", code.as_str())]
pub struct E2bError {
    /// The HTTP status of a REST answer.
    pub status: StatusCode,
    /// The code of a Connect answer.
    pub code: ConnectCode,
    /// What was wrong, in one sentence.
    pub message: String,
}

impl E2bError {
    /// An error of this code, with the code's HTTP status.
    pub fn new(code: ConnectCode, message: impl Into<String>) -> E2bError {
        E2bError { status: code.status(), code, message: message.into() }
    }

    /// `invalid_argument` (400).
    pub fn invalid_argument(message: impl Into<String>) -> E2bError {
        E2bError::new(ConnectCode::InvalidArgument, message)
    }

    /// `not_found` (404).
    pub fn not_found(message: impl Into<String>) -> E2bError {
        E2bError::new(ConnectCode::NotFound, message)
    }

    /// `internal` (500).
    pub fn internal(message: impl Into<String>) -> E2bError {
        E2bError::new(ConnectCode::Internal, message)
    }

    /// An envd call for a sandbox this server does not hold (killed, expired, never made): what E2B's proxy in front
    /// of envd answers, 502 (`unavailable` in Connect) saying it "was not found", which the SDKs raise as their
    /// sandbox-not-running errors.
    pub fn sandbox_gone(id: &str) -> E2bError {
        E2bError {
            status: StatusCode::BAD_GATEWAY,
            code: ConnectCode::Unavailable,
            message: format!("the sandbox {id} was not found"),
        }
    }

    /// A path or method this server does not implement under the E2B routes (501, `unimplemented`).
    pub fn unimplemented(method: &axum::http::Method, path: &str) -> E2bError {
        E2bError::new(ConnectCode::Unimplemented, format!("strata serve does not implement {method} {path}"))
    }

    /// The REST answer: `{"code": <status>, "message": …}`.
    fn rest(&self) -> Response {
        (self.status, Json(json!({"code": self.status.as_u16(), "message": self.message}))).into_response()
    }

    /// The Connect unary answer: `{"code": "not_found", "message": …}` with the code's status.
    fn unary(&self) -> Response {
        (self.code.status(), Json(json!({"code": self.code.as_str(), "message": self.message}))).into_response()
    }

    /// The Connect stream answer: 200 and the end-of-stream envelope carrying the error.
    fn stream(&self) -> Response {
        let end = super::connect::envelope(super::connect::END_STREAM, &self.end_of_stream());
        ([(header::CONTENT_TYPE, "application/connect+json")], Body::from(end)).into_response()
    }

    /// The answer to a request to `path` with these headers, in the shape of its protocol: for what is refused
    /// before routing, which [`render`] does not see.
    pub fn answer_to(self, path: &str, headers: &HeaderMap) -> Response {
        self.answer(Protocol::of(path, headers))
    }

    fn answer(self, protocol: Protocol) -> Response {
        match protocol {
            Protocol::Rest => self.into_response(),
            Protocol::Unary => self.unary(),
            Protocol::Stream => self.stream(),
        }
    }

    /// The message of an end-of-stream envelope that ends a stream with this error.
    pub fn end_of_stream(&self) -> serde_json::Value {
        json!({"error": {"code": self.code.as_str(), "message": self.message}})
    }
}

impl From<ApiError> for E2bError {
    fn from(err: ApiError) -> E2bError {
        E2bError { status: err.status, code: ConnectCode::of_status(err.status), message: err.message }
    }
}

impl From<crate::registry::RegistryError> for E2bError {
    fn from(err: crate::registry::RegistryError) -> E2bError {
        ApiError::from(err).into()
    }
}

impl From<strata_core::TierError> for E2bError {
    fn from(err: strata_core::TierError) -> E2bError {
        ApiError::from(err).into()
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        let mut response = self.rest();
        response.extensions_mut().insert(self);
        response
    }
}

/// The protocol a request to the E2B routes speaks, which its errors answer in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Rest,
    Unary,
    Stream,
}

impl Protocol {
    /// Connect procedures are `/package.Service/Method`; streams are sent as `application/connect+json`.
    fn of(path: &str, headers: &HeaderMap) -> Protocol {
        let service = path.trim_start_matches('/').split('/').next().unwrap_or_default();
        if !service.contains('.') {
            return Protocol::Rest;
        }
        let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok());
        match content_type {
            Some(kind) if kind.starts_with("application/connect+") => Protocol::Stream,
            _ => Protocol::Unary,
        }
    }
}

/// The longest body of a router refusal kept as an error's message.
const MAX_REFUSAL: usize = 512;

/// Answers every error of an E2B route in the shape its protocol has: an [`E2bError`] as it is, and any other error
/// response (the router's own refusals) as the error of its status with its text as the message.
pub async fn render(request: Request, next: Next) -> Response {
    let protocol = Protocol::of(request.uri().path(), request.headers());
    let (method, path) = (request.method().clone(), request.uri().path().to_owned());
    let response = next.run(request).await;
    let status = response.status();
    let err = match response.extensions().get::<E2bError>() {
        Some(_) if protocol == Protocol::Rest => return response,
        Some(err) => err.clone(),
        None if status.is_client_error() || status.is_server_error() => {
            let body = axum::body::to_bytes(response.into_body(), MAX_REFUSAL).await.unwrap_or_default();
            let text = String::from_utf8_lossy(&body).trim().to_owned();
            match status {
                StatusCode::NOT_FOUND if text.is_empty() => E2bError::unimplemented(&method, &path),
                StatusCode::METHOD_NOT_ALLOWED => E2bError { status, ..E2bError::unimplemented(&method, &path) },
                _ if text.is_empty() => E2bError {
                    status,
                    code: ConnectCode::of_status(status),
                    message: status.canonical_reason().unwrap_or("error").to_owned(),
                },
                _ => E2bError { status, code: ConnectCode::of_status(status), message: text },
            }
        }
        None => return response,
    };
    err.answer(protocol)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_round_trips_through_its_name_and_status() {
        for code in ConnectCode::ALL {
            assert_eq!(ConnectCode::from_name(code.as_str()), Some(code));
            let back = ConnectCode::of_status(code.status());
            let same_status = [code, back].map(ConnectCode::status);
            assert_eq!(same_status[0], same_status[1], "{code:?}");
        }
        assert_eq!(ConnectCode::from_name("nope"), None);
        assert_eq!(ConnectCode::Unimplemented.status(), StatusCode::NOT_IMPLEMENTED);
        assert_eq!(ConnectCode::Canceled.status().as_u16(), 499);
    }

    #[test]
    fn a_gone_sandbox_is_a_502_saying_it_was_not_found() {
        let err = E2bError::sandbox_gone("sb_x");
        assert_eq!((err.status.as_u16(), err.code), (502, ConnectCode::Unavailable));
        assert!(err.message.contains("was not found"), "{}", err.message);
    }
}
