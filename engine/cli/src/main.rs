//! The `strata` command. It parses arguments and prints; `strata-engine` decides and the tiers execute.
//!
//! Exit status (docs/DESIGN.md §5): the guest's exit code when it exited; 124 when a limit stopped it; 125 when it
//! trapped or crashed; 2 for a usage or input error (one line on stderr, or `{"error":{…}}` under `--json`).

#![forbid(unsafe_code)]

mod console;
mod daemon;
mod docs;
mod doctor;
mod images;
mod progress;
mod prune;
mod replay;
mod run;
mod serve;
mod snapshot;
mod tty;

use std::io::Write;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Exit status for usage and input errors.
const USAGE_ERROR: u8 = 2;

#[derive(Parser)]
#[command(
    name = "strata",
    version,
    about = "Run untrusted code fast, isolated and metered.",
    long_about = "Run untrusted code fast, isolated and metered: WebAssembly modules and Python on the wasm tier \
                  (wasmtime), Linux programs in a jail on the process tier, with file grants, limits and a usage \
                  report."
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// Run a job: `strata run [OPTIONS] FILE [-- ARGS...]`, or `strata run --python -c CODE | -m MODULE`.
    Run(Box<run::RunCommand>),
    /// Re-run a job recorded by `strata run --record FILE` with the same inputs and check that its output and
    /// exit status are byte-identical; says where it diverged if not (exit status 1).
    Replay(replay::ReplayArgs),
    /// Snapshot a prepared sandbox (`create`) or look into a snapshot (`inspect`); `strata run --snapshot DIR`
    /// forks it.
    Snapshot(snapshot::SnapshotArgs),
    /// Build, list or verify guest images (the Python runtime, the Debian root filesystem); size and prune caches.
    Images(images::ImagesArgs),
    /// What this host can run (KVM kind, cgroups, namespaces, seccomp, overlayfs) and each tier's availability.
    Doctor(doctor::DoctorArgs),
    /// Serve the sandbox API over HTTP and WebSocket (`/v1`, `/metrics`) until SIGTERM or SIGINT.
    Serve(Box<serve::ServeArgs>),
    /// A warm daemon that later `strata run` commands hand their command lines to (start, stop, status): a one-shot
    /// Python job then starts from an engine with the runtime loaded, in a few milliseconds. `STRATA_DAEMON=off`
    /// makes `strata run` ignore it.
    Daemon(daemon::DaemonArgs),
    /// Print a completion script for a shell: `strata completions bash > ~/.local/share/bash-completion/completions/strata`.
    Completions(docs::CompletionsArgs),
    /// Print the manual page (roff), or write one page per command into a directory (`--dir`).
    Man(docs::ManArgs),
}

/// A usage or input error, reported as one line (or a JSON object) with exit status 2.
#[derive(Debug)]
pub(crate) struct Failure {
    kind: &'static str,
    message: String,
}

impl Failure {
    pub(crate) fn new(kind: &'static str, message: impl Into<String>) -> Failure {
        Failure { kind, message: message.into() }
    }
}

impl From<strata_engine::EngineError> for Failure {
    fn from(err: strata_engine::EngineError) -> Failure {
        Failure::new(err.code(), err.to_string())
    }
}

/// Prints the library's progress (`strata: compiling …`) and warnings (`strata: warning: …`) on stderr.
struct StderrLogger;

impl log::Log for StderrLogger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::Level::Info
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let warning = matches!(record.level(), log::Level::Error | log::Level::Warn);
        progress::line(&record.args().to_string(), warning);
    }

    fn flush(&self) {}
}

fn main() -> ExitCode {
    // Before any thread starts (see `tty::block_resizes`).
    tty::block_resizes();
    static LOGGER: StderrLogger = StderrLogger;
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(log::LevelFilter::Info);
    }
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // A run on a terminal (`-t`) is this process's: its window changes and raw mode are this terminal's.
    let tty = args.iter().skip(2).take_while(|a| *a != "--").any(|a| a == "-t" || a == "--tty");
    if args.get(1).is_some_and(|a| a == "run")
        && !tty
        && let Some(socket) = strata_engine::warm::socket_path(strata_engine::strata_home().as_deref())
        && let Some(ended) = strata_engine::warm::run_through(&socket, &args)
    {
        return match ended {
            Ok(strata_engine::warm::Ended::Exited(code)) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
            Ok(strata_engine::warm::Ended::Signaled(signal)) => {
                ExitCode::from(u8::try_from(strata_engine::warm::end_like(signal)).unwrap_or(1))
            }
            Err(err) => {
                let json = args.iter().take_while(|a| *a != "--").any(|a| a == "--json");
                ExitCode::from(fail(json, &Failure::new("daemon", err.to_string())))
            }
        };
    }
    ExitCode::from(dispatch(args, None))
}

/// Runs the command line `args` (the program name first) and returns its exit status; `warm`: a warm daemon's
/// engine, for `run`.
pub(crate) fn dispatch(args: Vec<std::ffi::OsString>, warm: Option<strata_engine::Engine>) -> u8 {
    // `--json` before any `--` asks for JSON errors too, even when parsing fails.
    let json = args.iter().take_while(|a| *a != "--").any(|a| a == "--json");
    let cli = match Cli::try_parse_from(&args) {
        Ok(cli) => cli,
        Err(err) => {
            use clap::error::ErrorKind;
            if matches!(err.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = err.print();
                return 0;
            }
            if err.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                let _ = err.print();
                return USAGE_ERROR;
            }
            return fail(json, &Failure::new("usage", clap_message(&err)));
        }
    };
    let result = match cli.command {
        Command::Run(args) => {
            let json = args.run.json;
            run::run(*args, warm).map_err(|failure| (json, failure))
        }
        Command::Replay(args) => {
            let json = args.json;
            replay::replay(args).map_err(|failure| (json, failure))
        }
        Command::Snapshot(args) => {
            let json = snapshot::wants_json(&args);
            snapshot::snapshot(args).map_err(|failure| (json, failure))
        }
        Command::Images(args) => images::images(args).map_err(|failure| (false, failure)),
        Command::Doctor(args) => doctor::doctor(args).map_err(|failure| (false, failure)),
        Command::Serve(args) => serve::serve(*args).map_err(|failure| (false, failure)),
        Command::Daemon(args) => daemon::daemon(args).map_err(|failure| (false, failure)),
        Command::Completions(args) => docs::completions::<Cli>(&args).map_err(|failure| (false, failure)),
        Command::Man(args) => docs::man::<Cli>(&args).map_err(|failure| (false, failure)),
    };
    match result {
        // Exit codes outside 0..=255 cannot be represented; WASI limits them to 0..126 anyway.
        Ok(code) => u8::try_from(code).unwrap_or(1),
        Err((json, failure)) => fail(json, &failure),
    }
}

/// clap's message without its `error: ` prefix and usage hints, on one line:
/// "invalid value '2x' for '--timeout <DURATION>': …".
fn clap_message(err: &clap::Error) -> String {
    let text = err.to_string();
    let message: Vec<&str> =
        text.lines().take_while(|line| !line.trim().is_empty() && !line.starts_with("Usage:")).map(str::trim).collect();
    let message = message.join(" ");
    message.strip_prefix("error: ").unwrap_or(&message).to_owned()
}

fn fail(json: bool, failure: &Failure) -> u8 {
    if json {
        let object = serde_json::json!({"error": {"kind": failure.kind, "message": failure.message}});
        let _ = writeln!(std::io::stdout(), "{object}");
    } else {
        progress::plain(&format!("strata: {}", failure.message));
    }
    USAGE_ERROR
}
