//! `strata-soak`: drives a real `strata serve` (the release binary) with a bounded mix of concurrent jobs and
//! checks that it holds up (`benches/soak/run.sh`; README, Benchmarks).
//!
//! - **soak** (default): `--concurrency` workers run tagged jobs (wasm Python one-shots and sessions, process
//!   commands, forks of snapshots, file calls, WebSocket streams, cancels, wall limits, E2B commands) for
//!   `--duration`. Every answer is checked against its request (its tag back exactly once: nothing lost,
//!   duplicated or crossed) and must be typed (a 429/503 with a code is counted as a refusal). The server's
//!   descriptors, threads, RSS, mounts, processes, cgroups, state and scratch entries are sampled through the run
//!   and printed as a table; once the load stops they must be back where they were after the warm-up.
//! - **chaos**: the same load, and `--rounds` times a SIGKILL of the server in the middle of it, then a restart on
//!   the same `$STRATA_HOME`: the dead server's processes must be gone, its snapshots valid or refused as invalid
//!   by `strata snapshot inspect` (never half-read; the two it finished before the load, valid), and once its
//!   successor has started, none of its cgroups, state, scratch, sockets or mounts under the home left; the
//!   successor must then serve every kind of job.
//!
//! Loopback only; the load stops by itself.

mod jobs;
mod probe;
mod server;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use hdrhistogram::Histogram;
use tokio::sync::Mutex;

use jobs::{Kind, Target, Verdict};
use probe::Sample;
use server::{Server, ServerConfig};

#[derive(Parser, Debug)]
#[command(about = "Soak and chaos harness for strata serve")]
struct Args {
    /// `soak`, or `chaos` (SIGKILL the server under load and restart it).
    #[arg(long, default_value = "soak")]
    mode: String,
    /// How long the load runs (soak), e.g. 600s, 10m, 45s.
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    duration: Duration,
    /// Jobs in flight at once.
    #[arg(long, default_value_t = 12)]
    concurrency: usize,
    /// How often the server's resources are sampled.
    #[arg(long, default_value = "15s", value_parser = parse_duration)]
    sample_every: Duration,
    /// Chaos: how many kill-and-restart rounds.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Chaos: the load runs this long before each kill.
    #[arg(long, default_value = "20s", value_parser = parse_duration)]
    kill_after: Duration,
    /// The `strata` binary (default: the release build in $CARGO_TARGET_DIR).
    #[arg(long)]
    strata: Option<PathBuf>,
    /// Seeds the job mix.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Where the server's log goes.
    #[arg(long, default_value = "/tmp/strata-soak-serve.log")]
    log: PathBuf,
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    let (number, unit) = text.trim().split_at(text.trim().find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
    let n: u64 = number.parse().map_err(|_| format!("not a duration: {text:?}"))?;
    match unit {
        "" | "s" => Ok(Duration::from_secs(n)),
        "ms" => Ok(Duration::from_millis(n)),
        "m" => Ok(Duration::from_secs(n * 60)),
        "h" => Ok(Duration::from_secs(n * 3600)),
        _ => Err(format!("unknown unit in {text:?} (ms, s, m, h)")),
    }
}

/// The longest a job may take before it counts as lost.
const JOB_LIMIT: Duration = Duration::from_secs(120);

/// Jobs of one kind.
#[derive(Debug)]
struct Tally {
    ok: u64,
    refused: BTreeMap<String, u64>,
    failed: u64,
    failures: Vec<String>,
    latency: Histogram<u64>,
}

impl Tally {
    fn new() -> Tally {
        Tally {
            ok: 0,
            refused: BTreeMap::new(),
            failed: 0,
            failures: Vec::new(),
            latency: Histogram::new_with_bounds(1, 600_000, 3).expect("histogram bounds"),
        }
    }
}

/// What the workers found.
#[derive(Debug, Default)]
struct Results {
    by_kind: BTreeMap<Kind, Tally>,
    /// Jobs cut by a SIGKILL of the server (chaos): not failures, not counted in the kinds.
    cut: u64,
}

impl Results {
    fn record(&mut self, kind: Kind, verdict: Verdict, took: Duration) {
        let tally = self.by_kind.entry(kind).or_insert_with(Tally::new);
        match verdict {
            Verdict::Ok => {
                tally.ok += 1;
                let ms = u64::try_from(took.as_millis()).unwrap_or(u64::MAX);
                tally.latency.saturating_record(ms.max(1));
            }
            Verdict::Refused(status, code) => *tally.refused.entry(format!("{status} {code}")).or_default() += 1,
            Verdict::Failed(message) => {
                tally.failed += 1;
                if tally.failures.len() < 5 {
                    tally.failures.push(message);
                }
            }
        }
    }

    fn total(&self) -> (u64, u64, u64) {
        self.by_kind.values().fold((0, 0, 0), |(ok, refused, failed), t| {
            (ok + t.ok, refused + t.refused.values().sum::<u64>(), failed + t.failed)
        })
    }

    fn print(&self) {
        println!(
            "\n{:<16} {:>7} {:>8} {:>7} {:>8} {:>8} {:>8}  refusals",
            "job", "ok", "refused", "failed", "p50 ms", "p90 ms", "p99 ms"
        );
        for (kind, t) in &self.by_kind {
            let q = |q: f64| if t.ok == 0 { 0 } else { t.latency.value_at_quantile(q) };
            let refusals: Vec<String> = t.refused.iter().map(|(code, n)| format!("{code}: {n}")).collect();
            println!(
                "{:<16} {:>7} {:>8} {:>7} {:>8} {:>8} {:>8}  {}",
                kind.name(),
                t.ok,
                t.refused.values().sum::<u64>(),
                t.failed,
                q(0.5),
                q(0.9),
                q(0.99),
                refusals.join(", ")
            );
        }
        let (ok, refused, failed) = self.total();
        println!("{:<16} {ok:>7} {refused:>8} {failed:>7}", "all");
        if self.cut > 0 {
            println!("(jobs cut by the server's SIGKILL, not judged: {})", self.cut);
        }
        for (kind, t) in &self.by_kind {
            for failure in &t.failures {
                println!("FAILED {}: {failure}", kind.name());
            }
        }
    }
}

/// The load: `concurrency` workers running tagged jobs until `stop` is set.
struct Load {
    stop: Arc<AtomicBool>,
    started: Arc<AtomicU64>,
    workers: Vec<tokio::task::JoinHandle<()>>,
    results: Arc<Mutex<Results>>,
}

impl Load {
    fn start(target: &Target, concurrency: usize, seed: u64, round: u32, killed: Arc<AtomicBool>) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let started = Arc::new(AtomicU64::new(0));
        let results = Arc::new(Mutex::new(Results::default()));
        let workers = (0..concurrency)
            .map(|worker| {
                let (target, stop, started, results, killed) =
                    (target.clone(), stop.clone(), started.clone(), results.clone(), killed.clone());
                tokio::spawn(async move {
                    while !stop.load(Ordering::SeqCst) {
                        let n = started.fetch_add(1, Ordering::SeqCst);
                        let kind = Kind::pick(n, seed);
                        let tag = format!("soak-{round}-{worker}-{n}-{:x}", seed.wrapping_mul(n | 1));
                        let began = Instant::now();
                        let verdict = jobs::run(&target, kind, &tag, JOB_LIMIT).await;
                        let mut results = results.lock().await;
                        if killed.load(Ordering::SeqCst) && verdict != Verdict::Ok {
                            results.cut += 1;
                        } else {
                            results.record(kind, verdict, began.elapsed());
                        }
                    }
                })
            })
            .collect();
        Load { stop, started, workers, results }
    }

    async fn finish(self) -> Results {
        self.stop.store(true, Ordering::SeqCst);
        for worker in self.workers {
            let _ = worker.await;
        }
        Arc::try_unwrap(self.results).map(Mutex::into_inner).unwrap_or_default()
    }
}

fn print_header() {
    println!(
        "{:>7} {:>7} {:>6} {:>8} {:>8} {:>7} {:>6} {:>8} {:>6} {:>8}",
        "t", "jobs", "fds", "threads", "rss MiB", "mounts", "procs", "cgroups", "state", "scratch"
    );
}

fn print_row(at: Duration, jobs: u64, s: &Sample) {
    println!(
        "{:>6}s {:>7} {:>6} {:>8} {:>8} {:>7} {:>6} {:>8} {:>6} {:>8}",
        at.as_secs(),
        jobs,
        s.fds,
        s.threads,
        s.rss_kib / 1024,
        s.mounts,
        s.procs,
        s.cgroups,
        s.state,
        s.scratch
    );
}

/// One job of each kind, all of which must succeed.
async fn one_of_each(target: &Target, round: u32) -> anyhow::Result<()> {
    let mut failures = Vec::new();
    for (n, (kind, _)) in Kind::MIX.iter().enumerate() {
        let tag = format!("check-{round}-{n}");
        match jobs::run(target, *kind, &tag, JOB_LIMIT).await {
            Verdict::Ok => {}
            other => failures.push(format!("{}: {other:?}", kind.name())),
        }
    }
    if failures.is_empty() { Ok(()) } else { bail!("jobs failed: {}", failures.join("; ")) }
}

/// Waits up to `limit` for the server's sandboxes to be gone (they are deleted by the jobs; their jails end
/// asynchronously), then samples it.
async fn settled(pid: u32, home: Option<&Path>, baseline: &Sample, limit: Duration) -> Sample {
    let deadline = Instant::now() + limit;
    loop {
        let now = Sample::of(pid, home);
        let back = now.procs <= baseline.procs
            && now.cgroups <= baseline.cgroups
            && now.state <= baseline.state
            && now.scratch <= baseline.scratch
            && now.mounts <= baseline.mounts
            && now.fds <= baseline.fds + 8;
        if back || Instant::now() > deadline {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn target_of(server: &Server) -> Target {
    Target { base: server.base.clone(), ws_base: server.ws_base.clone(), client: reqwest::Client::new() }
}

fn server_config(args: &Args) -> ServerConfig {
    ServerConfig {
        strata: args.strata.clone().unwrap_or_else(server::default_strata),
        log: args.log.clone(),
        flags: ["--ttl", "300s", "--max-sandboxes", "128"].map(str::to_owned).to_vec(),
    }
}

async fn soak(args: &Args) -> anyhow::Result<bool> {
    let home = server::strata_home();
    let server = Server::start(&server_config(args)).await?;
    let target = target_of(&server);
    println!(
        "soak: strata serve pid {} at {}, {} workers for {:?}, samples every {:?}",
        server.pid, server.base, args.concurrency, args.duration, args.sample_every
    );
    // The first job of each kind maps runtimes, builds images, starts timer threads: not counted as growth.
    one_of_each(&target, 0).await.context("warm-up")?;
    // Idle: no jail left of the warm-up's sandboxes.
    let idle = Sample { fds: usize::MAX / 2, mounts: usize::MAX, state: usize::MAX, ..Sample::default() };
    let baseline = settled(server.pid, home.as_deref(), &idle, Duration::from_secs(30)).await;
    print_header();
    print_row(Duration::ZERO, 0, &baseline);
    let mut samples = vec![(Duration::ZERO, 0, baseline)];
    let load = Load::start(&target, args.concurrency, args.seed, 0, Arc::new(AtomicBool::new(false)));
    let began = Instant::now();
    while began.elapsed() < args.duration {
        tokio::time::sleep(args.sample_every.min(args.duration.saturating_sub(began.elapsed()))).await;
        let sample = Sample::of(server.pid, home.as_deref());
        let jobs = load.started.load(Ordering::SeqCst);
        print_row(began.elapsed(), jobs, &sample);
        samples.push((began.elapsed(), jobs, sample));
    }
    let jobs = load.started.load(Ordering::SeqCst);
    let results = load.finish().await;
    let took = began.elapsed();
    let after = settled(server.pid, home.as_deref(), &baseline, Duration::from_secs(60)).await;
    println!("settled:");
    print_row(took, jobs, &after);
    results.print();
    let peak_rss = samples.iter().map(|(_, _, s)| s.rss_kib).max().unwrap_or(0);
    println!(
        "\n{} jobs in {:.0} s ({:.1}/s) at {} at once; RSS baseline {} MiB, peak {} MiB, settled {} MiB",
        jobs,
        took.as_secs_f64(),
        jobs as f64 / took.as_secs_f64(),
        args.concurrency,
        baseline.rss_kib / 1024,
        peak_rss / 1024,
        after.rss_kib / 1024
    );
    let mut problems = Vec::new();
    let (_, _, failed) = results.total();
    if failed > 0 {
        problems.push(format!("{failed} jobs failed (lost, untyped or wrong answers)"));
    }
    let grew = |what: &str, before: usize, after: usize, slack: usize, problems: &mut Vec<String>| {
        if after > before + slack {
            problems.push(format!("{what} grew from {before} to {after}"));
        }
    };
    grew("fds", baseline.fds, after.fds, 8, &mut problems);
    grew("threads", baseline.threads, after.threads, 4, &mut problems);
    grew("mounts", baseline.mounts, after.mounts, 0, &mut problems);
    grew("processes", baseline.procs, after.procs, 0, &mut problems);
    grew("cgroups", baseline.cgroups, after.cgroups, 0, &mut problems);
    grew("state entries", baseline.state, after.state, 0, &mut problems);
    grew("scratch entries", baseline.scratch, after.scratch, 0, &mut problems);
    // The allocator keeps some of what peak load used; a leak grows with the jobs, far past this.
    if after.rss_kib > baseline.rss_kib + 256 * 1024 {
        problems.push(format!("RSS grew from {} to {} MiB", baseline.rss_kib / 1024, after.rss_kib / 1024));
    }
    let pid = server.pid;
    let own_cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let status = server.stop(Duration::from_secs(60)).await?;
    if !status.success() {
        problems.push(format!("the server exited {status} after SIGTERM"));
    }
    // A clean stop leaves nothing: no state directory, no cgroup.
    let mut left = probe::cgroups_under(&probe::cgroup_parents(&own_cgroups), pid);
    if let Some(home) = &home {
        left.extend(probe::state_dirs(home, pid));
        left.extend(probe::scratch_of(home, pid));
    }
    if !left.is_empty() {
        problems.push(format!("left after SIGTERM: {left:?}"));
    }
    report(&problems)
}

/// Chaos rounds: load, SIGKILL, checks, restart.
async fn chaos(args: &Args) -> anyhow::Result<bool> {
    let home = server::strata_home().context("chaos needs a STRATA_HOME")?;
    let config = server_config(args);
    let strata = config.strata.clone();
    let mut problems = Vec::new();
    let mut server = Server::start(&config).await?;
    let mut all = Results::default();
    for round in 1..=args.rounds {
        let target = target_of(&server);
        one_of_each(&target, round).await.with_context(|| format!("round {round}: a fresh server's jobs"))?;
        let kept = jobs::keep_snapshots(&target, &format!("kept-{round}"))
            .await
            .map_err(|e| anyhow::anyhow!("round {round}: keeping snapshots: {e}"))?;
        let mounts = probe::mounts_under(&home);
        let pid = server.pid;
        let own_cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
        let killed = Arc::new(AtomicBool::new(false));
        let load = Load::start(&target, args.concurrency, args.seed ^ u64::from(round), round, killed.clone());
        tokio::time::sleep(args.kill_after).await;
        let before = Sample::of(pid, Some(&home));
        let procs = probe::descendants(pid);
        let state = probe::state_dirs(&home, pid);
        killed.store(true, Ordering::SeqCst);
        server.kill().await?;
        let jobs = load.started.load(Ordering::SeqCst);
        println!(
            "round {round}: SIGKILL of pid {pid} after {jobs} jobs, holding {} processes, {} cgroups, {} state \
             entries, {} scratch entries",
            before.procs, before.cgroups, before.state, before.scratch
        );
        let results = load.finish().await;
        // The jails end with the server: each PID 1 sees its control socket close.
        let deadline = Instant::now() + Duration::from_secs(15);
        let mut survivors = alive(&procs);
        while !survivors.is_empty() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
            survivors = alive(&procs);
        }
        if !survivors.is_empty() {
            problems.push(format!("round {round}: processes outlived the killed server by 15 s: {survivors:?}"));
        }
        // Its snapshots, as the kill left them: each valid, or refused as invalid.
        let (valid, invalid) = inspect_snapshots(&strata, &state, round, &mut problems).await;
        let partial = state
            .iter()
            .flat_map(|dir| std::fs::read_dir(dir).into_iter().flatten().flatten())
            .filter(|e| e.file_name().to_string_lossy().contains(".partial-"))
            .count();
        println!(
            "round {round}: its snapshots: {} valid, {} refused as invalid, {partial} staging directories cut \
             mid-write (never opened as snapshots)",
            valid.len(),
            invalid.len()
        );
        // The snapshots it had finished before the load must have come through the kill whole.
        for id in &kept {
            if !valid.contains(id) {
                problems.push(format!("round {round}: the complete snapshot {id} is not valid after the kill"));
            }
        }
        server = Server::start(&config).await.with_context(|| format!("round {round}: restarting"))?;
        // The successor's start sweeps what the dead server left.
        let parents = probe::cgroup_parents(&own_cgroups);
        let deadline = Instant::now() + Duration::from_secs(30);
        let left = loop {
            let left: Vec<PathBuf> = probe::cgroups_under(&parents, pid)
                .into_iter()
                .chain(probe::state_dirs(&home, pid))
                .chain(probe::scratch_of(&home, pid))
                .collect();
            if left.is_empty() || Instant::now() > deadline {
                break left;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        if !left.is_empty() {
            problems.push(format!("round {round}: left after the restart: {left:?}"));
        }
        // Jails mount in namespaces of their own: nothing under the home may stay mounted on the host.
        let mounts_now = probe::mounts_under(&home);
        let stale_mounts: Vec<&String> = mounts_now.iter().filter(|m| !mounts.contains(m)).collect();
        if !stale_mounts.is_empty() {
            problems.push(format!("round {round}: mounts under the home left: {stale_mounts:?}"));
        }
        println!(
            "round {round}: restarted as pid {}; left of pid {pid}: {} cgroups, state, scratch; {} processes; {} \
             mounts",
            server.pid,
            left.len(),
            alive(&procs).len(),
            stale_mounts.len()
        );
        merge(&mut all, results);
    }
    one_of_each(&target_of(&server), args.rounds + 1).await.context("the last server's jobs")?;
    let pid = server.pid;
    let status = server.stop(Duration::from_secs(60)).await?;
    if !status.success() {
        problems.push(format!("the last server exited {status} after SIGTERM"));
    }
    if !probe::state_dirs(&home, pid).is_empty() {
        problems.push("the last server left its state directory after SIGTERM".to_owned());
    }
    all.print();
    let (_, _, failed) = all.total();
    if failed > 0 {
        problems.push(format!("{failed} jobs failed before a kill"));
    }
    report(&problems)
}

fn alive(procs: &[(u32, String)]) -> Vec<(u32, String)> {
    procs
        .iter()
        .filter(|(pid, name)| {
            // The same pid with the same name: not reused by another process meanwhile.
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    stat.split_once('(').and_then(|(_, rest)| rest.rsplit_once(')')).map(|(n, _)| n == name)
                })
                .unwrap_or(false)
        })
        .cloned()
        .collect()
}

fn merge(all: &mut Results, round: Results) {
    all.cut += round.cut;
    for (kind, tally) in round.by_kind {
        let into = all.by_kind.entry(kind).or_insert_with(Tally::new);
        into.ok += tally.ok;
        into.failed += tally.failed;
        into.failures.extend(tally.failures);
        for (code, n) in tally.refused {
            *into.refused.entry(code).or_default() += n;
        }
        let _ = into.latency.add(&tally.latency);
    }
}

/// Runs `strata snapshot inspect` on every snapshot in a dead server's state directories: the ids of those
/// found valid and of those refused as invalid. Anything but a clean pass or a typed refusal within 30 s is a
/// problem.
async fn inspect_snapshots(
    strata: &Path,
    state: &[PathBuf],
    round: u32,
    problems: &mut Vec<String>,
) -> (Vec<String>, Vec<String>) {
    let (mut valid, mut invalid) = (Vec::new(), Vec::new());
    for dir in state {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.starts_with("snap_") {
                continue;
            }
            let run = tokio::process::Command::new(strata)
                .args(["snapshot", "inspect"])
                .arg(entry.path())
                .kill_on_drop(true)
                .output();
            match tokio::time::timeout(Duration::from_secs(30), run).await {
                Ok(Ok(out)) if out.status.success() => valid.push(name),
                // A refusal is strata's usage-error exit with its one-line message; a panic is not one.
                Ok(Ok(out)) if out.status.code() == Some(2) && out.stderr.starts_with(b"strata: ") => {
                    invalid.push(name);
                    let said = String::from_utf8_lossy(&out.stderr);
                    println!("round {round}: {} refused: {}", entry.path().display(), said.trim());
                }
                Ok(Ok(out)) if out.status.code().is_some() => {
                    let said = String::from_utf8_lossy(&out.stderr);
                    problems.push(format!(
                        "round {round}: inspect {} exited {}: {said}",
                        entry.path().display(),
                        out.status
                    ));
                }
                Ok(Ok(out)) => {
                    problems.push(format!("round {round}: inspect {} died: {}", entry.path().display(), out.status))
                }
                Ok(Err(err)) => problems.push(format!("round {round}: cannot run inspect: {err}")),
                Err(_) => problems.push(format!("round {round}: inspect {} took over 30 s", entry.path().display())),
            }
        }
    }
    (valid, invalid)
}

fn report(problems: &[String]) -> anyhow::Result<bool> {
    if problems.is_empty() {
        println!("\nPASS");
        return Ok(true);
    }
    println!();
    for problem in problems {
        println!("PROBLEM: {problem}");
    }
    println!("FAIL");
    Ok(false)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let passed = match args.mode.as_str() {
        "soak" => soak(&args).await?,
        "chaos" => chaos(&args).await?,
        other => bail!("unknown mode {other:?} (soak or chaos)"),
    };
    if !passed {
        std::process::exit(1);
    }
    Ok(())
}
