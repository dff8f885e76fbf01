//! A live machine: the VM, its memory, its vCPUs (paused, or running on their threads), its devices and their
//! backend threads, and pausing it at a safe point.
//!
//! **Pausing** ([`Machine::pause`]) follows Firecracker: every vCPU thread is kicked (stop flag plus a signal whose
//! handler sets `kvm_run.immediate_exit`, see [`crate::vstate::vcpu`]) and joined; then each vCPU enters `KVM_RUN`
//! once more with `immediate_exit` set, which completes an I/O exit the guest was in the middle of (an `in` whose
//! value is not yet in `RAX`, an MMIO read, a string `out` with more to go) and returns `EINTR` before another guest
//! instruction runs. Only then is the architectural state consistent: saved without that step, a restored guest
//! would repeat or lose the access.
//!
//! **Restoring** ([`Machine::restore`]) builds a new machine from a saved state ([`crate::persist`]) and memory
//! that already holds the guest's RAM.

use std::fs::File;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::devices::serial::{
    DEFAULT_LOG_CAPACITY, SERIAL_GSI, SERIAL_PORT_BASE, SERIAL_PORT_LEN, SerialDevice, SerialLog,
};
use crate::devices::virtio::Interrupt;
use crate::devices::virtio::block::BlockDevice;
use crate::devices::virtio::mmio::{BackendThread, MMIO_LEN, MmioTransport};
use crate::devices::virtio::persist::{MmioTransportConstructorArgs, Persist};
use crate::devices::virtio::vsock::VsockDevice;
use crate::devices::virtio::vsock::persist::VsockConstructorArgs;
pub use crate::error::MachineError;
use crate::persist::{DevicesState, MicrovmState, RestoreArgs, VirtioDeviceState, VirtioSlotState};
use crate::vstate::memory::GuestMemory;
use crate::vstate::vcpu::{Vcpu, VcpuExit, VcpuThread};
use crate::vstate::vm::{Vm, VmConfig, VmState};

/// How many `KVM_RUN`s with `immediate_exit` a pause waits for a vCPU's pending I/O to complete (a string
/// instruction may need a few).
const MAX_IO_COMPLETIONS: usize = 16;

fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A virtio-mmio transport as the MMIO bus holds it, by device kind.
#[derive(Debug, Clone)]
pub enum VirtioTransport {
    /// virtio-vsock.
    Vsock(Arc<Mutex<MmioTransport<VsockDevice>>>),
    /// virtio-blk.
    Block(Arc<Mutex<MmioTransport<BlockDevice>>>),
}

/// A virtio-mmio device of a machine: where it is and its transport.
#[derive(Debug, Clone)]
pub struct VirtioSlot {
    /// Guest-physical base of the register window.
    pub base: u64,
    /// The GSI its interrupt is wired to.
    pub gsi: u32,
    /// The transport (shared with the MMIO bus).
    pub transport: VirtioTransport,
}

/// The devices a snapshot saves, as shared with the buses: the monitor registers each device here as it places it.
#[derive(Debug, Clone, Default)]
pub struct Devices {
    /// COM1 (at [`SERIAL_PORT_BASE`], GSI [`SERIAL_GSI`]).
    pub serial: Option<Arc<Mutex<SerialDevice>>>,
    /// The virtio-mmio devices.
    pub virtio: Vec<VirtioSlot>,
}

enum TransportGuard<'a> {
    Vsock(MutexGuard<'a, MmioTransport<VsockDevice>>),
    Block(MutexGuard<'a, MmioTransport<BlockDevice>>),
}

impl Devices {
    /// Saves every device while holding all their locks: a backend thread cannot touch a queue or guest memory
    /// until `then` (which writes guest memory out) is done too.
    fn save_with<R>(&self, then: impl FnOnce(DevicesState) -> Result<R, MachineError>) -> Result<R, MachineError> {
        let serial = self.serial.as_ref().map(|s| lock(s));
        let guards: Vec<(u64, u32, TransportGuard<'_>)> = self
            .virtio
            .iter()
            .map(|slot| {
                let guard = match &slot.transport {
                    VirtioTransport::Vsock(t) => TransportGuard::Vsock(lock(t)),
                    VirtioTransport::Block(t) => TransportGuard::Block(lock(t)),
                };
                (slot.base, slot.gsi, guard)
            })
            .collect();
        let state = DevicesState {
            serial: serial.as_ref().map(|s| s.save_state()),
            virtio: guards
                .iter()
                .map(|(base, gsi, guard)| {
                    let (transport, device) = match guard {
                        TransportGuard::Vsock(t) => (t.save(), VirtioDeviceState::Vsock(t.device().save())),
                        TransportGuard::Block(t) => (t.save(), VirtioDeviceState::Block(t.device().save())),
                    };
                    VirtioSlotState { base: *base, gsi: *gsi, transport, device }
                })
                .collect(),
        };
        then(state)
    }
}

/// A microVM the monitor can pause, snapshot and resume: the VM, its memory, its vCPUs (paused, or running on their
/// threads), its devices and their backend threads. Dropping it stops and joins every thread.
#[derive(Debug)]
pub struct Machine {
    // Drop order matters: threads stop before the VM and the memory they use go away.
    running: Vec<VcpuThread>,
    backends: Vec<BackendThread>,
    vcpus: Vec<Vcpu>,
    devices: Devices,
    vm: Vm,
    memory: GuestMemory,
}

impl Machine {
    /// A paused machine from its parts. `vcpus` must be in index order; `devices` lists what sits on the buses.
    pub fn new(vm: Vm, memory: GuestMemory, vcpus: Vec<Vcpu>, devices: Devices) -> Machine {
        Machine { running: Vec::new(), backends: Vec::new(), vcpus, devices, vm, memory }
    }

    /// Hands a device backend thread to the machine (stopped when it is dropped).
    pub fn add_backend(&mut self, backend: BackendThread) {
        self.backends.push(backend);
    }

    /// The VM.
    pub fn vm(&self) -> &Vm {
        &self.vm
    }

    /// Guest RAM.
    pub fn memory(&self) -> &GuestMemory {
        &self.memory
    }

    /// The devices.
    pub fn devices(&self) -> &Devices {
        &self.devices
    }

    /// The console log, when the machine has a serial device.
    pub fn serial_log(&self) -> Option<SerialLog> {
        self.devices.serial.as_ref().map(|s| lock(s).log())
    }

    /// The paused vCPUs (empty while running).
    pub fn vcpus(&self) -> &[Vcpu] {
        &self.vcpus
    }

    /// The paused vCPUs, to run one on the caller's thread with [`Vcpu::run_once`].
    pub fn vcpus_mut(&mut self) -> &mut [Vcpu] {
        &mut self.vcpus
    }

    /// Whether the vCPUs are on their threads.
    pub fn is_running(&self) -> bool {
        !self.running.is_empty()
    }

    /// Whether a running vCPU's thread has already ended (halt without irqchip, shutdown, an error).
    pub fn has_stopped(&self) -> bool {
        self.running.iter().any(VcpuThread::is_finished)
    }

    /// Starts every paused vCPU on its own thread.
    pub fn resume(&mut self) -> Result<(), MachineError> {
        for vcpu in std::mem::take(&mut self.vcpus) {
            let index = vcpu.index();
            self.running.push(vcpu.start().map_err(|source| MachineError::Vcpu { index, source })?);
        }
        Ok(())
    }

    /// Stops every vCPU at a safe point: kicks them all, joins their threads, then completes any pending I/O
    /// ([`complete_pending_io`]). Returns how each vCPU's run ended ([`VcpuExit::Stopped`] when the kick stopped
    /// it; a halt or shutdown when the guest got there first). A paused machine stays paused.
    pub fn pause(&mut self) -> Result<Vec<VcpuExit>, MachineError> {
        for thread in &self.running {
            // A thread that has just finished cannot be signalled; it needs no kick.
            let _ = thread.kick();
        }
        let mut exits = Vec::with_capacity(self.running.len());
        let mut first_error = None;
        for thread in std::mem::take(&mut self.running) {
            match thread.join() {
                Ok((vcpu, result)) => {
                    let index = vcpu.index();
                    match result {
                        Ok(exit) => exits.push(exit),
                        Err(source) => {
                            first_error.get_or_insert(MachineError::Vcpu { index, source });
                        }
                    }
                    self.vcpus.push(vcpu);
                }
                Err(source) => {
                    first_error.get_or_insert(MachineError::Vcpu { index: u8::MAX, source });
                }
            }
        }
        for vcpu in &mut self.vcpus {
            complete_pending_io(vcpu)?;
        }
        match first_error {
            Some(err) => Err(err),
            None => Ok(exits),
        }
    }

    /// The machine's state (not its memory), saved under the device locks. Pending I/O of a vCPU driven with
    /// [`Vcpu::run_once`] is completed first ([`complete_pending_io`]).
    pub fn save_state(&mut self) -> Result<MicrovmState, MachineError> {
        self.save_state_with(|state, _| Ok(state.clone()))
    }

    /// Saves the paused machine: its state, and its RAM written sparse into `memory_out`
    /// ([`GuestMemory::write_sparse`]), both under the device locks, so no backend thread touches a queue or guest
    /// memory in between.
    pub fn save(&mut self, memory_out: &File) -> Result<MicrovmState, MachineError> {
        self.save_state_with(|state, memory| {
            memory.write_sparse(memory_out).map_err(|source| MachineError::Io { path: "memory".into(), source })?;
            Ok(state.clone())
        })
    }

    fn save_state_with<R>(
        &mut self,
        then: impl FnOnce(&MicrovmState, &GuestMemory) -> Result<R, MachineError>,
    ) -> Result<R, MachineError> {
        if self.is_running() {
            return Err(MachineError::Running);
        }
        if self.vcpus.is_empty() {
            return Err(MachineError::NoVcpus);
        }
        for vcpu in &mut self.vcpus {
            complete_pending_io(vcpu)?;
        }
        let vm = VmState::save(&self.vm)?;
        let vcpus = self
            .vcpus
            .iter()
            .map(|vcpu| vcpu.save_state().map_err(|source| MachineError::Vcpu { index: vcpu.index(), source }))
            .collect::<Result<Vec<_>, _>>()?;
        self.devices.save_with(|devices| {
            let state = MicrovmState { memory_bytes: self.memory.size(), vm, vcpus, devices };
            state.validate()?;
            then(&state, &self.memory)
        })
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        for thread in &self.running {
            let _ = thread.kick();
        }
        for thread in self.running.drain(..) {
            let _ = thread.join();
        }
    }
}

impl Machine {
    /// Rebuilds the machine `state` describes over `memory` (already holding its RAM: a memfd filled with
    /// [`GuestMemory::fill_sparse_from`], or a memory file mapped `MAP_PRIVATE` with
    /// [`GuestMemory::from_open_file_private`]): a new VM (with an irqchip exactly when the state has one), its
    /// state set, the devices rebuilt on the caller's buses, the vCPUs created from their state and left paused
    /// ([`Machine::resume`] starts them). Host resources that are not state come in `args`.
    pub fn restore(state: &MicrovmState, memory: GuestMemory, args: RestoreArgs) -> Result<Machine, MachineError> {
        if memory.size() != state.memory_bytes {
            return Err(MachineError::MemorySize { expected: state.memory_bytes, found: memory.size() });
        }
        let irqchip = state.vm.irqchip.is_some();
        let RestoreArgs { kvm, mut io_bus, mut mmio_bus, vsock_uds, guest_cid, disks, serial_log } = args;
        let mut vm = match kvm {
            Some(kvm) => Vm::with_kvm(kvm, &VmConfig { irqchip })?,
            None => Vm::new(&VmConfig { irqchip })?,
        };
        vm.register_memory(&memory)?;
        state.vm.restore(&vm)?;

        let mut devices = Devices::default();
        if let Some(serial_state) = &state.devices.serial {
            let log = serial_log.unwrap_or_else(|| SerialLog::new(DEFAULT_LOG_CAPACITY));
            let serial = SerialDevice::from_state(serial_state, log)?;
            if irqchip {
                vm.register_irqfd(serial.interrupt_evt(), SERIAL_GSI)?;
            }
            let serial = Arc::new(Mutex::new(serial));
            io_bus.insert(serial.clone(), SERIAL_PORT_BASE, SERIAL_PORT_LEN)?;
            devices.serial = Some(serial);
        }

        let mut vsock_uds = vsock_uds;
        let mut disks = disks.into_iter();
        let mut backends = Vec::new();
        for (index, slot) in state.devices.virtio.iter().enumerate() {
            let interrupt = Interrupt::new().map_err(MachineError::Interrupt)?;
            if irqchip {
                vm.register_irqfd(interrupt.irqfd(), slot.gsi)?;
            }
            let mem = memory.mmap().clone();
            let transport_error = |source| MachineError::Transport { index, source };
            let transport = match &slot.device {
                VirtioDeviceState::Vsock(device_state) => {
                    let uds_path = vsock_uds.take().ok_or(MachineError::MissingArg { index, what: "vsock_uds" })?;
                    let device = VsockDevice::restore(VsockConstructorArgs { uds_path, guest_cid }, device_state)
                        .map_err(|source| MachineError::Vsock { index, source })?;
                    let transport = MmioTransport::restore(
                        MmioTransportConstructorArgs { mem, device, interrupt },
                        &slot.transport,
                    )
                    .map_err(transport_error)?;
                    let transport = Arc::new(Mutex::new(transport));
                    mmio_bus.insert(transport.clone(), slot.base, MMIO_LEN)?;
                    backends.push(BackendThread::spawn(transport.clone())?);
                    VirtioTransport::Vsock(transport)
                }
                VirtioDeviceState::Block(device_state) => {
                    let disk = disks.next().ok_or(MachineError::MissingArg { index, what: "a disk" })?;
                    let device = BlockDevice::restore(disk, device_state)
                        .map_err(|source| MachineError::Block { index, source })?;
                    let transport = MmioTransport::restore(
                        MmioTransportConstructorArgs { mem, device, interrupt },
                        &slot.transport,
                    )
                    .map_err(transport_error)?;
                    let transport = Arc::new(Mutex::new(transport));
                    mmio_bus.insert(transport.clone(), slot.base, MMIO_LEN)?;
                    VirtioTransport::Block(transport)
                }
            };
            devices.virtio.push(VirtioSlot { base: slot.base, gsi: slot.gsi, transport });
        }

        let mut vcpus = Vec::with_capacity(state.vcpus.len());
        for (index, vcpu_state) in state.vcpus.iter().enumerate() {
            let index =
                u8::try_from(index).map_err(|_| MachineError::InvalidState("vCPU index out of range".into()))?;
            let vcpu_error = |source| MachineError::Vcpu { index, source };
            let vcpu = Vcpu::new(&vm, index, io_bus.clone(), mmio_bus.clone()).map_err(vcpu_error)?;
            vcpu.restore_state(vcpu_state).map_err(vcpu_error)?;
            vcpus.push(vcpu);
        }
        let mut machine = Machine::new(vm, memory, vcpus, devices);
        for backend in backends {
            machine.add_backend(backend);
        }
        Ok(machine)
    }
}

/// Finishes whatever I/O exit a stopped vCPU was in the middle of, without running another guest instruction:
/// `KVM_RUN` with `immediate_exit` set completes the pending access (loading an `in`'s value into `RAX`, advancing
/// `RIP` past an `out`) and returns `EINTR` (KVM's documented way to make the state consistent before saving it).
/// A string instruction with more to transfer exits again with its next chunk, which goes to the bus like any
/// other access; that repeats at most a few times.
pub fn complete_pending_io(vcpu: &mut Vcpu) -> Result<(), MachineError> {
    let index = vcpu.index();
    for _ in 0..MAX_IO_COMPLETIONS {
        vcpu.set_immediate_exit(1);
        match vcpu.run_once() {
            Ok(VcpuExit::Interrupted) => return Ok(()),
            // A stale stop request is consumed without entering KVM_RUN; an I/O chunk was dispatched: go again.
            Ok(VcpuExit::Stopped) => {}
            Ok(exit) if exit.is_io() => {}
            Ok(exit) => {
                vcpu.set_immediate_exit(0);
                return Err(MachineError::NotQuiesced { index, exit: format!("{exit:?}") });
            }
            Err(source) => {
                vcpu.set_immediate_exit(0);
                return Err(MachineError::Vcpu { index, source });
            }
        }
    }
    vcpu.set_immediate_exit(0);
    Err(MachineError::NotQuiesced { index, exit: format!("still in I/O after {MAX_IO_COMPLETIONS} completions") })
}
