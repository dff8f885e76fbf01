//! `strata run`.

use std::io::{IsTerminal, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use strata_core::{
    Allowlist, ByteSize, Capabilities, Determinism, EnvVar, ExecOptions, Fuel, Grant, Job, Limits, LimitsOverride,
    Outcome, PythonSource, Recorder, Snapshot, Status, StdinStream, TierKind, format_duration, parse_duration,
};
use strata_engine::{Engine, EngineConfig, Policy, RunRequest, TierChoice, VmImage};

use crate::Failure;
use crate::console::Console;

#[derive(Args)]
pub(crate) struct RunArgs {
    /// The program: a WebAssembly command (a WASI preview1 module or a WASI 0.2 component), a Python script (.py)
    /// or a Linux executable.
    /// Without FILE, the arguments after `--` are a command of the guest image (`--tier process -- ls /`).
    #[arg(value_name = "FILE")]
    file: Option<PathBuf>,

    /// Run Python (with FILE: treat it as a Python script whatever its name).
    #[arg(long)]
    python: bool,

    /// Python source to run, as `python -c CODE`.
    #[arg(short = 'c', value_name = "CODE", conflicts_with_all = ["file", "module"])]
    code: Option<String>,

    /// A Python module to run as `__main__`, as `python -m MODULE`.
    #[arg(short = 'm', value_name = "MODULE", conflicts_with_all = ["file"])]
    module: Option<String>,

    /// Arguments passed to the program, or the command itself when there is no FILE (after `--`).
    #[arg(last = true, value_name = "ARGS")]
    args: Vec<String>,

    /// Tier to run on: auto, wasm, process or vm.
    #[arg(long, value_name = "TIER", default_value = "auto", value_parser = parse_tier)]
    tier: TierChoice,

    /// The root filesystem: a custom image built or imported with `strata images` (the process tier), or the
    /// microVM's own: initramfs (busybox, the fastest boot) or debian (python3 and the rest).
    #[arg(long, value_name = "IMAGE", value_parser = parse_image)]
    image: Option<ImageChoice>,

    /// Wall-clock limit, e.g. 2s, 500ms [default: 30s].
    #[arg(long, value_name = "DURATION", value_parser = parse_duration_arg)]
    timeout: Option<Duration>,

    /// CPU-time limit, e.g. 1s [default: 30s].
    #[arg(long, value_name = "DURATION", value_parser = parse_duration_arg)]
    cpu: Option<Duration>,

    /// WebAssembly fuel budget (runs fuel-metered code and reports fuel used), or "unlimited" [default: unlimited].
    #[arg(long, value_name = "N", value_parser = parse_fuel)]
    fuel: Option<Fuel>,

    /// Memory limit, e.g. 256MiB [default: 512MiB].
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    memory: Option<ByteSize>,

    /// Captured output per stream; beyond it output is counted and dropped, e.g. 64KiB [default: 1MiB].
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    output_limit: Option<ByteSize>,

    /// Virtual CPUs of a microVM; on the process tier, the jail's CPU bandwidth in whole CPUs [default: 1].
    #[arg(long, value_name = "N")]
    vcpus: Option<u32>,

    /// Processes and threads the job may have at once (process and microVM tiers) [default: 256].
    #[arg(long, value_name = "N")]
    pids: Option<u32>,

    /// Scratch disk the job may write, e.g. 256MiB (the jail's writable layer) [default: 1GiB].
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    disk: Option<ByteSize>,

    /// Grant a host directory at a guest path; read-only unless `:rw` (repeatable).
    #[arg(long = "dir", value_name = "HOST:GUEST[:ro|:rw]", value_parser = parse_grant)]
    dirs: Vec<Grant>,

    /// Set an environment variable in the guest (repeatable).
    #[arg(long = "env", value_name = "K=V", value_parser = parse_env)]
    env: Vec<EnvVar>,

    /// Run as this account of the sandbox's image (the process tier's Debian image has `user`, uid 1000, with
    /// passwordless `sudo`); the sandbox's root by default. Python goes native for it.
    #[arg(long, value_name = "USER")]
    user: Option<strata_core::UserName>,

    /// Like --env, and the value is redacted from captured output (repeatable).
    #[arg(long = "secret", value_name = "K=V", value_parser = parse_env)]
    secrets: Vec<EnvVar>,

    /// A secret the job never sees (repeatable; process tier): the guest's NAME holds a placeholder, and the egress
    /// proxy puts VALUE in its place in the headers of plain-HTTP requests to the HOSTs (each inside --allow-net),
    /// nowhere else. `NAME=env:VAR@HOST` reads the value from this command's environment, keeping it out of argv.
    // Strings here, parsed in `run`: clap's own errors would repeat the value.
    #[arg(long = "egress-secret", value_name = "NAME=VALUE@HOST[,HOST...]")]
    egress_secrets: Vec<String>,

    /// Allow network egress to HOST[:PORT] (repeatable): through the host proxy on the native tiers, as checked
    /// wasi:sockets connects for wasm components; Python goes native for it (CPython in wasm has no sockets).
    #[arg(long = "allow-net", value_name = "HOST[:PORT]", value_parser = parse_net)]
    allow_net: Vec<Allowlist>,

    /// A policy file (policies/README.md): limits, tiers, network, grant sets; flags override or add to it.
    #[arg(long, value_name = "FILE")]
    policy: Option<PathBuf>,

    /// Grant the directories of the policy's grant set [grants.NAME] (repeatable); --dir adds to them.
    #[arg(long = "grants", value_name = "NAME")]
    grant_sets: Vec<String>,

    /// Run the job in a fresh fork of this snapshot (made by `strata snapshot create`); the fork keeps the
    /// snapshot's grants, environment and network.
    #[arg(long, value_name = "DIR")]
    snapshot: Option<PathBuf>,

    /// Print exactly one JSON object, the outcome (or {"error":…}), instead of the guest's output.
    #[arg(long)]
    pub(crate) json: bool,

    /// Run the job on a pseudo-terminal driven from this terminal, as `docker run -it` does: raw mode (every key
    /// goes to the job), window-size changes forwarded (process and microVM tiers; Python goes native).
    #[arg(short = 't', long, conflicts_with = "json")]
    pub(crate) tty: bool,
}

/// `strata run`: the job's options, and how to make the run reproducible.
#[derive(Args)]
pub(crate) struct RunCommand {
    #[command(flatten)]
    pub(crate) run: RunArgs,

    #[command(flatten)]
    repro: ReproArgs,
}

/// Reproducible runs (wasm jobs only: they force the wasm tier).
#[derive(Args)]
struct ReproArgs {
    /// Make the job's clocks and randomness deterministic: the wall clock starts at an instant derived from N and
    /// both clocks advance 1ms per reading, random bytes come from ChaCha20 keyed by N (wasm tier only).
    #[arg(long, value_name = "N")]
    seed: Option<u64>,

    /// Record the job's inputs (args, env, stdin, clock readings, random bytes, tool answers) and its output and
    /// status into FILE, for `strata replay FILE` (wasm tier only; stdin is read whole before the job starts).
    #[arg(long, value_name = "FILE")]
    record: Option<PathBuf>,
}

/// A job ready to run: what `strata run` and `strata snapshot create` make of their options.
pub(crate) struct Prepared {
    pub(crate) engine: Engine,
    pub(crate) job: Job,
    pub(crate) caps: Capabilities,
    pub(crate) limits: Limits,
    pub(crate) tier: TierChoice,
    pub(crate) snapshot: Option<Snapshot>,
    pub(crate) json: bool,
    /// Arguments that name a host file no grant covers: the guest cannot see them (see [`ungranted_host_paths`]).
    pub(crate) ungranted: Vec<String>,
}

impl Prepared {
    /// The request for its job: in a fork of `--snapshot` when there is one (the fork keeps the snapshot's
    /// capabilities), otherwise with the capabilities the flags grant.
    pub(crate) fn request(&self) -> RunRequest<'_> {
        let request = RunRequest::new(&self.job).limits(self.limits.clone()).tier(self.tier);
        match &self.snapshot {
            Some(snapshot) => request.in_fork_of(snapshot),
            None => request.caps(&self.caps),
        }
    }
}

fn parse_tier(s: &str) -> Result<TierChoice, String> {
    s.parse().map_err(|e: strata_engine::EngineError| e.to_string())
}

/// What `--image` names.
#[derive(Debug, Clone)]
enum ImageChoice {
    /// The microVM's root filesystem.
    Vm(VmImage),
    /// A custom image of the store.
    Custom(strata_core::ImageName),
}

fn parse_image(s: &str) -> Result<ImageChoice, String> {
    match s.parse::<VmImage>() {
        Ok(vm) => Ok(ImageChoice::Vm(vm)),
        Err(_) => s.parse().map(ImageChoice::Custom).map_err(|e: strata_core::ImageNameError| e.to_string()),
    }
}

pub(crate) fn parse_duration_arg(s: &str) -> Result<Duration, String> {
    parse_duration(s).map_err(|e| e.to_string())
}

fn parse_size(s: &str) -> Result<ByteSize, String> {
    s.parse().map_err(|e: strata_core::UnitsError| e.to_string())
}

fn parse_fuel(s: &str) -> Result<Fuel, String> {
    s.parse().map_err(|e: strata_core::limits::FuelParseError| e.to_string())
}

fn parse_grant(s: &str) -> Result<Grant, String> {
    s.parse().map_err(|e: strata_core::CapsError| e.to_string())
}

/// An `--allow-net` spec, parsed here, once, as the egress proxy reads it (a malformed one is a usage error at once).
fn parse_net(s: &str) -> Result<Allowlist, String> {
    Allowlist::parse([s]).map_err(|e| e.to_string())
}

fn parse_env(s: &str) -> Result<EnvVar, String> {
    s.parse().map_err(|e: strata_core::CapsError| e.to_string())
}

/// `NAME=VALUE@HOST[,HOST...]`, `env:VAR` read from this process's environment (errors never show the value).
fn parse_egress_secret(s: &str) -> Result<strata_core::EgressSecret, Failure> {
    strata_core::EgressSecret::parse_spec(s, |var| std::env::var(var).ok())
        .map_err(|e| Failure::new("usage", format!("--egress-secret: {e}")))
}

/// The guest's stdin: this process's stdin when it is a pipe, a socket or a file, streamed into the job as it
/// arrives (the job starts at once, and its limits run while it waits for input; end of input is the writer
/// closing it); nothing when it is a terminal, as for a job that has no input.
fn stdin_stream() -> Result<Option<StdinStream>, Failure> {
    let stdin = std::io::stdin();
    if stdin.is_terminal() {
        return Ok(None);
    }
    match stdin.as_fd().try_clone_to_owned() {
        Ok(fd) => Ok(Some(StdinStream::new(fd))),
        // No descriptor 0 at all (EBADF): no input, as for a closed stdin.
        Err(err) if err.raw_os_error() == Some(9) => Ok(None),
        Err(err) => Err(Failure::new("input_unreadable", format!("cannot read stdin: {err}"))),
    }
}

/// This process's stdin, a terminal, as the stream of a job on a terminal (`--tty`): what is typed, as it is.
fn terminal_stream() -> Result<StdinStream, Failure> {
    let fd = std::io::stdin().as_fd().try_clone_to_owned();
    fd.map(StdinStream::new).map_err(|e| Failure::new("input_unreadable", format!("cannot read the terminal: {e}")))
}

/// The engine configuration of a `strata run` with this policy file and microVM image (none: the defaults).
pub(crate) fn engine_config(policy: Policy, image: Option<VmImage>) -> Result<EngineConfig, Failure> {
    Ok(EngineConfig { policy, max_wasm_instances: 4, vm_image: image.unwrap_or_default(), ..EngineConfig::from_env()? })
}

/// Prepares a run: its engine (`warm`, a warm daemon's engine of the default configuration, when the run has the
/// default configuration: no `--policy` and no `--image`), job, capabilities and limits.
pub(crate) fn prepare(args: RunArgs, warm: Option<Engine>) -> Result<Prepared, Failure> {
    let policy = match &args.policy {
        Some(path) => Policy::from_file(path).map_err(strata_engine::EngineError::from)?,
        None => Policy::default(),
    };
    let limits = limits_of(&args, &policy);
    if args.snapshot.is_some()
        && (!args.dirs.is_empty()
            || !args.grant_sets.is_empty()
            || !args.env.is_empty()
            || !args.secrets.is_empty()
            || !args.egress_secrets.is_empty()
            || !args.allow_net.is_empty())
    {
        return Err(Failure::new(
            "usage",
            "a fork keeps its snapshot's capabilities: give --dir, --grants, --env, --secret and --allow-net to \
             `strata snapshot create`",
        ));
    }
    let caps = caps_of(&args, &policy)?;
    let ungranted = if args.snapshot.is_none() { ungranted_host_paths(&args.args, &caps.grants) } else { Vec::new() };
    let vm_image = match args.image {
        Some(ImageChoice::Vm(vm)) => Some(vm),
        _ => None,
    };
    if vm_image.is_some() && matches!(args.tier, TierChoice::Tier(tier) if tier != strata_core::TierKind::Microvm) {
        return Err(Failure::new(
            "usage",
            format!(
                "--image initramfs|debian chooses the microVM's root filesystem; it does not apply to --tier {}",
                args.tier
            ),
        ));
    }
    let engine = match warm {
        Some(engine) if args.policy.is_none() && vm_image.is_none() => engine,
        _ => Engine::new(engine_config(policy, vm_image)?)?,
    };
    // Verified with the home's key before anything of it is used: its seal, then every file.
    let snapshot = match &args.snapshot {
        Some(dir) => Some(engine.open_snapshot(dir)?),
        None => None,
    };
    let job = match (args.code, args.module, args.file) {
        (Some(code), _, _) => Job::Python { source: PythonSource::Code(code), args: args.args },
        (None, Some(module), _) => Job::Python { source: PythonSource::Module(module), args: args.args },
        (None, None, Some(file)) if args.python => Job::Python { source: PythonSource::File(file), args: args.args },
        (None, None, Some(file)) => strata_engine::job_for_file(&file, args.args)?,
        (None, None, None) if args.python => {
            return Err(Failure::new("usage", "--python needs FILE, -c CODE or -m MODULE"));
        }
        (None, None, None) if !args.args.is_empty() => Job::Command { argv: args.args },
        (None, None, None) => {
            return Err(Failure::new("usage", "nothing to run: give FILE, -c CODE, -m MODULE or `-- COMMAND ARGS...`"));
        }
    };
    Ok(Prepared { engine, job, caps, limits, tier: args.tier, snapshot, json: args.json, ungranted })
}

/// The limits of a run: the policy's, with the command line's flags over them.
fn limits_of(args: &RunArgs, policy: &Policy) -> Limits {
    let flags = LimitsOverride {
        wall: args.timeout,
        cpu: args.cpu,
        fuel: args.fuel,
        memory: args.memory,
        output: args.output_limit,
        pids: args.pids,
        disk: args.disk,
        vcpus: args.vcpus,
        ..LimitsOverride::default()
    };
    flags.apply(&policy.limits)
}

/// The capabilities of a run: the policy's grants and network with the command line's.
fn caps_of(args: &RunArgs, policy: &Policy) -> Result<Capabilities, Failure> {
    let grants = policy.grants_with(&args.grant_sets, args.dirs.clone()).map_err(|err| {
        let policy = args.policy.as_ref().map_or("the default policy".to_owned(), |path| path.display().to_string());
        Failure::new("usage", format!("--grants: {policy}: {err}"))
    })?;
    Ok(Capabilities {
        grants,
        env: args.env.clone(),
        secrets: args.secrets.clone(),
        egress_secrets: args.egress_secrets.iter().map(|s| parse_egress_secret(s)).collect::<Result<_, _>>()?,
        net: policy.network.net_with(&args.allow_net.iter().fold(Allowlist::default(), |all, one| all.union(one))),
        tools: Vec::new(),
        user: args.user.clone(),
        image: match &args.image {
            Some(ImageChoice::Custom(name)) => Some(name.clone()),
            _ => None,
        },
    })
}

/// Whether the command line `argv` (`strata run …`) looks like a Linux command, which a warm daemon's spare child
/// (holding the jail [`prestart`] builds) should run: not Python, not a wasm module, not a fork of a snapshot, on
/// the process tier or the router's choice. A guess only ever costs time: a spare's jail that a job does not take
/// is closed beside the job, and a job that needs a jail and finds none builds its own.
pub(crate) fn suits_spare(argv: &[String]) -> bool {
    let Ok(cli) = <crate::Cli as clap::Parser>::try_parse_from(argv) else { return false };
    let crate::Command::Run(command) = cli.command else { return false };
    let run = &command.run;
    let script = run.file.as_ref().is_some_and(|file| {
        file.extension().is_some_and(|ext| ["wasm", "wat", "py"].iter().any(|known| ext.eq_ignore_ascii_case(known)))
    });
    !run.python
        && run.code.is_none()
        && run.module.is_none()
        && run.snapshot.is_none()
        && !script
        && matches!(run.tier, TierChoice::Auto | TierChoice::Tier(TierKind::Process))
}

/// Whether a command line is Python a warm daemon's Python spare ([`python_resident`]) serves: one-shot Python
/// (`--python`, `-c`, `-m`, a `.py` file) that may run on the wasm tier, not from a snapshot, without a fuel budget
/// (fuel runs other compiled code), a policy file or an image (either may send it elsewhere), an environment of
/// its own (which the primed interpreter does not have), or inputs to reproduce.
pub(crate) fn suits_python(argv: &[String]) -> bool {
    let Ok(cli) = <crate::Cli as clap::Parser>::try_parse_from(argv) else { return false };
    let crate::Command::Run(command) = cli.command else { return false };
    let run = &command.run;
    let script =
        run.file.as_ref().is_some_and(|file| file.extension().is_some_and(|ext| ext.eq_ignore_ascii_case("py")));
    (run.python || run.code.is_some() || run.module.is_some() || script)
        && run.snapshot.is_none()
        && run.policy.is_none()
        && run.image.is_none()
        && run.fuel.is_none()
        && run.env.is_empty()
        && run.secrets.is_empty()
        && command.repro.seed.is_none()
        && command.repro.record.is_none()
        && matches!(run.tier, TierChoice::Auto | TierChoice::Tier(TierKind::Wasm))
}

/// What a warm daemon does once, before it serves: a Python instance made for a one-shot job of the default
/// configuration, which every child it forks inherits a copy of (`WasmTier::prestart_python`). A failure leaves
/// jobs to make their own, as without it.
pub(crate) fn prestart_python(engine: &Engine) {
    if let Err(err) = engine.wasm().prestart_python(engine.default_limits()) {
        log::warn!("no Python instance prepared ahead: {err}");
    }
}

/// What a warm daemon's Python spare child prepares before its command arrives: its copy of the daemon's Python
/// instance made resident and its own ([`suits_python`]).
pub(crate) fn python_resident(engine: &Engine) {
    engine.wasm().make_primed_python_resident();
}

/// What a warm daemon's spare child prepares before its command arrives: the jail a command of the default
/// configuration (`strata run -- COMMAND`, `--tier process`: no flag that changes the jail) runs in. A command
/// whose jail would differ builds its own, so this only ever saves time. Failures are left for the command to
/// meet (and report) itself.
pub(crate) fn prestart(engine: &Engine) {
    let Ok(cli) = <crate::Cli as clap::Parser>::try_parse_from(["strata", "run", "--", "true"]) else { return };
    let crate::Command::Run(command) = cli.command else { return };
    let policy = Policy::default();
    let limits = limits_of(&command.run, &policy);
    let Ok(caps) = caps_of(&command.run, &policy) else { return };
    // Starting the tier builds a missing Debian image (minutes, with the network): never behind a user's back.
    if !engine.images().debian().is_ok_and(|image| image.is_installed()) {
        return;
    }
    match engine.process() {
        Ok(tier) => {
            if let Err(err) = tier.prestart(&caps, &limits) {
                log::debug!("no jail prepared ahead: {err}");
            }
        }
        Err(err) => log::debug!("no jail prepared ahead: {err}"),
    }
}

pub(crate) fn run(command: RunCommand, warm: Option<Engine>) -> Result<i32, Failure> {
    let RunCommand { run: args, repro } = command;
    let reproducible = repro.seed.is_some() || repro.record.is_some();
    let flag = if repro.record.is_some() { "--record" } else { "--seed" };
    if reproducible && args.snapshot.is_some() {
        return Err(Failure::new(
            "usage",
            format!(
                "{flag} runs a one-shot wasm job; a fork of --snapshot is a live session, which is not reproducible"
            ),
        ));
    }
    let tty = args.tty;
    if tty && reproducible {
        return Err(Failure::new("usage", format!("{flag} runs a wasm job, which has no terminal (--tty)")));
    }
    let mut prepared = prepare(args, warm)?;
    if reproducible {
        // Only the wasm tier makes a job reproducible: force it, and never let the job run elsewhere unseeded.
        prepared.tier = match prepared.tier {
            TierChoice::Auto | TierChoice::Tier(TierKind::Wasm) => TierChoice::Tier(TierKind::Wasm),
            other => {
                return Err(Failure::new(
                    "usage",
                    format!("{flag} needs the wasm tier (only wasm jobs are reproducible), not --tier {other}"),
                ));
            }
        };
    }
    let recorder = repro.record.as_ref().map(|_| Arc::new(Recorder::new(repro.seed)));
    let determinism = match (&recorder, repro.seed) {
        (Some(recorder), _) => Some(Determinism::Record(recorder.clone())),
        (None, Some(seed)) => Some(Determinism::Seed(seed)),
        (None, None) => None,
    };
    let (stdin, raw, terminal) = match (tty, &recorder) {
        (true, _) => {
            let (raw, terminal) = crate::tty::RawTerminal::enter()?;
            (StdinInput::Terminal, Some(raw), Some(terminal))
        }
        (false, Some(_)) => (StdinInput::Whole, None, None),
        (false, None) => (StdinInput::Stream, None, None),
    };
    let Prepared { engine, limits, json, ungranted, .. } = &prepared;
    let request = prepared.request().options(ExecOptions { determinism, terminal, ..ExecOptions::default() });
    let outcome = execute_with(*json, limits, request, (stdin, raw), |request| engine.execute(request))?;
    if let (Some(recorder), Some(path)) = (&recorder, &repro.record) {
        let recording = recorder.finish(&outcome).map_err(|e| Failure::new(e.code(), e.to_string()))?;
        recording.write(path).map_err(|e| Failure::new(e.code(), e.to_string()))?;
        if !*json {
            crate::progress::plain(&format!("strata: recorded to {} (`strata replay` re-runs it)", path.display()));
        }
    }
    if *json {
        print_json(&outcome)?;
    } else if outcome.exit_code() != 0
        && let Some(hint) = ungranted_hint(ungranted)
    {
        crate::progress::plain(&hint);
    }
    let code = outcome.exit_code();
    // This process exits next: let the exit release the compiled code rather than unmapping it piece by piece.
    prepared.engine.close_for_exit();
    Ok(code)
}

/// The job's arguments that are relative paths of files or directories on the host which no grant covers.
/// The guest sees only its grants (its working directory is `/`), so `strata run analysis.py -- input.csv` cannot
/// open `input.csv`; when such a job fails, [`ungranted_hint`] says how to grant it. Absolute paths are left out:
/// `/etc/hosts` names a file of the guest's own image as often as one of the host's.
fn ungranted_host_paths(args: &[String], grants: &[strata_core::Grant]) -> Vec<String> {
    let granted: Vec<PathBuf> = grants.iter().filter_map(|g| std::fs::canonicalize(&g.host).ok()).collect();
    args.iter()
        .filter(|arg| !arg.is_empty() && !arg.starts_with('-') && !Path::new(arg).is_absolute())
        .filter(|arg| std::fs::canonicalize(arg).is_ok_and(|host| !granted.iter().any(|dir| host.starts_with(dir))))
        .cloned()
        .collect()
}

/// One line naming the ungranted host paths and the `--dir` that would show them to the guest.
fn ungranted_hint(ungranted: &[String]) -> Option<String> {
    let first = ungranted.first()?;
    let names = ungranted.iter().map(|p| format!("`{p}`")).collect::<Vec<_>>().join(", ");
    let guest = Path::new("/work").join(first.trim_start_matches("./"));
    Some(format!(
        "strata: hint: {names} {} on the host, but the sandbox sees only the directories granted to it (its working \
         directory is /): grant the current directory, e.g. `--dir .:/work`, and pass `{}`",
        if ungranted.len() == 1 { "is a path" } else { "are paths" },
        guest.display()
    ))
}

/// Runs `request` through `job` with this process's stdin streamed in and its output streamed to this process's
/// stdout and stderr (or, with `json`, only captured), then reports what the output cannot say on stderr.
pub(crate) fn execute<'a, T: AsOutcome>(
    json: bool,
    limits: &Limits,
    request: RunRequest<'a>,
    job: impl FnOnce(RunRequest<'a>) -> Result<T, strata_engine::EngineError>,
) -> Result<T, Failure> {
    execute_with(json, limits, request, (StdinInput::Stream, None), job)
}

/// How a job gets this process's stdin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StdinInput {
    /// Streamed in as it arrives.
    Stream,
    /// Read to its end before the job starts (a recorded job's stdin is part of its recording).
    Whole,
    /// This process's terminal, in raw mode, streamed in as typed (`--tty`).
    Terminal,
}

/// [`execute`], with stdin given as `stdin` says.
fn execute_with<'a, T: AsOutcome>(
    json: bool,
    limits: &Limits,
    request: RunRequest<'a>,
    (stdin, raw): (StdinInput, Option<crate::tty::RawTerminal>),
    job: impl FnOnce(RunRequest<'a>) -> Result<T, strata_engine::EngineError>,
) -> Result<T, Failure> {
    let console = Console::start()?;
    let stream = match stdin {
        StdinInput::Terminal => Some(terminal_stream()?),
        _ => stdin_stream()?,
    };
    let request = match (stream, stdin) {
        (Some(stream), StdinInput::Stream | StdinInput::Terminal) => request.stdin_stream(stream),
        (Some(stream), StdinInput::Whole) => {
            let bytes = stream
                .read_to_end(strata_core::MAX_BUFFERED_STDIN)
                .map_err(|e| Failure::new(e.code(), e.to_string()))?;
            request.stdin(bytes)
        }
        (None, _) => request,
    };
    let request = request.cancel(console.token());
    if json {
        let result = job(request);
        console.finish(|| drop(raw));
        return Ok(result?);
    }
    let result = job(request.on_output(console.sink()));
    // The console writes what output is still queued and ends; then the terminal as it was, before anything else
    // is printed.
    console.finish(|| drop(raw));
    let result = result?;
    report(result.outcome(), limits);
    Ok(result)
}

/// What [`execute`] reports on.
pub(crate) trait AsOutcome {
    fn outcome(&self) -> &Outcome;
}

impl AsOutcome for Outcome {
    fn outcome(&self) -> &Outcome {
        self
    }
}

pub(crate) fn print_json(value: &impl serde::Serialize) -> Result<(), Failure> {
    let text = serde_json::to_string(value)
        .map_err(|e| Failure::new("internal", format!("cannot encode the outcome: {e}")))?;
    let _ = writeln!(std::io::stdout(), "{text}");
    Ok(())
}

/// One line on stderr for what the guest's own output cannot say: a re-run on a native tier, a limit, a trap, a
/// truncation.
fn report(outcome: &Outcome, limits: &Limits) {
    let mut err = std::io::stderr();
    for escalation in outcome.escalations.iter().filter(|e| e.from == strata_core::TierKind::Wasm) {
        let _ = writeln!(err, "strata: re-ran on the {} tier: {}", escalation.to, escalation.reason);
    }
    match &outcome.status {
        Status::Exited { .. } => {}
        Status::LimitExceeded { limit } => {
            let value = match limit {
                strata_core::LimitKind::Wall => format_duration(limits.wall),
                strata_core::LimitKind::Cpu => format_duration(limits.cpu),
                strata_core::LimitKind::Fuel => limits.fuel.to_string(),
                strata_core::LimitKind::Memory => limits.memory.to_string(),
                strata_core::LimitKind::Pids => limits.pids.to_string(),
                strata_core::LimitKind::Disk => limits.disk.to_string(),
                strata_core::LimitKind::Files => limits.files.to_string(),
                _ => String::new(),
            };
            let _ = writeln!(err, "strata: {limit} limit exceeded ({value})");
        }
        Status::Trapped { message } => {
            let _ = writeln!(err, "strata: trapped: {message}");
        }
        Status::Crashed { message } => {
            let _ = writeln!(err, "strata: crashed: {message}");
        }
    }
    for (name, cut, written) in [
        ("stdout", outcome.truncated.stdout, outcome.usage.stdout_bytes),
        ("stderr", outcome.truncated.stderr, outcome.usage.stderr_bytes),
    ] {
        if cut {
            let _ = writeln!(err, "strata: {name} truncated at {} ({written} bytes written)", limits.output);
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Args;
    use strata_core::Limits;
    use strata_core::units::format_duration;

    /// Linux commands go to a daemon's spare child (its jail would serve them); Python, wasm modules and forks
    /// go to a child forked for them.
    #[test]
    fn only_linux_commands_suit_a_spare() {
        let suits = |line: &str| super::suits_spare(&line.split(' ').map(str::to_owned).collect::<Vec<_>>());
        assert!(suits("strata run -- true"));
        assert!(suits("strata run --tier process -- sh -c x"));
        assert!(suits("strata run --memory 64MiB ./tool -- a"));
        assert!(!suits("strata run --python -c print(1)"));
        assert!(!suits("strata run hello.wasm -- world"));
        assert!(!suits("strata run analysis.PY"));
        assert!(!suits("strata run --tier wasm -- true"));
        assert!(!suits("strata run --snapshot dir -- true"));
        assert!(!suits("strata images list"));
        assert!(!suits("strata run --no-such-flag"));
    }

    /// The defaults `strata run --help` prints are the default policy's, so the help cannot drift from it.
    #[test]
    fn help_defaults_are_the_default_policy() {
        let command = super::RunArgs::augment_args(clap::Command::new("run"));
        let help = |id: &str| {
            let arg = command.get_arguments().find(|a| a.get_id() == id).unwrap_or_else(|| panic!("no --{id}"));
            arg.get_help().map(ToString::to_string).unwrap_or_default()
        };
        let limits = Limits::default();
        let expected = [
            ("timeout", format_duration(limits.wall)),
            ("cpu", format_duration(limits.cpu)),
            ("fuel", limits.fuel.to_string()),
            ("memory", limits.memory.to_string()),
            ("output_limit", limits.output.to_string()),
            ("vcpus", limits.vcpus.to_string()),
            ("pids", limits.pids.to_string()),
            ("disk", limits.disk.to_string()),
        ];
        for (id, default) in expected {
            let text = help(id);
            assert!(text.contains(&format!("[default: {default}]")), "--{id}: {text:?} should name {default}");
        }
    }
}
