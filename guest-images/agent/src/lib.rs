//! The guest agent: PID 1 of a microVM (static musl), also runnable as a host process over a Unix socket. (work in progress).
