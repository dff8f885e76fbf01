//! The guest agent: PID 1 of a microVM (static musl), also runnable as a host process over a Unix socket.
//!
//! In a guest it boots the userland ([`init`]), reaps every process, and serves docs/DESIGN.md §4's protocol
//! ([`strata_guest_proto`]) on AF_VSOCK, one connection at a time ([`serve`]): execs with streamed output and
//! stdin ([`exec`]), file transfers ([`files`]) and tree listings ([`tree`]), the sandbox's file methods
//! ([`entries`]) and directory watches ([`watch`]), snapshot steps and power-off ([`system`]), and, when the host
//! asks, the network egress forwarder ([`egress`]). Run as an ordinary
//! process (`--unix PATH`) the same code serves one connection over a Unix socket, which is how its tests drive
//! the whole protocol at full speed.
//!
//! ```text
//! strata-agent                        as PID 1: boot, then listen on vsock (kernel parameter strata.port)
//! strata-agent --vsock-port N         listen on vsock port N (in a guest, not as PID 1)
//! strata-agent --unix PATH [--reap-all]
//!                                     connect to the Unix socket PATH and serve that connection (host mode);
//!                                     --reap-all reaps orphans too, as a child subreaper; the egress
//!                                     forwarder's streams go to the Unix socket PATH_<port>
//! ```

pub mod egress;
pub mod entries;
pub mod exec;
pub mod files;
pub mod init;
pub mod reap;
pub mod serve;
pub mod system;
pub mod tree;
pub mod watch;

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use strata_guest_proto::VsockListener;

pub use serve::{Agent, AgentConfig, Role, ServeEnd, ServeError};
pub use system::Halt;

/// How the agent was asked to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// PID 1 of a guest.
    Init,
    /// Listen on a vsock port (in a guest).
    Vsock {
        /// The port.
        port: u32,
    },
    /// Connect to a Unix socket and serve that one connection (on the host).
    Unix {
        /// The socket.
        path: PathBuf,
        /// Reap orphans too (as a child subreaper).
        reap_all: bool,
    },
}

/// The command line could not be understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}\nusage: strata-agent [--vsock-port N | --unix PATH [--reap-all]]")]
pub struct UsageError(String);

impl Mode {
    /// Reads the arguments (without the program name). PID 1 ignores them: the kernel passes the command
    /// line's stray words to init.
    pub fn parse(args: &[String], pid1: bool) -> Result<Mode, UsageError> {
        if pid1 {
            return Ok(Mode::Init);
        }
        match args {
            [flag, port] if flag == "--vsock-port" => port
                .parse()
                .map(|port| Mode::Vsock { port })
                .map_err(|_| UsageError(format!("invalid vsock port {port:?}"))),
            [flag, path, rest @ ..] if flag == "--unix" => {
                let reap_all = match rest {
                    [] => false,
                    [flag] if flag == "--reap-all" => true,
                    _ => return Err(UsageError(format!("unexpected arguments {rest:?}"))),
                };
                Ok(Mode::Unix { path: PathBuf::from(path), reap_all })
            }
            _ => Err(UsageError(format!("unexpected arguments {args:?}"))),
        }
    }
}

fn log(message: &str) {
    eprintln!("strata-agent: {message}");
}

/// The `strata-agent` program; returns its exit code (as PID 1 it never returns).
pub fn run(args: &[String]) -> i32 {
    let pid1 = std::process::id() == 1;
    let mode = match Mode::parse(args, pid1) {
        Ok(mode) => mode,
        Err(err) => {
            log(&err.to_string());
            return 2;
        }
    };
    match mode {
        Mode::Init => {
            let (config, notes) = init::boot();
            for note in notes {
                log(&note);
            }
            listen_forever(config.port, config.halt)
        }
        Mode::Vsock { port } => {
            init::ensure_stdio(Path::new("/dev/null"));
            listen_forever(port, Halt::PowerOff)
        }
        Mode::Unix { path, reap_all } => serve_unix(&path, reap_all),
    }
}

fn serve_unix(path: &Path, reap_all: bool) -> i32 {
    init::ensure_stdio(Path::new("/dev/null"));
    if reap_all {
        // SAFETY: PR_SET_CHILD_SUBREAPER takes an integer and only changes this process's attributes.
        if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } < 0 {
            log(&format!("PR_SET_CHILD_SUBREAPER: {}", std::io::Error::last_os_error()));
            return 1;
        }
    }
    let agent = match Agent::new(AgentConfig { role: Role::Host, reap_all }) {
        Ok(agent) => agent.with_egress_dial(egress::EgressDial::Unix(path.to_owned())),
        Err(err) => {
            log(&format!("starting: {err}"));
            return 1;
        }
    };
    let stream = match UnixStream::connect(path) {
        Ok(stream) => stream,
        Err(err) => {
            log(&format!("connecting to {}: {err}", path.display()));
            return 1;
        }
    };
    match agent.serve(stream) {
        Ok(ServeEnd::Closed | ServeEnd::PowerOff) => 0,
        Ok(ServeEnd::VersionMismatch { host }) => {
            log(&format!("the host speaks protocol version {host}"));
            1
        }
        Err(err) => {
            log(&serve::error_chain(&err));
            1
        }
    }
}

/// Serves vsock connections one after another, for ever; powers off when asked.
fn listen_forever(port: u32, halt: Halt) -> i32 {
    let agent = loop {
        match Agent::new(AgentConfig::guest(halt)) {
            Ok(agent) => break agent,
            Err(err) => log(&format!("starting: {err}")),
        }
        std::thread::sleep(Duration::from_secs(1));
    };
    let mut last_failure = String::new();
    loop {
        let listener = match VsockListener::bind(port) {
            Ok(listener) => listener,
            Err(err) => {
                // Once per kind of failure: the console is a slow serial port.
                let failure = format!("vsock port {port}: {err}; retrying every second");
                if failure != last_failure {
                    log(&failure);
                    last_failure = failure;
                }
                std::thread::sleep(Duration::from_secs(1));
                continue;
            }
        };
        // One line on the console: the guest is up and waits for the host (boot checks look for it).
        log(&format!("ready: listening on vsock port {port}"));
        loop {
            let stream = match listener.accept() {
                Ok((stream, _cid)) => stream,
                Err(err) => {
                    log(&format!("accept: {err}"));
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            match agent.serve(stream) {
                Ok(ServeEnd::PowerOff) => {
                    let errno = system::halt(halt);
                    log(&format!("power-off refused: {}", errno.desc()));
                    if std::process::id() != 1 {
                        return 1;
                    }
                }
                Ok(ServeEnd::Closed) => {}
                Ok(ServeEnd::VersionMismatch { host }) => log(&format!("the host speaks protocol version {host}")),
                Err(err) => log(&serve::error_chain(&err)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn modes_parse() {
        assert_eq!(Mode::parse(&args(&["anything"]), true), Ok(Mode::Init));
        assert_eq!(Mode::parse(&args(&["--vsock-port", "1024"]), false), Ok(Mode::Vsock { port: 1024 }));
        assert_eq!(
            Mode::parse(&args(&["--unix", "/tmp/s", "--reap-all"]), false),
            Ok(Mode::Unix { path: "/tmp/s".into(), reap_all: true })
        );
        assert!(Mode::parse(&args(&["--vsock-port", "x"]), false).is_err());
        assert!(Mode::parse(&args(&[]), false).is_err());
        assert!(Mode::parse(&args(&["--unix", "/s", "--bogus"]), false).is_err());
    }
}
