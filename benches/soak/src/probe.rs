//! What a server holds on the host, read from `/proc`, its cgroup tree and `$STRATA_HOME`: the figures that must stay
//! flat under load and be zero once a killed server's successor has started.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

/// One reading.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sample {
    /// Open descriptors.
    pub fds: usize,
    /// Threads.
    pub threads: usize,
    /// Resident memory, KiB.
    pub rss_kib: u64,
    /// Mounts the server sees (its mount namespace is the host's: jails mount in their own).
    pub mounts: usize,
    /// Its processes besides itself (jail keepers, PID 1s, jobs: every descendant).
    pub procs: usize,
    /// Jail and job cgroups named after it.
    pub cgroups: usize,
    /// Entries of its state directory (snapshots, E2B homes).
    pub state: usize,
    /// Escalation scratch copies and egress proxy sockets named after it.
    pub scratch: usize,
}

impl Sample {
    /// Reads the figures of server `pid` (whose state lives under `home`).
    pub fn of(pid: u32, home: Option<&Path>) -> Sample {
        let proc_dir = PathBuf::from(format!("/proc/{pid}"));
        let count = |dir: &Path| fs::read_dir(dir).map(|d| d.count()).unwrap_or(0);
        let rss_kib = fs::read_to_string(proc_dir.join("status"))
            .ok()
            .and_then(|status| {
                status
                    .lines()
                    .find_map(|l| l.strip_prefix("VmRSS:").and_then(|v| v.trim().trim_end_matches(" kB").parse().ok()))
            })
            .unwrap_or(0);
        Sample {
            fds: count(&proc_dir.join("fd")),
            threads: count(&proc_dir.join("task")),
            rss_kib,
            mounts: fs::read_to_string(proc_dir.join("mountinfo")).map(|m| m.lines().count()).unwrap_or(0),
            procs: descendants(pid).len(),
            cgroups: cgroups_of(pid).len(),
            state: home.map(|h| state_entries(h, pid)).unwrap_or(0),
            scratch: home.map(|h| scratch_entries(h, pid)).unwrap_or(0),
        }
    }
}

/// Every live descendant of `pid`: `(pid, command name)`.
pub fn descendants(pid: u32) -> Vec<(u32, String)> {
    let mut parent_of = HashMap::new();
    let mut names = HashMap::new();
    for entry in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(child) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let Ok(stat) = fs::read_to_string(entry.path().join("stat")) else { continue };
        // `pid (comm) state ppid …`: the name may hold spaces and parentheses; what follows the last ')' is plain.
        let Some((head, tail)) = stat.rsplit_once(')') else { continue };
        let name = head.split_once('(').map(|(_, n)| n.to_owned()).unwrap_or_default();
        let Some(ppid) = tail.split_whitespace().nth(1).and_then(|p| p.parse::<u32>().ok()) else { continue };
        parent_of.insert(child, ppid);
        names.insert(child, name);
    }
    let mut found = Vec::new();
    for &child in parent_of.keys() {
        let mut at = child;
        let mut depth = 0;
        while let Some(&up) = parent_of.get(&at) {
            if up == pid {
                found.push((child, names.get(&child).cloned().unwrap_or_default()));
                break;
            }
            at = up;
            depth += 1;
            if up <= 1 || depth > 64 {
                break;
            }
        }
    }
    found.sort_unstable();
    found
}

/// The directories where the process tier makes the cgroups of server `pid`: `strata` under the server's own
/// cgroup, in each hierarchy mounted here. Read from the server's `/proc/PID/cgroup` when it runs, else from
/// `own_cgroups` (the lines it had, kept by the caller before the server was killed).
pub fn cgroup_parents(own_cgroups: &str) -> Vec<PathBuf> {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mounts: Vec<PathBuf> = mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let fstype = right.split(' ').next()?;
            (fstype == "cgroup" || fstype == "cgroup2").then(|| PathBuf::from(left.split(' ').nth(4).unwrap_or("")))
        })
        .collect();
    let mut parents = Vec::new();
    for line in own_cgroups.lines() {
        let Some(path) = line.splitn(3, ':').nth(2) else { continue };
        for mount in &mounts {
            let parent = mount.join(path.trim_start_matches('/')).join("strata");
            if parent.is_dir() && !parents.contains(&parent) {
                parents.push(parent);
            }
        }
    }
    parents
}

/// The cgroups of server `pid` (named `<pid>-<start time>-<n>`, with their jobs' inside), over every hierarchy.
pub fn cgroups_of(pid: u32) -> Vec<PathBuf> {
    let own = fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    cgroups_under(&cgroup_parents(&own), pid)
}

/// The cgroups named after `pid` under `parents`, with their children (the v1 hierarchies hold the same tree once per
/// controller: the fullest one counts).
pub fn cgroups_under(parents: &[PathBuf], pid: u32) -> Vec<PathBuf> {
    let prefix = format!("{pid}-");
    let subdirectories = |dir: &Path| -> Vec<PathBuf> {
        fs::read_dir(dir).into_iter().flatten().flatten().map(|e| e.path()).filter(|p| p.is_dir()).collect()
    };
    parents
        .iter()
        .map(|parent| {
            let mut found = Vec::new();
            for jail in subdirectories(parent) {
                if jail.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&prefix)) {
                    found.extend(subdirectories(&jail));
                    found.push(jail);
                }
            }
            found
        })
        .max_by_key(Vec::len)
        .unwrap_or_default()
}

/// The state directories of server `pid` (`$STRATA_HOME/run/serve/server-<pid>-…`).
pub fn state_dirs(home: &Path, pid: u32) -> Vec<PathBuf> {
    let prefix = format!("server-{pid}-");
    fs::read_dir(home.join("run/serve"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
        .collect()
}

fn state_entries(home: &Path, pid: u32) -> usize {
    state_dirs(home, pid)
        .iter()
        .map(|dir| {
            let top: Vec<PathBuf> = fs::read_dir(dir).into_iter().flatten().flatten().map(|e| e.path()).collect();
            let homes = fs::read_dir(dir.join("e2b")).map(|d| d.count()).unwrap_or(0);
            top.len() + homes
        })
        .sum()
}

/// Escalation scratch copies (`run/scratch/scratch-<pid>-…`) and egress sockets (`run/jail-egress/<pid>-….sock`).
pub fn scratch_of(home: &Path, pid: u32) -> Vec<PathBuf> {
    let scratch = format!("scratch-{pid}-");
    let socket = format!("{pid}-");
    let mut found = Vec::new();
    for (dir, prefix) in [(home.join("run/scratch"), &scratch), (home.join("run/jail-egress"), &socket)] {
        for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
            if entry.file_name().to_string_lossy().starts_with(prefix.as_str()) {
                found.push(entry.path());
            }
        }
    }
    found
}

fn scratch_entries(home: &Path, pid: u32) -> usize {
    scratch_of(home, pid).len()
}

/// The mount points under `home` in this process's mount namespace (the host's).
pub fn mounts_under(home: &Path) -> Vec<String> {
    let home = home.to_string_lossy().into_owned();
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .filter(|point| point.starts_with(home.as_str()))
        .map(str::to_owned)
        .collect()
}
