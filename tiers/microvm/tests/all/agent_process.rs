//! The embedded guest agent run as a host process over a Unix socket (`strata-agent --unix PATH`): the "guest" of
//! the tests that need the real agent without a VM.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::process::{Child, Command};

use strata_guest_proto::{AgentClient, ClientConfig};

/// A running agent: its process, the client connected to it, and the directory holding its binary and socket.
pub struct Spawned {
    /// The agent process.
    pub child: Child,
    /// The connected client.
    pub client: AgentClient,
    /// Holds the binary and the socket.
    pub dir: tempfile::TempDir,
}

/// Starts the agent and connects to it; `None` (after one skip line) when this build has no embedded agent.
pub fn spawn() -> Option<Spawned> {
    let Ok(binary) = strata_tier_microvm::guest::agent_binary() else {
        eprintln!("skip: this build has no guest agent (install the x86_64-unknown-linux-musl target)");
        return None;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let exe = dir.path().join("strata-agent");
    fs::write(&exe, binary).expect("write agent");
    fs::set_permissions(&exe, fs::Permissions::from_mode(0o755)).expect("chmod");
    let socket = dir.path().join("agent.sock");
    let listener = UnixListener::bind(&socket).expect("bind");
    // ETXTBSY: another test thread forked while this one still had the binary open for writing, and the child
    // holds that descriptor until it execs; it goes away at once.
    let mut tries = 0;
    let child = loop {
        match Command::new(&exe).arg("--unix").arg(&socket).spawn() {
            Err(err) if err.raw_os_error() == Some(libc::ETXTBSY) && tries < 50 => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            other => break other.expect("spawn agent"),
        }
    };
    let (stream, _) = listener.accept().expect("accept");
    let client = AgentClient::connect(stream, ClientConfig::default()).expect("connect");
    Some(Spawned { child, client, dir })
}
