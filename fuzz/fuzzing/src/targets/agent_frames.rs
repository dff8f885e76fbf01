//! The agent protocol's framing and message decoding (`guest-images/proto`, `frame.rs` and `message.rs`): the
//! input is a byte stream as a hostile agent (or host) would send it, read frame by frame.
//!
//! Oracles: reading never fails other than with a typed [`FrameError`] (no panic, no allocation beyond a frame's
//! bound); a body that decodes re-encodes within [`MAX_FRAME`] and decodes back to the same message; a `Hello`
//! shows its version to [`peek_hello_version`]; every decoded message, the file methods' and watches' too,
//! names its kind, and an agent's message the request it is about (`Hello` none).

use std::fmt::Debug;

use serde::Serialize;
use serde::de::DeserializeOwned;
use strata_guest_proto::frame::{decode, encode, peek_hello_version};
use strata_guest_proto::{FrameError, FrameReader, GuestMessage, HostMessage, MAX_FRAME};

/// Reads `data` as frames of agent messages, then as frames of host messages.
pub fn run(data: &[u8]) {
    stream::<GuestMessage>(data, |m| {
        assert!(!m.kind().is_empty());
        match m {
            GuestMessage::Hello { version, .. } => {
                assert_eq!(m.request_id(), None, "a Hello names a request");
                Some(*version)
            }
            _ => None,
        }
    });
    stream::<HostMessage>(data, |m| {
        assert!(!m.kind().is_empty());
        match m {
            HostMessage::Hello { version } => Some(*version),
            _ => None,
        }
    });
}

fn stream<T>(data: &[u8], hello: fn(&T) -> Option<u32>)
where
    T: Serialize + DeserializeOwned + PartialEq + Debug,
{
    let mut reader = FrameReader::new(data);
    loop {
        let body = match reader.read_body() {
            Ok(Some(body)) => body,
            Ok(None) => return,
            Err(FrameError::TooLarge { len, max }) => {
                assert!(len > max as u64, "TooLarge for {len} <= {max}");
                return;
            }
            Err(FrameError::Truncated { expected, got, .. }) => {
                assert!(got < expected, "Truncated with {got} of {expected} bytes");
                return;
            }
            Err(err) => panic!("reading a byte slice failed with {err:?}"),
        };
        assert!(body.len() <= MAX_FRAME);
        let peeked = peek_hello_version(body);
        match decode::<T>(body) {
            Ok(message) => {
                let again = encode(&message).expect("a decoded message encodes");
                assert!(again.len() <= MAX_FRAME, "{message:?} re-encodes to {} bytes", again.len());
                let back: T = decode(&again).expect("a re-encoded message decodes");
                assert_eq!(back, message, "a message changed through encode and decode");
                if let Some(version) = hello(&message) {
                    assert_eq!(peeked, Some(version), "a Hello's version is not what peek_hello_version sees");
                }
            }
            Err(FrameError::Malformed { .. }) => {}
            Err(err) => panic!("decoding a frame body failed with {err:?}"),
        }
    }
}
