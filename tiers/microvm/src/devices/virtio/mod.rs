//! virtio devices over the MMIO transport.
