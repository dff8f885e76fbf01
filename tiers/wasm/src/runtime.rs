//! One wasmtime engine configuration (fuel-metered or not), its linkers (preview1 modules; WASI 0.2 components,
//! made on first use), and the modules and components prepared for it.
//!
//! A runtime is generic over what its stores hold ([`StoreData`]): the linkers reach a store's WASI context,
//! tools and network through the views that the host functions' own modules define ([`ToolsView`], [`NetView`]).

use std::collections::{HashMap, HashSet};
use std::hash::Hasher;
use std::sync::{Arc, Mutex, OnceLock};

use strata_core::{TierError, TierKind};
use wasmtime::component::Component;
use wasmtime::{
    Config, Enabled, Engine, ExternType, InstanceAllocationStrategy, InstancePre, Linker, Module, OptLevel,
    PoolingAllocationConfig, Store,
};
use wasmtime_wasi::WasiView;
use wasmtime_wasi::p1::WasiP1Ctx;
use wasmtime_wasi::p2::bindings::CommandPre;

use crate::cache::{CacheOutcome, Digest, ModuleCache};
use crate::epoch::EpochTicker;
use crate::error::{internal, internal_from, lock};
use crate::net::NetView;
use crate::snapshot::memory_image::MappedMemoryCreator;
use crate::tools::ToolsView;

/// The guest's WebAssembly stack; CPython in wasm needs 8 MiB (wasi-python-abi.md §2).
pub(crate) const MAX_WASM_STACK: usize = 8 << 20;
/// Largest table a module may have or grow to (CPython's function table has 47,157 entries).
pub(crate) const MAX_TABLE_ELEMENTS: usize = 1 << 17;
/// Largest instance metadata (vmctx) a module may need.
const MAX_INSTANCE_SIZE: usize = 8 << 20;
/// Largest linear memory of a wasm32 module.
pub(crate) const MAX_LINEAR_MEMORY: u64 = 4 << 30;
/// Most core instances one component may hold (instance slots are counters, not reservations).
const MAX_CORE_INSTANCES_PER_COMPONENT: u32 = 16;
/// Most tables one component may hold (each table slot reserves address space for [`MAX_TABLE_ELEMENTS`]).
const MAX_TABLES_PER_COMPONENT: u32 = 4;

/// Modules at least this large get progress messages while they compile.
const PROGRESS_MODULE_SIZE: usize = 4 << 20;
/// How often a long compile says it is still going.
const PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_secs(15);

/// Progress lines for a long compile: one at the start, one every [`PROGRESS_EVERY`], one at the end.
struct CompileProgress {
    name: String,
    started: std::time::Instant,
    done: Option<std::sync::mpsc::Sender<()>>,
    ticker: Option<std::thread::JoinHandle<()>>,
}

impl CompileProgress {
    /// `size` is the module's size, `code` the bytes of its function bodies (what compiling costs).
    fn start(name: &str, size: usize, code: usize) -> CompileProgress {
        log::info!(
            "compiling {name} ({:.1} MB) for this machine, once: {}; later runs load it from the cache",
            size as f64 / 1e6,
            compile_estimate(code)
        );
        let started = std::time::Instant::now();
        let (done, wait) = std::sync::mpsc::channel::<()>();
        let label = name.to_owned();
        let ticker = std::thread::Builder::new()
            .name("strata-progress".into())
            .spawn(move || {
                while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = wait.recv_timeout(PROGRESS_EVERY) {
                    log::info!("still compiling {label} ({}s)", started.elapsed().as_secs());
                }
            })
            .ok();
        CompileProgress { name: name.to_owned(), started, done: Some(done), ticker }
    }
}

/// Cranelift's measured rate on the Python runtime's function bodies, in CPU-seconds per MB of code.
const COMPILE_CPU_SECONDS_PER_CODE_MB: f64 = 2.4;

/// The bytes of a core module's function bodies (its code section), which is what compiling it costs; a
/// component's whole size. Reads section headers only.
fn code_bytes(bytes: &[u8]) -> usize {
    for payload in wasmparser::Parser::new(0).parse_all(bytes) {
        match payload {
            Ok(wasmparser::Payload::CodeSectionStart { size, .. }) => return size as usize,
            Ok(wasmparser::Payload::Version { encoding: wasmparser::Encoding::Component, .. }) => return bytes.len(),
            Ok(_) => {}
            Err(_) => break,
        }
    }
    0
}

/// How long compiling `code` bytes of function bodies usually takes here, in words: wasmtime compiles functions
/// in parallel, one thread per CPU.
fn compile_estimate(code: usize) -> String {
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let seconds = code as f64 / 1e6 * COMPILE_CPU_SECONDS_PER_CODE_MB / cpus as f64;
    let cores = if cpus == 1 { "one core".to_owned() } else { format!("{cpus} cores") };
    match seconds {
        s if s < 10.0 => format!("usually under 10 seconds on {cores}"),
        s if s < 90.0 => format!("usually about {} seconds on {cores}", (s / 10.0).round() * 10.0),
        s => format!("usually about {} minutes on {cores}", (s / 60.0).round()),
    }
}

impl Drop for CompileProgress {
    fn drop(&mut self) {
        drop(self.done.take());
        if let Some(ticker) = self.ticker.take() {
            let _ = ticker.join();
        }
        log::info!("compiled {} in {:.1}s", self.name, self.started.elapsed().as_secs_f64());
    }
}

/// How many prepared modules each engine keeps in memory before it forgets them all and starts again. Each
/// holds compiled code; the disk cache makes a re-prepare cheap.
const MAX_PREPARED: usize = 256;

/// What the stores of a runtime's instances hold: a preview1 WASI context, WASI 0.2's view of the same
/// context, and a job's tools and network, each as its linker functions reach it.
pub(crate) trait StoreData: WasiView + ToolsView + NetView + Sized {
    /// The preview1 context.
    fn preview1(&mut self) -> &mut WasiP1Ctx;

    /// Data with nothing granted and no limits armed; used to inspect the linker.
    fn empty() -> Self;
}

/// A module ready to instantiate.
pub(crate) struct Prepared<T: 'static> {
    pub(crate) pre: InstancePre<T>,
}

/// A WASI 0.2 command component ready to instantiate.
pub(crate) struct PreparedComponent<T: 'static> {
    pub(crate) pre: CommandPre<T>,
}

/// The component linker: WASI 0.2 with Strata's name-lookup filter.
type ComponentLinker<T> = wasmtime::component::Linker<T>;

/// A wasmtime engine with its linker, epoch ticker and prepared modules.
pub(crate) struct Runtime<T: 'static> {
    pub(crate) engine: Engine,
    pub(crate) linker: Linker<T>,
    pub(crate) ticker: EpochTicker,
    pub(crate) metered: bool,
    fingerprint: Digest,
    provided: HashSet<(String, String)>,
    prepared: Mutex<HashMap<Digest, Arc<Prepared<T>>>>,
    components: OnceLock<Result<ComponentLinker<T>, String>>,
    prepared_components: Mutex<HashMap<Digest, Arc<PreparedComponent<T>>>>,
}

/// Feeds `Hash` output into BLAKE3, so an engine's compatibility hash becomes a stable digest.
struct DigestHasher(blake3::Hasher);

impl Hasher for DigestHasher {
    fn finish(&self) -> u64 {
        let bytes = self.0.finalize();
        u64::from_le_bytes(bytes.as_bytes()[..8].try_into().unwrap_or([0; 8]))
    }

    fn write(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
}

/// How an engine allocates instances.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Allocation {
    /// The pooling allocator with copy-on-write images of the modules' data: one-shot jobs.
    Pooled,
    /// On demand, each linear memory mapped from a memory image ([`crate::snapshot::memory_image`]):
    /// snapshot-ready sessions and their forks.
    Mapped,
}

/// The configuration of an engine with `max_instances` instance slots (the tier config's `max_instances`).
fn engine_config(max_instances: u32, metered: bool, allocation: Allocation) -> Config {
    let slots = max_instances.max(1);
    let mut pool = PoolingAllocationConfig::new();
    // A slot is one job. A component job holds several core instances and tables (a Rust `wasm32-wasip2` command:
    // its program, wit-component's shim and fixup modules; 3 instances, 2 tables, 1 memory), so the pool has room
    // for a component's worth per slot; the stacks (one per running job) and component instances bound the jobs.
    pool.total_core_instances(slots.saturating_mul(MAX_CORE_INSTANCES_PER_COMPONENT))
        .total_component_instances(slots)
        .max_core_instances_per_component(MAX_CORE_INSTANCES_PER_COMPONENT)
        .max_memories_per_component(2)
        .max_tables_per_component(MAX_TABLES_PER_COMPONENT)
        // A module that uses exceptions (CPython) also takes a GC heap, which lives in a memory slot.
        .total_memories(slots.saturating_mul(2))
        .total_gc_heaps(slots)
        .total_tables(slots.saturating_mul(MAX_TABLES_PER_COMPONENT))
        .total_stacks(slots)
        .max_memory_size(MAX_LINEAR_MEMORY as usize)
        .table_elements(MAX_TABLE_ELEMENTS)
        // CPython's vmctx holds 89,060 function references: 1.5 MB, over the 1 MiB default.
        .max_core_instance_size(MAX_INSTANCE_SIZE)
        .pagemap_scan(Enabled::Auto);
    // Where the kernel can say which pages a job dirtied (PAGEMAP_SCAN, Linux 6.7+), a used slot is reset by
    // copying back just those pages and keeps them mapped, so the next job on it takes no page faults: for
    // CPython, whose heap starts at 40 MiB, that halves a one-shot job. Otherwise only the first MiB is reset in
    // place (a memset of that whole MiB) and the rest is returned to the kernel.
    let (memory_resident, table_resident) =
        if PoolingAllocationConfig::is_pagemap_scan_available() { (64 << 20, 1 << 20) } else { (1 << 20, 64 << 10) };
    pool.linear_memory_keep_resident(memory_resident).table_keep_resident(table_resident);

    let mut config = Config::new();
    config
        .consume_fuel(metered)
        .epoch_interruption(true)
        .wasm_exceptions(true)
        .max_wasm_stack(MAX_WASM_STACK)
        .async_stack_size(MAX_WASM_STACK + (1 << 20))
        .memory_init_cow(true)
        .cranelift_opt_level(OptLevel::Speed)
        .allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
    if allocation == Allocation::Mapped {
        config
            .allocation_strategy(InstanceAllocationStrategy::OnDemand)
            .with_host_memory(Arc::new(MappedMemoryCreator));
    }
    config
}

impl<T: StoreData> Runtime<T> {
    pub(crate) fn new(max_instances: u32, metered: bool, allocation: Allocation) -> Result<Self, TierError> {
        let engine = Engine::new(&engine_config(max_instances, metered, allocation))
            .map_err(|e| internal_from("cannot create the wasmtime engine", e))?;
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p1::add_to_linker_async(&mut linker, T::preview1)
            .map_err(|e| internal_from("cannot link WASI", e))?;
        // Its sleeps on the job's executor, where the wall limit and a cancel end them.
        strata_wasi_shims::poll::add_to_linker(&mut linker, T::preview1)
            .map_err(|e| internal_from("cannot link poll_oneoff", e))?;
        // File I/O runs inline: no opening what could wait for ever there (a FIFO, a device).
        strata_wasi_shims::open::add_to_linker(&mut linker, T::preview1)
            .map_err(|e| internal_from("cannot link path_open", e))?;
        crate::tools::add_to_linker(&mut linker).map_err(|e| internal_from("cannot link host.call", e))?;

        let mut hasher = DigestHasher(blake3::Hasher::new());
        std::hash::Hash::hash(&engine.precompile_compatibility_hash(), &mut hasher);
        let fingerprint = *hasher.0.finalize().as_bytes();

        let mut store = Store::new(&engine, T::empty());
        let provided = linker.iter(&mut store).map(|(module, name, _)| (module.to_owned(), name.to_owned())).collect();
        drop(store);

        Ok(Runtime {
            ticker: EpochTicker::new(engine.clone()),
            engine,
            linker,
            metered,
            fingerprint,
            provided,
            prepared: Mutex::new(HashMap::new()),
            components: OnceLock::new(),
            prepared_components: Mutex::new(HashMap::new()),
        })
    }

    /// The component linker, made on first use.
    fn component_linker(&self) -> Result<&ComponentLinker<T>, TierError> {
        self.components
            .get_or_init(|| {
                component_linker(&self.engine).map_err(|e| format!("cannot link WASI 0.2: {}", describe(&e)))
            })
            .as_ref()
            .map_err(internal)
    }

    /// Returns the prepared component for `bytes` (whose BLAKE3 digest is `hash`), compiling it or loading it
    /// from the disk cache on first use. It must be a `wasi:cli/command` whose imports the linker provides.
    pub(crate) fn prepare_component(
        &self,
        cache: Option<&ModuleCache>,
        name: &str,
        hash: &Digest,
        bytes: impl FnOnce() -> Result<Arc<[u8]>, TierError>,
    ) -> Result<(Arc<PreparedComponent<T>>, Option<CacheOutcome>), TierError> {
        if let Some(prepared) = lock(&self.prepared_components).get(hash) {
            return Ok((prepared.clone(), None));
        }
        let linker = self.component_linker()?;
        let invalid = |reason: String| TierError::InvalidModule { name: name.to_owned(), reason };
        let compile = || {
            let bytes = bytes()?;
            if format_of(name, &bytes)? != Format::Component {
                return Err(invalid("it is a core module, not a component".into()));
            }
            let _progress = (bytes.len() >= PROGRESS_MODULE_SIZE)
                .then(|| CompileProgress::start(name, bytes.len(), code_bytes(&bytes)));
            Component::new(&self.engine, &bytes).map_err(|e| invalid(describe(&e)))
        };
        let (component, outcome) = match cache {
            Some(cache) => {
                let key = ModuleCache::component_key(&self.fingerprint, hash);
                let (component, outcome) = cache.load_or_compile(&self.engine, &key, compile)?;
                (component, Some(outcome))
            }
            None => (compile()?, None),
        };
        let pre = linker.instantiate_pre(&component).map_err(|err| link_error(name, &err))?;
        let pre = CommandPre::new(pre).map_err(|err| {
            invalid(format!(
                "it is not a WASI 0.2 command (a `wasi:cli/command` exporting `wasi:cli/run`): {}",
                describe(&err)
            ))
        })?;
        let prepared = Arc::new(PreparedComponent { pre });
        let mut map = lock(&self.prepared_components);
        if map.len() >= MAX_PREPARED {
            map.clear();
        }
        map.insert(*hash, prepared.clone());
        Ok((prepared, outcome))
    }

    /// Returns the prepared module for `bytes` (whose BLAKE3 digest is `hash`), compiling it or loading it
    /// from the disk cache on first use.
    pub(crate) fn prepare(
        &self,
        cache: Option<&ModuleCache>,
        name: &str,
        hash: &Digest,
        expect: Expect,
        bytes: impl FnOnce() -> Result<Arc<[u8]>, TierError>,
    ) -> Result<(Arc<Prepared<T>>, Option<CacheOutcome>), TierError> {
        if let Some(prepared) = self.lock_prepared().get(hash) {
            return Ok((prepared.clone(), None));
        }
        let invalid = |err: wasmtime::Error| TierError::InvalidModule { name: name.to_owned(), reason: describe(&err) };
        // The bytes are only needed to compile: a module in the disk cache is mapped without reading them.
        let compile = || {
            let bytes = bytes()?;
            check_format(name, &bytes)?;
            // Large modules take seconds to minutes to compile; say so, since only the first run pays it.
            let _progress = (bytes.len() >= PROGRESS_MODULE_SIZE)
                .then(|| CompileProgress::start(name, bytes.len(), code_bytes(&bytes)));
            Module::new(&self.engine, &bytes).map_err(invalid)
        };
        let (module, outcome) = match cache {
            Some(cache) => {
                let key = ModuleCache::key(&self.fingerprint, hash);
                let (module, outcome) = cache.load_or_compile(&self.engine, &key, compile)?;
                (module, Some(outcome))
            }
            None => (compile()?, None),
        };
        self.check_imports(name, &module)?;
        expect.check(name, &module)?;
        let pre = self.linker.instantiate_pre(&module).map_err(invalid)?;
        let prepared = Arc::new(Prepared { pre });
        let mut map = self.lock_prepared();
        if map.len() >= MAX_PREPARED {
            map.clear();
        }
        map.insert(*hash, prepared.clone());
        Ok((prepared, outcome))
    }

    fn lock_prepared(&self) -> std::sync::MutexGuard<'_, HashMap<Digest, Arc<Prepared<T>>>> {
        lock(&self.prepared)
    }

    /// A module imports only what the linker provides.
    fn check_imports(&self, name: &str, module: &Module) -> Result<(), TierError> {
        for import in module.imports() {
            if !self.provided.contains(&(import.module().to_owned(), import.name().to_owned())) {
                return Err(TierError::UnknownImport {
                    name: name.to_owned(),
                    import: format!("{}::{}", import.module(), import.name()),
                });
            }
        }
        Ok(())
    }
}

/// What kind of module a job needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expect {
    /// A WASI command: `_start: () -> ()`.
    Command,
    /// The Python runtime: a reactor exporting `turn`, `host_alloc`, `shutdown` and `memory`.
    PythonReactor,
}

impl Expect {
    fn check(self, name: &str, module: &Module) -> Result<(), TierError> {
        let invalid = |reason: String| TierError::InvalidModule { name: name.to_owned(), reason };
        match self {
            Expect::Command => match module.get_export("_start") {
                Some(ExternType::Func(ty)) if ty.params().len() == 0 && ty.results().len() == 0 => Ok(()),
                Some(_) => Err(invalid(
                    "its `_start` export is not a function of no arguments and no results; Strata runs WASI command modules".into(),
                )),
                None => Err(invalid("it has no `_start` export (a reactor or library); Strata runs WASI command modules".into())),
            },
            Expect::PythonReactor => {
                for export in ["turn", "host_alloc", "shutdown", "memory"] {
                    if module.get_export(export).is_none() {
                        return Err(invalid(format!("the Python runtime lacks its `{export}` export")));
                    }
                }
                Ok(())
            }
        }
    }
}

/// What a WebAssembly binary is, by its header: `\0asm`, a 16-bit version, a 16-bit layer (0: a core module,
/// 1: a component).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    /// A core module (binary version 1).
    Module,
    /// A component (layer 1; its version is checked by wasmtime when it compiles).
    Component,
}

/// The header of a core module of binary version 1.
const CORE_MODULE_HEADER: [u8; 8] = *b"\0asm\x01\0\0\0";

/// Reads the header of `bytes` (named `name` in errors): a core module or a component, else a typed error.
pub(crate) fn format_of(name: &str, bytes: &[u8]) -> Result<Format, TierError> {
    if !bytes.starts_with(b"\0asm") {
        return Err(TierError::WrongFormat {
            what: name.to_owned(),
            expected: "a WebAssembly module or component (it does not start with the \\0asm magic)",
        });
    }
    match bytes.get(..8) {
        // A truncated header is a core module to wasmtime, which says what is wrong with it.
        None => Ok(Format::Module),
        Some(header) if header == CORE_MODULE_HEADER => Ok(Format::Module),
        Some([.., 1, 0]) => Ok(Format::Component),
        Some(_) => Err(TierError::Unsupported {
            tier: TierKind::Wasm,
            what: format!("{name}: WebAssembly binary versions other than core modules of version 1 and components"),
        }),
    }
}

fn check_format(name: &str, bytes: &[u8]) -> Result<(), TierError> {
    match format_of(name, bytes)? {
        Format::Module => Ok(()),
        Format::Component => Err(TierError::InvalidModule {
            name: name.to_owned(),
            reason: "it is a component where a core module is needed".into(),
        }),
    }
}

/// WASI 0.2 (wasmtime-wasi's `p2`), with `wasi:sockets/ip-name-lookup` replaced by the job's filter, TCP
/// connects logged and counted ([`crate::net`]), and opens of what could wait refused ([`strata_wasi_shims::open`]).
fn component_linker<T: StoreData>(engine: &Engine) -> wasmtime::Result<ComponentLinker<T>> {
    let mut linker = ComponentLinker::new(engine);
    wasmtime_wasi::p2::add_to_linker_async(&mut linker)?;
    crate::net::add_to_linker(&mut linker)?;
    strata_wasi_shims::open::add_to_component_linker(&mut linker)?;
    Ok(linker)
}

/// A component the linker cannot instantiate: an import it does not provide (by name), or invalid.
fn link_error(name: &str, err: &wasmtime::Error) -> TierError {
    let text = describe(err);
    // wasmtime words it "component imports instance `wasi:foo/bar@1.0.0`, but a matching implementation was
    // not found in the linker".
    let import = text
        .split_once("component imports ")
        .filter(|_| text.contains("matching implementation was not found"))
        .and_then(|(_, rest)| rest.split('`').nth(1));
    match import {
        Some(import) => TierError::UnknownImport { name: name.to_owned(), import: import.to_owned() },
        None => TierError::InvalidModule { name: name.to_owned(), reason: text },
    }
}

/// An error and its causes on one line: "failed to parse WebAssembly module: unexpected end (at offset 0x10)".
pub(crate) fn describe(err: &wasmtime::Error) -> String {
    let mut text = String::new();
    for cause in err.chain() {
        let cause = cause.to_string();
        if !text.is_empty() {
            if text.contains(&cause) {
                continue;
            }
            text.push_str(": ");
        }
        text.push_str(cause.trim());
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_says_module_or_component() {
        assert_eq!(format_of("m", b"\0asm\x01\0\0\0").ok(), Some(Format::Module));
        assert_eq!(format_of("c", b"\0asm\x0d\0\x01\0").ok(), Some(Format::Component));
        assert_eq!(format_of("c", b"\0asm\x0e\0\x01\0rest").ok(), Some(Format::Component), "wasmtime checks versions");
        assert_eq!(format_of("short", b"\0asm\x01").ok(), Some(Format::Module), "wasmtime says what is missing");
        let err = format_of("v2", b"\0asm\x02\0\0\0").expect_err("core version 2");
        assert_eq!(err.code(), "unsupported", "{err}");
        let err = format_of("text", b"(module)").expect_err("not binary");
        assert_eq!(err.code(), "wrong_format", "{err}");
        let err = check_format("c", b"\0asm\x0d\0\x01\0").expect_err("a component is not a core module");
        assert!(err.to_string().contains("component"), "{err}");
    }
}
