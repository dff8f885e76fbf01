//! Progress lines on stderr, with counted steps condensed.
//!
//! A long build reports every package it fetches, unpacks and configures (`debian image: unpacking libc6
//! (12/85)`): hundreds of lines. A line whose message ends in a counter, `(N)` or `(N/M)`, is a *step*: on a
//! terminal each step overwrites the last, so a phase is one updating line; elsewhere (a log, CI) a phase prints
//! its first step, then at most one every [`QUIET_EVERY`], then its last one when the next phase starts. Every
//! other line (a phase's start, a warning, an error) is printed whole, after ending an overwritten line.

use std::io::{IsTerminal, Write};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Off a terminal, how often a phase's steps print one line.
const QUIET_EVERY: Duration = Duration::from_secs(10);

/// What the last step printed was (or would have been).
struct State {
    tty: bool,
    /// A step line is on the terminal without its newline.
    open: bool,
    /// The phase of the last step, its last message and whether that message was printed.
    phase: Option<(String, String, bool)>,
    last_printed: Option<Instant>,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

/// The step counter at the end of `message`, `(12)` or `(12/85)`, and the phase it belongs to: the message
/// without its counter and its last word (`debian image: unpacking libc6 (12/85)` → `debian image: unpacking`).
fn phase_of(message: &str) -> Option<&str> {
    let body = message.strip_suffix(')')?;
    let (rest, counter) = body.rsplit_once(" (")?;
    let numeric = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let counted = match counter.split_once('/') {
        Some((done, total)) => numeric(done) && numeric(total),
        None => numeric(counter),
    };
    if !counted {
        return None;
    }
    Some(rest.rsplit_once(' ').map_or(rest, |(phase, _)| phase))
}

/// Prints `strata: MESSAGE` (or `strata: warning: MESSAGE`) on stderr, condensing steps.
pub(crate) fn line(message: &str, warning: bool) {
    let mut guard = STATE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let state = guard.get_or_insert_with(|| State {
        tty: std::io::stderr().is_terminal(),
        open: false,
        phase: None,
        last_printed: None,
    });
    let mut err = std::io::stderr().lock();
    let text = if warning { format!("strata: warning: {message}") } else { format!("strata: {message}") };
    let phase = if warning { None } else { phase_of(message) };
    match phase {
        Some(phase) if state.tty => {
            let _ = write!(err, "\r\x1b[K{text}");
            state.open = true;
            state.phase = Some((phase.to_owned(), text, true));
        }
        Some(phase) => {
            let same = state.phase.as_ref().is_some_and(|(p, _, _)| p == phase);
            if !same {
                finish_phase(state, &mut err);
            }
            let due = !same || state.last_printed.is_none_or(|at| at.elapsed() >= QUIET_EVERY);
            if due {
                let _ = writeln!(err, "{text}");
                state.last_printed = Some(Instant::now());
            }
            state.phase = Some((phase.to_owned(), text, due));
        }
        None => {
            finish_phase(state, &mut err);
            state.phase = None;
            let _ = writeln!(err, "{text}");
        }
    }
}

/// Forgets what is known of stderr (whether it is a terminal, an open step line): a warm daemon's job has the
/// client's stderr, not the daemon's.
pub(crate) fn reset() {
    *STATE.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
}

/// Prints `text` as it is on stderr, on a line of its own (after ending an overwritten step line).
pub(crate) fn plain(text: &str) {
    let mut guard = STATE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut err = std::io::stderr().lock();
    if let Some(state) = guard.as_mut() {
        finish_phase(state, &mut err);
    }
    let _ = writeln!(err, "{text}");
}

/// Ends the last phase: the terminal's open line gets its newline; off a terminal, its last step is printed
/// when it was not (so the count a phase ended at is always in the log).
fn finish_phase(state: &mut State, err: &mut impl Write) {
    if state.open {
        let _ = writeln!(err);
        state.open = false;
    } else if let Some((_, text, false)) = &state.phase {
        let _ = writeln!(err, "{text}");
    }
    state.phase = None;
}

#[cfg(test)]
mod tests {
    use super::phase_of;

    #[test]
    fn counted_steps_have_a_phase_and_other_lines_do_not() {
        assert_eq!(phase_of("debian image: unpacking libc6 (12/85)"), Some("debian image: unpacking"));
        assert_eq!(phase_of("debian image: retrieving libc6 (3)"), Some("debian image: retrieving"));
        assert_eq!(phase_of("still compiling python.wasm (15s)"), None);
        assert_eq!(phase_of("debian image: base system installed (85 packages)"), None);
        assert_eq!(phase_of("debian image: debootstrap bookworm (minbase, amd64, 9 extra packages) from x"), None);
        assert_eq!(phase_of("a (1/)"), None);
        assert_eq!(phase_of("(1)"), None);
    }
}
