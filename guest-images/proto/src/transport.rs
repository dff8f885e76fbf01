//! The byte streams the protocol runs over: AF_VSOCK in a guest, a Unix socket on the host (tests, and the
//! agent run as an ordinary process). Both sides use a connection from two threads (one reads, others write),
//! so a [`Transport`] can hand out a second handle on itself and be shut down from either.

use std::io::{self, Read, Write};
use std::mem::size_of;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// A connected, reliable byte stream.
pub trait Transport: Read + Write + Send + Sized + 'static {
    /// A second handle on the same connection.
    fn try_clone(&self) -> io::Result<Self>;
    /// Shuts down both directions: a thread blocked reading another handle sees the end of the stream.
    fn shutdown(&self) -> io::Result<()>;
    /// Bounds each read (`None`: reads block until data arrives).
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
}

impl Transport for UnixStream {
    fn try_clone(&self) -> io::Result<Self> {
        UnixStream::try_clone(self)
    }

    fn shutdown(&self) -> io::Result<()> {
        UnixStream::shutdown(self, std::net::Shutdown::Both)
    }

    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        UnixStream::set_read_timeout(self, timeout)
    }
}

/// `VMADDR_CID_ANY`: a listener accepts connections to any of the guest's addresses.
pub const VMADDR_CID_ANY: u32 = libc::VMADDR_CID_ANY;

/// `VMADDR_CID_HOST`: the host, seen from a guest.
pub const VMADDR_CID_HOST: u32 = libc::VMADDR_CID_HOST;

fn vsock_address(cid: u32, port: u32) -> libc::sockaddr_vm {
    libc::sockaddr_vm {
        svm_family: libc::AF_VSOCK as libc::sa_family_t,
        svm_reserved1: 0,
        svm_port: port,
        svm_cid: cid,
        svm_zero: [0; 4],
    }
}

fn vsock_socket() -> io::Result<OwnedFd> {
    // SAFETY: socket() takes no pointers; a non-negative result is a new descriptor that nothing else owns.
    let fd = unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by socket() and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// A listening AF_VSOCK stream socket.
#[derive(Debug)]
pub struct VsockListener {
    fd: OwnedFd,
}

impl VsockListener {
    /// Listens on `port` of every local CID.
    pub fn bind(port: u32) -> io::Result<Self> {
        let fd = vsock_socket()?;
        let address = vsock_address(VMADDR_CID_ANY, port);
        // SAFETY: `address` is a valid sockaddr_vm that outlives the call, and the length passed is its size.
        check(unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&raw const address).cast::<libc::sockaddr>(),
                size_of::<libc::sockaddr_vm>() as libc::socklen_t,
            )
        })?;
        // SAFETY: listen() takes no pointers.
        check(unsafe { libc::listen(fd.as_raw_fd(), 4) })?;
        Ok(VsockListener { fd })
    }

    /// Waits for a connection; returns it and the peer's CID.
    pub fn accept(&self) -> io::Result<(VsockStream, u32)> {
        loop {
            let mut address = vsock_address(0, 0);
            let mut len = size_of::<libc::sockaddr_vm>() as libc::socklen_t;
            // SAFETY: `address` and `len` are valid for writes and describe a buffer of `len` bytes.
            let fd = unsafe {
                libc::accept4(
                    self.fd.as_raw_fd(),
                    (&raw mut address).cast::<libc::sockaddr>(),
                    &mut len,
                    libc::SOCK_CLOEXEC,
                )
            };
            if fd < 0 {
                let err = io::Error::last_os_error();
                if err.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(err);
            }
            // SAFETY: accept4 just returned this descriptor; nothing else owns it.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            return Ok((VsockStream { fd }, address.svm_cid));
        }
    }
}

impl AsFd for VsockListener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// A connected AF_VSOCK stream socket.
#[derive(Debug)]
pub struct VsockStream {
    fd: OwnedFd,
}

impl VsockStream {
    /// Connects to `port` at `cid`.
    pub fn connect(cid: u32, port: u32) -> io::Result<Self> {
        let fd = vsock_socket()?;
        let address = vsock_address(cid, port);
        // SAFETY: `address` is a valid sockaddr_vm that outlives the call, and the length passed is its size.
        check(unsafe {
            libc::connect(
                fd.as_raw_fd(),
                (&raw const address).cast::<libc::sockaddr>(),
                size_of::<libc::sockaddr_vm>() as libc::socklen_t,
            )
        })?;
        Ok(VsockStream { fd })
    }
}

impl AsFd for VsockStream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for VsockStream {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl Read for VsockStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: `buf` is valid for writes of `buf.len()` bytes for the duration of the call.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
    }
}

impl Write for VsockStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // SAFETY: `buf` is valid for reads of `buf.len()` bytes for the duration of the call.
        let n = unsafe { libc::send(self.fd.as_raw_fd(), buf.as_ptr().cast(), buf.len(), libc::MSG_NOSIGNAL) };
        if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Transport for VsockStream {
    fn try_clone(&self) -> io::Result<Self> {
        Ok(VsockStream { fd: self.fd.try_clone()? })
    }

    fn shutdown(&self) -> io::Result<()> {
        // SAFETY: shutdown() takes no pointers.
        check(unsafe { libc::shutdown(self.fd.as_raw_fd(), libc::SHUT_RDWR) })
    }

    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        let timeval = match timeout {
            // A zero timeval means "no timeout"; the smallest real one is a microsecond.
            Some(t) => libc::timeval {
                tv_sec: t.as_secs().try_into().unwrap_or(i32::MAX.into()),
                tv_usec: t.subsec_micros().max(u32::from(t.is_zero())).into(),
            },
            None => libc::timeval { tv_sec: 0, tv_usec: 0 },
        };
        // SAFETY: `timeval` is a valid struct timeval that outlives the call; the length passed is its size.
        check(unsafe {
            libc::setsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&raw const timeval).cast(),
                size_of::<libc::timeval>() as libc::socklen_t,
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vsock_code_runs_or_reports_an_os_error() {
        // Outside a VM (or without the vsock modules) the socket calls fail with an OS error, never worse.
        match VsockListener::bind(0xdead) {
            Ok(listener) => drop(listener),
            Err(err) => assert!(err.raw_os_error().is_some(), "{err}"),
        }
        match VsockStream::connect(VMADDR_CID_HOST, 0xdead) {
            Ok(stream) => drop(stream),
            Err(err) => assert!(err.raw_os_error().is_some(), "{err}"),
        }
    }

    #[test]
    fn unix_stream_clone_and_shutdown() {
        let (a, mut b) = UnixStream::pair().expect("pair");
        let mut a2 = Transport::try_clone(&a).expect("clone");
        a2.write_all(b"x").expect("write");
        let mut one = [0u8; 1];
        b.read_exact(&mut one).expect("read");
        Transport::shutdown(&a).expect("shutdown");
        let mut rest = Vec::new();
        assert_eq!(b.read_to_end(&mut rest).expect("eof"), 0);
    }
}
