//! A pseudo-terminal for a job ([`crate::ExecOptions::terminal`]): the job's standard streams are one terminal,
//! as in `docker run -t` or `ssh -t`. Its output arrives as [`crate::Stream::Stdout`] (a terminal merges both
//! streams, and turns `\n` into `\r\n` as a terminal does), its input comes from
//! [`crate::ExecOptions::stdin_stream`] (bytes as typed: `0x03` is Ctrl-C, `0x04` Ctrl-D), and its window size
//! is this handle's, which the caller changes while the job runs ([`Terminal::resize`]; the job's foreground
//! process gets `SIGWINCH`). Tiers without terminals answer [`crate::TierError::Unsupported`].

use std::fmt;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::sync::lock;

/// A terminal's window size in character cells. Zero means unknown, as the kernel has it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowSize {
    /// Rows.
    pub rows: u16,
    /// Columns.
    pub cols: u16,
}

impl Default for WindowSize {
    /// 24 rows of 80 columns, a terminal's traditional size.
    fn default() -> WindowSize {
        WindowSize { rows: 24, cols: 80 }
    }
}

impl fmt::Display for WindowSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}x{}", self.cols, self.rows)
    }
}

/// Applies a new window size to the job's terminal.
type Resizer = Box<dyn Fn(WindowSize) + Send>;

struct State {
    size: WindowSize,
    resizer: Option<Resizer>,
}

/// The terminal of one job: its window size, shared by the caller (who resizes it) and the tier running the job
/// (which applies each size to the terminal while the job runs). Cheap to clone; clones share the state.
#[derive(Clone)]
pub struct Terminal(Arc<Mutex<State>>);

impl fmt::Debug for Terminal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = lock(&self.0);
        f.debug_struct("Terminal").field("size", &state.size).field("attached", &state.resizer.is_some()).finish()
    }
}

impl Terminal {
    /// A terminal of `size`.
    pub fn new(size: WindowSize) -> Terminal {
        Terminal(Arc::new(Mutex::new(State { size, resizer: None })))
    }

    /// The current window size.
    pub fn size(&self) -> WindowSize {
        lock(&self.0).size
    }

    /// Changes the window size: applied at once to the running job's terminal, else when the job starts.
    pub fn resize(&self, size: WindowSize) {
        let mut state = lock(&self.0);
        state.size = size;
        if let Some(resizer) = &state.resizer {
            resizer(size);
        }
    }

    /// For a tier: applies every later [`Terminal::resize`] with `resizer` until [`Terminal::detach`], and
    /// returns the size now (which the tier gives the terminal it makes). No resize falls between the two.
    pub fn attach(&self, resizer: impl Fn(WindowSize) + Send + 'static) -> WindowSize {
        let mut state = lock(&self.0);
        state.resizer = Some(Box::new(resizer));
        state.size
    }

    /// For a tier: the job's terminal is gone; later sizes are only kept.
    pub fn detach(&self) {
        lock(&self.0).resizer = None;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

    use super::*;

    #[test]
    fn a_resize_reaches_the_attached_terminal_and_is_kept_after_it_detaches() {
        let terminal = Terminal::new(WindowSize { rows: 10, cols: 40 });
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = seen.clone();
        assert_eq!(terminal.attach(move |size| sink.lock().unwrap().push(size)), WindowSize { rows: 10, cols: 40 });
        terminal.resize(WindowSize { rows: 50, cols: 132 });
        terminal.detach();
        terminal.resize(WindowSize { rows: 1, cols: 2 });
        assert_eq!(*seen.lock().unwrap(), [WindowSize { rows: 50, cols: 132 }]);
        assert_eq!(terminal.size(), WindowSize { rows: 1, cols: 2 });
    }
}
