//! Running one exec: `fork` + `execve` (the agent is multi-threaded, so the child calls only
//! async-signal-safe functions on memory prepared before the fork), then one thread per exec that streams its
//! output, feeds its standard input and reports its exit.
//!
//! The child gets a session (and process group) of its own, so a signal reaches everything it started; default
//! signal dispositions (the Rust runtime ignores `SIGPIPE`) and an empty signal mask; the requested rlimits;
//! standard input from a pipe or `/dev/null`; standard output and error to pipes. A step that fails is reported
//! through a close-on-exec pipe as the step and its `errno`.
//!
//! The exec ends when its main process exits: output already written is drained, output that background
//! processes write later (into pipes they inherited) is not waited for.

use std::collections::VecDeque;
use std::ffi::CString;
use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use nix::errno::Errno;
use nix::fcntl::{FcntlArg, OFlag, fcntl};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::unistd::pipe2;
use strata_guest_proto::{ExecLimits, ExecRequest, ExitStatus, MAX_CHUNK, OutputStream, TtySize};

use crate::reap::{Exit, ExitSlot, Reaper};

/// The `PATH` used to find a program when the exec's environment has none.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The most output drained per stream after the main process exits (a background writer could go on forever).
const DRAIN_LIMIT: usize = 16 << 20;

/// An exec that could not start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct SpawnError {
    /// The OS error number.
    pub errno: i32,
    /// What failed, naming the program.
    pub message: String,
}

impl SpawnError {
    fn new(errno: Errno, message: impl Into<String>) -> SpawnError {
        SpawnError { errno: errno as i32, message: message.into() }
    }
}

/// The steps of the child, as reported through the report pipe.
const STAGES: [&str; 6] = ["setsid", "stdio", "signals", "rlimits", "chdir", "exec"];

/// Everything the child needs, prepared before `fork` (the child may not allocate).
struct ChildPlan {
    program: CString,
    argv: Vec<CString>,
    env: Vec<CString>,
    cwd: CString,
    rlimits: Vec<(RlimitResource, libc::rlim_t, libc::rlim_t)>,
}

/// `setrlimit`'s resource type differs between the C libraries.
#[cfg(target_env = "gnu")]
type RlimitResource = libc::__rlimit_resource_t;
#[cfg(not(target_env = "gnu"))]
type RlimitResource = libc::c_int;

impl ChildPlan {
    fn new(request: &ExecRequest) -> Result<ChildPlan, SpawnError> {
        let Some(name) = request.argv.first() else {
            return Err(SpawnError::new(Errno::EINVAL, "empty argument vector"));
        };
        let program = resolve(name, &request.env)
            .ok_or_else(|| SpawnError::new(Errno::ENOENT, format!("{name}: command not found")))?;
        let nul = || SpawnError::new(Errno::EINVAL, "an argument, variable or path contains a NUL byte");
        let program = CString::new(program.into_os_string().into_encoded_bytes()).map_err(|_| nul())?;
        let argv = request.argv.iter().map(|a| CString::new(a.as_str())).collect::<Result<Vec<_>, _>>();
        let mut env = Vec::with_capacity(request.env.len());
        for (key, value) in &request.env {
            if key.is_empty() || key.contains('=') {
                return Err(SpawnError::new(Errno::EINVAL, format!("invalid environment variable name {key:?}")));
            }
            env.push(CString::new(format!("{key}={value}")).map_err(|_| nul())?);
        }
        let cwd = if request.cwd.is_empty() { "/" } else { request.cwd.as_str() };
        Ok(ChildPlan {
            program,
            argv: argv.map_err(|_| nul())?,
            env,
            cwd: CString::new(cwd).map_err(|_| nul())?,
            rlimits: rlimits(&request.limits),
        })
    }
}

fn rlimits(limits: &ExecLimits) -> Vec<(RlimitResource, libc::rlim_t, libc::rlim_t)> {
    let mut list = vec![(libc::RLIMIT_CORE, 0, 0)];
    if let Some(n) = limits.open_files {
        list.push((libc::RLIMIT_NOFILE, n, n));
    }
    if let Some(s) = limits.cpu_seconds {
        list.push((libc::RLIMIT_CPU, s, s.saturating_add(1)));
    }
    list
}

/// Finds a program the way `execvp` does, with the exec's `PATH` (not the agent's).
pub fn resolve(program: &str, env: &[(String, String)]) -> Option<PathBuf> {
    if program.contains('/') {
        return Some(PathBuf::from(program));
    }
    if program.is_empty() {
        return None;
    }
    let path = env.iter().find(|(k, _)| k == "PATH").map(|(_, v)| v.as_str()).unwrap_or(DEFAULT_PATH);
    path.split(':').filter(|dir| !dir.is_empty()).map(|dir| Path::new(dir).join(program)).find(|candidate| {
        std::fs::metadata(candidate).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
}

/// A started exec, before its thread takes over.
#[derive(Debug)]
pub struct Spawned {
    /// The main process (also its process group).
    pub pid: i32,
    stdout: File,
    stderr: File,
    stdin: Option<File>,
    exit: Arc<ExitSlot>,
    /// Its terminal's master, when it runs on one ([`ExecRequest::tty`]), for resizes.
    terminal: Option<Arc<OwnedFd>>,
}

/// A terminal of the guest's `devpts` for an exec: the master the agent keeps, the slave the exec gets.
struct Pty {
    master: OwnedFd,
    slave: OwnedFd,
}

impl Pty {
    fn open(size: TtySize) -> Result<Pty, SpawnError> {
        let failed = |what: &str, errno: Errno| SpawnError::new(errno, format!("terminal: {what}: {}", errno.desc()));
        let master = nix::fcntl::open(
            "/dev/ptmx",
            OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .map_err(|e| failed("/dev/ptmx", e))?;
        let unlock: libc::c_int = 0;
        // SAFETY: TIOCSPTLCK reads one int from a pointer that outlives the call.
        if unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSPTLCK, &unlock) } < 0 {
            return Err(failed("unlock", Errno::last()));
        }
        resize(&master, size).map_err(|e| failed("size", e))?;
        let flags = libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC;
        // SAFETY: TIOCGPTPEER takes open flags by value and returns a new descriptor of the slave, or -1.
        let slave = unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCGPTPEER, flags) };
        if slave < 0 {
            return Err(failed("slave", Errno::last()));
        }
        // SAFETY: the kernel just returned this descriptor; nothing else owns it.
        let slave = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(slave) };
        Ok(Pty { master, slave })
    }
}

/// Sets the window size of the terminal whose master `fd` is (its foreground process group gets `SIGWINCH`).
pub fn resize(fd: &OwnedFd, size: TtySize) -> Result<(), Errno> {
    let winsize = libc::winsize { ws_row: size.rows, ws_col: size.cols, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: TIOCSWINSZ reads a winsize from a pointer that outlives the call.
    if unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &winsize) } < 0 { Err(Errno::last()) } else { Ok(()) }
}

/// Starts `request`'s program.
pub fn spawn(request: &ExecRequest, reaper: &Reaper) -> Result<Spawned, SpawnError> {
    let plan = ChildPlan::new(request)?;
    let argv = pointers(&plan.argv);
    let env = pointers(&plan.env);
    let pipe =
        |what: &str| pipe2(OFlag::O_CLOEXEC).map_err(|e| SpawnError::new(e, format!("{what} pipe: {}", e.desc())));
    let copy = |fd: &OwnedFd| fd.try_clone().map_err(|e| SpawnError::new(io_errno(&e), format!("dup: {e}")));
    // On a terminal: the slave is all three streams, the master is read for output and written with input, and
    // stderr's reader is a pipe already at its end.
    let (terminal, stdin_child, stdin_parent, (stdout_r, stdout_w), (stderr_r, stderr_w)) = match request.tty {
        Some(size) => {
            let Pty { master, slave } = Pty::open(size)?;
            let (stderr_r, _) = pipe("stderr")?;
            let streams = (copy(&slave)?, copy(&slave)?);
            (Some(Arc::new(copy(&master)?)), slave, Some(copy(&master)?), (master, streams.0), (stderr_r, streams.1))
        }
        None => {
            let (stdin_child, stdin_parent): (OwnedFd, Option<OwnedFd>) = if request.stdin {
                let (r, w) = pipe("stdin")?;
                (r, Some(w))
            } else {
                let null =
                    File::open("/dev/null").map_err(|e| SpawnError::new(io_errno(&e), format!("/dev/null: {e}")))?;
                (null.into(), None)
            };
            (None, stdin_child, stdin_parent, pipe("stdout")?, pipe("stderr")?)
        }
    };
    let tty = terminal.is_some();
    let (report_r, report_w) = pipe("report")?;
    let stdio = [stdin_child.as_raw_fd(), stdout_w.as_raw_fd(), stderr_w.as_raw_fd()];

    let (pid, exit) = reaper
        .fork(|| {
            // SAFETY: fork() takes no arguments. In the child only `child` runs, which calls async-signal-safe
            // functions on memory prepared before the fork and never returns.
            match unsafe { libc::fork() } {
                -1 => Err(Errno::last()),
                0 => child(&plan, &argv, &env, stdio, tty, report_w.as_raw_fd()),
                pid => Ok(pid),
            }
        })
        .map_err(|e| SpawnError::new(e, format!("fork: {}", e.desc())))?;
    drop((stdin_child, stdout_w, stderr_w, report_w));

    let mut report = [0u8; 5];
    let got = read_report(File::from(report_r), &mut report);
    if got > 0 {
        // The child failed before or at execve and exits at once; let the reaper have it.
        let _ = wait_slot(&exit);
        let stage = STAGES.get(usize::from(report[0])).copied().unwrap_or("start");
        let errno = Errno::from_raw(i32::from_le_bytes([report[1], report[2], report[3], report[4]]));
        let name = request.argv.first().map(String::as_str).unwrap_or("");
        let message = match stage {
            "exec" => format!("{name}: {}", errno.desc()),
            "chdir" => format!("{}: {}", request.cwd, errno.desc()),
            _ => format!("{name}: {stage}: {}", errno.desc()),
        };
        return Err(SpawnError::new(errno, message));
    }
    let nonblocking = |fd: OwnedFd| -> File {
        let _ = fcntl(&fd, FcntlArg::F_SETFL(OFlag::O_NONBLOCK));
        File::from(fd)
    };
    Ok(Spawned {
        pid,
        stdout: nonblocking(stdout_r),
        stderr: nonblocking(stderr_r),
        stdin: stdin_parent.map(nonblocking),
        exit,
        terminal,
    })
}

fn io_errno(err: &std::io::Error) -> Errno {
    Errno::from_raw(err.raw_os_error().unwrap_or(libc::EIO))
}

fn read_report(mut pipe: File, buf: &mut [u8; 5]) -> usize {
    let mut got = 0;
    while got < buf.len() {
        match pipe.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => break,
        }
    }
    got
}

/// Blocks until the slot holds the exit.
fn wait_slot(slot: &ExitSlot) -> Exit {
    loop {
        if let Some(exit) = slot.take() {
            return exit;
        }
        let mut fds = [PollFd::new(slot.ready_fd(), PollFlags::POLLIN)];
        let _ = poll(&mut fds, PollTimeout::NONE);
    }
}

fn pointers(strings: &[CString]) -> Vec<*const libc::c_char> {
    strings.iter().map(|s| s.as_ptr()).chain(std::iter::once(std::ptr::null())).collect()
}

/// The kernel's `struct sigaction` (x86_64 and arm64 layout), for `rt_sigaction`.
#[repr(C)]
struct KernelSigaction {
    handler: libc::sighandler_t,
    flags: libc::c_ulong,
    restorer: usize,
    mask: u64,
}

/// The forked child: becomes the program or reports why not and exits. Async-signal-safe calls only.
fn child(
    plan: &ChildPlan,
    argv: &[*const libc::c_char],
    env: &[*const libc::c_char],
    stdio: [RawFd; 3],
    tty: bool,
    report: RawFd,
) -> ! {
    let fail = |stage: u8| -> ! {
        let errno = Errno::last_raw().to_le_bytes();
        let message = [stage, errno[0], errno[1], errno[2], errno[3]];
        // SAFETY: write() reads `message`, which outlives the call; _exit() ends the child without running the
        // parent's atexit handlers or destructors.
        unsafe {
            libc::write(report, message.as_ptr().cast(), message.len());
            libc::_exit(127)
        }
    };
    // SAFETY: every call below is async-signal-safe and reads only memory prepared before the fork (the plan,
    // the pointer arrays, which point into the plan's CStrings, and plain integers).
    unsafe {
        if libc::setsid() < 0 {
            fail(0);
        }
        // The pipes were created after fds 0..=2 were open, so no source is among the targets.
        for (target, fd) in stdio.iter().enumerate() {
            if libc::dup2(*fd, target as RawFd) < 0 {
                fail(1);
            }
        }
        // The terminal on 0..=2 becomes the controlling terminal of the session made above.
        if tty && libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
            fail(1);
        }
        // Through the system call: the C library refuses the signals it reserves (32..=34), which the agent
        // may have inherited ignored.
        let default = KernelSigaction { handler: libc::SIG_DFL, flags: 0, restorer: 0, mask: 0 };
        for signal in 1..=64 {
            if signal != libc::SIGKILL && signal != libc::SIGSTOP {
                libc::syscall(libc::SYS_rt_sigaction, signal, &raw const default, std::ptr::null_mut::<u8>(), 8usize);
            }
        }
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        if libc::pthread_sigmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut()) != 0 {
            fail(2);
        }
        for &(resource, soft, hard) in &plan.rlimits {
            let limit = libc::rlimit { rlim_cur: soft, rlim_max: hard };
            if libc::setrlimit(resource, &limit) < 0 {
                fail(3);
            }
        }
        if libc::chdir(plan.cwd.as_ptr()) < 0 {
            fail(4);
        }
        // Descriptors above 2 that are not close-on-exec (a library's, a test harness's) stay out of the job.
        libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, libc::CLOSE_RANGE_CLOEXEC);
        libc::execve(plan.program.as_ptr(), argv.as_ptr(), env.as_ptr());
    }
    fail(5)
}

/// Standard input waiting to be written to an exec; filled by the connection's reader, drained by the exec's
/// thread.
#[derive(Debug)]
pub struct StdinQueue {
    state: Mutex<StdinState>,
    doorbell: EventFd,
}

#[derive(Debug, Default)]
struct StdinState {
    chunks: VecDeque<Vec<u8>>,
    /// Offset into the first chunk already written.
    offset: usize,
    closed: bool,
    /// The exec closed its end (or ended): further input is dropped.
    gone: bool,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl StdinQueue {
    fn new() -> Result<Arc<StdinQueue>, Errno> {
        let doorbell = EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?;
        Ok(Arc::new(StdinQueue { state: Mutex::new(StdinState::default()), doorbell }))
    }

    /// Queues bytes for the exec's standard input.
    pub fn push(&self, data: Vec<u8>) {
        let mut state = lock(&self.state);
        if state.gone || state.closed || data.is_empty() {
            return;
        }
        state.chunks.push_back(data);
        drop(state);
        let _ = self.doorbell.write(1);
    }

    /// Closes the exec's standard input once the queued bytes are written.
    pub fn close(&self) {
        lock(&self.state).closed = true;
        let _ = self.doorbell.write(1);
    }
}

/// Where an exec's thread sends what it has to say.
pub trait ExecSink {
    /// A chunk of output (at most [`MAX_CHUNK`] bytes).
    fn output(&self, stream: OutputStream, data: &[u8]);
}

/// What the exec's thread reports at the end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    /// How the main process ended.
    pub exit: Exit,
    /// Bytes written to standard output and error.
    pub bytes: [u64; 2],
}

/// A started exec with its stdin queue, ready for its thread.
#[derive(Debug)]
pub struct Running {
    spawned: Spawned,
    stdin: Option<Arc<StdinQueue>>,
    output_cap: Option<u64>,
}

impl Running {
    /// Wraps a spawned exec (and creates its stdin queue when it reads from the host).
    pub fn new(spawned: Spawned, output_cap: Option<u64>) -> Result<Running, SpawnError> {
        let stdin = match spawned.stdin {
            Some(_) => Some(StdinQueue::new().map_err(|e| SpawnError::new(e, format!("eventfd: {}", e.desc())))?),
            None => None,
        };
        Ok(Running { spawned, stdin, output_cap })
    }

    /// The main process's PID.
    pub fn pid(&self) -> i32 {
        self.spawned.pid
    }

    /// The exec's terminal's master, for [`strata_guest_proto::HostMessage::Resize`].
    pub fn terminal(&self) -> Option<Arc<OwnedFd>> {
        self.spawned.terminal.clone()
    }

    /// The queue for [`strata_guest_proto::HostMessage::StdinData`].
    pub fn stdin_queue(&self) -> Option<Arc<StdinQueue>> {
        self.stdin.clone()
    }

    /// Streams output and stdin until the main process exits; `exited` runs as soon as it is known to have
    /// (before its exit is collected), then the exit is returned.
    pub fn run(self, sink: &dyn ExecSink, exited: impl FnOnce()) -> Finished {
        let Running { spawned, stdin: queue, output_cap } = self;
        let Spawned { stdout, stderr, stdin, exit, terminal, .. } = spawned;
        // Held until the output is drained: the master's copy in the exec table may go first.
        let _terminal = terminal;
        let mut streams = [Some(stdout), Some(stderr)];
        let mut stdin = stdin;
        let mut bytes = [0u64; 2];
        let mut buf = vec![0u8; MAX_CHUNK];
        let kinds = [OutputStream::Stdout, OutputStream::Stderr];
        let forward = |index: usize, data: &[u8], bytes: &mut [u64; 2]| {
            let allowed = match output_cap {
                Some(cap) => usize::try_from(cap.saturating_sub(bytes[index])).unwrap_or(usize::MAX).min(data.len()),
                None => data.len(),
            };
            if allowed > 0 {
                sink.output(kinds[index], &data[..allowed]);
            }
            bytes[index] = bytes[index].saturating_add(data.len() as u64);
        };
        loop {
            let want_stdin = match (&stdin, &queue) {
                (Some(_), Some(queue)) => {
                    let state = lock(&queue.state);
                    if state.chunks.is_empty() && state.closed { None } else { Some(!state.chunks.is_empty()) }
                }
                _ => None,
            };
            if want_stdin.is_none() {
                // Closed by the host (with everything written), or never used.
                stdin = None;
            }
            let mut fds = Vec::with_capacity(5);
            fds.push(PollFd::new(exit.ready_fd(), PollFlags::POLLIN));
            let mut slots = [None; 2];
            for (i, stream) in streams.iter().enumerate() {
                if let Some(stream) = stream {
                    slots[i] = Some(fds.len());
                    fds.push(PollFd::new(stream.as_fd(), PollFlags::POLLIN));
                }
            }
            let mut doorbell_slot = None;
            let mut stdin_slot = None;
            if let Some(queue) = &queue {
                doorbell_slot = Some(fds.len());
                fds.push(PollFd::new(queue.doorbell.as_fd(), PollFlags::POLLIN));
                if let (Some(pipe), Some(true)) = (&stdin, want_stdin) {
                    stdin_slot = Some(fds.len());
                    fds.push(PollFd::new(pipe.as_fd(), PollFlags::POLLOUT));
                }
            }
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) | Err(Errno::EINTR) => {}
                Err(_) => break,
            }
            let ready = |slot: Option<usize>| {
                slot.and_then(|i| fds.get(i)).and_then(PollFd::revents).is_some_and(|r| !r.is_empty())
            };
            let exited = ready(Some(0));
            let ready_streams = [ready(slots[0]), ready(slots[1])];
            let doorbell = ready(doorbell_slot);
            let stdin_ready = ready(stdin_slot);
            drop(fds);

            for (i, is_ready) in ready_streams.into_iter().enumerate() {
                if !is_ready {
                    continue;
                }
                let Some(stream) = &mut streams[i] else { continue };
                match stream.read(&mut buf) {
                    Ok(0) => streams[i] = None,
                    Ok(n) => forward(i, &buf[..n], &mut bytes),
                    Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
                    Err(_) => streams[i] = None,
                }
            }
            if let Some(queue) = &queue {
                if doorbell {
                    let _ = queue.doorbell.read();
                }
                if stdin_ready
                    && let Some(pipe) = &mut stdin
                    && !write_stdin(pipe, queue)
                {
                    stdin = None;
                }
            }
            if exited {
                break;
            }
        }
        // The main process has exited: what it wrote is in the pipes. Take that, not what stragglers write later.
        for (i, stream) in streams.iter_mut().enumerate() {
            let Some(stream) = stream else { continue };
            let mut drained = 0;
            while drained < DRAIN_LIMIT {
                match stream.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        drained += n;
                        forward(i, &buf[..n], &mut bytes);
                    }
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
        }
        drop(streams);
        drop(stdin);
        if let Some(queue) = &queue {
            let mut state = lock(&queue.state);
            state.gone = true;
            state.chunks.clear();
        }
        exited();
        Finished { exit: wait_slot(&exit), bytes }
    }
}

/// Writes queued stdin to the pipe until it would block; false when the exec no longer reads it.
fn write_stdin(pipe: &mut File, queue: &StdinQueue) -> bool {
    let mut state = lock(&queue.state);
    loop {
        let offset = state.offset;
        let Some(chunk) = state.chunks.front() else { return true };
        match pipe.write(&chunk[offset..]) {
            Ok(n) => {
                if offset + n >= chunk.len() {
                    state.chunks.pop_front();
                    state.offset = 0;
                } else {
                    state.offset = offset + n;
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => return true,
            Err(_) => {
                state.gone = true;
                state.chunks.clear();
                return false;
            }
        }
    }
}

/// Whether an exit was the OOM killer's: killed by `SIGKILL` while the kernel's OOM kill count went up.
pub fn oom_killed(status: ExitStatus, oom_kills_before: Option<u64>, oom_kills_after: Option<u64>) -> bool {
    matches!((status, oom_kills_before, oom_kills_after), (ExitStatus::Signal(libc::SIGKILL), Some(b), Some(a)) if a > b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn programs_are_found_in_the_jobs_path() {
        let env = vec![("PATH".to_owned(), "/nonexistent:/bin:/usr/bin".to_owned())];
        assert!(resolve("sh", &env).is_some_and(|p| p.ends_with("sh")));
        assert_eq!(resolve("/x/y", &env), Some(PathBuf::from("/x/y")));
        assert_eq!(resolve("no-such-program-anywhere", &env), None);
        assert_eq!(resolve("", &env), None);
    }

    #[test]
    fn bad_requests_fail_before_fork() {
        let request = |argv: &[&str], env: &[(&str, &str)]| ExecRequest {
            argv: argv.iter().map(|s| s.to_string()).collect(),
            env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            ..ExecRequest::default()
        };
        assert_eq!(ChildPlan::new(&request(&[], &[])).err().map(|e| e.errno), Some(libc::EINVAL));
        assert_eq!(ChildPlan::new(&request(&["/bin/sh", "a\0b"], &[])).err().map(|e| e.errno), Some(libc::EINVAL));
        assert_eq!(ChildPlan::new(&request(&["/bin/sh"], &[("A=B", "c")])).err().map(|e| e.errno), Some(libc::EINVAL));
        assert_eq!(ChildPlan::new(&request(&["nope-nope"], &[])).err().map(|e| e.errno), Some(libc::ENOENT));
    }

    #[test]
    fn oom_is_a_sigkill_with_a_rising_count() {
        let kill = ExitStatus::Signal(libc::SIGKILL);
        assert!(oom_killed(kill, Some(3), Some(4)));
        assert!(!oom_killed(kill, Some(3), Some(3)));
        assert!(!oom_killed(ExitStatus::Code(137), Some(3), Some(4)));
        assert!(!oom_killed(kill, None, Some(4)));
    }
}
