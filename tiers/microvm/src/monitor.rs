//! The engine's side of a monitor process: the only microVM code that runs in the engine's process.
//!
//! [`Monitor::start`] runs the embedded `strata-vmm` binary (from a sealed memfd, made once per process) with the
//! control socket as its standard input and a pipe as its standard error, in a cgroup of its own (memory: the
//! guest's RAM plus [`MONITOR_OVERHEAD`]; pids; CPU: one per vCPU), and asks it to jail itself and build the
//! machine ([`strata_vmm::monitor`] says how). Each VM gets a directory of its own under the run directory:
//! `root/` (the monitor's root is mounted there, in its own mount namespace only) and `sock/` (its vsock sockets,
//! owned by the monitor's user, the only host directory it sees).
//!
//! Every request waits at most its deadline. A monitor that dies — killed by its seccomp filter, crashed, or out
//! of memory — closes the socket; the request fails with [`MonitorError::Crashed`], which carries how it ended
//! and what it wrote to standard error. Dropping a [`Monitor`] kills it (by pidfd), reaps its keeper, removes its
//! cgroup and its directory: nothing is left behind.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, ChildStderr, Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::fcntl::{FcntlArg, SealFlag, fcntl};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
use strata_tier_process::jail::{Cgroup, CgroupLimits, CgroupRoot};
use strata_vmm::proto::{self, JailSpec, MachineSpec, PROTOCOL_VERSION, Reply, Request, ThreadKind};
use strata_vmm::seccomp::SECCOMP_EXIT;

/// The monitor binary, built by `build.rs`.
const VMM_BINARY: &[u8] = include_bytes!(env!("STRATA_VMM_BINARY"));

/// Memory a monitor may use beyond its guest's RAM: its own code, heap, thread stacks, device buffers.
pub const MONITOR_OVERHEAD: u64 = 64 << 20;
/// Threads and processes a monitor may have: the keeper, the main thread, the spawner, a backend, and the vCPUs
/// (added per VM).
const MONITOR_PIDS: u64 = 8;
/// How long a monitor has to jail itself.
const JAIL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long building a machine may take (loading a kernel, copying a snapshot's memory).
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long any other request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// The first host user and group ID monitors run as (inside their user namespace they are root). Each monitor
/// of this process gets the next of 65,536 IDs: no host file belongs to them.
pub const MONITOR_ID_BASE: u32 = 0x5354_0000;
/// How many IDs monitors cycle through.
const MONITOR_IDS: u64 = 0x1_0000;
/// What standard error the engine keeps of a dead monitor.
const STDERR_KEPT: usize = 4096;

/// Why a monitor could not be started or did not answer.
#[derive(Debug, Clone, thiserror::Error)]
pub enum MonitorError {
    /// The monitor process, its cgroup or its directory could not be made.
    #[error("cannot start the monitor: {0}")]
    Spawn(String),
    /// The monitor refused or failed a request.
    #[error("the monitor failed at {stage}: {message}")]
    Failed {
        /// What it was doing.
        stage: String,
        /// Why.
        message: String,
    },
    /// The monitor is gone: killed, crashed, or it broke the protocol.
    #[error("the monitor crashed ({how}){}", if report.is_empty() { String::new() } else { format!(": {report}") })]
    Crashed {
        /// How it ended.
        how: String,
        /// What it wrote to standard error (its last 4 KiB).
        report: String,
        /// Whether a thread made a call outside its seccomp filter.
        seccomp: bool,
    },
    /// The monitor did not answer in time (it is killed).
    #[error("the monitor did not answer within {0:?}")]
    Timeout(Duration),
}

/// Where and how monitors run.
#[derive(Debug, Clone)]
pub struct MonitorConfig {
    /// A directory of Strata's own for the VMs' directories (created if missing).
    pub run_dir: PathBuf,
    /// Where the monitors' cgroups go; `None` runs them without one (a host without usable cgroups).
    pub cgroups: Option<CgroupRoot>,
}

impl MonitorConfig {
    /// The run directory, with cgroups where the host has them.
    pub fn new(run_dir: PathBuf) -> MonitorConfig {
        MonitorConfig { run_dir, cgroups: CgroupRoot::detect().ok() }
    }
}

/// How a guest's vCPUs ended, once it stopped on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stopped {
    /// Each vCPU's last exit.
    pub exits: Vec<String>,
}

/// A running monitor process and its machine.
#[derive(Debug)]
pub struct Monitor {
    ctl: OwnedFd,
    keeper: Option<Child>,
    stderr: Option<ChildStderr>,
    pid: i32,
    pidfd: Option<OwnedFd>,
    cgroup: Option<Cgroup>,
    dir: PathBuf,
    /// Set once the monitor is known to be gone.
    dead: Option<MonitorError>,
}

/// The embedded binary in a sealed memfd, made once per process.
fn binary() -> Result<&'static OwnedFd, MonitorError> {
    static BINARY: OnceLock<Result<OwnedFd, String>> = OnceLock::new();
    BINARY
        .get_or_init(|| {
            let fd = memfd_create("strata-vmm", MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)
                .map_err(|e| e.to_string())?;
            let mut file = File::from(fd);
            file.write_all(VMM_BINARY).map_err(|e| e.to_string())?;
            let seals =
                SealFlag::F_SEAL_SEAL | SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_WRITE;
            fcntl(&file, FcntlArg::F_ADD_SEALS(seals)).map_err(|e| e.to_string())?;
            Ok(OwnedFd::from(file))
        })
        .as_ref()
        .map_err(|e| MonitorError::Spawn(format!("embedded strata-vmm: {e}")))
}

fn unique() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl Monitor {
    /// Starts a monitor, jails it and has it build `spec` from `files` (`/dev/kvm` is opened here and goes
    /// first; `files` are the payload's and the disks', in the spec's order). `vcpus` sizes its cgroup, and
    /// `memory_bytes` (the guest's RAM) its memory limit.
    pub fn start(
        config: &MonitorConfig,
        spec: &MachineSpec,
        files: &[BorrowedFd<'_>],
        vcpus: u8,
        memory_bytes: u64,
    ) -> Result<Monitor, MonitorError> {
        let mut monitor = Monitor::jailed(config, vcpus, memory_bytes)?;
        let kvm = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/kvm")
            .map_err(|e| MonitorError::Spawn(format!("/dev/kvm: {e}")))?;
        let mut fds = vec![kvm.as_fd()];
        fds.extend_from_slice(files);
        match monitor.request(&Request::Start(spec.clone()), &fds, START_TIMEOUT)? {
            Reply::Started => Ok(monitor),
            other => Err(unexpected("start", other)),
        }
    }

    /// A monitor in its jail, before it has a machine.
    fn jailed(config: &MonitorConfig, vcpus: u8, memory_bytes: u64) -> Result<Monitor, MonitorError> {
        let binary = binary()?;
        let n = unique();
        let id = MONITOR_ID_BASE + (n % MONITOR_IDS) as u32;
        let dir = config.run_dir.join(format!("vm-{}-{n}", std::process::id()));
        let spawn = |what: &str| {
            let what = what.to_owned();
            move |e: std::io::Error| MonitorError::Spawn(format!("{what}: {e}"))
        };
        fs::DirBuilder::new().recursive(true).mode(0o700).create(&config.run_dir).map_err(spawn("run directory"))?;
        let root_dir = dir.join("root");
        let socket_dir = dir.join("sock");
        fs::DirBuilder::new().mode(0o755).create(&dir).map_err(spawn("VM directory"))?;
        let cleanup = |e| {
            let _ = fs::remove_dir_all(&dir);
            e
        };
        fs::DirBuilder::new().mode(0o755).create(&root_dir).map_err(spawn("root directory")).map_err(cleanup)?;
        fs::DirBuilder::new().mode(0o700).create(&socket_dir).map_err(spawn("socket directory")).map_err(cleanup)?;
        std::os::unix::fs::chown(&socket_dir, Some(id), Some(id))
            .map_err(spawn("socket directory"))
            .map_err(cleanup)?;
        // The run directory is only ours (0700); the VM's own is traversable so the monitor's user can reach
        // `sock/` while the engine binds it.
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o711)).map_err(spawn("VM directory")).map_err(cleanup)?;
        let limits = CgroupLimits {
            memory: memory_bytes.saturating_add(MONITOR_OVERHEAD),
            pids: MONITOR_PIDS + u64::from(vcpus),
            cpus: u32::from(vcpus.max(1)),
        };
        let cgroup = match &config.cgroups {
            Some(root) => Some(root.create(&limits).map_err(|e| cleanup(MonitorError::Spawn(format!("cgroup: {e}"))))?),
            None => None,
        };
        let (ctl, monitor_end) = socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)
            .map_err(|e| MonitorError::Spawn(format!("control socket: {e}")))?;
        let mut command = Command::new(format!("/proc/self/fd/{}", binary.as_raw_fd()));
        command
            .arg0("strata-vmm")
            .env_clear()
            .stdin(Stdio::from(monitor_end))
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let keeper = command.spawn();
        drop(command);
        let mut keeper = match keeper {
            Ok(child) => child,
            Err(e) => {
                if let Some(cgroup) = &cgroup {
                    cgroup.remove();
                }
                return Err(cleanup(MonitorError::Spawn(format!("strata-vmm: {e}"))));
            }
        };
        let stderr = keeper.stderr.take();
        if let Some(stderr) = &stderr {
            let _ = nix::fcntl::fcntl(stderr, FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK));
        }
        let mut monitor = Monitor { ctl, keeper: Some(keeper), stderr, pid: 0, pidfd: None, cgroup, dir, dead: None };
        let spec = JailSpec {
            version: PROTOCOL_VERSION,
            join_cgroup: monitor.cgroup.as_ref().map(Cgroup::self_join_files).unwrap_or_default(),
            root_dir,
            socket_dir,
            uid: id,
            gid: id,
        };
        proto::send(monitor.ctl.as_fd(), &Request::Jail(spec), &[]).map_err(|e| monitor.died(&e.to_string()))?;
        match monitor.receive(JAIL_TIMEOUT)? {
            Reply::Jailed { host_pid } if host_pid > 0 => {
                monitor.pid = host_pid;
                let pidfd =
                    pidfd_open(host_pid).map_err(|e| MonitorError::Spawn(format!("pidfd of the monitor: {e}")))?;
                monitor.pidfd = Some(pidfd);
            }
            other => return Err(unexpected("jail", other)),
        }
        match monitor.receive(JAIL_TIMEOUT)? {
            Reply::Ready => Ok(monitor),
            other => Err(unexpected("jail", other)),
        }
    }

    /// The monitor's process ID, as the host sees it.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// The host directory of the VM's sockets (what the monitor sees as `/run`).
    pub fn socket_dir(&self) -> PathBuf {
        self.dir.join("sock")
    }

    /// The monitor's cgroup, when it has one.
    pub fn cgroup(&self) -> Option<&Cgroup> {
        self.cgroup.as_ref()
    }

    /// `None` while the guest runs; how its vCPUs ended once it stopped on its own.
    pub fn status(&mut self) -> Result<Option<Stopped>, MonitorError> {
        match self.request(&Request::Status, &[], REQUEST_TIMEOUT)? {
            Reply::Status { stopped: false, .. } => Ok(None),
            Reply::Status { stopped: true, exits } => Ok(Some(Stopped { exits })),
            other => Err(unexpected("status", other)),
        }
    }

    /// The console's log and how many bytes no longer fit in it.
    pub fn console(&mut self) -> Result<(String, u64), MonitorError> {
        match self.request(&Request::Console, &[], REQUEST_TIMEOUT)? {
            Reply::Console { text, dropped } => Ok((text, dropped)),
            other => Err(unexpected("console", other)),
        }
    }

    /// Pauses the guest at a safe point, has the monitor write its state into `state` and its memory (sparse)
    /// into `memory`, both empty files, and resumes it. Returns the state's length.
    pub fn snapshot(&mut self, state: &File, memory: &File) -> Result<u64, MonitorError> {
        match self.request(&Request::Snapshot, &[state.as_fd(), memory.as_fd()], REQUEST_TIMEOUT)? {
            Reply::Saved { state_bytes } => Ok(state_bytes),
            other => Err(unexpected("snapshot", other)),
        }
    }

    /// Asks `thread` to make a call outside its filter (tests: the monitor must die of it).
    pub fn probe(&mut self, thread: ThreadKind) -> Result<(), MonitorError> {
        match self.request(&Request::Probe(thread), &[], REQUEST_TIMEOUT)? {
            Reply::Done => Ok(()),
            other => Err(unexpected("probe", other)),
        }
    }

    /// Stops the vCPUs and ends the monitor (as dropping it does, but asking first).
    pub fn stop(mut self) {
        if self.dead.is_none() {
            let _ = self.request(&Request::Stop, &[], Duration::from_secs(5));
        }
    }

    /// Whether the monitor process has ended.
    pub fn has_ended(&mut self) -> bool {
        if self.dead.is_some() {
            return true;
        }
        match self.keeper.as_mut().map(Child::try_wait) {
            Some(Ok(Some(_))) | None => true,
            Some(Ok(None)) => false,
            Some(Err(_)) => true,
        }
    }

    fn request(&mut self, request: &Request, fds: &[BorrowedFd<'_>], timeout: Duration) -> Result<Reply, MonitorError> {
        if let Some(dead) = &self.dead {
            return Err(dead.clone());
        }
        if let Err(e) = proto::send(self.ctl.as_fd(), request, fds) {
            return Err(self.died(&e.to_string()));
        }
        self.receive(timeout)
    }

    fn receive(&mut self, timeout: Duration) -> Result<Reply, MonitorError> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut fds = [PollFd::new(self.ctl.as_fd(), PollFlags::POLLIN)];
            let wait = PollTimeout::try_from(left.as_millis().min(i32::MAX as u128) as i32).unwrap_or(PollTimeout::MAX);
            match poll(&mut fds, wait) {
                Ok(0) => {
                    self.kill();
                    let err = MonitorError::Timeout(timeout);
                    self.dead = Some(err.clone());
                    return Err(err);
                }
                Ok(_) => break,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(self.died(&e.to_string())),
            }
        }
        match proto::recv::<Reply>(self.ctl.as_fd()) {
            Ok(Some((Reply::Failed { stage, message }, _))) => Err(MonitorError::Failed { stage, message }),
            Ok(Some((reply, _))) => Ok(reply),
            Ok(None) => Err(self.died("the control socket closed")),
            Err(e) => Err(self.died(&e.to_string())),
        }
    }

    /// The monitor is gone (or broke the protocol): kill it for sure, reap the keeper, keep its last words.
    fn died(&mut self, why: &str) -> MonitorError {
        self.kill();
        let status = self.keeper.as_mut().and_then(|k| k.wait().ok());
        let code = status.and_then(|s| s.code());
        let how = match code {
            Some(SECCOMP_EXIT) => "a thread made a system call outside its seccomp filter".to_owned(),
            Some(code) if code > 128 => format!("killed by signal {}", code - 128),
            Some(code) => format!("exit status {code}"),
            None => match status {
                Some(s) => format!("{s}"),
                None => why.to_owned(),
            },
        };
        let report = self.stderr_tail();
        let err = MonitorError::Crashed { how, report, seccomp: code == Some(SECCOMP_EXIT) };
        self.dead = Some(err.clone());
        err
    }

    fn stderr_tail(&mut self) -> String {
        let mut text = Vec::new();
        if let Some(stderr) = self.stderr.as_mut() {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stderr.read(&mut buf) {
                if n == 0 {
                    break;
                }
                text.extend_from_slice(&buf[..n]);
                if text.len() > 4 * STDERR_KEPT {
                    text.drain(..text.len() - STDERR_KEPT);
                }
            }
        }
        let start = text.len().saturating_sub(STDERR_KEPT);
        String::from_utf8_lossy(&text[start..]).trim().to_owned()
    }

    fn kill(&mut self) {
        if let Some(pidfd) = &self.pidfd {
            // SAFETY: pidfd_send_signal(2) on our own pidfd with a plain signal number and no siginfo.
            unsafe { libc::syscall(libc::SYS_pidfd_send_signal, pidfd.as_raw_fd(), libc::SIGKILL, 0usize, 0u32) };
        } else if let Some(keeper) = self.keeper.as_mut() {
            // Before the monitor's PID is known, killing the keeper kills the monitor too (its death signal).
            let _ = keeper.kill();
        }
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.kill();
        if let Some(mut keeper) = self.keeper.take() {
            let _ = keeper.wait();
        }
        if let Some(cgroup) = self.cgroup.take() {
            cgroup.kill_all();
            cgroup.remove();
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Removes the VM directories (`vm-<pid>-<n>`) that engines no longer running left in `run_dir` (an engine that
/// was killed: its monitors ended when their control sockets closed, their directories stayed). Returns how many.
pub fn remove_stale(run_dir: &std::path::Path) -> usize {
    let Ok(entries) = fs::read_dir(run_dir) else { return 0 };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix("vm-")).and_then(|n| n.split('-').next()) else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else { continue };
        if pid == std::process::id() || std::path::Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        if fs::remove_dir_all(entry.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

fn pidfd_open(pid: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open(2) with a PID and no flags; the result is checked before it is owned.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0u32) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this new descriptor; nothing else owns it.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) })
}

fn unexpected(stage: &str, reply: Reply) -> MonitorError {
    MonitorError::Failed { stage: stage.into(), message: format!("unexpected reply {reply:?}") }
}
