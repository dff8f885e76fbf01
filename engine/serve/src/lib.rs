//! `strata serve`: Strata's sandbox API over HTTP/1.1 and WebSocket.
//!
//! One process serves, on one port:
//! - the native API under `/v1` ([`api`]): sandboxes (create, list, get, delete, set timeout), jobs in them (exec,
//!   and exec streamed over a WebSocket, [`ws`]), one-shot runs, files, snapshots and forks; JSON everywhere, errors
//!   as `{"error":{"code":"...","message":"..."}}` ([`ApiError`]); its OpenAPI document at `/v1/openapi.json`;
//! - the E2B-compatible subset the official E2B SDK uses unmodified ([`e2b`]): its control plane, the in-sandbox
//!   agent (envd: Connect-RPC process calls, files, health) and the code interpreter's `/execute`;
//! - `/metrics` in the Prometheus text format ([`metrics`]) and `/health`.
//!
//! The router here is the only place that knows every layer: the native API, its WebSocket and the E2B layer each
//! call a small service layer (start, get, kill sandboxes, run jobs, files), never one another, and it calls the
//! [`registry`] (which knows nothing of HTTP or E2B), the metrics and admission ([`capacity`]).
//!
//! Requests carry an API key (`Authorization: Bearer KEY` or `X-API-Key: KEY`) checked against a file of hashed keys
//! with per-key quotas ([`auth`]). Without a keys file the server accepts every request as `anonymous`, and for that
//! reason refuses to listen on anything but a loopback address ([`ServeError::OpenNonLoopback`]). Before any of
//! that, connections are capped per client and in all, and timed out when they never finish a request
//! ([`connections`]).
//!
//! Sandboxes live until deleted or until their TTL passes (a reaper task kills and frees them). Jobs run on
//! blocking threads, never on the async runtime. On shutdown ([`Server::run`]'s future, SIGTERM/SIGINT under
//! [`serve`]) the server refuses new work with 503 `shutting_down`, kills running jobs, closes every sandbox and
//! removes its snapshots. A server killed before it could do so leaves its state directory, cgroups and sockets
//! behind (its jails end with it: each jail's PID 1 ends when its control socket closes); the next server removes
//! them when it starts, before it takes a request.
//!
//! ```no_run
//! # async fn example() -> Result<(), strata_serve::ServeError> {
//! let config = strata_serve::ServeConfig::new(strata_engine::EngineConfig::from_env()?);
//! let server = strata_serve::Server::bind(config).await?;
//! println!("listening on {}", server.local_addr());
//! server.run(strata_serve::shutdown_signal()).await
//! # }
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod api;
pub mod auth;
pub mod cache;
pub mod capacity;
pub mod connections;
pub mod console;
pub mod e2b;
pub mod error;
pub mod fleet;
pub mod jobs;
pub mod metrics;
pub mod paused;
pub mod ports;
pub mod pty;
pub mod registry;
mod service;
pub mod tls;
pub mod usage;
pub mod ws;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Request, State};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use strata_engine::{Engine, EngineConfig, EngineError, Policy};
use tokio::net::TcpListener;
use tracing::Instrument;

pub use auth::{KeyStore, KeysError, Principal, hash_key};
pub use connections::{ConnectionLimits, Connections};
pub use error::ApiError;
pub use metrics::Metrics;
pub use registry::{Registry, SandboxEntry};

/// The address `strata serve` listens on by default.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:3000";

/// vCPU slots per host CPU by default: sandboxes mostly wait for their next request, so a CPU carries many.
pub const DEFAULT_CPU_OVERCOMMIT: u32 = 128;

/// How to run a server.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Where to listen (port 0 picks a free port; [`Server::local_addr`] says which).
    pub listen: SocketAddr,
    /// The engine's configuration (its policy's limits are the defaults and the ceiling of every request).
    pub engine: EngineConfig,
    /// Accepted API keys; `None` accepts every request as `anonymous` (loopback addresses only).
    pub keys: Option<KeyStore>,
    /// A sandbox's TTL when its request names none.
    pub default_ttl: Duration,
    /// The longest TTL a request may ask for.
    pub max_ttl: Duration,
    /// Sandboxes the server holds at most, over every key.
    pub max_sandboxes: usize,
    /// Whether requests may grant host directories to sandboxes (off: a `grants` capability is refused).
    pub allow_grants: bool,
    /// How often the reaper looks for expired sandboxes.
    pub reap_interval: Duration,
    /// Kill sandboxes idle (no job, no request) this long, besides their TTL; `None`: only the TTL.
    pub idle_timeout: Option<Duration>,
    /// The most memory the server's sandboxes may commit (the sum of their memory limits); `None`: no budget.
    pub memory_budget: Option<u64>,
    /// The most virtual CPUs the server's sandboxes may commit (the sum of their `vcpus` limits); `None`: no budget.
    pub cpu_budget: Option<u64>,
    /// vCPU slots per host CPU for admission's CPU bin-packing ([`capacity`]); 0 leaves CPUs out of admission.
    pub cpu_overcommit: u32,
    /// The host memory admission keeps free ([`capacity`]); `None` is [`capacity::default_min_free_memory`].
    pub min_free_memory: Option<u64>,
    /// Where the server keeps its snapshots (a fresh directory under it, removed at shutdown); `None` is
    /// `$STRATA_HOME/run/serve`, else the system's temporary directory.
    pub state_dir: Option<PathBuf>,
    /// How connections are capped and timed out, before any request reaches authentication ([`connections`]).
    pub connections: ConnectionLimits,
    /// The domain whose names `{port}-{sandboxId}.{domain}` reach a sandbox's port ([`ports`]), behind a wildcard
    /// DNS name pointing at this server; `None`: ports only through the `/v1/…/ports/` route and E2B's headers.
    pub domain: Option<String>,
    /// E2B template names that stand for custom images (`templateID` → image); a template that is neither
    /// built in nor here names an image of the store directly.
    pub templates: std::collections::BTreeMap<String, strata_core::ImageName>,
    /// The most the home's caches may hold: pruned to it at start and every [`cache::PRUNE_INTERVAL`] ([`cache`]);
    /// `None`: never pruned by the server.
    pub cache_budget: Option<u64>,
    /// The fleet this server is a node of ([`fleet`]); `None`: a server on its own.
    pub fleet: Option<fleet::FleetConfig>,
    /// Serve clients over TLS with this certificate ([`tls`]); with a fleet CA, the fleet's nodes talk to each
    /// other and to etcd over mutual TLS. `None`: plain HTTP.
    pub tls: Option<tls::TlsFiles>,
}

impl ServeConfig {
    /// The defaults: [`DEFAULT_LISTEN`], no keys, TTL 300 s (at most 24 h), no idle timeout, 256 sandboxes, no
    /// memory or CPU budget, no grants, [`ConnectionLimits::default`].
    pub fn new(engine: EngineConfig) -> ServeConfig {
        ServeConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 3000)),
            engine,
            keys: None,
            default_ttl: Duration::from_secs(300),
            max_ttl: Duration::from_secs(24 * 3600),
            max_sandboxes: 256,
            allow_grants: false,
            reap_interval: Duration::from_secs(1),
            idle_timeout: None,
            memory_budget: None,
            cpu_budget: None,
            cpu_overcommit: DEFAULT_CPU_OVERCOMMIT,
            min_free_memory: None,
            state_dir: None,
            connections: ConnectionLimits::default(),
            domain: None,
            templates: std::collections::BTreeMap::new(),
            cache_budget: None,
            fleet: None,
            tls: None,
        }
    }
}

/// The server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// No keys file, and an address other than loopback: every client on the network would be anonymous.
    #[error("refusing to listen on {0} without API keys: pass --keys FILE, or listen on a loopback address")]
    OpenNonLoopback(SocketAddr),
    /// The address could not be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The engine could not be built.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The keys file could not be used.
    #[error(transparent)]
    Keys(#[from] KeysError),
    /// The state directory could not be created.
    #[error("cannot create the server's state directory {}", path.display())]
    StateDir {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The async runtime could not start or the server failed while serving.
    #[error("server I/O error")]
    Io(#[source] std::io::Error),
    /// The server could not join its fleet (etcd unreachable, the node's name taken, a bad configuration).
    #[error("cannot join the fleet: {0}")]
    Fleet(#[from] fleet::FleetError),
    /// The TLS certificate, key or CA could not be used.
    #[error("TLS: {0}")]
    Tls(#[from] tls::TlsError),
}

/// What every request handler shares.
#[derive(Debug)]
pub struct AppState {
    /// The engine.
    pub engine: Arc<Engine>,
    /// The engine's policy (limits, network).
    pub policy: Policy,
    /// Live sandboxes and snapshots.
    pub registry: Arc<Registry>,
    /// Counters and histograms.
    pub metrics: Metrics,
    /// Accepted keys (`None`: anonymous).
    pub keys: Option<KeyStore>,
    /// See [`ServeConfig::default_ttl`].
    pub default_ttl: Duration,
    /// See [`ServeConfig::max_ttl`].
    pub max_ttl: Duration,
    /// See [`ServeConfig::allow_grants`].
    pub allow_grants: bool,
    /// This server's snapshot directory.
    pub snapshot_dir: PathBuf,
    /// The E2B layer's state of its sandboxes (dropped with each sandbox, through [`SandboxEntry::on_kill`]).
    pub e2b: Arc<e2b::E2bState>,
    /// Paused sandboxes ([`paused`]).
    pub paused: paused::Paused,
    /// Open connections and their limits.
    pub connections: Arc<Connections>,
    /// See [`ServeConfig::domain`].
    pub domain: Option<String>,
    /// See [`ServeConfig::templates`].
    pub templates: std::collections::BTreeMap<String, strata_core::ImageName>,
    /// The sandboxes' terminals ([`pty`]).
    pub ptys: Arc<pty::Ptys>,
    /// This node's membership of a fleet ([`fleet`]); `None`: a server on its own.
    pub fleet: Option<Arc<fleet::Fleet>>,
    draining: AtomicBool,
}

impl AppState {
    /// Whether the server is shutting down (new work gets 503 `shutting_down`).
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Refuses new work while shutting down.
    pub fn admit(&self) -> Result<(), ApiError> {
        if self.draining() {
            self.metrics.rejected("shutting_down");
            return Err(ApiError::shutting_down());
        }
        Ok(())
    }

    /// Starts shutting down: refuses new work, kills every sandbox and removes every snapshot. Blocks until the
    /// sandboxes are closed; call it on a blocking thread.
    pub fn drain_blocking(&self) {
        self.draining.store(true, Ordering::SeqCst);
        let all = self.registry.take_all();
        let count = all.len();
        std::thread::scope(|scope| {
            for entry in &all {
                scope.spawn(|| entry.kill());
            }
        });
        if let Err(err) = std::fs::remove_dir_all(&self.snapshot_dir)
            && err.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(dir = %self.snapshot_dir.display(), error = %err, "removing the snapshot directory failed");
        }
        if count > 0 {
            tracing::info!(sandboxes = count, "closed every sandbox");
        }
    }
}

/// A bound server, ready to [`run`](Server::run).
#[derive(Debug)]
pub struct Server {
    listener: TcpListener,
    state: Arc<AppState>,
    tls: Option<Arc<tls::Tls>>,
}

impl Server {
    /// Builds the engine and binds the address. Without keys, only a loopback address is accepted.
    pub async fn bind(config: ServeConfig) -> Result<Server, ServeError> {
        if config.keys.is_none() && !config.listen.ip().is_loopback() {
            return Err(ServeError::OpenNonLoopback(config.listen));
        }
        let engine = Arc::new(Engine::new(config.engine.clone())?);
        Server::bind_with_engine(engine, config).await
    }

    /// Binds a server over an engine the caller built (and may share); `config.engine` gives only the policy
    /// (limits, network) requests are checked against, which should be the engine's.
    pub async fn bind_with_engine(engine: Arc<Engine>, config: ServeConfig) -> Result<Server, ServeError> {
        if config.keys.is_none() && !config.listen.ip().is_loopback() {
            return Err(ServeError::OpenNonLoopback(config.listen));
        }
        let base = match &config.state_dir {
            Some(dir) => dir.clone(),
            None => match engine.home() {
                Some(home) => home.join("run/serve"),
                None => std::env::temp_dir().join("strata-serve"),
            },
        };
        remove_stale_state(&base);
        // What a predecessor killed mid-job left (cgroups and what still runs in them, egress sockets, scratch
        // copies) goes before this server takes any request, not at the first job of the tier concerned.
        let sweeper = engine.clone();
        let _ = tokio::task::spawn_blocking(move || sweeper.remove_stale()).await;
        let snapshot_dir = base.join(registry::new_id(&format!("server-{}-", std::process::id())));
        std::fs::create_dir_all(&snapshot_dir)
            .map_err(|source| ServeError::StateDir { path: snapshot_dir.clone(), source })?;
        let tls = match &config.tls {
            Some(files) => {
                let tls = tls::Tls::load(files.clone())?;
                tls.spawn_reload();
                Some(tls)
            }
            None => None,
        };
        let listener = TcpListener::bind(config.listen)
            .await
            .map_err(|source| ServeError::Bind { addr: config.listen, source })?;
        if config.keys.is_none() {
            tracing::warn!("no API keys (--keys): every request is served as `anonymous`, on loopback only");
        }
        if !console::built() {
            tracing::info!(
                "the console (/ui/) is not built into this server: npm ci && npm run build in engine/serve/ui, then build strata again"
            );
        }
        let host = capacity::HostCapacity::host(
            config.cpu_overcommit,
            config.min_free_memory.unwrap_or_else(capacity::default_min_free_memory),
        );
        let fleet = match &config.fleet {
            Some(fleet_config) => {
                let memory = config.memory_budget.unwrap_or_else(|| {
                    let available = capacity::MemoryProbe::host().available().unwrap_or(0);
                    available.saturating_sub(config.min_free_memory.unwrap_or_else(capacity::default_min_free_memory))
                });
                let offer = fleet::Capacity {
                    cpus: u32::try_from(host.cpus()).unwrap_or(u32::MAX),
                    slots: config.cpu_overcommit,
                    memory,
                };
                Some(fleet::Fleet::join(fleet_config.clone(), offer, tls.clone()).await?)
            }
            None => None,
        };
        let state = Arc::new(AppState {
            engine,
            policy: config.engine.policy.clone(),
            registry: Arc::new(
                Registry::new(config.max_sandboxes, config.memory_budget, config.cpu_budget).with_host(host),
            ),
            metrics: Metrics::default(),
            keys: config.keys,
            default_ttl: config.default_ttl,
            max_ttl: config.max_ttl,
            allow_grants: config.allow_grants,
            snapshot_dir,
            e2b: Arc::default(),
            paused: paused::Paused::default(),
            connections: Arc::new(Connections::new(config.connections)),
            domain: config.domain.clone(),
            templates: config.templates.clone(),
            ptys: Arc::default(),
            fleet,
            draining: AtomicBool::new(false),
        });
        spawn_reaper(&state, config.reap_interval, config.idle_timeout);
        fleet::spawn(&state);
        spawn_sampler(&state);
        cache::spawn(&state, config.cache_budget);
        Ok(Server { listener, state, tls })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        // A bound listener has an address; the configured one is a fallback that cannot be reached.
        self.listener.local_addr().unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    /// The shared state (for embedders and tests: the registry, the metrics).
    pub fn state(&self) -> Arc<AppState> {
        self.state.clone()
    }

    /// Serves until `shutdown` completes, then drains: new work is refused with 503, running jobs are killed,
    /// every sandbox is closed and the snapshots removed; in-flight requests finish (with the outcome of their
    /// killed job) before this returns.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), ServeError> {
        let state = self.state.clone();
        let app = router(state.clone());
        let drain_state = state.clone();
        let graceful = async move {
            shutdown.await;
            tracing::info!("shutting down: refusing new work, killing sandboxes");
            let drained = service::blocking(move || {
                drain_state.drain_blocking();
                Ok::<(), ApiError>(())
            })
            .await;
            if let Err(err) = drained {
                tracing::error!(error = %err, "draining failed");
            }
        };
        connections::serve(self.listener, app, state.connections.clone(), self.tls, too_large, graceful).await;
        // Anything created while the last requests finished.
        let last = state.clone();
        let _ = service::blocking(move || {
            last.drain_blocking();
            Ok::<(), ApiError>(())
        })
        .await;
        if let Some(fleet) = &state.fleet {
            fleet.leave().await;
        }
        Ok(())
    }
}

/// Removes the state directories (`server-PID-…`) of servers whose process is gone (killed before they could
/// clean up), so that a crash leaks nothing past the next start.
fn remove_stale_state(base: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(base) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix("server-")).and_then(|n| n.split('-').next()) else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else { continue };
        if pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            tracing::info!(dir = %entry.path().display(), "removing the state of a server that is gone");
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Runs `each` every `interval` while the server is up (not draining), on the runtime; it stops with the server.
fn every<F, Fut>(state: &Arc<AppState>, interval: Duration, mut each: F)
where
    F: FnMut(Arc<AppState>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let weak = Arc::downgrade(state);
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let Some(state) = weak.upgrade() else { return };
            if state.draining() {
                return;
            }
            each(state).await;
        }
    });
}

/// Kills sandboxes past their TTL or idle for `idle`, every `interval`.
fn spawn_reaper(state: &Arc<AppState>, interval: Duration, idle: Option<Duration>) {
    every(state, interval, move |state| async move {
        for entry in state.registry.take_expired(Instant::now(), idle) {
            tracing::info!(sandbox = %entry.id, owner = %entry.owner, "sandbox expired; killing it");
            let state = state.clone();
            let _ = std::thread::Builder::new().name("strata-serve-reap".into()).spawn(move || {
                let started = Instant::now();
                // An E2B sandbox created with `autoPause` is snapshotted first, to be resumed later.
                e2b::pause_on_expiry(&state, &entry);
                entry.kill();
                state.metrics.latency(entry.tier.as_str(), "expire", started.elapsed());
            });
        }
    });
}

/// Samples every sandbox's resource use each [`usage::SAMPLE_INTERVAL`] ([`SandboxEntry::sample_usage`]), from
/// one blocking thread at a time.
fn spawn_sampler(state: &Arc<AppState>) {
    every(state, usage::SAMPLE_INTERVAL, |state| async move {
        let entries = state.registry.list(None);
        drop(state);
        let _ = tokio::task::spawn_blocking(move || {
            for entry in entries.iter().filter(|entry| entry.tier != strata_core::TierKind::Wasm) {
                let _ = entry.sample_usage();
            }
        })
        .await;
    });
}

/// Completes on SIGTERM or SIGINT (Ctrl-C).
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = ctrl_c => tracing::info!("SIGINT received"),
        () = term => tracing::info!("SIGTERM received"),
    }
}

/// Runs a server on a multi-threaded runtime of its own until SIGTERM or SIGINT (what `strata serve` calls).
pub fn serve(config: ServeConfig) -> Result<(), ServeError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("strata-serve")
        .build()
        .map_err(ServeError::Io)?;
    runtime.block_on(async move {
        let server = Server::bind(config).await?;
        tracing::info!(addr = %server.local_addr(), "strata serve listening");
        server.run(shutdown_signal()).await
    })
}

/// The whole application: `/v1`, `/metrics`, `/health`, with request ids, logs and authentication.
pub fn router(state: Arc<AppState>) -> Router {
    let authed = api::routes()
        .merge(ws::routes())
        .merge(pty::routes())
        .merge(e2b::control_routes())
        .merge(fleet::api::routes())
        .layer(axum::middleware::from_fn_with_state(state.clone(), authenticate));
    Router::new()
        .merge(authed)
        .merge(e2b::envd_routes())
        .route("/v1/openapi.json", axum::routing::get(api::openapi))
        .route("/metrics", axum::routing::get(metrics_text))
        .route("/health", axum::routing::get(e2b::health))
        .merge(console::routes())
        .fallback(unknown_route)
        .layer(axum::extract::DefaultBodyLimit::max(state.connections.limits().max_body))
        .layer(axum::middleware::from_fn(e2b_errors))
        .layer(axum::middleware::from_fn_with_state(state.clone(), e2b::ports::route))
        .layer(axum::middleware::from_fn_with_state(state.clone(), fleet::route::route))
        .layer(axum::middleware::from_fn_with_state(state.clone(), request_log))
        .with_state(state)
}

/// Whether `path` is one of Strata's own (the native API, its document, `/metrics`) rather than an E2B route.
pub(crate) fn native_path(path: &str) -> bool {
    path == "/v1" || path.starts_with("/v1/") || path == "/metrics"
}

/// What no route takes: the native API's `not_found`, or E2B's `unimplemented` in the shape of the E2B request.
async fn unknown_route(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    if native_path(uri.path()) {
        return ApiError::new(axum::http::StatusCode::NOT_FOUND, "not_found", "no such endpoint").into_response();
    }
    e2b::E2bError::unimplemented(&method, uri.path()).into_response()
}

/// The answer to a request whose declared body is over `max_body`, refused before routing.
fn too_large(path: &str, headers: &axum::http::HeaderMap, max_body: usize) -> Response {
    let err = ApiError::too_large(Some(max_body));
    if native_path(path) {
        return err.into_response();
    }
    e2b::E2bError::from(err).answer_to(path, headers)
}

/// Gives every error of an E2B route E2B's shape ([`e2b::error::render`]); Strata's own routes keep theirs.
async fn e2b_errors(request: Request, next: Next) -> Response {
    if native_path(request.uri().path()) {
        return next.run(request).await;
    }
    e2b::error::render(request, next).await
}

async fn metrics_text(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    let mut text = state.metrics.render(
        &state.registry.active_by_tier(),
        state.registry.memory_committed(),
        state.registry.vcpus_committed(),
        state.registry.host_slots(),
    );
    if let Some(budget) = state.registry.memory_budget() {
        text.push_str(
            "# HELP strata_memory_budget_bytes The most memory the server's sandboxes may commit (--memory-budget).\n\
             # TYPE strata_memory_budget_bytes gauge\n",
        );
        text.push_str(&format!("strata_memory_budget_bytes {budget}\n"));
    }
    state.connections.render_metrics(&mut text);
    if let Some(fleet) = &state.fleet {
        fleet.render_metrics(&mut text);
    }
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], text)
}

/// Checks the API key and attaches the request's [`Principal`].
async fn authenticate(State(state): State<Arc<AppState>>, mut request: Request, next: Next) -> Response {
    let principal = match &state.keys {
        None => Principal::anonymous(),
        Some(keys) => match keys.authenticate(request.headers()) {
            Ok(principal) => principal,
            Err(err) => {
                state.metrics.rejected("unauthorized");
                // The E2B SDKs parse their own error shape; Strata's routes get the native one.
                if native_path(request.uri().path()) {
                    return err.into_response();
                }
                return e2b::E2bError::from(err).into_response();
            }
        },
    };
    tracing::Span::current().record("key", principal.name.as_str());
    request.extensions_mut().insert(principal);
    next.run(request).await
}

/// Gives every request an id (`x-request-id`, taken from the request when it has a short printable one), a
/// tracing span carrying it, and one log line when it ends. Bodies and headers are never logged (they may carry
/// secrets and keys).
async fn request_log(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    static NEXT_ID: AtomicU64 = AtomicU64::new(1);
    let id = request
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 64 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_owned)
        .unwrap_or_else(|| format!("req-{}", NEXT_ID.fetch_add(1, Ordering::Relaxed)));
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let span = tracing::info_span!("request", id = %id, %method, %path, key = tracing::field::Empty);
    let started = Instant::now();
    let mut response = next.run(request).instrument(span.clone()).await;
    let status = response.status().as_u16();
    state.metrics.response(status);
    span.in_scope(|| {
        let ms = (started.elapsed().as_secs_f64() * 1e6).round() / 1e3;
        tracing::info!(status, ms, "request done");
    });
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert("x-request-id", value);
    }
    response
}
