//! A node's CPUs as bins of vCPU slots: the one bin-packing rule of Strata, for a node admitting sandboxes onto
//! itself and for a placer choosing a node of the fleet.
//!
//! A node is `cpus` bins of `slots` slots (most sandboxes are idle, so a CPU carries many). A sandbox with `vcpus`
//! = v takes one slot on each of v *distinct* CPUs, so it never asks for more parallelism than the node has.
//! Placement is sorted first-fit: the sandboxes of one request (a fork of `count` copies is one request) are placed
//! largest first, each onto the lowest-numbered CPUs with a free slot, which keeps the load on few CPUs and leaves
//! whole CPUs free for wide sandboxes; a request is placed entirely or not at all. `slots` = 0 means CPUs are not
//! admitted against: every request fits, and takes no CPU.

use crate::records::AllocEntry;

/// Why placed sandboxes cannot be taken back into bins ([`Bins::occupy`]): the placement does not fit the node.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BinsError {
    /// A CPU past the node's.
    #[error("sandbox {id} is on CPU {cpu}, but the node has {cpus}")]
    NoSuchCpu {
        /// The sandbox.
        id: String,
        /// The CPU named.
        cpu: u32,
        /// The node's CPUs.
        cpus: u32,
    },
    /// A sandbox on one CPU twice.
    #[error("sandbox {id} is on CPU {cpu} twice")]
    CpuTwice {
        /// The sandbox.
        id: String,
        /// The CPU.
        cpu: u32,
    },
    /// A sandbox on another number of CPUs than its vCPUs.
    #[error("sandbox {id} has {vcpus} vCPUs on {placed} CPUs")]
    Width {
        /// The sandbox.
        id: String,
        /// Its vCPUs.
        vcpus: u32,
        /// The CPUs it is on.
        placed: usize,
    },
    /// A CPU with more sandboxes than slots.
    #[error("CPU {cpu} has more than {slots} sandboxes with sandbox {id}")]
    Full {
        /// The sandbox that did not fit.
        id: String,
        /// The CPU.
        cpu: u32,
        /// Slots per CPU.
        slots: u32,
    },
}

/// A node's CPUs as bins of vCPU slots, with the slots in use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bins {
    /// Slots used, per CPU.
    used: Vec<u32>,
    slots: u32,
}

impl Bins {
    /// `cpus` CPUs (at least one) of `slots` vCPU slots each, all free; 0 slots: CPUs are not admitted against.
    /// `cpus` is trusted: bound it first when it comes from elsewhere ([`crate::records::MAX_CPUS`]).
    pub fn new(cpus: u32, slots: u32) -> Bins {
        Bins { used: vec![0; cpus.max(1) as usize], slots }
    }

    /// Bins with the slots these placed sandboxes take; an error when they do not fit ([`Bins::occupy`]).
    pub fn with_entries(cpus: u32, slots: u32, entries: &[AllocEntry]) -> Result<Bins, BinsError> {
        let mut bins = Bins::new(cpus, slots);
        for entry in entries {
            bins.occupy(entry)?;
        }
        Ok(bins)
    }

    /// The CPUs.
    pub fn cpus(&self) -> u32 {
        // `used` was made from a u32.
        u32::try_from(self.used.len()).unwrap_or(u32::MAX)
    }

    /// vCPU slots per CPU.
    pub fn slots_per_cpu(&self) -> u32 {
        self.slots
    }

    /// vCPU slots in use, over every CPU.
    pub fn slots_used(&self) -> u64 {
        self.used.iter().map(|&u| u64::from(u)).sum()
    }

    /// vCPU slots in use and in all.
    pub fn slots(&self) -> (u64, u64) {
        (self.slots_used(), u64::from(self.slots).saturating_mul(self.used.len() as u64))
    }

    /// Places sandboxes of these widths, largest first, each onto the lowest-numbered CPUs with a free slot; the
    /// CPUs of each, in the order given; `None`, with nothing placed, unless all fit.
    pub fn place_all(&mut self, widths: &[u32]) -> Option<Vec<Vec<u32>>> {
        let mut placed = vec![Vec::new(); widths.len()];
        if self.slots == 0 {
            return Some(placed);
        }
        let mut order: Vec<usize> = (0..widths.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(widths[i]));
        for i in order {
            let want = widths[i] as usize;
            let cpus: Vec<u32> = (0..self.cpus()).filter(|&c| self.used[c as usize] < self.slots).take(want).collect();
            if cpus.len() < want {
                for cpus in &placed {
                    self.release(cpus);
                }
                return None;
            }
            for &c in &cpus {
                self.used[c as usize] += 1;
            }
            placed[i] = cpus;
        }
        Some(placed)
    }

    /// Gives back one sandbox's slots.
    pub fn release(&mut self, cpus: &[u32]) {
        for &c in cpus {
            if let Some(used) = self.used.get_mut(c as usize) {
                *used = used.saturating_sub(1);
            }
        }
    }

    /// Takes the slots of a sandbox placed before (read back from an alloc), checking that it is one slot on each
    /// of `vcpus` distinct CPUs of this node, each with a free slot. Nothing is taken on an error. With 0 slots,
    /// CPUs are not admitted against and the entry's CPUs are not looked at.
    pub fn occupy(&mut self, entry: &AllocEntry) -> Result<(), BinsError> {
        if self.slots == 0 {
            return Ok(());
        }
        let id = || entry.id.clone();
        if entry.cpus.len() != entry.vcpus as usize {
            return Err(BinsError::Width { id: id(), vcpus: entry.vcpus, placed: entry.cpus.len() });
        }
        for (i, &cpu) in entry.cpus.iter().enumerate() {
            let Some(&used) = self.used.get(cpu as usize) else {
                return Err(BinsError::NoSuchCpu { id: id(), cpu, cpus: self.cpus() });
            };
            if entry.cpus[..i].contains(&cpu) {
                return Err(BinsError::CpuTwice { id: id(), cpu });
            }
            if used >= self.slots {
                return Err(BinsError::Full { id: id(), cpu, slots: self.slots });
            }
        }
        for &cpu in &entry.cpus {
            self.used[cpu as usize] += 1;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

    use super::*;

    /// `count` sandboxes of `vcpus` each, as `HostCapacity::place` does.
    fn place(bins: &mut Bins, vcpus: u32, count: usize) -> Option<Vec<Vec<u32>>> {
        bins.place_all(&vec![vcpus; count])
    }

    fn entry(id: &str, vcpus: u32, cpus: &[u32]) -> AllocEntry {
        AllocEntry { id: id.into(), vcpus, memory: 0, cpus: cpus.to_vec() }
    }

    #[test]
    fn first_fit_fills_the_lowest_cpus_and_keeps_sandboxes_on_distinct_cpus() {
        let mut h = Bins::new(4, 2);
        assert_eq!(place(&mut h, 1, 3).unwrap(), vec![vec![0], vec![0], vec![1]]);
        // CPU 0 is full, CPU 1 has one slot: a 3-wide sandbox takes 1, 2 and 3.
        assert_eq!(place(&mut h, 3, 1).unwrap(), vec![vec![1, 2, 3]]);
        assert_eq!(h.slots_used(), 6);
        assert_eq!(h.slots(), (6, 8));
        // Two slots left (CPUs 2 and 3): a 3-wide one does not fit, and nothing was taken trying.
        assert_eq!(place(&mut h, 3, 1), None);
        assert_eq!(h.slots_used(), 6);
        h.release(&[1, 2, 3]);
        assert_eq!(place(&mut h, 2, 1).unwrap(), vec![vec![1, 2]]);
    }

    #[test]
    fn a_request_is_placed_largest_first_and_entirely_or_not_at_all() {
        // 2 CPUs × 2 slots: [1, 1, 2] fits only when the 2-wide sandbox is placed first.
        let mut h = Bins::new(2, 2);
        assert_eq!(h.place_all(&[1, 1, 2]).unwrap(), vec![vec![0], vec![1], vec![0, 1]]);
        assert_eq!(h.place_all(&[1]), None, "full");
        let mut h = Bins::new(2, 1);
        assert!(place(&mut h, 1, 3).is_none());
        assert_eq!(h.slots_used(), 0, "a refused request takes nothing");
        assert!(place(&mut h, 1, 2).is_some());
        // A sandbox wider than the node never fits, whatever the slots.
        assert!(place(&mut Bins::new(2, 100), 3, 1).is_none());
        // Zero slots: CPUs are not admitted against.
        assert_eq!(place(&mut Bins::new(1, 0), 8, 2).unwrap(), vec![Vec::<u32>::new(); 2]);
        // A node has at least one CPU.
        assert_eq!(Bins::new(0, 1).cpus(), 1);
    }

    #[test]
    fn placed_sandboxes_are_taken_back_only_when_they_fit() {
        let entries = [entry("a", 2, &[0, 1]), entry("b", 1, &[0])];
        let mut h = Bins::with_entries(3, 2, &entries).unwrap();
        assert_eq!(h.slots_used(), 3);
        // CPU 0 is full: the next sandbox goes to 1 and 2.
        assert_eq!(place(&mut h, 2, 1).unwrap(), vec![vec![1, 2]]);
        let before = h.clone();
        assert_eq!(h.occupy(&entry("c", 1, &[3])), Err(BinsError::NoSuchCpu { id: "c".into(), cpu: 3, cpus: 3 }));
        assert_eq!(h.occupy(&entry("c", 2, &[2, 2])), Err(BinsError::CpuTwice { id: "c".into(), cpu: 2 }));
        assert_eq!(h.occupy(&entry("c", 2, &[2])), Err(BinsError::Width { id: "c".into(), vcpus: 2, placed: 1 }));
        assert_eq!(h.occupy(&entry("c", 2, &[2, 1])), Err(BinsError::Full { id: "c".into(), cpu: 1, slots: 2 }));
        assert_eq!(h, before, "a refused entry takes nothing");
        assert_eq!(h.occupy(&entry("c", 1, &[2])), Ok(()));
        // Zero slots: entries are not looked at.
        assert!(Bins::with_entries(1, 0, &[entry("x", 9, &[7, 7])]).is_ok());
    }
}
