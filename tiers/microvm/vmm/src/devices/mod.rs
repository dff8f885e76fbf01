//! Devices and the buses vCPU exits dispatch to.

pub mod bus;
pub mod serial;
pub mod virtio;
