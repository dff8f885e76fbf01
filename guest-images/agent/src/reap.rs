//! Waiting for children.
//!
//! As PID 1 (or a child subreaper) the agent reaps every process that ends under it: [`Reaper::all`] runs one
//! thread blocked in `wait4(-1)`, and hands the status of each exec's main process to the exec that registered
//! it (an orphan's is dropped). A process is registered while the registry is locked around its `fork`, so the
//! reaper, which takes the lock before looking a PID up, never sees an exec's PID before it is registered.
//!
//! Run as an ordinary process (in a test binary, beside other code that waits for its own children), the agent
//! must not wait for processes it did not start: [`Reaper::own`] waits for each exec's PID from a thread of its
//! own.
//!
//! Either way the exec learns of the exit through an [`ExitSlot`]: the status and resource use, and an eventfd
//! that becomes readable when they are there, so the exec's output loop can poll for it beside its pipes.

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use nix::errno::Errno;
use nix::sys::eventfd::{EfdFlags, EventFd};
use strata_guest_proto::{ExitStatus, Rusage};

/// How a process ended and what it used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exit {
    /// Exit code or signal.
    pub status: ExitStatus,
    /// From `wait4`.
    pub rusage: Rusage,
}

/// Where an exec's exit arrives.
#[derive(Debug)]
pub struct ExitSlot {
    exit: Mutex<Option<Exit>>,
    ready: EventFd,
}

impl ExitSlot {
    fn new() -> Result<Arc<ExitSlot>, Errno> {
        let ready = EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?;
        Ok(Arc::new(ExitSlot { exit: Mutex::new(None), ready }))
    }

    fn fill(&self, exit: Exit) {
        *lock(&self.exit) = Some(exit);
        // The counter cannot overflow from one write of 1.
        let _ = self.ready.write(1);
    }

    /// Readable once the exit is known.
    pub fn ready_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.ready.as_fd()
    }

    /// The exit, once known.
    pub fn take(&self) -> Option<Exit> {
        lock(&self.exit).take()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Who waits for the agent's children.
#[derive(Debug, Clone)]
pub enum Reaper {
    /// Each exec's PID, by a thread of its own; nothing else is waited for.
    Own,
    /// Every child, by one thread.
    All(Arc<Registry>),
}

/// The execs waiting for their main process, by PID.
#[derive(Debug, Default)]
pub struct Registry {
    state: Mutex<RegistryState>,
    spawned: Condvar,
}

#[derive(Debug, Default)]
struct RegistryState {
    waiting: HashMap<i32, Arc<ExitSlot>>,
    /// Counts forks, so the reaper knows when there may be children again.
    generation: u64,
    /// Orphans reaped (for tests and logs).
    orphans: u64,
}

impl Reaper {
    /// Waits only for the execs' own processes.
    pub fn own() -> Reaper {
        Reaper::Own
    }

    /// Reaps every child, from a new thread.
    pub fn all() -> std::io::Result<Reaper> {
        let registry = Arc::new(Registry::default());
        let for_thread = Arc::clone(&registry);
        std::thread::Builder::new().name("reaper".into()).spawn(move || reap_forever(&for_thread))?;
        Ok(Reaper::All(registry))
    }

    /// Orphans reaped so far ([`Reaper::All`] only).
    pub fn orphans_reaped(&self) -> u64 {
        match self {
            Reaper::Own => 0,
            Reaper::All(registry) => lock(&registry.state).orphans,
        }
    }

    /// Forks with `fork`, which returns the child's PID in the parent (and never returns in the child); the
    /// slot receives the child's exit.
    pub fn fork(&self, fork: impl FnOnce() -> Result<i32, Errno>) -> Result<(i32, Arc<ExitSlot>), Errno> {
        let slot = ExitSlot::new()?;
        match self {
            Reaper::Own => {
                let pid = fork()?;
                let for_thread = Arc::clone(&slot);
                let waiter = std::thread::Builder::new().name(format!("wait-{pid}")).spawn(move || {
                    for_thread.fill(wait_for(pid));
                });
                if waiter.is_err() {
                    // SAFETY: kill() takes no pointers; `pid` is our unreaped child, so it names no other process.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                    slot.fill(wait_for(pid));
                }
                Ok((pid, slot))
            }
            Reaper::All(registry) => {
                let mut state = lock(&registry.state);
                let pid = fork()?;
                state.waiting.insert(pid, Arc::clone(&slot));
                state.generation += 1;
                drop(state);
                registry.spawned.notify_one();
                Ok((pid, slot))
            }
        }
    }
}

/// Waits for one child.
fn wait_for(pid: i32) -> Exit {
    loop {
        match wait4(pid) {
            Ok((_, exit)) => return exit,
            Err(Errno::EINTR) => continue,
            // Only if someone else reaped it: report it as killed rather than hang.
            Err(_) => return Exit { status: ExitStatus::Signal(libc::SIGKILL), rusage: Rusage::default() },
        }
    }
}

fn reap_forever(registry: &Registry) {
    loop {
        let seen = lock(&registry.state).generation;
        match wait4(-1) {
            Ok((pid, exit)) => {
                let mut state = lock(&registry.state);
                match state.waiting.remove(&pid) {
                    Some(slot) => slot.fill(exit),
                    None => state.orphans += 1,
                }
            }
            Err(Errno::EINTR) => {}
            Err(_) => {
                // No children: sleep until the next fork.
                let mut state = lock(&registry.state);
                while state.generation == seen {
                    state = registry.spawned.wait(state).unwrap_or_else(PoisonError::into_inner);
                }
            }
        }
    }
}

/// `wait4(pid, ..., 0)`: blocks until a child (`-1`: any) ends.
pub fn wait4(pid: i32) -> Result<(i32, Exit), Errno> {
    let mut status = 0;
    // SAFETY: rusage is plain data for which all-zero bytes are a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `status` and `usage` are valid for writes for the duration of the call.
    let reaped = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    if reaped < 0 {
        return Err(Errno::last());
    }
    Ok((reaped, Exit { status: decode_status(status), rusage: rusage_of(&usage) }))
}

/// A `wait` status word as an [`ExitStatus`].
pub fn decode_status(status: i32) -> ExitStatus {
    if libc::WIFSIGNALED(status) {
        ExitStatus::Signal(libc::WTERMSIG(status))
    } else {
        ExitStatus::Code(libc::WEXITSTATUS(status))
    }
}

fn micros(tv: libc::timeval) -> u64 {
    let secs = u64::try_from(tv.tv_sec).unwrap_or(0);
    let micros = u64::try_from(tv.tv_usec).unwrap_or(0);
    secs.saturating_mul(1_000_000).saturating_add(micros)
}

fn rusage_of(usage: &libc::rusage) -> Rusage {
    Rusage {
        user_us: micros(usage.ru_utime),
        sys_us: micros(usage.ru_stime),
        // Linux reports ru_maxrss in KiB.
        max_rss_kb: u64::try_from(usage.ru_maxrss).unwrap_or(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_statuses_decode() {
        assert_eq!(decode_status(0), ExitStatus::Code(0));
        assert_eq!(decode_status(3 << 8), ExitStatus::Code(3));
        assert_eq!(decode_status(libc::SIGKILL), ExitStatus::Signal(9));
        assert_eq!(decode_status(libc::SIGSEGV | 0x80), ExitStatus::Signal(libc::SIGSEGV));
    }
}
