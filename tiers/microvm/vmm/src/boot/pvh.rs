//! The PVH boot protocol's `hvm_start_info`, module list and memory map (Firecracker's `configure_pvh`).

use linux_loader::configurator::pvh::PvhBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::elf::start_info::{hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info};
use vm_memory::{Address, GuestAddress};

use super::BootError;
use super::e820::memory_map;
use super::layout::*;
use crate::vstate::memory::GuestMemory;

/// `hvm_start_info.magic`.
const XEN_HVM_START_MAGIC_VALUE: u32 = 0x336e_c578;

/// Writes the start info at [`PVH_INFO_ADDR`], the initrd as its one module at [`PVH_MODLIST_ADDR`], and the memory
/// map at [`PVH_MEMMAP_ADDR`].
pub(super) fn write_start_info(mem: &GuestMemory, initrd: Option<(GuestAddress, u64)>) -> Result<(), BootError> {
    let memmap: Vec<hvm_memmap_table_entry> = memory_map(mem)
        .into_iter()
        .map(|(addr, size, type_)| hvm_memmap_table_entry { addr, size, type_, reserved: 0 })
        .collect();
    let mut start_info = hvm_start_info {
        magic: XEN_HVM_START_MAGIC_VALUE,
        version: 1,
        cmdline_paddr: CMDLINE_ADDR,
        memmap_paddr: PVH_MEMMAP_ADDR,
        memmap_entries: memmap.len() as u32,
        ..Default::default()
    };
    let mut params = BootParams::new(&start_info, GuestAddress(PVH_INFO_ADDR));
    if let Some((addr, size)) = initrd {
        start_info.nr_modules = 1;
        start_info.modlist_paddr = PVH_MODLIST_ADDR;
        params = BootParams::new(&start_info, GuestAddress(PVH_INFO_ADDR));
        let module = hvm_modlist_entry { paddr: addr.raw_value(), size, ..Default::default() };
        params.set_modules(&[module], GuestAddress(PVH_MODLIST_ADDR));
    }
    params.set_sections(&memmap, GuestAddress(PVH_MEMMAP_ADDR));
    PvhBootConfigurator::write_bootparams(&params, mem.mmap()).map_err(BootError::BootParams)
}
