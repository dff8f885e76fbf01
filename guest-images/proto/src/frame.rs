//! Framing: a little-endian `u32` body length, then the body, one bincode-encoded message.
//!
//! Neither side trusts the other's sizes: a length above [`MAX_FRAME`] is refused before anything is
//! allocated, a stream that ends inside a frame is [`FrameError::Truncated`], and a body must decode to exactly
//! one message with nothing left over. Lengths inside a body (strings, byte strings, lists) are checked against
//! the body itself by the decoder (which is also limited to [`MAX_FRAME`] bytes of allocation).

use std::io::{self, Read, Write};

use bincode::config::{Config, standard};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// The largest frame body, in bytes.
pub const MAX_FRAME: usize = 1 << 20;

/// The length prefix's size.
pub const HEADER_LEN: usize = 4;

fn config() -> impl Config {
    standard().with_little_endian().with_variable_int_encoding().with_limit::<MAX_FRAME>()
}

/// A frame that could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The length prefix (or a message to send) exceeds [`MAX_FRAME`].
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// The announced (or encoded) body length.
        len: u64,
        /// [`MAX_FRAME`].
        max: usize,
    },
    /// The stream ended inside a frame.
    #[error("connection closed {got} bytes into a {expected}-byte frame {part}")]
    Truncated {
        /// `header` or `body`.
        part: &'static str,
        /// The bytes the part should have had.
        expected: usize,
        /// The bytes that arrived.
        got: usize,
    },
    /// The body is not one valid message.
    #[error("malformed frame: {reason}")]
    Malformed {
        /// What the decoder found wrong.
        reason: String,
    },
    /// The connection failed.
    #[error("connection failed")]
    Io(#[source] io::Error),
}

impl Clone for FrameError {
    fn clone(&self) -> Self {
        match self {
            FrameError::TooLarge { len, max } => FrameError::TooLarge { len: *len, max: *max },
            FrameError::Truncated { part, expected, got } => {
                FrameError::Truncated { part, expected: *expected, got: *got }
            }
            FrameError::Malformed { reason } => FrameError::Malformed { reason: reason.clone() },
            FrameError::Io(err) => FrameError::Io(match err.raw_os_error() {
                Some(code) => io::Error::from_raw_os_error(code),
                None => io::Error::new(err.kind(), err.to_string()),
            }),
        }
    }
}

/// Encodes a message as one frame body.
pub fn encode<T: Serialize>(message: &T) -> Result<Vec<u8>, FrameError> {
    let mut body = Vec::new();
    encode_into(message, &mut body)?;
    Ok(body)
}

fn encode_into<T: Serialize>(message: &T, out: &mut Vec<u8>) -> Result<(), FrameError> {
    let start = out.len();
    bincode::serde::encode_into_std_write(message, out, config())
        .map_err(|err| FrameError::Malformed { reason: err.to_string() })?;
    let len = out.len() - start;
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge { len: len as u64, max: MAX_FRAME });
    }
    Ok(())
}

/// Decodes one frame body, which must hold exactly one message.
pub fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, FrameError> {
    if body.len() > MAX_FRAME {
        return Err(FrameError::TooLarge { len: body.len() as u64, max: MAX_FRAME });
    }
    let (message, used) = bincode::serde::decode_from_slice::<T, _>(body, config())
        .map_err(|err| FrameError::Malformed { reason: err.to_string() })?;
    if used != body.len() {
        return Err(FrameError::Malformed { reason: format!("{} bytes after the message", body.len() - used) });
    }
    Ok(message)
}

/// The version in a frame body that starts like a `Hello` of any protocol version (variant 0, then the version),
/// even when the rest of it does not decode as this version's `Hello`.
pub fn peek_hello_version(body: &[u8]) -> Option<u32> {
    match bincode::serde::decode_from_slice::<(u32, u32), _>(body, config()) {
        Ok(((0, version), _)) => Some(version),
        _ => None,
    }
}

/// Reads frames from a byte stream.
#[derive(Debug)]
pub struct FrameReader<R> {
    inner: R,
    body: Vec<u8>,
}

impl<R: Read> FrameReader<R> {
    /// Reads from `inner`.
    pub fn new(inner: R) -> Self {
        FrameReader { inner, body: Vec::new() }
    }

    /// The stream.
    pub fn get_ref(&self) -> &R {
        &self.inner
    }

    /// Reads one frame body; `Ok(None)` when the stream ends cleanly between frames.
    pub fn read_body(&mut self) -> Result<Option<&[u8]>, FrameError> {
        let mut header = [0u8; HEADER_LEN];
        let got = read_full(&mut self.inner, &mut header)?;
        if got == 0 {
            return Ok(None);
        }
        if got < HEADER_LEN {
            return Err(FrameError::Truncated { part: "header", expected: HEADER_LEN, got });
        }
        let len = u32::from_le_bytes(header);
        let len = usize::try_from(len)
            .ok()
            .filter(|&len| len <= MAX_FRAME)
            .ok_or(FrameError::TooLarge { len: u64::from(len), max: MAX_FRAME })?;
        self.body.clear();
        self.body.resize(len, 0);
        let got = read_full(&mut self.inner, &mut self.body)?;
        if got < len {
            return Err(FrameError::Truncated { part: "body", expected: len, got });
        }
        Ok(Some(&self.body))
    }

    /// Reads and decodes one message; `Ok(None)` when the stream ends cleanly between frames.
    pub fn read<T: DeserializeOwned>(&mut self) -> Result<Option<T>, FrameError> {
        match self.read_body()? {
            None => Ok(None),
            Some(body) => decode(body).map(Some),
        }
    }
}

/// Fills `buf` unless the stream ends first; returns how many bytes arrived.
fn read_full(reader: &mut impl Read, buf: &mut [u8]) -> Result<usize, FrameError> {
    let mut got = 0;
    while got < buf.len() {
        match reader.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(err) => return Err(FrameError::Io(err)),
        }
    }
    Ok(got)
}

/// Writes frames to a byte stream.
#[derive(Debug)]
pub struct FrameWriter<W> {
    inner: W,
    frame: Vec<u8>,
}

impl<W: Write> FrameWriter<W> {
    /// Writes to `inner`.
    pub fn new(inner: W) -> Self {
        FrameWriter { inner, frame: Vec::new() }
    }

    /// The stream.
    pub fn get_ref(&self) -> &W {
        &self.inner
    }

    /// Encodes and writes one message (nothing is written when it is too large).
    pub fn write<T: Serialize>(&mut self, message: &T) -> Result<(), FrameError> {
        self.frame.clear();
        self.frame.extend_from_slice(&[0; HEADER_LEN]);
        encode_into(message, &mut self.frame)?;
        let len = u32::try_from(self.frame.len() - HEADER_LEN)
            .map_err(|_| FrameError::TooLarge { len: self.frame.len() as u64, max: MAX_FRAME })?;
        self.frame[..HEADER_LEN].copy_from_slice(&len.to_le_bytes());
        self.inner.write_all(&self.frame).map_err(FrameError::Io)?;
        self.inner.flush().map_err(FrameError::Io)
    }

    /// Writes an already encoded body (tests use this to send what a correct peer would not).
    pub fn write_body(&mut self, body: &[u8]) -> Result<(), FrameError> {
        let len = u32::try_from(body.len())
            .ok()
            .filter(|&len| len as usize <= MAX_FRAME)
            .ok_or(FrameError::TooLarge { len: body.len() as u64, max: MAX_FRAME })?;
        self.inner.write_all(&len.to_le_bytes()).map_err(FrameError::Io)?;
        self.inner.write_all(body).map_err(FrameError::Io)?;
        self.inner.flush().map_err(FrameError::Io)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::*;

    fn sample_host_messages() -> Vec<HostMessage> {
        vec![
            HostMessage::Hello { version: 7 },
            HostMessage::Exec {
                id: RequestId(1),
                request: ExecRequest {
                    argv: vec!["sh".into(), "-c".into(), "echo hi".into()],
                    env: vec![("PATH".into(), "/bin".into())],
                    cwd: "/".into(),
                    stdin: true,
                    limits: ExecLimits { output: Some(10), open_files: Some(64), cpu_seconds: None },
                    tty: None,
                },
            },
            HostMessage::StdinData { id: RequestId(1), data: Bytes(vec![0, 1, 2, 255]) },
            HostMessage::StdinClose { id: RequestId(1) },
            HostMessage::Signal { id: RequestId(1), signal: 9 },
            HostMessage::WriteFile {
                id: RequestId(2),
                path: "/tmp/x".into(),
                mode: 0o644,
                data: Bytes(vec![7; 1000]),
                last: true,
            },
            HostMessage::ReadFile { id: RequestId(3), path: "/etc/hostname".into(), max: 4096 },
            HostMessage::PrepareSnapshot { id: RequestId(4) },
            HostMessage::AfterRestore {
                id: RequestId(5),
                entropy: Entropy([0xa5; Entropy::LEN]),
                unix_time_ns: 1_700_000_000_000_000_000,
            },
            HostMessage::PowerOff,
            HostMessage::MakeDir { id: RequestId(6), path: "/data/sub".into(), mode: 0o750, empty: true },
            HostMessage::MakeSymlink { id: RequestId(7), path: "/data/link".into(), target: "../x".into() },
            HostMessage::ListTree { id: RequestId(8), path: "/data".into(), max_entries: 100_000 },
            HostMessage::StartEgress { id: RequestId(9), listen_port: 3128, host_port: 1028, max_connections: 64 },
            HostMessage::Stat { id: RequestId(10), path: "/data/x".into() },
            HostMessage::ListDir { id: RequestId(11), path: "/data".into(), depth: 2, max_entries: 100_000 },
            HostMessage::CreateDir { id: RequestId(12), path: "/data/a/b".into() },
            HostMessage::Rename { id: RequestId(13), from: "/data/x".into(), to: "/data/y".into() },
            HostMessage::Remove { id: RequestId(14), path: "/data/y".into() },
            HostMessage::Watch { id: RequestId(15), path: "/data".into(), recursive: true },
            HostMessage::Unwatch { id: RequestId(15) },
        ]
    }

    fn sample_guest_messages() -> Vec<GuestMessage> {
        vec![
            GuestMessage::Hello { version: 7, agent_version: "0.1.0".into(), kernel: "6.1.0".into() },
            GuestMessage::Started { id: RequestId(1), pid: 42 },
            GuestMessage::Output { id: RequestId(1), stream: OutputStream::Stderr, data: Bytes(b"oops\n".to_vec()) },
            GuestMessage::Exited {
                id: RequestId(1),
                status: ExitStatus::Signal(9),
                rusage: Rusage { user_us: 1, sys_us: 2, max_rss_kb: 3 },
                oom_killed: true,
                stdout_bytes: 0,
                stderr_bytes: 5,
            },
            GuestMessage::ExecFailed { id: RequestId(6), errno: 2, message: "nope: not found".into() },
            GuestMessage::FileData { id: RequestId(3), data: Bytes(vec![1; 70_000]) },
            GuestMessage::FileDone { id: RequestId(3), size: 70_000 },
            GuestMessage::FileError { id: RequestId(3), errno: 21, message: "is a directory".into() },
            GuestMessage::Ack { id: RequestId(4) },
            GuestMessage::Error { id: None, message: "bad".into() },
            GuestMessage::TreeEntries {
                id: RequestId(8),
                entries: vec![
                    TreeEntry { path: "sub".into(), kind: EntryKind::Dir, mode: 0o755, size: 0, target: None },
                    TreeEntry { path: "sub/f".into(), kind: EntryKind::File, mode: 0o644, size: 1 << 40, target: None },
                    TreeEntry {
                        path: "link".into(),
                        kind: EntryKind::Symlink,
                        mode: 0o777,
                        size: 4,
                        target: Some("../x".into()),
                    },
                ],
            },
            GuestMessage::TreeDone { id: RequestId(8), count: 3, skipped: 1 },
            GuestMessage::Entry { id: RequestId(10), entry: entry_info("/data/x") },
            GuestMessage::DirEntries {
                id: RequestId(11),
                entries: vec![
                    entry_info("/data/x"),
                    EntryInfo {
                        file_type: FileType::Symlink,
                        modified: None,
                        target: Some("../elsewhere".into()),
                        ..entry_info("/data/link")
                    },
                ],
            },
            GuestMessage::DirDone { id: RequestId(11), count: 2, skipped: 0 },
            GuestMessage::DirCreated { id: RequestId(12), created: true },
            GuestMessage::WatchEvents {
                id: RequestId(15),
                events: vec![
                    WatchEvent { kind: WatchKind::Create, path: "/data/new".into() },
                    WatchEvent { kind: WatchKind::Remove, path: "/data/new".into() },
                ],
                overflowed: true,
            },
            GuestMessage::WatchEnded { id: RequestId(15), reason: "the watched directory is gone".into() },
        ]
    }

    fn entry_info(path: &str) -> EntryInfo {
        EntryInfo {
            path: path.into(),
            file_type: FileType::File,
            size: 5,
            mode: 0o644,
            uid: 1000,
            gid: 1000,
            modified: Some((-1, 999_999_999)),
            target: None,
        }
    }

    fn frames<T: Serialize>(messages: &[T]) -> Vec<u8> {
        let mut writer = FrameWriter::new(Vec::new());
        for message in messages {
            writer.write(message).expect("write");
        }
        writer.inner
    }

    #[test]
    fn every_message_round_trips_through_frames() {
        let host = sample_host_messages();
        let bytes = frames(&host);
        let mut reader = FrameReader::new(bytes.as_slice());
        for expected in &host {
            assert_eq!(reader.read::<HostMessage>().expect("read").as_ref(), Some(expected));
        }
        assert_eq!(reader.read::<HostMessage>().expect("eof"), None);

        let guest = sample_guest_messages();
        let bytes = frames(&guest);
        let mut reader = FrameReader::new(bytes.as_slice());
        for expected in &guest {
            assert_eq!(reader.read::<GuestMessage>().expect("read").as_ref(), Some(expected));
        }
        assert_eq!(reader.read::<GuestMessage>().expect("eof"), None);
    }

    #[test]
    fn byte_strings_are_encoded_compactly() {
        let body = encode(&GuestMessage::FileData { id: RequestId(1), data: Bytes(vec![0xff; 65536]) }).expect("enc");
        assert!(body.len() < 65536 + 16, "{} bytes", body.len());
    }

    #[test]
    fn oversize_length_prefix_is_refused_before_reading_the_body() {
        let mut bytes = u32::MAX.to_le_bytes().to_vec();
        bytes.extend_from_slice(&[0; 16]);
        let mut reader = FrameReader::new(bytes.as_slice());
        let err = reader.read::<HostMessage>().expect_err("oversize");
        assert!(matches!(err, FrameError::TooLarge { len, .. } if len == u64::from(u32::MAX)), "{err}");
        assert!(reader.body.capacity() < 1024);

        let just_over = ((MAX_FRAME + 1) as u32).to_le_bytes();
        let err = FrameReader::new(&just_over[..]).read::<HostMessage>().expect_err("oversize");
        assert!(matches!(err, FrameError::TooLarge { .. }), "{err}");
    }

    #[test]
    fn truncated_header_and_body_are_typed() {
        let err = FrameReader::new(&[5u8, 0][..]).read::<HostMessage>().expect_err("short header");
        assert!(matches!(err, FrameError::Truncated { part: "header", expected: 4, got: 2 }), "{err}");

        let mut bytes = frames(&[HostMessage::Hello { version: 1 }]);
        bytes.pop();
        let err = FrameReader::new(bytes.as_slice()).read::<HostMessage>().expect_err("short body");
        assert!(matches!(err, FrameError::Truncated { part: "body", .. }), "{err}");
    }

    #[test]
    fn garbage_bodies_are_malformed() {
        for body in [
            &[][..],
            &[0xff, 0xff, 0xff, 0xff, 0xff][..],
            // Variant 200 does not exist.
            &[200][..],
            // A valid Hello followed by a stray byte.
            &[0, 1, 0][..],
            // Exec whose argv claims 2^60 entries.
            &[1, 1, 0xfd, 0, 0, 0, 0, 0, 0, 0, 0x10][..],
        ] {
            let mut writer = FrameWriter::new(Vec::new());
            writer.write_body(body).expect("write");
            let err = FrameReader::new(writer.inner.as_slice()).read::<HostMessage>().expect_err("garbage");
            assert!(matches!(err, FrameError::Malformed { .. }), "{body:?}: {err}");
        }
    }

    #[test]
    fn a_huge_length_inside_a_small_frame_allocates_nothing() {
        // Output { id: 1, stream: Stdout, data: <claims u64::MAX bytes> }
        let mut body = vec![2, 1, 0, 0xfd];
        body.extend_from_slice(&u64::MAX.to_le_bytes());
        let err = decode::<GuestMessage>(&body).expect_err("huge");
        assert!(matches!(err, FrameError::Malformed { .. }), "{err}");
        // A string (the agent version) claiming 1 TiB.
        let mut body = vec![0, 1, 0xfd];
        body.extend_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(matches!(decode::<GuestMessage>(&body), Err(FrameError::Malformed { .. })));
    }

    #[test]
    fn entropy_must_be_exactly_64_bytes() {
        let mut body = encode(&HostMessage::PrepareSnapshot { id: RequestId(1) }).expect("enc");
        // AfterRestore is variant 8: id, then a byte string of 63 bytes.
        body[0] = 8;
        body.push(63);
        body.extend_from_slice(&[1; 63]);
        body.push(0);
        assert!(matches!(decode::<HostMessage>(&body), Err(FrameError::Malformed { .. })));
    }

    #[test]
    fn a_full_batch_of_the_longest_entries_fits_in_a_frame() {
        let entry = TreeEntry {
            path: "p".repeat(crate::MAX_PATH),
            kind: EntryKind::Symlink,
            mode: u32::MAX,
            size: u64::MAX,
            target: Some("t".repeat(crate::MAX_PATH)),
        };
        let message =
            GuestMessage::TreeEntries { id: RequestId(u64::MAX), entries: vec![entry; crate::MAX_TREE_BATCH] };
        let body = encode(&message).expect("a full batch encodes");
        assert!(body.len() <= MAX_FRAME, "{} bytes", body.len());
    }

    #[test]
    fn full_batches_of_the_longest_entries_and_events_fit_in_a_frame() {
        let entry = EntryInfo {
            path: "p".repeat(crate::MAX_PATH),
            file_type: FileType::Symlink,
            size: u64::MAX,
            mode: u32::MAX,
            uid: u32::MAX,
            gid: u32::MAX,
            modified: Some((i64::MIN, u32::MAX)),
            target: Some("t".repeat(crate::MAX_PATH)),
        };
        let message = GuestMessage::DirEntries { id: RequestId(u64::MAX), entries: vec![entry; crate::MAX_TREE_BATCH] };
        assert!(encode(&message).expect("a full batch encodes").len() <= MAX_FRAME);
        let event = WatchEvent { kind: WatchKind::Rename, path: "p".repeat(crate::MAX_PATH) };
        let message = GuestMessage::WatchEvents {
            id: RequestId(u64::MAX),
            events: vec![event; crate::MAX_WATCH_BATCH],
            overflowed: true,
        };
        assert!(encode(&message).expect("a full batch encodes").len() <= MAX_FRAME);
    }

    #[test]
    fn the_new_messages_keep_the_old_ones_tags() {
        // Appended, never inserted: what an older peer sends still decodes to the same message.
        assert_eq!(
            encode(&HostMessage::StartEgress { id: RequestId(1), listen_port: 1, host_port: 1, max_connections: 1 })
                .expect("enc")[0],
            13
        );
        assert_eq!(encode(&HostMessage::Stat { id: RequestId(1), path: String::new() }).expect("enc")[0], 14);
        assert_eq!(encode(&GuestMessage::Error { id: None, message: String::new() }).expect("enc")[0], 11);
        assert_eq!(encode(&GuestMessage::Entry { id: RequestId(1), entry: entry_info("/x") }).expect("enc")[0], 12);
    }

    #[test]
    fn too_large_message_is_not_written() {
        let mut writer = FrameWriter::new(Vec::new());
        let message = GuestMessage::FileData { id: RequestId(1), data: Bytes(vec![0; MAX_FRAME]) };
        assert!(matches!(writer.write(&message), Err(FrameError::TooLarge { .. })));
        assert!(writer.inner.is_empty());
    }

    #[test]
    fn hello_version_is_readable_across_versions() {
        let body = encode(&HostMessage::Hello { version: 3 }).expect("enc");
        assert_eq!(peek_hello_version(&body), Some(3));
        // A future Hello with more fields still shows its version.
        let future = encode(&(0u32, 99u32, "extra", 5u64)).expect("enc");
        assert_eq!(peek_hello_version(&future), Some(99));
        assert!(decode::<GuestMessage>(&future).is_err());
        let not_hello = encode(&HostMessage::PowerOff).expect("enc");
        assert_eq!(peek_hello_version(&not_hello), None);
    }
}
