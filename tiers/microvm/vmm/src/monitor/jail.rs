//! The keeper and the monitor's jail (see [`crate::monitor`] for the order of things and why).

use std::fs;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;

use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sched::{CloneFlags, unshare};
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::{
    ForkResult, Gid, Pid, Uid, chdir, fork, pipe, pivot_root, read, setgroups, setresgid, setresuid, write,
};

use crate::proto::{self, JailSpec, PROTOCOL_VERSION, RUN_DIR, Reply, Request};
use crate::seccomp;

/// The monitor's root: a tmpfs this small holds only its mount points.
const ROOT_OPTIONS: &str = "size=64k,nr_inodes=16,mode=0755";

/// The highest capability number we drop from the bounding set (the kernel ignores the numbers it lacks).
const LAST_CAPABILITY: libc::c_ulong = 63;

/// A failure before the monitor serves: reported over the control socket when it can be, then the exit.
fn fail(ctl: &OwnedFd, stage: &str, message: impl std::fmt::Display) -> ! {
    let _ = proto::send(ctl.as_fd(), &Reply::Failed { stage: stage.into(), message: message.to_string() }, &[]);
    std::process::exit(1)
}

/// The keeper: reads the jail spec, joins the cgroup, makes the namespaces, forks the monitor, maps its IDs,
/// reports its PID, then waits for it and exits with its status.
pub fn keeper(ctl: OwnedFd) -> ! {
    let spec = match proto::recv::<Request>(ctl.as_fd()) {
        Ok(Some((Request::Jail(spec), _))) => spec,
        Ok(Some((other, _))) => fail(&ctl, "jail", format!("expected the jail spec, got {other:?}")),
        Ok(None) => std::process::exit(1),
        Err(e) => fail(&ctl, "jail", e),
    };
    if spec.version != PROTOCOL_VERSION {
        fail(&ctl, "jail", format!("protocol version {} (this monitor speaks {PROTOCOL_VERSION})", spec.version));
    }
    for file in &spec.join_cgroup {
        if let Err(e) = fs::write(file, "0") {
            fail(&ctl, "cgroup", format!("{}: {e}", file.display()));
        }
    }
    // No parent-death signal here: it would follow the engine *thread* that started the keeper, which may end
    // long before the engine does. The monitor ends when the engine's end of the control socket closes.
    // The monitor is PID 1 of a new PID namespace; its other namespaces are its own alone (a mount namespace
    // shared with the keeper would move the keeper's root too when the monitor pivots).
    if let Err(e) = unshare(CloneFlags::CLONE_NEWPID) {
        fail(&ctl, "namespaces", e);
    }
    let (to_keeper_r, to_keeper_w) = pipe().unwrap_or_else(|e| fail(&ctl, "pipe", e));
    let (to_monitor_r, to_monitor_w) = pipe().unwrap_or_else(|e| fail(&ctl, "pipe", e));
    // SAFETY: the keeper is single-threaded (the binary starts no thread before this), so the child may run any
    // code after fork.
    match unsafe { fork() } {
        Err(e) => fail(&ctl, "fork", e),
        Ok(ForkResult::Child) => {
            drop((to_keeper_r, to_monitor_w));
            enter(ctl, &spec, to_keeper_w, to_monitor_r)
        }
        Ok(ForkResult::Parent { child }) => {
            drop((to_keeper_w, to_monitor_r));
            let mut byte = [0u8; 1];
            // The monitor writes one byte once it is in its user namespace; EOF means it failed (and said why).
            if read(&to_keeper_r, &mut byte) != Ok(1) {
                std::process::exit(wait_status(child));
            }
            if let Err(e) = map_ids(child, &spec) {
                let _ = nix::sys::signal::kill(child, nix::sys::signal::Signal::SIGKILL);
                fail(&ctl, "user namespace", e);
            }
            if let Err(e) = proto::send(ctl.as_fd(), &Reply::Jailed { host_pid: child.as_raw() }, &[]) {
                let _ = nix::sys::signal::kill(child, nix::sys::signal::Signal::SIGKILL);
                eprintln!("strata-vmm: {e}");
                std::process::exit(1);
            }
            drop(ctl);
            let _ = write(&to_monitor_w, b"g");
            drop((to_keeper_r, to_monitor_w));
            // From here the keeper only waits.
            if let Err(e) = seccomp::compile(&seccomp::keeper_rules()).and_then(|p| seccomp::install(&p)) {
                eprintln!("strata-vmm keeper: {e}");
            }
            std::process::exit(wait_status(child))
        }
    }
}

/// Waits for the monitor: its exit code, or 128 + the signal that killed it.
fn wait_status(child: Pid) -> i32 {
    loop {
        match waitpid(child, None) {
            Ok(WaitStatus::Exited(_, code)) => return code,
            Ok(WaitStatus::Signaled(_, signal, _)) => return 128 + signal as i32,
            Ok(_) => continue,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => return 1,
        }
    }
}

/// Maps the monitor's user namespace: its root is `spec.uid`/`spec.gid` on the host, and nothing else exists.
fn map_ids(child: Pid, spec: &JailSpec) -> std::io::Result<()> {
    let proc = Path::new("/proc").join(child.as_raw().to_string());
    fs::write(proc.join("setgroups"), "deny")?;
    fs::write(proc.join("uid_map"), format!("0 {} 1", spec.uid))?;
    fs::write(proc.join("gid_map"), format!("0 {} 1", spec.gid))?;
    Ok(())
}

/// The monitor's side: the root, the user namespace, no capabilities; then it serves.
fn enter(ctl: OwnedFd, spec: &JailSpec, to_keeper: OwnedFd, from_keeper: OwnedFd) -> ! {
    // Killed with the keeper (single-threaded, so its one thread is the keeper's whole life).
    // SAFETY: prctl(PR_SET_PDEATHSIG) only changes this process's own attribute.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    let namespaces = CloneFlags::CLONE_NEWNS
        | CloneFlags::CLONE_NEWUTS
        | CloneFlags::CLONE_NEWIPC
        | CloneFlags::CLONE_NEWNET
        | CloneFlags::CLONE_NEWCGROUP;
    if let Err(e) = unshare(namespaces) {
        fail(&ctl, "namespaces", e);
    }
    if let Err(e) = make_root(spec) {
        fail(&ctl, "root", e);
    }
    if let Err(e) = nix::unistd::sethostname("strata-vmm") {
        fail(&ctl, "hostname", e);
    }
    // Host root's supplementary groups would stay with us inside the user namespace.
    if let Err(e) = setgroups(&[]) {
        fail(&ctl, "groups", e);
    }
    if let Err(e) = unshare(CloneFlags::CLONE_NEWUSER) {
        fail(&ctl, "user namespace", e);
    }
    let _ = write(&to_keeper, b"u");
    drop(to_keeper);
    let mut byte = [0u8; 1];
    if read(&from_keeper, &mut byte) != Ok(1) {
        // The keeper failed and said why.
        std::process::exit(1);
    }
    drop(from_keeper);
    let root = (Uid::from_raw(0), Gid::from_raw(0));
    if let Err(e) = setresgid(root.1, root.1, root.1).and_then(|()| setresuid(root.0, root.0, root.0)) {
        fail(&ctl, "identity", e);
    }
    if let Err(e) = drop_privileges() {
        fail(&ctl, "capabilities", e);
    }
    // Nothing but the control socket and standard error stays open.
    // SAFETY: close_range on descriptors 3 and up; no object of ours refers to them (the pipes are dropped).
    unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
    if ctl.as_raw_fd() != 0 {
        fail(&ctl, "control socket", "not on descriptor 0");
    }
    if let Err(e) = super::install_sigsys_handler() {
        fail(&ctl, "SIGSYS handler", e);
    }
    if let Err(e) = seccomp::register() {
        fail(&ctl, "seccomp", e);
    }
    if let Err(e) = proto::send(ctl.as_fd(), &Reply::Ready, &[]) {
        eprintln!("strata-vmm: {e}");
        std::process::exit(1);
    }
    super::control::serve(ctl)
}

/// The tmpfs root with `/run` bound from the engine's socket directory, pivoted into, read-only.
fn make_root(spec: &JailSpec) -> nix::Result<()> {
    mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None::<&str>)?;
    let hardened = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mount(Some("tmpfs"), &spec.root_dir, Some("tmpfs"), hardened, Some(ROOT_OPTIONS))?;
    let run = spec.root_dir.join(RUN_DIR.trim_start_matches('/'));
    let old = spec.root_dir.join("old");
    nix::unistd::mkdir(&run, nix::sys::stat::Mode::from_bits_truncate(0o755))?;
    nix::unistd::mkdir(&old, nix::sys::stat::Mode::from_bits_truncate(0o700))?;
    mount(Some(&spec.socket_dir), &run, None::<&str>, MsFlags::MS_BIND, None::<&str>)?;
    mount(None::<&str>, &run, None::<&str>, MsFlags::MS_REMOUNT | MsFlags::MS_BIND | hardened, None::<&str>)?;
    chdir(&spec.root_dir)?;
    pivot_root(".", "old")?;
    chdir("/")?;
    umount2("/old", MntFlags::MNT_DETACH)?;
    std::fs::remove_dir("/old").map_err(|e| nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)))?;
    let read_only = MsFlags::MS_REMOUNT | MsFlags::MS_BIND | MsFlags::MS_RDONLY | hardened;
    mount(None::<&str>, "/", None::<&str>, read_only, None::<&str>)
}

/// Every capability gone (bounding set, ambient, effective, permitted, inheritable), `no_new_privs`, not
/// dumpable, no core files.
fn drop_privileges() -> std::io::Result<()> {
    let check = |ret: libc::c_int| if ret == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) };
    for cap in 0..=LAST_CAPABILITY {
        // SAFETY: prctl(PR_CAPBSET_DROP, cap) takes an integer; EINVAL for numbers this kernel lacks is ignored.
        unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) };
    }
    // SAFETY: prctl with integer arguments, changing only this process's attributes.
    check(unsafe { libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) })?;
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
    let header = CapHeader { version: 0x2008_0522 /* _LINUX_CAPABILITY_VERSION_3 */, pid: 0 };
    let data = [CapData { effective: 0, permitted: 0, inheritable: 0 }; 2];
    // SAFETY: capset(2) reads a version-3 header and two data structs, which these are; it only lowers ours.
    check(unsafe { libc::syscall(libc::SYS_capset, &header, data.as_ptr()) } as libc::c_int)?;
    // SAFETY: prctl with integer arguments, changing only this process's attributes.
    check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) })?;
    // SAFETY: as above.
    check(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) })?;
    let no_core = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: setrlimit with a valid rlimit struct.
    check(unsafe { libc::setrlimit(libc::RLIMIT_CORE, &no_core) })?;
    Ok(())
}
