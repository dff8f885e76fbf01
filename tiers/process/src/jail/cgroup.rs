//! One cgroup per jail, under whichever hierarchy the host has.
//!
//! The host may mount cgroup v2 with the controllers (pure v2), or v1 controllers with a controller-less v2
//! `unified` tree beside them (this machine). [`CgroupRoot::detect`] prefers v2 when it has the memory, pids and cpu
//! controllers, else uses v1's memory, pids, cpu and cpuacct hierarchies. Each jail's cgroup is created under the
//! engine's own cgroup, in a `strata` directory, and named `<engine pid>-<engine start time>-<seq>`, so a later
//! engine can tell the cgroups of a dead engine (to remove) from those of a live one (to leave alone).
//!
//! Limits: memory (swap off: v1 `memsw` equal to the limit, v2 `memory.swap.max = 0`), pids, CPU bandwidth.
//! Readings: CPU time, peak memory, OOM kills, and how often the pids limit refused a fork; and whether memory
//! can still be freed for another job ([`Cgroup::can_make_room`]), asked after a memory kill.
//!
//! A job run beside others in one jail (a lane, see [`crate::jail::Lanes`]) gets a child cgroup of the jail's
//! ([`Cgroup::child`]): its own readings, and a kill that reaches every process it started, while the jail's
//! limits still bound all of its jobs together. On v1 the child has limits of its own too; on v2 a cgroup that
//! holds processes cannot hand controllers down (the "no internal processes" rule), so there the child only
//! counts CPU time and is killed whole, and memory is read from the jail's cgroup.

use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Which cgroup hierarchy a jail's cgroup lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    /// Separate v1 hierarchies per controller.
    V1,
    /// The unified v2 hierarchy.
    V2,
}

/// Why a cgroup could not be set up or read.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// Neither hierarchy has the controllers the jail needs.
    #[error("no usable cgroup hierarchy: {0}")]
    Unavailable(String),
    /// A cgroup file could not be written or read.
    #[error("cgroup {}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CgroupError + '_ {
    move |source| CgroupError::Io { path: path.to_owned(), source }
}

/// The limits a jail's cgroup enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CgroupLimits {
    /// Memory in bytes (swap off).
    pub memory: u64,
    /// Processes and threads.
    pub pids: u64,
    /// CPU bandwidth in whole CPUs.
    pub cpus: u32,
}

/// Where jail cgroups are created.
#[derive(Debug, Clone)]
pub struct CgroupRoot {
    version: CgroupVersion,
    /// v1: (controller, `<mount>/<engine's cgroup>/strata`); v2: one entry with an empty controller name.
    parents: Vec<(&'static str, PathBuf)>,
    owner: String,
    /// Why v2 was not used, when v1 is.
    why_not_v2: Option<String>,
}

const V1_CONTROLLERS: [&str; 4] = ["memory", "pids", "cpu", "cpuacct"];

static SEQUENCE: AtomicU64 = AtomicU64::new(0);

/// How long [`Cgroup::kill_all`] keeps killing what it finds in a v1 cgroup.
const KILL_PATIENCE: Duration = Duration::from_millis(200);

impl CgroupRoot {
    /// Finds the hierarchy to use from `/proc/self/mountinfo` and `/proc/self/cgroup`.
    pub fn detect() -> Result<CgroupRoot, CgroupError> {
        let mountinfo =
            fs::read_to_string("/proc/self/mountinfo").map_err(io_err(Path::new("/proc/self/mountinfo")))?;
        let membership = fs::read_to_string("/proc/self/cgroup").map_err(io_err(Path::new("/proc/self/cgroup")))?;
        let owner = owner_tag(std::process::id()).unwrap_or_else(|| format!("{}-0", std::process::id()));
        let mounts = parse_mounts(&mountinfo);

        let mut v2_problem = "no cgroup2 mount".to_owned();
        if let Some((mount, _)) = mounts.iter().find(|(_, kind)| kind.is_none()) {
            let own = membership.lines().find_map(|l| l.strip_prefix("0::")).unwrap_or("/");
            let own_dir = mount.join(own.trim_start_matches('/'));
            let controllers = fs::read_to_string(own_dir.join("cgroup.controllers")).unwrap_or_default();
            let have: Vec<&str> = controllers.split_whitespace().collect();
            if ["memory", "pids", "cpu"].iter().all(|c| have.contains(c)) {
                return Ok(CgroupRoot {
                    version: CgroupVersion::V2,
                    parents: vec![("", own_dir.join("strata"))],
                    owner,
                    why_not_v2: None,
                });
            }
            v2_problem = format!("the cgroup2 tree at {} has controllers [{}]", mount.display(), controllers.trim());
        }
        let mut parents = Vec::new();
        for controller in V1_CONTROLLERS {
            let Some((mount, _)) = mounts.iter().find(|(_, kind)| kind.as_deref().is_some_and(|k| has(k, controller)))
            else {
                return Err(CgroupError::Unavailable(format!(
                    "{v2_problem}, and no cgroup v1 hierarchy has the {controller} controller"
                )));
            };
            let own = membership
                .lines()
                .filter_map(|l| l.split_once(':').and_then(|(_, rest)| rest.split_once(':')))
                .find(|(list, _)| has(list, controller))
                .map(|(_, path)| path)
                .unwrap_or("/");
            parents.push((controller, mount.join(own.trim_start_matches('/')).join("strata")));
        }
        Ok(CgroupRoot { version: CgroupVersion::V1, parents, owner, why_not_v2: Some(v2_problem) })
    }

    /// The hierarchy in use.
    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    /// One line for logs and `strata doctor`: which hierarchy and where.
    pub fn describe(&self) -> String {
        match self.version {
            CgroupVersion::V2 => format!("cgroup v2 at {}", self.parents[0].1.display()),
            CgroupVersion::V1 => {
                let list: Vec<String> = self.parents.iter().map(|(c, p)| format!("{c}={}", p.display())).collect();
                let why = self.why_not_v2.as_deref().map(|w| format!("; not v2: {w}")).unwrap_or_default();
                format!("cgroup v1 ({}){why}", list.join(", "))
            }
        }
    }

    /// Creates a jail's cgroup with its limits.
    pub fn create(&self, limits: &CgroupLimits) -> Result<Cgroup, CgroupError> {
        let name = format!("{}-{}", self.owner, SEQUENCE.fetch_add(1, Ordering::Relaxed));
        let mut dirs = Vec::new();
        for (controller, parent) in &self.parents {
            if self.version == CgroupVersion::V2 {
                prepare_v2_parent(parent)?;
            } else {
                fs::create_dir_all(parent).map_err(io_err(parent))?;
            }
            let dir = parent.join(&name);
            fs::create_dir(&dir).map_err(io_err(&dir))?;
            dirs.push((*controller, dir));
        }
        let cgroup = Cgroup { version: self.version, dirs };
        if let Err(err) = cgroup.apply(limits) {
            cgroup.remove();
            return Err(err);
        }
        Ok(cgroup)
    }

    /// Removes the cgroups left by engines that are no longer running (killed mid-job), killing any process
    /// still in them. Returns how many were removed.
    pub fn remove_stale(&self) -> usize {
        let mut removed = 0;
        for (controller, parent) in &self.parents {
            let Ok(entries) = fs::read_dir(parent) else { continue };
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                // The entry's type from the directory listing: no `stat` for each of the controller's files.
                if !entry.file_type().is_ok_and(|kind| kind.is_dir()) || owner_is_alive(&name) {
                    continue;
                }
                let cgroup = Cgroup { version: self.version, dirs: vec![(controller, entry.path())] };
                cgroup.kill_all();
                if cgroup.remove() {
                    removed += 1;
                }
            }
        }
        removed
    }

    /// How many cgroups exist under this root, jails' and their jobs' (in the first hierarchy), for leak checks.
    pub fn count(&self) -> usize {
        let jails = self.parents.first().map(|(_, parent)| subdirectories(parent)).unwrap_or_default();
        jails.len() + jails.iter().map(|jail| subdirectories(jail).len()).sum::<usize>()
    }
}

fn has(list: &str, controller: &str) -> bool {
    list.split(',').any(|c| c == controller)
}

/// (mount point, Some(v1 super options) | None for cgroup2).
fn parse_mounts(mountinfo: &str) -> Vec<(PathBuf, Option<String>)> {
    let mut out = Vec::new();
    for line in mountinfo.lines() {
        let Some((left, right)) = line.split_once(" - ") else { continue };
        let mount_point = left.split(' ').nth(4).unwrap_or("");
        let mut right = right.split(' ');
        let fstype = right.next().unwrap_or("");
        let super_opts = right.nth(1).unwrap_or("");
        match fstype {
            "cgroup2" => out.push((PathBuf::from(mount_point), None)),
            "cgroup" => out.push((PathBuf::from(mount_point), Some(super_opts.to_owned()))),
            _ => {}
        }
    }
    out
}

/// `<pid>-<start time in clock ticks>` of a process, from `/proc/<pid>/stat`.
fn owner_tag(pid: u32) -> Option<String> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces and parentheses; fields after the last ')' are plain.
    let after = stat.rsplit_once(')')?.1;
    let start = after.split_whitespace().nth(19)?;
    Some(format!("{pid}-{start}"))
}

/// Whether the engine that created the cgroup `name` (`<pid>-<start>-<seq>`) still runs.
fn owner_is_alive(name: &str) -> bool {
    let mut parts = name.splitn(3, '-');
    let (Some(pid), Some(start)) = (parts.next(), parts.next()) else { return true };
    let Ok(pid) = pid.parse::<u32>() else { return true };
    owner_tag(pid).is_some_and(|tag| tag == format!("{pid}-{start}"))
}

fn prepare_v2_parent(parent: &Path) -> Result<(), CgroupError> {
    fs::create_dir_all(parent).map_err(io_err(parent))?;
    for dir in [parent.parent().unwrap_or(parent), parent] {
        let control = dir.join("cgroup.subtree_control");
        let current = fs::read_to_string(&control).unwrap_or_default();
        if ["memory", "pids", "cpu"].iter().all(|c| current.split_whitespace().any(|x| x == *c)) {
            continue;
        }
        fs::write(&control, "+memory +pids +cpu").map_err(|source| CgroupError::Unavailable(format!(
            "cannot enable memory, pids and cpu in {} ({source}); run the engine in a leaf cgroup whose parent delegates them",
            control.display()
        )))?;
    }
    Ok(())
}

/// One jail's cgroup (a directory per v1 controller, or one v2 directory). A clone names the same directories.
#[derive(Debug, Clone)]
pub struct Cgroup {
    version: CgroupVersion,
    dirs: Vec<(&'static str, PathBuf)>,
}

impl Cgroup {
    fn dir(&self, controller: &str) -> &Path {
        match self.version {
            CgroupVersion::V2 => &self.dirs[0].1,
            CgroupVersion::V1 => {
                self.dirs.iter().find(|(c, _)| *c == controller).map(|(_, d)| d.as_path()).unwrap_or(&self.dirs[0].1)
            }
        }
    }

    fn write(&self, controller: &str, file: &str, value: &str) -> Result<(), CgroupError> {
        let path = self.dir(controller).join(file);
        fs::write(&path, value).map_err(io_err(&path))
    }

    fn read(&self, controller: &str, file: &str) -> Option<String> {
        fs::read_to_string(self.dir(controller).join(file)).ok()
    }

    fn apply(&self, limits: &CgroupLimits) -> Result<(), CgroupError> {
        let period = 100_000u64;
        let quota = period * u64::from(limits.cpus.max(1));
        match self.version {
            CgroupVersion::V1 => {
                // memsw (memory + swap) equal to the memory limit: no swap. Absent when swap accounting is off.
                // The kernel keeps memsw at least the memory limit: raised first, lowered after.
                let memory = limits.memory.to_string();
                let memsw = self.dir("memory").join("memory.memsw.limit_in_bytes").exists();
                let current = self.read("memory", "memory.limit_in_bytes").and_then(|v| v.trim().parse::<u64>().ok());
                let raising = current.is_some_and(|current| limits.memory > current);
                if memsw && raising {
                    self.write("memory", "memory.memsw.limit_in_bytes", &memory)?;
                }
                self.write("memory", "memory.limit_in_bytes", &memory)?;
                if memsw && !raising {
                    self.write("memory", "memory.memsw.limit_in_bytes", &memory)?;
                }
                let _ = self.write("memory", "memory.swappiness", "0");
                self.write("pids", "pids.max", &limits.pids.to_string())?;
                self.write("cpu", "cpu.cfs_period_us", &period.to_string())?;
                self.write("cpu", "cpu.cfs_quota_us", &quota.to_string())?;
            }
            CgroupVersion::V2 => {
                self.write("", "memory.max", &limits.memory.to_string())?;
                if self.dir("").join("memory.swap.max").exists() {
                    self.write("", "memory.swap.max", "0")?;
                }
                self.write("", "pids.max", &limits.pids.to_string())?;
                self.write("", "cpu.max", &format!("{quota} {period}"))?;
            }
        }
        Ok(())
    }

    /// Sets the limits of a child cgroup made by [`Cgroup::child`] (on v1; a v2 child has no controllers of its own
    /// and its jail's limits bound it).
    pub fn apply_limits(&self, limits: &CgroupLimits) -> Result<(), CgroupError> {
        if self.version == CgroupVersion::V1 { self.apply(limits) } else { Ok(()) }
    }

    /// Creates a child cgroup for one job: on v1 with `limits` of its own (the jail's still bound it), on v2
    /// without (see the module's documentation).
    pub fn child(&self, limits: &CgroupLimits) -> Result<Cgroup, CgroupError> {
        self.named_child(&format!("job-{}", SEQUENCE.fetch_add(1, Ordering::Relaxed)), limits)
    }

    /// Creates the child cgroup `name` (as [`Cgroup::child`] does; an error when it exists, with
    /// [`ErrorKind::AlreadyExists`] as its source's kind).
    pub fn named_child(&self, name: &str, limits: &CgroupLimits) -> Result<Cgroup, CgroupError> {
        let mut dirs = Vec::new();
        for (controller, parent) in &self.dirs {
            let dir = parent.join(name);
            if let Err(err) = fs::create_dir(&dir) {
                Cgroup { version: self.version, dirs }.remove();
                return Err(io_err(&dir)(err));
            }
            dirs.push((*controller, dir));
        }
        let child = Cgroup { version: self.version, dirs };
        if self.version == CgroupVersion::V1
            && let Err(err) = child.apply(limits)
        {
            child.remove();
            return Err(err);
        }
        Ok(child)
    }

    /// Whether the cgroup has a memory controller of its own (a v2 job's child cgroup has none).
    pub fn has_memory(&self) -> bool {
        match self.version {
            CgroupVersion::V1 => true,
            CgroupVersion::V2 => self.dir("").join("memory.peak").exists(),
        }
    }

    /// Removes the cgroup's directories if no process is left in them, without waiting. Returns whether it did.
    pub fn try_remove(&self) -> bool {
        self.dirs.iter().all(|(_, dir)| match fs::remove_dir(dir) {
            Ok(()) => true,
            Err(err) => err.kind() == ErrorKind::NotFound,
        })
    }

    /// The files a single-threaded process writes `0` into to move itself into the cgroup: v1's per-thread
    /// `tasks` (a thread moving itself skips the global lock that moving a whole process by PID through
    /// `cgroup.procs` takes, which waits for an RCU grace period: 7–15 ms on an idle host), v2's `cgroup.procs`.
    pub fn self_join_files(&self) -> Vec<PathBuf> {
        let file = match self.version {
            CgroupVersion::V1 => "tasks",
            CgroupVersion::V2 => "cgroup.procs",
        };
        self.dirs.iter().map(|(_, dir)| dir.join(file)).collect()
    }

    /// CPU time used by every process that ran in the cgroup.
    pub fn cpu_time(&self) -> Duration {
        match self.version {
            CgroupVersion::V1 => self
                .read("cpuacct", "cpuacct.usage")
                .and_then(|s| s.trim().parse().ok())
                .map(Duration::from_nanos)
                .unwrap_or_default(),
            CgroupVersion::V2 => self
                .read("", "cpu.stat")
                .and_then(|s| keyed(&s, "usage_usec"))
                .map(Duration::from_micros)
                .unwrap_or_default(),
        }
    }

    /// The memory charged to the cgroup now, the page cache in it, and its limit (`u64::MAX` without one), in bytes.
    pub fn memory_now(&self) -> (u64, u64, u64) {
        let number = |controller: &str, file: &str| self.read(controller, file).map(|s| s.trim().to_owned());
        let (used, stat, limit) = match self.version {
            CgroupVersion::V1 => (
                number("memory", "memory.usage_in_bytes"),
                self.read("memory", "memory.stat")
                    .and_then(|s| keyed(&s, "total_cache").or_else(|| keyed(&s, "cache"))),
                number("memory", "memory.limit_in_bytes"),
            ),
            CgroupVersion::V2 => (
                number("", "memory.current"),
                self.read("", "memory.stat").and_then(|s| keyed(&s, "file")),
                number("", "memory.max"),
            ),
        };
        let used = used.and_then(|s| s.parse().ok()).unwrap_or(0);
        let limit = limit.and_then(|s| s.parse().ok()).unwrap_or(u64::MAX);
        (used, stat.unwrap_or(0).min(used), limit)
    }

    /// The most memory the cgroup has used since it was created or since [`reset_peak`](Cgroup::reset_peak).
    pub fn peak_memory(&self) -> u64 {
        let (controller, file) = match self.version {
            CgroupVersion::V1 => ("memory", "memory.max_usage_in_bytes"),
            CgroupVersion::V2 => ("", "memory.peak"),
        };
        self.read(controller, file).and_then(|s| s.trim().parse().ok()).unwrap_or(0)
    }

    /// Starts a new peak-memory reading (v1: resets the high-water mark; v2 keeps the cgroup's lifetime peak).
    pub fn reset_peak(&self) {
        if self.version == CgroupVersion::V1 {
            let _ = self.write("memory", "memory.max_usage_in_bytes", "0");
        }
    }

    /// Whether `room` bytes under the memory limit are free, or can be freed by reclaiming what the kernel can
    /// (page cache). `false` when what fills the cgroup cannot be reclaimed: files of the jail's tmpfs and
    /// their inodes, shared memory, processes still running; then every new job would be killed for memory. On
    /// v1 this lowers the limit for a moment (the kernel reclaims to reach it, or refuses with `EBUSY`); on v2
    /// it asks `memory.reclaim`. When the cgroup cannot tell, it answers `true`.
    pub fn can_make_room(&self, room: u64) -> bool {
        let number =
            |controller: &str, file: &str| self.read(controller, file).and_then(|s| s.trim().parse::<u64>().ok());
        match self.version {
            CgroupVersion::V1 => {
                let (Some(limit), Some(usage)) =
                    (number("memory", "memory.limit_in_bytes"), number("memory", "memory.usage_in_bytes"))
                else {
                    return true;
                };
                let target = limit.saturating_sub(room);
                if usage <= target {
                    return true;
                }
                match self.write("memory", "memory.limit_in_bytes", &target.to_string()) {
                    Ok(()) => {
                        let _ = self.write("memory", "memory.limit_in_bytes", &limit.to_string());
                        true
                    }
                    Err(CgroupError::Io { source, .. }) => source.raw_os_error() != Some(libc::EBUSY),
                    Err(_) => true,
                }
            }
            CgroupVersion::V2 => {
                let (Some(limit), Some(usage)) = (number("", "memory.max"), number("", "memory.current")) else {
                    return true;
                };
                let target = limit.saturating_sub(room);
                if usage <= target {
                    return true;
                }
                match self.write("", "memory.reclaim", &(usage - target).to_string()) {
                    Ok(()) => true,
                    Err(CgroupError::Io { source, .. }) => source.raw_os_error() != Some(libc::EAGAIN),
                    Err(_) => true,
                }
            }
        }
    }

    /// How many processes the kernel's OOM killer has killed in the cgroup.
    pub fn oom_kills(&self) -> u64 {
        let (controller, file) = match self.version {
            CgroupVersion::V1 => ("memory", "memory.oom_control"),
            CgroupVersion::V2 => ("", "memory.events"),
        };
        self.read(controller, file).and_then(|s| keyed(&s, "oom_kill")).unwrap_or(0)
    }

    /// How many forks the pids limit refused.
    pub fn pids_refusals(&self) -> u64 {
        self.read("pids", "pids.events").and_then(|s| keyed(&s, "max")).unwrap_or(0)
    }

    /// The processes in the cgroup and in its child cgroups.
    pub fn pids(&self) -> Vec<i32> {
        let dir = self.dir("pids");
        let mut dirs = vec![dir.to_path_buf()];
        dirs.extend(subdirectories(dir));
        dirs.iter()
            .filter_map(|dir| fs::read_to_string(dir.join("cgroup.procs")).ok())
            .flat_map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect::<Vec<i32>>())
            .collect()
    }

    /// Kills every process in the cgroup and its child cgroups: on v1 until none is listed (a process forked
    /// meanwhile is killed in the next pass), for at most 200 ms, checking every 200 µs.
    pub fn kill_all(&self) {
        if self.version == CgroupVersion::V2 && self.write("", "cgroup.kill", "1").is_ok() {
            return;
        }
        let deadline = Instant::now() + KILL_PATIENCE;
        while Instant::now() < deadline {
            let pids = self.pids();
            if pids.is_empty() {
                return;
            }
            for pid in pids {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Removes the cgroup's directories and its child cgroups', waiting briefly for dying processes to leave.
    /// Returns whether all went.
    pub fn remove(&self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut all = true;
        let children = self.dirs.iter().flat_map(|(_, dir)| subdirectories(dir));
        let dirs: Vec<PathBuf> = children.chain(self.dirs.iter().map(|(_, dir)| dir.clone())).collect();
        for dir in &dirs {
            loop {
                match fs::remove_dir(dir) {
                    Ok(()) => break,
                    Err(err) if err.kind() == ErrorKind::NotFound => break,
                    Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_micros(200)),
                    Err(err) => {
                        log::warn!("cannot remove cgroup {}: {err}", dir.display());
                        all = false;
                        break;
                    }
                }
            }
        }
        all
    }
}

/// The directories in a cgroup directory: its child cgroups.
fn subdirectories(dir: &Path) -> Vec<PathBuf> {
    fs::read_dir(dir)
        .map(|entries| {
            entries.flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir())).map(|e| e.path()).collect()
        })
        .unwrap_or_default()
}

/// The value of `key` in a `key value` per line file.
fn keyed(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key).and_then(|rest| rest.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_parsing_finds_both_kinds() {
        let text = "35 25 0:30 / /sys/fs/cgroup/memory rw,relatime shared:14 - cgroup cgroup rw,memory\n\
                    36 25 0:31 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n\
                    37 25 0:32 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n";
        let mounts = parse_mounts(text);
        assert_eq!(mounts.len(), 3);
        assert_eq!(mounts[0], (PathBuf::from("/sys/fs/cgroup/memory"), Some("rw,memory".into())));
        assert_eq!(mounts[1], (PathBuf::from("/sys/fs/cgroup/unified"), None));
        assert!(has(mounts[2].1.as_deref().expect("v1"), "cpuacct"));
    }

    #[test]
    fn keyed_values() {
        assert_eq!(keyed("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n", "oom_kill"), Some(3));
        assert_eq!(keyed("max 7\n", "max"), Some(7));
        assert_eq!(keyed("usage_usec 12\nuser_usec 5\n", "usage_usec"), Some(12));
    }

    #[test]
    fn own_cgroup_owner_is_alive_and_dead_pid_is_not() {
        let tag = owner_tag(std::process::id()).expect("own stat");
        assert!(owner_is_alive(&format!("{tag}-0")));
        assert!(!owner_is_alive("999999999-1-0"));
    }
}
