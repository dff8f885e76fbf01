//! The native API's request checks, for the fuzz targets (`fuzz/`): what a handler makes of a JSON body before it
//! starts anything. Not an API.

use strata_core::Job;

use super::*;

/// What a body asks for, once checked.
#[derive(Debug)]
pub struct Checked {
    /// The job (`/run`, `/exec`).
    pub job: Option<Job>,
    /// Its capabilities (`/sandboxes`, `/run`).
    pub caps: Option<Capabilities>,
    /// Its limits.
    pub limits: Option<Limits>,
    /// Its TTL (`/sandboxes`, `/timeout`, `/fork`).
    pub ttl: Option<Duration>,
}

/// Checks `body` as the body of endpoint `kind`: 0 `POST /v1/sandboxes`, 1 `/v1/run`, 2 `.../exec`,
/// 3 `.../timeout`, 4 `/v1/snapshots/{id}/fork`, as the handlers do.
pub fn check_body(state: &AppState, kind: u8, body: &[u8]) -> Result<Checked, ApiError> {
    let parse = |e: serde_json::Error| ApiError::bad_request("invalid_json", e.to_string());
    let mut checked = Checked { job: None, caps: None, limits: None, ttl: None };
    match kind % 5 {
        0 => {
            let req: CreateSandboxRequest = serde_json::from_slice(body).map_err(parse)?;
            tier_choice(req.tier.as_deref())?;
            checked.caps = Some(capabilities(state, &req.capabilities)?);
            checked.limits = Some(limits(state, &state.policy.limits, &req.limits)?);
            checked.ttl = Some(ttl(state, req.ttl)?);
        }
        1 => {
            let req: RunRequest = serde_json::from_slice(body).map_err(parse)?;
            tier_choice(req.tier.as_deref())?;
            checked.job = Some(req.job.to_job()?);
            checked.caps = Some(capabilities(state, &req.capabilities)?);
            checked.limits = Some(limits(state, &state.policy.limits, &req.job.limits)?);
        }
        2 => {
            let req: JobRequest = serde_json::from_slice(body).map_err(parse)?;
            checked.job = Some(req.to_job()?);
            checked.limits = Some(limits(state, &state.policy.limits, &req.limits)?);
        }
        3 => {
            let req: TimeoutRequest = serde_json::from_slice(body).map_err(parse)?;
            checked.ttl = Some(ttl(state, Some(req.timeout))?);
        }
        _ => {
            let req: ForkRequest = serde_json::from_slice(body).map_err(parse)?;
            if req.count == 0 || req.count > MAX_FORKS {
                return Err(ApiError::bad_request("invalid_count", "count"));
            }
            checked.ttl = Some(ttl(state, req.ttl)?);
        }
    }
    Ok(checked)
}
