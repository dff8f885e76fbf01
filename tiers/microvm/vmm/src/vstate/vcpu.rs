//! A vCPU: its setup (CPUID, MSRs, FPU, LAPIC, entry registers), the run loop and its exits, stopping it from
//! another thread, and its state for snapshots ([`state`]).
//!
//! Stopping a running vCPU follows Firecracker: the stopper sets the vCPU's stop flag and sends it a real-time
//! signal ([`kick_signal`]); the signal's handler, running on the vCPU thread, sets `kvm_run.immediate_exit`, so
//! `KVM_RUN` returns `EINTR` whether the signal arrived inside it (the kernel checks for signals between guest
//! instructions, also when it is emulating them or waiting on `hlt`) or just before it. The run loop then sees the
//! flag and returns [`VcpuExit::Stopped`].

pub mod cpuid;
pub mod msr;
pub mod state;

use std::cell::Cell;
use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use kvm_bindings::{
    KVM_EXIT_INTERNAL_ERROR, KVM_INTERNAL_ERROR_DELIVERY_EV, KVM_INTERNAL_ERROR_EMULATION, KVM_INTERNAL_ERROR_SIMUL_EX,
    KVM_INTERNAL_ERROR_UNEXPECTED_EXIT_REASON, KVM_SYSTEM_EVENT_CRASH, KVM_SYSTEM_EVENT_RESET,
    KVM_SYSTEM_EVENT_SHUTDOWN, Msrs, kvm_fpu, kvm_msr_entry,
};
use kvm_ioctls::{VcpuExit as KvmExit, VcpuFd};
use vmm_sys_util::signal::{Killable, SIGRTMIN, register_signal_handler};

use crate::boot::{EntryPoint, entry_regs, entry_sregs};
use crate::devices::bus::Bus;
use crate::vstate::vm::{KvmCapabilities, Vm, VmError};
use cpuid::{CpuidProfile, CpuidTopology, build_cpuid};

/// Offset of the kick signal from `SIGRTMIN` (glibc keeps the real-time signals below `SIGRTMIN` for itself).
pub const VCPU_KICK_SIGNAL_OFFSET: i32 = 0;

/// The signal that kicks a vCPU thread out of `KVM_RUN`.
pub fn kick_signal() -> i32 {
    SIGRTMIN() + VCPU_KICK_SIGNAL_OFFSET
}

/// LAPIC register offsets and delivery modes used at setup.
const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

/// Why a vCPU could not be created, configured, run or saved.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    /// A KVM ioctl on the vCPU failed.
    #[error("{op} failed")]
    Kvm {
        /// The ioctl.
        op: &'static str,
        /// Why.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// A VM-level query the vCPU needs failed.
    #[error("VM query for the vCPU failed")]
    Vm(#[from] VmError),
    /// The vCPU index is not below the vCPU count.
    #[error("vCPU index {index} is outside a topology of {count} vCPUs")]
    Topology {
        /// The index.
        index: u8,
        /// The count.
        count: u8,
    },
    /// More CPUID entries than KVM accepts.
    #[error("CPUID has more entries than KVM accepts")]
    CpuidFull,
    /// KVM refused an MSR.
    #[error("KVM refused to set MSR {0:#x}")]
    MsrRefused(u32),
    /// A saved state failed validation.
    #[error("invalid vCPU state: {0}")]
    InvalidState(&'static str),
    /// `KVM_RUN` failed (other than being interrupted).
    #[error("KVM_RUN failed")]
    Run(#[source] kvm_ioctls::Error),
    /// `KVM_RUN` returned an exit the monitor does not handle.
    #[error("unexpected vCPU exit {0}")]
    UnexpectedExit(String),
    /// The vCPU thread could not be spawned.
    #[error("cannot spawn the vCPU thread")]
    Spawn(#[source] std::io::Error),
    /// The kick signal handler could not be installed.
    #[error("cannot install the vCPU kick signal handler")]
    SignalHandler(#[source] vmm_sys_util::errno::Error),
    /// The kick signal could not be sent.
    #[error("cannot signal the vCPU thread")]
    Kick(#[source] vmm_sys_util::errno::Error),
    /// The vCPU thread panicked.
    #[error("the vCPU thread panicked")]
    ThreadPanicked,
}

pub(crate) fn kvm_error(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VcpuError {
    move |source| VcpuError::Kvm { op, source }
}

/// How to set a vCPU up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VcpuConfig {
    /// How many vCPUs the guest has (for the CPUID topology).
    pub vcpu_count: u8,
    /// Which CPUID mask to apply.
    pub cpuid: CpuidProfile,
}

impl Default for VcpuConfig {
    fn default() -> VcpuConfig {
        VcpuConfig { vcpu_count: 1, cpuid: CpuidProfile::Standard }
    }
}

/// `KVM_SYSTEM_EVENT_*`: the guest asked for the machine to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SystemEvent {
    /// Power off (PSCI / ACPI shutdown).
    Shutdown,
    /// Reboot.
    Reset,
    /// The guest reported a crash.
    Crash,
    /// Another event type.
    Other(u32),
}

/// `KVM_INTERNAL_ERROR_*` suberrors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InternalErrorKind {
    /// The instruction emulator could not handle an instruction: on a PVM host every guest instruction goes
    /// through it, so an instruction it lacks (or a fetch from a guest address with no memory) ends up here.
    Emulation,
    /// An exception was raised while delivering another.
    SimultaneousException,
    /// An event could not be delivered (e.g. through a bad IDT) without a triple fault.
    DeliveryEvent,
    /// KVM saw a hardware exit it does not handle.
    UnexpectedExitReason,
    /// Another suberror.
    Other(u32),
}

/// A `KVM_EXIT_INTERNAL_ERROR`: KVM could not go on running the guest.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("KVM internal error {kind:?} (data {data:x?})")]
pub struct InternalError {
    /// The suberror.
    pub kind: InternalErrorKind,
    /// Up to 16 words of detail (for emulation failures: instruction length and bytes, on recent kernels).
    pub data: Vec<u64>,
}

/// What ended one `KVM_RUN`, after I/O has been dispatched to the buses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VcpuExit {
    /// An `in` from `port`, answered by the port bus (or all ones when `handled` is false).
    IoIn {
        /// The port.
        port: u16,
        /// Bytes read.
        len: usize,
        /// Whether a device is mapped there.
        handled: bool,
    },
    /// An `out` to `port`, given to the port bus.
    IoOut {
        /// The port.
        port: u16,
        /// Bytes written.
        len: usize,
        /// Whether a device is mapped there.
        handled: bool,
    },
    /// A read from guest-physical `addr` where there is no RAM, answered by the MMIO bus.
    MmioRead {
        /// The address.
        addr: u64,
        /// Bytes read.
        len: usize,
        /// Whether a device is mapped there.
        handled: bool,
    },
    /// A write to guest-physical `addr` where there is no RAM, given to the MMIO bus.
    MmioWrite {
        /// The address.
        addr: u64,
        /// Bytes written.
        len: usize,
        /// Whether a device is mapped there.
        handled: bool,
    },
    /// `hlt` with no in-kernel irqchip to wait on.
    Hlt,
    /// The vCPU shut down: a triple fault.
    Shutdown,
    /// The guest asked to power off, reboot, or reported a crash.
    SystemEvent(SystemEvent),
    /// VM entry failed (hardware reason code and the physical CPU).
    FailEntry {
        /// `hardware_entry_failure_reason`.
        reason: u64,
        /// Host CPU.
        cpu: u32,
    },
    /// KVM could not continue: an emulation failure and the like.
    InternalError(InternalError),
    /// `KVM_RUN` was interrupted by a signal that was not a stop request.
    Interrupted,
    /// Another thread asked the vCPU to stop ([`VcpuThread::kick`]).
    Stopped,
}

impl VcpuExit {
    /// Whether the guest can go on after this exit without the monitor deciding anything: I/O that was dispatched,
    /// or a stray signal.
    pub fn is_io(&self) -> bool {
        matches!(
            self,
            VcpuExit::IoIn { .. }
                | VcpuExit::IoOut { .. }
                | VcpuExit::MmioRead { .. }
                | VcpuExit::MmioWrite { .. }
                | VcpuExit::Interrupted
        )
    }
}

thread_local! {
    /// The `immediate_exit` byte of the `kvm_run` of the vCPU this thread is running, while it runs one.
    static IMMEDIATE_EXIT: Cell<*mut u8> = const { Cell::new(std::ptr::null_mut()) };
}

extern "C" fn handle_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // A const-initialised thread-local without a destructor is a plain TLS slot: reading it is async-signal-safe.
    let target = IMMEDIATE_EXIT.with(Cell::get);
    if !target.is_null() {
        // SAFETY: a non-null pointer is only installed by `RunGuard` for the duration of `Vcpu::run_once` on this
        // very thread, and points into the vCPU's `kvm_run` mapping, which the `VcpuFd` borrowed by that call keeps
        // alive. The page is shared with the kernel and written to as a volatile byte.
        unsafe { target.write_volatile(1) };
    }
}

fn install_kick_handler() -> Result<(), VcpuError> {
    static INSTALLED: OnceLock<Result<(), i32>> = OnceLock::new();
    INSTALLED
        .get_or_init(|| register_signal_handler(kick_signal(), handle_kick).map_err(|e| e.errno()))
        .map_err(|errno| VcpuError::SignalHandler(vmm_sys_util::errno::Error::new(errno)))
}

/// Installs the kick target for one `KVM_RUN` and removes it again, also on early return.
struct RunGuard;

impl RunGuard {
    fn install(fd: &mut VcpuFd) -> RunGuard {
        let target = &raw mut fd.get_kvm_run().immediate_exit;
        IMMEDIATE_EXIT.with(|t| t.set(target));
        RunGuard
    }
}

impl Drop for RunGuard {
    fn drop(&mut self) {
        IMMEDIATE_EXIT.with(|t| t.set(std::ptr::null_mut()));
    }
}

/// A KVM vCPU with the buses its I/O exits go to.
#[derive(Debug)]
pub struct Vcpu {
    fd: VcpuFd,
    index: u8,
    io_bus: Bus,
    mmio_bus: Bus,
    stop: Arc<AtomicBool>,
    irqchip: bool,
    caps: KvmCapabilities,
    msr_list: Vec<u32>,
}

impl Vcpu {
    /// Creates vCPU `index` of `vm` (`KVM_CREATE_VCPU`), bare: call [`Vcpu::configure`] and [`Vcpu::set_entry`] to
    /// boot it, or [`Vcpu::restore_state`] to continue a saved one.
    pub fn new(vm: &Vm, index: u8, io_bus: Bus, mmio_bus: Bus) -> Result<Vcpu, VcpuError> {
        install_kick_handler()?;
        let fd = vm.fd().create_vcpu(u64::from(index)).map_err(kvm_error("KVM_CREATE_VCPU"))?;
        let msr_list = vm.msr_index_list()?;
        Ok(Vcpu {
            fd,
            index,
            io_bus,
            mmio_bus,
            stop: Arc::new(AtomicBool::new(false)),
            irqchip: vm.has_irqchip(),
            caps: *vm.capabilities(),
            msr_list,
        })
    }

    /// This vCPU's index (and APIC ID).
    pub fn index(&self) -> u8 {
        self.index
    }

    /// Sets `kvm_run.immediate_exit` through the vCPU's own mapping of its `kvm_run` page: while it is 1,
    /// `KVM_RUN` completes a pending I/O exit and returns `EINTR` before the guest runs another instruction.
    pub fn set_immediate_exit(&mut self, value: u8) {
        self.fd.set_kvm_immediate_exit(value);
    }

    /// The vCPU fd, for what this type does not wrap.
    pub fn fd(&self) -> &VcpuFd {
        &self.fd
    }

    /// Sets the boot CPU model: CPUID (KVM's supported set through the [`cpuid`] mask), the boot MSRs
    /// ([`msr::boot_msr_entries`]), a reset FPU (x87 control word 0x37f, MXCSR 0x1f80) and, with the irqchip, the
    /// LAPIC's LINT0 as ExtINT (the PIC's output) and LINT1 as NMI.
    pub fn configure(&self, vm: &Vm, config: &VcpuConfig) -> Result<(), VcpuError> {
        let topology = CpuidTopology {
            index: self.index,
            count: config.vcpu_count,
            tsc_deadline_timer: self.caps.tsc_deadline_timer,
        };
        let cpuid = build_cpuid(&vm.supported_cpuid()?, config.cpuid, topology)?;
        self.fd.set_cpuid2(&cpuid).map_err(kvm_error("KVM_SET_CPUID2"))?;
        self.set_msrs(&msr::boot_msr_entries())?;
        let fpu = kvm_fpu { fcw: 0x37f, mxcsr: 0x1f80, ..Default::default() };
        self.fd.set_fpu(&fpu).map_err(kvm_error("KVM_SET_FPU"))?;
        if self.irqchip {
            let mut lapic = self.fd.get_lapic().map_err(kvm_error("KVM_GET_LAPIC"))?;
            for (reg, mode) in [(APIC_LVT0, APIC_MODE_EXTINT), (APIC_LVT1, APIC_MODE_NMI)] {
                let bytes: [u8; 4] = std::array::from_fn(|i| lapic.regs[reg + i] as u8);
                let value = (u32::from_le_bytes(bytes) & !0x700) | (mode << 8);
                for (i, b) in value.to_le_bytes().into_iter().enumerate() {
                    lapic.regs[reg + i] = b as std::os::raw::c_char;
                }
            }
            self.fd.set_lapic(&lapic).map_err(kvm_error("KVM_SET_LAPIC"))?;
        }
        Ok(())
    }

    /// Sets the registers the boot protocol of `entry` asks for ([`crate::boot::entry_regs`],
    /// [`crate::boot::entry_sregs`]); the descriptor and page tables must already be in guest memory.
    pub fn set_entry(&self, entry: &EntryPoint) -> Result<(), VcpuError> {
        let mut sregs = self.fd.get_sregs().map_err(kvm_error("KVM_GET_SREGS"))?;
        entry_sregs(entry, &mut sregs);
        self.fd.set_sregs(&sregs).map_err(kvm_error("KVM_SET_SREGS"))?;
        self.fd.set_regs(&entry_regs(entry)).map_err(kvm_error("KVM_SET_REGS"))
    }

    fn set_msrs(&self, entries: &[kvm_msr_entry]) -> Result<(), VcpuError> {
        let msrs = Msrs::from_entries(entries).map_err(|_| VcpuError::InvalidState("too many MSRs"))?;
        let written = self.fd.set_msrs(&msrs).map_err(kvm_error("KVM_SET_MSRS"))?;
        match entries.get(written) {
            Some(refused) => Err(VcpuError::MsrRefused(refused.index)),
            None => Ok(()),
        }
    }

    /// Runs the guest until the next exit and dispatches port and MMIO accesses to the buses. Returns
    /// [`VcpuExit::Stopped`] without entering the guest when a stop was requested.
    pub fn run_once(&mut self) -> Result<VcpuExit, VcpuError> {
        let _guard = RunGuard::install(&mut self.fd);
        if self.stop.swap(false, Ordering::SeqCst) {
            return Ok(VcpuExit::Stopped);
        }
        let exit = match self.fd.run() {
            Ok(KvmExit::IoIn(port, data)) => {
                let handled = self.io_bus.read(u64::from(port), data);
                VcpuExit::IoIn { port, len: data.len(), handled }
            }
            Ok(KvmExit::IoOut(port, data)) => {
                let handled = self.io_bus.write(u64::from(port), data);
                VcpuExit::IoOut { port, len: data.len(), handled }
            }
            Ok(KvmExit::MmioRead(addr, data)) => {
                let handled = self.mmio_bus.read(addr, data);
                VcpuExit::MmioRead { addr, len: data.len(), handled }
            }
            Ok(KvmExit::MmioWrite(addr, data)) => {
                let handled = self.mmio_bus.write(addr, data);
                VcpuExit::MmioWrite { addr, len: data.len(), handled }
            }
            Ok(KvmExit::Hlt) => VcpuExit::Hlt,
            Ok(KvmExit::Shutdown) => VcpuExit::Shutdown,
            Ok(KvmExit::SystemEvent(kind, _)) => VcpuExit::SystemEvent(match kind {
                KVM_SYSTEM_EVENT_SHUTDOWN => SystemEvent::Shutdown,
                KVM_SYSTEM_EVENT_RESET => SystemEvent::Reset,
                KVM_SYSTEM_EVENT_CRASH => SystemEvent::Crash,
                other => SystemEvent::Other(other),
            }),
            Ok(KvmExit::FailEntry(reason, cpu)) => VcpuExit::FailEntry { reason, cpu },
            Ok(KvmExit::InternalError) => VcpuExit::InternalError(self.internal_error()),
            Ok(KvmExit::Intr) => self.interrupted(),
            Ok(other) => return Err(VcpuError::UnexpectedExit(format!("{other:?}"))),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => self.interrupted(),
            Err(e) => return Err(VcpuError::Run(e)),
        };
        Ok(exit)
    }

    fn interrupted(&mut self) -> VcpuExit {
        self.fd.set_kvm_immediate_exit(0);
        if self.stop.swap(false, Ordering::SeqCst) { VcpuExit::Stopped } else { VcpuExit::Interrupted }
    }

    fn internal_error(&mut self) -> InternalError {
        let run = self.fd.get_kvm_run();
        if run.exit_reason != KVM_EXIT_INTERNAL_ERROR {
            return InternalError { kind: InternalErrorKind::Other(u32::MAX), data: Vec::new() };
        }
        // SAFETY: `exit_reason` is KVM_EXIT_INTERNAL_ERROR, so `internal` is the union member the kernel filled.
        let internal = unsafe { run.__bindgen_anon_1.internal };
        let n = usize::try_from(internal.ndata).unwrap_or(usize::MAX).min(internal.data.len());
        let kind = match internal.suberror {
            KVM_INTERNAL_ERROR_EMULATION => InternalErrorKind::Emulation,
            KVM_INTERNAL_ERROR_SIMUL_EX => InternalErrorKind::SimultaneousException,
            KVM_INTERNAL_ERROR_DELIVERY_EV => InternalErrorKind::DeliveryEvent,
            KVM_INTERNAL_ERROR_UNEXPECTED_EXIT_REASON => InternalErrorKind::UnexpectedExitReason,
            other => InternalErrorKind::Other(other),
        };
        InternalError { kind, data: internal.data[..n].to_vec() }
    }

    /// Runs until an exit the monitor must decide on: everything but dispatched I/O and stray signals
    /// ([`VcpuExit::is_io`]).
    pub fn run(&mut self) -> Result<VcpuExit, VcpuError> {
        loop {
            let exit = self.run_once()?;
            if !exit.is_io() {
                return Ok(exit);
            }
        }
    }

    /// Asks the vCPU to stop at its next chance. Only the flag: use [`VcpuThread::kick`] to also interrupt a
    /// `KVM_RUN` in progress on another thread.
    pub fn request_stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }

    /// Moves the vCPU to a thread of its own (`strata-vcpu<N>`) that runs [`Vcpu::run`] once and hands the vCPU
    /// back on [`VcpuThread::join`]. In a monitor process the thread runs under the vCPU filter
    /// ([`crate::seccomp::spawn`]).
    pub fn start(self) -> Result<VcpuThread, VcpuError> {
        let stop = self.stop.clone();
        let name = format!("strata-vcpu{}", self.index);
        let handle = crate::seccomp::spawn(crate::seccomp::ThreadKind::Vcpu, name, move || {
            let mut vcpu = self;
            let result = vcpu.run();
            (vcpu, result)
        })
        .map_err(VcpuError::Spawn)?;
        Ok(VcpuThread { handle, stop })
    }
}

/// What a vCPU thread hands back: the vCPU (for its state) and how its run ended.
pub type VcpuThreadResult = (Vcpu, Result<VcpuExit, VcpuError>);

/// A vCPU running on its own thread.
#[derive(Debug)]
pub struct VcpuThread {
    handle: JoinHandle<VcpuThreadResult>,
    stop: Arc<AtomicBool>,
}

impl VcpuThread {
    /// Stops the vCPU: sets its stop flag, then signals its thread so a `KVM_RUN` in progress (running, emulating
    /// or halted in the kernel) returns. The thread then finishes with [`VcpuExit::Stopped`].
    pub fn kick(&self) -> Result<(), VcpuError> {
        self.stop.store(true, Ordering::SeqCst);
        if self.handle.is_finished() {
            return Ok(());
        }
        self.handle.kill(kick_signal()).map_err(VcpuError::Kick)
    }

    /// Whether the thread has finished.
    pub fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }

    /// Waits for the thread and takes the vCPU back.
    pub fn join(self) -> Result<VcpuThreadResult, VcpuError> {
        self.handle.join().map_err(|_| VcpuError::ThreadPanicked)
    }
}
