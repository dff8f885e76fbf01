//! Live forks of a process-tier zygote beside cold starts of the same work, measured in the same run (as root):
//!
//! | name              | Strata: zygote fork                                         | peers, same run                      |
//! |-------------------|-------------------------------------------------------------|--------------------------------------|
//! | `zygote_numpy`    | `ProcessZygote::fork_python` of a `python3` that imported    | cold `python3 -c 'import numpy …'`   |
//! |                   | numpy: fork → first stdout byte, and the whole fork          | in a fresh jail; bare host `python3` |
//! | `idle_forks`      | 100 forks alive at once (each printed and sleeps): PSS per   | (the zygote's own PSS beside)        |
//! |                   | fork from `/proc/<pid>/smaps_rollup`                         |                                      |
//!
//! Fork-to-first-output is the time from the call to the first stdout chunk reaching the host (an output sink);
//! the whole fork adds waiting for the fork's end and removing its cgroup. The target is ≤ 5 ms p50
//! fork-to-first-output. Uses the Debian image under `$STRATA_HOME` (with `python3-numpy`; without it the setup
//! imports `json` and says so); skips with a line when the image or root is missing. `ZYGOTE_ITERS` sets the
//! number of timed runs (default 200, 30 with `--quick`).

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use strata_benches::{Figures, descendants_pss_kib, latency, ratio, strata_home};
use strata_core::{
    CancelToken, Capabilities, ExecOptions, Job, Limits, OutputSink, PythonSource, Status, Stream, Tier,
};
use strata_rootfs_image::DebianImage;
use strata_tier_process::zygote::ProcessZygote;
use strata_tier_process::{ProcessTier, ProcessTierConfig};

const SETUP_NUMPY: &str = "import numpy as np\nx = np.arange(1000)";
const JOB_NUMPY: &str = "print(int(x.sum()))";
const EXPECT_NUMPY: &[u8] = b"499500\n";
const SETUP_PLAIN: &str = "import json\nx = list(range(1000))";
const JOB_PLAIN: &str = "print(sum(x))";

/// Records when the first stdout chunk arrived.
#[derive(Default)]
struct FirstOutput(Mutex<Option<Instant>>);

impl OutputSink for FirstOutput {
    fn output(&self, stream: Stream, _chunk: &[u8]) {
        if stream == Stream::Stdout
            && let Ok(mut first) = self.0.lock()
        {
            first.get_or_insert_with(Instant::now);
        }
    }
}

fn main() -> anyhow::Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let iters: usize = match std::env::var("ZYGOTE_ITERS") {
        Ok(n) => n.parse().context("ZYGOTE_ITERS")?,
        Err(_) if quick => 30,
        Err(_) => 200,
    };
    let home = strata_home();
    let rootfs: PathBuf = match DebianImage::new(&home)?.installed() {
        Ok(installed) => installed.rootfs,
        Err(err) => {
            println!("process zygote: skipped: no Debian image under {} ({err})", home.display());
            return Ok(());
        }
    };
    let numpy = rootfs.join("usr/lib/python3/dist-packages/numpy").is_dir();
    let tier = match ProcessTier::new(ProcessTierConfig {
        rootfs,
        run_dir: home.join("run/jail"),
        snapshots: strata_core::SnapshotTrust::process_local(),
        images: None,
    }) {
        Ok(tier) => tier,
        Err(err) => {
            println!("process zygote: skipped: {err}");
            return Ok(());
        }
    };
    let (setup, job, expect): (&str, &str, &[u8]) =
        if numpy { (SETUP_NUMPY, JOB_NUMPY, EXPECT_NUMPY) } else { (SETUP_PLAIN, JOB_PLAIN, EXPECT_NUMPY) };
    println!(
        "# Strata process-tier zygote forks ({} cores, {iters} runs per figure); setup: {}",
        std::thread::available_parallelism()?,
        if numpy { "import numpy" } else { "import json (this image has no python3-numpy)" }
    );
    let (caps, limits) = (Capabilities::default(), Limits::default());
    let started = Instant::now();
    let (zygote, _) = tier.python_zygote(setup, &caps, &limits)?;
    println!("{:<26} {:.1} ms (setup included)", "zygote_start", started.elapsed().as_secs_f64() * 1e3);

    let mut first = Figures::new("zygote_first_output");
    let warmups = (iters / 10).max(1);
    let mut calls = 0;
    let whole = latency("zygote_fork", iters, || {
        let sink = Arc::new(FirstOutput::default());
        let opts = ExecOptions { sink: Some(sink.clone()), ..ExecOptions::default() };
        let start = Instant::now();
        let outcome = zygote.fork_python(job, &opts)?;
        anyhow::ensure!(outcome.status == Status::Exited { code: 0 } && outcome.stdout == expect, "{outcome:?}");
        let at = sink.0.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.context("no output")?;
        calls += 1;
        if calls > warmups {
            first.record(at.duration_since(start));
        }
        Ok(())
    })?;
    first.print("fork → first stdout byte");
    whole.print("fork → fork ended, cgroup removed");

    let cold_job = Job::Python { source: PythonSource::Code(format!("{setup}\n{job}")), args: Vec::new() };
    let cold = latency("cold_jail", iters.min(100), || {
        let outcome = tier.run(&cold_job, &caps, &limits, ExecOptions::default())?;
        anyhow::ensure!(outcome.status == Status::Exited { code: 0 } && outcome.stdout == expect, "{outcome:?}");
        Ok(())
    })?;
    cold.print("cold: a fresh jail, python3 -c setup+job");
    ratio("zygote_numpy", &first, &cold, "cold jail");
    if let Some(bare) = bare_python(setup, job, expect, iters.min(100))? {
        bare.print("bare host python3 -c (no jail)");
        ratio("zygote_numpy", &first, &bare, "bare python3");
    }
    let p50 = first.p_us(0.5) / 1e3;
    println!("target: fork → first output ≤ 5 ms p50: {p50:.2} ms {}", if p50 <= 5.0 { "PASS" } else { "MISS" });

    idle_forks(&zygote, 100)?;
    zygote.close();
    Ok(())
}

/// The host's `python3` running the same work, when it has numpy (or the plain setup is in use).
fn bare_python(setup: &str, job: &str, expect: &[u8], iters: usize) -> anyhow::Result<Option<Figures>> {
    let code = format!("{setup}\n{job}");
    let probe = Command::new("python3").arg("-c").arg(&code).output();
    match probe {
        Ok(out) if out.status.success() && out.stdout == expect => {}
        _ => {
            println!("{:<26} skipped: the host's python3 cannot run the setup (no numpy?)", "bare_python");
            return Ok(None);
        }
    }
    latency("bare_python", iters, || {
        let out = Command::new("python3").arg("-c").arg(&code).output()?;
        anyhow::ensure!(out.status.success(), "{out:?}");
        Ok(())
    })
    .map(Some)
}

/// Keeps `count` forks alive at once and prints their PSS.
fn idle_forks(zygote: &ProcessZygote, count: usize) -> anyhow::Result<()> {
    let zygote_pss = descendants_pss_kib()?;
    let cancel = CancelToken::new();
    let up = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    struct Up(Arc<std::sync::atomic::AtomicUsize>);
    impl OutputSink for Up {
        fn output(&self, stream: Stream, _chunk: &[u8]) {
            if stream == Stream::Stdout {
                self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
    }
    let limits = Limits { wall: Duration::from_secs(120), ..Limits::default() };
    let measured = std::thread::scope(|scope| -> anyhow::Result<u64> {
        let mut handles = Vec::new();
        for _ in 0..count {
            let opts = ExecOptions {
                sink: Some(Arc::new(Up(up.clone()))),
                cancel: Some(cancel.clone()),
                limits: Some(limits.clone()),
                ..ExecOptions::default()
            };
            handles.push(
                scope.spawn(move || zygote.fork_python("import time\nprint('up', flush=True)\ntime.sleep(120)", &opts)),
            );
        }
        let deadline = Instant::now() + Duration::from_secs(120);
        while up.load(std::sync::atomic::Ordering::SeqCst) < count && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let alive = up.load(std::sync::atomic::Ordering::SeqCst);
        let pss = descendants_pss_kib();
        cancel.cancel();
        for handle in handles {
            let _ = handle.join();
        }
        anyhow::ensure!(alive >= count, "only {alive} of {count} forks came up");
        pss
    })?;
    let forks = measured.saturating_sub(zygote_pss);
    println!(
        "{:<26} {count} forks alive: {:.1} MiB PSS in all, {:.0} KiB per fork (the zygote's jail: {:.1} MiB)",
        "idle_forks",
        forks as f64 / 1024.0,
        forks as f64 / count as f64,
        zygote_pss as f64 / 1024.0
    );
    Ok(())
}
