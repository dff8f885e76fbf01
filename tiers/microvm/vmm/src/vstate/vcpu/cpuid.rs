//! The CPUID a vCPU sees: `KVM_GET_SUPPORTED_CPUID` with a documented mask on top.
//!
//! KVM's supported list already hides what it cannot virtualise; the mask below makes the rest consistent for a
//! sandbox guest: it says it is a guest, hides host power/debug/perf features, and describes a one-socket topology
//! with one thread per core and APIC ID = vCPU index. [`CPUID_RULES`] is the bit mask, one rule per line;
//! [`build_cpuid`] also computes the per-vCPU fields:
//!
//! | leaf | register, bits | value | why |
//! |---|---|---|---|
//! | `0x1` | `EBX[31:24]` | vCPU index | the initial APIC ID; the in-kernel LAPIC of vCPU *n* has ID *n* |
//! | `0x1` | `EBX[23:16]` | vCPU count | logical processors per package |
//! | `0x1` | `EBX[15:8]` | 8 | `CLFLUSH` line size in 8-byte units (64 bytes) |
//! | `0x1` | `EDX[28]` (HTT) | count > 1 | `EBX[23:16]` is only meaningful with HTT set |
//! | `0x1` | `ECX[24]` (TSC-deadline) | `KVM_CAP_TSC_DEADLINE_TIMER` | KVM emulates the mode but leaves the bit out of the supported list |
//! | `0xb` | subleaf 0, 1; EDX all | SMT level (1 thread), core level (count); x2APIC ID | x2APIC topology matches leaf 1 |
//! | `0x8000_0008` | `ECX[7:0]`, `ECX[15:12]` (AMD) | count − 1, 0 | cores per package on AMD; legacy APIC-ID sizing |
//! | `0xa` | all | 0 | no virtual PMU: perf counters are not part of the sandbox |
//! | `0xd` | all subleaves (with [`CpuidProfile::PvmCompat`]) | 0 | no XSAVE state components once XSAVE is hidden |

use kvm_bindings::{CpuId, kvm_cpuid_entry2};

use super::VcpuError;

/// Which register of a CPUID leaf a rule touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuidRegister {
    /// EAX.
    Eax,
    /// EBX.
    Ebx,
    /// ECX.
    Ecx,
    /// EDX.
    Edx,
}

/// What a rule does to its bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuidAction {
    /// Clear them: the guest must not use the feature.
    Clear,
    /// Set them: the guest may rely on it.
    Set,
}

/// A set of rules to apply on top of KVM's supported CPUID.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum CpuidProfile {
    /// The rules every guest gets.
    #[default]
    Standard,
    /// Standard plus hiding CX16, the XSAVE family and AVX, for experiments on PVM hosts: there a stock Linux stopped
    /// in the instruction emulator on `lock cmpxchg16b`, and with CX16 hidden, on `xrstor`. Without XSAVE the kernel
    /// manages FPU state with `fxsave`/`fxrstor`, and every AVX level needs XSAVE-managed state.
    PvmCompat,
}

/// One line of the mask: at `leaf`/`subleaf` (every subleaf when `None`), in `register`, `action` the `bits`, for
/// every guest (`only` = `None`) or only with one profile.
#[derive(Debug, Clone, Copy)]
pub struct CpuidRule {
    /// The leaf (EAX in).
    pub leaf: u32,
    /// The subleaf (ECX in); `None` matches all.
    pub subleaf: Option<u32>,
    /// The register.
    pub register: CpuidRegister,
    /// The bits, as a mask.
    pub bits: u32,
    /// Clear or set.
    pub action: CpuidAction,
    /// Profile the rule belongs to (`None`: all).
    pub only: Option<CpuidProfile>,
    /// Why.
    pub why: &'static str,
}

const fn rule(leaf: u32, register: CpuidRegister, bits: u32, action: CpuidAction, why: &'static str) -> CpuidRule {
    CpuidRule { leaf, subleaf: None, register, bits, action, only: None, why }
}

const fn pvm(leaf: u32, subleaf: u32, register: CpuidRegister, bits: u32, why: &'static str) -> CpuidRule {
    CpuidRule {
        leaf,
        subleaf: Some(subleaf),
        register,
        bits,
        action: CpuidAction::Clear,
        only: Some(CpuidProfile::PvmCompat),
        why,
    }
}

const fn bit(n: u32) -> u32 {
    1 << n
}

use CpuidAction::{Clear, Set};
use CpuidRegister::{Ebx, Ecx, Edx};

/// The static part of the mask, applied in order.
pub const CPUID_RULES: &[CpuidRule] = &[
    rule(0x1, Ecx, bit(31), Set, "hypervisor present: the guest uses kvmclock and paravirt ops, skips microcode"),
    rule(0x1, Ecx, bit(3), Clear, "MONITOR/MWAIT: not passed through; an idle guest must HLT and yield the core"),
    rule(0x1, Ecx, bit(5), Clear, "VMX: no nested virtualisation inside a sandbox"),
    rule(0x1, Ecx, bit(2) | bit(4) | bit(15), Clear, "DTES64, DS-CPL, PDCM: host debug store and perf capabilities"),
    rule(0x1, Ecx, bit(7) | bit(8), Clear, "EIST, TM2: power and thermal control belong to the host"),
    rule(0x1, Ecx, bit(14), Clear, "xTPR update control: not virtualised"),
    rule(0x1, Edx, bit(22) | bit(29), Clear, "ACPI thermal monitor, TM: power and thermal control belong to the host"),
    rule(0x6, CpuidRegister::Eax, bit(1), Clear, "Turbo Boost: host power management"),
    rule(0x6, Ecx, bit(3), Clear, "energy/performance bias MSR: host power management"),
    pvm(0x1, 0, Ecx, bit(13), "CMPXCHG16B: PVM's emulator stopped a stock Linux on lock cmpxchg16b"),
    pvm(0x1, 0, Ecx, bit(26) | bit(27), "XSAVE, OSXSAVE: with CX16 hidden, Linux stopped on xrstor under PVM"),
    pvm(0x1, 0, Ecx, bit(28) | bit(29) | bit(12), "AVX, F16C, FMA: need XSAVE-managed YMM state"),
    pvm(0x7, 0, Ebx, bit(5), "AVX2: needs XSAVE-managed state"),
    pvm(
        0x7,
        0,
        Ebx,
        bit(16) | bit(17) | bit(21) | bit(26) | bit(27) | bit(28) | bit(30) | bit(31),
        "AVX-512 F/DQ/IFMA/PF/ER/CD/BW/VL: need XSAVE-managed ZMM state",
    ),
    pvm(
        0x7,
        0,
        Ecx,
        bit(1) | bit(6) | bit(8) | bit(9) | bit(10) | bit(11) | bit(12) | bit(14),
        "AVX-512 VBMI/VBMI2, GFNI/VAES/VPCLMULQDQ (VEX forms), VNNI, BITALG, VPOPCNTDQ",
    ),
    pvm(
        0x7,
        0,
        Edx,
        bit(2) | bit(3) | bit(8) | bit(22) | bit(23) | bit(24) | bit(25),
        "AVX-512 4VNNIW/4FMAPS/VP2INTERSECT, AMX: XSAVE-managed state",
    ),
    pvm(0x7, 1, CpuidRegister::Eax, bit(4) | bit(5), "AVX-VNNI, AVX512-BF16: XSAVE-managed state"),
];

/// Topology of the guest, for the computed fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuidTopology {
    /// This vCPU's index, which is also its APIC ID.
    pub index: u8,
    /// How many vCPUs the guest has.
    pub count: u8,
    /// Whether KVM emulates the LAPIC's TSC-deadline mode.
    pub tsc_deadline_timer: bool,
}

fn register(entry: &mut kvm_cpuid_entry2, register: CpuidRegister) -> &mut u32 {
    match register {
        CpuidRegister::Eax => &mut entry.eax,
        CpuidRegister::Ebx => &mut entry.ebx,
        CpuidRegister::Ecx => &mut entry.ecx,
        CpuidRegister::Edx => &mut entry.edx,
    }
}

fn is_amd(cpuid: &CpuId) -> bool {
    cpuid
        .as_slice()
        .iter()
        .any(|e| e.function == 0 && [e.ebx, e.edx, e.ecx].iter().flat_map(|r| r.to_le_bytes()).eq(*b"AuthenticAMD"))
}

/// KVM's supported CPUID with [`CPUID_RULES`] (for `profile`) and the computed fields of `topology` applied.
pub fn build_cpuid(supported: &CpuId, profile: CpuidProfile, topology: CpuidTopology) -> Result<CpuId, VcpuError> {
    if topology.count == 0 || topology.index >= topology.count {
        return Err(VcpuError::Topology { index: topology.index, count: topology.count });
    }
    let mut cpuid = supported.clone();
    let amd = is_amd(&cpuid);
    let apic_id = u32::from(topology.index);
    let count = u32::from(topology.count);

    let has_leaf_b_1 = cpuid.as_slice().iter().any(|e| e.function == 0xb && e.index == 1);
    if !has_leaf_b_1 && let Some(template) = cpuid.as_slice().iter().find(|e| e.function == 0xb).copied() {
        cpuid.push(kvm_cpuid_entry2 { index: 1, ..template }).map_err(|_| VcpuError::CpuidFull)?;
    }

    for entry in cpuid.as_mut_slice() {
        for rule in CPUID_RULES {
            let applies = rule.leaf == entry.function
                && rule.subleaf.is_none_or(|s| s == entry.index)
                && rule.only.is_none_or(|p| p == profile);
            if applies {
                let reg = register(entry, rule.register);
                match rule.action {
                    CpuidAction::Clear => *reg &= !rule.bits,
                    CpuidAction::Set => *reg |= rule.bits,
                }
            }
        }
        match entry.function {
            0x1 => {
                entry.ebx = (entry.ebx & 0xff) | (apic_id << 24) | (count << 16) | (8 << 8);
                entry.edx = if count > 1 { entry.edx | bit(28) } else { entry.edx & !bit(28) };
                if topology.tsc_deadline_timer {
                    entry.ecx |= bit(24);
                }
            }
            0xa => (entry.eax, entry.ebx, entry.ecx, entry.edx) = (0, 0, 0, 0),
            0xb => {
                let (eax, ebx, ecx) = match entry.index {
                    0 => (0, 1, 1 << 8),
                    1 => (u32::BITS - (count - 1).leading_zeros(), count, 1 | (2 << 8)),
                    n => (0, 0, n & 0xff),
                };
                (entry.eax, entry.ebx, entry.ecx, entry.edx) = (eax, ebx, ecx, apic_id);
            }
            0xd if profile == CpuidProfile::PvmCompat => (entry.eax, entry.ebx, entry.ecx, entry.edx) = (0, 0, 0, 0),
            0x8000_0008 if amd => entry.ecx = (entry.ecx & !0xf0ff) | (count - 1),
            _ => {}
        }
    }
    Ok(cpuid)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(function: u32, index: u32, eax: u32, ebx: u32, ecx: u32, edx: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 { function, index, eax, ebx, ecx, edx, ..Default::default() }
    }

    fn host() -> CpuId {
        CpuId::from_entries(&[
            entry(0, 0, 0x1c, u32::from_le_bytes(*b"Auth"), u32::from_le_bytes(*b"cAMD"), u32::from_le_bytes(*b"enti")),
            entry(1, 0, 0x00b0_0f21, 0x0102_0800, 0x8120_2000 | bit(3) | bit(26) | bit(28), 0x078b_fbff),
            entry(0xa, 0, 7, 7, 7, 7),
            entry(0xb, 0, 0, 0, 0, 1),
            entry(0xd, 0, 0xe7, 0x980, 0x980, 0),
            entry(0x8000_0008, 0, 0x3030, 0, 0x7001, 0),
        ])
        .expect("cpuid")
    }

    fn find(cpuid: &CpuId, function: u32, index: u32) -> kvm_cpuid_entry2 {
        *cpuid.as_slice().iter().find(|e| e.function == function && e.index == index).expect("leaf")
    }

    #[test]
    fn standard_mask_sets_hypervisor_and_the_apic_id() {
        let topology = CpuidTopology { index: 2, count: 3, tsc_deadline_timer: true };
        let cpuid = build_cpuid(&host(), CpuidProfile::Standard, topology).expect("cpuid");
        let leaf1 = find(&cpuid, 1, 0);
        assert_ne!(leaf1.ecx & bit(31), 0, "hypervisor");
        assert_eq!(leaf1.ecx & bit(3), 0, "monitor");
        assert_ne!(leaf1.ecx & bit(24), 0, "tsc deadline");
        assert_ne!(leaf1.ecx & bit(13), 0, "cx16 kept");
        assert_eq!(leaf1.ebx >> 24, 2, "apic id");
        assert_eq!((leaf1.ebx >> 16) & 0xff, 3, "count");
        assert_ne!(leaf1.edx & bit(28), 0, "htt");
        assert_eq!(find(&cpuid, 0xa, 0).eax, 0, "no pmu");
        assert_eq!(find(&cpuid, 0xb, 0).edx, 2);
        assert_eq!((find(&cpuid, 0xb, 1).eax, find(&cpuid, 0xb, 1).ebx), (2, 3));
        assert_eq!(find(&cpuid, 0x8000_0008, 0).ecx & 0xff, 2);
        assert_eq!(find(&cpuid, 0xd, 0).eax, 0xe7, "xsave leaf kept");
    }

    #[test]
    fn pvm_profile_hides_cx16_xsave_and_avx() {
        let topology = CpuidTopology { index: 0, count: 1, tsc_deadline_timer: false };
        let cpuid = build_cpuid(&host(), CpuidProfile::PvmCompat, topology).expect("cpuid");
        let leaf1 = find(&cpuid, 1, 0);
        assert_eq!(leaf1.ecx & (bit(13) | bit(26) | bit(28)), 0);
        assert_eq!(leaf1.edx & bit(28), 0, "no htt with one vCPU");
        assert_eq!(find(&cpuid, 0xd, 0).eax, 0);
    }

    #[test]
    fn an_index_outside_the_topology_is_refused() {
        let topology = CpuidTopology { index: 1, count: 1, tsc_deadline_timer: false };
        assert!(matches!(
            build_cpuid(&host(), CpuidProfile::Standard, topology),
            Err(VcpuError::Topology { index: 1, count: 1 })
        ));
    }
}
