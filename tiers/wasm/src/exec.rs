//! Running one job: the WASI context built from `Capabilities`, the store with its limits, and the mapping of
//! how the guest ended to an `Outcome`.

use std::cell::RefCell;
use std::future::Future;
use std::time::{Duration, Instant};

use strata_core::{
    CancelToken, Capabilities, GrantMode, LimitKind, Limits, Net, Outcome, Status, Stream, TierError, TierKind,
    Truncated, Usage,
};
use strata_wasi_shims::OutputCapture;
use wasmtime::{ResourceLimiter, Store, Trap, UpdateDeadline, WasmBacktrace};
use wasmtime_wasi::p1::WasiP1Ctx;
use wasmtime_wasi::p2::pipe::MemoryInputPipe;
use wasmtime_wasi::{FsPerms, I32Exit, WasiCtxBuilder};

use crate::runtime::{MAX_LINEAR_MEMORY, MAX_TABLE_ELEMENTS, Prepared, Runtime, describe};

/// Per-store state: the guest's WASI context and the meter that enforces its limits.
pub(crate) struct JobState {
    pub(crate) wasi: WasiP1Ctx,
    meter: Meter,
}

impl JobState {
    /// State with nothing granted and no limits armed; used to inspect the linker.
    pub(crate) fn empty() -> JobState {
        JobState { wasi: WasiCtxBuilder::new().build_p1(), meter: Meter::new(&Limits::default(), None) }
    }
}

/// Why the host stopped a guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
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
struct Meter {
    memory_cap: u64,
    memory_now: u64,
    peak_memory: u64,
    wall_deadline: Instant,
    cpu_start: Duration,
    cpu_limit: Duration,
    cancel: Option<CancelToken>,
    stop: Option<Stop>,
}

impl Meter {
    fn new(limits: &Limits, cancel: Option<CancelToken>) -> Meter {
        let now = Instant::now();
        Meter {
            memory_cap: limits.memory.0.min(MAX_LINEAR_MEMORY),
            memory_now: 0,
            peak_memory: 0,
            wall_deadline: now.checked_add(limits.wall).unwrap_or(now + Duration::from_secs(86_400 * 365)),
            cpu_start: thread_cpu_time(),
            cpu_limit: limits.cpu,
            cancel,
            stop: None,
        }
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
fn thread_cpu_time() -> Duration {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID).map(Duration::from).unwrap_or_default()
}

thread_local! {
    /// Each thread that runs jobs keeps one single-threaded tokio runtime: wasmtime's async calls, WASI's
    /// timers and the wall-clock timeout run on it, on the caller's own thread.
    static EXECUTOR: RefCell<Option<tokio::runtime::Runtime>> = const { RefCell::new(None) };
}

fn block_on<F: Future>(future: F) -> Result<F::Output, TierError> {
    if tokio::runtime::Handle::try_current().is_ok() {
        return Err(TierError::Internal {
            tier: TierKind::Wasm,
            message: "a job was started on a thread inside an async runtime".into(),
        });
    }
    // The runtime is taken out of its slot while it runs, so nothing borrowed is held across the job.
    let runtime = match EXECUTOR.with(|cell| cell.borrow_mut().take()) {
        Some(runtime) => runtime,
        None => tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| {
            TierError::Internal { tier: TierKind::Wasm, message: format!("cannot start the executor: {e}") }
        })?,
    };
    let output = runtime.block_on(future);
    EXECUTOR.with(|cell| *cell.borrow_mut() = Some(runtime));
    Ok(output)
}

/// Everything one run needs besides the module.
pub(crate) struct JobSpec<'a> {
    pub(crate) program: &'a str,
    pub(crate) args: &'a [String],
    pub(crate) caps: &'a Capabilities,
    pub(crate) limits: &'a Limits,
    pub(crate) stdin: &'a [u8],
    pub(crate) sink: Option<std::sync::Arc<dyn strata_core::OutputSink>>,
    pub(crate) cancel: Option<CancelToken>,
}

/// Checks that the capabilities can be honoured on this tier, before anything is built.
pub(crate) fn check_caps(caps: &Capabilities) -> Result<(), TierError> {
    caps.validate()?;
    if let Net::Allow(hosts) = &caps.net {
        return Err(TierError::Unsupported {
            tier: TierKind::Wasm,
            what: format!("network egress (--allow-net {}); jobs on this tier have no network", hosts.join(",")),
        });
    }
    if let Some(tool) = caps.tools.first() {
        return Err(TierError::Unsupported { tier: TierKind::Wasm, what: format!("host tool {tool:?}") });
    }
    Ok(())
}

/// The one place `Capabilities` become a WASI context: nothing is reachable that is not granted here.
fn wasi_ctx(spec: &JobSpec<'_>, stdout: OutputCapture, stderr: OutputCapture) -> Result<WasiP1Ctx, TierError> {
    let mut builder = WasiCtxBuilder::new();
    // Must come before the preopens, which capture it: file I/O runs on the job's thread instead of a pool.
    builder.allow_blocking_current_thread(true);
    builder.arg(spec.program).args(spec.args);
    for var in spec.caps.guest_env() {
        builder.env(&var.name, &var.value);
    }
    builder
        .stdin(MemoryInputPipe::new(spec.stdin.to_vec()))
        .stdout(stdout)
        .stderr(stderr)
        .allow_tcp(false)
        .allow_udp(false)
        .allow_ip_name_lookup(false);
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

enum Ended {
    Returned(wasmtime::Result<()>),
    WallTimeout,
    Cancelled,
}

/// Runs a prepared module to completion.
pub(crate) fn execute(runtime: &Runtime, prepared: &Prepared, spec: JobSpec<'_>) -> Result<Outcome, TierError> {
    let limits = spec.limits;
    let secrets = spec.caps.secret_values();
    let stdout = OutputCapture::new(Stream::Stdout, limits.output.0, secrets.clone(), spec.sink.clone());
    let stderr = OutputCapture::new(Stream::Stderr, limits.output.0, secrets, spec.sink.clone());
    let wasi = wasi_ctx(&spec, stdout.clone(), stderr.clone())?;

    let _running = runtime.ticker.enter().map_err(|e| TierError::Internal {
        tier: TierKind::Wasm,
        message: format!("cannot start the epoch thread: {e}"),
    })?;
    let started = Instant::now();
    let meter = Meter::new(limits, spec.cancel.clone());
    let wall_deadline = meter.wall_deadline;
    let cpu_start = meter.cpu_start;
    let mut store = Store::new(&runtime.engine, JobState { wasi, meter });
    store.limiter(|state| &mut state.meter);
    let fuel_budget = limits.fuel.limit().filter(|_| runtime.metered);
    if let Some(fuel) = fuel_budget {
        store.set_fuel(fuel).map_err(|e| TierError::Internal { tier: TierKind::Wasm, message: e.to_string() })?;
    }
    store.set_epoch_deadline(1);
    store.epoch_deadline_callback(|mut ctx| {
        let meter = &mut ctx.data_mut().meter;
        match meter.check() {
            Some(stop) => Err(meter.trip(stop)),
            None => Ok(UpdateDeadline::Continue(1)),
        }
    });

    let cancel = spec.cancel.clone();
    let ended = block_on(async {
        let run = async {
            let instance = prepared.pre.instantiate_async(&mut store).await?;
            let start = instance.get_typed_func::<(), ()>(&mut store, "_start")?;
            start.call_async(&mut store, ()).await
        };
        let cancelled = async {
            match &cancel {
                Some(token) => token.cancelled().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            result = tokio::time::timeout_at(wall_deadline.into(), run) => match result {
                Ok(returned) => Ended::Returned(returned),
                Err(_) => Ended::WallTimeout,
            },
            () = cancelled => Ended::Cancelled,
        }
    })?;
    let wall = started.elapsed();
    let cpu = thread_cpu_time().saturating_sub(cpu_start);

    let status = match ended {
        Ended::WallTimeout => Status::LimitExceeded { limit: LimitKind::Wall },
        Ended::Cancelled => return Err(TierError::Cancelled),
        Ended::Returned(Ok(())) => Status::Exited { code: 0 },
        Ended::Returned(Err(err)) => match store.data().meter.stop {
            Some(Stop::Limit(limit)) => Status::LimitExceeded { limit },
            Some(Stop::Cancelled) => return Err(TierError::Cancelled),
            None => classify(&err)?,
        },
    };
    let fuel = fuel_budget.map(|budget| budget.saturating_sub(store.get_fuel().unwrap_or(0)));
    let peak_memory = store.data().meter.peak_memory;
    // Returns the instance's pool slot before the outcome is assembled.
    drop(store);

    let (out, err) = (stdout.finish(), stderr.finish());
    Ok(Outcome {
        tier: TierKind::Wasm,
        status,
        truncated: Truncated { stdout: out.truncated, stderr: err.truncated },
        usage: Usage { wall, cpu, fuel, peak_memory, stdout_bytes: out.written, stderr_bytes: err.written },
        stdout: out.bytes,
        stderr: err.bytes,
        escalations: Vec::new(),
    })
}

/// How a guest that ended with an error (and was not stopped by the meter) ended.
fn classify(err: &wasmtime::Error) -> Result<Status, TierError> {
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
