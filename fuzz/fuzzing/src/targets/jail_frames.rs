//! The process jail's control protocol (`tiers/process/jail/src/proto.rs`): one `SOCK_SEQPACKET` message, a JSON
//! document sent inline or spilled into a memfd, as the jail's PID 1 (which shares its namespaces with the job) or
//! the host would send it.
//!
//! Input: a mode byte, then the document. Mode bit 0 spills the document into a memfd sent as `@spill` (the way
//! documents over `MAX_INLINE` travel); bit 1 attaches a spare descriptor as well; bit 2 sends the spill marker
//! with no memfd. The message is received both as a [`JailFrame`] (what the host reads) and as a [`HostFrame`].
//!
//! The same bytes also go to the jail's `sudo` listener's decoder (mode bit 3: its command runs).
//!
//! Oracles: `recv` fails only with a typed [`ProtoError`], never panics; a frame it accepts survives a `send` and
//! `recv` round trip unchanged; documents over the inline limit are refused unless spilled.

use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::{Mutex, OnceLock, PoisonError};

use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
use serde::Serialize;
use serde::de::DeserializeOwned;
use strata_jail::proto::{HostFrame, JailFrame, MAX_INLINE, ProtoError, SPILL, recv, send};

use crate::generate::Cursor;

/// A connected pair, made once per process (a fresh pair per input would spend the input's time in the kernel).
fn pair() -> &'static Mutex<(OwnedFd, OwnedFd)> {
    static PAIR: OnceLock<Mutex<(OwnedFd, OwnedFd)>> = OnceLock::new();
    PAIR.get_or_init(crate::generate::seqpacket_pair)
}

/// Feeds one control message.
pub fn run(data: &[u8]) {
    let mut input = Cursor::new(data);
    let mode = input.u8();
    let doc = input.rest();
    if doc.len() > MAX_INLINE && mode & 1 == 0 {
        return; // the kernel would refuse nothing, but this one is no different from a truncated one
    }
    let pair = pair().lock().unwrap_or_else(PoisonError::into_inner);
    let (host, jail) = (&pair.0, &pair.1);
    deliver::<JailFrame>(jail, host, doc, mode);
    deliver::<HostFrame>(host, jail, doc, mode);
    drop(pair);
    sudo_message(doc, mode);
}

/// The same bytes as a message of a jail process to PID 1's `sudo` listener (`strata_jail::sudo`), which trusts
/// nothing of it: a request is taken only before the command runs, a signal frame only while it does and with no
/// descriptors, anything else ends the client; an accepted request survives a JSON round trip.
fn sudo_message(doc: &[u8], mode: u8) {
    use strata_jail::sudo::{Incoming, Request, decode};
    let fds = if mode & 2 != 0 { vec![memfd_create("fuzz-fd", MFdFlags::MFD_CLOEXEC).expect("memfd")] } else { vec![] };
    let with_fds = !fds.is_empty();
    match decode(doc, fds, mode & 8 != 0) {
        Incoming::Request(request, fds) => {
            assert!(mode & 8 == 0, "a request while the command runs");
            assert_eq!(fds.len(), usize::from(with_fds), "descriptors handed over beside the request");
            let json = serde_json::to_vec(&request).expect("serializes");
            let again: Request = serde_json::from_slice(&json).expect("an accepted request parses again");
            assert_eq!(again, request);
        }
        Incoming::Frame(_) => assert!(mode & 8 != 0 && !with_fds, "a signal frame before the command or with fds"),
        Incoming::Gone => {}
        Incoming::Nothing => panic!("decoding a message never waits"),
    }
}

fn deliver<T: Serialize + DeserializeOwned>(from: &OwnedFd, to: &OwnedFd, doc: &[u8], mode: u8) {
    let memfd = (mode & 1 != 0).then(|| {
        let fd = memfd_create("fuzz-frame", MFdFlags::MFD_CLOEXEC).expect("memfd");
        let mut file = std::fs::File::from(fd);
        file.write_all(doc).expect("write the memfd");
        OwnedFd::from(file)
    });
    let spare = (mode & 2 != 0).then(|| memfd_create("fuzz-spare", MFdFlags::MFD_CLOEXEC).expect("memfd"));
    let mut fds = Vec::new();
    fds.extend(spare.as_ref().map(|fd| fd.as_raw_fd()));
    if mode & 4 == 0 {
        fds.extend(memfd.as_ref().map(|fd| fd.as_raw_fd()));
    }
    let payload = if memfd.is_some() { SPILL } else { doc };
    let cmsgs = [ControlMessage::ScmRights(&fds)];
    let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &cmsgs };
    let iov = [std::io::IoSlice::new(payload)];
    if payload.is_empty() && fds.is_empty() {
        return; // an empty message reads as the peer closing, which it is not
    }
    sendmsg::<()>(from.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_DONTWAIT, None).expect("send one message");
    match recv::<T>(to.as_fd()) {
        Ok(Some((frame, received))) => {
            let expected = usize::from(spare.is_some());
            assert_eq!(received.len(), expected, "descriptors handed over beside the frame");
            round_trip::<T>(from, to, &frame);
        }
        Ok(None) => panic!("a message read as the end of the connection"),
        Err(ProtoError::Malformed(_)) => {}
        Err(ProtoError::Io(err)) => panic!("receiving a queued message failed: {err}"),
    }
}

fn round_trip<T: Serialize + DeserializeOwned>(from: &OwnedFd, to: &OwnedFd, frame: &T) {
    let json = serde_json::to_value(frame).expect("an accepted frame serializes");
    send(from.as_fd(), frame, &[]).expect("an accepted frame is sent");
    let (again, fds): (T, _) = recv(to.as_fd()).expect("a sent frame is received").expect("not the end");
    assert!(fds.is_empty());
    assert_eq!(serde_json::to_value(&again).expect("serializes"), json, "a frame changed through send and recv");
}
