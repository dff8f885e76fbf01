//! The setup steps a jail's PID 1 ([`crate::init`]) and each zygote fork ([`crate::zygote`]) take alike: the
//! error a step fails with, the writable layer's tmpfs options, the masked procfs, the minimal `/dev`, bind mounts
//! that take their flags, and the loopback interface.

use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;

use nix::errno::Errno;
use nix::mount::{MsFlags, mount};

/// Where the old root is kept between `pivot_root` and its detachment.
pub(crate) const OLD_ROOT: &str = "/.strata-oldroot";

/// Device nodes bound from the host into the jail's `/dev`.
const DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom", "tty"];

/// `/proc` entries hidden behind `/dev/null` (kernel addresses, keys, timers, the sysrq trigger).
const PROC_MASKED: &[&str] = &["kcore", "keys", "timer_list", "sysrq-trigger", "kallsyms", "latency_stats"];

/// `/proc` trees made read-only (kernel tunables and hardware knobs).
const PROC_READ_ONLY: &[&str] = &["sys", "irq", "bus", "fs", "acpi", "scsi"];

/// Bytes of the writable layer per inode it may hold (a page: what the smallest file with data takes): the disk
/// limit bounds the files a job can make, and with them the kernel memory they pin, not only their bytes.
const SCRATCH_BYTES_PER_INODE: u64 = 4096;

/// The options of a writable layer's tmpfs of `bytes` bytes (at least 1 MiB).
pub(crate) fn scratch_options(bytes: u64) -> String {
    let bytes = bytes.max(1 << 20);
    format!("size={bytes},nr_inodes={},mode=0755", bytes / SCRATCH_BYTES_PER_INODE)
}

/// A setup step that failed.
pub(crate) struct StepError {
    pub(crate) stage: String,
    pub(crate) message: String,
}

/// `result`, its error tagged with the stage it failed at.
pub(crate) fn step<T>(stage: impl Into<String>, result: Result<T, impl std::fmt::Display>) -> Result<T, StepError> {
    result.map_err(|e| StepError { stage: stage.into(), message: e.to_string() })
}

/// Hides [`PROC_MASKED`] behind `null` (a path to `/dev/null`) and makes [`PROC_READ_ONLY`] read-only in the
/// procfs mounted at `proc`.
pub(crate) fn confine_proc(proc: &str, null: &str) -> Result<(), StepError> {
    for entry in PROC_MASKED {
        let path = format!("{proc}/{entry}");
        if Path::new(&path).exists() {
            step(format!("mask {path}"), bind_onto(Path::new(null), &path, true))?;
        }
    }
    for entry in PROC_READ_ONLY {
        let path = format!("{proc}/{entry}");
        if Path::new(&path).is_dir() {
            step(format!("read-only {path}"), bind_onto(Path::new(&path), &path, true))?;
        }
    }
    Ok(())
}

/// Mounts a minimal `/dev` at `dev`: a tmpfs with [`DEVICES`] bound from the directory `devices`, the usual
/// links, a private `devpts` at `/dev/pts` (with `/dev/ptmx`) and a private `/dev/shm`.
pub(crate) fn mount_dev_at(dev: &str, devices: &str) -> Result<(), StepError> {
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC;
    step("/dev", fs::DirBuilder::new().recursive(true).mode(0o755).create(dev))?;
    step("/dev", mount(Some("strata-dev"), dev, Some("tmpfs"), flags, Some("size=64k,mode=0755")))?;
    for name in DEVICES {
        let path = format!("{dev}/{name}");
        step(
            format!("/dev/{name}"),
            fs::OpenOptions::new().create(true).truncate(true).write(true).mode(0o666).open(&path),
        )?;
        // A device node works only on a mount without `nodev`.
        step(format!("/dev/{name}"), bind_with(Path::new(&format!("{devices}/{name}")), &path, MsFlags::MS_NOEXEC))?;
    }
    for (link, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        step(format!("/dev/{link}"), std::os::unix::fs::symlink(target, format!("{dev}/{link}")))?;
    }
    // A devpts of the jail's own: its terminals are numbered here and nowhere else ([`crate::tty`]).
    let pts = format!("{dev}/pts");
    step("/dev/pts", fs::DirBuilder::new().mode(0o755).create(&pts))?;
    let options = crate::tty::devpts_options();
    step("/dev/pts", mount(Some("devpts"), pts.as_str(), Some("devpts"), flags, Some(options.as_str())))?;
    step("/dev/ptmx", std::os::unix::fs::symlink("pts/ptmx", format!("{dev}/ptmx")))?;
    let shm = format!("{dev}/shm");
    step("/dev/shm", fs::DirBuilder::new().mode(0o1777).create(&shm))?;
    step("/dev/shm", mount(Some("shm"), shm.as_str(), Some("tmpfs"), flags | MsFlags::MS_NODEV, Some("mode=1777")))?;
    Ok(())
}

/// Bind-mounts `source` at `target`, then remounts it `nosuid,nodev` (and read-only when asked): a bind mount
/// takes its flags only from a remount.
pub(crate) fn bind_onto(source: &Path, target: &str, read_only: bool) -> Result<(), Errno> {
    bind_with(source, target, if read_only { MsFlags::MS_RDONLY | MsFlags::MS_NODEV } else { MsFlags::MS_NODEV })
}

/// Bind-mounts `source` at `target` and remounts it `nosuid` plus `extra`.
fn bind_with(source: &Path, target: &str, extra: MsFlags) -> Result<(), Errno> {
    mount(Some(source), target, None::<&str>, MsFlags::MS_BIND, None::<&str>)?;
    let flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_NOSUID | extra;
    mount(None::<&str>, target, None::<&str>, flags, None::<&str>)
}

/// Brings the loopback interface of the new network namespace up: the only interface it has.
pub(crate) fn loopback_up() -> Result<(), Errno> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socket};
    let sock = socket(AddressFamily::Inet, SockType::Datagram, SockFlag::SOCK_CLOEXEC, None)?;
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS reads the flags of the named interface into `req`, which outlives the call.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS as _, &mut req) } < 0 {
        return Err(Errno::last());
    }
    // SAFETY: the union member ifru_flags is the one SIOCGIFFLAGS filled in.
    unsafe { req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short };
    // SAFETY: SIOCSIFFLAGS reads `req`, which outlives the call.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS as _, &req) } < 0 {
        return Err(Errno::last());
    }
    Ok(())
}
