//! The jail's user namespace and the idmapped mounts that make it usable.
//!
//! Jobs run as root *of the jail*, which is host UID/GID [`IdMap::base`] — an unprivileged ID on the host — rather
//! than host root. For that to look like a normal system inside, the image (owned by host root) is mounted
//! *idmapped* through the namespace's mapping, so its files appear owned by the jail's root; grants are idmapped
//! the same way, so a job's writes into a read-write grant land on the host owned by host root, as they would from
//! a root process. The mount and network namespaces stay owned by the host's user namespace: even with a
//! capability inside its own user namespace, a job could not mount or configure anything.
//!
//! The keeper creates the namespace; PID 1 stays in the host's user namespace (it builds mounts); each job's
//! process joins the jail's user namespace with `setns` before it drops every capability.

use std::fs;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use nix::errno::Errno;
use nix::sched::CloneFlags;
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::waitpid;
use nix::unistd::Pid;

use crate::proto::IdMap;

/// The process a new [`UserNamespace`] was created in, killed once its ID maps were written: reap it with
/// [`reap`](NamespaceHolder::reap) (it counts against its cgroup's processes until then).
#[derive(Debug)]
#[must_use = "the holder is a child process to reap"]
pub struct NamespaceHolder(Pid);

impl NamespaceHolder {
    /// Waits for the (killed) holder to end and reaps it.
    pub fn reap(self) {
        let _ = waitpid(self.0, None);
    }
}

/// A user namespace with a mapping `0..count` → `base..base+count`, held open by a descriptor.
#[derive(Debug)]
pub struct UserNamespace {
    fd: OwnedFd,
    map: IdMap,
}

impl UserNamespace {
    /// Creates the namespace: a child is cloned into it (`CLONE_NEWUSER`) and does nothing but wait to be killed;
    /// this process writes the namespace's ID maps through `/proc/<child>`, keeps a descriptor to it and kills
    /// the child. Nothing waits for the child to run: it is reaped with [`NamespaceHolder::reap`]. Its PID is
    /// the one in this process's PID namespace, which the mounted `/proc` must show: call this before unsharing a
    /// PID namespace. Must be called single-threaded.
    pub fn create(map: IdMap) -> Result<(UserNamespace, NamespaceHolder), Errno> {
        // SAFETY: a clone without CLONE_VM and without a new stack is a fork: the child runs on a copy of this
        // single-threaded process's memory and only calls pause (async-signal-safe) until it is killed; it never
        // leaves this block, allocates or takes a lock.
        let pid = unsafe {
            libc::syscall(libc::SYS_clone, libc::CLONE_NEWUSER | libc::SIGCHLD, 0usize, 0usize, 0usize, 0usize)
        };
        if pid < 0 {
            return Err(Errno::last());
        }
        if pid == 0 {
            loop {
                // SAFETY: pause only waits for a signal; SIGKILL ends this child.
                unsafe { libc::pause() };
            }
        }
        let holder = NamespaceHolder(Pid::from_raw(pid as i32));
        let adopted = Self::adopt(&Path::new("/proc").join(pid.to_string()), map);
        let _ = kill(holder.0, Signal::SIGKILL);
        match adopted {
            Ok(userns) => Ok((userns, holder)),
            Err(errno) => {
                holder.reap();
                Err(errno)
            }
        }
    }

    fn adopt(process: &Path, map: IdMap) -> Result<UserNamespace, Errno> {
        let line = format!("0 {} {}\n", map.base, map.count);
        fs::write(process.join("uid_map"), &line).map_err(io_errno)?;
        fs::write(process.join("gid_map"), &line).map_err(io_errno)?;
        let file = fs::File::open(process.join("ns/user")).map_err(io_errno)?;
        Ok(UserNamespace { fd: file.into(), map })
    }

    /// The mapping.
    pub fn map(&self) -> IdMap {
        self.map
    }

    /// Moves the calling process into the namespace as its root (UID and GID 0, no supplementary groups).
    /// Must be called single-threaded, before the capabilities are dropped.
    pub fn enter_as_root(&self) -> Result<(), Errno> {
        nix::sched::setns(&self.fd, CloneFlags::CLONE_NEWUSER)?;
        nix::unistd::setgroups(&[])?;
        let root_gid = nix::unistd::Gid::from_raw(0);
        let root_uid = nix::unistd::Uid::from_raw(0);
        nix::unistd::setresgid(root_gid, root_gid, root_gid)?;
        nix::unistd::setresuid(root_uid, root_uid, root_uid)
    }

    /// Moves the calling process into the namespace with every capability in it (IDs unchanged): how a helper of
    /// PID 1 writes the ID maps of a namespace nested in this one. Must be called single-threaded.
    pub fn enter(&self) -> Result<(), Errno> {
        nix::sched::setns(&self.fd, CloneFlags::CLONE_NEWUSER)
    }

    /// Mounts `source` at `target` idmapped through this namespace (a detached clone of the source tree, its
    /// attributes set, then moved into place), `nosuid,nodev`, read-only when asked.
    pub fn mount_idmapped(&self, source: &Path, target: &Path, read_only: bool) -> Result<(), Errno> {
        let tree = open_tree(source)?;
        let mut attr_set = libc::MOUNT_ATTR_IDMAP | libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV;
        if read_only {
            attr_set |= libc::MOUNT_ATTR_RDONLY;
        }
        let attr = MountAttr { attr_set, attr_clr: 0, propagation: 0, userns_fd: self.fd.as_raw_fd() as u64 };
        // SAFETY: mount_setattr reads `attr` (repr(C), the kernel's struct mount_attr, size passed) and an empty
        // path relative to `tree`, a descriptor we own.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_mount_setattr,
                tree.as_raw_fd(),
                c"".as_ptr(),
                libc::AT_EMPTY_PATH,
                &attr as *const MountAttr,
                std::mem::size_of::<MountAttr>(),
            )
        };
        if rc < 0 {
            return Err(Errno::last());
        }
        move_mount(&tree, target)
    }

    /// Gives a file or directory PID 1 created to the jail's root, so jobs can change it.
    pub fn give(&self, path: &Path) -> Result<(), Errno> {
        let id = Some(self.map.base);
        nix::unistd::chown(path, id.map(nix::unistd::Uid::from_raw), id.map(nix::unistd::Gid::from_raw))
    }
}

/// The kernel's `struct mount_attr`.
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

fn io_errno(err: std::io::Error) -> Errno {
    Errno::from_raw(err.raw_os_error().unwrap_or(libc::EIO))
}

fn open_tree(source: &Path) -> Result<OwnedFd, Errno> {
    let path = std::ffi::CString::new(source.as_os_str().as_encoded_bytes()).map_err(|_| Errno::EINVAL)?;
    let flags = libc::OPEN_TREE_CLONE | libc::OPEN_TREE_CLOEXEC as libc::c_uint;
    // SAFETY: open_tree reads a NUL-terminated path that outlives the call and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_open_tree, libc::AT_FDCWD, path.as_ptr(), flags) };
    if fd < 0 {
        return Err(Errno::last());
    }
    // SAFETY: the kernel just returned this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

fn move_mount(tree: &OwnedFd, target: &Path) -> Result<(), Errno> {
    let target = std::ffi::CString::new(target.as_os_str().as_encoded_bytes()).map_err(|_| Errno::EINVAL)?;
    // SAFETY: move_mount reads two NUL-terminated paths that outlive the call; `tree` is a descriptor we own.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_FDCWD,
            target.as_ptr(),
            libc::MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    if rc < 0 { Err(Errno::last()) } else { Ok(()) }
}
