//! Sessions: one guest, several jobs in turn through its agent ([`Session`]), whatever the guest is — a booted
//! microVM ([`crate::tier::MicrovmSandbox`]) or, in tests, the agent run as a host process ([`AgentHost`]).
//!
//! A session copies its grants in once, when it starts, and keeps everything the jobs leave in the guest (files,
//! processes) for the next job. Each job ([`Session::exec_job`]) is translated, limited, captured and judged as a
//! one-shot job is (the one-shot path is a session of one job): its argv and uploaded program, `BASE_ENV` with the
//! capabilities' variables, rlimits from its limits, output capped per stream with secrets redacted, the wall
//! limit enforced from the host (the job's process group killed), the agent's exit report mapped to a
//! [`Status`]. After a job that exits with 0 the read-write grants are copied back ([`crate::grants::copy_out`]),
//! after any other ending they are not (the host keeps what the last successful job left).
//!
//! Files ([`Session::write_file`], [`Session::read_file`]) and the file methods (`list_dir`, `stat`, `make_dir`,
//! `rename`, `remove`, `watch`; see [`crate::files`]) take guest paths by [`GuestPath`]'s rules, anywhere in the
//! guest but its kernel filesystems (`/proc`, `/sys`, `/dev`); a change inside a read-only grant is refused. The
//! agent does the work in the guest, never following a link where the operation is on the link. A file written
//! inside a read-write grant reaches the host with the next copy-back, like anything a job writes there.
//!
//! **Network egress** (no NIC; the agent's forwarder tunnels over vsock). With [`Net::Allow`](strata_core::Net::Allow) the
//! session starts a host egress proxy ([`strata_egress`]) with the allowlist, listening on the Unix socket where
//! the guest's streams to vsock port [`EGRESS_PORT`] arrive ([`AgentHost::egress_path`]: the vsock device
//! connects each guest stream to `<uds>_1028`, so the device's muxer is the host relay and the proxy serves the
//! streams directly), then asks the agent to start its forwarder ([`AgentClient::start_egress`]) on the guest's
//! `127.0.0.1:3128`, which opens one vsock stream per accepted connection. Jobs get `HTTP_PROXY`, `HTTPS_PROXY`,
//! `http_proxy`, `https_proxy` = `http://127.0.0.1:3128` and `NO_PROXY`, `no_proxy` as [`strata_egress::proxy_env`]
//! sets them (the capabilities' own variables may override them); each job's proxy records (drained when it ends, after its last connections
//! close) are its Outcome's `egress`. Both ends cap the tunnels at [`DEFAULT_EGRESS_CONNECTIONS`] (the agent and
//! the proxy each answer `503` beyond it), so a guest that opens vsock streams itself gains nothing; the proxy
//! judges every request whoever sent it. With [`Net::Deny`](strata_core::Net::Deny) nothing listens on either side. The proxy stops when
//! the session ends (its thread joined, its socket removed).
//!
//! A snapshot ([`Session::snapshot`]) asks the agent to quiesce (refused while an exec runs; it syncs the guest's
//! filesystems), then the host saves the whole guest ([`AgentHost::snapshot`]) with the session's description in
//! the manifest's meta: the capabilities with secrets by name only (`secret_names`; their values are never
//! written by Strata), the limits and where jobs start. Secret values a job had in its environment may still be
//! in the guest's memory, which the snapshot holds whole: a microVM snapshot is as sensitive as the sandbox.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard, TryLockError};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use std::io::Read;

use strata_core::fs::MAX_LIST_ENTRIES;
use strata_core::sync::lock;
use strata_core::{
    Capabilities, EntryInfo, ExecOptions, GrantMode, GuestPath, Job, LimitKind, Limits, Outcome, OutputSink, Persisted,
    Pumped, Sandbox, Snapshot, Status, Stream, TierError, TierKind, Truncated, Usage, Watcher,
};
use strata_core::{GuestCommand, OutputCapture};
use strata_egress::{EgressConfig, EgressHandle, EgressProxy};
use strata_guest_proto::{
    AgentClient, ClientError, DEFAULT_EGRESS_CONNECTIONS, EGRESS_PORT, ExecEvent, ExecLimits, ExecRequest, ExitStatus,
    MAX_CHUNK, OutputStream,
};

use crate::files::{self, file_error};
use crate::grants::{self, GrantError, HostTree};
use crate::snapshot::SnapshotExtra;

/// Where host programs and scripts are written in the guest.
pub use strata_core::guest_command::PROGRAM_DIR;

/// Where jobs start in a microVM.
pub const DEFAULT_WORKDIR: &str = "/root";

/// The environment every job starts from.
const BASE_ENV: &[(&str, &str)] =
    &[("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"), ("HOME", "/root"), ("LANG", "C.UTF-8")];

/// Guest paths a grant may not take: the guest's kernel filesystems and where Strata puts programs.
const RESERVED_GUEST_PATHS: &[&str] = &["/proc", "/sys", "/dev", PROGRAM_DIR];

/// The most `read_file` returns.
pub const MAX_READ: u64 = 256 * 1024 * 1024;

/// How long the agent has to report a killed job's exit before the job is given up on.
const KILL_GRACE: Duration = Duration::from_secs(2);

/// How long the end of a job waits for its last tunnelled connections to finish before reading the egress log.
const EGRESS_SETTLE: Duration = Duration::from_millis(500);

/// Where a guest's egress tunnel reaches the host, and where its forwarder listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EgressPath {
    /// The Unix socket the guest's streams to vsock port [`EGRESS_PORT`] arrive at (`<uds>_1028`); the session's
    /// egress proxy binds it.
    pub socket: PathBuf,
    /// The guest TCP port on 127.0.0.1 the agent's forwarder listens on (jobs' `HTTP_PROXY`):
    /// [`strata_guest_proto::EGRESS_LISTEN_PORT`] in a VM.
    pub listen_port: u16,
}

/// Where a session's agent lives: a booted microVM, or a host process serving the agent over a Unix socket (tests).
/// The session drives the agent; the host only owns the guest's life.
pub trait AgentHost: Send + Sync {
    /// Whether the guest has stopped on its own (crashed, rebooted).
    fn has_stopped(&self) -> bool;

    /// The guest console's last lines, for a crash report (empty when there is no console).
    fn console_tail(&self) -> String {
        String::new()
    }

    /// The directory jobs start in.
    fn workdir(&self) -> &str {
        DEFAULT_WORKDIR
    }

    /// Where the guest's egress tunnel reaches the host; `None` when this guest has none (then a session with
    /// network is refused as unsupported).
    fn egress_path(&self) -> Option<EgressPath> {
        None
    }

    /// The Unix socket where the guest's streams to the host's vsock `port` arrive (`<uds>_<port>`, as the vsock
    /// device names them), for the ports the host reaches through the agent; `None` when this guest has none (then
    /// ports are unsupported).
    fn dial_socket(&self, port: u32) -> Option<PathBuf> {
        let _ = port;
        None
    }

    /// Saves the whole guest, its agent quiesced, into a new snapshot directory at `destination` (with `extra`
    /// in its manifest) and lets it go on.
    fn snapshot(
        &mut self,
        destination: &Path,
        parent: Option<String>,
        extra: SnapshotExtra,
    ) -> Result<Snapshot, TierError>;

    /// Ends the guest once its agent was asked to power off (or is gone) and releases everything it holds.
    fn shut_down(self)
    where
        Self: Sized;
}

/// How long [`Session`]'s `connect_port` waits for the agent's stream once it said it was connected.
const PORT_STREAM_WAIT: Duration = Duration::from_secs(5);

/// The first host vsock port of the ports' streams ([`Session`]'s `connect_port`), clear of the agent's and the
/// egress tunnel's; each connection takes the next of [`PORT_STREAM_SPAN`].
const PORT_STREAM_BASE: u32 = 20_000;

/// How many host vsock ports the ports' streams cycle through.
const PORT_STREAM_SPAN: u32 = 40_000;

/// The host vsock port of the next port stream.
fn port_stream_port() -> u32 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    PORT_STREAM_BASE + NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % PORT_STREAM_SPAN
}

/// Removes a socket file when dropped.
struct RemoveOnDrop<'a>(&'a Path);

impl Drop for RemoveOnDrop<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.0);
    }
}

pub(crate) fn unsupported(what: &str) -> TierError {
    TierError::Unsupported { tier: TierKind::Microvm, what: what.to_owned() }
}

pub(crate) fn internal(message: impl std::fmt::Display) -> TierError {
    TierError::internal(TierKind::Microvm, message.to_string())
}

/// A failure of the tier itself while doing `what`, caused by `source` (kept as the error's source).
pub(crate) fn internal_from(
    what: &str,
    source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
) -> TierError {
    TierError::internal_from(TierKind::Microvm, what, source)
}

/// A guest running jobs in turn through its agent, with file calls beside them. Dropping it powers the guest
/// off, as [`Sandbox::close`] does.
#[derive(Debug)]
pub struct Session<H: AgentHost> {
    caps: Capabilities,
    limits: Limits,
    parent: Option<String>,
    /// The guest: shared by a job and file calls; held alone by a snapshot (which saves the host) and by close.
    guest: RwLock<Guest<H>>,
    /// Held by the one job that runs, and by a snapshot.
    turn: Mutex<()>,
    /// Why the session can run nothing more.
    ended: Mutex<Option<String>>,
    /// Set by close: a running job is stopped at its next look (within 50 ms).
    closing: AtomicBool,
}

/// A session's guest while it lives.
#[derive(Debug)]
struct Guest<H> {
    host: Option<H>,
    client: Option<AgentClient>,
    /// The egress proxy and the guest port of the agent's forwarder, with network.
    egress: Option<(EgressHandle, u16)>,
}

impl<H: AgentHost> Session<H> {
    /// A session over a guest whose agent `client` reached: the grants are scanned and copied in.
    pub fn start(host: H, client: AgentClient, caps: &Capabilities, limits: &Limits) -> Result<Session<H>, TierError> {
        let Some(trees) = scan_grants(caps, limits)? else {
            return Err(over_disk_limit(limits));
        };
        Session::with_trees(host, client, caps, limits, &trees)
    }

    /// [`Session::start`] with the grants already scanned (before the guest was even started).
    pub(crate) fn with_trees(
        host: H,
        client: AgentClient,
        caps: &Capabilities,
        limits: &Limits,
        trees: &[HostTree],
    ) -> Result<Session<H>, TierError> {
        // The session first: a failure below drops it, which powers the guest off.
        let session = Session::resumed(host, client, caps, limits, None)?;
        {
            let guest = read(&session.guest);
            let client = session.agent(&guest)?;
            for (grant, tree) in caps.grants.iter().zip(trees) {
                grants::copy_in(client, tree, &grant.guest).map_err(grant_error)?;
            }
        }
        Ok(session)
    }

    /// A session over a guest that already holds its grants (a fork of a snapshot whose id is `parent`). With
    /// network, its egress proxy and the agent's forwarder are started.
    pub fn resumed(
        host: H,
        client: AgentClient,
        caps: &Capabilities,
        limits: &Limits,
        parent: Option<String>,
    ) -> Result<Session<H>, TierError> {
        let session = Session {
            caps: caps.clone(),
            limits: limits.clone(),
            parent,
            guest: RwLock::new(Guest { host: Some(host), client: Some(client), egress: None }),
            turn: Mutex::new(()),
            ended: Mutex::new(None),
            closing: AtomicBool::new(false),
        };
        // The session first: a failure below drops it, which powers the guest off.
        let mut guest = write(&session.guest);
        if let (Some(host), Some(client)) = (&guest.host, &guest.client) {
            guest.egress = start_egress(host, client, caps)?;
        }
        drop(guest);
        Ok(session)
    }

    /// Runs `f` on the session's egress proxy, with network.
    pub fn with_egress_proxy<T>(&self, f: impl FnOnce(&EgressHandle) -> T) -> Option<T> {
        read(&self.guest).egress.as_ref().map(|(proxy, _)| f(proxy))
    }

    /// The id of the snapshot this session was forked from, if it was.
    pub fn parent(&self) -> Option<&str> {
        self.parent.as_deref()
    }

    /// The capabilities the session runs with.
    pub fn caps(&self) -> &Capabilities {
        &self.caps
    }

    /// Runs `f` on the host side of the guest, while it lives.
    pub fn with_host<T>(&self, f: impl FnOnce(&H) -> T) -> Option<T> {
        read(&self.guest).host.as_ref().map(f)
    }

    /// [`Sandbox::list_dir`] refusing more than `max` entries (it refuses more than [`MAX_LIST_ENTRIES`]).
    pub fn list_dir_at_most(&self, path: &GuestPath, depth: u32, max: usize) -> Result<Vec<EntryInfo>, TierError> {
        files::list_dir(self.agent(&read(&self.guest))?, path, depth, max)
    }

    /// The agent of a guest that still runs.
    fn agent<'g>(&self, guest: &'g Guest<H>) -> Result<&'g AgentClient, TierError> {
        if let Some(reason) = lock(&self.ended).as_ref() {
            return Err(TierError::SessionEnded { reason: reason.clone() });
        }
        match (&guest.client, &guest.host) {
            (Some(client), Some(host)) if !host.has_stopped() => Ok(client),
            (Some(_), Some(_)) => Err(TierError::SessionEnded { reason: "the guest stopped".into() }),
            _ => Err(TierError::SessionEnded { reason: "the sandbox was closed".into() }),
        }
    }

    /// The turn, for a job or a snapshot: [`TierError::Busy`] while another holds it.
    fn turn(&self, doing: &'static str) -> Result<MutexGuard<'_, ()>, TierError> {
        match self.turn.try_lock() {
            Ok(guard) => Ok(guard),
            Err(TryLockError::Poisoned(poisoned)) => Ok(poisoned.into_inner()),
            Err(TryLockError::WouldBlock) => Err(TierError::Busy { tier: TierKind::Microvm, doing }),
        }
    }

    /// Runs one job in the guest; `started` is when its wall time began (a one-shot job's boot counts).
    /// [`TierError::Busy`] while another job runs or a snapshot is taken.
    pub fn exec_job(&self, job: &Job, opts: &ExecOptions, started: Instant) -> Result<Outcome, TierError> {
        let prepared = PreparedJob::new(job)?;
        self.exec_prepared(prepared, opts, started)
    }

    /// [`Session::exec_job`] of a job already translated (before the guest was even started).
    pub(crate) fn exec_prepared(
        &self,
        prepared: PreparedJob,
        opts: &ExecOptions,
        started: Instant,
    ) -> Result<Outcome, TierError> {
        let _turn = self.turn("a job; the microVM tier runs one at a time")?;
        let guest = read(&self.guest);
        let limits = opts.limits.clone().unwrap_or_else(|| self.limits.clone());
        let PreparedJob { argv, upload } = prepared;
        let client = self.agent(&guest)?;
        if let Some((path, bytes)) = &upload {
            client.write_file(path, 0o755, bytes).map_err(internal)?;
        }
        let caps = &self.caps;
        let secrets = caps.secret_values();
        let sink: Option<Arc<dyn OutputSink>> = opts.sink.clone();
        let stdout = OutputCapture::new(Stream::Stdout, limits.output.0, secrets.clone(), sink.clone());
        let stderr = OutputCapture::new(Stream::Stderr, limits.output.0, secrets, sink);
        let mut env: Vec<(String, String)> = BASE_ENV.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        if let (Some((_, port)), Some(allow)) = (&guest.egress, caps.net.allowlist()) {
            env.extend(strata_egress::proxy_env(&format!("http://127.0.0.1:{port}"), allow));
        }
        for var in caps.guest_env() {
            env.retain(|(k, _)| *k != var.name);
            env.push((var.name.clone(), var.value.clone()));
        }
        let stdin = opts.stdin.as_deref().unwrap_or_default();
        let stream = opts.stdin_stream.as_ref();
        let workdir = guest.host.as_ref().map_or(DEFAULT_WORKDIR, AgentHost::workdir).to_owned();
        let request = ExecRequest {
            argv,
            env,
            cwd: workdir,
            stdin: stream.is_some() || !stdin.is_empty(),
            limits: ExecLimits {
                output: Some(limits.output.0),
                open_files: Some(u64::from(limits.files)),
                cpu_seconds: Some(limits.cpu.as_secs().saturating_add(1)),
            },
            tty: opts.terminal.as_ref().map(|terminal| tty_size(terminal.size())),
        };
        let mut handle = client.start(&request).map_err(|err| match err {
            ClientError::ExecFailed { errno, message } if errno == libc::ENOENT => {
                TierError::ProgramNotFound { program: message }
            }
            ClientError::ExecFailed { message, .. } => TierError::ExecFailed { message },
            other => internal(other),
        })?;
        let control = handle.control();
        // A terminal's window follows its handle while the job runs (the agent resizes the guest's terminal).
        let _terminal = opts.terminal.as_ref().map(|terminal| {
            let resizer = control.clone();
            let now = terminal.attach(move |size| {
                let _ = resizer.resize(tty_size(size));
            });
            if Some(tty_size(now)) != request.tty {
                let _ = control.resize(tty_size(now));
            }
            Detach(terminal)
        });
        // On a terminal, the end of the input stream is not the terminal's end: the job reads end of file after a
        // Ctrl-D the writer types.
        let on_terminal = opts.terminal.is_some();
        // A stream goes to the agent chunk by chunk as it arrives (the agent queues it for the job), and stops being
        // read when the job ends: the pump is stopped with this function's return.
        let _pump = match stream {
            Some(stream) => {
                let control = control.clone();
                let pump = stream.pump(MAX_CHUNK, move |pumped| match pumped {
                    Pumped::Data(data) => control.write_stdin(data).is_ok(),
                    Pumped::End | Pumped::Failed(_) => {
                        if !on_terminal {
                            let _ = control.close_stdin();
                        }
                        false
                    }
                });
                Some(pump.map_err(|source| TierError::ReadInput { path: "stdin stream".into(), source })?)
            }
            None => {
                if !stdin.is_empty() {
                    control.write_stdin(stdin).map_err(internal)?;
                    if !on_terminal {
                        control.close_stdin().map_err(internal)?;
                    }
                }
                None
            }
        };
        let deadline = started + limits.wall;
        let mut stopped: Option<LimitKind> = None;
        let mut lost: Option<ClientError> = None;
        let report = loop {
            if opts.cancel.as_ref().is_some_and(strata_core::CancelToken::is_cancelled) {
                let _ = control.signal(libc::SIGKILL);
                return Err(TierError::Cancelled);
            }
            if self.closing.load(Ordering::SeqCst) {
                let _ = control.signal(libc::SIGKILL);
                return Err(TierError::SessionEnded { reason: "the sandbox was closed during the job".into() });
            }
            let left = deadline.saturating_duration_since(Instant::now()).min(Duration::from_millis(50));
            match handle.next_event(Some(left.max(Duration::from_millis(1)))) {
                Ok(ExecEvent::Output { stream: OutputStream::Stdout, data }) => stdout.write(&data),
                Ok(ExecEvent::Output { stream: OutputStream::Stderr, data }) => stderr.write(&data),
                Ok(ExecEvent::Exited(report)) => break Some(report),
                Err(ClientError::Timeout(_)) => {
                    if Instant::now() >= deadline && stopped.is_none() {
                        stopped = Some(LimitKind::Wall);
                        let _ = control.signal(libc::SIGKILL);
                    } else if stopped.is_some() && Instant::now() >= deadline + KILL_GRACE {
                        break None;
                    }
                    if guest.host.as_ref().is_some_and(AgentHost::has_stopped) {
                        lost = Some(ClientError::Disconnected);
                        break None;
                    }
                }
                Err(err) => {
                    lost = Some(err);
                    break None;
                }
            }
        };
        let wall = started.elapsed();
        // The agent caps output before it is sent: its totals say what the job wrote.
        let totals = report.map_or((0, 0), |r| (r.stdout_bytes, r.stderr_bytes));
        let (status, cpu, peak) = match (report, lost) {
            (_, Some(err)) => {
                let console = guest.host.as_ref().map(AgentHost::console_tail).unwrap_or_default();
                let reason = format!("the guest agent was lost during a job ({err})");
                *lock(&self.ended) = Some(reason.clone());
                if !console.is_empty() {
                    stderr.write(format!("\n{console}\n").as_bytes());
                }
                (Status::Crashed { message: reason }, Duration::ZERO, 0)
            }
            (None, None) => (Status::LimitExceeded { limit: LimitKind::Wall }, Duration::ZERO, 0),
            (Some(report), None) => {
                let cpu = Duration::from_micros(report.rusage.user_us.saturating_add(report.rusage.sys_us));
                let status = match (stopped, report.status) {
                    (Some(limit), _) => Status::LimitExceeded { limit },
                    (None, _) if report.oom_killed => Status::LimitExceeded { limit: LimitKind::Memory },
                    (None, ExitStatus::Signal(_)) if cpu > limits.cpu => {
                        Status::LimitExceeded { limit: LimitKind::Cpu }
                    }
                    (None, ExitStatus::Code(code)) => Status::Exited { code },
                    (None, ExitStatus::Signal(signal)) => {
                        Status::Trapped { message: format!("killed by signal {signal}") }
                    }
                };
                (status, cpu, report.rusage.max_rss_kb.saturating_mul(1024))
            }
        };
        let status = if status == (Status::Exited { code: 0 }) {
            copy_back(self.agent(&guest)?, &self.caps, &limits, status)?
        } else {
            status
        };
        let (out, err) = (stdout.finish(), stderr.finish());
        let cap = limits.output.0;
        let (egress, egress_dropped) = match &guest.egress {
            Some((proxy, _)) => proxy.drain_records_settled(EGRESS_SETTLE).into_entries(),
            None => (Vec::new(), 0),
        };
        Ok(Outcome {
            truncated: Truncated {
                stdout: out.truncated || totals.0 > cap,
                stderr: err.truncated || totals.1 > cap,
                egress: egress_dropped,
            },
            usage: Usage {
                wall,
                cpu,
                fuel: None,
                peak_memory: peak,
                stdout_bytes: out.written.max(totals.0),
                stderr_bytes: err.written.max(totals.1),
            },
            stdout: out.bytes,
            stderr: err.bytes,
            egress,
            ..Outcome::new(TierKind::Microvm, status)
        })
    }

    /// What a snapshot's manifest says about the session: capabilities (secrets by name only), limits, workdir.
    pub fn snapshot_extra(&self) -> SnapshotExtra {
        let workdir = self.with_host(|host| host.workdir().to_owned()).unwrap_or_else(|| DEFAULT_WORKDIR.to_owned());
        session_meta(&self.caps, &self.limits, &workdir)
    }

    /// Powers the guest off and releases it; idempotent. A job that runs is stopped first.
    fn end(&self) {
        self.closing.store(true, Ordering::SeqCst);
        let mut guest = write(&self.guest);
        if let Some(client) = guest.client.take() {
            let _ = client.power_off();
        }
        if let Some(host) = guest.host.take() {
            host.shut_down();
        }
        // After the guest: nothing can reach the proxy any more.
        guest.egress = None;
        lock(&self.ended).get_or_insert_with(|| "the sandbox was closed".into());
    }
}

/// With [`Net::Allow`](strata_core::Net::Allow): the host egress proxy on the guest's egress socket, then the
/// agent's forwarder.
/// Lets the monitor's unprivileged user connect to a socket the engine listens on in the VM's socket directory (a
/// directory only that user and root can enter; connecting takes write permission on the socket).
fn open_to_the_monitor(socket: &Path) -> Result<(), TierError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o666))
        .map_err(|err| internal_from("opening a socket to the monitor", err))
}

fn start_egress<H: AgentHost>(
    host: &H,
    client: &AgentClient,
    caps: &Capabilities,
) -> Result<Option<(EgressHandle, u16)>, TierError> {
    let Some(allowlist) = caps.net.allowlist().cloned() else { return Ok(None) };
    let path = host.egress_path().ok_or_else(|| unsupported("network egress on a guest without an egress tunnel"))?;
    let config = EgressConfig::new(allowlist)
        .with_unix_socket(&path.socket)
        .with_max_connections(DEFAULT_EGRESS_CONNECTIONS as usize);
    let proxy = EgressProxy::start(config)
        .map_err(|err| internal(format!("egress proxy: {}", strata_guest_proto::error_chain(&err))))?;
    open_to_the_monitor(&path.socket)?;
    client
        .start_egress(path.listen_port, EGRESS_PORT, DEFAULT_EGRESS_CONNECTIONS)
        .map_err(|err| internal_from("starting the guest's egress forwarder", err))?;
    Ok(Some((proxy, path.listen_port)))
}

fn read<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

fn write<T>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(PoisonError::into_inner)
}

/// The session's part of a snapshot's meta, and the state a booted guest's memory holds.
pub(crate) fn session_meta(caps: &Capabilities, limits: &Limits, workdir: &str) -> SnapshotExtra {
    let mut recorded = caps.clone();
    let secret_names: Vec<String> = recorded.secrets.drain(..).map(|s| s.name).collect();
    let meta = json!({
        "caps": recorded,
        "secret_names": secret_names,
        "limits": limits,
        "workdir": workdir,
        "processes": "kept: the whole guest is saved, so processes left running by the jobs run on in every fork",
        "filesystem": "kept: the guest's files live in its RAM (tmpfs overlay), saved with it",
    });
    let Value::Object(meta) = meta else { unreachable!("json! of an object is an object") };
    SnapshotExtra { persists: vec![Persisted::Filesystem, Persisted::Processes, Persisted::Descriptors], meta }
}

impl<H: AgentHost> Drop for Session<H> {
    fn drop(&mut self) {
        self.end();
    }
}

impl<H: AgentHost> Sandbox for Session<H> {
    fn tier(&self) -> TierKind {
        TierKind::Microvm
    }

    fn exec(&self, job: &Job, opts: ExecOptions) -> Result<Outcome, TierError> {
        opts.refuse_determinism(TierKind::Microvm, "microVM jobs")?;
        opts.refuse_user(TierKind::Microvm)?;
        self.exec_job(job, &opts, Instant::now())
    }

    fn write_file(&self, guest_path: &str, contents: &[u8]) -> Result<(), TierError> {
        let path = files::file_target(guest_path)?;
        files::writable(&self.caps, &path, false)?;
        let guest = read(&self.guest);
        self.agent(&guest)?.write_file(path.as_str(), 0o644, contents).map_err(|err| file_error(&path, err))
    }

    fn read_file(&self, guest_path: &str) -> Result<Vec<u8>, TierError> {
        let path = files::file_target(guest_path)?;
        let guest = read(&self.guest);
        self.agent(&guest)?.read_file(path.as_str(), MAX_READ).map_err(|err| file_error(&path, err))
    }

    fn list_dir(&self, path: &GuestPath, depth: u32) -> Result<Vec<EntryInfo>, TierError> {
        self.list_dir_at_most(path, depth, MAX_LIST_ENTRIES)
    }

    fn stat(&self, path: &GuestPath) -> Result<EntryInfo, TierError> {
        files::stat(self.agent(&read(&self.guest))?, path)
    }

    fn make_dir(&self, path: &GuestPath) -> Result<bool, TierError> {
        files::make_dir(self.agent(&read(&self.guest))?, &self.caps, path)
    }

    fn rename(&self, from: &GuestPath, to: &GuestPath) -> Result<EntryInfo, TierError> {
        files::rename(self.agent(&read(&self.guest))?, &self.caps, from, to)
    }

    fn remove(&self, path: &GuestPath) -> Result<(), TierError> {
        files::remove(self.agent(&read(&self.guest))?, &self.caps, path)
    }

    fn watch(&self, path: &GuestPath, recursive: bool) -> Result<Watcher, TierError> {
        files::watch(self.agent(&read(&self.guest))?, path, recursive)
    }

    /// The agent connects to the guest's `127.0.0.1:port` and opens a stream to a host vsock port of this
    /// connection's own (the guest dials out, as for egress: a vsock device hands it to `<uds>_<port>`, where this
    /// listens for that one stream), then relays the two.
    fn connect_port(&self, port: u16) -> Result<strata_core::PortStream, TierError> {
        let guest = read(&self.guest);
        let client = self.agent(&guest)?;
        let host_port = port_stream_port();
        let socket = guest
            .host
            .as_ref()
            .and_then(|host| host.dial_socket(host_port))
            .ok_or_else(|| unsupported("ports on a guest without streams to the host"))?;
        let _ = std::fs::remove_file(&socket);
        let listener = std::os::unix::net::UnixListener::bind(&socket)
            .map_err(|err| internal_from("listening for a port's stream", err))?;
        let _remove = RemoveOnDrop(&socket);
        open_to_the_monitor(&socket)?;
        client.open_port(port, host_port).map_err(|err| match err {
            ClientError::Refused { message } if message.starts_with(strata_guest_proto::PORT_CLOSED) => {
                TierError::PortClosed { port, reason: message }
            }
            other => internal_from("opening a port in the guest", other),
        })?;
        // The agent answered once its stream was connected: it waits in the backlog.
        listener.set_nonblocking(true).map_err(|err| internal_from("accepting a port's stream", err))?;
        let deadline = Instant::now() + PORT_STREAM_WAIT;
        loop {
            match listener.accept() {
                Ok((stream, _)) => {
                    stream.set_nonblocking(false).map_err(|err| internal_from("a port's stream", err))?;
                    return Ok(strata_core::PortStream::Unix(stream));
                }
                Err(err) if err.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(err) => return Err(internal_from("accepting a port's stream", err)),
            }
        }
    }

    fn snapshot(&self, destination: &Path) -> Result<Snapshot, TierError> {
        let _turn = self.turn("a job; a snapshot is taken between jobs")?;
        let extra = self.snapshot_extra();
        let mut guest = write(&self.guest);
        self.agent(&guest)?.prepare_snapshot().map_err(|err| match err {
            ClientError::Refused { message } => TierError::Unsupported {
                tier: TierKind::Microvm,
                what: format!("a snapshot while the guest is busy ({message})"),
            },
            other => internal(format!("quiescing the guest agent: {other}")),
        })?;
        let parent = self.parent.clone();
        let host =
            guest.host.as_mut().ok_or_else(|| TierError::SessionEnded { reason: "the sandbox was closed".into() })?;
        host.snapshot(destination, parent, extra)
    }

    fn close(&self) -> Result<(), TierError> {
        self.end();
        Ok(())
    }
}

pub(crate) fn over_disk_limit(limits: &Limits) -> TierError {
    unsupported(&format!("grants holding more than the disk limit of {} bytes", limits.disk.0))
}

/// Checks every grant and walks its host tree; `None` when their files are over the disk limit.
pub(crate) fn scan_grants(caps: &Capabilities, limits: &Limits) -> Result<Option<Vec<HostTree>>, TierError> {
    let mut left = limits.disk.0;
    let mut trees = Vec::with_capacity(caps.grants.len());
    for grant in &caps.grants {
        let guest = GuestPath::new(&grant.guest)?;
        let reserved = |r: &&str| GuestPath::new(r).is_ok_and(|r| guest.is_within(&r));
        if guest.is_root() || RESERVED_GUEST_PATHS.iter().any(reserved) {
            return Err(TierError::GuestPath {
                path: grant.guest.clone(),
                reason: "is reserved in the microVM (/, /proc, /sys, /dev, /run/strata)".into(),
            });
        }
        let host = grant.host.canonicalize().map_err(|_| strata_core::CapsError::GrantNotFound(grant.host.clone()))?;
        match grants::scan(&host, left) {
            Ok(tree) => {
                left -= tree.bytes;
                trees.push(tree);
            }
            Err(GrantError::TooLarge { .. }) => return Ok(None),
            Err(err) => return Err(grant_error(err)),
        }
    }
    Ok(Some(trees))
}

/// Copies the read-write grants back after a job that exited with 0; the status that the job ends with.
fn copy_back(client: &AgentClient, caps: &Capabilities, limits: &Limits, status: Status) -> Result<Status, TierError> {
    let mut left = limits.disk.0;
    for grant in caps.grants.iter().filter(|g| g.mode == GrantMode::Rw) {
        let host =
            grant.host.canonicalize().map_err(|source| TierError::ReadInput { path: grant.host.clone(), source })?;
        match grants::copy_out(client, &grant.guest, &host, left) {
            Ok(copied) => left = left.saturating_sub(copied.bytes),
            Err(GrantError::TooLarge { .. } | GrantError::TooManyEntries { .. }) => {
                return Ok(Status::LimitExceeded { limit: LimitKind::Disk });
            }
            Err(err @ GrantError::Refused { .. }) => return Ok(Status::Crashed { message: err.to_string() }),
            Err(err) => return Err(grant_error(err)),
        }
    }
    Ok(status)
}

pub(crate) fn grant_error(err: GrantError) -> TierError {
    match err {
        GrantError::Host { path, source } => TierError::ReadInput { path, source },
        GrantError::NotEmpty { guest } => TierError::GuestPath {
            path: guest,
            reason: "a microVM grant needs a guest path that is absent or empty in the image".into(),
        },
        GrantError::Agent(err) => internal(err),
        other => TierError::Unsupported { tier: TierKind::Microvm, what: other.to_string() },
    }
}

/// An outcome for a job that never ran.
pub(crate) fn ended(status: Status, started: Instant) -> Outcome {
    Outcome { usage: Usage { wall: started.elapsed(), ..Usage::default() }, ..Outcome::new(TierKind::Microvm, status) }
}

/// A host file to write into the guest before the job: guest path and contents.
type Upload = (String, Vec<u8>);

/// A job translated for the agent: its argv, and a host file (program or script) to write into the guest first.
#[derive(Debug)]
pub(crate) struct PreparedJob {
    argv: Vec<String>,
    upload: Option<Upload>,
}

impl PreparedJob {
    /// Translates `job` ([`GuestCommand`]), reading its program or script from the host; refuses what this tier
    /// cannot run.
    pub(crate) fn new(job: &Job) -> Result<PreparedJob, TierError> {
        let GuestCommand { argv, copy_in } = GuestCommand::new(job, TierKind::Microvm)?;
        let upload = match copy_in {
            Some(mut copy) => {
                let mut bytes = Vec::with_capacity(usize::try_from(copy.size).unwrap_or(0));
                copy.file
                    .read_to_end(&mut bytes)
                    .map_err(|source| TierError::ReadInput { path: copy.guest.clone().into(), source })?;
                Some((copy.guest, bytes))
            }
            None => None,
        };
        Ok(PreparedJob { argv, upload })
    }
}

/// A terminal's size as the agent protocol has it.
fn tty_size(size: strata_core::WindowSize) -> strata_guest_proto::TtySize {
    strata_guest_proto::TtySize { rows: size.rows, cols: size.cols }
}

/// Detaches a job's terminal handle when the job is over (later sizes are only kept).
struct Detach<'a>(&'a strata_core::Terminal);

impl Drop for Detach<'_> {
    fn drop(&mut self) {
        self.0.detach();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grants_may_not_take_reserved_guest_paths() {
        let caps = |guest: &str| Capabilities {
            grants: vec![strata_core::Grant { host: "/".into(), guest: guest.into(), mode: GrantMode::Ro }],
            ..Capabilities::default()
        };
        for reserved in ["/", "/proc/x", "/dev", "/run/strata/bin"] {
            let err = scan_grants(&caps(reserved), &Limits::default()).expect_err(reserved);
            assert_eq!(err.code(), "guest_path", "{reserved}");
        }
    }

    #[test]
    fn snapshot_meta_names_secrets_without_their_values() {
        let caps = Capabilities {
            env: vec!["PLAIN=visible".parse().expect("env")],
            secrets: vec!["TOKEN=hunter2".parse().expect("secret")],
            ..Capabilities::default()
        };
        let extra = session_meta(&caps, &Limits::default(), "/root");
        let text = serde_json::to_string(&extra.meta).expect("json");
        assert!(!text.contains("hunter2"), "{text}");
        assert_eq!(extra.meta["secret_names"], json!(["TOKEN"]));
        assert_eq!(extra.meta["caps"]["env"][0]["value"], "visible");
        assert_eq!(extra.meta["caps"]["secrets"], json!([]));
        let back: Capabilities = serde_json::from_value(extra.meta["caps"].clone()).expect("caps read back");
        assert!(back.secrets.is_empty());
        assert!(extra.persists.contains(&Persisted::Processes) && extra.persists.contains(&Persisted::Filesystem));
    }
}
