//! System calls run *inside* another process: the zygote and its forks, which the jail's PID 1 holds stopped
//! under `ptrace` and never lets run code of their own while it works on them.
//!
//! The technique is the one CRIU's `compel` uses: with the tracee in a ptrace stop, its registers are set to
//! "a `syscall` instruction is next, with these arguments" (and `orig_rax = -1`, so the kernel does not restart an
//! interrupted call over ours), it is resumed to its syscall-entry stop and on to its syscall-exit stop, where
//! `rax` is the result. Between injections it stays stopped. The instruction used is the one the tracee was
//! blocked on (two bytes before its `rip` when it stopped inside a system call), checked to be `0f 05`.
//!
//! A seccomp filter that answers `SECCOMP_RET_TRACE` hands the decision to us: every such stop during an
//! injection is allowed (the call is ours). Signals that arrive meanwhile are discarded: a stopped zygote has no
//! use for them.
//!
//! x86_64 only, like the rest of the jail.

use std::fs::File;
use std::os::unix::fs::FileExt;

use libc::user_regs_struct;
use nix::errno::Errno;
use nix::sys::ptrace::{self, Event, Options};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;

/// `-ERESTARTSYS`, what `rax` holds when a stop interrupted a blocking call.
const ERESTARTSYS: u64 = (-512i64) as u64;

/// The `syscall` instruction.
const SYSCALL_INSN: [u8; 2] = [0x0f, 0x05];

/// How often, and how far apart, a tracee is looked at until it is blocked in the call it must be stopped in.
const STOP_POINT_ATTEMPTS: u32 = 200;
const STOP_POINT_POLL: std::time::Duration = std::time::Duration::from_millis(10);

/// Why an injection failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InjectError {
    /// A `ptrace` or `/proc/<pid>/mem` operation failed.
    Os {
        /// What was being done.
        what: &'static str,
        /// The error.
        errno: Errno,
    },
    /// The tracee exited or was killed.
    Gone,
    /// The tracee is not where it must be.
    NotAtStopPoint(String),
}

impl std::fmt::Display for InjectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InjectError::Os { what, errno } => write!(f, "{what}: {}", errno.desc()),
            InjectError::Gone => f.write_str("the process is gone"),
            InjectError::NotAtStopPoint(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for InjectError {}

fn os(what: &'static str) -> impl FnOnce(Errno) -> InjectError {
    move |errno| InjectError::Os { what, errno }
}

/// The ptrace options every tracee gets: it dies with its tracer, syscall stops are marked, children are traced
/// from birth, seccomp `TRACE` verdicts come to us.
pub fn options() -> Options {
    Options::PTRACE_O_EXITKILL
        | Options::PTRACE_O_TRACESYSGOOD
        | Options::PTRACE_O_TRACEFORK
        | Options::PTRACE_O_TRACEVFORK
        | Options::PTRACE_O_TRACECLONE
        | Options::PTRACE_O_TRACESECCOMP
}

/// Waits for the next stop of `pid`. Exits end with [`InjectError::Gone`].
fn wait(pid: Pid) -> Result<WaitStatus, InjectError> {
    loop {
        match waitpid(pid, Some(WaitPidFlag::__WALL)) {
            Ok(WaitStatus::Exited(..) | WaitStatus::Signaled(..)) => return Err(InjectError::Gone),
            Ok(status) => return Ok(status),
            Err(Errno::EINTR) => continue,
            Err(Errno::ECHILD) => return Err(InjectError::Gone),
            Err(errno) => return Err(InjectError::Os { what: "waitpid", errno }),
        }
    }
}

/// A process held in a ptrace stop, with the `syscall` instruction injections go through.
#[derive(Debug)]
pub struct Tracee {
    pid: Pid,
    syscall_addr: u64,
    mem: File,
}

/// The registers that make a stopped process, once let go, repeat the blocking call it was stopped in.
#[derive(Debug, Clone, Copy)]
pub struct ResumePoint {
    regs: user_regs_struct,
}

impl ResumePoint {
    /// The call's arguments (`rdi`, `rsi`, `rdx`).
    pub fn args(&self) -> [u64; 3] {
        [self.regs.rdi, self.regs.rsi, self.regs.rdx]
    }
}

impl Tracee {
    /// Seizes `pid` (which must not be traced yet) and stops it blocked in system call `nr` with first argument
    /// `arg0` (e.g. `read(0, …)`), letting it run for up to two seconds to get there. Returns the tracee and the
    /// point it resumes from.
    pub fn seize_at(pid: Pid, nr: i64, arg0: u64, proc: &str) -> Result<(Tracee, ResumePoint), InjectError> {
        ptrace::seize(pid, options()).map_err(os("PTRACE_SEIZE"))?;
        ptrace::interrupt(pid).map_err(os("PTRACE_INTERRUPT"))?;
        // The interrupt stop (or a signal stop that came first).
        wait(pid)?;
        let mem = File::options()
            .read(true)
            .write(true)
            .open(format!("{proc}/{pid}/mem"))
            .map_err(|e| InjectError::Os { what: "open /proc/<pid>/mem", errno: io_errno(&e) })?;
        // Interrupted while blocked in the call, its registers say so; otherwise let it run a little and look
        // again (a zygote signals readiness just before it blocks).
        let mut entry_regs = None;
        for attempt in 0..STOP_POINT_ATTEMPTS {
            let regs = ptrace::getregs(pid).map_err(os("PTRACE_GETREGS"))?;
            if regs.orig_rax == nr as u64 && regs.rdi == arg0 && regs.rax == ERESTARTSYS {
                entry_regs = Some(regs);
                break;
            }
            if attempt + 1 == STOP_POINT_ATTEMPTS {
                break;
            }
            ptrace::cont(pid, None).map_err(os("PTRACE_CONT"))?;
            std::thread::sleep(STOP_POINT_POLL);
            ptrace::interrupt(pid).map_err(os("PTRACE_INTERRUPT"))?;
            wait(pid)?;
        }
        let entry_regs = entry_regs.ok_or_else(|| {
            InjectError::NotAtStopPoint(format!(
                "the process is not blocked in system call {nr}({arg0}, …) (waited {:?})",
                STOP_POINT_POLL * STOP_POINT_ATTEMPTS
            ))
        })?;
        let syscall_addr = entry_regs.rip.wrapping_sub(2);
        let tracee = Tracee { pid, syscall_addr, mem };
        let mut insn = [0u8; 2];
        tracee.read_mem(syscall_addr, &mut insn)?;
        if insn != SYSCALL_INSN {
            return Err(InjectError::NotAtStopPoint(format!(
                "the instruction before {:#x} is not `syscall` (the call came through another path)",
                entry_regs.rip
            )));
        }
        let mut resume = entry_regs;
        resume.rip = syscall_addr;
        resume.rax = nr as u64;
        resume.orig_rax = u64::MAX;
        Ok((tracee, ResumePoint { regs: resume }))
    }

    /// A child `parent`'s injected `clone` created: traced from birth, in its first stop. Shares the parent's
    /// `syscall` instruction (same memory layout).
    pub fn adopt_child(parent: &Tracee, child: Pid, proc: &str) -> Result<Tracee, InjectError> {
        // Its first stop (PTRACE_EVENT_STOP, or a signal stop).
        wait(child)?;
        let mem = File::options()
            .read(true)
            .write(true)
            .open(format!("{proc}/{child}/mem"))
            .map_err(|e| InjectError::Os { what: "open /proc/<pid>/mem", errno: io_errno(&e) })?;
        Ok(Tracee { pid: child, syscall_addr: parent.syscall_addr, mem })
    }

    /// The traced process.
    pub fn pid(&self) -> Pid {
        self.pid
    }

    /// Runs system call `nr` with `args` in the tracee; returns its raw result (a negative errno on failure) and,
    /// for a call that created a process, that process's PID.
    pub fn syscall(&self, nr: i64, args: [u64; 6]) -> Result<(i64, Option<Pid>), InjectError> {
        let mut regs = ptrace::getregs(self.pid).map_err(os("PTRACE_GETREGS"))?;
        regs.rip = self.syscall_addr;
        regs.rax = nr as u64;
        regs.orig_rax = u64::MAX;
        regs.rdi = args[0];
        regs.rsi = args[1];
        regs.rdx = args[2];
        regs.r10 = args[3];
        regs.r8 = args[4];
        regs.r9 = args[5];
        ptrace::setregs(self.pid, regs).map_err(os("PTRACE_SETREGS"))?;
        let mut child = None;
        // To the entry stop, then on to the exit stop.
        ptrace::syscall(self.pid, None).map_err(os("PTRACE_SYSCALL"))?;
        run_to_syscall_stop(self.pid, &mut child)?;
        let entered = ptrace::getregs(self.pid).map_err(os("PTRACE_GETREGS"))?;
        if entered.orig_rax != nr as u64 {
            return Err(InjectError::NotAtStopPoint(format!(
                "the injected call {nr} entered as {}",
                entered.orig_rax as i64
            )));
        }
        ptrace::syscall(self.pid, None).map_err(os("PTRACE_SYSCALL"))?;
        run_to_syscall_stop(self.pid, &mut child)?;
        let done = ptrace::getregs(self.pid).map_err(os("PTRACE_GETREGS"))?;
        Ok((done.rax as i64, child))
    }

    /// Like [`syscall`](Tracee::syscall), with a negative result turned into an error naming `what`.
    pub fn call(&self, what: &'static str, nr: i64, args: [u64; 6]) -> Result<u64, InjectError> {
        let (rc, _) = self.syscall(nr, args)?;
        if rc < 0 && rc > -4096 {
            return Err(InjectError::Os { what, errno: Errno::from_raw(-rc as i32) });
        }
        Ok(rc as u64)
    }

    /// Writes the tracee's memory.
    pub fn write_mem(&self, addr: u64, bytes: &[u8]) -> Result<(), InjectError> {
        self.mem
            .write_all_at(bytes, addr)
            .map_err(|e| InjectError::Os { what: "write /proc/<pid>/mem", errno: io_errno(&e) })
    }

    /// Reads the tracee's memory.
    pub fn read_mem(&self, addr: u64, out: &mut [u8]) -> Result<(), InjectError> {
        self.mem
            .read_exact_at(out, addr)
            .map_err(|e| InjectError::Os { what: "read /proc/<pid>/mem", errno: io_errno(&e) })
    }

    /// Sets the registers that resume the blocking call and lets the tracee go.
    pub fn release(self, at: &ResumePoint) -> Result<(), InjectError> {
        ptrace::setregs(self.pid, at.regs).map_err(os("PTRACE_SETREGS"))?;
        ptrace::detach(self.pid, None).map_err(os("PTRACE_DETACH"))
    }
}

/// Resumes `pid` through seccomp and fork events and discarded signals until its next syscall stop. A process a
/// `clone` created is recorded in `child`.
fn run_to_syscall_stop(pid: Pid, child: &mut Option<Pid>) -> Result<(), InjectError> {
    loop {
        match wait(pid)? {
            WaitStatus::PtraceSyscall(_) => return Ok(()),
            WaitStatus::PtraceEvent(_, _, event) => {
                if [Event::PTRACE_EVENT_FORK, Event::PTRACE_EVENT_VFORK, Event::PTRACE_EVENT_CLONE]
                    .iter()
                    .any(|e| *e as i32 == event)
                {
                    let new = ptrace::getevent(pid).map_err(os("PTRACE_GETEVENTMSG"))?;
                    *child = Some(Pid::from_raw(new as i32));
                }
                // Seccomp TRACE verdicts are allowed; other events need nothing.
                ptrace::syscall(pid, None).map_err(os("PTRACE_SYSCALL"))?;
            }
            // A signal: discarded.
            _ => ptrace::syscall(pid, None).map_err(os("PTRACE_SYSCALL"))?,
        }
    }
}

fn io_errno(err: &std::io::Error) -> Errno {
    Errno::from_raw(err.raw_os_error().unwrap_or(libc::EIO))
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::fd::{AsRawFd, OwnedFd};

    use nix::sys::signal::{Signal, kill};
    use nix::unistd::{ForkResult, fork, pipe};

    use super::*;

    /// A child that says it is ready on `ready` and then blocks reading fd `fd`; when the read returns it writes
    /// what it read to `out` and exits 0.
    fn blocked_child(fd: i32, ready: OwnedFd, out: OwnedFd) -> Pid {
        // SAFETY: the child only makes async-signal-safe calls (read, write, _exit) before exiting.
        match unsafe { fork() }.expect("fork") {
            ForkResult::Child => {
                // Other tests of this process run on other threads: keep only the three descriptors this child
                // uses, so that it holds none of theirs open (a socket end they drop must reach end of file).
                let mut keep = [fd, ready.as_raw_fd(), out.as_raw_fd()];
                keep.sort_unstable();
                let mut first = 3;
                for kept in keep {
                    if kept > first {
                        // SAFETY: close_range only closes descriptors of this (forked, single-threaded) child.
                        unsafe {
                            libc::syscall(libc::SYS_close_range, first as libc::c_uint, (kept - 1) as libc::c_uint, 0)
                        };
                    }
                    first = first.max(kept + 1);
                }
                // SAFETY: as above.
                unsafe { libc::syscall(libc::SYS_close_range, first as libc::c_uint, libc::c_uint::MAX, 0) };
                let mut buf = [0u8; 64];
                // SAFETY: plain write/read/_exit on descriptors this child owns, into a stack buffer.
                unsafe {
                    libc::write(ready.as_raw_fd(), b"r".as_ptr().cast(), 1);
                    let n = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
                    if n > 0 {
                        libc::write(out.as_raw_fd(), buf.as_ptr().cast(), n as usize);
                    }
                    libc::_exit(0)
                }
            }
            ForkResult::Parent { child } => child,
        }
    }

    #[test]
    fn injected_calls_run_in_the_tracee_and_it_resumes_its_read() {
        let (in_r, in_w) = pipe().expect("pipe");
        let (ready_r, ready_w) = pipe().expect("pipe");
        let (out_r, out_w) = pipe().expect("pipe");
        let child = blocked_child(in_r.as_raw_fd(), ready_w, out_w);
        let mut byte = [0u8; 1];
        File::from(ready_r).read_exact(&mut byte).expect("ready");
        let (tracee, resume) =
            Tracee::seize_at(child, libc::SYS_read, in_r.as_raw_fd() as u64, "/proc").expect("seize");
        assert_eq!(resume.args()[0], in_r.as_raw_fd() as u64);
        // getpid runs in the child, not here.
        let pid = tracee.call("getpid", libc::SYS_getpid, [0; 6]).expect("getpid");
        assert_eq!(pid as i32, child.as_raw());
        // A fork of the stopped child (a sibling, so this test reaps it), traced from birth: it resumes the same
        // read and gets its own input.
        let flags = (libc::CLONE_PARENT | libc::SIGCHLD) as u64;
        let (rc, forked) = tracee.syscall(libc::SYS_clone, [flags, 0, 0, 0, 0, 0]).expect("clone");
        let forked = forked.expect("clone reported the child");
        assert_eq!(rc as i32, forked.as_raw());
        let fork_tracee = Tracee::adopt_child(&tracee, forked, "/proc").expect("adopt");
        // A memory round trip through the fork's own (copied) memory.
        let page = fork_tracee
            .call(
                "mmap",
                libc::SYS_mmap,
                [
                    0,
                    4096,
                    (libc::PROT_READ | libc::PROT_WRITE) as u64,
                    (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u64,
                    u64::MAX,
                    0,
                ],
            )
            .expect("mmap");
        fork_tracee.write_mem(page, b"hello").expect("write");
        let mut back = [0u8; 5];
        fork_tracee.read_mem(page, &mut back).expect("read");
        assert_eq!(&back, b"hello");
        fork_tracee.call("munmap", libc::SYS_munmap, [page, 4096, 0, 0, 0, 0]).expect("munmap");
        fork_tracee.release(&resume).expect("release fork");
        (&File::from(in_w.try_clone().expect("dup"))).write_all(b"one").expect("feed");
        let mut got = [0u8; 3];
        let mut out = File::from(out_r);
        out.read_exact(&mut got).expect("fork output");
        assert_eq!(&got, b"one");
        assert_eq!(waitpid(forked, None).expect("wait fork"), WaitStatus::Exited(forked, 0));
        // The original is still stopped and resumes its own read when released.
        tracee.release(&resume).expect("release");
        (&File::from(in_w)).write_all(b"two").expect("feed");
        out.read_exact(&mut got).expect("original output");
        assert_eq!(&got, b"two");
        assert_eq!(waitpid(child, None).expect("wait"), WaitStatus::Exited(child, 0));
        drop(in_r);
    }

    #[test]
    fn a_process_that_never_makes_the_call_is_refused() {
        let (ready_r, ready_w) = pipe().expect("pipe");
        let (_out_r, out_w) = pipe().expect("pipe");
        let (in_r, _in_w) = pipe().expect("pipe");
        let child = blocked_child(in_r.as_raw_fd(), ready_w, out_w);
        let mut byte = [0u8; 1];
        File::from(ready_r).read_exact(&mut byte).expect("ready");
        // It blocks in read(in_r), never in read(99): refused, not waited on forever.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let err = Tracee::seize_at(child, libc::SYS_read, 99, "/proc");
        let _ = kill(child, Signal::SIGKILL);
        let _ = waitpid(child, None);
        assert!(matches!(err, Err(InjectError::NotAtStopPoint(_))), "{err:?}");
        drop(in_r);
    }
}
