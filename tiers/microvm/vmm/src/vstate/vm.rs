//! The KVM VM: guest memory slots, the in-kernel interrupt controllers and PIT, the clock, and irqfds.
//!
//! Teardown cost to know about: closing a VM with the in-kernel irqchip takes the kernel about 16 ms, and 8 ms more
//! with the PIT (measured on a PVM host, all of it in the kernel's close path, which waits for the devices to leave
//! the I/O buses). A VM without them closes in about 0.1 ms.

use std::sync::OnceLock;

use kvm_bindings::{
    CpuId, KVM_MAX_CPUID_ENTRIES, KVM_MEM_LOG_DIRTY_PAGES, KVM_PIT_SPEAKER_DUMMY, MsrList, kvm_clock_data,
    kvm_pit_config, kvm_userspace_memory_region,
};
use kvm_ioctls::{Cap, Kvm, VmFd};
use serde::{Deserialize, Serialize};
use vm_memory::Address;
use vmm_sys_util::eventfd::EventFd;

use crate::vstate::memory::GuestMemory;

pub mod state;

pub use state::{IoapicState, IrqchipState, PicState, PitChannelState, PitState, VmState};

/// Where KVM puts the three pages of the real-mode TSS it needs on Intel (inside the MMIO gap, never RAM).
pub const KVM_TSS_ADDRESS: u64 = 0xfffb_d000;
/// Where KVM puts the identity-map page it needs on Intel without unrestricted guests (just below the TSS).
pub const KVM_IDENTITY_MAP_ADDRESS: u64 = 0xfffb_c000;

/// Why a VM could not be created or configured.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// `/dev/kvm` could not be opened.
    #[error("cannot open /dev/kvm")]
    OpenKvm(#[source] kvm_ioctls::Error),
    /// The KVM API version is not 12.
    #[error("KVM API version {0} is not the supported version 12")]
    ApiVersion(i32),
    /// A capability the monitor relies on is missing.
    #[error("KVM lacks {0}, which the monitor needs")]
    MissingCapability(&'static str),
    /// A KVM ioctl on the VM failed.
    #[error("{op} failed")]
    Kvm {
        /// The ioctl.
        op: &'static str,
        /// Why.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// More memory regions than KVM has slots for.
    #[error("memory region {slot} exceeds KVM's {max} memory slots")]
    TooManySlots {
        /// The slot asked for.
        slot: u32,
        /// What KVM offers.
        max: usize,
    },
    /// An irqfd was asked for while the VM has no in-kernel irqchip.
    #[error("GSI {0} needs the in-kernel irqchip, which this VM was created without")]
    NoIrqchip(u32),
    /// A saved VM state was set on a VM that has the in-kernel irqchip exactly when the state has not.
    #[error("the VM's irqchip does not match the saved state's")]
    IrqchipMismatch,
}

fn kvm_error(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |source| VmError::Kvm { op, source }
}

/// The `KVM_CAP_*` facts the monitor depends on, read once per VM.
///
/// Required (a VM is refused without them): `USER_MEMORY` (memory slots), `EXT_CPUID` (`KVM_SET_CPUID2`),
/// `IMMEDIATE_EXIT` (stopping a vCPU from another thread without a race), `MP_STATE` and `VCPU_EVENTS` (complete
/// vCPU state for snapshots), `SET_TSS_ADDR` (Intel needs it before the first vCPU runs), and with the irqchip:
/// `IRQCHIP`, `PIT2`, `IRQFD`. The rest are reported and used when present.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvmCapabilities {
    /// `KVM_CAP_NR_MEMSLOTS`: how many memory slots a VM has.
    pub memory_slots: usize,
    /// `KVM_CAP_IRQCHIP`: in-kernel PIC, IOAPIC and LAPICs.
    pub irqchip: bool,
    /// `KVM_CAP_PIT2`: in-kernel PIT.
    pub pit2: bool,
    /// `KVM_CAP_IRQFD`: an eventfd raises a GSI without a trip through the monitor.
    pub irqfd: bool,
    /// `KVM_CAP_IOEVENTFD`: a guest write to an address signals an eventfd (virtio queue notifications).
    pub ioeventfd: bool,
    /// `KVM_CAP_IMMEDIATE_EXIT`: `kvm_run.immediate_exit`, for kicking a vCPU out of `KVM_RUN`.
    pub immediate_exit: bool,
    /// `KVM_CAP_XSAVE`: `KVM_GET/SET_XSAVE`.
    pub xsave: bool,
    /// `KVM_CAP_XSAVE2`: the size in bytes of the XSAVE area (0 without the cap; above 4096 with AMX).
    pub xsave2_size: usize,
    /// `KVM_CAP_XCRS`: `KVM_GET/SET_XCRS`.
    pub xcrs: bool,
    /// `KVM_CAP_ADJUST_CLOCK`: the flags `KVM_GET_CLOCK` may report (0 without the cap).
    pub adjust_clock: u32,
    /// `KVM_CAP_TSC_DEADLINE_TIMER`: the LAPIC's TSC-deadline mode is emulated (`CPUID.1:ECX[24]` may be set).
    pub tsc_deadline_timer: bool,
    /// `KVM_CAP_GET_TSC_KHZ`: the vCPU TSC frequency can be read (and is saved with the vCPU).
    pub tsc_khz: bool,
}

impl KvmCapabilities {
    /// Reads the capabilities of the host's KVM.
    pub fn probe(kvm: &Kvm) -> KvmCapabilities {
        let int = |cap| usize::try_from(kvm.check_extension_int(cap)).unwrap_or(0);
        KvmCapabilities {
            memory_slots: kvm.get_nr_memslots(),
            irqchip: kvm.check_extension(Cap::Irqchip),
            pit2: kvm.check_extension(Cap::Pit2),
            irqfd: kvm.check_extension(Cap::Irqfd),
            ioeventfd: kvm.check_extension(Cap::Ioeventfd),
            immediate_exit: kvm.check_extension(Cap::ImmediateExit),
            xsave: kvm.check_extension(Cap::Xsave),
            xsave2_size: int(Cap::Xsave2),
            xcrs: kvm.check_extension(Cap::Xcrs),
            adjust_clock: u32::try_from(kvm.check_extension_int(Cap::AdjustClock)).unwrap_or(0),
            tsc_deadline_timer: kvm.check_extension(Cap::TscDeadlineTimer),
            tsc_khz: kvm.check_extension(Cap::GetTscKhz),
        }
    }

    fn require(&self, kvm: &Kvm, irqchip: bool) -> Result<(), VmError> {
        let required = [
            (Cap::UserMemory, "KVM_CAP_USER_MEMORY"),
            (Cap::ExtCpuid, "KVM_CAP_EXT_CPUID"),
            (Cap::ImmediateExit, "KVM_CAP_IMMEDIATE_EXIT"),
            (Cap::MpState, "KVM_CAP_MP_STATE"),
            (Cap::VcpuEvents, "KVM_CAP_VCPU_EVENTS"),
            (Cap::SetTssAddr, "KVM_CAP_SET_TSS_ADDR"),
        ];
        let with_irqchip =
            [(Cap::Irqchip, "KVM_CAP_IRQCHIP"), (Cap::Pit2, "KVM_CAP_PIT2"), (Cap::Irqfd, "KVM_CAP_IRQFD")];
        let extra: &[(Cap, &'static str)] = if irqchip { &with_irqchip } else { &[] };
        for &(cap, name) in required.iter().chain(extra) {
            if !kvm.check_extension(cap) {
                return Err(VmError::MissingCapability(name));
            }
        }
        Ok(())
    }
}

/// How to create a VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmConfig {
    /// Create the in-kernel irqchip (PIC, IOAPIC, per-vCPU LAPIC) and PIT, as a Linux guest needs. Without it, `hlt`
    /// returns to the monitor as [`crate::vstate::vcpu::VcpuExit::Hlt`] (tiny test guests use that); with it, `hlt`
    /// waits in the kernel for an interrupt.
    pub irqchip: bool,
}

impl Default for VmConfig {
    fn default() -> VmConfig {
        VmConfig { irqchip: true }
    }
}

/// The KVM clock (`KVM_GET_CLOCK`), as saved with a snapshot and set on restore so guest time does not jump
/// backwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClockState {
    /// Guest kvmclock time, in nanoseconds.
    pub clock: u64,
    /// `KVM_CLOCK_*` flags as read (`KVM_CLOCK_TSC_STABLE` and others); not passed back on set.
    pub flags: u32,
}

/// A KVM virtual machine: owns the VM fd (and the `/dev/kvm` fd it came from). Dropping it destroys the VM; vCPUs
/// hold their own fds and keep the VM alive in the kernel until they are dropped too.
#[derive(Debug)]
pub struct Vm {
    kvm: Kvm,
    fd: VmFd,
    caps: KvmCapabilities,
    irqchip: bool,
    next_slot: u32,
    memory: Vec<GuestMemory>,
}

impl Vm {
    /// Opens `/dev/kvm`, checks the capabilities the monitor needs, creates the VM and sets it up: TSS and identity
    /// map addresses, and with `config.irqchip` the in-kernel irqchip and PIT (speaker port stubbed).
    pub fn new(config: &VmConfig) -> Result<Vm, VmError> {
        let kvm = Kvm::new().map_err(VmError::OpenKvm)?;
        Vm::with_kvm(kvm, config)
    }

    /// As [`Vm::new`], on an already open `/dev/kvm`.
    pub fn with_kvm(kvm: Kvm, config: &VmConfig) -> Result<Vm, VmError> {
        let version = kvm.get_api_version();
        if version != 12 {
            return Err(VmError::ApiVersion(version));
        }
        let caps = KvmCapabilities::probe(&kvm);
        caps.require(&kvm, config.irqchip)?;
        let fd = kvm.create_vm().map_err(kvm_error("KVM_CREATE_VM"))?;
        let tss = usize::try_from(KVM_TSS_ADDRESS).map_err(|_| VmError::MissingCapability("a 64-bit host"))?;
        fd.set_tss_address(tss).map_err(kvm_error("KVM_SET_TSS_ADDR"))?;
        if kvm.check_extension(Cap::SetIdentityMapAddr) {
            fd.set_identity_map_address(KVM_IDENTITY_MAP_ADDRESS).map_err(kvm_error("KVM_SET_IDENTITY_MAP_ADDR"))?;
        }
        if config.irqchip {
            fd.create_irq_chip().map_err(kvm_error("KVM_CREATE_IRQCHIP"))?;
            let pit = kvm_pit_config { flags: KVM_PIT_SPEAKER_DUMMY, ..Default::default() };
            fd.create_pit2(pit).map_err(kvm_error("KVM_CREATE_PIT2"))?;
        }
        Ok(Vm { kvm, fd, caps, irqchip: config.irqchip, next_slot: 0, memory: Vec::new() })
    }

    /// The capabilities read when the VM was created.
    pub fn capabilities(&self) -> &KvmCapabilities {
        &self.caps
    }

    /// Whether the VM has the in-kernel irqchip and PIT.
    pub fn has_irqchip(&self) -> bool {
        self.irqchip
    }

    /// The VM fd, for device code that needs ioctls this type does not wrap (ioeventfds).
    pub fn fd(&self) -> &VmFd {
        &self.fd
    }

    /// The `/dev/kvm` fd.
    pub fn kvm(&self) -> &Kvm {
        &self.kvm
    }

    /// The CPUID leaves KVM can virtualise on this host (`KVM_GET_SUPPORTED_CPUID`), before any masking. The answer
    /// is a fact of the host's KVM, so it is asked once per process: the ioctl takes about 0.3 ms, a fifth of
    /// starting a tiny guest.
    pub fn supported_cpuid(&self) -> Result<CpuId, VmError> {
        static SUPPORTED: OnceLock<CpuId> = OnceLock::new();
        if let Some(cpuid) = SUPPORTED.get() {
            return Ok(cpuid.clone());
        }
        let cpuid =
            self.kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).map_err(kvm_error("KVM_GET_SUPPORTED_CPUID"))?;
        Ok(SUPPORTED.get_or_init(|| cpuid).clone())
    }

    /// The MSRs KVM saves and restores for a vCPU (`KVM_GET_MSR_INDEX_LIST`), asked once per process.
    pub fn msr_index_list(&self) -> Result<Vec<u32>, VmError> {
        static LIST: OnceLock<Vec<u32>> = OnceLock::new();
        if let Some(list) = LIST.get() {
            return Ok(list.clone());
        }
        let list: MsrList = self.kvm.get_msr_index_list().map_err(kvm_error("KVM_GET_MSR_INDEX_LIST"))?;
        Ok(LIST.get_or_init(|| list.as_slice().to_vec()).clone())
    }

    /// Registers every region of `memory` as a KVM memory slot (`KVM_SET_USER_MEMORY_REGION`). The VM keeps a clone
    /// of `memory`, so the mappings stay valid for as long as the guest can touch them.
    pub fn register_memory(&mut self, memory: &GuestMemory) -> Result<(), VmError> {
        self.register_memory_with(memory, false)
    }

    /// As [`Vm::register_memory`], with KVM dirty-page logging on (for incremental snapshots).
    pub fn register_memory_with(&mut self, memory: &GuestMemory, log_dirty: bool) -> Result<(), VmError> {
        for (addr, len, host) in memory.regions() {
            let slot = self.next_slot;
            if usize::try_from(slot).map_or(true, |s| s >= self.caps.memory_slots) {
                return Err(VmError::TooManySlots { slot, max: self.caps.memory_slots });
            }
            let region = kvm_userspace_memory_region {
                slot,
                flags: if log_dirty { KVM_MEM_LOG_DIRTY_PAGES } else { 0 },
                guest_phys_addr: addr.raw_value(),
                memory_size: len,
                userspace_addr: host as u64,
            };
            // SAFETY: `host..host + len` is a live mapping owned by `memory`'s regions; the clone pushed below keeps
            // it mapped for as long as this VM (and with it the memory slot) exists, and slots never overlap because
            // the regions of one `GuestMemory` do not and each gets a fresh slot number.
            unsafe { self.fd.set_user_memory_region(region) }.map_err(kvm_error("KVM_SET_USER_MEMORY_REGION"))?;
            self.next_slot += 1;
        }
        self.memory.push(memory.clone());
        Ok(())
    }

    /// Makes `event` raise `gsi` on the in-kernel irqchip (`KVM_IRQFD`): a device writes the eventfd, the guest sees
    /// an edge on the GSI without the monitor being involved.
    pub fn register_irqfd(&self, event: &EventFd, gsi: u32) -> Result<(), VmError> {
        if !self.irqchip {
            return Err(VmError::NoIrqchip(gsi));
        }
        self.fd.register_irqfd(event, gsi).map_err(kvm_error("KVM_IRQFD"))
    }

    /// Removes an irqfd registered with [`Vm::register_irqfd`].
    pub fn unregister_irqfd(&self, event: &EventFd, gsi: u32) -> Result<(), VmError> {
        self.fd.unregister_irqfd(event, gsi).map_err(kvm_error("KVM_IRQFD (deassign)"))
    }

    /// Reads the KVM clock.
    pub fn clock(&self) -> Result<ClockState, VmError> {
        let data = self.fd.get_clock().map_err(kvm_error("KVM_GET_CLOCK"))?;
        Ok(ClockState { clock: data.clock, flags: data.flags })
    }

    /// Sets the KVM clock (restore). Only the time is passed: the TSC-stable flag describes the source host.
    pub fn set_clock(&self, state: &ClockState) -> Result<(), VmError> {
        let data = kvm_clock_data { clock: state.clock, ..Default::default() };
        self.fd.set_clock(&data).map_err(kvm_error("KVM_SET_CLOCK"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kvm_present() -> bool {
        std::path::Path::new("/dev/kvm").exists()
    }

    #[test]
    fn irqfd_without_irqchip_is_a_typed_error() {
        if !kvm_present() {
            return;
        }
        let vm = Vm::new(&VmConfig { irqchip: false }).expect("vm");
        let event = EventFd::new(libc::EFD_NONBLOCK).expect("eventfd");
        assert!(matches!(vm.register_irqfd(&event, 4), Err(VmError::NoIrqchip(4))));
    }

    #[test]
    fn clock_round_trips() {
        if !kvm_present() {
            return;
        }
        let vm = Vm::new(&VmConfig::default()).expect("vm");
        let clock = ClockState { clock: 5_000_000_000, flags: 0 };
        vm.set_clock(&clock).expect("set clock");
        let read = vm.clock().expect("clock");
        assert!(read.clock >= clock.clock && read.clock < clock.clock + 1_000_000_000, "{read:?}");
    }
}
