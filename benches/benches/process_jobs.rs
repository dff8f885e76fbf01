//! Process-tier figures beside their peers, measured in the same run (run `benches/run.sh`, as root):
//!
//! | name           | Strata (a fresh jail per run)                         | peers, same run                        |
//! |----------------|-------------------------------------------------------|----------------------------------------|
//! | `true_inproc`  | `Engine::execute` (process tier), `/bin/true`         | `bwrap … /bin/true`; bare `/bin/true`  |
//! | `true_process` | `strata run --tier process -- /bin/true`              | the same two, run in turn with it      |
//! | `true_daemon`  | the same command through a warm `strata daemon`       | the same two, run in turn with it      |
//! | `print1`       | `Engine::execute` (process tier), `python3 -c print(1)`| `bwrap … python3 -c`; bare `python3 -c`|
//! | `sandbox_exec` | `/bin/true` in a live sandbox (a lane of the jail)     | `true_inproc` (a fresh jail)           |
//! | `jobs_8_*`     | 8 jobs at once in one sandbox                          | the same 8 in turn                     |
//!
//! Each Strata run is a fresh jail: namespaces, a cgroup, an overlay over the Debian rootfs, pivot_root, seccomp,
//! exec, teardown. The bwrap peer gets a comparable profile on the same rootfs (see [`bwrap`]). The whole-process
//! figures of `/bin/true` (the strata CLI, bwrap, bare) take turns run by run ([`interleaved`]), so that a machine
//! whose load changes during the bench moves all three alike. Then the targets with PASS/MISS beside them:
//! `/bin/true` in a fresh jail ≤ 10 ms p50 and ≤ 1.5× bwrap, in-process and as a whole `strata run` process; jail
//! overhead on `python3 -c 'print(1)'` ≤ 10 ms over bare. Nothing here asserts a time: the figures are for reading.
//!
//! Iterations per figure: `$STRATA_BENCH_ITERS`, else 500 (50 with `--quick`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::Context;
use strata_benches::{Contender, Figures, find_strata, interleaved, latency, process, ratio};
use strata_core::{Capabilities, ExecOptions, Job, Limits, Status, TierKind};
use strata_engine::{Engine, EngineConfig, RunRequest, TierChoice};

const PRINT1: &str = "print(1)";

/// The jail's PATH (`strata_jail::init::DEFAULT_PATH`), given to the bwrap peer too.
const GUEST_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// `bwrap` with a profile comparable to the jail's, on the same rootfs, running `argv`.
///
/// Alike: new mount, PID, network, IPC, UTS and cgroup namespaces (`--unshare-all`; bwrap also tries a user
/// namespace), hostname `strata`, a private `/proc`, a minimal `/dev`, every capability dropped, a new session,
/// killed with its parent, a clean environment (the jail's PATH, HOME, LANG), cwd `/root`.
/// Different: Strata mounts an overlayfs (tmpfs upper) over the rootfs so the whole tree is writable; bubblewrap
/// 0.8.0 (bookworm) has no `--overlay-src`/`--tmp-overlay`, so here the rootfs is a read-only bind with a tmpfs on
/// `/tmp`. bwrap creates no cgroup (no memory/pids/CPU limits, no CPU or peak-memory accounting) and loads no
/// seccomp filter unless given one; Strata does both, sets rlimits and `no_new_privs`, and runs its own PID 1.
fn bwrap(bin: &Path, rootfs: &Path, argv: &[&str]) -> Command {
    let mut c = Command::new(bin);
    c.args(["--unshare-all", "--die-with-parent", "--new-session"])
        .arg("--ro-bind")
        .arg(rootfs)
        .arg("/")
        .args(["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--cap-drop", "ALL", "--hostname", "strata"])
        .args(["--clearenv", "--setenv", "PATH", GUEST_PATH, "--setenv", "HOME", "/root", "--setenv", "LANG"])
        .args(["C.UTF-8", "--chdir", "/root", "--"])
        .args(argv);
    c
}

fn find_in_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?).map(|d| d.join(name)).find(|p| p.is_file())
}

/// The host's Python for the bare figure: Debian's `/usr/bin/python3` when there is one, else `python3` on PATH.
fn host_python() -> Option<PathBuf> {
    let debian = Path::new("/usr/bin/python3");
    if debian.exists() { Some(debian.to_owned()) } else { find_in_path("python3") }
}

fn version(bin: &Path) -> String {
    match Command::new(bin).arg("--version").output() {
        Ok(out) => {
            let text = if out.stdout.is_empty() { out.stderr } else { out.stdout };
            String::from_utf8_lossy(&text).trim().to_owned()
        }
        Err(err) => format!("unknown ({err})"),
    }
}

/// A fresh jail per run, through the engine in this process.
fn strata_inproc(
    engine: &Engine,
    name: &'static str,
    argv: &[&str],
    stdout: &[u8],
    iters: usize,
) -> anyhow::Result<Figures> {
    let job = Job::Command { argv: argv.iter().map(|a| (*a).to_owned()).collect() };
    latency(name, iters, || {
        let request = RunRequest::new(&job).limits(Limits::default()).tier(TierChoice::Tier(TierKind::Process));
        let outcome = engine.execute(request)?;
        anyhow::ensure!(outcome.status == Status::Exited { code: 0 } && outcome.stdout == stdout, "{outcome:?}");
        Ok(())
    })
}

/// Whether a whole process exited 0 with exactly `stdout` on its stdout.
fn exited_with(out: &Output, stdout: &[u8]) -> anyhow::Result<()> {
    anyhow::ensure!(out.status.success() && out.stdout == stdout, "{:?}, stdout {:?}", out.status, out.stdout);
    Ok(())
}

/// A whole process per run; its exit must be 0 and its stdout exactly `stdout`.
fn whole(name: &'static str, iters: usize, stdout: &[u8], cmd: &mut dyn FnMut() -> Command) -> anyhow::Result<Figures> {
    process(name, iters, (iters / 10).max(1), cmd, &|out| exited_with(out, stdout))
}

/// One target line: the figure, the target and PASS/MISS (informative only).
fn target(name: &str, what: &str, value: f64, unit: &str, limit: f64) {
    let verdict = if value <= limit { "PASS" } else { "MISS" };
    println!("{name:<26} {what:<36} {value:>8.2}{unit:<2}  target <= {limit}{unit}  {verdict}");
}

/// A `strata daemon` of the bench's own, on a socket in a temporary directory, stopped when dropped.
struct WarmDaemon {
    strata: PathBuf,
    home: PathBuf,
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl WarmDaemon {
    /// Starts it with the environment the bench's `strata run` commands have (it serves only those).
    fn start(strata: &Path, home: &Path) -> anyhow::Result<WarmDaemon> {
        let dir = tempfile::tempdir()?;
        let socket = dir.path().join("warm.sock");
        let daemon = WarmDaemon { strata: strata.to_owned(), home: home.to_owned(), socket, _dir: dir };
        let out = daemon.command(&["daemon", "start", "--idle", "10m"]).output()?;
        anyhow::ensure!(out.status.success(), "daemon start: {}", String::from_utf8_lossy(&out.stderr).trim());
        Ok(daemon)
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(&self.strata);
        c.env("STRATA_HOME", &self.home).env("STRATA_DAEMON", &self.socket).args(args);
        c
    }

    /// Fails unless the daemon served every run handed to it (a refused run would have run cold).
    fn check_served(&self, runs: usize) -> anyhow::Result<()> {
        let out = self.command(&["daemon", "status", "--json"]).output()?;
        let status: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        let served = status["served"].as_u64().unwrap_or(0);
        anyhow::ensure!(served >= runs as u64, "the daemon served {served} of {runs}+ runs: {status}");
        Ok(())
    }
}

impl Drop for WarmDaemon {
    fn drop(&mut self) {
        let _ = self.command(&["daemon", "stop"]).output();
    }
}

fn main() -> anyhow::Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let iters: usize = match std::env::var("STRATA_BENCH_ITERS") {
        Ok(n) => n.parse().context("STRATA_BENCH_ITERS")?,
        Err(_) if quick => 50,
        Err(_) => 500,
    };
    let home = strata_engine::strata_home().context("no STRATA_HOME nor HOME")?;
    let engine = Engine::new(EngineConfig { home: Some(home.clone()), ..EngineConfig::default() })?;
    println!(
        "# Strata process-tier benchmarks ({} cores, {iters} runs per figure); p50/p90/p99/max per job",
        std::thread::available_parallelism()?
    );
    // Engine::process() would build a missing Debian image (minutes, silently here): skip instead.
    if !engine.images().debian()?.is_installed() {
        println!("process tier: skipped: no Debian image (benches/run.sh or `strata images build debian` builds it)");
        return Ok(());
    }
    if let Err(err) = engine.process() {
        println!("process tier: skipped: {err}");
        return Ok(());
    }
    let rootfs = engine.images().debian()?.installed()?.rootfs;
    let bwrap_bin = find_in_path("bwrap");
    match &bwrap_bin {
        Some(bin) => println!("# peer: {} ({}), rootfs {}", version(bin), bin.display(), rootfs.display()),
        None => println!("# peer bwrap: skipped: not on PATH (benches/run.sh installs Debian's bubblewrap)"),
    }
    let strata = find_strata();
    if strata.is_none() {
        println!("# strata run: skipped: no target/release/strata (benches/run.sh builds it)");
    }

    // /bin/true.
    let name = "true";
    let inproc = strata_inproc(&engine, "true_inproc", &["/bin/true"], b"", iters)?;
    // A warm daemon of the bench's own, which the CLI's second figure goes through.
    let daemon = match &strata {
        Some(strata) => match WarmDaemon::start(strata, &home) {
            Ok(daemon) => Some(daemon),
            Err(err) => {
                println!("# strata run through the daemon: skipped: {err:#}");
                None
            }
        },
        None => None,
    };
    // The whole processes in turn: the CLI without and with the daemon (when built), bwrap (when installed), bare.
    let strata_run = |socket: &Path| {
        let mut c = Command::new(strata.as_deref().unwrap_or(Path::new("strata")));
        c.env("STRATA_HOME", &home).env("STRATA_DAEMON", socket).args(["run", "--tier", "process", "--", "/bin/true"]);
        c
    };
    let mut cli_cmd = || strata_run(Path::new("off"));
    let mut daemon_cmd = || strata_run(daemon.as_ref().map_or(Path::new("off"), |d| d.socket.as_path()));
    let mut bwrap_cmd = || bwrap(bwrap_bin.as_deref().unwrap_or(Path::new("bwrap")), &rootfs, &["/bin/true"]);
    let mut bare_cmd = || Command::new("/bin/true");
    let mut contenders = Vec::new();
    if strata.is_some() {
        contenders.push(Contender { name: "true_process", cmd: &mut cli_cmd });
    }
    if daemon.is_some() {
        contenders.push(Contender { name: "true_daemon", cmd: &mut daemon_cmd });
    }
    if bwrap_bin.is_some() {
        contenders.push(Contender { name: "true_bwrap", cmd: &mut bwrap_cmd });
    }
    contenders.push(Contender { name: "true_bare", cmd: &mut bare_cmd });
    let mut figures = interleaved(iters, (iters / 10).max(1), &mut contenders, &|out| exited_with(out, b""))?;
    let bare = figures.pop().expect("bare is always measured");
    let peer = bwrap_bin.is_some().then(|| figures.pop()).flatten();
    let warm = daemon.is_some().then(|| figures.pop()).flatten();
    let cli = strata.is_some().then(|| figures.pop()).flatten();
    if let Some(daemon) = &daemon {
        daemon.check_served(iters)?;
    }
    drop(daemon);
    inproc.print("strata (in-process)");
    if let Some(cli) = &cli {
        cli.print("strata run --tier process (CLI)");
    }
    if let Some(warm) = &warm {
        warm.print("the same through strata daemon");
    }
    if let Some(peer) = &peer {
        peer.print("bwrap (ro rootfs)");
    }
    bare.print("bare /bin/true (host)");
    if let Some(peer) = &peer {
        ratio(name, &inproc, peer, "bwrap");
    }
    ratio(name, &inproc, &bare, "bare");
    if let (Some(cli), Some(peer)) = (&cli, &peer) {
        println!(
            "{name:<26} ratio strata CLI/bwrap: p50 {:.2}x, p99 {:.2}x",
            cli.p_us(0.5) / peer.p_us(0.5),
            cli.p_us(0.99) / peer.p_us(0.99)
        );
    }
    if let (Some(warm), Some(peer)) = (&warm, &peer) {
        println!(
            "{name:<26} ratio strata CLI through the daemon/bwrap: p50 {:.2}x, p99 {:.2}x",
            warm.p_us(0.5) / peer.p_us(0.5),
            warm.p_us(0.99) / peer.p_us(0.99)
        );
    }

    // python3 -c 'print(1)'.
    let name = "print1";
    let py_inproc = strata_inproc(&engine, "print1_inproc", &["python3", "-c", PRINT1], b"1\n", iters)?;
    let py_peer = match &bwrap_bin {
        Some(bin) => {
            Some(whole("print1_bwrap", iters, b"1\n", &mut || bwrap(bin, &rootfs, &["python3", "-c", PRINT1]))?)
        }
        None => None,
    };
    let python = host_python().context("no python3 on the host")?;
    println!(
        "# python: jail and bwrap run the image's /usr/bin/python3 ({}); bare runs the host's {} ({})",
        version(&rootfs.join("usr/bin/python3")),
        python.display(),
        version(&python)
    );
    let py_bare = whole("print1_bare", iters, b"1\n", &mut || {
        let mut c = Command::new(&python);
        c.args(["-c", PRINT1]);
        c
    })?;
    py_inproc.print("strata (in-process)");
    if let Some(peer) = &py_peer {
        peer.print("bwrap (ro rootfs)");
    }
    py_bare.print("bare python3 (host)");
    if let Some(peer) = &py_peer {
        ratio(name, &py_inproc, peer, "bwrap");
    }
    ratio(name, &py_inproc, &py_bare, "bare");

    // A live sandbox: a job (on a lane of the jail: a socket pair and a child cgroup of its own per job), then 8
    // jobs at once, against 8 in turn.
    let sandbox = engine.start(TierChoice::Tier(TierKind::Process), &Capabilities::default(), &Limits::default())?;
    let job = Job::Command { argv: vec!["/bin/true".into()] };
    let exited = |outcome: strata_core::Outcome| -> anyhow::Result<()> {
        anyhow::ensure!(outcome.status == Status::Exited { code: 0 }, "{outcome:?}");
        Ok(())
    };
    let own = latency("sandbox_exec", iters, || exited(sandbox.exec(&job, ExecOptions::default())?))?;
    let batch = |parallel: bool| -> anyhow::Result<()> {
        if !parallel {
            return (0..8).try_for_each(|_| exited(sandbox.exec(&job, ExecOptions::default())?));
        }
        std::thread::scope(|scope| {
            let jobs: Vec<_> = (0..8).map(|_| scope.spawn(|| sandbox.exec(&job, ExecOptions::default()))).collect();
            jobs.into_iter().try_for_each(|j| exited(j.join().map_err(|_| anyhow::anyhow!("job thread"))??))
        })
    };
    let in_turn = latency("jobs_8_in_turn", (iters / 10).max(5), || batch(false))?;
    let at_once = latency("jobs_8_at_once", (iters / 10).max(5), || batch(true))?;
    sandbox.close()?;
    own.print("sandbox, one job");
    ratio("sandbox_exec", &own, &inproc, "a fresh jail");
    in_turn.print("8 jobs in turn");
    at_once.print("8 jobs at once");
    ratio("jobs_8_at_once", &at_once, &in_turn, "in turn");

    // The targets, informative.
    println!("# targets (benchmarks, not tests: a MISS does not fail the bench)");
    let ms = |f: &Figures| f.p_us(0.5) / 1_000.0;
    target("true_inproc", "p50, fresh jail, in-process", ms(&inproc), "ms", 10.0);
    if let Some(cli) = &cli {
        target("true_process", "p50, fresh jail, strata CLI", ms(cli), "ms", 10.0);
    }
    if let Some(peer) = &peer {
        target("true_inproc", "p50 strata/bwrap", ms(&inproc) / ms(peer), "x", 1.5);
        if let Some(cli) = &cli {
            target("true_process", "p50 strata CLI/bwrap", ms(cli) / ms(peer), "x", 1.5);
        }
        if let Some(warm) = &warm {
            target("true_daemon", "p50 strata CLI (daemon)/bwrap", ms(warm) / ms(peer), "x", 1.5);
        }
    }
    target("print1_inproc", "p50 overhead, strata - bare", ms(&py_inproc) - ms(&py_bare), "ms", 10.0);
    if let Some(peer) = &py_peer {
        println!(
            "{:<26} {:<36} {:>8.2}ms  (for reference)",
            "print1_bwrap",
            "p50 overhead, bwrap - bare",
            ms(peer) - ms(&py_bare)
        );
    }
    Ok(())
}
