//! Direct boot of an ELF `vmlinux`: kernel segments, command line, initrd, and the zero page or PVH start info.

use std::fs::File;
use std::io::{Read, Seek};

use linux_loader::cmdline::Cmdline;
use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params};
use linux_loader::loader::elf::{Elf, PvhBootCapability};
use linux_loader::loader::{KernelLoader, load_cmdline};
use vm_memory::{Address, Bytes, GuestAddress, ReadVolatile};

use super::e820::memory_map;
use super::layout::*;
use super::{BootError, BootProtocol, EntryPoint, pvh, write_boot_tables};
use crate::vstate::memory::{GuestMemory, MMIO_GAP_START, PAGE_SIZE};

/// `boot_params.hdr.boot_flag`.
const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
/// `boot_params.hdr.header`: "HdrS".
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448;
/// `boot_params.hdr.type_of_loader`: an unregistered loader.
const KERNEL_LOADER_OTHER: u8 = 0xff;
/// `boot_params.hdr.kernel_alignment`: 16 MiB.
const KERNEL_MIN_ALIGNMENT_BYTES: u32 = 0x0100_0000;

/// What [`load_kernel`] placed in guest memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadedKernel {
    /// How the boot vCPU enters it: pass to `Vcpu::set_entry`.
    pub entry: EntryPoint,
    /// First byte after the kernel's segments.
    pub kernel_end: GuestAddress,
    /// Where the initrd went and its size.
    pub initrd: Option<(GuestAddress, u64)>,
    /// The kernel's PVH entry, when it has one (whether or not PVH was chosen).
    pub pvh_entry: Option<GuestAddress>,
}

/// Loads an ELF `vmlinux` and everything its boot protocol needs into `mem`:
/// its `PT_LOAD` segments at their physical addresses (above [`HIMEM_START`]), `cmdline` at [`CMDLINE_ADDR`] (the
/// caller appends `virtio_mmio.device=4K@0x...:IRQ` entries first, with `Cmdline::add_virtio_mmio_device`), the
/// initrd page-aligned at the top of low memory, the GDT/IDT/page tables, and the zero page ([`ZERO_PAGE_ADDR`]) or,
/// for PVH, the `hvm_start_info` ([`PVH_INFO_ADDR`]).
pub fn load_kernel<K>(
    mem: &GuestMemory,
    kernel: &mut K,
    cmdline: &Cmdline,
    initrd: Option<&mut File>,
    protocol: BootProtocol,
) -> Result<LoadedKernel, BootError>
where
    K: Read + ReadVolatile + Seek,
{
    let needed = HIMEM_START + PAGE_SIZE;
    if mem.low_end().raw_value() < needed {
        return Err(BootError::MemoryTooSmall { size: mem.size(), needed });
    }
    let loaded = Elf::load(mem.mmap(), None, kernel, Some(GuestAddress(HIMEM_START))).map_err(BootError::LoadKernel)?;
    let pvh_entry = match loaded.pvh_boot_cap {
        PvhBootCapability::PvhEntryPresent(addr) => Some(addr),
        _ => None,
    };
    let kernel_end = GuestAddress(loaded.kernel_end);

    let cmdline_len =
        cmdline.as_cstring().map_err(|_| BootError::Cmdline(linux_loader::loader::Error::InvalidCommandLine))?;
    let cmdline_len = cmdline_len.as_bytes_with_nul().len();
    if cmdline_len > CMDLINE_MAX_SIZE {
        return Err(BootError::CmdlineTooLong { len: cmdline_len, max: CMDLINE_MAX_SIZE });
    }
    load_cmdline(mem.mmap(), GuestAddress(CMDLINE_ADDR), cmdline).map_err(BootError::Cmdline)?;
    write_boot_tables(mem, protocol)?;
    let initrd = match initrd {
        Some(file) => Some(load_initrd(mem, file, kernel_end)?),
        None => None,
    };

    let entry = match protocol {
        BootProtocol::Linux64 => {
            write_zero_page(mem, cmdline_len, initrd)?;
            EntryPoint { protocol, entry: loaded.kernel_load, boot_info: GuestAddress(ZERO_PAGE_ADDR) }
        }
        BootProtocol::Pvh => {
            let entry = pvh_entry.ok_or(BootError::NoPvhEntry)?;
            pvh::write_start_info(mem, initrd)?;
            EntryPoint { protocol, entry, boot_info: GuestAddress(PVH_INFO_ADDR) }
        }
    };
    Ok(LoadedKernel { entry, kernel_end, initrd, pvh_entry })
}

/// Copies the initrd to the highest page-aligned address where it ends before the top of low memory.
fn load_initrd(mem: &GuestMemory, file: &mut File, kernel_end: GuestAddress) -> Result<(GuestAddress, u64), BootError> {
    let size = file.metadata().map_err(BootError::ReadInitrd)?.len();
    let low_end = mem.low_end().raw_value();
    let too_large = BootError::InitrdTooLarge { size, kernel_end: kernel_end.raw_value(), low_end };
    let addr = match low_end.checked_sub(size) {
        Some(top) => top & !(PAGE_SIZE - 1),
        None => return Err(too_large),
    };
    if addr < kernel_end.raw_value() || addr < HIMEM_START {
        return Err(too_large);
    }
    let len = usize::try_from(size).map_err(|_| too_large)?;
    file.rewind().map_err(BootError::ReadInitrd)?;
    mem.mmap()
        .read_exact_volatile_from(GuestAddress(addr), file, len)
        .map_err(|e| BootError::Memory(crate::vstate::memory::MemoryError::Access(e)))?;
    Ok((GuestAddress(addr), size))
}

fn write_zero_page(
    mem: &GuestMemory,
    cmdline_len: usize,
    initrd: Option<(GuestAddress, u64)>,
) -> Result<(), BootError> {
    let mut params = boot_params::default();
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
    params.hdr.header = KERNEL_HDR_MAGIC;
    params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT_BYTES;
    params.hdr.cmd_line_ptr = CMDLINE_ADDR as u32;
    // Linux takes cmdline_size as the length without the NUL.
    params.hdr.cmdline_size = (cmdline_len - 1) as u32;
    if let Some((addr, size)) = initrd {
        // The initrd lies below the MMIO gap, so both fit 32 bits; checked anyway.
        let too_large = || BootError::InitrdTooLarge { size, kernel_end: 0, low_end: MMIO_GAP_START };
        params.hdr.ramdisk_image = u32::try_from(addr.raw_value()).map_err(|_| too_large())?;
        params.hdr.ramdisk_size = u32::try_from(size).map_err(|_| too_large())?;
    }
    for (addr, size, kind) in memory_map(mem) {
        let slot = params.e820_table.get_mut(usize::from(params.e820_entries)).ok_or(BootError::E820Full)?;
        *slot = boot_e820_entry { addr, size, r#type: kind };
        params.e820_entries += 1;
    }
    let params = BootParams::new::<boot_params>(&params, GuestAddress(ZERO_PAGE_ADDR));
    LinuxBootConfigurator::write_bootparams(&params, mem.mmap()).map_err(BootError::BootParams)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    /// A minimal ELF64 executable: one `PT_LOAD` of `code` at physical `paddr`, entry at its first byte.
    pub(crate) fn tiny_elf(paddr: u64, code: &[u8]) -> Vec<u8> {
        const EHDR: u64 = 64;
        const PHDR: u64 = 56;
        let entry = paddr + EHDR + PHDR;
        let filesz = EHDR + PHDR + code.len() as u64;
        let mut elf = Vec::new();
        elf.extend_from_slice(b"\x7fELF\x02\x01\x01\0\0\0\0\0\0\0\0\0"); // 64-bit, little endian, SysV
        elf.extend_from_slice(&2u16.to_le_bytes()); // e_type: EXEC
        elf.extend_from_slice(&0x3eu16.to_le_bytes()); // e_machine: x86-64
        elf.extend_from_slice(&1u32.to_le_bytes()); // e_version
        elf.extend_from_slice(&entry.to_le_bytes()); // e_entry
        elf.extend_from_slice(&EHDR.to_le_bytes()); // e_phoff
        elf.extend_from_slice(&0u64.to_le_bytes()); // e_shoff
        elf.extend_from_slice(&0u32.to_le_bytes()); // e_flags
        elf.extend_from_slice(&(EHDR as u16).to_le_bytes()); // e_ehsize
        elf.extend_from_slice(&(PHDR as u16).to_le_bytes()); // e_phentsize
        elf.extend_from_slice(&1u16.to_le_bytes()); // e_phnum
        elf.extend_from_slice(&[0; 6]); // e_shentsize, e_shnum, e_shstrndx
        elf.extend_from_slice(&1u32.to_le_bytes()); // p_type: LOAD
        elf.extend_from_slice(&7u32.to_le_bytes()); // p_flags: RWX
        elf.extend_from_slice(&0u64.to_le_bytes()); // p_offset
        elf.extend_from_slice(&paddr.to_le_bytes()); // p_vaddr
        elf.extend_from_slice(&paddr.to_le_bytes()); // p_paddr
        elf.extend_from_slice(&filesz.to_le_bytes()); // p_filesz
        elf.extend_from_slice(&filesz.to_le_bytes()); // p_memsz
        elf.extend_from_slice(&0x1000u64.to_le_bytes()); // p_align
        elf.extend_from_slice(code);
        elf
    }

    fn read_u32(mem: &GuestMemory, addr: u64) -> u32 {
        let mut b = [0u8; 4];
        mem.read(GuestAddress(addr), &mut b).expect("read");
        u32::from_le_bytes(b)
    }

    #[test]
    fn the_zero_page_points_at_the_cmdline_and_the_initrd() {
        let mem = GuestMemory::new(16 << 20).expect("memory");
        let elf = tiny_elf(0x20_0000, &[0xf4]);
        let mut cmdline = Cmdline::new(CMDLINE_MAX_SIZE).expect("cmdline");
        cmdline.insert_str("console=ttyS0").expect("insert");
        cmdline.add_virtio_mmio_device(0x1000, GuestAddress(MMIO_GAP_START), 5, None).expect("virtio");
        let dir = tempfile::tempdir().expect("tempdir");
        let initrd_path = dir.path().join("initrd");
        std::fs::write(&initrd_path, vec![0x5a; 5000]).expect("initrd");
        let mut initrd = File::open(&initrd_path).expect("open");

        let loaded =
            load_kernel(&mem, &mut Cursor::new(elf), &cmdline, Some(&mut initrd), BootProtocol::Linux64).expect("load");
        assert_eq!(loaded.entry.entry, GuestAddress(0x20_0000 + 64 + 56));
        assert_eq!(loaded.entry.boot_info, GuestAddress(ZERO_PAGE_ADDR));
        let (initrd_addr, initrd_size) = loaded.initrd.expect("initrd");
        assert_eq!((initrd_addr.raw_value(), initrd_size), ((16 << 20) - 0x2000, 5000));

        let hdr = ZERO_PAGE_ADDR + 0x1f1;
        assert_eq!(read_u32(&mem, ZERO_PAGE_ADDR + 0x228), CMDLINE_ADDR as u32, "cmd_line_ptr");
        assert_eq!(read_u32(&mem, ZERO_PAGE_ADDR + 0x218), initrd_addr.raw_value() as u32, "ramdisk_image");
        assert_eq!(read_u32(&mem, ZERO_PAGE_ADDR + 0x21c), 5000, "ramdisk_size");
        assert_eq!(read_u32(&mem, hdr + 0x202 - 0x1f1), KERNEL_HDR_MAGIC, "header");
        let mut text = vec![0u8; 64];
        mem.read(GuestAddress(CMDLINE_ADDR), &mut text).expect("read");
        let text = String::from_utf8_lossy(&text);
        assert!(text.starts_with("console=ttyS0 virtio_mmio.device=4K@0xd0000000:5\0"), "{text}");

        let mut entries = [0u8; 1];
        mem.read(GuestAddress(ZERO_PAGE_ADDR + 0x1e8), &mut entries).expect("read");
        assert_eq!(entries[0], 3, "low RAM, high RAM, MMIO gap");
    }

    #[test]
    fn bad_kernels_and_oversized_inputs_are_typed_errors() {
        let mem = GuestMemory::new(4 << 20).expect("memory");
        let cmdline = Cmdline::new(16).expect("cmdline");
        let not_elf = load_kernel(&mem, &mut Cursor::new(vec![0u8; 256]), &cmdline, None, BootProtocol::Linux64);
        assert!(matches!(not_elf, Err(BootError::LoadKernel(_))), "{not_elf:?}");

        let beyond_ram = tiny_elf(8 << 20, &[0xf4]);
        let res = load_kernel(&mem, &mut Cursor::new(beyond_ram), &cmdline, None, BootProtocol::Linux64);
        assert!(matches!(res, Err(BootError::LoadKernel(_))), "{res:?}");

        let no_pvh = tiny_elf(0x20_0000, &[0xf4]);
        let res = load_kernel(&mem, &mut Cursor::new(no_pvh), &cmdline, None, BootProtocol::Pvh);
        assert!(matches!(res, Err(BootError::NoPvhEntry)), "{res:?}");

        let mut long = Cmdline::new(4096).expect("cmdline");
        long.insert_str("x".repeat(3000)).expect("insert");
        let res = load_kernel(&mem, &mut Cursor::new(tiny_elf(0x20_0000, &[0xf4])), &long, None, BootProtocol::Linux64);
        assert!(matches!(res, Err(BootError::CmdlineTooLong { len: 3001, .. })), "{res:?}");

        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("initrd");
        std::fs::write(&path, vec![0u8; 4 << 20]).expect("initrd");
        let mut initrd = File::open(&path).expect("open");
        let res = load_kernel(
            &mem,
            &mut Cursor::new(tiny_elf(0x20_0000, &[0xf4])),
            &cmdline,
            Some(&mut initrd),
            BootProtocol::Linux64,
        );
        assert!(matches!(res, Err(BootError::InitrdTooLarge { .. })), "{res:?}");
    }
}
