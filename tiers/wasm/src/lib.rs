//! Strata's WebAssembly tier: WASI preview1 command modules, WASI 0.2 command components ([below](#components)),
//! and Python ([`python`]), on wasmtime.
//!
//! - One wasmtime [`Engine`](wasmtime::Engine) per fuel mode (unmetered, the default, and fuel-metered, whose
//!   compiled code differs), each shared by every job, with the pooling allocator and copy-on-write memory
//!   images so an instance costs microseconds.
//! - A precompiled-module cache on disk ([`cache`]), keyed by the module's hash and the engine's
//!   compatibility fingerprint and verified on every load; in memory, prepared modules are kept per engine and
//!   files are recognised by their metadata, so a repeated job does one `stat` before instantiating.
//! - Limits: fuel (`Limits::fuel`), a wall-clock deadline and CPU time checked at every epoch tick and by a
//!   timer around blocking host calls, linear memory by a `ResourceLimiter`; each reports its own
//!   `LimitExceeded { limit }`. Every host call a guest can wait in is asynchronous on the job's executor, so
//!   the deadline and a cancel end the wait: sleeps and `poll_oneoff` (see [`strata_wasi_shims::poll`]), stdin,
//!   sockets, name lookups, host tool calls (whose handler, host code, is left to finish on a thread of its own);
//!   and nothing is opened whose open could wait on the job's thread, a FIFO or a device ([`strata_wasi_shims::open`]).
//! - Capabilities: grants become preopened directories (cap-std: no escape by `..`, absolute paths or
//!   symlinks; read-only grants refuse every change), env and secrets become the environment, stdin is a byte
//!   buffer or a stream read as it arrives ([`strata_wasi_shims::StreamedStdin`]). Preview1 modules and Python
//!   have no network: a job of theirs whose capabilities allow network egress is refused (`unsupported`) rather
//!   than run without it.
//! - Snapshots and forks ([`snapshot`](Tier::fork)): Python sessions run a snapshot-ready form of the runtime
//!   (its mutable globals exported, its data segments moved into a memory image) whose linear memory is mapped
//!   copy-on-write from an image file; a snapshot saves the memory, the globals and the scratch `/tmp`, and a
//!   fork maps the saved memory instead of the base image: no compile, no copy, pages shared by every fork.
//!
//! Jobs run on the caller's thread, which blocks until the job ends. Called from inside an async runtime, a
//! job runs on a scoped thread of its own instead, so it never stalls the runtime's own machinery; servers
//! should still call from `spawn_blocking` to keep their workers free.
//!
//! # Components
//!
//! A `Job::Wasm` whose binary is a component (the header's layer field is 1), as `cargo build --target
//! wasm32-wasip2` makes, runs as a `wasi:cli/command`: the same capabilities, limits (fuel included: it is
//! wasmtime's engine-wide `consume_fuel`, which meters components too), outcome and usage as a preview1
//! command, and a compiled-component cache beside the modules'. A component that is not a command, or imports
//! what Strata does not provide, is a typed error (`invalid_module`, `unknown_import`). Components are the
//! tier's only jobs with **network egress**: `wasi:sockets` TCP connects checked against the allowlist and
//! logged in the outcome's `egress` ([`net`]). In a sandbox each `exec` of a component is a fresh instance, as
//! for preview1 commands.
//!
//! # Modules
//!
//! From the top down:
//!
//! - `sandbox`, [`python`], `component`: live sandboxes, Python jobs and sessions, WASI 0.2 commands.
//! - `grants`, `watch`: a sandbox's filesystem methods on its grants' host directories (never following a
//!   link out of a grant), and its inotify watches.
//! - `exec`: running a guest: the WASI context built from the capabilities, the store and its data (`JobState`)
//!   with the limits armed, the guarded call, the outcome.
//! - `snapshot`: a snapshot's files, saved from a session and read back by a fork; in it, the rewrite that makes
//!   a module snapshot-ready (`ready_module`), the snapshot-ready Python runtime made once and cached
//!   (`ready_runtime`), and the copy-on-write memories snapshot-ready instances run in (`memory_image`).
//! - `runtime`: an engine, its linkers and the programs prepared for it, generic over the stores' data.
//! - [`net`], `tools`: the network layers over `wasi:sockets` and the `host.call` import, each linked for any
//!   store whose data gives it its view (`NetView`, `ToolsView`), as wasmtime-wasi's `WasiView` does.
//! - [`cache`], `epoch`, `error`: the compiled-code cache, the epoch ticker, the tier's internal errors.

#![warn(missing_docs)]

pub mod cache;
mod component;
mod epoch;
mod error;
mod exec;
mod grants;
pub mod net;
pub mod python;
mod runtime;
mod sandbox;
mod snapshot;
#[doc(hidden)]
pub use snapshot::fuzzing as snapshot_fuzzing;
mod tools;
mod watch;

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use strata_core::{
    Capabilities, ExecOptions, Job, Limits, ModuleSource, Outcome, Sandbox, Snapshot, SnapshotTrust, Tier, TierError,
    TierKind, ToolRegistry,
};

pub use cache::{CacheOutcome, ModuleCache};
pub use python::{PythonArtifacts, PythonProvider};
pub use sandbox::WasmSandbox;

use crate::cache::Digest;
use crate::error::{internal, internal_from, lock};
use crate::exec::JobState;
use crate::python::SessionModule;
use crate::runtime::{Allocation, Expect, Format, Prepared, PreparedComponent, Runtime};
use crate::snapshot::ready_runtime::{self, ReadyRuntime};
use crate::tools::ToolHost;

/// Settings of the wasm tier.
#[derive(Clone)]
pub struct WasmTierConfig {
    /// Directory of the precompiled-module cache; `None` compiles in memory only.
    pub cache_dir: Option<PathBuf>,
    /// How many instances may exist at once per engine (the pooling allocator's slot count). A job beyond it
    /// fails with `TierError::Capacity`.
    pub max_instances: u32,
    /// Supplies the Python runtime; without one, Python jobs are refused as unsupported.
    pub python: Option<Arc<dyn PythonProvider>>,
    /// Host tools jobs may call, chosen per job by `Capabilities::tools`.
    pub tools: ToolRegistry,
    /// What seals this tier's snapshots and opens them for forks ([`SnapshotTrust`]); by default a key of this
    /// process alone.
    pub snapshots: SnapshotTrust,
}

impl std::fmt::Debug for WasmTierConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WasmTierConfig")
            .field("cache_dir", &self.cache_dir)
            .field("max_instances", &self.max_instances)
            .field("python", &self.python.is_some())
            .field("tools", &self.tools)
            .field("snapshots", &self.snapshots)
            .finish()
    }
}

impl Default for WasmTierConfig {
    fn default() -> Self {
        WasmTierConfig {
            cache_dir: None,
            max_instances: 64,
            python: None,
            tools: ToolRegistry::new(),
            snapshots: SnapshotTrust::process_local(),
        }
    }
}

/// The wasm tier. Cheap to clone; clones share engines and caches.
#[derive(Clone)]
pub struct WasmTier {
    inner: Arc<TierInner>,
}

impl std::fmt::Debug for WasmTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WasmTier").field("config", &self.inner.config).finish_non_exhaustive()
    }
}

/// What identifies a file's contents without reading it: if none of these changed, neither did the bytes
/// (barring deliberate timestamp forgery by someone who can already write the job's input).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

impl FileStamp {
    fn of(meta: &std::fs::Metadata) -> FileStamp {
        FileStamp {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
            ctime_ns: i128::from(meta.ctime()) * 1_000_000_000 + i128::from(meta.ctime_nsec()),
        }
    }
}

const MAX_REMEMBERED_FILES: usize = 1024;

pub(crate) struct TierInner {
    config: WasmTierConfig,
    cache: Option<ModuleCache>,
    unmetered: OnceLock<Result<Runtime<JobState>, String>>,
    metered: OnceLock<Result<Runtime<JobState>, String>>,
    /// The engines of snapshot-ready sessions and their forks, unmetered and metered.
    mapped_unmetered: OnceLock<Result<Runtime<JobState>, String>>,
    mapped_metered: OnceLock<Result<Runtime<JobState>, String>>,
    /// The snapshot-ready form of each Python runtime met so far (by its sha256), or why it has none.
    ready: Mutex<HashMap<Digest, Result<ReadyRuntime, String>>>,
    files: Mutex<HashMap<PathBuf, (FileStamp, Digest, Format)>>,
    /// A Python instance made ahead of the next one-shot Python job ([`WasmTier::prestart_python`]).
    primed: Mutex<Option<python::PrimedPython>>,
}

/// The Python runtime's files, its module prepared for one engine, and where the compiled code came from.
type PreparedPython = (PythonArtifacts, Arc<Prepared<JobState>>, Option<CacheOutcome>);

/// A job's program, prepared.
enum Program {
    /// A WASI preview1 command module.
    Module(Arc<Prepared<JobState>>),
    /// A WASI 0.2 command component.
    Component(Arc<PreparedComponent<JobState>>),
}

impl WasmTier {
    /// A wasm tier with these settings. Engines are created on first use.
    pub fn new(config: WasmTierConfig) -> WasmTier {
        let cache = config.cache_dir.clone().map(ModuleCache::new);
        WasmTier {
            inner: Arc::new(TierInner {
                config,
                cache,
                unmetered: OnceLock::new(),
                metered: OnceLock::new(),
                mapped_unmetered: OnceLock::new(),
                mapped_metered: OnceLock::new(),
                ready: Mutex::new(HashMap::new()),
                files: Mutex::new(HashMap::new()),
                primed: Mutex::new(None),
            }),
        }
    }

    /// Compiles (or loads from the cache) the module a job would run, without running it, and says where it
    /// came from (`None`: it was already prepared in this process).
    pub fn prepare(&self, module: &ModuleSource, limits: &Limits) -> Result<Option<CacheOutcome>, TierError> {
        let runtime = self.inner.runtime(limits.fuel.limit().is_some())?;
        self.inner.prepare(runtime, module).map(|(_, outcome)| outcome)
    }

    /// Installs (if needed) and compiles or loads the Python runtime for these limits' fuel mode, as the first
    /// Python job would; says where the compiled code came from.
    pub fn prepare_python(&self, limits: &Limits) -> Result<Option<CacheOutcome>, TierError> {
        let runtime = self.inner.runtime(limits.fuel.limit().is_some())?;
        self.inner.python(runtime).map(|(_, _, outcome)| outcome)
    }

    /// Does ahead of the next one-shot Python job (of `limits`' fuel mode) what its start would do: the runtime
    /// loaded and an instance made, with the job-independent part of a one-shot job's code already run in it. For
    /// a process that forks a child per job (a warm daemon), which runs no guest code itself: the priming starts
    /// no thread (the process stays single-threaded, as forking needs), and each child takes its own copy of the
    /// instance. The next one-shot Python job in a process runs in the instance, exactly as it would in one made
    /// for it (`tests/all/python.rs` compares the two), and leaves it to that process's exit rather than reset
    /// its pool slot: the process that takes it runs one job and exits. A job with its own environment (`env`,
    /// `secrets`: the interpreter reads its environment at its first turn), inputs to reproduce (`--seed`,
    /// `--record`, replay), or a memory limit below what the instance holds (~40 MiB) makes its own instance, as
    /// without it.
    pub fn prestart_python(&self, limits: &Limits) -> Result<(), TierError> {
        let metered = limits.fuel.limit().is_some();
        let runtime = self.inner.runtime(metered)?;
        let (artifacts, prepared, _) = self.inner.python(runtime)?;
        let primed = python::prime(runtime, &prepared, &artifacts, limits)?;
        *lock(&self.inner.primed) = Some(primed);
        Ok(())
    }

    /// Makes the memory of the instance [`WasmTier::prestart_python`] made resident and this process's own (in a
    /// forked child: its copy, ~40 MiB), so that the job takes no page faults in the interpreter's heap. For a
    /// child forked ahead of its job (a warm daemon's spare). Does nothing when no instance waits.
    pub fn make_primed_python_resident(&self) {
        if let Some(primed) = lock(&self.inner.primed).as_mut() {
            primed.make_resident();
        }
    }

    /// Whether a Python instance made by [`WasmTier::prestart_python`] waits for its job.
    pub fn python_primed(&self) -> bool {
        lock(&self.inner.primed).is_some()
    }

    /// Prepares what Python sessions (and their snapshots and forks) run for `limits`' fuel mode: the
    /// snapshot-ready runtime, made and compiled once (minutes the first time, with progress) and cached like
    /// [`WasmTier::prepare_python`]'s. A runtime that cannot be made snapshot-ready is not an error here: its
    /// sessions run the plain runtime and refuse snapshots, saying why.
    pub fn prepare_python_sessions(&self, limits: &Limits) -> Result<(), TierError> {
        self.inner.python_session(limits.fuel.limit().is_some()).map(|_| ())
    }
}

impl TierInner {
    fn runtime(&self, metered: bool) -> Result<&Runtime<JobState>, TierError> {
        self.runtime_of(metered, Allocation::Pooled)
    }

    fn runtime_of(&self, metered: bool, allocation: Allocation) -> Result<&Runtime<JobState>, TierError> {
        let cell = match (allocation, metered) {
            (Allocation::Pooled, false) => &self.unmetered,
            (Allocation::Pooled, true) => &self.metered,
            (Allocation::Mapped, false) => &self.mapped_unmetered,
            (Allocation::Mapped, true) => &self.mapped_metered,
        };
        cell.get_or_init(|| Runtime::new(self.config.max_instances, metered, allocation).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(internal)
    }

    fn prepare(
        &self,
        runtime: &Runtime<JobState>,
        module: &ModuleSource,
    ) -> Result<(Program, Option<CacheOutcome>), TierError> {
        let name = module.program_name();
        match module {
            ModuleSource::Bytes { bytes, .. } => {
                let hash = *blake3::hash(bytes).as_bytes();
                let format = crate::runtime::format_of(&name, bytes)?;
                self.prepare_as(runtime, &name, format, &hash, || Ok(bytes.clone()))
            }
            ModuleSource::File(path) => {
                let unreadable = |source| TierError::ReadInput { path: path.clone(), source };
                let meta = std::fs::metadata(path).map_err(unreadable)?;
                if !meta.is_file() {
                    return Err(TierError::WrongFormat {
                        what: path.display().to_string(),
                        expected: "a regular file",
                    });
                }
                let stamp = FileStamp::of(&meta);
                let known = self.lock_files().get(path).filter(|(s, ..)| *s == stamp).map(|(_, hash, f)| (*hash, *f));
                if let Some((hash, format)) = known {
                    return self.prepare_as(runtime, &name, format, &hash, || {
                        std::fs::read(path).map(Arc::from).map_err(unreadable)
                    });
                }
                let bytes: Arc<[u8]> = std::fs::read(path).map_err(unreadable)?.into();
                let hash = *blake3::hash(&bytes).as_bytes();
                let format = crate::runtime::format_of(&name, &bytes)?;
                let prepared = self.prepare_as(runtime, &name, format, &hash, || Ok(bytes))?;
                let mut files = self.lock_files();
                if files.len() >= MAX_REMEMBERED_FILES {
                    files.clear();
                }
                files.insert(path.clone(), (stamp, hash, format));
                Ok(prepared)
            }
        }
    }

    /// Prepares a WASI command of a known format: a preview1 module or a WASI 0.2 component.
    fn prepare_as(
        &self,
        runtime: &Runtime<JobState>,
        name: &str,
        format: Format,
        hash: &Digest,
        bytes: impl FnOnce() -> Result<Arc<[u8]>, TierError>,
    ) -> Result<(Program, Option<CacheOutcome>), TierError> {
        let cache = self.cache.as_ref();
        match format {
            Format::Module => runtime
                .prepare(cache, name, hash, Expect::Command, bytes)
                .map(|(prepared, outcome)| (Program::Module(prepared), outcome)),
            Format::Component => runtime
                .prepare_component(cache, name, hash, bytes)
                .map(|(prepared, outcome)| (Program::Component(prepared), outcome)),
        }
    }

    fn lock_files(&self) -> std::sync::MutexGuard<'_, HashMap<PathBuf, (FileStamp, Digest, Format)>> {
        lock(&self.files)
    }

    fn run(&self, job: &Job, caps: &Capabilities, limits: &Limits, opts: ExecOptions) -> Result<Outcome, TierError> {
        opts.refuse_terminal(TierKind::Wasm)?;
        opts.refuse_user(TierKind::Wasm)?;
        caps.refuse_user(TierKind::Wasm)?;
        caps.refuse_image(TierKind::Wasm)?;
        caps.refuse_egress_secrets(TierKind::Wasm)?;
        if tokio::runtime::Handle::try_current().is_err() {
            return self.run_here(job, caps, limits, opts);
        }
        // Called from inside an async runtime, where this thread must not block on a runtime of its own: run
        // the job on a scoped thread of its own instead (its CPU time is measured there too).
        std::thread::scope(|scope| {
            std::thread::Builder::new()
                .name("strata-job".into())
                .spawn_scoped(scope, || self.run_here(job, caps, limits, opts))
                .map_err(|e| internal_from("cannot start a job thread", e))?
                .join()
                .unwrap_or_else(|_| Err(internal("the job thread panicked")))
        })
    }

    /// The Python runtime's files and its prepared snapshot for `runtime`'s fuel mode.
    fn python(&self, runtime: &Runtime<JobState>) -> Result<PreparedPython, TierError> {
        let provider = self.config.python.as_ref().ok_or_else(|| TierError::Unsupported {
            tier: TierKind::Wasm,
            what: "Python jobs (this engine has no Python runtime configured)".into(),
        })?;
        let artifacts = provider.artifacts()?;
        let snapshot = artifacts.snapshot.clone();
        let (prepared, outcome) = runtime.prepare(
            self.cache.as_ref(),
            "the Python runtime",
            &artifacts.snapshot_digest,
            Expect::PythonReactor,
            || {
                std::fs::read(&snapshot)
                    .map(Arc::from)
                    .map_err(|source| TierError::ReadInput { path: snapshot.clone(), source })
            },
        )?;
        Ok((artifacts, prepared, outcome))
    }

    /// The module Python sessions run for this fuel mode: the snapshot-ready runtime, or the plain one (with the
    /// reason) when the runtime cannot be made snapshot-ready. Returns the engine it belongs to.
    fn python_session(&self, metered: bool) -> Result<(PythonArtifacts, SessionModule, &Runtime<JobState>), TierError> {
        let provider = self.config.python.as_ref().ok_or_else(|| TierError::Unsupported {
            tier: TierKind::Wasm,
            what: "Python jobs (this engine has no Python runtime configured)".into(),
        })?;
        let artifacts = provider.artifacts()?;
        let known = self.lock_ready().get(&artifacts.snapshot_digest).cloned();
        let mut instrumented = None;
        let ready = match known {
            Some(ready) => ready,
            None => {
                let (ready, module) =
                    ready_runtime::load_or_make(self.cache.as_ref(), &artifacts.snapshot, &artifacts.snapshot_digest)?;
                instrumented = module;
                self.lock_ready().insert(artifacts.snapshot_digest, ready.clone());
                ready
            }
        };
        match ready {
            Ok(ready) => {
                let runtime = self.runtime_of(metered, Allocation::Mapped)?;
                let snapshot = artifacts.snapshot.clone();
                let (prepared, _) = runtime.prepare(
                    self.cache.as_ref(),
                    "the Python runtime (snapshot-ready)",
                    &ready.digest,
                    Expect::PythonReactor,
                    || match instrumented {
                        Some(module) => Ok(module),
                        None => ready_runtime::instrumented_module(&snapshot),
                    },
                )?;
                let module = SessionModule { prepared, allocation: Allocation::Mapped, snapshots: Ok(ready) };
                Ok((artifacts, module, runtime))
            }
            Err(reason) => {
                let runtime = self.runtime(metered)?;
                let (artifacts, prepared, _) = self.python(runtime)?;
                let module = SessionModule { prepared, allocation: Allocation::Pooled, snapshots: Err(reason) };
                Ok((artifacts, module, runtime))
            }
        }
    }

    fn lock_ready(&self) -> std::sync::MutexGuard<'_, HashMap<Digest, Result<ReadyRuntime, String>>> {
        lock(&self.ready)
    }

    /// Starts a sandbox from a snapshot of this tier: re-opened with this tier's trust first (the same sealed
    /// manifest, its files as verified), and every file read through it.
    fn fork(self: &Arc<Self>, snapshot: &Snapshot) -> Result<WasmSandbox, TierError> {
        let snapshot = &self.config.snapshots.reopen(snapshot)?;
        let state = snapshot::SandboxState::read(snapshot)?;
        if !state.caps.secrets.is_empty() {
            let names: Vec<&str> = state.caps.secrets.iter().map(|s| s.name.as_str()).collect();
            return Err(TierError::Unsupported {
                tier: TierKind::Wasm,
                what: format!(
                    "forking a snapshot taken with secrets ({}): their values are never written to disk",
                    names.join(", ")
                ),
            });
        }
        exec::check_caps(&state.caps, &self.config.tools)?;
        let parent = Some(snapshot.manifest.id.clone());
        let Some(python) = &state.python else {
            return Ok(WasmSandbox::restored(self.clone(), state.caps, state.limits, None, parent));
        };
        let (artifacts, module, runtime) = self.python_session(python.metered)?;
        match &module.snapshots {
            Ok(ready) if ready.identity() == python.runtime => {}
            Ok(_) => {
                return Err(TierError::Unsupported {
                    tier: TierKind::Wasm,
                    what: format!(
                        "a snapshot of another Python runtime ({}); the installed one is different",
                        python.runtime
                    ),
                });
            }
            Err(reason) => {
                return Err(TierError::Unsupported {
                    tier: TierKind::Wasm,
                    what: format!("forks of Python snapshots with this runtime ({reason})"),
                });
            }
        }
        let memory = snapshot::open_memory(snapshot, python.memory_bytes)?;
        let scratch = if python.scratch { Some(snapshot::restore_scratch(snapshot)?) } else { None };
        let restore =
            python::Restore { memory, globals: python.globals.clone(), scratch, clock_ns: python.monotonic_ns };
        let tools = self.tools(&state.caps)?;
        let session = python::PythonSession::start(
            runtime,
            &module,
            &artifacts,
            &state.caps,
            &state.limits,
            tools,
            Some(restore),
        )?;
        Ok(WasmSandbox::restored(self.clone(), state.caps, state.limits, Some(session), parent))
    }

    /// The host tools a job's capabilities name.
    fn tools(&self, caps: &Capabilities) -> Result<ToolHost, TierError> {
        Ok(ToolHost::new(self.config.tools.select(&caps.tools)?))
    }

    fn run_here(
        &self,
        job: &Job,
        caps: &Capabilities,
        limits: &Limits,
        opts: ExecOptions,
    ) -> Result<Outcome, TierError> {
        exec::check_caps(caps, &self.config.tools)?;
        let runtime = self.runtime(limits.fuel.limit().is_some())?;
        let inputs = match &opts.determinism {
            Some(determinism) => {
                Some(determinism.start(job, caps, limits, opts.stdin.as_deref(), opts.stdin_stream.is_some())?)
            }
            None => None,
        };
        let context = |tools: ToolHost| exec::JobContext {
            caps,
            limits,
            stdin: exec::GuestStdin::of(&opts),
            sink: opts.sink.clone(),
            cancel: opts.cancel.clone(),
            tools: tools.with_inputs(inputs.clone()),
            inputs: inputs.clone(),
        };
        match job {
            Job::Wasm { module, args } => {
                let (prepared, _) = self.prepare(runtime, module)?;
                let program = module.program_name();
                match prepared {
                    Program::Module(prepared) => {
                        exec::execute(runtime, &prepared, &program, args, context(self.tools(caps)?))
                    }
                    Program::Component(prepared) => {
                        component::execute(runtime, &prepared, &program, args, context(ToolHost::default()))
                    }
                }
            }
            Job::Python { source, args } => {
                // Before the runtime is loaded (possibly fetched): it would be refused anyway.
                exec::refuse_net(caps, exec::PYTHON)?;
                let (artifacts, prepared, _) = self.python(runtime)?;
                let primed = match inputs {
                    None => lock(&self.primed).take_if(|primed| primed.serves(&prepared, caps)),
                    Some(_) => None,
                };
                python::run_once(runtime, &prepared, &artifacts, source, args, context(self.tools(caps)?), primed)
            }
            other => Err(TierError::WrongJob { tier: TierKind::Wasm, job: other.kind() }),
        }
    }
}

impl Tier for WasmTier {
    fn kind(&self) -> TierKind {
        TierKind::Wasm
    }

    fn run(&self, job: &Job, caps: &Capabilities, limits: &Limits, opts: ExecOptions) -> Result<Outcome, TierError> {
        self.inner.run(job, caps, limits, opts)
    }

    fn start(&self, caps: &Capabilities, limits: &Limits) -> Result<Box<dyn Sandbox>, TierError> {
        exec::check_caps(caps, &self.inner.config.tools)?;
        caps.refuse_user(TierKind::Wasm)?;
        caps.refuse_image(TierKind::Wasm)?;
        caps.refuse_egress_secrets(TierKind::Wasm)?;
        Ok(Box::new(WasmSandbox::new(self.inner.clone(), caps.clone(), limits.clone())))
    }

    fn fork(&self, snapshot: &Snapshot) -> Result<Box<dyn Sandbox>, TierError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Ok(Box::new(self.inner.fork(snapshot)?));
        }
        // As for `run`: the restore runs guest code, which must not block an async runtime's thread.
        let sandbox = std::thread::scope(|scope| {
            std::thread::Builder::new()
                .name("strata-fork".into())
                .spawn_scoped(scope, || self.inner.fork(snapshot))
                .map_err(|e| internal_from("cannot start a fork thread", e))?
                .join()
                .unwrap_or_else(|_| Err(internal("the fork thread panicked")))
        })?;
        Ok(Box::new(sandbox))
    }
}
