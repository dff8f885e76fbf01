//! A vCPU's complete architectural state as plain serde data, and its save/restore.
//!
//! Each KVM structure has a mirror here with the same fields (padding dropped), so a snapshot is readable and
//! versionable without depending on kvm-bindings' memory layout. Restore validates sizes and counts before any
//! ioctl: a corrupt snapshot is a typed error, never a short read or a panic.

use kvm_bindings::{
    CpuId, KVM_MAX_CPUID_ENTRIES, Msrs, kvm_cpuid_entry2, kvm_debugregs, kvm_dtable, kvm_fpu, kvm_lapic_state,
    kvm_mp_state, kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs, kvm_vcpu_events, kvm_xcr, kvm_xcrs, kvm_xsave,
};
use serde::{Deserialize, Serialize};

use super::{Vcpu, VcpuError, kvm_error};

/// Size of the LAPIC register page.
pub const LAPIC_STATE_SIZE: usize = 1024;
/// Size of the legacy XSAVE area in 32-bit words (4 KiB); a larger area comes from `KVM_GET_XSAVE2`.
pub const XSAVE_REGION_WORDS: usize = 1024;
/// Most XCRs KVM transfers.
pub const MAX_XCRS: usize = 16;
/// Most MSRs accepted in a saved state (KVM's own list is a few dozen).
pub const MAX_SAVED_MSRS: usize = 1024;
/// Largest XSAVE area accepted (64 KiB; AMX needs about 11 KiB).
pub const MAX_XSAVE_WORDS: usize = 16 * 1024;

/// General-purpose registers, `RIP` and `RFLAGS`.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Regs {
    pub rax: u64,
    pub rbx: u64,
    pub rcx: u64,
    pub rdx: u64,
    pub rsi: u64,
    pub rdi: u64,
    pub rsp: u64,
    pub rbp: u64,
    pub r8: u64,
    pub r9: u64,
    pub r10: u64,
    pub r11: u64,
    pub r12: u64,
    pub r13: u64,
    pub r14: u64,
    pub r15: u64,
    pub rip: u64,
    pub rflags: u64,
}

/// A segment register, hidden part included.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Segment {
    pub base: u64,
    pub limit: u32,
    pub selector: u16,
    pub type_: u8,
    pub present: u8,
    pub dpl: u8,
    pub db: u8,
    pub s: u8,
    pub l: u8,
    pub g: u8,
    pub avl: u8,
    pub unusable: u8,
}

/// GDTR or IDTR.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DescriptorTable {
    pub base: u64,
    pub limit: u16,
}

/// Segment, descriptor-table and control registers, `EFER`, `APIC_BASE` and the pending-interrupt bitmap.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sregs {
    pub cs: Segment,
    pub ds: Segment,
    pub es: Segment,
    pub fs: Segment,
    pub gs: Segment,
    pub ss: Segment,
    pub tr: Segment,
    pub ldt: Segment,
    pub gdt: DescriptorTable,
    pub idt: DescriptorTable,
    pub cr0: u64,
    pub cr2: u64,
    pub cr3: u64,
    pub cr4: u64,
    pub cr8: u64,
    pub efer: u64,
    pub apic_base: u64,
    pub interrupt_bitmap: [u64; 4],
}

/// x87 and SSE state (`KVM_GET_FPU`).
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fpu {
    pub fpr: [[u8; 16]; 8],
    pub fcw: u16,
    pub fsw: u16,
    pub ftwx: u8,
    pub last_opcode: u16,
    pub last_ip: u64,
    pub last_dp: u64,
    pub xmm: [[u8; 16]; 16],
    pub mxcsr: u32,
}

/// Debug registers.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DebugRegs {
    pub db: [u64; 4],
    pub dr6: u64,
    pub dr7: u64,
    pub flags: u64,
}

/// Pending and injected exceptions, interrupts, NMIs and SMIs (`KVM_GET_VCPU_EVENTS`).
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VcpuEvents {
    pub exception_injected: u8,
    pub exception_nr: u8,
    pub exception_has_error_code: u8,
    pub exception_pending: u8,
    pub exception_error_code: u32,
    pub interrupt_injected: u8,
    pub interrupt_nr: u8,
    pub interrupt_soft: u8,
    pub interrupt_shadow: u8,
    pub nmi_injected: u8,
    pub nmi_pending: u8,
    pub nmi_masked: u8,
    pub sipi_vector: u32,
    /// `KVM_VCPUEVENT_VALID_*`: which of the optional fields KVM filled (and restore passes back).
    pub flags: u32,
    pub smi_smm: u8,
    pub smi_pending: u8,
    pub smi_smm_inside_nmi: u8,
    pub smi_latched_init: u8,
    pub triple_fault_pending: u8,
    pub exception_has_payload: u8,
    pub exception_payload: u64,
}

/// One CPUID leaf as set on the vCPU.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpuidEntry {
    pub function: u32,
    pub index: u32,
    pub flags: u32,
    pub eax: u32,
    pub ebx: u32,
    pub ecx: u32,
    pub edx: u32,
}

/// One MSR.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MsrEntry {
    pub index: u32,
    pub data: u64,
}

/// One extended control register (`XCR0`).
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Xcr {
    pub xcr: u32,
    pub value: u64,
}

/// Everything needed to continue a vCPU elsewhere: a new vCPU of a new VM over the same memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VcpuState {
    /// The CPUID the vCPU ran with (set first on restore: MSRs and XSAVE are checked against it).
    pub cpuid: Vec<CpuidEntry>,
    /// `KVM_MP_STATE_*` (runnable, halted, ...).
    pub mp_state: u32,
    /// General registers.
    pub regs: Regs,
    /// Special registers.
    pub sregs: Sregs,
    /// x87/SSE state.
    pub fpu: Fpu,
    /// The XSAVE area in 32-bit words, when KVM supports XSAVE.
    pub xsave: Option<Vec<u32>>,
    /// Extended control registers, when KVM supports them.
    pub xcrs: Option<Vec<Xcr>>,
    /// Debug registers.
    pub debug_regs: DebugRegs,
    /// The LAPIC register page, when the VM has the in-kernel irqchip.
    pub lapic: Option<Vec<u8>>,
    /// MSRs from KVM's save list that could be read.
    pub msrs: Vec<MsrEntry>,
    /// Pending events.
    pub events: VcpuEvents,
    /// TSC frequency in kHz, when KVM reports it.
    pub tsc_khz: Option<u32>,
}

impl From<kvm_regs> for Regs {
    fn from(r: kvm_regs) -> Regs {
        Regs {
            rax: r.rax,
            rbx: r.rbx,
            rcx: r.rcx,
            rdx: r.rdx,
            rsi: r.rsi,
            rdi: r.rdi,
            rsp: r.rsp,
            rbp: r.rbp,
            r8: r.r8,
            r9: r.r9,
            r10: r.r10,
            r11: r.r11,
            r12: r.r12,
            r13: r.r13,
            r14: r.r14,
            r15: r.r15,
            rip: r.rip,
            rflags: r.rflags,
        }
    }
}

impl From<Regs> for kvm_regs {
    fn from(r: Regs) -> kvm_regs {
        kvm_regs {
            rax: r.rax,
            rbx: r.rbx,
            rcx: r.rcx,
            rdx: r.rdx,
            rsi: r.rsi,
            rdi: r.rdi,
            rsp: r.rsp,
            rbp: r.rbp,
            r8: r.r8,
            r9: r.r9,
            r10: r.r10,
            r11: r.r11,
            r12: r.r12,
            r13: r.r13,
            r14: r.r14,
            r15: r.r15,
            rip: r.rip,
            rflags: r.rflags,
        }
    }
}

impl From<kvm_segment> for Segment {
    fn from(s: kvm_segment) -> Segment {
        Segment {
            base: s.base,
            limit: s.limit,
            selector: s.selector,
            type_: s.type_,
            present: s.present,
            dpl: s.dpl,
            db: s.db,
            s: s.s,
            l: s.l,
            g: s.g,
            avl: s.avl,
            unusable: s.unusable,
        }
    }
}

impl From<Segment> for kvm_segment {
    fn from(s: Segment) -> kvm_segment {
        kvm_segment {
            base: s.base,
            limit: s.limit,
            selector: s.selector,
            type_: s.type_,
            present: s.present,
            dpl: s.dpl,
            db: s.db,
            s: s.s,
            l: s.l,
            g: s.g,
            avl: s.avl,
            unusable: s.unusable,
            padding: 0,
        }
    }
}

impl From<kvm_dtable> for DescriptorTable {
    fn from(t: kvm_dtable) -> DescriptorTable {
        DescriptorTable { base: t.base, limit: t.limit }
    }
}

impl From<DescriptorTable> for kvm_dtable {
    fn from(t: DescriptorTable) -> kvm_dtable {
        kvm_dtable { base: t.base, limit: t.limit, padding: [0; 3] }
    }
}

impl From<kvm_sregs> for Sregs {
    fn from(s: kvm_sregs) -> Sregs {
        Sregs {
            cs: s.cs.into(),
            ds: s.ds.into(),
            es: s.es.into(),
            fs: s.fs.into(),
            gs: s.gs.into(),
            ss: s.ss.into(),
            tr: s.tr.into(),
            ldt: s.ldt.into(),
            gdt: s.gdt.into(),
            idt: s.idt.into(),
            cr0: s.cr0,
            cr2: s.cr2,
            cr3: s.cr3,
            cr4: s.cr4,
            cr8: s.cr8,
            efer: s.efer,
            apic_base: s.apic_base,
            interrupt_bitmap: s.interrupt_bitmap,
        }
    }
}

impl From<Sregs> for kvm_sregs {
    fn from(s: Sregs) -> kvm_sregs {
        kvm_sregs {
            cs: s.cs.into(),
            ds: s.ds.into(),
            es: s.es.into(),
            fs: s.fs.into(),
            gs: s.gs.into(),
            ss: s.ss.into(),
            tr: s.tr.into(),
            ldt: s.ldt.into(),
            gdt: s.gdt.into(),
            idt: s.idt.into(),
            cr0: s.cr0,
            cr2: s.cr2,
            cr3: s.cr3,
            cr4: s.cr4,
            cr8: s.cr8,
            efer: s.efer,
            apic_base: s.apic_base,
            interrupt_bitmap: s.interrupt_bitmap,
        }
    }
}

impl From<kvm_fpu> for Fpu {
    fn from(f: kvm_fpu) -> Fpu {
        Fpu {
            fpr: f.fpr,
            fcw: f.fcw,
            fsw: f.fsw,
            ftwx: f.ftwx,
            last_opcode: f.last_opcode,
            last_ip: f.last_ip,
            last_dp: f.last_dp,
            xmm: f.xmm,
            mxcsr: f.mxcsr,
        }
    }
}

impl From<Fpu> for kvm_fpu {
    fn from(f: Fpu) -> kvm_fpu {
        kvm_fpu {
            fpr: f.fpr,
            fcw: f.fcw,
            fsw: f.fsw,
            ftwx: f.ftwx,
            last_opcode: f.last_opcode,
            last_ip: f.last_ip,
            last_dp: f.last_dp,
            xmm: f.xmm,
            mxcsr: f.mxcsr,
            ..Default::default()
        }
    }
}

impl From<kvm_debugregs> for DebugRegs {
    fn from(d: kvm_debugregs) -> DebugRegs {
        DebugRegs { db: d.db, dr6: d.dr6, dr7: d.dr7, flags: d.flags }
    }
}

impl From<DebugRegs> for kvm_debugregs {
    fn from(d: DebugRegs) -> kvm_debugregs {
        kvm_debugregs { db: d.db, dr6: d.dr6, dr7: d.dr7, flags: d.flags, ..Default::default() }
    }
}

impl From<kvm_vcpu_events> for VcpuEvents {
    fn from(e: kvm_vcpu_events) -> VcpuEvents {
        VcpuEvents {
            exception_injected: e.exception.injected,
            exception_nr: e.exception.nr,
            exception_has_error_code: e.exception.has_error_code,
            exception_pending: e.exception.pending,
            exception_error_code: e.exception.error_code,
            interrupt_injected: e.interrupt.injected,
            interrupt_nr: e.interrupt.nr,
            interrupt_soft: e.interrupt.soft,
            interrupt_shadow: e.interrupt.shadow,
            nmi_injected: e.nmi.injected,
            nmi_pending: e.nmi.pending,
            nmi_masked: e.nmi.masked,
            sipi_vector: e.sipi_vector,
            flags: e.flags,
            smi_smm: e.smi.smm,
            smi_pending: e.smi.pending,
            smi_smm_inside_nmi: e.smi.smm_inside_nmi,
            smi_latched_init: e.smi.latched_init,
            triple_fault_pending: e.triple_fault.pending,
            exception_has_payload: e.exception_has_payload,
            exception_payload: e.exception_payload,
        }
    }
}

impl From<VcpuEvents> for kvm_vcpu_events {
    fn from(e: VcpuEvents) -> kvm_vcpu_events {
        let mut k = kvm_vcpu_events::default();
        k.exception.injected = e.exception_injected;
        k.exception.nr = e.exception_nr;
        k.exception.has_error_code = e.exception_has_error_code;
        k.exception.pending = e.exception_pending;
        k.exception.error_code = e.exception_error_code;
        k.interrupt.injected = e.interrupt_injected;
        k.interrupt.nr = e.interrupt_nr;
        k.interrupt.soft = e.interrupt_soft;
        k.interrupt.shadow = e.interrupt_shadow;
        k.nmi.injected = e.nmi_injected;
        k.nmi.pending = e.nmi_pending;
        k.nmi.masked = e.nmi_masked;
        k.sipi_vector = e.sipi_vector;
        k.flags = e.flags;
        k.smi.smm = e.smi_smm;
        k.smi.pending = e.smi_pending;
        k.smi.smm_inside_nmi = e.smi_smm_inside_nmi;
        k.smi.latched_init = e.smi_latched_init;
        k.triple_fault.pending = e.triple_fault_pending;
        k.exception_has_payload = e.exception_has_payload;
        k.exception_payload = e.exception_payload;
        k
    }
}

impl From<&kvm_cpuid_entry2> for CpuidEntry {
    fn from(e: &kvm_cpuid_entry2) -> CpuidEntry {
        CpuidEntry {
            function: e.function,
            index: e.index,
            flags: e.flags,
            eax: e.eax,
            ebx: e.ebx,
            ecx: e.ecx,
            edx: e.edx,
        }
    }
}

impl From<&CpuidEntry> for kvm_cpuid_entry2 {
    fn from(e: &CpuidEntry) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function: e.function,
            index: e.index,
            flags: e.flags,
            eax: e.eax,
            ebx: e.ebx,
            ecx: e.ecx,
            edx: e.edx,
            ..Default::default()
        }
    }
}

fn invalid(what: &'static str) -> VcpuError {
    VcpuError::InvalidState(what)
}

impl VcpuState {
    /// Checks counts and sizes against what KVM accepts, before anything is written to a vCPU.
    pub fn validate(&self) -> Result<(), VcpuError> {
        if self.cpuid.is_empty() || self.cpuid.len() > KVM_MAX_CPUID_ENTRIES {
            return Err(invalid("CPUID entry count out of range"));
        }
        if self.mp_state > kvm_bindings::KVM_MP_STATE_SUSPENDED {
            return Err(invalid("unknown MP state"));
        }
        if let Some(xsave) = &self.xsave
            && (xsave.len() < XSAVE_REGION_WORDS || xsave.len() > MAX_XSAVE_WORDS)
        {
            return Err(invalid("XSAVE area size out of range"));
        }
        if self.xcrs.as_ref().is_some_and(|x| x.len() > MAX_XCRS) {
            return Err(invalid("more than 16 XCRs"));
        }
        if self.lapic.as_ref().is_some_and(|l| l.len() != LAPIC_STATE_SIZE) {
            return Err(invalid("LAPIC page is not 1024 bytes"));
        }
        if self.msrs.len() > MAX_SAVED_MSRS {
            return Err(invalid("too many MSRs"));
        }
        Ok(())
    }
}

impl Vcpu {
    /// Saves the vCPU's state. The vCPU must not be running (it is borrowed, so it cannot be on another thread).
    /// `KVM_GET_MP_STATE` goes first: it makes KVM process pending APIC events, which may change everything else.
    pub fn save_state(&self) -> Result<VcpuState, VcpuError> {
        let mp_state = self.fd.get_mp_state().map_err(kvm_error("KVM_GET_MP_STATE"))?.mp_state;
        let regs = self.fd.get_regs().map_err(kvm_error("KVM_GET_REGS"))?.into();
        let sregs = self.fd.get_sregs().map_err(kvm_error("KVM_GET_SREGS"))?.into();
        let fpu = self.fd.get_fpu().map_err(kvm_error("KVM_GET_FPU"))?.into();
        let xsave = if self.caps.xsave { Some(self.get_xsave()?) } else { None };
        let xcrs = if self.caps.xcrs {
            let x = self.fd.get_xcrs().map_err(kvm_error("KVM_GET_XCRS"))?;
            let n = usize::try_from(x.nr_xcrs).unwrap_or(usize::MAX).min(MAX_XCRS);
            Some(x.xcrs[..n].iter().map(|x| Xcr { xcr: x.xcr, value: x.value }).collect())
        } else {
            None
        };
        let debug_regs = self.fd.get_debug_regs().map_err(kvm_error("KVM_GET_DEBUGREGS"))?.into();
        let lapic = if self.irqchip {
            let l = self.fd.get_lapic().map_err(kvm_error("KVM_GET_LAPIC"))?;
            Some(l.regs.iter().map(|b| *b as u8).collect())
        } else {
            None
        };
        let msrs = self.get_msrs()?;
        let events = self.fd.get_vcpu_events().map_err(kvm_error("KVM_GET_VCPU_EVENTS"))?.into();
        let cpuid = self
            .fd
            .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
            .map_err(kvm_error("KVM_GET_CPUID2"))?
            .as_slice()
            .iter()
            .map(CpuidEntry::from)
            .collect();
        let tsc_khz = if self.caps.tsc_khz { self.fd.get_tsc_khz().ok() } else { None };
        Ok(VcpuState { cpuid, mp_state, regs, sregs, fpu, xsave, xcrs, debug_regs, lapic, msrs, events, tsc_khz })
    }

    /// Restores a state saved by [`Vcpu::save_state`] into this (fresh, unconfigured) vCPU, after validating it.
    /// The LAPIC is restored only when both the state and this VM have one.
    pub fn restore_state(&self, state: &VcpuState) -> Result<(), VcpuError> {
        state.validate()?;
        let entries: Vec<kvm_cpuid_entry2> = state.cpuid.iter().map(kvm_cpuid_entry2::from).collect();
        let cpuid = CpuId::from_entries(&entries).map_err(|_| VcpuError::CpuidFull)?;
        self.fd.set_cpuid2(&cpuid).map_err(kvm_error("KVM_SET_CPUID2"))?;
        self.fd.set_mp_state(kvm_mp_state { mp_state: state.mp_state }).map_err(kvm_error("KVM_SET_MP_STATE"))?;
        self.fd.set_regs(&state.regs.into()).map_err(kvm_error("KVM_SET_REGS"))?;
        self.fd.set_sregs(&state.sregs.into()).map_err(kvm_error("KVM_SET_SREGS"))?;
        self.fd.set_fpu(&state.fpu.into()).map_err(kvm_error("KVM_SET_FPU"))?;
        if let Some(xsave) = &state.xsave
            && self.caps.xsave
        {
            self.set_xsave(xsave)?;
        }
        if let Some(xcrs) = &state.xcrs
            && self.caps.xcrs
        {
            let mut k = kvm_xcrs { nr_xcrs: xcrs.len() as u32, ..Default::default() };
            for (slot, x) in k.xcrs.iter_mut().zip(xcrs) {
                *slot = kvm_xcr { xcr: x.xcr, reserved: 0, value: x.value };
            }
            self.fd.set_xcrs(&k).map_err(kvm_error("KVM_SET_XCRS"))?;
        }
        self.fd.set_debug_regs(&state.debug_regs.into()).map_err(kvm_error("KVM_SET_DEBUGREGS"))?;
        if let Some(lapic) = &state.lapic
            && self.irqchip
        {
            let mut k = kvm_lapic_state::default();
            for (slot, b) in k.regs.iter_mut().zip(lapic) {
                *slot = *b as std::os::raw::c_char;
            }
            self.fd.set_lapic(&k).map_err(kvm_error("KVM_SET_LAPIC"))?;
        }
        self.restore_msrs(&state.msrs)?;
        self.fd.set_vcpu_events(&state.events.into()).map_err(kvm_error("KVM_SET_VCPU_EVENTS"))?;
        if let Some(khz) = state.tsc_khz
            && self.caps.tsc_khz
            && self.fd.get_tsc_khz().ok() != Some(khz)
        {
            self.fd.set_tsc_khz(khz).map_err(kvm_error("KVM_SET_TSC_KHZ"))?;
        }
        Ok(())
    }

    fn get_xsave(&self) -> Result<Vec<u32>, VcpuError> {
        let size = self.caps.xsave2_size;
        if size <= XSAVE_REGION_WORDS * 4 {
            let x = self.fd.get_xsave().map_err(kvm_error("KVM_GET_XSAVE"))?;
            return Ok(x.region.to_vec());
        }
        let extra = (size - XSAVE_REGION_WORDS * 4).div_ceil(4);
        let mut x = kvm_bindings::Xsave::new(extra).map_err(|_| invalid("XSAVE area size out of range"))?;
        // SAFETY: `x` was allocated for KVM_CAP_XSAVE2 bytes (the 4 KiB header plus `extra` words), which is the
        // most KVM_GET_XSAVE2 writes.
        unsafe { self.fd.get_xsave2(&mut x) }.map_err(kvm_error("KVM_GET_XSAVE2"))?;
        let fam = x.as_fam_struct_ref();
        Ok(fam.xsave.region.iter().chain(x.as_slice()).copied().collect())
    }

    fn set_xsave(&self, words: &[u32]) -> Result<(), VcpuError> {
        let (region, extra) = words.split_at(XSAVE_REGION_WORDS.min(words.len()));
        if extra.is_empty() {
            let mut k = kvm_xsave::default();
            k.region.copy_from_slice(region);
            // SAFETY: `k` is a whole `kvm_xsave` with no flexible part; KVM_SET_XSAVE reads only its 4 KiB region.
            return unsafe { self.fd.set_xsave(&k) }.map_err(kvm_error("KVM_SET_XSAVE"));
        }
        if XSAVE_REGION_WORDS * 4 + extra.len() * 4 > self.caps.xsave2_size.max(XSAVE_REGION_WORDS * 4) {
            return Err(invalid("XSAVE area larger than this host's"));
        }
        let mut x = kvm_bindings::Xsave::new(extra.len()).map_err(|_| invalid("XSAVE area size out of range"))?;
        // SAFETY: `as_mut_fam_struct` hands out the header; its `len` stays the value `Xsave::new` set.
        unsafe { x.as_mut_fam_struct() }.xsave.region.copy_from_slice(region);
        x.as_mut_slice().copy_from_slice(extra);
        // SAFETY: `x` holds `extra.len()` words after the header, and that size is within KVM_CAP_XSAVE2 (checked
        // above), so KVM reads only memory `x` owns.
        unsafe { self.fd.set_xsave2(&x) }.map_err(kvm_error("KVM_SET_XSAVE2"))
    }

    /// Sets the saved MSRs. KVM refuses some MSRs depending on the VM rather than the vCPU (the async-PF interrupt
    /// MSR needs an in-kernel LAPIC, for one): a refused MSR is accepted only when the new vCPU already holds the
    /// saved value, so nothing the guest set is lost silently.
    fn restore_msrs(&self, saved: &[MsrEntry]) -> Result<(), VcpuError> {
        let mut rest: Vec<kvm_msr_entry> =
            saved.iter().map(|m| kvm_msr_entry { index: m.index, data: m.data, ..Default::default() }).collect();
        while !rest.is_empty() {
            let msrs = Msrs::from_entries(&rest).map_err(|_| invalid("too many MSRs"))?;
            let written = self.fd.set_msrs(&msrs).map_err(kvm_error("KVM_SET_MSRS"))?;
            let Some(refused) = rest.get(written).copied() else { break };
            let mut probe = Msrs::from_entries(&[kvm_msr_entry { index: refused.index, ..Default::default() }])
                .map_err(|_| invalid("too many MSRs"))?;
            let read = self.fd.get_msrs(&mut probe).map_err(kvm_error("KVM_GET_MSRS"))?;
            if read != 1 || probe.as_slice().first().map(|m| m.data) != Some(refused.data) {
                return Err(VcpuError::MsrRefused(refused.index));
            }
            rest.drain(..=written);
        }
        Ok(())
    }

    /// Reads every MSR on KVM's save list; an MSR KVM refuses to read (the list covers all CPU models) is left out.
    fn get_msrs(&self) -> Result<Vec<MsrEntry>, VcpuError> {
        let mut wanted: Vec<u32> = self.msr_list.clone();
        let mut saved = Vec::with_capacity(wanted.len());
        while !wanted.is_empty() {
            let entries: Vec<kvm_msr_entry> =
                wanted.iter().map(|&index| kvm_msr_entry { index, ..Default::default() }).collect();
            let mut msrs = Msrs::from_entries(&entries).map_err(|_| invalid("too many MSRs"))?;
            let read = self.fd.get_msrs(&mut msrs).map_err(kvm_error("KVM_GET_MSRS"))?;
            saved.extend(msrs.as_slice().iter().take(read).map(|m| MsrEntry { index: m.index, data: m.data }));
            // KVM stops at the first MSR it cannot read: skip it and read on.
            wanted.drain(..(read + 1).min(wanted.len()));
        }
        Ok(saved)
    }
}
