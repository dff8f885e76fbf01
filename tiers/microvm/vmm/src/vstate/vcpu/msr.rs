//! Model-specific registers at boot (Firecracker's `create_boot_msr_entries`).

use kvm_bindings::kvm_msr_entry;

/// Time-stamp counter.
pub const MSR_IA32_TSC: u32 = 0x10;
/// `SYSENTER` code segment.
pub const MSR_IA32_SYSENTER_CS: u32 = 0x174;
/// `SYSENTER` stack pointer.
pub const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
/// `SYSENTER` entry point.
pub const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
/// Miscellaneous feature enables.
pub const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
/// `MISC_ENABLE` bit 0: fast string operations (`rep movs`/`stos` in cache-line chunks).
pub const MSR_IA32_MISC_ENABLE_FAST_STRING: u64 = 1;
/// Default memory type for ranges no MTRR covers.
pub const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
/// `MTRRdefType`: MTRRs enabled (bit 11), default type write-back (6).
pub const MTRR_ENABLE_WRITE_BACK: u64 = (1 << 11) | 6;
/// `SYSCALL` segment selectors.
pub const MSR_STAR: u32 = 0xc000_0081;
/// 64-bit `SYSCALL` entry point.
pub const MSR_LSTAR: u32 = 0xc000_0082;
/// Compatibility-mode `SYSCALL` entry point.
pub const MSR_CSTAR: u32 = 0xc000_0083;
/// `RFLAGS` bits `SYSCALL` clears.
pub const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
/// The `GS` base `SWAPGS` swaps in.
pub const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;

/// The MSRs a vCPU starts with: system-call entry points cleared (the kernel sets its own), TSC at 0, fast strings
/// on, and MTRRs enabled with write-back as the default type (without it the guest would run with caching off).
pub fn boot_msr_entries() -> Vec<kvm_msr_entry> {
    let entry = |index, data| kvm_msr_entry { index, data, ..Default::default() };
    vec![
        entry(MSR_IA32_SYSENTER_CS, 0),
        entry(MSR_IA32_SYSENTER_ESP, 0),
        entry(MSR_IA32_SYSENTER_EIP, 0),
        entry(MSR_STAR, 0),
        entry(MSR_CSTAR, 0),
        entry(MSR_KERNEL_GS_BASE, 0),
        entry(MSR_SYSCALL_MASK, 0),
        entry(MSR_LSTAR, 0),
        entry(MSR_IA32_TSC, 0),
        entry(MSR_IA32_MISC_ENABLE, MSR_IA32_MISC_ENABLE_FAST_STRING),
        entry(MSR_MTRR_DEF_TYPE, MTRR_ENABLE_WRITE_BACK),
    ]
}
