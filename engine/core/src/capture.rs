//! Guest stdout/stderr captured in memory with a per-stream cap, the one capture every tier uses.
//!
//! A write always succeeds at once: the guest is never blocked by a slow reader nor failed by a full buffer.
//! Bytes up to the cap are kept (secrets redacted) and forwarded to the optional [`OutputSink`]; bytes beyond
//! it are counted and dropped, and the capture records that it was truncated.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::redact::{Redactor, Secret};
use crate::tier::{OutputSink, Stream};

/// One captured stream. Clones share the same buffer, as the WASI stream handles of one stdout must.
#[derive(Clone)]
pub struct OutputCapture {
    state: Arc<Mutex<CaptureState>>,
}

struct CaptureState {
    stream: Stream,
    cap: usize,
    kept: Vec<u8>,
    written: u64,
    truncated: bool,
    redactor: Redactor,
    sink: Option<Arc<dyn OutputSink>>,
}

/// What a capture holds once the guest is done.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Captured {
    /// The kept bytes (at most the cap, secrets redacted).
    pub bytes: Vec<u8>,
    /// Every byte the guest wrote, kept or not.
    pub written: u64,
    /// Whether bytes were dropped at the cap.
    pub truncated: bool,
}

impl std::fmt::Debug for OutputCapture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.lock();
        f.debug_struct("OutputCapture")
            .field("stream", &state.stream)
            .field("cap", &state.cap)
            .field("kept", &state.kept.len())
            .field("written", &state.written)
            .finish()
    }
}

impl OutputCapture {
    /// A capture of `stream` that keeps at most `cap` bytes, redacting `secrets`, forwarding kept bytes to `sink`.
    pub fn new(stream: Stream, cap: u64, secrets: Vec<Secret>, sink: Option<Arc<dyn OutputSink>>) -> Self {
        let cap = usize::try_from(cap).unwrap_or(usize::MAX);
        OutputCapture {
            state: Arc::new(Mutex::new(CaptureState {
                stream,
                cap,
                kept: Vec::new(),
                written: 0,
                truncated: false,
                redactor: Redactor::new(secrets),
                sink,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, CaptureState> {
        // A panic while holding the lock cannot leave the state inconsistent beyond a partial append, which
        // is still valid captured output.
        crate::sync::lock(&self.state)
    }

    /// Records a guest write.
    pub fn write(&self, bytes: &[u8]) {
        self.lock().write(bytes);
    }

    /// Starts a fresh capture on the same stream (a new turn of a session): the kept bytes, counts and
    /// truncation are cleared, and output goes to `sink` under a cap of `cap` bytes from now on.
    pub fn restart(&self, cap: u64, sink: Option<Arc<dyn OutputSink>>) {
        let mut state = self.lock();
        state.cap = usize::try_from(cap).unwrap_or(usize::MAX);
        state.kept = Vec::new();
        state.written = 0;
        state.truncated = false;
        state.redactor.finish();
        state.sink = sink;
    }

    /// Flushes what the redactor held back and returns the capture. Further writes are still counted.
    pub fn finish(&self) -> Captured {
        let mut state = self.lock();
        let tail = state.redactor.finish();
        state.keep(&tail);
        Captured { bytes: state.kept.clone(), written: state.written, truncated: state.truncated }
    }
}

impl CaptureState {
    fn write(&mut self, bytes: &[u8]) {
        self.written = self.written.saturating_add(bytes.len() as u64);
        if self.truncated {
            return;
        }
        if self.redactor.is_empty() {
            self.keep(bytes);
        } else {
            let safe = self.redactor.push(bytes);
            self.keep(&safe);
        }
    }

    fn keep(&mut self, bytes: &[u8]) {
        if let Some(sink) = self.sink.as_ref().filter(|sink| sink.takes_all()) {
            if !bytes.is_empty() {
                sink.output(self.stream, bytes);
            }
            return;
        }
        let room = self.cap.saturating_sub(self.kept.len());
        let kept = &bytes[..bytes.len().min(room)];
        if kept.len() < bytes.len() {
            self.truncated = true;
        }
        if kept.is_empty() {
            return;
        }
        self.kept.extend_from_slice(kept);
        if let Some(sink) = &self.sink {
            sink.output(self.stream, kept);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Collect(Mutex<Vec<u8>>);

    impl OutputSink for Collect {
        fn output(&self, _stream: Stream, chunk: &[u8]) {
            self.0.lock().expect("lock").extend_from_slice(chunk);
        }
    }

    #[test]
    fn output_beyond_the_cap_is_counted_and_dropped() {
        let capture = OutputCapture::new(Stream::Stdout, 5, Vec::new(), None);
        capture.write(b"hel");
        capture.write(b"lo world");
        capture.write(b"!");
        let captured = capture.finish();
        assert_eq!(captured, Captured { bytes: b"hello".to_vec(), written: 12, truncated: true });
    }

    #[test]
    fn output_at_exactly_the_cap_is_not_truncated() {
        let capture = OutputCapture::new(Stream::Stdout, 5, Vec::new(), None);
        capture.write(b"hello");
        assert!(!capture.finish().truncated);
    }

    #[test]
    fn a_restarted_capture_starts_empty_with_its_new_cap() {
        let capture = OutputCapture::new(Stream::Stdout, 4, Vec::new(), None);
        capture.write(b"first turn");
        assert!(capture.finish().truncated);
        capture.restart(64, None);
        capture.write(b"second");
        assert_eq!(capture.finish(), Captured { bytes: b"second".to_vec(), written: 6, truncated: false });
    }

    struct TakesAll(Collect);

    impl OutputSink for TakesAll {
        fn output(&self, stream: Stream, chunk: &[u8]) {
            self.0.output(stream, chunk);
        }

        fn takes_all(&self) -> bool {
            true
        }
    }

    #[test]
    fn a_sink_that_takes_all_gets_every_byte_and_nothing_is_kept() {
        let sink = Arc::new(TakesAll(Collect::default()));
        let capture = OutputCapture::new(Stream::Stdout, 4, Vec::new(), Some(sink.clone()));
        capture.write(b"beyond ");
        capture.write(b"the cap");
        assert_eq!(capture.finish(), Captured { bytes: Vec::new(), written: 14, truncated: false });
        assert_eq!(*sink.0.0.lock().expect("lock"), b"beyond the cap");
    }

    #[test]
    fn sink_sees_the_redacted_capped_bytes() {
        let sink = Arc::new(Collect::default());
        let capture = OutputCapture::new(
            Stream::Stderr,
            64,
            vec![Secret { name: "KEY".into(), value: b"s3cret".to_vec() }],
            Some(sink.clone()),
        );
        capture.write(b"key=s3c");
        capture.write(b"ret end");
        let captured = capture.finish();
        assert_eq!(captured.bytes, b"key=[REDACTED:KEY] end");
        assert_eq!(*sink.0.lock().expect("lock"), captured.bytes);
        assert_eq!(captured.written, 14);
    }
}
