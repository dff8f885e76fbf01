//! The monitor process: one microVM per process, jailed the way Firecracker's jailer does it, driven by the engine
//! over the control socket ([`crate::proto`]).
//!
//! The engine runs the `strata-vmm` binary (embedded in it, from a sealed memfd) with the control socket as
//! standard input. What happens then:
//!
//! 1. **The keeper** ([`jail::keeper`], host root, single-threaded) reads [`crate::proto::JailSpec`], joins the
//!    VM's cgroup (memory, pids, CPU: the monitor inherits it), enters a new PID namespace and forks the monitor,
//!    its PID 1 (killed with the keeper).
//! 2. **The monitor** (`jail::enter`), still host root, enters new mount, UTS, IPC, network and cgroup
//!    namespaces of its own, makes every mount private,
//!    mounts a small tmpfs as its root holding only `/run` (the VM's socket directory, bound from the engine's),
//!    `pivot_root`s into it, detaches the old root and remounts the new one read-only; then drops its
//!    supplementary groups and enters a new **user namespace** whose root the keeper maps to an unprivileged host
//!    user and group, becomes that user, drops every capability (effective, permitted, inheritable, bounding,
//!    ambient), sets `no_new_privs`, is no longer dumpable (no ptrace, no `/proc` access by that user), and closes
//!    every descriptor but the control socket and standard error. The mount namespace belongs to the host's user
//!    namespace, so the monitor cannot change a mount even before it drops its capabilities. It never sees a host
//!    path: `/dev/kvm`, the kernel, the initramfs, disks and snapshot files arrive as descriptors.
//! 3. The keeper writes the ID maps, reports the monitor's host PID ([`crate::proto::Reply::Jailed`]), closes its
//!    end of the socket, installs its own filter (`wait4` and exit) and exits with the monitor's status when it
//!    ends (128 + the signal for a killed one).
//! 4. The monitor registers the seccomp filters ([`crate::seccomp`]: the spawner thread starts under its own),
//!    reports [`crate::proto::Reply::Ready`], builds the machine [`crate::proto::Request::Start`] describes
//!    ([`build`]), installs the VMM filter on its main thread, starts the vCPUs (each under the vCPU filter) and
//!    serves requests ([`control`]) until [`crate::proto::Request::Stop`] or the engine closes the socket.
//!
//! A thread that makes a call outside its filter gets `SIGSYS`; the handler writes which thread and which call to
//! standard error and exits with [`crate::seccomp::SECCOMP_EXIT`]: the engine reports a crashed VM with that line.

pub mod build;
pub mod control;
pub mod jail;
mod probe;

use std::os::fd::{FromRawFd, OwnedFd};

/// The binary's entry: the keeper, which forks the monitor.
pub fn main() -> ! {
    // Started as `/proc/self/fd/N`, the process would be named `N` in `ps` and `/proc/PID/comm`; best effort.
    let _ = nix::sys::prctl::set_name(c"strata-vmm");
    // SAFETY: the engine starts this binary with the control socket as standard input; nothing else in this
    // process owns descriptor 0.
    let ctl = unsafe { OwnedFd::from_raw_fd(0) };
    jail::keeper(ctl)
}

/// The `SIGSYS` handler: reports the thread kind and the call, then exits with the seccomp status. Only
/// async-signal-safe work: a const-initialised thread-local read, formatting into a stack buffer, `write`, `_exit`.
extern "C" fn on_sigsys(_signal: libc::c_int, info: *mut libc::siginfo_t, _context: *mut libc::c_void) {
    // `si_syscall` sits at byte 24 of a SIGSYS siginfo on x86-64 (after signo, errno, code, padding and
    // `si_call_addr`).
    let call = if info.is_null() {
        -1
    } else {
        // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers; the read stays inside it (128 bytes).
        unsafe { info.cast::<u8>().add(24).cast::<i32>().read_unaligned() }
    };
    let kind = match crate::seccomp::current_kind_code() {
        1 => "vmm",
        2 => "vcpu",
        3 => "worker",
        4 => "spawner",
        _ => "unknown",
    };
    let mut buf = [0u8; 128];
    let mut len = 0;
    for part in [b"strata-vmm: the ".as_slice(), kind.as_bytes(), b" thread made system call ".as_slice()] {
        let n = part.len().min(buf.len() - len);
        buf[len..len + n].copy_from_slice(&part[..n]);
        len += n;
    }
    len += write_decimal(&mut buf[len..], call);
    for &b in b" outside its seccomp filter\n" {
        if len < buf.len() {
            buf[len] = b;
            len += 1;
        }
    }
    // SAFETY: write(2) of our own stack buffer to standard error, then _exit(2): both async-signal-safe and on
    // every thread's list.
    unsafe {
        libc::write(2, buf.as_ptr().cast(), len);
        libc::_exit(crate::seccomp::SECCOMP_EXIT);
    }
}

fn write_decimal(out: &mut [u8], value: i32) -> usize {
    let mut digits = [0u8; 12];
    let mut n = 0;
    let negative = value < 0;
    let mut v = value.unsigned_abs();
    loop {
        digits[n] = b'0' + (v % 10) as u8;
        n += 1;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    if negative {
        digits[n] = b'-';
        n += 1;
    }
    let n = n.min(out.len());
    for i in 0..n {
        out[i] = digits[n - 1 - i];
    }
    n
}

/// Installs [`on_sigsys`] for the whole process.
fn install_sigsys_handler() -> std::io::Result<()> {
    // SAFETY: a zeroed sigaction is valid; we set a SA_SIGINFO handler with the matching signature and an empty
    // mask, then install it with sigaction(2), checking the result.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigsys as *const () as usize;
        action.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut action.sa_mask);
        if libc::sigaction(libc::SIGSYS, &action, std::ptr::null_mut()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimals() {
        let mut buf = [0u8; 12];
        let n = write_decimal(&mut buf, 41);
        assert_eq!(&buf[..n], b"41");
        let n = write_decimal(&mut buf, -1);
        assert_eq!(&buf[..n], b"-1");
        let n = write_decimal(&mut buf, 0);
        assert_eq!(&buf[..n], b"0");
    }
}
