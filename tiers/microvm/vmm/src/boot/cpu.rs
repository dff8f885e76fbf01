//! The boot vCPU's descriptor tables, page tables and registers (Firecracker's `setup_regs`/`setup_sregs`).

use kvm_bindings::{kvm_dtable, kvm_regs, kvm_segment, kvm_sregs};
use vm_memory::{Address, GuestAddress};

use super::layout::*;
use super::{BootError, BootProtocol, EntryPoint};
use crate::vstate::memory::GuestMemory;

/// CR0: protection enable.
pub const X86_CR0_PE: u64 = 1 << 0;
/// CR0: extension type (always 1 on modern CPUs).
pub const X86_CR0_ET: u64 = 1 << 4;
/// CR0: native x87 error reporting.
pub const X86_CR0_NE: u64 = 1 << 5;
/// CR0: paging.
pub const X86_CR0_PG: u64 = 1 << 31;
/// CR4: physical address extension (required for long mode).
pub const X86_CR4_PAE: u64 = 1 << 5;
/// EFER: long mode enable.
pub const EFER_LME: u64 = 1 << 8;
/// EFER: long mode active.
pub const EFER_LMA: u64 = 1 << 10;

/// Page-table entry bits: present, writable.
const PTE_PRESENT_RW: u64 = 0x3;
/// Page-directory entry bits: present, writable, 2 MiB page.
const PDE_PRESENT_RW_HUGE: u64 = 0x83;

/// A GDT descriptor from its flags (access byte in bits 0-7, flags nibble in bits 12-15), base and limit.
pub const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    let (flags, base, limit) = (flags as u64, base as u64, limit as u64);
    ((base & 0xff00_0000) << 32)
        | ((flags & 0xf0ff) << 40)
        | ((limit & 0x000f_0000) << 32)
        | ((base & 0x00ff_ffff) << 16)
        | (limit & 0xffff)
}

/// The KVM segment register value a descriptor loads, for selector `index * 8`.
pub fn segment_from_gdt(entry: u64, index: u8) -> kvm_segment {
    let bit = |n: u32| ((entry >> n) & 1) as u8;
    let base = ((entry >> 32) & 0xff00_0000) | ((entry >> 16) & 0x00ff_ffff);
    let raw_limit = ((entry >> 32) & 0x000f_0000) | (entry & 0xffff);
    let granular = bit(55) == 1;
    let limit = if granular { (raw_limit << 12) | 0xfff } else { raw_limit };
    kvm_segment {
        base,
        limit: limit as u32,
        selector: u16::from(index) * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present: bit(47),
        dpl: ((entry >> 45) & 0x3) as u8,
        db: bit(54),
        s: bit(44),
        l: bit(53),
        g: bit(55),
        avl: bit(52),
        unusable: u8::from(bit(47) == 0),
        padding: 0,
    }
}

/// The GDT of a protocol: null, code, data, TSS. 64-bit: a long-mode code segment (L=1); PVH: 32-bit flat.
pub fn gdt(protocol: BootProtocol) -> [u64; 4] {
    match protocol {
        BootProtocol::Linux64 => [
            gdt_entry(0, 0, 0),            // null
            gdt_entry(0xa09b, 0, 0xfffff), // code: present, ring 0, execute/read, accessed; L=1, G=1
            gdt_entry(0xc093, 0, 0xfffff), // data: present, ring 0, read/write, accessed; D/B=1, G=1
            gdt_entry(0x808b, 0, 0xfffff), // TSS: present, busy 64-bit TSS; G=1
        ],
        BootProtocol::Pvh => [
            gdt_entry(0, 0, 0),
            gdt_entry(0xc09b, 0, 0xffff_ffff), // code: 32-bit flat
            gdt_entry(0xc093, 0, 0xffff_ffff), // data: 32-bit flat
            gdt_entry(0x008b, 0, 0x67),        // TSS: busy, 104 bytes
        ],
    }
}

/// Writes the GDT and an empty IDT, and for the 64-bit protocol the identity page tables (PML4 → PDPT → PD of 512
/// 2 MiB pages: guest virtual = physical for the first GiB).
pub fn write_boot_tables(mem: &GuestMemory, protocol: BootProtocol) -> Result<(), BootError> {
    if mem.low_end().raw_value() < BOOT_TABLES_END {
        return Err(BootError::MemoryTooSmall { size: mem.size(), needed: BOOT_TABLES_END });
    }
    let write = |addr: u64, bytes: &[u8]| mem.write(GuestAddress(addr), bytes).map_err(BootError::Memory);
    let gdt: Vec<u8> = gdt(protocol).iter().flat_map(|e| e.to_le_bytes()).collect();
    write(GDT_ADDR, &gdt)?;
    write(IDT_ADDR, &0u64.to_le_bytes())?;
    if protocol == BootProtocol::Linux64 {
        write(PML4_ADDR, &(PDPT_ADDR | PTE_PRESENT_RW).to_le_bytes())?;
        write(PDPT_ADDR, &(PD_ADDR | PTE_PRESENT_RW).to_le_bytes())?;
        let pd: Vec<u8> = (0..512u64).flat_map(|i| ((i << 21) | PDE_PRESENT_RW_HUGE).to_le_bytes()).collect();
        write(PD_ADDR, &pd)?;
    }
    Ok(())
}

/// General registers at entry: `RIP` = entry, `RFLAGS` = reserved bit only (interrupts off), and the boot
/// information in `RSI` (64-bit: the zero page, with a stack below the page tables) or `RBX` (PVH).
pub fn entry_regs(entry: &EntryPoint) -> kvm_regs {
    match entry.protocol {
        BootProtocol::Linux64 => kvm_regs {
            rflags: 0x2,
            rip: entry.entry.raw_value(),
            rsp: BOOT_STACK_POINTER,
            rbp: BOOT_STACK_POINTER,
            rsi: entry.boot_info.raw_value(),
            ..Default::default()
        },
        BootProtocol::Pvh => kvm_regs {
            rflags: 0x2,
            rip: entry.entry.raw_value(),
            rbx: entry.boot_info.raw_value(),
            ..Default::default()
        },
    }
}

/// Special registers at entry, on top of the vCPU's reset values (which keep `APIC_BASE` and the like):
/// segments from [`gdt`], GDTR/IDTR at [`GDT_ADDR`]/[`IDT_ADDR`], and
/// - 64-bit: `CR0` = PE|ET|NE|PG (caching on), `CR3` = [`PML4_ADDR`], `CR4` = PAE, `EFER` = LME|LMA;
/// - PVH: `CR0` = PE|ET, `CR4` = 0, `EFER` = 0 (protected mode, no paging).
pub fn entry_sregs(entry: &EntryPoint, sregs: &mut kvm_sregs) {
    let gdt = gdt(entry.protocol);
    let code = segment_from_gdt(gdt[1], 1);
    let data = segment_from_gdt(gdt[2], 2);
    let tss = segment_from_gdt(gdt[3], 3);
    sregs.gdt = kvm_dtable { base: GDT_ADDR, limit: (std::mem::size_of_val(&gdt) - 1) as u16, padding: [0; 3] };
    sregs.idt = kvm_dtable { base: IDT_ADDR, limit: (std::mem::size_of::<u64>() - 1) as u16, padding: [0; 3] };
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = tss;
    match entry.protocol {
        BootProtocol::Linux64 => {
            sregs.cr0 = X86_CR0_PE | X86_CR0_ET | X86_CR0_NE | X86_CR0_PG;
            sregs.cr3 = PML4_ADDR;
            sregs.cr4 = X86_CR4_PAE;
            sregs.efer = EFER_LME | EFER_LMA;
        }
        BootProtocol::Pvh => {
            sregs.cr0 = X86_CR0_PE | X86_CR0_ET;
            sregs.cr3 = 0;
            sregs.cr4 = 0;
            sregs.efer = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gdt_entries_decode_to_the_segments_they_describe() {
        let [_, code, data, tss] = gdt(BootProtocol::Linux64);
        let cs = segment_from_gdt(code, 1);
        assert_eq!((cs.selector, cs.l, cs.db, cs.present, cs.s, cs.type_, cs.limit), (8, 1, 0, 1, 1, 0xb, u32::MAX));
        let ds = segment_from_gdt(data, 2);
        assert_eq!((ds.selector, ds.l, ds.db, ds.type_, ds.base), (0x10, 0, 1, 0x3, 0));
        let tr = segment_from_gdt(tss, 3);
        assert_eq!((tr.selector, tr.s, tr.type_, tr.unusable), (0x18, 0, 0xb, 0));
        assert_eq!(segment_from_gdt(0, 0).unusable, 1);
        assert_eq!(gdt_entry(0xa09b, 0, 0xfffff), 0x00af_9b00_0000_ffff);
    }

    #[test]
    fn page_tables_identity_map_the_first_gib() {
        let mem = GuestMemory::new(1 << 20).expect("memory");
        write_boot_tables(&mem, BootProtocol::Linux64).expect("tables");
        let read = |addr: u64| {
            let mut b = [0u8; 8];
            mem.read(GuestAddress(addr), &mut b).expect("read");
            u64::from_le_bytes(b)
        };
        assert_eq!(read(PML4_ADDR), PDPT_ADDR | 3);
        assert_eq!(read(PDPT_ADDR), PD_ADDR | 3);
        assert_eq!(read(PD_ADDR), 0x83);
        assert_eq!(read(PD_ADDR + 511 * 8), (511 << 21) | 0x83);
        assert_eq!(read(GDT_ADDR + 8), gdt(BootProtocol::Linux64)[1]);
    }

    #[test]
    fn too_little_memory_for_the_tables_is_refused() {
        let mem = GuestMemory::new(0x8000).expect("memory");
        assert!(matches!(
            write_boot_tables(&mem, BootProtocol::Linux64),
            Err(BootError::MemoryTooSmall { needed: BOOT_TABLES_END, .. })
        ));
    }
}
