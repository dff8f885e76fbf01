//! The native API under `/v1`: sandboxes, jobs, files, snapshots and forks, as JSON.
//!
//! Every handler checks the request, then does the blocking work (starting a sandbox, running a job, closing) on
//! a blocking thread so the async runtime stays responsive. Sandboxes and snapshots belong to the API key that
//! made them; another key sees `sandbox_not_found`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{Extension, Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use strata_core::{
    CancelToken, Capabilities, EnvVar, ExecOptions, FileType, Grant, GuestPath, Limits, LimitsOverride, Outcome,
    TierKind,
};
use strata_engine::TierChoice;
use utoipa::{OpenApi, ToSchema};

use crate::error::{ApiError, ErrorBody};
use crate::registry::{SandboxEntry, SnapshotEntry, new_id, unix_seconds};
pub use crate::service::JobRequest;
use crate::service::{
    CancelOnDrop, blocking, exec_in, kill_sandbox, limits, record_job, reserve, sandbox, start_sandbox, ttl,
};
use crate::{AppState, Principal};

/// The largest request body (files, jobs) the API accepts by default ([`crate::ConnectionLimits::max_body`]).
pub const MAX_BODY: usize = crate::connections::DEFAULT_MAX_BODY;

/// The most forks one request may make.
pub const MAX_FORKS: usize = 64;

type Shared = State<Arc<AppState>>;

/// The `/v1` routes that need an API key.
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/sandboxes", post(create_sandbox).get(list_sandboxes))
        .route("/v1/sandboxes/{id}", get(get_sandbox).delete(delete_sandbox))
        .route("/v1/sandboxes/{id}/exec", post(exec))
        .route("/v1/sandboxes/{id}/files", get(read_file).put(write_file))
        .route("/v1/sandboxes/{id}/files/list", get(list_files))
        .route("/v1/sandboxes/{id}/fork", post(fork_live))
        .route("/v1/sandboxes/{id}/timeout", post(set_timeout))
        .route("/v1/sandboxes/{id}/network", axum::routing::put(set_network))
        .route("/v1/sandboxes/{id}/pause", post(pause_sandbox))
        .route("/v1/sandboxes/{id}/resume", post(resume_sandbox))
        .route("/v1/sandboxes/{id}/metrics", get(metrics))
        .route("/v1/sandboxes/{id}/jobs", get(jobs))
        .route("/v1/images", get(list_images))
        .route("/v1/sandboxes/{id}/snapshot", post(snapshot))
        .route("/v1/sandboxes/{id}/ports/{port}", any(port))
        .route("/v1/sandboxes/{id}/ports/{port}/", any(port))
        .route("/v1/sandboxes/{id}/ports/{port}/{*path}", any(port))
        .route("/v1/snapshots", get(list_snapshots))
        .route("/v1/snapshots/{id}", axum::routing::delete(delete_snapshot))
        .route("/v1/snapshots/{id}/fork", post(fork))
        .route("/v1/snapshots/{id}/manifest", get(snapshot_manifest))
        .route("/v1/snapshots/{id}/file", get(snapshot_file))
        .route("/v1/run", post(run))
}

/// What a sandbox's jobs may touch.
#[derive(Debug, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct CapabilitiesRequest {
    /// Environment variables.
    pub env: BTreeMap<String, String>,
    /// Environment variables whose values are redacted from output (and never logged).
    pub secrets: BTreeMap<String, String>,
    /// Host directories, as `HOST:GUEST[:ro|:rw]`; refused unless the server runs with `--allow-grants`.
    pub grants: Vec<String>,
    /// Network egress allowed to these `HOST[:PORT]` patterns (added to the policy's).
    pub allow_net: Vec<String>,
    /// Secrets the sandbox never sees, by environment variable name (process tier): the variable holds a
    /// placeholder, and the egress proxy puts the value in its place in the headers of plain-HTTP requests to the
    /// secret's hosts (each inside the network allowlist), nowhere else.
    pub egress_secrets: BTreeMap<String, EgressSecretRequest>,
    /// The account of the sandbox's image its jobs run as (and who owns what the file calls create); the
    /// sandbox's root when absent. Process tier only (the image's `user`, uid 1000, has passwordless `sudo`).
    pub user: Option<String>,
}

/// One egress secret of [`CapabilitiesRequest::egress_secrets`].
#[derive(Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EgressSecretRequest {
    /// The value (never returned, logged or written to a snapshot).
    pub value: String,
    /// The `HOST[:PORT]` specs the value may be sent to (not port 443: the proxy does not terminate TLS).
    pub hosts: Vec<String>,
}

impl std::fmt::Debug for EgressSecretRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EgressSecretRequest").field("value", &"[REDACTED]").field("hosts", &self.hosts).finish()
    }
}

/// `POST /v1/sandboxes`.
#[derive(Debug, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct CreateSandboxRequest {
    /// `auto` (the default: wasm), `wasm`, `process` or `vm`.
    pub tier: Option<String>,
    /// What its jobs may touch (ignored with `snapshot`: a fork keeps the snapshot's).
    pub capabilities: CapabilitiesRequest,
    /// Limits of its jobs, over the policy's (`{"wall":"2s","memory":"256MiB"}`); none may exceed the policy's.
    #[schema(value_type = Object)]
    pub limits: LimitsOverride,
    /// Seconds it lives before the reaper kills it (default 300).
    pub ttl: Option<u64>,
    /// Start it as a fork of this snapshot (from `POST /v1/sandboxes/{id}/snapshot`).
    pub snapshot: Option<String>,
    /// Start it from this custom image (`strata images build` or `import`; process tier), with the image's
    /// defaults and its supervised start command.
    pub image: Option<String>,
}

/// `POST /v1/run`: a one-shot job in a fresh sandbox that is gone afterwards.
#[derive(Debug, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RunRequest {
    /// `auto` (the router picks), `wasm`, `process` or `vm`.
    pub tier: Option<String>,
    /// The job.
    pub job: JobRequest,
    /// What it may touch.
    pub capabilities: CapabilitiesRequest,
    /// Run it on this custom image (`strata images build` or `import`; process tier).
    pub image: Option<String>,
}

/// A sandbox as the API shows it.
#[derive(Debug, Serialize, ToSchema)]
pub struct SandboxInfo {
    /// Its id.
    pub id: String,
    /// `wasm`, `process` or `microvm`.
    pub tier: String,
    /// Created, in seconds since the Unix epoch.
    pub created_at: u64,
    /// When the reaper kills it, in seconds since the Unix epoch.
    pub expires_at: u64,
    /// Whether a job is running in it.
    pub running: bool,
    /// How many jobs are running in it.
    pub jobs_running: usize,
    /// Whether it runs jobs at the same time (process tier); elsewhere a request while a job runs is
    /// `409 sandbox_busy`.
    pub concurrent: bool,
    /// The host CPUs admission placed it on (bin-packing accounting; its jobs are not pinned to them).
    pub cpus: Vec<usize>,
    /// Its image's start command as its init supervises it (`state`, `restarts`, `pid`, `last_exit`,
    /// `log_tail`); shown by `GET /v1/sandboxes/{id}` for a sandbox that has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub service: Option<strata_core::ServiceStatus>,
    /// The image it was created from, when its request named one (else its tier's default).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Its memory limit, in bytes.
    pub memory_limit: u64,
    /// Its virtual CPUs.
    pub vcpus: u32,
    /// Its last resource sample (taken every few seconds), if one was taken.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<crate::usage::UsageSample>,
}

impl SandboxInfo {
    fn of(entry: &SandboxEntry) -> SandboxInfo {
        SandboxInfo {
            id: entry.id.clone(),
            tier: entry.tier.as_str().to_owned(),
            created_at: unix_seconds(entry.created),
            expires_at: entry.expires_at(),
            running: entry.is_running(),
            jobs_running: entry.jobs_running(),
            concurrent: entry.is_concurrent(),
            cpus: entry.cpus.clone(),
            service: None,
            image: entry.image.clone(),
            memory_limit: entry.limits.memory.0,
            vcpus: entry.limits.vcpus,
            usage: entry.usage.latest(),
        }
    }
}

/// `GET /v1/sandboxes`.
#[derive(Debug, Serialize, ToSchema)]
pub struct SandboxList {
    /// The caller's sandboxes, oldest first.
    pub sandboxes: Vec<SandboxInfo>,
    /// The caller's paused sandboxes, oldest pause first.
    pub paused: Vec<PausedInfo>,
}

/// A paused sandbox ([`crate::paused`]): its state kept as a snapshot under its id until resumed or deleted.
#[derive(Debug, Serialize, ToSchema)]
pub struct PausedInfo {
    /// Its id (the same once resumed).
    pub id: String,
    /// The tier it resumes on.
    pub tier: String,
    /// When it was first created (Unix seconds).
    pub created_at: u64,
    /// When it was paused (Unix seconds).
    pub paused_at: u64,
}

impl PausedInfo {
    fn of(paused: &crate::paused::PausedSandbox) -> PausedInfo {
        PausedInfo {
            id: paused.id.clone(),
            tier: paused.tier.as_str().to_owned(),
            created_at: crate::registry::unix_seconds(paused.created),
            paused_at: crate::registry::unix_seconds(paused.paused_at),
        }
    }
}

/// `POST /v1/sandboxes/{id}/resume`.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ResumeRequest {
    /// Seconds it lives from now (default: the server's TTL).
    pub ttl: Option<u64>,
}

/// `POST /v1/sandboxes/{id}/timeout`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TimeoutRequest {
    /// Seconds from now until the reaper kills the sandbox.
    pub timeout: u64,
}

/// `?path=` of the file endpoints.
#[derive(Debug, Deserialize)]
pub struct FileQuery {
    /// The guest path.
    pub path: String,
}

/// A snapshot as the API shows it.
#[derive(Debug, Serialize, ToSchema)]
pub struct SnapshotInfo {
    /// Its id.
    pub id: String,
    /// The tier it was taken on (forks run there).
    pub tier: String,
    /// The sandbox it was taken from.
    pub source: String,
    /// Taken, in seconds since the Unix epoch.
    pub created_at: u64,
}

impl SnapshotInfo {
    fn of(entry: &SnapshotEntry) -> SnapshotInfo {
        SnapshotInfo {
            id: entry.id.clone(),
            tier: entry.snapshot.tier.as_str().to_owned(),
            source: entry.source.clone(),
            created_at: unix_seconds(entry.created),
        }
    }
}

/// `GET /v1/snapshots`.
#[derive(Debug, Serialize, ToSchema)]
pub struct SnapshotList {
    /// The caller's snapshots, oldest first.
    pub snapshots: Vec<SnapshotInfo>,
}

/// `POST /v1/snapshots/{id}/fork`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// How many forks (1 to 64).
    #[serde(default = "one")]
    pub count: usize,
    /// Seconds each fork lives (default 300).
    #[serde(default)]
    pub ttl: Option<u64>,
}

fn one() -> usize {
    1
}

/// The forks made by `POST /v1/snapshots/{id}/fork`.
#[derive(Debug, Serialize, ToSchema)]
pub struct ForkResponse {
    /// The new sandboxes.
    pub sandboxes: Vec<SandboxInfo>,
}

/// The Outcome of a job, exactly as `strata run --json` prints it (docs/DESIGN.md §5).
#[derive(Debug, ToSchema)]
#[allow(dead_code)]
pub struct OutcomeDoc {
    /// `wasm`, `process` or `microvm`.
    tier: String,
    /// `{"kind":"exited","code":0}`, `{"kind":"limit_exceeded","limit":"wall"}`, `{"kind":"trapped"|"crashed",
    /// "message":…}`.
    #[schema(value_type = Object)]
    status: (),
    /// Captured stdout (base64 when `stdout_encoding` is `base64`).
    stdout: String,
    /// Captured stderr (base64 when `stderr_encoding` is `base64`).
    stderr: String,
    /// `{"stdout":bool,"stderr":bool}`.
    #[schema(value_type = Object)]
    truncated: (),
    /// `{"wall_ms","cpu_ms","fuel","peak_memory_bytes","stdout_bytes","stderr_bytes"}`.
    #[schema(value_type = Object)]
    usage: (),
    /// Tiers the job moved through.
    #[schema(value_type = Vec<Object>)]
    escalations: (),
    /// Tool frames.
    #[schema(value_type = Vec<Object>)]
    tools: (),
}

/// The OpenAPI document of the native API.
#[derive(OpenApi)]
#[openapi(
    info(title = "Strata sandbox API", description = "strata serve: sandboxes, jobs, files, snapshots and forks. \
        Connections are bounded before any request is routed or authenticated: a connection past the server's caps \
        per client address (`--max-connections-per-peer`) or in all (`--max-connections`) is answered 429 or 503 \
        `too_many_connections` and closed; a header must be whole within `--header-timeout` of its first byte, a \
        body within `--body-timeout` of its header (408 `body_timeout`) and no larger than `--max-body` (413 \
        `body_too_large`); a connection with no request in flight closes after `--keep-alive-timeout`, and one whose \
        client accepts no byte of a response for `--write-timeout` is cut off."),
    paths(
        create_sandbox, list_sandboxes, get_sandbox, delete_sandbox, exec, read_file, write_file, set_timeout, set_network,
        pause_sandbox, resume_sandbox,
        snapshot, list_snapshots, delete_snapshot, fork, snapshot_manifest, snapshot_file, run, fork_live, jobs,
        list_images, list_files, port, metrics, crate::pty::create,
        crate::pty::list, crate::pty::resize, crate::pty::kill, crate::pty::attach
    ),
    components(schemas(
        CapabilitiesRequest, CreateSandboxRequest, JobRequest, RunRequest, SandboxInfo, SandboxList, TimeoutRequest,
        SnapshotInfo, SnapshotList, ForkRequest, ForkResponse, OutcomeDoc, ErrorBody, crate::error::ErrorDetail,
        LiveForkResponse, FileEntry, FileList, MetricsList, JobList, crate::jobs::JobRecord, ImageList, ImageInfo, crate::usage::UsageSample, crate::pty::PtyRequest, crate::pty::PtyInfo, crate::pty::PtyList,
        crate::pty::ResizeRequest, NetworkRequest, PausedInfo, ResumeRequest, EgressSecretRequest
    )),
    modifiers(&BearerAuth, &BodyLimits),
    security(("api_key" = []))
)]
#[derive(Debug)]
pub struct ApiDoc;

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "api_key",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// Documents the 408 and 413 answers of every operation that takes a body.
struct BodyLimits;

impl utoipa::Modify for BodyLimits {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::{ContentBuilder, Ref, RefOr, ResponseBuilder};
        let answers = [
            ("408", "the body did not arrive whole within the server's body timeout (`body_timeout`)"),
            ("413", "the body is larger than the server accepts (`body_too_large`)"),
        ];
        for item in openapi.paths.paths.values_mut() {
            for operation in [&mut item.put, &mut item.post].into_iter().flatten() {
                if operation.request_body.is_none() {
                    continue;
                }
                for (status, description) in answers {
                    let content = ContentBuilder::new().schema(Some(Ref::from_schema_name("ErrorBody"))).build();
                    let response = ResponseBuilder::new().description(description).content("application/json", content);
                    operation.responses.responses.entry(status.to_owned()).or_insert(RefOr::T(response.build()));
                }
            }
        }
    }
}

/// `GET /v1/openapi.json`.
pub async fn openapi() -> impl IntoResponse {
    Json(ApiDoc::openapi())
}

fn json<T>(body: Result<Json<T>, JsonRejection>) -> Result<T, ApiError> {
    body.map(|Json(v)| v).map_err(ApiError::from)
}

fn tier_choice(tier: Option<&str>) -> Result<TierChoice, ApiError> {
    tier.unwrap_or("auto").parse::<TierChoice>().map_err(ApiError::from)
}

/// A request's `image`, checked.
pub(crate) fn image_name(image: Option<&str>) -> Result<Option<strata_core::ImageName>, ApiError> {
    image
        .map(|name| {
            strata_core::ImageName::new(name).map_err(|e| ApiError::bad_request("invalid_image", e.to_string()))
        })
        .transpose()
}

/// The capabilities of a request, checked.
pub(crate) fn capabilities(state: &AppState, req: &CapabilitiesRequest) -> Result<Capabilities, ApiError> {
    let invalid = |message: String| ApiError::bad_request("invalid_capability", message);
    let var = |name: &str, value: &str| {
        if name.is_empty() || name.contains(['=', '\0']) || value.contains('\0') {
            return Err(invalid(format!("invalid environment variable name {name:?} (or a NUL in its value)")));
        }
        Ok(EnvVar { name: name.to_owned(), value: value.to_owned() })
    };
    let env = req.env.iter().map(|(k, v)| var(k, v)).collect::<Result<Vec<_>, _>>()?;
    let secrets = req.secrets.iter().map(|(k, v)| var(k, v)).collect::<Result<Vec<_>, _>>()?;
    if !req.grants.is_empty() && !state.allow_grants {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "grants_not_allowed",
            "this server does not grant host directories (start it with --allow-grants)",
        ));
    }
    let grants = req
        .grants
        .iter()
        .map(|spec| spec.parse::<Grant>().map_err(|e| invalid(e.to_string())))
        .collect::<Result<Vec<_>, _>>()?;
    let allow_net = strata_core::Allowlist::parse(&req.allow_net).map_err(|e| invalid(e.to_string()))?;
    let user = req.user.as_deref().map(crate::service::parse_user).transpose()?;
    let egress_secrets = req
        .egress_secrets
        .iter()
        .map(|(name, s)| strata_core::EgressSecret::new(name, &s.value, &s.hosts).map_err(|e| invalid(e.to_string())))
        .collect::<Result<Vec<_>, _>>()?;
    let caps = Capabilities {
        grants,
        env,
        secrets,
        egress_secrets,
        net: state.policy.network.net_with(&allow_net),
        user,
        ..Capabilities::default()
    };
    caps.validate().map_err(|e| invalid(e.to_string()))?;
    Ok(caps)
}

#[utoipa::path(post, path = "/v1/sandboxes", tag = "sandboxes", request_body = CreateSandboxRequest,
    responses((status = 201, body = SandboxInfo), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 429, body = ErrorBody), (status = 503, body = ErrorBody)))]
async fn create_sandbox(
    State(state): Shared,
    Extension(principal): Extension<Principal>,
    body: Result<Json<CreateSandboxRequest>, JsonRejection>,
) -> Result<(StatusCode, Json<SandboxInfo>), ApiError> {
    let req = json(body)?;
    let choice = tier_choice(req.tier.as_deref())?;
    let limits = limits(&state, state.engine.default_limits(), &req.limits)?;
    let ttl = ttl(&state, req.ttl)?;
    let entry = match &req.snapshot {
        Some(id) => {
            let snapshot = state.registry.snapshot(id, &principal.name)?;
            let mut forks = fork_sandboxes(&state, &principal, snapshot, choice, 1, limits, ttl).await?;
            forks.pop().ok_or_else(|| ApiError::internal("the fork made no sandbox"))?
        }
        None => {
            let caps =
                Capabilities { image: image_name(req.image.as_deref())?, ..capabilities(&state, &req.capabilities)? };
            start_sandbox(&state, &principal, choice, caps, limits, ttl).await?
        }
    };
    Ok((StatusCode::CREATED, Json(SandboxInfo::of(&entry))))
}

/// `?start=&end=` of a metrics request: Unix seconds, either open.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
struct MetricsQuery {
    /// The earliest sample, in seconds since the Unix epoch.
    start: Option<f64>,
    /// The latest sample, in seconds since the Unix epoch.
    end: Option<f64>,
}

/// A sandbox's resource use over time.
#[derive(Debug, Serialize, ToSchema)]
pub struct MetricsList {
    /// Samples, oldest first: one every 5 s for the last hour, and one taken for this request.
    pub samples: Vec<crate::usage::UsageSample>,
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/metrics", tag = "sandboxes", params(MetricsQuery),
    responses((status = 200, body = MetricsList), (status = 404, body = ErrorBody),
        (status = 501, body = ErrorBody, description = "the sandbox's tier does not measure its use (wasm, microVM)")))]
async fn metrics(
    State(state): Shared,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    query: Result<Query<MetricsQuery>, QueryRejection>,
) -> Result<Json<MetricsList>, ApiError> {
    let Query(query) = query?;
    let entry = sandbox(&state, &principal, &id)?;
    let sampled = entry.clone();
    blocking(move || sampled.sample_usage()).await?;
    Ok(Json(MetricsList { samples: entry.usage.between(query.start, query.end) }))
}

#[utoipa::path(get, path = "/v1/sandboxes", tag = "sandboxes", responses((status = 200, body = SandboxList)))]
async fn list_sandboxes(State(state): Shared, Extension(principal): Extension<Principal>) -> Json<SandboxList> {
    let sandboxes = state.registry.list(Some(&principal.name)).iter().map(|e| SandboxInfo::of(e)).collect();
    let paused = state.paused.list(&principal.name).iter().map(|p| PausedInfo::of(p)).collect();
    Json(SandboxList { sandboxes, paused })
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/pause", tag = "sandboxes",
    responses((status = 200, body = PausedInfo, description = "paused: what its tier snapshots (the process tier: its \
        filesystem) is kept under its id"), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "a job or file call did not end within 10 s"),
        (status = 429, body = ErrorBody), (status = 501, body = ErrorBody)))]
async fn pause_sandbox(
    State(state): Shared,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<PausedInfo>, ApiError> {
    let paused = crate::paused::pause(&state, &principal, &id).await?;
    Ok(Json(PausedInfo::of(&paused)))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/resume", tag = "sandboxes", request_body = ResumeRequest,
    responses((status = 200, body = SandboxInfo, description = "running again, under the same id"),
        (status = 404, body = ErrorBody), (status = 429, body = ErrorBody)))]
async fn resume_sandbox(
    State(state): Shared,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    body: Result<Json<ResumeRequest>, JsonRejection>,
) -> Result<Json<SandboxInfo>, ApiError> {
    let req = json(body)?;
    let ttl = ttl(&state, req.ttl)?;
    let entry = crate::paused::resume(&state, &principal, &id, ttl).await?;
    Ok(Json(SandboxInfo::of(&entry)))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}", tag = "sandboxes",
    responses((status = 200, body = SandboxInfo), (status = 404, body = ErrorBody)))]
async fn get_sandbox(
    State(state): Shared,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<SandboxInfo>, ApiError> {
    let entry = sandbox(&state, &principal, &id)?;
    let mut info = SandboxInfo::of(&entry);
    // Only the process tier runs services: the others answer without a round trip.
    if entry.tier == strata_core::TierKind::Process {
        info.service = tokio::task::spawn_blocking(move || entry.service()).await.ok().flatten();
    }
    Ok(Json(info))
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}", tag = "sandboxes",
    responses((status = 204), (status = 404, body = ErrorBody)))]
async fn delete_sandbox(
    State(state): Shared,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    // A paused one is deleted with its snapshot.
    let deleted = {
        let state = state.clone();
        let (id, owner) = (id.clone(), principal.name.clone());
        blocking(move || Ok::<_, ApiError>(state.paused.delete(&id, &owner))).await?
    };
    if deleted {
        state.e2b.forget_paused(&id);
        return Ok(StatusCode::NO_CONTENT);
    }
    kill_sandbox(&state, &principal, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/exec", tag = "jobs", request_body = JobRequest,
    responses((status = 200, body = OutcomeDoc, description = "the Outcome, as `strata run --json` prints it"),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
async fn exec(
    State(state): Shared,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    body: Result<Json<JobRequest>, JsonRejection>,
) -> Result<Json<Outcome>, ApiError> {
    state.admit()?;
    let req = json(body)?;
    let entry = sandbox(&state, &principal, &id)?;
    let job = req.to_job()?;
    let limits = limits(&state, &entry.limits, &req.limits)?;
    let user = req.user()?;
    let opts =
        ExecOptions { limits: Some(limits), stdin: req.stdin.map(String::into_bytes), user, ..ExecOptions::default() };
    Ok(Json(exec_in(&state, entry, job, opts).await?))
}

#[utoipa::path(post, path = "/v1/run", tag = "jobs", request_body = RunRequest,
    responses((status = 200, body = OutcomeDoc, description = "the Outcome, as `strata run --json` prints it"),
        (status = 400, body = ErrorBody), (status = 429, body = ErrorBody)))]
async fn run(
    State(state): Shared,
    Extension(principal): Extension<Principal>,
    body: Result<Json<RunRequest>, JsonRejection>,
) -> Result<Json<Outcome>, ApiError> {
    let req = json(body)?;
    let choice = tier_choice(req.tier.as_deref())?;
    let job = req.job.to_job()?;
    let caps = Capabilities { image: image_name(req.image.as_deref())?, ..capabilities(&state, &req.capabilities)? };
    let limits = limits(&state, state.engine.default_limits(), &req.job.limits)?;
    let _reservation = reserve(&state, &principal, 1, &limits)?;
    let token = CancelToken::new();
    let mut guard = CancelOnDrop(Some(token.clone()));
    let user = req.job.user()?;
    let opts = ExecOptions {
        stdin: req.job.stdin.map(String::into_bytes),
        cancel: Some(token),
        user,
        ..ExecOptions::default()
    };
    let engine = state.engine.clone();
    let started = Instant::now();
    let result = blocking(move || {
        let request = strata_engine::RunRequest::new(&job).caps(&caps).limits(limits).tier(choice).options(opts);
        engine.execute(request).map_err(ApiError::from)
    })
    .await;
    guard.0 = None;
    let tier = match choice {
        TierChoice::Tier(tier) => tier,
        TierChoice::Auto => TierKind::Wasm,
    };
    record_job(&state, tier, "run", started, &result);
    Ok(Json(result?))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/files", tag = "files", params(("path" = String, Query)),
    responses((status = 200, content_type = "application/octet-stream", body = Vec<u8>),
        (status = 404, body = ErrorBody)))]
async fn read_file(
    State(state): Shared,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    query: Result<Query<FileQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(query) = query?;
    let entry = sandbox(&state, &principal, &id)?;
    let bytes = crate::service::read_file(&state, entry, query.path).await?;
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], bytes).into_response())
}

#[utoipa::path(put, path = "/v1/sandboxes/{id}/files", tag = "files", params(("path" = String, Query)),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 204), (status = 404, body = ErrorBody)))]
async fn write_file(
    State(state): Shared,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    query: Result<Query<FileQuery>, QueryRejection>,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<StatusCode, ApiError> {
    state.admit()?;
    let Query(query) = query?;
    let body = body?;
    let entry = sandbox(&state, &principal, &id)?;
    crate::service::write_file(&state, entry, query.path, body.to_vec()).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/timeout", tag = "sandboxes", request_body = TimeoutRequest,
    responses((status = 204), (status = 404, body = ErrorBody)))]
async fn set_timeout(
    State(state): Shared,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    body: Result<Json<TimeoutRequest>, JsonRejection>,
) -> Result<StatusCode, ApiError> {
    let req = json(body)?;
    let entry = sandbox(&state, &principal, &id)?;
    entry.set_ttl(ttl(&state, Some(req.timeout))?);
    Ok(StatusCode::NO_CONTENT)
}

/// `PUT /v1/sandboxes/{id}/network`: the egress allowlist from now on.
#[derive(Debug, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct NetworkRequest {
    /// `HOST[:PORT]` patterns the sandbox's jobs may reach, over the policy's (empty: the policy's only). Replaces
    /// what the sandbox was created or last updated with; connections already made go on.
    pub allow_net: Vec<String>,
}

#[utoipa::path(put, path = "/v1/sandboxes/{id}/network", tag = "sandboxes", request_body = NetworkRequest,
    responses((status = 204), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 501, body = ErrorBody, description = "the sandbox was created without a network, or its tier \
            cannot change it")))]
async fn set_network(
    State(state): Shared,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    body: Result<Json<NetworkRequest>, JsonRejection>,
) -> Result<StatusCode, ApiError> {
    let req = json(body)?;
    let allow = strata_core::Allowlist::parse(&req.allow_net)
        .map_err(|e| ApiError::bad_request("invalid_capability", e.to_string()))?;
    let net = state.policy.network.net_with(&allow);
    let entry = sandbox(&state, &principal, &id)?;
    blocking(move || entry.call(|sandbox| sandbox.set_network(&net))).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/snapshot", tag = "snapshots",
    responses((status = 201, body = SnapshotInfo), (status = 404, body = ErrorBody), (status = 501, body = ErrorBody)))]
async fn snapshot(
    State(state): Shared,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<(StatusCode, Json<SnapshotInfo>), ApiError> {
    let entry = take_snapshot(&state, &principal, id).await?;
    Ok((StatusCode::CREATED, Json(SnapshotInfo::of(&entry))))
}

/// Snapshots the sandbox `id` into the server's snapshot directory and registers the snapshot.
async fn take_snapshot(
    state: &Arc<AppState>,
    principal: &Principal,
    id: String,
) -> Result<Arc<SnapshotEntry>, ApiError> {
    state.admit()?;
    let entry = sandbox(state, principal, &id)?;
    let snap_id = new_id("snap_");
    let dir = state.snapshot_dir.join(&snap_id);
    let started = Instant::now();
    let tier = entry.tier;
    let target = dir.clone();
    let snapshot = blocking(move || entry.snapshot(&target)).await?;
    state.metrics.latency(tier.as_str(), "snapshot", started.elapsed());
    let entry = state.registry.add_snapshot(SnapshotEntry {
        id: snap_id,
        owner: principal.name.clone(),
        source: id,
        created: std::time::SystemTime::now(),
        snapshot,
        dir,
    });
    crate::fleet::snapshots::hold(state, &entry.id).await;
    Ok(entry)
}

/// The forks made by `POST /v1/sandboxes/{id}/fork`, and the snapshot they were made from.
#[derive(Debug, Serialize, ToSchema)]
pub struct LiveForkResponse {
    /// The snapshot taken of the live sandbox (kept until deleted or the server stops; fork it again at will).
    pub snapshot: SnapshotInfo,
    /// The new sandboxes.
    pub sandboxes: Vec<SandboxInfo>,
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/fork", tag = "snapshots", request_body = ForkRequest,
    responses((status = 201, body = LiveForkResponse), (status = 404, body = ErrorBody),
        (status = 429, body = ErrorBody), (status = 501, body = ErrorBody)))]
async fn fork_live(
    State(state): Shared,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    body: Result<Json<ForkRequest>, JsonRejection>,
) -> Result<(StatusCode, Json<LiveForkResponse>), ApiError> {
    let req = json(body)?;
    if req.count == 0 || req.count > MAX_FORKS {
        return Err(ApiError::bad_request("invalid_count", format!("count must be between 1 and {MAX_FORKS}")));
    }
    let ttl = ttl(&state, req.ttl)?;
    let limits = sandbox(&state, &principal, &id)?.limits.clone();
    let snapshot = take_snapshot(&state, &principal, id).await?;
    let info = SnapshotInfo::of(&snapshot);
    let forks = fork_sandboxes(&state, &principal, snapshot, TierChoice::Auto, req.count, limits, ttl).await?;
    let sandboxes = forks.iter().map(|e| SandboxInfo::of(e)).collect();
    Ok((StatusCode::CREATED, Json(LiveForkResponse { snapshot: info, sandboxes })))
}

/// `GET /v1/sandboxes/{id}/jobs`.
#[derive(Debug, Serialize, ToSchema)]
pub struct JobList {
    /// The sandbox's last jobs (at most 32), oldest first, with the ends of their output and their egress.
    pub jobs: Vec<crate::jobs::JobRecord>,
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/jobs", tag = "sandboxes",
    responses((status = 200, body = JobList), (status = 404, body = ErrorBody)))]
async fn jobs(
    State(state): Shared,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<JobList>, ApiError> {
    let entry = sandbox(&state, &principal, &id)?;
    Ok(Json(JobList { jobs: entry.jobs.list() }))
}

/// One image of the server's store, or a template naming one.
#[derive(Debug, Serialize, ToSchema)]
pub struct ImageInfo {
    /// Its name (what `image` in a create names).
    pub name: String,
    /// Where it came from (`dockerfile`, `oci`, …), as the store records it.
    #[schema(value_type = Object)]
    pub source: serde_json::Value,
    /// When it was made (RFC 3339).
    pub created: String,
    /// Its layers.
    pub layers: usize,
    /// The E2B template names that stand for it (`--template NAME=IMAGE`).
    pub templates: Vec<String>,
}

/// `GET /v1/images`.
#[derive(Debug, Serialize, ToSchema)]
pub struct ImageList {
    /// The images of the server's store, by name.
    pub images: Vec<ImageInfo>,
}

#[utoipa::path(get, path = "/v1/images", tag = "images", responses((status = 200, body = ImageList)))]
async fn list_images(State(state): Shared) -> Result<Json<ImageList>, ApiError> {
    let templates = state.templates.clone();
    let engine = state.engine.clone();
    let records = blocking(move || {
        let store = engine.image_store().map_err(ApiError::from)?;
        store.list().map_err(|e| ApiError::internal(format!("listing the images: {e}")))
    })
    .await?;
    let images = records
        .into_iter()
        .map(|record| ImageInfo {
            name: record.name.to_string(),
            source: serde_json::to_value(&record.source).unwrap_or_default(),
            created: record.created.clone(),
            layers: record.layers.len(),
            templates: templates.iter().filter(|(_, image)| **image == record.name).map(|(t, _)| t.clone()).collect(),
        })
        .collect();
    Ok(Json(ImageList { images }))
}

/// One entry of a directory listing.
#[derive(Debug, Serialize, ToSchema)]
pub struct FileEntry {
    /// The entry's name in the directory.
    pub name: String,
    /// `file`, `dir`, `symlink` or `other` (a link is not followed).
    #[serde(rename = "type")]
    #[schema(value_type = String)]
    pub kind: FileType,
    /// Size in bytes.
    pub size: u64,
}

/// `GET /v1/sandboxes/{id}/files/list`.
#[derive(Debug, Serialize, ToSchema)]
pub struct FileList {
    /// The directory's entries, by name.
    pub entries: Vec<FileEntry>,
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/list", tag = "files", params(("path" = String, Query)),
    responses((status = 200, body = FileList), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 501, body = ErrorBody)))]
async fn list_files(
    State(state): Shared,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    query: Result<Query<FileQuery>, QueryRejection>,
) -> Result<Json<FileList>, ApiError> {
    let Query(query) = query?;
    let path = GuestPath::new(&query.path).map_err(|e| ApiError::bad_request("invalid_query", e.to_string()))?;
    let entry = sandbox(&state, &principal, &id)?;
    let listed = crate::service::list_dir(&state, entry, path, 1).await?;
    let entries = listed.into_iter().map(|info| FileEntry { name: info.name, kind: info.file_type, size: info.size });
    Ok(Json(FileList { entries: entries.collect() }))
}

#[utoipa::path(get, path = "/v1/snapshots", tag = "snapshots", responses((status = 200, body = SnapshotList)))]
async fn list_snapshots(State(state): Shared, Extension(principal): Extension<Principal>) -> Json<SnapshotList> {
    Json(SnapshotList {
        snapshots: state.registry.snapshots(&principal.name).iter().map(|s| SnapshotInfo::of(s)).collect(),
    })
}

#[utoipa::path(delete, path = "/v1/snapshots/{id}", tag = "snapshots",
    responses((status = 204), (status = 404, body = ErrorBody)))]
async fn delete_snapshot(
    State(state): Shared,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let entry = state.registry.remove_snapshot(&id, &principal.name)?;
    crate::fleet::snapshots::release(&state, &id).await;
    blocking(move || {
        std::fs::remove_dir_all(&entry.dir)
            .map_err(|e| ApiError::internal(format!("cannot remove snapshot {}: {e}", entry.id)))
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/v1/snapshots/{id}/manifest", tag = "snapshots",
    responses((status = 200, description = "the snapshot's sealed manifest (JSON: format, tier, files with their \
        sizes and sha256, meta): what a node of a fleet fetching the snapshot checks the files against"),
        (status = 404, body = ErrorBody)))]
async fn snapshot_manifest(
    State(state): Shared,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let entry = state.registry.snapshot(&id, &principal.name)?;
    Ok(([(header::CONTENT_TYPE, "application/json")], entry.snapshot.manifest.to_json()).into_response())
}

/// `GET /v1/snapshots/{id}/file?path=…`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotFileQuery {
    /// A file the manifest lists.
    pub path: String,
}

#[utoipa::path(get, path = "/v1/snapshots/{id}/file", tag = "snapshots", params(("path" = String, Query,
        description = "a file the manifest lists")),
    responses((status = 200, description = "the file's bytes, as verified when the snapshot was opened"),
        (status = 404, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn snapshot_file(
    State(state): Shared,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    query: Result<Query<SnapshotFileQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(query) = query?;
    let entry = state.registry.snapshot(&id, &principal.name)?;
    let Some(size) = entry.snapshot.listed(&query.path).map(|f| f.size) else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "file_not_found",
            format!("snapshot {id} lists no file {:?}", query.path),
        ));
    };
    let path = query.path.clone();
    let file = blocking(move || entry.snapshot.open_file(&path).map_err(ApiError::from)).await?;
    let body = crate::fleet::snapshots::file_body(file);
    Ok(([(header::CONTENT_TYPE, "application/octet-stream"), (header::CONTENT_LENGTH, &size.to_string())], body)
        .into_response())
}

#[utoipa::path(post, path = "/v1/snapshots/{id}/fork", tag = "snapshots", request_body = ForkRequest,
    responses((status = 201, body = ForkResponse), (status = 404, body = ErrorBody), (status = 429, body = ErrorBody)))]
async fn fork(
    State(state): Shared,
    Extension(principal): Extension<Principal>,
    remote: Option<Extension<crate::fleet::snapshots::RemoteSnapshot>>,
    headers: axum::http::HeaderMap,
    Path(id): Path<String>,
    body: Result<Json<ForkRequest>, JsonRejection>,
) -> Result<(StatusCode, Json<ForkResponse>), ApiError> {
    let req = json(body)?;
    if req.count == 0 || req.count > MAX_FORKS {
        return Err(ApiError::bad_request("invalid_count", format!("count must be between 1 and {MAX_FORKS}")));
    }
    let ttl = ttl(&state, req.ttl)?;
    // A snapshot another node of the fleet holds, which has no room for the forks: fetched and forked here.
    let snapshot = match (state.registry.snapshot(&id, &principal.name), remote) {
        (Err(_), Some(Extension(remote))) => {
            crate::fleet::snapshots::fetch(&state, &principal, &headers, &id, &remote.advertise).await?
        }
        (found, _) => found?,
    };
    let limits = state.engine.default_limits().clone();
    let forks = fork_sandboxes(&state, &principal, snapshot, TierChoice::Auto, req.count, limits, ttl).await?;
    Ok((StatusCode::CREATED, Json(ForkResponse { sandboxes: forks.iter().map(|e| SandboxInfo::of(e)).collect() })))
}

/// Starts `count` forks of a snapshot, all or none.
async fn fork_sandboxes(
    state: &Arc<AppState>,
    principal: &Principal,
    snapshot: Arc<SnapshotEntry>,
    choice: TierChoice,
    count: usize,
    limits: Limits,
    ttl: Duration,
) -> Result<Vec<Arc<SandboxEntry>>, ApiError> {
    let mut reservation = reserve(state, principal, count, &limits)?;
    let ids: Vec<String> = (0..count).map(|_| new_id("sb_")).collect();
    for (i, id) in ids.iter().enumerate() {
        if let Err(err) = crate::service::fleet_reserve(state, id, &limits).await {
            for id in &ids[..i] {
                crate::service::fleet_abandon(state, id);
            }
            return Err(err);
        }
    }
    let engine = state.engine.clone();
    let started = Instant::now();
    let forked = blocking(move || {
        let mut sandboxes = Vec::with_capacity(count);
        for _ in 0..count {
            match engine.fork(choice, &snapshot.snapshot) {
                Ok(sandbox) => sandboxes.push(sandbox),
                Err(err) => {
                    for sandbox in sandboxes {
                        let _ = sandbox.close();
                    }
                    return Err(ApiError::from(err));
                }
            }
        }
        Ok(sandboxes)
    })
    .await;
    let sandboxes = match forked {
        Ok(sandboxes) => sandboxes,
        Err(err) => {
            for id in &ids {
                crate::service::fleet_abandon(state, id);
            }
            return Err(err);
        }
    };
    let mut entries = Vec::with_capacity(count);
    for (sandbox, id) in sandboxes.into_iter().zip(ids) {
        let tier = sandbox.tier();
        state.metrics.sandbox_created(tier);
        state.metrics.latency(tier.as_str(), "fork", started.elapsed() / count as u32);
        let entry = reservation.commit(SandboxEntry::new(id, principal.name.clone(), sandbox, limits.clone(), ttl));
        crate::service::fleet_follow(state, &entry);
        entries.push(entry);
    }
    Ok(entries)
}

/// Entry points of the fuzz targets (`fuzz/`): the parsers a client feeds, reachable without a server.
#[doc(hidden)]
pub mod fuzzing;

/// Any method and path under it, forwarded to `127.0.0.1:{port}` inside the sandbox as `/{path}?{query}` with
/// `Host: 127.0.0.1:{port}`, its answer streamed back; a WebSocket upgrade is joined through. The server's
/// credentials are not passed on. 502 `port_closed` when nothing accepts there, 501 on a tier without a network
/// of its own (wasm), 503 `too_many_connections` past 64 open connections of the sandbox.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/ports/{port}/{path}", tag = "ports",
    params(("id" = String, Path), ("port" = u16, Path), ("path" = String, Path, description = "the path inside the sandbox")),
    responses((status = 200, description = "the sandbox's server's answer"), (status = 101, description = "a WebSocket joined through"),
        (status = 502, body = ErrorBody), (status = 501, body = ErrorBody)))]
async fn port(
    State(state): Shared,
    Extension(principal): Extension<Principal>,
    Path(params): Path<Vec<(String, String)>>,
    request: axum::http::Request<axum::body::Body>,
) -> Result<Response, ApiError> {
    let param = |name: &str| params.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str()).unwrap_or("");
    let (id, port) = (param("id"), crate::ports::parse_port(param("port"))?);
    let entry = sandbox(&state, &principal, id)?;
    // The raw path after `/ports/{port}` (still percent-encoded, as the client sent it), and the query.
    let prefix = format!("/v1/sandboxes/{id}/ports/{}", param("port"));
    let rest = request.uri().path().strip_prefix(prefix.as_str()).unwrap_or("/");
    let rest = if rest.is_empty() { "/" } else { rest };
    let target = match request.uri().query() {
        Some(query) => format!("{rest}?{query}"),
        None => rest.to_owned(),
    };
    crate::ports::proxy(entry, port, &target, crate::ports::HostHeader::Local, request).await
}
