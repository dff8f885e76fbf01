//! This host's capacity, and admission against it: sandboxes packed onto the host's CPUs, and a floor of free
//! memory the host keeps.
//!
//! **CPUs.** Each CPU this process may run on ([`std::thread::available_parallelism`], which honours the affinity
//! mask and a cgroup quota) is a bin of `slots` vCPU slots (`--cpu-overcommit`: most sandboxes are idle, so a
//! CPU carries many). A sandbox with `vcpus` = v takes one slot on each of v *distinct* CPUs, so a sandbox never
//! asks for more parallelism than the host has. Placement is sorted first-fit: the items of one request (a fork of
//! `count` copies is one request) are placed largest first, each onto the lowest-numbered CPUs with a free slot,
//! which keeps the load on as few CPUs as possible and leaves whole CPUs free for wide sandboxes. A request is
//! placed entirely or not at all. The placement is accounting: it decides admission and is shown in the sandbox's
//! `cpus`, but jobs are not pinned to those CPUs.
//!
//! **Memory.** Besides the committed-memory budget (the sum of memory limits, [`crate::ServeConfig::memory_budget`]),
//! a request is admitted only when the host's `MemAvailable` (`/proc/meminfo`, read at each admission) covers the
//! memory limits of every sandbox it creates on top of `--min-free-memory`: the host can give a new sandbox its
//! whole limit now and still keep its floor. Sandboxes use far less than their limits when idle, so this admits
//! many more sandboxes than `MemTotal / limit` while real memory pressure stops admission.

use std::path::PathBuf;

use strata_fleet::Bins;

/// Where free memory is read from.
#[derive(Debug, Clone)]
pub enum MemoryProbe {
    /// `MemAvailable` in this `meminfo`-format file (normally `/proc/meminfo`).
    Meminfo(PathBuf),
    /// A fixed amount (for tests).
    Fixed(u64),
}

impl MemoryProbe {
    /// The host's memory probe: `/proc/meminfo`.
    pub fn host() -> MemoryProbe {
        MemoryProbe::Meminfo(PathBuf::from("/proc/meminfo"))
    }

    /// Bytes available now; `None` when it cannot be read (then memory admission is by the budgets alone).
    pub fn available(&self) -> Option<u64> {
        match self {
            MemoryProbe::Fixed(bytes) => Some(*bytes),
            MemoryProbe::Meminfo(path) => meminfo_field(&std::fs::read_to_string(path).ok()?, "MemAvailable"),
        }
    }
}

/// A `Name:  123 kB` field of `/proc/meminfo`, in bytes.
pub fn meminfo_field(text: &str, name: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.split(':').next() == Some(name))?;
    let kib: u64 = line.split(':').nth(1)?.split_whitespace().next()?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

/// The default floor of free memory: 5% of the host's `MemTotal`, at least 256 MiB.
pub fn default_min_free_memory() -> u64 {
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| meminfo_field(&t, "MemTotal"));
    total.map_or(0, |t| t / 20).max(256 << 20)
}

/// Why the host cannot take a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Short {
    /// Not enough CPU slots for the request's sandboxes.
    Cpu {
        /// vCPUs each sandbox asked for.
        vcpus: u32,
        /// Sandboxes in the request.
        count: usize,
        /// The host's CPUs.
        cpus: usize,
        /// vCPU slots per CPU.
        slots: u32,
    },
    /// Free memory would fall below the floor.
    Memory {
        /// `MemAvailable` now.
        available: u64,
        /// The request's memory limits plus the floor.
        needed: u64,
    },
}

/// The host's CPUs as bins of vCPU slots ([`strata_fleet::Bins`]: the same rule a fleet places by across nodes),
/// and its free-memory floor.
#[derive(Debug, Clone)]
pub struct HostCapacity {
    bins: Bins,
    min_free: u64,
    probe: MemoryProbe,
}

impl HostCapacity {
    /// `cpus` CPUs of `slots` vCPU slots each (0 slots: CPUs are not admitted against), keeping `min_free` bytes of
    /// memory free as `probe` reads it.
    pub fn new(cpus: usize, slots: u32, min_free: u64, probe: MemoryProbe) -> HostCapacity {
        let cpus = u32::try_from(cpus).unwrap_or(strata_fleet::MAX_CPUS).min(strata_fleet::MAX_CPUS);
        HostCapacity { bins: Bins::new(cpus, slots), min_free, probe }
    }

    /// This host: the CPUs this process may run on, and `/proc/meminfo`.
    pub fn host(slots: u32, min_free: u64) -> HostCapacity {
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        HostCapacity::new(cpus, slots, min_free, MemoryProbe::host())
    }

    /// The host's CPUs.
    pub fn cpus(&self) -> usize {
        self.bins.cpus() as usize
    }

    /// vCPU slots in use, over every CPU.
    pub fn slots_used(&self) -> u64 {
        self.bins.slots_used()
    }

    /// vCPU slots in use and in all.
    pub fn slots(&self) -> (u64, u64) {
        self.bins.slots()
    }

    /// Checks free memory for `memory` more bytes of limits.
    pub fn check_memory(&self, memory: u64) -> Result<(), Short> {
        if let Some(available) = self.probe.available() {
            let needed = memory.saturating_add(self.min_free);
            if available < needed {
                return Err(Short::Memory { available, needed });
            }
        }
        Ok(())
    }

    /// Places `count` sandboxes of `vcpus` each (sorted first-fit, all or nothing): the CPUs of each.
    pub fn place(&mut self, vcpus: u32, count: usize) -> Result<Vec<Vec<usize>>, Short> {
        self.place_all(&vec![vcpus; count]).ok_or(Short::Cpu {
            vcpus,
            count,
            cpus: self.cpus(),
            slots: self.bins.slots_per_cpu(),
        })
    }

    /// Places sandboxes of these widths, largest first, each onto the lowest-numbered CPUs with a free slot; the
    /// CPUs of each, in the order given; `None`, with nothing placed, unless all fit ([`Bins::place_all`]).
    pub fn place_all(&mut self, widths: &[u32]) -> Option<Vec<Vec<usize>>> {
        let placed = self.bins.place_all(widths)?;
        Some(placed.into_iter().map(|cpus| cpus.into_iter().map(|c| c as usize).collect()).collect())
    }

    /// Gives back one sandbox's slots.
    pub fn release(&mut self, cpus: &[usize]) {
        let cpus: Vec<u32> = cpus.iter().filter_map(|&c| u32::try_from(c).ok()).collect();
        self.bins.release(&cpus);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

    use super::*;

    fn host(cpus: usize, slots: u32) -> HostCapacity {
        HostCapacity::new(cpus, slots, 100, MemoryProbe::Fixed(1000))
    }

    #[test]
    fn first_fit_fills_the_lowest_cpus_and_keeps_sandboxes_on_distinct_cpus() {
        let mut h = host(4, 2);
        assert_eq!(h.place(1, 3).unwrap(), vec![vec![0], vec![0], vec![1]]);
        // CPU 0 is full, CPU 1 has one slot: a 3-wide sandbox takes 1, 2 and 3.
        assert_eq!(h.place(3, 1).unwrap(), vec![vec![1, 2, 3]]);
        assert_eq!(h.slots_used(), 6);
        // Two slots left (CPUs 2 and 3): a 3-wide one does not fit, and nothing was taken trying.
        assert_eq!(h.place(3, 1), Err(Short::Cpu { vcpus: 3, count: 1, cpus: 4, slots: 2 }));
        assert_eq!(h.slots_used(), 6);
        h.release(&[1, 2, 3]);
        assert_eq!(h.place(2, 1).unwrap(), vec![vec![1, 2]]);
    }

    #[test]
    fn a_request_is_placed_largest_first_and_entirely_or_not_at_all() {
        // 2 CPUs × 2 slots: [1, 1, 2] fits only when the 2-wide sandbox is placed first.
        let mut h = host(2, 2);
        assert_eq!(h.place_all(&[1, 1, 2]).unwrap(), vec![vec![0], vec![1], vec![0, 1]]);
        assert_eq!(h.place_all(&[1]), None, "full");
        let mut h = host(2, 1);
        assert!(h.place(1, 3).is_err());
        assert_eq!(h.slots_used(), 0, "a refused request takes nothing");
        assert!(h.place(1, 2).is_ok());
        // A sandbox wider than the host never fits, whatever the slots.
        assert!(host(2, 100).place(3, 1).is_err());
        // Zero slots: CPUs are not admitted against.
        assert_eq!(host(1, 0).place(8, 2).unwrap(), vec![Vec::<usize>::new(); 2]);
    }

    #[test]
    fn memory_is_admitted_above_the_floor() {
        let h = host(1, 1);
        assert_eq!(h.check_memory(900), Ok(()));
        assert_eq!(h.check_memory(901), Err(Short::Memory { available: 1000, needed: 1001 }));
        let text = "MemTotal:       24576000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(meminfo_field(text, "MemAvailable"), Some(20_000_000 * 1024));
        assert_eq!(meminfo_field(text, "MemAvail"), None);
        assert!(MemoryProbe::host().available().is_some_and(|b| b > 0));
        assert!(default_min_free_memory() >= 256 << 20);
    }
}
