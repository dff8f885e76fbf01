//! Fixed guest-physical addresses of the boot structures (see the table in [`crate::boot`]).

/// The GDT: null, code, data, TSS descriptors (8 bytes each).
pub const GDT_ADDR: u64 = 0x500;
/// The IDT: one empty entry; the kernel installs its own before it enables interrupts.
pub const IDT_ADDR: u64 = 0x520;
/// PVH `hvm_start_info`.
pub const PVH_INFO_ADDR: u64 = 0x6000;
/// PVH module list (the initrd), right after the start info.
pub const PVH_MODLIST_ADDR: u64 = 0x6040;
/// PVH memory map (in place of the zero page, which PVH does not use).
pub const PVH_MEMMAP_ADDR: u64 = 0x7000;
/// The zero page: Linux's `boot_params`.
pub const ZERO_PAGE_ADDR: u64 = 0x7000;
/// Initial `RSP`/`RBP`, below the page tables.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// Page-map level 4 table.
pub const PML4_ADDR: u64 = 0x9000;
/// Page-directory-pointer table (one entry used: the first GiB).
pub const PDPT_ADDR: u64 = 0xa000;
/// Page directory: 512 entries of 2 MiB pages, identity-mapping the first GiB.
pub const PD_ADDR: u64 = 0xb000;
/// End of the page tables: the least RAM a 64-bit entry needs.
pub const BOOT_TABLES_END: u64 = PD_ADDR + 0x1000;
/// What the identity map covers (1 GiB): the kernel and its first allocations must live below it, and so must the
/// MMIO of a hand-written test guest.
pub const IDENTITY_MAPPED: u64 = 1 << 30;
/// The kernel command line.
pub const CMDLINE_ADDR: u64 = 0x20000;
/// The longest command line, with its NUL (Linux's x86 `COMMAND_LINE_SIZE`).
pub const CMDLINE_MAX_SIZE: usize = 2048;
/// Start of the Extended BIOS Data Area: usable RAM below 1 MiB stops here.
pub const EBDA_START: u64 = 0x9fc00;
/// Start of high memory (1 MiB): the kernel's segments load above.
pub const HIMEM_START: u64 = 0x10_0000;

/// e820 type of usable RAM.
pub const E820_RAM: u32 = 1;
/// e820 type of reserved ranges (the MMIO gap).
pub const E820_RESERVED: u32 = 2;
