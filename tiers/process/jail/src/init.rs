//! The jail's own processes: the keeper that the host spawns, and the PID 1 it forks into the new namespaces.
//!
//! The host starts `strata-jail` with the control socket as its stdin ([`CONTROL_FD`]) and sends
//! [`HostFrame::Setup`]. The keeper moves itself into the sandbox's cgroup, creates the jobs' user namespace,
//! unshares the mount, UTS, IPC, network, cgroup and PID namespaces and forks; its child is PID 1 of the new PID
//! namespace. PID 1 builds the filesystem (a private tmpfs holding the overlay's upper layer over the idmapped
//! read-only image, `/proc`, a minimal `/dev`, the grants), `pivot_root`s into it, brings up loopback in an
//! otherwise empty network namespace, installs the seccomp filter on itself (every job inherits it; PID 1 is
//! confined too) and answers [`JailFrame::Ready`]. Then it serves frames: each job is a child that joins the user
//! namespace as its root, drops every capability and `execve`s. PID 1 reaps every process in the namespace. When
//! the host closes the socket (or dies), PID 1 exits, and the kernel kills everything left in the namespace. When
//! the jail has network, `Setup::egress_socket` is bind-mounted at [`forward::GUEST_SOCKET`] and PID 1's event
//! loop also runs the [`forward`]er on the jail's `127.0.0.1:3128`. The host's file methods are frames PID 1
//! answers on the jail's tree ([`crate::files`]); its watches are inotify descriptors in the same event loop
//! ([`crate::watch`]).
//!
//! Everything here runs single-threaded, so allocating after `fork` is sound.

use std::ffi::CString;
use std::fs;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

use nix::errno::Errno;
use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sched::{CloneFlags, unshare};
use nix::sys::resource::{Resource, setrlimit};
use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, SigmaskHow, Signal, kill, sigaction, sigprocmask};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{ForkResult, Pid, chdir, execve, fork, pivot_root, sethostname, setsid};

use crate::files::{FileResult, Files};
use crate::forward::{self, Forwarder};
use crate::proto::{
    self, Bind, CONTROL_FD, Exec, HostFrame, JailFrame, MAX_LOWERS, PROTOCOL_VERSION, ServiceExit, Setup,
};
use crate::seccomp;
use crate::service::{StopReply, Supervisor};
use crate::steps::{OLD_ROOT, StepError, bind_onto, confine_proc, loopback_up, mount_dev_at, scratch_options, step};
use crate::sudo::{self, Incoming, Reply, Sudo};
use crate::tree;
use crate::tty;
use crate::userns::UserNamespace;
use crate::users::{self, Account};
use crate::watch::{self, Watches};
use crate::zygote;
use seccompiler::BpfProgram;

/// Where a process sets how the OOM killer ranks it; the value that exempts it (the jail's own processes);
/// the value that makes it the first choice (every job).
const OOM_SCORE_ADJ: &str = "/proc/self/oom_score_adj";
const OOM_SCORE_ADJ_MIN: &str = "-1000";
const OOM_SCORE_ADJ_MAX: &str = "1000";

/// The `PATH` used to find a job's program when its environment has none.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The entry point of the `strata-jail` binary. Returns the process exit code.
pub fn main() -> i32 {
    let Some(ctl) = take_control_socket() else {
        eprintln!("strata-jail: standard input is not Strata's control socket; this program is started by Strata");
        return 2;
    };
    let (setup, mut fds) = match proto::recv::<HostFrame>(ctl.as_fd()) {
        Ok(Some((HostFrame::Setup(setup), fds))) => (setup, fds),
        // The host went away before the jail existed: nothing to clean up.
        Ok(None) => return 0,
        Ok(Some((other, _))) => return fail(&ctl, "protocol", format!("expected Setup, got {other:?}")),
        Err(err) => return fail(&ctl, "protocol", err.to_string()),
    };
    if setup.version != PROTOCOL_VERSION {
        return fail(&ctl, "protocol", format!("version {} (this jail speaks {PROTOCOL_VERSION})", setup.version));
    }
    let restore = match (setup.restore_upper, fds.pop(), fds.is_empty()) {
        (false, None, true) => None,
        (true, Some(tree), true) => Some(tree),
        _ => return fail(&ctl, "protocol", "Setup came with the wrong descriptors".into()),
    };
    for file in &setup.join_cgroup {
        if let Err(err) = fs::write(file, "0") {
            return fail(&ctl, "cgroup", format!("{}: {err}", file.display()));
        }
    }
    // The keeper and PID 1 (which inherits it) are not the OOM killer's to choose where the host lets them say
    // so (lowering it takes CAP_SYS_RESOURCE, which some hosts' root lacks); each job ranks itself first anyway
    // (see `Init::become_job`).
    let _ = fs::write(OOM_SCORE_ADJ, OOM_SCORE_ADJ_MIN);
    // The jobs' user namespace, made before the PID namespace is: its holder is then named in this `/proc`, and
    // PID 1 inherits the namespace's descriptor.
    let (userns, holder) = match setup.id_map.map(UserNamespace::create).transpose() {
        Ok(created) => created.unzip(),
        Err(errno) => return fail(&ctl, "user namespace", errno.desc().to_owned()),
    };
    let namespaces = CloneFlags::CLONE_NEWNS
        | CloneFlags::CLONE_NEWUTS
        | CloneFlags::CLONE_NEWIPC
        | CloneFlags::CLONE_NEWNET
        | CloneFlags::CLONE_NEWCGROUP
        | CloneFlags::CLONE_NEWPID;
    if let Err(errno) = unshare(namespaces) {
        return fail(&ctl, "unshare", errno.desc().to_owned());
    }
    // PID 1's seccomp filters are compiled here while PID 1 builds the jail, and handed over through this pipe:
    // installing them is PID 1's last step, so compiling them (a fraction of a millisecond) overlaps the mounts.
    let (filters_r, filters_w) = match nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC) {
        Ok(pipe) => pipe,
        Err(errno) => return fail(&ctl, "seccomp", errno.desc().to_owned()),
    };
    // SAFETY: this process is single-threaded (main has spawned no threads), so the child may run arbitrary code.
    match unsafe { fork() } {
        Err(errno) => fail(&ctl, "fork", errno.desc().to_owned()),
        Ok(ForkResult::Child) => {
            drop(filters_w);
            pid1(ctl, setup, restore, userns, filters_r)
        }
        Ok(ForkResult::Parent { child }) => {
            drop((ctl, restore, userns, filters_r));
            let compiled = if setup.zygote { seccomp::zygote_pid1_filters() } else { seccomp::filters() };
            // A filter that did not compile (a bug) leaves the pipe empty: PID 1 fails at its seccomp step.
            if let Ok(filters) = compiled {
                let _ = filters.write_to(&mut fs::File::from(filters_w));
            }
            // Killed already; reaped while PID 1 builds the jail.
            if let Some(holder) = holder {
                holder.reap();
            }
            keep(child)
        }
    }
}

/// Moves the control socket off standard input (to a close-on-exec descriptor above 2) and puts `/dev/null` there.
fn take_control_socket() -> Option<OwnedFd> {
    use nix::sys::socket::{SockType, getsockopt, sockopt};
    // SAFETY: CONTROL_FD is open for the process's whole life (it is standard input); borrowing it is sound.
    let stdin = unsafe { std::os::fd::BorrowedFd::borrow_raw(CONTROL_FD) };
    if getsockopt(&stdin, sockopt::SockType).ok()? != SockType::SeqPacket {
        return None;
    }
    let moved = nix::fcntl::fcntl(stdin, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(3)).ok()?;
    // SAFETY: F_DUPFD_CLOEXEC just returned this new descriptor; nothing else owns it.
    let ctl = unsafe { OwnedFd::from_raw_fd(moved) };
    let null = fs::File::open("/dev/null").ok()?;
    // SAFETY: dup2 onto fd 0 replaces standard input with /dev/null; the socket lives on as `ctl`.
    if unsafe { libc::dup2(null.as_raw_fd(), CONTROL_FD) } < 0 {
        return None;
    }
    Some(ctl)
}

/// The keeper: waits for PID 1 and exits with its status, so the host has one direct child to reap.
fn keep(pid1: Pid) -> i32 {
    loop {
        match waitpid(pid1, None) {
            Ok(WaitStatus::Exited(_, code)) => return code,
            Ok(WaitStatus::Signaled(_, signal, _)) => return 128 + signal as i32,
            Ok(_) | Err(Errno::EINTR) => continue,
            Err(_) => return 1,
        }
    }
}

fn fail(ctl: &OwnedFd, stage: &str, message: String) -> i32 {
    let _ = proto::send(ctl.as_fd(), &JailFrame::SetupFailed { stage: stage.to_owned(), message }, &[]);
    1
}

/// PID 1: builds the jail (see [`build`]), installs the seccomp filters the keeper compiled and sends through
/// `filters`, and serves the host's frames.
fn pid1(ctl: OwnedFd, setup: Setup, restore: Option<OwnedFd>, userns: Option<UserNamespace>, filters: OwnedFd) -> i32 {
    // SAFETY: prctl with PR_SET_PDEATHSIG and a valid signal number only changes this process's attributes.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    // The host's /proc is still mounted: its /proc/self names this process by its PID outside the namespace.
    let host_pid =
        fs::read_link("/proc/self").ok().and_then(|p| p.to_str().and_then(|s| s.parse::<i32>().ok())).unwrap_or(0);
    let mut notes = Vec::new();
    let built = build(&setup, restore, userns, &mut notes).and_then(|built| {
        let filters = seccomp::JailFilters::read_from(&mut fs::File::from(filters))
            .map_err(|e| format!("the keeper handed over no filters ({e})"));
        Ok((built, step("seccomp", filters)?))
    });
    let ((userns, upper), filters) = match built {
        Ok(built) => built,
        Err(StepError { stage, message }) => return fail(&ctl, &stage, message),
    };
    // The forwarder listens before any job runs, so no job can take its port.
    let forwarder = match setup.egress_socket.is_some().then(|| Forwarder::bind(forward::GUEST_SOCKET)).transpose() {
        Ok(forwarder) => forwarder,
        Err(err) => return fail(&ctl, "egress forwarder", err.to_string()),
    };
    // Nobody in the jail may read this process's memory or descriptors through /proc (it holds the control
    // socket and full capabilities).
    // SAFETY: prctl with PR_SET_DUMPABLE only changes this process's attributes.
    unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0) };
    // The filter goes on PID 1 itself once the jail is built: every job inherits it through fork, so no job
    // pays for compiling and attaching it, and PID 1 is confined too.
    if let Err(err) = seccomp::install(&filters) {
        return fail(&ctl, "seccomp", err.to_string());
    }
    let mut files = match Files::open(userns.as_ref().map(UserNamespace::map)) {
        Ok(files) => files,
        Err(errno) => return fail(&ctl, "root", errno.desc().to_owned()),
    };
    if let Some(owner) = &setup.files_owner {
        match (&userns, users::lookup(&files, owner)) {
            (Some(userns), Ok(account)) if account.uid < userns.map().count && account.gid < userns.map().count => {
                files.set_owner(account.uid, account.gid);
            }
            (None, _) => return fail(&ctl, "files owner", "an owner other than root needs a user namespace".into()),
            (_, Err(err)) => return fail(&ctl, "files owner", err.to_string()),
            (Some(_), Ok(account)) => {
                return fail(&ctl, "files owner", format!("user {owner}'s IDs ({}) are not mapped", account.uid));
            }
        }
    }
    // A snapshot's upper layer may hold an old socket there (or whatever a job put there): without a listener,
    // `sudo` says it cannot reach PID 1, and the jail runs on.
    let _ = fs::remove_file(sudo::SOCKET);
    let sudo = match Sudo::bind(userns.as_ref().map_or(0, |userns| userns.map().base)) {
        Ok(sudo) => Some(sudo),
        Err(errno) => {
            notes.push(format!("sudo: cannot listen on {}: {}", sudo::SOCKET, errno.desc()));
            None
        }
    };
    if proto::send(ctl.as_fd(), &JailFrame::Ready { host_pid, notes }, &[upper.as_fd()]).is_err() {
        return 1;
    }
    let zygote = match setup.zygote.then(seccomp::zygote_filter).transpose() {
        Ok(filter) => filter.map(|filter| zygote::Zygote::new(filter, setup.binds.clone(), setup.scratch_bytes)),
        Err(err) => return fail(&ctl, "seccomp", err.to_string()),
    };
    Init {
        ctl,
        userns,
        upper,
        one_shot: setup.one_shot,
        job: None,
        job_cgroup: Vec::new(),
        sudo,
        forwarder,
        zygote,
        lanes: Vec::new(),
        lanes_opened: false,
        next_lane: 0,
        files,
        watches: Watches::default(),
        service: None,
    }
    .serve()
}

/// Builds the jail's filesystem and identity. Runs as PID 1, in the new namespaces, with full capabilities.
/// `restore` is a [`tree`] file the upper layer starts from (a fork); `userns` the jobs' user namespace, when
/// one was asked for (the image and grants are mounted idmapped through it). Returns it, and a descriptor of the
/// upper directory (for snapshots).
fn build(
    setup: &Setup,
    restore: Option<OwnedFd>,
    userns: Option<UserNamespace>,
    notes: &mut Vec<String>,
) -> Result<(Option<UserNamespace>, OwnedFd), StepError> {
    step(
        "mount propagation",
        mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None::<&str>),
    )?;
    let scratch = &setup.scratch_mount;
    let options = scratch_options(setup.scratch_bytes);
    step(
        "scratch tmpfs",
        mount(Some("strata"), scratch, Some("tmpfs"), MsFlags::MS_NOSUID | MsFlags::MS_NODEV, Some(options.as_str())),
    )?;
    let (upper, work, root) = (scratch.join("upper"), scratch.join("work"), scratch.join("root"));
    for dir in [&upper, &work, &root] {
        step("scratch dirs", fs::DirBuilder::new().mode(0o755).create(dir))?;
    }
    if setup.lowers.is_empty() || setup.lowers.len() > MAX_LOWERS {
        let message = format!("{} layers (1 to {MAX_LOWERS})", setup.lowers.len());
        return Err(StepError { stage: "image layers".into(), message });
    }
    // Each layer is mounted read-only under the scratch tmpfs, so the overlay's options name short paths
    // whatever the host paths are: idmapped (the image as the jail's root owns it) or, without a user
    // namespace, bound as it is.
    let layers = scratch.join("l");
    step("scratch dirs", fs::DirBuilder::new().mode(0o755).create(&layers))?;
    let mut lowers = Vec::with_capacity(setup.lowers.len());
    for (index, source) in setup.lowers.iter().enumerate() {
        let lower = layers.join(index.to_string());
        step("scratch dirs", fs::DirBuilder::new().mode(0o755).create(&lower))?;
        match &userns {
            Some(userns) => step("idmapped image", userns.mount_idmapped(source, &lower, true))?,
            None => step("image layers", bind_onto(source, &lower.to_string_lossy(), true))?,
        }
        lowers.push(lower.display().to_string());
    }
    if let Some(userns) = &userns {
        // The upper layer's root directory takes the image root's owner, or the jail's root could not
        // create files in `/`.
        step("scratch dirs", userns.give(&upper))?;
    }
    let lower = lowers.join(":");
    let upper_fd: OwnedFd = step(
        "scratch dirs",
        fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW).open(&upper),
    )?
    .into();
    if let Some(tree_fd) = restore {
        // Before the overlay is mounted over it: overlayfs does not allow its layers to change under it. PID 1
        // is already in the jail's cgroup, so the tmpfs pages are charged to the fork.
        let input = std::io::BufReader::with_capacity(256 * 1024, fs::File::from(tree_fd));
        let id_map = userns.as_ref().map(UserNamespace::map);
        step("restore upper layer", tree::extract_tree(input, upper_fd.as_fd(), id_map))?;
    }
    // The upper layer must stand on its own (a snapshot stores it; a fork mounts it over the same image): no
    // redirects or metadata-only copy-ups that point into the lower layer, no inode index.
    let overlay = format!(
        "lowerdir={},upperdir={},workdir={},redirect_dir=off,metacopy=off,index=off",
        lower,
        upper.display(),
        work.display()
    );
    step("overlay", mount(Some("strata-root"), &root, Some("overlay"), MsFlags::empty(), Some(overlay.as_str())))?;
    step("hostname", sethostname(&setup.hostname))?;
    step("loopback", loopback_up())?;

    let old_root = root.join(OLD_ROOT.trim_start_matches('/'));
    step("pivot_root", fs::DirBuilder::new().mode(0o700).create(&old_root))?;
    step("pivot_root", pivot_root(&root, &old_root))?;
    step("pivot_root", chdir("/"))?;

    mount_proc()?;
    mount_dev()?;
    for bind in &setup.binds {
        mount_grant(bind, userns.as_ref(), notes)?;
    }
    step("/run/strata", create_dirs(Path::new("/run/strata"), userns.as_ref()))?;
    if let Some(socket) = &setup.egress_socket {
        let source = PathBuf::from(format!("{OLD_ROOT}{}", socket.display()));
        step(
            "egress socket",
            fs::OpenOptions::new().create(true).append(true).mode(0o600).open(forward::GUEST_SOCKET),
        )?;
        step("egress socket", bind_onto(&source, forward::GUEST_SOCKET, false))?;
    }
    step("detach host root", umount2(OLD_ROOT, MntFlags::MNT_DETACH))?;
    step("detach host root", fs::remove_dir(OLD_ROOT))?;
    Ok((userns, upper_fd))
}

/// Creates `dir` and its missing parents (mode 0755), each given to the jail's root when there is a user
/// namespace.
fn create_dirs(dir: &Path, userns: Option<&UserNamespace>) -> std::io::Result<()> {
    let missing: Vec<&Path> = dir.ancestors().take_while(|p| !p.exists()).collect();
    for path in missing.into_iter().rev() {
        fs::DirBuilder::new().mode(0o755).create(path)?;
        if let Some(userns) = userns {
            userns.give(path)?;
        }
    }
    Ok(())
}

fn mount_proc() -> Result<(), StepError> {
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    step("/proc", fs::DirBuilder::new().recursive(true).mode(0o555).create("/proc"))?;
    step("/proc", mount(Some("proc"), "/proc", Some("proc"), flags, None::<&str>))?;
    confine_proc("/proc", &format!("{OLD_ROOT}/dev/null"))
}

fn mount_dev() -> Result<(), StepError> {
    mount_dev_at("/dev", &format!("{OLD_ROOT}/dev"))
}

fn mount_grant(bind: &Bind, userns: Option<&UserNamespace>, notes: &mut Vec<String>) -> Result<(), StepError> {
    let stage = format!("grant {}", bind.guest);
    let source = PathBuf::from(format!("{OLD_ROOT}{}", bind.host.display()));
    let meta = step(&stage, fs::metadata(&source))?;
    let target = Path::new(&bind.guest);
    if meta.is_dir() {
        step(&stage, create_dirs(target, userns))?;
    } else {
        if let Some(parent) = target.parent() {
            step(&stage, create_dirs(parent, userns))?;
        }
        step(&stage, fs::OpenOptions::new().create(true).append(true).mode(0o644).open(target))?;
    }
    if let Some(userns) = userns {
        match userns.mount_idmapped(&source, target, bind.read_only) {
            Ok(()) => return Ok(()),
            // The grant's filesystem cannot be idmapped: a plain bind, whose files keep their host owners
            // (a read-write grant is then writable only where its modes let anyone write).
            Err(errno @ (Errno::EINVAL | Errno::EPERM | Errno::EOPNOTSUPP)) => notes.push(format!(
                "grant {} -> {}: the filesystem does not support idmapped mounts ({}); bind-mounted with host owners",
                bind.host.display(),
                bind.guest,
                errno.desc()
            )),
            Err(errno) => return Err(StepError { stage, message: errno.desc().to_owned() }),
        }
    }
    step(&stage, bind_onto(&source, &bind.guest, bind.read_only))
}

/// PID 1's state while serving.
struct Init {
    ctl: OwnedFd,
    userns: Option<UserNamespace>,
    /// The overlay's upper directory (close-on-exec; jobs never get it).
    upper: OwnedFd,
    one_shot: bool,
    job: Option<Pid>,
    /// The first connection's job's cgroup files, while it runs (a `sudo` command it starts joins them).
    job_cgroup: Vec<OwnedFd>,
    /// The `sudo` listener and its clients ([`sudo`]); `None` when it could not listen.
    sudo: Option<Sudo>,
    /// The egress forwarder, when the jail has network.
    forwarder: Option<Forwarder>,
    /// The zygote and its forks, in a jail set up for one.
    zygote: Option<zygote::Zygote>,
    /// The other connections ([`HostFrame::Lane`]), each with its own job.
    lanes: Vec<Lane>,
    /// Whether a lane was ever opened (their jobs, and what those left behind, may be running).
    lanes_opened: bool,
    /// The serial number of the next lane (watches name their lane by it: indices change as lanes close).
    next_lane: u64,
    /// The jail's tree, for the filesystem methods.
    files: Files,
    /// The inotify watches the connections started.
    watches: Watches,
    /// The jail's service ([`crate::service`]), once the host started one.
    service: Option<Supervisor>,
}

/// A control connection beside the first one.
struct Lane {
    ctl: OwnedFd,
    job: Option<Pid>,
    /// Its job's cgroup files, while it runs (a `sudo` command it starts joins them).
    cgroup: Vec<OwnedFd>,
    serial: u64,
}

/// The most lanes open at once; a `Lane` frame past it is dropped (its socket closes, which the host reads as
/// the jail having ended that lane).
const MAX_LANES: usize = 1024;

/// Which connection a frame came on: the first (`None`) or a lane.
type Conn = Option<usize>;

impl Init {
    fn serve(mut self) -> i32 {
        let mut mask = SigSet::empty();
        mask.add(Signal::SIGCHLD);
        if sigprocmask(SigmaskHow::SIG_BLOCK, Some(&mask), None).is_err() {
            return 1;
        }
        let Ok(signals) = SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK) else {
            return 1;
        };
        loop {
            let mut fds =
                vec![PollFd::new(self.ctl.as_fd(), PollFlags::POLLIN), PollFd::new(signals.as_fd(), PollFlags::POLLIN)];
            let zygote_fd = self.zygote.as_ref().and_then(zygote::Zygote::ready_fd);
            if let Some(fd) = zygote_fd {
                fds.push(PollFd::new(fd, PollFlags::POLLIN));
            }
            let lanes_from = fds.len();
            fds.extend(self.lanes.iter().map(|lane| PollFd::new(lane.ctl.as_fd(), PollFlags::POLLIN)));
            let watches_from = fds.len();
            let watched = self.watches.poll_fds(&mut fds);
            let net_from = fds.len();
            if let Some(forwarder) = &self.forwarder {
                forwarder.poll_fds(&mut fds);
            }
            let sudo_from = fds.len();
            if let Some(sudo) = &self.sudo {
                sudo.poll_fds(&mut fds);
            }
            let service_at = fds.len();
            if let Some(service) = &self.service {
                fds.push(PollFd::new(service.log_fd(), PollFlags::POLLIN));
            }
            // With forks to make ahead, only look: one is made after whatever is ready now was handled.
            let refill = self.zygote.as_ref().is_some_and(zygote::Zygote::wants_refill);
            let service_wake = self.service.as_ref().and_then(|service| service.next_wake(Instant::now()));
            let wake = match (self.watches.next_wake(), service_wake) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let timeout = match wake {
                _ if refill => PollTimeout::ZERO,
                // Rounded up: a wake a little late, never a spin of early ones.
                Some(wake) => PollTimeout::try_from(wake.as_millis().saturating_add(1).min(1000) as i32)
                    .unwrap_or(PollTimeout::MAX),
                None => PollTimeout::NONE,
            };
            match poll(&mut fds, timeout) {
                Ok(_) | Err(Errno::EINTR) => {}
                Err(_) => return 1,
            }
            let ctl_ready = fds[0].revents().is_some_and(|r| !r.is_empty());
            let child_ready = fds[1].revents().is_some_and(|r| !r.is_empty());
            let zygote_ready = zygote_fd.is_some() && fds[2].revents().is_some_and(|r| !r.is_empty());
            let net: Vec<PollFlags> =
                fds[net_from..sudo_from].iter().map(|fd| fd.revents().unwrap_or(PollFlags::empty())).collect();
            let sudo_ready: Vec<bool> =
                fds[sudo_from..service_at].iter().map(|fd| fd.revents().is_some_and(|r| !r.is_empty())).collect();
            let service_ready = fds.get(service_at).is_some_and(|fd| fd.revents().is_some_and(|r| !r.is_empty()));
            let lanes_ready: Vec<bool> =
                fds[lanes_from..watches_from].iter().map(|fd| fd.revents().is_some_and(|r| !r.is_empty())).collect();
            let watches_ready: Vec<usize> = fds[watches_from..net_from]
                .iter()
                .zip(watched)
                .filter(|(fd, _)| fd.revents().is_some_and(|r| !r.is_empty()))
                .map(|(_, index)| index)
                .collect();
            drop(fds);
            if !watches_ready.is_empty() {
                self.watches.read(&self.files, &watches_ready);
            }
            if zygote_ready
                && let Some(zygote) = &mut self.zygote
                && let Some(reply) = zygote.on_ready()
            {
                // Held or killed: either way no longer the job (its end is not reported as one).
                self.job = None;
                let _ = proto::send(self.ctl.as_fd(), &reply, &[]);
            }
            if !net.iter().all(PollFlags::is_empty)
                && let Some(forwarder) = &mut self.forwarder
            {
                forwarder.pump(&net);
            }
            if service_ready && let Some(service) = &mut self.service {
                service.pump(&self.files, false);
            }
            if child_ready {
                while let Ok(Some(_)) = signals.read_signal() {}
                if self.reap() {
                    return 0;
                }
            }
            self.tend_service();
            if sudo_ready.iter().any(|ready| *ready) {
                self.serve_sudo(&sudo_ready);
            }
            if ctl_ready {
                match proto::recv::<HostFrame>(self.ctl.as_fd()) {
                    // The host closed the socket or died: end the jail.
                    Ok(None) | Err(_) => return 0,
                    Ok(Some((HostFrame::Shutdown, _))) => return 0,
                    Ok(Some((frame, fds))) => self.handle(None, frame, fds),
                }
            }
            // Last first: closing a lane removes it from the list.
            for index in (0..lanes_ready.len()).rev() {
                if !lanes_ready[index] {
                    continue;
                }
                match proto::recv::<HostFrame>(self.lanes[index].ctl.as_fd()) {
                    Ok(Some((frame, fds))) => self.handle(Some(index), frame, fds),
                    // The host closed the lane (or sent garbage): its job goes with it.
                    Ok(None) | Err(_) => {
                        let lane = self.lanes.swap_remove(index);
                        self.watches.stop_owner(Some(lane.serial));
                        if let Some(pid) = lane.job {
                            let _ = kill(Pid::from_raw(-pid.as_raw()), Signal::SIGKILL);
                        }
                    }
                }
            }
            let (ctl, lanes) = (&self.ctl, &self.lanes);
            self.watches.flush(|owner| match owner {
                None => Some(ctl.as_fd()),
                Some(serial) => lanes.iter().find(|lane| lane.serial == serial).map(|lane| lane.ctl.as_fd()),
            });
            if !ctl_ready
                && !child_ready
                && let Some(zygote) = &mut self.zygote
                && zygote.wants_refill()
            {
                zygote.refill(self.userns.as_ref());
            }
        }
    }

    /// Reaps every exited process; reports the job's end. Returns whether PID 1 should exit.
    fn reap(&mut self) -> bool {
        loop {
            if let Some(service) = &self.service {
                service.kill_group_if_ended();
            }
            let status = match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) | Err(_) => return false,
                Ok(status) => status,
            };
            let (pid, code, signal) = match status {
                WaitStatus::Exited(pid, code) => (pid, Some(code), None),
                WaitStatus::Signaled(pid, signal, _) => (pid, None, Some(signal as i32)),
                _ => continue,
            };
            if let Some(zygote) = &mut self.zygote {
                zygote.reaped(pid, code, signal);
            }
            let exit = match (code, signal) {
                (Some(code), _) => ServiceExit::Code(code),
                (None, signal) => ServiceExit::Signal(signal.unwrap_or(0)),
            };
            if let Some(service) = &mut self.service
                && let Some(waiting) = service.reaped(pid, exit, Instant::now())
            {
                if !waiting.is_empty() {
                    service.pump(&self.files, true);
                    let status = service.status(Instant::now());
                    for owner in waiting {
                        self.send_to(owner, &status);
                    }
                }
                continue;
            }
            if let Some(sudo) = &mut self.sudo
                && let Some(index) = sudo.clients.iter().position(|client| client.command == Some(pid))
            {
                let client = sudo.clients.swap_remove(index);
                sudo::reply_on(client.socket.as_fd(), &Reply::Exited { code, signal });
                continue;
            }
            if self.job == Some(pid) {
                self.job = None;
                self.job_cgroup.clear();
                let _ = proto::send(self.ctl.as_fd(), &JailFrame::Exited { code, signal }, &[]);
                if self.one_shot {
                    return true;
                }
            } else if let Some(lane) = self.lanes.iter_mut().find(|lane| lane.job == Some(pid)) {
                lane.job = None;
                lane.cgroup.clear();
                let _ = proto::send(lane.ctl.as_fd(), &JailFrame::Exited { code, signal }, &[]);
            }
        }
    }

    /// The socket of connection `conn`.
    fn conn_fd(&self, conn: Conn) -> BorrowedFd<'_> {
        match conn {
            None => self.ctl.as_fd(),
            Some(index) => self.lanes[index].ctl.as_fd(),
        }
    }

    /// The owner a watch started on connection `conn` reports to.
    fn conn_owner(&self, conn: Conn) -> watch::Owner {
        conn.map(|index| self.lanes[index].serial)
    }

    /// The job slot of connection `conn`.
    fn conn_job(&mut self, conn: Conn) -> &mut Option<Pid> {
        match conn {
            None => &mut self.job,
            Some(index) => &mut self.lanes[index].job,
        }
    }

    fn handle(&mut self, conn: Conn, frame: HostFrame, fds: Vec<OwnedFd>) {
        let reply = match frame {
            HostFrame::Exec(exec) => {
                if self.conn_job(conn).is_some() {
                    exec_failed("busy", libc::EBUSY, "a job is already running".into())
                } else {
                    match self.spawn(&exec, fds, None) {
                        Ok(Spawned { pid, master, cgroup }) => {
                            *self.conn_job(conn) = Some(pid);
                            match conn {
                                None => self.job_cgroup = cgroup,
                                Some(index) => self.lanes[index].cgroup = cgroup,
                            }
                            let started = JailFrame::Started { pid: pid.as_raw() };
                            let _ = proto::send(
                                self.conn_fd(conn),
                                &started,
                                &master.as_ref().map(AsFd::as_fd).into_iter().collect::<Vec<_>>(),
                            );
                            return;
                        }
                        Err(failed) => failed,
                    }
                }
            }
            HostFrame::Kill if conn.is_some() => {
                // The job called setsid: its process group is its PID.
                if let Some(pid) = *self.conn_job(conn) {
                    let _ = kill(Pid::from_raw(-pid.as_raw()), Signal::SIGKILL);
                }
                return;
            }
            HostFrame::Lane => {
                let mut fds = fds;
                if let (Some(ctl), true, true) = (fds.pop(), fds.is_empty(), self.lanes.len() < MAX_LANES) {
                    self.lanes.push(Lane { ctl, job: None, cgroup: Vec::new(), serial: self.next_lane });
                    self.next_lane += 1;
                    self.lanes_opened = true;
                }
                return;
            }
            HostFrame::ListDir { path, depth, max_entries } => {
                let socket = self.conn_fd(conn);
                self.files.list_dir(&path, depth, max_entries, |frame| {
                    let _ = proto::send(socket, frame, &[]);
                });
                return;
            }
            HostFrame::Stat { path } => entry_frame(self.files.stat(&path)),
            HostFrame::MakeDir { path } => match self.files.make_dir(&path) {
                Ok(created) => JailFrame::DirMade { created },
                Err(failure) => failure.frame(),
            },
            HostFrame::Rename { from, to } => entry_frame(self.files.rename(&from, &to)),
            HostFrame::Remove { path } => match self.files.remove(&path) {
                Ok(()) => JailFrame::Removed,
                Err(failure) => failure.frame(),
            },
            HostFrame::Watch { id, path, recursive } => {
                let owner = self.conn_owner(conn);
                self.watches.start(&self.files, owner, id, &path, recursive)
            }
            HostFrame::Unwatch { id } => {
                let owner = self.conn_owner(conn);
                self.watches.stop(owner, id);
                return;
            }
            HostFrame::WriteFile { path, mode } => write_file(&self.files, &path, mode, fds),
            HostFrame::Service(service) => self.start_service(service, fds),
            HostFrame::ServiceStatus => match &mut self.service {
                Some(service) => {
                    service.pump(&self.files, true);
                    service.status(Instant::now())
                }
                None => JailFrame::NoService,
            },
            HostFrame::StopService { grace_ms } => {
                let owner = self.conn_owner(conn);
                match &mut self.service {
                    None => JailFrame::NoService,
                    Some(service) => match service.stop(grace_ms, owner, Instant::now()) {
                        StopReply::Later => return,
                        StopReply::Now => {
                            service.pump(&self.files, true);
                            service.status(Instant::now())
                        }
                    },
                }
            }
            HostFrame::ReadFile { path } => match self.files.open_read(&path) {
                Ok((file, size)) => {
                    let _ = proto::send(self.conn_fd(conn), &JailFrame::FileOpened { size }, &[file.as_fd()]);
                    return;
                }
                Err(failure) => failure.frame(),
            },
            other if conn.is_some() => {
                let name = format!("{other:?}");
                let name = name.split(['(', ' ', '{']).next().unwrap_or("frame");
                exec_failed("protocol", libc::EINVAL, format!("{name} is only taken on the first connection"))
            }
            frame => return self.handle_first(frame, fds),
        };
        let _ = proto::send(self.conn_fd(conn), &reply, &[]);
    }

    /// The frames only the first connection takes.
    fn handle_first(&mut self, frame: HostFrame, fds: Vec<OwnedFd>) {
        let reply = match frame {
            HostFrame::Setup(_) => exec_failed("protocol", 0, "the jail is already set up".into()),
            HostFrame::Shutdown
            | HostFrame::Exec(_)
            | HostFrame::Lane
            | HostFrame::WriteFile { .. }
            | HostFrame::ReadFile { .. }
            | HostFrame::ListDir { .. }
            | HostFrame::Stat { .. }
            | HostFrame::MakeDir { .. }
            | HostFrame::Rename { .. }
            | HostFrame::Remove { .. }
            | HostFrame::Watch { .. }
            | HostFrame::Unwatch { .. }
            | HostFrame::Service(_)
            | HostFrame::ServiceStatus
            | HostFrame::StopService { .. } => return,
            // The service runs in a cgroup of its own, as the lanes' jobs do: it is not the job's to kill.
            HostFrame::Kill if self.lanes_opened || self.service.is_some() => {
                kill_outside_lanes();
                return;
            }
            HostFrame::Kill => {
                // As PID 1, kill(-1) reaches every other process of the namespace.
                let _ = kill(Pid::from_raw(-1), Signal::SIGKILL);
                return;
            }
            HostFrame::Zygote(exec) => {
                let started = match &mut self.zygote {
                    None => Err(exec_failed("protocol", libc::EINVAL, "this jail was not set up for a zygote".into())),
                    Some(zygote) if !zygote.is_unused() || self.job.is_some() => {
                        Err(exec_failed("busy", libc::EBUSY, "the jail already has a zygote or a job".into()))
                    }
                    Some(zygote) => zygote.prepare(fds),
                };
                match started.and_then(|fds| {
                    let filter = self.zygote.as_ref().map(zygote::Zygote::filter);
                    self.spawn(&exec, fds, filter)
                }) {
                    Ok(Spawned { pid, .. }) => {
                        self.job = Some(pid);
                        if let Some(zygote) = &mut self.zygote {
                            zygote.started(pid);
                        }
                        JailFrame::Started { pid: pid.as_raw() }
                    }
                    Err(failed) => {
                        if let Some(zygote) = &mut self.zygote {
                            zygote.reset();
                        }
                        failed
                    }
                }
            }
            HostFrame::Fork(fork) => match &mut self.zygote {
                Some(zygote) => match zygote.fork(&fork, fds, self.userns.as_ref()) {
                    Ok((pid, pidfd)) => {
                        let _ =
                            proto::send(self.ctl.as_fd(), &JailFrame::Forked { pid: pid.as_raw() }, &[pidfd.as_fd()]);
                        return;
                    }
                    Err(failed) => failed,
                },
                None => JailFrame::ForkFailed { stage: "protocol".into(), message: "this jail has no zygote".into() },
            },
            HostFrame::OpenUpper => {
                let _ = proto::send(self.ctl.as_fd(), &JailFrame::UpperOpened, &[self.upper.as_fd()]);
                return;
            }
        };
        let _ = proto::send(self.ctl.as_fd(), &reply, &[]);
    }

    /// Starts the jail's service (see [`crate::service`]): answers its status once it runs, or why it does not.
    fn start_service(&mut self, service: proto::Service, fds: Vec<OwnedFd>) -> JailFrame {
        if self.service.is_some() {
            return exec_failed("busy", libc::EBUSY, "the jail has a service already (one per jail)".into());
        }
        let supervisor = match Supervisor::new(service, fds) {
            Ok(supervisor) => supervisor,
            Err(refused) => return refused,
        };
        self.service = Some(supervisor);
        let now = Instant::now();
        match self.run_service(now) {
            Ok(()) => self.service.as_ref().map_or(JailFrame::NoService, |service| service.status(now)),
            Err(failed) => {
                self.service = None;
                failed
            }
        }
    }

    /// Starts a run of the service.
    fn run_service(&mut self, now: Instant) -> Result<(), JailFrame> {
        let Some(service) = &self.service else { return Ok(()) };
        let exec = service.exec().clone();
        let fds = service.start_fds().map_err(|errno| exec_failed("pipe", errno as i32, errno.desc().into()))?;
        let started = self.spawn(&exec, fds, None)?;
        if let Some(service) = &mut self.service {
            service.started(started.pid, now);
        }
        Ok(())
    }

    /// Restarts the service when it is due, and kills it when a stop's grace has passed.
    fn tend_service(&mut self) {
        let now = Instant::now();
        let Some(service) = &mut self.service else { return };
        service.kill_if_due(now);
        if !service.restart_due(now) {
            return;
        }
        service.restarting();
        if let Err(failed) = self.run_service(now) {
            let message = match failed {
                JailFrame::ExecFailed { message, .. } => message,
                other => format!("{other:?}"),
            };
            if let Some(service) = &mut self.service {
                service.start_failed(&message, &self.files, now);
            }
        }
    }

    /// Sends `frame` on the connection `owner` names, if it is still open.
    fn send_to(&self, owner: watch::Owner, frame: &JailFrame) {
        let socket = match owner {
            None => Some(self.ctl.as_fd()),
            Some(serial) => self.lanes.iter().find(|lane| lane.serial == serial).map(|lane| lane.ctl.as_fd()),
        };
        if let Some(socket) = socket {
            let _ = proto::send(socket, frame, &[]);
        }
    }

    /// Spawns a job with `fds` as its descriptors 0, 1, 2 (and 3, 4 for a zygote), plus the program to copy in
    /// last when the job has one; `filter` is stacked on the jail's before `execve`. A job with a tty gets a
    /// terminal of the jail's as 0, 1 and 2 instead (`fds` start with the cgroup files), whose master is returned
    /// beside its PID.
    fn spawn(&self, exec: &Exec, mut fds: Vec<OwnedFd>, filter: Option<&BpfProgram>) -> Result<Spawned, JailFrame> {
        if exec.argv.is_empty() {
            return Err(exec_failed("argv", libc::EINVAL, "empty argument vector".into()));
        }
        let account = match &exec.user {
            None => None,
            Some(_) if self.userns.is_none() => {
                return Err(exec_failed(
                    "user",
                    libc::EPERM,
                    "running as a user needs the jail's user namespace".into(),
                ));
            }
            Some(name) => Some(
                users::lookup(&self.files, name).map_err(|e| exec_failed("user", e.errno() as i32, e.to_string()))?,
            ),
        };
        let as_user;
        let exec = match &account {
            None => exec,
            Some(account) => {
                as_user = for_account(exec, account);
                &as_user
            }
        };
        let mut master = None;
        if let Some(size) = exec.tty {
            if filter.is_some() {
                return Err(exec_failed("tty", libc::EINVAL, "a zygote has no terminal".into()));
            }
            let uid = account.as_ref().map_or(0, |account| account.uid);
            let owner = self.userns.as_ref().map(|userns| userns.map().base.saturating_add(uid));
            let pty = tty::Pty::open("/dev/pts/ptmx", size, owner)
                .map_err(|errno| exec_failed("tty", errno as i32, format!("opening a terminal: {}", errno.desc())))?;
            let copies = (0..2)
                .map(|_| pty.slave.try_clone())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| io_failed("tty", &e))?;
            fds.splice(0..0, std::iter::once(pty.slave).chain(copies));
            master = Some(pty.master);
        }
        let stdio = if filter.is_some() { zygote::ZYGOTE_FDS } else { 3 };
        let cgroup_files = exec.cgroup_files as usize;
        if cgroup_files > zygote::MAX_CGROUP_FILES {
            return Err(exec_failed("protocol", libc::EINVAL, format!("{cgroup_files} cgroup files")));
        }
        let expected = stdio + cgroup_files + usize::from(exec.program_copy.is_some());
        if fds.len() != expected {
            return Err(exec_failed(
                "protocol",
                libc::EINVAL,
                format!("{} descriptors, expected {expected}", fds.len()),
            ));
        }
        if let Some(target) = &exec.program_copy {
            let program = fds.pop().expect("counted above");
            copy_in(program, target, 0o755, self.userns.as_ref()).map_err(|e| io_failed("copy", &e))?;
        }
        let cgroup = fds.split_off(stdio);
        // Kept while the job runs, for the `sudo` commands it starts (a copy that fails leaves them in the jail's).
        let kept: Vec<OwnedFd> = cgroup.iter().filter_map(|fd| fd.try_clone().ok()).collect();
        let path = resolve(&exec.argv[0], &exec.env)
            .ok_or_else(|| exec_failed("lookup", libc::ENOENT, format!("{}: command not found", exec.argv[0])))?;
        let argv = cstrings(exec.argv.iter().map(String::as_str))?;
        let env =
            cstrings(exec.env.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().iter().map(String::as_str))?;
        let path = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| nul_error())?;
        let (report_r, report_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .map_err(|e| exec_failed("pipe", e as i32, e.desc().into()))?;
        // SAFETY: PID 1 is single-threaded, so the child may allocate and run arbitrary code.
        match unsafe { fork() } {
            Err(errno) => Err(exec_failed("fork", errno as i32, errno.desc().into())),
            Ok(ForkResult::Child) => {
                drop(report_r);
                // The report pipe must stay clear of the numbers the job's descriptors go to.
                let report_w = match nix::fcntl::fcntl(&report_w, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(16)) {
                    // SAFETY: F_DUPFD_CLOEXEC just returned this new descriptor; nothing else owns it.
                    Ok(moved) => unsafe { OwnedFd::from_raw_fd(moved) },
                    Err(_) => report_w,
                };
                let (stage, errno) = match join_cgroup(&cgroup) {
                    Ok(()) => self.become_job(exec, account.as_ref(), &fds, &path, &argv, &env, filter),
                    Err(errno) => ("cgroup", errno),
                };
                let mut report = fs::File::from(report_w);
                let _ = report.write_all(format!("{stage}\0{}", errno as i32).as_bytes());
                // SAFETY: _exit ends this forked child without running the parent's atexit handlers.
                unsafe { libc::_exit(127) }
            }
            Ok(ForkResult::Parent { child }) => {
                drop(report_w);
                drop((fds, cgroup));
                let mut text = String::new();
                let _ = fs::File::from(report_r).read_to_string(&mut text);
                if text.is_empty() {
                    return Ok(Spawned { pid: child, master, cgroup: kept });
                }
                let _ = waitpid(child, None);
                let (stage, errno) = text.split_once('\0').unwrap_or((text.as_str(), "0"));
                let errno = errno.parse().unwrap_or(0);
                let message = format!("{}: {stage}: {}", exec.argv[0], Errno::from_raw(errno).desc());
                Err(exec_failed(stage, errno, message))
            }
        }
    }

    /// Turns the forked child into the job. Returns only on failure, with the step and the error.
    #[allow(clippy::too_many_arguments)]
    fn become_job(
        &self,
        exec: &Exec,
        account: Option<&Account>,
        fds: &[OwnedFd],
        path: &CString,
        argv: &[CString],
        env: &[CString],
        filter: Option<&BpfProgram>,
    ) -> (&'static str, Errno) {
        macro_rules! check {
            ($stage:expr, $e:expr) => {
                if let Err(errno) = $e {
                    return ($stage, errno);
                }
            };
        }
        // The job is the OOM killer's first choice in the jail's cgroup, not PID 1: a job that fills it with kernel
        // memory (an inode flood) has a smaller resident set than PID 1, which the killer would otherwise pick,
        // ending the jail instead of the job. Raising needs no capability; it is done while this process still
        // has CAP_SYS_RESOURCE (where the host gave it one), so that the job cannot lower it again.
        check!("oom_score_adj", fs::write(OOM_SCORE_ADJ, OOM_SCORE_ADJ_MAX).map_err(|e| io_errno(&e)));
        check!("setsid", setsid());
        // Limits first: raising a hard limit needs a capability of the host's user namespace.
        check!("rlimits", set_limits(exec));
        // Before the descriptors move: the namespace's descriptor may sit on a number the job's streams take.
        if let Some(userns) = &self.userns {
            check!("user namespace", userns.enter_as_root());
        }
        // The sources are numbered 3 and up (PID 1's own 0..=2 are open). Any of them that sits on a lower target
        // than its own is moved above every target first, so no dup2 overwrites a source still to be used.
        let mut sources: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
        for source in &mut sources {
            if (*source as usize) < fds.len() {
                // SAFETY: F_DUPFD duplicates a descriptor this child owns onto a free number >= fds.len().
                let moved = unsafe { libc::fcntl(*source, libc::F_DUPFD, fds.len() as libc::c_int) };
                if moved < 0 {
                    return ("stdio", Errno::last());
                }
                *source = moved;
            }
        }
        for (target, source) in sources.iter().enumerate() {
            // SAFETY: dup2 onto 0..n replaces this child's low descriptors with ones it owns; the copy is not
            // close-on-exec.
            if unsafe { libc::dup2(*source, target as RawFd) } < 0 {
                return ("stdio", Errno::last());
            }
        }
        // Everything else but the CLOEXEC report pipe goes; the pipe closes itself on exec.
        check!("close fds", crate::sys::cloexec_from(fds.len() as u32));
        // A terminal on 0, 1 and 2 becomes the controlling terminal of the session `setsid` made above.
        if exec.tty.is_some() {
            check!("tty", tty::make_controlling());
        }
        check!("signals", sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None));
        // Every signal's default action, as a program a fresh shell starts has: an ignored disposition survives
        // `execve`, and this process has some a job must not get (`SIGPIPE`, which Rust ignores: `yes | head -1`
        // would print "Broken pipe"; `SIGINT`, ignored where the server was started in the background).
        for signal in Signal::iterator().filter(|s| !matches!(s, Signal::SIGKILL | Signal::SIGSTOP)) {
            let default = SigAction::new(SigHandler::SigDfl, SaFlags::empty(), SigSet::empty());
            // SAFETY: SIG_DFL installs no handler; this child is single-threaded and about to execve.
            check!("signals", unsafe { sigaction(signal, &default) });
        }
        // And the real-time ones, 32 to 64, glibc's own two included (which its `sigaction` refuses): through the
        // system call, with an all-zero `struct sigaction` (`SIG_DFL`, no flags, an empty mask) whatever its layout.
        let zero = [0u64; 4];
        for number in 32..=64 {
            // SAFETY: rt_sigaction reads a sigaction of at most 32 bytes from `zero` (all zeros: SIG_DFL) and writes
            // nothing back (a null old action); the set size is the kernel's 8 bytes.
            unsafe { libc::syscall(libc::SYS_rt_sigaction, number, zero.as_ptr(), std::ptr::null::<u8>(), 8) };
        }
        // A user's job enters its directory as the user (a directory the user may not enter is an error).
        if account.is_none() {
            check!("chdir", chdir(exec.cwd.as_str()));
        }
        check!("capabilities", drop_capabilities(account));
        if account.is_some() {
            check!("chdir", chdir(exec.cwd.as_str()));
        }
        if let Some(filter) = filter
            && seccomp::install_one(filter).is_err()
        {
            return ("seccomp", Errno::last());
        }
        match execve(path, argv, env) {
            Err(errno) => ("exec", errno),
            Ok(never) => match never {},
        }
    }
}

/// A job started: its PID, its terminal's master (with a tty) and copies of its cgroup files.
struct Spawned {
    pid: Pid,
    master: Option<OwnedFd>,
    cgroup: Vec<OwnedFd>,
}

/// `exec` for `account`: its `HOME`, `USER` and `LOGNAME`, and its home as the directory when none is given.
fn for_account(exec: &Exec, account: &Account) -> Exec {
    let mut exec = exec.clone();
    exec.env.retain(|(name, _)| !matches!(name.as_str(), "HOME" | "USER" | "LOGNAME"));
    exec.env.push(("HOME".into(), account.home.clone()));
    exec.env.push(("USER".into(), account.name.clone()));
    exec.env.push(("LOGNAME".into(), account.name.clone()));
    if exec.cwd.is_empty() {
        exec.cwd = account.home.clone();
    }
    exec
}

/// How deep a `sudo` client may be below the job whose cgroup its command joins.
const MAX_ANCESTRY: usize = 256;

impl Init {
    /// Serves the `sudo` listener and clients that `ready` (in [`Sudo::poll_fds`] order) says have something.
    fn serve_sudo(&mut self, ready: &[bool]) {
        let Some(sudo) = &mut self.sudo else { return };
        if ready.first() == Some(&true) {
            sudo.accept();
        }
        // Last first: a client that is done is removed.
        let clients = ready.len().saturating_sub(1).min(sudo.clients.len());
        for index in (0..clients).rev() {
            if !ready[index + 1] {
                continue;
            }
            let Some(sudo) = &self.sudo else { return };
            match sudo.read(index) {
                Incoming::Nothing => {}
                Incoming::Gone => {
                    let Some(sudo) = &mut self.sudo else { return };
                    let client = sudo.clients.swap_remove(index);
                    // The client went away (killed, or its job was): its command goes with it.
                    if let Some(pid) = client.command {
                        let _ = kill(Pid::from_raw(-pid.as_raw()), Signal::SIGKILL);
                    }
                }
                Incoming::Frame(sudo::ClientFrame::Signal(number)) => {
                    if let (Some(pid), Ok(signal)) = (sudo.clients[index].command, Signal::try_from(number)) {
                        let _ = kill(Pid::from_raw(-pid.as_raw()), signal);
                    }
                }
                Incoming::Request(request, fds) => self.start_sudo(index, request, fds),
            }
        }
    }

    /// Starts client `index`'s command as the jail's root, if it may.
    fn start_sudo(&mut self, index: usize, request: sudo::Request, fds: Vec<OwnedFd>) {
        let Some(sudo) = &self.sudo else { return };
        let (peer_pid, peer_uid) = sudo.clients[index].peer;
        let refused = |sudo: &mut Sudo, message: String| {
            sudo.reply(index, &Reply::Refused(message));
            sudo.clients.swap_remove(index);
        };
        if !users::may_sudo(&self.files, peer_uid) {
            let message = format!("user {peer_uid} is not in the sudoers (the {} group)", users::SUDO_GROUP);
            if let Some(sudo) = &mut self.sudo {
                refused(sudo, message);
            }
            return;
        }
        if fds.len() != 3 {
            if let Some(sudo) = &mut self.sudo {
                refused(sudo, format!("{} descriptors, expected 3 (stdin, stdout, stderr)", fds.len()));
            }
            return;
        }
        let mut fds = fds;
        let cgroup = self.cgroup_of(peer_pid);
        let cgroup_files = cgroup.len() as u32;
        fds.extend(cgroup);
        let exec = Exec {
            argv: request.argv,
            env: request.env,
            cwd: request.cwd,
            program_copy: None,
            nofile: SUDO_NOFILE,
            cpu_seconds: libc::RLIM_INFINITY,
            cgroup_files,
            tty: None,
            user: None,
        };
        let started = self.spawn(&exec, fds, None);
        let Some(sudo) = &mut self.sudo else { return };
        match started {
            Ok(Spawned { pid, .. }) => {
                sudo.clients[index].command = Some(pid);
                sudo.reply(index, &Reply::Started(pid.as_raw()));
            }
            Err(JailFrame::ExecFailed { message, .. }) => refused(sudo, message),
            Err(other) => refused(sudo, format!("{other:?}")),
        }
    }

    /// Copies of the cgroup files of the job `pid` descends from (none when it descends from none: a daemon).
    fn cgroup_of(&self, pid: i32) -> Vec<OwnedFd> {
        let mut current = pid;
        for _ in 0..MAX_ANCESTRY {
            let files = if self.job.is_some_and(|job| job.as_raw() == current) {
                Some(&self.job_cgroup)
            } else {
                self.lanes.iter().find(|lane| lane.job.is_some_and(|job| job.as_raw() == current)).map(|l| &l.cgroup)
            };
            if let Some(files) = files {
                return files.iter().filter_map(|fd| fd.try_clone().ok()).collect();
            }
            match sudo::parent_of(current) {
                Some(parent) if parent > 1 => current = parent,
                _ => return Vec::new(),
            }
        }
        Vec::new()
    }
}

/// Open files of a `sudo` command (the jail's `RLIMIT_NOFILE` for its jobs is the host's request; a command
/// started this way gets Debian's default).
const SUDO_NOFILE: u64 = 1024;

/// Kills every process of the jail but PID 1 that is in the jail's own cgroup: the first connection's jobs and
/// what they left behind, not the lanes' jobs (each in a child cgroup, which its `/proc/<pid>/cgroup` shows as a
/// path below this cgroup namespace's root). Repeats until a pass finds no new one (a process forked meanwhile;
/// a killed one cannot fork).
fn kill_outside_lanes() {
    let mut signalled = std::collections::HashSet::new();
    for _ in 0..1000 {
        let Ok(entries) = fs::read_dir("/proc") else { return };
        let mut killed = 0;
        for entry in entries.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
            if pid == 1 || signalled.contains(&pid) {
                continue;
            }
            let Ok(cgroups) = fs::read_to_string(format!("/proc/{pid}/cgroup")) else { continue };
            let in_lane = cgroups.lines().any(|line| line.splitn(3, ':').nth(2).is_some_and(|path| path != "/"));
            if !in_lane && kill(Pid::from_raw(pid), Signal::SIGKILL).is_ok() {
                signalled.insert(pid);
                killed += 1;
            }
        }
        if killed == 0 {
            return;
        }
    }
}

/// Moves the calling (single-threaded) process into the cgroup whose files are given, by writing `0` into each:
/// before it runs anything, so everything it starts is in that cgroup too. The files are close-on-exec.
fn join_cgroup(files: &[OwnedFd]) -> Result<(), Errno> {
    for file in files {
        nix::unistd::write(file, b"0")?;
    }
    Ok(())
}

fn exec_failed(stage: &str, errno: i32, message: String) -> JailFrame {
    JailFrame::ExecFailed { stage: stage.to_owned(), errno, message }
}

fn io_failed(stage: &str, err: &std::io::Error) -> JailFrame {
    exec_failed(stage, err.raw_os_error().unwrap_or(0), err.to_string())
}

fn nul_error() -> JailFrame {
    exec_failed("argv", libc::EINVAL, "an argument or environment entry contains a NUL byte".into())
}

fn cstrings<'a>(items: impl Iterator<Item = &'a str>) -> Result<Vec<CString>, JailFrame> {
    items.map(|s| CString::new(s).map_err(|_| nul_error())).collect()
}

/// Finds a program the way `execvp` does, with the job's `PATH` (not PID 1's).
fn resolve(program: &str, env: &[(String, String)]) -> Option<PathBuf> {
    if program.contains('/') {
        return Some(PathBuf::from(program));
    }
    if program.is_empty() {
        return None;
    }
    let path = env.iter().find(|(k, _)| k == "PATH").map(|(_, v)| v.as_str()).unwrap_or(DEFAULT_PATH);
    path.split(':')
        .filter(|dir| !dir.is_empty())
        .map(|dir| Path::new(dir).join(program))
        .find(|candidate| fs::metadata(candidate).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}

fn set_limits(exec: &Exec) -> Result<(), Errno> {
    setrlimit(Resource::RLIMIT_NOFILE, exec.nofile, exec.nofile)?;
    setrlimit(Resource::RLIMIT_CORE, 0, 0)?;
    setrlimit(Resource::RLIMIT_CPU, exec.cpu_seconds, exec.cpu_seconds.saturating_add(1))?;
    Ok(())
}

/// Drops every capability for good: the bounding and ambient sets, then effective/permitted/inheritable, with
/// the securebits that stop a root `execve` from regaining them, all locked. With an `account`, the process
/// becomes it (groups, then group, then user: in the jail's user namespace, while `CAP_SETUID` and
/// `CAP_SETGID` are still held) between the two.
fn drop_capabilities(account: Option<&Account>) -> Result<(), Errno> {
    const SECBIT_NOROOT: libc::c_ulong = 1 << 0;
    const SECBIT_NOROOT_LOCKED: libc::c_ulong = 1 << 1;
    const SECBIT_NO_SETUID_FIXUP: libc::c_ulong = 1 << 2;
    const SECBIT_NO_SETUID_FIXUP_LOCKED: libc::c_ulong = 1 << 3;
    const SECBIT_KEEP_CAPS_LOCKED: libc::c_ulong = 1 << 5;
    const SECBIT_NO_CAP_AMBIENT_RAISE: libc::c_ulong = 1 << 6;
    const SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED: libc::c_ulong = 1 << 7;
    let last_cap = fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse::<libc::c_ulong>().ok())
        .unwrap_or(40);
    let bits = SECBIT_NOROOT
        | SECBIT_NOROOT_LOCKED
        | SECBIT_NO_SETUID_FIXUP
        | SECBIT_NO_SETUID_FIXUP_LOCKED
        | SECBIT_KEEP_CAPS_LOCKED
        | SECBIT_NO_CAP_AMBIENT_RAISE
        | SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED;
    // SAFETY: prctl(PR_SET_SECUREBITS) takes an integer argument and only changes this process's attributes.
    if unsafe { libc::prctl(libc::PR_SET_SECUREBITS, bits, 0, 0, 0) } < 0 {
        return Err(Errno::last());
    }
    for cap in 0..=last_cap {
        // SAFETY: PR_CAPBSET_DROP takes a capability number; an unknown one fails with EINVAL, which we ignore.
        unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) };
    }
    // SAFETY: PR_CAP_AMBIENT_CLEAR_ALL takes no pointers.
    if unsafe { libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) } < 0 {
        return Err(Errno::last());
    }
    if let Some(account) = account {
        let groups: Vec<nix::unistd::Gid> = account.groups.iter().map(|g| nix::unistd::Gid::from_raw(*g)).collect();
        nix::unistd::setgroups(&groups)?;
        let (gid, uid) = (nix::unistd::Gid::from_raw(account.gid), nix::unistd::Uid::from_raw(account.uid));
        nix::unistd::setresgid(gid, gid, gid)?;
        nix::unistd::setresuid(uid, uid, uid)?;
    }
    #[repr(C)]
    struct CapHeader {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct CapData {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
    let header = CapHeader { version: LINUX_CAPABILITY_VERSION_3, pid: 0 };
    let data = [CapData { effective: 0, permitted: 0, inheritable: 0 }; 2];
    // SAFETY: capset reads a version-3 header and two data structs, both alive and correctly laid out (repr(C)).
    if unsafe { libc::syscall(libc::SYS_capset, &header, data.as_ptr()) } < 0 {
        return Err(Errno::last());
    }
    Ok(())
}

/// Copies a descriptor's contents to a new file at `target`, creating its parent directories; what it creates
/// belongs to the jail's root.
fn copy_in(source: OwnedFd, target: &str, mode: u32, userns: Option<&UserNamespace>) -> std::io::Result<()> {
    if let Some(parent) = Path::new(target).parent() {
        create_dirs(parent, userns)?;
    }
    let mut src = fs::File::from(source);
    let mut dst = fs::OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(target)?;
    std::io::copy(&mut src, &mut dst)?;
    dst.set_permissions(fs::Permissions::from_mode(mode))?;
    if let Some(userns) = userns {
        userns.give(Path::new(target))?;
    }
    Ok(())
}

/// Writes a file the host sent (see [`Files::write`]). Its set-user-ID and set-group-ID bits are dropped: PID 1
/// runs under the jail's filter too, and what the host writes into a grant obeys the rule jobs do (see
/// [`seccomp`]).
fn write_file(files: &Files, path: &str, mode: u32, mut fds: Vec<OwnedFd>) -> JailFrame {
    let Some(source) = fds.pop().filter(|_| fds.is_empty()) else {
        return JailFrame::FileError { errno: libc::EINVAL, message: "expected one descriptor".into() };
    };
    let mut src = fs::File::from(source);
    if let Err(err) = std::io::Seek::rewind(&mut src) {
        return file_error(&err);
    }
    match files.write(path, mode, &mut src) {
        Ok(()) => JailFrame::FileWritten,
        Err(failure) => failure.frame(),
    }
}

fn entry_frame(entry: FileResult<proto::Entry>) -> JailFrame {
    match entry {
        Ok(entry) => JailFrame::Entry { entry },
        Err(failure) => failure.frame(),
    }
}

fn file_error(err: &std::io::Error) -> JailFrame {
    JailFrame::FileError { errno: err.raw_os_error().unwrap_or(0), message: err.to_string() }
}

fn io_errno(err: &std::io::Error) -> Errno {
    Errno::from_raw(err.raw_os_error().unwrap_or(libc::EIO))
}
