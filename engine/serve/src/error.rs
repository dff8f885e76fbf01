//! The API's typed errors: `{"error":{"code":"...","message":"..."}}` with a stable code and an HTTP status.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use strata_core::TierError;
use strata_engine::EngineError;
use utoipa::ToSchema;

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
    pub fn busy(id: &str) -> ApiError {
        ApiError::new(StatusCode::CONFLICT, "sandbox_busy", format!("sandbox {id} is running another request"))
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
            TierError::GuestPath { .. } => StatusCode::NOT_FOUND,
            TierError::Unsupported { .. } => StatusCode::NOT_IMPLEMENTED,
            TierError::SessionEnded { .. } => StatusCode::CONFLICT,
            TierError::Cancelled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            TierError::Capacity { .. } => StatusCode::SERVICE_UNAVAILABLE,
            TierError::Snapshot(_) => StatusCode::BAD_REQUEST,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError { status, code: err.code(), message: err.to_string() }
    }
}

impl From<EngineError> for ApiError {
    fn from(err: EngineError) -> ApiError {
        let err = match err {
            EngineError::Tier(tier) => return tier.into(),
            other => other,
        };
        let status = match &err {
            EngineError::TierUnavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
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
        if let Some(err) = crate::connections::rejected_body(rejection.status(), &rejection) {
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
        crate::connections::rejected_body(rejection.status(), &rejection)
            .unwrap_or_else(|| ApiError::bad_request("invalid_body", rejection.body_text()))
    }
}

impl From<axum::extract::rejection::QueryRejection> for ApiError {
    fn from(rejection: axum::extract::rejection::QueryRejection) -> ApiError {
        ApiError::bad_request("invalid_query", rejection.body_text())
    }
}
