//! The host <-> guest agent protocol (DESIGN §4): versioned, length-prefixed bincode frames. (work in progress).
