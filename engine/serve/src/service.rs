//! What the native API ([`crate::api`]), its WebSocket ([`crate::ws`]) and the E2B layer ([`crate::e2b`]) do alike:
//! check limits and TTLs, admit, start, kill and run jobs in sandboxes of the registry, and make their filesystem
//! calls (the tier's own methods: files, listings, watches), on threads of their own, with the metrics counted. None of those layers calls another; each calls this one.

use std::io::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use strata_core::{
    CancelToken, Capabilities, EntryInfo, ExecOptions, Fuel, GuestPath, Job, Limits, LimitsOverride, Outcome,
    PythonSource, Sandbox, StdinStream, TierError, TierKind, UserName, Watcher,
};
use strata_engine::TierChoice;
use tokio::sync::mpsc;
use utoipa::ToSchema;

use crate::error::ApiError;
use crate::metrics::outcome_label;
use crate::registry::{Reservation, SandboxEntry, new_id};
use crate::{AppState, Principal};

/// A job: exactly one of `command` or `python`.
#[derive(Debug, Default, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct JobRequest {
    /// A program of the guest image and its arguments (`["ls","-l","/"]`; process and microVM tiers).
    pub command: Option<Vec<String>>,
    /// Python source, as `python -c CODE`.
    pub python: Option<String>,
    /// `sys.argv[1:]` of a Python job.
    pub args: Vec<String>,
    /// Text the job reads on stdin.
    pub stdin: Option<String>,
    /// Limits of this job, over the sandbox's.
    #[schema(value_type = Object)]
    pub limits: LimitsOverride,
    /// WebSocket only: the client's messages after this one are the job's stdin as it runs, up to an empty message
    /// (EOF). The job reads each as it arrives, on every tier.
    pub stdin_stream: bool,
    /// Run it as this account of the sandbox's image (`root`: the sandbox's root) instead of the sandbox's user;
    /// process tier only.
    pub user: Option<String>,
}

impl JobRequest {
    /// The account it asks to run as, checked.
    pub fn user(&self) -> Result<Option<UserName>, ApiError> {
        self.user.as_deref().map(parse_user).transpose()
    }

    /// The engine's job.
    pub fn to_job(&self) -> Result<Job, ApiError> {
        let invalid = |message: &str| ApiError::bad_request("invalid_job", message);
        match (&self.command, &self.python) {
            (Some(argv), None) => {
                if argv.first().is_none_or(|program| program.is_empty()) {
                    return Err(invalid("command must name a program"));
                }
                if argv.iter().any(|a| a.contains('\0')) {
                    return Err(invalid("command arguments must not contain NUL"));
                }
                if !self.args.is_empty() {
                    return Err(invalid("args belong to python jobs; put a command's arguments in command"));
                }
                Ok(Job::Command { argv: argv.clone() })
            }
            (None, Some(code)) => Ok(Job::Python { source: PythonSource::Code(code.clone()), args: self.args.clone() }),
            (Some(_), Some(_)) => Err(invalid("a job is either command or python, not both")),
            (None, None) => Err(invalid("a job needs command or python")),
        }
    }
}

/// An account name of a request.
pub(crate) fn parse_user(name: &str) -> Result<UserName, ApiError> {
    UserName::new(name).map_err(|e| ApiError::bad_request("invalid_user", e.to_string()))
}

/// Runs `f` on a thread of its own and waits for it without blocking the runtime. Not tokio's blocking pool: its
/// threads carry the runtime's context, and the wasm tier refuses to run a sandbox's job on such a thread.
pub(crate) async fn blocking<T, E>(f: impl FnOnce() -> Result<T, E> + Send + 'static) -> Result<T, ApiError>
where
    T: Send + 'static,
    E: Send + 'static,
    ApiError: From<E>,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("strata-serve-job".into())
        .spawn(move || {
            let _ = tx.send(f());
        })
        .map_err(|e| ApiError::internal(format!("cannot start a worker thread: {e}")))?;
    Ok(rx.await.map_err(|_| ApiError::internal("the worker thread panicked"))??)
}

/// Cancels a job when the request's future is dropped (the client went away) before the job finished.
pub(crate) struct CancelOnDrop(pub(crate) Option<CancelToken>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(token) = self.0.take() {
            token.cancel();
        }
    }
}

/// `over` applied to `base`, refused when a limit exceeds the policy's.
pub(crate) fn limits(state: &AppState, base: &Limits, over: &LimitsOverride) -> Result<Limits, ApiError> {
    let limits = over.apply(base);
    let ceiling = &state.policy.limits;
    let fuel_over = match (limits.fuel, ceiling.fuel) {
        (_, Fuel::Unlimited) => false,
        (Fuel::Unlimited, Fuel::Limited(_)) => true,
        (Fuel::Limited(asked), Fuel::Limited(max)) => asked > max,
    };
    let over = [
        ("wall", limits.wall > ceiling.wall),
        ("cpu", limits.cpu > ceiling.cpu),
        ("fuel", fuel_over),
        ("memory", limits.memory.0 > ceiling.memory.0),
        ("output", limits.output.0 > ceiling.output.0),
        ("vcpus", limits.vcpus > ceiling.vcpus),
        ("disk", limits.disk.0 > ceiling.disk.0),
        ("pids", limits.pids > ceiling.pids),
        ("files", limits.files > ceiling.files),
    ];
    if let Some((name, _)) = over.iter().find(|(_, over)| *over) {
        return Err(ApiError::bad_request("limit_too_high", format!("the {name} limit exceeds the server policy's")));
    }
    Ok(limits)
}

/// A TTL in seconds, checked against the server's maximum.
pub(crate) fn ttl(state: &AppState, seconds: Option<u64>) -> Result<Duration, ApiError> {
    let ttl = seconds.map(Duration::from_secs).unwrap_or(state.default_ttl);
    if ttl.is_zero() || ttl > state.max_ttl {
        return Err(ApiError::bad_request(
            "invalid_ttl",
            format!("ttl must be between 1 and {} seconds", state.max_ttl.as_secs()),
        ));
    }
    Ok(ttl)
}

/// Counts a job's result.
pub(crate) fn record_job(
    state: &AppState,
    tier: TierKind,
    op: &'static str,
    started: Instant,
    result: &Result<Outcome, ApiError>,
) {
    match result {
        Ok(outcome) => {
            state.metrics.job(outcome.tier, outcome_label(outcome));
            state.metrics.latency(outcome.tier.as_str(), op, started.elapsed());
        }
        Err(_) => state.metrics.job(tier, "error"),
    }
}

/// Admits `places` new sandboxes with these limits for `principal`.
pub(crate) fn reserve(
    state: &AppState,
    principal: &Principal,
    places: usize,
    limits: &Limits,
) -> Result<Reservation, ApiError> {
    state.admit()?;
    state.registry.reserve(principal, places, limits).map_err(|err| {
        state.metrics.rejected(err.reason());
        ApiError::from(err)
    })
}

/// In a fleet, reserves and confirms sandbox `id` on this node (made here for a reason of its own: a fork of a
/// snapshot this node holds, a resume), so that every node finds it and placement counts it; nothing without one.
pub(crate) async fn fleet_reserve(state: &AppState, id: &str, limits: &Limits) -> Result<(), ApiError> {
    match &state.fleet {
        Some(fleet) => {
            fleet.place_here(id, limits.vcpus, limits.memory.0).await.map_err(crate::fleet::placement::fleet_error)
        }
        None => Ok(()),
    }
}

/// In a fleet, frees sandbox `id` (reserved, then not made) in etcd.
pub(crate) fn fleet_abandon(state: &AppState, id: &str) {
    if let Some(fleet) = &state.fleet {
        crate::fleet::release_later(fleet, id);
    }
}

/// In a fleet, frees `entry`'s sandbox in etcd when it is killed.
pub(crate) fn fleet_follow(state: &AppState, entry: &SandboxEntry) {
    if let Some(fleet) = &state.fleet {
        let (fleet, id) = (fleet.clone(), entry.id.clone());
        entry.on_kill(move || crate::fleet::release_later(&fleet, &id));
    }
}

/// Starts a sandbox for `principal` (what `POST /v1/sandboxes` and the E2B layer do).
pub(crate) async fn start_sandbox(
    state: &Arc<AppState>,
    principal: &Principal,
    choice: TierChoice,
    caps: Capabilities,
    limits: Limits,
    ttl: Duration,
) -> Result<Arc<SandboxEntry>, ApiError> {
    // In a fleet: where it goes (this node, as the id reserved and confirmed in etcd, or another one).
    let id = match crate::fleet::placement::Placement::current() {
        Some(placement) if state.fleet.is_some() => {
            match placement.decide(state, limits.vcpus, limits.memory.0).await? {
                crate::fleet::placement::Decision::Here(id) => id,
                crate::fleet::placement::Decision::Forwarded => return Err(ApiError::forwarded()),
            }
        }
        _ => {
            let id = new_id("sb_");
            fleet_reserve(state, &id, &limits).await?;
            id
        }
    };
    // This node's own admission (quotas, its budgets, its CPUs and free memory) is the last word.
    let mut reservation = match reserve(state, principal, 1, &limits) {
        Ok(reservation) => reservation,
        Err(err) => {
            fleet_abandon(state, &id);
            return Err(err);
        }
    };
    let started = Instant::now();
    let engine = state.engine.clone();
    let sandbox_limits = limits.clone();
    let image = caps.image.as_ref().map(ToString::to_string);
    let sandbox = match blocking(move || engine.start(choice, &caps, &sandbox_limits).map_err(ApiError::from)).await {
        Ok(sandbox) => sandbox,
        Err(err) => {
            fleet_abandon(state, &id);
            return Err(err);
        }
    };
    let tier = sandbox.tier();
    let entry =
        reservation.commit(SandboxEntry::new(id, principal.name.clone(), sandbox, limits, ttl).with_image(image));
    fleet_follow(state, &entry);
    state.metrics.sandbox_created(tier);
    state.metrics.latency(tier.as_str(), "create", started.elapsed());
    tracing::info!(sandbox = %entry.id, %tier, "sandbox created");
    // A shutdown that began while it started has already drained the registry: close it now.
    if state.draining() {
        if let Ok(entry) = state.registry.remove(&entry.id, &principal.name) {
            close(entry).await?;
        }
        return Err(ApiError::shutting_down());
    }
    Ok(entry)
}

/// Kills a sandbox taken out of the registry and waits until it is closed.
pub(crate) async fn kill(state: &Arc<AppState>, entry: Arc<SandboxEntry>) -> Result<(), ApiError> {
    let started = Instant::now();
    let tier = entry.tier;
    close(entry).await?;
    state.metrics.latency(tier.as_str(), "delete", started.elapsed());
    Ok(())
}

/// Runs a job in a sandbox, cancelling it if the request is dropped.
pub(crate) async fn exec_in(
    state: &Arc<AppState>,
    entry: Arc<SandboxEntry>,
    job: Job,
    opts: ExecOptions,
) -> Result<Outcome, ApiError> {
    let token = opts.cancel.clone().unwrap_or_default();
    let mut guard = CancelOnDrop(Some(token.clone()));
    let opts = ExecOptions { cancel: Some(token), ..opts };
    let started = Instant::now();
    let tier = entry.tier;
    let result = blocking(move || entry.exec(&job, opts)).await;
    guard.0 = None;
    record_job(state, tier, "exec", started, &result);
    result
}

/// The sandbox `id` if `principal` may use it (else not found: ids of other keys are not revealed).
pub(crate) fn sandbox(state: &AppState, principal: &Principal, id: &str) -> Result<Arc<SandboxEntry>, ApiError> {
    match state.registry.get(id, &principal.name) {
        Err(crate::registry::RegistryError::SandboxNotFound(_)) if state.paused.get(id, &principal.name).is_some() => {
            Err(ApiError::new(
                axum::http::StatusCode::CONFLICT,
                "sandbox_paused",
                format!("sandbox {id} is paused: resume it first (POST /v1/sandboxes/{id}/resume)"),
            ))
        }
        other => Ok(other?),
    }
}

/// Takes the sandbox `id` of `principal` out of the registry (its place is free at once) and kills it.
pub(crate) async fn kill_sandbox(state: &Arc<AppState>, principal: &Principal, id: &str) -> Result<(), ApiError> {
    let entry = state.registry.remove(id, &principal.name)?;
    kill(state, entry).await?;
    tracing::info!(sandbox = %id, "sandbox deleted");
    Ok(())
}

/// Runs one filesystem call of a sandbox (blocking, on a thread of its own), beside its running jobs. Its latency
/// is counted as `op`.
async fn file_call<T: Send + 'static>(
    state: &AppState,
    entry: Arc<SandboxEntry>,
    op: &'static str,
    call: impl FnOnce(&dyn Sandbox) -> Result<T, TierError> + Send + 'static,
) -> Result<T, ApiError> {
    let (started, tier) = (Instant::now(), entry.tier);
    let answer = blocking(move || entry.call(call)).await?;
    state.metrics.latency(tier.as_str(), op, started.elapsed());
    Ok(answer)
}

/// Reads a file of a sandbox.
pub(crate) async fn read_file(state: &AppState, entry: Arc<SandboxEntry>, path: String) -> Result<Vec<u8>, ApiError> {
    file_call(state, entry, "file_read", move |calls| calls.read_file(&path)).await
}

/// Writes a file of a sandbox.
pub(crate) async fn write_file(
    state: &AppState,
    entry: Arc<SandboxEntry>,
    path: String,
    data: Vec<u8>,
) -> Result<(), ApiError> {
    file_call(state, entry, "file_write", move |calls| calls.write_file(&path, &data)).await
}

/// The entries of a sandbox's directory, `depth` levels down (1: its own entries), in path order: each
/// directory's entries by name, the entries below one right after it.
pub(crate) async fn list_dir(
    state: &AppState,
    entry: Arc<SandboxEntry>,
    path: GuestPath,
    depth: u32,
) -> Result<Vec<EntryInfo>, ApiError> {
    let mut entries = file_call(state, entry, "file_list", move |calls| calls.list_dir(&path, depth)).await?;
    entries.sort_by(|a, b| a.path.as_str().split('/').cmp(b.path.as_str().split('/')));
    Ok(entries)
}

/// What a sandbox's path is (a link itself, not what it points to).
pub(crate) async fn stat(state: &AppState, entry: Arc<SandboxEntry>, path: GuestPath) -> Result<EntryInfo, ApiError> {
    file_call(state, entry, "file_stat", move |calls| calls.stat(&path)).await
}

/// Makes a directory of a sandbox and its missing parents; `false` when it already was one.
pub(crate) async fn make_dir(state: &AppState, entry: Arc<SandboxEntry>, path: GuestPath) -> Result<bool, ApiError> {
    file_call(state, entry, "file_make_dir", move |calls| calls.make_dir(&path)).await
}

/// Moves a sandbox's file or directory; what is at its new path.
pub(crate) async fn rename(
    state: &AppState,
    entry: Arc<SandboxEntry>,
    from: GuestPath,
    to: GuestPath,
) -> Result<EntryInfo, ApiError> {
    file_call(state, entry, "file_rename", move |calls| calls.rename(&from, &to)).await
}

/// Removes a sandbox's file, link or directory (with everything in it).
pub(crate) async fn remove(state: &AppState, entry: Arc<SandboxEntry>, path: GuestPath) -> Result<(), ApiError> {
    file_call(state, entry, "file_remove", move |calls| calls.remove(&path)).await
}

/// Watches a sandbox's directory (and the directories below it when `recursive`); dropping the watcher stops it.
pub(crate) async fn watch(
    state: &AppState,
    entry: Arc<SandboxEntry>,
    path: GuestPath,
    recursive: bool,
) -> Result<Watcher, ApiError> {
    file_call(state, entry, "file_watch", move |calls| calls.watch(&path, recursive)).await
}

/// Kills a sandbox taken out of the registry (blocking, on a thread of its own) and waits until it is closed.
pub(crate) async fn close(entry: Arc<SandboxEntry>) -> Result<(), ApiError> {
    blocking(move || {
        entry.kill();
        Ok::<(), ApiError>(())
    })
    .await
}

/// A pipe for a job's stdin and a channel into its writer: a blocking thread that writes each chunk, closing the
/// pipe when the channel closes or the job is gone (`EPIPE`).
/// The wall and CPU limit of a job that lives until it exits, is killed, or its sandbox ends (an E2B command, a
/// terminal): its sandbox's TTL bounds it.
pub(crate) const JOB_LIFE: std::time::Duration = std::time::Duration::from_secs(30 * 24 * 3600);

pub(crate) fn stdin_writer() -> Result<(StdinStream, mpsc::Sender<Vec<u8>>), ApiError> {
    let (stream, mut pipe) =
        StdinStream::pipe().map_err(|e| ApiError::internal(format!("cannot make the stdin pipe: {e}")))?;
    let (tx, mut rx) = mpsc::channel::<Vec<u8>>(STDIN_QUEUE);
    tokio::task::spawn_blocking(move || {
        while let Some(chunk) = rx.blocking_recv() {
            if pipe.write_all(&chunk).is_err() {
                break;
            }
        }
    });
    Ok((stream, tx))
}

/// Chunks of stdin queued for a job that is not reading them yet; past this, the client's messages wait.
const STDIN_QUEUE: usize = 64;
