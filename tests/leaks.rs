//! No fd, thread or mapping leaks after 1,000 jobs. A binary of its own (no test harness), so nothing else
//! runs in the process while it counts.

use std::time::Instant;

use strata_core::{Capabilities, ExecOptions, Grant, GrantMode, Job, Limits, LimitsOverride, Status};
use strata_engine::{Engine, EngineConfig};
use strata_test_programs as programs;

fn count(dir: &str) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

fn mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps").map(|m| m.lines().count()).unwrap_or(0)
}

#[derive(Debug, PartialEq, Eq, Clone, Copy)]
struct Resources {
    fds: usize,
    threads: usize,
    mappings: usize,
}

fn resources() -> Resources {
    Resources { fds: count("/proc/self/fd"), threads: count("/proc/self/task"), mappings: mappings() }
}

fn main() -> anyhow::Result<()> {
    let home = tempfile::tempdir()?;
    let data = tempfile::tempdir()?;
    std::fs::write(data.path().join("f.txt"), "data")?;
    let engine = Engine::new(EngineConfig { home: Some(home.path().to_owned()), ..EngineConfig::default() })?;
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
    std::thread::scope(|s| s.spawn(|| run_all(1)).join()).map_err(|_| anyhow::anyhow!("worker panicked"))??;
    let before = resources();
    let started = Instant::now();
    let rounds = 1000usize.div_ceil(jobs.len() * 2);
    let mut done = run_all(rounds)?;
    // The other half on a second thread, which must leave nothing behind when it ends.
    done += std::thread::scope(|s| s.spawn(|| run_all(rounds)).join())
        .map_err(|_| anyhow::anyhow!("worker thread panicked"))??;
    let after = resources();
    println!("{done} jobs in {:.2?}; before {before:?}, after {after:?}", started.elapsed());
    anyhow::ensure!(done >= 1000, "ran only {done} jobs");
    anyhow::ensure!(before == after, "resources leaked: before {before:?}, after {after:?}");
    println!("leaks: ok");
    Ok(())
}
