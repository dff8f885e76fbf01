//! No fd, thread or mapping leaks after 1,000 jobs. A binary of its own (no test harness), so nothing else
//! runs in the process while it counts.

use std::time::Instant;

use strata_core::{Capabilities, ExecOptions, Grant, GrantMode, Job, Limits, LimitsOverride, PythonSource, Status};
use strata_engine::{Engine, EngineConfig, TierChoice};
use strata_test_programs as programs;

fn count(dir: &str) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

fn scratch_dirs() -> usize {
    std::fs::read_dir(std::env::temp_dir())
        .map(|d| {
            d.filter(|e| e.as_ref().is_ok_and(|e| e.file_name().to_string_lossy().starts_with("strata-scratch-")))
                .count()
        })
        .unwrap_or(0)
}

fn mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps").map(|m| m.lines().count()).unwrap_or(0)
}

#[derive(Debug, PartialEq, Eq, Clone, Copy)]
struct Resources {
    fds: usize,
    threads: usize,
    mappings: usize,
    scratch_dirs: usize,
}

fn resources() -> Resources {
    Resources {
        fds: count("/proc/self/fd"),
        threads: count("/proc/self/task"),
        mappings: mappings(),
        scratch_dirs: scratch_dirs(),
    }
}

fn python(code: &str) -> Job {
    Job::Python { source: PythonSource::Code(code.into()), args: Vec::new() }
}

/// Python sessions: started, a few turns, closed (or dropped).
fn sessions(engine: &Engine, caps: &Capabilities, count: usize) -> anyhow::Result<()> {
    for i in 0..count {
        let mut sandbox = engine.start(TierChoice::Auto, caps, &Limits::default())?;
        for turn in ["x = 1", "x += 1", "x"] {
            let outcome = sandbox.exec(&python(turn), ExecOptions::default())?;
            anyhow::ensure!(outcome.status == Status::Exited { code: 0 }, "{outcome:?}");
        }
        if i % 2 == 0 {
            sandbox.close()?;
        }
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    std::fs::write(data.path().join("f.txt"), "data")?;
    // The shared home: the Python runtime is installed and compiled there once.
    let home = strata_engine::strata_home().ok_or_else(|| anyhow::anyhow!("no STRATA_HOME"))?;
    let engine = Engine::new(EngineConfig { home: Some(home), ..EngineConfig::default() })?;
    let caps = Capabilities {
        grants: vec![Grant::new(data.path(), "/data", GrantMode::Rw)?],
        stdin: b"input".to_vec(),
        ..Capabilities::default()
    };
    let fuel: LimitsOverride = toml::from_str("fuel = 2000000")?;
    let small_memory: LimitsOverride = toml::from_str("memory = \"4MiB\"")?;
    let jobs: Vec<(Job, Limits)> = vec![
        (Job::wasm_file(programs::HELLO, vec![]), Limits::default()),
        (Job::wasm_file(programs::ECHO, vec!["x".into()]), Limits::default()),
        (Job::wasm_file(programs::FS, vec!["read".into(), "/data/f.txt".into()]), Limits::default()),
        (Job::wasm_file(programs::FS, vec!["write".into(), "/data/g.txt".into(), "y".into()]), Limits::default()),
        (Job::wasm_file(programs::PANIC, vec![]), Limits::default()),
        (Job::wasm_file(programs::SPIN, vec![]), fuel.apply(&Limits::default())),
        (Job::wasm_file(programs::ALLOC, vec!["16".into()]), small_memory.apply(&Limits::default())),
        (Job::wasm_file(programs::TRIVIAL_WAT, vec![]), Limits::default()),
        (python("print(open('/data/f.txt').read())"), Limits::default()),
        (python("open('/tmp/x', 'w').write('y'); 1 / 0"), Limits::default()),
    ];
    let run_all = |rounds: usize| -> anyhow::Result<usize> {
        let mut done = 0;
        for _ in 0..rounds {
            for (job, limits) in &jobs {
                let outcome = engine.run(job, &caps, limits, ExecOptions::default())?;
                anyhow::ensure!(!matches!(outcome.status, Status::Crashed { .. }), "{outcome:?}");
                done += 1;
            }
        }
        Ok(done)
    };
    // Warm up: engines, epoch threads, the executor, prepared modules, and a worker thread (whose stack and
    // malloc arena the C library keeps for the next thread).
    run_all(2)?;
    sessions(&engine, &caps, 2)?;
    std::thread::scope(|s| s.spawn(|| run_all(1)).join()).map_err(|_| anyhow::anyhow!("worker panicked"))??;
    let before = resources();
    let started = Instant::now();
    let rounds = 1000usize.div_ceil(jobs.len() * 2);
    let mut done = run_all(rounds)?;
    // The other half on a second thread, which must leave nothing behind when it ends.
    done += std::thread::scope(|s| s.spawn(|| run_all(rounds)).join())
        .map_err(|_| anyhow::anyhow!("worker thread panicked"))??;
    sessions(&engine, &caps, 20)?;
    let after = resources();
    println!("{done} jobs in {:.2?}; before {before:?}, after {after:?}", started.elapsed());
    anyhow::ensure!(done >= 1000, "ran only {done} jobs");
    anyhow::ensure!(before == after, "resources leaked: before {before:?}, after {after:?}");
    println!("leaks: ok");
    Ok(())
}
