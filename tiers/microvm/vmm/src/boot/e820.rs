//! The e820 memory map that both boot protocols hand the kernel: the zero page's `e820_table` and PVH's memory map.

use vm_memory::Address;

use super::layout::*;
use crate::vstate::memory::{GuestMemory, MMIO_GAP_END, MMIO_GAP_SIZE, MMIO_GAP_START};

/// The e820 map both protocols hand over: RAM below the EBDA, RAM from 1 MiB to the end of low memory, the MMIO gap
/// reserved, and RAM above 4 GiB when there is any.
pub(super) fn memory_map(mem: &GuestMemory) -> Vec<(u64, u64, u32)> {
    let low_end = mem.low_end().raw_value();
    let mut map = vec![(0, EBDA_START.min(low_end), E820_RAM)];
    if low_end > HIMEM_START {
        map.push((HIMEM_START, low_end - HIMEM_START, E820_RAM));
    }
    map.push((MMIO_GAP_START, MMIO_GAP_SIZE, E820_RESERVED));
    if mem.size() > MMIO_GAP_START {
        map.push((MMIO_GAP_END, mem.size() - MMIO_GAP_START, E820_RAM));
    }
    map
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_memory_map_reserves_the_gap_and_continues_above_it() {
        let mem = GuestMemory::new(MMIO_GAP_START + (1 << 20)).expect("memory");
        assert_eq!(
            memory_map(&mem),
            vec![
                (0, EBDA_START, E820_RAM),
                (HIMEM_START, MMIO_GAP_START - HIMEM_START, E820_RAM),
                (MMIO_GAP_START, MMIO_GAP_SIZE, E820_RESERVED),
                (MMIO_GAP_END, 1 << 20, E820_RAM),
            ]
        );
    }
}
