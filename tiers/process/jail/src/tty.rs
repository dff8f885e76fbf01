//! Pseudo-terminals for jobs, from the jail's own `devpts` instance.
//!
//! Every jail mounts a `devpts` of its own at `/dev/pts` (`newinstance`, at most [`MAX_PTYS`] terminals, so a job
//! that opens `/dev/ptmx` in a loop pins a bounded amount of kernel memory), with `/dev/ptmx` linked to its
//! multiplexer: terminals a job opens (`script`, `expect`, Python's `pty`) are numbered in the jail and invisible
//! outside it. A job run with [`crate::proto::Exec::tty`] gets one of them from PID 1 (`Pty::open`): the
//! terminal's far end is the job's stdin, stdout, stderr and controlling terminal, and its near end (the master)
//! goes to the host beside the `Started` frame, where input is written, output read and the window resized.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;
use nix::fcntl::{OFlag, open};
use nix::sys::stat::Mode;

use crate::proto::TtySize;

/// The most terminals one jail's `devpts` holds at once.
pub const MAX_PTYS: u32 = 64;

/// The `devpts` mount options of a jail: a private instance whose multiplexer anyone in the jail may open.
pub(crate) fn devpts_options() -> String {
    format!("newinstance,ptmxmode=0666,mode=0620,max={MAX_PTYS}")
}

/// One terminal: the master the host keeps, the slave the job gets.
pub(crate) struct Pty {
    /// The near end: input written here is what the job reads, output the job writes is read here.
    pub(crate) master: OwnedFd,
    /// The far end, for the job's standard streams.
    pub(crate) slave: OwnedFd,
}

impl Pty {
    /// Opens a terminal of the jail's `devpts` (`ptmx` is a path in PID 1's root, after `pivot_root`), unlocked,
    /// with the window `size`, its slave given to `owner` (the jail's root on the host, when jobs run in a user
    /// namespace). Both ends are close-on-exec.
    pub(crate) fn open(ptmx: &str, size: TtySize, owner: Option<u32>) -> Result<Pty, Errno> {
        let master = open(ptmx, OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC, Mode::empty())?;
        let unlock: libc::c_int = 0;
        // SAFETY: TIOCSPTLCK reads one int from a pointer that outlives the call.
        check(unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSPTLCK, &unlock) })?;
        set_size(&master, size)?;
        let flags = libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC;
        // SAFETY: TIOCGPTPEER takes open flags by value and returns a new descriptor of the slave, or -1.
        let slave = check(unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCGPTPEER, flags) })?;
        // SAFETY: the kernel just returned this descriptor; nothing else owns it.
        let slave = unsafe { OwnedFd::from_raw_fd(slave as RawFd) };
        if let Some(id) = owner {
            nix::unistd::fchown(&slave, Some(nix::unistd::Uid::from_raw(id)), Some(nix::unistd::Gid::from_raw(id)))?;
        }
        Ok(Pty { master, slave })
    }
}

/// Sets the window size of the terminal whose master or slave `fd` is (the job's foreground process group gets
/// `SIGWINCH` when it changes).
pub fn set_size(fd: &impl AsRawFd, size: TtySize) -> Result<(), Errno> {
    let winsize = libc::winsize { ws_row: size.rows, ws_col: size.cols, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: TIOCSWINSZ reads a winsize from a pointer that outlives the call.
    check(unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &winsize) }).map(drop)
}

/// The window size of the terminal `fd` is (any end of it, or a host terminal).
pub fn size(fd: &impl AsRawFd) -> Result<TtySize, Errno> {
    let mut winsize = libc::winsize { ws_row: 0, ws_col: 0, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: TIOCGWINSZ writes a winsize through a pointer to this local, which outlives the call.
    check(unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCGWINSZ, &mut winsize) })?;
    Ok(TtySize { rows: winsize.ws_row, cols: winsize.ws_col })
}

/// Makes the terminal on descriptor 0 the calling process's controlling terminal (it must lead a session
/// without one).
pub(crate) fn make_controlling() -> Result<(), Errno> {
    // SAFETY: TIOCSCTTY takes an int by value (0: do not steal a terminal another session holds).
    check(unsafe { libc::ioctl(0, libc::TIOCSCTTY, 0) }).map(drop)
}

fn check(rc: libc::c_int) -> Result<libc::c_int, Errno> {
    if rc < 0 { Err(Errno::last()) } else { Ok(rc) }
}
