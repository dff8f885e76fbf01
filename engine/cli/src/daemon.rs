//! `strata daemon`: the warm daemon that later `strata run` commands hand their command lines to
//! (`strata_engine::warm`).

use std::io::Write;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use strata_engine::warm::{self, Daemon, DaemonStatus, SparePlan};
use strata_engine::{Engine, Policy, strata_home};

use crate::Failure;

#[derive(Args)]
pub(crate) struct DaemonArgs {
    #[command(subcommand)]
    command: DaemonCommand,
}

#[derive(Subcommand)]
enum DaemonCommand {
    /// Start the warm daemon in the background and return once it answers (or say why it could not start).
    Start(StartArgs),
    /// Stop the daemon: it takes no more jobs and exits when the running ones have ended.
    Stop,
    /// Whether a daemon answers, and its counters.
    Status {
        /// Print the status as one JSON object (`{"up":false,…}` when no daemon answers).
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args)]
struct StartArgs {
    /// Exit after this long without a job, e.g. 30s, 15m, 2h.
    #[arg(long, default_value = "15m", value_parser = crate::run::parse_duration_arg)]
    idle: Duration,
    /// Serve in this process instead of the background (for a service manager); logs go to stderr.
    #[arg(long)]
    foreground: bool,
    /// Children kept forked ahead of their commands, of each kind: holding the jail a default Linux command runs
    /// in, and holding a fresh Python instance for one-shot Python (~40 MiB each) (0: fork one per command, when
    /// it arrives).
    #[arg(long, default_value_t = SPARES)]
    spares: usize,
}

fn socket() -> Result<PathBuf, Failure> {
    warm::socket_path(strata_home().as_deref()).ok_or_else(|| {
        Failure::new("usage", "no socket for the daemon: STRATA_DAEMON is off, or there is no STRATA_HOME or HOME")
    })
}

fn failure(err: warm::WarmError) -> Failure {
    Failure::new("daemon", err.to_string())
}

pub(crate) fn daemon(args: DaemonArgs) -> Result<i32, Failure> {
    let path = socket()?;
    match args.command {
        DaemonCommand::Start(start) if start.foreground => serve(path, start.idle, start.spares),
        DaemonCommand::Start(start) => spawn(path, start.idle, start.spares),
        DaemonCommand::Stop => match warm::stop(&path) {
            Ok(()) => {
                crate::progress::plain(&format!("strata: the daemon on {} is stopping", path.display()));
                Ok(0)
            }
            Err(warm::WarmError::NotRunning(_)) => {
                crate::progress::plain(&format!("strata: no daemon answers on {}", path.display()));
                Ok(0)
            }
            Err(err) => Err(failure(err)),
        },
        DaemonCommand::Status { json } => {
            let status = match warm::status(&path) {
                Ok(status) => Some(status),
                Err(warm::WarmError::NotRunning(_)) => None,
                Err(err) => return Err(failure(err)),
            };
            print_status(&path, status.as_ref(), json);
            Ok(if status.is_some() { 0 } else { 1 })
        }
    }
}

fn print_status(path: &std::path::Path, status: Option<&DaemonStatus>, json: bool) {
    let mut out = std::io::stdout();
    match (status, json) {
        (None, true) => {
            let _ = writeln!(out, "{}", serde_json::json!({"up": false, "socket": path}));
        }
        (None, false) => {
            let _ = writeln!(out, "no daemon answers on {}", path.display());
        }
        (Some(status), true) => {
            let mut object = serde_json::to_value(status).unwrap_or_default();
            if let Some(map) = object.as_object_mut() {
                map.insert("up".into(), true.into());
                map.insert("socket".into(), path.display().to_string().into());
            }
            let _ = writeln!(out, "{object}");
        }
        (Some(status), false) => {
            let _ = writeln!(
                out,
                "daemon pid {} on {}: up {} s, {} jobs served, {} running, {} refused; exits after {} s idle",
                status.pid,
                path.display(),
                status.uptime_s,
                status.served,
                status.running,
                status.refused,
                status.idle_exit_s
            );
            if let Some(reason) = &status.last_refusal {
                let _ = writeln!(out, "last refused: {reason} (that run ran without the daemon)");
            }
        }
    }
}

/// Children of each kind the daemon keeps forked and prepared ahead of their commands: two, so that while one
/// command runs the next child is ready and the one after prepares.
const SPARES: usize = 2;

/// `start --foreground`: warms an engine of `strata run`'s default configuration and serves until stopped.
fn serve(path: PathBuf, idle: Duration, spares: usize) -> Result<i32, Failure> {
    let engine = Engine::new(crate::run::engine_config(Policy::default(), None)?)?;
    engine.warm()?;
    crate::run::prestart_python(&engine);
    let daemon = Daemon::bind(&path, engine, run_in_child, idle).map_err(failure)?.with_spares(vec![
        SparePlan { count: spares, prepare: crate::run::prestart, suits: crate::run::suits_spare },
        SparePlan { count: spares, prepare: crate::run::python_resident, suits: crate::run::suits_python },
    ]);
    log::info!("daemon ready on {} (pid {})", path.display(), std::process::id());
    daemon.serve().map_err(failure)?;
    Ok(0)
}

/// What a job's child runs: the command line, as `strata` itself would, with the warm engine.
fn run_in_child(argv: Vec<String>, engine: Engine) -> i32 {
    crate::progress::reset();
    i32::from(crate::dispatch(argv.into_iter().map(Into::into).collect(), Some(engine)))
}

/// `start`: warms the caches in this process (compiling what is not compiled yet, with progress), then starts
/// `strata daemon start --foreground` in the background, logging to `logs/daemon.log` under the home, and waits
/// until it answers.
fn spawn(path: PathBuf, idle: Duration, spares: usize) -> Result<i32, Failure> {
    if let Ok(status) = warm::status(&path) {
        crate::progress::plain(&format!("strata: a daemon (pid {}) already answers on {}", status.pid, path.display()));
        return Ok(0);
    }
    // Whatever the first run compiles or generates (with threads) is made here, so the daemon starts from disk
    // caches and stays single-threaded, as it must to fork.
    Engine::new(crate::run::engine_config(Policy::default(), None)?)?.warm()?;
    let home = strata_home().ok_or_else(|| Failure::new("usage", "no STRATA_HOME or HOME"))?;
    let logs = home.join("logs");
    std::fs::create_dir_all(&logs).map_err(|e| Failure::new("io", format!("{}: {e}", logs.display())))?;
    let log_path = logs.join("daemon.log");
    let log =
        std::fs::File::create(&log_path).map_err(|e| Failure::new("io", format!("{}: {e}", log_path.display())))?;
    let err = log.try_clone().map_err(|e| Failure::new("io", e.to_string()))?;
    let exe = std::env::current_exe().map_err(|e| Failure::new("io", e.to_string()))?;
    let mut child = {
        use std::os::unix::process::CommandExt;
        std::process::Command::new(exe)
            .args(["daemon", "start", "--foreground", "--idle"])
            .arg(format!("{}s", idle.as_secs().max(1)))
            .arg(format!("--spares={spares}"))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            // Its own process group: a Ctrl-C in the terminal that started it does not reach it.
            .process_group(0)
            .spawn()
            .map_err(|e| Failure::new("io", format!("cannot start the daemon: {e}")))?
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(status) = warm::status(&path) {
            crate::progress::plain(&format!(
                "strata: daemon pid {} answers on {} (exits after {} s idle; `strata daemon stop` stops it)",
                status.pid,
                path.display(),
                status.idle_exit_s
            ));
            return Ok(0);
        }
        if let Ok(Some(exit)) = child.try_wait() {
            let text = std::fs::read_to_string(&log_path).unwrap_or_default();
            let last = text.lines().last().unwrap_or("no message");
            return Err(Failure::new("daemon", format!("the daemon exited ({exit}): {last}")));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(Failure::new(
                "daemon",
                format!("the daemon did not answer within 60 s (see {})", log_path.display()),
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
