//! A live jail that runs jobs, in turn or at once: its filesystem (the overlay's upper layer) persists between
//! them.
//!
//! A job runs on the jail's first connection when that is free, else on a lane of its own ([`Lanes`]), beside the
//! others. Either way it runs in a cgroup of its own under the jail's (a child made per lane job, the first
//! connection's kept from job to job), so its CPU time, peak memory and limits (its own, else the sandbox's) are its
//! own whatever runs beside it, while the sandbox's limits bound all of them together. File calls take lanes. A
//! snapshot is taken between jobs: a snapshot while a job or file call runs, or a job or file call while a snapshot
//! is taken, is [`TierError::Busy`]. Close stops the sandbox's service first, when it has one ([`crate::service`]:
//! `SIGTERM`, then `SIGKILL` after its grace), then kills PID 1, which ends whatever runs.

use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard, TryLockError};

use nix::sys::signal::Signal;
use strata_jail::sys::signal_pidfd;

use strata_core::sync::lock;
use strata_core::{
    Capabilities, EntryInfo, ExecOptions, GuestPath, Job, Limits, Net, Outcome, Sandbox, SandboxUsage, ServiceSpec,
    ServiceStatus, Snapshot, TierError, TierKind, Watcher,
};

use crate::fs::{self, file_error, file_target};
use crate::jail::{Jail, Lanes};
use crate::{PreparedJob, Runner, jail_error, run_in};

/// How long connecting to a port of the jail's loopback may take (a listener's full backlog holds it).
const PORT_CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The most `read_file` returns.
const MAX_READ: u64 = 256 * 1024 * 1024;

/// A process-tier sandbox (from [`ProcessTier::start`](crate::ProcessTier)).
#[derive(Debug)]
pub struct ProcessSandbox {
    /// The jail's first connection: a job at a time, snapshots, close.
    jail: Mutex<Option<Jail>>,
    /// A pidfd of the jail's PID 1, so that close ends a job that holds the first connection.
    pid1: Option<OwnedFd>,
    /// Jobs and file calls, beside each other.
    lanes: Arc<Lanes>,
    /// Read by every job and file call while it runs, written by a snapshot: one excludes the other.
    gate: RwLock<()>,
    closed: AtomicBool,
    /// Its capabilities; the network changes at run time ([`Sandbox::set_network`]).
    caps: RwLock<Capabilities>,
    /// Replaces its egress proxy's allowlist, when it has a proxy.
    egress: Option<strata_egress::AllowlistSwitch>,
    /// Its egress secrets' placeholders, as every job's environment has them.
    secret_env: Vec<(String, String)>,
    limits: Limits,
    /// What its snapshots record and are sealed with.
    origin: crate::snapshot::Origin,
    /// The stop grace of its service, once one was started: close stops it first.
    service_grace: Mutex<Option<std::time::Duration>>,
}

impl ProcessSandbox {
    /// A sandbox over a started jail, whose lanes it opens.
    pub(crate) fn new(
        mut jail: Jail,
        caps: Capabilities,
        limits: Limits,
        origin: crate::snapshot::Origin,
    ) -> Result<ProcessSandbox, TierError> {
        let lanes = jail.lanes().map_err(jail_error)?;
        Ok(ProcessSandbox {
            egress: jail.egress_switch(),
            secret_env: jail.egress_secret_env(),
            pid1: jail.pidfd(),
            jail: Mutex::new(Some(jail)),
            lanes,
            gate: RwLock::new(()),
            closed: AtomicBool::new(false),
            caps: RwLock::new(caps),
            limits,
            origin,
            service_grace: Mutex::new(None),
        })
    }

    /// The id of the snapshot this sandbox was forked from, if it was.
    pub fn parent(&self) -> Option<&str> {
        self.origin.parent.as_deref()
    }

    /// The PID of the jail's PID 1 on the host, while it runs.
    pub fn pid1(&self) -> Option<nix::unistd::Pid> {
        lock(&self.jail).as_ref().filter(|jail| !jail.has_ended()).map(Jail::pid1)
    }

    /// The lanes, for a job or file call: refused once the sandbox is closed, and while a snapshot is taken.
    fn lanes(&self) -> Result<(RwLockReadGuard<'_, ()>, &Lanes), TierError> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(ended());
        }
        let gate = match self.gate.try_read() {
            Ok(gate) => gate,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => {
                return Err(TierError::Busy { tier: TierKind::Process, doing: "a snapshot" });
            }
        };
        Ok((gate, &self.lanes))
    }
}

fn ended() -> TierError {
    TierError::SessionEnded { reason: "the sandbox's jail has ended".into() }
}

impl Sandbox for ProcessSandbox {
    fn tier(&self) -> TierKind {
        TierKind::Process
    }

    fn exec(&self, job: &Job, opts: ExecOptions) -> Result<Outcome, TierError> {
        opts.refuse_determinism(TierKind::Process, "process-tier jobs")?;
        let limits = opts.limits.clone().unwrap_or_else(|| self.limits.clone());
        let caps = self.caps.read().unwrap_or_else(PoisonError::into_inner).clone();
        let mut prepared = PreparedJob::new(job, &caps, &limits, &opts, &self.origin.image)?;
        prepared.add_env(self.secret_env.clone());
        let stdin = opts.stdin.clone().unwrap_or_default();
        let (_gate, lanes) = self.lanes()?;
        let mut first = match self.jail.try_lock() {
            Ok(first) => Some(first),
            Err(TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        };
        match first.as_deref_mut() {
            Some(Some(jail)) if !jail.has_ended() => {
                run_in(Runner::Jail(jail), prepared, &caps, &limits, &stdin, &opts)
            }
            Some(_) => Err(ended()),
            None => run_in(Runner::Lane(lanes), prepared, &caps, &limits, &stdin, &opts),
        }
    }

    /// From a thread of its own that enters the jail's network namespace (through the pidfd of its PID 1) and
    /// connects there: the socket stays in that namespace after the thread has ended, so it reaches the jail's
    /// loopback and nothing else; the calling thread's namespace never changes.
    fn connect_port(&self, port: u16) -> Result<strata_core::PortStream, TierError> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(ended());
        }
        let pid1 = self.pid1.as_ref().ok_or_else(ended)?;
        let connect = || -> Result<std::net::TcpStream, TierError> {
            nix::sched::setns(pid1, nix::sched::CloneFlags::CLONE_NEWNET).map_err(|errno| {
                TierError::internal_from(TierKind::Process, "entering the jail's network namespace", errno)
            })?;
            let address = std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, port));
            std::net::TcpStream::connect_timeout(&address, PORT_CONNECT_TIMEOUT)
                .map_err(|err| TierError::PortClosed { port, reason: err.to_string() })
        };
        std::thread::scope(|scope| {
            std::thread::Builder::new()
                .name("strata-port".into())
                .spawn_scoped(scope, connect)
                .map_err(|e| TierError::internal_from(TierKind::Process, "starting the port thread", e))?
                .join()
                .unwrap_or_else(|_| Err(TierError::internal(TierKind::Process, "the port thread panicked")))
        })
        .map(strata_core::PortStream::Tcp)
    }

    /// The jail's cgroup (every job and what it left running) and its writable layer.
    fn usage(&self) -> Result<SandboxUsage, TierError> {
        let (_gate, lanes) = self.lanes()?;
        let (cpu_time, (memory_used, memory_cache, limit), (disk_used, disk_total)) = lanes.usage();
        Ok(SandboxUsage {
            cpu_count: self.limits.vcpus,
            cpu_time,
            memory_used,
            memory_cache,
            memory_total: limit.min(self.limits.memory.0),
            disk_used,
            disk_total,
        })
    }

    fn write_file(&self, path: &str, contents: &[u8]) -> Result<(), TierError> {
        let path = file_target(path)?;
        let (_gate, lanes) = self.lanes()?;
        lanes.write_file(path.as_str(), contents, 0o644).map_err(|e| file_error(path.as_str(), e))
    }

    fn read_file(&self, path: &str) -> Result<Vec<u8>, TierError> {
        let path = file_target(path)?;
        let (_gate, lanes) = self.lanes()?;
        lanes.read_file(path.as_str(), MAX_READ).map_err(|e| file_error(path.as_str(), e))
    }

    fn list_dir(&self, path: &GuestPath, depth: u32) -> Result<Vec<EntryInfo>, TierError> {
        let (_gate, lanes) = self.lanes()?;
        fs::list_dir(lanes, path, depth)
    }

    fn stat(&self, path: &GuestPath) -> Result<EntryInfo, TierError> {
        let (_gate, lanes) = self.lanes()?;
        fs::stat(lanes, path)
    }

    fn make_dir(&self, path: &GuestPath) -> Result<bool, TierError> {
        let (_gate, lanes) = self.lanes()?;
        fs::make_dir(lanes, path)
    }

    fn rename(&self, from: &GuestPath, to: &GuestPath) -> Result<EntryInfo, TierError> {
        let (_gate, lanes) = self.lanes()?;
        fs::rename(lanes, from, to)
    }

    fn remove(&self, path: &GuestPath) -> Result<(), TierError> {
        let (_gate, lanes) = self.lanes()?;
        fs::remove(lanes, path)
    }

    /// A watch lasts beyond this call: it does not hold a snapshot off (a snapshot reads the files, it does not
    /// change them).
    fn watch(&self, path: &GuestPath, recursive: bool) -> Result<Watcher, TierError> {
        let (_gate, lanes) = self.lanes()?;
        fs::watch(lanes, path, recursive)
    }

    fn snapshot(&self, destination: &Path) -> Result<Snapshot, TierError> {
        let _gate = match self.gate.try_write() {
            Ok(gate) => gate,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => {
                return Err(TierError::Busy { tier: TierKind::Process, doing: "a job or file call" });
            }
        };
        let mut jail = lock(&self.jail);
        let jail = match jail.as_mut() {
            Some(jail) if !jail.has_ended() => jail,
            _ => return Err(ended()),
        };
        let caps = self.caps.read().unwrap_or_else(PoisonError::into_inner).clone();
        crate::snapshot::take(jail, destination, &caps, &self.limits, &self.origin)
    }

    /// Puts `net` in force for the connections its jobs make from now on (and their proxy variables): its
    /// egress proxy's allowlist is replaced. A sandbox started without a network has no proxy to change.
    fn set_network(&self, net: &Net) -> Result<(), TierError> {
        let Some(switch) = &self.egress else {
            return Err(TierError::Unsupported {
                tier: TierKind::Process,
                what: "changing the network of a sandbox started without one (start it with a network, an empty \
                       allowlist included, to change it later)"
                    .into(),
            });
        };
        let allowlist = match net {
            Net::Deny => strata_core::Allowlist::deny_all(),
            Net::Allow(allowlist) => allowlist.clone(),
        };
        if !switch.set(allowlist.clone()) {
            return Err(ended());
        }
        self.caps.write().unwrap_or_else(PoisonError::into_inner).net = Net::Allow(allowlist);
        Ok(())
    }

    /// `/bin/sh -c` the command, as a job of this sandbox is prepared, supervised by the jail's PID 1 in a cgroup
    /// of its own (the crate's `service` module).
    fn start_service(&self, spec: &ServiceSpec) -> Result<(), TierError> {
        let caps = self.caps.read().unwrap_or_else(PoisonError::into_inner).clone();
        let service = crate::service::prepare(spec, &caps, &self.limits, &self.origin.image, self.secret_env.clone())?;
        let (_gate, lanes) = self.lanes()?;
        crate::service::start(lanes, &service, &self.limits)?;
        *lock(&self.service_grace) = Some(spec.stop_grace);
        Ok(())
    }

    fn service(&self) -> Result<Option<ServiceStatus>, TierError> {
        let (_gate, lanes) = self.lanes()?;
        crate::service::status(lanes)
    }

    /// Stops its service gracefully, when it has one (waiting at most the service's stop grace and a margin),
    /// then kills every process of the jail (its jobs end as cancelled when their tokens were cancelled, else as
    /// crashed) and releases it.
    fn close(&self) -> Result<(), TierError> {
        let first = !self.closed.swap(true, Ordering::SeqCst);
        let service = lock(&self.service_grace).take();
        if let (true, Some(grace)) = (first, service) {
            crate::service::stop(&self.lanes, grace);
        }
        // A job on the first connection holds the jail: it ends with PID 1 and lets go.
        if let Some(pid1) = &self.pid1 {
            signal_pidfd(pid1, Signal::SIGKILL);
        }
        let jail = self.jail.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(jail) = jail {
            jail.close();
        }
        Ok(())
    }
}

impl ProcessSandbox {
    /// Writes `contents` to `path` in the sandbox with the permission bits `mode` (set-user-ID and set-group-ID
    /// dropped), its missing parents made, owned as [`Sandbox::write_file`]'s files are.
    pub fn write_file_mode(&self, path: &str, contents: &[u8], mode: u32) -> Result<(), TierError> {
        let path = file_target(path)?;
        let (_gate, lanes) = self.lanes()?;
        lanes.write_file(path.as_str(), contents, mode).map_err(|e| file_error(path.as_str(), e))
    }

    /// Writes the sandbox's filesystem changes (the overlay's upper layer: what its jobs wrote, whiteouts for what
    /// they deleted) to `out` as a [`strata_jail::tree`] file, owners as the jail sees them; its processes are
    /// paused meanwhile. What an image build stores as a layer.
    pub fn write_upper(&self, out: &mut dyn std::io::Write) -> Result<strata_jail::tree::TreeStats, TierError> {
        let _gate = self.gate.write().unwrap_or_else(PoisonError::into_inner);
        let mut jail = lock(&self.jail);
        let jail = match jail.as_mut() {
            Some(jail) if !jail.has_ended() => jail,
            _ => return Err(ended()),
        };
        let upper = jail.open_upper().map_err(jail_error)?;
        let id_map = jail.id_map();
        let stopped = jail.pause();
        let written = strata_jail::tree::write_tree(std::os::fd::AsFd::as_fd(&upper), &mut *out, id_map);
        jail.resume(stopped);
        written.map_err(|err| crate::internal(format!("reading the upper layer: {err}")))
    }
}

#[cfg(test)]
impl ProcessSandbox {
    /// Its lanes, for tests that call the file functions with other bounds than the methods'.
    pub(crate) fn lanes_for_tests(&self) -> &Lanes {
        &self.lanes
    }
}
