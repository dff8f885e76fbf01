//! virtio-vsock: the guest agent's channel, multiplexed onto host Unix sockets (see [`muxer`] for the host-side
//! protocol, the flow control and the limits a hostile guest runs into).

mod device;
pub mod muxer;
pub mod packet;
pub mod persist;

pub use device::{VSOCK_QUEUE_SIZE, VsockConfig, VsockDevice, VsockError, VsockMetrics};
pub use muxer::{CONN_BUF_SIZE, MAX_CONNECTIONS, MAX_PENDING_HANDSHAKES, MAX_QUEUED_RESETS, MuxerError};
