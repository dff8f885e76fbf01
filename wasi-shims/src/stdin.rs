//! A guest's stdin fed from a [`StdinStream`] as its bytes arrive, for preview1 modules and components alike; or
//! from bytes, and switched from one input to another between a session's turns ([`StreamedStdin::switch`]).
//!
//! The stream is read by a [`StdinStream::pump`] thread, started by the guest's first read or poll of stdin (a job
//! that never reads stdin leaves the stream untouched), into a channel of one chunk: the pump reads ahead by at
//! most two chunks of [`CHUNK`] bytes, and waits while the guest does not read. The guest's side is asynchronous
//! throughout: a read with nothing there yet waits on the channel inside the job's executor, where the job's wall
//! limit and cancel stop it like any other wait, and a poll (`poll_oneoff` with an fd subscription, a
//! `wasi:io/poll` pollable) is ready when bytes or the end are. End of input is the writer closing the stream.
//! When the guest's context goes (its job ended), the pump is stopped and its thread ends, whether or not the
//! writer still holds the stream open.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use bytes::Bytes;
use strata_core::{PumpStop, Pumped, StdinStream};
use tokio::io::{AsyncRead, ReadBuf};
use tokio::sync::mpsc;
use wasmtime_wasi::cli::{IsTerminal, StdinStream as WasiStdin};
use wasmtime_wasi::p2::{InputStream, Pollable, StreamError};

/// The most the pump reads at once.
pub const CHUNK: usize = 64 * 1024;

/// A guest's stdin reading a [`StdinStream`]. Clones (and the handles WASI makes of it) share one position in
/// the stream, as WASI requires of stdin.
#[derive(Clone)]
pub struct StreamedStdin {
    inbox: Arc<Mutex<Inbox>>,
}

impl std::fmt::Debug for StreamedStdin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamedStdin").finish_non_exhaustive()
    }
}

/// A stdin switched to another input for now ([`StreamedStdin::switch_for_now`]); dropping it switches back (and
/// stops reading the other input, if a stream).
pub struct SwitchedFor {
    stdin: StreamedStdin,
    saved: Option<Inbox>,
}

impl std::fmt::Debug for SwitchedFor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SwitchedFor").finish_non_exhaustive()
    }
}

impl Drop for SwitchedFor {
    fn drop(&mut self) {
        if let Some(saved) = self.saved.take() {
            *self.stdin.lock() = saved;
        }
    }
}

/// How the stream ended.
enum End {
    Closed,
    Failed(String),
}

/// What a guest's stdin reads next.
#[derive(Debug, Clone)]
pub enum StdinSource {
    /// These bytes, then the end.
    Bytes(Bytes),
    /// A stream, as it arrives.
    Stream(StdinStream),
}

enum Source {
    /// Not read yet: the pump starts on the guest's first read or poll.
    Idle(StdinStream),
    /// Being pumped.
    Pumping { chunks: mpsc::Receiver<Result<Bytes, String>>, _stop: PumpStop },
    /// Nothing more comes.
    Done,
}

struct Inbox {
    source: Source,
    /// Bytes received and not yet read by the guest.
    pending: Bytes,
    end: Option<End>,
}

impl StreamedStdin {
    /// A guest stdin reading `stream`.
    pub fn new(stream: StdinStream) -> StreamedStdin {
        StreamedStdin::of(StdinSource::Stream(stream))
    }

    /// A guest stdin reading `source`.
    pub fn of(source: StdinSource) -> StreamedStdin {
        StreamedStdin { inbox: Arc::new(Mutex::new(Inbox::of(source))) }
    }

    /// Reads `source` from now on, in place of what was left (a stream left is no longer read: its pump stops).
    pub fn switch(&self, source: StdinSource) {
        *self.lock() = Inbox::of(source);
    }

    /// Reads `source` until the returned guard is dropped, then what was left before, from where it was.
    pub fn switch_for_now(&self, source: StdinSource) -> SwitchedFor {
        let saved = std::mem::replace(&mut *self.lock(), Inbox::of(source));
        SwitchedFor { stdin: self.clone(), saved: Some(saved) }
    }

    fn lock(&self) -> MutexGuard<'_, Inbox> {
        // The inbox is a few fields replaced whole; a poisoned lock still holds a consistent value.
        self.inbox.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Inbox {
    fn of(source: StdinSource) -> Inbox {
        match source {
            StdinSource::Stream(stream) => Inbox { source: Source::Idle(stream), pending: Bytes::new(), end: None },
            StdinSource::Bytes(bytes) => Inbox { source: Source::Done, pending: bytes, end: Some(End::Closed) },
        }
    }

    /// Starts the pump if it has not started yet.
    fn start(&mut self) {
        let Source::Idle(stream) = &self.source else { return };
        let (tx, chunks) = mpsc::channel(1);
        let started = stream.pump(CHUNK, move |pumped| match pumped {
            // The pump's own thread is outside any runtime, where a blocking send is allowed; it returns (false)
            // as soon as the guest's side is dropped.
            Pumped::Data(data) => tx.blocking_send(Ok(Bytes::copy_from_slice(data))).is_ok(),
            Pumped::End => false,
            Pumped::Failed(err) => {
                let _ = tx.blocking_send(Err(err.to_string()));
                false
            }
        });
        self.source = match started {
            Ok(stop) => Source::Pumping { chunks, _stop: stop },
            Err(err) => {
                self.end = Some(End::Failed(format!("cannot start reading stdin: {err}")));
                Source::Done
            }
        };
    }

    /// Whether a read would return something (bytes, or the end), registering `cx` for a wake-up when not.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        self.start();
        if !self.pending.is_empty() || self.end.is_some() {
            return Poll::Ready(());
        }
        let Source::Pumping { chunks, .. } = &mut self.source else {
            self.end.get_or_insert(End::Closed);
            return Poll::Ready(());
        };
        match chunks.poll_recv(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(received) => {
                self.receive(received);
                Poll::Ready(())
            }
        }
    }

    /// Takes what the channel holds now, without waiting.
    fn try_receive(&mut self) {
        self.start();
        if !self.pending.is_empty() || self.end.is_some() {
            return;
        }
        if let Source::Pumping { chunks, .. } = &mut self.source {
            match chunks.try_recv() {
                Ok(chunk) => self.receive(Some(chunk)),
                Err(mpsc::error::TryRecvError::Empty) => {}
                Err(mpsc::error::TryRecvError::Disconnected) => self.receive(None),
            }
        }
    }

    fn receive(&mut self, received: Option<Result<Bytes, String>>) {
        match received {
            Some(Ok(bytes)) => self.pending = bytes,
            Some(Err(message)) => self.finish(End::Failed(message)),
            None => self.finish(End::Closed),
        }
    }

    fn finish(&mut self, end: End) {
        self.end = Some(end);
        // Stops the pump (if it still runs) and drops the channel.
        self.source = Source::Done;
    }

    /// Up to `size` bytes of what has arrived; empty when nothing has yet.
    fn take(&mut self, size: usize) -> Result<Bytes, StreamError> {
        self.try_receive();
        if !self.pending.is_empty() {
            let n = size.min(self.pending.len());
            return Ok(self.pending.split_to(n));
        }
        match &self.end {
            None => Ok(Bytes::new()),
            Some(End::Closed) => Err(StreamError::Closed),
            Some(End::Failed(message)) => {
                Err(StreamError::LastOperationFailed(wasmtime::format_err!("reading stdin failed: {message}")))
            }
        }
    }
}

impl IsTerminal for StreamedStdin {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl WasiStdin for StreamedStdin {
    fn p2_stream(&self) -> Box<dyn InputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn AsyncRead + Send + Sync> {
        Box::new(self.clone())
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for StreamedStdin {
    async fn ready(&mut self) {
        std::future::poll_fn(|cx| self.lock().poll_ready(cx)).await
    }
}

impl InputStream for StreamedStdin {
    fn read(&mut self, size: usize) -> Result<Bytes, StreamError> {
        self.lock().take(size)
    }
}

impl AsyncRead for StreamedStdin {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let mut inbox = self.lock();
        if inbox.poll_ready(cx).is_pending() {
            return Poll::Pending;
        }
        match inbox.take(buf.remaining()) {
            Ok(bytes) => {
                buf.put_slice(&bytes);
                Poll::Ready(Ok(()))
            }
            Err(StreamError::Closed) => Poll::Ready(Ok(())),
            Err(err) => Poll::Ready(Err(io::Error::other(err.to_string()))),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
    }

    #[test]
    fn the_guest_reads_each_write_as_it_comes_then_the_end() {
        let (stream, mut writer) = StdinStream::pipe().expect("pipe");
        let mut stdin = StreamedStdin::new(stream).p2_stream();
        assert!(stdin.read(16).expect("read").is_empty(), "nothing yet: a read does not wait");
        runtime().block_on(async {
            writer.write_all(b"one").expect("write");
            assert_eq!(&stdin.blocking_read(16).await.expect("read")[..], b"one");
            writer.write_all(b"two").expect("write");
            assert_eq!(&stdin.blocking_read(2).await.expect("read")[..], b"tw");
            assert_eq!(&stdin.blocking_read(16).await.expect("read")[..], b"o");
            drop(writer);
            assert!(matches!(stdin.blocking_read(16).await, Err(StreamError::Closed)));
        });
    }

    #[test]
    fn a_wait_for_stdin_gives_way_to_a_timeout_while_the_writer_holds_it_open() {
        let (stream, _writer) = StdinStream::pipe().expect("pipe");
        let mut stdin = StreamedStdin::new(stream).p2_stream();
        let waited = runtime().block_on(async {
            tokio::time::timeout(std::time::Duration::from_millis(50), stdin.blocking_read(16)).await
        });
        assert!(waited.is_err(), "the read waited, and the timeout ended the wait");
    }

    #[test]
    fn a_switched_stdin_reads_its_new_source() {
        let (stream, _writer) = StdinStream::pipe().expect("pipe");
        let stdin = StreamedStdin::of(StdinSource::Bytes(Bytes::from_static(b"first")));
        let mut handle = stdin.p2_stream();
        assert_eq!(&handle.read(2).expect("read")[..], b"fi");
        stdin.switch(StdinSource::Stream(stream));
        assert!(handle.read(16).expect("read").is_empty(), "the stream has nothing yet; the old bytes are gone");
        stdin.switch(StdinSource::Bytes(Bytes::new()));
        assert!(matches!(handle.read(16), Err(StreamError::Closed)));
        stdin.switch(StdinSource::Bytes(Bytes::from_static(b"kept")));
        let turn = stdin.switch_for_now(StdinSource::Bytes(Bytes::from_static(b"turn")));
        assert_eq!(&handle.read(16).expect("read")[..], b"turn");
        drop(turn);
        assert_eq!(&handle.read(16).expect("read")[..], b"kept", "back where it was");
    }

    #[test]
    fn a_stdin_never_read_leaves_the_stream_untouched() {
        let (stream, mut writer) = StdinStream::pipe().expect("pipe");
        writer.write_all(b"left").expect("write");
        drop(writer);
        drop(StreamedStdin::new(stream.clone()));
        assert_eq!(stream.read_to_end(16).expect("read"), b"left");
    }
}
