//! The zygote: a job held stopped after its setup, and forked — a real `fork()` of it, memory shared
//! copy-on-write by the kernel — into a fresh jail of its own for each fork.
//!
//! **Starting.** The zygote is spawned like a job, with three descriptors more: 0 is a pipe PID 1 never writes, 3
//! a pipe to say "ready" on, 4 a socket PID 1 later passes each fork's standard streams through. Its filter is
//! the jail's plus [`crate::seccomp::zygote_filter`], so it has nothing PID 1 of a zygote jail keeps (`ptrace`, the
//! mount calls, `setns`). When it writes to 3, PID 1 kills every other process of the jail (nothing else may
//! live beside the forks), seizes it with `ptrace`, checks it is blocked in `read(0, …)`, single-threaded and holds
//! no shared writable mapping (forks would share it), and keeps it stopped: from then on **the zygote never runs
//! code of its own again**; PID 1 only injects system calls into it ([`crate::inject`]).
//!
//! **Forking.** PID 1 injects `clone(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC |
//! CLONE_NEWUTS | CLONE_PARENT)` into the zygote — allowed by the jail's filter only through its `TRACE` verdict,
//! which only PID 1, the tracer, answers. The child, traced from birth and stopped, is PID 1 of a new PID
//! namespace, alone in new mount, network, IPC and UTS namespaces owned by a new user namespace. Before it runs a
//! single instruction of its own, PID 1:
//! 1. writes its ID maps (a helper in the jobs' user namespace: the same IDs as the zygote);
//! 2. builds its filesystem, from helpers that join its namespaces: a private tmpfs holding a new overlay whose
//!    lower layer is the zygote's root and whose upper layer is the fork's own, a procfs of the fork's PID
//!    namespace (made in the jail's mount namespace, where procfs may be mounted, and moved into the fork's),
//!    masked like the jail's, a fresh `/dev` and `/dev/shm`, the grants; then `pivot_root`s it into that root and
//!    sets its hostname and loopback;
//! 3. injects into it: a scratch page, `recvmsg` of the fork's stdin/stdout/stderr from descriptor 4, `dup3`s
//!    onto 0–2, `close_range(3, ~0)`, `chdir` back to the zygote's working directory (in the new root), `capset`
//!    to nothing (`no_new_privs` is inherited, so no `execve` gives any back), `munmap`;
//! 4. checks from outside what it got: new namespaces, descriptors 0–2 exactly the ones sent and nothing else, no
//!    capability, `no_new_privs`, the seccomp filter, one thread;
//! 5. moves it into the fork's cgroup (files the host opened), hands the host a pidfd, and lets it go: it resumes
//!    the zygote's `read(0, …)`, on its own stdin.
//!
//! A fork is a one-job sandbox: when its first process exits its PID namespace ends; PID 1 writes the exit
//! status to the status pipe the host passed, as a JSON `Exited` frame. The zygote's own process is never
//! reachable from a fork (another PID namespace), nor a fork from another.

use std::collections::HashMap;
use std::ffi::CString;
use std::fs;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::Path;

use nix::errno::Errno;
use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sched::{CloneFlags, setns};
use nix::sys::signal::{Signal, kill};
use nix::sys::socket::{AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType, sendmsg, socketpair};
use nix::sys::wait::waitpid;
use nix::unistd::{ForkResult, Pid, chdir, fork, pipe2, pivot_root, sethostname};
use seccompiler::BpfProgram;

use crate::inject::{InjectError, ResumePoint, Tracee};
use crate::proto::{Bind, Fork, JailFrame};
use crate::steps::{OLD_ROOT, StepError, bind_onto, confine_proc, loopback_up, mount_dev_at, scratch_options, step};
use crate::userns::UserNamespace;

/// How many descriptors the zygote starts with: stdin, stdout, stderr, the ready pipe, the fork channel.
pub const ZYGOTE_FDS: usize = 5;

/// The zygote's descriptor the fork channel is on.
const CHANNEL_FD: u64 = 4;

/// The zygote's root, bound (alone, without the mounts under it, read-only) where forks take it as their lower
/// layer: overlayfs cannot use a mount with locked mounts under it, and every mount under the jail's `/` is locked
/// in a fork's mount namespace.
const ZYGOTE_ROOT: &str = "/run/strata/.zygote/root";

/// Where a fork's private tmpfs goes while its root is built.
const FORK_SCRATCH: &str = "/run/strata/.zygote/fork";

/// The namespaces each fork gets.
const FORK_CLONE_FLAGS: u64 = (libc::CLONE_NEWUSER
    | libc::CLONE_NEWNS
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUTS
    | libc::CLONE_PARENT
    | libc::SIGCHLD) as u64;

/// The namespaces compared between a fork and its zygote.
const FORK_NAMESPACES: &[&str] = &["user", "mnt", "pid", "net", "ipc", "uts"];

/// A zygote held by PID 1.
#[derive(Debug)]
struct Held {
    tracee: Tracee,
    resume: ResumePoint,
    /// Its working directory, restored in each fork.
    cwd: String,
    /// PID 1's end of the fork channel, and a second descriptor of the zygote's end (to drain it after a failed
    /// fork, so no fork ever receives another's streams).
    channel: OwnedFd,
    channel_peer: OwnedFd,
    /// Keeps the zygote's stdin open (it is never written): a fork resumes its read on its own stdin instead.
    _stdin: OwnedFd,
}

#[derive(Debug)]
enum State {
    Unused,
    Starting { pid: Option<Pid>, ready: OwnedFd, stdin: OwnedFd, channel: OwnedFd, channel_peer: OwnedFd },
    Ready(Box<Held>),
    Gone,
}

/// A fork made ahead of its request: cloned, its ID maps written, its root built, its working directory set and
/// its capabilities dropped, descriptors above 2 closed but the fork channel's — held stopped until a request
/// gives it its streams and its cgroup.
#[derive(Debug)]
struct Prepared {
    tracee: Tracee,
    /// Its scratch page (still mapped; unmapped once the request's steps are done).
    page: u64,
    /// Its tmpfs's size.
    scratch_bytes: u64,
}

/// How many forks are kept made ahead of their requests.
const POOL: usize = 2;

/// PID 1's zygote: its state, the forks made ahead, and its forks' status pipes.
#[derive(Debug)]
pub struct Zygote {
    filter: BpfProgram,
    binds: Vec<Bind>,
    /// The jail's tmpfs size: what forks made ahead get (a request for another size gets a fork made for it).
    scratch_bytes: u64,
    state: State,
    pool: Vec<Prepared>,
    /// Set when making a fork ahead failed: no more are made ahead (each request then makes its own, and reports).
    pool_failed: bool,
    made: u64,
    forks: HashMap<i32, OwnedFd>,
}

fn failed(stage: &str, message: impl std::fmt::Display) -> JailFrame {
    JailFrame::ForkFailed { stage: stage.to_owned(), message: message.to_string() }
}

fn inject_failed(stage: &'static str) -> impl FnOnce(InjectError) -> JailFrame {
    move |err| failed(stage, err)
}

impl Zygote {
    /// A zygote jail's, before the zygote starts.
    pub fn new(filter: BpfProgram, binds: Vec<Bind>, scratch_bytes: u64) -> Zygote {
        Zygote {
            filter,
            binds,
            scratch_bytes,
            state: State::Unused,
            pool: Vec::new(),
            pool_failed: false,
            made: 0,
            forks: HashMap::new(),
        }
    }

    /// Whether a fork should be made ahead now (PID 1 does it when it has nothing else to do).
    pub fn wants_refill(&self) -> bool {
        matches!(self.state, State::Ready(_)) && !self.pool_failed && self.pool.len() < POOL
    }

    /// Makes one fork ahead of its request.
    pub fn refill(&mut self, userns: Option<&UserNamespace>) {
        match self.make_ahead(self.scratch_bytes, userns) {
            Ok(prepared) => self.pool.push(prepared),
            Err(_) => self.pool_failed = true,
        }
    }

    /// The zygote's extra seccomp filter.
    pub fn filter(&self) -> &BpfProgram {
        &self.filter
    }

    /// Whether no zygote was started yet.
    pub fn is_unused(&self) -> bool {
        matches!(self.state, State::Unused)
    }

    /// The ready pipe, while the zygote sets itself up.
    pub fn ready_fd(&self) -> Option<BorrowedFd<'_>> {
        match &self.state {
            State::Starting { ready, .. } => Some(ready.as_fd()),
            _ => None,
        }
    }

    /// Makes the zygote's descriptors from the host's stdout and stderr: stdin, stdout, stderr, ready, channel.
    pub fn prepare(&mut self, mut fds: Vec<OwnedFd>) -> Result<Vec<OwnedFd>, JailFrame> {
        let io = |e: Errno| JailFrame::ExecFailed { stage: "zygote".into(), errno: e as i32, message: e.desc().into() };
        if fds.len() != 2 {
            return Err(JailFrame::ExecFailed {
                stage: "protocol".into(),
                errno: libc::EINVAL,
                message: format!("{} descriptors, expected 2 (stdout, stderr)", fds.len()),
            });
        }
        let (stdin_r, stdin_w) = pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(io)?;
        let (ready_r, ready_w) = pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(io)?;
        let (channel, peer) =
            socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC).map_err(io)?;
        let channel_peer = nix::unistd::dup(&peer).map_err(io)?;
        // SAFETY: fcntl(F_SETFD) on a descriptor PID 1 owns: PID 1's copy of the zygote's end stays
        // close-on-exec (dup cleared the flag).
        unsafe { libc::fcntl(channel_peer.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
        let stderr = fds.pop().expect("counted");
        let stdout = fds.pop().expect("counted");
        self.state = State::Starting { pid: None, ready: ready_r, stdin: stdin_w, channel, channel_peer };
        Ok(vec![stdin_r, stdout, stderr, ready_w, peer])
    }

    /// The zygote was spawned as `pid`.
    pub fn started(&mut self, started: Pid) {
        if let State::Starting { pid, .. } = &mut self.state {
            *pid = Some(started);
        }
    }

    /// The zygote could not be spawned.
    pub fn reset(&mut self) {
        self.state = State::Unused;
    }

    /// The ready pipe is readable: holds the zygote, or refuses it (killed). `None` while there is nothing to
    /// say (the zygote closed the pipe without a word: its end is reported when it exits).
    pub fn on_ready(&mut self) -> Option<JailFrame> {
        let State::Starting { pid: Some(pid), ready, .. } = &self.state else {
            return None;
        };
        let pid = *pid;
        let mut byte = [0u8; 1];
        let said = fs::File::from(ready.try_clone().ok()?).read(&mut byte).unwrap_or(0);
        let State::Starting { stdin, channel, channel_peer, .. } = std::mem::replace(&mut self.state, State::Gone)
        else {
            return None;
        };
        if said == 0 {
            // Closed without a word: keep waiting for its exit (reported as the job's end).
            self.state = State::Gone;
            return None;
        }
        match hold(pid) {
            Ok((tracee, resume, cwd)) => {
                self.state = State::Ready(Box::new(Held { tracee, resume, cwd, channel, channel_peer, _stdin: stdin }));
                Some(JailFrame::ZygoteReady { pid: pid.as_raw() })
            }
            Err(message) => {
                let _ = kill(pid, Signal::SIGKILL);
                Some(JailFrame::ZygoteRefused { message })
            }
        }
    }

    /// A process ended: the zygote (forks are over), or a fork (its status goes to the host).
    pub fn reaped(&mut self, pid: Pid, code: Option<i32>, signal: Option<i32>) {
        let is_zygote = match &self.state {
            State::Ready(held) => held.tracee.pid() == pid,
            State::Starting { pid: Some(zygote), .. } => *zygote == pid,
            _ => false,
        };
        if is_zygote {
            self.state = State::Gone;
            // Forks made ahead are killed (and reaped) as they are dropped.
            for prepared in self.pool.drain(..) {
                drop(KillOnDrop(Some(prepared.tracee.pid())));
            }
        }
        if let Some(status) = self.forks.remove(&pid.as_raw()) {
            let frame = serde_json::to_vec(&JailFrame::Exited { code, signal }).unwrap_or_default();
            let _ = fs::File::from(status).write_all(&frame);
        }
    }

    /// Forks the zygote (see the module's documentation): takes a fork made ahead (or makes one), gives it its
    /// streams and its cgroup, checks it and lets it run. `fds`: stdin, stdout, stderr, status, cgroup files.
    pub fn fork(
        &mut self,
        request: &Fork,
        fds: Vec<OwnedFd>,
        userns: Option<&UserNamespace>,
    ) -> Result<(Pid, OwnedFd), JailFrame> {
        if !matches!(self.state, State::Ready(_)) {
            return Err(failed("zygote", "there is no zygote ready to fork (it was refused, or it ended)"));
        }
        if fds.len() < 4 || fds.len() > 4 + MAX_CGROUP_FILES {
            return Err(failed(
                "protocol",
                format!("{} descriptors, expected 4 to {}", fds.len(), 4 + MAX_CGROUP_FILES),
            ));
        }
        let mut fds = fds.into_iter();
        let stdio: Vec<OwnedFd> = fds.by_ref().take(3).collect();
        let status = fds.next().expect("counted");
        let cgroup_files: Vec<OwnedFd> = fds.collect();
        let ahead = self.pool.iter().position(|p| p.scratch_bytes == request.scratch_bytes);
        let prepared = match ahead {
            Some(at) => self.pool.remove(at),
            None => self.make_ahead(request.scratch_bytes, userns)?,
        };
        let State::Ready(held) = &self.state else {
            return Err(failed("zygote", "the zygote ended"));
        };
        let pid = prepared.tracee.pid();
        let child = KillOnDrop(Some(pid));
        let mut streams = stdio.iter().map(|fd| fd.as_fd()).collect::<Vec<_>>();
        streams.extend(cgroup_files.iter().map(|fd| fd.as_fd()));
        let sent = send_fds(&held.channel, &streams);
        let given = sent.and_then(|()| give_streams(&prepared, cgroup_files.len()));
        if let Err(err) = given {
            drain(&held.channel_peer);
            return Err(err);
        }
        verify(pid, held.tracee.pid(), &stdio)?;
        let pidfd = crate::sys::pidfd_open(pid.as_raw()).map_err(|errno| failed("pidfd", errno.desc()))?;
        prepared.tracee.release(&held.resume).map_err(inject_failed("release"))?;
        child.disarm();
        self.forks.insert(pid.as_raw(), status);
        Ok((pid, pidfd))
    }

    /// Makes a fork up to the point where only its streams and cgroup are missing (see [`Prepared`]).
    fn make_ahead(&mut self, scratch_bytes: u64, userns: Option<&UserNamespace>) -> Result<Prepared, JailFrame> {
        let State::Ready(held) = &self.state else {
            return Err(failed("zygote", "there is no zygote ready to fork (it was refused, or it ended)"));
        };
        let (rc, _) = held.tracee.syscall(libc::SYS_clone, [FORK_CLONE_FLAGS, 0, 0, 0, 0, 0]).map_err(|err| {
            // The zygote died under us, or is unusable: no fork will work again.
            failed("clone", err)
        })?;
        if rc < 0 {
            return Err(failed("clone", Errno::from_raw(-rc as i32).desc()));
        }
        let pid = Pid::from_raw(rc as i32);
        let child = KillOnDrop(Some(pid));
        let tracee = Tracee::adopt_child(&held.tracee, pid, "/proc").map_err(inject_failed("clone"))?;
        write_id_maps(pid, userns)?;
        self.made += 1;
        let hostname = format!("strata-fork-{}", self.made);
        build_fork(pid, &hostname, scratch_bytes, &self.binds, userns)?;
        let page = drop_privileges(&tracee, &held.cwd)?;
        child.disarm();
        Ok(Prepared { tracee, page, scratch_bytes })
    }
}

/// Kills (and reaps) a half-made fork unless disarmed.
struct KillOnDrop(Option<Pid>);

impl KillOnDrop {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(pid) = self.0 {
            let _ = kill(pid, Signal::SIGKILL);
            let _ = waitpid(pid, Some(nix::sys::wait::WaitPidFlag::__WALL));
        }
    }
}

/// Seizes the ready zygote and checks it can be one. Returns the tracee, where it resumes, and its cwd.
fn hold(pid: Pid) -> Result<(Tracee, ResumePoint, String), String> {
    // Nothing but PID 1, the zygote and (later) its forks may live in the jail: a process left behind would
    // share the forks' user ID and see their PIDs.
    if let Ok(entries) = fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(other) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
            if other != 1 && other != pid.as_raw() {
                let _ = kill(Pid::from_raw(other), Signal::SIGKILL);
            }
        }
    }
    let (tracee, resume) =
        Tracee::seize_at(pid, libc::SYS_read, 0, "/proc").map_err(|e| format!("holding the zygote: {e}"))?;
    let status = fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| format!("/proc/{pid}/status: {e}"))?;
    let threads = status_field(&status, "Threads").unwrap_or("?");
    if threads != "1" {
        return Err(format!(
            "the zygote has {threads} threads; only a single-threaded process can be forked whole (for numpy, set \
             OPENBLAS_NUM_THREADS=1 and OMP_NUM_THREADS=1)"
        ));
    }
    let maps = fs::read_to_string(format!("/proc/{pid}/maps")).map_err(|e| format!("/proc/{pid}/maps: {e}"))?;
    if let Some(shared) = maps
        .lines()
        .find(|line| line.split_whitespace().nth(1).is_some_and(|p| p.starts_with("rw") && p.ends_with('s')))
    {
        return Err(format!("the zygote holds a shared writable mapping, which its forks would share: {shared}"));
    }
    for dir in [ZYGOTE_ROOT, FORK_SCRATCH] {
        fs::DirBuilder::new().recursive(true).mode(0o755).create(dir).map_err(|e| format!("{dir}: {e}"))?;
    }
    mount(Some("/"), ZYGOTE_ROOT, None::<&str>, MsFlags::MS_BIND, None::<&str>)
        .and_then(|()| {
            let flags =
                MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
            mount(None::<&str>, ZYGOTE_ROOT, None::<&str>, flags, None::<&str>)
        })
        .map_err(|e| format!("binding the zygote's root for its forks: {}", e.desc()))?;
    let cwd = fs::read_link(format!("/proc/{pid}/cwd"))
        .ok()
        .and_then(|p| p.to_str().map(str::to_owned))
        .filter(|p| p.starts_with('/') && !p.ends_with(" (deleted)") && p.len() < 2048)
        .unwrap_or_else(|| "/".to_owned());
    Ok((tracee, resume, cwd))
}

fn status_field<'a>(status: &'a str, name: &str) -> Option<&'a str> {
    status.lines().find_map(|line| line.strip_prefix(name)?.strip_prefix(':').map(str::trim))
}

/// Runs `work` in a forked child of PID 1 (single-threaded, so anything may run there); its error comes back as
/// text.
fn in_child(work: impl FnOnce() -> Result<(), String>) -> Result<(), String> {
    let (report_r, report_w) = pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| format!("pipe: {}", e.desc()))?;
    // SAFETY: the caller (PID 1 or one of its helpers) is single-threaded.
    match unsafe { fork() } {
        Err(errno) => Err(format!("fork: {}", errno.desc())),
        Ok(ForkResult::Child) => {
            drop(report_r);
            let code = match work() {
                Ok(()) => 0,
                Err(message) => {
                    let _ = fs::File::from(report_w).write_all(message.as_bytes());
                    1
                }
            };
            // SAFETY: _exit ends this helper without running PID 1's exit handlers.
            unsafe { libc::_exit(code) }
        }
        Ok(ForkResult::Parent { child }) => {
            drop(report_w);
            let mut text = String::new();
            let _ = fs::File::from(report_r).read_to_string(&mut text);
            let status = waitpid(child, None);
            match status {
                Ok(nix::sys::wait::WaitStatus::Exited(_, 0)) if text.is_empty() => Ok(()),
                _ if !text.is_empty() => Err(text),
                other => Err(format!("helper ended as {other:?}")),
            }
        }
    }
}

fn errno_text(what: &str) -> impl FnOnce(Errno) -> String + '_ {
    move |e| format!("{what}: {}", e.desc())
}

/// Writes the fork's user namespace's ID maps: the jobs' IDs, one to one (the fork's root is the zygote's).
fn write_id_maps(pid: Pid, userns: Option<&UserNamespace>) -> Result<(), JailFrame> {
    let count = userns.map_or(65_536, |u| u.map().count);
    let write = move || -> Result<(), String> {
        for file in ["uid_map", "gid_map"] {
            fs::write(format!("/proc/{pid}/{file}"), format!("0 0 {count}\n"))
                .map_err(|e| format!("/proc/{pid}/{file}: {e}"))?;
        }
        Ok(())
    };
    match userns {
        // The writer must live in the parent of the fork's namespace: the jobs' namespace.
        Some(userns) => in_child(|| {
            userns.enter().map_err(errno_text("joining the jobs' user namespace"))?;
            write()
        }),
        None => write(),
    }
    .map_err(|message| failed("id maps", message))
}

fn open_ns(pid: Pid, name: &str) -> Result<fs::File, JailFrame> {
    fs::File::open(format!("/proc/{pid}/ns/{name}")).map_err(|e| failed("namespaces", format!("{name}: {e}")))
}

/// Builds the fork's root and identity from helpers that join its namespaces (see the module documentation).
fn build_fork(
    pid: Pid,
    hostname: &str,
    scratch_bytes: u64,
    binds: &[Bind],
    userns: Option<&UserNamespace>,
) -> Result<(), JailFrame> {
    let pid_ns = open_ns(pid, "pid")?;
    let mnt_ns = open_ns(pid, "mnt")?;
    let uts_ns = open_ns(pid, "uts")?;
    let net_ns = open_ns(pid, "net")?;
    in_child(|| {
        // Children of this helper are born in the fork's PID namespace: the procfs it mounts is the fork's.
        setns(&pid_ns, CloneFlags::CLONE_NEWPID).map_err(errno_text("joining the fork's PID namespace"))?;
        in_child(|| {
            let proc = fs_mount_proc().map_err(errno_text("procfs"))?;
            setns(&mnt_ns, CloneFlags::CLONE_NEWNS).map_err(errno_text("joining the fork's mount namespace"))?;
            setns(&uts_ns, CloneFlags::CLONE_NEWUTS).map_err(errno_text("joining the fork's UTS namespace"))?;
            sethostname(hostname).map_err(errno_text("hostname"))?;
            setns(&net_ns, CloneFlags::CLONE_NEWNET).map_err(errno_text("joining the fork's network namespace"))?;
            loopback_up().map_err(errno_text("loopback"))?;
            build_root(&proc, scratch_bytes, binds, userns)
                .map_err(|StepError { stage, message }| format!("{stage}: {message}"))
        })
    })
    .map_err(|message| failed("filesystem", message))
}

/// A new procfs instance of this process's PID namespace, detached (`fsopen`/`fsmount`): made here, in the jail's
/// mount namespace, since the fork's (owned by its user namespace, with a masked procfs in it) may not mount one.
fn fs_mount_proc() -> Result<OwnedFd, Errno> {
    // SAFETY: fsopen takes a NUL-terminated name and flags; the result is a new descriptor.
    let fs_fd = unsafe { libc::syscall(libc::SYS_fsopen, c"proc".as_ptr(), libc::FSOPEN_CLOEXEC) };
    if fs_fd < 0 {
        return Err(Errno::last());
    }
    // SAFETY: fsopen just returned this descriptor.
    let fs_fd = unsafe { OwnedFd::from_raw_fd(fs_fd as RawFd) };
    // SAFETY: FSCONFIG_CMD_CREATE takes no key or value.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fs_fd.as_raw_fd(),
            libc::FSCONFIG_CMD_CREATE,
            std::ptr::null::<u8>(),
            std::ptr::null::<u8>(),
            0,
        )
    };
    if rc < 0 {
        return Err(Errno::last());
    }
    let attrs = libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV | libc::MOUNT_ATTR_NOEXEC;
    // SAFETY: fsmount takes the configured context's descriptor, flags and mount attributes.
    let mnt = unsafe { libc::syscall(libc::SYS_fsmount, fs_fd.as_raw_fd(), libc::FSMOUNT_CLOEXEC, attrs) };
    if mnt < 0 {
        return Err(Errno::last());
    }
    // SAFETY: fsmount just returned this descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(mnt as RawFd) })
}

/// In the fork's mount namespace: its tmpfs, overlay, procfs, `/dev`, grants, then `pivot_root`.
fn build_root(
    proc: &OwnedFd,
    scratch_bytes: u64,
    binds: &[Bind],
    userns: Option<&UserNamespace>,
) -> Result<(), StepError> {
    let options = scratch_options(scratch_bytes);
    step(
        "fork tmpfs",
        mount(
            Some("strata-fork"),
            FORK_SCRATCH,
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some(options.as_str()),
        ),
    )?;
    let (upper, work, root) =
        (format!("{FORK_SCRATCH}/upper"), format!("{FORK_SCRATCH}/work"), format!("{FORK_SCRATCH}/root"));
    for dir in [&upper, &work, &root] {
        step("fork dirs", fs::DirBuilder::new().mode(0o755).create(dir))?;
    }
    if let Some(userns) = userns {
        step("fork dirs", userns.give(Path::new(&upper)))?;
    }
    // The lower layer is the zygote's root (the jail's overlay: image and setup layer), which nothing changes
    // any more: the zygote is stopped and alone.
    let overlay =
        format!("lowerdir={ZYGOTE_ROOT},upperdir={upper},workdir={work},redirect_dir=off,metacopy=off,index=off");
    step(
        "fork overlay",
        mount(Some("strata-fork-root"), root.as_str(), Some("overlay"), MsFlags::empty(), Some(overlay.as_str())),
    )?;
    let proc_dir = format!("{root}/proc");
    let proc_target =
        CString::new(proc_dir.as_str()).map_err(|e| StepError { stage: "/proc".into(), message: e.to_string() })?;
    // SAFETY: move_mount takes a detached mount's descriptor (empty path) and a NUL-terminated target path.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            proc.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_FDCWD,
            proc_target.as_ptr(),
            libc::MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    if rc < 0 {
        return Err(StepError { stage: "/proc".into(), message: Errno::last().desc().into() });
    }
    // The masks are bound from an empty file of the fork's own tmpfs: the jail's `/dev/null` is a locked mount
    // here (`noexec` locked on), which a read-only remount of a bind of it would have to drop.
    let null = format!("{FORK_SCRATCH}/null");
    step("/proc", fs::OpenOptions::new().create(true).truncate(true).write(true).open(&null))?;
    confine_proc(&proc_dir, &null)?;
    mount_dev_at(&format!("{root}/dev"), "/dev")?;
    for bind in binds {
        let target = format!("{root}{}", bind.guest);
        step(
            format!("grant {}", bind.guest),
            mount(
                Some(bind.guest.as_str()),
                target.as_str(),
                None::<&str>,
                MsFlags::MS_BIND | MsFlags::MS_REC,
                None::<&str>,
            ),
        )?;
        if bind.read_only {
            step(format!("grant {}", bind.guest), bind_onto(Path::new(&target), &target, true))?;
        }
    }
    let old_root = format!("{root}{OLD_ROOT}");
    step("pivot_root", fs::DirBuilder::new().mode(0o700).create(&old_root))?;
    step("pivot_root", pivot_root(root.as_str(), old_root.as_str()))?;
    step("pivot_root", chdir("/"))?;
    step("detach the zygote's root", umount2(OLD_ROOT, MntFlags::MNT_DETACH))?;
    step("detach the zygote's root", fs::remove_dir(OLD_ROOT))?;
    Ok(())
}

/// Queues the fork's standard streams and cgroup files on the fork channel (the fork's injected `recvmsg` takes
/// them).
fn send_fds(channel: &OwnedFd, fds: &[BorrowedFd<'_>]) -> Result<(), JailFrame> {
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let cmsg = [ControlMessage::ScmRights(&raw)];
    sendmsg::<()>(channel.as_raw_fd(), &[std::io::IoSlice::new(b"s")], &cmsg, MsgFlags::MSG_DONTWAIT, None)
        .map(drop)
        .map_err(|e| failed("stdio", e.desc()))
}

/// Throws away whatever is queued for the zygote's end of the channel.
fn drain(peer: &OwnedFd) {
    let mut buf = [0u8; 16];
    // Each message's descriptors are owned as received, and closed as they are dropped.
    // A closed peer reads as an empty message without descriptors: nothing more is queued.
    while strata_fdpass::recv_with::<0>(peer.as_fd(), &mut buf, MsgFlags::MSG_DONTWAIT)
        .is_ok_and(|received| received.len > 0 || !received.fds.is_empty())
    {}
}

/// The most cgroup files a fork request carries (one per cgroup v1 hierarchy).
pub(crate) const MAX_CGROUP_FILES: usize = 6;

/// The scratch page's layout in the fork.
const PAGE: u64 = 4096;
const IOV: u64 = 0;
const MSGHDR: u64 = 16;
const CONTROL: u64 = 256;
const CONTROL_LEN: u64 = 128;
const DATA: u64 = 512;
const ZERO: u64 = 520;
const CWD: u64 = 1024;
const ROOT_DIR: u64 = 3072;
const CAP_HEADER: u64 = 3584;
const CAP_DATA: u64 = 3592;

/// Injects what a fork gets before any request: a scratch page, its working directory, no capability, no
/// descriptor above 2 but the fork channel. Returns the page's address.
fn drop_privileges(fork: &Tracee, cwd: &str) -> Result<u64, JailFrame> {
    let page = fork
        .call(
            "mmap",
            libc::SYS_mmap,
            [
                0,
                PAGE,
                (libc::PROT_READ | libc::PROT_WRITE) as u64,
                (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u64,
                u64::MAX,
                0,
            ],
        )
        .map_err(inject_failed("scratch page"))?;
    let mut image = vec![0u8; PAGE as usize];
    let put = |image: &mut Vec<u8>, at: u64, bytes: &[u8]| {
        image[at as usize..at as usize + bytes.len()].copy_from_slice(bytes)
    };
    // struct iovec { base, len }
    put(&mut image, IOV, &(page + DATA).to_ne_bytes());
    put(&mut image, IOV + 8, &1u64.to_ne_bytes());
    // struct msghdr { name, namelen(+pad), iov, iovlen, control, controllen, flags(+pad) }
    put(&mut image, MSGHDR + 16, &(page + IOV).to_ne_bytes());
    put(&mut image, MSGHDR + 24, &1u64.to_ne_bytes());
    put(&mut image, MSGHDR + 32, &(page + CONTROL).to_ne_bytes());
    put(&mut image, MSGHDR + 40, &CONTROL_LEN.to_ne_bytes());
    put(&mut image, ZERO, b"0");
    put(&mut image, CWD, cwd.as_bytes());
    put(&mut image, ROOT_DIR, b"/\0");
    // struct __user_cap_header_struct { version = _LINUX_CAPABILITY_VERSION_3, pid = 0 }, then two zeroed data.
    put(&mut image, CAP_HEADER, &0x2008_0522u32.to_ne_bytes());
    fork.write_mem(page, &image).map_err(inject_failed("scratch page"))?;
    if fork.call("chdir", libc::SYS_chdir, [page + CWD, 0, 0, 0, 0, 0]).is_err() {
        fork.call("chdir", libc::SYS_chdir, [page + ROOT_DIR, 0, 0, 0, 0, 0]).map_err(inject_failed("chdir"))?;
    }
    fork.call("capset", libc::SYS_capset, [page + CAP_HEADER, page + CAP_DATA, 0, 0, 0, 0])
        .map_err(inject_failed("capabilities"))?;
    fork.call("close_range", libc::SYS_close_range, [3, CHANNEL_FD - 1, 0, 0, 0, 0])
        .map_err(inject_failed("close descriptors"))?;
    fork.call("close_range", libc::SYS_close_range, [CHANNEL_FD + 1, u64::from(u32::MAX), 0, 0, 0, 0])
        .map_err(inject_failed("close descriptors"))?;
    Ok(page)
}

/// Injects a request's part: `recvmsg` of its streams and cgroup files from the fork channel, `dup3` of the
/// streams onto 0–2, a write of `0` into each cgroup file (a process moving itself takes the kernel's fast
/// path), then every descriptor above 2 closed and the scratch page unmapped.
fn give_streams(prepared: &Prepared, cgroup_files: usize) -> Result<(), JailFrame> {
    let (fork, page) = (&prepared.tracee, prepared.page);
    let got = fork
        .call(
            "recvmsg",
            libc::SYS_recvmsg,
            [CHANNEL_FD, page + MSGHDR, (libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC) as u64, 0, 0, 0],
        )
        .map_err(|e| failed("stdio", format!("{e} (the zygote's descriptor 4 is not the fork channel any more?)")))?;
    let mut control = [0u8; CONTROL_LEN as usize];
    fork.read_mem(page + CONTROL, &mut control).map_err(inject_failed("stdio"))?;
    let word = |at: usize| u64::from_ne_bytes(control[at..at + 8].try_into().expect("8 bytes"));
    let int = |at: usize| i32::from_ne_bytes(control[at..at + 4].try_into().expect("4 bytes"));
    let count = 3 + cgroup_files;
    if got != 1 || word(0) != (16 + 4 * count) as u64 || int(8) != libc::SOL_SOCKET || int(12) != libc::SCM_RIGHTS {
        return Err(failed("stdio", "the fork did not receive its streams"));
    }
    let fds: Vec<i32> = (0..count).map(|i| int(16 + 4 * i)).collect();
    for (target, fd) in fds.iter().take(3).enumerate() {
        fork.call("dup3", libc::SYS_dup3, [*fd as u64, target as u64, 0, 0, 0, 0]).map_err(inject_failed("stdio"))?;
    }
    for fd in &fds[3..] {
        let wrote = fork.call("write", libc::SYS_write, [*fd as u64, page + ZERO, 1, 0, 0, 0]);
        if wrote != Ok(1) {
            return Err(failed("cgroup", format!("the fork could not join its cgroup: {wrote:?}")));
        }
    }
    fork.call("close_range", libc::SYS_close_range, [3, u64::from(u32::MAX), 0, 0, 0, 0])
        .map_err(inject_failed("close descriptors"))?;
    fork.call("munmap", libc::SYS_munmap, [page, PAGE, 0, 0, 0, 0]).map_err(inject_failed("scratch page"))?;
    Ok(())
}

/// Checks the fork from outside before it runs: what it must have, it has.
fn verify(pid: Pid, zygote: Pid, stdio: &[OwnedFd]) -> Result<(), JailFrame> {
    let refuse = |what: String| Err(failed("verify", what));
    for ns in FORK_NAMESPACES {
        let mine = fs::read_link(format!("/proc/{pid}/ns/{ns}")).ok();
        let its = fs::read_link(format!("/proc/{zygote}/ns/{ns}")).ok();
        if mine.is_none() || mine == its {
            return refuse(format!("the fork shares the zygote's {ns} namespace"));
        }
    }
    let status = fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| failed("verify", e))?;
    for (field, want) in [
        ("NoNewPrivs", "1"),
        ("Seccomp", "2"),
        ("Threads", "1"),
        ("CapEff", "0000000000000000"),
        ("CapPrm", "0000000000000000"),
        ("CapInh", "0000000000000000"),
        ("CapAmb", "0000000000000000"),
    ] {
        let got = status_field(&status, field);
        if got != Some(want) {
            return refuse(format!("the fork's {field} is {got:?}, not {want}"));
        }
    }
    let mut fds: Vec<String> = fs::read_dir(format!("/proc/{pid}/fd"))
        .map_err(|e| failed("verify", e))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    fds.sort();
    if fds != ["0", "1", "2"] {
        return refuse(format!("the fork holds descriptors {fds:?}, not exactly 0, 1, 2"));
    }
    for (n, fd) in stdio.iter().enumerate() {
        let theirs = fs::metadata(format!("/proc/{pid}/fd/{n}")).map_err(|e| failed("verify", e))?;
        let ours = fs::File::from(fd.try_clone().map_err(|e| failed("verify", e))?)
            .metadata()
            .map_err(|e| failed("verify", e))?;
        if (theirs.dev(), theirs.ino()) != (ours.dev(), ours.ino()) {
            return refuse(format!("the fork's descriptor {n} is not the stream it was sent"));
        }
    }
    Ok(())
}
