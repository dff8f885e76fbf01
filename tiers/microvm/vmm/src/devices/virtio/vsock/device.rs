//! The virtio-vsock device: RX, TX and event queues around the [`VsockMuxer`].
//!
//! - TX (guest notifies queue 1): every chain is parsed as a packet and handed to the muxer, then returned
//!   with used length 0. A chain that is not a valid packet (header descriptor short or write-only, data
//!   descriptor missing, shorter than the header's `len`, or `len` above 64 KiB, buffers outside memory) is
//!   returned unread and counted in [`VsockMetrics::tx_malformed`].
//! - RX (guest notifies queue 0, or the backend has host data): while the muxer has packets for the guest, each
//!   RX chain gets one (header, and data for RW). A chain that cannot hold a header is returned with length 0.
//! - Event (queue 2): carries `VIRTIO_VSOCK_EVENT_TRANSPORT_RESET` after a snapshot restore, which makes the
//!   guest drop its connections and re-read its CID.

use std::fmt;
use std::path::{Path, PathBuf};

use virtio_bindings::virtio_ids::VIRTIO_ID_VSOCK;
use virtio_queue::{Queue, QueueOwnedT, QueueState, QueueT};
use virtio_vsock::packet::VsockPacket;
use vm_memory::{Bytes, GuestMemoryMmap};

use super::muxer::{MuxerError, VsockMuxer};
use super::packet::MAX_PKT_DATA;
use crate::devices::virtio::{ActivateError, Interrupt, InterruptKind, VIRTIO_F_VERSION_1, VirtioDevice};

/// Each queue's maximum size.
pub const VSOCK_QUEUE_SIZE: u16 = 256;
const RX: usize = 0;
const TX: usize = 1;
const EVENT: usize = 2;
const QUEUE_SIZES: [u16; 3] = [VSOCK_QUEUE_SIZE; 3];
/// `VIRTIO_VSOCK_EVENT_TRANSPORT_RESET`.
const EVENT_TRANSPORT_RESET: u32 = 0;

/// What a vsock device is built from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VsockConfig {
    /// The guest's CID (3 ..= 0xffff_fffe).
    pub guest_cid: u64,
    /// The host-side Unix socket: host processes connect to it (`CONNECT <port>\n`); guest connections to
    /// port `P` go to `<uds_path>_<P>`. It must not exist; the device removes it when dropped.
    pub uds_path: PathBuf,
}

/// Why a vsock device could not be created.
#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    /// The CID is reserved (0, 1, 2), `VMADDR_CID_ANY` or does not fit 32 bits.
    #[error("guest CID {0} is reserved or out of range")]
    InvalidCid(u64),
    /// The host side could not be set up.
    #[error("cannot set up the vsock backend")]
    Muxer(#[source] MuxerError),
}

pub(super) fn check_cid(cid: u64) -> Result<u64, VsockError> {
    if (3..u64::from(u32::MAX)).contains(&cid) { Ok(cid) } else { Err(VsockError::InvalidCid(cid)) }
}

/// Packet counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VsockMetrics {
    /// Valid packets the guest sent.
    pub tx_packets: u64,
    /// TX chains that were not valid packets.
    pub tx_malformed: u64,
    /// Packets delivered to the guest.
    pub rx_packets: u64,
    /// RX chains that could not hold a packet.
    pub rx_malformed: u64,
}

struct Active {
    mem: GuestMemoryMmap,
    queues: Vec<Queue>,
    interrupt: Interrupt,
}

/// The virtio-vsock device.
pub struct VsockDevice {
    pub(super) guest_cid: u64,
    muxer: VsockMuxer,
    active: Option<Active>,
    metrics: VsockMetrics,
    pub(super) transport_reset_pending: bool,
}

impl fmt::Debug for VsockDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VsockDevice")
            .field("guest_cid", &self.guest_cid)
            .field("uds_path", &self.muxer.uds_path())
            .field("connections", &self.muxer.connection_count())
            .field("active", &self.active.is_some())
            .field("metrics", &self.metrics)
            .finish_non_exhaustive()
    }
}

impl VsockDevice {
    /// Binds `config.uds_path` and builds the device.
    pub fn new(config: VsockConfig) -> Result<VsockDevice, VsockError> {
        let guest_cid = check_cid(config.guest_cid)?;
        let muxer = VsockMuxer::new(guest_cid, config.uds_path).map_err(VsockError::Muxer)?;
        Ok(VsockDevice {
            guest_cid,
            muxer,
            active: None,
            metrics: VsockMetrics::default(),
            transport_reset_pending: false,
        })
    }

    /// The guest's CID.
    pub fn guest_cid(&self) -> u64 {
        self.guest_cid
    }

    /// The host-side socket path.
    pub fn uds_path(&self) -> &Path {
        self.muxer.uds_path()
    }

    /// Open connections.
    pub fn connection_count(&self) -> usize {
        self.muxer.connection_count()
    }

    /// Packet counters.
    pub fn metrics(&self) -> VsockMetrics {
        self.metrics
    }

    /// Whether a transport-reset event is waiting for an event buffer.
    pub fn transport_reset_pending(&self) -> bool {
        self.transport_reset_pending
    }

    /// Guest → host: every packet on the TX queue. Returns whether chains were returned to the guest.
    fn process_tx(&mut self) -> bool {
        let VsockDevice { muxer, active, metrics, .. } = self;
        let Some(Active { mem, queues, .. }) = active.as_mut() else { return false };
        let Some(txq) = queues.get_mut(TX) else { return false };
        let mut used = false;
        while let Some(mut chain) = txq.pop_descriptor_chain(&*mem) {
            let head = chain.head_index();
            match VsockPacket::from_tx_virtq_chain(&*mem, &mut chain, MAX_PKT_DATA) {
                Ok(pkt) => {
                    metrics.tx_packets += 1;
                    muxer.send_pkt(&pkt);
                }
                Err(e) => {
                    metrics.tx_malformed += 1;
                    log::debug!("vsock: malformed TX chain {head}: {e}");
                }
            }
            match txq.add_used(&*mem, head, 0) {
                Ok(()) => used = true,
                Err(e) => log::debug!("vsock: cannot return TX chain {head}: {e}"),
            }
        }
        used
    }

    /// Host → guest: fills RX buffers while the muxer has packets. Returns whether chains were returned.
    fn process_rx(&mut self) -> bool {
        let VsockDevice { muxer, active, metrics, .. } = self;
        let Some(Active { mem, queues, .. }) = active.as_mut() else { return false };
        let Some(rxq) = queues.get_mut(RX) else { return false };
        let mut used = false;
        while muxer.has_pending_rx() {
            let Some(mut chain) = rxq.pop_descriptor_chain(&*mem) else { break };
            let head = chain.head_index();
            // The data buffer's size is the guest's business; the muxer never fills more than 64 KiB of it.
            let len = match VsockPacket::from_rx_virtq_chain(&*mem, &mut chain, u32::MAX) {
                Ok(mut pkt) => match muxer.fill_rx(&mut pkt) {
                    Some(len) => {
                        metrics.rx_packets += 1;
                        len
                    }
                    None => {
                        // Nothing this buffer can carry now: leave it for later.
                        rxq.go_to_previous_position();
                        break;
                    }
                },
                Err(e) => {
                    metrics.rx_malformed += 1;
                    log::debug!("vsock: unusable RX chain {head}: {e}");
                    0
                }
            };
            match rxq.add_used(&*mem, head, len) {
                Ok(()) => used = true,
                Err(e) => log::debug!("vsock: cannot return RX chain {head}: {e}"),
            }
        }
        used
    }

    /// Posts a transport-reset event if one is pending and the guest gave an event buffer.
    fn process_event(&mut self) -> bool {
        if !self.transport_reset_pending {
            return false;
        }
        let Some(Active { mem, queues, .. }) = self.active.as_mut() else { return false };
        let Some(evq) = queues.get_mut(EVENT) else { return false };
        let Some(mut chain) = evq.pop_descriptor_chain(&*mem) else { return false };
        let head = chain.head_index();
        let len = match chain.next() {
            Some(d) if d.is_write_only() && d.len() >= 4 && mem.write_obj(EVENT_TRANSPORT_RESET, d.addr()).is_ok() => 4,
            _ => 0,
        };
        self.transport_reset_pending = false;
        evq.add_used(&*mem, head, len).is_ok()
    }

    fn signal(&self, used: bool) {
        if let (true, Some(active)) = (used, self.active.as_ref()) {
            active.interrupt.trigger(InterruptKind::UsedBuffer);
        }
    }
}

impl VirtioDevice for VsockDevice {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_VSOCK
    }

    fn avail_features(&self) -> u64 {
        VIRTIO_F_VERSION_1
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        super::super::read_config_bytes(&self.guest_cid.to_le_bytes(), offset, data);
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        log::debug!("vsock: write to read-only config space at {offset:#x} ignored");
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        queues: Vec<Queue>,
        interrupt: Interrupt,
        _acked_features: u64,
    ) -> Result<(), ActivateError> {
        if queues.len() != QUEUE_SIZES.len() {
            return Err(ActivateError::QueueCount { expected: QUEUE_SIZES.len(), got: queues.len() });
        }
        for index in [RX, TX] {
            if !queues.get(index).is_some_and(|q| q.ready()) {
                return Err(ActivateError::QueueNotReady(index));
            }
        }
        self.active = Some(Active { mem, queues, interrupt });
        let used = self.process_event();
        self.signal(used);
        Ok(())
    }

    fn process_queue(&mut self, index: usize) {
        let used = match index {
            RX => self.process_rx(),
            TX => {
                let tx = self.process_tx();
                // Replies (RESPONSE, RST, credit updates) are usually waiting now.
                self.process_rx() || tx
            }
            EVENT => self.process_event(),
            _ => false,
        };
        self.signal(used);
    }

    fn queue_states(&self) -> Vec<QueueState> {
        self.active.iter().flat_map(|a| a.queues.iter().map(|q| q.state())).collect()
    }

    fn reset(&mut self) {
        self.muxer.reset();
        self.active = None;
    }

    fn backend_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        Some(self.muxer.epoll_fd())
    }

    fn process_backend(&mut self) {
        self.muxer.process_events();
        let used = self.process_rx();
        self.signal(used);
    }
}

impl VsockDevice {
    pub(super) fn set_guest_cid(&mut self, guest_cid: u64) {
        self.guest_cid = guest_cid;
        self.muxer.set_guest_cid(guest_cid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserved_cids_are_refused() {
        for cid in [0u64, 1, 2, u64::from(u32::MAX), 1 << 40] {
            assert!(matches!(check_cid(cid), Err(VsockError::InvalidCid(c)) if c == cid));
        }
        assert_eq!(check_cid(3).ok(), Some(3));
    }

    #[test]
    fn config_space_holds_the_cid() {
        let dir = tempfile::tempdir().expect("tempdir");
        let device = VsockDevice::new(VsockConfig { guest_cid: 0x1234_5678, uds_path: dir.path().join("v.sock") })
            .expect("device");
        let mut data = [0u8; 8];
        device.read_config(0, &mut data);
        assert_eq!(u64::from_le_bytes(data), 0x1234_5678);
        let mut data = [0xffu8; 4];
        device.read_config(6, &mut data);
        assert_eq!(data, [0, 0, 0, 0]);
        device.read_config(u64::MAX, &mut data);
        assert_eq!(data, [0, 0, 0, 0]);
    }
}
