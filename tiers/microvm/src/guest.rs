//! What runs inside the microVM, as far as the host needs it: the guest agent's static binary, embedded at build
//! time (see `build.rs`), from which the initramfs is made.

/// The guest agent could not be embedded in this build.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "this build of Strata has no guest agent: install the x86_64-unknown-linux-musl Rust target \
     (`rustup target add x86_64-unknown-linux-musl`) and rebuild"
)]
pub struct NoAgent;

/// The static (musl) guest agent, `/init` of the initramfs.
pub fn agent_binary() -> Result<&'static [u8], NoAgent> {
    #[cfg(not(strata_no_agent))]
    {
        Ok(include_bytes!(env!("STRATA_AGENT_BINARY")))
    }
    #[cfg(strata_no_agent)]
    {
        Err(NoAgent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_agent_is_a_static_executable() {
        let Ok(agent) = agent_binary() else {
            eprintln!("skip: built without the musl target, so without an agent");
            return;
        };
        assert_eq!(&agent[..4], b"\x7fELF");
        // No PT_INTERP: nothing for a C library loader to do in an initramfs that has none.
        assert!(!agent.windows(16).any(|w| w.starts_with(b"/lib/ld-musl") || w.starts_with(b"/lib64/ld-linux")));
    }
}
