//! The live sandboxes and snapshots the server holds, with their owners, deadlines and admission counts.
//!
//! Locks here are `std` mutexes held for a few instructions, never across an `await` or a job. A sandbox's calls
//! run on blocking threads, beside each other as far as its tier allows ([`Sandbox`] says what runs at once; a call
//! its tier cannot take beside a running one is `409 sandbox_busy`), so a command started in the background does
//! not hold up the next on the process tier. [`SandboxEntry::kill`] cancels the running jobs before it closes the
//! sandbox.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use strata_core::{CancelToken, ExecOptions, Job, Limits, Outcome, Sandbox, Snapshot, TierError, TierKind};

use crate::capacity::{HostCapacity, Short};

/// Locks a mutex, taking the data of a poisoned one (a panic elsewhere must not wedge the server).
pub(crate) use strata_core::sync::lock;

/// Seconds since the Unix epoch.
pub(crate) fn unix_seconds(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// A fresh identifier with a prefix: `sb_…` for sandboxes, `snap_…` for snapshots.
pub(crate) fn new_id(prefix: &str) -> String {
    let uuid = uuid::Uuid::new_v4().simple().to_string();
    format!("{prefix}{}", &uuid[..20])
}

/// Why a call on a sandbox or snapshot of the registry failed.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// No such sandbox (or one the caller may not see, or one that was killed).
    #[error("no sandbox {0}")]
    SandboxNotFound(String),
    /// No such snapshot (or one the caller may not see).
    #[error("no snapshot {0}")]
    SnapshotNotFound(String),
    /// The sandbox cannot take the request beside what it is doing (a tier that runs one job at a time, a
    /// snapshot while jobs run).
    #[error("sandbox {id} is busy with {doing}")]
    Busy {
        /// The sandbox.
        id: String,
        /// What it is busy with.
        doing: &'static str,
    },
    /// The sandbox runs as many jobs at once as it may.
    #[error("sandbox {id} is running {max} jobs, the most it runs at once")]
    TooManyJobs {
        /// The sandbox.
        id: String,
        /// The most it runs at once.
        max: usize,
    },
    /// The sandbox has as many proxied port connections open as it may ([`MAX_PORT_CONNECTIONS`]).
    #[error("sandbox {id} has {max} port connections open, the most it may")]
    TooManyPortConnections {
        /// The sandbox.
        id: String,
        /// The most it has open at once.
        max: usize,
    },
    /// The tier failed the call.
    #[error(transparent)]
    Tier(#[from] TierError),
}

/// Why a sandbox was not admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionError {
    /// The key already holds its quota of concurrent sandboxes.
    #[error("API key {owner} already has {limit} sandboxes (its quota)")]
    Quota {
        /// The key's name.
        owner: String,
        /// Its quota.
        limit: usize,
    },
    /// The server holds its maximum of sandboxes.
    #[error("the server holds its maximum of {limit} sandboxes")]
    Capacity {
        /// The server's maximum.
        limit: usize,
    },
    /// The key's sandboxes would commit more memory than its quota.
    #[error("API key {owner} would commit {asked} bytes of sandbox memory, past its quota of {limit}")]
    MemoryQuota {
        /// The key's name.
        owner: String,
        /// Committed with this request.
        asked: u64,
        /// Its quota.
        limit: u64,
    },
    /// The server's sandboxes would commit more virtual CPUs than its budget.
    #[error("the server's sandboxes would commit {asked} vcpus, past its budget of {limit}")]
    CpuBudget {
        /// Committed with this request.
        asked: u64,
        /// The server's budget.
        limit: u64,
    },
    /// The server's sandboxes would commit more memory than its budget.
    #[error("the server's sandboxes would commit {asked} bytes of memory, past its budget of {limit}")]
    MemoryBudget {
        /// Committed with this request.
        asked: u64,
        /// The server's budget.
        limit: u64,
    },
    /// The host's CPUs have no room for the request's sandboxes ([`crate::capacity`]).
    #[error(
        "this host's {cpus} CPUs ({slots} vCPU slots each) have no room for {count} more sandbox(es) of {vcpus} vcpus"
    )]
    HostCpu {
        /// vCPUs each sandbox asked for.
        vcpus: u32,
        /// Sandboxes in the request.
        count: usize,
        /// The host's CPUs.
        cpus: usize,
        /// vCPU slots per CPU.
        slots: u32,
    },
    /// The host's free memory does not cover the request's memory limits above the floor it keeps.
    #[error(
        "this host has {available} bytes of memory available; the request needs {needed} (its limits and the free floor)"
    )]
    HostMemory {
        /// `MemAvailable` now.
        available: u64,
        /// The request's memory limits plus the floor.
        needed: u64,
    },
}

impl From<Short> for AdmissionError {
    fn from(short: Short) -> AdmissionError {
        match short {
            Short::Cpu { vcpus, count, cpus, slots } => AdmissionError::HostCpu { vcpus, count, cpus, slots },
            Short::Memory { available, needed } => AdmissionError::HostMemory { available, needed },
        }
    }
}

impl AdmissionError {
    /// The label of this rejection in `/metrics`.
    pub fn reason(&self) -> &'static str {
        match self {
            AdmissionError::Quota { .. } => "quota",
            AdmissionError::Capacity { .. } => "capacity",
            AdmissionError::MemoryQuota { .. } => "memory_quota",
            AdmissionError::MemoryBudget { .. } => "memory_budget",
            AdmissionError::CpuBudget { .. } => "cpu_budget",
            AdmissionError::HostCpu { .. } => "host_cpu",
            AdmissionError::HostMemory { .. } => "host_memory",
        }
    }
}

/// The most jobs one sandbox runs at once (each holds a blocking thread of the server while it runs).
pub const MAX_JOBS: usize = 64;

/// A live sandbox and what the server knows about it.
pub struct SandboxEntry {
    /// Its identifier.
    pub id: String,
    /// The name of the API key that created it.
    pub owner: String,
    /// The tier it runs on.
    pub tier: TierKind,
    /// Limits of its jobs unless a job brings its own.
    pub limits: Limits,
    /// When it was created.
    pub created: SystemTime,
    /// The host CPUs admission placed it on ([`crate::capacity`]; accounting, not pinning).
    pub cpus: Vec<usize>,
    deadline: Mutex<(Instant, SystemTime)>,
    sandbox: Arc<dyn Sandbox>,
    /// The jobs running now, by a number of their own.
    running: Mutex<HashMap<u64, CancelToken>>,
    /// Its services running now ([`SandboxEntry::exec_service`]), by the same numbering.
    services: Mutex<HashMap<u64, CancelToken>>,
    next_job: AtomicU64,
    killed: AtomicBool,
    last_used: Mutex<Instant>,
    /// What runs when it is killed (the state other layers keep about it).
    on_kill: Mutex<Vec<Box<dyn FnOnce() + Send>>>,
    /// Its ports' proxied connections open now ([`crate::ports`]).
    pub port_connections: PortConnections,
    /// Its resource use over time ([`crate::usage`]).
    pub usage: crate::usage::UsageLog,
    /// Its recent jobs ([`crate::jobs`]).
    pub jobs: crate::jobs::JobLog,
    /// The image it was created from, when the request named one (`None`: its tier's default).
    pub image: Option<String>,
}

impl std::fmt::Debug for SandboxEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxEntry")
            .field("id", &self.id)
            .field("owner", &self.owner)
            .field("tier", &self.tier)
            .finish()
    }
}

impl SandboxEntry {
    /// An entry for a sandbox that lives for `ttl` from now.
    pub fn new(id: String, owner: String, sandbox: Box<dyn Sandbox>, limits: Limits, ttl: Duration) -> SandboxEntry {
        let now = SystemTime::now();
        SandboxEntry {
            id,
            owner,
            tier: sandbox.tier(),
            limits,
            created: now,
            cpus: Vec::new(),
            deadline: Mutex::new((Instant::now() + ttl, now + ttl)),
            sandbox: Arc::from(sandbox),
            running: Mutex::new(HashMap::new()),
            services: Mutex::new(HashMap::new()),
            next_job: AtomicU64::new(0),
            killed: AtomicBool::new(false),
            last_used: Mutex::new(Instant::now()),
            on_kill: Mutex::new(Vec::new()),
            port_connections: PortConnections::default(),
            usage: crate::usage::UsageLog::default(),
            jobs: crate::jobs::JobLog::default(),
            image: None,
        }
    }

    /// The entry, noting the image it was created from.
    pub fn with_image(mut self, image: Option<String>) -> SandboxEntry {
        self.image = image;
        self
    }

    /// Samples what the sandbox uses now into its log ([`crate::usage`]); `Unsupported` on a tier that cannot tell.
    /// Looking is not using: the sandbox's idle time goes on.
    pub fn sample_usage(&self) -> Result<(), RegistryError> {
        if self.killed.load(Ordering::SeqCst) {
            return Err(RegistryError::SandboxNotFound(self.id.clone()));
        }
        let usage = self.sandbox.usage()?;
        self.usage.record(std::time::SystemTime::now(), usage);
        Ok(())
    }

    /// Its service (an image's start command) as its init reports it; `None` when it has none or is gone.
    /// Blocking: one round trip to the sandbox.
    pub fn service(&self) -> Option<strata_core::ServiceStatus> {
        if self.killed.load(Ordering::SeqCst) {
            return None;
        }
        self.sandbox.service().ok().flatten()
    }

    /// Runs `f` (blocking) when the sandbox is killed, after it is closed; at once if it already was.
    pub fn on_kill(&self, f: impl FnOnce() + Send + 'static) {
        let mut hooks = lock(&self.on_kill);
        // `kill` sets `killed` before it takes the hooks: one of the two sees the other.
        if !self.killed.load(Ordering::SeqCst) {
            hooks.push(Box::new(f));
            return;
        }
        drop(hooks);
        f();
    }

    /// When it expires, in seconds since the Unix epoch.
    pub fn expires_at(&self) -> u64 {
        unix_seconds(lock(&self.deadline).1)
    }

    /// Whether its deadline has passed.
    pub fn expired(&self, now: Instant) -> bool {
        lock(&self.deadline).0 <= now
    }

    /// Sets its deadline to `ttl` from now.
    pub fn set_ttl(&self, ttl: Duration) {
        *lock(&self.deadline) = (Instant::now() + ttl, SystemTime::now() + ttl);
    }

    /// Whether it has been idle (no job running, no request using it) for at least `idle` at `now`.
    pub fn idle_for(&self, idle: Duration, now: Instant) -> bool {
        !self.is_running() && now.saturating_duration_since(*lock(&self.last_used)) >= idle
    }

    /// Memory it commits: its memory limit.
    pub fn memory(&self) -> u64 {
        self.limits.memory.0
    }

    /// Virtual CPUs it commits: its `vcpus` limit.
    pub fn vcpus(&self) -> u64 {
        u64::from(self.limits.vcpus)
    }

    /// Whether a job is running in it now.
    pub fn is_running(&self) -> bool {
        !lock(&self.running).is_empty()
    }

    /// How many jobs are running in it now.
    pub fn jobs_running(&self) -> usize {
        lock(&self.running).len()
    }

    /// Whether it runs jobs at the same time (else a job while one runs is `sandbox_busy`).
    pub fn is_concurrent(&self) -> bool {
        self.tier.runs_jobs_at_once()
    }

    /// Runs `f` on the sandbox (blocking: call it on a blocking thread), beside its other calls as far as its
    /// tier allows. One that was killed is `sandbox_not_found`, also when it was killed while `f` ran.
    pub fn call<T>(&self, f: impl FnOnce(&dyn Sandbox) -> Result<T, TierError>) -> Result<T, RegistryError> {
        if self.killed.load(Ordering::SeqCst) {
            return Err(RegistryError::SandboxNotFound(self.id.clone()));
        }
        *lock(&self.last_used) = Instant::now();
        let result = f(self.sandbox.as_ref()).map_err(|err| match err {
            TierError::SessionEnded { .. } if self.killed.load(Ordering::SeqCst) => {
                RegistryError::SandboxNotFound(self.id.clone())
            }
            TierError::Busy { doing, .. } => RegistryError::Busy { id: self.id.clone(), doing },
            other => RegistryError::from(other),
        });
        *lock(&self.last_used) = Instant::now();
        result
    }

    /// Runs a job in the sandbox (blocking). `opts.cancel` is set when absent; killing the sandbox cancels it.
    pub fn exec(&self, job: &Job, mut opts: ExecOptions) -> Result<Outcome, RegistryError> {
        let token = opts.cancel.get_or_insert_with(CancelToken::new).clone();
        let number = self.next_job.fetch_add(1, Ordering::Relaxed);
        {
            let mut running = lock(&self.running);
            if running.len() >= MAX_JOBS {
                return Err(RegistryError::TooManyJobs { id: self.id.clone(), max: MAX_JOBS });
            }
            running.insert(number, token.clone());
        }
        // `kill` sets `killed` before it looks at `running`: one of the two sees the other.
        if self.killed.load(Ordering::SeqCst) {
            token.cancel();
        }
        let started = SystemTime::now();
        let outcome = self.call(|sandbox| sandbox.exec(job, opts));
        lock(&self.running).remove(&number);
        self.jobs.record(job, started, &outcome);
        outcome
    }

    /// Runs a service of the sandbox (blocking): a job that lives as long as something of the sandbox does (a
    /// code-interpreter kernel, for its context), not a piece of work. It is not counted as a running job (so a
    /// sandbox whose kernel waits for cells is idle), and killing the sandbox ends it as it ends jobs.
    pub fn exec_service(&self, job: &Job, mut opts: ExecOptions) -> Result<Outcome, RegistryError> {
        let token = opts.cancel.get_or_insert_with(CancelToken::new).clone();
        let number = self.next_job.fetch_add(1, Ordering::Relaxed);
        lock(&self.services).insert(number, token.clone());
        if self.killed.load(Ordering::SeqCst) {
            token.cancel();
        }
        let outcome = self.call(|sandbox| sandbox.exec(job, opts));
        lock(&self.services).remove(&number);
        outcome
    }

    /// Snapshots the sandbox into `destination` (blocking). Only between jobs: while any runs it is `sandbox_busy`.
    pub fn snapshot(&self, destination: &std::path::Path) -> Result<Snapshot, RegistryError> {
        if self.is_running() {
            return Err(RegistryError::Busy { id: self.id.clone(), doing: "a job; a snapshot is taken between jobs" });
        }
        self.call(|sandbox| sandbox.snapshot(destination))
    }

    /// Kills the running jobs if any and closes the sandbox (blocking). Idempotent.
    pub fn kill(&self) {
        self.killed.store(true, Ordering::SeqCst);
        for token in lock(&self.running).values().chain(lock(&self.services).values()) {
            token.cancel();
        }
        if let Err(err) = self.sandbox.close() {
            tracing::warn!(sandbox = %self.id, error = %err, "closing the sandbox failed");
        }
        let hooks = std::mem::take(&mut *lock(&self.on_kill));
        for hook in hooks {
            hook();
        }
    }
}

/// A snapshot the server took, kept in its state directory until deleted or the server stops.
#[derive(Debug)]
pub struct SnapshotEntry {
    /// Its identifier.
    pub id: String,
    /// The name of the API key that took it.
    pub owner: String,
    /// The sandbox it was taken from.
    pub source: String,
    /// When it was taken.
    pub created: SystemTime,
    /// The opened snapshot.
    pub snapshot: Snapshot,
    /// Its directory.
    pub dir: PathBuf,
}

#[derive(Default)]
struct Inner {
    sandboxes: HashMap<String, Arc<SandboxEntry>>,
    snapshots: HashMap<String, Arc<SnapshotEntry>>,
    /// Copies of snapshots other nodes of the fleet hold, fetched to fork here (not listed as this node's).
    copies: HashMap<String, Arc<SnapshotEntry>>,
    /// Live and reserved sandboxes per owner.
    per_owner: HashMap<String, usize>,
    /// Live and reserved sandboxes in all.
    total: usize,
    /// Memory committed (live and reserved) per owner.
    memory_per_owner: HashMap<String, u64>,
    /// Memory committed in all.
    memory: u64,
    /// Virtual CPUs committed in all (the sum of the sandboxes' `vcpus` limits).
    vcpus: u64,
    /// The host's CPUs and free-memory floor, when admission looks at the host.
    host: Option<HostCapacity>,
}

/// Every live sandbox and snapshot, by id.
#[derive(Default)]
pub struct Registry {
    inner: Mutex<Inner>,
    max_sandboxes: usize,
    memory_budget: Option<u64>,
    cpu_budget: Option<u64>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = lock(&self.inner);
        f.debug_struct("Registry")
            .field("sandboxes", &inner.sandboxes.len())
            .field("total", &inner.total)
            .field("memory", &inner.memory)
            .field("vcpus", &inner.vcpus)
            .finish()
    }
}

/// Places for sandboxes, held between admission and creation; dropping it gives back the places not used.
#[derive(Debug)]
pub struct Reservation {
    registry: Arc<Registry>,
    owner: String,
    places: usize,
    memory_each: u64,
    vcpus_each: u64,
    /// The host CPUs of each place not yet used.
    placements: Vec<Vec<usize>>,
}

impl Reservation {
    /// Adds a created sandbox, using one place.
    pub fn commit(&mut self, mut entry: SandboxEntry) -> Arc<SandboxEntry> {
        entry.cpus = self.placements.pop().unwrap_or_default();
        let entry = Arc::new(entry);
        let mut inner = lock(&self.registry.inner);
        // The entry's own memory limit is what its removal gives back: settle any difference now.
        inner.commit_memory(&self.owner, entry.memory(), self.memory_each);
        inner.vcpus = inner.vcpus.saturating_sub(self.vcpus_each).saturating_add(entry.vcpus());
        inner.sandboxes.insert(entry.id.clone(), entry.clone());
        self.places = self.places.saturating_sub(1);
        entry
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.places > 0 {
            let mut inner = lock(&self.registry.inner);
            let memory = self.memory_each.saturating_mul(self.places as u64);
            let vcpus = self.vcpus_each.saturating_mul(self.places as u64);
            inner.release(&self.owner, self.places, memory, vcpus);
            for cpus in self.placements.drain(..) {
                inner.release_cpus(&cpus);
            }
        }
    }
}

impl Inner {
    fn release(&mut self, owner: &str, places: usize, memory: u64, vcpus: u64) {
        self.total = self.total.saturating_sub(places);
        self.vcpus = self.vcpus.saturating_sub(vcpus);
        if let Some(count) = self.per_owner.get_mut(owner) {
            *count = count.saturating_sub(places);
            if *count == 0 {
                self.per_owner.remove(owner);
            }
        }
        self.memory = self.memory.saturating_sub(memory);
        if let Some(committed) = self.memory_per_owner.get_mut(owner) {
            *committed = committed.saturating_sub(memory);
            if *committed == 0 {
                self.memory_per_owner.remove(owner);
            }
        }
    }

    /// Gives back the host CPU slots of one sandbox.
    fn release_cpus(&mut self, cpus: &[usize]) {
        if let Some(host) = &mut self.host {
            host.release(cpus);
        }
    }

    /// Takes `entry` out, giving back everything it committed.
    fn remove_entry(&mut self, id: &str) -> Option<Arc<SandboxEntry>> {
        let entry = self.sandboxes.remove(id)?;
        self.release(&entry.owner, 1, entry.memory(), entry.vcpus());
        self.release_cpus(&entry.cpus);
        Some(entry)
    }

    /// Replaces `reserved` bytes of `owner`'s committed memory by `actual`.
    fn commit_memory(&mut self, owner: &str, actual: u64, reserved: u64) {
        let committed = self.memory_per_owner.entry(owner.to_owned()).or_default();
        *committed = committed.saturating_sub(reserved).saturating_add(actual);
        self.memory = self.memory.saturating_sub(reserved).saturating_add(actual);
    }
}

impl Registry {
    /// A registry that holds at most `max_sandboxes` sandboxes, whose memory limits add up to at most
    /// `memory_budget` bytes and whose `vcpus` limits add up to at most `cpu_budget` (`None`: no budget).
    pub fn new(max_sandboxes: usize, memory_budget: Option<u64>, cpu_budget: Option<u64>) -> Registry {
        Registry { inner: Mutex::default(), max_sandboxes, memory_budget, cpu_budget }
    }

    /// The same registry, also admitting against this host's CPUs and free memory ([`crate::capacity`]).
    pub fn with_host(self, host: HostCapacity) -> Registry {
        lock(&self.inner).host = Some(host);
        self
    }

    /// Reserves `places` sandboxes with these `limits` (their memory and vcpus are what they commit) for
    /// `principal`, within its quotas and the server's capacity.
    pub fn reserve(
        self: &Arc<Self>,
        principal: &crate::Principal,
        places: usize,
        limits: &Limits,
    ) -> Result<Reservation, AdmissionError> {
        let owner = principal.name.as_str();
        let (memory_each, vcpus_each) = (limits.memory.0, u64::from(limits.vcpus));
        let memory = memory_each.saturating_mul(places as u64);
        let vcpus = vcpus_each.saturating_mul(places as u64);
        let mut inner = lock(&self.inner);
        let held = inner.per_owner.get(owner).copied().unwrap_or(0);
        if let Some(limit) = principal.max_sandboxes
            && held + places > limit
        {
            return Err(AdmissionError::Quota { owner: owner.to_owned(), limit });
        }
        if inner.total + places > self.max_sandboxes {
            return Err(AdmissionError::Capacity { limit: self.max_sandboxes });
        }
        let committed = inner.memory_per_owner.get(owner).copied().unwrap_or(0);
        if let Some(limit) = principal.max_memory
            && committed.saturating_add(memory) > limit
        {
            return Err(AdmissionError::MemoryQuota {
                owner: owner.to_owned(),
                asked: committed.saturating_add(memory),
                limit,
            });
        }
        if let Some(limit) = self.memory_budget
            && inner.memory.saturating_add(memory) > limit
        {
            return Err(AdmissionError::MemoryBudget { asked: inner.memory.saturating_add(memory), limit });
        }
        if let Some(limit) = self.cpu_budget
            && inner.vcpus.saturating_add(vcpus) > limit
        {
            return Err(AdmissionError::CpuBudget { asked: inner.vcpus.saturating_add(vcpus), limit });
        }
        let placements = match &mut inner.host {
            Some(host) => {
                host.check_memory(memory)?;
                host.place(limits.vcpus, places)?
            }
            None => Vec::new(),
        };
        inner.vcpus = inner.vcpus.saturating_add(vcpus);
        inner.total += places;
        *inner.per_owner.entry(owner.to_owned()).or_default() += places;
        inner.memory = inner.memory.saturating_add(memory);
        *inner.memory_per_owner.entry(owner.to_owned()).or_default() += memory;
        Ok(Reservation { registry: self.clone(), owner: owner.to_owned(), places, memory_each, vcpus_each, placements })
    }

    /// Memory committed by live and reserved sandboxes (the sum of their memory limits).
    pub fn memory_committed(&self) -> u64 {
        lock(&self.inner).memory
    }

    /// Virtual CPUs committed by live and reserved sandboxes (the sum of their `vcpus` limits).
    pub fn vcpus_committed(&self) -> u64 {
        lock(&self.inner).vcpus
    }

    /// Host vCPU slots in use, and in all, when admission looks at the host.
    pub fn host_slots(&self) -> Option<(u64, u64)> {
        lock(&self.inner).host.as_ref().map(HostCapacity::slots)
    }

    /// The sandbox `id` if `owner` may use it (else not found: ids of other keys are not revealed).
    pub fn get(&self, id: &str, owner: &str) -> Result<Arc<SandboxEntry>, RegistryError> {
        match lock(&self.inner).sandboxes.get(id) {
            Some(entry) if entry.owner == owner => Ok(entry.clone()),
            _ => Err(RegistryError::SandboxNotFound(id.to_owned())),
        }
    }

    /// The sandbox `id` whoever owns it (for the E2B envd layer, which checks the sandbox's access token instead).
    pub fn get_any(&self, id: &str) -> Option<Arc<SandboxEntry>> {
        lock(&self.inner).sandboxes.get(id).cloned()
    }

    /// Takes the sandbox `id` out of the registry (its place is free at once); the caller kills it.
    pub fn remove(&self, id: &str, owner: &str) -> Result<Arc<SandboxEntry>, RegistryError> {
        let mut inner = lock(&self.inner);
        match inner.sandboxes.get(id) {
            Some(entry) if entry.owner == owner => {}
            _ => return Err(RegistryError::SandboxNotFound(id.to_owned())),
        }
        inner.remove_entry(id).ok_or_else(|| RegistryError::SandboxNotFound(id.to_owned()))
    }

    /// The sandboxes of `owner` (every sandbox when `None`), oldest first.
    pub fn list(&self, owner: Option<&str>) -> Vec<Arc<SandboxEntry>> {
        let inner = lock(&self.inner);
        let mut list: Vec<_> =
            inner.sandboxes.values().filter(|e| owner.is_none_or(|o| e.owner == o)).cloned().collect();
        list.sort_by(|a, b| a.created.cmp(&b.created).then_with(|| a.id.cmp(&b.id)));
        list
    }

    /// Live sandboxes per tier.
    pub fn active_by_tier(&self) -> HashMap<TierKind, usize> {
        let mut counts = HashMap::new();
        for entry in lock(&self.inner).sandboxes.values() {
            *counts.entry(entry.tier).or_default() += 1;
        }
        counts
    }

    /// Takes every sandbox whose deadline has passed, or that has been idle for `idle` (when given), out of the
    /// registry; the caller kills them.
    pub fn take_expired(&self, now: Instant, idle: Option<Duration>) -> Vec<Arc<SandboxEntry>> {
        let mut inner = lock(&self.inner);
        let expired: Vec<String> = inner
            .sandboxes
            .values()
            .filter(|e| e.expired(now) || idle.is_some_and(|idle| e.idle_for(idle, now)))
            .map(|e| e.id.clone())
            .collect();
        let mut taken = Vec::new();
        for id in expired {
            if let Some(entry) = inner.remove_entry(&id) {
                taken.push(entry);
            }
        }
        taken
    }

    /// Takes every sandbox out of the registry; the caller kills them.
    pub fn take_all(&self) -> Vec<Arc<SandboxEntry>> {
        let mut inner = lock(&self.inner);
        let ids: Vec<String> = inner.sandboxes.keys().cloned().collect();
        ids.iter().filter_map(|id| inner.remove_entry(id)).collect()
    }

    /// Adds a snapshot.
    pub fn add_snapshot(&self, entry: SnapshotEntry) -> Arc<SnapshotEntry> {
        let entry = Arc::new(entry);
        lock(&self.inner).snapshots.insert(entry.id.clone(), entry.clone());
        entry
    }

    /// The snapshot `id` if `owner` may use it.
    pub fn snapshot(&self, id: &str, owner: &str) -> Result<Arc<SnapshotEntry>, RegistryError> {
        match lock(&self.inner).snapshots.get(id) {
            Some(entry) if entry.owner == owner => Ok(entry.clone()),
            _ => Err(RegistryError::SnapshotNotFound(id.to_owned())),
        }
    }

    /// Whether this node holds snapshot `id` (whoever owns it).
    pub fn holds_snapshot(&self, id: &str) -> bool {
        lock(&self.inner).snapshots.contains_key(id)
    }

    /// Keeps a copy of a snapshot another node holds ([`crate::fleet::snapshots`]); an earlier copy of it goes.
    pub fn add_copy(&self, entry: SnapshotEntry) -> (Arc<SnapshotEntry>, Option<Arc<SnapshotEntry>>) {
        let entry = Arc::new(entry);
        let replaced = lock(&self.inner).copies.insert(entry.id.clone(), entry.clone());
        (entry, replaced)
    }

    /// The copy of snapshot `id` if `owner` may use it.
    pub fn copy(&self, id: &str, owner: &str) -> Option<Arc<SnapshotEntry>> {
        lock(&self.inner).copies.get(id).filter(|entry| entry.owner == owner).cloned()
    }

    /// Takes the copy of snapshot `id` out (its original is gone); the caller removes its directory.
    pub fn remove_copy(&self, id: &str) -> Option<Arc<SnapshotEntry>> {
        lock(&self.inner).copies.remove(id)
    }

    /// The most memory the sandboxes may commit, if there is a budget.
    pub fn memory_budget(&self) -> Option<u64> {
        self.memory_budget
    }

    /// The snapshots of `owner`, oldest first.
    pub fn snapshots(&self, owner: &str) -> Vec<Arc<SnapshotEntry>> {
        let mut list: Vec<_> = lock(&self.inner).snapshots.values().filter(|e| e.owner == owner).cloned().collect();
        list.sort_by(|a, b| a.created.cmp(&b.created).then_with(|| a.id.cmp(&b.id)));
        list
    }

    /// Takes the snapshot `id` out of the registry; the caller removes its directory.
    pub fn remove_snapshot(&self, id: &str, owner: &str) -> Result<Arc<SnapshotEntry>, RegistryError> {
        let mut inner = lock(&self.inner);
        match inner.snapshots.get(id) {
            Some(entry) if entry.owner == owner => {}
            _ => return Err(RegistryError::SnapshotNotFound(id.to_owned())),
        }
        inner.snapshots.remove(id).ok_or_else(|| RegistryError::SnapshotNotFound(id.to_owned()))
    }
}

/// The most proxied connections one sandbox has open at once; more are refused with 503.
pub const MAX_PORT_CONNECTIONS: usize = 64;

/// Counts a sandbox's open proxied connections; one slot is held for each connection's life.
#[derive(Debug, Default)]
pub struct PortConnections(Arc<AtomicUsize>);

/// One counted connection; dropping it frees the slot.
pub(crate) struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl PortConnections {
    pub(crate) fn take(&self, id: &str) -> Result<Slot, RegistryError> {
        let taken = self.0.fetch_add(1, Ordering::SeqCst);
        let slot = Slot(self.0.clone());
        if taken >= MAX_PORT_CONNECTIONS {
            return Err(RegistryError::TooManyPortConnections { id: id.to_owned(), max: MAX_PORT_CONNECTIONS });
        }
        Ok(slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str, max_sandboxes: Option<usize>, max_memory: Option<u64>) -> crate::Principal {
        crate::Principal { name: name.to_owned(), max_sandboxes, max_memory }
    }

    fn limits(memory: u64, vcpus: u32) -> Limits {
        Limits { memory: strata_core::ByteSize(memory), vcpus, ..Limits::default() }
    }

    #[test]
    fn quota_counts_reserved_places_and_frees_them_on_drop() {
        let registry = Arc::new(Registry::new(10, None, None));
        let a = key("a", Some(2), None);
        let first = registry.reserve(&a, 2, &limits(0, 0)).expect("within quota");
        assert!(matches!(registry.reserve(&a, 1, &limits(0, 0)), Err(AdmissionError::Quota { limit: 2, .. })));
        assert!(registry.reserve(&key("b", Some(2), None), 1, &limits(0, 0)).is_ok());
        drop(first);
        assert!(registry.reserve(&a, 2, &limits(0, 0)).is_ok());
    }

    #[test]
    fn server_capacity_is_shared_by_every_key() {
        let registry = Arc::new(Registry::new(3, None, None));
        let _a = registry.reserve(&key("a", None, None), 2, &limits(0, 0)).expect("fits");
        let err = registry.reserve(&key("b", None, None), 2, &limits(0, 0)).expect_err("over capacity");
        assert_eq!(err, AdmissionError::Capacity { limit: 3 });
        assert_eq!(err.reason(), "capacity");
    }

    #[test]
    fn memory_is_admitted_against_the_key_quota_and_the_server_budget() {
        let registry = Arc::new(Registry::new(100, Some(1000), None));
        let a = key("a", None, Some(600));
        let held = registry.reserve(&a, 2, &limits(250, 0)).expect("500 of 600");
        assert_eq!(registry.memory_committed(), 500);
        assert!(matches!(
            registry.reserve(&a, 1, &limits(250, 0)),
            Err(AdmissionError::MemoryQuota { limit: 600, .. })
        ));
        let err = registry.reserve(&key("b", None, None), 3, &limits(200, 0)).expect_err("1100 > 1000");
        assert_eq!(err, AdmissionError::MemoryBudget { asked: 1100, limit: 1000 });
        drop(held);
        assert_eq!(registry.memory_committed(), 0);
        assert!(registry.reserve(&key("b", None, None), 3, &limits(200, 0)).is_ok());
    }

    #[test]
    fn vcpus_are_admitted_against_the_server_budget() {
        let registry = Arc::new(Registry::new(100, None, Some(4)));
        let held = registry.reserve(&key("a", None, None), 3, &limits(0, 1)).expect("3 of 4");
        let err = registry.reserve(&key("b", None, None), 1, &limits(0, 2)).expect_err("5 > 4");
        assert_eq!(err, AdmissionError::CpuBudget { asked: 5, limit: 4 });
        assert_eq!(registry.vcpus_committed(), 3);
        drop(held);
        assert_eq!(registry.vcpus_committed(), 0);
    }

    /// A real (wasm) sandbox in an entry.
    fn entry(id: &str, owner: &str, limits: Limits) -> SandboxEntry {
        static ENGINE: std::sync::OnceLock<strata_engine::Engine> = std::sync::OnceLock::new();
        let engine = ENGINE.get_or_init(|| strata_engine::Engine::new(Default::default()).expect("engine"));
        let choice = strata_engine::TierChoice::Tier(TierKind::Wasm);
        let sandbox = engine.start(choice, &Default::default(), &Limits::default()).expect("a wasm sandbox");
        SandboxEntry::new(id.to_owned(), owner.to_owned(), sandbox, limits, Duration::from_secs(60))
    }

    #[test]
    fn the_host_admits_by_cpu_bins_and_free_memory_and_gets_both_back() {
        use crate::capacity::MemoryProbe;
        // 2 CPUs of 2 slots, 1000 bytes available, 100 kept free.
        let host = HostCapacity::new(2, 2, 100, MemoryProbe::Fixed(1000));
        let registry = Arc::new(Registry::new(100, None, None).with_host(host));
        let a = key("a", None, None);
        let err = registry.reserve(&a, 1, &limits(901, 1)).expect_err("901 + 100 > 1000");
        assert_eq!(err, AdmissionError::HostMemory { available: 1000, needed: 1001 });
        assert_eq!(err.reason(), "host_memory");
        let err = registry.reserve(&a, 1, &limits(1, 3)).expect_err("wider than the host");
        assert_eq!(err, AdmissionError::HostCpu { vcpus: 3, count: 1, cpus: 2, slots: 2 });

        let mut both = registry.reserve(&a, 1, &limits(1, 2)).expect("one slot on each CPU");
        let wide = both.commit(entry("sb_wide", "a", limits(1, 2)));
        assert_eq!(wide.cpus, vec![0, 1]);
        let mut two = registry.reserve(&a, 2, &limits(1, 1)).expect("the last two slots");
        assert_eq!(registry.host_slots(), Some((4, 4)));
        assert!(matches!(registry.reserve(&a, 1, &limits(1, 1)), Err(AdmissionError::HostCpu { .. })));
        let one = two.commit(entry("sb_one", "a", limits(1, 1)));
        drop(two);
        assert_eq!(registry.host_slots(), Some((3, 4)), "the unused place's slot came back");
        registry.remove(&wide.id, "a").expect("remove");
        assert_eq!(registry.host_slots(), Some((1, 4)));
        assert_eq!(registry.take_all().len(), 1);
        assert_eq!(registry.host_slots(), Some((0, 4)));
        one.kill();
        wide.kill();
    }
}
