//! The one thread that stands between a running job and this process's terminal.
//!
//! While a job runs, [`Console`] writes the job's output to this process's stdout and stderr from a thread of its
//! own, so a slow or closed terminal or pipe never blocks the guest (only the captured, capped bytes pass through,
//! so the queue is bounded by the output limit), and takes `SIGINT`, `SIGTERM`, `SIGHUP` and `SIGQUIT`: each
//! cancels the job, which then ends as a cancelled job does (its jail torn down, its scratch directory removed),
//! and this process ends by that signal afterwards ([`Console::finish`]), as it would have at once without this.
//! The signals are blocked in the calling thread before any other thread starts (so every thread has them
//! blocked) and read from a signalfd.
//!
//! One thread does both, and it is joined when the job has ended: a thread still blocked when the process exits,
//! or one more to join, is one more wake-up of another thread (often on the other CPU) before this process can
//! end, a fraction of a millisecond each on a short job.

use std::collections::VecDeque;
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use strata_core::{CancelToken, OutputSink, Stream};

use crate::Failure;

/// The console thread of one job: see the module documentation.
pub(crate) struct Console {
    token: CancelToken,
    caught: Arc<AtomicI32>,
    output: Arc<ConsoleOutput>,
    thread: Option<JoinHandle<()>>,
}

/// The job's output on its way to the console thread.
pub(crate) struct ConsoleOutput {
    queue: Mutex<Queue>,
    /// The write end of the pipe that wakes the console thread (non-blocking).
    wake: OwnedFd,
}

#[derive(Default)]
struct Queue {
    chunks: VecDeque<(Stream, Vec<u8>)>,
    /// The job has ended: the thread writes what is queued and ends.
    ended: bool,
}

impl ConsoleOutput {
    fn wake(&self) {
        // A full pipe (EAGAIN) has a wake-up in it already.
        let _ = nix::unistd::write(&self.wake, &[1]);
    }
}

impl OutputSink for ConsoleOutput {
    fn output(&self, stream: Stream, chunk: &[u8]) {
        let first = {
            let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
            queue.chunks.push_back((stream, chunk.to_vec()));
            queue.chunks.len() == 1
        };
        // The thread takes the whole queue when it wakes: only the first chunk of a batch needs to wake it.
        if first {
            self.wake();
        }
    }
}

impl Console {
    /// Blocks the interrupt signals in the calling thread (call it before any other thread starts) and starts the
    /// console thread.
    pub(crate) fn start() -> Result<Console, Failure> {
        let internal = |what: &str, err: Errno| Failure::new("internal", format!("{what}: {err}"));
        let signals = interrupts();
        signals.thread_block().map_err(|e| internal("cannot block signals", e))?;
        let signal_fd = SignalFd::with_flags(&signals, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
            .map_err(|e| internal("cannot read signals", e))?;
        let (wake_r, wake_w) = nix::unistd::pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK)
            .map_err(|e| internal("cannot make the console's pipe", e))?;
        let token = CancelToken::new();
        let caught = Arc::new(AtomicI32::new(0));
        let output = Arc::new(ConsoleOutput { queue: Mutex::default(), wake: wake_w });
        let thread = {
            let (token, caught, output) = (token.clone(), caught.clone(), output.clone());
            std::thread::Builder::new()
                .name("strata-console".into())
                .spawn(move || serve(&signal_fd, &wake_r, &output, &token, &caught))
                .map_err(|e| Failure::new("internal", format!("cannot start the console thread: {e}")))?
        };
        Ok(Console { token, caught, output, thread: Some(thread) })
    }

    /// The token the job is cancelled with.
    pub(crate) fn token(&self) -> CancelToken {
        self.token.clone()
    }

    /// Where the job's output goes to be written to this process's stdout and stderr.
    pub(crate) fn sink(&self) -> Arc<ConsoleOutput> {
        self.output.clone()
    }

    /// After the job: writes what output is still queued and ends the thread; then, if a signal cancelled the job,
    /// ends this process by that signal (where that signal is ignored, as a process started in the background of
    /// a non-interactive shell ignores `SIGINT`, with 128 + its number, as a shell reports a process a signal
    /// ended). `before_exit` runs first either way (restoring the terminal).
    pub(crate) fn finish(mut self, before_exit: impl FnOnce()) {
        self.output.queue.lock().unwrap_or_else(PoisonError::into_inner).ended = true;
        self.output.wake();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        before_exit();
        let caught = self.caught.load(Ordering::SeqCst);
        if let Ok(signal) = Signal::try_from(caught) {
            let _ = std::io::stdout().flush();
            let mut set = SigSet::empty();
            set.add(signal);
            let _ = set.thread_unblock();
            let _ = nix::sys::signal::raise(signal);
            std::process::exit(128 + caught);
        }
    }
}

/// The signals that cancel the job.
fn interrupts() -> SigSet {
    let mut set = SigSet::empty();
    for signal in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP, Signal::SIGQUIT] {
        set.add(signal);
    }
    set
}

/// The console thread: signals cancel the job; queued output is written; it ends once the job has and the queue
/// is written.
fn serve(signals: &SignalFd, wake: &OwnedFd, output: &ConsoleOutput, token: &CancelToken, caught: &AtomicI32) {
    let (mut out, mut err) = (std::io::stdout(), std::io::stderr());
    let (mut out_ok, mut err_ok) = (true, true);
    loop {
        let mut fds = [PollFd::new(signals.as_fd(), PollFlags::POLLIN), PollFd::new(wake.as_fd(), PollFlags::POLLIN)];
        if let Err(errno) = poll(&mut fds, PollTimeout::NONE)
            && errno != Errno::EINTR
        {
            // Out of memory for a moment, at worst (the descriptors are valid): look again shortly rather than
            // leave the job's output unwritten.
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        while let Ok(Some(info)) = signals.read_signal() {
            caught.store(info.ssi_signo as i32, Ordering::SeqCst);
            token.cancel();
        }
        let mut drained = [0u8; 64];
        while matches!(nix::unistd::read(wake, &mut drained), Ok(n) if n > 0) {}
        let (chunks, ended) = {
            let mut queue = output.queue.lock().unwrap_or_else(PoisonError::into_inner);
            (std::mem::take(&mut queue.chunks), queue.ended)
        };
        for (stream, chunk) in chunks {
            // A reader that went away (EPIPE) stops that stream only; the guest is unaffected.
            match stream {
                Stream::Stdout if out_ok => out_ok = out.write_all(&chunk).and_then(|()| out.flush()).is_ok(),
                Stream::Stderr if err_ok => err_ok = err.write_all(&chunk).is_ok(),
                _ => {}
            }
        }
        if ended {
            return;
        }
    }
}
