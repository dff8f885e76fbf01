//! The filesystem calls' request parser, for the fuzz targets (`fuzz/`, through `e2b::fuzzing`). Not an API.

use serde_json::Value;

use crate::error::ApiError;

/// The argv of the sandbox's program for the filesystem call `call` with this request.
pub(crate) fn operation(call: &str, request: &Value) -> Result<Vec<String>, ApiError> {
    super::operation(call, request)
}
