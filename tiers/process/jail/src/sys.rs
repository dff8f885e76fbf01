//! System calls the jail and its host side make that nix does not wrap: one copy of each.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

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
