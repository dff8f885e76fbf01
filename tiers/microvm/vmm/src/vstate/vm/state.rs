//! The VM's own state for snapshots: the KVM clock and, with the in-kernel irqchip, both 8259 PICs, the IOAPIC
//! and the PIT, as plain serde mirrors of the KVM structures (every field an integer, so any value round-trips
//! and a damaged one is refused by KVM, not by a panic here).

use kvm_bindings::{
    KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, kvm_ioapic_state,
    kvm_ioapic_state__bindgen_ty_1, kvm_irqchip, kvm_pic_state, kvm_pit_channel_state, kvm_pit_state2,
};
use serde::{Deserialize, Serialize};

use super::{ClockState, Vm, VmError, kvm_error};
use crate::persist::IOAPIC_PINS;

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

fn get_irqchip(vm: &Vm, chip_id: u32) -> Result<kvm_irqchip, VmError> {
    let mut chip = kvm_irqchip { chip_id, ..Default::default() };
    vm.fd().get_irqchip(&mut chip).map_err(kvm_error("KVM_GET_IRQCHIP"))?;
    Ok(chip)
}

impl VmState {
    /// Reads the VM's clock, irqchip and PIT.
    pub fn save(vm: &Vm) -> Result<VmState, VmError> {
        let clock = vm.clock()?;
        if !vm.has_irqchip() {
            return Ok(VmState { clock, irqchip: None, pit: None });
        }
        let pic = |chip_id| -> Result<PicState, VmError> {
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
    pub fn restore(&self, vm: &Vm) -> Result<(), VmError> {
        if self.irqchip.is_some() != vm.has_irqchip() {
            return Err(VmError::IrqchipMismatch);
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
