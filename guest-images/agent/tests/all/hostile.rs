//! A host that sends what a correct client would not: the agent answers with an error or hangs up, never
//! panics.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::thread::JoinHandle;
use std::time::Duration;

use strata_agent::{ServeEnd, ServeError};
use strata_guest_proto::{
    Bytes, ExecRequest, FrameError, FrameReader, FrameWriter, GuestMessage, HostMessage, PROTOCOL_VERSION, RequestId,
};

use crate::{agent_thread, argv, noise};

struct Raw {
    reader: FrameReader<UnixStream>,
    writer: FrameWriter<UnixStream>,
    agent: JoinHandle<Result<ServeEnd, ServeError>>,
}

impl Raw {
    fn new() -> Raw {
        let (host, agent) = agent_thread();
        host.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        Raw { writer: FrameWriter::new(host.try_clone().expect("clone")), reader: FrameReader::new(host), agent }
    }

    fn hello() -> Raw {
        let mut raw = Raw::new();
        raw.send(&HostMessage::Hello { version: PROTOCOL_VERSION });
        assert!(matches!(raw.recv(), Some(GuestMessage::Hello { .. })));
        raw
    }

    fn send(&mut self, message: &HostMessage) {
        self.writer.write(message).expect("send");
    }

    fn recv(&mut self) -> Option<GuestMessage> {
        self.reader.read().expect("recv")
    }

    fn raw(&mut self, bytes: &[u8]) {
        self.writer.get_ref().try_clone().expect("clone").write_all(bytes).expect("write");
    }

    fn close(self) -> Result<ServeEnd, ServeError> {
        self.writer.get_ref().shutdown(std::net::Shutdown::Both).expect("shutdown");
        self.agent.join().expect("the agent thread must not panic")
    }
}

fn is_connection_error(message: Option<GuestMessage>) -> bool {
    matches!(message, Some(GuestMessage::Error { id: None, .. }))
}

#[test]
fn garbage_frames_are_answered_and_the_connection_goes_on() {
    let mut raw = Raw::hello();
    let mut bodies: Vec<Vec<u8>> = vec![
        vec![],
        vec![200],
        vec![0xff; 9],
        // Exec with a truncated request.
        vec![1, 1, 5, b'a'],
        // StdinData whose byte string claims 2^40 bytes.
        [&[2u8, 1, 0xfd][..], &(1u64 << 40).to_le_bytes()].concat(),
        // PowerOff followed by a stray byte.
        vec![9, 0],
    ];
    for seed in 0..300u64 {
        let mut body = noise((seed % 200) as usize + 1, seed + 1);
        // Never a real variant (0..=9) at the start, so no random message is valid (or runs something).
        body[0] = 10 + body[0] % 200;
        bodies.push(body);
    }
    for body in &bodies {
        raw.writer.write_body(body).expect("send");
        assert!(is_connection_error(raw.recv()), "{body:?}");
    }
    // Still serving.
    raw.send(&HostMessage::PrepareSnapshot { id: RequestId(1) });
    assert_eq!(raw.recv(), Some(GuestMessage::Ack { id: RequestId(1) }));
    assert_eq!(raw.close().expect("serve"), ServeEnd::Closed);
}

#[test]
fn an_oversize_frame_is_answered_and_the_connection_closed() {
    let mut raw = Raw::hello();
    raw.raw(&u32::MAX.to_le_bytes());
    assert!(is_connection_error(raw.recv()));
    assert_eq!(raw.recv(), None);
    let end = raw.close();
    assert!(matches!(end, Err(ServeError::Frame(FrameError::TooLarge { .. }))), "{end:?}");
}

#[test]
fn a_truncated_frame_ends_the_connection() {
    let mut raw = Raw::hello();
    raw.raw(&100u32.to_le_bytes());
    raw.raw(&[1; 10]);
    raw.writer.get_ref().shutdown(std::net::Shutdown::Write).expect("shutdown");
    let end = raw.agent.join().expect("no panic");
    assert!(matches!(end, Err(ServeError::Frame(FrameError::Truncated { part: "body", .. }))), "{end:?}");
}

#[test]
fn the_first_message_must_be_hello() {
    let mut raw = Raw::new();
    raw.send(&HostMessage::ReadFile { id: RequestId(1), path: "/etc/hostname".into(), max: 100 });
    assert!(is_connection_error(raw.recv()));
    let end = raw.close();
    assert!(matches!(end, Err(ServeError::NoHello { kind: "ReadFile" })), "{end:?}");
}

#[test]
fn a_host_of_another_version_is_told_ours_and_dropped() {
    let mut raw = Raw::new();
    raw.send(&HostMessage::Hello { version: PROTOCOL_VERSION + 1 });
    assert!(matches!(raw.recv(), Some(GuestMessage::Hello { version: PROTOCOL_VERSION, .. })));
    assert_eq!(raw.recv(), None);
    assert_eq!(raw.close().expect("serve"), ServeEnd::VersionMismatch { host: PROTOCOL_VERSION + 1 });
}

#[test]
fn messages_for_unknown_execs_are_ignored_and_ids_are_not_reused_while_running() {
    let mut raw = Raw::hello();
    raw.send(&HostMessage::StdinData { id: RequestId(77), data: Bytes(b"x".to_vec()) });
    raw.send(&HostMessage::StdinClose { id: RequestId(77) });
    raw.send(&HostMessage::Signal { id: RequestId(77), signal: libc::SIGKILL });
    let sleep = ExecRequest { ..argv(&["sleep", "100"]) };
    raw.send(&HostMessage::Exec { id: RequestId(5), request: sleep.clone() });
    let Some(GuestMessage::Started { id: RequestId(5), .. }) = raw.recv() else { panic!("not started") };
    raw.send(&HostMessage::Exec { id: RequestId(5), request: sleep });
    assert!(matches!(raw.recv(), Some(GuestMessage::ExecFailed { id: RequestId(5), errno: libc::EBUSY, .. })));
    // A signal number out of range is refused by the kernel, not by a panic.
    raw.send(&HostMessage::Signal { id: RequestId(5), signal: 100_000 });
    raw.send(&HostMessage::Signal { id: RequestId(5), signal: libc::SIGKILL });
    assert!(matches!(raw.recv(), Some(GuestMessage::Exited { id: RequestId(5), .. })));
    assert_eq!(raw.close().expect("serve"), ServeEnd::Closed);
}
