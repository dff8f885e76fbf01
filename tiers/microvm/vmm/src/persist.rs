//! What a microVM's snapshot is made of, as data: the state file's format and the rebuilding of a machine from it.
//!
//! **What is saved** ([`MicrovmState`], the file [`STATE_FILE`]): per vCPU everything [`VcpuState`] holds (CPUID,
//! regs, sregs, FPU, XSAVE, XCRs, debug registers, the MSRs of `KVM_GET_MSR_INDEX_LIST` that KVM lets us read,
//! LAPIC, vCPU events, MP state, TSC frequency); for the VM ([`VmState`]) the KVM clock and, with the in-kernel
//! irqchip, both PICs, the IOAPIC and the PIT; the serial UART's registers; each virtio-mmio transport's registers
//! and queues (addresses, sizes, `next_avail`/`next_used`) with its device's own state (vsock: the CID; blk:
//! capacity and disk ID). Guest RAM goes to [`MEMORY_FILE`], laid end to end without the MMIO gap, as a sparse file
//! ([`crate::vstate::memory::GuestMemory::write_sparse`]): a page of zeros is a hole. vsock connections are not saved: as in Firecracker
//! the restored device starts without them and sends the guest a transport-reset event.
//!
//! **The state file** is a 20-byte header (magic `STRATAVM`, format version, body length; little endian) and a
//! JSON body of plain serde mirrors of the KVM structures. It is read with a size cap, its version checked before
//! the body is parsed, unknown fields refused, and every count and size validated ([`MicrovmState::validate`])
//! before anything reaches KVM: a damaged state is a typed [`MachineError`], never a panic or a huge allocation.
//! The sealed snapshot directory around these files is the tier's (`strata-tier-microvm`'s `snapshot` module).
//!
//! Rebuilding a machine from a state is `Machine::restore`, in the `machine` module.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::devices::bus::Bus;
use crate::devices::serial::{SerialDeviceState, SerialLog};
use crate::devices::virtio::block::persist::{BlockConstructorArgs, BlockState};
use crate::devices::virtio::mmio::MMIO_LEN;
use crate::devices::virtio::persist::MmioTransportState;
use crate::devices::virtio::vsock::persist::VsockState;
use crate::error::MachineError;
use crate::vstate::memory::ram_layout;
use crate::vstate::vcpu::state::VcpuState;
use crate::vstate::vm::VmState;

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

/// Host resources a restored or forked machine is built with: what a snapshot cannot carry.
#[derive(Debug, Default)]
pub struct RestoreArgs {
    /// `/dev/kvm`, already open (the jailed monitor cannot open it); opened here when `None`.
    pub kvm: Option<kvm_ioctls::Kvm>,
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
    pub disks: Vec<BlockConstructorArgs>,
    /// The console log for the restored serial device; a new one of [`DEFAULT_LOG_CAPACITY`](crate::devices::serial::DEFAULT_LOG_CAPACITY) when `None`.
    pub serial_log: Option<SerialLog>,
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
    pub fn validate(&self) -> Result<(), MachineError> {
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
            vcpu.validate().map_err(|source| MachineError::Vcpu { index, source })?;
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
    pub fn to_bytes(&self) -> Result<Vec<u8>, MachineError> {
        let body = serde_json::to_vec(self).map_err(|e| MachineError::StateFormat(e.to_string()))?;
        let mut bytes = Vec::with_capacity(STATE_HEADER_LEN + body.len());
        bytes.extend_from_slice(&STATE_MAGIC);
        bytes.extend_from_slice(&STATE_VERSION.to_le_bytes());
        bytes.extend_from_slice(&(body.len() as u64).to_le_bytes());
        bytes.extend_from_slice(&body);
        Ok(bytes)
    }

    /// Parses and validates a state file's bytes (`path` only names it in errors).
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<MicrovmState, MachineError> {
        let not_a_state = || MachineError::NotAState { path: path.to_owned() };
        let (header, body) = bytes.split_at_checked(STATE_HEADER_LEN).ok_or_else(not_a_state)?;
        let (magic, rest) = header.split_at(8);
        if magic != STATE_MAGIC {
            return Err(not_a_state());
        }
        let (version, length) = rest.split_at(4);
        let version = u32::from_le_bytes(version.try_into().map_err(|_| not_a_state())?);
        if version != STATE_VERSION {
            return Err(MachineError::StateVersion { found: version, supported: STATE_VERSION });
        }
        let expected = u64::from_le_bytes(length.try_into().map_err(|_| not_a_state())?);
        if expected > MAX_STATE_BYTES {
            return Err(MachineError::StateTooLarge { size: expected, max: MAX_STATE_BYTES });
        }
        let found = body.len() as u64;
        if found != expected {
            return Err(MachineError::StateLength { expected, found });
        }
        let state: MicrovmState = serde_json::from_slice(body).map_err(|e| MachineError::StateFormat(e.to_string()))?;
        state.validate()?;
        Ok(state)
    }

    /// Reads a state file: at most [`MAX_STATE_BYTES`] of body, whatever its header claims.
    pub fn read(path: &Path) -> Result<MicrovmState, MachineError> {
        let file = File::open(path).map_err(io_error(path))?;
        let cap = MAX_STATE_BYTES + STATE_HEADER_LEN as u64;
        let size = file.metadata().map_err(io_error(path))?.len();
        if size > cap {
            return Err(MachineError::StateTooLarge { size: size - STATE_HEADER_LEN as u64, max: MAX_STATE_BYTES });
        }
        let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
        file.take(cap + 1).read_to_end(&mut bytes).map_err(io_error(path))?;
        MicrovmState::from_bytes(&bytes, path)
    }
}

fn invalid(message: impl Into<String>) -> MachineError {
    MachineError::InvalidState(message.into())
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> MachineError + '_ {
    move |source| MachineError::Io { path: path.to_owned(), source }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vstate::vcpu::state::{DebugRegs, Fpu, Regs, Sregs, VcpuEvents};
    use crate::vstate::vm::{ClockState, PitChannelState, PitState};

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

    fn parse(bytes: &[u8]) -> Result<MicrovmState, MachineError> {
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
        assert!(matches!(parse(&bytes[..10]), Err(MachineError::NotAState { .. })));
        let mut wrong = bytes.clone();
        wrong[0] = b'X';
        assert!(matches!(parse(&wrong), Err(MachineError::NotAState { .. })));
        let mut version = bytes.clone();
        version[8] = 9;
        assert!(matches!(parse(&version), Err(MachineError::StateVersion { found: 9, supported: 1 })));
        assert!(matches!(parse(&bytes[..bytes.len() - 1]), Err(MachineError::StateLength { .. })));
        let mut huge = bytes.clone();
        huge[12..20].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(parse(&huge), Err(MachineError::StateTooLarge { .. })));
        let mut garbage = bytes[..STATE_HEADER_LEN].to_vec();
        garbage[12..20].copy_from_slice(&4u64.to_le_bytes());
        garbage.extend_from_slice(b"{]}x");
        assert!(matches!(parse(&garbage), Err(MachineError::StateFormat(_))));
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
        assert!(matches!(parse(&bytes), Err(MachineError::StateFormat(_))));
    }
}
