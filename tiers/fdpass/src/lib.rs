//! One datagram and the descriptors beside it (`SCM_RIGHTS`) over a Unix socket (`SOCK_SEQPACKET`): the transport
//! of the process jail's control protocol (`strata-jail`) and of the microVM monitor's (`strata-vmm`), each of
//! which frames and bounds its own messages on top. Received descriptors are close-on-exec and owned at once, so
//! none leaks whatever the caller does with the message; a message or control data cut short by the buffer is
//! reported, never taken as whole.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;
use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};

/// Sends `payload` as one datagram with `fds` beside it (none: no control message), retrying on `EINTR`.
pub fn send(socket: BorrowedFd<'_>, payload: &[u8], fds: &[RawFd], flags: MsgFlags) -> Result<(), Errno> {
    let iov = [IoSlice::new(payload)];
    let rights = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &rights };
    loop {
        match sendmsg::<()>(socket.as_raw_fd(), &iov, cmsgs, flags, None) {
            Ok(_) => return Ok(()),
            Err(Errno::EINTR) => continue,
            Err(errno) => return Err(errno),
        }
    }
}

/// A datagram received into the caller's buffer.
#[derive(Debug)]
pub struct Received {
    /// Bytes of the datagram in the buffer (0 with no descriptor: the peer closed the socket).
    pub len: usize,
    /// The datagram or its descriptors did not fit (`MSG_TRUNC`, `MSG_CTRUNC`): the message is not whole.
    pub truncated: bool,
    /// The descriptors that came with it, owned.
    pub fds: Vec<OwnedFd>,
}

/// The most descriptors Linux passes in one message (`SCM_MAX_FD`).
const SCM_MAX_FD: usize = 253;

/// Receives one datagram into `buf`, retrying on `EINTR`. More than `MAX_FDS` descriptors make it `truncated`,
/// and are closed: the control buffer holds as many as the kernel ever passes, because descriptors that do not
/// fit in it would be installed in this process's table where nothing could reach them to close them.
pub fn recv<const MAX_FDS: usize>(socket: BorrowedFd<'_>, buf: &mut [u8]) -> Result<Received, Errno> {
    recv_with::<MAX_FDS>(socket, buf, MsgFlags::empty())
}

/// [`recv`] with more `flags` (`MSG_DONTWAIT`: `EAGAIN` when nothing is queued; `EINTR` is then returned too).
pub fn recv_with<const MAX_FDS: usize>(
    socket: BorrowedFd<'_>,
    buf: &mut [u8],
    flags: MsgFlags,
) -> Result<Received, Errno> {
    let mut cmsg = nix::cmsg_space!([RawFd; SCM_MAX_FD]);
    let retry = !flags.contains(MsgFlags::MSG_DONTWAIT);
    loop {
        let mut iov = [IoSliceMut::new(buf)];
        match recvmsg::<()>(socket.as_raw_fd(), &mut iov, Some(&mut cmsg), flags | MsgFlags::MSG_CMSG_CLOEXEC) {
            Ok(msg) => {
                let mut fds = Vec::new();
                for c in msg.cmsgs()? {
                    if let ControlMessageOwned::ScmRights(list) = c {
                        for fd in list {
                            // SAFETY: SCM_RIGHTS installed these descriptors in our table just now; nothing
                            // else owns them.
                            fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                        }
                    }
                }
                let truncated = msg.flags.intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC) || fds.len() > MAX_FDS;
                return Ok(Received { len: msg.bytes, truncated, fds });
            }
            Err(Errno::EINTR) if retry => continue,
            Err(errno) => return Err(errno),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
    use std::os::fd::AsFd;

    fn pair() -> (OwnedFd, OwnedFd) {
        socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC).expect("socketpair")
    }

    #[test]
    fn a_datagram_and_its_descriptors_cross_and_what_does_not_fit_is_reported() {
        let (a, b) = pair();
        let file = std::fs::File::open("/proc/self/stat").expect("a file");
        send(a.as_fd(), b"hello", &[file.as_raw_fd(), file.as_raw_fd()], MsgFlags::empty()).expect("send");
        let mut buf = [0u8; 16];
        let got = recv::<2>(b.as_fd(), &mut buf).expect("recv");
        assert_eq!((&buf[..got.len], got.truncated, got.fds.len()), (&b"hello"[..], false, 2));
        // Three descriptors where two are allowed, and a datagram longer than the buffer: both reported, and the
        // descriptors all owned (closed when dropped, none left in the table).
        let open = || std::fs::read_dir("/proc/self/fd").expect("fds").count();
        let before = open();
        send(a.as_fd(), b"x", &[file.as_raw_fd(); 3], MsgFlags::empty()).expect("send");
        let over = recv::<2>(b.as_fd(), &mut buf).expect("recv");
        assert!(over.truncated && over.fds.len() == 3);
        drop(over);
        send(a.as_fd(), b"x", &[file.as_raw_fd(); SCM_MAX_FD], MsgFlags::empty()).expect("send");
        assert_eq!(recv::<2>(b.as_fd(), &mut buf).expect("recv").fds.len(), SCM_MAX_FD);
        assert_eq!(open(), before, "no descriptor left behind");
        send(a.as_fd(), &[7u8; 32], &[], MsgFlags::empty()).expect("send");
        assert!(recv::<2>(b.as_fd(), &mut buf).expect("recv").truncated);
        drop(a);
        let closed = recv::<2>(b.as_fd(), &mut buf).expect("recv");
        assert_eq!((closed.len, closed.fds.len()), (0, 0));
    }
}
