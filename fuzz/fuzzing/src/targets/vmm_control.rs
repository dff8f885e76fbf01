//! The microVM monitor's control protocol (`tiers/microvm/vmm/src/proto.rs`): one `SOCK_SEQPACKET` message, a JSON
//! document of at most `MAX_MESSAGE` bytes with descriptors beside it, as a monitor taken over by its guest would
//! send it to the engine ([`Reply`]), or as the engine sends it to the monitor ([`Request`]).
//!
//! Input: a mode byte, then the document. Mode bit 0 attaches a spare descriptor.
//!
//! Oracles: `recv` fails only with a typed [`ProtoError::Malformed`], never panics; a message it accepts survives a
//! `send` and `recv` round trip unchanged; a document over the limit is refused.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::{Mutex, OnceLock, PoisonError};

use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
use serde::Serialize;
use serde::de::DeserializeOwned;
use strata_vmm::proto::{MAX_MESSAGE, ProtoError, Reply, Request, recv, send};

use crate::generate::Cursor;

fn pair() -> &'static Mutex<(OwnedFd, OwnedFd)> {
    static PAIR: OnceLock<Mutex<(OwnedFd, OwnedFd)>> = OnceLock::new();
    PAIR.get_or_init(crate::generate::seqpacket_pair)
}

/// Feeds one control message each way.
pub fn run(data: &[u8]) {
    let mut input = Cursor::new(data);
    let mode = input.u8();
    let doc = input.rest();
    if doc.is_empty() && mode & 1 == 0 {
        return; // an empty message reads as the peer closing, which it is not
    }
    let pair = pair().lock().unwrap_or_else(PoisonError::into_inner);
    deliver::<Reply>(&pair.0, &pair.1, doc, mode);
    deliver::<Request>(&pair.1, &pair.0, doc, mode);
}

fn deliver<T: Serialize + DeserializeOwned>(from: &OwnedFd, to: &OwnedFd, doc: &[u8], mode: u8) {
    let spare = (mode & 1 != 0).then(|| memfd_create("fuzz-spare", MFdFlags::MFD_CLOEXEC).expect("memfd"));
    let fds: Vec<i32> = spare.iter().map(|fd| fd.as_raw_fd()).collect();
    let cmsgs = [ControlMessage::ScmRights(&fds)];
    let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &cmsgs };
    let iov = [std::io::IoSlice::new(doc)];
    if sendmsg::<()>(from.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_DONTWAIT, None).is_err() {
        return; // larger than the socket takes: nothing to receive
    }
    match recv::<T>(to.as_fd()) {
        Ok(Some((message, received))) => {
            assert!(doc.len() <= MAX_MESSAGE, "a {}-byte message was accepted", doc.len());
            assert_eq!(received.len(), usize::from(spare.is_some()), "descriptors handed over beside it");
            let json = serde_json::to_value(&message).expect("an accepted message serializes");
            send(from.as_fd(), &message, &[]).expect("an accepted message is sent");
            let (again, fds): (T, _) = recv(to.as_fd()).expect("a sent message is received").expect("not the end");
            assert!(fds.is_empty());
            assert_eq!(serde_json::to_value(&again).expect("serializes"), json, "changed through send and recv");
        }
        Ok(None) => panic!("a message read as the end of the connection"),
        Err(ProtoError::Malformed(_)) => {}
        Err(ProtoError::Socket(errno)) => panic!("receiving a queued message failed: {errno}"),
    }
}
