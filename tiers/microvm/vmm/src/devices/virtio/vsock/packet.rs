//! vsock packets: the 44-byte header's fields, parsed from and written into guest buffers through
//! [`virtio_vsock::packet::VsockPacket`].
//!
//! A TX packet (guest → host) is parsed by `VsockPacket::from_tx_virtq_chain`, which checks that the header
//! descriptor is device-readable and at least 44 bytes long, that the data descriptor is device-readable and
//! holds `len` bytes, and that `len` is at most [`MAX_PKT_DATA`]; [`TxHeader`] copies the header out so that
//! later logic never re-reads guest memory the guest may be changing. An RX packet (host → guest) is a guest
//! buffer with room for a header and, optionally, data; [`RxHeader::write`] fills every header field.

use virtio_vsock::packet::VsockPacket;

/// The host's CID.
pub const VSOCK_HOST_CID: u64 = 2;
/// The only socket type the device carries.
pub const VSOCK_TYPE_STREAM: u16 = 1;
/// Header length.
pub const VSOCK_HEADER_LEN: u32 = virtio_vsock::packet::PKT_HEADER_SIZE as u32;
/// The largest payload one packet carries (Linux's `VIRTIO_VSOCK_MAX_PKT_BUF_SIZE`).
pub const MAX_PKT_DATA: u32 = 64 * 1024;

/// `SHUTDOWN` flag: the sender will receive no more data.
pub const VSOCK_FLAGS_SHUTDOWN_RCV: u32 = 1;
/// `SHUTDOWN` flag: the sender will send no more data.
pub const VSOCK_FLAGS_SHUTDOWN_SEND: u32 = 2;

/// Packet operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum VsockOp {
    /// Connection request.
    Request = 1,
    /// Connection accepted.
    Response = 2,
    /// Connection reset.
    Rst = 3,
    /// Half or full close.
    Shutdown = 4,
    /// Data.
    Rw = 5,
    /// The sender's receive-buffer state, unsolicited or asked for.
    CreditUpdate = 6,
    /// Asks for a credit update.
    CreditRequest = 7,
}

impl VsockOp {
    /// The operation with wire value `op`, if there is one.
    pub fn from_u16(op: u16) -> Option<VsockOp> {
        Some(match op {
            1 => VsockOp::Request,
            2 => VsockOp::Response,
            3 => VsockOp::Rst,
            4 => VsockOp::Shutdown,
            5 => VsockOp::Rw,
            6 => VsockOp::CreditUpdate,
            7 => VsockOp::CreditRequest,
            _ => return None,
        })
    }
}

/// A TX packet's header, copied out of guest memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxHeader {
    /// Source CID (must be the guest's).
    pub src_cid: u64,
    /// Destination CID (must be the host's).
    pub dst_cid: u64,
    /// Guest port.
    pub src_port: u32,
    /// Host port.
    pub dst_port: u32,
    /// Payload length (checked against the data descriptor by the parser).
    pub len: u32,
    /// Socket type.
    pub type_: u16,
    /// Raw operation (unknown values included).
    pub op: u16,
    /// Operation flags.
    pub flags: u32,
    /// The guest's receive buffer size for this connection.
    pub buf_alloc: u32,
    /// Bytes the guest has consumed from this connection so far.
    pub fwd_cnt: u32,
}

impl TxHeader {
    /// The header of a parsed TX packet.
    pub fn of(pkt: &VsockPacket<'_, ()>) -> TxHeader {
        TxHeader {
            src_cid: pkt.src_cid(),
            dst_cid: pkt.dst_cid(),
            src_port: pkt.src_port(),
            dst_port: pkt.dst_port(),
            len: pkt.len(),
            type_: pkt.type_(),
            op: pkt.op(),
            flags: pkt.flags(),
            buf_alloc: pkt.buf_alloc(),
            fwd_cnt: pkt.fwd_cnt(),
        }
    }
}

/// An RX packet's header, as the device writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RxHeader {
    /// Destination CID (the guest's).
    pub dst_cid: u64,
    /// Host port.
    pub src_port: u32,
    /// Guest port.
    pub dst_port: u32,
    /// Operation.
    pub op: VsockOp,
    /// Operation flags.
    pub flags: u32,
    /// Payload length.
    pub len: u32,
    /// The host side's buffer for this connection.
    pub buf_alloc: u32,
    /// Bytes the host side has consumed so far.
    pub fwd_cnt: u32,
}

impl RxHeader {
    /// Writes every header field into `pkt`'s header buffer; returns the used length (header + payload).
    pub fn write(&self, pkt: &mut VsockPacket<'_, ()>) -> u32 {
        pkt.set_src_cid(VSOCK_HOST_CID)
            .set_dst_cid(self.dst_cid)
            .set_src_port(self.src_port)
            .set_dst_port(self.dst_port)
            .set_len(self.len)
            .set_type(VSOCK_TYPE_STREAM)
            .set_op(self.op as u16)
            .set_flags(self.flags)
            .set_buf_alloc(self.buf_alloc)
            .set_fwd_cnt(self.fwd_cnt);
        VSOCK_HEADER_LEN.saturating_add(self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ops_round_trip_and_unknown_ops_are_none() {
        for op in 1..=7u16 {
            assert_eq!(VsockOp::from_u16(op).map(|o| o as u16), Some(op));
        }
        for op in [0u16, 8, 0xffff] {
            assert_eq!(VsockOp::from_u16(op), None);
        }
        assert_eq!(VSOCK_HEADER_LEN, 44);
    }
}
