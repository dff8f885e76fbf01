//! What a wasm attempt holds back until it is known to be the result: its streamed output ([`HeldOutput`]) and the stdin it read ([`StdinTee`]), replayed to a native rerun.

use std::io;
use std::io::PipeWriter;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use strata_core::sync::lock;
use strata_core::{OutputSink, StdinStream, Stream};
/// An [`OutputSink`] that keeps what it is given until [`release`](HeldOutput::release) passes it on (or it is
/// dropped, discarding it). It holds only what the outcome captures, so the output limit bounds it.
#[derive(Default)]
pub struct HeldOutput {
    chunks: Mutex<Vec<(Stream, Vec<u8>)>>,
}

impl HeldOutput {
    /// Passes everything held to `sink`, in order.
    pub fn release(&self, sink: &dyn OutputSink) {
        let chunks = match self.chunks.lock() {
            Ok(mut chunks) => std::mem::take(&mut *chunks),
            Err(poisoned) => std::mem::take(&mut *poisoned.into_inner()),
        };
        for (stream, chunk) in chunks {
            sink.output(stream, &chunk);
        }
    }
}

impl std::fmt::Debug for HeldOutput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held = self.chunks.lock().map_or(0, |chunks| chunks.len());
        f.debug_struct("HeldOutput").field("chunks", &held).finish()
    }
}

impl OutputSink for HeldOutput {
    fn output(&self, stream: Stream, chunk: &[u8]) {
        let mut chunks = match self.chunks.lock() {
            Ok(chunks) => chunks,
            Err(poisoned) => poisoned.into_inner(),
        };
        chunks.push((stream, chunk.to_vec()));
    }
}

/// The most stdin a wasm attempt may take from a stream and still escalate (the native rerun replays it).
pub const MAX_TEED_STDIN: usize = strata_core::MAX_BUFFERED_STDIN;

/// How long a tee's thread waits on a descriptor before it looks whether it was stopped.
const TEE_POLL: Duration = Duration::from_millis(50);

/// The most a tee reads or writes at once: one pipe buffer page, which a pipe with room takes without blocking.
const TEE_CHUNK: usize = 4096;

/// stdin shared by an escalating job's two runs (see the module docs): the wasm attempt's side of the caller's
/// stream and the record of what it took.
pub struct StdinTee {
    original: StdinStream,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    recording: Arc<Mutex<Recording>>,
}

/// What a tee took from the caller's stream.
#[derive(Debug, Default)]
struct Recording {
    bytes: Vec<u8>,
    /// More than the cap was taken; `bytes` holds only the first part.
    over_cap: bool,
    /// The stream ended (its writer closed it, or reading failed).
    ended: bool,
}

/// Feeds a native rerun its stdin; stops doing so when dropped.
#[derive(Debug)]
pub struct StdinReplay {
    stop: Arc<AtomicBool>,
}

impl Drop for StdinReplay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl std::fmt::Debug for StdinTee {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StdinTee").finish_non_exhaustive()
    }
}

impl StdinTee {
    /// Tees `original` into the stream the wasm attempt reads (returned beside the tee), recording at most `cap`
    /// bytes. A thread of its own copies the bytes as they arrive.
    pub fn start(original: StdinStream, cap: usize) -> io::Result<(StdinTee, StdinStream)> {
        let (attempt, writer) = StdinStream::pipe()?;
        let stop = Arc::new(AtomicBool::new(false));
        let recording = Arc::new(Mutex::new(Recording::default()));
        let thread = {
            let (original, stop, recording) = (original.clone(), stop.clone(), recording.clone());
            std::thread::Builder::new().name("strata-stdin-tee".into()).spawn(move || {
                // Dropped when the thread ends: the attempt's end of input.
                let to_attempt = writer;
                copy_live(&original, &stop, |chunk| {
                    let Some(bytes) = chunk else {
                        lock(&recording).ended = true;
                        return false;
                    };
                    {
                        let mut record = lock(&recording);
                        if !record.over_cap && record.bytes.len().saturating_add(bytes.len()) <= cap {
                            record.bytes.extend_from_slice(bytes);
                        } else {
                            record.over_cap = true;
                        }
                    }
                    // Taken from the stream and recorded: the rerun replays it even if the attempt is gone.
                    write_all_until(&to_attempt, bytes, &stop)
                });
            })?
        };
        Ok((StdinTee { original, stop, thread: Some(thread), recording }, attempt))
    }

    /// Stops teeing once the wasm attempt is over and returns the rerun's stdin: what the attempt took, then the
    /// rest of the caller's stream as it arrives, fed by a thread of its own until the [`StdinReplay`] is dropped.
    /// `None` when the attempt took more than the cap.
    pub fn rerun(mut self) -> io::Result<Option<(StdinStream, StdinReplay)>> {
        self.halt();
        let recording = std::mem::take(&mut *lock(&self.recording));
        if recording.over_cap {
            return Ok(None);
        }
        let (rerun, writer) = StdinStream::pipe()?;
        let stop = Arc::new(AtomicBool::new(false));
        let (original, feeding) = (self.original.clone(), stop.clone());
        std::thread::Builder::new().name("strata-stdin-tee".into()).spawn(move || {
            if !write_all_until(&writer, &recording.bytes, &feeding) || recording.ended {
                return;
            }
            copy_live(&original, &feeding, |chunk| match chunk {
                Some(bytes) => write_all_until(&writer, bytes, &feeding),
                None => false,
            });
        })?;
        Ok(Some((rerun, StdinReplay { stop })))
    }

    /// Stops the tee's thread and waits for it, so every byte it took from the stream is in the recording.
    fn halt(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for StdinTee {
    fn drop(&mut self) {
        // Without waiting: the thread sees the flag within one poll interval.
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Reads `from` as its bytes arrive and hands each chunk to `to` (`None` at its end, or when reading fails), until
/// `to` returns false, the end, or `stop` is set (looked at every [`TEE_POLL`]).
fn copy_live(from: &StdinStream, stop: &AtomicBool, mut to: impl FnMut(Option<&[u8]>) -> bool) {
    let mut buf = [0u8; TEE_CHUNK];
    while !stop.load(Ordering::Relaxed) {
        match wait_for(from.as_fd(), PollFlags::POLLIN) {
            Ok(false) => continue,
            Ok(true) => {}
            Err(_) => {
                to(None);
                return;
            }
        }
        match nix::unistd::read(from.as_fd(), &mut buf) {
            Ok(0) => {
                to(None);
                return;
            }
            Ok(n) => {
                if !to(Some(&buf[..n.min(buf.len())])) {
                    return;
                }
            }
            Err(Errno::EINTR | Errno::EAGAIN) => {}
            Err(_) => {
                to(None);
                return;
            }
        }
    }
}

/// Writes all of `bytes` into a pipe, never blocking for longer than [`TEE_POLL`] without looking at `stop`;
/// false when stopped or when the pipe's reader is gone.
fn write_all_until(to: &PipeWriter, mut bytes: &[u8], stop: &AtomicBool) -> bool {
    while !bytes.is_empty() {
        if stop.load(Ordering::Relaxed) {
            return false;
        }
        match wait_for(to.as_fd(), PollFlags::POLLOUT) {
            Ok(false) => continue,
            Ok(true) => {}
            Err(_) => return false,
        }
        let chunk = &bytes[..bytes.len().min(TEE_CHUNK)];
        match nix::unistd::write(to, chunk) {
            Ok(n) => bytes = &bytes[n.min(bytes.len())..],
            Err(Errno::EINTR | Errno::EAGAIN) => {}
            // EPIPE: the reader is gone (SIGPIPE is ignored in Rust programs).
            Err(_) => return false,
        }
    }
    true
}

/// Waits up to [`TEE_POLL`] for `events` on `fd`: `Ok(true)` when they came (or the other end hung up, or an
/// error is pending: the next read or write says which), `Ok(false)` when the time passed.
fn wait_for(fd: std::os::fd::BorrowedFd<'_>, events: PollFlags) -> io::Result<bool> {
    let mut fds = [PollFd::new(fd, events)];
    let timeout = PollTimeout::try_from(TEE_POLL).unwrap_or(PollTimeout::MAX);
    match poll(&mut fds, timeout) {
        Ok(0) | Err(Errno::EINTR) => Ok(false),
        Ok(_) => {
            let revents = fds[0].revents().unwrap_or(PollFlags::empty());
            if revents.contains(PollFlags::POLLNVAL) {
                return Err(io::Error::from_raw_os_error(nix::libc::EBADF));
            }
            Ok(true)
        }
        Err(err) => Err(err.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_output_passes_on_only_when_released() {
        #[derive(Default)]
        struct Collect(Mutex<Vec<u8>>);
        impl OutputSink for Collect {
            fn output(&self, _: Stream, chunk: &[u8]) {
                self.0.lock().expect("lock").extend_from_slice(chunk);
            }
        }
        let held = HeldOutput::default();
        held.output(Stream::Stdout, b"a");
        held.output(Stream::Stderr, b"b");
        let sink = Collect::default();
        assert!(sink.0.lock().expect("lock").is_empty());
        held.release(&sink);
        assert_eq!(*sink.0.lock().expect("lock"), b"ab");
    }
}
