//! The API's typed errors: `{"error":{"code":"...","message":"..."}}` with a stable code and an HTTP status.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use strata_core::TierError;
use strata_engine::EngineError;
use utoipa::ToSchema;

use crate::connections::BodyTimeout;
use crate::registry::{AdmissionError, RegistryError};

/// An error the API returns: an HTTP status, a stable machine-readable code and a one-line message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// A stable code (`not_found`, `invalid_json`, `unauthorized`, `quota_exceeded`, …).
    pub code: &'static str,
    /// What was wrong, in one sentence.
    pub message: String,
}

/// The JSON body of an error response.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// The `error` object of an [`ErrorBody`].
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// A stable, machine-readable code.
    pub code: String,
    /// A human-readable message.
    pub message: String,
}

impl ApiError {
    /// A create another node of the fleet answered ([`crate::fleet::placement`]): the fleet's middleware replaces
    /// this with that node's answer, so no client sees it.
    pub fn forwarded() -> ApiError {
        ApiError::new(StatusCode::BAD_GATEWAY, "forwarded", "the request was answered by another node of the fleet")
    }

    /// An error with this status, code and message.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, code, message: message.into() }
    }

    /// 400 with this code.
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, code, message)
    }

    /// 404 `sandbox_not_found`.
    pub fn sandbox_not_found(id: &str) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "sandbox_not_found", format!("no sandbox {id}"))
    }

    /// 404 `snapshot_not_found`.
    pub fn snapshot_not_found(id: &str) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "snapshot_not_found", format!("no snapshot {id}"))
    }

    /// 401 `unauthorized`.
    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }

    /// 503 `shutting_down`: the server is draining and takes no new work.
    pub fn shutting_down() -> ApiError {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "shutting_down", "the server is shutting down")
    }

    /// 409 `sandbox_busy`: another request is using the sandbox.
    pub fn busy(id: &str, doing: &str) -> ApiError {
        ApiError::new(StatusCode::CONFLICT, "sandbox_busy", format!("sandbox {id} is busy with {doing}"))
    }

    /// 429 `too_many_jobs`: the sandbox runs as many jobs at once as it may.
    pub fn too_many_jobs(id: &str, max: usize) -> ApiError {
        ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "too_many_jobs",
            format!("sandbox {id} is running {max} jobs, the most it runs at once"),
        )
    }

    /// 500 `internal`.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }

    /// 413 `body_too_large`: the request body is over `max_body` bytes (when known), the most the server accepts.
    pub fn too_large(max_body: Option<usize>) -> ApiError {
        let message = match max_body {
            Some(max) => format!("the request body is over {max} bytes, the most this server accepts"),
            None => "the request body is over the most this server accepts".to_owned(),
        };
        ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", message)
    }

    /// The error a request body's reader got from the connection's body (`crate::connections`): 413
    /// `body_too_large` or 408 `body_timeout`; `None` for any other error.
    pub(crate) fn of_body(err: &(dyn std::error::Error + 'static), max_body: Option<usize>) -> Option<ApiError> {
        let mut source = Some(err);
        while let Some(err) = source {
            if err.is::<http_body_util::LengthLimitError>() {
                return Some(ApiError::too_large(max_body));
            }
            if let Some(timeout) = err.downcast_ref::<BodyTimeout>() {
                return Some(ApiError::new(StatusCode::REQUEST_TIMEOUT, "body_timeout", timeout.to_string()));
            }
            source = err.source();
        }
        None
    }

    /// The error of an extractor's rejection of a body the connection cut (axum reports the size limit by its
    /// status).
    pub(crate) fn of_rejected_body(
        status: StatusCode,
        rejection: &(dyn std::error::Error + 'static),
    ) -> Option<ApiError> {
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            return Some(ApiError::too_large(None));
        }
        ApiError::of_body(rejection, None)
    }

    /// The response body.
    pub fn body(&self) -> ErrorBody {
        ErrorBody { error: ErrorDetail { code: self.code.to_owned(), message: self.message.clone() } }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

impl From<TierError> for ApiError {
    fn from(err: TierError) -> ApiError {
        let status = match &err {
            TierError::ReadInput { .. }
            | TierError::WrongFormat { .. }
            | TierError::InvalidModule { .. }
            | TierError::UnknownImport { .. }
            | TierError::Capability(_)
            | TierError::WrongJob { .. }
            | TierError::Tool(_)
            | TierError::ProgramNotFound { .. }
            | TierError::ExecFailed { .. } => StatusCode::BAD_REQUEST,
            TierError::GuestPath { .. } | TierError::ImageNotFound { .. } => StatusCode::NOT_FOUND,
            TierError::Unsupported { .. } => StatusCode::NOT_IMPLEMENTED,
            TierError::SessionEnded { .. } | TierError::Busy { .. } | TierError::SessionTier { .. } => {
                StatusCode::CONFLICT
            }
            TierError::Cancelled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            TierError::Capacity { .. } => StatusCode::SERVICE_UNAVAILABLE,
            TierError::PortClosed { .. } => StatusCode::BAD_GATEWAY,
            TierError::Snapshot(_) => StatusCode::BAD_REQUEST,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError { status, code: err.code(), message: err.to_string() }
    }
}

impl From<strata_core::SnapshotError> for ApiError {
    fn from(err: strata_core::SnapshotError) -> ApiError {
        TierError::Snapshot(err).into()
    }
}

impl From<EngineError> for ApiError {
    fn from(err: EngineError) -> ApiError {
        let err = match err {
            EngineError::Tier(tier) => return tier.into(),
            other => other,
        };
        let status = match &err {
            EngineError::TierUnavailable { .. }
            | EngineError::Wasm32Numerics { .. }
            | EngineError::ImageNotReady { .. } => StatusCode::SERVICE_UNAVAILABLE,
            EngineError::TierNotAllowed { .. } => StatusCode::FORBIDDEN,
            EngineError::NoTierFor(_)
            | EngineError::UnknownTier(_)
            | EngineError::UnknownImage(_)
            | EngineError::UnknownFileKind(_)
            | EngineError::SnapshotTier { .. } => StatusCode::BAD_REQUEST,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError { status, code: err.code(), message: err.to_string() }
    }
}

impl From<axum::extract::rejection::JsonRejection> for ApiError {
    fn from(rejection: axum::extract::rejection::JsonRejection) -> ApiError {
        use axum::extract::rejection::JsonRejection as R;
        if let Some(err) = ApiError::of_rejected_body(rejection.status(), &rejection) {
            return err;
        }
        let code = match &rejection {
            R::MissingJsonContentType(_) => "unsupported_media_type",
            R::JsonDataError(_) => "invalid_request",
            _ => "invalid_json",
        };
        let status = match &rejection {
            R::MissingJsonContentType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            _ => StatusCode::BAD_REQUEST,
        };
        ApiError::new(status, code, rejection.body_text())
    }
}

impl From<axum::extract::rejection::BytesRejection> for ApiError {
    fn from(rejection: axum::extract::rejection::BytesRejection) -> ApiError {
        ApiError::of_rejected_body(rejection.status(), &rejection)
            .unwrap_or_else(|| ApiError::bad_request("invalid_body", rejection.body_text()))
    }
}

impl From<axum::extract::rejection::QueryRejection> for ApiError {
    fn from(rejection: axum::extract::rejection::QueryRejection) -> ApiError {
        ApiError::bad_request("invalid_query", rejection.body_text())
    }
}

impl From<AdmissionError> for ApiError {
    fn from(err: AdmissionError) -> ApiError {
        let code = match err {
            AdmissionError::Quota { .. } | AdmissionError::MemoryQuota { .. } => "quota_exceeded",
            AdmissionError::Capacity { .. }
            | AdmissionError::MemoryBudget { .. }
            | AdmissionError::CpuBudget { .. }
            | AdmissionError::HostCpu { .. }
            | AdmissionError::HostMemory { .. } => "server_at_capacity",
        };
        ApiError::new(StatusCode::TOO_MANY_REQUESTS, code, err.to_string())
    }
}

impl From<RegistryError> for ApiError {
    fn from(err: RegistryError) -> ApiError {
        match err {
            RegistryError::SandboxNotFound(id) => ApiError::sandbox_not_found(&id),
            RegistryError::SnapshotNotFound(id) => ApiError::snapshot_not_found(&id),
            RegistryError::Busy { id, doing } => ApiError::busy(&id, doing),
            RegistryError::TooManyJobs { id, max } => ApiError::too_many_jobs(&id, max),
            err @ RegistryError::TooManyPortConnections { .. } => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "too_many_connections", err.to_string())
            }
            RegistryError::Tier(err) => err.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_and_admission_errors_keep_their_codes() {
        let full = ApiError::from(AdmissionError::Capacity { limit: 3 });
        assert_eq!((full.status, full.code), (StatusCode::TOO_MANY_REQUESTS, "server_at_capacity"));
        let quota = ApiError::from(AdmissionError::Quota { owner: "a".into(), limit: 1 });
        assert_eq!(quota.code, "quota_exceeded");
        let gone = ApiError::from(RegistryError::SandboxNotFound("sb_x".into()));
        assert_eq!((gone.status, gone.code), (StatusCode::NOT_FOUND, "sandbox_not_found"));
        let busy = ApiError::from(RegistryError::Busy { id: "sb_x".into(), doing: "a job" });
        assert_eq!((busy.status, busy.code), (StatusCode::CONFLICT, "sandbox_busy"));
        let many = ApiError::from(RegistryError::TooManyJobs { id: "sb_x".into(), max: 2 });
        assert_eq!(many.code, "too_many_jobs");
    }
}
