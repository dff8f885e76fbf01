//! System calls the jail and its host side make that nix does not wrap (or wraps as `unsafe`): one copy of each.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;
use nix::sys::signal::Signal;

/// A pidfd of the process `pid` (`pidfd_open(2)`): signals sent through it never reach a process that reused
/// the PID.
pub fn pidfd_open(pid: i32) -> Result<OwnedFd, Errno> {
    // SAFETY: pidfd_open takes a PID and flags and returns a new descriptor or -1; no memory is passed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(Errno::last());
    }
    let fd = RawFd::try_from(fd).map_err(|_| Errno::EBADF)?;
    // SAFETY: the kernel just returned this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Sends `signal` to the process of `pidfd` (`pidfd_send_signal(2)`); a process already gone is no error.
pub fn signal_pidfd(pidfd: &OwnedFd, signal: Signal) {
    // SAFETY: pidfd_send_signal on a pidfd we own, with no siginfo (a null pointer is allowed) and no flags.
    unsafe { libc::syscall(libc::SYS_pidfd_send_signal, pidfd.as_raw_fd(), signal as i32, std::ptr::null::<u8>(), 0) };
}

/// Marks every descriptor from `first` up close-on-exec (`close_range(2)` with `CLOSE_RANGE_CLOEXEC`), so that
/// they close themselves at `execve`.
pub fn cloexec_from(first: u32) -> Result<(), Errno> {
    // SAFETY: close_range with CLOSE_RANGE_CLOEXEC only marks descriptors close-on-exec; nothing is closed here.
    let rc = unsafe { libc::syscall(libc::SYS_close_range, first, u32::MAX, libc::CLOSE_RANGE_CLOEXEC) };
    if rc < 0 { Err(Errno::last()) } else { Ok(()) }
}

/// Accepts a connection on the listening socket `listener`, close-on-exec (`accept4(2)`).
pub fn accept_cloexec(listener: BorrowedFd<'_>) -> Result<OwnedFd, Errno> {
    let fd = nix::sys::socket::accept4(listener.as_raw_fd(), nix::sys::socket::SockFlag::SOCK_CLOEXEC)?;
    // SAFETY: accept4 just returned this new descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Why [`fork_single_threaded`] did not fork.
#[derive(Debug, thiserror::Error)]
pub enum ForkError {
    /// Other threads would be copied mid-flight (holding locks, half-way through allocations): not safe to fork.
    #[error("this process has {0} threads; only a single-threaded process may fork and keep running Rust code")]
    Threaded(usize),
    /// `/proc/self/task` could not be read, so the thread count is unknown.
    #[error("cannot count this process's threads: {0}")]
    Count(std::io::Error),
    /// `fork(2)` itself failed.
    #[error("fork: {0}")]
    Fork(Errno),
}

/// Forks this process, which must be single-threaded (checked first, from `/proc/self/task`), and runs `child`
/// in the new process, which then ends with `_exit` and the code `child` returned (101 if it panicked), running
/// no exit handlers of the parent's. Returns the child's PID in the parent.
pub fn fork_single_threaded(child: impl FnOnce() -> i32) -> Result<i32, ForkError> {
    let threads = std::fs::read_dir("/proc/self/task").map_err(ForkError::Count)?.count();
    if threads != 1 {
        return Err(ForkError::Threaded(threads));
    }
    // SAFETY: the process has exactly one thread (checked above; it cannot start another between the check and
    // the fork, since this thread is the only one that could), so the child's copy of every lock and allocator is
    // consistent and it may run any Rust code.
    match unsafe { nix::unistd::fork() } {
        Err(errno) => Err(ForkError::Fork(errno)),
        Ok(nix::unistd::ForkResult::Parent { child }) => Ok(child.as_raw()),
        Ok(nix::unistd::ForkResult::Child) => {
            let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(child)).unwrap_or(101);
            // SAFETY: _exit ends the child at once: the parent's atexit handlers and buffered state are not its own.
            unsafe { libc::_exit(code) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pidfd_of_this_process_is_open_and_of_no_process_is_an_error() {
        let own = pidfd_open(std::process::id() as i32).expect("a pidfd of this process");
        assert!(own.as_raw_fd() >= 0);
        assert_eq!(pidfd_open(-1).expect_err("no such PID"), Errno::EINVAL);
    }
}
