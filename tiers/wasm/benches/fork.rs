//! Forks of a Python snapshot on the wasm tier, beside their peer measured in the same run.
//!
//! | name                 | Strata                                                   | peer                              |
//! |----------------------|----------------------------------------------------------|-----------------------------------|
//! | `fork_first_output`  | `Tier::fork` of a session that ran `import numpy as np;  | a one-shot job that imports numpy |
//! |                      | x = 41`, then `exec("print(x + 1)")` until `42` is back   | and prints `x + 1` cold           |
//! | `fork_only`, `fork_second_job` | the fork alone, and a second `print(x + 1)` in it (for reading) | —  |
//! | `idle_forks_pss`     | Pss (`/proc/self/smaps_rollup`) of 100 idle forks        | the snapshot's memory size × 100  |
//!
//! Uses the Python runtime under `$STRATA_HOME` (installed and compiled on first use, as the tests do). Ratios
//! are Strata / peer (below 1.0: Strata is faster or smaller). `FORK_ITERS` sets the number of forks timed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use strata_benches::{Figures, ratio, strata_home};
use strata_core::{Capabilities, ExecOptions, Job, Limits, PythonSource, Sandbox, Status, Tier, TierError};
use strata_python_image::PythonImage;
use strata_tier_wasm::{PythonArtifacts, PythonProvider, WasmTier, WasmTierConfig};

struct Provider(PythonImage);

impl PythonProvider for Provider {
    fn artifacts(&self) -> Result<PythonArtifacts, TierError> {
        let (installed, _) = self
            .0
            .ensure(&|line| eprintln!("python runtime: {line}"))
            .map_err(|e| TierError::Artifact(e.to_string()))?;
        Ok(PythonArtifacts {
            snapshot: installed.snapshot,
            snapshot_digest: installed.snapshot_sha256,
            stdlib_dir: installed.stdlib_dir,
            stdlib_zip_name: installed.stdlib_zip_name,
            mpl_data_dir: Some(installed.mpl_data_dir),
        })
    }
}

fn code(text: &str) -> Job {
    Job::Python { source: PythonSource::Code(text.into()), args: Vec::new() }
}

fn expect_output(outcome: &strata_core::Outcome, expected: &str) -> anyhow::Result<()> {
    anyhow::ensure!(
        outcome.status == Status::Exited { code: 0 } && outcome.stdout == expected.as_bytes(),
        "{:?}: {}{}",
        outcome.status,
        String::from_utf8_lossy(&outcome.stdout),
        String::from_utf8_lossy(&outcome.stderr)
    );
    Ok(())
}

/// This process's proportional set size, in bytes.
fn pss() -> anyhow::Result<u64> {
    let text = std::fs::read_to_string("/proc/self/smaps_rollup")?;
    let line = text.lines().find(|l| l.starts_with("Pss:")).context("no Pss line")?;
    let kb: u64 = line.split_whitespace().nth(1).context("Pss value")?.parse()?;
    Ok(kb * 1024)
}

fn main() -> anyhow::Result<()> {
    let home = strata_home();
    let tier = WasmTier::new(WasmTierConfig {
        cache_dir: Some(home.join("modules")),
        python: Some(Arc::new(Provider(PythonImage::new(&home)?))),
        ..WasmTierConfig::default()
    });
    let limits = Limits { wall: Duration::from_secs(600), cpu: Duration::from_secs(600), ..Limits::default() };
    let caps = Capabilities::default();
    let iters: usize = std::env::var("FORK_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(200);

    // The parent: a session that imported numpy (the first run compiles the snapshot-ready runtime).
    let parent = tier.start(&caps, &limits)?;
    let t = Instant::now();
    expect_output(&parent.exec(&code("import numpy as np; x = 41"), ExecOptions::default())?, "")?;
    println!("session import numpy            {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
    let dir = tempfile::tempdir()?;
    let t = Instant::now();
    let made = parent.snapshot(&dir.path().join("snap"))?;
    println!(
        "snapshot                        {:.1} ms, {:.1} MB on disk (memory {} MB)",
        t.elapsed().as_secs_f64() * 1e3,
        made.manifest.total_bytes as f64 / 1e6,
        made.manifest.meta["python"]["memory_bytes"].as_u64().unwrap_or(0) / 1_000_000
    );
    let t = Instant::now();
    let snapshot = strata_core::SnapshotTrust::process_local().open_for(&made.dir, strata_core::TierKind::Wasm)?;
    println!("open + verify                   {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
    parent.close()?;

    // Strata: fork, then the first job's output.
    let first = code("print(x + 1)");
    let mut forks = Figures::new("fork_first_output");
    let mut fork_only = Figures::new("fork_only");
    let mut second_job = Figures::new("fork_second_job");
    for i in 0..iters + iters / 10 + 1 {
        let t = Instant::now();
        let fork = tier.fork(&snapshot)?;
        let forked = t.elapsed();
        let outcome = fork.exec(&first, ExecOptions::default())?;
        let elapsed = t.elapsed();
        expect_output(&outcome, "42\n")?;
        let t = Instant::now();
        expect_output(&fork.exec(&first, ExecOptions::default())?, "42\n")?;
        if i > iters / 10 {
            forks.record(elapsed);
            fork_only.record(forked);
            second_job.record(t.elapsed());
        }
        fork.close()?;
    }

    // The peer: the same state built cold in a fresh instance.
    let cold = code("import numpy as np; x = 41; print(x + 1)");
    let mut cold_runs = Figures::new("fork_first_output");
    for i in 0..6 {
        let t = Instant::now();
        let outcome = tier.run(&cold, &caps, &limits, ExecOptions::default())?;
        let elapsed = t.elapsed();
        expect_output(&outcome, "42\n")?;
        if i > 0 {
            cold_runs.record(elapsed);
        }
    }
    fork_only.print("strata fork (returned)");
    second_job.print("strata second job in the fork");
    forks.print("strata fork + exec");
    cold_runs.print("cold one-shot import numpy");
    ratio("fork_first_output", &forks, &cold_runs, "cold");

    // 100 idle forks, each having run one job.
    let before = pss()?;
    let mut idle: Vec<Box<dyn Sandbox>> = Vec::new();
    for _ in 0..100 {
        let fork = tier.fork(&snapshot)?;
        expect_output(&fork.exec(&first, ExecOptions::default())?, "42\n")?;
        idle.push(fork);
    }
    let after = pss()?;
    let memory = made.manifest.meta["python"]["memory_bytes"].as_u64().unwrap_or(0);
    let per_fork = after.saturating_sub(before) as f64 / 100.0;
    println!(
        "idle_forks_pss                  100 forks: +{:.1} MB Pss, {:.2} MB per fork; private copies would be {:.1} MB each ({:.3}x)",
        after.saturating_sub(before) as f64 / 1e6,
        per_fork / 1e6,
        memory as f64 / 1e6,
        per_fork / memory.max(1) as f64
    );
    for fork in idle {
        fork.close()?;
    }
    Ok(())
}
