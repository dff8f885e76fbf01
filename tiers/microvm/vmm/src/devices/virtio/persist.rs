//! Snapshot state of the virtio-mmio transport: the negotiated features, the device status, the registers the
//! driver selected, and every queue (size, ring addresses, ready, next_avail/next_used).
//!
//! A device is saved in two parts that restore in order: the device's own state (its `persist.rs`: the
//! configuration space and what it needs from the host), then this transport state around the restored
//! device. [`MmioTransport::restore`] checks the state against the device and guest memory instead of trusting
//! it (queue sizes, alignment, rings inside memory, a status the handshake can reach, features the device
//! offers) and re-activates the device when the snapshot was taken after DRIVER_OK.

use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueState, QueueT};
use vm_memory::GuestMemoryMmap;

use super::mmio::{
    MmioError, MmioTransport, QueueConfigError, S_ACK, S_DRIVER, S_DRIVER_OK, S_FAILED, S_FEATURES_OK, S_NEEDS_RESET,
    configure_queue,
};
use super::{ActivateError, INTERRUPT_STATUS_MASK, Interrupt, VirtioDevice};

/// `VIRTIO_RING_F_EVENT_IDX`.
const VIRTIO_RING_F_EVENT_IDX: u64 = 1 << 29;

/// Save and restore, Firecracker's shape: plain-data state, plus the host resources the state cannot carry.
pub trait Persist: Sized {
    /// The serializable state.
    type State;
    /// Host resources needed to rebuild (memory, files, sockets, a fresh identity for a fork).
    type ConstructorArgs;
    /// Why a state was refused.
    type Error;
    /// The current state.
    fn save(&self) -> Self::State;
    /// Rebuilds from `state`, validating it.
    fn restore(args: Self::ConstructorArgs, state: &Self::State) -> Result<Self, Self::Error>;
}

/// One virtqueue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VirtqueueState {
    /// The device's maximum size for this queue.
    pub max_size: u16,
    /// The size the driver chose.
    pub size: u16,
    /// Whether the driver enabled the queue.
    pub ready: bool,
    /// Descriptor table address.
    pub desc_table: u64,
    /// Available ring address.
    pub avail_ring: u64,
    /// Used ring address.
    pub used_ring: u64,
    /// The next available-ring entry the device will read.
    pub next_avail: u16,
    /// The next used-ring entry the device will write.
    pub next_used: u16,
    /// Whether `VIRTIO_RING_F_EVENT_IDX` is in use.
    pub event_idx: bool,
}

impl From<QueueState> for VirtqueueState {
    fn from(q: QueueState) -> VirtqueueState {
        VirtqueueState {
            max_size: q.max_size,
            size: q.size,
            ready: q.ready,
            desc_table: q.desc_table,
            avail_ring: q.avail_ring,
            used_ring: q.used_ring,
            next_avail: q.next_avail,
            next_used: q.next_used,
            event_idx: q.event_idx_enabled,
        }
    }
}

impl From<VirtqueueState> for QueueState {
    fn from(q: VirtqueueState) -> QueueState {
        QueueState {
            max_size: q.max_size,
            next_avail: q.next_avail,
            next_used: q.next_used,
            event_idx_enabled: q.event_idx,
            size: q.size,
            ready: q.ready,
            desc_table: q.desc_table,
            avail_ring: q.avail_ring,
            used_ring: q.used_ring,
        }
    }
}

/// The transport's registers and queues.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MmioTransportState {
    /// The device ID the state was saved from.
    pub device_type: u32,
    /// `Status`.
    pub status: u32,
    /// `DeviceFeaturesSel`.
    pub device_features_sel: u32,
    /// `DriverFeaturesSel`.
    pub driver_features_sel: u32,
    /// What the driver wrote to `DriverFeatures`.
    pub driver_features: u64,
    /// The features fixed at FEATURES_OK.
    pub acked_features: u64,
    /// `QueueSel`.
    pub queue_select: u32,
    /// `InterruptStatus`.
    pub interrupt_status: u32,
    /// `ConfigGeneration`.
    pub config_generation: u32,
    /// Whether the device was active (DRIVER_OK accepted).
    pub activated: bool,
    /// Every queue, in order.
    pub queues: Vec<VirtqueueState>,
}

/// What a transport is rebuilt around: guest memory, the (already restored) device, a fresh interrupt line.
#[derive(Debug)]
pub struct MmioTransportConstructorArgs<D> {
    /// Guest memory (the restored image).
    pub mem: GuestMemoryMmap,
    /// The device, restored from its own state.
    pub device: D,
    /// The interrupt line to use from now on.
    pub interrupt: Interrupt,
}

/// Why a transport state was refused.
#[derive(Debug, thiserror::Error)]
pub enum MmioPersistError {
    /// The state belongs to another kind of device.
    #[error("state is of device type {saved}, the device is type {device}")]
    DeviceType {
        /// In the state.
        saved: u32,
        /// The device's.
        device: u32,
    },
    /// The queue count differs from the device's.
    #[error("state has {saved} queues, the device has {device}")]
    QueueCount {
        /// In the state.
        saved: usize,
        /// The device's.
        device: usize,
    },
    /// A queue's maximum size differs from the device's.
    #[error("state queue {index} has maximum size {saved}, the device's is {device}")]
    QueueMaxSize {
        /// The queue.
        index: usize,
        /// In the state.
        saved: u16,
        /// The device's.
        device: u16,
    },
    /// A queue's configuration is invalid for guest memory.
    #[error("state queue {index} is invalid")]
    Queue {
        /// The queue.
        index: usize,
        /// Why.
        #[source]
        source: QueueConfigError,
    },
    /// A queue uses event-index suppression the driver never negotiated.
    #[error("state queue {0} uses EVENT_IDX, which was not negotiated")]
    EventIdx(usize),
    /// The status is not one the handshake can produce.
    #[error("state status {0:#x} is not a reachable device status")]
    Status(u32),
    /// The activated flag contradicts the status.
    #[error("state activated flag {activated} contradicts status {status:#x}")]
    Activated {
        /// The flag.
        activated: bool,
        /// The status.
        status: u32,
    },
    /// The acked features include features the device does not offer, or are set before FEATURES_OK.
    #[error("state acked features {acked:#x} are not a valid choice among the offered {offered:#x}")]
    Features {
        /// In the state.
        acked: u64,
        /// The device's.
        offered: u64,
    },
    /// Unknown interrupt status bits.
    #[error("state interrupt status {0:#x} has unknown bits")]
    InterruptStatus(u32),
    /// The device cannot sit behind a transport.
    #[error("cannot build the transport")]
    Transport(#[source] MmioError),
    /// The device refused activation.
    #[error("cannot re-activate the device")]
    Activate(#[source] ActivateError),
}

fn reachable_status(status: u32) -> bool {
    let base = status & !(S_FAILED | S_NEEDS_RESET);
    let handshake = [0, S_ACK, S_ACK | S_DRIVER, S_ACK | S_DRIVER | S_FEATURES_OK];
    let driver_ok = S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK;
    (handshake.contains(&base) && status & S_NEEDS_RESET == 0) || base == driver_ok
}

impl<D: VirtioDevice> Persist for MmioTransport<D> {
    type State = MmioTransportState;
    type ConstructorArgs = MmioTransportConstructorArgs<D>;
    type Error = MmioPersistError;

    fn save(&self) -> MmioTransportState {
        let live = if self.activated { self.device.queue_states() } else { Vec::new() };
        let queues = if live.len() == self.queues.len() {
            live.into_iter().map(VirtqueueState::from).collect()
        } else {
            self.queues.iter().map(|slot| VirtqueueState::from(slot.queue.state())).collect()
        };
        MmioTransportState {
            device_type: self.device.device_type(),
            status: self.status,
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            driver_features: self.driver_features,
            acked_features: self.acked_features,
            queue_select: self.queue_select,
            interrupt_status: self.interrupt.status(),
            config_generation: self.config_generation,
            activated: self.activated,
            queues,
        }
    }

    fn restore(
        args: MmioTransportConstructorArgs<D>,
        state: &MmioTransportState,
    ) -> Result<MmioTransport<D>, MmioPersistError> {
        let MmioTransportConstructorArgs { mem, device, interrupt } = args;
        let device_type = device.device_type();
        if state.device_type != device_type {
            return Err(MmioPersistError::DeviceType { saved: state.device_type, device: device_type });
        }
        if !reachable_status(state.status) {
            return Err(MmioPersistError::Status(state.status));
        }
        let driver_ok = state.status & S_DRIVER_OK != 0 && state.status & S_NEEDS_RESET == 0;
        if state.activated != driver_ok {
            return Err(MmioPersistError::Activated { activated: state.activated, status: state.status });
        }
        let offered = device.avail_features();
        let features_ok = state.status & S_FEATURES_OK != 0;
        let acked = state.acked_features;
        if acked & !offered != 0
            || (features_ok && acked & super::VIRTIO_F_VERSION_1 == 0)
            || (!features_ok && acked != 0)
        {
            return Err(MmioPersistError::Features { acked, offered });
        }
        if state.interrupt_status & !INTERRUPT_STATUS_MASK != 0 {
            return Err(MmioPersistError::InterruptStatus(state.interrupt_status));
        }
        let device_queues = device.queue_max_sizes().len();
        if state.queues.len() != device_queues {
            return Err(MmioPersistError::QueueCount { saved: state.queues.len(), device: device_queues });
        }

        let mut transport = MmioTransport::new(mem, device, interrupt).map_err(MmioPersistError::Transport)?;
        for (index, (slot, saved)) in transport.queues.iter_mut().zip(&state.queues).enumerate() {
            let max = slot.queue.max_size();
            if saved.max_size != max {
                return Err(MmioPersistError::QueueMaxSize { index, saved: saved.max_size, device: max });
            }
            if saved.event_idx && acked & VIRTIO_RING_F_EVENT_IDX == 0 {
                return Err(MmioPersistError::EventIdx(index));
            }
            let invalid = |source| MmioPersistError::Queue { index, source };
            let size = u32::from(saved.size);
            if saved.ready {
                configure_queue(
                    &mut slot.queue,
                    &transport.mem,
                    size,
                    saved.desc_table,
                    saved.avail_ring,
                    saved.used_ring,
                )
                .map_err(invalid)?;
            } else {
                // A queue that is not enabled only needs values the registers could hold.
                slot.queue = Queue::try_from(QueueState::from(*saved))
                    .map_err(|_| invalid(QueueConfigError::Size { size, max }))?;
            }
            slot.queue.set_next_avail(saved.next_avail);
            slot.queue.set_next_used(saved.next_used);
            slot.queue.set_event_idx(saved.event_idx);
            slot.size = size;
            slot.desc = saved.desc_table;
            slot.driver = saved.avail_ring;
            slot.device = saved.used_ring;
        }
        transport.status = state.status;
        transport.device_features_sel = state.device_features_sel;
        transport.driver_features_sel = state.driver_features_sel;
        transport.driver_features = state.driver_features;
        transport.acked_features = acked;
        transport.queue_select = state.queue_select;
        transport.config_generation = state.config_generation;
        transport.interrupt.set_status(state.interrupt_status);
        if state.activated {
            transport.activate_device().map_err(MmioPersistError::Activate)?;
            transport.activated = true;
        }
        Ok(transport)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::bus::BusDevice;
    use crate::devices::virtio::testing::Recorder;
    use vm_memory::GuestAddress;

    fn memory() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).expect("memory")
    }

    fn w(t: &mut MmioTransport<Recorder>, offset: u64, value: u32) {
        t.write(offset, &value.to_le_bytes());
    }

    fn active_transport() -> MmioTransport<Recorder> {
        let mut t =
            MmioTransport::new(memory(), Recorder::default(), Interrupt::new().expect("eventfd")).expect("transport");
        for status in [0, S_ACK, S_ACK | S_DRIVER] {
            w(&mut t, 0x70, status);
        }
        w(&mut t, 0x24, 1);
        w(&mut t, 0x20, 1);
        w(&mut t, 0x70, S_ACK | S_DRIVER | S_FEATURES_OK);
        w(&mut t, 0x30, 0);
        w(&mut t, 0x38, 8);
        w(&mut t, 0x80, 0x1000);
        w(&mut t, 0x90, 0x2000);
        w(&mut t, 0xa0, 0x3000);
        w(&mut t, 0x44, 1);
        w(&mut t, 0x70, S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK);
        assert!(t.is_activated());
        t
    }

    fn restore(state: &MmioTransportState) -> Result<MmioTransport<Recorder>, MmioPersistError> {
        let args = MmioTransportConstructorArgs {
            mem: memory(),
            device: Recorder::default(),
            interrupt: Interrupt::new().expect("eventfd"),
        };
        MmioTransport::restore(args, state)
    }

    #[test]
    fn save_restore_round_trip() {
        let mut t = active_transport();
        let live =
            vec![QueueState { next_avail: 5, next_used: 4, ..t.queues[0].queue.state() }, t.queues[1].queue.state()];
        t.device_mut().live = Some(live);
        let state = t.save();
        assert_eq!(state.queues.len(), 2);
        assert_eq!(state.queues[0].next_avail, 5);
        let restored = restore(&state).expect("restore");
        assert!(restored.is_activated());
        assert_eq!(restored.device().activated, Some(crate::devices::virtio::VIRTIO_F_VERSION_1));
        assert_eq!(restored.queues[0].queue.next_avail(), 5);
        assert_eq!(restored.queues[0].queue.next_used(), 4);
        assert_eq!(restored.queue_config(0), Some((8, true)));
        // The restored device reports no live queues, so the transport's copy (same positions) is saved.
        assert_eq!(restored.save(), state);
        // Through serde too.
        let json = serde_json::to_string(&state).expect("serialize");
        assert_eq!(serde_json::from_str::<MmioTransportState>(&json).expect("deserialize"), state);
    }

    #[test]
    fn restore_rejects_invalid_states() {
        let good = active_transport().save();
        let mut cases: Vec<(&str, MmioTransportState)> = Vec::new();
        let mut s = good.clone();
        s.queues[0].used_ring = 0xfff0;
        cases.push(("used ring outside memory", s));
        let mut s = good.clone();
        s.queues[0].desc_table = 0x1001;
        cases.push(("misaligned descriptor table", s));
        let mut s = good.clone();
        s.queues[0].size = 12;
        cases.push(("size not a power of two", s));
        let mut s = good.clone();
        s.queues[0].size = 32;
        cases.push(("size above maximum", s));
        let mut s = good.clone();
        s.queues[1].size = 3;
        cases.push(("disabled queue with a bad size", s));
        let mut s = good.clone();
        s.queues[0].max_size = 32;
        cases.push(("different maximum", s));
        let mut s = good.clone();
        s.queues.pop();
        cases.push(("missing queue", s));
        let mut s = good.clone();
        s.acked_features |= 1 << 40;
        cases.push(("feature not offered", s));
        let mut s = good.clone();
        s.status = S_DRIVER_OK;
        cases.push(("unreachable status", s));
        let mut s = good.clone();
        s.activated = false;
        cases.push(("activated contradicts status", s));
        let mut s = good.clone();
        s.device_type = 7;
        cases.push(("other device type", s));
        let mut s = good.clone();
        s.interrupt_status = 0x10;
        cases.push(("unknown interrupt bits", s));
        let mut s = good.clone();
        s.queues[0].event_idx = true;
        cases.push(("event idx not negotiated", s));
        for (what, state) in cases {
            assert!(restore(&state).is_err(), "{what} was accepted");
        }
        assert!(restore(&good).is_ok());
    }

    #[test]
    fn unknown_fields_are_rejected() {
        let json = serde_json::to_value(active_transport().save()).expect("serialize");
        let mut object = json.as_object().cloned().expect("object");
        object.insert("surprise".into(), serde_json::Value::Bool(true));
        assert!(serde_json::from_value::<MmioTransportState>(serde_json::Value::Object(object)).is_err());
    }
}
