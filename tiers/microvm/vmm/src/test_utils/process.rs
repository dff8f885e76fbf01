//! One test process, many tests: who may run beside whom, and what the process holds.
//!
//! libtest runs a binary's tests on parallel threads of one process. A test that runs vCPUs wants the host's
//! cores to itself (its timing checks), and a test that checks for leaks compares the process's fds and threads
//! before and after: both need the process to themselves. So every test of such a binary takes one guard of one
//! lock first: [`alone`] (or [`kvm`], which also checks for `/dev/kvm`) exclusively, [`shared`] beside the
//! other shared tests. A test takes one guard, once: the lock is not reentrant.
//!
//! [`Held`] lists what the process holds, so that a leak check names what was left behind.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// The lock every test of a binary takes first. A test that failed while holding it poisons nothing: the next
/// test starts from whatever the failed one left, as it would in a process of its own.
static PROCESS: RwLock<()> = RwLock::new(());

/// Held by a test that has the process to itself.
#[derive(Debug)]
pub struct Alone {
    _guard: RwLockWriteGuard<'static, ()>,
}

/// Held by a test that runs beside other shared tests, never beside one that is [`Alone`].
#[derive(Debug)]
pub struct Shared {
    _guard: RwLockReadGuard<'static, ()>,
}

/// Waits until no other test runs, and keeps it so until the guard is dropped.
pub fn alone() -> Alone {
    Alone { _guard: PROCESS.write().unwrap_or_else(PoisonError::into_inner) }
}

/// Waits until no test runs [`alone`], and keeps it so until the guard is dropped.
pub fn shared() -> Shared {
    Shared { _guard: PROCESS.read().unwrap_or_else(PoisonError::into_inner) }
}

/// For a test on KVM: the process to itself ([`alone`]), or `None`, after one `skip:` line, without `/dev/kvm`.
pub fn kvm() -> Option<Alone> {
    if !Path::new("/dev/kvm").exists() {
        println!("skip: /dev/kvm is absent");
        return None;
    }
    Some(alone())
}

/// What the process holds: its open fds and its `strata-*` threads (vCPUs, device backends, egress proxies;
/// the test harness's own threads come and go with the other tests), each by number and what it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// Each fd with what it refers to (`3`, `anon_inode:kvm-vm`), but for the one this listing reads through.
    pub fds: BTreeSet<(u32, String)>,
    /// Each `strata-*` thread's id and name.
    pub threads: BTreeSet<(u32, String)>,
}

impl Held {
    /// What the process holds now.
    pub fn now() -> Held {
        Held { fds: open_fds(), threads: strata_threads() }
    }

    /// What `self` holds that `before` did not: a leak check's finding, empty when nothing was left behind.
    pub fn since(&self, before: &Held) -> Held {
        Held {
            fds: self.fds.difference(&before.fds).cloned().collect(),
            threads: self.threads.difference(&before.threads).cloned().collect(),
        }
    }

    /// Whether this holds nothing.
    pub fn is_empty(&self) -> bool {
        self.fds.is_empty() && self.threads.is_empty()
    }
}

fn open_fds() -> BTreeSet<(u32, String)> {
    let listing = std::fs::read_link("/proc/self").map(|pid| Path::new("/proc").join(pid).join("fd")).ok();
    std::fs::read_dir("/proc/self/fd")
        .expect("list /proc/self/fd")
        .flatten()
        .filter_map(|fd| {
            let number = fd.file_name().to_str()?.parse().ok()?;
            let target = std::fs::read_link(fd.path()).ok()?;
            (Some(&target) != listing.as_ref()).then(|| (number, target.display().to_string()))
        })
        .collect()
}

fn strata_threads() -> BTreeSet<(u32, String)> {
    std::fs::read_dir("/proc/self/task")
        .expect("list /proc/self/task")
        .flatten()
        .filter_map(|task| {
            let id = task.file_name().to_str()?.parse().ok()?;
            let name = std::fs::read_to_string(task.path().join("comm")).ok()?.trim_end().to_owned();
            name.starts_with("strata-").then_some((id, name))
        })
        .collect()
}
