//! Loading and entering a Linux kernel.
//!
//! The default is Linux's 64-bit boot protocol, as Firecracker does it for an ELF `vmlinux`: the vCPU starts in long
//! mode at the ELF entry (`startup_64`), with a flat GDT, identity-mapped page tables for the first GiB and `RSI`
//! pointing at the zero page (`boot_params`). [`BootProtocol::Pvh`] is the alternative for kernels with a PVH note
//! (`XEN_ELFNOTE_PHYS32_ENTRY`, reported by linux-loader as `pvh_boot_cap`): the vCPU starts in 32-bit protected mode
//! without paging and `RBX` pointing at an `hvm_start_info`. PVH needs hardware KVM: a PVM host only runs vCPUs
//! that enter in 64-bit supervisor mode.
//!
//! Low memory layout (guest physical):
//!
//! | address | what |
//! |---|---|
//! | `0x500` | GDT ([`GDT_ADDR`]): null, code, data, TSS |
//! | `0x520` | IDT ([`IDT_ADDR`]): empty; the kernel installs its own |
//! | `0x6000` | PVH `hvm_start_info`, then its module list ([`PVH_INFO_ADDR`]) |
//! | `0x7000` | zero page `boot_params` ([`ZERO_PAGE_ADDR`]), or the PVH memory map |
//! | `0x8ff0` | initial stack pointer ([`BOOT_STACK_POINTER`]) |
//! | `0x9000` | PML4, then PDPT at `0xa000` and PD at `0xb000` ([`PML4_ADDR`]) |
//! | `0x20000` | kernel command line ([`CMDLINE_ADDR`], at most [`CMDLINE_MAX_SIZE`] bytes) |
//! | `0x9fc00` | EBDA: RAM below it is usable, `0x9fc00..1 MiB` is not |
//! | `1 MiB` | [`HIMEM_START`]: the kernel's `p_paddr`s start above |
//! | top of low RAM | the initrd, page aligned, below the MMIO gap |

pub mod cpu;
mod e820;
pub mod layout;
mod linux;
mod pvh;

use vm_memory::GuestAddress;

pub use cpu::{entry_regs, entry_sregs, write_boot_tables};
pub use layout::*;
pub use linux::{LoadedKernel, load_kernel};

use crate::vstate::memory::MemoryError;

/// Why a kernel could not be loaded or its entry prepared.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// Guest RAM does not reach past the fixed boot structures.
    #[error("guest memory of {size:#x} bytes is too small for the boot layout (needs at least {needed:#x})")]
    MemoryTooSmall {
        /// RAM size.
        size: u64,
        /// What the layout needs.
        needed: u64,
    },
    /// linux-loader refused the kernel image.
    #[error("cannot load the kernel image")]
    LoadKernel(#[source] linux_loader::loader::Error),
    /// PVH was asked for but the kernel has no PVH entry note.
    #[error("the kernel has no PVH entry point (XEN_ELFNOTE_PHYS32_ENTRY)")]
    NoPvhEntry,
    /// The command line is longer than the guest accepts.
    #[error("kernel command line of {len} bytes exceeds {max} bytes")]
    CmdlineTooLong {
        /// Its length with the terminating NUL.
        len: usize,
        /// [`CMDLINE_MAX_SIZE`].
        max: usize,
    },
    /// The command line could not be written.
    #[error("cannot write the kernel command line")]
    Cmdline(#[source] linux_loader::loader::Error),
    /// Reading or measuring the initrd failed.
    #[error("cannot read the initrd")]
    ReadInitrd(#[source] std::io::Error),
    /// The initrd does not fit between the kernel and the top of low memory.
    #[error("initrd of {size:#x} bytes does not fit between the kernel end {kernel_end:#x} and {low_end:#x}")]
    InitrdTooLarge {
        /// Its size.
        size: u64,
        /// Where the kernel ends.
        kernel_end: u64,
        /// The end of low RAM.
        low_end: u64,
    },
    /// More e820 entries than the zero page holds.
    #[error("the e820 map is full")]
    E820Full,
    /// Writing the zero page or the PVH structures failed.
    #[error("cannot write the boot parameters")]
    BootParams(#[source] linux_loader::configurator::Error),
    /// Writing the GDT, IDT, page tables or the initrd to guest memory failed.
    #[error("cannot write boot structures to guest memory")]
    Memory(#[source] MemoryError),
}

/// How the vCPU enters the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum BootProtocol {
    /// Linux's 64-bit boot protocol: long mode, paging on, `RSI` = zero page. The default; the only entry a PVM host
    /// can run.
    #[default]
    Linux64,
    /// PVH: 32-bit protected mode, paging off, `RBX` = `hvm_start_info`. Hardware KVM only.
    Pvh,
}

/// Where and how the boot vCPU starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryPoint {
    /// The protocol, which decides the CPU mode and the register carrying `boot_info`.
    pub protocol: BootProtocol,
    /// First instruction.
    pub entry: GuestAddress,
    /// The zero page (`RSI`, 64-bit protocol) or the `hvm_start_info` (`RBX`, PVH); 0 for bare test guests.
    pub boot_info: GuestAddress,
}

impl EntryPoint {
    /// Long mode at `entry` with no boot information: for hand-written guests on top of [`write_boot_tables`].
    pub fn long_mode(entry: GuestAddress) -> EntryPoint {
        EntryPoint { protocol: BootProtocol::Linux64, entry, boot_info: GuestAddress(0) }
    }
}
