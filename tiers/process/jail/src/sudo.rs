//! `sudo` inside the jail: the jail's root for a job that runs as a user.
//!
//! A job never gains privileges by `execve` (`no_new_privs`, and a set-user-ID bit means nothing in the jail), so
//! `sudo` cannot be a set-user-ID program. Instead PID 1, which builds every job, listens on [`SOCKET`] (a
//! `SOCK_SEQPACKET` socket only the jail's processes can reach): the image's `sudo` client connects, sends one
//! [`Request`] (argv, environment, directory) with its standard streams as `SCM_RIGHTS`, and PID 1 starts the
//! command as the jail's root, exactly as it starts a job (its own session, every capability dropped, the jail's
//! seccomp filter), in the cgroup of the job the client descends from (so killing that job's cgroup kills it
//! too). The client forwards the signals it gets ([`ClientFrame::Signal`]) and receives [`Reply::Started`], then
//! [`Reply::Exited`]; when the client goes away first, the command's process group is killed.
//!
//! Who may: the jail's root and the members of its `sudo` group ([`crate::users::may_sudo`]), by the peer
//! credentials the kernel gives (`SO_PEERCRED`), never by what the client says. Nothing a client sends can make
//! PID 1 block: the sockets are non-blocking, a message is at most [`MAX_REQUEST`] bytes with at most three
//! descriptors and never spills into a file, and at most [`MAX_CLIENTS`] clients are served at once.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags};
use nix::sys::socket::{
    AddressFamily, Backlog, MsgFlags, SockFlag, SockType, UnixAddr, accept4, bind, getsockopt, listen, send, socket,
    sockopt,
};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

/// Where the jail's `sudo` clients connect.
pub const SOCKET: &str = "/run/strata/sudo.sock";

/// The largest request (argv and environment of one command).
pub const MAX_REQUEST: usize = 256 * 1024;

/// Clients served at once; more wait in the listen backlog.
pub const MAX_CLIENTS: usize = 32;

/// What a client asks: the command to run as the jail's root. Its standard streams come beside it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    /// The argument vector (`argv[0]` is looked up in the `PATH` of `env`).
    pub argv: Vec<String>,
    /// The complete environment.
    pub env: Vec<(String, String)>,
    /// The directory to start in.
    pub cwd: String,
}

/// What a client sends once its command runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub enum ClientFrame {
    /// Deliver this signal to the command's process group (the client got it).
    Signal(i32),
}

/// What PID 1 answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub enum Reply {
    /// The command runs, as this PID.
    Started(i32),
    /// It could not be run, or the client may not.
    Refused(String),
    /// It ended: its exit code, or the signal that ended it.
    Exited {
        /// Exit code, when it exited.
        code: Option<i32>,
        /// The signal, when one ended it.
        signal: Option<i32>,
    },
}

/// One connected client.
#[derive(Debug)]
pub struct Client {
    /// Its socket.
    pub socket: OwnedFd,
    /// Its PID in the jail and its user ID as the jail sees it (from `SO_PEERCRED`).
    pub peer: (i32, u32),
    /// The command it started, while it runs.
    pub command: Option<Pid>,
}

/// The listening socket and its clients.
#[derive(Debug)]
pub struct Sudo {
    listener: OwnedFd,
    /// The clients, in the order they came.
    pub clients: Vec<Client>,
    /// The host ID of the jail's root (peer credentials are host IDs in PID 1's user namespace).
    id_base: u32,
}

/// What a client's message was.
#[derive(Debug)]
pub enum Incoming {
    /// A request, with the descriptors that came beside it.
    Request(Request, Vec<OwnedFd>),
    /// A frame about its running command.
    Frame(ClientFrame),
    /// It closed its end, or sent what cannot be read: it is done.
    Gone,
    /// Nothing to read yet.
    Nothing,
}

impl Sudo {
    /// Listens on [`SOCKET`] (which must not exist), mode 0666, owned by the jail's root (host ID `id_base`).
    pub fn bind(id_base: u32) -> Result<Sudo, Errno> {
        let listener =
            socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK, None)?;
        bind(listener.as_raw_fd(), &UnixAddr::new(SOCKET)?)?;
        nix::sys::stat::fchmodat(
            nix::fcntl::AT_FDCWD,
            SOCKET,
            nix::sys::stat::Mode::from_bits_truncate(0o666),
            nix::sys::stat::FchmodatFlags::NoFollowSymlink,
        )?;
        let id = Some(id_base);
        nix::unistd::chown(SOCKET, id.map(nix::unistd::Uid::from_raw), id.map(nix::unistd::Gid::from_raw))?;
        listen(&listener, Backlog::new(16)?)?;
        Ok(Sudo { listener, clients: Vec::new(), id_base })
    }

    /// Adds the listener (while it takes clients) and every client to a poll set; returns where they start.
    pub fn poll_fds<'a>(&'a self, fds: &mut Vec<PollFd<'a>>) -> usize {
        let from = fds.len();
        let listening = if self.clients.len() < MAX_CLIENTS { PollFlags::POLLIN } else { PollFlags::empty() };
        fds.push(PollFd::new(self.listener.as_fd(), listening));
        fds.extend(self.clients.iter().map(|client| PollFd::new(client.socket.as_fd(), PollFlags::POLLIN)));
        from
    }

    /// Accepts the clients waiting, up to [`MAX_CLIENTS`].
    pub fn accept(&mut self) {
        while self.clients.len() < MAX_CLIENTS {
            let Ok(fd) = accept4(self.listener.as_raw_fd(), SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK) else {
                return;
            };
            // SAFETY: accept4 just returned this descriptor; nothing else owns it.
            let socket = unsafe { OwnedFd::from_raw_fd(fd) };
            let Ok(cred) = getsockopt(&socket, sockopt::PeerCredentials) else { continue };
            // An ID outside the jail's range (none can be there) is mapped to one no account has.
            let uid = cred.uid().checked_sub(self.id_base).unwrap_or(u32::MAX);
            self.clients.push(Client { socket, peer: (cred.pid(), uid), command: None });
        }
    }

    /// Reads what client `index` sent.
    pub fn read(&self, index: usize) -> Incoming {
        let socket = self.clients[index].socket.as_fd();
        let mut buf = vec![0u8; MAX_REQUEST + 1];
        let (len, truncated, fds) = match strata_fdpass::recv_with::<4>(socket, &mut buf, MsgFlags::MSG_DONTWAIT) {
            Ok(received) => (received.len, received.truncated, received.fds),
            Err(Errno::EAGAIN | Errno::EINTR) => return Incoming::Nothing,
            Err(_) => return Incoming::Gone,
        };
        if len == 0 || truncated || len > MAX_REQUEST {
            return Incoming::Gone;
        }
        decode(&buf[..len], fds, self.clients[index].command.is_some())
    }

    /// Sends `reply` to client `index` without waiting (a client that does not read loses it).
    pub fn reply(&self, index: usize, reply: &Reply) {
        reply_on(self.clients[index].socket.as_fd(), reply);
    }
}

/// What a client's message `body` (with `fds` beside it) says: a [`Request`] before its command runs, a
/// [`ClientFrame`] (with no descriptors) while it does (`running`); anything else ends the client.
pub fn decode(body: &[u8], fds: Vec<OwnedFd>, running: bool) -> Incoming {
    if running {
        return match serde_json::from_slice(body) {
            Ok(frame) if fds.is_empty() => Incoming::Frame(frame),
            _ => Incoming::Gone,
        };
    }
    match serde_json::from_slice(body) {
        Ok(request) => Incoming::Request(request, fds),
        Err(_) => Incoming::Gone,
    }
}

/// Sends `reply` on `socket` without waiting.
pub fn reply_on(socket: BorrowedFd<'_>, reply: &Reply) {
    if let Ok(doc) = serde_json::to_vec(reply) {
        let _ = send(socket.as_raw_fd(), &doc, MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL);
    }
}

/// The PID of `pid`'s parent in the jail, from `/proc/<pid>/stat` (`None` once it is gone).
pub fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid ...`; comm may hold spaces and parentheses, so read after the last `)`.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wire_format_is_the_clients() {
        // What the image's Python client sends and reads (guest-images/rootfs/src/sudo.py).
        let request: Request =
            serde_json::from_str(r#"{"argv":["id","-u"],"env":[["PATH","/usr/bin"]],"cwd":"/root"}"#).expect("parses");
        assert_eq!(request.argv, ["id", "-u"]);
        assert_eq!(serde_json::from_str::<ClientFrame>(r#"{"Signal":2}"#).expect("parses"), ClientFrame::Signal(2));
        let exited = serde_json::to_string(&Reply::Exited { code: Some(3), signal: None }).expect("serialises");
        assert_eq!(exited, r#"{"Exited":{"code":3,"signal":null}}"#);
        assert_eq!(serde_json::to_string(&Reply::Started(7)).expect("serialises"), r#"{"Started":7}"#);
        assert!(serde_json::from_str::<Request>(r#"{"argv":[],"env":[],"cwd":"/","uid":0}"#).is_err());
    }

    #[test]
    fn the_parent_is_read_after_the_command_name() {
        assert_eq!(parent_of(std::process::id() as i32), Some(nix::unistd::getppid().as_raw()));
        assert_eq!(parent_of(i32::MAX), None);
    }
}
