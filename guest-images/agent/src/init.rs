//! PID 1's boot: the filesystems a Linux userland expects, the root overlay, the hostname, loopback.
//!
//! The kernel command line configures it (`strata.*` parameters, which the kernel leaves to userspace):
//!
//! - `strata.root=DEV` — the read-only root image (e.g. `/dev/vda`), mounted under a tmpfs overlay that becomes
//!   `/`. Without it the agent stays on the root it was started from (the initramfs).
//! - `strata.rootfstype=TYPE` — its filesystem (default: `ext4`, then `squashfs`).
//! - `strata.scratch=BYTES` — size of the overlay's tmpfs (default: the kernel's, half the RAM).
//! - `strata.port=N` — the vsock port to listen on (default [`DEFAULT_AGENT_PORT`]).
//! - `strata.hostname=NAME` — default `strata`.
//! - `strata.halt=poweroff|restart` — how `PowerOff` ends the guest (default `poweroff`).
//!
//! Nothing here stops the boot: a step that fails is logged and the agent serves with what it has (PID 1 must
//! never exit).

use std::fs;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::DirBuilderExt;
use std::path::Path;

use nix::errno::Errno;
use nix::mount::{MsFlags, mount};
use strata_guest_proto::DEFAULT_AGENT_PORT;

use crate::system::Halt;

/// What the kernel command line asks of the agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootConfig {
    /// The root image's device.
    pub root: Option<String>,
    /// Its filesystem type.
    pub root_fstype: Option<String>,
    /// The overlay tmpfs's size in bytes.
    pub scratch_bytes: Option<u64>,
    /// The vsock port.
    pub port: u32,
    /// The hostname.
    pub hostname: String,
    /// How to end the guest.
    pub halt: Halt,
}

impl Default for BootConfig {
    fn default() -> Self {
        BootConfig {
            root: None,
            root_fstype: None,
            scratch_bytes: None,
            port: DEFAULT_AGENT_PORT,
            hostname: "strata".into(),
            halt: Halt::PowerOff,
        }
    }
}

impl BootConfig {
    /// Reads the `strata.*` parameters of a kernel command line; returns the configuration and a note for each
    /// value it could not use.
    pub fn from_cmdline(cmdline: &str) -> (BootConfig, Vec<String>) {
        let mut config = BootConfig::default();
        let mut notes = Vec::new();
        for word in cmdline.split_ascii_whitespace() {
            let Some((key, value)) = word.strip_prefix("strata.").and_then(|w| w.split_once('=')) else {
                continue;
            };
            let path_like = |v: &str| v.starts_with('/') && !v.contains(',');
            match key {
                "root" if path_like(value) => config.root = Some(value.to_owned()),
                "rootfstype" if !value.is_empty() && value.bytes().all(|b| b.is_ascii_alphanumeric()) => {
                    config.root_fstype = Some(value.to_owned())
                }
                "scratch" if value.parse::<u64>().is_ok_and(|n| n > 0) => config.scratch_bytes = value.parse().ok(),
                "port" if value.parse::<u32>().is_ok() => config.port = value.parse().unwrap_or(DEFAULT_AGENT_PORT),
                "hostname" if !value.is_empty() && value.len() <= 64 => config.hostname = value.to_owned(),
                "halt" if value == "poweroff" => config.halt = Halt::PowerOff,
                "halt" if value == "restart" => config.halt = Halt::Restart,
                _ => notes.push(format!("ignored kernel parameter {word:?}")),
            }
        }
        (config, notes)
    }
}

/// Boots the guest's userland; returns the configuration and lines for the console log (what went wrong on
/// the way, and which root it is on).
pub fn boot() -> (BootConfig, Vec<String>) {
    let notes = std::cell::RefCell::new(Vec::new());
    let note = |what: &str, result: Result<(), Errno>| {
        if let Err(errno) = result {
            notes.borrow_mut().push(format!("{what}: {}", errno.desc()));
        }
    };
    let nosuid_nodev_noexec = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    note("/proc", mount_fs("proc", "/proc", "proc", nosuid_nodev_noexec, None));
    note("/sys", mount_fs("sysfs", "/sys", "sysfs", nosuid_nodev_noexec, None));
    note("/dev", mount_fs("devtmpfs", "/dev", "devtmpfs", MsFlags::MS_NOSUID, Some("mode=0755")));
    ensure_stdio(Path::new("/dev/console"));
    note(
        "mount propagation",
        mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None::<&str>),
    );

    let cmdline = fs::read_to_string("/proc/cmdline").unwrap_or_default();
    let (config, cmdline_notes) = BootConfig::from_cmdline(&cmdline);
    notes.borrow_mut().extend(cmdline_notes);
    if let Some(device) = &config.root {
        let message = match switch_to_overlay(device, &config) {
            Ok(()) => format!("root: {device}, read-only, under a tmpfs overlay"),
            Err((step, errno)) => {
                format!("root overlay on {device}: {step}: {}; staying on the initial root", errno.desc())
            }
        };
        notes.borrow_mut().push(message);
    }

    let tmpfs = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    note(
        "/dev/pts",
        mount_fs(
            "devpts",
            "/dev/pts",
            "devpts",
            MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
            Some("newinstance,ptmxmode=0666,mode=0620"),
        ),
    );
    note("/dev/shm", mount_fs("shm", "/dev/shm", "tmpfs", tmpfs, Some("mode=1777")));
    note("/tmp", mount_fs("tmp", "/tmp", "tmpfs", tmpfs, Some("mode=1777")));
    note("/run", mount_fs("run", "/run", "tmpfs", tmpfs, Some("mode=0755")));
    note("/sys/fs/cgroup", mount_fs("cgroup2", "/sys/fs/cgroup", "cgroup2", nosuid_nodev_noexec, None));
    for (link, target) in [
        ("/dev/fd", "/proc/self/fd"),
        ("/dev/stdin", "/proc/self/fd/0"),
        ("/dev/stdout", "/proc/self/fd/1"),
        ("/dev/stderr", "/proc/self/fd/2"),
        ("/dev/ptmx", "pts/ptmx"),
    ] {
        if fs::symlink_metadata(link).is_err() {
            note(link, std::os::unix::fs::symlink(target, link).map_err(|e| errno_of(&e)));
        }
    }
    note("hostname", nix::unistd::sethostname(&config.hostname));
    note("loopback", loopback_up());
    (config, notes.into_inner())
}

fn errno_of(err: &std::io::Error) -> Errno {
    Errno::from_raw(err.raw_os_error().unwrap_or(libc::EIO))
}

/// Mounts a filesystem at `target`, creating the directory; one already mounted there (`EBUSY`) is fine.
fn mount_fs(source: &str, target: &str, fstype: &str, flags: MsFlags, data: Option<&str>) -> Result<(), Errno> {
    if !Path::new(target).is_dir() {
        fs::DirBuilder::new().recursive(true).mode(0o755).create(target).map_err(|e| errno_of(&e))?;
    }
    match mount(Some(source), target, Some(fstype), flags, data) {
        Err(Errno::EBUSY) => Ok(()),
        other => other,
    }
}

/// Puts the root image under a tmpfs overlay and makes that `/` (the `switch_root` way, which works from an
/// initramfs, where `pivot_root` does not): everything is built in a tmpfs on `/run`, `/proc`, `/sys` and
/// `/dev` move over, then the overlay is moved onto `/` and becomes the root.
fn switch_to_overlay(device: &str, config: &BootConfig) -> Result<(), (&'static str, Errno)> {
    let scratch = match config.scratch_bytes {
        Some(bytes) => format!("size={bytes},mode=0755"),
        None => "mode=0755".to_owned(),
    };
    mount_fs("strata-scratch", "/run", "tmpfs", MsFlags::MS_NOSUID | MsFlags::MS_NODEV, Some(&scratch))
        .map_err(|e| ("scratch tmpfs", e))?;
    for dir in ["/run/lower", "/run/upper", "/run/work", "/run/root"] {
        fs::DirBuilder::new().mode(0o755).create(dir).map_err(|e| ("scratch directories", errno_of(&e)))?;
    }
    let types: Vec<&str> = match &config.root_fstype {
        Some(fstype) => vec![fstype.as_str()],
        None => vec!["ext4", "squashfs"],
    };
    let mut mounted = Err(Errno::ENODEV);
    for fstype in types {
        mounted = mount(Some(device), "/run/lower", Some(fstype), MsFlags::MS_RDONLY, None::<&str>);
        if mounted.is_ok() {
            break;
        }
    }
    mounted.map_err(|e| ("root image", e))?;
    let options = "lowerdir=/run/lower,upperdir=/run/upper,workdir=/run/work";
    mount(Some("strata-root"), "/run/root", Some("overlay"), MsFlags::empty(), Some(options))
        .map_err(|e| ("overlay", e))?;
    for dir in ["/proc", "/sys", "/dev"] {
        let target = format!("/run/root{dir}");
        if !Path::new(&target).is_dir() {
            fs::DirBuilder::new().mode(0o755).create(&target).map_err(|e| ("mount points", errno_of(&e)))?;
        }
        mount(Some(dir), target.as_str(), None::<&str>, MsFlags::MS_MOVE, None::<&str>).map_err(|e| ("move", e))?;
    }
    nix::unistd::chdir("/run/root").map_err(|e| ("chdir", e))?;
    mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>).map_err(|e| ("move root", e))?;
    nix::unistd::chroot(".").map_err(|e| ("chroot", e))?;
    nix::unistd::chdir("/").map_err(|e| ("chdir", e))?;
    Ok(())
}

/// Makes sure descriptors 0, 1 and 2 are open (on `console`, else `/dev/null`), so no descriptor the agent
/// opens later lands on a standard stream's number.
pub fn ensure_stdio(console: &Path) {
    for fd in 0..3 {
        // SAFETY: F_GETFD takes no pointers and only reports whether `fd` is open.
        if unsafe { libc::fcntl(fd, libc::F_GETFD) } >= 0 {
            continue;
        }
        let opened = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(console)
            .or_else(|_| fs::OpenOptions::new().read(true).write(true).open("/dev/null"));
        let Ok(file) = opened else { return };
        let file = OwnedFd::from(file);
        if file.as_raw_fd() != fd {
            // SAFETY: dup2 onto a descriptor that is not open; `file` stays owned and is closed on drop.
            unsafe { libc::dup2(file.as_raw_fd(), fd) };
        } else {
            // The lowest free number was `fd` itself: keep it open.
            std::mem::forget(file);
        }
    }
}

/// Brings the loopback interface up.
fn loopback_up() -> Result<(), Errno> {
    // SAFETY: socket() takes no pointers.
    let raw = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(Errno::last());
    }
    // SAFETY: socket() just returned this descriptor; nothing else owns it.
    let sock = unsafe { OwnedFd::from_raw_fd(raw) };
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_configures_the_boot() {
        let (config, notes) = BootConfig::from_cmdline(
            "console=ttyS0 reboot=k strata.root=/dev/vda strata.rootfstype=ext4 strata.port=2000 \
             strata.hostname=box strata.halt=restart strata.scratch=1048576 panic=1",
        );
        assert_eq!(
            config,
            BootConfig {
                root: Some("/dev/vda".into()),
                root_fstype: Some("ext4".into()),
                scratch_bytes: Some(1 << 20),
                port: 2000,
                hostname: "box".into(),
                halt: Halt::Restart,
            }
        );
        assert!(notes.is_empty(), "{notes:?}");
    }

    #[test]
    fn bad_values_keep_the_defaults_and_are_noted() {
        let (config, notes) = BootConfig::from_cmdline(
            "strata.root=vda strata.port=-1 strata.rootfstype=ext4,ro strata.halt=explode strata.scratch=0 strata.x",
        );
        assert_eq!(config, BootConfig::default());
        assert_eq!(notes.len(), 5, "{notes:?}");
        assert_eq!(BootConfig::from_cmdline("").0, BootConfig::default());
    }
}
