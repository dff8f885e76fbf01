//! The warm daemon's requests (`engine/src/warm.rs`): one `SOCK_SEQPACKET` message from a process of the daemon's
//! user that connected to its socket, received as the daemon receives it and judged by the daemon's rule
//! (`check_request`) against a daemon of a fixed binary identity and environment.
//!
//! Input: a byte whose low two bits say how many descriptors travel beside the message (0 to 3), then the
//! document.
//!
//! Oracles: receiving fails only with a typed `ProtoError`, never panics; a request the rule accepts is a `run` of
//! this protocol and binary, from an absolute directory, of `strata run`, with exactly the three standard streams,
//! in the daemon's environment (but for the shell's noise); an accepted request survives a send and receive round
//! trip unchanged.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::{Mutex, OnceLock, PoisonError};

use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
use strata_engine::warm::{PROTOCOL, Request, check_request};
use strata_jail::proto::{ProtoError, recv, send};

use crate::generate::Cursor;

/// The daemon's identity in this target.
pub const IDENTITY: &str = "2049:1234:221408288:1796520000.0:0.1.0";

/// The daemon's environment in this target, as `comparable_env` lists it.
pub fn environment() -> Vec<(String, String)> {
    vec![("HOME".into(), "/root".into()), ("PATH".into(), "/usr/bin:/bin".into())]
}

fn pair() -> &'static Mutex<(OwnedFd, OwnedFd)> {
    static PAIR: OnceLock<Mutex<(OwnedFd, OwnedFd)>> = OnceLock::new();
    PAIR.get_or_init(crate::generate::seqpacket_pair)
}

/// Feeds one request.
pub fn run(data: &[u8]) {
    let mut input = Cursor::new(data);
    let descriptors = usize::from(input.u8() & 3);
    let doc = input.rest();
    if doc.is_empty() && descriptors == 0 {
        return; // an empty message reads as the client closing, which it is not
    }
    if doc.len() > strata_jail::proto::MAX_INLINE {
        return; // a client's request is one inline message; a longer one is no different from a truncated one
    }
    let pair = pair().lock().unwrap_or_else(PoisonError::into_inner);
    let (client, daemon) = (&pair.0, &pair.1);
    let stdin = std::io::stdin();
    let fds: Vec<i32> = (0..descriptors).map(|_| stdin.as_fd().as_raw_fd()).collect();
    let cmsgs = [ControlMessage::ScmRights(&fds)];
    let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &cmsgs };
    let iov = [std::io::IoSlice::new(doc)];
    sendmsg::<()>(client.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_DONTWAIT, None).expect("send one message");
    let (request, received) = match recv::<Request>(daemon.as_fd()) {
        Ok(Some(message)) => message,
        Ok(None) => panic!("a message read as the end of the connection"),
        Err(ProtoError::Malformed(_)) => return,
        Err(ProtoError::Io(err)) => panic!("receiving a queued message failed: {err}"),
    };
    assert_eq!(received.len(), descriptors, "descriptors handed over beside the request");
    let env = environment();
    if let Request::Run(run) = &request
        && check_request(run, received.len(), 0, IDENTITY, &env).is_ok()
    {
        assert_eq!((run.protocol, run.identity.as_str(), received.len()), (PROTOCOL, IDENTITY, 3));
        assert_eq!(run.argv.get(1).map(String::as_str), Some("run"));
        assert!(run.cwd.is_absolute(), "{:?}", run.cwd);
        let mut theirs: Vec<_> =
            run.env.iter().filter(|(k, _)| !["PWD", "OLDPWD", "SHLVL", "_"].contains(&k.as_str())).cloned().collect();
        theirs.sort();
        assert_eq!(theirs, env, "an accepted request is of the daemon's environment");
    }
    drop(received);
    let json = serde_json::to_value(&request).expect("an accepted request serializes");
    send(client.as_fd(), &request, &[]).expect("an accepted request is sent");
    let (again, fds) = recv::<Request>(daemon.as_fd()).expect("a sent request is received").expect("not the end");
    assert!(fds.is_empty());
    assert_eq!(serde_json::to_value(&again).expect("serializes"), json, "a request changed through send and recv");
}
