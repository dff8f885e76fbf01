//! Wasm-tier job figures beside their peers, measured in the same run (run `benches/run.sh`):
//!
//! | name                      | Strata                                   | peer                                   |
//! |---------------------------|------------------------------------------|----------------------------------------|
//! | `inproc_trivial_us`       | `Engine::execute` of a trivial module    | a bare wasmtime + WASI p1 embedding     |
//! | `inproc_hello_us`         | `Engine::execute` of a Rust hello module | the same bare embedding                 |
//! | `throughput_2t_jobs_per_s`| `Engine::execute` on 2 threads           | the bare embedding on 2 threads         |
//! | `process_trivial_us`      | `strata run trivial.wasm`                | `wasmtime run` (its cache on) and       |
//! |                           |                                          | `wasmtime run --allow-precompiled`      |
//! | `process_2t_jobs_per_s`   | `strata run` processes on 2 threads      | `wasmtime run` processes on 2 threads   |
//!
//! Latencies are HDR-histogram percentiles; ratios are Strata / peer (below 1.0 means Strata is faster).
//! Nothing here asserts a time: the figures are for reading.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::Arc;

use anyhow::{Context, bail};
use strata_benches::{find_strata, latency, process, ratio, strata_home, throughput};
use strata_core::{Job, Limits, ModuleSource, Status};
use strata_engine::{Engine, EngineConfig, RunRequest};
use strata_test_programs as programs;
use wasmtime_wasi::WasiCtxBuilder;
use wasmtime_wasi::p1::WasiP1Ctx;
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;

/// A minimal embedding of wasmtime with WASI p1, as an embedder would write it without Strata: default
/// engine config (on-demand allocation), a linker, a prepared instance, a fresh store and context per job.
struct BareWasmtime {
    pre: wasmtime::InstancePre<WasiP1Ctx>,
    engine: wasmtime::Engine,
}

impl BareWasmtime {
    fn new(path: &str) -> anyhow::Result<BareWasmtime> {
        let engine = wasmtime::Engine::default();
        let module = wasmtime::Module::from_file(&engine, path).map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut linker = wasmtime::Linker::new(&engine);
        wasmtime_wasi::p1::add_to_linker_sync(&mut linker, |ctx| ctx).map_err(|e| anyhow::anyhow!("{e}"))?;
        let pre = linker.instantiate_pre(&module).map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(BareWasmtime { pre, engine })
    }

    fn run(&self) -> anyhow::Result<()> {
        let stdout = MemoryOutputPipe::new(1 << 20);
        let wasi = WasiCtxBuilder::new().arg("trivial").stdout(stdout.clone()).build_p1();
        let mut store = wasmtime::Store::new(&self.engine, wasi);
        let instance = self.pre.instantiate(&mut store).map_err(|e| anyhow::anyhow!("{e}"))?;
        let start = instance.get_typed_func::<(), ()>(&mut store, "_start").map_err(|e| anyhow::anyhow!("{e}"))?;
        if let Err(err) = start.call(&mut store, ()) {
            match err.downcast_ref::<wasmtime_wasi::I32Exit>() {
                Some(exit) if exit.0 == 0 => {}
                _ => bail!("bare wasmtime run failed: {err}"),
            }
        }
        anyhow::ensure!(!stdout.contents().is_empty(), "no output");
        Ok(())
    }
}

fn strata_job(engine: &Engine, job: &Job) -> anyhow::Result<()> {
    let outcome = engine.execute(RunRequest::new(job).limits(Limits::default()))?;
    anyhow::ensure!(outcome.status == Status::Exited { code: 0 } && !outcome.stdout.is_empty(), "{outcome:?}");
    Ok(())
}

fn find_wasmtime() -> Option<PathBuf> {
    let installed = strata_home().join("tools/bin/wasmtime");
    if installed.exists() {
        return Some(installed);
    }
    std::env::split_paths(&std::env::var_os("PATH")?).map(|d| d.join("wasmtime")).find(|p| p.exists())
}

fn main() -> anyhow::Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let scale = if quick { 10 } else { 1 };
    let home = tempfile::tempdir()?;
    let engine = Arc::new(Engine::new(EngineConfig { home: Some(home.path().into()), ..EngineConfig::default() })?);
    println!(
        "# Strata wasm-tier benchmarks ({} cores); p50/p90/p99/max per job",
        std::thread::available_parallelism()?
    );

    // In-process latency, warm cache.
    let trivial = Job::Wasm { module: ModuleSource::File(programs::TRIVIAL_WAT.into()), args: vec![] };
    let hello = Job::Wasm { module: ModuleSource::File(programs::HELLO.into()), args: vec![] };
    let bare_trivial = BareWasmtime::new(programs::TRIVIAL_WAT)?;
    let bare_hello = BareWasmtime::new(programs::HELLO)?;

    let inproc = latency("inproc_trivial_us", 20_000 / scale, || strata_job(&engine, &trivial))?;
    let peer = latency("inproc_trivial_us", 20_000 / scale, || bare_trivial.run())?;
    inproc.print("strata Engine::execute");
    peer.print("bare wasmtime+wasi p1");
    ratio("inproc_trivial_us", &inproc, &peer, "bare");

    let ours = latency("inproc_hello_us", 5_000 / scale, || strata_job(&engine, &hello))?;
    let peer = latency("inproc_hello_us", 5_000 / scale, || bare_hello.run())?;
    ours.print("strata Engine::execute");
    peer.print("bare wasmtime+wasi p1");
    ratio("inproc_hello_us", &ours, &peer, "bare");

    // Throughput on 2 threads.
    let secs = if quick { 0.5 } else { 3.0 };
    let inproc_throughput = throughput(2, secs, || strata_job(&engine, &trivial))?;
    let peer = throughput(2, secs, || bare_trivial.run())?;
    println!("{:<26} {:<34} {inproc_throughput:>10.0} jobs/s", "throughput_2t_jobs_per_s", "strata Engine::execute");
    println!("{:<26} {:<34} {peer:>10.0} jobs/s", "throughput_2t_jobs_per_s", "bare wasmtime+wasi p1");
    println!("{:<26} ratio strata/bare: {:.2}x", "throughput_2t_jobs_per_s", inproc_throughput / peer);

    // Whole processes.
    let iters = 200 / scale;
    let (Some(strata), Some(wasmtime)) = (find_strata(), find_wasmtime()) else {
        println!(
            "process_trivial_ms: skipped: needs target/release/strata and the wasmtime CLI (benches/run.sh builds and \
             installs both)"
        );
        return Ok(());
    };
    let version = Command::new(&wasmtime).arg("--version").output().context("wasmtime --version")?;
    println!("# peer: {}", String::from_utf8_lossy(&version.stdout).trim());
    let wasm_home = tempfile::tempdir()?;
    let cwasm = wasm_home.path().join("trivial.cwasm");
    let status = Command::new(&wasmtime).arg("compile").arg(programs::TRIVIAL_WAT).arg("-o").arg(&cwasm).status()?;
    anyhow::ensure!(status.success(), "wasmtime compile failed");

    let hello_ok = |out: &Output| -> anyhow::Result<()> {
        anyhow::ensure!(out.status.success() && out.stdout == b"hello\n", "{:?}", out.status);
        Ok(())
    };
    let strata_home = home.path().to_owned();
    let ours = process(
        "process_trivial_us",
        iters,
        5,
        &mut || {
            let mut c = Command::new(&strata);
            c.env("STRATA_HOME", &strata_home).args(["run", programs::TRIVIAL_WAT]);
            c
        },
        &hello_ok,
    )?;
    let wasm_cache_home = wasm_home.path().to_owned();
    let peer = process(
        "process_trivial_us",
        iters,
        5,
        &mut || {
            let mut c = Command::new(&wasmtime);
            c.env("HOME", &wasm_cache_home).env("XDG_CACHE_HOME", wasm_cache_home.join("cache"));
            c.args(["run", programs::TRIVIAL_WAT]);
            c
        },
        &hello_ok,
    )?;
    let peer_pre = process(
        "process_trivial_us",
        iters,
        5,
        &mut || {
            let mut c = Command::new(&wasmtime);
            c.args(["run", "--allow-precompiled"]).arg(&cwasm);
            c
        },
        &hello_ok,
    )?;
    ours.print("strata run");
    peer.print("wasmtime run (cache on)");
    peer_pre.print("wasmtime run --allow-precompiled");
    ratio("process_trivial_us", &ours, &peer, "wasmtime");
    ratio("process_trivial_us", &ours, &peer_pre, "wasmtime-precompiled");
    println!(
        "{:<26} ratio strata Engine::execute / wasmtime run process: p50 {:.4}x ({:.2}us vs {:.0}us)",
        "inproc_vs_cli",
        inproc.p_us(0.5) / peer.p_us(0.5),
        inproc.p_us(0.5),
        peer.p_us(0.5)
    );

    // Whole processes on 2 threads.
    let run_ok = |mut c: Command| -> anyhow::Result<()> {
        let out = c.stdout(Stdio::piped()).stderr(Stdio::piped()).output()?;
        anyhow::ensure!(out.status.success() && out.stdout == b"hello\n", "{:?}", out.status);
        Ok(())
    };
    let secs = if quick { 0.5 } else { 2.0 };
    let ours = throughput(2, secs, || {
        let mut c = Command::new(&strata);
        c.env("STRATA_HOME", &strata_home).args(["run", programs::TRIVIAL_WAT]);
        run_ok(c)
    })?;
    let peer = throughput(2, secs, || {
        let mut c = Command::new(&wasmtime);
        c.env("HOME", &wasm_cache_home).env("XDG_CACHE_HOME", wasm_cache_home.join("cache"));
        c.args(["run", programs::TRIVIAL_WAT]);
        run_ok(c)
    })?;
    println!("{:<26} {:<34} {ours:>10.0} jobs/s", "process_2t_jobs_per_s", "strata run");
    println!("{:<26} {:<34} {peer:>10.0} jobs/s", "process_2t_jobs_per_s", "wasmtime run (cache on)");
    println!("{:<26} ratio strata/wasmtime: {:.2}x", "process_2t_jobs_per_s", ours / peer);
    println!(
        "{:<26} ratio strata Engine::execute / wasmtime run processes: {:.0}x",
        "throughput_vs_cli",
        inproc_throughput / peer
    );
    Ok(())
}
