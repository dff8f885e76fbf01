//! A warm start for one-shot commands: `strata daemon` keeps an [`Engine`] with the Python runtime loaded
//! (the compiled code's metadata deserialised, the router's module list read) in one single-threaded process,
//! and each `strata run` that finds it hands over its command line, working directory and standard streams; the
//! daemon forks a child that runs that command exactly as the `strata` process would have, from the warm
//! state, and reports how it ended. A zygote, as the process tier's numpy zygote and Android's are. With
//! [`Daemon::with_spares`] the children are forked ahead of their commands and prepare, while they wait, what a
//! command of the default configuration does first (the CLI: a jail for a Linux command; for one-shot Python, the
//! pages of the interpreter the daemon primed, `WasmTier::prestart_python`, made the child's own). A child tells
//! the client how its job ended as soon as the job is over (its descriptors given back, its output flushed),
//! before its own exit unmaps its memory; the daemon reaps it.
//!
//! What the child runs is the command-line tool's own code with the client's arguments, in the client's working
//! directory and umask, writing to and reading from the client's own descriptors (passed with `SCM_RIGHTS`):
//! nothing of the job goes through the daemon. Each child is a fresh copy of the same untouched warm state, so
//! no job sees another's. The client only uses the daemon when nothing it would do differently applies: the same
//! `strata` binary (device, inode, size and modification time of the executable), the same environment (but for
//! the shell's `PWD`, `OLDPWD`, `SHLVL` and `_`), arguments and environment that are UTF-8; otherwise the daemon
//! refuses and the client runs the command itself, as it does when no daemon answers.
//!
//! The socket is `SOCK_SEQPACKET` in a directory only the owner can enter, and the daemon also checks the peer's
//! UID. A client that goes away (killed, its connection closed) has its job killed; `SIGINT`, `SIGTERM`,
//! `SIGHUP` and `SIGQUIT` the client receives are passed to the job, and a job a signal ended ends its client with
//! the same signal. The daemon exits after an idle period, on `strata daemon stop`, and when its socket file is
//! removed or replaced.

use std::collections::HashMap;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::socket::{
    AddressFamily, Backlog, SockFlag, SockType, UnixAddr, bind, connect, getsockopt, listen, setsockopt, socket,
    sockopt,
};
use nix::sys::stat::Mode;
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};
use strata_jail::proto::{self, ProtoError};
use strata_jail::sys::{ForkError, accept_cloexec, fork_single_threaded, pidfd_open, signal_pidfd};

use crate::Engine;

/// The protocol's version: a client and daemon of different versions never talk (the binary's identity, which
/// both check, changes with it anyway).
pub const PROTOCOL: u32 = 1;

/// How long the daemon waits for a client's request once it connected; a client that connects and says nothing
/// cannot hold the daemon longer.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a client waits for its job to start before it runs the command itself.
const STARTED_TIMEOUT: Duration = Duration::from_secs(5);

/// The most jobs one daemon runs at once; a client beyond that is refused and runs its command itself.
pub const MAX_RUNNING: usize = 64;

/// Environment variables a shell changes between commands without meaning anything to Strata.
pub const SHELL_NOISE: [&str; 4] = ["PWD", "OLDPWD", "SHLVL", "_"];

/// What went wrong with the daemon or talking to it.
#[derive(Debug, thiserror::Error)]
pub enum WarmError {
    /// A file or socket operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        source: std::io::Error,
    },
    /// The other side sent something that is not this protocol.
    #[error("the warm daemon's socket: {0}")]
    Protocol(String),
    /// The daemon could not fork a job.
    #[error(transparent)]
    Fork(#[from] ForkError),
    /// No daemon answers on the socket.
    #[error("no warm daemon answers on {0}")]
    NotRunning(PathBuf),
}

impl WarmError {
    fn io(what: impl Into<String>, source: impl Into<std::io::Error>) -> WarmError {
        WarmError::Io { what: what.into(), source: source.into() }
    }
}

impl From<ProtoError> for WarmError {
    fn from(err: ProtoError) -> WarmError {
        WarmError::Protocol(err.to_string())
    }
}

/// A client's message to the daemon.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Run a command line; the message carries the client's stdin, stdout and stderr, in that order.
    Run(RunRequest),
    /// Pass a signal to the running job (only on the connection of a `Run`).
    Signal {
        /// The signal's number.
        signal: i32,
    },
    /// Say how the daemon is.
    Status,
    /// Stop taking jobs and exit when the running ones have ended.
    Stop,
}

/// A command line to run, as the client would have run it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunRequest {
    /// [`PROTOCOL`].
    pub protocol: u32,
    /// The client's binary ([`exe_identity`]).
    pub identity: String,
    /// The command line, the program name first.
    pub argv: Vec<String>,
    /// The client's working directory.
    pub cwd: PathBuf,
    /// The client's environment.
    pub env: Vec<(String, String)>,
    /// The client's umask.
    pub umask: u32,
}

/// The daemon's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Reply {
    /// The daemon will not run this; the client runs the command itself.
    Refused {
        /// Why.
        reason: String,
    },
    /// The job's process started.
    Started {
        /// Its PID.
        pid: i32,
    },
    /// The job's process exited with this code.
    Exited {
        /// The code.
        code: i32,
    },
    /// A signal ended the job's process.
    Signaled {
        /// The signal's number.
        signal: i32,
    },
    /// The daemon's state.
    Status(DaemonStatus),
    /// The daemon stops taking jobs.
    Stopping,
}

/// What `strata daemon status` shows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DaemonStatus {
    /// The daemon's PID.
    pub pid: i32,
    /// Its binary ([`exe_identity`]).
    pub identity: String,
    /// Seconds since it started.
    pub uptime_s: u64,
    /// Jobs it started.
    pub served: u64,
    /// Jobs running now.
    pub running: usize,
    /// Clients it refused (another binary or environment, too many jobs).
    pub refused: u64,
    /// Why it refused the last one it refused.
    pub last_refusal: Option<String>,
    /// It exits after this many seconds without a job.
    pub idle_exit_s: u64,
    /// Spare children waiting, prepared, for the next commands ([`Daemon::with_spares`]).
    #[serde(default)]
    pub spares: usize,
}

/// The identity of the running `strata` binary: its path's device, inode, size and modification time, and the
/// crate's version. Two processes of the same file have the same identity; a rebuilt binary has another.
pub fn exe_identity() -> Result<String, WarmError> {
    let exe = std::env::current_exe().map_err(|e| WarmError::io("cannot find this program's file", e))?;
    let meta = std::fs::metadata(&exe).map_err(|e| WarmError::io(format!("{}", exe.display()), e))?;
    Ok(format!(
        "{}:{}:{}:{}.{}:{}",
        meta.dev(),
        meta.ino(),
        meta.size(),
        meta.mtime(),
        meta.mtime_nsec(),
        env!("CARGO_PKG_VERSION")
    ))
}

/// The socket a daemon for `home` listens on: `$STRATA_DAEMON` when it is a path, else `run/warm.sock` under
/// `home`. `None` when `$STRATA_DAEMON` is `off` (or `0`), or there is no home.
pub fn socket_path(home: Option<&Path>) -> Option<PathBuf> {
    match std::env::var_os("STRATA_DAEMON") {
        Some(value) if value == "off" || value == "0" => None,
        Some(value) if !value.is_empty() => Some(PathBuf::from(value)),
        _ => home.map(|home| home.join("run/warm.sock")),
    }
}

/// This process's environment as the daemon compares it: sorted, without [`SHELL_NOISE`]; `None` when a name or
/// value is not UTF-8.
pub fn comparable_env(
    env: impl Iterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
) -> Option<Vec<(String, String)>> {
    let mut out = Vec::new();
    for (name, value) in env {
        let (name, value) = (name.into_string().ok()?, value.into_string().ok()?);
        if !SHELL_NOISE.contains(&name.as_str()) {
            out.push((name, value));
        }
    }
    out.sort();
    Some(out)
}

/// Bounds how long a receive on `fd` blocks (`Duration::ZERO`: forever).
fn receive_timeout(fd: &OwnedFd, timeout: Duration) {
    let value = nix::sys::time::TimeVal::new(
        i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX),
        i64::from(timeout.subsec_micros()),
    );
    let _ = setsockopt(fd, sockopt::ReceiveTimeout, &value);
}

/// What confines process `pid` (`"self"` for this one), as `/proc` shows it: its namespaces, cgroups, resource
/// limits, capability sets, `no_new_privs` and seccomp mode. A daemon runs a command only for a client confined
/// exactly as it is, so that no client gets a command run with less confinement than its own (one in another
/// mount namespace, under a tighter `ulimit`, in a seccomp sandbox or another cgroup would otherwise escape it).
pub fn confinement(pid: &str) -> Result<Vec<(String, String)>, std::io::Error> {
    let proc = PathBuf::from("/proc").join(pid);
    let mut out = Vec::new();
    for ns in ["mnt", "pid", "net", "ipc", "uts", "user", "cgroup"] {
        let target = std::fs::read_link(proc.join("ns").join(ns))?;
        out.push((format!("{ns} namespace"), target.display().to_string()));
    }
    out.push(("cgroup".into(), std::fs::read_to_string(proc.join("cgroup"))?));
    out.push(("resource limits".into(), std::fs::read_to_string(proc.join("limits"))?));
    let status = std::fs::read_to_string(proc.join("status"))?;
    for field in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp", "Seccomp_filters"] {
        let value = status
            .lines()
            .find_map(|line| line.strip_prefix(field).and_then(|rest| rest.strip_prefix(':')))
            .map(str::trim)
            .unwrap_or("");
        out.push((field.into(), value.into()));
    }
    Ok(out)
}

/// The first way `theirs` is confined otherwise than `ours`, if any.
fn confined_otherwise(ours: &[(String, String)], theirs: &[(String, String)]) -> Option<String> {
    ours.iter().zip(theirs).find(|(a, b)| a != b).map(|((name, _), _)| name.clone())
}

fn seqpacket() -> Result<OwnedFd, WarmError> {
    socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None)
        .map_err(|e| WarmError::io("cannot make a socket", e))
}

/// Connects to the daemon at `path`.
fn connect_to(path: &Path) -> Result<OwnedFd, WarmError> {
    let fd = seqpacket()?;
    let addr = UnixAddr::new(path).map_err(|e| WarmError::io(format!("{}", path.display()), e))?;
    connect(fd.as_raw_fd(), &addr).map_err(|_| WarmError::NotRunning(path.to_owned()))?;
    Ok(fd)
}

fn recv_reply(fd: BorrowedFd<'_>) -> Result<Option<Reply>, WarmError> {
    Ok(proto::recv::<Reply>(fd)?.map(|(reply, _)| reply))
}

/// Asks the daemon at `path` for its status.
pub fn status(path: &Path) -> Result<DaemonStatus, WarmError> {
    let fd = connect_to(path)?;
    proto::send(fd.as_fd(), &Request::Status, &[])?;
    match recv_reply(fd.as_fd())? {
        Some(Reply::Status(status)) => Ok(status),
        other => Err(WarmError::Protocol(format!("expected its status, got {other:?}"))),
    }
}

/// Asks the daemon at `path` to stop; it exits once its running jobs have ended.
pub fn stop(path: &Path) -> Result<(), WarmError> {
    let fd = connect_to(path)?;
    proto::send(fd.as_fd(), &Request::Stop, &[])?;
    match recv_reply(fd.as_fd())? {
        Some(Reply::Stopping) => Ok(()),
        other => Err(WarmError::Protocol(format!("expected it to stop, got {other:?}"))),
    }
}

/// How a command the daemon ran ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// It exited with this code.
    Exited(i32),
    /// This signal ended it.
    Signaled(i32),
}

/// Runs `argv` through the daemon at `path`, with this process's working directory, umask, environment and
/// standard streams; returns `None` when there is no daemon or it refused (the caller runs the command itself).
/// While the job runs, `SIGINT`, `SIGTERM`, `SIGHUP` and `SIGQUIT` sent to this process go to the job.
pub fn run_through(path: &Path, argv: &[std::ffi::OsString]) -> Option<Result<Ended, WarmError>> {
    let argv: Vec<String> = argv.iter().map(|a| a.clone().into_string().ok()).collect::<Option<_>>()?;
    let env = comparable_env(std::env::vars_os())?;
    let cwd = std::env::current_dir().ok()?;
    let identity = exe_identity().ok()?;
    let fd = connect_to(path).ok()?;
    // The umask can only be read by setting it: set it back at once (this process has one thread here).
    let umask = nix::sys::stat::umask(Mode::from_bits_truncate(0o022));
    nix::sys::stat::umask(umask);
    let request = Request::Run(RunRequest { protocol: PROTOCOL, identity, argv, cwd, env, umask: umask.bits() });
    let (stdin, stdout, stderr) = (std::io::stdin(), std::io::stdout(), std::io::stderr());
    let stdio = [stdin.as_fd(), stdout.as_fd(), stderr.as_fd()];
    proto::send(fd.as_fd(), &request, &stdio).ok()?;
    // A daemon that accepted but does not answer (stopped, or gone with a job's copy of its socket still open)
    // is as good as none.
    receive_timeout(&fd, STARTED_TIMEOUT);
    let started = recv_reply(fd.as_fd());
    receive_timeout(&fd, Duration::ZERO);
    match started {
        Ok(Some(Reply::Started { .. })) => {}
        Ok(Some(Reply::Refused { reason })) => {
            log::debug!("the warm daemon refused: {reason}");
            return None;
        }
        // No answer in time, or none at all: the job did not start, so the client may run it itself.
        Ok(None) | Err(_) => return None,
        Ok(other) => return Some(Err(WarmError::Protocol(format!("expected the job to start, got {other:?}")))),
    }
    Some(wait_for_job(fd))
}

/// Passes the client's signals to the job until it ends, and returns how it ended. One thread waits for both,
/// the reply on the socket and the signals (blocked, read from a signalfd): a second thread would be one more to
/// wake, often on the other CPU, before this process could end.
fn wait_for_job(fd: OwnedFd) -> Result<Ended, WarmError> {
    let mut signals = SigSet::empty();
    for signal in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP, Signal::SIGQUIT] {
        signals.add(signal);
    }
    signals.thread_block().map_err(|e| WarmError::io("cannot block signals", e))?;
    let signal_fd = SignalFd::with_flags(&signals, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
        .map_err(|e| WarmError::io("cannot read signals", e))?;
    loop {
        let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN), PollFd::new(signal_fd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) | Err(Errno::EINTR) => {}
            Err(err) => return Err(WarmError::io("poll", err)),
        }
        let ready = |fd: &PollFd<'_>| fd.revents().is_some_and(|r| !r.is_empty());
        if ready(&fds[1]) {
            while let Ok(Some(info)) = signal_fd.read_signal() {
                let signal = i32::try_from(info.ssi_signo).unwrap_or(0);
                let _ = proto::send(fd.as_fd(), &Request::Signal { signal }, &[]);
            }
        }
        if ready(&fds[0]) {
            return match recv_reply(fd.as_fd())? {
                Some(Reply::Exited { code }) => Ok(Ended::Exited(code)),
                Some(Reply::Signaled { signal }) => Ok(Ended::Signaled(signal)),
                None => Err(WarmError::Protocol("the daemon ended before the job did".into())),
                Some(other) => Err(WarmError::Protocol(format!("expected how the job ended, got {other:?}"))),
            };
        }
    }
}

/// Ends this process as a signal ended the job: with the same signal when its default action ends a process,
/// else with 128 + its number, as a shell reports it.
pub fn end_like(signal: i32) -> i32 {
    if let Ok(signal) = Signal::try_from(signal) {
        let mut set = SigSet::empty();
        set.add(signal);
        let _ = set.thread_unblock();
        let _ = nix::sys::signal::raise(signal);
    }
    128 + signal
}

/// Why a daemon of binary `identity` and environment `env` (as [`comparable_env`] lists it), running `running`
/// jobs, will not run `run`, which came with `fds` descriptors; `Ok` when it will. The client then runs the
/// command itself.
pub fn check_request(
    run: &RunRequest,
    fds: usize,
    running: usize,
    identity: &str,
    env: &[(String, String)],
) -> Result<(), String> {
    if run.protocol != PROTOCOL {
        return Err(format!("protocol {} (this daemon speaks {PROTOCOL})", run.protocol));
    }
    if run.identity != identity {
        return Err("another strata binary".into());
    }
    if fds != 3 {
        return Err(format!("{fds} descriptors (stdin, stdout and stderr expected)"));
    }
    if running >= MAX_RUNNING {
        return Err(format!("{running} jobs running"));
    }
    if run.argv.get(1).map(String::as_str) != Some("run") {
        return Err("not a `strata run` command line".into());
    }
    if !run.cwd.is_absolute() {
        return Err("a relative working directory".into());
    }
    let mut theirs = run.env.clone();
    theirs.retain(|(name, _)| !SHELL_NOISE.contains(&name.as_str()));
    theirs.sort();
    if theirs != env {
        let ours: HashMap<&str, &str> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let theirs: HashMap<&str, &str> = theirs.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let mut names: Vec<&str> =
            ours.keys().chain(theirs.keys()).filter(|k| ours.get(*k) != theirs.get(*k)).copied().collect();
        names.sort_unstable();
        names.dedup();
        return Err(format!("another environment (differs in {})", names.join(", ")));
    }
    Ok(())
}

/// What the forked child runs: the command line, with the warm engine.
pub type Handler = fn(Vec<String>, Engine) -> i32;

/// What a spare child does with its copy of the warm engine before its command arrives ([`Daemon::with_spares`]).
pub type Prepare = fn(&Engine);

/// Whether a command line should go to a spare child (what it prepared would serve it) rather than to a child
/// forked for it ([`Daemon::with_spares`]).
pub type Suits = fn(&[String]) -> bool;

/// One kind of spare child ([`Daemon::with_spares`]): how many to keep, what each prepares, and which command lines
/// what it prepared serves.
#[derive(Debug, Clone, Copy)]
pub struct SparePlan {
    /// How many to keep forked and prepared.
    pub count: usize,
    /// What each does with its copy of the engine while it waits.
    pub prepare: Prepare,
    /// The command lines it takes.
    pub suits: Suits,
}

/// Spare children that died before a command reached them, in a row, after which the daemon makes no more
/// spares (and forks a child per command, as without them).
const SPARE_FAILURES: u32 = 3;

/// How long the daemon, exiting, waits for a spare child to close what it prepared before killing it.
const SPARE_EXIT_TIMEOUT: Duration = Duration::from_secs(5);

/// A child forked ahead of its command, prepared, waiting on `channel` for it.
struct Spare {
    pid: i32,
    pidfd: OwnedFd,
    channel: OwnedFd,
    /// Its kind: an index into the daemon's plans.
    plan: usize,
}

/// A job the daemon runs.
struct Job {
    connection: OwnedFd,
    pid: i32,
    pidfd: OwnedFd,
}

/// The warm daemon: a listening socket and an engine warmed for the command line's default configuration.
pub struct Daemon {
    /// `None` only in a job's child, which closes it.
    listener: Option<OwnedFd>,
    path: PathBuf,
    /// The socket file's inode: the daemon exits when the file is removed or replaced.
    inode: u64,
    identity: String,
    env: Vec<(String, String)>,
    /// This process's [`confinement`].
    confinement: Vec<(String, String)>,
    engine: Option<Engine>,
    handler: Handler,
    /// The kinds of spare children to keep.
    plans: Vec<SparePlan>,
    spares: Vec<Spare>,
    /// Spares that died before their command, in a row.
    spare_failures: u32,
    idle: Duration,
    started: Instant,
    served: u64,
    refused: u64,
    last_refusal: Option<String>,
}

impl std::fmt::Debug for Daemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Daemon").field("path", &self.path).field("identity", &self.identity).finish_non_exhaustive()
    }
}

impl Daemon {
    /// Binds `path` (its directory made private to this user; a stale socket no daemon answers on replaced) for
    /// `engine`, which the caller has warmed ([`Engine::warm`]). `handler` runs each command line in its child.
    pub fn bind(path: &Path, engine: Engine, handler: Handler, idle: Duration) -> Result<Daemon, WarmError> {
        let dir = path.parent().ok_or_else(|| WarmError::Protocol(format!("{} has no directory", path.display())))?;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| WarmError::io(format!("cannot create {}", dir.display()), e))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| WarmError::io(format!("cannot make {} private", dir.display()), e))?;
        if path.exists() {
            if connect_to(path).is_ok() {
                return Err(WarmError::io(
                    format!("a warm daemon already answers on {}", path.display()),
                    std::io::Error::from(std::io::ErrorKind::AddrInUse),
                ));
            }
            std::fs::remove_file(path).map_err(|e| WarmError::io(format!("cannot remove {}", path.display()), e))?;
        }
        // Forking needs a single-threaded process: say so now, not at the first client.
        let threads = std::fs::read_dir("/proc/self/task").map_err(|e| WarmError::io("/proc/self/task", e))?.count();
        if threads != 1 {
            return Err(WarmError::Fork(ForkError::Threaded(threads)));
        }
        let listener = seqpacket()?;
        let addr = UnixAddr::new(path).map_err(|e| WarmError::io(format!("{}", path.display()), e))?;
        bind(listener.as_raw_fd(), &addr).map_err(|e| WarmError::io(format!("cannot bind {}", path.display()), e))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| WarmError::io(format!("cannot make {} private", path.display()), e))?;
        listen(&listener, Backlog::new(64).unwrap_or(Backlog::MAXCONN))
            .map_err(|e| WarmError::io(format!("cannot listen on {}", path.display()), e))?;
        let inode = std::fs::metadata(path).map_err(|e| WarmError::io(format!("{}", path.display()), e))?.ino();
        let env = comparable_env(std::env::vars_os())
            .ok_or_else(|| WarmError::Protocol("this process's environment is not UTF-8".into()))?;
        Ok(Daemon {
            listener: Some(listener),
            path: path.to_owned(),
            inode,
            identity: exe_identity()?,
            env,
            confinement: confinement("self").map_err(|e| WarmError::io("/proc/self", e))?,
            engine: Some(engine),
            handler,
            plans: Vec::new(),
            spares: Vec::new(),
            spare_failures: 0,
            idle,
            started: Instant::now(),
            served: 0,
            refused: 0,
            last_refusal: None,
        })
    }

    /// Keeps children forked ahead of their commands, `count` of each plan, each of which runs its plan's
    /// `prepare` on its copy of the engine and then waits: a command then starts in a child that has already done,
    /// off the command's path, what every command of a default configuration does first (the CLI: the jail a
    /// default process-tier run needs, [`crate::Engine::process`] and `ProcessTier::prestart`; or a Python
    /// instance, `WasmTier::prestart_python`). A child is still a fresh copy of the warm state, used once; what it
    /// prepared is closed with it when the daemon exits unused. A command line goes to a spare of the first plan
    /// whose `suits` accepts it (what it prepared would serve it); the others to a child forked for them, as
    /// without spares, so that they never pay for closing what they do not use.
    pub fn with_spares(mut self, plans: Vec<SparePlan>) -> Daemon {
        self.plans = plans;
        self
    }

    /// Serves clients until stopped, idle for the idle period, or its socket file is gone; then waits for the
    /// running jobs and removes the socket file (if it is still its own).
    pub fn serve(mut self) -> Result<(), WarmError> {
        let mut jobs: Vec<Job> = Vec::new();
        let mut stopping = false;
        let mut last_job = Instant::now();
        loop {
            if jobs.is_empty() && (stopping || last_job.elapsed() >= self.idle || !self.owns_socket()) {
                break;
            }
            // Spares prepare while no job runs, so that a preparation never competes with a job for the CPUs.
            if !stopping && jobs.is_empty() {
                self.replenish(&mut jobs);
            }
            let Some(listener) = self.listener.as_ref() else { break };
            let ready = {
                let mut fds = vec![PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
                for job in &jobs {
                    fds.push(PollFd::new(job.pidfd.as_fd(), PollFlags::POLLIN));
                    fds.push(PollFd::new(job.connection.as_fd(), PollFlags::POLLIN));
                }
                for spare in &self.spares {
                    fds.push(PollFd::new(spare.pidfd.as_fd(), PollFlags::POLLIN));
                }
                // Wake at least once a second to notice the idle period and a removed socket file.
                match poll(&mut fds, PollTimeout::from(1000u16)) {
                    Ok(_) | Err(Errno::EINTR) => {}
                    Err(err) => return Err(WarmError::io("poll", err)),
                }
                fds.iter().map(|fd| fd.revents().is_some_and(|r| !r.is_empty())).collect::<Vec<bool>>()
            };
            // A spare that ended before its command (its preparation failed badly, or it was killed).
            let first_spare = 1 + 2 * jobs.len();
            for index in (0..self.spares.len()).rev() {
                if ready[first_spare + index] {
                    let spare = self.spares.swap_remove(index);
                    let status = waitpid(Pid::from_raw(spare.pid), None);
                    self.spare_failures += 1;
                    log::warn!("spare child {} ended before its command: {status:?}", spare.pid);
                }
            }
            // Jobs first, from the last so removing one keeps the others' indices.
            for index in (0..jobs.len()).rev() {
                let (exited, client) = (ready[1 + 2 * index], ready[2 + 2 * index]);
                if exited {
                    let job = jobs.swap_remove(index);
                    let reply = match waitpid(Pid::from_raw(job.pid), None) {
                        Ok(WaitStatus::Exited(_, code)) => Reply::Exited { code },
                        Ok(WaitStatus::Signaled(_, signal, _)) => Reply::Signaled { signal: signal as i32 },
                        other => {
                            log::warn!("job {}: unexpected wait status {other:?}", job.pid);
                            Reply::Exited { code: 125 }
                        }
                    };
                    let _ = proto::send_nowait(job.connection.as_fd(), &reply);
                    last_job = Instant::now();
                } else if client {
                    self.client_message(&jobs[index]);
                }
            }
            if ready[0] && !stopping {
                stopping = self.accept(&mut jobs);
                last_job = Instant::now();
            }
        }
        if self.owns_socket() {
            let _ = std::fs::remove_file(&self.path);
        }
        self.close_spares();
        Ok(())
    }

    /// Forks spare children up to each plan's count (none after [`SPARE_FAILURES`] died unused in a row).
    fn replenish(&mut self, jobs: &mut Vec<Job>) {
        for plan in 0..self.plans.len() {
            let SparePlan { count, prepare, .. } = self.plans[plan];
            while self.spares.iter().filter(|spare| spare.plan == plan).count() < count
                && self.spare_failures < SPARE_FAILURES
            {
                match self.fork_spare(plan, prepare, jobs) {
                    Ok(spare) => self.spares.push(spare),
                    Err(err) => {
                        self.spare_failures += 1;
                        log::warn!("cannot fork a spare child: {err}");
                        return;
                    }
                }
            }
        }
    }

    /// Forks one spare child of `plan`: it prepares, then waits for its command (a [`RunRequest`], the client's
    /// three streams and its connection) on its end of a socket pair; the daemon closing that end ends it.
    fn fork_spare(&mut self, plan: usize, prepare: Prepare, jobs: &mut Vec<Job>) -> Result<Spare, WarmError> {
        let (ours, theirs) =
            nix::sys::socket::socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)
                .map_err(|e| WarmError::io("socketpair", e))?;
        let handler = self.handler;
        let mut ours = Some(ours);
        let mut theirs = Some(theirs);
        let pid = fork_single_threaded(|| {
            // As a job's child: nothing of the daemon's but the engine and its own end of the pair.
            let engine = self.engine.take();
            self.listener = None;
            self.spares.clear();
            jobs.clear();
            ours = None;
            let (Some(engine), Some(theirs)) = (engine, theirs.take()) else { return 125 };
            prepare(&engine);
            match proto::recv::<RunRequest>(theirs.as_fd()) {
                // The client's three streams, then its connection (to report the end on).
                Ok(Some((run, mut fds))) if fds.len() == 4 => {
                    drop(theirs);
                    let report = fds.pop();
                    run_job(handler, run, fds, engine, report)
                }
                // The daemon is exiting (or sent something else): close what was prepared.
                _ => {
                    drop(engine);
                    0
                }
            }
        })?;
        drop(theirs.take());
        let channel = ours.take().ok_or_else(|| WarmError::Protocol("the spare's socket went missing".into()))?;
        match pidfd_open(pid) {
            Ok(pidfd) => Ok(Spare { pid, pidfd, channel, plan }),
            Err(err) => {
                let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL);
                let _ = waitpid(Pid::from_raw(pid), None);
                Err(WarmError::io("pidfd_open", err))
            }
        }
    }

    /// Ends the spare children: each closes what it prepared and exits (or is killed after
    /// [`SPARE_EXIT_TIMEOUT`]).
    fn close_spares(&mut self) {
        let spares = std::mem::take(&mut self.spares);
        let deadline = Instant::now() + SPARE_EXIT_TIMEOUT;
        let mut waiting = Vec::new();
        for Spare { pid, pidfd, channel, .. } in spares {
            drop(channel);
            waiting.push((pid, pidfd));
        }
        for (pid, pidfd) in waiting {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut fds = [PollFd::new(pidfd.as_fd(), PollFlags::POLLIN)];
            let ended = matches!(poll(&mut fds, poll_timeout(left)), Ok(n) if n > 0);
            if !ended {
                log::warn!("spare child {pid} did not exit in time: killed");
                signal_pidfd(&pidfd, Signal::SIGKILL);
            }
            let _ = waitpid(Pid::from_raw(pid), None);
        }
    }

    /// Whether the socket file is still this daemon's.
    fn owns_socket(&self) -> bool {
        std::fs::symlink_metadata(&self.path).is_ok_and(|meta| meta.ino() == self.inode)
    }

    /// A message on a running job's connection: a signal to pass on, or the client gone (the job is killed).
    fn client_message(&self, job: &Job) {
        match proto::recv::<Request>(job.connection.as_fd()) {
            Ok(Some((Request::Signal { signal }, _))) => {
                if let Ok(signal) = Signal::try_from(signal) {
                    signal_pidfd(&job.pidfd, signal);
                }
            }
            // Closed, broken, or not this protocol: the client is gone as far as its job is concerned.
            _ => signal_pidfd(&job.pidfd, Signal::SIGKILL),
        }
    }

    /// Takes one client; returns whether it asked the daemon to stop.
    fn accept(&mut self, jobs: &mut Vec<Job>) -> bool {
        let Some(Ok(connection)) = self.listener.as_ref().map(|l| accept_cloexec(l.as_fd())) else { return false };
        let own_uid = nix::unistd::geteuid().as_raw();
        let peer = match getsockopt(&connection, sockopt::PeerCredentials) {
            Ok(cred) if cred.uid() == own_uid => cred.pid(),
            _ => return false,
        };
        receive_timeout(&connection, REQUEST_TIMEOUT);
        let (request, fds) = match proto::recv::<Request>(connection.as_fd()) {
            Ok(Some(message)) => message,
            _ => return false,
        };
        receive_timeout(&connection, Duration::ZERO);
        let run = match request {
            Request::Status => {
                let _ = proto::send_nowait(connection.as_fd(), &Reply::Status(self.status(jobs.len())));
                return false;
            }
            Request::Stop => {
                let _ = proto::send_nowait(connection.as_fd(), &Reply::Stopping);
                return true;
            }
            Request::Signal { .. } => return false,
            Request::Run(run) => run,
        };
        if let Err(reason) = check_request(&run, fds.len(), jobs.len(), &self.identity, &self.env) {
            self.refuse(connection.as_fd(), reason);
            return false;
        }
        // The client waits for the answer, so its PID is still its own while this reads it.
        match confinement(&peer.to_string()) {
            Ok(theirs) => {
                if let Some(what) = confined_otherwise(&self.confinement, &theirs) {
                    self.refuse(connection.as_fd(), format!("a client confined otherwise ({what})"));
                    return false;
                }
            }
            Err(err) => {
                self.refuse(connection.as_fd(), format!("cannot see how the client is confined: {err}"));
                return false;
            }
        }
        let mut connection = Some(connection);
        let started = self.start(run, fds, &mut connection, jobs);
        let Some(connection) = connection else { return false };
        match started {
            Ok((pid, pidfd)) => {
                self.served += 1;
                let _ = proto::send_nowait(connection.as_fd(), &Reply::Started { pid });
                jobs.push(Job { connection, pid, pidfd });
            }
            Err(err) => self.refuse(connection.as_fd(), err.to_string()),
        }
        false
    }

    fn refuse(&mut self, connection: BorrowedFd<'_>, reason: String) {
        self.refused += 1;
        self.last_refusal = Some(reason.clone());
        let _ = proto::send_nowait(connection, &Reply::Refused { reason });
    }

    /// Forks the job's process: the client's streams as its own, its working directory and umask, then the
    /// handler with the warm engine.
    fn start(
        &mut self,
        run: RunRequest,
        fds: Vec<OwnedFd>,
        connection: &mut Option<OwnedFd>,
        jobs: &mut Vec<Job>,
    ) -> Result<(i32, OwnedFd), WarmError> {
        // The oldest spare of the plan has had the longest to prepare.
        let plan = self.plans.iter().position(|plan| (plan.suits)(&run.argv));
        while let Some(index) = plan.and_then(|plan| self.spares.iter().position(|spare| spare.plan == plan)) {
            let spare = self.spares.remove(index);
            let mut fds_ref: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
            if let Some(connection) = connection.as_ref() {
                fds_ref.push(connection.as_fd());
            }
            match proto::send(spare.channel.as_fd(), &run, &fds_ref) {
                Ok(()) => {
                    self.spare_failures = 0;
                    return Ok((spare.pid, spare.pidfd));
                }
                Err(err) => {
                    // Gone meanwhile (its pidfd says so at the next poll, but it is no longer watched): reap it.
                    log::warn!("spare child {} did not take its command: {err}", spare.pid);
                    signal_pidfd(&spare.pidfd, Signal::SIGKILL);
                    let _ = waitpid(Pid::from_raw(spare.pid), None);
                    self.spare_failures += 1;
                }
            }
        }
        let handler = self.handler;
        let pid = fork_single_threaded(|| {
            // The child keeps nothing of the daemon's but the engine: its sockets and the other jobs' pidfds are
            // closed.
            let engine = self.engine.take();
            self.listener = None;
            self.spares.clear();
            let report = connection.take();
            jobs.clear();
            match engine {
                Some(engine) => run_job(handler, run, fds, engine, report),
                None => 125,
            }
        })?;
        match pidfd_open(pid) {
            Ok(pidfd) => Ok((pid, pidfd)),
            Err(err) => {
                // Not yet reaped, so the PID is still this child's.
                let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL);
                let _ = waitpid(Pid::from_raw(pid), None);
                Err(WarmError::io("pidfd_open", err))
            }
        }
    }

    fn status(&self, running: usize) -> DaemonStatus {
        DaemonStatus {
            pid: std::process::id() as i32,
            identity: self.identity.clone(),
            uptime_s: self.started.elapsed().as_secs(),
            served: self.served,
            running,
            refused: self.refused,
            last_refusal: self.last_refusal.clone(),
            idle_exit_s: self.idle.as_secs(),
            spares: self.spares.len(),
        }
    }
}

/// In a job's child: the client's streams as its own, its working directory and umask, then the handler with
/// the warm engine; the job's exit code. Once the handler has returned (everything the job opened or started is
/// closed and its output flushed), the child lets go of the client's streams and tells the client on `report`
/// how the job ended, before this process's exit unmaps its memory (milliseconds for the Python runtime's
/// mappings), which is no longer the job's.
fn run_job(handler: Handler, run: RunRequest, fds: Vec<OwnedFd>, engine: Engine, report: Option<OwnedFd>) -> i32 {
    let setup = nix::unistd::dup2_stdin(&fds[0])
        .and_then(|()| nix::unistd::dup2_stdout(&fds[1]))
        .and_then(|()| nix::unistd::dup2_stderr(&fds[2]));
    drop(fds);
    if setup.is_err() {
        return 125;
    }
    if let Err(err) = nix::unistd::chdir(&run.cwd) {
        let _ = writeln!(std::io::stderr(), "strata: cannot enter {}: {}", run.cwd.display(), err.desc());
        return 2;
    }
    nix::sys::stat::umask(Mode::from_bits_truncate(run.umask));
    let code = handler(run.argv, engine);
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    if let Some(report) = report {
        // This process's copies of the client's descriptors would hold them open until its exit: a reader of the
        // client's output then sees its end when the client exits.
        let released = std::fs::File::open("/dev/null").is_ok_and(|null| {
            nix::unistd::dup2_stdin(&null)
                .and_then(|()| nix::unistd::dup2_stdout(&null))
                .and_then(|()| nix::unistd::dup2_stderr(&null))
                .is_ok()
        });
        // What `waitpid` will say: the low byte of the code this process exits with.
        if released {
            let _ = proto::send_nowait(report.as_fd(), &Reply::Exited { code: code & 0xff });
        }
    }
    code
}

/// A poll timeout of `d`, rounded up to a millisecond and capped at the largest one poll takes.
fn poll_timeout(d: Duration) -> PollTimeout {
    let ms = d.as_nanos().div_ceil(1_000_000).min(i32::MAX as u128);
    i32::try_from(ms).ok().and_then(|ms| PollTimeout::try_from(ms).ok()).unwrap_or(PollTimeout::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(env: &[(&str, &str)]) -> RunRequest {
        RunRequest {
            protocol: PROTOCOL,
            identity: "exe".into(),
            argv: vec!["strata".into(), "run".into(), "--python".into(), "-c".into(), "print(1)".into()],
            cwd: PathBuf::from("/tmp"),
            env: env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
            umask: 0o022,
        }
    }

    fn ours() -> Vec<(String, String)> {
        vec![("HOME".into(), "/root".into()), ("PATH".into(), "/bin".into())]
    }

    #[test]
    fn only_the_same_binary_and_environment_with_three_streams_is_run() {
        let env = ours();
        let same = request(&[("PATH", "/bin"), ("HOME", "/root"), ("PWD", "/x"), ("SHLVL", "3"), ("_", "/bin/sh")]);
        assert_eq!(check_request(&same, 3, 0, "exe", &env), Ok(()));
        let other = check_request(&same, 3, 0, "another", &env).expect_err("another binary");
        assert!(other.contains("another strata binary"), "{other}");
        let fds = check_request(&same, 2, 0, "exe", &env).expect_err("two descriptors");
        assert!(fds.contains("2 descriptors"), "{fds}");
        let busy = check_request(&same, 3, MAX_RUNNING, "exe", &env).expect_err("too many jobs");
        assert!(busy.contains("jobs running"), "{busy}");
        let extra = request(&[("PATH", "/bin"), ("HOME", "/root"), ("SECRET_TOKEN", "v")]);
        let differs = check_request(&extra, 3, 0, "exe", &env).expect_err("another environment");
        assert_eq!(differs, "another environment (differs in SECRET_TOKEN)");
        assert!(!differs.contains("=v"), "values are never quoted: {differs}");
        let changed = request(&[("PATH", "/usr/bin"), ("HOME", "/root")]);
        assert_eq!(
            check_request(&changed, 3, 0, "exe", &env).expect_err("PATH differs"),
            "another environment (differs in PATH)"
        );
        let mut old = same.clone();
        old.protocol = PROTOCOL + 1;
        assert!(check_request(&old, 3, 0, "exe", &env).is_err());
        let mut serve = same.clone();
        serve.argv[1] = "serve".into();
        assert_eq!(check_request(&serve, 3, 0, "exe", &env), Err("not a `strata run` command line".into()));
        let mut relative = same;
        relative.cwd = PathBuf::from("tmp");
        assert!(check_request(&relative, 3, 0, "exe", &env).is_err());
    }

    #[test]
    fn requests_and_replies_survive_the_socket_and_unknown_fields_are_refused() {
        let (a, b) =
            nix::sys::socket::socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)
                .expect("socketpair");
        let run = Request::Run(request(&[("PATH", "/bin")]));
        let stdin = std::io::stdin();
        proto::send(a.as_fd(), &run, &[stdin.as_fd(), stdin.as_fd(), stdin.as_fd()]).expect("send");
        let (got, fds) = proto::recv::<Request>(b.as_fd()).expect("recv").expect("a message");
        assert_eq!((got, fds.len()), (run, 3));
        for reply in [
            Reply::Started { pid: 7 },
            Reply::Exited { code: 3 },
            Reply::Signaled { signal: 2 },
            Reply::Refused { reason: "r".into() },
        ] {
            proto::send(a.as_fd(), &reply, &[]).expect("send");
            assert_eq!(recv_reply(b.as_fd()).expect("recv"), Some(reply));
        }
        let unknown =
            br#"{"kind":"run","protocol":1,"identity":"x","argv":[],"cwd":"/","env":[],"umask":18,"as_root":true}"#;
        nix::sys::socket::send(a.as_raw_fd(), unknown, nix::sys::socket::MsgFlags::empty()).expect("send");
        assert!(proto::recv::<Request>(b.as_fd()).is_err(), "an unknown field is refused");
    }

    #[test]
    fn the_socket_path_follows_strata_daemon_else_the_home() {
        // Read-only on the process environment: the variable is not set in the unit-test environment.
        if std::env::var_os("STRATA_DAEMON").is_none() {
            assert_eq!(socket_path(Some(Path::new("/h"))), Some(PathBuf::from("/h/run/warm.sock")));
            assert_eq!(socket_path(None), None);
        }
    }

    #[test]
    fn this_process_is_confined_as_itself_and_a_difference_is_named() {
        let ours = confinement("self").expect("this process's confinement");
        assert!(ours.iter().any(|(name, _)| name == "mnt namespace"), "{ours:?}");
        assert_eq!(confined_otherwise(&ours, &confinement("self").expect("again")), None);
        let mut theirs = ours.clone();
        if let Some(limits) = theirs.iter_mut().find(|(name, _)| name == "resource limits") {
            limits.1.push_str("Max open files 512 512 files\n");
        }
        assert_eq!(confined_otherwise(&ours, &theirs).as_deref(), Some("resource limits"));
    }

    #[test]
    fn a_signal_number_ends_this_process_only_through_its_own_signal() {
        // A number that is no signal maps to the shell's 128 + n without raising anything.
        assert_eq!(end_like(200), 328);
    }
}
