//! virtio-vsock: the guest agent's channel and the network egress tunnel, multiplexed onto host Unix sockets (see
//! [`muxer`] for the host-side protocol, the flow control and the limits a hostile guest runs into). The egress
//! tunnel needs nothing of its own here: the agent's forwarder opens one guest-initiated stream per connection to
//! host port `strata_guest_proto::EGRESS_PORT`, which the muxer connects to `<uds>_1028`, where the sandbox's
//! egress proxy listens (the tier's `session` module); with no proxy there, the guest gets RST.

mod device;
pub mod muxer;
pub mod packet;
pub mod persist;

pub use device::{VSOCK_QUEUE_SIZE, VsockConfig, VsockDevice, VsockError, VsockMetrics};
pub use muxer::{CONN_BUF_SIZE, MAX_CONNECTIONS, MAX_PENDING_HANDSHAKES, MAX_QUEUED_RESETS, MuxerError};
