//! What the agent does to the guest system as a whole: reseed randomness, set the clock, count OOM kills,
//! flush and power off. Only in a guest: run on the host (tests), the agent must not touch the machine's clock
//! or randomness.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::fd::AsRawFd;

use nix::errno::Errno;
use strata_guest_proto::Entropy;

/// `RNDADDENTROPY`: `_IOW('R', 0x03, int[2])`.
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
/// `RNDRESEEDCRNG`: `_IO('R', 0x07)`.
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;

/// A system step that failed.
#[derive(Debug, thiserror::Error)]
pub enum SystemError {
    /// Writing to, or an ioctl on, `/dev/urandom` failed.
    #[error("reseeding /dev/urandom failed")]
    Entropy(#[source] std::io::Error),
    /// `clock_settime` failed.
    #[error("setting the clock to {unix_time_ns} ns failed")]
    Clock {
        /// The time asked for.
        unix_time_ns: u64,
        /// The error.
        #[source]
        errno: Errno,
    },
}

/// `struct rand_pool_info` with room for the entropy.
#[repr(C)]
struct RandPoolInfo {
    entropy_count: libc::c_int,
    buf_size: libc::c_int,
    buf: [u8; Entropy::LEN],
}

/// Mixes `entropy` into the kernel's pool, credits it, and reseeds the CRNG at once, so a restored fork's
/// random numbers diverge from its siblings' before anything reads them.
pub fn reseed(entropy: &Entropy) -> Result<(), SystemError> {
    let mut urandom = OpenOptions::new().write(true).open("/dev/urandom").map_err(SystemError::Entropy)?;
    let info = RandPoolInfo {
        entropy_count: (Entropy::LEN * 8) as libc::c_int,
        buf_size: Entropy::LEN as libc::c_int,
        buf: entropy.0,
    };
    // SAFETY: RNDADDENTROPY reads a rand_pool_info header followed by `buf_size` bytes; `info` is laid out that
    // way (repr(C), the buffer directly after two ints) and outlives the call.
    if unsafe { libc::ioctl(urandom.as_raw_fd(), RNDADDENTROPY as _, &raw const info) } < 0 {
        // Without CAP_SYS_ADMIN: mix it in uncredited.
        urandom.write_all(&entropy.0).map_err(SystemError::Entropy)?;
        return Ok(());
    }
    // SAFETY: RNDRESEEDCRNG takes no argument.
    if unsafe { libc::ioctl(urandom.as_raw_fd(), RNDRESEEDCRNG as _) } < 0 {
        return Err(SystemError::Entropy(std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Sets `CLOCK_REALTIME`.
pub fn set_clock(unix_time_ns: u64) -> Result<(), SystemError> {
    let time = nix::sys::time::TimeSpec::from(std::time::Duration::from_nanos(unix_time_ns));
    nix::time::clock_settime(nix::time::ClockId::CLOCK_REALTIME, time)
        .map_err(|errno| SystemError::Clock { unix_time_ns, errno })
}

/// The kernel's count of OOM kills since boot (`oom_kill` in `/proc/vmstat`).
pub fn oom_kills() -> Option<u64> {
    parse_oom_kills(&std::fs::read_to_string("/proc/vmstat").ok()?)
}

fn parse_oom_kills(vmstat: &str) -> Option<u64> {
    vmstat.lines().find_map(|line| line.strip_prefix("oom_kill ")).and_then(|n| n.trim().parse().ok())
}

/// Flushes every filesystem.
pub fn sync() {
    // SAFETY: sync() takes no arguments.
    unsafe { libc::sync() };
}

/// How the guest ends on power-off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Halt {
    /// `reboot(RB_POWER_OFF)`.
    PowerOff,
    /// `reboot(RB_AUTOBOOT)`: without ACPI a power-off only halts the CPUs, while a reset reaches the monitor.
    Restart,
}

/// Flushes and ends the guest; returns only if the kernel refused.
pub fn halt(how: Halt) -> Errno {
    sync();
    let mode = match how {
        Halt::PowerOff => nix::sys::reboot::RebootMode::RB_POWER_OFF,
        Halt::Restart => nix::sys::reboot::RebootMode::RB_AUTOBOOT,
    };
    match nix::sys::reboot::reboot(mode) {
        Err(errno) => errno,
        Ok(never) => match never {},
    }
}

/// The kernel release (`uname -r`).
pub fn kernel_release() -> String {
    nix::sys::utsname::uname().map(|u| u.release().to_string_lossy().into_owned()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oom_kill_count_is_parsed_from_vmstat() {
        assert_eq!(parse_oom_kills("pgfault 10\noom_kill 3\nfoo 1\n"), Some(3));
        assert_eq!(parse_oom_kills("pgfault 10\n"), None);
        assert_eq!(parse_oom_kills("oom_kill x\n"), None);
    }

    #[test]
    fn rand_pool_info_matches_the_kernel_layout() {
        assert_eq!(std::mem::size_of::<RandPoolInfo>(), 8 + Entropy::LEN);
        assert_eq!(std::mem::offset_of!(RandPoolInfo, buf), 8);
    }
}
