//! Running guests: the WASI context built from `Capabilities`, the store with its limits, the guarded call,
//! and the mapping of how the guest ended to an `Outcome`. Shared by WASI commands (preview1 modules and 0.2
//! components), one-shot Python and Python sessions.
//!
//! A job's store holds a [`JobState`], which gives the runtime's linkers the views they are generic over
//! ([`StoreData`], [`ToolsView`], [`NetView`]): the modules below this one never name it.

use std::cell::RefCell;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_core::{
    CancelToken, Capabilities, ExecOptions, GrantMode, LimitKind, Limits, Net, Outcome, OutputSink, Status,
    StdinStream, Stream, TierError, TierKind, ToolCall, ToolRegistry, Truncated, Usage,
};
use strata_core::{Captured, JobInputs, OutputCapture};
use strata_wasi_shims::{StreamedStdin, WasiOutput};
use wasmtime::{ResourceLimiter, Store, Trap, UpdateDeadline, WasmBacktrace};
use wasmtime_wasi::p1::WasiP1Ctx;
use wasmtime_wasi::p2::pipe::MemoryInputPipe;
use wasmtime_wasi::sockets::WasiSocketsView;
use wasmtime_wasi::{FsPerms, I32Exit, WasiCtxBuilder, WasiCtxView, WasiView};

use crate::error::{internal, internal_from};
use crate::net::{NetCtxView, NetPolicy, NetView};
use crate::runtime::{MAX_LINEAR_MEMORY, MAX_TABLE_ELEMENTS, Prepared, Runtime, StoreData, describe};
use crate::tools::{ToolHost, ToolsView};

/// Per-store state: the guest's WASI context, the meter that enforces its limits, its tools, and its network
/// policy (components only).
///
/// A preview1 module reaches the context through wasmtime-wasi's preview1 adapter; a component reaches the same
/// context (its `WasiCtx` and resource table) through [`WasiView`], so both kinds share one way of building it.
pub(crate) struct JobState {
    pub(crate) wasi: WasiP1Ctx,
    pub(crate) meter: Meter,
    pub(crate) tools: ToolHost,
    pub(crate) net: Option<Arc<NetPolicy>>,
}

impl StoreData for JobState {
    fn preview1(&mut self) -> &mut WasiP1Ctx {
        &mut self.wasi
    }

    fn empty() -> JobState {
        JobState {
            wasi: WasiCtxBuilder::new().build_p1(),
            meter: Meter::new(&Limits::default(), None),
            tools: ToolHost::default(),
            net: None,
        }
    }
}

impl WasiView for JobState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        self.wasi.ctx()
    }
}

impl ToolsView for JobState {
    fn tools(&mut self) -> &mut ToolHost {
        &mut self.tools
    }
}

impl NetView for JobState {
    fn net(&mut self) -> NetCtxView<'_> {
        NetCtxView { sockets: self.wasi.sockets(), policy: self.net.as_ref() }
    }
}

/// Why the host stopped a guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    Limit(LimitKind),
    Cancelled,
}

/// The error a meter raises into the guest to stop it; the reason is kept in [`Meter::stop`].
#[derive(Debug)]
struct Stopped(Stop);

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Stop::Limit(limit) => write!(f, "{limit} limit exceeded"),
            Stop::Cancelled => f.write_str("cancelled"),
        }
    }
}

impl std::error::Error for Stopped {}

/// Enforces memory, wall, CPU and cancellation, and records peak memory.
pub(crate) struct Meter {
    memory_cap: u64,
    memory_now: u64,
    pub(crate) peak_memory: u64,
    pub(crate) wall_deadline: Instant,
    pub(crate) cpu_start: Duration,
    cpu_limit: Duration,
    cancel: Option<CancelToken>,
    pub(crate) stop: Option<Stop>,
}

impl Meter {
    pub(crate) fn new(limits: &Limits, cancel: Option<CancelToken>) -> Meter {
        let mut meter = Meter {
            memory_cap: 0,
            memory_now: 0,
            peak_memory: 0,
            wall_deadline: Instant::now(),
            cpu_start: Duration::ZERO,
            cpu_limit: Duration::ZERO,
            cancel: None,
            stop: None,
        };
        meter.arm(limits, cancel);
        meter
    }

    /// Arms the limits for a new job or turn; memory already in use stays counted.
    pub(crate) fn arm(&mut self, limits: &Limits, cancel: Option<CancelToken>) {
        let now = Instant::now();
        self.memory_cap = limits.memory.0.min(MAX_LINEAR_MEMORY);
        self.peak_memory = self.memory_now;
        self.wall_deadline = now.checked_add(limits.wall).unwrap_or(now + Duration::from_secs(86_400 * 365));
        self.cpu_start = thread_cpu_time();
        self.cpu_limit = limits.cpu;
        self.cancel = cancel;
        self.stop = None;
    }

    /// Counts `bytes` of linear memory that exist already (a memory mapped from a snapshot larger than the
    /// module's minimum, which the limiter saw).
    pub(crate) fn note_memory(&mut self, bytes: u64) {
        self.memory_now = self.memory_now.max(bytes);
        self.peak_memory = self.peak_memory.max(self.memory_now);
    }

    /// Whether the memory already in use is within the armed cap.
    pub(crate) fn fits(&self) -> bool {
        self.memory_now <= self.memory_cap
    }

    /// Checked at every epoch tick while the guest runs.
    fn check(&self) -> Option<Stop> {
        if self.cancel.as_ref().is_some_and(CancelToken::is_cancelled) {
            return Some(Stop::Cancelled);
        }
        if Instant::now() >= self.wall_deadline {
            return Some(Stop::Limit(LimitKind::Wall));
        }
        if thread_cpu_time().saturating_sub(self.cpu_start) > self.cpu_limit {
            return Some(Stop::Limit(LimitKind::Cpu));
        }
        None
    }

    fn trip(&mut self, stop: Stop) -> wasmtime::Error {
        self.stop = Some(stop);
        wasmtime::Error::new(Stopped(stop))
    }
}

impl ResourceLimiter for Meter {
    fn memory_growing(&mut self, current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        let total = self.memory_now.saturating_sub(current as u64).saturating_add(desired as u64);
        if total > self.memory_cap {
            // Past the cap the guest is stopped, as a cgroup OOM kill stops a process: the job reports
            // `limit_exceeded`/`memory` rather than whatever the guest's allocator does with a failed grow.
            return Err(self.trip(Stop::Limit(LimitKind::Memory)));
        }
        self.memory_now = total;
        self.peak_memory = self.peak_memory.max(total);
        Ok(true)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        Ok(desired <= MAX_TABLE_ELEMENTS)
    }
}

/// CPU time of the calling thread, which is the thread the guest runs on.
pub(crate) fn thread_cpu_time() -> Duration {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID).map(Duration::from).unwrap_or_default()
}

thread_local! {
    /// Each thread that runs jobs keeps one single-threaded tokio runtime: wasmtime's async calls, WASI's
    /// timers and the wall-clock timeout run on it, on the caller's own thread.
    static EXECUTOR: RefCell<Option<Executor>> = const { RefCell::new(None) };
}

/// A job thread's runtime, which never waits for its blocking pool when it goes (with its thread): a task
/// wasmtime-wasi handed to that pool (a name lookup, a file operation) may still be blocked in the host after
/// its job was stopped, and must not hold the job's thread, nor the process's exit, until it returns.
struct Executor(Option<tokio::runtime::Runtime>);

impl Drop for Executor {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

pub(crate) fn block_on<F: Future>(future: F) -> Result<F::Output, TierError> {
    if tokio::runtime::Handle::try_current().is_ok() {
        return Err(internal("a job was started on a thread inside an async runtime"));
    }
    // The runtime is taken out of its slot while it runs, so nothing borrowed is held across the job.
    let executor = match EXECUTOR.with(|cell| cell.borrow_mut().take()) {
        Some(executor) => executor,
        None => Executor(Some(
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| internal_from("cannot start the executor", e))?,
        )),
    };
    let Some(runtime) = &executor.0 else { return Err(internal("the executor is gone")) };
    let output = runtime.block_on(future);
    EXECUTOR.with(|cell| *cell.borrow_mut() = Some(executor));
    Ok(output)
}

/// Checks that the capabilities can be honoured on this tier, before anything is built. Whether a job can use
/// network egress depends on the job ([`refuse_net`]).
pub(crate) fn check_caps(caps: &Capabilities, registry: &ToolRegistry) -> Result<(), TierError> {
    caps.validate()?;
    registry.select(&caps.tools)?;
    Ok(())
}

/// Python on this tier, for [`refuse_net`].
pub(crate) const PYTHON: &str = "Python on wasm (CPython is a preview1 module)";

/// Refuses network egress for a job that cannot have sockets (`what`: a preview1 module, Python): only WASI 0.2
/// components get the network on this tier.
pub(crate) fn refuse_net(caps: &Capabilities, what: &str) -> Result<(), TierError> {
    match &caps.net {
        Net::Deny => Ok(()),
        Net::Allow(hosts) => Err(TierError::Unsupported {
            tier: TierKind::Wasm,
            what: format!(
                "network egress (--allow-net {}) for {what}; on this tier only WASI 0.2 components (wasm32-wasip2) \
                 have sockets",
                hosts.specs().join(",")
            ),
        }),
    }
}

/// A directory the guest sees besides the grants (the Python stdlib, a scratch `/tmp`).
pub(crate) struct Preopen {
    pub(crate) host: PathBuf,
    pub(crate) guest: String,
    pub(crate) writable: bool,
}

/// What a WASI context is built from.
pub(crate) struct WasiSpec<'a> {
    pub(crate) args: Vec<String>,
    /// Set before the capabilities' env, which may override them.
    pub(crate) base_env: Vec<(&'static str, String)>,
    pub(crate) caps: &'a Capabilities,
    pub(crate) stdin: GuestStdin<'a>,
    pub(crate) preopens: Vec<Preopen>,
    /// The guest's monotonic clock; WASI's default (zero when the context is made) when `None`.
    pub(crate) clock: Option<GuestClock>,
    /// The job's network (components only); `None` is no network at all.
    pub(crate) net: Option<Arc<NetPolicy>>,
    /// Where the guest's clocks and random bytes come from when the job is seeded, recorded or replayed (this
    /// takes the place of `clock`); the host's when `None`.
    pub(crate) inputs: Option<Arc<JobInputs>>,
}

impl<'a> WasiSpec<'a> {
    /// A one-shot command's context: argv `program args…`, the job's capabilities and stdin, WASI's own clock.
    pub(crate) fn command(program: &str, args: &[String], job: &JobContext<'a>, net: Option<Arc<NetPolicy>>) -> Self {
        let mut argv = vec![program.to_owned()];
        argv.extend(args.iter().cloned());
        WasiSpec {
            args: argv,
            base_env: Vec::new(),
            caps: job.caps,
            stdin: job.stdin.clone(),
            preopens: Vec::new(),
            clock: None,
            net,
            inputs: job.inputs.clone(),
        }
    }
}

/// A job's stdin.
#[derive(Debug, Clone)]
pub(crate) enum GuestStdin<'a> {
    /// All of it, known before the job starts.
    Bytes(&'a [u8]),
    /// A stream the job reads as it arrives ([`StreamedStdin`]).
    Stream(StdinStream),
    /// One the caller keeps, to switch it to another input later (a session's, between turns).
    Switched(StreamedStdin),
}

impl<'a> GuestStdin<'a> {
    /// The stdin of a job with these options: their stream, else their bytes, else none (at its end).
    pub(crate) fn of(opts: &'a ExecOptions) -> GuestStdin<'a> {
        match &opts.stdin_stream {
            Some(stream) => GuestStdin::Stream(stream.clone()),
            None => GuestStdin::Bytes(opts.stdin.as_deref().unwrap_or_default()),
        }
    }
}

/// A monotonic clock that starts at a given reading: a session's starts at zero, a fork's where its snapshot's
/// stood, so the guest never sees it go back.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GuestClock {
    base_ns: u64,
    started: Instant,
}

impl GuestClock {
    /// A clock reading `base_ns` now.
    pub(crate) fn starting_at(base_ns: u64) -> GuestClock {
        GuestClock { base_ns, started: Instant::now() }
    }

    /// What the guest reads now, in nanoseconds.
    pub(crate) fn now_ns(&self) -> u64 {
        let elapsed = u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.base_ns.saturating_add(elapsed)
    }
}

impl wasmtime_wasi::HostMonotonicClock for GuestClock {
    fn resolution(&self) -> u64 {
        1
    }

    fn now(&self) -> u64 {
        self.now_ns()
    }
}

/// The guest's clocks read from a seeded, recorded or replayed job's [`JobInputs`].
struct InputsClock(Arc<JobInputs>);

impl wasmtime_wasi::HostWallClock for InputsClock {
    fn resolution(&self) -> Duration {
        Duration::from_nanos(1)
    }

    fn now(&self) -> Duration {
        Duration::from_nanos(self.0.wall_clock_ns())
    }
}

impl wasmtime_wasi::HostMonotonicClock for InputsClock {
    fn resolution(&self) -> u64 {
        1
    }

    fn now(&self) -> u64 {
        self.0.monotonic_ns()
    }
}

/// The guest's random bytes (WASI's secure and insecure generators alike) from a job's [`JobInputs`].
struct InputsRandom(Arc<JobInputs>);

impl rand_core::TryRng for InputsRandom {
    type Error = std::convert::Infallible;

    fn try_next_u32(&mut self) -> Result<u32, Self::Error> {
        let mut bytes = [0u8; 4];
        self.0.fill_random(&mut bytes);
        Ok(u32::from_le_bytes(bytes))
    }

    fn try_next_u64(&mut self) -> Result<u64, Self::Error> {
        let mut bytes = [0u8; 8];
        self.0.fill_random(&mut bytes);
        Ok(u64::from_le_bytes(bytes))
    }

    fn try_fill_bytes(&mut self, dst: &mut [u8]) -> Result<(), Self::Error> {
        self.0.fill_random(dst);
        Ok(())
    }
}

/// The one place `Capabilities` become a WASI context: nothing is reachable that is not granted here.
pub(crate) fn wasi_ctx(spec: WasiSpec<'_>, captures: &Captures) -> Result<WasiP1Ctx, TierError> {
    let mut builder = WasiCtxBuilder::new();
    // Must come before the preopens, which capture it: file I/O runs on the job's thread instead of a pool.
    builder.allow_blocking_current_thread(true);
    builder.args(&spec.args);
    match &spec.inputs {
        Some(inputs) => {
            builder
                .wall_clock(InputsClock(inputs.clone()))
                .monotonic_clock(InputsClock(inputs.clone()))
                .secure_random(InputsRandom(inputs.clone()))
                .insecure_random(InputsRandom(inputs.clone()))
                .insecure_random_seed(inputs.insecure_seed());
        }
        None => {
            if let Some(clock) = spec.clock {
                builder.monotonic_clock(clock);
            }
        }
    }
    for (name, value) in &spec.base_env {
        builder.env(name, value);
    }
    for var in spec.caps.guest_env() {
        builder.env(&var.name, &var.value);
    }
    match spec.stdin {
        GuestStdin::Bytes(bytes) => builder.stdin(MemoryInputPipe::new(bytes.to_vec())),
        GuestStdin::Stream(stream) => builder.stdin(StreamedStdin::new(stream)),
        GuestStdin::Switched(stdin) => builder.stdin(stdin),
    };
    builder.stdout(WasiOutput(captures.stdout.clone())).stderr(WasiOutput(captures.stderr.clone()));
    crate::net::configure(&mut builder, spec.net.as_ref());
    for preopen in &spec.preopens {
        let perms = if preopen.writable { FsPerms::ReadWrite } else { FsPerms::ReadOnly };
        builder
            .preopened_dir(&preopen.host, &preopen.guest, perms)
            .map_err(|e| internal(format!("cannot open {}: {e}", preopen.host.display())))?;
    }
    for grant in &spec.caps.grants {
        let perms = match grant.mode {
            GrantMode::Ro => FsPerms::ReadOnly,
            GrantMode::Rw => FsPerms::ReadWrite,
        };
        builder
            .preopened_dir(&grant.host, &grant.guest, perms)
            .map_err(|_| strata_core::CapsError::GrantNotFound(grant.host.clone()))?;
    }
    Ok(builder.build_p1())
}

/// A job's stdout and stderr captures.
pub(crate) struct Captures {
    pub(crate) stdout: OutputCapture,
    pub(crate) stderr: OutputCapture,
}

impl Captures {
    pub(crate) fn new(caps: &Capabilities, limits: &Limits, sink: Option<Arc<dyn OutputSink>>) -> Captures {
        let secrets = caps.secret_values();
        Captures {
            stdout: OutputCapture::new(Stream::Stdout, limits.output.0, secrets.clone(), sink.clone()),
            stderr: OutputCapture::new(Stream::Stderr, limits.output.0, secrets, sink),
        }
    }

    pub(crate) fn restart(&self, limits: &Limits, sink: Option<Arc<dyn OutputSink>>) {
        self.stdout.restart(limits.output.0, sink.clone());
        self.stderr.restart(limits.output.0, sink);
    }

    pub(crate) fn finish(&self) -> (Captured, Captured) {
        (self.stdout.finish(), self.stderr.finish())
    }
}

/// A store with the meter as its limiter, fuel set when the engine is metered, and the epoch callback armed.
pub(crate) fn new_store(runtime: &Runtime<JobState>, state: JobState) -> Store<JobState> {
    let mut store = Store::new(&runtime.engine, state);
    store.limiter(|state| &mut state.meter);
    store.epoch_deadline_callback(|mut ctx| {
        let meter = &mut ctx.data_mut().meter;
        match meter.check() {
            Some(stop) => Err(meter.trip(stop)),
            None => Ok(UpdateDeadline::Continue(1)),
        }
    });
    store
}

/// Sets the fuel budget of the next call: the job's limit, or all there is when the engine is metered and the
/// job set none (so fuel is still reported). Returns the budget.
pub(crate) fn set_fuel(
    runtime: &Runtime<JobState>,
    store: &mut Store<JobState>,
    limits: &Limits,
) -> Result<Option<u64>, TierError> {
    if !runtime.metered {
        return Ok(None);
    }
    let budget = limits.fuel.limit().unwrap_or(u64::MAX);
    store.set_fuel(budget).map_err(internal)?;
    Ok(Some(budget))
}

/// How a guarded call ended.
pub(crate) enum Ended<T> {
    Returned(wasmtime::Result<T>),
    WallTimeout,
    Cancelled,
}

/// Runs `future` (a guest call) until it returns, the wall deadline passes (also while the guest is blocked in
/// a host call), or the job is cancelled.
pub(crate) fn guarded<T, F: Future<Output = wasmtime::Result<T>>>(
    future: F,
    wall_deadline: Instant,
    cancel: Option<&CancelToken>,
) -> Result<Ended<T>, TierError> {
    block_on(async {
        let cancelled = async {
            match cancel {
                Some(token) => token.cancelled().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            result = tokio::time::timeout_at(wall_deadline.into(), future) => match result {
                Ok(returned) => Ended::Returned(returned),
                Err(_) => Ended::WallTimeout,
            },
            () = cancelled => Ended::Cancelled,
        }
    })
}

/// The status of a guarded call; `returned` maps a normal return.
pub(crate) fn status_of<T>(
    ended: Ended<T>,
    stop: Option<Stop>,
    returned: impl FnOnce(T) -> Status,
) -> Result<Status, TierError> {
    match ended {
        Ended::WallTimeout => Ok(Status::LimitExceeded { limit: LimitKind::Wall }),
        Ended::Cancelled => Err(TierError::Cancelled),
        Ended::Returned(Ok(value)) => Ok(returned(value)),
        Ended::Returned(Err(err)) => match stop {
            Some(Stop::Limit(limit)) => Ok(Status::LimitExceeded { limit }),
            Some(Stop::Cancelled) => Err(TierError::Cancelled),
            None => classify(&err),
        },
    }
}

/// What a finished job or turn measured, besides its output.
pub(crate) struct Measured {
    pub(crate) started: Instant,
    pub(crate) cpu_start: Duration,
    pub(crate) fuel_budget: Option<u64>,
}

impl Measured {
    pub(crate) fn start(store: &Store<JobState>, fuel_budget: Option<u64>) -> Measured {
        Measured { started: Instant::now(), cpu_start: store.data().meter.cpu_start, fuel_budget }
    }

    /// Assembles the outcome; reads fuel and peak memory from `store`.
    pub(crate) fn outcome(
        &self,
        status: Status,
        store: &mut Store<JobState>,
        captures: &Captures,
        tools: Vec<ToolCall>,
    ) -> Outcome {
        let wall = self.started.elapsed();
        let cpu = thread_cpu_time().saturating_sub(self.cpu_start);
        let fuel = self.fuel_budget.map(|budget| budget.saturating_sub(store.get_fuel().unwrap_or(0)));
        let peak_memory = store.data().meter.peak_memory;
        let (out, err) = captures.finish();
        Outcome {
            truncated: Truncated { stdout: out.truncated, stderr: err.truncated, egress: 0 },
            usage: Usage { wall, cpu, fuel, peak_memory, stdout_bytes: out.written, stderr_bytes: err.written },
            stdout: out.bytes,
            stderr: err.bytes,
            tools,
            ..Outcome::new(TierKind::Wasm, status)
        }
    }
}

/// What every one-shot job brings besides its program: capabilities, limits, stdin, output sink, cancel
/// token and tools.
pub(crate) struct JobContext<'a> {
    pub(crate) caps: &'a Capabilities,
    pub(crate) limits: &'a Limits,
    pub(crate) stdin: GuestStdin<'a>,
    pub(crate) sink: Option<Arc<dyn OutputSink>>,
    pub(crate) cancel: Option<CancelToken>,
    pub(crate) tools: ToolHost,
    /// The clocks, random bytes and tool answers of a seeded, recorded or replayed job.
    pub(crate) inputs: Option<Arc<JobInputs>>,
}

/// A store ready for a one-shot job: limits armed, fuel set, the epoch ticker running while it lives.
pub(crate) struct ArmedStore<'r> {
    pub(crate) store: Store<JobState>,
    pub(crate) measured: Measured,
    pub(crate) wall_deadline: Instant,
    pub(crate) _running: crate::epoch::Running<'r>,
}

/// Builds the store of a one-shot job around its WASI context.
pub(crate) fn arm_store<'r>(
    runtime: &'r Runtime<JobState>,
    wasi: WasiP1Ctx,
    limits: &Limits,
    cancel: Option<CancelToken>,
    tools: ToolHost,
) -> Result<ArmedStore<'r>, TierError> {
    let running = runtime.ticker.enter().map_err(|e| internal_from("cannot start the epoch thread", e))?;
    let meter = Meter::new(limits, cancel);
    let mut store = new_store(runtime, JobState { wasi, meter, tools, net: None });
    let fuel_budget = set_fuel(runtime, &mut store, limits)?;
    store.set_epoch_deadline(1);
    let measured = Measured::start(&store, fuel_budget);
    let wall_deadline = store.data().meter.wall_deadline;
    Ok(ArmedStore { store, measured, wall_deadline, _running: running })
}

/// Runs a prepared WASI command to completion.
pub(crate) fn execute(
    runtime: &Runtime<JobState>,
    prepared: &Prepared<JobState>,
    program: &str,
    args: &[String],
    job: JobContext<'_>,
) -> Result<Outcome, TierError> {
    refuse_net(job.caps, &format!("{program}, a WASI preview1 module (preview1 has no sockets)"))?;
    let captures = Captures::new(job.caps, job.limits, job.sink.clone());
    let wasi = wasi_ctx(WasiSpec::command(program, args, &job, None), &captures)?;
    let ArmedStore { mut store, measured, wall_deadline, _running } =
        arm_store(runtime, wasi, job.limits, job.cancel.clone(), job.tools)?;

    let ended = guarded(
        async {
            let instance = prepared.pre.instantiate_async(&mut store).await?;
            let start = instance.get_typed_func::<(), ()>(&mut store, "_start")?;
            start.call_async(&mut store, ()).await
        },
        wall_deadline,
        job.cancel.as_ref(),
    )?;
    let status = status_of(ended, store.data().meter.stop, |()| Status::Exited { code: 0 })?;
    let tools = store.data_mut().tools.take_records();
    Ok(measured.outcome(status, &mut store, &captures, tools))
}

/// How a guest that ended with an error (and was not stopped by the meter) ended.
pub(crate) fn classify(err: &wasmtime::Error) -> Result<Status, TierError> {
    if let Some(exit) = err.downcast_ref::<I32Exit>() {
        return Ok(Status::Exited { code: exit.0 });
    }
    if let Some(Trap::OutOfFuel) = err.downcast_ref::<Trap>() {
        return Ok(Status::LimitExceeded { limit: LimitKind::Fuel });
    }
    if let Some(limit) = err.downcast_ref::<wasmtime::PoolConcurrencyLimitError>() {
        return Err(TierError::Capacity { tier: TierKind::Wasm, reason: limit.to_string() });
    }
    // A trap reads best as its cause first ("wasm trap: wasm `unreachable` instruction executed"), then the
    // guest's stack; other errors (a host function that failed) as their chain of causes.
    let mut message = if err.downcast_ref::<Trap>().is_some() { err.root_cause().to_string() } else { describe(err) };
    if let Some(backtrace) = err.downcast_ref::<WasmBacktrace>() {
        let frames = backtrace.to_string();
        let frames = frames.trim_end().strip_prefix("error while executing at ").unwrap_or(frames.trim_end());
        if !frames.trim().is_empty() {
            message.push('\n');
            message.push_str(frames);
        }
    }
    Ok(Status::Trapped { message })
}
