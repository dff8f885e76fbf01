//! `strata run --tty` (`-t`): the job on a pseudo-terminal, driven from this process's own terminal as
//! `docker run -it` does. The host terminal goes into raw mode for the job's life (every key, Ctrl-C included,
//! goes to the job as a byte; its own line discipline echoes and edits), its window size is the job's, and each
//! `SIGWINCH` resizes the job's terminal. Raw mode is undone however the job ends.

use std::io::IsTerminal;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use nix::sys::signal::{SigSet, Signal};
use nix::sys::termios::{self, SetArg, Termios};
use strata_core::{Terminal, WindowSize};

use crate::Failure;

/// This process's terminal in raw mode while it lives; dropping it puts the terminal back as it was.
pub(crate) struct RawTerminal {
    saved: Termios,
    resizes: Option<std::thread::JoinHandle<()>>,
    done: Arc<AtomicBool>,
}

/// Blocks `SIGWINCH` in the calling thread (and the threads it starts afterwards), so that [`RawTerminal`]'s
/// thread takes it with `sigwait`. Called first thing in `main`, before any other thread starts: a window
/// change delivered to a thread that does not block it would be lost (its default action is to ignore it).
pub(crate) fn block_resizes() {
    let _ = SigSet::from(Signal::SIGWINCH).thread_block();
}

fn stdin() -> std::io::Stdin {
    std::io::stdin()
}

fn window_size() -> WindowSize {
    match strata_jail::tty::size(&std::io::stdout().as_fd()) {
        Ok(size) if size.rows > 0 && size.cols > 0 => WindowSize { rows: size.rows, cols: size.cols },
        _ => WindowSize::default(),
    }
}

impl RawTerminal {
    /// The job's terminal, of this terminal's size, and this terminal in raw mode with its window changes
    /// forwarded to the job's. Refused unless stdin and stdout are both terminals.
    pub(crate) fn enter() -> Result<(RawTerminal, Terminal), Failure> {
        if !std::io::stdin().is_terminal() || !std::io::stdout().is_terminal() {
            return Err(Failure::new(
                "usage",
                "--tty needs a terminal: stdin and stdout are not both one (run it from a terminal, or without -t)",
            ));
        }
        let saved = termios::tcgetattr(stdin())
            .map_err(|e| Failure::new("internal", format!("cannot read the terminal's settings: {e}")))?;
        let mut raw = saved.clone();
        termios::cfmakeraw(&mut raw);
        termios::tcsetattr(stdin(), SetArg::TCSANOW, &raw)
            .map_err(|e| Failure::new("internal", format!("cannot put the terminal in raw mode: {e}")))?;
        let terminal = Terminal::new(window_size());
        let done = Arc::new(AtomicBool::new(false));
        let (follow, stop) = (terminal.clone(), done.clone());
        let resizes = std::thread::Builder::new()
            .name("strata-winch".into())
            .spawn(move || {
                let winch = SigSet::from(Signal::SIGWINCH);
                while winch.wait().is_ok() && !stop.load(Ordering::SeqCst) {
                    follow.resize(window_size());
                }
            })
            .ok();
        Ok((RawTerminal { saved, resizes, done }, terminal))
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        let _ = termios::tcsetattr(stdin(), SetArg::TCSADRAIN, &self.saved);
        self.done.store(true, Ordering::SeqCst);
        if let Some(thread) = self.resizes.take() {
            // Wakes the thread's `sigwait`: SIGWINCH is blocked in every thread, so it is the one that takes it.
            let _ = nix::sys::signal::kill(nix::unistd::getpid(), Signal::SIGWINCH);
            let _ = thread.join();
        }
    }
}
