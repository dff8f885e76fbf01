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
//! Files ([`Session::write_file`], [`Session::read_file`]) follow the process tier's guest-path rules: an absolute
//! path without `.`/`..` components or NUL, anywhere in the guest but its kernel filesystems (`/proc`, `/sys`,
//! `/dev`); writing inside a read-only grant is refused. A file written inside a read-write grant reaches the host
//! with the next copy-back, like anything a job writes there.
//!
//! **Network egress** (DESIGN §3: no NIC; the agent's forwarder tunnels over vsock). With [`Net::Allow`] the
//! session starts a host egress proxy ([`strata_egress`]) with the allowlist, listening on the Unix socket where
//! the guest's streams to vsock port [`EGRESS_PORT`] arrive ([`AgentHost::egress_path`]: the vsock device
//! connects each guest stream to `<uds>_1028`, so the device's muxer is the host relay and the proxy serves the
//! streams directly), then asks the agent to start its forwarder ([`AgentClient::start_egress`]) on the guest's
//! `127.0.0.1:3128`, which opens one vsock stream per accepted connection. Jobs get `HTTP_PROXY`, `HTTPS_PROXY`,
//! `http_proxy`, `https_proxy` = `http://127.0.0.1:3128` and `NO_PROXY`, `no_proxy` as [`strata_egress::proxy_env`]
//! sets them (the capabilities' own variables may override them); each job's proxy records (drained when it ends, after its last connections
//! close) are its Outcome's `egress`. Both ends cap the tunnels at [`DEFAULT_EGRESS_CONNECTIONS`] (the agent and
//! the proxy each answer `503` beyond it), so a guest that opens vsock streams itself gains nothing; the proxy
//! judges every request whoever sent it. With [`Net::Deny`] nothing listens on either side. The proxy stops when
//! the session ends (its thread joined, its socket removed).
//!
//! A snapshot ([`Session::snapshot`]) asks the agent to quiesce (refused while an exec runs; it syncs the guest's
//! filesystems), then the host saves the whole guest ([`AgentHost::snapshot`]) with the session's description in
//! the manifest's meta: the capabilities with secrets by name only (`secret_names`; their values are never
//! written by Strata), the limits and where jobs start. Secret values a job had in its environment may still be
//! in the guest's memory, which the snapshot holds whole: a microVM snapshot is as sensitive as the sandbox.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use strata_core::{
    Capabilities, ExecOptions, GrantMode, Job, LimitKind, Limits, Net, Outcome, OutputSink, Persisted, Pumped,
    PythonSource, Sandbox, Snapshot, Status, Stream, TierError, TierKind, Truncated, Usage,
};
use strata_egress::{Allowlist, EgressConfig, EgressHandle, EgressProxy};
use strata_guest_proto::{
    AgentClient, ClientError, DEFAULT_EGRESS_CONNECTIONS, EGRESS_PORT, ExecEvent, ExecLimits, ExecRequest, ExitStatus,
    MAX_CHUNK, OutputStream,
};
use strata_wasi_shims::OutputCapture;

use crate::grants::{self, GrantError, HostTree};
use crate::snapshot::SnapshotExtra;

/// Where host programs and scripts are written in the guest.
pub const PROGRAM_DIR: &str = "/run/strata";

/// Where jobs start in a microVM.
pub const DEFAULT_WORKDIR: &str = "/root";

/// The environment every job starts from.
const BASE_ENV: &[(&str, &str)] =
    &[("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"), ("HOME", "/root"), ("LANG", "C.UTF-8")];

/// Guest paths a grant may not take: the guest's kernel filesystems and where Strata puts programs.
const RESERVED_GUEST_PATHS: &[&str] = &["/proc", "/sys", "/dev", PROGRAM_DIR];

/// Guest paths `write_file` and `read_file` may not touch: the guest's kernel filesystems.
const KERNEL_PATHS: &[&str] = &["/proc", "/sys", "/dev"];

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

/// The allowlist of `net`: `None` for [`Net::Deny`]; a malformed entry is a `wrong_format` error.
pub fn egress_allowlist(net: &Net) -> Result<Option<Allowlist>, TierError> {
    let Net::Allow(specs) = net else { return Ok(None) };
    Ok(Some(Allowlist::parse(specs)?))
}

/// Where a session's agent lives: a booted microVM, or a host process serving the agent over a Unix socket (tests).
/// The session drives the agent; the host only owns the guest's life.
pub trait AgentHost: Send {
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

pub(crate) fn unsupported(what: &str) -> TierError {
    TierError::Unsupported { tier: TierKind::Microvm, what: what.to_owned() }
}

pub(crate) fn internal(message: impl std::fmt::Display) -> TierError {
    TierError::Internal { tier: TierKind::Microvm, message: message.to_string() }
}

/// A guest running jobs in turn through its agent. Dropping it powers the guest off, as [`Sandbox::close`] does.
#[derive(Debug)]
pub struct Session<H: AgentHost> {
    host: Option<H>,
    client: Option<AgentClient>,
    caps: Capabilities,
    limits: Limits,
    parent: Option<String>,
    /// Why the session can run nothing more.
    ended: Option<String>,
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
        let session = Session::resumed(host, client, caps, limits, None)?;
        for (grant, tree) in caps.grants.iter().zip(trees) {
            grants::copy_in(session.agent()?, tree, &grant.guest).map_err(grant_error)?;
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
        let mut session = Session {
            host: Some(host),
            client: Some(client),
            caps: caps.clone(),
            limits: limits.clone(),
            parent,
            ended: None,
            egress: None,
        };
        session.start_egress()?;
        Ok(session)
    }

    /// With [`Net::Allow`]: the host egress proxy on the guest's egress socket, then the agent's forwarder.
    fn start_egress(&mut self) -> Result<(), TierError> {
        let Some(allowlist) = egress_allowlist(&self.caps.net)? else { return Ok(()) };
        let path = self
            .host
            .as_ref()
            .and_then(AgentHost::egress_path)
            .ok_or_else(|| unsupported("network egress on a guest without an egress tunnel"))?;
        let config = EgressConfig::new(allowlist)
            .with_unix_socket(&path.socket)
            .with_max_connections(DEFAULT_EGRESS_CONNECTIONS as usize);
        let proxy = EgressProxy::start(config)
            .map_err(|err| internal(format!("egress proxy: {}", strata_guest_proto::error_chain(&err))))?;
        self.agent()?
            .start_egress(path.listen_port, EGRESS_PORT, DEFAULT_EGRESS_CONNECTIONS)
            .map_err(|err| internal(format!("starting the guest's egress forwarder: {err}")))?;
        self.egress = Some((proxy, path.listen_port));
        Ok(())
    }

    /// The session's egress proxy, with network.
    pub fn egress_proxy(&self) -> Option<&EgressHandle> {
        self.egress.as_ref().map(|(proxy, _)| proxy)
    }

    /// The id of the snapshot this session was forked from, if it was.
    pub fn parent(&self) -> Option<&str> {
        self.parent.as_deref()
    }

    /// The capabilities the session runs with.
    pub fn caps(&self) -> &Capabilities {
        &self.caps
    }

    /// The host side of the guest.
    pub fn host(&self) -> Option<&H> {
        self.host.as_ref()
    }

    fn agent(&self) -> Result<&AgentClient, TierError> {
        if let Some(reason) = &self.ended {
            return Err(TierError::SessionEnded { reason: reason.clone() });
        }
        match (&self.client, &self.host) {
            (Some(client), Some(host)) if !host.has_stopped() => Ok(client),
            (Some(_), Some(_)) => Err(TierError::SessionEnded { reason: "the guest stopped".into() }),
            _ => Err(TierError::SessionEnded { reason: "the sandbox was closed".into() }),
        }
    }

    /// Runs one job in the guest; `started` is when its wall time began (a one-shot job's boot counts).
    pub fn exec_job(&mut self, job: &Job, opts: &ExecOptions, started: Instant) -> Result<Outcome, TierError> {
        let prepared = PreparedJob::new(job)?;
        self.exec_prepared(prepared, opts, started)
    }

    /// [`Session::exec_job`] of a job already translated (before the guest was even started).
    pub(crate) fn exec_prepared(
        &mut self,
        prepared: PreparedJob,
        opts: &ExecOptions,
        started: Instant,
    ) -> Result<Outcome, TierError> {
        let limits = opts.limits.clone().unwrap_or_else(|| self.limits.clone());
        let PreparedJob { argv, upload } = prepared;
        let client = self.agent()?;
        if let Some((path, bytes)) = &upload {
            client.write_file(path, 0o755, bytes).map_err(internal)?;
        }
        let caps = &self.caps;
        let secrets = caps.secret_values();
        let sink: Option<Arc<dyn OutputSink>> = opts.sink.clone();
        let stdout = OutputCapture::new(Stream::Stdout, limits.output.0, secrets.clone(), sink.clone());
        let stderr = OutputCapture::new(Stream::Stderr, limits.output.0, secrets, sink);
        let mut env: Vec<(String, String)> = BASE_ENV.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        if let (Some((_, port)), Some(allow)) = (&self.egress, egress_allowlist(&caps.net)?) {
            env.extend(strata_egress::proxy_env(&format!("http://127.0.0.1:{port}"), &allow));
        }
        for var in caps.guest_env() {
            env.retain(|(k, _)| *k != var.name);
            env.push((var.name.clone(), var.value.clone()));
        }
        let stdin = opts.stdin.as_deref().unwrap_or(&caps.stdin);
        let stream = opts.stdin_stream.as_ref();
        let workdir = self.host.as_ref().map_or(DEFAULT_WORKDIR, AgentHost::workdir).to_owned();
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
        };
        let mut handle = client.start(&request).map_err(|err| match err {
            ClientError::ExecFailed { errno, message } if errno == libc::ENOENT => {
                TierError::ProgramNotFound { program: message }
            }
            ClientError::ExecFailed { message, .. } => TierError::ExecFailed { message },
            other => internal(other),
        })?;
        let control = handle.control();
        // A stream goes to the agent chunk by chunk as it arrives (the agent queues it for the job), and stops being
        // read when the job ends: the pump is stopped with this function's return.
        let _pump = match stream {
            Some(stream) => {
                let control = control.clone();
                let pump = stream.pump(MAX_CHUNK, move |pumped| match pumped {
                    Pumped::Data(data) => control.write_stdin(data).is_ok(),
                    Pumped::End | Pumped::Failed(_) => {
                        let _ = control.close_stdin();
                        false
                    }
                });
                Some(pump.map_err(|source| TierError::ReadInput { path: "stdin stream".into(), source })?)
            }
            None => {
                if !stdin.is_empty() {
                    control.write_stdin(stdin).map_err(internal)?;
                    control.close_stdin().map_err(internal)?;
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
                    if self.host.as_ref().is_some_and(AgentHost::has_stopped) {
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
                let console = self.host.as_ref().map(AgentHost::console_tail).unwrap_or_default();
                let reason = format!("the guest agent was lost during a job ({err})");
                self.ended = Some(reason.clone());
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
            copy_back(self.agent()?, &self.caps, &limits, status)?
        } else {
            status
        };
        let (out, err) = (stdout.finish(), stderr.finish());
        let cap = limits.output.0;
        let (egress, egress_dropped) = match &self.egress {
            Some((proxy, _)) => proxy.drain_records_settled(EGRESS_SETTLE).into_entries(),
            None => (Vec::new(), 0),
        };
        Ok(Outcome {
            tier: TierKind::Microvm,
            status,
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
            escalations: Vec::new(),
            tools: Vec::new(),
            route: None,
            egress,
        })
    }

    /// What a snapshot's manifest says about the session: capabilities (secrets by name only), limits, workdir.
    pub fn snapshot_extra(&self) -> SnapshotExtra {
        session_meta(&self.caps, &self.limits, self.host.as_ref().map_or(DEFAULT_WORKDIR, AgentHost::workdir))
    }

    /// Powers the guest off and releases it; idempotent.
    fn end(&mut self) {
        if let Some(client) = self.client.take() {
            let _ = client.power_off();
        }
        if let Some(host) = self.host.take() {
            host.shut_down();
        }
        // After the guest: nothing can reach the proxy any more.
        self.egress = None;
        self.ended.get_or_insert_with(|| "the sandbox was closed".into());
    }
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

    fn exec(&mut self, job: &Job, opts: ExecOptions) -> Result<Outcome, TierError> {
        self.exec_job(job, &opts, Instant::now())
    }

    fn write_file(&mut self, guest_path: &str, contents: &[u8]) -> Result<(), TierError> {
        let path = guest_path_checked(guest_path)?;
        if let Some(grant) = self.caps.grants.iter().find(|g| g.mode == GrantMode::Ro && is_within(path, &g.guest)) {
            return Err(TierError::GuestPath {
                path: path.to_owned(),
                reason: format!("is inside the read-only grant {}", grant.guest),
            });
        }
        self.agent()?.write_file(path, 0o644, contents).map_err(|err| file_error(path, err))
    }

    fn read_file(&mut self, guest_path: &str) -> Result<Vec<u8>, TierError> {
        let path = guest_path_checked(guest_path)?;
        self.agent()?.read_file(path, MAX_READ).map_err(|err| file_error(path, err))
    }

    fn snapshot(&mut self, destination: &Path) -> Result<Snapshot, TierError> {
        self.agent()?.prepare_snapshot().map_err(|err| match err {
            ClientError::Refused { message } => TierError::Unsupported {
                tier: TierKind::Microvm,
                what: format!("a snapshot while the guest is busy ({message})"),
            },
            other => internal(format!("quiescing the guest agent: {other}")),
        })?;
        let extra = self.snapshot_extra();
        let parent = self.parent.clone();
        let host =
            self.host.as_mut().ok_or_else(|| TierError::SessionEnded { reason: "the sandbox was closed".into() })?;
        host.snapshot(destination, parent, extra)
    }

    fn close(mut self: Box<Self>) -> Result<(), TierError> {
        self.end();
        Ok(())
    }
}

/// `path` lies at or below the directory `dir`.
fn is_within(path: &str, dir: &str) -> bool {
    let dir = dir.trim_end_matches('/');
    dir.is_empty() || path == dir || path.strip_prefix(dir).is_some_and(|rest| rest.starts_with('/'))
}

/// The process tier's rules for a guest path handed to `write_file`/`read_file`, and not in a kernel filesystem.
fn guest_path_checked(path: &str) -> Result<&str, TierError> {
    let bad = |reason: &str| TierError::GuestPath { path: path.to_owned(), reason: reason.to_owned() };
    if !path.starts_with('/') || path.contains('\0') || path.split('/').any(|c| c == ".." || c == ".") {
        return Err(bad("must be absolute, without `.` or `..`"));
    }
    if path.trim_end_matches('/').is_empty() {
        return Err(bad("is the root directory"));
    }
    if KERNEL_PATHS.iter().any(|k| is_within(path, k)) {
        return Err(bad("is in the guest's kernel filesystems (/proc, /sys, /dev)"));
    }
    Ok(path)
}

fn file_error(path: &str, err: ClientError) -> TierError {
    match err {
        ClientError::File { message, .. } => TierError::GuestPath { path: path.to_owned(), reason: message },
        ClientError::Disconnected | ClientError::Frame(_) => {
            TierError::SessionEnded { reason: format!("the guest agent was lost ({err})") }
        }
        other => internal(other),
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
        let reserved = |r: &&str| is_within(&grant.guest, r);
        if grant.guest.trim_end_matches('/').is_empty() || RESERVED_GUEST_PATHS.iter().any(reserved) {
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
    Outcome {
        tier: TierKind::Microvm,
        status,
        stdout: Vec::new(),
        stderr: Vec::new(),
        truncated: Truncated::default(),
        usage: Usage { wall: started.elapsed(), ..Usage::default() },
        escalations: Vec::new(),
        tools: Vec::new(),
        route: None,
        egress: Vec::new(),
    }
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
    /// Translates `job`, reading its program or script from the host; refuses what this tier cannot run.
    pub(crate) fn new(job: &Job) -> Result<PreparedJob, TierError> {
        let (argv, upload) = translate(job)?;
        Ok(PreparedJob { argv, upload })
    }
}

/// The job's argv, and a host file to write into the guest first.
fn translate(job: &Job) -> Result<(Vec<String>, Option<Upload>), TierError> {
    let upload = |path: &std::path::Path, dir: &str| -> Result<Upload, TierError> {
        let bytes = std::fs::read(path).map_err(|source| TierError::ReadInput { path: path.to_owned(), source })?;
        let name = path.file_name().map(|n| n.to_string_lossy().replace('/', "_")).unwrap_or_else(|| "program".into());
        Ok((format!("{PROGRAM_DIR}/{dir}/{name}"), bytes))
    };
    match job {
        Job::Command { argv } if argv.first().is_some_and(|a| !a.is_empty()) => Ok((argv.clone(), None)),
        Job::Command { .. } => Err(TierError::WrongFormat { what: "the command".into(), expected: "a non-empty argv" }),
        Job::Native { program, args } => {
            let (path, bytes) = upload(program, "bin")?;
            let mut argv = vec![path.clone()];
            argv.extend(args.iter().cloned());
            Ok((argv, Some((path, bytes))))
        }
        Job::Python { source, args } => {
            let mut argv = vec!["python3".to_owned()];
            let mut file = None;
            match source {
                PythonSource::Code(code) => argv.extend(["-c".to_owned(), code.clone()]),
                PythonSource::Module(module) => argv.extend(["-m".to_owned(), module.clone()]),
                PythonSource::File(path) => {
                    let (guest, bytes) = upload(path, "scripts")?;
                    argv.push(guest.clone());
                    file = Some((guest, bytes));
                }
            }
            argv.extend(args.iter().cloned());
            Ok((argv, file))
        }
        Job::Wasm { .. } => Err(TierError::WrongJob { tier: TierKind::Microvm, job: job.kind() }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_paths_follow_the_process_tiers_rules() {
        for bad in ["relative", "/a/../b", "/a/./b", "/", "/proc/self/mem", "/dev/sda", "/sys", "/a\0b"] {
            assert_eq!(guest_path_checked(bad).expect_err(bad).code(), "guest_path", "{bad}");
        }
        for good in ["/tmp/x", "/root/notes/a.txt", "/procfs/x", "/devices"] {
            assert_eq!(guest_path_checked(good).expect(good), good);
        }
    }

    #[test]
    fn within_is_by_component() {
        assert!(is_within("/data/x", "/data"));
        assert!(is_within("/data", "/data/"));
        assert!(!is_within("/database", "/data"));
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
