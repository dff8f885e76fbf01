//! microVM snapshots: pause a VM at a safe point, save it into a snapshot directory, restore it into a new monitor,
//! or fork it by mapping its memory file copy-on-write.
//!
//! ```text
//! let mut machine = Machine::new(vm, memory, vcpus, devices);   // a VM the monitor built
//! machine.resume()?;                                             // vCPU threads run the guest
//! machine.pause()?;                                              // kicked out of KVM_RUN, pending I/O completed
//! let snap = machine.snapshot(dest, None, &trust)?;              // = VmSnapshot::save(&mut machine, dest, None, &trust)
//!
//! let snap = VmSnapshot::open(dest, &trust)?;                    // seal, sha256 of every file, then the state checked
//! let again = snap.restore(RestoreArgs::default())?;             // RAM copied into a fresh memfd
//! let fork = snap.fork(RestoreArgs { guest_cid: Some(7), ..Default::default() })?; // RAM mapped MAP_PRIVATE
//! ```
//!
//! **Pausing** ([`Machine::pause`]) follows Firecracker: every vCPU thread is kicked (stop flag plus a signal whose
//! handler sets `kvm_run.immediate_exit`, see [`crate::vstate::vcpu`]) and joined; then each vCPU enters `KVM_RUN`
//! once more with `immediate_exit` set, which completes an I/O exit the guest was in the middle of (an `in` whose
//! value is not yet in `RAX`, an MMIO read, a string `out` with more to go) and returns `EINTR` before another guest
//! instruction runs. Only then is the architectural state consistent: saved without that step, a restored guest
//! would repeat or lose the access.
//!
//! **What is saved** ([`MicrovmState`], the file [`STATE_FILE`]): per vCPU everything [`VcpuState`] holds (CPUID,
//! regs, sregs, FPU, XSAVE, XCRs, debug registers, the MSRs of `KVM_GET_MSR_INDEX_LIST` that KVM lets us read,
//! LAPIC, vCPU events, MP state, TSC frequency); for the VM the KVM clock and, with the in-kernel irqchip, both PICs,
//! the IOAPIC and the PIT; the serial UART's registers; each virtio-mmio transport's registers and queues (addresses,
//! sizes, `next_avail`/`next_used`) with its device's own state (vsock: the CID; blk: capacity and disk ID). Guest
//! RAM goes to [`MEMORY_FILE`], laid end to end without the MMIO gap, as a sparse file: a page of zeros is a hole
//! (not written on save, not copied on restore, read as zeros by a fork). vsock connections are not saved: as in
//! Firecracker the restored device starts without them and sends the guest a transport-reset event.
//!
//! **The state file** is a 20-byte header (magic `STRATAVM`, format version, body length; little endian) and a
//! JSON body of plain serde mirrors of the KVM structures. It is read with a size cap, its version checked before
//! the body is parsed, unknown fields refused, and every count and size validated ([`MicrovmState::validate`])
//! before anything reaches KVM: a damaged state is a typed [`VmSnapshotError`], never a panic or a huge
//! allocation. The snapshot directory itself is strata-core's ([`strata_core::SnapshotWriter`]): written atomically
//! under a manifest with every file's sha256, sealed with the host's key ([`SnapshotTrust`]), which
//! [`VmSnapshot::open`] verifies; the state file is parsed from the bytes the manifest sealed (read and checked in
//! one pass, [`Snapshot::read_file`]) and the memory mapped or copied is the memory file's private copy
//! ([`Snapshot::private_copy`]: an unnamed file or a sealed memfd, checked against the manifest as it was filled,
//! which no other process can shrink or write), never the file or a path opened again.
//!
//! **Restore and fork** build a new VM (with an irqchip exactly when the snapshot had one), set the VM state, rebuild
//! the devices on the caller's buses and create the vCPUs from their state; the vCPUs are left paused
//! ([`Machine::resume`] starts them). [`VmSnapshot::restore`] copies RAM into a fresh memfd: the machine owns its
//! memory like a booted one. [`VmSnapshot::fork`] maps the private copy `MAP_PRIVATE`: pages are shared with every
//! other fork until the guest writes them, so forks are cheap and independent, and whatever is done to the
//! snapshot's files while forks live reaches none of them (a mapped file truncated under a fork would raise
//! `SIGBUS` in the monitor). Host resources
//! that are not state come in [`RestoreArgs`]: the vsock socket path, a new guest CID for a fork's identity, the
//! disk images, extra devices on the buses.
//!
//! A booted Linux VM is such a machine too: [`crate::builder::Microvm`] records every device it places in a
//! [`Machine`], and [`crate::builder::Microvm::snapshot`] pauses, saves ([`VmSnapshot::save_with`], with the
//! caller's meta) and resumes it; [`crate::builder::Microvm::fork`] starts a fork of one in a new monitor. The tier
//! puts sessions on top ([`crate::tier`]: the agent quiesced before, reconnected and reseeded after).

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use kvm_bindings::{
    KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, kvm_ioapic_state,
    kvm_ioapic_state__bindgen_ty_1, kvm_irqchip, kvm_pic_state, kvm_pit_channel_state, kvm_pit_state2, kvm_run,
};
use serde::{Deserialize, Serialize};
use strata_core::{Persisted, Snapshot, SnapshotError, SnapshotTrust, SnapshotWriter, TierKind};
use vm_memory::Address;

use crate::devices::bus::{Bus, BusError};
use crate::devices::serial::{
    DEFAULT_LOG_CAPACITY, SERIAL_GSI, SERIAL_PORT_BASE, SERIAL_PORT_LEN, SerialDevice, SerialDeviceState, SerialError,
    SerialLog,
};
use crate::devices::virtio::Interrupt;
use crate::devices::virtio::block::BlockDevice;
use crate::devices::virtio::block::persist::{BlockConstructorArgs, BlockPersistError, BlockState};
use crate::devices::virtio::mmio::{BackendThread, BackendThreadError, MMIO_LEN, MmioTransport};
use crate::devices::virtio::persist::{MmioPersistError, MmioTransportConstructorArgs, MmioTransportState, Persist};
use crate::devices::virtio::vsock::VsockDevice;
use crate::devices::virtio::vsock::persist::{VsockConstructorArgs, VsockPersistError, VsockState};
use crate::vstate::memory::{Backing, GuestMemory, MemoryError, PAGE_SIZE, ram_layout};
use crate::vstate::vcpu::state::VcpuState;
use crate::vstate::vcpu::{Vcpu, VcpuError, VcpuExit, VcpuThread};
use crate::vstate::vm::{ClockState, Vm, VmConfig, VmError};

/// The state file's name inside a snapshot directory.
pub const STATE_FILE: &str = "vmstate";
/// The guest memory file's name inside a snapshot directory.
pub const MEMORY_FILE: &str = "memory";
/// The first bytes of a state file.
pub const STATE_MAGIC: [u8; 8] = *b"STRATAVM";
/// The state format this build writes and reads.
pub const STATE_VERSION: u32 = 1;
/// Magic, version, body length.
pub const STATE_HEADER_LEN: usize = 8 + 4 + 8;
/// The largest state body accepted (a 255-vCPU VM with AMX state is well below it).
pub const MAX_STATE_BYTES: u64 = 32 << 20;
/// Most virtio devices a state may describe.
pub const MAX_VIRTIO_DEVICES: usize = 32;
/// Most vCPUs a state may describe (indices are `u8`).
pub const MAX_VCPUS: usize = u8::MAX as usize;
/// The IOAPIC's input pins (KVM's IOAPIC has 24).
pub const IOAPIC_PINS: usize = 24;
/// Where KVM's IOAPIC lives; it cannot be moved.
pub const IOAPIC_BASE_ADDRESS: u64 = 0xfec0_0000;
/// How many `KVM_RUN`s with `immediate_exit` a pause waits for a vCPU's pending I/O to complete (a string
/// instruction may need a few).
const MAX_IO_COMPLETIONS: usize = 16;

/// Why a snapshot could not be taken, opened, restored or forked.
#[derive(Debug, thiserror::Error)]
pub enum VmSnapshotError {
    /// The snapshot store refused the directory (missing file, checksum, manifest) or could not write it.
    #[error(transparent)]
    Store(#[from] SnapshotError),
    /// A file of the snapshot could not be read or written.
    #[error("cannot access {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The state file does not start with [`STATE_MAGIC`] or is shorter than its header.
    #[error("{path} is not a microVM state file")]
    NotAState {
        /// The file.
        path: PathBuf,
    },
    /// The state file has another format version.
    #[error("the state file has format version {found}; this build reads version {supported}")]
    StateVersion {
        /// The file's.
        found: u32,
        /// [`STATE_VERSION`].
        supported: u32,
    },
    /// The state body is larger than [`MAX_STATE_BYTES`].
    #[error("the state body is {size} bytes, more than the {max} accepted")]
    StateTooLarge {
        /// Its size.
        size: u64,
        /// [`MAX_STATE_BYTES`].
        max: u64,
    },
    /// The header's body length differs from what follows it (truncated or grown).
    #[error("the state header announces {expected} bytes of body, the file has {found}")]
    StateLength {
        /// The header's length.
        expected: u64,
        /// What follows the header.
        found: u64,
    },
    /// The body is not JSON of the expected shape.
    #[error("the state body is malformed: {0}")]
    StateFormat(String),
    /// The state is well-formed but describes something this monitor refuses to build.
    #[error("invalid microVM state: {0}")]
    InvalidState(String),
    /// The snapshot's manifest lacks one of our files.
    #[error("the snapshot has no {0} file")]
    MissingFile(&'static str),
    /// The memory file's size differs from the state's memory size.
    #[error("the memory file is {found} bytes, the state says {expected}")]
    MemorySize {
        /// The state's.
        expected: u64,
        /// The file's.
        found: u64,
    },
    /// The machine's vCPUs are running: pause it first.
    #[error("the machine is running; pause it before taking a snapshot")]
    Running,
    /// The machine has no vCPU to save.
    #[error("the machine has no vCPUs")]
    NoVcpus,
    /// A vCPU could not be paused at a safe point.
    #[error("vCPU {index} did not settle after its pending I/O: {exit}")]
    NotQuiesced {
        /// The vCPU.
        index: u8,
        /// What it did instead.
        exit: String,
    },
    /// A vCPU's `kvm_run` page could not be mapped to complete its pending I/O.
    #[error("cannot map vCPU {index}'s kvm_run page")]
    MapKvmRun {
        /// The vCPU.
        index: u8,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A vCPU's thread, state or creation failed.
    #[error("vCPU {index}")]
    Vcpu {
        /// The vCPU.
        index: u8,
        /// Why.
        #[source]
        source: VcpuError,
    },
    /// Creating or configuring the VM failed.
    #[error("VM")]
    Vm(#[from] VmError),
    /// A KVM ioctl on the VM failed.
    #[error("{op} failed")]
    Kvm {
        /// The ioctl.
        op: &'static str,
        /// Why.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// Guest memory could not be created, mapped or copied.
    #[error("guest memory")]
    Memory(#[from] MemoryError),
    /// A device could not be placed on a bus.
    #[error("device placement")]
    Bus(#[from] BusError),
    /// The serial device could not be restored.
    #[error("serial device")]
    Serial(#[from] SerialError),
    /// A virtio transport's state was refused.
    #[error("virtio device {index} transport")]
    Transport {
        /// The device's position in the state.
        index: usize,
        /// Why.
        #[source]
        source: MmioPersistError,
    },
    /// A vsock device's state was refused.
    #[error("virtio device {index} (vsock)")]
    Vsock {
        /// The device's position in the state.
        index: usize,
        /// Why.
        #[source]
        source: VsockPersistError,
    },
    /// A block device's state was refused.
    #[error("virtio device {index} (block)")]
    Block {
        /// The device's position in the state.
        index: usize,
        /// Why.
        #[source]
        source: BlockPersistError,
    },
    /// A host resource a device needs was not given in [`RestoreArgs`].
    #[error("virtio device {index} needs {what} in the restore arguments")]
    MissingArg {
        /// The device's position in the state.
        index: usize,
        /// What is missing.
        what: &'static str,
    },
    /// A device's interrupt eventfd could not be created.
    #[error("cannot create an interrupt eventfd")]
    Interrupt(#[source] io::Error),
    /// A device's backend thread could not start.
    #[error("cannot start a device backend thread")]
    Backend(#[from] BackendThreadError),
}

fn kvm_error(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmSnapshotError {
    move |source| VmSnapshotError::Kvm { op, source }
}

fn invalid(message: impl Into<String>) -> VmSnapshotError {
    VmSnapshotError::InvalidState(message.into())
}

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> VmSnapshotError + '_ {
    move |source| VmSnapshotError::Io { path: path.to_owned(), source }
}

fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

// ---------------------------------------------------------------------------------------------------------------
// The state: plain serde data.

/// One 8259 PIC (`struct kvm_pic_state`).
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PicState {
    pub last_irr: u8,
    pub irr: u8,
    pub imr: u8,
    pub isr: u8,
    pub priority_add: u8,
    pub irq_base: u8,
    pub read_reg_select: u8,
    pub poll: u8,
    pub special_mask: u8,
    pub init_state: u8,
    pub auto_eoi: u8,
    pub rotate_on_auto_eoi: u8,
    pub special_fully_nested_mode: u8,
    pub init4: u8,
    pub elcr: u8,
    pub elcr_mask: u8,
}

impl From<kvm_pic_state> for PicState {
    fn from(p: kvm_pic_state) -> PicState {
        PicState {
            last_irr: p.last_irr,
            irr: p.irr,
            imr: p.imr,
            isr: p.isr,
            priority_add: p.priority_add,
            irq_base: p.irq_base,
            read_reg_select: p.read_reg_select,
            poll: p.poll,
            special_mask: p.special_mask,
            init_state: p.init_state,
            auto_eoi: p.auto_eoi,
            rotate_on_auto_eoi: p.rotate_on_auto_eoi,
            special_fully_nested_mode: p.special_fully_nested_mode,
            init4: p.init4,
            elcr: p.elcr,
            elcr_mask: p.elcr_mask,
        }
    }
}

impl From<PicState> for kvm_pic_state {
    fn from(p: PicState) -> kvm_pic_state {
        kvm_pic_state {
            last_irr: p.last_irr,
            irr: p.irr,
            imr: p.imr,
            isr: p.isr,
            priority_add: p.priority_add,
            irq_base: p.irq_base,
            read_reg_select: p.read_reg_select,
            poll: p.poll,
            special_mask: p.special_mask,
            init_state: p.init_state,
            auto_eoi: p.auto_eoi,
            rotate_on_auto_eoi: p.rotate_on_auto_eoi,
            special_fully_nested_mode: p.special_fully_nested_mode,
            init4: p.init4,
            elcr: p.elcr,
            elcr_mask: p.elcr_mask,
        }
    }
}

/// The IOAPIC (`struct kvm_ioapic_state`); each redirection-table entry as its 64 raw bits.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IoapicState {
    pub base_address: u64,
    pub ioregsel: u32,
    pub id: u32,
    pub irr: u32,
    pub redirtbl: [u64; IOAPIC_PINS],
}

impl From<kvm_ioapic_state> for IoapicState {
    fn from(s: kvm_ioapic_state) -> IoapicState {
        IoapicState {
            base_address: s.base_address,
            ioregsel: s.ioregsel,
            id: s.id,
            irr: s.irr,
            redirtbl: std::array::from_fn(|pin| {
                // SAFETY: `bits` spans the whole 8-byte union and every bit pattern is a valid u64.
                unsafe { s.redirtbl[pin].bits }
            }),
        }
    }
}

impl From<IoapicState> for kvm_ioapic_state {
    fn from(s: IoapicState) -> kvm_ioapic_state {
        kvm_ioapic_state {
            base_address: s.base_address,
            ioregsel: s.ioregsel,
            id: s.id,
            irr: s.irr,
            pad: 0,
            redirtbl: std::array::from_fn(|pin| kvm_ioapic_state__bindgen_ty_1 { bits: s.redirtbl[pin] }),
        }
    }
}

/// The in-kernel interrupt controllers outside the vCPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IrqchipState {
    /// The master 8259.
    pub pic_master: PicState,
    /// The slave 8259.
    pub pic_slave: PicState,
    /// The IOAPIC.
    pub ioapic: IoapicState,
}

/// One 8254 PIT channel (`struct kvm_pit_channel_state`). `count_load_time` is a host clock reading, kept as KVM
/// gave it, as Firecracker does.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PitChannelState {
    pub count: u32,
    pub latched_count: u16,
    pub count_latched: u8,
    pub status_latched: u8,
    pub status: u8,
    pub read_state: u8,
    pub write_state: u8,
    pub write_latch: u8,
    pub rw_mode: u8,
    pub mode: u8,
    pub bcd: u8,
    pub gate: u8,
    pub count_load_time: i64,
}

impl From<kvm_pit_channel_state> for PitChannelState {
    fn from(c: kvm_pit_channel_state) -> PitChannelState {
        PitChannelState {
            count: c.count,
            latched_count: c.latched_count,
            count_latched: c.count_latched,
            status_latched: c.status_latched,
            status: c.status,
            read_state: c.read_state,
            write_state: c.write_state,
            write_latch: c.write_latch,
            rw_mode: c.rw_mode,
            mode: c.mode,
            bcd: c.bcd,
            gate: c.gate,
            count_load_time: c.count_load_time,
        }
    }
}

impl From<PitChannelState> for kvm_pit_channel_state {
    fn from(c: PitChannelState) -> kvm_pit_channel_state {
        kvm_pit_channel_state {
            count: c.count,
            latched_count: c.latched_count,
            count_latched: c.count_latched,
            status_latched: c.status_latched,
            status: c.status,
            read_state: c.read_state,
            write_state: c.write_state,
            write_latch: c.write_latch,
            rw_mode: c.rw_mode,
            mode: c.mode,
            bcd: c.bcd,
            gate: c.gate,
            count_load_time: c.count_load_time,
        }
    }
}

/// The in-kernel PIT (`struct kvm_pit_state2`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PitState {
    /// Channels 0, 1 and 2.
    pub channels: [PitChannelState; 3],
    /// `KVM_PIT_FLAGS_*`.
    pub flags: u32,
}

/// What belongs to the VM rather than to a vCPU or a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmState {
    /// The KVM clock.
    pub clock: ClockState,
    /// PICs and IOAPIC, when the VM has the in-kernel irqchip.
    pub irqchip: Option<IrqchipState>,
    /// The PIT, which comes with the irqchip.
    pub pit: Option<PitState>,
}

fn get_irqchip(vm: &Vm, chip_id: u32) -> Result<kvm_irqchip, VmSnapshotError> {
    let mut chip = kvm_irqchip { chip_id, ..Default::default() };
    vm.fd().get_irqchip(&mut chip).map_err(kvm_error("KVM_GET_IRQCHIP"))?;
    Ok(chip)
}

impl VmState {
    /// Reads the VM's clock, irqchip and PIT.
    pub fn save(vm: &Vm) -> Result<VmState, VmSnapshotError> {
        let clock = vm.clock()?;
        if !vm.has_irqchip() {
            return Ok(VmState { clock, irqchip: None, pit: None });
        }
        let pic = |chip_id| -> Result<PicState, VmSnapshotError> {
            let chip = get_irqchip(vm, chip_id)?;
            // SAFETY: the union's `pic` member is sixteen u8s, valid for any bits, and it is the member KVM fills
            // for a PIC chip id.
            Ok(PicState::from(unsafe { chip.chip.pic }))
        };
        let pic_master = pic(KVM_IRQCHIP_PIC_MASTER)?;
        let pic_slave = pic(KVM_IRQCHIP_PIC_SLAVE)?;
        let chip = get_irqchip(vm, KVM_IRQCHIP_IOAPIC)?;
        // SAFETY: `ioapic` is integers and unions of integers, valid for any bits, and it is the member KVM fills for
        // the IOAPIC chip id.
        let ioapic = IoapicState::from(unsafe { chip.chip.ioapic });
        let pit = vm.fd().get_pit2().map_err(kvm_error("KVM_GET_PIT2"))?;
        let pit = PitState { channels: pit.channels.map(PitChannelState::from), flags: pit.flags };
        Ok(VmState { clock, irqchip: Some(IrqchipState { pic_master, pic_slave, ioapic }), pit: Some(pit) })
    }

    /// Sets the PIT, the clock and the irqchip of a new VM (Firecracker's order), which must have an irqchip
    /// exactly when the state does.
    pub fn restore(&self, vm: &Vm) -> Result<(), VmSnapshotError> {
        if self.irqchip.is_some() != vm.has_irqchip() {
            return Err(invalid("the VM's irqchip does not match the state's"));
        }
        if let Some(pit) = &self.pit {
            let state = kvm_pit_state2 { channels: pit.channels.map(Into::into), flags: pit.flags, reserved: [0; 9] };
            vm.fd().set_pit2(&state).map_err(kvm_error("KVM_SET_PIT2"))?;
        }
        vm.set_clock(&self.clock)?;
        if let Some(irqchip) = &self.irqchip {
            for (chip_id, pic) in
                [(KVM_IRQCHIP_PIC_MASTER, irqchip.pic_master), (KVM_IRQCHIP_PIC_SLAVE, irqchip.pic_slave)]
            {
                let mut chip = kvm_irqchip { chip_id, ..Default::default() };
                chip.chip.pic = pic.into();
                vm.fd().set_irqchip(&chip).map_err(kvm_error("KVM_SET_IRQCHIP"))?;
            }
            let mut chip = kvm_irqchip { chip_id: KVM_IRQCHIP_IOAPIC, ..Default::default() };
            chip.chip.ioapic = irqchip.ioapic.into();
            vm.fd().set_irqchip(&chip).map_err(kvm_error("KVM_SET_IRQCHIP"))?;
        }
        Ok(())
    }
}

/// A virtio device's own state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum VirtioDeviceState {
    /// virtio-vsock.
    Vsock(VsockState),
    /// virtio-blk.
    Block(BlockState),
}

/// One virtio-mmio device: where it sits, its interrupt, its transport and its device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VirtioSlotState {
    /// Guest-physical base of its 4 KiB register window.
    pub base: u64,
    /// Its GSI.
    pub gsi: u32,
    /// The transport's registers and queues.
    pub transport: MmioTransportState,
    /// The device's state.
    pub device: VirtioDeviceState,
}

/// The devices' state.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DevicesState {
    /// COM1, when the VM has it.
    pub serial: Option<SerialDeviceState>,
    /// The virtio-mmio devices, in placement order.
    pub virtio: Vec<VirtioSlotState>,
}

/// Everything but guest RAM: what [`STATE_FILE`] holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MicrovmState {
    /// Guest RAM in bytes (the size of [`MEMORY_FILE`]).
    pub memory_bytes: u64,
    /// VM-level state.
    pub vm: VmState,
    /// Every vCPU, by index.
    pub vcpus: Vec<VcpuState>,
    /// The devices.
    pub devices: DevicesState,
}

impl MicrovmState {
    /// Checks every count, size and cross-reference before anything is built from the state.
    pub fn validate(&self) -> Result<(), VmSnapshotError> {
        ram_layout(self.memory_bytes)?;
        let irqchip = self.vm.irqchip.is_some();
        if self.vm.pit.is_some() != irqchip {
            return Err(invalid("a PIT without the irqchip, or the irqchip without a PIT"));
        }
        if let Some(chip) = &self.vm.irqchip
            && chip.ioapic.base_address != IOAPIC_BASE_ADDRESS
        {
            return Err(invalid(format!(
                "IOAPIC base {:#x} is not {IOAPIC_BASE_ADDRESS:#x}",
                chip.ioapic.base_address
            )));
        }
        if self.vcpus.is_empty() || self.vcpus.len() > MAX_VCPUS {
            return Err(invalid(format!("{} vCPUs (1 to {MAX_VCPUS} accepted)", self.vcpus.len())));
        }
        for (index, vcpu) in self.vcpus.iter().enumerate() {
            let index = u8::try_from(index).map_err(|_| invalid("vCPU index out of range"))?;
            vcpu.validate().map_err(|source| VmSnapshotError::Vcpu { index, source })?;
            if vcpu.lapic.is_some() != irqchip {
                return Err(invalid(format!("vCPU {index} has a LAPIC exactly when the VM has no irqchip")));
            }
        }
        if let Some(serial) = &self.devices.serial
            && serial.in_buffer.len() > crate::devices::serial::SERIAL_FIFO_SIZE
        {
            return Err(invalid(format!("the serial FIFO holds {} bytes", serial.in_buffer.len())));
        }
        let virtio = &self.devices.virtio;
        if virtio.len() > MAX_VIRTIO_DEVICES {
            return Err(invalid(format!("{} virtio devices (at most {MAX_VIRTIO_DEVICES})", virtio.len())));
        }
        let mut vsocks = 0;
        for (index, slot) in virtio.iter().enumerate() {
            if slot.base.checked_add(MMIO_LEN).is_none() || !slot.base.is_multiple_of(MMIO_LEN) {
                return Err(invalid(format!("virtio device {index} base {:#x} is not a 4 KiB window", slot.base)));
            }
            if irqchip && usize::try_from(slot.gsi).map_or(true, |gsi| gsi >= IOAPIC_PINS) {
                return Err(invalid(format!("virtio device {index} GSI {} is not an IOAPIC pin", slot.gsi)));
            }
            if slot.transport.queues.len() > usize::from(u8::MAX) {
                return Err(invalid(format!("virtio device {index} has {} queues", slot.transport.queues.len())));
            }
            if matches!(slot.device, VirtioDeviceState::Vsock(_)) {
                vsocks += 1;
            }
        }
        if vsocks > 1 {
            return Err(invalid(format!("{vsocks} vsock devices (at most one)")));
        }
        Ok(())
    }

    /// The state file's bytes: header, then the JSON body.
    pub fn to_bytes(&self) -> Result<Vec<u8>, VmSnapshotError> {
        let body = serde_json::to_vec(self).map_err(|e| VmSnapshotError::StateFormat(e.to_string()))?;
        let mut bytes = Vec::with_capacity(STATE_HEADER_LEN + body.len());
        bytes.extend_from_slice(&STATE_MAGIC);
        bytes.extend_from_slice(&STATE_VERSION.to_le_bytes());
        bytes.extend_from_slice(&(body.len() as u64).to_le_bytes());
        bytes.extend_from_slice(&body);
        Ok(bytes)
    }

    /// Parses and validates a state file's bytes (`path` only names it in errors).
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<MicrovmState, VmSnapshotError> {
        let not_a_state = || VmSnapshotError::NotAState { path: path.to_owned() };
        let (header, body) = bytes.split_at_checked(STATE_HEADER_LEN).ok_or_else(not_a_state)?;
        let (magic, rest) = header.split_at(8);
        if magic != STATE_MAGIC {
            return Err(not_a_state());
        }
        let (version, length) = rest.split_at(4);
        let version = u32::from_le_bytes(version.try_into().map_err(|_| not_a_state())?);
        if version != STATE_VERSION {
            return Err(VmSnapshotError::StateVersion { found: version, supported: STATE_VERSION });
        }
        let expected = u64::from_le_bytes(length.try_into().map_err(|_| not_a_state())?);
        if expected > MAX_STATE_BYTES {
            return Err(VmSnapshotError::StateTooLarge { size: expected, max: MAX_STATE_BYTES });
        }
        let found = body.len() as u64;
        if found != expected {
            return Err(VmSnapshotError::StateLength { expected, found });
        }
        let state: MicrovmState =
            serde_json::from_slice(body).map_err(|e| VmSnapshotError::StateFormat(e.to_string()))?;
        state.validate()?;
        Ok(state)
    }

    /// Reads a state file: at most [`MAX_STATE_BYTES`] of body, whatever its header claims.
    pub fn read(path: &Path) -> Result<MicrovmState, VmSnapshotError> {
        let file = File::open(path).map_err(io_error(path))?;
        let cap = MAX_STATE_BYTES + STATE_HEADER_LEN as u64;
        let size = file.metadata().map_err(io_error(path))?.len();
        if size > cap {
            return Err(VmSnapshotError::StateTooLarge { size: size - STATE_HEADER_LEN as u64, max: MAX_STATE_BYTES });
        }
        let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
        file.take(cap + 1).read_to_end(&mut bytes).map_err(io_error(path))?;
        MicrovmState::from_bytes(&bytes, path)
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The live machine.

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
    fn save_with<R>(
        &self,
        then: impl FnOnce(DevicesState) -> Result<R, VmSnapshotError>,
    ) -> Result<R, VmSnapshotError> {
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
    pub fn resume(&mut self) -> Result<(), VmSnapshotError> {
        for vcpu in std::mem::take(&mut self.vcpus) {
            let index = vcpu.index();
            self.running.push(vcpu.start().map_err(|source| VmSnapshotError::Vcpu { index, source })?);
        }
        Ok(())
    }

    /// Stops every vCPU at a safe point: kicks them all, joins their threads, then completes any pending I/O
    /// ([`complete_pending_io`]). Returns how each vCPU's run ended ([`VcpuExit::Stopped`] when the kick stopped
    /// it; a halt or shutdown when the guest got there first). A paused machine stays paused.
    pub fn pause(&mut self) -> Result<Vec<VcpuExit>, VmSnapshotError> {
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
                            first_error.get_or_insert(VmSnapshotError::Vcpu { index, source });
                        }
                    }
                    self.vcpus.push(vcpu);
                }
                Err(source) => {
                    first_error.get_or_insert(VmSnapshotError::Vcpu { index: u8::MAX, source });
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

    /// Saves the paused machine into a new snapshot directory at `dest` ([`VmSnapshot::save`]).
    pub fn snapshot(
        &mut self,
        dest: &Path,
        parent: Option<String>,
        trust: &SnapshotTrust,
    ) -> Result<VmSnapshot, VmSnapshotError> {
        VmSnapshot::save(self, dest, parent, trust)
    }

    /// The machine's state (not its memory), saved under the device locks. Pending I/O of a vCPU driven with
    /// [`Vcpu::run_once`] is completed first ([`complete_pending_io`]).
    pub fn save_state(&mut self) -> Result<MicrovmState, VmSnapshotError> {
        self.save_state_with(|state, _| Ok(state.clone()))
    }

    fn save_state_with<R>(
        &mut self,
        then: impl FnOnce(&MicrovmState, &GuestMemory) -> Result<R, VmSnapshotError>,
    ) -> Result<R, VmSnapshotError> {
        if self.is_running() {
            return Err(VmSnapshotError::Running);
        }
        if self.vcpus.is_empty() {
            return Err(VmSnapshotError::NoVcpus);
        }
        for vcpu in &mut self.vcpus {
            complete_pending_io(vcpu)?;
        }
        let vm = VmState::save(&self.vm)?;
        let vcpus = self
            .vcpus
            .iter()
            .map(|vcpu| vcpu.save_state().map_err(|source| VmSnapshotError::Vcpu { index: vcpu.index(), source }))
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

// ---------------------------------------------------------------------------------------------------------------
// Pausing at a safe point.

/// The bytes of the second `kvm_run` mapping (one page; `struct kvm_run` fits in it by design).
const KVM_RUN_MAP_LEN: usize = 4096;
const _: () = assert!(std::mem::size_of::<kvm_run>() <= KVM_RUN_MAP_LEN);

/// A second mapping of a vCPU's `kvm_run` page, to set `immediate_exit` from outside [`Vcpu`] (which keeps its own
/// mapping to itself). Unmapped on drop.
struct KvmRunMap {
    run: NonNull<kvm_run>,
}

impl KvmRunMap {
    fn new(vcpu: &Vcpu) -> io::Result<KvmRunMap> {
        // SAFETY: mmap of a vCPU fd at offset 0 maps its kvm_run page, as KVM documents; the kernel picks a fresh
        // address (no hint, no MAP_FIXED), so no existing mapping is touched; the result is checked below.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                KVM_RUN_MAP_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                vcpu.fd().as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let run = NonNull::new(addr.cast::<kvm_run>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(KvmRunMap { run })
    }

    fn set_immediate_exit(&self, value: u8) {
        // SAFETY: `run` is a live, writable, page-aligned mapping of the vCPU's kvm_run for as long as `self` lives.
        // The byte is shared with the kernel and with the vCPU's own mapping of the same page, so it is written as a
        // volatile byte through a raw pointer, without creating a reference to the structure.
        unsafe { (&raw mut (*self.run.as_ptr()).immediate_exit).write_volatile(value) };
    }
}

impl Drop for KvmRunMap {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping `new` made, which nothing else refers to once `self` goes.
        if unsafe { libc::munmap(self.run.as_ptr().cast(), KVM_RUN_MAP_LEN) } != 0 {
            log::warn!("snapshot: cannot unmap a kvm_run page: {}", io::Error::last_os_error());
        }
    }
}

/// Finishes whatever I/O exit a stopped vCPU was in the middle of, without running another guest instruction:
/// `KVM_RUN` with `immediate_exit` set completes the pending access (loading an `in`'s value into `RAX`, advancing
/// `RIP` past an `out`) and returns `EINTR` (KVM's documented way to make the state consistent before saving it).
/// A string instruction with more to transfer exits again with its next chunk, which goes to the bus like any
/// other access; that repeats at most a few times.
pub fn complete_pending_io(vcpu: &mut Vcpu) -> Result<(), VmSnapshotError> {
    let index = vcpu.index();
    let run = KvmRunMap::new(vcpu).map_err(|source| VmSnapshotError::MapKvmRun { index, source })?;
    for _ in 0..MAX_IO_COMPLETIONS {
        run.set_immediate_exit(1);
        match vcpu.run_once() {
            Ok(VcpuExit::Interrupted) => return Ok(()),
            // A stale stop request is consumed without entering KVM_RUN; an I/O chunk was dispatched: go again.
            Ok(VcpuExit::Stopped) => {}
            Ok(exit) if exit.is_io() => {}
            Ok(exit) => {
                run.set_immediate_exit(0);
                return Err(VmSnapshotError::NotQuiesced { index, exit: format!("{exit:?}") });
            }
            Err(source) => {
                run.set_immediate_exit(0);
                return Err(VmSnapshotError::Vcpu { index, source });
            }
        }
    }
    run.set_immediate_exit(0);
    Err(VmSnapshotError::NotQuiesced { index, exit: format!("still in I/O after {MAX_IO_COMPLETIONS} completions") })
}

// ---------------------------------------------------------------------------------------------------------------
// Guest memory, sparse: a page of zeros is a hole in the memory file and is never written into a restored memfd.

/// The chunk memory is copied in.
const COPY_CHUNK: usize = 1 << 20;

/// Data extents of `file` as `(offset, len)`, by `SEEK_DATA`/`SEEK_HOLE`; all of `0..size` when the filesystem
/// cannot tell.
fn data_extents(file: &File, size: u64) -> Vec<(u64, u64)> {
    use nix::unistd::{Whence, lseek};
    let whole = vec![(0, size)];
    let mut extents = Vec::new();
    let mut pos: u64 = 0;
    while pos < size {
        let Ok(offset) = i64::try_from(pos) else { return whole };
        let start = match lseek(file, offset, Whence::SeekData) {
            Ok(start) => start,
            Err(nix::errno::Errno::ENXIO) => break,
            Err(_) => return whole,
        };
        let Ok(end) = lseek(file, start, Whence::SeekHole) else { return whole };
        let (Ok(start), Ok(end)) = (u64::try_from(start), u64::try_from(end)) else { return whole };
        let end = end.min(size);
        if end <= start {
            break;
        }
        extents.push((start, end - start));
        pos = end;
    }
    extents
}

/// Copies memory into `out` chunk by chunk, writing only the runs of pages that are not all zeros.
struct SparseCopy<'a> {
    out: &'a File,
    buf: Vec<u8>,
}

impl<'a> SparseCopy<'a> {
    fn new(out: &'a File) -> SparseCopy<'a> {
        SparseCopy { out, buf: vec![0; COPY_CHUNK] }
    }

    /// Copies `start..start + len` (file offsets): `read` fills a buffer from an offset.
    fn copy_range(
        &mut self,
        start: u64,
        len: u64,
        mut read: impl FnMut(u64, &mut [u8]) -> io::Result<()>,
    ) -> io::Result<()> {
        let end = start.checked_add(len).ok_or_else(|| io::Error::other("memory range overflows"))?;
        let mut offset = start;
        while offset < end {
            let n = usize::try_from(end - offset).unwrap_or(usize::MAX).min(self.buf.len());
            let chunk = &mut self.buf[..n];
            read(offset, chunk)?;
            write_nonzero_runs(self.out, offset, chunk)?;
            offset += n as u64;
        }
        Ok(())
    }
}

/// Writes the runs of not-all-zero pages of `chunk` (which sits at file offset `offset`) to `out`.
fn write_nonzero_runs(out: &File, offset: u64, chunk: &[u8]) -> io::Result<()> {
    let page = PAGE_SIZE as usize;
    let mut run: Option<usize> = None;
    for (i, bytes) in chunk.chunks(page).enumerate() {
        let zero = bytes.iter().all(|b| *b == 0);
        match (zero, run) {
            (false, None) => run = Some(i * page),
            (true, Some(from)) => {
                out.write_all_at(&chunk[from..i * page], offset + from as u64)?;
                run = None;
            }
            _ => {}
        }
    }
    if let Some(from) = run {
        out.write_all_at(&chunk[from..], offset + from as u64)?;
    }
    Ok(())
}

/// Writes guest RAM to `out` as the memory file (RAM laid end to end), sparse: zero pages are holes. A memfd is
/// read with `pread` between its holes (reading its mapping would allocate every page); a fork's private mapping is
/// read through the mapping, which holds its own writes.
fn write_memory(memory: &GuestMemory, out: &File) -> io::Result<()> {
    let size = memory.size();
    let mut copy = SparseCopy::new(out);
    match memory.backing() {
        Backing::Memfd => {
            let file = memory.file();
            for (start, len) in data_extents(file, size) {
                copy.copy_range(start, len, |offset, buf| file.read_exact_at(buf, offset))?;
            }
        }
        Backing::PrivateFile => {
            let mut file_offset = 0u64;
            for (addr, len, _) in memory.regions() {
                let base = file_offset;
                copy.copy_range(base, len, |offset, buf| {
                    let at = addr.checked_add(offset - base).ok_or_else(|| io::Error::other("address overflow"))?;
                    memory.read(at, buf).map_err(io::Error::other)
                })?;
                file_offset += len;
            }
        }
    }
    out.set_len(size)
}

// ---------------------------------------------------------------------------------------------------------------
// Snapshots on disk.

/// Host resources a restored or forked machine is built with: what a snapshot cannot carry.
#[derive(Debug, Default)]
pub struct RestoreArgs {
    /// The port bus to place the restored serial device on; may already hold the caller's own devices.
    pub io_bus: Bus,
    /// The MMIO bus to place the restored virtio devices on; may already hold the caller's own devices.
    pub mmio_bus: Bus,
    /// The host socket for the vsock device (must not exist); required when the snapshot has one.
    pub vsock_uds: Option<PathBuf>,
    /// A new guest CID (a fork's identity); `None` keeps the saved one.
    pub guest_cid: Option<u64>,
    /// The disk images for the block devices, in the order of the state's block devices; each must have the saved
    /// size.
    pub disks: Vec<PathBuf>,
    /// The console log for the restored serial device; a new one of [`DEFAULT_LOG_CAPACITY`] when `None`.
    pub serial_log: Option<SerialLog>,
}

/// What a snapshot's caller adds to the machine's own description ([`VmSnapshot::save_with`]).
#[derive(Debug, Clone, Default)]
pub struct SnapshotExtra {
    /// Kinds of state the saved memory holds besides memory, CPU and devices.
    pub persists: Vec<Persisted>,
    /// More keys for the manifest's meta object.
    pub meta: serde_json::Map<String, serde_json::Value>,
}

/// A verified snapshot of a microVM: its directory (checked against its manifest) and its parsed, validated state.
/// Restoring or forking from it any number of times reads the state once.
#[derive(Debug, Clone)]
pub struct VmSnapshot {
    snapshot: Snapshot,
    state: MicrovmState,
}

impl VmSnapshot {
    /// Saves a paused machine into a new snapshot directory at `dest` (which must not exist): vCPU I/O in flight
    /// completed ([`complete_pending_io`]), then the state file and
    /// the memory file, written under the device locks, then sealed by [`SnapshotWriter::commit`] (sha256 of each
    /// file, the seal of `trust`'s key, fsync, atomic rename). `parent` is the snapshot the machine was forked from,
    /// if any.
    pub fn save(
        machine: &mut Machine,
        dest: &Path,
        parent: Option<String>,
        trust: &SnapshotTrust,
    ) -> Result<VmSnapshot, VmSnapshotError> {
        VmSnapshot::save_with(machine, dest, parent, SnapshotExtra::default(), trust)
    }

    /// [`VmSnapshot::save`], with what the caller knows about the guest beyond the machine: more kinds of state
    /// that the saved memory holds (a booted Linux keeps its files and processes in RAM) and more meta keys (the
    /// tier's capabilities and images). A key of `extra.meta` never replaces one of the machine's own.
    pub fn save_with(
        machine: &mut Machine,
        dest: &Path,
        parent: Option<String>,
        extra: SnapshotExtra,
        trust: &SnapshotTrust,
    ) -> Result<VmSnapshot, VmSnapshotError> {
        let writer = SnapshotWriter::create(dest, trust)?;
        let state = machine.save_state_with(|state, memory| {
            let path = writer.dir().join(STATE_FILE);
            let bytes = state.to_bytes()?;
            File::create(&path).and_then(|mut f| f.write_all(&bytes)).map_err(io_error(&path))?;
            let path = writer.dir().join(MEMORY_FILE);
            let file = File::create(&path).map_err(io_error(&path))?;
            write_memory(memory, &file).map_err(io_error(&path))?;
            Ok(state.clone())
        })?;
        let meta = serde_json::json!({
            "state_file": STATE_FILE,
            "state_version": STATE_VERSION,
            "memory_file": MEMORY_FILE,
            "memory_bytes": state.memory_bytes,
            "vcpus": state.vcpus.len(),
            "irqchip": state.vm.irqchip.is_some(),
            "serial": state.devices.serial.is_some(),
            "virtio": state.devices.virtio.iter().map(|slot| match slot.device {
                VirtioDeviceState::Vsock(_) => "vsock",
                VirtioDeviceState::Block(_) => "block",
            }).collect::<Vec<_>>(),
        });
        let mut meta = meta;
        if let Some(object) = meta.as_object_mut() {
            for (key, value) in extra.meta {
                object.entry(key).or_insert(value);
            }
        }
        let mut persists = vec![Persisted::Memory, Persisted::Cpu, Persisted::Devices];
        for kind in extra.persists {
            if !persists.contains(&kind) {
                persists.push(kind);
            }
        }
        persists.sort();
        let snapshot = writer.commit(TierKind::Microvm, parent, persists, meta)?;
        Ok(VmSnapshot { snapshot, state })
    }

    /// Opens a snapshot directory: the seal, the manifest and every file's sha256 ([`SnapshotTrust::open_for`]),
    /// then the state file (header, version, size cap, shape, [`MicrovmState::validate`]) and the memory file's size.
    pub fn open(dir: &Path, trust: &SnapshotTrust) -> Result<VmSnapshot, VmSnapshotError> {
        VmSnapshot::from_verified(trust.open_for(dir, TierKind::Microvm)?)
    }

    /// As [`VmSnapshot::open`], for a snapshot a [`SnapshotTrust`] has already verified (opened or re-opened).
    pub fn from_verified(snapshot: Snapshot) -> Result<VmSnapshot, VmSnapshotError> {
        if snapshot.tier != TierKind::Microvm {
            return Err(SnapshotError::WrongTier {
                dir: snapshot.dir.clone(),
                expected: TierKind::Microvm,
                found: snapshot.tier,
            }
            .into());
        }
        let listed = |name: &str| snapshot.manifest.files.iter().find(|f| f.path == name).map(|f| f.size);
        listed(STATE_FILE).ok_or(VmSnapshotError::MissingFile(STATE_FILE))?;
        let memory_size = listed(MEMORY_FILE).ok_or(VmSnapshotError::MissingFile(MEMORY_FILE))?;
        let bytes = snapshot.read_file(STATE_FILE, MAX_STATE_BYTES + STATE_HEADER_LEN as u64)?;
        let state = MicrovmState::from_bytes(&bytes, &snapshot.file(STATE_FILE))?;
        if memory_size != state.memory_bytes {
            return Err(VmSnapshotError::MemorySize { expected: state.memory_bytes, found: memory_size });
        }
        Ok(VmSnapshot { snapshot, state })
    }

    /// The snapshot directory and manifest.
    pub fn snapshot(&self) -> &Snapshot {
        &self.snapshot
    }

    /// The saved state.
    pub fn state(&self) -> &MicrovmState {
        &self.state
    }

    /// The memory file.
    pub fn memory_path(&self) -> PathBuf {
        self.snapshot.file(MEMORY_FILE)
    }

    /// Rebuilds the machine with its own copy of RAM (a fresh memfd, the memory file's non-zero pages written
    /// into it): independent of the snapshot's files once it returns. The vCPUs are paused.
    pub fn restore(&self, args: RestoreArgs) -> Result<Machine, VmSnapshotError> {
        let memory = GuestMemory::new(self.state.memory_bytes)?;
        let path = self.memory_path();
        // From the private copy, not the file: the bytes copied are the ones the manifest names, whatever happens
        // to the file meanwhile.
        let copy = self.snapshot.private_copy(MEMORY_FILE)?;
        let source = copy.file();
        let found = copy.len();
        if found != self.state.memory_bytes {
            return Err(VmSnapshotError::MemorySize { expected: self.state.memory_bytes, found });
        }
        // Only the pages that hold data: the memfd's holes read as zero, and cost nothing until the guest uses them.
        let size = self.state.memory_bytes;
        let mut sparse = SparseCopy::new(memory.file());
        for (start, len) in data_extents(source, size) {
            sparse.copy_range(start, len, |offset, buf| source.read_exact_at(buf, offset)).map_err(io_error(&path))?;
        }
        self.build(memory, args)
    }

    /// Rebuilds the machine over the memory file's private copy ([`Snapshot::private_copy`], made once and
    /// checked against the manifest as it is made) mapped `MAP_PRIVATE`: it shares every page it has not written
    /// with every other fork, its writes reach no one else, and nothing done to the snapshot's file afterwards
    /// reaches it (a truncated mapped file would kill the monitor with `SIGBUS`). Give it a new identity in
    /// `args` (`guest_cid`). The vCPUs are paused.
    pub fn fork(&self, args: RestoreArgs) -> Result<Machine, VmSnapshotError> {
        let path = self.memory_path();
        let copy = self.snapshot.private_copy(MEMORY_FILE)?;
        let file = copy.file().try_clone().map_err(io_error(&path))?;
        let memory = GuestMemory::from_open_file_private(file, &path)?;
        if memory.size() != self.state.memory_bytes {
            return Err(VmSnapshotError::MemorySize { expected: self.state.memory_bytes, found: memory.size() });
        }
        self.build(memory, args)
    }

    fn build(&self, memory: GuestMemory, args: RestoreArgs) -> Result<Machine, VmSnapshotError> {
        let state = &self.state;
        let irqchip = state.vm.irqchip.is_some();
        let mut vm = Vm::new(&VmConfig { irqchip })?;
        vm.register_memory(&memory)?;
        state.vm.restore(&vm)?;

        let RestoreArgs { mut io_bus, mut mmio_bus, vsock_uds, guest_cid, disks, serial_log } = args;
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
            let interrupt = Interrupt::new().map_err(VmSnapshotError::Interrupt)?;
            if irqchip {
                vm.register_irqfd(interrupt.irqfd(), slot.gsi)?;
            }
            let mem = memory.mmap().clone();
            let transport_error = |source| VmSnapshotError::Transport { index, source };
            let transport = match &slot.device {
                VirtioDeviceState::Vsock(device_state) => {
                    let uds_path = vsock_uds.take().ok_or(VmSnapshotError::MissingArg { index, what: "vsock_uds" })?;
                    let device = VsockDevice::restore(VsockConstructorArgs { uds_path, guest_cid }, device_state)
                        .map_err(|source| VmSnapshotError::Vsock { index, source })?;
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
                    let path = disks.next().ok_or(VmSnapshotError::MissingArg { index, what: "a disk path" })?;
                    let device = BlockDevice::restore(BlockConstructorArgs { path }, device_state)
                        .map_err(|source| VmSnapshotError::Block { index, source })?;
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
            let index = u8::try_from(index).map_err(|_| invalid("vCPU index out of range"))?;
            let vcpu_error = |source| VmSnapshotError::Vcpu { index, source };
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vstate::vcpu::state::{DebugRegs, Fpu, Regs, Sregs, VcpuEvents};

    fn vcpu_state(lapic: bool) -> VcpuState {
        VcpuState {
            cpuid: vec![Default::default()],
            mp_state: 0,
            regs: Regs::default(),
            sregs: Sregs::default(),
            fpu: Fpu::default(),
            xsave: None,
            xcrs: None,
            debug_regs: DebugRegs::default(),
            lapic: lapic.then(|| vec![0; 1024]),
            msrs: Vec::new(),
            events: VcpuEvents::default(),
            tsc_khz: None,
        }
    }

    fn state() -> MicrovmState {
        MicrovmState {
            memory_bytes: 2 << 20,
            vm: VmState { clock: ClockState { clock: 1, flags: 0 }, irqchip: None, pit: None },
            vcpus: vec![vcpu_state(false)],
            devices: DevicesState::default(),
        }
    }

    fn parse(bytes: &[u8]) -> Result<MicrovmState, VmSnapshotError> {
        MicrovmState::from_bytes(bytes, Path::new("vmstate"))
    }

    #[test]
    fn state_bytes_round_trip() {
        let s = state();
        assert_eq!(parse(&s.to_bytes().expect("bytes")).expect("parse"), s);
    }

    #[test]
    fn damaged_headers_are_typed_errors() {
        let bytes = state().to_bytes().expect("bytes");
        assert!(matches!(parse(&bytes[..10]), Err(VmSnapshotError::NotAState { .. })));
        let mut wrong = bytes.clone();
        wrong[0] = b'X';
        assert!(matches!(parse(&wrong), Err(VmSnapshotError::NotAState { .. })));
        let mut version = bytes.clone();
        version[8] = 9;
        assert!(matches!(parse(&version), Err(VmSnapshotError::StateVersion { found: 9, supported: 1 })));
        assert!(matches!(parse(&bytes[..bytes.len() - 1]), Err(VmSnapshotError::StateLength { .. })));
        let mut huge = bytes.clone();
        huge[12..20].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(parse(&huge), Err(VmSnapshotError::StateTooLarge { .. })));
        let mut garbage = bytes[..STATE_HEADER_LEN].to_vec();
        garbage[12..20].copy_from_slice(&4u64.to_le_bytes());
        garbage.extend_from_slice(b"{]}x");
        assert!(matches!(parse(&garbage), Err(VmSnapshotError::StateFormat(_))));
    }

    #[test]
    fn invalid_states_are_refused() {
        let mut cases: Vec<(&str, MicrovmState)> = Vec::new();
        let mut s = state();
        s.vcpus.clear();
        cases.push(("no vCPUs", s));
        let mut s = state();
        s.vcpus = vec![vcpu_state(false); MAX_VCPUS + 1];
        cases.push(("too many vCPUs", s));
        let mut s = state();
        s.memory_bytes = 4097;
        cases.push(("unaligned memory", s));
        let mut s = state();
        s.vcpus[0].lapic = Some(vec![0; 1024]);
        cases.push(("a LAPIC without irqchip", s));
        let mut s = state();
        s.vcpus[0].lapic = Some(vec![0; 4]);
        cases.push(("a short LAPIC", s));
        let mut s = state();
        s.vm.pit = Some(PitState { channels: [PitChannelState::default(); 3], flags: 0 });
        cases.push(("a PIT without irqchip", s));
        let mut s = state();
        s.devices.serial = Some(SerialDeviceState {
            baud_divisor_low: 0,
            baud_divisor_high: 0,
            interrupt_enable: 0,
            interrupt_identification: 0,
            line_control: 0,
            line_status: 0,
            modem_control: 0,
            modem_status: 0,
            scratch: 0,
            in_buffer: vec![0; 65],
        });
        cases.push(("an overfull serial FIFO", s));
        for (what, s) in cases {
            let bytes = s.to_bytes().expect("bytes");
            assert!(parse(&bytes).is_err(), "{what} was accepted");
        }
    }

    #[test]
    fn unknown_fields_are_refused() {
        let bytes = state().to_bytes().expect("bytes");
        let mut value: serde_json::Value = serde_json::from_slice(&bytes[STATE_HEADER_LEN..]).expect("json");
        value["surprise"] = serde_json::Value::Bool(true);
        let body = serde_json::to_vec(&value).expect("json");
        let mut bytes = bytes[..STATE_HEADER_LEN].to_vec();
        bytes[12..20].copy_from_slice(&(body.len() as u64).to_le_bytes());
        bytes.extend_from_slice(&body);
        assert!(matches!(parse(&bytes), Err(VmSnapshotError::StateFormat(_))));
    }
}
