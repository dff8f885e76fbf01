//! The jail, seen from the host: a small API to start one, run jobs in it and end it.
//!
//! ```text
//! Jail::start(&cgroups, &JailConfig)  → spawns the embedded `strata-jail` (keeper), puts it in a fresh cgroup,
//!                                        sends Setup, waits for Ready (namespaces, overlay, pivot_root done)
//! jail.exec(&Exec, program, &JobIo, &JobWatch, &CgroupLimits)
//!                                       → one job: pipes for stdio, limits watched from here (a session's jobs
//!                                         in a cgroup of their own, JobsCgroup)
//! jail.lanes()                          → more connections, for jobs and file calls at the same time
//! jail.write_file / read_file           → files inside the jail, through PID 1
//! jail.file_request / watch             → listings, stat, mkdir, rename, remove, inotify watches, by PID 1
//! lanes.start_service / service_status / stop_service
//!                                       → the jail's one supervised service, run by PID 1 (jail::service)
//! drop(jail)                            → PID 1 killed (the kernel kills its whole PID namespace), keeper
//!                                         reaped, cgroup removed; mounts die with the mount namespace
//! ```
//!
//! Nothing here depends on what runs in the jail: the process tier runs jobs in it, and the microVM monitor can
//! run inside one as Firecracker's jailer does.

pub mod cgroup;
mod files;
mod lane;
mod service;
mod tty;

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{FcntlArg, OFlag, SealFlag, fcntl};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::signal::Signal;
use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
use nix::unistd::Pid;
use strata_core::OutputCapture;
use strata_core::{CancelToken, LimitKind};
use strata_egress::{Drained, EgressHandle};
use strata_jail::proto::{self, Bind, Exec, HostFrame, IdMap, JailFrame, PROTOCOL_VERSION, Setup};
use strata_jail::sys::{pidfd_open, signal_pidfd};

pub use cgroup::{Cgroup, CgroupError, CgroupLimits, CgroupRoot, CgroupVersion};
pub use files::{FileAnswer, JailWatch};
pub use lane::Lanes;
pub use service::{SERVICE_CGROUP, STOP_MARGIN};

/// The `strata-jail` binary, built by this crate's build script.
static JAIL_BINARY: &[u8] = include_bytes!(env!("STRATA_JAIL_BINARY"));

/// How long a jail may take to build itself before it is given up.
const SETUP_TIMEOUT: Duration = Duration::from_secs(30);

/// How often a running job's CPU time, OOM and pids counters are read.
const WATCH_INTERVAL: Duration = Duration::from_millis(10);

/// The memory a session must be able to free after a job was killed for memory, or no job could run in it
/// again: enough for a shell and `rm`.
const MEMORY_HEADROOM: u64 = 8 << 20;

/// Why a session is ended after a memory kill (see [`Cgroup::can_make_room`]).
const JAMMED: &str = "a jail was ended after a memory kill: what its jobs left in it (files of its tmpfs, their \
                      inodes, shared memory) fills its memory limit, so that no job could run there again";

/// How long to wait for a killed jail's pipes to close before giving up on the rest of its output.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// What a jail is built from.
#[derive(Debug, Clone)]
pub struct JailConfig {
    /// The image's read-only layers, the top one first.
    pub lowers: Vec<PathBuf>,
    /// An existing empty host directory; the jail mounts its private tmpfs over it in its own namespace.
    pub scratch_mount: PathBuf,
    /// Size of the jail's writable layer.
    pub scratch_bytes: u64,
    /// Host directories bind-mounted into the jail.
    pub binds: Vec<Bind>,
    /// The jail's hostname.
    pub hostname: String,
    /// The jail ends when its first job does.
    pub one_shot: bool,
    /// Its cgroup's limits.
    pub limits: CgroupLimits,
    /// Jobs run in a user namespace with this mapping (the image and grants mounted idmapped through it);
    /// `None` runs them as host root with every capability dropped.
    pub id_map: Option<IdMap>,
    /// A [`strata_jail::tree`] file the upper layer starts from (a fork of a snapshot: the file as the snapshot
    /// was verified with, already open); `None` starts it empty.
    pub restore_upper: Option<std::sync::Arc<File>>,
    /// The host egress proxy's Unix socket, bound into the jail with a forwarder on its `127.0.0.1:3128`
    /// ([`strata_jail::forward`]); `None`: loopback only.
    pub egress_socket: Option<PathBuf>,
    /// The jail holds a zygote and forks it ([`Jail::start_zygote`], [`Jail::fork`]).
    pub zygote: bool,
    /// The jail's account that owns what the file calls create (needs `id_map`); the jail's root when `None`.
    pub files_owner: Option<String>,
}

impl JailConfig {
    /// Whether a jail built from `self` is the jail `other` describes: every field equal, and neither starting
    /// from a snapshot's upper layer nor behind an egress proxy (those belong to one jail alone).
    pub fn same_jail(&self, other: &JailConfig) -> bool {
        // Destructured, so that a new field cannot be forgotten here.
        let JailConfig {
            lowers,
            scratch_mount,
            scratch_bytes,
            binds,
            hostname,
            one_shot,
            limits,
            id_map,
            restore_upper,
            egress_socket,
            zygote,
            files_owner,
        } = self;
        restore_upper.is_none()
            && other.restore_upper.is_none()
            && egress_socket.is_none()
            && other.egress_socket.is_none()
            && *lowers == other.lowers
            && *scratch_mount == other.scratch_mount
            && *scratch_bytes == other.scratch_bytes
            && *binds == other.binds
            && *hostname == other.hostname
            && *one_shot == other.one_shot
            && *limits == other.limits
            && *id_map == other.id_map
            && *zygote == other.zygote
            && *files_owner == other.files_owner
    }
}

/// Why a jail could not be started or used.
#[derive(Debug, thiserror::Error)]
pub enum JailError {
    /// The jail process could not be spawned.
    #[error("cannot start the jail: {0}")]
    Spawn(#[source] std::io::Error),
    /// Its cgroup could not be set up.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// A step of building the jail failed inside it.
    #[error("jail setup failed at {stage}: {message}")]
    Setup {
        /// Which step.
        stage: String,
        /// The error.
        message: String,
    },
    /// The jail broke the control protocol or went away.
    #[error("jail control: {0}")]
    Protocol(String),
    /// The jail has ended (a one-shot jail after its job, or a killed one).
    #[error("the jail has ended")]
    Ended,
    /// The job's program could not be started.
    #[error("{message}")]
    NotStarted {
        /// Which step (`lookup`, `copy`, `exec`, ...).
        stage: String,
        /// The OS error number.
        errno: i32,
        /// The error.
        message: String,
    },
    /// The zygote could not be held (it was killed).
    #[error("the zygote was refused: {0}")]
    ZygoteRefused(String),
    /// A fork of the zygote could not be made.
    #[error("forking the zygote failed at {stage}: {message}")]
    Fork {
        /// Which step.
        stage: String,
        /// The error.
        message: String,
    },
    /// A file operation in the jail failed.
    #[error("{message}")]
    File {
        /// The OS error number.
        errno: i32,
        /// The error.
        message: String,
    },
    /// A listing had more entries than asked for (or more bytes than the jail sends in one).
    #[error("the listing has more than {limit} entries")]
    ListTooLarge {
        /// The most entries it was to have.
        limit: u32,
    },
}

impl From<proto::ProtoError> for JailError {
    fn from(err: proto::ProtoError) -> Self {
        JailError::Protocol(err.to_string())
    }
}

/// A job's standard streams.
#[derive(Debug)]
pub struct JobIo<'a> {
    /// Bytes fed to stdin, which is then closed (unless `stdin_stream` is given).
    pub stdin: &'a [u8],
    /// A readable descriptor that is the job's stdin itself (a pipe its caller writes while the job runs).
    pub stdin_stream: Option<BorrowedFd<'a>>,
    /// Where stdout goes.
    pub stdout: &'a OutputCapture,
    /// Where stderr goes.
    pub stderr: &'a OutputCapture,
    /// Run the job on a terminal of the jail's (from its `devpts`, [`strata_jail::tty`]): its output goes to
    /// `stdout`, its input comes from `stdin` and `stdin_stream`.
    pub terminal: Option<&'a strata_core::Terminal>,
}

/// The limits watched from the host while a job runs.
#[derive(Debug, Clone)]
pub struct JobWatch {
    /// Wall-clock time.
    pub wall: Duration,
    /// CPU time of everything in the jail.
    pub cpu: Duration,
    /// Cancels the job.
    pub cancel: Option<CancelToken>,
}

/// How a job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobEnd {
    /// Its main process exited with a code.
    Exited(i32),
    /// A signal killed its main process.
    Signaled(i32),
    /// A limit stopped it.
    Limit(LimitKind),
    /// It was cancelled.
    Cancelled,
    /// It is a zygote, set up and held stopped, ready to fork.
    ZygoteReady,
    /// The jail died under it (not through a limit).
    JailLost,
}

impl JobEnd {
    /// The end a jail's `Exited` frame reports.
    fn of_exit(code: Option<i32>, signal: Option<i32>) -> JobEnd {
        match (code, signal) {
            (Some(code), _) => JobEnd::Exited(code),
            (None, Some(signal)) => JobEnd::Signaled(signal),
            (None, None) => JobEnd::JailLost,
        }
    }
}

/// What a job did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobReport {
    /// How it ended.
    pub end: JobEnd,
    /// Wall-clock time.
    pub wall: Duration,
    /// CPU time (the cgroup's).
    pub cpu: Duration,
    /// Peak memory (the cgroup's).
    pub peak_memory: u64,
}

/// A running jail.
#[derive(Debug)]
pub struct Jail {
    keeper: Option<Child>,
    ctl: OwnedFd,
    cgroup: Cgroup,
    pid1: Pid,
    /// A pidfd of PID 1: signals through it cannot reach a process that reused the PID.
    pidfd: Option<OwnedFd>,
    one_shot: bool,
    ended: bool,
    id_map: Option<IdMap>,
    /// The egress proxy serving this jail: stopped (threads joined, socket file removed) with it. Its lanes
    /// hold it weakly.
    egress: Option<Arc<EgressHandle>>,
    /// Its lanes, once opened.
    lanes: Option<Arc<Lanes>>,
    /// Its writable layer, watched for a job that fills it.
    scratch: Option<Arc<Scratch>>,
    /// A session's cgroup for the jobs of this connection, made by the first and kept for the next.
    jobs: Option<JobsCgroup>,
    /// Jobs cgroups a job left processes running in, removed once those are gone.
    lingering: Vec<Cgroup>,
}

/// The cgroup a session's jobs on the jail's first connection run in: a child of the jail's, made once and kept
/// (its limits rewritten when a job brings others), so that each job's CPU time, peak memory and limits are its
/// own whatever runs beside it on lanes, at the cost of a few writes per job rather than a cgroup made and removed.
/// A job that leaves processes running (a server started in the background) leaves them in this cgroup, which is
/// then set aside until they are gone, and the next job gets a new one: what they use is never a later job's.
#[derive(Debug)]
struct JobsCgroup {
    cgroup: Cgroup,
    limits: CgroupLimits,
}

/// A jail's writable layer as the host watches it: a descriptor of a directory on it (the overlay's upper
/// directory, from PID 1), used for nothing but `fstatvfs`.
#[derive(Debug)]
pub(crate) struct Scratch(OwnedFd);

impl Scratch {
    /// Bytes the layer holds, and its size.
    pub(crate) fn usage(&self) -> (u64, u64) {
        match nix::sys::statvfs::fstatvfs(&self.0) {
            Ok(s) => {
                let block = s.fragment_size();
                (s.blocks().saturating_sub(s.blocks_free()).saturating_mul(block), s.blocks().saturating_mul(block))
            }
            Err(_) => (0, 0),
        }
    }

    /// Whether the layer has no block or no inode left, so that a write or a new file fails with `ENOSPC`.
    fn is_full(&self) -> bool {
        nix::sys::statvfs::fstatvfs(&self.0).is_ok_and(|s| s.blocks_available() == 0 || s.files_available() == 0)
    }
}

/// Whether a job filled the writable layer: full when it ended and not when it began. A layer that was full
/// already is the earlier job's doing, reported then.
#[derive(Debug)]
struct DiskWatch<'a> {
    scratch: &'a Scratch,
    full_at_start: bool,
}

impl<'a> DiskWatch<'a> {
    fn take(scratch: Option<&'a Scratch>) -> Option<DiskWatch<'a>> {
        scratch.map(|scratch| DiskWatch { scratch, full_at_start: scratch.is_full() })
    }

    fn filled(&self) -> bool {
        !self.full_at_start && self.scratch.is_full()
    }
}

/// Starts copying the embedded `strata-jail` into its sealed memfd on a thread of its own, so that the first
/// [`Jail::start`] of this process finds it ready (or waits only for the rest of the copy) instead of making it
/// on its own path: the copy (1.6 MB into fresh shared memory) then overlaps what the caller does before the
/// first jail. Errors are not lost: the first `Jail::start` reports them. Does nothing once the memfd exists.
pub fn prepare_binary() {
    if JAIL_MEMFD.get().is_some() {
        return;
    }
    let spawned = std::thread::Builder::new().name("strata-jail-copy".into()).spawn(|| {
        let _ = jail_binary();
    });
    if let Err(err) = spawned {
        log::debug!("cannot copy the jail binary ahead ({err}); the first jail will");
    }
}

/// The embedded binary in its sealed memfd, or why it could not be made: made once per process.
static JAIL_MEMFD: OnceLock<Result<OwnedFd, String>> = OnceLock::new();

/// The embedded binary in a sealed memfd, created once per process.
fn jail_binary() -> Result<&'static OwnedFd, JailError> {
    JAIL_MEMFD
        .get_or_init(|| {
            let fd = memfd_create("strata-jail", MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)
                .map_err(|e| e.to_string())?;
            let mut file = File::from(fd);
            file.write_all(JAIL_BINARY).map_err(|e| e.to_string())?;
            let seals =
                SealFlag::F_SEAL_SEAL | SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_WRITE;
            fcntl(&file, FcntlArg::F_ADD_SEALS(seals)).map_err(|e| e.to_string())?;
            // Keep it clear of the low descriptor numbers: the spawned child installs its control socket at fd 3
            // before exec'ing this file by its /proc/self/fd path.
            let high = fcntl(&file, FcntlArg::F_DUPFD_CLOEXEC(64)).map_err(|e| e.to_string())?;
            // SAFETY: F_DUPFD_CLOEXEC just returned this new descriptor; nothing else owns it.
            Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(high) })
        })
        .as_ref()
        .map_err(|e| JailError::Spawn(std::io::Error::other(format!("embedded strata-jail: {e}"))))
}

impl Jail {
    /// Builds a jail and waits until it is ready for jobs.
    pub fn start(cgroups: &CgroupRoot, config: &JailConfig) -> Result<Jail, JailError> {
        let (host_end, jail_end) = socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)
            .map_err(|e| JailError::Spawn(e.into()))?;
        let cgroup = cgroups.create(&config.limits)?;
        // After the cgroup: a copy started by `prepare_binary` has had that long to finish.
        let binary = match jail_binary() {
            Ok(binary) => binary,
            Err(err) => {
                cgroup.remove();
                return Err(err);
            }
        };
        let mut command = Command::new(format!("/proc/self/fd/{}", binary.as_raw_fd()));
        // The control socket is the jail's stdin: no pre-exec code, so std spawns with posix_spawn (vfork-like)
        // instead of forking this process's whole address space.
        command
            .arg0("strata-jail")
            .env_clear()
            .stdin(Stdio::from(jail_end))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        let keeper = match command.spawn() {
            Ok(child) => child,
            Err(err) => {
                cgroup.remove();
                return Err(JailError::Spawn(err));
            }
        };
        // `command` holds the jail's end of the socket; it must close here, or the jail would never see EOF.
        drop(command);
        let mut jail = Jail {
            keeper: Some(keeper),
            ctl: host_end,
            cgroup,
            pid1: Pid::from_raw(0),
            pidfd: None,
            jobs: None,
            lingering: Vec::new(),
            one_shot: config.one_shot,
            ended: false,
            id_map: config.id_map,
            egress: None,
            lanes: None,
            scratch: None,
        };
        // The jail process moves itself into its cgroup (see `Cgroup::self_join_files`) before it does anything
        // else; nothing runs in the jail outside it.
        let setup = Setup {
            version: PROTOCOL_VERSION,
            join_cgroup: jail.cgroup.self_join_files(),
            lowers: config.lowers.clone(),
            scratch_mount: config.scratch_mount.clone(),
            scratch_bytes: config.scratch_bytes,
            binds: config.binds.clone(),
            hostname: config.hostname.clone(),
            one_shot: config.one_shot,
            id_map: config.id_map,
            restore_upper: config.restore_upper.is_some(),
            egress_socket: config.egress_socket.clone(),
            zygote: config.zygote,
            files_owner: config.files_owner.clone(),
        };
        let tree = config.restore_upper.clone();
        if let Some(tree) = &tree {
            // PID 1 reads it from where the descriptor stands, which a jail that failed before may have moved.
            std::io::Seek::rewind(&mut &**tree).map_err(|e| JailError::Setup {
                stage: "restore upper layer".into(),
                message: format!("rewinding the layer: {e}"),
            })?;
        }
        let fds: Vec<BorrowedFd<'_>> = tree.iter().map(|f| f.as_fd()).collect();
        proto::send(jail.ctl.as_fd(), &HostFrame::Setup(setup), &fds)?;
        drop(tree);
        if !wait_readable(jail.ctl.as_fd(), SETUP_TIMEOUT) {
            return Err(JailError::Setup {
                stage: "timeout".into(),
                message: format!("not ready after {SETUP_TIMEOUT:?}"),
            });
        }
        match proto::recv::<JailFrame>(jail.ctl.as_fd())? {
            Some((JailFrame::Ready { host_pid, notes }, mut fds)) if host_pid > 0 => {
                for note in notes {
                    log::warn!("jail: {note}");
                }
                jail.scratch = fds.pop().map(|fd| Arc::new(Scratch(fd)));
                jail.pid1 = Pid::from_raw(host_pid);
                // PID 1 cannot have exited yet: it ends only on our signal, an OOM kill or our closing the socket.
                jail.pidfd = Some(pidfd_open(host_pid).map_err(|e| JailError::Spawn(e.into()))?);
                Ok(jail)
            }
            Some((JailFrame::SetupFailed { stage, message }, _)) => Err(JailError::Setup { stage, message }),
            Some((other, _)) => Err(JailError::Protocol(format!("expected Ready, got {other:?}"))),
            None => {
                Err(JailError::Setup { stage: "start".into(), message: "the jail exited before it was ready".into() })
            }
        }
    }

    /// Hands the jail the egress proxy its [`JailConfig::egress_socket`] belongs to; it stops with the jail.
    pub fn attach_egress(&mut self, proxy: EgressHandle) {
        self.egress = Some(Arc::new(proxy));
    }

    /// The environment a job gets for the egress proxy's secrets (each name = its placeholder); empty without a
    /// proxy.
    pub fn egress_secret_env(&self) -> Vec<(String, String)> {
        self.egress.as_ref().map(|proxy| proxy.secret_env()).unwrap_or_default()
    }

    /// A handle that replaces the allowlist of the jail's egress proxy, when it has one.
    pub fn egress_switch(&self) -> Option<strata_egress::AllowlistSwitch> {
        self.egress.as_ref().map(|proxy| proxy.switch())
    }

    /// Takes the egress records of the connections that ended since the last call (and the count not kept),
    /// first waiting up to `settle` for those still open (a job that has ended is closing its last ones). Empty
    /// without a proxy.
    pub fn drain_egress(&self, settle: Duration) -> Drained {
        self.egress.as_ref().map(|proxy| proxy.drain_records_settled(settle)).unwrap_or_default()
    }

    /// The jail's cgroup.
    pub fn cgroup(&self) -> &Cgroup {
        &self.cgroup
    }

    /// PID 1 of the jail, as the host sees it.
    pub fn pid1(&self) -> Pid {
        self.pid1
    }

    /// Another pidfd of PID 1 (to end the jail from where the jail itself is not at hand).
    pub fn pidfd(&self) -> Option<OwnedFd> {
        self.pidfd.as_ref().and_then(|pidfd| pidfd.try_clone().ok())
    }

    /// Whether the jail has ended.
    pub fn has_ended(&self) -> bool {
        self.ended
    }

    /// The ID mapping of its jobs' user namespace (`None`: jobs run as host IDs).
    pub fn id_map(&self) -> Option<IdMap> {
        self.id_map
    }

    /// A descriptor of the overlay's upper directory, from PID 1, for storing the jail's filesystem. Walk it with
    /// `*at` calls that never follow a symlink: the jail's processes own what is in it.
    pub fn open_upper(&mut self) -> Result<OwnedFd, JailError> {
        if self.ended {
            return Err(JailError::Ended);
        }
        proto::send(self.ctl.as_fd(), &HostFrame::OpenUpper, &[])?;
        match self.reply()? {
            (JailFrame::UpperOpened, mut fds) if fds.len() == 1 => Ok(fds.pop().expect("one descriptor")),
            (other, _) => Err(JailError::Protocol(format!("unexpected {other:?} for OpenUpper"))),
        }
    }

    /// Stops every process of the jail but PID 1 (`SIGSTOP`), so its filesystem holds still while it is stored;
    /// the processes that were stopped already are left out of the returned list, which
    /// [`resume`](Jail::resume) continues. Repeats until no new process shows up (a stopped process cannot fork).
    pub fn pause(&mut self) -> Vec<Pid> {
        let keeper = self.keeper.as_ref().map(|k| k.id() as i32);
        let mut stopped: Vec<Pid> = Vec::new();
        let mut seen: std::collections::HashSet<i32> = std::collections::HashSet::new();
        for _ in 0..1000 {
            let fresh: Vec<i32> = self
                .cgroup
                .pids()
                .into_iter()
                .filter(|pid| *pid != self.pid1.as_raw() && Some(*pid) != keeper && seen.insert(*pid))
                .collect();
            if fresh.is_empty() {
                break;
            }
            for pid in fresh {
                if process_state(pid) == Some('T') {
                    continue;
                }
                let pid = Pid::from_raw(pid);
                if nix::sys::signal::kill(pid, Signal::SIGSTOP).is_ok() {
                    stopped.push(pid);
                }
            }
        }
        // SIGSTOP takes effect when the process next runs in the kernel: wait until each says it is stopped.
        let deadline = Instant::now() + Duration::from_millis(500);
        for pid in &stopped {
            while !matches!(process_state(pid.as_raw()), Some('T' | 't' | 'Z' | 'X') | None)
                && Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        stopped
    }

    /// Continues the processes [`pause`](Jail::pause) stopped.
    pub fn resume(&mut self, stopped: Vec<Pid>) {
        for pid in stopped {
            let _ = nix::sys::signal::kill(pid, Signal::SIGCONT);
        }
    }

    /// Runs one job and waits for it, feeding stdin, capturing output and enforcing `watch`. In a session the job
    /// runs in a cgroup of its own under `limits`, a child of the jail's kept for this connection's next jobs (so
    /// each is metered and limited alone, whatever runs on lanes beside it); a one-shot jail's cgroup is the job's.
    pub fn exec(
        &mut self,
        exec: &Exec,
        program: Option<File>,
        io: &JobIo<'_>,
        watch: &JobWatch,
        limits: &CgroupLimits,
    ) -> Result<JobReport, JailError> {
        self.run(exec, program, io, watch, Some(limits))
    }

    /// Starts the zygote (in a jail made with [`JailConfig::zygote`]) and waits until it is held ready to fork
    /// ([`JobEnd::ZygoteReady`]) or ends, capturing the setup's output and enforcing `watch` meanwhile. Its stdin
    /// is PID 1's (see [`strata_jail::zygote`]); `io.stdin` is not used.
    pub fn start_zygote(&mut self, exec: &Exec, io: &JobIo<'_>, watch: &JobWatch) -> Result<JobReport, JailError> {
        self.run(exec, None, io, watch, None)
    }

    /// The session's jobs cgroup under `limits`, made on first use.
    fn jobs_cgroup(&mut self, limits: &CgroupLimits) -> Result<Cgroup, JailError> {
        self.lingering.retain(|cgroup| !cgroup.try_remove());
        match &mut self.jobs {
            Some(jobs) if jobs.limits == *limits => {}
            Some(jobs) => {
                jobs.cgroup.apply_limits(limits)?;
                jobs.limits = *limits;
            }
            None => self.jobs = Some(JobsCgroup { cgroup: self.cgroup.child(limits)?, limits: *limits }),
        }
        Ok(self.jobs.as_ref().map(|jobs| jobs.cgroup.clone()).expect("made above"))
    }

    fn run(
        &mut self,
        exec: &Exec,
        program: Option<File>,
        io: &JobIo<'_>,
        watch: &JobWatch,
        limits: Option<&CgroupLimits>,
    ) -> Result<JobReport, JailError> {
        if self.ended {
            return Err(JailError::Ended);
        }
        // No limits: the zygote's start, which runs as the jail's own.
        let zygote = limits.is_none();
        // A session's job runs in the jobs cgroup, a one-shot jail's (or the zygote) in the jail's.
        let own = match limits {
            Some(limits) if !self.one_shot => Some(self.jobs_cgroup(limits)?),
            _ => None,
        };
        let join: Vec<File> = match &own {
            Some(own) => own
                .self_join_files()
                .iter()
                .map(|path| File::options().write(true).open(path))
                .collect::<Result<_, _>>()
                .map_err(JailError::Spawn)?,
            None => Vec::new(),
        };
        let cgroup = self.cgroup.clone();
        let job_cgroup = own.as_ref().unwrap_or(&cgroup);
        job_cgroup.reset_peak();
        let scratch = self.scratch.clone();
        let counters = Counters {
            job: Baseline::take(job_cgroup),
            outer: own.as_ref().map(|_| Baseline::take(&cgroup)),
            disk: DiskWatch::take(scratch.as_deref()),
        };
        let start = Instant::now();
        let mut exec = exec.clone();
        exec.cgroup_files = join.len() as u32;
        let mut extra: Vec<BorrowedFd<'_>> = join.iter().map(AsFd::as_fd).collect();
        extra.extend(program.as_ref().map(AsFd::as_fd));
        let (_tty, (stdin_w, stdout_r, stderr_r)) = match io.terminal {
            Some(terminal) if !zygote => {
                let (link, ends) = tty::start(self.ctl.as_fd(), &exec, &extra, terminal, io.stdin_stream)?;
                (Some(link), ends)
            }
            _ => {
                let (pipes, theirs) = job_pipes()?;
                if zygote {
                    proto::send(self.ctl.as_fd(), &HostFrame::Zygote(exec), &[theirs.1.as_fd(), theirs.2.as_fd()])?;
                } else {
                    let mut fds = vec![io.stdin_stream.unwrap_or(theirs.0.as_fd()), theirs.1.as_fd(), theirs.2.as_fd()];
                    fds.extend(extra.iter().copied());
                    proto::send(self.ctl.as_fd(), &HostFrame::Exec(exec), &fds)?;
                }
                (None, pipes)
            }
        };
        drop(extra);
        drop((program, join));

        let mut pump = Pump::new(stdin_w, stdout_r, stderr_r, io, !zygote);
        let mut exit: Option<JobEnd> = None;
        let mut stopped: Option<JobEnd> = None;
        let mut killed_at: Option<Instant> = None;
        let mut ctl_open = true;
        let mut exited_at = None;
        loop {
            if exit.is_some() || !ctl_open {
                if !self.ended {
                    // A session: the job is over; its background processes may hold the pipes open.
                    pump.drain_available(io);
                    break;
                }
                // The namespace is going away: the pipes reach end of file once its last process is gone.
                let since = exited_at.or(killed_at).unwrap_or(start);
                if pump.drained() || since.elapsed() > DRAIN_TIMEOUT {
                    break;
                }
            }
            if killed_at.is_some_and(|t| t.elapsed() > DRAIN_TIMEOUT) {
                break;
            }
            let now = Instant::now();
            let deadline = start + watch.wall;
            let mut timeout = WATCH_INTERVAL;
            if stopped.is_none() && deadline > now {
                timeout = timeout.min(deadline - now);
            }
            let ready = pump.poll(if ctl_open { Some(self.ctl.as_fd()) } else { None }, timeout);
            if ready.ctl {
                match proto::recv::<JailFrame>(self.ctl.as_fd()) {
                    Ok(Some((JailFrame::Started { .. }, _))) => {}
                    Ok(Some((JailFrame::Exited { code, signal }, _))) => {
                        exited_at = Some(Instant::now());
                        exit = Some(JobEnd::of_exit(code, signal));
                        if self.one_shot {
                            self.ended = true;
                        }
                    }
                    Ok(Some((JailFrame::ExecFailed { stage, errno, message }, _))) => {
                        return Err(JailError::NotStarted { stage, errno, message });
                    }
                    Ok(Some((JailFrame::ZygoteReady { .. }, _))) if zygote => {
                        exited_at = Some(Instant::now());
                        exit = Some(JobEnd::ZygoteReady);
                    }
                    Ok(Some((JailFrame::ZygoteRefused { message }, _))) if zygote => {
                        return Err(JailError::ZygoteRefused(message));
                    }
                    Ok(Some((other, _))) => {
                        return Err(JailError::Protocol(format!("unexpected {other:?} during a job")));
                    }
                    Ok(None) | Err(_) => {
                        ctl_open = false;
                        self.ended = true;
                        exited_at.get_or_insert_with(Instant::now);
                    }
                }
            }
            pump.transfer(&ready, io);
            if stopped.is_none()
                && exit.is_none()
                && ctl_open
                && let Some(reason) = counters.reached(watch, start)
            {
                stopped = Some(reason);
                killed_at = Some(Instant::now());
                match &own {
                    // Every process the job started, wherever it went: they are all in its cgroup.
                    Some(own) => own.kill_all(),
                    None => self.kill_job(),
                }
            }
        }
        let end_time = exited_at.unwrap_or_else(Instant::now);
        let end = counters.explain(stopped, exit, watch);
        if end == JobEnd::Limit(LimitKind::Memory) && !self.ended && !cgroup.can_make_room(MEMORY_HEADROOM) {
            log::warn!("{JAMMED}");
            self.kill_pid1();
        }
        let peak_memory = if job_cgroup.has_memory() { job_cgroup.peak_memory() } else { cgroup.peak_memory() };
        if own.as_ref().is_some_and(|own| !own.pids().is_empty())
            && let Some(jobs) = self.jobs.take()
        {
            self.lingering.push(jobs.cgroup);
        }
        Ok(JobReport { end, wall: end_time.duration_since(start), cpu: counters.job.cpu(), peak_memory })
    }

    /// Stops the running job: a one-shot jail is ended whole (PID 1 killed, so the kernel kills its namespace);
    /// a session's PID 1 kills every other process in it and stays.
    fn kill_job(&mut self) {
        if self.one_shot || proto::send(self.ctl.as_fd(), &HostFrame::Kill, &[]).is_err() {
            self.kill_pid1();
        }
    }

    /// Kills PID 1, and with it every process of the jail's PID namespace.
    fn kill_pid1(&mut self) {
        if let Some(pidfd) = &self.pidfd {
            signal_pidfd(pidfd, Signal::SIGKILL);
        }
        self.ended = true;
    }

    /// Forks the held zygote into a fresh jail of its own (see [`strata_jail::zygote`]): `stdio` are the fork's
    /// stdin, stdout and stderr, `status` the pipe its end is reported on, `cgroup_files` the fork's cgroup files
    /// its PID is written into before it runs. Returns its PID in the zygote's jail and a pidfd of it.
    pub fn fork(
        &mut self,
        request: &strata_jail::proto::Fork,
        stdio: [BorrowedFd<'_>; 3],
        status: BorrowedFd<'_>,
        cgroup_files: &[File],
    ) -> Result<(i32, OwnedFd), JailError> {
        if self.ended {
            return Err(JailError::Ended);
        }
        let mut fds = stdio.to_vec();
        fds.push(status);
        fds.extend(cgroup_files.iter().map(AsFd::as_fd));
        proto::send(self.ctl.as_fd(), &HostFrame::Fork(request.clone()), &fds)?;
        match self.reply()? {
            (JailFrame::Forked { pid }, mut fds) if fds.len() == 1 => Ok((pid, fds.pop().expect("one descriptor"))),
            (JailFrame::ForkFailed { stage, message }, _) => Err(JailError::Fork { stage, message }),
            (other, _) => Err(JailError::Protocol(format!("unexpected {other:?} for Fork"))),
        }
    }

    /// Writes a file in the jail (parents created), replacing any file there.
    pub fn write_file(&mut self, path: &str, contents: &[u8], mode: u32) -> Result<(), JailError> {
        if self.ended {
            return Err(JailError::Ended);
        }
        let written = write_file_on(self.ctl.as_fd(), path, contents, mode);
        self.ended |= matches!(written, Err(JailError::Ended));
        written
    }

    /// Reads a regular file of the jail, at most `max` bytes (more is an `EFBIG` error).
    pub fn read_file(&mut self, path: &str, max: u64) -> Result<Vec<u8>, JailError> {
        if self.ended {
            return Err(JailError::Ended);
        }
        let read = read_file_on(self.ctl.as_fd(), path, max);
        self.ended |= matches!(read, Err(JailError::Ended));
        read
    }

    /// Sends a filesystem request to PID 1 (`ListDir`, `Stat`, `MakeDir`, `Rename`, `Remove`) and reads its
    /// answer.
    pub fn file_request(&mut self, frame: &HostFrame) -> Result<FileAnswer, JailError> {
        if self.ended {
            return Err(JailError::Ended);
        }
        let answer = files::request_on(self.ctl.as_fd(), frame);
        self.ended |= matches!(answer, Err(JailError::Ended));
        answer
    }

    /// Watches the directory `path` (and every directory below it, `recursive`) on a lane of its own; see
    /// [`Lanes::watch_dir`].
    pub fn watch_dir(
        &mut self,
        path: &str,
        recursive: bool,
        on_events: impl FnMut(Vec<proto::WatchEvent>, bool) -> bool + Send + 'static,
    ) -> Result<JailWatch, JailError> {
        if self.ended {
            return Err(JailError::Ended);
        }
        JailWatch::start(lane::open(self.ctl.as_fd())?, path, recursive, on_events)
    }

    fn reply(&mut self) -> Result<(JailFrame, Vec<OwnedFd>), JailError> {
        let reply = reply_on(self.ctl.as_fd());
        self.ended |= matches!(reply, Err(JailError::Ended));
        reply
    }

    /// Lanes into this jail ([`Lanes`]): jobs and file operations that run beside each other and beside this
    /// handle's own. The first call opens them; later calls return the same.
    pub fn lanes(&mut self) -> Result<Arc<Lanes>, JailError> {
        if self.ended {
            return Err(JailError::Ended);
        }
        if let Some(lanes) = &self.lanes {
            return Ok(lanes.clone());
        }
        let root = lane::open(self.ctl.as_fd())?;
        let egress = self.egress.as_ref().map(Arc::downgrade).unwrap_or_default();
        let lanes = Arc::new(Lanes::new(root, self.cgroup.clone(), egress, self.scratch.clone()));
        self.lanes = Some(lanes.clone());
        Ok(lanes)
    }

    /// Ends the jail and releases everything it holds (also done on drop).
    pub fn close(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        let pid1_killed = self.pidfd.as_ref().map(|pidfd| signal_pidfd(pidfd, Signal::SIGKILL)).is_some();
        if let Some(mut keeper) = self.keeper.take() {
            // With PID 1 killed, the keeper ends on its own once it has reaped it, which is after the kernel has torn
            // down the jail's namespaces and taken PID 1 out of the cgroup: waiting for that leaves `kill_all`
            // nothing to wait out. Without a PID 1 to kill (a jail that never got ready), the keeper is killed,
            // and its death kills PID 1 (its parent-death signal).
            if !pid1_killed {
                let _ = keeper.kill();
            }
            let _ = keeper.wait();
        }
        self.ended = true;
        self.cgroup.kill_all();
        self.cgroup.remove();
        // Every process that could hold a connection is gone: the proxy stops without waiting on any.
        self.egress.take();
    }
}

impl Drop for Jail {
    fn drop(&mut self) {
        if self.keeper.is_some() {
            self.shutdown();
        }
    }
}

/// A fork of a zygote while it runs: its pipes, pidfd and cgroup (see [`Jail::fork`]).
#[derive(Debug)]
pub struct ForkHandle {
    /// The host ends: stdin (write), stdout and stderr (read), the status pipe (read).
    pub stdin: OwnedFd,
    /// Read end of the fork's stdout.
    pub stdout: OwnedFd,
    /// Read end of the fork's stderr.
    pub stderr: OwnedFd,
    /// Where PID 1 reports the fork's end.
    pub status: OwnedFd,
    /// A pidfd of the fork's first process (its PID namespace's init: killing it ends the fork).
    pub pidfd: OwnedFd,
    /// The fork's cgroup.
    pub cgroup: Cgroup,
}

/// Feeds a fork its stdin, captures its output and enforces `watch` on its cgroup until it ends; kills it on a
/// limit or a cancel. The cgroup is emptied and removed afterwards.
pub fn run_fork(fork: ForkHandle, io: &JobIo<'_>, watch: &JobWatch) -> JobReport {
    let ForkHandle { stdin, stdout, stderr, status, pidfd, cgroup } = fork;
    for fd in [&stdin, &stdout, &stderr, &status] {
        let _ = set_nonblocking(fd.as_fd());
    }
    let counters =
        Counters { job: Baseline { cgroup: &cgroup, cpu: Duration::ZERO, oom: 0, pids: 0 }, outer: None, disk: None };
    let start = Instant::now();
    let mut pump = Pump::new(stdin, stdout, stderr, io, true);
    let mut status = Some(status);
    let mut report = Vec::new();
    let mut exit: Option<JobEnd> = None;
    let mut stopped: Option<JobEnd> = None;
    let mut ended_at: Option<Instant> = None;
    loop {
        if let Some(at) = ended_at
            && (pump.drained() || at.elapsed() > DRAIN_TIMEOUT)
        {
            break;
        }
        let ready = pump.poll(status.as_ref().map(AsFd::as_fd), WATCH_INTERVAL);
        if ready.ctl
            && let Some(fd) = &status
        {
            let mut buf = [0u8; 256];
            match nix::unistd::read(fd.as_fd(), &mut buf) {
                Ok(0) | Err(Errno::EBADF | Errno::EIO) => {
                    status = None;
                    let frame = serde_json::from_slice::<JailFrame>(&report).ok();
                    exit = Some(match frame {
                        Some(JailFrame::Exited { code: Some(code), .. }) => JobEnd::Exited(code),
                        Some(JailFrame::Exited { signal: Some(signal), .. }) => JobEnd::Signaled(signal),
                        _ => JobEnd::JailLost,
                    });
                    ended_at.get_or_insert_with(Instant::now);
                }
                Ok(n) => report.extend_from_slice(&buf[..n.min(4096 - report.len().min(4096))]),
                Err(_) => {}
            }
        }
        pump.transfer(&ready, io);
        if stopped.is_none()
            && exit.is_none()
            && let Some(reason) = counters.reached(watch, start)
        {
            stopped = Some(reason);
            signal_pidfd(&pidfd, Signal::SIGKILL);
            ended_at.get_or_insert_with(Instant::now);
        }
    }
    let end_time = Instant::now();
    let report = JobReport {
        end: counters.explain(stopped, exit, watch),
        wall: end_time.duration_since(start),
        cpu: cgroup.cpu_time(),
        peak_memory: cgroup.peak_memory(),
    };
    signal_pidfd(&pidfd, Signal::SIGKILL);
    cgroup.kill_all();
    cgroup.remove();
    report
}

/// A cgroup's counters when a job started: what the job did is the difference.
struct Baseline<'a> {
    cgroup: &'a Cgroup,
    cpu: Duration,
    oom: u64,
    pids: u64,
}

impl<'a> Baseline<'a> {
    fn take(cgroup: &'a Cgroup) -> Baseline<'a> {
        Baseline { cgroup, cpu: cgroup.cpu_time(), oom: cgroup.oom_kills(), pids: cgroup.pids_refusals() }
    }

    fn cpu(&self) -> Duration {
        self.cgroup.cpu_time().saturating_sub(self.cpu)
    }

    fn oom_killed(&self) -> bool {
        self.cgroup.oom_kills() > self.oom
    }

    fn pids_refused(&self) -> bool {
        self.cgroup.pids_refusals() > self.pids
    }
}

/// The job's counters, and those of the jail around it when the job has a cgroup of its own (a lane's job):
/// a limit of the jail's that the job ran into counts as the job's. `disk` watches the jail's writable layer.
struct Counters<'a> {
    job: Baseline<'a>,
    outer: Option<Baseline<'a>>,
    disk: Option<DiskWatch<'a>>,
}

impl Counters<'_> {
    fn oom_killed(&self) -> bool {
        self.job.oom_killed() || self.outer.as_ref().is_some_and(Baseline::oom_killed)
    }

    fn pids_refused(&self) -> bool {
        self.job.pids_refused() || self.outer.as_ref().is_some_and(Baseline::pids_refused)
    }

    /// The limit the job has reached while it runs, or a cancel.
    fn reached(&self, watch: &JobWatch, start: Instant) -> Option<JobEnd> {
        if watch.cancel.as_ref().is_some_and(CancelToken::is_cancelled) {
            Some(JobEnd::Cancelled)
        } else if self.oom_killed() {
            Some(JobEnd::Limit(LimitKind::Memory))
        } else if self.pids_refused() {
            Some(JobEnd::Limit(LimitKind::Pids))
        } else if start.elapsed() >= watch.wall {
            Some(JobEnd::Limit(LimitKind::Wall))
        } else if self.job.cpu() > watch.cpu {
            Some(JobEnd::Limit(LimitKind::Cpu))
        } else {
            None
        }
    }

    /// How the job ended: the limit that stopped it, else its exit. A limit the kernel enforced (an OOM kill,
    /// a refused fork, a writable layer the job filled) explains the end even when the job exited on its own
    /// before the watch saw the counter move, and even when a child took the hit. An OOM kill, read from the
    /// cgroup's counter, is `memory` whatever else ended: the job, or the jail under it.
    fn explain(&self, stopped: Option<JobEnd>, exit: Option<JobEnd>, watch: &JobWatch) -> JobEnd {
        match (stopped, exit) {
            (Some(reason), _) => reason,
            (None, _) if self.oom_killed() => JobEnd::Limit(LimitKind::Memory),
            (None, Some(_)) if self.pids_refused() => JobEnd::Limit(LimitKind::Pids),
            (None, Some(_)) if self.disk.as_ref().is_some_and(DiskWatch::filled) => JobEnd::Limit(LimitKind::Disk),
            (None, Some(JobEnd::Signaled(_))) if self.job.cpu() > watch.cpu => JobEnd::Limit(LimitKind::Cpu),
            (None, Some(end)) => end,
            // The jail ended under a cancelled job (its sandbox was closed): the cancel explains it.
            (None, None) if watch.cancel.as_ref().is_some_and(CancelToken::is_cancelled) => JobEnd::Cancelled,
            (None, None) => JobEnd::JailLost,
        }
    }
}

/// Writes a file in the jail through the connection `ctl` (parents created), replacing any file there.
fn write_file_on(ctl: BorrowedFd<'_>, path: &str, contents: &[u8], mode: u32) -> Result<(), JailError> {
    let fd = memfd_create("strata-file", MFdFlags::MFD_CLOEXEC).map_err(|e| JailError::Spawn(e.into()))?;
    let mut file = File::from(fd);
    file.write_all(contents).map_err(JailError::Spawn)?;
    proto::send(ctl, &HostFrame::WriteFile { path: path.to_owned(), mode }, &[file.as_fd()])?;
    match reply_on(ctl)? {
        (JailFrame::FileWritten, _) => Ok(()),
        (JailFrame::FileError { errno, message }, _) => Err(JailError::File { errno, message }),
        (other, _) => Err(JailError::Protocol(format!("unexpected {other:?} for WriteFile"))),
    }
}

/// Reads a regular file of the jail through the connection `ctl`, at most `max` bytes (more is `EFBIG`).
fn read_file_on(ctl: BorrowedFd<'_>, path: &str, max: u64) -> Result<Vec<u8>, JailError> {
    proto::send(ctl, &HostFrame::ReadFile { path: path.to_owned() }, &[])?;
    match reply_on(ctl)? {
        (JailFrame::FileOpened { .. }, mut fds) if fds.len() == 1 => {
            let file = File::from(fds.pop().expect("one descriptor"));
            let mut contents = Vec::new();
            (&file).take(max.saturating_add(1)).read_to_end(&mut contents).map_err(|e| JailError::File {
                errno: e.raw_os_error().unwrap_or(0),
                message: format!("{path}: {e}"),
            })?;
            if contents.len() as u64 > max {
                return Err(JailError::File {
                    errno: libc::EFBIG,
                    message: format!("{path} is larger than {max} bytes"),
                });
            }
            Ok(contents)
        }
        (JailFrame::FileError { errno, message }, _) => Err(JailError::File { errno, message }),
        (other, _) => Err(JailError::Protocol(format!("unexpected {other:?} for ReadFile"))),
    }
}

/// The reply to a request on the connection `ctl`; `Ended` when the jail closed it.
fn reply_on(ctl: BorrowedFd<'_>) -> Result<(JailFrame, Vec<OwnedFd>), JailError> {
    if !wait_readable(ctl, SETUP_TIMEOUT) {
        return Err(JailError::Protocol("no reply from the jail".into()));
    }
    proto::recv::<JailFrame>(ctl)?.ok_or(JailError::Ended)
}

/// The state letter of `/proc/<pid>/stat` (`R`, `S`, `T`, ...), `None` when the process is gone.
fn process_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// A job's three pipes: the host's ends (stdin's writer, stdout's and stderr's readers, non-blocking), and the
/// job's (stdin's reader, stdout's and stderr's writers).
fn job_pipes() -> Result<(tty::Ends, tty::Ends), JailError> {
    let pipe = || nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| JailError::Spawn(e.into()));
    let ((stdin_r, stdin_w), (stdout_r, stdout_w), (stderr_r, stderr_w)) = (pipe()?, pipe()?, pipe()?);
    for fd in [&stdin_w, &stdout_r, &stderr_r] {
        set_nonblocking(fd.as_fd()).map_err(|e| JailError::Spawn(e.into()))?;
    }
    Ok(((stdin_w, stdout_r, stderr_r), (stdin_r, stdout_w, stderr_w)))
}

fn set_nonblocking(fd: BorrowedFd<'_>) -> Result<(), Errno> {
    let flags = OFlag::from_bits_truncate(fcntl(fd, FcntlArg::F_GETFL)?);
    fcntl(fd, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK)).map(drop)
}

fn wait_readable(fd: BorrowedFd<'_>, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
        match poll(&mut fds, poll_timeout(left)) {
            Ok(0) => return false,
            Ok(_) => return true,
            Err(Errno::EINTR) => continue,
            Err(_) => return false,
        }
    }
}

fn poll_timeout(d: Duration) -> PollTimeout {
    PollTimeout::try_from(d.as_millis().min(60_000) as i32).unwrap_or(PollTimeout::MAX)
}

/// The host ends of a job's pipes.
struct Pump<'a> {
    stdin: Option<OwnedFd>,
    stdin_data: &'a [u8],
    stdout: Option<OwnedFd>,
    stderr: Option<OwnedFd>,
}

#[derive(Default)]
struct Ready {
    ctl: bool,
    stdin: bool,
    stdout: bool,
    stderr: bool,
}

impl<'a> Pump<'a> {
    /// The pumps of a job's pipes; `stdin` is fed `io.stdin` unless `feed` is false or there is nothing to feed
    /// (then the job's stdin reaches end of file at once, or is `io.stdin_stream`).
    fn new(stdin: OwnedFd, stdout: OwnedFd, stderr: OwnedFd, io: &JobIo<'a>, feed: bool) -> Pump<'a> {
        let feed = feed && !io.stdin.is_empty() && io.stdin_stream.is_none();
        Pump { stdin: feed.then_some(stdin), stdin_data: io.stdin, stdout: Some(stdout), stderr: Some(stderr) }
    }

    fn drained(&self) -> bool {
        self.stdout.is_none() && self.stderr.is_none()
    }

    fn poll(&self, ctl: Option<BorrowedFd<'_>>, timeout: Duration) -> Ready {
        let mut fds = Vec::with_capacity(4);
        let mut slots = [usize::MAX; 4];
        if let Some(ctl) = ctl {
            slots[0] = fds.len();
            fds.push(PollFd::new(ctl, PollFlags::POLLIN));
        }
        if let Some(fd) = &self.stdin {
            slots[1] = fds.len();
            fds.push(PollFd::new(fd.as_fd(), PollFlags::POLLOUT));
        }
        if let Some(fd) = &self.stdout {
            slots[2] = fds.len();
            fds.push(PollFd::new(fd.as_fd(), PollFlags::POLLIN));
        }
        if let Some(fd) = &self.stderr {
            slots[3] = fds.len();
            fds.push(PollFd::new(fd.as_fd(), PollFlags::POLLIN));
        }
        let mut timeout = timeout;
        if timeout.is_zero() {
            timeout = Duration::from_millis(1);
        }
        if poll(&mut fds, poll_timeout(timeout)).is_err() {
            return Ready::default();
        }
        let hit = |slot: usize| slot != usize::MAX && fds[slot].revents().is_some_and(|r| !r.is_empty());
        Ready { ctl: hit(slots[0]), stdin: hit(slots[1]), stdout: hit(slots[2]), stderr: hit(slots[3]) }
    }

    fn transfer(&mut self, ready: &Ready, io: &JobIo<'_>) {
        if ready.stdin {
            self.feed();
        }
        if ready.stdout {
            read_into(&mut self.stdout, io.stdout, false);
        }
        if ready.stderr {
            read_into(&mut self.stderr, io.stderr, false);
        }
    }

    fn feed(&mut self) {
        let Some(fd) = &self.stdin else { return };
        match nix::unistd::write(fd, self.stdin_data) {
            Ok(n) => {
                self.stdin_data = &self.stdin_data[n..];
                if self.stdin_data.is_empty() {
                    self.stdin = None;
                }
            }
            Err(Errno::EAGAIN | Errno::EINTR) => {}
            // EPIPE: the job closed stdin or exited; the rest is not wanted.
            Err(_) => self.stdin = None,
        }
    }

    /// Reads whatever the pipes hold now, without waiting for their writers (a session's background processes
    /// may keep them open).
    fn drain_available(&mut self, io: &JobIo<'_>) {
        read_into(&mut self.stdout, io.stdout, true);
        read_into(&mut self.stderr, io.stderr, true);
        self.stdout = None;
        self.stderr = None;
    }
}

/// Reads from a pipe into a capture: one buffer's worth, or everything available when `all`. Closes the pipe at
/// end of file.
fn read_into(pipe: &mut Option<OwnedFd>, capture: &OutputCapture, all: bool) {
    let mut buf = [0u8; 64 * 1024];
    while let Some(fd) = pipe {
        match nix::unistd::read(fd.as_fd(), &mut buf) {
            Ok(0) => *pipe = None,
            Ok(n) => {
                capture.write(&buf[..n]);
                if !all && n < buf.len() {
                    return;
                }
            }
            Err(Errno::EINTR) => {}
            Err(Errno::EAGAIN) => return,
            Err(_) => *pipe = None,
        }
    }
}
