//! Forks of a process-tier snapshot beside a cold start of the same work, measured in the same run (as root):
//!
//! | name          | Strata: fork                                                  | peer: cold start                       |
//! |---------------|---------------------------------------------------------------|----------------------------------------|
//! | `fork_small`  | `Tier::fork` of a sandbox whose setup job ran                 | one-shot `sh -c '<setup>; cat /tmp/x'` |
//! |               | `echo 41 > /tmp/x`, then `cat /tmp/x` until `41` is back       | in a fresh jail                        |
//! | `fork_8mib`   | the same with 8 MiB of random data written by the setup job   | the same, setup included               |
//!
//! Both contenders pay for a fresh jail (namespaces, cgroup, overlay, pivot_root, seccomp) and its teardown; the
//! fork also restores the snapshot's upper layer, the cold start re-runs the setup job. Ratios are fork / cold
//! (below 1.0: the fork is faster). Uses the Debian image under `$STRATA_HOME` (`strata images build debian`);
//! skips with a line when it or root is missing. `FORK_ITERS` sets the number of timed runs (default 200, 30
//! with `--quick`).
//!
//! Then `idle_forks`: 100 forks kept alive at once after their first job, and the PSS of their processes (every
//! descendant of this process, from `/proc/<pid>/smaps_rollup`) per fork. A fork's restored layer lives in its
//! jail's tmpfs, which no process maps: it is charged to the fork's cgroup, not counted here (the snapshot's size
//! is printed beside).

use std::path::PathBuf;

use anyhow::Context;
use strata_benches::{Figures, descendants_pss_kib, latency, ratio, strata_home};
use strata_core::{Capabilities, ExecOptions, Job, Limits, Outcome, Status, Tier};
use strata_rootfs_image::DebianImage;
use strata_tier_process::{ProcessTier, ProcessTierConfig};

fn sh(script: &str) -> Job {
    Job::Command { argv: vec!["sh".into(), "-c".into(), script.into()] }
}

fn expect_41(outcome: &Outcome) -> anyhow::Result<()> {
    anyhow::ensure!(
        outcome.status == Status::Exited { code: 0 } && outcome.stdout == b"41\n",
        "{:?}: {}{}",
        outcome.status,
        String::from_utf8_lossy(&outcome.stdout),
        String::from_utf8_lossy(&outcome.stderr)
    );
    Ok(())
}

/// One case: the fork's figures, the cold start's, and the snapshot's size.
fn case(tier: &ProcessTier, name: &'static str, setup: &str, iters: usize) -> anyhow::Result<(Figures, Figures, u64)> {
    let (caps, limits) = (Capabilities::default(), Limits::default());
    let dir = tempfile::tempdir()?;
    let sandbox = tier.start(&caps, &limits)?;
    let outcome = sandbox.exec(&sh(setup), ExecOptions::default())?;
    anyhow::ensure!(outcome.status == Status::Exited { code: 0 }, "setup: {outcome:?}");
    let snapshot = sandbox.snapshot(&dir.path().join("snap"))?;
    sandbox.close()?;
    let cat = sh("cat /tmp/x");
    let fork = latency(name, iters, || {
        let fork = tier.fork(&snapshot)?;
        expect_41(&fork.exec(&cat, ExecOptions::default())?)?;
        fork.close()?;
        Ok(())
    })?;
    let cold_job = sh(&format!("{setup}; cat /tmp/x"));
    let cold = latency(name, iters, || expect_41(&tier.run(&cold_job, &caps, &limits, ExecOptions::default())?))?;
    Ok((fork, cold, snapshot.manifest.total_bytes))
}

fn main() -> anyhow::Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let iters: usize = match std::env::var("FORK_ITERS") {
        Ok(n) => n.parse().context("FORK_ITERS")?,
        Err(_) if quick => 30,
        Err(_) => 200,
    };
    let home = strata_home();
    let image = DebianImage::new(&home)?;
    let rootfs: PathBuf = match image.installed() {
        Ok(installed) => installed.rootfs,
        Err(err) => {
            println!("process fork: skipped: no Debian image under {} ({err})", home.display());
            return Ok(());
        }
    };
    let tier = match ProcessTier::new(ProcessTierConfig {
        rootfs,
        run_dir: home.join("run/jail"),
        snapshots: strata_core::SnapshotTrust::process_local(),
        images: None,
    }) {
        Ok(tier) => tier,
        Err(err) => {
            println!("process fork: skipped: {err}");
            return Ok(());
        }
    };
    println!(
        "# Strata process-tier forks ({} cores, {iters} runs per figure); fork-to-first-output vs cold start",
        std::thread::available_parallelism()?
    );
    for (name, setup) in [
        ("fork_small", "echo 41 > /tmp/x"),
        ("fork_8mib", "head -c 8388608 /dev/urandom > /root/data && echo 41 > /tmp/x"),
    ] {
        let (fork, cold, bytes) = case(&tier, name, setup, iters)?;
        fork.print(&format!("fork of a snapshot ({} KiB)", bytes.div_ceil(1024)));
        cold.print("cold start (setup + cat)");
        ratio(name, &fork, &cold, "cold");
    }
    idle_forks(&tier, 100)
}

/// Keeps `count` forks alive after their first job and prints the PSS of their processes.
fn idle_forks(tier: &ProcessTier, count: usize) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let sandbox = tier.start(&Capabilities::default(), &Limits::default())?;
    let outcome = sandbox.exec(&sh("echo 41 > /tmp/x"), ExecOptions::default())?;
    anyhow::ensure!(outcome.status == Status::Exited { code: 0 }, "setup: {outcome:?}");
    let snapshot = sandbox.snapshot(&dir.path().join("snap"))?;
    sandbox.close()?;
    let before = descendants_pss_kib()?;
    let mut forks = Vec::with_capacity(count);
    for _ in 0..count {
        let fork = tier.fork(&snapshot)?;
        expect_41(&fork.exec(&sh("cat /tmp/x"), ExecOptions::default())?)?;
        forks.push(fork);
    }
    let after = descendants_pss_kib()?;
    let per_fork = after.saturating_sub(before) as f64 / count as f64;
    println!(
        "{:<26} {count} forks alive: {:.1} MiB PSS in all, {per_fork:.0} KiB per fork (+ a {} B layer each in its tmpfs)",
        "idle_forks",
        after.saturating_sub(before) as f64 / 1024.0,
        snapshot.manifest.total_bytes
    );
    for fork in forks {
        fork.close()?;
    }
    Ok(())
}
